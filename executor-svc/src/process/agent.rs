//! The node agent: the program that stands for one leased node of the process
//! backend. The `node-agent` binary only parses its flags and calls [`run`].
//!
//! An agent records who it is in its state directory, binds a TCP port on
//! loopback after a configurable delay (the endpoint is unknown until then, as
//! a real node's address is), records the port, and serves bootstrap sessions
//! over that port with the protocol of [`super::agent_protocol`]. Its one
//! session runs on a task of its own, so the session goes on whoever is
//! connected: a client that reconnects (an executor that restarted) attaches and
//! gets the stage log it missed, with the same sequence numbers.
//!
//! Faults come from the agent itself, as its boot parameters direct: a failed
//! stage, a hang, or a crash that is a real `SIGKILL` of its own process, so
//! the executor sees exactly what a dying node looks like. On SIGTERM or SIGINT
//! the agent exits cleanly and removes nothing: its directory belongs to the
//! executor, which removes it when it destroys the lease.

use std::{
    future::Future,
    io,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use contract::{BootstrapStage, Clock, ResourceIdentity, SystemClock};
use tokio::{
    io::{AsyncWriteExt as _, BufReader},
    net::{TcpListener, TcpStream, tcp::OwnedWriteHalf},
    sync::{mpsc, watch},
    task::AbortHandle,
};

use super::{
    agent_protocol::{
        AGENT_RECORD, AgentRecord, ENDPOINT_FILE, EndReason, IdentityRecord, KnownSession, RECORD_VERSION,
        Reply, Request, SESSION_RECORD, STAGE_PLAN, SessionPlan, SessionRecord, SessionStatus, StageLine,
        WireParams, read_message, to_line, write_atomically, write_json,
    },
    registry::own_start_time,
};

/// How long a new connection may take to send its first request.
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How an agent is started.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub identity: ResourceIdentity,
    pub state_dir: PathBuf,
    /// How long after it starts the agent binds its endpoint.
    pub endpoint_delay: Duration,
    /// Time between stages when the boot parameters do not say.
    pub default_stage_delay_ms: u64,
}

