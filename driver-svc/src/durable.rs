//! The embedded durable store: [`RedbStore`], a `RunStore` over one redb file.
//!
//! redb because it is pure Rust (no C toolchain, nothing to install), gives
//! atomic, durable write transactions (copy-on-write pages with checksums, so a
//! torn write is detected and rolled back to the last commit at open), and
//! takes a delta of one pass as one transaction: durability costs one fsync per
//! pass, not one per node.
//!
//! Records are protobuf messages (`provisioning.store.v1`), each carrying the
//! schema version, so the format can evolve; a store written by a newer schema
//! is refused rather than misread, and an older one is migrated at open, in one
//! transaction (all of it, or nothing).
//!
//! Schema history:
//! - 1: runs and nodes.
//! - 2: a run record may be a *reclaim* run (`StoredMeta.reclaim`), held only
//!   to destroy orphans. Migrating from 1 rewrites every record under the new
//!   version (a version-1 record is never a reclaim run).
//! - 3: each run's event log (`StoredEvent`, table `events`) and its
//!   conditions (`StoredMeta.conditions`). Migrating from 2 creates the table;
//!   records of version 2 are read as they are (they have no conditions).
//!
//! Tables: `meta` (run uid → `StoredMeta`), `nodes` ((run uid, node id) →
//! `StoredNode`), `events` ((run uid, seq) → `StoredEvent`), `schema`
//! ("version" → u32).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Arc, PoisonError, RwLock},
};

use contract::{
    ClusterShape, Epoch, Event, Generation, GroupId, LogicalNodeId, ManagedNode, NodeGroup, Operation, RunId,
    RunUid, UnixMillis,
    pb::{self, store::v1 as rec},
    wire::{TemplateTable, event_from_wire, event_to_wire, node_from_wire, node_to_wire, shape_from_wire},
};
use platform::secrets::{OpenError, Sealer, SecretsError, open_owner_only};
use prost::Message;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::core::{
    ConditionMark, NodeRecord, RunDelta, RunMeta, RunStore, StoreError, StoredRun,
    rollout::{GroupRollout, Halt, StableGroup},
};
use crate::group_commit::GroupCommit;

/// The schema this code writes.
pub const SCHEMA_VERSION: u32 = 3;
/// The oldest record version this code reads as it is (a record's format
/// from here on only gained fields).
const OLDEST_RECORD: u32 = 2;

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const NODES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("nodes");
const SCHEMA: TableDefinition<&str, u32> = TableDefinition::new("schema");
const EVENTS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("events");

/// The store file inside the data directory.
pub const FILE_NAME: &str = "driver.redb";

/// What redb may hold of the file in memory. Its default, 1 GiB, suits a
/// database that is read; this one is written, and read whole only at start,
/// so its cache holds pages the service keeps in its own structures anyway.
/// At 100,000 nodes the executor's cache held 122 MB, over two fifths of
/// what the process kept; the cache grows with the file up to its size.
/// 16 MiB converged a million nodes no slower than 64 MiB on the bench
/// machine, in about 0.5 KB a node less at 100,000 (docs/profile-notes.md).
const CACHE_BYTES: usize = 16 << 20;

fn create_database(path: &Path) -> Result<Database, redb::DatabaseError> {
    redb::Builder::new().set_cache_size(CACHE_BYTES).create(path)
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

/// A `RunStore` over a redb file.
///
/// After an I/O error (a full disk, say) redb refuses every further
/// transaction until the database is opened again; the store then reopens
/// the file itself, so a run halted by the failed write is reloaded once
/// the disk takes writes again, without a restart of the driver.
#[derive(Debug)]
pub struct RedbStore {
    /// `None` only while the file is being opened again.
    db: RwLock<Option<Database>>,
    path: PathBuf,
    /// Seals secret parameter values before they are written.
    sealer: Sealer,
    /// Commits of runs that wait for the file at once, written together.
    group: GroupCommit<Encoded>,
}

impl RedbStore {
    /// Opens (or creates) the store in `dir`. A file that is not a valid
    /// database, or one written by a newer schema, is an error: the driver
    /// refuses to start rather than run on partial state.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_sealed(dir, Sealer::default())
    }

    /// As [`RedbStore::open`], sealing secret parameter values with the
    /// sealer's key (see `platform::secrets`). The directory and the file are
    /// made readable by their owner only.
    pub fn open_sealed(dir: &Path, sealer: Sealer) -> Result<Self, StoreError> {
        let db = open_owner_only(dir, FILE_NAME, create_database).map_err(|e| match e {
            OpenError::Unavailable(e) => unavailable(e),
            OpenError::Corrupt(e) => corrupt(e),
        })?;
        check_schema(&db)?;
        Ok(Self {
            db: RwLock::new(Some(db)),
            path: dir.join(FILE_NAME),
            sealer,
            group: GroupCommit::default(),
        })
    }

    /// Runs `f` on the database. An error that redb answers after an I/O
    /// error (every transaction refused until the file is opened again)
    /// makes the store open it again, so the caller's retry can succeed.
    fn with_db<T>(&self, f: impl FnOnce(&Database) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let result = {
            let guard = self.db.read().unwrap_or_else(PoisonError::into_inner);
            match guard.as_ref() {
                Some(db) => f(db),
                None => Err(unavailable("the store file is being opened again")),
            }
        };
        let poisoned = matches!(&result, Err(StoreError::Unavailable(m)) if m.contains(&redb::Error::PreviousIo.to_string()))
            || matches!(&result, Err(StoreError::Unavailable(m)) if m.contains("being opened again"));
        if poisoned {
            self.reopen();
        }
        result
    }

    /// Opens the file again (after an I/O error): the old handle is dropped
    /// first, so its lock on the file goes with it.
    fn reopen(&self) {
        let mut guard = self.db.write().unwrap_or_else(PoisonError::into_inner);
        *guard = None;
        match create_database(&self.path) {
            Ok(db) => {
                tracing::warn!(path = %self.path.display(), "store file opened again after an I/O error");
                *guard = Some(db);
            }
            Err(e) => {
                tracing::error!(path = %self.path.display(), error = %e,
                    "the store file cannot be opened again yet; the next write tries again");
            }
        }
    }

    /// The open database, for tests that write what an older driver would.
    #[cfg(test)]
    fn raw(&self) -> std::sync::RwLockReadGuard<'_, Option<Database>> {
        self.db.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The schema version the file is at.
    pub fn schema_version(&self) -> Result<u32, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read().map_err(unavailable)?;
            let schema = txn.open_table(SCHEMA).map_err(unavailable)?;
            let v = schema.get("version").map_err(unavailable)?.map(|v| v.value());
            v.ok_or_else(|| corrupt("the store has no schema version"))
        })
    }
}

