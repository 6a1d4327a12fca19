//! A run's conditions (SPEC §8) over the three real services: `Ready`,
//! `Progressing`, `Degraded` and `Stalled` say where the run stands and why,
//! including when a service it depends on is down.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use contract::pb;
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, watch_until},
    shapes::shape,
};

const PATIENCE: Duration = Duration::from_secs(60);

fn condition<'a>(s: &'a pb::RunStatus, kind: &str) -> &'a pb::Condition {
    s.conditions
        .iter()
        .find(|c| c.r#type == kind)
        .unwrap_or_else(|| panic!("no {kind} condition in {:?}", s.conditions))
}

fn is(s: &pb::RunStatus, kind: &str, status: bool, reason: &str) -> bool {
    s.conditions
        .iter()
        .any(|c| c.r#type == kind && c.status == status && c.reason == reason)
}

async fn apply(cluster: &Cluster, s: &contract::ClusterShape) {
    cluster.apply(s).await.unwrap();
}

async fn until(cluster: &Cluster, what: &str, done: impl FnMut(&pb::RunStatus) -> bool) -> pb::RunStatus {
    let mut c = cluster.client().await.unwrap();
    match watch_until(&mut c, "cond", PATIENCE, done).await {
        Ok(s) => s,
        Err(e) => {
            cluster.dump_logs();
            panic!("never {what}: {e}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dependency_down_degrades_the_run_until_it_is_back() {
    let mut cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    apply(&cluster, &shape("cond", 1, "fake", &[("workers", 3, "img:1")])).await;
    let s = until(&cluster, "converged", |s| s.converged).await;
    let ready = condition(&s, "Ready");
    assert!(ready.status && ready.reason == "Converged", "{ready:?}");
    assert!(ready.since_ms > 0 && ready.observed_generation == 1, "{ready:?}");
    assert!(is(&s, "Degraded", false, "AsExpected"), "{:?}", s.conditions);
    assert!(is(&s, "Progressing", false, "Converged"), "{:?}", s.conditions);
    assert!(is(&s, "Stalled", false, "AsExpected"), "{:?}", s.conditions);

    // The executor goes: the run is degraded (its nodes are still ready).
    cluster.executor.kill().await.unwrap();
    let s = until(&cluster, "degraded by the executor link", |s| {
        is(s, "Degraded", true, "ExecutorLinkDown")
    })
    .await;
    assert!(
        condition(&s, "Degraded")
            .message
            .contains("executor link is down")
    );
    cluster.executor.restart(cluster.dir.path()).await.unwrap();
    until(&cluster, "back from the executor", |s| {
        is(s, "Degraded", false, "AsExpected") && s.converged
    })
    .await;

    // The decider goes: a change cannot be decided, and the run says why.
    cluster.decider.kill().await.unwrap();
    apply(&cluster, &shape("cond", 2, "fake", &[("workers", 4, "img:1")])).await;
    let s = until(&cluster, "degraded by the decider", |s| {
        is(s, "Degraded", true, "DeciderUnreachable")
    })
    .await;
    assert!(!s.converged);
    assert!(is(&s, "Ready", false, "NotConverged"), "{:?}", s.conditions);
    // Explain says what the node waits on.
    let mut c = cluster.client().await.unwrap();
    let e = c
        .explain_node(pb::ExplainNodeRequest {
            run_id: "cond".into(),
            node_id: "workers-0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        e.executor_note.contains("the decider cannot be reached"),
        "{:?}",
        e.executor_note
    );
    cluster.decider.restart(cluster.dir.path()).await.unwrap();
    let s = until(&cluster, "converged at generation 2", |s| {
        s.converged && s.generation == 2
    })
    .await;
    assert!(is(&s, "Degraded", false, "AsExpected"), "{:?}", s.conditions);
    assert_eq!(condition(&s, "Ready").observed_generation, 2);
}

/// A run whose every unready node failed permanently is stalled, not
/// progressing; one that is merely on its way is progressing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_cannot_converge_is_stalled() {
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    apply(
        &cluster,
        &shape(
            "cond",
            1,
            "fake",
            &[("ctrl", 1, "img:1"), ("workers", 2, "invalid:1")],
        ),
    )
    .await;
    let s = until(&cluster, "stalled", |s| {
        is(s, "Stalled", true, "PermanentFailure")
    })
    .await;
    let stalled = condition(&s, "Stalled");
    assert!(
        stalled.message.contains("workers-0") && stalled.message.contains("workers-1"),
        "{stalled:?}"
    );
    assert!(stalled.message.contains("change the node spec"), "{stalled:?}");
    assert!(is(&s, "Progressing", false, "Stalled"), "{:?}", s.conditions);
    assert!(is(&s, "Degraded", true, "NodesFailed"), "{:?}", s.conditions);
    assert!(!s.converged);

    // Fixing the spec ends the stall.
    apply(
        &cluster,
        &shape(
            "cond",
            2,
            "fake",
            &[("ctrl", 1, "img:1"), ("workers", 2, "img:1")],
        ),
    )
    .await;
    let s = until(&cluster, "converged", |s| s.converged && s.generation == 2).await;
    assert!(is(&s, "Stalled", false, "AsExpected"), "{:?}", s.conditions);
    assert!(is(&s, "Ready", true, "Converged"), "{:?}", s.conditions);
}
