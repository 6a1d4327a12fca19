//! The registry of runs: it creates, restores, reloads, takes over and
//! forgets run actors, answers the API's requests through them, and runs the
//! orphan sweep. What the actors share is `context::RunContext`.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, RwLock, atomic::AtomicU64, atomic::Ordering},
    time::Duration,
};

use contract::{
    Clock, ClusterShape, Epoch, FieldError, GroupId, InventoryResource, LogicalNodeId, Problem, RunId,
    RunUid, pb,
};
use platform::balance::Balanced;
use tokio::sync::{mpsc, oneshot, watch};

use crate::{
    actor::{RunActor, RunEvent, RunHandle},
    context::{Registry, RunContext},
    core::{Applied, ApplyError, OrphanResource, Policy, RunState, RunStore, StoreError},
    link::Link,
    orphans::{Holdings, Inventory, Orphan, Orphans, ResourceKey},
    replicas::{Claim, Placement, Replicas},
    status,
};
pub use crate::{error::DriverError, metrics::Metrics};

/// Refreshes the gauges read from live state (nodes by stage, runs by phase,
/// the link) before each scrape; stops once the driver is gone.
fn register_scrape(shared: &Arc<Shared>) {
    let weak = Arc::downgrade(shared);
    platform::metrics::global().on_scrape(move || {
        let Some(shared) = weak.upgrade() else {
            return false;
        };
        let handles: Vec<RunHandle> = shared
            .runs
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default();
        let mut stages: BTreeMap<&'static str, f64> = BTreeMap::new();
        let mut phases: BTreeMap<&'static str, f64> = BTreeMap::new();
        let (mut unhealthy, mut held) = (0.0, 0.0);
        for h in &handles {
            let status = h.status.borrow().clone();
            let phase = pb::RunPhase::try_from(status.phase).unwrap_or(pb::RunPhase::Unspecified);
            *phases.entry(phase_name(phase)).or_default() += 1.0;
            for g in &status.groups {
                unhealthy += f64::from(g.unhealthy);
                held += f64::from(g.remediation_held);
                for c in &g.stages {
                    let stage = pb::NodeStage::try_from(c.stage)
                        .ok()
                        .and_then(|s| contract::NodeStage::try_from(s).ok())
                        .map_or("unknown", contract::NodeStage::name);
                    *stages.entry(stage).or_default() += f64::from(c.count);
                }
            }
        }
        let e = &shared.run.metrics.exported;
        e.nodes.replace_all(stages.into_iter().map(|(k, v)| (vec![k], v)));
        e.runs.replace_all(phases.into_iter().map(|(k, v)| (vec![k], v)));
        e.unhealthy.set(&[], unhealthy);
        e.remediation_held.set(&[], held);
        e.admission_waiting
            .set(&[], shared.run.admission.held_nodes() as f64);
        let link = shared.run.link.counters();
        e.link_up.set(
            &[],
            if shared.run.link.generation().is_some() {
                1.0
            } else {
                0.0
            },
        );
        for (event, n) in [
            ("connect", link.connects),
            ("disconnect", link.disconnects),
            ("sent", link.sent),
            ("dropped", link.dropped),
            ("received", link.received),
            ("undecodable", link.undecodable),
            ("unrouted", link.unrouted),
        ] {
            e.link_events.mirror(&[event], n);
        }
        true
    });
}

fn phase_name(p: pb::RunPhase) -> &'static str {
    match p {
        pb::RunPhase::Unspecified => "unknown",
        pb::RunPhase::Progressing => "progressing",
        pb::RunPhase::Converged => "converged",
        pb::RunPhase::Paused => "paused",
        pb::RunPhase::Deleting => "deleting",
        pb::RunPhase::Deleted => "deleted",
    }
}

/// What the driver keeps besides what its run actors are given: the
/// registry of runs and the orphan report.
pub(crate) struct Shared {
    /// What every run actor is given (and the driver uses too).
    pub(crate) run: Arc<RunContext>,
    pub(crate) orphans: Orphans,
    runs: RwLock<HashMap<RunId, RunHandle>>,
    /// Reclaim runs (see `orphans`), by uid: never listed as runs.
    reclaims: RwLock<HashMap<RunUid, RunHandle>>,
    /// Held while a run is taken over, so one run is never restored twice.
    takeover: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("run", &self.run)
            .finish_non_exhaustive()
    }
}

impl Registry for Shared {
    fn forget(&self, run_id: &RunId, uid: RunUid) {
        if let Ok(mut runs) = self.runs.write()
            && runs.get(run_id).is_some_and(|h| h.uid == uid)
        {
            runs.remove(run_id);
        }
        if let Ok(mut reclaims) = self.reclaims.write() {
            reclaims.remove(&uid);
        }
    }
}

