//! Stores written by schema versions 1 and 2 (checked-in fixtures, see
//! `fixtures/README.md`) open under the current schema: each is migrated in
//! place, every run and node reads back as written, and the driver restores
//! from it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use contract::{Effect, RunUid};
use driver_svc::{
    core::{RunStore, StoreError},
    durable::{FILE_NAME, RedbStore, SCHEMA_VERSION},
};

fn fixture_copy() -> tempfile::TempDir {
    fixture_copy_of(1)
}

fn fixture_copy_of(version: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/store-v{version}"))
        .join(FILE_NAME);
    std::fs::copy(&src, dir.path().join(FILE_NAME)).unwrap();
    dir
}

#[test]
fn a_version_1_store_is_migrated_and_reads_back_as_written() {
    reads_back_as_written(1);
}

/// Version 2 had no event log and no stored conditions: its runs read back
/// with neither, and take both from then on.
#[test]
fn a_version_2_store_is_migrated_and_reads_back_as_written() {
    reads_back_as_written(2);
}

fn reads_back_as_written(version: u32) {
    assert_eq!(
        SCHEMA_VERSION, 3,
        "a new schema needs its own fixture and migration test"
    );
    let dir = fixture_copy_of(version);
    let store = RedbStore::open(dir.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), SCHEMA_VERSION);

    let runs = store.load_all().unwrap();
    assert_eq!(runs.len(), 2);
    let train = runs
        .iter()
        .find(|r| r.meta.run_id.as_str() == "train")
        .expect("run train");
    assert_eq!(train.meta.uid, RunUid::from_u128(9));
    assert_eq!(train.meta.epoch.get(), 3);
    assert_eq!(train.meta.shape.generation.get(), 3);
    assert!(!train.meta.deleting && !train.meta.paused && !train.meta.reclaim);
    assert_eq!(train.meta.next_attempt, 5);
    let template = &train.meta.shape.groups[0].template;
    assert_eq!(template.image, "img:1");
    let token = template.boot.get("token").expect("the secret parameter");
    assert!(token.secret);
    assert_eq!(token.value, "s3cret");
    assert_eq!(train.nodes.len(), 4);
    for n in &train.nodes {
        let pending = n.node.pending.expect("a pending operation");
        assert_eq!(pending.effect, Effect::CreateLease);
        let inflight = n.inflight.as_ref().expect("the recorded operation");
        assert_eq!(inflight.id, pending.id);
        assert_eq!(n.node.spec.image, "img:1");
    }

    let serve = runs
        .iter()
        .find(|r| r.meta.run_id.as_str() == "serve")
        .expect("run serve");
    assert_eq!(serve.meta.uid, RunUid::from_u128(5));
    assert_eq!(serve.meta.epoch.get(), 7);
    assert!(serve.meta.paused && !serve.meta.reclaim);
    assert!(serve.nodes.is_empty());
    assert!(
        runs.iter()
            .all(|r| r.events.is_empty() && r.meta.conditions.is_empty())
    );

    // Migrated once: reopening reads the same, at the same version.
    drop(store);
    let again = RedbStore::open(dir.path()).unwrap();
    assert_eq!(again.schema_version().unwrap(), SCHEMA_VERSION);
    assert_eq!(again.load_all().unwrap(), runs);
}

#[test]
fn a_migrated_store_takes_new_writes() {
    let dir = fixture_copy();
    let store = RedbStore::open(dir.path()).unwrap();
    let mut runs = store.load_all().unwrap();
    let train = runs
        .iter_mut()
        .find(|r| r.meta.run_id.as_str() == "train")
        .unwrap();
    let mut delta = driver_svc::core::RunDelta::new(train.meta.uid);
    let mut meta = train.meta.clone();
    meta.deleting = true;
    delta.meta = Some(meta);
    delta.removals.push(train.nodes[0].node.id.clone());
    store.commit(&delta).unwrap();
    drop(store);
    let reopened = RedbStore::open(dir.path()).unwrap().load_all().unwrap();
    let train = reopened
        .iter()
        .find(|r| r.meta.run_id.as_str() == "train")
        .unwrap();
    assert!(train.meta.deleting);
    assert_eq!(train.nodes.len(), 3);
}

#[test]
fn the_fixtures_themselves_are_still_of_their_versions() {
    // The checked-in files must stay the versions they were written at, or
    // the migration tests above test nothing: open a copy through redb.
    for version in [1, 2] {
        let dir = fixture_copy_of(version);
        let db = redb::Database::open(dir.path().join(FILE_NAME)).unwrap();
        let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
        let schema: redb::TableDefinition<&str, u32> = redb::TableDefinition::new("schema");
        let table = txn.open_table(schema).unwrap();
        assert_eq!(table.get("version").unwrap().unwrap().value(), version);
        let events: redb::TableDefinition<(&str, u64), &[u8]> = redb::TableDefinition::new("events");
        assert!(
            txn.open_table(events).is_err(),
            "a version-{version} store has no event table"
        );
    }
}

#[test]
fn a_store_from_a_newer_schema_is_refused_and_left_alone() {
    let dir = fixture_copy();
    {
        let db = redb::Database::open(dir.path().join(FILE_NAME)).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let schema: redb::TableDefinition<&str, u32> = redb::TableDefinition::new("schema");
            let mut table = txn.open_table(schema).unwrap();
            table.insert("version", SCHEMA_VERSION + 1).unwrap();
        }
        txn.commit().unwrap();
    }
    let err = RedbStore::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt(_)), "{err}");
    assert!(err.to_string().contains("schema version"), "{err}");
    // Nothing was migrated or rewritten: still the newer version, and the
    // records are still version-1 bytes.
    let db = redb::Database::open(dir.path().join(FILE_NAME)).unwrap();
    let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
    let schema: redb::TableDefinition<&str, u32> = redb::TableDefinition::new("schema");
    assert_eq!(
        txn.open_table(schema)
            .unwrap()
            .get("version")
            .unwrap()
            .unwrap()
            .value(),
        SCHEMA_VERSION + 1
    );
    let meta: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
    let table = txn.open_table(meta).unwrap();
    let mut records = 0;
    for item in redb::ReadableTable::iter(&table).unwrap() {
        let (_, v) = item.unwrap();
        // Field 1 (schema), varint 1: the record was not rewritten.
        assert_eq!(&v.value()[..2], &[0x08, 0x01]);
        records += 1;
    }
    assert_eq!(records, 2);
}

#[test]
fn a_migration_that_fails_leaves_the_store_at_version_1() {
    let dir = fixture_copy();
    {
        // A run record that claims another schema inside a version-1 store.
        let db = redb::Database::open(dir.path().join(FILE_NAME)).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let meta: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("meta");
            let mut table = txn.open_table(meta).unwrap();
            table.insert("odd", [0x08u8, 0x07].as_slice()).unwrap();
        }
        txn.commit().unwrap();
    }
    let err = RedbStore::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt(_)), "{err}");
    assert!(err.to_string().contains("schema 7"), "{err}");
    let db = redb::Database::open(dir.path().join(FILE_NAME)).unwrap();
    let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
    let schema: redb::TableDefinition<&str, u32> = redb::TableDefinition::new("schema");
    assert_eq!(
        txn.open_table(schema)
            .unwrap()
            .get("version")
            .unwrap()
            .unwrap()
            .value(),
        1,
        "a failed migration must change nothing"
    );
}
