//! The fake provider as an async [`Backend`]: [`FakeProvider`] behind a mutex,
//! real (tokio) latency, a background task that delivers bootstrap stages when
//! they are due and rolls the provider's day-2 faults at each fault tick, and
//! an optional state file so that leases outlive the process.
//!
//! The fake watches what it holds as a real backend does: a resource lost at
//! a fault tick, or on request ([`FakeBackend::apply_fault`], which the
//! executor's `FakeControl` test service calls), is reported to the change
//! sink the executor hands over in [`Backend::watch`]; a sick resource fails
//! [`Backend::probe`], so the executor's prober finds it. Fault ticks wait
//! until the executor watches: a loss nobody would hear of is not rolled.
//!
//! The mutex is a `std` one and is never held across an await: every use is a
//! short synchronous step (apply an effect, hand out due stages, list).
//!
//! The state file holds the provider's resources (identity → lease, endpoint,
//! session) and id counters as JSON. It is rewritten after every change, under
//! the provider's lock so that writes happen in the order of the changes, to a
//! temporary name and then renamed, so a crash leaves the old file or the new
//! one, never half of one. Writing synchronously on the calling task is a
//! deliberate simplification for a test backend whose file is small. Sessions
//! restored from a file are live but emit no further stages (see
//! [`crate::fake::FakeSnapshot`]).

