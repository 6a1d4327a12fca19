//! The driver's admission limit: how many operations all its runs together
//! may have pending at once (`--max-operations-in-flight`).
//!
//! Every operation carries a deadline from its dispatch, and the executor
//! abandons one still unstarted at its deadline. A driver that dispatched
//! everything its passes decided would, past what the executor and the
//! provider get through before those deadlines, see operations expire in
//! queues, fail, back off and go again: more work for the same nodes, and
//! memory in all three services for work that cannot start. With the limit,
//! what is not admitted is not recorded at all; the node waits in its run
//! (`RunState::set_dispatch_room`) and is decided again when there is room.
//!
//! Each run actor states what it holds (its pending operations, and the room
//! reserved for a pass in flight) as an absolute figure, so the books cannot
//! drift whatever a run does between two statements. A run reserves room
//! before a pass and states what it holds after; the room it did not use goes
//! back then. A run refused room waits from that moment, and says after its
//! pass whether nodes still wait. While other runs wait for room, a run is
//! granted at most an even share of the limit, and nothing until a quarter
//! of that share (or all it wants, if less) is free for it: a pass is then
//! worth its fixed cost. Alone, a run may take all the room there is, in
//! steps of a quarter of the limit (or all it wants, if less; what the
//! steps bought is in docs/driver.md). When room comes back and some run
//! waits, the waiting runs are woken ([`Admission::freed`]); a run granted
//! nothing waits on. Room cannot stay short of a step for good: what runs
//! hold settles, and with nothing held all of the limit is free.

use std::{collections::HashMap, sync::Mutex};

use contract::RunUid;
use tokio::sync::watch;

/// The limit unless configured: enough to keep the executor busy (at the
/// bench's 86,000 round trips a second, a few seconds of work), few enough
/// that the operations a pass dispatches start well inside the default
/// 60-second deadline.
pub const DEFAULT_MAX_OPERATIONS_IN_FLIGHT: usize = 10_000;

/// Room is granted in steps of at least this part of a run's share (the
/// whole limit for a run alone).
const STEPS_A_SHARE: usize = 4;

/// What each run holds against the limit, and who waits for room.
#[derive(Debug, Default)]
struct Books {
    holding: HashMap<RunUid, usize>,
    total: usize,
    /// Runs waiting for room, with how many nodes each holds for it as it
    /// last said (0: refused room, and not settled since).
    waiting: HashMap<RunUid, usize>,
}

impl Books {
    fn set(&mut self, run: RunUid, holding: usize) -> usize {
        let before = self.holding.insert(run, holding).unwrap_or(0);
        self.total = self.total - before + holding;
        before
    }
}

#[derive(Debug)]
pub struct Admission {
    /// `None`: no limit.
    limit: Option<usize>,
    books: Mutex<Books>,
    freed: watch::Sender<u64>,
}

impl Admission {
    pub fn new(limit: Option<usize>) -> Self {
        Self {
            limit: limit.filter(|l| *l > 0),
            books: Mutex::new(Books::default()),
            freed: watch::channel(0).0,
        }
    }

