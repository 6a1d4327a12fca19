//! `provisionctl`'s side of authentication: the bearer token it sends on
//! every call (from `--token-file` or `PROVISIONCTL_TOKEN`), and the `token`
//! commands that make a token and the driver's tokens-file entry for it.

use std::{fmt, io::Read as _, path::Path};

use tonic::{
    Request, Status,
    metadata::{Ascii, MetadataValue},
    service::Interceptor,
};

use super::{
    cli::TokenCommand,
    error::{CliError, Exit},
};
use platform::token as auth;

/// The environment variable that may hold the token itself.
pub const TOKEN_ENV: &str = "PROVISIONCTL_TOKEN";

/// Adds `authorization: Bearer <token>` to every call, when there is a
/// token. Its `Debug` never shows the token.
#[derive(Clone, Default)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "BearerToken(<redacted>)"
        } else {
            "BearerToken(none)"
        })
    }
}

impl BearerToken {
    /// No token: calls go without credentials.
    pub fn none() -> Self {
        Self(None)
    }

    /// `token`, checked to be sendable as metadata.
    pub fn new(token: &str) -> Result<Self, String> {
        let token = token.trim();
        if token.is_empty() {
            return Err("the token is empty".to_owned());
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("the token is not printable ASCII text without spaces".to_owned());
        }
        let mut value: MetadataValue<Ascii> = format!("Bearer {token}")
            .parse()
            .map_err(|_| "the token cannot be sent as metadata".to_owned())?;
        value.set_sensitive(true);
        Ok(Self(Some(value)))
    }

    /// The token `--token-file` names, else `PROVISIONCTL_TOKEN`, else none.
    pub fn from_args(token_file: Option<&Path>) -> Result<Self, CliError> {
        if let Some(path) = token_file {
            let text = std::fs::read_to_string(path).map_err(|e| CliError::Read {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
            return Self::new(&text).map_err(|why| {
                CliError::Other(format!("the token file {} cannot be used: {why}", path.display()))
            });
        }
        match std::env::var(TOKEN_ENV) {
            Ok(token) if !token.trim().is_empty() => {
                Self::new(&token).map_err(|why| CliError::Other(format!("{TOKEN_ENV} cannot be used: {why}")))
            }
            _ => Ok(Self::none()),
        }
    }
}

impl Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

/// `--expires`: an RFC 3339 time, or a duration from now, as the entry's
/// `expires` (RFC 3339, UTC).
fn expiry(when: &str) -> Result<String, CliError> {
    let at = match platform::token::parse_expiry(when) {
        Ok(at) => at,
        Err(not_a_time) => {
            let wait = humantime::parse_duration(when.trim()).map_err(|_| {
                CliError::Usage(format!(
                    "--expires {when:?} is neither a time nor a duration: give an RFC 3339 time \
                     (2027-01-31T00:00:00Z) or a duration from now (30d, 12h); {not_a_time}"
                ))
            })?;
            std::time::SystemTime::now() + wait
        }
    };
    if at <= std::time::SystemTime::now() {
        return Err(CliError::Usage(format!("--expires {when:?} is in the past")));
    }
    Ok(platform::token::format_expiry(at))
}

/// Runs a `token` command (no server involved).
pub fn run(cmd: TokenCommand) -> Result<Exit, CliError> {
    match cmd {
        TokenCommand::New {
            name,
            access,
            runs,
            save,
            expires,
        } => {
            let expires = expires.as_deref().map(expiry).transpose()?;
            let runs = (!runs.is_empty()).then_some(runs);
            if let Some(runs) = &runs {
                for r in runs {
                    contract::RunId::parse("--run", r).map_err(|e| CliError::Other(e.to_string()))?;
                }
            }
            let token = auth::new_token()
                .map_err(|e| CliError::Other(format!("cannot get random bytes for a token: {e}")))?;
            let mut entry = auth::entry_for(&name, &token, access, runs);
            entry.expires = expires;
            let yaml = serde_yaml_ng::to_string(&[entry])
                .map_err(|e| CliError::Other(format!("cannot write the entry: {e}")))?;
            match save {
                Some(path) => {
                    save_token(&path, &token)?;
                    eprintln!(
                        "provisionctl: token {name:?} saved in {} (mode 600); add the entry printed to the \
                         driver's tokens file",
                        path.display()
                    );
                }
                None => eprintln!(
                    "provisionctl: token {name:?} (shown once; the tokens file keeps only its hash):\n{token}"
                ),
            }
            write_out(yaml.as_bytes())?;
            Ok(Exit::Success)
        }
        TokenCommand::Hash => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|e| CliError::Read {
                    path: "standard input".to_owned(),
                    reason: e.to_string(),
                })?;
            let token = text.trim();
            if token.is_empty() {
                return Err(CliError::Other("no token on standard input".to_owned()));
            }
            write_out(format!("{}\n", auth::to_hex(&auth::hash_token(token))).as_bytes())?;
            Ok(Exit::Success)
        }
    }
}

/// Writes `token` to a new file only its owner can read.
fn save_token(path: &Path, token: &str) -> Result<(), CliError> {
    use std::io::Write as _;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let fail = |e: std::io::Error| {
        CliError::Other(format!(
            "cannot save the token in {}: {e}{}",
            path.display(),
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                " (an existing file is never overwritten)"
            } else {
                ""
            }
        ))
    };
    let mut f = options.open(path).map_err(fail)?;
    f.write_all(format!("{token}\n").as_bytes()).map_err(fail)
}

/// Writes to standard output (a closed pipe ends the output quietly).
fn write_out(b: &[u8]) -> Result<(), CliError> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(b).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::Other(format!("cannot write the output: {e}")))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn the_token_goes_in_the_authorization_metadata_and_never_in_debug() {
        let mut t = BearerToken::new(" prov_abc\n").unwrap();
        assert!(!format!("{t:?}").contains("prov_abc"));
        let r = t.call(Request::new(())).unwrap();
        assert_eq!(r.metadata().get("authorization").unwrap(), "Bearer prov_abc");
        let mut none = BearerToken::none();
        assert!(
            none.call(Request::new(()))
                .unwrap()
                .metadata()
                .get("authorization")
                .is_none()
        );
        assert!(BearerToken::new("  ").is_err());
        assert!(BearerToken::new("caf\u{e9}").is_err());
    }

    #[test]
    fn a_saved_token_is_owner_only_and_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t");
        save_token(&p, "prov_x").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "prov_x\n");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        }
        assert!(
            save_token(&p, "prov_y")
                .unwrap_err()
                .to_string()
                .contains("never overwritten")
        );
        let t = BearerToken::from_args(Some(&p)).unwrap();
        assert!(format!("{t:?}").contains("redacted"));
    }
}
