//! `watch RUN`: the live progress view and its plain-line form.
//!
//! The view is a pure function of the latest status, the failing nodes (when
//! the run is small enough to fetch them) and the time, so it is tested
//! without a terminal. [`Painter`] puts frames on the screen: on a terminal
//! it redraws in place with two ANSI sequences (cursor up, clear line), with
//! no TUI library; otherwise it prints a line only when something changed,
//! so a log of a watch stays short and greppable.

use std::{
    collections::BTreeSet,
    io::{self, Write},
    time::Duration,
};

use contract::pb;

use super::{
    names,
    render::{desired, phase_text},
    text,
};

/// Above this many nodes the view does not fetch per-node detail: a run of
/// that size is summarized by group counts, and the server is spared a full
/// node listing every second.
pub const NODE_DETAIL_LIMIT: u32 = 2000;

/// How many failing nodes the live view lists before it summarizes.
const FAILING_SHOWN: usize = 8;

/// What the view knows about failing nodes.
#[derive(Debug, Clone, Default)]
pub enum Failing {
    /// Not fetched (yet), or nothing fails.
    #[default]
    Unknown,
    /// The run is too large to list them; the group counts stand in.
    TooLarge,
    /// The failing nodes, as of the server time `now_ms`.
    Nodes { nodes: Vec<pb::NodeStatus>, now_ms: u64 },
}

/// Whether a node counts as failing, as the server's group `failing` counts it.
pub fn is_failing(n: &pb::NodeStatus) -> bool {
    n.state.as_ref().is_some_and(|st| {
        let retry = st.retry.clone().unwrap_or_default();
        retry.consecutive_failures > 0
            || !retry.permanent_failure.is_empty()
            || st.stage == pb::NodeStage::Failed as i32
    })
}

/// One failing node in a sentence: attempt, failures, next retry, reason.
pub fn failing_line(n: &pb::NodeStatus, now_ms: u64) -> String {
    let st = n.state.clone().unwrap_or_default();
    let retry = st.retry.unwrap_or_default();
    let facts = st.facts.unwrap_or_default();
    if !retry.permanent_failure.is_empty() {
        return format!(
            "{} attempt {}, permanent: {}",
            st.node_id, st.attempt, retry.permanent_failure
        );
    }
    let next = {
        [retry.next_effect_at_ms, retry.restart_at_ms]
            .into_iter()
            .filter(|t| *t > 0)
            .min()
            .map_or_else(
                || "retrying".to_owned(),
                |t| format!("next try {}", text::relative(t, now_ms)),
            )
    };
    let reason = if !facts.failure_reason.is_empty() {
        facts.failure_reason
    } else {
        names::stage(st.stage).to_owned()
    };
    let failures = match retry.consecutive_failures {
        0 => String::new(),
        1 => ", 1 failure".to_owned(),
        k => format!(", {k} failures"),
    };
    format!(
        "{} attempt {}{failures}, {next}: {reason}",
        st.node_id, st.attempt
    )
}

/// Stage counts in path order, `new=1 bootstrapping=2 ready=3`.
fn stages(g: &pb::GroupStatus) -> String {
    let mut v: Vec<&pb::StageCount> = g.stages.iter().collect();
    v.sort_by_key(|c| names::stage_order(c.stage));
    let parts: Vec<String> = v
        .iter()
        .map(|c| format!("{}={}", names::stage(c.stage), c.count))
        .collect();
    if parts.is_empty() {
        "-".to_owned()
    } else {
        parts.join(" ")
    }
}

fn head(s: &pb::RunStatus) -> String {
    format!(
        "run {} · generation {} · {} · {}/{} ready · {} pending",
        s.run_id,
        s.generation,
        phase_text(s),
        s.ready_count,
        desired(s),
        s.pending_operations
    )
}

