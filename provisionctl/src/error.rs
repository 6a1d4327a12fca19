//! What can go wrong in `provisionctl`, said as the user's problem, and the
//! exit code each failure ends with.
//!
//! The exit codes are part of the interface (scripts branch on them) and are
//! listed once, in [`Exit`], which `--help` and the README repeat.

use std::fmt;

use crate::shapefile::ShapeFileError;

/// `provisionctl`'s exit codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The command did what was asked (`watch`: the run converged or was deleted).
    Success = 0,
    /// The request failed: a bad shape file, a refusal by the server, an
    /// unknown run or node. Nothing was changed.
    Failed = 1,
    /// The command line itself was wrong (clap's convention); also `plan
    /// --detailed-exitcode` when applying the file would change the run
    /// (terraform's convention).
    Usage = 2,
    /// `--timeout` expired before the run converged (`watch`) or was gone
    /// (`delete --wait`).
    Timeout = 3,
    /// The server could not be reached, or a service behind it is down.
    Unavailable = 4,
    /// `watch`: the run is stalled (its `Stalled` condition is true):
    /// nothing more can happen without a change to its shape.
    Stalled = 5,
    /// A change (apply, delete, pause, resume, abandon) was sent, and the
    /// connection broke or the call timed out before the answer came: it
    /// may or may not have taken effect.
    OutcomeUnknown = 6,
    /// Interrupted with Ctrl-C (128 + SIGINT, as shells report it).
    Interrupted = 130,
}

impl Exit {
    /// `plan --detailed-exitcode`: applying the file would change the run.
    pub const CHANGES: Exit = Exit::Usage;

    pub fn code(self) -> u8 {
        self as u8
    }
}

/// The exit-code table as `--help` prints it.
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
  0    success (watch: the run converged, or was deleted)
  1    the request failed: bad shape file, refused by the server, unknown run or node
  2    bad command line (plan --detailed-exitcode: the file would change the run)
  3    --timeout expired (watch: not converged; delete --wait: not gone)
  4    the server is unreachable or a service behind it is unavailable
  5    watch: the run is stalled (nothing more can happen without a change)
  6    a change was sent but its answer was lost: it may or may not have
       taken effect (check with `provisionctl get`)
  130  interrupted (Ctrl-C)";

/// A failed command. `Display` is the whole message the user reads.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}\nnothing was sent to the server")]
    ShapeFile(#[from] ShapeFileError),
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    /// The server understood and said no; `message` says why in plain words
    /// and `hint` what to do about it.
    #[error("{}", with_hint(message, hint))]
    Refused { message: String, hint: Option<String> },
    #[error("{}", with_hint(message, hint))]
    NotFound { message: String, hint: Option<String> },
    #[error("{message}")]
    Unavailable { message: String },
    #[error("{message}")]
    Timeout { message: String },
    #[error("{message}")]
    Stalled { message: String },
    /// A change was sent and no answer came back: it may have landed.
    #[error("{message}")]
    OutcomeUnknown { message: String },
    #[error("interrupted")]
    Interrupted,
    /// The command line is wrong in a way the parser cannot see (flags that
    /// only make sense together). The binary prints it as clap prints its
    /// own usage errors, and exits 2.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Other(String),
}

fn with_hint(message: &str, hint: &Option<String>) -> String {
    match hint {
        Some(h) => format!("{message}\n{h}"),
        None => message.to_owned(),
    }
}

impl CliError {
    pub fn exit(&self) -> Exit {
        match self {
            CliError::ShapeFile(_)
            | CliError::Read { .. }
            | CliError::Refused { .. }
            | CliError::NotFound { .. }
            | CliError::Other(_) => Exit::Failed,
            CliError::Unavailable { .. } => Exit::Unavailable,
            CliError::Timeout { .. } => Exit::Timeout,
            CliError::Stalled { .. } => Exit::Stalled,
            CliError::OutcomeUnknown { .. } => Exit::OutcomeUnknown,
            CliError::Interrupted => Exit::Interrupted,
            CliError::Usage(_) => Exit::Usage,
        }
    }

    pub fn refused(message: impl Into<String>, hint: impl Into<Option<String>>) -> Self {
        CliError::Refused {
            message: message.into(),
            hint: hint.into(),
        }
    }
}

