//! Transport security: TLS (rustls) on every listener and channel, mutual TLS
//! between the services, and the rule that only the driver may call the
//! decider and the executor.
//!
//! **Identity.** A peer is named by the SPIFFE-style URI in its certificate's
//! subject alternative names, `spiffe://provisioning/<name>` (the driver is
//! `spiffe://provisioning/driver-svc`). A host name cannot serve: on one
//! machine every service answers to `localhost`, so a DNS name says where a
//! service runs, not which one it is. The certificate must chain to the CA
//! bundle given with `--tls-ca`; rustls checks the chain, the validity dates
//! and the key usages during the handshake, and [`PeerIdentityLayer`] then
//! checks the name, in one tower layer in front of every handler. A client
//! that must reach one particular service (the driver calling the decider
//! and the executor) checks the server's name the same way, in its own
//! rustls verifier ([`Transport::peer_endpoint`]): a certificate from the CA
//! for another service is refused in the handshake.
//!
//! **Modes.** A service runs with TLS ([`Transport::Tls`]: its certificate,
//! key and the CA bundle) or, only when asked with `--insecure`, in plaintext
//! ([`Transport::Insecure`], which logs a warning at start). With neither it
//! refuses to start. The decider and the executor require a client
//! certificate ([`ClientAuth::Required`]) and let only the allowed identities
//! through (`--tls-allow-client`, the driver by default); health checks are
//! answered to any client the handshake admitted, so a probe needs a
//! certificate from the CA but not the driver's. The driver's public API
//! serves TLS with client certificates optional ([`ClientAuth::Optional`]);
//! one that is presented must chain to the CA.
//!
//! With the `certgen` feature, [`dev`] writes a development CA and the
//! certificates of every service and of `provisionctl`.

use std::{
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use http::{Request, Response, Uri};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig,
    server::{TcpConnectInfo, TlsConnectInfo},
};
use tower::{Layer, Service};

use crate::{
    error_chain,
    telemetry::grpc::{Target, TracedChannel},
};

/// The trust domain of every identity this system issues and checks.
pub const TRUST_DOMAIN: &str = "provisioning";

/// The driver's name; the decider and the executor allow its identity by default.
pub const DRIVER: &str = "driver-svc";

/// How long a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The URI a certificate carries for `name`: `spiffe://provisioning/<name>`.
/// A value that already is a URI (it contains `://`) is returned unchanged.
pub fn identity_of(name: &str) -> String {
    if name.contains("://") {
        name.to_owned()
    } else {
        format!("spiffe://{TRUST_DOMAIN}/{name}")
    }
}

/// The SPIFFE identities (`spiffe://...` URI SANs) of a DER certificate; empty
/// when it has none or does not parse.
pub fn identities_in(cert: &CertificateDer<'_>) -> Vec<String> {
    match webpki::EndEntityCert::try_from(cert) {
        Ok(cert) => cert
            .valid_uri_names()
            .filter(|uri| uri.starts_with("spiffe://"))
            .map(str::to_owned)
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// What went wrong setting up TLS. Each message names the flag or the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "no TLS settings: give --tls-cert, --tls-key and --tls-ca (or PROVISIONING_TLS_CERT, \
         PROVISIONING_TLS_KEY, PROVISIONING_TLS_CA), or --insecure (PROVISIONING_INSECURE=true) to run \
         in plaintext"
    )]
    NoSettings,
    #[error("--insecure (plaintext) cannot be combined with {flag}: choose one")]
    Conflict { flag: &'static str },
    #[error("{missing} is missing: TLS needs --tls-cert, --tls-key and --tls-ca together")]
    Incomplete { missing: &'static str },
    #[error("reading {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} holds no {what} in PEM form", path.display())]
    Pem { what: &'static str, path: PathBuf },
    #[error(
        "{} and {} are not a pair: {reason}; give the key that was issued with the certificate",
        cert.display(),
        key.display()
    )]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    #[error("{url:?} is not an address to connect to: {reason}")]
    Url { url: String, reason: String },
    #[error("{url} is {scheme}:// but {mode}")]
    Scheme {
        url: String,
        scheme: String,
        mode: &'static str,
    },
    #[error("this side has no certificate of its own to serve TLS with")]
    NoIdentity,
    #[error("setting up TLS: {0}")]
    Setup(String),
    #[error(transparent)]
    Transport(#[from] tonic::transport::Error),
}

/// The PEM files of one side of a TLS connection, read and checked, and
/// read again as they change (see [`TlsMaterial::watch`]): servers and
/// channels set up from it take the files in force at each new handshake,
/// and connections already made keep theirs.
pub struct TlsMaterial {
    ca_path: PathBuf,
    identity_paths: Option<(PathBuf, PathBuf)>,
    current: std::sync::RwLock<Arc<Pems>>,
    /// How often [`TlsMaterial::watch`] looks at the files (zero: only on
    /// SIGHUP).
    reload_every: Duration,
    watching: std::sync::atomic::AtomicBool,
}

/// One reading of the files.
struct Pems {
    /// The CA bundle peers are verified against.
    ca: Vec<u8>,
    /// This side's certificate chain and private key, when it has them.
    identity: Option<(Vec<u8>, Vec<u8>)>,
    /// The identities (SPIFFE URIs) this side's certificate carries.
    names: Vec<String>,
    /// The CA as rustls roots.
    roots: Arc<rustls::RootCertStore>,
    /// This side's chain and key as rustls signs with them.
    certified: Option<Arc<rustls::sign::CertifiedKey>>,
    /// rustls's checks of a server's and of a client's chain to the CA.
    server_verifier: Arc<rustls::client::WebPkiServerVerifier>,
    client_verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        let pems = self.pems();
        f.debug_struct("TlsMaterial")
            .field("names", &pems.names)
            .field("has_identity", &pems.identity.is_some())
            .finish_non_exhaustive()
    }
}

