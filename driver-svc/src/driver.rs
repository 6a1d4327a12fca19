//! The registry of runs and what every run actor shares: the store, the
//! clock, the executor link, the decider client and the policy.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, RwLock, atomic::AtomicU64, atomic::Ordering},
    time::Duration,
};

use contract::{
    Clock, ClusterShape, Epoch, LogicalNodeId, RunId, RunUid, pb, pb::decider_client::DeciderClient,
};
use tokio::sync::oneshot;
use tonic::transport::Channel;

use crate::{
    actor::{RunActor, RunEvent, RunHandle},
    core::{Applied, ApplyError, PassOutcome, Policy, RunState, RunStore, StoreError},
    link::Link,
};

/// Driver-wide counters (exported as metrics by the observability layer).
#[derive(Debug, Default)]
pub struct Metrics {
    pub passes: AtomicU64,
    pub operations: AtomicU64,
    pub transitions: AtomicU64,
    pub stale_decisions: AtomicU64,
    pub decider_errors: AtomicU64,
    pub actions_by_rule: [AtomicU64; 17],
}

impl Metrics {
    pub(crate) fn pass(&self, o: &PassOutcome) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.operations
            .fetch_add(o.operations.len() as u64, Ordering::Relaxed);
        self.transitions
            .fetch_add(u64::from(o.transitions), Ordering::Relaxed);
        self.stale_decisions
            .fetch_add(u64::from(o.stale), Ordering::Relaxed);
        for (i, n) in o.actions_by_rule.iter().enumerate() {
            self.actions_by_rule[i].fetch_add(u64::from(*n), Ordering::Relaxed);
        }
    }

    pub(crate) fn decider_error(&self) {
        self.decider_errors.fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) struct Shared {
    pub(crate) store: Mutex<Box<dyn RunStore>>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) link: Link,
    pub(crate) decider: DeciderClient<Channel>,
    pub(crate) policy: Arc<Policy>,
    pub(crate) safety_tick: Duration,
    pub(crate) metrics: Metrics,
    runs: RwLock<HashMap<RunId, RunHandle>>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// Drops a run from the registry once it is gone (only the incarnation
    /// with this uid: a new run with the same id may already exist).
    pub(crate) fn forget(&self, run_id: &RunId, uid: RunUid) {
        if let Ok(mut runs) = self.runs.write()
            && runs.get(run_id).is_some_and(|h| h.uid == uid)
        {
            runs.remove(run_id);
        }
    }
}

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
    #[error("the run is halted after a store failure ({0}); restart the driver")]
    Halted(String),
}

/// What an apply did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApplyOutcome {
    pub uid: RunUid,
    pub applied: Applied,
    pub created: bool,
}

/// The driver: a registry of run actors.
#[derive(Debug, Clone)]
pub struct Driver {
    shared: Arc<Shared>,
}

/// How to build a driver.
#[derive(Debug)]
pub struct DriverConfig {
    pub store: Box<dyn RunStore>,
    pub clock: Arc<dyn Clock>,
    pub decider: DeciderClient<Channel>,
    pub link: Link,
    pub policy: Policy,
    pub safety_tick: Duration,
}

