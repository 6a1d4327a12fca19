//! The three services with the process backend: every lease is a real
//! node-agent process. "No double-create" and "converged leaks nothing" are
//! checked by counting live agent processes in the OS process table.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::Duration,
};

use contract::pb;
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, live_agent_pids, watch_until},
    shapes::shape,
};

const CONVERGE: Duration = Duration::from_secs(90);

/// Live node agents under `root`, by `(node, attempt)`, from `/proc`.
fn live_agents(root: &Path) -> BTreeMap<(String, String), Vec<u32>> {
    let mut out: BTreeMap<(String, String), Vec<u32>> = BTreeMap::new();
    for (pid, node, attempt) in live_agent_pids(root) {
        out.entry((node, attempt)).or_default().push(pid);
    }
    out
}

fn process_cluster(agents: &Path) -> ClusterOptions {
    ClusterOptions::default()
        .executor("--backend", "process")
        .executor("--process-state-dir", &agents.display().to_string())
        .executor("--process-kill-grace-ms", "500")
}

fn slots(m: &BTreeMap<(String, String), Vec<u32>>) -> BTreeMap<String, usize> {
    let mut per_slot: BTreeMap<String, usize> = BTreeMap::new();
    for ((node, _), pids) in m {
        *per_slot.entry(node.clone()).or_default() += pids.len();
    }
    per_slot
}

async fn apply(cluster: &Cluster, s: &contract::ClusterShape) {
    let mut c = cluster.client().await.unwrap();
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(s)),
    })
    .await
    .unwrap();
}

async fn converged(cluster: &Cluster, generation: u64) -> pb::RunStatus {
    let mut c = cluster.client().await.unwrap();
    match watch_until(&mut c, "agents", CONVERGE, |s| {
        s.converged && s.generation == generation
    })
    .await
    {
        Ok(s) => s,
        Err(e) => {
            cluster.dump_logs();
            panic!("{e}");
        }
    }
}

