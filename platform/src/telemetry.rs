//! Tracing, logs and metrics set up once per process, and W3C trace context
//! carried across the services.
//!
//! [`init`] installs one `tracing` subscriber with two layers: the log layer
//! (text, or JSON lines that carry the enclosing span's trace and span ids,
//! filtered by `RUST_LOG`) and the OpenTelemetry layer, which turns this
//! workspace's spans into OpenTelemetry spans. The OpenTelemetry layer is there
//! even when nothing is exported, so trace ids exist for the logs and travel
//! to the next service; spans leave the process over OTLP/gRPC only when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is
//! set, in plaintext or TLS as [`export`] says, which also makes the exporter
//! report its own health (log lines, and counters of spans exported and
//! dropped). Exporter settings that cannot be used are logged and the process
//! runs without exporting: telemetry never stops a service from serving. The
//! SDK reads the other standard variables itself: `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` (and `_ARG`), the batch
//! processor's `OTEL_BSP_*`. The returned [`Telemetry`] flushes the spans still
//! buffered when it is shut down or dropped, which each binary does as `main`
//! ends.
//!
//! Span attributes that count something are integers: `tracing-opentelemetry`
//! records a field of type `u64`, `usize` or `u32` (and any `%` or `?` field)
//! as a string, and only `i64` (and the smaller signed types) as an integer,
//! so counts are passed through [`int`].
//!
//! Propagation is W3C trace context only. Across gRPC calls it rides in the
//! `traceparent`/`tracestate` metadata, injected and extracted by the tower
//! layers in [`grpc`]; across the messages streamed on the driver–executor
//! link it rides in each message's [`TraceContext`], through
//! [`context_of`]/[`set_parent`].

use std::{net::SocketAddr, path::Path, time::Duration};

use opentelemetry::{
    Context,
    propagation::{Extractor, Injector, TextMapPropagator as _},
    trace::{SpanContext, TraceContextExt as _, TraceFlags, TraceState, TracerProvider as _},
};
use opentelemetry_sdk::{
    Resource,
    propagation::TraceContextPropagator,
    trace::{IdGenerator as _, RandomIdGenerator, SdkTracerProvider},
};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::{
    EnvFilter, Layer as _,
    filter::{FilterExt as _, filter_fn},
    layer::SubscriberExt as _,
};

use contract::ops::TraceContext;

pub mod export;
pub mod grpc;
mod json;

/// The crates whose spans are exported. Spans of the libraries underneath
/// (tonic, hyper, h2) stay local: they would multiply the span count by the
/// number of frames and say nothing an operator acts on.
const EXPORTED_TARGETS: &[&str] = &["platform", "decider_svc", "driver_svc", "executor_svc"];

/// Whether `target` is one of [`EXPORTED_TARGETS`] or a module under one.
/// Asked for every span and event the OpenTelemetry layer sees, so it
/// allocates nothing.
fn exported_target(target: &str) -> bool {
    EXPORTED_TARGETS.iter().any(|t| {
        target
            .strip_prefix(t)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    })
}

/// The names of spans no log line is written in, which the log layer does not
/// see. The log layer formats a span's fields into a string when the span is
/// made, whether or not anything is ever logged in it; for these spans, made
/// once per operation or per message folded, that was a fifth of the driver's
/// CPU and a sixteenth of the executor's at a million nodes, for nothing:
///
/// - `operation`, the driver's span of an operation ([`operation_span!`]),
///   lives from dispatch to fold and is never entered;
/// - `fold`, the driver's span around folding one executor message, holds no
///   log line that does not name its run and node itself;
/// - `execute`, the executor's span around one provider call: the backends
///   log from their own tasks, naming the plugin.
///
/// Exported spans are not affected; with no exporter these spans are not
/// built at all.
pub const UNLOGGED_SPANS: [&str; 3] = ["operation", "fold", "execute"];

/// Whether the log layer sees this span or event.
fn logged(meta: &tracing::Metadata<'_>) -> bool {
    !(meta.is_span() && UNLOGGED_SPANS.contains(&meta.name()))
}

