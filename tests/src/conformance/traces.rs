//! Levels 2 and 3: the services' event traces (`platform::event_trace`, JSON
//! lines written with `--event-trace`) read back after every round and
//! translated into the events the oracle's event checks read
//! ([`crate::sim::Event`]), so the same checks run across processes.
//!
//! # How each event is rebuilt
//!
//! - **Transitions.** The driver writes, for every change of a run's nodes, the
//!   new state of each node that changed (current attempts, and the
//!   successors of a rollout's surge apart) and the cause: a client request, a
//!   received message with the fold's verdict, the timer's deadline folds, the
//!   deadline folds that open a pass, a pass's applied answer, a restore from
//!   the store (`run-started`). [`Translator`] keeps a copy of the run's nodes
//!   and turns each such line into a [`Transition`] with the full states before
//!   and after, as the simulation records them.
//! - **A pass's decisions** are those of its answer that the driver applied:
//!   none when the shape changed while the decider ran, and otherwise all but
//!   those the driver says it left stale (`stale_at`: their slot changed
//!   meanwhile, or they name an attempt the slot no longer holds).
//!   The transition's time is the pass's (what the decider decided at),
//!   with the time the answer was applied beside it (what the driver
//!   computes a backoff from), its `before` the nodes just before the answer
//!   was applied.
//! - **Passes** ([`Event::Pass`]): `pass-begun` says whether the run was
//!   converged when the decider was asked, `pass-decided` what the answer did.
//! - **Submissions.** An operation the executor received is paired with the
//!   driver's latest `dispatched` line for its id written before it arrived;
//!   `recorded` is whether the driver's last commit before that line held it
//!   pending (same id, effect and deadline), and the node in the submission's
//!   context is the driver's node at that line. An operation the driver never
//!   dispatched counts as not recorded.
//! - **Executor events** (starts, aborts, every result, observation and
//!   rejection it sent, replays and re-sends included) are the executor's own
//!   lines. A restarted executor (a new `started` line) runs nothing: whatever
//!   was running in the old process is taken as aborted.
//! - **Backend calls** ([`Event::BackendCall`]) are rebuilt from what the
//!   executor reports, since the backend's inside is not visible: a slot holds
//!   a resource of an attempt from a successful create that named a lease
//!   until a successful destroy; a session runs from a successful start (or a
//!   stage seen) until a final stage, a successful cancel or destroy; and a
//!   create result naming a lease not named before for its identity counts as
//!   a lease made.
//! - **The decider's answers** as it sent them become [`Cause::Answer`]
//!   transitions that change nothing, for the check that a pass decides each
//!   node once.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{Read as _, Seek as _, SeekFrom},
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use contract::{
    AttemptId, Effect, LogicalNodeId, Operation, Outcome, PendingOp, RunUid, SessionId, UnixMillis,
};
use driver_svc::core::{Discard, Fold};
use platform::event_trace::{Changes, Msg, TraceEvent, TraceLine, parse_line};

use crate::sim::{Cause, Event, Nodes, PassSummary, ToDriver, Transition};

/// A file being appended to by a service, read a whole line at a time.
#[derive(Debug)]
struct Follow {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl Follow {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            offset: 0,
            partial: Vec::new(),
        }
    }

    /// The lines written since the last read (a last line without its newline
    /// waits for the next read).
    fn read(&mut self) -> anyhow::Result<Vec<TraceLine>> {
        let mut f = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("opening {}", self.path.display())),
        };
        f.seek(SeekFrom::Start(self.offset))?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf)?;
        self.offset += buf.len() as u64;
        self.partial.extend_from_slice(&buf);
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return Ok(Vec::new());
        };
        let rest = self.partial.split_off(end + 1);
        let whole = std::mem::replace(&mut self.partial, rest);
        let text = String::from_utf8(whole).context("a trace line is not UTF-8")?;
        text.lines()
            .filter(|l| !l.is_empty())
            .map(|l| parse_line(l).with_context(|| format!("{}: cannot read {l:?}", self.path.display())))
            .collect()
    }
}

