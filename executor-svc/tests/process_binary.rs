//! The real `executor-svc` binary with `--backend process`, driven over gRPC as
//! a driver drives it: claim, submit, read results and observations. One test
//! kills the executor with SIGKILL mid-bootstrap and starts another over the
//! same state directory, which adopts the agent and replays its stages with the
//! same sequence numbers.
//!
//! An agent whose executor was killed is re-parented to the nearest subreaper:
//! this test process makes itself one, so such an agent never becomes a zombie
//! of init that nobody reaps, and the test reaps it itself.

// The tests wait for real processes in real time.
#![allow(clippy::disallowed_methods)]

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};
use contract::{
    AttemptId, Clock, Endpoint, Epoch, LeaseId, LogicalNodeId, Operation, OperationId, OperationInput,
    OperationResult, Outcome, Param, Params, RunId, RunUid, SessionId, SystemClock, TraceContext, UnixMillis,
    pb::{self, executor_client::ExecutorClient, executor_message::Kind},
    shape::example_template,
};
use executor_svc::process::registry::{processes_naming, read_stat};
use tokio::{
    process::{Child, Command},
    sync::mpsc,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

type TestResult = anyhow::Result<()>;

const EXECUTOR: &str = env!("CARGO_BIN_EXE_executor-svc");
const AGENT: &str = env!("CARGO_BIN_EXE_node-agent");
const RUN: RunUid = RunUid::from_u128(0xb1_0000_0000_0000_0000_0000_0000_0002);
const PATIENCE: Duration = Duration::from_secs(15);

/// One `executor-svc` process.
struct Executor {
    child: Child,
    addr: SocketAddr,
}

impl Executor {
    async fn start(dir: &Path, root: &Path) -> anyhow::Result<Self> {
        let ready = dir.join("executor.ready");
        let _ = std::fs::remove_file(&ready);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("executor.log"))?;
        let mut child = Command::new(EXECUTOR)
            .args(["--listen", "127.0.0.1:0", "--insecure", "--backend", "process"])
            .arg("--ready-file")
            .arg(&ready)
            .arg("--process-state-dir")
            .arg(root)
            .arg("--node-agent-path")
            .arg(AGENT)
            .args(["--process-kill-grace-ms", "500"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()?;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        let addr = loop {
            if let Ok(s) = std::fs::read_to_string(&ready)
                && let Ok(addr) = s.trim().parse()
            {
                break addr;
            }
            if let Some(status) = child.try_wait()? {
                bail!(
                    "executor-svc exited early ({status}); see {}",
                    dir.join("executor.log").display()
                );
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "executor-svc never became ready"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        Ok(Self { child, addr })
    }

    async fn link(&self) -> anyhow::Result<Link> {
        let mut client = ExecutorClient::connect(format!("http://{}", self.addr)).await?;
        let (tx, rx) = mpsc::channel(64);
        let inbound = client.link(ReceiverStream::new(rx)).await?.into_inner();
        Ok(Link {
            tx,
            inbound,
            client,
            next_seq: 0,
        })
    }

    fn signal(&self, sig: rustix::process::Signal) -> TestResult {
        let pid = self.child.id().context("the executor has exited")?;
        kill(i32::try_from(pid)?, sig);
        Ok(())
    }
}

/// One driver link, for node `workers-0` attempt 1 of [`RUN`].
struct Link {
    tx: mpsc::Sender<pb::DriverMessage>,
    inbound: Streaming<pb::ExecutorMessage>,
    client: ExecutorClient<tonic::transport::Channel>,
    next_seq: u32,
}

impl Link {
    async fn send(&self, kind: pb::driver_message::Kind) -> TestResult {
        let msg = pb::DriverMessage {
            kind: Some(kind),
            trace: None,
        };
        self.tx.send(msg).await.context("the link is closed")
    }

    async fn claim(&mut self, epoch: u64) -> TestResult {
        self.send(pb::driver_message::Kind::Claim(pb::Claim {
            run_uid: RUN.to_string(),
            run_id: "train".to_owned(),
            epoch,
        }))
        .await?;
        match self.next().await? {
            Kind::Claimed(c) if c.epoch == epoch => Ok(()),
            other => bail!("expected the claim accepted, got {other:?}"),
        }
    }

    /// The next message about the run. What the executor serves (its first
    /// message on every link) must name the process backend, and is
    /// otherwise not this test's subject.
    async fn next(&mut self) -> anyhow::Result<Kind> {
        loop {
            let kind = match tokio::time::timeout(PATIENCE, self.inbound.message()).await {
                Err(_) => bail!("no message within {PATIENCE:?}"),
                Ok(Err(status)) => bail!("the link failed: {status}"),
                Ok(Ok(None)) => bail!("the link ended"),
                Ok(Ok(Some(msg))) => msg.kind.context("a message without a kind")?,
            };
            match kind {
                Kind::Providers(p) => {
                    let names: Vec<&str> = p.providers.iter().map(|p| p.name.as_str()).collect();
                    anyhow::ensure!(names == ["process"], "the executor serves {names:?}");
                }
                other => return Ok(other),
            }
        }
    }

    /// Asks for a session's stages after `seq`, as a reconnecting driver does.
    async fn observe_from(&self, session: &SessionId, seq: u64) -> TestResult {
        self.send(pb::driver_message::Kind::ObserveFrom(pb::ObserveFrom {
            run_uid: RUN.to_string(),
            after: vec![pb::ObservationRef {
                run_uid: RUN.to_string(),
                session_id: session.to_string(),
                seq,
            }],
        }))
        .await
    }

    /// Submits an operation with the next sequence number; returns its id.
    async fn submit(&mut self, epoch: u64, input: OperationInput) -> anyhow::Result<OperationId> {
        let id = OperationId::new(AttemptId::new(1), self.next_seq);
        self.next_seq += 1;
        self.resubmit(epoch, id, input).await?;
        Ok(id)
    }

    async fn resubmit(&mut self, epoch: u64, id: OperationId, input: OperationInput) -> TestResult {
        let op = Operation {
            run_uid: RUN,
            run_id: RunId::parse("run_id", "train")?,
            node: LogicalNodeId::parse("node", "workers-0")?,
            id,
            epoch: Epoch::new(epoch),
            deadline: UnixMillis::new(SystemClock.now().as_millis() + 10_000),
            provider: "process".into(),
            input,
            trace: TraceContext::default(),
        };
        self.send(pb::driver_message::Kind::Submit(pb::Operation::from(&op)))
            .await
    }

    /// The result of `id`, collecting the observations that arrive before it.
    async fn result(
        &mut self,
        id: OperationId,
        seen: &mut Vec<pb::BootstrapObservation>,
    ) -> anyhow::Result<Outcome> {
        loop {
            match self.next().await? {
                Kind::Result(r) => {
                    let result = OperationResult::try_from(r)?;
                    if result.id == id {
                        return Ok(result.outcome);
                    }
                }
                Kind::Observation(o) => seen.push(o),
                other => bail!("unexpected {other:?}"),
            }
        }
    }

    /// Observations until `stage` arrives.
    async fn observations_until(
        &mut self,
        stage: pb::BootstrapStage,
        seen: &mut Vec<pb::BootstrapObservation>,
    ) -> TestResult {
        while !seen.iter().any(|o| o.stage == stage as i32) {
            match self.next().await? {
                Kind::Observation(o) => seen.push(o),
                Kind::Result(_) => {}
                other => bail!("unexpected {other:?}"),
            }
        }
        Ok(())
    }

    async fn inventory(&mut self) -> anyhow::Result<Vec<pb::Resource>> {
        let request = pb::InventoryRequest {
            run_uid: RUN.to_string(),
        };
        Ok(self.client.inventory(request).await?.into_inner().resources)
    }
}

fn params(pairs: &[(&str, &str)]) -> Params {
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

fn create_input(boot: Params) -> OperationInput {
    let mut template = example_template("process", "img:1");
    template.boot = boot;
    OperationInput::CreateLease {
        template: Arc::new(template),
    }
}

fn succeeded(outcome: Outcome) -> anyhow::Result<contract::ResultFacts> {
    match outcome {
        Outcome::Succeeded(facts) => Ok(facts),
        other => bail!("expected success, got {other:?}"),
    }
}

fn kill(pid: i32, sig: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid).filter(|_| pid > 1) {
        let _ = rustix::process::kill_process(pid, sig);
    }
}

fn pid_of(lease: &LeaseId) -> anyhow::Result<i32> {
    Ok(lease
        .as_str()
        .strip_prefix("proc-")
        .context("a lease that names no process")?
        .parse()?)
}

fn running(pid: i32) -> bool {
    matches!(read_stat(pid), Ok(Some(stat)) if !stat.has_exited())
}

/// Waits until `pid` has left the process table, reaping it if it became our
/// child (an orphan re-parented to this subreaper).
async fn gone(pid: i32) -> TestResult {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while Path::new(&format!("/proc/{pid}")).exists() {
        if let Some(p) = rustix::process::Pid::from_raw(pid) {
            let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG);
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "pid {pid} is still in the process table"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// The test's directory and state root; on drop, kills and reaps any agent
/// the test left behind.
struct Scratch {
    dir: tempfile::TempDir,
    pids: Vec<i32>,
}

impl Scratch {
    fn new() -> anyhow::Result<Self> {
        // Agents of a killed executor are re-parented here rather than to init.
        rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
        let dir = tempfile::tempdir()?;
        std::fs::create_dir_all(dir.path().join("agents"))?;
        Ok(Self {
            dir,
            pids: Vec::new(),
        })
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("agents")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir(self.root()) {
            for entry in entries.flatten() {
                self.pids.extend(processes_naming(&entry.path()));
            }
        }
        for &pid in &self.pids {
            kill(pid, rustix::process::Signal::KILL);
            if let Some(p) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::empty());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_executor_binary_runs_leases_as_processes() -> TestResult {
    let mut scratch = Scratch::new()?;
    let mut executor = Executor::start(scratch.dir.path(), &scratch.root()).await?;
    let mut link = executor.link().await?;
    link.claim(1).await?;
    let mut seen = Vec::new();

    let create = link
        .submit(1, create_input(params(&[("fault.endpoint_delay_ms", "200")])))
        .await?;
    let lease = succeeded(link.result(create, &mut seen).await?)?
        .lease
        .context("no lease")?;
    let pid = pid_of(&lease)?;
    scratch.pids.push(pid);
    ensure!(running(pid));

    let mut not_ready = 0;
    let endpoint = loop {
        let lookup = link
            .submit(1, OperationInput::LookupEndpoint { lease: lease.clone() })
            .await?;
        match link.result(lookup, &mut seen).await? {
            Outcome::Succeeded(facts) => break facts.endpoint.context("no endpoint")?,
            Outcome::NotReady { .. } => not_ready += 1,
            other => bail!("lookup: {other:?}"),
        }
        ensure!(not_ready < 500, "the endpoint never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ensure!(not_ready > 0, "not ready before the agent binds");

    let start = link
        .submit(
            1,
            OperationInput::StartBootstrap {
                lease: lease.clone(),
                endpoint: endpoint.clone(),
                boot: params(&[("stage_delay_ms", "10")]),
                join: Params::new(),
            },
        )
        .await?;
    let session = succeeded(link.result(start, &mut seen).await?)?
        .session
        .context("no session")?;
    link.observations_until(pb::BootstrapStage::Converged, &mut seen)
        .await?;
    let seqs: Vec<u64> = seen.iter().map(|o| o.seq).collect();
    ensure!(seqs == [1, 2, 3, 4, 5], "{seen:?}");
    ensure!(seen.iter().all(|o| o.session_id == session.as_str()));

    let inventory = link.inventory().await?;
    ensure!(
        inventory.len() == 1 && inventory[0].lease_id == lease.as_str() && inventory[0].session_live,
        "{inventory:?}"
    );

    let cancel = link
        .submit(
            1,
            OperationInput::CancelBootstrap {
                session: Some(session),
            },
        )
        .await?;
    succeeded(link.result(cancel, &mut seen).await?)?;
    let destroy = link
        .submit(1, OperationInput::DestroyLease { lease: Some(lease) })
        .await?;
    succeeded(link.result(destroy, &mut seen).await?)?;
    gone(pid).await?;
    ensure!(link.inventory().await?.is_empty());
    ensure!(
        std::fs::read_dir(scratch.root())?.next().is_none(),
        "no directory is left"
    );

    executor.signal(rustix::process::Signal::TERM)?;
    let status = tokio::time::timeout(PATIENCE, executor.child.wait()).await??;
    ensure!(
        status.success(),
        "the executor exits cleanly on SIGTERM: {status}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_executor_is_replaced_and_the_new_one_adopts_its_agents() -> TestResult {
    let mut scratch = Scratch::new()?;
    let executor = Executor::start(scratch.dir.path(), &scratch.root()).await?;
    let mut link = executor.link().await?;
    link.claim(1).await?;
    let mut seen = Vec::new();

    let create = link.submit(1, create_input(Params::new())).await?;
    let facts = succeeded(link.result(create, &mut seen).await?)?;
    let lease = facts.lease.context("no lease")?;
    let pid = pid_of(&lease)?;
    scratch.pids.push(pid);
    let endpoint: Endpoint = match facts.endpoint {
        Some(endpoint) => endpoint,
        None => loop {
            let lookup = link
                .submit(1, OperationInput::LookupEndpoint { lease: lease.clone() })
                .await?;
            if let Outcome::Succeeded(f) = link.result(lookup, &mut seen).await? {
                break f.endpoint.context("no endpoint")?;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        },
    };
    let start_input = OperationInput::StartBootstrap {
        lease: lease.clone(),
        endpoint,
        boot: params(&[("stage_delay_ms", "250")]),
        join: Params::new(),
    };
    let start = link.submit(1, start_input.clone()).await?;
    let session: SessionId = succeeded(link.result(start, &mut seen).await?)?
        .session
        .context("no session")?;
    link.observations_until(pb::BootstrapStage::BootCheck, &mut seen)
        .await?;
    let before = seen.clone();

    // SIGKILL: the executor gets no chance to do anything. The agent lives on.
    let next_seq = link.next_seq;
    executor.signal(rustix::process::Signal::KILL)?;
    drop(link);
    drop(executor);
    tokio::time::sleep(Duration::from_millis(100)).await;
    ensure!(running(pid), "the agent outlives its executor");

    let executor = Executor::start(scratch.dir.path(), &scratch.root()).await?;
    let mut link = executor.link().await?;
    link.claim(2).await?;
    // The driver resubmits its create: it adopts (or, with a durable executor,
    // replays): the same lease, still one process.
    link.next_seq = next_seq;
    link.resubmit(2, create, create_input(Params::new())).await?;
    let mut after = Vec::new();
    let adopted = succeeded(link.result(create, &mut after).await?)?;
    ensure!(adopted.lease == Some(lease.clone()), "{adopted:?}");
    // A reconnecting driver asks for its sessions from the last folded stage
    // (none acknowledged here, so from the start).
    link.observe_from(&session, 0).await?;
    let dirs: Vec<_> = std::fs::read_dir(scratch.root())?.flatten().collect();
    ensure!(dirs.len() == 1 && processes_naming(&dirs[0].path()) == vec![pid]);

    link.observations_until(pb::BootstrapStage::Converged, &mut after)
        .await?;
    let seqs: Vec<u64> = after.iter().map(|o| o.seq).collect();
    ensure!(seqs == [1, 2, 3, 4, 5], "{after:?}");
    for (old, new) in before.iter().zip(&after) {
        ensure!(
            old.seq == new.seq && old.stage == new.stage && old.at_ms == new.at_ms,
            "a replay, not a rerun: {old:?} vs {new:?}"
        );
    }
    ensure!(after.iter().all(|o| o.session_id == session.as_str()));

    // The driver's pending start, resubmitted: the session is adopted.
    link.resubmit(2, start, start_input).await?;
    let mut extra = Vec::new();
    let restarted = succeeded(link.result(start, &mut extra).await?)?;
    ensure!(restarted.session == Some(session), "{restarted:?}");
    ensure!(extra.is_empty(), "nothing streamed twice: {extra:?}");

    let destroy = link
        .submit(2, OperationInput::DestroyLease { lease: None })
        .await?;
    succeeded(link.result(destroy, &mut extra).await?)?;
    // The agent was re-parented to this test process; it reaps it.
    gone(pid).await?;
    ensure!(std::fs::read_dir(scratch.root())?.next().is_none());
    Ok(())
}
