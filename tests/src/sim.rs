//! The three cores composed in memory on a virtual clock.
//!
//! The driver's [`RunState`], the pure decider and the executor's
//! [`ExecutorCore`] over the fake provider, wired the way the services wire
//! them, with every message passing through a delivery queue that can deliver in
//! order or delay, reorder and duplicate. Time only moves when the simulation
//! moves it, so a run is a pure function of its seed and inputs.
//!
//! Beyond plain driving, the simulation is the conformance kit's level-1 system
//! under test, so it also offers:
//! - a rich event log ([`Sim::record`]): every change of the driver's nodes with
//!   its cause and the states before and after, every submission with the state
//!   it was submitted from, every backend call, every message the executor sent;
//! - control of the executor's outcomes ([`Sim::inject`]), of the link
//!   ([`Sim::reconnect`]), of replays and resubmissions, and driver restarts from
//!   the store ([`Sim::restart_driver`]);
//! - a permutation knob ([`Sim::permute`]) that applies independent work in the
//!   reverse order, for the order-independence half of guarantee 16;
//! - test-only fault injection hooks ([`Tamper`]) through which the kit's
//!   mutants break a guarantee on purpose, to show the oracle notices.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    fmt,
    sync::Arc,
    time::Duration,
};

use contract::{
    AttemptId, ClusterShape, DecideOutput, Decision, Effect, Epoch, LogicalNodeId, ManagedNode, Observation,
    Operation, OperationId, OperationInput, OperationResult, Outcome, PendingOp, Rejection, ResourceChange,
    RunUid, SessionId, UnixMillis, backoff::mix64,
};
use driver_svc::core::{
    AckRef, Applied, ApplyError, Fold, LinkSession, MemStore, PassOutcome, Policy, RunState, RunStore,
    ToExecutor,
};
use executor_svc::{
    core::{ExecutorCore, Output},
    fake::{FakeCall, FakeChangeKind, FakeConfig, FakeProvider},
};

/// How results and observations travel back to the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// In order, right after they happen.
    InOrder,
    /// Delayed by a few steps, reordered and sometimes duplicated. The delay and
    /// the duplication of a message are a hash of its content, the seed and the
    /// step, and messages due at one step are interleaved by a hash of their node,
    /// so the chaos does not depend on the order in which independent nodes'
    /// messages were produced (guarantee 16 compares runs that differ only in it).
    Chaotic,
}

/// A message from the executor to the driver.
#[derive(Debug, Clone, PartialEq)]
pub enum ToDriver {
    Result(OperationResult),
    Observation(Observation),
    Rejection(Rejection),
    /// A resource change (a lost resource).
    Change(ResourceChange),
}

impl ToDriver {
    /// The node the message is about, if it names one.
    pub fn node(&self) -> Option<&LogicalNodeId> {
        match self {
            ToDriver::Result(r) => Some(&r.node),
            ToDriver::Observation(o) => Some(&o.node),
            ToDriver::Change(c) => Some(&c.node),
            ToDriver::Rejection(_) => None,
        }
    }
}

/// Every node of a run by slot, as one value.
pub type Nodes = BTreeMap<LogicalNodeId, ManagedNode>;

/// Why the driver's nodes changed.
#[derive(Debug, Clone)]
pub enum Cause {
    /// Expired deadlines were folded: operations past deadline plus grace, and
    /// stage deadlines.
    Timer,
    /// A pass applied these decisions, as the driver received them.
    Decisions(Vec<Decision>),
    /// A message from the executor was folded. `msg` is the message as the
    /// executor sent it (a mutant may have folded something else).
    Fold { msg: ToDriver, verdict: Fold },
    /// A shape update or a deletion.
    Apply,
    /// The driver restarted from its store.
    Restore,
    /// The decider's answer as it left the decider (level 2, from its trace):
    /// no node changes with it; the driver applies it later as `Decisions`.
    Answer(Vec<Decision>),
}

/// One change of the driver's nodes, with the states around it.
#[derive(Debug, Clone)]
pub struct Transition {
    pub at: UnixMillis,
    /// When the driver made the change: for a pass's decisions over the
    /// services, when it applied the answer (`at` is when it asked the
    /// decider, the time the decisions were made for); otherwise `at`.
    pub applied_at: UnixMillis,
    pub cause: Cause,
    /// The slots' current attempts.
    pub before: Nodes,
    pub after: Nodes,
    /// The successor attempts slots hold under a rollout's surge, by slot,
    /// where either side holds one.
    pub successors: Option<Box<Successors>>,
}

/// The successor attempts around a [`Transition`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Successors {
    pub before: Nodes,
    pub after: Nodes,
}

/// A run's nodes as a transition reads them: current attempts, successors.
type Snapshot = (Nodes, Nodes);

/// An outcome the test forces on one operation instead of the fake's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Forced {
    /// Definitely did not happen; retrying may work. The fake is not called.
    Retryable,
    /// Definitely did not happen; retrying the same input will not work.
    Permanent,
    /// The effect happened (the fake ran it), but the answer is "ambiguous".
    AmbiguousDone,
    /// The effect did not happen, and the answer is "ambiguous".
    AmbiguousNotDone,
    /// "Not ready yet" (meaningful for lookups and bootstrap starts); the fake is
    /// not called.
    NotReady,
    /// The fake ran the effect but the call never returns before the deadline:
    /// the executor abandons it (ambiguous) and the shell aborts the call.
    Hang,
    /// As `Hang`, but the aborted call completes anyway after the deadline, so a
    /// late result reaches the driver.
    HangLate,
}

impl Forced {
    pub const ALL: [Forced; 7] = [
        Forced::Retryable,
        Forced::Permanent,
        Forced::AmbiguousDone,
        Forced::AmbiguousNotDone,
        Forced::NotReady,
        Forced::Hang,
        Forced::HangLate,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Forced::Retryable => "retryable",
            Forced::Permanent => "permanent",
            Forced::AmbiguousDone => "ambiguous-done",
            Forced::AmbiguousNotDone => "ambiguous-not-done",
            Forced::NotReady => "not-ready",
            Forced::Hang => "hang",
            Forced::HangLate => "hang-late",
        }
    }
}

