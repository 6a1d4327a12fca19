//! The oracle: the twenty guarantees of SPEC.md section 6, the day-2 ones of
//! section 8 (21: a lost slot recovers; 22: remediation within its budget;
//! 23: converged means observed), plus no double-create and
//! converged-leaks-nothing, each as its own named check.
//!
//! [`Oracle::check`] reads one [`StepRecord`] at a time and keeps what the
//! checks need from earlier rounds. Checks over state snapshots run at every
//! level; checks over events (transitions with their cause, submissions, backend
//! calls, executor messages) run where the system reports events: in memory,
//! and over the real services from their event traces
//! ([`super::traces`]). Guarantee 16 (determinism) and the bound of guarantee 18 are whole-run
//! checks that the runner makes; their functions here are the comparison and the
//! bound it uses. Guarantee 21 is judged when the fair tail ends without
//! converging ([`Oracle::g21_unrecovered`], which the runner asks then); the
//! oracle keeps, round by round, which lost slots are still to recover.
//!
//! Each check's doc comment says exactly what it checks and where it has to
//! approximate.

use std::collections::{BTreeMap, BTreeSet};

use contract::{
    AttemptId, ClusterShape, Decision, Effect, Endpoint, GroupId, Intent, LeaseId, LogicalNodeId,
    ManagedNode, NodeFacts, NodeStage, NodeTemplate, Operation, OperationId, Outcome, RejectionReason,
    RetryState, Rule, RunUid, SessionId, UnixMillis, backoff_delay,
};
use driver_svc::core::{Fold, Policy};
use executor_svc::core::Output;

use super::record::{ApplyKind, ApplyRecord, Probe, RunSnapshot, StepRecord, StepRef, Verdict};
use crate::sim::{Cause, Event, Nodes, ToDriver, Transition};

/// The guarantees, named as SPEC.md section 6 numbers them, plus the two
/// backend-level ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Guarantee {
    G01AttemptIdsUniqueIncreasing,
    G02FoldOnlyIntoNamedAttempt,
    G03RetiredFactsNeverCarried,
    G04RecordedBeforeSubmitted,
    G05OnePendingPerNode,
    G06OneRunningPerAttempt,
    G07ResubmitReplaysConflictRejected,
    G08DestroyedHoldsNothing,
    G09FailedCleanupKeepsFacts,
    G10CleanupOrdered,
    G11FailedAttemptCleansUpAtOnce,
    G12NotReadyIsNotAFailure,
    G13AdoptBeforeDestroy,
    G14BackoffFollowsPolicy,
    G15ConvergedPassIsNoop,
    G16Deterministic,
    G17GenerationMonotonic,
    G18FairConvergence,
    G19ScaleDownHighestNoTwoLive,
    G20NoPanicNoSpin,
    G21LostSlotRecovers,
    G22RemediationWithinBudget,
    G23ConvergedMeansObserved,
    G24RolloutWithinBudget,
    G25RevertNeverReentersBadTemplate,
    NoDoubleCreate,
    ConvergedLeaksNothing,
}

impl Guarantee {
    pub const ALL: [Guarantee; 27] = [
        Guarantee::G01AttemptIdsUniqueIncreasing,
        Guarantee::G02FoldOnlyIntoNamedAttempt,
        Guarantee::G03RetiredFactsNeverCarried,
        Guarantee::G04RecordedBeforeSubmitted,
        Guarantee::G05OnePendingPerNode,
        Guarantee::G06OneRunningPerAttempt,
        Guarantee::G07ResubmitReplaysConflictRejected,
        Guarantee::G08DestroyedHoldsNothing,
        Guarantee::G09FailedCleanupKeepsFacts,
        Guarantee::G10CleanupOrdered,
        Guarantee::G11FailedAttemptCleansUpAtOnce,
        Guarantee::G12NotReadyIsNotAFailure,
        Guarantee::G13AdoptBeforeDestroy,
        Guarantee::G14BackoffFollowsPolicy,
        Guarantee::G15ConvergedPassIsNoop,
        Guarantee::G16Deterministic,
        Guarantee::G17GenerationMonotonic,
        Guarantee::G18FairConvergence,
        Guarantee::G19ScaleDownHighestNoTwoLive,
        Guarantee::G20NoPanicNoSpin,
        Guarantee::G21LostSlotRecovers,
        Guarantee::G22RemediationWithinBudget,
        Guarantee::G23ConvergedMeansObserved,
        Guarantee::G24RolloutWithinBudget,
        Guarantee::G25RevertNeverReentersBadTemplate,
        Guarantee::NoDoubleCreate,
        Guarantee::ConvergedLeaksNothing,
    ];

    /// The guarantee's wording in SPEC.md.
    pub fn text(self) -> &'static str {
        match self {
            Guarantee::G01AttemptIdsUniqueIncreasing => {
                "attempt ids are unique and increasing per run; slot names are {group}-{index}"
            }
            Guarantee::G02FoldOnlyIntoNamedAttempt => {
                "a result or fact is folded only into the attempt and operation it names"
            }
            Guarantee::G03RetiredFactsNeverCarried => {
                "facts of a retired attempt never appear in its replacement's record"
            }
            Guarantee::G04RecordedBeforeSubmitted => {
                "every operation the executor sees was recorded pending in driver state first"
            }
            Guarantee::G05OnePendingPerNode => "at most one pending operation per node, at every instant",
            Guarantee::G06OneRunningPerAttempt => {
                "at most one running operation per attempt inside the executor"
            }
            Guarantee::G07ResubmitReplaysConflictRejected => {
                "resubmitting an operation id replays its result; same id, other input: rejected"
            }
            Guarantee::G08DestroyedHoldsNothing => {
                "a Destroyed node holds no lease, no session, no pending operation"
            }
            Guarantee::G09FailedCleanupKeepsFacts => {
                "failed cleanup keeps its live facts (dead-hold): nothing is forgotten while live"
            }
            Guarantee::G10CleanupOrdered => {
                "cleanup is ordered: cancel bootstrap, then destroy lease, then mark destroyed"
            }
            Guarantee::G11FailedAttemptCleansUpAtOnce => {
                "a failed attempt starts cleanup at once; backoff delays only the restart"
            }
            Guarantee::G12NotReadyIsNotAFailure => "endpoint-not-ready never counts as a failure",
            Guarantee::G13AdoptBeforeDestroy => {
                "after an ambiguous outcome the create is re-issued (adopted) before any destructive step"
            }
            Guarantee::G14BackoffFollowsPolicy => {
                "backoff per node follows the policy; ready resets it; a replacement inherits the count"
            }
            Guarantee::G15ConvergedPassIsNoop => "a pass over a converged run is a no-op",
            Guarantee::G16Deterministic => {
                "identical traces give identical states; the order of independent work does not matter"
            }
            Guarantee::G17GenerationMonotonic => {
                "generation never regresses; rejected updates (same generation, run id) change nothing"
            }
            Guarantee::G18FairConvergence => {
                "once faults stop, the run converges to the latest shape within a bounded number of passes"
            }
            Guarantee::G19ScaleDownHighestNoTwoLive => {
                "scale-down removes only the highest slots; never two live attempts per slot"
            }
            Guarantee::G20NoPanicNoSpin => {
                "no panics, no spins; exhaustion and saturation are errors; at most one action per node"
            }
            Guarantee::G21LostSlotRecovers => {
                "once faults stop, a slot whose resource was lost is ready again on a later attempt within \
                 the fair tail's bound"
            }
            Guarantee::G22RemediationWithinBudget => {
                "remediation never has more than max_in_flight nodes of a group in flight, and never acts \
                 while the group is over max_unhealthy"
            }
            Guarantee::G23ConvergedMeansObserved => {
                "a run is reported converged only when no desired node is lost or unhealthy"
            }
            Guarantee::G24RolloutWithinBudget => {
                "a rollout never has more of a group's desired slots unavailable because of it than \
                 max_unavailable"
            }
            Guarantee::G25RevertNeverReentersBadTemplate => {
                "after a halt with auto-revert, the run converges to the group's last converged \
                 template without passing through the bad one again"
            }
            Guarantee::NoDoubleCreate => "never two resources for one identity (no double-create)",
            Guarantee::ConvergedLeaksNothing => "a converged or deleted run leaves nothing at the backend",
        }
    }
}

/// One broken guarantee.
#[derive(Debug, Clone, PartialEq)]
pub struct Violation {
    pub guarantee: Guarantee,
    pub at: StepRef,
    pub detail: String,
}

/// The pass bound of the fair tail (guarantee 18), as a formula over the run.
///
/// Once faults stop, each node needs at most `ladder` passes to become ready
/// from any state, where every operation counts twice (the pass that folds its
/// result, and a pass woken at its deadline if the result is late):
///
/// - `INFLIGHT = 3`: the operation in flight when faults stopped (2), and a
///   stage timeout or bootstrap failure of the attempt it belongs to (1);
/// - `CLEANUP = 8`: begin-delete and mark-destroyed (2), re-issued create,
///   cancel and destroy (3 operations);
/// - `RESTART = 2`: the wake-up when the restart backoff ends, and the restart;
/// - `CLIMB = 2 × (2 + probes) + 6`: create, `probes` endpoint lookups and the
///   bootstrap start (operations), five bootstrap stages and the observed
///   convergence.
///
/// A node may have to be replaced once more than it fails (its spec drifted,
/// or a repair of a permanently refused spec), so the run's bound is
/// `SLACK + nodes × (2 + repairs) × ladder`, with `nodes` the larger of the slots
/// held and desired when the tail starts. The bound is loose by design (it
/// assumes no two nodes share a pass); it still catches a run that stalls, or
/// one that keeps redoing work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TailBound {
    pub nodes: u64,
    pub probes: u64,
    pub repairs: u64,
}

impl TailBound {
    pub const SLACK: u64 = 10;
    pub const INFLIGHT: u64 = 3;
    pub const CLEANUP: u64 = 8;
    pub const RESTART: u64 = 2;

    pub fn ladder(&self) -> u64 {
        Self::INFLIGHT + Self::CLEANUP + Self::RESTART + 2 * (2 + self.probes) + 6
    }

    pub fn passes(&self) -> u64 {
        Self::SLACK + self.nodes * (2 + self.repairs) * self.ladder()
    }
}

/// Consecutive passes at one instant that change nothing, above which the
/// driver is spinning (guarantee 20). One is normal (a safety tick, a wake-up at
/// an operation's deadline before its grace ends); two can follow a tick that
/// lands on such a wake-up.
pub const MAX_BARREN_PASSES: u32 = 2;