/// The three services' trace files of one system under test.
#[derive(Debug, Clone)]
pub struct TracePaths {
    pub driver: PathBuf,
    pub executor: PathBuf,
    pub decider: PathBuf,
}

impl TracePaths {
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            driver: dir.join("driver-events.jsonl"),
            executor: dir.join("executor-events.jsonl"),
            decider: dir.join("decider-events.jsonl"),
        }
    }
}

/// A deliberate corruption of what the traces say, to show that the checks
/// reading them across processes can fail (the binaries themselves carry no
/// mutants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceTamper {
    /// Each pass's commit is read as if it came after the pass's operations
    /// went to the link: what a driver that dispatches before it records
    /// would write. Guarantee 4 must catch it.
    DispatchBeforeCommit,
    /// A folded result is read as if it named the attempt before the one it
    /// names: what a driver that folds a result into the wrong attempt would
    /// write. Guarantee 2 must catch it.
    FoldIntoOtherAttempt,
}

/// One driver `dispatched` line, for pairing with the executor's receipt.
#[derive(Debug, Clone)]
struct Dispatch {
    t_us: u64,
    recorded: bool,
    node: Option<contract::ManagedNode>,
}

/// The pass in flight, as far as the driver's lines say.
#[derive(Debug, Clone)]
struct PassInFlight {
    converged: bool,
    /// Its opening deadline folds changed a node.
    changed: bool,
}

/// Reads the traces and rebuilds the oracle's events.
#[derive(Debug)]
pub struct Translator {
    driver: Follow,
    executor: Follow,
    decider: Follow,
    tamper: Option<TraceTamper>,
    /// The driver's nodes as its lines say: current attempts, and the
    /// successors of a rollout's surge.
    nodes: Nodes,
    successors: Nodes,
    /// Each attempt's pending operation as of the driver's last commit.
    committed: BTreeMap<(LogicalNodeId, AttemptId), Option<PendingOp>>,
    pass: Option<PassInFlight>,
    dispatches: BTreeMap<String, Vec<Dispatch>>,
    /// Every operation the executor received, by id.
    ops: BTreeMap<String, Operation>,
    running: BTreeMap<String, (RunUid, contract::OperationId)>,
    /// Result-derived backend model: attempts holding a resource per slot,
    /// running sessions and those that ended (a session that ended does not
    /// run again, even when a re-run start adopts it), leases seen per
    /// identity.
    live: BTreeMap<LogicalNodeId, BTreeSet<AttemptId>>,
    sessions: BTreeMap<(LogicalNodeId, AttemptId), SessionId>,
    ended: BTreeSet<SessionId>,
    leases: BTreeMap<(LogicalNodeId, AttemptId), BTreeSet<String>>,
    /// Operations whose success the backend model has taken (each once).
    modeled: BTreeSet<String>,
    /// A commit line held back by [`TraceTamper::DispatchBeforeCommit`].
    held_commit: bool,
    /// The run followed: its id, and its uid once its actor started. Lines
    /// of other runs (the driver's reclaim runs) are skipped.
    run_id: String,
    uid: Option<String>,
    /// Lines read so far, per service.
    pub lines: BTreeMap<String, u64>,
}

fn node_id(s: &str) -> anyhow::Result<LogicalNodeId> {
    Ok(LogicalNodeId::parse("node", s)?)
}

fn discard(name: &str) -> anyhow::Result<Discard> {
    Discard::ALL
        .into_iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| anyhow::anyhow!("unknown discard reason {name:?}"))
}

/// Merges lines of several files by time, keeping each file's own order.
fn merge(mut sources: Vec<Vec<TraceLine>>) -> Vec<TraceLine> {
    let mut heads: Vec<std::collections::VecDeque<TraceLine>> =
        sources.drain(..).map(std::collections::VecDeque::from).collect();
    let mut out = Vec::new();
    loop {
        let next = heads
            .iter()
            .enumerate()
            .filter_map(|(i, q)| q.front().map(|l| (l.t_us, i)))
            .min();
        let Some((_, i)) = next else { break };
        if let Some(l) = heads[i].pop_front() {
            out.push(l);
        }
    }
    out
}

