//! The fake provider: a synchronous, in-memory model of a provider backend with
//! seeded fault injection and virtual latency.
//!
//! [`FakeProvider::execute`] applies an operation's effect to the model at call
//! time and says how long the call takes; the caller (an in-memory simulation, or
//! the async backend that wraps this) delivers the outcome after that latency.
//! Bootstrap sessions are schedules of stages; [`FakeProvider::due_observations`]
//! hands out the stages whose time has come. Nothing here reads a clock or uses a
//! global random source: `now` is an argument and every random choice comes from a
//! SplitMix64 stream seeded by [`FakeConfig::seed`], so one seed and one sequence
//! of calls always give the same outcomes.
//!
//! The model follows the backend rules of SPEC.md section 5: every request is
//! keyed on the resource identity, a create adopts an existing lease for its
//! identity before making one, and cancel and destroy treat "already absent" as
//! success. Ambiguous faults are real ambiguity: the effect happens with
//! probability one half, and the caller cannot tell which.
//!
//! # Day-2 faults: losses and sickness
//!
//! Besides the faults of calls, the provider's resources fail on their own
//! (SPEC.md section 8). Virtual time is cut into fault ticks, one every
//! [`FAULT_TICK`] of the clock (at its whole multiples, so the ticks do not
//! depend on when the provider was told the time). At each tick every live
//! resource, in identity order, is lost with probability
//! [`FaultRates::lose`]; one that stays and is sick heals with probability
//! [`FaultRates::heal`]; one that stays, is healthy and has its endpoint bound
//! sickens with probability [`FaultRates::sicken`]. [`FakeProvider::due_changes`]
//! rolls every tick up to the `now` it is given and returns what happened, for
//! the caller to report as a watching backend does: a loss through the
//! executor's change sink, a sickness through the probes that now fail
//! ([`FakeProvider::probe`]). The rolls draw from a SplitMix64 stream of their
//! own, seeded from the same seed, so switching them on does not shift the
//! outcomes of calls. Ticks that pass while the three rates are zero roll
//! nothing (they are not rolled later either), and a jump of the clock longer
//! than [`MAX_FAULT_TICKS`] ticks rolls only its last ones, so one call costs
//! at most that many rolls per resource.

use std::{
    collections::{BTreeMap, BTreeSet},
    ops::Bound,
    time::Duration,
};

use contract::{
    AttemptId, BootstrapStage, Endpoint, FieldError, LeaseId, LogicalNodeId, NodeTemplate, Operation,
    OperationInput, Outcome, ResourceIdentity, ResultFacts, RunUid, SessionId, UnixMillis, backoff::mix64,
};

/// Probabilities, each in `[0, 1]`, of the faults the fake injects. Rates of the
/// same call are exclusive alternatives (a create is retryable, permanent,
/// ambiguous or fine), so their sum should not exceed 1; values outside `[0, 1]`
/// are clamped and NaN counts as 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultRates {
    pub create_retryable: f64,
    pub create_permanent: f64,
    pub create_ambiguous: f64,
    pub lookup_error: f64,
    pub start_fail: f64,
    pub start_ambiguous: f64,
    /// A started session fails at a random stage.
    pub bootstrap_fail: f64,
    /// A started session stops emitting after a random stage and never converges.
    pub bootstrap_hang: f64,
    pub cancel_fail: f64,
    pub destroy_fail: f64,
    pub destroy_ambiguous: f64,
    /// Per live resource and fault tick: the resource is lost (its machine went
    /// away behind the executor's back).
    pub lose: f64,
    /// Per live, healthy resource with its endpoint bound, and fault tick: it
    /// stops answering its health probes.
    pub sicken: f64,
    /// Per sick resource and fault tick: it answers its probes again.
    pub heal: f64,
}

impl FaultRates {
    /// No faults at all.
    pub const fn none() -> Self {
        Self {
            create_retryable: 0.0,
            create_permanent: 0.0,
            create_ambiguous: 0.0,
            lookup_error: 0.0,
            start_fail: 0.0,
            start_ambiguous: 0.0,
            bootstrap_fail: 0.0,
            bootstrap_hang: 0.0,
            cancel_fail: 0.0,
            destroy_fail: 0.0,
            destroy_ambiguous: 0.0,
            lose: 0.0,
            sicken: 0.0,
            heal: 0.0,
        }
    }

    /// Whether any day-2 fault (loss, sickness, healing) can happen.
    pub fn has_day2(&self) -> bool {
        [self.lose, self.sicken, self.heal].iter().any(|r| *r > 0.0)
    }

    /// Frequent faults of every recoverable kind, and at modest rates the
    /// day-2 ones: a resource is lost about once in 200 seconds, sickens about
    /// once in 100 and, once sick, heals after 10 on average (so a group
    /// whose nodes go unhealthy for 2 seconds replaces most of them first).
    ///
    /// `create_permanent` stays 0: a permanent failure holds a node until its
    /// shape changes, so a simulation that stops faults and expects convergence
    /// (SPEC.md section 6, guarantee 18) could never get there. Tests of permanent
    /// failures set it, or use an image starting with `invalid`.
    pub const fn chaos() -> Self {
        Self {
            create_retryable: 0.1,
            create_permanent: 0.0,
            create_ambiguous: 0.1,
            lookup_error: 0.1,
            start_fail: 0.1,
            start_ambiguous: 0.1,
            bootstrap_fail: 0.1,
            bootstrap_hang: 0.05,
            cancel_fail: 0.1,
            destroy_fail: 0.1,
            destroy_ambiguous: 0.1,
            lose: 0.005,
            sicken: 0.01,
            heal: 0.1,
        }
    }
}

impl Default for FaultRates {
    fn default() -> Self {
        Self::none()
    }
}

/// Parses a latency flag, `MIN,MAX` milliseconds (or a single `N` for a
/// fixed latency), for the binaries that run the fake.
pub fn parse_latency(s: &str) -> Result<(u64, u64), String> {
    let number = |part: &str| {
        part.trim()
            .parse::<u64>()
            .map_err(|e| format!("{part:?} is not a number of milliseconds: {e}"))
    };
    let (min, max) = match s.split_once(',') {
        Some((min, max)) => (number(min)?, number(max)?),
        None => {
            let n = number(s)?;
            (n, n)
        }
    };
    if min > max {
        return Err(format!("the minimum {min} is above the maximum {max}"));
    }
    Ok((min, max))
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FakeConfig {
    pub seed: u64,
    pub faults: FaultRates,
    /// Minimum and maximum latency of one call, in milliseconds, uniform.
    pub latency_ms: (u64, u64),
    /// A lease's endpoint becomes ready this long after the lease is created.
    pub endpoint_delay_ms: u64,
    /// Time between consecutive bootstrap stages, and before the first.
    pub stage_interval_ms: u64,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            faults: FaultRates::none(),
            latency_ms: (1, 5),
            endpoint_delay_ms: 0,
            stage_interval_ms: 10,
        }
    }
}

/// The length of a day-2 fault tick (see the module documentation).
pub const FAULT_TICK: Duration = Duration::from_secs(1);
const FAULT_TICK_MS: u64 = 1_000;

/// The most fault ticks one [`FakeProvider::due_changes`] call rolls: an hour's.
pub const MAX_FAULT_TICKS: u64 = 3_600;

/// What happened to a resource on its own at a fault tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeChangeKind {
    /// The resource is gone: it left the inventory and its session stopped.
    Lost,
    /// It stopped answering its probes.
    Sickened,
    /// It answers its probes again.
    Healed,
}

/// A day-2 change of one resource, from [`FakeProvider::due_changes`].
#[derive(Debug, Clone, PartialEq)]
pub struct FakeChange {
    pub identity: ResourceIdentity,
    pub kind: FakeChangeKind,
    /// The fault tick it happened at.
    pub at: UnixMillis,
}

/// What a call did: its outcome is due `latency` after the call.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeCall {
    pub latency: Duration,
    pub outcome: Outcome,
}

