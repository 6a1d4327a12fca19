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
use executor_svc::process::{
    agent_protocol::{ENDPOINT_FILE, SESSION_RECORD, SessionRecord, SessionStatus, read_json},
    registry::STATE_DIR_FLAG,
};
use provisioning_tests::{
    procs::{
        AgentsDir, Cluster, ClusterOptions, ProcEntry, eventually, live_agent_pids, run_events, watch_until,
        zombie_descendants,
    },
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
    cluster.apply(s).await.unwrap();
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

/// The end of every test: no agent of the test lives, and no node agent
/// among this process's descendants is a zombie (dead, never reaped by
/// the executor that spawned it, nor by this process when it inherited
/// it). A zombie that outlives the wait is a leak, not a moment's lag.
async fn assert_all_gone(agents: &AgentsDir) {
    let gone = eventually(Duration::from_secs(15), "every agent gone", || async {
        (live_agents(&agents.root).is_empty() && zombie_agents().is_empty()).then_some(())
    })
    .await;
    if let Err(e) = gone {
        panic!(
            "{e}: agents left: {:?}; zombie agents: {:?}",
            live_agents(&agents.root),
            zombie_agents()
        );
    }
}

/// Node agents among this process's descendants that are zombies.
fn zombie_agents() -> Vec<ProcEntry> {
    zombie_descendants()
        .into_iter()
        .filter(|p| p.comm == "node-agent")
        .collect()
}

fn agents_dir() -> (AgentsDir, PathBuf) {
    let keep = AgentsDir::new().unwrap();
    let root = keep.root.clone();
    (keep, root)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_agents_converge_scale_down_and_are_all_gone_after_delete() {
    let (keep, agents) = agents_dir();
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
    delete_run(&mut c).await;
    assert_all_gone(&keep).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_killed_during_creates_never_doubles_an_agent() {
    let (keep, agents) = agents_dir();
    let mut cluster = Cluster::start(process_cluster(&agents)).await.unwrap();
    apply(
        &cluster,
        &shape("agents", 1, "process", &[("workers", 8, "img:1")]),
    )
    .await;
    // Creates are in flight once the first agent lives: kill the executor
    // hard, then bring it back over the same agent directory.
    eventually(CONVERGE, "the first agent lives", || async {
        (!live_agents(&agents).is_empty()).then_some(())
    })
    .await
    .unwrap();
    cluster.executor.kill().await.unwrap();
    // The outage's length, not a wait for anything: the driver's link is
    // down a moment and retries.
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
    delete_run(&mut c).await;
    assert_all_gone(&keep).await;
}

/// The pid of the live agent of `node` at `attempt`, if there is one.
fn agent_of(agents: &Path, node: &str, attempt: u64) -> Option<u32> {
    live_agents(agents)
        .get(&(node.to_owned(), attempt.to_string()))
        .and_then(|pids| pids.first().copied())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_mid_bootstrap_fails_its_attempt_and_is_replaced() {
    let (keep, agents) = agents_dir();
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
    let (attempt, pid) = running_agent(&c, &agents, "workers-0").await;
    let killed = std::process::Command::new("kill")
        .arg("-KILL")
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(killed.success());

    let s = converged(&cluster, 1).await;
    assert_eq!(s.ready_count, 3);
    let state = node_state(&mut c, "workers-0").await.unwrap();
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

    delete_run(&mut c).await;
    assert_all_gone(&keep).await;
}

/// `s` with boot parameters added to `group`'s template.
fn with_boot(s: contract::ClusterShape, group: &str, params: &[(&str, &str)]) -> contract::ClusterShape {
    provisioning_tests::shapes::with_template(s, group, |t| {
        for (k, v) in params {
            t.boot.insert(
                (*k).to_owned(),
                contract::Param {
                    value: (*v).to_owned(),
                    secret: false,
                },
            );
        }
    })
}

type Client = pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>;

/// `node`'s state as the driver explains it, once the node exists.
async fn explain_node(c: &mut Client, node: &str) -> Option<pb::NodeExplanation> {
    let explained = c
        .explain_node(pb::ExplainNodeRequest {
            run_id: "agents".into(),
            node_id: node.into(),
        })
        .await
        .ok()?;
    Some(explained.into_inner())
}

async fn explain(c: &mut Client, node: &str) -> pb::NodeExplanation {
    explain_node(c, node).await.unwrap()
}

async fn node_state(c: &mut Client, node: &str) -> Option<pb::NodeState> {
    explain_node(c, node).await?.node.and_then(|n| n.state)
}

/// Waits until `node`'s state satisfies `done` and returns it; on giving
/// up, prints the services' logs and fails with the last state.
async fn wait_for_state(
    cluster: &Cluster,
    c: &mut Client,
    node: &str,
    what: &str,
    done: impl Fn(&pb::NodeState) -> bool,
) -> pb::NodeState {
    let reached = eventually(CONVERGE, &format!("{node} reaches {what}"), || {
        let mut c = c.clone();
        let done = &done;
        async move { node_state(&mut c, node).await.filter(|s| done(s)) }
    })
    .await;
    match reached {
        Ok(state) => state,
        Err(e) => {
            cluster.dump_logs();
            panic!("{e}; last state: {:?}", node_state(c, node).await);
        }
    }
}

/// Waits until `node` (once a pass has inserted it) is at a stage `at`
/// accepts with a live agent, and returns its attempt and the agent's pid.
async fn agent_at(c: &Client, agents: &Path, node: &str, at: impl Fn(&pb::NodeState) -> bool) -> (u64, u32) {
    eventually(CONVERGE, &format!("{node} has a live agent"), || {
        let mut c = c.clone();
        let at = &at;
        async move {
            let state = node_state(&mut c, node).await.filter(|s| at(s))?;
            Some((state.attempt, agent_of(agents, node, state.attempt)?))
        }
    })
    .await
    .unwrap()
}

/// [`agent_at`] with the node's bootstrap running.
async fn running_agent(c: &Client, agents: &Path, node: &str) -> (u64, u32) {
    agent_at(c, agents, node, |s| {
        s.stage == pb::NodeStage::BootstrapRunning as i32
    })
    .await
}

/// Waits until `pid`'s scheduler state is stopped (`T`).
async fn stopped(pid: u32) {
    eventually(CONVERGE, "the agent is stopped", || async {
        (proc_state(pid) == Some('T')).then_some(())
    })
    .await
    .unwrap();
}

/// Waits until `node`'s agent at `attempt` is no longer alive.
async fn dead(agents: &Path, node: &str, attempt: u64) {
    eventually(CONVERGE, "the agent is dead", || async {
        agent_of(agents, node, attempt).is_none().then_some(())
    })
    .await
    .unwrap();
}

/// The state directory agent `pid` was started with, from its command line.
fn state_dir_of(pid: u32) -> Option<PathBuf> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let at = args.iter().position(|a| a == STATE_DIR_FLAG)?;
    args.get(at + 1).map(PathBuf::from)
}

/// The scheduler state of `pid` (`T` when stopped).
fn proc_state(pid: u32) -> Option<char> {
    provisioning_tests::procs::proc_table()
        .into_iter()
        .find(|p| p.pid == pid)
        .map(|p| p.state)
}

fn signal(pid: u32, sig: &str) {
    let sent = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{sig} {pid}");
}

/// Converged with exactly one live agent (by identity, in `/proc`) per slot of
/// `expected`, none of them `gone_attempt` of `node`, whose slot holds a later
/// attempt.
async fn assert_replaced(
    cluster: &Cluster,
    c: &mut Client,
    agents: &Path,
    expected: &[&str],
    node: &str,
    gone_attempt: u64,
) {
    let s = converged(cluster, 1).await;
    assert_eq!(s.ready_count as usize, expected.len());
    let state = node_state(c, node).await.unwrap();
    assert!(
        state.attempt > gone_attempt,
        "the stopped attempt was not replaced: {state:?}"
    );
    let live = live_agents(agents);
    let per_slot = slots(&live);
    assert_eq!(
        per_slot.keys().map(String::as_str).collect::<Vec<_>>(),
        expected,
        "{live:?}"
    );
    assert!(
        per_slot.values().all(|n| *n == 1),
        "a slot with two live agents: {live:?}"
    );
    assert!(
        agent_of(agents, node, gone_attempt).is_none(),
        "the stopped attempt's agent outlived its cleanup: {live:?}"
    );
}

/// Deletes the run and waits until it is gone. A run whose cleanup finished
/// before the watch began is already forgotten: not found is gone too.
async fn delete_run(c: &mut Client) {
    c.delete_run(pb::DeleteRunRequest {
        run_id: "agents".into(),
    })
    .await
    .unwrap();
    let gone = watch_until(c, "agents", CONVERGE, |s| s.phase == pb::RunPhase::Deleted as i32).await;
    if let Err(e) = gone {
        let not_found = e
            .downcast_ref::<tonic::Status>()
            .is_some_and(|s| s.code() == tonic::Code::NotFound);
        assert!(not_found, "the run was not deleted: {e}");
    }
}

/// An agent stopped (SIGSTOP) once it has bound its endpoint, before the
/// driver starts its bootstrap: the kernel accepts the start's connection but
/// nobody answers, so the start times out ambiguous. Cleanup cancels the
/// ambiguous bootstrap (the agent cannot answer, so the executor ends the
/// session on its own side), destroys the lease (SIGTERM and SIGCONT, then
/// SIGKILL), and the slot gets a fresh attempt. The test never resumes the
/// agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_stopped_before_answering_its_start_is_cleaned_up_and_replaced() {
    let (keep, agents) = agents_dir();
    let opts = process_cluster(&agents)
        .driver("--backoff-base-ms", "100")
        // The agent binds its endpoint half-way between two probes, so it is
        // stopped long before the driver learns the endpoint.
        .driver("--probe-interval-ms", "1000")
        .driver("--operation-timeout-ms", "1500")
        .driver("--result-grace-ms", "500");
    let cluster = Cluster::start(opts).await.unwrap();
    let s = with_boot(
        shape("agents", 1, "process", &[("workers", 2, "img:1")]),
        "workers",
        &[("fault.endpoint_delay_ms", "500")],
    );
    apply(&cluster, &s).await;
    let mut c = cluster.client().await.unwrap();

    let (attempt, pid) = agent_at(&c, &agents, "workers-0", |_| true).await;
    let dir = state_dir_of(pid).unwrap();
    eventually(CONVERGE, "the agent binds its endpoint", || async {
        dir.join(ENDPOINT_FILE).exists().then_some(())
    })
    .await
    .unwrap();
    signal(pid, "STOP");
    stopped(pid).await;

    // The start got no answer: the attempt failed with its bootstrap
    // ambiguous, and cleanup begins with a cancel.
    let failed = wait_for_state(&cluster, &mut c, "workers-0", "an ambiguous bootstrap", |n| {
        n.attempt == attempt && n.facts.as_ref().is_some_and(|f| f.ambiguous_bootstrap)
    })
    .await;
    assert!(
        failed
            .facts
            .as_ref()
            .is_some_and(|f| f.failure_reason.contains("start-bootstrap")),
        "{failed:?}"
    );

    assert_replaced(
        &cluster,
        &mut c,
        &agents,
        &["workers-0", "workers-1"],
        "workers-0",
        attempt,
    )
    .await;
    delete_run(&mut c).await;
    assert_all_gone(&keep).await;
}

/// An agent stopped (SIGSTOP) while its bootstrap streams: the session goes
/// silent, the bootstrap deadline fails the attempt, and cleanup must still
/// reach the destroy although the stopped agent never answers the cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_stopped_mid_bootstrap_times_out_and_cleanup_still_destroys_it() {
    let (keep, agents) = agents_dir();
    let opts = process_cluster(&agents)
        .driver("--backoff-base-ms", "100")
        .driver("--bootstrap-timeout-ms", "4000")
        .driver("--operation-timeout-ms", "2000")
        .driver("--result-grace-ms", "500");
    let cluster = Cluster::start(opts).await.unwrap();
    // Stages 300 ms apart: a healthy bootstrap converges well within the
    // deadline, and one stopped after its start is caught mid-way.
    let s = with_boot(
        shape("agents", 1, "process", &[("workers", 2, "img:1")]),
        "workers",
        &[("stage_delay_ms", "300")],
    );
    apply(&cluster, &s).await;
    let mut c = cluster.client().await.unwrap();

    let (attempt, pid) = running_agent(&c, &agents, "workers-0").await;
    signal(pid, "STOP");
    stopped(pid).await;
    let dir = state_dir_of(pid).unwrap();
    let session: SessionRecord = read_json(&dir, SESSION_RECORD).unwrap().unwrap();
    assert_eq!(
        session.status,
        SessionStatus::Running,
        "stopped mid-bootstrap: {session:?}"
    );

    let failed = wait_for_state(&cluster, &mut c, "workers-0", "a bootstrap timeout", |n| {
        n.attempt == attempt
            && n.facts
                .as_ref()
                .is_some_and(|f| f.failure_reason.contains("did not converge"))
    })
    .await;
    assert!(
        failed.facts.as_ref().is_some_and(|f| !f.session_id.is_empty()),
        "cleanup has a session to cancel: {failed:?}"
    );

    assert_replaced(
        &cluster,
        &mut c,
        &agents,
        &["workers-0", "workers-1"],
        "workers-0",
        attempt,
    )
    .await;
    delete_run(&mut c).await;
    assert_all_gone(&keep).await;
}

/// SPEC §8: a converged run stays true. A ready node's agent is SIGKILLed:
/// the executor sees the exit (its pidfd), the driver fails the attempt, the
/// run leaves convergence, the slot is cleaned up and replaced on a fresh
/// attempt, and the run converges again with one agent per slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_nodes_agent_killed_is_found_lost_and_replaced() {
    let (keep, agents) = agents_dir();
    // A restart backoff long enough for the degraded run to be seen.
    let opts = process_cluster(&agents).driver("--backoff-base-ms", "1000");
    let cluster = Cluster::start(opts).await.unwrap();
    apply(
        &cluster,
        &shape("agents", 1, "process", &[("workers", 10, "img:1")]),
    )
    .await;
    let s = converged(&cluster, 1).await;
    assert_eq!(s.ready_count, 10);
    let mut c = cluster.client().await.unwrap();
    let mut attempts = BTreeMap::new();
    for i in 0..10 {
        let node = format!("workers-{i}");
        let state = node_state(&mut c, &node).await.unwrap();
        attempts.insert(node, state.attempt);
    }
    let before = node_state(&mut c, "workers-3").await.unwrap();
    let pid = agent_of(&agents, "workers-3", before.attempt).unwrap();
    let killed_at = unix_ms();
    signal(pid, "KILL");

    // Nothing polls the node: the run leaves convergence because the
    // executor saw the agent go, and its Degraded condition names the node.
    let left = watch_until(&mut c, "agents", CONVERGE, |s| {
        s.conditions.iter().any(|c| {
            c.r#type == "Degraded" && c.status && c.reason == "NodesLost" && c.message.contains("workers-3")
        })
    })
    .await;
    match left {
        Ok(s) => assert!(!s.converged, "a run with a lost node is not converged"),
        Err(e) => {
            cluster.dump_logs();
            panic!("the run never said its node was lost: {e}");
        }
    }
    assert_replaced(
        &cluster,
        &mut c,
        &agents,
        &[
            "workers-0",
            "workers-1",
            "workers-2",
            "workers-3",
            "workers-4",
            "workers-5",
            "workers-6",
            "workers-7",
            "workers-8",
            "workers-9",
        ],
        "workers-3",
        before.attempt,
    )
    .await;
    // Only the lost slot was replaced.
    for (node, attempt) in &attempts {
        if node != "workers-3" {
            let state = node_state(&mut c, node).await.unwrap();
            assert_eq!(state.attempt, *attempt, "{node} was replaced too: {state:?}");
        }
    }
    // The event log has the loss once, of that attempt, as the executor's
    // watch saw it (the agent's exit), not as a later look at the inventory.
    let log = run_events(&mut c, "agents").await.unwrap();
    let lost: Vec<&pb::Event> = log.iter().filter(|e| e.reason == "NodeLost").collect();
    assert_eq!(lost.len(), 1, "{log:?}");
    assert_eq!(
        (lost[0].node_id.as_str(), lost[0].attempt),
        ("workers-3", before.attempt)
    );
    assert!(!lost[0].message.contains("inventory"), "{:?}", lost[0]);
    println!(
        "the loss was folded {} ms after the SIGKILL",
        lost[0].first_at_ms.saturating_sub(killed_at)
    );
    delete_run(&mut c).await;
    assert_all_gone(&keep).await;
}

