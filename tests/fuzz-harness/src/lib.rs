//! Entry points for fuzzing what the services read from the network, shared by
//! the fuzz targets in `fuzz/` and by the test that replays their corpus
//! (`tests/tests/fuzz_corpus.rs`). A crate of its own, so no service ships it.
//!
//! Each entry point takes arbitrary bytes, decodes them as one kind of message
//! a service receives, and puts the result through the conversion and
//! validation that service runs on it:
//!
//! | entry point          | input                                  | served by |
//! |----------------------|----------------------------------------|-----------|
//! | [`apply_request`]    | `ApplyRequest`                         | the driver's `Apply`: [`shape_from_wire`], then [`ClusterShape::validate`] with the default [`ShapeLimits`] |
//! | [`plan_request`]     | `PlanRequest`                          | the driver's `Plan`, the same way |
//! | [`run_request`]      | a selector byte, then one of [`RUN_REQUESTS`] | the driver's other methods: the run id, and for `ExplainNode` and `AbandonNode` the node id, for `ListNodes` its page token (a node id) |
//! | [`decide_call`]      | length-delimited `DecideRequest`s      | the decider's `Decide` stream: header, template table, node and slot batches, `end`; then the ladder |
//! | [`driver_message`]   | `DriverMessage`                        | the executor's link: claims, operations, acknowledgements, replay cursors, forgets |
//! | [`executor_message`] | `ExecutorMessage`                      | the driver's link: claim acceptances, results, observations, rejections |
//! | [`shape_validation`] | bytes that build a domain shape and limits | [`ClusterShape::validate`] and the shape's wire mappings |
//!
//! An entry point never panics, whatever its input: a panic is a bug in the
//! code under test. It returns what the service would make of the input
//! ([`Verdict`]), or a [`Violation`] when a property the contract promises does
//! not hold for it: a message that changes when re-encoded, a decode that loses
//! or invents data, a domain value that does not survive the wire, a refusal
//! that names no field, validation that disagrees with the rules it documents.
//! A violation is a bug as well; the fuzz targets panic on one so that the
//! fuzzer keeps the input.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt,
    sync::Arc,
};

use prost::Message;

use contract::{
    Claim, ClusterShape, Decision, FieldError, GroupId, LogicalNodeId, ManagedNode, NodeGroup, NodeTemplate,
    Observation, Operation, OperationId, OperationResult, Param, Params, Problem, ProviderShape, Rejection,
    RunId, RunUid, SessionId, ShapeLimits, UnixMillis,
    decision::Action,
    ids::Generation,
    pb,
    shape::Accelerator,
    wire::{
        REDACTED, TemplateTable, node_from_wire, node_to_wire, redacted, shape_from_wire,
        shape_from_wire_with_table, shape_to_wire_redacted, shape_to_wire_with_table,
    },
};

/// What the receiving service would make of an input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The bytes are not a message of the expected type.
    Undecodable,
    /// The message decodes but the service refuses it, with this message.
    Refused(String),
    /// The service accepts it.
    Accepted,
}

/// A property that failed for an input: a bug in the code under test.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{target}: {what}")]
pub struct Violation {
    /// The entry point that found it.
    pub target: &'static str,
    pub what: String,
}

fn violation(target: &'static str, what: impl Into<String>) -> Violation {
    Violation {
        target,
        what: what.into(),
    }
}

/// A refusal, which must name the field it refuses.
fn refused(target: &'static str, e: &FieldError) -> Result<Verdict, Violation> {
    if e.field.is_empty() {
        return Err(violation(target, format!("a refusal names no field: {e}")));
    }
    Ok(Verdict::Refused(e.to_string()))
}

// ---------------------------------------------------------------------------
// Message-level checks
// ---------------------------------------------------------------------------

/// Visits the floating-point fields of a message, in a fixed order.
type Floats<M> = fn(&mut M, &mut dyn FnMut(&mut f64));

fn no_floats<M>(_: &mut M, _: &mut dyn FnMut(&mut f64)) {}

fn template_floats(t: &mut pb::NodeTemplate, f: &mut dyn FnMut(&mut f64)) {
    if let Some(p) = t.provider.as_mut() {
        f(&mut p.cpu);
        f(&mut p.memory_gib);
    }
}

fn shape_floats(s: &mut pb::ClusterShape, f: &mut dyn FnMut(&mut f64)) {
    for t in s.groups.iter_mut().filter_map(|g| g.template.as_mut()) {
        template_floats(t, f);
    }
}

fn apply_floats(r: &mut pb::ApplyRequest, f: &mut dyn FnMut(&mut f64)) {
    if let Some(s) = r.shape.as_mut() {
        shape_floats(s, f);
    }
}

fn plan_floats(r: &mut pb::PlanRequest, f: &mut dyn FnMut(&mut f64)) {
    if let Some(s) = r.shape.as_mut() {
        shape_floats(s, f);
    }
}

fn decide_floats(r: &mut pb::DecideRequest, f: &mut dyn FnMut(&mut f64)) {
    if let Some(pb::decide_request::Part::Header(h)) = r.part.as_mut() {
        if let Some(s) = h.desired.as_mut() {
            shape_floats(s, f);
        }
        for t in &mut h.templates {
            template_floats(t, f);
        }
    }
}

fn driver_message_floats(m: &mut pb::DriverMessage, f: &mut dyn FnMut(&mut f64)) {
    if let Some(pb::driver_message::Kind::Submit(op)) = m.kind.as_mut()
        && let Some(pb::operation::Input::CreateLease(c)) = op.input.as_mut()
        && let Some(t) = c.template.as_mut()
    {
        template_floats(t, f);
    }
}

/// Equality that compares floating-point fields by their bits, so that a NaN
/// equals itself, but for the sign of zero: prost leaves a zero of either sign
/// out of the encoding as the default value (tokio-rs/prost#1177; proto3 says
/// `-0.0` is to be sent), so `-0.0` decodes as `0.0` after a round trip. The
/// domain compares quantities numerically, so to it they are the same.
fn bitwise_eq<M: Clone + PartialEq>(a: &M, b: &M, floats: Floats<M>) -> bool {
    let bits = |m: &M| {
        let mut m = m.clone();
        let mut out = Vec::new();
        floats(&mut m, &mut |x| {
            out.push(if *x == 0.0 { 0 } else { x.to_bits() });
            *x = 0.0;
        });
        (m, out)
    };
    bits(a) == bits(b)
}

