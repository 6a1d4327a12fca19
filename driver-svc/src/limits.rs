//! The public API's limits, in one tower layer ([`LimitsLayer`]) around the
//! `Provisioning` service, inside the authentication layer (so it knows the
//! caller). Health checks and reflection are not limited.
//!
//! In the order a call meets them:
//!
//! 1. **Per-client rate limit**: `--rate-limit` calls per
//!    `--rate-limit-window-ms` per client, a client being a token (its name)
//!    or, without authentication, a peer IP address. One keyed GCRA limiter
//!    (`governor`) holds every client's budget: a burst of up to
//!    `--rate-limit` calls, refilled evenly over the window; a call over it is
//!    refused at once, with the exact time until the next call would pass as
//!    its retry hint.
//! 2. **Watch streams per client** (`--max-watches-per-client`) and in all
//!    (`--max-watches`): a `WatchRun` or `WatchEvents` takes a slot for as long as its
//!    response stream lives, and gives it back when the stream ends or the
//!    client goes away.
//! 3. **Concurrency limit with load shedding**: at most
//!    `--max-concurrent-requests` calls in flight (a watch counts until its
//!    stream starts); one more is shed at once (`tower::load_shed` over
//!    `tower::limit::ConcurrencyLimit`), never queued.
//! 4. **Request deadline**: a call that has not answered within
//!    `--request-timeout-ms` is ended (`tower::timeout`).
//!
//! Refusals are `RESOURCE_EXHAUSTED` (the deadline: `DEADLINE_EXCEEDED`)
//! with a message naming the limit and its flag; a shed call and one over its
//! rate carry a retry hint, `grpc-retry-pushback-ms`, in their metadata.
//! None reaches a handler, so none changes anything. A request larger than
//! `--max-recv-message-bytes`, which tonic answers `OUT_OF_RANGE`, is
//! answered `RESOURCE_EXHAUSTED` as gRPC specifies.

use std::{
    collections::HashMap,
    convert::Infallible,
    fmt,
    net::IpAddr,
    num::NonZeroU32,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll},
    time::Duration,
};

use futures::future::{BoxFuture, FutureExt as _};
use governor::{
    DefaultKeyedRateLimiter, Quota,
    clock::{Clock as _, Reference as _},
};
use http_body::Frame;
use platform::{
    metrics::{Counter, Gauge, global},
    runtime::MessageLimits,
};
use tonic::{Code, Status, body::Body, metadata::MetadataValue, server::NamedService};
use tower::{
    Layer, Service, ServiceBuilder, ServiceExt as _,
    limit::{ConcurrencyLimit, ConcurrencyLimitLayer},
    load_shed::{LoadShed, LoadShedLayer, error::Overloaded},
    timeout::{Timeout, TimeoutLayer, error::Elapsed},
};

use crate::auth::{Principal, refusals};

/// The metadata key of gRPC's retry hint (milliseconds).
pub const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";

/// The public API's streaming calls: each holds a watch slot.
const WATCH_PATHS: [&str; 2] = [
    "/provisioning.v1.Provisioning/WatchRun",
    "/provisioning.v1.Provisioning/WatchEvents",
];

/// Clients whose rate is tracked before idle ones are forgotten, and the
/// most tracked at all (beyond it, new clients are shed until some go idle).
const CLIENTS_SOFT_CAP: usize = 1024;
const CLIENTS_HARD_CAP: usize = 65_536;

pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 30_000;
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: u32 = 64;
pub const DEFAULT_OVERLOAD_RETRY_MS: u64 = 250;
pub const DEFAULT_RATE_LIMIT: u64 = 100;
pub const DEFAULT_RATE_LIMIT_WINDOW_MS: u64 = 1_000;
pub const DEFAULT_MAX_WATCHES_PER_CLIENT: u32 = 16;
pub const DEFAULT_MAX_WATCHES: u32 = 1_024;