/// What [`init`] needs.
#[derive(Debug, Clone)]
pub struct TelemetryConfig<'a> {
    /// The default `service.name` when neither `OTEL_SERVICE_NAME` nor
    /// `OTEL_RESOURCE_ATTRIBUTES` names one.
    pub service: &'static str,
    /// Log JSON lines instead of text.
    pub log_json: bool,
    /// Serve Prometheus metrics on this address; port 0 picks one.
    pub metrics_listen: Option<SocketAddr>,
    /// The service's ready file: the metrics address is written next to it,
    /// as `<ready file>.metrics`.
    pub ready_file: Option<&'a Path>,
}

/// Why telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("binding the metrics endpoint on {addr}: {source}")]
    MetricsBind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("writing the metrics ready file {path}: {source}")]
    MetricsReadyFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("opening the event trace {path}: {source}")]
    EventTrace {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// The process's telemetry. Shut it down (or drop it) as `main` ends, inside
/// the multi-threaded runtime, so buffered spans are exported.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    exporting: bool,
    metrics_addr: Option<SocketAddr>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
}

/// How long the final export may take at shutdown; a collector that is gone
/// must not hold the process past its grace period for long.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

impl Telemetry {
    /// Where metrics are served, if they are.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Whether spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.exporting
    }

    /// Exports the spans still buffered and stops the exporter and the
    /// metrics endpoint. The provider's shutdown blocks until the export ends,
    /// so it runs on a blocking thread while the runtime's workers drive the
    /// exporter's connection.
    pub async fn shutdown(mut self) {
        if let Some(task) = self.metrics_task.take() {
            task.abort();
        }
        if let Some(provider) = self.provider.take() {
            let flushed = tokio::task::spawn_blocking(move || {
                let result = provider.shutdown_with_timeout(FLUSH_TIMEOUT);
                (result, provider)
            })
            .await;
            // Through the log layer, so a JSON log stays JSON to its end.
            if let Ok((Err(e), _)) = flushed {
                tracing::warn!(error = %e, "flushing spans at shutdown failed; the spans still buffered are lost");
            }
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(task) = self.metrics_task.take() {
            task.abort();
        }
        // A `main` that returned early through `?` did not call `shutdown`;
        // flushing here still exports its spans. This blocks the dropping
        // thread, which in `main` is the runtime's entry thread, not a worker.
        if let Some(provider) = self.provider.take()
            && self.exporting
            && let Err(e) = provider.shutdown_with_timeout(FLUSH_TIMEOUT)
        {
            tracing::warn!(error = %e, "flushing spans at exit failed; the spans still buffered are lost");
        }
    }
}

/// Whether `OTEL_TRACES_EXPORTER=none` turns exporting off.
fn exporter_none() -> bool {
    std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.trim() == "none")
}

/// A count as the integer attribute it is (see the module's documentation):
/// saturating at `i64::MAX`, which no count here reaches.
pub fn int<T: TryInto<i64>>(n: T) -> i64 {
    n.try_into().unwrap_or(i64::MAX)
}

/// The OTLP span exporter for `settings`.
fn build_exporter(
    settings: &export::ExportSettings,
) -> Result<opentelemetry_otlp::SpanExporter, opentelemetry_otlp::ExporterBuildError> {
    use opentelemetry_otlp::{WithExportConfig as _, WithTonicConfig as _};
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(settings.endpoint.clone());
    if let Some(tls) = &settings.tls {
        builder = builder.with_tls_config(tls.clone());
    }
    builder.build()
}

/// Logs a panic as an error line, so that a JSON log stays JSON when the
/// process panics.
fn log_panics_as_json() {
    std::panic::set_hook(Box::new(|info| {
        tracing::error!(panic = %info, "panicked");
    }));
}

