//! What every run actor is given: the store it persists to, the clock, the
//! executor link, the decider client, the policy and the metrics, and a way
//! back to the registry that holds it. The driver builds one and hands it to
//! each actor it starts.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use contract::{Clock, RunId, RunUid};
use decider_svc::DeciderChannel;
use platform::balance::Balanced;
use tokio::sync::mpsc;

use crate::{
    admission::Admission,
    core::{Policy, RunStore},
    link::Link,
    metrics::Metrics,
    replicas::Replicas,
};

/// The registry of runs, as a run actor sees it.
pub(crate) trait Registry: Send + Sync {
    /// Drops a run from the registry once it is gone (only the incarnation
    /// with this uid: a new run with the same id may already exist).
    fn forget(&self, run_id: &RunId, uid: RunUid);
}

pub(crate) struct RunContext {
    /// Taken by every run's actor at once: each persists its own commits.
    pub(crate) store: Arc<dyn RunStore>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) link: Link,
    pub(crate) decider: DeciderChannel<Balanced>,
    pub(crate) policy: Arc<Policy>,
    pub(crate) safety_tick: Duration,
    /// The operations all runs together may have pending.
    pub(crate) admission: Admission,
    /// Run actors alive now: each spaces its status publications by their
    /// cost times this, so that building statuses takes a bounded share of
    /// the driver however many runs change at once.
    pub(crate) actors: std::sync::atomic::AtomicUsize,
    pub(crate) metrics: Metrics,
    /// With a store shared by several drivers: which replica owns which run
    /// (see [`crate::replicas`]); `None` when this driver owns every run it
    /// stores.
    pub(crate) replicas: Option<Arc<dyn Replicas>>,
    /// Runs halted by a failed write, to reload from the store
    /// (`Driver::reload`).
    pub(crate) reloads: mpsc::UnboundedSender<RunUid>,
    pub(crate) registry: Weak<dyn Registry>,
}

impl std::fmt::Debug for RunContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunContext")
            .field("policy", &self.policy)
            .field("safety_tick", &self.safety_tick)
            .finish_non_exhaustive()
    }
}

impl RunContext {
    /// Whether this driver may write `uid` now (always, without replicas).
    /// Reads local state only.
    pub(crate) fn owns(&self, uid: RunUid) -> bool {
        self.replicas.as_ref().is_none_or(|r| r.owns(uid))
    }

    /// A run actor's write failed: its run is halted, and reloaded from the
    /// store once the store takes writes again.
    pub(crate) fn reload_later(&self, uid: RunUid) {
        let _ = self.reloads.send(uid);
    }

    /// A run is gone: the registry forgets it (if the driver still exists).
    pub(crate) fn forget(&self, run_id: &RunId, uid: RunUid) {
        if let Some(registry) = self.registry.upgrade() {
            registry.forget(run_id, uid);
        }
    }
}
