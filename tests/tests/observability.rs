//! Observability of the three real binaries: one trace across the services
//! over OTLP (received by an in-process OTLP/gRPC server), the Prometheus
//! endpoints, JSON logs that carry trace ids, and the deploy/ configurations
//! that match the demo's ports.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use contract::pb::{self, provisioning_client::ProvisioningClient};
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::{AnyValue, KeyValue, any_value::Value},
};
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, Service, TestPki, eventually, watch_until},
    shapes::shape,
};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status, transport::Channel};

const CONVERGE: Duration = Duration::from_secs(60);
const SERVICES: [&str; 3] = ["decider-svc", "driver-svc", "executor-svc"];
/// What each service is called in the traces (set with OTEL_SERVICE_NAME).
const TRACE_NAMES: [(&str, &str); 3] = [
    ("decider-svc", "provisioning-decider"),
    ("driver-svc", "provisioning-driver"),
    ("executor-svc", "provisioning-executor"),
];
const OUTCOME_CLASSES: [&str; 5] = [
    "succeeded",
    "not-ready",
    "failed-retryable",
    "failed-permanent",
    "ambiguous",
];

// ---------------------------------------------------------------------------
// An in-process OTLP trace receiver
// ---------------------------------------------------------------------------

/// One received span, flattened.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    resource: BTreeMap<String, String>,
    trace_id: String,
    span_id: String,
    /// Empty for a root span.
    parent: String,
    name: String,
    kind: i32,
    start_ns: u64,
    attrs: BTreeMap<String, String>,
    /// Each attribute's value type: `int`, `string`, `bool`, `double`.
    types: BTreeMap<String, &'static str>,
    /// The attributes of the span's events: key, value type, value.
    event_attrs: Vec<(String, &'static str, String)>,
    links: Vec<(String, String)>,
    /// The whole span as received (events and their attributes included).
    raw: String,
}

impl Received {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs.get(key).map(String::as_str)
    }
}

const KIND_SERVER: i32 = 2;
const KIND_CLIENT: i32 = 3;

fn text(v: &AnyValue) -> String {
    match &v.value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn type_of(v: Option<&AnyValue>) -> &'static str {
    match v.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(_)) => "string",
        Some(Value::IntValue(_)) => "int",
        Some(Value::BoolValue(_)) => "bool",
        Some(Value::DoubleValue(_)) => "double",
        Some(_) => "other",
        None => "none",
    }
}

fn types(kvs: &[KeyValue]) -> BTreeMap<String, &'static str> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), type_of(kv.value.as_ref())))
        .collect()
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), kv.value.as_ref().map(text).unwrap_or_default()))
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(Debug, Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Received>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let mut out = self.spans.lock().unwrap();
        for rs in request.into_inner().resource_spans {
            let resource = rs.resource.map(|r| attributes(&r.attributes)).unwrap_or_default();
            let service = resource.get("service.name").cloned().unwrap_or_default();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    let raw = format!("{s:?}");
                    out.push(Received {
                        raw,
                        service: service.clone(),
                        resource: resource.clone(),
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent: hex(&s.parent_span_id),
                        name: s.name,
                        kind: s.kind,
                        start_ns: s.start_time_unix_nano,
                        attrs: attributes(&s.attributes),
                        types: types(&s.attributes),
                        event_attrs: s
                            .events
                            .iter()
                            .flat_map(|e| &e.attributes)
                            .map(|kv| {
                                (
                                    kv.key.clone(),
                                    type_of(kv.value.as_ref()),
                                    kv.value.as_ref().map(text).unwrap_or_default(),
                                )
                            })
                            .collect(),
                        links: s
                            .links
                            .iter()
                            .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                            .collect(),
                    });
                }
            }
        }
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

async fn start_receiver() -> (Receiver, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let receiver = Receiver::default();
    let server = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(receiver.clone()))
        .serve_with_incoming(TcpListenerStream::new(listener));
    tokio::spawn(server);
    (receiver, addr)
}

/// A receiver serving on `listener` until [`Serving::stop`].
struct Serving {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Serving {
    fn start(receiver: &Receiver, listener: tokio::net::TcpListener) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver.clone()))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            });
        let task = tokio::spawn(async move {
            let _ = server.await;
        });
        Self { stop, task }
    }

    /// Stops serving and waits until the listener and its connections are
    /// closed, so the next export finds the port refused.
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the receiver stops")
            .unwrap();
    }
}

/// The receiver's spans of `service` for run `run`.
fn spans_of_run(receiver: &Receiver, service: &str, run: &str) -> usize {
    receiver
        .spans
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.service == service && s.attr("provisioning.run.id") == Some(run))
        .count()
}

/// A one-node run, applied and converged.
async fn converge_one(cluster: &Cluster, run: &str) {
    let mut c = cluster.client().await.unwrap();
    let s = shape(run, 1, "fake", &[("solo", 1, "img:1")]);
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await
    .unwrap();
    if let Err(e) = watch_until(&mut c, run, CONVERGE, |s| s.converged && s.generation == 1).await {
        cluster.dump_logs();
        panic!("{e}");
    }
}

fn now_ns() -> u64 {
    u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()).unwrap()
}

/// The options of a traced cluster: every service exports to `otlp`, under
/// its own service name, with a short safety tick so idle ticks happen.
/// The batch span processor's export cadence and the exporter's timeout in
/// traced clusters (`OTEL_BSP_SCHEDULE_DELAY`, `OTEL_EXPORTER_OTLP_TIMEOUT`):
/// an export to a receiver that is gone retries for at most this long, and
/// is then counted failed.
const EXPORT_DELAY_MS: u64 = 100;
const EXPORT_TIMEOUT_MS: u64 = 500;

