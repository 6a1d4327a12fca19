//! One task per run, the only writer of that run's state.
//!
//! The actor consumes a closed enum of events ([`RunEvent`]): client requests,
//! executor messages, link changes, the decider's answers and its own timers.
//! After each batch of events it commits what changed (releasing the
//! acknowledgements of committed folds), starts a pass if one is wanted and none
//! is running, and publishes the run's status. Passes follow work-queue rules:
//! one at a time; triggers while one is queued collapse (a pass is wanted when
//! anything is dirty or due, however many events made it so); a trigger during a
//! pass leaves a node dirty, which guarantees exactly one follow-up pass.

use std::{sync::Arc, time::Duration};

use contract::{
    ClusterShape, DecideOutput, LogicalNodeId, RejectionReason, RunUid, TraceContext, UnixMillis, pb,
    pb::driver_message::Kind,
};
use decider_svc::client::DecideError;
use tokio::{
    sync::{mpsc, oneshot, watch},
    time::Instant,
};

use crate::{
    core::{AckRef, Applied, ApplyError, PassPlan, RunState},
    driver::{DriverError, Shared},
    link::FromExecutor,
    status::run_status,
};

/// Everything a run actor reacts to.
#[derive(Debug)]
pub enum RunEvent {
    Apply {
        shape: ClusterShape,
        reply: oneshot::Sender<Result<Applied, DriverError>>,
    },
    Delete {
        reply: oneshot::Sender<Result<pb::RunStatus, DriverError>>,
    },
    SetPaused {
        paused: bool,
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
    Plan {
        shape: ClusterShape,
        reply: oneshot::Sender<Result<pb::PlanResponse, ApplyError>>,
    },
    FromExecutor(FromExecutor),
    LinkUp(u64),
    LinkDown,
    Decided {
        plan: PassPlan,
        result: Result<DecideOutput, DecideError>,
    },
}

/// A handle to a run's actor.
#[derive(Debug, Clone)]
pub struct RunHandle {
    pub uid: RunUid,
    pub tx: mpsc::UnboundedSender<RunEvent>,
    pub status: watch::Receiver<Arc<pb::RunStatus>>,
}

pub(crate) struct RunActor {
    run: RunState,
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<RunEvent>,
    tx: mpsc::UnboundedSender<RunEvent>,
    status: watch::Sender<Arc<pb::RunStatus>>,
    /// The link generation our claim was sent on; submissions go only there.
    link: Option<u64>,
    fenced: bool,
    pass_in_flight: bool,
    decider_failures: u32,
    decider_retry_at: Option<Instant>,
    next_safety_tick: Instant,
    changed: bool,
    acks: Vec<AckRef>,
    /// Set when the store refused a write: the run does nothing more.
    halted: Option<String>,
}

impl std::fmt::Debug for RunActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunActor")
            .field("run", &self.run.run_id())
            .finish_non_exhaustive()
    }
}

