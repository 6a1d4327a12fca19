//! The etcd store: [`EtcdStore`], a `RunStore` over etcd (cargo feature `etcd`).
//!
//! Values are the records [`crate::durable::RedbStore`] writes (protobuf
//! `provisioning.store.v1`, secrets sealed by the same [`Sealer`]); keys sit
//! under a prefix (default [`DEFAULT_PREFIX`]):
//!
//! - `runs/<uid>/meta`: the run record (`StoredMeta`);
//! - `runs/<uid>/gen`: the generation of the run's node records (decimal;
//!   absent means 0);
//! - `runs/<uid>/nodes/<gen>/<node id>`: node records (`StoredNode`);
//! - `runs/<uid>/events/<seq>`: the run's event log (`StoredEvent`; the
//!   sequence number zero-padded to 20 digits, so keys sort by it);
//! - `runs/<uid>/writer`: the owner id of the replica that wrote the run
//!   last (every write sets it, so etcd's history of this key says which
//!   replica wrote each revision of the run);
//! - `uids/<uid>`: the run's id, one key per stored run (the index replicas
//!   scan for runs nobody owns);
//! - `names/<run id>`: the uid of the run that holds this run id (reclaim
//!   runs hold none); taken by the run's first write, which fails if another
//!   run holds it, so two replicas cannot create the same run id;
//! - `owners/<uid>`: the owner id of the replica that owns the run, attached to
//!   that replica's lease;
//! - `members/<owner id>`: the address a replica serves its public API on,
//!   attached to its lease.
//!
//! **Ownership.** Each store has an owner id and an etcd lease, kept alive by a
//! background task. Before its first write to a run the store claims the run:
//! it creates the ownership key (or re-attaches its own key to its current
//! lease); a run owned by another replica is refused. Every write transaction
//! compares that the ownership key still holds this owner id, so a write from a
//! replica that lost the run (its lease expired or was revoked, and another
//! took the run) fails as [`StoreError::Unavailable`] instead of landing. When
//! keep-alive fails, or the lease may have expired by the local clock (counted
//! from when the last acknowledged keep-alive was *sent*), the store refuses
//! every further write at once, without asking etcd, and for good (the
//! process must restart to write again). The lease is not revoked when the
//! store is dropped: a stopped replica's runs are free once its lease
//! expires (or at once after [`EtcdStore::revoke_lease`]).
//!
//! **Atomicity.** A delta that fits one transaction (at most `max_txn_ops`
//! operations, etcd's `--max-txn-ops`, 128 by default, and about 1 MiB, under
//! etcd's default 1.5 MiB request limit) is one transaction. A larger delta is
//! a *rewrite*: the run's node set after the delta is written, in as many
//! transactions as it takes, under the next generation (`nodes/<gen+1>/`),
//! which readers ignore; then one transaction switches `gen`, writes the run
//! record and deletes the old generation. A rewrite cut short leaves only an
//! unreferenced generation, which the next rewrite deletes first: a delta is
//! never half-applied. A single record over the request limit cannot be
//! written (etcd refuses it; the commit fails).
//!
//! **Replicas.** The store is also the driver's [`Replicas`]: claims, loads of
//! one run, where a run id is served, the runs nobody owns (`uids/` less
//! `owners/`), and a counter a watch on `owners/` moves whenever an ownership
//! key goes (and when this replica's lease is lost). See
//! [`crate::replicas`] for what the driver does with it.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use contract::{LogicalNodeId, RunUid};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, EventType, GetOptions, KeyValue, PutOptions,
    Txn, TxnOp, TxnOpResponse, TxnResponse, WatchFilterType, WatchOptions,
};
use platform::secrets::Sealer;

use tokio::time::Instant;

use crate::core::{NodeRecord, RunDelta, RunStore, StoreError, StoredRun};
use crate::durable::{decode_event, decode_meta, decode_node, encode_event, encode_meta, encode_node};
use crate::replicas::{Claim, Owner, Placement, Replicas};

/// Where the store's keys live unless configured otherwise.
pub const DEFAULT_PREFIX: &str = "/provisioning/v1/";
/// etcd's default `--max-txn-ops`.
pub const DEFAULT_MAX_TXN_OPS: usize = 128;
/// The most record bytes put in one transaction (etcd's default request limit
/// is 1.5 MiB).
const MAX_TXN_BYTES: usize = 1 << 20;
/// Keys read per range request when loading.
const PAGE: i64 = 256;
/// The largest answer a read accepts (tonic's default is 4 MiB; a page of
/// node records can be larger).
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// How an [`EtcdStore`] connects and identifies itself.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// `host:port` (or `http://host:port`) of etcd members.
    pub endpoints: Vec<String>,
    /// The key prefix; ends with `/`.
    pub prefix: String,
    /// This replica's owner id, written into the ownership keys it holds.
    pub owner_id: String,
    /// The lease's time to live (etcd may grant a longer one).
    pub lease_ttl: Duration,
    /// The most operations put in one transaction (etcd's `--max-txn-ops`).
    pub max_txn_ops: usize,
    /// How long one request to etcd may take before the commit fails.
    pub request_timeout: Duration,
    /// TLS to the members: on when set (the endpoints are then https).
    pub tls: Option<EtcdTls>,
}

/// The PEM material of TLS to etcd.
#[derive(Clone)]
pub struct EtcdTls {
    /// The CA bundle the members' certificates are verified against.
    pub ca: Vec<u8>,
    /// A client certificate and key, for members that require one
    /// (`--client-cert-auth`).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.identity.is_some())
            .finish_non_exhaustive()
    }
}

impl EtcdTls {
    fn options(&self) -> etcd_client::TlsOptions {
        use tonic::transport::{Certificate, Identity};
        let tls = etcd_client::TlsOptions::new().ca_certificate(Certificate::from_pem(&self.ca));
        match &self.identity {
            Some((cert, key)) => tls.identity(Identity::from_pem(cert, key)),
            None => tls,
        }
    }
}

