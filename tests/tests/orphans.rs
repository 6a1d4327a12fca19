//! Operator abandon, the orphan report and the orphan sweep, with the three
//! real binaries: an abandoned node is forgotten (its slot re-provisioned
//! under a fresh attempt) and listed with what it left behind; the sweep finds
//! its still-live resource in the executor's inventory, and destroys it
//! through the run's deletion path once its slot is free. A driver that lost
//! its store has the resources of its runs destroyed by a reclaim run, which
//! survives a crash; with `--orphan-policy report` orphans are only listed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use contract::pb::{self, provisioning_client::ProvisioningClient};
use provisioning_tests::{
    procs::{AgentsDir, Cluster, ClusterOptions, eventually, live_agent_pids, sample, watch_until},
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

/// How many orphan sweeps the driver has finished.
async fn sweeps(cluster: &Cluster) -> f64 {
    let exposition = cluster.driver.scrape().await.unwrap();
    sample(&exposition, "provisioning_orphan_sweeps_total{result=\"ok\"}").unwrap_or(0.0)
}

/// Returns once `n` more sweeps have run (so a check after it sees what
/// those sweeps did, rather than hoping a fixed wait was long enough).
async fn after_more_sweeps(cluster: &Cluster, n: f64) {
    let from = sweeps(cluster).await;
    eventually(CONVERGE, "the orphan sweep runs", || async {
        (sweeps(cluster).await >= from + n).then_some(())
    })
    .await
    .unwrap();
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

    // A few sweeps run over the converged run: nothing of it is an orphan.
    after_more_sweeps(&cluster, 3.0).await;
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
    let swept = eventually(
        Duration::from_secs(20),
        "the sweep reports the abandoned node's resource",
        || {
            let mut c = c.clone();
            async move {
                let listed = orphans(&mut c).await;
                listed.into_iter().find(|o| o.reason.contains("sweep"))
            }
        },
    )
    .await;
    let swept = match swept {
        Ok(o) => o,
        Err(e) => {
            cluster.dump_logs();
            panic!("{e}: {:?}", orphans(&mut c).await);
        }
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
    for source in ["sweep", "abandoned"] {
        let series = format!("provisioning_orphans{{source=\"{source}\"}}");
        assert_eq!(provisioning_tests::procs::sample(&m, &series), Some(1.0), "{m}");
    }
    assert!(
        swept.reason.contains("holds node workers-1 at attempt"),
        "an older attempt of a held slot waits for the slot: {}",
        swept.reason
    );

    // Scale down past workers-1: its current attempt goes the normal way,
    // the slot is free, and the sweep hands the abandoned attempt to the
    // run's deletion path; it is destroyed and leaves the report.
    let s2 = shape(RUN, 2, "fake", &[("workers", 1, "img:1")]);
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s2)),
    })
    .await
    .unwrap();
    let deadline = Instant::now() + CONVERGE;
    loop {
        let inventory = cluster.inventory().await.unwrap();
        let listed = orphans(&mut c).await;
        let left: Vec<_> = inventory.iter().filter(|x| x.node_id != "workers-0").collect();
        if left.is_empty()
            && listed
                .iter()
                .all(|o| o.reason.contains("abandoned by an operator"))
        {
            break;
        }
        if Instant::now() > deadline {
            cluster.dump_logs();
            panic!("the abandoned attempt was not destroyed: inventory {inventory:?}, orphans {listed:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    watch_until(&mut c, RUN, CONVERGE, |s| s.converged && s.generation == 2)
        .await
        .unwrap();
    let m = cluster.driver.scrape().await.unwrap();
    assert!(
        provisioning_tests::procs::sample(&m, "provisioning_orphans_destroyed_total") == Some(1.0),
        "{}",
        m.lines()
            .filter(|l| l.starts_with("provisioning_orphan"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

async fn apply_and_converge(cluster: &Cluster, c: &mut ProvisioningClient<Channel>, provider: &str, n: u32) {
    let s = shape(RUN, 1, provider, &[("workers", n, "img:1")]);
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await
    .unwrap();
    if let Err(e) = watch_until(c, RUN, CONVERGE, |s| s.converged && s.generation == 1).await {
        cluster.dump_logs();
        panic!("{e}");
    }
}

/// Kills the driver and removes its data directory: it comes back knowing
/// nothing of the runs whose resources still live.
async fn lose_the_store(cluster: &mut Cluster) {
    cluster.driver.kill().await.unwrap();
    std::fs::remove_dir_all(cluster.dir.path().join("driver-data")).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_that_lost_its_store_has_the_leftovers_destroyed_by_a_reclaim_run_that_survives_a_crash() {
    let agents = AgentsDir::new().unwrap();
    let mut cluster = Cluster::start(
        ClusterOptions::default()
            .executor("--backend", "process")
            .executor("--process-state-dir", &agents.root.display().to_string())
            .executor("--process-kill-grace-ms", "300")
            .driver("--orphan-sweep-ms", "200"),
    )
    .await
    .unwrap();
    let mut c = cluster.client().await.unwrap();
    apply_and_converge(&cluster, &mut c, "process", 3).await;
    assert_eq!(live_agent_pids(&agents.root).len(), 3);
    let uid = c
        .get_run(pb::GetRunRequest {
            run_id: RUN.into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner()
        .run_uid;

    // The new driver dies once its reclaim run recorded the cleanup of the
    // leftovers, before dispatching any of it.
    lose_the_store(&mut cluster).await;
    cluster.driver.set_flag("--crash-at", Some("deleting-recorded"));
    cluster.driver.restart(cluster.dir.path()).await.unwrap();
    let exit = cluster.driver.wait_exit(Duration::from_secs(30)).await.unwrap();
    if exit.is_none() {
        cluster.dump_logs();
        panic!("the sweep never recorded a reclaim run");
    }
    assert_eq!(live_agent_pids(&agents.root).len(), 3, "nothing was dispatched");

    // The next driver restores the reclaim run from its store and lists what
    // it holds as being destroyed; it is not a run of anyone's.
    cluster.driver.set_flag("--crash-at", None);
    cluster.driver.restart(cluster.dir.path()).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    let listed = orphans(&mut c).await;
    assert_eq!(listed.len(), 3, "{listed:?}");
    for o in &listed {
        assert!(o.reason.contains("being destroyed"), "{}", o.reason);
        assert_eq!(o.resource.as_ref().unwrap().run_uid, uid);
    }
    let runs = c
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(runs.runs.is_empty(), "a reclaim run is not a run: {runs:?}");

    // Everything is destroyed through the deletion path, and the report empties.
    let deadline = Instant::now() + CONVERGE;
    loop {
        let inventory = cluster.inventory().await.unwrap();
        let live = live_agent_pids(&agents.root);
        let listed = orphans(&mut c).await;
        if inventory.is_empty() && live.is_empty() && listed.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            cluster.dump_logs();
            panic!("leftovers remain: inventory {inventory:?}, agents {live:?}, orphans {listed:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = std::fs::read_to_string(cluster.driver.log_file()).unwrap();
    assert!(
        log.contains("reclaim run recorded"),
        "the reclaim went through a stored run"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_report_policy_orphans_are_listed_and_left_alone() {
    let mut cluster = Cluster::start(
        ClusterOptions::default()
            .driver("--orphan-sweep-ms", "150")
            .driver("--orphan-policy", "report")
            .service_env("driver-svc", "PROVISIONING_METRICS_LISTEN", "127.0.0.1:0"),
    )
    .await
    .unwrap();
    let mut c = cluster.client().await.unwrap();
    apply_and_converge(&cluster, &mut c, "fake", 2).await;
    lose_the_store(&mut cluster).await;
    cluster.driver.restart(cluster.dir.path()).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let listed = orphans(&mut c).await;
        if listed.len() == 2 {
            assert!(
                listed.iter().all(|o| o.reason.contains("holds no run with uid")),
                "{listed:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the sweep did not report the leftovers: {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Several more sweeps: still listed, still live, nothing destroyed.
    after_more_sweeps(&cluster, 3.0).await;
    assert_eq!(cluster.inventory().await.unwrap().len(), 2);
    assert_eq!(orphans(&mut c).await.len(), 2);
}
