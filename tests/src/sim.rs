//! The three cores composed in memory on a virtual clock.
//!
//! The driver's [`RunState`], the pure decider and the executor's
//! [`ExecutorCore`] over the fake provider, wired the way the services wire
//! them, with every message passing through a delivery queue that can deliver in
//! order or delay, reorder and duplicate. Time only moves when the simulation
//! moves it, so a run is a pure function of its seed and inputs.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    sync::Arc,
};

use contract::{
    ClusterShape, Epoch, LogicalNodeId, Observation, Operation, OperationId, OperationResult, Outcome,
    Rejection, RunUid, UnixMillis,
};
use driver_svc::core::{AckRef, MemStore, PassOutcome, Policy, RunState};
use executor_svc::{
    core::{ExecutorCore, Output},
    fake::{FakeConfig, FakeProvider},
};

/// How results and observations travel back to the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// In order, right after they happen.
    InOrder,
    /// Delayed by a random number of steps, reordered and sometimes duplicated.
    Chaotic,
}

/// A message from the executor to the driver.
#[derive(Debug, Clone)]
pub enum ToDriver {
    Result(OperationResult),
    Observation(Observation),
    Rejection(Rejection),
}

/// Something that happened, for checks over the whole trace.
#[derive(Debug, Clone)]
pub enum Event {
    /// An operation reached the executor; `recorded` says whether the driver's
    /// committed store held it pending at that moment.
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
}