impl Clone for TlsMaterial {
    /// The same files, as they are now (the clone watches nothing yet).
    fn clone(&self) -> Self {
        Self {
            ca_path: self.ca_path.clone(),
            identity_paths: self.identity_paths.clone(),
            current: std::sync::RwLock::new(self.pems()),
            reload_every: self.reload_every,
            watching: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

/// How often a service looks at its TLS files for a change, by default.
pub const DEFAULT_TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(5);

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

fn certificates(
    what: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::Pem {
            what,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// Checks that `key` is the private key of the chain's first certificate, so
/// that a mismatched pair is refused when it is read, naming both files,
/// rather than failing every handshake later as a bare transport error.
fn keys_match(
    chain: &[CertificateDer<'static>],
    key: &PrivateKeyDer<'_>,
    cert_path: &Path,
    key_path: &Path,
) -> Result<(), TlsError> {
    let mismatch = |reason: String| TlsError::KeyMismatch {
        cert: cert_path.to_owned(),
        key: key_path.to_owned(),
        reason,
    };
    let signing = rustls::crypto::ring::sign::any_supported_type(key)
        .map_err(|e| mismatch(format!("the key is of no supported type ({e})")))?;
    match rustls::sign::CertifiedKey::new(chain.to_vec(), signing).keys_match() {
        Ok(()) => Ok(()),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err(mismatch("the key is not the certificate's".to_owned()))
        }
        // A key that cannot tell its public half is let through: the
        // handshake is the check then.
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok(()),
        Err(e) => Err(mismatch(e.to_string())),
    }
}

/// Reads and checks the files.
fn read_pems(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<Pems, TlsError> {
    let ca_pem = read("the CA bundle", ca)?;
    let ca_certs = certificates("CA certificate", ca, &ca_pem)?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in ca_certs {
        roots
            .add(cert)
            .map_err(|e| TlsError::Setup(format!("{}: {e}", ca.display())))?;
    }
    let mut names = Vec::new();
    let mut certified = None;
    let identity = match identity {
        None => None,
        Some((cert, key)) => {
            let cert_pem = read("the certificate", cert)?;
            let key_pem = read("the private key", key)?;
            let chain = certificates("certificate", cert, &cert_pem)?;
            let Ok(key_der) = PrivateKeyDer::from_pem_slice(&key_pem) else {
                return Err(TlsError::Pem {
                    what: "private key",
                    path: key.to_owned(),
                });
            };
            keys_match(&chain, &key_der, cert, key)?;
            if let Some(leaf) = chain.first() {
                names = identities_in(leaf);
            }
            let signing = rustls::crypto::ring::sign::any_supported_type(&key_der)
                .map_err(|e| TlsError::Setup(format!("{}: {e}", key.display())))?;
            certified = Some(Arc::new(rustls::sign::CertifiedKey::new(chain, signing)));
            Some((cert_pem, key_pem))
        }
    };
    let roots = Arc::new(roots);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let setup = |e: &dyn std::fmt::Display| TlsError::Setup(format!("{}: {e}", ca.display()));
    let server_verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::clone(&roots),
        Arc::clone(&provider),
    )
    .build()
    .map_err(|e| setup(&e))?;
    let client_verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), provider)
            .build()
            .map_err(|e| setup(&e))?;
    Ok(Pems {
        ca: ca_pem,
        identity,
        names,
        roots,
        certified,
        server_verifier,
        client_verifier,
    })
}

impl TlsMaterial {
    /// Reads the CA bundle and, if given, a certificate chain with its key.
    pub fn load(ca: &Path, identity: Option<(&Path, &Path)>) -> Result<Self, TlsError> {
        let pems = read_pems(ca, identity)?;
        Ok(Self {
            ca_path: ca.to_owned(),
            identity_paths: identity.map(|(c, k)| (c.to_owned(), k.to_owned())),
            current: std::sync::RwLock::new(Arc::new(pems)),
            reload_every: DEFAULT_TLS_RELOAD_INTERVAL,
            watching: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// How often [`TlsMaterial::watch`] looks at the files (zero: only on
    /// SIGHUP).
    pub fn with_reload_interval(mut self, every: Duration) -> Self {
        self.reload_every = every;
        self
    }

    fn pems(&self) -> Arc<Pems> {
        Arc::clone(
            &self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The identities this side's certificate carries (empty without one).
    pub fn names(&self) -> Vec<String> {
        self.pems().names.clone()
    }

    /// Reads the files again: `Ok(true)` if they changed and now serve new
    /// handshakes, `Ok(false)` if they are as they were. Files that do not
    /// load (unreadable, not PEM, a key that is not the certificate's) are
    /// an error, and what was loaded before stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let identity = self
            .identity_paths
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path()));
        let fresh = read_pems(&self.ca_path, identity)?;
        let mut current = self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.ca == fresh.ca && current.identity == fresh.identity {
            return Ok(false);
        }
        *current = Arc::new(fresh);
        Ok(true)
    }

    /// Reloads the files on SIGHUP and whenever they change (looked at every
    /// reload interval), as cert-manager and SPIFFE agents rotate them, for
    /// as long as the material is in use; once per material. A change that
    /// does not load keeps what was loaded before and logs why, once per
    /// bad version. Call it inside the runtime.
    pub fn watch(self: &Arc<Self>) {
        if self.watching.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let me = Arc::downgrade(self);
        let every = self.reload_every;
        tokio::spawn(async move {
            #[cfg(unix)]
            let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
            #[cfg(not(unix))]
            let mut hup: Option<()> = None;
            let mut reported: Option<String> = None;
            loop {
                let signalled = async {
                    match &mut hup {
                        #[cfg(unix)]
                        Some(h) => {
                            h.recv().await;
                        }
                        _ => std::future::pending::<()>().await,
                    }
                };
                let looked = async {
                    if every.is_zero() {
                        std::future::pending::<()>().await;
                    }
                    tokio::time::sleep(every).await;
                };
                let on_signal = tokio::select! {
                    () = signalled => true,
                    () = looked => false,
                };
                let Some(material) = me.upgrade() else {
                    return;
                };
                let mut reloaded = material.reload();
                if matches!(reloaded, Err(TlsError::KeyMismatch { .. })) {
                    // Caught between writing the certificate and its key:
                    // look again once the other has landed.
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    reloaded = material.reload();
                }
                match reloaded {
                    Ok(true) => {
                        reported = None;
                        tracing::info!(
                            names = ?material.names(),
                            ca = %material.ca_path.display(),
                            "TLS files reloaded: new handshakes use the new certificate and CA"
                        );
                    }
                    Ok(false) => {
                        if on_signal {
                            tracing::info!("SIGHUP: the TLS files are unchanged");
                        }
                    }
                    Err(e) => {
                        let why = e.to_string();
                        if reported.as_deref() != Some(why.as_str()) {
                            tracing::error!(
                                error = %why,
                                "the TLS files changed but do not load: the certificate and CA loaded before stay in use"
                            );
                            reported = Some(why);
                        }
                    }
                }
            }
        });
    }

    fn client_config(&self) -> ClientTlsConfig {
        let pems = self.pems();
        let config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&pems.ca))
            .timeout(HANDSHAKE_TIMEOUT);
        match &pems.identity {
            Some((cert, key)) => config.identity(Identity::from_pem(cert, key)),
            None => config,
        }
    }

    /// A rustls client configuration that accepts only a server whose
    /// certificate chains to the CA, names the host dialed and carries the
    /// identity `expect` (a URI, see [`identity_of`]).
    fn peer_config(self: &Arc<Self>, expect: &str) -> Result<rustls::ClientConfig, TlsError> {
        let setup = |e: &dyn std::fmt::Display| TlsError::Setup(e.to_string());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = Arc::new(PeerVerifier {
            material: Arc::clone(self),
            expect: expect.to_owned(),
        });
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| setup(&e))?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = if self.identity_paths.is_some() {
            builder.with_client_cert_resolver(Arc::new(Current(Arc::clone(self))))
        } else {
            builder.with_no_client_auth()
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }

    /// A rustls server configuration that takes the certificate and the CA
    /// in force at each handshake, with `auth` for client certificates.
    fn reloading_server_config(
        self: &Arc<Self>,
        auth: ClientAuth,
    ) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        if self.identity_paths.is_none() {
            return Err(TlsError::NoIdentity);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Setup(e.to_string()))?
            .with_client_cert_verifier(Arc::new(ClientVerifier {
                material: Arc::clone(self),
                auth,
            }))
            .with_cert_resolver(Arc::new(Current(Arc::clone(self))));
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }

    /// One TLS handshake with `host:port` as a client holding this
    /// material, then a read: what ended it, if anything did within two
    /// seconds (`None`: the server took the handshake and waits, as a server
    /// that accepts this client does). For telling why a call failed with a
    /// bare transport error: a server that refuses a client certificate says
    /// so in an alert after the handshake, which a call, writing first, may
    /// never read.
    pub async fn handshake_error(&self, host: &str, port: u16) -> Option<String> {
        use tokio::io::AsyncReadExt as _;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let pems = self.pems();
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .ok()?
            .with_root_certificates(Arc::clone(&pems.roots));
        let mut config = match &pems.identity {
            Some((cert, key)) => {
                let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
                    .filter_map(Result::ok)
                    .collect();
                let key = PrivateKeyDer::from_pem_slice(key).ok()?;
                builder.with_client_auth_cert(chain, key).ok()?
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        let name = rustls_pki_types::ServerName::try_from(host.to_owned()).ok()?;
        let probe = async {
            let tcp = tokio::net::TcpStream::connect((host, port)).await.ok()?;
            let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
            let mut stream = match connector.connect(name, tcp).await {
                Ok(stream) => stream,
                Err(e) => return Some(error_chain(&e)),
            };
            let mut byte = [0_u8; 1];
            match stream.read(&mut byte).await {
                Err(e) => Some(error_chain(&e)),
                Ok(_) => None,
            }
        };
        tokio::time::timeout(Duration::from_secs(2), probe)
            .await
            .ok()
            .flatten()
    }

    fn server_config(&self, auth: ClientAuth) -> Result<ServerTlsConfig, TlsError> {
        let pems = self.pems();
        let (cert, key) = pems.identity.as_ref().ok_or(TlsError::NoIdentity)?;
        Ok(ServerTlsConfig::new()
            .identity(Identity::from_pem(cert, key))
            .client_ca_root(Certificate::from_pem(&pems.ca))
            .client_auth_optional(auth == ClientAuth::Optional)
            .timeout(HANDSHAKE_TIMEOUT))
    }
}

/// Whether a TLS server asks its clients for a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// The handshake fails without a certificate that chains to the CA.
    Required,
    /// A client may present one (it must then chain to the CA) or none.
    Optional,
}

/// How one process talks: TLS with its material, or plaintext.
#[derive(Debug, Clone)]
pub enum Transport {
    /// Plaintext, only behind `--insecure`.
    Insecure,
    Tls(Arc<TlsMaterial>),
}

impl Transport {
    pub fn is_tls(&self) -> bool {
        matches!(self, Self::Tls(_))
    }

    /// `https` with TLS, `http` without.
    pub fn scheme(&self) -> &'static str {
        if self.is_tls() { "https" } else { "http" }
    }

    /// `url` with this transport's scheme: `host:port` gets it, a URL must
    /// already have it (an `http://` URL with TLS on is refused rather than
    /// quietly sent in plaintext, and the other way round).
    pub fn url(&self, url: &str) -> Result<String, TlsError> {
        match url.split_once("://") {
            None => Ok(format!("{}://{url}", self.scheme())),
            Some((scheme, _)) if scheme.eq_ignore_ascii_case(self.scheme()) => Ok(url.to_owned()),
            Some((scheme, _)) => Err(TlsError::Scheme {
                url: url.to_owned(),
                scheme: scheme.to_owned(),
                mode: if self.is_tls() {
                    "TLS is on: use https:// (or --insecure for plaintext)"
                } else {
                    "this side runs in plaintext (--insecure): use http://"
                },
            }),
        }
    }

    /// A channel endpoint for `url` (see [`Transport::url`]) that verifies the
    /// server against the CA bundle and presents this side's certificate, if
    /// it has one.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, TlsError> {
        let url = self.url(url)?;
        let endpoint = Endpoint::from_shared(url.clone()).map_err(|e| TlsError::Url {
            url: url.clone(),
            reason: e.to_string(),
        })?;
        Ok(match self {
            Self::Insecure => endpoint,
            Self::Tls(material) => endpoint.tls_config(material.client_config())?,
        })
    }

    /// Like [`Transport::endpoint`], for a server that must be the service
    /// named `expect` (a name or a URI, see [`identity_of`]): with TLS the
    /// handshake also fails unless the server's certificate carries that
    /// identity. In plaintext there is nobody to check.
    pub fn peer_endpoint(&self, url: &str, expect: &str) -> Result<PeerEndpoint, TlsError> {
        match self {
            Self::Insecure => {
                let endpoint = self.endpoint(url)?;
                Ok(PeerEndpoint {
                    target: Target::of(endpoint.uri()),
                    endpoint,
                    connector: None,
                })
            }
            Self::Tls(material) => {
                let url = self.url(url)?;
                let target = url
                    .parse::<Uri>()
                    .map(|uri| Target::of(&uri))
                    .map_err(|e| TlsError::Url {
                        url: url.clone(),
                        reason: e.to_string(),
                    })?;
                // TLS is the connector's: the endpoint itself is plain HTTP/2.
                let plain = url
                    .split_once("://")
                    .map_or_else(|| url.clone(), |(_, rest)| format!("http://{rest}"));
                let endpoint = Endpoint::from_shared(plain).map_err(|e| TlsError::Url {
                    url: url.clone(),
                    reason: e.to_string(),
                })?;
                Ok(PeerEndpoint {
                    endpoint,
                    target,
                    connector: Some(PeerConnector {
                        config: Arc::new(material.peer_config(&identity_of(expect))?),
                        dial: None,
                    }),
                })
            }
        }
    }

    /// The connections a server accepts on `listener`: plaintext, or TLS
    /// with this side's certificate and `auth` for client certificates. The
    /// TLS files are watched ([`TlsMaterial::watch`]): each handshake takes
    /// the certificate and the CA in force then, and connections already
    /// made keep theirs. Handshakes run apart from the accept loop, so a slow
    /// one holds up no other. Call it inside the runtime.
    pub fn incoming(
        &self,
        listener: tokio::net::TcpListener,
        auth: ClientAuth,
    ) -> Result<Incoming, TlsError> {
        match self {
            Self::Insecure => Ok(Incoming::Plain(crate::runtime::incoming(listener))),
            Self::Tls(material) => {
                let config = material.reloading_server_config(auth)?;
                material.watch();
                Ok(Incoming::Tls(TlsIncoming::spawn(listener, config)))
            }
        }
    }

    /// Sets up `server` to serve TLS with tonic's own acceptor, the
    /// certificate as it is now (`auth` for client certificates);
    /// plaintext leaves it as it is. The services use
    /// [`Transport::incoming`], which follows rotations.
    pub fn configure_server<L>(&self, server: Server<L>, auth: ClientAuth) -> Result<Server<L>, TlsError> {
        match self {
            Self::Insecure => Ok(server),
            Self::Tls(material) => Ok(server.tls_config(material.server_config(auth)?)?),
        }
    }
}

/// What [`Transport::incoming`] accepts: give it to [`serve`].
#[derive(Debug)]
pub enum Incoming {
    Plain(crate::runtime::NoDelayIncoming),
    Tls(TlsIncoming),
}

/// Serves `router` on `incoming` until `signal` resolves, then drains.
pub async fn serve<L, ResBody>(
    router: tonic::transport::server::Router<L>,
    incoming: Incoming,
    signal: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error>
where
    L: Layer<tonic::service::Routes>,
    L::Service: Service<Request<tonic::body::Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    <L::Service as Service<Request<tonic::body::Body>>>::Future: Send,
    <L::Service as Service<Request<tonic::body::Body>>>::Error:
        Into<Box<dyn std::error::Error + Send + Sync>> + Send,
    ResBody: http_body::Body<Data = prost::bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match incoming {
        Incoming::Plain(i) => router.serve_with_incoming_shutdown(i, signal).await,
        Incoming::Tls(i) => router.serve_with_incoming_shutdown(i, signal).await,
    }
}

/// TLS connections whose handshakes are done: a task accepts TCP
/// connections (`TCP_NODELAY` on each) and does each handshake in a task of
/// its own, within the handshake timeout. It stops, closing the listener,
/// once this stream is dropped (the server stopped).
#[derive(Debug)]
pub struct TlsIncoming {
    accepted: tokio::sync::mpsc::Receiver<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
}

impl TlsIncoming {
    fn spawn(listener: tokio::net::TcpListener, config: Arc<rustls::ServerConfig>) -> Self {
        let (tx, accepted) = tokio::sync::mpsc::channel(64);
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    next = listener.accept() => next,
                    () = tx.closed() => return,
                };
                let tcp = match next {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        // Out of descriptors, say: wait a little, go on.
                        tracing::warn!(error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY could not be set");
                }
                let (tx, acceptor) = (tx.clone(), acceptor.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send(tls).await;
                        }
                        Ok(Err(e)) => tracing::debug!(error = %e, "a TLS handshake failed"),
                        Err(_) => tracing::debug!("a TLS handshake timed out"),
                    }
                });
            }
        });
        Self { accepted }
    }
}

