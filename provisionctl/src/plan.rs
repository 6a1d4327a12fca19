//! `plan`: what the driver would do next for a proposed shape, per group and
//! per kind of change, with the ladder rule and reason behind each.
//!
//! The server answers with one decision per node (the first step the next
//! pass would take) and the slots the shape removes. This module sorts those
//! into the changes a person thinks in: insert, replace (the attempt is torn
//! down and started afresh), scale down (the highest slots go), in progress
//! (work the run was already doing) and unchanged. Only the server's answer
//! and the group counts are shown, never the shape's parameters, so a secret
//! in the local file cannot leak into a plan.

use std::collections::{BTreeMap, BTreeSet};

use contract::pb;
use serde_json::{Map, Value, json};

use super::{
    names,
    render::{decision_json, shape_json},
    text,
};

/// The kind of change a decision amounts to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Change {
    ScaleDown,
    Replace,
    Insert,
    InProgress,
    Unchanged,
}

impl Change {
    pub fn name(self) -> &'static str {
        match self {
            Change::ScaleDown => "scale-down",
            Change::Replace => "replace",
            Change::Insert => "insert",
            Change::InProgress => "in-progress",
            Change::Unchanged => "unchanged",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Change::ScaleDown => "scale down",
            Change::Replace => "replace",
            Change::Insert => "insert",
            Change::InProgress => "in progress",
            Change::Unchanged => "unchanged",
        }
    }
}

/// Classifies one decision. A slot the shape removes is a scale-down whatever
/// its current step; a cleanup that begins on a slot that stays is a
/// replacement (the slot gets a fresh attempt once cleanup finishes).
pub fn classify(d: &pb::Decision, scale_down: &BTreeSet<&str>) -> Change {
    if scale_down.contains(d.node_id.as_str()) {
        Change::ScaleDown
    } else if d.kind == pb::ActionKind::Insert as i32 {
        Change::Insert
    } else if d.kind == pb::ActionKind::BeginDelete as i32
        || d.kind == pb::ActionKind::Surge as i32
        || d.rule == contract::Rule::RolloutBudget.number()
    {
        // A drifted node the rollout budget holds is replaced in a later wave.
        Change::Replace
    } else if d.kind == pb::ActionKind::Wait as i32 && d.rule == contract::Rule::Ready.number() {
        Change::Unchanged
    } else {
        Change::InProgress
    }
}

/// Up to this many slots a scale-down is listed one by one, highest first;
/// beyond, as ranges.
const SCALE_DOWN_LISTED: usize = 12;

/// Everything a plan shows.
#[derive(Debug)]
pub struct PlanInput<'a> {
    pub source: &'a str,
    pub run_id: &'a str,
    /// The generation the plan was made for.
    pub generation: u64,
    /// The run's current status, if the run exists.
    pub current: Option<&'a pb::RunStatus>,
    /// Group ids and counts of the proposed shape, in file order.
    pub proposed: Vec<(String, i64)>,
    pub response: &'a pb::PlanResponse,
    /// Per group, the fields the shape changes ([`field_changes`]).
    pub changes: BTreeMap<String, Vec<FieldChange>>,
    /// Whether applying the file would change the run (a new run, or a new
    /// generation); an identical file would not.
    pub changed: bool,
}

/// One field of a group that a shape changes: its path in the shape-file
/// schema, and its value before and after (`None`: absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldChange {
    pub path: String,
    pub old: Option<String>,
    pub new: Option<String>,
}

impl FieldChange {
    fn text(&self) -> String {
        match (&self.old, &self.new) {
            (Some(o), Some(n)) => format!("{}: {o} → {n}", self.path),
            (None, Some(n)) => format!("{}: added, {n}", self.path),
            (Some(o), None) => format!("{}: removed (was {o})", self.path),
            (None, None) => self.path.clone(),
        }
    }
}

