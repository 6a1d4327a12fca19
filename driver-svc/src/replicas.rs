//! Driver replicas sharing one store: which replica serves which run.
//!
//! With a store several drivers share (the etcd store), each run is owned by
//! one live replica at a time. [`Replicas`] is what the driver asks the store
//! about that: claim a run (before restoring it), load one run, find where a
//! run id is served, list the runs nobody owns, and whether this replica may
//! still write a run. A driver on a store of its own (redb, memory) has no
//! `Replicas`: it owns every run it stores.
//!
//! The driver's side (see `driver`): at start, and whenever an owner goes, a
//! replica claims the runs nobody owns and restores each under a new epoch,
//! which its actor claims at the executor before dispatching anything; a
//! request for a run another replica serves is answered with that replica's
//! address ([`DriverError::Elsewhere`](crate::driver::DriverError)); before
//! each pass and each dispatch an actor checks [`Replicas::owns`], which reads
//! only local state, so a replica whose lease may have lapsed stops at once
//! even when the store cannot be reached.

use std::collections::HashSet;

use contract::RunUid;

use crate::core::{StoreError, StoredRun};

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This replica owns the run now.
    Mine,
    /// Another live replica owns it.
    Held { owner: String },
    /// It is not stored (any more): nothing to own.
    Gone,
}

/// A replica, as other replicas and clients reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// Its owner id.
    pub id: String,
    /// The address it announced for the public API (`host:port`), if any.
    pub address: Option<String>,
}

/// Where a run id is served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// This replica owns it.
    Here(RunUid),
    /// Another live replica owns it.
    Elsewhere(RunUid, Owner),
    /// It is stored, and no live replica owns it (its owner went).
    Unowned(RunUid),
    /// No such run.
    Unknown,
}

/// Ownership of runs among driver replicas sharing a store. Calls may block
/// on the store (call them off the async workers); [`Replicas::owns`] and
/// [`Replicas::lost`] never do.
pub trait Replicas: Send + Sync + std::fmt::Debug {
    /// This replica's owner id.
    fn owner_id(&self) -> &str;
    /// Whether this replica may write `uid` now: it claimed the run and its
    /// lease is live by the local clock. Reads local state only.
    fn owns(&self, uid: RunUid) -> bool;
    /// Whether this replica's lease is lost (for good: the process must
    /// restart to own anything again). Reads local state only.
    fn lost(&self) -> bool;
    /// Tells other replicas and clients where this replica serves.
    fn announce(&self, address: &str) -> Result<(), StoreError>;
    /// Claims the stored run `uid` for this replica.
    fn claim(&self, uid: RunUid) -> Result<Claim, StoreError>;
    /// Gives up `uid` (if this replica owns it).
    fn release(&self, uid: RunUid) -> Result<(), StoreError>;
    /// Everything stored for `uid`, read after claiming it.
    fn load(&self, uid: RunUid) -> Result<Option<StoredRun>, StoreError>;
    /// Where `run_id` is served.
    fn locate(&self, run_id: &str) -> Result<Placement, StoreError>;
    /// Stored runs no live replica owns, and runs this owner id owned under
    /// an earlier lease (a restart with the same id).
    fn unowned(&self) -> Result<Vec<RunUid>, StoreError>;
    /// The stored state of every run (reclaim runs aside) this replica does
    /// not own, with its owner if one is live: what `ListRuns` shows of the
    /// runs other replicas serve.
    fn elsewhere(&self) -> Result<Vec<(StoredRun, Option<Owner>)>, StoreError>;
    /// Every run the store knows, whoever owns it (the orphan sweep must not
    /// take another replica's resources for orphans).
    fn known_runs(&self) -> Result<HashSet<RunUid>, StoreError>;
    /// Gives up every run at once (revokes this replica's lease), for a
    /// graceful stop: the other replicas take the runs without waiting for
    /// the lease to expire. This replica writes no more.
    fn resign(&self) -> Result<(), StoreError>;
    /// A counter that moves when ownership may have moved (an owner's key
    /// went): the driver then looks for runs to take over.
    fn changes(&self) -> tokio::sync::watch::Receiver<u64>;
}
