//! The event trace: what a service received, decided, recorded and dispatched,
//! one JSON object per line, so that a test outside the processes can check
//! the guarantees of SPEC.md section 6 over the same events an in-memory run
//! shows (the conformance kit's level 2 reads it).
//!
//! Off unless `--event-trace <path>` (`PROVISIONING_EVENT_TRACE`) is given;
//! [`crate::runtime::init_telemetry`] installs it for the process. Off, a
//! writer is one `OnceLock` read ([`get`]) and nothing is built. On, each line
//! is written with one `write` call as soon as it is made (the file is opened
//! for appending, so a restarted service continues the same file under a new
//! `pid`, and a reader can follow it while the service runs). The trace is a
//! test and debugging aid: the driver diffs a run's nodes around each change to
//! say what changed, O(nodes) per event.
//!
//! Every line has `t_us` (wall-clock microseconds when written), `svc`, `pid`
//! and `ev`, the event's kind; the rest depends on the kind ([`TraceEvent`]).
//! Domain values travel twice: readable fields for people, and `wire`, the
//! value's protobuf encoding in hex, for tools that need it exactly (see
//! [`NodeRec::node`], [`OpRec::op`] and the like).

use std::{
    fs::File,
    io::Write as _,
    path::Path,
    sync::{Arc, Mutex, OnceLock},
    time::{SystemTime, UNIX_EPOCH},
};

use prost::Message;
use serde::{Deserialize, Serialize};

use contract::{
    Decision, FieldError, ManagedNode, NodeTemplate, Observation, Operation, OperationResult, Rejection,
    ResourceChange, pb,
    wire::{TemplateTable, node_from_wire, node_to_wire},
};

/// One line of an event trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceLine {
    /// When the line was written: wall-clock microseconds since the Unix epoch.
    pub t_us: u64,
    /// The writing service (`driver-svc`, `executor-svc`, `decider-svc`).
    pub svc: String,
    /// The writing process: a restarted service appends under a new pid.
    pub pid: u32,
    #[serde(flatten)]
    pub event: TraceEvent,
}

/// What happened. Run uids, node ids and operation ids are written as their
/// `Display` forms (`a3.2` for an operation id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "kebab-case")]
pub enum TraceEvent {
    /// The process began writing (first line of each process).
    Started,

    // ----- driver ----------------------------------------------------------
    /// A run's actor started: a new run, or one restored from the store under
    /// a new epoch. `nodes` is every node it holds; `shape` its desired shape
    /// (a `pb::ClusterShape` in hex).
    RunStarted {
        run: String,
        run_id: String,
        epoch: u64,
        shape: String,
        deleting: bool,
        nodes: Vec<NodeRec>,
        /// The successor attempts slots hold under a rollout's surge.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        successors: Vec<NodeRec>,
    },
    /// A request reached the run: `what` is `shape`, `delete`, `pause`,
    /// `resume` or `abandon` from a client, or `adopt-orphans` from the orphan
    /// sweep; `outcome` says what came of it. `shape` and `deleting` are the
    /// run's afterwards.
    Request {
        run: String,
        now_ms: u64,
        what: String,
        generation: u64,
        outcome: String,
        shape: String,
        deleting: bool,
        #[serde(default, skip_serializing_if = "Changes::is_empty")]
        changes: Changes,
    },
    /// A message from the executor reached the run and was folded
    /// (`verdict` `folded`), discarded (`discarded:<reason>`), or handled
    /// otherwise (`claimed`, `fenced`, `reclaim`, `error:<why>`).
    Received {
        run: String,
        now_ms: u64,
        msg: Msg,
        verdict: String,
        #[serde(default, skip_serializing_if = "Changes::is_empty")]
        changes: Changes,
    },
    /// The run's timer folded expired deadlines.
    Deadlines {
        run: String,
        now_ms: u64,
        folded: u32,
        #[serde(default, skip_serializing_if = "Changes::is_empty")]
        changes: Changes,
    },
    /// A pass began: deadlines due were folded (`changes`), and `nodes` (with
    /// the version each had) go to the decider. `converged`: the run was
    /// converged when the decider was asked.
    PassBegun {
        run: String,
        pass: u64,
        now_ms: u64,
        generation: u64,
        deleting: bool,
        full: bool,
        converged: bool,
        nodes: Vec<NodeVersion>,
        #[serde(default, skip_serializing_if = "Changes::is_empty")]
        changes: Changes,
    },
    /// The decider answered pass `pass` (asked at `plan_now_ms`) and the
    /// answer was applied at `now_ms` and committed. `stale_answer`: the shape
    /// changed while the decider ran, so none of it was applied; otherwise
    /// `stale` decisions were skipped because their node changed meanwhile.
    /// `actions` counts the actions applied (waits excluded).
    PassDecided {
        run: String,
        pass: u64,
        plan_now_ms: u64,
        now_ms: u64,
        stale_answer: bool,
        decisions: Vec<DecisionRec>,
        actions: u32,
        operations: u32,
        transitions: u32,
        stale: u32,
        /// Where the stale decisions are in `decisions` (the others were
        /// applied).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        stale_at: Vec<u32>,
        #[serde(default, skip_serializing_if = "Changes::is_empty")]
        changes: Changes,
    },
    /// Pass `pass` ended without applying anything: the decider failed, the
    /// answer could not be applied, or the driver is stopping.
    PassFailed { run: String, pass: u64, error: String },
    /// What the run changed since its last commit is durable.
    Committed { run: String },
    /// An operation recorded pending was handed to the executor link
    /// (`sent`), or kept for later because the link is down or the run may
    /// not dispatch (`sent: false`). `resubmit`: after the link came back.
    Dispatched {
        run: String,
        op: OpRec,
        sent: bool,
        resubmit: bool,
    },
    /// The run claimed itself at the executor on link generation `link`.
    Claim { run: String, epoch: u64, link: u64 },

