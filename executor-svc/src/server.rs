//! The executor's gRPC service: the driver link and the inventory.
//!
//! **Architecture Invariant:** one actor task owns the [`ExecutorCore`]; nothing
//! else reads or writes it. Link handlers, backend calls and the bootstrap stage
//! sink only send the actor an `Event`, and the actor folds events one at a
//! time in `Actor::fold`. The actor never awaits anything but its next event:
//! backend calls run on tasks of their own, and messages to a driver are queued
//! with `try_send` (a link whose queue is full is closed; nothing is lost,
//! because results stay in the core until acknowledged and are re-sent when the
//! driver claims the run again).
//!
//! Routing: the latest link to claim a run receives the run's results and
//! observations; a rejection goes to the link whose message caused it. Results
//! produced while no link routes the run stay in the core until a driver claims
//! it. Acknowledgements and replays are honoured only from the link that routes
//! the run, so a fenced driver cannot acknowledge away what its successor needs.
//!
//! Tracing: each backend call is a span (`execute <effect>`), the child of the
//! driver's span for the operation, whose context the operation carries. The
//! result it produces, and the bootstrap observations of a session it starts,
//! carry the backend call's context back, so the driver's folds are its
//! children. Replays of recorded results carry the resubmission's context.

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use crate::budget::{Budget, BudgetConfig};
use contract::{
    Claim, Clock, Epoch, FieldError, InventoryResource, Monotonic, Observation, Operation, OperationId,
    OperationResult, Outcome, Rejection, RejectionReason, ResourceChange, RunUid, SessionId, TraceContext,
    WatchHealth,
    pages::{self, PageStream},
    pb::{
        self,
        executor_server::{Executor, ExecutorServer},
    },
    wire::{trace_from_wire, trace_to_wire},
};
use futures::StreamExt as _;
use platform::{
    event_trace::{self, ChangeRec, ObsRec, OpRec, RejRec, ResultRec, SeqRef, TraceEvent},
    metrics::{Counter, Gauge, Histogram, LATENCY_BUCKETS},
    runtime::health_and_reflection,
    telemetry::{self, grpc::ServerLayer},
};
use tokio::{
    net::TcpListener,
    sync::{
        mpsc::{self, error::TrySendError},
        oneshot, watch,
    },
    task::AbortHandle,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument as _;

use crate::{
    backend::{
        Backend, BackendError, ChangeSink, InventoryItem, ObservationReceiver, ObservationSender,
        ObservationSink, RawChange, RawObservation,
    },
    core::{ExecutorCore, Output},
    health,
};

/// The longest the actor sleeps before it reads the clock again while a
/// deadline is armed, so that a clock that jumps (or a virtual clock moved by a
/// test) is noticed within this much.
const MAX_TIMER_SLEEP: Duration = Duration::from_secs(1);

/// Events folded into one step (one store transaction) at most.
const MAX_BATCH: usize = 1024;

/// Tunables of the service.
#[derive(Debug, Clone)]
pub struct Config {
    /// Messages queued for one driver before the link counts as stuck and is
    /// closed.
    pub link_buffer: usize,
    /// Events queued for the actor before link readers and backend calls wait.
    pub event_buffer: usize,
    /// How long open links and calls may take to finish after shutdown starts.
    pub shutdown_grace: Duration,
    /// Where the executor keeps fencing epochs and completed results across its
    /// own restarts; `None` keeps them in memory only.
    pub state_dir: Option<std::path::PathBuf>,
    /// TLS and who may call (the driver); plaintext by default, for an
    /// executor embedded in a test.
    pub peers: platform::tls::PeerPolicy,
    /// Seals secret parameter values of the operations kept in `state_dir`.
    pub secrets: platform::secrets::Sealer,
    /// Caps on backend calls (see `budget`).
    pub budget: crate::budget::BudgetConfig,
    /// The largest message the executor accepts and sends.
    pub messages: platform::runtime::MessageLimits,
    /// Serve the fake backend's control service over this backend (a test
    /// double: `--fake-control`); `None`, as in production, serves nothing
    /// of it.
    pub fake_control: Option<crate::fake_backend::FakeBackend>,
    /// The providers the backend serves (see `providers`), told to every
    /// driver first on its link and again whenever they change; `None`
    /// tells nothing (a driver then checks no provider names).
    pub providers: Option<watch::Receiver<Vec<contract::ServedProvider>>>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            // Bursts of a large run are normal; only a driver that stopped
            // reading entirely should fill this.
            link_buffer: 1 << 20,
            event_buffer: 1024,
            shutdown_grace: Duration::from_secs(5),
            state_dir: None,
            peers: platform::tls::PeerPolicy::plaintext(),
            secrets: platform::secrets::Sealer::default(),
            budget: crate::budget::BudgetConfig::default(),
            messages: platform::runtime::MessageLimits::default(),
            fake_control: None,
            providers: None,
        }
    }
}

/// The executor's metrics (docs/observability.md, "Metrics"), in the
/// process-wide registry.
#[derive(Debug, Clone)]
struct ExecutorMetrics {
    started: Counter,
    completed: Counter,
    replayed: Counter,
    late: Counter,
    backend_call: Histogram,
    running: Gauge,
    observations: Counter,
    observations_coalesced: Counter,
    resource_changes: Counter,
    rejections: Counter,
    links: Gauge,
    budget_waiting: Gauge,
    budget_waits: Counter,
}

/// An outcome's class in the `outcome` label (`Outcome::class_name`).
const OUTCOME_CLASSES: [&str; 5] = [
    "succeeded",
    "not-ready",
    "failed-retryable",
    "failed-permanent",
    "ambiguous",
];

impl ExecutorMetrics {
    fn new() -> Self {
        let m = Self::register();
        m.declare();
        m
    }

    /// Exports each counter's known label values at zero from the start.
    fn declare(&self) {
        for effect in contract::Effect::ALL.map(contract::Effect::name) {
            for counter in [&self.started, &self.replayed, &self.late] {
                counter.init(&[effect]);
            }
            for outcome in OUTCOME_CLASSES {
                self.completed.init(&[effect, outcome]);
            }
        }
        for held in [
            crate::budget::Held::ProviderInflight,
            crate::budget::Held::ProviderRate,
            crate::budget::Held::RunInflight,
            crate::budget::Held::RunRate,
        ] {
            self.budget_waits.init(&[held.name()]);
        }
        for stage in contract::BootstrapStage::ALL {
            self.observations.init(&[stage.name()]);
        }
        self.observations_coalesced.init(&[]);
        for change in ["lost", "healthy", "unhealthy"] {
            self.resource_changes.init(&[change]);
        }
        for reason in [
            RejectionReason::Fenced,
            RejectionReason::ConflictingInput,
            RejectionReason::UnknownRun,
            RejectionReason::Invalid,
        ] {
            self.rejections.init(&[reason.name()]);
        }
    }

