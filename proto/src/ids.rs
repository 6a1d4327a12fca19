//! Identities. Every id is a newtype with a private field, validated when it is
//! built from outside input, so no bare `String` or `u64` id crosses a function.

use std::{fmt, str::FromStr, sync::Arc};

use crate::error::{FieldError, Problem};

/// Longest run or group id accepted.
pub const MAX_ID_LEN: usize = 63;

/// Checks the id grammar shared by run and group ids: 1..=63 characters of
/// lowercase ASCII letters, digits and `-`, starting with a letter and not ending
/// with `-` (a DNS label, so ids are safe in hostnames, paths and metric labels).
fn check_label(field: &str, s: &str) -> Result<(), FieldError> {
    if s.is_empty() {
        return Err(FieldError::new(field, Problem::Empty));
    }
    if s.len() > MAX_ID_LEN {
        return Err(FieldError::new(
            field,
            Problem::TooLong {
                len: s.len(),
                max: MAX_ID_LEN,
            },
        ));
    }
    let bytes = s.as_bytes();
    let ok_chars = bytes
        .iter()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-');
    if !ok_chars || !bytes[0].is_ascii_lowercase() || bytes[bytes.len() - 1] == b'-' {
        return Err(FieldError::new(
            field,
            Problem::Malformed(
                "expected lowercase letters, digits and '-', starting with a letter and not ending with '-'",
            ),
        ));
    }
    Ok(())
}

/// The caller-chosen name of a run. Fixed for the run's life.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunId(Arc<str>);

impl RunId {
    /// Parses a run id; `field` names the input field in the error.
    pub fn parse(field: &str, s: &str) -> Result<Self, FieldError> {
        check_label(field, s)?;
        Ok(Self(Arc::from(s)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A fresh identity for each incarnation of a run id, so that a run deleted and
/// created again never collides with its past at the executor.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RunUid(u128);

impl RunUid {
    pub const fn from_u128(v: u128) -> Self {
        Self(v)
    }

    pub const fn as_u128(self) -> u128 {
        self.0
    }

    /// The 32 lowercase hex digits of the wire, written without the
    /// formatting machinery: every operation, result and store key of the
    /// link carries one.
    fn hex(self) -> [u8; 32] {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 32];
        for (i, d) in out.iter_mut().enumerate() {
            *d = DIGITS[((self.0 >> (124 - 4 * i)) & 0xf) as usize];
        }
        out
    }

    /// Parses the 32-hex-digit form used on the wire.
    pub fn parse(field: &str, s: &str) -> Result<Self, FieldError> {
        if s.len() != 32
            || !s
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(FieldError::new(
                field,
                Problem::Malformed("expected 32 lowercase hex digits"),
            ));
        }
        u128::from_str_radix(s, 16)
            .map(Self)
            .map_err(|_| FieldError::new(field, Problem::Malformed("expected 32 lowercase hex digits")))
    }
}

/// A group within a shape; slots are named `{group}-{index}`.
///
/// Ids of one group usually share one allocation (see [`GroupInterner`]), so
/// equality and order look at the address first: a run's maps are keyed by
/// node id, and at 1,000,000 nodes comparing group names was an eighth of the
/// driver's time.
#[derive(Clone)]
pub struct GroupId(Arc<str>);

/// The name's hash: ids equal by address are equal by name too.
impl std::hash::Hash for GroupId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl PartialEq for GroupId {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl Eq for GroupId {}

impl PartialOrd for GroupId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for GroupId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        if Arc::ptr_eq(&self.0, &other.0) {
            std::cmp::Ordering::Equal
        } else {
            self.0.cmp(&other.0)
        }
    }
}

impl GroupId {
    pub fn parse(field: &str, s: &str) -> Result<Self, FieldError> {
        check_label(field, s)?;
        Ok(Self(Arc::from(s)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The stable slot `{group_id}-{index}`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogicalNodeId {
    group: GroupId,
    index: u32,
}

impl LogicalNodeId {
    pub fn new(group: GroupId, index: u32) -> Self {
        Self { group, index }
    }

    pub fn group(&self) -> &GroupId {
        &self.group
    }

    pub fn index(&self) -> u32 {
        self.index
    }

    /// Appends the wire's spelling, `{group}-{index}` (what [`Self::to_wire`]
    /// returns), to `out`, without a string of its own.
    pub fn push_wire(&self, out: &mut Vec<u8>) {
        let mut digits = [0u8; 10];
        out.extend_from_slice(self.group.as_str().as_bytes());
        out.push(b'-');
        out.extend_from_slice(decimal_digits(self.index, &mut digits));
    }

    /// The length in bytes of the wire's spelling.
    pub fn wire_len(&self) -> usize {
        let mut digits = [0u8; 10];
        self.group.as_str().len() + 1 + decimal_digits(self.index, &mut digits).len()
    }

    /// The wire's spelling, `{group}-{index}` (what `Display` writes), in one
    /// allocation of its size: every node of every message is named by it.
    pub fn to_wire(&self) -> String {
        let mut digits = [0u8; 10];
        let index = decimal(self.index, &mut digits);
        let group = self.group.as_str();
        let mut s = String::with_capacity(group.len() + 1 + index.len());
        s.push_str(group);
        s.push('-');
        s.push_str(index);
        s
    }

    /// Parses `{group}-{index}`; the index is the digits after the last `-`.
    pub fn parse(field: &str, s: &str) -> Result<Self, FieldError> {
        let (group, index) = Self::split(field, s)?;
        let group = GroupId::parse(field, group)?;
        Ok(Self { group, index })
    }

    fn split<'s>(field: &str, s: &'s str) -> Result<(&'s str, u32), FieldError> {
        let malformed = || FieldError::new(field, Problem::Malformed("expected {group_id}-{index}"));
        let (group, index) = s.rsplit_once('-').ok_or_else(malformed)?;
        if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
            return Err(malformed());
        }
        // No leading zeros, so each slot has exactly one spelling.
        if index.len() > 1 && index.starts_with('0') {
            return Err(malformed());
        }
        let index = index.parse::<u32>().map_err(|_| malformed())?;
        Ok((group, index))
    }
}

/// The group ids already met while decoding a stream of messages, so that
/// the node ids parsed from it share one allocation per group instead of one
/// per node (and compare by address). Holds at most [`GroupInterner::MAX`]
/// groups; ids of groups past that are parsed on their own.
#[derive(Debug, Clone, Default)]
pub struct GroupInterner {
    known: Vec<GroupId>,
}

impl GroupInterner {
    pub const MAX: usize = 64;

    /// An interner that starts with `groups` (a shape's, say).
    pub fn with(groups: impl IntoIterator<Item = GroupId>) -> Self {
        let mut known: Vec<GroupId> = groups.into_iter().collect();
        known.truncate(Self::MAX);
        Self { known }
    }

    /// As [`GroupId::parse`].
    pub fn group(&mut self, field: &str, s: &str) -> Result<GroupId, FieldError> {
        if let Some(g) = self.known.iter().find(|g| g.as_str() == s) {
            return Ok(g.clone());
        }
        let g = GroupId::parse(field, s)?;
        if self.known.len() < Self::MAX {
            self.known.push(g.clone());
        }
        Ok(g)
    }

    /// As [`LogicalNodeId::parse`].
    pub fn node(&mut self, field: &str, s: &str) -> Result<LogicalNodeId, FieldError> {
        let (group, index) = LogicalNodeId::split(field, s)?;
        let group = self.group(field, group)?;
        Ok(LogicalNodeId { group, index })
    }
}

/// One incarnation of a slot, from a per-run monotonic allocator; never reused.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct AttemptId(u64);

impl AttemptId {
    pub const fn new(v: u64) -> Self {
        Self(v)
    }

    pub const fn get(self) -> u64 {
        self.0
    }
}

/// One dispatched effect: (attempt, sequence within the attempt).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OperationId {
    attempt: AttemptId,
    seq: u32,
}

impl OperationId {
    pub const fn new(attempt: AttemptId, seq: u32) -> Self {
        Self { attempt, seq }
    }