/// Wall-clock milliseconds, to set beside the driver's event times.
fn unix_ms() -> u64 {
    #[allow(clippy::disallowed_methods)]
    let now = std::time::SystemTime::now();
    now.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// An agent that dies while the executor is down is found when the executor
/// starts again (it finds the agent's directory with no live agent) and its
/// slot is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_died_while_the_executor_was_down_is_found_at_its_restart() {
    let (keep, agents) = agents_dir();
    let opts = process_cluster(&agents).driver("--backoff-base-ms", "100");
    let mut cluster = Cluster::start(opts).await.unwrap();
    apply(
        &cluster,
        &shape("agents", 1, "process", &[("workers", 3, "img:1")]),
    )
    .await;
    converged(&cluster, 1).await;
    let mut c = cluster.client().await.unwrap();
    let before = node_state(&mut c, "workers-1").await.unwrap();
    let pid = agent_of(&agents, "workers-1", before.attempt).unwrap();

    cluster.executor.kill().await.unwrap();
    signal(pid, "KILL");
    dead(&agents, "workers-1", before.attempt).await;
    cluster.executor.restart(cluster.dir.path()).await.unwrap();
    // The run still says converged until the restarted executor reports the
    // loss; then the slot gets a fresh attempt.
    replaced_after_restart(&cluster, &mut c, &keep, "workers-1", before.attempt).await;
}

