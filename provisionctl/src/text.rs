//! Small text helpers shared by the renderers: aligned tables, durations,
//! times relative to the server's clock, progress bars and compact lists of
//! node slots.

use std::{collections::BTreeMap, fmt::Write as _, time::Duration};

/// Columns padded to their widest cell; the last column is not padded, so
/// lines carry no trailing spaces.
#[derive(Debug, Default)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Self {
            rows: vec![header.iter().map(|h| (*h).to_owned()).collect()],
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn lines(&self) -> Vec<String> {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        self.rows
            .iter()
            .map(|r| {
                let mut line = String::new();
                for (c, cell) in r.iter().enumerate() {
                    if c + 1 == r.len() {
                        line.push_str(cell);
                    } else {
                        let _ = write!(line, "{cell:<w$}  ", w = widths[c]);
                    }
                }
                line.trim_end().to_owned()
            })
            .collect()
    }
}

/// `850ms`, `12.3s`, `4m05s`, `2h03m`.
pub fn duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{:.1}s", d.as_secs_f64())
    } else if ms < 3_600_000 {
        let s = d.as_secs();
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        let m = d.as_secs() / 60;
        format!("{}h{:02}m", m / 60, m % 60)
    }
}

/// An age as kubectl shows one: the largest unit or two (`45s`, `3m12s`,
/// `5h20m`, `4d7h`).
pub fn age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// A wall-clock time (ms) relative to `now_ms`: `in 1.2s`, `3.0s ago`, or
/// `now`. Both times come from the server, so a skewed client clock does not
/// matter.
pub fn relative(at_ms: u64, now_ms: u64) -> String {
    if at_ms >= now_ms {
        let d = at_ms - now_ms;
        if d == 0 {
            "now".to_owned()
        } else {
            format!("in {}", duration(Duration::from_millis(d)))
        }
    } else {
        format!("{} ago", duration(Duration::from_millis(now_ms - at_ms)))
    }
}

/// A wall-clock time (ms since the Unix epoch) as UTC, to the second:
/// `2026-12-02T17:45:03Z`.
pub fn utc(at_ms: u64) -> String {
    let secs = at_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days to a civil date (proleptic Gregorian), after Howard Hinnant's
    // `civil_from_days`.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// `[########------------]` with `width` cells.
pub fn bar(done: u32, total: u32, width: usize) -> String {
    let filled = if total == 0 {
        width
    } else {
        let f = u64::from(done.min(total)) * width as u64 / u64::from(total);
        usize::try_from(f).unwrap_or(width)
    };
    format!("[{}{}]", "#".repeat(filled), "-".repeat(width - filled))
}

pub fn percent(done: u32, total: u32) -> u32 {
    if total == 0 {
        100
    } else {
        let p = u64::from(done.min(total)) * 100 / u64::from(total);
        u32::try_from(p).unwrap_or(100)
    }
}

/// Splits `group-7` into `("group", 7)`.
pub fn split_node(node: &str) -> Option<(&str, u32)> {
    let (group, index) = node.rsplit_once('-')?;
    Some((group, index.parse().ok()?))
}

/// Node ids as compact text: `workers-0..4, workers-7, gpu-2`. Runs of three
/// or more consecutive slots of a group become a range; groups keep the order
/// they first appear in.
pub fn node_list(nodes: &[String]) -> String {
    let mut order: Vec<&str> = Vec::new();
    let mut by_group: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    let mut odd: Vec<&str> = Vec::new();
    for n in nodes {
        match split_node(n) {
            Some((g, i)) => {
                if !by_group.contains_key(g) {
                    order.push(g);
                }
                by_group.entry(g).or_default().push(i);
            }
            None => odd.push(n),
        }
    }
    let mut parts: Vec<String> = Vec::new();
    for g in order {
        let Some(indices) = by_group.get_mut(g) else {
            continue;
        };
        indices.sort_unstable();
        indices.dedup();
        let mut i = 0;
        while i < indices.len() {
            let mut j = i;
            while j + 1 < indices.len() && indices[j + 1] == indices[j] + 1 {
                j += 1;
            }
            if j - i >= 2 {
                parts.push(format!("{g}-{}..{}", indices[i], indices[j]));
            } else {
                for k in &indices[i..=j] {
                    parts.push(format!("{g}-{k}"));
                }
            }
            i = j + 1;
        }
    }
    parts.extend(odd.into_iter().map(str::to_owned));
    parts.join(", ")
}

/// `1 node` / `3 nodes`.
pub fn nodes(n: usize) -> String {
    count(n, "node")
}

/// `1 group` / `2 groups`: a count with its noun, plural when it is not 1.
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Cuts a line to `width` characters, marking the cut.
pub fn clip(line: &str, width: usize) -> String {
    if line.chars().count() <= width || width < 2 {
        return line.to_owned();
    }
    let mut s: String = line.chars().take(width - 1).collect();
    s.push('…');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_kubectl_shows_them() {
        let s = Duration::from_secs;
        assert_eq!(age(s(45)), "45s");
        assert_eq!(age(s(192)), "3m12s");
        assert_eq!(age(s(5 * 3600 + 20 * 60 + 7)), "5h20m");
        assert_eq!(age(s(4 * 86_400 + 7 * 3600)), "4d7h");
    }

    #[test]
    fn utc_times_are_civil_dates() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_796_233_503_999), "2026-12-02T17:45:03Z");
        assert_eq!(utc(4_107_542_399_000), "2100-02-28T23:59:59Z");
    }

    #[test]
    fn tables_align_and_do_not_trail() {
        let mut t = Table::new(&["A", "LONGER", "C"]);
        t.row(vec!["xxxx".into(), "y".into(), String::new()]);
        assert_eq!(t.lines(), vec!["A     LONGER  C", "xxxx  y"]);
    }

    #[test]
    fn durations_and_relative_times() {
        assert_eq!(duration(Duration::from_millis(850)), "850ms");
        assert_eq!(duration(Duration::from_millis(12_345)), "12.3s");
        assert_eq!(duration(Duration::from_secs(245)), "4m05s");
        assert_eq!(duration(Duration::from_secs(7380)), "2h03m");
        assert_eq!(relative(2_500, 1_000), "in 1.5s");
        assert_eq!(relative(1_000, 4_000), "3.0s ago");
        assert_eq!(relative(5, 5), "now");
    }

    #[test]
    fn bars_fill_in_proportion() {
        assert_eq!(bar(0, 4, 8), "[--------]");
        assert_eq!(bar(2, 4, 8), "[####----]");
        assert_eq!(bar(9, 4, 8), "[########]");
        assert_eq!(bar(0, 0, 4), "[####]");
        assert_eq!(percent(1, 3), 33);
        assert_eq!(percent(0, 0), 100);
    }

    #[test]
    fn node_lists_compress_runs() {
        let ids: Vec<String> = ["w-0", "w-1", "w-2", "w-3", "w-5", "w-7", "w-8", "g-1", "odd"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        assert_eq!(node_list(&ids), "w-0..3, w-5, w-7, w-8, g-1, odd");
        assert_eq!(split_node("my-group-12"), Some(("my-group", 12)));
        assert_eq!(clip("abcdef", 4), "abc…");
        assert_eq!(nodes(1), "1 node");
    }
}
