//! A node's `NodeState` written straight into a byte buffer, for the one
//! message that carries a run's nodes by the thousand: the `Decide` call's node
//! batches.
//!
//! [`node_to_wire`](super::node_to_wire) builds a `pb::NodeState` (a string for
//! the node id, one for each fact) that prost then measures and encodes; a
//! pass over 100,000 nodes did that 100,000 times on the driver's hot path.
//! [`encode_node`] writes the same fields from the [`ManagedNode`] itself, with
//! no allocation once its buffer has grown; [`encode_decision`] does the same
//! for the decider's answer. What it writes decodes to exactly
//! what `node_to_wire` builds, templates interned in the same order (the
//! tests hold it to that over every stage, fact and surge); the bytes may
//! differ only where protobuf lets two encodings mean one message.
//!
//! Nested messages (`facts`, `pending`, `retry`, and `facts.health`) are
//! written in place behind a one-byte length, which is widened after the fact
//! in the rare case a body reaches 128 bytes (a long failure reason).

use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};

use super::{NO_REASON, TemplateTable, action_to_wire};
use crate::{
    decision::Decision,
    pb,
    state::{ManagedNode, NodeFacts, PendingOp, RetryState, Surge},
    time::UnixMillis,
};

/// Appends the body of `n`'s `NodeState` (no tag or length of its own) to
/// `out`, its templates interned into `table` as
/// [`node_to_wire`](super::node_to_wire) interns them.
pub fn encode_node(n: &ManagedNode, table: &mut TemplateTable, out: &mut Vec<u8>) {
    // The node's own template first, then a permanent failure's: the order
    // `node_to_wire` interns them in, so both give the same indices.
    let template_ref = table.intern(&n.spec);
    put_key(out, 1, WireType::LengthDelimited);
    encode_varint(n.id.wire_len() as u64, out);
    n.id.push_wire(out);
    put_u64(out, 2, n.attempt.get());
    put_enum(out, 3, pb::Intent::from(n.intent) as i32);
    put_enum(out, 4, pb::NodeStage::from(n.stage) as i32);
    nested(out, 5, |out| facts(&n.facts, out));
    if let Some(p) = &n.pending {
        nested(out, 6, |out| pending(p, out));
    }
    nested(out, 7, |out| retry(&n.retry, table, out));
    put_u64(out, 8, UnixMillis::to_wire(n.stage_deadline));
    put_u64(out, 9, u64::from(template_ref));
    let (successor_attempt, successor_ready) = match n.surge {
        Surge::Current {
            successor,
            successor_ready,
        } => (successor.get(), successor_ready),
        _ => (0, false),
    };
    put_u64(out, 10, successor_attempt);
    put_bool(out, 11, successor_ready);
    put_bool(out, 12, n.surge == Surge::Successor);
}

/// Appends the body of `d`'s `Decision` (no tag or length of its own) to
/// `out`: what prost writes for `pb::Decision::from(d)`, without its strings.
pub fn encode_decision(d: &Decision, out: &mut Vec<u8>) {
    let (kind, effect, until_ms) = action_to_wire(d.action);
    put_key(out, 1, WireType::LengthDelimited);
    encode_varint(d.node.wire_len() as u64, out);
    d.node.push_wire(out);
    put_u64(out, 2, d.attempt.map_or(0, |a| a.get()));
    put_u64(out, 3, u64::from(d.rule.number()));
    put_enum(out, 4, kind as i32);
    put_enum(out, 5, effect as i32);
    put_str(out, 6, &d.reason);
    put_u64(out, 7, until_ms);
}

/// Appends `body` as field `tag`, length-delimited.
pub fn put_message(out: &mut Vec<u8>, tag: u32, body: &[u8]) {
    put_key(out, tag, WireType::LengthDelimited);
    encode_varint(body.len() as u64, out);
    out.extend_from_slice(body);
}

/// The bytes [`put_message`] appends for a body of `len` bytes under `tag`.
pub fn message_len(tag: u32, len: usize) -> usize {
    prost::encoding::key_len(tag) + encoded_len_varint(len as u64) + len
}

