//! The process backend with real node-agent processes: leases are child
//! processes, endpoints are real TCP ports, bootstraps are real sessions, and
//! faults are real signals. Every test checks at its end that the agents it saw
//! are gone from the process table (reaped, not zombies), and its fixture kills
//! whatever is left if the test fails half-way.

// The tests wait for real processes in real time.
#![allow(clippy::disallowed_methods)]

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};
use contract::{
    AttemptId, BootstrapStage, Clock, Epoch, LeaseId, LogicalNodeId, Operation, OperationId, OperationInput,
    Outcome, Param, Params, ResourceIdentity, ResultFacts, RunId, RunUid, SessionId, SystemClock,
    TraceContext, UnixMillis, shape::example_template,
};
use executor_svc::{
    backend::{Backend, ObservationReceiver, ObservationSink, RawObservation, observation_queue},
    process::{
        ProcessBackend, ProcessConfig,
        agent_protocol::{SESSION_RECORD, SessionRecord, SessionStatus, read_json},
        registry::{processes_naming, read_stat},
    },
};

type TestResult = anyhow::Result<()>;

const AGENT: &str = env!("CARGO_BIN_EXE_node-agent");
const RUN: RunUid = RunUid::from_u128(0x5eed_0000_0000_0000_0000_0000_0000_0001);
/// How long a test waits for something it expects.
const PATIENCE: Duration = Duration::from_secs(10);

fn boot(pairs: &[(&str, &str)]) -> Params {
    pairs
        .iter()
        .map(|(k, v)| {
            (
                (*k).to_owned(),
                Param {
                    value: (*v).to_owned(),
                    secret: false,
                },
            )
        })
        .collect()
}

/// One backend over a temporary root, with the sink its sessions stream to.
struct Fixture {
    root: tempfile::TempDir,
    backend: ProcessBackend,
    sink: ObservationSink,
    observations: ObservationReceiver,
    /// Every agent PID the test saw, checked gone at the end.
    pids: Vec<i32>,
}

impl Fixture {
    fn new() -> anyhow::Result<Self> {
        Self::with_agent(PathBuf::from(AGENT))
    }

    fn with_agent(agent: PathBuf) -> anyhow::Result<Self> {
        let root = tempfile::tempdir()?;
        let backend = start_backend(root.path(), agent)?;
        let (tx, observations) = observation_queue();
        Ok(Self {
            root,
            backend,
            sink: ObservationSink::new(tx, TraceContext::default()),
            observations,
            pids: Vec::new(),
        })
    }

    /// A second backend over the same root, as an executor restart makes.
    fn restart(&mut self) -> anyhow::Result<()> {
        self.backend = start_backend(self.root.path(), PathBuf::from(AGENT))?;
        let (tx, observations) = observation_queue();
        self.sink = ObservationSink::new(tx, TraceContext::default());
        self.observations = observations;
        Ok(())
    }

    async fn run(&self, op: Operation) -> Outcome {
        self.backend.execute(op, self.sink.clone()).await
    }

    /// Creates the lease and returns its facts and the agent's PID.
    async fn create(&mut self, node: &Node, boot: Params) -> anyhow::Result<(LeaseId, i32)> {
        let outcome = self.run(node.create(boot)).await;
        let lease = facts(outcome)?.lease.context("a create without a lease")?;
        let pid = pid_of(&lease)?;
        self.pids.push(pid);
        Ok((lease, pid))
    }

