//! Renderers for what `get` and `list` print: a run's status, its nodes and
//! its shape, as a table for people or as JSON/YAML for scripts.
//!
//! The JSON and YAML outputs are the same document (one `serde_json::Value`
//! serialized two ways), so a script can switch format without changing its
//! field names, and the table shows the same facts. Shapes come from the
//! server already redacted; nothing here ever reads a local secret.

use std::time::Duration;

use contract::pb;
use serde_json::{Map, Value, json};

use super::{
    names,
    text::{self, Table},
};

/// How a read command prints its answer: `-o table|wide|json|yaml|name`, or
/// `-o jsonpath=TEMPLATE` (kubectl's form: text with `{.field[0].other}`
/// expressions, `[*]` for every element).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Table,
    /// The table with more columns where a command has them (`list`: the
    /// run's uid, epoch, passes and labels); else the table.
    Wide,
    Json,
    Yaml,
    /// `kind/name` of each thing the answer is about (`run/demo`).
    Name,
    /// The template; leaked once at parse time, so that `Output` stays a
    /// copyable value (a command line parses one).
    JsonPath(&'static str),
}

impl Output {
    /// Parses `-o`'s value.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "table" => Ok(Output::Table),
            "wide" => Ok(Output::Wide),
            "json" => Ok(Output::Json),
            "yaml" => Ok(Output::Yaml),
            "name" => Ok(Output::Name),
            _ => match s.strip_prefix("jsonpath=") {
                Some(t) => {
                    jsonpath::parse(t)?;
                    Ok(Output::JsonPath(Box::leak(t.to_owned().into_boxed_str())))
                }
                None => Err(format!(
                    "{s:?} is not an output: table, wide, json, yaml, name or jsonpath=TEMPLATE (e.g. jsonpath='{{.phase}}')"
                )),
            },
        }
    }
}

/// `kind/name` of each thing a document is about, or `None` when it names
/// nothing `-o name` knows.
fn names(value: &Value) -> Option<Vec<String>> {
    let field = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    if let Some(runs) = value.get("runs").and_then(Value::as_array) {
        return Some(
            runs.iter()
                .filter_map(|r| field(r, "run_id"))
                .map(|r| format!("run/{r}"))
                .collect(),
        );
    }
    if let Some(providers) = value.get("providers").and_then(Value::as_array) {
        return Some(
            providers
                .iter()
                .filter_map(|p| field(p, "name"))
                .map(|p| format!("provider/{p}"))
                .collect(),
        );
    }
    field(value, "run_id").map(|r| vec![format!("run/{r}")])
}

/// The document as `output` prints it; an error names what cannot be
/// printed that way.
pub fn render(value: &Value, output: Output) -> Result<String, String> {
    match output {
        Output::Name => names(value)
            .map(|n| n.iter().map(|l| format!("{l}\n")).collect())
            .ok_or_else(|| {
                "-o name names runs and providers; this answer is neither (try -o json)".to_owned()
            }),
        Output::JsonPath(t) => {
            let mut s = jsonpath::evaluate(&jsonpath::parse(t)?, value)?;
            s.push('\n');
            Ok(s)
        }
        _ => Ok(document(value, output)),
    }
}

/// The document as JSON (pretty) or YAML text.
pub fn document(value: &Value, output: Output) -> String {
    match output {
        Output::Yaml => {
            serde_yaml_ng::to_string(value).unwrap_or_else(|e| format!("# cannot render YAML: {e}\n"))
        }
        _ => {
            let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("\"{e}\""));
            s.push('\n');
            s
        }
    }
}

