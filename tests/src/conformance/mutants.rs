//! Deliberately broken variants of the system, to show the oracle can fail.
//!
//! The cores cannot be edited from here, so each mutant is a test-only fault
//! injection at the harness's seams ([`crate::sim::Tamper`]): it bends the
//! decider's answer before the driver applies it, the operation stream between
//! driver and executor, the executor's answers, the backend's calls, the message
//! the driver folds, the driver's store, or (for two state-only guarantees) the
//! snapshot the oracle reads. Each one breaks one guarantee the way a real bug
//! would, and [`Mutant::expected`] names the check that must catch it.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use contract::{
    Action, AttemptId, ClusterShape, DecideOutput, Effect, Generation, GroupId, LeaseId, LogicalNodeId,
    Operation, OperationId, OperationInput, OperationResult, Outcome, PendingOp, ResultFacts, Rule,
    UnixMillis,
};
use driver_svc::core::{RunDelta, RunStore};
use executor_svc::{
    core::Output,
    fake::{FakeCall, FakeProvider},
};

use super::{oracle::Guarantee, record::StepRecord};
use crate::sim::{Event, Sim, Tamper, ToDriver};

/// The mutants, one or more per guarantee.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// The driver restarts with its attempt allocator reset to 1.
    ReuseAttemptIds,
    /// A result for another attempt or operation is folded into the node's
    /// current pending operation.
    FoldIntoCurrentAttempt,
    /// The replacement attempt's record shows its predecessor's lease.
    CarryFactsIntoReplacement,
    /// Operations are submitted before the pass that records them is committed.
    SubmitBeforeCommit,
    /// A second operation is recorded and submitted for a node with one pending.
    SecondPendingOperation,
    /// The executor starts a submitted operation even when its attempt is busy.
    EagerExecutor,
    /// The executor re-runs a completed operation instead of replaying it.
    DropDedupTable,
    /// A destroyed node's record keeps its lease.
    DestroyedKeepsLease,
    /// A failed cancel or destroy is folded as a success.
    ForgetOnFailedCleanup,
    /// A cancel goes out as a destroy.
    DestroyBeforeCancel,
    /// Cleanup of a failed attempt waits for the restart backoff.
    BackoffBeforeCleanup,
    /// "Not ready" is folded as a failure.
    NotReadyCountsAsFailure,
    /// An ambiguous create is destroyed by identity instead of re-issued.
    DestroyBeforeAdopt,
    /// A destroyed node restarts without waiting for its backoff.
    RestartWithoutBackoff,
    /// Once the run is converged, every node is probed again.
    ReprobeReady,
    /// A process-global counter leaks into backend latencies.
    Nondeterministic,
    /// A pass applies only its first two actions.
    OrderDependent,
    /// The first slot never starts its bootstrap.
    ForgetOneSlot,
    /// A deleting node whose slot is still desired restarts before its cleanup.
    RestartBeforeCleanup,
    /// The decider answers twice for one node.
    TwoActionsForOneNode,
    /// The driver queues another full pass after every step.
    AlwaysFollowUp,
    /// A pass at a saturated clock panics (the probe's outcome, as the oracle
    /// reads it, says so).
    PanicAtSaturatedClock,
    /// A driver that takes other content at the same generation as a bump.
    LenientRevision,
    /// The backend destroys and re-creates instead of adopting.
    RecreateInsteadOfAdopt,
    /// The backend says a destroy of an undesired slot succeeded and keeps it.
    DestroyLies,
    /// The driver ignores a lost resource (as if it named another attempt).
    IgnoreLoss,
    /// The driver cleans up after a lost resource but never restarts its
    /// slot: the restart it is due waits forever.
    NeverRestartAfterLoss,
    /// The decider grants every remediation its budget holds.
    IgnoreRemediationBudget,
    /// The driver takes an unhealthy report for a healthy one.
    HideUnhealthy,
    /// The decider replaces every drifted node its rollout budget holds.
    IgnoreRolloutBudget,
    /// The decider gives every drifted node its rollout budget holds a
    /// successor, whatever the group's `max_surge`.
    IgnoreSurgeBudget,
    /// Once a halted rollout is reverted, the driver tries the template it
    /// reverted from again, as a new generation of its own (a rollback
    /// loop).
    RevertLoop,
}