/// Something that happened, for checks over the whole trace.
#[derive(Debug, Clone)]
pub enum Event {
    /// An operation reached the executor; `recorded` says whether the driver's
    /// committed store held it pending (same id, effect and deadline) at that
    /// moment.
    Submitted {
        op: Operation,
        recorded: bool,
    },
    Started(Operation),
    Completed {
        run_uid: RunUid,
        id: OperationId,
        outcome: Outcome,
    },
    Pass(PassSummary),
    /// Recorded just before the matching `Submitted`: the node as the driver's
    /// state held it, and the pending operation of the committed store.
    SubmitContext {
        id: OperationId,
        node: Option<Box<ManagedNode>>,
        store_pending: Option<PendingOp>,
    },
    /// The shell ran an operation against the backend (just before `Started`).
    BackendCall {
        op: Operation,
        /// Attempts of the operation's slot holding a live resource at the fake
        /// just before the call.
        slot_attempts: Vec<AttemptId>,
        /// The identity's bootstrap session was still streaming stages.
        session_running: bool,
        /// The call made a new lease (not an adoption).
        lease_made: bool,
        forced: Option<Forced>,
    },
    /// The executor abandoned a running operation and told the shell to abort.
    Aborted {
        run_uid: RunUid,
        id: OperationId,
    },
    /// The executor sent this to the driver (whether or not it arrives).
    Emitted(ToDriver),
    /// The driver's nodes changed.
    Transition(Box<Transition>),
    /// A conflicting resubmission of an operation id the executor has seen
    /// (another client's probe; nothing of it reaches the driver).
    ConflictProbe {
        op: Operation,
        outputs: Vec<Output>,
    },
    /// The executor received the driver's acknowledgement of the run's
    /// resource changes with these sequence numbers (level 2, from its
    /// trace; in memory a message's fold is its acknowledgement).
    ChangesAcknowledged(Vec<u64>),
    /// The driver took this shape, or began deleting the run (level 2, from
    /// its trace; in memory, a shape the driver takes of its own in a pass
    /// or on its timer, a revert: the round's state says the rest).
    Shape {
        shape: ClusterShape,
        deleting: bool,
    },
    /// With nothing else to do, the driver's next wake-up was already due
    /// (`poll_timeout() <= now`) while it had no pass to run (`needs_pass` was
    /// false): the actor's timer would fire again at once, in a busy loop, until
    /// time moves on. The simulation lets time move on to the next event.
    Spin {
        at: UnixMillis,
    },
}

#[derive(Debug, Clone)]
pub struct PassSummary {
    pub at: UnixMillis,
    pub operations: usize,
    pub transitions: u32,
    /// The run was converged when the decider was asked.
    pub converged_before: bool,
    /// Decisions that are not waits.
    pub actions: usize,
    /// Whether any node changed in the pass (deadline folds included).
    pub changed: bool,
}

/// A small deterministic RNG (SplitMix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// Test-only fault injection: each hook may bend one step of the composed system
/// so that a guarantee breaks, which is how the conformance kit shows that its
/// oracle notices (it cannot edit the cores). Every hook defaults to "do nothing".
pub trait Tamper: fmt::Debug {
    /// The decider's answer, before the driver applies it.
    fn decisions(&mut self, _sim: &Sim, _out: &mut DecideOutput) {}
    /// Whether the pass's operations count as submitted before the pass was
    /// committed (the submissions are checked against the store as it was).
    fn submits_before_commit(&self) -> bool {
        false
    }
    /// An operation on its way to the executor; returns extra operations to send
    /// after it.
    fn submit(&mut self, _sim: &mut Sim, _op: &mut Operation) -> Vec<Operation> {
        Vec::new()
    }
    /// The executor core's answer to a submission, before the shell acts on it.
    fn executor_submit(&mut self, _sim: &mut Sim, _op: &Operation, _outputs: &mut Vec<Output>) {}
    /// A backend call; `Some` replaces the fake's call.
    fn backend_call(
        &mut self,
        _fake: &mut FakeProvider,
        _op: &Operation,
        _now: UnixMillis,
    ) -> Option<FakeCall> {
        None
    }
    /// A message about to be folded; `Some` folds that instead.
    fn fold(&mut self, _sim: &Sim, _msg: &ToDriver) -> Option<ToDriver> {
        None
    }
    /// The end of a step.
    fn after_step(&mut self, _sim: &mut Sim) {}
}

/// How many delivered messages [`Sim::resend`] can pick from.
const HISTORY: usize = 32;

/// Latency of a forced definite answer.
const FORCED_LATENCY: Duration = Duration::from_millis(3);

/// The composed system.
#[derive(Debug)]
pub struct Sim {
    pub now: UnixMillis,
    pub run: RunState,
    pub store: MemStore,
    pub exec: ExecutorCore,
    pub fake: FakeProvider,
    pub delivery: Delivery,
    pub rng: Rng,
    /// Backend calls in progress: due time → completions.
    backend: BTreeMap<UnixMillis, Vec<(Operation, Outcome)>>,
    /// Messages on their way to the driver, with the step they arrive at.
    transit: VecDeque<(u64, ToDriver)>,
    /// The driver's side of the link: the production session logic
    /// (`driver_core::LinkSession`), as the run actor drives it.
    session: LinkSession,
    /// The generation of the latest link (a stream between the two).
    link_generation: u64,
    step: u64,
    pub events: Vec<Event>,
    pub passes: u64,
    /// Record transitions, submission contexts, backend calls and emitted
    /// messages in [`Sim::events`] (costly: every node is cloned around every
    /// change).
    pub record: bool,
    /// Apply each pass's decisions, and backend completions due at the same
    /// instant, in reverse order.
    pub permute: bool,
    pub tamper: Option<Box<dyn Tamper>>,
    seed: u64,
    policy: Arc<Policy>,
    /// Forced outcomes waiting for the next operation of a slot (and effect).
    injections: Vec<(LogicalNodeId, Option<Effect>, Forced)>,
    /// Aborted calls that complete anyway (late results).
    late_after_abort: BTreeSet<(RunUid, OperationId)>,
    /// Operations the executor has seen, first submission of each id.
    seen: BTreeMap<OperationId, Operation>,
    /// Recently delivered messages, newest last.
    history: VecDeque<ToDriver>,
    /// The groups the driver last asked the executor to probe.
    probed: BTreeSet<contract::GroupId>,
}

