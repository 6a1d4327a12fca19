//! Assembles the driver: the store, the decider client, the executor link and
//! the public API, served until `shutdown` resolves.

use std::{sync::Arc, time::Duration};

use contract::{
    Clock,
    pb::{executor_client::ExecutorClient, provisioning_server::ProvisioningServer},
};
use platform::{balance::Balanced, telemetry::grpc::ServerLayer, tls::ClientAuth};
use tokio::net::TcpListener;
use tracing::Instrument as _;

use crate::{
    api::Api,
    core::{Policy, RunStore},
    driver::{Driver, DriverConfig, DriverError},
    link::Link,
    orphans::{Inventory, SweepConfig},
    replicas::Replicas,
};

/// How long the runs get to stop at shutdown (a pass in flight waits for its
/// Decide answer, which the decider gives in milliseconds when it is up).
const RUNS_STOP_WITHIN: Duration = Duration::from_secs(2);

/// Everything `run` needs besides the listener.
#[derive(Debug)]
pub struct Config {
    /// e.g. `http://127.0.0.1:7001`, or several, comma-separated; every
    /// address their hosts resolve to takes calls in turn
    /// (`platform::balance`).
    pub decider: String,
    /// How often the decider's host is resolved again (zero: only at start).
    pub decider_resolve_interval: Duration,
    pub executor: String,
    /// Who the decider and the executor must be (names or URIs, see
    /// [`platform::tls::identity_of`]), checked in the TLS handshake.
    pub decider_identity: String,
    pub executor_identity: String,
    pub policy: Policy,
    pub safety_tick: Duration,
    /// The most operations all runs together may have pending (`None`: no
    /// limit); see [`crate::admission`].
    pub max_operations_in_flight: Option<usize>,
    pub store: Box<dyn RunStore>,
    pub clock: Arc<dyn Clock>,
    /// Between orphan sweeps; zero turns the sweep off.
    pub orphan_sweep: Duration,
    /// Whether the sweep destroys the orphans it confirms (through the
    /// deletion path) or only reports them.
    pub orphan_destroy: bool,
    /// TLS (or plaintext) for the public API and for the channels to the
    /// decider and the executor, where the driver's certificate is its
    /// client identity (see [`platform::tls`]).
    pub transport: platform::tls::Transport,
    /// Who may call the public API (see [`crate::auth`]).
    pub auth: Arc<crate::auth::Authenticator>,
    /// What callers may ask of it (see [`crate::limits`]).
    pub limits: crate::limits::ApiLimits,
    /// With a store several drivers share: run ownership (see
    /// [`crate::replicas`]), and the address this replica announces to
    /// clients that call another (default: the bound address).
    pub replicas: Option<Arc<dyn Replicas>>,
    pub advertise: Option<String>,
}

/// How often a replica looks for runs nobody owns even when its watch on the
/// owners says nothing moved.
const TAKEOVER_RESCAN: Duration = Duration::from_secs(2);

/// What can stop the driver's server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot set up TLS: {0}")]
    Tls(#[from] platform::tls::TlsError),
    #[error("the listener: {0}")]
    Listener(#[from] std::io::Error),
    #[error("cannot start the driver: {0}")]
    Driver(#[from] DriverError),
    #[error("announcing this replica: {0}")]
    Announce(String),
    #[error("cannot set up gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("the gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The replica's etcd lease is gone: its runs are stopped, and the
    /// process exits non-zero so that its supervisor starts it afresh.
    #[error(
        "this driver replica lost its etcd lease: it stopped its runs (other replicas take them \
         over) and exits so that its supervisor starts it afresh"
    )]
    LeaseLost,
}

/// Serves the driver on `listener` until `shutdown` resolves.
/// Registers every metric family the driver exports, each known series at
/// zero, in the process's registry. `main` calls it before it announces
/// that it is ready, so that a scrape right after sees them all; `run`
/// registers them again as it builds what counts (idempotent).
pub fn declare_metrics() {
    let _ = crate::metrics::Metrics::default();
    let _ = crate::auth::refusals();
}