impl tokio_stream::Stream for TlsIncoming {
    type Item = Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.accepted.poll_recv(cx).map(|next| next.map(Ok))
    }
}

/// A channel endpoint to one particular service (see
/// [`Transport::peer_endpoint`]). Set timeouts and keep-alives on
/// `endpoint`, then connect through [`PeerEndpoint::connect`] or
/// [`PeerEndpoint::connect_lazy`], which do TLS with the identity check.
#[derive(Clone)]
pub struct PeerEndpoint {
    pub endpoint: Endpoint,
    /// The service's host and port as the caller named them (the endpoint's
    /// own URI is plaintext `http://` with TLS, which the connector does).
    target: Target,
    connector: Option<PeerConnector>,
}

impl std::fmt::Debug for PeerEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerEndpoint")
            .field("uri", self.endpoint.uri())
            .field("tls", &self.connector.is_some())
            .finish()
    }
}

impl PeerEndpoint {
    /// Changes the endpoint's settings (timeouts, keep-alives).
    pub fn map(self, f: impl FnOnce(Endpoint) -> Endpoint) -> Self {
        Self {
            endpoint: f(self.endpoint),
            target: self.target,
            connector: self.connector,
        }
    }

    /// Where calls through this endpoint go, for their spans.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// [`PeerEndpoint::connect_lazy_to`], in the client tracing layer.
    pub fn traced_lazy_to(&self, addr: std::net::SocketAddr) -> TracedChannel {
        crate::telemetry::grpc::traced(self.connect_lazy_to(addr), self.target.clone())
    }