pub const START: UnixMillis = UnixMillis::new(1_700_000_000_000);

impl Sim {
    pub fn new(shape: ClusterShape, fake: FakeConfig, delivery: Delivery, seed: u64) -> anyhow::Result<Self> {
        Self::with_policy(shape, fake, delivery, seed, Policy::default())
    }

    pub fn with_policy(
        shape: ClusterShape,
        fake: FakeConfig,
        delivery: Delivery,
        seed: u64,
        policy: Policy,
    ) -> anyhow::Result<Self> {
        let uid = RunUid::from_u128(u128::from(seed) << 64 | 0x5eed);
        let epoch = Epoch::new(1);
        let policy = Arc::new(policy);
        let run = RunState::create(shape, uid, epoch, Arc::clone(&policy), START)?;
        let exec = ExecutorCore::default();
        let store = MemStore::new();
        // The actor commits a created run before it answers the client.
        let mut run = run;
        run.take_commit().persist_to(&store)?;
        let mut sim = Self {
            now: START,
            run,
            store,
            exec,
            fake: FakeProvider::new(fake),
            delivery,
            rng: Rng::new(seed ^ 0xdead_beef),
            backend: BTreeMap::new(),
            transit: VecDeque::new(),
            session: LinkSession::new(),
            link_generation: 0,
            step: 0,
            events: Vec::new(),
            passes: 0,
            record: false,
            permute: false,
            tamper: None,
            seed,
            policy,
            injections: Vec::new(),
            late_after_abort: BTreeSet::new(),
            seen: BTreeMap::new(),
            history: VecDeque::new(),
            probed: BTreeSet::new(),
        };
        // The run's actor starts, and the link comes up.
        sim.connect()?;
        Ok(sim)
    }

    /// Whether the link is down: nothing is submitted or delivered.
    pub fn link_down(&self) -> bool {
        self.session.link().is_none()
    }

    /// Operations the driver released while the link was down (lost).
    pub fn lost_submissions(&self) -> u64 {
        self.session.dropped_submissions()
    }

    /// The link breaks: what is on it is lost.
    pub fn cut_link(&mut self) {
        self.session.handle_link_down();
    }

    /// A new stream: the driver's session claims the run (the executor then
    /// sends every unacknowledged result and resource change again),
    /// resubmits what is pending and asks for observations after the last
    /// sequence it folded.
    fn connect(&mut self) -> anyhow::Result<()> {
        self.link_generation += 1;
        self.session.handle_link_up(self.link_generation, &self.run);
        self.transmit(None)
    }

    /// Carries out at the executor what the driver's session sent, as the
    /// executor's link handler does. `store` is the store submissions are
    /// checked against, when not the current one.
    fn transmit(&mut self, store: Option<&MemStore>) -> anyhow::Result<()> {
        let uid = self.run.uid();
        while let Some((generation, m)) = self.session.poll_transmit() {
            if generation != self.link_generation {
                continue;
            }
            match m {
                ToExecutor::Claim(claim) => {
                    self.exec
                        .claim(&claim)
                        .map_err(|r| anyhow::anyhow!("claim rejected: {r:?}"))?;
                    // As the executor does on a claim: whatever the driver
                    // has not acknowledged may never have reached it.
                    for r in self.exec.unacked_results_of(uid) {
                        self.send(ToDriver::Result(r));
                    }
                    for c in self.exec.unacked_resource_changes_of(uid) {
                        self.send(ToDriver::Change(c));
                    }
                }
                ToExecutor::Submit { op, .. } => self.submit_checked(op, store),
                // The simulation has no prober: a sickness the fake rolls
                // reaches the executor as the prober's report would, for the
                // groups the driver asked to probe (the `sicken` and `heal`
                // inputs report whatever the group).
                ToExecutor::Watch(w) => {
                    self.probed = w.groups.into_iter().map(|(g, _)| g).collect();
                }
                ToExecutor::ObserveFrom(after) => {
                    for (session, after) in after {
                        for o in self.exec.observations_after(uid, &session, after) {
                            self.send(ToDriver::Observation(o));
                        }
                    }
                }
                ToExecutor::Ack(acks) => {
                    for a in acks {
                        match a {
                            AckRef::Result(id) => self.exec.ack_result(uid, id),
                            AckRef::Observation { session, seq } => {
                                self.exec.ack_observations(uid, &session, seq)
                            }
                            AckRef::Change { seq } => self.exec.ack_resource_change(uid, seq),
                        }
                    }
                }
            }
        }
        Ok(())
    }

    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// Calls `f` with the tamper hooks, if any, taken out of `self` for the call.
    fn with_tamper<R>(&mut self, f: impl FnOnce(&mut dyn Tamper, &mut Sim) -> R) -> Option<R> {
        let mut t = self.tamper.take()?;
        let r = f(t.as_mut(), self);
        self.tamper = Some(t);
        Some(r)
    }

    /// Every node, by slot.
    pub fn nodes(&self) -> Nodes {
        self.run.nodes().map(|n| (n.id.clone(), n.clone())).collect()
    }

    /// Every successor attempt by slot.
    pub fn successors(&self) -> Nodes {
        self.run.successors().map(|n| (n.id.clone(), n.clone())).collect()
    }

    fn snapshot(&self) -> Snapshot {
        (self.nodes(), self.successors())
    }

