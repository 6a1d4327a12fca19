//! A `Decide` call's answer read straight from its bytes, for the one
//! message that carries a run's decisions by the thousand.
//!
//! prost decodes each `pb::Decision` into a struct with a `String` for the
//! node id and one for the reason, and [`decision_from_wire`](super::decision_from_wire)
//! then parses the node id again. [`decode_answer`] reads a `DecideResponse`
//! into [`Decisions`]: the message's bytes, shared, and each decision's numbers
//! and the ranges of its strings (checked UTF-8, as prost checks them).
//! [`Decisions::decision`] converts one with the same checks as
//! `decision_from_wire`, by the same code. What prost would accept, this
//! accepts, to the same message: fields in any order, unknown fields skipped,
//! a repeated `decisions` part merged, the last part of the `oneof` kept (the
//! tests hold it to prost's decoding, truncations and flipped bytes included).

use prost::{
    Message as _,
    bytes::{Buf, Bytes},
    encoding::{DecodeContext, WireType, check_wire_type, decode_key, decode_varint, skip_field},
};

use super::decision_from_parts;
use crate::{decision::Decision, error::FieldError, ids::GroupInterner, pb};

/// A `Decision` as it arrived: its strings still where they are in the
/// message's bytes (checked UTF-8), its numbers not yet checked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct RawDecision {
    node_id: (u32, u32),
    reason: (u32, u32),
    attempt: u64,
    until_ms: u64,
    rule: u32,
    kind: i32,
    effect: i32,
}

/// The decisions of one `DecideResponse` (or of several merged), read but
/// not yet checked: [`Decisions::decision`] checks each.
#[derive(Debug, Clone, Default)]
pub struct Decisions {
    bytes: Bytes,
    raw: Vec<RawDecision>,
}

impl Decisions {
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    /// The `i`th decision, with the same checks and errors as
    /// [`decision_from_wire`](super::decision_from_wire), by the same code.
    pub fn decision(&self, i: usize, groups: &mut GroupInterner) -> Option<Result<Decision, FieldError>> {
        let d = self.raw.get(i)?;
        Some(decision_from_parts(
            self.text(d.node_id),
            d.attempt,
            d.rule,
            d.kind,
            d.effect,
            d.until_ms,
            self.text(d.reason).to_owned(),
            groups,
        ))
    }

    /// A string field [`decode_answer`] has checked.
    fn text(&self, (start, end): (u32, u32)) -> &str {
        self.bytes
            .get(start as usize..end as usize)
            .and_then(|b| std::str::from_utf8(b).ok())
            .unwrap_or_default()
    }

    /// The decisions as prost decodes them, for comparing.
    fn to_wire(&self) -> Vec<pb::Decision> {
        self.raw
            .iter()
            .map(|d| pb::Decision {
                node_id: self.text(d.node_id).to_owned(),
                attempt: d.attempt,
                rule: d.rule,
                kind: d.kind,
                effect: d.effect,
                reason: self.text(d.reason).to_owned(),
                until_ms: d.until_ms,
            })
            .collect()
    }

    /// Appends `more`'s decisions.
    fn extend(&mut self, more: Decisions) {
        if self.raw.is_empty() {
            *self = more;
            return;
        }
        let mut bytes = Vec::with_capacity(self.bytes.len() + more.bytes.len());
        bytes.extend_from_slice(&self.bytes);
        let shift = u32::try_from(self.bytes.len()).unwrap_or(u32::MAX);
        bytes.extend_from_slice(&more.bytes);
        self.bytes = Bytes::from(bytes);
        let moved = |(a, b): (u32, u32)| (a.saturating_add(shift), b.saturating_add(shift));
        self.raw.extend(more.raw.into_iter().map(|d| RawDecision {
            node_id: moved(d.node_id),
            reason: moved(d.reason),
            ..d
        }));
    }
}

impl PartialEq for Decisions {
    fn eq(&self, other: &Self) -> bool {
        self.to_wire() == other.to_wire()
    }
}

impl Eq for Decisions {}

