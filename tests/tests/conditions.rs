//! A run's conditions (SPEC §8) over the three real services: `Ready`,
//! `Progressing`, `Degraded` and `Stalled` say where the run stands and why,
//! including when a service it depends on is down.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use contract::pb;
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, run_events, watch_until},
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

/// The run's event log.
async fn events(cluster: &Cluster) -> Vec<pb::Event> {
    let mut c = cluster.client().await.unwrap();
    run_events(&mut c, "cond").await.unwrap()
}

fn reasons(events: &[pb::Event]) -> Vec<&str> {
    events.iter().map(|e| e.reason.as_str()).collect()
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

    // The log tells the story, in order: created, converged, the executor
    // link lost and back, the decider lost (while generation 2 waited) and
    // back, converged again.
    let log = events(&cluster).await;
    let want = [
        "Applied",
        "Converged",
        "DependencyLost",
        "DependencyBack",
        "Applied",
        "DependencyLost",
        "DependencyBack",
        "Converged",
    ];
    let got = reasons(&log);
    let mut rest = got.iter();
    for w in want {
        assert!(rest.any(|r| *r == w), "{w} missing or out of order in {got:?}");
    }
    assert!(log.windows(2).all(|w| w[0].seq < w[1].seq), "{log:?}");
    let lost: Vec<&pb::Event> = log.iter().filter(|e| e.reason == "DependencyLost").collect();
    assert!(lost[0].message.contains("executor link"), "{:?}", lost[0]);
    assert!(lost[1].message.contains("decider"), "{:?}", lost[1]);
    assert!(lost.iter().all(|e| e.r#type == pb::EventType::Warning as i32));

    // A restarted driver keeps the log, the conditions' `since` and adds
    // only that it restored the run (no second "converged").
    let since = condition(&s, "Ready").since_ms;
    cluster.driver.restart(cluster.dir.path()).await.unwrap();
    let s = until(&cluster, "converged after the driver restarted", |s| s.converged).await;
    assert_eq!(condition(&s, "Ready").since_ms, since, "{:?}", s.conditions);
    let after = events(&cluster).await;
    assert_eq!(
        &after[..log.len()],
        &log[..],
        "the log changed across the restart"
    );
    assert_eq!(reasons(&after[log.len()..]), ["Restored"], "{after:?}");
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
    // Each permanent failure is logged once, naming its node and attempt,
    // and the stall once.
    let log = events(&cluster).await;
    for node in ["workers-0", "workers-1"] {
        let failed: Vec<&pb::Event> = log
            .iter()
            .filter(|e| e.reason == "NodeFailedPermanently" && e.node_id == node)
            .collect();
        assert_eq!(failed.len(), 1, "{log:?}");
        assert!(
            failed[0].attempt > 0 && failed[0].group_id == "workers",
            "{:?}",
            failed[0]
        );
    }
    let stalled: Vec<&pb::Event> = log.iter().filter(|e| e.reason == "Stalled").collect();
    assert_eq!(stalled.len(), 1, "{log:?}");
    assert!(
        stalled[0].message.starts_with("PermanentFailure"),
        "{:?}",
        stalled[0]
    );

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