    /// [`PeerEndpoint::connect_lazy`], in the client tracing layer.
    pub fn traced_lazy(&self) -> TracedChannel {
        crate::telemetry::grpc::traced(self.connect_lazy(), self.target.clone())
    }

    pub async fn connect(&self) -> Result<Channel, tonic::transport::Error> {
        match &self.connector {
            None => self.endpoint.connect().await,
            Some(c) => self.endpoint.connect_with_connector(c.clone()).await,
        }
    }

    pub fn connect_lazy(&self) -> Channel {
        match &self.connector {
            None => self.endpoint.connect_lazy(),
            Some(c) => self.endpoint.connect_with_connector_lazy(c.clone()),
        }
    }

    /// The host this endpoint names and its port (the scheme's default
    /// when it names none), to resolve.
    pub fn host_and_port(&self) -> (String, u16) {
        (
            self.target.address().to_owned(),
            self.target.port().unwrap_or(443),
        )
    }

    /// Like [`PeerEndpoint::connect_lazy`], to one of the addresses the
    /// endpoint's host resolves to: the connection goes to `addr`, and TLS
    /// still checks the certificate against the host name and the identity
    /// (a replica behind a headless Service carries the Service's name).
    pub fn connect_lazy_to(&self, addr: std::net::SocketAddr) -> Channel {
        match &self.connector {
            None => self.endpoint.connect_with_connector_lazy(PlainConnector { addr }),
            Some(c) => self.endpoint.connect_with_connector_lazy(PeerConnector {
                config: Arc::clone(&c.config),
                dial: Some(addr),
            }),
        }
    }
}