impl EtcdConfig {
    pub fn new(endpoints: Vec<String>, owner_id: impl Into<String>) -> Self {
        Self {
            endpoints,
            prefix: DEFAULT_PREFIX.to_owned(),
            owner_id: owner_id.into(),
            lease_ttl: Duration::from_secs(10),
            max_txn_ops: DEFAULT_MAX_TXN_OPS,
            request_timeout: Duration::from_secs(5),
            tls: None,
        }
    }
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

fn etcd_err(e: etcd_client::Error) -> StoreError {
    unavailable(format!("etcd: {e}"))
}

/// Whether a request failed before it reached any member: its connection
/// was refused, so nothing was sent and even a write may go again.
fn never_sent(e: &etcd_client::Error) -> bool {
    let etcd_client::Error::GRpcStatus(status) = e else {
        return false;
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(err) = cause {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        cause = err.source();
    }
    false
}

/// The first pause before a request that reached no member goes again; it
/// doubles up to [`UNSENT_PAUSE_MAX`].
const UNSENT_PAUSE: Duration = Duration::from_millis(10);
const UNSENT_PAUSE_MAX: Duration = Duration::from_millis(200);

/// Sends `request` on `client`, and again while it reaches no member (a
/// member that has just gone is still in the client's balancer until the
/// probe takes it out; `probe` asks for that at once), up to twice per
/// member. Any other answer, and the last refusal, is returned.
async fn again_if_unsent<T, Fut>(
    client: &Client,
    probe: &tokio::sync::Notify,
    members: usize,
    mut request: impl FnMut(Client) -> Fut,
) -> Result<T, StoreError>
where
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let mut pause = UNSENT_PAUSE;
    let mut attempts = 2 * members.max(1);
    loop {
        match request(client.clone()).await {
            Err(e) if attempts > 1 && never_sent(&e) => {
                attempts -= 1;
                probe.notify_one();
                tracing::debug!(error = %e, "an etcd request reached no member: sending it again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(UNSENT_PAUSE_MAX);
            }
            r => return r.map_err(etcd_err),
        }
    }
}

/// The lease's state, shared with the keep-alive task.
#[derive(Debug)]
struct LeaseHealth {
    /// Set when keep-alive failed or the lease was released: no more writes.
    fenced: AtomicBool,
    /// When (ms since `start`) the last acknowledged keep-alive was sent.
    renewed_ms: AtomicU64,
    start: Instant,
    ttl: Duration,
}

impl LeaseHealth {
    fn fence(&self, why: &str) {
        if !self.fenced.swap(true, Ordering::SeqCst) {
            tracing::error!(
                reason = why,
                "etcd lease lost: this replica writes no more run state"
            );
        }
    }

    /// Whether the lease may still be live, by the local clock.
    fn live(&self) -> bool {
        if self.fenced.load(Ordering::SeqCst) {
            return false;
        }
        let renewed = Duration::from_millis(self.renewed_ms.load(Ordering::SeqCst));
        if self.start.elapsed().saturating_sub(renewed) >= self.ttl {
            self.fence("no keep-alive acknowledged within the lease's time to live");
            return false;
        }
        true
    }
}

/// A run this store has claimed: the generation of its node records (`None`:
/// no `gen` key yet) and its run id once a run record was seen.
#[derive(Debug, Clone, Default)]
struct Claimed {
    generation: Option<u64>,
    run_id: Option<String>,
}

/// What an [`EtcdStore`] and its [`Replicas`] handles share.
struct Inner {
    /// Runs the store's requests, the keep-alive and the owner watch; `None`
    /// only in drop.
    rt: Option<tokio::runtime::Runtime>,
    client: Client,
    cfg: EtcdConfig,
    sealer: Sealer,
    lease: i64,
    health: Arc<LeaseHealth>,
    claimed: Mutex<HashMap<RunUid, Claimed>>,
    changes: tokio::sync::watch::Receiver<u64>,
    /// Wakes the member probe ([`steer_to_live_members`]) before its period.
    probe: Arc<tokio::sync::Notify>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Allowed in any context (a runtime dropped inside another panics).
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// A `RunStore` over etcd, with per-run ownership fenced by a lease.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cfg = &self.inner.cfg;
        f.debug_struct("EtcdStore")
            .field("endpoints", &cfg.endpoints)
            .field("prefix", &cfg.prefix)
            .field("owner_id", &cfg.owner_id)
            .field("lease", &self.inner.lease)
            .finish_non_exhaustive()
    }
}

/// Runs `f` on `rt` and waits for it from this (synchronous) caller, which may
/// itself be on another runtime's worker.
fn block_on<T: Send + 'static>(
    rt: Option<&tokio::runtime::Runtime>,
    timeout: Duration,
    f: impl Future<Output = Result<T, StoreError>> + Send + 'static,
) -> Result<T, StoreError> {
    let rt = rt.ok_or_else(|| unavailable("the etcd store is shut down"))?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    rt.spawn(async move {
        let r = match tokio::time::timeout(timeout, f).await {
            Ok(r) => r,
            Err(_) => Err(unavailable(format!("etcd did not answer within {timeout:?}"))),
        };
        let _ = tx.send(r);
    });
    rx.recv()
        .map_err(|_| unavailable("the etcd store's runtime stopped"))?
}

async fn keep_alive(
    client: Client,
    lease: i64,
    health: Arc<LeaseHealth>,
    changes: tokio::sync::watch::Sender<u64>,
) {
    keep_alive_until_lost(client, lease, &health).await;
    // Whoever waits for ownership changes hears of the loss at once.
    changes.send_modify(|n| *n += 1);
}

/// Renews the lease every third of its time to live. A keep-alive stream
/// that breaks (its member went, a network blip) is opened again, on
/// whichever member answers, for as long as the lease may still be live by
/// the local clock; the lease is lost when etcd says it is gone or when no
/// renewal was acknowledged within its time to live. A first stream that
/// reached no member (its connection refused) goes again too.
async fn keep_alive_until_lost(client: Client, lease: i64, health: &LeaseHealth) {
    let period = health.ttl / 3;
    let renewed = |sent: Duration| {
        health.renewed_ms.store(
            u64::try_from(sent.as_millis()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
    };
    let mut first = true;
    loop {
        if !first {
            tokio::time::sleep(KEEP_ALIVE_REOPEN_WAIT.min(period)).await;
        }
        if !health.live() {
            return;
        }
        let mut lc = client.lease_client();
        let sent = health.start.elapsed();
        let (mut keeper, mut stream) = match tokio::time::timeout(period, lc.keep_alive(lease)).await {
            Ok(Ok(pair)) => pair,
            // A first stream that reached no member goes again (below),
            // on another, while the lease is live by the local clock.
            Ok(Err(e)) if first && !never_sent(&e) => return health.fence(&format!("keep-alive: {e}")),
            Err(_) if first => return health.fence("keep-alive: etcd did not answer"),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "etcd keep-alive: cannot reopen the stream yet");
                continue;
            }
            Err(_) => {
                tracing::warn!("etcd keep-alive: no member answered the reopened stream");
                continue;
            }
        };
        if !first {
            tracing::info!("etcd keep-alive stream reopened");
        }
        first = false;
        renewed(sent);
        loop {
            tokio::time::sleep(period).await;
            if !health.live() {
                return;
            }
            let sent = health.start.elapsed();
            let answer = tokio::time::timeout(period, async {
                keeper.keep_alive().await?;
                stream.message().await
            })
            .await;
            let broke = match answer {
                Ok(Ok(Some(r))) if r.ttl() > 0 => {
                    renewed(sent);
                    continue;
                }
                Ok(Ok(Some(_))) => return health.fence("keep-alive: the lease is gone"),
                Ok(Ok(None)) => "the stream ended".to_owned(),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "etcd did not answer".to_owned(),
            };
            tracing::warn!(reason = %broke, "etcd keep-alive stream broke: reopening it");
            break;
        }
    }
}

/// How long a broken keep-alive stream waits before it is opened again
/// (at most a third of the lease's time to live).
const KEEP_ALIVE_REOPEN_WAIT: Duration = Duration::from_millis(200);

/// How long a member has to answer its status probe.
const MEMBER_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How often each member is asked whether it is up.
const MEMBER_PROBE_EVERY: Duration = Duration::from_millis(500);