/// One bootstrap stage reached by a session.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeObservation {
    pub identity: ResourceIdentity,
    pub session: SessionId,
    pub stage: BootstrapStage,
    pub detail: String,
    pub at: UnixMillis,
}

/// A live resource, as [`FakeProvider::inventory`] lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeResource {
    pub identity: ResourceIdentity,
    pub lease: LeaseId,
    /// Known once the endpoint is ready, as of the latest time the provider was
    /// told (see [`FakeProvider::inventory`]).
    pub endpoint: Option<Endpoint>,
    /// A bootstrap session exists on the lease (running or finished, but neither
    /// cancelled nor destroyed).
    pub session_live: bool,
}

/// One resource of a [`FakeSnapshot`].
#[derive(Debug, Clone, PartialEq)]
pub struct FakeSnapshotResource {
    pub identity: ResourceIdentity,
    pub lease: LeaseId,
    pub endpoint: Endpoint,
    /// When the endpoint is (or was) bound.
    pub ready_at: UnixMillis,
    /// The lease's bootstrap session, if one exists.
    pub session: Option<SessionId>,
    /// The session's whole stage plan (streamed again from the start after a
    /// restore, so its sequence numbers match the first streaming).
    pub stages: Vec<BootstrapStage>,
    /// The resource fails its probes (a sick machine stays sick across a
    /// restart of whoever watches it).
    pub sick: bool,
}

/// The provider's resources and id counters, as plain values, so that a caller
/// can keep them somewhere (a state file) and [`FakeProvider::restore`] them
/// into a new provider: leases and endpoints then outlive the process.
///
/// A session's remaining schedule of stages is not part of it: a restored
/// session is live but emits nothing more, as if its bootstrap hung. The driver
/// treats that as it treats any hung bootstrap (the stage deadline fails the
/// attempt and cleanup cancels the session). The random stream is not part of it
/// either: a restored provider restarts its stream from the seed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FakeSnapshot {
    pub resources: Vec<FakeSnapshotResource>,
    pub lease_counter: u64,
    pub session_counter: u64,
    /// The latest time the provider had been told.
    pub latest: UnixMillis,
}

