//! Who may call the public API, and what they may do.
//!
//! **Authentication** is one tower layer, [`AuthLayer`], around the
//! `Provisioning` service only (health checks and reflection stay open): it
//! reads the `authorization: Bearer <token>` metadata, hashes the token
//! (SHA-256) and looks the hash up among the operator's tokens, comparing in
//! constant time. Without a token, a client certificate (TLS) whose identity
//! (`spiffe://provisioning/<name>`, see `platform::tls`) an entry names
//! authenticates the call instead. A call that neither authenticates is
//! answered `UNAUTHENTICATED` there and never reaches a handler; an accepted
//! one carries its [`Principal`] in the request's extensions.
//!
//! **Authorization** is per method and per run, in the handlers (`api.rs`),
//! through [`principal`] and [`Principal::require_run`]: a token grants `read`
//! (`GetRun`, `ListRuns`, `WatchRun`, `ExplainNode`, `Plan`, `ListOrphans`, `ListProviders`,
//! `ListEvents`, `WatchEvents`) or `write` (those, and `Apply`, `DeleteRun`, `PauseRun`, `ResumeRun`, `PromoteRollout`,
//! `AbandonNode`), optionally only for named runs. A call beyond its grant is
//! answered `PERMISSION_DENIED` before it touches anything; lists show only
//! the runs a token may read.
//!
//! The tokens file (`--tokens-file`) is a YAML (or JSON) list of entries
//! `{name, sha256 | client_cert, access, runs, expires}`; it holds hashes,
//! never tokens. An entry past its `expires` (RFC 3339) is answered
//! `UNAUTHENTICATED` saying it expired; each entry's expiry is exported as
//! `provisioning_api_token_expiry_timestamp_seconds{token}` (the alerting
//! rules warn a week ahead), and a load logs a warning for an entry that
//! expires within a week or has expired.
//! `provisionctl token new` makes a token and its entry. SIGHUP reloads the
//! file; a file that does not load keeps the tokens already loaded.
//!
//! Without a tokens file the driver starts only with
//! `--allow-unauthenticated`, and then every caller is the anonymous
//! principal with write access to every run.

use std::{
    collections::BTreeSet,
    convert::Infallible,
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    task::{Context, Poll},
};

use contract::{Clock as _, SystemClock, UnixMillis};
use futures::future::{BoxFuture, FutureExt as _};
pub use platform::token::{Access, TokenEntry, entry_for, hash_token, new_token, to_hex};
use platform::{
    metrics::{Counter, Gauge, global},
    token::parse_hash,
};
use tonic::{
    Status,
    body::Body,
    server::NamedService,
    transport::server::{TcpConnectInfo, TlsConnectInfo},
};
use tower::{Layer, Service};

/// A tokens file that cannot be used, said in terms of the file.
#[derive(Debug, thiserror::Error)]
pub enum TokensFileError {
    #[error("cannot read the tokens file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("the tokens file {path} is not a list of token entries: {reason}")]
    Syntax { path: PathBuf, reason: String },
    #[error("the tokens file {path}, entry {index} ({name:?}): {problem}")]
    Entry {
        path: PathBuf,
        index: usize,
        name: String,
        problem: String,
    },
}

/// The tokens the driver accepts, as loaded from the file.
#[derive(Debug, Clone, Default)]
pub struct TokenSet {
    entries: Vec<Loaded>,
}

#[derive(Debug, Clone)]
struct Loaded {
    credential: Credential,
    principal: Principal,
    /// When the entry stops being accepted, and as the file says it.
    expires: Option<(UnixMillis, String)>,
}

/// How far ahead a load warns of an entry's expiry.
const EXPIRY_WARNING: std::time::Duration = std::time::Duration::from_secs(7 * 86_400);