    // ----- executor --------------------------------------------------------
    /// A driver's claim, and whether the executor accepted it.
    ClaimReceived {
        run: String,
        epoch: u64,
        link: u64,
        accepted: bool,
    },
    /// An operation arrived from a driver (before the executor's core saw it).
    OpReceived { op: OpRec, link: u64 },
    /// A backend call started.
    CallStarted { op: OpRec },
    /// A backend call finished; `current` is false for a call that was
    /// abandoned (its completion is late) or replaced.
    CallCompleted {
        run: String,
        id: String,
        outcome: String,
        current: bool,
    },
    /// The executor abandoned a running operation at its deadline and aborted
    /// its backend call.
    CallAborted { run: String, id: String },
    /// A result for the driver: fresh, late, or replayed for a resubmission
    /// (see the record's flags); `resend`: sent again to a driver that
    /// claimed the run anew, unacknowledged.
    ResultOut { result: ResultRec, resend: bool },
    /// A bootstrap observation for the driver; `replay`: asked for again.
    ObservationOut { obs: ObsRec, replay: bool },
    /// A rejection for the driver.
    RejectionOut { rejection: RejRec },
    /// A resource change for the driver; `resend`: sent again on a claim.
    ChangeOut { change: ChangeRec, resend: bool },
    /// Acknowledgements from a driver; `changes` are the sequence numbers of
    /// the resource changes it acknowledged.
    AckReceived {
        run: String,
        results: Vec<String>,
        observations: Vec<SeqRef>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        changes: Vec<u64>,
    },
    /// A driver said a run is gone.
    ForgetReceived { run: String, epoch: u64 },

    // ----- decider ---------------------------------------------------------
    /// One `Decide` call: what it was asked (`nodes` decided, at `now_ms`) and
    /// every decision it returned, inserts included.
    Decide {
        run_id: String,
        now_ms: u64,
        generation: u64,
        deleting: bool,
        nodes: u32,
        inserts: u32,
        decisions: Vec<DecisionRec>,
    },
}

/// A message from the executor, as the driver received it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Msg {
    Result(ResultRec),
    Observation(ObsRec),
    Rejection(RejRec),
    Change(ChangeRec),
    Claimed { epoch: u64 },
}

/// Nodes a change touched: the new state of each changed or added node, and
/// the ids of removed ones.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Changes {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<NodeRec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed: Vec<String>,
    /// Successor attempts (a rollout's surge) that changed or appeared.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub successors: Vec<NodeRec>,
    /// Slots whose successor attempt went away (it took the slot over, or
    /// was reaped).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub successors_removed: Vec<String>,
    /// The run's shape, when the change gave it another generation (hex).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<String>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty()
            && self.removed.is_empty()
            && self.successors.is_empty()
            && self.successors_removed.is_empty()
            && self.shape.is_none()
    }
}

/// A node named in a pass plan, with its version then.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeVersion {
    pub id: String,
    pub version: u64,
}