pub async fn run(
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    config: Config,
) -> Result<(), ServerError> {
    // With TLS each channel checks that its server is the service it wants
    // (the identity in its certificate), not only that the CA signed it.
    // Every address of every decider named takes calls in turn.
    let mut decider_endpoints = Vec::new();
    for address in config.decider.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        decider_endpoints.push(
            config
                .transport
                .peer_endpoint(address, &config.decider_identity)?
                .map(|e| {
                    e.connect_timeout(Duration::from_secs(2))
                        .timeout(Duration::from_secs(30))
                }),
        );
    }
    let deciders = Balanced::start(decider_endpoints, config.decider_resolve_interval).await;
    tracing::info!(decider = %config.decider, addresses = ?deciders.addresses(), "deciders");
    let decider = decider_svc::DeciderChannel::new(deciders)
        .max_decoding_message_size(16 << 20)
        .max_encoding_message_size(16 << 20);
    let executor_endpoint = config
        .transport
        .peer_endpoint(&config.executor, &config.executor_identity)?
        .map(|e| {
            e.connect_timeout(Duration::from_secs(2))
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(Duration::from_secs(10))
        });
    // The orphan sweep's calls (Inventory) use their own channel, with a
    // request timeout the long-lived link stream cannot have.
    let inventory_endpoint = executor_endpoint
        .clone()
        .map(|e| e.timeout(Duration::from_secs(30)));
    let link = Link::new();
    let bound = listener.local_addr()?;
    let driver = Driver::start(DriverConfig {
        store: config.store,
        clock: config.clock,
        decider,
        link: link.clone(),
        policy: config.policy,
        safety_tick: config.safety_tick,
        max_operations_in_flight: config.max_operations_in_flight,
        replicas: config.replicas.clone(),
    })?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Set when this replica loses its lease: it stops its runs and exits.
    let (lost_tx, mut lost_rx) = tokio::sync::watch::channel(false);
    let takeover_task = match config.replicas.clone() {
        None => None,
        Some(replicas) => {
            let address = config.advertise.clone().unwrap_or_else(|| bound.to_string());
            let announced = replicas.clone();
            let announce = address.clone();
            tokio::task::spawn_blocking(move || announced.announce(&announce))
                .await
                .map_err(|e| ServerError::Announce(e.to_string()))?
                .map_err(|e| ServerError::Announce(e.to_string()))?;
            tracing::info!(owner = replicas.owner_id(), %address, "driver replica announced");
            let taken = driver.take_over_unowned().await?;
            tracing::info!(runs = taken, "runs claimed at start");
            let driver = driver.clone();
            let mut stop = stop_rx.clone();
            Some(tokio::spawn(async move {
                tokio::select! {
                    () = take_over_loop(driver, replicas, lost_tx) => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
            }))
        }
    };
    let link_task = tokio::spawn({
        let mut stop = stop_rx.clone();
        async move {
            link.run(executor_endpoint, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await;
        }
    });

    let sweep_task = (!config.orphan_sweep.is_zero()).then(|| {
        let inventory =
            ExecutorClient::new(inventory_endpoint.traced_lazy()).max_decoding_message_size(64 << 20);
        let mut stop = stop_rx.clone();
        let driver = driver.clone();
        let sweep = SweepConfig::new(config.orphan_sweep, config.orphan_destroy);
        tokio::spawn(async move {
            tokio::select! {
                () = sweep_orphans(driver, inventory, sweep) => {}
                _ = stop.wait_for(|s| *s) => {}
            }
        })
    });

    let (_reporter, health, reflection, reflection_alpha) =
        platform::runtime::health_and_reflection::<ProvisioningServer<Api>>().await?;
    // Authentication, then the limits, around the public API only: health
    // checks and reflection stay open.
    let api = tower::ServiceBuilder::new()
        .layer(config.auth.layer())
        .layer(config.limits.layer())
        .service(
            ProvisioningServer::new(Api::new(driver.clone(), config.limits.max_send_message_bytes))
                .max_decoding_message_size(config.limits.max_recv_message_bytes)
                .max_encoding_message_size(config.limits.max_send_message_bytes),
        );
    let mut stop = stop_rx;
    let stopping = driver.clone();
    // Client certificates are optional on the public API; one presented
    // must chain to the CA.
    let incoming = config.transport.incoming(listener, ClientAuth::Optional)?;
    let router = platform::runtime::server()
        .layer(ServerLayer::new())
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(api);
    let served = platform::tls::serve(router, incoming, async move {
        tokio::select! {
            () = shutdown => {}
            _ = lost_rx.wait_for(|l| *l) => {}
        }
        // The runs stop first: their watch streams end with them, so a
        // client still watching does not hold the graceful shutdown open.
        stopping.shutdown(RUNS_STOP_WITHIN).await;
        let _ = stop.wait_for(|_| true).await;
    });
    let result = served.await;
    // The runs stop before the executor link closes, so nothing they send on
    // the way out is lost, and before the process flushes its spans.
    driver.shutdown(RUNS_STOP_WITHIN).await;
    let _ = stop_tx.send(true);
    let _ = link_task.await;
    if let Some(t) = sweep_task {
        let _ = t.await;
    }
    let lost = match takeover_task {
        Some(t) => {
            let _ = t.await;
            config.replicas.as_ref().is_some_and(|r| r.lost())
        }
        None => false,
    };
    // A replica stopping on purpose hands its runs over at once: its runs
    // are stopped and committed, and revoking its lease frees them for the
    // other replicas now rather than when the lease would expire.
    if let Some(replicas) = config.replicas.clone()
        && !lost
    {
        let resigned = tokio::task::spawn_blocking(move || replicas.resign())
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        match resigned {
            Ok(()) => tracing::info!("resigned: the other replicas take this replica's runs now"),
            Err(e) => {
                tracing::warn!(error = %e, "could not resign; the runs are free once the lease expires")
            }
        }
    }
    result?;
    if lost {
        return Err(ServerError::LeaseLost);
    }
    Ok(())
}

/// With replicas: takes over the runs nobody owns whenever ownership may
/// have moved (the store's watch on the owners) and every
/// [`TAKEOVER_RESCAN`]; when this replica's lease is lost, says so on `lost`
/// and returns. A short random delay before each look spreads the runs of
/// a replica that went among the others.
async fn take_over_loop(driver: Driver, replicas: Arc<dyn Replicas>, lost: tokio::sync::watch::Sender<bool>) {
    let mut changes = replicas.changes();
    let mut watching = true;
    let clock = driver.clock();
    let mut next_scan = clock.monotonic().saturating_add(TAKEOVER_RESCAN);
    loop {
        if replicas.lost() {
            tracing::error!("this driver replica lost its etcd lease: stopping its runs");
            driver.shutdown(RUNS_STOP_WITHIN).await;
            let _ = lost.send(true);
            return;
        }
        tokio::select! {
            changed = changes.changed(), if watching => watching = changed.is_ok(),
            () = tokio::time::sleep(next_scan.saturating_since(clock.monotonic())) => {}
            // The lease is judged by the local clock: look at it this often.
            () = tokio::time::sleep(Duration::from_millis(200)) => continue,
        }
        if replicas.lost() {
            continue;
        }
        let mut jitter = [0u8; 1];
        let _ = getrandom::fill(&mut jitter);
        tokio::time::sleep(Duration::from_millis(u64::from(jitter[0]))).await;
        match driver.take_over_unowned().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(runs = n, "took over runs another replica owned"),
            Err(e) => tracing::warn!(error = %e, "looking for runs to take over failed"),
        }
        next_scan = clock.monotonic().saturating_add(TAKEOVER_RESCAN);
    }
}

