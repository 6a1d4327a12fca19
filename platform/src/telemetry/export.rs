//! Where spans go and whether they get there: the OTLP/gRPC exporter's
//! settings (endpoint, TLS) and its own health (log lines and counters).
//!
//! **Settings.** The endpoint is `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else
//! `OTEL_EXPORTER_OTLP_ENDPOINT`. `http://` is plaintext and `https://` is TLS;
//! an endpoint without a scheme (`collector:4317`) is TLS unless
//! `OTEL_EXPORTER_OTLP_INSECURE` (or `..._TRACES_INSECURE`) is `true`, which is
//! the OTLP exporter specification's default. TLS is tonic's rustls with the
//! ring provider. The server is checked against the CA in
//! `OTEL_EXPORTER_OTLP_CERTIFICATE` when it is set, else against the system's
//! CA store; `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE` and `_CLIENT_KEY` (both
//! or neither) present a client certificate. Each `OTEL_EXPORTER_OTLP_*`
//! variable has its `OTEL_EXPORTER_OTLP_TRACES_*` form, which wins.
//!
//! A setting that cannot be used (an unknown scheme, a file that cannot be read
//! or holds no PEM) is not a reason to refuse to serve: [`settings`] says what
//! is wrong, the caller logs it once and the process runs without exporting,
//! counting the spans it would have sent as dropped (`exporter_unavailable`).
//!
//! **Health.** [`Reporting`] wraps the exporter and [`Admission`] the batch
//! processor. Every span handed to the exporter is counted exported or
//! dropped (`export_failed`: refused, unreachable or timed out), and a span
//! that finds the queue full is counted dropped (`queue_full`), so
//! `provisioning_telemetry_spans_exported_total` and
//! `provisioning_telemetry_spans_dropped_total{reason}` account for every
//! sampled span. The first failed export logs one warning, a failure that
//! lasts logs a reminder at most every [`REMIND_EVERY`], and the first export
//! that succeeds after failures logs one line saying so, with what was lost.

