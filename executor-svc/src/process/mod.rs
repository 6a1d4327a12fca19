//! The process backend: every lease is a real child process, a node agent
//! ([`agent`], the `node-agent` binary), with a TCP endpoint on loopback and a
//! bootstrap session streamed over it; faults are real signals and real errors.
//!
//! Layout: [`agent_protocol`] is the wire protocol and the records an agent's
//! state directory holds, [`registry`] reads those directories and decides
//! whether an agent is alive (never by PID alone), [`agent`] is the agent
//! program, `relay` turns a session's stage stream into observations, and this
//! module is the [`Backend`] itself.
//!
//! Each identity `(run_uid, run_id, node, attempt)` owns one directory under the
//! root state directory. Every request is keyed on it, so the directory, not
//! the executor's memory, is the source of truth: an executor that restarts
//! over the same root finds the live agents, adopts them on the next create, and
//! re-attaches to their sessions in [`Backend::resume`]. Agents are spawned in a
//! process group of their own and are not killed when the executor's handle to
//! them drops, so they outlive the executor; agents this executor spawned are
//! reaped by a waiter task, so none stays a zombie.
//!
//! **Architecture Invariant:** at most one live agent per identity. Operations
//! on one identity are serialised by a per-identity lock, and a create spawns
//! only after it has found no live agent for the directory by its records or by
//! a `/proc` scan for the directory on an agent's command line.
//!
//! Outcome classes are honest: a missing agent binary is `Permanent`; a failure
//! that definitely left nothing behind (nothing spawned, the agent is dead, the
//! connection was refused) is `Retryable`; a request that may have taken effect
//! but got no answer (a start sent but unanswered) is `Ambiguous`. A spawned
//! agent that has not recorded itself by the create's deadline is still the
//! identity's one live process: the create holds it as the lease, and lookups
//! say it is not ready until it records its endpoint. A cancel is the
//! exception: the session is ended on the executor's side when the agent does
//! not answer (see `Shared::cancel`), so cleanup always reaches the destroy.

pub mod agent;
pub mod agent_protocol;
mod exits;
pub mod registry;
mod relay;

use std::{
    collections::HashMap,
    io,
    os::unix::process::ExitStatusExt as _,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use contract::{
    Clock, Endpoint, LeaseId, NodeTemplate, Operation, OperationInput, Outcome, Params, ResourceIdentity,
    ResultFacts, SessionId, UnixMillis,
};
use futures::future::BoxFuture;
use tokio::{
    io::{AsyncWriteExt as _, BufReader},
    net::TcpStream,
    sync::watch,
    task::AbortHandle,
};

use self::{
    agent_protocol::{
        AGENT_LOG, IdentityRecord, KnownSession, LAUNCH_RECORD, LaunchRecord, RECORD_VERSION, Reply, Request,
        endpoint_delay_ms, params_to_wire, read_message, to_line, write_json,
    },
    registry::{AgentEntry, STATE_DIR_FLAG, clear_records, dir_name, inspect, processes_naming, read_stat},
    relay::{Connection, Relay},
};
use crate::backend::{Backend, BackendError, ChangeSink, InventoryItem, ObservationSink};

/// The agent binary's name, looked up next to the executor's own binary.
pub const AGENT_BINARY: &str = "node-agent";

/// Reason of a request for a lease this backend does not hold.
const NO_SUCH_LEASE: &str = "no such lease";

/// How often waits on a process or a record look again.
const POLL: Duration = Duration::from_millis(10);

/// How long an agent gets to die after SIGKILL before the destroy is reported
/// as failed.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How much before an operation's deadline the backend gives up waiting and
/// answers itself, so its own (more precise) reason reaches the driver rather
/// than the core's generic abandonment.
const DEADLINE_MARGIN: Duration = Duration::from_millis(100);

/// The longest a cancel waits for the agent's answer (the operation's deadline
/// may cut it shorter) before the executor ends the session on its own side. A
/// running agent answers at once.
const CANCEL_WAIT: Duration = Duration::from_secs(5);

/// How the process backend runs.
#[derive(Debug, Clone)]
pub struct ProcessConfig {
    /// The root under which each identity gets its directory.
    pub state_dir: PathBuf,
    /// The `node-agent` binary.
    pub agent_path: PathBuf,
    /// How long a destroyed agent gets between SIGTERM and SIGKILL.
    pub kill_grace: Duration,
    /// The longest a create waits for a new agent to record itself (the
    /// operation's deadline may cut it shorter); past it the create holds
    /// the live agent as its lease, not ready yet.
    pub start_timeout: Duration,
}

impl ProcessConfig {
    /// A configuration with the default grace (2 s) and start timeout (10 s).
    pub fn new(state_dir: PathBuf, agent_path: PathBuf) -> Self {
        Self {
            state_dir,
            agent_path,
            kill_grace: Duration::from_secs(2),
            start_timeout: Duration::from_secs(10),
        }
    }

    /// The default root: a directory under the system's temporary directory.
    pub fn default_state_dir() -> PathBuf {
        std::env::temp_dir().join("provisioning-executor-process")
    }

    /// The `node-agent` binary next to the running executable, where cargo and
    /// installs put the crate's binaries side by side.
    pub fn agent_next_to_current_exe() -> io::Result<PathBuf> {
        let exe = std::env::current_exe()?;
        let dir = exe
            .parent()
            .ok_or_else(|| io::Error::other("the current executable has no parent directory"))?;
        Ok(dir.join(AGENT_BINARY))
    }
}

/// What stops the process backend from starting.
#[derive(Debug, thiserror::Error)]
pub enum ProcessBackendError {
    #[error("cannot create the process backend's state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The process backend; cheap to clone. Dropping the last handle stops its
/// session relays (the agents keep running).
#[derive(Debug, Clone)]
pub struct ProcessBackend {
    shared: Arc<Shared>,
    _guard: Arc<StopRelaysOnDrop>,
}

#[derive(Debug)]
struct StopRelaysOnDrop(Arc<Shared>);

impl Drop for StopRelaysOnDrop {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::SeqCst);
        let mut relays = self.0.relays();
        for relay in relays.by_identity.values_mut() {
            relay.stop();
        }
        for task in relays.other_tasks.drain(..) {
            task.abort();
        }
        drop(relays);
        lock(&self.0.watches).stop();
    }
}

