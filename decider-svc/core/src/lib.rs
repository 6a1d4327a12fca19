//! The decider: the pure decision function of the provisioning reconciler.
//!
//! `decide(desired, nodes, existing slots, now)` returns one [`Decision`] per node
//! (an action or a wait, each with its ladder rule and a reason) plus an `Insert`
//! for every desired slot that has no node, and `requeue_at`, the earliest future
//! stored deadline among waiting nodes. The ladder is [`decide_node`]; it reads
//! like the table in SPEC.md section 3, one `if` per row, first match wins.
//!
//! This crate does no I/O, reads no clock and uses no randomness: `now` is an
//! argument and every deadline it compares was computed and stored by the driver.
//! `clippy.toml` bans the clock functions here, and the crate depends on nothing
//! but the contract's plain domain types.

#![forbid(unsafe_code)]

use std::{borrow::Cow, collections::HashMap, sync::Arc};

use contract::{
    Action, ClusterShape, DecideOutput, Decision, Effect, GroupCounts, GroupId, Intent, LogicalNodeId,
    ManagedNode, NodeGroup, NodeStage, NodeTemplate, Rule, Surge, UnixMillis,
};

/// The desired shape as the ladder sees it: which slots are wanted, and with
/// which template. A deleting run wants nothing.
#[derive(Debug, Clone)]
pub struct DesiredView<'a> {
    groups: &'a [NodeGroup],
    deleting: bool,
    /// Only built for shapes with many groups; a linear scan wins below that.
    index: Option<HashMap<&'a GroupId, usize>>,
    /// Each group's day-2 counts over the whole run (the Decide header's), for
    /// the remediation budget. A group not here has none.
    counts: HashMap<GroupId, GroupCounts>,
}

const INDEX_THRESHOLD: usize = 16;

impl<'a> DesiredView<'a> {
    pub fn new(shape: &'a ClusterShape, deleting: bool) -> Self {
        Self::from_groups(&shape.groups, deleting)
    }

    pub fn from_groups(groups: &'a [NodeGroup], deleting: bool) -> Self {
        let index = (groups.len() > INDEX_THRESHOLD)
            .then(|| groups.iter().enumerate().map(|(i, g)| (&g.id, i)).collect());
        Self {
            groups,
            deleting,
            index,
            counts: HashMap::new(),
        }
    }

    /// The view with the run's per-group counts (see [`GroupCounts`]).
    pub fn with_counts(mut self, counts: impl IntoIterator<Item = (GroupId, GroupCounts)>) -> Self {
        self.counts = counts.into_iter().collect();
        self
    }

    pub fn counts(&self, group: &GroupId) -> GroupCounts {
        self.counts.get(group).copied().unwrap_or_default()
    }

    /// A view that wants nothing (a run with no shape, or being deleted).
    pub fn empty() -> DesiredView<'static> {
        DesiredView {
            groups: &[],
            deleting: true,
            index: None,
            counts: HashMap::new(),
        }
    }

    fn group(&self, id: &GroupId) -> Option<&'a NodeGroup> {
        match &self.index {
            Some(index) => index.get(id).map(|&i| &self.groups[i]),
            None => self.groups.iter().find(|g| &g.id == id),
        }
    }

    /// A group as desired; `None` for a group the shape does not have, or
    /// any group of a deleting run.
    pub fn desired_group(&self, id: &GroupId) -> Option<&'a NodeGroup> {
        if self.deleting {
            return None;
        }
        self.group(id)
    }

    /// The template a slot should hold, or `None` if the slot is undesired.
    pub fn template_for(&self, node: &LogicalNodeId) -> Option<&'a Arc<NodeTemplate>> {
        self.desired_group(node.group())
            .filter(|g| node.index() < g.count)
            .map(|g| &g.template)
    }

    pub fn groups(&self) -> impl Iterator<Item = &'a NodeGroup> {
        let groups = if self.deleting { &[][..] } else { self.groups };
        groups.iter()
    }
}

