//! Crash recovery with real processes. During convergence of a shape on the
//! process backend (every lease a node-agent process), the driver is killed
//! at each of its named crash points and at seeded random times, the executor
//! at seeded random times, and both at once; each is restarted on the same
//! data directory. Throughout, a sampler reads the OS process table: no
//! identity (node, attempt) and no slot ever has two live agents. After each
//! restart an accepted apply is still there; the run converges to the latest
//! accepted shape with one agent per slot; after deletion no agent is left.
//!
//! Every test prints its kill count; together they kill a service more than
//! twenty times per run. The random tests take their seed from `CRASH_SEED`
//! (printed, so a failure can be replayed).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeMap, path::Path, time::Duration};

use contract::{ClusterShape, Param, pb};
use provisioning_tests::{
    procs::{AgentsDir, Cluster, ClusterOptions, Sampler, live_agent_pids, watch_until},
    shapes::{shape, with_template},
    sim::Rng,
};
use tonic::Code;

const RUN: &str = "crashy";
const CONVERGE: Duration = Duration::from_secs(90);
/// How long a driver armed at a crash point may take to reach it.
const REACH: Duration = Duration::from_secs(30);

fn options(agents: &Path) -> ClusterOptions {
    ClusterOptions::default()
        .executor("--backend", "process")
        .executor("--process-state-dir", &agents.display().to_string())
        .executor("--process-kill-grace-ms", "300")
        .driver("--operation-timeout-ms", "5000")
        .driver("--result-grace-ms", "500")
        .driver("--orphan-sweep-ms", "0")
}

/// `workers` agents whose bootstrap takes a while, so that crashes land
/// mid-convergence.
fn workers(generation: u64, count: u32, image: &str) -> ClusterShape {
    with_template(
        shape(RUN, generation, "process", &[("workers", count, image)]),
        "workers",
        |t| {
            for (k, v) in [("stage_delay_ms", "120"), ("fault.endpoint_delay_ms", "250")] {
                t.boot.insert(
                    k.into(),
                    Param {
                        value: v.into(),
                        secret: false,
                    },
                );
            }
        },
    )
}

async fn status(cluster: &Cluster) -> Option<pb::RunStatus> {
    let mut c = cluster.client().await.unwrap();
    match c
        .get_run(pb::GetRunRequest {
            run_id: RUN.into(),
            include_nodes: false,
        })
        .await
    {
        Ok(s) => Some(s.into_inner()),
        Err(s) if s.code() == Code::NotFound => None,
        Err(s) => panic!("get_run: {s}"),
    }
}

/// A client of the driver; a driver that is gone is `UNAVAILABLE`.
async fn client(
    cluster: &Cluster,
) -> Result<contract::pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>, tonic::Status> {
    cluster
        .client()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))
}

async fn apply(cluster: &Cluster, s: &ClusterShape) -> Result<(), tonic::Status> {
    let mut c = client(cluster).await?;
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(s)),
    })
    .await
    .map(|_| ())
}

async fn delete(cluster: &Cluster) -> Result<(), tonic::Status> {
    let mut c = client(cluster).await?;
    c.delete_run(pb::DeleteRunRequest { run_id: RUN.into() })
        .await
        .map(|_| ())
}

