//! Rollouts within budgets (SPEC.md section 9), through the three services
//! with the process backend: every node is a real agent process, so "ready"
//! and "live" are counted from the driver's status and the OS process table
//! while a template change rolls out.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{path::Path, sync::Arc, time::Duration};

use contract::{Budget, ClusterShape, Param, RolloutPolicy, pb};
use provisioning_tests::{
    procs::{AgentsDir, Cluster, ClusterOptions, eventually, live_agent_pids, run_events, watch_until},
    shapes::shape,
};
use tokio::sync::watch;

const CONVERGE: Duration = Duration::from_secs(120);
const RUN: &str = "rolls";

type Client = pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>;

fn process_cluster(agents: &Path) -> ClusterOptions {
    ClusterOptions::default()
        .executor("--backend", "process")
        .executor("--process-state-dir", &agents.display().to_string())
        .executor("--process-kill-grace-ms", "500")
}

/// One group `workers` of `count` on `image`, with `policy` and the
/// template's boot parameters `boot`.
fn workers(
    generation: u64,
    count: u32,
    image: &str,
    policy: RolloutPolicy,
    boot: &[(&str, &str)],
) -> ClusterShape {
    let mut s = shape(RUN, generation, "process", &[("workers", count, image)]);
    let g = &mut s.groups[0];
    g.policy.rollout = policy;
    let t = Arc::make_mut(&mut g.template);
    for (k, v) in boot {
        t.boot.insert(
            (*k).to_owned(),
            Param {
                value: (*v).to_owned(),
                secret: false,
            },
        );
    }
    s
}

async fn converged(cluster: &Cluster, c: &mut Client, generation: u64) -> pb::RunStatus {
    match watch_until(c, RUN, CONVERGE, |s| s.converged && s.generation == generation).await {
        Ok(s) => s,
        Err(e) => {
            cluster.dump_logs();
            panic!("{e}");
        }
    }
}

async fn status(c: &mut Client) -> pb::RunStatus {
    c.get_run(pb::GetRunRequest {
        run_id: RUN.to_owned(),
        include_nodes: true,
    })
    .await
    .unwrap()
    .into_inner()
}