/// The slots a run holds, decided this pass or not, so that the decider can
/// see which desired slots have no node.
///
/// Kept as ranges per group, so a run that holds its slots without gaps (the
/// common case, whatever its size) is one range per group: the set costs what
/// its gaps cost, not what the run holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotSet {
    groups: HashMap<GroupId, Vec<SlotRange>>,
    sorted: bool,
}

/// The slot indices `start..end` of one group (half-open, `start < end`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SlotRange {
    pub start: u32,
    pub end: u32,
}

impl Default for SlotSet {
    fn default() -> Self {
        Self::new()
    }
}

impl SlotSet {
    pub fn new() -> Self {
        Self {
            groups: HashMap::new(),
            sorted: true,
        }
    }

    pub fn insert(&mut self, node: &LogicalNodeId) {
        self.insert_index(node.group(), node.index());
    }

    pub fn insert_index(&mut self, group: &GroupId, index: u32) {
        self.insert_range(group, index, index.saturating_add(1));
    }

    /// Adds the indices `start..end`; an empty range adds nothing. Ranges may
    /// overlap and come in any order; [`SlotSet::finish`] merges them.
    pub fn insert_range(&mut self, group: &GroupId, start: u32, end: u32) {
        if start >= end {
            return;
        }
        let v = match self.groups.get_mut(group) {
            Some(v) => v,
            None => self.groups.entry(group.clone()).or_default(),
        };
        match v.last_mut() {
            // In order and touching the last range (the common case: slots
            // added in ascending order): extend it.
            Some(last) if last.start <= start && start <= last.end => last.end = last.end.max(end),
            Some(last) if last.end < start => v.push(SlotRange { start, end }),
            Some(_) => {
                self.sorted = false;
                v.push(SlotRange { start, end });
            }
            None => v.push(SlotRange { start, end }),
        }
    }

    /// Sorts and merges the ranges; lookups need it, and the inserts keep a
    /// cheap flag so that slots added in order (the common case) cost nothing
    /// here.
    pub fn finish(&mut self) {
        if !self.sorted {
            for v in self.groups.values_mut() {
                v.sort_unstable();
                let mut merged: Vec<SlotRange> = Vec::with_capacity(v.len());
                for r in v.drain(..) {
                    match merged.last_mut() {
                        Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                        _ => merged.push(r),
                    }
                }
                *v = merged;
            }
            self.sorted = true;
        }
    }

    pub fn contains(&self, node: &LogicalNodeId) -> bool {
        debug_assert!(self.sorted, "SlotSet::finish must be called before lookups");
        let index = node.index();
        self.groups.get(node.group()).is_some_and(|v| {
            let after = v.partition_point(|r| r.start <= index);
            after > 0 && v[after - 1].end > index
        })
    }

    /// How many slots the set holds.
    pub fn len(&self) -> usize {
        self.groups
            .values()
            .flatten()
            .map(|r| (r.end - r.start) as usize)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.groups.values().all(Vec::is_empty)
    }

    /// One group's ranges, ascending, disjoint and not touching (after
    /// `finish`).
    pub fn ranges(&self, group: &GroupId) -> &[SlotRange] {
        self.groups.get(group).map_or(&[], Vec::as_slice)
    }

    /// Indices held for one group, ascending (after `finish`).
    pub fn indices(&self, group: &GroupId) -> impl Iterator<Item = u32> + '_ {
        self.ranges(group).iter().flat_map(|r| r.start..r.end)
    }

    pub fn iter_groups(&self) -> impl Iterator<Item = (&GroupId, &[SlotRange])> {
        self.groups.iter().map(|(g, v)| (g, v.as_slice()))
    }
}

fn decision(
    node: &ManagedNode,
    rule: Rule,
    action: Action,
    reason: impl Into<Cow<'static, str>>,
) -> Decision {
    Decision {
        node: node.id.clone(),
        attempt: Some(node.attempt),
        rule,
        action,
        reason: reason.into(),
    }
}

fn wait(
    node: &ManagedNode,
    rule: Rule,
    until: Option<UnixMillis>,
    reason: impl Into<Cow<'static, str>>,
) -> Decision {
    decision(node, rule, Action::Wait { until }, reason)
}