fn sdk_disabled() -> bool {
    std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// The resource: the SDK's detectors read `OTEL_SERVICE_NAME` and
/// `OTEL_RESOURCE_ATTRIBUTES`; the binary's name is the fallback service name.
fn resource(service: &'static str) -> Resource {
    let named_by_env = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| v.contains("service.name="));
    let builder = Resource::builder();
    if named_by_env {
        builder.build()
    } else {
        builder.with_service_name(service).build()
    }
}

/// The service's subscriber: the log layer, and the OpenTelemetry layer
/// when spans go somewhere (`provider`).
///
/// Without a provider the log layer is the only layer. An absent layer in
/// the stack (an `Option` that is `None`) left every callsite's interest
/// open, so h2's TRACE spans (several on every poll of every HTTP/2
/// connection) were built and dropped in the registry though nothing took
/// them: without them the executor hosting a provider plugin used a fifth
/// less CPU (docs/profile-notes.md).
fn dispatch(
    provider: Option<&SdkTracerProvider>,
    service: &'static str,
    log_json: bool,
) -> tracing::Dispatch {
    match provider {
        Some(provider) => tracing::Dispatch::new(
            tracing_subscriber::registry()
                .with(otel_layer(provider, service))
                .with(log_layer(log_json)),
        ),
        None => tracing::Dispatch::new(tracing_subscriber::registry().with(log_layer(log_json))),
    }
}

/// Logs at `RUST_LOG` (default `info`), text or JSON lines, to stderr; the
/// spans that hold no log line are left out.
fn log_layer<S>(json: bool) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let log_filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info"))
        .and(filter_fn(logged));
    if json {
        json::layer().with_filter(log_filter).boxed()
    } else {
        // Colours only on a terminal: a log file or a journal gets plain text.
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .with_filter(log_filter)
            .boxed()
    }
}

/// Spans of this workspace at INFO or above, and of events only warnings and
/// errors (which become span events), to `provider`'s tracer.
fn otel_layer(
    provider: &SdkTracerProvider,
    service: &'static str,
) -> impl tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync {
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(service))
        .with_tracked_inactivity(false)
        // Parents come from the tracing span tree and explicit trace
        // contexts, never from an attached OpenTelemetry context, so
        // entering a span need not attach one (which costs every poll
        // of every instrumented future).
        .with_context_activation(false)
        .with_threads(false)
        .with_location(false)
        .with_filter(filter_fn(|meta| {
            let level = if meta.is_span() {
                tracing::Level::INFO
            } else {
                tracing::Level::WARN
            };
            *meta.level() <= level && exported_target(meta.target())
        }))
}