/// The public API's limits as flags (each with an environment variable).
#[derive(Debug, Clone, clap::Args)]
pub struct LimitArgs {
    /// A public API call not answered within this long is ended with
    /// DEADLINE_EXCEEDED (a watch: until its stream starts).
    #[arg(long, env = "DRIVER_REQUEST_TIMEOUT_MS", default_value_t = DEFAULT_REQUEST_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub request_timeout_ms: u64,
    /// Public API calls in flight at once; one more is refused at once with
    /// RESOURCE_EXHAUSTED and a retry hint (load shedding), never queued.
    #[arg(long, env = "DRIVER_MAX_CONCURRENT_REQUESTS", default_value_t = DEFAULT_MAX_CONCURRENT_REQUESTS,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_requests: u32,
    /// The retry hint (grpc-retry-pushback-ms) a shed call carries.
    #[arg(long, env = "DRIVER_OVERLOAD_RETRY_MS", default_value_t = DEFAULT_OVERLOAD_RETRY_MS)]
    pub overload_retry_ms: u64,
    /// Calls one client (a token, or a peer address without authentication)
    /// may make per --rate-limit-window-ms; more are refused with
    /// RESOURCE_EXHAUSTED. 0 = no limit.
    #[arg(long, env = "DRIVER_RATE_LIMIT", default_value_t = DEFAULT_RATE_LIMIT)]
    pub rate_limit: u64,
    /// The window of --rate-limit.
    #[arg(long, env = "DRIVER_RATE_LIMIT_WINDOW_MS", default_value_t = DEFAULT_RATE_LIMIT_WINDOW_MS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub rate_limit_window_ms: u64,
    /// Watch streams one client may have open; one more is refused with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "DRIVER_MAX_WATCHES_PER_CLIENT", default_value_t = DEFAULT_MAX_WATCHES_PER_CLIENT,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_watches_per_client: u32,
    /// Watch streams open at once, all clients together.
    #[arg(long, env = "DRIVER_MAX_WATCHES", default_value_t = DEFAULT_MAX_WATCHES,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_watches: u32,
}

impl LimitArgs {
    /// The limits, with the message sizes every service takes
    /// (`platform::runtime::MessageLimits`).
    pub fn limits(&self, messages: MessageLimits) -> ApiLimits {
        ApiLimits {
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            max_concurrent_requests: self.max_concurrent_requests.max(1) as usize,
            overload_retry: Duration::from_millis(self.overload_retry_ms),
            rate_limit: (self.rate_limit > 0).then_some(self.rate_limit),
            rate_limit_window: Duration::from_millis(self.rate_limit_window_ms.max(1)),
            max_watches_per_client: self.max_watches_per_client.max(1) as usize,
            max_watches: self.max_watches.max(1) as usize,
            max_recv_message_bytes: messages.recv_bytes(),
            max_send_message_bytes: messages.send_bytes(),
        }
    }
}

/// The public API's limits (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiLimits {
    pub request_timeout: Duration,
    pub max_concurrent_requests: usize,
    pub overload_retry: Duration,
    /// Calls per client per window; `None`: no rate limit.
    pub rate_limit: Option<u64>,
    pub rate_limit_window: Duration,
    pub max_watches_per_client: usize,
    pub max_watches: usize,
    /// The largest request and response messages (`--max-recv-message-bytes`,
    /// `--max-send-message-bytes`, flags every service takes).
    pub max_recv_message_bytes: usize,
    pub max_send_message_bytes: usize,
}

impl Default for ApiLimits {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_millis(DEFAULT_REQUEST_TIMEOUT_MS),
            max_concurrent_requests: DEFAULT_MAX_CONCURRENT_REQUESTS as usize,
            overload_retry: Duration::from_millis(DEFAULT_OVERLOAD_RETRY_MS),
            rate_limit: Some(DEFAULT_RATE_LIMIT),
            rate_limit_window: Duration::from_millis(DEFAULT_RATE_LIMIT_WINDOW_MS),
            max_watches_per_client: DEFAULT_MAX_WATCHES_PER_CLIENT as usize,
            max_watches: DEFAULT_MAX_WATCHES as usize,
            max_recv_message_bytes: MessageLimits::default().recv_bytes(),
            max_send_message_bytes: MessageLimits::default().send_bytes(),
        }
    }
}