/// Keeps the client's requests on members that answer: every member named
/// in `--store` is asked for its status on a connection of its own; one that
/// does not answer is taken out of the client's balancer (so no request
/// waits on it) and put back once it answers again. The last member left
/// always stays in. `probe` wakes it before its period (a request found a
/// member gone).
async fn steer_to_live_members(client: Client, cfg: EtcdConfig, probe: Arc<tokio::sync::Notify>) {
    let endpoints = &cfg.endpoints;
    if endpoints.len() < 2 {
        return;
    }
    let timeout = MEMBER_PROBE_TIMEOUT.min(cfg.request_timeout);
    let opts = connect_options(&cfg, timeout);
    let tls = cfg.tls.is_some();
    let mut probes: Vec<Option<Client>> = vec![None; endpoints.len()];
    let mut out: Vec<bool> = vec![false; endpoints.len()];
    loop {
        tokio::select! {
            () = tokio::time::sleep(MEMBER_PROBE_EVERY) => {}
            () = probe.notified() => {}
        }
        for (i, endpoint) in endpoints.iter().enumerate() {
            if probes[i].is_none() {
                probes[i] = Client::connect([endpoint.as_str()], Some(opts.clone()))
                    .await
                    .ok();
            }
            let up = match probes[i].as_mut() {
                Some(c) => matches!(tokio::time::timeout(timeout, c.status()).await, Ok(Ok(_))),
                None => false,
            };
            let url = member_url(endpoint, tls);
            if !up && !out[i] && out.iter().filter(|o| !**o).count() > 1 {
                if client.remove_endpoint(&url).await.is_ok() {
                    out[i] = true;
                    tracing::warn!(member = %endpoint, "etcd member does not answer: requests go to the others");
                }
            } else if up && out[i] && client.add_endpoint(&url).await.is_ok() {
                out[i] = false;
                tracing::info!(member = %endpoint, "etcd member answers again: requests go to it too");
            }
        }
    }
}

/// A member's address as the client's balancer keys it.
fn member_url(endpoint: &str, tls: bool) -> String {
    if endpoint.starts_with("http://") || endpoint.starts_with("https://") {
        endpoint.to_owned()
    } else if tls {
        format!("https://{endpoint}")
    } else {
        format!("http://{endpoint}")
    }
}

/// How the store's client (and each member's probe) connects: `timeout`
/// for connecting and for each request, and TLS when configured.
fn connect_options(cfg: &EtcdConfig, timeout: Duration) -> ConnectOptions {
    let opts = ConnectOptions::new()
        .with_connect_timeout(timeout)
        .with_timeout(timeout);
    match &cfg.tls {
        Some(tls) => opts.with_tls(tls.options()),
        None => opts,
    }
}