/// Each entry's expiry, seconds since the epoch, by token name.
fn expiry_gauge() -> Gauge {
    global().gauge(
        "provisioning_api_token_expiry_timestamp_seconds",
        "When each tokens-file entry with an `expires` stops being accepted (Unix seconds), by token \
         name.",
        &["token"],
    )
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Credential {
    /// A bearer token's SHA-256.
    Token([u8; 32]),
    /// A client certificate's identity URI.
    Certificate(String),
}

impl TokenSet {
    /// Parses a tokens file's text; `path` only names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Self, TokensFileError> {
        let entries: Option<Vec<TokenEntry>> =
            serde_yaml_ng::from_str(text).map_err(|e| TokensFileError::Syntax {
                path: path.to_owned(),
                reason: e.to_string(),
            })?;
        let mut out = Vec::new();
        let mut names = BTreeSet::new();
        let mut hashes = BTreeSet::new();
        let mut certs = BTreeSet::new();
        for (index, e) in entries.unwrap_or_default().into_iter().enumerate() {
            let bad = |problem: String| TokensFileError::Entry {
                path: path.to_owned(),
                index,
                name: e.name.clone(),
                problem,
            };
            if e.name.trim().is_empty() {
                return Err(bad("name must not be empty".into()));
            }
            if !names.insert(e.name.clone()) {
                return Err(bad("name is a duplicate".into()));
            }
            let credential = match (&e.sha256, &e.client_cert) {
                (Some(sha256), None) => {
                    let hash = parse_hash(sha256).ok_or_else(|| {
                        bad("sha256 must be 64 hexadecimal digits (the token's SHA-256)".into())
                    })?;
                    if !hashes.insert(hash) {
                        return Err(bad("sha256 is the same as another entry's".into()));
                    }
                    Credential::Token(hash)
                }
                (None, Some(cert)) if !cert.trim().is_empty() => {
                    let identity = platform::tls::identity_of(cert.trim());
                    if !certs.insert(identity.clone()) {
                        return Err(bad("client_cert is the same as another entry's".into()));
                    }
                    Credential::Certificate(identity)
                }
                _ => {
                    return Err(bad(
                        "give exactly one of sha256 (a token's hash) or client_cert (a certificate's \
                         identity)"
                            .into(),
                    ));
                }
            };
            let expires = match &e.expires {
                None => None,
                Some(text) => {
                    let at = platform::token::parse_expiry(text).map_err(bad)?;
                    let ms = at
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                        .map_err(|_| bad(format!("expires {text:?} is before 1970")))?;
                    Some((UnixMillis::new(ms), text.trim().to_owned()))
                }
            };
            let runs = match &e.runs {
                None => None,
                Some(runs) => {
                    let mut set = BTreeSet::new();
                    for r in runs {
                        contract::RunId::parse("runs", r).map_err(|f| bad(f.to_string()))?;
                        set.insert(r.clone());
                    }
                    Some(Arc::new(set))
                }
            };
            out.push(Loaded {
                credential,
                principal: Principal {
                    name: Some(Arc::from(e.name.as_str())),
                    access: e.access,
                    runs,
                },
                expires,
            });
        }
        Ok(Self { entries: out })
    }

    /// Reads and parses the file at `path`.
    pub fn load(path: &Path) -> Result<Self, TokensFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokensFileError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &text)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Exports each entry's expiry, and warns of those within a week of it
    /// (or past it) at `now`: what a load does.
    fn announce_expiries(&self, now: UnixMillis) {
        expiry_gauge().replace_all(self.entries.iter().filter_map(|e| {
            let (at, _) = e.expires.as_ref()?;
            Some((vec![e.principal.name()?], at.as_millis() as f64 / 1000.0))
        }));
        for e in &self.entries {
            let (Some((at, text)), Some(name)) = (&e.expires, e.principal.name()) else {
                continue;
            };
            if *at <= now {
                tracing::warn!(token = name, expires = %text, "a token in the tokens file has expired: calls with it are refused");
            } else if at.saturating_since(now) <= EXPIRY_WARNING {
                tracing::warn!(token = name, expires = %text, "a token in the tokens file expires within a week");
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry whose token is `token`. Every entry is compared, in
    /// constant time, so the time taken says nothing about which (if any)
    /// matched.
    fn find(&self, token: &str) -> Option<&Loaded> {
        let hash = hash_token(token);
        let mut found = None;
        for e in &self.entries {
            if let Credential::Token(h) = &e.credential
                && constant_time_eq(h, &hash)
            {
                found = Some(e);
            }
        }
        found
    }

    /// The first entry naming one of a client certificate's `identities`.
    fn find_certificate(&self, identities: &[String]) -> Option<&Loaded> {
        self.entries
            .iter()
            .find(|e| matches!(&e.credential, Credential::Certificate(id) if identities.contains(id)))
    }
}

impl Loaded {
    /// The entry's principal, unless it has expired at `now`.
    fn principal_at(&self, now: UnixMillis) -> Result<Principal, Status> {
        match &self.expires {
            Some((at, text)) if *at <= now => Err(Status::unauthenticated(format!(
                "{} expired at {text}; its holder needs a new one from this server's operator",
                match &self.credential {
                    Credential::Token(_) =>
                        format!("the token {:?}", self.principal.name().unwrap_or_default()),
                    Credential::Certificate(id) => format!("the tokens-file entry for {id}"),
                }
            ))),
            _ => Ok(self.principal.clone()),
        }
    }
}

/// Whether `a == b`, in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Who made a call: a token's holder, or the anonymous caller of a driver
/// started with `--allow-unauthenticated`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The token's name; `None` for the anonymous caller.
    name: Option<Arc<str>>,
    access: Access,
    /// Only these runs; `None`: every run.
    runs: Option<Arc<BTreeSet<String>>>,
}

impl Principal {
    /// The caller of a driver without authentication: writes every run.
    pub fn anonymous() -> Self {
        Self {
            name: None,
            access: Access::Write,
            runs: None,
        }
    }

    /// The token's name, or `None` when calls are not authenticated.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn who(&self) -> String {
        match &self.name {
            Some(n) => format!("token {n:?}"),
            None => "an unauthenticated caller".to_owned(),
        }
    }

    /// `PERMISSION_DENIED` unless the principal has `need` for `method`.
    pub fn require(&self, need: Access, method: &str) -> Result<(), Status> {
        if self.access >= need {
            Ok(())
        } else {
            Err(denied(format!(
                "{} has {} access; {method} needs {need} access",
                self.who(),
                self.access
            )))
        }
    }

    /// `PERMISSION_DENIED` unless the principal may act on `run`.
    pub fn require_run(&self, run: &str) -> Result<(), Status> {
        if self.may_see(run) {
            Ok(())
        } else {
            let allowed: Vec<&str> = self
                .runs
                .iter()
                .flat_map(|r| r.iter().map(String::as_str))
                .collect();
            Err(denied(format!(
                "{} is limited to runs [{}]; run {run:?} is not one of them",
                self.who(),
                allowed.join(", ")
            )))
        }
    }

    /// Whether the principal may read `run` (lists show only those).
    pub fn may_see(&self, run: &str) -> bool {
        self.runs.as_ref().is_none_or(|r| r.contains(run))
    }
}