fn traced(otlp: SocketAddr) -> ClusterOptions {
    let mut opts = ClusterOptions::default()
        .driver("--safety-tick-ms", "250")
        .env("OTEL_BSP_SCHEDULE_DELAY", &EXPORT_DELAY_MS.to_string())
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", &EXPORT_TIMEOUT_MS.to_string())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("http://{otlp}"))
        .env("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        .env("OTEL_TRACES_SAMPLER", "parentbased_always_on");
    for (service, name) in TRACE_NAMES {
        opts = opts.service_env(service, "OTEL_SERVICE_NAME", name);
    }
    opts
}

/// Applies a 6-node shape and waits for convergence.
async fn converge(cluster: &Cluster, run: &str) -> (ProvisioningClient<Channel>, u32) {
    let mut c = cluster.client().await.unwrap();
    let s = shape(run, 1, "fake", &[("ctrl", 2, "img:1"), ("workers", 4, "img:1")]);
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await
    .unwrap();
    if let Err(e) = watch_until(&mut c, run, CONVERGE, |s| s.converged && s.generation == 1).await {
        cluster.dump_logs();
        panic!("{e}");
    }
    (c, 6)
}

/// SIGTERM to every service, the driver first (it closes its streams), so
/// each flushes its spans on the way out.
async fn stop(cluster: &mut Cluster) {
    for s in [&mut cluster.driver, &mut cluster.executor, &mut cluster.decider] {
        let status = match s.terminate().await {
            Ok(status) => status,
            Err(e) => {
                let log = std::fs::read_to_string(s.log_file()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                panic!(
                    "{} did not stop: {e}; last log lines (newest first):\n{}",
                    s.name,
                    tail.join("\n")
                );
            }
        };
        assert!(status.success(), "{} exited with {status}", s.name);
    }
}

// ---------------------------------------------------------------------------
// Traces
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_follows_each_operation_across_the_three_services() {
    let (receiver, otlp) = start_receiver().await;
    let mut cluster = Cluster::start(traced(otlp)).await.unwrap();
    let started = std::time::Instant::now();
    let (client, nodes) = converge(&cluster, "obs").await;
    let converge_time = started.elapsed();
    let converged_ns = now_ns();
    // Several safety ticks (250 ms) pass over the converged run.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let idle_end_ns = now_ns();
    drop(client);
    let (decider_port, executor_port) = (cluster.decider.addr.port(), cluster.executor.addr.port());
    stop(&mut cluster).await;

    let spans = receiver.spans.lock().unwrap().clone();
    let by_id: BTreeMap<&str, &Received> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let name_of = |service: &str| TRACE_NAMES.iter().find(|(s, _)| *s == service).unwrap().1;
    let (driver, decider, executor) = (
        name_of("driver-svc"),
        name_of("decider-svc"),
        name_of("executor-svc"),
    );

    // Every service exported, under the name and resource the environment gave it.
    let services: BTreeSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(services, BTreeSet::from([driver, decider, executor]), "services");
    assert!(
        spans
            .iter()
            .all(|s| s.resource.get("deployment.environment").map(String::as_str) == Some("test")),
        "OTEL_RESOURCE_ATTRIBUTES reaches every span's resource"
    );

    // Parent-child links are intact: every parent was received, and edges
    // cross every process boundary.
    let mut crossings: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for s in &spans {
        if s.parent.is_empty() {
            continue;
        }
        let parent = by_id
            .get(s.parent.as_str())
            .unwrap_or_else(|| panic!("the parent of {} ({}) was never received", s.name, s.service));
        assert_eq!(parent.trace_id, s.trace_id, "{} left its parent's trace", s.name);
        if parent.service != s.service {
            *crossings
                .entry((parent.service.as_str(), s.service.as_str()))
                .or_default() += 1;
        }
    }
    for edge in [(driver, decider), (driver, executor), (executor, driver)] {
        assert!(
            crossings.get(&edge).copied().unwrap_or(0) > 0,
            "no parent-child edge {edge:?}; edges: {crossings:?}"
        );
    }

    // The Decide call on both sides, named and attributed per the RPC
    // conventions; the server span is the child of the client span.
    let decide_server: Vec<&Received> = spans
        .iter()
        .filter(|s| s.service == decider && s.name == "provisioning.internal.v1.Decider/Decide")
        .collect();
    assert!(!decide_server.is_empty(), "no Decide server span");
    for s in &decide_server {
        assert_eq!(s.kind, KIND_SERVER);
        assert_eq!(s.attr("rpc.system"), Some("grpc"));
        assert_eq!(s.attr("rpc.service"), Some("provisioning.internal.v1.Decider"));
        assert_eq!(s.attr("rpc.method"), Some("Decide"));
        assert_eq!(s.attr("rpc.grpc.status_code"), Some("0"));
        assert_eq!(s.attr("provisioning.run.id"), Some("obs"));
        let client = by_id[s.parent.as_str()];
        assert_eq!((client.service.as_str(), client.kind), (driver, KIND_CLIENT));
        assert_eq!(client.name, "provisioning.internal.v1.Decider/Decide");
        assert_eq!(client.attr("rpc.grpc.status_code"), Some("0"));
        assert_eq!(
            by_id[client.parent.as_str()].name,
            "pass",
            "a Decide call belongs to a pass"
        );
    }

    // Passes: attributed, and the first is the child of the Apply request.
    let passes: Vec<&Received> = spans
        .iter()
        .filter(|s| s.service == driver && s.name == "pass")
        .collect();
    let rule_total = |rule: u32| -> u64 {
        passes
            .iter()
            .filter_map(|p| p.attr(&format!("provisioning.pass.rule_{rule}")))
            .map(|v| v.parse::<u64>().unwrap())
            .sum()
    };
    assert_eq!(rule_total(0), 6, "inserts by rule 0 across passes");
    assert_eq!(rule_total(12), 6, "create-lease by rule 12 across passes");
    for p in &passes {
        assert_eq!(p.attr("provisioning.run.id"), Some("obs"));
        assert_eq!(p.attr("provisioning.run.generation"), Some("1"));
        assert!(p.attr("provisioning.pass.nodes").is_some());
        assert!(p.attr("provisioning.pass.result").is_some());
    }
    let apply = spans
        .iter()
        .find(|s| s.service == driver && s.name == "provisioning.v1.Provisioning/Apply")
        .expect("the Apply request's span");
    assert_eq!(apply.kind, KIND_SERVER);
    assert!(
        passes.iter().any(|p| p.parent == apply.span_id),
        "the first pass is the child of the Apply request"
    );
    assert!(
        passes.iter().any(|p| !p.links.is_empty()),
        "passes caused by folds link to them"
    );

    // Every dispatched operation has a span with its outcome class, and the
    // executor ran each under it.
    let operations: Vec<&Received> = spans
        .iter()
        .filter(|s| s.service == driver && s.name.starts_with("operation "))
        .collect();
    assert!(
        operations.len() >= 2 * nodes as usize,
        "{} operation spans",
        operations.len()
    );
    for op in &operations {
        let outcome = op
            .attr("provisioning.operation.outcome")
            .unwrap_or_else(|| panic!("{} has no outcome", op.name));
        assert!(OUTCOME_CLASSES.contains(&outcome), "{outcome}");
        for key in [
            "provisioning.operation.id",
            "provisioning.operation.effect",
            "provisioning.operation.attempt",
        ] {
            assert!(op.attr(key).is_some(), "{} lacks {key}", op.name);
        }
    }
    let executions: Vec<&Received> = spans
        .iter()
        .filter(|s| s.service == executor && s.name.starts_with("execute "))
        .collect();
    assert_eq!(
        executions.len(),
        operations.len(),
        "one backend call per operation"
    );
    for ex in &executions {
        let op = by_id[ex.parent.as_str()];
        assert!(op.name.starts_with("operation "), "{} under {}", ex.name, op.name);
        assert_eq!(
            ex.attr("provisioning.operation.id"),
            op.attr("provisioning.operation.id")
        );
        assert_eq!(
            ex.attr("provisioning.operation.outcome"),
            op.attr("provisioning.operation.outcome")
        );
    }

    // For every node: one trace holds its create-lease from the driver
    // through the executor and back to the fold, and links to the pass that
    // decided it, whose trace holds the Decide call.
    for node in [
        "ctrl-0",
        "ctrl-1",
        "workers-0",
        "workers-1",
        "workers-2",
        "workers-3",
    ] {
        let op = operations
            .iter()
            .find(|s| s.name == "operation create-lease" && s.attr("provisioning.node.id") == Some(node))
            .unwrap_or_else(|| panic!("no create-lease span for {node}"));
        let in_trace: Vec<&Received> = spans.iter().filter(|s| s.trace_id == op.trace_id).collect();
        let services: BTreeSet<&str> = in_trace.iter().map(|s| s.service.as_str()).collect();
        assert_eq!(
            services,
            BTreeSet::from([driver, executor]),
            "{node}'s create-lease trace"
        );
        assert!(op.parent.is_empty(), "{node}'s create-lease is a root");
        let execute = in_trace
            .iter()
            .find(|s| s.parent == op.span_id && s.service == executor)
            .unwrap_or_else(|| panic!("no executor span under {node}'s create-lease"));
        assert!(
            in_trace
                .iter()
                .any(|s| s.parent == execute.span_id && s.service == driver && s.name == "fold result"),
            "{node}'s result is folded under the executor's span"
        );
        let pass = op
            .links
            .iter()
            .find_map(|(_, id)| by_id.get(id.as_str()).filter(|s| s.name == "pass"))
            .unwrap_or_else(|| panic!("{node}'s create-lease links to no pass"));
        assert!(
            spans
                .iter()
                .any(|s| s.trace_id == pass.trace_id && s.service == decider),
            "the trace of {node}'s pass holds the Decide call"
        );
    }

    // Bounded: spans per node over the convergence, and none while idle.
    let margin = 300_000_000;
    let during: Vec<&Received> = spans
        .iter()
        .filter(|s| s.start_ns <= converged_ns + margin)
        .collect();
    let idle: Vec<&Received> = spans
        .iter()
        .filter(|s| s.start_ns > converged_ns + margin && s.start_ns < idle_end_ns)
        .collect();
    let mut by_name: BTreeMap<(String, String), usize> = BTreeMap::new();
    for s in &during {
        *by_name.entry((s.service.clone(), s.name.clone())).or_default() += 1;
    }
    let per_node = during.len() as f64 / f64::from(nodes);
    println!(
        "trace figures: {} spans over a clean convergence of {nodes} nodes in {converge_time:?} = \
         {per_node:.1} per node; {} spans over {} idle safety ticks",
        during.len(),
        idle.len(),
        (idle_end_ns - converged_ns - margin) / 250_000_000
    );
    for ((service, name), n) in &by_name {
        println!("  {n:4}  {service}  {name}");
    }
    assert!(per_node <= 50.0, "{per_node:.1} spans per node");
    assert!(
        idle.is_empty(),
        "idle ticks made spans: {:?}",
        idle.iter().map(|s| (&s.service, &s.name)).collect::<Vec<_>>()
    );

    // Every client span says where its call went: the host and port of the
    // channel's target, the port an integer.
    let clients: Vec<&Received> = spans.iter().filter(|s| s.kind == KIND_CLIENT).collect();
    assert!(
        clients
            .iter()
            .any(|s| s.name.starts_with("provisioning.internal.v1.Executor/")),
        "no client span of a call to the executor"
    );
    for s in &clients {
        let port = if s.name.starts_with("provisioning.internal.v1.Decider/") {
            decider_port
        } else if s.name.starts_with("provisioning.internal.v1.Executor/") {
            executor_port
        } else {
            panic!("a client span of an unknown call: {}", s.name)
        };
        assert_eq!(s.attr("server.address"), Some("127.0.0.1"), "{}", s.name);
        assert_eq!(
            s.attr("server.port"),
            Some(port.to_string().as_str()),
            "{}",
            s.name
        );
        assert_eq!(s.types.get("server.port"), Some(&"int"), "{}", s.name);
    }

    // Counts are integer attributes, not strings.
    assert_counts_are_integers(&spans);
}

/// Attributes that count something (or are numbers: a port, a status code).
const INTEGER_ATTRIBUTES: &[&str] = &[
    "provisioning.run.generation",
    "provisioning.pass.nodes",
    "provisioning.pass.actions",
    "provisioning.pass.operations",
    "provisioning.pass.transitions",
    "provisioning.pass.stale",
    "provisioning.operation.attempt",
    "provisioning.bootstrap.seq",
    "provisioning.decide.nodes",
    "provisioning.decide.inserts",
    "rpc.grpc.status_code",
    "server.port",
];

/// Every attribute in [`INTEGER_ATTRIBUTES`] (and each pass's actions by
/// rule) is seen, and always as an integer; and no string attribute, of a
/// span or of its events, holds a bare number.
/// A pass caused by more folds than it may link (sixty creates completing
/// at once) links the first 16 and counts the rest in
/// `provisioning.pass.links_dropped`: no cause is dropped silently. Every
/// pass that is not speculative carries the count, an integer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_with_more_causes_than_links_counts_the_rest() {
    let (receiver, otlp) = start_receiver().await;
    let mut cluster = Cluster::start(traced(otlp).executor("--fake-latency-ms", "40,40"))
        .await
        .unwrap();
    let mut c = cluster.client().await.unwrap();
    let s = shape("links", 1, "fake", &[("workers", 60, "img:1")]);
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await
    .unwrap();
    if let Err(e) = watch_until(&mut c, "links", CONVERGE, |s| s.converged && s.generation == 1).await {
        cluster.dump_logs();
        panic!("{e}");
    }
    drop(c);
    stop(&mut cluster).await;
    let spans = receiver.spans.lock().unwrap().clone();
    let passes: Vec<&Received> = spans
        .iter()
        .filter(|s| s.name == "pass" && s.attr("provisioning.run.id") == Some("links"))
        .collect();
    assert!(!passes.is_empty());
    for p in &passes {
        assert!(p.links.len() <= 16, "{} links", p.links.len());
        let dropped = p.attr("provisioning.pass.links_dropped");
        assert_eq!(
            p.types.get("provisioning.pass.links_dropped").copied(),
            dropped.map(|_| "int"),
            "{p:?}"
        );
        if p.links.len() < 16 {
            assert!(
                dropped.is_none_or(|d| d == "0"),
                "dropped {dropped:?} with {} links",
                p.links.len()
            );
        }
    }
    let counted: u64 = passes
        .iter()
        .filter_map(|p| p.attr("provisioning.pass.links_dropped")?.parse::<u64>().ok())
        .sum();
    assert!(
        passes.iter().any(|p| p.links.len() == 16) && counted > 0,
        "no pass had more causes than links: {:?}",
        passes.iter().map(|p| p.links.len()).collect::<Vec<_>>()
    );
}

/// Waits until `run` is gone (its delete finished).
async fn until_gone(c: &ProvisioningClient<Channel>, run: &str) {
    eventually(CONVERGE, "the run is gone", || {
        let mut c = c.clone();
        async move {
            let got = c
                .get_run(pb::GetRunRequest {
                    run_id: run.into(),
                    include_nodes: false,
                })
                .await;
            matches!(got, Err(s) if s.code() == tonic::Code::NotFound).then_some(())
        }
    })
    .await
    .unwrap();
}

/// The spans whose parent was never received: (service, name).
fn orphans(spans: &[Received]) -> Vec<(&str, &str)> {
    let ids: BTreeSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    spans
        .iter()
        .filter(|s| !s.parent.is_empty() && !ids.contains(s.parent.as_str()))
        .map(|s| (s.service.as_str(), s.name.as_str()))
        .collect()
}

/// The most spans one trace may hold (ARCHITECTURE.md, "Tracing"): a
/// request and its pass with the Decide call, or one operation with its
/// call at the executor, its fold and a bootstrap's stages. Traces do not
/// grow with the run.
const TRACE_SPAN_BOUND: usize = 64;

/// The spans reachable from `from` by walking to children and to the spans
/// that link to what was reached (what it caused).
fn reachable<'a>(spans: &'a [Received], from: &'a Received) -> BTreeSet<&'a str> {
    let mut caused: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for s in spans {
        if !s.parent.is_empty() {
            caused.entry(s.parent.as_str()).or_default().push(&s.span_id);
        }
        for (_, linked) in &s.links {
            caused.entry(linked.as_str()).or_default().push(&s.span_id);
        }
    }
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let mut next = vec![from.span_id.as_str()];
    while let Some(id) = next.pop() {
        if seen.insert(id) {
            next.extend(caused.get(id).into_iter().flatten().copied());
        }
    }
    seen
}

/// A node's life, followed from outside as an on-call engineer would: a
/// 200-node run is applied, then scaled down and given a new image, then
/// deleted. From each request's span, walking to children and to the spans
/// that link back (what each caused), every node it changed is reached: to
/// the fold of its `converged` stage after each apply, and to the fold of
/// its lease's destruction after the scale-down and the delete, through
/// however many passes. Every span's parent was received, no trace holds
/// more than [`TRACE_SPAN_BOUND`] spans, and the causes passes could not
/// link are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_s_life_is_reached_from_the_request_that_changed_it() {
    let (receiver, otlp) = start_receiver().await;
    let mut cluster = Cluster::start(
        traced(otlp)
            .env("OTEL_BSP_MAX_QUEUE_SIZE", "500000")
            .executor("--fake-stage-interval-ms", "1"),
    )
    .await
    .unwrap();
    let mut c = cluster.client().await.unwrap();
    let run = "life";
    for (generation, groups) in [
        (1, [("ctrl", 20, "img:1"), ("workers", 180, "img:1")]),
        (2, [("ctrl", 20, "img:2"), ("workers", 150, "img:2")]),
    ] {
        let s = shape(run, generation, "fake", &groups);
        c.apply(pb::ApplyRequest {
            shape: Some(pb::ClusterShape::from(&s)),
        })
        .await
        .unwrap();
        if let Err(e) = watch_until(&mut c, run, CONVERGE, |s| {
            s.converged && s.generation == generation
        })
        .await
        {
            cluster.dump_logs();
            panic!("{e}");
        }
    }
    c.delete_run(pb::DeleteRunRequest { run_id: run.into() })
        .await
        .unwrap();
    until_gone(&c, run).await;
    drop(c);
    stop(&mut cluster).await;
    let spans = receiver.spans.lock().unwrap().clone();

    // Every parent was received.
    let orphans = orphans(&spans);
    assert!(orphans.is_empty(), "spans whose parent never came: {orphans:?}");
    // No trace grows with the run.
    let mut per_trace: BTreeMap<&str, usize> = BTreeMap::new();
    for s in &spans {
        *per_trace.entry(s.trace_id.as_str()).or_default() += 1;
    }
    let largest = per_trace.values().copied().max().unwrap_or(0);
    assert!(
        largest <= TRACE_SPAN_BOUND,
        "a trace of {largest} spans (bound {TRACE_SPAN_BOUND})"
    );

    let requests = |name: &str| -> Vec<&Received> {
        let mut r: Vec<&Received> = spans
            .iter()
            .filter(|s| s.name == format!("provisioning.v1.Provisioning/{name}"))
            .collect();
        r.sort_by_key(|s| s.start_ns);
        r
    };
    let applies = requests("Apply");
    let deletes = requests("DeleteRun");
    assert_eq!((applies.len(), deletes.len()), (2, 1));
    let node_of = |s: &Received| s.attr("provisioning.node.id").unwrap_or_default().to_owned();
    let converged_after = |at: u64| -> Vec<&Received> {
        spans
            .iter()
            .filter(|s| {
                s.name == "fold observation"
                    && s.attr("provisioning.bootstrap.stage") == Some("converged")
                    && s.start_ns > at
            })
            .collect()
    };
    let destroyed_after = |at: u64| -> Vec<&Received> {
        spans
            .iter()
            .filter(|s| {
                s.name == "fold result"
                    && s.attr("provisioning.operation.effect") == Some("destroy-lease")
                    && s.attr("provisioning.operation.outcome") == Some("succeeded")
                    && s.start_ns > at
            })
            .collect()
    };
    // Which nodes `ends` of them `request` reaches.
    let reached = |request: &Received, ends: &[&Received]| -> BTreeSet<String> {
        let from = reachable(&spans, request);
        ends.iter()
            .filter(|s| from.contains(s.span_id.as_str()))
            .map(|s| node_of(s))
            .collect()
    };
    let names =
        |group: &str, n: usize| -> BTreeSet<String> { (0..n).map(|i| format!("{group}-{i}")).collect() };
    let all = |groups: &[(&str, usize)]| -> BTreeSet<String> {
        groups.iter().flat_map(|(g, n)| names(g, *n)).collect()
    };

    let gen1 = all(&[("ctrl", 20), ("workers", 180)]);
    let ready1 = reached(applies[0], &converged_after(applies[0].start_ns));
    assert_eq!(
        gen1.difference(&ready1).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "nodes whose readiness the first Apply does not reach"
    );
    let gen2 = all(&[("ctrl", 20), ("workers", 150)]);
    let ready2 = reached(applies[1], &converged_after(applies[1].start_ns));
    assert_eq!(
        gen2.difference(&ready2).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "replaced nodes whose readiness the second Apply does not reach"
    );
    let removed: BTreeSet<String> = (150..180).map(|i| format!("workers-{i}")).collect();
    let gone2 = reached(applies[1], &destroyed_after(applies[1].start_ns));
    assert_eq!(
        removed.difference(&gone2).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "removed nodes whose destruction the second Apply does not reach"
    );
    let gone = reached(deletes[0], &destroyed_after(deletes[0].start_ns));
    assert_eq!(
        gen2.difference(&gone).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "nodes whose destruction the DeleteRun does not reach"
    );

    let passes: Vec<&Received> = spans.iter().filter(|s| s.name == "pass").collect();
    let dropped: u64 = passes
        .iter()
        .filter_map(|p| p.attr("provisioning.pass.links_dropped")?.parse::<u64>().ok())
        .sum();
    let ops = spans.iter().filter(|s| s.name.starts_with("operation ")).count();
    let most_links = spans.iter().map(|s| s.links.len()).max().unwrap_or(0);
    println!(
        "node lives: {} spans in {} traces (largest {largest}); {} passes, {ops} operations; \
         the most links on a span {most_links}; {dropped} pass causes counted, not linked",
        spans.len(),
        per_trace.len(),
        passes.len(),
    );
}

