//! Calling a remote decider: what the driver uses in place of an in-process
//! [`decider::decide`].
//!
//! [`encode_call`] is pure, so the driver can build a pass's call while it
//! holds its state and send it after letting go; [`decide_call`] streams it and
//! collects the answer. Every message is bounded in size whatever the run's
//! size: node batches by count and by encoded bytes, slot batches by count, and
//! templates travel once, in the header's table.
//!
//! The run's slots go last, as ranges to a decider whose response headers say
//! it reads them ([`SLOT_RANGES_HEADER`]) and as indices otherwise, so a pass
//! over a run without gaps sends a few numbers for its slots, not one per node,
//! and a decider that predates ranges still gets a call it reads.
//! [`encode_request`] and [`decide`] are the fixed form (indices, sent as
//! built), for tools and tests that look at the messages themselves.

use contract::{
    ClusterShape, DecideOutput, FieldError, GroupCounts, GroupId, GroupInterner, ManagedNode, Problem,
    TraceContext, UnixMillis,
    pb::{self, decide_request::Part, decider_client::DeciderClient},
    wire::{
        TemplateTable,
        answer::Answer,
        encode::{encode_node, message_len, put_message},
        shape_to_wire_with_table, slot_ranges_to_wire, trace_to_wire,
    },
};
use decider::{SlotRange, SlotSet};
use prost::Message as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{
    Code, Status,
    codegen::{Body, Bytes, GrpcMethod, StdError, http::uri::PathAndQuery},
};

use crate::server::SLOT_RANGES_HEADER;

/// The most nodes in one `NodeBatch`.
pub const NODE_BATCH: usize = 1024;

/// A node batch is also cut before its encoded size passes this, because a
/// node's failure reasons are free text and 1024 long ones could otherwise
/// pass the decider's 4 MiB decoding limit.
pub const NODE_BATCH_BYTES: usize = 1 << 20;

/// The most slot indices in one `SlotBatch`, and the most bounds in one
/// `SlotRanges` (at most 5 bytes each, packed).
pub const SLOT_BATCH: usize = 65_536;

/// A run with at most this many slots sends them as indices without waiting
/// for the decider's headers: a few kilobytes, against a round trip. Above
/// it, every pass of a run that holds its slots without gaps would send
/// them all again (a hundred runs of 10,000, each pass sending its 10,000
/// indices, spent a third of the decider's CPU decoding them).
pub const EAGER_SLOTS: usize = 4_096;

/// How a call sends the run's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotEncoding {
    /// `SlotBatch` indices, one per slot: what every decider reads.
    Indices,
    /// `SlotRanges` for a group whose ranges take fewer numbers than its
    /// indices, indices for the others: only for a decider that reads ranges.
    Ranges,
}

/// One pass's `Decide` call: the header and node batches encoded (as the
/// bytes of their `DecideRequest`s), the slots kept until the decider has said
/// which form it reads.
#[derive(Debug, Clone)]
pub struct DecideCall {
    head: Vec<Bytes>,
    nodes: usize,
    slots: SlotSet,
    trace: Option<pb::TraceContext>,
}

impl DecideCall {
    /// The whole request stream, encoded, with the slots in `encoding`.
    pub fn into_encoded(self, encoding: SlotEncoding) -> Vec<Bytes> {
        let mut messages = self.head;
        messages.extend(
            slot_messages(&self.slots, encoding, &self.trace)
                .into_iter()
                .chain([message(&self.trace, Part::End(pb::DecideEnd {}))])
                .map(|m| Bytes::from(m.encode_to_vec())),
        );
        messages
    }

    /// The whole request stream as messages, with the slots in `encoding`:
    /// for tools and tests that look at the messages themselves.
    pub fn into_messages(self, encoding: SlotEncoding) -> Vec<pb::DecideRequest> {
        self.into_encoded(encoding)
            .iter()
            .map(|m| {
                // The bytes are `encode_call`'s own, which the contract's tests
                // hold to what prost decodes; were one not to decode, it would
                // become a message with no part, which a decider refuses.
                pb::DecideRequest::decode(m.as_ref()).unwrap_or_default()
            })
            .collect()
    }