/// kubectl's JSONPath templates, the part scripts use: literal text with
/// `{...}` expressions of fields (`.a.b`), indices (`[0]`, `[-1]`) and every
/// element (`[*]`, `.*`); several values are joined by a space.
mod jsonpath {
    use serde_json::Value;

    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Part {
        Text(String),
        Path(Vec<Step>),
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Step {
        Field(String),
        Index(i64),
        All,
    }

    pub fn parse(template: &str) -> Result<Vec<Part>, String> {
        let mut parts = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_owned()));
            }
            let close = rest[open..]
                .find('}')
                .map(|c| open + c)
                .ok_or_else(|| format!("jsonpath {template:?}: a `{{` without its `}}`"))?;
            parts.push(Part::Path(path(&rest[open + 1..close], template)?));
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        Ok(parts)
    }

    fn path(expr: &str, template: &str) -> Result<Vec<Step>, String> {
        let bad = |why: &str| format!("jsonpath {template:?}: {why} in {{{expr}}}");
        let mut steps = Vec::new();
        let mut rest = expr.trim().strip_prefix('$').unwrap_or(expr.trim());
        while !rest.is_empty() {
            if let Some(r) = rest.strip_prefix('.') {
                let end = r.find(['.', '[']).unwrap_or(r.len());
                let name = &r[..end];
                match name {
                    "" if end == r.len() => break,
                    "" => {}
                    "*" => steps.push(Step::All),
                    _ => steps.push(Step::Field(name.to_owned())),
                }
                rest = &r[end..];
            } else if let Some(r) = rest.strip_prefix('[') {
                let end = r.find(']').ok_or_else(|| bad("a `[` without its `]`"))?;
                let inner = r[..end].trim();
                steps.push(match inner {
                    "*" => Step::All,
                    _ => match inner.parse::<i64>() {
                        Ok(i) => Step::Index(i),
                        Err(_) => Step::Field(inner.trim_matches(['\'', '"']).to_owned()),
                    },
                });
                rest = &r[end + 1..];
            } else {
                return Err(bad("expected `.field` or `[index]`"));
            }
        }
        Ok(steps)
    }

    fn select<'a>(steps: &[Step], v: &'a Value, out: &mut Vec<&'a Value>) {
        let Some((step, rest)) = steps.split_first() else {
            out.push(v);
            return;
        };
        match (step, v) {
            (Step::Field(f), Value::Object(m)) => {
                if let Some(x) = m.get(f) {
                    select(rest, x, out);
                }
            }
            (Step::Index(i), Value::Array(a)) => {
                let at = if *i < 0 { a.len() as i64 + i } else { *i };
                if let Some(x) = usize::try_from(at).ok().and_then(|at| a.get(at)) {
                    select(rest, x, out);
                }
            }
            (Step::All, Value::Array(a)) => a.iter().for_each(|x| select(rest, x, out)),
            (Step::All, Value::Object(m)) => m.values().for_each(|x| select(rest, x, out)),
            _ => {}
        }
    }

    pub fn evaluate(parts: &[Part], value: &Value) -> Result<String, String> {
        let mut s = String::new();
        for part in parts {
            match part {
                Part::Text(t) => s.push_str(t),
                Part::Path(steps) => {
                    let mut found = Vec::new();
                    select(steps, value, &mut found);
                    let shown: Vec<String> = found
                        .into_iter()
                        .map(|v| match v {
                            Value::String(x) => x.clone(),
                            Value::Null => String::new(),
                            other => other.to_string(),
                        })
                        .collect();
                    s.push_str(&shown.join(" "));
                }
            }
        }
        Ok(s)
    }
}

/// A document as `-o json` and `-o yaml` print it.
pub type Document = Value;

/// Reads back a document `provisionctl` printed with `-o json` or `-o yaml`,
/// for tools and tests that consume its output.
pub fn parse_document(text: &str, output: Output) -> Result<Document, String> {
    match output {
        Output::Json => serde_json::from_str(text).map_err(|e| format!("not JSON: {e}")),
        Output::Yaml => serde_yaml_ng::from_str(text).map_err(|e| format!("not YAML: {e}")),
        Output::Table | Output::Wide | Output::Name | Output::JsonPath(_) => Err("not a document".to_owned()),
    }
}

fn ms_or_null(ms: u64) -> Value {
    if ms == 0 { Value::Null } else { json!(ms) }
}

fn non_empty(s: &str) -> Value {
    if s.is_empty() { Value::Null } else { json!(s) }
}

/// A stage-count map in path order (`new`, …, `ready`, `failed`, `destroyed`).
fn stage_counts(stages: &[pb::StageCount]) -> Vec<(&'static str, u32)> {
    let mut v: Vec<(i32, u32)> = stages.iter().map(|c| (c.stage, c.count)).collect();
    v.sort_by_key(|(s, _)| names::stage_order(*s));
    v.into_iter().map(|(s, c)| (names::stage(s), c)).collect()
}

pub fn decision_json(d: &pb::Decision) -> Value {
    json!({
        "rule": d.rule,
        "rule_name": names::rule(d.rule),
        "kind": names::kind(d.kind),
        "effect": if d.effect == 0 { Value::Null } else { json!(names::effect(d.effect)) },
        "reason": d.reason,
        "until_ms": ms_or_null(d.until_ms),
    })
}

