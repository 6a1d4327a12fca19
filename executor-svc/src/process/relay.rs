//! Session relays: one task per bootstrap session this executor streams, which
//! reads the agent's stage lines and sends them through the session's
//! [`ObservationSink`].
//!
//! A relay forwards each agent stage exactly once per executor process and in
//! order, skipping any sequence number it already forwarded. The executor's core
//! numbers a session's observations from 1 in arrival order, so its sequence
//! numbers equal the agent's; after an executor restart the relay starts again
//! from the agent's first stage, which reproduces the numbers the driver
//! already folded.
//!
//! When the connection drops, the relay asks why. An agent that is alive gets
//! re-attached from the last forwarded stage. An agent that died gets its
//! recorded stage log (`session.json`) replayed for whatever was not forwarded
//! yet, then, unless the session had already ended, a `FailedClosed`
//! observation: the driver fails the attempt. A relay that cannot reach a live
//! agent for [`LOST_AFTER`] reports the same failure rather than wait forever.

use std::{sync::Arc, time::Duration};

use contract::{BootstrapStage, ResourceIdentity, SessionId, UnixMillis};
use tokio::{
    io::BufReader,
    net::tcp::{OwnedReadHalf, OwnedWriteHalf},
    task::AbortHandle,
};

use super::{
    Shared,
    agent_protocol::{
        AgentRecord, ENDPOINT_FILE, EndReason, Reply, Request, SESSION_RECORD, SessionRecord, StageLine,
        read_json, read_message,
    },
    connect, lock,
    registry::agent_alive,
};
use crate::backend::{ObservationSink, RawObservation};

/// How long a relay keeps trying to reach a live agent whose session it lost
/// before it reports the session failed.
pub(super) const LOST_AFTER: Duration = Duration::from_secs(30);

/// How long an attach waits for the agent's answer.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest pause between two attach tries.
const MAX_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// One protocol connection to an agent.
#[derive(Debug)]
pub(super) struct Connection {
    pub(super) read: BufReader<OwnedReadHalf>,
    pub(super) write: OwnedWriteHalf,
}

/// A session this executor relays (or relayed: the entry stays after the stream
/// ended, so that a later adopting start does not stream it twice).
#[derive(Debug)]
pub(super) struct Relay {
    /// Tells this relay's task from a later one for the same identity.
    token: u64,
    pub(super) session: SessionId,
    /// The agent sequence number of the last stage forwarded.
    pub(super) relayed: u64,
    sink: ObservationSink,
    /// The task, while it streams.
    task: Option<AbortHandle>,
}

impl Relay {
    pub(super) fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }

    fn streaming(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }
}

/// Relays `session` of `identity` to `sink`, over `conn` if given (already
/// accepted by the agent) or over a fresh attach. `continues` says the agent
/// streams `conn` after the stages already relayed for this session; otherwise
/// it streams from the first stage.
///
/// If this session is already streaming, only its sink changes (an adopting
/// start brings the sink of its own operation) and `conn` is closed.
pub(super) fn start(
    shared: &Arc<Shared>,
    identity: &ResourceIdentity,
    session: SessionId,
    agent: AgentRecord,
    sink: ObservationSink,
    conn: Option<Connection>,
    continues: bool,
) {
    if shared.stopped.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    let mut relays = shared.relays();
    let token = relays.next_token;
    relays.next_token = token.wrapping_add(1);
    let relayed = match relays.by_identity.get_mut(identity) {
        Some(existing) if existing.session == session && continues => {
            if existing.streaming() {
                existing.sink = sink;
                return;
            }
            existing.relayed
        }
        Some(existing) => {
            existing.stop();
            0
        }
        None => 0,
    };
    let task = tokio::spawn(run(
        Arc::clone(shared),
        identity.clone(),
        token,
        session.clone(),
        agent,
        conn,
    ));
    relays.by_identity.insert(
        identity.clone(),
        Relay {
            token,
            session,
            relayed,
            sink,
            task: Some(task.abort_handle()),
        },
    );
}