/// The orphan sweep: shortly after the executor link comes up (each time it
/// does), then every `config.every` while it stays up (or as soon again when
/// a look found held leases missing), reads the executor's inventory and
/// compares it with the runs (see [`crate::orphans`]).
async fn sweep_orphans(
    driver: Driver,
    mut executor: ExecutorClient<platform::telemetry::grpc::TracedChannel>,
    config: SweepConfig,
) {
    let poll = config
        .after_link_up
        .min(Duration::from_millis(200))
        .max(Duration::from_millis(10));
    let mut seen_link: Option<u64> = None;
    let mut next: Option<contract::Monotonic> = None;
    loop {
        tokio::time::sleep(poll).await;
        let link = driver.link().generation();
        if link.is_none() {
            seen_link = None;
            next = None;
            continue;
        }
        if link != seen_link {
            seen_link = link;
            next = Some(driver.clock().monotonic().saturating_add(config.after_link_up));
        }
        let at = driver.clock().monotonic();
        if next.is_none_or(|t| t > at) {
            continue;
        }
        next = Some(at.saturating_add(config.every));
        // A sweep is routine: its span is an unsampled root, so neither the
        // Inventory call nor the executor's side of it is recorded (an idle
        // driver makes no spans).
        let span = tracing::info_span!(parent: None, "orphan sweep");
        platform::telemetry::set_unsampled_root(&span);
        let read = driver.begin_inventory_read().await;
        let inventory = read_inventory(&mut executor).instrument(span).await;
        match inventory {
            Ok(inventory) => {
                let resources = inventory.resources.len();
                let new = driver.sweep_orphans(read, inventory, config.destroy).await;
                tracing::debug!(resources, new_orphans = new.len(), "orphan sweep");
                if driver.missing_suspected() {
                    let took = driver.clock().monotonic().saturating_since(at);
                    next = Some(relook_at(at, took, &config));
                }
            }
            Err(status) => {
                drop(read);
                driver.sweep_failed();
                tracing::warn!(%status, "orphan sweep: the executor's inventory could not be read");
            }
        }
    }
}