/// Checks the file's schema version, migrating an older one in the same
/// transaction.
fn check_schema(db: &Database) -> Result<(), StoreError> {
    let txn = db.begin_write().map_err(unavailable)?;
    {
        let mut schema = txn.open_table(SCHEMA).map_err(unavailable)?;
        let found = schema.get("version").map_err(unavailable)?.map(|v| v.value());
        match found {
            None => {
                schema.insert("version", SCHEMA_VERSION).map_err(unavailable)?;
            }
            Some(v) if v == SCHEMA_VERSION => {}
            Some(v) if v > SCHEMA_VERSION => {
                return Err(corrupt(format!(
                    "the store was written by schema version {v}; this driver reads up to {SCHEMA_VERSION}"
                )));
            }
            Some(from @ (1 | 2)) => {
                // Older schemas are migrated here, one version at a time,
                // inside this transaction: a failed migration leaves the
                // file as it was. 2 → 3 only adds the events table,
                // opened below.
                drop(schema);
                if from == 1 {
                    migrate_1_to_2(&txn)?;
                }
                txn.open_table(SCHEMA)
                    .map_err(unavailable)?
                    .insert("version", SCHEMA_VERSION)
                    .map_err(unavailable)?;
                tracing::info!(from, to = SCHEMA_VERSION, "store migrated");
            }
            Some(v) => {
                return Err(corrupt(format!("no migration from schema version {v}")));
            }
        }
        txn.open_table(META).map_err(unavailable)?;
        txn.open_table(NODES).map_err(unavailable)?;
        txn.open_table(EVENTS).map_err(unavailable)?;
    }
    txn.commit().map_err(unavailable)
}

/// Schema 1 → 2: every record is rewritten under version 2; their fields are
/// unchanged (a version-1 run is never a reclaim run).
fn migrate_1_to_2(txn: &redb::WriteTransaction) -> Result<(), StoreError> {
    let mut meta = txn.open_table(META).map_err(unavailable)?;
    let mut rows: Vec<(String, Vec<u8>)> = Vec::new();
    for item in meta.iter().map_err(unavailable)? {
        let (k, v) = item.map_err(unavailable)?;
        let mut m = rec::StoredMeta::decode(v.value()).map_err(|e| corrupt(format!("run record: {e}")))?;
        if m.schema != 1 {
            return Err(corrupt(format!(
                "run record {} of schema {} in a version-1 store",
                k.value(),
                m.schema
            )));
        }
        m.schema = 2;
        m.reclaim = false;
        rows.push((k.value().to_owned(), m.encode_to_vec()));
    }
    for (k, v) in rows {
        meta.insert(k.as_str(), v.as_slice()).map_err(unavailable)?;
    }
    let mut nodes = txn.open_table(NODES).map_err(unavailable)?;
    let mut rows: Vec<((String, String), Vec<u8>)> = Vec::new();
    for item in nodes.iter().map_err(unavailable)? {
        let (k, v) = item.map_err(unavailable)?;
        let mut n = rec::StoredNode::decode(v.value()).map_err(|e| corrupt(format!("node record: {e}")))?;
        let (uid, id) = k.value();
        if n.schema != 1 {
            return Err(corrupt(format!(
                "node record {uid}/{id} of schema {} in a version-1 store",
                n.schema
            )));
        }
        n.schema = 2;
        rows.push(((uid.to_owned(), id.to_owned()), n.encode_to_vec()));
    }
    for ((uid, id), v) in rows {
        nodes
            .insert((uid.as_str(), id.as_str()), v.as_slice())
            .map_err(unavailable)?;
    }
    Ok(())
}

fn sealing(e: SecretsError) -> StoreError {
    match e {
        SecretsError::Random(_) => unavailable(e),
        other => corrupt(other),
    }
}

fn seal_shape(sealer: &Sealer, shape: &mut pb::ClusterShape) -> Result<(), StoreError> {
    for t in shape.groups.iter_mut().filter_map(|g| g.template.as_mut()) {
        sealer.seal_template(t).map_err(sealing)?;
    }
    Ok(())
}

fn open_shape(sealer: &Sealer, shape: &mut pb::ClusterShape) -> Result<(), StoreError> {
    for t in shape.groups.iter_mut().filter_map(|g| g.template.as_mut()) {
        sealer.open_template(t).map_err(sealing)?;
    }
    Ok(())
}