pub fn node_json(n: &pb::NodeStatus) -> Value {
    let st = n.state.clone().unwrap_or_default();
    let facts = st.facts.unwrap_or_default();
    let retry = st.retry.unwrap_or_default();
    json!({
        "node_id": st.node_id,
        "group_id": n.group_id,
        "attempt": st.attempt,
        "intent": names::intent(st.intent),
        "stage": names::stage(st.stage),
        "spec_current": n.spec_current,
        "facts": {
            "lease_id": non_empty(&facts.lease_id),
            "endpoint": non_empty(&facts.endpoint),
            "session_id": non_empty(&facts.session_id),
            "bootstrap_stage": if facts.bootstrap_stage == 0 { Value::Null } else { json!(names::bootstrap_stage(facts.bootstrap_stage)) },
            "bootstrap_seq": facts.bootstrap_seq,
            "failure_reason": non_empty(&facts.failure_reason),
            "failed_at_ms": ms_or_null(facts.failed_at_ms),
            "ambiguous_create": facts.ambiguous_create,
            "ambiguous_bootstrap": facts.ambiguous_bootstrap,
            "lost": facts.lost,
        },
        "health": facts.health.as_ref().map(|h| json!({
            "healthy": h.healthy,
            "since_ms": ms_or_null(h.since_ms),
            "observed_at_ms": ms_or_null(h.observed_at_ms),
            "detail": h.detail,
            "remediate_at_ms": ms_or_null(h.remediate_at_ms),
        })),
        "pending": st.pending.map(|p| json!({
            "effect": names::effect(p.effect),
            "operation": p.id.map(|id| format!("{}.{}", id.attempt, id.seq)),
            "deadline_ms": ms_or_null(p.deadline_ms),
            "dispatched_at_ms": ms_or_null(p.dispatched_at_ms),
        })),
        "retry": {
            "consecutive_failures": retry.consecutive_failures,
            "next_effect_at_ms": ms_or_null(retry.next_effect_at_ms),
            "restart_at_ms": ms_or_null(retry.restart_at_ms),
            "permanent_failure": non_empty(&retry.permanent_failure),
            "remediating": retry.remediating,
        },
        "stage_deadline_ms": ms_or_null(st.stage_deadline_ms),
        "last_decision": n.last_decision.as_ref().map(decision_json),
    })
}

fn params_json(params: &std::collections::HashMap<String, pb::Param>) -> Value {
    let mut sorted: Vec<(&String, &pb::Param)> = params.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let map: Map<String, Value> = sorted
        .into_iter()
        .map(|(k, p)| {
            // Redacted again here although the server already did: a shape
            // printed by this client must never carry a secret value, whatever
            // the server sent.
            let v = if p.secret {
                json!({ "value": contract::wire::REDACTED, "secret": true })
            } else {
                json!(p.value)
            };
            (k.clone(), v)
        })
        .collect();
    Value::Object(map)
}

/// A shape in the shape-file schema, so `get -o yaml` reads like the file
/// that was applied (secret values redacted).
pub fn shape_json(s: &pb::ClusterShape) -> Value {
    let groups: Vec<Value> = s
        .groups
        .iter()
        .map(|g| {
            let t = g.template.clone().unwrap_or_default();
            let p = t.provider.clone().unwrap_or_default();
            let mut labels: Vec<(&String, &String)> = p.labels.iter().collect();
            labels.sort();
            json!({
                "id": g.id,
                "count": g.count,
                "template": {
                    "role": t.role,
                    "image": t.image,
                    "provider": {
                        "name": p.name,
                        "machine_type": p.machine_type,
                        "cpu": p.cpu,
                        "memory_gib": p.memory_gib,
                        "accelerators": p.accelerators.iter().map(|a| json!({"kind": a.kind, "count": a.count})).collect::<Vec<_>>(),
                        "zone": p.zone,
                        "labels": labels.into_iter().map(|(k, v)| (k.clone(), json!(v))).collect::<Map<_, _>>(),
                    },
                    "boot": params_json(&t.boot),
                    "join": params_json(&t.join),
                },
                "health": health_json(g.health.unwrap_or_default()),
                "remediation": remediation_json(g.remediation.unwrap_or_default()),
                "rollout": rollout_policy_json(g.rollout.unwrap_or_default()),
            })
        })
        .collect();
    json!({ "run_id": s.run_id, "generation": s.generation, "groups": groups })
}