use std::{
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use contract::{
    AttemptId, BootstrapStage, Change, Clock, Endpoint, FieldError, LeaseId, LogicalNodeId, Operation,
    OperationInput, Outcome, ResourceIdentity, RunId, RunUid, SessionId, UnixMillis,
};
use futures::{
    StreamExt as _,
    future::BoxFuture,
    stream::{self, BoxStream},
};
use serde::{Deserialize, Serialize};
use tokio::{sync::Notify, task::AbortHandle};

use crate::{
    backend::{Backend, BackendError, ChangeSink, InventoryItem, ObservationSink, RawChange, RawObservation},
    fake::{
        FakeCall, FakeChangeKind, FakeConfig, FakeProvider, FakeResource, FakeSnapshot, FakeSnapshotResource,
        FaultRates,
    },
};

/// The longest the stage emitter sleeps before it looks at the clock again, so
/// that a clock that jumps (or a virtual one moved by a test) is noticed.
const MAX_EMITTER_SLEEP: Duration = Duration::from_secs(1);

/// The state file's format version.
const STATE_FILE_VERSION: u32 = 1;

/// Failures of the fake backend's state file.
#[derive(Debug, thiserror::Error)]
pub enum FakeBackendError {
    #[error("cannot read the fake backend's state file {path}: {source}")]
    ReadState {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the fake backend's state file {path} is malformed: {reason}")]
    MalformedState { path: PathBuf, reason: String },
    #[error("cannot write the fake backend's state file {path}: {source}")]
    WriteState {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The in-memory fake provider behind the [`Backend`] trait; cheap to clone.
#[derive(Debug, Clone)]
pub struct FakeBackend {
    shared: Arc<Shared>,
    /// Stops the stage emitter when the last handle goes. Futures returned by
    /// `execute` hold only `shared`, so they do not keep the emitter alive.
    _emitter: Arc<AbortOnDrop>,
}

#[derive(Debug)]
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Wakes the emitter when a new session may have moved the next stage earlier.
    wake: Notify,
    clock: Arc<dyn Clock>,
    /// The wall clock and the monotonic clock when the backend started: the
    /// provider's own time runs from there on the monotonic clock
    /// ([`Shared::provider_now`]).
    origin: (UnixMillis, contract::Monotonic),
    state_file: Option<PathBuf>,
}

impl Shared {
    /// The provider's time: the wall clock at start, moved on by the
    /// monotonic clock. A step of the executor's wall clock (NTP, an
    /// operator) does not move it, as it does not move a real provider's
    /// machines: a stage due in 300 ms is still due in 300 ms after the
    /// wall clock goes back an hour.
    fn provider_now(&self) -> UnixMillis {
        let (wall, mono) = self.origin;
        wall.checked_add(self.clock.monotonic().saturating_since(mono))
            .unwrap_or(UnixMillis::MAX)
    }
}

#[derive(Debug)]
struct State {
    provider: FakeProvider,
    /// The sink of every session with stages still to come, from the latest
    /// `StartBootstrap` of its identity (an adopting start replaces it).
    sinks: BTreeMap<ResourceIdentity, ObservationSink>,
    /// Where sessions restored from the state file stream, once the executor
    /// hands it over (see [`Backend::resume`]).
    resumed: Option<ObservationSink>,
    /// Where lost resources are reported, once the executor watches (see
    /// [`Backend::watch`]).
    changes: Option<ChangeSink>,
}

/// A fault a test inflicts on one resource of the fake provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResourceFault {
    /// The resource is lost: it leaves the inventory and the executor is told.
    Lose,
    /// It fails its probes until healed.
    Sicken,
    /// It answers its probes again.
    Heal,
}

/// The fake provider holds no resource for the identity a fault names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the fake provider holds no resource of run {run_uid}, node {node}, attempt {attempt}")]
pub struct NotHeld {
    pub run_uid: RunUid,
    pub node: LogicalNodeId,
    pub attempt: AttemptId,
}

/// The most resources a page of [`FakeBackend`]'s paged read holds (about
/// half a megabyte), each page read under the lock on its own.
const PAGE_RESOURCES: usize = 4096;

fn item(r: FakeResource) -> InventoryItem {
    InventoryItem {
        identity: r.identity,
        lease: Some(r.lease),
        endpoint: r.endpoint,
        session_live: r.session_live,
    }
}

impl FakeBackend {
    /// The provider's resources as inventory items: every run's, or one's.
    fn listing(
        &self,
        run_uid: Option<RunUid>,
    ) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>> {
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            let mut state = shared.lock();
            state.provider.advance(shared.provider_now());
            let resources = match run_uid {
                Some(uid) => state.provider.inventory_of(uid),
                None => state.provider.inventory(),
            };
            Ok(resources.into_iter().map(item).collect())
        })
    }

    /// Pages of at most `page` resources, each taken under the lock from
    /// where the last one ended.
    fn pages(&self, page: usize) -> BoxStream<'static, Result<Vec<InventoryItem>, BackendError>> {
        /// Where the read is: at its start, after an identity, or done.
        enum Cursor {
            Start,
            After(ResourceIdentity),
            Done,
        }
        let shared = Arc::clone(&self.shared);
        stream::unfold(Cursor::Start, move |cursor| {
            let shared = Arc::clone(&shared);
            async move {
                let after = match cursor {
                    Cursor::Start => None,
                    Cursor::After(identity) => Some(identity),
                    Cursor::Done => return None,
                };
                let resources = {
                    let mut state = shared.lock();
                    state.provider.advance(shared.provider_now());
                    state.provider.inventory_after(after.as_ref(), page)
                };
                let next = match resources.last() {
                    Some(last) if resources.len() >= page => Cursor::After(last.identity.clone()),
                    _ => Cursor::Done,
                };
                Some((Ok(resources.into_iter().map(item).collect()), next))
            }
        })
        .boxed()
    }

    /// Starts the backend: loads the state file if one is configured and exists,
    /// writes it once (so an unwritable path fails here, not on the first
    /// create), and spawns the stage emitter. Must run inside a tokio runtime.
    pub fn start(
        config: FakeConfig,
        state_file: Option<PathBuf>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, FakeBackendError> {
        let provider = match &state_file {
            Some(path) => match load_state(path)? {
                Some(snapshot) => FakeProvider::restore(config, snapshot),
                None => FakeProvider::new(config),
            },
            None => FakeProvider::new(config),
        };
        if let Some(path) = &state_file {
            write_state(path, &provider.snapshot())?;
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                provider,
                sinks: BTreeMap::new(),
                resumed: None,
                changes: None,
            }),
            wake: Notify::new(),
            origin: (clock.now(), clock.monotonic()),
            clock,
            state_file,
        });
        let emitter = tokio::spawn(emit_stages(Arc::clone(&shared)));
        Ok(Self {
            shared,
            _emitter: Arc::new(AbortOnDrop(emitter.abort_handle())),
        })
    }

    /// Changes the fault rates from the next call (and fault tick) on.
    pub fn set_faults(&self, faults: FaultRates) {
        self.shared.lock().provider.set_faults(faults);
        self.shared.wake.notify_one();
    }

    /// Reads the provider (counters, live resources) for checks and metrics.
    pub fn with_provider<R>(&self, f: impl FnOnce(&FakeProvider) -> R) -> R {
        f(&self.shared.lock().provider)
    }

    /// Inflicts `fault` on the resource of `(run_uid, node, attempt)`, for
    /// tests that drive a running executor: a lost resource is reported to
    /// the executor as one lost at a fault tick is; a sick one fails its
    /// probes until it is healed.
    pub fn apply_fault(
        &self,
        run_uid: RunUid,
        node: &LogicalNodeId,
        attempt: AttemptId,
        fault: ResourceFault,
    ) -> Result<(), NotHeld> {
        let mut state = self.shared.lock();
        let Some(identity) = state.provider.find(run_uid, node, attempt) else {
            return Err(NotHeld {
                run_uid,
                node: node.clone(),
                attempt,
            });
        };
        match fault {
            ResourceFault::Lose => {
                state.provider.lose(&identity);
                state.sinks.remove(&identity);
                let at = self.shared.clock.now();
                report_lost(
                    &state,
                    identity,
                    "lost on request (the fake's control service)",
                    at,
                );
            }
            ResourceFault::Sicken => {
                state.provider.sicken(&identity);
            }
            ResourceFault::Heal => {
                state.provider.heal(&identity);
            }
        }
        self.shared.persist(&state.provider);
        Ok(())
    }
}