impl ApiLimits {
    /// The layer that applies these limits to the service it wraps.
    pub fn layer(&self) -> LimitsLayer {
        LimitsLayer {
            shared: Arc::new(Shared {
                limits: self.clone(),
                rates: self
                    .rate_limit
                    .map(|per_window| Rates::new(per_window, self.rate_limit_window)),
                watches: Mutex::new(Watches::default()),
                refused: refusals(),
                open_watches: global().gauge(
                    "provisioning_api_watches",
                    "WatchRun streams open on the public API.",
                    &[],
                ),
            }),
        }
    }
}

/// Whose budget a call spends: a token's, or a peer address's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum ClientKey {
    Token(Arc<str>),
    Peer(IpAddr),
    /// No token and no peer address (not over TCP): one shared budget.
    Unknown,
}

impl fmt::Display for ClientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientKey::Token(name) => write!(f, "token {name:?}"),
            ClientKey::Peer(ip) => write!(f, "client {ip}"),
            ClientKey::Unknown => f.write_str("this client"),
        }
    }
}

fn client_key(req: &http::Request<Body>) -> ClientKey {
    if let Some(name) = req.extensions().get::<Principal>().and_then(Principal::name) {
        return ClientKey::Token(Arc::from(name));
    }
    // tonic's own reading of the peer address (plain TCP or TLS).
    let mut probe = http::Request::new(());
    *probe.extensions_mut() = req.extensions().clone();
    match tonic::Request::from_http(probe).remote_addr() {
        Some(addr) => ClientKey::Peer(addr.ip()),
        None => ClientKey::Unknown,
    }
}

/// Every client's rate budget: one keyed GCRA limiter.
struct Rates {
    limiter: DefaultKeyedRateLimiter<ClientKey>,
    per_window: u64,
    window: Duration,
    /// When clients with a full budget were last forgotten.
    last_sweep: Mutex<governor::clock::QuantaInstant>,
}

impl fmt::Debug for Rates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rates")
            .field("per_window", &self.per_window)
            .field("window", &self.window)
            .field("clients", &self.limiter.len())
            .finish_non_exhaustive()
    }
}

impl Rates {
    fn new(per_window: u64, window: Duration) -> Self {
        let burst = NonZeroU32::new(u32::try_from(per_window).unwrap_or(u32::MAX)).unwrap_or(NonZeroU32::MIN);
        // One call's worth of budget comes back every window / per_window
        // (at least a nanosecond, which `with_period` needs).
        let period = (window / burst.get()).max(Duration::from_nanos(1));
        let quota = Quota::with_period(period)
            .unwrap_or_else(|| Quota::per_second(burst))
            .allow_burst(burst);
        let limiter = DefaultKeyedRateLimiter::keyed(quota);
        let now = limiter.clock().now();
        Self {
            limiter,
            per_window,
            window,
            last_sweep: Mutex::new(now),
        }
    }

    /// Forgets clients whose budget is full again (they are the same as new
    /// ones), at most once a window, once there are many.
    fn sweep(&self) {
        if self.limiter.len() < CLIENTS_SOFT_CAP {
            return;
        }
        let now = self.limiter.clock().now();
        let mut last = lock(&self.last_sweep);
        if now.duration_since(*last) >= self.window.into() {
            *last = now;
            self.limiter.retain_recent();
            self.limiter.shrink_to_fit();
        }
    }
}

#[derive(Debug, Default)]
struct Watches {
    per_client: HashMap<ClientKey, usize>,
    total: usize,
}