/// A duration in milliseconds as the shape file writes it (`10s`, `500ms`).
fn ms_text(ms: u64) -> String {
    if ms > 0 && ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// A group's health policy in the shape-file schema, its unset fields as
/// the defaults they mean.
fn health_json(h: pb::HealthPolicy) -> Value {
    match contract::wire::health_from_wire(h) {
        Ok(h) => json!({
            "probe": match h.probe {
                contract::Probe::None => "none",
                contract::Probe::Tcp => "tcp",
            },
            "interval": ms_text(h.interval_ms),
            "timeout": ms_text(h.timeout_ms),
            "unhealthy_after": ms_text(h.unhealthy_after_ms),
            "startup_grace": ms_text(h.startup_grace_ms),
        }),
        Err(e) => json!({ "invalid": e.to_string() }),
    }
}

/// A group's remediation budget in the shape-file schema.
fn remediation_json(r: pb::RemediationPolicy) -> Value {
    match contract::wire::remediation_from_wire(r) {
        Ok(r) => json!({
            "max_in_flight": r.max_in_flight,
            "max_unhealthy": budget_json(r.max_unhealthy),
        }),
        Err(e) => json!({ "invalid": e.to_string() }),
    }
}

fn budget_json(b: contract::Budget) -> Value {
    match b {
        contract::Budget::Count(n) => json!(n),
        contract::Budget::Percent(p) => json!(format!("{p}%")),
    }
}

/// A group's rollout policy in the shape-file schema.
fn rollout_policy_json(r: pb::RolloutPolicy) -> Value {
    let r = contract::wire::rollout_from_wire(r);
    json!({
        "max_unavailable": budget_json(r.max_unavailable),
        "max_surge": budget_json(r.max_surge),
        "canary": r.canary,
        "progress_deadline": ms_text(r.progress_deadline_ms),
        "failure_threshold": r.failure_threshold,
        "auto_revert": r.auto_revert,
    })
}

/// A group's rollout in progress as a document.
pub fn rollout_json(r: &pb::RolloutStatus) -> Value {
    json!({
        "generation": r.generation,
        "updated": r.updated,
        "updated_ready": r.updated_ready,
        "old": r.old,
        "unavailable": r.unavailable,
        "max_unavailable": r.max_unavailable,
        "max_surge": r.max_surge,
        "surging": r.surging,
        "canary": r.canary,
        "promoted": r.promoted,
        "canary_paused": r.canary_paused,
        "halted": r.halted,
        "halt_reason": non_empty(&r.halt_reason),
        "failures": r.failures,
        "reverted_from": (r.reverted_from > 0).then_some(r.reverted_from),
        "started_at_ms": ms_or_null(r.started_at_ms),
        "progress_deadline_ms": ms_or_null(r.progress_deadline_ms),
    })
}

/// A rollout's state in a word or a few.
fn rollout_state(r: &pb::RolloutStatus) -> String {
    if r.halted {
        format!("halted: {}", r.halt_reason)
    } else if r.canary_paused {
        "canary: waiting for a promotion".to_owned()
    } else if r.reverted_from > 0 {
        format!("reverting generation {}", r.reverted_from)
    } else {
        "progressing".to_owned()
    }
}

/// `rollout status`: each group's rollout, or that it has none.
pub fn rollout_table(s: &pb::RunStatus) -> Vec<String> {
    let mut t = Table::new(&[
        "GROUP",
        "GENERATION",
        "NEW",
        "OLD",
        "UNAVAILABLE",
        "SURGING",
        "CANARY",
        "FAILED",
        "STATE",
    ]);
    for g in &s.groups {
        let Some(r) = &g.rollout else {
            t.row(vec![
                g.group_id.clone(),
                "-".into(),
                format!("{}/{} ready", g.ready, g.desired),
                "0".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                "no rollout in progress".into(),
            ]);
            continue;
        };
        let canary = match (r.canary, r.promoted) {
            (0, _) => "-".to_owned(),
            (n, true) => format!("{n} (promoted)"),
            (n, false) => n.to_string(),
        };
        t.row(vec![
            g.group_id.clone(),
            r.generation.to_string(),
            format!("{}/{} ready", r.updated_ready, g.desired),
            r.old.to_string(),
            format!("{}/{}", r.unavailable, r.max_unavailable),
            format!("{}/{}", r.surging, r.max_surge),
            canary,
            r.failures.to_string(),
            rollout_state(r),
        ]);
    }
    t.lines()
}

/// `rollout status` as a document.
pub fn rollouts_json(s: &pb::RunStatus) -> Value {
    json!({
        "run_id": s.run_id,
        "generation": s.generation,
        "groups": s.groups.iter().map(|g| json!({
            "group_id": g.group_id,
            "desired": g.desired,
            "ready": g.ready,
            "rollout": g.rollout.as_ref().map(rollout_json),
        })).collect::<Vec<_>>(),
    })
}

/// A run's status document. `with_shape` adds the (redacted) shape,
/// `with_nodes` the node list (present, if empty, whenever it was asked for).
pub fn status_json(s: &pb::RunStatus, with_shape: bool, with_nodes: bool) -> Value {
    let groups: Vec<Value> = s
        .groups
        .iter()
        .map(|g| {
            let stages: Map<String, Value> = stage_counts(&g.stages)
                .into_iter()
                .map(|(k, c)| (k.to_owned(), json!(c)))
                .collect();
            json!({
                "group_id": g.group_id, "desired": g.desired, "ready": g.ready,
                "failing": g.failing, "unhealthy": g.unhealthy,
                "remediation_held": g.remediation_held, "stages": stages,
                "rollout": g.rollout.as_ref().map(rollout_json),
            })
        })
        .collect();
    let mut v = json!({
        "run_id": s.run_id,
        "run_uid": s.run_uid,
        "generation": s.generation,
        "observed_generation": s.observed_generation,
        "phase": names::phase(s.phase),
        "converged": s.converged,
        "paused": s.paused,
        "labels": s.labels.iter().collect::<std::collections::BTreeMap<_, _>>(),
        "desired_count": desired(s),
        "node_count": s.node_count,
        "ready_count": s.ready_count,
        "pending_operations": s.pending_operations,
        "epoch": s.epoch,
        "passes": s.passes,
        "created_at_ms": ms_or_null(s.created_at_ms),
        "converged_at_ms": ms_or_null(s.converged_at_ms),
        "updated_at_ms": ms_or_null(s.updated_at_ms),
        "folded_results": s.folded_results,
        "folded_observations": s.folded_observations,
        "discarded": s.discarded,
        "groups": groups,
        "conditions": s.conditions.iter().map(condition_json).collect::<Vec<_>>(),
    });
    if let Value::Object(m) = &mut v {
        if s.from_store {
            m.insert(
                "served_by".into(),
                json!({ "replica": s.served_by, "address": s.served_at, "from_store": true }),
            );
        }
        if with_shape && let Some(shape) = &s.shape {
            m.insert("shape".into(), shape_json(shape));
        }
        if with_nodes || !s.nodes.is_empty() {
            m.insert(
                "nodes".into(),
                Value::Array(s.nodes.iter().map(node_json).collect()),
            );
        }
    }
    v
}

fn condition_json(c: &pb::Condition) -> Value {
    json!({
        "type": c.r#type,
        "status": c.status,
        "reason": c.reason,
        "message": c.message,
        "since_ms": ms_or_null(c.since_ms),
        "observed_generation": c.observed_generation,
    })
}

/// The run's condition of type `kind`, if it is true.
pub fn condition<'a>(s: &'a pb::RunStatus, kind: &str) -> Option<&'a pb::Condition> {
    s.conditions.iter().find(|c| c.r#type == kind && c.status)
}

