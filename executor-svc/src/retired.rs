//! The attempts of one run whose lease was destroyed, kept in a size that
//! follows the run's live attempts rather than its history.
//!
//! An attempt retires when the driver acknowledges the `DestroyLease` that
//! removed its lease. From then on the driver can no longer resubmit any of
//! its operations: it acknowledges a result only after committing its fold,
//! which ends the attempt; it holds at most one pending operation per node,
//! so none of the attempt's is left; and after a restart or a failover it
//! resubmits only what its store holds pending. The attempt's completed
//! records go at that moment (see `RunState::retire` in [`crate::core`]).
//!
//! What stays is a defence against a driver that breaks that rule (a store
//! rolled back, a bug): a stray create for a retired attempt would make a
//! lease nobody destroys. So every retired attempt id stays refused, for as
//! long as the run is known, as one of a set of ranges. Attempt ids are unique
//! and increasing per run, so retired ids form runs of consecutive numbers
//! broken only by attempts still live (or ids the executor never saw): the
//! set holds at most one range per live attempt, plus one, however long the
//! run has lived.
//!
//! The digests of each operation id a retired attempt used are kept for the
//! [`Retired::RECENT`] most recent retirements only. Within them a
//! resubmitted id with other input is refused as a conflict, and a cleanup
//! of the attempt answered "already absent"; past them a resubmitted id is
//! refused or answered by its kind alone (the attempt's lease is gone either
//! way).

use std::collections::{BTreeMap, VecDeque};

use contract::{AttemptId, OperationId};

/// One retired attempt's operations: sequence number and input digest.
pub type Digests = BTreeMap<u32, u64>;

/// See the module documentation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Retired {
    /// Retired attempt ids as inclusive ranges, keyed by their first id.
    ranges: BTreeMap<u64, u64>,
    /// The digests of the most recently retired attempts.
    recent: BTreeMap<AttemptId, Digests>,
    /// `recent`'s attempts in the order they retired, oldest first.
    order: VecDeque<AttemptId>,
}

impl Retired {
    /// How many retired attempts keep their operations' digests.
    pub const RECENT: usize = 1024;

    pub fn contains(&self, attempt: AttemptId) -> bool {
        let a = attempt.get();
        self.ranges
            .range(..=a)
            .next_back()
            .is_some_and(|(_, last)| *last >= a)
    }

    /// Retires `attempt`, with the digests of the operations it used.
    pub fn retire(&mut self, attempt: AttemptId, digests: Digests) {
        self.insert_id(attempt.get());
        if self.recent.insert(attempt, digests).is_none() {
            self.order.push_back(attempt);
        }
        while self.order.len() > Self::RECENT {
            if let Some(oldest) = self.order.pop_front() {
                self.recent.remove(&oldest);
            }
        }
    }

    /// The input digest operation `id` used, if its attempt retired recently
    /// and used it.
    pub fn digest(&self, id: OperationId) -> Option<u64> {
        self.recent.get(&id.attempt())?.get(&id.seq()).copied()
    }

    /// Records that a retired attempt's operation `id` was answered, so that
    /// the same id with other input is refused later (while the attempt is
    /// among the recent ones).
    pub fn record(&mut self, id: OperationId, digest: u64) {
        if let Some(ops) = self.recent.get_mut(&id.attempt()) {
            ops.insert(id.seq(), digest);
        }
    }