/// Tells the executor a resource is gone. Without a sink (the executor does
/// not watch yet) nobody can be told; a closed one means it is shutting down.
fn report_lost(state: &State, identity: ResourceIdentity, reason: &str, at: UnixMillis) {
    if let Some(sink) = &state.changes {
        let _ = sink.send(RawChange {
            identity,
            change: Change::Lost {
                reason: reason.to_owned(),
            },
            at,
        });
    }
}

impl Shared {
    /// A poisoned lock only means another task panicked mid-step; the model is
    /// still a consistent value (each step is one method call), so it is used.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies an operation's effect now and returns when its outcome is due.
    fn apply(&self, op: &Operation, sink: ObservationSink) -> FakeCall {
        let mut state = self.lock();
        let call = state.provider.execute(op, self.provider_now());
        let identity = op.identity();
        if state.provider.is_emitting(&identity) {
            if matches!(op.input, OperationInput::StartBootstrap { .. }) {
                state.sinks.insert(identity, sink);
                self.wake.notify_one();
            }
        } else {
            state.sinks.remove(&identity);
        }
        if matches!(op.input, OperationInput::CreateLease { .. }) {
            // The first resource held starts the fault ticks.
            self.wake.notify_one();
        }
        if !matches!(op.input, OperationInput::LookupEndpoint { .. }) {
            self.persist(&state.provider);
        }
        call
    }

    /// Writes the state file, if configured. A failed write is logged, not
    /// reported as the operation's outcome: the effect did happen in the running
    /// provider, and only a restart would lose it.
    fn persist(&self, provider: &FakeProvider) {
        if let Some(path) = &self.state_file
            && let Err(e) = write_state(path, &provider.snapshot())
        {
            tracing::error!(error = %e, "the fake backend could not persist its state");
        }
    }