/// Moves `changes` whenever an ownership key is deleted (its lease expired or
/// was revoked, or its run was dropped), re-opening the watch if it breaks.
async fn watch_owners(client: Client, prefix: Vec<u8>, changes: tokio::sync::watch::Sender<u64>) {
    loop {
        let mut wc = client.watch_client();
        let opened = wc
            .watch(
                prefix.clone(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_filters([WatchFilterType::NoPut]),
                ),
            )
            .await;
        if let Ok(mut stream) = opened {
            // Anything may have moved while no watch was open.
            changes.send_modify(|n| *n += 1);
            while let Ok(Some(resp)) = stream.message().await {
                if resp.events().iter().any(|e| e.event_type() == EventType::Delete) {
                    changes.send_modify(|n| *n += 1);
                }
                if resp.canceled() {
                    break;
                }
            }
        }
        if changes.is_closed() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The end of the range of keys starting with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Every key-value under `prefix`, read at one revision, page by page.
async fn get_prefix(client: &Client, prefix: Vec<u8>) -> Result<Vec<KeyValue>, etcd_client::Error> {
    let mut kv = client.kv_client().max_decoding_message_size(MAX_ANSWER_BYTES);
    let end = prefix_end(&prefix);
    let mut from = prefix;
    let mut revision = 0;
    let mut out = Vec::new();
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
        if revision > 0 {
            opts = opts.with_revision(revision);
        }
        let resp = kv.get(from.clone(), Some(opts)).await?;
        if revision == 0 {
            revision = resp.header().map(|h| h.revision()).unwrap_or(0);
        }
        let kvs = resp.kvs();
        let Some(last) = kvs.last() else { break };
        from = last.key().to_vec();
        from.push(0);
        out.extend_from_slice(kvs);
        if !resp.more() {
            break;
        }
    }
    Ok(out)
}

/// The first key-value of the `i`-th operation's range answer, if any.
fn got(resp: &TxnResponse, i: usize) -> Option<KeyValue> {
    match resp.op_responses().into_iter().nth(i) {
        Some(TxnOpResponse::Get(g)) => g.kvs().first().cloned(),
        _ => None,
    }
}

fn text(kv: &KeyValue) -> String {
    String::from_utf8_lossy(kv.value()).into_owned()
}

fn parse_gen(kv: Option<&KeyValue>) -> Result<Option<u64>, StoreError> {
    match kv {
        None => Ok(None),
        Some(kv) => {
            let s = std::str::from_utf8(kv.value()).map_err(|_| corrupt("a run's gen key is not text"))?;
            s.parse()
                .map(Some)
                .map_err(|_| corrupt(format!("a run's gen key holds {s:?}")))
        }
    }
}

/// Why a write transaction's comparisons failed: its failure branch reads the
/// ownership key, the gen key, the run record and (when the write creates
/// the run) the run id's name key, in that order.
enum Refused {
    Ownership(String),
    Generation(Option<u64>),
    UnknownRun,
    /// Another run (this uid) holds the run id.
    NameTaken(String),
}

/// A first write of a run records its uid in `uids/` and, unless it is a
/// reclaim run, takes its run id in `names/`: the comparison and the writes.
struct Creating {
    run_id: String,
    compares: Vec<Compare>,
    ops: Vec<TxnOp>,
}

impl EtcdStore {
    /// Connects, takes a lease and starts keeping it alive.
    pub fn open(cfg: EtcdConfig, sealer: Sealer) -> Result<Self, StoreError> {
        if cfg.endpoints.is_empty() {
            return Err(unavailable("no etcd endpoints"));
        }
        if cfg.owner_id.is_empty() || cfg.owner_id.contains('/') {
            return Err(unavailable("an owner id must be non-empty, without '/'"));
        }
        if cfg.max_txn_ops < 8 {
            return Err(unavailable("max_txn_ops below 8"));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("etcd-store")
            .enable_all()
            .build()
            .map_err(|e| unavailable(format!("starting the etcd store's runtime: {e}")))?;
        let endpoints = cfg.endpoints.clone();
        let ttl_secs = i64::try_from(cfg.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        // The lease is judged against the machine's own monotonic clock,
        // as etcd times it on its side: the store is I/O, not the driver's
        // decisions, and its keep-alive runs on a runtime of its own.
        #[expect(
            clippy::disallowed_methods,
            reason = "the lease's local judgement times real keep-alive round trips"
        )]
        let start = Instant::now();
        let opts = connect_options(&cfg, cfg.request_timeout);
        let probe = Arc::new(tokio::sync::Notify::new());
        let first_probe = probe.clone();
        let (client, lease, granted) = block_on(Some(&rt), cfg.request_timeout * 2, async move {
            let members = endpoints.len();
            let client = Client::connect(endpoints, Some(opts)).await.map_err(etcd_err)?;
            let lease = again_if_unsent(&client, &first_probe, members, |mut c| async move {
                c.lease_grant(ttl_secs, None).await
            })
            .await?;
            Ok((client, lease.id(), lease.ttl()))
        })?;
        let ttl = Duration::from_secs(u64::try_from(granted).unwrap_or(0).max(1));
        let health = Arc::new(LeaseHealth {
            fenced: AtomicBool::new(false),
            renewed_ms: AtomicU64::new(0),
            start,
            ttl,
        });
        let (changes_tx, changes) = tokio::sync::watch::channel(0u64);
        rt.spawn(keep_alive(
            client.clone(),
            lease,
            health.clone(),
            changes_tx.clone(),
        ));
        rt.spawn(steer_to_live_members(client.clone(), cfg.clone(), probe.clone()));
        rt.spawn(watch_owners(
            client.clone(),
            format!("{}owners/", cfg.prefix).into_bytes(),
            changes_tx,
        ));
        tracing::info!(owner = %cfg.owner_id, lease, ttl_s = ttl.as_secs(), "etcd store open");
        Ok(Self {
            inner: Arc::new(Inner {
                rt: Some(rt),
                client,
                cfg,
                sealer,
                lease,
                health,
                claimed: Mutex::new(HashMap::new()),
                changes,
                probe,
            }),
        })
    }

    pub fn owner_id(&self) -> &str {
        &self.inner.cfg.owner_id
    }

    pub fn lease_id(&self) -> i64 {
        self.inner.lease
    }

    /// Whether this store has stopped writing (its lease is lost or released).
    pub fn is_fenced(&self) -> bool {
        !self.inner.health.live()
    }

    /// This store's handle on run ownership, for the driver.
    pub fn replicas(&self) -> Arc<dyn Replicas> {
        Arc::new(self.clone())
    }

    /// Revokes the lease: every run this store owns is released at once, and
    /// the store writes no more.
    pub fn revoke_lease(&mut self) -> Result<(), StoreError> {
        Replicas::resign(self)
    }

    fn claimed(&self) -> std::sync::MutexGuard<'_, HashMap<RunUid, Claimed>> {
        match self.inner.claimed.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    fn block<T: Send + 'static>(
        &self,
        f: impl Future<Output = Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        block_on(self.inner.rt.as_ref(), self.inner.cfg.request_timeout, f)
    }

    fn key(&self, rest: &str) -> String {
        format!("{}{rest}", self.inner.cfg.prefix)
    }

    fn owner_key(&self, uid: RunUid) -> String {
        self.key(&format!("owners/{uid}"))
    }

    fn name_key(&self, run_id: &str) -> String {
        self.key(&format!("names/{run_id}"))
    }

    fn uid_key(&self, uid: RunUid) -> String {
        self.key(&format!("uids/{uid}"))
    }

    fn member_key(&self, owner: &str) -> String {
        self.key(&format!("members/{owner}"))
    }

    fn run_key(&self, uid: RunUid, rest: &str) -> String {
        self.key(&format!("runs/{uid}/{rest}"))
    }

    fn event_key(&self, uid: RunUid, seq: u64) -> String {
        self.run_key(uid, &format!("events/{seq:020}"))
    }

    /// The writes of a delta's events: each recorded or repeated event, and
    /// the deletion of those the run no longer keeps.
    fn event_ops(&self, delta: &RunDelta) -> Result<Vec<TxnOp>, StoreError> {
        let mut ops = Vec::new();
        if delta.events.is_empty() && delta.events_below.is_none() {
            return Ok(ops);
        }
        let run_id = match &delta.meta {
            Some(m) => m.run_id.clone(),
            None => {
                let known = self.claimed().get(&delta.uid).and_then(|c| c.run_id.clone());
                match known {
                    Some(id) => contract::RunId::parse("run_id", &id).map_err(corrupt)?,
                    None => {
                        let key = self.run_key(delta.uid, "meta");
                        let got = self.send(move |mut client| {
                            let key = key.clone();
                            async move { client.get(key, None).await }
                        })?;
                        let kv = got.kvs().first().ok_or(StoreError::UnknownRun(delta.uid))?;
                        decode_meta(&self.inner.sealer, kv.value())?.run_id
                    }
                }
            }
        };
        for e in &delta.events {
            ops.push(TxnOp::put(
                self.event_key(delta.uid, e.seq),
                encode_event(&run_id, e),
                None,
            ));
        }
        if let Some(below) = delta.events_below {
            ops.push(TxnOp::delete(
                self.event_key(delta.uid, 0),
                Some(DeleteOptions::new().with_range(self.event_key(delta.uid, below))),
            ));
        }
        Ok(ops)
    }

    fn nodes_prefix(&self, uid: RunUid, generation: u64) -> String {
        self.run_key(uid, &format!("nodes/{generation}/"))
    }

    /// Sends the request `request` builds on the store's runtime, again while
    /// it reaches no member ([`again_if_unsent`]), and waits for its answer.
    fn send<T, Fut>(&self, request: impl FnMut(Client) -> Fut + Send + 'static) -> Result<T, StoreError>
    where
        T: Send + 'static,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send,
    {
        let client = self.inner.client.clone();
        let probe = self.inner.probe.clone();
        let members = self.inner.cfg.endpoints.len();
        self.block(async move { again_if_unsent(&client, &probe, members, request).await })
    }

    fn txn(&self, txn: Txn) -> Result<TxnResponse, StoreError> {
        self.send(move |mut client| {
            let txn = txn.clone();
            async move { client.txn(txn).await }
        })
    }

    fn get_prefix(&self, prefix: String) -> Result<Vec<KeyValue>, StoreError> {
        let prefix = prefix.into_bytes();
        self.send(move |client| {
            let prefix = prefix.clone();
            async move { get_prefix(&client, prefix).await }
        })
    }

    fn check_live(&self) -> Result<(), StoreError> {
        if self.inner.health.live() {
            Ok(())
        } else {
            Err(unavailable(format!(
                "replica {} has lost its etcd lease: it writes no more run state",
                self.inner.cfg.owner_id
            )))
        }
    }

    fn lost(&self, uid: RunUid, owner: &str) -> StoreError {
        self.claimed().remove(&uid);
        let now = if owner.is_empty() { "nobody" } else { owner };
        unavailable(format!(
            "replica {} does not own run {uid} (its owner is {now}): the write was refused",
            self.inner.cfg.owner_id
        ))
    }

    /// Claims `uid` for this replica unless already claimed; returns the
    /// generation of its node records, or who holds the run. With
    /// `existing`, only a stored run is claimed (a run dropped meanwhile is
    /// held by nobody: `Err("")`).
    fn claim_run(&self, uid: RunUid, existing: bool) -> Result<Result<Option<u64>, String>, StoreError> {
        if let Some(c) = self.claimed().get(&uid) {
            return Ok(Ok(c.generation));
        }
        let owner = self.owner_key(uid);
        let gen_key = self.run_key(uid, "gen");
        let me = self.inner.cfg.owner_id.clone();
        let lease = self.inner.lease;
        let put = || {
            TxnOp::put(
                owner.clone(),
                me.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )
        };
        let mut when = vec![Compare::create_revision(owner.clone(), CompareOp::Equal, 0)];
        if existing {
            when.push(Compare::version(self.uid_key(uid), CompareOp::Greater, 0));
        }
        let resp = self.txn(
            Txn::new()
                .when(when)
                .and_then([put(), TxnOp::get(gen_key.clone(), None)])
                .or_else([
                    TxnOp::get(owner.clone(), None),
                    TxnOp::get(gen_key.clone(), None),
                    TxnOp::get(self.uid_key(uid), Some(GetOptions::new().with_keys_only())),
                ]),
        )?;
        let generation = parse_gen(got(&resp, 1).as_ref())?;
        if !resp.succeeded() {
            if existing && got(&resp, 2).is_none() {
                return Ok(Err(String::new()));
            }
            let held = got(&resp, 0);
            let holder = held.as_ref().map(text).unwrap_or_default();
            let Some(held) = held.filter(|_| holder == me) else {
                return Ok(Err(holder));
            };
            if held.lease() != lease {
                // Ours from an earlier lease (a restart under the same owner
                // id): attach it to this one, unless it changed meanwhile.
                let resp = self.txn(
                    Txn::new()
                        .when([Compare::mod_revision(
                            owner.clone(),
                            CompareOp::Equal,
                            held.mod_revision(),
                        )])
                        .and_then([put()]),
                )?;
                if !resp.succeeded() {
                    return Ok(Err("another replica".to_owned()));
                }
            }
        }
        // A claim after the lease lapsed by the local clock would be a claim
        // this replica could not keep.
        self.check_live()?;
        self.claimed().entry(uid).or_default().generation = generation;
        Ok(Ok(generation))
    }

    fn claim(&self, uid: RunUid) -> Result<Option<u64>, StoreError> {
        match self.claim_run(uid, false)? {
            Ok(g) => Ok(g),
            Err(holder) => Err(self.lost(uid, &holder)),
        }
    }

    /// The comparisons every write of `uid` makes: this replica owns the run
    /// and its node records are at `generation`.
    fn fence(&self, uid: RunUid, generation: Option<u64>) -> Vec<Compare> {
        let gen_key = self.run_key(uid, "gen");
        vec![
            Compare::value(
                self.owner_key(uid),
                CompareOp::Equal,
                self.inner.cfg.owner_id.clone(),
            ),
            match generation {
                Some(g) => Compare::value(gen_key, CompareOp::Equal, g.to_string()),
                None => Compare::version(gen_key, CompareOp::Equal, 0),
            },
        ]
    }

    fn diagnose_ops(&self, uid: RunUid, name: Option<&str>) -> Vec<TxnOp> {
        let mut ops = vec![
            TxnOp::get(self.owner_key(uid), None),
            TxnOp::get(self.run_key(uid, "gen"), None),
            TxnOp::get(
                self.run_key(uid, "meta"),
                Some(GetOptions::new().with_keys_only()),
            ),
        ];
        if let Some(run_id) = name {
            ops.push(TxnOp::get(self.name_key(run_id), None));
        }
        ops
    }

    fn diagnose(
        &self,
        resp: &TxnResponse,
        uid: RunUid,
        generation: Option<u64>,
        creating: bool,
    ) -> Result<Refused, StoreError> {
        let owner = got(resp, 0).as_ref().map(text).unwrap_or_default();
        if owner != self.inner.cfg.owner_id {
            return Ok(Refused::Ownership(owner));
        }
        let found = parse_gen(got(resp, 1).as_ref())?;
        if found != generation {
            return Ok(Refused::Generation(found));
        }
        if creating {
            if let Some(holder) = got(resp, 3).as_ref().map(text)
                && holder != uid.to_string()
            {
                return Ok(Refused::NameTaken(holder));
            }
        } else if got(resp, 2).is_none() {
            return Ok(Refused::UnknownRun);
        }
        Err(unavailable(
            "an etcd transaction failed its comparisons for no visible reason",
        ))
    }

    /// One write transaction under the fence; on refusal, the reason.
    /// `creating` names the run id a run's first write takes.
    fn fenced_txn(
        &self,
        uid: RunUid,
        generation: Option<u64>,
        extra: Vec<Compare>,
        ops: Vec<TxnOp>,
        creating: Option<&str>,
    ) -> Result<Result<(), Refused>, StoreError> {
        self.check_live()?;
        let mut when = self.fence(uid, generation);
        when.extend(extra);
        let resp = self.txn(
            Txn::new()
                .when(when)
                .and_then(ops)
                .or_else(self.diagnose_ops(uid, creating)),
        )?;
        if resp.succeeded() {
            return Ok(Ok(()));
        }
        let why = self.diagnose(&resp, uid, generation, creating.is_some())?;
        match &why {
            Refused::Ownership(owner) => return Err(self.lost(uid, owner)),
            Refused::Generation(g) => {
                self.claimed().entry(uid).or_default().generation = *g;
            }
            Refused::UnknownRun | Refused::NameTaken(_) => {}
        }
        Ok(Err(why))
    }

    /// The records the commit of a run's first write adds (see [`Creating`]).
    fn creating(&self, uid: RunUid, meta: &crate::core::RunMeta) -> Creating {
        let run_id = meta.run_id.to_string();
        let mut compares = Vec::new();
        let mut ops = vec![TxnOp::put(self.uid_key(uid), run_id.clone(), None)];
        if !meta.reclaim {
            let name = self.name_key(&run_id);
            compares.push(Compare::version(name.clone(), CompareOp::Equal, 0));
            ops.push(TxnOp::put(name, uid.to_string(), None));
        }
        Creating {
            run_id,
            compares,
            ops,
        }
    }

    /// The writes that drop a run: its records, its uid, its ownership key,
    /// and its run id's name key if that still names this run.
    fn drop_ops(&self, uid: RunUid, run_id: Option<&str>) -> Vec<TxnOp> {
        let mut ops = vec![
            TxnOp::delete(self.run_key(uid, ""), Some(DeleteOptions::new().with_prefix())),
            TxnOp::delete(self.uid_key(uid), None),
            TxnOp::delete(self.owner_key(uid), None),
        ];
        if let Some(run_id) = run_id {
            let name = self.name_key(run_id);
            ops.push(TxnOp::txn(
                Txn::new()
                    .when([Compare::value(name.clone(), CompareOp::Equal, uid.to_string())])
                    .and_then([TxnOp::delete(name, None)]),
            ));
        }
        ops
    }

    /// Every fenced write also says who wrote it (`runs/<uid>/writer`), so the
    /// store's history shows which replica wrote each revision of a run.
    fn writer_op(&self, uid: RunUid) -> TxnOp {
        TxnOp::put(self.run_key(uid, "writer"), self.inner.cfg.owner_id.clone(), None)
    }

    fn commit_once(&self, delta: &RunDelta) -> Result<Result<(), Refused>, StoreError> {
        let uid = delta.uid;
        if delta.drop_run {
            // Dropping a run that is not stored (any more) changes nothing.
            let generation = match self.claim_run(uid, true)? {
                Ok(g) => g,
                Err(holder) if holder.is_empty() => return Ok(Ok(())),
                Err(holder) => return Err(self.lost(uid, &holder)),
            };
            let run_id = self.claimed().get(&uid).and_then(|c| c.run_id.clone());
            let ops = self.drop_ops(uid, run_id.as_deref());
            let r = self.fenced_txn(uid, generation, Vec::new(), ops, None)?;
            if r.is_ok() {
                self.claimed().remove(&uid);
            }
            return Ok(r);
        }
        let generation = self.claim(uid)?;
        let meta = delta
            .meta
            .as_ref()
            .map(|m| encode_meta(&self.inner.sealer, m))
            .transpose()?;
        let creating = match (&delta.meta, generation) {
            (Some(m), None) => Some(self.creating(uid, m)),
            _ => None,
        };
        let mut upserts = Vec::with_capacity(delta.upserts.len());
        for r in &delta.upserts {
            upserts.push((r.node.id.to_string(), encode_node(&self.inner.sealer, r)?));
        }
        let removals: Vec<String> = delta.removals.iter().map(|id| id.to_string()).collect();
        let mut extra = if meta.is_none() {
            vec![Compare::version(self.run_key(uid, "meta"), CompareOp::Greater, 0)]
        } else {
            Vec::new()
        };
        let mut fixed = vec![self.writer_op(uid)];
        fixed.extend(self.event_ops(delta)?);
        let name = creating.as_ref().map(|c| c.run_id.clone());
        if let Some(c) = creating {
            extra.extend(c.compares);
            fixed.extend(c.ops);
        }
        let ops = upserts.len() + removals.len() + fixed.len() + 2;
        let bytes: usize = upserts.iter().map(|(_, v)| v.len()).sum::<usize>()
            + meta.as_ref().map_or(0, Vec::len)
            + delta.events.iter().map(|e| e.message.len() + 128).sum::<usize>();
        let r = if ops > self.inner.cfg.max_txn_ops || bytes > MAX_TXN_BYTES {
            self.rewrite(
                uid,
                generation,
                meta,
                upserts,
                removals,
                (extra, fixed),
                name.as_deref(),
            )?
        } else {
            let g = generation.unwrap_or(0);
            let prefix = self.nodes_prefix(uid, g);
            let mut txn_ops = Vec::with_capacity(ops);
            txn_ops.extend(fixed);
            if let Some(m) = meta {
                txn_ops.push(TxnOp::put(self.run_key(uid, "meta"), m, None));
            }
            if generation.is_none() {
                txn_ops.push(TxnOp::put(self.run_key(uid, "gen"), "0", None));
            }
            for (id, v) in upserts {
                txn_ops.push(TxnOp::put(format!("{prefix}{id}"), v, None));
            }
            for id in removals {
                txn_ops.push(TxnOp::delete(format!("{prefix}{id}"), None));
            }
            let r = self.fenced_txn(uid, generation, extra, txn_ops, name.as_deref())?;
            if r.is_ok() {
                self.claimed().entry(uid).or_default().generation = Some(g);
            }
            r
        };
        if r.is_ok()
            && let Some(m) = &delta.meta
        {
            self.claimed().entry(uid).or_default().run_id = Some(m.run_id.to_string());
        }
        Ok(r)
    }

    /// A delta too large for one transaction: the whole node set after it is
    /// written under the next generation, then one transaction switches to it
    /// (with `last`: the comparisons and writes that belong to the switch).
    #[allow(clippy::too_many_arguments)]
    fn rewrite(
        &self,
        uid: RunUid,
        generation: Option<u64>,
        meta: Option<Vec<u8>>,
        upserts: Vec<(String, Vec<u8>)>,
        removals: Vec<String>,
        last: (Vec<Compare>, Vec<TxnOp>),
        name: Option<&str>,
    ) -> Result<Result<(), Refused>, StoreError> {
        let (extra, fixed) = last;
        let g = generation.unwrap_or(0);
        let next = g + 1;
        let old = self.nodes_prefix(uid, g);
        let staged = self.nodes_prefix(uid, next);
        // Clear what an earlier rewrite cut short left (and check the run is
        // known, and its name free, before writing anything).
        let clear = vec![TxnOp::delete(
            staged.clone(),
            Some(DeleteOptions::new().with_prefix()),
        )];
        if let Err(why) = self.fenced_txn(uid, generation, extra.clone(), clear, name)? {
            return Ok(Err(why));
        }
        let current = self.get_prefix(old.clone())?;
        let mut nodes: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for kv in current {
            let id = kv
                .key()
                .strip_prefix(old.as_bytes())
                .ok_or_else(|| corrupt("a node key outside its run's range"))?;
            let id = String::from_utf8(id.to_vec()).map_err(|_| corrupt("a node key is not text"))?;
            nodes.insert(id, kv.value().to_vec());
        }
        for id in removals {
            nodes.remove(&id);
        }
        nodes.extend(upserts);
        let mut chunk: Vec<TxnOp> = Vec::new();
        let mut chunk_bytes = 0;
        let per_txn = self.inner.cfg.max_txn_ops;
        let mut entries = nodes.into_iter().peekable();
        while let Some((id, v)) = entries.next() {
            chunk_bytes += v.len();
            chunk.push(TxnOp::put(format!("{staged}{id}"), v, None));
            let full = chunk.len() >= per_txn
                || entries
                    .peek()
                    .is_some_and(|(_, n)| chunk_bytes + n.len() > MAX_TXN_BYTES);
            if full || entries.peek().is_none() {
                let ops = std::mem::take(&mut chunk);
                chunk_bytes = 0;
                if let Err(why) = self.fenced_txn(uid, generation, Vec::new(), ops, None)? {
                    return Ok(Err(why));
                }
            }
        }
        let mut ops = fixed;
        ops.push(TxnOp::put(self.run_key(uid, "gen"), next.to_string(), None));
        ops.push(TxnOp::delete(old, Some(DeleteOptions::new().with_prefix())));
        if let Some(m) = meta {
            ops.push(TxnOp::put(self.run_key(uid, "meta"), m, None));
        }
        let r = self.fenced_txn(uid, generation, extra, ops, name)?;
        if r.is_ok() {
            self.claimed().entry(uid).or_default().generation = Some(next);
        }
        Ok(r)
    }

    /// The runs in `kvs` (keys under `runs/`), each at its current generation.
    fn parse_runs(&self, kvs: &[KeyValue]) -> Result<Vec<StoredRun>, StoreError> {
        let runs = self.key("runs/");
        let mut metas: BTreeMap<String, &[u8]> = BTreeMap::new();
        let mut gens: BTreeMap<String, u64> = BTreeMap::new();
        let mut nodes: BTreeMap<(String, u64), NodeValues<'_>> = BTreeMap::new();
        let mut events: BTreeMap<String, Vec<contract::Event>> = BTreeMap::new();
        for kv in kvs {
            let key = kv
                .key()
                .strip_prefix(runs.as_bytes())
                .and_then(|k| std::str::from_utf8(k).ok())
                .ok_or_else(|| corrupt("a key under the runs prefix is not text"))?;
            let (uid, rest) = key
                .split_once('/')
                .ok_or_else(|| corrupt(format!("unexpected key {key}")))?;
            match rest {
                "meta" => {
                    metas.insert(uid.to_owned(), kv.value());
                }
                "gen" => {
                    if let Some(g) = parse_gen(Some(kv))? {
                        gens.insert(uid.to_owned(), g);
                    }
                }
                "writer" => {}
                _ if rest.starts_with("events/") => {
                    let seq = rest
                        .strip_prefix("events/")
                        .and_then(|s| s.parse::<u64>().ok())
                        .ok_or_else(|| corrupt(format!("unexpected key {key}")))?;
                    let e = decode_event(kv.value())?;
                    if e.seq != seq {
                        return Err(corrupt(format!("event {} under the wrong key {key}", e.seq)));
                    }
                    events.entry(uid.to_owned()).or_default().push(e);
                }
                _ => {
                    let (g, id) = rest
                        .strip_prefix("nodes/")
                        .and_then(|r| r.split_once('/'))
                        .and_then(|(g, id)| Some((g.parse::<u64>().ok()?, id)))
                        .ok_or_else(|| corrupt(format!("unexpected key {key}")))?;
                    nodes
                        .entry((uid.to_owned(), g))
                        .or_default()
                        .push((id.to_owned(), kv.value()));
                }
            }
        }
        let sealer = &self.inner.sealer;
        let mut out = Vec::with_capacity(metas.len());
        for (uid, bytes) in &metas {
            let meta = decode_meta(sealer, bytes)?;
            if meta.uid.to_string() != *uid {
                return Err(corrupt(format!("run record under the wrong key {uid}")));
            }
            let g = gens.get(uid).copied().unwrap_or(0);
            let mut records: Vec<NodeRecord> = Vec::new();
            // Other generations are what a cut-short rewrite left: not part
            // of the run.
            for (id, v) in nodes.remove(&(uid.clone(), g)).unwrap_or_default() {
                let rec = decode_node(sealer, v)?;
                if rec.node.id != LogicalNodeId::parse("node_id", &id).map_err(corrupt)? {
                    return Err(corrupt(format!("node record under the wrong key {id}")));
                }
                records.push(rec);
            }
            records.sort_by_key(|r| r.node.id.clone());
            let mut log = events.remove(uid).unwrap_or_default();
            log.sort_by_key(|e| e.seq);
            out.push(StoredRun {
                meta,
                nodes: records,
                events: log,
            });
        }
        for (uid, g) in nodes.keys() {
            if !metas.contains_key(uid) && gens.get(uid).copied().unwrap_or(0) == *g {
                return Err(corrupt(format!(
                    "node records of run {uid}, which has no run record"
                )));
            }
        }
        out.sort_by_key(|r| r.meta.uid);
        Ok(out)
    }

    /// `(uid, owner, lease)` of every ownership key.
    fn owners(&self) -> Result<Vec<(RunUid, String, i64)>, StoreError> {
        let prefix = self.key("owners/");
        let mut out = Vec::new();
        for kv in self.get_prefix(prefix.clone())? {
            let uid = kv
                .key()
                .strip_prefix(prefix.as_bytes())
                .and_then(|k| std::str::from_utf8(k).ok())
                .and_then(|k| RunUid::parse("run_uid", k).ok())
                .ok_or_else(|| corrupt("an ownership key that names no run uid"))?;
            out.push((uid, text(&kv), kv.lease()));
        }
        Ok(out)
    }

    /// The uid of every stored run.
    fn uids(&self) -> Result<Vec<RunUid>, StoreError> {
        let prefix = self.key("uids/");
        self.get_prefix(prefix.clone())?
            .iter()
            .map(|kv| {
                kv.key()
                    .strip_prefix(prefix.as_bytes())
                    .and_then(|k| std::str::from_utf8(k).ok())
                    .and_then(|k| RunUid::parse("run_uid", k).ok())
                    .ok_or_else(|| corrupt("a uid key that names no run uid"))
            })
            .collect()
    }
}

/// A run generation's node records: (node id, record).
type NodeValues<'a> = Vec<(String, &'a [u8])>;