async fn converged(cluster: &Cluster, generation: u64) -> pb::RunStatus {
    let mut c = cluster.client().await.unwrap();
    match watch_until(&mut c, RUN, CONVERGE, |s| {
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

fn deleting(st: &pb::RunStatus) -> bool {
    st.phase == pb::RunPhase::Deleting as i32 || st.phase == pb::RunPhase::Deleted as i32
}

/// Exactly one live agent per slot, the slots being `workers-0..count`.
fn one_agent_per_slot(agents: &Path, count: u32) {
    let mut per_slot: BTreeMap<String, usize> = BTreeMap::new();
    for (_, node, _) in live_agent_pids(agents) {
        *per_slot.entry(node).or_default() += 1;
    }
    let expected: BTreeMap<String, usize> = (0..count).map(|i| (format!("workers-{i}"), 1)).collect();
    assert_eq!(per_slot, expected, "live agents per slot at convergence");
}

/// Waits until the run is gone and no agent is left.
async fn gone_and_clean(cluster: &Cluster, agents: &Path) {
    let deadline = tokio::time::Instant::now() + CONVERGE;
    while status(cluster).await.is_some() {
        if tokio::time::Instant::now() > deadline {
            cluster.dump_logs();
            panic!("the run was not deleted: {:?}", status(cluster).await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = live_agent_pids(agents);
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "agents left after deletion: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a step does once the driver armed at its crash point is up.
#[derive(Debug, Clone)]
enum Step {
    /// Apply a shape: the driver dies after committing it, before answering.
    Apply(ClusterShape),
    /// Delete the run: the driver dies after committing it, before answering.
    Delete,
    /// Apply shapes through the armed driver, one after another, each once
    /// the run converged to the one before, until the driver dies at the
    /// point (before or after answering): the work they bring is all done
    /// under the armed driver.
    Change(Vec<ClusterShape>),
    /// Let the run go on until the driver dies at the point.
    Run,
}

/// Restarts the driver armed at `spec`, does `step`, and waits for the
/// driver to die there. Returns the last generation a `Change` had answered
/// (0 if none).
async fn crash_at(cluster: &mut Cluster, spec: &str, step: &Step) -> u64 {
    let mut answered = 0;
    cluster.driver.set_flag("--crash-at", Some(spec));
    cluster.driver.restart(cluster.dir.path()).await.unwrap();
    match step {
        Step::Apply(s) => {
            let answered = apply(cluster, s).await;
            assert!(answered.is_err(), "{spec}: the apply was answered: {answered:?}");
        }
        Step::Delete => {
            let answered = delete(cluster).await;
            assert!(answered.is_err(), "{spec}: the delete was answered: {answered:?}");
        }
        Step::Change(shapes) => {
            for s in shapes {
                if apply(cluster, s).await.is_err() {
                    break;
                }
                answered = s.generation.get();
                // Until the driver dies, or the run converges to this shape
                // without reaching the point (then the next shape).
                let deadline = tokio::time::Instant::now() + REACH;
                loop {
                    if !cluster.driver.is_running() {
                        break;
                    }
                    let done = match client(cluster).await {
                        Err(e) => Err(e),
                        Ok(mut c) => c
                            .get_run(pb::GetRunRequest {
                                run_id: RUN.into(),
                                include_nodes: false,
                            })
                            .await
                            .map(|r| r.into_inner()),
                    };
                    match done {
                        Ok(st) if st.converged && st.generation == answered => break,
                        Err(_) => break,
                        _ => {}
                    }
                    if tokio::time::Instant::now() > deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if !cluster.driver.is_running() {
                    break;
                }
            }
        }
        Step::Run => {}
    }
    let exit = cluster.driver.wait_exit(REACH).await.unwrap();
    if exit.is_none() {
        cluster.dump_logs();
        panic!(
            "{spec}: the driver did not reach its crash point; run: {:?}",
            status(cluster).await
        );
    }
    let exit = exit.unwrap();
    assert!(!exit.success(), "{spec}: the driver exited cleanly: {exit}");
    answered
}

/// The shape of generation `g`: the image alternates, so every generation
/// replaces every node (cleanup, create, bootstrap: many passes and
/// operations to crash in), and the count alternates between 4 and 5.
fn generation(g: u64) -> ClusterShape {
    workers(g, 4 + (g % 2) as u32, &format!("img:{}", g % 2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_crashed_at_each_named_point_loses_nothing_and_doubles_nothing() {
    let agents = AgentsDir::new().unwrap();
    let mut cluster = Cluster::start(options(&agents.root)).await.unwrap();
    let sampler = Sampler::start(&agents.root);

    // Each point is reached while the run converges to a new generation,
    // applied through the armed driver.
    let points = [
        "apply-committed",
        "pass-decided:2",
        "pass-recorded:2",
        "pass-dispatched-one",
        "pass-dispatched:2",
        "fold-committed:3",
        "apply-committed",
        "pass-recorded:3",
        "fold-committed:6",
        "pass-dispatched-one:2",
        "pass-decided:4",
        "pass-dispatched",
    ];
    let mut crashes = 0;
    let mut accepted = 0;
    for spec in points {
        let step = if spec.starts_with("apply-committed") {
            Step::Apply(generation(accepted + 1))
        } else {
            Step::Change((1..=3).map(|k| generation(accepted + k)).collect())
        };
        let committed_first = matches!(step, Step::Apply(_));
        let answered = crash_at(&mut cluster, spec, &step).await;
        crashes += 1;
        // The next driver finds every accepted shape: one that was answered,
        // and one the driver committed before it died unanswered. A change
        // the driver died before receiving may be missing.
        cluster.driver.set_flag("--crash-at", None);
        cluster.driver.restart(cluster.dir.path()).await.unwrap();
        let st = status(&cluster).await.expect("the accepted run was lost");
        if committed_first {
            assert_eq!(st.generation, accepted + 1, "after a crash at {spec}");
        } else {
            // Every answered change is there; the one the driver died with
            // may or may not be.
            assert!(
                st.generation >= answered.max(accepted) && st.generation <= answered.max(accepted) + 1,
                "after a crash at {spec}: generation {}, last answered {answered}",
                st.generation
            );
        }
        accepted = st.generation;
    }
    let st = converged(&cluster, accepted).await;
    let count = generation(accepted).groups[0].count;
    assert_eq!(st.ready_count, count);
    one_agent_per_slot(&agents.root, count);

    // Mid-deletion: the deletion is accepted by a driver that dies before
    // answering; the next finds it and dies once it recorded the cleanup
    // operations, before dispatching them.
    crash_at(&mut cluster, "delete-committed", &Step::Delete).await;
    crash_at(&mut cluster, "deleting-recorded", &Step::Run).await;
    crashes += 2;
    cluster.driver.set_flag("--crash-at", None);
    cluster.driver.restart(cluster.dir.path()).await.unwrap();
    // The accepted deletion is never lost.
    if let Some(st) = status(&cluster).await {
        assert!(deleting(&st), "after the crashes mid-deletion: {st:?}");
    }
    gone_and_clean(&cluster, &agents.root).await;
    let samples = sampler.finish();
    eprintln!("driver crashes at named points: {crashes}; process-table samples: {samples}");
    assert_eq!(crashes, points.len() + 2);
}

/// Which service a random-kill test kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Victim {
    Driver,
    Executor,
    Both,
}

fn seed(salt: u64) -> u64 {
    std::env::var("CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_c4a5)
        ^ salt
}

async fn kill_and_restart(cluster: &mut Cluster, victim: Victim) {
    let dir = cluster.dir.path().to_path_buf();
    if matches!(victim, Victim::Driver | Victim::Both) {
        cluster.driver.kill().await.unwrap();
    }
    if matches!(victim, Victim::Executor | Victim::Both) {
        cluster.executor.kill().await.unwrap();
    }
    if matches!(victim, Victim::Executor | Victim::Both) {
        cluster.executor.restart(&dir).await.unwrap();
    }
    if matches!(victim, Victim::Driver | Victim::Both) {
        cluster.driver.restart(&dir).await.unwrap();
    }
}

/// Kills `victim` `kills` times at seeded random moments while the run
/// converges through shape changes, then once more during deletion.
async fn random_kills(victim: Victim, kills: usize, salt: u64) {
    let seed = seed(salt);
    eprintln!("{victim:?} kills, seed {seed} (CRASH_SEED={})", seed ^ salt);
    let mut rng = Rng::new(seed);
    let agents = AgentsDir::new().unwrap();
    let mut cluster = Cluster::start(options(&agents.root)).await.unwrap();
    let sampler = Sampler::start(&agents.root);

    let mut generation = 1;
    let mut count = 5;
    apply(&cluster, &workers(generation, count, "img:1"))
        .await
        .unwrap();
    let mut accepted = (generation, count);
    for k in 0..kills {
        if k % 3 == 2 {
            // A new shape; accepted only if the driver answered.
            generation += 1;
            count = if count == 5 { 3 } else { 5 };
            let image = format!("img:{}", 1 + generation % 2);
            if apply(&cluster, &workers(generation, count, &image)).await.is_ok() {
                accepted = (generation, count);
            }
        }
        tokio::time::sleep(Duration::from_millis(50 + rng.below(650))).await;
        kill_and_restart(&mut cluster, victim).await;
        let st = status(&cluster).await.expect("the accepted run was lost");
        assert_eq!(st.generation, accepted.0, "after kill {k}");
    }
    let st = converged(&cluster, accepted.0).await;
    assert_eq!(st.ready_count, accepted.1);
    one_agent_per_slot(&agents.root, accepted.1);

    delete(&cluster).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20 + rng.below(180))).await;
    kill_and_restart(&mut cluster, victim).await;
    if let Some(st) = status(&cluster).await {
        assert!(deleting(&st), "the accepted deletion was lost: {st:?}");
    }
    gone_and_clean(&cluster, &agents.root).await;
    let samples = sampler.finish();
    eprintln!(
        "{victim:?} killed {} times (seed {seed}); process-table samples: {samples}",
        kills + 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_killed_at_seeded_random_times_loses_nothing_and_doubles_nothing() {
    random_kills(Victim::Driver, 8, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_executor_killed_at_seeded_random_times_doubles_nothing() {
    random_kills(Victim::Executor, 5, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_killed_at_once_lose_nothing_and_double_nothing() {
    random_kills(Victim::Both, 4, 3).await;
}