/// The live view's frame.
pub fn frame(s: &pb::RunStatus, failing: &Failing, elapsed: Duration) -> Vec<String> {
    let mut out = vec![format!("{} · {}", head(s), text::duration(elapsed))];
    if s.paused {
        out.push("paused: nothing new is dispatched; operations in flight finish".to_owned());
    }
    let mut t = text::Table::new(&["GROUP", "READY", "PROGRESS", "FAILING", "UNHEALTHY", "STAGES"]);
    for g in &s.groups {
        t.row(vec![
            g.group_id.clone(),
            format!("{}/{}", g.ready, g.desired),
            format!(
                "{} {:>3}%",
                text::bar(g.ready, g.desired, 20),
                text::percent(g.ready, g.desired)
            ),
            g.failing.to_string(),
            unhealthy(g),
            stages(g),
        ]);
    }
    out.extend(t.lines());
    if let Some(d) = degraded(s) {
        out.push(d);
    }
    let failing_total: u32 = s.groups.iter().map(|g| g.failing).sum();
    if failing_total > 0 {
        match failing {
            Failing::Nodes { nodes, now_ms } if !nodes.is_empty() => {
                let permanent = nodes.iter().any(|n| {
                    n.state
                        .as_ref()
                        .and_then(|st| st.retry.as_ref())
                        .is_some_and(|r| !r.permanent_failure.is_empty())
                });
                out.push(format!(
                    "failing ({}){}:",
                    text::nodes(nodes.len()),
                    if permanent {
                        "; a permanent failure is retried only after its group's template changes"
                    } else {
                        ""
                    }
                ));
                for n in nodes.iter().take(FAILING_SHOWN) {
                    out.push(format!("  {}", failing_line(n, *now_ms)));
                }
                if nodes.len() > FAILING_SHOWN {
                    out.push(format!(
                        "  … and {} more (provisionctl get {} --nodes)",
                        nodes.len() - FAILING_SHOWN,
                        s.run_id
                    ));
                }
            }
            Failing::TooLarge => out.push(format!(
                "failing: {} (too many nodes to list live; provisionctl get {} --nodes)",
                text::nodes(failing_total as usize),
                s.run_id
            )),
            _ => out.push(format!("failing: {}", text::nodes(failing_total as usize))),
        }
    }
    out
}

/// The plain form's status line; printed only when it changes, so it leaves
/// out anything that moves by itself (elapsed time, relative deadlines).
pub fn plain_status(s: &pb::RunStatus) -> String {
    let groups: Vec<String> = s
        .groups
        .iter()
        .map(|g| {
            let failing = if g.failing > 0 {
                format!(" failing={}", g.failing)
            } else {
                String::new()
            };
            let unhealthy = if g.unhealthy > 0 {
                format!(" unhealthy={}", unhealthy(g))
            } else {
                String::new()
            };
            format!(
                "{} {}/{} {}{failing}{unhealthy}",
                g.group_id,
                g.ready,
                g.desired,
                stages(g)
            )
        })
        .collect();
    let mut line = format!("{} | {}", head(s), groups.join(" | "));
    if let Some(d) = degraded(s) {
        line.push_str(" | ");
        line.push_str(&d);
    }
    line
}

/// A group's unhealthy (or lost) nodes, with how many the budget holds.
fn unhealthy(g: &pb::GroupStatus) -> String {
    if g.remediation_held > 0 {
        format!("{}({} held)", g.unhealthy, g.remediation_held)
    } else {
        g.unhealthy.to_string()
    }
}

/// `degraded: <why>` while the run's `Degraded` condition is true: lost or
/// unhealthy nodes, or a service it depends on that is down.
fn degraded(s: &pb::RunStatus) -> Option<String> {
    crate::render::condition(s, "Degraded").map(|c| format!("degraded ({}): {}", c.reason, c.message))
}

