//! The registry of runs and what every run actor shares: the store, the
//! clock, the executor link, the decider client and the policy.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, RwLock, atomic::AtomicU64, atomic::Ordering},
    time::Duration,
};

use contract::{
    Clock, ClusterShape, Epoch, LogicalNodeId, RunId, RunUid, pb, pb::decider_client::DeciderClient,
};
use platform::{
    metrics::{Counter, Gauge, Histogram},
    telemetry::grpc::TracedChannel,
};
use tokio::sync::{mpsc, oneshot};

use crate::{
    actor::{RunActor, RunEvent, RunHandle},
    core::{Applied, ApplyError, OrphanResource, PassOutcome, Policy, RunState, RunStore, StoreError},
    link::Link,
    orphans::{Holdings, Orphans},
    replicas::{Claim, Owner, Placement, Replicas},
};

/// Driver-wide counters, and the driver's Prometheus metrics (each is
/// documented in ARCHITECTURE.md, "Metrics"). The atomics are the driver's
/// own totals for tests and callers of [`Driver::metrics`]; the registry
/// handles are what the metrics endpoint serves.
#[derive(Debug)]
pub struct Metrics {
    pub passes: AtomicU64,
    pub operations: AtomicU64,
    pub transitions: AtomicU64,
    pub stale_decisions: AtomicU64,
    pub decider_errors: AtomicU64,
    pub actions_by_rule: [AtomicU64; 17],
    pub(crate) exported: Exported,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            passes: AtomicU64::default(),
            operations: AtomicU64::default(),
            transitions: AtomicU64::default(),
            stale_decisions: AtomicU64::default(),
            decider_errors: AtomicU64::default(),
            actions_by_rule: Default::default(),
            exported: Exported::new(platform::metrics::global()),
        }
    }
}

/// The work queue's name in the `name` label, as client-go's work queues
/// label theirs: one key per run.
pub(crate) const QUEUE: &str = "runs";

/// The driver's metric families, in the controller-runtime / client-go work
/// queue conventions where one applies.
#[derive(Debug, Clone)]
pub(crate) struct Exported {
    pub(crate) queue_depth: Gauge,
    pub(crate) queue_adds: Counter,
    pub(crate) queue_duration: Histogram,
    pub(crate) queue_retries: Counter,
    pub(crate) reconcile: Counter,
    pub(crate) reconcile_errors: Counter,
    pub(crate) pass_duration: Histogram,
    pub(crate) actions: Counter,
    pub(crate) stale_decisions: Counter,
    pub(crate) dispatched: Counter,
    pub(crate) in_flight: Gauge,
    pub(crate) operation_duration: Histogram,
    pub(crate) folds: Counter,
    pub(crate) discarded: Counter,
    pub(crate) converged: Counter,
    takeovers: Counter,
    reloads: Counter,
    nodes: Gauge,
    runs: Gauge,
    link_up: Gauge,
    link_events: Counter,
}