    fn transition(&mut self, cause: Cause, (before, successors_before): Snapshot) {
        let (after, successors_after) = self.snapshot();
        let successors = (!successors_before.is_empty() || !successors_after.is_empty()).then(|| {
            Box::new(Successors {
                before: successors_before,
                after: successors_after,
            })
        });
        self.events.push(Event::Transition(Box::new(Transition {
            at: self.now,
            applied_at: self.now,
            cause,
            before,
            after,
            successors,
        })));
    }

    /// The driver took a shape of its own (a revert) since `generation`.
    fn shape_event(&mut self, generation: contract::Generation) {
        if self.record && self.run.shape().generation != generation {
            self.events.push(Event::Shape {
                shape: self.run.shape().clone(),
                deleting: self.run.is_deleting(),
            });
        }
    }

    fn snapshot_if_recording(&self) -> Option<Snapshot> {
        self.record.then(|| self.snapshot())
    }

    /// Folds expired deadlines, as the driver's actor does on its timer.
    pub fn timer(&mut self) -> anyhow::Result<()> {
        if self.run.poll_timeout().is_none_or(|t| t > self.now) {
            return Ok(());
        }
        let before = self.snapshot_if_recording();
        let generation = self.run.shape().generation;
        let folded = self.run.handle_timeout(self.now)?;
        if let Some(before) = before
            && folded > 0
        {
            self.transition(Cause::Timer, before);
        }
        self.shape_event(generation);
        let released = self.run.take_commit().persist_to(&self.store)?;
        self.session.handle_released(released, &mut self.run);
        self.transmit(None)?;
        Ok(())
    }

    /// Runs one pass if the run wants one. Returns whether a pass ran.
    pub fn pass(&mut self) -> anyhow::Result<bool> {
        if !self.run.needs_pass(self.now) {
            return Ok(false);
        }
        let s0 = self.snapshot_if_recording();
        let generation = self.run.shape().generation;
        let plan = self.run.begin_pass(self.now)?;
        let s1 = self.snapshot_if_recording();
        let timer_changed = s0 != s1;
        if let (Some(s0), true) = (s0, timer_changed) {
            self.transition(Cause::Timer, s0);
        }
        let converged_before = self.run.is_converged();
        let mut output = {
            let view = self.run.desired_view();
            let slots = self.run.slot_set();
            decider::decide(&view, self.run.plan_nodes(&plan), slots, self.now)
        };
        if self.permute {
            output.decisions.reverse();
        }
        self.with_tamper(|t, sim| t.decisions(sim, &mut output));
        let precommit = self
            .tamper
            .as_ref()
            .is_some_and(|t| t.submits_before_commit())
            .then(|| self.store.clone());
        let decisions = self.record.then(|| output.decisions.clone());
        let actions = output.actions().count();
        let mut outcome: PassOutcome = self.run.apply_decisions(plan, output, self.now)?;
        let released = outcome.take_commit().persist_to(&self.store)?;
        let mut changed = timer_changed;
        if let (Some(s1), Some(decisions)) = (s1, decisions) {
            changed |= s1 != self.snapshot();
            self.transition(Cause::Decisions(decisions), s1);
        }
        self.shape_event(generation);
        self.passes += 1;
        self.events.push(Event::Pass(PassSummary {
            at: self.now,
            operations: outcome.operations as usize,
            transitions: outcome.transitions,
            converged_before,
            actions,
            changed,
        }));
        self.session.handle_released(released, &mut self.run);
        self.transmit(precommit.as_ref())?;
        Ok(true)
    }

    fn recorded_in(store: &MemStore, op: &Operation) -> Option<PendingOp> {
        let runs = store.load_all().ok()?;
        // The operation's attempt: the slot's current one or its successor.
        runs.iter()
            .filter(|r| r.meta.uid == op.run_uid)
            .flat_map(|r| r.nodes.iter())
            .filter(|n| n.node.id == op.node)
            .flat_map(|n| std::iter::once(n).chain(n.successor.as_deref()))
            .find(|n| n.node.attempt == op.id.attempt())
            .and_then(|n| n.node.pending)
    }

    /// Sends an operation to the executor through the driver's session
    /// (lost while the link is down).
    pub fn submit(&mut self, op: Operation) -> anyhow::Result<()> {
        self.session.submit(op);
        self.transmit(None)
    }

    /// What the executor does with a submission that reached it; `store` is
    /// the store the submission is checked against, when not the current one.
    fn submit_checked(&mut self, mut op: Operation, store: Option<&MemStore>) {
        let extra = self
            .with_tamper(|t, sim| t.submit(sim, &mut op))
            .unwrap_or_default();
        let store_pending = Self::recorded_in(store.unwrap_or(&self.store), &op);
        let recorded = store_pending
            .is_some_and(|p| p.id == op.id && p.effect == op.input.effect() && p.deadline == op.deadline);
        if self.record {
            self.events.push(Event::SubmitContext {
                id: op.id,
                // The operation's attempt: the slot's current one, or its
                // successor under a rollout's surge.
                node: self
                    .run
                    .successor(&op.node)
                    .filter(|n| n.attempt == op.id.attempt())
                    .or_else(|| self.run.node(&op.node))
                    .cloned()
                    .map(Box::new),
                store_pending,
            });
        }
        self.events.push(Event::Submitted {
            op: op.clone(),
            recorded,
        });
        self.seen.entry(op.id).or_insert_with(|| op.clone());
        let mut outputs = self.exec.submit(op.clone(), self.now);
        self.with_tamper(|t, sim| t.executor_submit(sim, &op, &mut outputs));
        self.handle_outputs(outputs);
        for op in extra {
            self.submit_checked(op, store);
        }
    }

    /// Forces the outcome of the next operation with `effect` (any effect when
    /// `None`) that the backend runs for `node`.
    pub fn inject(&mut self, node: LogicalNodeId, effect: Option<Effect>, forced: Forced) {
        self.injections.push((node, effect, forced));
    }

    /// Drops every forced outcome not yet used.
    pub fn clear_injections(&mut self) {
        self.injections.clear();
    }

