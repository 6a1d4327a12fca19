//! The driver's writes under a store that misbehaves: the driver runs in this
//! process on a store double wrapping a real store, against the real decider
//! and executor processes.
//!
//! A store write that fails inside a pass:
//! The pass's decisions are applied in memory when its write fails, and the
//! operations it recorded are not dispatched, so the run is ahead of its
//! store. It must be halted and reloaded from the store, as after any failed
//! commit, and go on from there. (An etcd member dying under a pass's write
//! once left such a run waiting out its operations' deadline: the pending
//! operations were stored by the next write and never sent.)
//!
//! A store write that is slow: each run persists its own commits, so a run
//! whose commit stalls holds back only its own operations, never another
//! run's passes (commits were once made under one lock every run shared).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use contract::pb::{self, provisioning_client::ProvisioningClient};
use driver_svc::{
    auth::Authenticator,
    core::{MemStore, Policy, RunDelta, RunStore, StoreError, StoredRun},
    durable::RedbStore,
    limits::ApiLimits,
    server::{Config, run},
};
use provisioning_tests::{
    procs::{self, Cluster, ClusterOptions},
    shapes::shape,
};

const RUN: &str = "flaky";

/// Longer than the test waits: a run that only an operation's deadline would
/// move again does not converge within it.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(600);
const CONVERGE: Duration = Duration::from_secs(60);

/// What the test sees of the store.
#[derive(Debug, Default)]
struct Seen {
    /// Refuse the next write that records an operation.
    armed: AtomicBool,
    refused: AtomicU32,
    /// The epoch of every run record written, in order.
    epochs: Mutex<Vec<u64>>,
}

/// A memory store that refuses one chosen write (a test double).
#[derive(Debug)]
struct FlakyStore {
    inner: MemStore,
    seen: Arc<Seen>,
}

impl RunStore for FlakyStore {
    fn commit(&self, delta: &RunDelta) -> Result<(), StoreError> {
        let records_an_operation = delta.upserts.iter().any(|r| r.inflight.is_some());
        if records_an_operation && self.seen.armed.swap(false, Ordering::SeqCst) {
            self.seen.refused.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Unavailable("refused by the test".into()));
        }
        self.inner.commit(delta)?;
        if let Some(meta) = &delta.meta {
            self.seen.epochs.lock().unwrap().push(meta.epoch.get());
        }
        Ok(())
    }

    fn load_all(&self) -> Result<Vec<StoredRun>, StoreError> {
        self.inner.load_all()
    }
}

/// A driver in this process on `store`, against the cluster's decider and
/// executor: its client, the sender that stops it, and its task.
async fn start_driver(
    cluster: &Cluster,
    store: Box<dyn RunStore>,
) -> (
    ProvisioningClient<tonic::transport::Channel>,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), driver_svc::server::ServerError>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let driver = tokio::spawn(run(
        listener,
        async move {
            let _ = stopped.await;
        },
        Config {
            decider: cluster.decider.url(),
            decider_resolve_interval: Duration::ZERO,
            executor: cluster.executor.url(),
            decider_identity: "decider-svc".to_owned(),
            executor_identity: "executor-svc".to_owned(),
            policy: Policy {
                operation_timeout: OPERATION_TIMEOUT,
                ..Policy::default()
            },
            safety_tick: OPERATION_TIMEOUT,
            max_operations_in_flight: None,
            store,
            clock: Arc::new(contract::SystemClock),
            orphan_sweep: Duration::ZERO,
            orphan_destroy: false,
            transport: platform::tls::Transport::Insecure,
            auth: Authenticator::open(),
            limits: ApiLimits::default(),
            replicas: None,
            advertise: None,
        },
    ));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    (ProvisioningClient::new(channel), stop, driver)
}

fn apply(run_id: &str, generation: u64, count: u32) -> pb::ApplyRequest {
    pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            run_id,
            generation,
            "fake",
            &[("w", count, "img:1")],
        ))),
    }
}