impl From<Vec<pb::Decision>> for Decisions {
    fn from(ds: Vec<pb::Decision>) -> Self {
        let mut bytes = Vec::new();
        let mut at = |s: &str| {
            let start = bytes.len();
            bytes.extend_from_slice(s.as_bytes());
            let pos = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
            (pos(start), pos(bytes.len()))
        };
        let raw = ds
            .iter()
            .map(|d| RawDecision {
                node_id: at(&d.node_id),
                reason: at(&d.reason),
                attempt: d.attempt,
                until_ms: d.until_ms,
                rule: d.rule,
                kind: d.kind,
                effect: d.effect,
            })
            .collect();
        Self {
            bytes: Bytes::from(bytes),
            raw,
        }
    }
}

/// One `DecideResponse`'s `part`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Decisions(Decisions),
    Summary(pb::DecideSummary),
    /// The message has no part.
    None,
}

impl From<pb::DecideResponse> for Answer {
    fn from(r: pb::DecideResponse) -> Self {
        match r.part {
            Some(pb::decide_response::Part::Decisions(b)) => Answer::Decisions(b.decisions.into()),
            Some(pb::decide_response::Part::Summary(s)) => Answer::Summary(s),
            None => Answer::None,
        }
    }
}

/// Why an answer's bytes are not a `DecideResponse`.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    #[error(transparent)]
    Decode(#[from] prost::DecodeError),
    #[error("a length-delimited field runs past the end of its message")]
    Truncated,
    #[error("`{0}` is not UTF-8")]
    NotUtf8(&'static str),
    #[error("the message is over 4 GiB")]
    TooLong,
}

/// Reads one `DecideResponse` from `buf` (all of it).
pub fn decode_answer(buf: &mut impl Buf) -> Result<Answer, AnswerError> {
    // One copy of the message (none where `buf` is already shared bytes);
    // every string is a range of it.
    let bytes = buf.copy_to_bytes(buf.remaining());
    if u32::try_from(bytes.len()).is_err() {
        return Err(AnswerError::TooLong);
    }
    let mut r = Reader {
        all: &bytes,
        cur: &bytes,
        end: bytes.len(),
    };
    let mut part = Answer::None;
    while !r.cur.is_empty() {
        let (tag, wire_type) = decode_key(&mut r.cur)?;
        match tag {
            1 => {
                check_wire_type(WireType::LengthDelimited, wire_type)?;
                let (start, end) = r.delimited()?;
                let mut raw = Vec::new();
                decision_batch(&mut r.within(start, end), &mut raw)?;
                let read = Decisions {
                    bytes: bytes.clone(),
                    raw,
                };
                part = match std::mem::replace(&mut part, Answer::None) {
                    Answer::Decisions(mut d) => {
                        d.extend(read);
                        Answer::Decisions(d)
                    }
                    _ => Answer::Decisions(read),
                };
            }
            2 => {
                check_wire_type(WireType::LengthDelimited, wire_type)?;
                let (start, end) = r.delimited()?;
                let mut summary = match std::mem::replace(&mut part, Answer::None) {
                    Answer::Summary(s) => s,
                    _ => pb::DecideSummary::default(),
                };
                summary.merge(&bytes[start as usize..end as usize])?;
                part = Answer::Summary(summary);
            }
            _ => skip_field(wire_type, tag, &mut r.cur, DecodeContext::default())?,
        }
    }
    Ok(part)
}

/// A cursor over one message: `cur` is what is left of `all[..end]`.
struct Reader<'a> {
    all: &'a [u8],
    cur: &'a [u8],
    end: usize,
}

impl<'a> Reader<'a> {
    fn at(&self) -> u32 {
        // `decode_answer` refuses a message over `u32::MAX` bytes.
        (self.end - self.cur.len()) as u32
    }

    /// The next length-delimited field's body, as a range of the message.
    fn delimited(&mut self) -> Result<(u32, u32), AnswerError> {
        let len = decode_varint(&mut self.cur)?;
        if len > self.cur.len() as u64 {
            return Err(AnswerError::Truncated);
        }
        let start = self.at();
        self.cur = &self.cur[len as usize..];
        Ok((start, self.at()))
    }

    /// A reader over `start..end` of the same message.
    fn within(&self, start: u32, end: u32) -> Reader<'a> {
        Reader {
            all: self.all,
            cur: &self.all[start as usize..end as usize],
            end: end as usize,
        }
    }
}

