//! Table tests for the decider's ladder (SPEC.md section 3 and the reference's
//! "per-pass decision ladder"), all through one `check()` helper, plus seeded
//! random properties over `decide_node`, `inserts`, `SlotSet` and `decide`.
//!
//! Every ladder row has the condition that fires it and the nearest condition
//! that does not (one fact flipped), with the rule that fires instead.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use contract::{
    Action, AttemptId, BootstrapProgress, BootstrapStage, ClusterShape, Decision, Effect, Endpoint, Failure,
    Generation, GroupId, Intent, LeaseId, LogicalNodeId, ManagedNode, NodeGroup, NodeStage, NodeTemplate,
    OperationId, Param, PendingOp, PermanentFailure, RetryState, Rule, RunId, SessionId, UnixMillis,
    shape::example_template,
};
use decider::{DesiredView, SlotSet, decide, decide_node, fold_requeue, inserts};

// ---------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------

const NOW: u64 = 1_000_000;
const ATTEMPT: u64 = 42;

fn at(ms: u64) -> UnixMillis {
    UnixMillis::new(ms)
}

fn now() -> UnixMillis {
    at(NOW)
}

fn gid(s: &str) -> GroupId {
    GroupId::parse("group", s).unwrap()
}

fn nid(s: &str) -> LogicalNodeId {
    LogicalNodeId::parse("node", s).unwrap()
}

/// The template nodes are built from; a fresh `Arc` each time, so the decider
/// must compare templates by value, not by pointer.
fn template(image: &str) -> Arc<NodeTemplate> {
    Arc::new(example_template("fake", image))
}

fn shape(groups: Vec<NodeGroup>) -> ClusterShape {
    ClusterShape {
        run_id: RunId::parse("run_id", "run").unwrap(),
        generation: Generation::new(3),
        labels: Default::default(),
        groups,
    }
}

fn group(id: &str, count: u32, template: Arc<NodeTemplate>) -> NodeGroup {
    NodeGroup {
        id: gid(id),
        count,
        template,
        policy: Default::default(),
    }
}

fn wait(until: Option<u64>) -> Action {
    Action::Wait { until: until.map(at) }
}

fn dispatch(e: Effect) -> Action {
    Action::Dispatch(e)
}

/// Node builder: `node("w-0").stage(..).lease().endpoint().session()`.
#[derive(Debug, Clone)]
struct N(ManagedNode);

fn node(id: &str) -> N {
    N(ManagedNode::new(
        nid(id),
        AttemptId::new(ATTEMPT),
        template("img:1"),
        RetryState::default(),
    ))
}

impl N {
    fn stage(mut self, s: NodeStage) -> Self {
        self.0.stage = s;
        self
    }
    fn deleting(mut self) -> Self {
        self.0.intent = Intent::Deleting;
        self
    }
    fn spec(mut self, t: Arc<NodeTemplate>) -> Self {
        self.0.spec = t;
        self
    }
    fn lease(mut self) -> Self {
        self.0.facts.lease = Some(LeaseId::new("lease", "lease-1").unwrap());
        self
    }
    fn endpoint(mut self) -> Self {
        self.0.facts.endpoint = Some(Endpoint::new("endpoint", "127.0.0.1:4242").unwrap());
        self
    }
    fn session(mut self) -> Self {
        self.0.facts.session = Some(SessionId::new("session", "sess-1").unwrap());
        self
    }
    fn bootstrap(mut self, stage: BootstrapStage) -> Self {
        self.0.facts.bootstrap = Some(BootstrapProgress {
            stage,
            seq: 4,
            at: at(NOW - 10),
            detail: String::new(),
        });
        self
    }
    fn failure(mut self, reason: &str) -> Self {
        self.0.facts.failure = Some(Failure {
            reason: reason.to_owned(),
            at: at(NOW - 10),
        });
        self
    }
    fn ambiguous_create(mut self) -> Self {
        self.0.facts.ambiguous_create = true;
        self
    }
    fn ambiguous_bootstrap(mut self) -> Self {
        self.0.facts.ambiguous_bootstrap = true;
        self
    }
    fn pending(mut self, effect: Effect, deadline: u64) -> Self {
        self.0.pending = Some(PendingOp {
            id: OperationId::new(AttemptId::new(ATTEMPT), 3),
            effect,
            deadline: at(deadline),
            dispatched_at: at(NOW - 100),
        });
        self
    }
    fn next_effect_at(mut self, t: u64) -> Self {
        self.0.retry.next_effect_at = Some(at(t));
        self
    }
    fn restart_at(mut self, t: u64) -> Self {
        self.0.retry.restart_at = Some(at(t));
        self
    }
    fn permanent(mut self, reason: &str, spec: Arc<NodeTemplate>) -> Self {
        self.0.retry.permanent = Some(PermanentFailure {
            reason: reason.to_owned(),
            spec,
        });
        self
    }
    fn stage_deadline(mut self, t: u64) -> Self {
        self.0.stage_deadline = Some(at(t));
        self
    }
    /// Unhealthy since `since`, due for remediation at `due`.
    fn unhealthy(mut self, since: u64, due: u64) -> Self {
        self.0.facts.health = Some(contract::NodeHealth {
            healthy: false,
            since: at(since),
            observed_at: at(since),
            seq: 1,
            detail: "no answer".to_owned(),
            remediate_at: Some(at(due)),
        });
        self
    }
    /// A fully provisioned, ready node.
    fn ready(self) -> Self {
        self.stage(NodeStage::Dormant)
            .lease()
            .endpoint()
            .session()
            .bootstrap(BootstrapStage::Converged)
    }
}

/// What the desired shape says about the node under test (always group `w`).
#[derive(Debug, Clone)]
enum Want {
    /// Desired, with the node's own template (`img:1`), and `count == index + 1`
    /// (the last desired slot, so an off-by-one in the count check shows).
    Current,
    /// Desired (`count == index + 1`), with another template: drift.
    Template(Arc<NodeTemplate>),
    /// Group `w` exists but `count == index`: the first undesired slot.
    BeyondCount,
    /// The shape has no group `w` (only group `other`).
    GroupMissing,
    /// The shape is `Current`, but the run is being deleted.
    RunDeleting,
}

impl Want {
    fn shape_for(&self, id: &LogicalNodeId) -> (ClusterShape, bool) {
        let i = id.index();
        match self {
            Want::Current => (shape(vec![group("w", i + 1, template("img:1"))]), false),
            Want::Template(t) => (shape(vec![group("w", i + 1, t.clone())]), false),
            Want::BeyondCount => (shape(vec![group("w", i, template("img:1"))]), false),
            Want::GroupMissing => (shape(vec![group("other", 8, template("img:1"))]), false),
            Want::RunDeleting => (shape(vec![group("w", i + 1, template("img:1"))]), true),
        }
    }
}

/// One row of a table: a named situation and the decision it must get.
#[derive(Debug)]
struct Case {
    name: &'static str,
    want: Want,
    node: ManagedNode,
    rule: Rule,
    action: Action,
}

fn case(name: &'static str, want: Want, n: N, rule: Rule, action: Action) -> Case {
    Case {
        name,
        want,
        node: n.0,
        rule,
        action,
    }
}

/// The one helper every table goes through. Asserts the exact rule and action,
/// that the decision names the node and its attempt, carries a reason, is
/// deterministic, and that `decide` over the same node agrees with
/// `decide_node` (one decision for the node, no insert for its slot).
fn check(c: &Case) -> Decision {
    let (mut shape, deleting) = c.want.shape_for(&c.node.id);
    // Every desired slot serves and a rollout may take them all down: a
    // drifted node is row 4's (the rollout's own tables set the budgets).
    for g in &mut shape.groups {
        g.policy.rollout = contract::RolloutPolicy {
            max_unavailable: contract::Budget::Percent(100),
            max_surge: contract::Budget::Count(0),
            ..Default::default()
        };
    }
    let view = DesiredView::new(&shape, deleting).with_counts(shape.groups.iter().map(|g| {
        (
            g.id.clone(),
            contract::GroupCounts {
                available: g.count,
                ..Default::default()
            },
        )
    }));
    let d = decide_node(&view, &c.node, now());
    let ctx = format!(
        "case {:?}: got {:?} ({}) for {:?}",
        c.name, d.action, d.reason, c.want
    );
    assert_eq!(d.rule, c.rule, "rule: {ctx}");
    assert_eq!(d.action, c.action, "action: {ctx}");
    assert_eq!(d.node, c.node.id, "node: {ctx}");
    assert_eq!(d.attempt, Some(c.node.attempt), "attempt: {ctx}");
    assert!(!d.reason.is_empty(), "reason: {ctx}");
    assert_eq!(
        decide_node(&view, &c.node.clone(), now()),
        d,
        "deterministic: {ctx}"
    );

    let mut existing = SlotSet::new();
    existing.insert(&c.node.id);
    existing.finish();
    let out = decide(&view, [&c.node], &existing, now());
    let mine: Vec<&Decision> = out.decisions.iter().filter(|x| x.node == c.node.id).collect();
    assert_eq!(mine, vec![&d], "decide agrees with decide_node: {ctx}");
    d
}

fn check_all(cases: &[Case]) {
    for c in cases {
        let _ = check(c);
    }
}

// ---------------------------------------------------------------------------
// Rule 0: Insert
// ---------------------------------------------------------------------------

fn insert_ids(view: &DesiredView<'_>, existing: &SlotSet) -> Vec<String> {
    inserts(view, existing)
        .map(|d| {
            assert_eq!(d.rule, Rule::Insert, "{d:?}");
            assert_eq!(d.action, Action::Insert, "{d:?}");
            assert_eq!(d.attempt, None, "an insert has no attempt yet: {d:?}");
            assert!(!d.reason.is_empty());
            d.node.to_string()
        })
        .collect()
}

fn slots(ids: &[&str]) -> SlotSet {
    let mut s = SlotSet::new();
    for id in ids {
        s.insert(&nid(id));
    }
    s.finish();
    s
}