/// Why a stored run is restored (the event it records says so).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Restore {
    /// The driver is starting and restores the runs it stores.
    Started,
    /// A write failed: the run is reloaded from what the store holds.
    Reloaded,
    /// A replica takes over a run no live replica owns.
    TakenOver,
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
    /// The decider, through the tracing layer: each pass's `Decide` call is
    /// a child of the pass's span.
    pub decider: decider_svc::DeciderChannel<Balanced>,
    pub link: Link,
    pub policy: Policy,
    pub safety_tick: Duration,
    /// The most operations all runs together may have pending (`None`: no
    /// limit); see [`crate::admission`].
    pub max_operations_in_flight: Option<usize>,
    /// Set with a store several drivers share: this driver then restores
    /// only the runs it claims ([`Driver::take_over_unowned`]).
    pub replicas: Option<Arc<dyn Replicas>>,
}

/// The first wait before a halted run is reloaded, doubled after each failed
/// reload up to [`RELOAD_MAX_WAIT`].
const RELOAD_FIRST_WAIT: Duration = Duration::from_millis(200);
const RELOAD_MAX_WAIT: Duration = Duration::from_secs(10);
/// How long a reload waits for the halted actor to stop.
const RELOAD_STOP_WAIT: Duration = Duration::from_secs(5);

/// Reloads each run whose actor halted on a failed write, retrying with
/// backoff until the store takes the run's new epoch. Ends with the driver.
async fn reload_runs(shared: std::sync::Weak<Shared>, mut rx: mpsc::UnboundedReceiver<RunUid>) {
    while let Some(uid) = rx.recv().await {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut wait = RELOAD_FIRST_WAIT;
            loop {
                tokio::time::sleep(wait).await;
                let Some(shared) = shared.upgrade() else { return };
                match (Driver { shared }).reload(uid).await {
                    Ok(()) => return,
                    Err(e) => {
                        tracing::warn!(run_uid = %uid, error = %e, retry_in = ?wait * 2,
                            "cannot reload a halted run yet");
                        wait = (wait * 2).min(RELOAD_MAX_WAIT);
                    }
                }
            }
        });
    }
}

/// Runs `f` (which may block on the store) off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, DriverError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| DriverError::ActorGone)?
        .map_err(DriverError::Store)
}

impl Driver {
    /// Builds the driver and restores every stored run under a new epoch.
    pub fn start(config: DriverConfig) -> Result<Self, DriverError> {
        // Replicas sharing the store restore only what they claim.
        let stored = match config.replicas {
            Some(_) => Vec::new(),
            None => config.store.load_all()?,
        };
        let (reloads, reload_rx) = mpsc::unbounded_channel();
        let shared = Arc::new_cyclic(|registry: &std::sync::Weak<Shared>| Shared {
            run: Arc::new(RunContext {
                store: Arc::from(config.store),
                clock: config.clock,
                link: config.link,
                decider: config.decider,
                policy: Arc::new(config.policy),
                safety_tick: config.safety_tick,
                admission: crate::admission::Admission::new(config.max_operations_in_flight),
                actors: std::sync::atomic::AtomicUsize::new(0),
                metrics: Metrics::default(),
                replicas: config.replicas,
                reloads,
                registry: registry.clone(),
            }),
            orphans: Orphans::new(),
            runs: RwLock::new(HashMap::new()),
            reclaims: RwLock::new(HashMap::new()),
            takeover: tokio::sync::Mutex::new(()),
        });
        register_scrape(&shared);
        tokio::spawn(reload_runs(Arc::downgrade(&shared), reload_rx));
        let driver = Self { shared };
        for s in stored {
            driver.restore(s, Restore::Started)?;
        }
        Ok(driver)
    }

    /// Persists what a run without an actor yet (created, restored or
    /// reclaimed) changed. Such a run has dispatched nothing and folded
    /// nothing, so its commit holds nothing back.
    fn persist_actorless(&self, run: &mut RunState) -> Result<(), DriverError> {
        let released = run.take_commit().persist_to(&*self.shared.run.store)?;
        debug_assert!(released.operations.is_empty() && released.acks.is_empty());
        Ok(())
    }

    /// Restores a stored run under a new, strictly larger epoch, made durable
    /// before the run's actor can claim it at the executor (and so fence
    /// whatever an earlier owner still has in flight there); the actor then
    /// resubmits the run's pending operations.
    fn restore(&self, s: crate::core::StoredRun, why: Restore) -> Result<RunUid, DriverError> {
        let run = self.restored(s, why)?;
        Ok(self.spawn_restored(run))
    }

