//! The etcd store against a real etcd (Debian's `etcd-server`, started by
//! `provisioning_tests::etcd`) on loopback with a temporary data directory per
//! test: what is committed is what is loaded, a run owned by one replica
//! refuses another's writes, ownership moves when the owner's lease goes, a
//! large delta commits whole, a replica whose keep-alive fails stops
//! writing at once, and members that refuse connections fail no request.
//!
//! Run with `cargo test -p provisioning-tests --features etcd --test etcd_store`.

#![cfg(feature = "etcd")]
#![allow(clippy::unwrap_used, clippy::expect_used)]
// The tests wait for a real etcd in real time.
#![allow(clippy::disallowed_methods)]

use std::{sync::Arc, time::Duration};

use tokio::time::Instant;

use contract::{ClusterShape, Epoch, Generation, RunId, RunUid, UnixMillis};
use driver_svc::{
    core::{MemStore, Policy, RunDelta, RunState, RunStore, StoreError, StoredRun},
    etcd::{EtcdConfig, EtcdStore},
    replicas::{Claim, Owner, Placement},
};
use platform::secrets::Sealer;
use provisioning_tests::etcd::{Etcd, free_port};

const NOW: UnixMillis = UnixMillis::new(1_700_000_000_000);

/// The stores a test opens on its etcd.
trait Stores {
    fn config(&self, owner: &str) -> EtcdConfig;
    /// A store for `owner`, retried while etcd finishes starting.
    fn store(&self, owner: &str) -> EtcdStore;
    fn store_with(&self, cfg: EtcdConfig) -> EtcdStore;
}

impl Stores for Etcd {
    fn config(&self, owner: &str) -> EtcdConfig {
        EtcdConfig {
            lease_ttl: Duration::from_secs(5),
            ..EtcdConfig::new(vec![self.endpoint.clone()], owner)
        }
    }

    fn store(&self, owner: &str) -> EtcdStore {
        self.store_with(self.config(owner))
    }

