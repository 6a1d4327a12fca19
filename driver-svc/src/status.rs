//! What clients read: a run's status (per-group counts by stage, phase,
//! convergence) and per-node detail, built from the run state.

use std::{collections::BTreeMap, sync::Arc};

use contract::{
    ClusterShape, GroupId, LogicalNodeId, ManagedNode, NodeStage, NodeTemplate, UnixMillis, pb,
    wire::{TemplateTable, node_to_wire, shape_to_wire_redacted},
};

use decider::DesiredView;

use crate::core::{ConditionMark, LOST_PREFIX, RunState};

/// A run's status. Secrets in the shape are redacted.
pub fn run_status(run: &RunState, include_nodes: bool, now: UnixMillis) -> pb::RunStatus {
    let meta = run.meta();
    let desired = run.desired_view();
    #[derive(Default)]
    struct G {
        desired: u32,
        ready: u32,
        failing: u32,
        unhealthy: u32,
        held: u32,
        stages: [u32; NodeStage::ALL.len()],
    }
    let mut groups: BTreeMap<GroupId, G> = BTreeMap::new();
    for g in desired.groups() {
        groups.entry(g.id.clone()).or_default().desired = g.count;
    }
    for (group, counts) in run.group_counts() {
        groups.entry(group).or_default().unhealthy = counts.unhealthy;
    }
    for node in run.remediation_held() {
        groups.entry(node.group().clone()).or_default().held += 1;
    }
    let mut ready_count = 0u32;
    let mut pending = 0u32;
    let mut nodes = Vec::new();
    let mut table = TemplateTable::default();
    // A slot's successor (a rollout's surge) is listed after the run's nodes.
    let attempts = run
        .nodes()
        .map(|n| (n, false))
        .chain(run.successors().map(|n| (n, true)));
    // Nodes come group by group: each group's map entry and desired template
    // are looked up once per run of its nodes, not once per node.
    let mut last_group = None;
    let mut acc_group: Option<&GroupId> = None;
    let mut acc = G::default();
    for (n, successor) in attempts {
        let group = n.id.group();
        if acc_group != Some(group)
            && let Some(done) = acc_group.replace(group)
        {
            add_counts(groups.entry(done.clone()).or_default(), std::mem::take(&mut acc));
        }
        acc.stages[n.stage.ordinal()] += 1;
        let current =
            template_for(&desired, &mut last_group, &n.id).is_some_and(|t| NodeTemplate::same(t, &n.spec));
        if n.is_ready() && current {
            acc.ready += 1;
            ready_count += 1;
        }
        if n.retry.consecutive_failures > 0 || n.stage == NodeStage::Failed {
            acc.failing += 1;
        }
        if n.pending.is_some() {
            pending += 1;
        }
        if include_nodes {
            nodes.push(node_status(run, n, successor, current, &mut table));
        }
    }
    if let Some(done) = acc_group {
        add_counts(groups.entry(done.clone()).or_default(), acc);
    }
    fn add_counts(into: &mut G, from: G) {
        into.ready += from.ready;
        into.failing += from.failing;
        for (a, b) in into.stages.iter_mut().zip(from.stages) {
            *a += b;
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
                unhealthy: g.unhealthy,
                remediation_held: g.held,
                rollout: rollout_status(run, &id),
                stages: NodeStage::ALL
                    .iter()
                    .zip(g.stages)
                    .filter(|&(_, count)| count > 0)
                    .map(|(&stage, count)| pb::StageCount {
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
        // The run's actor adds them (`Conditions`): they need what it knows
        // of the decider and the link, and when each last changed.
        conditions: Vec::new(),
        labels: meta
            .shape
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }
}

/// One attempt as clients read it (`successor`: the slot's successor, whose
/// last decision is kept apart from the current attempt's).
fn node_status(
    run: &RunState,
    n: &ManagedNode,
    successor: bool,
    spec_current: bool,
    table: &mut TemplateTable,
) -> pb::NodeStatus {
    pb::NodeStatus {
        state: Some(node_to_wire(n, table)),
        group_id: n.id.group().to_string(),
        spec_current,
        last_decision: if successor {
            run.successor_decision(&n.id)
        } else {
            run.last_decision(&n.id)
        }
        .map(|l| pb::Decision::from(&l.decision)),
    }
}

/// Most slots in a `ListNodes` page, and how many a page of size 0 holds.
pub const MAX_NODE_PAGE: usize = 10_000;
pub const DEFAULT_NODE_PAGE: usize = 1_000;

/// A page of `ListNodes`: up to `slots` slots after `after` in node id
/// order, each slot's current attempt then its successor; the token names
/// the page's last slot when more follow.
pub fn node_page(run: &RunState, after: Option<&LogicalNodeId>, slots: usize) -> pb::ListNodesResponse {
    let desired = run.desired_view();
    let mut last_group = None;
    let mut table = TemplateTable::default();
    let mut nodes = Vec::new();
    let mut page = run.slots_after(after);
    let mut last = None;
    for (current, successor) in page.by_ref().take(slots) {
        let attempts = std::iter::once((current, false)).chain(successor.map(|s| (s, true)));
        for (n, is_successor) in attempts {
            let spec_current = template_for(&desired, &mut last_group, &n.id)
                .is_some_and(|t| NodeTemplate::same(t, &n.spec));
            nodes.push(node_status(run, n, is_successor, spec_current, &mut table));
        }
        last = Some(&current.id);
    }
    let next_page_token = match (page.next(), last) {
        (Some(_), Some(id)) => id.to_string(),
        _ => String::new(),
    };
    pb::ListNodesResponse {
        nodes,
        next_page_token,
        node_count: u32::try_from(run.node_count()).unwrap_or(u32::MAX),
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
        node: Some(node_status(run, n, false, current, &mut table)),
        decision: run.explain(node, now).map(|d| pb::Decision::from(&d)),
        now_ms: now.as_millis(),
        executor_note,
    })
}

/// What `Plan` answers for `shape`: the decisions a pass would make now and
/// the nodes the shape scales away (highest index first).
pub fn plan(run: &RunState, probe: &RunState, shape: &ClusterShape, now: UnixMillis) -> pb::PlanResponse {
    // The decisions and waves of the run with the shape applied (its counts
    // and rollouts are the shape's), the rest against the run as it is.
    let out = probe.plan_current(now);
    let waves = probe
        .rollout_waves()
        .into_iter()
        .map(|w| pb::PlanWave {
            nodes: w
                .slots
                .iter()
                .map(|i| LogicalNodeId::new(w.group.clone(), *i).to_string())
                .collect(),
            group_id: w.group.to_string(),
            wave: w.number,
            note: w.note,
        })
        .collect();
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
        changed_secrets: changed_secrets(run.shape(), shape),
        waves,
    }
}

/// The secret parameters whose value `proposed` changes from `current`
/// (`GROUP.template.boot.KEY`): a client sees both redacted, so only the
/// server can say that one changed; it never says to what.
fn changed_secrets(current: &ClusterShape, proposed: &ClusterShape) -> Vec<String> {
    let mut out = Vec::new();
    for g in &proposed.groups {
        let Some(before) = current.group(&g.id) else {
            continue;
        };
        for (section, old, new) in [
            ("boot", &before.template.boot, &g.template.boot),
            ("join", &before.template.join, &g.template.join),
        ] {
            for (key, p) in new {
                let secret = p.secret || old.get(key).is_some_and(|o| o.secret);
                if secret && old.get(key).is_some_and(|o| o.value != p.value) {
                    out.push(format!("{}.template.{section}.{key}", g.id));
                }
            }
        }
    }
    out
}

/// What the run's actor knows of the services it depends on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dependencies {
    /// Why the last pass could not reach the decider, while it cannot.
    pub decider_down: Option<String>,
    /// The executor link is down (no stream, or it is reconnecting).
    pub executor_link_down: bool,
    /// Why the run is halted (a write its store refused), while it is.
    pub halted: Option<String>,
    /// Providers the run's groups name that the executor cannot reach now.
    pub providers_down: Vec<String>,
}