/// SIGTERM right after a delete has finished: the last pass (the one that
/// saw the run gone) and its calls are exported whole. No span's parent is
/// missing; in particular every Decide call the decider served has its
/// client span and its pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_right_after_a_delete_exports_the_last_pass_whole() {
    for round in 0..3 {
        let (receiver, otlp) = start_receiver().await;
        let mut cluster = Cluster::start(traced(otlp)).await.unwrap();
        let (mut c, _) = converge(&cluster, "final").await;
        c.delete_run(pb::DeleteRunRequest {
            run_id: "final".into(),
        })
        .await
        .unwrap();
        until_gone(&c, "final").await;
        drop(c);
        stop(&mut cluster).await;
        let spans = receiver.spans.lock().unwrap().clone();
        let orphans = orphans(&spans);
        assert!(
            orphans.is_empty(),
            "round {round}: spans whose parent never came: {orphans:?}"
        );
        let deleted_pass = spans.iter().any(|s| {
            s.name == "pass"
                && s.attr("provisioning.run.id") == Some("final")
                && s.start_ns
                    > spans
                        .iter()
                        .find(|d| d.name == "provisioning.v1.Provisioning/DeleteRun")
                        .map_or(u64::MAX, |d| d.start_ns)
        });
        assert!(
            deleted_pass,
            "round {round}: no pass after the DeleteRun was exported"
        );
    }
}

