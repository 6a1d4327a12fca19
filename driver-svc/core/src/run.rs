//! One run's state machine: the sans-IO heart of the driver.
//!
//! Inputs arrive as method calls with `now` as an argument (shape updates, pass
//! decisions, executor results, bootstrap observations, deadlines); outputs are
//! values (operations to submit, acknowledgements to send, the next deadline).
//! The async shell owns one `RunState` per run in a single task, so this type is
//! the only writer of the run's state.
//!
//! A pass is two calls: [`RunState::begin_pass`] folds expired deadlines and
//! names the nodes that need a decision; [`RunState::apply_decisions`] applies
//! the decider's answer to exactly the state it was computed from (a node that
//! changed meanwhile is skipped and queued for the next pass), records every
//! operation pending with its deadline, and returns the pass's writes as one
//! [`Commit`] that holds the operations back until the shell has made the
//! writes durable. Between passes, [`RunState::take_commit`] hands over what
//! folds changed, holding back their acknowledgements the same way.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    sync::Arc,
    time::Duration,
};

use contract::{
    Action, AttemptId, BootstrapProgress, BootstrapStage, Change, ClockSaturated, ClusterShape, DecideOutput,
    Decision, Effect, Epoch, Event, EventReason, Failure, FieldError, Generation, GroupCounts, Intent,
    LogicalNodeId, ManagedNode, NodeHealth, NodeStage, NodeTemplate, Observation, Operation, OperationId,
    OperationInput, OperationResult, Outcome, PendingOp, PermanentFailure, Rejection, ResourceChange,
    RetryState, Rule, RunId, RunUid, Subject, Surge, TraceContext, UnixMillis, backoff_delay,
};
use decider::{DesiredView, SlotSet};

use crate::{
    commit::{AckRef, Commit},
    policy::Policy,
    rollout::{self, GroupRollout, StableGroup, Tally},
    store::{ConditionMark, NodeRecord, RunDelta, RunMeta, StoredRun},
};

/// Why a promotion was refused. Nothing changes when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromoteError {
    #[error("the run has no group {0}")]
    NoSuchGroup(contract::GroupId),
    #[error("group {0} has no rollout in progress")]
    NoRollout(contract::GroupId),
}

/// Why a shape update was refused. Nothing changes when one is returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApplyError {
    #[error("invalid shape: {0}")]
    Invalid(#[from] FieldError),
    #[error("run_id {given} does not match the run's id {current}; a run's id is fixed for its life")]
    RunIdChanged { current: RunId, given: RunId },
    #[error("generation {given} is lower than the current generation {current}")]
    GenerationRegressed { current: Generation, given: Generation },
    #[error("generation {0} was already applied with other content; bump the generation to change the shape")]
    SameGenerationOtherContent(Generation),
    #[error("run {0} is being deleted; apply again once it is gone")]
    Deleting(RunId),
}

/// What an accepted shape update did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Changed,
    /// Same generation, same content: an idempotent no-op.
    Unchanged,
}

/// Errors of the state machine itself. None of them panics or loops: each is
/// returned and the state is left consistent.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error(transparent)]
    Clock(#[from] ClockSaturated),
    #[error("attempt id allocator exhausted")]
    AttemptsExhausted,
    #[error("operation sequence exhausted for {0}")]
    SequenceExhausted(LogicalNodeId),
    #[error("a pass is already in progress")]
    PassInProgress,
    #[error("no pass is in progress")]
    NoPass,
}

/// Why a result or observation was not folded. Each is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Discard {
    OtherRun,
    UnknownNode,
    SupersededAttempt,
    /// No pending operation with that id: unknown, or already expired.
    UnknownOperation,
    EffectMismatch,
    /// A completion after the executor abandoned the operation.
    Late,
    /// An observation of a session the attempt does not hold.
    StaleSession,
    /// An observation at or below the last folded sequence number.
    Duplicate,
    /// An observation past the next sequence number of its session: one
    /// before it has not arrived yet (a stream broken and reconnected sends
    /// new stages before the replay of older ones). It is not acknowledged,
    /// and the session is asked for again after the last folded number, so
    /// every stage is folded once and in order.
    Gap,
    /// An observation of a session whose `StartBootstrap` result has not been
    /// folded yet. It is not acknowledged: the executor keeps it, and the
    /// driver asks for it again once the result names the session.
    SessionNotYetKnown,
    /// An observation after its session's end (a terminal stage is
    /// folded): a session reports nothing after its end, and folding it
    /// would take the node back to a stage it has passed.
    AfterEnd,
}

impl Discard {
    pub const ALL: [Discard; 11] = [
        Discard::OtherRun,
        Discard::UnknownNode,
        Discard::SupersededAttempt,
        Discard::UnknownOperation,
        Discard::EffectMismatch,
        Discard::Late,
        Discard::StaleSession,
        Discard::Duplicate,
        Discard::Gap,
        Discard::SessionNotYetKnown,
        Discard::AfterEnd,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Discard::OtherRun => "other-run",
            Discard::UnknownNode => "unknown-node",
            Discard::SupersededAttempt => "superseded-attempt",
            Discard::UnknownOperation => "unknown-operation",
            Discard::EffectMismatch => "effect-mismatch",
            Discard::Late => "late",
            Discard::StaleSession => "stale-session",
            Discard::Duplicate => "duplicate",
            Discard::Gap => "gap",
            Discard::SessionNotYetKnown => "session-not-yet-known",
            Discard::AfterEnd => "after-end",
        }
    }
}

/// The outcome of folding one result or observation.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fold {
    Folded,
    Discarded(Discard),
}

/// The nodes a pass asks the decider about, and the state it asked about.
#[must_use]
#[derive(Debug, Clone)]
pub struct PassPlan {
    pub now: UnixMillis,
    pub generation: Generation,
    pub deleting: bool,
    /// Nodes to decide, with the version each had when the plan was made.
    pub nodes: Vec<(LogicalNodeId, u64)>,
    /// Whether every node is in `nodes` (after a shape change, a restart or a
    /// safety tick) rather than only those that changed or are due.
    pub full: bool,
}

/// What applying a pass's decisions produced.
#[must_use]
#[derive(Debug, Clone)]
pub struct PassOutcome {
    /// The pass's writes (with the folds' since the last commit), holding
    /// back the operations it recorded pending and the acknowledgements of
    /// those folds until the shell has made it durable.
    pub commit: Commit,
    /// How many operations the pass recorded pending (kept when the commit
    /// is taken out, see [`PassOutcome::take_commit`]).
    pub operations: u32,
    pub transitions: u32,
    /// Decisions skipped because their node changed while the decider ran.
    pub stale: u32,
    /// Where those are in the decider's answer (for the event trace).
    pub stale_at: Vec<u32>,
    /// Actions (not waits) by rule number.
    pub actions_by_rule: [u32; contract::Rule::SLOTS],
    /// Another pass is needed at once (a driver transition happened, or a
    /// decision was stale).
    pub follow_up: bool,
    pub converged: bool,
}

impl PassOutcome {
    /// Moves the commit out (to persist it), leaving an empty one and the
    /// pass's counts.
    pub fn take_commit(&mut self) -> Commit {
        let empty = Commit::new(RunDelta::new(self.commit.delta().uid), Vec::new(), Vec::new());
        std::mem::replace(&mut self.commit, empty)
    }
}

/// The last decision recorded for a node, for explanations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastDecision {
    pub decision: Decision,
    pub at: UnixMillis,
}

#[derive(Debug, Clone)]
struct Entry {
    /// Shared with the commits that hold it until it changes again (see
    /// [`Entry::rec_mut`]).
    rec: Arc<NodeRecord>,
    /// Bumped on every change, so a decision computed from an older state is
    /// recognised and skipped.
    version: u64,
    /// Changed since the last decision.
    dirty: bool,
    /// When the last decision asked for another look on its own.
    wake_at: Option<UnixMillis>,
    last: Option<LastDecision>,
    /// The successor attempt's last decision, while the slot holds one.
    succ_last: Option<LastDecision>,
    trace: TraceContext,
    /// What the run's indexes hold for this entry (see `RunState::reindex`).
    indexed: Indexed,
}

/// An entry's keys in the run's indexes, as last synced.
#[derive(Debug, Clone, Copy, Default)]
struct Indexed {
    dirty: bool,
    wake: Option<UnixMillis>,
    deadline: Option<UnixMillis>,
    /// Counted in its group's `GroupCounts`.
    impaired: bool,
    remediating: bool,
    /// Counted in its group's rollout tally (see [`Slot`]).
    slot: Slot,
    /// The slot holds a successor attempt.
    surging: bool,
}

/// What a node is to its group's rollout, by the shape it is indexed under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Slot {
    /// In a desired slot.
    desired: bool,
    /// Desired, and serving: active, ready, neither unhealthy nor lost.
    available: bool,
    /// Desired, on the group's current template.
    updated: bool,
    /// Updated and available.
    updated_ready: bool,
    /// Updated, and its attempt failed.
    failed: bool,
}

impl Slot {
    /// What a slot is, from its attempts (the current one and any
    /// successor, in either order: the marks are the same).
    fn of<'a>(
        mut attempts: impl Iterator<Item = &'a ManagedNode>,
        shape: &ClusterShape,
        deleting: bool,
    ) -> Self {
        let Some(first) = attempts.next() else {
            return Self::default();
        };
        let Some(g) = shape.desired_group(&first.id).filter(|_| !deleting) else {
            return Self::default();
        };
        let mut slot = Self {
            desired: true,
            ..Self::default()
        };
        for n in std::iter::once(first).chain(attempts) {
            let serves = n.intent == Intent::Active && n.stage.is_ready() && !n.facts.is_impaired();
            let current = NodeTemplate::same(&g.template, &n.spec);
            slot.available |= serves;
            slot.updated |= current;
            slot.updated_ready |= current && serves;
            slot.failed |= current && (n.stage == NodeStage::Failed || n.facts.bootstrap_failed());
        }
        slot
    }
}

/// Whether an attempt serves: active, ready, neither unhealthy nor lost.
fn serves(n: &ManagedNode) -> bool {
    n.intent == Intent::Active && n.stage.is_ready() && !n.facts.is_impaired()
}

/// The earliest of an attempt's deadlines the run watches: its operation's
/// deadline plus grace, and an active attempt's stage deadline.
fn deadline_of(n: &ManagedNode, grace: Duration) -> Option<UnixMillis> {
    [
        n.pending.and_then(|p| p.deadline.checked_add(grace).ok()),
        n.stage_deadline.filter(|_| n.intent == Intent::Active),
    ]
    .into_iter()
    .flatten()
    .min()
}

impl Entry {
    fn new(rec: NodeRecord) -> Self {
        Self {
            rec: Arc::new(rec),
            version: 0,
            dirty: true,
            wake_at: None,
            last: None,
            succ_last: None,
            trace: TraceContext::default(),
            indexed: Indexed::default(),
        }
    }

    /// The record, to change: copied first if a commit still holds it.
    fn rec_mut(&mut self) -> &mut NodeRecord {
        Arc::make_mut(&mut self.rec)
    }

    /// The slot's successor attempt is `attempt`.
    fn is_successor(&self, attempt: AttemptId) -> bool {
        self.rec
            .successor
            .as_ref()
            .is_some_and(|s| s.node.attempt == attempt)
    }

    /// Puts the successor attempt in the current attempt's place and the
    /// current in the successor's (its own inverse): the machinery written for
    /// a slot's attempt then works on either (see `RunState::on_attempt`).
    fn swap_successor(&mut self) {
        if self.rec.successor.is_none() {
            return;
        }
        let rec = Arc::make_mut(&mut self.rec);
        if let Some(s) = rec.successor.as_deref_mut() {
            std::mem::swap(&mut rec.node, &mut s.node);
            std::mem::swap(&mut rec.next_seq, &mut s.next_seq);
            std::mem::swap(&mut rec.inflight, &mut s.inflight);
            std::mem::swap(&mut self.last, &mut self.succ_last);
        }
    }

    /// The successor takes the slot (its last decision with it): the
    /// attempt it replaced, or `None`, and nothing changed, when the slot
    /// holds no successor.
    fn promote_successor(&mut self) -> Option<Arc<NodeRecord>> {
        self.rec.successor.as_ref()?;
        let successor = self.rec_mut().successor.take()?;
        let gone = std::mem::replace(&mut self.rec, Arc::new(*successor));
        self.last = self.succ_last.take();
        self.version += 1;
        self.dirty = true;
        self.wake_at = None;
        Some(gone)
    }

    /// The slot's attempts: the current one, then its successor.
    fn attempts(&self) -> impl Iterator<Item = &ManagedNode> {
        std::iter::once(&self.rec.node).chain(self.rec.successor.as_deref().map(|s| &s.node))
    }
}

/// What an abandoned node left behind: its identity and the live facts the
/// driver knew when it forgot the node (see [`RunState::abandon`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbandonedNode {
    pub run_uid: RunUid,
    pub run_id: RunId,
    pub node: LogicalNodeId,
    pub attempt: AttemptId,
    pub lease: Option<contract::LeaseId>,
    pub endpoint: Option<contract::Endpoint>,
    pub session: Option<contract::SessionId>,
    /// The operation that was pending when the node was abandoned, if any
    /// (its result, should one come, is discarded as unknown).
    pub pending: Option<OperationId>,
    pub at: UnixMillis,
}

/// A resource of a run that the orphan sweep found and no node of the run
/// holds: it is adopted as a node being deleted, so the normal deletion path
/// destroys it (see [`RunState::adopt_orphan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrphanResource {
    pub node: LogicalNodeId,
    pub attempt: AttemptId,
    pub lease: Option<contract::LeaseId>,
    pub endpoint: Option<contract::Endpoint>,
    /// A bootstrap session may be live; its id is not known.
    pub session_live: bool,
}

impl From<&contract::InventoryResource> for OrphanResource {
    fn from(r: &contract::InventoryResource) -> Self {
        Self {
            node: r.identity.node.clone(),
            attempt: r.identity.attempt,
            lease: r.lease.clone(),
            endpoint: r.endpoint.clone(),
            session_live: r.session_live,
        }
    }
}

/// The attempt of `n` fails: its cleanup starts at once (row 4), its restart
/// backs off until `restart_at`, and its failure count is `failures`.
fn attempt_failed(n: &mut ManagedNode, failures: u32, restart_at: UnixMillis, failure: Failure) {
    n.stage = NodeStage::Failed;
    n.stage_deadline = None;
    n.retry.consecutive_failures = failures;
    n.retry.next_effect_at = None;
    n.retry.restart_at = Some(restart_at);
    n.facts.failure = Some(failure);
}

/// How the failure of an attempt whose resource was lost begins.
pub const LOST_PREFIX: &str = "resource lost: ";

/// The first operation sequence number on an adopted orphan: above any its
/// attempt used before, so the executor never sees one of the attempt's
/// operation ids again with another input.
pub const ORPHAN_SEQ_BASE: u32 = 1 << 24;

/// Counters a run keeps for metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunCounters {
    pub passes: u64,
    pub operations: u64,
    pub folded_results: u64,
    pub folded_observations: u64,
    pub discarded: BTreeMap<&'static str, u64>,
    pub deadline_folds: u64,
    pub stage_timeouts: u64,
    /// Attempts failed because their resource was lost.
    pub lost: u64,
    /// Attempts replaced for health.
    pub remediated: u64,
}

