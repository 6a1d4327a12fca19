//! What the executor keeps across its own restart, in a redb file in its state
//! directory.
//!
//! Kept: each run's highest epoch (so an old driver incarnation stays fenced
//! after an executor restart), its retired attempts (so a stray create for a
//! cleaned-up attempt is refused), and every completed operation's result until
//! it is pruned (so a resubmission replays it instead of running it again).
//! Not kept: running and queued operations (a resubmitted one runs again and the
//! backend adopts what the first run made, keyed on the identity) and bootstrap
//! observations (the backend streams a session again from its start on
//! `resume`, with the same sequence numbers).
//!
//! The shell writes the core's changes of a step in one transaction before it
//! sends that step's outputs: a result the driver may have seen is one a
//! restarted executor can replay.
//!
//! A completed operation is kept as the digest of its input and its result,
//! never its input: no template and no secret parameter value is written.
//! Records written by executors that kept the whole operation while its
//! result was owed hold it sealed with the operator's key when one was
//! configured (`--secrets-key-file`, see `platform::secrets`); they are
//! opened once at start for their digest. The directory and file are private
//! to their owner.

use std::path::Path;

use contract::{
    AttemptId, Epoch, Operation, OperationId, OperationResult, RunUid,
    pb::{self, store::v1 as rec},
};
use platform::secrets::{OpenError, Sealer, SecretsError, open_owner_only};
use prost::Message;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::core::{DurableChange, DurableOp, DurableRun, RetiredAttempt, input_digest};

const SCHEMA_VERSION: u32 = 1;
const RUNS: TableDefinition<&str, &[u8]> = TableDefinition::new("runs");
/// (run uid, attempt, seq) → `ExecutorOp`.
const OPS: TableDefinition<(&str, u64, u32), &[u8]> = TableDefinition::new("ops");
const SCHEMA: TableDefinition<&str, u32> = TableDefinition::new("schema");

pub const FILE_NAME: &str = "executor.redb";

/// What redb may hold of the file in memory. Its default, 1 GiB, suits a
/// database that is read; this one is written, and read whole only at start,
/// so its cache holds pages the service keeps in its own structures anyway.
/// At 100,000 nodes the executor's cache held 122 MB, over two fifths of
/// what the process kept; the cache grows with the file up to its size.
/// 16 MiB, as the driver's: hosting a provider plugin, where this store
/// writes in many small transactions, it costs about 3% more of the
/// executor's CPU than 64 MiB, and 50 MB less at 100,000 nodes
/// (docs/profile-notes.md).
const CACHE_BYTES: usize = 16 << 20;

fn create_database(path: &Path) -> Result<Database, redb::DatabaseError> {
    redb::Builder::new().set_cache_size(CACHE_BYTES).create(path)
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("executor store unavailable: {0}")]
    Unavailable(String),
    #[error("executor store is corrupt: {0}")]
    Corrupt(String),
}