    /// Rolls the fault ticks due now (once the executor watches), sends every
    /// stage due now to its session's sink, and returns when the next stage
    /// or fault tick is due.
    fn emit_due(&self) -> Option<UnixMillis> {
        let mut state = self.lock();
        let now = self.provider_now();
        let next_change = if state.changes.is_some() {
            let changes = state.provider.due_changes(now);
            for c in &changes {
                if c.kind == FakeChangeKind::Lost {
                    state.sinks.remove(&c.identity);
                    report_lost(
                        &state,
                        c.identity.clone(),
                        "injected: the provider lost the resource",
                        c.at,
                    );
                }
            }
            if !changes.is_empty() {
                self.persist(&state.provider);
            }
            state.provider.next_change_at()
        } else {
            None
        };
        if state.resumed.is_none() && state.sinks.is_empty() {
            // Nothing can receive a stage yet (the executor has not handed over
            // its sink for restored sessions): leave them scheduled.
            return next_change;
        }
        let due = state.provider.due_observations(now);
        let mut done = Vec::new();
        for o in due {
            if let Some(sink) = state.sinks.get(&o.identity).or(state.resumed.as_ref()) {
                let raw = RawObservation::new(o.identity.clone(), o.session, o.stage, o.detail, o.at);
                // A closed sink means the executor is shutting down; the stage is
                // dropped with it.
                let _ = sink.send(raw);
            }
            if !state.provider.is_emitting(&o.identity) {
                done.push(o.identity);
            }
        }
        // A finished session's sink goes once all its due stages are out:
        // several can fall due at once (an emitter that ran late), and
        // each goes to its session's sink, with the trace of the call that
        // started it, never to the sink of restored sessions.
        for identity in done {
            if !state.provider.is_emitting(&identity) {
                state.sinks.remove(&identity);
            }
        }
        [state.provider.next_observation_at(), next_change]
            .into_iter()
            .flatten()
            .min()
    }
}

/// The emitter: one task for the whole backend, sleeping until the next stage
/// or fault tick is due, or until something new is scheduled.
async fn emit_stages(shared: Arc<Shared>) {
    loop {
        match shared.emit_due() {
            None => shared.wake.notified().await,
            Some(at) => {
                let delay = at.saturating_since(shared.provider_now()).min(MAX_EMITTER_SLEEP);
                tokio::select! {
                    () = shared.wake.notified() => {}
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

impl Backend for FakeBackend {
    fn resume(&self, observations: ObservationSink) {
        self.shared.lock().resumed = Some(observations);
        self.shared.wake.notify_one();
    }

    fn watch(&self, changes: ChangeSink) {
        let mut state = self.shared.lock();
        state.changes = Some(changes);
        // Fault ticks count from the start of the watch.
        state.provider.start_ticks(self.shared.provider_now());
        drop(state);
        self.shared.wake.notify_one();
    }

    fn execute(&self, op: Operation, observations: ObservationSink) -> BoxFuture<'static, Outcome> {
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            let call = shared.apply(&op, observations);
            tokio::time::sleep(call.latency).await;
            call.outcome
        })
    }

    /// The fake's endpoints are not sockets: the probe asks the provider.
    fn probe(
        &self,
        identity: &contract::ResourceIdentity,
        _endpoint: &contract::Endpoint,
    ) -> BoxFuture<'static, Result<(), String>> {
        let result = self.shared.lock().provider.probe(identity);
        Box::pin(async move { result })
    }

    fn inventory(&self) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>> {
        self.listing(None)
    }

    fn inventory_of(&self, run_uid: RunUid) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>> {
        self.listing(Some(run_uid))
    }

    fn inventory_pages(&self) -> BoxStream<'static, Result<Vec<InventoryItem>, BackendError>> {
        self.pages(PAGE_RESOURCES)
    }
}

// ---------------------------------------------------------------------------
// The state file
// ---------------------------------------------------------------------------