/// After an executor restart: `node` gets a fresh attempt past `gone`, the
/// run converges with one agent per slot of its three workers, and a delete
/// leaves nothing.
async fn replaced_after_restart(cluster: &Cluster, c: &mut Client, keep: &AgentsDir, node: &str, gone: u64) {
    wait_for_state(cluster, c, node, "a fresh attempt", |s| s.attempt > gone).await;
    let expected = ["workers-0", "workers-1", "workers-2"];
    assert_replaced(cluster, c, &keep.root, &expected, node, gone).await;
    delete_run(c).await;
    assert_all_gone(keep).await;
}

/// SPEC §8, inventory resync: a resource that vanished without a trace (its
/// agent killed and its directory removed while the executor was down, so no
/// watch can report it) is missing from the executor's inventory at two
/// consecutive looks, is found lost, and its slot is replaced. The sweep's
/// interval is ten minutes: the look after the link comes up finds the lease
/// missing, and the confirming look follows within a second, not an
/// interval later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_missing_from_the_inventory_at_two_looks_is_lost_and_replaced() {
    let (keep, agents) = agents_dir();
    let opts = process_cluster(&agents)
        .driver("--backoff-base-ms", "100")
        .driver("--orphan-sweep-ms", "600000");
    let mut cluster = Cluster::start(opts).await.unwrap();
    apply(
        &cluster,
        &shape("agents", 1, "process", &[("workers", 3, "img:1")]),
    )
    .await;
    converged(&cluster, 1).await;
    let mut c = cluster.client().await.unwrap();
    let before = node_state(&mut c, "workers-2").await.unwrap();
    let pid = agent_of(&agents, "workers-2", before.attempt).unwrap();
    let dir = state_dir_of(pid).unwrap();

    cluster.executor.kill().await.unwrap();
    signal(pid, "KILL");
    dead(&agents, "workers-2", before.attempt).await;
    std::fs::remove_dir_all(&dir).unwrap();
    cluster.executor.restart(cluster.dir.path()).await.unwrap();
    replaced_after_restart(&cluster, &mut c, &keep, "workers-2", before.attempt).await;
}