    pub fn limit(&self) -> Option<usize> {
        self.limit
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        // The books are absolute figures each run restates: a panic while
        // they were held leaves them consistent enough to go on with.
        self.books
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Room for `run`'s next pass, which holds `holding` operations now and
    /// could use `want` more: `None` without a limit. The room granted is
    /// counted as held until the run's next [`Admission::settle`].
    pub fn reserve(&self, run: RunUid, holding: usize, want: usize) -> Option<usize> {
        let limit = self.limit?;
        let mut books = self.books();
        books.set(run, holding);
        let free = limit.saturating_sub(books.total);
        let others = books.waiting.keys().filter(|r| **r != run).count();
        // With others waiting, an even share among them and this run; alone,
        // all the room there is. Either way in steps worth a pass: a quarter
        // of the share (or all the run wants, if less). Room that comes back
        // an operation at a time would otherwise buy a waiting run a pass
        // (a `Decide` call, a commit, a batch on the link) for an operation
        // or two each.
        let (share, step) = if others > 0 {
            let even = (limit / (others + 1)).max(1);
            (
                even.saturating_sub(holding),
                want.min(even.div_ceil(STEPS_A_SHARE)),
            )
        } else {
            (usize::MAX, want.min(limit.div_ceil(STEPS_A_SHARE)))
        };
        let granted = free.min(want).min(share);
        let granted = if granted < step { 0 } else { granted };
        books.set(run, holding + granted);
        // Short of what it wants, the run waits from now on, under the same
        // lock: room given back after this moment wakes it, and room given
        // back before it was free for this reservation to take.
        if granted < want {
            books.waiting.entry(run).or_insert(0);
        }
        Some(granted)
    }

    /// `run` holds `holding` operations, and `held_nodes` nodes wait in it
    /// for room. Room given back wakes the waiting runs.
    pub fn settle(&self, run: RunUid, holding: usize, held_nodes: usize) {
        if self.limit.is_none() {
            return;
        }
        let mut books = self.books();
        let before = books.set(run, holding);
        if held_nodes > 0 {
            books.waiting.insert(run, held_nodes);
        } else {
            books.waiting.remove(&run);
        }
        let others_wait = books.waiting.keys().any(|r| *r != run);
        drop(books);
        if holding < before && others_wait {
            self.freed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// `run` is gone or stopped: what it held goes back.
    pub fn forget(&self, run: RunUid) {
        if self.limit.is_none() {
            return;
        }
        let mut books = self.books();
        let before = books.set(run, 0);
        books.holding.remove(&run);
        books.waiting.remove(&run);
        let wake = before > 0 && !books.waiting.is_empty();
        drop(books);
        if wake {
            self.freed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Moves whenever room comes back while some run waits for it.
    pub fn freed(&self) -> watch::Receiver<u64> {
        self.freed.subscribe()
    }

    /// Operations held against the limit, all runs together.
    pub fn holding(&self) -> usize {
        self.books().total
    }

    /// Nodes waiting for room, all runs together.
    pub fn held_nodes(&self) -> usize {
        self.books().waiting.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uid(n: u128) -> RunUid {
        RunUid::from_u128(n)
    }

    #[test]
    fn without_a_limit_everything_is_admitted_and_nothing_is_kept() {
        let a = Admission::new(None);
        assert_eq!(a.reserve(uid(1), 5, 1_000_000), None);
        a.settle(uid(1), 7, 1);
        assert_eq!((a.holding(), a.held_nodes()), (0, 0));
        // Zero means no limit too, as on the command line.
        assert_eq!(Admission::new(Some(0)).limit(), None);
    }

    #[test]
    fn a_reservation_is_held_until_the_run_settles_and_never_exceeds_the_limit() {
        let a = Admission::new(Some(10));
        assert_eq!(a.reserve(uid(1), 0, 6), Some(6));
        assert_eq!(a.holding(), 6);
        // The second run gets what is left, not what it wants.
        assert_eq!(a.reserve(uid(2), 0, 6), Some(4));
        assert_eq!(a.holding(), 10);
        assert_eq!(a.reserve(uid(3), 0, 1), Some(0));
        // The first used 3 of its 6: the rest comes back.
        a.settle(uid(1), 3, 0);
        assert_eq!(a.holding(), 7);
        assert_eq!(a.reserve(uid(3), 0, 5), Some(3));
        assert_eq!(a.holding(), 10);
    }

    #[test]
    fn statements_are_absolute_so_the_books_cannot_drift() {
        let a = Admission::new(Some(100));
        a.settle(uid(1), 40, 0);
        a.settle(uid(1), 40, 0);
        a.settle(uid(2), 10, 0);
        assert_eq!(a.holding(), 50);
        a.settle(uid(1), 0, 0);
        assert_eq!(a.holding(), 10);
        a.forget(uid(2));
        assert_eq!(a.holding(), 0);
    }

    #[test]
    fn with_others_waiting_a_run_gets_an_even_share() {
        let a = Admission::new(Some(100));
        // Two runs wait with nothing held.
        a.settle(uid(2), 0, 5);
        a.settle(uid(3), 0, 7);
        assert_eq!(a.held_nodes(), 12);
        // A third asks for everything: a third of the limit.
        assert_eq!(a.reserve(uid(1), 0, 1_000), Some(33));
        // Already holding its share, it gets nothing more.
        a.settle(uid(1), 33, 1);
        assert_eq!(a.reserve(uid(1), 33, 1_000), Some(0));
        // The waiting ones get theirs.
        assert_eq!(a.reserve(uid(2), 0, 1_000), Some(33));
        // Alone, a run takes all the room there is.
        let alone = Admission::new(Some(100));
        assert_eq!(alone.reserve(uid(1), 0, 1_000), Some(100));
    }

    #[test]
    fn with_others_waiting_room_comes_in_steps_worth_a_pass() {
        let a = Admission::new(Some(100));
        a.settle(uid(2), 0, 5);
        a.settle(uid(3), 0, 7);
        // A share is 33, a step 9: 3 short of its share, a run waits on.
        a.settle(uid(1), 30, 1);
        assert_eq!(a.reserve(uid(1), 30, 1_000), Some(0));
        assert_eq!(a.holding(), 30);
        a.settle(uid(1), 24, 1);
        assert_eq!(a.reserve(uid(1), 24, 1_000), Some(9));
        // A run that wants less than a step gets all it wants.
        assert_eq!(a.reserve(uid(2), 0, 2), Some(2));
        // Short of free room rather than of its share, likewise.
        let b = Admission::new(Some(100));
        b.settle(uid(2), 0, 5);
        b.settle(uid(1), 95, 0);
        // A share is 50, a step 13.
        assert_eq!(b.reserve(uid(3), 0, 40), Some(0));
        b.settle(uid(1), 90, 0);
        assert_eq!(b.reserve(uid(3), 0, 40), Some(0));
        b.settle(uid(1), 80, 0);
        assert_eq!(b.reserve(uid(3), 0, 40), Some(20));
        // Alone, a run takes room in steps of a quarter of the limit, or
        // all it wants if less.
        let alone = Admission::new(Some(100));
        alone.settle(uid(1), 99, 1);
        assert_eq!(alone.reserve(uid(1), 99, 1_000), Some(0));
        alone.settle(uid(1), 76, 1);
        assert_eq!(alone.reserve(uid(1), 76, 1_000), Some(0));
        alone.settle(uid(1), 75, 1);
        assert_eq!(alone.reserve(uid(1), 75, 1_000), Some(25));
        alone.settle(uid(1), 99, 1);
        assert_eq!(alone.reserve(uid(1), 99, 1), Some(1));
    }

    #[test]
    fn a_run_refused_room_waits_from_that_moment() {
        let a = Admission::new(Some(4));
        a.settle(uid(1), 4, 0);
        let mut freed = a.freed();
        // Run 2 is refused: it waits before it has said so itself.
        assert_eq!(a.reserve(uid(2), 0, 3), Some(0));
        a.settle(uid(1), 0, 0);
        assert!(freed.has_changed().unwrap_or(false), "the refused run is woken");
        freed.borrow_and_update();
        // Granted all it wanted, it does not wait.
        assert_eq!(a.reserve(uid(2), 0, 3), Some(3));
        a.settle(uid(2), 3, 0);
        a.settle(uid(2), 0, 0);
        assert!(!freed.has_changed().unwrap_or(true), "nobody waits");
    }

    #[test]
    fn room_given_back_wakes_the_runs_that_wait_and_only_then() {
        let a = Admission::new(Some(10));
        let mut freed = a.freed();
        a.settle(uid(1), 10, 0);
        // Nobody waits: giving back wakes nobody.
        a.settle(uid(1), 9, 0);
        assert!(!freed.has_changed().unwrap_or(true));
        a.settle(uid(2), 0, 1);
        a.settle(uid(1), 5, 0);
        assert!(freed.has_changed().unwrap_or(false));
        freed.borrow_and_update();
        // Holding more wakes nobody.
        a.settle(uid(1), 8, 0);
        assert!(!freed.has_changed().unwrap_or(true));
        // A run that goes away gives back what it held.
        a.forget(uid(1));
        assert!(freed.has_changed().unwrap_or(false));
        assert_eq!(a.holding(), 0);
    }
}