impl Translator {
    /// Follows the traces at `paths` for the run named `run_id`.
    pub fn new(paths: &TracePaths, run_id: &str, tamper: Option<TraceTamper>) -> Self {
        Self {
            run_id: run_id.to_owned(),
            uid: None,
            driver: Follow::new(paths.driver.clone()),
            executor: Follow::new(paths.executor.clone()),
            decider: Follow::new(paths.decider.clone()),
            tamper,
            nodes: Nodes::new(),
            successors: Nodes::new(),
            committed: BTreeMap::new(),
            pass: None,
            dispatches: BTreeMap::new(),
            ops: BTreeMap::new(),
            running: BTreeMap::new(),
            live: BTreeMap::new(),
            sessions: BTreeMap::new(),
            ended: BTreeSet::new(),
            leases: BTreeMap::new(),
            modeled: BTreeSet::new(),
            held_commit: false,
            lines: BTreeMap::new(),
        }
    }

    /// The events written since the last call. The executor's file is read
    /// first: every operation it received was dispatched (and its line
    /// written) before, so the driver's file, read next, already holds it.
    pub fn events(&mut self) -> anyhow::Result<Vec<Event>> {
        let executor = self.executor.read()?;
        let driver = self.driver.read()?;
        let decider = self.decider.read()?;
        let mut out = Vec::new();
        for line in merge(vec![driver, executor, decider]) {
            *self.lines.entry(line.svc.clone()).or_default() += 1;
            self.line(line, &mut out)?;
        }
        Ok(out)
    }

    fn transition(
        &mut self,
        out: &mut Vec<Event>,
        at: UnixMillis,
        cause: Cause,
        changes: &Changes,
    ) -> anyhow::Result<()> {
        self.transition_applied(out, at, at, cause, changes)
    }

    /// A transition made for `at` and applied at `applied_at` (a pass's).
    fn transition_applied(
        &mut self,
        out: &mut Vec<Event>,
        at: UnixMillis,
        applied_at: UnixMillis,
        cause: Cause,
        changes: &Changes,
    ) -> anyhow::Result<()> {
        let before = self.nodes.clone();
        let successors_before = self.successors.clone();
        self.apply(changes)?;
        out.push(Event::Transition(Box::new(Transition {
            at,
            applied_at,
            cause,
            before,
            after: self.nodes.clone(),
            successors: self.successors_around(successors_before),
        })));
        // A shape the driver took of its own with the change (a revert).
        if let Some(shape) = &changes.shape {
            out.push(Event::Shape {
                shape: platform::event_trace::shape(shape)?,
                deleting: false,
            });
        }
        Ok(())
    }

    /// The successors around a transition, where either side holds one.
    fn successors_around(&self, before: Nodes) -> Option<Box<crate::sim::Successors>> {
        (!before.is_empty() || !self.successors.is_empty()).then(|| {
            Box::new(crate::sim::Successors {
                before,
                after: self.successors.clone(),
            })
        })
    }

    fn apply(&mut self, changes: &Changes) -> anyhow::Result<()> {
        for rec in &changes.changed {
            let n = rec.node().with_context(|| format!("node {}", rec.id))?;
            self.nodes.insert(n.id.clone(), n);
        }
        for id in &changes.removed {
            self.nodes.remove(&node_id(id)?);
        }
        for rec in &changes.successors {
            let n = rec.node().with_context(|| format!("successor {}", rec.id))?;
            self.successors.insert(n.id.clone(), n);
        }
        for id in &changes.successors_removed {
            self.successors.remove(&node_id(id)?);
        }
        Ok(())
    }

    fn commit(&mut self) {
        self.committed = self
            .nodes
            .values()
            .chain(self.successors.values())
            .map(|n| ((n.id.clone(), n.attempt), n.pending))
            .collect();
    }

