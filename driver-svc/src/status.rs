//! What clients read: a run's status (per-group counts by stage, phase,
//! convergence) and per-node detail, built from the run state.

use std::collections::BTreeMap;

use contract::{
    ClusterShape, GroupId, LogicalNodeId, NodeStage, NodeTemplate, UnixMillis, pb,
    wire::{TemplateTable, node_to_wire, shape_to_wire_redacted},
};

use crate::core::RunState;

/// A run's status. Secrets in the shape are redacted.
pub fn run_status(run: &RunState, include_nodes: bool, now: UnixMillis) -> pb::RunStatus {
    let meta = run.meta();
    let desired = run.desired_view();
    #[derive(Default)]
    struct G {
        desired: u32,
        ready: u32,
        failing: u32,
        stages: BTreeMap<NodeStage, u32>,
    }
    let mut groups: BTreeMap<GroupId, G> = BTreeMap::new();
    for g in desired.groups() {
        groups.entry(g.id.clone()).or_default().desired = g.count;
    }
    let mut ready_count = 0u32;
    let mut pending = 0u32;
    let mut nodes = Vec::new();
    let mut table = TemplateTable::default();
    for n in run.nodes() {
        let g = groups.entry(n.id.group().clone()).or_default();
        *g.stages.entry(n.stage).or_default() += 1;
        let current = desired
            .template_for(&n.id)
            .is_some_and(|t| NodeTemplate::same(t, &n.spec));
        if n.is_ready() && current {
            g.ready += 1;
            ready_count += 1;
        }
        if n.retry.consecutive_failures > 0 || n.stage == NodeStage::Failed {
            g.failing += 1;
        }
        if n.pending.is_some() {
            pending += 1;
        }
        if include_nodes {
            nodes.push(pb::NodeStatus {
                state: Some(node_to_wire(n, &mut table)),
                group_id: n.id.group().to_string(),
                spec_current: current,
                last_decision: run.last_decision(&n.id).map(|l| pb::Decision::from(&l.decision)),
            });
        }
    }
    let converged = run.is_converged();
    let phase = if run.is_gone() {
        pb::RunPhase::Deleted
    } else if meta.deleting {
        pb::RunPhase::Deleting
    } else if meta.paused {
        pb::RunPhase::Paused
    } else if converged {
        pb::RunPhase::Converged
    } else {
        pb::RunPhase::Progressing
    };
    pb::RunStatus {
        run_id: meta.run_id.to_string(),
        run_uid: meta.uid.to_string(),
        generation: meta.shape.generation.get(),
        observed_generation: meta.observed_generation.get(),
        phase: phase as i32,
        converged,
        paused: meta.paused,
        groups: groups
            .into_iter()
            .map(|(id, g)| pb::GroupStatus {
                group_id: id.to_string(),
                desired: g.desired,
                ready: g.ready,
                failing: g.failing,
                stages: g
                    .stages
                    .into_iter()
                    .map(|(stage, count)| pb::StageCount {
                        stage: pb::NodeStage::from(stage) as i32,
                        count,
                    })
                    .collect(),
            })
            .collect(),
        nodes,
        node_count: u32::try_from(run.node_count()).unwrap_or(u32::MAX),
        ready_count,
        pending_operations: pending,
        updated_at_ms: now.as_millis(),
        epoch: meta.epoch.get(),
        shape: Some(shape_to_wire_redacted(&meta.shape)),
        passes: run.counters().passes,
        created_at_ms: meta.created_at.as_millis(),
        converged_at_ms: UnixMillis::to_wire(meta.converged_at),
        folded_results: run.counters().folded_results,
        folded_observations: run.counters().folded_observations,
        discarded: run.counters().discarded.values().sum(),
        served_by: String::new(),
        served_at: String::new(),
        from_store: false,
    }
}

/// What `ExplainNode` answers for `node`: its state, the last decision and
/// the decision it would get now; `executor_note` is what the executor said
/// of its pending call (a budget wait).
pub fn explanation(
    run: &RunState,
    node: &LogicalNodeId,
    now: UnixMillis,
    executor_note: String,
) -> Option<pb::NodeExplanation> {
    let n = run.node(node)?;
    let mut table = TemplateTable::default();
    let current = run
        .desired_view()
        .template_for(node)
        .is_some_and(|t| NodeTemplate::same(t, &n.spec));
    Some(pb::NodeExplanation {
        node: Some(pb::NodeStatus {
            state: Some(node_to_wire(n, &mut table)),
            group_id: node.group().to_string(),
            spec_current: current,
            last_decision: run.last_decision(node).map(|l| pb::Decision::from(&l.decision)),
        }),
        decision: run.explain(node, now).map(|d| pb::Decision::from(&d)),
        now_ms: now.as_millis(),
        executor_note,
    })
}

/// What `Plan` answers for `shape`: the decisions a pass would make now and
/// the nodes the shape scales away (highest index first).
pub fn plan(run: &RunState, shape: &ClusterShape, now: UnixMillis) -> pb::PlanResponse {
    let out = run.plan(shape, now);
    let mut scale_down: Vec<&LogicalNodeId> = run
        .nodes()
        .filter(|n| shape.desired_group(&n.id).is_none())
        .map(|n| &n.id)
        .collect();
    scale_down.sort_by(|a, b| b.index().cmp(&a.index()).then_with(|| a.group().cmp(b.group())));
    pb::PlanResponse {
        decisions: out.decisions.iter().map(pb::Decision::from).collect(),
        scale_down: scale_down.iter().map(ToString::to_string).collect(),
        current_generation: run.shape().generation.get(),
    }
}
