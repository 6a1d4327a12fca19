//! The decider's side of a `Decide` call's node batches: a `DecideRequest`
//! read with its nodes left as ranges of the message's bytes, and each node
//! decoded, when the decider comes to it, into one `pb::NodeState` used again
//! for the next.
//!
//! prost decodes a batch into a `Vec<pb::NodeState>`: a few hundred bytes and
//! a `String` for the node id and each fact, for every node, before the first
//! is decided. [`decode_request`] keeps a `nodes` part as [`NodeRanges`], and
//! [`NodeScratch::read`] decodes one node into a message whose strings keep
//! their capacity from node to node; [`node_from_wire_ref`](super::node_from_wire_ref)
//! converts it with the checks every other path uses. Every other part is
//! prost's. What prost accepts, this accepts, to the same message (unknown
//! fields skipped, the last part of the `oneof` kept, a repeated part merged);
//! the one difference is when a malformed node is found: prost refuses its
//! whole message, [`NodeScratch::read`] the node itself.

use prost::{
    Message as _,
    bytes::{Buf, Bytes},
    encoding::{DecodeContext, WireType, check_wire_type, decode_key, decode_varint, skip_field},
};

use crate::pb::{self, decide_request::Part};

/// A `nodes` part: the message's bytes and where each node's body is.
#[derive(Debug, Clone, Default)]
pub struct NodeRanges {
    bytes: Bytes,
    nodes: Vec<(usize, usize)>,
}

impl NodeRanges {
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The `i`th node's encoded `NodeState`.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        let &(start, end) = self.nodes.get(i)?;
        self.bytes.get(start..end)
    }

    /// Each node's encoded `NodeState`, in order.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> {
        self.nodes
            .iter()
            .map(|&(start, end)| self.bytes.get(start..end).unwrap_or_default())
    }
}

/// One `DecideRequest`, as the decider reads it.
#[derive(Debug, Clone, Default)]
pub struct Incoming {
    /// The `part`: `Nodes` as ranges, every other part as prost decodes it.
    pub part: Option<IncomingPart>,
}

#[derive(Debug, Clone)]
pub enum IncomingPart {
    Nodes(NodeRanges),
    Other(Part),
}

/// Why a request's bytes are not a `DecideRequest`.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Decode(#[from] prost::DecodeError),
    #[error("a length-delimited field runs past the end of its message")]
    Truncated,
}

/// Reads one `DecideRequest` from `buf` (all of it).
pub fn decode_request(buf: &mut impl Buf) -> Result<Incoming, RequestError> {
    let bytes = buf.copy_to_bytes(buf.remaining());
    let mut cur: &[u8] = &bytes;
    let mut part: Option<IncomingPart> = None;
    while !cur.is_empty() {
        let (tag, wire_type) = decode_key(&mut cur)?;
        match tag {
            2 => {
                check_wire_type(WireType::LengthDelimited, wire_type)?;
                let body = delimited(&mut cur)?;
                let offset = bytes.len() - cur.len() - body.len();
                let mut nodes = match part.take() {
                    Some(IncomingPart::Nodes(n)) => n.nodes,
                    _ => Vec::new(),
                };
                node_batch(body, offset, &mut nodes)?;
                part = Some(IncomingPart::Nodes(NodeRanges {
                    bytes: bytes.clone(),
                    nodes,
                }));
            }
            1 | 3 | 4 | 5 => {
                // prost's own merge of the `oneof`, into what is there.
                let mut other = match part.take() {
                    Some(IncomingPart::Other(p)) => Some(p),
                    _ => None,
                };
                Part::merge(&mut other, tag, wire_type, &mut cur, DecodeContext::default())?;
                part = other.map(IncomingPart::Other);
            }
            15 => {
                // The trace context is not consulted here (the call's
                // metadata carries it), but a malformed one is refused, as
                // prost refuses it.
                check_wire_type(WireType::LengthDelimited, wire_type)?;
                pb::TraceContext::decode(delimited(&mut cur)?)?;
            }
            _ => skip_field(wire_type, tag, &mut cur, DecodeContext::default())?,
        }
    }
    Ok(Incoming { part })
}

