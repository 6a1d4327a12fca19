//! Group commit: the commits of many runs that wait for the store at once
//! written together, in one transaction.
//!
//! Each run's commits are written from that run's own blocking thread, and
//! an embedded store takes one write transaction at a time: a hundred runs
//! committing together each waited for the others' transactions, and each
//! paid a transaction's fixed cost (its pages written, one `fdatasync`).
//! Here the first caller to find no write under way writes everything queued
//! by then, its own commit included, in one call; whoever arrives meanwhile
//! queues and waits, and the next of them to find the writer free writes all
//! that queued in the meantime. A commit alone is written at once, as before;
//! under load a commit waits for at most the write under way and its own.
//!
//! The writer answers each commit on its own (one may be refused while the
//! others land, see `durable`); a write that fails as a whole fails every
//! commit it held.

use std::{
    collections::HashMap,
    sync::{Condvar, Mutex, MutexGuard, PoisonError},
};

use crate::core::StoreError;

/// Commits of type `T` waiting for one writer.
#[derive(Debug)]
pub struct GroupCommit<T> {
    state: Mutex<State<T>>,
    written: Condvar,
}

#[derive(Debug)]
struct State<T> {
    queue: Vec<(u64, T)>,
    /// A caller is writing a group.
    writing: bool,
    /// Answers for commits written, until their callers take them.
    answers: HashMap<u64, Result<(), StoreError>>,
    next: u64,
}

impl<T> Default for GroupCommit<T> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                queue: Vec::new(),
                writing: false,
                answers: HashMap::new(),
                next: 0,
            }),
            written: Condvar::new(),
        }
    }
}

impl<T> GroupCommit<T> {
    /// Commits `item`, blocking until it is written. `write` writes a group
    /// (this caller's `item` among others) and answers each in order; only
    /// the caller that writes a group calls it, once.
    pub fn commit(
        &self,
        item: T,
        write: impl FnOnce(Vec<T>) -> Vec<Result<(), StoreError>>,
    ) -> Result<(), StoreError> {
        let mut state = self.lock();
        let ticket = state.next;
        state.next += 1;
        state.queue.push((ticket, item));
        loop {
            if let Some(answer) = state.answers.remove(&ticket) {
                return answer;
            }
            if !state.writing {
                // The queue holds this caller's commit: another writer
                // would have answered it before leaving `writing`.
                let group = std::mem::take(&mut state.queue);
                state.writing = true;
                drop(state);
                return self.write_group(ticket, group, write);
            }
            state = self.written.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn write_group(
        &self,
        ticket: u64,
        group: Vec<(u64, T)>,
        write: impl FnOnce(Vec<T>) -> Vec<Result<(), StoreError>>,
    ) -> Result<(), StoreError> {
        let (tickets, items): (Vec<u64>, Vec<T>) = group.into_iter().unzip();
        // Whatever `write` does (it may panic), the group is answered and the
        // writer freed: waiting callers must not wait for good.
        let mut guard = Answer {
            group: self,
            tickets,
            answers: None,
        };
        guard.answers = Some(write(items));
        drop(guard);
        let mut state = self.lock();
        state.answers.remove(&ticket).unwrap_or_else(|| {
            Err(StoreError::Unavailable(
                "the store's writer gave no answer for a commit".into(),
            ))
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Commits queued and not yet taken by a writer.
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.lock().queue.len()
    }
}

/// Answers a written group's commits and frees the writer when dropped.
struct Answer<'a, T> {
    group: &'a GroupCommit<T>,
    tickets: Vec<u64>,
    answers: Option<Vec<Result<(), StoreError>>>,
}

impl<T> Drop for Answer<'_, T> {
    fn drop(&mut self) {
        let mut answers = self.answers.take().unwrap_or_default().into_iter();
        let mut state = self.group.lock();
        for &ticket in &self.tickets {
            let answer = answers.next().unwrap_or_else(|| {
                Err(StoreError::Unavailable(
                    "the store's writer stopped before it answered".into(),
                ))
            });
            state.answers.insert(ticket, answer);
        }
        state.writing = false;
        drop(state);
        self.group.written.notify_all();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::{
        sync::{Arc, mpsc},
        thread,
        time::Duration,
    };

    use super::*;

    /// Waits (a bounded while) until `f` holds.
    fn eventually(f: impl Fn() -> bool) {
        for _ in 0..2_000 {
            if f() {
                return;
            }
            thread::sleep(Duration::from_millis(1));
        }
        panic!("the condition never held");
    }

    #[test]
    fn commits_that_queue_behind_a_write_are_written_together() {
        let group = Arc::new(GroupCommit::<u32>::default());
        let (release, blocked) = mpsc::channel::<()>();
        let (groups_tx, groups) = mpsc::channel::<Vec<u32>>();

        // The first commit writes alone, and its write waits to be released.
        let first = {
            let (group, groups_tx) = (Arc::clone(&group), groups_tx.clone());
            thread::spawn(move || {
                group.commit(0, |items| {
                    groups_tx.send(items.clone()).unwrap();
                    blocked.recv().unwrap();
                    items.iter().map(|_| Ok(())).collect()
                })
            })
        };
        assert_eq!(groups.recv().unwrap(), [0]);
        // Three more arrive while it writes: they queue.
        let later: Vec<_> = (1..=3)
            .map(|i| {
                let (group, groups_tx) = (Arc::clone(&group), groups_tx.clone());
                thread::spawn(move || {
                    group.commit(i, |items| {
                        groups_tx.send(items.clone()).unwrap();
                        // The second commit is refused; the others land.
                        items
                            .iter()
                            .map(|&i| {
                                if i == 2 {
                                    Err(StoreError::Corrupt("two".into()))
                                } else {
                                    Ok(())
                                }
                            })
                            .collect()
                    })
                })
            })
            .collect();
        eventually(|| group.queued() == 3);
        release.send(()).unwrap();
        assert!(first.join().unwrap().is_ok());
        let answers: Vec<_> = later.into_iter().map(|t| t.join().unwrap()).collect();
        // One write took the three, each answered on its own.
        let mut written = groups.recv().unwrap();
        written.sort_unstable();
        assert_eq!(written, [1, 2, 3]);
        assert!(groups.try_recv().is_err(), "a second write");
        assert!(answers[0].is_ok() && answers[2].is_ok());
        assert!(matches!(&answers[1], Err(StoreError::Corrupt(m)) if m == "two"));
    }

    #[test]
    fn a_writer_that_panics_fails_its_group_and_frees_the_next() {
        let group = Arc::new(GroupCommit::<u32>::default());
        let panicked = {
            let group = Arc::clone(&group);
            thread::spawn(move || group.commit(0, |_| panic!("the disk caught fire")))
        };
        assert!(panicked.join().is_err());
        // The writer is free again: the next commit writes.
        assert!(
            group
                .commit(1, |items| items.iter().map(|_| Ok(())).collect())
                .is_ok()
        );
        // A write that answers fewer commits than it held fails the rest.
        let answer = group.commit(2, |_| Vec::new());
        assert!(matches!(answer, Err(StoreError::Unavailable(_))), "{answer:?}");
    }
}