/// Dials one address in plaintext, whatever the URI's host.
#[derive(Clone, Copy)]
struct PlainConnector {
    addr: std::net::SocketAddr,
}

impl Service<Uri> for PlainConnector {
    type Response = hyper_util::rt::TokioIo<tokio::net::TcpStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let addr = self.addr;
        Box::pin(async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            Ok(hyper_util::rt::TokioIo::new(tcp))
        })
    }
}

/// Dials TCP and does TLS with a [`PeerVerifier`].
#[derive(Clone)]
struct PeerConnector {
    config: Arc<rustls::ClientConfig>,
    /// The address to dial, when not the URI's host (a resolved replica);
    /// the URI's host is still the name the certificate must carry.
    dial: Option<std::net::SocketAddr>,
}

type PeerStream = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

impl Service<Uri> for PeerConnector {
    type Response = PeerStream;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<PeerStream, std::io::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let config = Arc::clone(&self.config);
        let dial = self.dial;
        Box::pin(async move {
            let invalid =
                |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{uri}: {what}"));
            let host = uri
                .host()
                .ok_or_else(|| invalid("no host"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = match dial {
                Some(addr) => tokio::net::TcpStream::connect(addr).await?,
                None => tokio::net::TcpStream::connect((host.as_str(), port)).await?,
            };
            tcp.set_nodelay(true)?;
            let name = rustls_pki_types::ServerName::try_from(host.clone())
                .map_err(|_| invalid("not a server name"))?;
            let handshake = tokio_rustls::TlsConnector::from(config).connect(name, tcp);
            let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "the TLS handshake timed out")
                })??;
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

/// The CA chain and host name checks of rustls against the CA in force,
/// then the server's identity.
#[derive(Debug)]
struct PeerVerifier {
    material: Arc<TlsMaterial>,
    expect: String,
}

impl rustls::client::danger::ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &rustls_pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let verified = self.material.pems().server_verifier.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        let found = identities_in(end_entity);
        if found.contains(&self.expect) {
            Ok(verified)
        } else {
            Err(rustls::Error::General(format!(
                "the server is not {}: its certificate names {}",
                self.expect,
                if found.is_empty() {
                    "no identity".to_owned()
                } else {
                    found.join(", ")
                }
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.material
            .pems()
            .server_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.material
            .pems()
            .server_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.material.pems().server_verifier.supported_verify_schemes()
    }
}

/// A client's chain checked against the CA in force at its handshake.
#[derive(Debug)]
struct ClientVerifier {
    material: Arc<TlsMaterial>,
    auth: ClientAuth,
}

impl rustls::server::danger::ClientCertVerifier for ClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.auth == ClientAuth::Required
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        // No hints: a client offers its one certificate whatever they say.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        self.material
            .pems()
            .client_verifier
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.material
            .pems()
            .client_verifier
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.material
            .pems()
            .client_verifier
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.material.pems().client_verifier.supported_verify_schemes()
    }
}

/// This side's certificate and key in force at each handshake, as a server
/// presents them and as a client does.
#[derive(Debug)]
struct Current(Arc<TlsMaterial>);

impl rustls::server::ResolvesServerCert for Current {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.pems().certified.clone()
    }
}

impl rustls::client::ResolvesClientCert for Current {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        self.0.pems().certified.clone()
    }