#[derive(Debug, Clone)]
pub struct PassSummary {
    pub at: UnixMillis,
    pub operations: usize,
    pub transitions: u32,
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
        contract::backoff::mix64(self.0)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

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
    /// Acknowledgements on their way to the executor.
    acks: Vec<AckRef>,
    step: u64,
    pub events: Vec<Event>,
    pub passes: u64,
    /// The link is down: nothing is submitted or delivered.
    pub link_down: bool,
    /// Operations the driver submitted while the link was down (lost).
    pub lost_submissions: u64,
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
        let run = RunState::create(shape, uid, epoch, Arc::new(policy), START)?;
        let mut exec = ExecutorCore::default();
        exec.claim(&contract::Claim {
            run_uid: uid,
            run_id: run.run_id().clone(),
            epoch,
        })
        .map_err(|r| anyhow::anyhow!("claim rejected: {r:?}"))?;
        Ok(Self {
            now: START,
            run,
            store: MemStore::new(),
            exec,
            fake: FakeProvider::new(fake),
            delivery,
            rng: Rng::new(seed ^ 0xdead_beef),
            backend: BTreeMap::new(),
            transit: VecDeque::new(),
            acks: Vec::new(),
            step: 0,
            events: Vec::new(),
            passes: 0,
            link_down: false,
            lost_submissions: 0,
        })
    }

    /// Runs one pass if the run wants one. Returns whether a pass ran.
    pub fn pass(&mut self) -> anyhow::Result<bool> {
        if !self.run.needs_pass(self.now) {
            return Ok(false);
        }
        let plan = self.run.begin_pass(self.now)?;
        let output = {
            let view = self.run.desired_view();
            let slots = self.run.slot_set();
            decider::decide(&view, self.run.plan_nodes(&plan), &slots, self.now)
        };
        let outcome: PassOutcome = self
            .run
            .apply_decisions(plan, output, self.now, &mut self.store)?;
        self.passes += 1;
        self.events.push(Event::Pass(PassSummary {
            at: self.now,
            operations: outcome.operations.len(),
            transitions: outcome.transitions,
        }));
        self.acks.extend(outcome.acks);
        for op in outcome.operations {
            self.submit(op);
        }
        Ok(true)
    }

    fn recorded_pending(&self, op: &Operation) -> bool {
        use driver_svc::core::RunStore;
        self.store.load_all().is_ok_and(|runs| {
            runs.iter().any(|r| {
                r.meta.uid == op.run_uid
                    && r.nodes
                        .iter()
                        .any(|n| n.node.id == op.node && n.node.pending.is_some_and(|p| p.id == op.id))
            })
        })
    }

    /// Sends an operation to the executor.
    pub fn submit(&mut self, op: Operation) {
        if self.link_down {
            self.lost_submissions += 1;
            return;
        }
        let recorded = self.recorded_pending(&op);
        self.events.push(Event::Submitted {
            op: op.clone(),
            recorded,
        });
        let outputs = self.exec.submit(op.clone(), self.now);
        self.handle_outputs(outputs);
    }

    fn handle_outputs(&mut self, outputs: Vec<Output>) {
        for o in outputs {
            match o {
                Output::Start(op) => {
                    self.events.push(Event::Started(op.clone()));
                    let call = self.fake.execute(&op, self.now);
                    let due = self.now.checked_add(call.latency).unwrap_or(UnixMillis::MAX);
                    self.backend.entry(due).or_default().push((op, call.outcome));
                }
                Output::Abort { run_uid, id } => {
                    // The shell cancels the backend call; its effect on the
                    // provider stays as it was (ambiguity is real).
                    for calls in self.backend.values_mut() {
                        calls.retain(|(op, _)| !(op.run_uid == run_uid && op.id == id));
                    }
                }
                Output::Result(r) => self.send(ToDriver::Result(r)),
                Output::Rejected(rej) => self.send(ToDriver::Rejection(rej)),
                Output::Observation(o) => self.send(ToDriver::Observation(o)),
            }
        }
    }

    fn send(&mut self, m: ToDriver) {
        let at = match self.delivery {
            Delivery::InOrder => self.step,
            Delivery::Chaotic => self.step + self.rng.below(4),
        };
        if self.delivery == Delivery::Chaotic && self.rng.chance(0.1) {
            let again = self.step + self.rng.below(6);
            self.transit.push_back((again, m.clone()));
        }
        self.transit.push_back((at, m));
    }

    /// Delivers every message due at this step to the driver (in a shuffled
    /// order when chaotic), then the acknowledgements to the executor.
    pub fn deliver(&mut self) -> anyhow::Result<usize> {
        if self.link_down {
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
            for i in (1..due.len()).rev() {
                let j = self.rng.below(i as u64 + 1) as usize;
                due.swap(i, j);
            }
        }
        let n = due.len();
        for m in due {
            match m {
                ToDriver::Result(r) => {
                    let _ = self.run.fold_result(&r, self.now)?;
                }
                ToDriver::Observation(o) => {
                    let _ = self.run.fold_observation(&o, self.now)?;
                }
                ToDriver::Rejection(rej) => {
                    let _ = self.run.fold_rejection(&rej, self.now)?;
                }
            }
        }
        // Folds are acknowledged only once committed.
        let acks = self.run.commit(&mut self.store)?;
        self.acks.extend(acks);
        self.flush_acks();
        let uid = self.run.uid();
        for session in self.run.take_replays() {
            for o in self.exec.observations_after(uid, &session, 0) {
                self.send(ToDriver::Observation(o));
            }
        }
        Ok(n)
    }

    fn flush_acks(&mut self) {
        let uid = self.run.uid();
        for a in std::mem::take(&mut self.acks) {
            match a {
                AckRef::Result(id) => self.exec.ack_result(uid, id),
                AckRef::Observation { session, seq } => self.exec.ack_observations(uid, &session, seq),
            }
        }
    }

    /// Completes backend calls and emits observations due by now.
    fn run_backend(&mut self) {
        let due: Vec<UnixMillis> = self.backend.range(..=self.now).map(|(t, _)| *t).collect();
        for t in due {
            for (op, outcome) in self.backend.remove(&t).unwrap_or_default() {
                self.events.push(Event::Completed {
                    run_uid: op.run_uid,
                    id: op.id,
                    outcome: outcome.clone(),
                });
                let outputs = self.exec.complete(op.run_uid, op.id, outcome, self.now);
                self.handle_outputs(outputs);
            }
        }
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

    /// One step: a pass if wanted, backend progress, delivery. When nothing is
    /// due now, the clock jumps to the next event.
    pub fn step(&mut self) -> anyhow::Result<()> {
        self.step += 1;
        self.pass()?;
        self.run_backend();
        let delivered = self.deliver()?;
        let idle = delivered == 0
            && !self.run.needs_pass(self.now)
            && self.transit.is_empty()
            && self.backend.range(..=self.now).next().is_none();
        if idle
            && let Some(t) = self.next_event_at()
            && t > self.now
        {
            self.now = t;
        }
        Ok(())
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

    /// Restores the link: the driver resubmits every pending operation and asks
    /// for observations after the last folded sequence.
    pub fn reconnect(&mut self) {
        self.link_down = false;
        // Unacknowledged results and observations come again on a new stream.
        for r in self.exec.unacked_results() {
            if r.run_uid == self.run.uid() {
                self.send(ToDriver::Result(r));
            }
        }
        let uid = self.run.uid();
        for (session, after) in self.run.observation_cursors() {
            for o in self.exec.observations_after(uid, &session, after) {
                self.send(ToDriver::Observation(o));
            }
        }
        for op in self.run.inflight_operations() {
            self.submit(op);
        }
    }

    /// Advances the virtual clock.
    pub fn advance(&mut self, ms: u64) {
        self.now = UnixMillis::new(self.now.as_millis().saturating_add(ms));
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

    /// Slots whose resources belong to more than one attempt at once.
    pub fn slots_with_two_attempts(&self) -> Vec<LogicalNodeId> {
        let mut per_slot: BTreeMap<LogicalNodeId, BTreeSet<contract::AttemptId>> = BTreeMap::new();
        for r in self.fake.inventory() {
            per_slot
                .entry(r.identity.node.clone())
                .or_default()
                .insert(r.identity.attempt);
        }
        per_slot
            .into_iter()
            .filter(|(_, a)| a.len() > 1)
            .map(|(s, _)| s)
            .collect()
    }
}