#[test]
fn rule_0_insert_fills_missing_slots_in_ascending_order() {
    let s = shape(vec![
        group("w", 4, template("img:1")),
        group("gpu", 2, template("img:9")),
    ]);
    let view = DesiredView::new(&s, false);

    // Fires: every desired slot without a node, group order then ascending index.
    assert_eq!(
        insert_ids(&view, &SlotSet::new()),
        ["w-0", "w-1", "w-2", "w-3", "gpu-0", "gpu-1"]
    );
    // Nearest non-firing: a slot that exists gets no insert.
    assert_eq!(
        insert_ids(&view, &slots(&["w-1", "w-3", "gpu-0"])),
        ["w-0", "w-2", "gpu-1"]
    );
    assert_eq!(
        insert_ids(&view, &slots(&["w-0", "w-1", "w-2", "w-3", "gpu-0", "gpu-1"])),
        Vec::<String>::new()
    );
    // Slots beyond the count get none, and existing slots beyond the count do
    // not hide desired ones.
    assert_eq!(
        insert_ids(&view, &slots(&["w-7", "gpu-2", "gpu-9"])),
        ["w-0", "w-1", "w-2", "w-3", "gpu-0", "gpu-1"]
    );
    // A slot of a group the shape does not have hides nothing.
    assert_eq!(
        insert_ids(&view, &slots(&["old-0", "old-1"])).len(),
        6,
        "slots of other groups do not count"
    );
    // A deleting run gets no inserts.
    let deleting = DesiredView::new(&s, true);
    assert_eq!(insert_ids(&deleting, &SlotSet::new()), Vec::<String>::new());
    assert_eq!(
        insert_ids(&DesiredView::empty(), &SlotSet::new()),
        Vec::<String>::new()
    );
    // A group of count 0 gets none.
    let zero = shape(vec![group("w", 0, template("img:1"))]);
    assert_eq!(
        insert_ids(&DesiredView::new(&zero, false), &SlotSet::new()),
        Vec::<String>::new()
    );
}

#[test]
fn rule_0_insert_with_slots_inserted_out_of_order() {
    let s = shape(vec![group("w", 6, template("img:1"))]);
    let view = DesiredView::new(&s, false);
    let mut existing = SlotSet::new();
    for i in [4, 0, 2, 2, 9, 0] {
        existing.insert_index(&gid("w"), i);
    }
    existing.finish();
    assert_eq!(
        existing.indices(&gid("w")).collect::<Vec<_>>(),
        [0, 2, 4, 9],
        "sorted and deduplicated"
    );
    assert_eq!(existing.len(), 4);
    assert!(existing.contains(&nid("w-2")));
    assert!(!existing.contains(&nid("w-3")));
    assert_eq!(insert_ids(&view, &existing), ["w-1", "w-3", "w-5"]);

    // Out of order across groups, then more in order after a finish.
    let mut existing = SlotSet::new();
    existing.insert(&nid("w-3"));
    existing.insert(&nid("x-1"));
    existing.insert(&nid("w-1"));
    existing.finish();
    existing.insert(&nid("w-5"));
    existing.insert(&nid("w-0"));
    existing.finish();
    assert_eq!(existing.indices(&gid("w")).collect::<Vec<_>>(), [0, 1, 3, 5]);
    assert_eq!(insert_ids(&view, &existing), ["w-2", "w-4"]);
}

#[test]
fn rule_0_insert_and_desired_view_with_many_groups() {
    // Above the view's linear-scan threshold the view indexes groups by id;
    // lookups and inserts must behave the same.
    let groups: Vec<NodeGroup> = (0..40)
        .map(|i| group(&format!("g{i}"), i % 3, template(&format!("img:{i}"))))
        .collect();
    let s = shape(groups);
    let view = DesiredView::new(&s, false);
    for i in 0..40u32 {
        for index in 0..3u32 {
            let id = nid(&format!("g{i}-{index}"));
            let got = view.template_for(&id).map(|t| t.image.clone());
            let want = (index < i % 3).then(|| format!("img:{i}"));
            assert_eq!(got, want, "{id}");
        }
    }
    assert_eq!(view.template_for(&nid("zz-0")), None, "missing group");
    let ids = insert_ids(&view, &slots(&["g2-1", "g5-0"]));
    let mut expected = Vec::new();
    for i in 0..40u32 {
        for index in 0..i % 3 {
            let id = format!("g{i}-{index}");
            if id != "g2-1" && id != "g5-0" {
                expected.push(id);
            }
        }
    }
    assert_eq!(ids, expected);
    // And the ladder sees it: desired, current spec → rule 12; missing → rule 4.
    let n = node("g37-0").spec(template("img:37")).0;
    assert_eq!(decide_node(&view, &n, now()).rule, Rule::CreateLease);
    let n = node("g37-1").spec(template("img:37")).0;
    assert_eq!(
        decide_node(&view, &n, now()).rule,
        Rule::BeginDelete,
        "index 1 >= count 1"
    );
    let deleting = DesiredView::new(&s, true);
    assert_eq!(deleting.template_for(&nid("g2-0")), None);
    assert_eq!(deleting.groups().count(), 0);
}

// ---------------------------------------------------------------------------
// Rows 1-3: destroyed nodes
// ---------------------------------------------------------------------------

#[test]
fn rows_1_to_3_destroyed_nodes() {
    use NodeStage::Destroyed;
    check_all(&[
        // Row 1 fires: destroyed and undesired, whichever way it is undesired.
        case(
            "index == count",
            Want::BeyondCount,
            node("w-2").stage(Destroyed),
            Rule::Reap,
            Action::Reap,
        ),
        case(
            "group missing",
            Want::GroupMissing,
            node("w-0").stage(Destroyed),
            Rule::Reap,
            Action::Reap,
        ),
        case(
            "run deleting",
            Want::RunDeleting,
            node("w-0").stage(Destroyed),
            Rule::Reap,
            Action::Reap,
        ),
        case(
            "undesired, restart not due: still reaped",
            Want::BeyondCount,
            node("w-1").stage(Destroyed).restart_at(NOW + 5_000),
            Rule::Reap,
            Action::Reap,
        ),
        case(
            "undesired with a permanent failure: still reaped",
            Want::RunDeleting,
            node("w-0")
                .stage(Destroyed)
                .permanent("invalid image", template("img:1")),
            Rule::Reap,
            Action::Reap,
        ),
        case(
            "undesired, deleting intent: reaped",
            Want::GroupMissing,
            node("w-0").stage(Destroyed).deleting(),
            Rule::Reap,
            Action::Reap,
        ),
        // Row 1 does not fire (slot desired, index == count - 1): row 2.
        case(
            "desired (last slot), restart_at None",
            Want::Current,
            node("w-2").stage(Destroyed),
            Rule::Restart,
            Action::Restart,
        ),
        // Row 2 fires: restart_at due (past, exactly now) or unset.
        case(
            "restart_at in the past",
            Want::Current,
            node("w-0").stage(Destroyed).restart_at(NOW - 1),
            Rule::Restart,
            Action::Restart,
        ),
        case(
            "restart_at == now is due",
            Want::Current,
            node("w-0").stage(Destroyed).restart_at(NOW),
            Rule::Restart,
            Action::Restart,
        ),
        case(
            "restart into a drifted spec (latest spec)",
            Want::Template(template("img:2")),
            node("w-0").stage(Destroyed).restart_at(NOW),
            Rule::Restart,
            Action::Restart,
        ),
        case(
            "deleting intent does not matter once destroyed",
            Want::Current,
            node("w-0").stage(Destroyed).deleting(),
            Rule::Restart,
            Action::Restart,
        ),
        // Row 2 does not fire (restart_at one ms in the future): row 3.
        case(
            "restart_at now + 1",
            Want::Current,
            node("w-0").stage(Destroyed).restart_at(NOW + 1),
            Rule::RestartBackoff,
            wait(Some(NOW + 1)),
        ),
        case(
            "restart_at later: wait until exactly restart_at",
            Want::Current,
            node("w-0").stage(Destroyed).restart_at(NOW + 7_500),
            Rule::RestartBackoff,
            wait(Some(NOW + 7_500)),
        ),
    ]);
}

#[test]
fn rows_2_3_permanent_failure_blocks_restart_until_the_spec_changes() {
    use NodeStage::Destroyed;
    // The failed spec is a different Arc with equal content: blocked by value.
    let blocked = check(&case(
        "permanent failure, spec equals the desired template",
        Want::Current,
        node("w-0")
            .stage(Destroyed)
            .permanent("invalid image img:1", template("img:1")),
        Rule::RestartBackoff,
        wait(None),
    ));
    assert!(
        blocked.reason.contains("invalid image img:1"),
        "the reason shows the failure: {:?}",
        blocked.reason
    );
    check_all(&[
        case(
            "permanent failure blocks even a due restart_at",
            Want::Current,
            node("w-0")
                .stage(Destroyed)
                .restart_at(NOW - 1)
                .permanent("quota refused", template("img:1")),
            Rule::RestartBackoff,
            wait(None),
        ),
        case(
            "permanent failure blocks with a future restart_at too (no deadline to wake for)",
            Want::Current,
            node("w-0")
                .stage(Destroyed)
                .restart_at(NOW + 9_000)
                .permanent("quota refused", template("img:1")),
            Rule::RestartBackoff,
            wait(None),
        ),
        // Nearest non-firing: the desired template differs from the failed one.
        case(
            "desired template changed: restart",
            Want::Template(template("img:2")),
            node("w-0")
                .stage(Destroyed)
                .permanent("invalid image img:1", template("img:1")),
            Rule::Restart,
            Action::Restart,
        ),
        case(
            "desired template changed, restart_at due: restart",
            Want::Template(template("img:2")),
            node("w-0")
                .stage(Destroyed)
                .restart_at(NOW)
                .permanent("invalid image img:1", template("img:1")),
            Rule::Restart,
            Action::Restart,
        ),
        case(
            "desired template changed, restart not due: the old template's backoff does not hold the new one",
            Want::Template(template("img:2")),
            node("w-0")
                .stage(Destroyed)
                .restart_at(NOW + 3_000)
                .permanent("invalid image img:1", template("img:1")),
            Rule::Restart,
            Action::Restart,
        ),
        case(
            "same template, restart not due: ordinary backoff",
            Want::Template(template("img:1")),
            node("w-0").stage(Destroyed).restart_at(NOW + 3_000),
            Rule::RestartBackoff,
            wait(Some(NOW + 3_000)),
        ),
    ]);
}

// ---------------------------------------------------------------------------
// Row 4: BeginDelete
// ---------------------------------------------------------------------------

fn with_boot_param(image: &str, key: &str, value: &str) -> Arc<NodeTemplate> {
    let mut t = example_template("fake", image);
    t.boot.insert(
        key.to_owned(),
        Param {
            value: value.to_owned(),
            secret: false,
        },
    );
    Arc::new(t)
}