/// One run's state and the machine that changes it.
#[derive(Debug, Clone)]
pub struct RunState {
    meta: RunMeta,
    policy: Arc<Policy>,
    /// Boxed: a map's leaves hold their values inline and are about half full
    /// when ids are inserted in order, so an inline `Entry` cost twice its size.
    nodes: BTreeMap<LogicalNodeId, Box<Entry>>,
    /// The next pass must decide every node.
    full: bool,
    in_pass: bool,
    meta_dirty: bool,
    changed: BTreeSet<LogicalNodeId>,
    removed: BTreeSet<LogicalNodeId>,
    unacked: Vec<AckRef>,
    /// A driver transition or a stale decision asks for the next pass at once.
    urgent: bool,
    /// When the first fold since the last pass happened (see `Policy::pass_batch`).
    batch_from: Option<UnixMillis>,
    /// Folds since the last pass, and when the latest happened.
    folds_since_pass: usize,
    last_fold: Option<UnixMillis>,
    /// Nodes with a pending operation.
    pending_ops: usize,
    /// Sessions whose observations to ask the executor for again.
    replays: Vec<(LogicalNodeId, contract::SessionId)>,
    counters: RunCounters,
    pass_trace: TraceContext,
    /// Indexes over the nodes, so that what the shell asks after every event
    /// (`needs_pass`, `poll_timeout`) and a pass's plan cost no scan of the
    /// run: dirty nodes, decision wake-ups, deadlines (operation deadline
    /// plus grace, or an active node's stage deadline), nodes held per group.
    /// Synced by `reindex` after every change to an entry.
    dirty_ids: BTreeSet<LogicalNodeId>,
    wakes: BTreeSet<(UnixMillis, LogicalNodeId)>,
    deadlines: BTreeSet<(UnixMillis, LogicalNodeId)>,
    held: HashMap<contract::GroupId, u64>,
    /// Each group's day-2 counts (unhealthy or lost, remediating), for the
    /// remediation budget the decider applies.
    counts: HashMap<contract::GroupId, GroupCounts>,
    /// Nodes whose last decision was a wait for the remediation budget: a
    /// change of their group's counts decides them again.
    budget_held: BTreeSet<LogicalNodeId>,
    /// Nodes whose last decision was a wait for a rollout's budget, canary
    /// or halt (rule 17; not a current attempt waiting for its successor).
    rollout_held: BTreeSet<LogicalNodeId>,
    /// How many operations the next pass may dispatch (`None`: as many as
    /// it decides), set by the shell from the driver's admission limit.
    dispatch_room: Option<usize>,
    /// Nodes whose last decision dispatched an operation the room did not
    /// admit: nothing was recorded for them, and passes with room decide
    /// them again, lowest first, as many as the room.
    dispatch_held: BTreeSet<LogicalNodeId>,
    /// Nodes whose lease was recorded since the orphan sweep began a read
    /// of the executor's inventory (`None`: no read under way, as far as
    /// the run knows). Such a lease may be made after its page was read.
    leases_during_read: Option<BTreeSet<LogicalNodeId>>,
    /// The slots the run holds, built on first use after a node was
    /// inserted or removed: every pass sends them, and they change only
    /// when the run's nodes do.
    slots: std::sync::OnceLock<SlotSet>,
    /// Groups whose counts changed since the last pass.
    counts_changed: BTreeSet<contract::GroupId>,
    /// Each group's rollout tally, and the attempts of each group's current
    /// template that failed since its rollout last looked.
    tallies: HashMap<contract::GroupId, Tally>,
    new_failures: HashMap<contract::GroupId, u32>,
    /// The run's event log as kept (at most `Policy::event_limit`, oldest
    /// first), the next sequence number, and what the next commit writes:
    /// events recorded or repeated, and where the kept log now starts.
    events: VecDeque<Event>,
    next_event_seq: u64,
    events_changed: BTreeSet<u64>,
    events_below: Option<u64>,
}

/// See [`RunState::request_undo`].
#[derive(Debug, Clone)]
pub struct RequestUndo {
    meta: RunMeta,
    meta_dirty: bool,
    full: bool,
    events: VecDeque<Event>,
    next_event_seq: u64,
    events_changed: BTreeSet<u64>,
    events_below: Option<u64>,
}

/// How many `pass_batch` windows a burst of results may stretch one batch to
/// (see `RunState::batch_end`).
const BATCH_STRETCH: u32 = 20;

impl RunState {
    /// A new run from its first shape. The caller supplies a fresh uid and the
    /// epoch it holds for the run.
    pub fn create(
        shape: ClusterShape,
        uid: RunUid,
        epoch: Epoch,
        policy: Arc<Policy>,
        now: UnixMillis,
    ) -> Result<Self, ApplyError> {
        shape.validate(&policy.limits)?;
        let meta = RunMeta {
            run_id: shape.run_id.clone(),
            uid,
            epoch,
            shape,
            deleting: false,
            paused: false,
            observed_generation: Generation::new(0),
            next_attempt: 1,
            created_at: now,
            converged_at: None,
            reclaim: false,
            conditions: Vec::new(),
            rollouts: Vec::new(),
            stable: Vec::new(),
        };
        Ok(Self::from_parts(meta, Vec::new(), Vec::new(), policy))
    }

    /// A run rebuilt from the store, under a new epoch.
    /// Operations in flight are carried over under the new epoch (the epoch is
    /// not part of the executor's dedup comparison, so a resubmission replays or
    /// adopts), and every stored deadline keeps its wall-clock meaning.
    pub fn restore(stored: StoredRun, epoch: Epoch, policy: Arc<Policy>) -> Self {
        let mut meta = stored.meta;
        meta.epoch = epoch;
        let mut nodes = stored.nodes;
        for n in &mut nodes {
            if let Some(op) = n.inflight.as_mut() {
                op.epoch = epoch;
            }
        }
        let mut run = Self::from_parts(meta, nodes, stored.events, policy);
        run.meta_dirty = true;
        // Every node is written back once, so the new epoch on the in-flight
        // operations is durable before any of them is resubmitted.
        run.changed = run.nodes.keys().cloned().collect();
        run
    }

    fn from_parts(meta: RunMeta, nodes: Vec<NodeRecord>, events: Vec<Event>, policy: Arc<Policy>) -> Self {
        // The latest event is always kept, so the log's last number is the
        // last one handed out.
        let next_event_seq = events.last().map_or(1, |e| e.seq.saturating_add(1));
        let nodes: BTreeMap<LogicalNodeId, Box<Entry>> = nodes
            .into_iter()
            .map(|mut r| {
                intern_in(&meta.shape, &mut r.node.id);
                (r.node.id.clone(), Box::new(Entry::new(r)))
            })
            .collect();
        let pending_ops = nodes
            .values()
            .flat_map(|e| e.attempts())
            .filter(|n| n.pending.is_some())
            .count();
        let ids: Vec<LogicalNodeId> = nodes.keys().cloned().collect();
        let mut run = Self {
            dirty_ids: BTreeSet::new(),
            wakes: BTreeSet::new(),
            deadlines: BTreeSet::new(),
            held: HashMap::new(),
            counts: HashMap::new(),
            budget_held: BTreeSet::new(),
            rollout_held: BTreeSet::new(),
            dispatch_room: None,
            dispatch_held: BTreeSet::new(),
            leases_during_read: None,
            slots: std::sync::OnceLock::new(),
            counts_changed: BTreeSet::new(),
            tallies: HashMap::new(),
            new_failures: HashMap::new(),
            urgent: false,
            batch_from: None,
            folds_since_pass: 0,
            last_fold: None,
            pending_ops,
            meta,
            policy,
            nodes,
            full: true,
            in_pass: false,
            meta_dirty: true,
            changed: BTreeSet::new(),
            removed: BTreeSet::new(),
            unacked: Vec::new(),
            replays: Vec::new(),
            counters: RunCounters::default(),
            pass_trace: TraceContext::default(),
            events: events.into(),
            next_event_seq,
            events_changed: BTreeSet::new(),
            events_below: None,
        };
        for id in ids {
            *run.held.entry(id.group().clone()).or_default() += 1;
            run.reindex(&id);
        }
        // Failures a restored rollout already counted.
        run.new_failures.clear();
        // A log stored under a larger limit is cut to this one.
        run.trim_events();
        run
    }

    /// Points `id` at the run's own allocation of its group's name, the
    /// shape's, which the ids of the nodes the run inserts share. [`contract::GroupId`]
    /// compares addresses before names, so an id decoded from a message (an
    /// allocation of its own) costs a string comparison at every step of
    /// every map lookup until it is interned: at a million nodes, a tenth of
    /// the driver's time. A group the shape does not have is left as it is.
    pub fn intern(&self, id: &mut LogicalNodeId) {
        intern_in(&self.meta.shape, id);
    }

    // ----- indexes -------------------------------------------------------

    /// Brings the indexes in line with the entry of `id` (which exists).
    fn reindex(&mut self, id: &LogicalNodeId) {
        let grace = self.policy.result_grace;
        let Some(e) = self.nodes.get_mut(id) else {
            return;
        };
        // Each attempt of a slot holding two knows the other's part (written
        // only when it moved: a record a commit holds is copied to change).
        let (current, successor) = match e.rec.successor.as_deref() {
            Some(s) => (
                Surge::Current {
                    successor: s.node.attempt,
                    successor_ready: serves(&s.node),
                },
                Some(Surge::Successor),
            ),
            None => (Surge::None, None),
        };
        if e.rec.node.surge != current || e.rec.successor.as_ref().map(|s| s.node.surge) != successor {
            let rec = e.rec_mut();
            rec.node.surge = current;
            if let (Some(s), Some(surge)) = (rec.successor.as_deref_mut(), successor) {
                s.node.surge = surge;
            }
        }
        let deadline = e.attempts().filter_map(|n| deadline_of(n, grace)).min();
        let now = Indexed {
            dirty: e.dirty,
            wake: e.wake_at,
            deadline,
            impaired: e
                .attempts()
                .any(|n| n.stage != NodeStage::Destroyed && n.facts.is_impaired()),
            remediating: e.attempts().any(|n| n.retry.remediating),
            slot: Slot::of(e.attempts(), &self.meta.shape, self.meta.deleting),
            surging: e.rec.successor.is_some(),
        };
        let was = std::mem::replace(&mut e.indexed, now);
        if (was.impaired, was.remediating, was.slot, was.surging)
            != (now.impaired, now.remediating, now.slot, now.surging)
        {
            let c = self.counts.entry(id.group().clone()).or_default();
            c.unhealthy = c.unhealthy + u32::from(now.impaired) - u32::from(was.impaired);
            c.remediating = c.remediating + u32::from(now.remediating) - u32::from(was.remediating);
            c.available = c.available + u32::from(now.slot.available) - u32::from(was.slot.available);
            c.updated = c.updated + u32::from(now.slot.updated) - u32::from(was.slot.updated);
            c.surging = c.surging + u32::from(now.surging) - u32::from(was.surging);
            let t = self.tallies.entry(id.group().clone()).or_default();
            t.held = t.held + u32::from(now.slot.desired) - u32::from(was.slot.desired);
            t.updated = t.updated + u32::from(now.slot.updated) - u32::from(was.slot.updated);
            t.updated_ready =
                t.updated_ready + u32::from(now.slot.updated_ready) - u32::from(was.slot.updated_ready);
            if now.slot.failed && !was.slot.failed {
                *self.new_failures.entry(id.group().clone()).or_default() += 1;
            }
            self.counts_changed.insert(id.group().clone());
        }
        if was.dirty != now.dirty {
            if now.dirty {
                self.dirty_ids.insert(id.clone());
            } else {
                self.dirty_ids.remove(id);
            }
        }
        if was.wake != now.wake {
            if let Some(t) = was.wake {
                self.wakes.remove(&(t, id.clone()));
            }
            if let Some(t) = now.wake {
                self.wakes.insert((t, id.clone()));
            }
        }
        if was.deadline != now.deadline {
            if let Some(t) = was.deadline {
                self.deadlines.remove(&(t, id.clone()));
            }
            if let Some(t) = now.deadline {
                self.deadlines.insert((t, id.clone()));
            }
        }
    }

    /// Inserts an entry and indexes it.
    fn insert_entry(&mut self, id: LogicalNodeId, e: Box<Entry>) {
        if let Some(old) = self.nodes.insert(id.clone(), e) {
            self.unindex(&id, &old);
        } else {
            *self.held.entry(id.group().clone()).or_default() += 1;
            self.slots.take();
        }
        self.reindex(&id);
    }

    /// Removes an entry and its index keys.
    fn remove_entry(&mut self, id: &LogicalNodeId) -> Option<Box<Entry>> {
        let e = self.nodes.remove(id)?;
        self.slots.take();
        self.unindex(id, &e);
        if let Some(n) = self.held.get_mut(id.group()) {
            *n = n.saturating_sub(1);
        }
        Some(e)
    }

    fn unindex(&mut self, id: &LogicalNodeId, e: &Entry) {
        if e.indexed.dirty {
            self.dirty_ids.remove(id);
        }
        if let Some(t) = e.indexed.wake {
            self.wakes.remove(&(t, id.clone()));
        }
        if let Some(t) = e.indexed.deadline {
            self.deadlines.remove(&(t, id.clone()));
        }
        let x = e.indexed;
        if (x.impaired || x.remediating || x.surging || x.slot != Slot::default())
            && let Some(c) = self.counts.get_mut(id.group())
        {
            c.unhealthy -= u32::from(x.impaired);
            c.remediating -= u32::from(x.remediating);
            c.surging -= u32::from(x.surging);
            c.available -= u32::from(x.slot.available);
            c.updated -= u32::from(x.slot.updated);
            if let Some(t) = self.tallies.get_mut(id.group()) {
                t.held -= u32::from(x.slot.desired);
                t.updated -= u32::from(x.slot.updated);
                t.updated_ready -= u32::from(x.slot.updated_ready);
            }
            self.counts_changed.insert(id.group().clone());
        }
        self.budget_held.remove(id);
        self.rollout_held.remove(id);
        self.dispatch_held.remove(id);
    }