    fn register() -> Self {
        let r = platform::metrics::global();
        Self {
            started: r.counter(
                "provisioning_executor_operations_started_total",
                "Backend calls started, by effect.",
                &["effect"],
            ),
            completed: r.counter(
                "provisioning_executor_operations_completed_total",
                "Operations completed with a fresh result (replays and late completions not \
                 included), by effect and outcome class; abandoned operations count as ambiguous.",
                &["effect", "outcome"],
            ),
            replayed: r.counter(
                "provisioning_executor_operations_replayed_total",
                "Resubmitted operations answered with their recorded result, by effect.",
                &["effect"],
            ),
            late: r.counter(
                "provisioning_executor_late_completions_total",
                "Backend calls that finished after their operation was abandoned at its deadline.",
                &["effect"],
            ),
            backend_call: r.histogram(
                "provisioning_executor_backend_call_duration_seconds",
                "Backend call latency, by effect and outcome class (abandoned calls not included).",
                &["effect", "outcome"],
                LATENCY_BUCKETS,
            ),
            running: r.gauge(
                "provisioning_executor_operations_running",
                "Backend calls in progress.",
                &[],
            ),
            budget_waiting: r.gauge(
                "provisioning_executor_budget_waiting",
                "Operations waiting for the provider budget (or their run's) before their backend \
                 call starts.",
                &[],
            ),
            budget_waits: r.counter(
                "provisioning_executor_budget_waits_total",
                "Operations that had to wait for a budget, by what held them: provider-inflight, \
                 provider-rate, run-inflight, run-rate.",
                &["held"],
            ),
            observations: r.counter(
                "provisioning_executor_observations_total",
                "Bootstrap observations recorded and sent, by stage.",
                &["stage"],
            ),
            observations_coalesced: r.counter(
                "provisioning_executor_observations_coalesced_total",
                "Bootstrap stages that took the place of an earlier stage of their session still \
                 queued for the executor's actor (a backlog), so the earlier one was never sent, \
                 and stages dropped after a queued terminal stage of their session.",
                &[],
            ),
            resource_changes: r.counter(
                "provisioning_executor_resource_changes_total",
                "Changes seen in held resources outside any operation and sent to the driver, by \
                 change (lost, healthy, unhealthy).",
                &["change"],
            ),
            rejections: r.counter(
                "provisioning_executor_rejections_total",
                "Driver messages rejected, by reason.",
                &["reason"],
            ),
            links: r.gauge("provisioning_executor_links", "Driver links open.", &[]),
        }
    }
}

/// What can stop the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot set up gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("the gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error(transparent)]
    Store(#[from] crate::durable::StoreError),
    #[error("cannot set up TLS: {0}")]
    Tls(#[from] platform::tls::TlsError),
}

/// Why a request failed; [`to_status`] maps it to a gRPC status.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("{0}")]
    Invalid(#[from] FieldError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("the executor is shutting down")]
    ShuttingDown,
}

/// The one place where the service's errors become gRPC statuses.
fn to_status(e: RequestError) -> Status {
    match &e {
        RequestError::Invalid(_) => Status::invalid_argument(e.to_string()),
        RequestError::Backend(BackendError::Unavailable(_)) | RequestError::ShuttingDown => {
            Status::unavailable(e.to_string())
        }
        RequestError::Backend(BackendError::Internal(_)) => Status::internal(e.to_string()),
    }
}

/// Serves the executor (link and inventory), gRPC health and reflection on
/// `listener` until `shutdown` resolves, then drains: health turns
/// `NOT_SERVING`, every link is closed with `UNAVAILABLE`, and the server gets
/// `config.shutdown_grace` to finish before backend calls are aborted.
pub async fn run(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    config: Config,
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
) -> Result<(), ServerError> {
    // TLS is set up first: a certificate it cannot use stops the executor
    // before anything else starts.
    let incoming = config.peers.incoming(listener)?;
    let server = platform::runtime::server();
    let (reporter, health, reflection, reflection_alpha) =
        health_and_reflection::<ExecutorServer<ExecutorService>>().await?;

    let (events_tx, events_rx) = mpsc::channel(config.event_buffer.max(1));
    let (observations_tx, observations_rx) = crate::backend::observation_queue();
    let (lifecycle, lifecycle_rx) = watch::channel(Lifecycle::Serving);
    backend.resume(ObservationSink::new(
        observations_tx.clone(),
        TraceContext::default(),
    ));
    let (changes_tx, changes_rx) = mpsc::unbounded_channel();
    let changes = ChangeSink::new(changes_tx);
    backend.watch(changes.clone());
    let (health_tx, health_rx) = mpsc::unbounded_channel();
    let inventory_hint = health::InventoryHint::default();
    tokio::spawn(crate::health::run(
        Arc::clone(&backend),
        Arc::clone(&clock),
        health_rx,
        changes,
        inventory_hint.clone(),
    ));
    let mut actor = Actor::new(Arc::clone(&backend), clock, events_tx.clone(), observations_tx);
    actor.health = Some(health_tx);
    actor.inventory_hint = inventory_hint;
    actor.budget = Budget::new(config.budget, actor.clock.monotonic());
    if let Some(dir) = &config.state_dir {
        let store = crate::durable::ExecutorStore::open_sealed(dir, config.secrets.clone())?;
        actor.core = ExecutorCore::restore(store.load()?);
        actor.store = Some(store);
    }
    if let Some(mut served) = config.providers.clone() {
        actor.served = Some(served.borrow_and_update().clone());
        let events = events_tx.clone();
        tokio::spawn(async move {
            while served.changed().await.is_ok() {
                let now = served.borrow_and_update().clone();
                if events.send(Event::Providers(now)).await.is_err() {
                    break;
                }
            }
        });
    }
    let actor = tokio::spawn(actor.run(events_rx, observations_rx, changes_rx, lifecycle_rx));

    let service = ExecutorService {
        events: events_tx,
        backend,
        next_link: Arc::new(AtomicU64::new(1)),
        link_buffer: config.link_buffer.max(1),
    };
    let (drain_started, drain_started_rx) = oneshot::channel::<()>();
    let drain = lifecycle.clone();
    let signal = async move {
        shutdown.await;
        tracing::info!("shutting down: draining links");
        reporter
            .set_not_serving::<ExecutorServer<ExecutorService>>()
            .await;
        drain.send_replace(Lifecycle::Draining);
        let _ = drain_started.send(());
    };
    let router = server
        .layer(ServerLayer::new())
        .layer(config.peers.layer())
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(
            ExecutorServer::new(service)
                .max_decoding_message_size(config.messages.recv_bytes())
                .max_encoding_message_size(config.messages.send_bytes()),
        )
        .add_optional_service(config.fake_control.clone().map(crate::fake_control::server));
    let serve = platform::tls::serve(router, incoming, signal);
    let grace = config.shutdown_grace;
    let grace_elapsed = async move {
        match drain_started_rx.await {
            Ok(()) => tokio::time::sleep(grace).await,
            // The signal future was dropped without firing: the server ended on
            // its own, and `serve` has the answer.
            Err(_) => std::future::pending().await,
        }
    };
    let result = tokio::select! {
        r = serve => r.map_err(ServerError::from),
        () = grace_elapsed => {
            tracing::warn!(?grace, "shutdown grace elapsed; closing what is left");
            Ok(())
        }
    };
    lifecycle.send_replace(Lifecycle::Stopped);
    if let Err(e) = actor.await {
        tracing::error!(error = %e, "the executor actor ended abnormally");
    }
    result
}

// ---------------------------------------------------------------------------
// The gRPC service
// ---------------------------------------------------------------------------

/// Identifies one driver link for routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct LinkId(u64);

/// Identifies one backend call, so that a completion from an aborted call is not
/// mistaken for one of a later call of the same operation id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TaskId(u64);

type Outbound = mpsc::Sender<Result<pb::ExecutorMessage, Status>>;

struct ExecutorService {
    events: mpsc::Sender<Event>,
    backend: Arc<dyn Backend>,
    next_link: Arc<AtomicU64>,
    link_buffer: usize,
}

impl std::fmt::Debug for ExecutorService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutorService")
            .field("link_buffer", &self.link_buffer)
            .finish_non_exhaustive()
    }
}