#[derive(Debug)]
struct Shared {
    limits: ApiLimits,
    rates: Option<Rates>,
    watches: Mutex<Watches>,
    refused: Counter,
    open_watches: Gauge,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A refusal and the reason it is counted under.
struct Refusal {
    reason: &'static str,
    status: Status,
}

fn exhausted(reason: &'static str, message: String, retry: Option<Duration>) -> Refusal {
    let mut status = Status::resource_exhausted(message);
    if let Some(retry) = retry
        && let Ok(v) = MetadataValue::try_from(retry.as_millis().to_string())
    {
        status.metadata_mut().insert(RETRY_PUSHBACK, v);
    }
    Refusal { reason, status }
}

impl Shared {
    /// Spends one call of `key`'s rate budget, or refuses.
    fn admit(&self, key: &ClientKey) -> Result<(), Refusal> {
        let Some(rates) = &self.rates else {
            return Ok(());
        };
        rates.sweep();
        let tracked = rates.limiter.len();
        if tracked >= CLIENTS_HARD_CAP {
            return Err(exhausted(
                "overloaded",
                format!(
                    "the driver is tracking {tracked} clients, its limit; retry in {} ms",
                    rates.window.as_millis()
                ),
                Some(rates.window),
            ));
        }
        match rates.limiter.check_key(key) {
            Ok(()) => Ok(()),
            Err(not_until) => {
                let wait = not_until.wait_time_from(rates.limiter.clock().now());
                // Whole milliseconds, rounded up: a client that waits the hint
                // is admitted.
                let wait_ms = wait.as_nanos().div_ceil(1_000_000).max(1);
                let wait = Duration::from_millis(u64::try_from(wait_ms).unwrap_or(u64::MAX));
                Err(exhausted(
                    "rate_limited",
                    format!(
                        "{key} is over its rate limit of {} calls per {} ms (--rate-limit); retry in \
                         {wait_ms} ms",
                        rates.per_window,
                        rates.window.as_millis(),
                    ),
                    Some(wait),
                ))
            }
        }
    }

    /// A watch slot for `key`, or a refusal.
    fn open_watch(self: &Arc<Self>, key: &ClientKey) -> Result<WatchSlot, Refusal> {
        let mut w = lock(&self.watches);
        let mine = w.per_client.get(key).copied().unwrap_or(0);
        if mine >= self.limits.max_watches_per_client {
            return Err(exhausted(
                "watch_limit",
                format!(
                    "{key} has {mine} watch streams open, its limit (--max-watches-per-client); close one \
                     before opening another"
                ),
                None,
            ));
        }
        if w.total >= self.limits.max_watches {
            return Err(exhausted(
                "watch_limit",
                format!(
                    "the driver has {} watch streams open, its limit (--max-watches); retry in {} ms",
                    w.total,
                    self.limits.overload_retry.as_millis()
                ),
                Some(self.limits.overload_retry),
            ));
        }
        *w.per_client.entry(key.clone()).or_insert(0) += 1;
        w.total += 1;
        self.open_watches.set(&[], w.total as f64);
        Ok(WatchSlot {
            shared: Arc::clone(self),
            key: key.clone(),
        })
    }

    fn refuse(&self, r: Refusal) -> http::Response<Body> {
        self.refused.inc(&[r.reason]);
        r.status.into_http()
    }
}

/// One open watch stream's place in the counts; given back on drop.
#[derive(Debug)]
struct WatchSlot {
    shared: Arc<Shared>,
    key: ClientKey,
}

impl Drop for WatchSlot {
    fn drop(&mut self) {
        let mut w = lock(&self.shared.watches);
        if let Some(n) = w.per_client.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                w.per_client.remove(&self.key);
            }
        }
        w.total = w.total.saturating_sub(1);
        self.shared.open_watches.set(&[], w.total as f64);
    }
}

/// A watch's response body, holding its slot until the stream is dropped
/// (it ended, or the client went away).
struct WatchBody {
    inner: Body,
    _slot: WatchSlot,
}

impl http_body::Body for WatchBody {
    type Data = <Body as http_body::Body>::Data;
    type Error = <Body as http_body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Applies [`ApiLimits`]; see the module documentation.
#[derive(Debug, Clone)]
pub struct LimitsLayer {
    shared: Arc<Shared>,
}

impl<S> Layer<S> for LimitsLayer {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let limits = &self.shared.limits;
        Limited {
            shared: Arc::clone(&self.shared),
            // Built once: clones share the concurrency limit's semaphore.
            inner: ServiceBuilder::new()
                .layer(LoadShedLayer::new())
                .layer(ConcurrencyLimitLayer::new(limits.max_concurrent_requests))
                .layer(TimeoutLayer::new(limits.request_timeout))
                .service(inner),
        }
    }
}

