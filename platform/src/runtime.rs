//! What every service binary does the same way: flags shared by all three,
//! telemetry setup (logs, traces, metrics: see [`crate::telemetry`]), the
//! bound-address announcement (a log line and an optional ready file), gRPC
//! health and reflection, and the shutdown signal.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::net::TcpListener;

/// Flags every service takes; each has an environment-variable equivalent.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// Address to listen on; port 0 picks a free port, announced once bound.
    #[arg(long, env = "PROVISIONING_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Write the bound address to this file once listening (written atomically).
    #[arg(long, env = "PROVISIONING_READY_FILE")]
    pub ready_file: Option<PathBuf>,
    /// Log as JSON lines instead of text.
    #[arg(long, env = "PROVISIONING_LOG_JSON", value_parser = clap::builder::BoolishValueParser::new(), default_value_t = false)]
    pub log_json: bool,
    /// How long in-flight work may take to drain after SIGTERM/SIGINT.
    #[arg(long, env = "PROVISIONING_SHUTDOWN_GRACE_MS", default_value_t = 5000)]
    pub shutdown_grace_ms: u64,
    /// Serve Prometheus metrics over HTTP at /metrics on this address; off
    /// unless given. Port 0 picks a free port, announced in a log line and,
    /// with --ready-file, in `<ready file>.metrics`.
    #[arg(long, env = "PROVISIONING_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Append a trace of what this service receives, decides, records and
    /// dispatches to this file, one JSON object per line (for tests and
    /// debugging; see `platform::event_trace`). Off unless given.
    #[arg(long, env = "PROVISIONING_EVENT_TRACE")]
    pub event_trace: Option<PathBuf>,
    /// TLS: --tls-cert, --tls-key, --tls-ca, or --insecure.
    #[command(flatten)]
    pub tls: crate::tls::TlsArgs,
    /// --max-recv-message-bytes, --max-send-message-bytes.
    #[command(flatten)]
    pub messages: MessageLimits,
}

impl CommonArgs {
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }

    /// This service's transport from the TLS flags (see [`crate::tls`]): TLS,
    /// or plaintext with a warning when `--insecure` asks for it. An error
    /// (no TLS settings, an incomplete set, a file that cannot be read) means
    /// the service must not start. Call it after [`init_telemetry`].
    pub fn transport(&self, service: &str) -> Result<crate::tls::Transport, crate::tls::TlsError> {
        let transport = self.tls.transport()?;
        match &transport {
            crate::tls::Transport::Insecure => tracing::warn!(
                service,
                "--insecure: serving and calling in plaintext; peers are not authenticated and \
                 anyone who can reach this port can call it"
            ),
            crate::tls::Transport::Tls(material) => tracing::info!(
                service,
                identity = %material.names().join(","),
                "TLS on"
            ),
        }
        Ok(transport)
    }
}

/// Sets up this service's logs, traces and metrics endpoint from its flags
/// and the standard `OTEL_*` variables (see [`crate::telemetry`]), and its
/// event trace if `--event-trace` asks for one. Call it first thing in
/// `main`, inside the runtime, and keep the result until `main` ends:
/// shutting it down (or dropping it) flushes buffered spans.
pub fn init_telemetry(
    service: &'static str,
    common: &CommonArgs,
) -> Result<crate::telemetry::Telemetry, crate::telemetry::TelemetryError> {
    let telemetry = crate::telemetry::init(&crate::telemetry::TelemetryConfig {
        service,
        log_json: common.log_json,
        metrics_listen: common.metrics_listen,
        ready_file: common.ready_file.as_deref(),
    })?;
    if let Some(path) = &common.event_trace {
        crate::event_trace::install(service, path).map_err(|source| {
            crate::telemetry::TelemetryError::EventTrace {
                path: path.clone(),
                source,
            }
        })?;
        tracing::info!(path = %path.display(), "event trace on");
    }
    Ok(telemetry)
}