#[test]
fn row_4_begin_delete() {
    use NodeStage::*;
    let bd = || (Rule::BeginDelete, Action::BeginDelete);
    let mut zone_moved = example_template("fake", "img:1");
    zone_moved.provider.zone = "local-b".to_owned();
    let mut cases = vec![
        // Undesired, three ways.
        case(
            "index == count",
            Want::BeyondCount,
            node("w-3").ready(),
            bd().0,
            bd().1,
        ),
        case(
            "group missing",
            Want::GroupMissing,
            node("w-0").ready(),
            bd().0,
            bd().1,
        ),
        case(
            "run deleting",
            Want::RunDeleting,
            node("w-0").ready(),
            bd().0,
            bd().1,
        ),
        case(
            "undesired new node",
            Want::BeyondCount,
            node("w-0"),
            bd().0,
            bd().1,
        ),
        // Spec drift.
        case(
            "image changed",
            Want::Template(template("img:2")),
            node("w-0").ready(),
            bd().0,
            bd().1,
        ),
        case(
            "boot parameter changed",
            Want::Template(with_boot_param("img:1", "k", "v")),
            node("w-0").stage(BootstrapRunning).lease().endpoint().session(),
            bd().0,
            bd().1,
        ),
        case(
            "provider zone changed",
            Want::Template(Arc::new(zone_moved)),
            node("w-0").stage(LeaseCreated).lease(),
            bd().0,
            bd().1,
        ),
        // Stage Failed.
        case(
            "stage failed",
            Want::Current,
            node("w-0").stage(Failed).lease().endpoint().failure("boom"),
            bd().0,
            bd().1,
        ),
        // Cleanup starts at once: row 4 is above row 5 and row 10.
        case(
            "failed with a future next_effect_at",
            Want::Current,
            node("w-0").stage(Failed).lease().next_effect_at(NOW + 5_000),
            bd().0,
            bd().1,
        ),
        case(
            "undesired with a pending op",
            Want::BeyondCount,
            node("w-0")
                .stage(LeaseRequested)
                .pending(Effect::CreateLease, NOW + 5_000),
            bd().0,
            bd().1,
        ),
        case(
            "failed with a pending op",
            Want::Current,
            node("w-0")
                .stage(Failed)
                .lease()
                .pending(Effect::LookupEndpoint, NOW + 5_000),
            bd().0,
            bd().1,
        ),
        // Nearest non-firing: intent already Deleting → rows 6-9 instead.
        case(
            "deleting, undesired, lease",
            Want::BeyondCount,
            node("w-0").stage(LeaseCreated).lease().deleting(),
            Rule::DestroyLease,
            dispatch(Effect::DestroyLease),
        ),
        case(
            "deleting, drifted, nothing left",
            Want::Template(template("img:2")),
            node("w-0").stage(New).deleting(),
            Rule::MarkDestroyed,
            Action::MarkDestroyed,
        ),
        case(
            "deleting, stage failed, session",
            Want::Current,
            node("w-0").stage(Failed).lease().endpoint().session().deleting(),
            Rule::CancelBootstrap,
            dispatch(Effect::CancelBootstrap),
        ),
        // Nearest non-firing: desired, current spec, healthy stage.
        case(
            "desired, current spec, new",
            Want::Current,
            node("w-0"),
            Rule::CreateLease,
            dispatch(Effect::CreateLease),
        ),
        case(
            "desired, same template content in another Arc, ready",
            Want::Current,
            node("w-0").ready(),
            Rule::Ready,
            wait(None),
        ),
        case(
            "bootstrap at a non-failure stage",
            Want::Current,
            node("w-0")
                .stage(Joined)
                .lease()
                .endpoint()
                .session()
                .bootstrap(BootstrapStage::Joined)
                .stage_deadline(NOW + 60_000),
            Rule::AwaitBootstrap,
            wait(Some(NOW + 60_000)),
        ),
    ];
    // Bootstrap progress at any Failed* stage fails the attempt.
    for (name, stage) in [
        ("bootstrap failed-connect", BootstrapStage::FailedConnect),
        ("bootstrap failed-boot-check", BootstrapStage::FailedBootCheck),
        ("bootstrap failed-agent-start", BootstrapStage::FailedAgentStart),
        ("bootstrap failed-join", BootstrapStage::FailedJoin),
        ("bootstrap failed-closed", BootstrapStage::FailedClosed),
    ] {
        cases.push(case(
            name,
            Want::Current,
            node("w-0")
                .stage(BootstrapRunning)
                .lease()
                .endpoint()
                .session()
                .bootstrap(stage)
                .stage_deadline(NOW + 60_000),
            bd().0,
            bd().1,
        ));
    }
    check_all(&cases);
}

// ---------------------------------------------------------------------------
// Row 5: pending operation
// ---------------------------------------------------------------------------

#[test]
fn row_5_pending_operation() {
    use NodeStage::*;
    let mut cases = Vec::new();
    for effect in Effect::ALL {
        cases.push(case(
            "pending op of each effect: wait until its deadline",
            Want::Current,
            node("w-0").stage(LeaseRequested).pending(effect, NOW + 30_000),
            Rule::Pending,
            wait(Some(NOW + 30_000)),
        ));
    }
    cases.extend([
        // Pending is above rows 6-16.
        case(
            "deleting, ambiguous create, pending (above row 6)",
            Want::BeyondCount,
            node("w-0")
                .deleting()
                .ambiguous_create()
                .pending(Effect::CreateLease, NOW + 10),
            Rule::Pending,
            wait(Some(NOW + 10)),
        ),
        case(
            "deleting, session, pending cancel (above row 7)",
            Want::GroupMissing,
            node("w-0")
                .deleting()
                .lease()
                .endpoint()
                .session()
                .pending(Effect::CancelBootstrap, NOW + 10),
            Rule::Pending,
            wait(Some(NOW + 10)),
        ),
        case(
            "deleting, lease, pending destroy (above row 8)",
            Want::RunDeleting,
            node("w-0")
                .deleting()
                .lease()
                .pending(Effect::DestroyLease, NOW + 10),
            Rule::Pending,
            wait(Some(NOW + 10)),
        ),
        case(
            "deleting, nothing left, pending (above row 9)",
            Want::RunDeleting,
            node("w-0").deleting().pending(Effect::DestroyLease, NOW + 10),
            Rule::Pending,
            wait(Some(NOW + 10)),
        ),
        case(
            "backoff not due, pending (above row 10)",
            Want::Current,
            node("w-0")
                .next_effect_at(NOW + 99_000)
                .pending(Effect::CreateLease, NOW + 10),
            Rule::Pending,
            wait(Some(NOW + 10)),
        ),
        case(
            "ready, pending (above row 11)",
            Want::Current,
            node("w-0").ready().pending(Effect::LookupEndpoint, NOW + 10),
            Rule::Pending,
            wait(Some(NOW + 10)),
        ),
        case(
            "endpoint known, pending start (above row 16)",
            Want::Current,
            node("w-0")
                .stage(EndpointKnown)
                .lease()
                .endpoint()
                .pending(Effect::StartBootstrap, NOW + 10),
            Rule::Pending,
            wait(Some(NOW + 10)),
        ),
        case(
            "deadline already past: still pending (the driver folds the timeout)",
            Want::Current,
            node("w-0")
                .stage(LeaseRequested)
                .pending(Effect::CreateLease, NOW - 1),
            Rule::Pending,
            wait(Some(NOW - 1)),
        ),
        // Pending is below row 4 ...
        case(
            "undesired with pending: begin delete",
            Want::GroupMissing,
            node("w-0").lease().pending(Effect::LookupEndpoint, NOW + 10),
            Rule::BeginDelete,
            Action::BeginDelete,
        ),
        case(
            "drifted with pending: begin delete",
            Want::Template(template("img:2")),
            node("w-0").lease().pending(Effect::LookupEndpoint, NOW + 10),
            Rule::BeginDelete,
            Action::BeginDelete,
        ),
        // ... and below rows 1-3.
        case(
            "destroyed, undesired, pending: reap",
            Want::BeyondCount,
            node("w-0")
                .stage(Destroyed)
                .pending(Effect::DestroyLease, NOW + 10),
            Rule::Reap,
            Action::Reap,
        ),
        case(
            "destroyed, desired, pending: restart",
            Want::Current,
            node("w-0")
                .stage(Destroyed)
                .pending(Effect::DestroyLease, NOW + 10),
            Rule::Restart,
            Action::Restart,
        ),
        case(
            "destroyed, restart not due, pending: restart backoff",
            Want::Current,
            node("w-0")
                .stage(Destroyed)
                .restart_at(NOW + 50)
                .pending(Effect::DestroyLease, NOW + 10),
            Rule::RestartBackoff,
            wait(Some(NOW + 50)),
        ),
        // Nearest non-firing: the same node without the pending op.
        case(
            "lease requested, nothing pending",
            Want::Current,
            node("w-0").stage(LeaseRequested),
            Rule::CreateLease,
            dispatch(Effect::CreateLease),
        ),
    ]);
    check_all(&cases);
}

// ---------------------------------------------------------------------------
// Rows 6-9: cleanup of a Deleting node
// ---------------------------------------------------------------------------