impl RunStore for EtcdStore {
    fn commit(&self, delta: &RunDelta) -> Result<(), StoreError> {
        self.check_live()?;
        // A second attempt only after the node generation was found moved
        // (the cached one was stale).
        for _ in 0..2 {
            match self.commit_once(delta)? {
                Ok(()) => return Ok(()),
                Err(Refused::UnknownRun) => return Err(StoreError::UnknownRun(delta.uid)),
                Err(Refused::Ownership(owner)) => return Err(self.lost(delta.uid, &owner)),
                Err(Refused::NameTaken(holder)) => {
                    let run_id = delta
                        .meta
                        .as_ref()
                        .map(|m| m.run_id.to_string())
                        .unwrap_or_default();
                    return Err(StoreError::NameTaken { run_id, holder });
                }
                Err(Refused::Generation(_)) => {}
            }
        }
        Err(unavailable(format!(
            "run {}'s node generation kept moving under replica {}",
            delta.uid, self.inner.cfg.owner_id
        )))
    }

    fn load_all(&self) -> Result<Vec<StoredRun>, StoreError> {
        let kvs = self.get_prefix(self.key("runs/"))?;
        self.parse_runs(&kvs)
    }
}

impl Replicas for EtcdStore {
    fn owner_id(&self) -> &str {
        &self.inner.cfg.owner_id
    }

