//! The interface of the stores a run's writes go to, and the in-memory
//! implementation (a test double; the durable stores implement the same trait).
//!
//! A pass's writes are one [`RunDelta`], committed together. The core never
//! calls a store: it hands the shell a `Commit`, which the shell persists
//! (`Commit::persist_to`) before anything it holds is released.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, PoisonError},
};

use contract::{
    ClusterShape, Epoch, Event, Generation, LogicalNodeId, ManagedNode, Operation, RunId, RunUid, UnixMillis,
};

/// A run's own fields (everything but its nodes).
#[derive(Debug, Clone, PartialEq)]
pub struct RunMeta {
    pub run_id: RunId,
    pub uid: RunUid,
    pub epoch: Epoch,
    pub shape: ClusterShape,
    pub deleting: bool,
    pub paused: bool,
    pub observed_generation: Generation,
    /// The next attempt id to hand out; attempts are never reused.
    pub next_attempt: u64,
    pub created_at: UnixMillis,
    pub converged_at: Option<UnixMillis>,
    /// Held only to destroy orphans of a run the driver no longer has (see
    /// `orphans`): never listed as a run, deleting from the start.
    pub reclaim: bool,
    /// Each condition as last recorded: what the status showed and when its
    /// status last changed, so `since` and the events that conditions cause
    /// outlive the driver's process.
    pub conditions: Vec<ConditionMark>,
    /// Each group's rollout in progress (SPEC.md section 9).
    pub rollouts: Vec<crate::rollout::GroupRollout>,
    /// Each group as it was when it last converged: what a revert applies.
    pub stable: Vec<crate::rollout::StableGroup>,
}

/// A condition's status, reason and the time its status last changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionMark {
    pub kind: String,
    pub status: bool,
    pub reason: String,
    pub since: UnixMillis,
}

/// One slot as stored: its node, the op-sequence allocator of its attempt, and
/// the operation in flight exactly as it was submitted (so a resubmission is
/// byte-for-byte the same input, which the executor replays). The operation
/// is boxed: most records have none, and a run keeps every record in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRecord {
    pub node: ManagedNode,
    pub next_seq: u32,
    pub inflight: Option<Box<Operation>>,
    /// The slot's successor attempt under a rollout's surge, stored with
    /// the slot (its own `successor` is always `None`).
    pub successor: Option<Box<NodeRecord>>,
}

impl NodeRecord {
    /// A fresh attempt's record.
    pub fn new(node: ManagedNode) -> Self {
        Self {
            node,
            next_seq: 1,
            inflight: None,
            successor: None,
        }
    }
}

/// The writes of one pass (or one fold batch) for one run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunDelta {
    pub uid: RunUid,
    pub meta: Option<RunMeta>,
    /// Shared with the run's own state until the run changes the record
    /// again (copy on write), so a commit copies no record.
    pub upserts: Vec<Arc<NodeRecord>>,
    pub removals: Vec<LogicalNodeId>,
    /// The run is gone: drop everything stored for it.
    pub drop_run: bool,
    /// Events recorded or repeated since the last commit (an event is
    /// written again, under its sequence number, when it repeats).
    pub events: Vec<Event>,
    /// Events numbered below this are no longer kept: delete them.
    pub events_below: Option<u64>,
}

impl RunDelta {
    pub fn new(uid: RunUid) -> Self {
        Self {
            uid,
            meta: None,
            upserts: Vec::new(),
            removals: Vec::new(),
            drop_run: false,
            events: Vec::new(),
            events_below: None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.meta.is_none()
            && self.upserts.is_empty()
            && self.removals.is_empty()
            && !self.drop_run
            && self.events.is_empty()
            && self.events_below.is_none()
    }
}

/// Everything stored for one run.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRun {
    pub meta: RunMeta,
    pub nodes: Vec<NodeRecord>,
    /// The event log as kept, oldest first.
    pub events: Vec<Event>,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("a node delta arrived for run {0}, which has no stored meta")]
    UnknownRun(RunUid),
    /// A shared store: another run (uid `holder`) took this run id first.
    #[error("run id {run_id} is taken by run uid {holder}")]
    NameTaken { run_id: String, holder: String },
}

/// Where run state is committed. Implementations commit a delta atomically,
/// and take commits of different runs concurrently (`&self`): the driver
/// persists each run's commits from that run's own task, never under a lock
/// shared by every run.
pub trait RunStore: Send + Sync + std::fmt::Debug {
    fn commit(&self, delta: &RunDelta) -> Result<(), StoreError>;
    fn load_all(&self) -> Result<Vec<StoredRun>, StoreError>;

    /// One run, as stored (a run reloaded after a failed write).
    fn load_run(&self, uid: RunUid) -> Result<Option<StoredRun>, StoreError> {
        Ok(self.load_all()?.into_iter().find(|s| s.meta.uid == uid))
    }

    /// Whether a commit may block the calling thread (on a disk or the
    /// network): the driver then writes off its async workers. A store that
    /// answers from memory says `false` and is written inline.
    fn blocks(&self) -> bool {
        true
    }
}

type MemRuns = BTreeMap<RunUid, MemRun>;

#[derive(Debug, Clone)]
struct MemRun {
    meta: RunMeta,
    /// Shared with the runs' states until they change a record again.
    nodes: BTreeMap<LogicalNodeId, Arc<NodeRecord>>,
    events: BTreeMap<u64, Event>,
}

/// Keeps state for the process lifetime only.
#[derive(Debug, Default)]
pub struct MemStore {
    inner: Mutex<MemInner>,
}

#[derive(Debug, Default, Clone)]
struct MemInner {
    runs: MemRuns,
    commits: u64,
}

impl Clone for MemStore {
    fn clone(&self) -> Self {
        Self {
            inner: Mutex::new(self.lock().clone()),
        }
    }
}

impl MemStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of successful commits, for tests that count them.
    pub fn commits(&self) -> u64 {
        self.lock().commits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemInner> {
        // Every write below is completed before the guard drops, so a
        // panicking holder leaves the map whole.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl RunStore for MemStore {
    fn commit(&self, delta: &RunDelta) -> Result<(), StoreError> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let uid = delta.uid;
        if delta.drop_run {
            inner.runs.remove(&uid);
            inner.commits += 1;
            return Ok(());
        }
        let entry = match (inner.runs.get_mut(&uid), &delta.meta) {
            (Some(e), Some(m)) => {
                e.meta = m.clone();
                e
            }
            (Some(e), None) => e,
            (None, Some(m)) => inner.runs.entry(uid).or_insert_with(|| MemRun {
                meta: m.clone(),
                nodes: BTreeMap::new(),
                events: BTreeMap::new(),
            }),
            (None, None) => return Err(StoreError::UnknownRun(uid)),
        };
        for r in &delta.upserts {
            entry.nodes.insert(r.node.id.clone(), Arc::clone(r));
        }
        for id in &delta.removals {
            entry.nodes.remove(id);
        }
        for e in &delta.events {
            entry.events.insert(e.seq, e.clone());
        }
        if let Some(below) = delta.events_below {
            entry.events = entry.events.split_off(&below);
        }
        inner.commits += 1;
        Ok(())
    }

    fn load_all(&self) -> Result<Vec<StoredRun>, StoreError> {
        Ok(self
            .lock()
            .runs
            .values()
            .map(|r| StoredRun {
                meta: r.meta.clone(),
                nodes: r.nodes.values().map(|n| NodeRecord::clone(n)).collect(),
                events: r.events.values().cloned().collect(),
            })
            .collect())
    }

    fn blocks(&self) -> bool {
        false
    }
}