    fn has_certs(&self) -> bool {
        self.0.identity_paths.is_some()
    }
}

/// The TLS flags every service takes (flattened into
/// [`crate::runtime::CommonArgs`]).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// This service's certificate chain (PEM), leaf first. Its identity is
    /// the URI SAN `spiffe://provisioning/<name>`.
    #[arg(long, env = "PROVISIONING_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "PROVISIONING_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// The CA bundle (PEM) peers' certificates are verified against: the
    /// servers this service calls, and its clients.
    #[arg(long, env = "PROVISIONING_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// Serve and call in plaintext, without TLS and without checking who the
    /// peer is. For development only; logs a warning at start. A service
    /// with neither this nor the three --tls-* files refuses to start.
    #[arg(long, env = "PROVISIONING_INSECURE", value_parser = clap::builder::BoolishValueParser::new(), default_value_t = false)]
    pub insecure: bool,
    /// How often the three TLS files are looked at for a change; a changed
    /// set that loads is used for new handshakes (connections already made
    /// keep theirs), one that does not is logged and the old set stays.
    /// SIGHUP reloads at once. 0: only on SIGHUP.
    #[arg(long, env = "PROVISIONING_TLS_RELOAD_INTERVAL_MS", default_value_t = 5_000)]
    pub tls_reload_interval_ms: u64,
}

