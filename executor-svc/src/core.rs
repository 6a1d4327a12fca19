//! The executor's sans-IO core: fencing, the operation-dedup table, the
//! one-running-operation-per-attempt rule, deadlines, unacknowledged results and
//! bootstrap observations.
//!
//! [`ExecutorCore`] is a deterministic state machine in the quinn-proto style. It
//! reads no clock and does no I/O: inputs arrive through methods with `now` as an
//! argument, outputs leave as [`Output`] values, and [`ExecutorCore::poll_timeout`]
//! says when [`ExecutorCore::handle_timeout`] must next be called. The tokio shell
//! around it starts and aborts backend calls as the outputs say and feeds their
//! outcomes back through [`ExecutorCore::complete`].
//!
//! Every map is a `BTreeMap` so that anything iterated into an output comes out in
//! the same order for the same inputs.

use std::collections::{BTreeMap, BTreeSet, VecDeque, btree_map};

use crate::retired::Retired;
use contract::{
    AttemptId, BootstrapStage, Change, Claim, Effect, Epoch, LogicalNodeId, Observation, Operation,
    OperationId, OperationResult, Outcome, Rejection, RejectionReason, ResourceChange, ResourceIdentity,
    RunUid, SessionId, TraceContext, UnixMillis,
};

/// Reason of the `Retryable` result of an operation whose deadline passed before
/// it could start: nothing was attempted, so the failure is definite.
pub const REASON_EXPIRED_BEFORE_START: &str = "deadline passed before the operation started";

/// Reason of the `Ambiguous` result of an operation abandoned at its deadline
/// while the backend call was still out.
pub const REASON_ABANDONED: &str = "deadline passed; the effect may or may not have happened";

/// What the core asks of its shell.
#[must_use]
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Run this operation against the backend and report its outcome through
    /// [`ExecutorCore::complete`].
    Start(Operation),
    /// Cancel the backend call of an operation the core has abandoned; its outcome
    /// may still be reported and comes out as a late result.
    Abort { run_uid: RunUid, id: OperationId },
    /// Send this result to the driver.
    Result(OperationResult),
    /// Send this rejection to the driver.
    Rejected(Rejection),
    /// Send this bootstrap observation to the driver.
    Observation(Observation),
    /// Send this resource change (a lost resource) to the driver.
    ResourceChange(ResourceChange),
}

/// A change to what the executor keeps across its own restart, for its shell
/// to write before it sends the outputs that depend on it.
#[derive(Debug, Clone, PartialEq)]
pub enum DurableChange {
    /// A run's fencing epoch and retired attempts: every retired id as
    /// ranges, and the digests of the recent ones (see [`crate::retired`]).
    Run {
        run_uid: RunUid,
        highest_epoch: Option<Epoch>,
        retired: Vec<RetiredAttempt>,
        retired_ranges: Vec<(AttemptId, AttemptId)>,
    },
    /// One completed operation's record: `Some` replaces what is kept for the
    /// operation, `None` drops it. Only records that changed are written, so a
    /// step costs the store what it changed, not what its attempts hold.
    Op {
        run_uid: RunUid,
        id: OperationId,
        record: Option<Box<DurableOp>>,
    },
    /// Every operation record of the run is dropped (the run record stays).
    ForgetOps { run_uid: RunUid },
}

/// A completed operation as the executor keeps it: the digest a
/// resubmission is compared by, and the result it is answered with. The
/// operation itself is not kept (it can never run again), so neither are its
/// template and sealed secrets.
#[derive(Debug, Clone, PartialEq)]
pub struct DurableOp {
    /// [`input_digest`] of the operation.
    pub input_digest: u64,
    pub result: OperationResult,
}

/// Everything kept for one run, for [`ExecutorCore::restore`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DurableRun {
    pub highest_epoch: Option<Epoch>,
    /// The recently retired attempts, with their operations' digests.
    pub retired: Vec<RetiredAttempt>,
    /// Every retired attempt id, as inclusive ranges.
    pub retired_ranges: Vec<(AttemptId, AttemptId)>,
    pub ops: Vec<DurableOp>,
}

/// What is left of a cleaned-up attempt: the sequence numbers it used and a
/// digest of each one's input, so that a resubmitted old id is still told
/// apart from the same id with other input.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RetiredAttempt {
    pub attempt: AttemptId,
    pub ops: Vec<(u32, u64)>,
}

/// A stable 64-bit FNV-1a hasher: digests are kept across restarts, so they
/// must not depend on the standard library's unspecified hasher.
#[derive(Debug)]
struct Fnv(u64);

impl std::hash::Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// A digest of what the dedup comparison compares (`Operation::same_input`).
pub fn input_digest(op: &Operation) -> u64 {
    use contract::OperationInput as I;
    use std::hash::{Hash, Hasher};
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    op.run_uid.hash(&mut h);
    op.run_id.hash(&mut h);
    op.node.hash(&mut h);
    op.id.hash(&mut h);
    let params = |p: &contract::Params, h: &mut Fnv| {
        for (k, v) in p {
            k.hash(h);
            v.value.hash(h);
            v.secret.hash(h);
        }
        h.write_u8(0xff);
    };
    match &op.input {
        I::CreateLease { template: t } => {
            h.write_u8(1);
            t.role.hash(&mut h);
            t.image.hash(&mut h);
            let p = &t.provider;
            p.name.hash(&mut h);
            p.machine_type.hash(&mut h);
            p.cpu.to_bits().hash(&mut h);
            p.memory_gib.to_bits().hash(&mut h);
            for a in &p.accelerators {
                a.kind.hash(&mut h);
                a.count.hash(&mut h);
            }
            p.zone.hash(&mut h);
            p.labels.hash(&mut h);
            params(&t.boot, &mut h);
            params(&t.join, &mut h);
        }
        I::LookupEndpoint { lease } => {
            h.write_u8(2);
            lease.as_str().hash(&mut h);
        }
        I::StartBootstrap {
            lease,
            endpoint,
            boot,
            join,
        } => {
            h.write_u8(3);
            lease.as_str().hash(&mut h);
            endpoint.as_str().hash(&mut h);
            params(boot, &mut h);
            params(join, &mut h);
        }
        I::CancelBootstrap { session } => {
            h.write_u8(4);
            session.as_ref().map(|s| s.as_str()).hash(&mut h);
        }
        I::DestroyLease { lease } => {
            h.write_u8(5);
            lease.as_ref().map(|l| l.as_str()).hash(&mut h);
        }
    }
    h.finish()
}

/// A completed operation's recorded result, as compact as the dedup table
/// needs it: the run and the operation id are the table's keys, and the
/// trace is kept only while the result is owed or a late completion may
/// still come (a replay joins the resubmission's trace).
#[derive(Debug, Clone)]
struct Completed {
    /// [`input_digest`] of the operation.
    input_digest: u64,
    node: LogicalNodeId,
    outcome: Outcome,
    completed_at: UnixMillis,
    trace: Option<Box<TraceContext>>,
    effect: Effect,
    acked: bool,
    /// The core abandoned the operation at its deadline while the backend call was
    /// out, so one late completion may still arrive; it is reported once.
    awaiting_late: bool,
    /// Restored from the store and not sent since: the previous incarnation
    /// may have stopped before it sent the result at all, so the first
    /// answer to a resubmission is the result re-sent, not a replay of one
    /// the driver has seen.
    restored: bool,
}

impl Completed {
    fn new(result: OperationResult, input_digest: u64, acked: bool) -> Self {
        let trace = (result.trace != TraceContext::default()).then(|| Box::new(result.trace));
        Self {
            input_digest,
            node: result.node,
            outcome: result.outcome,
            completed_at: result.completed_at,
            trace,
            effect: result.effect,
            acked,
            awaiting_late: false,
            restored: false,
        }
    }

    /// What is written of it. Neither its trace nor whether the driver has
    /// acknowledged it: after a restart a result is sent only to answer a
    /// resubmission, and then in the resubmission's trace (see
    /// [`ExecutorCore::restore`]).
    fn durable(&self, run_uid: RunUid, id: OperationId) -> DurableOp {
        let mut result = self.result(run_uid, id);
        result.trace = TraceContext::default();
        DurableOp {
            input_digest: self.input_digest,
            result,
        }
    }

    /// The recorded result of operation `id` of run `run_uid`.
    fn result(&self, run_uid: RunUid, id: OperationId) -> OperationResult {
        OperationResult {
            run_uid,
            node: self.node.clone(),
            id,
            effect: self.effect,
            outcome: self.outcome.clone(),
            completed_at: self.completed_at,
            late: false,
            replayed: false,
            trace: self.trace.as_deref().cloned().unwrap_or_default(),
        }
    }
}

/// One row of the dedup table: a word and a tag, so that the table's nodes
/// stay small however many operations it holds (a leaf of eleven rows and
/// their ids takes a 384-byte allocation; with the input and the state apart,
/// two words a row, it took 640).
///
/// The whole operation is kept while it may still run (queued or running).
/// Once it has completed it can never run again: a resubmission is answered
/// with the recorded result, so only the digest that a resubmission is
/// compared by is kept (in its [`Completed`] record), and an attempt's
/// completed operations cost their results, not their templates.
#[derive(Debug, Clone)]
enum OpEntry {
    /// Waiting its attempt's turn, or (`running`) out at the backend.
    Pending {
        op: Box<Operation>,
        running: bool,
    },
    Completed(Box<Completed>),
}

// A row stays a word and a tag: a field added beside the box would take
// every node of every run's table to the next allocation size.
const _: () = assert!(std::mem::size_of::<OpEntry>() <= 2 * std::mem::size_of::<usize>());