/// A group's rollout in progress, as clients read it.
pub fn rollout_status(run: &RunState, group: &GroupId) -> Option<pb::RolloutStatus> {
    let meta = run.meta();
    let g = meta.shape.group(group)?;
    let r = run.rollout(group)?;
    let t = run.tally(group);
    let counts = run
        .group_counts()
        .into_iter()
        .find(|(id, _)| id == group)
        .map(|(_, c)| c)
        .unwrap_or_default();
    let budget = g.policy.rollout.resolve(g.count);
    Some(pb::RolloutStatus {
        generation: r.generation.get(),
        updated: t.updated,
        updated_ready: t.updated_ready,
        old: t.drifted(),
        unavailable: g.count.saturating_sub(counts.available),
        max_unavailable: decider::rollout_unavailable_budget(g),
        max_surge: budget.max_surge,
        surging: counts.surging,
        canary: g.policy.rollout.canary,
        promoted: r.promoted,
        canary_paused: r.canary_reached && !r.canary_done() && r.halted.is_none(),
        halted: r.halted.is_some(),
        halt_reason: r.halted.as_ref().map(|h| h.reason.clone()).unwrap_or_default(),
        failures: r.failures,
        reverted_from: r.reverted_from.map_or(0, |g| g.get()),
        started_at_ms: r.started_at.as_millis(),
        progress_deadline_ms: UnixMillis::to_wire(r.deadline(g)),
    })
}