/// The oracle's memory across rounds.
#[derive(Debug)]
pub struct Oracle {
    policy: Policy,
    uid: RunUid,
    at: StepRef,
    now: UnixMillis,
    out: Vec<Violation>,
    /// The latest accepted shape.
    shape: Option<ClusterShape>,
    deleting: bool,
    groups_seen: BTreeSet<GroupId>,
    // Guarantee 1.
    slot_attempt: BTreeMap<LogicalNodeId, AttemptId>,
    /// Each slot's current attempt, and its successor attempt while it
    /// holds one (guarantee 19).
    current_of: BTreeMap<LogicalNodeId, AttemptId>,
    successor_of: BTreeMap<LogicalNodeId, AttemptId>,
    /// The attempts each slot held at some point of the round (what a
    /// backend read during the round may show).
    held_in_round: BTreeMap<LogicalNodeId, BTreeSet<AttemptId>>,
    attempt_slot: BTreeMap<AttemptId, LogicalNodeId>,
    max_attempt: Option<AttemptId>,
    next_attempt: u64,
    first_submit: BTreeMap<OperationId, Operation>,
    /// Slot names already checked.
    slots_ok: BTreeSet<LogicalNodeId>,
    // Guarantee 3.
    lease_owner: BTreeMap<LeaseId, (LogicalNodeId, AttemptId)>,
    endpoint_owner: BTreeMap<Endpoint, (LogicalNodeId, AttemptId)>,
    /// The endpoints are ports the OS hands out (level 3, real agents): a
    /// port freed by a destroyed attempt's agent may be bound again by any
    /// later agent, its own slot's replacement included.
    endpoints_from_os: bool,
    session_owner: BTreeMap<SessionId, (LogicalNodeId, AttemptId)>,
    // Guarantee 6.
    running: BTreeMap<AttemptId, OperationId>,
    // Guarantee 7.
    first_result: BTreeMap<OperationId, (Outcome, UnixMillis)>,
    // Guarantee 10.
    cleanup_rank: BTreeMap<AttemptId, u8>,
    // Guarantee 17.
    generation: u64,
    observed_generation: u64,
    // Guarantee 20.
    barren: (UnixMillis, u32),
    // Guarantee 23: what the executor last reported of each attempt's health,
    // and the attempts it reported lost.
    /// By the report's time and sequence number, as the driver orders them:
    /// a re-sent older report is not the last word (nor, after an executor
    /// restart numbers its reports from 1 again, an older one with a higher
    /// number).
    health_said: BTreeMap<(LogicalNodeId, AttemptId), ((UnixMillis, u64), bool)>,
    lost_said: BTreeSet<(LogicalNodeId, AttemptId)>,
    /// Where the events are read after the state (levels 2 and 3), a report
    /// is the executor's word for guarantee 23 only from the round after the
    /// one whose events show the driver's acknowledgement of it: the driver
    /// acknowledges after its commit, so the state read in that next round
    /// is later than the fold. Reports sent and not yet acknowledged, by
    /// sequence number, and those acknowledged in this round's events.
    said_unacked: BTreeMap<u64, contract::ResourceChange>,
    said_acked: Vec<contract::ResourceChange>,
    /// The round's events were read after its state.
    events_after_state: bool,
    // Guarantee 21: each slot whose resource was lost and that is not yet
    // ready again on a later attempt, with the highest attempt lost and the
    // run's pass count when the loss was first seen.
    lost_slots: BTreeMap<LogicalNodeId, (AttemptId, u64)>,
    /// Slots being replaced for a rollout, until they serve again (G24).
    rolling: BTreeSet<LogicalNodeId>,
    // Guarantee 25.
    /// Generations the client applied; any other generation the run takes
    /// is the driver's own (a revert).
    client_generations: BTreeSet<u64>,
    /// The templates each group was seen converged on (every desired slot
    /// ready on it), in order.
    converged_on: BTreeMap<GroupId, Vec<std::sync::Arc<NodeTemplate>>>,
    /// The template each reverted group went away from, until the client
    /// applies another template to the group.
    reverted_from: BTreeMap<GroupId, std::sync::Arc<NodeTemplate>>,
    /// Groups reverted so far.
    reverts: u64,
    /// The run's pass count in the latest state.
    passes: u64,
    // No double-create.
    leases_made: BTreeMap<(LogicalNodeId, AttemptId), u32>,
    lease_of: BTreeMap<(LogicalNodeId, AttemptId), String>,
    /// Level 3: the agent PID first seen serving each identity.
    pid_of: BTreeMap<(LogicalNodeId, AttemptId), String>,
    /// The context of the submission being read (recorded just before it).
    context: Option<(OperationId, Option<ManagedNode>)>,
    /// Converged leaks nothing, across processes: the mismatch between a
    /// converged run and the backend (the inventory, the process table) read
    /// at the last round, to be read again before it counts.
    mismatch: [Option<Mismatch>; 2],
}

/// A converged run's nodes, the backend's resources and how many it holds.
type Mismatch = (
    BTreeSet<(LogicalNodeId, AttemptId)>,
    BTreeSet<(LogicalNodeId, AttemptId)>,
    usize,
);

/// Where converged-leaks-nothing reads the backend.
#[derive(Debug, Clone, Copy)]
enum Backend {
    Inventory = 0,
    Processes = 1,
}

fn rule_is_cleanup(rule: Rule) -> bool {
    matches!(
        rule,
        Rule::ReissueCreate | Rule::CancelBootstrap | Rule::DestroyLease
    )
}

fn is_failure(o: &Outcome) -> bool {
    matches!(
        o,
        Outcome::Retryable { .. } | Outcome::Permanent { .. } | Outcome::Ambiguous { .. }
    )
}

fn cleanup_rank(effect: Effect) -> Option<u8> {
    match effect {
        Effect::CreateLease => Some(0),
        Effect::CancelBootstrap => Some(1),
        Effect::DestroyLease => Some(2),
        Effect::LookupEndpoint | Effect::StartBootstrap => None,
    }
}