pub(crate) fn encode_meta(sealer: &Sealer, m: &RunMeta) -> Result<Vec<u8>, StoreError> {
    let mut shape = pb::ClusterShape::from(&m.shape);
    seal_shape(sealer, &mut shape)?;
    Ok(rec::StoredMeta {
        schema: SCHEMA_VERSION,
        run_id: m.run_id.to_string(),
        run_uid: m.uid.to_string(),
        epoch: m.epoch.get(),
        shape: Some(shape),
        deleting: m.deleting,
        paused: m.paused,
        observed_generation: m.observed_generation.get(),
        next_attempt: m.next_attempt,
        created_at_ms: m.created_at.as_millis(),
        converged_at_ms: UnixMillis::to_wire(m.converged_at),
        reclaim: m.reclaim,
        conditions: m
            .conditions
            .iter()
            .map(|c| pb::Condition {
                r#type: c.kind.clone(),
                status: c.status,
                reason: c.reason.clone(),
                message: String::new(),
                since_ms: c.since.as_millis(),
                observed_generation: 0,
            })
            .collect(),
        rollouts: m.rollouts.iter().map(rollout_to_record).collect(),
        stable: m
            .stable
            .iter()
            .map(|s| {
                let mut group = pb::NodeGroup::from(&s.group);
                if let Some(t) = group.template.as_mut() {
                    sealer.seal_template(t).map_err(sealing)?;
                }
                Ok(rec::StableGroup {
                    group: Some(group),
                    generation: s.generation.get(),
                })
            })
            .collect::<Result<_, StoreError>>()?,
    }
    .encode_to_vec())
}

fn rollout_to_record(r: &GroupRollout) -> rec::GroupRollout {
    rec::GroupRollout {
        group_id: r.group.to_string(),
        generation: r.generation.get(),
        started_at_ms: r.started_at.as_millis(),
        progress_at_ms: r.progress_at.as_millis(),
        ready: r.ready,
        failures: r.failures,
        promoted: r.promoted,
        canary_reached: r.canary_reached,
        halted_at_ms: r.halted.as_ref().map_or(0, |h| h.at.as_millis()),
        halt_reason: r.halted.as_ref().map(|h| h.reason.clone()).unwrap_or_default(),
        reverted_from: r.reverted_from.map_or(0, Generation::get),
    }
}

fn rollout_from_record(r: rec::GroupRollout) -> Result<GroupRollout, StoreError> {
    Ok(GroupRollout {
        group: GroupId::parse("rollouts.group_id", &r.group_id).map_err(corrupt)?,
        generation: Generation::new(r.generation),
        started_at: UnixMillis::new(r.started_at_ms),
        progress_at: UnixMillis::new(r.progress_at_ms),
        ready: r.ready,
        failures: r.failures,
        promoted: r.promoted,
        canary_reached: r.canary_reached,
        halted: (r.halted_at_ms != 0).then(|| Halt {
            at: UnixMillis::new(r.halted_at_ms),
            reason: r.halt_reason,
        }),
        reverted_from: (r.reverted_from != 0).then(|| Generation::new(r.reverted_from)),
    })
}

/// A record's schema version is one this code reads.
fn readable(what: &str, schema: u32) -> Result<(), StoreError> {
    if (OLDEST_RECORD..=SCHEMA_VERSION).contains(&schema) {
        Ok(())
    } else {
        Err(corrupt(format!("{what} of schema {schema}")))
    }
}

pub(crate) fn decode_meta(sealer: &Sealer, bytes: &[u8]) -> Result<RunMeta, StoreError> {
    let m = rec::StoredMeta::decode(bytes).map_err(|e| corrupt(format!("run record: {e}")))?;
    readable("run record", m.schema)?;
    let mut shape = m.shape.ok_or_else(|| corrupt("run record without a shape"))?;
    open_shape(sealer, &mut shape)?;
    let shape: ClusterShape = shape_from_wire(shape).map_err(|e| corrupt(format!("stored shape: {e}")))?;
    Ok(RunMeta {
        run_id: RunId::parse("run_id", &m.run_id).map_err(corrupt)?,
        uid: RunUid::parse("run_uid", &m.run_uid).map_err(corrupt)?,
        epoch: Epoch::new(m.epoch),
        shape,
        deleting: m.deleting,
        paused: m.paused,
        observed_generation: Generation::new(m.observed_generation),
        next_attempt: m.next_attempt,
        created_at: UnixMillis::new(m.created_at_ms),
        converged_at: UnixMillis::from_wire(m.converged_at_ms),
        reclaim: m.reclaim,
        conditions: m
            .conditions
            .into_iter()
            .map(|c| ConditionMark {
                kind: c.r#type,
                status: c.status,
                reason: c.reason,
                since: UnixMillis::new(c.since_ms),
            })
            .collect(),
        rollouts: m
            .rollouts
            .into_iter()
            .map(rollout_from_record)
            .collect::<Result<_, _>>()?,
        stable: m
            .stable
            .into_iter()
            .map(|s| {
                let mut group = s.group.ok_or_else(|| corrupt("stable group without a group"))?;
                if let Some(t) = group.template.as_mut() {
                    sealer.open_template(t).map_err(sealing)?;
                }
                Ok(StableGroup {
                    group: NodeGroup::try_from(group).map_err(|e| corrupt(format!("stable group: {e}")))?,
                    generation: Generation::new(s.generation),
                })
            })
            .collect::<Result<_, StoreError>>()?,
    })
}

pub(crate) fn encode_event(run_id: &RunId, e: &Event) -> Vec<u8> {
    rec::StoredEvent {
        schema: SCHEMA_VERSION,
        event: Some(event_to_wire(run_id, e)),
    }
    .encode_to_vec()
}

pub(crate) fn decode_event(bytes: &[u8]) -> Result<Event, StoreError> {
    let e = rec::StoredEvent::decode(bytes).map_err(|e| corrupt(format!("event record: {e}")))?;
    readable("event record", e.schema)?;
    let event = e.event.ok_or_else(|| corrupt("event record without an event"))?;
    event_from_wire(event).map_err(|e| corrupt(format!("event: {e}")))
}