/// Stops relaying `identity`'s session and forgets it (it was cancelled, or the
/// agent is being destroyed): nothing more of it is reported. With `session`,
/// only that session is forgotten: a cancel of an older session leaves a newer
/// one streaming.
pub(super) fn forget(shared: &Shared, identity: &ResourceIdentity, session: Option<&SessionId>) {
    let mut relays = shared.relays();
    if relays
        .by_identity
        .get(identity)
        .is_some_and(|r| session.is_none_or(|s| *s == r.session))
        && let Some(mut relay) = relays.by_identity.remove(identity)
    {
        relay.stop();
    }
}

/// How a stream ended.
enum Pumped {
    Ended(EndReason),
    Lost(String),
    /// A later relay replaced this one, or the executor stopped listening.
    Superseded,
}

async fn run(
    shared: Arc<Shared>,
    identity: ResourceIdentity,
    token: u64,
    session: SessionId,
    agent: AgentRecord,
    mut conn: Option<Connection>,
) {
    let dir = shared.dir_of(&identity);
    let mut failing_since: Option<UnixMillis> = None;
    let mut pause = Duration::from_millis(25);
    loop {
        if let Some(mut c) = conn.take() {
            match pump(&shared, &identity, token, &session, &mut c).await {
                Pumped::Ended(reason) => {
                    tracing::debug!(?identity, %session, ?reason, "session stream ended");
                    return finish(&shared, &identity, token);
                }
                Pumped::Superseded => return,
                Pumped::Lost(why) => tracing::info!(?identity, %session, %why, "lost the session stream"),
            }
        }
        if !agent_alive(&agent) {
            return agent_died(&shared, &identity, token, &session, &agent).await;
        }
        let Some(after_seq) = relayed(&shared, &identity, token) else {
            return;
        };
        match attach(&dir, &session, after_seq).await {
            Ok(c) => {
                conn = Some(c);
                failing_since = None;
                pause = Duration::from_millis(25);
            }
            Err(Attach::NoSession(why)) => {
                tracing::info!(?identity, %session, %why, "the session is gone from its agent");
                return finish(&shared, &identity, token);
            }
            Err(Attach::Failed(why)) => {
                let now = shared.clock.now();
                let since = *failing_since.get_or_insert(now);
                if now.saturating_since(since) >= LOST_AFTER {
                    let detail =
                        format!("lost contact with the node agent's session for {LOST_AFTER:?}: {why}");
                    emit_closed(&shared, &identity, token, &session, detail);
                    return finish(&shared, &identity, token);
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(MAX_RETRY_PAUSE);
            }
        }
    }
}

/// Forwards stage lines until the stream ends.
async fn pump(
    shared: &Shared,
    identity: &ResourceIdentity,
    token: u64,
    session: &SessionId,
    conn: &mut Connection,
) -> Pumped {
    loop {
        match read_message::<Reply, _>(&mut conn.read).await {
            Ok(Some(Reply::Stage(line))) => {
                if !forward(shared, identity, token, session, line) {
                    return Pumped::Superseded;
                }
            }
            Ok(Some(Reply::End { reason })) => return Pumped::Ended(reason),
            Ok(Some(other)) => return Pumped::Lost(format!("unexpected message {other:?}")),
            Ok(None) => return Pumped::Lost("the connection closed".to_owned()),
            Err(e) => return Pumped::Lost(e.to_string()),
        }
    }
}

/// Sends one agent stage to the session's sink unless it was already sent.
/// Returns `false` when this relay should stop.
fn forward(
    shared: &Shared,
    identity: &ResourceIdentity,
    token: u64,
    session: &SessionId,
    line: StageLine,
) -> bool {
    let mut relays = shared.relays();
    let Some(relay) = relays.by_identity.get_mut(identity).filter(|r| r.token == token) else {
        return false;
    };
    if line.seq <= relay.relayed {
        return true;
    }
    if line.seq != relay.relayed.saturating_add(1) {
        tracing::warn!(?identity, %session, expected = relay.relayed + 1, got = line.seq, "a gap in the stage log");
    }
    relay.relayed = line.seq;
    let raw = RawObservation::new(
        identity.clone(),
        session.clone(),
        line.stage,
        line.detail,
        UnixMillis::new(line.at_ms),
    );
    relay.sink.send(raw)
}

/// The last forwarded sequence number, if this relay is still current.
fn relayed(shared: &Shared, identity: &ResourceIdentity, token: u64) -> Option<u64> {
    shared
        .relays()
        .by_identity
        .get(identity)
        .filter(|r| r.token == token)
        .map(|r| r.relayed)
}

/// Marks the relay as no longer streaming; its entry stays.
fn finish(shared: &Shared, identity: &ResourceIdentity, token: u64) {
    if let Some(relay) = shared
        .relays()
        .by_identity
        .get_mut(identity)
        .filter(|r| r.token == token)
    {
        relay.task = None;
    }
}

/// The agent died: forward what its stage log holds beyond what was relayed,
/// then report the session closed unless it had ended.
async fn agent_died(
    shared: &Shared,
    identity: &ResourceIdentity,
    token: u64,
    session: &SessionId,
    agent: &AgentRecord,
) {
    // Wait briefly for the reaper, for the detail's sake: "killed by signal 9"
    // says more than "is gone".
    let reaped = lock(&shared.children).get(&agent.pid).cloned();
    if let Some(mut reaped) = reaped {
        let _ = tokio::time::timeout(Duration::from_millis(500), reaped.wait_for(Option::is_some)).await;
    }
    let how = shared.exit_of(agent.pid).unwrap_or_else(|| "is gone".to_owned());
    let dir = shared.dir_of(identity);
    let record = match read_json::<SessionRecord>(&dir, SESSION_RECORD) {
        Ok(record) => record.filter(|r| r.session == session.as_str()),
        Err(e) => {
            tracing::warn!(?identity, error = %e, "cannot read the dead agent's session log");
            None
        }
    };
    let mut ended = false;
    if let Some(record) = record {
        for line in record.stages {
            if !forward(shared, identity, token, session, line) {
                return;
            }
        }
        ended = record.status.end_reason().is_some();
    }
    if !ended {
        let detail = format!("the node agent (pid {}) {how} during the session", agent.pid);
        tracing::warn!(?identity, %session, %detail, "bootstrap session closed");
        emit_closed(shared, identity, token, session, detail);
    }
    finish(shared, identity, token);
}

/// Reports the session failed-closed, numbered after the last relayed stage.
fn emit_closed(
    shared: &Shared,
    identity: &ResourceIdentity,
    token: u64,
    session: &SessionId,
    detail: String,
) {
    let mut relays = shared.relays();
    let Some(relay) = relays.by_identity.get_mut(identity).filter(|r| r.token == token) else {
        return;
    };
    relay.relayed = relay.relayed.saturating_add(1);
    let raw = RawObservation::new(
        identity.clone(),
        session.clone(),
        BootstrapStage::FailedClosed,
        detail,
        shared.clock.now(),
    );
    let _ = relay.sink.send(raw);
}

enum Attach {
    /// The agent answered: it has no such session.
    NoSession(String),
    /// The agent could not be asked.
    Failed(String),
}

/// Re-attaches to `session` and asks for the stages after `after_seq`.
async fn attach(dir: &std::path::Path, session: &SessionId, after_seq: u64) -> Result<Connection, Attach> {
    let endpoint = std::fs::read_to_string(dir.join(ENDPOINT_FILE))
        .map_err(|e| Attach::Failed(format!("no endpoint record: {e}")))?;
    let request = Request::Attach {
        session: session.as_str().to_owned(),
        after_seq,
    };
    let asked = tokio::time::timeout(ATTACH_TIMEOUT, async {
        let mut conn = connect(endpoint.trim()).await?;
        let reply = conn.request(&request).await?;
        Ok::<_, std::io::Error>((conn, reply))
    })
    .await;
    match asked {
        Ok(Ok((conn, Some(Reply::Accepted { .. })))) => Ok(conn),
        Ok(Ok((_, Some(Reply::Error { reason, .. })))) => Err(Attach::NoSession(reason)),
        Ok(Ok((_, other))) => Err(Attach::Failed(format!("unexpected answer {other:?}"))),
        Ok(Err(e)) => Err(Attach::Failed(e.to_string())),
        Err(_) => Err(Attach::Failed(format!("no answer within {ATTACH_TIMEOUT:?}"))),
    }
}