    /// The node of the attempt an operation names: the slot's current
    /// attempt or its successor.
    fn node_of(&self, op: &Operation) -> Option<&contract::ManagedNode> {
        self.successors
            .get(&op.node)
            .filter(|n| n.attempt == op.id.attempt())
            .or_else(|| self.nodes.get(&op.node))
    }

    fn release_commit(&mut self) {
        if std::mem::take(&mut self.held_commit) {
            self.commit();
        }
    }

    /// Whether `e` belongs to the run followed (the first run with its id
    /// whose actor starts is the one).
    fn ours(&mut self, e: &TraceEvent) -> bool {
        let uid = match e {
            TraceEvent::Started => return true,
            TraceEvent::Decide { run_id, .. } => return *run_id == self.run_id,
            TraceEvent::RunStarted { run, run_id, .. } => {
                if self.uid.is_none() && *run_id == self.run_id {
                    self.uid = Some(run.clone());
                }
                run
            }
            TraceEvent::Request { run, .. }
            | TraceEvent::Received { run, .. }
            | TraceEvent::Deadlines { run, .. }
            | TraceEvent::PassBegun { run, .. }
            | TraceEvent::PassDecided { run, .. }
            | TraceEvent::PassFailed { run, .. }
            | TraceEvent::Committed { run }
            | TraceEvent::Dispatched { run, .. }
            | TraceEvent::Claim { run, .. }
            | TraceEvent::ClaimReceived { run, .. }
            | TraceEvent::CallCompleted { run, .. }
            | TraceEvent::CallAborted { run, .. }
            | TraceEvent::AckReceived { run, .. }
            | TraceEvent::ForgetReceived { run, .. } => run,
            TraceEvent::OpReceived { op, .. } | TraceEvent::CallStarted { op } => &op.run,
            TraceEvent::ResultOut { result, .. } => &result.run,
            TraceEvent::ObservationOut { obs, .. } => &obs.run,
            TraceEvent::RejectionOut { rejection } => &rejection.run,
            TraceEvent::ChangeOut { change, .. } => &change.run,
        };
        self.uid.as_ref() == Some(uid)
    }