/// A look again at leases a sweep found missing comes no sooner than this
/// many times what that sweep took.
const RELOOK_COST_FACTOR: u32 = 4;

/// When to look again after a sweep begun at `at`, which took `took`, found
/// held leases missing. A lease missing at this look is lost if it is
/// missing at the next, so the next comes soon (a loss the executor reported
/// before it restarted, and never re-sent, waits on it): `after_link_up`
/// after this one, but no sooner than [`RELOOK_COST_FACTOR`] times what
/// this one took (and no later than the sweep's period). Before the runs
/// left the leases they record during a read out of it
/// ([`Driver::begin_inventory_read`]), such leases were missing at every
/// look while a large run converged, and sweeps of a million resources ran
/// back to back, each seconds of the driver's CPU; the spacing still bounds
/// what real losses cost.
fn relook_at(at: contract::Monotonic, took: Duration, config: &SweepConfig) -> contract::Monotonic {
    let spaced = config.after_link_up.max(took.saturating_mul(RELOOK_COST_FACTOR));
    at.saturating_add(spaced.min(config.every))
}

/// The executor's whole inventory, read in pages (`InventoryPages`), each
/// decoded as it arrives; from the one-message `Inventory` of an executor
/// that predates pages. A stream that breaks off, or ends before the page
/// marked last, is an error, never a shorter inventory: the sweep would take
/// the resources it did not list as missing.
async fn read_inventory(
    executor: &mut ExecutorClient<platform::telemetry::grpc::TracedChannel>,
) -> Result<Inventory, tonic::Status> {
    let request = contract::pb::InventoryRequest::default();
    let mut inventory = Inventory::default();
    let mut names = Names::default();
    match executor.inventory_pages(request.clone()).await {
        Ok(pages) => {
            let mut pages = pages.into_inner();
            loop {
                let Some(page) = pages.message().await? else {
                    return Err(tonic::Status::unavailable(
                        "the executor's inventory stream ended before its last page",
                    ));
                };
                decode_inventory(&mut inventory, &page.resources, &mut names);
                if page.last {
                    break;
                }
            }
            // Read to the end, so the call ends with its status rather than
            // as cancelled by the reader.
            if pages.message().await?.is_some() {
                return Err(tonic::Status::unavailable(
                    "the executor's inventory stream went on past its last page",
                ));
            }
        }
        Err(status) if status.code() == tonic::Code::Unimplemented => {
            let whole = executor.inventory(request).await?;
            decode_inventory(&mut inventory, &whole.into_inner().resources, &mut names);
        }
        Err(status) => return Err(status),
    }
    Ok(inventory)
}