pub fn desired(s: &pb::RunStatus) -> u32 {
    s.groups.iter().map(|g| g.desired).sum()
}

fn stages_text(stages: &[pb::StageCount]) -> String {
    let parts: Vec<String> = stage_counts(stages)
        .into_iter()
        .map(|(k, c)| format!("{k}={c}"))
        .collect();
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(" ")
    }
}

/// The phase in words, with what it implies.
pub fn phase_text(s: &pb::RunStatus) -> String {
    let phase = names::phase(s.phase);
    if s.paused && s.phase != pb::RunPhase::Paused as i32 {
        format!("{phase} (paused)")
    } else {
        phase.to_owned()
    }
}

/// `get RUN` as a table.
pub fn status_table(s: &pb::RunStatus) -> Vec<String> {
    let now = s.updated_at_ms;
    let mut out = Vec::new();
    let mut head = Table::default();
    head.row(vec!["run".into(), format!("{} (uid {})", s.run_id, s.run_uid)]);
    if !s.labels.is_empty() {
        head.row(vec!["labels".into(), labels_text(s)]);
    }
    head.row(vec![
        "phase".into(),
        format!(
            "{} at generation {} (observed {})",
            phase_text(s),
            s.generation,
            s.observed_generation
        ),
    ]);
    head.row(vec![
        "nodes".into(),
        format!(
            "{}/{} ready, {} held, {} operations pending",
            s.ready_count,
            desired(s),
            s.node_count,
            s.pending_operations
        ),
    ]);
    if s.created_at_ms > 0 {
        head.row(vec!["created".into(), text::relative(s.created_at_ms, now)]);
    }
    if s.converged_at_ms > 0 {
        head.row(vec!["converged".into(), text::relative(s.converged_at_ms, now)]);
    }
    if s.paused {
        head.row(vec![
            "paused".into(),
            "nothing new is dispatched; `provisionctl resume` continues".into(),
        ]);
    }
    out.extend(head.lines());
    if !s.conditions.is_empty() {
        out.push(String::new());
        let mut c = Table::new(&["CONDITION", "STATUS", "REASON", "SINCE", "MESSAGE"]);
        for cond in &s.conditions {
            c.row(vec![
                cond.r#type.clone(),
                if cond.status { "True" } else { "False" }.to_owned(),
                cond.reason.clone(),
                if cond.since_ms > 0 {
                    text::relative(cond.since_ms, now)
                } else {
                    String::new()
                },
                cond.message.clone(),
            ]);
        }
        out.extend(c.lines());
    }
    out.push(String::new());
    let mut t = Table::new(&["GROUP", "READY", "DESIRED", "FAILING", "UNHEALTHY", "STAGES"]);
    for g in &s.groups {
        let unhealthy = if g.remediation_held > 0 {
            format!("{} ({} held)", g.unhealthy, g.remediation_held)
        } else {
            g.unhealthy.to_string()
        };
        t.row(vec![
            g.group_id.clone(),
            g.ready.to_string(),
            g.desired.to_string(),
            g.failing.to_string(),
            unhealthy,
            stages_text(&g.stages),
        ]);
    }
    out.extend(t.lines());
    if !s.nodes.is_empty() {
        out.push(String::new());
        out.extend(nodes_table(&s.nodes, now));
    }
    out
}

/// One row per node: where it is and why.
pub fn nodes_table(nodes: &[pb::NodeStatus], now_ms: u64) -> Vec<String> {
    let mut t = Table::new(&[
        "NODE", "ATTEMPT", "STAGE", "HEALTH", "PENDING", "FAILURES", "RULE", "REASON",
    ]);
    for n in nodes {
        let st = n.state.clone().unwrap_or_default();
        let retry = st.retry.unwrap_or_default();
        let facts = st.facts.clone().unwrap_or_default();
        let health = health_cell(&facts, now_ms);
        let pending = st.pending.map_or_else(
            || "-".to_owned(),
            |p| {
                format!(
                    "{} ({})",
                    names::effect(p.effect),
                    text::relative(p.deadline_ms, now_ms)
                )
            },
        );
        let mut stage = names::stage(st.stage).to_owned();
        if st.intent == pb::Intent::Deleting as i32 && st.stage != pb::NodeStage::Destroyed as i32 {
            stage.push_str(", deleting");
        }
        if !n.spec_current {
            stage.push_str(", outdated");
        }
        let (rule, reason) = n
            .last_decision
            .as_ref()
            .map_or(("-".to_owned(), String::new()), |d| {
                (d.rule.to_string(), d.reason.clone())
            });
        t.row(vec![
            st.node_id,
            st.attempt.to_string(),
            stage,
            health,
            pending,
            retry.consecutive_failures.to_string(),
            rule,
            reason,
        ]);
    }
    t.lines()
}

