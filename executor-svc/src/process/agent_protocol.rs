//! What the executor and a node agent say to each other, and what the agent
//! leaves in its state directory.
//!
//! **The session protocol** runs over one TCP connection to the agent's
//! endpoint, as newline-delimited JSON objects tagged by a `"type"` field. The
//! client's first line is a [`Request`]:
//!
//! - `{"type":"start","boot":{..},"join":{..},"known":null}` starts the agent's
//!   bootstrap session, or adopts the one it already has (a node has at most one
//!   session that is not cancelled). `known` names a session and the last stage
//!   sequence the client already relayed, so an adopting client is not sent
//!   those stages again.
//! - `{"type":"attach","session":"..","after_seq":N}` re-attaches to a session
//!   (an executor that restarted) and streams its stages after `N`, from the
//!   agent's stage log, then the live ones.
//! - `{"type":"cancel","session":null}` ends the session (the named one, or
//!   whichever exists); the agent answers `cancelled` and closes.
//! - `{"type":"ping"}` is the executor's health probe; the agent answers
//!   `{"type":"pong"}` and closes.
//!
//! After a `start` or `attach` the agent answers `accepted` (or `error`), then
//! sends `stage` lines (`{"type":"stage","seq":1,"stage":"connected",
//! "detail":"..","at_ms":..}`, sequence numbers from 1 per session) as the
//! stages happen, and `end` once the session converged, failed or was
//! cancelled. A client may send `cancel` on the same connection. A connection
//! that closes without `end` means the agent went away (or hangs, when it stays
//! open and silent).
//!
//! **The state directory** of one agent holds `launch.json` (written by the
//! executor right after it spawned the agent), `agent.json` (the agent's own
//! identity record, with the kernel's start time of its process so a reused PID
//! is never mistaken for it), `endpoint` (the bound address, once bound),
//! `session.json` (the session's status and stage log, so a restarted executor
//! can replay it even when the agent has died) and `agent.log`. Every file but
//! the log is written whole: to a temporary name, then renamed.

use std::{
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
};

use contract::{
    AttemptId, BootstrapStage, FieldError, LogicalNodeId, Param, Params, ResourceIdentity, RunId, RunUid,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt as _, AsyncReadExt as _};

/// The format version of the records in a state directory.
pub const RECORD_VERSION: u32 = 1;

/// The longest protocol line either side accepts, so a confused peer cannot make
/// the other buffer without bound.
pub const MAX_LINE_BYTES: u64 = 1 << 20;

/// The agent's record of itself, `agent.json`.
pub const AGENT_RECORD: &str = "agent.json";
/// The executor's record of a spawn, `launch.json`.
pub const LAUNCH_RECORD: &str = "launch.json";
/// The bound address, `endpoint`.
pub const ENDPOINT_FILE: &str = "endpoint";
/// The session's status and stage log, `session.json`.
pub const SESSION_RECORD: &str = "session.json";
/// The agent's stdout and stderr.
pub const AGENT_LOG: &str = "agent.log";

/// Boot parameter: milliseconds between two stages.
pub const PARAM_STAGE_DELAY_MS: &str = "stage_delay_ms";
/// Boot parameter: emit the failure of this stage and end the session.
pub const PARAM_FAIL_AT: &str = "fault.fail_at";
/// Boot parameter: the agent process kills itself (SIGKILL) at this stage.
pub const PARAM_CRASH_AT: &str = "fault.crash_at";
/// Boot parameter: the agent stops streaming at this stage and keeps the
/// connection open.
pub const PARAM_HANG_AT: &str = "fault.hang_at";
/// Boot parameter, read at `CreateLease`: the agent binds its endpoint this many
/// milliseconds after it starts.
pub const PARAM_ENDPOINT_DELAY_MS: &str = "fault.endpoint_delay_ms";

/// The stages of a bootstrap that goes well, in order.
pub const STAGE_PLAN: [BootstrapStage; 5] = BootstrapStage::PROGRESS;

/// A boot or join parameter on the wire. The agent needs secret values to do its
/// work, and keeps the flag so that it never puts one in a detail or a log.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireParam {
    pub value: String,
    #[serde(default)]
    pub secret: bool,
}

/// Redacts secret values, as [`Param`]'s `Debug` does, so that logging a request
/// never leaks one.
impl std::fmt::Debug for WireParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.secret {
            f.write_str("<redacted>")
        } else {
            write!(f, "{:?}", self.value)
        }
    }
}