#[test]
fn rows_6_to_9_cleanup_in_order() {
    use NodeStage::*;
    check_all(&[
        // Row 6: an ambiguous create is re-issued first, whatever else is known.
        case(
            "ambiguous create, nothing else",
            Want::BeyondCount,
            node("w-0").stage(LeaseRequested).deleting().ambiguous_create(),
            Rule::ReissueCreate,
            dispatch(Effect::CreateLease),
        ),
        case(
            "ambiguous create with lease and session known",
            Want::RunDeleting,
            node("w-0")
                .stage(BootstrapRunning)
                .deleting()
                .ambiguous_create()
                .lease()
                .endpoint()
                .session(),
            Rule::ReissueCreate,
            dispatch(Effect::CreateLease),
        ),
        case(
            "ambiguous create and ambiguous bootstrap",
            Want::GroupMissing,
            node("w-0")
                .deleting()
                .ambiguous_create()
                .ambiguous_bootstrap()
                .lease(),
            Rule::ReissueCreate,
            dispatch(Effect::CreateLease),
        ),
        case(
            "ambiguous create on a desired node being replaced",
            Want::Template(template("img:2")),
            node("w-0").deleting().ambiguous_create(),
            Rule::ReissueCreate,
            dispatch(Effect::CreateLease),
        ),
        // Row 6 does not fire (no ambiguous create): row 7, cancel before destroy.
        case(
            "live session and lease",
            Want::BeyondCount,
            node("w-0")
                .stage(BootstrapRunning)
                .deleting()
                .lease()
                .endpoint()
                .session(),
            Rule::CancelBootstrap,
            dispatch(Effect::CancelBootstrap),
        ),
        // Row 7: an ambiguous bootstrap is cancelled, not re-issued.
        case(
            "ambiguous bootstrap, no session, lease",
            Want::BeyondCount,
            node("w-0")
                .stage(EndpointKnown)
                .deleting()
                .lease()
                .endpoint()
                .ambiguous_bootstrap(),
            Rule::CancelBootstrap,
            dispatch(Effect::CancelBootstrap),
        ),
        case(
            "ambiguous bootstrap, no session, no lease",
            Want::BeyondCount,
            node("w-0").deleting().ambiguous_bootstrap(),
            Rule::CancelBootstrap,
            dispatch(Effect::CancelBootstrap),
        ),
        case(
            "session without lease",
            Want::BeyondCount,
            node("w-0").deleting().session(),
            Rule::CancelBootstrap,
            dispatch(Effect::CancelBootstrap),
        ),
        // Row 7 does not fire (no session, no ambiguous bootstrap): row 8.
        case(
            "lease and endpoint, no session",
            Want::BeyondCount,
            node("w-0").stage(EndpointKnown).deleting().lease().endpoint(),
            Rule::DestroyLease,
            dispatch(Effect::DestroyLease),
        ),
        case(
            "lease only",
            Want::RunDeleting,
            node("w-0").stage(LeaseCreated).deleting().lease(),
            Rule::DestroyLease,
            dispatch(Effect::DestroyLease),
        ),
        // Row 8 does not fire (no lease): row 9.
        case(
            "nothing left",
            Want::RunDeleting,
            node("w-0").stage(LeaseCreated).deleting(),
            Rule::MarkDestroyed,
            Action::MarkDestroyed,
        ),
        case(
            "endpoint and failure facts only: nothing live",
            Want::BeyondCount,
            node("w-0")
                .stage(Failed)
                .deleting()
                .endpoint()
                .failure("boom")
                .bootstrap(BootstrapStage::FailedJoin),
            Rule::MarkDestroyed,
            Action::MarkDestroyed,
        ),
        case(
            "ready node being replaced, cleaned up",
            Want::Template(template("img:2")),
            node("w-0").stage(Dormant).deleting(),
            Rule::MarkDestroyed,
            Action::MarkDestroyed,
        ),
        // Row 9 is not gated by the backoff.
        case(
            "nothing left, backoff not due",
            Want::RunDeleting,
            node("w-0").deleting().next_effect_at(NOW + 5_000),
            Rule::MarkDestroyed,
            Action::MarkDestroyed,
        ),
    ]);
}

#[test]
fn rows_6_to_8_wait_for_the_backoff() {
    use NodeStage::*;
    check_all(&[
        // Gated: next_effect_at in the future → wait on the row's own rule.
        case(
            "re-issue create backing off",
            Want::BeyondCount,
            node("w-0")
                .deleting()
                .ambiguous_create()
                .lease()
                .session()
                .next_effect_at(NOW + 1),
            Rule::ReissueCreate,
            wait(Some(NOW + 1)),
        ),
        case(
            "cancel backing off",
            Want::BeyondCount,
            node("w-0")
                .stage(BootstrapRunning)
                .deleting()
                .lease()
                .session()
                .next_effect_at(NOW + 4_000),
            Rule::CancelBootstrap,
            wait(Some(NOW + 4_000)),
        ),
        case(
            "cancel of an ambiguous bootstrap backing off",
            Want::BeyondCount,
            node("w-0")
                .deleting()
                .lease()
                .ambiguous_bootstrap()
                .next_effect_at(NOW + 4_000),
            Rule::CancelBootstrap,
            wait(Some(NOW + 4_000)),
        ),
        case(
            "destroy backing off",
            Want::GroupMissing,
            node("w-0")
                .stage(LeaseCreated)
                .deleting()
                .lease()
                .next_effect_at(NOW + 8_000),
            Rule::DestroyLease,
            wait(Some(NOW + 8_000)),
        ),
        // Not gated: next_effect_at exactly now (due) or in the past.
        case(
            "re-issue create, backoff due now",
            Want::BeyondCount,
            node("w-0").deleting().ambiguous_create().next_effect_at(NOW),
            Rule::ReissueCreate,
            dispatch(Effect::CreateLease),
        ),
        case(
            "cancel, backoff past",
            Want::BeyondCount,
            node("w-0").deleting().lease().session().next_effect_at(NOW - 1),
            Rule::CancelBootstrap,
            dispatch(Effect::CancelBootstrap),
        ),
        case(
            "destroy, backoff due now",
            Want::GroupMissing,
            node("w-0").deleting().lease().next_effect_at(NOW),
            Rule::DestroyLease,
            dispatch(Effect::DestroyLease),
        ),
    ]);
}

// ---------------------------------------------------------------------------
// Row 10: retry backoff
// ---------------------------------------------------------------------------

#[test]
fn row_10_retry_backoff() {
    use NodeStage::*;
    check_all(&[
        case(
            "new node, backoff one ms away",
            Want::Current,
            node("w-0").next_effect_at(NOW + 1),
            Rule::RetryBackoff,
            wait(Some(NOW + 1)),
        ),
        case(
            "endpoint probe interval not due",
            Want::Current,
            node("w-0")
                .stage(LeaseCreated)
                .lease()
                .next_effect_at(NOW + 2_000),
            Rule::RetryBackoff,
            wait(Some(NOW + 2_000)),
        ),
        case(
            "ambiguous create on an active node, backing off",
            Want::Current,
            node("w-0")
                .stage(LeaseRequested)
                .ambiguous_create()
                .next_effect_at(NOW + 3_000),
            Rule::RetryBackoff,
            wait(Some(NOW + 3_000)),
        ),
        case(
            "above row 11: ready with a future next_effect_at",
            Want::Current,
            node("w-0").ready().next_effect_at(NOW + 3_000),
            Rule::RetryBackoff,
            wait(Some(NOW + 3_000)),
        ),
        case(
            "above row 14: converged with a future next_effect_at",
            Want::Current,
            node("w-0")
                .stage(Joined)
                .lease()
                .endpoint()
                .session()
                .bootstrap(BootstrapStage::Converged)
                .next_effect_at(NOW + 3_000),
            Rule::RetryBackoff,
            wait(Some(NOW + 3_000)),
        ),
        // Not gated: exactly now is due; past or unset too.
        case(
            "next_effect_at == now",
            Want::Current,
            node("w-0").next_effect_at(NOW),
            Rule::CreateLease,
            dispatch(Effect::CreateLease),
        ),
        case(
            "next_effect_at in the past",
            Want::Current,
            node("w-0").stage(LeaseCreated).lease().next_effect_at(NOW - 1),
            Rule::LookupEndpoint,
            dispatch(Effect::LookupEndpoint),
        ),
        case(
            "next_effect_at == 0",
            Want::Current,
            node("w-0")
                .stage(EndpointKnown)
                .lease()
                .endpoint()
                .next_effect_at(0),
            Rule::StartBootstrap,
            dispatch(Effect::StartBootstrap),
        ),
    ]);
}

// ---------------------------------------------------------------------------
// Row 11: ready
// ---------------------------------------------------------------------------

#[test]
fn row_11_ready_is_steady() {
    use NodeStage::*;
    check_all(&[
        case(
            "dormant",
            Want::Current,
            node("w-0").ready(),
            Rule::Ready,
            wait(None),
        ),
        case(
            "handed off",
            Want::Current,
            node("w-0").ready().stage(HandedOff),
            Rule::Ready,
            wait(None),
        ),
        case(
            "dormant, last desired slot",
            Want::Current,
            node("w-4").ready(),
            Rule::Ready,
            wait(None),
        ),
        case(
            "dormant, backoff due now",
            Want::Current,
            node("w-0").ready().next_effect_at(NOW),
            Rule::Ready,
            wait(None),
        ),
        case(
            "dormant, session closed (row 11 is above 12-16)",
            Want::Current,
            node("w-0").stage(Dormant).lease().endpoint(),
            Rule::Ready,
            wait(None),
        ),
        // Nearest non-firing: not a ready stage.
        case(
            "joined with converged bootstrap",
            Want::Current,
            node("w-0").ready().stage(Joined),
            Rule::ObserveConvergence,
            Action::ObserveConvergence,
        ),
        // ... or not desired, drifted, or deleting.
        case(
            "dormant, undesired",
            Want::BeyondCount,
            node("w-4").ready(),
            Rule::BeginDelete,
            Action::BeginDelete,
        ),
        case(
            "dormant, drifted",
            Want::Template(template("img:2")),
            node("w-0").ready(),
            Rule::BeginDelete,
            Action::BeginDelete,
        ),
        case(
            "dormant, deleting",
            Want::Current,
            node("w-0").ready().deleting(),
            Rule::CancelBootstrap,
            dispatch(Effect::CancelBootstrap),
        ),
    ]);
}

// ---------------------------------------------------------------------------
// Rows 12-16: the healthy progression
// ---------------------------------------------------------------------------

/// One pass over `nodes` of group `g` (the shape's only group) with the
/// header's `counts`: each node's rule and reason, inserts left out.
fn group_pass(
    g: contract::NodeGroup,
    counts: contract::GroupCounts,
    nodes: &[ManagedNode],
) -> Vec<(String, Rule, String)> {
    let id = g.id.clone();
    let s = shape(vec![g]);
    let view = DesiredView::new(&s, false).with_counts([(id, counts)]);
    let mut existing = SlotSet::new();
    for n in nodes {
        existing.insert(&n.id);
    }
    existing.finish();
    decide(&view, nodes, &existing, now())
        .decisions
        .into_iter()
        .filter(|d| d.rule != Rule::Insert)
        .map(|d| (d.node.to_string(), d.rule, d.reason.into_owned()))
        .collect()
}

/// The remediation budget of a group of ten with `max_in_flight` and
/// `max_unhealthy`, the nodes given, and the header's counts.
fn remediate(
    max_in_flight: u32,
    max_unhealthy: contract::Budget,
    counts: contract::GroupCounts,
    nodes: &[ManagedNode],
) -> Vec<(String, Rule, String)> {
    let mut g = group("w", 10, template("img:1"));
    g.policy.remediation = contract::RemediationPolicy {
        max_in_flight,
        max_unhealthy,
    };
    group_pass(g, counts, nodes)
}