fn assert_counts_are_integers(spans: &[Received]) {
    let mut seen = BTreeSet::new();
    for s in spans {
        for (key, kind) in &s.types {
            if INTEGER_ATTRIBUTES.contains(&key.as_str()) || key.starts_with("provisioning.pass.rule_") {
                assert_eq!(
                    *kind, "int",
                    "{key} of {} ({}) is exported as {kind}: {:?}",
                    s.name, s.service, s.attrs[key]
                );
                seen.insert(key.as_str());
            } else if *kind == "string" {
                assert!(
                    s.attrs[key].parse::<i64>().is_err(),
                    "{key} of {} ({}) is the number {:?} exported as a string",
                    s.name,
                    s.service,
                    s.attrs[key]
                );
            }
        }
        for (key, kind, value) in &s.event_attrs {
            assert!(
                !(*kind == "string" && value.parse::<i64>().is_ok()),
                "event attribute {key} of {} ({}) is the number {value:?} exported as a string",
                s.name,
                s.service
            );
        }
    }
    for key in INTEGER_ATTRIBUTES {
        assert!(seen.contains(key), "no span had {key}");
    }
    assert!(
        seen.iter().any(|k| k.starts_with("provisioning.pass.rule_")),
        "no pass counted its actions by rule"
    );
}

// ---------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------

/// One sample of an exposition: name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

fn parse_exposition(text: &str) -> (Vec<Sample>, BTreeSet<String>) {
    let mut samples = Vec::new();
    let mut families = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            families.insert(rest.split_whitespace().next().unwrap().to_owned());
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            v => v.parse().unwrap_or_else(|e| panic!("{line}: {e}")),
        };
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').unwrap();
                let labels = body
                    .split("\",")
                    .filter(|p| !p.is_empty())
                    .map(|pair| {
                        let (k, v) = pair.split_once("=\"").unwrap();
                        (k.to_owned(), v.trim_end_matches('"').to_owned())
                    })
                    .collect();
                (name.to_owned(), labels)
            }
            None => (series.to_owned(), BTreeMap::new()),
        };
        samples.push((name, labels, value));
    }
    (samples, families)
}

/// The sum of `name`'s samples whose labels include `want`.
fn sum(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|(n, labels, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

/// `name`'s samples by the value of `label`.
fn by_label(samples: &[Sample], name: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (n, labels, v) in samples {
        if n == name
            && let Some(l) = labels.get(label)
        {
            *out.entry(l.clone()).or_default() += v;
        }
    }
    out
}

/// `expr` without its label lists (`by (...)`, `without (...)`) and label
/// matchers (`{...}`), which name labels, not metrics.
fn without_labels(expr: &str) -> String {
    let mut out = String::new();
    let mut rest = expr;
    while !rest.is_empty() {
        let grouping = ["by (", "by(", "without (", "without("]
            .iter()
            .filter_map(|k| rest.find(k).map(|i| (i, k.len(), ')')))
            .chain(rest.find('{').map(|i| (i, 1, '}')))
            .min();
        match grouping {
            Some((at, len, close)) => {
                out.push_str(&rest[..at]);
                let after = &rest[at + len..];
                rest = after.find(close).map_or("", |end| &after[end + 1..]);
            }
            None => {
                out.push_str(rest);
                rest = "";
            }
        }
    }
    out
}

/// The metric names in the Grafana dashboard's queries (every word of an
/// `expr` that starts as the services' metrics do).
fn dashboard_metrics() -> BTreeSet<String> {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/provisioning.json"
    ))
    .unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut names = BTreeSet::new();
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = without_labels(target["expr"].as_str().expect("expr"));
            queries += 1;
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("provisioning_") || word.starts_with("grpc_") {
                    names.insert(word.to_owned());
                }
            }
        }
    }
    assert!(queries >= 10, "the dashboard has {queries} queries");
    names
}