/// The next length-delimited body.
fn delimited<'a>(cur: &mut &'a [u8]) -> Result<&'a [u8], RequestError> {
    let len = decode_varint(cur)?;
    if len > cur.len() as u64 {
        return Err(RequestError::Truncated);
    }
    let (body, rest) = cur.split_at(len as usize);
    *cur = rest;
    Ok(body)
}

/// A `NodeBatch`'s nodes, as ranges of the message; `offset` is where `body`
/// starts in it.
fn node_batch(mut body: &[u8], offset: usize, out: &mut Vec<(usize, usize)>) -> Result<(), RequestError> {
    let end = offset + body.len();
    while !body.is_empty() {
        let (tag, wire_type) = decode_key(&mut body)?;
        if tag == 1 {
            check_wire_type(WireType::LengthDelimited, wire_type)?;
            let node = delimited(&mut body)?;
            let node_end = end - body.len();
            out.push((node_end - node.len(), node_end));
        } else {
            skip_field(wire_type, tag, &mut body, DecodeContext::default())?;
        }
    }
    Ok(())
}

/// One `pb::NodeState` decoded into again and again: its node id and fact
/// strings keep their capacity, so a node costs no allocation to decode.
#[derive(Debug, Default)]
pub struct NodeScratch(pb::NodeState);