fn denied(message: String) -> Status {
    refusals().inc(&["permission_denied"]);
    Status::permission_denied(message)
}

/// The caller of `req`, checked for `need` on `method`: what the handlers
/// call first. `UNAUTHENTICATED` if the request did not come through the
/// [`AuthLayer`] (the API is never served without it).
pub fn principal<T>(req: &tonic::Request<T>, need: Access, method: &str) -> Result<Principal, Status> {
    let p = req
        .extensions()
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("the call was not authenticated"))?;
    p.require(need, method)?;
    Ok(p)
}

/// Public API calls refused before they were served, by reason (the limits
/// layer counts its own refusals in the same family).
pub(crate) fn refusals() -> Counter {
    let refused = global().counter(
        "provisioning_api_refused_total",
        "Public API calls refused, by reason: unauthenticated, permission_denied, overloaded, \
         rate_limited, watch_limit, deadline, too_large.",
        &["reason"],
    );
    for reason in REFUSAL_REASONS {
        refused.init(&[reason]);
    }
    refused
}

/// Every reason a public API call is refused for, exported at zero from the
/// start (`internal` is a limits layer failure that should not happen).
pub(crate) const REFUSAL_REASONS: [&str; 8] = [
    "unauthenticated",
    "permission_denied",
    "overloaded",
    "rate_limited",
    "watch_limit",
    "deadline",
    "too_large",
    "internal",
];