/// A failing node's identity for the plain form: a node is printed again only
/// when its attempt, failure count or reason changes.
pub fn failing_key(n: &pb::NodeStatus) -> String {
    let st = n.state.clone().unwrap_or_default();
    let retry = st.retry.unwrap_or_default();
    let facts = st.facts.unwrap_or_default();
    format!(
        "{}/{}/{}/{}/{}",
        st.node_id, st.attempt, retry.consecutive_failures, retry.permanent_failure, facts.failure_reason
    )
}

/// Draws frames: in place on a terminal, or as changed lines otherwise.
#[derive(Debug)]
pub struct Painter<W: Write> {
    out: W,
    live: bool,
    width: usize,
    drawn: usize,
    last_status: String,
    printed_failing: BTreeSet<String>,
}

impl<W: Write> Painter<W> {
    pub fn new(out: W, live: bool, width: usize) -> Self {
        Self {
            out,
            live,
            width,
            drawn: 0,
            last_status: String::new(),
            printed_failing: BTreeSet::new(),
        }
    }

    pub fn is_live(&self) -> bool {
        self.live
    }

    /// Shows the current state.
    pub fn draw(&mut self, s: &pb::RunStatus, failing: &Failing, elapsed: Duration) -> io::Result<()> {
        if self.live {
            self.draw_live(&frame(s, failing, elapsed))
        } else {
            self.draw_plain(s, failing, elapsed)
        }
    }

    fn draw_live(&mut self, lines: &[String]) -> io::Result<()> {
        let mut buf = String::new();
        if self.drawn > 0 {
            // Back to the first line of the previous frame.
            buf.push_str(&format!("\x1b[{}A", self.drawn));
        }
        for l in lines {
            // Clipped to the width: a wrapped line would take two rows and
            // the next cursor-up would land one row short.
            buf.push_str("\r\x1b[2K");
            buf.push_str(&text::clip(l, self.width.saturating_sub(1)));
            buf.push('\n');
        }
        if lines.len() < self.drawn {
            // Erase what is left of a longer previous frame.
            buf.push_str("\x1b[J");
        }
        self.drawn = lines.len();
        self.out.write_all(buf.as_bytes())?;
        self.out.flush()
    }

    fn draw_plain(&mut self, s: &pb::RunStatus, failing: &Failing, elapsed: Duration) -> io::Result<()> {
        let stamp = format!("[{:>7}]", text::duration(elapsed));
        let status = plain_status(s);
        if status != self.last_status {
            writeln!(self.out, "{stamp} {status}")?;
            self.last_status = status;
        }
        if let Failing::Nodes { nodes, now_ms } = failing {
            let keys: BTreeSet<String> = nodes.iter().map(failing_key).collect();
            for n in nodes {
                if !self.printed_failing.contains(&failing_key(n)) {
                    writeln!(self.out, "{stamp}   failing {}", failing_line(n, *now_ms))?;
                }
            }
            self.printed_failing = keys;
        }
        self.out.flush()
    }