/// What the ladder makes of one node: a decision, or a node whose
/// replacement a group budget decides once every such node of the pass is
/// known ([`Budgets`]).
enum Step {
    Decided(Decision),
    Remediate(Candidate),
    Roll(Candidate),
}

/// A ready node whose replacement waits on a budget: unhealthy past its
/// deadline (remediation), or drifted from its group's template (rollout).
#[derive(Debug, Clone)]
struct Candidate {
    node: LogicalNodeId,
    attempt: contract::AttemptId,
    /// Remediation only: since when it is unhealthy, and the probe's words.
    since: UnixMillis,
    detail: String,
}

impl Candidate {
    fn held(&self, rule: Rule, reason: String) -> Decision {
        Decision {
            node: self.node.clone(),
            attempt: Some(self.attempt),
            rule,
            action: Action::Wait { until: None },
            reason: reason.into(),
        }
    }

    fn replace(&self, reason: String) -> Decision {
        Decision {
            node: self.node.clone(),
            attempt: Some(self.attempt),
            rule: Rule::BeginDelete,
            action: Action::BeginDelete,
            reason: reason.into(),
        }
    }
}

/// The group budgets of one pass. Nodes due for a budgeted replacement are
/// held back until every node of the pass was seen, then granted per group
/// in a deterministic order, each grant counted against the budget of the
/// grants after it:
///
/// - remediation (SPEC.md section 8): longest unhealthy first, then lowest
///   index, up to `max_in_flight` less those already in flight, unless more
///   of the group is unhealthy or lost than `max_unhealthy` allows;
/// - rollout (SPEC.md section 9): lowest index first, while the group's
///   unavailable desired slots stay within `max_unavailable`, unless its
///   canary waits for a promotion or its rollout halted.
///
/// The counts come from the Decide header ([`GroupCounts`]), so a pass that
/// decides only some of a group's nodes still sees the whole group.
#[derive(Debug, Default)]
pub struct Budgets {
    remediate: Vec<Candidate>,
    roll: Vec<Candidate>,
}

impl Budgets {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.remediate.is_empty() && self.roll.is_empty()
    }

    /// One decision per node offered: `BeginDelete` (row 4) for the granted,
    /// a wait under row 17 or 18 for the held, each saying which budget and
    /// the counts.
    pub fn settle(self, desired: &DesiredView<'_>, now: UnixMillis) -> Vec<Decision> {
        let mut out = Vec::with_capacity(self.remediate.len() + self.roll.len());
        settle_remediations(self.remediate, desired, now, &mut out);
        settle_rollouts(self.roll, desired, &mut out);
        out
    }
}

fn settle_remediations(
    mut candidates: Vec<Candidate>,
    desired: &DesiredView<'_>,
    now: UnixMillis,
    out: &mut Vec<Decision>,
) {
    candidates.sort_by(|a, b| {
        (a.node.group(), a.since, a.node.index()).cmp(&(b.node.group(), b.since, b.node.index()))
    });
    let mut granted_in_group = 0u32;
    let mut group: Option<&GroupId> = None;
    for c in &candidates {
        if group != Some(c.node.group()) {
            group = Some(c.node.group());
            granted_in_group = 0;
        }
        let Some(g) = desired.group(c.node.group()) else {
            continue;
        };
        let policy = g.policy.remediation;
        let counts = desired.counts(&g.id);
        let max_unhealthy = policy.max_unhealthy.resolve(g.count);
        let in_flight = counts.remediating + granted_in_group;
        let held = |reason: String| c.held(Rule::RemediationBudget, reason);
        let d = if counts.unhealthy > max_unhealthy {
            held(format!(
                "{}: {}/{} unhealthy or lost, more than max_unhealthy {} allows ({}): remediation held",
                g.id, counts.unhealthy, g.count, policy.max_unhealthy, max_unhealthy
            ))
        } else if policy.max_in_flight == 0 {
            held(format!(
                "{}: max_in_flight is 0: unhealthy nodes are reported, never replaced",
                g.id
            ))
        } else if in_flight >= policy.max_in_flight {
            held(format!(
                "{}: {}/{} remediations in flight: waiting for one to finish",
                g.id, in_flight, policy.max_in_flight
            ))
        } else {
            granted_in_group += 1;
            let secs = now.saturating_since(c.since).as_secs();
            c.replace(format!(
                "unhealthy for {secs}s ({}): remediate ({}: {}/{} in flight)",
                c.detail,
                g.id,
                in_flight + 1,
                policy.max_in_flight
            ))
        };
        out.push(d);
    }
}