#[test]
fn row_4_and_18_the_remediation_budget() {
    let counts = |unhealthy, remediating| contract::GroupCounts {
        unhealthy,
        remediating,
        ..Default::default()
    };
    // Not yet due: ready, and another look at the stored deadline.
    let n = node("w-0").ready().unhealthy(NOW - 10, NOW + 500).0;
    let view_shape = shape(vec![group("w", 10, template("img:1"))]);
    let d = decide_node(&DesiredView::new(&view_shape, false), &n, now());
    assert_eq!((d.rule, d.action), (Rule::Ready, wait(Some(NOW + 500))));

    // Three due; one may be in flight: the longest unhealthy goes first, then
    // the lowest index; the others wait under rule 18 saying why.
    let nodes = [
        node("w-1").ready().unhealthy(NOW - 300, NOW - 1).0,
        node("w-2").ready().unhealthy(NOW - 900, NOW - 1).0,
        node("w-3").ready().unhealthy(NOW - 900, NOW - 1).0,
    ];
    let out = remediate(1, contract::Budget::Percent(100), counts(3, 0), &nodes);
    let granted: Vec<_> = out.iter().filter(|(_, r, _)| *r == Rule::BeginDelete).collect();
    assert_eq!(granted.len(), 1, "{out:?}");
    assert_eq!(granted[0].0, "w-2", "{out:?}");
    assert!(granted[0].2.contains("w: 1/1 in flight"), "{out:?}");
    let held: Vec<_> = out
        .iter()
        .filter(|(_, r, _)| *r == Rule::RemediationBudget)
        .collect();
    assert_eq!(held.len(), 2, "{out:?}");
    assert!(
        held.iter()
            .all(|(_, _, why)| why.contains("1/1 remediations in flight")),
        "{out:?}"
    );

    // Two allowed, one already in flight (counted in the header): one more.
    let out = remediate(2, contract::Budget::Percent(100), counts(3, 1), &nodes);
    assert_eq!(
        out.iter().filter(|(_, r, _)| *r == Rule::BeginDelete).count(),
        1,
        "{out:?}"
    );

    // More of the group unhealthy than max_unhealthy allows: none, and the
    // reason has the counts. 40% of 10 is 4; 6 are unhealthy.
    let out = remediate(3, contract::Budget::Percent(40), counts(6, 0), &nodes);
    assert!(
        out.iter().all(|(_, r, _)| *r == Rule::RemediationBudget),
        "{out:?}"
    );
    assert!(
        out[0]
            .2
            .contains("w: 6/10 unhealthy or lost, more than max_unhealthy 40% allows (4)"),
        "{out:?}"
    );
    // At the limit it still acts.
    let out = remediate(3, contract::Budget::Count(4), counts(4, 0), &nodes);
    assert_eq!(
        out.iter().filter(|(_, r, _)| *r == Rule::BeginDelete).count(),
        3,
        "{out:?}"
    );

    // max_in_flight 0: reported, never replaced.
    let out = remediate(0, contract::Budget::Percent(100), counts(1, 0), &nodes[..1]);
    assert_eq!(out[0].1, Rule::RemediationBudget);
    assert!(out[0].2.contains("max_in_flight is 0"), "{out:?}");

    // A drifted or failed unhealthy node is row 4 without the budget.
    let drifted = node("w-1")
        .ready()
        .unhealthy(NOW - 300, NOW - 1)
        .spec(template("img:9"))
        .0;
    let out = remediate(0, contract::Budget::Percent(0), counts(9, 9), &[drifted]);
    assert_eq!(out[0].1, Rule::BeginDelete, "{out:?}");

    // The same answer through the decider's per-node entry point.
    let g = {
        let mut g = group("w", 10, template("img:1"));
        g.policy.remediation.max_in_flight = 1;
        g
    };
    let s = shape(vec![g]);
    let busy = DesiredView::new(&s, false).with_counts([(gid("w"), counts(1, 1))]);
    assert_eq!(decide_node(&busy, &nodes[0], now()).rule, Rule::RemediationBudget);
    let idle = DesiredView::new(&s, false).with_counts([(gid("w"), counts(1, 0))]);
    assert_eq!(decide_node(&idle, &nodes[0], now()).rule, Rule::BeginDelete);
}

/// The rollout budget of a group of ten moving from `img:1` to `img:2`
/// under `policy`, the nodes given, and the header's counts.
fn roll(
    policy: contract::RolloutPolicy,
    counts: contract::GroupCounts,
    nodes: &[ManagedNode],
) -> Vec<(String, Rule, String)> {
    let mut g = group("w", 10, template("img:2"));
    g.policy.rollout = policy;
    group_pass(g, counts, nodes)
}

#[test]
fn row_4_and_17_the_rollout_budget() {
    let budget = |n| contract::RolloutPolicy {
        max_unavailable: contract::Budget::Count(n),
        max_surge: contract::Budget::Count(0),
        ..Default::default()
    };
    let counts = |available, updated| contract::GroupCounts {
        available,
        updated,
        ..Default::default()
    };
    let old = |name: &str| node(name).ready().spec(template("img:1")).0;
    let nodes = [old("w-5"), old("w-3"), old("w-4")];
    let granted = |out: &[(String, Rule, String)]| -> Vec<String> {
        out.iter()
            .filter(|(_, r, _)| *r == Rule::BeginDelete)
            .map(|(n, _, _)| n.clone())
            .collect()
    };

    // Two may be unavailable, all ten serve: the two lowest indices go, the
    // third waits under rule 17 with the counts.
    let out = roll(budget(2), counts(10, 0), &nodes);
    assert_eq!(granted(&out), ["w-3", "w-4"], "{out:?}");
    let held: Vec<_> = out.iter().filter(|(_, r, _)| *r == Rule::RolloutBudget).collect();
    assert_eq!(held.len(), 1, "{out:?}");
    assert_eq!(held[0].0, "w-5");
    assert!(held[0].2.contains("w: 2/2 unavailable"), "{out:?}");
    assert!(
        out.iter().any(|(_, _, why)| why.contains("w: 1/2 unavailable")),
        "{out:?}"
    );

    // One slot already unavailable (a node being replaced): one more.
    assert_eq!(granted(&roll(budget(2), counts(9, 1), &nodes)), ["w-3"]);
    // The budget spent: none.
    assert!(granted(&roll(budget(2), counts(8, 2), &nodes)).is_empty());
    // No unavailable budget, two successors: the two lowest get a successor
    // (rule 19) and nothing is taken down; one successor already in flight
    // leaves room for one more.
    let surge = contract::RolloutPolicy {
        max_unavailable: contract::Budget::Count(0),
        max_surge: contract::Budget::Count(2),
        ..Default::default()
    };
    let surged = |out: &[(String, Rule, String)]| -> Vec<String> {
        out.iter()
            .filter(|(_, r, _)| *r == Rule::SurgeInsert)
            .map(|(n, _, _)| n.clone())
            .collect()
    };
    let out = roll(surge, counts(10, 0), &nodes);
    assert_eq!(surged(&out), ["w-3", "w-4"], "{out:?}");
    assert!(granted(&out).is_empty(), "{out:?}");
    assert!(
        out.iter()
            .any(|(_, _, why)| why.contains("w: 0/0 unavailable, 2/2 surging")),
        "{out:?}"
    );
    let one_in_flight = contract::GroupCounts {
        surging: 1,
        ..counts(10, 1)
    };
    assert_eq!(surged(&roll(surge, one_in_flight, &nodes)), ["w-3"]);
    // Surge first, then the unavailable budget.
    let both = contract::RolloutPolicy {
        max_unavailable: contract::Budget::Count(1),
        max_surge: contract::Budget::Count(1),
        ..Default::default()
    };
    let out = roll(both, counts(10, 0), &nodes);
    assert_eq!(
        (surged(&out), granted(&out)),
        (vec!["w-3".to_owned()], vec!["w-4".to_owned()])
    );

    // A slot holding a successor: the current attempt serves until the
    // successor does, then hands over; once cleaned up, or a successor that
    // was, is reaped.
    let successor = AttemptId::new(900);
    let with = |n: N, ready: bool| {
        let mut n = n.0;
        n.surge = contract::Surge::Current {
            successor,
            successor_ready: ready,
        };
        n
    };
    let out = roll(
        surge,
        counts(10, 1),
        &[with(node("w-1").ready().spec(template("img:1")), false)],
    );
    assert_eq!(out[0].1, Rule::RolloutBudget, "{out:?}");
    assert!(out[0].2.contains("is being provisioned"), "{out:?}");
    let out = roll(
        surge,
        counts(10, 1),
        &[with(node("w-1").ready().spec(template("img:1")), true)],
    );
    assert_eq!(out[0].1, Rule::BeginDelete, "{out:?}");
    assert!(out[0].2.contains("hand the slot over"), "{out:?}");
    let out = roll(
        surge,
        counts(10, 1),
        &[with(node("w-1").stage(NodeStage::Destroyed), true)],
    );
    assert_eq!(out[0].1, Rule::Reap, "{out:?}");
    let mut gone = node("w-2").stage(NodeStage::Destroyed).0;
    gone.surge = contract::Surge::Successor;
    let out = roll(surge, counts(10, 1), &[gone]);
    assert_eq!(out[0].1, Rule::Reap, "{out:?}");

    // A canary of 2 with one replaced: one more, then the rollout waits for
    // a promotion; once promoted the budget alone decides.
    let canary = contract::RolloutPolicy {
        canary: 2,
        ..budget(5)
    };
    let out = roll(canary, counts(10, 1), &nodes);
    assert_eq!(granted(&out), ["w-3"], "{out:?}");
    assert!(
        out.iter()
            .any(|(_, r, why)| *r == Rule::RolloutBudget && why.contains("canary 2/2")),
        "{out:?}"
    );
    let promoted = contract::GroupCounts {
        canary_done: true,
        ..counts(10, 2)
    };
    assert_eq!(granted(&roll(canary, promoted, &nodes)).len(), 3);

    // A halted rollout replaces nothing more.
    let halted = contract::GroupCounts {
        halted: true,
        ..counts(10, 0)
    };
    let out = roll(budget(5), halted, &nodes);
    assert!(
        out.iter()
            .all(|(_, r, why)| *r == Rule::RolloutBudget && why.contains("halted")),
        "{out:?}"
    );

    // Failed, lost, unhealthy and undesired nodes never wait for the budget.
    let failed = node("w-1").stage(NodeStage::Failed).spec(template("img:1")).0;
    let lost = {
        let mut n = old("w-2");
        n.facts.lost = true;
        n
    };
    let sick = node("w-6")
        .ready()
        .unhealthy(NOW - 10, NOW + 500)
        .spec(template("img:1"))
        .0;
    let beyond = node("w-12").ready().spec(template("img:1")).0;
    let out = roll(budget(1), counts(0, 0), &[failed, lost, sick, beyond]);
    assert!(out.iter().all(|(_, r, _)| *r == Rule::BeginDelete), "{out:?}");
}

