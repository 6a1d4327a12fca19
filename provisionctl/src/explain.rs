//! `explain RUN NODE`: where a node is, what it holds, what it waits for, and
//! the ladder rule that applies to it now, in plain words.
//!
//! This is the answer to "why is it stuck": the rule and reason come from the
//! decider library evaluated against the node's current state on the server
//! (not replayed from history), and every deadline is shown relative to the
//! server's own clock.

use contract::pb;
use serde_json::{Value, json};

use super::{
    names,
    render::{decision_json, node_json},
    text,
};

/// What the user can do about the node's situation, if anything.
fn hint(st: &pb::NodeState, d: Option<&pb::Decision>, spec_current: bool) -> Option<String> {
    let retry = st.retry.clone().unwrap_or_default();
    if !retry.permanent_failure.is_empty() {
        return Some(
            "the provider refused this spec for good; change the group's template (for example the image) \
             and apply it, and the slot is retried with the new spec"
                .to_owned(),
        );
    }
    let rule = d.map(|d| d.rule)?;
    use contract::Rule as R;
    match R::from_number(rule)? {
        R::Pending => Some(
            "the operation is in flight; if no answer comes by its deadline the driver treats the outcome \
             as unknown and retries safely"
                .to_owned(),
        ),
        R::RetryBackoff | R::RestartBackoff if retry.consecutive_failures > 0 => Some(
            "the driver retries on its own; the failure reason above says why the last try failed".to_owned(),
        ),
        R::AwaitBootstrap => Some(
            "the bootstrap streams its progress; the attempt fails if it has not converged by the stage \
             deadline"
                .to_owned(),
        ),
        R::RemediationBudget => Some(
            "the reason says which budget holds it; a group over max_unhealthy is more likely a network \
             or probe fault than failed nodes: fix that, or raise the group's remediation.max_unhealthy"
                .to_owned(),
        ),
        R::RolloutBudget => Some(
            "the reason says what holds it: the group's max_unavailable (it goes on as replacements \
             become ready), a canary waiting for `provisionctl rollout promote`, or a halted rollout \
             (a newer apply ends the halt); `provisionctl rollout status` shows the group's rollout"
                .to_owned(),
        ),
        R::BeginDelete if !spec_current => {
            Some("the group's template changed: this attempt is replaced by one with the new spec".to_owned())
        }
        _ => None,
    }
}