    pub const fn attempt(self) -> AttemptId {
        self.attempt
    }

    pub const fn seq(self) -> u32 {
        self.seq
    }
}

/// The version of a desired shape; strictly increases with content.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Generation(u64);

impl Generation {
    pub const fn new(v: u64) -> Self {
        Self(v)
    }

    pub const fn get(self) -> u64 {
        self.0
    }
}

/// A driver's ownership term for a run; each taking of ownership gets a larger one.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Epoch(u64);

impl Epoch {
    pub const fn new(v: u64) -> Self {
        Self(v)
    }

    pub const fn get(self) -> u64 {
        self.0
    }

    /// The next epoch, or `None` on exhaustion.
    pub fn next(self) -> Option<Self> {
        self.0.checked_add(1).map(Self)
    }
}

macro_rules! opaque_string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Wraps a provider-chosen value; empty values are refused.
            pub fn new(field: &str, s: &str) -> Result<Self, FieldError> {
                if s.is_empty() {
                    return Err(FieldError::new(field, Problem::Empty));
                }
                if s.len() > MAX_OPAQUE_LEN {
                    return Err(FieldError::new(field, Problem::TooLong { len: s.len(), max: MAX_OPAQUE_LEN }));
                }
                Ok(Self(Arc::from(s)))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), &*self.0)
            }
        }
    };
}

/// Longest provider-chosen id (lease, session, endpoint) accepted.
pub const MAX_OPAQUE_LEN: usize = 512;

opaque_string_id!(
    /// A provider lease (one machine, process or VM).
    LeaseId
);
opaque_string_id!(
    /// The address at which a lease's node answers, e.g. `127.0.0.1:4242`.
    Endpoint
);
opaque_string_id!(
    /// One bootstrap session with a node.
    SessionId
);

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RunId({:?})", &*self.0)
    }
}

impl fmt::Display for RunUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(std::str::from_utf8(&self.hex()).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for RunUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RunUid({:032x})", self.0)
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GroupId({:?})", &*self.0)
    }
}