    /// A stored run under its new epoch, committed with the event that says
    /// why it was restored.
    fn restored(&self, s: crate::core::StoredRun, why: Restore) -> Result<RunState, DriverError> {
        let from = s.meta.epoch;
        let epoch = from
            .next()
            .ok_or_else(|| DriverError::Exhausted(format!("epoch of run {} exhausted", s.meta.run_id)))?;
        let mut run = RunState::restore(s, epoch, self.shared.run.policy.clone());
        let (reason, message) = match why {
            Restore::Started => (
                contract::EventReason::Restored,
                format!("restored from the store by a starting driver (epoch {from} → {epoch})"),
            ),
            Restore::Reloaded => (
                contract::EventReason::Restored,
                format!("reloaded from the store after a failed write (epoch {from} → {epoch})"),
            ),
            Restore::TakenOver => (
                contract::EventReason::TakenOver,
                format!("taken over by another driver replica (epoch {from} → {epoch})"),
            ),
        };
        let now = self.shared.run.clock.now();
        run.record_event(reason, contract::Subject::Run, message, now);
        self.persist_actorless(&mut run)?;
        tracing::info!(run = %run.run_id(), %epoch, nodes = run.node_count(), pending = run.pending_count(),
            reclaim = run.is_reclaim(), "run restored");
        Ok(run)
    }

    /// Starts a restored run's actor and registers it (in place of any
    /// earlier actor of the run).
    fn spawn_restored(&self, run: RunState) -> RunUid {
        let uid = run.uid();
        if run.is_reclaim() {
            self.shared.orphans.recovered(&run);
            let handle = RunActor::spawn(run, self.shared.run.clone(), contract::TraceContext::default());
            if let Ok(mut reclaims) = self.shared.reclaims.write() {
                reclaims.insert(uid, handle);
            }
            return uid;
        }
        let id = run.run_id().clone();
        let handle = RunActor::spawn(run, self.shared.run.clone(), contract::TraceContext::default());
        if let Ok(mut runs) = self.shared.runs.write() {
            runs.insert(id, handle);
        }
        uid
    }

    /// Reloads a run halted by a failed write: its in-memory state may be
    /// ahead of the store, so it is dropped and the run restored from what
    /// the store holds, under a new epoch, exactly as after a restart
    /// (pending operations resubmitted; the executor fences the old epoch).
    /// The halted actor keeps answering until the store has been read and
    /// the new epoch committed. A run this replica no longer owns, or that
    /// is no longer stored, is only stopped. An error leaves the run halted.
    pub async fn reload(&self, uid: RunUid) -> Result<(), DriverError> {
        let _one_at_a_time = self.shared.takeover.lock().await;
        let Some(old) = self.handle_by_uid(uid) else {
            return Ok(());
        };
        let stored = if !self.shared.run.owns(uid) {
            None
        } else if let Some(replicas) = self.shared.run.replicas.clone() {
            blocking(move || replicas.load(uid)).await?
        } else {
            let store = self.shared.run.store.clone();
            blocking(move || store.load_run(uid)).await?
        };
        let run = match stored {
            Some(s) => Some(self.restored(s, Restore::Reloaded)?),
            None => None,
        };
        let (done, stopped) = oneshot::channel();
        if old.tx.send(RunEvent::Shutdown { done }).is_ok() {
            let _ = tokio::time::timeout(RELOAD_STOP_WAIT, stopped).await;
        }
        match run {
            Some(run) => {
                let id = run.run_id().clone();
                self.spawn_restored(run);
                self.shared.run.metrics.exported.reloads.inc(&[]);
                tracing::warn!(run = %id, run_uid = %uid, "run reloaded from the store after a failed write");
            }
            None => {
                self.shared.run.link.unregister(uid);
                if let Ok(mut runs) = self.shared.runs.write() {
                    runs.retain(|_, h| h.uid != uid);
                }
                if let Ok(mut reclaims) = self.shared.reclaims.write() {
                    reclaims.remove(&uid);
                }
                tracing::warn!(run_uid = %uid, "a halted run is not this driver's to reload: stopped it");
            }
        }
        Ok(())
    }

    /// With replicas: claims every stored run no live replica owns and
    /// restores it (see [`Driver::take_over`]). Returns how many it took.
    pub async fn take_over_unowned(&self) -> Result<usize, DriverError> {
        let Some(replicas) = self.shared.run.replicas.clone() else {
            return Ok(0);
        };
        let uids = blocking(move || replicas.unowned()).await?;
        let mut taken = 0;
        for uid in uids {
            if self.take_over(uid).await? {
                taken += 1;
            }
        }
        Ok(taken)
    }