/// The unavailable budget a group's rollout may use (a percentage rounded
/// down; with surge also 0, one node at a time).
pub fn rollout_unavailable_budget(g: &NodeGroup) -> u32 {
    g.policy.rollout.resolve(g.count).max_unavailable
}

fn settle_rollouts(mut candidates: Vec<Candidate>, desired: &DesiredView<'_>, out: &mut Vec<Decision>) {
    candidates.sort_by(|a, b| (a.node.group(), a.node.index()).cmp(&(b.node.group(), b.node.index())));
    let (mut granted_in_group, mut surged_in_group) = (0u32, 0u32);
    let mut group: Option<&GroupId> = None;
    for c in &candidates {
        if group != Some(c.node.group()) {
            group = Some(c.node.group());
            granted_in_group = 0;
            surged_in_group = 0;
        }
        let Some(g) = desired.group(c.node.group()) else {
            continue;
        };
        let policy = g.policy.rollout;
        let counts = desired.counts(&g.id);
        let budget = policy.resolve(g.count);
        let unavailable = g.count.saturating_sub(counts.available) + granted_in_group;
        let surging = counts.surging + surged_in_group;
        let replaced = counts.updated + granted_in_group + surged_in_group;
        let held = |reason: String| c.held(Rule::RolloutBudget, reason);
        let d = if counts.halted {
            held(format!(
                "{}: the rollout halted: a newer apply (or a revert) ends the halt",
                g.id
            ))
        } else if policy.canary > 0 && !counts.canary_done && replaced >= policy.canary {
            held(format!(
                "{}: canary {}/{} on the new template: waiting for a promotion (provisionctl rollout promote)",
                g.id,
                replaced.min(policy.canary),
                policy.canary
            ))
        } else if surging < budget.max_surge {
            surged_in_group += 1;
            Decision {
                node: c.node.clone(),
                attempt: Some(c.attempt),
                rule: Rule::SurgeInsert,
                action: Action::Surge,
                reason: format!(
                    "the spec changed: a successor on the new template while this attempt serves ({}: {}/{} surging)",
                    g.id,
                    surging + 1,
                    budget.max_surge
                )
                .into(),
            }
        } else if unavailable >= budget.max_unavailable {
            held(format!(
                "{}: {}/{} unavailable, {}/{} surging: waiting for a replacement to become ready",
                g.id, unavailable, budget.max_unavailable, surging, budget.max_surge
            ))
        } else {
            granted_in_group += 1;
            c.replace(format!(
                "the spec changed: replace the attempt ({}: {}/{} unavailable)",
                g.id,
                unavailable + 1,
                budget.max_unavailable
            ))
        };
        out.push(d);
    }
}

/// The ladder for one node, a budget applied with the view's counts as if it
/// were the only node of the pass that the budget decides.
pub fn decide_node(desired: &DesiredView<'_>, n: &ManagedNode, now: UnixMillis) -> Decision {
    let mut b = Budgets::new();
    match decide_or_defer(desired, n, now, &mut b) {
        Some(d) => d,
        // `settle` answers every candidate whose group is desired, and the
        // ladder offers only nodes of desired groups.
        None => b
            .settle(desired, now)
            .pop()
            .unwrap_or_else(|| wait(n, Rule::RemediationBudget, None, "group not desired")),
    }
}

/// The ladder for one node in a pass of many: the decision, or `None` when
/// a group budget decides the node: it went to `budgets`, which answers for
/// it in [`Budgets::settle`].
pub fn decide_or_defer(
    desired: &DesiredView<'_>,
    n: &ManagedNode,
    now: UnixMillis,
    budgets: &mut Budgets,
) -> Option<Decision> {
    match ladder(desired, n, now) {
        Step::Decided(d) => Some(d),
        Step::Remediate(c) => {
            budgets.remediate.push(c);
            None
        }
        Step::Roll(c) => {
            budgets.roll.push(c);
            None
        }
    }
}