use std::{
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use opentelemetry::Context;
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    trace::{BatchConfigBuilder, BatchSpanProcessor, Span, SpanData, SpanExporter, SpanProcessor},
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use crate::metrics::{Counter, global};

/// How often a failure that goes on is logged again.
pub const REMIND_EVERY: Duration = Duration::from_secs(300);

/// The reasons a span is counted dropped, all exported from the start.
pub const DROP_REASONS: [&str; 3] = [EXPORT_FAILED, QUEUE_FULL, EXPORTER_UNAVAILABLE];
const EXPORT_FAILED: &str = "export_failed";
const QUEUE_FULL: &str = "queue_full";
const EXPORTER_UNAVAILABLE: &str = "exporter_unavailable";

/// The exporter's counters, registered (at zero) when telemetry starts.
#[derive(Debug, Clone)]
pub(super) struct ExportMetrics {
    exported: Counter,
    dropped: Counter,
}

impl ExportMetrics {
    pub(super) fn register() -> Self {
        let r = global();
        let exported = r.counter(
            "provisioning_telemetry_spans_exported_total",
            "Spans the OTLP receiver accepted.",
            &[],
        );
        let dropped = r.counter(
            "provisioning_telemetry_spans_dropped_total",
            "Sampled spans that were not exported, by reason: export_failed (the receiver refused, \
             could not be reached or did not answer in time), queue_full (the export queue was \
             full), exporter_unavailable (the exporter's settings could not be used).",
            &["reason"],
        );
        for reason in DROP_REASONS {
            dropped.init(&[reason]);
        }
        Self { exported, dropped }
    }
}

// ---------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------

/// Why the exporter's settings cannot be used. Each message names the
/// variable.
#[derive(Debug, thiserror::Error)]
pub enum ExportSettingsError {
    #[error("{var}={value:?}: the OTLP/gRPC exporter speaks http:// or https://, not {scheme}://")]
    Scheme {
        var: &'static str,
        value: String,
        scheme: String,
    },
    #[error("{var}: reading {}: {source}", path.display())]
    Read {
        var: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{var}: {} holds no {what} in PEM form", path.display())]
    Pem {
        var: String,
        path: PathBuf,
        what: &'static str,
    },
    #[error("{given} is set but {missing} is not: a client certificate needs both")]
    HalfIdentity { given: String, missing: String },
}

/// Where and how spans are sent.
#[derive(Debug, Clone)]
pub struct ExportSettings {
    /// `http://…` or `https://…`, the scheme always explicit.
    pub endpoint: String,
    /// With an `https://` endpoint.
    pub tls: Option<ClientTlsConfig>,
}

/// Reads the environment through `env` (the process's, or a test's).
type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The value of `OTEL_EXPORTER_OTLP_TRACES_<suffix>`, else of
/// `OTEL_EXPORTER_OTLP_<suffix>`, with the name it came from; empty values
/// count as unset.
fn otlp_var(env: Env<'_>, suffix: &str) -> Option<(String, String)> {
    [
        format!("OTEL_EXPORTER_OTLP_TRACES_{suffix}"),
        format!("OTEL_EXPORTER_OTLP_{suffix}"),
    ]
    .into_iter()
    .find_map(|name| {
        env(&name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .map(|v| (name, v))
    })
}

/// The exporter's settings from the environment; `None` when no endpoint is
/// set.
pub fn settings(env: Env<'_>) -> Result<Option<ExportSettings>, ExportSettingsError> {
    let Some((var, value)) = otlp_var(env, "ENDPOINT") else {
        return Ok(None);
    };
    let var: &'static str = if var.contains("_TRACES_") {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    } else {
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    };
    let insecure = otlp_var(env, "INSECURE").is_some_and(|(_, v)| v.eq_ignore_ascii_case("true"));
    let endpoint = match value.split_once("://") {
        Some((scheme, _)) if scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https") => {
            value.clone()
        }
        Some((scheme, _)) => {
            return Err(ExportSettingsError::Scheme {
                var,
                scheme: scheme.to_owned(),
                value: value.clone(),
            });
        }
        None if insecure => format!("http://{value}"),
        None => format!("https://{value}"),
    };
    let tls = endpoint
        .get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
        .then(|| tls_config(env))
        .transpose()?;
    Ok(Some(ExportSettings { endpoint, tls }))
}

/// Reads `(var, path)`'s file.
fn read(var: &str, path: &str) -> Result<Vec<u8>, ExportSettingsError> {
    std::fs::read(path).map_err(|source| ExportSettingsError::Read {
        var: var.to_owned(),
        path: PathBuf::from(path),
        source,
    })
}

/// Certificates in PEM form, checked to be there (rustls would otherwise
/// report an empty file only at the first handshake, as an unknown issuer).
fn certificates(var: &str, path: &str) -> Result<Vec<u8>, ExportSettingsError> {
    let pem = read(var, path)?;
    if CertificateDer::pem_slice_iter(&pem)
        .filter_map(Result::ok)
        .count()
        == 0
    {
        return Err(ExportSettingsError::Pem {
            var: var.to_owned(),
            path: PathBuf::from(path),
            what: "certificate",
        });
    }
    Ok(pem)
}

fn tls_config(env: Env<'_>) -> Result<ClientTlsConfig, ExportSettingsError> {
    let mut config = ClientTlsConfig::new();
    config = match otlp_var(env, "CERTIFICATE") {
        Some((var, path)) => config.ca_certificate(Certificate::from_pem(certificates(&var, &path)?)),
        None => config.with_native_roots(),
    };
    match (otlp_var(env, "CLIENT_CERTIFICATE"), otlp_var(env, "CLIENT_KEY")) {
        (Some((cert_var, cert)), Some((key_var, key))) => {
            let cert = certificates(&cert_var, &cert)?;
            let key_pem = read(&key_var, &key)?;
            if PrivateKeyDer::from_pem_slice(&key_pem).is_err() {
                return Err(ExportSettingsError::Pem {
                    var: key_var,
                    path: PathBuf::from(key),
                    what: "private key",
                });
            }
            config = config.identity(Identity::from_pem(cert, key_pem));
        }
        (Some((given, _)), None) => {
            return Err(ExportSettingsError::HalfIdentity {
                given,
                missing: "OTEL_EXPORTER_OTLP_CLIENT_KEY".to_owned(),
            });
        }
        (None, Some((given, _))) => {
            return Err(ExportSettingsError::HalfIdentity {
                given,
                missing: "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE".to_owned(),
            });
        }
        (None, None) => {}
    }
    Ok(config)
}

/// The batch queue's size: `OTEL_BSP_MAX_QUEUE_SIZE` as the SDK reads it,
/// else its default.
pub(super) fn queue_size(env: Env<'_>) -> usize {
    env("OTEL_BSP_MAX_QUEUE_SIZE")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(opentelemetry_sdk::trace::OTEL_BSP_MAX_QUEUE_SIZE_DEFAULT)
        .max(1)
}

// ---------------------------------------------------------------------------
// Health
// ---------------------------------------------------------------------------

/// What the log lines need to know between exports.
#[derive(Debug)]
enum State {
    Healthy,
    Failing {
        since: Instant,
        dropped: u64,
        reported: Instant,
    },
}

/// The exporter's health, shared by the processor (queue admission) and the
/// exporter (outcomes).
#[derive(Debug)]
pub(super) struct Health {
    endpoint: String,
    metrics: ExportMetrics,
    /// Spans admitted to the batch queue and not yet handed to the exporter.
    queued: AtomicUsize,
    state: Mutex<State>,
}

impl Health {
    pub(super) fn new(endpoint: String, metrics: ExportMetrics) -> Arc<Self> {
        Arc::new(Self {
            endpoint,
            metrics,
            queued: AtomicUsize::new(0),
            state: Mutex::new(State::Healthy),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes a place in a queue of `capacity`; `false` when it is full.
    fn admit(&self, capacity: usize) -> bool {
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < capacity).then_some(q + 1)
            })
            .is_ok()
    }

    /// `n` spans left the queue for the exporter.
    fn taken(&self, n: usize) {
        let _ = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| Some(q.saturating_sub(n)));
    }

    fn exported(&self, n: u64) {
        self.metrics.exported.add(&[], n);
        let mut state = self.state();
        if let State::Failing { since, dropped, .. } = *state {
            *state = State::Healthy;
            drop(state);
            tracing::info!(
                endpoint = %self.endpoint,
                dropped,
                failed_for_ms = u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX),
                "exporting spans over OTLP works again",
            );
        }
    }

    fn failed(&self, n: u64, error: &dyn std::fmt::Display) {
        self.metrics.dropped.add(&[EXPORT_FAILED], n);
        let now = Instant::now();
        let mut state = self.state();
        match &mut *state {
            State::Healthy => {
                *state = State::Failing {
                    since: now,
                    dropped: n,
                    reported: now,
                };
                drop(state);
                tracing::warn!(
                    endpoint = %self.endpoint,
                    dropped = n,
                    %error,
                    "exporting spans over OTLP failed; spans are dropped until the receiver takes them \
                     again (provisioning_telemetry_spans_dropped_total counts them)",
                );
            }
            State::Failing {
                since,
                dropped,
                reported,
            } => {
                *dropped = dropped.saturating_add(n);
                if now.duration_since(*reported) >= REMIND_EVERY {
                    *reported = now;
                    let (dropped, failing_for) = (*dropped, now.duration_since(*since));
                    drop(state);
                    tracing::warn!(
                        endpoint = %self.endpoint,
                        dropped,
                        failing_for_s = failing_for.as_secs(),
                        %error,
                        "exporting spans over OTLP is still failing",
                    );
                }
            }
        }
    }

    fn queue_full(&self) {
        self.metrics.dropped.inc(&[QUEUE_FULL]);
    }
}