impl Mutant {
    pub const ALL: [Mutant; 32] = [
        Mutant::ReuseAttemptIds,
        Mutant::FoldIntoCurrentAttempt,
        Mutant::CarryFactsIntoReplacement,
        Mutant::SubmitBeforeCommit,
        Mutant::SecondPendingOperation,
        Mutant::EagerExecutor,
        Mutant::DropDedupTable,
        Mutant::DestroyedKeepsLease,
        Mutant::ForgetOnFailedCleanup,
        Mutant::DestroyBeforeCancel,
        Mutant::BackoffBeforeCleanup,
        Mutant::NotReadyCountsAsFailure,
        Mutant::DestroyBeforeAdopt,
        Mutant::RestartWithoutBackoff,
        Mutant::ReprobeReady,
        Mutant::Nondeterministic,
        Mutant::OrderDependent,
        Mutant::ForgetOneSlot,
        Mutant::RestartBeforeCleanup,
        Mutant::TwoActionsForOneNode,
        Mutant::AlwaysFollowUp,
        Mutant::PanicAtSaturatedClock,
        Mutant::LenientRevision,
        Mutant::RecreateInsteadOfAdopt,
        Mutant::DestroyLies,
        Mutant::IgnoreLoss,
        Mutant::NeverRestartAfterLoss,
        Mutant::IgnoreRemediationBudget,
        Mutant::HideUnhealthy,
        Mutant::IgnoreRolloutBudget,
        Mutant::IgnoreSurgeBudget,
        Mutant::RevertLoop,
    ];

    /// The guarantee whose check must catch the mutant.
    pub fn expected(self) -> Guarantee {
        match self {
            Mutant::ReuseAttemptIds => Guarantee::G01AttemptIdsUniqueIncreasing,
            Mutant::FoldIntoCurrentAttempt => Guarantee::G02FoldOnlyIntoNamedAttempt,
            Mutant::CarryFactsIntoReplacement => Guarantee::G03RetiredFactsNeverCarried,
            Mutant::SubmitBeforeCommit => Guarantee::G04RecordedBeforeSubmitted,
            Mutant::SecondPendingOperation => Guarantee::G05OnePendingPerNode,
            Mutant::EagerExecutor => Guarantee::G06OneRunningPerAttempt,
            Mutant::DropDedupTable => Guarantee::G07ResubmitReplaysConflictRejected,
            Mutant::DestroyedKeepsLease => Guarantee::G08DestroyedHoldsNothing,
            Mutant::ForgetOnFailedCleanup => Guarantee::G09FailedCleanupKeepsFacts,
            Mutant::DestroyBeforeCancel => Guarantee::G10CleanupOrdered,
            Mutant::BackoffBeforeCleanup => Guarantee::G11FailedAttemptCleansUpAtOnce,
            Mutant::NotReadyCountsAsFailure => Guarantee::G12NotReadyIsNotAFailure,
            Mutant::DestroyBeforeAdopt => Guarantee::G13AdoptBeforeDestroy,
            Mutant::RestartWithoutBackoff => Guarantee::G14BackoffFollowsPolicy,
            Mutant::ReprobeReady => Guarantee::G15ConvergedPassIsNoop,
            Mutant::Nondeterministic | Mutant::OrderDependent => Guarantee::G16Deterministic,
            Mutant::LenientRevision => Guarantee::G17GenerationMonotonic,
            Mutant::ForgetOneSlot => Guarantee::G18FairConvergence,
            Mutant::RestartBeforeCleanup => Guarantee::G19ScaleDownHighestNoTwoLive,
            Mutant::TwoActionsForOneNode | Mutant::AlwaysFollowUp | Mutant::PanicAtSaturatedClock => {
                Guarantee::G20NoPanicNoSpin
            }
            Mutant::RecreateInsteadOfAdopt => Guarantee::NoDoubleCreate,
            Mutant::DestroyLies | Mutant::IgnoreLoss => Guarantee::ConvergedLeaksNothing,
            Mutant::NeverRestartAfterLoss => Guarantee::G21LostSlotRecovers,
            Mutant::IgnoreRemediationBudget => Guarantee::G22RemediationWithinBudget,
            Mutant::HideUnhealthy => Guarantee::G23ConvergedMeansObserved,
            Mutant::IgnoreRolloutBudget => Guarantee::G24RolloutWithinBudget,
            Mutant::IgnoreSurgeBudget => Guarantee::G19ScaleDownHighestNoTwoLive,
            Mutant::RevertLoop => Guarantee::G25RevertNeverReentersBadTemplate,
        }
    }