#[derive(Debug)]
struct Shared {
    config: ProcessConfig,
    clock: Arc<dyn Clock>,
    /// Serialises the operations (and the resume) of one identity.
    locks: Mutex<HashMap<ResourceIdentity, Arc<tokio::sync::Mutex<()>>>>,
    relays: Mutex<Relays>,
    /// Agents this process spawned and whose identity was not destroyed yet,
    /// each with a watch that turns `Some(how it ended)` once it is reaped.
    children: Mutex<HashMap<i32, watch::Receiver<Option<String>>>>,
    /// The watchers of live agents (`exits`).
    watches: Mutex<exits::Watches>,
    /// Set when the last handle dropped: no new relay starts.
    stopped: AtomicBool,
}

/// The sessions this executor relays, by identity.
#[derive(Debug, Default)]
struct Relays {
    by_identity: HashMap<ResourceIdentity, Relay>,
    next_token: u64,
    /// Tasks that are not one session's relay (the resume scan).
    other_tasks: Vec<AbortHandle>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means a task panicked mid-step; every step leaves the
    // maps consistent, so they are used.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ProcessBackend {
    /// Starts the backend over `config.state_dir` (created if missing). A
    /// missing agent binary is logged here and reported as a permanent failure
    /// by each create, so a misconfigured executor still serves cleanup.
    pub fn start(mut config: ProcessConfig, clock: Arc<dyn Clock>) -> Result<Self, ProcessBackendError> {
        let state_error = |source| ProcessBackendError::StateDir {
            path: config.state_dir.clone(),
            source,
        };
        std::fs::create_dir_all(&config.state_dir).map_err(state_error)?;
        // Canonical, so that the `--state-dir` an agent was started with is
        // spelled exactly as the liveness check looks for it.
        let root = std::fs::canonicalize(&config.state_dir).map_err(state_error)?;
        config.state_dir = root;
        if !config.agent_path.is_file() {
            tracing::error!(
                path = %config.agent_path.display(),
                "the node agent binary does not exist; every create will fail permanently"
            );
        }
        let shared = Arc::new(Shared {
            config,
            clock,
            locks: Mutex::new(HashMap::new()),
            relays: Mutex::new(Relays::default()),
            children: Mutex::new(HashMap::new()),
            watches: Mutex::new(exits::Watches::default()),
            stopped: AtomicBool::new(false),
        });
        Ok(Self {
            _guard: Arc::new(StopRelaysOnDrop(Arc::clone(&shared))),
            shared,
        })
    }

    /// The root state directory (canonical).
    pub fn state_dir(&self) -> &Path {
        &self.shared.config.state_dir
    }

    /// The directory of one identity.
    pub fn dir_of(&self, identity: &ResourceIdentity) -> PathBuf {
        self.shared.dir_of(identity)
    }

    /// Every identity directory with its records and liveness, dead agents
    /// included (they stay until a destroy removes them), for checks and
    /// operators.
    pub fn agents(&self) -> io::Result<Vec<AgentEntry>> {
        registry::scan(&self.shared.config.state_dir)
    }
}