    fn owns(&self, uid: RunUid) -> bool {
        self.inner.health.live() && self.claimed().contains_key(&uid)
    }

    fn lost(&self) -> bool {
        !self.inner.health.live()
    }

    fn announce(&self, address: &str) -> Result<(), StoreError> {
        self.check_live()?;
        let key = self.member_key(&self.inner.cfg.owner_id);
        let address = address.to_owned();
        let lease = self.inner.lease;
        self.send(move |mut client| {
            let (key, address) = (key.clone(), address.clone());
            async move {
                client
                    .put(key, address, Some(PutOptions::new().with_lease(lease)))
                    .await
                    .map(drop)
            }
        })
    }

    fn claim(&self, uid: RunUid) -> Result<Claim, StoreError> {
        self.check_live()?;
        Ok(match self.claim_run(uid, true)? {
            Ok(_) => Claim::Mine,
            Err(owner) if owner.is_empty() => Claim::Gone,
            Err(owner) => Claim::Held { owner },
        })
    }

    fn release(&self, uid: RunUid) -> Result<(), StoreError> {
        self.claimed().remove(&uid);
        let owner = self.owner_key(uid);
        self.txn(
            Txn::new()
                .when([
                    Compare::value(owner.clone(), CompareOp::Equal, self.inner.cfg.owner_id.clone()),
                    Compare::lease(owner.clone(), CompareOp::Equal, self.inner.lease),
                ])
                .and_then([TxnOp::delete(owner, None)]),
        )?;
        Ok(())
    }