#[derive(Debug, Serialize, Deserialize)]
struct StateFileDto {
    version: u32,
    lease_counter: u64,
    session_counter: u64,
    latest_ms: u64,
    resources: Vec<ResourceDto>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ResourceDto {
    run_uid: String,
    run_id: String,
    node_id: String,
    attempt: u64,
    lease_id: String,
    endpoint: String,
    ready_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    session_id: Option<String>,
    /// The session's stage plan, by stage name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    stages: Vec<String>,
    /// The resource fails its probes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    sick: bool,
}

impl From<&FakeSnapshot> for StateFileDto {
    fn from(s: &FakeSnapshot) -> Self {
        Self {
            version: STATE_FILE_VERSION,
            lease_counter: s.lease_counter,
            session_counter: s.session_counter,
            latest_ms: s.latest.as_millis(),
            resources: s
                .resources
                .iter()
                .map(|r| ResourceDto {
                    run_uid: r.identity.run_uid.to_string(),
                    run_id: r.identity.run_id.as_str().to_owned(),
                    node_id: r.identity.node.to_string(),
                    attempt: r.identity.attempt.get(),
                    lease_id: r.lease.as_str().to_owned(),
                    endpoint: r.endpoint.as_str().to_owned(),
                    ready_at_ms: r.ready_at.as_millis(),
                    session_id: r.session.as_ref().map(|s| s.as_str().to_owned()),
                    stages: r.stages.iter().map(|st| st.name().to_owned()).collect(),
                    sick: r.sick,
                })
                .collect(),
        }
    }
}

impl TryFrom<ResourceDto> for FakeSnapshotResource {
    type Error = FieldError;

    fn try_from(r: ResourceDto) -> Result<Self, FieldError> {
        Ok(Self {
            identity: ResourceIdentity {
                run_uid: RunUid::parse("run_uid", &r.run_uid)?,
                run_id: RunId::parse("run_id", &r.run_id)?,
                node: LogicalNodeId::parse("node_id", &r.node_id)?,
                attempt: AttemptId::new(r.attempt),
            },
            lease: LeaseId::new("lease_id", &r.lease_id)?,
            endpoint: Endpoint::new("endpoint", &r.endpoint)?,
            ready_at: UnixMillis::new(r.ready_at_ms),
            session: r
                .session_id
                .map(|s| SessionId::new("session_id", &s))
                .transpose()?,
            stages: r
                .stages
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    BootstrapStage::from_name(name).ok_or_else(|| {
                        FieldError::new(
                            format!("stages[{i}]"),
                            contract::Problem::Malformed("an unknown bootstrap stage"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
            sick: r.sick,
        })
    }
}

fn snapshot_from_dto(path: &Path, dto: StateFileDto) -> Result<FakeSnapshot, FakeBackendError> {
    let malformed = |reason: String| FakeBackendError::MalformedState {
        path: path.to_owned(),
        reason,
    };
    if dto.version != STATE_FILE_VERSION {
        return Err(malformed(format!(
            "version {} is not the supported version {STATE_FILE_VERSION}",
            dto.version
        )));
    }
    let resources = dto
        .resources
        .into_iter()
        .enumerate()
        .map(|(i, r)| FakeSnapshotResource::try_from(r).map_err(|e| e.within(&format!("resources[{i}]"))))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| malformed(e.to_string()))?;
    Ok(FakeSnapshot {
        resources,
        lease_counter: dto.lease_counter,
        session_counter: dto.session_counter,
        latest: UnixMillis::new(dto.latest_ms),
    })
}

/// Loads the state file; `None` when it does not exist yet (a first start).
fn load_state(path: &Path) -> Result<Option<FakeSnapshot>, FakeBackendError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(FakeBackendError::ReadState {
                path: path.to_owned(),
                source,
            });
        }
    };
    let dto: StateFileDto = serde_json::from_slice(&bytes).map_err(|e| FakeBackendError::MalformedState {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    snapshot_from_dto(path, dto).map(Some)
}

/// Writes the state file whole: to `<path>.tmp`, flushed to disk, then renamed
/// over `path`.
fn write_state(path: &Path, snapshot: &FakeSnapshot) -> Result<(), FakeBackendError> {
    let write_error = |source| FakeBackendError::WriteState {
        path: path.to_owned(),
        source,
    };
    let bytes =
        serde_json::to_vec(&StateFileDto::from(snapshot)).map_err(|e| write_error(io::Error::other(e)))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let write = || -> io::Result<()> {
        use std::io::Write as _;
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&bytes)?;
        // No fsync: the file must outlive a process restart, which the rename
        // gives, not a power cut. An fsync per operation, taken under the
        // provider's lock, would serialise every call behind the disk.
        std::fs::rename(&tmp, path)
    };
    write().map_err(write_error)
}

// Tests panic on purpose when a fixture is malformed or an expectation fails.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use contract::{
        BootstrapStage, Epoch, OperationId, Params, SystemClock, TraceContext, shape::example_template,
    };
    use tokio::sync::mpsc;