/// What the user was doing when the server answered, so that a status can be
/// told in those terms.
#[derive(Debug, Clone, Copy)]
pub enum Doing<'a> {
    Run {
        verb: &'a str,
        run: &'a str,
    },
    Node {
        verb: &'a str,
        run: &'a str,
        node: &'a str,
    },
    /// A request about no run in particular; the text says what, e.g. `list runs`.
    Server(&'a str),
}

impl fmt::Display for Doing<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Doing::Run { verb, run } => write!(f, "{verb} run {run}"),
            Doing::Node { verb, run, node } => write!(f, "{verb} node {node} of run {run}"),
            Doing::Server(what) => f.write_str(what),
        }
    }
}

/// The driver's messages start with the error's own context (`invalid shape:`);
/// the user already knows what they sent, so the prefix is dropped.
fn plain(message: &str) -> &str {
    message.strip_prefix("invalid shape: ").unwrap_or(message)
}

/// Whether a failed call that changes something may still have taken
/// effect: the request may have reached the server, and what failed was the
/// connection or the clock, not the server's answer. A status the server
/// sent has no source error; one the transport made does. A connection that
/// was never made sent nothing. A deadline that passed (ours, or the
/// server's own request timeout) leaves the handler's work unknown.
pub fn outcome_unknown(status: &tonic::Status) -> bool {
    use tonic::Code;
    match status.code() {
        Code::DeadlineExceeded => true,
        Code::Unknown | Code::Cancelled | Code::Unavailable | Code::Internal => {
            let mut source = std::error::Error::source(status);
            if source.is_none() {
                return false;
            }
            while let Some(e) = source {
                let text = e.to_string();
                if text.contains("tcp connect error")
                    || text.contains("error trying to connect")
                    || text.contains("Connection refused")
                {
                    return false;
                }
                source = e.source();
            }
            true
        }
        _ => false,
    }
}

/// As [`from_status`], for a call that changes something: when the outcome
/// cannot be known, the user is told so (exit 6), never that nothing changed.
pub fn from_change_status(status: &tonic::Status, doing: Doing<'_>, server: &str) -> CliError {
    if outcome_unknown(status) {
        return CliError::OutcomeUnknown {
            message: format!(
                "the outcome is unknown: the request to {doing} was sent, then the call failed ({}); it \
                 may have taken effect. {}",
                plain(status.message()),
                match doing {
                    Doing::Run { run, .. } | Doing::Node { run, .. } =>
                        format!("Check with `provisionctl get {run}` before you try again"),
                    Doing::Server(_) => "Check with `provisionctl list` before you try again".to_owned(),
                }
            ),
        };
    }
    from_status(status, doing, server)
}

/// Translates a gRPC status into the user's words. Specific commands handle
/// the statuses they can explain better (an apply's `FAILED_PRECONDITION`)
/// before falling back to this.
pub fn from_status(status: &tonic::Status, doing: Doing<'_>, server: &str) -> CliError {
    use tonic::Code;
    let msg = plain(status.message());
    match status.code() {
        Code::InvalidArgument => CliError::refused(format!("the server rejected the request: {msg}"), None),
        Code::NotFound => match doing {
            Doing::Run { run, .. } => CliError::NotFound {
                message: format!("run {run} does not exist on {server}"),
                hint: Some("`provisionctl list` shows the runs there".to_owned()),
            },
            // The run itself may be what is missing; the driver says which.
            Doing::Node { run, .. } if msg.starts_with("run ") => CliError::NotFound {
                message: format!("run {run} does not exist on {server}"),
                hint: Some("`provisionctl list` shows the runs there".to_owned()),
            },
            Doing::Node { run, node, .. } => CliError::NotFound {
                message: format!("run {run} has no node {node}"),
                hint: Some(format!(
                    "nodes are named GROUP-INDEX; `provisionctl get {run} --nodes` lists them"
                )),
            },
            Doing::Server(_) => CliError::NotFound {
                message: msg.to_owned(),
                hint: None,
            },
        },
        Code::FailedPrecondition => CliError::refused(format!("the server refused to {doing}: {msg}"), None),
        Code::ResourceExhausted => CliError::refused(
            format!("the server is too busy to {doing} right now: {msg}"),
            Some(match retry_pushback(status) {
                Some(pause) => format!("the server asks to try again in {} ms", pause.as_millis()),
                None => "try again in a little while".to_owned(),
            }),
        ),
        Code::Unauthenticated => CliError::refused(
            format!("the server at {server} did not accept our credentials: {msg}"),
            Some(
                "give a token with --token-file PATH or PROVISIONCTL_TOKEN (the driver's operator makes \
                 one with `provisionctl token new`)"
                    .to_owned(),
            ),
        ),
        Code::PermissionDenied => {
            CliError::refused(format!("you are not allowed to {doing} on {server}: {msg}"), None)
        }
        Code::Unimplemented => CliError::refused(
            format!("the server at {server} cannot {doing} yet: {msg}"),
            Some("it runs an older or partial version of driver-svc".to_owned()),
        ),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => CliError::Unavailable {
            message: format!("could not {doing}: the server at {server} is unavailable ({msg})"),
        },
        _ => CliError::Other(format!("could not {doing}: the server failed: {msg}")),
    }
}

