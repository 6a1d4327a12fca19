//! Trace propagation and RPC telemetry for every gRPC call between the
//! services, in one place: [`ServerLayer`] for the servers and
//! [`ClientLayer`] for the clients, both tower layers.
//!
//! The server layer extracts W3C trace context from the request metadata and
//! opens a server span under it; the client layer opens a client span under
//! the caller's current span and injects its context into the metadata. Both
//! spans follow the OpenTelemetry RPC conventions: named
//! `{rpc.service}/{rpc.method}`, with `rpc.system = "grpc"`, `rpc.service`,
//! `rpc.method` and, once the call ends, `rpc.grpc.status_code`; a client
//! span also names where the call goes, `server.address` and `server.port`
//! (the host and port of the channel's target, [`Target`]: the request a
//! channel is handed carries only the path). A call ends
//! when its response body ends, not when the response head leaves, so a
//! streaming call's span covers the whole stream; the status comes from the
//! trailers (or from the head of a trailers-only response).
//!
//! Both layers also count calls in the go-grpc-prometheus conventions
//! (`grpc_server_started_total`, `grpc_server_handled_total`,
//! `grpc_server_handling_seconds`, and `grpc_client_*` alike).
//!
//! Health checks and reflection are counted but not traced: probes arrive
//! every few seconds forever and a trace of one tells nothing.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context as TaskContext, Poll},
    time::Instant,
};

use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use tower::{Layer, Service};
use tracing::{Instrument as _, field::Empty};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::metrics::{Counter, Histogram, LATENCY_BUCKETS, global};

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// `/pkg.Service/Method` as (`pkg.Service`, `Method`).
fn service_and_method(path: &str) -> (String, String) {
    let trimmed = path.trim_start_matches('/');
    match trimmed.split_once('/') {
        Some((service, method)) => (service.to_owned(), method.to_owned()),
        None => (trimmed.to_owned(), String::new()),
    }
}

/// The streaming methods of the services here and of the gRPC services
/// they serve beside them, with their `grpc_type` (go-grpc-prometheus's
/// label); every other method is `unary`. Checked against the proto files
/// by a test.
const STREAMING: &[(&str, &str, &str)] = &[
    ("provisioning.v1.Provisioning", "WatchRun", "server_stream"),
    ("provisioning.v1.Provisioning", "WatchEvents", "server_stream"),
    ("provisioning.internal.v1.Decider", "Decide", "bidi_stream"),
    ("provisioning.internal.v1.Executor", "Link", "bidi_stream"),
    (
        "provisioning.internal.v1.Executor",
        "InventoryPages",
        "server_stream",
    ),
    ("provisioning.provider.v1.Provider", "Watch", "server_stream"),
    (
        "provisioning.provider.v1.Provider",
        "ListResourcePages",
        "server_stream",
    ),
    ("grpc.health.v1.Health", "Watch", "server_stream"),
    (
        "grpc.reflection.v1.ServerReflection",
        "ServerReflectionInfo",
        "bidi_stream",
    ),
    (
        "grpc.reflection.v1alpha.ServerReflection",
        "ServerReflectionInfo",
        "bidi_stream",
    ),
];

/// A method's `grpc_type`: `unary`, `client_stream`, `server_stream` or
/// `bidi_stream`.
fn grpc_type(service: &str, method: &str) -> &'static str {
    STREAMING
        .iter()
        .find(|(s, m, _)| *s == service && *m == method)
        .map_or("unary", |(_, _, t)| t)
}

/// Counts the gRPC messages in a body as its data goes by: each message is
/// a 5-byte prefix (a compression flag and a big-endian length) and then
/// that many bytes, and data frames split them anywhere.
#[derive(Debug, Default)]
struct MessageCounter {
    prefix: [u8; 5],
    /// Bytes of the current prefix seen so far.
    have: usize,
    /// Bytes of the current message still to come.
    remaining: u64,
}

