//! The driver's sans-IO core: the run state machine, its policy, the store
//! interface and the clock. Nothing here spawns, sleeps or does network I/O.

pub mod policy;
pub mod run;
pub mod store;

pub use contract::{Clock, ManualClock, SystemClock};
pub use policy::Policy;
pub use run::{
    AbandonedNode, AckRef, Applied, ApplyError, CoreError, Discard, Fold, LastDecision, ORPHAN_SEQ_BASE,
    OrphanResource, PassOutcome, PassPlan, RunState,
};
pub use store::{MemStore, NodeRecord, RunDelta, RunMeta, RunStore, StoreError, StoredRun};