/// `workers` probed every 200 ms (a probe unanswered in 200 ms fails), due
/// for replacement after a second unhealthy.
fn probed(count: u32, max_unhealthy: contract::Budget) -> contract::ClusterShape {
    let mut s = shape("agents", 1, "process", &[("workers", count, "img:1")]);
    s.groups[0].policy = contract::GroupPolicy {
        health: contract::HealthPolicy {
            probe: contract::Probe::Tcp,
            interval_ms: 200,
            timeout_ms: 200,
            unhealthy_after_ms: 1_000,
            startup_grace_ms: 0,
        },
        remediation: contract::RemediationPolicy {
            max_in_flight: 1,
            max_unhealthy,
        },
        rollout: contract::RolloutPolicy::default(),
    };
    s
}

async fn attempts_of(c: &mut Client, count: u32) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for i in 0..count {
        let node = format!("workers-{i}");
        out.insert(node.clone(), node_state(c, &node).await.unwrap().attempt);
    }
    out
}

async fn condition(
    cluster: &Cluster,
    c: &mut Client,
    what: &str,
    f: impl Fn(&pb::Condition) -> bool,
) -> pb::RunStatus {
    match watch_until(c, "agents", CONVERGE, |s| s.conditions.iter().any(&f)).await {
        Ok(s) => s,
        Err(e) => {
            cluster.dump_logs();
            panic!("never {what}: {e}");
        }
    }
}