/// The explanation as text for people.
pub fn explain_text(run: &str, e: &pb::NodeExplanation) -> Vec<String> {
    let now = e.now_ms;
    let node = e.node.clone().unwrap_or_default();
    let st = node.state.clone().unwrap_or_default();
    let facts = st.facts.clone().unwrap_or_default();
    let retry = st.retry.clone().unwrap_or_default();
    let mut out = vec![format!(
        "node {} of run {run} (group {})",
        st.node_id, node.group_id
    )];
    let mut t = text::Table::default();
    let mut row = |k: &str, v: String| t.row(vec![format!("  {k}"), v]);
    let intent = if st.intent == pb::Intent::Deleting as i32 && st.stage != pb::NodeStage::Destroyed as i32 {
        ", being cleaned up"
    } else {
        ""
    };
    row(
        "stage",
        format!("{}, attempt {}{intent}", names::stage(st.stage), st.attempt),
    );
    row(
        "spec",
        if node.spec_current {
            "current".to_owned()
        } else {
            "outdated: the group's template changed after this attempt started".to_owned()
        },
    );
    let or_none = |s: &str| {
        if s.is_empty() {
            "none".to_owned()
        } else {
            s.to_owned()
        }
    };
    row("lease", or_none(&facts.lease_id));
    row("endpoint", or_none(&facts.endpoint));
    row("session", or_none(&facts.session_id));
    if facts.bootstrap_stage != 0 {
        let when = if facts.bootstrap_stage_at_ms > 0 {
            format!(", {}", text::relative(facts.bootstrap_stage_at_ms, now))
        } else {
            String::new()
        };
        row(
            "bootstrap",
            format!(
                "{} (step {}){when}",
                names::bootstrap_stage(facts.bootstrap_stage),
                facts.bootstrap_seq
            ),
        );
    }
    if facts.lost {
        row("health", "lost: the executor saw the resource go".to_owned());
    } else if let Some(h) = &facts.health {
        let v = if h.healthy {
            format!(
                "healthy since {}, last observed {}",
                text::relative(h.since_ms, now),
                text::relative(h.observed_at_ms, now)
            )
        } else {
            let due = if h.remediate_at_ms > 0 {
                format!("; due for replacement {}", text::relative(h.remediate_at_ms, now))
            } else {
                String::new()
            };
            format!(
                "unhealthy since {} ({}), last observed {}{due}",
                text::relative(h.since_ms, now),
                h.detail,
                text::relative(h.observed_at_ms, now)
            )
        };
        row("health", v);
    }
    match &st.pending {
        Some(p) => {
            let op =
                p.id.map(|id| format!(" (operation {}.{})", id.attempt, id.seq))
                    .unwrap_or_default();
            let dispatched = if p.dispatched_at_ms > 0 {
                format!(", sent {}", text::relative(p.dispatched_at_ms, now))
            } else {
                String::new()
            };
            row(
                "pending",
                format!(
                    "{}{op}{dispatched}, deadline {}",
                    names::effect(p.effect),
                    text::relative(p.deadline_ms, now)
                ),
            );
        }
        None => row("pending", "nothing".to_owned()),
    }
    if st.stage_deadline_ms > 0 {
        row(
            "stage deadline",
            format!(
                "{} (the attempt fails if the stage is not done by then)",
                text::relative(st.stage_deadline_ms, now)
            ),
        );
    }
    let mut failures = if retry.consecutive_failures == 0 {
        "none".to_owned()
    } else {
        format!("{} in a row", retry.consecutive_failures)
    };
    if !facts.failure_reason.is_empty() {
        let when = if facts.failed_at_ms > 0 {
            format!(" ({})", text::relative(facts.failed_at_ms, now))
        } else {
            String::new()
        };
        failures.push_str(&format!("; last: {}{when}", facts.failure_reason));
    }
    row("failures", failures);
    if retry.next_effect_at_ms > 0 {
        row("next try", text::relative(retry.next_effect_at_ms, now));
    }
    // A permanent failure blocks the restart whatever its time says.
    if retry.restart_at_ms > 0 && retry.permanent_failure.is_empty() {
        row("restart", text::relative(retry.restart_at_ms, now));
    }
    if !retry.permanent_failure.is_empty() {
        row(
            "permanent",
            format!(
                "{}: restarts wait until the spec changes",
                retry.permanent_failure
            ),
        );
    }
    if facts.ambiguous_create {
        row(
            "ambiguous",
            "a create ended without a clear outcome; it is re-issued so the provider adopts what it made"
                .to_owned(),
        );
    }
    if facts.ambiguous_bootstrap {
        row(
            "ambiguous",
            "a bootstrap start ended without a clear outcome; it is cancelled before cleanup".to_owned(),
        );
    }
    out.extend(t.lines());
    out.push(String::new());
    match &e.decision {
        Some(d) => {
            out.push(format!(
                "now: {} — {}",
                names::rule_label(d.rule),
                names::rule_meaning(d.rule)
            ));
            let mut why = format!("  reason: {}", d.reason);
            if d.kind == pb::ActionKind::Wait as i32 {
                if d.until_ms > 0 {
                    why.push_str(&format!("; looks again {}", text::relative(d.until_ms, now)));
                } else {
                    why.push_str("; waits for an event");
                }
            } else {
                let what = if d.effect != 0 {
                    format!("dispatch {}", names::effect(d.effect))
                } else {
                    names::kind(d.kind).to_owned()
                };
                why.push_str(&format!("; the next pass will {what}"));
            }
            out.push(why);
        }
        None => out.push("now: no rule (the server gave no decision)".to_owned()),
    }
    if !e.executor_note.is_empty() {
        out.push(format!("note: {}", e.executor_note));
    }
    if let Some(last) = &node.last_decision {
        out.push(format!(
            "last pass: {}: {}",
            names::rule_label(last.rule),
            last.reason
        ));
    }
    if let Some(h) = hint(&st, e.decision.as_ref(), node.spec_current) {
        out.push(format!("what to do: {h}"));
    }
    out
}