    /// Claims `uid` in the store, loads it (after the claim, so every write
    /// of the replica that had it is in what is read, and none can follow)
    /// and restores it under a new epoch. Returns whether this driver took
    /// it (false: another replica holds it, or it is gone).
    pub async fn take_over(&self, uid: RunUid) -> Result<bool, DriverError> {
        let Some(replicas) = self.shared.run.replicas.clone() else {
            return Ok(false);
        };
        let _one_at_a_time = self.shared.takeover.lock().await;
        if self.handle_by_uid(uid).is_some() {
            return Ok(false);
        }
        let started = self.shared.run.clock.monotonic();
        let stored = blocking(move || match replicas.claim(uid)? {
            Claim::Held { .. } | Claim::Gone => Ok(None),
            Claim::Mine => match replicas.load(uid)? {
                Some(s) => Ok(Some(s)),
                None => {
                    // Dropped meanwhile: nothing to own.
                    replicas.release(uid)?;
                    Ok(None)
                }
            },
        })
        .await?;
        let Some(stored) = stored else {
            return Ok(false);
        };
        let (run, from_epoch) = (stored.meta.run_id.clone(), stored.meta.epoch);
        self.restore(stored, Restore::TakenOver)?;
        self.shared.run.metrics.exported.takeovers.inc(&[]);
        tracing::warn!(%run, run_uid = %uid, %from_epoch, took_ms = self.shared.run.clock.monotonic().saturating_since(started).as_millis() as u64,
            "took over a run no live replica owned");
        Ok(true)
    }

    /// With replicas, where a run id this driver does not hold is served:
    /// another replica ([`DriverError::Elsewhere`]), here once taken over
    /// (a run whose owner went), or nowhere ([`DriverError::NotFound`]).
    async fn locate(&self, run_id: &RunId) -> Result<RunHandle, DriverError> {
        let Some(replicas) = self.shared.run.replicas.clone() else {
            return Err(DriverError::NotFound(run_id.to_string()));
        };
        let id = run_id.to_string();
        let placement = blocking(move || replicas.locate(&id)).await?;
        match placement {
            Placement::Unknown => Err(DriverError::NotFound(run_id.to_string())),
            Placement::Elsewhere(_, owner) => Err(DriverError::Elsewhere {
                run: run_id.to_string(),
                owner,
            }),
            Placement::Here(_) | Placement::Unowned(_) => {
                if let Placement::Unowned(uid) = placement {
                    self.take_over(uid).await?;
                } else {
                    // A takeover may be restoring it right now.
                    drop(self.shared.takeover.lock().await);
                }
                self.handle(run_id)
                    .map_err(|_| DriverError::Moving(run_id.to_string()))
            }
        }
    }

    /// The run's handle, from this driver or (with replicas) after finding
    /// where it is served.
    async fn find(&self, run_id: &RunId) -> Result<RunHandle, DriverError> {
        match self.handle(run_id) {
            Err(DriverError::NotFound(_)) => self.locate(run_id).await,
            found => found,
        }
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.run.metrics
    }

    pub fn link(&self) -> &Link {
        &self.shared.run.link
    }

    /// The clock the driver reads time from (its runs and its loops).
    pub fn clock(&self) -> &dyn Clock {
        &*self.shared.run.clock
    }

    pub fn policy(&self) -> &Policy {
        &self.shared.run.policy
    }

    fn handle(&self, run_id: &RunId) -> Result<RunHandle, DriverError> {
        let runs = self.shared.runs.read().map_err(|_| DriverError::ActorGone)?;
        runs.get(run_id)
            .cloned()
            .ok_or_else(|| DriverError::NotFound(run_id.to_string()))
    }