/// Sets up logs, tracing and the metrics endpoint for this process. Must be
/// called inside a Tokio runtime (the exporter's channel and the metrics
/// server live on it). A second call in the same process (tests that start
/// several services) keeps the first subscriber.
pub fn init(config: &TelemetryConfig<'_>) -> Result<Telemetry, TelemetryError> {
    // Registered first, so the exporter's counters are served from the start
    // whether or not anything is exported.
    let export_metrics = export::ExportMetrics::register();
    // Set when spans go somewhere; `unusable` when exporting was asked for
    // but its settings cannot be used (told once the log is set up).
    let mut exporting_to: Option<(String, bool)> = None;
    let mut unusable: Option<String> = None;
    let provider = if sdk_disabled() {
        None
    } else {
        let mut builder = SdkTracerProvider::builder().with_resource(resource(config.service));
        let env = |name: &str| std::env::var(name).ok();
        let settings = if exporter_none() {
            Ok(None)
        } else {
            export::settings(&env)
        };
        match settings.map(|s| s.map(|s| (build_exporter(&s), s))) {
            Ok(None) => {}
            Ok(Some((Ok(exporter), settings))) => {
                let health = export::Health::new(settings.endpoint.clone(), export_metrics.clone());
                let exporter = export::Reporting::new(exporter, health.clone());
                builder = builder.with_span_processor(export::Admission::new(
                    exporter,
                    health,
                    export::queue_size(&env),
                ));
                exporting_to = Some((settings.endpoint, settings.tls.is_some()));
            }
            Ok(Some((Err(e), _))) => unusable = Some(e.to_string()),
            Err(e) => unusable = Some(e.to_string()),
        }
        if unusable.is_some() {
            builder = builder.with_span_processor(export::Unavailable(export_metrics));
        }
        // With nowhere to send spans (no endpoint, or
        // `OTEL_TRACES_EXPORTER=none`) there is no OpenTelemetry layer at
        // all: building spans nobody receives cost a quarter of the driver's
        // and the executor's CPU at 100,000 nodes (docs/observability.md).
        (exporting_to.is_some() || unusable.is_some()).then(|| builder.build())
    };

    let dispatch = dispatch(provider.as_ref(), config.service, config.log_json);
    json::remember_dispatch(&dispatch);
    // A second initialisation (tests that start several services in one
    // process) keeps the first subscriber.
    let installed = tracing::dispatcher::set_global_default(dispatch).is_ok();
    if installed && config.log_json {
        log_panics_as_json();
    }

    let (metrics_addr, metrics_task) = match config.metrics_listen {
        Some(addr) => {
            let (bound, task) = serve_metrics(config.service, addr, config.ready_file)?;
            (Some(bound), Some(task))
        }
        None => (None, None),
    };
    if let Some(error) = &unusable {
        tracing::error!(
            service = config.service,
            %error,
            "spans are not exported: the OTLP exporter's settings cannot be used, so the service \
             runs without them (provisioning_telemetry_spans_dropped_total with reason \
             exporter_unavailable counts the spans)",
        );
    }
    if let Some((endpoint, tls)) = &exporting_to {
        tracing::info!(service = config.service, %endpoint, tls, "exporting spans over OTLP/gRPC");
    }
    Ok(Telemetry {
        // Only the installed subscriber's provider is worth flushing; a second
        // one in the same process never receives a span.
        provider: provider.filter(|_| installed),
        exporting: exporting_to.is_some() && installed,
        metrics_addr,
        metrics_task,
    })
}

/// Binds the metrics endpoint, announces it (a log line, and
/// `<ready file>.metrics` when there is a ready file) and serves it.
fn serve_metrics(
    service: &'static str,
    addr: SocketAddr,
    ready_file: Option<&Path>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), TelemetryError> {
    let bind = || -> std::io::Result<(tokio::net::TcpListener, SocketAddr)> {
        let std_listener = std::net::TcpListener::bind(addr)?;
        std_listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(std_listener)?;
        let bound = listener.local_addr()?;
        Ok((listener, bound))
    };
    let (listener, bound) = bind().map_err(|source| TelemetryError::MetricsBind { addr, source })?;
    tracing::info!(service, metrics_addr = %bound, "serving metrics at http://{bound}/metrics");
    if let Some(ready) = ready_file {
        let path = metrics_ready_file(ready);
        crate::announce::write_ready_file(&path, bound)
            .map_err(|source| TelemetryError::MetricsReadyFile { path, source })?;
    }
    crate::metrics::process_metrics(crate::metrics::global(), service);
    let task = tokio::spawn(crate::metrics::serve(listener, crate::metrics::global()));
    Ok((bound, task))
}

/// Where the metrics address of a service with ready file `ready` is written.
pub fn metrics_ready_file(ready: &Path) -> std::path::PathBuf {
    let mut name = ready.as_os_str().to_owned();
    name.push(".metrics");
    std::path::PathBuf::from(name)
}

// ---------------------------------------------------------------------------
// Propagation
// ---------------------------------------------------------------------------

/// W3C trace context is the one format on every boundary.
fn propagator() -> TraceContextPropagator {
    TraceContextPropagator::new()
}

struct TraceContextCarrier<'a>(&'a mut TraceContext);

impl Injector for TraceContextCarrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        match key {
            "traceparent" => self.0.traceparent = value,
            "tracestate" => self.0.tracestate = value,
            _ => {}
        }
    }
}