/// Parameters as the protocol carries them.
pub type WireParams = BTreeMap<String, WireParam>;

pub fn params_to_wire(params: &Params) -> WireParams {
    params
        .iter()
        .map(|(k, p)| {
            (
                k.clone(),
                WireParam {
                    value: p.value.clone(),
                    secret: p.secret,
                },
            )
        })
        .collect()
}

/// A parameter's value, if it is set and not secret (fault directives are never
/// secret; a secret one is ignored rather than echoed into an error).
fn plain<'a>(params: &'a WireParams, key: &str) -> Option<&'a str> {
    params.get(key).filter(|p| !p.secret).map(|p| p.value.as_str())
}

/// The endpoint delay a node template asks for, from its boot parameters.
pub fn endpoint_delay_ms(boot: &Params) -> Result<u64, String> {
    match boot.get(PARAM_ENDPOINT_DELAY_MS) {
        None => Ok(0),
        Some(Param { value, .. }) => value
            .trim()
            .parse()
            .map_err(|e| format!("{PARAM_ENDPOINT_DELAY_MS}={value:?} is not a number of milliseconds: {e}")),
    }
}

/// How a session should go, from its boot parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionPlan {
    pub stage_delay_ms: u64,
    pub fail_at: Option<BootstrapStage>,
    pub crash_at: Option<BootstrapStage>,
    pub hang_at: Option<BootstrapStage>,
}

impl SessionPlan {
    /// Reads the plan; an unknown stage name or a malformed number is an error
    /// that names the parameter (the same parameters will never work, so the
    /// executor reports it as permanent).
    pub fn from_boot(boot: &WireParams, default_stage_delay_ms: u64) -> Result<Self, String> {
        let stage = |key: &str| -> Result<Option<BootstrapStage>, String> {
            match plain(boot, key) {
                None => Ok(None),
                Some(name) => BootstrapStage::from_name(name.trim())
                    .filter(|s| STAGE_PLAN.contains(s))
                    .map(Some)
                    .ok_or_else(|| {
                        format!(
                            "{key}={name:?} is not a bootstrap stage (one of connected, boot-check, \
                             agent-started, joined, converged)"
                        )
                    }),
            }
        };
        let stage_delay_ms = match plain(boot, PARAM_STAGE_DELAY_MS) {
            None => default_stage_delay_ms,
            Some(v) => v
                .trim()
                .parse()
                .map_err(|e| format!("{PARAM_STAGE_DELAY_MS}={v:?} is not a number of milliseconds: {e}"))?,
        };
        Ok(Self {
            stage_delay_ms,
            fail_at: stage(PARAM_FAIL_AT)?,
            crash_at: stage(PARAM_CRASH_AT)?,
            hang_at: stage(PARAM_HANG_AT)?,
        })
    }
}

/// A stage name on the wire; an unknown name fails to parse.
mod stage_name {
    use contract::BootstrapStage;
    use serde::{Deserialize, Deserializer, Serializer, de::Error as _};

    pub fn serialize<S: Serializer>(stage: &BootstrapStage, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(stage.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BootstrapStage, D::Error> {
        let name = String::deserialize(d)?;
        BootstrapStage::from_name(&name).ok_or_else(|| D::Error::custom(format!("unknown stage {name:?}")))
    }
}

/// One stage of a session, as the agent logs and streams it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageLine {
    pub seq: u64,
    #[serde(with = "stage_name")]
    pub stage: BootstrapStage,
    pub detail: String,
    pub at_ms: u64,
}

/// A session the client already knows, and how far it relayed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KnownSession {
    pub session: String,
    pub after_seq: u64,
}

/// The first line a client sends (and `cancel`, on a session's connection).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Request {
    Start {
        boot: WireParams,
        join: WireParams,
        #[serde(default)]
        known: Option<KnownSession>,
    },
    Attach {
        session: String,
        after_seq: u64,
    },
    Cancel {
        #[serde(default)]
        session: Option<String>,
    },
    /// A health probe: the agent answers `pong` and closes. (A connect alone
    /// proves nothing of a stopped agent: the kernel accepts for it.)
    Ping,
}

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EndReason {
    Converged,
    Failed,
    Cancelled,
}