    /// Installs the mutant's hooks into the simulation.
    pub fn install(self, sim: &mut Sim) {
        sim.tamper = Some(Box::new(Hooks {
            mutant: self,
            done: false,
            dropped: false,
            undesired: BTreeSet::new(),
            shapes: BTreeMap::new(),
            looped: BTreeSet::new(),
        }));
    }

    /// The mutant's tampering with the snapshot the oracle reads, if it has one.
    pub fn view(self) -> Option<ViewTamper> {
        matches!(
            self,
            Mutant::CarryFactsIntoReplacement | Mutant::DestroyedKeepsLease | Mutant::PanicAtSaturatedClock
        )
        .then(|| ViewTamper {
            mutant: self,
            leases: BTreeMap::new(),
        })
    }
}

/// A process-global counter: exactly the kind of hidden state that makes two
/// runs of one trace differ.
static GLOBAL: AtomicU64 = AtomicU64::new(0);

#[derive(Debug)]
struct Hooks {
    mutant: Mutant,
    done: bool,
    dropped: bool,
    /// Slots the last pass saw as undesired (for `DestroyLies`).
    undesired: BTreeSet<LogicalNodeId>,
    /// The run's shape at each generation a pass saw (for `RevertLoop`).
    shapes: BTreeMap<u64, ClusterShape>,
    /// Reverting generations already looped back (for `RevertLoop`).
    looped: BTreeSet<u64>,
}