fn facts(f: &NodeFacts, out: &mut Vec<u8>) {
    put_str(out, 1, f.lease.as_ref().map_or("", |l| l.as_str()));
    put_str(out, 2, f.endpoint.as_ref().map_or("", |e| e.as_str()));
    put_str(out, 3, f.session.as_ref().map_or("", |s| s.as_str()));
    if let Some(b) = &f.bootstrap {
        put_enum(out, 4, pb::BootstrapStage::from(b.stage) as i32);
        put_u64(out, 5, b.seq);
    }
    if let Some(fail) = &f.failure {
        put_str(out, 6, reason(&fail.reason));
        put_u64(out, 7, fail.at.as_millis());
    }
    put_bool(out, 8, f.ambiguous_create);
    put_bool(out, 9, f.ambiguous_bootstrap);
    if let Some(b) = &f.bootstrap {
        put_u64(out, 10, b.at.as_millis());
    }
    put_bool(out, 11, f.lost);
    if let Some(h) = &f.health {
        nested(out, 12, |out| {
            put_bool(out, 1, h.healthy);
            put_u64(out, 2, h.since.as_millis());
            put_u64(out, 3, h.observed_at.as_millis());
            put_str(out, 4, &h.detail);
            put_u64(out, 5, UnixMillis::to_wire(h.remediate_at));
            put_u64(out, 6, h.seq);
        });
    }
}

fn pending(p: &PendingOp, out: &mut Vec<u8>) {
    nested(out, 1, |out| {
        put_u64(out, 1, p.id.attempt().get());
        put_u64(out, 2, u64::from(p.id.seq()));
    });
    put_enum(out, 2, pb::Effect::from(p.effect) as i32);
    put_u64(out, 3, p.deadline.as_millis());
    put_u64(out, 4, p.dispatched_at.as_millis());
}

fn retry(r: &RetryState, table: &mut TemplateTable, out: &mut Vec<u8>) {
    put_u64(out, 1, u64::from(r.consecutive_failures));
    put_u64(out, 2, UnixMillis::to_wire(r.next_effect_at));
    put_u64(out, 3, UnixMillis::to_wire(r.restart_at));
    if let Some(p) = &r.permanent {
        put_str(out, 4, reason(&p.reason));
        put_u64(out, 5, u64::from(table.intern(&p.spec)));
    }
    put_bool(out, 6, r.remediating);
}

/// A failure's reason as the wire carries it (empty means "no failure").
fn reason(r: &str) -> &str {
    if r.is_empty() { NO_REASON } else { r }
}

fn put_key(out: &mut Vec<u8>, tag: u32, wire_type: WireType) {
    encode_key(tag, wire_type, out);
}

/// A `uint64`, `uint32` or `bool`-free scalar: omitted when zero, as proto3
/// omits a default.
fn put_u64(out: &mut Vec<u8>, tag: u32, v: u64) {
    if v != 0 {
        put_key(out, tag, WireType::Varint);
        encode_varint(v, out);
    }
}

fn put_enum(out: &mut Vec<u8>, tag: u32, v: i32) {
    if v != 0 {
        put_key(out, tag, WireType::Varint);
        // Protobuf sign-extends a negative `int32`/enum to ten bytes.
        encode_varint(i64::from(v) as u64, out);
    }
}

fn put_bool(out: &mut Vec<u8>, tag: u32, v: bool) {
    if v {
        put_key(out, tag, WireType::Varint);
        out.push(1);
    }
}

fn put_str(out: &mut Vec<u8>, tag: u32, s: &str) {
    if !s.is_empty() {
        put_message(out, tag, s.as_bytes());
    }
}