    /// The nodes the call carries.
    pub fn nodes(&self) -> usize {
        self.nodes
    }
}

fn message(trace: &Option<pb::TraceContext>, part: Part) -> pb::DecideRequest {
    pb::DecideRequest {
        part: Some(part),
        trace: trace.clone(),
    }
}

/// The slot messages of a call: groups in id order, each cut into batches of
/// at most [`SLOT_BATCH`] numbers.
fn slot_messages(
    slots: &SlotSet,
    encoding: SlotEncoding,
    trace: &Option<pb::TraceContext>,
) -> Vec<pb::DecideRequest> {
    let mut groups: Vec<_> = slots.iter_groups().collect();
    groups.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let mut out = Vec::new();
    for (group, ranges) in groups {
        let held: usize = ranges.iter().map(|r| (r.end - r.start) as usize).sum();
        if encoding == SlotEncoding::Ranges && 2 * ranges.len() < held {
            for chunk in ranges.chunks(SLOT_BATCH / 2) {
                out.push(message(
                    trace,
                    Part::SlotRanges(pb::SlotRanges {
                        group_id: group.as_str().to_owned(),
                        bounds: slot_ranges_to_wire(
                            chunk.iter().map(|&SlotRange { start, end }| (start, end)),
                        ),
                    }),
                ));
            }
        } else {
            let mut indices = ranges.iter().flat_map(|r| r.start..r.end).peekable();
            while indices.peek().is_some() {
                out.push(message(
                    trace,
                    Part::Slots(pb::SlotBatch {
                        group_id: group.as_str().to_owned(),
                        indices: indices.by_ref().take(SLOT_BATCH).collect(),
                    }),
                ));
            }
        }
    }
    out
}

/// Why a remote decide failed.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The decider could not be reached or did not finish its answer; a later
    /// pass may succeed. Transport errors, `UNAVAILABLE`, `DEADLINE_EXCEEDED`,
    /// and a response stream that ends without a summary land here.
    #[error("the decider is unavailable: {}: {}", .0.code(), .0.message())]
    Unavailable(Status),
    /// The decider refused the input (`INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED`
    /// and the like): sending the same input again gets the same answer.
    #[error("the decider rejected the request: {}: {}", .0.code(), .0.message())]
    Rejected(Status),
    /// The decider sent a decision that does not decode; the field path starts
    /// at the decision's index in the whole answer (`decisions[7].rule`).
    #[error("the decider sent an undecodable decision: {0}")]
    Decode(FieldError),
}

impl DecideError {
    /// Sorts a status from the call into refused input and everything else.
    /// Only codes that say "this input is wrong or too big for this decider"
    /// are rejections; every other code (including `UNKNOWN` and `INTERNAL`,
    /// which is what a broken connection often surfaces as) is treated as the
    /// decider being unavailable, so the driver retries instead of giving up.
    pub fn from_status(status: Status) -> Self {
        match status.code() {
            Code::InvalidArgument
            | Code::ResourceExhausted
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::Unimplemented
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::NotFound
            | Code::AlreadyExists => DecideError::Rejected(status),
            _ => DecideError::Unavailable(status),
        }
    }
}

/// The request messages for one pass: a header, node batches, slot batches,
/// then `end`, each carrying `trace`.
///
/// The header's template table holds every distinct template among the
/// shape's groups and the nodes' specs (including the specs a permanent
/// failure names), so a template shared by many nodes is encoded once. `slots`
/// must hold every slot the run has, not only `nodes`, as for
/// [`decider::decide`]; its groups are sent in id order.
pub fn encode_request<'a>(
    shape: &ClusterShape,
    deleting: bool,
    nodes: impl IntoIterator<Item = &'a ManagedNode>,
    slots: &SlotSet,
    now: UnixMillis,
    trace: &TraceContext,
) -> Vec<pb::DecideRequest> {
    encode_request_with_counts(shape, deleting, nodes, slots, &[], now, trace)
}

