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
//! - `owners/<uid>`: the owner id of the replica that owns the run, attached to
//!   that replica's lease.
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
//! expires (or at once after [`EtcdStore::release`]).
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
//! Not built yet: leader election across replicas, failover (a replica taking
//! over another's runs and resubmitting their pending operations), request
//! forwarding between replicas, and a new epoch per takeover.

use std::{
    collections::{BTreeMap, HashMap},
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use contract::{LogicalNodeId, RunUid, secrets::Sealer};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, KeyValue, PutOptions, Txn, TxnOp,
    TxnOpResponse, TxnResponse,
};

use tokio::time::Instant;

use crate::core::{NodeRecord, RunDelta, RunStore, StoreError, StoredRun};
use crate::durable::{decode_meta, decode_node, encode_meta, encode_node};

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

/// A `RunStore` over etcd, with per-run ownership fenced by a lease.
pub struct EtcdStore {
    /// Runs the store's requests and the keep-alive task; `None` only in drop.
    rt: Option<tokio::runtime::Runtime>,
    client: Client,
    cfg: EtcdConfig,
    sealer: Sealer,
    lease: i64,
    health: Arc<LeaseHealth>,
    /// Runs this store has claimed, with the generation of their node records
    /// (`None`: no `gen` key yet).
    claimed: HashMap<RunUid, Option<u64>>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.cfg.endpoints)
            .field("prefix", &self.cfg.prefix)
            .field("owner_id", &self.cfg.owner_id)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        // Allowed in any context (a runtime dropped inside another panics).
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
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

