//! What a system under test reports after each round, for the oracle: the
//! driver's state as far as it can be seen, the backend's live resources, and
//! (in memory) every event of the round.

use std::{collections::BTreeMap, fmt};

use contract::{
    AttemptId, ClusterShape, Generation, LogicalNodeId, OperationId, PendingOp, RunUid, UnixMillis,
};

use super::input::Input;
use crate::sim::{Event, Nodes};

/// Which part of a run a round belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The generated, faulty prefix.
    Prefix,
    /// The fair tail: faults stopped, link up, waiting for convergence.
    Tail,
    /// Deleting the converged run and waiting until it is gone.
    Teardown,
    /// Checks over the whole trace (determinism, probes).
    Whole,
}

/// Where in a run something happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepRef {
    pub phase: Phase,
    /// The index of the prefix input being applied.
    pub input: Option<usize>,
    /// The scheduler round since the run started.
    pub round: u64,
}

impl fmt::Display for StepRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.phase, self.input) {
            (Phase::Prefix, Some(i)) => write!(f, "prefix input #{i}, round {}", self.round),
            (phase, _) => write!(f, "{phase:?}, round {}", self.round),
        }
    }
}

/// The committed store's row for one node.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreRow {
    pub pending: Option<PendingOp>,
    pub inflight: Option<OperationId>,
}

/// The driver's state of the run, as far as the system under test shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSnapshot {
    pub uid: RunUid,
    /// Deleted and reaped (or, over the API, not found any more).
    pub gone: bool,
    pub deleting: bool,
    pub generation: Generation,
    pub observed_generation: Generation,
    pub shape: Option<ClusterShape>,
    pub converged: bool,
    /// The attempt allocator, when visible.
    pub next_attempt: Option<u64>,
    /// Every node. Over the API a node's spec is a placeholder (the status
    /// carries whether it is current instead).
    pub nodes: Nodes,
    /// The successor attempts slots hold under a rollout's surge.
    pub successors: Nodes,
    /// Whether each node's spec is its slot's current template.
    pub spec_current: BTreeMap<LogicalNodeId, bool>,
    /// The committed store, when visible.
    pub store: Option<BTreeMap<LogicalNodeId, StoreRow>>,
    /// Passes the driver has run.
    pub passes: u64,
}

/// A live resource at the backend.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Resource {
    pub node: LogicalNodeId,
    pub attempt: AttemptId,
    pub lease: String,
    pub session_live: bool,
}

/// What kind of shape update an apply was meant to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyKind {
    /// A valid update to the next generation: must be accepted.
    Valid,
    /// The current generation and content again: an idempotent no-op.
    Same,
    /// Must be rejected.
    Invalid,
}

/// How the system answered an apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Changed,
    Unchanged,
    Rejected(String),
    /// The run was gone, so the in-memory system did not try (a deleted run's
    /// id is free again, which makes a new run: outside the trace's scope).
    Skipped,
}

/// One shape update and the state just before it. The state just after is the
/// record's state.
#[derive(Debug, Clone)]
pub struct ApplyRecord {
    pub kind: ApplyKind,
    pub submitted: ClusterShape,
    pub verdict: Verdict,
    pub before: RunSnapshot,
    /// The snapshots are taken with nothing else running in between, so the
    /// nodes must match exactly after a rejection (over the API the run keeps
    /// working between the two reads, and only the shape can be compared).
    pub exact: bool,
}

/// An extra check run on a copy of the system, which must not disturb it.
#[derive(Debug, Clone)]
pub enum Probe {
    /// A pass over the converged run: how many actions it took and whether any
    /// node changed.
    ConvergedPass { actions: usize, changed: bool },
    /// A pass at a saturated clock, or with the attempt allocator exhausted:
    /// whether it panicked, and the error it returned (if any), and whether a
    /// failed call left the nodes as they were.
    Limits {
        what: &'static str,
        panicked: Option<String>,
        error: Option<String>,
        expected_error: bool,
        unchanged: bool,
    },
}

/// Everything the oracle sees of one round.
#[derive(Debug, Clone)]
pub struct StepRecord {
    pub at: StepRef,
    pub input: Option<Input>,
    pub now: UnixMillis,
    /// Every event of the round: in memory as it happens, over the real
    /// services as their event traces tell it.
    pub events: Vec<Event>,
    pub apply: Option<ApplyRecord>,
    pub state: RunSnapshot,
    /// The run's live resources at the backend.
    pub inventory: Option<Vec<Resource>>,
    /// Level 3: the live node-agent processes of the run in the OS process
    /// table, one sample per entry (taken while the round waited), the last one
    /// taken with `state`; `lease` is the agent's PID. Empty elsewhere.
    pub processes: Vec<Vec<Resource>>,
    /// Nothing on its way: no backend call out, no message in transit, nothing
    /// running or queued at the executor.
    pub quiescent: bool,
    pub probes: Vec<Probe>,
    /// The events were read after the state (levels 2 and 3: the services'
    /// traces are read once the status is in), so the state may predate the
    /// latest of them. In memory both are taken at once.
    pub events_after_state: bool,
}