    fn take_injection(&mut self, op: &Operation) -> Option<Forced> {
        let effect = op.input.effect();
        let i = self
            .injections
            .iter()
            .position(|(n, e, _)| *n == op.node && e.is_none_or(|e| e == effect))?;
        Some(self.injections.remove(i).2)
    }

    /// Whether the backend would adopt an existing resource for this operation
    /// (a create whose lease exists, a start whose session exists).
    fn adopts(&self, op: &Operation) -> bool {
        let identity = op.identity();
        let held = self.fake.inventory().into_iter().find(|r| r.identity == identity);
        match op.input.effect() {
            Effect::CreateLease => held.is_some(),
            Effect::StartBootstrap => held.is_some_and(|r| r.session_live),
            _ => false,
        }
    }

    /// The call the shell makes for a forced outcome.
    fn forced_call(&mut self, op: &Operation, forced: Forced) -> FakeCall {
        let reason = format!("forced: {}", forced.name());
        let definite = |outcome| FakeCall {
            latency: FORCED_LATENCY,
            outcome,
        };
        // "Not ready" says a resource exists but is not ready yet: only a lookup
        // or a bootstrap start can honestly say it. Elsewhere it stands for a
        // definite failure.
        let not_ready_ok = matches!(op.input.effect(), Effect::LookupEndpoint | Effect::StartBootstrap);
        let forced = if forced == Forced::NotReady && !not_ready_ok {
            Forced::Retryable
        } else {
            forced
        };
        // A backend adopts an existing resource for the identity before it
        // creates (SPEC.md section 5), so a create that finds its lease (or a
        // start that finds its session) cannot fail definitely: it adopts.
        let definite_failure = matches!(forced, Forced::Retryable | Forced::Permanent | Forced::NotReady);
        if definite_failure && self.adopts(op) {
            return self.fake.execute(op, self.now);
        }
        match forced {
            Forced::Retryable => definite(Outcome::Retryable { reason }),
            Forced::Permanent => definite(Outcome::Permanent { reason }),
            Forced::NotReady => definite(Outcome::NotReady { reason }),
            Forced::AmbiguousNotDone => definite(Outcome::Ambiguous { reason }),
            Forced::AmbiguousDone => {
                let call = self.fake.execute(op, self.now);
                FakeCall {
                    latency: call.latency,
                    outcome: Outcome::Ambiguous { reason },
                }
            }
            Forced::Hang | Forced::HangLate => {
                let call = self.fake.execute(op, self.now);
                if forced == Forced::HangLate {
                    self.late_after_abort.insert((op.run_uid, op.id));
                }
                // Long enough that the executor's deadline comes first.
                let latency = op.deadline.saturating_since(self.now) + Duration::from_secs(60);
                FakeCall {
                    latency,
                    outcome: call.outcome,
                }
            }
        }
    }

    fn run_on_backend(&mut self, op: Operation) {
        let forced = self.take_injection(&op);
        let identity = op.identity();
        let (slot_attempts, session_running) = if self.record {
            let attempts = self
                .fake
                .inventory()
                .into_iter()
                .filter(|r| r.identity.run_uid == op.run_uid && r.identity.node == op.node)
                .map(|r| r.identity.attempt)
                .collect();
            (attempts, self.fake.is_emitting(&identity))
        } else {
            (Vec::new(), false)
        };
        let creates = self.fake.creates();
        let now = self.now;
        let tampered = match self.tamper.as_mut() {
            Some(t) => t.backend_call(&mut self.fake, &op, now),
            None => None,
        };
        let call = match (tampered, forced) {
            (Some(call), _) => call,
            (None, Some(f)) => self.forced_call(&op, f),
            (None, None) => self.fake.execute(&op, now),
        };
        if self.record {
            self.events.push(Event::BackendCall {
                op: op.clone(),
                slot_attempts,
                session_running,
                lease_made: self.fake.creates() > creates,
                forced,
            });
        }
        self.events.push(Event::Started(op.clone()));
        let due = self.now.checked_add(call.latency).unwrap_or(UnixMillis::MAX);
        self.backend.entry(due).or_default().push((op, call.outcome));
    }

    fn handle_outputs(&mut self, outputs: Vec<Output>) {
        for o in outputs {
            match o {
                Output::Start(op) => self.run_on_backend(op),
                Output::Abort { run_uid, id } => {
                    if self.record {
                        self.events.push(Event::Aborted { run_uid, id });
                    }
                    // The shell cancels the backend call; its effect on the
                    // provider stays as it was (ambiguity is real). A call marked
                    // to complete late is not cancelled in time.
                    if !self.late_after_abort.remove(&(run_uid, id)) {
                        for calls in self.backend.values_mut() {
                            calls.retain(|(op, _)| !(op.run_uid == run_uid && op.id == id));
                        }
                    }
                }
                Output::Result(r) => self.send(ToDriver::Result(r)),
                Output::Rejected(rej) => self.send(ToDriver::Rejection(rej)),
                Output::Observation(o) => self.send(ToDriver::Observation(o)),
                Output::ResourceChange(c) => self.send(ToDriver::Change(c)),
            }
        }
    }

    /// A hash of a message's content that does not depend on attempt ids, lease
    /// or session names (which differ between runs that only reorder work).
    fn content_key(m: &ToDriver) -> u64 {
        let (node, a, b) = match m {
            ToDriver::Result(r) => (
                Some(&r.node),
                u64::from(r.id.seq()),
                r.effect as u64 | u64::from(r.late) << 8 | u64::from(r.replayed) << 9,
            ),
            ToDriver::Observation(o) => (Some(&o.node), o.seq, o.stage as u64 | 1 << 10),
            ToDriver::Rejection(rej) => (None, rej.id.map_or(0, |id| u64::from(id.seq())), 1 << 11),
            ToDriver::Change(c) => (Some(&c.node), c.seq, 1 << 12),
        };
        mix64(node.map_or(0, node_key) ^ mix64(a) ^ mix64(b.wrapping_mul(0x9e37)))
    }