struct TraceContextReader<'a>(&'a TraceContext);

impl Extractor for TraceContextReader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            "traceparent" if !self.0.traceparent.is_empty() => Some(&self.0.traceparent),
            "tracestate" if !self.0.tracestate.is_empty() => Some(&self.0.tracestate),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

/// The trace context of `span`, to put in a streamed message. Empty when the
/// span is not traced (no subscriber, or the span is disabled).
pub fn context_of(span: &tracing::Span) -> TraceContext {
    to_trace_context(&span.context())
}

/// The trace context of an OpenTelemetry context; empty when it holds no
/// valid span.
pub fn to_trace_context(cx: &Context) -> TraceContext {
    let mut out = TraceContext::default();
    if cx.span().span_context().is_valid() {
        propagator().inject_context(cx, &mut TraceContextCarrier(&mut out));
    }
    out
}

/// The OpenTelemetry context a message's trace context names.
pub fn extract(trace: &TraceContext) -> Context {
    propagator().extract(&TraceContextReader(trace))
}

/// The span context a message's trace context names (invalid when empty).
pub fn span_context(trace: &TraceContext) -> SpanContext {
    extract(trace).span().span_context().clone()
}

/// Makes `span` a child of the span `trace` names, if it names one. Must be
/// called before the span is entered or has children.
pub fn set_parent(span: &tracing::Span, trace: &TraceContext) {
    let cx = extract(trace);
    if cx.span().span_context().is_valid() {
        // Fails only when the span is disabled or already started, in which
        // case it stays where it is: a trace with a missing link, not an error.
        let _ = span.set_parent(cx);
    }
}

/// What caused a piece of work, kept so that the work's span can link to it
/// later: a recorded span's ids (no strings), cheap enough to keep one for
/// every node of a large run.
#[derive(Clone, Debug, PartialEq)]
pub struct Cause(SpanContext);

impl Cause {
    /// `span` as a cause, if it is recorded (a span nobody samples is no
    /// use to link to).
    pub fn of(span: &tracing::Span) -> Option<Self> {
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        (sc.is_valid() && sc.is_sampled()).then_some(Self(sc))
    }

    /// The span a message's trace context names, as a cause.
    pub fn from_trace(trace: &TraceContext) -> Option<Self> {
        let sc = span_context(trace);
        (sc.is_valid() && sc.is_sampled()).then_some(Self(sc))
    }

    /// Links `span` to this cause (an OpenTelemetry span link). Must be
    /// called before the span has ended.
    pub fn link(&self, span: &tracing::Span) {
        span.add_link(self.0.clone());
    }
}