    /// Whether the indexes match a scan of the nodes (for tests and debug
    /// builds).
    pub fn indexes_consistent(&self) -> bool {
        let grace = self.policy.result_grace;
        let dirty: BTreeSet<LogicalNodeId> = self
            .nodes
            .iter()
            .filter(|(_, e)| e.dirty)
            .map(|(id, _)| id.clone())
            .collect();
        let wakes: BTreeSet<(UnixMillis, LogicalNodeId)> = self
            .nodes
            .iter()
            .filter_map(|(id, e)| e.wake_at.map(|t| (t, id.clone())))
            .collect();
        let deadlines: BTreeSet<(UnixMillis, LogicalNodeId)> = self
            .nodes
            .iter()
            .filter_map(|(id, e)| {
                e.attempts()
                    .filter_map(|n| deadline_of(n, grace))
                    .min()
                    .map(|t| (t, id.clone()))
            })
            .collect();
        let mut held: HashMap<contract::GroupId, u64> = HashMap::new();
        for id in self.nodes.keys() {
            *held.entry(id.group().clone()).or_default() += 1;
        }
        let held_now: HashMap<contract::GroupId, u64> = self
            .held
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(g, n)| (g.clone(), *n))
            .collect();
        let mut counts: HashMap<contract::GroupId, GroupCounts> = HashMap::new();
        let mut tallies: HashMap<contract::GroupId, Tally> = HashMap::new();
        for (id, e) in &self.nodes {
            let c = counts.entry(id.group().clone()).or_default();
            c.unhealthy += u32::from(
                e.attempts()
                    .any(|n| n.stage != NodeStage::Destroyed && n.facts.is_impaired()),
            );
            c.remediating += u32::from(e.attempts().any(|n| n.retry.remediating));
            c.surging += u32::from(e.rec.successor.is_some());
            let slot = Slot::of(e.attempts(), &self.meta.shape, self.meta.deleting);
            c.available += u32::from(slot.available);
            c.updated += u32::from(slot.updated);
            let t = tallies.entry(id.group().clone()).or_default();
            t.held += u32::from(slot.desired);
            t.updated += u32::from(slot.updated);
            t.updated_ready += u32::from(slot.updated_ready);
        }
        let tallies_now: HashMap<contract::GroupId, Tally> = self
            .tallies
            .iter()
            .filter(|(_, t)| **t != Tally::default())
            .map(|(g, t)| (g.clone(), *t))
            .collect();
        tallies.retain(|_, t| *t != Tally::default());
        let nonzero =
            |m: &HashMap<contract::GroupId, GroupCounts>| -> HashMap<contract::GroupId, GroupCounts> {
                m.iter()
                    .filter(|(_, c)| **c != GroupCounts::default())
                    .map(|(g, c)| (g.clone(), *c))
                    .collect()
            };
        dirty == self.dirty_ids
            && wakes == self.wakes
            && deadlines == self.deadlines
            && held == held_now
            && nonzero(&counts) == nonzero(&self.counts)
            && tallies == tallies_now
    }

    /// What the executor is to probe: the run's groups that have a probe
    /// (none while the run is being deleted).
    pub fn watch_health(&self) -> contract::WatchHealth {
        let groups = if self.meta.deleting {
            Vec::new()
        } else {
            self.meta
                .shape
                .groups
                .iter()
                .filter(|g| g.policy.health.probe != contract::Probe::None)
                .map(|g| (g.id.clone(), g.policy.health))
                .collect()
        };
        contract::WatchHealth {
            run_uid: self.meta.uid,
            epoch: self.meta.epoch,
            groups,
        }
    }

    /// The nodes whose last decision was a wait for the remediation budget.
    pub fn remediation_held(&self) -> impl Iterator<Item = &LogicalNodeId> {
        self.budget_held.iter()
    }

    /// Each group's day-2 counts over the whole run, for the Decide header
    /// (groups with none are left out).
    pub fn group_counts(&self) -> Vec<(contract::GroupId, GroupCounts)> {
        let mut v: Vec<_> = self
            .counts
            .iter()
            .map(|(g, c)| {
                let mut c = *c;
                if let Some(r) = self.rollout(g) {
                    c.canary_done = r.canary_done();
                    c.halted = r.halted.is_some();
                }
                (g.clone(), c)
            })
            .filter(|(_, c)| *c != GroupCounts::default())
            .collect();
        v.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        v
    }

    // ----- reads ---------------------------------------------------------

    pub fn run_id(&self) -> &RunId {
        &self.meta.run_id
    }

    pub fn uid(&self) -> RunUid {
        self.meta.uid
    }

    pub fn epoch(&self) -> Epoch {
        self.meta.epoch
    }

    pub fn meta(&self) -> &RunMeta {
        &self.meta
    }

    pub fn shape(&self) -> &ClusterShape {
        &self.meta.shape
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn is_deleting(&self) -> bool {
        self.meta.deleting
    }

    pub fn is_paused(&self) -> bool {
        self.meta.paused
    }

    // ----- the event log ---------------------------------------------------

    /// Records an event of the run (SPEC.md section 8), written by the next
    /// commit with the change it describes. A repeat of the latest event
    /// (same reason, subject and message) raises its count instead; past the
    /// policy's limit the oldest event goes.
    pub fn record_event(&mut self, reason: EventReason, subject: Subject, message: String, now: UnixMillis) {
        if let Some(last) = self.events.back_mut()
            && last.repeats(reason, &subject, &message)
        {
            last.count = last.count.saturating_add(1);
            last.last_at = last.last_at.max(now);
            self.events_changed.insert(last.seq);
            return;
        }
        let seq = self.next_event_seq;
        self.next_event_seq = seq.saturating_add(1);
        self.events.push_back(Event {
            seq,
            reason,
            subject,
            message,
            generation: self.meta.shape.generation,
            first_at: now,
            last_at: now,
            count: 1,
        });
        self.events_changed.insert(seq);
        self.trim_events();
    }

    /// Drops the oldest events past the policy's limit; the next commit
    /// deletes them.
    fn trim_events(&mut self) {
        let limit = self.policy.event_limit.max(1);
        let mut trimmed = false;
        while self.events.len() > limit {
            if let Some(old) = self.events.pop_front() {
                self.events_changed.remove(&old.seq);
                trimmed = true;
            }
        }
        if trimmed {
            self.events_below = self.events.front().map(|e| e.seq);
        }
    }

    /// The events kept, oldest first.
    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.events.iter()
    }

    /// The kept event numbered `seq`.
    pub fn event(&self, seq: u64) -> Option<&Event> {
        self.events
            .binary_search_by_key(&seq, |e| e.seq)
            .ok()
            .and_then(|i| self.events.get(i))
    }

    /// The latest event's number and count (a repeat raises the count), or
    /// zeros: what a follower of the log compares to see something new.
    pub fn event_mark(&self) -> (u64, u32) {
        self.events.back().map_or((0, 0), |e| (e.seq, e.count))
    }

    /// The conditions as the shell last observed them: stored with the run
    /// when they differ from what is stored.
    pub fn set_conditions(&mut self, marks: Vec<ConditionMark>) {
        if self.meta.conditions != marks {
            self.meta.conditions = marks;
            self.meta_dirty = true;
        }
    }

    /// An operator abandons a node (its cleanup fails permanently): the node
    /// is removed from the run state and what it left behind is returned, to
    /// be listed as an orphan. Its pending operation, if any, is forgotten (a
    /// late result for it is discarded). A slot that is still desired is
    /// re-inserted by the next pass under a fresh attempt. `None` if the run
    /// holds no such node. The removal is written by the next commit.
    pub fn abandon(&mut self, id: &LogicalNodeId, now: UnixMillis) -> Option<AbandonedNode> {
        // A slot holding a successor: the current attempt is forgotten and
        // the successor takes the slot.
        if let Some(gone) = self.nodes.get_mut(id).and_then(|e| e.promote_successor()) {
            let gone = Arc::unwrap_or_clone(gone);
            self.changed.insert(id.clone());
            self.reindex(id);
            if gone.node.pending.is_some() {
                self.pending_ops = self.pending_ops.saturating_sub(1);
            }
            self.urgent = true;
            let n = gone.node;
            return Some(AbandonedNode {
                run_uid: self.meta.uid,
                run_id: self.meta.run_id.clone(),
                node: id.clone(),
                attempt: n.attempt,
                lease: n.facts.lease,
                endpoint: n.facts.endpoint,
                session: n.facts.session,
                pending: n.pending.map(|p| p.id),
                at: now,
            });
        }
        let e = self.remove_entry(id)?;
        let n = &e.rec.node;
        if n.pending.is_some() {
            self.pending_ops = self.pending_ops.saturating_sub(1);
        }
        if e.rec.successor.as_ref().is_some_and(|s| s.node.pending.is_some()) {
            self.pending_ops = self.pending_ops.saturating_sub(1);
        }
        self.changed.remove(id);
        self.removed.insert(id.clone());
        // The next pass looks at the whole run (the slot is missing now).
        self.full = true;
        self.urgent = true;
        Some(AbandonedNode {
            run_uid: self.meta.uid,
            run_id: self.meta.run_id.clone(),
            node: id.clone(),
            attempt: n.attempt,
            lease: n.facts.lease.clone(),
            endpoint: n.facts.endpoint.clone(),
            session: n.facts.session.clone(),
            pending: n.pending.map(|p| p.id),
            at: now,
        })
    }

    /// A run held only to destroy orphans of a run the driver no longer has:
    /// deleting from the start, with no shape (its nodes come from
    /// [`RunState::adopt_orphan`]), under `epoch` (above any the executor saw
    /// for `uid`).
    pub fn reclaim(run_id: RunId, uid: RunUid, epoch: Epoch, policy: Arc<Policy>, now: UnixMillis) -> Self {
        let meta = RunMeta {
            shape: ClusterShape {
                run_id: run_id.clone(),
                generation: Generation::new(1),
                labels: Default::default(),
                groups: Vec::new(),
            },
            run_id,
            uid,
            epoch,
            deleting: true,
            paused: false,
            observed_generation: Generation::new(1),
            next_attempt: 1,
            created_at: now,
            converged_at: None,
            reclaim: true,
            conditions: Vec::new(),
            rollouts: Vec::new(),
            stable: Vec::new(),
        };
        let mut run = Self::from_parts(meta, Vec::new(), Vec::new(), policy);
        run.meta_dirty = true;
        run
    }

    /// Whether this is a run held only to destroy orphans.
    pub fn is_reclaim(&self) -> bool {
        self.meta.reclaim
    }

    /// Adopts a resource of this run that no node holds as a node being
    /// deleted: the ladder cancels its session (by identity, the id being
    /// unknown), destroys its lease and reaps it, each operation recorded
    /// pending before it is dispatched, as for any node. Returns false (and
    /// changes nothing) if the run holds a node with that id (one attempt per
    /// slot, so an older attempt of a held slot waits until the slot is
    /// free), or if the resource has no lease id to destroy. Written by the
    /// next commit.
    pub fn adopt_orphan(&mut self, o: &OrphanResource) -> bool {
        if self.nodes.contains_key(&o.node) || self.in_pass || o.lease.is_none() {
            return false;
        }
        let spec = self
            .meta
            .shape
            .groups
            .iter()
            .find(|g| &g.id == o.node.group())
            .map(|g| g.template.clone())
            .unwrap_or_else(|| Arc::new(orphan_template()));
        let stage = if o.session_live {
            NodeStage::BootstrapRunning
        } else if o.endpoint.is_some() {
            NodeStage::EndpointKnown
        } else {
            NodeStage::LeaseCreated
        };
        let node = ManagedNode {
            id: o.node.clone(),
            attempt: o.attempt,
            spec,
            intent: Intent::Deleting,
            stage,
            facts: contract::NodeFacts {
                lease: o.lease.clone(),
                endpoint: o.endpoint.clone(),
                session: None,
                ambiguous_bootstrap: o.session_live,
                ..contract::NodeFacts::default()
            },
            pending: None,
            retry: RetryState::default(),
            surge: Surge::None,
            stage_deadline: None,
        };
        self.insert_entry(
            o.node.clone(),
            Box::new(Entry::new(NodeRecord {
                next_seq: ORPHAN_SEQ_BASE,
                ..NodeRecord::new(node)
            })),
        );
        if o.attempt.get() >= self.meta.next_attempt {
            self.meta.next_attempt = o.attempt.get().saturating_add(1);
        }
        self.meta.converged_at = None;
        self.meta_dirty = true;
        self.changed.insert(o.node.clone());
        self.removed.remove(&o.node);
        self.urgent = true;
        true
    }

    /// Deleted and every node reaped: the run can be forgotten.
    pub fn is_gone(&self) -> bool {
        self.meta.deleting && self.nodes.is_empty()
    }

    pub fn counters(&self) -> &RunCounters {
        &self.counters
    }

    pub fn nodes(&self) -> impl Iterator<Item = &ManagedNode> {
        self.nodes.values().map(|e| &e.rec.node)
    }

    pub fn node(&self, id: &LogicalNodeId) -> Option<&ManagedNode> {
        self.nodes.get(id).map(|e| &e.rec.node)
    }

    /// A slot's successor attempt, while it holds one (SPEC.md section 9).
    pub fn successor(&self, id: &LogicalNodeId) -> Option<&ManagedNode> {
        self.nodes.get(id)?.rec.successor.as_deref().map(|s| &s.node)
    }

    /// Every successor attempt the run's slots hold.
    pub fn successors(&self) -> impl Iterator<Item = &ManagedNode> {
        self.nodes
            .values()
            .filter_map(|e| e.rec.successor.as_deref().map(|s| &s.node))
    }

    /// The slots after `after` in node id order (every slot without it),
    /// each as its current attempt and its successor, if it holds one: a
    /// page of them costs its own length, not the run's.
    pub fn slots_after(
        &self,
        after: Option<&LogicalNodeId>,
    ) -> impl Iterator<Item = (&ManagedNode, Option<&ManagedNode>)> {
        let from = after.map_or(std::ops::Bound::Unbounded, std::ops::Bound::Excluded);
        self.nodes
            .range::<LogicalNodeId, _>((from, std::ops::Bound::Unbounded))
            .map(|(_, e)| (&e.rec.node, e.rec.successor.as_deref().map(|s| &s.node)))
    }

    /// A successor's last decision.
    pub fn successor_decision(&self, id: &LogicalNodeId) -> Option<&LastDecision> {
        self.nodes.get(id)?.succ_last.as_ref()
    }

    /// Runs `f` with `attempt` of slot `id` in the slot's current place: a
    /// successor's result, observation, change or decision is then folded by
    /// the same code as any attempt's, and put back after (the indexes are
    /// synced once it is).
    fn on_attempt<R>(&mut self, id: &LogicalNodeId, attempt: AttemptId, f: impl FnOnce(&mut Self) -> R) -> R {
        let swapped = match self.nodes.get_mut(id) {
            Some(e) if e.is_successor(attempt) => {
                e.swap_successor();
                true
            }
            _ => false,
        };
        let out = f(self);
        if swapped {
            if let Some(e) = self.nodes.get_mut(id) {
                e.swap_successor();
            }
            self.reindex(id);
        }
        out
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub fn last_decision(&self, id: &LogicalNodeId) -> Option<&LastDecision> {
        self.nodes.get(id).and_then(|e| e.last.as_ref())
    }

    /// The desired shape as the decider sees it, with the run's group counts.
    pub fn desired_view(&self) -> DesiredView<'_> {
        DesiredView::new(&self.meta.shape, self.meta.deleting).with_counts(self.group_counts())
    }

    /// Every slot the run holds (built again only after the run's nodes
    /// changed).
    pub fn slot_set(&self) -> &SlotSet {
        self.slots.get_or_init(|| {
            let mut s = SlotSet::new();
            for id in self.nodes.keys() {
                s.insert(id);
            }
            s.finish();
            s
        })
    }

    /// The operations recorded pending, exactly as first submitted, for a
    /// resubmission after the executor link reconnects or the driver restarts.
    pub fn inflight_operations(&self) -> Vec<Operation> {
        self.nodes
            .values()
            .flat_map(|e| std::iter::once(&*e.rec).chain(e.rec.successor.as_deref()))
            .filter_map(|r| r.inflight.as_deref().cloned())
            .collect()
    }

    /// Operations recorded pending (O(1), kept as they change).
    pub fn pending_operations(&self) -> usize {
        self.pending_ops
    }

    /// How many operations the next pass may dispatch (`None`: as many as
    /// it decides). The shell sets it from the driver's admission limit
    /// before it asks [`RunState::needs_pass`] and begins a pass; a pass
    /// spends it. A dispatch past it is not recorded: the node is held and
    /// decided again by a pass with room.
    pub fn set_dispatch_room(&mut self, room: Option<usize>) {
        self.dispatch_room = room;
    }

    /// How many nodes wait for dispatch room.
    pub fn dispatch_held_count(&self) -> usize {
        self.dispatch_held.len()
    }

    pub fn is_dispatch_held(&self, id: &LogicalNodeId) -> bool {
        self.dispatch_held.contains(id)
    }

    /// About how many operations the next pass could dispatch: the nodes it
    /// would decide (a node may dispatch for its successor as well, so this
    /// is not a bound). The shell asks its admission for this much room.
    pub fn dispatch_demand(&self, now: UnixMillis) -> usize {
        if self.full {
            return self.nodes.len();
        }
        let due = self.wakes.iter().take_while(|(t, _)| *t <= now).count();
        let budgets = if self.counts_changed.is_empty() {
            0
        } else {
            self.budget_held.len() + self.rollout_held.len()
        };
        self.dirty_ids.len() + due + budgets + self.dispatch_held.len()
    }

    pub fn pending_count(&self) -> usize {
        self.nodes
            .values()
            .flat_map(|e| e.attempts())
            .filter(|n| n.pending.is_some())
            .count()
    }

    /// Converged for the current generation: every desired slot holds the exact
    /// desired spec, ready, active, with nothing pending, and nothing else remains.
    pub fn is_converged(&self) -> bool {
        // What the kept counts settle first: a run with work outstanding,
        // or with other than one node per desired slot, has not converged.
        if self.meta.deleting
            || self.pending_ops > 0
            || !self.dispatch_held.is_empty()
            || self.nodes.len() as u64 != self.meta.shape.total_nodes()
        {
            return false;
        }
        let desired = DesiredView::new(&self.meta.shape, self.meta.deleting);
        let mut count = 0u64;
        // Highest first: the admission limit sends the lowest slots first,
        // so a node not yet ready is found at once.
        for e in self.nodes.values().rev() {
            let n = &e.rec.node;
            let Some(t) = desired.template_for(&n.id) else {
                return false;
            };
            // A slot still holding two attempts is mid-rollout.
            if e.rec.successor.is_some() {
                return false;
            }
            // Converged means observed: a lost or unhealthy node is not ready.
            if !(NodeTemplate::same(t, &n.spec)
                && n.is_ready()
                && n.intent == Intent::Active
                && n.pending.is_none()
                && !n.facts.is_impaired())
            {
                return false;
            }
            count += 1;
        }
        count == self.meta.shape.total_nodes()
    }

    /// Moves every deadline and wake-up the run keeps on the wall clock by
    /// `by_ms` (later when positive), after the shell saw the wall clock
    /// step by that much against the monotonic one: operation deadlines, stage
    /// deadlines, backoff and restart times, decision wake-ups, and the
    /// deadline an in-flight operation is resent with. A step then neither
    /// makes every deadline pass at once (forward) nor holds one for the
    /// step's length (back). The moved records go with the next commit.
    /// Returns how many slots it moved.
    pub fn shift_deadlines(&mut self, by_ms: i64) -> usize {
        if by_ms == 0 {
            return 0;
        }
        let shift = |t: UnixMillis| t.shifted(by_ms);
        fn shift_record(rec: &mut NodeRecord, shift: &impl Fn(UnixMillis) -> UnixMillis) {
            let n = &mut rec.node;
            if let Some(p) = &mut n.pending {
                p.deadline = shift(p.deadline);
                p.dispatched_at = shift(p.dispatched_at);
            }
            n.stage_deadline = n.stage_deadline.map(shift);
            n.retry.next_effect_at = n.retry.next_effect_at.map(shift);
            n.retry.restart_at = n.retry.restart_at.map(shift);
            if let Some(op) = &mut rec.inflight {
                op.deadline = shift(op.deadline);
            }
            if let Some(s) = &mut rec.successor {
                shift_record(s, shift);
            }
        }
        let ids: Vec<LogicalNodeId> = self.nodes.keys().cloned().collect();
        for id in &ids {
            if let Some(e) = self.nodes.get_mut(id) {
                shift_record(e.rec_mut(), &shift);
                e.wake_at = e.wake_at.map(shift);
                e.version += 1;
                self.changed.insert(id.clone());
                self.reindex(id);
            }
        }
        ids.len()
    }

    /// When the run next needs attention on its own: a decision's wake time, an
    /// operation's deadline plus grace, or a stage deadline.
    pub fn poll_timeout(&self) -> Option<UnixMillis> {
        let batch = self.batch_end();
        [
            self.wakes.first().map(|(t, _)| *t),
            self.deadlines.first().map(|(t, _)| *t),
            batch,
            self.rollout_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    // ----- rollouts ------------------------------------------------------

    /// A group's rollout in progress, if any.
    pub fn rollout(&self, group: &contract::GroupId) -> Option<&GroupRollout> {
        self.meta.rollouts.iter().find(|r| &r.group == group)
    }

    /// A group's rollout tally (its desired slots held, updated, updated and
    /// ready).
    pub fn tally(&self, group: &contract::GroupId) -> Tally {
        self.tallies.get(group).copied().unwrap_or_default()
    }

    /// The earliest progress deadline of a rollout still going.
    fn rollout_deadline(&self) -> Option<UnixMillis> {
        self.meta
            .rollouts
            .iter()
            .filter_map(|r| r.deadline(self.meta.shape.group(&r.group)?))
            .min()
    }

    /// Looks at every group's rollout: starts one for a group that holds
    /// drifted nodes, ends one whose group is all on its template (which
    /// becomes the group's stable template), and steps the rest (progress,
    /// canary, halt). A halt with `auto_revert` reverts the group.
    fn track_rollouts(&mut self, now: UnixMillis) {
        if self.meta.deleting {
            if !self.meta.rollouts.is_empty() {
                self.meta.rollouts.clear();
                self.meta_dirty = true;
            }
            return;
        }
        let mut reverts = Vec::new();
        let groups: Vec<contract::NodeGroup> = self.meta.shape.groups.clone();
        for g in &groups {
            let t = self.tally(&g.id);
            let failures = self.new_failures.remove(&g.id).unwrap_or(0);
            let pos = self.meta.rollouts.iter().position(|r| r.group == g.id);
            if t.updated_ready == g.count && t.held == g.count {
                self.group_settled(g, pos, now);
                continue;
            }
            let Some(pos) = pos else {
                if t.drifted() > 0 {
                    self.start_rollout(g, t, now);
                }
                continue;
            };
            let r = &mut self.meta.rollouts[pos];
            let before = r.clone();
            let step = rollout::step(r, g, t, failures, now);
            if *r != before {
                self.meta_dirty = true;
            }
            let subject = Subject::Group(g.id.clone());
            match step {
                rollout::Step::Nothing | rollout::Step::Progressed => {}
                rollout::Step::CanaryReached => {
                    let message = format!(
                        "canary of {} on the new template: the rollout waits for `provisionctl rollout promote {} {}`",
                        g.policy.rollout.canary, self.meta.run_id, g.id
                    );
                    self.record_event(EventReason::RolloutPaused, subject, message, now);
                }
                rollout::Step::Halted(reason) => {
                    self.counts_changed.insert(g.id.clone());
                    let revert = g.policy.rollout.auto_revert
                        && self.meta.rollouts[pos].reverted_from.is_none()
                        && self
                            .stable_group(&g.id)
                            .is_some_and(|s| !NodeTemplate::same(&s.group.template, &g.template));
                    let message = format!(
                        "{reason}; {} of {} nodes still on the old template keep serving{}",
                        t.drifted(),
                        g.count,
                        if revert { "; reverting" } else { "" }
                    );
                    self.record_event(EventReason::RolloutHalted, subject, message, now);
                    if revert {
                        reverts.push(g.id.clone());
                    }
                }
            }
        }
        for group in reverts {
            self.revert(&group, now);
        }
    }

    fn start_rollout(&mut self, g: &contract::NodeGroup, t: Tally, now: UnixMillis) {
        let r = GroupRollout::new(g.id.clone(), self.meta.shape.generation, now, t.updated_ready);
        let budget = decider::rollout_unavailable_budget(g);
        let message = format!(
            "generation {}: {} of {} nodes to replace, at most {} unavailable at once{}",
            self.meta.shape.generation,
            t.drifted(),
            g.count,
            budget,
            match g.policy.rollout.canary {
                0 => String::new(),
                n => format!(", pausing after a canary of {n}"),
            }
        );
        self.meta.rollouts.push(r);
        self.meta_dirty = true;
        self.counts_changed.insert(g.id.clone());
        self.record_event(
            EventReason::RolloutStarted,
            Subject::Group(g.id.clone()),
            message,
            now,
        );
    }

    /// Every desired slot of `g` is ready on its template: the group is
    /// stable there, and a rollout to it is complete.
    fn group_settled(&mut self, g: &contract::NodeGroup, pos: Option<usize>, now: UnixMillis) {
        let generation = self.meta.shape.generation;
        match self.meta.stable.iter_mut().find(|s| s.group.id == g.id) {
            Some(s) if s.group == *g => {}
            Some(s) => {
                *s = StableGroup {
                    group: g.clone(),
                    generation,
                };
                self.meta_dirty = true;
            }
            None => {
                self.meta.stable.push(StableGroup {
                    group: g.clone(),
                    generation,
                });
                self.meta_dirty = true;
            }
        }
        if let Some(pos) = pos {
            let r = self.meta.rollouts.remove(pos);
            self.meta_dirty = true;
            self.counts_changed.insert(g.id.clone());
            let message = match r.reverted_from {
                Some(from) => format!(
                    "reverted from generation {from}: all {} nodes ready on the template of generation {}",
                    g.count, r.generation
                ),
                None => format!(
                    "all {} nodes ready on the template of generation {} (started {} ago)",
                    g.count,
                    r.generation,
                    human(now.saturating_since(r.started_at))
                ),
            };
            self.record_event(
                EventReason::RolloutCompleted,
                Subject::Group(g.id.clone()),
                message,
                now,
            );
        }
    }

    fn stable_group(&self, group: &contract::GroupId) -> Option<&StableGroup> {
        self.meta.stable.iter().find(|s| &s.group.id == group)
    }

    /// Applies the group's stable template as a new generation, recorded as a
    /// revert: its rollout skips the canary and is never reverted itself.
    fn revert(&mut self, group: &contract::GroupId, now: UnixMillis) {
        let Some(stable) = self.stable_group(group).cloned() else {
            return;
        };
        let from = self.meta.shape.generation;
        let generation = Generation::new(from.get().saturating_add(1));
        let mut shape = self.meta.shape.clone();
        shape.generation = generation;
        let Some(g) = shape.groups.iter_mut().find(|g| &g.id == group) else {
            return;
        };
        g.template = stable.group.template.clone();
        let count = g.count;
        // Nodes already on the stable template share its Arc again.
        for e in self.nodes.values_mut() {
            if e.rec.node.id.group() == group
                && !Arc::ptr_eq(&e.rec.node.spec, &stable.group.template)
                && *e.rec.node.spec == *stable.group.template
            {
                e.rec_mut().node.spec = stable.group.template.clone();
            }
        }
        self.meta.shape = shape;
        self.meta.rollouts.retain(|r| &r.group != group);
        let ready = self.tallies.get(group).map_or(0, |t| t.updated_ready);
        self.meta.rollouts.push(GroupRollout {
            reverted_from: Some(from),
            ..GroupRollout::new(group.clone(), generation, now, ready)
        });
        self.meta.converged_at = None;
        self.meta_dirty = true;
        self.full = true;
        self.reindex_all();
        let ready = self.tally(group).updated_ready;
        if let Some(r) = self.meta.rollouts.last_mut() {
            r.ready = ready;
        }
        let message = format!(
            "generation {generation} reverts generation {from}: back to the template of generation {} ({ready} of {count} nodes on it)",
            stable.generation
        );
        self.record_event(
            EventReason::RolloutReverted,
            Subject::Group(group.clone()),
            message,
            now,
        );
    }

    /// Promotes a group's canary: its rollout goes on past it. `Ok(false)`
    /// when it was promoted already (or has no canary).
    pub fn promote(&mut self, group: &contract::GroupId, now: UnixMillis) -> Result<bool, PromoteError> {
        let g = self
            .meta
            .shape
            .group(group)
            .ok_or_else(|| PromoteError::NoSuchGroup(group.clone()))?;
        let canary = g.policy.rollout.canary;
        let Some(r) = self.meta.rollouts.iter_mut().find(|r| &r.group == group) else {
            return Err(PromoteError::NoRollout(group.clone()));
        };
        if r.canary_done() || canary == 0 {
            return Ok(false);
        }
        r.promoted = true;
        // The canary's pause is over: the deadline counts from now.
        r.progress_at = now;
        self.meta_dirty = true;
        self.counts_changed.insert(group.clone());
        self.record_event(
            EventReason::RolloutPromoted,
            Subject::Group(group.clone()),
            format!("canary of {canary} promoted: the rollout goes on"),
            now,
        );
        Ok(true)
    }

    // ----- desired state -------------------------------------------------

    /// Applies a shape update under the revision contract. On error nothing
    /// changes.
    pub fn apply_shape(&mut self, shape: ClusterShape) -> Result<Applied, ApplyError> {
        if shape.run_id != self.meta.run_id {
            return Err(ApplyError::RunIdChanged {
                current: self.meta.run_id.clone(),
                given: shape.run_id,
            });
        }
        if self.meta.deleting {
            return Err(ApplyError::Deleting(self.meta.run_id.clone()));
        }
        shape.validate(&self.policy.limits)?;
        let current = self.meta.shape.generation;
        if shape.generation < current {
            return Err(ApplyError::GenerationRegressed {
                current,
                given: shape.generation,
            });
        }
        if shape.generation == current {
            return if shape.same_content(&self.meta.shape) {
                Ok(Applied::Unchanged)
            } else {
                Err(ApplyError::SameGenerationOtherContent(current))
            };
        }
        // A group the run already has keeps its id's allocation, which the
        // nodes' ids share (see `intern`).
        let mut shape = shape;
        for g in &mut shape.groups {
            if let Some(old) = self.meta.shape.groups.iter().find(|o| o.id == g.id) {
                g.id = old.id.clone();
            }
        }
        // Nodes whose spec equals their group's new template share its Arc, so
        // the common drift check is a pointer compare and memory is shared.
        for g in &shape.groups {
            for e in self.nodes.values_mut() {
                if e.rec.node.id.group() == &g.id
                    && !Arc::ptr_eq(&e.rec.node.spec, &g.template)
                    && *e.rec.node.spec == *g.template
                {
                    e.rec_mut().node.spec = g.template.clone();
                }
            }
        }
        // A group whose template changed starts a new rollout; a newer apply
        // of the same template ends its rollout's halt (the rollout starts
        // over at the next pass, its deadline counted from then).
        let old = std::mem::replace(&mut self.meta.shape, shape);
        self.meta.rollouts.retain(|r| {
            let before = old.group(&r.group).map(|g| &g.template);
            let after = self.meta.shape.group(&r.group).map(|g| &g.template);
            match (before, after) {
                (Some(b), Some(a)) => NodeTemplate::same(b, a) && r.halted.is_none(),
                _ => false,
            }
        });
        self.meta.converged_at = None;
        self.meta_dirty = true;
        self.full = true;
        self.reindex_all();
        Ok(Applied::Changed)
    }

    /// Reindexes every node: what a node is to its group's rollout depends on
    /// the shape.
    fn reindex_all(&mut self) {
        let ids: Vec<LogicalNodeId> = self.nodes.keys().cloned().collect();
        for id in &ids {
            self.reindex(id);
        }
    }

    /// What a client's request (a shape, a deletion, a pause) may change, to
    /// put back if the commit that would make it durable fails: the client
    /// is told the request failed, and no read may show it as made.
    pub fn request_undo(&self) -> RequestUndo {
        RequestUndo {
            meta: self.meta.clone(),
            meta_dirty: self.meta_dirty,
            full: self.full,
            events: self.events.clone(),
            next_event_seq: self.next_event_seq,
            events_changed: self.events_changed.clone(),
            events_below: self.events_below,
        }
    }

    /// Puts back what [`RunState::request_undo`] saved (the shape, the
    /// run's flags, the event log).
    pub fn undo_request(&mut self, u: RequestUndo) {
        self.meta = u.meta;
        self.meta_dirty = u.meta_dirty;
        self.full = u.full;
        self.events = u.events;
        self.next_event_seq = u.next_event_seq;
        self.events_changed = u.events_changed;
        self.events_below = u.events_below;
        self.reindex_all();
    }

    /// Marks the run deleting: its desired shape becomes empty.
    pub fn delete(&mut self) -> bool {
        if self.meta.deleting {
            return false;
        }
        self.meta.deleting = true;
        self.meta.converged_at = None;
        self.meta_dirty = true;
        self.full = true;
        // A deleting run wants no slot.
        self.reindex_all();
        true
    }

    pub fn set_paused(&mut self, paused: bool) -> bool {
        if self.meta.paused == paused {
            return false;
        }
        self.meta.paused = paused;
        self.meta_dirty = true;
        self.full = true;
        true
    }

    /// Asks for a pass over every node (the safety tick).
    pub fn mark_all_dirty(&mut self) {
        self.full = true;
    }

    /// Sets the trace context that operations dispatched by the next pass carry.
    pub fn set_pass_trace(&mut self, trace: TraceContext) {
        self.pass_trace = trace;
    }

    // ----- passes --------------------------------------------------------

    /// Whether a pass would have anything to decide at `now`.
    pub fn needs_pass(&self, now: UnixMillis) -> bool {
        if self.full || self.urgent {
            return true;
        }
        // A due wake-up never waits for the batch window: its deadline is
        // what `poll_timeout` reported, and waiting would spin the timer.
        if self.wakes.first().is_some_and(|(t, _)| *t <= now) {
            return true;
        }
        if self.rollout_deadline().is_some_and(|t| t <= now) {
            return true;
        }
        // Nodes the admission limit held wait for room, not for a batch.
        if !self.dispatch_held.is_empty() && self.dispatch_room.is_none_or(|r| r > 0) {
            return true;
        }
        self.pass_wanted() && self.batch_end().is_none_or(|end| end <= now)
    }

    /// Whether a pass is wanted and waits only for the batch window (see
    /// [`RunState::needs_pass`]), so that what changed since the last commit
    /// can be written with that pass's decisions.
    pub fn pass_batching(&self, now: UnixMillis) -> bool {
        self.pass_wanted() && self.batch_end().is_some_and(|end| end > now)
    }

    /// A node changed or a desired slot has none: a pass has work.
    fn pass_wanted(&self) -> bool {
        !self.dirty_ids.is_empty() || self.missing_slots()
    }

    /// While operations are in flight, folds wait for more results until this:
    /// one `pass_batch` after the first fold since the last pass; and while
    /// results keep streaming in (each within `pass_batch` of the last) and
    /// fewer have been folded than are still pending, until they pause, up
    /// to [`BATCH_STRETCH`] windows. A burst of thousands of results is then
    /// decided in a few passes rather than one per window; a trickle (or a
    /// slow provider) is decided one window after each result, as before.
    fn batch_end(&self) -> Option<UnixMillis> {
        let batch = self.policy.pass_batch;
        if batch.is_zero() || self.pending_ops == 0 {
            return None;
        }
        // A window that does not fit the clock is no window at all.
        let from = self.batch_from?;
        let first = from.checked_add(batch).ok()?;
        if self.folds_since_pass >= self.pending_ops {
            return Some(first);
        }
        let quiet = self.last_fold.unwrap_or(from).checked_add(batch).unwrap_or(first);
        let cap = from.checked_add(batch * BATCH_STRETCH).unwrap_or(first);
        Some(first.max(quiet.min(cap)))
    }

    fn note_fold(&mut self, now: UnixMillis) {
        if self.batch_from.is_none() {
            self.batch_from = Some(now);
        }
        self.folds_since_pass += 1;
        self.last_fold = Some(now);
    }

    fn missing_slots(&self) -> bool {
        if self.meta.deleting {
            return false;
        }
        self.meta
            .shape
            .groups
            .iter()
            .any(|g| self.held.get(&g.id).copied().unwrap_or(0) < u64::from(g.count))
    }

    /// Starts a pass: folds expired deadlines, then names the nodes to decide.
    pub fn begin_pass(&mut self, now: UnixMillis) -> Result<PassPlan, CoreError> {
        if self.in_pass {
            return Err(CoreError::PassInProgress);
        }
        debug_assert!(self.indexes_consistent(), "run indexes out of step before a pass");
        self.handle_timeout(now)?;
        let full = self.full;
        let nodes = if full {
            self.nodes.iter().map(|(id, e)| (id.clone(), e.version)).collect()
        } else {
            let mut ids: BTreeSet<&LogicalNodeId> = self.dirty_ids.iter().collect();
            ids.extend(self.wakes.iter().take_while(|(t, _)| *t <= now).map(|(_, id)| id));
            // A node the remediation budget held is decided again when its
            // group's counts change (a remediation ended, a node healed).
            ids.extend(
                self.budget_held
                    .iter()
                    .filter(|id| self.counts_changed.contains(id.group())),
            );
            // A node a rollout holds, likewise; but no pass can grant more
            // of a group than its budgets together, and the decider grants
            // the lowest indices first: only that many, lowest first, are
            // decided again (the rest keep their wait until they are among
            // them), so a rollout's pass costs its budget, not its group.
            for g in &self.meta.shape.groups {
                if !self.counts_changed.contains(&g.id) {
                    continue;
                }
                let b = g.policy.rollout.resolve(g.count);
                let room = (b.max_unavailable + b.max_surge).max(1) as usize;
                ids.extend(
                    self.rollout_held
                        .range(LogicalNodeId::new(g.id.clone(), 0)..)
                        .take_while(|id| id.group() == &g.id)
                        .take(room),
                );
            }
            // Nodes the admission limit held: as many as there is room for,
            // lowest first, so that a pass costs its room, not the backlog.
            let room = self.dispatch_room.unwrap_or(usize::MAX);
            ids.extend(self.dispatch_held.iter().take(room));
            ids.into_iter()
                .filter_map(|id| self.nodes.get(id).map(|e| (id.clone(), e.version)))
                .collect()
        };
        self.full = false;
        self.urgent = false;
        self.counts_changed.clear();
        self.batch_from = None;
        self.folds_since_pass = 0;
        self.last_fold = None;
        self.in_pass = true;
        Ok(PassPlan {
            now,
            generation: self.meta.shape.generation,
            deleting: self.meta.deleting,
            nodes,
            full,
        })
    }

    /// The nodes a plan names, as they are now (for building the request).
    pub fn plan_nodes<'a>(&'a self, plan: &'a PassPlan) -> impl Iterator<Item = &'a ManagedNode> + 'a {
        plan.nodes
            .iter()
            .filter_map(|(id, _)| self.nodes.get(id))
            .flat_map(|e| e.attempts())
    }

    /// Abandons a pass whose decision never came (decider unreachable): nothing
    /// changes, and the nodes it named are decided by the next pass.
    pub fn abort_pass(&mut self, plan: PassPlan) {
        self.in_pass = false;
        if plan.full {
            self.full = true;
        }
    }

    /// Applies the decider's answer for `plan` and records every operation
    /// pending. The operations are in the returned commit, released once its
    /// delta is durable.
    pub fn apply_decisions(
        &mut self,
        plan: PassPlan,
        mut output: DecideOutput,
        now: UnixMillis,
    ) -> Result<PassOutcome, CoreError> {
        if !self.in_pass {
            return Err(CoreError::NoPass);
        }
        for d in &mut output.decisions {
            self.intern(&mut d.node);
        }
        self.in_pass = false;
        self.counters.passes += 1;
        let mut out = PassOutcome {
            commit: Commit::new(RunDelta::new(self.meta.uid), Vec::new(), Vec::new()),
            operations: 0,
            transitions: 0,
            stale: 0,
            stale_at: Vec::new(),
            actions_by_rule: [0; contract::Rule::SLOTS],
            follow_up: false,
            converged: false,
        };
        // A shape change while the decider ran invalidates the whole answer.
        if plan.generation != self.meta.shape.generation || plan.deleting != self.meta.deleting {
            self.full = true;
            out.follow_up = true;
            out.stale = u32::try_from(output.decisions.len()).unwrap_or(u32::MAX);
            out.commit = self.take_commit();
            return Ok(out);
        }
        let versions: BTreeMap<&LogicalNodeId, u64> = plan.nodes.iter().map(|(id, v)| (id, *v)).collect();
        for (id, _) in &plan.nodes {
            if let Some(e) = self.nodes.get_mut(id)
                && versions.get(id) == Some(&e.version)
            {
                e.dirty = false;
                e.wake_at = None;
                // Decided again now: held again only if its dispatch is
                // refused again.
                self.dispatch_held.remove(id);
                self.reindex(id);
            }
        }
        // A slot's current attempt and its successor are decided from one
        // snapshot, and whichever decision changes the slot first leaves the
        // other stale: the successor's go first, whatever order the decider
        // answered in, so the outcome does not depend on it.
        let mut decisions = output.decisions;
        // Each decision's place in the answer, where the order changed.
        let mut answered_at: Option<Vec<u32>> = None;
        if self.counts.values().any(|c| c.surging > 0) {
            let mut keyed: Vec<(bool, u32, Decision)> = decisions
                .into_iter()
                .enumerate()
                .map(|(i, d)| {
                    let successor = d
                        .attempt
                        .is_some_and(|a| self.nodes.get(&d.node).is_some_and(|e| e.is_successor(a)));
                    (!successor, u32::try_from(i).unwrap_or(u32::MAX), d)
                })
                .collect();
            keyed.sort_by_key(|(current, _, _)| *current);
            let (at, sorted): (Vec<u32>, Vec<Decision>) = keyed.into_iter().map(|(_, i, d)| (i, d)).unzip();
            answered_at = Some(at);
            decisions = sorted;
        }
        let mut ops = Vec::new();
        // Groups whose remediation the budget held before this pass, and
        // why it holds them now (an event when a group starts being held).
        let held_before: BTreeSet<contract::GroupId> =
            self.budget_held.iter().map(|n| n.group().clone()).collect();
        let mut held_now: BTreeMap<contract::GroupId, String> = BTreeMap::new();
        for (pos, d) in decisions.into_iter().enumerate() {
            let fresh = match d.action {
                Action::Insert => !self.nodes.contains_key(&d.node),
                _ => match (self.nodes.get(&d.node), versions.get(&d.node)) {
                    (Some(e), Some(v)) => {
                        *v == e.version
                            && d.attempt
                                .is_some_and(|a| a == e.rec.node.attempt || e.is_successor(a))
                    }
                    _ => false,
                },
            };
            if !fresh {
                out.stale += 1;
                out.stale_at.push(
                    answered_at
                        .as_ref()
                        .and_then(|at| at.get(pos).copied())
                        .unwrap_or_else(|| u32::try_from(pos).unwrap_or(u32::MAX)),
                );
                out.follow_up = true;
                self.urgent = true;
                if let Some(e) = self.nodes.get_mut(&d.node) {
                    e.dirty = true;
                    self.reindex(&d.node);
                }
                continue;
            }
            if !matches!(d.action, Action::Wait { .. }) {
                out.actions_by_rule[d.rule as usize] += 1;
            }
            if d.action.is_transition() {
                out.transitions += 1;
            }
            if d.rule == Rule::RemediationBudget && !held_before.contains(d.node.group()) {
                held_now
                    .entry(d.node.group().clone())
                    .or_insert_with(|| d.reason.to_string());
            }
            let successor = d
                .attempt
                .is_some_and(|a| self.nodes.get(&d.node).is_some_and(|e| e.is_successor(a)));
            if successor {
                self.apply_to_successor(d, now, &mut ops)?;
                continue;
            }
            if self.meta.paused && !matches!(d.action, Action::Wait { .. }) {
                // Paused: nothing new happens; the decision is kept for explain.
                self.record_decision(&d, now, None);
                continue;
            }
            self.apply_one(d, now, &mut ops)?;
        }
        if out.transitions > 0 && !self.meta.paused {
            out.follow_up = true;
            self.urgent = true;
        }
        for (group, reason) in held_now {
            self.record_event(EventReason::RemediationHeld, Subject::Group(group), reason, now);
        }
        self.track_rollouts(now);
        if self.meta.observed_generation != self.meta.shape.generation {
            self.meta.observed_generation = self.meta.shape.generation;
            self.meta_dirty = true;
        }
        out.converged = self.is_converged();
        if out.converged && self.meta.converged_at.is_none() {
            self.meta.converged_at = Some(now);
            self.meta_dirty = true;
        }
        self.counters.operations += ops.len() as u64;
        out.operations = u32::try_from(ops.len()).unwrap_or(u32::MAX);
        out.commit = self.commit_with(ops);
        debug_assert!(self.indexes_consistent(), "run indexes out of step after a pass");
        Ok(out)
    }

    /// A decision for a slot's successor attempt: a wait is kept beside the
    /// current attempt's (the slot wakes at the earlier), a reap drops the
    /// successor, and the rest is applied as to any attempt.
    fn apply_to_successor(
        &mut self,
        d: Decision,
        now: UnixMillis,
        ops: &mut Vec<Operation>,
    ) -> Result<(), CoreError> {
        let paused = self.meta.paused;
        let id = d.node.clone();
        let Some(e) = self.nodes.get_mut(&id) else {
            return Ok(());
        };
        match d.action {
            Action::Wait { until } => {
                let wake = until.filter(|t| *t > now);
                e.wake_at = match (e.wake_at, wake) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                e.succ_last = Some(LastDecision { decision: d, at: now });
            }
            _ if paused => e.succ_last = Some(LastDecision { decision: d, at: now }),
            Action::Reap => {
                e.rec_mut().successor = None;
                e.succ_last = None;
                e.version += 1;
                e.dirty = true;
                e.wake_at = None;
                self.changed.insert(id.clone());
            }
            _ => {
                let attempt = d.attempt.unwrap_or(AttemptId::new(0));
                return self.on_attempt(&id, attempt, |run| run.apply_one(d, now, ops));
            }
        }
        self.reindex(&id);
        Ok(())
    }

    fn record_decision(&mut self, d: &Decision, now: UnixMillis, wake: Option<UnixMillis>) {
        match d.rule {
            Rule::RemediationBudget => {
                self.budget_held.insert(d.node.clone());
                self.rollout_held.remove(&d.node);
            }
            // A current attempt waiting for its successor is decided again
            // when the successor changes (the same entry): not the budget's.
            Rule::RolloutBudget if self.nodes.get(&d.node).is_some_and(|e| e.rec.successor.is_some()) => {
                self.budget_held.remove(&d.node);
                self.rollout_held.remove(&d.node);
            }
            Rule::RolloutBudget => {
                self.rollout_held.insert(d.node.clone());
                self.budget_held.remove(&d.node);
            }
            _ => {
                self.budget_held.remove(&d.node);
                self.rollout_held.remove(&d.node);
            }
        }
        if let Some(e) = self.nodes.get_mut(&d.node) {
            // The slot wakes for the earlier of its attempts' waits (a
            // successor's was recorded first in this pass).
            e.wake_at = match (e.wake_at, wake) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            e.last = Some(LastDecision {
                decision: d.clone(),
                at: now,
            });
            self.reindex(&d.node);
        }
    }

    fn apply_one(&mut self, d: Decision, now: UnixMillis, ops: &mut Vec<Operation>) -> Result<(), CoreError> {
        // A node that acts waits for no budget (a wait records its own).
        if !matches!(d.action, Action::Wait { .. }) {
            self.budget_held.remove(&d.node);
            self.rollout_held.remove(&d.node);
        }
        match d.action {
            Action::Wait { until } => {
                let wake = until.filter(|t| *t > now);
                self.record_decision(&d, now, wake);
            }
            Action::Insert => {
                let Some(template) = self.meta.shape.desired_group(&d.node).map(|g| g.template.clone())
                else {
                    return Ok(());
                };
                let attempt = self.allocate_attempt()?;
                let node = ManagedNode::new(d.node.clone(), attempt, template, RetryState::default());
                let mut e = Box::new(Entry::new(NodeRecord::new(node)));
                e.last = Some(LastDecision {
                    decision: d.clone(),
                    at: now,
                });
                self.removed.remove(&d.node);
                self.changed.insert(d.node.clone());
                self.insert_entry(d.node, e);
            }
            Action::Reap => {
                // A current attempt cleaned up leaves the slot to its
                // successor.
                if self
                    .nodes
                    .get_mut(&d.node)
                    .and_then(|e| e.promote_successor())
                    .is_some()
                {
                    self.changed.insert(d.node.clone());
                    self.reindex(&d.node);
                    return Ok(());
                }
                self.remove_entry(&d.node);
                self.changed.remove(&d.node);
                self.removed.insert(d.node);
            }
            Action::Surge => {
                let Some(template) = self.meta.shape.desired_group(&d.node).map(|g| g.template.clone())
                else {
                    return Ok(());
                };
                // One successor per slot, ever at once.
                if self.nodes.get(&d.node).is_none_or(|e| e.rec.successor.is_some()) {
                    return Ok(());
                }
                let attempt = self.allocate_attempt()?;
                let node = ManagedNode::new(d.node.clone(), attempt, template, RetryState::default());
                self.change(&d.node, now, &d, |rec| {
                    rec.successor = Some(Box::new(NodeRecord::new(node)));
                });
            }
            Action::Restart => {
                let Some(template) = self.meta.shape.desired_group(&d.node).map(|g| g.template.clone())
                else {
                    return Ok(());
                };
                let attempt = self.allocate_attempt()?;
                self.change(&d.node, now, &d, |rec| {
                    let carried = RetryState {
                        consecutive_failures: rec.node.retry.consecutive_failures,
                        remediating: rec.node.retry.remediating,
                        ..RetryState::default()
                    };
                    rec.node = ManagedNode::new(rec.node.id.clone(), attempt, template, carried);
                    rec.next_seq = 1;
                    rec.inflight = None;
                });
            }
            Action::BeginDelete => {
                // A replacement for health: the slot counts as remediating
                // until it is ready again, and its restart backs off with the
                // failure counted, as any failed attempt's does.
                let remediation = self.nodes.get(&d.node).and_then(|e| {
                    let n = &e.rec.node;
                    // The health check first: most deletions are not for health,
                    // and they need no view of the shape.
                    let due = n.facts.health.as_ref().is_some_and(|h| h.due(now))
                        && decider::due_for_remediation(
                            &DesiredView::new(&self.meta.shape, self.meta.deleting),
                            n,
                            now,
                        );
                    due.then(|| (n.attempt, n.retry.consecutive_failures.saturating_add(1)))
                });
                let restart_at = match remediation {
                    Some((attempt, failures)) => Some((failures, self.backoff_at(attempt, failures, now)?)),
                    None => None,
                };
                if restart_at.is_some() {
                    self.counters.remediated += 1;
                    if let Some((attempt, since)) = self.nodes.get(&d.node).map(|e| {
                        let n = &e.rec.node;
                        (n.attempt, n.facts.health.as_ref().map(|h| h.since))
                    }) {
                        let message = match since {
                            Some(since) => format!(
                                "unhealthy for {}: replaced on a fresh attempt",
                                human(now.saturating_since(since))
                            ),
                            None => "unhealthy: replaced on a fresh attempt".to_owned(),
                        };
                        let node = d.node.clone();
                        let subject = Subject::Node { node, attempt };
                        self.record_event(EventReason::NodeRemediated, subject, message, now);
                    }
                }
                self.change(&d.node, now, &d, |rec| {
                    if let Some((failures, at)) = restart_at {
                        rec.node.retry.remediating = true;
                        rec.node.retry.consecutive_failures = failures;
                        rec.node.retry.restart_at = Some(at);
                    }
                    rec.node.intent = Intent::Deleting;
                    // Cleanup starts at once; backoff delays only a restart.
                    rec.node.retry.next_effect_at = None;
                    rec.node.stage_deadline = None;
                });
            }
            Action::MarkDestroyed => {
                self.change(&d.node, now, &d, |rec| {
                    let n = &mut rec.node;
                    n.stage = NodeStage::Destroyed;
                    n.stage_deadline = None;
                    n.facts.lease = None;
                    n.facts.endpoint = None;
                    n.facts.session = None;
                    n.retry.next_effect_at = None;
                });
            }
            Action::ObserveConvergence => {
                self.change(&d.node, now, &d, |rec| {
                    let n = &mut rec.node;
                    n.stage = NodeStage::Dormant;
                    // The session completed with convergence; nothing to cancel.
                    n.facts.session = None;
                    n.facts.failure = None;
                    n.stage_deadline = None;
                    // Reaching ready resets the failure count.
                    n.retry = RetryState::default();
                });
            }
            Action::Dispatch(_) if self.dispatch_room == Some(0) => {
                // No room: nothing is recorded, and the node is decided
                // again once there is (explain evaluates its rule live).
                self.dispatch_held.insert(d.node.clone());
            }
            Action::Dispatch(effect) => {
                if let Some(op) = self.dispatch(&d, effect, now)? {
                    ops.push(op);
                    if let Some(room) = &mut self.dispatch_room {
                        *room -= 1;
                    }
                }
            }
        }
        Ok(())
    }

    fn allocate_attempt(&mut self) -> Result<AttemptId, CoreError> {
        let id = self.meta.next_attempt;
        self.meta.next_attempt = id.checked_add(1).ok_or(CoreError::AttemptsExhausted)?;
        self.meta_dirty = true;
        Ok(AttemptId::new(id))
    }

    /// Applies a change to a node and records the decision that made it.
    fn change(&mut self, id: &LogicalNodeId, now: UnixMillis, d: &Decision, f: impl FnOnce(&mut NodeRecord)) {
        if let Some(e) = self.nodes.get_mut(id) {
            f(e.rec_mut());
            e.version += 1;
            e.dirty = true;
            e.wake_at = None;
            e.last = Some(LastDecision {
                decision: d.clone(),
                at: now,
            });
            self.changed.insert(id.clone());
            self.reindex(id);
        }
    }

    fn dispatch(
        &mut self,
        d: &Decision,
        effect: Effect,
        now: UnixMillis,
    ) -> Result<Option<Operation>, CoreError> {
        let deadline = now.checked_add(self.policy.operation_timeout(effect))?;
        let (run_uid, run_id, epoch) = (self.meta.uid, self.meta.run_id.clone(), self.meta.epoch);
        let trace = self.pass_trace.clone();
        let Some(e) = self.nodes.get_mut(&d.node) else {
            return Ok(None);
        };
        let n = &e.rec.node;
        if n.pending.is_some() {
            // One pending operation per node, ever; the decider never asks for a
            // second, and this keeps it so even if one did.
            return Ok(None);
        }
        let input = match effect {
            Effect::CreateLease => OperationInput::CreateLease {
                template: n.spec.clone(),
            },
            Effect::LookupEndpoint => match &n.facts.lease {
                Some(lease) => OperationInput::LookupEndpoint { lease: lease.clone() },
                None => return Ok(None),
            },
            Effect::StartBootstrap => match (&n.facts.lease, &n.facts.endpoint) {
                (Some(lease), Some(endpoint)) => OperationInput::StartBootstrap {
                    lease: lease.clone(),
                    endpoint: endpoint.clone(),
                    boot: n.spec.boot.clone(),
                    join: n.spec.join.clone(),
                },
                _ => return Ok(None),
            },
            Effect::CancelBootstrap => OperationInput::CancelBootstrap {
                session: n.facts.session.clone(),
            },
            Effect::DestroyLease => OperationInput::DestroyLease {
                lease: n.facts.lease.clone(),
            },
        };
        let provider: Arc<str> = Arc::from(n.spec.provider.name.as_str());
        let seq = e.rec.next_seq;
        let next_seq = seq
            .checked_add(1)
            .ok_or_else(|| CoreError::SequenceExhausted(d.node.clone()))?;
        let id = OperationId::new(n.attempt, seq);
        let op = Operation {
            run_uid,
            run_id,
            node: d.node.clone(),
            id,
            epoch,
            deadline,
            provider,
            input,
            trace: trace.clone(),
        };
        let rec = e.rec_mut();
        rec.next_seq = next_seq;
        rec.node.pending = Some(PendingOp {
            id,
            effect,
            deadline,
            dispatched_at: now,
        });
        self.pending_ops += 1;
        if effect == Effect::CreateLease
            && rec.node.intent == Intent::Active
            && rec.node.stage == NodeStage::New
        {
            rec.node.stage = NodeStage::LeaseRequested;
        }
        rec.inflight = Some(Box::new(op.clone()));
        e.trace = trace;
        e.version += 1;
        e.wake_at = None;
        e.last = Some(LastDecision {
            decision: d.clone(),
            at: now,
        });
        self.changed.insert(d.node.clone());
        self.reindex(&d.node);
        Ok(Some(op))
    }

    /// Every change since the last commit as one delta, holding back the
    /// acknowledgements of the folds in it. Once this returns the run counts
    /// the changes as committed: a commit the store refuses leaves the run
    /// ahead of its store, and the shell must reload it from the store.
    pub fn take_commit(&mut self) -> Commit {
        self.commit_with(Vec::new())
    }

    fn commit_with(&mut self, operations: Vec<Operation>) -> Commit {
        let mut delta = RunDelta::new(self.meta.uid);
        if self.is_gone() {
            delta.drop_run = true;
        } else {
            if self.meta_dirty {
                delta.meta = Some(self.meta.clone());
            }
            let mut upserts = Vec::with_capacity(self.changed.len());
            upserts.extend(
                self.changed
                    .iter()
                    .filter_map(|id| self.nodes.get(id).map(|e| Arc::clone(&e.rec))),
            );
            delta.upserts = upserts;
            delta.removals = self.removed.iter().cloned().collect();
            delta.events = self
                .events_changed
                .iter()
                .filter_map(|seq| self.event(*seq).cloned())
                .collect();
            delta.events_below = self.events_below;
        }
        self.events_changed.clear();
        self.events_below = None;
        self.meta_dirty = false;
        self.changed.clear();
        self.removed.clear();
        Commit::new(delta, operations, std::mem::take(&mut self.unacked))
    }

    // ----- folding -------------------------------------------------------

    fn backoff_at(
        &self,
        attempt: AttemptId,
        failures: u32,
        now: UnixMillis,
    ) -> Result<UnixMillis, ClockSaturated> {
        now.checked_add(backoff_delay(
            &self.policy.backoff,
            self.meta.uid,
            attempt,
            failures,
        ))
    }

    /// Folds an operation result into the attempt and operation it names.
    pub fn fold_result(&mut self, r: &OperationResult, now: UnixMillis) -> Result<Fold, CoreError> {
        self.on_attempt(&r.node, r.id.attempt(), |run| run.fold_result_in_place(r, now))
    }

    fn fold_result_in_place(&mut self, r: &OperationResult, now: UnixMillis) -> Result<Fold, CoreError> {
        let fold = self.check_result(r);
        if let Fold::Discarded(why) = fold {
            if why != Discard::OtherRun {
                // The executor keeps a result until it is acknowledged; a
                // discarded one is acknowledged too, or it would come back forever.
                self.unacked.push(AckRef::Result(r.id));
            }
            *self.counters.discarded.entry(why.name()).or_default() += 1;
            return Ok(fold);
        }
        self.fold_outcome(&r.node, r.effect, &r.outcome, now)?;
        self.unacked.push(AckRef::Result(r.id));
        self.counters.folded_results += 1;
        Ok(Fold::Folded)
    }

    fn check_result(&self, r: &OperationResult) -> Fold {
        if r.run_uid != self.meta.uid {
            return Fold::Discarded(Discard::OtherRun);
        }
        let Some(e) = self.nodes.get(&r.node) else {
            return Fold::Discarded(Discard::UnknownNode);
        };
        let n = &e.rec.node;
        if n.attempt != r.id.attempt() {
            return Fold::Discarded(Discard::SupersededAttempt);
        }
        if r.late {
            return Fold::Discarded(Discard::Late);
        }
        match n.pending {
            Some(p) if p.id == r.id && p.effect == r.effect => Fold::Folded,
            Some(p) if p.id == r.id => Fold::Discarded(Discard::EffectMismatch),
            _ => Fold::Discarded(Discard::UnknownOperation),
        }
    }

    /// Folds the outcome of the node's pending operation. Every deadline is
    /// computed before anything changes, so an error leaves the node as it was.
    fn fold_outcome(
        &mut self,
        id: &LogicalNodeId,
        effect: Effect,
        outcome: &Outcome,
        now: UnixMillis,
    ) -> Result<(), CoreError> {
        let Some(e) = self.nodes.get(id) else {
            return Ok(());
        };
        let n = &e.rec.node;
        let failures = n.retry.consecutive_failures.saturating_add(1);
        let backoff_at = self.backoff_at(n.attempt, failures, now)?;
        let probe_at = now.checked_add(self.policy.probe_interval)?;
        let endpoint_deadline = now.checked_add(self.policy.endpoint_timeout)?;
        let bootstrap_deadline = now.checked_add(self.policy.bootstrap_timeout)?;
        let Some(e) = self.nodes.get_mut(id) else {
            return Ok(());
        };
        e.version += 1;
        e.dirty = true;
        e.wake_at = None;
        let rec = e.rec_mut();
        rec.inflight = None;
        let was_permanent = rec.node.retry.permanent.is_some();
        let n = &mut rec.node;
        if n.pending.take().is_some() {
            self.pending_ops = self.pending_ops.saturating_sub(1);
        }
        if self.batch_from.is_none() {
            self.batch_from = Some(now);
        }
        self.folds_since_pass += 1;
        self.last_fold = Some(now);
        // A failed attempt (its resource lost while this operation ran)
        // records what the result names, for its cleanup, but never moves
        // forward again: a late success must not revive it.
        let active = n.intent == Intent::Active && n.stage != NodeStage::Failed;

        // Shared shapes of failure handling.
        let retry_later = |n: &mut ManagedNode, reason: &str| {
            n.retry.consecutive_failures = failures;
            n.retry.next_effect_at = Some(backoff_at);
            n.facts.failure = Some(Failure {
                reason: format!("{}: {reason}", effect.name()),
                at: now,
            });
        };
        let attempt_fails = |n: &mut ManagedNode, reason: &str, permanent: bool| {
            n.retry.consecutive_failures = failures;
            n.retry.next_effect_at = None;
            n.retry.restart_at = Some(backoff_at);
            if permanent {
                n.retry.permanent = Some(PermanentFailure {
                    reason: format!("{}: {reason}", effect.name()),
                    spec: n.spec.clone(),
                });
            }
            n.facts.failure = Some(Failure {
                reason: format!("{}: {reason}", effect.name()),
                at: now,
            });
            n.stage_deadline = None;
            if n.intent == Intent::Active {
                n.stage = NodeStage::Failed;
            }
        };

        match (effect, outcome) {
            (Effect::CreateLease, Outcome::Succeeded(f)) => match &f.lease {
                Some(lease) => {
                    n.facts.lease = Some(lease.clone());
                    if let Some(during) = &mut self.leases_during_read {
                        during.insert(id.clone());
                    }
                    n.facts.ambiguous_create = false;
                    if let Some(ep) = &f.endpoint {
                        n.facts.endpoint = Some(ep.clone());
                    }
                    if active {
                        if n.facts.endpoint.is_some() {
                            n.stage = NodeStage::EndpointKnown;
                            n.stage_deadline = None;
                        } else {
                            n.stage = NodeStage::LeaseCreated;
                            n.stage_deadline = Some(endpoint_deadline);
                        }
                    }
                }
                // A success that names no lease cannot be trusted either way.
                None => {
                    n.facts.ambiguous_create = true;
                    retry_later(n, "succeeded without naming a lease");
                }
            },
            (Effect::CreateLease, Outcome::NotReady { .. }) => {
                n.retry.next_effect_at = Some(probe_at);
            }
            (Effect::CreateLease, Outcome::Retryable { reason }) => {
                retry_later(n, reason);
                if active && n.facts.lease.is_none() {
                    n.stage = NodeStage::New;
                }
            }
            (Effect::CreateLease, Outcome::Permanent { reason }) => {
                // A definite "cannot create" after the adoption check: nothing exists.
                n.facts.ambiguous_create = false;
                attempt_fails(n, reason, true);
            }
            (Effect::CreateLease, Outcome::Ambiguous { reason }) => {
                n.facts.ambiguous_create = true;
                retry_later(n, reason);
            }

            (Effect::LookupEndpoint, Outcome::Succeeded(f)) => match &f.endpoint {
                Some(ep) => {
                    n.facts.endpoint = Some(ep.clone());
                    if active {
                        n.stage = NodeStage::EndpointKnown;
                        n.stage_deadline = None;
                    }
                }
                None => retry_later(n, "succeeded without naming an endpoint"),
            },
            // Not ready is a probe, never a failure.
            (Effect::LookupEndpoint, Outcome::NotReady { .. }) => {
                n.retry.next_effect_at = Some(probe_at);
            }
            (Effect::LookupEndpoint, Outcome::Retryable { reason } | Outcome::Ambiguous { reason }) => {
                retry_later(n, reason);
            }
            (Effect::LookupEndpoint, Outcome::Permanent { reason }) => attempt_fails(n, reason, true),

            (Effect::StartBootstrap, Outcome::Succeeded(f)) => match &f.session {
                Some(session) => {
                    // Stages may have reached the executor before this
                    // result (an adopted session after an executor restart
                    // streams again from its start) or reached this driver
                    // before it (left unacknowledged): ask for the session
                    // after what is folded. Stages acknowledged by then are
                    // not sent twice.
                    self.replays.push((id.clone(), session.clone()));
                    n.facts.session = Some(session.clone());
                    n.facts.ambiguous_bootstrap = false;
                    n.facts.bootstrap = None;
                    if active {
                        n.stage = NodeStage::BootstrapRunning;
                        n.stage_deadline = Some(bootstrap_deadline);
                    }
                }
                None => {
                    n.facts.ambiguous_bootstrap = true;
                    attempt_fails(n, "succeeded without naming a session", false);
                }
            },
            (Effect::StartBootstrap, Outcome::NotReady { .. }) => {
                n.retry.next_effect_at = Some(probe_at);
            }
            (Effect::StartBootstrap, Outcome::Retryable { reason }) => attempt_fails(n, reason, false),
            (Effect::StartBootstrap, Outcome::Permanent { reason }) => attempt_fails(n, reason, true),
            (Effect::StartBootstrap, Outcome::Ambiguous { reason }) => {
                n.facts.ambiguous_bootstrap = true;
                attempt_fails(n, reason, false);
            }

            (Effect::CancelBootstrap, Outcome::Succeeded(_)) => {
                n.facts.session = None;
                n.facts.ambiguous_bootstrap = false;
            }
            (Effect::DestroyLease, Outcome::Succeeded(_)) => {
                n.facts.lease = None;
                n.facts.endpoint = None;
            }
            // Cleanup failures keep every live fact (dead-hold) and retry on the
            // backoff schedule.
            (Effect::CancelBootstrap | Effect::DestroyLease, other) => {
                retry_later(n, other.reason());
            }
        }
        let permanent = (!was_permanent)
            .then(|| n.retry.permanent.as_ref().map(|p| (p.reason.clone(), n.attempt)))
            .flatten();
        self.changed.insert(id.clone());
        self.reindex(id);
        if let Some((reason, attempt)) = permanent {
            self.record_event(
                EventReason::NodeFailedPermanently,
                Subject::Node {
                    node: id.clone(),
                    attempt,
                },
                format!("{reason}; the slot waits for a change of its spec"),
                now,
            );
        }
        Ok(())
    }

    /// Folds a bootstrap observation into the session it names.
    pub fn fold_observation(&mut self, o: &Observation, now: UnixMillis) -> Result<Fold, CoreError> {
        self.on_attempt(&o.node, o.attempt, |run| run.fold_observation_in_place(o, now))
    }

    fn fold_observation_in_place(&mut self, o: &Observation, now: UnixMillis) -> Result<Fold, CoreError> {
        let fold = self.check_observation(o);
        if let Fold::Discarded(why) = fold {
            if why == Discard::Gap {
                self.replays.push((o.node.clone(), o.session.clone()));
            }
            if !matches!(
                why,
                Discard::OtherRun | Discard::SessionNotYetKnown | Discard::Gap
            ) {
                self.unacked.push(AckRef::Observation {
                    session: o.session.clone(),
                    seq: o.seq,
                });
            }
            *self.counters.discarded.entry(why.name()).or_default() += 1;
            return Ok(fold);
        }
        let failures = self
            .nodes
            .get(&o.node)
            .map_or(1, |e| e.rec.node.retry.consecutive_failures.saturating_add(1));
        let restart_at = self.backoff_at(o.attempt, failures, now)?;
        let Some(e) = self.nodes.get_mut(&o.node) else {
            return Ok(Fold::Discarded(Discard::UnknownNode));
        };
        e.version += 1;
        e.dirty = true;
        e.wake_at = None;
        let n = &mut e.rec_mut().node;
        n.facts.bootstrap = Some(BootstrapProgress {
            stage: o.stage,
            seq: o.seq,
            at: o.at,
            detail: o.detail.clone(),
        });
        if n.intent == Intent::Active {
            // An attempt already failed (its resource was lost first) fails
            // once: its failure count moves once.
            if o.stage.is_failure() && n.stage != NodeStage::Failed {
                // The attempt fails; the session stays recorded as live so that
                // cleanup cancels it ("already absent" is success).
                let failure = Failure {
                    reason: format!("bootstrap {}: {}", o.stage.name(), o.detail),
                    at: o.at,
                };
                attempt_failed(n, failures, restart_at, failure);
            } else if matches!(o.stage, BootstrapStage::Joined | BootstrapStage::Converged)
                && n.stage == NodeStage::BootstrapRunning
            {
                n.stage = NodeStage::Joined;
            }
        }
        self.changed.insert(o.node.clone());
        self.reindex(&o.node);
        self.note_fold(now);
        self.unacked.push(AckRef::Observation {
            session: o.session.clone(),
            seq: o.seq,
        });
        self.counters.folded_observations += 1;
        Ok(Fold::Folded)
    }

    /// Folds a change the executor saw in a resource (SPEC §8): a lost
    /// resource fails its attempt, which row 4 then cleans up ("already
    /// absent" is success) and the slot restarts under its restart backoff,
    /// the failure count carried. A change of another attempt, of a node
    /// being deleted or of an attempt that already failed changes nothing;
    /// every change is acknowledged once its fold is committed.
    pub fn fold_resource_change(&mut self, c: &ResourceChange, now: UnixMillis) -> Result<Fold, CoreError> {
        self.on_attempt(&c.node, c.attempt, |run| {
            run.fold_resource_change_in_place(c, now)
        })
    }

    fn fold_resource_change_in_place(
        &mut self,
        c: &ResourceChange,
        now: UnixMillis,
    ) -> Result<Fold, CoreError> {
        if c.run_uid != self.meta.uid {
            return Ok(Fold::Discarded(Discard::OtherRun));
        }
        // Sequence 0: the driver found the loss itself (inventory resync);
        // there is nothing to acknowledge.
        if c.seq > 0 {
            self.unacked.push(AckRef::Change { seq: c.seq });
        }
        let why = match self.nodes.get(&c.node).map(|e| &e.rec.node) {
            None => Some(Discard::UnknownNode),
            Some(n) if n.attempt != c.attempt => Some(Discard::SupersededAttempt),
            Some(n)
                if n.intent == Intent::Deleting
                    || matches!(n.stage, NodeStage::Failed | NodeStage::Destroyed) =>
            {
                Some(Discard::Duplicate)
            }
            Some(_) => None,
        };
        if let Some(why) = why {
            *self.counters.discarded.entry(why.name()).or_default() += 1;
            return Ok(Fold::Discarded(why));
        }
        let reason = match &c.change {
            Change::Lost { reason } => reason,
            Change::Health { healthy, detail } => return self.fold_health(c, *healthy, detail, now),
        };
        let failures = self
            .nodes
            .get(&c.node)
            .map_or(1, |e| e.rec.node.retry.consecutive_failures.saturating_add(1));
        let restart_at = self.backoff_at(c.attempt, failures, now)?;
        let Some(e) = self.nodes.get_mut(&c.node) else {
            return Ok(Fold::Discarded(Discard::UnknownNode));
        };
        e.version += 1;
        e.dirty = true;
        e.wake_at = None;
        let failure = Failure {
            reason: format!("{LOST_PREFIX}{reason}"),
            at: c.at,
        };
        let n = &mut e.rec_mut().node;
        attempt_failed(n, failures, restart_at, failure);
        n.facts.lost = true;
        self.changed.insert(c.node.clone());
        self.reindex(&c.node);
        self.note_fold(now);
        self.counters.lost += 1;
        self.record_event(
            EventReason::NodeLost,
            Subject::Node {
                node: c.node.clone(),
                attempt: c.attempt,
            },
            format!("resource lost ({reason}); the slot is replaced on a fresh attempt"),
            now,
        );
        Ok(Fold::Folded)
    }

    /// A health report of the attempt (SPEC.md section 8): the node is
    /// unhealthy from the first failed probe, and due for remediation once it
    /// has been for its group's `unhealthy_after`, a deadline stored here. A
    /// report older than the one folded is stale.
    fn fold_health(
        &mut self,
        c: &ResourceChange,
        healthy: bool,
        detail: &str,
        now: UnixMillis,
    ) -> Result<Fold, CoreError> {
        let unhealthy_after = self
            .meta
            .shape
            .group(c.node.group())
            .map_or(contract::HealthPolicy::default(), |g| g.policy.health)
            .unhealthy_after_ms;
        let Some(e) = self.nodes.get_mut(&c.node) else {
            return Ok(Fold::Discarded(Discard::UnknownNode));
        };
        let prev = e.rec.node.facts.health.as_ref();
        if prev.is_some_and(|h| (c.at, c.seq) <= (h.observed_at, h.seq)) {
            *self
                .counters
                .discarded
                .entry(Discard::Duplicate.name())
                .or_default() += 1;
            return Ok(Fold::Discarded(Discard::Duplicate));
        }
        let same = prev.is_some_and(|h| h.healthy == healthy);
        let was_unhealthy = prev.is_some_and(|h| !h.healthy);
        let unhealthy_since = prev.map(|h| h.since);
        let since = match prev {
            Some(h) if same => h.since,
            _ => c.at,
        };
        let remediate_at = if healthy {
            None
        } else {
            Some(since.checked_add(std::time::Duration::from_millis(unhealthy_after))?)
        };
        e.rec_mut().node.facts.health = Some(NodeHealth {
            healthy,
            since,
            observed_at: c.at,
            seq: c.seq,
            detail: detail.to_owned(),
            remediate_at,
        });
        // A report of the state already known changes no decision: it is
        // kept (the last observation time), and nothing is decided again.
        if !same {
            e.version += 1;
            e.dirty = true;
            e.wake_at = None;
        }
        self.changed.insert(c.node.clone());
        self.reindex(&c.node);
        self.note_fold(now);
        let subject = Subject::Node {
            node: c.node.clone(),
            attempt: c.attempt,
        };
        if !same && !healthy {
            let message = format!(
                "failed its health probe ({detail}); replaced if still unhealthy after {}",
                human(std::time::Duration::from_millis(unhealthy_after))
            );
            self.record_event(EventReason::NodeUnhealthy, subject, message, now);
        } else if !same && was_unhealthy {
            let message = match unhealthy_since {
                Some(since) => format!(
                    "passes its health probe again after {} unhealthy",
                    human(c.at.saturating_since(since))
                ),
                None => "passes its health probe again".to_owned(),
            };
            self.record_event(EventReason::NodeRecovered, subject, message, now);
        }
        Ok(Fold::Folded)
    }

    /// The leases the run believes live: nodes of an active attempt that
    /// hold one, are neither failed nor destroyed and have no operation in
    /// flight (whose result may change that). The inventory resync compares
    /// them with the executor's inventory.
    pub fn leases_held(&self) -> impl Iterator<Item = (&LogicalNodeId, AttemptId)> {
        self.nodes.values().flat_map(|e| e.attempts()).filter_map(|n| {
            let live = n.intent == Intent::Active
                && n.facts.lease.is_some()
                && n.pending.is_none()
                && !matches!(n.stage, NodeStage::Failed | NodeStage::Destroyed);
            live.then_some((&n.id, n.attempt))
        })
    }

    /// The orphan sweep begins to read the executor's inventory: the leases
    /// recorded from now on are left out of
    /// [`RunState::leases_held_through_read`].
    pub fn inventory_read_begins(&mut self) {
        self.leases_during_read = Some(BTreeSet::new());
    }

    /// Ends the read begun by [`RunState::inventory_read_begins`] and
    /// returns the leases held now that were recorded before it began: only
    /// those must be in a complete read of the inventory (a resource made
    /// after its page was read is not). None if the run did not see the read
    /// begin (it was loaded while the inventory was read).
    pub fn leases_held_through_read(&mut self) -> Vec<(LogicalNodeId, AttemptId)> {
        let Some(during) = self.leases_during_read.take() else {
            return Vec::new();
        };
        self.leases_held()
            .filter(|(id, _)| !during.contains(*id))
            .map(|(id, attempt)| (id.clone(), attempt))
            .collect()
    }

    /// Ends a read of the inventory that failed.
    pub fn inventory_read_ends(&mut self) {
        self.leases_during_read = None;
    }

    fn check_observation(&self, o: &Observation) -> Fold {
        if o.run_uid != self.meta.uid {
            return Fold::Discarded(Discard::OtherRun);
        }
        let Some(e) = self.nodes.get(&o.node) else {
            return Fold::Discarded(Discard::UnknownNode);
        };
        let n = &e.rec.node;
        if n.attempt != o.attempt {
            return Fold::Discarded(Discard::SupersededAttempt);
        }
        if n.facts.session.as_ref() != Some(&o.session) {
            let starting =
                n.facts.session.is_none() && n.pending.is_some_and(|p| p.effect == Effect::StartBootstrap);
            return Fold::Discarded(if starting {
                Discard::SessionNotYetKnown
            } else {
                Discard::StaleSession
            });
        }
        let last = n.facts.bootstrap.as_ref().map_or(0, |b| b.seq);
        if o.seq <= last {
            return Fold::Discarded(Discard::Duplicate);
        }
        if n.facts.bootstrap.as_ref().is_some_and(|b| b.stage.is_terminal()) {
            return Fold::Discarded(Discard::AfterEnd);
        }
        if o.seq > last.saturating_add(1) {
            return Fold::Discarded(Discard::Gap);
        }
        Fold::Folded
    }

    /// Sessions to ask the executor to replay from the start (their first
    /// stages may have arrived before the result that named them).
    pub fn take_replays(&mut self) -> Vec<(contract::SessionId, u64)> {
        let sessions = std::mem::take(&mut self.replays);
        sessions
            .into_iter()
            .map(|(node, session)| {
                let after = self
                    .nodes
                    .get(&node)
                    .filter(|e| e.rec.node.facts.session.as_ref() == Some(&session))
                    .and_then(|e| e.rec.node.facts.bootstrap.as_ref().map(|b| b.seq))
                    .unwrap_or(0);
                (session, after)
            })
            .collect()
    }

    /// The sessions of nodes still bootstrapping (their attempt's session
    /// has not reported its end), each with the sequence number of its last
    /// folded stage (0: none yet): what the shell compares from one safety
    /// tick to the next to find sessions that made no progress.
    pub fn bootstrapping_cursors(&self) -> impl Iterator<Item = (&contract::SessionId, u64)> + '_ {
        self.nodes.values().flat_map(|e| e.attempts()).filter_map(|n| {
            let bootstrapping = matches!(n.stage, NodeStage::BootstrapRunning | NodeStage::Joined)
                && !n.facts.bootstrap.as_ref().is_some_and(|b| b.stage.is_terminal());
            let session = n.facts.session.as_ref().filter(|_| bootstrapping)?;
            Some((session, n.facts.bootstrap.as_ref().map_or(0, |b| b.seq)))
        })
    }

    /// The last folded observation sequence per live session, for asking the
    /// executor to replay what came after.
    pub fn observation_cursors(&self) -> Vec<(contract::SessionId, u64)> {
        self.nodes
            .values()
            .filter_map(|e| {
                let n = &e.rec.node;
                n.facts
                    .session
                    .as_ref()
                    .map(|s| (s.clone(), n.facts.bootstrap.as_ref().map_or(0, |b| b.seq)))
            })
            .collect()
    }

    /// A submission that failed before reaching the executor folds as a
    /// failure of that operation. Whether it may have happened is unknown, so it
    /// folds as ambiguous.
    pub fn fold_submit_failure(
        &mut self,
        id: OperationId,
        node: &LogicalNodeId,
        reason: &str,
        now: UnixMillis,
    ) -> Result<Fold, CoreError> {
        self.on_attempt(node, id.attempt(), |run| {
            run.fold_submit_failure_in_place(id, node, reason, now)
        })
    }

    fn fold_submit_failure_in_place(
        &mut self,
        id: OperationId,
        node: &LogicalNodeId,
        reason: &str,
        now: UnixMillis,
    ) -> Result<Fold, CoreError> {
        let effect = match self.nodes.get(node).and_then(|e| e.rec.node.pending) {
            Some(p) if p.id == id => p.effect,
            _ => return Ok(Fold::Discarded(Discard::UnknownOperation)),
        };
        self.fold_outcome(
            node,
            effect,
            &Outcome::Ambiguous {
                reason: format!("submission failed: {reason}"),
            },
            now,
        )?;
        Ok(Fold::Folded)
    }

    /// A rejection from the executor. A conflicting-input or invalid rejection is
    /// definite (the operation did not run) and folds as a retryable failure; a
    /// fenced or unknown-run rejection means this driver must not act, and
    /// changes nothing (the shell re-claims or stops).
    pub fn fold_rejection(&mut self, rej: &Rejection, now: UnixMillis) -> Result<Fold, CoreError> {
        use contract::RejectionReason as R;
        let Some(id) = rej.id else {
            return Ok(Fold::Discarded(Discard::UnknownOperation));
        };
        if rej.run_uid != self.meta.uid {
            return Ok(Fold::Discarded(Discard::OtherRun));
        }
        if matches!(rej.reason, R::Fenced | R::UnknownRun) {
            return Ok(Fold::Discarded(Discard::UnknownOperation));
        }
        // Rejections are rare; finding the node by its pending id is a scan.
        let Some((node, effect)) = self.nodes.iter().find_map(|(nid, e)| {
            e.attempts().find_map(|n| match n.pending {
                Some(p) if p.id == id => Some((nid.clone(), p.effect)),
                _ => None,
            })
        }) else {
            return Ok(Fold::Discarded(Discard::UnknownOperation));
        };
        let outcome = Outcome::Retryable {
            reason: format!("rejected ({}): {}", rej.reason.name(), rej.message),
        };
        self.on_attempt(&node, id.attempt(), |run| {
            run.fold_outcome(&node, effect, &outcome, now)
        })?;
        Ok(Fold::Folded)
    }

    /// Folds every expired deadline: operations past deadline plus grace fold as
    /// ambiguous failures; expired stage deadlines fail the attempt.
    pub fn handle_timeout(&mut self, now: UnixMillis) -> Result<u32, CoreError> {
        if self.rollout_deadline().is_some_and(|t| t <= now) {
            self.track_rollouts(now);
        }
        let grace = self.policy.result_grace;
        let mut expired_ops = Vec::new();
        let mut expired_stages = Vec::new();
        // Only nodes with a deadline due can expire: the index names them.
        let due: Vec<LogicalNodeId> = self
            .deadlines
            .iter()
            .take_while(|(t, _)| *t <= now)
            .map(|(_, id)| id.clone())
            .collect();
        for id in &due {
            let Some(e) = self.nodes.get(id) else {
                continue;
            };
            for n in e.attempts() {
                if let Some(p) = n.pending
                    && p.deadline.checked_add(grace).is_ok_and(|t| t <= now)
                {
                    expired_ops.push((id.clone(), n.attempt, p.effect));
                }
                if n.intent == Intent::Active && n.stage_deadline.is_some_and(|t| t <= now) {
                    expired_stages.push((id.clone(), n.attempt));
                }
            }
        }
        let mut folded = 0;
        let ambiguous = Outcome::Ambiguous {
            reason: "no result by the operation's deadline".to_owned(),
        };
        for (id, attempt, effect) in expired_ops {
            self.on_attempt(&id, attempt, |run| run.fold_outcome(&id, effect, &ambiguous, now))?;
            self.counters.deadline_folds += 1;
            folded += 1;
        }
        for (id, attempt) in expired_stages {
            folded += self.on_attempt(&id, attempt, |run| run.expire_stage(id.clone(), now))?;
        }
        Ok(folded)
    }

    /// The current attempt of `id` missed its stage deadline: it fails.
    fn expire_stage(&mut self, id: LogicalNodeId, now: UnixMillis) -> Result<u32, CoreError> {
        let mut folded = 0;
        {
            let failures = self
                .nodes
                .get(&id)
                .map_or(1, |e| e.rec.node.retry.consecutive_failures.saturating_add(1));
            let attempt = self
                .nodes
                .get(&id)
                .map_or(AttemptId::new(0), |e| e.rec.node.attempt);
            let restart_at = self.backoff_at(attempt, failures, now)?;
            let (endpoint_timeout, bootstrap_timeout) =
                (self.policy.endpoint_timeout, self.policy.bootstrap_timeout);
            if let Some(e) = self.nodes.get_mut(&id) {
                let n = &mut e.rec_mut().node;
                let reason = match n.stage {
                    NodeStage::LeaseCreated => format!("no endpoint within {}", human(endpoint_timeout)),
                    _ => format!("bootstrap did not converge within {}", human(bootstrap_timeout)),
                };
                attempt_failed(n, failures, restart_at, Failure { reason, at: now });
                e.version += 1;
                e.dirty = true;
                e.wake_at = None;
                self.reindex(&id);
                self.changed.insert(id);
                self.counters.stage_timeouts += 1;
                folded += 1;
            }
        }
        Ok(folded)
    }

    /// Whether the run holds writes its store has not had yet (the run's
    /// fields, nodes or events).
    pub fn uncommitted(&self) -> bool {
        self.meta_dirty
            || !self.changed.is_empty()
            || !self.removed.is_empty()
            || !self.events_changed.is_empty()
            || self.events_below.is_some()
    }

    /// The rule that applies to a node now, evaluated with the decider library.
    pub fn explain(&self, id: &LogicalNodeId, now: UnixMillis) -> Option<Decision> {
        let n = self.node(id)?;
        Some(decider::decide_node(&self.desired_view(), n, now))
    }

    /// What the decider would do now under the run's own shape (a copy of
    /// the run with a proposed shape applied, for a plan).
    pub fn plan_current(&self, now: UnixMillis) -> DecideOutput {
        decider::decide(&self.desired_view(), self.nodes(), self.slot_set(), now)
    }

    /// The waves in which each group's drifted slots would be replaced under
    /// its rollout budget (see [`rollout::waves`]).
    pub fn rollout_waves(&self) -> Vec<rollout::Wave> {
        let view = self.desired_view();
        let mut out = Vec::new();
        for g in view.groups() {
            let (mut unavailable, mut ready) = (Vec::new(), Vec::new());
            for n in self
                .nodes()
                .filter(|n| n.id.group() == &g.id && n.id.index() < g.count)
            {
                if NodeTemplate::same(&g.template, &n.spec) || n.intent != Intent::Active {
                    continue;
                }
                if decider::rolls_within_budget(&view, n) {
                    ready.push(n.id.index());
                } else {
                    unavailable.push(n.id.index());
                }
            }
            out.extend(rollout::waves(g, view.counts(&g.id), unavailable, ready));
        }
        out
    }

    /// Finds whether a decision for `rule` is the last one recorded, for tests.
    pub fn last_rule(&self, id: &LogicalNodeId) -> Option<Rule> {
        self.last_decision(id).map(|l| l.decision.rule)
    }
}