/// [`encode_request`] with each group's day-2 counts over the whole run
/// ([`GroupCounts`]), which the remediation budget needs when `nodes` is only
/// part of the run.
pub fn encode_request_with_counts<'a>(
    shape: &ClusterShape,
    deleting: bool,
    nodes: impl IntoIterator<Item = &'a ManagedNode>,
    slots: &SlotSet,
    counts: &[(GroupId, GroupCounts)],
    now: UnixMillis,
    trace: &TraceContext,
) -> Vec<pb::DecideRequest> {
    encode_call(shape, deleting, nodes, slots.clone(), counts, now, trace)
        .into_messages(SlotEncoding::Indices)
}

/// A pass's call for [`decide_call`]: the header (with each group's day-2
/// counts over the whole run, [`GroupCounts`], which the remediation budget
/// needs when `nodes` is only part of the run) and the node batches encoded,
/// and `slots`, every slot the run has (finished), kept for the decider's
/// answer on ranges.
pub fn encode_call<'a>(
    shape: &ClusterShape,
    deleting: bool,
    nodes: impl IntoIterator<Item = &'a ManagedNode>,
    slots: SlotSet,
    counts: &[(GroupId, GroupCounts)],
    now: UnixMillis,
    trace: &TraceContext,
) -> DecideCall {
    let trace = trace_to_wire(trace);

    // The shape is interned first so that its templates get the first indices;
    // the header itself is built last, once the nodes have added theirs.
    let mut table = TemplateTable::default();
    let (desired, group_template_refs) = shape_to_wire_with_table(shape, &mut table);

    // Each node is written straight into its batch's bytes (no `NodeState`
    // is built), and a batch is wrapped into its `DecideRequest` once cut.
    let trace_bytes = trace.as_ref().map(prost::Message::encode_to_vec);
    let mut body = Vec::new();
    let mut batch = NodeBatchBytes::default();
    let mut node_bytes = Vec::new();
    let mut sent = 0;
    for node in nodes {
        node_bytes.clear();
        encode_node(node, &mut table, &mut node_bytes);
        let len = message_len(1, node_bytes.len());
        if batch.count > 0 && (batch.count >= NODE_BATCH || batch.bytes.len() + len > NODE_BATCH_BYTES) {
            body.push(batch.into_message(trace_bytes.as_deref()));
            batch = NodeBatchBytes::default();
        }
        put_message(&mut batch.bytes, 1, &node_bytes);
        batch.count += 1;
        sent += 1;
    }
    if batch.count > 0 {
        body.push(batch.into_message(trace_bytes.as_deref()));
    }

    let header = message(
        &trace,
        Part::Header(pb::DecideHeader {
            desired: Some(desired),
            now_ms: now.as_millis(),
            templates: table.into_wire(),
            group_template_refs,
            deleting,
            group_counts: counts
                .iter()
                .filter(|(_, c)| *c != GroupCounts::default())
                .map(|(g, c)| pb::GroupCounts {
                    group_id: g.as_str().to_owned(),
                    unhealthy: c.unhealthy,
                    remediating: c.remediating,
                    available: c.available,
                    updated: c.updated,
                    canary_done: c.canary_done,
                    halted: c.halted,
                    surging: c.surging,
                })
                .collect(),
        }),
    );
    let mut head = Vec::with_capacity(body.len() + 1);
    head.push(Bytes::from(header.encode_to_vec()));
    head.extend(body);
    DecideCall {
        head,
        nodes: sent,
        slots,
        trace,
    }
}

/// One `NodeBatch`'s repeated `nodes` field, as bytes.
#[derive(Default)]
struct NodeBatchBytes {
    bytes: Vec<u8>,
    count: usize,
}