/// Every family each service must export (docs/observability.md, "Metrics").
const DRIVER_FAMILIES: &[&str] = &[
    "provisioning_workqueue_depth",
    "provisioning_workqueue_adds_total",
    "provisioning_workqueue_queue_duration_seconds",
    "provisioning_workqueue_retries_total",
    "provisioning_workqueue_work_duration_seconds",
    "provisioning_reconcile_total",
    "provisioning_reconcile_errors_total",
    "provisioning_pass_duration_seconds",
    "provisioning_actions_total",
    "provisioning_stale_decisions_total",
    "provisioning_operations_dispatched_total",
    "provisioning_operations_in_flight",
    "provisioning_admission_waiting_nodes",
    "provisioning_operation_duration_seconds",
    "provisioning_folds_total",
    "provisioning_stale_results_discarded_total",
    "provisioning_runs_converged_total",
    "provisioning_bootstrap_sessions_asked_again_total",
    "provisioning_store_commits_total",
    "provisioning_store_node_writes_total",
    "provisioning_nodes",
    "provisioning_runs",
    "provisioning_executor_link_up",
    "provisioning_executor_link_events_total",
    "grpc_server_started_total",
    "grpc_server_handled_total",
    "grpc_server_handling_seconds",
    "grpc_client_started_total",
    "grpc_client_handled_total",
    "grpc_client_handling_seconds",
    "grpc_server_msg_received_total",
    "grpc_server_msg_sent_total",
    "grpc_client_msg_sent_total",
    "grpc_client_msg_received_total",
];
const EXECUTOR_FAMILIES: &[&str] = &[
    "provisioning_executor_operations_started_total",
    "provisioning_executor_operations_completed_total",
    "provisioning_executor_operations_replayed_total",
    "provisioning_executor_late_completions_total",
    "provisioning_executor_backend_call_duration_seconds",
    "provisioning_executor_operations_running",
    "provisioning_executor_observations_total",
    "provisioning_executor_observations_coalesced_total",
    "provisioning_executor_rejections_total",
    "provisioning_executor_links",
    // The driver's link is open, not yet handled: a family whose label
    // values are learnt shows from its first series.
    "grpc_server_started_total",
];
const DECIDER_FAMILIES: &[&str] = &[
    "provisioning_decider_decisions_total",
    "provisioning_decider_nodes_total",
    "grpc_server_handled_total",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_endpoints_serve_the_documented_metrics_and_they_move() {
    // No safety tick during the test: the three scrapes are not simultaneous,
    // and a pass between them would make the two sides of a count differ.
    let opts = ClusterOptions::default()
        .driver("--safety-tick-ms", "600000")
        .env("PROVISIONING_METRICS_LISTEN", "127.0.0.1:0");
    let cluster = Cluster::start(opts).await.unwrap();
    let (_client, nodes) = converge(&cluster, "metrics").await;
    let nodes = f64::from(nodes);
    // The follow-up pass after convergence and the last acknowledgements
    // finish within moments; the numbers compared below are settled then.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut expositions = BTreeMap::new();
    for s in [&cluster.driver, &cluster.executor, &cluster.decider] {
        let text = s
            .scrape()
            .await
            .unwrap_or_else(|e| panic!("scraping {}: {e}", s.name));
        expositions.insert(s.name.as_str(), parse_exposition(&text));
    }
    let (driver, driver_families) = &expositions["driver-svc"];
    let (executor, executor_families) = &expositions["executor-svc"];
    let (decider, decider_families) = &expositions["decider-svc"];
    for (service, families, want) in [
        ("driver-svc", driver_families, DRIVER_FAMILIES),
        ("executor-svc", executor_families, EXECUTOR_FAMILIES),
        ("decider-svc", decider_families, DECIDER_FAMILIES),
    ] {
        for f in want {
            assert!(families.contains(*f), "{service} does not export {f}");
        }
    }

    // Every service has the process metrics and its build info, read live.
    for (service, samples, families) in [
        ("driver-svc", driver, driver_families),
        ("executor-svc", executor, executor_families),
        ("decider-svc", decider, decider_families),
    ] {
        for family in [
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_threads",
            "process_start_time_seconds",
        ] {
            assert!(
                sum(samples, family, &[]) > 0.0,
                "{service}: {family} is zero or missing"
            );
        }
        // An idle decider may not have used a hundredth of a second yet.
        assert!(
            families.contains("process_cpu_seconds_total"),
            "{service}: no CPU time"
        );
        assert_eq!(
            sum(
                samples,
                "provisioning_build_info",
                &[("service", service), ("version", env!("CARGO_PKG_VERSION"))]
            ),
            1.0,
            "{service}'s build info"
        );
    }

    // The Grafana dashboard's queries name only metrics the binaries serve.
    let served: BTreeSet<&String> = driver_families
        .iter()
        .chain(executor_families)
        .chain(decider_families)
        .collect();
    for name in dashboard_metrics() {
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|f| served.contains(&(*f).to_owned()))
            })
            .unwrap_or(&name);
        assert!(
            served.contains(&family.to_owned()),
            "deploy/grafana/provisioning.json queries {name}, which no service serves"
        );
    }

    // Every exported family is documented in the metrics catalogue.
    let catalogue =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/observability.md")).unwrap();
    for families in [driver_families, executor_families, decider_families] {
        for f in families {
            let documented = catalogue.contains(&format!("`{f}`")) || catalogue.contains(&format!("`{f}{{"));
            assert!(documented, "{f} is not documented in docs/observability.md");
        }
    }

    // Fault-free: every operation the driver dispatched, the executor
    // completed once, with the same effects, and the driver folded each.
    let dispatched = by_label(driver, "provisioning_operations_dispatched_total", "effect");
    let completed = by_label(
        executor,
        "provisioning_executor_operations_completed_total",
        "effect",
    );
    assert!(!dispatched.is_empty());
    assert_eq!(
        dispatched, completed,
        "dispatched by the driver vs completed by the executor"
    );
    let total: f64 = dispatched.values().sum();
    assert!(total >= 2.0 * nodes, "{total} operations for {nodes} nodes");
    assert_eq!(dispatched.get("create-lease"), Some(&nodes));
    assert_eq!(
        sum(
            driver,
            "provisioning_operation_duration_seconds_count",
            &[("outcome", "succeeded")]
        ),
        total,
        "every operation folded as succeeded"
    );
    assert_eq!(
        sum(driver, "provisioning_folds_total", &[("kind", "result")]),
        total
    );
    assert!(sum(driver, "provisioning_folds_total", &[("kind", "observation")]) >= nodes);
    assert_eq!(sum(driver, "provisioning_operations_in_flight", &[]), 0.0);
    assert_eq!(
        sum(
            executor,
            "provisioning_executor_backend_call_duration_seconds_count",
            &[]
        ),
        total
    );
    assert_eq!(
        sum(executor, "provisioning_executor_operations_running", &[]),
        0.0
    );
    assert_eq!(sum(executor, "provisioning_executor_links", &[]), 1.0);
    assert!(sum(executor, "provisioning_executor_observations_total", &[]) >= nodes);

    // The work queue and the passes.
    assert!(sum(driver, "provisioning_workqueue_adds_total", &[("name", "runs")]) >= 1.0);
    assert!(
        sum(
            driver,
            "provisioning_workqueue_queue_duration_seconds_count",
            &[("name", "runs")]
        ) >= 1.0
    );
    assert_eq!(
        sum(driver, "provisioning_workqueue_depth", &[("name", "runs")]),
        0.0
    );
    let passes = sum(
        driver,
        "provisioning_pass_duration_seconds_count",
        &[("controller", "run")],
    );
    assert!(passes >= 3.0, "{passes} passes");
    assert_eq!(
        sum(driver, "provisioning_reconcile_total", &[("controller", "run")]),
        passes
    );
    // The store: what a batch folds is written with the pass that decides
    // on it, so the commits are about the passes (plus the apply's), not the
    // passes and every batch of folds.
    // (Here: 9 commits for 9 passes; 17-18 when every batch of folds was
    // committed on its own.)
    let commits = sum(driver, "provisioning_store_commits_total", &[]);
    let writes = sum(driver, "provisioning_store_node_writes_total", &[]);
    assert!(
        commits >= 1.0 && commits <= passes + 2.0,
        "{commits} commits for {passes} passes"
    );
    assert!(writes >= nodes, "{writes} node writes for {nodes} nodes");
    assert_eq!(
        sum(
            driver,
            "provisioning_workqueue_work_duration_seconds_count",
            &[("name", "runs")]
        ),
        passes
    );
    assert_eq!(
        sum(driver, "provisioning_reconcile_total", &[("result", "error")]),
        0.0
    );
    assert!(sum(driver, "provisioning_reconcile_total", &[("result", "requeue")]) >= 1.0);
    assert_eq!(
        sum(
            driver,
            "provisioning_actions_total",
            &[("rule", "0"), ("name", "insert")]
        ),
        nodes
    );
    assert_eq!(
        sum(
            driver,
            "provisioning_actions_total",
            &[("rule", "12"), ("name", "create-lease")]
        ),
        nodes
    );
    assert_eq!(sum(driver, "provisioning_runs_converged_total", &[]), 1.0);
    assert_eq!(sum(driver, "provisioning_runs", &[("phase", "converged")]), 1.0);
    assert_eq!(sum(driver, "provisioning_nodes", &[("stage", "dormant")]), nodes);
    assert_eq!(sum(driver, "provisioning_nodes", &[]), nodes);
    assert_eq!(sum(driver, "provisioning_executor_link_up", &[]), 1.0);
    assert!(
        sum(
            driver,
            "provisioning_executor_link_events_total",
            &[("event", "sent")]
        ) >= total
    );

    // RPC metrics on both sides of the Decide call.
    let decide = [
        ("grpc_service", "provisioning.internal.v1.Decider"),
        ("grpc_method", "Decide"),
    ];
    let served = sum(
        decider,
        "grpc_server_handled_total",
        &[decide[0], decide[1], ("grpc_code", "OK")],
    );
    let called = sum(
        driver,
        "grpc_client_handled_total",
        &[decide[0], decide[1], ("grpc_code", "OK")],
    );
    assert!(
        served >= passes,
        "{served} Decide calls served for {passes} passes"
    );
    assert_eq!(served, called, "Decide calls: decider served vs driver made");
    // The Decide stream is bidirectional, and each message the driver sent
    // the decider received (and back).
    let bidi = [decide[0], decide[1], ("grpc_type", "bidi_stream")];
    let sent = sum(driver, "grpc_client_msg_sent_total", &bidi);
    assert!(sent >= served, "{sent} Decide messages sent for {served} calls");
    assert_eq!(sum(decider, "grpc_server_msg_received_total", &bidi), sent);
    let answers = sum(decider, "grpc_server_msg_sent_total", &bidi);
    assert!(answers >= served, "{answers} Decide answers for {served} calls");
    assert_eq!(sum(driver, "grpc_client_msg_received_total", &bidi), answers);
    let apply = [
        ("grpc_service", "provisioning.v1.Provisioning"),
        ("grpc_method", "Apply"),
    ];
    assert_eq!(
        sum(
            driver,
            "grpc_server_handled_total",
            &[apply[0], apply[1], ("grpc_code", "OK"), ("grpc_type", "unary")]
        ),
        1.0
    );
    for name in ["grpc_server_msg_received_total", "grpc_server_msg_sent_total"] {
        assert_eq!(sum(driver, name, &[apply[0], apply[1]]), 1.0, "{name} of Apply");
    }
    assert!(sum(decider, "provisioning_decider_nodes_total", &[]) >= nodes);
    assert_eq!(
        sum(
            decider,
            "provisioning_decider_decisions_total",
            &[("rule", "0"), ("action", "insert")]
        ),
        nodes
    );
}

// ---------------------------------------------------------------------------
// Logs
// ---------------------------------------------------------------------------

fn json_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect()
}