    async fn ask<T>(
        &self,
        run_id: &RunId,
        make: impl FnOnce(oneshot::Sender<T>) -> RunEvent,
    ) -> Result<T, DriverError> {
        let h = self.find(run_id).await?;
        let (tx, rx) = oneshot::channel();
        // An actor that is gone finished its run (deleted and reaped): to a
        // client that run no longer exists.
        let gone = || DriverError::NotFound(run_id.to_string());
        h.tx.send(make(tx)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// Refuses a shape whose group names a provider the executor does not
    /// serve (SPEC §10), once the executor has said what it serves. A
    /// served provider that is down now is accepted: its plugin comes back.
    fn check_providers(&self, shape: &ClusterShape) -> Result<(), DriverError> {
        let Some(served) = self.shared.run.link.providers() else {
            return Ok(());
        };
        for (i, g) in shape.groups.iter().enumerate() {
            let name = &g.template.provider.name;
            if !served.iter().any(|s| s.name == *name) {
                return Err(DriverError::Apply(ApplyError::Invalid(FieldError::new(
                    format!("groups[{i}].template.provider.name"),
                    Problem::NotServed {
                        name: name.clone(),
                        served: served.iter().map(|s| s.name.clone()).collect(),
                    },
                ))));
            }
        }
        Ok(())
    }

    /// Applies a shape: creates the run, or updates it under the revision
    /// contract. The shape is stored before this returns.
    pub async fn apply(&self, shape: ClusterShape) -> Result<ApplyOutcome, DriverError> {
        self.check_providers(&shape)?;
        let existing = self.find(&shape.run_id).await;
        match existing {
            Ok(h) => {
                let (tx, rx) = oneshot::channel();
                h.tx.send(RunEvent::Apply {
                    shape,
                    trace: request_trace(),
                    reply: tx,
                })
                .map_err(|_| DriverError::ActorGone)?;
                let applied = rx.await.map_err(|_| DriverError::ActorGone)??;
                Ok(ApplyOutcome {
                    uid: h.uid,
                    applied,
                    created: false,
                })
            }
            Err(DriverError::NotFound(_)) => {
                let run_id = shape.run_id.clone();
                match self.create(shape) {
                    // Another replica created this run id first.
                    Err(DriverError::Store(StoreError::NameTaken { .. })) => {
                        Err(match self.locate(&run_id).await {
                            Err(e @ DriverError::Elsewhere { .. }) => e,
                            _ => DriverError::Moving(run_id.to_string()),
                        })
                    }
                    created => created,
                }
            }
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
        let now = self.shared.run.clock.now();
        let uid = fresh_uid();
        let mut run = RunState::create(shape, uid, Epoch::new(1), self.shared.run.policy.clone(), now)?;
        let generation = run.shape().generation;
        run.record_event(
            contract::EventReason::Applied,
            contract::Subject::Run,
            format!("run created at generation {generation}"),
            now,
        );
        if let Err(e) = self.persist_actorless(&mut run) {
            // The fresh uid's ownership claim is of no use now.
            if let Some(r) = &self.shared.run.replicas
                && let Err(release) = r.release(uid)
            {
                tracing::warn!(run_uid = %uid, error = %release, "could not release a run uid never created");
            }
            return Err(e);
        }
        crate::crash::hit(crate::crash::Point::ApplyCommitted);
        let id = run.run_id().clone();
        let handle = RunActor::spawn(run, self.shared.run.clone(), request_trace());
        runs.insert(id, handle);
        Ok(ApplyOutcome {
            uid,
            applied: Applied::Changed,
            created: true,
        })
    }

    pub async fn get(&self, run_id: &RunId, include_nodes: bool) -> Result<pb::RunStatus, DriverError> {
        self.ask(run_id, |reply| RunEvent::Get { include_nodes, reply })
            .await
    }

    /// Every run: this driver's, and with replicas the others' as stored
    /// (marked `from_store`, with the replica serving each).
    pub async fn list(&self) -> Result<Vec<pb::RunStatus>, DriverError> {
        let handles: Vec<RunHandle> = self
            .shared
            .runs
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default();
        let mut out: Vec<pb::RunStatus> = handles.iter().map(|h| (**h.status.borrow()).clone()).collect();
        if let Some(replicas) = self.shared.run.replicas.clone() {
            let here: std::collections::HashSet<String> = out.iter().map(|s| s.run_uid.clone()).collect();
            let now = self.shared.run.clock.now();
            for (stored, owner) in blocking(move || replicas.elsewhere()).await? {
                if here.contains(&stored.meta.uid.to_string()) {
                    continue;
                }
                let epoch = stored.meta.epoch;
                let run = RunState::restore(stored, epoch, self.shared.run.policy.clone());
                let mut s = status::run_status(&run, false, now);
                s.from_store = true;
                if let Some(o) = owner {
                    s.served_by = o.id;
                    s.served_at = o.address.unwrap_or_default();
                }
                out.push(s);
            }
        }
        out.sort_by(|a, b| a.run_id.cmp(&b.run_id));
        Ok(out)
    }

    /// The run's status channel: the current status, then every change.
    pub async fn watch(
        &self,
        run_id: &RunId,
    ) -> Result<tokio::sync::watch::Receiver<Arc<pb::RunStatus>>, DriverError> {
        Ok(self.find(run_id).await?.status)
    }

    /// The driver's wall clock (the injected one).
    pub fn now(&self) -> contract::UnixMillis {
        self.shared.run.clock.now()
    }

    /// The run's event log after `after` (at most `limit`; 0: all kept),
    /// oldest first, and the latest event's number.
    pub async fn events(
        &self,
        run_id: &RunId,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<contract::Event>, u64), DriverError> {
        self.ask(run_id, |reply| RunEvent::Events { after, limit, reply })
            .await
    }

    /// The run's event-log channel: it moves when an event is committed (or
    /// the latest repeats).
    pub async fn watch_events(&self, run_id: &RunId) -> Result<watch::Receiver<(u64, u32)>, DriverError> {
        Ok(self.find(run_id).await?.events)
    }

    pub async fn explain(
        &self,
        run_id: &RunId,
        node: &LogicalNodeId,
    ) -> Result<pb::NodeExplanation, DriverError> {
        let id = node.clone();
        self.ask(run_id, |reply| RunEvent::Explain { node: id, reply })
            .await?
            .ok_or_else(|| DriverError::NodeNotFound {
                run: run_id.to_string(),
                node: node.to_string(),
            })
    }

    /// A page of the run's nodes: up to `slots` slots after `after`.
    pub async fn nodes(
        &self,
        run_id: &RunId,
        after: Option<LogicalNodeId>,
        slots: usize,
    ) -> Result<pb::ListNodesResponse, DriverError> {
        self.ask(run_id, |reply| RunEvent::Nodes { after, slots, reply })
            .await
    }

    pub async fn plan(&self, shape: ClusterShape) -> Result<pb::PlanResponse, DriverError> {
        self.check_providers(&shape)?;
        match self.find(&shape.run_id).await {
            Ok(_) => {
                let run_id = shape.run_id.clone();
                Ok(self
                    .ask(&run_id, |reply| RunEvent::Plan { shape, reply })
                    .await??)
            }
            Err(DriverError::NotFound(_)) => {
                // A new run: plan against an empty state.
                let now = self.shared.run.clock.now();
                let run = RunState::create(
                    shape.clone(),
                    RunUid::from_u128(0),
                    Epoch::new(0),
                    self.shared.run.policy.clone(),
                    now,
                )?;
                // Generation 0: there is no run yet.
                Ok(pb::PlanResponse {
                    current_generation: 0,
                    ..status::plan(&run, &run, &shape, now)
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Stops every run actor for a graceful shutdown, waiting at most
    /// `within`: each abandons its pass in flight (if any) and ends its open
    /// spans, so the spans flushed at exit form whole traces.
    pub async fn shutdown(&self, within: Duration) {
        let mut handles: Vec<RunHandle> = self
            .shared
            .runs
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default();
        handles.extend(self.reclaim_handles());
        let mut stopped = Vec::with_capacity(handles.len());
        for h in handles {
            let (done, rx) = oneshot::channel();
            if h.tx.send(RunEvent::Shutdown { done }).is_ok() {
                stopped.push(rx);
            }
        }
        if tokio::time::timeout(within, futures::future::join_all(stopped))
            .await
            .is_err()
        {
            tracing::warn!(?within, "some runs did not stop in time");
        }
    }

    /// An operator abandons a node: the run forgets it (a desired slot is
    /// re-provisioned under a fresh attempt) and what it left behind joins
    /// the orphan report.
    pub async fn abandon(&self, run_id: &RunId, node: &LogicalNodeId) -> Result<Orphan, DriverError> {
        let id = node.clone();
        let left = self
            .ask(run_id, |reply| RunEvent::Abandon { node: id, reply })
            .await??
            .ok_or_else(|| DriverError::NodeNotFound {
                run: run_id.to_string(),
                node: node.to_string(),
            })?;
        Ok(self.shared.orphans.abandoned(&left))
    }

    /// The orphan report: abandoned nodes, then what the sweep found.
    /// The inventory resync's last look found held leases missing.
    pub fn missing_suspected(&self) -> bool {
        self.shared.orphans.missing_suspected()
    }

    pub fn orphans(&self) -> Vec<Orphan> {
        self.shared.orphans.list()
    }

    fn reclaim_handles(&self) -> Vec<RunHandle> {
        self.shared
            .reclaims
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default()
    }

    fn every_run_handle(&self) -> Vec<RunHandle> {
        let mut handles: Vec<RunHandle> = self
            .shared
            .runs
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default();
        handles.extend(self.reclaim_handles());
        handles
    }

    /// Tells every run that a read of the executor's inventory begins, and
    /// returns once each has noted it: a lease a run records from now on
    /// may be made after its page was read, and is not looked for in this
    /// read ([`Driver::sweep_orphans`]). Without this, every sweep while
    /// runs converge suspected such leases lost, and looked again soon.
    pub async fn begin_inventory_read(&self) -> InventoryRead {
        let handles = self.every_run_handle();
        let mut noted = Vec::with_capacity(handles.len());
        for h in handles {
            let (tx, rx) = oneshot::channel();
            if h.tx.send(RunEvent::InventoryReadBegins { reply: tx }).is_ok() && rx.await.is_ok() {
                noted.push(h.tx);
            }
        }
        InventoryRead { runs: noted }
    }

    /// What every run holds: run uid → node → current attempt, and the
    /// leases the runs believed live when `read` began and still do. A run
    /// whose actor is gone is left out (it was deleted). Reclaim runs count:
    /// what they hold is being destroyed already.
    async fn holdings(&self, mut read: InventoryRead) -> (Holdings, Vec<ResourceKey>) {
        // Each run ends its read as it answers.
        read.runs.clear();
        let handles = self.every_run_handle();
        let mut held = Holdings::new();
        let mut leases = Vec::new();
        for h in handles {
            let (tx, rx) = oneshot::channel();
            if h.tx.send(RunEvent::Holdings { reply: tx }).is_err() {
                continue;
            }
            if let Ok(run) = rx.await {
                held.insert(h.uid, run.nodes.into_iter().collect());
                leases.extend(run.leases.into_iter().map(|(n, a)| (h.uid, n, a)));
            }
        }
        (held, leases)
    }

    /// One orphan sweep over `inventory` (read from the executor since
    /// `read` began): compares it once with what the runs hold now, for both
    /// findings (the leases only with those held since the read began).
    /// Returns the orphans this sweep reported for the first time.
    /// The leases missing at two consecutive looks (SPEC §8, inventory
    /// resync) are lost, and their runs are told. With `destroy`, every
    /// orphan the report holds is handed to the deletion path (see
    /// [`Driver::destroy_orphans`]).
    ///
    /// With replicas, a resource of a run the store knows and another replica
    /// holds (or is about to take over) is that replica's business: this
    /// sweep leaves it out.
    pub async fn sweep_orphans(
        &self,
        read: InventoryRead,
        mut inventory: Inventory,
        destroy: bool,
    ) -> Vec<Orphan> {
        let (held, leases) = self.holdings(read).await;
        let theirs = match self.shared.run.replicas.clone() {
            None => Default::default(),
            Some(r) => match blocking(move || r.known_runs()).await {
                Ok(known) => known,
                Err(e) => {
                    tracing::warn!(error = %e, "orphan sweep: the store's runs could not be read");
                    self.sweep_failed();
                    return Vec::new();
                }
            },
        };
        inventory.resources.retain(|r| {
            let uid = r.identity.run_uid;
            held.contains_key(&uid) || !theirs.contains(&uid)
        });
        let now = self.shared.run.clock.now();
        let found = self.shared.orphans.sweep(&inventory, &held, &leases, now);
        let mut by_run: BTreeMap<RunUid, Vec<(LogicalNodeId, contract::AttemptId)>> = BTreeMap::new();
        for (uid, node, attempt) in found.lost {
            by_run.entry(uid).or_default().push((node, attempt));
        }
        for (uid, nodes) in by_run {
            tracing::warn!(run_uid = %uid, nodes = ?nodes, "leases missing from the executor's inventory at two looks: lost");
            if let Some(h) = self.handle_by_uid(uid) {
                let _ = h.tx.send(RunEvent::Missing { nodes });
            }
        }
        if destroy {
            self.destroy_orphans().await;
        }
        found.orphans
    }

    /// Hands the orphans the sweep confirmed to the normal deletion path: a
    /// resource of a run the driver holds is adopted by that run as a node
    /// being deleted; a resource of a run the driver no longer has goes to a
    /// reclaim run for that uid (created and committed here, under an epoch
    /// above the executor's for the uid, before anything is dispatched). Each
    /// adopted orphan stays in the report as being destroyed until it is gone
    /// from the inventory. An older attempt of a slot its run still holds
    /// stays reported: a run holds one attempt per slot, so it is adopted
    /// once the slot is free.
    pub async fn destroy_orphans(&self) {
        let mut by_run: BTreeMap<RunUid, Vec<InventoryResource>> = BTreeMap::new();
        for r in self.shared.orphans.confirmed() {
            by_run.entry(r.identity.run_uid).or_default().push(r);
        }
        for (uid, resources) in by_run {
            let adopted = match self.handle_by_uid(uid) {
                Some(h) => {
                    let (tx, rx) = oneshot::channel();
                    let orphans = resources.iter().map(OrphanResource::from).collect();
                    if h.tx.send(RunEvent::AdoptOrphans { orphans, reply: tx }).is_err() {
                        continue;
                    }
                    match rx.await {
                        Ok(Ok(adopted)) => adopted,
                        Ok(Err(e)) => {
                            tracing::warn!(run_uid = %uid, error = %e, "the run refused its orphans");
                            continue;
                        }
                        Err(_) => continue,
                    }
                }
                None => match self.reclaim(uid, &resources) {
                    Ok(adopted) => adopted,
                    Err(e) => {
                        tracing::error!(run_uid = %uid, error = %e, "could not record a reclaim run");
                        continue;
                    }
                },
            };
            for (r, adopted) in resources.iter().zip(adopted) {
                if adopted {
                    self.shared.orphans.destroying(r);
                }
            }
        }
    }

    /// The run (or reclaim run) with this uid.
    fn handle_by_uid(&self, uid: RunUid) -> Option<RunHandle> {
        let live = self
            .shared
            .runs
            .read()
            .ok()
            .and_then(|r| r.values().find(|h| h.uid == uid).cloned());
        live.or_else(|| {
            self.shared
                .reclaims
                .read()
                .ok()
                .and_then(|r| r.get(&uid).cloned())
        })
    }

    /// Creates, commits and starts a reclaim run holding `orphans`.
    fn reclaim(&self, uid: RunUid, orphans: &[InventoryResource]) -> Result<Vec<bool>, DriverError> {
        let Some(first) = orphans.first() else {
            return Ok(Vec::new());
        };
        let run_id = first.identity.run_id.clone();
        let highest = orphans.iter().map(|r| r.epoch).max().unwrap_or_default();
        let epoch = highest
            .next()
            .ok_or_else(|| DriverError::Exhausted(format!("epoch of run uid {uid} exhausted")))?;
        let now = self.shared.run.clock.now();
        let mut run = RunState::reclaim(run_id, uid, epoch, self.shared.run.policy.clone(), now);
        let adopted: Vec<bool> = orphans
            .iter()
            .map(|r| run.adopt_orphan(&OrphanResource::from(r)))
            .collect();
        if !adopted.iter().any(|a| *a) {
            return Ok(adopted);
        }
        self.persist_actorless(&mut run)?;
        tracing::warn!(run = %run.run_id(), run_uid = %uid, %epoch, nodes = run.node_count(),
            "reclaim run recorded: destroying the orphans of a run the driver no longer has");
        let handle = RunActor::spawn(run, self.shared.run.clone(), contract::TraceContext::default());
        if let Ok(mut reclaims) = self.shared.reclaims.write() {
            reclaims.insert(uid, handle);
        }
        Ok(adopted)
    }

    /// Reclaim runs the driver holds (for tests and the report).
    pub fn reclaim_count(&self) -> usize {
        self.shared.reclaims.read().map(|r| r.len()).unwrap_or(0)
    }

    /// An orphan sweep could not read the inventory.
    pub fn sweep_failed(&self) {
        self.shared.orphans.sweep_failed();
    }

    pub async fn delete(&self, run_id: &RunId) -> Result<pb::RunStatus, DriverError> {
        let trace = request_trace();
        self.ask(run_id, |reply| RunEvent::Delete { trace, reply })
            .await?
    }

    pub async fn set_paused(&self, run_id: &RunId, paused: bool) -> Result<pb::RunStatus, DriverError> {
        let trace = request_trace();
        self.ask(run_id, |reply| RunEvent::SetPaused { paused, trace, reply })
            .await?
    }

    /// Lets a group's rollout go on past its canary.
    pub async fn promote(&self, run_id: &RunId, group: GroupId) -> Result<pb::RunStatus, DriverError> {
        let trace = request_trace();
        self.ask(run_id, |reply| RunEvent::Promote { group, trace, reply })
            .await?
    }
}

/// The trace context of the client request being served (the API's server
/// span), so the pass a request causes joins the request's trace.
fn request_trace() -> contract::TraceContext {
    platform::telemetry::context_of(&tracing::Span::current())
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

/// A read of the executor's inventory under way ([`Driver::begin_inventory_read`]).
/// Dropped without [`Driver::sweep_orphans`] (the read failed), it tells
/// the runs the read is over.
#[derive(Debug)]
#[must_use = "a read begun is ended by Driver::sweep_orphans, or by dropping it"]
pub struct InventoryRead {
    runs: Vec<mpsc::UnboundedSender<RunEvent>>,
}

impl Drop for InventoryRead {
    fn drop(&mut self) {
        for run in self.runs.drain(..) {
            // A run gone has nothing to end.
            let _ = run.send(RunEvent::InventoryReadEnds);
        }
    }
}