impl NodeBatchBytes {
    /// The `DecideRequest` carrying the batch (field `nodes`, 2) and the
    /// call's trace context (field `trace`, 15), encoded.
    fn into_message(self, trace: Option<&[u8]>) -> Bytes {
        let trace_len = trace.map_or(0, |t| message_len(15, t.len()));
        let mut out = Vec::with_capacity(message_len(2, self.bytes.len()) + trace_len);
        put_message(&mut out, 2, &self.bytes);
        if let Some(t) = trace {
            put_message(&mut out, 15, t);
        }
        Bytes::from(out)
    }
}

/// The driver's way to deciders: the transport the generated client would
/// wrap (a plain `Channel`, or the driver's balanced channel with the tracing
/// layer) and its message limits, sending a call's requests as the bytes
/// [`encode_call`] wrote rather than encoding them again.
#[derive(Debug, Clone)]
pub struct DeciderChannel<T> {
    grpc: tonic::client::Grpc<T>,
}

impl<T> DeciderChannel<T>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<StdError>,
    T::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as Body>::Error: Into<StdError> + Send,
{
    pub fn new(inner: T) -> Self {
        Self {
            grpc: tonic::client::Grpc::new(inner),
        }
    }

    /// The largest response message accepted (tonic's default: 4 MiB).
    pub fn max_decoding_message_size(mut self, limit: usize) -> Self {
        self.grpc = self.grpc.max_decoding_message_size(limit);
        self
    }

    /// The largest request message sent.
    pub fn max_encoding_message_size(mut self, limit: usize) -> Self {
        self.grpc = self.grpc.max_encoding_message_size(limit);
        self
    }

    /// Opens a `Decide` call streaming `requests`, each an encoded
    /// `DecideRequest`: what the generated client's `decide` does, with the
    /// messages already encoded.
    async fn decide(
        &mut self,
        requests: impl tokio_stream::Stream<Item = Bytes> + Send + 'static,
    ) -> Result<tonic::Response<tonic::Streaming<Answer>>, Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unknown(format!("Service was not ready: {}", e.into())))?;
        let mut request = tonic::Request::new(requests);
        request
            .extensions_mut()
            .insert(GrpcMethod::new("provisioning.internal.v1.Decider", "Decide"));
        let path = PathAndQuery::from_static("/provisioning.internal.v1.Decider/Decide");
        self.grpc
            .streaming(request, path, crate::codec::Encoded::<Answer>::default())
            .await
    }
}

/// Sends a pass's call to the decider and collects its answer, as [`decide`]
/// does. The header and node batches go at once; the slots go once the
/// decider's response headers have arrived, as ranges if they carry
/// [`SLOT_RANGES_HEADER`] and as indices otherwise. A run with at most
/// [`EAGER_SLOTS`] slots sends them as indices at once. Returns the
/// form used with the answer.
pub async fn decide_call<T>(
    client: &mut DeciderChannel<T>,
    call: DecideCall,
) -> Result<(DecideOutput, SlotEncoding), DecideError>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<StdError>,
    T::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as Body>::Error: Into<StdError> + Send,
{
    let nodes_sent = call.nodes;
    if call.slots.len() <= EAGER_SLOTS {
        let responses = client
            .decide(tokio_stream::iter(call.into_encoded(SlotEncoding::Indices)))
            .await
            .map_err(DecideError::from_status)?
            .into_inner();
        let out = collect(responses, nodes_sent).await?;
        return Ok((out, SlotEncoding::Indices));
    }
    let DecideCall {
        head, slots, trace, ..
    } = call;
    let (tx, rx) = mpsc::unbounded_channel();
    for m in head {
        // The receiver is the request stream below, alive until the call ends.
        let _ = tx.send(m);
    }
    let response = client
        .decide(UnboundedReceiverStream::new(rx))
        .await
        .map_err(DecideError::from_status)?;
    let encoding = if response
        .metadata()
        .get(SLOT_RANGES_HEADER)
        .is_some_and(|v| v.as_bytes() == b"1")
    {
        SlotEncoding::Ranges
    } else {
        SlotEncoding::Indices
    };
    for m in slot_messages(&slots, encoding, &trace) {
        let _ = tx.send(Bytes::from(m.encode_to_vec()));
    }
    let _ = tx.send(Bytes::from(
        message(&trace, Part::End(pb::DecideEnd {})).encode_to_vec(),
    ));
    drop(tx);
    let out = collect(response.into_inner(), nodes_sent).await?;
    Ok((out, encoding))
}

