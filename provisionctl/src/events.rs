//! A run's event log as `events` and `describe` print it: a table with ages
//! (from the server's clock), one line per event as `events --follow` prints
//! them (with UTC times), and JSON.

use contract::pb;
use serde_json::{Value, json};

use super::text::{self, Table};

/// `Normal` or `Warning`.
pub fn kind(e: &pb::Event) -> &'static str {
    if e.r#type == pb::EventType::Warning as i32 {
        "Warning"
    } else {
        "Normal"
    }
}

/// What the event is about: `run`, `group/NAME` or `node/NAME (attempt N)`.
pub fn object(e: &pb::Event) -> String {
    if !e.node_id.is_empty() {
        format!("node/{} (attempt {})", e.node_id, e.attempt)
    } else if !e.group_id.is_empty() {
        format!("group/{}", e.group_id)
    } else {
        "run".to_owned()
    }
}

/// The message, with how often it happened when it repeated.
fn message(e: &pb::Event) -> String {
    if e.count > 1 {
        format!("{} (x{})", e.message, e.count)
    } else {
        e.message.clone()
    }
}

/// The events as a table, the ages measured against the server's `now_ms`.
pub fn events_table(events: &[pb::Event], now_ms: u64) -> Vec<String> {
    if events.is_empty() {
        return vec!["no events".to_owned()];
    }
    let mut t = Table::new(&["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]);
    for e in events {
        t.row(vec![
            text::relative(e.last_at_ms, now_ms),
            kind(e).to_owned(),
            e.reason.clone(),
            object(e),
            message(e),
        ]);
    }
    t.lines()
}

/// One event as `events --follow` prints it: a UTC time, then the table's
/// columns.
pub fn event_line(e: &pb::Event) -> String {
    format!(
        "{}  {:<7}  {:<21}  {}  {}",
        text::utc(e.last_at_ms),
        kind(e),
        e.reason,
        object(e),
        message(e)
    )
}

pub fn event_json(e: &pb::Event) -> Value {
    json!({
        "seq": e.seq,
        "type": kind(e),
        "reason": e.reason,
        "object": object(e),
        "group": if e.group_id.is_empty() { Value::Null } else { json!(e.group_id) },
        "node": if e.node_id.is_empty() { Value::Null } else { json!(e.node_id) },
        "attempt": if e.node_id.is_empty() { Value::Null } else { json!(e.attempt) },
        "message": e.message,
        "count": e.count,
        "generation": e.generation,
        "first_at_ms": e.first_at_ms,
        "last_at_ms": e.last_at_ms,
    })
}

pub fn events_json(run: &str, events: &[pb::Event]) -> Value {
    json!({
        "run": run,
        "events": events.iter().map(event_json).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64, reason: &str, node: &str, count: u32, warning: bool) -> pb::Event {
        pb::Event {
            seq,
            r#type: if warning {
                pb::EventType::Warning
            } else {
                pb::EventType::Normal
            } as i32,
            reason: reason.into(),
            message: format!("{reason} happened"),
            group_id: node.split('-').next().unwrap_or_default().into(),
            node_id: node.into(),
            attempt: if node.is_empty() { 0 } else { 2 },
            generation: 1,
            first_at_ms: 1_000,
            last_at_ms: 5_000,
            count,
            run_id: "r".into(),
        }
    }

    #[test]
    fn the_table_says_what_when_and_to_what() {
        let lines = events_table(
            &[
                event(1, "Applied", "", 1, false),
                event(2, "NodeLost", "workers-3", 1, true),
                event(3, "DependencyLost", "", 4, true),
            ],
            65_000,
        );
        assert!(lines[0].starts_with("LAST SEEN"), "{lines:?}");
        assert!(lines[1].contains("1m00s ago") && lines[1].contains("Normal") && lines[1].contains("run"));
        assert!(
            lines[2].contains("Warning")
                && lines[2].contains("NodeLost")
                && lines[2].contains("node/workers-3 (attempt 2)"),
            "{lines:?}"
        );
        assert!(lines[3].contains("(x4)"), "{lines:?}");
        assert_eq!(events_table(&[], 0), vec!["no events".to_owned()]);
    }

    #[test]
    fn a_followed_line_carries_a_utc_time_and_json_names_the_object() {
        let e = event(2, "NodeUnhealthy", "ctrl-0", 1, true);
        let line = event_line(&e);
        assert!(line.starts_with("1970-01-01T00:00:05Z"), "{line}");
        assert!(line.contains("node/ctrl-0 (attempt 2)"), "{line}");
        let v = event_json(&e);
        assert_eq!(v["node"], "ctrl-0");
        assert_eq!(v["group"], "ctrl");
        assert_eq!(v["type"], "Warning");
        let run = event_json(&event(1, "Applied", "", 1, false));
        assert!(run["node"].is_null() && run["attempt"].is_null());
    }
}