    fn load(&self, uid: RunUid) -> Result<Option<StoredRun>, StoreError> {
        let kvs = self.get_prefix(self.run_key(uid, ""))?;
        let run = self.parse_runs(&kvs)?.into_iter().next();
        if let Some(r) = &run
            && let Some(c) = self.claimed().get_mut(&uid)
        {
            c.run_id = Some(r.meta.run_id.to_string());
        }
        Ok(run)
    }

    fn elsewhere(&self) -> Result<Vec<(StoredRun, Option<Owner>)>, StoreError> {
        let names = self.key("names/");
        let mut uids = Vec::new();
        for kv in self.get_prefix(names.clone())? {
            let uid = RunUid::parse("run_uid", &text(&kv)).map_err(corrupt)?;
            if !self.claimed().contains_key(&uid) {
                uids.push(uid);
            }
        }
        if uids.is_empty() {
            return Ok(Vec::new());
        }
        let owners: HashMap<RunUid, String> = self
            .owners()?
            .into_iter()
            .map(|(uid, owner, _)| (uid, owner))
            .collect();
        let members = self.key("members/");
        let addresses: HashMap<String, String> = self
            .get_prefix(members.clone())?
            .iter()
            .filter_map(|kv| {
                let id = std::str::from_utf8(kv.key().strip_prefix(members.as_bytes())?).ok()?;
                Some((id.to_owned(), text(kv)))
            })
            .collect();
        let mut out = Vec::with_capacity(uids.len());
        for uid in uids {
            let kvs = self.get_prefix(self.run_key(uid, ""))?;
            // A run dropped since its name was read is left out.
            let Some(run) = self.parse_runs(&kvs)?.into_iter().next() else {
                continue;
            };
            let owner = owners.get(&uid).map(|id| Owner {
                id: id.clone(),
                address: addresses.get(id).cloned(),
            });
            out.push((run, owner));
        }
        Ok(out)
    }