/// What the agent sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Reply {
    /// The session this connection streams; `adopted` when it existed before.
    Accepted {
        session: String,
        adopted: bool,
    },
    Stage(StageLine),
    End {
        reason: EndReason,
    },
    /// The answer to a `ping`.
    Pong,
    /// The answer to a `cancel` on a connection of its own.
    Cancelled {
        session: Option<String>,
        existed: bool,
    },
    /// The request was refused; `permanent` when the same request will never
    /// succeed (malformed fault directives).
    Error {
        reason: String,
        permanent: bool,
    },
}

/// Where a session is, as `session.json` records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SessionStatus {
    Running,
    /// Stopped streaming on a `fault.hang_at`; still open.
    Hung,
    Converged,
    Failed,
    Cancelled,
}

impl SessionStatus {
    /// Why the session ended, if it has.
    pub fn end_reason(self) -> Option<EndReason> {
        match self {
            SessionStatus::Running | SessionStatus::Hung => None,
            SessionStatus::Converged => Some(EndReason::Converged),
            SessionStatus::Failed => Some(EndReason::Failed),
            SessionStatus::Cancelled => Some(EndReason::Cancelled),
        }
    }
}

/// `session.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub version: u32,
    pub session: String,
    pub status: SessionStatus,
    pub stages: Vec<StageLine>,
}

/// An agent's identity as records spell it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityRecord {
    pub run_uid: String,
    pub run_id: String,
    pub node: String,
    pub attempt: u64,
}

impl From<&ResourceIdentity> for IdentityRecord {
    fn from(id: &ResourceIdentity) -> Self {
        Self {
            run_uid: id.run_uid.to_string(),
            run_id: id.run_id.as_str().to_owned(),
            node: id.node.to_string(),
            attempt: id.attempt.get(),
        }
    }
}

impl TryFrom<&IdentityRecord> for ResourceIdentity {
    type Error = FieldError;

    fn try_from(r: &IdentityRecord) -> Result<Self, FieldError> {
        Ok(Self {
            run_uid: RunUid::parse("run_uid", &r.run_uid)?,
            run_id: RunId::parse("run_id", &r.run_id)?,
            node: LogicalNodeId::parse("node", &r.node)?,
            attempt: AttemptId::new(r.attempt),
        })
    }
}

/// `agent.json`: written by the agent once it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRecord {
    pub version: u32,
    pub pid: i32,
    /// The process's start time in clock ticks since boot (`/proc/<pid>/stat`,
    /// field 22): with the PID it names this process and no later one.
    pub start_time: u64,
    pub identity: IdentityRecord,
    pub started_at_ms: u64,
}

/// `launch.json`: written by the executor as soon as the spawn returned, so a
/// starting agent is known before it has written its own record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchRecord {
    pub version: u32,
    pub pid: i32,
    pub identity: IdentityRecord,
    pub launched_at_ms: u64,
}

/// Writes `bytes` to `dir/name` whole: to a temporary name in the same
/// directory, then renamed over the target, so a reader (or a crash) sees the
/// old file or the new one, never part of one.
pub fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(name))
}

/// Serialises `value` and writes it with [`write_atomically`].
pub fn write_json<T: Serialize>(dir: &Path, name: &str, value: &T) -> io::Result<()> {
    let bytes = serde_json::to_vec(value).map_err(io::Error::other)?;
    write_atomically(dir, name, &bytes)
}

/// Why a record could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is malformed: {reason}")]
    Malformed { path: PathBuf, reason: String },
}

/// Reads a JSON record; `None` when it does not exist (yet, or any more).
pub fn read_json<T: for<'de> Deserialize<'de>>(dir: &Path, name: &str) -> Result<Option<T>, RecordError> {
    let path = dir.join(name);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(RecordError::Read { path, source }),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| RecordError::Malformed {
            path,
            reason: e.to_string(),
        })
}