impl Shared {
    fn relays(&self) -> MutexGuard<'_, Relays> {
        lock(&self.relays)
    }

    fn dir_of(&self, identity: &ResourceIdentity) -> PathBuf {
        self.config.state_dir.join(dir_name(identity))
    }

    fn identity_lock(&self, identity: &ResourceIdentity) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(lock(&self.locks).entry(identity.clone()).or_default())
    }

    /// Drops a destroyed identity's lock, unless another operation holds or
    /// awaits it (that one would otherwise run beside a newcomer that made a
    /// fresh lock). The caller holds one reference and the map another.
    fn release_identity(&self, identity: &ResourceIdentity) {
        let mut locks = lock(&self.locks);
        if locks.get(identity).is_some_and(|l| Arc::strong_count(l) <= 2) {
            locks.remove(identity);
        }
    }

    /// Time left before `deadline`, less the margin the backend keeps to answer
    /// itself.
    fn time_left(&self, deadline: UnixMillis) -> Duration {
        deadline
            .saturating_since(self.clock.now())
            .saturating_sub(DEADLINE_MARGIN)
    }

    async fn execute(self: Arc<Self>, op: Operation, sink: ObservationSink) -> Outcome {
        let identity = op.identity();
        let guard = self.identity_lock(&identity);
        let _held = guard.lock().await;
        match &op.input {
            OperationInput::CreateLease { template } => {
                let outcome = self.create(&identity, template, op.deadline).await;
                if matches!(outcome, Outcome::Succeeded(_)) {
                    self.watch_identity(&identity);
                }
                outcome
            }
            OperationInput::LookupEndpoint { lease } => self.lookup(&identity, lease),
            OperationInput::StartBootstrap {
                lease, boot, join, ..
            } => {
                Arc::clone(&self)
                    .start_bootstrap(&identity, lease, boot, join, sink, op.deadline)
                    .await
            }
            OperationInput::CancelBootstrap { session } => {
                self.cancel(&identity, session.as_ref(), op.deadline).await
            }
            OperationInput::DestroyLease { .. } => self.destroy(&identity).await,
        }
    }

    /// Watches the live agent of `identity` (it holds the lease a create
    /// reported).
    fn watch_identity(self: &Arc<Self>, identity: &ResourceIdentity) {
        if let Ok(entry) = inspect(&self.dir_of(identity))
            && let (Some(pid), Some(agent)) = (entry.live_pid, entry.agent.as_ref())
            && agent.pid == pid
        {
            exits::agent_held(self, identity, pid, Some(agent.start_time));
        }
    }

    // -----------------------------------------------------------------------
    // CreateLease
    // -----------------------------------------------------------------------

    async fn create(
        &self,
        identity: &ResourceIdentity,
        template: &NodeTemplate,
        deadline: UnixMillis,
    ) -> Outcome {
        let dir = self.dir_of(identity);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            return Outcome::Retryable {
                reason: format!("cannot create the agent's directory {}: {e}", dir.display()),
            };
        }
        let entry = match inspect(&dir) {
            Ok(entry) => entry,
            Err(e) => return unreadable(&dir, &e),
        };
        if let Some(pid) = entry.live_pid {
            if entry.agent.is_some() {
                tracing::info!(?identity, pid, "adopting the live node agent");
                return lease_outcome(pid, entry.endpoint.as_deref());
            }
            // Spawned (by this executor or one before it) but not yet recorded:
            // wait for it rather than start a second one.
            tracing::info!(?identity, pid, "a node agent is starting; waiting for it");
            return self.await_agent_record(&dir, pid, deadline).await;
        }
        let delay_ms = match endpoint_delay_ms(&template.boot) {
            Ok(ms) => ms,
            Err(reason) => return Outcome::Permanent { reason },
        };
        if let Some(pid) = entry.last_pid {
            lock(&self.children).remove(&pid);
        }
        if let Err(e) = clear_records(&dir) {
            return Outcome::Retryable {
                reason: format!("cannot clear the dead agent's records in {}: {e}", dir.display()),
            };
        }
        let pid = match self.spawn_agent(identity, &dir, delay_ms) {
            Ok(pid) => pid,
            Err(outcome) => return outcome,
        };
        tracing::info!(?identity, pid, "spawned a node agent");
        self.await_agent_record(&dir, pid, deadline).await
    }

    /// Spawns the agent of `dir` and starts the task that reaps it. Everything
    /// from the spawn to the waiter's registration is synchronous, so an abort of
    /// the operation at its deadline cannot lose the child between them.
    fn spawn_agent(&self, identity: &ResourceIdentity, dir: &Path, delay_ms: u64) -> Result<i32, Outcome> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(AGENT_LOG))
            .and_then(|log| Ok((log.try_clone()?, log)))
            .map_err(|e| Outcome::Retryable {
                reason: format!("cannot open the agent's log in {}: {e}", dir.display()),
            })?;
        let mut cmd = tokio::process::Command::new(&self.config.agent_path);
        cmd.arg("--run-uid")
            .arg(identity.run_uid.to_string())
            .arg("--run-id")
            .arg(identity.run_id.as_str())
            .arg("--node")
            .arg(identity.node.to_string())
            .arg("--attempt")
            .arg(identity.attempt.get().to_string())
            .arg(STATE_DIR_FLAG)
            .arg(dir)
            .arg("--endpoint-delay-ms")
            .arg(delay_ms.to_string())
            .stdin(Stdio::null())
            // A file, not the executor's stdio: an agent that outlives the
            // executor must not die writing to a closed pipe.
            .stdout(Stdio::from(log.0))
            .stderr(Stdio::from(log.1))
            // A group of its own, so a Ctrl-C meant for the executor's group
            // does not reach it; and no kill on drop, so it outlives the
            // executor.
            .process_group(0)
            .kill_on_drop(false);
        let mut child = cmd.spawn().map_err(|e| {
            let reason = format!(
                "cannot start the node agent {}: {e}",
                self.config.agent_path.display()
            );
            match e.kind() {
                // The same binary will be missing or unusable next time too.
                io::ErrorKind::NotFound | io::ErrorKind::PermissionDenied => Outcome::Permanent { reason },
                _ if e.raw_os_error() == Some(rustix::io::Errno::NOEXEC.raw_os_error()) => {
                    Outcome::Permanent { reason }
                }
                // Out of processes or memory: nothing started, later may work.
                _ => Outcome::Retryable { reason },
            }
        })?;
        let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) else {
            // Only a child that was already reaped has no id; none is here.
            return Err(Outcome::Ambiguous {
                reason: "the spawned node agent has no process id".to_owned(),
            });
        };
        let (exited_tx, exited_rx) = watch::channel(None);
        lock(&self.children).insert(pid, exited_rx);
        tokio::spawn(async move {
            let how = match child.wait().await {
                Ok(status) => describe_exit(status),
                Err(e) => format!("could not be waited for: {e}"),
            };
            tracing::info!(pid, %how, "a node agent ended");
            // The entry stays, so later requests can say how the agent died;
            // the destroy of its identity removes it.
            let _ = exited_tx.send(Some(how));
        });
        let launch = LaunchRecord {
            version: RECORD_VERSION,
            pid,
            identity: IdentityRecord::from(identity),
            launched_at_ms: self.clock.now().as_millis(),
        };
        // Not fatal: the agent records itself in a moment, and a `/proc` scan
        // finds it before then.
        if let Err(e) = write_json(dir, LAUNCH_RECORD, &launch) {
            tracing::warn!(pid, error = %e, "cannot write the launch record");
        }
        Ok(pid)
    }

    /// Waits until agent `pid` has recorded itself in `dir`.
    async fn await_agent_record(&self, dir: &Path, pid: i32, deadline: UnixMillis) -> Outcome {
        let wait = self.time_left(deadline).min(self.config.start_timeout);
        let waited = tokio::time::timeout(wait, async {
            loop {
                match inspect(dir) {
                    Ok(entry) if entry.agent.as_ref().is_some_and(|a| a.pid == pid) => {
                        if entry.live_pid == Some(pid) {
                            return lease_outcome(pid, entry.endpoint.as_deref());
                        }
                        return self.exited_early(dir, pid);
                    }
                    Ok(_) | Err(_) => {
                        if !process_exists(pid) {
                            return self.exited_early(dir, pid);
                        }
                    }
                }
                tokio::time::sleep(POLL).await;
            }
        })
        .await;
        match waited {
            Ok(outcome) => outcome,
            // The agent lives but has not recorded itself (it is slow, or
            // stopped): it is the identity's one resource all the same, held
            // as its lease, and not ready (a lookup says so until it records
            // its endpoint). Reporting it ambiguous instead would have a
            // cleanup re-issue the create for ever while the agent stays
            // stopped, never reaching the destroy.
            Err(_) if process_exists(pid) => {
                tracing::info!(
                    pid,
                    ?wait,
                    "a node agent has not recorded itself yet; holding it as the lease"
                );
                lease_outcome(pid, None)
            }
            Err(_) => self.exited_early(dir, pid),
        }
    }

    /// The outcome of a create whose agent died before it was usable: nothing
    /// lives, so the failure is definite.
    fn exited_early(&self, dir: &Path, pid: i32) -> Outcome {
        let how = self.exit_of(pid).unwrap_or_else(|| "exited".to_owned());
        Outcome::Retryable {
            reason: format!(
                "node agent pid {pid} {how} before it was ready; see {}",
                dir.join(AGENT_LOG).display()
            ),
        }
    }

    /// How agent `pid` ended, if this process spawned and reaped it.
    fn exit_of(&self, pid: i32) -> Option<String> {
        lock(&self.children).get(&pid).and_then(|rx| rx.borrow().clone())
    }

    // -----------------------------------------------------------------------
    // LookupEndpoint
    // -----------------------------------------------------------------------

    fn lookup(&self, identity: &ResourceIdentity, lease: &LeaseId) -> Outcome {
        let live = match self.live_agent(identity, lease) {
            Ok(live) => live,
            Err(outcome) => return outcome,
        };
        match live.endpoint.as_deref().map(|e| Endpoint::new("endpoint", e)) {
            None => Outcome::NotReady {
                reason: "the node agent has not bound its endpoint yet".to_owned(),
            },
            Some(Ok(endpoint)) => Outcome::Succeeded(ResultFacts {
                lease: Some(lease.clone()),
                endpoint: Some(endpoint),
                session: None,
            }),
            Some(Err(e)) => Outcome::Retryable {
                reason: format!("the agent's endpoint record is malformed: {e}"),
            },
        }
    }

    /// The identity's agent, if it is alive and is the lease named; otherwise the
    /// definite failure to report. A starting agent (spawned, not yet recorded)
    /// is not ready.
    fn live_agent(&self, identity: &ResourceIdentity, lease: &LeaseId) -> Result<LiveAgent, Outcome> {
        let dir = self.dir_of(identity);
        if !dir.is_dir() {
            return Err(Outcome::Retryable {
                reason: NO_SUCH_LEASE.to_owned(),
            });
        }
        let entry = inspect(&dir).map_err(|e| unreadable(&dir, &e))?;
        let Some(pid) = entry.live_pid else {
            let reason = match entry.last_pid {
                Some(pid) => {
                    let how = self.exit_of(pid).unwrap_or_else(|| "is not running".to_owned());
                    format!("the node agent (pid {pid}) {how}")
                }
                None => NO_SUCH_LEASE.to_owned(),
            };
            return Err(Outcome::Retryable { reason });
        };
        let Some(record) = entry.agent.clone() else {
            return Err(Outcome::NotReady {
                reason: "the node agent is starting".to_owned(),
            });
        };
        // Requests are keyed on identity; a lease id that is not the identity's
        // live agent names something this backend does not hold.
        if lease.as_str() != lease_name(pid) {
            return Err(Outcome::Retryable {
                reason: format!("{NO_SUCH_LEASE}: {lease} is not the live agent of this node"),
            });
        }
        Ok(LiveAgent {
            pid,
            record,
            endpoint: entry.endpoint,
        })
    }

    // -----------------------------------------------------------------------
    // StartBootstrap
    // -----------------------------------------------------------------------

    async fn start_bootstrap(
        self: Arc<Self>,
        identity: &ResourceIdentity,
        lease: &LeaseId,
        boot: &Params,
        join: &Params,
        sink: ObservationSink,
        deadline: UnixMillis,
    ) -> Outcome {
        let live = match self.live_agent(identity, lease) {
            Ok(live) => live,
            // Not ready is not an answer a start can give: the driver starts a
            // bootstrap only once it knows the endpoint.
            Err(Outcome::NotReady { reason }) => return Outcome::Retryable { reason },
            Err(outcome) => return outcome,
        };
        let Some(endpoint) = live.endpoint.clone() else {
            return Outcome::Retryable {
                reason: "the node agent has not bound its endpoint yet".to_owned(),
            };
        };
        let known = {
            let relays = self.relays();
            relays.by_identity.get(identity).map(|r| KnownSession {
                session: r.session.as_str().to_owned(),
                after_seq: r.relayed,
            })
        };
        let request = Request::Start {
            boot: params_to_wire(boot),
            join: params_to_wire(join),
            known: known.clone(),
        };
        let wait = self.time_left(deadline);
        let mut conn = match tokio::time::timeout(wait, connect(&endpoint)).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => {
                return Outcome::Retryable {
                    reason: format!("cannot reach the node agent at {endpoint}: {e}"),
                };
            }
            Err(_) => {
                return Outcome::Retryable {
                    reason: format!("connecting to the node agent at {endpoint} timed out"),
                };
            }
        };
        let answer = tokio::time::timeout(wait, conn.request(&request)).await;
        let (session, adopted) = match answer {
            Ok(Ok(Some(Reply::Accepted { session, adopted }))) => (session, adopted),
            Ok(Ok(Some(Reply::Error { reason, permanent }))) => {
                let reason = format!("the node agent refused the bootstrap: {reason}");
                return if permanent {
                    Outcome::Permanent { reason }
                } else {
                    Outcome::Retryable { reason }
                };
            }
            Ok(Ok(Some(other))) => {
                return Outcome::Ambiguous {
                    reason: format!("the node agent answered the start with {other:?}"),
                };
            }
            Ok(Ok(None)) | Ok(Err(_)) => {
                let pid = live.pid;
                return if process_exists(pid) {
                    Outcome::Ambiguous {
                        reason: "the node agent closed the connection before answering the start".to_owned(),
                    }
                } else {
                    Outcome::Retryable {
                        reason: format!("the node agent (pid {pid}) died before answering the start"),
                    }
                };
            }
            Err(_) => {
                return Outcome::Ambiguous {
                    reason: format!("the node agent did not answer the start within {wait:?}"),
                };
            }
        };
        let session_id = match SessionId::new("session", &session) {
            Ok(id) => id,
            Err(e) => {
                return Outcome::Ambiguous {
                    reason: format!("the node agent named its session badly: {e}"),
                };
            }
        };
        let relaying = known.is_some_and(|k| k.session == session);
        tracing::info!(?identity, session, adopted, relaying, "bootstrap session started");
        relay::start(
            &self,
            identity,
            session_id.clone(),
            live.record,
            sink,
            Some(conn),
            relaying,
        );
        Outcome::Succeeded(ResultFacts {
            session: Some(session_id),
            ..ResultFacts::default()
        })
    }

    // -----------------------------------------------------------------------
    // CancelBootstrap
    // -----------------------------------------------------------------------

    async fn cancel(
        &self,
        identity: &ResourceIdentity,
        session: Option<&SessionId>,
        deadline: UnixMillis,
    ) -> Outcome {
        let dir = self.dir_of(identity);
        let done = || {
            relay::forget(self, identity, session);
            Outcome::Succeeded(ResultFacts::default())
        };
        if !dir.is_dir() {
            return done();
        }
        let entry = match inspect(&dir) {
            Ok(entry) => entry,
            Err(e) => return unreadable(&dir, &e),
        };
        // A session cannot outlive its agent, nor exist before the agent's
        // endpoint is bound: either way it is already absent.
        let (Some(pid), Some(endpoint)) = (entry.live_pid, entry.endpoint.clone()) else {
            return done();
        };
        let wait = self.time_left(deadline).min(CANCEL_WAIT);
        let request = Request::Cancel {
            session: session.map(|s| s.as_str().to_owned()),
        };
        let asked = tokio::time::timeout(wait, async {
            let mut conn = connect(&endpoint).await?;
            conn.request(&request).await
        })
        .await;
        let unanswered = match asked {
            Ok(Ok(Some(Reply::Cancelled { session, existed }))) => {
                tracing::info!(?identity, ?session, existed, "bootstrap session cancelled");
                return done();
            }
            _ if !process_exists(pid) => return done(),
            Ok(Ok(Some(other))) => format!("answered the cancel with {other:?}"),
            Ok(Ok(None)) => "closed the connection before answering the cancel".to_owned(),
            Ok(Err(e)) => format!("could not be asked at {endpoint}: {e}"),
            Err(_) => format!("did not answer the cancel within {wait:?}"),
        };
        // Ending the session is the executor's to do, with or without the
        // agent: it stops relaying the session, so nothing more of it reaches
        // the driver, and a cancel it sent stays queued on the agent's socket
        // for when the agent runs again. What follows a cancel in cleanup is
        // the lease's destroy, which stops the agent in whatever state it is
        // (a stopped agent included). An unanswered cancel reported as
        // ambiguous would be retried for as long as the agent stays silent,
        // and cleanup would never reach that destroy.
        tracing::warn!(
            ?identity,
            pid,
            agent = %unanswered,
            "the node agent did not confirm the cancel; the session is ended on the executor's side"
        );
        done()
    }

    // -----------------------------------------------------------------------
    // DestroyLease
    // -----------------------------------------------------------------------

    async fn destroy(&self, identity: &ResourceIdentity) -> Outcome {
        let dir = self.dir_of(identity);
        // The agent is going away on purpose: its session's end is no failure
        // to report.
        relay::forget(self, identity, None);
        if !dir.is_dir() {
            self.release_identity(identity);
            return Outcome::Succeeded(ResultFacts::default());
        }
        let mut targets: Vec<(i32, Option<u64>)> = Vec::new();
        let mut dead = None;
        match inspect(&dir) {
            Ok(entry) => {
                dead = entry.last_pid;
                if let Some(pid) = entry.live_pid {
                    let start_time = entry
                        .agent
                        .as_ref()
                        .filter(|a| a.pid == pid)
                        .map(|a| a.start_time);
                    targets.push((pid, start_time));
                }
            }
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "destroying by process scan"),
        }
        // Belt and braces: any other process started for this directory goes
        // too, so the directory is never removed under a live agent.
        for pid in processes_naming(&dir) {
            if !targets.iter().any(|(p, _)| *p == pid) {
                targets.push((pid, None));
            }
        }
        for &(pid, _) in &targets {
            exits::agent_released(self, pid);
        }
        for &(pid, start_time) in &targets {
            if let Err(reason) = self.terminate(pid, start_time, &dir).await {
                return Outcome::Retryable { reason };
            }
        }
        {
            let mut children = lock(&self.children);
            for pid in targets.iter().map(|(pid, _)| *pid).chain(dead) {
                children.remove(&pid);
            }
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Outcome::Retryable {
                    reason: format!(
                        "the agent is gone but its directory {} remains: {e}",
                        dir.display()
                    ),
                };
            }
        }
        self.release_identity(identity);
        tracing::info!(?identity, "lease destroyed");
        Outcome::Succeeded(ResultFacts::default())
    }

    /// SIGTERM, the grace period, then SIGKILL; returns once the agent is dead
    /// and, if this process spawned it, reaped.
    async fn terminate(&self, pid: i32, start_time: Option<u64>, dir: &Path) -> Result<(), String> {
        let is_agent = || is_the_agent(pid, start_time, dir);
        if !is_agent() {
            return Ok(());
        }
        let reaped = lock(&self.children).get(&pid).cloned();
        signal(pid, rustix::process::Signal::TERM);
        // A stopped agent cannot act on SIGTERM until it runs again.
        signal(pid, rustix::process::Signal::CONT);
        if !wait_until_gone(&is_agent, self.config.kill_grace).await {
            tracing::warn!(pid, grace = ?self.config.kill_grace, "the node agent ignored SIGTERM; killing it");
            if is_agent() {
                signal(pid, rustix::process::Signal::KILL);
            }
            if !wait_until_gone(&is_agent, KILL_WAIT).await {
                return Err(format!(
                    "node agent pid {pid} is still alive {KILL_WAIT:?} after SIGKILL"
                ));
            }
        }
        // Our own child is dead; give the waiter a moment to reap it, so that
        // no zombie outlives the destroy.
        if let Some(mut reaped) = reaped {
            let _ = tokio::time::timeout(Duration::from_secs(2), reaped.wait_for(Option::is_some)).await;
        }
        Ok(())
    }

    // -----------------------------------------------------------------------
    // Inventory and resume
    // -----------------------------------------------------------------------

    fn inventory(&self) -> Result<Vec<InventoryItem>, BackendError> {
        let entries = registry::scan(&self.config.state_dir)
            .map_err(|e| BackendError::Unavailable(format!("cannot scan the state directory: {e}")))?;
        let mut items = Vec::new();
        for entry in entries {
            let Some(identity) = entry.identity() else {
                continue;
            };
            let Some(pid) = entry.live_pid else {
                tracing::debug!(
                    ?identity,
                    "an agent directory whose agent is dead; a destroy removes it"
                );
                continue;
            };
            items.push(InventoryItem {
                identity,
                lease: LeaseId::new("lease", &lease_name(pid)).ok(),
                endpoint: entry
                    .endpoint
                    .as_deref()
                    .and_then(|e| Endpoint::new("endpoint", e).ok()),
                session_live: entry
                    .session
                    .as_ref()
                    .is_some_and(|s| s.status != agent_protocol::SessionStatus::Cancelled),
            });
        }
        items.sort_by(|a, b| a.identity.cmp(&b.identity));
        Ok(items)
    }

    /// Re-attaches to every session found in the state directory that this
    /// executor does not relay yet.
    async fn resume(self: Arc<Self>, sink: ObservationSink) {
        let entries = match registry::scan(&self.config.state_dir) {
            Ok(entries) => entries,
            Err(e) => {
                tracing::error!(error = %e, "cannot scan the state directory to resume sessions");
                return;
            }
        };
        for entry in entries {
            let (Some(identity), Some(agent), Some(session)) =
                (entry.identity(), entry.agent.clone(), entry.session.clone())
            else {
                continue;
            };
            if session.status == agent_protocol::SessionStatus::Cancelled {
                continue;
            }
            let Ok(session_id) = SessionId::new("session", &session.session) else {
                continue;
            };
            let guard = self.identity_lock(&identity);
            let _held = guard.lock().await;
            if self.relays().by_identity.contains_key(&identity) {
                continue;
            }
            tracing::info!(?identity, session = %session.session, alive = entry.is_alive(), "resuming a session");
            relay::start(&self, &identity, session_id, agent, sink.clone(), None, false);
        }
    }
}

