//! A store write that fails inside a pass: the driver, in this process on a
//! store that refuses one chosen write, against the real decider and
//! executor processes.
//!
//! The pass's decisions are applied in memory when its write fails, and the
//! operations it recorded are not dispatched, so the run is ahead of its
//! store. It must be halted and reloaded from the store, as after any failed
//! commit, and go on from there. (An etcd member dying under a pass's write
//! once left such a run waiting out its operations' deadline: the pending
//! operations were stored by the next write and never sent.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    time::Duration,
};

use contract::pb::{self, provisioning_client::ProvisioningClient};
use driver_svc::{
    auth::Authenticator,
    core::{MemStore, Policy, RunDelta, RunStore, StoreError, StoredRun},
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
    fn commit(&mut self, delta: &RunDelta) -> Result<(), StoreError> {
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
            executor: cluster.executor.url(),
            decider_identity: "decider-svc".to_owned(),
            executor_identity: "executor-svc".to_owned(),
            policy: Policy {
                operation_timeout: OPERATION_TIMEOUT,
                ..Policy::default()
            },
            safety_tick: OPERATION_TIMEOUT,
            store: Box::new(store),
            clock: Arc::new(contract::SystemClock),
            orphan_sweep: Duration::ZERO,
            orphan_destroy: false,
            transport: contract::tls::Transport::Insecure,
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
    let mut client = ProvisioningClient::new(channel);
    let apply = |generation: u64, count: u32| pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            RUN,
            generation,
            "fake",
            &[("w", count, "img:1")],
        ))),
    };
    client.apply(apply(1, 2)).await.unwrap();
    let mut watched = client
        .watch_run(pb::WatchRunRequest {
            run_id: RUN.into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    let converged = read_watch(&mut watched, |s| s.converged).await;
    assert_eq!(converged.ready_count, 2);
    assert_eq!(seen.refused.load(Ordering::SeqCst), 0);

    // The scale-up's first operations are recorded by a pass; that write
    // is refused.
    seen.armed.store(true, Ordering::SeqCst);
    client.apply(apply(2, 4)).await.unwrap();
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
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), driver)
        .await
        .expect("the driver stops")
        .unwrap()
        .unwrap();
}