    fn line(&mut self, line: TraceLine, out: &mut Vec<Event>) -> anyhow::Result<()> {
        if !self.ours(&line.event) {
            return Ok(());
        }
        let t_us = line.t_us;
        let executor = line.svc == "executor-svc";
        if self.held_commit && !matches!(line.event, TraceEvent::Dispatched { .. }) && !executor {
            self.release_commit();
        }
        let ms = UnixMillis::new;
        match line.event {
            TraceEvent::Started if executor => {
                // A new executor process: nothing of the old one runs.
                for (_, (run_uid, id)) in std::mem::take(&mut self.running) {
                    out.push(Event::Aborted { run_uid, id });
                }
            }
            TraceEvent::Started => {}
            TraceEvent::RunStarted {
                nodes,
                successors,
                shape,
                deleting,
                ..
            } => {
                out.push(Event::Shape {
                    shape: platform::event_trace::shape(&shape)?,
                    deleting,
                });
                let before = std::mem::take(&mut self.nodes);
                let successors_before = std::mem::take(&mut self.successors);
                for rec in &nodes {
                    let n = rec.node().with_context(|| format!("node {}", rec.id))?;
                    self.nodes.insert(n.id.clone(), n);
                }
                for rec in &successors {
                    let n = rec.node().with_context(|| format!("successor {}", rec.id))?;
                    self.successors.insert(n.id.clone(), n);
                }
                self.commit();
                self.pass = None;
                if !before.is_empty() || !self.nodes.is_empty() {
                    out.push(Event::Transition(Box::new(Transition {
                        at: ms(t_us / 1000),
                        applied_at: ms(t_us / 1000),
                        cause: Cause::Restore,
                        before,
                        after: self.nodes.clone(),
                        successors: self.successors_around(successors_before),
                    })));
                }
            }
            TraceEvent::Request {
                now_ms,
                what,
                outcome,
                shape,
                deleting,
                changes,
                ..
            } => {
                out.push(Event::Shape {
                    shape: platform::event_trace::shape(&shape)?,
                    deleting,
                });
                if what == "adopt-orphans" {
                    // Resources the run takes over from outside its own
                    // decisions, facts and all, as from a store.
                    if !changes.is_empty() {
                        self.transition(out, ms(now_ms), Cause::Restore, &changes)?;
                    }
                } else if !changes.is_empty() || (what == "shape" && outcome == "changed") {
                    self.transition(out, ms(now_ms), Cause::Apply, &changes)?;
                }
            }
            TraceEvent::Received {
                now_ms,
                msg,
                verdict,
                changes,
                ..
            } => {
                let msg = match msg {
                    Msg::Result(r) => {
                        let mut r = r.result()?;
                        if self.tamper == Some(TraceTamper::FoldIntoOtherAttempt)
                            && verdict == "folded"
                            && r.id.attempt().get() > 1
                        {
                            r.id = contract::OperationId::new(
                                AttemptId::new(r.id.attempt().get() - 1),
                                r.id.seq(),
                            );
                        }
                        ToDriver::Result(r)
                    }
                    Msg::Observation(o) => ToDriver::Observation(o.observation()?),
                    Msg::Rejection(r) => ToDriver::Rejection(r.rejection()?),
                    Msg::Change(c) => ToDriver::Change(c.resource_change()?),
                    Msg::Claimed { .. } => return Ok(()),
                };
                let verdict = match verdict.as_str() {
                    "folded" => Fold::Folded,
                    // Not folded: a fencing, or a claim lost at the executor.
                    "fenced" | "reclaim" => return Ok(()),
                    v => match v.strip_prefix("discarded:") {
                        Some(why) => Fold::Discarded(discard(why)?),
                        None => anyhow::bail!("the driver failed to fold {msg:?}: {v}"),
                    },
                };
                self.transition(out, ms(now_ms), Cause::Fold { msg, verdict }, &changes)?;
            }
            TraceEvent::Deadlines { now_ms, changes, .. } => {
                self.transition(out, ms(now_ms), Cause::Timer, &changes)?;
            }
            TraceEvent::PassBegun {
                now_ms,
                converged,
                changes,
                ..
            } => {
                self.pass = None;
                if !changes.is_empty() {
                    self.transition(out, ms(now_ms), Cause::Timer, &changes)?;
                }
                self.pass = Some(PassInFlight {
                    converged,
                    changed: !changes.is_empty(),
                });
            }
            TraceEvent::PassDecided {
                plan_now_ms,
                now_ms,
                stale_answer,
                decisions,
                actions,
                operations,
                transitions,
                stale_at,
                changes,
                ..
            } => {
                let pass = self.pass.take();
                // The driver says which decisions it left stale; the rest
                // it applied.
                let mut applied = Vec::new();
                if !stale_answer {
                    for (i, d) in decisions.iter().enumerate() {
                        if !stale_at.iter().any(|s| *s as usize == i) {
                            applied.push(d.decision()?);
                        }
                    }
                }
                let at = ms(plan_now_ms);
                self.transition_applied(out, at, ms(now_ms), Cause::Decisions(applied), &changes)?;
                out.push(Event::Pass(PassSummary {
                    at,
                    operations: operations as usize,
                    transitions,
                    converged_before: pass.as_ref().is_some_and(|p| p.converged),
                    actions: actions as usize,
                    changed: pass.as_ref().is_some_and(|p| p.changed) || !changes.is_empty(),
                }));
            }
            TraceEvent::PassFailed { .. } => self.pass = None,
            TraceEvent::Committed { .. } => {
                if self.tamper == Some(TraceTamper::DispatchBeforeCommit) {
                    self.held_commit = true;
                } else {
                    self.commit();
                }
            }
            TraceEvent::Dispatched { op, sent, .. } => {
                if sent {
                    let op = op.op()?;
                    let recorded = self
                        .committed
                        .get(&(op.node.clone(), op.id.attempt()))
                        .copied()
                        .flatten()
                        .is_some_and(|p| {
                            p.id == op.id && p.effect == op.input.effect() && p.deadline == op.deadline
                        });
                    let node = self.node_of(&op).cloned();
                    self.dispatches
                        .entry(op.id.to_string())
                        .or_default()
                        .push(Dispatch { t_us, recorded, node });
                }
            }
            TraceEvent::Claim { .. } | TraceEvent::ClaimReceived { .. } => {}
            TraceEvent::OpReceived { op, .. } => {
                let dispatch = self
                    .dispatches
                    .get(&op.id)
                    .and_then(|ds| ds.iter().rev().find(|d| d.t_us <= t_us))
                    .cloned();
                let op = op.op()?;
                out.push(Event::SubmitContext {
                    id: op.id,
                    node: dispatch.as_ref().and_then(|d| d.node.clone()).map(Box::new),
                    store_pending: None,
                });
                out.push(Event::Submitted {
                    op: op.clone(),
                    recorded: dispatch.is_some_and(|d| d.recorded),
                });
                self.ops.entry(op.id.to_string()).or_insert(op);
            }
            TraceEvent::CallStarted { op } => {
                let op = op.op()?;
                let attempt = op.id.attempt();
                out.push(Event::BackendCall {
                    op: op.clone(),
                    slot_attempts: self
                        .live
                        .get(&op.node)
                        .map(|a| a.iter().copied().collect())
                        .unwrap_or_default(),
                    session_running: self.sessions.contains_key(&(op.node.clone(), attempt)),
                    lease_made: false,
                    forced: None,
                });
                self.running.insert(op.id.to_string(), (op.run_uid, op.id));
                self.ops.entry(op.id.to_string()).or_insert_with(|| op.clone());
                out.push(Event::Started(op));
            }
            TraceEvent::CallCompleted { .. } => {}
            TraceEvent::CallAborted { run, id } => {
                if let Some((run_uid, id)) = self.running.remove(&id) {
                    out.push(Event::Aborted { run_uid, id });
                } else {
                    out.push(Event::Aborted {
                        run_uid: RunUid::parse("run", &run)?,
                        id: self
                            .ops
                            .get(&id)
                            .map(|op| op.id)
                            .ok_or_else(|| anyhow::anyhow!("aborted {id}, which was never received"))?,
                    });
                }
            }
            TraceEvent::ResultOut { result, .. } => {
                let r = result.result()?;
                if !r.late && !r.replayed {
                    self.running.remove(&result.id);
                }
                // The model takes each operation's success once, from its
                // first line. That is usually the fresh result; a replay or a
                // re-send repeats a stored result, which may be the first the
                // trace shows: an executor killed after it stored a result
                // and before it sent it re-sends it after its restart. (Only
                // a success changes the model; a late success can follow an
                // ambiguous result of the same operation.)
                if matches!(r.outcome, Outcome::Succeeded(_)) && self.modeled.insert(result.id.clone()) {
                    self.backend_model(&r, out);
                }
                out.push(Event::Emitted(ToDriver::Result(r)));
            }
            TraceEvent::ObservationOut { obs, replay } => {
                let o = obs.observation()?;
                if !replay {
                    let key = (o.node.clone(), o.attempt);
                    if o.stage.is_terminal() {
                        self.end_session(&key);
                        self.ended.insert(o.session.clone());
                    } else if !self.ended.contains(&o.session) {
                        self.sessions.insert(key, o.session.clone());
                    }
                }
                out.push(Event::Emitted(ToDriver::Observation(o)));
            }
            TraceEvent::RejectionOut { rejection } => {
                out.push(Event::Emitted(ToDriver::Rejection(rejection.rejection()?)));
            }
            TraceEvent::ChangeOut { change, .. } => {
                out.push(Event::Emitted(ToDriver::Change(change.resource_change()?)));
            }
            TraceEvent::AckReceived { changes, .. } => {
                if !changes.is_empty() {
                    out.push(Event::ChangesAcknowledged(changes));
                }
            }
            TraceEvent::ForgetReceived { .. } => {}
            TraceEvent::Decide {
                now_ms, decisions, ..
            } => {
                let decisions = decisions
                    .iter()
                    .map(|d| d.decision().map_err(anyhow::Error::from))
                    .collect::<anyhow::Result<Vec<_>>>()?;
                out.push(Event::Transition(Box::new(Transition {
                    at: ms(now_ms),
                    applied_at: ms(now_ms),
                    cause: Cause::Answer(decisions),
                    before: Nodes::new(),
                    after: Nodes::new(),
                    successors: None,
                })));
            }
        }
        Ok(())
    }