impl Backend for ProcessBackend {
    fn execute(&self, op: Operation, observations: ObservationSink) -> BoxFuture<'static, Outcome> {
        Box::pin(Arc::clone(&self.shared).execute(op, observations))
    }

    fn inventory(&self) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>> {
        let shared = Arc::clone(&self.shared);
        Box::pin(async move { shared.inventory() })
    }

    fn resume(&self, observations: ObservationSink) {
        let task = tokio::spawn(Arc::clone(&self.shared).resume(observations));
        self.shared.relays().other_tasks.push(task.abort_handle());
    }

    fn watch(&self, changes: ChangeSink) {
        exits::start(&self.shared, changes);
    }

    /// A `ping` answered by `pong`: a stopped or wedged agent whose kernel
    /// still accepts connections fails it.
    fn probe(
        &self,
        _identity: &ResourceIdentity,
        endpoint: &Endpoint,
    ) -> BoxFuture<'static, Result<(), String>> {
        let endpoint = endpoint.as_str().to_owned();
        Box::pin(async move {
            let mut conn = connect(&endpoint)
                .await
                .map_err(|e| format!("connect to {endpoint}: {e}"))?;
            match conn.request(&Request::Ping).await {
                Ok(Some(Reply::Pong)) => Ok(()),
                Ok(Some(other)) => Err(format!("unexpected answer to ping: {other:?}")),
                Ok(None) => Err("the agent closed the connection without answering".to_owned()),
                Err(e) => Err(format!("ping {endpoint}: {e}")),
            }
        })
    }
}