pub(crate) fn encode_node(sealer: &Sealer, r: &NodeRecord) -> Result<Vec<u8>, StoreError> {
    Ok(stored_node(sealer, r)?.encode_to_vec())
}

fn stored_node(sealer: &Sealer, r: &NodeRecord) -> Result<rec::StoredNode, StoreError> {
    let mut table = TemplateTable::default();
    let state = node_to_wire(&r.node, &mut table);
    let mut templates = table.into_wire();
    for t in &mut templates {
        sealer.seal_template(t).map_err(sealing)?;
    }
    let inflight = match r.inflight.as_deref().map(pb::Operation::from) {
        Some(mut op) => {
            sealer.seal_operation(&mut op).map_err(sealing)?;
            Some(op)
        }
        None => None,
    };
    let successor = match r.successor.as_deref() {
        Some(s) => Some(Box::new(stored_node(sealer, s)?)),
        None => None,
    };
    Ok(rec::StoredNode {
        schema: SCHEMA_VERSION,
        state: Some(state),
        templates,
        next_seq: r.next_seq,
        inflight,
        bootstrap_detail: r
            .node
            .facts
            .bootstrap
            .as_ref()
            .map(|b| b.detail.clone())
            .unwrap_or_default(),
        successor,
    })
}

pub(crate) fn decode_node(sealer: &Sealer, bytes: &[u8]) -> Result<NodeRecord, StoreError> {
    let n = rec::StoredNode::decode(bytes).map_err(|e| corrupt(format!("node record: {e}")))?;
    node_record(sealer, n, true)
}

/// A stored node as a record; `with_successor` is false for a successor
/// (which has none of its own).
fn node_record(
    sealer: &Sealer,
    mut n: rec::StoredNode,
    with_successor: bool,
) -> Result<NodeRecord, StoreError> {
    readable("node record", n.schema)?;
    for t in &mut n.templates {
        sealer.open_template(t).map_err(sealing)?;
    }
    if let Some(op) = n.inflight.as_mut() {
        sealer.open_operation(op).map_err(sealing)?;
    }
    let templates =
        TemplateTable::from_wire(n.templates).map_err(|e| corrupt(format!("node templates: {e}")))?;
    let state = n.state.ok_or_else(|| corrupt("node record without a state"))?;
    let mut node: ManagedNode =
        node_from_wire(state, &templates).map_err(|e| corrupt(format!("node: {e}")))?;
    if let Some(b) = node.facts.bootstrap.as_mut() {
        b.detail = n.bootstrap_detail;
    }
    let inflight = n
        .inflight
        .map(Operation::try_from)
        .transpose()
        .map_err(|e| corrupt(format!("in-flight operation: {e}")))?
        .map(Box::new);
    let successor = match n.successor {
        Some(_) if !with_successor => return Err(corrupt("a successor record with a successor of its own")),
        Some(s) => Some(Box::new(node_record(sealer, *s, false)?)),
        None => None,
    };
    Ok(NodeRecord {
        node,
        next_seq: n.next_seq,
        inflight,
        successor,
    })
}

impl RunStore for RedbStore {
    /// Encodes the delta on the calling thread, then writes it with the
    /// commits of other runs waiting at the same time, in one transaction
    /// (`group_commit`). Each delta is atomic and answered on its own.
    fn commit(&self, delta: &RunDelta) -> Result<(), StoreError> {
        if delta.upserts.len() > GROUP_MAX_UPSERTS {
            return self.commit_alone(delta);
        }
        let encoded = self.encode(delta, Upserts::Encoded)?;
        self.group.commit(encoded, |group| {
            let n = group.len();
            match self.with_db(|db| write_group(db, &group)) {
                Ok(answers) => answers,
                Err(e) => vec![Err(e); n],
            }
        })
    }

    fn load_all(&self) -> Result<Vec<StoredRun>, StoreError> {
        self.with_db(|db| load_from(db, &self.sealer))
    }
}

/// A run's delta as the records it writes: encoded (and sealed) before it
/// waits for the file, so that runs encode in parallel and the writer only
/// writes.
#[derive(Debug)]
struct Encoded {
    uid: RunUid,
    key: String,
    drop_run: bool,
    meta: Option<Vec<u8>>,
    upserts: Vec<(String, Vec<u8>)>,
    removals: Vec<String>,
    events: Vec<(u64, Vec<u8>)>,
    events_below: Option<u64>,
}

/// A delta with more node records than this is written alone, each record
/// encoded as it is written: encoded whole before it waits, as a group's
/// deltas are, a run's first pass of a million nodes held its records twice
/// (about 200 MB more at the driver's peak). A delta that large pays for
/// its transaction many times over anyway.
const GROUP_MAX_UPSERTS: usize = 4096;

/// Whether [`RedbStore::encode`] encodes the node records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Upserts {
    Encoded,
    Left,
}

impl RedbStore {
    /// A large delta in a transaction of its own (see [`GROUP_MAX_UPSERTS`]).
    fn commit_alone(&self, delta: &RunDelta) -> Result<(), StoreError> {
        let head = self.encode(delta, Upserts::Left)?;
        // Refused, the delta fails its transaction, which then writes nothing.
        self.with_db(|db| {
            in_write(db, |t| {
                write_delta(t, &head, Some((&self.sealer, &delta.upserts)))?
            })
        })
    }

