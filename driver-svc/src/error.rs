//! What a client request to the driver can fail with.

use crate::{
    core::{ApplyError, StoreError},
    replicas::Owner,
};

/// Why a client request failed; mapped to a gRPC status in one place (`api`).
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("run {0} not found")]
    NotFound(String),
    #[error("node {node} not found in run {run}")]
    NodeNotFound { run: String, node: String },
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("the run's actor is gone")]
    ActorGone,
    #[error(
        "the run is halted after a store failure ({0}); it is reloaded from the store once the store takes writes again: retry shortly"
    )]
    Halted(String),
    /// Another replica serves the run: call it there.
    #[error("run {run} is served by driver replica {} at {}; call it there", .owner.id,
        .owner.address.as_deref().unwrap_or("an address it has not announced"))]
    Elsewhere { run: String, owner: Owner },
    /// The run's owner went and no replica has taken it over yet.
    #[error("run {0} is between owners (its replica went); retry shortly")]
    Moving(String),
    /// One of the run's id spaces (attempts, operation sequence numbers,
    /// epochs) is used up: no retry helps; the run must be created anew.
    #[error("{0}: the run cannot go on; delete it and create it again")]
    Exhausted(String),
    /// The driver broke one of its own rules (a deadline past the clock's
    /// range, a pass out of turn): a bug, not the caller's doing.
    #[error("internal: {0}")]
    Internal(String),
    #[error(transparent)]
    Promote(#[from] crate::core::PromoteError),
}