#[test]
fn rows_12_13_lease_and_endpoint() {
    use NodeStage::*;
    check_all(&[
        // Row 12: no lease.
        case(
            "new",
            Want::Current,
            node("w-0"),
            Rule::CreateLease,
            dispatch(Effect::CreateLease),
        ),
        case(
            "lease requested, no pending, no lease",
            Want::Current,
            node("w-0").stage(LeaseRequested).failure("create failed"),
            Rule::CreateLease,
            dispatch(Effect::CreateLease),
        ),
        case(
            "active with an ambiguous create: re-issue through row 12",
            Want::Current,
            node("w-0").stage(LeaseRequested).ambiguous_create(),
            Rule::CreateLease,
            dispatch(Effect::CreateLease),
        ),
        // Nearest non-firing for 12 / row 13 fires: a lease but no endpoint.
        case(
            "lease, no endpoint",
            Want::Current,
            node("w-0").stage(LeaseCreated).lease(),
            Rule::LookupEndpoint,
            dispatch(Effect::LookupEndpoint),
        ),
        case(
            "lease, no endpoint, stage deadline stored",
            Want::Current,
            node("w-0")
                .stage(LeaseCreated)
                .lease()
                .stage_deadline(NOW + 60_000),
            Rule::LookupEndpoint,
            dispatch(Effect::LookupEndpoint),
        ),
        // Nearest non-firing for 13: the endpoint is known → row 16.
        case(
            "lease and endpoint",
            Want::Current,
            node("w-0").stage(EndpointKnown).lease().endpoint(),
            Rule::StartBootstrap,
            dispatch(Effect::StartBootstrap),
        ),
    ]);
}

#[test]
fn rows_14_to_16_bootstrap() {
    use NodeStage::*;
    let running = || node("w-0").stage(BootstrapRunning).lease().endpoint().session();
    let joined = || node("w-0").stage(Joined).lease().endpoint().session();
    let mut cases = vec![
        // Row 14: joined, live session, bootstrap converged.
        case(
            "joined and converged",
            Want::Current,
            joined()
                .bootstrap(BootstrapStage::Converged)
                .stage_deadline(NOW + 60_000),
            Rule::ObserveConvergence,
            Action::ObserveConvergence,
        ),
        // Row 14 does not fire: joined but not converged → row 15.
        case(
            "joined, bootstrap at joined (not converged)",
            Want::Current,
            joined()
                .bootstrap(BootstrapStage::Joined)
                .stage_deadline(NOW + 60_000),
            Rule::AwaitBootstrap,
            wait(Some(NOW + 60_000)),
        ),
        case(
            "joined, no progress yet",
            Want::Current,
            joined().stage_deadline(NOW + 60_000),
            Rule::AwaitBootstrap,
            wait(Some(NOW + 60_000)),
        ),
        // Row 15: a live session, not converged, waits until the stage deadline.
        case(
            "running, no progress, no stored deadline",
            Want::Current,
            running(),
            Rule::AwaitBootstrap,
            wait(None),
        ),
        case(
            "running, stage deadline already past (the driver fails it)",
            Want::Current,
            running()
                .bootstrap(BootstrapStage::AgentStarted)
                .stage_deadline(NOW - 1),
            Rule::AwaitBootstrap,
            wait(Some(NOW - 1)),
        ),
        // Row 15 does not fire: no session → row 16.
        case(
            "endpoint known, no session",
            Want::Current,
            node("w-0").stage(EndpointKnown).lease().endpoint(),
            Rule::StartBootstrap,
            dispatch(Effect::StartBootstrap),
        ),
        // Row 16 re-issues an ambiguous bootstrap on an active node (adopt).
        case(
            "endpoint known, ambiguous bootstrap",
            Want::Current,
            node("w-0")
                .stage(EndpointKnown)
                .lease()
                .endpoint()
                .ambiguous_bootstrap(),
            Rule::StartBootstrap,
            dispatch(Effect::StartBootstrap),
        ),
        // Row 14 needs a live session: converged progress without one is row 16.
        case(
            "joined, converged, session gone",
            Want::Current,
            node("w-0")
                .stage(Joined)
                .lease()
                .endpoint()
                .bootstrap(BootstrapStage::Converged),
            Rule::StartBootstrap,
            dispatch(Effect::StartBootstrap),
        ),
        // Row 16 does not fire: a session → row 15.
        case(
            "endpoint known, session",
            Want::Current,
            node("w-0")
                .stage(EndpointKnown)
                .lease()
                .endpoint()
                .session()
                .stage_deadline(NOW + 5),
            Rule::AwaitBootstrap,
            wait(Some(NOW + 5)),
        ),
    ];
    for stage in [
        BootstrapStage::Connected,
        BootstrapStage::BootCheck,
        BootstrapStage::AgentStarted,
        BootstrapStage::Joined,
    ] {
        cases.push(case(
            "running, each non-final sub-stage",
            Want::Current,
            running().bootstrap(stage).stage_deadline(NOW + 45_000),
            Rule::AwaitBootstrap,
            wait(Some(NOW + 45_000)),
        ));
    }
    check_all(&cases);
}

// ---------------------------------------------------------------------------
// decide / requeue_at
// ---------------------------------------------------------------------------

#[test]
fn decide_requeue_at_is_the_earliest_future_wait() {
    use NodeStage::*;
    let s = shape(vec![group("w", 8, template("img:1"))]);
    let view = DesiredView::new(&s, false);
    let nodes = [
        node("w-0").next_effect_at(NOW + 500).0,               // row 10, +500
        node("w-1").pending(Effect::CreateLease, NOW + 200).0, // row 5, +200
        node("w-2").stage(Destroyed).restart_at(NOW + 900).0,  // row 3, +900
        node("w-3").pending(Effect::CreateLease, NOW).0,       // row 5, due now: ignored
        node("w-4").pending(Effect::CreateLease, NOW - 1).0,   // row 5, past: ignored
        node("w-5").ready().0,                                 // row 11, None
        node("w-6").stage(LeaseCreated).lease().0,             // row 13, dispatch
    ];
    let mut existing = SlotSet::new();
    for n in &nodes {
        existing.insert(&n.id);
    }
    existing.finish();
    let out = decide(&view, &nodes, &existing, now());
    assert_eq!(out.requeue_at, Some(at(NOW + 200)));
    let got: Vec<(String, Rule)> = out
        .decisions
        .iter()
        .map(|d| (d.node.to_string(), d.rule))
        .collect();
    assert_eq!(
        got,
        [
            ("w-0".to_owned(), Rule::RetryBackoff),
            ("w-1".to_owned(), Rule::Pending),
            ("w-2".to_owned(), Rule::RestartBackoff),
            ("w-3".to_owned(), Rule::Pending),
            ("w-4".to_owned(), Rule::Pending),
            ("w-5".to_owned(), Rule::Ready),
            ("w-6".to_owned(), Rule::LookupEndpoint),
            ("w-7".to_owned(), Rule::Insert),
        ]
    );
    assert_eq!(out.actions().count(), 2, "one dispatch and one insert");

    // Without the +200 node the next earliest is +500.
    let out = decide(
        &view,
        nodes.iter().filter(|n| n.id != nid("w-1")),
        &existing,
        now(),
    );
    assert_eq!(out.requeue_at, Some(at(NOW + 500)));
    // Only waits already due or past (no spin), or waits for an event: None.
    let stale = [nodes[3].clone(), nodes[4].clone(), nodes[5].clone()];
    assert_eq!(decide(&view, &stale, &existing, now()).requeue_at, None);
    // No waits at all: None.
    let busy = [nodes[6].clone(), node("w-0").0];
    assert_eq!(decide(&view, &busy, &existing, now()).requeue_at, None);
    // A wait one ms ahead counts.
    let soon = [node("w-0").next_effect_at(NOW + 1).0];
    assert_eq!(
        decide(&view, &soon, &existing, now()).requeue_at,
        Some(at(NOW + 1))
    );
    // Nodes not passed in still hide their slots from inserts.
    let out = decide(&view, std::iter::empty(), &existing, now());
    assert_eq!(out.decisions.len(), 1);
    assert_eq!(out.decisions[0].node, nid("w-7"));
    assert_eq!(out.requeue_at, None);
}

#[test]
fn fold_requeue_keeps_the_earliest_deadline_after_now() {
    let d = |action: Action| Decision {
        node: nid("w-0"),
        attempt: Some(AttemptId::new(1)),
        rule: Rule::Pending,
        action,
        reason: "test".into(),
    };
    let n = now();
    assert_eq!(
        fold_requeue(None, &d(wait(Some(NOW + 10))), n),
        Some(at(NOW + 10))
    );
    assert_eq!(
        fold_requeue(Some(at(NOW + 5)), &d(wait(Some(NOW + 10))), n),
        Some(at(NOW + 5))
    );
    assert_eq!(
        fold_requeue(Some(at(NOW + 50)), &d(wait(Some(NOW + 10))), n),
        Some(at(NOW + 10))
    );
    assert_eq!(
        fold_requeue(None, &d(wait(Some(NOW))), n),
        None,
        "due now: no spin"
    );
    assert_eq!(
        fold_requeue(None, &d(wait(Some(NOW - 1))), n),
        None,
        "past: no spin"
    );
    assert_eq!(
        fold_requeue(Some(at(NOW + 7)), &d(wait(Some(NOW))), n),
        Some(at(NOW + 7))
    );
    assert_eq!(fold_requeue(None, &d(wait(None)), n), None);
    assert_eq!(
        fold_requeue(Some(at(NOW + 7)), &d(wait(None)), n),
        Some(at(NOW + 7))
    );
    assert_eq!(fold_requeue(None, &d(dispatch(Effect::CreateLease)), n), None);
    assert_eq!(
        fold_requeue(Some(at(NOW + 3)), &d(Action::Restart), n),
        Some(at(NOW + 3))
    );
}

// ---------------------------------------------------------------------------
// Properties over seeded random inputs
// ---------------------------------------------------------------------------

/// SplitMix64: a tiny deterministic generator, so failures replay by seed.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }
    fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())].clone()
    }
    /// A stored time around `now`, including the edges, or none.
    fn time(&mut self) -> Option<u64> {
        self.pick(&[
            None,
            None,
            Some(0),
            Some(NOW - 1_000),
            Some(NOW - 1),
            Some(NOW),
            Some(NOW + 1),
            Some(NOW + 1_000),
            Some(u64::MAX),
        ])
    }
}

/// A random shape for group `w` (and sometimes only group `x`), and whether the
/// run is deleting.
fn random_shape(rng: &mut Rng, shared: &Arc<NodeTemplate>) -> (ClusterShape, bool) {
    let t = match rng.below(3) {
        0 => shared.clone(),
        1 => template("img:1"),
        _ => template("img:2"),
    };
    let id = if rng.chance(1, 6) { "x" } else { "w" };
    let count = rng.below(4) as u32;
    let mut g = group(id, count, t);
    g.policy.remediation = contract::RemediationPolicy {
        max_in_flight: rng.below(3) as u32,
        max_unhealthy: if rng.chance(1, 2) {
            contract::Budget::Count(rng.below(4) as u32)
        } else {
            contract::Budget::Percent(rng.pick(&[0, 50, 100]))
        },
    };
    (shape(vec![g]), rng.chance(1, 8))
}