    fn locate(&self, run_id: &str) -> Result<Placement, StoreError> {
        let name = self.txn(Txn::new().and_then([TxnOp::get(self.name_key(run_id), None)]))?;
        let Some(uid) = got(&name, 0) else {
            return Ok(Placement::Unknown);
        };
        let uid = RunUid::parse("run_uid", &text(&uid)).map_err(corrupt)?;
        let found = self.txn(Txn::new().and_then([
            TxnOp::get(self.owner_key(uid), None),
            TxnOp::get(self.uid_key(uid), Some(GetOptions::new().with_keys_only())),
        ]))?;
        if got(&found, 1).is_none() {
            // A name left by a run that is gone.
            return Ok(Placement::Unknown);
        }
        let Some(owner) = got(&found, 0) else {
            return Ok(Placement::Unowned(uid));
        };
        let owner = text(&owner);
        if owner == self.inner.cfg.owner_id {
            return Ok(if self.claimed().contains_key(&uid) {
                Placement::Here(uid)
            } else {
                Placement::Unowned(uid)
            });
        }
        let member = self.txn(Txn::new().and_then([TxnOp::get(self.member_key(&owner), None)]))?;
        let address = got(&member, 0).as_ref().map(text);
        Ok(Placement::Elsewhere(uid, Owner { id: owner, address }))
    }

    fn unowned(&self) -> Result<Vec<RunUid>, StoreError> {
        let owners = self.owners()?;
        let me = &self.inner.cfg.owner_id;
        let claimed = self.claimed().keys().copied().collect::<HashSet<_>>();
        let held: HashSet<RunUid> = owners
            .iter()
            .filter(|(uid, owner, lease)| {
                owner != me || (*lease == self.inner.lease && claimed.contains(uid))
            })
            .map(|(uid, _, _)| *uid)
            .collect();
        Ok(self
            .uids()?
            .into_iter()
            .filter(|uid| !held.contains(uid))
            .collect())
    }

    fn known_runs(&self) -> Result<HashSet<RunUid>, StoreError> {
        let mut known: HashSet<RunUid> = self.uids()?.into_iter().collect();
        known.extend(self.owners()?.into_iter().map(|(uid, _, _)| uid));
        Ok(known)
    }

    fn resign(&self) -> Result<(), StoreError> {
        self.inner.health.fence("resigned");
        self.claimed().clear();
        let lease = self.inner.lease;
        self.send(move |mut client| async move { client.lease_revoke(lease).await.map(drop) })
    }

    fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.changes.clone()
    }
}

/// The etcd store's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct EtcdArgs {
    /// etcd members for `--store etcd`: `host:port,...`.
    #[arg(long, env = "DRIVER_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// The prefix of every key the store writes.
    #[arg(long, env = "DRIVER_ETCD_PREFIX", default_value = DEFAULT_PREFIX)]
    pub etcd_prefix: String,
    /// This replica's owner id in the runs' ownership keys (default: random
    /// per process).
    #[arg(long, env = "DRIVER_ETCD_OWNER_ID")]
    pub etcd_owner_id: Option<String>,
    /// The time to live of this replica's lease, in seconds.
    #[arg(long, env = "DRIVER_ETCD_LEASE_TTL_S", default_value_t = 10)]
    pub etcd_lease_ttl_s: u64,
    /// The most operations in one transaction (etcd's --max-txn-ops).
    #[arg(long, env = "DRIVER_ETCD_MAX_TXN_OPS", default_value_t = DEFAULT_MAX_TXN_OPS)]
    pub etcd_max_txn_ops: usize,
    /// The `host:port` clients reach this replica's public API at, announced
    /// to the other replicas, which answer a request for a run this replica
    /// serves with it (default: the bound listen address).
    #[arg(long, env = "DRIVER_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,
    /// TLS to etcd: the CA bundle (PEM) the members' certificates are
    /// verified against. TLS is on when it is given.
    #[arg(long, env = "DRIVER_ETCD_TLS_CA", value_name = "PEM")]
    pub etcd_tls_ca: Option<std::path::PathBuf>,
    /// With --etcd-tls-ca: the certificate (PEM) this replica presents to
    /// members that require client certificates; with --etcd-tls-key.
    #[arg(long, env = "DRIVER_ETCD_TLS_CERT", value_name = "PEM", requires_all = ["etcd_tls_key", "etcd_tls_ca"])]
    pub etcd_tls_cert: Option<std::path::PathBuf>,
    /// The key (PEM) of --etcd-tls-cert.
    #[arg(
        long,
        env = "DRIVER_ETCD_TLS_KEY",
        value_name = "PEM",
        requires = "etcd_tls_cert"
    )]
    pub etcd_tls_key: Option<std::path::PathBuf>,
}

impl EtcdArgs {
    pub fn config(&self) -> Result<EtcdConfig, StoreError> {
        if self.etcd_endpoints.is_empty() {
            return Err(unavailable("--store etcd needs --etcd-endpoints"));
        }
        let prefix = if self.etcd_prefix.ends_with('/') {
            self.etcd_prefix.clone()
        } else {
            format!("{}/", self.etcd_prefix)
        };
        let owner_id = match &self.etcd_owner_id {
            Some(id) => id.clone(),
            None => {
                let mut b = [0u8; 8];
                getrandom::fill(&mut b).map_err(|e| unavailable(format!("an owner id: {e}")))?;
                b.iter().map(|x| format!("{x:02x}")).collect()
            }
        };
        let read = |flag: &str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| unavailable(format!("{flag} {}: {e}", path.display())))
        };
        let tls = match &self.etcd_tls_ca {
            None => None,
            Some(ca) => Some(EtcdTls {
                ca: read("--etcd-tls-ca", ca)?,
                identity: match (&self.etcd_tls_cert, &self.etcd_tls_key) {
                    (Some(cert), Some(key)) => {
                        Some((read("--etcd-tls-cert", cert)?, read("--etcd-tls-key", key)?))
                    }
                    _ => None,
                },
            }),
        };
        if tls.is_some()
            && let Some(plain) = self.etcd_endpoints.iter().find(|e| e.starts_with("http://"))
        {
            return Err(unavailable(format!(
                "--etcd-tls-ca is given but {plain} is an http:// member: give https:// or host:port"
            )));
        }
        Ok(EtcdConfig {
            prefix,
            lease_ttl: Duration::from_secs(self.etcd_lease_ttl_s),
            max_txn_ops: self.etcd_max_txn_ops,
            tls,
            ..EtcdConfig::new(self.etcd_endpoints.clone(), owner_id)
        })
    }
}