/// A ready node's agent stopped (SIGSTOP): its process lives and the kernel
/// still accepts connections for it, but its probe goes unanswered. The node
/// is unhealthy at once (the run leaves Ready, Degraded names it), is
/// replaced once it has been for `unhealthy_after`, and the run converges
/// again with one live agent per slot; nothing else is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_ready_agent_is_unhealthy_then_remediated() {
    let (keep, agents) = agents_dir();
    let cluster = Cluster::start(process_cluster(&agents)).await.unwrap();
    apply(&cluster, &probed(10, contract::Budget::Percent(100))).await;
    converged(&cluster, 1).await;
    let mut c = cluster.client().await.unwrap();
    let attempts = attempts_of(&mut c, 10).await;
    let pid = agent_of(&agents, "workers-1", attempts["workers-1"]).unwrap();
    signal(pid, "STOP");

    let s = condition(&cluster, &mut c, "degraded for health", |c| {
        c.r#type == "Degraded" && c.status && c.reason == "NodesUnhealthy" && c.message.contains("workers-1")
    })
    .await;
    assert!(
        !s.converged,
        "a run with an unhealthy node is not converged: {s:?}"
    );
    let all: Vec<String> = (0..10).map(|i| format!("workers-{i}")).collect();
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    assert_replaced(
        &cluster,
        &mut c,
        &agents,
        &all,
        "workers-1",
        attempts["workers-1"],
    )
    .await;
    let after = attempts_of(&mut c, 10).await;
    for (node, attempt) in &attempts {
        if node != "workers-1" {
            assert_eq!(after[node], *attempt, "{node} was replaced too");
        }
    }
    // The log says what happened to it, in order: unhealthy, then replaced.
    let log = run_events(&mut c, "agents").await.unwrap();
    let of_node: Vec<&str> = log
        .iter()
        .filter(|e| e.node_id == "workers-1" && e.attempt == attempts["workers-1"])
        .map(|e| e.reason.as_str())
        .collect();
    assert_eq!(of_node, ["NodeUnhealthy", "NodeRemediated"], "{log:?}");
    delete_run(&mut c).await;
    assert_all_gone(&keep).await;
}