fn random_counts(rng: &mut Rng) -> contract::GroupCounts {
    contract::GroupCounts {
        unhealthy: rng.below(4) as u32,
        remediating: rng.below(3) as u32,
        available: rng.below(6) as u32,
        updated: rng.below(6) as u32,
        canary_done: rng.below(2) == 0,
        halted: rng.below(5) == 0,
        surging: rng.below(3) as u32,
    }
}

fn random_node(rng: &mut Rng, shared: &Arc<NodeTemplate>) -> ManagedNode {
    let index = rng.below(4);
    let mut n = node(&format!("w-{index}")).0;
    n.attempt = AttemptId::new(rng.next_u64() % 1_000);
    n.surge = match rng.below(6) {
        0 => contract::Surge::Successor,
        1 => contract::Surge::Current {
            successor: AttemptId::new(1_000 + rng.next_u64() % 1_000),
            successor_ready: rng.chance(1, 2),
        },
        _ => contract::Surge::None,
    };
    n.spec = match rng.below(3) {
        0 => shared.clone(),
        1 => template("img:1"),
        _ => template("img:3"),
    };
    n.intent = if rng.chance(1, 3) {
        Intent::Deleting
    } else {
        Intent::Active
    };
    n.stage = rng.pick(&NodeStage::ALL);
    let b = node("w-0").lease().endpoint().session().0.facts;
    if rng.chance(2, 3) {
        n.facts.lease = b.lease.clone();
    }
    if rng.chance(2, 3) {
        n.facts.endpoint = b.endpoint.clone();
    }
    if rng.chance(1, 2) {
        n.facts.session = b.session.clone();
    }
    if rng.chance(2, 3) {
        // Converged is drawn more often, so row 14 is reached often enough.
        let stage = if rng.chance(1, 4) {
            BootstrapStage::Converged
        } else {
            rng.pick(&BootstrapStage::ALL)
        };
        n.facts.bootstrap = Some(BootstrapProgress {
            stage,
            seq: rng.next_u64() % 10,
            at: at(NOW - 5),
            detail: String::new(),
        });
    }
    if rng.chance(1, 4) {
        n.facts.failure = Some(Failure {
            reason: "boom".to_owned(),
            at: at(NOW - 5),
        });
    }
    n.facts.ambiguous_create = rng.chance(1, 4);
    n.facts.ambiguous_bootstrap = rng.chance(1, 4);
    if rng.chance(1, 2) {
        let healthy = rng.chance(1, 3);
        n.facts.health = Some(contract::NodeHealth {
            healthy,
            since: at(NOW - 100),
            observed_at: at(NOW - 50),
            seq: 1,
            detail: "no answer".to_owned(),
            remediate_at: if healthy { None } else { rng.time().map(at) },
        });
    }
    if rng.chance(1, 3) {
        n.pending = Some(PendingOp {
            id: OperationId::new(n.attempt, 1),
            effect: rng.pick(&Effect::ALL),
            deadline: at(rng.time().unwrap_or(NOW + 10)),
            dispatched_at: at(NOW - 5),
        });
    }
    n.retry.consecutive_failures = rng.below(5) as u32;
    n.retry.next_effect_at = rng.time().map(at);
    n.retry.restart_at = rng.time().map(at);
    n.retry.permanent = match rng.below(4) {
        0 => Some(PermanentFailure {
            reason: "invalid image".to_owned(),
            spec: template("img:1"),
        }),
        1 => Some(PermanentFailure {
            reason: "quota".to_owned(),
            spec: template("img:2"),
        }),
        _ => None,
    };
    n.stage_deadline = rng.time().map(at);
    n
}

/// The ladder written out again from the spec's table, independently of the
/// decider: the rule each row's condition selects.
fn expected_rule(
    n: &ManagedNode,
    wanted: Option<&contract::NodeGroup>,
    counts: contract::GroupCounts,
    now: UnixMillis,
) -> Rule {
    let due = |t: Option<UnixMillis>| t.is_none_or(|t| t <= now);
    let f = &n.facts;
    let group = wanted;
    let wanted = wanted.map(|g| &*g.template);
    // A desired slot holding two attempts (surge).
    let serving = n.intent == Intent::Active
        && matches!(n.stage, NodeStage::Dormant | NodeStage::HandedOff)
        && n.pending.is_none()
        && !f.bootstrap.as_ref().is_some_and(|b| b.stage.is_failure())
        && !f.lost
        && f.health.as_ref().is_none_or(|h| h.healthy);
    if wanted.is_some() {
        match n.surge {
            contract::Surge::Successor if n.stage == NodeStage::Destroyed => return Rule::Reap,
            contract::Surge::Current { .. } if n.stage == NodeStage::Destroyed => return Rule::Reap,
            contract::Surge::Current { successor_ready, .. } if serving => {
                return if successor_ready {
                    Rule::BeginDelete
                } else {
                    Rule::RolloutBudget
                };
            }
            _ => {}
        }
    }
    if n.stage == NodeStage::Destroyed {
        return match wanted {
            None => Rule::Reap,
            Some(w) if n.retry.permanent.as_ref().is_some_and(|p| *p.spec == *w) => Rule::RestartBackoff,
            // The backoff paces one template's retries, not a new one's.
            Some(w) if !due(n.retry.restart_at) && *w == *n.spec => Rule::RestartBackoff,
            Some(_) => Rule::Restart,
        };
    }
    let failed = n.stage == NodeStage::Failed || f.bootstrap.as_ref().is_some_and(|b| b.stage.is_failure());
    // Row 4 for a drifted node that still serves, within the rollout budget
    // (row 17 holds it otherwise).
    let impaired = f.lost || f.health.as_ref().is_some_and(|h| !h.healthy);
    if n.intent == Intent::Active
        && matches!(n.stage, NodeStage::Dormant | NodeStage::HandedOff)
        && n.pending.is_none()
        && !failed
        && !impaired
        && let Some(g) = group
        && *g.template != *n.spec
    {
        let r = g.policy.rollout;
        let budget = r.resolve(g.count);
        let canary_waits = r.canary > 0 && !counts.canary_done && counts.updated >= r.canary;
        let spent = g.count.saturating_sub(counts.available) >= budget.max_unavailable;
        return if counts.halted || canary_waits {
            Rule::RolloutBudget
        } else if counts.surging < budget.max_surge {
            Rule::SurgeInsert
        } else if spent {
            Rule::RolloutBudget
        } else {
            Rule::BeginDelete
        };
    }
    if n.intent == Intent::Active && wanted.is_none_or(|w| *w != *n.spec || failed) {
        return Rule::BeginDelete;
    }
    // Row 4 for health, within the budget (row 18 holds it otherwise).
    let unhealthy_due = f
        .health
        .as_ref()
        .is_some_and(|h| !h.healthy && h.remediate_at.is_some_and(|t| t <= now));
    if n.intent == Intent::Active
        && matches!(n.stage, NodeStage::Dormant | NodeStage::HandedOff)
        && n.pending.is_none()
        && unhealthy_due
        && let Some(g) = group
    {
        let r = g.policy.remediation;
        let over = counts.unhealthy > r.max_unhealthy.resolve(g.count);
        return if over || r.max_in_flight == 0 || counts.remediating >= r.max_in_flight {
            Rule::RemediationBudget
        } else {
            Rule::BeginDelete
        };
    }
    if n.pending.is_some() {
        return Rule::Pending;
    }
    if n.intent == Intent::Deleting {
        return if f.ambiguous_create {
            Rule::ReissueCreate
        } else if f.session.is_some() || f.ambiguous_bootstrap {
            Rule::CancelBootstrap
        } else if f.lease.is_some() {
            Rule::DestroyLease
        } else {
            Rule::MarkDestroyed
        };
    }
    if !due(n.retry.next_effect_at) {
        return Rule::RetryBackoff;
    }
    if matches!(n.stage, NodeStage::Dormant | NodeStage::HandedOff) {
        return Rule::Ready;
    }
    if f.lease.is_none() {
        return Rule::CreateLease;
    }
    if f.endpoint.is_none() {
        return Rule::LookupEndpoint;
    }
    // Row 14 is read as SPEC.md's clarification states it: a live session whose
    // bootstrap reached the converged class. The reference table also names the
    // stage (`SwactorJoined`); neither this oracle nor the decider checks it.
    if f.session.is_some() {
        if f.bootstrap
            .as_ref()
            .is_some_and(|b| b.stage == BootstrapStage::Converged)
        {
            return Rule::ObserveConvergence;
        }
        return Rule::AwaitBootstrap;
    }
    Rule::StartBootstrap
}

/// The actions each rule may answer with.
fn action_fits_rule(d: &Decision, n: &ManagedNode, now: UnixMillis) -> bool {
    let backoff_wait = |a: Action| {
        a == Action::Wait {
            until: n.retry.next_effect_at,
        } && !due_at(a, now)
    };
    match d.rule {
        Rule::Insert => false,
        Rule::Reap => d.action == Action::Reap,
        Rule::Restart => d.action == Action::Restart,
        Rule::RestartBackoff => {
            d.action == Action::Wait { until: None }
                || (d.action
                    == Action::Wait {
                        until: n.retry.restart_at,
                    }
                    && !due_at(d.action, now))
        }
        Rule::BeginDelete => d.action == Action::BeginDelete,
        Rule::Pending => n.pending.is_some_and(|p| {
            d.action
                == Action::Wait {
                    until: Some(p.deadline),
                }
        }),
        Rule::ReissueCreate => d.action == dispatch(Effect::CreateLease) || backoff_wait(d.action),
        Rule::CancelBootstrap => d.action == dispatch(Effect::CancelBootstrap) || backoff_wait(d.action),
        Rule::DestroyLease => d.action == dispatch(Effect::DestroyLease) || backoff_wait(d.action),
        Rule::MarkDestroyed => d.action == Action::MarkDestroyed,
        Rule::RetryBackoff => backoff_wait(d.action),
        Rule::Ready => {
            d.action == Action::Wait { until: None }
                || n.facts.health.as_ref().is_some_and(|h| {
                    !h.healthy
                        && d.action
                            == Action::Wait {
                                until: h.remediate_at,
                            }
                })
        }
        Rule::RolloutBudget | Rule::RemediationBudget => d.action == Action::Wait { until: None },
        Rule::SurgeInsert => d.action == Action::Surge,
        Rule::CreateLease => d.action == dispatch(Effect::CreateLease),
        Rule::LookupEndpoint => d.action == dispatch(Effect::LookupEndpoint),
        Rule::ObserveConvergence => d.action == Action::ObserveConvergence,
        Rule::AwaitBootstrap => {
            d.action
                == Action::Wait {
                    until: n.stage_deadline,
                }
        }
        Rule::StartBootstrap => d.action == dispatch(Effect::StartBootstrap),
    }
}