    fn encode(&self, delta: &RunDelta, upserts: Upserts) -> Result<Encoded, StoreError> {
        let key = delta.uid.to_string();
        if delta.drop_run {
            return Ok(Encoded {
                uid: delta.uid,
                key,
                drop_run: true,
                meta: None,
                upserts: Vec::new(),
                removals: Vec::new(),
                events: Vec::new(),
                events_below: None,
            });
        }
        let meta = delta
            .meta
            .as_ref()
            .map(|m| encode_meta(&self.sealer, m))
            .transpose()?;
        let upserts = match upserts {
            Upserts::Encoded => delta
                .upserts
                .iter()
                .map(|r| Ok((r.node.id.to_string(), encode_node(&self.sealer, r)?)))
                .collect::<Result<_, StoreError>>()?,
            Upserts::Left => Vec::new(),
        };
        // An event names its run: from the delta, or as the run is stored
        // (only this run's own commits change that, and it waits for each).
        let events = if delta.events.is_empty() {
            Vec::new()
        } else {
            let run_id = match &delta.meta {
                Some(m) => m.run_id.clone(),
                None => self
                    .with_db(|db| stored_run_id(db, &self.sealer, &key))?
                    .ok_or(StoreError::UnknownRun(delta.uid))?,
            };
            delta
                .events
                .iter()
                .map(|e| (e.seq, encode_event(&run_id, e)))
                .collect()
        };
        Ok(Encoded {
            uid: delta.uid,
            key,
            drop_run: false,
            meta,
            upserts,
            removals: delta.removals.iter().map(ToString::to_string).collect(),
            events,
            events_below: delta.events_below,
        })
    }
}

/// The run id of the run stored under `key`, if it is stored.
fn stored_run_id(db: &Database, sealer: &Sealer, key: &str) -> Result<Option<RunId>, StoreError> {
    let txn = db.begin_read().map_err(unavailable)?;
    let meta = txn.open_table(META).map_err(unavailable)?;
    let stored = meta.get(key).map_err(unavailable)?;
    stored
        .map(|m| Ok(decode_meta(sealer, m.value())?.run_id))
        .transpose()
}

/// Writes a group of deltas in one write transaction and answers each: a
/// delta for a run that is not stored is refused alone, before any of its
/// records is written; a transaction that fails fails them all.
fn write_group(db: &Database, group: &[Encoded]) -> Result<Vec<Result<(), StoreError>>, StoreError> {
    in_write(db, |t| {
        group.iter().map(|delta| write_delta(t, delta, None)).collect()
    })
}

/// The tables a delta writes, open in one write transaction.
struct Tables<'t> {
    meta: redb::Table<'t, &'static str, &'static [u8]>,
    nodes: redb::Table<'t, (&'static str, &'static str), &'static [u8]>,
    events: redb::Table<'t, (&'static str, u64), &'static [u8]>,
}