/// The condition types, in the order a status lists them.
pub const CONDITION_TYPES: [&str; 4] = ["Ready", "Progressing", "Degraded", "Stalled"];

/// One condition as observed now, before its `since` is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub kind: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

/// At most this many nodes are named in a condition's message.
const NAMED: usize = 5;

/// What a run being deleted has left to do.
fn deleting_message(left: usize, paused: bool) -> String {
    let nodes = if left == 1 { "node" } else { "nodes" };
    if paused {
        format!("being deleted, paused: {left} {nodes} left to clean up once resumed")
    } else {
        format!("being deleted: {left} {nodes} left to clean up")
    }
}

fn named(nodes: &[String]) -> String {
    let mut s = nodes.iter().take(NAMED).cloned().collect::<Vec<_>>().join(", ");
    if nodes.len() > NAMED {
        s.push_str(&format!(" and {} more", nodes.len() - NAMED));
    }
    s
}

/// The run's conditions now (SPEC §8), in [`CONDITION_TYPES`] order.
/// [`DesiredView::template_for`] for nodes that come group by group: the
/// group is looked up once per run of its nodes (`last` keeps it).
fn template_for<'a, 'n>(
    desired: &DesiredView<'a>,
    last: &mut Option<(&'n GroupId, Option<&'a contract::NodeGroup>)>,
    id: &'n LogicalNodeId,
) -> Option<&'a Arc<NodeTemplate>> {
    let group = match *last {
        Some((g, d)) if g == id.group() => d,
        _ => {
            let d = desired.desired_group(id.group());
            *last = Some((id.group(), d));
            d
        }
    };
    group.filter(|g| id.index() < g.count).map(|g| &g.template)
}