/// The ladder for one node. Remediation and the rollout budget are row 4
/// for a ready node with nothing pending (rows 1-3 and 5-10 fire for none of
/// those): unhealthy past its stored deadline, or drifted from its group's
/// template while it still serves; a budget decides them ([`Budgets`]).
fn ladder(desired: &DesiredView<'_>, n: &ManagedNode, now: UnixMillis) -> Step {
    if let Some(d) = surge_rows(desired, n) {
        return Step::Decided(d);
    }
    if due_for_remediation(desired, n, now)
        && let Some(h) = &n.facts.health
    {
        return Step::Remediate(Candidate {
            node: n.id.clone(),
            attempt: n.attempt,
            since: h.since,
            detail: h.detail.clone(),
        });
    }
    if rolls_within_budget(desired, n) {
        return Step::Roll(Candidate {
            node: n.id.clone(),
            attempt: n.attempt,
            since: now,
            detail: String::new(),
        });
    }
    Step::Decided(rows(desired, n, now))
}

/// A desired slot holding two attempts (SPEC.md section 9): the current
/// attempt serves until its successor does, then hands the slot over (row 4)
/// and, once cleaned up, leaves it to the successor (row 1's reap); a
/// successor that was cleaned up before it served is reaped, and the current
/// attempt keeps the slot. A current attempt that stops serving (failed,
/// lost, unhealthy) and an undesired slot take the ladder as any node does.
fn surge_rows(desired: &DesiredView<'_>, n: &ManagedNode) -> Option<Decision> {
    desired.template_for(&n.id)?;
    match n.surge {
        Surge::None => None,
        Surge::Successor => (n.stage == NodeStage::Destroyed).then(|| {
            decision(
                n,
                Rule::Reap,
                Action::Reap,
                "a successor cleaned up before it served: the current attempt keeps the slot",
            )
        }),
        Surge::Current {
            successor,
            successor_ready,
        } => {
            if n.stage == NodeStage::Destroyed {
                return Some(decision(
                    n,
                    Rule::Reap,
                    Action::Reap,
                    format!("cleaned up: its successor {successor} takes the slot"),
                ));
            }
            if !serving(n) || n.facts.is_impaired() {
                return None;
            }
            Some(if successor_ready {
                decision(
                    n,
                    Rule::BeginDelete,
                    Action::BeginDelete,
                    format!("its successor {successor} serves: hand the slot over"),
                )
            } else {
                wait(
                    n,
                    Rule::RolloutBudget,
                    None,
                    format!("its successor {successor} is being provisioned (surge)"),
                )
            })
        }
    }
}

/// An active, ready attempt with nothing pending.
fn serving(n: &ManagedNode) -> bool {
    n.intent == Intent::Active && n.stage.is_ready() && n.pending.is_none() && !n.facts.bootstrap_failed()
}

/// A ready node that is still wanted as it is, with nothing pending, and
/// unhealthy past its stored deadline: what the remediation budget decides.
/// The driver asks the same when it applies a `BeginDelete`, to know it for a
/// replacement for health.
pub fn due_for_remediation(desired: &DesiredView<'_>, n: &ManagedNode, now: UnixMillis) -> bool {
    serving(n)
        && n.facts.health.as_ref().is_some_and(|h| h.due(now))
        && desired
            .template_for(&n.id)
            .is_some_and(|t| NodeTemplate::same(t, &n.spec))
}

/// A ready node that serves (neither unhealthy nor lost) in a desired slot
/// whose template changed: its replacement is a rollout's, and waits for the
/// group's budget. Undesired, failed, lost and unhealthy nodes never wait:
/// they are unavailable already.
pub fn rolls_within_budget(desired: &DesiredView<'_>, n: &ManagedNode) -> bool {
    serving(n)
        && !n.facts.is_impaired()
        && desired
            .template_for(&n.id)
            .is_some_and(|t| !NodeTemplate::same(t, &n.spec))
}