/// Six of ten agents stopped with `max_unhealthy: 40%`: more of the group is
/// unhealthy than the budget allows, so nothing is replaced and the run says
/// why (Stalled, RemediationHeld, with the counts). Resuming the agents (the
/// run paused meanwhile) heals their probes and the run converges with every
/// original attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mass_failure_over_max_unhealthy_replaces_nothing_and_heals() {
    let (keep, agents) = agents_dir();
    let cluster = Cluster::start(process_cluster(&agents)).await.unwrap();
    apply(&cluster, &probed(10, contract::Budget::Percent(40))).await;
    converged(&cluster, 1).await;
    let mut c = cluster.client().await.unwrap();
    let attempts = attempts_of(&mut c, 10).await;
    let stopped: Vec<u32> = (0..6)
        .map(|i| {
            agent_of(
                &agents,
                &format!("workers-{i}"),
                attempts[&format!("workers-{i}")],
            )
            .unwrap()
        })
        .collect();
    for pid in &stopped {
        signal(*pid, "STOP");
    }
    let s = condition(&cluster, &mut c, "stalled by the remediation budget", |c| {
        c.r#type == "Stalled" && c.status && c.reason == "RemediationHeld" && c.message.contains("6/10")
    })
    .await;
    assert!(!s.converged);
    // Every stopped node is past `unhealthy_after` once the budget has held
    // it (row 11 waits until then): each one's decision names the budget,
    // and nothing was replaced.
    let held = eventually(CONVERGE, "the budget holds every stopped node", || {
        let mut c = c.clone();
        async move {
            let mut held = Vec::new();
            for i in 0..6 {
                let last = explain(&mut c, &format!("workers-{i}"))
                    .await
                    .node
                    .and_then(|n| n.last_decision)
                    .filter(|d| d.rule == contract::Rule::RemediationBudget.number())?;
                held.push(last);
            }
            Some(held)
        }
    })
    .await
    .unwrap();
    assert!(
        held.iter().all(|d| d.reason.contains("max_unhealthy 40%")),
        "{held:?}"
    );
    assert_eq!(
        attempts_of(&mut c, 10).await,
        attempts,
        "a node was replaced over the budget"
    );

    // The agents come back one probe at a time, and a group back within its
    // budget replaces the nodes still unhealthy past `unhealthy_after` (as
    // it should); the operator pauses the run while they come back, so the
    // probes heal with nothing replaced, then resumes it.
    c.pause_run(pb::PauseRunRequest {
        run_id: "agents".into(),
    })
    .await
    .unwrap();
    for pid in &stopped {
        signal(*pid, "CONT");
    }
    condition(&cluster, &mut c, "healthy again", |c| {
        c.r#type == "Degraded" && !c.status
    })
    .await;
    c.resume_run(pb::ResumeRunRequest {
        run_id: "agents".into(),
    })
    .await
    .unwrap();
    converged(&cluster, 1).await;
    assert_eq!(attempts_of(&mut c, 10).await, attempts, "healing replaced a node");
    // The log: six nodes unhealthy, the group held once (with the budget and
    // the counts), the stall, six recoveries, converged; nothing replaced.
    let log = run_events(&mut c, "agents").await.unwrap();
    let count = |reason: &str| log.iter().filter(|e| e.reason == reason).count();
    assert_eq!(count("NodeUnhealthy"), 6, "{log:?}");
    assert_eq!(count("NodeRecovered"), 6, "{log:?}");
    assert_eq!(count("NodeRemediated"), 0, "{log:?}");
    let held: Vec<&pb::Event> = log.iter().filter(|e| e.reason == "RemediationHeld").collect();
    assert_eq!(held.len(), 1, "{log:?}");
    assert_eq!(held[0].group_id, "workers");
    assert!(held[0].message.contains("max_unhealthy 40%"), "{:?}", held[0]);
    assert_eq!(count("Stalled"), 1, "{log:?}");
    let last_recovered = log.iter().rposition(|e| e.reason == "NodeRecovered");
    let last_converged = log.iter().rposition(|e| e.reason == "Converged");
    assert!(last_converged > last_recovered, "{log:?}");
    delete_run(&mut c).await;
    assert_all_gone(&keep).await;
}
