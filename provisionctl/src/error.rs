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
  5    watch: the run is stalled (nothing more can happen without a change);
       delete --wait: the run is paused, so its cleanup waits
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

    /// Whether a server that refused the client's certificate could be
    /// behind this failure: it refuses after the handshake, and the call
    /// sees a broken connection, a cancelled stream or an unavailable
    /// server, never the refusal itself.
    pub fn may_be_a_refused_handshake(&self) -> bool {
        matches!(
            self,
            CliError::Other(_) | CliError::Unavailable { .. } | CliError::OutcomeUnknown { .. }
        )
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
    // A failed handshake or first frame: the request was never processed.
    if let Some(problem) = connection_problem(&chain(status), server) {
        return problem;
    }
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

/// How this command reaches the server, for messages about the connection:
/// the TLS files it was given, or plaintext.
#[derive(Debug, Clone, Default)]
pub struct Reach {
    pub tls_ca: Option<String>,
    pub tls_cert: Option<String>,
    pub insecure: bool,
}

static REACH: std::sync::OnceLock<Reach> = std::sync::OnceLock::new();

/// Records how this command reaches the server (once, when it first does).
pub fn set_reach(reach: Reach) {
    let _ = REACH.set(reach);
}

/// The texts of an error and every error under it, outermost first.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut texts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        texts.push(s.to_string());
        source = s.source();
    }
    texts
}

/// What [`speaks_tls`] finds, as [`connection_problem`] reads it.
pub const SPEAKS_TLS: &str = "answered plaintext HTTP/2 with TLS";

/// Whether the server at `host:port` answers the start of a plaintext HTTP/2
/// connection with a TLS record (a TLS server's alert), as a driver serving
/// TLS does; asked before a plaintext (`--insecure`) command's first call, so
/// that pointing it at a TLS driver is told as such rather than as the
/// broken pipe or protocol error the call would end in. `None`: it could not
/// tell (no answer, or not in time).
pub async fn speaks_tls(host: &str, port: u16) -> Option<bool> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect((host, port)).await.ok()?;
        // The connection preface and an empty SETTINGS frame.
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        stream.write_all(&hello).await.ok()?;
        let mut first = [0_u8; 5];
        let n = stream.read(&mut first).await.ok()?;
        // A TLS record: content type 21 (alert) or 22 (handshake), version 3.x.
        Some(n >= 2 && matches!(first[0], 21 | 22) && first[1] == 3)
    };
    tokio::time::timeout(std::time::Duration::from_secs(2), probe)
        .await
        .ok()
        .flatten()
}

/// A connection that failed for a reason the user can fix on the command
/// line (the wrong CA, TLS against plaintext, a port that is not the
/// driver's), told in those terms. Nothing was processed by the server in any
/// of these cases: the handshake or the first frame failed.
pub fn connection_problem(chain: &[String], server: &str) -> Option<CliError> {
    let reach = REACH.get().cloned().unwrap_or_default();
    let has = |needle: &str| chain.iter().any(|t| t.contains(needle));
    let ca = reach.tls_ca.as_deref().unwrap_or("--tls-ca");
    let unavailable = |message: String| Some(CliError::Unavailable { message });
    if has("InvalidContentType") || has("corrupt message") {
        return unavailable(format!(
            "the server at {server} does not speak TLS (it answered in plaintext)\nif it is a driver \
             started with --insecure, give --insecure (PROVISIONCTL_INSECURE=true) instead of --tls-ca; \
             else check the address"
        ));
    }
    if reach.insecure && has(SPEAKS_TLS) {
        return unavailable(format!(
            "the server at {server} {SPEAKS_TLS}, and --insecure is plaintext\ngive --tls-ca \
             (PROVISIONCTL_TLS_CA) with the CA that issued the driver's certificate instead of --insecure"
        ));
    }
    if has("UnknownIssuer") || has("BadSignature") {
        return unavailable(format!(
            "the server at {server} presented a certificate that the CA in {ca} did not issue\ngive \
             --tls-ca the CA bundle that issued the driver's certificate (`provisionctl certs` writes it \
             as ca.pem beside the certificates)"
        ));
    }
    if let Some(t) = chain.iter().find(|t| t.contains("NotValidForName")) {
        return unavailable(format!(
            "the server at {server} presented a certificate that is not valid for that address ({t})\nuse \
             a host name the certificate names, or issue one for this address (`provisionctl certs \
             --host`)"
        ));
    }
    if has("Expired") && has("certificate") {
        return unavailable(format!(
            "the server at {server} presented an expired certificate\nits operator must renew it"
        ));
    }
    if has("CertificateRequired") {
        return unavailable(format!(
            "the server at {server} requires a client certificate, and this command gave none\nthe \
             driver's public port does not require one: if {server} is the decider's or the executor's \
             port, --server should name driver-svc's; else give --tls-cert and --tls-key"
        ));
    }
    if has("UnknownCA") || has("BadCertificate") || has("DecryptError") {
        let cert = reach.tls_cert.as_deref().unwrap_or("--tls-cert");
        return unavailable(format!(
            "the server at {server} refused this command's client certificate ({cert}): it was not \
             issued by the CA the server trusts\ngive a certificate from the server's CA, or none (the \
             driver's public port does not require one)"
        ));
    }
    None
}

/// Translates a gRPC status into the user's words. Specific commands handle
/// the statuses they can explain better (an apply's `FAILED_PRECONDITION`)
/// before falling back to this.
pub fn from_status(status: &tonic::Status, doing: Doing<'_>, server: &str) -> CliError {
    use tonic::Code;
    if let Some(problem) = connection_problem(&chain(status), server) {
        return problem;
    }
    let msg = plain(status.message());
    if matches!(status.code(), Code::PermissionDenied | Code::Unauthenticated)
        && msg.contains(platform::tls::INTERNAL_PORT)
    {
        return CliError::Unavailable {
            message: format!(
                "the server at {server} is not the driver: {msg}\n--server (or PROVISIONCTL_SERVER) should \
                 name driver-svc's public port"
            ),
        };
    }
    match status.code() {
        Code::InvalidArgument => CliError::refused(format!("the server rejected the request: {msg}"), None),
        Code::NotFound => match doing {
            // The run is there; something named in it is not.
            Doing::Run { run, .. } if msg.starts_with("the run has no ") => CliError::NotFound {
                message: format!("run {run} {}", msg.trim_start_matches("the run ")),
                hint: Some(format!("`provisionctl get {run}` shows its groups")),
            },
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
            format!(
                "the server at {server} cannot {doing}: it does not serve that call{}",
                if msg.is_empty() {
                    String::new()
                } else {
                    format!(" ({msg})")
                }
            ),
            Some(
                "it is not driver-svc (is --server the decider's or the executor's port?), or it runs an \
                 older version of driver-svc"
                    .to_owned(),
            ),
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
    fn a_missing_group_is_told_as_such_not_as_a_missing_run() {
        let e = from_status(
            &tonic::Status::not_found("the run has no group gpu"),
            Doing::Run {
                verb: "promote",
                run: "x",
            },
            "s",
        );
        assert_eq!(e.exit(), Exit::Failed);
        assert_eq!(
            e.to_string(),
            "run x has no group gpu\n`provisionctl get x` shows its groups"
        );
    }

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