impl Tamper for Hooks {
    fn decisions(&mut self, sim: &Sim, out: &mut DecideOutput) {
        let run = &sim.run;
        let now = sim.now;
        if self.mutant == Mutant::RevertLoop {
            let shape = run.shape();
            self.shapes
                .entry(shape.generation.get())
                .or_insert_with(|| shape.clone());
        }
        match self.mutant {
            Mutant::BackoffBeforeCleanup => {
                for d in &mut out.decisions {
                    let Some(n) = run.node(&d.node) else { continue };
                    if matches!(d.action, Action::Dispatch(_))
                        && matches!(
                            d.rule,
                            Rule::ReissueCreate | Rule::CancelBootstrap | Rule::DestroyLease
                        )
                        && n.retry.next_effect_at.is_none()
                        && let Some(t) = n.retry.restart_at.filter(|t| *t > now)
                    {
                        d.action = Action::Wait { until: Some(t) };
                    }
                }
            }
            Mutant::DestroyBeforeAdopt => {
                for d in &mut out.decisions {
                    if d.rule == Rule::ReissueCreate && d.action == Action::Dispatch(Effect::CreateLease) {
                        d.rule = Rule::DestroyLease;
                        d.action = Action::Dispatch(Effect::DestroyLease);
                    }
                }
            }
            Mutant::RestartWithoutBackoff => {
                for d in &mut out.decisions {
                    let permanent = run.node(&d.node).is_some_and(|n| n.retry.permanent.is_some());
                    if d.rule == Rule::RestartBackoff && !permanent {
                        d.rule = Rule::Restart;
                        d.action = Action::Restart;
                    }
                }
            }
            Mutant::ReprobeReady if run.is_converged() => {
                for d in &mut out.decisions {
                    if d.rule == Rule::Ready {
                        d.rule = Rule::LookupEndpoint;
                        d.action = Action::Dispatch(Effect::LookupEndpoint);
                    }
                }
            }
            Mutant::OrderDependent => {
                let mut actions = 0;
                let before = out.decisions.len();
                out.decisions.retain(|d| {
                    if matches!(d.action, Action::Wait { .. }) {
                        return true;
                    }
                    actions += 1;
                    actions <= 2
                });
                self.dropped |= out.decisions.len() < before;
            }
            Mutant::ForgetOneSlot => {
                let first = run.nodes().map(|n| n.id.clone()).next();
                for d in &mut out.decisions {
                    if Some(&d.node) == first.as_ref() && d.action == Action::Dispatch(Effect::StartBootstrap)
                    {
                        d.rule = Rule::AwaitBootstrap;
                        d.action = Action::Wait { until: None };
                    }
                }
            }
            Mutant::RestartBeforeCleanup => {
                let view = run.desired_view();
                for d in &mut out.decisions {
                    if matches!(d.rule, Rule::CancelBootstrap | Rule::DestroyLease)
                        && matches!(d.action, Action::Dispatch(_))
                        && view.template_for(&d.node).is_some()
                    {
                        d.rule = Rule::Restart;
                        d.action = Action::Restart;
                    }
                }
            }
            Mutant::NeverRestartAfterLoss => {
                for d in &mut out.decisions {
                    let lost = run.node(&d.node).is_some_and(|n| n.facts.lost);
                    if lost && d.action == Action::Restart {
                        d.rule = Rule::RestartBackoff;
                        d.action = Action::Wait { until: None };
                    }
                }
            }
            Mutant::IgnoreRemediationBudget => {
                for d in &mut out.decisions {
                    if d.rule == Rule::RemediationBudget {
                        d.rule = Rule::BeginDelete;
                        d.action = Action::BeginDelete;
                    }
                }
            }
            Mutant::IgnoreRolloutBudget => {
                for d in &mut out.decisions {
                    if d.rule == Rule::RolloutBudget {
                        d.rule = Rule::BeginDelete;
                        d.action = Action::BeginDelete;
                    }
                }
            }
            Mutant::IgnoreSurgeBudget => {
                for d in &mut out.decisions {
                    if d.rule == Rule::RolloutBudget && run.successor(&d.node).is_none() {
                        d.rule = Rule::SurgeInsert;
                        d.action = Action::Surge;
                    }
                }
            }
            Mutant::TwoActionsForOneNode => {
                if let Some(d) = out
                    .decisions
                    .iter()
                    .find(|d| !matches!(d.action, Action::Wait { .. }))
                    .cloned()
                {
                    out.decisions.push(d);
                }
            }
            Mutant::DestroyLies => {
                let view = run.desired_view();
                self.undesired = run
                    .nodes()
                    .filter(|n| view.template_for(&n.id).is_none())
                    .map(|n| n.id.clone())
                    .collect();
            }
            _ => {}
        }
    }

    fn submits_before_commit(&self) -> bool {
        self.mutant == Mutant::SubmitBeforeCommit
    }

    fn submit(&mut self, sim: &mut Sim, op: &mut Operation) -> Vec<Operation> {
        match self.mutant {
            Mutant::DestroyBeforeCancel => {
                if let OperationInput::CancelBootstrap { .. } = op.input {
                    let lease = sim.run.node(&op.node).and_then(|n| n.facts.lease.clone());
                    op.input = OperationInput::DestroyLease { lease };
                }
                Vec::new()
            }
            Mutant::SecondPendingOperation if !self.done => {
                let uid = sim.run.uid();
                let Some(mut stored) = sim
                    .store
                    .load_all()
                    .ok()
                    .and_then(|runs| runs.into_iter().find(|r| r.meta.uid == uid))
                    .and_then(|r| r.nodes.into_iter().find(|n| n.node.id == op.node))
                else {
                    return Vec::new();
                };
                self.done = true;
                let mut second = op.clone();
                second.id = OperationId::new(op.id.attempt(), op.id.seq() + 1_000);
                stored.node.pending = Some(PendingOp {
                    id: second.id,
                    effect: second.input.effect(),
                    deadline: second.deadline,
                    dispatched_at: sim.now,
                });
                stored.inflight = Some(Box::new(second.clone()));
                let mut delta = RunDelta::new(uid);
                delta.upserts.push(std::sync::Arc::new(stored));
                let _ = sim.store.commit(&delta);
                vec![second]
            }
            _ => Vec::new(),
        }
    }