/// The driver's authentication flags.
#[derive(Debug, Clone, clap::Args)]
pub struct AuthArgs {
    /// The tokens file: a YAML (or JSON) list of `{name, sha256, access:
    /// read|write, runs: [..]}` entries (`provisionctl token new` makes one).
    /// Every public API call must then carry one of its tokens. SIGHUP
    /// reloads it.
    #[arg(long, env = "DRIVER_TOKENS_FILE", value_name = "PATH")]
    pub tokens_file: Option<PathBuf>,
    /// Serve the public API without authentication: anyone who can reach
    /// the port may change any run. Required when there is no --tokens-file.
    #[arg(long, env = "DRIVER_ALLOW_UNAUTHENTICATED", value_parser = clap::builder::BoolishValueParser::new(), conflicts_with = "tokens_file")]
    pub allow_unauthenticated: bool,
}

/// Why the driver cannot set up authentication.
#[derive(Debug, thiserror::Error)]
pub enum AuthSetupError {
    #[error(
        "refusing to serve the public API without authentication: give --tokens-file PATH \
         (`provisionctl token new` makes a token and its entry), or --allow-unauthenticated to let \
         anyone who reaches the port change any run"
    )]
    NoTokens,
    #[error(transparent)]
    TokensFile(#[from] TokensFileError),
}

impl AuthArgs {
    /// The authenticator these flags ask for (with SIGHUP reloads of a
    /// tokens file), or why there is none. Call it inside the runtime.
    pub fn authenticator(&self) -> Result<Arc<Authenticator>, AuthSetupError> {
        match (&self.tokens_file, self.allow_unauthenticated) {
            (Some(path), _) => {
                let auth = Authenticator::from_file(path)?;
                auth.reload_on_sighup();
                Ok(auth)
            }
            (None, true) => {
                tracing::warn!(
                    "--allow-unauthenticated: the public API accepts every caller, with write access to \
                     every run"
                );
                Ok(Authenticator::open())
            }
            (None, false) => Err(AuthSetupError::NoTokens),
        }
    }
}

/// How the driver authenticates callers.
#[derive(Debug)]
pub struct Authenticator {
    mode: Mode,
}

#[derive(Debug)]
enum Mode {
    /// `--allow-unauthenticated`: every caller is [`Principal::anonymous`].
    Open,
    Tokens {
        path: PathBuf,
        set: RwLock<Arc<TokenSet>>,
    },
}

impl Authenticator {
    /// Every caller is anonymous with write access (`--allow-unauthenticated`).
    pub fn open() -> Arc<Self> {
        Arc::new(Self { mode: Mode::Open })
    }

    /// Tokens from the file at `path`, loaded now (an unusable file is an error).
    pub fn from_file(path: &Path) -> Result<Arc<Self>, TokensFileError> {
        let set = TokenSet::load(path)?;
        set.announce_expiries(SystemClock.now());
        warn_if_writable(path);
        if set.is_empty() {
            tracing::warn!(path = %path.display(), "the tokens file has no tokens: every API call will be refused");
        }
        tracing::info!(path = %path.display(), tokens = set.len(), "client authentication: bearer tokens");
        Ok(Arc::new(Self {
            mode: Mode::Tokens {
                path: path.to_owned(),
                set: RwLock::new(Arc::new(set)),
            },
        }))
    }

    /// Tokens from `set` (for tests and embedding); reloads read nothing.
    pub fn with_tokens(set: TokenSet) -> Arc<Self> {
        set.announce_expiries(SystemClock.now());
        Arc::new(Self {
            mode: Mode::Tokens {
                path: PathBuf::new(),
                set: RwLock::new(Arc::new(set)),
            },
        })
    }

    /// Whether callers must present a token.
    pub fn requires_tokens(&self) -> bool {
        matches!(self.mode, Mode::Tokens { .. })
    }

    /// Reads the tokens file again; on failure the tokens loaded before stay.
    pub fn reload(&self) -> Result<usize, TokensFileError> {
        let Mode::Tokens { path, set } = &self.mode else {
            return Ok(0);
        };
        let fresh = TokenSet::load(path)?;
        fresh.announce_expiries(SystemClock.now());
        let n = fresh.len();
        if let Ok(mut guard) = set.write() {
            *guard = Arc::new(fresh);
        }
        Ok(n)
    }