/// The ladder's rows for one node: first matching row wins. Row numbers are
/// SPEC.md's.
fn rows(desired: &DesiredView<'_>, n: &ManagedNode, now: UnixMillis) -> Decision {
    let wanted = desired.template_for(&n.id);
    let due = |t: Option<UnixMillis>| t.is_none_or(|t| t <= now);

    // Rows 1-3: a destroyed node is reaped, restarted, or waits to restart.
    if n.stage == NodeStage::Destroyed {
        let Some(template) = wanted else {
            return decision(
                n,
                Rule::Reap,
                Action::Reap,
                "destroyed and the slot is no longer desired",
            );
        };
        if let Some(p) = &n.retry.permanent
            && NodeTemplate::same(&p.spec, template)
        {
            return wait(
                n,
                Rule::RestartBackoff,
                None,
                format!(
                    "permanent failure ({}); change the node's spec to retry",
                    p.reason
                ),
            );
        }
        // The backoff paces retries of one template: a slot whose template
        // changed restarts on the new one at once (its failure count still
        // carries), paced by the rollout budget instead.
        if !due(n.retry.restart_at) && NodeTemplate::same(template, &n.spec) {
            return wait(
                n,
                Rule::RestartBackoff,
                n.retry.restart_at,
                "restart is backing off",
            );
        }
        let reason = if NodeTemplate::same(template, &n.spec) {
            "destroyed and still desired: fresh attempt"
        } else {
            "destroyed and still desired: fresh attempt on the new template"
        };
        return decision(n, Rule::Restart, Action::Restart, reason);
    }

    // Row 4: an active attempt that is unwanted, drifted or failed begins cleanup.
    if n.intent == Intent::Active {
        let why = match wanted {
            None => Some("the slot is no longer desired"),
            Some(t) if !NodeTemplate::same(t, &n.spec) => Some("the spec changed: replace the attempt"),
            Some(_) if n.stage == NodeStage::Failed || n.facts.bootstrap_failed() => {
                Some("the attempt failed: clean it up")
            }
            Some(_) => None,
        };
        if let Some(why) = why {
            return decision(n, Rule::BeginDelete, Action::BeginDelete, why);
        }
    }

    // Row 5: one pending operation per node; wait for its result or deadline.
    if let Some(p) = &n.pending {
        let reason: &'static str = match p.effect {
            Effect::CreateLease => "waiting for create-lease",
            Effect::LookupEndpoint => "waiting for lookup-endpoint",
            Effect::StartBootstrap => "waiting for start-bootstrap",
            Effect::CancelBootstrap => "waiting for cancel-bootstrap",
            Effect::DestroyLease => "waiting for destroy-lease",
        };
        return wait(n, Rule::Pending, Some(p.deadline), reason);
    }

    // Rows 6-9: cleanup, in order, each effect gated by the retry backoff.
    if n.intent == Intent::Deleting {
        let step = if n.facts.ambiguous_create {
            Some((
                Rule::ReissueCreate,
                Effect::CreateLease,
                "a create ended ambiguously: re-issue it so the executor adopts what it made",
            ))
        } else if n.facts.session.is_some() || n.facts.ambiguous_bootstrap {
            Some((
                Rule::CancelBootstrap,
                Effect::CancelBootstrap,
                "cleanup: cancel the bootstrap session",
            ))
        } else if n.facts.lease.is_some() {
            Some((
                Rule::DestroyLease,
                Effect::DestroyLease,
                "cleanup: destroy the lease",
            ))
        } else {
            None
        };
        return match step {
            Some((rule, _, _)) if !due(n.retry.next_effect_at) => wait(
                n,
                rule,
                n.retry.next_effect_at,
                "cleanup is backing off after a failure",
            ),
            Some((rule, effect, reason)) => decision(n, rule, Action::Dispatch(effect), reason),
            None => decision(n, Rule::MarkDestroyed, Action::MarkDestroyed, "cleanup complete"),
        };
    }

    // Row 10: retry backoff (or probe interval) not due.
    if !due(n.retry.next_effect_at) {
        return wait(
            n,
            Rule::RetryBackoff,
            n.retry.next_effect_at,
            "backing off before the next try",
        );
    }

    // Row 11: ready is the steady state. An unhealthy node not yet due for
    // remediation wants another look at its stored deadline.
    if n.stage.is_ready() {
        if let Some(h) = n.facts.health.as_ref().filter(|h| h.is_unhealthy()) {
            return wait(
                n,
                Rule::Ready,
                h.remediate_at,
                format!(
                    "ready but unhealthy ({}): remediation is due at its deadline",
                    h.detail
                ),
            );
        }
        return wait(n, Rule::Ready, None, "ready");
    }

    // Rows 12-16: the healthy progression.
    if n.facts.lease.is_none() {
        let reason = if n.facts.ambiguous_create {
            "re-issue the ambiguous create so the executor adopts what it made"
        } else {
            "no lease yet: create one"
        };
        return decision(
            n,
            Rule::CreateLease,
            Action::Dispatch(Effect::CreateLease),
            reason,
        );
    }
    if n.facts.endpoint.is_none() {
        return decision(
            n,
            Rule::LookupEndpoint,
            Action::Dispatch(Effect::LookupEndpoint),
            "lease created: look up its endpoint",
        );
    }
    if n.facts.session.is_some() {
        if n.facts.bootstrap_converged() {
            return decision(
                n,
                Rule::ObserveConvergence,
                Action::ObserveConvergence,
                "bootstrap converged: the node is ready",
            );
        }
        return wait(
            n,
            Rule::AwaitBootstrap,
            n.stage_deadline,
            "bootstrap running: awaiting its stages",
        );
    }
    decision(
        n,
        Rule::StartBootstrap,
        Action::Dispatch(Effect::StartBootstrap),
        "endpoint known: start the bootstrap",
    )
}