impl RunActor {
    /// Spawns the actor for `run` and returns its handle.
    pub(crate) fn spawn(run: RunState, shared: Arc<Shared>) -> RunHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let now = shared.clock.now();
        let (status, status_rx) = watch::channel(Arc::new(run_status(&run, false, now)));
        let uid = run.uid();
        let actor = RunActor {
            next_safety_tick: Instant::now() + shared.safety_tick,
            run,
            shared: shared.clone(),
            rx,
            tx: tx.clone(),
            status,
            link: None,
            fenced: false,
            pass_in_flight: false,
            decider_failures: 0,
            decider_retry_at: None,
            changed: true,
            acks: Vec::new(),
            halted: None,
        };
        shared.link.register(uid, tx.clone());
        tokio::spawn(actor.run());
        RunHandle {
            uid,
            tx,
            status: status_rx,
        }
    }

    fn now(&self) -> UnixMillis {
        self.shared.clock.now()
    }

    async fn run(mut self) {
        loop {
            let wake = self.next_wake();
            tokio::select! {
                ev = self.rx.recv() => {
                    let Some(ev) = ev else { break };
                    self.handle(ev);
                    // Drain what else is queued: one commit and one pass for the batch.
                    while let Ok(ev) = self.rx.try_recv() {
                        self.handle(ev);
                    }
                }
                () = tokio::time::sleep_until(wake) => self.on_timer(),
            }
            let _ = self.commit();
            self.maybe_pass();
            self.publish();
            if self.run.is_gone() {
                self.finish();
                break;
            }
        }
    }

    /// The earliest of the run's own deadline, the decider retry and the
    /// safety tick.
    fn next_wake(&self) -> Instant {
        let mut wake = self.next_safety_tick;
        if let Some(t) = self.run.poll_timeout() {
            wake = wake.min(self.instant_of(t));
        }
        if let Some(t) = self.decider_retry_at {
            wake = wake.min(t);
        }
        wake
    }

    fn instant_of(&self, t: UnixMillis) -> Instant {
        Instant::now() + t.saturating_since(self.now())
    }

    fn on_timer(&mut self) {
        let now = self.now();
        match self.run.handle_timeout(now) {
            Ok(n) if n > 0 => self.changed = true,
            Ok(_) => {}
            Err(e) => tracing::error!(run = %self.run.run_id(), error = %e, "folding deadlines failed"),
        }
        if self.decider_retry_at.is_some_and(|t| t <= Instant::now()) {
            self.decider_retry_at = None;
        }
        if self.next_safety_tick <= Instant::now() {
            self.next_safety_tick = Instant::now() + self.shared.safety_tick;
            self.run.mark_all_dirty();
        }
    }

    fn handle(&mut self, ev: RunEvent) {
        let now = self.now();
        match ev {
            RunEvent::Apply { shape, reply } => {
                if let Some(why) = &self.halted {
                    let _ = reply.send(Err(DriverError::Halted(why.clone())));
                    return;
                }
                let result = self.run.apply_shape(shape).map_err(DriverError::from);
                let result = match result {
                    // The accepted shape is stored before the client hears so.
                    Ok(Applied::Changed) => self.commit().map(|()| Applied::Changed),
                    other => other,
                };
                self.changed = true;
                let _ = reply.send(result);
            }
            RunEvent::Delete { reply } => {
                let result = match &self.halted {
                    Some(why) => Err(DriverError::Halted(why.clone())),
                    None if self.run.delete() => self.commit(),
                    None => Ok(()),
                };
                self.changed = true;
                let _ = reply.send(result.map(|()| run_status(&self.run, false, now)));
            }
            RunEvent::SetPaused { paused, reply } => {
                let result = match &self.halted {
                    Some(why) => Err(DriverError::Halted(why.clone())),
                    None if self.run.set_paused(paused) => self.commit(),
                    None => Ok(()),
                };
                self.changed = true;
                let _ = reply.send(result.map(|()| run_status(&self.run, false, now)));
            }
            RunEvent::Get { include_nodes, reply } => {
                let _ = reply.send(run_status(&self.run, include_nodes, now));
            }
            RunEvent::Explain { node, reply } => {
                let _ = reply.send(self.explain(&node, now));
            }
            RunEvent::Plan { shape, reply } => {
                let _ = reply.send(self.plan(shape, now));
            }
            RunEvent::FromExecutor(msg) => self.on_executor_message(msg, now),
            RunEvent::LinkUp(generation) => self.link_up(generation),
            RunEvent::LinkDown => self.link = None,
            RunEvent::Decided { plan, result } => self.decided(plan, result, now),
        }
    }

    fn explain(&self, node: &LogicalNodeId, now: UnixMillis) -> Option<pb::NodeExplanation> {
        let n = self.run.node(node)?;
        let mut table = contract::wire::TemplateTable::default();
        let current = self
            .run
            .desired_view()
            .template_for(node)
            .is_some_and(|t| contract::NodeTemplate::same(t, &n.spec));
        Some(pb::NodeExplanation {
            node: Some(pb::NodeStatus {
                state: Some(contract::wire::node_to_wire(n, &mut table)),
                group_id: node.group().to_string(),
                spec_current: current,
                last_decision: self
                    .run
                    .last_decision(node)
                    .map(|l| pb::Decision::from(&l.decision)),
            }),
            decision: self.run.explain(node, now).map(|d| pb::Decision::from(&d)),
            now_ms: now.as_millis(),
        })
    }

    fn plan(&self, shape: ClusterShape, now: UnixMillis) -> Result<pb::PlanResponse, ApplyError> {
        // The plan is checked against the same revision contract as an apply,
        // on a copy, so that a plan never promises what an apply would refuse.
        let mut probe = self.run.clone();
        probe.apply_shape(shape.clone())?;
        let out = self.run.plan(&shape, now);
        let mut scale_down: Vec<LogicalNodeId> = self
            .run
            .nodes()
            .filter(|n| shape.desired_group(&n.id).is_none())
            .map(|n| n.id.clone())
            .collect();
        scale_down.sort_by(|a, b| b.index().cmp(&a.index()).then_with(|| a.group().cmp(b.group())));
        Ok(pb::PlanResponse {
            decisions: out.decisions.iter().map(pb::Decision::from).collect(),
            scale_down: scale_down.iter().map(ToString::to_string).collect(),
            current_generation: self.run.shape().generation.get(),
        })
    }

    fn on_executor_message(&mut self, msg: FromExecutor, now: UnixMillis) {
        let folded = match msg {
            FromExecutor::Claimed(epoch) => {
                tracing::debug!(run = %self.run.run_id(), %epoch, "claim accepted");
                return;
            }
            FromExecutor::Result(r) => self.run.fold_result(&r, now),
            FromExecutor::Observation(o) => self.run.fold_observation(&o, now),
            FromExecutor::Rejection(rej) => {
                if matches!(rej.reason, RejectionReason::Fenced) {
                    // A newer incarnation owns this run: this driver must not act.
                    tracing::error!(run = %self.run.run_id(), epoch = %self.run.epoch(), highest = %rej.highest_epoch,
                        "fenced by the executor; no further operations will be dispatched for this run");
                    self.fenced = true;
                    return;
                }
                if matches!(rej.reason, RejectionReason::UnknownRun)
                    && let Some(g) = self.link
                {
                    // The claim did not take (an executor restarted under us):
                    // claim again and resubmit.
                    self.link_up(g);
                    return;
                }
                self.run.fold_rejection(&rej, now)
            }
        };
        match folded {
            Ok(_) => self.changed = true,
            Err(e) => tracing::error!(run = %self.run.run_id(), error = %e, "fold failed"),
        }
    }

    fn link_up(&mut self, generation: u64) {
        self.link = Some(generation);
        let link = &self.shared.link;
        let claim = pb::Claim {
            run_uid: self.run.uid().to_string(),
            run_id: self.run.run_id().to_string(),
            epoch: self.run.epoch().get(),
        };
        link.send(generation, message(Kind::Claim(claim), &TraceContext::default()));
        if self.fenced {
            return;
        }
        for op in self.run.inflight_operations() {
            let trace = op.trace.clone();
            link.send(
                generation,
                message(Kind::Submit(pb::Operation::from(&op)), &trace),
            );
        }
        let uid = self.run.uid().to_string();
        let after = self
            .run
            .observation_cursors()
            .into_iter()
            .map(|(session, seq)| pb::ObservationRef {
                run_uid: uid.clone(),
                session_id: session.to_string(),
                seq,
            })
            .collect::<Vec<_>>();
        if !after.is_empty() {
            link.send(
                generation,
                message(
                    Kind::ObserveFrom(pb::ObserveFrom { run_uid: uid, after }),
                    &TraceContext::default(),
                ),
            );
        }
    }

    fn decided(&mut self, plan: PassPlan, result: Result<DecideOutput, DecideError>, now: UnixMillis) {
        self.pass_in_flight = false;
        match result {
            Ok(out) => {
                self.decider_failures = 0;
                let outcome = {
                    let mut store = match self.shared.store.lock() {
                        Ok(s) => s,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    self.run.apply_decisions(plan, out, now, &mut **store)
                };
                match outcome {
                    Ok(outcome) => {
                        self.shared.metrics.pass(&outcome);
                        self.acks.extend(outcome.acks);
                        for op in &outcome.operations {
                            self.submit(op);
                        }
                        self.changed = true;
                    }
                    Err(e) => {
                        tracing::error!(run = %self.run.run_id(), error = %e, "applying decisions failed")
                    }
                }
            }
            Err(e) => {
                // Nothing changes and nothing is dispatched while the decider is
                // away; the pass is retried with backoff.
                self.run.abort_pass(plan);
                self.decider_failures = self.decider_failures.saturating_add(1);
                let exp = self.decider_failures.min(6);
                let delay = Duration::from_millis(100 * (1u64 << exp)).min(Duration::from_secs(5));
                self.decider_retry_at = Some(Instant::now() + delay);
                self.shared.metrics.decider_error();
                tracing::warn!(run = %self.run.run_id(), error = %e, retry_in = ?delay, "decider call failed");
            }
        }
    }

    fn submit(&self, op: &contract::Operation) {
        if self.fenced || self.halted.is_some() {
            return;
        }
        if let Some(g) = self.link {
            let trace = op.trace.clone();
            self.shared
                .link
                .send(g, message(Kind::Submit(pb::Operation::from(op)), &trace));
        }
        // With the link down the operation stays recorded pending; it is
        // resubmitted when the link comes back, or folds at its deadline.
    }

    /// Commits what changed. A failed commit halts the run: its in-memory
    /// state is ahead of the store, so nothing more is dispatched, acknowledged
    /// or accepted for it until the driver restarts from the store.
    fn commit(&mut self) -> Result<(), DriverError> {
        if let Some(why) = &self.halted {
            return Err(DriverError::Halted(why.clone()));
        }
        let acks = {
            let mut store = match self.shared.store.lock() {
                Ok(s) => s,
                Err(poisoned) => poisoned.into_inner(),
            };
            self.run.commit(&mut **store)
        };
        match acks {
            Ok(acks) => self.acks.extend(acks),
            Err(e) => {
                self.halt(format!("the store refused a write: {e}"));
                return Err(DriverError::Halted(e.to_string()));
            }
        }
        self.send_acks();
        self.send_replays();
        Ok(())
    }

    fn halt(&mut self, why: String) {
        tracing::error!(run = %self.run.run_id(), reason = %why,
            "run halted: no further work until the driver restarts from its store");
        self.halted = Some(why);
        self.acks.clear();
        self.changed = true;
    }

    /// Asks for the stages of newly known sessions from the start: any that
    /// arrived before the result naming the session were left unacknowledged.
    fn send_replays(&mut self) {
        let sessions = self.run.take_replays();
        let Some(g) = self.link else {
            // On the next `LinkUp` every live session is asked for anyway.
            return;
        };
        if sessions.is_empty() {
            return;
        }
        let uid = self.run.uid().to_string();
        let after = sessions
            .into_iter()
            .map(|session| pb::ObservationRef {
                run_uid: uid.clone(),
                session_id: session.to_string(),
                seq: 0,
            })
            .collect();
        self.shared.link.send(
            g,
            message(
                Kind::ObserveFrom(pb::ObserveFrom { run_uid: uid, after }),
                &TraceContext::default(),
            ),
        );
    }

    fn send_acks(&mut self) {
        if self.acks.is_empty() {
            return;
        }
        let Some(g) = self.link else {
            // Unacknowledged results are resent on the next stream; they fold
            // as duplicates and are acknowledged then.
            self.acks.clear();
            return;
        };
        let uid = self.run.uid().to_string();
        let mut ack = pb::Ack::default();
        for a in self.acks.drain(..) {
            match a {
                AckRef::Result(id) => ack.results.push(pb::ResultRef {
                    run_uid: uid.clone(),
                    id: Some(id.into()),
                }),
                AckRef::Observation { session, seq } => ack.observations.push(pb::ObservationRef {
                    run_uid: uid.clone(),
                    session_id: session.to_string(),
                    seq,
                }),
            }
        }
        self.shared
            .link
            .send(g, message(Kind::Ack(ack), &TraceContext::default()));
    }

    fn maybe_pass(&mut self) {
        if self.pass_in_flight || self.decider_retry_at.is_some() || self.fenced || self.halted.is_some() {
            return;
        }
        let now = self.now();
        if !self.run.needs_pass(now) {
            return;
        }
        let plan = match self.run.begin_pass(now) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(run = %self.run.run_id(), error = %e, "cannot start a pass");
                return;
            }
        };
        let requests = {
            let slots = self.run.slot_set();
            decider_svc::client::encode_request(
                self.run.shape(),
                self.run.is_deleting(),
                self.run.plan_nodes(&plan),
                &slots,
                now,
                &TraceContext::default(),
            )
        };
        self.pass_in_flight = true;
        let mut client = self.shared.decider.clone();
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let result = decider_svc::client::decide(&mut client, requests).await;
            let _ = tx.send(RunEvent::Decided { plan, result });
        });
    }

    fn publish(&mut self) {
        if !self.changed {
            return;
        }
        self.changed = false;
        let status = run_status(&self.run, false, self.now());
        self.status.send_replace(Arc::new(status));
    }

    fn finish(&mut self) {
        let uid = self.run.uid();
        let _ = self.commit();
        if let Some(g) = self.link {
            self.shared.link.send(
                g,
                message(
                    Kind::Forget(pb::ForgetRun {
                        run_uid: uid.to_string(),
                        epoch: self.run.epoch().get(),
                    }),
                    &TraceContext::default(),
                ),
            );
        }
        self.changed = true;
        self.publish();
        self.shared.link.unregister(uid);
        self.shared.forget(self.run.run_id(), uid);
        tracing::info!(run = %self.run.run_id(), "run deleted");
    }
}

fn message(kind: Kind, trace: &TraceContext) -> pb::DriverMessage {
    pb::DriverMessage {
        kind: Some(kind),
        trace: contract::wire::trace_to_wire(trace),
    }
}