    fn executor_submit(&mut self, sim: &mut Sim, op: &Operation, outputs: &mut Vec<Output>) {
        match self.mutant {
            Mutant::EagerExecutor if outputs.is_empty() => outputs.push(Output::Start(op.clone())),
            Mutant::DropDedupTable => {
                for o in outputs.iter_mut() {
                    if let Output::Result(r) = o
                        && r.replayed
                    {
                        // The executor runs the operation again.
                        sim.events.push(Event::Started(op.clone()));
                        let call = sim.fake.execute(op, sim.now);
                        *o = Output::Result(OperationResult {
                            outcome: call.outcome,
                            replayed: false,
                            completed_at: sim.now,
                            ..r.clone()
                        });
                    }
                }
            }
            _ => {}
        }
    }

    fn backend_call(&mut self, fake: &mut FakeProvider, op: &Operation, now: UnixMillis) -> Option<FakeCall> {
        match self.mutant {
            Mutant::Nondeterministic => {
                let mut call = fake.execute(op, now);
                call.latency += Duration::from_millis(GLOBAL.fetch_add(1, Ordering::Relaxed) % 7);
                Some(call)
            }
            Mutant::RecreateInsteadOfAdopt if op.input.effect() == Effect::CreateLease => {
                let identity = op.identity();
                if fake.inventory().iter().any(|r| r.identity == identity) {
                    let mut destroy = op.clone();
                    destroy.input = OperationInput::DestroyLease { lease: None };
                    let _ = fake.execute(&destroy, now);
                }
                None
            }
            Mutant::DestroyLies
                if op.input.effect() == Effect::DestroyLease && self.undesired.contains(&op.node) =>
            {
                Some(FakeCall {
                    latency: Duration::from_millis(2),
                    outcome: Outcome::Succeeded(ResultFacts::default()),
                })
            }
            _ => None,
        }
    }

    fn fold(&mut self, sim: &Sim, msg: &ToDriver) -> Option<ToDriver> {
        if let (Mutant::IgnoreLoss, ToDriver::Change(c)) = (self.mutant, msg)
            && matches!(c.change, contract::Change::Lost { .. })
        {
            return Some(ToDriver::Change(contract::ResourceChange {
                attempt: AttemptId::new(c.attempt.get().saturating_add(1 << 40)),
                ..c.clone()
            }));
        }
        if let (Mutant::HideUnhealthy, ToDriver::Change(c)) = (self.mutant, msg)
            && let contract::Change::Health { healthy: false, .. } = c.change
        {
            return Some(ToDriver::Change(contract::ResourceChange {
                change: contract::Change::Health {
                    healthy: true,
                    detail: "probe answered".to_owned(),
                },
                ..c.clone()
            }));
        }
        let ToDriver::Result(r) = msg else { return None };
        match self.mutant {
            Mutant::FoldIntoCurrentAttempt => {
                let p = sim.run.node(&r.node)?.pending?;
                (p.id != r.id).then(|| {
                    ToDriver::Result(OperationResult {
                        id: p.id,
                        effect: p.effect,
                        late: false,
                        ..r.clone()
                    })
                })
            }
            Mutant::ForgetOnFailedCleanup
                if matches!(r.effect, Effect::CancelBootstrap | Effect::DestroyLease)
                    && !matches!(r.outcome, Outcome::Succeeded(_)) =>
            {
                Some(ToDriver::Result(OperationResult {
                    outcome: Outcome::Succeeded(ResultFacts::default()),
                    ..r.clone()
                }))
            }
            Mutant::NotReadyCountsAsFailure if matches!(r.outcome, Outcome::NotReady { .. }) => {
                Some(ToDriver::Result(OperationResult {
                    outcome: Outcome::Retryable {
                        reason: "not ready".to_owned(),
                    },
                    ..r.clone()
                }))
            }
            _ => None,
        }
    }