impl MessageCounter {
    /// Feeds `data`; returns how many messages began in it.
    fn feed(&mut self, mut data: &[u8]) -> u64 {
        let mut began = 0;
        while !data.is_empty() {
            if self.remaining > 0 {
                let skip = usize::try_from(self.remaining)
                    .unwrap_or(usize::MAX)
                    .min(data.len());
                self.remaining -= skip as u64;
                data = &data[skip..];
                continue;
            }
            let take = (5 - self.have).min(data.len());
            self.prefix[self.have..self.have + take].copy_from_slice(&data[..take]);
            self.have += take;
            data = &data[take..];
            if self.have == 5 {
                self.have = 0;
                began += 1;
                let [_, a, b, c, d] = self.prefix;
                self.remaining = u64::from(u32::from_be_bytes([a, b, c, d]));
            }
        }
        began
    }
}

fn is_probe(service: &str) -> bool {
    service.starts_with("grpc.health.") || service.starts_with("grpc.reflection.")
}

/// The name gRPC gives each status code, as go-grpc-prometheus labels it.
pub fn code_name(code: i32) -> &'static str {
    match code {
        0 => "OK",
        1 => "Canceled",
        2 => "Unknown",
        3 => "InvalidArgument",
        4 => "DeadlineExceeded",
        5 => "NotFound",
        6 => "AlreadyExists",
        7 => "PermissionDenied",
        8 => "ResourceExhausted",
        9 => "FailedPrecondition",
        10 => "Aborted",
        11 => "OutOfRange",
        12 => "Unimplemented",
        13 => "Internal",
        14 => "Unavailable",
        15 => "DataLoss",
        16 => "Unauthenticated",
        _ => "Unknown",
    }
}

/// The OpenTelemetry RPC conventions mark a server span as an error only for
/// codes that mean the server failed; a client span for any code but OK.
fn is_error(kind: Kind, code: i32) -> bool {
    match kind {
        Kind::Server => matches!(code, 2 | 4 | 12 | 13 | 14 | 15),
        Kind::Client => code != 0,
    }
}

fn grpc_status(headers: &HeaderMap) -> Option<i32> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Server,
    Client,
}

/// The call counters of one side, registered in the global registry, in
/// go-grpc-prometheus's names and labels.
#[derive(Debug, Clone)]
struct CallMetrics {
    started: Counter,
    handled: Counter,
    handling: Histogram,
    /// Messages the caller sent: received on the server, sent by the client.
    requests: Counter,
    /// Messages the callee sent: sent by the server, received by the client.
    responses: Counter,
}

impl CallMetrics {
    fn new(kind: Kind) -> Self {
        let r = global();
        let labels = &["grpc_type", "grpc_service", "grpc_method"];
        let with_code = &["grpc_type", "grpc_service", "grpc_method", "grpc_code"];
        let side = match kind {
            Kind::Server => "server",
            Kind::Client => "client",
        };
        let (requests, responses) = match kind {
            Kind::Server => (
                (
                    "grpc_server_msg_received_total",
                    "Messages received on the server.",
                ),
                ("grpc_server_msg_sent_total", "Messages sent by the server."),
            ),
            Kind::Client => (
                ("grpc_client_msg_sent_total", "Messages sent by the client."),
                (
                    "grpc_client_msg_received_total",
                    "Messages received by the client.",
                ),
            ),
        };
        Self {
            started: r.counter(
                &format!("grpc_{side}_started_total"),
                &format!("RPCs started ({side})."),
                labels,
            ),
            handled: r.counter(
                &format!("grpc_{side}_handled_total"),
                &format!("RPCs completed ({side}), by status code."),
                with_code,
            ),
            handling: r.histogram(
                &format!("grpc_{side}_handling_seconds"),
                "Time from the start of an RPC to the end of its response (a whole stream for \
                 streaming RPCs).",
                labels,
                LATENCY_BUCKETS,
            ),
            requests: r.counter(requests.0, requests.1, labels),
            responses: r.counter(responses.0, responses.1, labels),
        }
    }
}

/// One call in progress: its span and what its end must record.
struct Call {
    kind: Kind,
    span: tracing::Span,
    labels: CallLabels,
    started: Instant,
    status: Option<i32>,
    metrics: CallMetrics,
}

