//! One task per run, the only writer of that run's state.
//!
//! The actor consumes a closed enum of events ([`RunEvent`]): client requests,
//! executor messages, link changes, the decider's answers and its own timers.
//! After each batch of events it starts a pass if one is wanted and none is
//! running, commits what changed (releasing the acknowledgements of committed
//! folds) unless a pass will carry it ([`RunActor::pass_carries`]: the pass's
//! commit writes the folds with its decisions), and publishes the run's
//! status. Every commit is persisted from this task, off the async workers
//! when the store may block ([`RunActor::persist`]): runs commit
//! concurrently, and a pass's operations and a batch's acknowledgements go
//! out only once their commit is durable. Passes follow work-queue rules:
//! one at a time; triggers while one is queued collapse (a pass is wanted when
//! anything is dirty or due, however many events made it so); a trigger during a
//! pass leaves a node dirty, which guarantees exactly one follow-up pass.
//!
//! The actor is also where the driver's spans are made (docs/observability.md,
//! "Traces"): one per pass, one per dispatched operation from dispatch to
//! the fold of its outcome, and one per fold. A pass carries out the client
//! request that changed the run (it is the request's child) or links to the
//! folds that made it necessary; a pass asked for only by the safety tick is
//! recorded only if it acts.

use std::{collections::HashMap, sync::Arc, time::Duration};

use contract::{
    Action, ClusterShape, DecideOutput, Effect, Event, EventReason, GroupId, LogicalNodeId, Monotonic,
    Operation, OperationId, RejectionReason, ResourceChange, RunUid, Subject, TraceContext, UnixMillis, pb,
};
use decider_svc::client::DecideError;
use platform::telemetry;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{Instrument as _, field::Empty};

use crate::{
    context::RunContext,
    core::{
        AbandonedNode, Applied, ApplyError, Commit, Fold, LinkSession, OrphanResource, PassPlan, Released,
        RunState, StoreError, ToExecutor,
    },
    crash,
    error::DriverError,
    events::{In, RunEvents, Verdict},
    link::{self, FromExecutor, LinkEvent},
    metrics::{CONTROLLER, QUEUE},
    status::{self, run_status},
};

/// The most span links a pass carries to the folds that made it necessary;
/// past this the pass still runs, names only its first causes, and counts
/// the others (`provisioning.pass.links_dropped`).
const MAX_CAUSES: usize = 16;

/// The status is rebuilt (O(nodes)) at most this often while only counts
/// move, and at most once per [`PUBLISH_COST_FACTOR`] times what the last
/// build took, times the run actors alive: at a million nodes a build takes
/// tens of milliseconds, and with a hundred runs of 10,000 changing at
/// once a fixed period spent 40% of the driver on statuses. At 10 the builds
/// were still 11% of the driver's samples converging a million nodes; at 20
/// a watcher of that run sees its counts about once a second. A phase
/// change is published at once.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);
const PUBLISH_COST_FACTOR: u32 = 20;

/// What makes a status change worth publishing at once: generation,
/// converged, deleting, paused, gone, halted.
type PhaseKey = (u64, bool, bool, bool, bool, bool);

/// What a run holds, for the inventory resync.
#[derive(Debug, Default)]
pub struct Held {
    /// Every node, at its current attempt and its successor's, if any.
    pub nodes: Vec<(LogicalNodeId, crate::orphans::Attempts)>,
    /// The nodes whose lease the run believes live and recorded before the
    /// inventory read began (none if it did not see the read begin).
    pub leases: Vec<(LogicalNodeId, contract::AttemptId)>,
}

/// Everything a run actor reacts to.
#[derive(Debug)]
pub enum RunEvent {
    /// `trace` is the client request's: the pass that carries the change
    /// out is its child.
    Apply {
        shape: ClusterShape,
        trace: TraceContext,
        reply: oneshot::Sender<Result<Applied, DriverError>>,
    },
    Delete {
        trace: TraceContext,
        reply: oneshot::Sender<Result<pb::RunStatus, DriverError>>,
    },
    SetPaused {
        paused: bool,
        trace: TraceContext,
        reply: oneshot::Sender<Result<pb::RunStatus, DriverError>>,
    },
    Promote {
        group: GroupId,
        trace: TraceContext,
        reply: oneshot::Sender<Result<pb::RunStatus, DriverError>>,
    },
    Get {
        include_nodes: bool,
        reply: oneshot::Sender<pb::RunStatus>,
    },
    Explain {
        node: LogicalNodeId,
        reply: oneshot::Sender<Option<pb::NodeExplanation>>,
    },
    /// A page of the run's nodes (`status::node_page`).
    Nodes {
        after: Option<LogicalNodeId>,
        slots: usize,
        reply: oneshot::Sender<pb::ListNodesResponse>,
    },
    Plan {
        shape: ClusterShape,
        reply: oneshot::Sender<Result<pb::PlanResponse, ApplyError>>,
    },
    /// The run's event log after `after` (at most `limit`, oldest first;
    /// 0: all kept), and the latest event's number.
    Events {
        after: u64,
        limit: usize,
        reply: oneshot::Sender<(Vec<Event>, u64)>,
    },
    /// An operator abandons a node: the run forgets it, commits, and answers
    /// with what the node left behind (`None`: no such node).
    Abandon {
        node: LogicalNodeId,
        reply: oneshot::Sender<Result<Option<AbandonedNode>, DriverError>>,
    },
    /// The inventory resync begins to read the executor's inventory: the
    /// run notes the leases it records from now on, which the read may not
    /// list. Answered once noted.
    InventoryReadBegins {
        reply: oneshot::Sender<()>,
    },
    /// The read failed: nothing more to note.
    InventoryReadEnds,
    /// The inventory resync has read the inventory and asks which (node,
    /// attempt) pairs the run holds, and which of them hold a lease the run
    /// believed live before the read began and still does. Ends the read.
    Holdings {
        reply: oneshot::Sender<Held>,
    },
    /// The inventory resync found these leases missing from the executor's
    /// inventory at two consecutive looks: they are lost.
    Missing {
        nodes: Vec<(LogicalNodeId, contract::AttemptId)>,
    },
    /// The orphan sweep hands the run resources of its own that no node
    /// holds, to destroy through its deletion path; the answer says which
    /// were adopted (a held slot, a pass in flight or a halted run refuses).
    AdoptOrphans {
        orphans: Vec<OrphanResource>,
        reply: oneshot::Sender<Result<Vec<bool>, DriverError>>,
    },
    FromExecutor(FromExecutor),
    LinkUp(u64),
    LinkDown,
    /// The executor's providers changed: the run's conditions may name one.
    Providers,
    Decided {
        plan: PassPlan,
        result: Result<DecideOutput, DecideError>,
    },
    /// The driver is shutting down: finish (abandon) the pass in flight, end
    /// the spans still open so they are exported, stop, and say so.
    Shutdown {
        done: oneshot::Sender<()>,
    },
}

impl From<LinkEvent> for RunEvent {
    fn from(ev: LinkEvent) -> Self {
        match ev {
            LinkEvent::Up(generation) => Self::LinkUp(generation),
            LinkEvent::Down => Self::LinkDown,
            LinkEvent::Message(msg) => Self::FromExecutor(msg),
            LinkEvent::Providers => Self::Providers,
        }
    }
}