/// Reads one protocol line and parses it; `None` at a clean end of the stream.
/// A line longer than [`MAX_LINE_BYTES`], a stream that ends mid-line and a
/// line that is not the expected message are all `InvalidData`.
///
/// Not cancellation safe (a partly read line is lost): callers that select
/// over it read on a task of their own.
pub async fn read_message<T, R>(reader: &mut R) -> io::Result<Option<T>>
where
    T: for<'de> Deserialize<'de>,
    R: AsyncBufRead + Unpin,
{
    let mut line = Vec::new();
    let n = (&mut *reader)
        .take(MAX_LINE_BYTES)
        .read_until(b'\n', &mut line)
        .await?;
    if n == 0 {
        return Ok(None);
    }
    if line.last() != Some(&b'\n') {
        let why = if line.len() as u64 >= MAX_LINE_BYTES {
            format!("a protocol line is longer than {MAX_LINE_BYTES} bytes")
        } else {
            "the stream ended in the middle of a line".to_owned()
        };
        return Err(io::Error::new(io::ErrorKind::InvalidData, why));
    }
    serde_json::from_slice(&line)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Serialises one protocol message as a line.
pub fn to_line<T: Serialize>(message: &T) -> io::Result<Vec<u8>> {
    let mut line = serde_json::to_vec(message).map_err(io::Error::other)?;
    line.push(b'\n');
    Ok(line)
}

// Tests panic on purpose when an expectation fails.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn boot(pairs: &[(&str, &str)]) -> WireParams {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    (*k).to_owned(),
                    WireParam {
                        value: (*v).to_owned(),
                        secret: false,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn messages_are_flat_tagged_lines() {
        let stage = Reply::Stage(StageLine {
            seq: 3,
            stage: BootstrapStage::AgentStarted,
            detail: "ok".to_owned(),
            at_ms: 17,
        });
        let line = String::from_utf8(to_line(&stage).unwrap()).unwrap();
        assert_eq!(
            line,
            "{\"type\":\"stage\",\"seq\":3,\"stage\":\"agent-started\",\"detail\":\"ok\",\"at_ms\":17}\n"
        );
        assert_eq!(serde_json::from_str::<Reply>(&line).unwrap(), stage);

        let secret = Request::Start {
            boot: [(
                "token".to_owned(),
                WireParam {
                    value: "hunter2".to_owned(),
                    secret: true,
                },
            )]
            .into_iter()
            .collect(),
            join: WireParams::new(),
            known: None,
        };
        assert!(
            !format!("{secret:?}").contains("hunter2"),
            "secrets never reach a log"
        );

        let cancel: Request = serde_json::from_str(r#"{"type":"cancel"}"#).unwrap();
        assert_eq!(cancel, Request::Cancel { session: None });
        let bad = serde_json::from_str::<Reply>(
            r#"{"type":"stage","seq":1,"stage":"dancing","detail":"","at_ms":0}"#,
        );
        assert!(bad.unwrap_err().to_string().contains("dancing"));
    }

    #[test]
    fn the_plan_reads_fault_directives_and_names_a_bad_one() {
        let plan = SessionPlan::from_boot(
            &boot(&[
                (PARAM_FAIL_AT, "boot-check"),
                (PARAM_HANG_AT, "joined"),
                (PARAM_STAGE_DELAY_MS, "7"),
            ]),
            25,
        )
        .unwrap();
        assert_eq!(plan.fail_at, Some(BootstrapStage::BootCheck));
        assert_eq!(plan.hang_at, Some(BootstrapStage::Joined));
        assert_eq!(plan.crash_at, None);
        assert_eq!(plan.stage_delay_ms, 7);
        assert_eq!(SessionPlan::from_boot(&boot(&[]), 25).unwrap().stage_delay_ms, 25);

        let err = SessionPlan::from_boot(&boot(&[(PARAM_CRASH_AT, "failed-join")]), 25).unwrap_err();
        assert!(err.contains(PARAM_CRASH_AT), "{err}");
        let err = SessionPlan::from_boot(&boot(&[(PARAM_STAGE_DELAY_MS, "soon")]), 25).unwrap_err();
        assert!(err.contains(PARAM_STAGE_DELAY_MS), "{err}");
    }

    #[test]
    fn identities_round_trip_through_records() {
        let id = ResourceIdentity {
            run_uid: RunUid::from_u128(0xfeed),
            run_id: RunId::parse("run_id", "train").unwrap(),
            node: LogicalNodeId::parse("node", "workers-3").unwrap(),
            attempt: AttemptId::new(9),
        };
        let record = IdentityRecord::from(&id);
        assert_eq!(ResourceIdentity::try_from(&record).unwrap(), id);
        let broken = IdentityRecord {
            node: "workers".to_owned(),
            ..record
        };
        assert_eq!(ResourceIdentity::try_from(&broken).unwrap_err().field, "node");
    }
}