fn decode<M: Message + Default>(data: &[u8]) -> Option<M> {
    M::decode(data).ok()
}

/// Decode → encode → decode gives the same message, and the encoding is as
/// long as the message says.
fn stable<M: Message + Default + Clone + PartialEq>(
    target: &'static str,
    m: &M,
    floats: Floats<M>,
) -> Result<(), Violation> {
    let bytes = m.encode_to_vec();
    if bytes.len() != m.encoded_len() {
        return Err(violation(
            target,
            format!(
                "encoded {} bytes but encoded_len says {}",
                bytes.len(),
                m.encoded_len()
            ),
        ));
    }
    let again = M::decode(bytes.as_slice())
        .map_err(|e| violation(target, format!("a re-encoded message does not decode: {e}")))?;
    if !bitwise_eq(m, &again, floats) {
        return Err(violation(target, "decode → encode → decode changed the message"));
    }
    Ok(())
}

/// A domain value survives domain → wire → bytes → wire → domain unchanged.
fn domain_round_trip<D, W>(target: &'static str, what: &str, d: &D) -> Result<(), Violation>
where
    D: PartialEq + fmt::Debug + TryFrom<W, Error = FieldError>,
    W: Message + Default + for<'a> From<&'a D>,
{
    let bytes = W::from(d).encode_to_vec();
    let wire = W::decode(bytes.as_slice())
        .map_err(|e| violation(target, format!("an encoded {what} does not decode: {e}")))?;
    match D::try_from(wire) {
        Ok(back) if back == *d => Ok(()),
        Ok(back) => Err(violation(
            target,
            format!("{what} changed on the wire: {d:?} came back as {back:?}"),
        )),
        Err(e) => Err(violation(
            target,
            format!("{what} {d:?} is refused after a round trip: {e}"),
        )),
    }
}

// ---------------------------------------------------------------------------
// The driver's public API
// ---------------------------------------------------------------------------

/// The `Provisioning` methods [`run_request`] covers, by selector value
/// (`selector % RUN_REQUESTS.len()`).
pub const RUN_REQUESTS: [&str; 12] = [
    "GetRun",
    "ListRuns",
    "WatchRun",
    "ExplainNode",
    "DeleteRun",
    "PauseRun",
    "ResumeRun",
    "AbandonNode",
    "ListOrphans",
    "ListEvents",
    "WatchEvents",
    "ListNodes",
];

/// An `ApplyRequest`, as the driver's `Apply` takes it.
pub fn apply_request(data: &[u8]) -> Result<Verdict, Violation> {
    const T: &str = "apply_request";
    let Some(req) = decode::<pb::ApplyRequest>(data) else {
        return Ok(Verdict::Undecodable);
    };
    stable(T, &req, apply_floats)?;
    shape_request(T, req.shape)
}

/// A `PlanRequest`, as the driver's `Plan` takes it.
pub fn plan_request(data: &[u8]) -> Result<Verdict, Violation> {
    const T: &str = "plan_request";
    let Some(req) = decode::<pb::PlanRequest>(data) else {
        return Ok(Verdict::Undecodable);
    };
    stable(T, &req, plan_floats)?;
    shape_request(T, req.shape)
}

/// The shape argument of `Apply` and `Plan`: required, decoded, then validated
/// with the driver's default limits.
fn shape_request(target: &'static str, shape: Option<pb::ClusterShape>) -> Result<Verdict, Violation> {
    let Some(wire) = shape else {
        return refused(target, &FieldError::new("shape", Problem::Missing));
    };
    let shape = match shape_from_wire(wire.clone()) {
        Ok(s) => s,
        Err(e) => return refused(target, &e.within("shape")),
    };
    // Decoding is lossless: the shape maps back to the message it came from,
    // but for the groups' optional run ids, which are checked and dropped, and
    // their policies, whose unset fields decode as the defaults (and encode
    // explicitly).
    let mut expected = wire;
    for g in &mut expected.groups {
        g.run_id.clear();
        let health = contract::wire::health_from_wire(g.health.take().unwrap_or_default());
        let remediation = contract::wire::remediation_from_wire(g.remediation.take().unwrap_or_default());
        match (health, remediation) {
            (Ok(h), Ok(r)) => {
                g.health = Some(contract::wire::health_to_wire(&h));
                g.remediation = Some(contract::wire::remediation_to_wire(&r));
                let rollout = contract::wire::rollout_from_wire(g.rollout.take().unwrap_or_default());
                g.rollout = Some(contract::wire::rollout_to_wire(&rollout));
            }
            _ => {
                return Err(violation(
                    target,
                    "a policy the shape accepted decodes alone as an error",
                ));
            }
        }
    }
    if !bitwise_eq(&pb::ClusterShape::from(&shape), &expected, shape_floats) {
        return Err(violation(target, "decoding the shape lost or changed a field"));
    }
    if let Err(e) = shape.validate(&ShapeLimits::default()) {
        return refused(target, &e);
    }
    accepted_shape(target, &shape)?;
    Ok(Verdict::Accepted)
}

/// What holds for every shape the driver accepts: it survives the wire both
/// ways (inline templates and a template table), still validates afterwards,
/// and its read-path copies hide exactly the secret parameter values.
fn accepted_shape(target: &'static str, shape: &ClusterShape) -> Result<(), Violation> {
    domain_round_trip::<ClusterShape, pb::ClusterShape>(target, "an accepted shape", shape)?;
    let mut table = TemplateTable::default();
    let (wire, refs) = shape_to_wire_with_table(shape, &mut table);
    let templates = TemplateTable::from_wire(table.into_wire())
        .map_err(|e| violation(target, format!("a shape's template table is refused: {e}")))?;
    match shape_from_wire_with_table(Some(wire), &refs, &templates) {
        Ok(back) if back == *shape => {}
        Ok(_) => return Err(violation(target, "a shape changed through a template table")),
        Err(e) => {
            return Err(violation(
                target,
                format!("a shape is refused through a template table: {e}"),
            ));
        }
    }
    if let Err(e) = shape.validate(&ShapeLimits::default()) {
        return Err(violation(
            target,
            format!("an accepted shape fails validation the second time: {e}"),
        ));
    }
    let read = shape_to_wire_redacted(shape);
    if !bitwise_eq(&read, &redacted(&pb::ClusterShape::from(shape)), shape_floats) {
        return Err(violation(target, "the two read-path redactions differ"));
    }
    if read.groups.len() != shape.groups.len() {
        return Err(violation(target, "redaction changed the groups"));
    }
    for (g, wire) in shape.groups.iter().zip(&read.groups) {
        let Some(t) = &wire.template else {
            return Err(violation(target, "redaction dropped a template"));
        };
        if !redacts_exactly_secrets(&g.template.boot, &t.boot)
            || !redacts_exactly_secrets(&g.template.join, &t.join)
        {
            return Err(violation(
                target,
                format!(
                    "group {}: a read path shows a secret or hides a plain value",
                    g.id
                ),
            ));
        }
    }
    Ok(())
}

fn redacts_exactly_secrets(params: &Params, read: &HashMap<String, pb::Param>) -> bool {
    params.len() == read.len()
        && params.iter().all(|(k, p)| match read.get(k) {
            Some(r) if p.secret => r.secret && r.value == REDACTED,
            Some(r) => !r.secret && r.value == p.value,
            None => false,
        })
}

/// One of the driver's run-addressed requests: the first byte selects the
/// method from [`RUN_REQUESTS`], the rest is its request message.
pub fn run_request(data: &[u8]) -> Result<Verdict, Violation> {
    const T: &str = "run_request";
    let Some((&selector, body)) = data.split_first() else {
        return Ok(Verdict::Undecodable);
    };
    fn request<M: Message + Default + Clone + PartialEq>(body: &[u8]) -> Result<Option<M>, Violation> {
        let Some(m) = decode::<M>(body) else {
            return Ok(None);
        };
        stable(T, &m, no_floats)?;
        Ok(Some(m))
    }
    let (run_id, node_id) = match usize::from(selector) % RUN_REQUESTS.len() {
        0 => match request::<pb::GetRunRequest>(body)? {
            Some(r) => (r.run_id, None),
            None => return Ok(Verdict::Undecodable),
        },
        1 => match request::<pb::ListRunsRequest>(body)? {
            Some(_) => return Ok(Verdict::Accepted),
            None => return Ok(Verdict::Undecodable),
        },
        2 => match request::<pb::WatchRunRequest>(body)? {
            Some(r) => (r.run_id, None),
            None => return Ok(Verdict::Undecodable),
        },
        3 => match request::<pb::ExplainNodeRequest>(body)? {
            Some(r) => (r.run_id, Some(r.node_id)),
            None => return Ok(Verdict::Undecodable),
        },
        4 => match request::<pb::DeleteRunRequest>(body)? {
            Some(r) => (r.run_id, None),
            None => return Ok(Verdict::Undecodable),
        },
        5 => match request::<pb::PauseRunRequest>(body)? {
            Some(r) => (r.run_id, None),
            None => return Ok(Verdict::Undecodable),
        },
        6 => match request::<pb::ResumeRunRequest>(body)? {
            Some(r) => (r.run_id, None),
            None => return Ok(Verdict::Undecodable),
        },
        7 => match request::<pb::AbandonNodeRequest>(body)? {
            Some(r) => (r.run_id, Some(r.node_id)),
            None => return Ok(Verdict::Undecodable),
        },
        8 => match request::<pb::ListOrphansRequest>(body)? {
            Some(_) => return Ok(Verdict::Accepted),
            None => return Ok(Verdict::Undecodable),
        },
        9 => match request::<pb::ListEventsRequest>(body)? {
            Some(r) => (r.run_id, None),
            None => return Ok(Verdict::Undecodable),
        },
        10 => match request::<pb::WatchEventsRequest>(body)? {
            Some(r) => (r.run_id, None),
            None => return Ok(Verdict::Undecodable),
        },
        // The page token is the last node id of the page before (empty: the
        // first page), parsed as one.
        _ => match request::<pb::ListNodesRequest>(body)? {
            Some(r) => (r.run_id, (!r.page_token.is_empty()).then_some(r.page_token)),
            None => return Ok(Verdict::Undecodable),
        },
    };
    // The API checks the run id; the driver then parses the node id.
    let run = match RunId::parse("run_id", &run_id) {
        Ok(id) => id,
        Err(e) => return refused(T, &e),
    };
    if run.as_str() != run_id {
        return Err(violation(T, format!("run id {run_id:?} parsed as {run:?}")));
    }
    if let Some(node_id) = node_id {
        let node = match LogicalNodeId::parse("node_id", &node_id) {
            Ok(n) => n,
            Err(e) => return refused(T, &e),
        };
        check_node_id_spelling(T, &node_id, &node)?;
    }
    Ok(Verdict::Accepted)
}

/// Each slot has exactly one spelling: a parsed node id prints as its input.
fn check_node_id_spelling(target: &'static str, raw: &str, node: &LogicalNodeId) -> Result<(), Violation> {
    if node.to_string() != raw {
        return Err(violation(
            target,
            format!("node id {raw:?} parsed as {node}, another spelling"),
        ));
    }
    Ok(())
}

/// A run uid has one spelling too: 32 lowercase hex digits.
fn check_uid_spelling(target: &'static str, raw: &str, uid: RunUid) -> Result<(), Violation> {
    if uid.to_string() != raw {
        return Err(violation(target, format!("run uid {raw:?} parsed as {uid}")));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The decider's Decide stream
// ---------------------------------------------------------------------------

/// The most desired slots, nodes and slot indices one [`decide_call`] takes,
/// as the decider's `max_nodes` setting (`--max-nodes`). Small, so that each
/// fuzz run stays quick; the checks are the same at any size.
pub const DECIDE_MAX_NODES: u32 = 256;

/// The decision ladder [`decide_call_with`] runs over what it decodes;
/// [`Decider`] is the decider's own.
pub trait Ladder {
    /// One node's decision.
    fn decide(
        &mut self,
        desired: &ClusterShape,
        deleting: bool,
        node: &ManagedNode,
        now: UnixMillis,
    ) -> Decision;

    /// An insert for every desired slot not in `held` (which may repeat
    /// slots, and name slots or groups that are not desired).
    fn inserts(&mut self, desired: &ClusterShape, deleting: bool, held: &[(GroupId, u32)]) -> Vec<Decision>;
}

/// A message's bytes, for building inputs without naming `prost`.
pub fn encode(m: &impl Message) -> Vec<u8> {
    m.encode_to_vec()
}

/// A [`run_request`] input: `method` indexes [`RUN_REQUESTS`].
pub fn run_request_input(method: u8, request: &impl Message) -> Vec<u8> {
    let mut input = vec![method];
    input.extend(request.encode_to_vec());
    input
}

/// The decider's ladder, as its `Decide` service runs it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Decider;

impl Ladder for Decider {
    fn decide(
        &mut self,
        desired: &ClusterShape,
        deleting: bool,
        node: &ManagedNode,
        now: UnixMillis,
    ) -> Decision {
        decider::decide_node(&decider::DesiredView::new(desired, deleting), node, now)
    }

    fn inserts(&mut self, desired: &ClusterShape, deleting: bool, held: &[(GroupId, u32)]) -> Vec<Decision> {
        let mut slots = decider::SlotSet::new();
        for (group, index) in held {
            slots.insert_index(group, *index);
        }
        slots.finish();
        decider::inserts(&decider::DesiredView::new(desired, deleting), &slots).collect()
    }
}

/// [`decide_call_with`] the decider's own ladder.
pub fn decide_call(data: &[u8]) -> Result<Verdict, Violation> {
    decide_call_with(data, &mut Decider)
}

/// A call's requests as [`decide_call`] reads them: each length-delimited.
pub fn decide_input(requests: &[pb::DecideRequest]) -> Vec<u8> {
    requests
        .iter()
        .flat_map(Message::encode_length_delimited_to_vec)
        .collect()
}

enum Next {
    Request(Box<pb::DecideRequest>),
    /// The input ended.
    End,
    /// Bytes that are not a length-delimited `DecideRequest`.
    Garbage,
}

fn next_request(buf: &mut &[u8]) -> Next {
    if buf.is_empty() {
        return Next::End;
    }
    match pb::DecideRequest::decode_length_delimited(&mut *buf) {
        Ok(m) => Next::Request(Box::new(m)),
        Err(_) => Next::Garbage,
    }
}

/// A `Decide` call: a stream of length-delimited `DecideRequest`s
/// ([`decide_input`]), read under the decider's protocol (one header first,
/// then node and slot batches, then `end`), with every node decided by
/// `ladder` as it is decoded and the inserts at `end`. Every decision must name
/// its node and attempt and survive the wire, and the inserts must be exactly
/// the desired slots the call does not hold.
pub fn decide_call_with(data: &[u8], ladder: &mut impl Ladder) -> Result<Verdict, Violation> {
    const T: &str = "decide_call";
    let mut buf = data;
    let header = match next_request(&mut buf) {
        Next::Garbage => return Ok(Verdict::Undecodable),
        Next::End => return Ok(Verdict::Refused("the call carries no header".to_owned())),
        Next::Request(r) => {
            stable(T, &*r, decide_floats)?;
            match r.part {
                Some(pb::decide_request::Part::Header(h)) => h,
                _ => return Ok(Verdict::Refused("the first message is not a header".to_owned())),
            }
        }
    };
    let templates = match TemplateTable::from_wire(header.templates) {
        Ok(t) => t,
        Err(e) => return refused(T, &e.within("header")),
    };
    let shape = match shape_from_wire_with_table(header.desired, &header.group_template_refs, &templates) {
        Ok(s) => s,
        Err(e) => return refused(T, &e.within("header")),
    };
    let now = UnixMillis::new(header.now_ms);
    let deleting = header.deleting;
    if !deleting && shape.total_nodes() > u64::from(DECIDE_MAX_NODES) {
        return Ok(Verdict::Refused("too many desired slots".to_owned()));
    }

    let mut decided: u32 = 0;
    let mut held: Vec<(GroupId, u32)> = Vec::new();
    loop {
        let request = match next_request(&mut buf) {
            Next::End => return Ok(Verdict::Refused("the call ended before `end`".to_owned())),
            Next::Garbage => return Ok(Verdict::Refused("undecodable message in the stream".to_owned())),
            Next::Request(r) => r,
        };
        stable(T, &*request, decide_floats)?;
        match request.part {
            None => return Ok(Verdict::Refused("a message carries no part".to_owned())),
            Some(pb::decide_request::Part::Header(_)) => {
                return Ok(Verdict::Refused("a second header".to_owned()));
            }
            Some(pb::decide_request::Part::End(_)) => break,
            Some(pb::decide_request::Part::Slots(batch)) => {
                let group = match GroupId::parse("slots.group_id", &batch.group_id) {
                    Ok(g) => g,
                    Err(e) => return refused(T, &e),
                };
                if held.len().saturating_add(batch.indices.len()) > DECIDE_MAX_NODES as usize {
                    return Ok(Verdict::Refused("too many slot indices".to_owned()));
                }
                held.extend(batch.indices.into_iter().map(|i| (group.clone(), i)));
            }
            Some(pb::decide_request::Part::SlotRanges(batch)) => {
                let group = match GroupId::parse("slot_ranges.group_id", &batch.group_id) {
                    Ok(g) => g,
                    Err(e) => return refused(T, &e),
                };
                let ranges: Vec<(u32, u32)> = match contract::wire::slot_ranges_from_wire(&batch.bounds) {
                    Ok(r) => r.collect(),
                    Err(e) => return refused(T, &e.within("slot_ranges")),
                };
                let covered: u64 = ranges.iter().map(|&(start, end)| u64::from(end - start)).sum();
                if (held.len() as u64).saturating_add(covered) > u64::from(DECIDE_MAX_NODES) {
                    return Ok(Verdict::Refused("too many slot indices".to_owned()));
                }
                for (start, end) in ranges {
                    held.extend((start..end).map(|i| (group.clone(), i)));
                }
            }
            Some(pb::decide_request::Part::Nodes(batch)) => {
                if (decided as usize).saturating_add(batch.nodes.len()) > DECIDE_MAX_NODES as usize {
                    return Ok(Verdict::Refused("too many nodes".to_owned()));
                }
                for wire in batch.nodes {
                    let node = match node_from_wire(wire, &templates) {
                        Ok(n) => n,
                        Err(e) => return refused(T, &e.within(&format!("nodes[{decided}]"))),
                    };
                    node_round_trip(T, &node)?;
                    let d = ladder.decide(&shape, deleting, &node, now);
                    if d.node != node.id || d.attempt != Some(node.attempt) {
                        return Err(violation(
                            T,
                            format!(
                                "the decision for {} {} names {} {:?}",
                                node.id, node.attempt, d.node, d.attempt
                            ),
                        ));
                    }
                    if d.action == Action::Insert {
                        return Err(violation(T, format!("an existing node {} is inserted", node.id)));
                    }
                    domain_round_trip::<Decision, pb::Decision>(T, "a decision", &d)?;
                    decided += 1;
                }
            }
        }
    }
    check_inserts(
        T,
        &shape,
        deleting,
        &held,
        &ladder.inserts(&shape, deleting, &held),
    )?;
    Ok(Verdict::Accepted)
}

/// A node survives the wire with its templates in a fresh table.
fn node_round_trip(target: &'static str, node: &ManagedNode) -> Result<(), Violation> {
    let mut table = TemplateTable::default();
    let wire = node_to_wire(node, &mut table);
    let bytes = wire.encode_to_vec();
    let wire = pb::NodeState::decode(bytes.as_slice())
        .map_err(|e| violation(target, format!("an encoded node does not decode: {e}")))?;
    let templates = TemplateTable::from_wire(table.into_wire())
        .map_err(|e| violation(target, format!("a node's template table is refused: {e}")))?;
    match node_from_wire(wire, &templates) {
        Ok(back) if back == *node => Ok(()),
        Ok(back) => Err(violation(
            target,
            format!("a node changed on the wire: {node:?} came back as {back:?}"),
        )),
        Err(e) => Err(violation(
            target,
            format!("node {} is refused after a round trip: {e}", node.id),
        )),
    }
}

/// The inserts are exactly the desired slots not held, each once, and each
/// survives the wire.
fn check_inserts(
    target: &'static str,
    shape: &ClusterShape,
    deleting: bool,
    held: &[(GroupId, u32)],
    inserts: &[Decision],
) -> Result<(), Violation> {
    let held: HashSet<(&GroupId, u32)> = held.iter().map(|(g, i)| (g, *i)).collect();
    let mut expected: Vec<LogicalNodeId> = Vec::new();
    if !deleting {
        for g in &shape.groups {
            for i in (0..g.count).filter(|i| !held.contains(&(&g.id, *i))) {
                expected.push(LogicalNodeId::new(g.id.clone(), i));
            }
        }
    }
    let got: Vec<LogicalNodeId> = inserts.iter().map(|d| d.node.clone()).collect();
    if got != expected {
        return Err(violation(
            target,
            format!("inserted {got:?}; the desired slots not held are {expected:?}"),
        ));
    }
    for d in inserts {
        if d.action != Action::Insert || d.attempt.is_some() {
            return Err(violation(target, format!("an insert for {} is {d:?}", d.node)));
        }
        domain_round_trip::<Decision, pb::Decision>(target, "an insert", d)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The executor link
// ---------------------------------------------------------------------------

/// A `DriverMessage`, as the executor's link reads it.
pub fn driver_message(data: &[u8]) -> Result<Verdict, Violation> {
    use pb::driver_message::Kind;
    const T: &str = "driver_message";
    let Some(msg) = decode::<pb::DriverMessage>(data) else {
        return Ok(Verdict::Undecodable);
    };
    stable(T, &msg, driver_message_floats)?;
    match msg.kind {
        None => refused(T, &FieldError::new("kind", Problem::Missing)),
        Some(Kind::Claim(c)) => {
            let raw = c.clone();
            match Claim::try_from(c) {
                Ok(claim) => {
                    if pb::Claim::from(&claim) != raw {
                        return Err(violation(T, format!("decoding claim {raw:?} changed it")));
                    }
                    domain_round_trip::<Claim, pb::Claim>(T, "a claim", &claim)?;
                    Ok(Verdict::Accepted)
                }
                Err(e) => refused(T, &e),
            }
        }
        Some(Kind::Watch(w)) => match contract::WatchHealth::try_from(w) {
            Ok(w) => {
                domain_round_trip::<contract::WatchHealth, pb::WatchHealth>(T, "a health watch", &w)?;
                Ok(Verdict::Accepted)
            }
            Err(e) => refused(T, &e),
        },
        Some(Kind::Submit(op)) => match Operation::try_from(op) {
            Ok(op) => {
                domain_round_trip::<Operation, pb::Operation>(T, "an operation", &op)?;
                Ok(Verdict::Accepted)
            }
            Err(e) => refused(T, &e),
        },
        Some(Kind::Ack(ack)) => {
            // Each acknowledgement stands alone: a bad one is refused and the
            // rest still count.
            let mut verdict = Verdict::Accepted;
            for r in ack.results {
                let parsed = RunUid::parse("run_uid", &r.run_uid).and_then(|uid| {
                    let id = r.id.ok_or_else(|| FieldError::new("id", Problem::Missing))?;
                    let id = OperationId::try_from(id).map_err(|e| e.within("id"))?;
                    Ok((uid, id))
                });
                match parsed {
                    Ok((uid, id)) => {
                        check_uid_spelling(T, &r.run_uid, uid)?;
                        if pb::OperationId::from(id) != r.id.unwrap_or_default() {
                            return Err(violation(T, format!("operation id {id} changed in decoding")));
                        }
                    }
                    Err(e) => verdict = first_refusal(verdict, refused(T, &e)?),
                }
            }
            for o in ack.observations {
                match RunUid::parse("run_uid", &o.run_uid)
                    .and_then(|uid| Ok((uid, SessionId::new("session_id", &o.session_id)?)))
                {
                    Ok((uid, _)) => check_uid_spelling(T, &o.run_uid, uid)?,
                    Err(e) => verdict = first_refusal(verdict, refused(T, &e)?),
                }
            }
            Ok(verdict)
        }
        Some(Kind::ObserveFrom(from)) => {
            let mut verdict = Verdict::Accepted;
            for cursor in from.after {
                // A cursor may leave its run uid empty to mean the request's.
                let raw = if cursor.run_uid.is_empty() {
                    &from.run_uid
                } else {
                    &cursor.run_uid
                };
                match RunUid::parse("run_uid", raw)
                    .and_then(|uid| Ok((uid, SessionId::new("session_id", &cursor.session_id)?)))
                {
                    Ok((uid, session)) => {
                        check_uid_spelling(T, raw, uid)?;
                        if session.as_str() != cursor.session_id {
                            return Err(violation(T, "a session id changed in decoding"));
                        }
                    }
                    Err(e) => verdict = first_refusal(verdict, refused(T, &e)?),
                }
            }
            Ok(verdict)
        }
        Some(Kind::Forget(forget)) => match RunUid::parse("run_uid", &forget.run_uid) {
            Ok(uid) => {
                check_uid_spelling(T, &forget.run_uid, uid)?;
                Ok(Verdict::Accepted)
            }
            Err(e) => refused(T, &e),
        },
    }
}

fn first_refusal(so_far: Verdict, this: Verdict) -> Verdict {
    match so_far {
        Verdict::Accepted => this,
        other => other,
    }
}

/// An `ExecutorMessage`, as the driver's link reads it.
pub fn executor_message(data: &[u8]) -> Result<Verdict, Violation> {
    use pb::executor_message::Kind;
    const T: &str = "executor_message";
    let Some(msg) = decode::<pb::ExecutorMessage>(data) else {
        return Ok(Verdict::Undecodable);
    };
    stable(T, &msg, no_floats)?;
    match msg.kind {
        // The driver skips a message with no kind.
        None => Ok(Verdict::Refused("a message with no kind".to_owned())),
        Some(Kind::Claimed(c)) => match RunUid::parse("run_uid", &c.run_uid) {
            Ok(uid) => {
                check_uid_spelling(T, &c.run_uid, uid)?;
                Ok(Verdict::Accepted)
            }
            Err(e) => refused(T, &e),
        },
        Some(Kind::Result(r)) => match OperationResult::try_from(r) {
            Ok(r) => {
                domain_round_trip::<OperationResult, pb::OperationResult>(T, "a result", &r)?;
                Ok(Verdict::Accepted)
            }
            Err(e) => refused(T, &e),
        },
        Some(Kind::Observation(o)) => match Observation::try_from(o) {
            Ok(o) => {
                domain_round_trip::<Observation, pb::BootstrapObservation>(T, "an observation", &o)?;
                Ok(Verdict::Accepted)
            }
            Err(e) => refused(T, &e),
        },
        Some(Kind::Rejection(r)) => match Rejection::try_from(r) {
            Ok(r) => {
                domain_round_trip::<Rejection, pb::Rejection>(T, "a rejection", &r)?;
                Ok(Verdict::Accepted)
            }
            Err(e) => refused(T, &e),
        },
        Some(Kind::Waiting(w)) => match contract::wire::Waiting::try_from(w) {
            Ok(_) => Ok(Verdict::Accepted),
            Err(e) => refused(T, &e),
        },
        Some(Kind::Providers(p)) => {
            for p in p.providers {
                match contract::ServedProvider::try_from(p) {
                    Ok(p) => domain_round_trip::<contract::ServedProvider, pb::ServedProvider>(
                        T,
                        "a served provider",
                        &p,
                    )?,
                    Err(e) => return refused(T, &e),
                }
            }
            Ok(Verdict::Accepted)
        }
        Some(Kind::Change(c)) => match contract::ResourceChange::try_from(c) {
            Ok(c) => {
                domain_round_trip::<contract::ResourceChange, pb::ResourceChange>(
                    T,
                    "a resource change",
                    &c,
                )?;
                Ok(Verdict::Accepted)
            }
            Err(e) => refused(T, &e),
        },
    }
}

// ---------------------------------------------------------------------------
// Shape validation, from a structured input
// ---------------------------------------------------------------------------

/// Reads values from fuzz input. Past its end every read is zero, so any input
/// builds a value.
struct Source<'a>(&'a [u8]);

/// Characters of generated ids: valid ones, a few invalid ones, and few enough
/// that duplicates are common.
const ID_CHARS: &[char] = &['a', 'b', 'g', 'z', '0', '1', '9', '-', 'A', '_'];

/// Characters of generated free text, multi-byte ones included (limits count
/// bytes).
const TEXT_CHARS: &[char] = &['a', 'b', ':', '/', '.', ' ', '-', '\u{0}', 'é', '€', '😀'];

impl Source<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn bool(&mut self) -> bool {
        self.byte() & 1 == 1
    }

    fn below(&mut self, n: u8) -> u8 {
        self.byte() % n.max(1)
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) << 32 | u64::from(self.u32())
    }

    fn string(&mut self, chars: &[char]) -> String {
        let len = match self.byte() {
            255 => 4097,
            254 => 4096,
            b => usize::from(b % 72),
        };
        (0..len)
            .map(|_| {
                chars
                    .get(usize::from(self.byte()) % chars.len().max(1))
                    .copied()
                    .unwrap_or('a')
            })
            .collect()
    }

    fn f64(&mut self) -> f64 {
        match self.below(12) {
            0 => 0.0,
            1 => -0.0,
            2 => f64::NAN,
            3 => f64::INFINITY,
            4 => f64::NEG_INFINITY,
            5 => -1.5,
            6 => f64::MAX,
            7 => f64::MIN_POSITIVE,
            8 => f64::from_bits(self.u64()),
            _ => f64::from(self.byte()) / 4.0,
        }
    }

    fn count(&mut self) -> u32 {
        match self.below(4) {
            0 => self.u32(),
            1 => 100_000 - 2 + u32::from(self.below(4)),
            _ => u32::from(self.byte()),
        }
    }

    fn limits(&mut self) -> ShapeLimits {
        if self.bool() {
            return ShapeLimits::default();
        }
        ShapeLimits {
            max_groups: usize::from(self.below(6)),
            max_nodes_per_group: u32::from(self.byte()),
            max_nodes_total: u64::from(self.byte()) * 2,
            max_params: usize::from(self.below(5)),
            max_string_len: usize::from(self.below(48)),
            max_payload_bytes: 1 << 20,
        }
    }

    fn params(&mut self) -> Params {
        (0..self.below(6))
            .map(|_| {
                let key = self.string(TEXT_CHARS);
                let value = self.string(TEXT_CHARS);
                let secret = self.bool();
                (key, Param { value, secret })
            })
            .collect()
    }

    fn template(&mut self) -> NodeTemplate {
        let role = self.string(TEXT_CHARS);
        let image = self.string(TEXT_CHARS);
        let provider = ProviderShape {
            name: self.string(TEXT_CHARS),
            machine_type: self.string(TEXT_CHARS),
            cpu: self.f64(),
            memory_gib: self.f64(),
            accelerators: (0..self.below(4))
                .map(|_| Accelerator {
                    kind: self.string(TEXT_CHARS),
                    count: self.count(),
                })
                .collect(),
            zone: self.string(TEXT_CHARS),
            labels: (0..self.below(6))
                .map(|_| (self.string(TEXT_CHARS), self.string(TEXT_CHARS)))
                .collect::<BTreeMap<_, _>>(),
        };
        NodeTemplate {
            role,
            provider,
            image,
            boot: self.params(),
            join: self.params(),
        }
    }

    fn shape(&mut self) -> Result<ClusterShape, FieldError> {
        let run_id =
            RunId::parse("run_id", &self.string(ID_CHARS)).or_else(|_| RunId::parse("run_id", "r"))?;
        let generation = match self.below(4) {
            0 => 0,
            1 => self.u64(),
            _ => 1 + u64::from(self.byte()),
        };
        let mut groups: Vec<NodeGroup> = Vec::new();
        for _ in 0..self.below(8) {
            let id = GroupId::parse("id", &self.string(ID_CHARS)).or_else(|_| GroupId::parse("id", "g"))?;
            let count = self.count();
            let template = match groups.last() {
                // Groups may share one template, as the driver's do.
                Some(last) if self.below(4) == 0 => Arc::clone(&last.template),
                _ => Arc::new(self.template()),
            };
            groups.push(NodeGroup::new(id, count, template));
        }
        Ok(ClusterShape {
            run_id,
            generation: Generation::new(generation),
            labels: Default::default(),
            groups,
        })
    }
}

/// The validation rules as documented, written independently of
/// [`ClusterShape::validate`] so that the two can be compared.
fn follows_rules(shape: &ClusterShape, limits: &ShapeLimits) -> bool {
    let short = |s: &str| s.len() <= limits.max_string_len;
    let quantity = |v: f64| v.is_finite() && v >= 0.0;
    let params = |p: &Params| {
        p.len() <= limits.max_params
            && p.iter()
                .all(|(k, v)| !k.is_empty() && short(k) && short(&v.value))
    };
    let template = |t: &NodeTemplate| {
        let p = &t.provider;
        short(&t.role)
            && !t.image.is_empty()
            && short(&t.image)
            && !p.name.is_empty()
            && short(&p.name)
            && short(&p.machine_type)
            && short(&p.zone)
            && quantity(p.cpu)
            && quantity(p.memory_gib)
            && p.accelerators
                .iter()
                .all(|a| !a.kind.is_empty() && short(&a.kind))
            && p.labels.len() <= limits.max_params
            && p.labels.iter().all(|(k, v)| short(k) && short(v))
            && params(&t.boot)
            && params(&t.join)
    };
    let ids: HashSet<&GroupId> = shape.groups.iter().map(|g| &g.id).collect();
    let total: u64 = shape.groups.iter().map(|g| u64::from(g.count)).sum();
    shape.generation.get() >= 1
        && shape.groups.len() <= limits.max_groups
        && ids.len() == shape.groups.len()
        && shape
            .groups
            .iter()
            .all(|g| g.count <= limits.max_nodes_per_group && template(&g.template))
        && total <= limits.max_nodes_total
}

/// What the wire decoding checks of a shape built from valid ids: a
/// generation, unique groups, finite non-negative quantities.
fn wire_accepts(shape: &ClusterShape) -> bool {
    let ids: HashSet<&GroupId> = shape.groups.iter().map(|g| &g.id).collect();
    let quantity = |v: f64| v.is_finite() && v >= 0.0;
    shape.generation.get() >= 1
        && ids.len() == shape.groups.len()
        && shape
            .groups
            .iter()
            .all(|g| quantity(g.template.provider.cpu) && quantity(g.template.provider.memory_gib))
}

/// A shape and limits built from the bytes, validated. Validation must agree
/// with the documented rules under both the built limits and the driver's
/// defaults, and refusals must name a field; the wire must accept exactly the
/// shapes with a generation, unique groups and finite quantities, and give
/// them back unchanged. Accepted means valid under the default limits.
pub fn shape_validation(data: &[u8]) -> Result<Verdict, Violation> {
    const T: &str = "shape_validation";
    let mut src = Source(data);
    let limits = src.limits();
    let shape = src
        .shape()
        .map_err(|e| violation(T, format!("a fallback id does not parse: {e}")))?;

    let mut verdict = Verdict::Accepted;
    for limits in [limits, ShapeLimits::default()] {
        let checked = shape.validate(&limits);
        if checked.is_ok() != follows_rules(&shape, &limits) {
            return Err(violation(
                T,
                format!("validate says {checked:?} under {limits:?}, the documented rules the opposite"),
            ));
        }
        verdict = match checked {
            Ok(()) => Verdict::Accepted,
            Err(e) => refused(T, &e)?,
        };
    }

    let bytes = pb::ClusterShape::from(&shape).encode_to_vec();
    let decoded = pb::ClusterShape::decode(bytes.as_slice())
        .map_err(|e| violation(T, format!("an encoded shape does not decode: {e}")))?;
    match shape_from_wire(decoded) {
        Ok(back) if !wire_accepts(&shape) => {
            return Err(violation(
                T,
                format!("the wire accepts a shape it must refuse: {back:?}"),
            ));
        }
        Ok(back) if back != shape => {
            return Err(violation(T, "a shape changed on the wire"));
        }
        Ok(_) => {}
        Err(e) if wire_accepts(&shape) => {
            return Err(violation(
                T,
                format!("the wire refuses a shape it must accept: {e}"),
            ));
        }
        Err(e) => {
            refused(T, &e)?;
        }
    }
    if verdict == Verdict::Accepted {
        accepted_shape(T, &shape)?;
    }
    Ok(verdict)
}

#[cfg(test)]
mod tests {
    use super::*;
    use contract::shape::example_template;

    fn shape() -> Result<pb::ClusterShape, FieldError> {
        let mut t = example_template("fake", "img:1");
        t.join.insert(
            "token".to_owned(),
            Param {
                value: "s3cret".to_owned(),
                secret: true,
            },
        );
        Ok(pb::ClusterShape::from(&ClusterShape {
            run_id: RunId::parse("run_id", "demo")?,
            generation: Generation::new(1),
            labels: Default::default(),
            groups: vec![NodeGroup {
                id: GroupId::parse("id", "workers")?,
                count: 3,
                template: Arc::new(t),
                policy: Default::default(),
            }],
        }))
    }

    #[test]
    fn a_valid_apply_is_accepted_and_a_bad_one_refused_by_field() -> Result<(), Box<dyn std::error::Error>> {
        let ok = pb::ApplyRequest {
            shape: Some(shape()?),
        }
        .encode_to_vec();
        assert_eq!(apply_request(&ok)?, Verdict::Accepted);
        assert_eq!(plan_request(&ok)?, Verdict::Accepted);

        let mut bad = shape()?;
        bad.groups[0].count = -1;
        let bad = pb::ApplyRequest { shape: Some(bad) }.encode_to_vec();
        match apply_request(&bad)? {
            Verdict::Refused(m) => assert!(m.starts_with("shape.groups[0].count"), "{m}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(apply_request(&[0xff])?, Verdict::Undecodable);
        assert!(matches!(apply_request(&[])?, Verdict::Refused(_)));
        Ok(())
    }

    #[test]
    fn bitwise_equality_sees_nan_and_the_bits_but_not_the_sign_of_zero() -> Result<(), FieldError> {
        let with_cpu = |cpu: f64| -> Result<pb::ClusterShape, FieldError> {
            let mut s = shape()?;
            for p in s
                .groups
                .iter_mut()
                .filter_map(|g| g.template.as_mut()?.provider.as_mut())
            {
                p.cpu = cpu;
            }
            Ok(s)
        };
        let nan = with_cpu(f64::NAN)?;
        assert_ne!(nan, nan.clone(), "NaN makes the derived equality fail");
        assert!(bitwise_eq(&nan, &nan.clone(), shape_floats));
        assert!(!bitwise_eq(
            &nan,
            &with_cpu(f64::from_bits(f64::NAN.to_bits() ^ 1))?,
            shape_floats
        ));
        assert!(!bitwise_eq(&with_cpu(1.0)?, &with_cpu(2.0)?, shape_floats));
        assert!(bitwise_eq(&with_cpu(-0.0)?, &with_cpu(0.0)?, shape_floats));
        Ok(())
    }

    /// fuzz/artifacts/plan_request/crash-967c…: a cpu of `-0.0` comes back
    /// from a round trip as `0.0`, which is the same quantity.
    #[test]
    fn a_negative_zero_quantity_is_accepted() -> Result<(), Box<dyn std::error::Error>> {
        let mut s = shape()?;
        for p in s
            .groups
            .iter_mut()
            .filter_map(|g| g.template.as_mut()?.provider.as_mut())
        {
            p.cpu = -0.0;
        }
        let plan = pb::PlanRequest { shape: Some(s) }.encode_to_vec();
        let again = pb::PlanRequest::decode(
            pb::PlanRequest::decode(plan.as_slice())?
                .encode_to_vec()
                .as_slice(),
        )?;
        let cpu = again.shape.and_then(|s| {
            s.groups
                .first()?
                .template
                .as_ref()?
                .provider
                .as_ref()
                .map(|p| p.cpu)
        });
        assert_eq!(
            cpu.map(f64::to_bits),
            Some(0.0f64.to_bits()),
            "prost drops the sign"
        );
        assert_eq!(plan_request(&plan)?, Verdict::Accepted);
        Ok(())
    }

    #[test]
    fn run_requests_check_run_then_node() -> Result<(), Violation> {
        let explain = |run: &str, node: &str| {
            let mut input = vec![3];
            input.extend(
                pb::ExplainNodeRequest {
                    run_id: run.to_owned(),
                    node_id: node.to_owned(),
                }
                .encode_to_vec(),
            );
            run_request(&input)
        };
        assert_eq!(explain("demo", "workers-2")?, Verdict::Accepted);
        assert!(matches!(explain("Demo", "workers-2")?, Verdict::Refused(m) if m.starts_with("run_id")));
        assert!(matches!(explain("demo", "workers-02")?, Verdict::Refused(m) if m.starts_with("node_id")));
        assert_eq!(
            run_request(&[1])?,
            Verdict::Accepted,
            "ListRuns takes anything empty"
        );
        assert_eq!(run_request(&[])?, Verdict::Undecodable);
        Ok(())
    }

    #[test]
    fn the_shape_oracle_and_validate_agree_on_edges() -> Result<(), Violation> {
        // All zeros: default limits off, run "r", generation 0.
        assert!(matches!(shape_validation(&[0; 64])?, Verdict::Refused(_)));
        // Every byte 1: default limits, valid ids, generation 2.
        for data in [[1u8; 300], [7u8; 300], [255u8; 300], [254u8; 300]] {
            shape_validation(&data)?;
        }
        Ok(())
    }

    #[test]
    fn source_reads_zero_past_the_end() {
        let mut s = Source(&[5]);
        assert_eq!(s.byte(), 5);
        assert_eq!(s.byte(), 0);
        assert_eq!(s.u64(), 0);
        assert_eq!(s.string(TEXT_CHARS), "");
    }
}