/// A session's sequence number (an acknowledgement).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeqRef {
    pub session: String,
    pub seq: u64,
}

/// A shape, from what [`hex`] wrote.
pub fn shape(hex: &str) -> Result<contract::ClusterShape, TraceError> {
    Ok(contract::ClusterShape::try_from(unhex::<pb::ClusterShape>(hex)?)?)
}

/// One node's state. `state` is its `pb::NodeState`, whose template
/// references index `templates` (each a `pb::NodeTemplate`), both in hex.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRec {
    pub id: String,
    pub attempt: u64,
    pub stage: String,
    pub intent: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<String>,
    pub state: String,
    pub templates: Vec<String>,
}

impl NodeRec {
    pub fn of(n: &ManagedNode) -> Self {
        let mut table = TemplateTable::default();
        let state = node_to_wire(n, &mut table);
        Self {
            id: n.id.to_string(),
            attempt: n.attempt.get(),
            stage: n.stage.name().to_owned(),
            intent: match n.intent {
                contract::Intent::Active => "active",
                contract::Intent::Deleting => "deleting",
            }
            .to_owned(),
            pending: n.pending.map(|p| p.id.to_string()),
            state: hex(&state),
            templates: table.into_wire().iter().map(hex).collect(),
        }
    }

    /// The node, exactly.
    pub fn node(&self) -> Result<ManagedNode, TraceError> {
        let templates = self
            .templates
            .iter()
            .map(|t| unhex::<pb::NodeTemplate>(t))
            .collect::<Result<Vec<_>, _>>()?;
        let templates: Vec<Arc<NodeTemplate>> = TemplateTable::from_wire(templates)?;
        Ok(node_from_wire(unhex(&self.state)?, &templates)?)
    }
}

/// One operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRec {
    pub run: String,
    pub id: String,
    pub node: String,
    pub effect: String,
    pub epoch: u64,
    pub deadline_ms: u64,
    pub wire: String,
}

impl OpRec {
    pub fn of(op: &Operation) -> Self {
        Self {
            run: op.run_uid.to_string(),
            id: op.id.to_string(),
            node: op.node.to_string(),
            effect: op.input.effect().name().to_owned(),
            epoch: op.epoch.get(),
            deadline_ms: op.deadline.as_millis(),
            wire: hex(&pb::Operation::from(op)),
        }
    }

    pub fn op(&self) -> Result<Operation, TraceError> {
        Ok(Operation::try_from(unhex::<pb::Operation>(&self.wire)?)?)
    }
}

/// One operation result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRec {
    pub run: String,
    pub id: String,
    pub node: String,
    pub effect: String,
    pub outcome: String,
    pub late: bool,
    pub replayed: bool,
    pub wire: String,
}

impl ResultRec {
    pub fn of(r: &OperationResult) -> Self {
        Self {
            run: r.run_uid.to_string(),
            id: r.id.to_string(),
            node: r.node.to_string(),
            effect: r.effect.name().to_owned(),
            outcome: r.outcome.class_name().to_owned(),
            late: r.late,
            replayed: r.replayed,
            wire: hex(&pb::OperationResult::from(r)),
        }
    }

    pub fn result(&self) -> Result<OperationResult, TraceError> {
        Ok(OperationResult::try_from(unhex::<pb::OperationResult>(
            &self.wire,
        )?)?)
    }
}

/// One bootstrap observation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObsRec {
    pub run: String,
    pub node: String,
    pub attempt: u64,
    pub session: String,
    pub seq: u64,
    pub stage: String,
    pub wire: String,
}

impl ObsRec {
    pub fn of(o: &Observation) -> Self {
        Self {
            run: o.run_uid.to_string(),
            node: o.node.to_string(),
            attempt: o.attempt.get(),
            session: o.session.to_string(),
            seq: o.seq,
            stage: o.stage.name().to_owned(),
            wire: hex(&pb::BootstrapObservation::from(o)),
        }
    }

    pub fn observation(&self) -> Result<Observation, TraceError> {
        Ok(Observation::try_from(unhex::<pb::BootstrapObservation>(
            &self.wire,
        )?)?)
    }
}

/// One resource change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChangeRec {
    pub run: String,
    pub node: String,
    pub attempt: u64,
    pub seq: u64,
    pub change: String,
    pub wire: String,
}