    fn send(&mut self, m: ToDriver) {
        if self.record {
            self.events.push(Event::Emitted(m.clone()));
        }
        if self.link_down() {
            // The stream is broken: the message is lost (the executor keeps
            // results and observations until acknowledged, and sends them again
            // on the next stream).
            return;
        }
        match self.delivery {
            Delivery::InOrder => self.transit.push_back((self.step, m)),
            Delivery::Chaotic => {
                let k = mix64(Self::content_key(&m) ^ mix64(self.seed) ^ self.step.wrapping_mul(0x5851));
                if (k >> 20).is_multiple_of(10) {
                    self.transit.push_back((self.step + (k >> 40) % 6, m.clone()));
                }
                self.transit.push_back((self.step + k % 4, m));
            }
        }
    }

    /// Delivers every message due at this step to the driver (interleaved across
    /// nodes when chaotic), then the acknowledgements to the executor.
    pub fn deliver(&mut self) -> anyhow::Result<usize> {
        if self.link_down() {
            return Ok(0);
        }
        let step = self.step;
        let mut due: Vec<ToDriver> = Vec::new();
        let mut keep = VecDeque::new();
        while let Some((at, m)) = self.transit.pop_front() {
            if at <= step {
                due.push(m);
            } else {
                keep.push_back((at, m));
            }
        }
        self.transit = keep;
        if self.delivery == Delivery::Chaotic {
            // A stable sort keeps each node's messages in the order they were
            // sent while nodes interleave differently at every step.
            let salt = mix64(self.seed ^ step.wrapping_mul(0x2545_f491));
            due.sort_by_key(|m| m.node().map_or(0, |n| mix64(node_key(n) ^ salt)));
        }
        let n = due.len();
        for m in due {
            let folded = self
                .with_tamper(|t, sim| t.fold(sim, &m))
                .flatten()
                .unwrap_or_else(|| m.clone());
            let before = self.snapshot_if_recording();
            let verdict = match &folded {
                ToDriver::Result(r) => self.run.fold_result(r, self.now)?,
                ToDriver::Observation(o) => self.run.fold_observation(o, self.now)?,
                ToDriver::Rejection(rej) => self.run.fold_rejection(rej, self.now)?,
                ToDriver::Change(c) => self.run.fold_resource_change(c, self.now)?,
            };
            if let Some(before) = before {
                self.transition(
                    Cause::Fold {
                        msg: m.clone(),
                        verdict,
                    },
                    before,
                );
            }
            if self.history.len() == HISTORY {
                self.history.pop_front();
            }
            self.history.push_back(m);
        }
        // Folds are acknowledged only once committed.
        let released = self.run.take_commit().persist_to(&self.store)?;
        self.session.handle_released(released, &mut self.run);
        self.transmit(None)?;
        Ok(n)
    }

    /// Completes backend calls and emits observations due by now.
    fn run_backend(&mut self) {
        let due: Vec<UnixMillis> = self.backend.range(..=self.now).map(|(t, _)| *t).collect();
        for t in due {
            let mut calls = self.backend.remove(&t).unwrap_or_default();
            if self.permute {
                calls.reverse();
            }
            for (op, outcome) in calls {
                self.events.push(Event::Completed {
                    run_uid: op.run_uid,
                    id: op.id,
                    outcome: outcome.clone(),
                });
                let outputs = self.exec.complete(op.run_uid, op.id, outcome, self.now);
                self.handle_outputs(outputs);
            }
        }
        self.fake_changes();
        for fo in self.fake.due_observations(self.now) {
            let out = self.exec.record_observation(
                &fo.identity,
                fo.session,
                fo.stage,
                fo.detail,
                fo.at,
                contract::TraceContext::default(),
            );
            self.handle_outputs(out);
        }
        let outputs = self.exec.handle_timeout(self.now);
        self.handle_outputs(outputs);
    }

    /// The provider's day-2 faults of the fault ticks up to now, reported as
    /// the executor's watch (a loss) and prober (a change of health, in a
    /// probed group) report them. Fault ticks are not events of their own:
    /// they are rolled whenever the clock has moved, so an idle simulation
    /// does not step through them one by one.
    fn fake_changes(&mut self) {
        for c in self.fake.due_changes(self.now) {
            if c.kind != FakeChangeKind::Lost && !self.probed.contains(c.identity.node.group()) {
                continue;
            }
            let change = match c.kind {
                FakeChangeKind::Lost => contract::Change::Lost {
                    reason: "injected: the provider lost the resource".to_owned(),
                },
                FakeChangeKind::Sickened => contract::Change::Health {
                    healthy: false,
                    detail: "the probe went unanswered".to_owned(),
                },
                FakeChangeKind::Healed => contract::Change::Health {
                    healthy: true,
                    detail: "probe answered".to_owned(),
                },
            };
            let out = self.exec.record_resource_change(&c.identity, change, c.at);
            self.handle_outputs(out);
        }
    }