    use super::*;
    use crate::backend::{ObservationReceiver, observation_queue};

    /// A path named `name` in a directory of its own, removed with the
    /// returned guard.
    fn temp_path(name: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix("executor-svc-fake-")
            .tempdir()
            .unwrap();
        let path = dir.path().join(name);
        (dir, path)
    }

    fn op(attempt: u64, seq: u32, input: OperationInput) -> Operation {
        Operation {
            run_uid: RunUid::from_u128(0xabc),
            run_id: RunId::parse("run_id", "train").unwrap(),
            node: LogicalNodeId::parse("node", "workers-0").unwrap(),
            id: OperationId::new(AttemptId::new(attempt), seq),
            epoch: Epoch::new(1),
            deadline: UnixMillis::MAX,
            provider: "fake".into(),
            input,
            trace: TraceContext {
                traceparent: format!("00-{:032x}-{:016x}-01", 7, 9),
                tracestate: String::new(),
            },
        }
    }

    fn create() -> Operation {
        op(
            1,
            0,
            OperationInput::CreateLease {
                template: Arc::new(example_template("fake", "img:1")),
            },
        )
    }

    fn facts(outcome: Outcome) -> contract::ResultFacts {
        match outcome {
            Outcome::Succeeded(f) => f,
            other => panic!("expected success, got {other:?}"),
        }
    }

    fn quick() -> FakeConfig {
        FakeConfig {
            latency_ms: (0, 0),
            stage_interval_ms: 5,
            ..FakeConfig::default()
        }
    }

    /// The `StartBootstrap` of attempt 1 on `lease`.
    fn start_bootstrap(lease: contract::LeaseId) -> Operation {
        op(
            1,
            1,
            OperationInput::StartBootstrap {
                lease,
                endpoint: Endpoint::new("endpoint", "10.0.0.1:22").unwrap(),
                boot: Params::new(),
                join: Params::new(),
            },
        )
    }

    fn sink() -> (ObservationSink, ObservationReceiver) {
        let (tx, rx) = observation_queue();
        (ObservationSink::new(tx, create().trace), rx)
    }

    #[tokio::test]
    async fn stages_reach_the_sink_of_the_start_with_its_trace() {
        let backend = FakeBackend::start(quick(), None, Arc::new(SystemClock)).unwrap();
        let (s, mut rx) = sink();
        let lease = facts(backend.execute(create(), s.clone()).await).lease.unwrap();
        let start = start_bootstrap(lease);
        let session = facts(backend.execute(start, s).await).session.unwrap();
        let mut stages = Vec::new();
        while let Some(o) = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
        {
            assert_eq!(o.session, session);
            assert_eq!(o.trace, create().trace);
            stages.push(o.stage);
            if o.stage == BootstrapStage::Converged {
                break;
            }
        }
        assert_eq!(stages.len(), 5, "{stages:?}");
        // The finished session no longer holds a sink.
        assert!(backend.shared.lock().sinks.is_empty());
    }

    /// Every stage of a session falls due at once (the emitter ran late):
    /// each still goes to the sink of the call that started the session,
    /// with its trace, not to the sink of restored sessions.
    #[tokio::test]
    async fn stages_due_together_keep_the_trace_of_their_start() {
        let clock = contract::ManualClock::new(UnixMillis::new(1_000_000));
        let backend = FakeBackend::start(quick(), None, Arc::new(clock.clone())).unwrap();
        let (restored_tx, mut restored) = observation_queue();
        backend.resume(ObservationSink::new(restored_tx, TraceContext::default()));
        let (s, mut rx) = sink();
        let lease = facts(backend.execute(create(), s.clone()).await).lease.unwrap();
        let start = start_bootstrap(lease);
        let _ = facts(backend.execute(start, s).await);
        clock.advance(60_000);
        backend.shared.wake.notify_one();
        let mut stages = Vec::new();
        while let Some(o) = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
        {
            assert_eq!(o.trace, create().trace);
            stages.push(o.stage);
            if o.stage == BootstrapStage::Converged {
                break;
            }
        }
        assert_eq!(stages.len(), 5, "{stages:?}");
        assert!(
            restored.try_recv().is_err(),
            "a stage went to the restored sessions' sink"
        );
    }