/// See [`LimitsLayer`].
#[derive(Debug, Clone)]
pub struct Limited<S> {
    shared: Arc<Shared>,
    inner: LoadShed<ConcurrencyLimit<Timeout<S>>>,
}

impl<S: NamedService> NamedService for Limited<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Limited<S>
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

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Every limit is checked per call, in `call`: never a wait here.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let shared = Arc::clone(&self.shared);
        let key = client_key(&req);
        if let Err(r) = shared.admit(&key) {
            return futures::future::ready(Ok(shared.refuse(r))).boxed();
        }
        let slot = if WATCH_PATHS.contains(&req.uri().path()) {
            match shared.open_watch(&key) {
                Ok(slot) => Some(slot),
                Err(r) => return futures::future::ready(Ok(shared.refuse(r))).boxed(),
            }
        } else {
            None
        };
        let inner = self.inner.clone();
        async move {
            match inner.oneshot(req).await {
                Ok(response) => Ok(finish(&shared, response, slot)),
                Err(e) => {
                    let limits = &shared.limits;
                    let refusal = if e.is::<Overloaded>() {
                        exhausted(
                            "overloaded",
                            format!(
                                "the driver is at its limit of {} calls in flight (--max-concurrent-requests); \
                                 retry in {} ms",
                                limits.max_concurrent_requests,
                                limits.overload_retry.as_millis()
                            ),
                            Some(limits.overload_retry),
                        )
                    } else if e.is::<Elapsed>() {
                        Refusal {
                            reason: "deadline",
                            status: Status::deadline_exceeded(format!(
                                "the call did not finish within the server's limit of {} ms \
                                 (--request-timeout-ms); it may still take effect: read the run before \
                                 retrying",
                                limits.request_timeout.as_millis()
                            )),
                        }
                    } else {
                        Refusal {
                            reason: "internal",
                            status: Status::internal(format!("the call failed: {e}")),
                        }
                    };
                    Ok(shared.refuse(refusal))
                }
            }
        }
        .boxed()
    }
}

