//! Operator abandon and the orphan report, with the three real binaries: an
//! abandoned node is forgotten (its slot re-provisioned under a fresh
//! attempt) and listed with what it left behind, and the orphan sweep finds
//! its still-live resource in the executor's inventory.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use contract::pb::{self, provisioning_client::ProvisioningClient};
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, watch_until},
    shapes::shape,
};
use tonic::{Code, transport::Channel};

const CONVERGE: Duration = Duration::from_secs(60);
const RUN: &str = "orph";

async fn node_state(c: &mut ProvisioningClient<Channel>, node: &str) -> Option<pb::NodeState> {
    let s = c
        .get_run(pb::GetRunRequest {
            run_id: RUN.into(),
            include_nodes: true,
        })
        .await
        .unwrap()
        .into_inner();
    s.nodes
        .into_iter()
        .filter_map(|n| n.state)
        .find(|n| n.node_id == node)
}

async fn orphans(c: &mut ProvisioningClient<Channel>) -> Vec<pb::Orphan> {
    c.list_orphans(pb::ListOrphansRequest {})
        .await
        .unwrap()
        .into_inner()
        .orphans
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_node_is_listed_reprovisioned_and_found_by_the_sweep() {
    let cluster = Cluster::start(
        ClusterOptions::default()
            .driver("--orphan-sweep-ms", "300")
            .service_env("driver-svc", "PROVISIONING_METRICS_LISTEN", "127.0.0.1:0"),
    )
    .await
    .unwrap();
    let mut c = cluster.client().await.unwrap();
    let s = shape(RUN, 1, "fake", &[("workers", 3, "img:1")]);
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await
    .unwrap();
    let run = match watch_until(&mut c, RUN, CONVERGE, |s| s.converged && s.generation == 1).await {
        Ok(s) => s,
        Err(e) => {
            cluster.dump_logs();
            panic!("{e}");
        }
    };
    assert!(orphans(&mut c).await.is_empty(), "a converged run has no orphans");

    // Let a few sweeps run over the converged run: nothing of it is an orphan.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        orphans(&mut c).await.is_empty(),
        "the sweep reported a current attempt: {:?}",
        orphans(&mut c).await
    );

    // Bad requests.
    let err = c
        .abandon_node(pb::AbandonNodeRequest {
            run_id: RUN.into(),
            node_id: "not a node".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let err = c
        .abandon_node(pb::AbandonNodeRequest {
            run_id: RUN.into(),
            node_id: "workers-9".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");
    let err = c
        .abandon_node(pb::AbandonNodeRequest {
            run_id: "nope".into(),
            node_id: "workers-1".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err}");

    // Abandon a live node.
    let before = node_state(&mut c, "workers-1").await.unwrap();
    let lease = before.facts.as_ref().unwrap().lease_id.clone();
    assert!(!lease.is_empty(), "a converged node holds a lease");
    let orphan = c
        .abandon_node(pb::AbandonNodeRequest {
            run_id: RUN.into(),
            node_id: "workers-1".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .orphan
        .unwrap();
    let r = orphan.resource.clone().unwrap();
    assert_eq!(r.run_uid, run.run_uid);
    assert_eq!(r.run_id, RUN);
    assert_eq!(r.node_id, "workers-1");
    assert_eq!(r.attempt, before.attempt);
    assert_eq!(r.lease_id, lease);
    assert!(orphan.reason.contains("abandoned"), "{}", orphan.reason);
    assert!(orphan.recorded_at_ms > 0);

    let listed = orphans(&mut c).await;
    assert!(
        listed.iter().any(|o| o == &orphan),
        "ListOrphans lists the abandoned node: {listed:?}"
    );

    // The slot comes back under a fresh attempt, and the run converges again.
    let deadline = Instant::now() + CONVERGE;
    loop {
        if let Some(n) = node_state(&mut c, "workers-1").await
            && n.attempt != before.attempt
            && n.stage == pb::NodeStage::Dormant as i32
        {
            assert!(n.attempt > before.attempt);
            break;
        }
        if Instant::now() > deadline {
            cluster.dump_logs();
            panic!("workers-1 was not re-provisioned");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The abandoned attempt's lease is still live at the executor, and the
    // sweep (two consecutive sightings) reports it from the inventory.
    let inventory = cluster.inventory().await.unwrap();
    assert!(
        inventory
            .iter()
            .any(|x| x.node_id == "workers-1" && x.attempt == before.attempt),
        "the abandoned attempt's resource is still live: {inventory:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let swept = loop {
        let listed = orphans(&mut c).await;
        if let Some(o) = listed.iter().find(|o| o.reason.contains("sweep")) {
            break o.clone();
        }
        if Instant::now() > deadline {
            cluster.dump_logs();
            panic!("the sweep never reported the abandoned node's resource: {listed:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let sr = swept.resource.unwrap();
    assert_eq!(sr.run_uid, run.run_uid);
    assert_eq!(sr.node_id, "workers-1");
    assert_eq!(sr.attempt, before.attempt);
    assert_eq!(sr.lease_id, lease);

    // Nothing else is an orphan: the re-provisioned attempt and the other
    // nodes are current.
    let listed = orphans(&mut c).await;
    assert_eq!(listed.len(), 2, "{listed:?}");
    let m = cluster.driver.scrape().await.unwrap();
    let lines: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("provisioning_orphan"))
        .collect();
    assert!(
        lines.contains(&"provisioning_orphans{source=\"sweep\"} 1")
            && lines.contains(&"provisioning_orphans{source=\"abandoned\"} 1"),
        "{lines:?}"
    );
}
