//! Listening, announcing and shutting down: what every plugin does the same
//! way.

use std::{
    fmt,
    future::Future,
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    str::FromStr,
    sync::Arc,
};

use platform::tls::{ClientAuth, TlsArgs, Transport};
use tokio_stream::wrappers::UnixListenerStream;

use crate::{ANNOUNCEMENT, Events, Provider, server::ProviderService, server::TestingService, wire::pb};

/// Where a plugin listens: `host:port` (TCP) or `unix:/path` (a Unix
/// socket, which the plugin creates and removes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl FromStr for Listen {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path (unix:/run/provider.sock)".into());
            }
            return Ok(Listen::Unix(PathBuf::from(path)));
        }
        s.parse::<SocketAddr>()
            .map(Listen::Tcp)
            .map_err(|e| format!("{s:?} is neither host:port nor unix:/path: {e}"))
    }
}

impl fmt::Display for Listen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Listen::Tcp(addr) => write!(f, "{addr}"),
            Listen::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// The flags every plugin binary takes (flatten them into its own).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Where to listen: `host:port` (port 0 picks a free one) or
    /// `unix:/path`. The bound address is announced on standard output as
    /// `provider-listening <address>`.
    #[arg(long, env = "PROVIDER_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: Listen,
    /// Serve the testing hooks (`ProviderTesting`: lose or sicken one
    /// resource on request), for a conformance run. Never in production.
    #[arg(long, env = "PROVIDER_TESTING")]
    pub testing: bool,
    /// Log as JSON lines (on standard error) instead of text.
    #[arg(long, env = "PROVIDER_LOG_JSON")]
    pub log_json: bool,
    /// TLS over TCP: --tls-cert, --tls-key, --tls-ca (client certificates
    /// are required and checked against the CA), or --insecure. Not used on
    /// a Unix socket, which the file system's permissions protect.
    #[command(flatten)]
    pub tls: TlsArgs,
}

impl ServeArgs {
    /// The options these flags give: an error when TCP has neither TLS nor
    /// `--insecure`.
    pub fn options(&self) -> Result<ServeOptions, ServeError> {
        let transport = match &self.listen {
            Listen::Unix(_) => Transport::Insecure,
            Listen::Tcp(_) => self.tls.transport().map_err(ServeError::Tls)?,
        };
        Ok(ServeOptions {
            listen: self.listen.clone(),
            transport,
            testing: self.testing,
            announce: true,
        })
    }
}

/// How [`serve`] serves.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: Listen,
    /// TLS or plaintext on TCP; a Unix socket is always plaintext.
    pub transport: Transport,
    /// Serve the [`crate::Testing`] hooks.
    pub testing: bool,
    /// Write the announcement line on standard output once listening.
    pub announce: bool,
}

impl ServeOptions {
    /// Plaintext on `listen`, announced, no testing hooks.
    pub fn plaintext(listen: Listen) -> Self {
        Self {
            listen,
            transport: Transport::Insecure,
            testing: false,
            announce: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {listen}: {source}")]
    Bind { listen: Listen, source: std::io::Error },
    #[error("{0}")]
    Tls(platform::tls::TlsError),
    #[error("cannot announce the address on standard output: {0}")]
    Announce(std::io::Error),
    #[error("the provider's info names no provider: it must serve at least one name")]
    NoNames,
    #[error("--testing: the provider has no testing hooks")]
    NoTestingHooks,
    #[error("the gRPC server failed: {0}")]
    Server(#[from] tonic::transport::Error),
}

/// The line a plugin writes on standard output once it listens at `address`.
pub fn announce_line(address: &str) -> String {
    format!("{ANNOUNCEMENT} {address}")
}

/// The address an announcement line gives (the inverse of
/// [`announce_line`]), for whoever starts a plugin; the error says what the
/// line was instead.
pub fn announced_address(line: &str) -> Result<&str, String> {
    line.strip_prefix(ANNOUNCEMENT)
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .ok_or_else(|| {
            format!("its first line on standard output was {line:?}, not `{ANNOUNCEMENT} <address>`")
        })
}

fn announce(address: &str) -> Result<(), ServeError> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", announce_line(address))
        .and_then(|()| out.flush())
        .map_err(ServeError::Announce)
}

/// Removes a stale socket file left by an earlier run (only a socket: any
/// other file at the path is left for `bind` to refuse).
fn remove_stale_socket(path: &Path) {
    use std::os::unix::fs::FileTypeExt as _;
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        let _ = std::fs::remove_file(path);
    }
}

/// Serves `provider` until `shutdown` resolves, then lets calls in flight
/// finish and returns. Calls [`Provider::start`] first, then listens, then
/// announces the address.
pub async fn serve<P: Provider>(
    provider: P,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let info = provider.info();
    if info.provider_names.is_empty() {
        return Err(ServeError::NoNames);
    }
    let testing = match (options.testing, provider.testing()) {
        (false, _) => None,
        (true, Some(hooks)) => Some(TestingService::new(hooks)),
        (true, None) => return Err(ServeError::NoTestingHooks),
    };
    let events = Events::default();
    provider.start(events.clone());
    let provider = Arc::new(provider);
    let service = pb::provider_server::ProviderServer::new(ProviderService::new(provider, events));
    let mut server = options
        .transport
        .configure_server(platform::runtime::server(), ClientAuth::Required)
        .map_err(ServeError::Tls)?;
    let router = server
        .add_service(service)
        .add_optional_service(testing.map(pb::provider_testing_server::ProviderTestingServer::new));
    match &options.listen {
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Bind {
                    listen: options.listen.clone(),
                    source,
                })?;
            let bound = listener.local_addr().map_err(|source| ServeError::Bind {
                listen: options.listen.clone(),
                source,
            })?;
            tracing::info!(address = %bound, names = ?info.provider_names, "provider plugin listening");
            if options.announce {
                announce(&bound.to_string())?;
            }
            router
                .serve_with_incoming_shutdown(platform::runtime::incoming(listener), shutdown)
                .await?;
        }
        Listen::Unix(path) => {
            remove_stale_socket(path);
            let listener = tokio::net::UnixListener::bind(path).map_err(|source| ServeError::Bind {
                listen: options.listen.clone(),
                source,
            })?;
            tracing::info!(address = %options.listen, names = ?info.provider_names, "provider plugin listening");
            if options.announce {
                announce(&options.listen.to_string())?;
            }
            let served = router
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
                .await;
            remove_stale_socket(path);
            served?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_parse() {
        assert_eq!(
            "127.0.0.1:0".parse::<Listen>(),
            Ok(Listen::Tcp("127.0.0.1:0".parse().unwrap()))
        );
        assert_eq!(
            "unix:/tmp/p.sock".parse::<Listen>(),
            Ok(Listen::Unix(PathBuf::from("/tmp/p.sock")))
        );
        assert!("unix:".parse::<Listen>().is_err());
        assert!("localhost".parse::<Listen>().is_err());
        assert_eq!(Listen::Unix(PathBuf::from("/a")).to_string(), "unix:/a");
    }

    #[test]
    fn tcp_needs_tls_or_insecure_and_a_socket_does_not() {
        use clap::Parser as _;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let cli = Cli::try_parse_from(["p"]).unwrap();
        assert!(matches!(cli.serve.options(), Err(ServeError::Tls(_))));
        let cli = Cli::try_parse_from(["p", "--insecure"]).unwrap();
        assert!(cli.serve.options().is_ok());
        let cli = Cli::try_parse_from(["p", "--listen", "unix:/tmp/x.sock"]).unwrap();
        assert!(!cli.serve.options().unwrap().transport.is_tls());
    }
}
