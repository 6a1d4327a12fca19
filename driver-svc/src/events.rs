//! The driver's lines of the event trace (`platform::event_trace`): for each
//! run, what its actor received and folded or discarded, the passes (the
//! nodes decided with their versions, the decisions, what they changed), each
//! commit, and each operation handed to the executor link.
//!
//! Every line that changes the run's nodes carries the new state of each node
//! that changed, so a reader that starts from `run-started` and applies the
//! changes in order holds the run's nodes at every line. To know what changed,
//! a change is bracketed by [`RunEvents::before`] (a copy of the nodes, taken
//! only when the trace is on) and the line's writer, which diffs.

use std::collections::BTreeMap;

use contract::{
    DecideOutput, Decision, Epoch, LogicalNodeId, ManagedNode, Observation, Operation, OperationResult,
    Rejection, ResourceChange, UnixMillis, pb,
};
use platform::event_trace::{
    self, Changes, DecisionRec, EventTrace, Msg, NodeRec, NodeVersion, OpRec, TraceEvent,
};

use crate::core::{CoreError, Fold, PassOutcome, PassPlan, RunState};

/// A copy of a run's nodes before a change; `None` when the trace is off.
/// The run before a change: its nodes, and the generation of its shape.
pub(crate) type Before = Option<Nodes>;

/// Current attempts and successors (a rollout's surge) by slot, and the
/// shape's generation.
#[derive(Debug)]
pub(crate) struct Nodes {
    current: BTreeMap<LogicalNodeId, ManagedNode>,
    successors: BTreeMap<LogicalNodeId, ManagedNode>,
    generation: contract::Generation,
}

fn nodes_of(run: &RunState) -> Nodes {
    Nodes {
        current: run.nodes().map(|n| (n.id.clone(), n.clone())).collect(),
        successors: run.successors().map(|n| (n.id.clone(), n.clone())).collect(),
        generation: run.shape().generation,
    }
}