    fn store_with(&self, cfg: EtcdConfig) -> EtcdStore {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match EtcdStore::open(cfg.clone(), Sealer::default()) {
                Ok(s) => return s,
                Err(e) => {
                    assert!(Instant::now() < deadline, "etcd store did not open: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}

fn shape(count: u32, run_id: &str) -> ClusterShape {
    let mut s = ClusterShape {
        run_id: RunId::parse("r", run_id).unwrap(),
        generation: Generation::new(1),
        labels: Default::default(),
        groups: vec![contract::NodeGroup {
            id: contract::GroupId::parse("g", "workers").unwrap(),
            count,
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

/// A run with uid `uid`, named `train-<uid>`.
fn run(count: u32, uid: u128) -> RunState {
    named(count, uid, &format!("train-{uid}"))
}

fn named(count: u32, uid: u128, run_id: &str) -> RunState {
    RunState::create(
        shape(count, run_id),
        RunUid::from_u128(uid),
        Epoch::new(3),
        Arc::new(Policy::default()),
        NOW,
    )
    .unwrap()
}

/// Two passes: the run's records, then its nodes with creates in flight.
fn drive(run: &mut RunState, store: &dyn RunStore) {
    for _ in 0..2 {
        let plan = run.begin_pass(NOW).unwrap();
        let out = {
            let view = run.desired_view();
            decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), NOW)
        };
        let mut outcome = run.apply_decisions(plan, out, NOW).unwrap();
        let _ = outcome.take_commit().persist_to(store).unwrap();
    }
}

/// A delta that rewrites everything stored for `stored`, paused.
fn rewrite_delta(stored: &StoredRun) -> RunDelta {
    let mut delta = RunDelta::new(stored.meta.uid);
    let mut meta = stored.meta.clone();
    meta.paused = !meta.paused;
    delta.meta = Some(meta);
    delta.upserts = stored.nodes.iter().cloned().map(Arc::new).collect();
    delta
}

fn refused_for_ownership(r: Result<(), StoreError>) {
    match r {
        Err(StoreError::Unavailable(msg)) => assert!(
            msg.contains("does not own") || msg.contains("lost its etcd lease"),
            "{msg}"
        ),
        other => panic!("a write without ownership was not refused: {other:?}"),
    }
}

#[test]
fn what_is_committed_is_what_is_loaded() {
    let etcd = Etcd::start().unwrap();
    let store = etcd.store("a");
    let mem = MemStore::new();
    let mut a = run(4, 9);
    let mut b = a.clone();
    let mut other = run(2, 10);
    let mut other_mem = other.clone();
    drive(&mut a, &store);
    drive(&mut b, &mem);
    drive(&mut other, &store);
    drive(&mut other_mem, &mem);
    let loaded = store.load_all().unwrap();
    assert_eq!(loaded, mem.load_all().unwrap());
    assert_eq!(loaded.len(), 2);
    assert_eq!(loaded[0].nodes.len(), 4);
    assert!(
        loaded[0]
            .nodes
            .iter()
            .all(|n| n.inflight.is_some() && n.node.pending.is_some())
    );
    assert_eq!(
        loaded[0].meta.shape.groups[0].template.boot["token"].value,
        "s3cret"
    );

    // Another replica reads the same (loading needs no ownership).
    let reader = etcd.store("b");
    assert_eq!(reader.load_all().unwrap(), loaded);

    // A node delta for a run never stored is refused as such.
    let mut unknown = RunDelta::new(RunUid::from_u128(77));
    unknown.removals.push(loaded[0].nodes[0].node.id.clone());
    assert!(matches!(store.commit(&unknown), Err(StoreError::UnknownRun(_))));

    // Dropping a run leaves nothing of it, and frees it for another owner.
    let mut drop_run = RunDelta::new(RunUid::from_u128(9));
    drop_run.drop_run = true;
    store.commit(&drop_run).unwrap();
    mem.commit(&drop_run).unwrap();
    assert_eq!(store.load_all().unwrap(), mem.load_all().unwrap());
    let reader = reader;
    let mut again = run(1, 9);
    drive(&mut again, &reader);
    assert_eq!(reader.load_all().unwrap().len(), 2);
}

/// Members named in the endpoints that refuse connections (gone, or not up
/// yet) fail no request while one member answers: the store opens, and
/// every write and read goes again until it reaches the member that is up.
#[test]
fn members_that_refuse_connections_fail_no_request() {
    let etcd = Etcd::start().unwrap();
    let gone: Vec<String> = (0..2)
        .map(|_| format!("127.0.0.1:{}", free_port().unwrap()))
        .collect();
    let store = etcd.store_with(EtcdConfig {
        endpoints: vec![gone[0].clone(), etcd.endpoint.clone(), gone[1].clone()],
        ..etcd.config("a")
    });
    let mem = MemStore::new();
    for uid in 1..=12 {
        let mut run = run(2, uid);
        let mut same = run.clone();
        drive(&mut run, &store);
        drive(&mut same, &mem);
        assert_eq!(store.load_all().unwrap(), mem.load_all().unwrap());
    }
    assert_eq!(store.load_all().unwrap().len(), 12);
}

#[test]
fn a_replica_cannot_write_a_run_another_owns() {
    let etcd = Etcd::start().unwrap();
    let first = etcd.store("first");
    let second = etcd.store("second");
    let mut r = run(4, 5);
    drive(&mut r, &first);
    let before = first.load_all().unwrap();

    refused_for_ownership(second.commit(&rewrite_delta(&before[0])));
    let mut drop_run = RunDelta::new(RunUid::from_u128(5));
    drop_run.drop_run = true;
    refused_for_ownership(second.commit(&drop_run));
    assert_eq!(
        first.load_all().unwrap(),
        before,
        "a refused write changed the store"
    );

    // The owner still writes.
    first.commit(&rewrite_delta(&before[0])).unwrap();
    assert!(first.load_all().unwrap()[0].meta.paused);
}

#[test]
fn when_the_owner_lease_goes_another_replica_takes_the_run() {
    let etcd = Etcd::start().unwrap();
    let mut first = etcd.store("first");
    let second = etcd.store("second");
    let mut r = run(4, 5);
    drive(&mut r, &first);
    let before = first.load_all().unwrap();
    refused_for_ownership(second.commit(&rewrite_delta(&before[0])));

    first.revoke_lease().unwrap();
    assert!(first.is_fenced());
    let taken = rewrite_delta(&before[0]);
    second.commit(&taken).unwrap();
    let after = second.load_all().unwrap();
    assert!(after[0].meta.paused);
    assert_eq!(after[0].nodes, before[0].nodes);

    // The old owner's writes now fail and change nothing.
    refused_for_ownership(first.commit(&rewrite_delta(&after[0])));
    assert_eq!(second.load_all().unwrap(), after);

    // A third replica is refused too: the run is the second's now.
    let third = etcd.store("third");
    refused_for_ownership(third.commit(&rewrite_delta(&after[0])));
    assert_eq!(third.load_all().unwrap(), after);
}

#[test]
fn an_expired_lease_lets_another_replica_take_the_run() {
    let etcd = Etcd::start().unwrap();
    let first = etcd.store("first");
    let mut r = run(2, 5);
    drive(&mut r, &first);
    let before = first.load_all().unwrap();
    let second = etcd.store("second");
    refused_for_ownership(second.commit(&rewrite_delta(&before[0])));
    // The first replica goes away without releasing: its keep-alive stops
    // and its lease (5 s) expires unrenewed.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match second.commit(&rewrite_delta(&before[0])) {
            Ok(()) => break,
            Err(e) => {
                assert!(Instant::now() < deadline, "the run was never taken over: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    assert!(second.load_all().unwrap()[0].meta.paused);
}

#[test]
fn a_large_delta_commits_and_loads_back_whole() {
    let etcd = Etcd::start().unwrap();
    let store = etcd.store("a");
    let mem = MemStore::new();
    let mut a = run(1000, 11);
    let mut b = a.clone();
    drive(&mut a, &store);
    drive(&mut b, &mem);
    let loaded = store.load_all().unwrap();
    assert_eq!(loaded[0].nodes.len(), 1000);
    assert_eq!(loaded, mem.load_all().unwrap());

    // What a rewrite cut short leaves (records under the next generation)
    // is not part of the run, and the next rewrite clears it.
    let uid = loaded[0].meta.uid;
    let gen_key = format!("/provisioning/v1/runs/{uid}/gen");
    let generation: u64 = raw_get(&etcd, &gen_key).unwrap().parse().unwrap();
    let junk = format!("/provisioning/v1/runs/{uid}/nodes/{}/junk", generation + 1);
    raw_put(&etcd, &junk, "not a node record");
    assert_eq!(store.load_all().unwrap(), mem.load_all().unwrap());

    // A second large rewrite, and one removing nodes, still read back whole.
    let mut delta = rewrite_delta(&loaded[0]);
    delta.removals = loaded[0].nodes[..300].iter().map(|n| n.node.id.clone()).collect();
    delta.upserts.drain(..300);
    store.commit(&delta).unwrap();
    mem.commit(&delta).unwrap();
    let loaded = store.load_all().unwrap();
    assert_eq!(loaded[0].nodes.len(), 700);
    assert_eq!(raw_get(&etcd, &junk), None);
    assert_eq!(raw_get(&etcd, &gen_key), Some((generation + 1).to_string()));
    assert!(loaded[0].meta.paused);
    assert_eq!(loaded, mem.load_all().unwrap());

    // A small transaction limit splits even modest deltas the same way.
    let small = etcd.store_with(EtcdConfig {
        max_txn_ops: 8,
        prefix: "/small/".into(),
        ..etcd.config("s")
    });
    let mem = MemStore::new();
    let mut a = run(50, 12);
    let mut b = a.clone();
    drive(&mut a, &small);
    drive(&mut b, &mem);
    assert_eq!(small.load_all().unwrap(), mem.load_all().unwrap());
}

#[test]
fn a_replica_whose_keep_alive_fails_stops_writing_at_once() {
    let mut etcd = Etcd::start().unwrap();
    let store = etcd.store("a");
    let mut r = run(2, 5);
    drive(&mut r, &store);
    let stored = store.load_all().unwrap();
    assert!(!store.is_fenced());

    etcd.kill().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !store.is_fenced() {
        assert!(
            Instant::now() < deadline,
            "the store kept writing without a lease"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let t = Instant::now();
    let err = store.commit(&rewrite_delta(&stored[0])).unwrap_err();
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "the refusal waited for etcd"
    );
    assert!(err.to_string().contains("lost its etcd lease"), "{err}");
}

fn raw<T>(etcd: &Etcd, f: impl AsyncFnOnce(etcd_client::Client) -> T) -> T {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = etcd_client::Client::connect([etcd.endpoint.as_str()], None)
            .await
            .unwrap();
        f(client).await
    })
}

fn raw_get(etcd: &Etcd, key: &str) -> Option<String> {
    raw(etcd, async |mut c| {
        let r = c.get(key, None).await.unwrap();
        r.kvs().first().map(|kv| kv.value_str().unwrap().to_owned())
    })
}

fn raw_put(etcd: &Etcd, key: &str, value: &str) {
    raw(etcd, async |mut c| {
        c.put(key, value, None).await.unwrap();
    })
}

/// Revokes `lease` from outside the store that holds it (as etcd does when
/// it expires the lease), so that store has not noticed yet.
fn revoke_behind_its_back(etcd: &Etcd, lease: i64) {
    raw(etcd, async |mut c| {
        c.lease_revoke(lease).await.unwrap();
    });
}

#[test]
fn a_write_after_ownership_moved_fails_in_its_transaction() {
    let etcd = Etcd::start().unwrap();
    // A long lease: its keep-alive does not run during the test, so the
    // refusal below comes from the transaction's comparison, not from the
    // store noticing the lost lease.
    let first = etcd.store_with(EtcdConfig {
        lease_ttl: Duration::from_secs(60),
        ..etcd.config("first")
    });
    let second = etcd.store("second");
    let mut r = run(200, 5);
    drive(&mut r, &first);
    let before = first.load_all().unwrap();

    revoke_behind_its_back(&etcd, first.lease_id());
    assert!(!first.is_fenced());
    // The second takes the run with a small write (the node records stay
    // where they are, so only the ownership comparison stands in the way).
    let mut taken = RunDelta::new(RunUid::from_u128(5));
    taken.meta = rewrite_delta(&before[0]).meta;
    second.commit(&taken).unwrap();
    let after = second.load_all().unwrap();
    assert!(after[0].meta.paused);

    // A small delta (one transaction) and a large one (a rewrite).
    let mut small = RunDelta::new(RunUid::from_u128(5));
    small.upserts.push(Arc::new(before[0].nodes[0].clone()));
    small.meta = Some(before[0].meta.clone());
    for delta in [small, rewrite_delta(&after[0])] {
        match first.commit(&delta) {
            Err(StoreError::Unavailable(msg)) => {
                assert!(
                    msg.contains("does not own run") && msg.contains("second"),
                    "{msg}"
                )
            }
            other => panic!("the old owner's write was not refused: {other:?}"),
        }
        assert_eq!(
            second.load_all().unwrap(),
            after,
            "a refused write changed the store"
        );
    }
}

#[test]
fn a_restarted_replica_with_the_same_owner_id_moves_its_runs_to_its_new_lease() {
    let etcd = Etcd::start().unwrap();
    let first = etcd.store("first");
    let mut r = run(2, 5);
    drive(&mut r, &first);
    let before = first.load_all().unwrap();
    let owner_key = "/provisioning/v1/owners/".to_owned() + &before[0].meta.uid.to_string();
    let lease_of = |etcd: &Etcd| {
        raw(etcd, async |mut c| {
            let r = c.get(owner_key.as_str(), None).await.unwrap();
            r.kvs().first().map(|kv| kv.lease())
        })
    };
    assert_eq!(lease_of(&etcd), Some(first.lease_id()));
    drop(first);

    let restarted = etcd.store("first");
    restarted.commit(&rewrite_delta(&before[0])).unwrap();
    assert_eq!(lease_of(&etcd), Some(restarted.lease_id()));
    assert!(restarted.load_all().unwrap()[0].meta.paused);
}

#[test]
fn two_replicas_cannot_create_the_same_run_id() {
    let etcd = Etcd::start().unwrap();
    let first = etcd.store("first");
    let second = etcd.store("second");
    first.replicas().announce("10.0.0.1:7000").unwrap();
    let mut a = named(2, 1, "shared-name");
    drive(&mut a, &first);
    let before = first.load_all().unwrap();

    // The same run id under another uid, from another replica: refused,
    // naming the run that holds it, and nothing of it is written.
    let mut b = named(2, 2, "shared-name");
    let plan = b.begin_pass(NOW).unwrap();
    let out = {
        let view = b.desired_view();
        decider::decide(&view, b.plan_nodes(&plan), b.slot_set(), NOW)
    };
    let mut outcome = b.apply_decisions(plan, out, NOW).unwrap();
    let err = outcome.take_commit().persist_to(&second).unwrap_err();
    assert!(
        err.to_string().contains(&RunUid::from_u128(1).to_string()),
        "{err}"
    );
    let mut direct = RunDelta::new(RunUid::from_u128(3));
    direct.meta = Some(named(1, 3, "shared-name").meta().clone());
    match second.commit(&direct) {
        Err(StoreError::NameTaken { run_id, holder }) => {
            assert_eq!(run_id, "shared-name");
            assert_eq!(holder, RunUid::from_u128(1).to_string());
        }
        other => panic!("a second run with a taken run id was not refused: {other:?}"),
    }
    assert_eq!(second.load_all().unwrap(), before);

    // The second replica finds where the run is served.
    let second = second.replicas();
    assert_eq!(
        second.locate("shared-name").unwrap(),
        Placement::Elsewhere(
            RunUid::from_u128(1),
            Owner {
                id: "first".into(),
                address: Some("10.0.0.1:7000".into()),
            }
        )
    );
    assert_eq!(second.locate("no-such-run").unwrap(), Placement::Unknown);
    assert_eq!(
        first.replicas().locate("shared-name").unwrap(),
        Placement::Here(RunUid::from_u128(1))
    );

    // Once the run is dropped its name is free again.
    let mut drop_run = RunDelta::new(RunUid::from_u128(1));
    drop_run.drop_run = true;
    first.commit(&drop_run).unwrap();
    assert_eq!(second.locate("shared-name").unwrap(), Placement::Unknown);
    let mut again = named(1, 4, "shared-name");
    let second = etcd.store("second-again");
    drive(&mut again, &second);
    assert_eq!(second.load_all().unwrap().len(), 1);
}

#[test]
fn a_replica_takes_over_the_runs_of_one_that_went() {
    let etcd = Etcd::start().unwrap();
    let mut first = etcd.store("first");
    let second = etcd.store("second");
    let third = etcd.store("third");
    let (s2, s3) = (second.replicas(), third.replicas());
    let mut changes = s2.changes();
    changes.mark_unchanged();
    for uid in [21, 22] {
        let mut r = run(3, uid);
        drive(&mut r, &first);
    }
    let before = first.load_all().unwrap();
    assert!(s2.unowned().unwrap().is_empty(), "the runs have a live owner");
    assert_eq!(
        s2.claim(RunUid::from_u128(21)).unwrap(),
        Claim::Held {
            owner: "first".into()
        }
    );
    assert!(!s2.owns(RunUid::from_u128(21)));
    assert_eq!(s2.known_runs().unwrap().len(), 2);
    // A run that is not stored is nobody's to claim.
    let never = RunUid::from_u128(999);
    assert_eq!(s2.claim(never).unwrap(), Claim::Gone);
    assert!(!s2.owns(never));
    assert_eq!(raw_get(&etcd, &format!("/provisioning/v1/owners/{never}")), None);

    // The first replica goes: its ownership keys go with its lease, and the
    // others hear of it.
    first.revoke_lease().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), changes.changed())
            .await
            .expect("no ownership change was heard")
            .unwrap();
    });
    let mut unowned = s2.unowned().unwrap();
    unowned.sort();
    assert_eq!(unowned, vec![RunUid::from_u128(21), RunUid::from_u128(22)]);
    assert_eq!(
        s2.locate("train-21").unwrap(),
        Placement::Unowned(RunUid::from_u128(21))
    );

    // The second claims one and loads it whole; the third is refused it.
    let uid = RunUid::from_u128(21);
    assert_eq!(s2.claim(uid).unwrap(), Claim::Mine);
    assert!(s2.owns(uid));
    assert_eq!(
        s3.claim(uid).unwrap(),
        Claim::Held {
            owner: "second".into()
        }
    );
    assert_eq!(s2.load(uid).unwrap().as_ref(), Some(&before[0]));
    assert_eq!(s3.unowned().unwrap(), vec![RunUid::from_u128(22)]);

    // Its writes land, and say who wrote them.
    let writer = format!("/provisioning/v1/runs/{uid}/writer");
    assert_eq!(raw_get(&etcd, &writer).as_deref(), Some("first"));
    let second = second;
    second.commit(&rewrite_delta(&before[0])).unwrap();
    assert_eq!(raw_get(&etcd, &writer).as_deref(), Some("second"));
    let third = third;
    refused_for_ownership(third.commit(&rewrite_delta(&before[0])));
    assert_eq!(raw_get(&etcd, &writer).as_deref(), Some("second"));

    // Releasing a run frees it for the others.
    s2.release(uid).unwrap();
    assert!(!s2.owns(uid));
    assert_eq!(s3.claim(uid).unwrap(), Claim::Mine);
}

/// A run's event log is stored with it (`runs/<uid>/events/<seq>`): events
/// recorded and repeated load back as the memory store keeps them, the
/// oldest are deleted past the run's limit (in a small transaction and in a
/// rewrite alike), and a dropped run leaves none.
#[test]
fn the_event_log_is_stored_trimmed_and_dropped_with_its_run() {
    use contract::{EventReason, Subject};
    let etcd = Etcd::start().unwrap();
    let store = etcd.store("a");
    let mem = MemStore::new();
    let policy = Arc::new(Policy {
        event_limit: 3,
        ..Policy::default()
    });
    let mut a = RunState::create(
        shape(200, "logged"),
        RunUid::from_u128(21),
        Epoch::new(3),
        policy,
        NOW,
    )
    .unwrap();
    drive_both(&mut a, &store, &mem);
    for i in 0..4 {
        a.record_event(EventReason::Applied, Subject::Run, format!("event {i}"), NOW);
    }
    // A repeat of the latest raises its count in place.
    a.record_event(EventReason::Applied, Subject::Run, "event 3".into(), NOW);
    commit_both(&mut a, &store, &mem);
    let loaded = store.load_all().unwrap();
    assert_eq!(loaded, mem.load_all().unwrap());
    let log: Vec<(u64, u32)> = loaded[0].events.iter().map(|e| (e.seq, e.count)).collect();
    assert_eq!(log, [(2, 1), (3, 1), (4, 2)]);

    // With a pass whose delta is too large for one transaction: the events
    // ride with the switch to the rewritten nodes.
    a.record_event(EventReason::Paused, Subject::Run, "paused".into(), NOW);
    assert!(a.set_paused(true));
    let mut delta = a.take_commit().delta().clone();
    delta.upserts = loaded[0].nodes.iter().cloned().map(Arc::new).collect();
    assert!(delta.upserts.len() > EtcdConfig::new(Vec::new(), "x").max_txn_ops);
    let gen_key = format!("/provisioning/v1/runs/{}/gen", RunUid::from_u128(21));
    let before: u64 = raw_get(&etcd, &gen_key).unwrap_or_default().parse().unwrap_or(0);
    store.commit(&delta).unwrap();
    mem.commit(&delta).unwrap();
    let after: u64 = raw_get(&etcd, &gen_key).unwrap().parse().unwrap();
    assert_eq!(after, before + 1, "the delta was not a rewrite");
    let loaded = store.load_all().unwrap();
    assert_eq!(loaded, mem.load_all().unwrap());
    assert_eq!(
        loaded[0].events.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [3, 4, 5]
    );
    let first = format!("/provisioning/v1/runs/{}/events/{:020}", RunUid::from_u128(21), 2);
    assert_eq!(raw_get(&etcd, &first), None, "a trimmed event is still stored");

    let mut drop_run = RunDelta::new(RunUid::from_u128(21));
    drop_run.drop_run = true;
    store.commit(&drop_run).unwrap();
    assert!(store.load_all().unwrap().is_empty());
    let third = format!("/provisioning/v1/runs/{}/events/{:020}", RunUid::from_u128(21), 3);
    assert_eq!(raw_get(&etcd, &third), None);
}

fn drive_both(run: &mut RunState, store: &dyn RunStore, mem: &MemStore) {
    let mut copy = run.clone();
    drive(run, store);
    drive(&mut copy, mem);
}

fn commit_both(run: &mut RunState, store: &dyn RunStore, mem: &MemStore) {
    let delta = run.take_commit().delta().clone();
    store.commit(&delta).unwrap();
    mem.commit(&delta).unwrap();
}
