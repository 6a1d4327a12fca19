//! The process backend's state directory: one subdirectory per identity, and
//! the checks that tell whether the agent a directory names is alive.
//!
//! A PID alone never proves anything: PIDs are reused. An agent is alive when
//! the process its records name exists, is not a zombie, and is that agent:
//! its kernel start time equals the one the agent recorded in `agent.json`, or,
//! before the agent has written that record, its command line names the
//! directory (`--state-dir <dir>`), which no other program's does. An agent so
//! young that neither record exists yet is found by scanning `/proc` for that
//! command line, so a create that races a restart never spawns a second agent.
//!
//! Everything here is synchronous and cheap (a few small files); the backend
//! calls it from its tasks directly.

use std::{
    io,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
};

use contract::ResourceIdentity;

use super::agent_protocol::{
    AGENT_RECORD, AgentRecord, ENDPOINT_FILE, LAUNCH_RECORD, LaunchRecord, RecordError, SESSION_RECORD,
    SessionRecord, read_json,
};

/// The agent flag that names its state directory; the command-line check looks
/// for it followed by the directory.
pub const STATE_DIR_FLAG: &str = "--state-dir";

/// The name of an identity's directory under the root. `_` appears in none of
/// the ids, so the name is unambiguous; the records inside hold the identity
/// itself, so nothing parses the name back.
pub fn dir_name(identity: &ResourceIdentity) -> String {
    format!(
        "{}_{}_{}_a{}",
        identity.run_uid,
        identity.run_id,
        identity.node,
        identity.attempt.get()
    )
}

/// What `/proc/<pid>/stat` says about a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// The state letter: `R`, `S`, `D`, `T` (stopped), `Z` (zombie), ...
    pub state: char,
    /// Clock ticks after boot at which the process started.
    pub start_time: u64,
}

impl ProcStat {
    /// A zombie or a dying process has ended: only its exit status is left.
    pub fn has_exited(self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Parses the text of `/proc/<pid>/stat`. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted from after its last `)`.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let (_, rest) = text.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3) comes field 4; the start time is field 22.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start_time })
}

/// The stat of `pid`, or `None` when no such process exists.
pub fn read_stat(pid: i32) -> io::Result<Option<ProcStat>> {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(text) => parse_stat(&text)
            .map(Some)
            .ok_or_else(|| io::Error::other(format!("/proc/{pid}/stat is malformed"))),
        Err(e) if matches!(e.kind(), io::ErrorKind::NotFound) || e.raw_os_error() == Some(3) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The calling process's kernel start time, for its `agent.json`.
pub fn own_start_time() -> io::Result<u64> {
    let text = std::fs::read_to_string("/proc/self/stat")?;
    parse_stat(&text)
        .map(|s| s.start_time)
        .ok_or_else(|| io::Error::other("/proc/self/stat is malformed"))
}

/// Whether `pid`'s command line contains `--state-dir <dir>`.
pub fn cmdline_names_dir(pid: i32, dir: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    args.windows(2)
        .any(|w| w[0] == STATE_DIR_FLAG.as_bytes() && w[1] == dir.as_os_str().as_bytes())
}

/// Live processes whose command line names `dir`: the agents of that directory,
/// however young. Normally none or one.
pub fn processes_naming(dir: &Path) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .filter(|&pid| cmdline_names_dir(pid, dir))
        .filter(|&pid| matches!(read_stat(pid), Ok(Some(stat)) if !stat.has_exited()))
        .collect()
}

/// Whether the agent `record` describes is this very process, alive.
pub fn agent_alive(record: &AgentRecord) -> bool {
    matches!(read_stat(record.pid), Ok(Some(stat)) if !stat.has_exited() && stat.start_time == record.start_time)
}

/// What one identity's directory holds, and whether its agent lives.
#[derive(Debug, Clone)]
pub struct AgentEntry {
    pub dir: PathBuf,
    pub agent: Option<AgentRecord>,
    pub launch: Option<LaunchRecord>,
    /// The PID of the live agent, when one is alive.
    pub live_pid: Option<i32>,
    /// The last PID the records name, alive or not.
    pub last_pid: Option<i32>,
    pub endpoint: Option<String>,
    pub session: Option<SessionRecord>,
}