/// A test's agent directory. Dropping it SIGKILLs every agent still running
/// under it, so a failing test leaves no process behind (agents outlive their
/// executor by design).
struct AgentsDir {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Drop for AgentsDir {
    fn drop(&mut self) {
        for pids in live_agents(&self.root).values() {
            for pid in pids {
                let _ = std::process::Command::new("kill")
                    .arg("-KILL")
                    .arg(pid.to_string())
                    .status();
            }
        }
    }
}

fn agents_dir() -> (AgentsDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("agents");
    (
        AgentsDir {
            _dir: d,
            root: p.clone(),
        },
        p,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_agents_converge_scale_down_and_are_all_gone_after_delete() {
    let (_keep, agents) = agents_dir();
    let cluster = Cluster::start(process_cluster(&agents)).await.unwrap();
    apply(
        &cluster,
        &shape(
            "agents",
            1,
            "process",
            &[("ctrl", 3, "img:1"), ("workers", 7, "img:1")],
        ),
    )
    .await;
    let s = converged(&cluster, 1).await;
    assert_eq!(s.ready_count, 10);
    let live = live_agents(&agents);
    let per_slot = slots(&live);
    assert_eq!(per_slot.len(), 10, "{live:?}");
    assert!(
        per_slot.values().all(|n| *n == 1),
        "a slot with two live agents: {live:?}"
    );

    // Scale down: exactly the highest-index workers' agents go.
    apply(
        &cluster,
        &shape(
            "agents",
            2,
            "process",
            &[("ctrl", 3, "img:1"), ("workers", 4, "img:1")],
        ),
    )
    .await;
    converged(&cluster, 2).await;
    let per_slot = slots(&live_agents(&agents));
    let expected: Vec<String> = [
        "ctrl-0",
        "ctrl-1",
        "ctrl-2",
        "workers-0",
        "workers-1",
        "workers-2",
        "workers-3",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(per_slot.keys().cloned().collect::<Vec<_>>(), expected);

    // Delete: no agent process is left.
    let mut c = cluster.client().await.unwrap();
    c.delete_run(pb::DeleteRunRequest {
        run_id: "agents".into(),
    })
    .await
    .unwrap();
    watch_until(&mut c, "agents", CONVERGE, |s| {
        s.phase == pb::RunPhase::Deleted as i32
    })
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = live_agents(&agents);
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "agents left after delete: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_killed_during_creates_never_doubles_an_agent() {
    let (_keep, agents) = agents_dir();
    let mut cluster = Cluster::start(process_cluster(&agents)).await.unwrap();
    apply(
        &cluster,
        &shape("agents", 1, "process", &[("workers", 8, "img:1")]),
    )
    .await;
    // Creates are in flight: kill the executor hard, then bring it back over
    // the same agent directory.
    tokio::time::sleep(Duration::from_millis(60)).await;
    cluster.executor.kill().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.executor.restart(cluster.dir.path()).await.unwrap();

    let s = converged(&cluster, 1).await;
    assert_eq!(s.ready_count, 8);
    let live = live_agents(&agents);
    let per_slot = slots(&live);
    assert_eq!(per_slot.len(), 8, "{live:?}");
    assert!(
        per_slot.values().all(|n| *n == 1),
        "a slot with two live agents: {live:?}"
    );

    let mut c = cluster.client().await.unwrap();
    c.delete_run(pb::DeleteRunRequest {
        run_id: "agents".into(),
    })
    .await
    .unwrap();
    watch_until(&mut c, "agents", CONVERGE, |s| {
        s.phase == pb::RunPhase::Deleted as i32
    })
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !live_agents(&agents).is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "agents left: {:?}",
            live_agents(&agents)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The pid of the live agent of `node` at `attempt`, if there is one.
fn agent_of(agents: &Path, node: &str, attempt: u64) -> Option<u32> {
    live_agents(agents)
        .get(&(node.to_owned(), attempt.to_string()))
        .and_then(|pids| pids.first().copied())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_mid_bootstrap_fails_its_attempt_and_is_replaced() {
    let (_keep, agents) = agents_dir();
    let opts = process_cluster(&agents).driver("--backoff-base-ms", "100");
    let cluster = Cluster::start(opts).await.unwrap();
    // Slow stages, so the bootstrap is still running when the agent dies.
    let slow = provisioning_tests::shapes::with_template(
        shape("agents", 1, "process", &[("workers", 3, "img:1")]),
        "workers",
        |t| {
            t.boot.insert(
                "stage_delay_ms".into(),
                contract::Param {
                    value: "400".into(),
                    secret: false,
                },
            );
        },
    );
    apply(&cluster, &slow).await;
    let mut c = cluster.client().await.unwrap();
    // Wait for workers-0's bootstrap to be running, then SIGKILL its agent.
    let (attempt, pid) = loop {
        let explained = c
            .explain_node(pb::ExplainNodeRequest {
                run_id: "agents".into(),
                node_id: "workers-0".into(),
            })
            .await;
        // Before the first pass inserts the node, it is not found yet.
        let Ok(s) = explained else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let state = s.into_inner().node.and_then(|n| n.state).unwrap();
        if state.stage == pb::NodeStage::BootstrapRunning as i32
            && let Some(pid) = agent_of(&agents, "workers-0", state.attempt)
        {
            break (state.attempt, pid);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let killed = std::process::Command::new("kill")
        .arg("-KILL")
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(killed.success());

    let s = converged(&cluster, 1).await;
    assert_eq!(s.ready_count, 3);
    let node = c
        .explain_node(pb::ExplainNodeRequest {
            run_id: "agents".into(),
            node_id: "workers-0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let state = node.node.and_then(|n| n.state).unwrap();
    assert!(state.attempt > attempt, "the killed attempt was not replaced");
    assert!(
        state.retry.is_some_and(|r| r.consecutive_failures == 0),
        "ready resets the failure count"
    );
    let per_slot = slots(&live_agents(&agents));
    assert_eq!(per_slot.len(), 3);
    assert!(per_slot.values().all(|n| *n == 1), "{per_slot:?}");
    assert!(
        agent_of(&agents, "workers-0", attempt).is_none(),
        "the dead attempt's agent is back"
    );

    c.delete_run(pb::DeleteRunRequest {
        run_id: "agents".into(),
    })
    .await
    .unwrap();
    watch_until(&mut c, "agents", CONVERGE, |s| {
        s.phase == pb::RunPhase::Deleted as i32
    })
    .await
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !live_agents(&agents).is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "agents left: {:?}",
            live_agents(&agents)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