async fn watch(
    client: &mut ProvisioningClient<tonic::transport::Channel>,
    run_id: &str,
) -> tonic::Streaming<pb::RunStatus> {
    client
        .watch_run(pb::WatchRunRequest {
            run_id: run_id.into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner()
}

/// The run converges without waiting out an operation's deadline.
async fn read_watch(
    watched: &mut tonic::Streaming<pb::RunStatus>,
    done: impl Fn(&pb::RunStatus) -> bool,
) -> pb::RunStatus {
    procs::read_watch(watched, CONVERGE, done).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_whose_write_fails_is_reloaded_and_goes_on() {
    // The decider and the executor as processes; their driver is not used.
    let cluster = Cluster::start(ClusterOptions::default().insecure().driver("--store", "memory"))
        .await
        .unwrap();
    let seen = Arc::new(Seen::default());
    let store = FlakyStore {
        inner: MemStore::new(),
        seen: seen.clone(),
    };
    let (mut client, stop, driver) = start_driver(&cluster, Box::new(store)).await;
    client.apply(apply(RUN, 1, 2)).await.unwrap();
    let mut watched = watch(&mut client, RUN).await;
    let converged = read_watch(&mut watched, |s| s.converged).await;
    assert_eq!(converged.ready_count, 2);
    assert_eq!(seen.refused.load(Ordering::SeqCst), 0);

    // The scale-up's first operations are recorded by a pass; that write
    // is refused.
    seen.armed.store(true, Ordering::SeqCst);
    client.apply(apply(RUN, 2, 4)).await.unwrap();
    let scaled = read_watch(&mut watched, |s| s.converged && s.generation == 2).await;
    assert_eq!(scaled.ready_count, 4);
    assert_eq!(
        seen.refused.load(Ordering::SeqCst),
        1,
        "one pass's write was refused"
    );
    let epochs = seen.epochs.lock().unwrap().clone();
    assert_eq!(epochs.first(), Some(&1), "{epochs:?}");
    assert_eq!(
        epochs.last(),
        Some(&2),
        "the run was reloaded from the store under a new epoch: {epochs:?}"
    );

    // A graceful stop waits for open calls: the watch goes first.
    drop(watched);
    drop(client);
    stop_driver(stop, driver).await;
}

async fn stop_driver(
    stop: tokio::sync::oneshot::Sender<()>,
    driver: tokio::task::JoinHandle<Result<(), driver_svc::server::ServerError>>,
) {
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), driver)
        .await
        .expect("the driver stops")
        .unwrap()
        .unwrap();
}

/// How long a stalled commit waits to be released before it goes on by
/// itself (so a driver that serialises commits is seen to, rather than hang).
const STALL_AT_MOST: Duration = Duration::from_secs(30);

/// A durable store whose first operation-recording commit of one chosen run
/// waits until the test releases it (a test double around the real store).
#[derive(Debug)]
struct StallingStore {
    inner: RedbStore,
    stall: Arc<Stall>,
}

#[derive(Debug, Default)]
struct Stall {
    /// The run id to stall, and once its run is created, its uid.
    run_id: Mutex<Option<(String, Option<contract::RunUid>)>>,
    armed: AtomicBool,
    /// A commit is waiting now.
    stalled: AtomicBool,
    /// The operations the stalled commit records.
    stalled_ops: AtomicUsize,
    released: Mutex<bool>,
    release: Condvar,
}

impl Stall {
    fn wait_for_release(&self) {
        let until = Instant::now() + STALL_AT_MOST;
        let mut released = self.released.lock().unwrap();
        while !*released {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            released = self.release.wait_timeout(released, left).unwrap().0;
        }
    }

    fn open(&self) {
        *self.released.lock().unwrap() = true;
        self.release.notify_all();
    }
}

impl RunStore for StallingStore {
    fn commit(&self, delta: &RunDelta) -> Result<(), StoreError> {
        let chosen = {
            let mut chosen = self.stall.run_id.lock().unwrap();
            match (chosen.as_mut(), &delta.meta) {
                (Some((id, uid @ None)), Some(m)) if m.run_id.as_str() == id => *uid = Some(delta.uid),
                _ => {}
            }
            chosen.as_ref().and_then(|(_, uid)| *uid) == Some(delta.uid)
        };
        let ops = delta.upserts.iter().filter(|r| r.inflight.is_some()).count();
        if chosen && ops > 0 && self.stall.armed.swap(false, Ordering::SeqCst) {
            self.stall.stalled_ops.store(ops, Ordering::SeqCst);
            self.stall.stalled.store(true, Ordering::SeqCst);
            self.stall.wait_for_release();
            self.stall.stalled.store(false, Ordering::SeqCst);
        }
        self.inner.commit(delta)
    }

    fn load_all(&self) -> Result<Vec<StoredRun>, StoreError> {
        self.inner.load_all()
    }
}

async fn leases_of(cluster: &Cluster, run_id: &str) -> usize {
    let inventory = cluster.inventory().await.unwrap();
    inventory
        .iter()
        .filter(|r| r.run_id == run_id && !r.lease_id.is_empty())
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_runs_slow_commit_holds_back_only_its_own_operations() {
    let cluster = Cluster::start(ClusterOptions::default().insecure().driver("--store", "memory"))
        .await
        .unwrap();
    let data = tempfile::tempdir().unwrap();
    let stall = Arc::new(Stall::default());
    *stall.run_id.lock().unwrap() = Some(("slow".to_owned(), None));
    let store = StallingStore {
        inner: RedbStore::open(data.path()).unwrap(),
        stall: stall.clone(),
    };
    let (mut client, stop, driver) = start_driver(&cluster, Box::new(store)).await;

    client.apply(apply("slow", 1, 1)).await.unwrap();
    let mut slow = watch(&mut client, "slow").await;
    let _ = read_watch(&mut slow, |s| s.converged).await;
    assert_eq!(leases_of(&cluster, "slow").await, 1);

    // The scale-up's pass records two creates; its commit stalls.
    stall.armed.store(true, Ordering::SeqCst);
    client.apply(apply("slow", 2, 3)).await.unwrap();
    procs::eventually(CONVERGE, "the scale-up's commit comes", || async {
        stall.stalled.load(Ordering::SeqCst).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(stall.stalled_ops.load(Ordering::SeqCst), 2);

    // Another run is created, decided, committed and converged meanwhile.
    client.apply(apply("fast", 1, 3)).await.unwrap();
    let mut fast = watch(&mut client, "fast").await;
    let converged = read_watch(&mut fast, |s| s.converged).await;
    assert_eq!(converged.ready_count, 3);
    assert!(
        stall.stalled.load(Ordering::SeqCst),
        "the other run converged only once the stalled commit went on: commits are serialised"
    );
    // Recorded, not yet durable: not dispatched.
    assert_eq!(
        leases_of(&cluster, "slow").await,
        1,
        "the stalled run's operations were dispatched before their commit was durable"
    );

    stall.open();
    let scaled = read_watch(&mut slow, |s| s.converged && s.generation == 2).await;
    assert_eq!(scaled.ready_count, 3);
    assert_eq!(leases_of(&cluster, "slow").await, 3);

    drop((slow, fast, client));
    stop_driver(stop, driver).await;
}