/// The handler's response, with a watch's slot attached to its body and a
/// request tonic found too large re-answered as gRPC specifies.
fn finish(shared: &Shared, response: http::Response<Body>, slot: Option<WatchSlot>) -> http::Response<Body> {
    if response.headers().get("grpc-status").is_some_and(|v| v == "11")
        && let Some(status) = Status::from_header_map(response.headers())
        && status.code() == Code::OutOfRange
        && status.message().contains("decoded message length too large")
    {
        return shared.refuse(Refusal {
            reason: "too_large",
            status: Status::resource_exhausted(format!(
                "the request is larger than this server accepts (--max-recv-message-bytes): {}",
                status.message()
            )),
        });
    }
    match slot {
        Some(slot) => response.map(|inner| Body::new(WatchBody { inner, _slot: slot })),
        None => response,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn shared(limits: ApiLimits) -> Arc<Shared> {
        limits.layer().shared
    }

    #[tokio::test]
    async fn each_client_has_its_own_rate_budget() {
        let s = shared(ApiLimits {
            rate_limit: Some(3),
            rate_limit_window: Duration::from_secs(60),
            ..ApiLimits::default()
        });
        let a = ClientKey::Token(Arc::from("a"));
        let b = ClientKey::Peer("127.0.0.1".parse().unwrap());
        for _ in 0..3 {
            assert!(s.admit(&a).is_ok());
        }
        let r = s.admit(&a).err().unwrap();
        assert_eq!(r.status.code(), Code::ResourceExhausted);
        // Three calls a minute: one comes back every 20 s, and the hint says
        // how long until then.
        let hint: u64 = r
            .status
            .metadata()
            .get(RETRY_PUSHBACK)
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((19_000..=20_000).contains(&hint), "{hint}");
        assert!(
            r.status.message().contains(&format!("retry in {hint} ms")),
            "{}",
            r.status.message()
        );
        assert!(r.status.message().contains("token \"a\"") && r.status.message().contains("--rate-limit"));
        assert!(s.admit(&b).is_ok(), "another client's budget is its own");
    }

    #[tokio::test]
    async fn a_rate_budget_comes_back_after_its_window() {
        let s = shared(ApiLimits {
            rate_limit: Some(1),
            rate_limit_window: Duration::from_millis(30),
            ..ApiLimits::default()
        });
        let a = ClientKey::Unknown;
        assert!(s.admit(&a).is_ok());
        assert!(s.admit(&a).is_err());
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(s.admit(&a).is_ok());
    }

    /// A stand-in for the API: answers OK once `gate` opens.
    fn gated(
        gate: Arc<tokio::sync::Notify>,
    ) -> impl Service<
        http::Request<Body>,
        Response = http::Response<Body>,
        Error = Infallible,
        Future = impl Future<Output = Result<http::Response<Body>, Infallible>> + Send,
    > + Clone
    + Send
    + 'static {
        tower::service_fn(move |_req: http::Request<Body>| {
            let gate = Arc::clone(&gate);
            async move {
                gate.notified().await;
                Ok::<_, Infallible>(Status::ok("").into_http())
            }
        })
    }

    fn status_of(r: &http::Response<Body>) -> Status {
        Status::from_header_map(r.headers()).unwrap()
    }

    #[tokio::test]
    async fn a_call_over_the_concurrency_limit_is_shed_at_once_with_a_retry_hint() {
        let gate = Arc::new(tokio::sync::Notify::new());
        let limits = ApiLimits {
            max_concurrent_requests: 1,
            overload_retry: Duration::from_millis(150),
            ..ApiLimits::default()
        };
        let svc = limits.layer().layer(gated(Arc::clone(&gate)));
        let first = tokio::spawn(svc.clone().oneshot(http::Request::new(Body::empty())));
        tokio::task::yield_now().await;
        // The first call holds the only slot until the gate opens: the
        // second is answered without waiting for it.
        let second = svc
            .clone()
            .oneshot(http::Request::new(Body::empty()))
            .await
            .unwrap();
        let status = status_of(&second);
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(
            status.message().contains("--max-concurrent-requests"),
            "{}",
            status.message()
        );
        assert_eq!(second.headers().get(RETRY_PUSHBACK).unwrap(), "150");
        gate.notify_one();
        assert_eq!(status_of(&first.await.unwrap().unwrap()).code(), Code::Ok);
        // The slot is free again.
        gate.notify_one();
        let third = svc.oneshot(http::Request::new(Body::empty())).await.unwrap();
        assert_eq!(status_of(&third).code(), Code::Ok);
    }

    #[tokio::test]
    async fn a_call_past_the_request_timeout_is_ended_with_deadline_exceeded() {
        let gate = Arc::new(tokio::sync::Notify::new());
        let limits = ApiLimits {
            request_timeout: Duration::from_millis(20),
            ..ApiLimits::default()
        };
        let svc = limits.layer().layer(gated(gate));
        let r = svc.oneshot(http::Request::new(Body::empty())).await.unwrap();
        let status = status_of(&r);
        assert_eq!(status.code(), Code::DeadlineExceeded);
        assert!(
            status.message().contains("--request-timeout-ms"),
            "{}",
            status.message()
        );
    }

    #[test]
    fn watch_slots_are_counted_per_client_and_given_back() {
        let s = shared(ApiLimits {
            max_watches_per_client: 2,
            max_watches: 3,
            ..ApiLimits::default()
        });
        let a = ClientKey::Token(Arc::from("a"));
        let b = ClientKey::Token(Arc::from("b"));
        let a1 = s.open_watch(&a).ok().unwrap();
        let _a2 = s.open_watch(&a).ok().unwrap();
        let r = s.open_watch(&a).err().unwrap();
        assert_eq!(r.status.code(), Code::ResourceExhausted);
        assert!(r.status.message().contains("--max-watches-per-client"));
        let _b1 = s.open_watch(&b).ok().unwrap();
        let r = s.open_watch(&b).err().unwrap();
        assert!(
            r.status.message().contains("--max-watches)"),
            "{}",
            r.status.message()
        );
        drop(a1);
        let _a3 = s.open_watch(&a).ok().unwrap();
        assert_eq!(lock(&s.watches).total, 3);
        assert_eq!(lock(&s.watches).per_client[&a], 2);
    }
}