/// A `DecisionBatch`'s decisions, appended to `out`.
fn decision_batch(r: &mut Reader<'_>, out: &mut Vec<RawDecision>) -> Result<(), AnswerError> {
    while !r.cur.is_empty() {
        let (tag, wire_type) = decode_key(&mut r.cur)?;
        if tag == 1 {
            check_wire_type(WireType::LengthDelimited, wire_type)?;
            let (start, end) = r.delimited()?;
            out.push(decision(&mut r.within(start, end))?);
        } else {
            skip_field(wire_type, tag, &mut r.cur, DecodeContext::default())?;
        }
    }
    Ok(())
}

fn decision(r: &mut Reader<'_>) -> Result<RawDecision, AnswerError> {
    let mut d = RawDecision::default();
    while !r.cur.is_empty() {
        let (tag, wire_type) = decode_key(&mut r.cur)?;
        match tag {
            1 => d.node_id = string(r, wire_type, "node_id")?,
            2 => d.attempt = varint(r, wire_type)?,
            // As prost reads `uint32` and `int32`: the low bits of the varint.
            3 => d.rule = varint(r, wire_type)? as u32,
            4 => d.kind = varint(r, wire_type)? as i32,
            5 => d.effect = varint(r, wire_type)? as i32,
            6 => d.reason = string(r, wire_type, "reason")?,
            7 => d.until_ms = varint(r, wire_type)?,
            _ => skip_field(wire_type, tag, &mut r.cur, DecodeContext::default())?,
        }
    }
    Ok(d)
}

fn varint(r: &mut Reader<'_>, wire_type: WireType) -> Result<u64, AnswerError> {
    check_wire_type(WireType::Varint, wire_type)?;
    Ok(decode_varint(&mut r.cur)?)
}