/// The run ids and groups an inventory names, each kept once: a million
/// resources name a few runs and groups, and each decoded on its own held an
/// allocation per name (two per resource).
#[derive(Debug, Default)]
struct Names {
    groups: contract::GroupInterner,
    run: Option<contract::RunId>,
}

impl Names {
    fn share(&mut self, mut resource: contract::InventoryResource) -> contract::InventoryResource {
        let id = &mut resource.identity;
        match &self.run {
            Some(run) if *run == id.run_id => id.run_id = run.clone(),
            _ => self.run = Some(id.run_id.clone()),
        }
        if let Ok(group) = self.groups.group("node_id", id.node.group().as_str()) {
            id.node = contract::LogicalNodeId::new(group, id.node.index());
        }
        resource
    }
}

/// Adds inventory entries in domain types. An entry that does not decode is
/// logged and left out, and counted, so that the sweep concludes nothing
/// from an absence it cannot vouch for (see [`crate::orphans::Orphans::sweep`]).
fn decode_inventory(inventory: &mut Inventory, resources: &[contract::pb::Resource], names: &mut Names) {
    for r in resources {
        match contract::InventoryResource::try_from(r) {
            Ok(resource) => inventory.resources.push(names.share(resource)),
            Err(error) => {
                tracing::warn!(%error, run_uid = %r.run_uid, node = %r.node_id, attempt = r.attempt,
                    "orphan sweep: an inventory entry does not decode; left out");
                inventory.undecodable += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use contract::pb::{self, executor_server::Executor};
    use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};

    use super::*;

    /// A look again at missing leases comes `after_link_up` after a cheap
    /// sweep, and no sooner than four times what a costly one took.
    #[test]
    fn a_look_again_is_spaced_by_what_the_sweep_took() {
        let config = SweepConfig::new(Duration::from_secs(60), false);
        let at = contract::Monotonic::from_origin(Duration::from_secs(100));
        let after = |took_ms| relook_at(at, Duration::from_millis(took_ms), &config).saturating_since(at);
        assert_eq!(after(5), Duration::from_secs(1));
        assert_eq!(after(250), Duration::from_secs(1));
        assert_eq!(after(2_000), Duration::from_secs(8));
        // No later than the next sweep would come anyway.
        assert_eq!(after(20_000), Duration::from_secs(60));
    }

    fn resource(i: u32) -> pb::Resource {
        pb::Resource {
            run_uid: format!("{:032x}", 7),
            run_id: "train".into(),
            node_id: format!("workers-{i}"),
            attempt: u64::from(i) + 1,
            lease_id: format!("lease-{i}"),
            ..Default::default()
        }
    }

    /// An executor that answers `InventoryPages` with `pages` (or, with
    /// `None`, as one that predates it) and `Inventory` with `whole`.
    #[derive(Debug, Clone)]
    struct Double {
        pages: Option<Vec<pb::InventoryResponse>>,
        whole: Vec<pb::Resource>,
    }

    #[tonic::async_trait]
    impl Executor for Double {
        type LinkStream = ReceiverStream<Result<pb::ExecutorMessage, tonic::Status>>;
        type InventoryPagesStream = ReceiverStream<Result<pb::InventoryResponse, tonic::Status>>;

        async fn link(
            &self,
            _: tonic::Request<tonic::Streaming<pb::DriverMessage>>,
        ) -> Result<tonic::Response<Self::LinkStream>, tonic::Status> {
            Err(tonic::Status::unimplemented("no link"))
        }

        async fn inventory(
            &self,
            _: tonic::Request<pb::InventoryRequest>,
        ) -> Result<tonic::Response<pb::InventoryResponse>, tonic::Status> {
            Ok(tonic::Response::new(pb::InventoryResponse {
                resources: self.whole.clone(),
                last: false,
            }))
        }

        async fn inventory_pages(
            &self,
            _: tonic::Request<pb::InventoryRequest>,
        ) -> Result<tonic::Response<Self::InventoryPagesStream>, tonic::Status> {
            let Some(pages) = self.pages.clone() else {
                return Err(tonic::Status::unimplemented("predates pages"));
            };
            let (tx, rx) = tokio::sync::mpsc::channel(pages.len().max(1));
            for page in pages {
                let _ = tx.send(Ok(page)).await;
            }
            Ok(tonic::Response::new(ReceiverStream::new(rx)))
        }
    }

    async fn read_from(double: Double) -> Result<Inventory, tonic::Status> {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(pb::executor_server::ExecutorServer::new(double))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        let uri: http::Uri = format!("http://{addr}").parse().unwrap();
        let channel = tonic::transport::Endpoint::from(uri.clone())
            .connect()
            .await
            .unwrap();
        let mut client = ExecutorClient::new(platform::telemetry::grpc::traced(
            channel,
            platform::telemetry::grpc::Target::of(&uri),
        ));
        let read = read_inventory(&mut client).await;
        server.abort();
        read
    }

    fn nodes(inventory: &Inventory) -> Vec<String> {
        inventory
            .resources
            .iter()
            .map(|r| r.identity.node.to_string())
            .collect()
    }

    #[tokio::test]
    async fn the_inventory_is_read_in_pages_up_to_the_last() {
        let page = |from: u32, last: bool| pb::InventoryResponse {
            resources: (from..from + 3).map(resource).collect(),
            last,
        };
        let double = Double {
            pages: Some(vec![page(0, false), page(3, false), page(6, true)]),
            whole: Vec::new(),
        };
        let inventory = read_from(double).await.unwrap();
        let expected: Vec<String> = (0..9).map(|i| format!("workers-{i}")).collect();
        assert_eq!(nodes(&inventory), expected);
        assert_eq!(inventory.undecodable, 0);
        // Across pages, every resource of the run and group shares its names.
        let first = &inventory.resources[0].identity;
        for r in &inventory.resources {
            assert!(std::ptr::eq(r.identity.run_id.as_str(), first.run_id.as_str()));
            assert!(std::ptr::eq(
                r.identity.node.group().as_str(),
                first.node.group().as_str()
            ));
        }

        // An empty inventory is one empty last page.
        let empty = Double {
            pages: Some(vec![pb::InventoryResponse {
                resources: Vec::new(),
                last: true,
            }]),
            whole: vec![resource(1)],
        };
        assert!(read_from(empty).await.unwrap().resources.is_empty());
    }

    #[tokio::test]
    async fn a_stream_that_ends_before_its_last_page_is_an_error_not_a_shorter_inventory() {
        for pages in [
            vec![pb::InventoryResponse {
                resources: vec![resource(0)],
                last: false,
            }],
            Vec::new(),
        ] {
            let double = Double {
                pages: Some(pages),
                whole: vec![resource(0), resource(1)],
            };
            let status = read_from(double).await.unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
            assert!(status.message().contains("last page"), "{status:?}");
        }
    }

    #[tokio::test]
    async fn an_executor_that_predates_pages_is_read_whole() {
        let double = Double {
            pages: None,
            whole: vec![resource(4), resource(5)],
        };
        let inventory = read_from(double).await.unwrap();
        assert_eq!(nodes(&inventory), ["workers-4", "workers-5"]);
    }
}