impl ChangeRec {
    pub fn of(c: &ResourceChange) -> Self {
        Self {
            run: c.run_uid.to_string(),
            node: c.node.to_string(),
            attempt: c.attempt.get(),
            seq: c.seq,
            change: c.change.name().to_owned(),
            wire: hex(&pb::ResourceChange::from(c)),
        }
    }

    pub fn resource_change(&self) -> Result<ResourceChange, TraceError> {
        Ok(ResourceChange::try_from(unhex::<pb::ResourceChange>(
            &self.wire,
        )?)?)
    }
}

/// One rejection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RejRec {
    pub run: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub reason: String,
    pub wire: String,
}

impl RejRec {
    pub fn of(r: &Rejection) -> Self {
        Self {
            run: r.run_uid.to_string(),
            id: r.id.map(|id| id.to_string()),
            reason: r.reason.name().to_owned(),
            wire: hex(&pb::Rejection::from(r)),
        }
    }

    pub fn rejection(&self) -> Result<Rejection, TraceError> {
        Ok(Rejection::try_from(unhex::<pb::Rejection>(&self.wire)?)?)
    }
}

/// One decision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionRec {
    pub node: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u64>,
    pub rule: u32,
    pub action: String,
    pub wire: String,
}

impl DecisionRec {
    pub fn of(d: &Decision) -> Self {
        Self {
            node: d.node.to_string(),
            attempt: d.attempt.map(contract::AttemptId::get),
            rule: d.rule.number(),
            action: d.action.name().to_owned(),
            wire: hex(&pb::Decision::from(d)),
        }
    }

    pub fn decision(&self) -> Result<Decision, TraceError> {
        Ok(Decision::try_from(unhex::<pb::Decision>(&self.wire)?)?)
    }
}

/// Why a trace value could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("not an even-length hex string")]
    Hex,
    #[error("not a protobuf message of the expected type: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error(transparent)]
    Field(#[from] FieldError),
    #[error("not a trace line: {0}")]
    Json(#[from] serde_json::Error),
}

/// `m`'s protobuf encoding in lowercase hex.
pub fn hex<M: Message>(m: &M) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let bytes = m.encode_to_vec();
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    s
}

/// Decodes what [`hex`] wrote.
pub fn unhex<M: Message + Default>(s: &str) -> Result<M, TraceError> {
    fn digit(c: u8) -> Result<u8, TraceError> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(TraceError::Hex),
        }
    }
    let s = s.as_bytes();
    if !s.len().is_multiple_of(2) {
        return Err(TraceError::Hex);
    }
    let bytes = s
        .chunks_exact(2)
        .map(|p| Ok(digit(p[0])? << 4 | digit(p[1])?))
        .collect::<Result<Vec<u8>, TraceError>>()?;
    Ok(M::decode(bytes.as_slice())?)
}

/// Parses one line of a trace.
pub fn parse_line(line: &str) -> Result<TraceLine, TraceError> {
    Ok(serde_json::from_str(line)?)
}

/// A trace file being written.
#[derive(Debug)]
pub struct EventTrace {
    svc: &'static str,
    pid: u32,
    out: Mutex<File>,
}

impl EventTrace {
    /// Opens `path` for appending and writes a [`TraceEvent::Started`] line.
    pub fn open(svc: &'static str, path: &Path) -> std::io::Result<Self> {
        let out = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        let trace = Self {
            svc,
            pid: std::process::id(),
            out: Mutex::new(out),
        };
        trace.write(TraceEvent::Started)?;
        Ok(trace)
    }

    /// Writes one line. A failed write is logged (once per process) and the
    /// trace goes on: it must never stop the service it describes.
    pub fn emit(&self, event: TraceEvent) {
        static WARNED: OnceLock<()> = OnceLock::new();
        if let Err(e) = self.write(event)
            && WARNED.set(()).is_ok()
        {
            tracing::warn!(error = %e, "writing the event trace failed; later failures are not logged");
        }
    }

    fn write(&self, event: TraceEvent) -> std::io::Result<()> {
        let t_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        let line = TraceLine {
            t_us,
            svc: self.svc.to_owned(),
            pid: self.pid,
            event,
        };
        let mut text = serde_json::to_string(&line).map_err(std::io::Error::other)?;
        text.push('\n');
        // One write per line, made while the lock is held, so lines of
        // concurrent writers never interleave and a reader sees whole lines
        // (or the start of the last one).
        let mut out = match self.out.lock() {
            Ok(out) => out,
            Err(poisoned) => poisoned.into_inner(),
        };
        out.write_all(text.as_bytes())
    }
}

