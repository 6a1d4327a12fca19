//! The `Decider` gRPC service.
//!
//! Each `Decide` call runs in its own task, which reads the request stream and
//! writes responses into a small bounded channel: a slow reader holds the task
//! back instead of letting decisions pile up, so a call's memory is one node
//! batch, one decision batch and the slot set, whatever the run's size.
//!
//! The protocol, in order: exactly one `header` first; then `nodes`, `slots`
//! and `slot_ranges` batches in any order; then `end`. Every response carries
//! [`SLOT_RANGES_HEADER`], so a driver knows this decider reads ranges. Each
//! node is decided as soon as it is decoded; `end` releases the inserts (which need every slot) and the summary,
//! after which the response stream ends. Any deviation fails the call with
//! `INVALID_ARGUMENT` naming the field, and a call over the configured size with
//! `RESOURCE_EXHAUSTED`; [`to_status`] is the one place that maps errors to codes.

use std::future::Future;

use contract::{
    FieldError, GroupCounts, GroupId, GroupInterner, UnixMillis,
    pb::{self, DecideResponse, decide_request::Part},
    wire::{
        self, TemplateTable,
        encode::{encode_decision, message_len, put_message},
        node_from_wire_ref,
        request::{Incoming, IncomingPart, NodeRanges, NodeScratch},
        shape_from_wire_with_table,
    },
};
use decider::{Budgets, DesiredView, SlotSet};
use platform::{
    event_trace::{self, DecisionRec, TraceEvent},
    runtime::health_and_reflection,
    telemetry::{self, grpc::ServerLayer},
    tls::PeerPolicy,
};
use prost::Message as _;
use tokio::{net::TcpListener, sync::mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming, codegen::Bytes};
use tracing::Instrument as _;

use crate::route::DeciderServer;

/// The most decisions in one `DecisionBatch`.
pub const MAX_BATCH: usize = 2048;

/// A decision batch is also cut once its encoded size reaches this, so that
/// long reasons (a permanent failure quotes the provider's message) cannot push
/// a batch of [`MAX_BATCH`] decisions past the client's 4 MiB decoding limit.
pub const MAX_BATCH_BYTES: usize = 1 << 20;

/// The response header by which a decider says it reads `slot_ranges` (value
/// `1`). A driver sends ranges only to a decider that said so in the same
/// call; one that predates ranges would refuse the unknown part.
pub const SLOT_RANGES_HEADER: &str = "provisioning-decide-slot-ranges";

/// The default for [`Config::max_nodes`].
pub const DEFAULT_MAX_NODES: u32 = 1_000_000;

/// Responses buffered per call before the task waits for the client to read.
const RESPONSE_BUFFER: usize = 4;

/// What a decider instance is configured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// The most nodes, the most slot indices and the most desired slots one call
    /// may carry; each is counted separately.
    pub max_nodes: u32,
    /// The largest message the decider accepts and sends.
    pub messages: platform::runtime::MessageLimits,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_nodes: DEFAULT_MAX_NODES,
            messages: platform::runtime::MessageLimits::default(),
        }
    }
}