/// True if `a` is a wait whose stored time has come (or has none).
fn due_at(a: Action, now: UnixMillis) -> bool {
    match a {
        Action::Wait { until } => until.is_none_or(|t| t <= now),
        _ => true,
    }
}

#[test]
fn property_decide_node_over_random_nodes() {
    const CASES: u64 = 40_000;
    let shared = template("img:1");
    let mut seen = BTreeSet::new();
    for seed in 0..CASES {
        let mut rng = Rng(seed);
        let (s, deleting) = random_shape(&mut rng, &shared);
        let counts = random_counts(&mut rng);
        let view = DesiredView::new(&s, deleting).with_counts([(gid("w"), counts)]);
        let n = random_node(&mut rng, &shared);
        let base = || format!("seed {seed}: {n:#?}\nshape {s:#?} deleting={deleting}");

        // Never panics; one decision for the node, naming it and its attempt.
        let d = decide_node(&view, &n, now());
        let ctx = || format!("{}\n=> {d:?}", base());
        assert_eq!(d.node, n.id, "{}", ctx());
        assert_eq!(d.attempt, Some(n.attempt), "{}", ctx());
        assert!(!d.reason.is_empty(), "{}", ctx());
        assert_ne!(d.rule, Rule::Insert, "{}", ctx());
        seen.insert(d.rule);

        // Deterministic.
        assert_eq!(decide_node(&view, &n.clone(), now()), d, "{}", ctx());

        // Exactly one decision for the node through `decide`.
        let mut existing = SlotSet::new();
        existing.insert(&n.id);
        existing.finish();
        let out = decide(&view, [&n], &existing, now());
        let mine: Vec<&Decision> = out.decisions.iter().filter(|x| x.node == n.id).collect();
        assert_eq!(mine, vec![&d], "{}", ctx());

        // The rule is the one the spec's table selects, with a fitting action.
        let wanted = s.desired_group(&n.id).filter(|_| !deleting);
        assert_eq!(d.rule, expected_rule(&n, wanted, counts, now()), "{}", ctx());
        assert!(action_fits_rule(&d, &n, now()), "{}", ctx());

        // Computes no deadline: every `until` is one the driver stored.
        if let Action::Wait { until: Some(t) } = d.action {
            let stored = [
                n.pending.map(|p| p.deadline),
                n.retry.next_effect_at,
                n.retry.restart_at,
                n.stage_deadline,
                n.facts.health.as_ref().and_then(|h| h.remediate_at),
            ];
            assert!(stored.contains(&Some(t)), "{}", ctx());
        }

        if let Action::Dispatch(e) = d.action {
            // One pending operation per node, ever.
            assert!(n.pending.is_none(), "dispatch while pending: {}", ctx());
            // Backoff gates every effect.
            assert!(
                n.retry.next_effect_at.is_none_or(|t| t <= now()),
                "dispatch during backoff: {}",
                ctx()
            );
            // The create is re-issued (adopted) before any destructive step.
            assert!(
                !(e.is_destructive() && n.facts.ambiguous_create),
                "destructive effect with an ambiguous create: {}",
                ctx()
            );
            // Destructive effects only while deleting; cancel before destroy.
            assert!(!e.is_destructive() || n.intent == Intent::Deleting, "{}", ctx());
            if e == Effect::DestroyLease {
                assert!(
                    n.facts.session.is_none() && !n.facts.ambiguous_bootstrap,
                    "{}",
                    ctx()
                );
            }
            // Nothing is dispatched for a destroyed node.
            assert_ne!(n.stage, NodeStage::Destroyed, "{}", ctx());
        }

        // Guarantee 15: a ready, active, desired, current-spec node with nothing
        // pending (and no failed bootstrap recorded, and not unhealthy or
        // lost: converged means observed) gets no action.
        let current = wanted.is_some_and(|w| *w.template == *n.spec);
        if n.intent == Intent::Active
            && n.stage.is_ready()
            && current
            && n.surge == contract::Surge::None
            && n.pending.is_none()
            && !n.facts.bootstrap_failed()
            && !n.facts.is_impaired()
        {
            assert!(
                matches!(d.action, Action::Wait { .. }),
                "action on a converged node: {}",
                ctx()
            );
            if n.retry.next_effect_at.is_none_or(|t| t <= now()) {
                assert_eq!((d.rule, d.action), (Rule::Ready, wait(None)), "{}", ctx());
            }
        }
    }
    // The generator reaches every rule of the ladder.
    let missing: Vec<Rule> = Rule::ALL
        .into_iter()
        .filter(|r| *r != Rule::Insert && !seen.contains(r))
        .collect();
    assert!(missing.is_empty(), "rules never reached: {missing:?}");
}

#[test]
fn property_slot_set_and_inserts() {
    let groups = ["a", "b", "c"];
    for seed in 0..3_000u64 {
        let mut rng = Rng(seed ^ 0x0051_05e7);
        // Held slots per group, inserted in random order with duplicates,
        // sometimes with a finish() in the middle.
        let mut held: BTreeMap<&str, BTreeSet<u32>> = BTreeMap::new();
        let mut set = SlotSet::new();
        for _ in 0..rng.below(24) {
            let g = rng.pick(&groups);
            let i = rng.below(12) as u32;
            held.entry(g).or_default().insert(i);
            match rng.below(3) {
                0 => set.insert(&nid(&format!("{g}-{i}"))),
                1 => set.insert_index(&gid(g), i),
                _ => {
                    // A range from `i`, possibly overlapping what is held.
                    let end = (i + 1 + rng.below(4) as u32).min(12);
                    held.entry(g).or_default().extend(i..end);
                    set.insert_range(&gid(g), i, end);
                }
            }
            if rng.chance(1, 10) {
                set.finish();
            }
        }
        set.finish();
        let ctx = format!("seed {seed}: held {held:?}");
        assert_eq!(
            set.len(),
            held.values().map(BTreeSet::len).sum::<usize>(),
            "{ctx}"
        );
        assert_eq!(set.is_empty(), held.values().all(BTreeSet::is_empty), "{ctx}");
        for g in groups {
            let want: Vec<u32> = held
                .get(g)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default();
            assert_eq!(set.indices(&gid(g)).collect::<Vec<_>>(), want, "{ctx}");
            // Kept as ranges: ascending, none empty, none touching the next.
            let ranges = set.ranges(&gid(g));
            assert!(ranges.iter().all(|r| r.start < r.end), "{ctx}");
            assert!(ranges.windows(2).all(|w| w[0].end < w[1].start), "{ctx}");
            for i in 0..12 {
                let id = nid(&format!("{g}-{i}"));
                assert_eq!(set.contains(&id), want.contains(&i), "{id} {ctx}");
            }
        }

        // A random shape over some of the groups; inserts are its complement.
        let mut shape_groups = Vec::new();
        for g in groups {
            if rng.chance(2, 3) {
                shape_groups.push(group(g, rng.below(10) as u32, template("img:1")));
            }
        }
        let s = shape(shape_groups);
        let deleting = rng.chance(1, 8);
        let view = DesiredView::new(&s, deleting);
        let mut expected = Vec::new();
        if !deleting {
            for g in &s.groups {
                for i in 0..g.count {
                    if !held.get(g.id.as_str()).is_some_and(|h| h.contains(&i)) {
                        expected.push(format!("{}-{i}", g.id));
                    }
                }
            }
        }
        assert_eq!(insert_ids(&view, &set), expected, "{ctx} shape {s:?}");
    }
}

#[test]
fn property_decide_requeue_over_random_batches() {
    let shared = template("img:1");
    for seed in 0..3_000u64 {
        let mut rng = Rng(seed.wrapping_mul(31).wrapping_add(7));
        let (s, deleting) = random_shape(&mut rng, &shared);
        let view = DesiredView::new(&s, deleting);
        let mut nodes = Vec::new();
        let mut existing = SlotSet::new();
        for i in 0..rng.below(4) {
            let mut n = random_node(&mut rng, &shared);
            n.id = nid(&format!("w-{i}"));
            existing.insert(&n.id);
            nodes.push(n);
        }
        existing.finish();
        let out = decide(&view, &nodes, &existing, now());
        let ctx = format!("seed {seed}: {out:#?}");

        let singles: Vec<Decision> = nodes.iter().map(|n| decide_node(&view, n, now())).collect();
        // A node a group budget decides (due for remediation, or drifted
        // and ready under a rollout) is decided after the others, by the
        // budget over all of them; every other node as on its own.
        let remediation = |d: &Decision| d.rule == Rule::BeginDelete && d.reason.starts_with("unhealthy for");
        let candidate = |d: &Decision| {
            d.rule == Rule::RemediationBudget
                || remediation(d)
                || (d.rule == Rule::RolloutBudget && !d.reason.contains("is being provisioned"))
                || d.rule == Rule::SurgeInsert
                || (d.rule == Rule::BeginDelete
                    && d.reason.starts_with("the spec changed: replace the attempt ("))
        };
        let by_node = |ds: &[Decision]| -> BTreeMap<LogicalNodeId, Decision> {
            ds.iter().map(|d| (d.node.clone(), d.clone())).collect()
        };
        let batch = by_node(&out.decisions[..nodes.len()]);
        let single = by_node(&singles);
        assert_eq!(batch.len(), nodes.len(), "{ctx}");
        let mut granted = 0u32;
        for (id, d) in &single {
            if candidate(d) {
                let b = &batch[id];
                assert!(candidate(b), "{ctx}");
                granted += u32::from(remediation(b));
            } else {
                assert_eq!(&batch[id], d, "{ctx}");
            }
        }
        // The budget over the batch: never more than max_in_flight at once
        // (none already in flight here), never one while the group is over
        // max_unhealthy (no counts given: nothing is).
        if let Some(g) = s.groups.first() {
            assert!(granted <= g.policy.remediation.max_in_flight, "{ctx}");
        }
        let want_requeue = singles
            .iter()
            .filter_map(|d| match d.action {
                Action::Wait { until: Some(t) } if t > now() => Some(t),
                _ => None,
            })
            .min();
        assert_eq!(out.requeue_at, want_requeue, "{ctx}");
        let ins: Vec<Decision> = inserts(&view, &existing).collect();
        assert_eq!(out.decisions[nodes.len()..], ins[..], "{ctx}");
        // At most one decision per node.
        let ids: BTreeSet<String> = out.decisions.iter().map(|d| d.node.to_string()).collect();
        assert_eq!(ids.len(), out.decisions.len(), "{ctx}");
    }
}