/// A call's `grpc_type`, `grpc_service` and `grpc_method`.
#[derive(Debug, Clone)]
struct CallLabels {
    kind: &'static str,
    service: Arc<str>,
    method: Arc<str>,
}

impl CallLabels {
    fn new(service: &str, method: &str) -> Self {
        Self {
            kind: grpc_type(service, method),
            service: Arc::from(service),
            method: Arc::from(method),
        }
    }

    fn values(&self) -> [&str; 3] {
        [self.kind, &self.service, &self.method]
    }
}

impl Call {
    fn start(kind: Kind, span: tracing::Span, labels: CallLabels, metrics: CallMetrics) -> Self {
        metrics.started.inc(&labels.values());
        Self {
            kind,
            span,
            labels,
            started: Instant::now(),
            status: None,
            metrics,
        }
    }

    /// Records the end of the call with `code` (the status it ended with,
    /// or `fallback` when none was seen) and closes the span.
    fn finish(self, fallback: i32) {
        let code = self.status.unwrap_or(fallback);
        self.span.record("rpc.grpc.status_code", code);
        if is_error(self.kind, code) {
            self.span.record("otel.status_code", "error");
        }
        let [kind, service, method] = self.labels.values();
        self.metrics
            .handled
            .inc(&[kind, service, method, code_name(code)]);
        self.metrics
            .handling
            .observe_duration(&self.labels.values(), self.started.elapsed());
    }
}

/// A response body that ends its call when it ends: it reads the status from
/// the trailers and records the call when the last frame has gone (or when
/// the body is dropped early, as `CANCELLED`).
pub struct TracedBody<B> {
    inner: B,
    call: Option<Call>,
    /// The messages of the response, counted as they go by.
    messages: Counted,
}

/// A body's message count and the counter it adds to.
#[doc(hidden)]
#[derive(Debug)]
pub struct Counted {
    counter: MessageCounter,
    into: Counter,
    labels: CallLabels,
}

impl Counted {
    fn new(into: &Counter, labels: &CallLabels) -> Self {
        Self {
            counter: MessageCounter::default(),
            into: into.clone(),
            labels: labels.clone(),
        }
    }

    /// Counts the messages that begin in `frame`'s data, if it has any.
    fn feed<D: AsRef<[u8]>>(&mut self, frame: &Frame<D>) {
        let Some(data) = frame.data_ref() else {
            return;
        };
        let n = self.counter.feed(data.as_ref());
        if n > 0 {
            self.into.add(&self.labels.values(), n);
        }
    }
}

/// A request body that can have its messages counted and stay the type its
/// service takes: tonic's services and channels take `tonic::body::Body`,
/// which the counting body is boxed back into.
pub trait CountMessages: Sized {
    #[doc(hidden)]
    fn counted(self, messages: Counted) -> Self;
}

impl CountMessages for tonic::body::Body {
    fn counted(self, messages: Counted) -> Self {
        tonic::body::Body::new(CountedBody {
            inner: self,
            messages,
        })
    }
}

/// A body with nothing in it (tests' requests) has nothing to count.
impl CountMessages for () {
    fn counted(self, _messages: Counted) -> Self {}
}

/// A request body whose messages are counted as they go by.
pub struct CountedBody<B> {
    inner: B,
    messages: Counted,
}

impl<B> std::fmt::Debug for CountedBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CountedBody").finish_non_exhaustive()
    }
}

impl<B> Body for CountedBody<B>
where
    B: Body + Unpin,
    B::Data: AsRef<[u8]>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            self.messages.feed(frame);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> std::fmt::Debug for TracedBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TracedBody").finish_non_exhaustive()
    }
}

impl<B> Drop for TracedBody<B> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            call.finish(1);
        }
    }
}