/// The complete JSON lines of a log still being written (its last line may
/// be half there).
fn json_lines_so_far(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn message(line: &serde_json::Value) -> &str {
    line["fields"]["message"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_the_trace_and_span_ids_of_the_enclosing_span() {
    let (receiver, otlp) = start_receiver().await;
    // A short safety tick: the idle passes after convergence are not
    // sampled, and neither are their Decide calls.
    let opts = traced(otlp)
        .driver("--safety-tick-ms", "250")
        .env("PROVISIONING_LOG_JSON", "true")
        .service_env("decider-svc", "RUST_LOG", "info,decider_svc=debug");
    let mut cluster = Cluster::start(opts).await.unwrap();
    let (client, _) = converge(&cluster, "logs").await;
    // Wait for a Decide call of an unsampled pass: a `decided` line in the
    // call's span that names no trace.
    let decider_log = cluster.decider.log_file().to_path_buf();
    let untraced = |line: &serde_json::Value| {
        message(line) == "decided" && line.get("trace_id").is_none() && line.get("span").is_some()
    };
    eventually(CONVERGE, "a Decide call of an unsampled pass", || {
        let log = decider_log.clone();
        async move { json_lines_so_far(&log).iter().any(untraced).then_some(()) }
    })
    .await
    .unwrap();
    drop(client);
    stop(&mut cluster).await;
    let spans = receiver.spans.lock().unwrap().clone();
    let span = |id: &str| spans.iter().find(|s| s.span_id == id);

    // A line carries ids only of a span that was exported: every one of the
    // three services' lines that names a span names one the receiver got,
    // in the trace it says.
    for name in SERVICES {
        for line in json_lines(&cluster.dir.path().join(format!("{name}.log"))) {
            if let Some(id) = line.get("span_id").and_then(|v| v.as_str()) {
                let s =
                    span(id).unwrap_or_else(|| panic!("{name}: a line names a span never exported: {line}"));
                assert_eq!(Some(s.trace_id.as_str()), line["trace_id"].as_str(), "{line}");
            }
        }
    }

    // The driver's "run converged" line is written inside the pass that saw
    // convergence: its ids are that pass span's.
    let driver = json_lines(cluster.driver.log_file());
    let converged = driver
        .iter()
        .find(|l| message(l) == "run converged")
        .expect("a `run converged` line");
    let (trace_id, span_id) = (
        converged["trace_id"].as_str().expect("trace_id"),
        converged["span_id"].as_str().expect("span_id"),
    );
    let pass = span(span_id).expect("the line's span was exported");
    assert_eq!((pass.name.as_str(), pass.trace_id.as_str()), ("pass", trace_id));
    assert_eq!(converged["span"]["name"], "pass");
    assert_eq!(converged["level"], "INFO");

    // Every "decided" line of the decider is written inside a Decide call:
    // a sampled one's under the driver's trace, an unsampled one's with no ids.
    let decider = json_lines(cluster.decider.log_file());
    assert!(
        decider.iter().any(untraced),
        "no `decided` line of an unsampled call"
    );
    let decided: Vec<&serde_json::Value> = decider
        .iter()
        .filter(|l| message(l) == "decided" && !untraced(l))
        .collect();
    assert!(!decided.is_empty(), "no `decided` lines");
    for line in decided {
        let s = span(line["span_id"].as_str().expect("span_id")).expect("the line's span was exported");
        assert_eq!(s.name, "provisioning.internal.v1.Decider/Decide");
        assert_eq!(Some(s.trace_id.as_str()), line["trace_id"].as_str());
        let client = span(&s.parent).expect("the driver's client span");
        assert_eq!(client.service, "provisioning-driver");
    }

    // A line outside any span carries no ids.
    let listening = driver
        .iter()
        .find(|l| message(l) == "listening")
        .expect("a `listening` line");
    assert!(listening.get("trace_id").is_none(), "{listening}");
}

// ---------------------------------------------------------------------------
// The exporter's own health
// ---------------------------------------------------------------------------

const EXPORT_FAILED: &str = "exporting spans over OTLP failed; spans are dropped until the receiver takes them again (provisioning_telemetry_spans_dropped_total counts them)";
const EXPORT_RECOVERED: &str = "exporting spans over OTLP works again";

/// The counters' families that learn their label values as they occur
/// (docs/observability.md, "Metrics"); every other counter has a series
/// from the start.
const LEARNT_COUNTERS: &[&str] = &[
    "grpc_server_started_total",
    "grpc_server_handled_total",
    "grpc_client_started_total",
    "grpc_client_handled_total",
    "grpc_server_msg_received_total",
    "grpc_server_msg_sent_total",
    "grpc_client_msg_sent_total",
    "grpc_client_msg_received_total",
    "provisioning_stale_results_discarded_total",
    "provisioning_decider_decisions_total",
];

/// One scrape of `service`, parsed.
async fn scrape(service: &Service) -> (Vec<Sample>, BTreeSet<String>) {
    let text = service
        .scrape()
        .await
        .unwrap_or_else(|e| panic!("scraping {}: {e}", service.name));
    parse_exposition(&text)
}

/// A receiver stopped mid-run: each service logs one failure line, counts
/// the spans it drops, and logs one line when the receiver is back. Every
/// counter is there from the start. Every log line, to the last, is JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_reports_failures_and_recovery_and_counters_start_at_zero() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = listener.local_addr().unwrap();
    let receiver = Receiver::default();
    let serving = Serving::start(&receiver, listener);
    let opts = traced(otlp)
        .driver("--safety-tick-ms", "600000")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", "2000")
        .env("PROVISIONING_METRICS_LISTEN", "127.0.0.1:0")
        .env("PROVISIONING_LOG_JSON", "true");
    let mut cluster = Cluster::start(opts).await.unwrap();
    let services = || [&cluster.driver, &cluster.executor, &cluster.decider];

    // Before anything happened: every counter has its series, at zero.
    for (service, want) in services()
        .into_iter()
        .zip([DRIVER_FAMILIES, EXECUTOR_FAMILIES, DECIDER_FAMILIES])
    {
        let (samples, families) = scrape(service).await;
        let counters = want
            .iter()
            .chain(&[
                "provisioning_telemetry_spans_exported_total",
                "provisioning_telemetry_spans_dropped_total",
            ])
            .filter(|f| f.ends_with("_total") && !LEARNT_COUNTERS.contains(f));
        for family in counters {
            assert!(
                families.contains(*family),
                "{} does not export {family}",
                service.name
            );
            assert!(
                samples.iter().any(|(n, _, _)| n == family),
                "{} exports {family} with no series before its first event",
                service.name
            );
        }
        for reason in ["export_failed", "queue_full", "exporter_unavailable"] {
            assert_eq!(
                samples
                    .iter()
                    .find(|(n, l, _)| n == "provisioning_telemetry_spans_dropped_total"
                        && l.get("reason").map(String::as_str) == Some(reason))
                    .map(|s| s.2),
                Some(0.0),
                "{}: spans dropped for {reason} at the start",
                service.name
            );
        }
    }
    let (driver, _) = scrape(&cluster.driver).await;
    for (family, labels) in [
        ("provisioning_reconcile_total", ("result", "error")),
        (
            "provisioning_reconcile_errors_total",
            ("reason", "decider_unavailable"),
        ),
        (
            "provisioning_operations_dispatched_total",
            ("effect", "destroy-lease"),
        ),
        ("provisioning_api_refused_total", ("reason", "unauthenticated")),
    ] {
        assert!(
            driver.iter().any(|(n, l, v)| n == family
                && l.get(labels.0).map(String::as_str) == Some(labels.1)
                && *v == 0.0),
            "{family}{{{}=\"{}\"}} is not exported at zero from the start",
            labels.0,
            labels.1
        );
    }

    // Spans reach the receiver.
    converge_one(&cluster, "before").await;
    eventually(
        CONVERGE,
        "the driver's spans of run `before` exported",
        || async { (spans_of_run(&receiver, "provisioning-driver", "before") > 0).then_some(()) },
    )
    .await
    .unwrap();

    // The receiver goes away; the services go on, and say so once.
    serving.stop().await;
    converge_one(&cluster, "during").await;
    for service in services() {
        let log = service.log_file().to_path_buf();
        eventually(
            CONVERGE,
            &format!("{} logs the failed export", service.name),
            || {
                let log = log.clone();
                async move {
                    json_lines_so_far(&log)
                        .iter()
                        .any(|l| message(l) == EXPORT_FAILED)
                        .then_some(())
                }
            },
        )
        .await
        .unwrap();
        let (samples, _) = scrape(service).await;
        let dropped = sum(
            &samples,
            "provisioning_telemetry_spans_dropped_total",
            &[("reason", "export_failed")],
        );
        assert!(dropped > 0.0, "{}: no span counted dropped", service.name);
    }
    let (before, _) = scrape(&cluster.driver).await;
    let exported_before = sum(&before, "provisioning_telemetry_spans_exported_total", &[]);
    assert!(exported_before > 0.0, "the driver counted no span exported");

    // It comes back on the same address: one line says so, and spans flow.
    let listener = tokio::net::TcpListener::bind(otlp).await.unwrap();
    let serving = Serving::start(&receiver, listener);
    converge_one(&cluster, "after").await;
    for service in services() {
        let log = service.log_file().to_path_buf();
        eventually(CONVERGE, &format!("{} logs the recovery", service.name), || {
            let log = log.clone();
            async move {
                json_lines_so_far(&log)
                    .iter()
                    .any(|l| message(l) == EXPORT_RECOVERED)
                    .then_some(())
            }
        })
        .await
        .unwrap();
    }
    eventually(CONVERGE, "the driver's spans of run `after` exported", || async {
        (spans_of_run(&receiver, "provisioning-driver", "after") > 0).then_some(())
    })
    .await
    .unwrap();
    let (after, _) = scrape(&cluster.driver).await;
    assert!(sum(&after, "provisioning_telemetry_spans_exported_total", &[]) > exported_before);
    // The outage lost spans: the first failed export held the first spans of
    // run `during` (those of `before` were received before the receiver
    // went), so fewer of its spans arrived than of the same run made while
    // the receiver was up. (Its last spans may arrive: an export retries
    // within its timeout and succeeds if the receiver is back by then.)
    let (before_spans, during_spans) = (
        spans_of_run(&receiver, "provisioning-driver", "before"),
        spans_of_run(&receiver, "provisioning-driver", "during"),
    );
    assert!(
        during_spans < before_spans,
        "{during_spans} spans of the outage's run arrived, as many as the {before_spans} of a run made \
         with the receiver up: none was dropped"
    );

    stop(&mut cluster).await;
    serving.stop().await;
    for service in [&cluster.driver, &cluster.executor, &cluster.decider] {
        // Every line is JSON (json_lines panics otherwise).
        let lines = json_lines(service.log_file());
        let failed: Vec<&serde_json::Value> = lines.iter().filter(|l| message(l) == EXPORT_FAILED).collect();
        let recovered: Vec<&serde_json::Value> =
            lines.iter().filter(|l| message(l) == EXPORT_RECOVERED).collect();
        assert_eq!(
            (failed.len(), recovered.len()),
            (1, 1),
            "{}: failure and recovery lines",
            service.name
        );
        assert_eq!(failed[0]["level"], "WARN");
        assert_eq!(failed[0]["fields"]["endpoint"], format!("http://{otlp}"));
        assert!(
            failed[0]["fields"]["error"]
                .as_str()
                .is_some_and(|e| !e.is_empty())
        );
        assert_eq!(recovered[0]["level"], "INFO");
        assert!(
            recovered[0]["fields"]["dropped"].as_u64().is_some_and(|n| n > 0),
            "{}",
            recovered[0]
        );
        let at = |l: &serde_json::Value| l["timestamp"].as_str().unwrap_or_default().to_owned();
        assert!(at(failed[0]) <= at(recovered[0]), "recovery before failure");
    }
}

/// A flush at shutdown that cannot finish (the receiver accepts connections
/// and never answers) is logged, as JSON in a JSON log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_flush_at_shutdown_is_a_json_line_in_a_json_log() {
    // A blackhole: connections are accepted and never answered.
    let blackhole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = blackhole.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((conn, _)) = blackhole.accept().await {
            open.push(conn);
        }
    });
    let dir = tempfile::tempdir().unwrap();
    TestPki::create(dir.path()).unwrap();
    let env: Vec<(String, String)> = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{otlp}")),
        // Nothing is exported before the shutdown's flush.
        ("OTEL_BSP_SCHEDULE_DELAY", "600000".to_owned()),
        ("PROVISIONING_LOG_JSON", "true".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let mut decider = Service::start_with_env("decider-svc", dir.path(), "127.0.0.1:0", &[], &env)
        .await
        .unwrap();
    // One traced call (its empty request is refused), read to its end: a
    // span to flush.
    let mut client =
        pb::decider_client::DeciderClient::new(decider.channel(Some(platform::tls::DRIVER)).await.unwrap());
    if let Ok(answer) = client
        .decide(tokio_stream::iter(Vec::<pb::DecideRequest>::new()))
        .await
    {
        let mut answer = answer.into_inner();
        while let Ok(Some(_)) = answer.message().await {}
    }
    drop(client);
    let status = decider.terminate().await.unwrap();
    held.abort();
    assert!(status.success(), "decider-svc exited with {status}");

    let lines = json_lines(decider.log_file());
    let flush = lines
        .iter()
        .find(|l| message(l).starts_with("flushing spans at shutdown failed"))
        .unwrap_or_else(|| panic!("no line about the failed flush in {lines:?}"));
    assert_eq!(flush["level"], "WARN");
    assert!(
        flush["fields"]["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{flush}"
    );
}

/// A service that cannot start says why in a JSON line when its log is JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_that_cannot_start_says_why_in_a_json_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let env = vec![("PROVISIONING_LOG_JSON".to_owned(), "true".to_owned())];
    let started = Service::start_with_env(
        "decider-svc",
        dir.path(),
        &listen,
        &["--insecure".to_owned()],
        &env,
    )
    .await;
    assert!(started.is_err(), "decider-svc started on a port in use");
    // Every line is JSON, the last says why the process ended.
    let lines = json_lines(&dir.path().join("decider-svc.log"));
    let last = lines.last().expect("a log line");
    assert_eq!(
        (last["level"].as_str(), message(last)),
        (Some("ERROR"), "exiting on an error")
    );
    let error = last["fields"]["error"].as_str().unwrap_or_default();
    assert!(error.starts_with(&format!("binding {listen}")), "{error}");
    assert!(
        error.contains(&format!(
            "another process listens on {listen}; stop it, or give --listen (PROVISIONING_LISTEN) another \
             address"
        )),
        "{error}"
    );
    drop(taken);
}