impl Oracle {
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            uid: RunUid::from_u128(0),
            at: StepRef {
                phase: super::record::Phase::Prefix,
                input: None,
                round: 0,
            },
            now: UnixMillis::ZERO,
            out: Vec::new(),
            shape: None,
            deleting: false,
            groups_seen: BTreeSet::new(),
            slot_attempt: BTreeMap::new(),
            current_of: BTreeMap::new(),
            successor_of: BTreeMap::new(),
            held_in_round: BTreeMap::new(),
            attempt_slot: BTreeMap::new(),
            max_attempt: None,
            next_attempt: 0,
            first_submit: BTreeMap::new(),
            slots_ok: BTreeSet::new(),
            lease_owner: BTreeMap::new(),
            endpoint_owner: BTreeMap::new(),
            endpoints_from_os: false,
            session_owner: BTreeMap::new(),
            running: BTreeMap::new(),
            first_result: BTreeMap::new(),
            cleanup_rank: BTreeMap::new(),
            generation: 0,
            observed_generation: 0,
            barren: (UnixMillis::ZERO, 0),
            health_said: BTreeMap::new(),
            lost_said: BTreeSet::new(),
            said_unacked: BTreeMap::new(),
            said_acked: Vec::new(),
            events_after_state: false,
            lost_slots: BTreeMap::new(),
            rolling: BTreeSet::new(),
            client_generations: BTreeSet::new(),
            converged_on: BTreeMap::new(),
            reverted_from: BTreeMap::new(),
            reverts: 0,
            passes: 0,
            leases_made: BTreeMap::new(),
            lease_of: BTreeMap::new(),
            pid_of: BTreeMap::new(),
            context: None,
            mismatch: [None, None],
        }
    }

    /// How many groups the oracle has seen the driver revert.
    pub fn reverts(&self) -> u64 {
        self.reverts
    }

    fn fail(&mut self, guarantee: Guarantee, detail: String) {
        self.out.push(Violation {
            guarantee,
            at: self.at,
            detail,
        });
    }

    /// Checks one round; returns every guarantee it breaks.
    pub fn check(&mut self, rec: &StepRecord) -> Vec<Violation> {
        self.held_in_round = self
            .current_of
            .keys()
            .map(|slot| (slot.clone(), self.slot_may_hold(slot)))
            .collect();
        self.at = rec.at;
        self.now = rec.now;
        self.events_after_state = rec.events_after_state;
        // Reports acknowledged in the previous round's events are behind this
        // round's state.
        for c in std::mem::take(&mut self.said_acked) {
            self.g23_said(&c);
        }
        if !rec.state.gone {
            self.uid = rec.state.uid;
        }
        if let Some(a) = &rec.apply {
            self.g17_revision_contract(a, &rec.state);
            if a.verdict == Verdict::Changed {
                self.client_generations.insert(a.submitted.generation.get());
            }
        }
        // Where the events say when the driver took each shape (level 2's
        // traces), the checks over them read the shape in force then, and the
        // round's state the shape it shows; elsewhere the round's shape is the
        // state's.
        let shapes_in_events = rec.events.iter().any(|e| matches!(e, Event::Shape { .. }));
        if !shapes_in_events {
            self.take_shape(rec.state.shape.as_ref(), rec.state.deleting);
        }
        if rec
            .input
            .as_ref()
            .is_some_and(|i| !matches!(i, super::input::Input::Step(_)))
        {
            // An external input (a tick, an update, a restart) may ask for a pass
            // of its own; passes that change nothing count towards a spin only
            // when nothing from outside asked for them.
            self.barren = (UnixMillis::ZERO, 0);
        }
        for e in &rec.events {
            self.event(e);
        }
        if shapes_in_events {
            self.take_shape(rec.state.shape.as_ref(), rec.state.deleting);
        }
        for p in &rec.probes {
            self.probe(p);
        }
        self.state(rec);
        std::mem::take(&mut self.out)
    }

    /// The run's desired shape (if it shows one) and deletion flag from now on.
    fn take_shape(&mut self, shape: Option<&ClusterShape>, deleting: bool) {
        if let Some(shape) = shape {
            self.g25_new_generation(shape);
            self.groups_seen.extend(shape.groups.iter().map(|g| g.id.clone()));
            self.shape = Some(shape.clone());
        }
        self.deleting = deleting;
    }

    fn event(&mut self, e: &Event) {
        match e {
            Event::Transition(t) => self.transition(t),
            Event::SubmitContext { id, node, .. } => self.context = Some((*id, node.as_deref().cloned())),
            Event::Submitted { op, recorded } => {
                let node = match self.context.take() {
                    Some((id, node)) if id == op.id => node,
                    _ => None,
                };
                self.g04_recorded_before_submitted(op, *recorded);
                self.submission(op, node.as_ref());
            }
            Event::BackendCall {
                op,
                slot_attempts,
                session_running,
                lease_made,
                ..
            } => {
                self.g10_backend_order(op, *session_running);
                self.g19_no_second_attempt_at_backend(op, slot_attempts);
                self.no_double_create_call(op, *lease_made);
            }
            Event::Started(op) => {
                self.g06_start(op);
                self.g07_not_rerun(op);
            }
            Event::Aborted { id, .. } => {
                if self.running.get(&id.attempt()) == Some(id) {
                    self.running.remove(&id.attempt());
                }
            }
            Event::Emitted(ToDriver::Result(r)) => {
                if !r.late && !r.replayed && self.running.get(&r.id.attempt()) == Some(&r.id) {
                    self.running.remove(&r.id.attempt());
                }
                self.g07_results(r);
            }
            // A lost resource is gone: a create for its identity after the
            // loss makes the identity's only lease, not a second one.
            Event::Emitted(ToDriver::Change(c)) => {
                if let contract::Change::Lost { .. } = &c.change {
                    self.leases_made.remove(&(c.node.clone(), c.attempt));
                    self.lease_of.remove(&(c.node.clone(), c.attempt));
                    self.g21_lost(&c.node, c.attempt);
                }
                if self.events_after_state {
                    self.said_unacked.insert(c.seq, c.clone());
                } else {
                    self.g23_said(c);
                }
            }
            Event::ChangesAcknowledged(seqs) => {
                for seq in seqs {
                    if let Some(c) = self.said_unacked.remove(seq) {
                        self.said_acked.push(c);
                    }
                }
            }
            Event::ConflictProbe { op, outputs } => self.g07_conflict(op, outputs),
            Event::Pass(p) => {
                self.g15_converged_pass(p.converged_before, p.actions, p.operations, p.changed);
                self.g20_spin(p.at, p.operations == 0 && p.transitions == 0 && !p.changed);
            }
            Event::Spin { at } => self.fail(
                Guarantee::G20NoPanicNoSpin,
                format!(
                    "at {at:?} the driver's next wake-up is already due but it has no pass to run: \
                     its timer fires again at once, a busy loop until time moves on"
                ),
            ),
            Event::Shape { shape, deleting } => self.take_shape(Some(shape), *deleting),
            Event::Emitted(_) | Event::Completed { .. } => {}
        }
    }

    fn transition(&mut self, t: &Transition) {
        // A loss the driver found itself (the inventory resync) is folded
        // without the executor having said it.
        if let Cause::Fold {
            msg: ToDriver::Change(c),
            verdict: Fold::Folded,
        } = &t.cause
            && matches!(c.change, contract::Change::Lost { .. })
        {
            self.g21_lost(&c.node, c.attempt);
        }
        if t.before != t.after || t.successors.as_ref().is_some_and(|s| s.before != s.after) {
            // Something changed, so the next pass has something to look at.
            self.barren = (t.at, 0);
        }
        let (current, successors) = views(t);
        // Attempts handed out in one transition, to current attempts and
        // successors alike, are all above those handed out before.
        self.g01_nodes(
            current
                .after
                .iter()
                .chain(successors.iter().flat_map(|s| &s.after)),
        );
        self.attempt_checks(&current, false);
        if let Some(successors) = &successors {
            self.attempt_checks(successors, true);
        }
        self.g22_budget(&current);
        self.g24_rollout_budget(&current, t.successors.as_deref());
        self.g20_one_action_per_node(t);
        // The decider's answer as it left the decider carries no nodes.
        if !matches!(t.cause, Cause::Answer(_)) {
            self.g19_handover(t);
            self.g19_successors(t);
            self.g25_converged_on(&current.after);
        }
    }

    /// The checks of one attempt's record, over one view of a transition
    /// ([`views`]).
    fn attempt_checks(&mut self, t: &Transition, successors: bool) {
        self.g02_fold_named(t);
        self.g03_fresh_attempt_facts(t);
        self.g03_fact_owners(&t.after);
        self.g05_pending_replaced(t);
        self.g08_destroyed(&t.after, None);
        self.g09_dead_hold(t);
        self.g10_decision_order(t);
        self.g11_cleanup_at_once(t);
        self.g12_not_ready(t);
        self.g13_adopt_first(t);
        self.g14_backoff(t);
        // A successor is reaped when it is destroyed, its slot still desired:
        // what the slot holds is checked on its own (g19_handover).
        if !successors {
            self.g19_scale_down(t);
        }
        self.g25_no_attempt_on_reverted(t);
    }

    fn submission(&mut self, op: &Operation, node: Option<&ManagedNode>) {
        self.g01_operation_ids(op, node);
        self.g05_submitted_is_pending(op, node);
        self.g10_submitted_order(op, node);
        self.g13_submitted_after_ambiguity(op, node);
        self.first_submit.entry(op.id).or_insert_with(|| op.clone());
    }

    fn state(&mut self, rec: &StepRecord) {
        let s = &rec.state;
        self.g01_nodes(&s.nodes);
        self.g01_allocator(s);
        self.endpoints_from_os |= !rec.processes.is_empty();
        self.g03_fact_owners(&s.nodes);
        if let Some(inv) = &rec.inventory {
            self.g03_inventory_matches_facts(s, inv);
            self.g19_inventory(inv);
            self.no_double_create_inventory(inv);
            self.converged_leaks_nothing(s, inv, rec.quiescent, Backend::Inventory);
        }
        self.g23_converged_is_observed(s, rec.quiescent);
        self.passes = s.passes;
        self.g21_recovered(s);
        for sample in &rec.processes {
            self.no_double_create_processes(sample);
        }
        if let Some(last) = rec.processes.last() {
            self.converged_leaks_nothing_processes(s, last, rec.quiescent);
        }
        self.g25_converged_on(&s.nodes);
        self.g04_store_agrees(s);
        self.g08_destroyed(&s.nodes, s.store.as_ref());
        self.g14_ready_is_reset(&s.nodes);
        self.g17_generation(s);
    }

    /// Guarantee 14, on states: an active node that is ready has a reset
    /// backoff (no failures counted, no deadline stored). A ready node takes no
    /// effect until it is deleted, so nothing can fail in between.
    fn g14_ready_is_reset(&mut self, nodes: &Nodes) {
        for (id, n) in nodes {
            if n.intent == Intent::Active && n.is_ready() && n.retry != RetryState::default() {
                let detail = format!("ready {id} holds backoff state {:?}", n.retry);
                self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
            }
        }
    }

    fn probe(&mut self, p: &Probe) {
        match p {
            Probe::ConvergedPass { actions, changed } => {
                if *actions > 0 || *changed {
                    self.fail(
                        Guarantee::G15ConvergedPassIsNoop,
                        format!(
                            "a full pass over the converged run took {actions} actions (changed nodes: {changed})"
                        ),
                    );
                }
            }
            Probe::Limits {
                what,
                panicked,
                error,
                expected_error,
                unchanged,
            } => self.g20_limits(
                what,
                panicked.as_deref(),
                error.as_deref(),
                *expected_error,
                *unchanged,
            ),
        }
    }

    /// Guarantee 1. Checks, on every state the run is seen in (each transition's
    /// after-state and each round's snapshot): every slot name parses back as
    /// `{group}-{index}` and names a group of some accepted shape; an attempt id
    /// belongs to one slot only, ever; when a slot's attempt changes, the new
    /// attempt is above every attempt seen before in the run. Approximation: an
    /// attempt that is allocated and retired between two observations is never
    /// seen; in memory there is none (a node changes at most once per pass, and
    /// every pass is observed), over the API polls can miss one.
    fn g01_nodes<'a>(&mut self, nodes: impl IntoIterator<Item = (&'a LogicalNodeId, &'a ManagedNode)>) {
        let floor = self.max_attempt;
        let mut fresh = Vec::new();
        for (id, n) in nodes {
            if &n.id != id
                || !self.slots_ok.contains(id)
                    && LogicalNodeId::parse("node", &id.to_string()).ok().as_ref() != Some(id)
            {
                self.fail(
                    Guarantee::G01AttemptIdsUniqueIncreasing,
                    format!("slot {id} does not round-trip as {{group}}-{{index}}"),
                );
            } else if !self.slots_ok.contains(id) {
                self.slots_ok.insert(id.clone());
            }
            if !self.groups_seen.is_empty() && !self.groups_seen.contains(id.group()) {
                self.fail(
                    Guarantee::G01AttemptIdsUniqueIncreasing,
                    format!("slot {id} names group {} of no accepted shape", id.group()),
                );
            }
            match self.attempt_slot.get(&n.attempt) {
                Some(slot) if slot != id => {
                    let detail = format!("attempt {} is held by {id} but belonged to {slot}", n.attempt);
                    self.fail(Guarantee::G01AttemptIdsUniqueIncreasing, detail);
                    continue;
                }
                Some(_) => continue,
                None => {}
            }
            if floor.is_some_and(|m| n.attempt <= m) {
                let detail = format!(
                    "{id} got attempt {} after attempt {} was already handed out",
                    n.attempt,
                    floor.map_or(0, AttemptId::get)
                );
                self.fail(Guarantee::G01AttemptIdsUniqueIncreasing, detail);
            }
            fresh.push((id.clone(), n.attempt));
        }
        for (id, attempt) in fresh {
            self.attempt_slot.insert(attempt, id.clone());
            self.slot_attempt.insert(id, attempt);
            self.max_attempt = self.max_attempt.max(Some(attempt));
        }
    }

    /// Guarantee 1, the allocator: where it is visible, the next attempt id never
    /// decreases and is above every attempt handed out.
    fn g01_allocator(&mut self, s: &RunSnapshot) {
        let Some(next) = s.next_attempt else { return };
        if next < self.next_attempt {
            let detail = format!(
                "the attempt allocator went back from {} to {next}",
                self.next_attempt
            );
            self.fail(Guarantee::G01AttemptIdsUniqueIncreasing, detail);
        }
        if let Some(max) = self.max_attempt
            && next <= max.get()
        {
            let detail = format!("the attempt allocator is at {next} but attempt {max} exists");
            self.fail(Guarantee::G01AttemptIdsUniqueIncreasing, detail);
        }
        self.next_attempt = self.next_attempt.max(next);
    }

    /// Guarantee 1, operation ids: an operation belongs to the attempt its node
    /// holds when it is submitted, and an operation id is never reused for
    /// another node or input.
    fn g01_operation_ids(&mut self, op: &Operation, node: Option<&ManagedNode>) {
        if let Some(n) = node
            && n.attempt != op.id.attempt()
        {
            let detail = format!(
                "operation {} submitted for {} which holds attempt {}",
                op.id, op.node, n.attempt
            );
            self.fail(Guarantee::G01AttemptIdsUniqueIncreasing, detail);
        }
        if let Some(first) = self.first_submit.get(&op.id)
            && !first.same_input(op)
        {
            let detail = format!("operation id {} reused for another node or input", op.id);
            self.fail(Guarantee::G01AttemptIdsUniqueIncreasing, detail);
        }
    }

    /// Guarantee 2. For every folded message, as the executor sent it: only the
    /// node it names may change (a rejection names an operation, so only the node
    /// holding it pending); if that node changed, it held the attempt the message
    /// names, and for a result the very operation pending (same id and effect,
    /// not a late completion), which the fold then resolves; for an observation,
    /// the session it names with a higher sequence number, which it records. A
    /// message the driver reported as discarded must change nothing.
    fn g02_fold_named(&mut self, t: &Transition) {
        let Cause::Fold { msg, verdict } = &t.cause else {
            return;
        };
        let named: Option<LogicalNodeId> = match msg {
            ToDriver::Rejection(rej) => t
                .before
                .values()
                .find(|n| n.pending.is_some_and(|p| Some(p.id) == rej.id))
                .map(|n| n.id.clone()),
            m => m.node().cloned(),
        };
        let others_changed = t.before.len() != t.after.len()
            || t.before
                .iter()
                .any(|(id, n)| Some(id) != named.as_ref() && t.after.get(id) != Some(n));
        if others_changed {
            self.fail(
                Guarantee::G02FoldOnlyIntoNamedAttempt,
                format!("folding {} changed a node it does not name", describe(msg)),
            );
        }
        let Some(id) = named else { return };
        let (before, after) = (t.before.get(&id), t.after.get(&id));
        let changed = before != after;
        if matches!(verdict, Fold::Discarded(_)) && changed {
            self.fail(
                Guarantee::G02FoldOnlyIntoNamedAttempt,
                format!(
                    "{} was reported discarded ({verdict:?}) but changed {id}",
                    describe(msg)
                ),
            );
        }
        let (Some(b), Some(a)) = (before, after) else {
            return;
        };
        if !changed {
            return;
        }
        let why = match msg {
            ToDriver::Result(r) => {
                let pending_ok = b.pending.is_some_and(|p| p.id == r.id && p.effect == r.effect);
                if b.attempt != r.id.attempt() {
                    Some(format!(
                        "it names attempt {} but {id} holds {}",
                        r.id.attempt(),
                        b.attempt
                    ))
                } else if !pending_ok {
                    Some(format!(
                        "{id}'s pending operation is {:?}",
                        b.pending.map(|p| p.id)
                    ))
                } else if r.late {
                    Some("it is a late completion of an abandoned operation".to_owned())
                } else if a.pending.is_some_and(|p| p.id == r.id) {
                    Some("the operation is still pending after its result was folded".to_owned())
                } else {
                    None
                }
            }
            ToDriver::Observation(o) => {
                if b.attempt != o.attempt {
                    Some(format!(
                        "it names attempt {} but {id} holds {}",
                        o.attempt, b.attempt
                    ))
                } else if b.facts.session.as_ref() != Some(&o.session) {
                    Some(format!("{id}'s session is {:?}", b.facts.session))
                } else if b.facts.bootstrap.as_ref().is_some_and(|p| p.seq >= o.seq) {
                    Some("its sequence number is not above the last folded one".to_owned())
                } else {
                    None
                }
            }
            ToDriver::Rejection(rej) => {
                matches!(rej.reason, RejectionReason::Fenced | RejectionReason::UnknownRun)
                    .then(|| format!("a {} rejection must change nothing", rej.reason.name()))
            }
            ToDriver::Change(c) => (b.attempt != c.attempt)
                .then(|| format!("it names attempt {} but {id} holds {}", c.attempt, b.attempt)),
        };
        if let Some(why) = why {
            self.fail(
                Guarantee::G02FoldOnlyIntoNamedAttempt,
                format!("{} changed {id}: {why}", describe(msg)),
            );
        }
    }

    /// Guarantee 3, at birth: a node whose attempt is new in a transition (an
    /// insert or a restart) starts with no facts at all: no lease, endpoint,
    /// session, bootstrap progress, failure or remembered ambiguity.
    fn g03_fresh_attempt_facts(&mut self, t: &Transition) {
        if matches!(t.cause, Cause::Restore) {
            return;
        }
        for (id, a) in &t.after {
            let fresh = t.before.get(id).is_none_or(|b| b.attempt != a.attempt);
            if fresh && a.facts != NodeFacts::default() {
                let detail = format!("{id}'s new attempt {} starts with facts {:?}", a.attempt, a.facts);
                self.fail(Guarantee::G03RetiredFactsNeverCarried, detail);
            }
        }
    }

    /// Guarantee 3, for life: every lease, endpoint and session value a node's
    /// facts hold belongs to the first attempt that held it; no other attempt
    /// of its slot (a replacement in particular) may ever hold it. Another
    /// slot may hold it once its owner no longer does: a real provider hands
    /// out a freed value again (the OS reuses an exited agent's port). With
    /// real agents (level 3) an endpoint is such a port, which the OS may
    /// hand to the same slot's replacement too, so there an endpoint is
    /// released once its owner attempt no longer holds it, whatever the
    /// slot; leases and sessions stay unique to their attempt at every level.
    fn g03_fact_owners(&mut self, nodes: &Nodes) {
        fn owned<K: Ord + Clone + std::fmt::Display>(
            map: &mut BTreeMap<K, (LogicalNodeId, AttemptId)>,
            key: Option<&K>,
            n: &ManagedNode,
            what: &str,
            nodes: &Nodes,
            reused_by_same_slot: bool,
            held: impl Fn(&ManagedNode) -> Option<&K>,
        ) -> Option<String> {
            let key = key?;
            let owner = match map.get(key) {
                Some(o) => o,
                None => {
                    map.insert(key.clone(), (n.id.clone(), n.attempt));
                    return None;
                }
            };
            let released = (reused_by_same_slot || owner.0 != n.id)
                && !nodes
                    .values()
                    .any(|o| o.id == owner.0 && o.attempt == owner.1 && held(o) == Some(key));
            if released {
                map.insert(key.clone(), (n.id.clone(), n.attempt));
                return None;
            }
            (owner.0 != n.id || owner.1 != n.attempt).then(|| {
                format!(
                    "{} attempt {} holds {what} {key}, a fact of {} attempt {}",
                    n.id, n.attempt, owner.0, owner.1
                )
            })
        }
        for n in nodes.values() {
            let f = &n.facts;
            let found = [
                owned(
                    &mut self.lease_owner,
                    f.lease.as_ref(),
                    n,
                    "lease",
                    nodes,
                    false,
                    |o| o.facts.lease.as_ref(),
                ),
                owned(
                    &mut self.endpoint_owner,
                    f.endpoint.as_ref(),
                    n,
                    "endpoint",
                    nodes,
                    self.endpoints_from_os,
                    |o| o.facts.endpoint.as_ref(),
                ),
                owned(
                    &mut self.session_owner,
                    f.session.as_ref(),
                    n,
                    "session",
                    nodes,
                    false,
                    |o| o.facts.session.as_ref(),
                ),
            ];
            for detail in found.into_iter().flatten() {
                self.fail(Guarantee::G03RetiredFactsNeverCarried, detail);
            }
        }
    }

    /// Guarantee 3, against the backend: a lease the driver records for a node
    /// that is live at the backend belongs to that node's current attempt.
    fn g03_inventory_matches_facts(&mut self, s: &RunSnapshot, inventory: &[super::record::Resource]) {
        let by_lease: BTreeMap<&str, &super::record::Resource> =
            inventory.iter().map(|r| (r.lease.as_str(), r)).collect();
        for n in s.nodes.values() {
            let Some(lease) = &n.facts.lease else { continue };
            if let Some(r) = by_lease.get(lease.as_str())
                && (r.node != n.id || r.attempt != n.attempt)
            {
                let detail = format!(
                    "{} attempt {} records lease {lease}, which the backend holds for {} attempt {}",
                    n.id, n.attempt, r.node, r.attempt
                );
                self.fail(Guarantee::G03RetiredFactsNeverCarried, detail);
            }
        }
    }

    /// Guarantee 4. Every operation the executor receives was, at that moment,
    /// the pending operation of the driver's committed store for its node, with
    /// the same id, effect and deadline (so a crash right after the submission
    /// cannot forget it).
    fn g04_recorded_before_submitted(&mut self, op: &Operation, recorded: bool) {
        if !recorded {
            let detail = format!(
                "{} {} for {} reached the executor before it was committed pending",
                op.input.effect().name(),
                op.id,
                op.node
            );
            self.fail(Guarantee::G04RecordedBeforeSubmitted, detail);
        }
    }

    /// Guarantee 4, durability at rest: after every round the committed store
    /// holds exactly the pending operations of the driver's state (and the
    /// operation kept for resubmission is that one).
    fn g04_store_agrees(&mut self, s: &RunSnapshot) {
        let Some(store) = &s.store else { return };
        for (id, n) in &s.nodes {
            let row = store.get(id);
            let stored = row.and_then(|r| r.pending);
            if stored != n.pending || row.is_some_and(|r| r.inflight != n.pending.map(|p| p.id)) {
                let detail = format!(
                    "{id}: the state holds pending {:?} but the store holds {stored:?} (in flight {:?})",
                    n.pending.map(|p| p.id),
                    row.and_then(|r| r.inflight)
                );
                self.fail(Guarantee::G04RecordedBeforeSubmitted, detail);
            }
        }
    }

    /// Guarantee 5, over transitions: a node's pending operation is only ever
    /// resolved (folded) before another is dispatched, never replaced by another
    /// in one step. (One pending per node at rest is structural: the state has
    /// one slot for it.)
    fn g05_pending_replaced(&mut self, t: &Transition) {
        for (id, a) in &t.after {
            let Some(b) = t.before.get(id) else { continue };
            if let (Some(p1), Some(p2)) = (b.pending, a.pending)
                && b.attempt == a.attempt
                && p1.id != p2.id
            {
                let detail = format!("{id} dispatched {} while {} was still pending", p2.id, p1.id);
                self.fail(Guarantee::G05OnePendingPerNode, detail);
            }
        }
    }

    /// Guarantee 5, over submissions: every operation submitted is the one
    /// pending operation the driver's state holds for the node at that moment, so
    /// the executor never has two of a node's operations outstanding.
    fn g05_submitted_is_pending(&mut self, op: &Operation, node: Option<&ManagedNode>) {
        let Some(n) = node else { return };
        let pending = n.pending.map(|p| p.id);
        if pending != Some(op.id) {
            let detail = format!(
                "{} was submitted for {} whose one pending operation is {pending:?}",
                op.id, op.node
            );
            self.fail(Guarantee::G05OnePendingPerNode, detail);
        }
    }

    /// Guarantee 6. Over the executor's starts, completions and aborts: an
    /// operation is running from its start until its result (or the abort when
    /// the executor abandons it at its deadline); no attempt ever has two running
    /// at once, be they two operations or two calls of one. A call the shell
    /// could not abort in time and that completes late is not running inside the
    /// executor any more, so it does not count.
    fn g06_start(&mut self, op: &Operation) {
        let attempt = op.id.attempt();
        if let Some(other) = self.running.get(&attempt) {
            let detail = format!("{} started while {other} of the same attempt was running", op.id);
            self.fail(Guarantee::G06OneRunningPerAttempt, detail);
        }
        self.running.insert(attempt, op.id);
    }

    /// Guarantee 7, results: every result the executor sends for an operation it
    /// has completed is the recorded one: a re-send of an unacknowledged result
    /// (on a new stream) is identical (outcome and completion time), and a replay
    /// answering a resubmission carries the outcome first recorded, even when a
    /// late completion of an abandoned call said otherwise.
    fn g07_results(&mut self, r: &contract::OperationResult) {
        let first = self.first_result.get(&r.id).cloned();
        match (r.replayed, r.late, first) {
            (false, false, None) => {
                self.first_result
                    .insert(r.id, (r.outcome.clone(), r.completed_at));
            }
            (false, false, Some((outcome, at))) if outcome != r.outcome || at != r.completed_at => {
                let detail = format!(
                    "operation {} completed again ({} at {:?}) after it completed {} at {at:?}",
                    r.id,
                    r.outcome.class_name(),
                    r.completed_at,
                    outcome.class_name()
                );
                self.fail(Guarantee::G07ResubmitReplaysConflictRejected, detail);
            }
            (true, _, Some((first, _))) if first != r.outcome => {
                let detail = format!(
                    "the replay of {} says {} but it first completed {}",
                    r.id,
                    r.outcome.class_name(),
                    first.class_name()
                );
                self.fail(Guarantee::G07ResubmitReplaysConflictRejected, detail);
            }
            (true, _, None) | (_, true, None) => {
                let detail = format!("a replayed or late result of {} that never completed", r.id);
                self.fail(Guarantee::G07ResubmitReplaysConflictRejected, detail);
            }
            _ => {}
        }
    }

    /// Guarantee 7, dedup: an operation the executor has completed is never
    /// started again (a resubmission replays it).
    fn g07_not_rerun(&mut self, op: &Operation) {
        if self.first_result.contains_key(&op.id) {
            let detail = format!(
                "{} {} ran again after it had completed",
                op.input.effect().name(),
                op.id
            );
            self.fail(Guarantee::G07ResubmitReplaysConflictRejected, detail);
        }
    }

    /// Guarantee 7, conflicts: a submission of a seen operation id with other
    /// input gets exactly one answer, a rejection naming the operation, and
    /// neither starts nor replays anything. The reason is a conflicting input, or
    /// `invalid` when the executor had refused the id's attempt as retired (it
    /// then never recorded the first input to compare with).
    fn g07_conflict(&mut self, op: &Operation, outputs: &[Output]) {
        let ok = matches!(
            outputs,
            [Output::Rejected(r)]
                if matches!(r.reason, RejectionReason::ConflictingInput | RejectionReason::Invalid)
                    && r.id == Some(op.id)
        );
        if !ok {
            let detail = format!("resubmitting {} with other input answered {outputs:?}", op.id);
            self.fail(Guarantee::G07ResubmitReplaysConflictRejected, detail);
        }
    }

    /// Guarantee 8. On every state: a `Destroyed` node has no lease, no session,
    /// no pending operation and no remembered ambiguity, and (where the store is
    /// visible) no operation kept for resubmission.
    fn g08_destroyed(
        &mut self,
        nodes: &Nodes,
        store: Option<&BTreeMap<LogicalNodeId, super::record::StoreRow>>,
    ) {
        for (id, n) in nodes {
            if n.stage != NodeStage::Destroyed {
                continue;
            }
            let inflight = store.and_then(|s| s.get(id)).and_then(|r| r.inflight);
            if n.facts.holds_resources() || n.pending.is_some() || inflight.is_some() {
                let detail = format!(
                    "destroyed {id} holds lease {:?}, session {:?}, ambiguity ({}, {}), pending {:?}, in flight {inflight:?}",
                    n.facts.lease,
                    n.facts.session,
                    n.facts.ambiguous_create,
                    n.facts.ambiguous_bootstrap,
                    n.pending.map(|p| p.id)
                );
                self.fail(Guarantee::G08DestroyedHoldsNothing, detail);
            }
        }
    }

    /// Guarantee 9. Over every transition of a node within one attempt, a live
    /// fact disappears only for the reason that makes it gone: the lease and
    /// endpoint only by a folded successful destroy, the session only by a folded
    /// successful cancel or the observed convergence of its bootstrap, a
    /// remembered ambiguous create only by a create that named a lease (or said
    /// definitely "cannot create"), a remembered ambiguous bootstrap only by a
    /// start that named its session or a successful cancel. So a failed cleanup
    /// (or a timeout, or anything else) keeps every live fact.
    fn g09_dead_hold(&mut self, t: &Transition) {
        let folded = match &t.cause {
            Cause::Fold {
                msg: ToDriver::Result(r),
                verdict: Fold::Folded,
            } => Some(r),
            _ => None,
        };
        let success = |effect: Effect| {
            folded.is_some_and(|r| r.effect == effect && matches!(r.outcome, Outcome::Succeeded(_)))
        };
        for (id, a) in &t.after {
            let Some(b) = t.before.get(id) else { continue };
            if b.attempt != a.attempt {
                continue;
            }
            let converged = match &t.cause {
                Cause::Decisions(ds) => ds
                    .iter()
                    .any(|d| &d.node == id && d.action == contract::Action::ObserveConvergence),
                _ => false,
            };
            let (bf, af) = (&b.facts, &a.facts);
            let mut lost = Vec::new();
            if bf.lease.is_some() && af.lease != bf.lease && !success(Effect::DestroyLease) {
                lost.push("lease");
            }
            if bf.endpoint.is_some() && af.endpoint != bf.endpoint && !success(Effect::DestroyLease) {
                lost.push("endpoint");
            }
            if bf.session.is_some()
                && af.session != bf.session
                && !success(Effect::CancelBootstrap)
                && !converged
            {
                lost.push("session");
            }
            let create_settled = folded.is_some_and(|r| {
                r.effect == Effect::CreateLease
                    && (matches!(&r.outcome, Outcome::Succeeded(f) if f.lease.is_some())
                        || matches!(r.outcome, Outcome::Permanent { .. }))
            });
            if bf.ambiguous_create && !af.ambiguous_create && !create_settled {
                lost.push("ambiguous create");
            }
            let start_settled = folded.is_some_and(|r| {
                r.effect == Effect::StartBootstrap
                    && matches!(&r.outcome, Outcome::Succeeded(f) if f.session.is_some())
            }) || success(Effect::CancelBootstrap);
            if bf.ambiguous_bootstrap && !af.ambiguous_bootstrap && !start_settled {
                lost.push("ambiguous bootstrap");
            }
            if !lost.is_empty() {
                let cause = match &t.cause {
                    Cause::Fold { msg, .. } => describe(msg),
                    other => format!("{other:?}").chars().take(80).collect(),
                };
                let detail = format!(
                    "{id} attempt {} forgot its live {} on {cause}",
                    a.attempt,
                    lost.join(", ")
                );
                self.fail(Guarantee::G09FailedCleanupKeepsFacts, detail);
            }
        }
    }

    /// Guarantee 10, in the driver's decisions: a destroy is dispatched only once
    /// no session is known or suspected and no create is ambiguous; a cancel only
    /// once no create is ambiguous; a node is marked destroyed only when it holds
    /// nothing and waits for nothing. Also, per attempt, the cleanup effects
    /// dispatched while deleting never go back in the order create (adoption),
    /// cancel, destroy, and a deleting attempt never dispatches a lookup or start.
    fn g10_decision_order(&mut self, t: &Transition) {
        if !matches!(t.cause, Cause::Decisions(_)) {
            return;
        }
        for (id, a) in &t.after {
            let Some(b) = t.before.get(id) else { continue };
            if b.attempt != a.attempt {
                continue;
            }
            if let (None, Some(p)) = (b.pending, a.pending) {
                let f = &b.facts;
                let why = match p.effect {
                    Effect::DestroyLease if f.session.is_some() || f.ambiguous_bootstrap => {
                        Some("destroy dispatched before the bootstrap was cancelled")
                    }
                    Effect::DestroyLease | Effect::CancelBootstrap if f.ambiguous_create => {
                        Some("cleanup dispatched before the ambiguous create was adopted")
                    }
                    _ => None,
                };
                if let Some(why) = why {
                    self.fail(
                        Guarantee::G10CleanupOrdered,
                        format!("{id} attempt {}: {why}", a.attempt),
                    );
                }
                if b.intent == Intent::Deleting {
                    self.cleanup_step(id, a.attempt, p.effect);
                }
            }
            if a.stage == NodeStage::Destroyed
                && b.stage != NodeStage::Destroyed
                && (b.facts.holds_resources() || b.pending.is_some())
            {
                let detail = format!(
                    "{id} attempt {} marked destroyed while holding lease {:?}, session {:?}, ambiguity ({}, {}), pending {:?}",
                    a.attempt,
                    b.facts.lease,
                    b.facts.session,
                    b.facts.ambiguous_create,
                    b.facts.ambiguous_bootstrap,
                    b.pending.map(|p| p.id)
                );
                self.fail(Guarantee::G10CleanupOrdered, detail);
            }
        }
    }

    fn cleanup_step(&mut self, id: &LogicalNodeId, attempt: AttemptId, effect: Effect) {
        let Some(rank) = cleanup_rank(effect) else {
            let detail = format!("deleting {id} attempt {attempt} dispatched {}", effect.name());
            self.fail(Guarantee::G10CleanupOrdered, detail);
            return;
        };
        let last = *self.cleanup_rank.entry(attempt).or_insert(rank);
        if rank < last {
            let detail = format!(
                "{id} attempt {attempt} went back to {} during cleanup",
                effect.name()
            );
            self.fail(Guarantee::G10CleanupOrdered, detail);
        }
        self.cleanup_rank.insert(attempt, last.max(rank));
    }

    /// Guarantee 10, in the operation stream: a destroy reaches the executor only
    /// for a node whose state (at submission) shows no session and no suspected
    /// one.
    fn g10_submitted_order(&mut self, op: &Operation, node: Option<&ManagedNode>) {
        let Some(n) = node else { return };
        if op.input.effect() == Effect::DestroyLease
            && (n.facts.session.is_some() || n.facts.ambiguous_bootstrap)
        {
            let detail = format!(
                "destroy {} submitted for {} while its session {:?} was not cancelled",
                op.id, op.node, n.facts.session
            );
            self.fail(Guarantee::G10CleanupOrdered, detail);
        }
    }

    /// Guarantee 10, at the backend: a destroy never runs while the identity's
    /// bootstrap session is still streaming stages. Approximation: a session that
    /// hung (streams nothing more) or converged does not count as running here;
    /// the decision-level check covers those.
    fn g10_backend_order(&mut self, op: &Operation, session_running: bool) {
        if op.input.effect() == Effect::DestroyLease && session_running {
            let detail = format!(
                "destroy {} ran while {}'s bootstrap was still running",
                op.id, op.node
            );
            self.fail(Guarantee::G10CleanupOrdered, detail);
        }
    }

    /// Guarantee 11. When an attempt fails (its stage becomes `Failed`), the
    /// failure sets no effect backoff (`next_effect_at`) but a restart time; the
    /// next decision for a failed active node is `BeginDelete`, which clears any
    /// effect backoff; and a cleanup rule (6, 7, 8) only ever waits when an
    /// effect backoff set after the cleanup began (by a failed cleanup effect) is
    /// still in the future.
    fn g11_cleanup_at_once(&mut self, t: &Transition) {
        for (id, a) in &t.after {
            let Some(b) = t.before.get(id) else { continue };
            if b.attempt == a.attempt && a.stage == NodeStage::Failed && b.stage != NodeStage::Failed {
                if a.retry.next_effect_at.is_some_and(|x| x > t.at) {
                    let detail = format!(
                        "{id}'s failure delayed its cleanup until {:?}",
                        a.retry.next_effect_at
                    );
                    self.fail(Guarantee::G11FailedAttemptCleansUpAtOnce, detail);
                }
                if a.retry.restart_at.is_none() {
                    let detail = format!("{id}'s failure set no restart time");
                    self.fail(Guarantee::G11FailedAttemptCleansUpAtOnce, detail);
                }
            }
        }
        let Cause::Decisions(decisions) = &t.cause else {
            return;
        };
        for d in decisions {
            let Some(b) = t.before.get(&d.node) else { continue };
            let failed =
                b.intent == Intent::Active && (b.stage == NodeStage::Failed || b.facts.bootstrap_failed());
            if failed && d.action != contract::Action::BeginDelete {
                let detail = format!(
                    "failed {} was decided {:?} instead of beginning cleanup",
                    d.node, d.action
                );
                self.fail(Guarantee::G11FailedAttemptCleansUpAtOnce, detail);
            }
            if let contract::Action::Wait { .. } = d.action
                && rule_is_cleanup(d.rule)
                && b.retry.next_effect_at.is_none_or(|x| x <= t.at)
            {
                let detail = format!(
                    "{}'s cleanup waited ({}) though no cleanup effect had failed",
                    d.node, d.rule
                );
                self.fail(Guarantee::G11FailedAttemptCleansUpAtOnce, detail);
            }
            if d.action == contract::Action::BeginDelete
                && let Some(a) = t.after.get(&d.node)
                && a.intent == Intent::Deleting
                && a.retry.next_effect_at.is_some()
            {
                let detail = format!("{} began cleanup gated by {:?}", d.node, a.retry.next_effect_at);
                self.fail(Guarantee::G11FailedAttemptCleansUpAtOnce, detail);
            }
        }
    }

    /// Guarantee 12. Folding a not-ready outcome never raises the failure count,
    /// never fails the attempt and records no failure; it only schedules the
    /// next probe one probe interval later.
    fn g12_not_ready(&mut self, t: &Transition) {
        let Cause::Fold {
            msg: ToDriver::Result(r),
            ..
        } = &t.cause
        else {
            return;
        };
        if !matches!(r.outcome, Outcome::NotReady { .. }) {
            return;
        }
        let (Some(b), Some(a)) = (t.before.get(&r.node), t.after.get(&r.node)) else {
            return;
        };
        if a == b {
            return;
        }
        let probe_at = t.at.checked_add(self.policy.probe_interval).ok();
        let failed = a.retry.consecutive_failures != b.retry.consecutive_failures
            || (a.stage == NodeStage::Failed && b.stage != NodeStage::Failed)
            || a.facts.failure != b.facts.failure;
        if failed || a.retry.next_effect_at != probe_at {
            let detail = format!(
                "not-ready for {} counted as a failure: failures {} -> {}, stage {:?} -> {:?}, next effect {:?} (probe at {probe_at:?})",
                r.node,
                b.retry.consecutive_failures,
                a.retry.consecutive_failures,
                b.stage,
                a.stage,
                a.retry.next_effect_at
            );
            self.fail(Guarantee::G12NotReadyIsNotAFailure, detail);
        }
    }

    /// Guarantee 13, in decisions: while an attempt remembers an ambiguous create,
    /// the only effect it may dispatch is that create again (so the executor
    /// adopts whatever was made), and it may be neither marked destroyed nor
    /// replaced.
    fn g13_adopt_first(&mut self, t: &Transition) {
        if !matches!(t.cause, Cause::Decisions(_)) {
            return;
        }
        for (id, b) in &t.before {
            if !b.facts.ambiguous_create {
                continue;
            }
            let why = match t.after.get(id) {
                Some(a) if a.attempt != b.attempt => Some("replaced".to_owned()),
                Some(a) if a.stage == NodeStage::Destroyed && b.stage != NodeStage::Destroyed => {
                    Some("marked destroyed".to_owned())
                }
                Some(a) => match (b.pending, a.pending) {
                    (None, Some(p)) if p.effect != Effect::CreateLease => {
                        Some(format!("sent {}", p.effect.name()))
                    }
                    _ => None,
                },
                None => Some("reaped".to_owned()),
            };
            if let Some(why) = why {
                let detail = format!(
                    "{id} attempt {} was {why} before its ambiguous create was adopted",
                    b.attempt
                );
                self.fail(Guarantee::G13AdoptBeforeDestroy, detail);
            }
        }
    }

    /// Guarantee 13, in the operation stream: an operation submitted for a node
    /// whose state remembers an ambiguous create is that create.
    fn g13_submitted_after_ambiguity(&mut self, op: &Operation, node: Option<&ManagedNode>) {
        if let Some(n) = node
            && n.facts.ambiguous_create
            && op.input.effect() != Effect::CreateLease
        {
            let detail = format!(
                "{} {} sent for {} before its ambiguous create was adopted",
                op.input.effect().name(),
                op.id,
                op.node
            );
            self.fail(Guarantee::G13AdoptBeforeDestroy, detail);
        }
    }

    /// Guarantee 14. Over transitions within one attempt: the failure count rises
    /// by exactly one per failure (a folded definite or ambiguous failure, a
    /// failed bootstrap stage, an expired deadline) and then the stored deadline
    /// (`next_effect_at`, or `restart_at` when the attempt failed) is exactly the
    /// fold's time plus `backoff_delay(policy, run uid, attempt, failures)`; it
    /// falls only to zero, and only when the node becomes ready; no effect is
    /// dispatched before `next_effect_at` and no restart happens before
    /// `restart_at`; a replacement starts with its predecessor's count and no
    /// deadlines. Approximation: which outcomes count as failures is read from
    /// the outcome class, so a folded `Succeeded` that names no lease (which the
    /// driver rightly treats as a failure) is not required to count.
    fn g14_backoff(&mut self, t: &Transition) {
        // The node a folded failure names, and whether it counts only for an
        // active attempt (a failed bootstrap stage of a deleting attempt is
        // progress of its cleanup, not a new failure).
        let must_count: Option<(LogicalNodeId, AttemptId, bool)> = match &t.cause {
            Cause::Fold {
                msg: ToDriver::Result(r),
                verdict: Fold::Folded,
            } if is_failure(&r.outcome) => Some((r.node.clone(), r.id.attempt(), false)),
            Cause::Fold {
                msg: ToDriver::Observation(o),
                verdict: Fold::Folded,
            } if o.stage.is_failure() => Some((o.node.clone(), o.attempt, true)),
            // A lost resource fails its attempt; a health report is a fact,
            // not a failure (remediation counts one when it begins).
            Cause::Fold {
                msg: ToDriver::Change(c),
                verdict: Fold::Folded,
            } if matches!(c.change, contract::Change::Lost { .. }) => Some((c.node.clone(), c.attempt, true)),
            Cause::Fold {
                msg: ToDriver::Rejection(rej),
                verdict: Fold::Folded,
            } => t
                .before
                .values()
                .find(|n| n.pending.is_some_and(|p| Some(p.id) == rej.id))
                .map(|n| (n.id.clone(), n.attempt, false)),
            _ => None,
        };
        let decisions: Option<&Vec<contract::Decision>> = match &t.cause {
            Cause::Decisions(d) => Some(d),
            _ => None,
        };
        for (id, a) in &t.after {
            let Some(b) = t.before.get(id) else { continue };
            if b.attempt != a.attempt {
                if decisions.is_some() {
                    self.g14_restart(id, b, a, t.at);
                }
                continue;
            }
            let (fb, fa) = (b.retry.consecutive_failures, a.retry.consecutive_failures);
            if let Some((node, attempt, active_only)) = &must_count
                && node == id
                && *attempt == b.attempt
                && fa != fb.saturating_add(1)
            {
                // A failed stage folded into an attempt that already failed (its
                // stage deadline expired first) is the same failure seen twice.
                let exempt = *active_only && (b.intent != Intent::Active || b.stage == NodeStage::Failed);
                if !exempt {
                    let detail = format!("a failure folded into {id} moved its failure count {fb} -> {fa}");
                    self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
                }
            }
            if matches!(t.cause, Cause::Timer) {
                // One failure per deadline that expired: the pending operation's
                // (deadline plus grace) and the stage's.
                let grace = self.policy.result_grace;
                let op = b
                    .pending
                    .is_some_and(|p| p.deadline.checked_add(grace).is_ok_and(|d| d <= t.at));
                let stage = b.intent == Intent::Active && b.stage_deadline.is_some_and(|d| d <= t.at);
                let expired = u32::from(op) + u32::from(stage);
                if fa != fb.saturating_add(expired) {
                    let detail =
                        format!("{id}: {expired} deadlines expired but the failure count moved {fb} -> {fa}");
                    self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
                }
            }
            if fa > fb && (fa == fb.saturating_add(1) || matches!(t.cause, Cause::Timer)) {
                // The driver computes a backoff when it makes the change (a
                // pass's: when it applies the answer).
                let expected = t
                    .applied_at
                    .checked_add(backoff_delay(&self.policy.backoff, self.uid, a.attempt, fa))
                    .ok();
                if a.retry.next_effect_at != expected && a.retry.restart_at != expected {
                    let detail = format!(
                        "{id} failure {fa} at {:?}: next effect {:?}, restart {:?}, the policy says {expected:?}",
                        t.applied_at, a.retry.next_effect_at, a.retry.restart_at
                    );
                    self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
                }
            } else if fa > fb {
                let detail = format!("{id}'s failure count jumped {fb} -> {fa}");
                self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
            } else if fa < fb {
                let ready = !b.is_ready() && a.is_ready();
                if !(ready && fa == 0) {
                    let detail = format!("{id}'s failure count fell {fb} -> {fa} without reaching ready");
                    self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
                }
            }
            if !b.is_ready() && a.is_ready() && a.retry != RetryState::default() {
                let detail = format!("{id} became ready without a reset backoff: {:?}", a.retry);
                self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
            }
            if decisions.is_some()
                && b.pending.is_none()
                && a.pending.is_some()
                && b.retry.next_effect_at.is_some_and(|x| x > t.at)
            {
                let detail = format!(
                    "{id} dispatched {} at {:?} before its backoff ended at {:?}",
                    a.pending.map_or("?", |p| p.effect.name()),
                    t.at,
                    b.retry.next_effect_at
                );
                self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
            }
        }
    }

    fn g14_restart(&mut self, id: &LogicalNodeId, b: &ManagedNode, a: &ManagedNode, at: UnixMillis) {
        // The backoff paces one template's retries: a restart onto a changed
        // template need not wait for the old one's (SPEC §9).
        if b.retry.restart_at.is_some_and(|x| x > at) && NodeTemplate::same(&a.spec, &b.spec) {
            let detail = format!(
                "{id} restarted at {at:?} before its restart backoff ended at {:?}",
                b.retry.restart_at
            );
            self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
        }
        if a.retry.consecutive_failures != b.retry.consecutive_failures
            || a.retry.next_effect_at.is_some()
            || a.retry.restart_at.is_some()
        {
            let detail = format!(
                "{id}'s replacement {} did not inherit the count cleanly: {:?} from {:?}",
                a.attempt, a.retry, b.retry
            );
            self.fail(Guarantee::G14BackoffFollowsPolicy, detail);
        }
    }

    /// Guarantee 15. A pass decided over a converged run takes no action,
    /// dispatches nothing and changes no node; and a full pass run on a copy of a
    /// converged run (the probe) does the same.
    fn g15_converged_pass(&mut self, converged: bool, actions: usize, operations: usize, changed: bool) {
        if converged && (actions > 0 || operations > 0 || changed) {
            let detail = format!(
                "a pass over the converged run took {actions} actions, dispatched {operations} (changed: {changed})"
            );
            self.fail(Guarantee::G15ConvergedPassIsNoop, detail);
        }
    }

    /// Guarantee 17, per shape update. A valid update to the next generation is
    /// accepted; the same generation with the same content is accepted as a
    /// no-op; everything meant to be invalid (a lower generation, the same
    /// generation with other content, another run id, an invalid shape) and
    /// everything sent to a deleting run is rejected. A rejection or a no-op
    /// changes nothing: the same generation, shape and deletion flag and (where
    /// nothing else ran in between) the very same nodes and allocator. An accepted
    /// change installs the submitted shape at its generation.
    fn g17_revision_contract(&mut self, a: &ApplyRecord, after: &RunSnapshot) {
        let expected_accept = match a.kind {
            _ if a.before.deleting || a.before.gone => false,
            ApplyKind::Valid | ApplyKind::Same => true,
            ApplyKind::Invalid => false,
        };
        let verdict_ok = matches!(
            (&a.verdict, a.kind, expected_accept),
            (Verdict::Skipped, _, _)
                | (Verdict::Changed, ApplyKind::Valid, true)
                | (Verdict::Unchanged, ApplyKind::Same, true)
                | (Verdict::Rejected(_), _, false)
        );
        if !verdict_ok {
            let detail = format!(
                "a {:?} update to generation {} answered {:?} (deleting: {})",
                a.kind, a.submitted.generation, a.verdict, a.before.deleting
            );
            self.fail(Guarantee::G17GenerationMonotonic, detail);
        }
        let must_not_change = matches!(
            a.verdict,
            Verdict::Rejected(_) | Verdict::Unchanged | Verdict::Skipped
        );
        if must_not_change {
            let same = if a.exact {
                a.before == *after
            } else {
                a.before.generation == after.generation
                    && a.before.shape == after.shape
                    && a.before.deleting == after.deleting
            };
            if !same {
                let detail = format!(
                    "a {:?} update ({:?}) changed the run: generation {} -> {}",
                    a.kind, a.verdict, a.before.generation, after.generation
                );
                self.fail(Guarantee::G17GenerationMonotonic, detail);
            }
        }
        // Over the API the driver may take a generation of its own (a
        // revert) before the state after the apply is read.
        let later = !a.exact && after.generation > a.submitted.generation;
        if a.verdict == Verdict::Changed
            && !later
            && (after.generation != a.submitted.generation
                || after
                    .shape
                    .as_ref()
                    .is_some_and(|s| !s.same_content(&a.submitted)))
        {
            let detail = format!(
                "an accepted update to generation {} left generation {}",
                a.submitted.generation, after.generation
            );
            self.fail(Guarantee::G17GenerationMonotonic, detail);
        }
    }

    /// Guarantee 17, per round: the generation never decreases, and the observed
    /// generation never decreases nor passes the generation.
    fn g17_generation(&mut self, s: &RunSnapshot) {
        let (g, o) = (s.generation.get(), s.observed_generation.get());
        if s.gone {
            return;
        }
        if g < self.generation || o < self.observed_generation || o > g {
            let detail = format!(
                "generation {} -> {g}, observed {} -> {o}",
                self.generation, self.observed_generation
            );
            self.fail(Guarantee::G17GenerationMonotonic, detail);
        }
        self.generation = self.generation.max(g);
        self.observed_generation = self.observed_generation.max(o);
    }

    fn desired_template(&self, id: &LogicalNodeId) -> Option<&std::sync::Arc<NodeTemplate>> {
        if self.deleting {
            return None;
        }
        self.shape
            .as_ref()
            .and_then(|s| s.desired_group(id))
            .map(|g| &g.template)
    }

    /// Guarantee 19, in decisions: an active node begins cleanup only when its
    /// slot is no longer desired (a scale-down leaves exactly the slots at and
    /// above the new count undesired, so only the highest-index slots go), its
    /// spec drifted, or its attempt failed; a node is reaped only when its slot is
    /// undesired and inserted only when desired; and a slot gets a new attempt
    /// only once the old one is `Destroyed`.
    fn g19_scale_down(&mut self, t: &Transition) {
        if !matches!(t.cause, Cause::Decisions(_)) {
            return;
        }
        let t_at = t.at;
        for (id, b) in &t.before {
            let desired = self.desired_template(id).cloned();
            match t.after.get(id) {
                None if desired.is_some() => {
                    self.fail(
                        Guarantee::G19ScaleDownHighestNoTwoLive,
                        format!("desired slot {id} was reaped"),
                    );
                }
                Some(a) if a.attempt != b.attempt && b.stage != NodeStage::Destroyed => {
                    let detail = format!(
                        "{id} started attempt {} while attempt {} was {:?}",
                        a.attempt, b.attempt, b.stage
                    );
                    self.fail(Guarantee::G19ScaleDownHighestNoTwoLive, detail);
                }
                Some(a)
                    if a.attempt == b.attempt
                        && b.intent == Intent::Active
                        && a.intent == Intent::Deleting =>
                {
                    let justified = match &desired {
                        None => true,
                        Some(t) => {
                            !NodeTemplate::same(t, &b.spec)
                                || b.stage == NodeStage::Failed
                                || b.facts.bootstrap_failed()
                                // Remediation: unhealthy past its stored deadline.
                                || b.facts.health.as_ref().is_some_and(|h| h.due(t_at))
                        }
                    };
                    if !justified {
                        let detail = format!("{id} began cleanup though desired, current and healthy");
                        self.fail(Guarantee::G19ScaleDownHighestNoTwoLive, detail);
                    }
                }
                _ => {}
            }
        }
        for id in t.after.keys() {
            if !t.before.contains_key(id) && self.desired_template(id).is_none() {
                self.fail(
                    Guarantee::G19ScaleDownHighestNoTwoLive,
                    format!("undesired slot {id} was inserted"),
                );
            }
        }
    }

    /// The attempts a slot may hold at once: its current one and, under a
    /// rollout's surge, its successor (SPEC.md section 9).
    fn slot_may_hold(&self, slot: &LogicalNodeId) -> BTreeSet<AttemptId> {
        self.current_of
            .get(slot)
            .into_iter()
            .chain(self.successor_of.get(slot))
            .copied()
            .collect()
    }

    /// Guarantee 19 at the backend: a create for an attempt finds no other
    /// attempt of its slot holding a resource, but (with surge) the slot's
    /// current attempt and its successor.
    fn g19_no_second_attempt_at_backend(&mut self, op: &Operation, slot_attempts: &[AttemptId]) {
        if op.input.effect() != Effect::CreateLease {
            return;
        }
        let may = self.slot_may_hold(&op.node);
        let pair = may.contains(&op.id.attempt());
        if let Some(other) = slot_attempts
            .iter()
            .find(|a| **a != op.id.attempt() && !(pair && may.contains(a)))
        {
            let detail = format!(
                "{} created for attempt {} while attempt {other} still held a resource",
                op.node,
                op.id.attempt()
            );
            self.fail(Guarantee::G19ScaleDownHighestNoTwoLive, detail);
        }
    }

    /// Guarantee 19, per round: no slot has live resources of two attempts,
    /// but its current attempt and its successor.
    fn g19_inventory(&mut self, inventory: &[super::record::Resource]) {
        let mut per_slot: BTreeMap<&LogicalNodeId, BTreeSet<AttemptId>> = BTreeMap::new();
        for r in inventory {
            per_slot.entry(&r.node).or_default().insert(r.attempt);
        }
        let doubled: Vec<String> = per_slot
            .iter()
            .filter(|(s, a)| {
                a.len() > 2 || a.len() > 1 && !self.held_in_round.get(*s).is_some_and(|h| a.is_subset(h))
            })
            .map(|(s, a)| format!("{s} {a:?}"))
            .collect();
        if !doubled.is_empty() {
            self.fail(
                Guarantee::G19ScaleDownHighestNoTwoLive,
                format!(
                    "slots with live resources of two attempts: {}",
                    doubled.join(", ")
                ),
            );
        }
    }

    /// Guarantee 19 as SPEC.md section 9 restates it, on transitions: a slot
    /// gains a successor only while its group's template has a surge, and
    /// then its group holds at most `max_surge` successors. Notes each slot's
    /// successor.
    fn g19_successors(&mut self, t: &Transition) {
        let mut gained: BTreeSet<&GroupId> = BTreeSet::new();
        for (id, n) in &t.after {
            let successor = match n.surge {
                contract::Surge::Current { successor, .. } => Some(successor),
                _ => None,
            };
            let had = t.before.get(id).and_then(|b| match b.surge {
                contract::Surge::Current { successor, .. } => Some(successor),
                _ => None,
            });
            if successor.is_some() && successor != had {
                gained.insert(id.group());
            }
        }
        for group in gained {
            let held = t
                .after
                .values()
                .filter(|n| n.id.group() == group && matches!(n.surge, contract::Surge::Current { .. }))
                .count() as u32;
            let Some(g) = self
                .shape
                .as_ref()
                .and_then(|s| s.groups.iter().find(|g| &g.id == group))
            else {
                continue;
            };
            let budget = g.policy.rollout.resolve(g.count).max_surge;
            if held > budget {
                let detail = format!(
                    "group {group} holds {held} successors, max_surge {:?} allows {budget} of {}",
                    g.policy.rollout.max_surge, g.count
                );
                self.fail(Guarantee::G19ScaleDownHighestNoTwoLive, detail);
            }
        }
        for (id, n) in &t.after {
            self.current_of.insert(id.clone(), n.attempt);
            match n.surge {
                contract::Surge::Current { successor, .. } => {
                    self.successor_of.insert(id.clone(), successor);
                }
                _ => {
                    self.successor_of.remove(id);
                }
            }
        }
        self.current_of.retain(|id, _| t.after.contains_key(id));
        self.successor_of.retain(|id, _| t.after.contains_key(id));
        for slot in t.after.keys() {
            let held = self.slot_may_hold(slot);
            self.held_in_round.entry(slot.clone()).or_default().extend(held);
        }
    }

    /// Guarantee 19 at a handover: a successor takes its slot over only once
    /// the slot's current attempt is destroyed (cleaned up, holding nothing).
    fn g19_handover(&mut self, t: &Transition) {
        for id in promoted(t) {
            if let Some(old) = t.before.get(id)
                && old.stage != NodeStage::Destroyed
            {
                let detail = format!(
                    "{id}'s successor {} took the slot over while attempt {} was {:?}",
                    t.after.get(id).map_or(AttemptId::new(0), |n| n.attempt),
                    old.attempt,
                    old.stage
                );
                self.fail(Guarantee::G19ScaleDownHighestNoTwoLive, detail);
            }
        }
    }

    /// Guarantee 20, per pass: the decider gives at most one decision per node,
    /// in the answer it sends (where its trace shows it) and in what the driver
    /// applies.
    fn g20_one_action_per_node(&mut self, t: &Transition) {
        let (Cause::Decisions(decisions) | Cause::Answer(decisions)) = &t.cause else {
            return;
        };
        // A slot's current attempt and its successor are decided apart.
        let mut seen = BTreeSet::new();
        for d in decisions {
            if !seen.insert((&d.node, d.attempt)) {
                self.fail(
                    Guarantee::G20NoPanicNoSpin,
                    format!("one pass decided {} twice", d.node),
                );
            }
        }
    }

    /// Guarantee 20, spins: no more than [`MAX_BARREN_PASSES`] consecutive passes
    /// at one virtual instant that change nothing and dispatch nothing, with
    /// nothing in between that could have asked for them (no node changed, no
    /// input from outside; each fold or input may ask for one pass that then
    /// finds nothing to do).
    fn g20_spin(&mut self, at: UnixMillis, barren: bool) {
        if !barren {
            self.barren = (at, 0);
            return;
        }
        self.barren = if self.barren.0 == at {
            (at, self.barren.1 + 1)
        } else {
            (at, 1)
        };
        if self.barren.1 > MAX_BARREN_PASSES {
            let detail = format!("{} passes in a row at {at:?} changed nothing", self.barren.1);
            self.fail(Guarantee::G20NoPanicNoSpin, detail);
        }
    }

    /// Guarantee 20, limits: at a saturated clock or with the attempt allocator
    /// exhausted, a pass returns the matching error and does not panic, and a
    /// failed call leaves the nodes as they were.
    fn g20_limits(
        &mut self,
        what: &str,
        panicked: Option<&str>,
        error: Option<&str>,
        expected_error: bool,
        unchanged: bool,
    ) {
        if let Some(p) = panicked {
            self.fail(Guarantee::G20NoPanicNoSpin, format!("{what}: panicked: {p}"));
        } else if !expected_error {
            self.fail(
                Guarantee::G20NoPanicNoSpin,
                format!("{what}: expected a typed error, got {error:?}"),
            );
        } else if !unchanged {
            self.fail(
                Guarantee::G20NoPanicNoSpin,
                format!("{what}: the failed call changed the nodes"),
            );
        }
    }

    /// No double-create, at the backend: each identity (run, slot, attempt) gets
    /// at most one lease made for it, ever (a create that finds one adopts it).
    fn no_double_create_call(&mut self, op: &Operation, lease_made: bool) {
        if !lease_made {
            return;
        }
        let n = self
            .leases_made
            .entry((op.node.clone(), op.id.attempt()))
            .or_insert(0);
        *n += 1;
        if *n > 1 {
            let detail = format!(
                "{} attempt {} had {n} leases made for it",
                op.node,
                op.id.attempt()
            );
            self.fail(Guarantee::NoDoubleCreate, detail);
        }
    }

    /// No double-create, over inventories: an identity never shows two leases at
    /// once, and never a different lease from the one it showed before.
    /// Approximation: over the API a lease destroyed and re-made between two
    /// polls under the same identity is only caught if both are seen.
    fn no_double_create_inventory(&mut self, inventory: &[super::record::Resource]) {
        let mut now: BTreeMap<(LogicalNodeId, AttemptId), &str> = BTreeMap::new();
        for r in inventory {
            let key = (r.node.clone(), r.attempt);
            if let Some(other) = now.insert(key.clone(), &r.lease) {
                let detail = format!(
                    "{} attempt {} holds leases {other} and {}",
                    r.node, r.attempt, r.lease
                );
                self.fail(Guarantee::NoDoubleCreate, detail);
            }
            let seen = self
                .lease_of
                .entry(key)
                .or_insert_with(|| r.lease.clone())
                .clone();
            if seen != r.lease {
                let detail = format!(
                    "{} attempt {} held lease {seen}, now {}",
                    r.node, r.attempt, r.lease
                );
                self.fail(Guarantee::NoDoubleCreate, detail);
            }
        }
    }

    /// No double-create, in the OS process table (level 3): at every sample a
    /// slot has at most one live agent process, and an identity (slot, attempt)
    /// is only ever served by one process (a second PID for it is a second
    /// agent spawned for one create).
    fn no_double_create_processes(&mut self, sample: &[super::record::Resource]) {
        let mut per_slot: BTreeMap<&LogicalNodeId, (BTreeSet<AttemptId>, Vec<String>)> = BTreeMap::new();
        for r in sample {
            let (attempts, agents) = per_slot.entry(&r.node).or_default();
            attempts.insert(r.attempt);
            agents.push(format!("a{} pid {}", r.attempt.get(), r.lease));
        }
        for (node, (attempts, agents)) in per_slot {
            // Under surge a slot runs its current attempt's agent and its
            // successor's, one each.
            let pair = attempts.len() == agents.len()
                && attempts.len() <= 2
                && self
                    .held_in_round
                    .get(node)
                    .is_some_and(|h| attempts.is_subset(h));
            if agents.len() > 1 && !pair {
                let detail = format!(
                    "{node} has {} live agent processes at once: {}",
                    agents.len(),
                    agents.join(", ")
                );
                self.fail(Guarantee::NoDoubleCreate, detail);
            }
        }
        for r in sample {
            let key = (r.node.clone(), r.attempt);
            let seen = self.pid_of.entry(key).or_insert_with(|| r.lease.clone()).clone();
            if seen != r.lease {
                let detail = format!(
                    "{} attempt {} was served by agent pid {seen}, now by pid {}",
                    r.node, r.attempt, r.lease
                );
                self.fail(Guarantee::NoDoubleCreate, detail);
            }
        }
    }

    /// Converged leaks nothing, in the OS process table (level 3): the same
    /// check as over the inventory, counting live agent processes.
    fn converged_leaks_nothing_processes(
        &mut self,
        s: &RunSnapshot,
        sample: &[super::record::Resource],
        quiescent: bool,
    ) {
        let before = self.out.len();
        self.converged_leaks_nothing(s, sample, quiescent, Backend::Processes);
        for v in &mut self.out[before..] {
            v.detail = format!("live node-agent processes: {}", v.detail);
        }
    }

    /// Guarantee 22, on every transition: per group, the slots being replaced
    /// for health are at most the group's `max_in_flight`, and a node begins
    /// its replacement for health only while the group is within
    /// `max_unhealthy` (counted over the state before the decision).
    fn g22_budget(&mut self, t: &Transition) {
        let Some(shape) = self.shape.clone() else { return };
        for g in &shape.groups {
            let r = g.policy.remediation;
            let in_group = |n: &&ManagedNode| n.id.group() == &g.id;
            let in_flight = t
                .after
                .values()
                .filter(in_group)
                .filter(|n| n.retry.remediating)
                .count();
            if in_flight > r.max_in_flight as usize {
                let detail = format!(
                    "{}: {in_flight} nodes replaced for health at once, max_in_flight is {}",
                    g.id, r.max_in_flight
                );
                self.fail(Guarantee::G22RemediationWithinBudget, detail);
            }
            let impaired = t
                .before
                .values()
                .filter(in_group)
                .filter(|n| n.stage != NodeStage::Destroyed && n.facts.is_impaired())
                .count();
            let limit = r.max_unhealthy.resolve(g.count) as usize;
            let started: Vec<String> = t
                .after
                .values()
                .filter(in_group)
                .filter(|a| a.retry.remediating && t.before.get(&a.id).is_some_and(|b| !b.retry.remediating))
                .map(|a| a.id.to_string())
                .collect();
            if impaired > limit && !started.is_empty() {
                let detail = format!(
                    "{}: {impaired}/{} unhealthy or lost, over max_unhealthy {} ({limit}), yet {} began \
                     its replacement",
                    g.id,
                    g.count,
                    r.max_unhealthy,
                    started.join(", ")
                );
                self.fail(Guarantee::G22RemediationWithinBudget, detail);
            }
        }
    }

    /// Guarantee 24, on every transition: a serving node on an older template
    /// that begins its cleanup starts its slot's rollout replacement; the
    /// slot counts against its group's rollout until it serves again (or is
    /// no longer desired). When slots start, the group's count must be
    /// within `max_unavailable` (a percentage rounded down; with no surge
    /// either, 1).
    fn g24_rollout_budget(&mut self, t: &Transition, successors: Option<&crate::sim::Successors>) {
        // A deleting run wants nothing: its cleanups are no rollout's.
        if self.deleting {
            self.rolling.clear();
            return;
        }
        let Some(shape) = self.shape.clone() else { return };
        let serving =
            |n: &ManagedNode| n.intent == Intent::Active && n.stage.is_ready() && !n.facts.is_impaired();
        // Under surge a slot serves through its successor too: the current
        // attempt hands the slot over once its successor serves.
        let successor_serves =
            |nodes: Option<&Nodes>, id: &LogicalNodeId| nodes.and_then(|s| s.get(id)).is_some_and(&serving);
        let (succ_before, succ_after) = (successors.map(|s| &s.before), successors.map(|s| &s.after));
        // Slots that serve again, or are no longer wanted, are done.
        self.rolling.retain(|id| {
            shape.desired_group(id).is_some()
                && !t.after.get(id).is_some_and(&serving)
                && !successor_serves(succ_after, id)
        });
        for g in &shape.groups {
            let mut started = Vec::new();
            for (id, b) in t
                .before
                .iter()
                .filter(|(id, _)| id.group() == &g.id && id.index() < g.count)
            {
                let drifted = !NodeTemplate::same(&b.spec, &g.template) && *b.spec != *g.template;
                let began = t
                    .after
                    .get(id)
                    .is_some_and(|a| a.attempt == b.attempt && a.intent == Intent::Deleting);
                if serving(b) && drifted && began && !successor_serves(succ_before, id) {
                    started.push(id.clone());
                }
            }
            if started.is_empty() {
                continue;
            }
            self.rolling.extend(started.iter().cloned());
            let budget = g.policy.rollout.resolve(g.count).max_unavailable as usize;
            let rolling = self.rolling.iter().filter(|id| id.group() == &g.id).count();
            if rolling > budget {
                let names: Vec<String> = started.iter().map(ToString::to_string).collect();
                let detail = format!(
                    "{}: {rolling} slots being replaced for the rollout at once, max_unavailable {} allows \
                     {budget}; {} began",
                    g.id,
                    g.policy.rollout.max_unavailable,
                    names.join(", ")
                );
                self.fail(Guarantee::G24RolloutWithinBudget, detail);
            }
        }
    }

    /// Guarantee 21: `node`'s resource of `attempt` is lost; the slot is to
    /// recover on a later attempt.
    /// Guarantee 25: notes the templates each group of the shape in force
    /// is converged on (every desired slot active and ready on it).
    fn g25_converged_on(&mut self, nodes: &Nodes) {
        if self.deleting {
            return;
        }
        let Some(shape) = &self.shape else {
            return;
        };
        for g in &shape.groups {
            let converged = (0..g.count).all(|i| {
                nodes.get(&LogicalNodeId::new(g.id.clone(), i)).is_some_and(|n| {
                    n.intent == Intent::Active && n.is_ready() && NodeTemplate::same(&n.spec, &g.template)
                })
            });
            let seen = self.converged_on.entry(g.id.clone()).or_default();
            if converged && !seen.iter().any(|t| NodeTemplate::same(t, &g.template)) {
                seen.push(g.template.clone());
            }
        }
    }

    /// Guarantee 25, on shapes: a generation the client did not apply is the
    /// driver's revert. Each group it changes goes back to a template the
    /// group was converged on, never to one a revert went away from; a
    /// template the client applies to a group ends what its revert left.
    fn g25_new_generation(&mut self, shape: &ClusterShape) {
        let Some(prev) = self.shape.take() else {
            return;
        };
        if shape.generation <= prev.generation {
            self.shape = Some(prev);
            return;
        }
        let by_client = self.client_generations.contains(&shape.generation.get());
        for g in &shape.groups {
            let Some(p) = prev.groups.iter().find(|p| p.id == g.id) else {
                continue;
            };
            if NodeTemplate::same(&p.template, &g.template) {
                continue;
            }
            if by_client {
                self.reverted_from.remove(&g.id);
                continue;
            }
            let converged = self
                .converged_on
                .get(&g.id)
                .is_some_and(|ts| ts.iter().any(|t| NodeTemplate::same(t, &g.template)));
            if !converged {
                let detail = format!(
                    "generation {} (not the client's) moved group {} from image {} to image {}, a template \
                     the group was never converged on",
                    shape.generation, g.id, p.template.image, g.template.image
                );
                self.fail(Guarantee::G25RevertNeverReentersBadTemplate, detail);
            }
            if self
                .reverted_from
                .get(&g.id)
                .is_some_and(|bad| NodeTemplate::same(bad, &g.template))
            {
                let detail = format!(
                    "generation {} (not the client's) put group {} back on image {}, which a revert went \
                     away from",
                    shape.generation, g.id, g.template.image
                );
                self.fail(Guarantee::G25RevertNeverReentersBadTemplate, detail);
            }
            self.reverted_from.insert(g.id.clone(), p.template.clone());
            self.reverts += 1;
        }
        self.shape = Some(prev);
    }

    /// Guarantee 25, on transitions: once a group is reverted, no attempt of
    /// it starts on the template it was reverted from.
    fn g25_no_attempt_on_reverted(&mut self, t: &Transition) {
        if self.reverted_from.is_empty() {
            return;
        }
        for (id, n) in &t.after {
            let fresh = t.before.get(id).is_none_or(|b| b.attempt != n.attempt);
            if fresh
                && n.intent == Intent::Active
                && self
                    .reverted_from
                    .get(id.group())
                    .is_some_and(|bad| NodeTemplate::same(bad, &n.spec))
            {
                let detail = format!(
                    "{id} started attempt {} on image {}, which its group's revert went away from",
                    n.attempt, n.spec.image
                );
                self.fail(Guarantee::G25RevertNeverReentersBadTemplate, detail);
            }
        }
    }

    fn g21_lost(&mut self, node: &LogicalNodeId, attempt: AttemptId) {
        let passes = self.passes;
        let e = self.lost_slots.entry(node.clone()).or_insert((attempt, passes));
        if attempt > e.0 {
            *e = (attempt, passes);
        }
    }

    /// Guarantee 21, per round: a lost slot has recovered once the state
    /// shows it ready on an attempt after the lost one; one no longer desired
    /// (scaled down, removed, the run deleted) has nothing to recover.
    fn g21_recovered(&mut self, s: &RunSnapshot) {
        let done: Vec<LogicalNodeId> = self
            .lost_slots
            .iter()
            .filter(|(id, (lost, _))| {
                s.gone
                    || self.desired_template(id).is_none()
                    || s.nodes
                        .get(*id)
                        .is_some_and(|n| n.is_ready() && n.attempt > *lost)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in done {
            self.lost_slots.remove(&id);
        }
    }

    /// Guarantee 21, when the fair tail ends without converging within its
    /// pass bound (or stalls, so that it never will): every desired slot that
    /// lost its resource and is not ready again on a later attempt breaks it.
    /// The liveness of guarantee 18, for the slots that day 2 broke: a
    /// driver that never replaces a lost resource, or waits on it forever,
    /// is named here rather than only as a run that does not converge. A run
    /// that does converge cannot break it: converged means every desired slot
    /// is ready, and one still on its lost attempt is guarantee 23's.
    pub fn g21_unrecovered(&self, at: StepRef, s: &RunSnapshot) -> Vec<Violation> {
        self.lost_slots
            .iter()
            .map(|(id, (lost, seen))| {
                let now = s.nodes.get(id).map_or("no node".to_owned(), |n| {
                    format!("attempt {} {:?}/{:?}", n.attempt, n.intent, n.stage)
                });
                Violation {
                    guarantee: Guarantee::G21LostSlotRecovers,
                    at,
                    detail: format!(
                        "{id} lost attempt {lost} (seen at pass {seen}) and is not ready on a later attempt \
                         when the fair tail ends at pass {}: {now}",
                        s.passes
                    ),
                }
            })
            .collect()
    }

    /// Guarantee 23: the executor's report `c` is its latest word on the
    /// attempt, unless a later one came first.
    fn g23_said(&mut self, c: &contract::ResourceChange) {
        let key = (c.node.clone(), c.attempt);
        match &c.change {
            contract::Change::Lost { .. } => {
                self.lost_said.insert(key);
            }
            contract::Change::Health { healthy, .. } => {
                let order = (c.at, c.seq);
                let said = self.health_said.entry(key).or_insert((order, *healthy));
                if order >= said.0 {
                    *said = (order, *healthy);
                }
            }
        }
    }

    /// Guarantee 23: whenever the run says it is converged and nothing is on
    /// its way, the executor's last word on every node's current attempt is
    /// neither lost nor unhealthy. Across processes a report is the
    /// executor's word from the round after its acknowledgement (see
    /// `said_unacked`): a report still on its way when the status was read
    /// does not count against that status.
    fn g23_converged_is_observed(&mut self, s: &RunSnapshot, quiescent: bool) {
        if !quiescent || !s.converged || s.gone {
            return;
        }
        for n in s.nodes.values() {
            let key = (n.id.clone(), n.attempt);
            let said = if self.lost_said.contains(&key) {
                Some("lost")
            } else if self.health_said.get(&key).is_some_and(|(_, healthy)| !healthy) {
                Some("unhealthy")
            } else {
                None
            };
            if let Some(said) = said {
                let detail = format!(
                    "converged, but the executor said {} attempt {} is {said}",
                    n.id, n.attempt
                );
                self.fail(Guarantee::G23ConvergedMeansObserved, detail);
            }
        }
    }

    /// Converged leaks nothing: whenever the run is converged and nothing is on
    /// its way, the backend holds exactly one resource per node, of the node's
    /// current attempt; whenever the run is gone and nothing is on its way, the
    /// backend holds nothing of the run.
    ///
    /// Across processes the backend is read after the status, and a resource
    /// can be lost in between (its loss then still on its way to the driver),
    /// so there a converged run that does not match the backend breaks it
    /// only when the same mismatch is read again at the next round, the run
    /// still converged: by then a loss has been folded (the run is no longer
    /// converged) or the driver missed it. A gone run is checked at once:
    /// nothing of it may appear after it.
    fn converged_leaks_nothing(
        &mut self,
        s: &RunSnapshot,
        inventory: &[super::record::Resource],
        quiescent: bool,
        backend: Backend,
    ) {
        let previous = self.mismatch[backend as usize].take();
        if !quiescent {
            return;
        }
        if s.gone {
            if !inventory.is_empty() {
                let left: Vec<String> = inventory
                    .iter()
                    .map(|r| format!("{} a{}", r.node, r.attempt.get()))
                    .collect();
                self.fail(
                    Guarantee::ConvergedLeaksNothing,
                    format!("the deleted run left {}", left.join(", ")),
                );
            }
            return;
        }
        if !s.converged {
            return;
        }
        let want: BTreeSet<(LogicalNodeId, AttemptId)> =
            s.nodes.values().map(|n| (n.id.clone(), n.attempt)).collect();
        let have: BTreeSet<(LogicalNodeId, AttemptId)> =
            inventory.iter().map(|r| (r.node.clone(), r.attempt)).collect();
        if want != have || inventory.len() != want.len() {
            if self.events_after_state {
                let mismatch = (want.clone(), have.clone(), inventory.len());
                let again = previous.as_ref() == Some(&mismatch);
                self.mismatch[backend as usize] = Some(mismatch);
                if !again {
                    return;
                }
            }
            let extra: Vec<String> = have.difference(&want).map(|(n, a)| format!("{n} {a}")).collect();
            let missing: Vec<String> = want.difference(&have).map(|(n, a)| format!("{n} {a}")).collect();
            let detail = format!(
                "converged, but the backend holds extra [{}] and lacks [{}]",
                extra.join(", "),
                missing.join(", ")
            );
            self.fail(Guarantee::ConvergedLeaksNothing, detail);
        }
    }
}

/// A message, briefly.
/// The two views of a transition that the checks of one attempt's record
/// read, each as if every attempt in it were its slot's only one: the slots'
/// current attempts (a successor that takes its slot over shows as having
/// held it already, continuing) and, where the run holds any, the successors
/// of a rollout's surge (one that takes its slot over leaves this view
/// without being removed). Decisions go to the view holding the attempt they
/// name, inserts to the current one; the reap of a current attempt whose
/// successor takes over is in neither (`g19_handover` checks it). The
/// `surge` marks the driver derives from a slot's pair are cleared: a change
/// of the successor marks its current attempt, which is checked on its own
/// (`g19_successors`).
fn views(t: &Transition) -> (std::borrow::Cow<'_, Transition>, Option<Transition>) {
    use std::borrow::Cow;
    let Some(s) = t.successors.as_deref() else {
        return (Cow::Borrowed(t), None);
    };
    let promoted: BTreeSet<&LogicalNodeId> = promoted(t).collect();
    let clear = |nodes: &Nodes| -> Nodes {
        nodes
            .iter()
            .map(|(id, n)| {
                let mut n = n.clone();
                n.surge = contract::Surge::None;
                (id.clone(), n)
            })
            .collect()
    };
    let mut before_c = clear(&t.before);
    for id in &promoted {
        if let Some(n) = s.before.get(*id) {
            let mut n = n.clone();
            n.surge = contract::Surge::None;
            before_c.insert((*id).clone(), n);
        }
    }
    let after_c = clear(&t.after);
    let mut before_s = clear(&s.before);
    before_s.retain(|id, _| !promoted.contains(id));
    let after_s = clear(&s.after);
    let holds = |before: &Nodes, after: &Nodes, d: &Decision| {
        [before, after]
            .iter()
            .any(|m| m.get(&d.node).is_some_and(|n| Some(n.attempt) == d.attempt))
    };
    let split = |ds: &[Decision]| -> (Vec<Decision>, Vec<Decision>) {
        let current = ds
            .iter()
            .filter(|d| d.attempt.is_none() || holds(&before_c, &after_c, d))
            .cloned()
            .collect();
        let successors = ds
            .iter()
            .filter(|d| {
                d.attempt.is_some() && !holds(&before_c, &after_c, d) && holds(&before_s, &after_s, d)
            })
            .cloned()
            .collect();
        (current, successors)
    };
    let (cause_c, cause_s) = match &t.cause {
        Cause::Decisions(ds) => {
            let (c, s) = split(ds);
            (Cause::Decisions(c), Cause::Decisions(s))
        }
        Cause::Answer(ds) => {
            let (c, s) = split(ds);
            (Cause::Answer(c), Cause::Answer(s))
        }
        other => (other.clone(), other.clone()),
    };
    let view = |cause, before, after| Transition {
        at: t.at,
        applied_at: t.applied_at,
        cause,
        before,
        after,
        successors: None,
    };
    (
        Cow::Owned(view(cause_c, before_c, after_c)),
        Some(view(cause_s, before_s, after_s)),
    )
}

/// Slots whose successor took the slot over in `t`.
fn promoted(t: &Transition) -> impl Iterator<Item = &LogicalNodeId> {
    t.successors.iter().flat_map(move |s| {
        s.before
            .iter()
            .filter(move |(id, n)| t.after.get(*id).is_some_and(|a| a.attempt == n.attempt))
            .map(|(id, _)| id)
    })
}

pub fn describe(m: &ToDriver) -> String {
    match m {
        ToDriver::Result(r) => format!(
            "result {} {} {}{}{} for {}",
            r.id,
            r.effect.name(),
            r.outcome.class_name(),
            if r.late { " (late)" } else { "" },
            if r.replayed { " (replayed)" } else { "" },
            r.node
        ),
        ToDriver::Observation(o) => format!(
            "observation {} #{} {} of {} attempt {}",
            o.session,
            o.seq,
            o.stage.name(),
            o.node,
            o.attempt
        ),
        ToDriver::Rejection(r) => format!("rejection {:?} {}", r.id, r.reason.name()),
        ToDriver::Change(c) => format!(
            "resource change #{} {} of {} attempt {}",
            c.seq,
            c.change.name(),
            c.node,
            c.attempt
        ),
    }
}