impl TlsArgs {
    /// Reads and checks the TLS files, or accepts plaintext when `--insecure`
    /// asks for it; refuses neither, both, or an incomplete set.
    pub fn transport(&self) -> Result<Transport, TlsError> {
        let given = [
            ("--tls-cert", self.tls_cert.as_deref()),
            ("--tls-key", self.tls_key.as_deref()),
            ("--tls-ca", self.tls_ca.as_deref()),
        ];
        if self.insecure {
            if let Some((flag, _)) = given.iter().find(|(_, p)| p.is_some()) {
                return Err(TlsError::Conflict { flag });
            }
            return Ok(Transport::Insecure);
        }
        if given.iter().all(|(_, p)| p.is_none()) {
            return Err(TlsError::NoSettings);
        }
        match given {
            [(_, Some(cert)), (_, Some(key)), (_, Some(ca))] => Ok(Transport::Tls(Arc::new(
                TlsMaterial::load(ca, Some((cert, key)))?
                    .with_reload_interval(Duration::from_millis(self.tls_reload_interval_ms)),
            ))),
            _ => {
                let missing = given
                    .iter()
                    .find(|(_, p)| p.is_none())
                    .map_or("--tls-ca", |(flag, _)| flag);
                Err(TlsError::Incomplete { missing })
            }
        }
    }
}

/// The flag of a service only the driver may call: which client identities
/// it lets through.
#[derive(Debug, Clone, clap::Args)]
pub struct PeerArgs {
    /// A client identity allowed to call this service: a name (`driver-svc`
    /// means `spiffe://provisioning/driver-svc`) or a whole `spiffe://` URI.
    /// Repeat it (or separate with commas) to allow several. Health checks
    /// are open to any client with a certificate from the CA.
    #[arg(
        long = "tls-allow-client",
        env = "PROVISIONING_TLS_ALLOW_CLIENT",
        value_name = "NAME",
        value_delimiter = ',',
        default_value = DRIVER
    )]
    pub allow: Vec<String>,
}

impl PeerArgs {
    /// The allowed identities as URIs.
    pub fn identities(&self) -> Vec<String> {
        self.allow.iter().map(|n| identity_of(n.trim())).collect()
    }
}

/// How a service that only the driver may call is secured: its transport,
/// with client certificates required, and the identities let through.
#[derive(Debug, Clone)]
pub struct PeerPolicy {
    transport: Transport,
    allowed: Arc<[String]>,
}

impl PeerPolicy {
    /// Plaintext, nobody checked: for a server embedded in a test.
    pub fn plaintext() -> Self {
        Self {
            transport: Transport::Insecure,
            allowed: Arc::from(Vec::new()),
        }
    }

    /// `transport`, and with TLS only clients whose certificate carries one
    /// of `allowed` (URIs, see [`identity_of`]).
    pub fn new(transport: Transport, allowed: Vec<String>) -> Self {
        Self {
            transport,
            allowed: Arc::from(allowed),
        }
    }

    /// The connections a server of this policy accepts on `listener`
    /// ([`Transport::incoming`]), client certificates required.
    pub fn incoming(&self, listener: tokio::net::TcpListener) -> Result<Incoming, TlsError> {
        self.transport.incoming(listener, ClientAuth::Required)
    }

    /// The layer that checks the client's identity (it lets everything
    /// through in plaintext, where there is none to check).
    pub fn layer(&self) -> PeerIdentityLayer {
        PeerIdentityLayer {
            allowed: self.transport.is_tls().then(|| Arc::clone(&self.allowed)),
        }
    }
}

/// Lets a call through only if the client's certificate carries an allowed
/// identity; answers others `PERMISSION_DENIED` (and a connection without a
/// certificate `UNAUTHENTICATED`) before any handler runs. Health checks pass
/// unchecked. See [`PeerPolicy::layer`].
#[derive(Debug, Clone)]
pub struct PeerIdentityLayer {
    /// `None`: no check (plaintext).
    allowed: Option<Arc<[String]>>,
}