/// An `Insert` for every desired slot that the run does not hold, in group
/// order then ascending index. It walks the gaps between the held ranges, so
/// a pass over a run that holds every slot costs one step per group.
pub fn inserts<'s>(
    desired: &'s DesiredView<'_>,
    existing: &'s SlotSet,
) -> impl Iterator<Item = Decision> + 's {
    desired.groups().flat_map(move |g| {
        let held = existing.ranges(&g.id);
        // Each gap runs from the end of one held range (or 0) to the start of
        // the next (or the group's count).
        let gap_starts = std::iter::once(0).chain(held.iter().map(|r| r.end));
        let gap_ends = held.iter().map(|r| r.start).chain(std::iter::once(u32::MAX));
        gap_starts
            .zip(gap_ends)
            .take_while(move |&(from, _)| from < g.count)
            .flat_map(move |(from, to)| from..to.min(g.count))
            .map(move |i| Decision {
                node: LogicalNodeId::new(g.id.clone(), i),
                attempt: None,
                rule: Rule::Insert,
                action: Action::Insert,
                reason: Cow::Borrowed("desired slot has no node"),
            })
    })
}

/// Folds a decision into a running `requeue_at`: the earliest wait deadline
/// strictly after `now` (a deadline already past is the driver's to fold, and
/// requeueing for it would spin).
pub fn fold_requeue(acc: Option<UnixMillis>, d: &Decision, now: UnixMillis) -> Option<UnixMillis> {
    match d.action {
        Action::Wait { until: Some(t) } if t > now => Some(acc.map_or(t, |a| a.min(t))),
        _ => acc,
    }
}

/// One whole pass: a decision per given node (those a group budget decides
/// after the others, as the budgets settled them), inserts for missing slots, and
/// `requeue_at`. `existing` must hold every slot of the run (finished), not only
/// the nodes passed in.
pub fn decide<'n>(
    desired: &DesiredView<'_>,
    nodes: impl IntoIterator<Item = &'n ManagedNode>,
    existing: &SlotSet,
    now: UnixMillis,
) -> DecideOutput {
    let mut out = DecideOutput::default();
    let mut budgets = Budgets::new();
    for n in nodes {
        if let Some(d) = decide_or_defer(desired, n, now, &mut budgets) {
            out.requeue_at = fold_requeue(out.requeue_at, &d, now);
            out.decisions.push(d);
        }
    }
    out.decisions.extend(budgets.settle(desired, now));
    out.decisions.extend(inserts(desired, existing));
    out
}