impl<B> Body for TracedBody<B>
where
    B: Body + Unpin,
    B::Data: AsRef<[u8]>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                self.messages.feed(frame);
                if let Some(status) = frame.trailers_ref().and_then(grpc_status)
                    && let Some(call) = self.call.as_mut()
                {
                    call.status = Some(status);
                }
            }
            // A body that fails mid-stream ends the call as `UNKNOWN` unless
            // trailers said otherwise; one that ends without trailers is OK
            // (a unary success sends them, so this is only a bare body).
            Poll::Ready(Some(Err(_))) => {
                if let Some(call) = self.call.take() {
                    call.finish(2);
                }
            }
            Poll::Ready(None) => {
                if let Some(call) = self.call.take() {
                    call.finish(0);
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The server side: a span per incoming call, under the caller's trace.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerLayer;

impl ServerLayer {
    pub fn new() -> Self {
        Self
    }
}

impl<S> Layer<S> for ServerLayer {
    type Service = Server<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Server {
            inner,
            metrics: CallMetrics::new(Kind::Server),
        }
    }
}

/// See [`ServerLayer`].
#[derive(Debug, Clone)]
pub struct Server<S> {
    inner: S,
    metrics: CallMetrics,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Server<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    ReqBody: CountMessages,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body + Unpin + Send + 'static,
{
    type Response = Response<TracedBody<ResBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (service, method) = service_and_method(req.uri().path());
        let span = if is_probe(&service) {
            tracing::Span::none()
        } else {
            let span = tracing::info_span!(
                "grpc.server",
                otel.name = %format_args!("{service}/{method}"),
                otel.kind = "server",
                rpc.system = "grpc",
                rpc.service = %service,
                rpc.method = %method,
                rpc.grpc.status_code = Empty,
                otel.status_code = Empty,
            );
            let parent = super::propagator().extract(&HeaderExtractor(req.headers()));
            if opentelemetry::trace::TraceContextExt::span(&parent)
                .span_context()
                .is_valid()
            {
                let _ = span.set_parent(parent);
            }
            span
        };
        let labels = CallLabels::new(&service, &method);
        let req = req.map(|b| b.counted(Counted::new(&self.metrics.requests, &labels)));
        let responses = Counted::new(&self.metrics.responses, &labels);
        let call = Call::start(Kind::Server, span.clone(), labels, self.metrics.clone());
        // The service that was polled ready is the one called; the clone
        // takes its place for the next call (tower's usual swap).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let future = span.in_scope(|| inner.call(req));
        Box::pin(
            async move {
                let mut call = call;
                match future.await {
                    Ok(response) => {
                        call.status = grpc_status(response.headers());
                        Ok(response.map(|inner| TracedBody {
                            inner,
                            call: Some(call),
                            messages: responses,
                        }))
                    }
                    Err(e) => {
                        // The service failed without a response; the
                        // transport answers that as INTERNAL.
                        call.finish(13);
                        Err(e)
                    }
                }
            }
            .instrument(span),
        )
    }
}

/// Where a client's calls go: the `server.address` and `server.port` of its
/// spans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    address: Arc<str>,
    port: Option<u16>,
}

impl Target {
    /// The host and port of `uri`, the port being the scheme's (443 for
    /// `https`, 80 for `http`) when the URI names none. An IPv6 address is
    /// given without its brackets, as the conventions write it.
    pub fn of(uri: &Uri) -> Self {
        let host = uri.host().unwrap_or_default();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let port = uri.port_u16().or_else(|| match uri.scheme_str() {
            Some(s) if s.eq_ignore_ascii_case("https") => Some(443),
            Some(s) if s.eq_ignore_ascii_case("http") => Some(80),
            _ => None,
        });
        Self {
            address: Arc::from(host),
            port,
        }
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn port(&self) -> Option<u16> {
        self.port
    }
}

/// The client side: a span per outgoing call to `target`, under the caller's
/// current span, whose context travels in the request metadata.
#[derive(Debug, Clone)]
pub struct ClientLayer {
    target: Target,
}

impl ClientLayer {
    pub fn new(target: Target) -> Self {
        Self { target }
    }
}

impl<S> Layer<S> for ClientLayer {
    type Service = Client<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Client {
            inner,
            target: self.target.clone(),
            metrics: CallMetrics::new(Kind::Client),
        }
    }
}

/// See [`ClientLayer`].
#[derive(Debug, Clone)]
pub struct Client<S> {
    inner: S,
    target: Target,
    metrics: CallMetrics,
}