/// The exporter, reporting what became of each batch.
#[derive(Debug)]
pub(super) struct Reporting<E> {
    inner: E,
    health: Arc<Health>,
}

impl<E> Reporting<E> {
    pub(super) fn new(inner: E, health: Arc<Health>) -> Self {
        Self { inner, health }
    }
}

impl<E: SpanExporter> SpanExporter for Reporting<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let n = batch.len();
        self.health.taken(n);
        let export = self.inner.export(batch);
        async move {
            let result = export.await;
            let count = u64::try_from(n).unwrap_or(u64::MAX);
            match &result {
                Ok(()) => self.health.exported(count),
                Err(e) => self.health.failed(count, e),
            }
            result
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The batch processor behind a queue bound of its own size, kept here: a
/// span that would not fit is counted (`queue_full`) instead of vanishing
/// inside the SDK. The SDK's queue never holds more than this count (a span
/// leaves this count only when the exporter receives it, after it left the
/// SDK's queue), so the SDK itself never drops one.
#[derive(Debug)]
pub(super) struct Admission {
    inner: BatchSpanProcessor,
    health: Arc<Health>,
    capacity: usize,
}

impl Admission {
    pub(super) fn new<E>(exporter: Reporting<E>, health: Arc<Health>, capacity: usize) -> Self
    where
        E: SpanExporter + Send + Sync + 'static,
    {
        let config = BatchConfigBuilder::default()
            .with_max_queue_size(capacity)
            .build();
        Self {
            inner: BatchSpanProcessor::builder(exporter)
                .with_batch_config(config)
                .build(),
            health,
            capacity,
        }
    }
}

impl SpanProcessor for Admission {
    fn on_start(&self, span: &mut Span, cx: &Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.health.admit(self.capacity) {
            self.inner.on_end(span);
        } else {
            self.health.queue_full();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Where spans end when exporting was asked for but its settings could not
/// be used: each is counted dropped (`exporter_unavailable`).
#[derive(Debug)]
pub(super) struct Unavailable(pub(super) ExportMetrics);

impl SpanProcessor for Unavailable {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, _span: SpanData) {
        self.0.dropped.inc(&[EXPORTER_UNAVAILABLE]);
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    fn endpoint(vars: &[(&str, &str)]) -> Result<Option<(String, bool)>, ExportSettingsError> {
        settings(&env_of(vars)).map(|s| s.map(|s| (s.endpoint, s.tls.is_some())))
    }

    #[test]
    fn the_endpoint_keeps_its_scheme_and_a_bare_one_is_tls_unless_insecure() {
        assert!(endpoint(&[]).unwrap_or_else(|e| panic!("{e}")).is_none());
        assert!(
            endpoint(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])
                .unwrap_or_else(|e| panic!("{e}"))
                .is_none()
        );
        let cases = [
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")],
                "http://c:4317",
                false,
            ),
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "HTTPS://c:4317")],
                "HTTPS://c:4317",
                true,
            ),
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "c:4317")],
                "https://c:4317",
                true,
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "c:4317"),
                    ("OTEL_EXPORTER_OTLP_INSECURE", "TRUE"),
                ],
                "http://c:4317",
                false,
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://general:1"),
                    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "traces:2"),
                    ("OTEL_EXPORTER_OTLP_INSECURE", "true"),
                    ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "false"),
                ],
                "https://traces:2",
                true,
            ),
        ];
        for (vars, want, tls) in cases {
            assert_eq!(
                endpoint(&vars).unwrap_or_else(|e| panic!("{e}")),
                Some((want.to_owned(), tls)),
                "{vars:?}"
            );
        }
    }

    #[test]
    fn unusable_settings_name_their_variable() {
        let dir = std::env::temp_dir().join(format!("otlp-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate").unwrap_or_else(|e| panic!("{e}"));
        let empty = empty.display().to_string();
        let missing = dir.join("missing.pem").display().to_string();
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "unix:///tmp/otlp.sock")],
                "OTEL_EXPORTER_OTLP_ENDPOINT=\"unix:///tmp/otlp.sock\"",
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4317"),
                    ("OTEL_EXPORTER_OTLP_CERTIFICATE", &missing),
                ],
                "OTEL_EXPORTER_OTLP_CERTIFICATE: reading",
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "c:4317"),
                    ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", &empty),
                ],
                "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE: ",
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4317"),
                    ("OTEL_EXPORTER_OTLP_CLIENT_KEY", &empty),
                ],
                "OTEL_EXPORTER_OTLP_CLIENT_KEY is set but OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE is not",
            ),
        ];
        for (vars, want) in cases {
            let e = match settings(&env_of(&vars)) {
                Err(e) => e.to_string(),
                Ok(s) => panic!("{vars:?} was accepted: {s:?}"),
            };
            assert!(e.starts_with(want), "{vars:?}: {e}");
        }
        // Plaintext reads no TLS files at all.
        assert!(
            endpoint(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_EXPORTER_OTLP_CERTIFICATE", &missing),
            ])
            .is_ok()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_queue_admits_up_to_its_capacity_and_frees_places_when_spans_leave() {
        let health = Health::new("http://x".to_owned(), ExportMetrics::register());
        assert!(health.admit(2));
        assert!(health.admit(2));
        assert!(!health.admit(2));
        health.taken(1);
        assert!(health.admit(2));
        health.taken(5);
        assert_eq!(health.queued.load(Ordering::Acquire), 0);
    }

    #[test]
    fn the_queue_size_is_the_sdks() {
        assert_eq!(queue_size(&env_of(&[])), 2048);
        assert_eq!(queue_size(&env_of(&[("OTEL_BSP_MAX_QUEUE_SIZE", "16")])), 16);
        assert_eq!(queue_size(&env_of(&[("OTEL_BSP_MAX_QUEUE_SIZE", "x")])), 2048);
    }
}