/// Makes `span` the root of a trace that is not sampled: neither it nor
/// anything under it, here or in the services it calls, is recorded (with the
/// default parent-based sampler). For work that is recorded only if it turns
/// out to do something, such as a safety-tick pass.
pub fn set_unsampled_root(span: &tracing::Span) {
    let ids = RandomIdGenerator::default();
    let remote = SpanContext::new(
        ids.new_trace_id(),
        ids.new_span_id(),
        TraceFlags::default(),
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(Context::new().with_remote_span_context(remote));
}

/// Sets an attribute on `span`'s OpenTelemetry span that was not declared as
/// a field (for keys computed at run time, like actions per rule).
pub fn set_attribute(
    span: &tracing::Span,
    key: impl Into<opentelemetry::Key>,
    value: impl Into<opentelemetry::Value>,
) {
    span.set_attribute(key, value);
}

/// The span of one operation, with the attributes both ends give it (the
/// driver's `operation` span from dispatch to fold, the executor's `execute`
/// span around the provider call): run, node, operation id, effect, attempt,
/// and the outcome and status recorded when it ends.
///
/// `operation_span!("name", otel_name, &op)` or, with an explicit parent,
/// `operation_span!(parent: p, "name", otel_name, &op)`; `otel_name` is any
/// `Display`.
#[macro_export]
macro_rules! operation_span {
    ($(parent: $parent:expr,)? $name:literal, $otel_name:expr, $op:expr) => {{
        let op: &$crate::__macro::Operation = $op;
        $crate::__macro::tracing::info_span!(
            $(parent: $parent,)?
            $name,
            otel.name = %$otel_name,
            provisioning.run.id = %op.run_id,
            provisioning.node.id = %op.node,
            provisioning.operation.id = %op.id,
            provisioning.operation.effect = op.input.effect().name(),
            provisioning.operation.attempt = $crate::telemetry::int(op.id.attempt().get()),
            provisioning.operation.outcome = $crate::__macro::tracing::field::Empty,
            otel.status_code = $crate::__macro::tracing::field::Empty,
        )
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A callsite of the kind h2 has on every poll of a connection: a TRACE
    /// span of a dependency.
    struct H2Poll;
    static H2_POLL: H2Poll = H2Poll;
    static H2_POLL_META: tracing::Metadata<'static> = tracing::Metadata::new(
        "Connection::poll",
        "h2::proto::connection",
        tracing::Level::TRACE,
        None,
        None,
        None,
        tracing::field::FieldSet::new(&[], tracing::callsite::Identifier(&H2_POLL)),
        tracing::metadata::Kind::SPAN,
    );
    impl tracing::callsite::Callsite for H2Poll {
        fn set_interest(&self, _: tracing::subscriber::Interest) {}
        fn metadata(&self) -> &tracing::Metadata<'_> {
            &H2_POLL_META
        }
    }

    /// Without an exporter no layer wants a dependency's TRACE span, and the
    /// subscriber says so when the callsite registers, so the span is never
    /// built. With an absent OpenTelemetry layer in the stack (`None` under
    /// the log layer) the interest was "sometimes" and the subscriber
    /// enabled the span, so h2 built and dropped such spans on every poll.
    #[test]
    fn without_an_exporter_a_dependencys_trace_span_is_never_built() {
        let d = dispatch(None, "test", false);
        assert!(d.register_callsite(&H2_POLL_META).is_never());
    }

    #[test]
    fn the_log_layer_skips_only_the_spans_that_hold_no_log_line() {
        // `pass`, `grpc.server` and the like hold log lines and are logged.
        tracing::subscriber::with_default(tracing_subscriber::registry(), || {
            let meta = |s: tracing::Span| s.metadata().map(logged);
            assert_eq!(meta(tracing::info_span!("operation")), Some(false));
            assert_eq!(meta(tracing::info_span!("execute")), Some(false));
            assert_eq!(meta(tracing::info_span!("fold")), Some(false));
            assert_eq!(meta(tracing::info_span!("pass")), Some(true));
        });
    }

    #[test]
    fn exported_targets_are_the_workspace_crates_and_their_modules() {
        for yes in [
            "platform",
            "driver_svc",
            "executor_svc::server",
            "decider_svc::a::b",
        ] {
            assert!(exported_target(yes), "{yes}");
        }
        for no in [
            "",
            "h2",
            "tonic::transport",
            "driver_svcx",
            "platformx::x",
            "contract",
            "driver_sv",
            "my::driver_svc",
        ] {
            assert!(!exported_target(no), "{no}");
        }
    }

    #[test]
    fn trace_context_round_trips_through_a_message() {
        let parent = TraceContext {
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
            tracestate: "vendor=1".to_owned(),
        };
        let cx = extract(&parent);
        assert!(cx.span().span_context().is_valid());
        assert!(cx.span().span_context().is_sampled());
        assert_eq!(to_trace_context(&cx), parent);
        assert!(!span_context(&TraceContext::default()).is_valid());
        assert_eq!(to_trace_context(&Context::new()), TraceContext::default());
    }

    #[test]
    fn the_metrics_ready_file_sits_next_to_the_ready_file() {
        assert_eq!(
            metrics_ready_file(Path::new("/tmp/x/driver-svc.ready")),
            Path::new("/tmp/x/driver-svc.ready.metrics")
        );
    }
}