impl AgentEntry {
    pub fn is_alive(&self) -> bool {
        self.live_pid.is_some()
    }

    /// The identity, from whichever record exists.
    pub fn identity(&self) -> Option<ResourceIdentity> {
        let record = self
            .agent
            .as_ref()
            .map(|a| &a.identity)
            .or(self.launch.as_ref().map(|l| &l.identity))?;
        ResourceIdentity::try_from(record).ok()
    }
}

/// Reads an identity's directory and decides whether its agent is alive.
pub fn inspect(dir: &Path) -> Result<AgentEntry, RecordError> {
    let agent: Option<AgentRecord> = read_json(dir, AGENT_RECORD)?;
    let launch: Option<LaunchRecord> = read_json(dir, LAUNCH_RECORD)?;
    let live_pid = match (&agent, &launch) {
        (Some(a), _) => agent_alive(a).then_some(a.pid),
        (None, Some(l)) => {
            let alive = matches!(read_stat(l.pid), Ok(Some(stat)) if !stat.has_exited())
                && cmdline_names_dir(l.pid, dir);
            alive.then_some(l.pid)
        }
        // Neither record: only a scan can tell whether an agent has just been
        // started for this directory.
        (None, None) => processes_naming(dir).first().copied(),
    };
    let last_pid = agent
        .as_ref()
        .map(|a| a.pid)
        .or(launch.as_ref().map(|l| l.pid))
        .or(live_pid);
    let endpoint = match std::fs::read_to_string(dir.join(ENDPOINT_FILE)) {
        Ok(s) if !s.trim().is_empty() => Some(s.trim().to_owned()),
        Ok(_) => None,
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(RecordError::Read {
                path: dir.join(ENDPOINT_FILE),
                source,
            });
        }
    };
    let session = read_json(dir, SESSION_RECORD)?;
    Ok(AgentEntry {
        dir: dir.to_owned(),
        agent,
        launch,
        live_pid,
        last_pid,
        endpoint,
        session,
    })
}

/// Every identity directory under `root` with what it holds. A directory that
/// cannot be read is logged and left out: one broken directory must not hide
/// the others.
pub fn scan(root: &Path) -> io::Result<Vec<AgentEntry>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root)? {
        let entry = entry?;
        if !entry.file_type()?.is_dir() || entry.file_name().as_bytes().starts_with(b".") {
            continue;
        }
        let dir = entry.path();
        match inspect(&dir) {
            Ok(found) => out.push(found),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "skipping an unreadable agent directory")
            }
        }
    }
    out.sort_by(|a, b| a.dir.cmp(&b.dir));
    Ok(out)
}

/// Removes files a dead agent left, before a new agent starts in the same
/// directory. The log is kept, appended to, for whoever investigates the death.
pub fn clear_records(dir: &Path) -> io::Result<()> {
    for name in [AGENT_RECORD, LAUNCH_RECORD, ENDPOINT_FILE, SESSION_RECORD] {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

// Tests panic on purpose when an expectation fails.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_even_with_odd_command_names() {
        let line = "4242 (node agent) (x)) S 1 4242 4242 0 -1 4194560 120 0 0 0 1 2 0 0 20 0 3 0 987654 \
                    1000 200 18446744073709551615";
        assert_eq!(
            parse_stat(line),
            Some(ProcStat {
                state: 'S',
                start_time: 987654
            })
        );
        assert!(parse_stat("4242 (short) Z 1 2").is_none());
        let zombie = parse_stat("7 (a) Z 1 7 7 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 55 0 0").unwrap();
        assert!(zombie.has_exited());
    }

    #[test]
    fn this_process_is_alive_and_a_wrong_start_time_is_not() {
        let pid = i32::try_from(std::process::id()).unwrap();
        let start_time = own_start_time().unwrap();
        let record = |start_time| AgentRecord {
            version: 1,
            pid,
            start_time,
            identity: super::super::agent_protocol::IdentityRecord {
                run_uid: String::new(),
                run_id: String::new(),
                node: String::new(),
                attempt: 0,
            },
            started_at_ms: 0,
        };
        assert!(agent_alive(&record(start_time)));
        assert!(
            !agent_alive(&record(start_time + 1)),
            "a reused PID is not the agent"
        );
        assert!(!cmdline_names_dir(pid, Path::new("/nowhere")));
    }
}