impl Driver {
    /// Builds the driver and restores every stored run under a new epoch.
    pub fn start(config: DriverConfig) -> Result<Self, DriverError> {
        let stored = config.store.load_all()?;
        let shared = Arc::new(Shared {
            store: Mutex::new(config.store),
            clock: config.clock,
            link: config.link,
            decider: config.decider,
            policy: Arc::new(config.policy),
            safety_tick: config.safety_tick,
            metrics: Metrics::default(),
            runs: RwLock::new(HashMap::new()),
        });
        let driver = Self { shared };
        for s in stored {
            // A new, strictly larger epoch per run, made durable before the run
            // can claim it at the executor.
            let epoch = s.meta.epoch.next().ok_or_else(|| {
                DriverError::Store(StoreError::Corrupt(format!(
                    "epoch of run {} exhausted",
                    s.meta.run_id
                )))
            })?;
            let mut run = RunState::restore(s, epoch, driver.shared.policy.clone());
            {
                let mut store = driver.shared.store.lock().map_err(|_| DriverError::ActorGone)?;
                run.commit(&mut **store).map_err(|e| match e {
                    crate::core::CoreError::Store(s) => DriverError::Store(s),
                    other => DriverError::Store(StoreError::Unavailable(other.to_string())),
                })?;
            }
            tracing::info!(run = %run.run_id(), %epoch, nodes = run.node_count(), pending = run.pending_count(), "run restored");
            let id = run.run_id().clone();
            let handle = RunActor::spawn(run, driver.shared.clone());
            if let Ok(mut runs) = driver.shared.runs.write() {
                runs.insert(id, handle);
            }
        }
        Ok(driver)
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    pub fn link(&self) -> &Link {
        &self.shared.link
    }

    pub fn policy(&self) -> &Policy {
        &self.shared.policy
    }

    fn handle(&self, run_id: &str) -> Result<RunHandle, DriverError> {
        let runs = self.shared.runs.read().map_err(|_| DriverError::ActorGone)?;
        runs.iter()
            .find(|(id, _)| id.as_str() == run_id)
            .map(|(_, h)| h.clone())
            .ok_or_else(|| DriverError::NotFound(run_id.to_owned()))
    }

    async fn ask<T>(
        &self,
        run_id: &str,
        make: impl FnOnce(oneshot::Sender<T>) -> RunEvent,
    ) -> Result<T, DriverError> {
        let h = self.handle(run_id)?;
        let (tx, rx) = oneshot::channel();
        h.tx.send(make(tx)).map_err(|_| DriverError::ActorGone)?;
        rx.await.map_err(|_| DriverError::ActorGone)
    }

    /// Applies a shape: creates the run, or updates it under the revision
    /// contract. The shape is stored before this returns.
    pub async fn apply(&self, shape: ClusterShape) -> Result<ApplyOutcome, DriverError> {
        let existing = self.handle(shape.run_id.as_str());
        match existing {
            Ok(h) => {
                let (tx, rx) = oneshot::channel();
                h.tx.send(RunEvent::Apply { shape, reply: tx })
                    .map_err(|_| DriverError::ActorGone)?;
                let applied = rx.await.map_err(|_| DriverError::ActorGone)??;
                Ok(ApplyOutcome {
                    uid: h.uid,
                    applied,
                    created: false,
                })
            }
            Err(DriverError::NotFound(_)) => self.create(shape),
            Err(e) => Err(e),
        }
    }

    fn create(&self, shape: ClusterShape) -> Result<ApplyOutcome, DriverError> {
        let mut runs = self.shared.runs.write().map_err(|_| DriverError::ActorGone)?;
        if runs.contains_key(&shape.run_id) {
            // Lost a race with another create: the caller retries as an update.
            return Err(DriverError::Apply(ApplyError::SameGenerationOtherContent(
                shape.generation,
            )));
        }
        let now = self.shared.clock.now();
        let uid = fresh_uid();
        let mut run = RunState::create(shape, uid, Epoch::new(1), self.shared.policy.clone(), now)?;
        {
            let mut store = self.shared.store.lock().map_err(|_| DriverError::ActorGone)?;
            run.commit(&mut **store).map_err(|e| match e {
                crate::core::CoreError::Store(s) => DriverError::Store(s),
                other => DriverError::Store(StoreError::Unavailable(other.to_string())),
            })?;
        }
        let id = run.run_id().clone();
        let handle = RunActor::spawn(run, self.shared.clone());
        runs.insert(id, handle);
        Ok(ApplyOutcome {
            uid,
            applied: Applied::Changed,
            created: true,
        })
    }

    pub async fn get(&self, run_id: &str, include_nodes: bool) -> Result<pb::RunStatus, DriverError> {
        self.ask(run_id, |reply| RunEvent::Get { include_nodes, reply })
            .await
    }

    pub async fn list(&self) -> Vec<pb::RunStatus> {
        let handles: Vec<RunHandle> = self
            .shared
            .runs
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default();
        let mut out: Vec<pb::RunStatus> = handles.iter().map(|h| (**h.status.borrow()).clone()).collect();
        out.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        out
    }

    /// The run's status channel: the current status, then every change.
    pub fn watch(
        &self,
        run_id: &str,
    ) -> Result<tokio::sync::watch::Receiver<Arc<pb::RunStatus>>, DriverError> {
        Ok(self.handle(run_id)?.status)
    }

    pub async fn explain(&self, run_id: &str, node: &str) -> Result<pb::NodeExplanation, DriverError> {
        let id =
            LogicalNodeId::parse("node_id", node).map_err(|e| DriverError::Apply(ApplyError::Invalid(e)))?;
        self.ask(run_id, |reply| RunEvent::Explain { node: id, reply })
            .await?
            .ok_or_else(|| DriverError::NodeNotFound {
                run: run_id.to_owned(),
                node: node.to_owned(),
            })
    }

    pub async fn plan(&self, shape: ClusterShape) -> Result<pb::PlanResponse, DriverError> {
        match self.handle(shape.run_id.as_str()) {
            Ok(_) => {
                let run_id = shape.run_id.to_string();
                Ok(self
                    .ask(&run_id, |reply| RunEvent::Plan { shape, reply })
                    .await??)
            }
            Err(DriverError::NotFound(_)) => {
                // A new run: plan against an empty state.
                let now = self.shared.clock.now();
                let run = RunState::create(
                    shape.clone(),
                    RunUid::from_u128(0),
                    Epoch::new(0),
                    self.shared.policy.clone(),
                    now,
                )?;
                let out = run.plan(&shape, now);
                Ok(pb::PlanResponse {
                    decisions: out.decisions.iter().map(pb::Decision::from).collect(),
                    scale_down: Vec::new(),
                    current_generation: 0,
                })
            }
            Err(e) => Err(e),
        }
    }

    pub async fn delete(&self, run_id: &str) -> Result<pb::RunStatus, DriverError> {
        self.ask(run_id, |reply| RunEvent::Delete { reply }).await?
    }

    pub async fn set_paused(&self, run_id: &str, paused: bool) -> Result<pb::RunStatus, DriverError> {
        self.ask(run_id, |reply| RunEvent::SetPaused { paused, reply })
            .await?
    }
}

/// A fresh run uid from the operating system's random source, with a
/// time-and-counter fallback so that uid creation never fails.
fn fresh_uid() -> RunUid {
    let mut buf = [0u8; 16];
    if getrandom::fill(&mut buf).is_ok() {
        return RunUid::from_u128(u128::from_le_bytes(buf));
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = contract::SystemClock.now().as_millis();
    let hi = contract::backoff::mix64(t ^ u64::from(std::process::id()));
    let lo = contract::backoff::mix64(n ^ hi);
    RunUid::from_u128(u128::from(hi) << 64 | u128::from(lo))
}