    /// Reloads the tokens file on every SIGHUP, for as long as the process runs.
    pub fn reload_on_sighup(self: &Arc<Self>) {
        if !self.requires_tokens() {
            return;
        }
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let me = Arc::clone(self);
            match signal(SignalKind::hangup()) {
                Ok(mut hup) => {
                    tokio::spawn(async move {
                        while hup.recv().await.is_some() {
                            match me.reload() {
                                Ok(n) => tracing::info!(tokens = n, "SIGHUP: tokens file reloaded"),
                                Err(e) => tracing::error!(
                                    error = %e,
                                    "SIGHUP: the tokens file was not reloaded; the tokens loaded before stay"
                                ),
                            }
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGHUP: the tokens file is read once")
                }
            }
        }
    }

    /// The principal the request's metadata (a bearer token) or, without
    /// one, its client certificate's `peer_identities` prove, or
    /// `UNAUTHENTICATED` saying what is missing or wrong (never echoing the
    /// token).
    pub fn authenticate(
        &self,
        headers: &http::HeaderMap,
        peer_identities: &[String],
    ) -> Result<Principal, Status> {
        self.authenticate_at(headers, peer_identities, SystemClock.now())
    }

    /// [`Authenticator::authenticate`] at `now` (an entry past its
    /// `expires` then is refused).
    pub fn authenticate_at(
        &self,
        headers: &http::HeaderMap,
        peer_identities: &[String],
        now: UnixMillis,
    ) -> Result<Principal, Status> {
        let set = match &self.mode {
            Mode::Open => return Ok(Principal::anonymous()),
            Mode::Tokens { set, .. } => set.read().map(|s| Arc::clone(&s)).unwrap_or_default(),
        };
        let Some(value) = headers.get(http::header::AUTHORIZATION) else {
            if let Some(e) = set.find_certificate(peer_identities) {
                return e.principal_at(now);
            }
            let certificate = if peer_identities.is_empty() {
                String::new()
            } else {
                format!(
                    ", and the client certificate's identity ({}) is not one this server accepts",
                    peer_identities.join(", ")
                )
            };
            return Err(Status::unauthenticated(format!(
                "no credentials: this server requires a bearer token in the metadata `authorization: \
                 Bearer <token>` (its operator issues tokens){certificate}"
            )));
        };
        let token = value
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, rest) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            })
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                Status::unauthenticated("the authorization metadata is not of the form `Bearer <token>`")
            })?;
        set.find(token)
            .ok_or_else(|| {
                Status::unauthenticated(
                    "the bearer token is not one this server accepts (mistyped, revoked, or for another \
                     server)",
                )
            })?
            .principal_at(now)
    }

    /// The layer that authenticates every call of the service it wraps.
    pub fn layer(self: &Arc<Self>) -> AuthLayer {
        AuthLayer {
            auth: Arc::clone(self),
        }
    }
}

/// A tokens file others may write lets them add their own token.
fn warn_if_writable(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        if let Ok(meta) = std::fs::metadata(path)
            && meta.permissions().mode() & 0o022 != 0
        {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{:o}", meta.permissions().mode() & 0o777),
                "the tokens file is writable by group or others: they could add a token"
            );
        }
    }
}

/// The identities in the client certificate of the request's connection
/// (none in plaintext, or when the client presented no certificate).
fn peer_identities(req: &http::Request<Body>) -> Vec<String> {
    req.extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(TlsConnectInfo::peer_certs)
        .and_then(|certs| certs.first().map(platform::tls::identities_in))
        .unwrap_or_default()
}

/// Authenticates each call; see the module documentation.
#[derive(Debug, Clone)]
pub struct AuthLayer {
    auth: Arc<Authenticator>,
}

impl<S> Layer<S> for AuthLayer {
    type Service = Authenticated<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Authenticated {
            inner,
            auth: Arc::clone(&self.auth),
            refused: refusals(),
        }
    }
}

/// See [`AuthLayer`].
#[derive(Debug, Clone)]
pub struct Authenticated<S> {
    inner: S,
    auth: Arc<Authenticator>,
    refused: Counter,
}