/// How a service's `main` ends: an error is logged through the log layer (a
/// JSON line when the log is JSON, as every other line), or printed as
/// `Error: ...` when logging was never set up, and the exit code is 1.
pub fn exit_code<E: std::fmt::Display>(result: Result<(), E>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            if tracing::dispatcher::has_been_set() {
                tracing::error!(error = %format_args!("{e:#}"), "exiting on an error");
            } else {
                eprintln!("Error: {e:#}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// Sets up logging only: `RUST_LOG` filters (default `info`), text or JSON
/// lines. For helper binaries that take no part in traces or metrics.
pub fn init_logging(json: bool) {
    use tracing_subscriber::{EnvFilter, fmt};
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A second initialisation (tests that start several services in one
    // process) keeps the first subscriber.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// Binds, then announces the bound address in a log line and, if asked, in a
/// ready file that appears whole (written to a temporary name, then renamed).
pub async fn bind_and_announce(
    service: &str,
    listen: SocketAddr,
    ready_file: Option<&Path>,
) -> std::io::Result<TcpListener> {
    let listener = TcpListener::bind(listen).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            std::io::Error::new(
                e.kind(),
                format!(
                    "{e}: another process listens on {listen}; stop it, or give --listen \
                     (PROVISIONING_LISTEN) another address (port 0 picks a free one)"
                ),
            )
        } else {
            e
        }
    })?;
    let addr = listener.local_addr()?;
    tracing::info!(service, %addr, "listening");
    if let Some(path) = ready_file {
        crate::announce::write_ready_file(path, addr)?;
    }
    Ok(listener)
}

/// Calls a peer may have in flight on one connection to a server of ours.
///
/// tonic's servers otherwise advertise no limit, so a client sends every
/// call it has at once. h2 guards a server against floods of small DATA
/// frames: each frame under 256 bytes that the service has not read yet
/// counts against half the connection window (512 KiB), and past it the
/// connection is closed (`GOAWAY`, `too_many_data_frames`), failing every
/// call on it. An executor's ten thousand operations to a provider plugin
/// did that: each a few hundred bytes, read late on a busy machine. At 1,024
/// streams the unread frames stay under 256 KiB whatever their size, and the
/// client holds further calls until a stream frees.
pub const MAX_CONCURRENT_STREAMS: u32 = 1024;

/// A gRPC server builder with what every server of ours sets
/// ([`MAX_CONCURRENT_STREAMS`]).
pub fn server() -> tonic::transport::Server {
    tonic::transport::Server::builder().max_concurrent_streams(MAX_CONCURRENT_STREAMS)
}

/// The connections a server accepts on `listener`, each with `TCP_NODELAY`
/// set. tonic sets it on the connections it accepts itself, not on those a
/// stream of accepted sockets hands it; without it, the second message of a
/// streamed answer (a `Decide` answer's summary after its decisions, say)
/// waits for the peer's delayed acknowledgement (Nagle's algorithm), about
/// 40 ms on Linux, on every call.
pub fn incoming(listener: TcpListener) -> NoDelayIncoming {
    NoDelayIncoming { listener }
}

/// See [`incoming`].
#[derive(Debug)]
pub struct NoDelayIncoming {
    listener: TcpListener,
}

impl tokio_stream::Stream for NoDelayIncoming {
    type Item = std::io::Result<tokio::net::TcpStream>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.listener.poll_accept(cx) {
            std::task::Poll::Ready(Ok((stream, peer))) => {
                if let Err(e) = stream.set_nodelay(true) {
                    // The connection still works, only slower.
                    tracing::debug!(%peer, error = %e, "TCP_NODELAY could not be set");
                }
                std::task::Poll::Ready(Some(Ok(stream)))
            }
            std::task::Poll::Ready(Err(e)) => std::task::Poll::Ready(Some(Err(e))),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                    _ = int.recv() => tracing::info!("SIGINT: shutting down"),
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The standard gRPC health service (with `S` marked serving) and the
/// reflection service, in both versions clients speak (`v1`, and `v1alpha`
/// for older grpcurl and Python's grpcio-reflection), listing only what this
/// port serves: `S`, health and reflection (a driver's public port does not
/// advertise the internal Decider and Executor services).
pub async fn health_and_reflection<S: tonic::server::NamedService>() -> Result<
    (
        tonic_health::server::HealthReporter,
        tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
    ),
    tonic_reflection::server::Error,
> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<S>().await;
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(contract::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name(S::NAME)
            .with_service_name(HEALTH_SERVICE)
            .with_service_name(REFLECTION_V1)
            .with_service_name(REFLECTION_V1ALPHA)
    };
    let reflection = builder().build_v1()?;
    let reflection_alpha = builder().build_v1alpha()?;
    Ok((reporter, health, reflection, reflection_alpha))
}

/// The services every port serves besides its own.
pub const HEALTH_SERVICE: &str = "grpc.health.v1.Health";
pub const REFLECTION_V1: &str = "grpc.reflection.v1.ServerReflection";
pub const REFLECTION_V1ALPHA: &str = "grpc.reflection.v1alpha.ServerReflection";

/// The largest gRPC message a server accepts and sends, on every service
/// (a peer cannot make it buffer more than this per message). A request over
/// the limit is refused with tonic's `OUT_OF_RANGE` (the driver's public API
/// answers `RESOURCE_EXHAUSTED`, as gRPC specifies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct MessageLimits {
    /// The largest message this server accepts, in bytes.
    #[arg(long = "max-recv-message-bytes", env = "PROVISIONING_MAX_RECV_MESSAGE_BYTES", value_name = "BYTES",
          default_value_t = MessageLimits::DEFAULT_RECV, value_parser = clap::value_parser!(u32).range(1..))]
    pub recv: u32,
    /// The largest message this server sends, in bytes (a large run's full
    /// status, or the executor's inventory, are the big ones).
    #[arg(long = "max-send-message-bytes", env = "PROVISIONING_MAX_SEND_MESSAGE_BYTES", value_name = "BYTES",
          default_value_t = MessageLimits::DEFAULT_SEND, value_parser = clap::value_parser!(u32).range(1..))]
    pub send: u32,
}

impl MessageLimits {
    /// 4 MiB: tonic's own default, which every request of the services fits.
    pub const DEFAULT_RECV: u32 = 4 << 20;
    /// 64 MiB: what the driver accepts from the executor and the decider.
    pub const DEFAULT_SEND: u32 = 64 << 20;

    pub fn recv_bytes(&self) -> usize {
        self.recv as usize
    }

    pub fn send_bytes(&self) -> usize {
        self.send as usize
    }
}

impl Default for MessageLimits {
    fn default() -> Self {
        Self {
            recv: Self::DEFAULT_RECV,
            send: Self::DEFAULT_SEND,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use tokio_stream::StreamExt as _;

    use super::*;

    /// Every accepted connection has `TCP_NODELAY`, so a streamed answer's
    /// later messages do not wait for delayed acknowledgements.
    #[tokio::test]
    async fn accepted_connections_do_not_wait_for_acknowledgements() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut accepted = incoming(listener);
        for _ in 0..2 {
            let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let server_side = accepted.next().await.unwrap().unwrap();
            assert!(server_side.nodelay().unwrap());
        }
    }
}