/// Why a `Decide` call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The first message was not a header.
    #[error("the first message must be a `header`, got {got}")]
    NoHeader { got: &'static str },
    #[error("`header` was sent twice; a call carries exactly one")]
    SecondHeader,
    #[error("`part` is required: each message is a `header`, `nodes`, `slots`, `slot_ranges` or `end`")]
    NoPart,
    /// A field failed to decode; the error names its path in the call
    /// (`header.desired.groups[0].id`, `nodes[3].node_id`, `slots.group_id`,
    /// `slot_ranges.bounds[3]`).
    #[error(transparent)]
    Field(#[from] FieldError),
    #[error("the request stream ended before `end`")]
    NoEnd,
    #[error("the call carries {count} {what}; the limit is {limit}")]
    TooMany {
        what: &'static str,
        count: u64,
        limit: u32,
    },
    /// Reading the request stream failed (the client reset it, or sent bytes
    /// that are not a `DecideRequest`).
    #[error("reading the request stream failed: {}", .0.message())]
    Receive(Status),
    /// The client stopped reading the responses; there is no one to tell.
    #[error("the client went away")]
    ClientGone,
}

/// The one mapping from a failed call to the status the client sees.
pub fn to_status(e: &CallError) -> Status {
    match e {
        CallError::NoHeader { .. }
        | CallError::SecondHeader
        | CallError::NoPart
        | CallError::Field(_)
        | CallError::NoEnd => Status::invalid_argument(e.to_string()),
        CallError::TooMany { .. } => Status::resource_exhausted(e.to_string()),
        // The receive error already carries the code that describes it (for
        // example a message over the decoding limit, or a cancelled stream).
        CallError::Receive(s) => Status::new(s.code(), e.to_string()),
        CallError::ClientGone => Status::cancelled(e.to_string()),
    }
}

/// The `Decider` service. Stateless: every call stands alone.
#[derive(Debug, Clone, Default)]
pub struct DeciderService {
    config: Config,
    metrics: DeciderMetrics,
}

impl DeciderService {
    pub fn new(config: Config) -> Self {
        Self {
            config,
            metrics: DeciderMetrics::default(),
        }
    }
}

/// The decider's metrics (docs/observability.md, "Metrics"), in the process-wide
/// registry.
#[derive(Debug, Clone)]
pub struct DeciderMetrics {
    decisions: platform::metrics::Counter,
    nodes: platform::metrics::Counter,
}

impl Default for DeciderMetrics {
    fn default() -> Self {
        let r = platform::metrics::global();
        Self {
            decisions: r.counter(
                "provisioning_decider_decisions_total",
                "Decisions made, by ladder rule and action (waits included).",
                &["rule", "action"],
            ),
            nodes: r.counter(
                "provisioning_decider_nodes_total",
                "Nodes decided (inserts for missing slots not included).",
                &[],
            ),
        }
    }
}

/// Decisions of one call counted locally and added once, so a 100,000-node
/// call takes the registry's lock a few times, not 100,000 times.
#[derive(Default)]
struct Tally(std::collections::BTreeMap<(u32, &'static str), u64>);

impl Tally {
    fn count(&mut self, d: &contract::Decision) {
        *self.0.entry((d.rule.number(), d.action.name())).or_default() += 1;
    }

    fn add_to(self, metrics: &DeciderMetrics) {
        for ((rule, action), n) in self.0 {
            metrics.decisions.add(&[&rule.to_string(), action], n);
        }
    }
}

impl DeciderService {
    /// Answers one `Decide` call: its task is spawned, and the response
    /// streams what it sends, each message already encoded.
    pub(crate) fn decide(
        &self,
        request: Request<Streaming<Incoming>>,
    ) -> Response<ReceiverStream<Result<Bytes, Status>>> {
        let mut requests = request.into_inner();
        let (tx, rx) = mpsc::channel(RESPONSE_BUFFER);
        let config = self.config;
        let metrics = self.metrics.clone();
        // The call's server span (opened by the tracing layer under the
        // driver's client span) follows the task that answers the call, so the
        // decisions and their log lines belong to the driver's pass.
        let span = tracing::Span::current();
        tokio::spawn(
            async move {
                let out = Responses(tx);
                match serve_call(&mut requests, &out, config, &metrics).await {
                    Ok(summary) => {
                        let span = tracing::Span::current();
                        telemetry::set_attribute(
                            &span,
                            "provisioning.decide.nodes",
                            i64::from(summary.decided_nodes),
                        );
                        telemetry::set_attribute(
                            &span,
                            "provisioning.decide.inserts",
                            i64::from(summary.inserts),
                        );
                        tracing::debug!(
                            decided = summary.decided_nodes,
                            inserts = summary.inserts,
                            "decided"
                        );
                    }
                    Err(CallError::ClientGone) => tracing::debug!("the client went away mid-call"),
                    Err(e) => {
                        tracing::info!(error = %e, "decide call refused");
                        // If the client is already gone, no one is left to tell.
                        let _ = out.0.send(Err(to_status(&e))).await;
                    }
                }
            }
            .instrument(span),
        );
        let mut response = Response::new(ReceiverStream::new(rx));
        response.metadata_mut().insert(
            SLOT_RANGES_HEADER,
            tonic::metadata::MetadataValue::from_static("1"),
        );
        response
    }
}

/// The sending half of a call's response stream: each message encoded.
struct Responses(mpsc::Sender<Result<Bytes, Status>>);

impl Responses {
    async fn send(&self, part: pb::decide_response::Part) -> Result<(), CallError> {
        let message = DecideResponse { part: Some(part) }.encode_to_vec();
        self.send_encoded(Bytes::from(message)).await
    }

    async fn send_encoded(&self, message: Bytes) -> Result<(), CallError> {
        self.0.send(Ok(message)).await.map_err(|_| CallError::ClientGone)
    }
}

/// Decisions waiting to be sent, cut into batches by count and by size: a
/// `DecisionBatch`'s repeated field, written as each decision is made.
struct Batcher<'a> {
    out: &'a Responses,
    batch: Vec<u8>,
    count: usize,
    decision: Vec<u8>,
}

impl<'a> Batcher<'a> {
    fn new(out: &'a Responses) -> Self {
        Self {
            out,
            batch: Vec::new(),
            count: 0,
            decision: Vec::new(),
        }
    }

    async fn push(&mut self, d: &contract::Decision) -> Result<(), CallError> {
        self.decision.clear();
        encode_decision(d, &mut self.decision);
        put_message(&mut self.batch, 1, &self.decision);
        self.count += 1;
        if self.count >= MAX_BATCH || self.batch.len() >= MAX_BATCH_BYTES {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), CallError> {
        if self.count == 0 {
            return Ok(());
        }
        // The `DecideResponse` whose `decisions` part (field 1) is the batch.
        let mut message = Vec::with_capacity(message_len(1, self.batch.len()));
        put_message(&mut message, 1, &self.batch);
        self.batch.clear();
        self.count = 0;
        self.out.send_encoded(Bytes::from(message)).await
    }
}

/// A message's part, as the call reads it.
enum CallPart {
    /// A second header (the first is read on its own).
    Header,
    Nodes(Nodes),
    Slots(pb::SlotBatch),
    SlotRanges(pb::SlotRanges),
    End,
}

/// A `nodes` part: as ranges of its message (each node decoded when its
/// turn comes, [`NodeScratch`]), or already decoded.
enum Nodes {
    Ranges(NodeRanges),
    Decoded(Vec<pb::NodeState>),
}

impl Nodes {
    fn len(&self) -> usize {
        match self {
            Nodes::Ranges(r) => r.len(),
            Nodes::Decoded(v) => v.len(),
        }
    }

    /// The `i`th node, decoded into `scratch` if it is not yet. A node that
    /// does not decode fails the call as a message that does not decode does
    /// (tonic's `INTERNAL`).
    fn get<'a>(
        &'a self,
        i: usize,
        scratch: &'a mut NodeScratch,
    ) -> Result<Option<&'a pb::NodeState>, CallError> {
        match self {
            Nodes::Ranges(r) => match r.get(i) {
                None => Ok(None),
                Some(body) => scratch
                    .read(body)
                    .map(Some)
                    .map_err(|e| CallError::Receive(Status::internal(e.to_string()))),
            },
            Nodes::Decoded(v) => Ok(v.get(i)),
        }
    }
}

impl From<IncomingPart> for CallPart {
    fn from(p: IncomingPart) -> Self {
        match p {
            IncomingPart::Nodes(r) => CallPart::Nodes(Nodes::Ranges(r)),
            IncomingPart::Other(Part::Nodes(b)) => CallPart::Nodes(Nodes::Decoded(b.nodes)),
            IncomingPart::Other(Part::Header(_)) => CallPart::Header,
            IncomingPart::Other(Part::Slots(b)) => CallPart::Slots(b),
            IncomingPart::Other(Part::SlotRanges(b)) => CallPart::SlotRanges(b),
            IncomingPart::Other(Part::End(_)) => CallPart::End,
        }
    }
}

/// The next message's part; `None` when the client closed its stream.
async fn next_part(requests: &mut Streaming<Incoming>) -> Result<Option<CallPart>, CallError> {
    match requests.message().await.map_err(CallError::Receive)? {
        None => Ok(None),
        Some(Incoming { part: None }) => Err(CallError::NoPart),
        Some(Incoming { part: Some(part) }) => Ok(Some(part.into())),
    }
}

/// How a refusal names what arrived instead of the header.
fn part_name(part: Option<&CallPart>) -> &'static str {
    match part {
        None => "the end of the stream",
        Some(CallPart::Header) => "`header`",
        Some(CallPart::Nodes(_)) => "`nodes`",
        Some(CallPart::Slots(_)) => "`slots`",
        Some(CallPart::SlotRanges(_)) => "`slot_ranges`",
        Some(CallPart::End) => "`end`",
    }
}