/// Desired slots serving now, whatever their template: a slot serves when
/// one of its attempts (the current one, or a successor) is active, ready,
/// neither unhealthy nor lost.
fn serving(s: &pb::RunStatus) -> usize {
    s.nodes
        .iter()
        .filter_map(|n| n.state.as_ref())
        .filter(|n| {
            let ready = [pb::NodeStage::Dormant as i32, pb::NodeStage::HandedOff as i32].contains(&n.stage);
            let facts = n.facts.clone().unwrap_or_default();
            let unhealthy = facts.health.as_ref().is_some_and(|h| !h.healthy);
            ready && n.intent == pb::Intent::Active as i32 && !facts.lost && !unhealthy
        })
        .map(|n| n.node_id.clone())
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

/// Samples the run at 10 Hz until told to stop: the fewest nodes serving
/// and the most live agents seen.
async fn sample(
    mut c: Client,
    agents: std::path::PathBuf,
    mut stop: watch::Receiver<bool>,
) -> (usize, usize) {
    let (mut fewest, mut most) = (usize::MAX, 0);
    while !*stop.borrow() {
        let s = status(&mut c).await;
        fewest = fewest.min(serving(&s));
        most = most.max(live_agent_pids(&agents).len());
        tokio::select! {
            _ = stop.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    (fewest, most)
}

fn attempts(s: &pb::RunStatus) -> Vec<u64> {
    let mut v: Vec<u64> = s
        .nodes
        .iter()
        .filter_map(|n| n.state.as_ref())
        .map(|n| n.attempt)
        .collect();
    v.sort_unstable();
    v
}

/// Deletes the run and waits until it is gone and none of its agents lives.
async fn delete_and_wait(c: &mut Client, agents: &Path) {
    c.delete_run(pb::DeleteRunRequest { run_id: RUN.into() })
        .await
        .unwrap();
    let gone = watch_until(c, RUN, CONVERGE, |s| s.phase == pb::RunPhase::Deleted as i32).await;
    if let Err(e) = gone {
        let not_found = e
            .downcast_ref::<tonic::Status>()
            .is_some_and(|s| s.code() == tonic::Code::NotFound);
        assert!(not_found, "the run was not deleted: {e}");
    }
    eventually(Duration::from_secs(15), "every agent gone", || async {
        live_agent_pids(agents).is_empty().then_some(())
    })
    .await
    .unwrap();
}

/// Ten nodes change template under `max_unavailable` and `max_surge`:
/// sampled at 10 Hz, never fewer than `10 - max_unavailable` serving nor more
/// than `10 + max_surge` live agents, and every node replaced.
async fn rolls_within(max_unavailable: u32, max_surge: u32) {
    let keep = AgentsDir::new().unwrap();
    let agents = keep.root.clone();
    let cluster = Cluster::start(process_cluster(&agents)).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    let policy = RolloutPolicy {
        max_unavailable: Budget::Count(max_unavailable),
        max_surge: Budget::Count(max_surge),
        ..RolloutPolicy::default()
    };
    cluster
        .apply(&workers(1, 10, "img:1", policy, &[]))
        .await
        .unwrap();
    converged(&cluster, &mut c, 1).await;
    let before = status(&mut c).await;

    let (tx, rx) = watch::channel(false);
    let sampler = tokio::spawn(sample(cluster.client().await.unwrap(), agents.clone(), rx));
    cluster
        .apply(&workers(2, 10, "img:2", policy, &[]))
        .await
        .unwrap();
    converged(&cluster, &mut c, 2).await;
    let after = status(&mut c).await;
    tx.send(true).unwrap();
    let (fewest, most) = sampler.await.unwrap();

    let floor = 10 - max_unavailable as usize;
    let ceiling = 10 + max_surge as usize;
    assert!(
        fewest >= floor,
        "{fewest} of 10 serving at some point: more than max_unavailable {max_unavailable} down"
    );
    assert!(
        most <= ceiling,
        "{most} live agents at some point: more than 10 and max_surge {max_surge}"
    );
    // Every node was replaced, onto a fresh attempt.
    let (old, new) = (attempts(&before), attempts(&after));
    assert_eq!(new.len(), 10);
    assert!(new.iter().all(|a| !old.contains(a)), "{old:?} -> {new:?}");

    let events = run_events(&mut c, RUN).await.unwrap();
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    assert!(reasons.contains(&"RolloutStarted"), "{reasons:?}");
    assert!(reasons.contains(&"RolloutCompleted"), "{reasons:?}");
    assert!(after.groups[0].rollout.is_none(), "{:?}", after.groups[0]);
    delete_and_wait(&mut c, &agents).await;
    drop(keep);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_change_keeps_nine_of_ten_serving_with_one_successor() {
    rolls_within(1, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_surge_only_template_change_keeps_all_ten_serving() {
    rolls_within(0, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_template_halts_and_reverts_to_the_last_converged_one() {
    let keep = AgentsDir::new().unwrap();
    let agents = keep.root.clone();
    let cluster = Cluster::start(process_cluster(&agents)).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    let policy = RolloutPolicy {
        max_unavailable: Budget::Count(1),
        max_surge: Budget::Count(0),
        failure_threshold: 2,
        auto_revert: true,
        ..RolloutPolicy::default()
    };
    cluster.apply(&workers(1, 4, "img:1", policy, &[])).await.unwrap();
    converged(&cluster, &mut c, 1).await;

    // The plan for the bad shape shows the waves it would take: one node at
    // a time, lowest index first.
    let bad = workers(2, 4, "img:2", policy, &[("fault.fail_at", "joined")]);
    let plan = c
        .plan(pb::PlanRequest {
            shape: Some(pb::ClusterShape::from(&bad)),
        })
        .await
        .unwrap()
        .into_inner();
    let waves: Vec<Vec<String>> = plan.waves.iter().map(|w| w.nodes.clone()).collect();
    assert_eq!(
        waves,
        [["workers-0"], ["workers-1"], ["workers-2"], ["workers-3"]].map(|w| w.map(String::from).to_vec()),
        "{plan:?}"
    );

    cluster.apply(&bad).await.unwrap();
    // The halt applies generation 3, the old template again, and the run
    // converges there.
    let after = converged(&cluster, &mut c, 3).await;
    let image = after.shape.as_ref().unwrap().groups[0]
        .template
        .as_ref()
        .unwrap()
        .image
        .clone();
    assert_eq!(image, "img:1");
    let events = run_events(&mut c, RUN).await.unwrap();
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    for r in [
        "RolloutStarted",
        "RolloutHalted",
        "RolloutReverted",
        "RolloutCompleted",
    ] {
        assert!(reasons.contains(&r), "no {r}: {reasons:?}");
    }
    let halted = events.iter().find(|e| e.reason == "RolloutHalted").unwrap();
    assert!(
        halted.message.contains("failure_threshold 2"),
        "{}",
        halted.message
    );
    // At most the threshold's attempts of the bad template were made, one
    // slot at a time: only workers-0 ever left the old template.
    let bad_attempts = events
        .iter()
        .filter(|e| e.reason == "NodeFailedPermanently" || e.message.contains("fault.fail_at"))
        .count();
    assert!(bad_attempts <= 2, "{bad_attempts} failed attempts: {events:?}");
    delete_and_wait(&mut c, &agents).await;
    drop(keep);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_waits_for_its_promotion() {
    let keep = AgentsDir::new().unwrap();
    let agents = keep.root.clone();
    let cluster = Cluster::start(process_cluster(&agents)).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    let policy = RolloutPolicy {
        max_unavailable: Budget::Count(2),
        max_surge: Budget::Count(0),
        canary: 2,
        ..RolloutPolicy::default()
    };
    cluster.apply(&workers(1, 5, "img:1", policy, &[])).await.unwrap();
    converged(&cluster, &mut c, 1).await;
    cluster.apply(&workers(2, 5, "img:2", policy, &[])).await.unwrap();

    // Two on the new template, ready, and the rollout paused there.
    let paused = eventually(CONVERGE, "the canary paused", || {
        let mut c = c.clone();
        async move {
            let s = status(&mut c).await;
            let r = s.groups.first()?.rollout.clone()?;
            (r.canary_paused && r.updated_ready == 2).then_some(s)
        }
    })
    .await
    .unwrap();
    let r = paused.groups[0].rollout.clone().unwrap();
    assert_eq!((r.updated, r.old), (2, 3), "{r:?}");
    let progressing = paused
        .conditions
        .iter()
        .find(|c| c.r#type == "Progressing")
        .unwrap();
    assert_eq!(progressing.reason, "CanaryPaused", "{progressing:?}");
    // It stays there: nothing more is replaced without a promotion.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = status(&mut c).await.groups[0].rollout.clone().unwrap();
    assert_eq!((still.updated, still.old), (2, 3), "{still:?}");

    // An unknown group is named; promotion goes on to convergence.
    let e = c
        .promote_rollout(pb::PromoteRolloutRequest {
            run_id: RUN.to_owned(),
            group_id: "gpu".to_owned(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::NotFound, "the run has no group gpu"),
        "{e:?}"
    );
    c.promote_rollout(pb::PromoteRolloutRequest {
        run_id: RUN.to_owned(),
        group_id: "workers".to_owned(),
    })
    .await
    .unwrap();
    let done = converged(&cluster, &mut c, 2).await;
    assert_eq!(done.ready_count, 5);
    let reasons: Vec<String> = run_events(&mut c, RUN)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.reason)
        .collect();
    for r in ["RolloutPaused", "RolloutPromoted", "RolloutCompleted"] {
        assert!(reasons.iter().any(|x| x == r), "no {r}: {reasons:?}");
    }
    delete_and_wait(&mut c, &agents).await;
    drop(keep);
}