    /// A paged read lists what a whole one does, and a resource that lives
    /// through the read once, whatever is made and destroyed between pages.
    #[tokio::test]
    async fn a_paged_read_lists_each_resource_living_through_it_once() {
        let backend = FakeBackend::start(quick(), None, Arc::new(SystemClock)).unwrap();
        let at = |attempt: u64, seq: u32, input: OperationInput| {
            let mut o = op(attempt, seq, input);
            o.id = OperationId::new(AttemptId::new(attempt), seq);
            o
        };
        let create_at = |attempt| at(attempt, 0, create().input);
        for attempt in 1..=10 {
            let _ = facts(backend.execute(create_at(attempt), sink().0).await);
        }
        let attempts = |items: &[InventoryItem]| -> Vec<u64> {
            items.iter().map(|i| i.identity.attempt.get()).collect()
        };
        let whole = backend.inventory().await.unwrap();
        let pages: Vec<Vec<InventoryItem>> = backend.pages(3).map(Result::unwrap).collect().await;
        assert_eq!(pages.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 3, 1]);
        assert_eq!(pages.concat(), whole);
        assert_eq!(attempts(&whole), (1..=10).collect::<Vec<_>>());

        let mut read = backend.pages(3);
        let mut listed = read.next().await.unwrap().unwrap();
        // Between pages: one already listed and one not yet are destroyed,
        // and one is made past the cursor.
        for gone in [2, 5] {
            let destroy = at(gone, 9, OperationInput::DestroyLease { lease: None });
            let _ = facts(backend.execute(destroy, sink().0).await);
        }
        let _ = facts(backend.execute(create_at(11), sink().0).await);
        while let Some(page) = read.next().await {
            listed.extend(page.unwrap());
        }
        assert_eq!(attempts(&listed), [1, 2, 3, 4, 6, 7, 8, 9, 10, 11]);
    }

    #[tokio::test]
    async fn the_state_file_keeps_leases_across_restarts() {
        let (_dir, path) = temp_path("fake-state.json");
        let first = FakeBackend::start(quick(), Some(path.clone()), Arc::new(SystemClock)).unwrap();
        let made = facts(first.execute(create(), sink().0).await);
        drop(first);

        let second = FakeBackend::start(quick(), Some(path.clone()), Arc::new(SystemClock)).unwrap();
        let listed = second.inventory().await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].lease, made.lease);
        assert_eq!(listed[0].endpoint, made.endpoint);
        let adopted = facts(second.execute(create(), sink().0).await);
        assert_eq!(adopted.lease, made.lease);
        assert_eq!(second.with_provider(|p| (p.creates(), p.adoptions())), (0, 1));

        // A new identity gets a new lease id, not a restored one's.
        let mut other = create();
        other.id = OperationId::new(AttemptId::new(2), 0);
        let fresh = facts(second.execute(other, sink().0).await);
        assert_ne!(fresh.lease, made.lease);

        // Destroying removes it from the file too.
        let destroy = op(1, 2, OperationInput::DestroyLease { lease: None });
        let _ = facts(second.execute(destroy, sink().0).await);
        let reloaded = load_state(&path).unwrap().unwrap();
        assert_eq!(reloaded.resources.len(), 1);
        assert_eq!(reloaded.resources[0].identity.attempt, AttemptId::new(2));
    }

    #[tokio::test]
    async fn a_malformed_state_file_is_refused_with_the_field() {
        let (_dir, path) = temp_path("bad.json");
        std::fs::write(&path, "{not json").unwrap();
        let err = FakeBackend::start(quick(), Some(path.clone()), Arc::new(SystemClock)).unwrap_err();
        assert!(matches!(err, FakeBackendError::MalformedState { .. }), "{err}");

        let bad_uid = r#"{"version":1,"lease_counter":1,"session_counter":0,"latest_ms":0,
            "resources":[{"run_uid":"xyz","run_id":"r","node_id":"w-0","attempt":1,
            "lease_id":"lease-1","endpoint":"10.0.0.1:22","ready_at_ms":0}]}"#;
        std::fs::write(&path, bad_uid).unwrap();
        let err = FakeBackend::start(quick(), Some(path), Arc::new(SystemClock)).unwrap_err();
        assert!(err.to_string().contains("resources[0].run_uid"), "{err}");
    }

    fn watched(backend: &FakeBackend) -> mpsc::UnboundedReceiver<RawChange> {
        let (tx, rx) = mpsc::unbounded_channel();
        backend.watch(ChangeSink::new(tx));
        rx
    }

    async fn next_change(rx: &mut mpsc::UnboundedReceiver<RawChange>) -> RawChange {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap()
    }

    #[tokio::test]
    async fn a_resource_lost_at_a_fault_tick_is_reported_and_leaves_the_inventory() {
        let (_dir, path) = temp_path("lost.json");
        let clock = Arc::new(contract::ManualClock::new(UnixMillis::new(1_000_000)));
        let backend = FakeBackend::start(quick(), Some(path.clone()), clock.clone()).unwrap();
        let mut changes = watched(&backend);
        let made = facts(backend.execute(create(), sink().0).await);
        assert_eq!(backend.inventory().await.unwrap().len(), 1);
        backend.set_faults(FaultRates {
            lose: 1.0,
            ..FaultRates::none()
        });
        // The ticks count from the start of the watch; the next one loses
        // the resource. `set_faults` wakes the emitter at once.
        clock.advance(2_000);
        backend.set_faults(FaultRates {
            lose: 1.0,
            ..FaultRates::none()
        });
        let lost = next_change(&mut changes).await;
        assert_eq!(lost.identity, create().identity());
        assert!(
            matches!(&lost.change, Change::Lost { reason } if reason.contains("injected")),
            "{lost:?}"
        );
        assert!(
            lost.at.as_millis() % 1_000 == 0 && lost.at <= clock.now(),
            "{lost:?}"
        );
        assert!(backend.inventory().await.unwrap().is_empty());
        // The state file agrees, and a create of the identity makes a new lease.
        assert!(load_state(&path).unwrap().unwrap().resources.is_empty());
        backend.set_faults(FaultRates::none());
        let again = facts(backend.execute(create(), sink().0).await);
        assert_ne!(again.lease, made.lease);
        assert!(changes.try_recv().is_err());
    }

    #[tokio::test]
    async fn faults_on_request_are_reported_or_fail_probes() {
        let backend = FakeBackend::start(quick(), None, Arc::new(SystemClock)).unwrap();
        let mut changes = watched(&backend);
        let made = facts(backend.execute(create(), sink().0).await);
        let id = create().identity();
        let endpoint = made.endpoint.unwrap();
        assert_eq!(backend.probe(&id, &endpoint).await, Ok(()));

        backend
            .apply_fault(id.run_uid, &id.node, id.attempt, ResourceFault::Sicken)
            .unwrap();
        assert!(backend.probe(&id, &endpoint).await.is_err());
        backend
            .apply_fault(id.run_uid, &id.node, id.attempt, ResourceFault::Heal)
            .unwrap();
        assert_eq!(backend.probe(&id, &endpoint).await, Ok(()));
        // Sickness and healing are found by probing, not reported.
        assert!(changes.try_recv().is_err());

        backend
            .apply_fault(id.run_uid, &id.node, id.attempt, ResourceFault::Lose)
            .unwrap();
        let lost = next_change(&mut changes).await;
        assert_eq!(lost.identity, id);
        assert!(matches!(lost.change, Change::Lost { .. }));
        assert!(backend.inventory().await.unwrap().is_empty());
        // Nothing is held any more: every fault names nothing.
        let err = backend
            .apply_fault(id.run_uid, &id.node, id.attempt, ResourceFault::Heal)
            .unwrap_err();
        assert_eq!(err.attempt, id.attempt);
        assert!(err.to_string().contains("no resource"), "{err}");
    }
}