    /// A message after the last frame.
    pub fn say(&mut self, line: &str) -> io::Result<()> {
        writeln!(self.out, "{line}")?;
        self.out.flush()
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::render::tests::{failing_node, status};

    #[test]
    fn the_frame_shows_groups_progress_failures_and_time() {
        let s = status();
        let failing = Failing::Nodes {
            nodes: vec![failing_node()],
            now_ms: 10_000,
        };
        let lines = frame(&s, &failing, Duration::from_millis(12_300));
        let text = lines.join("\n");
        assert!(
            text.starts_with("run demo · generation 2 · progressing · 4/6 ready · 1 pending · 12.3s"),
            "{text}"
        );
        assert!(
            text.contains("workers  2/4    [##########----------]  50%  1        1(1 held)"),
            "{text}"
        );
        assert!(
            text.contains("gpu      2/2    [####################] 100%  0        0"),
            "{text}"
        );
        assert!(!text.contains("degraded"), "{text}");
        let mut sick = s.clone();
        sick.conditions.push(pb::Condition {
            r#type: "Degraded".into(),
            status: true,
            reason: "NodesUnhealthy".into(),
            message: "unhealthy: workers-1".into(),
            ..Default::default()
        });
        let sick_text = frame(&sick, &Failing::Unknown, Duration::ZERO).join("\n");
        assert!(
            sick_text.contains("degraded (NodesUnhealthy): unhealthy: workers-1"),
            "{sick_text}"
        );
        assert!(plain_status(&sick).ends_with("| degraded (NodesUnhealthy): unhealthy: workers-1"));
        assert!(
            plain_status(&sick).contains("unhealthy=1(1 held)"),
            "{}",
            plain_status(&sick)
        );
        assert!(text.contains("new=2 ready=2"), "{text}");
        assert!(
            text.contains("workers-3 attempt 7, 3 failures, next try in 1.5s: quota refused"),
            "{text}"
        );
        let mut permanent = failing_node();
        if let Some(st) = permanent.state.as_mut() {
            st.retry = Some(pb::RetryState {
                consecutive_failures: 1,
                permanent_failure: "invalid image".into(),
                ..Default::default()
            });
        }
        assert_eq!(
            failing_line(&permanent, 10_000),
            "workers-3 attempt 7, permanent: invalid image"
        );
        let text = frame(
            &s,
            &Failing::Nodes {
                nodes: vec![permanent],
                now_ms: 10_000,
            },
            Duration::ZERO,
        )
        .join("\n");
        assert!(
            text.contains("retried only after its group's template changes"),
            "{text}"
        );
        let big = frame(&s, &Failing::TooLarge, Duration::ZERO).join("\n");
        assert!(
            big.contains("failing: 1 node (too many nodes to list live"),
            "{big}"
        );
    }

    #[test]
    fn live_painting_moves_up_and_clears() {
        let mut p = Painter::new(Vec::new(), true, 200);
        let s = status();
        p.draw(&s, &Failing::Unknown, Duration::from_secs(1)).unwrap();
        p.draw(&s, &Failing::Unknown, Duration::from_secs(2)).unwrap();
        let out = String::from_utf8(p.into_inner()).unwrap();
        let n = frame(&s, &Failing::Unknown, Duration::ZERO).len();
        assert_eq!(out.matches(&format!("\x1b[{n}A")).count(), 1, "{out:?}");
        assert_eq!(out.matches("\x1b[2K").count(), 2 * n, "{out:?}");
        assert!(out.contains("1.0s") && out.contains("2.0s"));
    }

    #[test]
    fn live_lines_are_clipped_to_the_terminal() {
        let mut p = Painter::new(Vec::new(), true, 20);
        p.draw(&status(), &Failing::Unknown, Duration::ZERO).unwrap();
        let out = String::from_utf8(p.into_inner()).unwrap();
        for l in out.split('\n') {
            let visible = l.replace("\r\x1b[2K", "");
            assert!(visible.chars().count() <= 19, "{visible:?}");
        }
    }

    #[test]
    fn plain_lines_only_when_something_changed() {
        let mut p = Painter::new(Vec::new(), false, 80);
        let mut s = status();
        let failing = Failing::Nodes {
            nodes: vec![failing_node()],
            now_ms: 10_000,
        };
        p.draw(&s, &failing, Duration::from_secs(1)).unwrap();
        p.draw(&s, &failing, Duration::from_secs(2)).unwrap();
        s.ready_count = 5;
        p.draw(&s, &failing, Duration::from_secs(3)).unwrap();
        let out = String::from_utf8(p.into_inner()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(
            lines[0].contains("4/6 ready") && lines[0].starts_with("[   1.0s]"),
            "{out}"
        );
        assert!(lines[1].contains("failing workers-3 attempt 7"), "{out}");
        assert!(lines[2].contains("5/6 ready"), "{out}");
        assert!(!out.contains('\x1b'), "no escapes when not a terminal");
    }
}