/// Why a pass's decisions were not carried out.
#[derive(Debug, thiserror::Error)]
enum PassError {
    #[error(transparent)]
    Core(#[from] crate::core::CoreError),
    #[error("the store refused the pass's write: {0}")]
    Store(StoreError),
}

/// A handle to a run's actor.
#[derive(Debug, Clone)]
pub struct RunHandle {
    pub uid: RunUid,
    pub tx: mpsc::UnboundedSender<RunEvent>,
    pub status: watch::Receiver<Arc<pb::RunStatus>>,
    /// The latest committed event's number and count: it moves when the
    /// run's event log gains an event or the latest repeats.
    pub events: watch::Receiver<(u64, u32)>,
}

pub(crate) struct RunActor {
    /// Notices steps of the wall clock, which the run's deadlines follow
    /// ([`RunActor::follow_clock_step`]).
    steps: contract::StepWatch,
    run: RunState,
    shared: Arc<RunContext>,
    rx: mpsc::UnboundedReceiver<RunEvent>,
    tx: mpsc::UnboundedSender<RunEvent>,
    status: watch::Sender<Arc<pb::RunStatus>>,
    /// The latest committed event (see [`RunHandle::events`]).
    event_mark: watch::Sender<(u64, u32)>,
    /// The executor link went down after being up, and is not back yet: its
    /// return is an event.
    link_lost: bool,
    /// The providers the run names that were unavailable at the last look.
    providers_down: Vec<String>,
    /// What goes on the executor link, and when (claims, resubmissions,
    /// replay cursors, acknowledgements): the same session logic the
    /// simulation runs.
    session: LinkSession,
    pass_in_flight: bool,
    /// The admission room reserved for the pass in flight.
    reserved: usize,
    /// Moves when another run gives admission room back while this one
    /// (or another) waits for it.
    freed: watch::Receiver<u64>,
    decider_failures: u32,
    /// Why the decider cannot be reached, while it cannot (a condition).
    decider_down: Option<String>,
    /// Each condition's last change.
    conditions: status::Conditions,
    decider_retry_at: Option<Monotonic>,
    next_safety_tick: Monotonic,
    changed: bool,
    /// When the status was last published, and the phase it showed: the
    /// status (O(nodes) to build) is published at most every
    /// `PUBLISH_EVERY`, except that a phase change goes out at once.
    last_publish: Option<(Monotonic, PhaseKey)>,
    /// The period of count-only publications: [`PUBLISH_EVERY`], or longer
    /// when the last build was slow.
    publish_every: Duration,
    /// Set when the store refused a write: the run does nothing more.
    halted: Option<String>,
    /// The span of the pass in flight, and when that pass started.
    pass_span: Option<tracing::Span>,
    pass_started: Option<Monotonic>,
    /// The pass in flight was asked for only by the safety tick.
    pass_speculative: bool,
    /// The last safety tick found nothing to do, and nothing has happened
    /// since: the pass it asks for is speculative.
    speculative: bool,
    /// The client request whose change the next pass carries out.
    origin: Option<TraceContext>,
    /// The folds since the last pass started; the next pass links to them.
    causes: Vec<telemetry::Cause>,
    /// The latest client request that changed the run, numbered: the
    /// operations it causes link to it (see [`RunActor::dispatch`]).
    request: Option<(u64, telemetry::Cause)>,
    requests: u64,
    /// Each node's latest fold that changed it, with the number of the
    /// latest request then: its next operation links to it, so that a
    /// node's life is one path of links however many passes it spans.
    node_causes: HashMap<LogicalNodeId, (u64, telemetry::Cause)>,
    /// Causes past [`MAX_CAUSES`] since the last pass began.
    causes_dropped: u64,
    /// Since when the run has wanted a pass that has not started (the work
    /// queue's view of this run).
    wanted_since: Option<Monotonic>,
    /// Every operation recorded pending, with its span until its outcome is
    /// folded.
    in_flight: HashMap<OperationId, InFlight>,
    /// The run's deadline folds already matched to their operations.
    deadline_folds_seen: u64,
    /// Set by `Shutdown`: start nothing new, stop once no pass is in flight.
    stopping: Option<oneshot::Sender<()>>,
    /// The run's lines of the event trace (nothing when it is off).
    events: RunEvents,
}

/// A pending operation as the actor tracks it for spans and metrics.
#[derive(Debug)]
struct InFlight {
    node: LogicalNodeId,
    effect: Effect,
    dispatched_at: UnixMillis,
    /// `Span::none()` for operations restored from the store: their dispatch
    /// belonged to an earlier process.
    span: tracing::Span,
    /// What the executor last said it waits for before starting the call
    /// (a budget), if it waits.
    waiting: Option<String>,
}

impl std::fmt::Debug for RunActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunActor")
            .field("run", &self.run.run_id())
            .finish_non_exhaustive()
    }
}