impl ExecutorService {
    /// The live resources `req` asks for, from one read of the backend, each
    /// with its run's highest epoch.
    async fn inventory_of(&self, req: pb::InventoryRequest) -> Result<Listing, RequestError> {
        let items = match only_run(&req)? {
            Some(uid) => self.backend.inventory_of(uid).await?,
            None => self.backend.inventory().await?,
        };
        Listing::of(items, &self.events).await
    }
}

/// The run an inventory request names, if it names one.
fn only_run(req: &pb::InventoryRequest) -> Result<Option<RunUid>, RequestError> {
    if req.run_uid.is_empty() {
        return Ok(None);
    }
    Ok(Some(RunUid::parse("run_uid", &req.run_uid)?))
}

/// One read of the backend and the highest epoch of each run it lists.
///
/// Its items become inventory entries one at a time, as they are encoded:
/// converted whole, the read and its conversion were two copies of every
/// resource held at once (two listings of 112 MB at a million resources).
struct Listing {
    items: Vec<InventoryItem>,
    epochs: HashMap<RunUid, Epoch>,
}

impl Listing {
    /// `items`, with the highest epoch of each run they name, which the
    /// actor keeps.
    async fn of(items: Vec<InventoryItem>, events: &mpsc::Sender<Event>) -> Result<Self, RequestError> {
        // Each resource carries its run's highest epoch, so a driver that
        // reclaims it claims the run above that.
        let mut seen = std::collections::HashSet::new();
        let runs: Vec<RunUid> = items
            .iter()
            .map(|item| item.identity.run_uid)
            .filter(|uid| seen.insert(*uid))
            .collect();
        let (reply, epochs) = oneshot::channel();
        events
            .send(Event::Epochs {
                runs: runs.clone(),
                reply,
            })
            .await
            .map_err(|_| RequestError::ShuttingDown)?;
        let epochs = epochs.await.map_err(|_| RequestError::ShuttingDown)?;
        let epochs = runs
            .into_iter()
            .zip(epochs)
            .map(|(uid, e)| (uid, e.unwrap_or_default()))
            .collect();
        Ok(Listing { items, epochs })
    }

    /// Each item as the wire's resource, in the read's order, converted as
    /// it is drawn.
    fn into_wire(self) -> impl Iterator<Item = pb::Resource> + Send + 'static {
        let Listing { items, epochs } = self;
        items.into_iter().map(move |item| {
            let epoch = epochs.get(&item.identity.run_uid).copied().unwrap_or_default();
            pb::Resource::from(&InventoryResource {
                identity: item.identity,
                lease: item.lease,
                endpoint: item.endpoint,
                session_live: item.session_live,
                epoch,
            })
        })
    }
}

/// Forwards a link's inbound messages to the actor until the driver closes its
/// side, the stream fails, or the actor drops the link (`closed` resolves).
async fn read_link(
    link: LinkId,
    mut inbound: Streaming<pb::DriverMessage>,
    events: mpsc::Sender<Event>,
    mut closed: oneshot::Receiver<()>,
) {
    loop {
        tokio::select! {
            _ = &mut closed => break,
            message = inbound.message() => match message {
                Ok(Some(msg)) => {
                    let event = Event::FromDriver {
                        link,
                        msg: Box::new(msg),
                    };
                    if events.send(event).await.is_err() {
                        break;
                    }
                }
                Ok(None) => break,
                Err(status) => {
                    // A driver going away is routine; a message the link
                    // could not take (too large, malformed) is not, and the
                    // driver only sees its link break.
                    if matches!(
                        status.code(),
                        tonic::Code::ResourceExhausted
                            | tonic::Code::OutOfRange
                            | tonic::Code::InvalidArgument
                            | tonic::Code::Internal
                    ) {
                        tracing::warn!(link = link.0, %status, "driver link failed on a message it could not take");
                    } else {
                        tracing::debug!(link = link.0, %status, "driver link failed");
                    }
                    break;
                }
            },
        }
    }
    let _ = events.send(Event::LinkClosed { link }).await;
}

#[tonic::async_trait]
impl Executor for ExecutorService {
    type LinkStream = ReceiverStream<Result<pb::ExecutorMessage, Status>>;