/// An identity's agent that is alive, recorded, and the lease a request named.
#[derive(Debug)]
struct LiveAgent {
    pid: i32,
    record: agent_protocol::AgentRecord,
    endpoint: Option<String>,
}

/// The lease id of agent `pid`.
fn lease_name(pid: i32) -> String {
    format!("proc-{pid}")
}

fn lease_outcome(pid: i32, endpoint: Option<&str>) -> Outcome {
    match LeaseId::new("lease", &lease_name(pid)) {
        Ok(lease) => Outcome::Succeeded(ResultFacts {
            lease: Some(lease),
            endpoint: endpoint.and_then(|e| Endpoint::new("endpoint", e).ok()),
            session: None,
        }),
        // Unreachable for a non-empty name, but the agent exists: say so.
        Err(e) => Outcome::Ambiguous {
            reason: format!("the node agent pid {pid} runs but its lease id is invalid: {e}"),
        },
    }
}

/// The outcome when an agent's directory cannot be read: whether an agent
/// lives is unknown unless a `/proc` scan finds one.
fn unreadable(dir: &Path, e: &agent_protocol::RecordError) -> Outcome {
    let reason = format!("cannot read the agent's records: {e}");
    if processes_naming(dir).is_empty() {
        Outcome::Retryable { reason }
    } else {
        Outcome::Ambiguous { reason }
    }
}