/// `write` in one write transaction, committed unless `write` fails.
fn in_write<T>(
    db: &Database,
    write: impl FnOnce(&mut Tables<'_>) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let txn = db.begin_write().map_err(unavailable)?;
    let written = {
        let mut tables = Tables {
            meta: txn.open_table(META).map_err(unavailable)?,
            nodes: txn.open_table(NODES).map_err(unavailable)?,
            events: txn.open_table(EVENTS).map_err(unavailable)?,
        };
        write(&mut tables)?
    };
    txn.commit().map_err(unavailable)?;
    Ok(written)
}

/// One delta's records, inside the group's transaction, and after its
/// encoded node records the `unencoded` ones, each encoded as it is written
/// (a large delta's, written alone). The outer error fails the transaction;
/// the inner one refuses this delta, which has then written nothing.
fn write_delta(
    Tables { meta, nodes, events }: &mut Tables<'_>,
    delta: &Encoded,
    unencoded: Option<(&Sealer, &[Arc<NodeRecord>])>,
) -> Result<Result<(), StoreError>, StoreError> {
    let uid = delta.key.as_str();
    if delta.drop_run {
        meta.remove(uid).map_err(unavailable)?;
        events
            .retain_in((uid, 0)..=(uid, u64::MAX), |_, _| false)
            .map_err(unavailable)?;
        let mut keys: Vec<String> = Vec::new();
        for item in nodes.range((uid, "")..).map_err(unavailable)? {
            let (k, _) = item.map_err(unavailable)?;
            let (u, n) = k.value();
            if u != uid {
                break;
            }
            keys.push(n.to_owned());
        }
        for k in keys {
            nodes.remove((uid, k.as_str())).map_err(unavailable)?;
        }
        return Ok(Ok(()));
    }
    if let Some(m) = &delta.meta {
        meta.insert(uid, m.as_slice()).map_err(unavailable)?;
    } else if meta.get(uid).map_err(unavailable)?.is_none() {
        return Ok(Err(StoreError::UnknownRun(delta.uid)));
    }
    for (id, record) in &delta.upserts {
        nodes
            .insert((uid, id.as_str()), record.as_slice())
            .map_err(unavailable)?;
    }
    if let Some((sealer, records)) = unencoded {
        for r in records {
            let id = r.node.id.to_string();
            nodes
                .insert((uid, id.as_str()), encode_node(sealer, r)?.as_slice())
                .map_err(unavailable)?;
        }
    }
    for id in &delta.removals {
        nodes.remove((uid, id.as_str())).map_err(unavailable)?;
    }
    for (seq, event) in &delta.events {
        events
            .insert((uid, *seq), event.as_slice())
            .map_err(unavailable)?;
    }
    if let Some(below) = delta.events_below {
        events
            .retain_in((uid, 0)..(uid, below), |_, _| false)
            .map_err(unavailable)?;
    }
    Ok(Ok(()))
}

/// Every run, in one read transaction.
fn load_from(db: &Database, sealer: &Sealer) -> Result<Vec<StoredRun>, StoreError> {
    let txn = db.begin_read().map_err(unavailable)?;
    let meta = txn.open_table(META).map_err(unavailable)?;
    let nodes = txn.open_table(NODES).map_err(unavailable)?;
    let mut runs: BTreeMap<String, StoredRun> = BTreeMap::new();
    for item in meta.iter().map_err(unavailable)? {
        let (k, v) = item.map_err(unavailable)?;
        let m = decode_meta(sealer, v.value())?;
        if m.uid.to_string() != k.value() {
            return Err(corrupt(format!("run record under the wrong key {}", k.value())));
        }
        runs.insert(
            k.value().to_owned(),
            StoredRun {
                meta: m,
                nodes: Vec::new(),
                events: Vec::new(),
            },
        );
    }
    for item in nodes.iter().map_err(unavailable)? {
        let (k, v) = item.map_err(unavailable)?;
        let (uid, id) = k.value();
        let rec = decode_node(sealer, v.value())?;
        if rec.node.id != LogicalNodeId::parse("node_id", id).map_err(corrupt)? {
            return Err(corrupt(format!("node record under the wrong key {id}")));
        }
        let run = runs
            .get_mut(uid)
            .ok_or_else(|| corrupt(format!("node {id} of run {uid}, which has no run record")))?;
        run.nodes.push(rec);
    }
    let events = txn.open_table(EVENTS).map_err(unavailable)?;
    for item in events.iter().map_err(unavailable)? {
        let (k, v) = item.map_err(unavailable)?;
        let (uid, seq) = k.value();
        let e = decode_event(v.value())?;
        if e.seq != seq {
            return Err(corrupt(format!(
                "event {} of run {uid} under the wrong key {seq}",
                e.seq
            )));
        }
        let run = runs
            .get_mut(uid)
            .ok_or_else(|| corrupt(format!("event {seq} of run {uid}, which has no run record")))?;
        run.events.push(e);
    }
    Ok(runs.into_values().collect())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::core::{MemStore, Policy, RunState};

    fn shape(generation: u64) -> ClusterShape {
        let mut s = ClusterShape {
            run_id: RunId::parse("r", "train").unwrap(),
            generation: Generation::new(generation),
            labels: Default::default(),
            groups: vec![contract::NodeGroup {
                id: contract::GroupId::parse("g", "workers").unwrap(),
                count: 4,
                template: Arc::new(contract::shape::example_template("fake", "img:1")),
                policy: Default::default(),
            }],
        };
        Arc::make_mut(&mut s.groups[0].template).boot.insert(
            "token".into(),
            contract::Param {
                value: "s3cret".into(),
                secret: true,
            },
        );
        s
    }

    fn drive(run: &mut RunState, store: &dyn RunStore, now: UnixMillis) {
        for _ in 0..2 {
            let plan = run.begin_pass(now).unwrap();
            let out = {
                let view = run.desired_view();
                decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), now)
            };
            let mut outcome = run.apply_decisions(plan, out, now).unwrap();
            let _ = outcome.take_commit().persist_to(store).unwrap();
        }
    }

    #[test]
    fn what_is_committed_is_what_is_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let now = UnixMillis::new(1_700_000_000_000);
        let policy = Arc::new(Policy::default());
        let durable = RedbStore::open(dir.path()).unwrap();
        let mem = MemStore::new();
        let mut a =
            RunState::create(shape(1), RunUid::from_u128(9), Epoch::new(3), policy.clone(), now).unwrap();
        let mut b = a.clone();
        drive(&mut a, &durable, now);
        drive(&mut b, &mem, now);
        assert_eq!(durable.load_all().unwrap(), mem.load_all().unwrap());
        drop(durable);

        // Reopened: the same runs, pending operations included.
        let reopened = RedbStore::open(dir.path()).unwrap();
        let loaded = reopened.load_all().unwrap();
        assert_eq!(loaded, mem.load_all().unwrap());
        assert_eq!(loaded[0].nodes.len(), 4);
        assert!(
            loaded[0]
                .nodes
                .iter()
                .all(|n| n.inflight.is_some() && n.node.pending.is_some())
        );
    }

    /// Runs committing from threads of their own at once all land, each
    /// whole (`group_commit` writes those that wait together).
    #[test]
    fn commits_of_many_runs_at_once_all_land() {
        let dir = tempfile::tempdir().unwrap();
        let now = UnixMillis::new(1_700_000_000_000);
        let store = Arc::new(RedbStore::open(dir.path()).unwrap());
        let mem = Arc::new(MemStore::new());
        let threads: Vec<_> = (1..=8u128)
            .map(|uid| {
                let (store, mem) = (Arc::clone(&store), Arc::clone(&mem));
                std::thread::spawn(move || {
                    let policy = Arc::new(Policy::default());
                    let mut run =
                        RunState::create(shape(1), RunUid::from_u128(uid), Epoch::new(1), policy, now)
                            .unwrap();
                    let mut twin = run.clone();
                    drive(&mut run, &*store, now);
                    drive(&mut twin, &*mem, now);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(store);
        let loaded = RedbStore::open(dir.path()).unwrap().load_all().unwrap();
        assert_eq!(loaded.len(), 8);
        assert_eq!(loaded, mem.load_all().unwrap());
    }

    /// A delta of more node records than a group takes is written alone,
    /// its records encoded as they are written: the same records land, and
    /// one for a run that is not stored is refused whole.
    #[test]
    fn a_large_delta_is_written_alone_and_whole() {
        let dir = tempfile::tempdir().unwrap();
        let now = UnixMillis::new(1_700_000_000_000);
        let store = RedbStore::open(dir.path()).unwrap();
        let mem = MemStore::new();
        let mut big = shape(1);
        big.groups[0].count = u32::try_from(GROUP_MAX_UPSERTS).unwrap() + 100;
        let policy = Arc::new(Policy::default());
        let mut run = RunState::create(big, RunUid::from_u128(3), Epoch::new(1), policy, now).unwrap();
        let mut twin = run.clone();
        drive(&mut run, &store, now);
        drive(&mut twin, &mem, now);
        // The file keeps nodes in the order of their ids' text.
        let by_id = |mut runs: Vec<StoredRun>| {
            for r in &mut runs {
                r.nodes.sort_by(|a, b| a.node.id.cmp(&b.node.id));
            }
            runs
        };
        let loaded = by_id(store.load_all().unwrap());
        assert_eq!(loaded, by_id(mem.load_all().unwrap()));
        assert!(
            loaded[0].nodes.len() > GROUP_MAX_UPSERTS,
            "{} nodes",
            loaded[0].nodes.len()
        );

        let mut stray = RunDelta::new(RunUid::from_u128(4));
        stray.upserts = loaded[0].nodes.iter().cloned().map(Arc::new).collect();
        assert!(matches!(store.commit(&stray), Err(StoreError::UnknownRun(_))));
        assert_eq!(by_id(store.load_all().unwrap()), loaded);
        let txn = store.raw().as_ref().unwrap().begin_read().unwrap();
        let rows = txn.open_table(NODES).unwrap().iter().unwrap().count();
        assert_eq!(rows, loaded[0].nodes.len(), "the refused delta wrote a node");
    }

    /// In one group, a delta for a run that is not stored is refused alone
    /// and writes nothing; the others land.
    #[test]
    fn a_delta_refused_in_a_group_writes_nothing_and_the_others_land() {
        let dir = tempfile::tempdir().unwrap();
        let now = UnixMillis::new(1_700_000_000_000);
        let store = RedbStore::open(dir.path()).unwrap();
        let known = RunUid::from_u128(5);
        let mut run =
            RunState::create(shape(1), known, Epoch::new(1), Arc::new(Policy::default()), now).unwrap();
        drive(&mut run, &store, now);
        let stored = store.load_all().unwrap().remove(0);
        assert_eq!(stored.nodes.len(), 4);

        let unknown = RunUid::from_u128(6);
        let mut stray = RunDelta::new(unknown);
        stray.upserts.push(Arc::new(stored.nodes[0].clone()));
        let mut removal = RunDelta::new(known);
        removal.removals.push(stored.nodes[1].node.id.clone());
        let group = [
            store.encode(&stray, Upserts::Encoded).unwrap(),
            store.encode(&removal, Upserts::Encoded).unwrap(),
        ];
        let answers = store.with_db(|db| write_group(db, &group)).unwrap();
        assert!(
            matches!(answers[0], Err(StoreError::UnknownRun(uid)) if uid == unknown),
            "{answers:?}"
        );
        assert!(answers[1].is_ok(), "{answers:?}");

        let loaded = store.load_all().unwrap();
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].nodes.len(), 3);
        let txn = store.raw().as_ref().unwrap().begin_read().unwrap();
        let rows = txn.open_table(NODES).unwrap().iter().unwrap().count();
        assert_eq!(rows, 3, "the refused delta wrote a node");
    }

    #[test]
    fn a_dropped_run_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let now = UnixMillis::new(1_700_000_000_000);
        let store = RedbStore::open(dir.path()).unwrap();
        let mut run = RunState::create(
            shape(1),
            RunUid::from_u128(5),
            Epoch::new(1),
            Arc::new(Policy::default()),
            now,
        )
        .unwrap();
        drive(&mut run, &store, now);
        let mut delta = RunDelta::new(RunUid::from_u128(5));
        delta.drop_run = true;
        store.commit(&delta).unwrap();
        assert!(store.load_all().unwrap().is_empty());
        let txn = store.raw().as_ref().unwrap().begin_read().unwrap();
        assert_eq!(txn.open_table(NODES).unwrap().iter().unwrap().count(), 0);
    }

    #[test]
    fn a_damaged_file_is_refused_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let now = UnixMillis::new(1_700_000_000_000);
        {
            let store = RedbStore::open(dir.path()).unwrap();
            let mut run = RunState::create(
                shape(1),
                RunUid::from_u128(5),
                Epoch::new(1),
                Arc::new(Policy::default()),
                now,
            )
            .unwrap();
            drive(&mut run, &store, now);
        }
        let path = dir.path().join(FILE_NAME);
        let len = std::fs::metadata(&path).unwrap().len();
        // Truncated: not a database any more.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len / 3).unwrap();
        drop(f);
        let refused = RedbStore::open(dir.path()).and_then(|s| s.load_all());
        assert!(refused.is_err(), "a truncated store was accepted");

        // Garbage.
        std::fs::write(&path, b"definitely not a database").unwrap();
        assert!(matches!(RedbStore::open(dir.path()), Err(StoreError::Corrupt(_))));
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn secret_values_are_sealed_at_rest_and_need_their_key() {
        use platform::secrets::SecretKey;
        let dir = tempfile::tempdir().unwrap();
        let now = UnixMillis::new(1_700_000_000_000);
        let key = || Sealer::new(Some(SecretKey::from_bytes(&[3u8; 32]).unwrap()));
        let written = {
            let store = RedbStore::open_sealed(dir.path(), key()).unwrap();
            let mut run = RunState::create(
                shape(1),
                RunUid::from_u128(5),
                Epoch::new(1),
                Arc::new(Policy::default()),
                now,
            )
            .unwrap();
            // Two passes: templates in node records and creates in flight.
            drive(&mut run, &store, now);
            store.load_all().unwrap()
        };
        let token = &written[0].meta.shape.groups[0].template.boot["token"];
        assert_eq!(token.value, "s3cret", "read back opened");
        assert!(written[0].nodes.iter().all(|n| n.inflight.is_some()));
        let bytes = std::fs::read(dir.path().join(FILE_NAME)).unwrap();
        assert!(
            !contains(&bytes, b"s3cret"),
            "a secret value is in the file in clear"
        );
        assert!(contains(&bytes, b"sealed:v1:"));

        assert_eq!(
            RedbStore::open_sealed(dir.path(), key())
                .unwrap()
                .load_all()
                .unwrap(),
            written
        );
        let no_key = RedbStore::open(dir.path()).unwrap().load_all().unwrap_err();
        assert!(no_key.to_string().contains("no key"), "{no_key}");
        let other = Sealer::new(Some(SecretKey::from_bytes(&[4u8; 32]).unwrap()));
        let wrong = RedbStore::open_sealed(dir.path(), other)
            .unwrap()
            .load_all()
            .unwrap_err();
        assert!(wrong.to_string().contains("does not open"), "{wrong}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(dir.path().join(FILE_NAME))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "the store file is private: {mode:o}");
        }
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = RedbStore::open(dir.path()).unwrap();
            let txn = store.raw().as_ref().unwrap().begin_write().unwrap();
            txn.open_table(SCHEMA)
                .unwrap()
                .insert("version", SCHEMA_VERSION + 1)
                .unwrap();
            txn.commit().unwrap();
        }
        let err = RedbStore::open(dir.path()).unwrap_err();
        assert!(err.to_string().contains("schema version"), "{err}");
    }

    /// Events and conditions are stored with the run, trimmed as the run
    /// trims them, and dropped with it.
    #[test]
    fn events_and_conditions_are_stored_trimmed_and_dropped_with_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let now = UnixMillis::new(1_700_000_000_000);
        let policy = Arc::new(Policy {
            event_limit: 3,
            ..Policy::default()
        });
        let store = RedbStore::open(dir.path()).unwrap();
        let mem = MemStore::new();
        let uid = RunUid::from_u128(11);
        let mut run = RunState::create(shape(1), uid, Epoch::new(1), policy, now).unwrap();
        for i in 0..5 {
            run.record_event(
                contract::EventReason::Applied,
                contract::Subject::Run,
                format!("event {i}"),
                now,
            );
        }
        run.set_conditions(vec![ConditionMark {
            kind: "Ready".into(),
            status: false,
            reason: "NotConverged".into(),
            since: now,
        }]);
        let delta = run.take_commit().delta().clone();
        store.commit(&delta).unwrap();
        mem.commit(&delta).unwrap();
        drop(store);
        let store = RedbStore::open(dir.path()).unwrap();
        let loaded = store.load_all().unwrap();
        assert_eq!(loaded, mem.load_all().unwrap());
        assert_eq!(
            loaded[0].events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [3, 4, 5]
        );
        assert_eq!(loaded[0].meta.conditions.len(), 1);
        assert_eq!(loaded[0].meta.conditions[0].reason, "NotConverged");
        let mut delta = RunDelta::new(uid);
        delta.drop_run = true;
        store.commit(&delta).unwrap();
        assert!(store.load_all().unwrap().is_empty());
        let txn = store.raw().as_ref().unwrap().begin_read().unwrap();
        assert_eq!(txn.open_table(EVENTS).unwrap().iter().unwrap().count(), 0);
    }

    /// A store of schema 2 (no event table, records of version 2) opens:
    /// the table is added and the records read as they are.
    #[test]
    fn a_schema_2_store_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let now = UnixMillis::new(1_700_000_000_000);
        let uid = RunUid::from_u128(12);
        {
            let store = RedbStore::open(dir.path()).unwrap();
            let mut run =
                RunState::create(shape(1), uid, Epoch::new(1), Arc::new(Policy::default()), now).unwrap();
            drive(&mut run, &store, now);
            // Back to what a schema-2 driver wrote.
            let txn = store.raw().as_ref().unwrap().begin_write().unwrap();
            {
                let mut meta = txn.open_table(META).unwrap();
                let key = uid.to_string();
                let mut m =
                    rec::StoredMeta::decode(meta.get(key.as_str()).unwrap().unwrap().value()).unwrap();
                m.schema = 2;
                m.conditions.clear();
                meta.insert(key.as_str(), m.encode_to_vec().as_slice()).unwrap();
                txn.open_table(SCHEMA).unwrap().insert("version", 2u32).unwrap();
                txn.delete_table(EVENTS).unwrap();
            }
            txn.commit().unwrap();
        }
        let store = RedbStore::open(dir.path()).unwrap();
        assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);
        let loaded = store.load_all().unwrap();
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].nodes.len(), 4);
        assert!(loaded[0].events.is_empty() && loaded[0].meta.conditions.is_empty());
    }

    /// A run's rollouts and stable groups are stored with it, a stable
    /// group's secrets sealed like the shape's.
    #[test]
    fn rollouts_and_stable_groups_round_trip_sealed() {
        use crate::core::rollout::{GroupRollout, Halt, StableGroup};
        use platform::secrets::SecretKey;
        let key = || Sealer::new(Some(SecretKey::from_bytes(&[3u8; 32]).unwrap()));
        let now = UnixMillis::new(1_700_000_000_000);
        let run = RunState::create(
            shape(1),
            RunUid::from_u128(9),
            Epoch::new(1),
            Arc::new(Policy::default()),
            now,
        )
        .unwrap();
        let mut meta = run.meta().clone();
        let group = meta.shape.groups[0].clone();
        meta.rollouts = vec![GroupRollout {
            failures: 2,
            promoted: true,
            canary_reached: true,
            halted: Some(Halt {
                at: now,
                reason: "2 attempts of the new template failed".to_owned(),
            }),
            reverted_from: Some(Generation::new(4)),
            ..GroupRollout::new(group.id.clone(), Generation::new(5), now, 3)
        }];
        meta.stable = vec![StableGroup {
            group,
            generation: Generation::new(3),
        }];
        let bytes = encode_meta(&key(), &meta).unwrap();
        assert!(
            !contains(&bytes, b"s3cret"),
            "a stable group's secret is in clear"
        );
        assert_eq!(decode_meta(&key(), &bytes).unwrap(), meta);
    }
}