/// What stops an agent before its shutdown signal.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot write the agent's {what} in {dir}: {source}")]
    WriteRecord {
        what: &'static str,
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the agent's own process start time: {0}")]
    StartTime(#[source] io::Error),
    #[error("cannot bind the agent's endpoint: {0}")]
    Bind(#[source] io::Error),
}

/// Runs the agent until `shutdown` resolves.
pub async fn run(config: AgentConfig, shutdown: impl Future<Output = ()>) -> Result<(), AgentError> {
    let clock = SystemClock;
    let dir = config.state_dir.clone();
    let write_error = |what| {
        let dir = dir.clone();
        move |source| AgentError::WriteRecord { what, dir, source }
    };
    std::fs::create_dir_all(&dir).map_err(write_error("state directory"))?;
    let pid = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
    let record = AgentRecord {
        version: RECORD_VERSION,
        pid,
        start_time: own_start_time().map_err(AgentError::StartTime)?,
        identity: IdentityRecord::from(&config.identity),
        started_at_ms: clock.now().as_millis(),
    };
    write_json(&dir, AGENT_RECORD, &record).map_err(write_error("identity record"))?;
    tracing::info!(pid, identity = ?config.identity, "node agent started");

    tokio::pin!(shutdown);
    tokio::select! {
        () = &mut shutdown => return Ok(()),
        () = tokio::time::sleep(config.endpoint_delay) => {}
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(AgentError::Bind)?;
    let endpoint = listener.local_addr().map_err(AgentError::Bind)?;
    write_atomically(&dir, ENDPOINT_FILE, format!("{endpoint}\n").as_bytes())
        .map_err(write_error("endpoint record"))?;
    tracing::info!(%endpoint, "node agent listening");

    let (changed, _) = watch::channel(0u64);
    let agent = Arc::new(Agent {
        config,
        pid,
        endpoint,
        clock,
        state: Mutex::new(State::default()),
        changed,
    });
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let agent = Arc::clone(&agent);
                    tokio::spawn(async move {
                        if let Err(e) = agent.serve(stream, peer).await {
                            tracing::debug!(%peer, error = %e, "a session connection ended with an error");
                        }
                    });
                }
                // Running out of descriptors is worth a pause, not an exit: the
                // session in progress must go on.
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    tracing::info!("node agent stopping on a shutdown signal");
    Ok(())
}

#[derive(Debug)]
struct Agent {
    config: AgentConfig,
    pid: i32,
    endpoint: SocketAddr,
    clock: SystemClock,
    state: Mutex<State>,
    /// Bumped after every change of the session, so that connections streaming
    /// it wake up.
    changed: watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct State {
    session: Option<Session>,
    sessions_started: u64,
}

#[derive(Debug)]
struct Session {
    id: String,
    status: SessionStatus,
    stages: Vec<StageLine>,
    /// The task that produces the stages, while it runs.
    driver: Option<AbortHandle>,
}

impl Session {
    fn record(&self) -> SessionRecord {
        SessionRecord {
            version: RECORD_VERSION,
            session: self.id.clone(),
            status: self.status,
            stages: self.stages.clone(),
        }
    }
}

/// What a connection streams after its first request was accepted.
#[derive(Debug)]
struct Accepted {
    session: String,
    adopted: bool,
    after_seq: u64,
}

impl Agent {
    /// A poisoned lock only means a connection task panicked mid-step; every step
    /// leaves the session consistent, so it is used.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes the session's record (under the lock, so writes keep the order of
    /// the changes) and wakes the connections.
    fn publish(&self, session: &Session) {
        if let Err(e) = write_json(&self.config.state_dir, SESSION_RECORD, &session.record()) {
            tracing::error!(error = %e, "cannot record the session; a restarted executor may miss stages");
        }
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Starts the session, or adopts the one that exists and is not cancelled.
    fn start(
        self: &Arc<Self>,
        boot: WireParams,
        join: WireParams,
        known: Option<KnownSession>,
        peer: SocketAddr,
    ) -> Result<Accepted, Reply> {
        let mut state = self.lock();
        if let Some(s) = state
            .session
            .as_ref()
            .filter(|s| s.status != SessionStatus::Cancelled)
        {
            let after_seq = known.filter(|k| k.session == s.id).map_or(0, |k| k.after_seq);
            return Ok(Accepted {
                session: s.id.clone(),
                adopted: true,
                after_seq,
            });
        }
        let plan = SessionPlan::from_boot(&boot, self.config.default_stage_delay_ms).map_err(|reason| {
            Reply::Error {
                reason,
                permanent: true,
            }
        })?;
        state.sessions_started += 1;
        // The PID keeps ids unique across agents of one identity (a respawned
        // agent counts its sessions from 1 again), and the node and attempt keep
        // them unique within the run, where the executor keys session logs.
        let id = format!(
            "{}-a{}-p{}-s{}",
            self.config.identity.node,
            self.config.identity.attempt.get(),
            self.pid,
            state.sessions_started
        );
        let driver = tokio::spawn(Arc::clone(self).drive(id.clone(), plan, boot, join, peer));
        let session = Session {
            id: id.clone(),
            status: SessionStatus::Running,
            stages: Vec::new(),
            driver: Some(driver.abort_handle()),
        };
        self.publish(&session);
        state.session = Some(session);
        Ok(Accepted {
            session: id,
            adopted: false,
            after_seq: 0,
        })
    }

    /// Whether `session` is the agent's session and has not been cancelled.
    fn has_session(&self, session: &str) -> bool {
        self.lock()
            .session
            .as_ref()
            .is_some_and(|s| s.id == session && s.status != SessionStatus::Cancelled)
    }

    /// Ends the named session (or whichever exists). Returns the session's id and
    /// whether there was one to end.
    fn cancel(&self, session: Option<&str>) -> (Option<String>, bool) {
        let mut state = self.lock();
        let Some(s) = state
            .session
            .as_mut()
            .filter(|s| s.status != SessionStatus::Cancelled && session.is_none_or(|id| id == s.id))
        else {
            return (session.map(str::to_owned), false);
        };
        if let Some(driver) = s.driver.take() {
            driver.abort();
        }
        s.status = SessionStatus::Cancelled;
        tracing::info!(session = %s.id, "session cancelled");
        let id = s.id.clone();
        if let Some(s) = &state.session {
            self.publish(s);
        }
        (Some(id), true)
    }

    /// Appends a stage to the session `id`, unless it was cancelled meanwhile,
    /// and moves its status. Returns whether the stage was recorded.
    fn record_stage(&self, id: &str, stage: BootstrapStage, detail: String, status: SessionStatus) -> bool {
        let mut state = self.lock();
        let Some(s) = state
            .session
            .as_mut()
            .filter(|s| s.id == id && s.status == SessionStatus::Running)
        else {
            return false;
        };
        let seq = u64::try_from(s.stages.len()).map_or(u64::MAX, |n| n.saturating_add(1));
        tracing::info!(session = id, seq, stage = stage.name(), %detail, "stage");
        s.stages.push(StageLine {
            seq,
            stage,
            detail,
            at_ms: self.clock.now().as_millis(),
        });
        s.status = status;
        if status != SessionStatus::Running {
            s.driver = None;
        }
        if let Some(s) = &state.session {
            self.publish(s);
        }
        true
    }

    fn set_status(&self, id: &str, status: SessionStatus) {
        let mut state = self.lock();
        if let Some(s) = state
            .session
            .as_mut()
            .filter(|s| s.id == id && s.status == SessionStatus::Running)
        {
            s.status = status;
            s.driver = None;
            tracing::info!(session = id, ?status, "session status");
        }
        if let Some(s) = &state.session {
            self.publish(s);
        }
    }

    /// The stages of `id` after `sent`, and why the session ended if it has. A
    /// session that is no longer the agent's counts as cancelled.
    fn pending(&self, id: &str, sent: u64) -> (Vec<StageLine>, Option<EndReason>) {
        let state = self.lock();
        match state.session.as_ref().filter(|s| s.id == id) {
            Some(s) => (
                s.stages.iter().filter(|l| l.seq > sent).cloned().collect(),
                s.status.end_reason(),
            ),
            None => (Vec::new(), Some(EndReason::Cancelled)),
        }
    }

    /// Produces a session's stages, a stage delay apart, obeying the fault
    /// directives of its boot parameters.
    async fn drive(
        self: Arc<Self>,
        id: String,
        plan: SessionPlan,
        boot: WireParams,
        join: WireParams,
        peer: SocketAddr,
    ) {
        let started = self.clock.now();
        for (i, stage) in STAGE_PLAN.into_iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(plan.stage_delay_ms)).await;
            }
            if plan.crash_at == Some(stage) {
                crash(stage);
            }
            if plan.hang_at == Some(stage) {
                tracing::warn!(session = %id, stage = stage.name(), "hanging as directed");
                self.set_status(&id, SessionStatus::Hung);
                return;
            }
            if plan.fail_at == Some(stage) {
                let detail = format!(
                    "fault.fail_at={}: the {} stage failed as directed",
                    stage.name(),
                    stage.name()
                );
                self.record_stage(&id, stage.failure(), detail, SessionStatus::Failed);
                return;
            }
            let detail = match stage {
                BootstrapStage::Connected => format!("session {id} opened by {peer}"),
                BootstrapStage::BootCheck => format!(
                    "boot check passed with {} boot parameters ({} secret)",
                    boot.len(),
                    boot.values().filter(|p| p.secret).count()
                ),
                BootstrapStage::AgentStarted => {
                    format!("node agent pid {} serving {}", self.pid, self.endpoint)
                }
                // Keys only: a join value may be a credential.
                BootstrapStage::Joined => format!(
                    "joined with parameters [{}]",
                    join.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
                _ => format!(
                    "converged {} ms after the session opened",
                    self.clock.now().as_millis().saturating_sub(started.as_millis())
                ),
            };
            let status = if stage == BootstrapStage::Converged {
                SessionStatus::Converged
            } else {
                SessionStatus::Running
            };
            if !self.record_stage(&id, stage, detail, status) {
                return;
            }
        }
    }

    /// Serves one connection: its first request decides what it is.
    async fn serve(self: Arc<Self>, stream: TcpStream, peer: SocketAddr) -> io::Result<()> {
        let (read, mut write) = stream.into_split();
        let mut read = BufReader::new(read);
        // A client that connects and never asks anything must not hold a task
        // for the agent's whole life.
        let first = tokio::time::timeout(FIRST_REQUEST_TIMEOUT, read_message::<Request, _>(&mut read)).await;
        let request = match first {
            Err(_) | Ok(Ok(None)) => return Ok(()),
            Ok(Ok(Some(request))) => request,
            // Tell a confused client what was wrong before hanging up on it.
            Ok(Err(e)) if e.kind() == io::ErrorKind::InvalidData => {
                let reason = format!("not a request: {e}");
                return send(
                    &mut write,
                    &Reply::Error {
                        reason,
                        permanent: true,
                    },
                )
                .await;
            }
            Ok(Err(e)) => return Err(e),
        };
        let accepted = match request {
            Request::Start { boot, join, known } => self.start(boot, join, known, peer),
            Request::Attach { session, after_seq } => {
                if self.has_session(&session) {
                    Ok(Accepted {
                        session,
                        adopted: true,
                        after_seq,
                    })
                } else {
                    Err(Reply::Error {
                        reason: format!("no session {session:?} on this node"),
                        permanent: false,
                    })
                }
            }
            Request::Cancel { session } => {
                let (session, existed) = self.cancel(session.as_deref());
                return send(&mut write, &Reply::Cancelled { session, existed }).await;
            }
            Request::Ping => return send(&mut write, &Reply::Pong).await,
        };
        let accepted = match accepted {
            Ok(accepted) => accepted,
            Err(refusal) => return send(&mut write, &refusal).await,
        };
        send(
            &mut write,
            &Reply::Accepted {
                session: accepted.session.clone(),
                adopted: accepted.adopted,
            },
        )
        .await?;

        // The client may send `cancel` while stages stream. Its lines are read on
        // a task of their own, because a read cannot be abandoned mid-line.
        let (requests_tx, mut requests) = mpsc::channel(4);
        let reader = tokio::spawn(async move {
            while let Ok(Some(request)) = read_message::<Request, _>(&mut read).await {
                if requests_tx.send(request).await.is_err() {
                    break;
                }
            }
        });
        let result = self.stream(&accepted, &mut write, &mut requests).await;
        reader.abort();
        result
    }

    /// Streams a session's stages to one connection until the session ends or
    /// the client goes away.
    async fn stream(
        &self,
        accepted: &Accepted,
        write: &mut OwnedWriteHalf,
        requests: &mut mpsc::Receiver<Request>,
    ) -> io::Result<()> {
        let mut changes = self.changed.subscribe();
        let mut sent = accepted.after_seq;
        loop {
            // Marked seen before reading, so a change made after the read wakes
            // the wait below.
            changes.borrow_and_update();
            let (lines, end) = self.pending(&accepted.session, sent);
            for line in lines {
                sent = line.seq;
                send(write, &Reply::Stage(line)).await?;
            }
            if let Some(reason) = end {
                return send(write, &Reply::End { reason }).await;
            }
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                }
                request = requests.recv() => match request {
                    Some(Request::Cancel { .. }) => {
                        self.cancel(Some(&accepted.session));
                    }
                    Some(other) => {
                        let reason = format!("only cancel may follow on a session connection, not {other:?}");
                        send(write, &Reply::Error { reason, permanent: false }).await?;
                    }
                    // The client closed its side: it no longer listens.
                    None => return Ok(()),
                },
            }
        }
    }
}

async fn send(write: &mut OwnedWriteHalf, reply: &Reply) -> io::Result<()> {
    write.write_all(&to_line(reply)?).await?;
    write.flush().await
}

/// Ends the process the way a crashing node ends: killed by a signal, with no
/// goodbye to anyone connected and nothing cleaned up.
fn crash(stage: BootstrapStage) -> ! {
    tracing::error!(stage = stage.name(), "crashing as directed (fault.crash_at)");
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    // SIGKILL cannot be caught, so this is reached only if the signal could not
    // be sent at all.
    std::process::abort()
}