    fn after_step(&mut self, sim: &mut Sim) {
        match self.mutant {
            Mutant::ReuseAttemptIds if !self.done && sim.run.meta().next_attempt > 3 => {
                let uid = sim.run.uid();
                if let Some(mut stored) = sim
                    .store
                    .load_all()
                    .ok()
                    .and_then(|runs| runs.into_iter().find(|r| r.meta.uid == uid))
                {
                    self.done = true;
                    stored.meta.next_attempt = 1;
                    let _ = sim.restore_from(stored);
                }
            }
            Mutant::OrderDependent if std::mem::take(&mut self.dropped) => sim.run.mark_all_dirty(),
            Mutant::AlwaysFollowUp => sim.run.mark_all_dirty(),
            Mutant::RevertLoop => {
                let shape = sim.run.shape().clone();
                let reverts: Vec<(GroupId, u64, u64)> = sim
                    .run
                    .meta()
                    .rollouts
                    .iter()
                    .filter_map(|r| Some((r.group.clone(), r.generation.get(), r.reverted_from?.get())))
                    .collect();
                for (group, generation, from) in reverts {
                    let bad = self
                        .shapes
                        .get(&from)
                        .and_then(|s| s.groups.iter().find(|g| g.id == group))
                        .map(|g| g.template.clone());
                    let (Some(bad), true) = (bad, self.looped.insert(generation)) else {
                        continue;
                    };
                    let mut again = shape.clone();
                    again.generation = Generation::new(shape.generation.get() + 1);
                    if let Some(g) = again.groups.iter_mut().find(|g| g.id == group) {
                        g.template = bad;
                    }
                    let _ = sim.apply_shape(again);
                    return;
                }
            }
            _ => {}
        }
    }
}

/// Tampering with what the oracle reads, for checks of state or of probes run
/// on copies: it remembers each attempt's lease and shows it where it must not
/// be, or reports a limit probe as a panic.
#[derive(Debug)]
pub struct ViewTamper {
    mutant: Mutant,
    leases: BTreeMap<LogicalNodeId, (AttemptId, LeaseId)>,
}

impl ViewTamper {
    pub fn tamper(&mut self, rec: &mut StepRecord) {
        if self.mutant == Mutant::PanicAtSaturatedClock {
            for p in &mut rec.probes {
                if let super::record::Probe::Limits { what, panicked, .. } = p
                    && what.contains("saturated")
                {
                    *panicked = Some("attempt to add with overflow".to_owned());
                }
            }
        }
        for (id, n) in rec.state.nodes.iter_mut() {
            let remembered = self.leases.get(id).cloned();
            match (self.mutant, remembered) {
                (Mutant::CarryFactsIntoReplacement, Some((attempt, lease)))
                    if attempt != n.attempt && n.facts.lease.is_none() =>
                {
                    n.facts.lease = Some(lease);
                }
                (Mutant::DestroyedKeepsLease, Some((attempt, lease)))
                    if attempt == n.attempt && n.stage == contract::NodeStage::Destroyed =>
                {
                    n.facts.lease = Some(lease);
                }
                _ => {}
            }
            if let Some(l) = &n.facts.lease {
                // The first attempt's lease is what a carried fact would be;
                // the current attempt's lease is what a destroyed node would keep.
                let keep_first = self.mutant == Mutant::CarryFactsIntoReplacement;
                if !(keep_first && self.leases.contains_key(id)) {
                    self.leases.insert(id.clone(), (n.attempt, l.clone()));
                }
            }
        }
    }
}