/// A shape as the server holds it: decoded (unset policy fields become the
/// defaults they mean) and encoded again, secrets redacted. A shape that does
/// not decode is compared as it is.
fn normalized(s: &pb::ClusterShape) -> pb::ClusterShape {
    let r = contract::wire::redacted(s);
    contract::wire::shape_from_wire(r.clone())
        .map_or(r, |d| contract::wire::redacted(&pb::ClusterShape::from(&d)))
}

/// `v` as `path → value` leaves.
fn flatten(path: &str, v: &Value, out: &mut BTreeMap<String, String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                flatten(&p, x, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                flatten(&format!("{path}[{i}]"), x, out);
            }
        }
        Value::String(s) => {
            out.insert(path.to_owned(), s.clone());
        }
        other => {
            out.insert(path.to_owned(), other.to_string());
        }
    }
}

/// Each group's fields in the shape-file schema, by group id (its id and
/// count left out: the plan's group header shows the count).
fn group_fields(s: &pb::ClusterShape) -> BTreeMap<String, BTreeMap<String, String>> {
    let doc = shape_json(&normalized(s));
    let mut out = BTreeMap::new();
    for g in doc["groups"].as_array().map(Vec::as_slice).unwrap_or_default() {
        let id = g["id"].as_str().unwrap_or_default().to_owned();
        let mut fields = BTreeMap::new();
        flatten("", g, &mut fields);
        fields.remove("id");
        fields.remove("count");
        out.insert(id, fields);
    }
    out
}

/// Per group id, the fields `proposed` changes against `current` (every
/// field of a new group is new). Secret values are compared by the server
/// (`PlanResponse.changed_secrets`), never here: both sides are redacted.
pub fn field_changes(
    current: Option<&pb::ClusterShape>,
    proposed: &pb::ClusterShape,
) -> BTreeMap<String, Vec<FieldChange>> {
    let before = current.map(group_fields).unwrap_or_default();
    let after = group_fields(proposed);
    let mut out = BTreeMap::new();
    for (id, new) in &after {
        let Some(old) = before.get(id) else {
            continue;
        };
        let keys: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
        let changes: Vec<FieldChange> = keys
            .into_iter()
            .filter(|k| old.get(*k) != new.get(*k))
            .map(|k| FieldChange {
                path: k.clone(),
                old: old.get(k).cloned(),
                new: new.get(k).cloned(),
            })
            .collect();
        if !changes.is_empty() {
            out.insert(id.clone(), changes);
        }
    }
    out
}

/// One line of a group: a change, with the rule and reason, and its nodes.
#[derive(Debug)]
struct Line<'a> {
    change: Change,
    rule: u32,
    reason: &'a str,
    nodes: Vec<String>,
}

/// What makes one line of a group: the change, its rule and its reason.
type LineKey<'a> = (Change, u32, &'a str);

struct Grouped<'a> {
    /// Group id → its lines, in display order.
    groups: Vec<(String, Vec<Line<'a>>)>,
    totals: BTreeMap<Change, usize>,
}

fn group_of(node: &str) -> &str {
    text::split_node(node).map_or(node, |(g, _)| g)
}

fn grouped<'a>(p: &PlanInput<'a>) -> Grouped<'a> {
    let scale_down: BTreeSet<&str> = p.response.scale_down.iter().map(String::as_str).collect();
    let mut order: Vec<String> = p.proposed.iter().map(|(g, _)| g.clone()).collect();
    if let Some(cur) = p.current {
        for g in &cur.groups {
            if !order.contains(&g.group_id) {
                order.push(g.group_id.clone());
            }
        }
    }
    let mut lines: BTreeMap<String, BTreeMap<LineKey<'a>, Vec<String>>> = BTreeMap::new();
    let mut totals: BTreeMap<Change, usize> = BTreeMap::new();
    for d in &p.response.decisions {
        let change = classify(d, &scale_down);
        *totals.entry(change).or_default() += 1;
        let g = group_of(&d.node_id).to_owned();
        if !order.contains(&g) {
            order.push(g.clone());
        }
        lines
            .entry(g)
            .or_default()
            .entry((change, d.rule, d.reason.as_str()))
            .or_default()
            .push(d.node_id.clone());
    }
    let groups = order
        .into_iter()
        .map(|g| {
            let ls = lines
                .remove(&g)
                .unwrap_or_default()
                .into_iter()
                .map(|((change, rule, reason), mut nodes)| {
                    // Scale-down lists the slots the way they go: highest first.
                    if change == Change::ScaleDown {
                        nodes.sort_by_key(|n| std::cmp::Reverse(text::split_node(n).map_or(0, |(_, i)| i)));
                    } else {
                        nodes.sort_by_key(|n| text::split_node(n).map_or(0, |(_, i)| i));
                    }
                    Line {
                        change,
                        rule,
                        reason,
                        nodes,
                    }
                })
                .collect();
            (g, ls)
        })
        .collect();
    Grouped { groups, totals }
}