/// Writes field `tag` as a message whose body `body` appends: behind a
/// one-byte length, widened once the body is known to need more.
fn nested(out: &mut Vec<u8>, tag: u32, body: impl FnOnce(&mut Vec<u8>)) {
    put_key(out, tag, WireType::LengthDelimited);
    let at = out.len();
    out.push(0);
    body(out);
    let len = out.len() - at - 1;
    if len < 0x80 {
        out[at] = len as u8;
        return;
    }
    let mut prefix = Vec::with_capacity(encoded_len_varint(len as u64));
    encode_varint(len as u64, &mut prefix);
    out.splice(at..=at, prefix);
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::Arc;

    use prost::Message as _;

    use super::*;
    use crate::{
        health::NodeHealth,
        ids::{AttemptId, Endpoint, GroupId, LeaseId, LogicalNodeId, OperationId, SessionId},
        shape::{NodeTemplate, example_template},
        state::{
            BootstrapProgress, BootstrapStage, Effect, Failure, Intent, NodeStage, PendingOp,
            PermanentFailure,
        },
        wire::node_to_wire,
    };

    /// A small deterministic generator, so that a failure names its case.
    pub(crate) struct Gen(pub(crate) u64);

    impl Gen {
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        pub(crate) fn one_in(&mut self, n: u64) -> bool {
            self.next().is_multiple_of(n)
        }

        pub(crate) fn pick<T: Copy>(&mut self, of: &[T]) -> T {
            of[(self.next() % of.len() as u64) as usize]
        }

        pub(crate) fn millis(&mut self) -> UnixMillis {
            UnixMillis::new(self.pick(&[1, 127, 128, 1_700_000_000_000, u64::MAX / 2]))
        }

        /// Text of a length around the one-byte length's edge, or long.
        pub(crate) fn text(&mut self, what: &str) -> String {
            let len = self.pick(&[0, 1, 100, 127, 128, 300, 20_000]);
            let mut s = format!("{what}-");
            while s.len() < len {
                s.push(char::from(b'a' + (self.next() % 26) as u8));
            }
            if len == 0 { String::new() } else { s }
        }
    }

    pub(crate) fn template(image: &str) -> Arc<NodeTemplate> {
        Arc::new(example_template("fake", image))
    }

    pub(crate) fn node(g: &mut Gen, templates: &[Arc<NodeTemplate>]) -> ManagedNode {
        let group = GroupId::parse(
            "group",
            g.pick(&["w", "workers", "a-long-group-name-of-forty-characters-x"]),
        )
        .unwrap();
        let index = g.pick(&[0, 9, 10, 127, 128, 99_999, u32::MAX]);
        let attempt = AttemptId::new(g.pick(&[1, 127, 128, 1 << 40, u64::MAX]));
        let mut n = ManagedNode::new(
            LogicalNodeId::new(group, index),
            attempt,
            Arc::clone(&templates[(g.next() % templates.len() as u64) as usize]),
            RetryState::default(),
        );
        n.intent = g.pick(&[Intent::Active, Intent::Deleting]);
        n.stage = g.pick(&NodeStage::ALL);
        let f = &mut n.facts;
        if g.one_in(2) {
            f.lease = Some(LeaseId::new("lease", &format!("lease-{}", g.next())).unwrap());
        }
        if g.one_in(2) {
            f.endpoint = Some(Endpoint::new("endpoint", "127.0.0.1:40027").unwrap());
        }
        if g.one_in(3) {
            f.session = Some(SessionId::new("session", &format!("session-{}", g.next())).unwrap());
        }
        if g.one_in(3) {
            f.bootstrap = Some(BootstrapProgress {
                stage: g.pick(&[
                    BootstrapStage::Connected,
                    BootstrapStage::AgentStarted,
                    BootstrapStage::Converged,
                    BootstrapStage::FailedJoin,
                ]),
                seq: g.pick(&[0, 3, 1 << 33]),
                at: g.millis(),
                // Not on the wire: it decodes as empty either way.
                detail: String::new(),
            });
        }
        if g.one_in(3) {
            f.failure = Some(Failure {
                reason: g.text("failure"),
                at: g.millis(),
            });
        }
        f.ambiguous_create = g.one_in(4);
        f.ambiguous_bootstrap = g.one_in(4);
        f.lost = g.one_in(5);
        if g.one_in(3) {
            f.health = Some(NodeHealth {
                healthy: g.one_in(2),
                since: g.millis(),
                observed_at: g.millis(),
                seq: g.pick(&[0, 1, 1 << 50]),
                detail: g.text("probe"),
                remediate_at: g.one_in(2).then(|| g.millis()),
            });
        }
        if g.one_in(2) {
            n.pending = Some(PendingOp {
                id: OperationId::new(attempt, g.pick(&[0, 1, 200, u32::MAX])),
                effect: g.pick(&Effect::ALL),
                deadline: g.millis(),
                dispatched_at: g.millis(),
            });
        }
        n.retry = RetryState {
            consecutive_failures: g.pick(&[0, 1, 300]),
            next_effect_at: g.one_in(2).then(|| g.millis()),
            restart_at: g.one_in(3).then(|| g.millis()),
            permanent: g.one_in(4).then(|| PermanentFailure {
                spec: Arc::clone(&templates[(g.next() % templates.len() as u64) as usize]),
                reason: g.text("permanent"),
            }),
            remediating: g.one_in(3),
        };
        n.stage_deadline = g.one_in(2).then(|| g.millis());
        n.surge = match g.next() % 3 {
            0 => Surge::None,
            1 => Surge::Current {
                successor: AttemptId::new(g.pick(&[2, 1 << 40])),
                successor_ready: g.one_in(2),
            },
            _ => Surge::Successor,
        };
        n
    }

    #[test]
    fn what_encode_node_writes_decodes_to_what_node_to_wire_builds() {
        let templates: Vec<_> = ["a", "b", "c"].into_iter().map(template).collect();
        let mut g = Gen(0x9e37_79b9_7f4a_7c15);
        let mut direct = TemplateTable::default();
        let mut built = TemplateTable::default();
        let mut buf = Vec::new();
        for case in 0..5_000 {
            let n = node(&mut g, &templates);
            buf.clear();
            encode_node(&n, &mut direct, &mut buf);
            let decoded =
                pb::NodeState::decode(buf.as_slice()).unwrap_or_else(|e| panic!("case {case}: {e}: {n:?}"));
            assert_eq!(decoded, node_to_wire(&n, &mut built), "case {case}: {n:?}");
        }
        assert_eq!(direct.into_wire(), built.into_wire());
    }

    #[test]
    fn what_encode_decision_writes_decodes_to_what_from_builds() {
        use std::borrow::Cow;

        use crate::decision::{Action, Rule};
        let mut g = Gen(0x2545_f491_4f6c_dd1d);
        let mut buf = Vec::new();
        let actions = [
            Action::Insert,
            Action::Reap,
            Action::Restart,
            Action::BeginDelete,
            Action::MarkDestroyed,
            Action::ObserveConvergence,
            Action::Surge,
            Action::Dispatch(Effect::CreateLease),
            Action::Dispatch(Effect::DestroyLease),
            Action::Wait { until: None },
            Action::Wait {
                until: Some(UnixMillis::new(1_700_000_000_000)),
            },
        ];
        for case in 0..2_000 {
            let group = GroupId::parse("group", g.pick(&["w", "workers"])).unwrap();
            let reason = g.text("reason");
            let d = Decision {
                node: LogicalNodeId::new(group, g.pick(&[0, 7, 128, u32::MAX])),
                attempt: g.one_in(3).then(|| AttemptId::new(g.pick(&[1, 1 << 40]))),
                rule: g.pick(&Rule::ALL),
                action: g.pick(&actions),
                reason: if g.one_in(2) {
                    Cow::Borrowed("a static reason")
                } else {
                    Cow::Owned(reason)
                },
            };
            buf.clear();
            encode_decision(&d, &mut buf);
            let decoded = pb::Decision::decode(buf.as_slice()).unwrap_or_else(|e| panic!("case {case}: {e}"));
            assert_eq!(decoded, pb::Decision::from(&d), "case {case}: {d:?}");
        }
    }

    #[test]
    fn a_nested_body_of_128_bytes_or_more_gets_a_wider_length() {
        let mut out = Vec::new();
        for len in [0, 1, 127, 128, 16_383, 16_384, 70_000] {
            out.clear();
            nested(&mut out, 4, |out| out.resize(out.len() + len, b'x'));
            let mut expected = Vec::new();
            put_message(&mut expected, 4, &vec![b'x'; len]);
            assert_eq!(out, expected, "len {len}");
            assert_eq!(out.len(), message_len(4, len), "len {len}");
        }
    }
}
