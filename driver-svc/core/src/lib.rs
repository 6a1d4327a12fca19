//! The driver's sans-IO core: one run's state machine ([`RunState`]), its
//! policy, and the interface of the stores its writes go to.
//!
//! Nothing here spawns, sleeps, reads a clock or does I/O: every input is a
//! method call with the `now` it happened at, and every output is a value.
//! A pass or a batch of folds ends in a [`Commit`]: the [`RunDelta`] to make
//! durable, holding back the operations to submit and the acknowledgements to
//! send until the shell says the delta is durable ([`Held::durable`]). The
//! shell (the driver's run actor) persists it off the async workers, per run.

pub mod commit;
pub mod policy;
pub mod rollout;
pub mod run;
pub mod session;
pub mod store;

pub use commit::{AckRef, Commit, Held, Released};
pub use policy::Policy;
pub use run::{
    AbandonedNode, Applied, ApplyError, CoreError, Discard, Fold, LOST_PREFIX, LastDecision, ORPHAN_SEQ_BASE,
    OrphanResource, PassOutcome, PassPlan, PromoteError, RequestUndo, RunState,
};
pub use session::{LinkSession, ToExecutor};
pub use store::{ConditionMark, MemStore, NodeRecord, RunDelta, RunMeta, RunStore, StoreError, StoredRun};