fn describe_exit(status: std::process::ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        (None, None) => format!("ended ({status})"),
    }
}

/// Whether a process with `pid` exists and has not exited (zombies have).
fn process_exists(pid: i32) -> bool {
    matches!(read_stat(pid), Ok(Some(stat)) if !stat.has_exited())
}

/// Whether `pid` is still the agent of `dir`: alive, and with the recorded
/// start time or, without one, the directory on its command line.
fn is_the_agent(pid: i32, start_time: Option<u64>, dir: &Path) -> bool {
    match read_stat(pid) {
        Ok(Some(stat)) if !stat.has_exited() => match start_time {
            Some(t) => stat.start_time == t,
            None => registry::cmdline_names_dir(pid, dir),
        },
        _ => false,
    }
}

/// Sends `sig` to `pid`. A process that is already gone is what the caller
/// wants, so failures are only logged.
fn signal(pid: i32, sig: rustix::process::Signal) {
    // PIDs 0 and 1 and negative ones mean groups or init to kill(2): never ours.
    let Some(target) = rustix::process::Pid::from_raw(pid).filter(|_| pid > 1) else {
        return;
    };
    if let Err(e) = rustix::process::kill_process(target, sig) {
        tracing::debug!(pid, ?sig, error = %e, "signal not delivered");
    }
}

async fn wait_until_gone(alive: &impl Fn() -> bool, within: Duration) -> bool {
    tokio::time::timeout(within, async {
        while alive() {
            tokio::time::sleep(POLL).await;
        }
    })
    .await
    .is_ok()
}

/// Opens a protocol connection to an agent.
async fn connect(endpoint: &str) -> io::Result<Connection> {
    let stream = TcpStream::connect(endpoint).await?;
    let (read, write) = stream.into_split();
    Ok(Connection {
        read: BufReader::new(read),
        write,
    })
}

impl Connection {
    /// Sends a request and reads the first reply.
    async fn request(&mut self, request: &Request) -> io::Result<Option<Reply>> {
        self.write.write_all(&to_line(request)?).await?;
        self.write.flush().await?;
        read_message(&mut self.read).await
    }
}