fn human(d: Duration) -> String {
    if d.as_millis().is_multiple_of(1000) {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// The template of an adopted orphan whose group the run does not have: it
/// is never created from, only cleaned up.
fn orphan_template() -> NodeTemplate {
    NodeTemplate {
        role: "orphan".into(),
        provider: contract::ProviderShape {
            name: String::new(),
            machine_type: String::new(),
            cpu: 0.0,
            memory_gib: 0.0,
            accelerators: Vec::new(),
            zone: String::new(),
            labels: BTreeMap::new(),
        },
        image: String::new(),
        boot: Default::default(),
        join: Default::default(),
    }
}

/// [`RunState::intern`] against `shape`.
fn intern_in(shape: &ClusterShape, id: &mut LogicalNodeId) {
    if let Some(g) = shape.groups.iter().find(|g| g.id == *id.group()) {
        *id = LogicalNodeId::new(g.id.clone(), id.index());
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::store::{MemStore, RunStore};

    const T0: UnixMillis = UnixMillis::new(1_700_000_000_000);
    const UID: RunUid = RunUid::from_u128(0xfeed);

    fn shape() -> ClusterShape {
        ClusterShape {
            run_id: RunId::parse("run_id", "orph").unwrap(),
            generation: Generation::new(1),
            labels: Default::default(),
            groups: vec![contract::NodeGroup {
                id: contract::GroupId::parse("id", "workers").unwrap(),
                count: 2,
                template: Arc::new(contract::shape::example_template("fake", "img:1")),
                policy: Default::default(),
            }],
        }
    }

    fn node(s: &str) -> LogicalNodeId {
        LogicalNodeId::parse("node", s).unwrap()
    }

    fn pass(run: &mut RunState, store: &MemStore, now: UnixMillis) -> PassOutcome {
        let plan = run.begin_pass(now).unwrap();
        let out = {
            let view = run.desired_view();
            decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), now)
        };
        let outcome = run.apply_decisions(plan, out, now).unwrap();
        store.commit(outcome.commit.delta()).unwrap();
        outcome
    }

    /// Two nodes inserted, each with a `CreateLease` pending; `workers-0`
    /// also knows a lease, an endpoint and a session.
    fn run_with_live_node() -> (RunState, MemStore) {
        let mut run = RunState::create(shape(), UID, Epoch::new(1), Arc::new(Policy::default()), T0).unwrap();
        let store = MemStore::new();
        let _ = pass(&mut run, &store, T0);
        let _ = pass(&mut run, &store, T0);
        assert_eq!(run.pending_count(), 2, "both nodes have a create pending");
        let e = run.nodes.get_mut(&node("workers-0")).unwrap();
        let facts = &mut e.rec_mut().node.facts;
        facts.lease = Some(contract::LeaseId::new("lease", "lease-w0").unwrap());
        facts.endpoint = Some(contract::Endpoint::new("endpoint", "127.0.0.1:4000").unwrap());
        facts.session = Some(contract::SessionId::new("session", "s-w0").unwrap());
        (run, store)
    }

    /// Whether two group ids share one allocation (compare by address).
    fn same_allocation(a: &contract::GroupId, b: &contract::GroupId) -> bool {
        std::ptr::eq(a.as_str().as_ptr(), b.as_str().as_ptr())
    }

    #[test]
    fn ids_from_messages_and_a_new_shape_share_the_runs_group_allocation() {
        let mut run = RunState::create(shape(), UID, Epoch::new(1), Arc::new(Policy::default()), T0).unwrap();
        let store = MemStore::new();
        let group = run.shape().groups[0].id.clone();

        // Inserts whose ids were decoded on their own, as from the decider.
        let plan = run.begin_pass(T0).unwrap();
        let mut out = {
            let view = run.desired_view();
            decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), T0)
        };
        for d in &mut out.decisions {
            d.node = node(&d.node.to_string());
            assert!(!same_allocation(d.node.group(), &group));
        }
        let outcome = run.apply_decisions(plan, out, T0).unwrap();
        store.commit(outcome.commit.delta()).unwrap();
        assert_eq!(run.node_count(), 2);
        for n in run.nodes() {
            assert!(same_allocation(n.id.group(), &group), "{}", n.id);
        }

        // An id decoded from an executor message.
        let mut id = node("workers-1");
        run.intern(&mut id);
        assert!(same_allocation(id.group(), &group));
        assert_eq!(id, node("workers-1"));
        let mut other = node("gpu-0");
        run.intern(&mut other);
        assert_eq!(other, node("gpu-0"), "a group the shape lacks is left alone");

        // A new generation keeps the group's allocation.
        let mut next = shape();
        next.generation = Generation::new(2);
        next.groups[0].count = 3;
        assert!(!same_allocation(&next.groups[0].id, &group));
        run.apply_shape(next).unwrap();
        assert!(same_allocation(&run.shape().groups[0].id, &group));
    }

    #[test]
    fn dispatch_room_caps_a_pass_and_the_held_nodes_go_out_lowest_first_as_room_returns() {
        let mut five = shape();
        five.groups[0].count = 5;
        let mut run = RunState::create(five, UID, Epoch::new(1), Arc::new(Policy::default()), T0).unwrap();
        let store = MemStore::new();
        // Inserts are transitions: no room needed.
        run.set_dispatch_room(Some(0));
        let inserted = pass(&mut run, &store, T0);
        assert_eq!((inserted.transitions, inserted.operations), (5, 0));

        // Room for two creates of five.
        run.set_dispatch_room(Some(2));
        let first = pass(&mut run, &store, T0);
        assert_eq!(first.operations, 2);
        assert_eq!(run.pending_operations(), 2);
        assert_eq!(run.pending_count(), 2, "the count kept matches a scan");
        assert_eq!(run.dispatch_held_count(), 3);
        assert!(run.is_dispatch_held(&node("workers-2")));
        assert!(!run.is_dispatch_held(&node("workers-0")));
        // Nothing is recorded for a held node: no operation, none stored.
        assert!(run.node(&node("workers-2")).unwrap().pending.is_none());
        let stored = store.load_all().unwrap();
        let stored_pending = stored[0]
            .nodes
            .iter()
            .filter(|n| n.node.pending.is_some())
            .count();
        assert_eq!(stored_pending, 2);

        // No room: the held nodes do not ask for a pass.
        run.set_dispatch_room(Some(0));
        assert!(!run.needs_pass(T0));

        // Room for one: the pass decides one held node, the lowest.
        run.set_dispatch_room(Some(1));
        assert!(run.needs_pass(T0));
        let plan = run.begin_pass(T0).unwrap();
        assert_eq!(
            plan.nodes
                .iter()
                .map(|(id, _)| id.to_string())
                .collect::<Vec<_>>(),
            vec!["workers-2".to_owned()],
            "a pass costs its room, not the backlog"
        );
        let out = {
            let view = run.desired_view();
            decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), T0)
        };
        let one = run.apply_decisions(plan, out, T0).unwrap();
        store.commit(one.commit.delta()).unwrap();
        assert_eq!(one.operations, 1);
        assert!(run.node(&node("workers-2")).unwrap().pending.is_some());
        assert_eq!(run.dispatch_held_count(), 2);

        // Without a limit the rest go out, and nothing waits.
        run.set_dispatch_room(None);
        let rest = pass(&mut run, &store, T0);
        assert_eq!(rest.operations, 2);
        assert_eq!(run.dispatch_held_count(), 0);
        assert_eq!(run.pending_operations(), 5);
        assert!(run.indexes_consistent());
    }

    #[test]
    fn abandon_records_identity_and_live_facts_and_forgets_the_node() {
        let (mut run, store) = run_with_live_node();
        let before = run.node(&node("workers-0")).unwrap().clone();
        let pending = before.pending.unwrap().id;
        let at = T0.checked_add(Duration::from_secs(5)).unwrap();

        let left = run.abandon(&node("workers-0"), at).unwrap();
        assert_eq!(left.run_uid, UID);
        assert_eq!(left.run_id.as_str(), "orph");
        assert_eq!(left.node, node("workers-0"));
        assert_eq!(left.attempt, before.attempt);
        assert_eq!(left.lease.as_ref().map(|l| l.as_str()), Some("lease-w0"));
        assert_eq!(left.endpoint.as_ref().map(|e| e.as_str()), Some("127.0.0.1:4000"));
        assert_eq!(left.session.as_ref().map(|s| s.as_str()), Some("s-w0"));
        assert_eq!(left.pending, Some(pending));
        assert_eq!(left.at, at);

        assert!(run.node(&node("workers-0")).is_none());
        assert!(
            run.node(&node("workers-1")).is_some(),
            "other nodes are untouched"
        );
        assert_eq!(run.pending_count(), 1);
        assert!(run.uncommitted());
        let _ = run.take_commit().persist_to(&store).unwrap();
        let stored = store.load_all().unwrap();
        let ids: Vec<String> = stored[0].nodes.iter().map(|n| n.node.id.to_string()).collect();
        assert_eq!(ids, vec!["workers-1".to_owned()], "the removal is committed");
    }

    #[test]
    fn an_abandoned_desired_slot_is_reinserted_with_a_fresh_attempt() {
        let (mut run, store) = run_with_live_node();
        let old = run.node(&node("workers-0")).unwrap().attempt;
        let highest = run.nodes().map(|n| n.attempt.get()).max().unwrap();
        let _ = run.abandon(&node("workers-0"), T0).unwrap();
        let _ = run.take_commit().persist_to(&store).unwrap();
        assert!(run.needs_pass(T0), "the missing slot asks for a pass");
        let _ = pass(&mut run, &store, T0);
        let again = run.node(&node("workers-0")).expect("re-inserted").attempt;
        assert_ne!(again, old);
        assert!(again.get() > highest, "attempts are never reused");
    }

    #[test]
    fn a_late_result_for_the_abandoned_attempt_is_discarded() {
        let (mut run, store) = run_with_live_node();
        let p = run.node(&node("workers-0")).unwrap().pending.unwrap();
        let _ = run.abandon(&node("workers-0"), T0).unwrap();
        let _ = pass(&mut run, &store, T0);
        let r = OperationResult {
            run_uid: UID,
            node: node("workers-0"),
            id: p.id,
            effect: p.effect,
            outcome: Outcome::Succeeded(contract::ResultFacts::default()),
            completed_at: T0,
            late: false,
            replayed: false,
            trace: TraceContext::default(),
        };
        let before = format!("{:?}", run.node(&node("workers-0")));
        assert!(matches!(run.fold_result(&r, T0).unwrap(), Fold::Discarded(_)));
        assert_eq!(before, format!("{:?}", run.node(&node("workers-0"))));
    }

    /// `workers-1`'s pending create succeeds with a lease.
    fn create_succeeds(run: &mut RunState) {
        let p = run.node(&node("workers-1")).unwrap().pending.unwrap();
        assert_eq!(p.effect, Effect::CreateLease);
        let r = OperationResult {
            run_uid: UID,
            node: node("workers-1"),
            id: p.id,
            effect: p.effect,
            outcome: Outcome::Succeeded(contract::ResultFacts {
                lease: Some(contract::LeaseId::new("lease", "lease-w1").unwrap()),
                ..Default::default()
            }),
            completed_at: T0,
            late: false,
            replayed: false,
            trace: TraceContext::default(),
        };
        assert!(matches!(run.fold_result(&r, T0).unwrap(), Fold::Folded));
    }

    /// A commit holds the run's own records (it copies none), and a change
    /// after it copies the record first: the commit, and a memory store
    /// that kept it, still hold the record as it was committed.
    #[test]
    fn a_commit_shares_its_records_and_a_later_change_leaves_them_as_committed() {
        let (mut run, store) = run_with_live_node();
        let _ = run.take_commit();
        let id = node("workers-1");
        // A change, then its commit: the record the commit holds is the run's.
        run.nodes.get_mut(&id).unwrap().rec_mut().next_seq += 1;
        run.changed.insert(id.clone());
        let commit = run.take_commit();
        let committed = commit.delta().upserts.iter().find(|r| r.node.id == id).unwrap();
        assert!(
            Arc::ptr_eq(committed, &run.nodes[&id].rec),
            "the commit copied the record"
        );
        store.commit(commit.delta()).unwrap();
        let as_committed = NodeRecord::clone(committed);

        // The create succeeds after the commit: the run's record changes ...
        create_succeeds(&mut run);
        let now = &run.nodes[&id].rec;
        assert!(now.node.facts.lease.is_some() && now.node.pending.is_none());
        // ... and neither the commit nor the store sees it.
        assert!(!Arc::ptr_eq(committed, now));
        assert_eq!(**committed, as_committed);
        let stored = store.load_all().unwrap().remove(0).nodes;
        assert_eq!(stored.iter().find(|r| r.node.id == id), Some(&as_committed));
    }

    #[test]
    fn a_lease_recorded_while_the_inventory_is_read_is_left_out_of_that_read() {
        let held =
            |run: &RunState| -> Vec<LogicalNodeId> { run.leases_held().map(|(id, _)| id.clone()).collect() };
        let (mut run, _store) = run_with_live_node();
        // `workers-0` knows its lease but has its create pending still.
        run.nodes
            .get_mut(&node("workers-0"))
            .unwrap()
            .rec_mut()
            .node
            .pending = None;
        assert_eq!(held(&run), vec![node("workers-0")]);

        // Recorded during the read: held, but not one the read must list.
        run.inventory_read_begins();
        create_succeeds(&mut run);
        assert_eq!(held(&run), vec![node("workers-0"), node("workers-1")]);
        let through: Vec<_> = run
            .leases_held_through_read()
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(through, vec![node("workers-0")]);
        // The read is over: the next one lists both.
        assert!(run.leases_held_through_read().is_empty(), "no read under way");
        run.inventory_read_begins();
        assert_eq!(run.leases_held_through_read().len(), 2);

        // A read that failed records nothing more.
        run.inventory_read_begins();
        run.inventory_read_ends();
        assert!(run.leases_during_read.is_none());
    }

    #[test]
    fn a_lease_recorded_before_the_inventory_is_read_is_in_that_read() {
        let (mut run, _store) = run_with_live_node();
        create_succeeds(&mut run);
        run.inventory_read_begins();
        let through: Vec<_> = run
            .leases_held_through_read()
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(
            through,
            vec![node("workers-1")],
            "workers-0 has its create pending"
        );
    }

    #[test]
    fn abandoning_an_unknown_node_changes_nothing() {
        let (mut run, store) = run_with_live_node();
        let _ = run.take_commit().persist_to(&store).unwrap();
        let before = format!("{:?}|{:?}", run.meta(), run.nodes().collect::<Vec<_>>());
        assert!(run.abandon(&node("workers-7"), T0).is_none());
        assert!(!run.uncommitted());
        assert_eq!(
            before,
            format!("{:?}|{:?}", run.meta(), run.nodes().collect::<Vec<_>>())
        );
    }
}