impl fmt::Display for LogicalNodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut digits = [0u8; 10];
        f.write_str(self.group.as_str())?;
        f.write_str("-")?;
        f.write_str(decimal(self.index, &mut digits))
    }
}

impl fmt::Debug for LogicalNodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `n`'s decimal digits, written at the end of `buf`.
fn decimal_digits(mut n: u32, buf: &mut [u8; 10]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[at..]
}

/// `n` in decimal, written at the end of `buf`.
fn decimal(n: u32, buf: &mut [u8; 10]) -> &str {
    // Only ASCII digits were written.
    std::str::from_utf8(decimal_digits(n, buf)).unwrap_or_default()
}

impl FromStr for LogicalNodeId {
    type Err = FieldError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse("node_id", s)
    }
}

impl fmt::Display for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}", self.0)
    }
}

impl fmt::Debug for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}", self.0)
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}.{}", self.attempt.0, self.seq)
    }
}

impl fmt::Debug for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}.{}", self.attempt.0, self.seq)
    }
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Debug for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Debug for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "e{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interned_node_ids_share_their_group_and_compare_as_parsed_ones() {
        let mut groups = GroupInterner::with([GroupId::parse("g", "workers").unwrap()]);
        let a = groups.node("n", "workers-3").unwrap();
        let b = groups.node("n", "workers-12").unwrap();
        let c = groups.node("n", "gpu-1").unwrap();
        let d = groups.node("n", "gpu-0").unwrap();
        assert!(Arc::ptr_eq(&a.group().0, &b.group().0));
        assert!(
            Arc::ptr_eq(&c.group().0, &d.group().0),
            "a group met on the way is kept"
        );
        // Order and equality are the parsed ids', whether or not they share.
        let parsed: Vec<LogicalNodeId> = ["workers-3", "workers-12", "gpu-1", "gpu-0"]
            .iter()
            .map(|s| LogicalNodeId::parse("n", s).unwrap())
            .collect();
        let interned = [a, b, c, d];
        for (i, x) in interned.iter().enumerate() {
            for (j, y) in parsed.iter().enumerate() {
                assert_eq!(x.cmp(&interned[j]), parsed[i].cmp(y), "{x} against {y}");
                assert_eq!(x == y, i == j);
            }
        }
        assert_eq!(groups.node("n", "workers-01").unwrap_err().field, "n");
        // Past MAX groups, ids are still parsed, only no longer kept.
        let mut many = GroupInterner::default();
        for i in 0..GroupInterner::MAX + 10 {
            let id = many.node("n", &format!("g{i}-0")).unwrap();
            assert_eq!(id.group().as_str(), format!("g{i}"));
        }
        assert_eq!(many.known.len(), GroupInterner::MAX);
    }

    #[test]
    fn node_ids_round_trip_and_reject_malformed() {
        let id = LogicalNodeId::parse("n", "gpu-workers-12").unwrap();
        assert_eq!(id.group().as_str(), "gpu-workers");
        assert_eq!(id.index(), 12);
        assert_eq!(id.to_string(), "gpu-workers-12");
        for bad in [
            "",
            "workers",
            "workers-",
            "-3",
            "workers-01",
            "Workers-1",
            "w_x-1",
            "workers-99999999999",
        ] {
            let err = LogicalNodeId::parse("node_id", bad).unwrap_err();
            assert_eq!(err.field, "node_id", "{bad}");
        }
    }

    #[test]
    fn labels_follow_the_dns_grammar() {
        assert!(RunId::parse("run_id", "train-7").is_ok());
        for bad in ["", "7train", "train-", "Train", "tr ain", &"a".repeat(64)] {
            assert!(RunId::parse("run_id", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn run_uid_round_trips_through_hex() {
        let uid = RunUid::from_u128(0xdead_beef);
        let s = uid.to_string();
        assert_eq!(s.len(), 32);
        assert_eq!(RunUid::parse("run_uid", &s).unwrap(), uid);
        assert!(RunUid::parse("run_uid", "xyz").is_err());
        assert!(RunUid::parse("run_uid", &s.to_uppercase()).is_err() || s == s.to_uppercase());
    }

    /// The hand-written spellings agree with the formatting machinery's.
    #[test]
    fn wire_spellings_match_their_formatted_form() {
        for v in [
            0,
            1,
            0xdead_beef,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
            u128::MAX,
        ] {
            let uid = RunUid::from_u128(v);
            assert_eq!(uid.to_string(), format!("{v:032x}"));
            assert_eq!(RunUid::parse("run_uid", &uid.to_string()).unwrap(), uid);
        }
        let group = GroupId::parse("g", "gpu-workers").unwrap();
        for index in [0, 7, 10, 99, 1_000_000, u32::MAX] {
            let id = LogicalNodeId::new(group.clone(), index);
            let expected = format!("gpu-workers-{index}");
            assert_eq!(id.to_wire(), expected);
            assert_eq!(id.to_string(), expected);
            assert_eq!(format!("{id:?}"), expected);
            assert_eq!(LogicalNodeId::parse("n", &id.to_wire()).unwrap(), id);
        }
    }
}