/// The pause a shed call asks for before it is sent again
/// (`grpc-retry-pushback-ms`), if it says.
pub fn retry_pushback(status: &tonic::Status) -> Option<std::time::Duration> {
    status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(std::time::Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_become_sentences_with_the_right_exit() {
        let e = from_status(
            &tonic::Status::not_found("run x not found"),
            Doing::Run {
                verb: "get",
                run: "x",
            },
            "http://h:1",
        );
        assert_eq!(e.exit(), Exit::Failed);
        let s = e.to_string();
        assert!(
            s.contains("run x does not exist on http://h:1") && s.contains("provisionctl list"),
            "{s}"
        );

        let e = from_status(
            &tonic::Status::unavailable("decider down"),
            Doing::Server("list runs"),
            "http://h:1",
        );
        assert_eq!(e.exit(), Exit::Unavailable);

        let e = from_status(
            &tonic::Status::invalid_argument("invalid shape: groups[0].count must not be negative"),
            Doing::Run {
                verb: "apply",
                run: "x",
            },
            "s",
        );
        assert_eq!(
            e.to_string(),
            "the server rejected the request: groups[0].count must not be negative"
        );
        assert!(!e.to_string().contains("InvalidArgument"));
    }

    #[test]
    fn only_a_change_whose_answer_was_lost_has_an_unknown_outcome() {
        let doing = Doing::Run {
            verb: "apply",
            run: "x",
        };
        // What the server said is known, whatever the code.
        for code in [
            tonic::Code::Unavailable,
            tonic::Code::Unknown,
            tonic::Code::Internal,
        ] {
            let sent = tonic::Status::new(code, "the store refused a write");
            assert!(!outcome_unknown(&sent), "{code:?}");
            assert_ne!(from_change_status(&sent, doing, "s").exit(), Exit::OutcomeUnknown);
        }
        // A deadline that passed leaves it unknown.
        let late = tonic::Status::deadline_exceeded("request timed out");
        let e = from_change_status(&late, doing, "s");
        assert_eq!(e.exit(), Exit::OutcomeUnknown);
        assert!(e.to_string().contains("provisionctl get x"), "{e}");
        // A broken connection after sending: unknown; a connection never made: not.
        let broken = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "error reading a body from connection",
        )));
        assert!(outcome_unknown(&broken), "{broken:?}");
        let refused = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "tcp connect error: Connection refused (os error 111)",
        )));
        assert!(!outcome_unknown(&refused), "{refused:?}");
    }

    #[test]
    fn exit_codes_are_the_documented_ones() {
        for (exit, code) in [
            (Exit::Success, 0),
            (Exit::Failed, 1),
            (Exit::Usage, 2),
            (Exit::Timeout, 3),
            (Exit::Unavailable, 4),
            (Exit::Stalled, 5),
            (Exit::OutcomeUnknown, 6),
            (Exit::Interrupted, 130),
        ] {
            assert_eq!(exit.code(), code);
            assert!(
                EXIT_CODES_HELP.contains(&format!("  {code} ")),
                "{code} undocumented"
            );
        }
    }
}