fn unavailable(e: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

#[derive(Debug)]
pub struct ExecutorStore {
    db: Database,
    sealer: Sealer,
}

fn sealing(e: SecretsError) -> StoreError {
    match e {
        SecretsError::Random(_) => unavailable(e),
        other => corrupt(other),
    }
}

impl ExecutorStore {
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_sealed(dir, Sealer::default())
    }

    /// As [`ExecutorStore::open`], sealing secret parameter values of the
    /// operations it keeps.
    pub fn open_sealed(dir: &Path, sealer: Sealer) -> Result<Self, StoreError> {
        let db = open_owner_only(dir, FILE_NAME, create_database).map_err(|e| match e {
            OpenError::Unavailable(e) => unavailable(e),
            OpenError::Corrupt(e) => corrupt(e),
        })?;
        let txn = db.begin_write().map_err(unavailable)?;
        {
            let mut schema = txn.open_table(SCHEMA).map_err(unavailable)?;
            let found = schema.get("version").map_err(unavailable)?.map(|v| v.value());
            match found {
                None => {
                    schema.insert("version", SCHEMA_VERSION).map_err(unavailable)?;
                }
                Some(SCHEMA_VERSION) => {}
                Some(v) => {
                    return Err(corrupt(format!(
                        "schema version {v}; this executor reads {SCHEMA_VERSION}"
                    )));
                }
            }
            txn.open_table(RUNS).map_err(unavailable)?;
            txn.open_table(OPS).map_err(unavailable)?;
        }
        txn.commit().map_err(unavailable)?;
        Ok(Self { db, sealer })
    }

    /// Writes one step's changes in one transaction.
    pub fn apply(&self, changes: &[DurableChange]) -> Result<(), StoreError> {
        if changes.is_empty() {
            return Ok(());
        }
        let txn = self.db.begin_write().map_err(unavailable)?;
        {
            let mut runs = txn.open_table(RUNS).map_err(unavailable)?;
            let mut ops = txn.open_table(OPS).map_err(unavailable)?;
            for change in changes {
                match change {
                    DurableChange::Run {
                        run_uid,
                        highest_epoch,
                        retired,
                        retired_ranges,
                    } => {
                        let uid = run_uid.to_string();
                        let bytes = rec::ExecutorRun {
                            schema: SCHEMA_VERSION,
                            run_uid: uid.clone(),
                            highest_epoch: highest_epoch.map_or(0, Epoch::get),
                            retired: retired
                                .iter()
                                .map(|r| rec::RetiredAttempt {
                                    attempt: r.attempt.get(),
                                    ops: r
                                        .ops
                                        .iter()
                                        .map(|(seq, digest)| rec::RetiredOp {
                                            seq: *seq,
                                            digest: *digest,
                                        })
                                        .collect(),
                                })
                                .collect(),
                            retired_ranges: retired_ranges
                                .iter()
                                .map(|(first, last)| rec::AttemptRange {
                                    first: first.get(),
                                    last: last.get(),
                                })
                                .collect(),
                        }
                        .encode_to_vec();
                        runs.insert(uid.as_str(), bytes.as_slice()).map_err(unavailable)?;
                    }
                    DurableChange::ForgetOps { run_uid } => {
                        let uid = run_uid.to_string();
                        remove_range(&mut ops, &uid, 0, u64::MAX)?;
                    }
                    DurableChange::Op { run_uid, id, record } => {
                        let uid = run_uid.to_string();
                        let key = (uid.as_str(), id.attempt().get(), id.seq());
                        match record {
                            Some(r) => {
                                let bytes = rec::ExecutorOp {
                                    schema: SCHEMA_VERSION,
                                    op: None,
                                    result: Some(pb::OperationResult::from(&r.result)),
                                    // Not kept (see `ExecutorCore::restore`).
                                    acked: false,
                                    input_digest: r.input_digest,
                                }
                                .encode_to_vec();
                                ops.insert(key, bytes.as_slice()).map_err(unavailable)?;
                            }
                            None => {
                                ops.remove(key).map_err(unavailable)?;
                            }
                        }
                    }
                }
            }
        }
        txn.commit().map_err(unavailable)
    }

    /// Everything kept, by run.
    pub fn load(&self) -> Result<Vec<(RunUid, DurableRun)>, StoreError> {
        let txn = self.db.begin_read().map_err(unavailable)?;
        let runs_t = txn.open_table(RUNS).map_err(unavailable)?;
        let ops_t = txn.open_table(OPS).map_err(unavailable)?;
        let mut runs: std::collections::BTreeMap<RunUid, DurableRun> = std::collections::BTreeMap::new();
        for item in runs_t.iter().map_err(unavailable)? {
            let (_, v) = item.map_err(unavailable)?;
            let r = rec::ExecutorRun::decode(v.value()).map_err(corrupt)?;
            let uid = RunUid::parse("run_uid", &r.run_uid).map_err(corrupt)?;
            runs.insert(
                uid,
                DurableRun {
                    highest_epoch: (r.highest_epoch != 0).then(|| Epoch::new(r.highest_epoch)),
                    retired: r
                        .retired
                        .into_iter()
                        .map(|a| RetiredAttempt {
                            attempt: AttemptId::new(a.attempt),
                            ops: a.ops.into_iter().map(|o| (o.seq, o.digest)).collect(),
                        })
                        .collect(),
                    retired_ranges: r
                        .retired_ranges
                        .into_iter()
                        .map(|r| (AttemptId::new(r.first), AttemptId::new(r.last)))
                        .collect(),
                    ops: Vec::new(),
                },
            );
        }
        for item in ops_t.iter().map_err(unavailable)? {
            let (k, v) = item.map_err(unavailable)?;
            let (uid, attempt, seq) = k.value();
            let r = rec::ExecutorOp::decode(v.value()).map_err(corrupt)?;
            let result = r
                .result
                .ok_or_else(|| corrupt("operation record without its result"))
                .and_then(|o| OperationResult::try_from(o).map_err(corrupt))?;
            let input_digest = match r.op {
                // Written by an executor that kept the whole operation while
                // its result was owed.
                Some(mut op) => {
                    self.sealer.open_operation(&mut op).map_err(sealing)?;
                    let op = Operation::try_from(op).map_err(corrupt)?;
                    if op.id != result.id || op.run_uid != result.run_uid {
                        return Err(corrupt(format!(
                            "operation record {uid}/{attempt}.{seq} holds the result of another operation"
                        )));
                    }
                    input_digest(&op)
                }
                None if r.input_digest != 0 => r.input_digest,
                None => return Err(corrupt("operation record without its operation or its digest")),
            };
            if result.id != OperationId::new(AttemptId::new(attempt), seq)
                || result.run_uid.to_string() != uid
            {
                return Err(corrupt(format!(
                    "operation record under the wrong key {uid}/{attempt}.{seq}"
                )));
            }
            runs.entry(result.run_uid)
                .or_default()
                .ops
                .push(DurableOp { input_digest, result });
        }
        Ok(runs.into_iter().collect())
    }
}