impl OpEntry {
    fn new(op: Operation) -> Self {
        OpEntry::Pending {
            op: Box::new(op),
            running: false,
        }
    }

    /// The whole operation, while it may still run.
    fn whole(&self) -> Option<&Operation> {
        match self {
            OpEntry::Pending { op, .. } => Some(op),
            OpEntry::Completed(_) => None,
        }
    }

    fn digest(&self) -> u64 {
        match self {
            OpEntry::Pending { op, .. } => input_digest(op),
            OpEntry::Completed(done) => done.input_digest,
        }
    }

    /// Whether `op` is a resubmission of this one (`Operation::same_input`).
    fn same(&self, op: &Operation) -> bool {
        match self {
            OpEntry::Pending { op: kept, .. } => op.same_input(kept),
            OpEntry::Completed(done) => input_digest(op) == done.input_digest,
        }
    }

    fn completed_mut(&mut self) -> Option<&mut Completed> {
        match self {
            OpEntry::Completed(done) => Some(done),
            OpEntry::Pending { .. } => None,
        }
    }
}

/// The running operation of one attempt and those waiting their turn, FIFO.
#[derive(Debug, Clone, Default)]
struct AttemptLane {
    running: Option<OperationId>,
    queue: VecDeque<OperationId>,
}

/// The sequence counter and unacknowledged observations of one bootstrap session.
#[derive(Debug, Clone)]
struct SessionLog {
    attempt: AttemptId,
    next_seq: u64,
    /// In sequence order (a session's sequence only grows, and the driver
    /// acknowledges up to a sequence), each without what the log and its keys
    /// already say. Given back (`Vec::new`, no allocation) once empty: a
    /// `BTreeMap` here held a node of eleven whole observations, about a
    /// kilobyte, for every session with one stage outstanding.
    unacked: Vec<Unacked>,
    /// Stages that arrived while the `StartBootstrap` that opened the session
    /// was still running. They are held until its result has gone out: a
    /// driver folds observations only into a session it knows, and it learns
    /// the session from that result.
    held: bool,
    /// A terminal stage has been recorded. Once it is acknowledged the log
    /// is forgotten (see [`ExecutorCore::ack_observations`]).
    ended: bool,
}

/// One unacknowledged observation of a session, as its [`SessionLog`] keeps it.
#[derive(Debug, Clone)]
struct Unacked {
    seq: u64,
    at: UnixMillis,
    stage: BootstrapStage,
    node: LogicalNodeId,
    detail: Box<str>,
    trace: Option<Box<TraceContext>>,
}

impl SessionLog {
    /// Observation `u` of this log, session `session` of run `run_uid`.
    fn observation(&self, run_uid: RunUid, session: &SessionId, u: &Unacked) -> Observation {
        Observation {
            run_uid,
            node: u.node.clone(),
            attempt: self.attempt,
            session: session.clone(),
            seq: u.seq,
            stage: u.stage,
            detail: u.detail.to_string(),
            at: u.at,
            trace: u.trace.as_deref().cloned().unwrap_or_default(),
        }
    }

    /// Every unacknowledged observation of the log, in sequence order.
    fn observations<'a>(
        &'a self,
        run_uid: RunUid,
        session: &'a SessionId,
    ) -> impl Iterator<Item = Observation> + 'a {
        self.unacked
            .iter()
            .map(move |u| self.observation(run_uid, session, u))
    }
}

/// Everything the core knows of one run.
#[derive(Debug, Clone, Default)]
struct RunState {
    /// `None` until the run is claimed. Observations can arrive for a run that no
    /// driver has claimed yet (after an executor restart), and they are kept.
    highest_epoch: Option<Epoch>,
    ops: BTreeMap<OperationId, OpEntry>,
    /// Only attempts with a running or queued operation have a lane.
    lanes: BTreeMap<AttemptId, AttemptLane>,
    /// Deadlines of the queued and running operations, earliest first, so the
    /// next timeout is found without scanning the dedup table.
    deadlines: BTreeSet<(UnixMillis, OperationId)>,
    unacked: BTreeSet<OperationId>,
    /// Attempts whose lease was destroyed and whose records were pruned.
    retired: Retired,
    sessions: BTreeMap<SessionId, SessionLog>,
    /// Each attempt's sessions (an attempt has few), so that an attempt's
    /// start result or retirement reaches its sessions without scanning
    /// every session of the run (a scan per attempt is quadratic in a
    /// rollout of 100,000 nodes).
    sessions_of: BTreeMap<AttemptId, Vec<SessionId>>,
    /// Resource changes by sequence number, kept until acknowledged; the next
    /// one gets `next_change_seq` (from 1).
    resource_changes: BTreeMap<u64, ResourceChange>,
    next_change_seq: u64,
    /// Operations whose durable record (a completed operation, its result and
    /// whether it was acknowledged) changed or went since `take_changes`.
    /// Queued and running operations are not kept, so their moves are not
    /// changes.
    changed: BTreeSet<OperationId>,
}

impl RunState {
    /// Sends the stages held back while an attempt's `StartBootstrap` ran, now
    /// that its result has gone out first.
    fn release_held(&mut self, run_uid: RunUid, attempt: AttemptId, out: &mut Vec<Output>) {
        let Some(ids) = self.sessions_of.get(&attempt) else {
            return;
        };
        for id in ids {
            if let Some(log) = self.sessions.get_mut(id)
                && log.attempt == attempt
                && log.held
            {
                log.held = false;
                out.extend(log.observations(run_uid, id).map(Output::Observation));
            }
        }
    }

    fn rejection(
        &self,
        run_uid: RunUid,
        id: Option<OperationId>,
        reason: RejectionReason,
        message: String,
    ) -> Rejection {
        Rejection {
            run_uid,
            id,
            reason,
            message,
            highest_epoch: self.highest_epoch.unwrap_or_default(),
        }
    }

    /// Records `outcome` as the result of a queued or running operation and
    /// returns it. The caller keeps the attempt's lane consistent.
    fn finish(&mut self, id: OperationId, outcome: Outcome, now: UnixMillis) -> Option<OperationResult> {
        let entry = self.ops.get_mut(&id)?;
        let op = entry.whole()?;
        let result = OperationResult {
            run_uid: op.run_uid,
            node: op.node.clone(),
            id,
            effect: op.input.effect(),
            outcome,
            completed_at: now,
            late: false,
            replayed: false,
            trace: op.trace.clone(),
        };
        self.deadlines.remove(&(op.deadline, id));
        let digest = input_digest(op);
        *entry = OpEntry::Completed(Box::new(Completed::new(result.clone(), digest, false)));
        self.unacked.insert(id);
        self.changed.insert(id);
        Some(result)
    }

    fn expire_unstarted(&mut self, id: OperationId, now: UnixMillis, out: &mut Vec<Output>) {
        let outcome = Outcome::Retryable {
            reason: REASON_EXPIRED_BEFORE_START.to_owned(),
        };
        if let Some(result) = self.finish(id, outcome, now) {
            out.push(Output::Result(result));
        }
    }

    /// Starts the next queued operation of an idle attempt. Queued operations
    /// whose deadline has passed complete as `Retryable` instead: they were never
    /// attempted, so their failure is definite.
    fn start_next(&mut self, attempt: AttemptId, now: UnixMillis, out: &mut Vec<Output>) {
        loop {
            let Some(lane) = self.lanes.get_mut(&attempt) else {
                return;
            };
            if lane.running.is_some() {
                return;
            }
            let Some(next) = lane.queue.pop_front() else {
                // An idle lane holds nothing worth keeping.
                self.lanes.remove(&attempt);
                return;
            };
            let Some(OpEntry::Pending { op, running }) = self.ops.get_mut(&next) else {
                continue;
            };
            if op.deadline <= now {
                self.expire_unstarted(next, now, out);
                continue;
            }
            *running = true;
            let op = Operation::clone(op);
            lane.running = Some(next);
            out.push(Output::Start(op));
            return;
        }
    }

    /// Frees the attempt of `id` if `id` is its running operation.
    fn release(&mut self, attempt: AttemptId, id: OperationId) {
        if let Some(lane) = self.lanes.get_mut(&attempt)
            && lane.running == Some(id)
        {
            lane.running = None;
        }
    }