impl RunActor {
    /// Spawns the actor for `run` and returns its handle. `origin` is the
    /// trace of the request that created the run, if one did.
    pub(crate) fn spawn(run: RunState, shared: Arc<RunContext>, origin: TraceContext) -> RunHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let request = telemetry::Cause::from_trace(&origin).map(|c| (1, c));
        let now = shared.clock.now();
        let (status, status_rx) = watch::channel(Arc::new(run_status(&run, false, now)));
        let (event_mark, events_rx) = watch::channel(run.event_mark());
        let conditions = status::Conditions::from_marks(&run.meta().conditions);
        let uid = run.uid();
        let in_flight: HashMap<OperationId, InFlight> = run
            .inflight_operations()
            .into_iter()
            .map(|op| {
                let dispatched_at = run
                    .node(&op.node)
                    .and_then(|n| n.pending)
                    .map_or(now, |p| p.dispatched_at);
                let f = InFlight {
                    node: op.node.clone(),
                    effect: op.input.effect(),
                    dispatched_at,
                    span: tracing::Span::none(),
                    waiting: None,
                };
                (op.id, f)
            })
            .collect();
        for f in in_flight.values() {
            shared.metrics.exported.in_flight.add(&[f.effect.name()], 1.0);
        }
        let deadline_folds_seen = run.counters().deadline_folds;
        let events = RunEvents::started(&run);
        let mut actor = RunActor {
            steps: contract::StepWatch::new(shared.clock.as_ref()),
            next_safety_tick: shared.clock.monotonic().saturating_add(shared.safety_tick),
            run,
            shared: shared.clone(),
            rx,
            tx: tx.clone(),
            status,
            event_mark,
            link_lost: false,
            providers_down: Vec::new(),
            session: LinkSession::new(),
            pass_in_flight: false,
            reserved: 0,
            freed: shared.admission.freed(),
            decider_failures: 0,
            decider_down: None,
            conditions,
            decider_retry_at: None,
            changed: true,
            last_publish: None,
            publish_every: PUBLISH_EVERY,
            halted: None,
            pass_span: None,
            pass_started: None,
            pass_speculative: false,
            speculative: false,
            origin: (!origin.traceparent.is_empty()).then_some(origin),
            causes: Vec::new(),
            request,
            requests: 1,
            node_causes: HashMap::new(),
            causes_dropped: 0,
            wanted_since: None,
            in_flight,
            deadline_folds_seen,
            stopping: None,
            events,
        };
        // The first status a watcher sees carries the conditions too.
        let first = actor.status(false, now);
        actor.status.send_replace(Arc::new(first));
        // A new or restored run wants its first pass at once.
        actor.want();
        let route = tx.clone();
        shared.link.register(uid, move |ev| route.send(ev.into()).is_ok());
        shared.actors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::spawn(actor.run());
        RunHandle {
            uid,
            tx,
            status: status_rx,
            events: events_rx,
        }
    }

    fn now(&self) -> UnixMillis {
        self.shared.clock.now()
    }

    /// Moves the run's deadlines with a step of the wall clock: the wall
    /// clock moved against the monotonic one by [`contract::StepWatch::STEP`] or more since
    /// the last look (NTP stepping it, an operator setting it). Slewing moves
    /// both together and is not a step.
    fn follow_clock_step(&mut self) {
        let _ = self.now_following_steps();
    }

    /// The wall time now, with the run's deadlines moved first if the clock
    /// stepped since the last look (the step and the time come from one
    /// reading; see [`contract::StepWatch::read`]). What compares the time
    /// with the run's deadlines (timeouts, passes, folds) reads it here.
    fn now_following_steps(&mut self) -> UnixMillis {
        let (now, step) = self.steps.read(self.shared.clock.as_ref());
        if let Some(by) = step {
            let moved = self.run.shift_deadlines(by);
            tracing::warn!(
                run = %self.run.run_id(),
                step_ms = by,
                nodes = moved,
                "the wall clock stepped: the run's deadlines moved with it"
            );
            self.changed = true;
            // A pass commits the moved records (and decides on them).
            self.want();
        }
        now
    }

    async fn run(mut self) {
        loop {
            self.follow_clock_step();
            let sleep = self.next_wake().saturating_since(self.monotonic());
            tokio::select! {
                ev = self.rx.recv() => {
                    let Some(ev) = ev else { break };
                    self.handle(ev).await;
                    // Drain what else is queued: one commit and one pass for the batch.
                    while let Ok(ev) = self.rx.try_recv() {
                        self.handle(ev).await;
                    }
                }
                () = tokio::time::sleep(sleep) => self.on_timer(),
                // Room came back, and this run has nodes waiting for it.
                _ = self.freed.changed(), if self.run.dispatch_held_count() > 0 && !self.pass_in_flight => {}
            }
            if self.stopping.is_some() && !self.pass_in_flight {
                self.stop().await;
                break;
            }
            self.maybe_pass();
            let carried = self.pass_carries();
            if carried {
                self.send_released();
            } else {
                let _ = self.commit().await;
            }
            self.settle_deadline_folds();
            self.publish();
            if self.run.uncommitted() && !carried {
                // The conditions changed (and with them, maybe, the event
                // log): stored now, not with whatever happens next.
                let _ = self.commit().await;
            }
            if self.run.is_gone() {
                self.finish().await;
                break;
            }
            self.settle_admission();
        }
        self.shared.admission.forget(self.run.uid());
        self.shared
            .actors
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// States what the run holds against the admission limit: its pending
    /// operations, and the room reserved for a pass in flight.
    fn settle_admission(&mut self) {
        if !self.pass_in_flight {
            self.reserved = 0;
        }
        let holding = self.run.pending_operations() + self.reserved;
        let held = self.run.dispatch_held_count();
        self.shared.admission.settle(self.run.uid(), holding, held);
    }

    /// Stops for a driver shutdown. Everything the run did is committed; the
    /// spans of operations still pending end now, marked `unfinished`, so the
    /// executor's spans under them keep their parent in the exported trace.
    /// After a restart the operations are resubmitted under the pass that
    /// dispatched them.
    async fn stop(&mut self) {
        let _ = self.commit().await;
        let now = self.now();
        let left: Vec<OperationId> = self.in_flight.keys().copied().collect();
        for id in left {
            self.close_operation(id, "unfinished", now);
        }
        self.unwant(false);
        if let Some(done) = self.stopping.take() {
            let _ = done.send(());
        }
    }

    /// Monotonic time, from the injected clock (as is `now`'s wall time).
    fn monotonic(&self) -> Monotonic {
        self.shared.clock.monotonic()
    }

    /// The earliest of the run's own deadline, the decider retry and the
    /// safety tick.
    fn next_wake(&self) -> Monotonic {
        let mut wake = self.next_safety_tick;
        if self.changed
            && let Some((at, _)) = self.last_publish
        {
            wake = wake.min(at.saturating_add(self.publish_every));
        }
        if let Some(t) = self.run.poll_timeout() {
            wake = wake.min(self.monotonic_of(t));
        }
        if let Some(t) = self.decider_retry_at {
            wake = wake.min(t);
        }
        wake
    }

    /// Where a wall-clock deadline falls on the monotonic timeline, as the
    /// clock reads now.
    fn monotonic_of(&self, t: UnixMillis) -> Monotonic {
        self.monotonic().saturating_add(t.saturating_since(self.now()))
    }

    fn on_timer(&mut self) {
        // A step is followed before anything reads the stepped clock.
        let now = self.now_following_steps();
        let before = self.events.before(&self.run);
        match self.run.handle_timeout(now) {
            Ok(n) if n > 0 => {
                self.changed = true;
                self.speculative = false;
                self.events.deadlines(before, &self.run, now, n);
            }
            Ok(_) => {}
            Err(e) => tracing::error!(run = %self.run.run_id(), error = %e, "folding deadlines failed"),
        }
        let at = self.monotonic();
        if self.decider_retry_at.is_some_and(|t| t <= at) {
            self.decider_retry_at = None;
        }
        if self.next_safety_tick <= at {
            self.next_safety_tick = at.saturating_add(self.shared.safety_tick);
            // A tick that finds nothing due asks for a pass only in case
            // something was missed; that pass is traced only if it acts.
            self.speculative = !self.run.needs_pass(now);
            self.run.mark_all_dirty();
            self.ask_quiet_sessions();
        }
        // Something is due (a deadline, a retry, the tick); if not, the next
        // `maybe_pass` finds nothing to do and takes the run off the queue.
        self.want();
    }

    /// On each safety tick, sessions still bootstrapping that made no
    /// progress since the previous one are asked for their stages again
    /// ([`LinkSession::handle_safety_tick`]).
    fn ask_quiet_sessions(&mut self) {
        let asked = self.session.handle_safety_tick(&self.run);
        if asked > 0 {
            tracing::debug!(run = %self.run.run_id(), sessions = asked,
                "bootstrap sessions without progress since the last tick: asking for their stages again");
            self.shared
                .metrics
                .exported
                .sessions_asked_again
                .add(&[], asked as u64);
        }
    }

    /// The run wants a pass: it joins the work queue unless it is on it.
    fn want(&mut self) {
        if self.wanted_since.is_none() {
            self.wanted_since = Some(self.monotonic());
            let e = &self.shared.metrics.exported;
            e.queue_depth.add(&[QUEUE], 1.0);
            e.queue_adds.inc(&[QUEUE]);
        }
    }

    /// The run leaves the work queue: its pass started (the wait is
    /// measured), or there turned out to be nothing to do.
    fn unwant(&mut self, started: bool) {
        if let Some(since) = self.wanted_since.take() {
            let e = &self.shared.metrics.exported;
            e.queue_depth.add(&[QUEUE], -1.0);
            if started {
                let waited = self.shared.clock.monotonic().saturating_since(since);
                e.queue_duration.observe_duration(&[QUEUE], waited);
            }
        }
    }

    /// Something changed the run: the next pass is real work.
    fn triggered(&mut self) {
        self.speculative = false;
        self.want();
    }

    async fn handle(&mut self, ev: RunEvent) {
        let now = self.now_following_steps();
        match ev {
            RunEvent::Apply { shape, trace, reply } => {
                if let Some(why) = &self.halted {
                    let _ = reply.send(Err(DriverError::Halted(why.clone())));
                    return;
                }
                let before = self.events.before(&self.run);
                let undo = self.run.request_undo();
                let result = self.run.apply_shape(shape).map_err(DriverError::from);
                self.events
                    .request(before, &self.run, now, "shape", || match &result {
                        Ok(Applied::Changed) => "changed".to_owned(),
                        Ok(Applied::Unchanged) => "unchanged".to_owned(),
                        Err(e) => format!("rejected: {e}"),
                    });
                let result = match result {
                    // The accepted shape is stored before the client hears so.
                    Ok(Applied::Changed) => {
                        let generation = self.run.shape().generation;
                        self.run.record_event(
                            EventReason::Applied,
                            Subject::Run,
                            format!("generation {generation} applied"),
                            now,
                        );
                        self.request_changed(trace);
                        let committed = self.commit().await.map(|()| Applied::Changed);
                        if committed.is_err() {
                            // Not stored, so not made: no read shows it.
                            self.run.undo_request(undo);
                        }
                        // Health policies apply at once and replace nothing.
                        self.session.handle_shape_changed(&self.run);
                        self.flush();
                        if committed.is_ok() {
                            crash::hit(crash::Point::ApplyCommitted);
                        }
                        committed
                    }
                    other => other,
                };
                self.changed = true;
                let _ = reply.send(result);
            }
            RunEvent::Delete { trace, reply } => {
                let before = self.events.before(&self.run);
                let undo = self.run.request_undo();
                let result = match &self.halted {
                    Some(why) => Err(DriverError::Halted(why.clone())),
                    None if self.run.delete() => {
                        self.run.record_event(
                            EventReason::Deleting,
                            Subject::Run,
                            "deletion requested: every node is cleaned up, then the run is gone".to_owned(),
                            now,
                        );
                        self.request_changed(trace);
                        let committed = self.commit().await;
                        if committed.is_ok() {
                            crash::hit(crash::Point::DeleteCommitted);
                        } else {
                            self.run.undo_request(undo);
                        }
                        committed
                    }
                    None => Ok(()),
                };
                self.events
                    .request(before, &self.run, now, "delete", || format!("{result:?}"));
                self.changed = true;
                let _ = reply.send(result.map(|()| self.status(false, now)));
            }
            RunEvent::SetPaused { paused, trace, reply } => {
                let before = self.events.before(&self.run);
                let undo = self.run.request_undo();
                let result = match &self.halted {
                    Some(why) => Err(DriverError::Halted(why.clone())),
                    None if self.run.set_paused(paused) => {
                        let (reason, message) = if paused {
                            (
                                EventReason::Paused,
                                "paused: nothing new is started until it is resumed",
                            )
                        } else {
                            (EventReason::Resumed, "resumed")
                        };
                        self.run
                            .record_event(reason, Subject::Run, message.to_owned(), now);
                        self.request_changed(trace);
                        let committed = self.commit().await;
                        if committed.is_err() {
                            self.run.undo_request(undo);
                        }
                        committed
                    }
                    None => Ok(()),
                };
                let what = if paused { "pause" } else { "resume" };
                self.events
                    .request(before, &self.run, now, what, || format!("{result:?}"));
                self.changed = true;
                let _ = reply.send(result.map(|()| self.status(false, now)));
            }
            RunEvent::Promote { group, trace, reply } => {
                let before = self.events.before(&self.run);
                let undo = self.run.request_undo();
                let result = match &self.halted {
                    Some(why) => Err(DriverError::Halted(why.clone())),
                    None => match self.run.promote(&group, now) {
                        Err(e) => Err(DriverError::Promote(e)),
                        Ok(false) => Ok(()),
                        Ok(true) => {
                            self.request_changed(trace);
                            let committed = self.commit().await;
                            if committed.is_err() {
                                self.run.undo_request(undo);
                            }
                            committed
                        }
                    },
                };
                self.events
                    .request(before, &self.run, now, "promote", || format!("{result:?}"));
                self.changed = true;
                let _ = reply.send(result.map(|()| self.status(false, now)));
            }
            RunEvent::Get { include_nodes, reply } => {
                let _ = reply.send(self.status(include_nodes, now));
            }
            RunEvent::Explain { node, reply } => {
                let _ = reply.send(self.explain(&node, now));
            }
            RunEvent::Nodes { after, slots, reply } => {
                let _ = reply.send(crate::status::node_page(&self.run, after.as_ref(), slots));
            }
            RunEvent::Plan { shape, reply } => {
                let _ = reply.send(self.plan(shape, now));
            }
            RunEvent::Events { after, limit, reply } => {
                let take = if limit == 0 { usize::MAX } else { limit };
                let events = self
                    .run
                    .events()
                    .filter(|e| e.seq > after)
                    .take(take)
                    .cloned()
                    .collect();
                let _ = reply.send((events, self.run.event_mark().0));
            }
            RunEvent::Abandon { node, reply } => {
                let before = self.events.before(&self.run);
                let result = match &self.halted {
                    Some(why) => Err(DriverError::Halted(why.clone())),
                    None => match self.run.abandon(&node, now) {
                        Some(left) => {
                            // The pending operation's span ends here: its
                            // outcome will never be folded.
                            let ops: Vec<OperationId> = self
                                .in_flight
                                .iter()
                                .filter(|(_, f)| f.node == node)
                                .map(|(id, _)| *id)
                                .collect();
                            for id in ops {
                                self.close_operation(id, "abandoned", now);
                            }
                            self.triggered();
                            self.commit().await.map(|()| Some(left))
                        }
                        None => Ok(None),
                    },
                };
                let outcome = || format!("{:?}", result.as_ref().map(Option::is_some));
                self.events.request(before, &self.run, now, "abandon", outcome);
                self.changed = true;
                let _ = reply.send(result);
            }
            RunEvent::Holdings { reply } => {
                let _ = reply.send(Held {
                    nodes: self
                        .run
                        .nodes()
                        .map(|n| {
                            let attempts = crate::orphans::Attempts {
                                current: n.attempt,
                                successor: self.run.successor(&n.id).map(|s| s.attempt),
                            };
                            (n.id.clone(), attempts)
                        })
                        .collect(),
                    leases: self.run.leases_held_through_read(),
                });
            }
            RunEvent::InventoryReadBegins { reply } => {
                self.run.inventory_read_begins();
                let _ = reply.send(());
            }
            RunEvent::InventoryReadEnds => self.run.inventory_read_ends(),
            RunEvent::Missing { nodes } => {
                for (node, attempt) in nodes {
                    let lost = ResourceChange {
                        run_uid: self.run.uid(),
                        node,
                        attempt,
                        seq: 0,
                        change: contract::Change::Lost {
                            reason: "missing from the executor's inventory at two consecutive looks"
                                .to_owned(),
                        },
                        at: now,
                        trace: TraceContext::default(),
                    };
                    self.on_executor_message(FromExecutor::Change(lost), now);
                }
            }
            RunEvent::AdoptOrphans { orphans, reply } => {
                let result = match &self.halted {
                    Some(why) => Err(DriverError::Halted(why.clone())),
                    None => {
                        let before = self.events.before(&self.run);
                        let adopted: Vec<bool> = orphans.iter().map(|o| self.run.adopt_orphan(o)).collect();
                        let outcome = || format!("adopted {adopted:?}");
                        self.events
                            .request(before, &self.run, now, "adopt-orphans", outcome);
                        if adopted.iter().any(|a| *a) {
                            // Recorded before the sweep hears so; the pass
                            // that cleans them up follows.
                            self.triggered();
                            self.commit().await.map(|()| adopted)
                        } else {
                            Ok(adopted)
                        }
                    }
                };
                self.changed = true;
                let _ = reply.send(result);
            }
            RunEvent::FromExecutor(msg) => self.on_executor_message(msg, now),
            RunEvent::LinkUp(generation) => {
                self.link_up(generation);
                if std::mem::take(&mut self.link_lost) {
                    self.run.record_event(
                        EventReason::DependencyBack,
                        Subject::Run,
                        "the executor link is back; pending operations are resubmitted".to_owned(),
                        now,
                    );
                }
                self.changed = true;
            }
            RunEvent::LinkDown => {
                if self.session.link().is_some() && !self.run.is_gone() {
                    self.link_lost = true;
                    self.run.record_event(
                        EventReason::DependencyLost,
                        Subject::Run,
                        "the executor link is down; operations wait until it is back".to_owned(),
                        now,
                    );
                }
                self.session.handle_link_down();
                self.changed = true;
            }
            RunEvent::Providers => {
                let down = self.providers_down();
                if down != self.providers_down {
                    let (reason, message) = if down.is_empty() {
                        (
                            EventReason::DependencyBack,
                            format!("provider {} is available again", self.providers_down.join(", ")),
                        )
                    } else {
                        (
                            EventReason::DependencyLost,
                            format!(
                                "provider {} is unavailable at the executor; its operations wait",
                                down.join(", ")
                            ),
                        )
                    };
                    if !self.run.is_gone() {
                        self.run.record_event(reason, Subject::Run, message, now);
                    }
                    self.providers_down = down;
                }
                self.changed = true;
            }
            RunEvent::Decided { plan, result } => self.decided(plan, result, now).await,
            RunEvent::Shutdown { done } => self.stopping = Some(done),
        }
    }

    /// A client request changed the run: the pass that carries the change out
    /// is the request's child (the latest request's, if several arrive).
    fn request_changed(&mut self, trace: TraceContext) {
        if let Some(cause) = telemetry::Cause::from_trace(&trace) {
            self.requests += 1;
            self.request = Some((self.requests, cause));
        }
        if !trace.traceparent.is_empty() {
            self.origin = Some(trace);
        }
        self.triggered();
    }

    fn explain(&self, node: &LogicalNodeId, now: UnixMillis) -> Option<pb::NodeExplanation> {
        let pending = self.run.node(node)?.pending;
        // What the node waits on when a service it needs is down says so,
        // rather than "in flight".
        let executor_note = if let Some(why) = &self.decider_down {
            format!("the decider cannot be reached ({why}); nothing is decided until it is back")
        } else if self.run.is_dispatch_held(node)
            && let Some(limit) = self.shared.admission.limit()
        {
            format!(
                "waiting for room to dispatch: the driver's runs hold {} of {limit} operations in flight \
                 (--max-operations-in-flight)",
                self.shared.admission.holding()
            )
        } else if pending.is_some() && self.session.link().is_none() {
            "the executor link is down; the pending operation is resubmitted when it is back".to_owned()
        } else {
            pending
                .and_then(|p| self.in_flight.get(&p.id))
                .and_then(|f| f.waiting.clone())
                .unwrap_or_default()
        };
        status::explanation(&self.run, node, now, executor_note)
    }

    fn plan(&self, shape: ClusterShape, now: UnixMillis) -> Result<pb::PlanResponse, ApplyError> {
        // The plan is checked against the same revision contract as an apply,
        // on a copy, so that a plan never promises what an apply would refuse.
        let mut probe = self.run.clone();
        probe.apply_shape(shape.clone())?;
        Ok(status::plan(&self.run, &probe, &shape, now))
    }

    fn on_executor_message(&mut self, mut msg: FromExecutor, now: UnixMillis) {
        match &mut msg {
            FromExecutor::Result(r) => self.run.intern(&mut r.node),
            FromExecutor::Observation(o) => self.run.intern(&mut o.node),
            FromExecutor::Change(c) => self.run.intern(&mut c.node),
            FromExecutor::Claimed(_) | FromExecutor::Rejection(_) | FromExecutor::Waiting(_) => {}
        }
        let folded = match msg {
            FromExecutor::Waiting(w) => {
                // Not state: only what `explain` tells of the pending call.
                if let Some(f) = self.in_flight.get_mut(&w.id) {
                    f.waiting = w.reason;
                }
                return;
            }
            FromExecutor::Claimed(epoch) => {
                self.events.received(
                    None,
                    &self.run,
                    now,
                    In::Claimed(epoch),
                    Verdict::Other("claimed"),
                );
                tracing::debug!(run = %self.run.run_id(), %epoch, "claim accepted");
                return;
            }
            FromExecutor::Result(r) => {
                // The fold is the child of the executor's span that produced
                // the result: the trace crosses back into the driver here.
                // `fold` is one of `telemetry::UNLOGGED_SPANS`: a log line in
                // a fold names its run and node itself.
                let span = tracing::info_span!(
                    parent: None,
                    "fold",
                    otel.name = "fold result",
                    provisioning.run.id = %self.run.run_id(),
                    provisioning.node.id = %r.node,
                    provisioning.operation.id = %r.id,
                    provisioning.operation.effect = r.effect.name(),
                    provisioning.operation.outcome = r.outcome.class_name(),
                    provisioning.fold.discarded = Empty,
                );
                telemetry::set_parent(&span, &r.trace);
                let _entered = span.enter();
                let before = self.events.before(&self.run);
                let folded = self.run.fold_result(&r, now);
                self.events
                    .received(before, &self.run, now, In::Result(&r), Verdict::Fold(&folded));
                match &folded {
                    Ok(Fold::Folded) => {
                        self.shared.metrics.exported.folds.inc(&["result"]);
                        self.close_operation(r.id, r.outcome.class_name(), now);
                        self.caused_by(&span, &r.node);
                    }
                    Ok(Fold::Discarded(why)) => self.discarded(&span, "result", why.name()),
                    Err(_) => {}
                }
                folded
            }
            FromExecutor::Observation(o) => {
                let span = tracing::info_span!(
                    parent: None,
                    "fold",
                    otel.name = "fold observation",
                    provisioning.run.id = %self.run.run_id(),
                    provisioning.node.id = %o.node,
                    provisioning.bootstrap.session = %o.session,
                    provisioning.bootstrap.seq = telemetry::int(o.seq),
                    provisioning.bootstrap.stage = o.stage.name(),
                    provisioning.fold.discarded = Empty,
                );
                telemetry::set_parent(&span, &o.trace);
                let _entered = span.enter();
                let before = self.events.before(&self.run);
                let folded = self.run.fold_observation(&o, now);
                self.events.received(
                    before,
                    &self.run,
                    now,
                    In::Observation(&o),
                    Verdict::Fold(&folded),
                );
                match &folded {
                    Ok(Fold::Folded) => {
                        self.shared.metrics.exported.folds.inc(&["observation"]);
                        self.caused_by(&span, &o.node);
                    }
                    Ok(Fold::Discarded(why)) => self.discarded(&span, "observation", why.name()),
                    Err(_) => {}
                }
                folded
            }
            FromExecutor::Change(c) => {
                let span = tracing::info_span!(
                    parent: None,
                    "fold",
                    otel.name = "fold resource change",
                    provisioning.run.id = %self.run.run_id(),
                    provisioning.node.id = %c.node,
                    provisioning.change = c.change.name(),
                    provisioning.fold.discarded = Empty,
                );
                let _entered = span.enter();
                let before = self.events.before(&self.run);
                let folded = self.run.fold_resource_change(&c, now);
                self.events
                    .received(before, &self.run, now, In::Change(&c), Verdict::Fold(&folded));
                match &folded {
                    Ok(Fold::Folded) => {
                        match &c.change {
                            contract::Change::Lost { .. } => {
                                tracing::warn!(run = %self.run.run_id(), node = %c.node, attempt = %c.attempt,
                                    change = ?c.change, "a node's resource is lost; its slot is replaced");
                                self.shared.metrics.exported.lost.inc(&[]);
                            }
                            contract::Change::Health { healthy, detail } => {
                                if *healthy {
                                    tracing::info!(run = %self.run.run_id(), node = %c.node, attempt = %c.attempt,
                                        "a node is healthy");
                                } else {
                                    tracing::warn!(run = %self.run.run_id(), node = %c.node, attempt = %c.attempt,
                                        %detail, "a node is unhealthy");
                                }
                                self.shared.metrics.exported.health.inc(&[c.change.name()]);
                            }
                        }
                        self.shared.metrics.exported.folds.inc(&["change"]);
                        self.caused_by(&span, &c.node);
                    }
                    Ok(Fold::Discarded(why)) => self.discarded(&span, "change", why.name()),
                    Err(_) => {}
                }
                folded
            }
            FromExecutor::Rejection(rej) => {
                if matches!(rej.reason, RejectionReason::Fenced) {
                    // A newer incarnation owns this run: this driver must not act.
                    tracing::error!(run = %self.run.run_id(), epoch = %self.run.epoch(), highest = %rej.highest_epoch,
                        "fenced by the executor; no further operations will be dispatched for this run");
                    self.session.handle_fenced();
                    self.events.received(
                        None,
                        &self.run,
                        now,
                        In::Rejection(&rej),
                        Verdict::Other("fenced"),
                    );
                    return;
                }
                if matches!(rej.reason, RejectionReason::UnknownRun)
                    && let Some(g) = self.session.link()
                {
                    // The claim did not take (an executor restarted under us):
                    // claim again and resubmit.
                    self.events.received(
                        None,
                        &self.run,
                        now,
                        In::Rejection(&rej),
                        Verdict::Other("reclaim"),
                    );
                    self.link_up(g);
                    return;
                }
                let before = self.events.before(&self.run);
                let folded = self.run.fold_rejection(&rej, now);
                self.events.received(
                    before,
                    &self.run,
                    now,
                    In::Rejection(&rej),
                    Verdict::Fold(&folded),
                );
                if let (Ok(Fold::Folded), Some(id)) = (&folded, rej.id) {
                    self.shared.metrics.exported.folds.inc(&["rejection"]);
                    self.close_operation(id, "failed-retryable", now);
                    self.triggered();
                }
                folded
            }
        };
        match folded {
            Ok(_) => self.changed = true,
            Err(e) => tracing::error!(run = %self.run.run_id(), error = %e, "fold failed"),
        }
    }

    /// A fold changed `node`: the next pass links to the fold's span, and
    /// so does the node's next operation.
    fn caused_by(&mut self, fold: &tracing::Span, node: &LogicalNodeId) {
        if let Some(cause) = telemetry::Cause::of(fold) {
            if self.causes.len() < MAX_CAUSES {
                self.causes.push(cause.clone());
            } else {
                self.causes_dropped += 1;
            }
            self.node_causes.insert(node.clone(), (self.requests, cause));
        }
        self.triggered();
    }

    fn discarded(&self, span: &tracing::Span, kind: &str, reason: &'static str) {
        span.record("provisioning.fold.discarded", reason);
        self.shared.metrics.exported.discarded.inc(&[kind, reason]);
    }

    /// Ends an operation's span with the class of its outcome and records its
    /// latency.
    fn close_operation(&mut self, id: OperationId, outcome: &str, now: UnixMillis) {
        let Some(f) = self.in_flight.remove(&id) else {
            return;
        };
        f.span.record("provisioning.operation.outcome", outcome);
        if matches!(outcome, "failed-retryable" | "failed-permanent" | "ambiguous") {
            f.span.record("otel.status_code", "error");
        }
        let e = &self.shared.metrics.exported;
        e.in_flight.add(&[f.effect.name()], -1.0);
        e.operation_duration
            .observe_duration(&[f.effect.name(), outcome], now.saturating_since(f.dispatched_at));
    }

    /// Operations the driver folded as ambiguous at their deadline (no result
    /// came) end here. Deadline folds are rare, so finding them is a scan.
    fn settle_deadline_folds(&mut self) {
        let seen = self.run.counters().deadline_folds;
        if seen == self.deadline_folds_seen {
            return;
        }
        self.deadline_folds_seen = seen;
        let now = self.now_following_steps();
        let ended: Vec<OperationId> = self
            .in_flight
            .iter()
            .filter(|(id, f)| {
                self.run
                    .node(&f.node)
                    .and_then(|n| n.pending)
                    .is_none_or(|p| p.id != **id)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in ended {
            self.close_operation(id, "ambiguous", now);
        }
    }

    fn link_up(&mut self, generation: u64) {
        if self.halted.is_some() || !self.owned() {
            // Nothing goes out for a halted run; its reload claims anew.
            self.session.handle_link_down();
            return;
        }
        self.session.handle_link_up(generation, &self.run);
        self.flush();
    }

    /// Sends what the session has queued, each on the link it was queued
    /// for, encoded with its trace.
    fn flush(&mut self) {
        let mut next = self.session.poll_transmit();
        if next.is_none() {
            return;
        }
        let uid = self.run.uid();
        while let Some((generation, m)) = next.take() {
            // A submission carries its operation span's context; a
            // resubmission joins it, so the executor's replay or adoption
            // shows under the original dispatch.
            let mut trace = TraceContext::default();
            match &m {
                ToExecutor::Claim(claim) => self.events.claim(claim.epoch, generation),
                ToExecutor::Submit { op, resubmission } => {
                    trace = self
                        .in_flight
                        .get(&op.id)
                        .map(|f| telemetry::context_of(&f.span))
                        .filter(|t| !t.traceparent.is_empty())
                        .unwrap_or_else(|| op.trace.clone());
                    self.events.dispatched(op, true, *resubmission);
                }
                ToExecutor::ObserveFrom(_) | ToExecutor::Ack(_) | ToExecutor::Watch(_) => {}
            }
            let msg = link::encode(uid, m, &trace);
            self.shared.link.send(generation, msg);
            next = self.session.poll_transmit();
        }
    }

    async fn decided(&mut self, plan: PassPlan, result: Result<DecideOutput, DecideError>, now: UnixMillis) {
        self.pass_in_flight = false;
        let mut span = self.pass_span.take().unwrap_or_else(tracing::Span::none);
        let speculative = std::mem::take(&mut self.pass_speculative);
        let started = self.pass_started.take();
        if self.stopping.is_some() {
            // Shutting down: nothing new is dispatched; the next driver decides
            // these nodes again.
            self.events.pass_failed(|| "the driver is stopping".to_owned());
            self.run.abort_pass(plan);
            span.record("provisioning.pass.result", "abandoned");
            return;
        }
        let shared = self.shared.clone();
        let e = &shared.metrics.exported;
        match result {
            Ok(out) => {
                crash::hit(crash::Point::PassDecided);
                self.decider_failures = 0;
                if self.decider_down.take().is_some() {
                    self.changed = true;
                    self.run.record_event(
                        EventReason::DependencyBack,
                        Subject::Run,
                        "the decider is reachable again".to_owned(),
                        now,
                    );
                }
                if speculative
                    && out
                        .decisions
                        .iter()
                        .any(|d| !matches!(d.action, Action::Wait { .. }))
                {
                    // The safety tick found work after all: trace the pass
                    // from here on (its Decide call went untraced).
                    span = self.new_pass_span(&plan, false);
                }
                // Operations dispatched by this pass carry its trace, so
                // their results, folds and resubmissions link back to it.
                self.run.set_pass_trace(telemetry::context_of(&span));
                let requeue_after = out.requeue_at.is_some();
                let was_converged = self.run.meta().converged_at.is_some();
                let cx = self.events.pass_context(&self.run, &plan, &out);
                let remediated_before = self.run.counters().remediated;
                let outcome = span.in_scope(|| self.run.apply_decisions(plan, out, now));
                let remediated = self.run.counters().remediated - remediated_before;
                if remediated > 0 {
                    self.shared.metrics.exported.remediated.add(&[], remediated);
                }
                // Recorded pending, then made durable, then dispatched.
                let outcome = match outcome {
                    Ok(mut outcome) => {
                        let commit = outcome.take_commit();
                        let persisted = self.persist(commit).instrument(span.clone()).await;
                        persisted
                            .map(|released| (outcome, released))
                            .map_err(PassError::Store)
                    }
                    Err(e) => Err(PassError::Core(e)),
                };
                let _entered = span.enter();
                match outcome {
                    Ok((outcome, released)) => {
                        self.publish_event_mark();
                        self.events.pass_decided(cx, &self.run, now, &outcome);
                        self.shared.metrics.pass(&outcome);
                        let result = if outcome.follow_up {
                            "requeue"
                        } else if requeue_after {
                            "requeue_after"
                        } else {
                            "success"
                        };
                        record_pass(&span, &outcome, result);
                        e.reconcile.inc(&[CONTROLLER, result]);
                        if outcome.follow_up {
                            // The follow-up pass is work queued by this one.
                            self.want();
                        }
                        if !was_converged && self.run.meta().converged_at.is_some() {
                            e.converged.inc(&[]);
                            tracing::info!(
                                run = %self.run.run_id(),
                                generation = self.run.shape().generation.get(),
                                nodes = self.run.node_count(),
                                "run converged"
                            );
                        }
                        // Acknowledged with the batch's commit, in one message.
                        if !released.acks.is_empty() {
                            crash::hit(crash::Point::FoldCommitted);
                        }
                        self.session.acknowledge(released.acks);
                        let ops = released.operations;
                        if !ops.is_empty() {
                            crash::hit(if self.run.meta().deleting {
                                crash::Point::DeletingRecorded
                            } else {
                                crash::Point::PassRecorded
                            });
                        }
                        self.shared.metrics.dispatched(&ops);
                        let count = ops.len();
                        let pass = telemetry::Cause::of(&span);
                        for (i, op) in ops.into_iter().enumerate() {
                            self.dispatch(op, now, pass.as_ref());
                            if i == 0 && count > 1 {
                                crash::hit(crash::Point::PassDispatchedOne);
                            }
                        }
                        if count > 0 {
                            crash::hit(crash::Point::PassDispatched);
                        }
                        // The causes of nodes the run no longer has (scaled
                        // down, deleted) go, in one sweep when they could
                        // have doubled the map.
                        if self.node_causes.len() > 2 * self.run.node_count() + 64 {
                            let run = &self.run;
                            self.node_causes.retain(|node, _| run.node(node).is_some());
                        }
                        self.changed = true;
                    }
                    Err(err) => {
                        self.events
                            .pass_failed(|| format!("applying the decisions failed: {err}"));
                        span.record("provisioning.pass.result", "error");
                        span.record("otel.status_code", "error");
                        e.reconcile.inc(&[CONTROLLER, "error"]);
                        e.reconcile_errors.inc(&[CONTROLLER, "apply"]);
                        tracing::error!(run = %self.run.run_id(), error = %err, "applying decisions failed");
                        if let PassError::Store(store) = &err {
                            // The decisions are applied in memory and not
                            // stored, and the operations they recorded were
                            // not dispatched: the run is ahead of the store,
                            // as after any failed commit. Reloaded from the
                            // store, it decides again (or resubmits what did
                            // land).
                            self.halt(format!("the store refused a pass's write: {store}"));
                            self.shared.reload_later(self.run.uid());
                        }
                    }
                }
            }
            Err(err) => {
                // Nothing changes and nothing is dispatched while the decider is
                // away; the pass is retried with backoff.
                self.events.pass_failed(|| format!("the decider failed: {err}"));
                self.run.abort_pass(plan);
                self.decider_failures = self.decider_failures.saturating_add(1);
                if self.decider_down.is_none() {
                    self.run.record_event(
                        EventReason::DependencyLost,
                        Subject::Run,
                        format!("the decider cannot be reached ({err}); nothing is decided until it is back"),
                        now,
                    );
                }
                self.decider_down = Some(err.to_string());
                self.changed = true;
                let exp = self.decider_failures.min(6);
                let delay = Duration::from_millis(100 * (1u64 << exp)).min(Duration::from_secs(5));
                self.decider_retry_at = Some(self.monotonic().saturating_add(delay));
                self.shared.metrics.decider_error();
                let reason = match &err {
                    DecideError::Unavailable(_) => "decider_unavailable",
                    DecideError::Rejected(_) => "decider_rejected",
                    DecideError::Decode(_) => "decider_undecodable",
                };
                span.record("provisioning.pass.result", "error");
                span.record("otel.status_code", "error");
                e.reconcile.inc(&[CONTROLLER, "error"]);
                e.reconcile_errors.inc(&[CONTROLLER, reason]);
                e.queue_retries.inc(&[QUEUE]);
                // The retry is queued work: the run stays wanted until it runs.
                self.want();
                let _entered = span.enter();
                tracing::warn!(run = %self.run.run_id(), error = %err, retry_in = ?delay, "decider call failed");
            }
        }
        if let Some(started) = started {
            let took = self.monotonic().saturating_since(started);
            e.pass_duration.observe_duration(&[CONTROLLER], took);
            e.work_duration.observe_duration(&[QUEUE], took);
        }
    }

    /// A pass's span. A speculative pass (only the safety tick asked for it)
    /// gets an unsampled root, so neither it nor its Decide call is recorded
    /// unless it turns out to act; any other pass is the child of the request
    /// that caused it, or a root linked to the folds that did.
    fn new_pass_span(&mut self, plan: &PassPlan, speculative: bool) -> tracing::Span {
        let span = tracing::info_span!(
            parent: None,
            "pass",
            provisioning.run.id = %self.run.run_id(),
            provisioning.run.generation = telemetry::int(self.run.shape().generation.get()),
            provisioning.pass.nodes = telemetry::int(plan.nodes.len()),
            provisioning.pass.full = plan.full,
            provisioning.pass.actions = Empty,
            provisioning.pass.operations = Empty,
            provisioning.pass.transitions = Empty,
            provisioning.pass.stale = Empty,
            provisioning.pass.result = Empty,
            provisioning.pass.links_dropped = Empty,
            otel.status_code = Empty,
        );
        if speculative {
            telemetry::set_unsampled_root(&span);
        } else {
            if let Some(origin) = self.origin.take() {
                telemetry::set_parent(&span, &origin);
            }
            for cause in self.causes.drain(..) {
                cause.link(&span);
            }
            span.record(
                "provisioning.pass.links_dropped",
                telemetry::int(std::mem::take(&mut self.causes_dropped)),
            );
        }
        span
    }

    /// Opens the span of an operation the current pass dispatched and
    /// submits the operation under it. The span ends when the operation's
    /// outcome is folded.
    ///
    /// Each operation is the root of a trace of its own (its call at the
    /// executor, the fold of its result, a bootstrap's stages), so that no
    /// trace grows with the run. It links to what caused it: the pass that
    /// decided it (`pass`), the node's latest fold (so a node's operations
    /// form one chain of links from its insert to its readiness and on to
    /// its destruction), and the latest client request when that came after
    /// the node's latest fold (so an `Apply` or a `DeleteRun` reaches every
    /// operation it caused, in whichever pass). At most three links.
    fn dispatch(&mut self, op: Operation, now: UnixMillis, pass: Option<&telemetry::Cause>) {
        let effect = op.input.effect();
        // One of `telemetry::UNLOGGED_SPANS`: never entered, so the log layer
        // leaves it alone.
        let span = platform::operation_span!(
            parent: None,
            "operation",
            format_args!("operation {}", effect.name()),
            &op
        );
        if let Some(pass) = pass {
            pass.link(&span);
        }
        let node_cause = self.node_causes.get(&op.node);
        if let Some((_, cause)) = node_cause {
            cause.link(&span);
        }
        if let Some((at, request)) = &self.request
            && node_cause.is_none_or(|(seen, _)| seen < at)
        {
            request.link(&span);
        }
        self.shared.metrics.exported.in_flight.add(&[effect.name()], 1.0);
        self.in_flight.insert(
            op.id,
            InFlight {
                node: op.node.clone(),
                effect,
                dispatched_at: now,
                span,
                waiting: None,
            },
        );
        self.submit(op);
    }

    /// Whether this driver still owns the run (always, on a store of its
    /// own). Checked before each pass and each dispatch, from local state
    /// only: a replica whose lease may have lapsed stops at once, even when
    /// the store cannot be reached. A run found not owned is halted.
    fn owned(&mut self) -> bool {
        if self.shared.owns(self.run.uid()) {
            return true;
        }
        if self.halted.is_none() {
            self.halt("this driver replica no longer owns the run".to_owned());
        }
        false
    }

    /// With the link down (or the run fenced) the operation stays recorded
    /// pending; it is resubmitted when a link comes back, or folds at its
    /// deadline.
    fn submit(&mut self, op: Operation) {
        if self.halted.is_some() || !self.owned() || !self.session.sends() {
            self.events.dispatched(&op, false, false);
            return;
        }
        self.session.submit(op);
        self.flush();
    }

    /// Whether what changed since the last commit waits for a pass's
    /// commit rather than being written now: a pass is in flight, or one is
    /// wanted and waits only for the batch window (at most `BATCH_STRETCH`
    /// windows), and nothing keeps it from starting then. The pass writes
    /// the folds with its decisions (`RunState::apply_decisions` commits
    /// everything changed), so a node folded and then decided is written
    /// once, not twice, and the folds' acknowledgements go when that commit
    /// is durable, as they would after their own. A pass that fails leaves
    /// them to the next commit of the loop.
    fn pass_carries(&self) -> bool {
        if self.halted.is_some() || self.stopping.is_some() {
            return false;
        }
        if self.pass_in_flight {
            return true;
        }
        self.decider_retry_at.is_none()
            && !self.session.is_fenced()
            && self.shared.owns(self.run.uid())
            && self.run.pass_batching(self.now())
    }

    /// Sends what earlier commits released (acknowledgements), the replays
    /// the run asks for, and whatever else the session has queued.
    fn send_released(&mut self) {
        self.session.flush_acks();
        self.session.ask_replays(&mut self.run);
        self.flush();
    }

    /// Commits what changed. A failed commit halts the run: its in-memory
    /// state may be ahead of the store, so nothing more is dispatched,
    /// acknowledged or accepted for it until the driver has reloaded it from
    /// the store ([`crate::driver::Driver::reload`]).
    async fn commit(&mut self) -> Result<(), DriverError> {
        if let Some(why) = &self.halted {
            return Err(DriverError::Halted(why.clone()));
        }
        let dirty = self.events.dirty(&self.run);
        let commit = self.run.take_commit();
        match self.persist(commit).await {
            Ok(released) => {
                debug_assert!(released.operations.is_empty(), "only a pass records operations");
                if !released.acks.is_empty() {
                    crash::hit(crash::Point::FoldCommitted);
                }
                self.session.acknowledge(released.acks);
            }
            Err(e) => {
                self.halt(format!("the store refused a write: {e}"));
                self.shared.reload_later(self.run.uid());
                return Err(DriverError::Halted(e.to_string()));
            }
        }
        self.events.committed(dirty);
        self.publish_event_mark();
        self.send_released();
        Ok(())
    }

    /// Makes a commit durable and releases what it held. A store that may
    /// block is written on the blocking pool: this run waits for its own
    /// commit, and every other run goes on with its passes and commits.
    async fn persist(&self, commit: Commit) -> Result<Released, StoreError> {
        let store = self.shared.store.clone();
        if !commit.delta().is_empty() {
            let e = &self.shared.metrics.exported;
            e.store_commits.inc(&[]);
            e.store_node_writes.add(&[], commit.delta().upserts.len() as u64);
        }
        if commit.delta().is_empty() || !store.blocks() {
            return commit.persist_to(&*store);
        }
        let (delta, held) = commit.into_parts();
        match tokio::task::spawn_blocking(move || store.commit(&delta)).await {
            Ok(written) => written.map(|()| held.durable()),
            Err(e) => Err(StoreError::Unavailable(format!(
                "the store's writer stopped: {e}"
            ))),
        }
    }

    fn halt(&mut self, why: String) {
        tracing::error!(run = %self.run.run_id(), reason = %why,
            "run halted: no further work until it is reloaded from the store");
        self.halted = Some(why);
        // Nothing queued goes out: not even acknowledgements, whose folds
        // the reload may not find stored.
        self.session.handle_link_down();
        self.changed = true;
    }

    fn maybe_pass(&mut self) {
        if self.pass_in_flight
            || self.decider_retry_at.is_some()
            || self.session.is_fenced()
            || self.halted.is_some()
            || self.stopping.is_some()
        {
            return;
        }
        if !self.owned() {
            return;
        }
        let now = self.now_following_steps();
        // Room for what the pass may dispatch, held until it is applied
        // (the demand is counted only under a limit).
        let admission = &self.shared.admission;
        let room = admission.limit().and_then(|_| {
            let demand = self.run.dispatch_demand(now);
            admission.reserve(self.run.uid(), self.run.pending_operations(), demand)
        });
        self.run.set_dispatch_room(room);
        if !self.run.needs_pass(now) {
            // Nothing is dirty or due after all: the run leaves the queue.
            self.unwant(false);
            self.speculative = false;
            return;
        }
        let before = self.events.before(&self.run);
        let plan = match self.run.begin_pass(now) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(run = %self.run.run_id(), error = %e, "cannot start a pass");
                return;
            }
        };
        self.events.pass_begun(before, &self.run, &plan);
        self.unwant(true);
        let speculative = std::mem::take(&mut self.speculative);
        let span = self.new_pass_span(&plan, speculative);
        // The slot set is kept as ranges, so a run without gaps copies a
        // few numbers here whatever its size.
        let call = decider_svc::client::encode_call(
            self.run.shape(),
            self.run.is_deleting(),
            self.run.plan_nodes(&plan),
            self.run.slot_set().clone(),
            &self.run.group_counts(),
            now,
            &telemetry::context_of(&span),
        );
        self.pass_in_flight = true;
        self.reserved = room.unwrap_or(0);
        self.pass_started = Some(self.monotonic());
        self.pass_speculative = speculative;
        self.pass_span = Some(span.clone());
        let mut client = self.shared.decider.clone();
        let tx = self.tx.clone();
        // The Decide call runs in the pass's span: the tracing layer makes
        // its client span a child of the pass.
        tokio::spawn(
            async move {
                let result = decider_svc::client::decide_call(&mut client, call)
                    .await
                    .map(|(out, _)| out);
                let _ = tx.send(RunEvent::Decided { plan, result });
            }
            .instrument(span),
        );
    }

    fn phase_key(&self) -> PhaseKey {
        let m = self.run.meta();
        (
            m.shape.generation.get(),
            m.converged_at.is_some(),
            m.deleting,
            m.paused,
            self.run.is_gone(),
            self.halted.is_some(),
        )
    }

    /// The run's status, with its conditions.
    fn status(&mut self, include_nodes: bool, now: UnixMillis) -> pb::RunStatus {
        let mut status = run_status(&self.run, include_nodes, now);
        let deps = status::Dependencies {
            decider_down: self.decider_down.clone(),
            executor_link_down: self.session.link().is_none() && !self.run.is_gone(),
            halted: self.halted.clone(),
            providers_down: self.providers_down(),
        };
        let observed = status::observe(&self.run, &deps);
        let (conditions, transitions) = self.conditions.stamp(observed, status.generation, now);
        status.conditions = conditions;
        if !transitions.is_empty() && !self.run.is_gone() {
            for t in transitions {
                let reason = match (t.kind, t.status) {
                    ("Ready", true) => EventReason::Converged,
                    ("Stalled", true) => EventReason::Stalled,
                    _ => continue,
                };
                let message = if t.kind == "Stalled" {
                    format!("{}: {}", t.reason, t.message)
                } else {
                    t.message
                };
                self.run.record_event(reason, Subject::Run, message, now);
            }
            self.run.set_conditions(self.conditions.marks());
        }
        status
    }

    /// Tells followers of the event log what is committed now.
    /// The providers the run's groups name that the executor serves but
    /// cannot reach now (a plugin that is down).
    fn providers_down(&self) -> Vec<String> {
        let Some(served) = self.shared.link.providers() else {
            return Vec::new();
        };
        let mut down: Vec<String> = self
            .run
            .meta()
            .shape
            .groups
            .iter()
            .map(|g| g.template.provider.name.as_str())
            .filter(|name| served.iter().any(|s| s.name == *name && !s.available))
            .map(str::to_owned)
            .collect();
        down.sort();
        down.dedup();
        down
    }

    fn publish_event_mark(&self) {
        let mark = self.run.event_mark();
        self.event_mark.send_if_modified(|m| {
            let moved = *m != mark;
            *m = mark;
            moved
        });
    }

    fn publish(&mut self) {
        if !self.changed {
            return;
        }
        let key = self.phase_key();
        let now = self.monotonic();
        let due = match self.last_publish {
            None => true,
            Some((at, last_key)) => last_key != key || now >= at.saturating_add(self.publish_every),
        };
        if !due {
            // `next_wake` brings the actor back when it is due.
            return;
        }
        self.changed = false;
        self.last_publish = Some((now, key));
        let status = self.status(false, self.now());
        self.status.send_replace(Arc::new(status));
        let took = self.monotonic().saturating_since(now);
        let actors = self
            .shared
            .actors
            .load(std::sync::atomic::Ordering::Relaxed)
            .max(1);
        let factor = PUBLISH_COST_FACTOR.saturating_mul(u32::try_from(actors).unwrap_or(u32::MAX));
        self.publish_every = PUBLISH_EVERY.max(took.saturating_mul(factor));
    }

    async fn finish(&mut self) {
        let uid = self.run.uid();
        let _ = self.commit().await;
        let now = self.now();
        let left: Vec<OperationId> = self.in_flight.keys().copied().collect();
        for id in left {
            self.close_operation(id, "abandoned", now);
        }
        self.unwant(false);
        if let Some(g) = self.session.link() {
            self.shared.link.send(g, link::forget(uid, self.run.epoch()));
        }
        self.changed = true;
        self.publish();
        self.shared.link.unregister(uid);
        self.shared.forget(self.run.run_id(), uid);
        tracing::info!(run = %self.run.run_id(), "run deleted");
    }
}

/// Records what a pass did on its span: counts, the result, and the actions
/// per ladder rule as `provisioning.pass.rule_<n>` attributes.
fn record_pass(span: &tracing::Span, o: &crate::core::PassOutcome, result: &str) {
    let actions: u32 = o.actions_by_rule.iter().sum();
    span.record("provisioning.pass.actions", i64::from(actions));
    span.record("provisioning.pass.operations", i64::from(o.operations));
    span.record("provisioning.pass.transitions", i64::from(o.transitions));
    span.record("provisioning.pass.stale", i64::from(o.stale));
    span.record("provisioning.pass.result", result);
    for (rule, n) in o.actions_by_rule.iter().enumerate() {
        if *n > 0 {
            telemetry::set_attribute(span, format!("provisioning.pass.rule_{rule}"), i64::from(*n));
        }
    }
}