/// Spans exported over TLS with a client certificate, to a receiver that
/// requires one: by an `https://` endpoint and by one without a scheme (TLS
/// is the default). A service whose TLS settings cannot be used still
/// starts and serves, says so once, and counts the spans it cannot send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_tls_and_unusable_settings_do_not_stop_a_service() {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};

    let pki_dir = tempfile::tempdir().unwrap();
    let pki = TestPki::create(pki_dir.path()).unwrap();
    // The receiver serves with a certificate of the test CA (valid for
    // 127.0.0.1) and wants the client's, from the same CA.
    let (cert, key) = pki.cert_and_key("decider-svc");
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(
            std::fs::read(&cert).unwrap(),
            std::fs::read(&key).unwrap(),
        ))
        .client_ca_root(Certificate::from_pem(std::fs::read(pki.ca()).unwrap()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = listener.local_addr().unwrap();
    let receiver = Receiver::default();
    let server = tonic::transport::Server::builder()
        .tls_config(tls)
        .unwrap()
        .add_service(TraceServiceServer::new(receiver.clone()))
        .serve_with_incoming(TcpListenerStream::new(listener));
    let serving = tokio::spawn(server);

    let (client_cert, client_key) = pki.cert_and_key(platform::tls::dev::CLIENT);
    let path = |p: &std::path::Path| p.display().to_string();
    let missing = pki_dir.path().join("no-such-ca.pem");
    let opts = traced(otlp)
        .driver("--safety-tick-ms", "600000")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &format!("https://{otlp}"))
        .service_env("driver-svc", "OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.to_string())
        .env("OTEL_EXPORTER_OTLP_CERTIFICATE", &path(&pki.ca()))
        .env("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", &path(&client_cert))
        .env("OTEL_EXPORTER_OTLP_CLIENT_KEY", &path(&client_key))
        .service_env("decider-svc", "OTEL_EXPORTER_OTLP_CERTIFICATE", &path(&missing))
        .env("PROVISIONING_METRICS_LISTEN", "127.0.0.1:0")
        .env("PROVISIONING_LOG_JSON", "true");
    let mut cluster = Cluster::start(opts).await.unwrap();
    converge_one(&cluster, "tls").await;
    let (decider, _) = scrape(&cluster.decider).await;
    let unavailable = sum(
        &decider,
        "provisioning_telemetry_spans_dropped_total",
        &[("reason", "exporter_unavailable")],
    );
    assert!(unavailable > 0.0, "the decider counted no span it could not send");
    stop(&mut cluster).await;
    serving.abort();

    for service in ["provisioning-driver", "provisioning-executor"] {
        assert!(
            spans_of_run(&receiver, service, "tls") > 0,
            "no span of {service} over TLS"
        );
    }
    let spans = receiver.spans.lock().unwrap().clone();
    assert!(
        !spans.iter().any(|s| s.service == "provisioning-decider"),
        "the decider exported without its CA"
    );
    let lines = json_lines(cluster.decider.log_file());
    let told: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| message(l).starts_with("spans are not exported"))
        .collect();
    assert_eq!(told.len(), 1, "one line says why spans are not exported");
    assert_eq!(told[0]["level"], "ERROR");
    let error = told[0]["fields"]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("OTEL_EXPORTER_OTLP_CERTIFICATE") && error.contains("no-such-ca.pem"),
        "{error}"
    );
}

// ---------------------------------------------------------------------------
// deploy/
// ---------------------------------------------------------------------------

fn deploy(file: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(file)
}