    /// Drops every completed and acknowledged record of a cleaned-up attempt and
    /// remembers the attempt as retired.
    ///
    /// Without this the dedup table would grow with every attempt a run ever had.
    /// A successful `DestroyLease` whose result the driver has acknowledged is the
    /// attempt's last effect: the driver marks the node destroyed and never sends
    /// the attempt another operation, so its records can no longer be replayed
    /// usefully. The attempt id stays in `retired` (a few bytes per attempt, freed
    /// by `forget_run`) so that a stray resubmitted create for it is refused
    /// instead of making a lease nobody will ever destroy. Records not yet
    /// acknowledged stay until they are, and are dropped then.
    fn retire(&mut self, attempt: AttemptId) {
        let range = OperationId::new(attempt, 0)..=OperationId::new(attempt, u32::MAX);
        let digests = self
            .ops
            .range(range.clone())
            .map(|(id, e)| (id.seq(), e.digest()))
            .collect();
        self.retired.retire(attempt, digests);
        let done: Vec<OperationId> = self
            .ops
            .range(range)
            .filter(|(_, e)| matches!(e, OpEntry::Completed(c) if c.acked))
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            self.ops.remove(&id);
            self.changed.insert(id);
        }
        // Sessions of the attempt with nothing left to acknowledge go too. A late
        // observation of a retired attempt would then restart its session's
        // sequence at 1, which is harmless: the driver discards every fact of a
        // retired attempt.
        if let Some(ids) = self.sessions_of.remove(&attempt) {
            let mut kept = Vec::new();
            for id in ids {
                match self.sessions.get(&id) {
                    Some(log) if !log.unacked.is_empty() => kept.push(id),
                    Some(_) => {
                        self.sessions.remove(&id);
                    }
                    None => {}
                }
            }
            if !kept.is_empty() {
                self.sessions_of.insert(attempt, kept);
            }
        }
    }

    /// Forgets a session (its attempt's index too).
    fn remove_session(&mut self, id: &SessionId) {
        if let Some(log) = self.sessions.remove(id)
            && let Some(ids) = self.sessions_of.get_mut(&log.attempt)
        {
            ids.retain(|s| s != id);
            if ids.is_empty() {
                self.sessions_of.remove(&log.attempt);
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.highest_epoch.is_none()
            && self.ops.is_empty()
            && self.sessions.is_empty()
            && self.resource_changes.is_empty()
    }
}

/// The executor's deterministic state machine; see the module documentation.
#[derive(Debug, Clone, Default)]
pub struct ExecutorCore {
    runs: BTreeMap<RunUid, RunState>,
    /// Runs whose epoch or retired set changed since `take_changes`. The
    /// operation records that changed are in each run's `changed`.
    dirty_runs: BTreeSet<RunUid>,
    forgotten: BTreeSet<RunUid>,
}

impl ExecutorCore {
    pub fn new() -> Self {
        Self::default()
    }

    /// A driver takes ownership of a run at `claim.epoch`. The highest epoch seen
    /// per run wins; a lower one is fenced. An equal one is accepted, so a driver
    /// that reconnects re-claims its own epoch.
    pub fn claim(&mut self, claim: &Claim) -> Result<(), Rejection> {
        let run = self.runs.entry(claim.run_uid).or_default();
        match run.highest_epoch {
            Some(highest) if claim.epoch < highest => Err(run.rejection(
                claim.run_uid,
                None,
                RejectionReason::Fenced,
                format!(
                    "claim at epoch {} for run {} is fenced: epoch {highest} has claimed it",
                    claim.epoch, claim.run_uid
                ),
            )),
            _ => {
                if run.highest_epoch != Some(claim.epoch) {
                    run.highest_epoch = Some(claim.epoch);
                    self.dirty_runs.insert(claim.run_uid);
                }
                Ok(())
            }
        }
    }

    /// Accepts an operation from the driver: rejects it, replays its recorded
    /// result, queues it behind its attempt's running operation, or starts it.
    #[must_use]
    pub fn submit(&mut self, op: Operation, now: UnixMillis) -> Vec<Output> {
        let mut out = Vec::new();
        let run_uid = op.run_uid;
        let id = op.id;
        let Some(run) = self.runs.get_mut(&run_uid) else {
            let rejection = Rejection {
                run_uid,
                id: Some(id),
                reason: RejectionReason::UnknownRun,
                message: format!("run {run_uid} has not been claimed"),
                highest_epoch: Epoch::default(),
            };
            out.push(Output::Rejected(rejection));
            return out;
        };
        let fence = match run.highest_epoch {
            None => Some((
                RejectionReason::UnknownRun,
                format!("run {run_uid} has not been claimed"),
            )),
            Some(highest) if op.epoch > highest => Some((
                RejectionReason::UnknownRun,
                format!(
                    "run {run_uid} has not been claimed at epoch {}; the highest claim is {highest}",
                    op.epoch
                ),
            )),
            Some(highest) if op.epoch < highest => Some((
                RejectionReason::Fenced,
                format!(
                    "operation {id} of run {run_uid} carries epoch {}, fenced by epoch {highest}",
                    op.epoch
                ),
            )),
            Some(_) => None,
        };
        if let Some((reason, message)) = fence {
            out.push(Output::Rejected(run.rejection(
                run_uid,
                Some(id),
                reason,
                message,
            )));
            return out;
        }

        if let Some(existing) = run.ops.get_mut(&id) {
            if !existing.same(&op) {
                let message = format!(
                    "operation {id} of run {run_uid} was already submitted with another node or input"
                );
                let rejection = Rejection {
                    run_uid,
                    id: Some(id),
                    reason: RejectionReason::ConflictingInput,
                    message,
                    highest_epoch: run.highest_epoch.unwrap_or_default(),
                };
                out.push(Output::Rejected(rejection));
                return out;
            }
            if let OpEntry::Completed(done) = existing {
                // The driver did not see the result, or saw it and restarted
                // before folding it: it is owed again until acknowledged.
                // Whether it is owed is not written (see `restore`).
                done.acked = false;
                run.unacked.insert(id);
                let mut replay = done.result(run_uid, id);
                replay.replayed = !std::mem::take(&mut done.restored);
                // The replay answers the resubmission, so it joins that trace.
                replay.trace = op.trace;
                out.push(Output::Result(replay));
            }
            // A queued or running operation's result is still to come.
            return out;
        }

        let attempt = id.attempt();
        // The digest is computed here only for an id its retired attempt
        // used: an operation that runs is digested once, when it settles.
        let used = run.retired.digest(id);
        if used.is_some_and(|d| d != input_digest(&op)) {
            let message = format!(
                "operation {id} of run {run_uid} was already used by its cleaned-up attempt with other input"
            );
            out.push(Output::Rejected(run.rejection(
                run_uid,
                Some(id),
                RejectionReason::ConflictingInput,
                message,
            )));
            return out;
        }
        if run.retired.contains(attempt) && op.input.effect().is_destructive() {
            // The attempt's lease is gone: a cancel or destroy for it (a retry
            // after the driver gave up waiting on the first) finds nothing,
            // and "already absent" is success. Nothing runs.
            run.retired.record(id, input_digest(&op));
            self.dirty_runs.insert(run_uid);
            run.ops.insert(id, OpEntry::new(op));
            if let Some(result) = run.finish(id, Outcome::Succeeded(Default::default()), now) {
                out.push(Output::Result(result));
            }
            return out;
        }
        if run.retired.contains(attempt) {
            let message = format!(
                "attempt {attempt} of run {run_uid} was cleaned up (its lease was destroyed); \
                 operation {id} is refused"
            );
            out.push(Output::Rejected(run.rejection(
                run_uid,
                Some(id),
                RejectionReason::Invalid,
                message,
            )));
            return out;
        }

        let deadline = op.deadline;
        run.ops.insert(id, OpEntry::new(op));
        if deadline <= now {
            run.expire_unstarted(id, now, &mut out);
            return out;
        }
        run.deadlines.insert((deadline, id));
        let lane = run.lanes.entry(attempt).or_default();
        lane.queue.push_back(id);
        run.start_next(attempt, now, &mut out);
        out
    }

    /// The backend finished an operation the core started.
    #[must_use]
    pub fn complete(
        &mut self,
        run_uid: RunUid,
        id: OperationId,
        outcome: Outcome,
        now: UnixMillis,
    ) -> Vec<Output> {
        let mut out = Vec::new();
        let Some(run) = self.runs.get_mut(&run_uid) else {
            return out;
        };
        let Some(entry) = run.ops.get_mut(&id) else {
            return out;
        };
        match entry {
            OpEntry::Pending { running: true, .. } => {
                if let Some(result) = run.finish(id, outcome, now) {
                    out.push(Output::Result(result));
                }
                run.release_held(run_uid, id.attempt(), &mut out);
                run.release(id.attempt(), id);
                run.start_next(id.attempt(), now, &mut out);
            }
            OpEntry::Completed(done) if done.awaiting_late => {
                // The recorded ambiguous result stays the dedup record: the driver
                // may already have acted on it, and a replay must not change.
                done.awaiting_late = false;
                out.push(Output::Result(OperationResult {
                    outcome,
                    completed_at: now,
                    late: true,
                    ..done.result(run_uid, id)
                }));
            }
            // A queued operation was never started, and a completed one has
            // already been reported: either is a confused shell, and ignored.
            OpEntry::Pending { running: false, .. } | OpEntry::Completed(_) => {}
        }
        out
    }

    /// The earliest deadline among running and queued operations: when
    /// [`ExecutorCore::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<UnixMillis> {
        self.runs
            .values()
            .filter_map(|run| run.deadlines.first().map(|(at, _)| *at))
            .min()
    }

    /// Moves the deadline of every queued and running operation by `by_ms`
    /// (later when positive), after the shell saw the wall clock step by
    /// that much against the monotonic one. A step forward then abandons
    /// nothing that still had time, and a step back leaves no operation
    /// waiting for the step's length: each keeps the time it had left.
    /// Completed operations keep theirs (nothing reads it again). Returns
    /// how many operations moved.
    pub fn shift_deadlines(&mut self, by_ms: i64) -> usize {
        let mut moved = 0;
        for run in self.runs.values_mut() {
            let before = std::mem::take(&mut run.deadlines);
            for (deadline, id) in before {
                let at = deadline.shifted(by_ms);
                if let Some(OpEntry::Pending { op, .. }) = run.ops.get_mut(&id) {
                    op.deadline = at;
                }
                run.deadlines.insert((at, id));
                moved += 1;
            }
        }
        moved
    }

    /// Abandons every running operation whose deadline has passed (reported
    /// `Ambiguous`, with an `Abort` for the shell) and completes every queued one
    /// past its deadline as `Retryable`; freed attempts start their next operation.
    #[must_use]
    pub fn handle_timeout(&mut self, now: UnixMillis) -> Vec<Output> {
        let mut out = Vec::new();
        for (&run_uid, run) in &mut self.runs {
            while let Some(&(deadline, id)) = run.deadlines.first() {
                if deadline > now {
                    break;
                }
                let attempt = id.attempt();
                match run.ops.get(&id) {
                    Some(OpEntry::Pending { running: true, .. }) => {
                        out.push(Output::Abort { run_uid, id });
                        let outcome = Outcome::Ambiguous {
                            reason: REASON_ABANDONED.to_owned(),
                        };
                        if let Some(result) = run.finish(id, outcome, now) {
                            out.push(Output::Result(result));
                        }
                        if let Some(done) = run.ops.get_mut(&id).and_then(OpEntry::completed_mut) {
                            done.awaiting_late = true;
                        }
                        run.release_held(run_uid, attempt, &mut out);
                        run.release(attempt, id);
                        run.start_next(attempt, now, &mut out);
                    }
                    Some(OpEntry::Pending { running: false, .. }) => {
                        if let Some(lane) = run.lanes.get_mut(&attempt) {
                            lane.queue.retain(|q| *q != id);
                            if lane.running.is_none() && lane.queue.is_empty() {
                                run.lanes.remove(&attempt);
                            }
                        }
                        run.expire_unstarted(id, now, &mut out);
                    }
                    // A stale index entry; `finish` removes them, so this only
                    // guards against looping forever.
                    Some(OpEntry::Completed(_)) | None => {
                        run.deadlines.remove(&(deadline, id));
                    }
                }
            }
        }
        out
    }

    /// The driver has received a result; it is no longer re-sent. Acknowledging a
    /// successful `DestroyLease` retires its attempt (see `RunState::retire`).
    pub fn ack_result(&mut self, run_uid: RunUid, id: OperationId) {
        let Some(run) = self.runs.get_mut(&run_uid) else {
            return;
        };
        let Some(done) = run.ops.get_mut(&id).and_then(OpEntry::completed_mut) else {
            return;
        };
        done.acked = true;
        // The driver has folded the result: a resubmission is answered from
        // it with the resubmission's own trace (a late result still joins
        // this one's).
        if !done.awaiting_late {
            done.trace = None;
        }
        // The acknowledgement itself is not written: a restarted executor
        // owes nothing it has recorded (see `restore`).
        let destroyed = done.effect == Effect::DestroyLease && matches!(done.outcome, Outcome::Succeeded(_));
        run.unacked.remove(&id);
        let attempt = id.attempt();
        if run.retired.contains(attempt) {
            run.ops.remove(&id);
            run.changed.insert(id);
        } else if destroyed {
            run.retire(attempt);
            self.dirty_runs.insert(run_uid);
        }
    }

    /// Completed results the driver has not acknowledged, by run then operation:
    /// what to re-send after the stream reconnects.
    pub fn unacked_results(&self) -> Vec<OperationResult> {
        self.runs
            .iter()
            .flat_map(|(&run_uid, run)| {
                run.unacked.iter().filter_map(move |&id| match run.ops.get(&id)? {
                    OpEntry::Completed(done) => Some(done.result(run_uid, id)),
                    OpEntry::Pending { .. } => None,
                })
            })
            .collect()
    }

    /// One run's completed results the driver has not acknowledged, by
    /// operation: what to re-send when a driver claims the run on a new link.
    pub fn unacked_results_of(&self, run_uid: RunUid) -> Vec<OperationResult> {
        let Some(run) = self.runs.get(&run_uid) else {
            return Vec::new();
        };
        run.unacked
            .iter()
            .filter_map(|&id| match run.ops.get(&id)? {
                OpEntry::Completed(done) => Some(done.result(run_uid, id)),
                OpEntry::Pending { .. } => None,
            })
            .collect()
    }

    /// Sequences a bootstrap stage reported by the backend and keeps it until the
    /// driver acknowledges it. Sequence numbers count from 1 per session.
    pub fn record_observation(
        &mut self,
        identity: &ResourceIdentity,
        session: SessionId,
        stage: BootstrapStage,
        detail: String,
        at: UnixMillis,
        trace: TraceContext,
    ) -> Vec<Output> {
        let run = self.runs.entry(identity.run_uid).or_default();
        let starting = run
            .lanes
            .get(&identity.attempt)
            .and_then(|lane| lane.running)
            .and_then(|id| run.ops.get(&id))
            .and_then(OpEntry::whole)
            .is_some_and(|op| op.input.effect() == contract::Effect::StartBootstrap);
        if !run.sessions.contains_key(&session) {
            // An attempt has one session but for a restart; a vector of one
            // holds one id, where `push` onto an empty one makes room for four.
            match run.sessions_of.entry(identity.attempt) {
                btree_map::Entry::Vacant(v) => {
                    v.insert(vec![session.clone()]);
                }
                btree_map::Entry::Occupied(mut o) => o.get_mut().push(session.clone()),
            }
        }
        let log = run.sessions.entry(session.clone()).or_insert_with(|| SessionLog {
            attempt: identity.attempt,
            next_seq: 1,
            unacked: Vec::new(),
            held: false,
            ended: false,
        });
        let seq = log.next_seq;
        log.next_seq = seq.saturating_add(1);
        let observation = Observation {
            run_uid: identity.run_uid,
            node: identity.node.clone(),
            attempt: identity.attempt,
            session,
            seq,
            stage,
            detail,
            at,
            trace,
        };
        log.unacked.push(Unacked {
            seq,
            at,
            stage,
            node: observation.node.clone(),
            detail: observation.detail.as_str().into(),
            trace: (observation.trace != TraceContext::default())
                .then(|| Box::new(observation.trace.clone())),
        });
        log.ended |= stage.is_terminal();
        if starting {
            log.held = true;
        }
        if log.held {
            Vec::new()
        } else {
            vec![Output::Observation(observation)]
        }
    }

    /// The driver has folded a session's observations up to `upto_seq`.
    ///
    /// A session whose terminal stage is acknowledged is forgotten: nothing
    /// of it is owed, and a live node's ended session would otherwise hold
    /// its log until the attempt retires. A stage recorded for it later (a
    /// provider that reports the end again) starts a new log at sequence 1,
    /// as every session does after an executor restart; the driver discards
    /// it (a stage after the session's end, or one already folded) and
    /// acknowledges it.
    pub fn ack_observations(&mut self, run_uid: RunUid, session: &SessionId, upto_seq: u64) {
        let Some(run) = self.runs.get_mut(&run_uid) else {
            return;
        };
        let Some(log) = run.sessions.get_mut(session) else {
            return;
        };
        let acked = log.unacked.partition_point(|u| u.seq <= upto_seq);
        log.unacked.drain(..acked);
        // An emptied vector keeps its buffer; every converged session would
        // then hold one for good.
        if log.unacked.is_empty() {
            log.unacked = Vec::new();
        }
        if log.unacked.is_empty() && (log.ended || run.retired.contains(log.attempt)) {
            run.remove_session(session);
        }
    }

    /// A session's unacknowledged observations after `after_seq`, in order. Only
    /// unacknowledged ones are kept, which covers every sequence the driver can
    /// ask for: it acknowledges only what it has folded.
    pub fn observations_after(
        &self,
        run_uid: RunUid,
        session: &SessionId,
        after_seq: u64,
    ) -> Vec<Observation> {
        self.runs
            .get(&run_uid)
            .and_then(|run| run.sessions.get(session))
            .filter(|log| !log.held)
            .map(|log| {
                log.unacked
                    .iter()
                    .filter(|u| u.seq > after_seq)
                    .map(|u| log.observation(run_uid, session, u))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every unacknowledged observation, by run, then session, then sequence.
    pub fn unacked_observations(&self) -> Vec<Observation> {
        self.runs
            .iter()
            .flat_map(|(&run_uid, run)| run.sessions.iter().map(move |(id, log)| (run_uid, id, log)))
            .filter(|(_, _, log)| !log.held)
            .flat_map(|(run_uid, id, log)| log.observations(run_uid, id))
            .collect()
    }

    /// One run's unacknowledged observations, by session then sequence.
    pub fn unacked_observations_of(&self, run_uid: RunUid) -> Vec<Observation> {
        self.runs
            .get(&run_uid)
            .map(|run| {
                run.sessions
                    .iter()
                    .filter(|(_, log)| !log.held)
                    .flat_map(|(id, log)| log.observations(run_uid, id))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Sequences a change the backend saw in a resource it holds (the
    /// resource is gone) and keeps it until the driver acknowledges it. A
    /// change of an attempt already cleaned up is dropped: the driver has
    /// nothing left of it to fold.
    pub fn record_resource_change(
        &mut self,
        identity: &ResourceIdentity,
        change: Change,
        at: UnixMillis,
    ) -> Vec<Output> {
        let run = self.runs.entry(identity.run_uid).or_default();
        if run.retired.contains(identity.attempt) {
            return Vec::new();
        }
        run.next_change_seq = run.next_change_seq.max(1);
        let seq = run.next_change_seq;
        run.next_change_seq = seq.saturating_add(1);
        let change = ResourceChange {
            run_uid: identity.run_uid,
            node: identity.node.clone(),
            attempt: identity.attempt,
            seq,
            change,
            at,
            trace: TraceContext::default(),
        };
        run.resource_changes.insert(seq, change.clone());
        vec![Output::ResourceChange(change)]
    }

    /// The driver has folded the run's resource change `seq`.
    pub fn ack_resource_change(&mut self, run_uid: RunUid, seq: u64) {
        if let Some(run) = self.runs.get_mut(&run_uid) {
            run.resource_changes.remove(&seq);
        }
    }

    /// One run's unacknowledged resource changes, in sequence: re-sent on
    /// every claim of the run.
    pub fn unacked_resource_changes_of(&self, run_uid: RunUid) -> Vec<ResourceChange> {
        self.runs
            .get(&run_uid)
            .map(|run| run.resource_changes.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Drops every record of a run (its dedup entries, queues and observations)
    /// but keeps its highest epoch, so fencing survives the forgetting. Running
    /// operations come out as `Abort`s for the shell to cancel; their results are
    /// no longer wanted. A stale epoch is fenced and changes nothing.
    #[must_use]
    pub fn forget_run(&mut self, run_uid: RunUid, epoch: Epoch) -> Vec<Output> {
        let mut out = Vec::new();
        let Some(run) = self.runs.get_mut(&run_uid) else {
            return out;
        };
        if let Some(highest) = run.highest_epoch
            && epoch < highest
        {
            let message = format!("forgetting run {run_uid} at epoch {epoch} is fenced by epoch {highest}");
            out.push(Output::Rejected(run.rejection(
                run_uid,
                None,
                RejectionReason::Fenced,
                message,
            )));
            return out;
        }
        for lane in run.lanes.values() {
            if let Some(id) = lane.running {
                out.push(Output::Abort { run_uid, id });
            }
        }
        let highest_epoch = run.highest_epoch;
        *run = RunState {
            highest_epoch,
            ..RunState::default()
        };
        self.forgotten.insert(run_uid);
        self.dirty_runs.insert(run_uid);
        if run.is_empty() {
            self.runs.remove(&run_uid);
        }
        out
    }

    /// What changed in the durable part of the state since the last call: the
    /// shell writes these before it sends the outputs of the same step, so a
    /// result the driver may have seen is one a restarted executor replays.
    pub fn take_changes(&mut self) -> Vec<DurableChange> {
        let mut changes: Vec<DurableChange> = std::mem::take(&mut self.forgotten)
            .into_iter()
            .map(|run_uid| DurableChange::ForgetOps { run_uid })
            .collect();
        for run_uid in std::mem::take(&mut self.dirty_runs) {
            let (highest_epoch, retired, retired_ranges) = self
                .runs
                .get(&run_uid)
                .map(|r| {
                    let retired = r
                        .retired
                        .recent()
                        .map(|(attempt, ops)| RetiredAttempt {
                            attempt,
                            ops: ops.iter().map(|(s, d)| (*s, *d)).collect(),
                        })
                        .collect();
                    (r.highest_epoch, retired, r.retired.ranges().collect())
                })
                .unwrap_or_default();
            changes.push(DurableChange::Run {
                run_uid,
                highest_epoch,
                retired,
                retired_ranges,
            });
        }
        for (&run_uid, run) in &mut self.runs {
            for id in std::mem::take(&mut run.changed) {
                let record = run.ops.get(&id).and_then(|e| match e {
                    OpEntry::Completed(c) => Some(Box::new(c.durable(run_uid, id))),
                    OpEntry::Pending { .. } => None,
                });
                changes.push(DurableChange::Op { run_uid, id, record });
            }
        }
        changes
    }

    /// Every completed operation's durable record, as a full write would
    /// store them: what the changes of `take_changes` must add up to.
    #[cfg(test)]
    fn durable_records(&self) -> BTreeMap<(RunUid, OperationId), DurableOp> {
        let mut out = BTreeMap::new();
        for (&run_uid, run) in &self.runs {
            for (&id, e) in &run.ops {
                if let OpEntry::Completed(c) = e {
                    out.insert((run_uid, id), c.durable(run_uid, id));
                }
            }
        }
        out
    }

    /// Drops the record of changes, for a shell that keeps nothing durable.
    pub fn clear_changes(&mut self) {
        self.forgotten.clear();
        self.dirty_runs.clear();
        for run in self.runs.values_mut() {
            run.changed.clear();
        }
    }

    /// A core rebuilt from what a previous incarnation kept: fencing epochs,
    /// retired attempts and completed operations (replayed on resubmission).
    /// Nothing is running after a restart; a resubmitted operation that had not
    /// completed runs again, and the backend adopts what the first run made.
    ///
    /// A restored result is owed to nobody: the driver resubmits every
    /// operation it still holds pending when its link comes back (SPEC
    /// section 4), and the resubmission replays the result. So an
    /// acknowledgement is never written (one write an operation, not two),
    /// and a restart does not send the driver every result it has already
    /// folded. Two kinds are owed again, as every result was before: a
    /// successful `DestroyLease` (its acknowledgement retires the attempt,
    /// and removes the attempt's records from the store) and a record of an
    /// attempt already retired (its acknowledgement removes it). Both stay
    /// on record only until acknowledged.
    pub fn restore(runs: impl IntoIterator<Item = (RunUid, DurableRun)>) -> Self {
        let mut core = Self::default();
        for (run_uid, d) in runs {
            let mut run = RunState {
                highest_epoch: d.highest_epoch,
                retired: Retired::restore(
                    d.retired_ranges,
                    d.retired
                        .into_iter()
                        .map(|r| (r.attempt, r.ops.into_iter().collect())),
                ),
                ..RunState::default()
            };
            for o in d.ops {
                let id = o.result.id;
                // The two kinds still owed (see above).
                let owed = run.retired.contains(id.attempt())
                    || (o.result.effect == Effect::DestroyLease
                        && matches!(o.result.outcome, Outcome::Succeeded(_)));
                if owed {
                    run.unacked.insert(id);
                }
                let mut done = Completed::new(o.result, o.input_digest, !owed);
                done.restored = !owed;
                run.ops.insert(id, OpEntry::Completed(Box::new(done)));
            }
            core.runs.insert(run_uid, run);
        }
        core
    }

    /// Operations currently running, across all runs.
    pub fn running_count(&self) -> usize {
        self.runs
            .values()
            .flat_map(|run| run.lanes.values())
            .filter(|lane| lane.running.is_some())
            .count()
    }

    /// Operations waiting for their attempt to become free, across all runs.
    pub fn queued_count(&self) -> usize {
        self.runs
            .values()
            .flat_map(|run| run.lanes.values())
            .map(|lane| lane.queue.len())
            .sum()
    }

    /// Rows of the dedup table, across all runs.
    pub fn entry_count(&self) -> usize {
        self.runs.values().map(|run| run.ops.len()).sum()
    }

    pub fn highest_epoch(&self, run_uid: RunUid) -> Option<Epoch> {
        self.runs.get(&run_uid).and_then(|run| run.highest_epoch)
    }

    pub fn is_running(&self, run_uid: RunUid, attempt: AttemptId) -> bool {
        self.runs
            .get(&run_uid)
            .and_then(|run| run.lanes.get(&attempt))
            .is_some_and(|lane| lane.running.is_some())
    }

    pub fn is_retired(&self, run_uid: RunUid, attempt: AttemptId) -> bool {
        self.runs
            .get(&run_uid)
            .is_some_and(|run| run.retired.contains(attempt))
    }
}

// Tests panic on purpose when a fixture is malformed or an expectation fails.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use contract::{LeaseId, LogicalNodeId, OperationInput, ResultFacts, RunId, shape::example_template};

    use super::*;

    const RUN: RunUid = RunUid::from_u128(7);

    fn t(ms: u64) -> UnixMillis {
        UnixMillis::new(ms)
    }

    fn claim(core: &mut ExecutorCore, epoch: u64) -> Result<(), Rejection> {
        core.claim(&Claim {
            run_uid: RUN,
            run_id: RunId::parse("run_id", "train").unwrap(),
            epoch: Epoch::new(epoch),
        })
    }

    fn create() -> OperationInput {
        OperationInput::CreateLease {
            template: Arc::new(example_template("fake", "img:1")),
        }
    }

    fn lease(s: &str) -> LeaseId {
        LeaseId::new("lease", s).unwrap()
    }

    fn op(attempt: u64, seq: u32, epoch: u64, deadline: u64, input: OperationInput) -> Operation {
        Operation {
            run_uid: RUN,
            run_id: RunId::parse("run_id", "train").unwrap(),
            node: LogicalNodeId::parse("node", &format!("workers-{attempt}")).unwrap(),
            id: OperationId::new(AttemptId::new(attempt), seq),
            epoch: Epoch::new(epoch),
            deadline: t(deadline),
            provider: "fake".into(),
            input,
            trace: TraceContext::default(),
        }
    }

    fn claimed() -> ExecutorCore {
        let mut core = ExecutorCore::new();
        claim(&mut core, 1).unwrap();
        core
    }

    fn succeeded() -> Outcome {
        Outcome::Succeeded(ResultFacts {
            lease: Some(lease("lease-1")),
            ..ResultFacts::default()
        })
    }

    fn starts(out: &[Output]) -> Vec<OperationId> {
        out.iter()
            .filter_map(|o| match o {
                Output::Start(op) => Some(op.id),
                _ => None,
            })
            .collect()
    }

    fn results(out: &[Output]) -> Vec<OperationResult> {
        out.iter()
            .filter_map(|o| match o {
                Output::Result(r) => Some(r.clone()),
                _ => None,
            })
            .collect()
    }

    fn rejection(out: &[Output]) -> Rejection {
        match out {
            [Output::Rejected(r)] => r.clone(),
            other => panic!("expected one rejection, got {other:?}"),
        }
    }

    fn id(attempt: u64, seq: u32) -> OperationId {
        OperationId::new(AttemptId::new(attempt), seq)
    }

    #[test]
    fn claims_fence_lower_epochs_and_ops_need_a_claim() {
        let mut core = ExecutorCore::new();
        let out = core.submit(op(1, 0, 1, 100, create()), t(0));
        assert_eq!(rejection(&out).reason, RejectionReason::UnknownRun);

        claim(&mut core, 5).unwrap();
        assert_eq!(core.highest_epoch(RUN), Some(Epoch::new(5)));
        let err = claim(&mut core, 4).unwrap_err();
        assert_eq!(err.reason, RejectionReason::Fenced);
        assert_eq!(err.highest_epoch, Epoch::new(5));
        assert_eq!(err.id, None);
        claim(&mut core, 5).unwrap();
        assert_eq!(core.highest_epoch(RUN), Some(Epoch::new(5)));

        let stale = core.submit(op(1, 0, 4, 100, create()), t(0));
        let r = rejection(&stale);
        assert_eq!(r.reason, RejectionReason::Fenced);
        assert_eq!(r.id, Some(id(1, 0)));
        let ahead = core.submit(op(1, 0, 6, 100, create()), t(0));
        assert_eq!(rejection(&ahead).reason, RejectionReason::UnknownRun);
        assert_eq!(core.running_count(), 0);

        let ok = core.submit(op(1, 0, 5, 100, create()), t(0));
        assert_eq!(starts(&ok), [id(1, 0)]);

        claim(&mut core, 6).unwrap();
        let fenced = core.submit(op(1, 1, 5, 100, create()), t(0));
        assert_eq!(rejection(&fenced).reason, RejectionReason::Fenced);
    }

    #[test]
    fn a_completed_operation_replays_without_starting_again() {
        let mut core = claimed();
        let first = op(1, 0, 1, 100, create());
        assert_eq!(starts(&core.submit(first.clone(), t(0))), [id(1, 0)]);
        let done = core.complete(RUN, id(1, 0), succeeded(), t(10));
        let recorded = results(&done);
        assert_eq!(recorded.len(), 1);
        assert!(!recorded[0].replayed);
        assert_eq!(recorded[0].completed_at, t(10));
        core.ack_result(RUN, id(1, 0));

        // A new driver epoch resubmits with another deadline: still a replay.
        claim(&mut core, 2).unwrap();
        let mut again = first;
        again.epoch = Epoch::new(2);
        again.deadline = t(500);
        let out = core.submit(again, t(20));
        assert!(starts(&out).is_empty());
        let replay = results(&out);
        assert_eq!(replay.len(), 1);
        assert!(replay[0].replayed);
        assert_eq!(replay[0].outcome, succeeded());
        assert_eq!(replay[0].completed_at, t(10));
        assert_eq!(core.running_count(), 0);
        // The replay is owed again until acknowledged.
        assert_eq!(core.unacked_results().len(), 1);
    }

    #[test]
    fn a_completed_operation_keeps_its_digest_and_still_tells_input_apart() {
        let mut core = claimed();
        let first = op(1, 0, 1, 100, create());
        let _ = core.submit(first.clone(), t(0));
        assert!(
            core.runs[&RUN].ops[&id(1, 0)].whole() == Some(&first),
            "a running operation is kept whole"
        );
        let _ = core.complete(RUN, id(1, 0), succeeded(), t(10));
        // Completed, owed to the driver or not: the digest alone, with the result.
        let kept = &core.runs[&RUN].ops[&id(1, 0)];
        assert!(
            kept.whole().is_none(),
            "a completed operation keeps only its digest"
        );
        assert_eq!(kept.digest(), input_digest(&first));
        let changes = core.take_changes();
        assert!(
            changes
                .iter()
                .any(|c| matches!(c, DurableChange::Op { record: Some(r), .. }
                if r.input_digest == input_digest(&first))),
            "{changes:?}"
        );
        let settled = core.durable_records();
        assert_eq!(settled[&(RUN, id(1, 0))].input_digest, input_digest(&first));
        // The acknowledgement is not written.
        core.ack_result(RUN, id(1, 0));
        assert_eq!(core.take_changes(), Vec::new());
        assert_eq!(core.durable_records(), settled);

        // Other input under the same id is still refused ...
        let other = op(1, 0, 1, 100, OperationInput::DestroyLease { lease: None });
        assert_eq!(
            rejection(&core.submit(other, t(20))).reason,
            RejectionReason::ConflictingInput
        );
        // ... and the same input replays the result, in a core restored from
        // the digest alone as in this one.
        let mut restored = ExecutorCore::restore([(
            RUN,
            DurableRun {
                highest_epoch: Some(Epoch::new(1)),
                retired: Vec::new(),
                retired_ranges: Vec::new(),
                ops: settled.into_values().collect(),
            },
        )]);
        // (The restored core's first answer is the result re-sent, its
        // second a replay: it cannot know whether its last incarnation
        // sent the result at all.)
        for (in_restored, replayed) in [(false, true), (true, false), (true, true)] {
            let core = if in_restored { &mut restored } else { &mut core };
            let out = core.submit(first.clone(), t(30));
            assert!(starts(&out).is_empty(), "{out:?}");
            let replay = results(&out);
            assert_eq!(replay.len(), 1, "{out:?}");
            assert_eq!(replay[0].replayed, replayed);
            assert_eq!(replay[0].outcome, succeeded());
            assert_eq!(replay[0].completed_at, t(10));
        }
    }

    #[test]
    fn same_id_with_other_input_is_rejected() {
        let mut core = claimed();
        let _ = core.submit(op(1, 0, 1, 100, create()), t(0));
        let other = op(
            1,
            0,
            1,
            100,
            OperationInput::DestroyLease {
                lease: Some(lease("lease-9")),
            },
        );
        let r = rejection(&core.submit(other, t(1)));
        assert_eq!(r.reason, RejectionReason::ConflictingInput);
        assert_eq!(r.id, Some(id(1, 0)));
        assert_eq!(core.running_count(), 1);
        // A resubmission of the running operation waits for its result.
        assert!(core.submit(op(1, 0, 1, 100, create()), t(2)).is_empty());
    }

    #[test]
    fn a_busy_attempt_queues_its_next_operation() {
        let mut core = claimed();
        let a1 = AttemptId::new(1);
        assert_eq!(starts(&core.submit(op(1, 0, 1, 100, create()), t(0))), [id(1, 0)]);
        let lookup = OperationInput::LookupEndpoint {
            lease: lease("lease-1"),
        };
        let out = core.submit(op(1, 1, 1, 100, lookup), t(1));
        assert!(out.is_empty(), "{out:?}");
        assert!(core.is_running(RUN, a1));
        assert_eq!((core.running_count(), core.queued_count()), (1, 1));
        assert_eq!(core.poll_timeout(), Some(t(100)));

        // Completing the second one before it started is ignored.
        assert!(core.complete(RUN, id(1, 1), succeeded(), t(2)).is_empty());
        assert_eq!((core.running_count(), core.queued_count()), (1, 1));

        let out = core.complete(RUN, id(1, 0), succeeded(), t(3));
        assert_eq!(results(&out)[0].id, id(1, 0));
        assert_eq!(starts(&out), [id(1, 1)]);
        assert_eq!((core.running_count(), core.queued_count()), (1, 0));

        let out = core.complete(RUN, id(1, 1), succeeded(), t(4));
        assert_eq!(results(&out).len(), 1);
        assert!(starts(&out).is_empty());
        assert!(!core.is_running(RUN, a1));
        assert_eq!(core.poll_timeout(), None);
    }

    #[test]
    fn different_attempts_run_concurrently() {
        let mut core = claimed();
        assert_eq!(starts(&core.submit(op(1, 0, 1, 100, create()), t(0))), [id(1, 0)]);
        assert_eq!(starts(&core.submit(op(2, 0, 1, 100, create()), t(0))), [id(2, 0)]);
        assert!(core.is_running(RUN, AttemptId::new(1)));
        assert!(core.is_running(RUN, AttemptId::new(2)));
        assert_eq!(core.running_count(), 2);
    }

    #[test]
    fn an_abandoned_operation_is_ambiguous_and_its_late_result_is_marked() {
        let mut core = claimed();
        let create_op = op(1, 0, 1, 100, create());
        let _ = core.submit(create_op.clone(), t(0));
        let lookup = OperationInput::LookupEndpoint {
            lease: lease("lease-1"),
        };
        let _ = core.submit(op(1, 1, 1, 300, lookup), t(0));
        assert!(core.handle_timeout(t(99)).is_empty());

        let out = core.handle_timeout(t(100));
        assert_eq!(
            out[0],
            Output::Abort {
                run_uid: RUN,
                id: id(1, 0)
            }
        );
        let abandoned = results(&out);
        assert_eq!(abandoned.len(), 1);
        assert_eq!(
            abandoned[0].outcome,
            Outcome::Ambiguous {
                reason: REASON_ABANDONED.to_owned()
            }
        );
        // The attempt is free again, so its queued operation starts.
        assert_eq!(starts(&out), [id(1, 1)]);
        assert_eq!(core.running_count(), 1);

        let late = results(&core.complete(RUN, id(1, 0), succeeded(), t(150)));
        assert_eq!(late.len(), 1);
        assert!(late[0].late);
        assert_eq!(late[0].outcome, succeeded());
        // Only one late result is reported.
        assert!(core.complete(RUN, id(1, 0), succeeded(), t(151)).is_empty());

        let replay = results(&core.submit(create_op, t(200)));
        assert_eq!(replay.len(), 1);
        assert!(replay[0].replayed && !replay[0].late);
        assert!(matches!(replay[0].outcome, Outcome::Ambiguous { .. }));
    }

    #[test]
    fn a_queued_operation_past_its_deadline_fails_without_starting() {
        let mut core = claimed();
        let _ = core.submit(op(1, 0, 1, 500, create()), t(0));
        let lookup = OperationInput::LookupEndpoint {
            lease: lease("lease-1"),
        };
        let _ = core.submit(op(1, 1, 1, 50, lookup.clone()), t(0));
        assert_eq!(core.poll_timeout(), Some(t(50)));

        let out = core.handle_timeout(t(60));
        assert!(starts(&out).is_empty());
        let expired = results(&out);
        assert_eq!(expired.len(), 1);
        assert_eq!(expired[0].id, id(1, 1));
        assert_eq!(
            expired[0].outcome,
            Outcome::Retryable {
                reason: REASON_EXPIRED_BEFORE_START.to_owned()
            }
        );
        assert_eq!((core.running_count(), core.queued_count()), (1, 0));
        assert_eq!(core.poll_timeout(), Some(t(500)));

        // One that expires while queued is skipped when its turn comes.
        let _ = core.submit(op(1, 2, 1, 70, lookup.clone()), t(60));
        let out = core.complete(RUN, id(1, 0), succeeded(), t(80));
        assert!(starts(&out).is_empty());
        let rs = results(&out);
        assert_eq!(rs.iter().map(|r| r.id).collect::<Vec<_>>(), [id(1, 0), id(1, 2)]);
        assert!(matches!(rs[1].outcome, Outcome::Retryable { .. }));

        // And one submitted already past its deadline never starts.
        let out = core.submit(op(2, 0, 1, 80, create()), t(80));
        assert!(starts(&out).is_empty());
        assert!(matches!(results(&out)[0].outcome, Outcome::Retryable { .. }));
        assert_eq!(core.running_count(), 0);
    }

    #[test]
    fn deadlines_follow_a_step_of_the_wall_clock() {
        let mut core = claimed();
        let _ = core.submit(op(1, 0, 1, 500, create()), t(0));
        let lookup = OperationInput::LookupEndpoint {
            lease: lease("lease-1"),
        };
        let _ = core.submit(op(1, 1, 1, 600, lookup), t(0));
        let hour = 3_600_000;

        // An hour forward: the running operation keeps the 400 ms it had.
        assert_eq!(core.shift_deadlines(hour), 2);
        assert_eq!(core.poll_timeout(), Some(t(500 + 3_600_000)));
        assert!(core.handle_timeout(t(100 + 3_600_000)).is_empty());
        let out = core.handle_timeout(t(500 + 3_600_000));
        assert!(matches!(results(&out)[0].outcome, Outcome::Ambiguous { .. }));

        // Back by the hour: the queued one, started meanwhile, is not left
        // waiting for an hour.
        assert_eq!(core.shift_deadlines(-hour), 1);
        assert_eq!(core.poll_timeout(), Some(t(600)));
        assert_eq!(core.shift_deadlines(0), 1);
        assert_eq!(core.poll_timeout(), Some(t(600)));
    }

    #[test]
    fn results_stay_unacked_until_acknowledged() {
        let mut core = claimed();
        for attempt in [2, 1] {
            let _ = core.submit(op(attempt, 0, 1, 100, create()), t(0));
            let _ = core.complete(RUN, id(attempt, 0), succeeded(), t(5));
        }
        let ids: Vec<_> = core.unacked_results().iter().map(|r| r.id).collect();
        assert_eq!(ids, [id(1, 0), id(2, 0)]);
        core.ack_result(RUN, id(1, 0));
        let ids: Vec<_> = core.unacked_results().iter().map(|r| r.id).collect();
        assert_eq!(ids, [id(2, 0)]);
        core.ack_result(RUN, id(2, 0));
        assert!(core.unacked_results().is_empty());
    }

    #[test]
    fn resource_changes_are_sequenced_per_run_and_kept_until_acknowledged() {
        let mut core = claimed();
        let lost = |reason: &str| Change::Lost {
            reason: reason.to_owned(),
        };
        let seqs: Vec<u64> = [1, 2]
            .into_iter()
            .flat_map(|attempt| core.record_resource_change(&identity(attempt), lost("exited"), t(3)))
            .map(|o| match o {
                Output::ResourceChange(c) => c.seq,
                other => panic!("expected a resource change, got {other:?}"),
            })
            .collect();
        assert_eq!(seqs, [1, 2]);
        let kept = |core: &ExecutorCore| -> Vec<u64> {
            core.unacked_resource_changes_of(RUN)
                .iter()
                .map(|c| c.seq)
                .collect()
        };
        assert_eq!(kept(&core), [1, 2]);
        core.ack_resource_change(RUN, 1);
        assert_eq!(kept(&core), [2]);
        core.ack_resource_change(RUN, 2);
        assert!(kept(&core).is_empty());

        // An attempt already cleaned up has nothing left to lose.
        let _ = core.submit(
            op(3, 0, 1, 100, OperationInput::DestroyLease { lease: None }),
            t(4),
        );
        let _ = core.complete(RUN, id(3, 0), succeeded(), t(5));
        core.ack_result(RUN, id(3, 0));
        assert!(core.is_retired(RUN, AttemptId::new(3)));
        assert!(
            core.record_resource_change(&identity(3), lost("late"), t(6))
                .is_empty()
        );
        assert!(kept(&core).is_empty());
    }

    fn identity(attempt: u64) -> ResourceIdentity {
        ResourceIdentity {
            run_uid: RUN,
            run_id: RunId::parse("run_id", "train").unwrap(),
            node: LogicalNodeId::parse("node", "workers-0").unwrap(),
            attempt: AttemptId::new(attempt),
        }
    }

    fn session(s: &str) -> SessionId {
        SessionId::new("session", s).unwrap()
    }

    fn observe(core: &mut ExecutorCore, attempt: u64, s: &str, stage: BootstrapStage) -> Observation {
        let out = core.record_observation(
            &identity(attempt),
            session(s),
            stage,
            String::new(),
            t(1),
            TraceContext::default(),
        );
        match out.as_slice() {
            [Output::Observation(o)] => o.clone(),
            other => panic!("expected one observation out, got {other:?}"),
        }
    }

    #[test]
    fn stages_wait_for_the_result_of_the_start_that_opened_their_session() {
        let mut core = claimed();
        let start = op(
            1,
            1,
            1,
            1000,
            OperationInput::StartBootstrap {
                lease: lease("l1"),
                endpoint: contract::Endpoint::new("endpoint", "127.0.0.1:1").unwrap(),
                boot: Default::default(),
                join: Default::default(),
            },
        );
        let out = core.submit(start, t(1));
        assert!(matches!(out.as_slice(), [Output::Start(_)]));
        // The backend streams two stages before the call has returned.
        for stage in [BootstrapStage::Connected, BootstrapStage::BootCheck] {
            let held = core.record_observation(
                &identity(1),
                session("s1"),
                stage,
                String::new(),
                t(2),
                TraceContext::default(),
            );
            assert!(
                held.is_empty(),
                "a stage went out before the session's start result"
            );
        }
        assert!(core.unacked_observations().is_empty());
        assert!(core.observations_after(RUN, &session("s1"), 0).is_empty());
        let out = core.complete(
            RUN,
            OperationId::new(AttemptId::new(1), 1),
            Outcome::Succeeded(Default::default()),
            t(3),
        );
        let kinds: Vec<&str> = out
            .iter()
            .map(|o| match o {
                Output::Result(_) => "result",
                Output::Observation(_) => "observation",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, ["result", "observation", "observation"]);
        // Later stages flow at once.
        let later = observe(&mut core, 1, "s1", BootstrapStage::AgentStarted);
        assert_eq!(later.seq, 3);
    }

    #[test]
    fn observations_are_sequenced_replayed_and_dropped_on_ack() {
        let mut core = claimed();
        let stages = [
            BootstrapStage::Connected,
            BootstrapStage::BootCheck,
            BootstrapStage::AgentStarted,
        ];
        let seqs: Vec<u64> = stages
            .iter()
            .map(|st| observe(&mut core, 1, "sess-a", *st).seq)
            .collect();
        assert_eq!(seqs, [1, 2, 3]);
        assert_eq!(observe(&mut core, 1, "sess-b", BootstrapStage::Connected).seq, 1);

        let after: Vec<_> = core
            .observations_after(RUN, &session("sess-a"), 1)
            .iter()
            .map(|o| (o.seq, o.stage))
            .collect();
        assert_eq!(
            after,
            [(2, BootstrapStage::BootCheck), (3, BootstrapStage::AgentStarted)]
        );

        core.ack_observations(RUN, &session("sess-a"), 2);
        let left: Vec<_> = core
            .unacked_observations()
            .iter()
            .map(|o| (o.session.as_str().to_owned(), o.seq))
            .collect();
        assert_eq!(left, [("sess-a".to_owned(), 3), ("sess-b".to_owned(), 1)]);
        assert!(core.observations_after(RUN, &session("sess-a"), 0).len() == 1);
        // Numbering continues after an acknowledgement.
        assert_eq!(observe(&mut core, 1, "sess-a", BootstrapStage::Joined).seq, 4);
        core.ack_observations(RUN, &session("sess-a"), u64::MAX);
        assert!(core.observations_after(RUN, &session("sess-a"), 0).is_empty());
    }

    #[test]
    fn an_ended_session_is_forgotten_once_its_end_is_acknowledged() {
        let mut core = claimed();
        let trace = TraceContext {
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
            tracestate: String::new(),
        };
        let sent: Vec<Observation> = [BootstrapStage::Connected, BootstrapStage::Converged]
            .into_iter()
            .flat_map(|stage| {
                core.record_observation(
                    &identity(1),
                    session("sess-a"),
                    stage,
                    format!("{} on node-1", stage.name()),
                    t(1),
                    trace.clone(),
                )
            })
            .map(|out| match out {
                Output::Observation(o) => o,
                other => panic!("expected an observation, got {other:?}"),
            })
            .collect();
        // What is kept for a replay is the observation that went out, whole.
        assert_eq!(core.observations_after(RUN, &session("sess-a"), 0), sent);
        assert_eq!(core.unacked_observations(), sent);

        core.ack_observations(RUN, &session("sess-a"), 1);
        assert_eq!(core.observations_after(RUN, &session("sess-a"), 0), sent[1..]);
        core.ack_observations(RUN, &session("sess-a"), 2);
        assert!(core.unacked_observations().is_empty());
        // The log went with its acknowledged end: a stage reported again
        // starts a new one, as after a restart.
        assert_eq!(observe(&mut core, 1, "sess-a", BootstrapStage::Converged).seq, 1);
        // A session that has not ended keeps its numbering across
        // acknowledgements.
        assert_eq!(observe(&mut core, 2, "sess-b", BootstrapStage::Connected).seq, 1);
        core.ack_observations(RUN, &session("sess-b"), 1);
        assert_eq!(observe(&mut core, 2, "sess-b", BootstrapStage::BootCheck).seq, 2);
    }

    #[test]
    fn forget_run_keeps_fencing() {
        let mut core = ExecutorCore::new();
        claim(&mut core, 3).unwrap();
        let _ = core.submit(op(1, 0, 3, 100, create()), t(0));
        let _ = core.submit(op(2, 0, 3, 100, create()), t(0));
        let _ = core.complete(RUN, id(2, 0), succeeded(), t(1));
        let _ = observe(&mut core, 1, "sess-a", BootstrapStage::Connected);

        let fenced = core.forget_run(RUN, Epoch::new(2));
        assert_eq!(rejection(&fenced).reason, RejectionReason::Fenced);
        assert_eq!(core.entry_count(), 2);

        let out = core.forget_run(RUN, Epoch::new(3));
        assert_eq!(
            out,
            [Output::Abort {
                run_uid: RUN,
                id: id(1, 0)
            }]
        );
        assert_eq!(core.entry_count(), 0);
        assert_eq!(core.running_count(), 0);
        assert!(core.unacked_results().is_empty());
        assert!(core.unacked_observations().is_empty());
        assert_eq!(core.poll_timeout(), None);
        assert_eq!(core.highest_epoch(RUN), Some(Epoch::new(3)));
        assert_eq!(claim(&mut core, 2).unwrap_err().reason, RejectionReason::Fenced);
        let stale = core.submit(op(3, 0, 2, 100, create()), t(2));
        assert_eq!(rejection(&stale).reason, RejectionReason::Fenced);
    }

    #[test]
    fn a_retired_attempt_refuses_a_resubmitted_create() {
        let mut core = claimed();
        let create_op = op(1, 0, 1, 100, create());
        let _ = core.submit(create_op.clone(), t(0));
        let _ = core.complete(RUN, id(1, 0), succeeded(), t(1));
        core.ack_result(RUN, id(1, 0));
        let _ = observe(&mut core, 1, "sess-a", BootstrapStage::Connected);
        core.ack_observations(RUN, &session("sess-a"), 1);

        let destroy = op(
            1,
            1,
            1,
            100,
            OperationInput::DestroyLease {
                lease: Some(lease("lease-1")),
            },
        );
        let _ = core.submit(destroy, t(2));
        let _ = core.complete(RUN, id(1, 1), Outcome::Succeeded(ResultFacts::default()), t(3));
        // Unacknowledged, the destroy retires nothing yet.
        assert!(!core.is_retired(RUN, AttemptId::new(1)));
        assert_eq!(core.entry_count(), 2);
        core.ack_result(RUN, id(1, 1));
        assert!(core.is_retired(RUN, AttemptId::new(1)));
        assert_eq!(core.entry_count(), 0);

        let out = core.submit(create_op, t(4));
        let r = rejection(&out);
        assert_eq!(r.reason, RejectionReason::Invalid);
        assert!(r.message.contains("cleaned up"), "{}", r.message);
        assert_eq!(core.running_count(), 0);

        // The pruned destroy's id with other input is still a conflict...
        let other = op(1, 1, 1, 100, OperationInput::DestroyLease { lease: None });
        assert_eq!(
            rejection(&core.submit(other, t(4))).reason,
            RejectionReason::ConflictingInput
        );
        // ...while the same destroy again is answered "already absent", and so is
        // a new cleanup of the attempt; neither runs.
        let again = op(
            1,
            1,
            1,
            100,
            OperationInput::DestroyLease {
                lease: Some(lease("lease-1")),
            },
        );
        assert!(
            matches!(core.submit(again, t(4)).as_slice(), [Output::Result(r)] if matches!(r.outcome, Outcome::Succeeded(_)))
        );
        let cancel = op(1, 2, 1, 100, OperationInput::CancelBootstrap { session: None });
        assert!(
            matches!(core.submit(cancel, t(4)).as_slice(), [Output::Result(r)] if matches!(r.outcome, Outcome::Succeeded(_)))
        );
        assert_eq!(core.running_count(), 0);
        // Other attempts are unaffected.
        assert_eq!(starts(&core.submit(op(2, 0, 1, 100, create()), t(4))), [id(2, 0)]);
    }

    #[test]
    fn a_failed_destroy_does_not_retire_its_attempt() {
        let mut core = claimed();
        let destroy = op(1, 0, 1, 100, OperationInput::DestroyLease { lease: None });
        let _ = core.submit(destroy, t(0));
        let fail = Outcome::Retryable {
            reason: "provider said no".to_owned(),
        };
        let _ = core.complete(RUN, id(1, 0), fail, t(1));
        core.ack_result(RUN, id(1, 0));
        assert!(!core.is_retired(RUN, AttemptId::new(1)));
        assert_eq!(starts(&core.submit(op(1, 1, 1, 100, create()), t(2))), [id(1, 1)]);
    }
    #[test]
    fn per_operation_changes_add_up_to_the_full_durable_state() {
        // A store that applies only what `take_changes` reports must hold
        // exactly the completed records a full rewrite would, after every step
        // of a long pseudo-random mix of submits, completions, replays,
        // acknowledgements, deadlines, retirements and forgets.
        let mut core = claimed();
        let mut kept: BTreeMap<(RunUid, OperationId), DurableOp> = BTreeMap::new();
        let mut started: Vec<OperationId> = Vec::new();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut now = 0;
        let (mut writes, mut removals) = (0, 0);
        for _ in 0..4000 {
            now += 1;
            let out = match next(10) {
                0..=3 => {
                    let (attempt, seq) = (1 + next(8), 1 + next(3) as u32);
                    let input = if seq == 3 {
                        OperationInput::DestroyLease {
                            lease: Some(lease("lease-1")),
                        }
                    } else {
                        create()
                    };
                    core.submit(op(attempt, seq, 1, now + 1 + next(40), input), t(now))
                }
                4..=5 if !started.is_empty() => {
                    let i = next(started.len() as u64) as usize;
                    let done = started.swap_remove(i);
                    core.complete(RUN, done, succeeded(), t(now))
                }
                6..=7 => {
                    let (attempt, seq) = (1 + next(8), 1 + next(3) as u32);
                    core.ack_result(RUN, id(attempt, seq));
                    Vec::new()
                }
                8 => core.handle_timeout(t(now)),
                _ if next(20) == 0 => {
                    started.clear();
                    core.forget_run(RUN, Epoch::new(1))
                }
                _ => Vec::new(),
            };
            started.extend(starts(&out));
            for change in core.take_changes() {
                match change {
                    DurableChange::Run { .. } => {}
                    DurableChange::ForgetOps { run_uid } => kept.retain(|(uid, _), _| *uid != run_uid),
                    DurableChange::Op { run_uid, id, record } => match record {
                        Some(r) => {
                            writes += 1;
                            kept.insert((run_uid, id), *r);
                        }
                        None => {
                            removals += 1;
                            kept.remove(&(run_uid, id));
                        }
                    },
                }
            }
            assert_eq!(kept, core.durable_records(), "after step at {now}");
        }
        // The mix reached every kind of change.
        assert!(
            writes > 100 && removals > 0,
            "writes {writes}, removals {removals}"
        );
    }

    #[test]
    fn queued_and_running_operations_are_not_written() {
        let mut core = claimed();
        let _ = core.take_changes();
        let out = core.submit(op(1, 1, 1, 100, create()), t(0));
        assert_eq!(starts(&out), vec![id(1, 1)]);
        let _ = core.submit(op(1, 2, 1, 100, create()), t(0));
        assert_eq!(core.take_changes(), Vec::new());
        let out = core.complete(RUN, id(1, 1), succeeded(), t(1));
        assert_eq!(starts(&out), vec![id(1, 2)]);
        let changes = core.take_changes();
        assert!(
            matches!(changes.as_slice(), [DurableChange::Op { id: written, record: Some(_), .. }]
                if *written == id(1, 1)),
            "{changes:?}"
        );
        // Neither an acknowledgement nor a replay that owes the result again
        // writes anything: after a restart nothing is owed until asked for.
        core.ack_result(RUN, id(1, 1));
        assert_eq!(core.take_changes(), Vec::new());
        let out = core.submit(op(1, 1, 1, 100, create()), t(2));
        assert!(matches!(results(&out).as_slice(), [r] if r.replayed), "{out:?}");
        assert_eq!(core.take_changes(), Vec::new());
    }
}