pub fn observe(run: &RunState, deps: &Dependencies) -> [Observed; 4] {
    let meta = run.meta();
    let desired = run.desired_view();
    let mut want = 0usize;
    let mut ready = 0usize;
    let (mut lost, mut failed, mut permanent, mut moving) = (Vec::new(), Vec::new(), Vec::new(), 0usize);
    let mut unhealthy = Vec::new();
    let mut unhealthy_groups = std::collections::BTreeSet::new();
    let mut permanent_reason = None;
    let mut last_group = None;
    for n in run.nodes() {
        let Some(template) = template_for(&desired, &mut last_group, &n.id) else {
            continue;
        };
        want += 1;
        if n.is_ready() && NodeTemplate::same(template, &n.spec) {
            // Ready means observed ready: an unhealthy node is not.
            if n.facts.health.as_ref().is_some_and(|h| h.is_unhealthy()) {
                unhealthy.push(n.id.to_string());
                unhealthy_groups.insert(n.id.group().clone());
            } else {
                ready += 1;
            }
            continue;
        }
        let why = n.facts.failure.as_ref().map(|f| f.reason.as_str());
        if let Some(p) = n
            .retry
            .permanent
            .as_ref()
            .filter(|p| NodeTemplate::same(&p.spec, template))
        {
            permanent.push(n.id.to_string());
            permanent_reason.get_or_insert_with(|| p.reason.clone());
        } else if n.facts.lost || why.is_some_and(|w| w.starts_with(LOST_PREFIX)) {
            // The reason's prefix: a node stored lost before the driver kept
            // the fact itself.
            lost.push(n.id.to_string());
        } else if n.stage == NodeStage::Failed || n.retry.consecutive_failures > 0 {
            failed.push(n.id.to_string());
        } else {
            moving += 1;
        }
    }
    // Desired slots with no node yet are on their way.
    let missing = desired
        .groups()
        .map(|g| g.count as usize)
        .sum::<usize>()
        .saturating_sub(want);
    // Groups whose unhealthy nodes the remediation budget holds for good:
    // the decider held one of them (its last decision is rule 18) and the
    // group is over max_unhealthy, or its max_in_flight is 0. Nothing
    // changes there until a node heals or the budget changes. (Held only
    // because others are being replaced is a wait, not a stall.)
    let held_groups: std::collections::BTreeSet<&GroupId> =
        run.remediation_held().map(LogicalNodeId::group).collect();
    let mut held = Vec::new();
    if !unhealthy.is_empty() {
        for (group, counts) in run.group_counts() {
            if !held_groups.contains(&group) {
                continue;
            }
            let Some(g) = meta.shape.group(&group) else {
                continue;
            };
            let r = g.policy.remediation;
            let limit = r.max_unhealthy.resolve(g.count);
            if counts.unhealthy > limit {
                held.push(format!(
                    "{group}: {}/{} unhealthy or lost, more than max_unhealthy {} allows ({limit})",
                    counts.unhealthy, g.count, r.max_unhealthy
                ));
            } else if r.max_in_flight == 0 && unhealthy_groups.contains(&group) {
                held.push(format!("{group}: max_in_flight is 0"));
            }
        }
    }
    // Rollouts that halted (SPEC §9): nothing more happens to their groups
    // until a newer apply or a revert; and canaries waiting for a promotion.
    let mut halted_rollouts = Vec::new();
    let mut canaries = Vec::new();
    if !meta.deleting {
        for g in &meta.shape.groups {
            let Some(r) = run.rollout(&g.id) else {
                continue;
            };
            if let Some(h) = &r.halted {
                halted_rollouts.push(format!("{}: {}", g.id, h.reason));
            } else if r.canary_reached && !r.canary_done() {
                canaries.push(g.id.to_string());
            }
        }
    }
    let converged = run.is_converged();
    let generation = meta.shape.generation;
    let ready_c = if converged {
        Observed {
            kind: "Ready",
            status: true,
            reason: "Converged",
            message: format!("{ready} of {ready} nodes ready at generation {generation}"),
        }
    } else if meta.deleting {
        Observed {
            kind: "Ready",
            status: false,
            reason: "Deleting",
            message: deleting_message(run.nodes().count(), meta.paused),
        }
    } else {
        Observed {
            kind: "Ready",
            status: false,
            reason: "NotConverged",
            message: format!("{ready} of {} nodes ready", want + missing),
        }
    };
    let settled =
        !converged && !meta.deleting && lost.is_empty() && failed.is_empty() && moving == 0 && missing == 0;
    let remediation_held = settled && !held.is_empty();
    let rollout_halted = !converged && !halted_rollouts.is_empty();
    let stalled =
        rollout_halted || remediation_held || (settled && !permanent.is_empty() && unhealthy.is_empty());
    let stalled_c = if rollout_halted {
        Observed {
            kind: "Stalled",
            status: true,
            reason: "RolloutHalted",
            message: format!(
                "rollout halted: {}; the nodes on the old template keep serving until a newer apply",
                halted_rollouts.join("; ")
            ),
        }
    } else if remediation_held {
        Observed {
            kind: "Stalled",
            status: true,
            reason: "RemediationHeld",
            message: format!(
                "remediation held by its budget: {}; unhealthy: {}. So many at once is more likely the \
                 network or the probe than the nodes",
                held.join("; "),
                named(&unhealthy)
            ),
        }
    } else if stalled {
        Observed {
            kind: "Stalled",
            status: true,
            reason: "PermanentFailure",
            message: format!(
                "{} failed permanently ({}); change the node spec to retry",
                named(&permanent),
                permanent_reason.unwrap_or_default()
            ),
        }
    } else {
        Observed {
            kind: "Stalled",
            status: false,
            reason: "AsExpected",
            message: String::new(),
        }
    };
    let progressing_c = if converged {
        Observed {
            kind: "Progressing",
            status: false,
            reason: "Converged",
            message: String::new(),
        }
    } else if meta.paused {
        Observed {
            kind: "Progressing",
            status: false,
            reason: "Paused",
            message: "the run is paused; resume it to go on".to_owned(),
        }
    } else if stalled {
        Observed {
            kind: "Progressing",
            status: false,
            reason: "Stalled",
            message: String::new(),
        }
    } else if !canaries.is_empty() {
        Observed {
            kind: "Progressing",
            status: true,
            reason: "CanaryPaused",
            message: format!(
                "the canary of {} is on the new template: `provisionctl rollout promote {} GROUP` goes on",
                canaries.join(", "),
                meta.run_id
            ),
        }
    } else {
        Observed {
            kind: "Progressing",
            status: true,
            reason: if meta.deleting { "Deleting" } else { "Reconciling" },
            message: if meta.deleting {
                deleting_message(run.nodes().count(), false)
            } else {
                format!("{ready} of {} nodes ready", want + missing)
            },
        }
    };
    let degraded_c = if let Some(why) = &deps.halted {
        Observed {
            kind: "Degraded",
            status: true,
            reason: "Halted",
            message: format!(
                "{why}; nothing is done for the run until it is reloaded from its store, which is retried \
                 with backoff"
            ),
        }
    } else if let Some(why) = &deps.decider_down {
        Observed {
            kind: "Degraded",
            status: true,
            reason: "DeciderUnreachable",
            message: format!("the decider cannot be reached ({why}); nothing is decided until it is back"),
        }
    } else if deps.executor_link_down {
        Observed {
            kind: "Degraded",
            status: true,
            reason: "ExecutorLinkDown",
            message: "the executor link is down; operations wait until it is back".to_owned(),
        }
    } else if !deps.providers_down.is_empty() {
        Observed {
            kind: "Degraded",
            status: true,
            reason: "ProviderUnavailable",
            message: format!(
                "provider {} is unavailable at the executor; its operations wait, or end ambiguous and are \
                 adopted once it is back",
                deps.providers_down.join(", ")
            ),
        }
    } else if !lost.is_empty() {
        Observed {
            kind: "Degraded",
            status: true,
            reason: "NodesLost",
            message: format!("lost: {}; each is replaced on a fresh attempt", named(&lost)),
        }
    } else if !unhealthy.is_empty() {
        Observed {
            kind: "Degraded",
            status: true,
            reason: "NodesUnhealthy",
            message: format!("unhealthy: {}", named(&unhealthy)),
        }
    } else if !failed.is_empty() || !permanent.is_empty() {
        let mut all = failed.clone();
        all.extend(permanent.iter().cloned());
        Observed {
            kind: "Degraded",
            status: true,
            reason: "NodesFailed",
            message: format!("failed: {}", named(&all)),
        }
    } else {
        Observed {
            kind: "Degraded",
            status: false,
            reason: "AsExpected",
            message: String::new(),
        }
    };
    [ready_c, progressing_c, degraded_c, stalled_c]
}