fn group_header(p: &PlanInput<'_>, g: &str) -> String {
    let before = p
        .current
        .and_then(|c| c.groups.iter().find(|x| x.group_id == g))
        .map(|x| x.desired);
    let after = p.proposed.iter().find(|(id, _)| id == g).map(|(_, c)| *c);
    match (before, after) {
        (None, Some(a)) => format!("group {g}: new, {a} nodes"),
        (Some(b), None) => format!("group {g}: removed ({b} → 0 nodes)"),
        (Some(b), Some(a)) if i64::from(b) == a => format!("group {g}: {a} nodes"),
        (Some(b), Some(a)) => format!("group {g}: {b} → {a} nodes"),
        (None, None) => format!("group {g}"),
    }
}

fn summary(totals: &BTreeMap<Change, usize>) -> String {
    let n = |c: Change| totals.get(&c).copied().unwrap_or(0);
    format!(
        "{} to insert, {} to replace, {} to scale down, {} in progress, {} unchanged",
        n(Change::Insert),
        n(Change::Replace),
        n(Change::ScaleDown),
        n(Change::InProgress),
        n(Change::Unchanged)
    )
}

/// The plan as text for people.
pub fn plan_table(p: &PlanInput<'_>) -> Vec<String> {
    let g = grouped(p);
    let mut out = Vec::new();
    out.push(match p.current {
        Some(cur) if !p.changed => format!(
            "plan for run {} from {}: no changes; the run is at generation {} already ({})",
            p.run_id,
            p.source,
            cur.generation,
            names::phase(cur.phase)
        ),
        Some(cur) => format!(
            "plan for run {} from {}: generation {} → {} ({})",
            p.run_id,
            p.source,
            cur.generation,
            p.generation,
            names::phase(cur.phase)
        ),
        None => format!(
            "plan for run {} from {}: a new run at generation {}",
            p.run_id, p.source, p.generation
        ),
    });
    for (group, lines) in &g.groups {
        out.push(String::new());
        out.push(group_header(p, group));
        for c in p.changes.get(group).map(Vec::as_slice).unwrap_or_default() {
            out.push(format!("  ~ {}", c.text()));
        }
        let prefix = format!("{group}.");
        for s in &p.response.changed_secrets {
            if let Some(path) = s.strip_prefix(&prefix) {
                out.push(format!("  ~ {path}: secret value changed (not shown)"));
            }
        }
        if lines.is_empty() {
            out.push("  no nodes".to_owned());
        }
        let waves: Vec<&pb::PlanWave> = p.response.waves.iter().filter(|w| &w.group_id == group).collect();
        if !waves.is_empty() {
            out.push(format!(
                "  rollout in {} wave{}, each once the one before is ready:",
                waves.len(),
                if waves.len() == 1 { "" } else { "s" }
            ));
            for w in waves {
                out.push(format!(
                    "    wave {}: {} ({})",
                    w.wave,
                    text::node_list(&w.nodes),
                    w.note
                ));
            }
        }
        for l in lines {
            let nodes = if l.change == Change::ScaleDown && l.nodes.len() <= SCALE_DOWN_LISTED {
                // Listed one by one in the order they go, highest first.
                l.nodes.join(", ")
            } else {
                text::node_list(&l.nodes)
            };
            out.push(format!(
                "  {:<11}  {}: {nodes}",
                l.change.label(),
                text::nodes(l.nodes.len())
            ));
            out.push(format!("      {}: {}", names::rule_label(l.rule), l.reason));
        }
    }
    out.push(String::new());
    out.push(format!("summary: {}", summary(&g.totals)));
    if g.totals.contains_key(&Change::Replace) || g.totals.contains_key(&Change::ScaleDown) {
        out.push(
            "these are the first steps of the next pass; later passes carry them through \
             (a node is cleaned up, then a replaced one restarts with the new template)"
                .to_owned(),
        );
    }
    if p.changed {
        out.push(format!(
            "nothing was changed; to make it so: provisionctl apply -f {}",
            p.source
        ));
    } else {
        out.push("applying this file would change nothing".to_owned());
    }
    out
}