fn remove_range(
    ops: &mut redb::Table<(&str, u64, u32), &[u8]>,
    uid: &str,
    first_attempt: u64,
    last_attempt: u64,
) -> Result<(), StoreError> {
    let mut keys = Vec::new();
    for item in ops
        .range((uid, first_attempt, 0)..=(uid, last_attempt, u32::MAX))
        .map_err(unavailable)?
    {
        let (k, _) = item.map_err(unavailable)?;
        let (_, a, s) = k.value();
        keys.push((a, s));
    }
    for (a, s) in keys {
        ops.remove((uid, a, s)).map_err(unavailable)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use contract::{
        Claim, LogicalNodeId, OperationInput, Outcome, ResultFacts, RunId, TraceContext, UnixMillis,
        shape::example_template,
    };

    use super::*;
    use crate::core::{ExecutorCore, Output};

    const RUN: RunUid = RunUid::from_u128(77);

    fn create(attempt: u64, epoch: u64) -> Operation {
        Operation {
            run_uid: RUN,
            run_id: RunId::parse("run_id", "train").unwrap(),
            node: LogicalNodeId::parse("node", "w-0").unwrap(),
            id: OperationId::new(AttemptId::new(attempt), 1),
            epoch: Epoch::new(epoch),
            deadline: UnixMillis::new(10_000),
            provider: "fake".into(),
            input: OperationInput::CreateLease {
                template: Arc::new(example_template("fake", "img:1")),
            },
            trace: TraceContext::default(),
        }
    }

    /// A core with the run claimed at `epoch`.
    fn claimed(epoch: u64) -> ExecutorCore {
        let mut core = ExecutorCore::new();
        core.claim(&Claim {
            run_uid: RUN,
            run_id: RunId::parse("run_id", "train").unwrap(),
            epoch: Epoch::new(epoch),
        })
        .unwrap();
        core
    }

    #[test]
    fn fencing_and_completed_results_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let store = ExecutorStore::open(dir.path()).unwrap();
        let mut core = claimed(4);
        let out = core.submit(create(1, 4), UnixMillis::new(1));
        assert!(matches!(out.as_slice(), [Output::Start(_)]));
        let lease = contract::LeaseId::new("l", "lease-1").unwrap();
        let _ = core.complete(
            RUN,
            OperationId::new(AttemptId::new(1), 1),
            Outcome::Succeeded(ResultFacts {
                lease: Some(lease.clone()),
                ..ResultFacts::default()
            }),
            UnixMillis::new(2),
        );
        store.apply(&core.take_changes()).unwrap();
        drop(store);

        let store = ExecutorStore::open(dir.path()).unwrap();
        let mut again = ExecutorCore::restore(store.load().unwrap());
        assert_eq!(again.highest_epoch(RUN), Some(Epoch::new(4)));
        // The result was never acknowledged, but a restored result is owed to
        // nobody until it is asked for: the driver resubmits what it holds
        // pending when its link comes back.
        assert!(again.unacked_results().is_empty());
        // A resubmission is answered from the record and starts nothing:
        // first the result re-sent (this executor cannot know whether the
        // last one sent it at all), then replays.
        for replayed in [false, true] {
            let out = again.submit(create(1, 4), UnixMillis::new(3));
            match out.as_slice() {
                [Output::Result(r)] => {
                    assert_eq!(r.replayed, replayed);
                    assert_eq!(r.completed_at, UnixMillis::new(2));
                    assert!(matches!(&r.outcome, Outcome::Succeeded(f) if f.lease.as_ref() == Some(&lease)));
                }
                other => panic!("expected the recorded result, got {other:?}"),
            }
        }
        // An older epoch stays fenced.
        let out = again.submit(create(2, 3), UnixMillis::new(3));
        assert!(
            matches!(out.as_slice(), [Output::Rejected(r)] if r.reason == contract::RejectionReason::Fenced)
        );

        // An acknowledgement writes nothing (the record keeps the digest and
        // the result), and a store reopened again still replays the result
        // and refuses the same id with other input.
        again.ack_result(RUN, OperationId::new(AttemptId::new(1), 1));
        assert_eq!(again.take_changes(), Vec::new());
        drop(store);
        let store = ExecutorStore::open(dir.path()).unwrap();
        let loaded = store.load().unwrap();
        assert_eq!(loaded[0].1.ops[0].input_digest, input_digest(&create(1, 4)));
        let mut third = ExecutorCore::restore(loaded);
        let out = third.submit(create(1, 4), UnixMillis::new(4));
        assert!(
            matches!(out.as_slice(), [Output::Result(r)] if r.completed_at == UnixMillis::new(2)),
            "{out:?}"
        );
        let mut other = create(1, 4);
        other.input = OperationInput::DestroyLease { lease: None };
        let out = third.submit(other, UnixMillis::new(4));
        assert!(
            matches!(out.as_slice(), [Output::Rejected(r)] if r.reason == contract::RejectionReason::ConflictingInput),
            "{out:?}"
        );
    }

    /// A successful destroy on record is owed to the driver again after a
    /// restart (the other results wait for a resubmission): a resubmission
    /// replays it, and its acknowledgement retires the attempt, removes its
    /// records from the store, and refuses new operations for it.
    #[test]
    fn a_recorded_destroy_is_owed_again_and_its_acknowledgement_retires_the_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let store = ExecutorStore::open(dir.path()).unwrap();
        let mut core = claimed(1);
        let mut destroy = create(1, 1);
        destroy.id = OperationId::new(AttemptId::new(1), 2);
        destroy.input = OperationInput::DestroyLease { lease: None };
        for op in [create(1, 1), destroy.clone(), create(2, 1)] {
            let id = op.id;
            let out = core.submit(op, UnixMillis::new(1));
            assert!(matches!(out.as_slice(), [Output::Start(_)]), "{out:?}");
            let _ = core.complete(
                RUN,
                id,
                Outcome::Succeeded(ResultFacts::default()),
                UnixMillis::new(2),
            );
        }
        store.apply(&core.take_changes()).unwrap();
        drop(store);

        let store = ExecutorStore::open(dir.path()).unwrap();
        let mut again = ExecutorCore::restore(store.load().unwrap());
        let owed: Vec<OperationId> = again.unacked_results().iter().map(|r| r.id).collect();
        assert_eq!(owed, vec![destroy.id]);
        let out = again.submit(destroy.clone(), UnixMillis::new(3));
        assert!(
            matches!(out.as_slice(), [Output::Result(r)] if r.replayed),
            "{out:?}"
        );

        again.ack_result(RUN, destroy.id);
        store.apply(&again.take_changes()).unwrap();
        let loaded = store.load().unwrap();
        let kept: Vec<OperationId> = loaded[0].1.ops.iter().map(|o| o.result.id).collect();
        assert_eq!(kept, vec![OperationId::new(AttemptId::new(2), 1)]);
        assert_eq!(
            loaded[0].1.retired_ranges,
            vec![(AttemptId::new(1), AttemptId::new(1))]
        );
        let mut late = create(1, 1);
        late.id = OperationId::new(AttemptId::new(1), 3);
        let out = again.submit(late, UnixMillis::new(5));
        assert!(
            matches!(out.as_slice(), [Output::Rejected(r)] if r.reason == contract::RejectionReason::Invalid),
            "{out:?}"
        );
        let out = again.submit(create(2, 1), UnixMillis::new(5));
        assert!(
            matches!(out.as_slice(), [Output::Result(r)] if !r.replayed && r.completed_at == UnixMillis::new(2)),
            "{out:?}"
        );
    }

    /// The record of a completed operation holds no input: an executor
    /// writes the digest, and no template or parameter reaches the file.
    #[test]
    fn a_completed_operation_is_written_without_its_input() {
        let dir = tempfile::tempdir().unwrap();
        let store = ExecutorStore::open(dir.path()).unwrap();
        let mut core = claimed(1);
        let _ = core.submit(create(1, 1), UnixMillis::new(1));
        let _ = core.complete(
            RUN,
            OperationId::new(AttemptId::new(1), 1),
            Outcome::Succeeded(ResultFacts::default()),
            UnixMillis::new(2),
        );
        store.apply(&core.take_changes()).unwrap();
        let txn = store.db.begin_read().unwrap();
        let ops = txn.open_table(OPS).unwrap();
        let bytes = ops.get((RUN.to_string().as_str(), 1, 1)).unwrap().unwrap();
        let record = rec::ExecutorOp::decode(bytes.value()).unwrap();
        assert_eq!(record.op, None, "{record:?}");
        assert_eq!(record.input_digest, input_digest(&create(1, 1)));
    }

    /// A record from an executor that kept the whole operation (sealed)
    /// while its result was owed loads as the operation's digest: the
    /// restarted executor replays it to a resubmission.
    #[test]
    fn a_record_holding_the_whole_operation_loads_as_its_digest() {
        let dir = tempfile::tempdir().unwrap();
        let key = platform::secrets::SecretKey::generate().unwrap();
        let sealer = Sealer::new(Some(key));
        let store = ExecutorStore::open_sealed(dir.path(), sealer.clone()).unwrap();
        let first = create(1, 1);
        let mut op = pb::Operation::from(&first);
        sealer.seal_operation(&mut op).unwrap();
        let result = OperationResult {
            run_uid: RUN,
            node: first.node.clone(),
            id: first.id,
            effect: contract::Effect::CreateLease,
            outcome: Outcome::Succeeded(ResultFacts::default()),
            completed_at: UnixMillis::new(2),
            late: false,
            replayed: false,
            trace: TraceContext::default(),
        };
        let bytes = rec::ExecutorOp {
            schema: SCHEMA_VERSION,
            op: Some(op),
            result: Some(pb::OperationResult::from(&result)),
            acked: false,
            input_digest: 0,
        }
        .encode_to_vec();
        let txn = store.db.begin_write().unwrap();
        {
            let mut ops = txn.open_table(OPS).unwrap();
            ops.insert((RUN.to_string().as_str(), 1, 1), bytes.as_slice())
                .unwrap();
        }
        txn.commit().unwrap();

        let loaded = store.load().unwrap();
        assert_eq!(loaded[0].1.ops[0].input_digest, input_digest(&first));
        let mut core = ExecutorCore::restore(loaded);
        core.claim(&Claim {
            run_uid: RUN,
            run_id: RunId::parse("run_id", "train").unwrap(),
            epoch: Epoch::new(1),
        })
        .unwrap();
        let out = core.submit(first, UnixMillis::new(3));
        assert!(
            matches!(out.as_slice(), [Output::Result(r)] if r.completed_at == UnixMillis::new(2)),
            "{out:?}"
        );
    }
}