/// A tonic channel with the client layer: what the services call each other
/// through.
pub type TracedChannel = Client<tonic::transport::Channel>;

/// Wraps `channel`, whose calls go to `target`, in the client layer.
pub fn traced(channel: tonic::transport::Channel, target: Target) -> TracedChannel {
    ClientLayer::new(target).layer(channel)
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Client<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    ReqBody: CountMessages,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body + Unpin + Send + 'static,
{
    type Response = Response<TracedBody<ResBody>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let (service, method) = service_and_method(req.uri().path());
        let span = tracing::info_span!(
            "grpc.client",
            otel.name = %format_args!("{service}/{method}"),
            otel.kind = "client",
            rpc.system = "grpc",
            rpc.service = %service,
            rpc.method = %method,
            server.address = &*self.target.address,
            server.port = self.target.port.map(i64::from),
            rpc.grpc.status_code = Empty,
            otel.status_code = Empty,
        );
        let cx = span.context();
        super::propagator().inject_context(&cx, &mut HeaderInjector(req.headers_mut()));
        let labels = CallLabels::new(&service, &method);
        let req = req.map(|b| b.counted(Counted::new(&self.metrics.requests, &labels)));
        let responses = Counted::new(&self.metrics.responses, &labels);
        let call = Call::start(Kind::Client, span.clone(), labels, self.metrics.clone());
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let future = span.in_scope(|| inner.call(req));
        Box::pin(
            async move {
                let mut call = call;
                match future.await {
                    Ok(response) => {
                        call.status = grpc_status(response.headers());
                        Ok(response.map(|inner| TracedBody {
                            inner,
                            call: Some(call),
                            messages: responses,
                        }))
                    }
                    Err(e) => {
                        // The transport failed before a response: gRPC
                        // clients report that as UNAVAILABLE.
                        call.finish(14);
                        Err(e)
                    }
                }
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_split_into_service_and_method() {
        assert_eq!(
            service_and_method("/provisioning.internal.v1.Decider/Decide"),
            ("provisioning.internal.v1.Decider".to_owned(), "Decide".to_owned())
        );
        assert!(is_probe("grpc.health.v1.Health"));
        assert!(!is_probe("provisioning.internal.v1.Executor"));
    }

    /// Messages are counted however the data frames split them.
    #[test]
    fn messages_are_counted_across_any_split() {
        let mut wire = Vec::new();
        for len in [0u32, 3, 70_000, 1] {
            wire.push(0);
            wire.extend_from_slice(&len.to_be_bytes());
            wire.extend(std::iter::repeat_n(7u8, len as usize));
        }
        for chunk in [1, 2, 4, 5, 6, 1000, wire.len()] {
            let mut counter = MessageCounter::default();
            let counted: u64 = wire.chunks(chunk).map(|c| counter.feed(c)).sum();
            assert_eq!(counted, 4, "in chunks of {chunk}");
            assert_eq!((counter.have, counter.remaining), (0, 0));
        }
    }

    /// Every streaming method in the proto files has its `grpc_type` in
    /// [`STREAMING`], and every entry there for these packages is one.
    #[test]
    fn the_streaming_table_matches_the_protos() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
        let mut found = Vec::new();
        let mut dirs = vec![root];
        while let Some(dir) = dirs.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                let path = e.path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|x| x == "proto") {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    let package = text
                        .lines()
                        .find_map(|l| l.trim().strip_prefix("package "))
                        .map(|p| p.trim_end_matches(';').to_owned())
                        .unwrap_or_default();
                    let mut service = String::new();
                    for line in text.lines().map(str::trim) {
                        if let Some(rest) = line.strip_prefix("service ") {
                            service = rest.split_whitespace().next().unwrap_or_default().to_owned();
                        }
                        let Some(rest) = line.strip_prefix("rpc ") else {
                            continue;
                        };
                        let Some((method, sig)) = rest.split_once('(') else {
                            continue;
                        };
                        let (request, response) = sig.split_once("returns").unwrap_or((sig, ""));
                        let kind = match (request.contains("stream "), response.contains("stream ")) {
                            (false, false) => "unary",
                            (true, false) => "client_stream",
                            (false, true) => "server_stream",
                            (true, true) => "bidi_stream",
                        };
                        let full = format!("{package}.{service}");
                        assert_eq!(grpc_type(&full, method.trim()), kind, "{full}/{method}");
                        if kind != "unary" {
                            found.push((full, method.trim().to_owned()));
                        }
                    }
                }
            }
        }
        let ours: Vec<(String, String)> = STREAMING
            .iter()
            .filter(|(s, _, _)| s.starts_with("provisioning."))
            .map(|(s, m, _)| ((*s).to_owned(), (*m).to_owned()))
            .collect();
        for entry in &ours {
            assert!(
                found.contains(entry),
                "{entry:?} is not a streaming method of the protos"
            );
        }
        assert_eq!(found.len(), ours.len(), "{found:?}");
    }

    #[test]
    fn error_classes_follow_the_rpc_conventions() {
        assert!(!is_error(Kind::Server, 3));
        assert!(is_error(Kind::Client, 3));
        assert!(is_error(Kind::Server, 14));
        assert!(!is_error(Kind::Server, 0));
        assert_eq!(code_name(14), "Unavailable");
    }

    #[test]
    fn a_target_is_the_host_and_port_of_its_uri() {
        let target = |uri: &str| {
            let t = Target::of(&uri.parse().unwrap_or_else(|e| panic!("{uri}: {e}")));
            (t.address().to_owned(), t.port())
        };
        assert_eq!(
            target("http://127.0.0.1:7001"),
            ("127.0.0.1".to_owned(), Some(7001))
        );
        assert_eq!(
            target("https://decider.svc"),
            ("decider.svc".to_owned(), Some(443))
        );
        assert_eq!(target("http://decider"), ("decider".to_owned(), Some(80)));
        assert_eq!(target("https://[::1]:9"), ("::1".to_owned(), Some(9)));
    }

    /// The client span names the channel's target, the port as an integer,
    /// although the request the channel is handed carries only a path.
    #[test]
    fn client_spans_name_the_server_address_and_port() {
        use std::sync::Mutex;
        use tracing_subscriber::layer::SubscriberExt as _;

        #[derive(Clone, Default)]
        struct Fields(Arc<Mutex<Vec<(String, String)>>>);
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if let Ok(mut f) = self.0.lock() {
                    f.push((field.name().to_owned(), format!("str:{value:?}")));
                }
            }
            fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
                if let Ok(mut f) = self.0.lock() {
                    f.push((field.name().to_owned(), format!("i64:{value}")));
                }
            }
        }
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Fields {
            fn on_new_span(
                &self,
                attrs: &tracing::span::Attributes<'_>,
                _id: &tracing::span::Id,
                _ctx: tracing_subscriber::layer::Context<'_, S>,
            ) {
                attrs.record(&mut self.clone());
            }
        }

        let fields = Fields::default();
        let subscriber = tracing_subscriber::registry().with(fields.clone());
        let target = Target::of(&"https://10.1.2.3:7443".parse().unwrap_or_else(|e| panic!("{e}")));
        let service = tower::service_fn(|_req: Request<()>| async {
            Ok::<_, std::convert::Infallible>(Response::new(NoBody))
        });
        let mut client = ClientLayer::new(target).layer(service);
        let request = Request::builder()
            .uri("/provisioning.internal.v1.Decider/Decide")
            .body(())
            .unwrap_or_else(|e| panic!("{e}"));
        tracing::subscriber::with_default(subscriber, || {
            drop(client.call(request));
        });
        let recorded = fields.0.lock().map(|f| f.clone()).unwrap_or_default();
        assert!(
            recorded.contains(&("server.address".to_owned(), "str:\"10.1.2.3\"".to_owned())),
            "{recorded:?}"
        );
        assert!(
            recorded.contains(&("server.port".to_owned(), "i64:7443".to_owned())),
            "{recorded:?}"
        );
    }

    /// A response body with nothing in it.
    struct NoBody;

    impl Body for NoBody {
        type Data = bytes::Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut TaskContext<'_>,
        ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
            Poll::Ready(None)
        }
    }
}