    fn end_session(&mut self, key: &(LogicalNodeId, AttemptId)) {
        if let Some(s) = self.sessions.remove(key) {
            self.ended.insert(s);
        }
    }

    /// Updates the result-derived backend model with `r`; a create naming a
    /// lease not seen before for its identity is a lease made.
    fn backend_model(&mut self, r: &contract::OperationResult, out: &mut Vec<Event>) {
        let key = (r.node.clone(), r.id.attempt());
        let Outcome::Succeeded(facts) = &r.outcome else {
            return;
        };
        match r.effect {
            Effect::CreateLease => {
                let Some(lease) = &facts.lease else { return };
                self.live
                    .entry(r.node.clone())
                    .or_default()
                    .insert(r.id.attempt());
                let new = self
                    .leases
                    .entry(key)
                    .or_default()
                    .insert(lease.as_str().to_owned());
                if let (true, Some(op)) = (new, self.ops.get(&r.id.to_string())) {
                    out.push(Event::BackendCall {
                        op: op.clone(),
                        slot_attempts: Vec::new(),
                        session_running: false,
                        lease_made: true,
                        forced: None,
                    });
                }
            }
            Effect::StartBootstrap => {
                if let Some(s) = &facts.session
                    && !self.ended.contains(s)
                {
                    self.sessions.insert(key, s.clone());
                }
            }
            Effect::CancelBootstrap => self.end_session(&key),
            Effect::DestroyLease => {
                self.end_session(&key);
                if let Some(a) = self.live.get_mut(&r.node) {
                    a.remove(&r.id.attempt());
                }
            }
            Effect::LookupEndpoint => {}
        }
    }
}