/// The conditions of one run across its statuses: each keeps its status,
/// its reason and the time its status last changed, stored with the run
/// (`RunMeta::conditions`) so they outlive the driver's process.
#[derive(Debug, Clone, Default)]
pub struct Conditions {
    marks: BTreeMap<&'static str, ConditionMark>,
}

/// A condition whose status or reason changed at a stamp.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub kind: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

impl Conditions {
    /// The conditions as stored with the run.
    pub fn from_marks(stored: &[ConditionMark]) -> Self {
        let marks = stored
            .iter()
            .filter_map(|m| {
                let kind = CONDITION_TYPES.into_iter().find(|k| *k == m.kind)?;
                Some((kind, m.clone()))
            })
            .collect();
        Self { marks }
    }

    /// What to store with the run.
    pub fn marks(&self) -> Vec<ConditionMark> {
        CONDITION_TYPES
            .iter()
            .filter_map(|k| self.marks.get(k).cloned())
            .collect()
    }

    /// `observed` with the time each condition's status last changed, and
    /// the conditions whose status or reason changed since the last stamp.
    pub fn stamp(
        &mut self,
        observed: [Observed; 4],
        generation: u64,
        now: UnixMillis,
    ) -> (Vec<pb::Condition>, Vec<Transition>) {
        let mut transitions = Vec::new();
        let conditions = observed
            .into_iter()
            .map(|o| {
                let since = match self.marks.get_mut(o.kind) {
                    Some(m) if m.status == o.status => {
                        if m.reason != o.reason {
                            m.reason = o.reason.to_owned();
                            transitions.push(Transition {
                                kind: o.kind,
                                status: o.status,
                                reason: o.reason,
                                message: o.message.clone(),
                            });
                        }
                        m.since
                    }
                    _ => {
                        self.marks.insert(
                            o.kind,
                            ConditionMark {
                                kind: o.kind.to_owned(),
                                status: o.status,
                                reason: o.reason.to_owned(),
                                since: now,
                            },
                        );
                        transitions.push(Transition {
                            kind: o.kind,
                            status: o.status,
                            reason: o.reason,
                            message: o.message.clone(),
                        });
                        now
                    }
                };
                pb::Condition {
                    r#type: o.kind.to_owned(),
                    status: o.status,
                    reason: o.reason.to_owned(),
                    message: o.message,
                    since_ms: since.as_millis(),
                    observed_generation: generation,
                }
            })
            .collect();
        (conditions, transitions)
    }
}
