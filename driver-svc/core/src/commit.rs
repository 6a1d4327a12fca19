//! What a pass or a batch of folds leaves for the shell to make durable, and
//! what waits on it.
//!
//! The two invariants of the driver's writes are in these types: an operation
//! is recorded pending before it is dispatched, and a fold is acknowledged
//! only after it is committed. A [`Commit`] carries the [`RunDelta`] and holds
//! back the operations and acknowledgements; the only way to them is
//! [`Held::durable`], which the shell calls once the delta is in the store.
//! A commit the store refused is dropped with everything it held: the run is
//! then ahead of its store, and the shell reloads it from the store.

use contract::{Operation, OperationId};

use crate::store::{RunDelta, RunStore, StoreError};

/// The writes of one pass (or one batch of folds) for one run, and what may be
/// released once they are durable.
#[must_use = "a commit's operations and acknowledgements wait on its delta being made durable"]
#[derive(Debug, Clone, PartialEq)]
pub struct Commit {
    delta: RunDelta,
    held: Held,
}

/// The operations and acknowledgements of a [`Commit`], released only by
/// [`Held::durable`].
#[must_use = "held operations and acknowledgements are released by `durable`"]
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Held {
    operations: Vec<Operation>,
    acks: Vec<AckRef>,
}

/// What a durable commit released: submit the operations, send the
/// acknowledgements.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Released {
    pub operations: Vec<Operation>,
    pub acks: Vec<AckRef>,
}

impl Commit {
    pub(crate) fn new(delta: RunDelta, operations: Vec<Operation>, acks: Vec<AckRef>) -> Self {
        Self {
            delta,
            held: Held { operations, acks },
        }
    }

    /// The writes to make durable (possibly none).
    pub fn delta(&self) -> &RunDelta {
        &self.delta
    }

    /// The operations this commit records pending: to look at (metrics,
    /// tests), not to submit before the commit is durable.
    pub fn operations(&self) -> &[Operation] {
        &self.held.operations
    }

    /// The acknowledgements this commit holds back.
    pub fn acks(&self) -> &[AckRef] {
        &self.held.acks
    }

    /// Whether there is nothing to write and nothing held.
    pub fn is_empty(&self) -> bool {
        self.delta.is_empty() && self.held.operations.is_empty() && self.held.acks.is_empty()
    }

    /// The delta to persist (moved, so it can be written off the caller's
    /// thread), and what it holds back.
    pub fn into_parts(self) -> (RunDelta, Held) {
        (self.delta, self.held)
    }

    /// Persists the delta with `write` (skipped when there is nothing to
    /// write), then releases what it held. On an error nothing is released.
    pub fn persist(
        self,
        write: impl FnOnce(&RunDelta) -> Result<(), StoreError>,
    ) -> Result<Released, StoreError> {
        if !self.delta.is_empty() {
            write(&self.delta)?;
        }
        Ok(self.held.durable())
    }

    /// Commits the delta to `store`, then releases what it held.
    pub fn persist_to(self, store: &(impl RunStore + ?Sized)) -> Result<Released, StoreError> {
        self.persist(|delta| store.commit(delta))
    }
}

impl Held {
    /// The delta these were held for is durable: release them.
    pub fn durable(self) -> Released {
        Released {
            operations: self.operations,
            acks: self.acks,
        }
    }
}

/// Something to acknowledge to the executor once the fold is committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckRef {
    Result(OperationId),
    Observation {
        session: contract::SessionId,
        seq: u64,
    },
    /// A resource change, by its per-run sequence number.
    Change {
        seq: u64,
    },
}