/// The plan as a document for scripts.
pub fn plan_json(p: &PlanInput<'_>) -> Value {
    let scale_down: BTreeSet<&str> = p.response.scale_down.iter().map(String::as_str).collect();
    let g = grouped(p);
    let n = |c: Change| g.totals.get(&c).copied().unwrap_or(0);
    let groups: Vec<Value> = g
        .groups
        .iter()
        .map(|(id, lines)| {
            json!({
                "group_id": id,
                "changes": lines.iter().map(|l| json!({
                    "change": l.change.name(),
                    "rule": l.rule,
                    "rule_name": names::rule(l.rule),
                    "reason": l.reason,
                    "nodes": l.nodes,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let decisions: Vec<Value> = p
        .response
        .decisions
        .iter()
        .map(|d| {
            let mut v = decision_json(d);
            if let Value::Object(m) = &mut v {
                m.insert("node_id".into(), json!(d.node_id));
                m.insert("attempt".into(), json!(d.attempt));
                m.insert("change".into(), json!(classify(d, &scale_down).name()));
            }
            v
        })
        .collect();
    let changes: Map<String, Value> = p
        .changes
        .iter()
        .map(|(g, cs)| {
            let list = cs
                .iter()
                .map(|c| json!({ "path": c.path, "old": c.old, "new": c.new }))
                .collect::<Vec<_>>();
            (g.clone(), json!(list))
        })
        .collect();
    json!({
        "run_id": p.run_id,
        "current_generation": p.current.map(|c| c.generation),
        "generation": p.generation,
        "changed": p.changed,
        "field_changes": changes,
        "changed_secrets": p.response.changed_secrets,
        "summary": {
            "insert": n(Change::Insert),
            "replace": n(Change::Replace),
            "scale_down": n(Change::ScaleDown),
            "in_progress": n(Change::InProgress),
            "unchanged": n(Change::Unchanged),
        },
        "scale_down": p.response.scale_down,
        "waves": p.response.waves.iter().map(|w| json!({
            "group_id": w.group_id,
            "wave": w.wave,
            "nodes": w.nodes,
            "note": w.note,
        })).collect::<Vec<_>>(),
        "groups": groups,
        "decisions": decisions,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn d(node: &str, rule: u32, kind: pb::ActionKind, reason: &str) -> pb::Decision {
        pb::Decision {
            node_id: node.into(),
            attempt: if kind == pb::ActionKind::Insert { 0 } else { 1 },
            rule,
            kind: kind as i32,
            effect: 0,
            reason: reason.into(),
            until_ms: 0,
        }
    }

    fn response() -> pb::PlanResponse {
        use pb::ActionKind as K;
        let mut decisions = Vec::new();
        for i in 0..3 {
            decisions.push(d(&format!("ctrl-{i}"), 11, K::Wait, "ready"));
        }
        for i in 0..2 {
            decisions.push(d(
                &format!("workers-{i}"),
                4,
                K::BeginDelete,
                "the spec changed: replace the attempt",
            ));
        }
        for i in 2..4 {
            decisions.push(d(
                &format!("workers-{i}"),
                17,
                K::Wait,
                "workers: 2/2 unavailable: waiting for a replacement to become ready",
            ));
        }
        for i in 4..6 {
            decisions.push(d(
                &format!("workers-{i}"),
                4,
                K::BeginDelete,
                "the slot is no longer desired",
            ));
        }
        decisions.push(d("gpu-0", 0, K::Insert, "desired slot has no node"));
        decisions.push(d("gpu-1", 0, K::Insert, "desired slot has no node"));
        pb::PlanResponse {
            decisions,
            scale_down: vec!["workers-5".into(), "workers-4".into()],
            current_generation: 2,
            changed_secrets: vec!["ctrl.template.join.token".into()],
            waves: vec![
                pb::PlanWave {
                    group_id: "workers".into(),
                    wave: 1,
                    nodes: vec!["workers-0".into(), "workers-1".into()],
                    note: "at most 2 unavailable at once".into(),
                },
                pb::PlanWave {
                    group_id: "workers".into(),
                    wave: 2,
                    nodes: vec!["workers-2".into(), "workers-3".into()],
                    note: "at most 2 unavailable at once".into(),
                },
            ],
        }
    }

    fn current() -> pb::RunStatus {
        pb::RunStatus {
            run_id: "demo".into(),
            generation: 2,
            phase: pb::RunPhase::Converged as i32,
            groups: vec![
                pb::GroupStatus {
                    group_id: "ctrl".into(),
                    desired: 3,
                    ..Default::default()
                },
                pb::GroupStatus {
                    group_id: "workers".into(),
                    desired: 6,
                    ..Default::default()
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn changes_are_grouped_with_rules_and_scale_down_goes_highest_first() {
        let resp = response();
        let cur = current();
        let input = PlanInput {
            source: "shape.yaml",
            run_id: "demo",
            generation: 3,
            current: Some(&cur),
            proposed: vec![("ctrl".into(), 3), ("workers".into(), 4), ("gpu".into(), 2)],
            response: &resp,
            changes: [(
                "workers".to_owned(),
                vec![FieldChange {
                    path: "template.image".into(),
                    old: Some("img:1".into()),
                    new: Some("img:2".into()),
                }],
            )]
            .into(),
            changed: true,
        };
        let text = plan_table(&input).join("\n");
        assert!(text.contains("generation 2 → 3"), "{text}");
        assert!(
            text.contains("group workers: 6 → 4 nodes\n  ~ template.image: img:1 → img:2\n"),
            "{text}"
        );
        assert!(
            text.contains("group ctrl: 3 nodes\n  ~ template.join.token: secret value changed (not shown)"),
            "{text}"
        );
        assert!(text.contains("group workers: 6 → 4 nodes"), "{text}");
        assert!(text.contains("group gpu: new, 2 nodes"), "{text}");
        assert!(text.contains("group ctrl: 3 nodes"), "{text}");
        assert!(text.contains("  scale down   2 nodes: workers-5, workers-4\n      rule 4 (begin-delete): the slot is no longer desired"), "{text}");
        assert!(
            text.contains(
                "  replace      2 nodes: workers-0, workers-1\n      rule 4 (begin-delete): the spec changed"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "  replace      2 nodes: workers-2, workers-3\n      rule 17 (rollout-budget): workers: 2/2"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "  rollout in 2 waves, each once the one before is ready:\n    wave 1: workers-0, workers-1 \
                 (at most 2 unavailable at once)\n    wave 2: workers-2, workers-3"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "  insert       2 nodes: gpu-0, gpu-1\n      rule 0 (insert): desired slot has no node"
            ),
            "{text}"
        );
        assert!(
            text.contains("  unchanged    3 nodes: ctrl-0..2\n      rule 11 (ready): ready"),
            "{text}"
        );
        assert!(
            text.contains("2 to insert, 4 to replace, 2 to scale down, 0 in progress, 3 unchanged"),
            "{text}"
        );

        let v = plan_json(&input);
        assert_eq!(v["changed"], true);
        assert_eq!(v["field_changes"]["workers"][0]["new"], "img:2");
        assert_eq!(v["changed_secrets"], json!(["ctrl.template.join.token"]));
        assert_eq!(v["summary"]["scale_down"], 2);
        assert_eq!(v["scale_down"], json!(["workers-5", "workers-4"]));
        assert_eq!(v["waves"][1]["nodes"], json!(["workers-2", "workers-3"]));
        assert_eq!(v["current_generation"], 2);
        let workers = v["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["group_id"] == "workers")
            .unwrap();
        assert_eq!(workers["changes"][0]["change"], "scale-down");
        assert_eq!(workers["changes"][0]["nodes"], json!(["workers-5", "workers-4"]));
        let insert = v["decisions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["node_id"] == "gpu-0")
            .unwrap();
        assert_eq!(insert["change"], "insert");
        assert_eq!(insert["rule"], 0);
    }

    #[test]
    fn a_new_run_is_all_inserts() {
        let resp = pb::PlanResponse {
            decisions: vec![d("w-0", 0, pb::ActionKind::Insert, "desired slot has no node")],
            scale_down: vec![],
            current_generation: 0,
            changed_secrets: vec![],
            waves: vec![],
        };
        let input = PlanInput {
            source: "-",
            run_id: "demo",
            generation: 1,
            current: None,
            proposed: vec![("w".into(), 1)],
            response: &resp,
            changes: BTreeMap::new(),
            changed: true,
        };
        let text = plan_table(&input).join("\n");
        assert!(text.contains("a new run at generation 1"), "{text}");
        assert!(text.contains("1 to insert, 0 to replace"), "{text}");
        assert_eq!(plan_json(&input)["current_generation"], Value::Null);
    }

    fn shape_with(image: &str, probe: i32, count: i64) -> pb::ClusterShape {
        let group = contract::NodeGroup {
            id: contract::GroupId::parse("id", "workers").unwrap(),
            count: 2,
            template: std::sync::Arc::new(contract::shape::example_template("fake", image)),
            policy: Default::default(),
        };
        let mut s = pb::ClusterShape::from(&contract::ClusterShape {
            run_id: contract::RunId::parse("run_id", "demo").unwrap(),
            generation: contract::Generation::new(1),
            labels: Default::default(),
            groups: vec![group],
        });
        s.groups[0].count = count;
        // As a shape file leaves them: unset, meaning the defaults.
        s.groups[0].health = Some(pb::HealthPolicy {
            probe,
            ..Default::default()
        });
        s.groups[0].remediation = None;
        s
    }

    #[test]
    fn field_changes_name_what_differs_and_defaults_equal_their_values() {
        let current = {
            // As the server holds it: every default written out.
            let d = contract::wire::shape_from_wire(shape_with("img:1", 0, 2)).unwrap();
            pb::ClusterShape::from(&d)
        };
        assert!(field_changes(Some(&current), &shape_with("img:1", 0, 2)).is_empty());
        // A count is the header's business, not a field change.
        assert!(field_changes(Some(&current), &shape_with("img:1", 0, 5)).is_empty());
        let changes = field_changes(Some(&current), &shape_with("img:2", pb::Probe::Tcp as i32, 2));
        let paths: Vec<(&str, Option<&str>, Option<&str>)> = changes["workers"]
            .iter()
            .map(|c| (c.path.as_str(), c.old.as_deref(), c.new.as_deref()))
            .collect();
        assert_eq!(
            paths,
            [
                ("health.probe", Some("none"), Some("tcp")),
                ("template.image", Some("img:1"), Some("img:2"))
            ]
        );
        // A new run has nothing to compare with.
        assert!(field_changes(None, &shape_with("img:2", 0, 2)).is_empty());
    }
}