/// Checks that adding `adding` items to `so_far` stays within `limit`.
fn within_limit(what: &'static str, so_far: u32, adding: usize, limit: u32) -> Result<u32, CallError> {
    let count = u64::from(so_far).saturating_add(u64::try_from(adding).unwrap_or(u64::MAX));
    match u32::try_from(count) {
        Ok(c) if c <= limit => Ok(c),
        _ => Err(CallError::TooMany { what, count, limit }),
    }
}

/// One whole call; returns the summary it sent.
async fn serve_call(
    requests: &mut Streaming<Incoming>,
    out: &Responses,
    config: Config,
    metrics: &DeciderMetrics,
) -> Result<pb::DecideSummary, CallError> {
    // The header is read by hand rather than through `next_part`, because its
    // message also carries the call's trace context.
    let header = match requests.message().await.map_err(CallError::Receive)? {
        Some(Incoming {
            part: Some(IncomingPart::Other(Part::Header(h))),
        }) => h,
        Some(Incoming { part: None }) => {
            return Err(CallError::NoHeader {
                got: "a message with no part",
            });
        }
        other => {
            let part = other.and_then(|m| m.part).map(CallPart::from);
            return Err(CallError::NoHeader {
                got: part_name(part.as_ref()),
            });
        }
    };
    let templates = TemplateTable::from_wire(header.templates).map_err(|e| e.within("header"))?;
    let shape = shape_from_wire_with_table(header.desired, &header.group_template_refs, &templates)
        .map_err(|e| e.within("header"))?;
    let now = UnixMillis::new(header.now_ms);
    let deleting = header.deleting;
    let mut counts = Vec::with_capacity(header.group_counts.len());
    for (i, c) in header.group_counts.into_iter().enumerate() {
        let group = GroupId::parse("group_id", &c.group_id)
            .map_err(|e| e.within(&format!("header.group_counts[{i}]")))?;
        counts.push((
            group,
            GroupCounts {
                unhealthy: c.unhealthy,
                remediating: c.remediating,
                available: c.available,
                updated: c.updated,
                canary_done: c.canary_done,
                halted: c.halted,
                surging: c.surging,
            },
        ));
    }
    // The call's trace context arrives in its metadata (the tracing layer
    // has already made the span its child); the copy in each message is for
    // tools reading a recorded stream, so it is not consulted here.
    telemetry::set_attribute(
        &tracing::Span::current(),
        "provisioning.run.id",
        shape.run_id.to_string(),
    );

    // Inserts are generated from the shape at `end`, so a shape with absurd
    // counts would make this call stream without bound: refuse it up front.
    if !deleting {
        let total = shape.total_nodes();
        if total > u64::from(config.max_nodes) {
            return Err(CallError::TooMany {
                what: "desired slots",
                count: total,
                limit: config.max_nodes,
            });
        }
    }

    // The nodes' ids share the shape's group ids.
    let mut groups = GroupInterner::with(shape.groups.iter().map(|g| g.id.clone()));
    let desired = DesiredView::new(&shape, deleting).with_counts(counts);
    let mut budgets = Budgets::new();
    let mut batcher = Batcher::new(out);
    let mut slots = SlotSet::new();
    let mut decided: u32 = 0;
    let mut slot_count: u32 = 0;
    let mut requeue_at = None;
    let mut tally = Tally::default();
    // Every decision of the call, for the event trace (only when it is on).
    let mut traced: Option<Vec<DecisionRec>> = event_trace::get().map(|_| Vec::new());
    // One decoded node at a time, its strings' buffers used again.
    let mut scratch = NodeScratch::default();
    loop {
        match next_part(requests).await? {
            None => return Err(CallError::NoEnd),
            Some(CallPart::Header) => return Err(CallError::SecondHeader),
            Some(CallPart::Nodes(batch)) => {
                within_limit("nodes", decided, batch.len(), config.max_nodes)?;
                for i in 0..batch.len() {
                    let Some(wire) = batch.get(i, &mut scratch)? else {
                        break;
                    };
                    // The index counts nodes across the whole call, so it names
                    // one node even though the client chose the batch boundaries.
                    let node = node_from_wire_ref(wire, &templates, &mut groups)
                        .map_err(|e| e.within(&format!("nodes[{decided}]")))?;
                    // A node due for remediation is answered at `end`, once
                    // the budget has seen every such node of the call.
                    let Some(d) = decider::decide_or_defer(&desired, &node, now, &mut budgets) else {
                        decided += 1;
                        continue;
                    };
                    requeue_at = decider::fold_requeue(requeue_at, &d, now);
                    tally.count(&d);
                    if let Some(t) = &mut traced {
                        t.push(DecisionRec::of(&d));
                    }
                    batcher.push(&d).await?;
                    decided += 1;
                }
                // Flushing here rather than waiting to fill a batch keeps the
                // answer flowing while the client is still sending, so neither
                // side holds more than a batch of it.
                batcher.flush().await?;
            }
            Some(CallPart::Slots(batch)) => {
                let group = groups.group("slots.group_id", &batch.group_id)?;
                slot_count = within_limit("slot indices", slot_count, batch.indices.len(), config.max_nodes)?;
                for index in batch.indices {
                    slots.insert_index(&group, index);
                }
            }
            Some(CallPart::SlotRanges(batch)) => {
                let group = groups.group("slot_ranges.group_id", &batch.group_id)?;
                let ranges =
                    wire::slot_ranges_from_wire(&batch.bounds).map_err(|e| e.within("slot_ranges"))?;
                // Each range counts as the slots it covers, as indices would.
                for (start, end) in ranges {
                    slot_count = within_limit(
                        "slot indices",
                        slot_count,
                        (end - start) as usize,
                        config.max_nodes,
                    )?;
                    slots.insert_range(&group, start, end);
                }
            }
            Some(CallPart::End) => break,
        }
    }

    for d in budgets.settle(&desired, now) {
        tally.count(&d);
        if let Some(t) = &mut traced {
            t.push(DecisionRec::of(&d));
        }
        batcher.push(&d).await?;
    }
    slots.finish();
    let mut inserts: u32 = 0;
    for d in decider::inserts(&desired, &slots) {
        tally.count(&d);
        if let Some(t) = &mut traced {
            t.push(DecisionRec::of(&d));
        }
        batcher.push(&d).await?;
        inserts += 1;
    }
    metrics.nodes.add(&[], u64::from(decided));
    tally.add_to(metrics);
    batcher.flush().await?;
    let summary = pb::DecideSummary {
        requeue_at_ms: UnixMillis::to_wire(requeue_at),
        decided_nodes: decided,
        inserts,
    };
    if let Some(decisions) = traced {
        event_trace::emit(|| TraceEvent::Decide {
            run_id: shape.run_id.to_string(),
            now_ms: now.as_millis(),
            generation: shape.generation.get(),
            deleting,
            nodes: decided,
            inserts,
            decisions,
        });
    }
    out.send(pb::decide_response::Part::Summary(summary)).await?;
    Ok(summary)
}