fn yaml(file: &str) -> serde_yaml_ng::Value {
    let text = std::fs::read_to_string(deploy(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// `deploy/telemetry.env`: the demo deployment's telemetry addresses.
fn telemetry_env() -> BTreeMap<String, String> {
    std::fs::read_to_string(deploy("telemetry.env"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("not KEY=VALUE: {l}"));
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect()
}

fn strings(v: &serde_yaml_ng::Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().filter_map(|x| x.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

fn keys(v: &serde_yaml_ng::Value) -> BTreeSet<String> {
    v.as_mapping()
        .map(|m| m.keys().filter_map(|k| k.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

#[test]
fn deploy_configs_point_at_the_demo_ports_and_are_consistent() {
    let env = telemetry_env();
    let metrics: BTreeMap<&str, String> = SERVICES
        .iter()
        .map(|s| {
            let key = format!("{}_METRICS", s.trim_end_matches("-svc").to_uppercase());
            (
                *s,
                env.get(&key).unwrap_or_else(|| panic!("{key} missing")).clone(),
            )
        })
        .collect();
    let otlp = env.get("OTLP_GRPC").expect("OTLP_GRPC");
    let distinct: BTreeSet<&String> = metrics.values().chain([otlp]).collect();
    assert_eq!(distinct.len(), 4, "every address is distinct: {env:?}");

    // Prometheus scrapes each service's metrics address, labelled with it.
    let prometheus = yaml("prometheus.yml");
    let jobs = prometheus["scrape_configs"]
        .as_sequence()
        .expect("scrape_configs");
    let mut scraped: BTreeMap<String, String> = BTreeMap::new();
    for job in jobs {
        for sc in job["static_configs"].as_sequence().expect("static_configs") {
            let service = sc["labels"]["service"]
                .as_str()
                .expect("a service label")
                .to_owned();
            for t in strings(&sc["targets"]) {
                scraped.insert(service.clone(), t);
            }
        }
        assert_eq!(job["metrics_path"].as_str().unwrap_or("/metrics"), "/metrics");
    }
    let want: BTreeMap<String, String> = metrics
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect();
    assert_eq!(scraped, want, "prometheus.yml targets vs deploy/telemetry.env");

    // The collector: every pipeline names components that are defined, every
    // defined component is used, traces arrive on the services' OTLP
    // address, and its metrics pipeline scrapes the same targets.
    let collector = yaml("otel-collector.yaml");
    let pipelines = collector["service"]["pipelines"]
        .as_mapping()
        .expect("service.pipelines");
    assert!(pipelines.contains_key("traces"), "a traces pipeline");
    for section in ["receivers", "processors", "exporters"] {
        let defined = keys(&collector[section]);
        let mut used = BTreeSet::new();
        for (name, p) in pipelines {
            let listed = strings(&p[section]);
            if section != "processors" {
                assert!(!listed.is_empty(), "pipeline {name:?} has no {section}");
            }
            for c in listed {
                assert!(
                    defined.contains(&c),
                    "pipeline {name:?} uses undefined {section} {c}"
                );
                used.insert(c);
            }
        }
        assert_eq!(defined, used, "{section} defined but unused");
    }
    let traces = &pipelines["traces"];
    assert!(strings(&traces["receivers"]).contains(&"otlp".to_owned()));
    assert_eq!(
        collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].as_str(),
        Some(otlp.as_str()),
        "the collector receives OTLP/gRPC where the services send it"
    );
    let mut collector_targets = BTreeSet::new();
    for job in collector["receivers"]["prometheus"]["config"]["scrape_configs"]
        .as_sequence()
        .expect("the collector's prometheus receiver")
    {
        for sc in job["static_configs"].as_sequence().expect("static_configs") {
            collector_targets.extend(strings(&sc["targets"]));
        }
    }
    assert_eq!(
        collector_targets,
        metrics.values().cloned().collect::<BTreeSet<_>>(),
        "the collector scrapes the services' metrics addresses"
    );

    // The demo starts the services on these addresses when asked to.
    let demo = std::fs::read_to_string(deploy("demo.sh")).unwrap();
    assert!(
        demo.contains("deploy/telemetry.env"),
        "demo.sh reads deploy/telemetry.env"
    );
    for key in [
        "DRIVER_METRICS",
        "DECIDER_METRICS",
        "EXECUTOR_METRICS",
        "OTLP_GRPC",
    ] {
        assert!(demo.contains(&format!("${key}")), "demo.sh uses {key}");
    }

    // promtool, where installed (CI installs it), checks the Prometheus files
    // (the compose stack's too) and the rules they load.
    match std::process::Command::new("promtool")
        .arg("check")
        .arg("config")
        .arg(deploy("prometheus.yml"))
        .arg(deploy("prometheus.compose.yml"))
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "promtool check config failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => {
            assert!(
                std::env::var("CI").is_err(),
                "promtool is missing in CI (.ci/run installs Debian's prometheus): {e}"
            );
            println!("promtool not installed ({e}); only the structural checks ran");
        }
    }
}

// ---------------------------------------------------------------------------
// Secrets
// ---------------------------------------------------------------------------

/// A secret boot and join value travels from the client to the executor and
/// is never seen again: not in any log line (at debug), span, metric or API
/// read, nor in clear in either store at rest (both sealed with a key file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_never_appears_in_logs_spans_metrics_reads_or_stores() {
    const SECRET: &str = "hunter2-correct-horse-battery";
    let (receiver, otlp) = start_receiver().await;
    let keys = tempfile::tempdir().unwrap();
    let key = keys.path().join("secrets.key");
    std::fs::write(&key, platform::secrets::SecretKey::generate().unwrap().to_hex()).unwrap();
    platform::secrets::restrict_to_owner(&key).unwrap();
    let key = key.display().to_string();
    let mut cluster = Cluster::start(
        traced(otlp)
            .env("RUST_LOG", "debug")
            .env("PROVISIONING_METRICS_LISTEN", "127.0.0.1:0")
            .driver("--secrets-key-file", &key)
            .executor("--secrets-key-file", &key),
    )
    .await
    .unwrap();
    let secret = |p: &mut contract::NodeTemplate| {
        for params in [&mut p.boot, &mut p.join] {
            params.insert(
                "token".into(),
                contract::Param {
                    value: SECRET.into(),
                    secret: true,
                },
            );
        }
    };
    let s = provisioning_tests::shapes::with_template(
        shape("sec", 1, "fake", &[("workers", 3, "img:1")]),
        "workers",
        secret,
    );
    let mut c = cluster.client().await.unwrap();
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await
    .unwrap();
    let converged = match watch_until(&mut c, "sec", CONVERGE, |s| s.converged).await {
        Ok(s) => s,
        Err(e) => {
            cluster.dump_logs();
            panic!("{e}");
        }
    };

    // Every read path.
    let mut reads: Vec<String> = vec![format!("{converged:?}")];
    let run = c
        .get_run(pb::GetRunRequest {
            run_id: "sec".into(),
            include_nodes: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        format!("{run:?}").contains("token"),
        "the read shows the parameter, redacted"
    );
    reads.push(format!("{run:?}"));
    reads.push(format!(
        "{:?}",
        c.list_runs(pb::ListRunsRequest::default())
            .await
            .unwrap()
            .into_inner()
    ));
    for n in &run.nodes {
        let id = n.state.as_ref().map(|s| s.node_id.clone()).unwrap_or_default();
        reads.push(format!(
            "{:?}",
            c.explain_node(pb::ExplainNodeRequest {
                run_id: "sec".into(),
                node_id: id,
            })
            .await
            .unwrap()
            .into_inner()
        ));
    }
    reads.push(format!(
        "{:?}",
        c.plan(pb::PlanRequest {
            shape: Some(pb::ClusterShape::from(&s)),
        })
        .await
        .unwrap()
        .into_inner()
    ));
    let mut watch = c
        .watch_run(pb::WatchRunRequest {
            run_id: "sec".into(),
            include_nodes: true,
        })
        .await
        .unwrap()
        .into_inner();
    reads.push(format!("{:?}", watch.message().await.unwrap()));
    reads.push(format!(
        "{:?}",
        c.list_orphans(pb::ListOrphansRequest {})
            .await
            .unwrap()
            .into_inner()
    ));
    for (i, r) in reads.iter().enumerate() {
        assert!(!r.contains(SECRET), "read #{i} shows the secret: {r}");
    }

    // Every metric of every service.
    for svc in [&cluster.driver, &cluster.executor, &cluster.decider] {
        let text = svc.scrape().await.unwrap();
        assert!(!text.contains(SECRET), "{} metrics show the secret", svc.name);
    }

    // The stores at rest.
    for file in ["driver-data/driver.redb", "executor-state/executor.redb"] {
        let bytes = std::fs::read(cluster.dir.path().join(file)).unwrap();
        assert!(
            !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "{file} holds the secret in clear"
        );
    }

    // Every span (names, attributes, events) and every log line.
    stop(&mut cluster).await;
    let spans = receiver.spans.lock().unwrap().clone();
    assert!(spans.len() > 20, "spans were exported: {}", spans.len());
    for span in &spans {
        assert!(
            !span.raw.contains(SECRET),
            "span {} of {} shows the secret",
            span.name,
            span.service
        );
    }
    let mut lines = 0;
    for name in ["decider-svc", "executor-svc", "driver-svc"] {
        let log = std::fs::read_to_string(cluster.dir.path().join(format!("{name}.log"))).unwrap();
        lines += log.lines().count();
        for line in log.lines() {
            assert!(!line.contains(SECRET), "{name} logged the secret: {line}");
        }
    }
    assert!(lines > 50, "debug logs were written: {lines} lines");
}