impl PeerIdentityLayer {
    /// Lets only `allowed` identities through.
    pub fn allow(allowed: Vec<String>) -> Self {
        Self {
            allowed: Some(Arc::from(allowed)),
        }
    }
}

impl<S> Layer<S> for PeerIdentityLayer {
    type Service = PeerIdentity<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PeerIdentity {
            inner,
            allowed: self.allowed.clone(),
        }
    }
}

/// See [`PeerIdentityLayer`].
#[derive(Debug, Clone)]
pub struct PeerIdentity<S> {
    inner: S,
    allowed: Option<Arc<[String]>>,
}

const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";

/// Words every refusal of the decider's and the executor's ports carries, so
/// that a client pointed at one of them by mistake can say it is not the
/// driver.
pub const INTERNAL_PORT: &str = "the provisioning services' internal protocol";

/// Whether the call may go on: the verdict for a request's path and the
/// certificates its connection presented.
fn admit(
    allowed: &[String],
    path: &str,
    peer_certs: Option<&[CertificateDer<'static>]>,
) -> Result<(), tonic::Status> {
    if path.starts_with(HEALTH_PREFIX) {
        return Ok(());
    }
    let Some(leaf) = peer_certs.and_then(<[_]>::first) else {
        return Err(tonic::Status::unauthenticated(
            "this port serves the provisioning services' internal protocol, only to clients with a \
             certificate; none was presented",
        ));
    };
    let presented = identities_in(leaf);
    if presented.iter().any(|id| allowed.contains(id)) {
        return Ok(());
    }
    let presented = if presented.is_empty() {
        "a certificate with no spiffe:// identity".to_owned()
    } else {
        presented.join(", ")
    };
    Err(tonic::Status::permission_denied(format!(
        "{presented} may not call this port: it serves the provisioning services' internal protocol, \
         only to {}",
        allowed.join(", ")
    )))
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for PeerIdentity<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if let Some(allowed) = &self.allowed {
            let certs = req
                .extensions()
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(TlsConnectInfo::peer_certs);
            if let Err(status) = admit(allowed, req.uri().path(), certs.as_deref().map(Vec::as_slice)) {
                tracing::warn!(
                    path = req.uri().path(),
                    code = ?status.code(),
                    reason = status.message(),
                    "call refused"
                );
                return Box::pin(std::future::ready(Ok(status.into_http())));
            }
        }
        Box::pin(self.inner.call(req))
    }
}

#[cfg(feature = "certgen")]
pub mod dev;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_spiffe_uris() {
        assert_eq!(identity_of("driver-svc"), "spiffe://provisioning/driver-svc");
        assert_eq!(identity_of("spiffe://other/x"), "spiffe://other/x");
    }

    #[test]
    fn urls_take_the_transport_scheme() {
        let insecure = Transport::Insecure;
        assert_eq!(
            insecure.url("127.0.0.1:7000").ok().as_deref(),
            Some("http://127.0.0.1:7000")
        );
        assert_eq!(insecure.url("http://h:1").ok().as_deref(), Some("http://h:1"));
        assert!(matches!(
            insecure.url("https://h:1"),
            Err(TlsError::Scheme { .. })
        ));
    }

    #[test]
    fn plaintext_needs_to_be_asked_for() {
        let none = TlsArgs::default();
        assert!(matches!(none.transport(), Err(TlsError::NoSettings)));
        let insecure = TlsArgs {
            insecure: true,
            ..TlsArgs::default()
        };
        assert!(matches!(insecure.transport(), Ok(Transport::Insecure)));
        let both = TlsArgs {
            insecure: true,
            tls_ca: Some("ca.pem".into()),
            ..TlsArgs::default()
        };
        assert!(matches!(
            both.transport(),
            Err(TlsError::Conflict { flag: "--tls-ca" })
        ));
        let partial = TlsArgs {
            tls_cert: Some("c.pem".into()),
            tls_ca: Some("ca.pem".into()),
            ..TlsArgs::default()
        };
        assert!(matches!(
            partial.transport(),
            Err(TlsError::Incomplete { missing: "--tls-key" })
        ));
    }

    #[test]
    fn health_is_open_and_everything_else_needs_a_certificate() {
        let allowed = vec![identity_of(DRIVER)];
        assert!(admit(&allowed, "/grpc.health.v1.Health/Check", None).is_ok());
        let refused = admit(&allowed, "/provisioning.internal.v1.Executor/Inventory", None);
        assert!(matches!(refused, Err(s) if s.code() == tonic::Code::Unauthenticated));
        let garbage = [CertificateDer::from(vec![1u8, 2, 3])];
        let refused = admit(
            &allowed,
            "/provisioning.internal.v1.Executor/Inventory",
            Some(&garbage),
        );
        assert!(matches!(refused, Err(s) if s.code() == tonic::Code::PermissionDenied));
    }
}