async fn keep_alive(client: Client, lease: i64, health: Arc<LeaseHealth>) {
    let period = health.ttl / 3;
    let mut lc = client.lease_client();
    let sent = health.start.elapsed();
    let (mut keeper, mut stream) = match tokio::time::timeout(period, lc.keep_alive(lease)).await {
        Ok(Ok(pair)) => pair,
        Ok(Err(e)) => return health.fence(&format!("keep-alive: {e}")),
        Err(_) => return health.fence("keep-alive: etcd did not answer"),
    };
    health.renewed_ms.store(
        u64::try_from(sent.as_millis()).unwrap_or(u64::MAX),
        Ordering::SeqCst,
    );
    loop {
        tokio::time::sleep(period).await;
        if health.fenced.load(Ordering::SeqCst) {
            return;
        }
        let sent = health.start.elapsed();
        let answer = tokio::time::timeout(period, async {
            keeper.keep_alive().await?;
            stream.message().await
        })
        .await;
        match answer {
            Ok(Ok(Some(r))) if r.ttl() > 0 => health.renewed_ms.store(
                u64::try_from(sent.as_millis()).unwrap_or(u64::MAX),
                Ordering::SeqCst,
            ),
            Ok(Ok(Some(_))) => return health.fence("keep-alive: the lease is gone"),
            Ok(Ok(None)) => return health.fence("keep-alive: the stream ended"),
            Ok(Err(e)) => return health.fence(&format!("keep-alive: {e}")),
            Err(_) => return health.fence("keep-alive: etcd did not answer"),
        }
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
async fn get_prefix(client: &Client, prefix: Vec<u8>) -> Result<Vec<KeyValue>, StoreError> {
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
        let resp = kv.get(from.clone(), Some(opts)).await.map_err(etcd_err)?;
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
/// ownership key, the gen key and the run record, in that order.
enum Refused {
    Ownership(String),
    Generation(Option<u64>),
    UnknownRun,
}

impl EtcdStore {
    /// Connects, takes a lease and starts keeping it alive.
    pub fn open(cfg: EtcdConfig, sealer: Sealer) -> Result<Self, StoreError> {
        if cfg.endpoints.is_empty() {
            return Err(unavailable("no etcd endpoints"));
        }
        if cfg.owner_id.is_empty() {
            return Err(unavailable("an empty owner id"));
        }
        if cfg.max_txn_ops < 4 {
            return Err(unavailable("max_txn_ops below 4"));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("etcd-store")
            .enable_all()
            .build()
            .map_err(|e| unavailable(format!("starting the etcd store's runtime: {e}")))?;
        let endpoints = cfg.endpoints.clone();
        let ttl_secs = i64::try_from(cfg.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let connect_timeout = cfg.request_timeout;
        let start = Instant::now();
        let (client, lease, granted) = block_on(Some(&rt), cfg.request_timeout * 2, async move {
            let opts = ConnectOptions::new()
                .with_connect_timeout(connect_timeout)
                .with_timeout(connect_timeout);
            let mut client = Client::connect(endpoints, Some(opts)).await.map_err(etcd_err)?;
            let lease = client.lease_grant(ttl_secs, None).await.map_err(etcd_err)?;
            Ok((client, lease.id(), lease.ttl()))
        })?;
        let ttl = Duration::from_secs(u64::try_from(granted).unwrap_or(0).max(1));
        let health = Arc::new(LeaseHealth {
            fenced: AtomicBool::new(false),
            renewed_ms: AtomicU64::new(0),
            start,
            ttl,
        });
        rt.spawn(keep_alive(client.clone(), lease, health.clone()));
        tracing::info!(owner = %cfg.owner_id, lease, ttl_s = ttl.as_secs(), "etcd store open");
        Ok(Self {
            rt: Some(rt),
            client,
            cfg,
            sealer,
            lease,
            health,
            claimed: HashMap::new(),
        })
    }

    pub fn owner_id(&self) -> &str {
        &self.cfg.owner_id
    }

    pub fn lease_id(&self) -> i64 {
        self.lease
    }

    /// Whether this store has stopped writing (its lease is lost or released).
    pub fn is_fenced(&self) -> bool {
        !self.health.live()
    }

    /// Revokes the lease: every run this store owns is released at once, and
    /// the store writes no more.
    pub fn release(&mut self) -> Result<(), StoreError> {
        self.health.fence("released");
        self.claimed.clear();
        let mut client = self.client.clone();
        let lease = self.lease;
        block_on(self.rt.as_ref(), self.cfg.request_timeout, async move {
            client.lease_revoke(lease).await.map_err(etcd_err)?;
            Ok(())
        })
    }

    fn key(&self, rest: &str) -> String {
        format!("{}{rest}", self.cfg.prefix)
    }

    fn owner_key(&self, uid: RunUid) -> String {
        self.key(&format!("owners/{uid}"))
    }

    fn run_key(&self, uid: RunUid, rest: &str) -> String {
        self.key(&format!("runs/{uid}/{rest}"))
    }

    fn nodes_prefix(&self, uid: RunUid, generation: u64) -> String {
        self.run_key(uid, &format!("nodes/{generation}/"))
    }

    fn txn(&self, txn: Txn) -> Result<TxnResponse, StoreError> {
        let mut client = self.client.clone();
        block_on(self.rt.as_ref(), self.cfg.request_timeout, async move {
            client.txn(txn).await.map_err(etcd_err)
        })
    }

    fn check_live(&self) -> Result<(), StoreError> {
        if self.health.live() {
            Ok(())
        } else {
            Err(unavailable(format!(
                "replica {} has lost its etcd lease: it writes no more run state",
                self.cfg.owner_id
            )))
        }
    }

    fn lost(&mut self, uid: RunUid, owner: &str) -> StoreError {
        self.claimed.remove(&uid);
        let now = if owner.is_empty() { "nobody" } else { owner };
        unavailable(format!(
            "replica {} does not own run {uid} (its owner is {now}): the write was refused",
            self.cfg.owner_id
        ))
    }

    /// Claims `uid` for this replica unless already claimed; returns the
    /// generation of its node records.
    fn claim(&mut self, uid: RunUid) -> Result<Option<u64>, StoreError> {
        if let Some(g) = self.claimed.get(&uid) {
            return Ok(*g);
        }
        let owner = self.owner_key(uid);
        let gen_key = self.run_key(uid, "gen");
        let me = self.cfg.owner_id.clone();
        let lease = self.lease;
        let put = || {
            TxnOp::put(
                owner.clone(),
                me.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )
        };
        let resp = self.txn(
            Txn::new()
                .when([Compare::create_revision(owner.clone(), CompareOp::Equal, 0)])
                .and_then([put(), TxnOp::get(gen_key.clone(), None)])
                .or_else([TxnOp::get(owner.clone(), None), TxnOp::get(gen_key.clone(), None)]),
        )?;
        let generation = parse_gen(got(&resp, 1).as_ref())?;
        if !resp.succeeded() {
            let held = got(&resp, 0);
            let holder = held
                .as_ref()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
                .unwrap_or_default();
            let Some(held) = held.filter(|_| holder == me) else {
                return Err(self.lost(uid, &holder));
            };
            if held.lease() != self.lease {
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
                    return Err(self.lost(uid, "another replica"));
                }
            }
        }
        self.claimed.insert(uid, generation);
        Ok(generation)
    }

    /// The comparisons every write of `uid` makes: this replica owns the run
    /// and its node records are at `generation`.
    fn fence(&self, uid: RunUid, generation: Option<u64>) -> Vec<Compare> {
        let gen_key = self.run_key(uid, "gen");
        vec![
            Compare::value(self.owner_key(uid), CompareOp::Equal, self.cfg.owner_id.clone()),
            match generation {
                Some(g) => Compare::value(gen_key, CompareOp::Equal, g.to_string()),
                None => Compare::version(gen_key, CompareOp::Equal, 0),
            },
        ]
    }

    fn diagnose_ops(&self, uid: RunUid) -> Vec<TxnOp> {
        vec![
            TxnOp::get(self.owner_key(uid), None),
            TxnOp::get(self.run_key(uid, "gen"), None),
            TxnOp::get(
                self.run_key(uid, "meta"),
                Some(GetOptions::new().with_keys_only()),
            ),
        ]
    }

    fn diagnose(&self, resp: &TxnResponse, generation: Option<u64>) -> Result<Refused, StoreError> {
        let owner = got(resp, 0)
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
            .unwrap_or_default();
        if owner != self.cfg.owner_id {
            return Ok(Refused::Ownership(owner));
        }
        let found = parse_gen(got(resp, 1).as_ref())?;
        if found != generation {
            return Ok(Refused::Generation(found));
        }
        if got(resp, 2).is_none() {
            return Ok(Refused::UnknownRun);
        }
        Err(unavailable(
            "an etcd transaction failed its comparisons for no visible reason",
        ))
    }

    /// One write transaction under the fence; on refusal, the reason.
    fn fenced_txn(
        &mut self,
        uid: RunUid,
        generation: Option<u64>,
        extra: Vec<Compare>,
        ops: Vec<TxnOp>,
    ) -> Result<Result<(), Refused>, StoreError> {
        self.check_live()?;
        let mut when = self.fence(uid, generation);
        when.extend(extra);
        let resp = self.txn(
            Txn::new()
                .when(when)
                .and_then(ops)
                .or_else(self.diagnose_ops(uid)),
        )?;
        if resp.succeeded() {
            return Ok(Ok(()));
        }
        let why = self.diagnose(&resp, generation)?;
        match &why {
            Refused::Ownership(owner) => {
                let owner = owner.clone();
                return Err(self.lost(uid, &owner));
            }
            Refused::Generation(g) => {
                self.claimed.insert(uid, *g);
            }
            Refused::UnknownRun => {}
        }
        Ok(Err(why))
    }

    fn commit_once(&mut self, delta: &RunDelta) -> Result<Result<(), Refused>, StoreError> {
        let uid = delta.uid;
        let generation = self.claim(uid)?;
        if delta.drop_run {
            let ops = vec![
                TxnOp::delete(self.run_key(uid, ""), Some(DeleteOptions::new().with_prefix())),
                TxnOp::delete(self.owner_key(uid), None),
            ];
            let r = self.fenced_txn(uid, generation, Vec::new(), ops)?;
            if r.is_ok() {
                self.claimed.remove(&uid);
            }
            return Ok(r);
        }
        let meta = delta
            .meta
            .as_ref()
            .map(|m| encode_meta(&self.sealer, m))
            .transpose()?;
        let mut upserts = Vec::with_capacity(delta.upserts.len());
        for r in &delta.upserts {
            upserts.push((r.node.id.to_string(), encode_node(&self.sealer, r)?));
        }
        let removals: Vec<String> = delta.removals.iter().map(|id| id.to_string()).collect();
        let extra = if meta.is_none() {
            vec![Compare::version(self.run_key(uid, "meta"), CompareOp::Greater, 0)]
        } else {
            Vec::new()
        };
        let ops = upserts.len() + removals.len() + 2;
        let bytes: usize =
            upserts.iter().map(|(_, v)| v.len()).sum::<usize>() + meta.as_ref().map_or(0, Vec::len);
        if ops > self.cfg.max_txn_ops || bytes > MAX_TXN_BYTES {
            return self.rewrite(uid, generation, meta, upserts, removals, extra);
        }
        let g = generation.unwrap_or(0);
        let prefix = self.nodes_prefix(uid, g);
        let mut txn_ops = Vec::with_capacity(ops);
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
        let r = self.fenced_txn(uid, generation, extra, txn_ops)?;
        if r.is_ok() {
            self.claimed.insert(uid, Some(g));
        }
        Ok(r)
    }

    /// A delta too large for one transaction: the whole node set after it is
    /// written under the next generation, then one transaction switches to it.
    fn rewrite(
        &mut self,
        uid: RunUid,
        generation: Option<u64>,
        meta: Option<Vec<u8>>,
        upserts: Vec<(String, Vec<u8>)>,
        removals: Vec<String>,
        extra: Vec<Compare>,
    ) -> Result<Result<(), Refused>, StoreError> {
        let g = generation.unwrap_or(0);
        let next = g + 1;
        let old = self.nodes_prefix(uid, g);
        let staged = self.nodes_prefix(uid, next);
        // Clear what an earlier rewrite cut short left (and check the run is
        // known when the delta brings no record for it).
        let clear = vec![TxnOp::delete(
            staged.clone(),
            Some(DeleteOptions::new().with_prefix()),
        )];
        if let Err(why) = self.fenced_txn(uid, generation, extra.clone(), clear)? {
            return Ok(Err(why));
        }
        let client = self.client.clone();
        let current = block_on(
            self.rt.as_ref(),
            self.cfg.request_timeout,
            get_prefix_owned(client, old.clone().into_bytes()),
        )?;
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
        let per_txn = self.cfg.max_txn_ops;
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
                if let Err(why) = self.fenced_txn(uid, generation, Vec::new(), ops)? {
                    return Ok(Err(why));
                }
            }
        }
        let mut ops = vec![
            TxnOp::put(self.run_key(uid, "gen"), next.to_string(), None),
            TxnOp::delete(old, Some(DeleteOptions::new().with_prefix())),
        ];
        if let Some(m) = meta {
            ops.push(TxnOp::put(self.run_key(uid, "meta"), m, None));
        }
        let r = self.fenced_txn(uid, generation, extra, ops)?;
        if r.is_ok() {
            self.claimed.insert(uid, Some(next));
        }
        Ok(r)
    }
}

async fn get_prefix_owned(client: Client, prefix: Vec<u8>) -> Result<Vec<KeyValue>, StoreError> {
    get_prefix(&client, prefix).await
}

/// A run generation's node records: (node id, record).
type NodeValues<'a> = Vec<(String, &'a [u8])>;

impl RunStore for EtcdStore {
    fn commit(&mut self, delta: &RunDelta) -> Result<(), StoreError> {
        self.check_live()?;
        // A second attempt only after the node generation was found moved
        // (the cached one was stale).
        for _ in 0..2 {
            match self.commit_once(delta)? {
                Ok(()) => return Ok(()),
                Err(Refused::UnknownRun) => return Err(StoreError::UnknownRun(delta.uid)),
                Err(Refused::Ownership(owner)) => return Err(self.lost(delta.uid, &owner)),
                Err(Refused::Generation(_)) => {}
            }
        }
        Err(unavailable(format!(
            "run {}'s node generation kept moving under replica {}",
            delta.uid, self.cfg.owner_id
        )))
    }

    fn load_all(&self) -> Result<Vec<StoredRun>, StoreError> {
        let runs = self.key("runs/");
        let client = self.client.clone();
        let kvs = block_on(
            self.rt.as_ref(),
            self.cfg.request_timeout,
            get_prefix_owned(client, runs.clone().into_bytes()),
        )?;
        let mut metas: BTreeMap<String, &[u8]> = BTreeMap::new();
        let mut gens: BTreeMap<String, u64> = BTreeMap::new();
        let mut nodes: BTreeMap<(String, u64), NodeValues<'_>> = BTreeMap::new();
        for kv in &kvs {
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
        let mut out = Vec::with_capacity(metas.len());
        for (uid, bytes) in &metas {
            let meta = decode_meta(&self.sealer, bytes)?;
            if meta.uid.to_string() != *uid {
                return Err(corrupt(format!("run record under the wrong key {uid}")));
            }
            let g = gens.get(uid).copied().unwrap_or(0);
            let mut records: Vec<NodeRecord> = Vec::new();
            // Other generations are what a cut-short rewrite left: not part
            // of the run.
            for (id, v) in nodes.remove(&(uid.clone(), g)).unwrap_or_default() {
                let rec = decode_node(&self.sealer, v)?;
                if rec.node.id != LogicalNodeId::parse("node_id", &id).map_err(corrupt)? {
                    return Err(corrupt(format!("node record under the wrong key {id}")));
                }
                records.push(rec);
            }
            records.sort_by_key(|r| r.node.id.clone());
            out.push(StoredRun { meta, nodes: records });
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
        Ok(EtcdConfig {
            prefix,
            lease_ttl: Duration::from_secs(self.etcd_lease_ttl_s),
            max_txn_ops: self.etcd_max_txn_ops,
            ..EtcdConfig::new(self.etcd_endpoints.clone(), owner_id)
        })
    }
}