impl NodeScratch {
    /// Decodes `body`, an encoded `NodeState`, as prost would into a fresh
    /// message.
    pub fn read(&mut self, body: &[u8]) -> Result<&pb::NodeState, prost::DecodeError> {
        let n = &mut self.0;
        let mut node_id = std::mem::take(&mut n.node_id);
        node_id.clear();
        // Facts present but empty convert as absent facts do.
        let facts = n.facts.take().map(|f| {
            let pb::NodeFacts {
                mut lease_id,
                mut endpoint,
                mut session_id,
                ..
            } = f;
            lease_id.clear();
            endpoint.clear();
            session_id.clear();
            pb::NodeFacts {
                lease_id,
                endpoint,
                session_id,
                ..Default::default()
            }
        });
        *n = pb::NodeState {
            node_id,
            facts,
            ..Default::default()
        };
        n.merge(body)?;
        Ok(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;
    use crate::{
        ids::GroupInterner,
        wire::{
            TemplateTable,
            encode::tests::{Gen, node, template},
            node_from_wire, node_from_wire_ref,
        },
    };

    fn nodes_message(nodes: Vec<pb::NodeState>) -> Vec<u8> {
        pb::DecideRequest {
            part: Some(Part::Nodes(pb::NodeBatch { nodes })),
            trace: Some(pb::TraceContext {
                traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
                tracestate: String::new(),
            }),
        }
        .encode_to_vec()
    }

    #[test]
    fn nodes_read_through_one_scratch_convert_as_prost_decoded_ones() {
        let templates: Vec<_> = ["a", "b", "c"].into_iter().map(template).collect();
        let mut g = Gen(0x5851_f42d_4c95_7f2d);
        let mut table = TemplateTable::default();
        let mut wire: Vec<pb::NodeState> = (0..3_000)
            .map(|_| crate::wire::node_to_wire(&node(&mut g, &templates), &mut table))
            .collect();
        // Facts and retry absent, and a node that does not convert, between
        // nodes that hold every fact.
        let bare = pb::NodeState {
            facts: None,
            retry: None,
            ..wire[0].clone()
        };
        wire.insert(10, bare.clone());
        wire.insert(500, bare);
        wire.insert(
            700,
            pb::NodeState {
                node_id: "no index".to_owned(),
                ..wire[1].clone()
            },
        );
        let table = TemplateTable::from_wire(table.into_wire()).unwrap();
        let bytes = nodes_message(wire.clone());
        let Some(IncomingPart::Nodes(ranges)) = decode_request(&mut &bytes[..]).unwrap().part else {
            panic!("no nodes part");
        };
        assert_eq!(ranges.len(), wire.len());
        let mut scratch = NodeScratch::default();
        let mut groups = GroupInterner::default();
        for (i, (body, w)) in ranges.iter().zip(wire).enumerate() {
            let read = scratch.read(body).unwrap();
            let direct = node_from_wire_ref(read, &table, &mut groups).map_err(|e| e.to_string());
            let by_prost = node_from_wire(w, &table).map_err(|e| e.to_string());
            assert_eq!(direct, by_prost, "node {i}");
        }
    }

    #[test]
    fn other_parts_and_broken_messages_read_as_prost_reads_them() {
        let messages = [
            pb::DecideRequest {
                part: Some(Part::Header(pb::DecideHeader {
                    now_ms: 5,
                    deleting: true,
                    ..Default::default()
                })),
                trace: None,
            },
            pb::DecideRequest {
                part: Some(Part::Slots(pb::SlotBatch {
                    group_id: "w".to_owned(),
                    indices: vec![1, 2, 300],
                })),
                trace: None,
            },
            pb::DecideRequest {
                part: Some(Part::End(pb::DecideEnd {})),
                trace: None,
            },
            pb::DecideRequest {
                part: None,
                trace: None,
            },
        ];
        for m in &messages {
            let bytes = m.encode_to_vec();
            let read = decode_request(&mut &bytes[..]).unwrap();
            match (read.part, &m.part) {
                (Some(IncomingPart::Other(p)), Some(q)) => assert_eq!(&p, q),
                (None, None) => {}
                (other, _) => panic!("{m:?} read as {other:?}"),
            }
        }
        // A nodes part then a slots part: the slots are the part, as in prost.
        let mut two = nodes_message(vec![pb::NodeState::default()]);
        two.extend(messages[1].encode_to_vec());
        assert!(matches!(
            decode_request(&mut &two[..]).unwrap().part,
            Some(IncomingPart::Other(Part::Slots(_)))
        ));
        // Two nodes parts merge.
        let one = pb::NodeState {
            node_id: "w-1".to_owned(),
            ..Default::default()
        };
        let mut two = nodes_message(vec![one.clone()]);
        two.extend(nodes_message(vec![one.clone(), one]));
        let Some(IncomingPart::Nodes(n)) = decode_request(&mut &two[..]).unwrap().part else {
            panic!("no nodes part");
        };
        assert_eq!(n.len(), 3);
        // Every truncation and flipped byte of a nodes message: refused by
        // both, or read alike, or (the one difference) refused by prost and
        // then refused when the broken node is read.
        let mut g = Gen(0x1234_5678_9abc_def1);
        let templates = [template("a")];
        let mut table = TemplateTable::default();
        let wire: Vec<_> = (0..3)
            .map(|_| crate::wire::node_to_wire(&node(&mut g, &templates), &mut table))
            .collect();
        let good = nodes_message(wire);
        let table = TemplateTable::from_wire(table.into_wire()).unwrap();
        // A node read into the scratch holds empty facts where prost's has
        // none; they convert alike, so nodes are compared converted.
        let convert = |n: &pb::NodeState| {
            node_from_wire_ref(n, &table, &mut GroupInterner::default()).map_err(|e| e.to_string())
        };
        let mut broken: Vec<Vec<u8>> = (0..good.len()).map(|cut| good[..cut].to_vec()).collect();
        for at in 0..good.len() {
            for flip in [0x80, 0x07, 0xff] {
                let mut bad = good.clone();
                bad[at] ^= flip;
                broken.push(bad);
            }
        }
        for bad in broken {
            let by_prost = pb::DecideRequest::decode(&bad[..]);
            let direct = decode_request(&mut &bad[..]);
            match (by_prost, direct) {
                (Err(_), Err(_)) => {}
                (Ok(p), Ok(d)) => match (p.part, d.part) {
                    (Some(Part::Nodes(b)), Some(IncomingPart::Nodes(r))) => {
                        let mut scratch = NodeScratch::default();
                        let read: Vec<_> = r.iter().map(|n| scratch.read(n).ok().map(&convert)).collect();
                        let by_prost: Vec<_> = b.nodes.iter().map(|n| Some(convert(n))).collect();
                        assert_eq!(read, by_prost);
                    }
                    (Some(p), Some(IncomingPart::Other(d))) => assert_eq!(p, d),
                    (None, None) => {}
                    (p, d) => panic!("prost read {p:?}, the decider {d:?}"),
                },
                (Err(_), Ok(d)) => {
                    let Some(IncomingPart::Nodes(r)) = d.part else {
                        panic!("only a node may be refused late: {d:?}");
                    };
                    let mut scratch = NodeScratch::default();
                    assert!(r.iter().any(|n| scratch.read(n).is_err()));
                }
                (Ok(p), Err(e)) => panic!("prost read {p:?}, the decider refused it: {e}"),
            }
        }
    }
}