impl Exported {
    fn new(r: &platform::metrics::Registry) -> Self {
        use platform::metrics::LATENCY_BUCKETS;
        Self {
            queue_depth: r.gauge(
                "provisioning_workqueue_depth",
                "Runs whose next pass is wanted but has not started (a pass is in flight, or the \
                 decider is being retried).",
                &["name"],
            ),
            queue_adds: r.counter(
                "provisioning_workqueue_adds_total",
                "Times a run went from needing nothing to wanting a pass; triggers that arrive while \
                 one is already wanted collapse into it.",
                &["name"],
            ),
            queue_duration: r.histogram(
                "provisioning_workqueue_queue_duration_seconds",
                "How long a run wanted a pass before the pass started.",
                &["name"],
                LATENCY_BUCKETS,
            ),
            queue_retries: r.counter(
                "provisioning_workqueue_retries_total",
                "Passes put back with backoff because the decider could not be reached.",
                &["name"],
            ),
            reconcile: r.counter(
                "provisioning_reconcile_total",
                "Passes, by result: success (nothing more to do), requeue (another pass at once), \
                 requeue_after (a deadline will wake the run), error.",
                &["result"],
            ),
            reconcile_errors: r.counter(
                "provisioning_reconcile_errors_total",
                "Passes that failed, by reason.",
                &["reason"],
            ),
            pass_duration: r.histogram(
                "provisioning_pass_duration_seconds",
                "Time from the start of a pass to its decisions being applied and committed (the \
                 Decide call included).",
                &[],
                LATENCY_BUCKETS,
            ),
            actions: r.counter(
                "provisioning_actions_total",
                "Actions applied (waits excluded), by ladder rule.",
                &["rule", "name"],
            ),
            stale_decisions: r.counter(
                "provisioning_stale_decisions_total",
                "Decisions skipped because their node changed while the decider ran.",
                &[],
            ),
            dispatched: r.counter(
                "provisioning_operations_dispatched_total",
                "Operations recorded pending and submitted to the executor, by effect.",
                &["effect"],
            ),
            in_flight: r.gauge(
                "provisioning_operations_in_flight",
                "Operations recorded pending and not yet folded, by effect.",
                &["effect"],
            ),
            operation_duration: r.histogram(
                "provisioning_operation_duration_seconds",
                "Time from an operation's dispatch to the fold of its outcome, by effect and outcome \
                 class.",
                &["effect", "outcome"],
                LATENCY_BUCKETS,
            ),
            folds: r.counter(
                "provisioning_folds_total",
                "Executor results, bootstrap observations and rejections folded into run state, by kind.",
                &["kind"],
            ),
            discarded: r.counter(
                "provisioning_stale_results_discarded_total",
                "Results and observations discarded instead of folded (superseded attempt, unknown or \
                 expired operation, late completion, stale session, duplicate), by kind and reason.",
                &["kind", "reason"],
            ),
            converged: r.counter(
                "provisioning_runs_converged_total",
                "Times a run reached convergence for its current generation.",
                &[],
            ),
            takeovers: r.counter(
                "provisioning_run_takeovers_total",
                "Stored runs this replica claimed and restored, at its start or when their owner \
                 went (replicas sharing an etcd store only).",
                &[],
            ),
            reloads: r.counter(
                "provisioning_run_reloads_total",
                "Runs halted by a failed store write and reloaded from the store under a new epoch.",
                &[],
            ),
            nodes: r.gauge(
                "provisioning_nodes",
                "Nodes across all runs, by stage.",
                &["stage"],
            ),
            runs: r.gauge("provisioning_runs", "Runs, by phase.", &["phase"]),
            link_up: r.gauge(
                "provisioning_executor_link_up",
                "1 while the driver's stream to the executor is up.",
                &[],
            ),
            link_events: r.counter(
                "provisioning_executor_link_events_total",
                "Executor link events: connects, disconnects, and messages sent, dropped (link down), \
                 received, undecodable or unrouted (no such run).",
                &["event"],
            ),
        }
    }
}

/// A rule's name in the `name` label: the action the ladder row takes.
pub(crate) fn rule_name(rule: contract::Rule) -> &'static str {
    use contract::Rule as R;
    match rule {
        R::Insert => "insert",
        R::Reap => "reap",
        R::Restart => "restart",
        R::RestartBackoff => "restart-backoff",
        R::BeginDelete => "begin-delete",
        R::Pending => "pending",
        R::ReissueCreate => "reissue-create",
        R::CancelBootstrap => "cancel-bootstrap",
        R::DestroyLease => "destroy-lease",
        R::MarkDestroyed => "mark-destroyed",
        R::RetryBackoff => "retry-backoff",
        R::Ready => "ready",
        R::CreateLease => "create-lease",
        R::LookupEndpoint => "lookup-endpoint",
        R::ObserveConvergence => "observe-convergence",
        R::AwaitBootstrap => "await-bootstrap",
        R::StartBootstrap => "start-bootstrap",
    }
}