    /// The next time anything is due, if anything is.
    pub fn next_event_at(&self) -> Option<UnixMillis> {
        [
            self.backend.keys().next().copied(),
            self.fake.next_observation_at(),
            self.exec.poll_timeout(),
            self.run.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The driver's safety tick as its actor runs it on the link: sessions
    /// still bootstrapping that made no progress since the previous tick are
    /// asked for their stages again. Returns how many were asked.
    pub fn safety_tick(&mut self) -> anyhow::Result<usize> {
        let asked = self.session.handle_safety_tick(&self.run);
        self.transmit(None)?;
        Ok(asked)
    }

    /// Whether nothing is on its way: no backend call out, no message in
    /// transit, nothing running or queued at the executor.
    pub fn quiescent(&self) -> bool {
        self.backend.is_empty()
            && self.transit.is_empty()
            && self.exec.running_count() == 0
            && self.exec.queued_count() == 0
            // A loss the executor holds for the driver (the link was down
            // when it happened) is on its way too.
            && self.exec.unacked_resource_changes_of(self.run.uid()).is_empty()
    }

    /// The next time after `now` anything is due, if anything is.
    fn next_event_after(&self, now: UnixMillis) -> Option<UnixMillis> {
        use std::ops::Bound::{Excluded, Unbounded};
        [
            self.backend
                .range((Excluded(now), Unbounded))
                .next()
                .map(|(t, _)| *t),
            self.fake.next_observation_at(),
            self.exec.poll_timeout(),
            self.run.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .filter(|t| *t > now)
        .min()
    }

    /// One step: deadline folds, a pass if wanted, backend progress, delivery.
    /// When nothing is due now, the clock jumps to the next event.
    pub fn step(&mut self) -> anyhow::Result<()> {
        self.step += 1;
        self.timer()?;
        self.pass()?;
        self.run_backend();
        let delivered = self.deliver()?;
        let idle = delivered == 0
            && !self.run.needs_pass(self.now)
            && self.transit.is_empty()
            && self.backend.range(..=self.now).next().is_none();
        if idle {
            let next = self.next_event_after(self.now);
            let spinning = self.run.poll_timeout().is_some_and(|t| t <= self.now);
            let target = if spinning {
                if self.record {
                    self.events.push(Event::Spin { at: self.now });
                }
                // The actor would loop on its timer while wall time passes; a
                // pass may be held back for at most one batch window.
                let window = self
                    .now
                    .checked_add(self.policy.pass_batch.max(Duration::from_millis(1)))
                    .unwrap_or(UnixMillis::MAX);
                Some(next.map_or(window, |t| t.min(window)))
            } else {
                next
            };
            if let Some(t) = target {
                self.now = t;
                self.fake.advance(t);
            }
        }
        self.with_tamper(|t, sim| t.after_step(sim));
        Ok(())
    }

    /// The identity of `node`'s current attempt, if the run holds the node.
    fn identity_of(&self, node: &LogicalNodeId) -> Option<contract::ResourceIdentity> {
        let n = self.run.node(node)?;
        Some(contract::ResourceIdentity {
            run_uid: self.run.uid(),
            run_id: self.run.run_id().clone(),
            node: node.clone(),
            attempt: n.attempt,
        })
    }

    /// The provider loses `node`'s resource (its machine went away) and the
    /// executor reports it, as a watching backend does. Returns whether the
    /// node held one.
    pub fn lose(&mut self, node: &LogicalNodeId) -> bool {
        let Some(identity) = self.identity_of(node) else {
            return false;
        };
        if !self.fake.lose(&identity) {
            return false;
        }
        let lost = contract::Change::Lost {
            reason: "the fake provider lost it".to_owned(),
        };
        let out = self.exec.record_resource_change(&identity, lost, self.now);
        self.handle_outputs(out);
        true
    }

    /// The executor reports `node`'s current attempt healthy or not, as its
    /// prober does when the node's probes change. Returns whether the node
    /// holds a resource to report on.
    pub fn report_health(&mut self, node: &LogicalNodeId, healthy: bool) -> bool {
        let Some(identity) = self.identity_of(node) else {
            return false;
        };
        if self.fake.probe(&identity).is_err() && healthy {
            return false;
        }
        let change = contract::Change::Health {
            healthy,
            detail: if healthy {
                "probe answered"
            } else {
                "the probe went unanswered"
            }
            .to_owned(),
        };
        let out = self.exec.record_resource_change(&identity, change, self.now);
        self.handle_outputs(out);
        true
    }

    /// Steps until converged (or `max_steps`); returns the steps taken.
    pub fn run_until_converged(&mut self, max_steps: u64) -> anyhow::Result<u64> {
        for i in 0..max_steps {
            if self.run.is_converged() && self.transit.is_empty() && self.backend.is_empty() {
                return Ok(i);
            }
            self.step()?;
        }
        anyhow::bail!(
            "not converged after {max_steps} steps at {:?}: {}",
            self.now,
            self.describe()
        )
    }

    /// Steps until the run is gone (after `delete`).
    pub fn run_until_gone(&mut self, max_steps: u64) -> anyhow::Result<u64> {
        for i in 0..max_steps {
            if self.run.is_gone() && self.transit.is_empty() && self.backend.is_empty() {
                return Ok(i);
            }
            self.step()?;
        }
        anyhow::bail!("not gone after {max_steps} steps: {}", self.describe())
    }

    /// Restores the link: messages in flight on the broken stream are lost;
    /// on the new stream the driver resubmits every pending operation and
    /// asks for observations after the last folded sequence.
    pub fn reconnect(&mut self) -> anyhow::Result<()> {
        self.transit.clear();
        self.connect()
    }

    /// The executor sends every unacknowledged result and observation again, as
    /// a replaying executor would; duplicates must change nothing.
    pub fn replay_unacked(&mut self) {
        let uid = self.run.uid();
        for r in self.exec.unacked_results_of(uid) {
            self.send(ToDriver::Result(r));
        }
        for o in self.exec.unacked_observations_of(uid) {
            self.send(ToDriver::Observation(o));
        }
        for c in self.exec.unacked_resource_changes_of(uid) {
            self.send(ToDriver::Change(c));
        }
    }

    /// Sends the `k`-th most recently delivered message again (a stale or
    /// duplicated message, often for a superseded attempt).
    pub fn resend(&mut self, k: usize) {
        if self.history.is_empty() {
            return;
        }
        let i = self.history.len() - 1 - k % self.history.len();
        let m = self.history[i].clone();
        self.send(m);
    }

    /// Resubmits every pending operation (the executor replays or keeps running).
    pub fn resubmit_inflight(&mut self) -> anyhow::Result<()> {
        for op in self.run.inflight_operations() {
            self.submit(op)?;
        }
        Ok(())
    }

    /// Another client resubmits an operation id the executor has seen with
    /// different input; the executor must reject it. Nothing reaches the driver.
    /// The `k`-th most recent id is probed.
    pub fn conflict_probe(&mut self, k: usize) {
        if self.seen.is_empty() || self.link_down() {
            return;
        }
        let mut recent: Vec<&Operation> = self.seen.values().collect();
        recent.sort_by_key(|op| std::cmp::Reverse(op.deadline));
        let mut op = recent[k % recent.len()].clone();
        // The probe speaks for the run's current owner, so that the executor
        // compares the input instead of fencing an old epoch.
        op.epoch = self.run.epoch();
        let other_lease = || contract::LeaseId::new("lease", "conflicting-lease").ok();
        op.input = match op.input {
            OperationInput::CreateLease { template } => {
                let mut t = (*template).clone();
                t.image.push_str("-conflict");
                OperationInput::CreateLease {
                    template: Arc::new(t),
                }
            }
            OperationInput::LookupEndpoint { lease } => OperationInput::DestroyLease { lease: Some(lease) },
            OperationInput::StartBootstrap { .. } => OperationInput::CancelBootstrap {
                session: SessionId::new("session", "conflicting-session").ok(),
            },
            OperationInput::CancelBootstrap { .. } => OperationInput::DestroyLease { lease: other_lease() },
            OperationInput::DestroyLease { .. } => OperationInput::DestroyLease { lease: other_lease() },
        };
        let outputs = self.exec.submit(op.clone(), self.now);
        if self.record {
            self.events.push(Event::ConflictProbe {
                op,
                outputs: outputs.clone(),
            });
        }
        // The probe's rejection goes to the probing client; anything else the
        // executor does is real and is carried out.
        let rest = outputs
            .into_iter()
            .filter(|o| !matches!(o, Output::Rejected(_)))
            .collect();
        self.handle_outputs(rest);
    }

    /// The driver process restarts: it loads the run from its store under a new
    /// epoch, claims that epoch at the executor, and resynchronises the link.
    /// Messages in flight to the old process and its unsent acknowledgements are
    /// lost. Returns whether the run was found in the store.
    pub fn restart_driver(&mut self) -> anyhow::Result<bool> {
        let uid = self.run.uid();
        let Some(stored) = self.store.load_all()?.into_iter().find(|r| r.meta.uid == uid) else {
            return Ok(false);
        };
        self.restore_from(stored)?;
        Ok(true)
    }

    /// Replaces the driver's state with `stored` under the next epoch (a driver
    /// restart; mutants use it to restart from a tampered store).
    pub fn restore_from(&mut self, stored: driver_svc::core::StoredRun) -> anyhow::Result<()> {
        let epoch = self
            .run
            .epoch()
            .next()
            .ok_or_else(|| anyhow::anyhow!("epochs exhausted"))?;
        let before = self.snapshot_if_recording();
        self.run = RunState::restore(stored, epoch, Arc::clone(&self.policy));
        if let Some(before) = before {
            self.transition(Cause::Restore, before);
        }
        // The new epoch is durable before the new process claims it.
        let released = self.run.take_commit().persist_to(&self.store)?;
        debug_assert!(released.operations.is_empty() && released.acks.is_empty());
        // A new process: a new session, and a new stream if the network is up.
        let up = !self.link_down();
        self.session = LinkSession::new();
        self.transit.clear();
        if up {
            self.connect()?;
        }
        Ok(())
    }

    /// Applies a shape update as the driver's actor does: an accepted change is
    /// committed before the client hears of it.
    pub fn apply_shape(&mut self, shape: ClusterShape) -> anyhow::Result<Result<Applied, ApplyError>> {
        let before = self.snapshot_if_recording();
        let r = self.run.apply_shape(shape);
        if matches!(r, Ok(Applied::Changed)) {
            let released = self.run.take_commit().persist_to(&self.store)?;
            self.session.handle_released(released, &mut self.run);
            self.transmit(None)?;
            if let Some(before) = before {
                self.transition(Cause::Apply, before);
            }
        }
        Ok(r)
    }

    /// Deletes the run as the driver's actor does (committed at once).
    pub fn delete_run(&mut self) -> anyhow::Result<bool> {
        let changed = self.run.delete();
        if changed {
            let released = self.run.take_commit().persist_to(&self.store)?;
            self.session.handle_released(released, &mut self.run);
            self.transmit(None)?;
        }
        Ok(changed)
    }

    /// Advances the virtual clock.
    pub fn advance(&mut self, ms: u64) {
        self.now = UnixMillis::new(self.now.as_millis().saturating_add(ms));
        self.fake.advance(self.now);
    }

    pub fn describe(&self) -> String {
        let mut stages: BTreeMap<&str, usize> = BTreeMap::new();
        for n in self.run.nodes() {
            *stages.entry(n.stage.name()).or_default() += 1;
        }
        format!(
            "nodes={} stages={stages:?} pending={} transit={} backend={} inventory={}",
            self.run.node_count(),
            self.run.pending_count(),
            self.transit.len(),
            self.backend.values().map(Vec::len).sum::<usize>(),
            self.fake.inventory().len()
        )
    }

    /// Slots whose resources belong to more than one attempt at once (what
    /// a rollout without surge never makes).
    pub fn slots_with_two_attempts(&self) -> Vec<LogicalNodeId> {
        self.slots_over(1)
    }

    /// Slots whose resources belong to more than `most` attempts at once
    /// (with surge, a slot holds its current attempt and one successor).
    pub fn slots_over(&self, most: usize) -> Vec<LogicalNodeId> {
        let mut per_slot: BTreeMap<LogicalNodeId, BTreeSet<contract::AttemptId>> = BTreeMap::new();
        for r in self.fake.inventory() {
            per_slot
                .entry(r.identity.node.clone())
                .or_default()
                .insert(r.identity.attempt);
        }
        per_slot
            .into_iter()
            .filter(|(_, a)| a.len() > most)
            .map(|(s, _)| s)
            .collect()
    }
}

/// A hash of a slot's name (FNV-1a), stable across runs.
pub fn node_key(n: &LogicalNodeId) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in n.group().as_str().bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    mix64(h ^ u64::from(n.index()))
}