/// The explanation as a document for scripts.
pub fn explain_json(run: &str, e: &pb::NodeExplanation) -> Value {
    let node = e.node.clone().unwrap_or_default();
    let mut v = node_json(&node);
    if let Value::Object(m) = &mut v {
        m.insert("run_id".into(), json!(run));
        m.insert("now_ms".into(), json!(e.now_ms));
        let rule = e.decision.as_ref().map(|d| {
            let mut r = decision_json(d);
            if let Value::Object(rm) = &mut r {
                rm.insert("meaning".into(), json!(names::rule_meaning(d.rule)));
            }
            r
        });
        m.insert("rule_now".into(), rule.unwrap_or(Value::Null));
        if !e.executor_note.is_empty() {
            m.insert("executor_note".into(), json!(e.executor_note));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::render::tests::failing_node;

    fn explanation() -> pb::NodeExplanation {
        let mut node = failing_node();
        if let Some(st) = node.state.as_mut() {
            st.pending = Some(pb::PendingOperation {
                id: Some(pb::OperationId { attempt: 7, seq: 2 }),
                effect: pb::Effect::CreateLease as i32,
                deadline_ms: 40_000,
                dispatched_at_ms: 9_000,
            });
        }
        pb::NodeExplanation {
            node: Some(node),
            decision: Some(pb::Decision {
                node_id: "workers-3".into(),
                attempt: 7,
                rule: 5,
                kind: pb::ActionKind::Wait as i32,
                effect: 0,
                reason: "waiting for create-lease".into(),
                until_ms: 40_000,
            }),
            now_ms: 10_000,
            executor_note: "waiting for the provider budget: 4 calls in flight, cap 4".into(),
        }
    }

    #[test]
    fn text_names_stage_pending_failures_and_the_rule_in_words() {
        let text = explain_text("demo", &explanation()).join("\n");
        assert!(
            text.contains("node workers-3 of run demo (group workers)"),
            "{text}"
        );
        assert!(text.contains("new, attempt 7"), "{text}");
        assert!(
            text.contains("note: waiting for the provider budget: 4 calls in flight, cap 4"),
            "{text}"
        );
        assert!(
            text.contains("create-lease (operation 7.2), sent 1.0s ago, deadline in 30.0s"),
            "{text}"
        );
        assert!(text.contains("3 in a row; last: quota refused"), "{text}");
        assert!(text.contains("next try"), "{text}");
        assert!(
            text.contains("now: rule 5 (pending) — waiting for a pending operation"),
            "{text}"
        );
        assert!(
            text.contains("reason: waiting for create-lease; looks again in 30.0s"),
            "{text}"
        );
        assert!(text.contains("last pass: rule 10 (retry-backoff)"), "{text}");
        assert!(text.contains("what to do:"), "{text}");
    }

    #[test]
    fn permanent_failures_say_what_to_change() {
        let mut e = explanation();
        if let Some(st) = e.node.as_mut().and_then(|n| n.state.as_mut()) {
            st.retry = Some(pb::RetryState {
                permanent_failure: "invalid image".into(),
                ..Default::default()
            });
        }
        let text = explain_text("demo", &e).join("\n");
        assert!(
            text.contains("invalid image: restarts wait until the spec changes"),
            "{text}"
        );
        assert!(text.contains("change the group's template"), "{text}");
    }

    #[test]
    fn json_carries_the_rule_now() {
        let v = explain_json("demo", &explanation());
        assert_eq!(v["rule_now"]["rule"], 5);
        assert_eq!(v["rule_now"]["rule_name"], "pending");
        assert_eq!(v["rule_now"]["meaning"], "waiting for a pending operation");
        assert_eq!(v["pending"]["effect"], "create-lease");
        assert_eq!(v["run_id"], "demo");
    }
}