/// What can stop the decider's server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot set up gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("cannot set up TLS: {0}")]
    Tls(#[from] platform::tls::TlsError),
    #[error("the gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves the `Decider` service, standard gRPC health checking (the decider
/// reported `SERVING` until `shutdown` resolves) and server reflection on
/// `listener` in plaintext, until `shutdown` resolves and the calls in flight
/// finish. For a decider embedded in a test; the binary uses [`serve`].
pub async fn run(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    config: Config,
) -> Result<(), ServerError> {
    serve(listener, shutdown, config, &PeerPolicy::plaintext()).await
}

/// As [`run`], secured by `policy`: with TLS, only a client whose certificate
/// carries an allowed identity (the driver's) gets past health checks.
pub async fn serve(
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
    config: Config,
    policy: &PeerPolicy,
) -> Result<(), ServerError> {
    let incoming = policy.incoming(listener)?;
    let (reporter, health, reflection, reflection_alpha) = health_and_reflection::<DeciderServer>().await?;
    let shutdown = async move {
        shutdown.await;
        // Health checkers see the decider leave before its port closes.
        reporter.set_not_serving::<DeciderServer>().await;
    };
    let router = platform::runtime::server()
        .layer(ServerLayer::new())
        .layer(policy.layer())
        .add_service(health)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(
            DeciderServer::new(DeciderService::new(config))
                .max_decoding_message_size(config.messages.recv_bytes())
                .max_encoding_message_size(config.messages.send_bytes()),
        );
    platform::tls::serve(router, incoming, shutdown).await?;
    Ok(())
}