    async fn link(
        &self,
        request: Request<Streaming<pb::DriverMessage>>,
    ) -> Result<Response<Self::LinkStream>, Status> {
        let inbound = request.into_inner();
        let link = LinkId(self.next_link.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = mpsc::channel(self.link_buffer);
        let (closer, closed) = oneshot::channel();
        // Sent before the reader starts, so the actor knows the link before any
        // of its messages.
        self.events
            .send(Event::LinkOpened { link, tx, closer })
            .await
            .map_err(|_| to_status(RequestError::ShuttingDown))?;
        tokio::spawn(read_link(link, inbound, self.events.clone(), closed));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn inventory(
        &self,
        request: Request<pb::InventoryRequest>,
    ) -> Result<Response<pb::InventoryResponse>, Status> {
        let listing = self.inventory_of(request.into_inner()).await.map_err(to_status)?;
        Ok(Response::new(pb::InventoryResponse {
            resources: listing.into_wire().collect(),
            last: false,
        }))
    }

    type InventoryPagesStream = PageStream<pb::InventoryResponse>;

    /// The backend's resources, read a page at a time and encoded as the
    /// driver reads them, each page's runs with their epochs: what is held
    /// is a page of the read, not the read. A request that names a run gets
    /// that run's resources, from one read.
    async fn inventory_pages(
        &self,
        request: Request<pb::InventoryRequest>,
    ) -> Result<Response<Self::InventoryPagesStream>, Status> {
        let req = request.into_inner();
        if only_run(&req).map_err(to_status)?.is_some() {
            let listing = self.inventory_of(req).await.map_err(to_status)?;
            return Ok(Response::new(pages::stream(listing.into_wire())));
        }
        let events = self.events.clone();
        let mut chunks = self
            .backend
            .inventory_pages()
            .then(move |read| {
                let events = events.clone();
                async move {
                    let listing = Listing::of(read?, &events).await?;
                    Ok::<_, RequestError>(listing.into_wire().collect::<Vec<_>>())
                }
            })
            .map(|chunk| chunk.map_err(to_status))
            .boxed();
        // A read that fails at once fails the call, as one read did.
        let first = match chunks.next().await {
            Some(Err(status)) => return Err(status),
            first => first,
        };
        Ok(Response::new(pages::stream_chunks(
            futures::stream::iter(first).chain(chunks),
        )))
    }
}

// ---------------------------------------------------------------------------
// The actor
// ---------------------------------------------------------------------------

/// Everything the actor reacts to; see `Actor::fold`.
#[derive(Debug)]
enum Event {
    /// A driver opened a link. Dropping `closer` tells the link's reader to stop.
    LinkOpened {
        link: LinkId,
        tx: Outbound,
        closer: oneshot::Sender<()>,
    },
    /// Boxed because a driver message is much larger than any other event.
    FromDriver {
        link: LinkId,
        msg: Box<pb::DriverMessage>,
    },
    LinkClosed {
        link: LinkId,
    },
    /// A backend call finished. `trace` is the call's span, which the result
    /// carries back to the driver.
    Completed {
        run_uid: RunUid,
        id: OperationId,
        task: TaskId,
        outcome: Outcome,
        trace: TraceContext,
    },
    /// A backend reported a bootstrap stage.
    Observation(RawObservation),
    /// What the executor serves changed (a plugin went down or came back).
    Providers(Vec<contract::ServedProvider>),
    /// A backend saw a resource it holds change (it is lost).
    ResourceChange(RawChange),
    /// The earliest deadline may have passed.
    Tick,
    /// The inventory asks for the highest epoch of each run it lists.
    Epochs {
        runs: Vec<RunUid>,
        reply: oneshot::Sender<Vec<Option<Epoch>>>,
    },
}

/// Where the server is in its life; the actor watches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lifecycle {
    Serving,
    /// Close every link and accept no new one.
    Draining,
    /// Abort backend calls and end.
    Stopped,
}

#[derive(Debug)]
struct LinkState {
    tx: Outbound,
    /// Held only to be dropped with the link, which stops its reader.
    _closer: oneshot::Sender<()>,
}

struct Actor {
    core: ExecutorCore,
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    /// Handed to backend calls for their completions.
    events: mpsc::Sender<Event>,
    /// Handed to backend calls, inside their sinks, for bootstrap stages.
    observations: ObservationSender,
    links: HashMap<LinkId, LinkState>,
    routes: HashMap<RunUid, LinkId>,
    /// Backend calls in progress, each with the flag that marks its span
    /// abandoned when the core abandons it (see `CallSpan`).
    tasks: HashMap<(RunUid, OperationId), (TaskId, AbortHandle, Arc<AtomicBool>)>,
    next_task: u64,
    draining: bool,
    store: Option<crate::durable::ExecutorStore>,
    /// Set when the store refused a write: nothing more is accepted.
    store_failed: bool,
    /// The health prober's commands (`None` in an actor without one).
    health: Option<mpsc::UnboundedSender<health::Command>>,
    /// Marked whenever the backend's resources may have changed (a result,
    /// a resource change), so that the prober reads the inventory again.
    inventory_hint: health::InventoryHint,
    metrics: ExecutorMetrics,
    /// Messages of the current step, sent by `flush` after its changes are
    /// durable.
    outbox: Vec<(LinkId, pb::ExecutorMessage)>,
    /// The current step's event-trace lines, written by `flush` with its
    /// messages (nothing when the trace is off).
    trace: event_trace::Deferred,
    /// Caps on backend calls; operations over them wait here.
    budget: Budget,
    /// Waiting operations the driver has been told about.
    told_waiting: HashSet<(RunUid, OperationId)>,
    /// The groups operations name, each kept once: an operation's node id
    /// outlives it in its result, its resource and its observations, and
    /// each decoded on its own held an allocation of its group's name.
    groups: contract::GroupInterner,
    /// What the executor serves, told first on every link (`None`: nothing
    /// is told).
    served: Option<Vec<contract::ServedProvider>>,
    /// Notices steps of the wall clock, which the operations' deadlines
    /// follow ([`Actor::follow_clock_step`]).
    steps: contract::StepWatch,
}

/// The message that tells a driver what the executor serves.
fn providers_message(served: &[contract::ServedProvider]) -> pb::ExecutorMessage {
    pb::ExecutorMessage {
        kind: Some(pb::executor_message::Kind::Providers(pb::ProvidersServed {
            providers: served.iter().map(pb::ServedProvider::from).collect(),
        })),
        ..Default::default()
    }
}

async fn sleep_for(delay: Option<Duration>) {
    match delay {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

impl Actor {
    fn new(
        backend: Arc<dyn Backend>,
        clock: Arc<dyn Clock>,
        events: mpsc::Sender<Event>,
        observations: ObservationSender,
    ) -> Self {
        Self {
            core: ExecutorCore::new(),
            backend,
            events,
            observations,
            links: HashMap::new(),
            routes: HashMap::new(),
            tasks: HashMap::new(),
            next_task: 0,
            draining: false,
            store: None,
            health: None,
            inventory_hint: health::InventoryHint::default(),
            store_failed: false,
            metrics: ExecutorMetrics::new(),
            outbox: Vec::new(),
            trace: event_trace::Deferred::default(),
            budget: Budget::new(BudgetConfig::default(), Monotonic::default()),
            told_waiting: HashSet::new(),
            groups: contract::GroupInterner::default(),
            served: None,
            steps: contract::StepWatch::new(clock.as_ref()),
            clock,
        }
    }

    /// Moves the operations' deadlines with a step of the wall clock (NTP
    /// stepping it, an operator setting it), before anything compares them
    /// with the new time: the driver moves its own deadlines for them by
    /// the same step, and an operation keeps the time it had left.
    fn follow_clock_step(&mut self) {
        let _ = self.now_following_steps();
    }

    /// The wall time now, with the operations' deadlines moved first if the
    /// clock stepped since the last look (one reading for both; see
    /// [`contract::StepWatch::read`]). What hands the core a time reads it
    /// here.
    fn now_following_steps(&mut self) -> contract::UnixMillis {
        let (now, step) = self.steps.read(self.clock.as_ref());
        if let Some(by) = step {
            let moved = self.core.shift_deadlines(by);
            tracing::warn!(
                step_ms = by,
                operations = moved,
                "the wall clock stepped: the operations' deadlines moved with it"
            );
        }
        now
    }

    async fn run(
        mut self,
        mut events: mpsc::Receiver<Event>,
        mut observations: ObservationReceiver,
        mut changes: mpsc::UnboundedReceiver<RawChange>,
        mut lifecycle: watch::Receiver<Lifecycle>,
    ) {
        let mut coalesced_seen = 0;
        loop {
            self.follow_clock_step();
            // Armed afresh after every event: any event can move the earliest
            // deadline.
            let timer = self
                .core
                .poll_timeout()
                .map(|at| at.saturating_since(self.clock.now()).min(MAX_TIMER_SLEEP));
            // A rate cap holding the queue wakes the actor when it allows a start.
            let budget_wake = self
                .budget
                .next_wake()
                .map(|at| at.saturating_since(self.clock.monotonic()));
            let timer = match (timer, budget_wake) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let event = tokio::select! {
                changed = lifecycle.changed() => {
                    let state = *lifecycle.borrow_and_update();
                    match (changed, state) {
                        (Err(_), _) | (Ok(()), Lifecycle::Stopped) => break,
                        (Ok(()), Lifecycle::Draining) => {
                            self.drain();
                            continue;
                        }
                        (Ok(()), Lifecycle::Serving) => continue,
                    }
                }
                event = events.recv() => match event {
                    Some(event) => event,
                    None => break,
                },
                Some(raw) = observations.recv() => Event::Observation(raw),
                Some(raw) = changes.recv() => Event::ResourceChange(raw),
                () = sleep_for(timer) => Event::Tick,
            };
            self.fold(event);
            // Whatever else is already queued joins this step, so that its
            // changes are written in one transaction (one fsync) before any of
            // its messages leave. With a store, and more calls running than
            // the step holds, the actor lets them run once before it writes:
            // calls to a plugin end one at a time, and each step that held
            // one or two paid a transaction of its own (the plugin-hosted row
            // at 100,000: 10-18% less time and executor CPU).
            let mut folded = 1;
            let mut yielded = false;
            while folded < MAX_BATCH {
                let next = match events.try_recv() {
                    Ok(ev) => ev,
                    Err(_) => match observations.try_recv() {
                        Ok(raw) => Event::Observation(raw),
                        Err(_) => match changes.try_recv() {
                            Ok(raw) => Event::ResourceChange(raw),
                            Err(_) if !yielded && self.store.is_some() && self.tasks.len() > folded => {
                                yielded = true;
                                tokio::task::yield_now().await;
                                continue;
                            }
                            Err(_) => break,
                        },
                    },
                };
                self.fold(next);
                folded += 1;
            }
            self.start_admitted();
            self.flush();
            self.metrics.running.set(&[], self.tasks.len() as f64);
            self.metrics.budget_waiting.set(&[], self.budget.waiting() as f64);
            self.metrics.links.set(&[], self.links.len() as f64);
            let coalesced = observations.coalesced();
            if coalesced != coalesced_seen {
                self.metrics.observations_coalesced.mirror(&[], coalesced);
                coalesced_seen = coalesced;
            }
        }
        self.stop();
        self.metrics.running.set(&[], 0.0);
        self.metrics.links.set(&[], 0.0);
    }

    /// Folds one event into the core and carries out what the core asks.
    fn fold(&mut self, event: Event) {
        self.follow_clock_step();
        match event {
            Event::LinkOpened { link, tx, closer } => {
                if self.draining {
                    let _ = tx.try_send(Err(to_status(RequestError::ShuttingDown)));
                    return;
                }
                self.links.insert(link, LinkState { tx, _closer: closer });
                if let Some(served) = &self.served {
                    self.send(link, providers_message(served));
                }
            }
            Event::Providers(served) => {
                let msg = providers_message(&served);
                let links: Vec<LinkId> = self.links.keys().copied().collect();
                for link in links {
                    self.send(link, msg.clone());
                }
                self.served = Some(served);
            }
            Event::FromDriver { link, msg } => {
                // Messages still queued from a link that was closed (stuck, or
                // drained at shutdown) have no one to answer and are dropped.
                if self.links.contains_key(&link) {
                    self.on_driver_message(link, *msg);
                }
            }
            Event::LinkClosed { link } => self.close_link(link),
            Event::Epochs { runs, reply } => {
                let _ = reply.send(runs.iter().map(|uid| self.core.highest_epoch(*uid)).collect());
            }
            Event::Completed {
                run_uid,
                id,
                task,
                outcome,
                trace,
            } => {
                let key = (run_uid, id);
                self.trace.push(|| TraceEvent::CallCompleted {
                    run: run_uid.to_string(),
                    id: id.to_string(),
                    outcome: outcome.class_name().to_owned(),
                    current: self
                        .tasks
                        .get(&key)
                        .is_some_and(|(current, _, _)| *current == task),
                });
                match self.tasks.get(&key) {
                    Some((current, _, _)) if *current == task => {
                        self.tasks.remove(&key);
                        self.budget.finished(run_uid);
                    }
                    // A newer call of the same id runs (the run was forgotten and
                    // the operation resubmitted): this one's outcome is stale.
                    Some(_) => return,
                    // Aborted after it finished: the core reports it as late.
                    None => {}
                }
                let now = self.now_following_steps();
                let mut out = self.core.complete(run_uid, id, outcome, now);
                // The result this call produced goes back under the call's
                // span, so the driver's fold is its child.
                for o in &mut out {
                    if let Output::Result(r) = o
                        && r.run_uid == run_uid
                        && r.id == id
                        && !trace.traceparent.is_empty()
                    {
                        r.trace = trace.clone();
                    }
                }
                self.apply(out, None, &TraceContext::default());
            }
            Event::Observation(raw) => {
                let out = self.core.record_observation(
                    &raw.identity,
                    raw.session,
                    raw.stage,
                    raw.detail,
                    raw.at,
                    raw.trace,
                );
                self.apply(out, None, &TraceContext::default());
            }
            Event::ResourceChange(raw) => {
                self.inventory_hint.mark();
                tracing::info!(identity = ?raw.identity, change = ?raw.change, "a resource changed");
                let out = self
                    .core
                    .record_resource_change(&raw.identity, raw.change, raw.at);
                self.apply(out, None, &TraceContext::default());
            }
            Event::Tick => {
                let now = self.now_following_steps();
                let out = self.core.handle_timeout(now);
                self.apply(out, None, &TraceContext::default());
            }
        }
    }

    fn on_driver_message(&mut self, link: LinkId, msg: pb::DriverMessage) {
        use pb::driver_message::Kind;
        let trace = trace_from_wire(msg.trace);
        match msg.kind {
            None => {
                let e = FieldError::new("kind", contract::Problem::Missing);
                self.reject_invalid(link, String::new(), None, "driver message", &e, &trace);
            }
            Some(Kind::Claim(c)) => self.on_claim(link, c, &trace),
            Some(Kind::Submit(op)) => self.on_submit(link, op, &trace),
            Some(Kind::Ack(ack)) => self.on_ack(link, ack, &trace),
            Some(Kind::ObserveFrom(from)) => self.on_observe_from(link, from, &trace),
            Some(Kind::Forget(forget)) => self.on_forget(link, forget, &trace),
            Some(Kind::Watch(watch)) => self.on_watch(link, watch, &trace),
        }
    }

    /// How to probe a run's resources: from the link that routes the run, at
    /// its claimed epoch; the prober takes it from there.
    fn on_watch(&mut self, link: LinkId, watch: pb::WatchHealth, trace: &TraceContext) {
        let raw_uid = watch.run_uid.clone();
        let watch = match WatchHealth::try_from(watch) {
            Ok(w) => w,
            Err(e) => return self.reject_invalid(link, raw_uid, None, "watch", &e, trace),
        };
        if !self.routed_here(link, watch.run_uid, None, "watch", trace) {
            return;
        }
        if self.core.highest_epoch(watch.run_uid) != Some(watch.epoch) {
            tracing::debug!(run = %watch.run_uid, epoch = %watch.epoch, "health policy of an old epoch ignored");
            return;
        }
        if let Some(h) = &self.health {
            let _ = h.send(health::Command::Policy(watch));
        }
    }

    fn on_claim(&mut self, link: LinkId, claim: pb::Claim, trace: &TraceContext) {
        let raw_uid = claim.run_uid.clone();
        let claim = match Claim::try_from(claim) {
            Ok(claim) => claim,
            Err(e) => return self.reject_invalid(link, raw_uid, None, "claim", &e, trace),
        };
        if self.store_failed {
            let e = FieldError::new(
                "claim",
                contract::Problem::Malformed("the executor's store failed; it accepts no work"),
            );
            return self.reject_invalid(link, raw_uid, None, "claim", &e, trace);
        }
        let claimed = self.core.claim(&claim);
        self.trace.push(|| TraceEvent::ClaimReceived {
            run: claim.run_uid.to_string(),
            epoch: claim.epoch.get(),
            link: link.0,
            accepted: claimed.is_ok(),
        });
        match claimed {
            Ok(()) => {
                // The acceptance leaves with the step's flush, after the epoch
                // is durable.
                let run_uid = claim.run_uid;
                self.routes.insert(run_uid, link);
                let accepted = pb::executor_message::Kind::Claimed(pb::ClaimAccepted {
                    run_uid: run_uid.to_string(),
                    epoch: claim.epoch.get(),
                });
                self.send(link, message(accepted, trace));
                // A new link may be a reconnect: whatever the driver has not
                // acknowledged may never have reached it.
                for result in self.core.unacked_results_of(run_uid) {
                    self.trace.push(|| TraceEvent::ResultOut {
                        result: ResultRec::of(&result),
                        resend: true,
                    });
                    self.send(link, result_message(&result));
                }
                for change in self.core.unacked_resource_changes_of(run_uid) {
                    self.trace.push(|| TraceEvent::ChangeOut {
                        change: ChangeRec::of(&change),
                        resend: true,
                    });
                    self.send(link, change_message(&change));
                }
                // Observations are not re-sent here: the driver asks for each
                // session's after its last folded sequence (`ObserveFrom`), and
                // sending them twice would double every replay.
            }
            Err(rejection) => {
                self.metrics.rejections.inc(&[rejection.reason.name()]);
                self.trace.push(|| TraceEvent::RejectionOut {
                    rejection: RejRec::of(&rejection),
                });
                self.send(link, rejection_message(&rejection, trace));
            }
        }
    }

    fn on_submit(&mut self, link: LinkId, op: pb::Operation, trace: &TraceContext) {
        let (raw_uid, raw_id) = (op.run_uid.clone(), op.id);
        let mut op = match Operation::try_from(op) {
            Ok(op) => op,
            Err(e) => return self.reject_invalid(link, raw_uid, raw_id, "operation", &e, trace),
        };
        if let Ok(group) = self.groups.group("node_id", op.node.group().as_str()) {
            op.node = contract::LogicalNodeId::new(group, op.node.index());
        }
        // A rejection answers the operation, so it joins the operation's trace,
        // or the message's when the operation carries none.
        let trace = if op.trace == TraceContext::default() {
            trace.clone()
        } else {
            op.trace.clone()
        };
        if self.store_failed {
            let e = FieldError::new(
                "operation",
                contract::Problem::Malformed("the executor's store failed; it accepts no work"),
            );
            return self.reject_invalid(link, raw_uid, raw_id, "operation", &e, &trace);
        }
        self.trace.push(|| TraceEvent::OpReceived {
            op: OpRec::of(&op),
            link: link.0,
        });
        let now = self.now_following_steps();
        let out = self.core.submit(op, now);
        self.apply(out, Some(link), &trace);
    }

    fn on_ack(&mut self, link: LinkId, ack: pb::Ack, trace: &TraceContext) {
        self.trace.push(|| TraceEvent::AckReceived {
            run: ack
                .results
                .first()
                .map(|r| r.run_uid.clone())
                .or_else(|| ack.observations.first().map(|o| o.run_uid.clone()))
                .or_else(|| ack.changes.first().map(|c| c.run_uid.clone()))
                .unwrap_or_default(),
            results: ack
                .results
                .iter()
                .filter_map(|r| r.id)
                .filter_map(|id| OperationId::try_from(id).ok())
                .map(|id| id.to_string())
                .collect(),
            observations: ack
                .observations
                .iter()
                .map(|o| SeqRef {
                    session: o.session_id.clone(),
                    seq: o.seq,
                })
                .collect(),
            changes: ack.changes.iter().map(|c| c.seq).collect(),
        });
        for r in ack.results {
            let raw_uid = r.run_uid.clone();
            let parsed = RunUid::parse("run_uid", &r.run_uid).and_then(|uid| {
                let id =
                    r.id.ok_or_else(|| FieldError::new("id", contract::Problem::Missing))
                        .and_then(|id| OperationId::try_from(id).map_err(|e| e.within("id")))?;
                Ok((uid, id))
            });
            match parsed {
                Ok((run_uid, id)) => {
                    if self.routed_here(link, run_uid, Some(id), "acknowledge", trace) {
                        self.core.ack_result(run_uid, id);
                    }
                }
                Err(e) => self.reject_invalid(link, raw_uid, r.id, "result acknowledgement", &e, trace),
            }
        }
        self.on_ack_changes(link, ack.changes, trace);
        for o in ack.observations {
            let raw_uid = o.run_uid.clone();
            let parsed = RunUid::parse("run_uid", &o.run_uid)
                .and_then(|uid| Ok((uid, SessionId::new("session_id", &o.session_id)?)));
            match parsed {
                Ok((run_uid, session)) => {
                    if self.routed_here(link, run_uid, None, "acknowledge", trace) {
                        self.core.ack_observations(run_uid, &session, o.seq);
                    }
                }
                Err(e) => self.reject_invalid(link, raw_uid, None, "observation acknowledgement", &e, trace),
            }
        }
    }

    fn on_ack_changes(&mut self, link: LinkId, changes: Vec<pb::ChangeRef>, trace: &TraceContext) {
        for c in changes {
            match RunUid::parse("run_uid", &c.run_uid) {
                Ok(run_uid) => {
                    if self.routed_here(link, run_uid, None, "acknowledge", trace) {
                        self.core.ack_resource_change(run_uid, c.seq);
                    }
                }
                Err(e) => self.reject_invalid(
                    link,
                    c.run_uid.clone(),
                    None,
                    "resource change acknowledgement",
                    &e,
                    trace,
                ),
            }
        }
    }

    fn on_observe_from(&mut self, link: LinkId, from: pb::ObserveFrom, trace: &TraceContext) {
        for cursor in from.after {
            // A cursor may leave its run uid empty to mean the request's.
            let raw_uid = if cursor.run_uid.is_empty() {
                from.run_uid.clone()
            } else {
                cursor.run_uid.clone()
            };
            let parsed = RunUid::parse("run_uid", &raw_uid)
                .and_then(|uid| Ok((uid, SessionId::new("session_id", &cursor.session_id)?)));
            let (run_uid, session) = match parsed {
                Ok(parsed) => parsed,
                Err(e) => {
                    self.reject_invalid(link, raw_uid, None, "observe-from cursor", &e, trace);
                    continue;
                }
            };
            if !self.routed_here(link, run_uid, None, "replay observations of", trace) {
                continue;
            }
            for observation in self.core.observations_after(run_uid, &session, cursor.seq) {
                self.trace.push(|| TraceEvent::ObservationOut {
                    obs: ObsRec::of(&observation),
                    replay: true,
                });
                self.send(link, observation_message(&observation));
            }
        }
    }

    fn on_forget(&mut self, link: LinkId, forget: pb::ForgetRun, trace: &TraceContext) {
        let run_uid = match RunUid::parse("run_uid", &forget.run_uid) {
            Ok(uid) => uid,
            Err(e) => return self.reject_invalid(link, forget.run_uid, None, "forget", &e, trace),
        };
        self.trace.push(|| TraceEvent::ForgetReceived {
            run: run_uid.to_string(),
            epoch: forget.epoch,
        });
        let out = self.core.forget_run(run_uid, Epoch::new(forget.epoch));
        if !out.iter().any(|o| matches!(o, Output::Rejected(_))) {
            self.routes.remove(&run_uid);
            if let Some(h) = &self.health {
                let _ = h.send(health::Command::Forget(run_uid));
            }
        }
        self.apply(out, Some(link), trace);
    }

    /// Whether `link` routes `run_uid`; if not, tells the driver so.
    fn routed_here(
        &mut self,
        link: LinkId,
        run_uid: RunUid,
        id: Option<OperationId>,
        action: &str,
        trace: &TraceContext,
    ) -> bool {
        if self.routes.get(&run_uid) == Some(&link) {
            return true;
        }
        let rejection = Rejection {
            run_uid,
            id,
            reason: RejectionReason::UnknownRun,
            message: format!("cannot {action} run {run_uid}: it is not claimed on this link"),
            highest_epoch: self.core.highest_epoch(run_uid).unwrap_or_default(),
        };
        self.metrics.rejections.inc(&[rejection.reason.name()]);
        self.trace.push(|| TraceEvent::RejectionOut {
            rejection: RejRec::of(&rejection),
        });
        self.send(link, rejection_message(&rejection, trace));
        false
    }

    /// Carries out the core's outputs. Rejections go to `origin`, the link whose
    /// message caused them; the core makes none without one.
    fn apply(&mut self, out: Vec<Output>, origin: Option<LinkId>, trace: &TraceContext) {
        for output in out {
            match output {
                Output::Start(op) => self.budget.enqueue(op),
                Output::Abort { run_uid, id } => {
                    self.trace.push(|| TraceEvent::CallAborted {
                        run: run_uid.to_string(),
                        id: id.to_string(),
                    });
                    if self.budget.remove(run_uid, id) {
                        // Abandoned while it waited: it never ran.
                        self.told_waiting.remove(&(run_uid, id));
                    } else if let Some((_, handle, abandoned)) = self.tasks.remove(&(run_uid, id)) {
                        // The call's task marks its span when the abort
                        // drops it.
                        abandoned.store(true, Ordering::Relaxed);
                        handle.abort();
                        self.budget.finished(run_uid);
                    }
                }
                Output::Result(result) => {
                    // An operation's effect is done (or abandoned): the
                    // inventory may list something new.
                    self.inventory_hint.mark();
                    self.trace.push(|| TraceEvent::ResultOut {
                        result: ResultRec::of(&result),
                        resend: false,
                    });
                    let effect = result.effect.name();
                    if result.replayed {
                        self.metrics.replayed.inc(&[effect]);
                    } else if result.late {
                        self.metrics.late.inc(&[effect]);
                    } else {
                        self.metrics.completed.inc(&[effect, result.outcome.class_name()]);
                    }
                    self.route(result.run_uid, result_message(&result));
                }
                Output::ResourceChange(c) => {
                    self.trace.push(|| TraceEvent::ChangeOut {
                        change: ChangeRec::of(&c),
                        resend: false,
                    });
                    self.metrics.resource_changes.inc(&[c.change.name()]);
                    self.route(c.run_uid, change_message(&c));
                }
                Output::Observation(o) => {
                    self.trace.push(|| TraceEvent::ObservationOut {
                        obs: ObsRec::of(&o),
                        replay: false,
                    });
                    self.metrics.observations.inc(&[o.stage.name()]);
                    self.route(o.run_uid, observation_message(&o));
                }
                Output::Rejected(rejection) => {
                    self.trace.push(|| TraceEvent::RejectionOut {
                        rejection: RejRec::of(&rejection),
                    });
                    self.metrics.rejections.inc(&[rejection.reason.name()]);
                    match origin {
                        Some(link) => self.send(link, rejection_message(&rejection, trace)),
                        None => tracing::warn!(?rejection, "a rejection with no link to send it to"),
                    }
                }
            }
        }
    }

    /// Writes what the core changed, before any output of the same step leaves;
    /// false when the write failed. A failed write stops the executor from
    /// accepting more work: its durable state would no longer match what
    /// drivers were told.
    fn persist(&mut self) -> bool {
        let Some(store) = &self.store else {
            self.core.clear_changes();
            return true;
        };
        let changes = self.core.take_changes();
        if let Err(e) = store.apply(&changes) {
            tracing::error!(error = %e, "the executor store refused a write; refusing further work");
            self.store_failed = true;
            return false;
        }
        true
    }

    /// Starts every waiting operation the budget lets start now, and tells
    /// the driver about each that has to wait (once) and when it starts.
    fn start_admitted(&mut self) {
        let now = self.clock.monotonic();
        for op in self.budget.drain(now) {
            if self.told_waiting.remove(&(op.run_uid, op.id)) {
                let msg = waiting_message(op.run_uid, op.id, None);
                self.route(op.run_uid, msg);
            }
            self.start(op);
        }
        if self.budget.waiting() == self.told_waiting.len() {
            return;
        }
        let untold: Vec<(RunUid, OperationId)> = self
            .budget
            .queued()
            .filter(|k| !self.told_waiting.contains(k))
            .collect();
        for (run_uid, id) in untold {
            let held = self.budget.hold_of(run_uid, now);
            let reason = held.map_or_else(
                || "waiting for earlier operations to start".to_owned(),
                |h| {
                    self.metrics.budget_waits.inc(&[h.name()]);
                    self.budget.describe(h)
                },
            );
            tracing::debug!(run_uid = %run_uid, id = %id, %reason, "operation waits for its budget");
            self.told_waiting.insert((run_uid, id));
            let msg = waiting_message(run_uid, id, Some(reason));
            self.route(run_uid, msg);
        }
    }

    /// Runs a backend call on a task of its own; its outcome comes back as
    /// `Event::Completed`. The call's span is made, entered and closed on
    /// that task, so the actor (the one task every operation goes through)
    /// does not pay for it.
    fn start(&mut self, op: Operation) {
        let (run_uid, id) = (op.run_uid, op.id);
        let task = TaskId(self.next_task);
        self.next_task = self.next_task.wrapping_add(1);
        let effect = op.input.effect();
        self.metrics.started.inc(&[effect.name()]);
        self.trace.push(|| TraceEvent::CallStarted { op: OpRec::of(&op) });
        let backend = Arc::clone(&self.backend);
        let observations = self.observations.clone();
        let events = self.events.clone();
        let backend_call = self.metrics.backend_call.clone();
        let clock = Arc::clone(&self.clock);
        let abandoned = Arc::new(AtomicBool::new(false));
        let span_abandoned = Arc::clone(&abandoned);
        let handle = tokio::spawn(async move {
            let span = platform::operation_span!(parent: None, "execute", span_name(effect), &op);
            telemetry::set_parent(&span, &op.trace);
            // Without an OpenTelemetry layer (an executor embedded in a test)
            // the call has no context of its own; the operation's is passed on.
            let trace = Some(telemetry::context_of(&span))
                .filter(|t| !t.traceparent.is_empty())
                .unwrap_or_else(|| op.trace.clone());
            // The session's observations join the call that started it.
            let sink = ObservationSink::new(observations, trace.clone());
            let mut call_span = CallSpan {
                span,
                abandoned: span_abandoned,
                finished: false,
            };
            let call = backend.execute(op, sink);
            // A latency measurement only, never a deadline: the clock's
            // monotonic time, not the wall time the core's deadlines use.
            let started = clock.monotonic();
            let outcome = call.instrument(call_span.span.clone()).await;
            call_span.finished = true;
            let class = outcome.class_name();
            call_span.span.record("provisioning.operation.outcome", class);
            if matches!(
                outcome,
                Outcome::Retryable { .. } | Outcome::Permanent { .. } | Outcome::Ambiguous { .. }
            ) {
                call_span.span.record("otel.status_code", "error");
            }
            backend_call.observe_duration(
                &[effect.name(), class],
                clock.monotonic().saturating_since(started),
            );
            let _ = events
                .send(Event::Completed {
                    run_uid,
                    id,
                    task,
                    outcome,
                    trace,
                })
                .await;
        });
        if let Some((_, stale, _)) = self
            .tasks
            .insert((run_uid, id), (task, handle.abort_handle(), abandoned))
        {
            stale.abort();
            self.budget.finished(run_uid);
        }
    }

    /// Sends to the link that routes the run; without one the message waits in
    /// the core (results until acknowledged, observations until replayed).
    fn route(&mut self, run_uid: RunUid, msg: pb::ExecutorMessage) {
        if let Some(&link) = self.routes.get(&run_uid) {
            self.send(link, msg);
        }
    }

    /// Queues a message for `link`; [`Actor::flush`] sends it once the step's
    /// durable changes are written.
    fn send(&mut self, link: LinkId, msg: pb::ExecutorMessage) {
        self.outbox.push((link, msg));
    }

    /// Writes the step's durable changes, then sends its messages. A step
    /// whose changes could not be written sends nothing: a result a driver
    /// saw must be one a restarted executor can replay (the drivers' deadlines
    /// fold what was not sent as ambiguous, and a restarted executor adopts).
    fn flush(&mut self) {
        let durable = self.persist();
        self.trace.write();
        let outbox = std::mem::take(&mut self.outbox);
        if !durable {
            tracing::error!(
                messages = outbox.len(),
                "a step's messages are not sent: its changes could not be written"
            );
            return;
        }
        for (link, msg) in outbox {
            self.send_now(link, msg);
        }
    }

    fn send_now(&mut self, link: LinkId, msg: pb::ExecutorMessage) {
        let Some(state) = self.links.get(&link) else {
            return;
        };
        match state.tx.try_send(Ok(msg)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                tracing::warn!(
                    link = link.0,
                    "the driver is not reading its link; closing it (unacknowledged results are \
                     re-sent when the driver claims again)"
                );
                self.close_link(link);
            }
            Err(TrySendError::Closed(_)) => self.close_link(link),
        }
    }

    fn close_link(&mut self, link: LinkId) {
        if self.links.remove(&link).is_some() {
            self.routes.retain(|_, l| *l != link);
        }
    }

    fn reject_invalid(
        &mut self,
        link: LinkId,
        run_uid: String,
        id: Option<pb::OperationId>,
        what: &str,
        error: &FieldError,
        trace: &TraceContext,
    ) {
        let highest_epoch = RunUid::parse("run_uid", &run_uid)
            .ok()
            .and_then(|uid| self.core.highest_epoch(uid))
            .map_or(0, Epoch::get);
        self.metrics.rejections.inc(&[RejectionReason::Invalid.name()]);
        let rejection = pb::Rejection {
            run_uid,
            id,
            reason: pb::RejectionReason::Invalid as i32,
            message: format!("invalid {what}: {error}"),
            highest_epoch,
        };
        self.send(
            link,
            message(pb::executor_message::Kind::Rejection(rejection), trace),
        );
    }

    fn drain(&mut self) {
        self.draining = true;
        for (_, state) in self.links.drain() {
            let _ = state.tx.try_send(Err(to_status(RequestError::ShuttingDown)));
        }
        self.routes.clear();
    }

    fn stop(&mut self) {
        for (_, (_, handle, _)) in self.tasks.drain() {
            handle.abort();
        }
        self.links.clear();
        self.routes.clear();
    }
}

/// The name of a backend call's span, `execute <effect>`, without formatting
/// it for every call.
fn span_name(effect: contract::Effect) -> &'static str {
    use contract::Effect as E;
    match effect {
        E::CreateLease => "execute create-lease",
        E::LookupEndpoint => "execute lookup-endpoint",
        E::StartBootstrap => "execute start-bootstrap",
        E::CancelBootstrap => "execute cancel-bootstrap",
        E::DestroyLease => "execute destroy-lease",
    }
}

/// A backend call's span as its task holds it. When the core abandons the
/// call at its deadline the actor sets `abandoned` and aborts the task; the
/// abort drops this before the call finished, which marks the span.
struct CallSpan {
    span: tracing::Span,
    abandoned: Arc<AtomicBool>,
    finished: bool,
}

impl Drop for CallSpan {
    fn drop(&mut self) {
        if !self.finished && self.abandoned.load(Ordering::Relaxed) {
            self.span.record("provisioning.operation.outcome", "abandoned");
            self.span.record("otel.status_code", "error");
        }
    }
}

fn message(kind: pb::executor_message::Kind, trace: &TraceContext) -> pb::ExecutorMessage {
    pb::ExecutorMessage {
        kind: Some(kind),
        trace: trace_to_wire(trace),
    }
}

fn result_message(result: &OperationResult) -> pb::ExecutorMessage {
    message(
        pb::executor_message::Kind::Result(pb::OperationResult::from(result)),
        &result.trace,
    )
}

fn observation_message(observation: &Observation) -> pb::ExecutorMessage {
    message(
        pb::executor_message::Kind::Observation(pb::BootstrapObservation::from(observation)),
        &observation.trace,
    )
}

fn change_message(change: &ResourceChange) -> pb::ExecutorMessage {
    message(
        pb::executor_message::Kind::Change(pb::ResourceChange::from(change)),
        &change.trace,
    )
}

fn rejection_message(rejection: &Rejection, trace: &TraceContext) -> pb::ExecutorMessage {
    message(
        pb::executor_message::Kind::Rejection(pb::Rejection::from(rejection)),
        trace,
    )
}

/// Tells the driver an operation waits for a budget (`Some(reason)`) or has
/// started after waiting (`None`).
fn waiting_message(run_uid: RunUid, id: OperationId, reason: Option<String>) -> pb::ExecutorMessage {
    pb::ExecutorMessage {
        kind: Some(pb::executor_message::Kind::Waiting(pb::OperationWaiting {
            run_uid: run_uid.to_string(),
            id: Some(id.into()),
            waiting: reason.is_some(),
            reason: reason.unwrap_or_default(),
        })),
        trace: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Mutex;
    use tracing_subscriber::{Layer, layer::SubscriberExt as _};

    /// Every field recorded on a span after its creation, as text.
    #[derive(Clone, Default)]
    struct Recorded(Arc<Mutex<Vec<(String, String)>>>);

    impl tracing::field::Visit for Recorded {
        fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
            if let Ok(mut v) = self.0.lock() {
                v.push((field.name().to_owned(), value.to_owned()));
            }
        }

        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if let Ok(mut v) = self.0.lock() {
                v.push((field.name().to_owned(), format!("{value:?}")));
            }
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Recorded {
        fn on_record(
            &self,
            _id: &tracing::span::Id,
            values: &tracing::span::Record<'_>,
            _ctx: tracing_subscriber::layer::Context<'_, S>,
        ) {
            values.record(&mut self.clone());
        }
    }

    fn drop_call_span(abandoned: bool, finished: bool) -> Vec<(String, String)> {
        let recorded = Recorded::default();
        let subscriber = tracing_subscriber::registry().with(recorded.clone());
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "execute",
                provisioning.operation.outcome = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
            );
            drop(CallSpan {
                span,
                abandoned: Arc::new(AtomicBool::new(abandoned)),
                finished,
            });
        });
        recorded.0.lock().map(|v| v.clone()).unwrap_or_default()
    }

    #[test]
    fn only_an_abandoned_call_that_did_not_finish_marks_its_span() {
        assert_eq!(
            drop_call_span(true, false),
            vec![
                (
                    "provisioning.operation.outcome".to_owned(),
                    "abandoned".to_owned()
                ),
                ("otel.status_code".to_owned(), "error".to_owned()),
            ]
        );
        assert_eq!(drop_call_span(true, true), Vec::new());
        assert_eq!(drop_call_span(false, false), Vec::new());
    }

    #[test]
    fn a_call_span_is_named_execute_and_its_effect() {
        for effect in contract::Effect::ALL {
            assert_eq!(span_name(effect), format!("execute {}", effect.name()));
        }
    }
}