/// The last `n` lines of a trace file, shortened, for a failure report.
pub fn tail(path: &Path, n: usize) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| {
            let mut s: String = l.chars().take(400).collect();
            if l.len() > 400 {
                s.push('…');
            }
            s
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use platform::event_trace::EventTrace;

    #[test]
    fn a_file_is_followed_a_whole_line_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        let mut follow = Follow::new(path.clone());
        assert!(follow.read().unwrap().is_empty());
        let t = EventTrace::open("driver-svc", &path).unwrap();
        t.emit(TraceEvent::Committed { run: "r".to_owned() });
        assert_eq!(follow.read().unwrap().len(), 2);
        // Half a line waits for its end.
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(br#"{"t_us":1,"svc":"x","pid":1,"#).unwrap();
        assert!(follow.read().unwrap().is_empty());
        f.write_all(b"\"ev\":\"started\"}\n").unwrap();
        assert_eq!(follow.read().unwrap()[0].event, TraceEvent::Started);
    }

    /// An executor killed after it stored a destroy's result and before it
    /// sent it re-sends the result after its restart: that re-send is the
    /// first the trace shows of it, and the model must take it, or a new
    /// attempt's create looks like a second live attempt (G19).
    #[test]
    fn a_result_first_seen_as_a_resend_updates_the_backend_model() {
        use contract::{
            AttemptId, Epoch, LeaseId, LogicalNodeId, Operation, OperationId, OperationInput,
            OperationResult, Outcome, ResultFacts, RunId, RunUid, TraceContext,
        };
        use platform::event_trace::{OpRec, ResultRec, hex};
        let dir = tempfile::tempdir().unwrap();
        let paths = TracePaths {
            driver: dir.path().join("driver.jsonl"),
            executor: dir.path().join("executor.jsonl"),
            decider: dir.path().join("decider.jsonl"),
        };
        let shape = crate::shapes::shape("conf", 1, "fake", &[("ctrl", 1, "img:1")]);
        let uid = RunUid::from_u128(7);
        let node = LogicalNodeId::parse("node", "ctrl-0").unwrap();
        let op = |attempt: u64, seq: u32, input: OperationInput| Operation {
            run_uid: uid,
            run_id: RunId::parse("run_id", "conf").unwrap(),
            node: node.clone(),
            id: OperationId::new(AttemptId::new(attempt), seq),
            epoch: Epoch::new(1),
            deadline: UnixMillis::new(10_000),
            provider: "fake".into(),
            input,
            trace: TraceContext::default(),
        };
        let succeeded = |op: &Operation, lease: Option<&str>| OperationResult {
            run_uid: uid,
            node: node.clone(),
            id: op.id,
            effect: op.input.effect(),
            outcome: Outcome::Succeeded(ResultFacts {
                lease: lease.map(|l| LeaseId::new("lease", l).unwrap()),
                endpoint: None,
                session: None,
            }),
            completed_at: UnixMillis::new(1_000),
            late: false,
            replayed: false,
            trace: TraceContext::default(),
        };
        let template = shape.groups[0].template.clone();
        let create2 = op(
            2,
            1,
            OperationInput::CreateLease {
                template: template.clone(),
            },
        );
        let destroy2 = op(
            2,
            5,
            OperationInput::DestroyLease {
                lease: Some(LeaseId::new("lease", "lease-2").unwrap()),
            },
        );
        let create8 = op(8, 1, OperationInput::CreateLease { template });

        let driver = EventTrace::open("driver-svc", &paths.driver).unwrap();
        driver.emit(TraceEvent::RunStarted {
            run: uid.to_string(),
            run_id: "conf".to_owned(),
            epoch: 1,
            shape: hex(&contract::pb::ClusterShape::from(&shape)),
            deleting: false,
            nodes: Vec::new(),
            successors: Vec::new(),
        });
        let executor = EventTrace::open("executor-svc", &paths.executor).unwrap();
        executor.emit(TraceEvent::CallStarted {
            op: OpRec::of(&create2),
        });
        executor.emit(TraceEvent::ResultOut {
            result: ResultRec::of(&succeeded(&create2, Some("lease-2"))),
            resend: false,
        });
        executor.emit(TraceEvent::CallStarted {
            op: OpRec::of(&destroy2),
        });
        // Killed here; the next executor re-sends the stored result.
        executor.emit(TraceEvent::ResultOut {
            result: ResultRec::of(&succeeded(&destroy2, None)),
            resend: true,
        });
        executor.emit(TraceEvent::CallStarted {
            op: OpRec::of(&create8),
        });

        let events = Translator::new(&paths, "conf", None).events().unwrap();
        let held = events
            .iter()
            .find_map(|e| match e {
                Event::BackendCall {
                    op,
                    slot_attempts,
                    lease_made: false,
                    ..
                } if op.id == create8.id => Some(slot_attempts.clone()),
                _ => None,
            })
            .unwrap();
        assert!(held.is_empty(), "attempts still holding a resource: {held:?}");
    }

    #[test]
    fn merging_keeps_each_files_order() {
        let l = |t_us, svc: &str| TraceLine {
            t_us,
            svc: svc.to_owned(),
            pid: 1,
            event: TraceEvent::Started,
        };
        let merged = merge(vec![vec![l(5, "a"), l(3, "a")], vec![l(4, "b")]]);
        let order: Vec<(u64, &str)> = merged.iter().map(|l| (l.t_us, l.svc.as_str())).collect();
        assert_eq!(order, vec![(4, "b"), (5, "a"), (3, "a")]);
    }
}