fn nodes_in(requests: &[pb::DecideRequest]) -> usize {
    requests
        .iter()
        .map(|r| match &r.part {
            Some(Part::Nodes(b)) => b.nodes.len(),
            _ => 0,
        })
        .sum()
}

/// Sends `requests` (from [`encode_request`]) to the decider and collects its
/// answer: the decisions in the order they arrive (the nodes' in the order
/// sent, then the inserts) and `requeue_at` from the summary.
///
/// The summary's counts are checked against the decisions received and the
/// nodes sent, so an answer that lost a batch is never taken for a whole one.
///
/// Any transport the generated client accepts works: a plain `Channel`, or
/// the driver's channel with the tracing layer, whose client span is the
/// `Decide` call's span on the driver's side.
pub async fn decide<T>(
    client: &mut DeciderClient<T>,
    requests: Vec<pb::DecideRequest>,
) -> Result<DecideOutput, DecideError>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<StdError>,
    T::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as Body>::Error: Into<StdError> + Send,
{
    let nodes_sent = nodes_in(&requests);
    let responses = client
        .decide(tokio_stream::iter(requests))
        .await
        .map_err(DecideError::from_status)?
        .into_inner();
    collect(responses, nodes_sent).await
}

/// Reads a call's answer: the decisions in the order they arrive, checked
/// against the summary and the nodes sent.
async fn collect<A: Into<Answer>>(
    mut responses: tonic::Streaming<A>,
    nodes_sent: usize,
) -> Result<DecideOutput, DecideError> {
    let mut out = DecideOutput::default();
    // The decisions' node ids share one group id per group.
    let mut groups = GroupInterner::default();
    loop {
        let Some(response) = responses.message().await.map_err(DecideError::from_status)? else {
            return Err(DecideError::Unavailable(Status::unavailable(
                "the decider's response stream ended without a summary",
            )));
        };
        match response.into() {
            Answer::Decisions(batch) => {
                out.decisions.reserve(batch.len());
                for k in 0..batch.len() {
                    let i = out.decisions.len();
                    let Some(d) = batch.decision(k, &mut groups) else {
                        break;
                    };
                    let d = d.map_err(|e| DecideError::Decode(e.within(&format!("decisions[{i}]"))))?;
                    out.decisions.push(d);
                }
            }
            Answer::Summary(summary) => {
                let announced = u64::from(summary.decided_nodes) + u64::from(summary.inserts);
                let received = u64::try_from(out.decisions.len()).unwrap_or(u64::MAX);
                let sent = u64::try_from(nodes_sent).unwrap_or(u64::MAX);
                if announced != received || u64::from(summary.decided_nodes) != sent {
                    return Err(DecideError::Unavailable(Status::data_loss(format!(
                        "the decider's summary announces {} node decisions and {} inserts, but {received} \
                         decisions arrived for {sent} nodes sent",
                        summary.decided_nodes, summary.inserts
                    ))));
                }
                out.requeue_at = UnixMillis::from_wire(summary.requeue_at_ms);
                // The summary is the last message; reading on to the trailers
                // ends the call cleanly (dropping the stream here would cancel
                // it), and its status is what the call's span records. The
                // answer is complete either way, so a failure here is ignored.
                let _ = responses.trailers().await;
                return Ok(out);
            }
            Answer::None => return Err(DecideError::Decode(FieldError::new("part", Problem::Missing))),
        }
    }
}
