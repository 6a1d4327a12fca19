//! Named crash points: the driver can be told to die at an exact moment of
//! its work, so crash tests can restart it from its store at each of them.
//!
//! A point is armed at start (`--crash-at <point>[:<n>]`) and fires on its
//! `n`-th hit (the first by default): the process aborts on the spot, without
//! unwinding, flushing or closing anything, as a power cut or SIGKILL would
//! leave it. Nothing is armed unless the flag is given; an unarmed point costs
//! one relaxed atomic load.

use std::sync::{
    OnceLock,
    atomic::{AtomicU64, Ordering},
};

/// Where the driver can be made to crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// A shape was accepted and committed; the client has not been answered.
    ApplyCommitted,
    /// A pass's decisions came back from the decider; nothing is applied yet
    /// (mid-pass).
    PassDecided,
    /// A pass's operations are recorded pending and committed; none is
    /// dispatched yet.
    PassRecorded,
    /// The first of a pass's operations was dispatched, the rest not yet.
    PassDispatchedOne,
    /// Every operation of a pass was dispatched.
    PassDispatched,
    /// Folds were committed; their acknowledgements are not sent yet.
    FoldCommitted,
    /// A deletion was accepted and committed; the client has not been answered.
    DeleteCommitted,
    /// A pass of a run being deleted recorded its cleanup operations; none is
    /// dispatched yet (mid-deletion).
    DeletingRecorded,
}

impl Point {
    pub const ALL: [Point; 8] = [
        Point::ApplyCommitted,
        Point::PassDecided,
        Point::PassRecorded,
        Point::PassDispatchedOne,
        Point::PassDispatched,
        Point::FoldCommitted,
        Point::DeleteCommitted,
        Point::DeletingRecorded,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Point::ApplyCommitted => "apply-committed",
            Point::PassDecided => "pass-decided",
            Point::PassRecorded => "pass-recorded",
            Point::PassDispatchedOne => "pass-dispatched-one",
            Point::PassDispatched => "pass-dispatched",
            Point::FoldCommitted => "fold-committed",
            Point::DeleteCommitted => "delete-committed",
            Point::DeletingRecorded => "deleting-recorded",
        }
    }
}

/// An armed point: which, and on which hit it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Armed {
    pub point: Point,
    pub nth: u64,
}

/// Parses `<point>[:<n>]`, `n` ≥ 1.
pub fn parse(spec: &str) -> Result<Armed, String> {
    let (name, nth) = match spec.split_once(':') {
        Some((name, n)) => {
            let nth = n
                .parse::<u64>()
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| format!("--crash-at {spec}: the hit count must be a whole number ≥ 1"))?;
            (name, nth)
        }
        None => (spec, 1),
    };
    let point = Point::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
        let names: Vec<&str> = Point::ALL.iter().map(|p| p.name()).collect();
        format!("--crash-at {spec}: unknown point; one of {}", names.join(", "))
    })?;
    Ok(Armed { point, nth })
}

static ARMED: OnceLock<Armed> = OnceLock::new();
static HITS: AtomicU64 = AtomicU64::new(0);

/// Arms one point for the life of the process. Returns false if one was
/// armed already.
pub fn arm(armed: Armed) -> bool {
    ARMED.set(armed).is_ok()
}

/// Marks that `point` was reached; aborts the process if it is the armed
/// point's `n`-th hit.
pub fn hit(point: Point) {
    let Some(armed) = ARMED.get() else {
        return;
    };
    if armed.point != point {
        return;
    }
    let n = HITS.fetch_add(1, Ordering::Relaxed) + 1;
    if n == armed.nth {
        eprintln!("crash point {} reached (hit {n}): aborting", point.name());
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn specs_parse_with_and_without_a_count() {
        assert_eq!(
            parse("pass-recorded").unwrap(),
            Armed {
                point: Point::PassRecorded,
                nth: 1
            }
        );
        assert_eq!(
            parse("deleting-recorded:3").unwrap(),
            Armed {
                point: Point::DeletingRecorded,
                nth: 3
            }
        );
        for p in Point::ALL {
            assert_eq!(parse(p.name()).unwrap().point, p);
        }
    }

    #[test]
    fn bad_specs_name_what_is_wrong() {
        assert!(parse("nowhere").unwrap_err().contains("unknown point"));
        assert!(parse("pass-recorded:0").unwrap_err().contains("≥ 1"));
        assert!(parse("pass-recorded:x").unwrap_err().contains("≥ 1"));
    }
}