/// SplitMix64: tiny, fast and good enough for fault injection; the fake owns its
/// stream, so no global or thread-local random state leaks in.
#[derive(Debug, Clone)]
struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

    fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    fn next_u64(&mut self) -> u64 {
        // `mix64` adds the golden gamma before finalising, so this is the
        // textbook SplitMix64 sequence.
        let out = mix64(self.state);
        self.state = self.state.wrapping_add(Self::GAMMA);
        out
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (0 when `n == 0`), by multiply-high to avoid modulo bias.
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi`, in either order.
    fn between(&mut self, a: u64, b: u64) -> u64 {
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        match (hi - lo).checked_add(1) {
            Some(span) => lo + self.below(span),
            None => self.next_u64(),
        }
    }

    fn coin(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }

    /// Picks one of exclusive alternatives with the given probabilities, or `None`
    /// (no fault) with the remaining probability. Always one draw, so the stream
    /// advances the same way whatever the rates.
    fn pick(&mut self, rates: &[f64]) -> Option<usize> {
        let u = self.unit();
        let mut acc = 0.0;
        for (i, rate) in rates.iter().enumerate() {
            acc += if rate.is_nan() { 0.0 } else { rate.clamp(0.0, 1.0) };
            if u < acc {
                return Some(i);
            }
        }
        None
    }
}

#[derive(Debug, Clone)]
struct FakeLease {
    id: LeaseId,
    endpoint: Endpoint,
    ready_at: UnixMillis,
}

/// A session's stage plan, packed: up to [`Plan::MAX`] stages of four bits
/// each (their place in [`BootstrapStage::ALL`]; `0xf` past the last), in
/// place of a vector the fake would hold for every node it bootstraps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Plan(u32);

impl Plan {
    const MAX: usize = 8;
    const END: u32 = 0xf;

    /// The plan of `stages`; stages past [`Plan::MAX`] are left out.
    fn of(stages: &[BootstrapStage]) -> Self {
        let mut codes = u32::MAX;
        for (i, stage) in stages.iter().take(Self::MAX).enumerate() {
            let code = BootstrapStage::ALL.iter().position(|s| s == stage).unwrap_or(0) as u32;
            codes &= !(Self::END << (4 * i));
            codes |= code << (4 * i);
        }
        Self(codes)
    }

    /// Stage `i` of the plan, if it has one.
    fn get(self, i: u8) -> Option<BootstrapStage> {
        let i = u32::from(i);
        if i as usize >= Self::MAX {
            return None;
        }
        let code = (self.0 >> (4 * i)) & Self::END;
        BootstrapStage::ALL.get(code as usize).copied()
    }

    fn stages(self) -> Vec<BootstrapStage> {
        (0..Self::MAX as u8).map_while(|i| self.get(i)).collect()
    }
}

/// Four words: the fake holds one for every node it bootstraps, in its
/// resources' table.
#[derive(Debug, Clone)]
struct FakeSession {
    id: SessionId,
    /// The next stage's time; the stages after it come one stage interval
    /// apart.
    next_at: UnixMillis,
    /// Every stage the session will stream, emitted or not, so that a restored
    /// session can stream it again from the start with the same sequence.
    plan: Plan,
    /// The next stage's place in the plan; [`FakeSession::DONE`] once every
    /// stage has gone, or the next one's time did not fit the clock.
    next: u8,
}

impl FakeSession {
    const DONE: u8 = u8::MAX;

    /// A session streaming `plan` from the start, its first stage one stage
    /// interval after `now`.
    fn new(id: SessionId, plan: Plan, now: UnixMillis, interval_ms: u64) -> Self {
        let mut session = Self {
            id,
            next_at: now,
            plan,
            next: Self::DONE,
        };
        session.set_next(session.after(0, now, interval_ms));
        session
    }

    /// The next stage to stream (its place in the plan) and its time.
    fn next(&self) -> Option<(u8, UnixMillis)> {
        (self.next != Self::DONE).then_some((self.next, self.next_at))
    }

    fn set_next(&mut self, next: Option<(u8, UnixMillis)>) {
        (self.next, self.next_at) = next.unwrap_or((Self::DONE, self.next_at));
    }

    /// Stage `i` and its time, one stage interval after `at`, if the plan has
    /// it and the time fits the clock.
    fn after(&self, i: u8, at: UnixMillis, interval_ms: u64) -> Option<(u8, UnixMillis)> {
        self.plan.get(i)?;
        at.checked_add(Duration::from_millis(interval_ms))
            .ok()
            .map(|t| (i, t))
    }
}

#[derive(Debug, Clone)]
struct FakeNode {
    lease: FakeLease,
    session: Option<FakeSession>,
}

// Nine words with the lease: a leaf of the resources' table (eleven of
// these beside their keys) then stays in a 1,536-byte allocation.
const _: () = assert!(std::mem::size_of::<FakeNode>() <= 9 * std::mem::size_of::<u64>());

/// A held resource's key: its identity, ordered by the run's uid, the attempt
/// and the node's index before any string. In identity order every key of a
/// run shares its run id, so each step of a lookup read two strings; in this
/// order a lookup compares integers until it reaches the identity itself.
/// (The executor probes every watched resource once per interval.)
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held(ResourceIdentity);

impl Held {
    fn of(identity: &ResourceIdentity) -> Self {
        Self(identity.clone())
    }
}

impl Ord for Held {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        let (a, b) = (&self.0, &other.0);
        a.run_uid
            .cmp(&b.run_uid)
            .then(a.attempt.cmp(&b.attempt))
            .then(a.node.index().cmp(&b.node.index()))
            .then_with(|| a.run_id.cmp(&b.run_id))
            .then_with(|| a.node.cmp(&b.node))
    }
}

impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// The in-memory provider; see the module documentation.
#[derive(Debug, Clone)]
pub struct FakeProvider {
    config: FakeConfig,
    rng: SplitMix64,
    /// The stream of the day-2 rolls, apart from the calls' stream.
    day2_rng: SplitMix64,
    /// The last fault tick rolled (or passed over); `None` until the provider
    /// is first asked for its changes.
    last_tick: Option<u64>,
    nodes: BTreeMap<Held, FakeNode>,
    /// The time of each session's next stage, so the next observation is found
    /// without scanning every node. One entry per session with stages left.
    agenda: BTreeSet<(UnixMillis, ResourceIdentity)>,
    /// The latest `now` the provider has been given; inventory reports endpoints
    /// ready as of then.
    latest: UnixMillis,
    lease_counter: u64,
    session_counter: u64,
    creates: u64,
    adoptions: u64,
    calls: u64,
    /// Resources whose probes fail (see [`FakeProvider::sicken`]).
    sick: BTreeSet<ResourceIdentity>,
}

const NO_SUCH_LEASE: &str = "no such lease";

/// Tells the day-2 stream's seed from the calls' stream's.
const DAY2_STREAM: u64 = 0xd2d2_5eed_f00d_fa17;

/// Turns a failure to build an id (which a well-formed counter never causes) into
/// a definite failure: nothing was created.
fn id_error(e: FieldError) -> Outcome {
    Outcome::Permanent {
        reason: format!("fake provider built an invalid id: {e}"),
    }
}

fn lease_facts(lease: &FakeLease, now: UnixMillis) -> ResultFacts {
    ResultFacts {
        lease: Some(lease.id.clone()),
        endpoint: (lease.ready_at <= now).then(|| lease.endpoint.clone()),
        session: None,
    }
}

fn session_facts(session: SessionId) -> ResultFacts {
    ResultFacts {
        session: Some(session),
        ..ResultFacts::default()
    }
}

impl FakeProvider {
    pub fn new(config: FakeConfig) -> Self {
        Self {
            rng: SplitMix64::new(config.seed),
            day2_rng: SplitMix64::new(mix64(config.seed ^ DAY2_STREAM)),
            last_tick: None,
            config,
            nodes: BTreeMap::new(),
            agenda: BTreeSet::new(),
            latest: UnixMillis::ZERO,
            lease_counter: 0,
            session_counter: 0,
            creates: 0,
            adoptions: 0,
            calls: 0,
            sick: BTreeSet::new(),
        }
    }

    pub fn config(&self) -> &FakeConfig {
        &self.config
    }

    /// Changes the fault rates from the next call on, e.g. to stop faults and
    /// check that a run converges.
    pub fn set_faults(&mut self, faults: FaultRates) {
        self.config.faults = faults;
    }

    /// Applies `op`'s effect to the model now; the outcome is due after the
    /// returned latency.
    pub fn execute(&mut self, op: &Operation, now: UnixMillis) -> FakeCall {
        self.calls += 1;
        self.latest = self.latest.max(now);
        let (lo, hi) = self.config.latency_ms;
        let latency = Duration::from_millis(self.rng.between(lo, hi));
        let identity = op.identity();
        let outcome = match &op.input {
            OperationInput::CreateLease { template } => self.create(identity, template, now),
            OperationInput::LookupEndpoint { lease } => self.lookup(&identity, lease, now),
            OperationInput::StartBootstrap { lease, .. } => self.start(identity, lease, now),
            OperationInput::CancelBootstrap { .. } => self.cancel(&identity),
            OperationInput::DestroyLease { .. } => self.destroy(&identity),
        };
        FakeCall {
            latency,
            outcome: outcome.unwrap_or_else(|definite| definite),
        }
    }

    fn create(
        &mut self,
        identity: ResourceIdentity,
        template: &NodeTemplate,
        now: UnixMillis,
    ) -> Result<Outcome, Outcome> {
        if let Some(node) = self.nodes.get(&Held::of(&identity)) {
            self.adoptions += 1;
            return Ok(Outcome::Succeeded(lease_facts(&node.lease, now)));
        }
        if template.image.starts_with("invalid") {
            return Ok(Outcome::Permanent {
                reason: format!("invalid image {:?}", template.image),
            });
        }
        let f = self.config.faults;
        match self
            .rng
            .pick(&[f.create_retryable, f.create_permanent, f.create_ambiguous])
        {
            Some(0) => Ok(Outcome::Retryable {
                reason: "injected: capacity temporarily unavailable".to_owned(),
            }),
            Some(1) => Ok(Outcome::Permanent {
                reason: "injected: quota refused".to_owned(),
            }),
            Some(_) => {
                if self.rng.coin() {
                    self.make_lease(identity, now)?;
                }
                Ok(Outcome::Ambiguous {
                    reason: "injected: the create timed out; the lease may exist".to_owned(),
                })
            }
            None => {
                let lease = self.make_lease(identity, now)?;
                Ok(Outcome::Succeeded(lease_facts(&lease, now)))
            }
        }
    }

    fn make_lease(&mut self, identity: ResourceIdentity, now: UnixMillis) -> Result<FakeLease, Outcome> {
        let n = self.lease_counter + 1;
        let id = LeaseId::new("lease", &format!("lease-{n}")).map_err(id_error)?;
        let address = format!("10.{}.{}.{}:22", (n >> 16) & 0xff, (n >> 8) & 0xff, n & 0xff);
        let endpoint = Endpoint::new("endpoint", &address).map_err(id_error)?;
        // A saturated clock means "never": such an endpoint is simply never ready.
        let ready_at = now
            .checked_add(Duration::from_millis(self.config.endpoint_delay_ms))
            .unwrap_or(UnixMillis::MAX);
        let lease = FakeLease {
            id,
            endpoint,
            ready_at,
        };
        self.lease_counter = n;
        self.creates += 1;
        self.insert_node(
            identity,
            FakeNode {
                lease: lease.clone(),
                session: None,
            },
        );
        Ok(lease)
    }

    fn lookup(
        &mut self,
        identity: &ResourceIdentity,
        lease: &LeaseId,
        now: UnixMillis,
    ) -> Result<Outcome, Outcome> {
        let no_such_lease = || Outcome::Retryable {
            reason: NO_SUCH_LEASE.to_owned(),
        };
        let Some(node) = self.nodes.get(&Held::of(identity)) else {
            return Ok(no_such_lease());
        };
        // Requests are keyed on identity; a lease id that does not match the
        // identity's lease names something this provider does not hold.
        if node.lease.id != *lease {
            return Ok(no_such_lease());
        }
        let ready_at = node.lease.ready_at;
        let endpoint = node.lease.endpoint.clone();
        if self.rng.pick(&[self.config.faults.lookup_error]).is_some() {
            return Ok(Outcome::Retryable {
                reason: "injected: the provider API returned an error".to_owned(),
            });
        }
        if now < ready_at {
            return Ok(Outcome::NotReady {
                reason: "the endpoint is not bound yet".to_owned(),
            });
        }
        Ok(Outcome::Succeeded(ResultFacts {
            lease: Some(lease.clone()),
            endpoint: Some(endpoint),
            session: None,
        }))
    }

    fn start(
        &mut self,
        identity: ResourceIdentity,
        lease: &LeaseId,
        now: UnixMillis,
    ) -> Result<Outcome, Outcome> {
        // As in `lookup`, a lease id other than the identity's names nothing here.
        let Some(node) = self
            .nodes
            .get(&Held::of(&identity))
            .filter(|n| n.lease.id == *lease)
        else {
            return Ok(Outcome::Retryable {
                reason: NO_SUCH_LEASE.to_owned(),
            });
        };
        if let Some(session) = &node.session {
            self.adoptions += 1;
            return Ok(Outcome::Succeeded(session_facts(session.id.clone())));
        }
        let f = self.config.faults;
        match self.rng.pick(&[f.start_fail, f.start_ambiguous]) {
            Some(0) => Ok(Outcome::Retryable {
                reason: "injected: could not reach the node to start the bootstrap".to_owned(),
            }),
            Some(_) => {
                if self.rng.coin() {
                    self.start_session(identity, now)?;
                }
                Ok(Outcome::Ambiguous {
                    reason: "injected: the start timed out; the session may be running".to_owned(),
                })
            }
            None => {
                let session = self.start_session(identity, now)?;
                Ok(Outcome::Succeeded(session_facts(session)))
            }
        }
    }

    /// Creates a session and schedules its stages. The fail roll comes first; a
    /// session that fails does not also roll for a hang.
    fn start_session(&mut self, identity: ResourceIdentity, now: UnixMillis) -> Result<SessionId, Outcome> {
        let n = self.session_counter + 1;
        let id = SessionId::new("session", &format!("sess-{n}")).map_err(id_error)?;
        let mut stages = BootstrapStage::PROGRESS.to_vec();
        let f = self.config.faults;
        if self.rng.pick(&[f.bootstrap_fail]).is_some() {
            // Any stage before convergence can fail; the failure ends the session.
            let at = self.rng.below(4) as usize;
            stages[at] = stages[at].failure();
            stages.truncate(at + 1);
        } else if self.rng.pick(&[f.bootstrap_hang]).is_some() {
            // A hung session gets at least as far as connecting, never converges.
            let last = self.rng.below(4) as usize;
            stages.truncate(last + 1);
        }
        let session = FakeSession::new(id.clone(), Plan::of(&stages), now, self.config.stage_interval_ms);
        let Some(node) = self.nodes.get_mut(&Held::of(&identity)) else {
            return Err(Outcome::Retryable {
                reason: NO_SUCH_LEASE.to_owned(),
            });
        };
        if let Some((_, first)) = session.next() {
            self.agenda.insert((first, identity));
        }
        node.session = Some(session);
        self.session_counter = n;
        Ok(id)
    }

    fn cancel(&mut self, identity: &ResourceIdentity) -> Result<Outcome, Outcome> {
        if self.rng.pick(&[self.config.faults.cancel_fail]).is_some() {
            return Ok(Outcome::Retryable {
                reason: "injected: the cancel request failed".to_owned(),
            });
        }
        self.remove_session(identity);
        Ok(Outcome::Succeeded(ResultFacts::default()))
    }

    fn destroy(&mut self, identity: &ResourceIdentity) -> Result<Outcome, Outcome> {
        let f = self.config.faults;
        match self.rng.pick(&[f.destroy_fail, f.destroy_ambiguous]) {
            Some(0) => Ok(Outcome::Retryable {
                reason: "injected: the destroy request failed".to_owned(),
            }),
            Some(_) => {
                if self.rng.coin() {
                    self.remove_node(identity);
                }
                Ok(Outcome::Ambiguous {
                    reason: "injected: the destroy timed out; the lease may still exist".to_owned(),
                })
            }
            None => {
                self.remove_node(identity);
                Ok(Outcome::Succeeded(ResultFacts::default()))
            }
        }
    }

    fn remove_session(&mut self, identity: &ResourceIdentity) {
        let Some(session) = self
            .nodes
            .get_mut(&Held::of(identity))
            .and_then(|n| n.session.take())
        else {
            return;
        };
        if let Some((_, at)) = session.next() {
            self.agenda.remove(&(at, identity.clone()));
        }
    }

    fn insert_node(&mut self, identity: ResourceIdentity, node: FakeNode) {
        self.nodes.insert(Held(identity), node);
    }

    fn remove_node(&mut self, identity: &ResourceIdentity) {
        self.remove_session(identity);
        self.nodes.remove(&Held::of(identity));
        self.sick.remove(identity);
    }

    /// Loses the resource of `identity` behind the executor's back (its
    /// machine went away), for tests: it leaves the inventory and its session
    /// stops. Returns whether there was one.
    pub fn lose(&mut self, identity: &ResourceIdentity) -> bool {
        let held = self.holds(identity);
        self.remove_node(identity);
        held
    }

    /// Makes the resource of `identity` fail its health probes until
    /// [`FakeProvider::heal`], for tests. Returns whether there is one.
    pub fn sicken(&mut self, identity: &ResourceIdentity) -> bool {
        let held = self.holds(identity);
        if held {
            self.sick.insert(identity.clone());
        }
        held
    }

    /// The resource of `identity` answers its probes again. Returns whether
    /// it was sick.
    pub fn heal(&mut self, identity: &ResourceIdentity) -> bool {
        self.sick.remove(identity)
    }

    /// Whether the provider holds a resource for `identity`.
    pub fn holds(&self, identity: &ResourceIdentity) -> bool {
        self.nodes.contains_key(&Held::of(identity))
    }

    /// Whether the resource of `identity` fails its probes.
    pub fn is_sick(&self, identity: &ResourceIdentity) -> bool {
        self.sick.contains(identity)
    }

    /// The identity of the resource held for `(run_uid, node, attempt)`, if
    /// there is one (an identity also names its run id, which a caller that
    /// knows the run by uid need not know).
    pub fn find(
        &self,
        run_uid: RunUid,
        node: &LogicalNodeId,
        attempt: AttemptId,
    ) -> Option<ResourceIdentity> {
        self.nodes
            .keys()
            .map(|held| &held.0)
            .find(|id| id.run_uid == run_uid && id.node == *node && id.attempt == attempt)
            .cloned()
    }

    /// Rolls the day-2 faults of every fault tick up to `now` (see the module
    /// documentation) and returns what happened, in tick order. A lost
    /// resource is already gone from the provider when this returns.
    pub fn due_changes(&mut self, now: UnixMillis) -> Vec<FakeChange> {
        self.latest = self.latest.max(now);
        let tick = now.as_millis() / FAULT_TICK_MS;
        let Some(last) = self.last_tick else {
            self.last_tick = Some(tick);
            return Vec::new();
        };
        if tick <= last {
            return Vec::new();
        }
        self.last_tick = Some(tick);
        let f = self.config.faults;
        if !f.has_day2() {
            return Vec::new();
        }
        let first = (last + 1).max(tick.saturating_sub(MAX_FAULT_TICKS - 1));
        let mut out = Vec::new();
        for k in first..=tick {
            let at = UnixMillis::new(k.saturating_mul(FAULT_TICK_MS));
            let live: Vec<(ResourceIdentity, bool)> = self
                .nodes
                .iter()
                .map(|(held, n)| (held.0.clone(), n.lease.ready_at <= at))
                .collect();
            for (identity, bound) in live {
                let kind = if self.day2_rng.pick(&[f.lose]).is_some() {
                    self.lose(&identity);
                    Some(FakeChangeKind::Lost)
                } else if self.sick.contains(&identity) {
                    let heals = self.day2_rng.pick(&[f.heal]).is_some();
                    heals.then(|| {
                        self.sick.remove(&identity);
                        FakeChangeKind::Healed
                    })
                } else if bound && self.day2_rng.pick(&[f.sicken]).is_some() {
                    self.sick.insert(identity.clone());
                    Some(FakeChangeKind::Sickened)
                } else {
                    None
                };
                if let Some(kind) = kind {
                    out.push(FakeChange { identity, kind, at });
                }
            }
        }
        out
    }

    /// Starts counting fault ticks from `now`, if they are not counted yet:
    /// the first tick rolled is the next one after `now`.
    pub fn start_ticks(&mut self, now: UnixMillis) {
        self.latest = self.latest.max(now);
        if self.last_tick.is_none() {
            self.last_tick = Some(now.as_millis() / FAULT_TICK_MS);
        }
    }

    /// When the next fault tick may change something: `None` while the
    /// day-2 rates are zero or the provider holds nothing.
    pub fn next_change_at(&self) -> Option<UnixMillis> {
        if !self.config.faults.has_day2() || self.nodes.is_empty() {
            return None;
        }
        let next = match self.last_tick {
            Some(t) => t.saturating_add(1),
            None => self.latest.as_millis() / FAULT_TICK_MS + 1,
        };
        Some(UnixMillis::new(next.saturating_mul(FAULT_TICK_MS)))
    }

    /// A health probe of the resource: it must exist and not be sick.
    pub fn probe(&self, identity: &ResourceIdentity) -> Result<(), String> {
        if !self.holds(identity) {
            return Err("no such resource".to_owned());
        }
        if self.sick.contains(identity) {
            return Err("the resource does not answer its probe".to_owned());
        }
        Ok(())
    }

    /// When the next bootstrap stage is due, if any session has one left.
    pub fn next_observation_at(&self) -> Option<UnixMillis> {
        self.agenda.first().map(|(at, _)| *at)
    }

    /// Every bootstrap stage due at or before `now`, by time then identity, each
    /// session's stages in order.
    pub fn due_observations(&mut self, now: UnixMillis) -> Vec<FakeObservation> {
        self.latest = self.latest.max(now);
        let mut out = Vec::new();
        while let Some((at, identity)) = self.agenda.first().cloned() {
            if at > now {
                break;
            }
            self.agenda.pop_first();
            let interval = self.config.stage_interval_ms;
            let Some(session) = self
                .nodes
                .get_mut(&Held::of(&identity))
                .and_then(|n| n.session.as_mut())
            else {
                continue;
            };
            let Some((i, at)) = session.next() else {
                continue;
            };
            let Some(stage) = session.plan.get(i) else {
                continue;
            };
            // A stage whose time does not fit the clock never comes: the
            // schedule ends there rather than wrapping.
            session.set_next(session.after(i + 1, at, interval));
            if let Some((_, next)) = session.next() {
                self.agenda.insert((next, identity.clone()));
            }
            out.push(FakeObservation {
                session: session.id.clone(),
                detail: format!("fake: {} on {}", stage.name(), identity.node),
                identity,
                stage,
                at,
            });
        }
        out
    }

    /// Every live resource, by run uid, then attempt, then node. Endpoints are reported ready as of the
    /// latest `now` the provider was given, since listing takes no time argument.
    pub fn inventory(&self) -> Vec<FakeResource> {
        self.nodes
            .iter()
            .map(|(held, node)| self.resource(held, node))
            .collect()
    }

    /// The live resources of run `run_uid`, as [`FakeProvider::inventory`]
    /// lists them. Only that run's are copied: the resources are in run uid
    /// order.
    pub fn inventory_of(&self, run_uid: RunUid) -> Vec<FakeResource> {
        self.nodes
            .iter()
            .skip_while(|(held, _)| held.0.run_uid < run_uid)
            .take_while(|(held, _)| held.0.run_uid == run_uid)
            .map(|(held, node)| self.resource(held, node))
            .collect()
    }

    /// At most `limit` live resources, in the order of
    /// [`FakeProvider::inventory`], from the first past `after` (from the
    /// first of all without it). Reading every resource this way, each page
    /// after the last one's final identity, lists a resource that lives
    /// through the read exactly once.
    pub fn inventory_after(&self, after: Option<&ResourceIdentity>, limit: usize) -> Vec<FakeResource> {
        let from = match after {
            Some(identity) => Bound::Excluded(Held::of(identity)),
            None => Bound::Unbounded,
        };
        self.nodes
            .range((from, Bound::Unbounded))
            .take(limit)
            .map(|(held, node)| self.resource(held, node))
            .collect()
    }

    fn resource(&self, Held(identity): &Held, node: &FakeNode) -> FakeResource {
        FakeResource {
            identity: identity.clone(),
            lease: node.lease.id.clone(),
            endpoint: (node.lease.ready_at <= self.latest).then(|| node.lease.endpoint.clone()),
            session_live: node.session.is_some(),
        }
    }

    /// Tells the provider the time without doing anything else, so that
    /// [`FakeProvider::inventory`] reports endpoints ready as of `now`.
    pub fn advance(&mut self, now: UnixMillis) {
        self.latest = self.latest.max(now);
    }

    /// Whether the identity has a session with stages still to come: whoever
    /// delivers its observations needs to keep a way to deliver them.
    pub fn is_emitting(&self, identity: &ResourceIdentity) -> bool {
        self.nodes
            .get(&Held::of(identity))
            .and_then(|n| n.session.as_ref())
            .is_some_and(|s| s.next().is_some())
    }

    /// The resources and counters, for [`FakeProvider::restore`].
    pub fn snapshot(&self) -> FakeSnapshot {
        FakeSnapshot {
            resources: self
                .nodes
                .iter()
                .map(|(Held(identity), node)| FakeSnapshotResource {
                    identity: identity.clone(),
                    lease: node.lease.id.clone(),
                    endpoint: node.lease.endpoint.clone(),
                    ready_at: node.lease.ready_at,
                    session: node.session.as_ref().map(|s| s.id.clone()),
                    stages: node.session.as_ref().map(|s| s.plan.stages()).unwrap_or_default(),
                    sick: self.sick.contains(identity),
                })
                .collect(),
            lease_counter: self.lease_counter,
            session_counter: self.session_counter,
            latest: self.latest,
        }
    }

    /// A provider with `config` holding a snapshot's resources. A restored
    /// session streams its whole stage plan again from the snapshot's time, as an
    /// agent that the executor reattaches to would: the driver discards the
    /// stages it already folded (same sequence numbers) and folds the rest. The
    /// counters continue from the snapshot's, so new ids do not repeat.
    pub fn restore(config: FakeConfig, snapshot: FakeSnapshot) -> Self {
        let mut provider = Self::new(config);
        provider.lease_counter = snapshot.lease_counter;
        provider.session_counter = snapshot.session_counter;
        provider.latest = snapshot.latest;
        let interval = provider.config.stage_interval_ms;
        for r in snapshot.resources {
            let plan = Plan::of(&r.stages);
            let session = r
                .session
                .map(|id| FakeSession::new(id, plan, snapshot.latest, interval));
            if let Some((_, first)) = session.as_ref().and_then(FakeSession::next) {
                provider.agenda.insert((first, r.identity.clone()));
            }
            if r.sick {
                provider.sick.insert(r.identity.clone());
            }
            provider.insert_node(
                r.identity,
                FakeNode {
                    lease: FakeLease {
                        id: r.lease,
                        endpoint: r.endpoint,
                        ready_at: r.ready_at,
                    },
                    session,
                },
            );
        }
        provider
    }

    /// Live leases of one run: zero after a run is scaled to zero or deleted, or
    /// something leaked.
    pub fn live_resources(&self, run_uid: RunUid) -> usize {
        self.nodes.keys().filter(|held| held.0.run_uid == run_uid).count()
    }

    /// Leases actually made (adoptions excluded).
    pub fn creates(&self) -> u64 {
        self.creates
    }

    /// Creates and starts that found an existing resource and returned it.
    pub fn adoptions(&self) -> u64 {
        self.adoptions
    }

    /// Calls to [`FakeProvider::execute`].
    pub fn calls(&self) -> u64 {
        self.calls
    }
}

// Tests panic on purpose when a fixture is malformed or an expectation fails.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use contract::{Epoch, OperationId, Params, RunId, TraceContext, shape::example_template};

    use super::*;

    const RUN: RunUid = RunUid::from_u128(9);

    fn t(ms: u64) -> UnixMillis {
        UnixMillis::new(ms)
    }

    fn op(attempt: u64, seq: u32, input: OperationInput) -> Operation {
        Operation {
            run_uid: RUN,
            run_id: RunId::parse("run_id", "train").unwrap(),
            node: LogicalNodeId::parse("node", &format!("workers-{attempt}")).unwrap(),
            id: OperationId::new(AttemptId::new(attempt), seq),
            epoch: Epoch::new(1),
            deadline: t(1_000_000),
            provider: "fake".into(),
            input,
            trace: TraceContext::default(),
        }
    }

    fn create_image(attempt: u64, image: &str) -> Operation {
        op(
            attempt,
            0,
            OperationInput::CreateLease {
                template: Arc::new(example_template("fake", image)),
            },
        )
    }

    fn create(attempt: u64) -> Operation {
        create_image(attempt, "img:1")
    }

    fn lookup(attempt: u64, lease: &LeaseId) -> Operation {
        op(
            attempt,
            1,
            OperationInput::LookupEndpoint { lease: lease.clone() },
        )
    }

    fn start(attempt: u64, lease: &LeaseId) -> Operation {
        op(
            attempt,
            2,
            OperationInput::StartBootstrap {
                lease: lease.clone(),
                endpoint: Endpoint::new("endpoint", "10.0.0.1:22").unwrap(),
                boot: Params::new(),
                join: Params::new(),
            },
        )
    }

    fn cancel(attempt: u64) -> Operation {
        op(attempt, 3, OperationInput::CancelBootstrap { session: None })
    }

    fn destroy(attempt: u64) -> Operation {
        op(attempt, 4, OperationInput::DestroyLease { lease: None })
    }

    fn facts(call: &FakeCall) -> &ResultFacts {
        match &call.outcome {
            Outcome::Succeeded(f) => f,
            other => panic!("expected success, got {other:?}"),
        }
    }

    fn provider(config: FakeConfig) -> FakeProvider {
        FakeProvider::new(config)
    }

    /// Creates and starts a bootstrap on a fresh identity, without faults.
    fn started(p: &mut FakeProvider, attempt: u64, now: UnixMillis) -> SessionId {
        let created = p.execute(&create(attempt), now);
        let lease = facts(&created).lease.clone().unwrap();
        let call = p.execute(&start(attempt, &lease), now);
        facts(&call).session.clone().unwrap()
    }

    #[test]
    fn an_ambiguous_create_is_adopted_by_the_next_one() {
        let mut p = provider(FakeConfig {
            faults: FaultRates {
                create_ambiguous: 1.0,
                ..FaultRates::none()
            },
            ..FakeConfig::default()
        });
        for attempt in 1..=20 {
            let call = p.execute(&create(attempt), t(0));
            assert!(matches!(call.outcome, Outcome::Ambiguous { .. }), "{call:?}");
        }
        let made: BTreeMap<u64, LeaseId> = p
            .inventory()
            .into_iter()
            .map(|r| (r.identity.attempt.get(), r.lease))
            .collect();
        // Half-done creates really are half done: some made a lease, some did not.
        assert!(!made.is_empty() && made.len() < 20, "{made:?}");
        assert_eq!(p.creates(), made.len() as u64);

        p.set_faults(FaultRates::none());
        for attempt in 1..=20 {
            let creates = p.creates();
            let call = p.execute(&create(attempt), t(1));
            let lease = facts(&call).lease.clone().unwrap();
            match made.get(&attempt) {
                Some(existing) => {
                    assert_eq!(&lease, existing);
                    assert_eq!(p.creates(), creates);
                }
                None => assert_eq!(p.creates(), creates + 1),
            }
        }
        assert_eq!(p.adoptions(), made.len() as u64);
        // Never two resources for one identity.
        assert_eq!(p.live_resources(RUN), 20);
    }

    #[test]
    fn destroying_or_cancelling_what_is_absent_succeeds() {
        let mut p = provider(FakeConfig::default());
        assert!(matches!(
            p.execute(&destroy(1), t(0)).outcome,
            Outcome::Succeeded(_)
        ));
        assert!(matches!(
            p.execute(&cancel(1), t(0)).outcome,
            Outcome::Succeeded(_)
        ));

        let _ = started(&mut p, 2, t(0));
        assert!(p.inventory()[0].session_live);
        assert!(matches!(
            p.execute(&destroy(2), t(1)).outcome,
            Outcome::Succeeded(_)
        ));
        assert_eq!(p.live_resources(RUN), 0);
        assert!(matches!(
            p.execute(&destroy(2), t(2)).outcome,
            Outcome::Succeeded(_)
        ));
        // The destroyed session emits nothing more.
        assert_eq!(p.next_observation_at(), None);
        assert!(p.due_observations(t(1_000)).is_empty());
    }

    #[test]
    fn the_endpoint_is_not_ready_until_its_delay_passes() {
        let mut p = provider(FakeConfig {
            endpoint_delay_ms: 100,
            ..FakeConfig::default()
        });
        let created = p.execute(&create(1), t(1_000));
        let lease = facts(&created).lease.clone().unwrap();
        assert_eq!(facts(&created).endpoint, None);
        assert!(matches!(
            p.execute(&lookup(1, &lease), t(1_099)).outcome,
            Outcome::NotReady { .. }
        ));
        assert_eq!(p.inventory()[0].endpoint, None);
        let ready = p.execute(&lookup(1, &lease), t(1_100));
        let endpoint = facts(&ready).endpoint.clone().unwrap();
        assert!(endpoint.as_str().starts_with("10."), "{endpoint}");
        assert_eq!(p.inventory()[0].endpoint, Some(endpoint));
        // With no delay the create reports the endpoint itself.
        let mut quick = provider(FakeConfig::default());
        assert!(facts(&quick.execute(&create(1), t(0))).endpoint.is_some());
        // A lookup for an identity without a lease is a retryable failure.
        assert!(matches!(
            p.execute(&lookup(2, &lease), t(2_000)).outcome,
            Outcome::Retryable { .. }
        ));
    }

    #[test]
    fn bootstrap_stages_come_out_in_order_at_their_times() {
        let mut p = provider(FakeConfig {
            stage_interval_ms: 10,
            ..FakeConfig::default()
        });
        let session = started(&mut p, 1, t(1_000));
        assert_eq!(p.next_observation_at(), Some(t(1_010)));
        assert!(p.due_observations(t(1_009)).is_empty());

        let first = p.due_observations(t(1_020));
        let second = p.due_observations(t(5_000));
        let got: Vec<_> = first
            .iter()
            .chain(&second)
            .map(|o| (o.at.as_millis(), o.stage))
            .collect();
        assert_eq!(first.len(), 2);
        assert_eq!(
            got,
            [
                (1_010, BootstrapStage::Connected),
                (1_020, BootstrapStage::BootCheck),
                (1_030, BootstrapStage::AgentStarted),
                (1_040, BootstrapStage::Joined),
                (1_050, BootstrapStage::Converged),
            ]
        );
        assert!(first.iter().chain(&second).all(|o| o.session == session));
        assert_eq!(p.next_observation_at(), None);

        // Starting again adopts the session rather than making another.
        let lease = p.inventory()[0].lease.clone();
        let again = p.execute(&start(1, &lease), t(6_000));
        assert_eq!(facts(&again).session.as_ref(), Some(&session));
        assert_eq!(p.adoptions(), 1);
    }

    #[test]
    fn a_failure_stage_ends_the_session() {
        let mut p = provider(FakeConfig {
            faults: FaultRates {
                bootstrap_fail: 1.0,
                ..FaultRates::none()
            },
            ..FakeConfig::default()
        });
        let mut failed_stages = BTreeSet::new();
        for attempt in 1..=30 {
            let _ = started(&mut p, attempt, t(0));
        }
        let all = p.due_observations(t(10_000));
        for attempt in 1..=30 {
            let stages: Vec<_> = all
                .iter()
                .filter(|o| o.identity.attempt.get() == attempt)
                .map(|o| o.stage)
                .collect();
            let (last, before) = stages.split_last().unwrap();
            assert!(last.is_failure(), "{stages:?}");
            assert!(!before.iter().any(|s| s.is_terminal()));
            failed_stages.insert(*last);
        }
        assert!(failed_stages.len() > 1, "failures should land on several stages");
        assert_eq!(p.next_observation_at(), None);
    }

    #[test]
    fn a_hung_session_never_converges() {
        let mut p = provider(FakeConfig {
            faults: FaultRates {
                bootstrap_hang: 1.0,
                ..FaultRates::none()
            },
            ..FakeConfig::default()
        });
        for attempt in 1..=10 {
            let _ = started(&mut p, attempt, t(0));
        }
        let all = p.due_observations(UnixMillis::MAX);
        assert!(!all.is_empty());
        assert!(
            all.iter()
                .all(|o| !o.stage.is_failure() && o.stage != BootstrapStage::Converged)
        );
        assert_eq!(p.next_observation_at(), None);
    }

    #[test]
    fn a_cancelled_session_emits_nothing_more() {
        let mut p = provider(FakeConfig::default());
        let _ = started(&mut p, 1, t(0));
        assert_eq!(p.due_observations(t(10)).len(), 1);
        assert!(matches!(
            p.execute(&cancel(1), t(11)).outcome,
            Outcome::Succeeded(_)
        ));
        assert_eq!(p.next_observation_at(), None);
        assert!(p.due_observations(t(1_000)).is_empty());
        assert!(!p.inventory()[0].session_live);
        assert_eq!(p.live_resources(RUN), 1);
    }

    #[test]
    fn a_restored_provider_keeps_leases_and_adopts_them() {
        let mut p = provider(FakeConfig {
            endpoint_delay_ms: 100,
            ..FakeConfig::default()
        });
        let made = facts(&p.execute(&create(1), t(1_000))).lease.clone().unwrap();
        let session = started(&mut p, 2, t(1_000));
        assert!(p.is_emitting(&create(2).identity()));
        let snapshot = p.snapshot();
        assert_eq!(snapshot.resources.len(), 2);

        let mut q = FakeProvider::restore(*p.config(), snapshot.clone());
        assert_eq!(q.snapshot(), snapshot);
        // A restored session streams its whole plan again, from the start.
        assert!(q.is_emitting(&create(2).identity()));
        assert!(q.next_observation_at().is_some());
        let again: Vec<_> = q
            .clone()
            .due_observations(t(1_000_000))
            .into_iter()
            .map(|o| o.stage)
            .collect();
        assert_eq!(again, BootstrapStage::PROGRESS);
        assert!(q.inventory()[1].session_live);
        // The endpoint is ready once the provider is told the time.
        assert_eq!(q.inventory()[0].endpoint, None);
        q.advance(t(1_100));
        assert!(q.inventory()[0].endpoint.is_some());

        let adopted = q.execute(&create(1), t(2_000));
        assert_eq!(facts(&adopted).lease.as_ref(), Some(&made));
        assert_eq!((q.creates(), q.adoptions()), (0, 1));
        let fresh = facts(&q.execute(&create(3), t(2_000))).lease.clone().unwrap();
        assert!(q.inventory().iter().filter(|r| r.lease == fresh).count() == 1);
        let lease2 = q.inventory()[1].lease.clone();
        let again = q.execute(&start(2, &lease2), t(2_000));
        assert_eq!(facts(&again).session.as_ref(), Some(&session));
    }

    #[test]
    fn an_invalid_image_fails_permanently_and_creates_nothing() {
        let mut p = provider(FakeConfig::default());
        let call = p.execute(&create_image(1, "invalid:latest"), t(0));
        assert!(matches!(call.outcome, Outcome::Permanent { .. }), "{call:?}");
        assert_eq!(p.creates(), 0);
        assert_eq!(p.live_resources(RUN), 0);
    }

    #[test]
    fn one_runs_inventory_is_the_inventory_of_that_run() {
        let mut p = FakeProvider::new(FakeConfig::default());
        for (uid, attempts) in [(8u128, 1..=3u64), (9, 4..=6), (10, 7..=9)] {
            for attempt in attempts {
                let create = Operation {
                    run_uid: RunUid::from_u128(uid),
                    ..create(attempt)
                };
                assert!(matches!(p.execute(&create, t(0)).outcome, Outcome::Succeeded(_)));
            }
        }
        let every = p.inventory();
        assert_eq!(every.len(), 9);
        for uid in [7u128, 8, 9, 10, 11] {
            let run_uid = RunUid::from_u128(uid);
            let expected: Vec<FakeResource> = every
                .iter()
                .filter(|r| r.identity.run_uid == run_uid)
                .cloned()
                .collect();
            assert_eq!(p.inventory_of(run_uid), expected, "run {uid}");
        }
        assert_eq!(p.inventory_of(RunUid::from_u128(9)).len(), 3);
    }

    #[test]
    fn a_plan_keeps_its_stages_in_order() {
        // Every stage has a code of its own, in any place of a plan.
        for every in [
            &BootstrapStage::ALL[..Plan::MAX],
            &BootstrapStage::ALL[BootstrapStage::ALL.len() - Plan::MAX..],
        ] {
            let backwards: Vec<BootstrapStage> = every.iter().rev().copied().collect();
            assert_eq!(Plan::of(every).stages(), every);
            assert_eq!(Plan::of(&backwards).stages(), backwards);
        }
        let failing = [BootstrapStage::Connected, BootstrapStage::FailedBootCheck];
        assert_eq!(Plan::of(&failing).get(1), Some(BootstrapStage::FailedBootCheck));
        assert_eq!(Plan::of(&failing).get(2), None);
        assert!(Plan::of(&[]).stages().is_empty());
        let long: Vec<BootstrapStage> = BootstrapStage::ALL.iter().cycle().take(20).copied().collect();
        assert_eq!(Plan::of(&long).stages(), long[..Plan::MAX]);
    }

    /// Drives a full lifecycle on several identities and records everything seen.
    fn script(config: FakeConfig) -> (Vec<FakeCall>, Vec<FakeObservation>, Vec<FakeResource>) {
        let mut p = provider(config);
        let mut calls = Vec::new();
        let mut now = 0;
        for attempt in 1..=40 {
            let created = p.execute(&create(attempt), t(now));
            let lease = match &created.outcome {
                Outcome::Succeeded(f) => f.lease.clone(),
                _ => None,
            };
            calls.push(created);
            if let Some(lease) = lease {
                calls.push(p.execute(&lookup(attempt, &lease), t(now + 1)));
                calls.push(p.execute(&start(attempt, &lease), t(now + 2)));
            }
            if attempt % 3 == 0 {
                calls.push(p.execute(&cancel(attempt), t(now + 3)));
                calls.push(p.execute(&destroy(attempt), t(now + 4)));
            }
            now += 7;
        }
        let observations = p.due_observations(t(now + 1_000));
        (calls, observations, p.inventory())
    }

    #[test]
    fn the_same_seed_gives_the_same_outcomes() {
        let config = FakeConfig {
            seed: 42,
            faults: FaultRates::chaos(),
            latency_ms: (1, 50),
            ..FakeConfig::default()
        };
        let a = script(config);
        let b = script(config);
        assert_eq!(a, b);
        // Chaos really injects faults, and another seed really differs.
        assert!(a.0.iter().any(|c| !matches!(c.outcome, Outcome::Succeeded(_))));
        let other = script(FakeConfig { seed: 43, ..config });
        assert_ne!(a.0, other.0);
        assert!(a.0.iter().all(|c| (1..=50).contains(&c.latency.as_millis())));
    }

    #[test]
    fn set_faults_none_stops_faults() {
        let everything = FaultRates {
            create_retryable: 0.5,
            create_ambiguous: 0.5,
            lookup_error: 1.0,
            start_fail: 0.5,
            start_ambiguous: 0.5,
            bootstrap_fail: 1.0,
            cancel_fail: 1.0,
            destroy_fail: 0.5,
            destroy_ambiguous: 0.5,
            ..FaultRates::none()
        };
        let mut p = provider(FakeConfig {
            faults: everything,
            ..FakeConfig::default()
        });
        let faulty: Vec<_> = (1..=10).map(|a| p.execute(&create(a), t(0)).outcome).collect();
        assert!(
            faulty.iter().all(|o| !matches!(o, Outcome::Succeeded(_))),
            "{faulty:?}"
        );

        p.set_faults(FaultRates::none());
        for attempt in 100..130 {
            let session = started(&mut p, attempt, t(10));
            let lease = p
                .inventory()
                .into_iter()
                .find(|r| r.identity.attempt.get() == attempt)
                .unwrap()
                .lease;
            assert!(matches!(
                p.execute(&lookup(attempt, &lease), t(11)).outcome,
                Outcome::Succeeded(_)
            ));
            assert!(!session.as_str().is_empty());
        }
        let stages = p.due_observations(t(10_000));
        assert_eq!(
            stages
                .iter()
                .filter(|o| o.stage == BootstrapStage::Converged)
                .count(),
            30
        );
        assert!(stages.iter().all(|o| !o.stage.is_failure()));
        for attempt in 100..130 {
            assert!(matches!(
                p.execute(&cancel(attempt), t(20_000)).outcome,
                Outcome::Succeeded(_)
            ));
            assert!(matches!(
                p.execute(&destroy(attempt), t(20_000)).outcome,
                Outcome::Succeeded(_)
            ));
        }
    }

    /// A provider holding `n` resources (attempts 1..=n) with bound
    /// endpoints, created at `t(0)`, with `faults`.
    fn holding(n: u64, seed: u64, faults: FaultRates) -> FakeProvider {
        let mut p = provider(FakeConfig {
            seed,
            ..FakeConfig::default()
        });
        for attempt in 1..=n {
            let _ = p.execute(&create(attempt), t(0));
        }
        p.set_faults(faults);
        p
    }

    /// Rolls every second from `t(0)` to `t(secs * 1000)`, one call a second.
    fn roll(p: &mut FakeProvider, secs: u64) -> Vec<FakeChange> {
        (0..=secs).flat_map(|s| p.due_changes(t(s * 1_000))).collect()
    }

    #[test]
    fn day2_faults_repeat_with_the_seed() {
        let day2 = FaultRates {
            lose: 0.01,
            sicken: 0.05,
            heal: 0.2,
            ..FaultRates::none()
        };
        let mut a = holding(10, 7, day2);
        let mut b = holding(10, 7, day2);
        let changes = roll(&mut a, 300);
        assert_eq!(changes, roll(&mut b, 300));
        assert_eq!(a.snapshot(), b.snapshot());
        let kinds: BTreeSet<String> = changes.iter().map(|c| format!("{:?}", c.kind)).collect();
        assert_eq!(
            kinds.len(),
            3,
            "losses, sickness and healing all happen: {changes:?}"
        );
        // Another seed rolls otherwise.
        let mut other = holding(10, 8, day2);
        assert_ne!(changes, roll(&mut other, 300));
        // Each change is at a whole tick, in tick order, and what it says is
        // what the provider now holds.
        assert!(changes.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(changes.iter().all(|c| c.at.as_millis() % 1_000 == 0));
        let mut sick = BTreeSet::new();
        for c in &changes {
            match c.kind {
                FakeChangeKind::Lost => assert!(!a.holds(&c.identity)),
                FakeChangeKind::Sickened => {
                    sick.insert(c.identity.clone());
                }
                FakeChangeKind::Healed => {
                    assert!(sick.remove(&c.identity), "healed what was not sick: {c:?}");
                }
            }
        }
        for r in a.inventory() {
            assert_eq!(a.probe(&r.identity).is_err(), sick.contains(&r.identity));
        }
    }

    #[test]
    fn a_probe_finds_each_resource_even_when_two_share_an_attempt() {
        let mut p = holding(2, 1, FaultRates::none());
        // A confused caller: another node's create under attempt 1.
        let mut other = create(1);
        other.node = LogicalNodeId::parse("node", "workers-9").unwrap();
        let _ = p.execute(&other, t(0));
        let (first, second) = (create(1).identity(), other.identity());
        assert!(p.holds(&second));
        for id in [&first, &second, &create(2).identity()] {
            assert_eq!(p.probe(id), Ok(()), "{id:?}");
        }
        assert!(p.lose(&first));
        assert!(p.probe(&first).is_err());
        assert_eq!(p.probe(&second), Ok(()), "found without the index");
        assert!(p.lose(&second));
        assert!(p.probe(&second).is_err());
    }

    #[test]
    fn a_lost_resource_leaves_the_inventory_and_is_reported() {
        let mut p = holding(
            3,
            1,
            FaultRates {
                lose: 1.0,
                ..FaultRates::none()
            },
        );
        // The first call only sets the ticks going; the next tick loses all.
        assert!(p.due_changes(t(500)).is_empty());
        assert_eq!(p.next_change_at(), Some(t(1_000)));
        let lost = p.due_changes(t(1_999));
        assert_eq!(lost.len(), 3, "{lost:?}");
        assert!(
            lost.iter()
                .all(|c| c.kind == FakeChangeKind::Lost && c.at == t(1_000))
        );
        assert!(p.inventory().is_empty());
        assert_eq!(p.live_resources(RUN), 0);
        assert!(p.probe(&create(1).identity()).is_err());
        // Nothing is held, so nothing is due and nothing more is reported.
        assert_eq!(p.next_change_at(), None);
        assert!(p.due_changes(t(10_000)).is_empty());
        // A create for a lost identity makes a new lease: the old one is gone.
        let creates = p.creates();
        let _ = p.execute(&create(1), t(10_000));
        assert_eq!(p.creates(), creates + 1);
    }

    #[test]
    fn without_day2_rates_nothing_changes_on_its_own() {
        assert!(FaultRates::chaos().has_day2());
        assert!(!FaultRates::none().has_day2());
        let mut p = holding(5, 3, FaultRates::none());
        assert_eq!(p.next_change_at(), None);
        assert!(roll(&mut p, 600).is_empty());
        assert_eq!(p.live_resources(RUN), 5);
        // Faults switched on later roll only the ticks after the switch, and
        // stop when they are switched off.
        p.set_faults(FaultRates {
            lose: 1.0,
            ..FaultRates::none()
        });
        assert_eq!(p.next_change_at(), Some(t(601_000)));
        p.set_faults(FaultRates::none());
        assert!(p.due_changes(t(700_000)).is_empty());
        assert_eq!(p.live_resources(RUN), 5);
    }

    #[test]
    fn only_a_bound_endpoint_sickens_and_sickness_outlives_a_restore() {
        let mut p = provider(FakeConfig {
            endpoint_delay_ms: 5_000,
            ..FakeConfig::default()
        });
        let _ = p.execute(&create(1), t(0));
        p.set_faults(FaultRates {
            sicken: 1.0,
            ..FaultRates::none()
        });
        let early = roll(&mut p, 4);
        assert!(early.is_empty(), "{early:?}");
        let later = p.due_changes(t(5_000));
        assert_eq!(later.len(), 1);
        assert_eq!(later[0].kind, FakeChangeKind::Sickened);
        assert!(p.is_sick(&create(1).identity()));
        let q = FakeProvider::restore(*p.config(), p.snapshot());
        assert!(q.probe(&create(1).identity()).is_err());
        assert_eq!(q.snapshot(), p.snapshot());
    }

    #[test]
    fn a_long_jump_rolls_at_most_its_last_ticks() {
        let mut p = holding(
            2,
            1,
            FaultRates {
                sicken: 1.0,
                heal: 1.0,
                ..FaultRates::none()
            },
        );
        assert!(p.due_changes(t(0)).is_empty());
        // Sick at one tick, healed at the next: one change per resource and tick.
        let changes = p.due_changes(t(100 * 3_600 * 1_000));
        assert_eq!(changes.len() as u64, 2 * MAX_FAULT_TICKS);
    }

    #[test]
    fn found_by_run_node_and_attempt() {
        let p = holding(2, 1, FaultRates::none());
        let id = create(2).identity();
        assert_eq!(p.find(RUN, &id.node, id.attempt), Some(id.clone()));
        assert_eq!(p.find(RUN, &id.node, AttemptId::new(9)), None);
        assert_eq!(p.find(RunUid::from_u128(1), &id.node, id.attempt), None);
    }
}