impl<S: NamedService> NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Authenticated<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        match self.auth.authenticate(req.headers(), &peer_identities(&req)) {
            Ok(principal) => {
                req.extensions_mut().insert(principal);
                // The service that was polled ready is the one called.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                inner.call(req).boxed()
            }
            Err(status) => {
                self.refused.inc(&["unauthenticated"]);
                futures::future::ready(Ok(status.into_http())).boxed()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn file(entries: &[TokenEntry]) -> TokenSet {
        TokenSet::parse(Path::new("t.yaml"), &serde_yaml_ng::to_string(entries).unwrap()).unwrap()
    }

    fn bearer(token: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn an_entry_is_accepted_until_its_expiry_and_refused_from_then_on() {
        let token = new_token().unwrap();
        let mut e = entry_for("ci", &token, Access::Read, None);
        e.expires = Some("2030-01-01T00:00:00Z".to_owned());
        let auth = Authenticator::with_tokens(file(&[e]));
        let at = UnixMillis::new(1_893_456_000_000);
        let before = UnixMillis::new(at.as_millis() - 1);
        assert_eq!(
            auth.authenticate_at(&bearer(&token), &[], before).unwrap().name(),
            Some("ci")
        );
        let refused = auth.authenticate_at(&bearer(&token), &[], at).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        assert!(
            refused
                .message()
                .starts_with("the token \"ci\" expired at 2030-01-01T00:00:00Z")
        );

        let mut bad = entry_for("x", &new_token().unwrap(), Access::Read, None);
        bad.expires = Some("next tuesday".to_owned());
        let e = TokenSet::parse(Path::new("t.yaml"), &serde_yaml_ng::to_string(&[bad]).unwrap()).unwrap_err();
        assert!(
            e.to_string()
                .contains("expires \"next tuesday\" is not an RFC 3339 time"),
            "{e}"
        );
    }

    #[test]
    fn a_known_token_is_its_principal_and_others_are_refused() {
        let t1 = new_token().unwrap();
        let t2 = new_token().unwrap();
        assert_ne!(t1, t2);
        let set = file(&[
            entry_for("ci", &t1, Access::Write, None),
            entry_for("viewer", &t2, Access::Read, Some(vec!["demo".into()])),
        ]);
        let auth = Authenticator::with_tokens(set);
        let ci = auth.authenticate(&bearer(&t1), &[]).unwrap();
        assert_eq!(ci.name(), Some("ci"));
        ci.require(Access::Write, "Apply").unwrap();
        let viewer = auth.authenticate(&bearer(&t2), &[]).unwrap();
        assert_eq!(
            viewer.require(Access::Write, "Apply").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        viewer.require(Access::Read, "GetRun").unwrap();
        viewer.require_run("demo").unwrap();
        let e = viewer.require_run("other").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("\"other\"") && e.message().contains("[demo]"),
            "{}",
            e.message()
        );

        for headers in [http::HeaderMap::new(), bearer("prov_nope"), bearer("")] {
            let e = auth.authenticate(&headers, &[]).unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated);
            assert!(!e.message().contains("prov_nope"));
        }
        let mut basic = http::HeaderMap::new();
        basic.insert(
            http::header::AUTHORIZATION,
            format!("Basic {t1}").parse().unwrap(),
        );
        assert_eq!(
            auth.authenticate(&basic, &[]).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        // The scheme is case-insensitive, as HTTP has it.
        let mut lower = http::HeaderMap::new();
        lower.insert(
            http::header::AUTHORIZATION,
            format!("bearer {t1}").parse().unwrap(),
        );
        assert_eq!(auth.authenticate(&lower, &[]).unwrap().name(), Some("ci"));
    }

    #[test]
    fn the_file_holds_hashes_and_bad_entries_are_named() {
        let token = "prov_0123";
        let entry = entry_for("ci", token, Access::Read, None);
        assert_eq!(entry.sha256, Some(to_hex(&hash_token(token))));
        assert!(
            !serde_yaml_ng::to_string(std::slice::from_ref(&entry))
                .unwrap()
                .contains(token)
        );
        // Known answer: SHA-256("abc").
        assert_eq!(
            to_hex(&hash_token("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );

        let p = Path::new("tokens.yaml");
        let cases = [
            (
                "- {name: a, sha256: abc, access: read}",
                "entry 0 (\"a\"): sha256 must be 64",
            ),
            (
                "- {name: a, sha256: ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad, access: admin}",
                "not a list of token entries",
            ),
            (
                "- {name: a, sha256: ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad, access: read, colour: red}",
                "unknown field",
            ),
            (
                "- {name: a, sha256: ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad, access: read, runs: [Bad_Run]}",
                "entry 0 (\"a\"): runs",
            ),
            (
                "- {name: a, sha256: ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad, access: read}\n\
                 - {name: a, sha256: ca7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad, access: read}",
                "entry 1 (\"a\"): name is a duplicate",
            ),
        ];
        for (text, want) in cases {
            let e = TokenSet::parse(p, text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
            assert!(e.contains("tokens.yaml"), "{e}");
        }
        assert!(TokenSet::parse(p, "").unwrap().is_empty());
        assert!(TokenSet::parse(p, "[]").unwrap().is_empty());
    }

    #[test]
    fn a_listed_client_certificate_authenticates_without_a_token() {
        let token = new_token().unwrap();
        let text = format!(
            "- {{name: ops, client_cert: ops, access: read, runs: [demo]}}\n- {}",
            serde_yaml_ng::to_string(&entry_for("ci", &token, Access::Write, None))
                .unwrap()
                .replace('\n', "\n  ")
                .trim_end()
        );
        let auth = Authenticator::with_tokens(TokenSet::parse(Path::new("t.yaml"), &text).unwrap());
        let ops = ["spiffe://provisioning/ops".to_owned()];
        let p = auth.authenticate(&http::HeaderMap::new(), &ops).unwrap();
        assert_eq!(p.name(), Some("ops"));
        assert!(p.require(Access::Write, "Apply").is_err() && !p.may_see("other"));
        // A token, when given, is what counts.
        assert_eq!(
            auth.authenticate(&bearer(&token), &ops).unwrap().name(),
            Some("ci")
        );
        assert!(auth.authenticate(&bearer("prov_wrong"), &ops).is_err());
        // A certificate no entry names, or none at all.
        let e = auth
            .authenticate(
                &http::HeaderMap::new(),
                &["spiffe://provisioning/other".to_owned()],
            )
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(
            e.message().contains("spiffe://provisioning/other"),
            "{}",
            e.message()
        );
        // One credential per entry.
        let both = "- {name: x, client_cert: ops, sha256: ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad, access: read}";
        assert!(
            TokenSet::parse(Path::new("t.yaml"), both)
                .unwrap_err()
                .to_string()
                .contains("exactly one")
        );
    }

    #[test]
    fn open_mode_makes_everyone_anonymous_with_write_access() {
        let auth = Authenticator::open();
        let p = auth.authenticate(&http::HeaderMap::new(), &[]).unwrap();
        assert_eq!(p, Principal::anonymous());
        p.require(Access::Write, "Apply").unwrap();
        assert!(p.may_see("anything"));
    }

    #[test]
    fn a_reload_that_fails_keeps_the_tokens_loaded_before() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.yaml");
        let (a, b) = (new_token().unwrap(), new_token().unwrap());
        std::fs::write(
            &path,
            serde_yaml_ng::to_string(&[entry_for("a", &a, Access::Read, None)]).unwrap(),
        )
        .unwrap();
        let auth = Authenticator::from_file(&path).unwrap();
        assert!(auth.authenticate(&bearer(&a), &[]).is_ok());
        std::fs::write(&path, "not: [a list").unwrap();
        assert!(auth.reload().is_err());
        assert!(auth.authenticate(&bearer(&a), &[]).is_ok());
        std::fs::write(
            &path,
            serde_yaml_ng::to_string(&[entry_for("b", &b, Access::Read, None)]).unwrap(),
        )
        .unwrap();
        assert_eq!(auth.reload().unwrap(), 1);
        assert!(auth.authenticate(&bearer(&a), &[]).is_err());
        assert_eq!(auth.authenticate(&bearer(&b), &[]).unwrap().name(), Some("b"));
    }
}