/// A node's health as a table cell: `lost`, `healthy (3s ago)` with the age
/// of the last observation, `unhealthy 12s` with how long, or `-` when never
/// probed.
fn health_cell(facts: &pb::NodeFacts, now_ms: u64) -> String {
    if facts.lost {
        return "lost".to_owned();
    }
    match &facts.health {
        None => "-".to_owned(),
        Some(h) if h.healthy => format!("healthy (seen {})", text::relative(h.observed_at_ms, now_ms)),
        Some(h) => format!("unhealthy since {}", text::relative(h.since_ms, now_ms)),
    }
}

/// `list` as a table.
/// A run's labels as `key=value, ...`, sorted.
fn labels_text(s: &pb::RunStatus) -> String {
    let sorted: std::collections::BTreeMap<_, _> = s.labels.iter().collect();
    sorted
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// `list`'s table; `wide` adds each run's uid, epoch and passes, and its
/// labels whether or not any run has some.
pub fn list_table(runs: &[pb::RunStatus], wide: bool) -> Vec<String> {
    if runs.is_empty() {
        return vec!["no runs".to_owned()];
    }
    // Driver replicas: a column says which replica serves each run (a run
    // another replica serves is shown as that replica last stored it).
    let replicas = runs.iter().any(|s| s.from_store);
    let mut columns = vec![
        "RUN",
        "PHASE",
        "GENERATION",
        "READY",
        "PENDING",
        "FAILING",
        "UNHEALTHY",
        "GROUPS",
        "AGE",
    ];
    if replicas {
        columns.push("SERVED BY");
    }
    if wide {
        columns.extend(["UID", "EPOCH", "PASSES"]);
    }
    let labelled = wide || runs.iter().any(|s| !s.labels.is_empty());
    if labelled {
        columns.push("LABELS");
    }
    let mut t = Table::new(&columns);
    for s in runs {
        let failing: u32 = s.groups.iter().map(|g| g.failing).sum();
        let unhealthy: u32 = s.groups.iter().map(|g| g.unhealthy).sum();
        // Measured against the server's clock, as every time shown is.
        let age = if s.created_at_ms > 0 && s.updated_at_ms >= s.created_at_ms {
            text::age(Duration::from_millis(s.updated_at_ms - s.created_at_ms))
        } else {
            "-".to_owned()
        };
        let mut row = vec![
            s.run_id.clone(),
            phase_text(s),
            s.generation.to_string(),
            format!("{}/{}", s.ready_count, desired(s)),
            s.pending_operations.to_string(),
            failing.to_string(),
            unhealthy.to_string(),
            s.groups.len().to_string(),
            age,
        ];
        if replicas {
            row.push(match (s.from_store, s.served_by.as_str(), s.served_at.as_str()) {
                (false, _, _) => "this replica".to_owned(),
                (true, "", _) => "nobody (being taken over)".to_owned(),
                (true, id, "") => id.to_owned(),
                (true, id, at) => format!("{id} at {at}"),
            });
        }
        if wide {
            row.extend([s.run_uid.clone(), s.epoch.to_string(), s.passes.to_string()]);
        }
        if labelled {
            row.push(if s.labels.is_empty() {
                "-".to_owned()
            } else {
                labels_text(s)
            });
        }
        t.row(row);
    }
    t.lines()
}

/// `list` as a document.
pub fn list_json(runs: &[pb::RunStatus]) -> Value {
    json!({ "runs": runs.iter().map(|s| status_json(s, false, false)).collect::<Vec<_>>() })
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn outputs_parse_and_a_bad_one_says_what_there_is() {
        assert_eq!(Output::parse("name"), Ok(Output::Name));
        assert_eq!(Output::parse("yaml"), Ok(Output::Yaml));
        assert_eq!(
            Output::parse("jsonpath={.phase}"),
            Ok(Output::JsonPath("{.phase}"))
        );
        let e = Output::parse("xml").unwrap_err();
        assert!(
            e.contains("table, wide, json, yaml, name or jsonpath=TEMPLATE"),
            "{e}"
        );
        assert_eq!(Output::parse("wide"), Ok(Output::Wide));
        let e = Output::parse("jsonpath={.phase").unwrap_err();
        assert!(e.contains("without its"), "{e}");
        let e = Output::parse("jsonpath={phase}").unwrap_err();
        assert!(e.contains("expected `.field`"), "{e}");
    }

    #[test]
    fn jsonpath_templates_select_fields_indices_and_every_element() {
        let doc = json!({
            "runs": [
                { "run_id": "a", "phase": "converged", "groups": [{ "ready": 3 }] },
                { "run_id": "b", "phase": "progressing", "groups": [{ "ready": 1 }, { "ready": 2 }] },
            ],
            "n": 2,
            "none": null,
        });
        let out = |t: &str| render(&doc, Output::parse(&format!("jsonpath={t}")).unwrap()).unwrap();
        assert_eq!(out("{.runs[*].run_id}"), "a b\n");
        assert_eq!(out("{.runs[0].phase}"), "converged\n");
        assert_eq!(out("{.runs[-1].groups[*].ready}"), "1 2\n");
        assert_eq!(out("{$.n} runs, first {.runs[0]['run_id']}"), "2 runs, first a\n");
        assert_eq!(out("{.missing}{.none}"), "\n");
        assert_eq!(out("{.runs[*].groups[0].ready}"), "3 1\n");
    }

    #[test]
    fn name_output_names_runs_and_providers() {
        let list = json!({ "runs": [{ "run_id": "a" }, { "run_id": "b" }] });
        assert_eq!(render(&list, Output::Name).unwrap(), "run/a\nrun/b\n");
        let one = json!({ "run_id": "demo", "phase": "converged" });
        assert_eq!(render(&one, Output::Name).unwrap(), "run/demo\n");
        let providers = json!({ "known": true, "providers": [{ "name": "fake" }] });
        assert_eq!(render(&providers, Output::Name).unwrap(), "provider/fake\n");
        let e = render(&json!({ "events": [] }), Output::Name).unwrap_err();
        assert!(e.contains("-o json"), "{e}");
    }

    pub(crate) fn status() -> pb::RunStatus {
        pb::RunStatus {
            run_id: "demo".into(),
            run_uid: "00000000000000000000000000000001".into(),
            generation: 2,
            observed_generation: 2,
            phase: pb::RunPhase::Progressing as i32,
            groups: vec![
                pb::GroupStatus {
                    group_id: "workers".into(),
                    desired: 4,
                    ready: 2,
                    failing: 1,
                    unhealthy: 1,
                    remediation_held: 1,
                    rollout: None,
                    stages: vec![
                        pb::StageCount {
                            stage: pb::NodeStage::Dormant as i32,
                            count: 2,
                        },
                        pb::StageCount {
                            stage: pb::NodeStage::New as i32,
                            count: 2,
                        },
                    ],
                },
                pb::GroupStatus {
                    group_id: "gpu".into(),
                    desired: 2,
                    ready: 2,
                    failing: 0,
                    unhealthy: 0,
                    remediation_held: 0,
                    rollout: None,
                    stages: vec![pb::StageCount {
                        stage: pb::NodeStage::Dormant as i32,
                        count: 2,
                    }],
                },
            ],
            node_count: 6,
            ready_count: 4,
            pending_operations: 1,
            updated_at_ms: 10_000,
            created_at_ms: 4_000,
            shape: Some(pb::ClusterShape {
                run_id: "demo".into(),
                generation: 2,
                labels: Default::default(),
                groups: vec![pb::NodeGroup {
                    id: "workers".into(),
                    count: 4,
                    template: Some(pb::NodeTemplate {
                        image: "img:1".into(),
                        join: [(
                            "token".to_owned(),
                            pb::Param {
                                value: "leaked-if-printed".into(),
                                secret: true,
                            },
                        )]
                        .into_iter()
                        .collect(),
                        ..Default::default()
                    }),
                    run_id: String::new(),
                    ..Default::default()
                }],
            }),
            ..Default::default()
        }
    }

    pub(crate) fn failing_node() -> pb::NodeStatus {
        pb::NodeStatus {
            state: Some(pb::NodeState {
                node_id: "workers-3".into(),
                attempt: 7,
                intent: pb::Intent::Active as i32,
                stage: pb::NodeStage::New as i32,
                facts: Some(pb::NodeFacts {
                    failure_reason: "quota refused".into(),
                    ..Default::default()
                }),
                pending: None,
                retry: Some(pb::RetryState {
                    consecutive_failures: 3,
                    next_effect_at_ms: 11_500,
                    ..Default::default()
                }),
                stage_deadline_ms: 0,
                template_ref: 0,
                ..Default::default()
            }),
            group_id: "workers".into(),
            spec_current: true,
            last_decision: Some(pb::Decision {
                node_id: "workers-3".into(),
                attempt: 7,
                rule: 10,
                kind: pb::ActionKind::Wait as i32,
                effect: 0,
                reason: "backing off before the next try".into(),
                until_ms: 11_500,
            }),
        }
    }

    #[test]
    fn json_and_yaml_carry_the_same_facts_and_no_secret() {
        let s = status();
        let v = status_json(&s, true, false);
        let json_text = document(&v, Output::Json);
        let yaml_text = document(&v, Output::Yaml);
        let from_json: Value = serde_json::from_str(&json_text).unwrap();
        let from_yaml: Value = serde_yaml_ng::from_str(&yaml_text).unwrap();
        assert_eq!(from_json, from_yaml);
        assert_eq!(from_json["phase"], "progressing");
        assert_eq!(from_json["desired_count"], 6);
        assert_eq!(from_json["groups"][0]["stages"]["new"], 2);
        assert_eq!(
            from_json["shape"]["groups"][0]["template"]["join"]["token"]["value"],
            "<redacted>"
        );
        assert!(!json_text.contains("leaked-if-printed") && !yaml_text.contains("leaked-if-printed"));
        // Stages are listed along the path to ready, whatever order they came in.
        let keys: Vec<&String> = from_json["groups"][0]["stages"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(keys.len(), 2);
    }

    #[test]
    fn the_table_shows_what_the_document_says() {
        let mut s = status();
        s.nodes = vec![failing_node()];
        let lines = status_table(&s).join("\n");
        assert!(lines.contains("4/6 ready"), "{lines}");
        assert!(lines.contains("progressing at generation 2"), "{lines}");
        assert!(
            lines.contains("workers  2      4        1        1 (1 held)  new=2 ready=2"),
            "{lines}"
        );
        assert!(
            lines.contains("gpu      2      2        0        0           ready=2"),
            "{lines}"
        );
        assert!(lines.contains("workers-3  7"), "{lines}");
        assert!(lines.contains("backing off before the next try"), "{lines}");
        assert!(!lines.contains("leaked-if-printed"));
        let v = status_json(&s, false, true);
        assert_eq!(v["groups"][0]["unhealthy"], 1);
        assert_eq!(v["groups"][0]["remediation_held"], 1);
        assert_eq!(v["nodes"][0]["retry"]["consecutive_failures"], 3);
        assert_eq!(v["nodes"][0]["last_decision"]["rule_name"], "retry-backoff");
        assert!(v.get("shape").is_none());
    }

    #[test]
    fn rollout_status_shows_each_groups_budget_use_and_state() {
        let mut s = status();
        s.groups[0].rollout = Some(pb::RolloutStatus {
            generation: 2,
            updated: 2,
            updated_ready: 1,
            old: 2,
            unavailable: 1,
            max_unavailable: 1,
            max_surge: 2,
            surging: 1,
            canary: 2,
            canary_paused: true,
            ..Default::default()
        });
        let text = rollout_table(&s).join("\n");
        assert!(text.contains("SURGING"), "{text}");
        let workers = text.lines().find(|l| l.starts_with("workers")).unwrap();
        for cell in ["1/4 ready", "1/1", "1/2", "canary: waiting for a promotion"] {
            assert!(workers.contains(cell), "{cell} missing: {workers}");
        }
        assert!(
            text.lines()
                .any(|l| l.starts_with("gpu") && l.contains("no rollout in progress")),
            "{text}"
        );
        let v = rollouts_json(&s);
        assert_eq!(v["groups"][0]["rollout"]["surging"], 1);
        assert!(v["groups"][1]["rollout"].is_null());
    }

    #[test]
    fn list_has_a_row_per_run() {
        let lines = list_table(&[status()], false);
        assert_eq!(lines.len(), 2);
        assert!(lines[1].starts_with("demo"), "{lines:?}");
        assert!(lines[1].contains("4/6"), "{lines:?}");
        assert_eq!(list_table(&[], false), vec!["no runs"]);
        let wide = list_table(&[status()], true);
        assert!(wide[0].contains("UID") && wide[0].contains("LABELS"), "{wide:?}");
        assert!(wide[1].contains("00000000000000000000000000000001"), "{wide:?}");
        assert_eq!(list_json(&[status()])["runs"][0]["run_id"], "demo");
        assert!(!lines[0].contains("SERVED BY"), "{lines:?}");
    }

    #[test]
    fn list_says_which_replica_serves_each_run() {
        let here = status();
        let mut there = status();
        there.run_id = "elsewhere".into();
        there.from_store = true;
        there.served_by = "driver-1".into();
        there.served_at = "10.0.0.2:7000".into();
        let mut moving = there.clone();
        moving.run_id = "moving".into();
        moving.served_by.clear();
        moving.served_at.clear();
        let lines = list_table(&[here, there.clone(), moving], false);
        assert!(lines[0].contains("SERVED BY"), "{lines:?}");
        assert!(lines[1].ends_with("this replica"), "{lines:?}");
        assert!(lines[2].ends_with("driver-1 at 10.0.0.2:7000"), "{lines:?}");
        assert!(lines[3].ends_with("nobody (being taken over)"), "{lines:?}");
        let v = list_json(&[status(), there]);
        assert!(v["runs"][0].get("served_by").is_none());
        assert_eq!(v["runs"][1]["served_by"]["replica"], "driver-1");
        assert_eq!(v["runs"][1]["served_by"]["from_store"], true);
    }
}