static GLOBAL: OnceLock<EventTrace> = OnceLock::new();

/// Turns the process's event trace on, writing to `path`. A second call
/// keeps the first trace.
pub fn install(svc: &'static str, path: &Path) -> std::io::Result<()> {
    if GLOBAL.get().is_some() {
        return Ok(());
    }
    let trace = EventTrace::open(svc, path)?;
    let _ = GLOBAL.set(trace);
    Ok(())
}

/// The process's event trace, if it is on.
pub fn get() -> Option<&'static EventTrace> {
    GLOBAL.get()
}

/// Writes the event `make` builds to the process's trace; with the trace off,
/// `make` is not called.
pub fn emit(make: impl FnOnce() -> TraceEvent) {
    if let Some(t) = get() {
        t.emit(make());
    }
}

/// Lines held back until what they describe is durable, then written in the
/// order they were made (the executor writes a step's lines after the step's
/// changes are stored, so its trace never shows a result a restart forgets).
/// With the trace off it holds nothing and builds nothing.
#[derive(Debug)]
pub struct Deferred(Option<Vec<TraceEvent>>);

impl Default for Deferred {
    fn default() -> Self {
        Self(get().map(|_| Vec::new()))
    }
}

impl Deferred {
    /// Holds the event `make` builds (not called with the trace off).
    pub fn push(&mut self, make: impl FnOnce() -> TraceEvent) {
        if let Some(held) = &mut self.0 {
            held.push(make());
        }
    }

    /// Writes what is held.
    pub fn write(&mut self) {
        if let (Some(t), Some(held)) = (get(), &mut self.0) {
            for event in held.drain(..) {
                t.emit(event);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn hex_round_trips() {
        let m = pb::OperationId { attempt: 7, seq: 300 };
        let s = hex(&m);
        assert_eq!(unhex::<pb::OperationId>(&s).unwrap(), m);
        assert!(matches!(unhex::<pb::OperationId>("abc"), Err(TraceError::Hex)));
        assert!(matches!(unhex::<pb::OperationId>("zz"), Err(TraceError::Hex)));
    }

    #[test]
    fn a_node_round_trips() {
        let id = contract::LogicalNodeId::parse("node", "work-3").unwrap();
        let spec = Arc::new(contract::shape::example_template("fake", "img"));
        let mut n = ManagedNode::new(
            id,
            contract::AttemptId::new(4),
            spec,
            contract::RetryState::default(),
        );
        n.facts.lease = Some(contract::LeaseId::new("lease", "l-1").unwrap());
        let rec = NodeRec::of(&n);
        assert_eq!(
            (rec.id.as_str(), rec.attempt, rec.stage.as_str()),
            ("work-3", 4, "new")
        );
        assert_eq!(rec.node().unwrap(), n);
    }

    #[test]
    fn lines_round_trip_and_are_flat() {
        let line = TraceLine {
            t_us: 5,
            svc: "driver-svc".to_owned(),
            pid: 9,
            event: TraceEvent::Claim {
                run: "r".to_owned(),
                epoch: 2,
                link: 3,
            },
        };
        let text = serde_json::to_string(&line).unwrap();
        assert!(text.contains(r#""ev":"claim""#), "{text}");
        assert_eq!(parse_line(&text).unwrap(), line);
        let started = serde_json::to_string(&TraceLine {
            event: TraceEvent::Started,
            ..line
        })
        .unwrap();
        assert!(started.contains(r#""ev":"started""#), "{started}");
        assert_eq!(parse_line(&started).unwrap().event, TraceEvent::Started);
    }

    #[test]
    fn a_trace_file_is_appended_line_by_line() {
        let dir = std::env::temp_dir().join(format!("event-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.jsonl");
        let _ = std::fs::remove_file(&path);
        let a = EventTrace::open("decider-svc", &path).unwrap();
        a.emit(TraceEvent::Committed { run: "x".to_owned() });
        let b = EventTrace::open("decider-svc", &path).unwrap();
        b.emit(TraceEvent::Committed { run: "y".to_owned() });
        let text = std::fs::read_to_string(&path).unwrap();
        let events: Vec<TraceEvent> = text.lines().map(|l| parse_line(l).unwrap().event).collect();
        assert_eq!(
            events,
            vec![
                TraceEvent::Started,
                TraceEvent::Committed { run: "x".to_owned() },
                TraceEvent::Started,
                TraceEvent::Committed { run: "y".to_owned() },
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
