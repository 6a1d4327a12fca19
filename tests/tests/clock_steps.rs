//! The wall clock stepped under the real binaries, an hour forward and an
//! hour back, while operations are pending: libfaketime (from Debian's
//! `libfaketime`, preloaded into every service) moves their wall clock the
//! way an NTP step does and leaves their monotonic clock alone.
//!
//! Forward, pending operations may pass their deadlines and end ambiguous,
//! then are adopted; stages may time out and their attempts be replaced.
//! Back, no operation waits for the hour: results arrive as they do, and
//! nothing is held by a deadline now an hour away. Either way no storm of
//! passes, one resource per slot, and convergence.
//!
//! Without libfaketime the test fails, naming the package, rather than skip.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use contract::pb;
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, watch_until},
    shapes::shape,
};

/// The preload library, wherever the distribution puts it for this machine.
fn libfaketime() -> PathBuf {
    for dir in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib",
        "/usr/lib64",
    ] {
        let p = PathBuf::from(dir).join("faketime/libfaketime.so.1");
        if p.exists() {
            return p;
        }
    }
    panic!("libfaketime.so.1 not found: install Debian's libfaketime (.ci/needs --install)");
}

fn apply_req(run: &str, generation: u64, workers: u32) -> pb::ApplyRequest {
    pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            run,
            generation,
            "fake",
            &[("workers", workers, "img:1")],
        ))),
    }
}

async fn status(
    c: &mut pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>,
) -> pb::RunStatus {
    c.get_run(pb::GetRunRequest {
        run_id: "stepped".to_owned(),
        include_nodes: false,
    })
    .await
    .unwrap()
    .into_inner()
}

/// Steps the clock to `offset_to` with operations pending, waits for the
/// run to converge at `generation` with `nodes` ready, checks that nothing
/// stormed, doubled or was replaced, and returns the passes it took.
async fn step_and_settle(
    c: &mut pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>,
    cluster: &Cluster,
    offset: &std::path::Path,
    offset_to: &str,
    generation: u64,
    nodes: usize,
    way: &str,
) -> u64 {
    let before = status(c).await;
    std::fs::write(offset, format!("{offset_to}\n")).unwrap();
    let done = match watch_until(c, "stepped", Duration::from_secs(90), |s| {
        s.converged && s.generation == generation
    })
    .await
    {
        Ok(s) => s,
        Err(e) => {
            let s = c
                .get_run(pb::GetRunRequest {
                    run_id: "stepped".to_owned(),
                    include_nodes: true,
                })
                .await
                .unwrap()
                .into_inner();
            for n in &s.nodes {
                eprintln!("{:?} last={:?}", n.state, n.last_decision);
            }
            panic!("not converged after the step {way}: {e}");
        }
    };
    assert_eq!(done.ready_count as usize, nodes);
    let passes = done.passes - before.passes;
    assert!(
        passes < 200,
        "{passes} passes to converge after the step {way}: a storm"
    );
    let slots = per_slot(cluster).await;
    assert_eq!(slots.len(), nodes, "{slots:?}");
    assert!(
        slots.values().all(|&n| n == 1),
        "a slot holds two resources: {slots:?}"
    );
    // The deadlines moved with the step: no stage timed out, no slot was
    // replaced (attempts are numbered in order, one per slot so far).
    assert_eq!(
        max_attempt(c).await,
        nodes as u64,
        "slots were replaced after the step {way}"
    );
    passes
}

/// The highest attempt among the run's nodes.
async fn max_attempt(c: &mut pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>) -> u64 {
    c.get_run(pb::GetRunRequest {
        run_id: "stepped".to_owned(),
        include_nodes: true,
    })
    .await
    .unwrap()
    .into_inner()
    .nodes
    .iter()
    .filter_map(|n| n.state.as_ref().map(|s| s.attempt))
    .max()
    .unwrap_or(0)
}

/// Waits until the run has operations pending.
async fn until_pending(c: &mut pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while status(c).await.pending_operations == 0 {
        assert!(tokio::time::Instant::now() < deadline, "nothing was dispatched");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Resources per slot in the executor's inventory.
async fn per_slot(cluster: &Cluster) -> BTreeMap<String, usize> {
    let mut slots = BTreeMap::new();
    let inventory = cluster
        .executor_client()
        .await
        .unwrap()
        .inventory(pb::InventoryRequest::default())
        .await
        .unwrap()
        .into_inner();
    for r in inventory.resources {
        *slots.entry(r.node_id).or_insert(0) += 1;
    }
    slots
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hour_forward_and_an_hour_back_under_pending_operations() {
    let time_dir = tempfile::tempdir().unwrap();
    let offset = time_dir.path().join("offset");
    std::fs::write(&offset, "+0\n").unwrap();
    let preload = libfaketime().display().to_string();
    let opts = ClusterOptions::default()
        .env("LD_PRELOAD", &preload)
        .env("FAKETIME_TIMESTAMP_FILE", &offset.display().to_string())
        // The wall clock only, as an NTP step moves it; read every second.
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        .env("FAKETIME_CACHE_DURATION", "1")
        .executor("--fake-latency-ms", "200,600")
        .executor("--fake-stage-interval-ms", "300")
        .driver("--operation-timeout-ms", "20000");
    let cluster = Cluster::start(opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    c.apply(apply_req("stepped", 1, 16)).await.unwrap();
    until_pending(&mut c).await;

    // An hour forward, with operations pending.
    let passes_forward = step_and_settle(&mut c, &cluster, &offset, "+1h", 1, 16, "forward").await;

    // An hour back (to the true time), with operations pending again: the
    // scale-up converges in seconds, not after the hour its deadlines now
    // seem to be away.
    c.apply(apply_req("stepped", 2, 24)).await.unwrap();
    until_pending(&mut c).await;
    let passes_back = step_and_settle(&mut c, &cluster, &offset, "+0", 2, 24, "back").await;
    eprintln!(
        "clock steps: {passes_forward} passes after the step forward, {passes_back} after the step back"
    );
}