    /// Probes the endpoint until it is known; returns it and how many probes
    /// were not ready.
    async fn endpoint(&self, node: &Node, lease: &LeaseId) -> anyhow::Result<(String, usize)> {
        let mut not_ready = 0;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            match self.run(node.lookup(lease)).await {
                Outcome::Succeeded(f) => {
                    let endpoint = f.endpoint.context("a lookup without an endpoint")?;
                    return Ok((endpoint.as_str().to_owned(), not_ready));
                }
                Outcome::NotReady { .. } => not_ready += 1,
                other => bail!("lookup: {other:?}"),
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "the endpoint never became ready"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn start(
        &self,
        node: &Node,
        lease: &LeaseId,
        endpoint: &str,
        boot: Params,
    ) -> anyhow::Result<SessionId> {
        facts(self.run(node.start(lease, endpoint, boot)).await)?
            .session
            .context("a start without a session")
    }

    /// Observations until one of class `until` (a failure or convergence).
    async fn stages_until(
        &mut self,
        done: impl Fn(BootstrapStage) -> bool,
    ) -> anyhow::Result<Vec<RawObservation>> {
        let mut seen = Vec::new();
        loop {
            let o = tokio::time::timeout(PATIENCE, self.observations.recv())
                .await
                .with_context(|| format!("no further stage after {seen:?}"))?
                .context("the sink closed")?;
            let last = o.stage;
            seen.push(o);
            if done(last) {
                return Ok(seen);
            }
        }
    }

    async fn silent_for(&mut self, quiet: Duration) -> TestResult {
        match tokio::time::timeout(quiet, self.observations.recv()).await {
            Err(_) => Ok(()),
            Ok(got) => bail!("expected no stage, got {got:?}"),
        }
    }

    async fn destroy(&self, node: &Node) -> TestResult {
        let outcome = self.run(node.destroy()).await;
        ensure!(matches!(outcome, Outcome::Succeeded(_)), "destroy: {outcome:?}");
        ensure!(
            !self.backend.dir_of(&node.identity()).exists(),
            "destroy leaves no directory"
        );
        Ok(())
    }

    /// Nothing is left: no directory, no inventory, and every PID the test saw
    /// is gone from the process table (not even a zombie).
    async fn assert_clean(&self) -> TestResult {
        let inventory = self.backend.inventory().await?;
        ensure!(inventory.is_empty(), "inventory after cleanup: {inventory:?}");
        let dirs = self.backend.agents()?;
        ensure!(dirs.is_empty(), "directories after cleanup: {dirs:?}");
        for &pid in &self.pids {
            wait_for(|| !Path::new(&format!("/proc/{pid}")).exists())
                .await
                .with_context(|| format!("agent pid {pid} is still in the process table"))?;
        }
        Ok(())
    }
}

impl Drop for Fixture {
    /// A failed test still leaves no agent behind.
    fn drop(&mut self) {
        if let Ok(entries) = self.backend.agents() {
            for entry in entries {
                for pid in processes_naming(&entry.dir) {
                    kill(pid, rustix::process::Signal::KILL);
                }
            }
        }
    }
}

fn start_backend(root: &Path, agent: PathBuf) -> anyhow::Result<ProcessBackend> {
    let config = ProcessConfig {
        kill_grace: Duration::from_millis(500),
        start_timeout: Duration::from_secs(5),
        ..ProcessConfig::new(root.to_owned(), agent)
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    Ok(ProcessBackend::start(config, clock)?)
}

/// One node slot's attempt, and the operations on it.
struct Node {
    node: LogicalNodeId,
    attempt: u64,
    /// Operations get fresh sequence numbers, as the driver gives them.
    seq: std::sync::atomic::AtomicU32,
    deadline_ms: u64,
}

impl Node {
    fn new(name: &str, attempt: u64) -> anyhow::Result<Self> {
        Ok(Self {
            node: LogicalNodeId::parse("node", name)?,
            attempt,
            seq: std::sync::atomic::AtomicU32::new(0),
            deadline_ms: 10_000,
        })
    }

    fn identity(&self) -> ResourceIdentity {
        ResourceIdentity {
            run_uid: RUN,
            run_id: run_id(),
            node: self.node.clone(),
            attempt: AttemptId::new(self.attempt),
        }
    }

    fn op(&self, input: OperationInput) -> Operation {
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Operation {
            run_uid: RUN,
            run_id: run_id(),
            node: self.node.clone(),
            id: OperationId::new(AttemptId::new(self.attempt), seq),
            epoch: Epoch::new(1),
            deadline: UnixMillis::new(SystemClock.now().as_millis() + self.deadline_ms),
            provider: "process".into(),
            input,
            trace: TraceContext::default(),
        }
    }

    fn create(&self, boot: Params) -> Operation {
        let mut template = example_template("process", "img:1");
        template.boot = boot;
        self.op(OperationInput::CreateLease {
            template: Arc::new(template),
        })
    }

    fn lookup(&self, lease: &LeaseId) -> Operation {
        self.op(OperationInput::LookupEndpoint { lease: lease.clone() })
    }

    fn start(&self, lease: &LeaseId, endpoint: &str, boot: Params) -> Operation {
        self.op(OperationInput::StartBootstrap {
            lease: lease.clone(),
            endpoint: contract::Endpoint::new("endpoint", endpoint).unwrap_or_else(|e| panic!("{e}")),
            boot,
            join: [(
                "cluster".to_owned(),
                Param {
                    value: "c1".to_owned(),
                    secret: false,
                },
            )]
            .into_iter()
            .collect(),
        })
    }

    fn cancel(&self, session: Option<SessionId>) -> Operation {
        self.op(OperationInput::CancelBootstrap { session })
    }

    fn destroy(&self) -> Operation {
        self.op(OperationInput::DestroyLease { lease: None })
    }
}

fn run_id() -> RunId {
    RunId::parse("run_id", "train").unwrap_or_else(|e| panic!("{e}"))
}

fn facts(outcome: Outcome) -> anyhow::Result<ResultFacts> {
    match outcome {
        Outcome::Succeeded(f) => Ok(f),
        other => bail!("expected success, got {other:?}"),
    }
}

fn pid_of(lease: &LeaseId) -> anyhow::Result<i32> {
    Ok(lease
        .as_str()
        .strip_prefix("proc-")
        .context("a lease id that names no process")?
        .parse()?)
}

fn kill(pid: i32, sig: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid).filter(|_| pid > 1) {
        let _ = rustix::process::kill_process(pid, sig);
    }
}

/// Whether `pid` runs (exists and is not a zombie).
fn running(pid: i32) -> bool {
    matches!(read_stat(pid), Ok(Some(stat)) if !stat.has_exited())
}

async fn wait_for(mut condition: impl FnMut() -> bool) -> TestResult {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !condition() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "gave up after {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

fn stages(seen: &[RawObservation]) -> Vec<BootstrapStage> {
    seen.iter().map(|o| o.stage).collect()
}

const HAPPY: [BootstrapStage; 5] = BootstrapStage::PROGRESS;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_a_process_from_create_to_destroy() -> TestResult {
    let mut f = Fixture::new()?;
    let node = Node::new("workers-0", 1)?;
    let (lease, pid) = f
        .create(&node, boot(&[("fault.endpoint_delay_ms", "300")]))
        .await?;
    ensure!(running(pid), "the agent runs");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))?;
    ensure!(
        String::from_utf8_lossy(&cmdline).contains("node-agent"),
        "pid {pid} is a node agent"
    );
    // Its own process group: a Ctrl-C aimed at the executor's does not reach it.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let (_, fields) = stat.rsplit_once(')').context("a malformed stat line")?;
    let pgrp: i32 = fields
        .split_whitespace()
        .nth(2)
        .context("no pgrp field")?
        .parse()?;
    ensure!(pgrp == pid, "the agent leads its own process group, not {pgrp}");

    let (endpoint, not_ready) = f.endpoint(&node, &lease).await?;
    ensure!(
        not_ready > 0,
        "the endpoint is not ready before the agent binds it"
    );
    ensure!(endpoint.starts_with("127.0.0.1:"), "{endpoint}");
    // The endpoint is a real listening socket.
    tokio::net::TcpStream::connect(&endpoint).await?;

    let session = f
        .start(&node, &lease, &endpoint, boot(&[("stage_delay_ms", "10")]))
        .await?;
    let seen = f.stages_until(|s| s == BootstrapStage::Converged).await?;
    ensure!(stages(&seen) == HAPPY, "{seen:?}");
    ensure!(
        seen.iter()
            .all(|o| o.session == session && o.identity == node.identity())
    );
    ensure!(
        seen.windows(2).all(|w| w[0].at <= w[1].at),
        "timestamps move forward: {seen:?}"
    );
    ensure!(
        seen[3].detail.contains("cluster") && seen[2].detail.contains(&pid.to_string()),
        "{seen:?}"
    );

    let inventory = f.backend.inventory().await?;
    ensure!(inventory.len() == 1, "{inventory:?}");
    ensure!(inventory[0].identity == node.identity() && inventory[0].session_live);
    ensure!(inventory[0].lease.as_ref() == Some(&lease));
    ensure!(inventory[0].endpoint.as_ref().map(|e| e.as_str()) == Some(endpoint.as_str()));

    let cancelled = f.run(node.cancel(Some(session))).await;
    ensure!(matches!(cancelled, Outcome::Succeeded(_)), "{cancelled:?}");
    ensure!(!f.backend.inventory().await?[0].session_live);
    f.destroy(&node).await?;
    ensure!(!running(pid), "destroy stops the agent");
    f.silent_for(Duration::from_millis(100)).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_create_adopts_and_absent_cleanup_succeeds() -> TestResult {
    let mut f = Fixture::new()?;
    let node = Node::new("workers-1", 1)?;
    let (lease, pid) = f.create(&node, Params::new()).await?;
    let again = facts(f.run(node.create(Params::new())).await)?;
    ensure!(
        again.lease.as_ref() == Some(&lease),
        "adopted, not doubled: {again:?}"
    );
    // Concurrent creates of one identity are serialised and adopt too.
    let (a, b) = tokio::join!(
        f.run(node.create(Params::new())),
        f.run(node.create(Params::new()))
    );
    ensure!(facts(a)?.lease == Some(lease.clone()) && facts(b)?.lease == Some(lease.clone()));
    let dir = f.backend.dir_of(&node.identity());
    ensure!(processes_naming(&dir) == vec![pid], "one agent for the identity");

    // Another attempt of the same slot is another identity: another agent.
    let other = Node::new("workers-1", 2)?;
    let (other_lease, other_pid) = f.create(&other, Params::new()).await?;
    ensure!(other_lease != lease && other_pid != pid);

    f.destroy(&node).await?;
    f.destroy(&node).await?;
    ensure!(running(other_pid), "destroying one identity leaves the other");
    f.destroy(&other).await?;
    // Never created at all: already absent is success, and so is cancelling.
    let never = Node::new("workers-9", 7)?;
    f.destroy(&never).await?;
    let cancelled = f.run(never.cancel(None)).await;
    ensure!(matches!(cancelled, Outcome::Succeeded(_)), "{cancelled:?}");
    // A lookup of a lease that does not exist is a definite, retryable failure.
    let lookup = f.run(node.lookup(&lease)).await;
    ensure!(matches!(lookup, Outcome::Retryable { .. }), "{lookup:?}");
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_at_reports_the_failed_stage_and_ends_the_session() -> TestResult {
    let mut f = Fixture::new()?;
    let node = Node::new("workers-2", 1)?;
    let (lease, pid) = f.create(&node, Params::new()).await?;
    let (endpoint, _) = f.endpoint(&node, &lease).await?;
    let faults = boot(&[("stage_delay_ms", "5"), ("fault.fail_at", "boot-check")]);
    f.start(&node, &lease, &endpoint, faults).await?;
    let seen = f.stages_until(BootstrapStage::is_failure).await?;
    ensure!(
        stages(&seen) == [BootstrapStage::Connected, BootstrapStage::FailedBootCheck],
        "{seen:?}"
    );
    ensure!(seen[1].detail.contains("fault.fail_at"), "{seen:?}");
    f.silent_for(Duration::from_millis(150)).await?;
    ensure!(running(pid), "a failed stage is not a dead agent");

    // A malformed directive will never work: a permanent failure. (The failed
    // session is cancelled first: a node has one session at a time.)
    let cancelled = f.run(node.cancel(None)).await;
    ensure!(matches!(cancelled, Outcome::Succeeded(_)), "{cancelled:?}");
    let bad = f
        .run(node.start(&lease, &endpoint, boot(&[("fault.hang_at", "never")])))
        .await;
    ensure!(
        matches!(&bad, Outcome::Permanent { reason } if reason.contains("fault.hang_at")),
        "{bad:?}"
    );
    f.destroy(&node).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_kills_the_agent_and_closes_the_session() -> TestResult {
    let mut f = Fixture::new()?;
    let node = Node::new("workers-3", 1)?;
    let (lease, pid) = f.create(&node, Params::new()).await?;
    let (endpoint, _) = f.endpoint(&node, &lease).await?;
    let faults = boot(&[("stage_delay_ms", "5"), ("fault.crash_at", "agent-started")]);
    f.start(&node, &lease, &endpoint, faults).await?;
    let seen = f.stages_until(BootstrapStage::is_failure).await?;
    ensure!(
        stages(&seen)
            == [
                BootstrapStage::Connected,
                BootstrapStage::BootCheck,
                BootstrapStage::FailedClosed
            ],
        "{seen:?}"
    );
    ensure!(
        seen[2].detail.contains("signal 9"),
        "the detail says how it died: {seen:?}"
    );
    // Really gone, and reaped: not even a zombie is left.
    wait_for(|| !Path::new(&format!("/proc/{pid}")).exists()).await?;

    let lookup = f.run(node.lookup(&lease)).await;
    ensure!(
        matches!(&lookup, Outcome::Retryable { reason } if reason.contains("signal 9")),
        "{lookup:?}"
    );
    ensure!(
        f.backend.inventory().await?.is_empty(),
        "a dead agent is no live resource"
    );
    let dirs = f.backend.agents()?;
    ensure!(
        dirs.len() == 1 && !dirs[0].is_alive(),
        "its directory waits for the destroy: {dirs:?}"
    );
    f.destroy(&node).await?;
    f.silent_for(Duration::from_millis(100)).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_bootstrap_closes_the_session() -> TestResult {
    let mut f = Fixture::new()?;
    let node = Node::new("workers-4", 1)?;
    let (lease, pid) = f.create(&node, Params::new()).await?;
    let (endpoint, _) = f.endpoint(&node, &lease).await?;
    let faults = boot(&[("stage_delay_ms", "5"), ("fault.hang_at", "joined")]);
    f.start(&node, &lease, &endpoint, faults).await?;
    let seen = f.stages_until(|s| s == BootstrapStage::AgentStarted).await?;
    ensure!(seen.len() == 3, "{seen:?}");
    kill(pid, rustix::process::Signal::KILL);
    let closed = f.stages_until(|_| true).await?;
    ensure!(closed[0].stage == BootstrapStage::FailedClosed, "{closed:?}");
    f.destroy(&node).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_at_stops_the_stream_until_cancelled() -> TestResult {
    let mut f = Fixture::new()?;
    let node = Node::new("workers-5", 1)?;
    let (lease, pid) = f.create(&node, Params::new()).await?;
    let (endpoint, _) = f.endpoint(&node, &lease).await?;
    let faults = boot(&[("stage_delay_ms", "5"), ("fault.hang_at", "joined")]);
    let session = f.start(&node, &lease, &endpoint, faults).await?;
    let seen = f.stages_until(|s| s == BootstrapStage::AgentStarted).await?;
    ensure!(stages(&seen) == HAPPY[..3], "{seen:?}");
    f.silent_for(Duration::from_millis(300)).await?;
    let dir = f.backend.dir_of(&node.identity());
    let record: SessionRecord = read_json(&dir, SESSION_RECORD)?.context("no session record")?;
    ensure!(record.status == SessionStatus::Hung, "{record:?}");
    ensure!(running(pid) && f.backend.inventory().await?[0].session_live);

    let cancelled = f.run(node.cancel(Some(session))).await;
    ensure!(matches!(cancelled, Outcome::Succeeded(_)), "{cancelled:?}");
    let record: SessionRecord = read_json(&dir, SESSION_RECORD)?.context("no session record")?;
    ensure!(record.status == SessionStatus::Cancelled, "{record:?}");
    // A cancelled session reports nothing more, and cancelling again is fine.
    f.silent_for(Duration::from_millis(100)).await?;
    let again = f.run(node.cancel(None)).await;
    ensure!(matches!(again, Outcome::Succeeded(_)), "{again:?}");
    f.destroy(&node).await?;
    f.silent_for(Duration::from_millis(100)).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_backend_adopts_agents_and_replays_their_sessions() -> TestResult {
    let mut f = Fixture::new()?;
    let node = Node::new("workers-6", 1)?;
    let (lease, pid) = f.create(&node, Params::new()).await?;
    let (endpoint, _) = f.endpoint(&node, &lease).await?;
    let slow = boot(&[("stage_delay_ms", "150")]);
    let session = f.start(&node, &lease, &endpoint, slow.clone()).await?;
    let before = f.stages_until(|s| s == BootstrapStage::BootCheck).await?;

    // The executor goes away; the agent and its session do not.
    f.restart()?;
    ensure!(running(pid), "the agent outlives its executor");
    let adopted = facts(f.run(node.create(Params::new())).await)?;
    ensure!(adopted.lease == Some(lease.clone()), "{adopted:?}");
    ensure!(adopted.endpoint.as_ref().map(|e| e.as_str()) == Some(endpoint.as_str()));
    let dir = f.backend.dir_of(&node.identity());
    ensure!(processes_naming(&dir) == vec![pid], "adopted, not doubled");

    f.backend.resume(f.sink.clone());
    let after = f.stages_until(|s| s == BootstrapStage::Converged).await?;
    ensure!(
        stages(&after) == HAPPY,
        "the whole log again, in order: {after:?}"
    );
    // The same stages with the same times: replayed from the agent's log, not
    // run again, so the executor numbers them as it did before.
    ensure!(after[..before.len()] == before[..], "{before:?} vs {after:?}");
    ensure!(after.iter().all(|o| o.session == session));

    // The driver resubmits its start: the session is adopted and nothing is
    // streamed twice.
    let restarted = f.start(&node, &lease, &endpoint, slow).await?;
    ensure!(restarted == session);
    f.silent_for(Duration::from_millis(300)).await?;
    f.destroy(&node).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_died_while_the_executor_was_away_fails_its_session() -> TestResult {
    let mut f = Fixture::new()?;
    let node = Node::new("workers-7", 1)?;
    let (lease, pid) = f.create(&node, Params::new()).await?;
    let (endpoint, _) = f.endpoint(&node, &lease).await?;
    let faults = boot(&[("stage_delay_ms", "5"), ("fault.hang_at", "joined")]);
    f.start(&node, &lease, &endpoint, faults).await?;
    let before = f.stages_until(|s| s == BootstrapStage::AgentStarted).await?;
    f.restart()?;
    kill(pid, rustix::process::Signal::KILL);
    wait_for(|| !running(pid)).await?;

    f.backend.resume(f.sink.clone());
    let after = f.stages_until(BootstrapStage::is_failure).await?;
    ensure!(after[..before.len()] == before[..], "{after:?}");
    ensure!(
        after.len() == before.len() + 1 && after[before.len()].stage == BootstrapStage::FailedClosed,
        "the recorded log, then the failure: {after:?}"
    );
    // Re-creating a dead identity starts a fresh agent in its place.
    let (fresh, fresh_pid) = f.create(&node, Params::new()).await?;
    ensure!(fresh != lease && fresh_pid != pid && running(fresh_pid));
    f.destroy(&node).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_agent_makes_a_start_ambiguous_and_is_still_destroyed() -> TestResult {
    let mut f = Fixture::new()?;
    let mut node = Node::new("workers-8", 1)?;
    let (lease, pid) = f.create(&node, Params::new()).await?;
    let (endpoint, _) = f.endpoint(&node, &lease).await?;
    kill(pid, rustix::process::Signal::STOP);
    wait_for(|| matches!(read_stat(pid), Ok(Some(s)) if s.state == 'T')).await?;
    node.deadline_ms = 600;
    // The kernel accepts the connection for a stopped process; nobody answers.
    let outcome = f.run(node.start(&lease, &endpoint, Params::new())).await;
    ensure!(matches!(outcome, Outcome::Ambiguous { .. }), "{outcome:?}");
    // Cleanup cancels the ambiguous bootstrap. The agent cannot answer, so the
    // executor ends the session on its own side, and cleanup goes on.
    let cancelled = f.run(node.cancel(None)).await;
    ensure!(matches!(cancelled, Outcome::Succeeded(_)), "{cancelled:?}");
    ensure!(
        matches!(read_stat(pid), Ok(Some(s)) if s.state == 'T'),
        "the agent is still stopped"
    );
    node.deadline_ms = 10_000;
    f.destroy(&node).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_agent_mid_session_is_cancelled_from_the_executor_side() -> TestResult {
    let mut f = Fixture::new()?;
    let mut node = Node::new("workers-9", 1)?;
    let (lease, pid) = f.create(&node, Params::new()).await?;
    let (endpoint, _) = f.endpoint(&node, &lease).await?;
    let slow = boot(&[("stage_delay_ms", "300")]);
    let session = f.start(&node, &lease, &endpoint, slow).await?;
    f.stages_until(|s| s == BootstrapStage::Connected).await?;
    kill(pid, rustix::process::Signal::STOP);
    wait_for(|| matches!(read_stat(pid), Ok(Some(s)) if s.state == 'T')).await?;
    let dir = f.backend.dir_of(&node.identity());
    let record: SessionRecord = read_json(&dir, SESSION_RECORD)?.context("no session record")?;
    ensure!(record.status == SessionStatus::Running, "{record:?}");

    node.deadline_ms = 800;
    let cancelled = f.run(node.cancel(Some(session))).await;
    ensure!(matches!(cancelled, Outcome::Succeeded(_)), "{cancelled:?}");
    // Stages relayed before the cancel are the session's; none may follow it.
    while f.observations.try_recv().is_ok() {}
    // The cancel waits on the agent's socket: once the agent runs again it
    // ends the session, and the executor relays nothing more of it.
    kill(pid, rustix::process::Signal::CONT);
    wait_for(|| {
        read_json::<SessionRecord>(&dir, SESSION_RECORD)
            .is_ok_and(|r| r.is_some_and(|r| r.status == SessionStatus::Cancelled))
    })
    .await
    .context("the agent never acted on the queued cancel")?;
    f.silent_for(Duration::from_millis(700)).await?;
    node.deadline_ms = 10_000;
    f.destroy(&node).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_agent_binary_is_a_permanent_failure() -> TestResult {
    let f = Fixture::with_agent(PathBuf::from("/nonexistent/node-agent"))?;
    let node = Node::new("workers-0", 1)?;
    let outcome = f.run(node.create(Params::new())).await;
    ensure!(
        matches!(&outcome, Outcome::Permanent { reason } if reason.contains("/nonexistent/node-agent")),
        "{outcome:?}"
    );
    f.destroy(&node).await?;
    f.assert_clean().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_never_records_itself_is_held_as_the_lease_and_never_doubled() -> TestResult {
    // A stand-in agent that runs with the real agent's arguments but never
    // writes its record (as a real one stopped before it could): the create
    // holds the live process as the identity's lease, not ready.
    let scripts = tempfile::tempdir()?;
    let script = scripts.path().join("silent-agent");
    std::fs::write(
        &script,
        "#!/bin/sh\ntrap 'exit 0' TERM\nwhile :; do sleep 0.05; done\n",
    )?;
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let f = Fixture::with_agent(script)?;
    let mut node = Node::new("workers-0", 1)?;
    node.deadline_ms = 700;
    let first = facts(f.run(node.create(Params::new())).await)?;
    let dir = f.backend.dir_of(&node.identity());
    let spawned = processes_naming(&dir);
    ensure!(spawned.len() == 1, "{spawned:?}");
    let lease = first.lease.clone().context("a lease")?;
    ensure!(
        pid_of(&lease)? == spawned[0] && first.endpoint.is_none(),
        "{first:?}"
    );
    // The re-issued create adopts the same process instead of spawning.
    let second = facts(f.run(node.create(Params::new())).await)?;
    ensure!(second.lease == Some(lease.clone()), "{second:?}");
    ensure!(
        processes_naming(&dir) == spawned,
        "never two processes for one identity"
    );
    // Not ready, which is not a failure.
    let lookup = f.run(node.lookup(&lease)).await;
    ensure!(matches!(lookup, Outcome::NotReady { .. }), "{lookup:?}");
    node.deadline_ms = 10_000;
    f.destroy(&node).await?;
    ensure!(processes_naming(&dir).is_empty());
    let mut f = f;
    f.pids = spawned;
    f.assert_clean().await
}