/// A message from the executor, as received.
#[derive(Debug, Clone, Copy)]
pub(crate) enum In<'a> {
    Result(&'a OperationResult),
    Observation(&'a Observation),
    Rejection(&'a Rejection),
    Change(&'a ResourceChange),
    Claimed(Epoch),
}

/// What became of a received message.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Verdict<'a> {
    Fold(&'a Result<Fold, CoreError>),
    Other(&'static str),
}

/// What a pass's answer is applied to, kept from before it is applied.
#[derive(Debug)]
pub(crate) struct PassContext {
    before: Nodes,
    plan_now: UnixMillis,
    stale_answer: bool,
    decisions: Vec<Decision>,
}

/// One run's writer of trace lines.
#[derive(Debug)]
pub(crate) struct RunEvents {
    trace: Option<&'static EventTrace>,
    run: String,
    /// Passes begun by this actor.
    passes: u64,
}

impl RunEvents {
    /// The writer for `run`'s actor; writes `run-started` with every node.
    pub(crate) fn started(run: &RunState) -> Self {
        let events = Self {
            trace: event_trace::get(),
            run: run.uid().to_string(),
            passes: 0,
        };
        if let Some(t) = events.trace {
            t.emit(TraceEvent::RunStarted {
                run: events.run.clone(),
                run_id: run.run_id().to_string(),
                epoch: run.epoch().get(),
                shape: event_trace::hex(&pb::ClusterShape::from(run.shape())),
                deleting: run.is_deleting(),
                nodes: run.nodes().map(NodeRec::of).collect(),
                successors: run.successors().map(NodeRec::of).collect(),
            });
        }
        events
    }

    /// The run's nodes before a change, if the trace is on.
    pub(crate) fn before(&self, run: &RunState) -> Before {
        self.trace.map(|_| nodes_of(run))
    }

    fn changes(
        Nodes {
            current: before,
            successors: successors_before,
            generation,
        }: Nodes,
        run: &RunState,
    ) -> Changes {
        let mut changes = Changes::default();
        // A shape the run took of its own (a revert).
        if run.shape().generation != generation {
            changes.shape = Some(event_trace::hex(&pb::ClusterShape::from(run.shape())));
        }
        for n in run.nodes() {
            if before.get(&n.id) != Some(n) {
                changes.changed.push(NodeRec::of(n));
            }
        }
        changes.removed = before
            .keys()
            .filter(|id| run.node(id).is_none())
            .map(ToString::to_string)
            .collect();
        for n in run.successors() {
            if successors_before.get(&n.id) != Some(n) {
                changes.successors.push(NodeRec::of(n));
            }
        }
        changes.successors_removed = successors_before
            .keys()
            .filter(|id| run.successor(id).is_none())
            .map(ToString::to_string)
            .collect();
        changes
    }

    /// A client request (`what`) reached the run.
    pub(crate) fn request(
        &self,
        before: Before,
        run: &RunState,
        now: UnixMillis,
        what: &str,
        outcome: impl FnOnce() -> String,
    ) {
        let (Some(t), Some(before)) = (self.trace, before) else {
            return;
        };
        t.emit(TraceEvent::Request {
            run: self.run.clone(),
            now_ms: now.as_millis(),
            what: what.to_owned(),
            generation: run.shape().generation.get(),
            outcome: outcome(),
            shape: event_trace::hex(&pb::ClusterShape::from(run.shape())),
            deleting: run.is_deleting(),
            changes: Self::changes(before, run),
        });
    }

    /// A message from the executor reached the run.
    pub(crate) fn received(
        &self,
        before: Before,
        run: &RunState,
        now: UnixMillis,
        msg: In<'_>,
        verdict: Verdict<'_>,
    ) {
        let Some(t) = self.trace else { return };
        let msg = match msg {
            In::Result(r) => Msg::Result(event_trace::ResultRec::of(r)),
            In::Observation(o) => Msg::Observation(event_trace::ObsRec::of(o)),
            In::Rejection(r) => Msg::Rejection(event_trace::RejRec::of(r)),
            In::Change(c) => Msg::Change(event_trace::ChangeRec::of(c)),
            In::Claimed(epoch) => Msg::Claimed { epoch: epoch.get() },
        };
        let verdict = match verdict {
            Verdict::Fold(Ok(Fold::Folded)) => "folded".to_owned(),
            Verdict::Fold(Ok(Fold::Discarded(why))) => format!("discarded:{}", why.name()),
            Verdict::Fold(Err(e)) => format!("error:{e}"),
            Verdict::Other(what) => what.to_owned(),
        };
        t.emit(TraceEvent::Received {
            run: self.run.clone(),
            now_ms: now.as_millis(),
            msg,
            verdict,
            changes: before.map(|b| Self::changes(b, run)).unwrap_or_default(),
        });
    }

    /// The run's timer folded expired deadlines (written only if it changed
    /// something).
    pub(crate) fn deadlines(&self, before: Before, run: &RunState, now: UnixMillis, folded: u32) {
        let (Some(t), Some(before)) = (self.trace, before) else {
            return;
        };
        let changes = Self::changes(before, run);
        if changes.is_empty() && folded == 0 {
            return;
        }
        t.emit(TraceEvent::Deadlines {
            run: self.run.clone(),
            now_ms: now.as_millis(),
            folded,
            changes,
        });
    }

    /// A pass began with `plan` (deadlines due folded since `before`).
    pub(crate) fn pass_begun(&mut self, before: Before, run: &RunState, plan: &PassPlan) {
        self.passes += 1;
        let (Some(t), Some(before)) = (self.trace, before) else {
            return;
        };
        t.emit(TraceEvent::PassBegun {
            run: self.run.clone(),
            pass: self.passes,
            now_ms: plan.now.as_millis(),
            generation: plan.generation.get(),
            deleting: plan.deleting,
            full: plan.full,
            converged: run.is_converged(),
            nodes: plan
                .nodes
                .iter()
                .map(|(id, version)| NodeVersion {
                    id: id.to_string(),
                    version: *version,
                })
                .collect(),
            changes: Self::changes(before, run),
        });
    }

    /// What the decider's answer for `plan` is about to be applied to.
    pub(crate) fn pass_context(
        &self,
        run: &RunState,
        plan: &PassPlan,
        out: &DecideOutput,
    ) -> Option<PassContext> {
        self.trace?;
        Some(PassContext {
            before: nodes_of(run),
            plan_now: plan.now,
            stale_answer: plan.generation != run.shape().generation || plan.deleting != run.is_deleting(),
            decisions: out.decisions.clone(),
        })
    }

    /// The answer was applied and committed.
    pub(crate) fn pass_decided(
        &self,
        cx: Option<PassContext>,
        run: &RunState,
        now: UnixMillis,
        o: &PassOutcome,
    ) {
        let (Some(t), Some(cx)) = (self.trace, cx) else {
            return;
        };
        t.emit(TraceEvent::PassDecided {
            run: self.run.clone(),
            pass: self.passes,
            plan_now_ms: cx.plan_now.as_millis(),
            now_ms: now.as_millis(),
            stale_answer: cx.stale_answer,
            decisions: cx.decisions.iter().map(DecisionRec::of).collect(),
            actions: o.actions_by_rule.iter().sum(),
            operations: o.operations,
            transitions: o.transitions,
            stale: o.stale,
            stale_at: o.stale_at.clone(),
            changes: Self::changes(cx.before, run),
        });
        self.committed_now();
    }

    /// The pass in flight ended without applying anything.
    pub(crate) fn pass_failed(&self, error: impl FnOnce() -> String) {
        let Some(t) = self.trace else { return };
        t.emit(TraceEvent::PassFailed {
            run: self.run.clone(),
            pass: self.passes,
            error: error(),
        });
    }

    /// Whether a commit now would write something (checked only when the
    /// trace is on).
    pub(crate) fn dirty(&self, run: &RunState) -> bool {
        self.trace.is_some() && run.uncommitted()
    }

    /// A commit that wrote something succeeded.
    pub(crate) fn committed(&self, dirty: bool) {
        if dirty {
            self.committed_now();
        }
    }

    fn committed_now(&self) {
        if let Some(t) = self.trace {
            t.emit(TraceEvent::Committed {
                run: self.run.clone(),
            });
        }
    }

    /// An operation recorded pending goes to the link (`sent`), or stays
    /// recorded for later.
    pub(crate) fn dispatched(&self, op: &Operation, sent: bool, resubmit: bool) {
        if let Some(t) = self.trace {
            t.emit(TraceEvent::Dispatched {
                run: self.run.clone(),
                op: OpRec::of(op),
                sent,
                resubmit,
            });
        }
    }

    /// The run claimed itself on link generation `link`.
    pub(crate) fn claim(&self, epoch: Epoch, link: u64) {
        if let Some(t) = self.trace {
            t.emit(TraceEvent::Claim {
                run: self.run.clone(),
                epoch: epoch.get(),
                link,
            });
        }
    }
}