    /// The retired ids as inclusive ranges, lowest first.
    pub fn ranges(&self) -> impl Iterator<Item = (AttemptId, AttemptId)> + '_ {
        self.ranges
            .iter()
            .map(|(first, last)| (AttemptId::new(*first), AttemptId::new(*last)))
    }

    /// The recent attempts' digests, oldest retirement first.
    pub fn recent(&self) -> impl Iterator<Item = (AttemptId, &Digests)> + '_ {
        self.order
            .iter()
            .filter_map(|a| self.recent.get(a).map(|ops| (*a, ops)))
    }

    /// Rebuilds the set from what [`Retired::ranges`] and [`Retired::recent`]
    /// returned. A recent attempt outside every range (a store written before
    /// the ranges were kept) is retired too.
    pub fn restore(
        ranges: impl IntoIterator<Item = (AttemptId, AttemptId)>,
        recent: impl IntoIterator<Item = (AttemptId, Digests)>,
    ) -> Self {
        let mut out = Self::default();
        for (first, last) in ranges {
            if first <= last {
                out.insert_range(first.get(), last.get());
            }
        }
        for (attempt, digests) in recent {
            out.retire(attempt, digests);
        }
        out
    }

    fn insert_id(&mut self, a: u64) {
        self.insert_range(a, a);
    }

    /// Adds `first..=last`, merging it with every range it overlaps or
    /// touches.
    fn insert_range(&mut self, mut first: u64, mut last: u64) {
        // A range that starts at or before `first` and reaches it (or the id
        // just before it) absorbs it.
        if let Some((&s, &e)) = self.ranges.range(..=first).next_back()
            && e.saturating_add(1) >= first
        {
            if e >= last {
                return;
            }
            first = s;
            self.ranges.remove(&s);
        }
        // Ranges that start inside `first..=last + 1` are absorbed.
        let touching: Vec<(u64, u64)> = self
            .ranges
            .range(first..=last.saturating_add(1))
            .map(|(s, e)| (*s, *e))
            .collect();
        for (s, e) in touching {
            self.ranges.remove(&s);
            last = last.max(e);
        }
        self.ranges.insert(first, last);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(n: u64) -> AttemptId {
        AttemptId::new(n)
    }

    fn ranges(r: &Retired) -> Vec<(u64, u64)> {
        r.ranges().map(|(f, l)| (f.get(), l.get())).collect()
    }

    #[test]
    fn ids_merge_into_ranges_whatever_the_order() {
        let mut r = Retired::default();
        for n in [5, 3, 4, 9, 1, 2, 7] {
            r.retire(a(n), Digests::new());
        }
        assert_eq!(ranges(&r), [(1, 5), (7, 7), (9, 9)]);
        r.retire(a(8), Digests::new());
        assert_eq!(ranges(&r), [(1, 5), (7, 9)]);
        r.retire(a(6), Digests::new());
        assert_eq!(ranges(&r), [(1, 9)]);
        for n in 1..=9 {
            assert!(r.contains(a(n)), "{n}");
        }
        assert!(!r.contains(a(10)));
        assert!(!r.contains(a(0)));
    }

    #[test]
    fn a_long_lived_run_holds_a_range_per_live_attempt() {
        // 100,000 attempts retire in turn while every hundredth stays live:
        // the set is a thousand ranges, and the digests stop at RECENT.
        let mut r = Retired::default();
        for n in 1..=100_000u64 {
            if n % 100 != 0 {
                r.retire(a(n), Digests::from([(0, n), (1, n + 1)]));
            }
        }
        assert_eq!(r.ranges().count(), 1000);
        assert_eq!(r.recent().count(), Retired::RECENT);
        assert!(r.contains(a(1)) && !r.contains(a(100)) && r.contains(a(99_999)));
        let id = |n, seq| OperationId::new(a(n), seq);
        assert_eq!(r.digest(id(99_999, 1)), Some(100_000));
        assert_eq!(r.digest(id(1, 0)), None, "the oldest digests are forgotten");
    }

    #[test]
    fn restore_gives_back_the_same_set() {
        let mut r = Retired::default();
        for n in [1, 2, 3, 10, 12] {
            r.retire(a(n), Digests::from([(0, n * 7)]));
        }
        r.record(OperationId::new(a(12), 4), 99);
        let again = Retired::restore(r.ranges(), r.recent().map(|(a, d)| (a, d.clone())));
        assert_eq!(again, r);
        // A store from before the ranges: the recent attempts alone.
        let old = Retired::restore([], [(a(4), Digests::new()), (a(5), Digests::new())]);
        assert_eq!(ranges(&old), [(4, 5)]);
    }
}