impl Metrics {
    pub(crate) fn pass(&self, o: &PassOutcome) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.operations
            .fetch_add(u64::from(o.operations), Ordering::Relaxed);
        self.transitions
            .fetch_add(u64::from(o.transitions), Ordering::Relaxed);
        self.stale_decisions
            .fetch_add(u64::from(o.stale), Ordering::Relaxed);
        for (i, n) in o.actions_by_rule.iter().enumerate() {
            self.actions_by_rule[i].fetch_add(u64::from(*n), Ordering::Relaxed);
        }
        let e = &self.exported;
        e.stale_decisions.add(&[], u64::from(o.stale));
        for (rule, n) in contract::Rule::ALL.iter().zip(o.actions_by_rule) {
            if n > 0 {
                e.actions
                    .add(&[&rule.number().to_string(), rule_name(*rule)], u64::from(n));
            }
        }
    }

    /// Operations a durable pass released for dispatch.
    pub(crate) fn dispatched(&self, ops: &[contract::Operation]) {
        for op in ops {
            self.exported.dispatched.inc(&[op.input.effect().name()]);
        }
    }

    pub(crate) fn decider_error(&self) {
        self.decider_errors.fetch_add(1, Ordering::Relaxed);
    }
}

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
        for h in &handles {
            let status = h.status.borrow().clone();
            let phase = pb::RunPhase::try_from(status.phase).unwrap_or(pb::RunPhase::Unspecified);
            *phases.entry(phase_name(phase)).or_default() += 1.0;
            for g in &status.groups {
                for c in &g.stages {
                    let stage = pb::NodeStage::try_from(c.stage)
                        .ok()
                        .and_then(|s| contract::NodeStage::try_from(s).ok())
                        .map_or("unknown", contract::NodeStage::name);
                    *stages.entry(stage).or_default() += f64::from(c.count);
                }
            }
        }
        let e = &shared.metrics.exported;
        e.nodes.replace_all(stages.into_iter().map(|(k, v)| (vec![k], v)));
        e.runs.replace_all(phases.into_iter().map(|(k, v)| (vec![k], v)));
        let link = shared.link.counters();
        e.link_up.set(
            &[],
            if shared.link.generation().is_some() {
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

pub(crate) struct Shared {
    /// Taken by every run's actor at once: each persists its own commits.
    pub(crate) store: Arc<dyn RunStore>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) link: Link,
    pub(crate) decider: DeciderClient<TracedChannel>,
    pub(crate) policy: Arc<Policy>,
    pub(crate) safety_tick: Duration,
    pub(crate) metrics: Metrics,
    pub(crate) orphans: Orphans,
    runs: RwLock<HashMap<RunId, RunHandle>>,
    /// Reclaim runs (see `orphans`), by uid: never listed as runs.
    reclaims: RwLock<HashMap<RunUid, RunHandle>>,
    /// With a store shared by several drivers: which replica owns which run
    /// (see [`crate::replicas`]); `None` when this driver owns every run it
    /// stores.
    pub(crate) replicas: Option<Arc<dyn Replicas>>,
    /// Held while a run is taken over, so one run is never restored twice.
    takeover: tokio::sync::Mutex<()>,
    /// Runs halted by a failed write, to reload from the store
    /// ([`Driver::reload`]).
    reloads: mpsc::UnboundedSender<RunUid>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl Shared {
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

    /// Drops a run from the registry once it is gone (only the incarnation
    /// with this uid: a new run with the same id may already exist).
    pub(crate) fn forget(&self, run_id: &RunId, uid: RunUid) {
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
    pub decider: DeciderClient<TracedChannel>,
    pub link: Link,
    pub policy: Policy,
    pub safety_tick: Duration,
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
        let shared = Arc::new(Shared {
            store: Arc::from(config.store),
            clock: config.clock,
            link: config.link,
            decider: config.decider,
            policy: Arc::new(config.policy),
            safety_tick: config.safety_tick,
            metrics: Metrics::default(),
            orphans: Orphans::new(),
            runs: RwLock::new(HashMap::new()),
            reclaims: RwLock::new(HashMap::new()),
            replicas: config.replicas,
            takeover: tokio::sync::Mutex::new(()),
            reloads,
        });
        register_scrape(&shared);
        tokio::spawn(reload_runs(Arc::downgrade(&shared), reload_rx));
        let driver = Self { shared };
        for s in stored {
            driver.restore(s)?;
        }
        Ok(driver)
    }

    /// Persists what a run without an actor yet (created, restored or
    /// reclaimed) changed. Such a run has dispatched nothing and folded
    /// nothing, so its commit holds nothing back.
    fn persist_actorless(&self, run: &mut RunState) -> Result<(), DriverError> {
        let released = self.shared.store.persist(run.take_commit())?;
        debug_assert!(released.operations.is_empty() && released.acks.is_empty());
        Ok(())
    }

    /// Restores a stored run under a new, strictly larger epoch, made durable
    /// before the run's actor can claim it at the executor (and so fence
    /// whatever an earlier owner still has in flight there); the actor then
    /// resubmits the run's pending operations.
    fn restore(&self, s: crate::core::StoredRun) -> Result<RunUid, DriverError> {
        let run = self.restored(s)?;
        Ok(self.spawn_restored(run))
    }

    /// A stored run under its new epoch, committed.
    fn restored(&self, s: crate::core::StoredRun) -> Result<RunState, DriverError> {
        let epoch = s
            .meta
            .epoch
            .next()
            .ok_or_else(|| DriverError::Exhausted(format!("epoch of run {} exhausted", s.meta.run_id)))?;
        let mut run = RunState::restore(s, epoch, self.shared.policy.clone());
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
            let handle = RunActor::spawn(run, self.shared.clone(), contract::TraceContext::default());
            if let Ok(mut reclaims) = self.shared.reclaims.write() {
                reclaims.insert(uid, handle);
            }
            return uid;
        }
        let id = run.run_id().clone();
        let handle = RunActor::spawn(run, self.shared.clone(), contract::TraceContext::default());
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
        let stored = if !self.shared.owns(uid) {
            None
        } else if let Some(replicas) = self.shared.replicas.clone() {
            blocking(move || replicas.load(uid)).await?
        } else {
            let store = self.shared.store.clone();
            blocking(move || store.load_run(uid)).await?
        };
        let run = match stored {
            Some(s) => Some(self.restored(s)?),
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
                self.shared.metrics.exported.reloads.inc(&[]);
                tracing::warn!(run = %id, run_uid = %uid, "run reloaded from the store after a failed write");
            }
            None => {
                self.shared.link.unregister(uid);
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
        let Some(replicas) = self.shared.replicas.clone() else {
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
        let Some(replicas) = self.shared.replicas.clone() else {
            return Ok(false);
        };
        let _one_at_a_time = self.shared.takeover.lock().await;
        if self.handle_by_uid(uid).is_some() {
            return Ok(false);
        }
        let started = self.shared.clock.monotonic();
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
        self.restore(stored)?;
        self.shared.metrics.exported.takeovers.inc(&[]);
        tracing::warn!(%run, run_uid = %uid, %from_epoch, took_ms = self.shared.clock.monotonic().saturating_since(started).as_millis() as u64,
            "took over a run no live replica owned");
        Ok(true)
    }

    /// With replicas, where a run id this driver does not hold is served:
    /// another replica ([`DriverError::Elsewhere`]), here once taken over
    /// (a run whose owner went), or nowhere ([`DriverError::NotFound`]).
    async fn locate(&self, run_id: &RunId) -> Result<RunHandle, DriverError> {
        let Some(replicas) = self.shared.replicas.clone() else {
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
        &self.shared.metrics
    }

    pub fn link(&self) -> &Link {
        &self.shared.link
    }

    /// The clock the driver reads time from (its runs and its loops).
    pub fn clock(&self) -> &dyn Clock {
        &*self.shared.clock
    }

    pub fn policy(&self) -> &Policy {
        &self.shared.policy
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

    /// Applies a shape: creates the run, or updates it under the revision
    /// contract. The shape is stored before this returns.
    pub async fn apply(&self, shape: ClusterShape) -> Result<ApplyOutcome, DriverError> {
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
        let now = self.shared.clock.now();
        let uid = fresh_uid();
        let mut run = RunState::create(shape, uid, Epoch::new(1), self.shared.policy.clone(), now)?;
        if let Err(e) = self.persist_actorless(&mut run) {
            // The fresh uid's ownership claim is of no use now.
            if let Some(r) = &self.shared.replicas
                && let Err(release) = r.release(uid)
            {
                tracing::warn!(run_uid = %uid, error = %release, "could not release a run uid never created");
            }
            return Err(e);
        }
        crate::crash::hit(crate::crash::Point::ApplyCommitted);
        let id = run.run_id().clone();
        let handle = RunActor::spawn(run, self.shared.clone(), request_trace());
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
        if let Some(replicas) = self.shared.replicas.clone() {
            let here: std::collections::HashSet<String> = out.iter().map(|s| s.run_uid.clone()).collect();
            let now = self.shared.clock.now();
            for (stored, owner) in blocking(move || replicas.elsewhere()).await? {
                if here.contains(&stored.meta.uid.to_string()) {
                    continue;
                }
                let epoch = stored.meta.epoch;
                let run = RunState::restore(stored, epoch, self.shared.policy.clone());
                let mut s = crate::status::run_status(&run, false, now);
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

    pub async fn plan(&self, shape: ClusterShape) -> Result<pb::PlanResponse, DriverError> {
        match self.find(&shape.run_id).await {
            Ok(_) => {
                let run_id = shape.run_id.clone();
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
    pub async fn abandon(&self, run_id: &RunId, node: &LogicalNodeId) -> Result<pb::Orphan, DriverError> {
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
    pub fn orphans(&self) -> Vec<pb::Orphan> {
        self.shared.orphans.list()
    }

    fn reclaim_handles(&self) -> Vec<RunHandle> {
        self.shared
            .reclaims
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default()
    }

    /// What every run holds: run uid → node → current attempt. A run whose
    /// actor is gone is left out (it was deleted). Reclaim runs count: what
    /// they hold is being destroyed already.
    pub async fn holdings(&self) -> Holdings {
        let mut handles: Vec<RunHandle> = self
            .shared
            .runs
            .read()
            .map(|r| r.values().cloned().collect())
            .unwrap_or_default();
        handles.extend(self.reclaim_handles());
        let mut held = Holdings::new();
        for h in handles {
            let (tx, rx) = oneshot::channel();
            if h.tx.send(RunEvent::Holdings { reply: tx }).is_err() {
                continue;
            }
            if let Ok(nodes) = rx.await {
                held.insert(
                    h.uid.to_string(),
                    nodes.into_iter().map(|(n, a)| (n.to_string(), a.get())).collect(),
                );
            }
        }
        held
    }

    /// One orphan sweep over `inventory` (read from the executor just
    /// before): compares it with what the runs hold now. Returns the orphans
    /// this sweep reported for the first time. With `destroy`, every orphan
    /// the report holds is handed to the deletion path (see
    /// [`Driver::destroy_orphans`]).
    ///
    /// With replicas, a resource of a run the store knows and another replica
    /// holds (or is about to take over) is that replica's business: this
    /// sweep leaves it out.
    pub async fn sweep_orphans(&self, inventory: &[pb::Resource], destroy: bool) -> Vec<pb::Orphan> {
        let held = self.holdings().await;
        let theirs = match self.shared.replicas.clone() {
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
        let mine: Vec<pb::Resource> = inventory
            .iter()
            .filter(|r| {
                held.contains_key(&r.run_uid)
                    || RunUid::parse("run_uid", &r.run_uid).map_or(true, |uid| !theirs.contains(&uid))
            })
            .cloned()
            .collect();
        let now = self.shared.clock.now().as_millis();
        let new = self.shared.orphans.sweep(&mine, &held, now);
        if destroy {
            self.destroy_orphans().await;
        }
        new
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
        let mut by_run: BTreeMap<String, Vec<pb::Resource>> = BTreeMap::new();
        for r in self.shared.orphans.confirmed() {
            by_run.entry(r.run_uid.clone()).or_default().push(r);
        }
        for (uid, resources) in by_run {
            let Ok(uid) = RunUid::parse("run_uid", &uid) else {
                tracing::warn!(run_uid = %uid, "an orphan with an unreadable run uid is only reported");
                continue;
            };
            let mut wanted: Vec<(pb::Resource, OrphanResource)> = Vec::new();
            for r in resources {
                match orphan_resource(&r) {
                    Ok(o) => wanted.push((r, o)),
                    Err(e) => tracing::warn!(run_uid = %uid, node = %r.node_id, error = %e,
                        "an orphan the driver cannot name is only reported"),
                }
            }
            if wanted.is_empty() {
                continue;
            }
            let handle = self.handle_by_uid(uid);
            let adopted = match handle {
                Some(h) => {
                    let (tx, rx) = oneshot::channel();
                    let orphans = wanted.iter().map(|(_, o)| o.clone()).collect();
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
                None => match self.reclaim(uid, &wanted) {
                    Ok(adopted) => adopted,
                    Err(e) => {
                        tracing::error!(run_uid = %uid, error = %e, "could not record a reclaim run");
                        continue;
                    }
                },
            };
            for ((r, _), adopted) in wanted.iter().zip(adopted) {
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
    fn reclaim(
        &self,
        uid: RunUid,
        orphans: &[(pb::Resource, OrphanResource)],
    ) -> Result<Vec<bool>, DriverError> {
        let Some((first, _)) = orphans.first() else {
            return Ok(Vec::new());
        };
        let run_id =
            RunId::parse("run_id", &first.run_id).map_err(|e| DriverError::Apply(ApplyError::Invalid(e)))?;
        let highest = orphans.iter().map(|(r, _)| r.epoch).max().unwrap_or(0);
        let epoch = Epoch::new(highest)
            .next()
            .ok_or_else(|| DriverError::Exhausted(format!("epoch of run uid {uid} exhausted")))?;
        let now = self.shared.clock.now();
        let mut run = RunState::reclaim(run_id, uid, epoch, self.shared.policy.clone(), now);
        let adopted: Vec<bool> = orphans.iter().map(|(_, o)| run.adopt_orphan(o)).collect();
        if !adopted.iter().any(|a| *a) {
            return Ok(adopted);
        }
        self.persist_actorless(&mut run)?;
        tracing::warn!(run = %run.run_id(), run_uid = %uid, %epoch, nodes = run.node_count(),
            "reclaim run recorded: destroying the orphans of a run the driver no longer has");
        let handle = RunActor::spawn(run, self.shared.clone(), contract::TraceContext::default());
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

/// An inventory resource as the run state names it.
fn orphan_resource(r: &pb::Resource) -> Result<OrphanResource, contract::FieldError> {
    let some = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    Ok(OrphanResource {
        node: LogicalNodeId::parse("node_id", &r.node_id)?,
        attempt: contract::AttemptId::new(r.attempt),
        lease: some(&r.lease_id)
            .map(|l| contract::LeaseId::new("lease_id", &l))
            .transpose()?,
        endpoint: some(&r.endpoint)
            .map(|e| contract::Endpoint::new("endpoint", &e))
            .transpose()?,
        session_live: r.session_live,
    })
}