fn string(r: &mut Reader<'_>, wire_type: WireType, field: &'static str) -> Result<(u32, u32), AnswerError> {
    check_wire_type(WireType::LengthDelimited, wire_type)?;
    let (start, end) = r.delimited()?;
    if std::str::from_utf8(&r.all[start as usize..end as usize]).is_err() {
        return Err(AnswerError::NotUtf8(field));
    }
    Ok((start, end))
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::*;
    use crate::pb::decide_response::Part;

    fn d(node: &str, rule: u32, kind: i32, reason: &str) -> pb::Decision {
        pb::Decision {
            node_id: node.to_owned(),
            attempt: 7,
            rule,
            kind,
            effect: 3,
            reason: reason.to_owned(),
            until_ms: 1_700_000_000_000,
        }
    }

    /// What prost makes of `bytes`, and what `decode_answer` makes of them.
    fn both(bytes: &[u8]) -> (Result<Answer, ()>, Result<Answer, ()>) {
        let by_prost = pb::DecideResponse::decode(bytes)
            .map(Answer::from)
            .map_err(|_| ());
        let direct = decode_answer(&mut &bytes[..]).map_err(|_| ());
        (by_prost, direct)
    }

    #[test]
    fn an_answer_decodes_as_prost_decodes_it() {
        let batch = |ds: Vec<pb::Decision>| pb::DecideResponse {
            part: Some(Part::Decisions(pb::DecisionBatch { decisions: ds })),
        };
        let long = "r".repeat(300);
        let messages = [
            batch(vec![d("w-1", 5, 5, "dispatch"), d("workers-99999", 16, 8, &long)]),
            batch(vec![pb::Decision::default()]),
            batch(Vec::new()),
            pb::DecideResponse {
                part: Some(Part::Summary(pb::DecideSummary {
                    requeue_at_ms: 9,
                    decided_nodes: 2,
                    inserts: 1,
                })),
            },
            pb::DecideResponse { part: None },
        ];
        for m in &messages {
            let bytes = m.encode_to_vec();
            let (by_prost, direct) = both(&bytes);
            assert!(by_prost.is_ok(), "{m:?}");
            assert_eq!(direct, by_prost, "{m:?}");
        }
        // Two `decisions` parts merge; a summary after them is the part.
        let mut two = messages[0].encode_to_vec();
        two.extend(messages[1].encode_to_vec());
        let (by_prost, direct) = both(&two);
        assert!(matches!(&direct, Ok(Answer::Decisions(v)) if v.len() == 3));
        if let Ok(Answer::Decisions(v)) = &direct {
            // The merged decisions' strings moved with them.
            assert_eq!(v.to_wire()[1].node_id, "workers-99999");
            assert_eq!(v.to_wire()[2], pb::Decision::default());
        }
        assert_eq!(direct, by_prost);
        two.extend(messages[3].encode_to_vec());
        let (by_prost, direct) = both(&two);
        assert!(matches!(direct, Ok(Answer::Summary(_))));
        assert_eq!(direct, by_prost);
        // Unknown fields at every level are skipped: field 9 of a decision,
        // of a batch and of the response, each length-delimited or a varint.
        let unknown = |mut body: Vec<u8>| {
            body.extend([(9 << 3) | 2, 2, b'x', b'y', 9 << 3, 0x96, 0x01]);
            body
        };
        let decision = unknown(d("w-3", 1, 1, "x").encode_to_vec());
        let mut batch_body = Vec::new();
        super::super::encode::put_message(&mut batch_body, 1, &decision);
        let batch_body = unknown(batch_body);
        let mut response = Vec::new();
        super::super::encode::put_message(&mut response, 1, &batch_body);
        let response = unknown(response);
        let (by_prost, direct) = both(&response);
        assert!(matches!(&by_prost, Ok(Answer::Decisions(v)) if v.len() == 1));
        assert_eq!(direct, by_prost);
    }

    #[test]
    fn a_broken_answer_is_refused_as_prost_refuses_it() {
        let good = pb::DecideResponse {
            part: Some(Part::Decisions(pb::DecisionBatch {
                decisions: vec![d("w-1", 5, 5, "dispatch")],
            })),
        }
        .encode_to_vec();
        // Every truncation of a good message, and one byte flipped at each
        // place, is refused by both or read alike by both.
        for cut in 0..good.len() {
            let (by_prost, direct) = both(&good[..cut]);
            assert_eq!(direct, by_prost, "cut at {cut}");
        }
        for at in 0..good.len() {
            for flip in [0x80, 0x07, 0xff] {
                let mut bad = good.clone();
                bad[at] ^= flip;
                let (by_prost, direct) = both(&bad);
                assert_eq!(direct, by_prost, "byte {at} ^ {flip:#x}");
            }
        }
        // A node id that is not UTF-8.
        let mut bad = good.clone();
        let at = bad.windows(3).position(|w| w == b"w-1").unwrap();
        bad[at] = 0xff;
        let (by_prost, direct) = both(&bad);
        assert!(by_prost.is_err());
        assert!(matches!(
            decode_answer(&mut &bad[..]),
            Err(AnswerError::NotUtf8("node_id"))
        ));
        assert_eq!(direct, by_prost);
    }

    #[test]
    fn a_raw_decision_converts_as_decision_from_wire_converts_it() {
        let ws = vec![
            d("w-1", 5, 5, "dispatch"),
            d("w-1", 99, 5, "no such rule"),
            d("w-1", 5, 42, "no such kind"),
            d("not a node", 5, 5, "x"),
            d("w-2", 0, 1, "an insert"),
        ];
        let bytes = pb::DecideResponse {
            part: Some(Part::Decisions(pb::DecisionBatch {
                decisions: ws.clone(),
            })),
        }
        .encode_to_vec();
        let Ok(Answer::Decisions(raw)) = decode_answer(&mut &bytes[..]) else {
            panic!("the batch did not read back");
        };
        assert_eq!(raw.len(), ws.len());
        for (i, w) in ws.into_iter().enumerate() {
            let from_raw = raw.decision(i, &mut GroupInterner::default()).unwrap();
            let from_wire = super::super::decision_from_wire(w, &mut GroupInterner::default());
            assert_eq!(
                from_raw.map_err(|e| e.to_string()),
                from_wire.map_err(|e| e.to_string())
            );
        }
        assert!(raw.decision(5, &mut GroupInterner::default()).is_none());
    }
}
