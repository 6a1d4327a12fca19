//! The driver core's contract: the bad-input matrix (each class gets its typed
//! error naming the field, and the state is unchanged), the revision contract,
//! folding rules, deadlines and the errors that replace panics and spins.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{sync::Arc, time::Duration};

use contract::{
    ClusterShape, Effect, Epoch, FieldError, Generation, LogicalNodeId, NodeStage, Observation,
    OperationResult, Outcome, Problem, ResultFacts, RunId, RunUid, TraceContext, UnixMillis, pb,
    wire::shape_from_wire,
};
use driver_svc::core::{
    AckRef, Applied, ApplyError, CoreError, Discard, Fold, MemStore, PassOutcome, Policy, RunState, RunStore,
    StoreError,
};

const T0: UnixMillis = UnixMillis::new(1_700_000_000_000);
const UID: RunUid = RunUid::from_u128(0xabc);

fn pb_shape(generation: u64) -> pb::ClusterShape {
    let s = contract::ClusterShape {
        run_id: RunId::parse("run_id", "train").unwrap(),
        generation: Generation::new(generation),
        labels: Default::default(),
        groups: vec![
            contract::NodeGroup {
                id: contract::GroupId::parse("id", "ctrl").unwrap(),
                count: 2,
                template: Arc::new(contract::shape::example_template("fake", "img:1")),
                policy: Default::default(),
            },
            contract::NodeGroup {
                id: contract::GroupId::parse("id", "workers").unwrap(),
                count: 3,
                template: Arc::new(contract::shape::example_template("fake", "img:1")),
                policy: Default::default(),
            },
        ],
    };
    pb::ClusterShape::from(&s)
}

fn shape(generation: u64) -> ClusterShape {
    shape_from_wire(pb_shape(generation)).unwrap()
}

fn policy() -> Arc<Policy> {
    Arc::new(Policy {
        limits: contract::ShapeLimits {
            max_nodes_per_group: 50,
            ..contract::ShapeLimits::default()
        },
        ..Policy::default()
    })
}

/// A run with nodes, one pass in (so there is state to keep unchanged).
fn run_with_nodes() -> (RunState, MemStore) {
    let mut run = RunState::create(shape(3), UID, Epoch::new(1), policy(), T0).unwrap();
    let store = MemStore::new();
    let _ = pass(&mut run, &store, T0);
    let _ = pass(&mut run, &store, T0);
    (run, store)
}

/// A pass, persisted: its counts and what its commit released.
#[derive(Debug)]
struct Passed {
    outcome: PassOutcome,
    operations: Vec<contract::Operation>,
    acks: Vec<AckRef>,
}

impl std::ops::Deref for Passed {
    type Target = PassOutcome;
    fn deref(&self) -> &PassOutcome {
        &self.outcome
    }
}

fn pass(run: &mut RunState, store: &MemStore, now: UnixMillis) -> Passed {
    let plan = run.begin_pass(now).unwrap();
    let out = {
        let view = run.desired_view();
        decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), now)
    };
    let mut outcome = run.apply_decisions(plan, out, now).unwrap();
    let released = outcome.take_commit().persist_to(store).unwrap();
    Passed {
        outcome,
        operations: released.operations,
        acks: released.acks,
    }
}

/// What must not change: the shape, the meta, every node.
fn fingerprint(run: &RunState) -> String {
    format!("{:?}|{:?}", run.meta(), run.nodes().collect::<Vec<_>>())
}

/// A bad input either fails wire validation (naming `field`) or core
/// validation (a typed `ApplyError`); either way the run is unchanged.
enum Expect {
    Field(&'static str),
    Apply(fn(&ApplyError) -> bool),
}

#[test]
fn the_bad_input_matrix() {
    let mut cases: Vec<(&str, pb::ClusterShape, Expect)> = Vec::new();
    let good = pb_shape(4);

    let mut s = good.clone();
    s.run_id = "Train".into();
    cases.push(("malformed run id", s, Expect::Field("run_id")));
    let mut s = good.clone();
    s.groups[0].id = "ctrl_1".into();
    cases.push(("malformed group id", s, Expect::Field("groups[0].id")));
    let mut s = good.clone();
    s.groups[1].id = "ctrl".into();
    cases.push(("duplicate group id", s, Expect::Field("groups[1].id")));
    let mut s = good.clone();
    s.groups[1]
        .template
        .as_mut()
        .unwrap()
        .provider
        .as_mut()
        .unwrap()
        .cpu = f64::INFINITY;
    cases.push((
        "infinite cpu",
        s,
        Expect::Field("groups[1].template.provider.cpu"),
    ));
    let mut s = good.clone();
    s.groups[1]
        .template
        .as_mut()
        .unwrap()
        .provider
        .as_mut()
        .unwrap()
        .memory_gib = f64::NAN;
    cases.push((
        "NaN memory",
        s,
        Expect::Field("groups[1].template.provider.memory_gib"),
    ));
    let mut s = good.clone();
    s.groups[0]
        .template
        .as_mut()
        .unwrap()
        .provider
        .as_mut()
        .unwrap()
        .cpu = -1.0;
    cases.push((
        "negative cpu",
        s,
        Expect::Field("groups[0].template.provider.cpu"),
    ));
    let mut s = good.clone();
    s.groups[0].count = -3;
    cases.push(("negative count", s, Expect::Field("groups[0].count")));
    let mut s = good.clone();
    s.groups[0].count = 51;
    cases.push((
        "count over the limit",
        s,
        Expect::Apply(|e| matches!(e, ApplyError::Invalid(f) if f.field == "groups[0].count")),
    ));
    let mut s = good.clone();
    s.groups[1].run_id = "other-run".into();
    cases.push(("foreign-run group", s, Expect::Field("groups[1].run_id")));
    let mut s = good.clone();
    s.generation = 2;
    cases.push((
        "generation regression",
        s,
        Expect::Apply(|e| matches!(e, ApplyError::GenerationRegressed { .. })),
    ));
    let mut s = good.clone();
    s.generation = 3;
    s.groups[1].count = 1;
    cases.push((
        "same generation, other content",
        s,
        Expect::Apply(|e| matches!(e, ApplyError::SameGenerationOtherContent(_))),
    ));
    let mut s = good.clone();
    s.run_id = "another".into();
    cases.push((
        "run id change",
        s,
        Expect::Apply(|e| matches!(e, ApplyError::RunIdChanged { .. })),
    ));

    for (what, input, expect) in cases {
        let (mut run, _store) = run_with_nodes();
        let before = fingerprint(&run);
        match (shape_from_wire(input), expect) {
            (Err(e), Expect::Field(field)) => assert_eq!(e.field, field, "{what}: {e}"),
            (Ok(s), Expect::Apply(check)) => {
                let err = run.apply_shape(s).unwrap_err();
                assert!(check(&err), "{what}: unexpected {err:?}");
            }
            (Ok(_), Expect::Field(f)) => panic!("{what}: accepted at the wire, expected an error on {f}"),
            (Err(e), Expect::Apply(_)) => panic!("{what}: rejected at the wire ({e}), expected a core error"),
        }
        assert_eq!(fingerprint(&run), before, "{what} changed the run");
    }
}

#[test]
fn apply_to_a_deleting_run_is_refused_and_changes_nothing() {
    let (mut run, _store) = run_with_nodes();
    assert!(run.delete());
    let before = fingerprint(&run);
    let err = run.apply_shape(shape(9)).unwrap_err();
    assert!(matches!(err, ApplyError::Deleting(_)), "{err:?}");
    assert_eq!(fingerprint(&run), before);
}

#[test]
fn the_revision_contract() {
    let (mut run, _store) = run_with_nodes();
    assert_eq!(run.apply_shape(shape(3)).unwrap(), Applied::Unchanged);
    assert_eq!(run.apply_shape(shape(4)).unwrap(), Applied::Changed);
    assert_eq!(run.shape().generation, Generation::new(4));
    // Generation may skip ahead.
    assert_eq!(run.apply_shape(shape(40)).unwrap(), Applied::Changed);
    // A shape that fails validation at create time is refused too.
    let mut bad = shape(1);
    bad.groups[0].count = 51;
    let err = RunState::create(bad, UID, Epoch::new(1), policy(), T0).unwrap_err();
    assert!(
        matches!(err, ApplyError::Invalid(FieldError { ref field, problem: Problem::OverConfiguredLimit { limit: Some(50), .. } }) if field == "groups[0].count")
    );
}

fn node(id: &str) -> LogicalNodeId {
    LogicalNodeId::parse("node", id).unwrap()
}

fn result(run: &RunState, id: &str, outcome: Outcome) -> OperationResult {
    let n = run.node(&node(id)).unwrap();
    let p = n.pending.unwrap();
    OperationResult {
        run_uid: UID,
        node: n.id.clone(),
        id: p.id,
        effect: p.effect,
        outcome,
        completed_at: T0,
        late: false,
        replayed: false,
        trace: TraceContext::default(),
    }
}

#[test]
fn operations_are_recorded_and_committed_before_they_are_returned() {
    let mut run = RunState::create(shape(1), UID, Epoch::new(7), policy(), T0).unwrap();
    let store = MemStore::new();
    let first = pass(&mut run, &store, T0);
    assert_eq!(first.transitions, 5, "five inserts");
    assert!(first.follow_up);
    let second = pass(&mut run, &store, T0);
    assert_eq!(second.operations.len(), 5);
    let stored = store.load_all().unwrap();
    for op in &second.operations {
        assert_eq!(op.epoch, Epoch::new(7));
        assert_eq!(
            op.deadline,
            T0.checked_add(Policy::default().operation_timeout).unwrap()
        );
        let rec = stored[0].nodes.iter().find(|r| r.node.id == op.node).unwrap();
        assert_eq!(
            rec.node.pending.unwrap().id,
            op.id,
            "not recorded pending in the store"
        );
        assert_eq!(rec.inflight.as_deref(), Some(op));
    }
    // One pending operation per node: another pass dispatches nothing new.
    let third = pass(&mut run, &store, T0);
    assert!(third.operations.is_empty());
}

#[test]
fn a_pass_holds_its_operations_until_its_commit_is_durable() {
    let mut run = RunState::create(shape(1), UID, Epoch::new(1), policy(), T0).unwrap();
    let store = MemStore::new();
    let _ = pass(&mut run, &store, T0);
    let plan = run.begin_pass(T0).unwrap();
    let out = {
        let view = run.desired_view();
        decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), T0)
    };
    let mut outcome = run.apply_decisions(plan, out, T0).unwrap();
    let commit = outcome.take_commit();
    assert_eq!(outcome.operations, 5, "the counts stay with the outcome");
    assert_eq!(commit.operations().len(), 5);
    // Every operation the commit holds is recorded pending in its delta.
    for op in commit.operations() {
        let rec = commit
            .delta()
            .upserts
            .iter()
            .find(|r| r.node.id == op.node)
            .unwrap();
        assert_eq!(rec.node.pending.map(|p| p.id), Some(op.id));
        assert_eq!(rec.inflight.as_deref(), Some(op));
    }
    // A store that refuses the write releases nothing.
    let refused = commit
        .clone()
        .persist(|_| Err(StoreError::Unavailable("refused".into())));
    assert!(refused.is_err());
    // One that takes it releases the operations, and only then.
    let mut written = 0;
    let released = commit
        .persist(|delta| {
            written = delta.upserts.len();
            Ok(())
        })
        .unwrap();
    assert_eq!(written, 5);
    assert_eq!(released.operations.len(), 5);
}

#[test]
fn folding_discards_what_it_must() {
    let (mut run, store) = run_with_nodes();
    let ok = result(
        &run,
        "workers-0",
        Outcome::Succeeded(ResultFacts {
            lease: Some(contract::LeaseId::new("l", "lease-1").unwrap()),
            endpoint: None,
            session: None,
        }),
    );

    // Another run's result.
    let mut other = ok.clone();
    other.run_uid = RunUid::from_u128(1);
    assert_eq!(
        run.fold_result(&other, T0).unwrap(),
        Fold::Discarded(Discard::OtherRun)
    );
    // A superseded attempt.
    let mut old = ok.clone();
    old.id = contract::OperationId::new(contract::AttemptId::new(ok.id.attempt().get() + 100), 1);
    assert_eq!(
        run.fold_result(&old, T0).unwrap(),
        Fold::Discarded(Discard::SupersededAttempt)
    );
    // An unknown operation of the right attempt.
    let mut unknown = ok.clone();
    unknown.id = contract::OperationId::new(ok.id.attempt(), 99);
    assert_eq!(
        run.fold_result(&unknown, T0).unwrap(),
        Fold::Discarded(Discard::UnknownOperation)
    );
    // A late completion.
    let mut late = ok.clone();
    late.late = true;
    assert_eq!(
        run.fold_result(&late, T0).unwrap(),
        Fold::Discarded(Discard::Late)
    );
    // None of that changed the node.
    assert!(run.node(&node("workers-0")).unwrap().pending.is_some());

    assert_eq!(run.fold_result(&ok, T0).unwrap(), Fold::Folded);
    let n = run.node(&node("workers-0")).unwrap();
    assert_eq!(n.stage, NodeStage::LeaseCreated);
    assert!(n.pending.is_none());
    assert!(
        n.stage_deadline.is_some(),
        "entering LeaseCreated stores the endpoint deadline"
    );
    // The same result again is an unknown operation now.
    assert_eq!(
        run.fold_result(&ok, T0).unwrap(),
        Fold::Discarded(Discard::UnknownOperation)
    );
    // Acknowledgements are released only by a commit.
    let acks = run.take_commit().persist_to(&store).unwrap().acks;
    assert!(!acks.is_empty());
}

#[test]
fn not_ready_is_a_probe_and_failures_back_off() {
    let (mut run, store) = run_with_nodes();
    let lease = contract::LeaseId::new("l", "lease-1").unwrap();
    let created = result(
        &run,
        "workers-1",
        Outcome::Succeeded(ResultFacts {
            lease: Some(lease),
            ..ResultFacts::default()
        }),
    );
    let _ = run.fold_result(&created, T0).unwrap();
    let _ = pass(&mut run, &store, T0);
    let n = run.node(&node("workers-1")).unwrap();
    assert_eq!(n.pending.unwrap().effect, Effect::LookupEndpoint);
    let not_ready = result(
        &run,
        "workers-1",
        Outcome::NotReady {
            reason: "not bound".into(),
        },
    );
    let _ = run.fold_result(&not_ready, T0).unwrap();
    let n = run.node(&node("workers-1")).unwrap();
    assert_eq!(n.retry.consecutive_failures, 0, "not-ready is not a failure");
    assert_eq!(
        n.retry.next_effect_at,
        T0.checked_add(Policy::default().probe_interval).ok()
    );

    // A definite create failure backs off per the policy.
    let failed = result(
        &run,
        "workers-2",
        Outcome::Retryable {
            reason: "quota".into(),
        },
    );
    let _ = run.fold_result(&failed, T0).unwrap();
    let n = run.node(&node("workers-2")).unwrap();
    assert_eq!(n.retry.consecutive_failures, 1);
    let expected = contract::backoff_delay(&Policy::default().backoff, UID, n.attempt, 1);
    assert_eq!(n.retry.next_effect_at, T0.checked_add(expected).ok());
    assert_eq!(n.stage, NodeStage::New);
}

#[test]
fn an_operation_past_its_deadline_and_grace_folds_as_ambiguous() {
    let (mut run, store) = run_with_nodes();
    let p = run.node(&node("ctrl-0")).unwrap().pending.unwrap();
    let grace = Policy::default().result_grace;
    let just_before = UnixMillis::new(p.deadline.as_millis() + grace.as_millis() as u64 - 1);
    assert_eq!(run.handle_timeout(just_before).unwrap(), 0);
    let at = p.deadline.checked_add(grace).unwrap();
    assert_eq!(
        run.poll_timeout(),
        Some(at),
        "the earliest deadline is the pending op's plus grace"
    );
    assert!(run.handle_timeout(at).unwrap() >= 1);
    let n = run.node(&node("ctrl-0")).unwrap();
    assert!(n.pending.is_none());
    assert!(
        n.facts.ambiguous_create,
        "an expired create is remembered as ambiguous"
    );
    // The result arriving after that is discarded.
    let late = OperationResult {
        run_uid: UID,
        node: node("ctrl-0"),
        id: p.id,
        effect: p.effect,
        outcome: Outcome::Succeeded(ResultFacts::default()),
        completed_at: at,
        late: false,
        replayed: false,
        trace: TraceContext::default(),
    };
    assert_eq!(
        run.fold_result(&late, at).unwrap(),
        Fold::Discarded(Discard::UnknownOperation)
    );
    // The next pass re-issues the create (so the executor adopts).
    let n = run.node(&node("ctrl-0")).unwrap();
    let retry_at = n.retry.next_effect_at.unwrap();
    let out = pass(&mut run, &store, retry_at);
    assert!(
        out.operations
            .iter()
            .any(|o| o.node == node("ctrl-0") && o.input.effect() == Effect::CreateLease)
    );
}

/// A step of the wall clock, followed by the shell: the deadlines move with
/// it, so an hour forward expires nothing that was not due, an hour back
/// holds nothing for the hour, and the moved records go with the next
/// commit.
#[test]
fn deadlines_move_with_a_step_of_the_wall_clock() {
    let hour: i64 = 3_600_000;
    let (mut run, store) = run_with_nodes();
    let p = run.node(&node("ctrl-0")).unwrap().pending.unwrap();
    let due = run.poll_timeout().unwrap();
    let _ = run.take_commit();

    // An hour forward: nothing is due at the stepped time that was not due
    // an hour earlier.
    let moved = run.shift_deadlines(hour);
    assert!(moved >= 2, "{moved} slots moved");
    assert_eq!(
        run.poll_timeout().unwrap().as_millis(),
        due.as_millis() + 3_600_000
    );
    let n = run.node(&node("ctrl-0")).unwrap().pending.unwrap();
    assert_eq!(n.deadline.as_millis(), p.deadline.as_millis() + 3_600_000);
    assert_eq!(n.id, p.id, "the operation is the same one");
    let stepped_now = UnixMillis::new(T0.as_millis() + 3_600_000);
    assert_eq!(
        run.handle_timeout(stepped_now).unwrap(),
        0,
        "nothing expired on the step"
    );
    assert!(run.uncommitted(), "the moved records wait for a commit");
    let _ = pass(&mut run, &store, stepped_now);

    // Back again: the deadline is where it was, not an hour away.
    run.shift_deadlines(-hour);
    assert_eq!(run.poll_timeout(), Some(due));
    assert!(
        run.handle_timeout(due).unwrap() >= 1,
        "the deadline still fires on time"
    );
    assert_eq!(run.shift_deadlines(0), 0);
}

#[test]
fn a_stage_deadline_fails_the_attempt() {
    let policy = Arc::new(Policy {
        endpoint_timeout: Duration::from_secs(10),
        ..Policy::default()
    });
    let mut run = RunState::create(shape(1), UID, Epoch::new(1), policy, T0).unwrap();
    let store = MemStore::new();
    let _ = pass(&mut run, &store, T0);
    let _ = pass(&mut run, &store, T0);
    let created = result(
        &run,
        "ctrl-0",
        Outcome::Succeeded(ResultFacts {
            lease: Some(contract::LeaseId::new("l", "lease-9").unwrap()),
            ..ResultFacts::default()
        }),
    );
    let _ = run.fold_result(&created, T0).unwrap();
    let later = T0.checked_add(Duration::from_secs(10)).unwrap();
    run.handle_timeout(later).unwrap();
    let n = run.node(&node("ctrl-0")).unwrap();
    assert_eq!(n.stage, NodeStage::Failed);
    assert!(n.facts.failure.as_ref().unwrap().reason.contains("no endpoint"));
    assert!(n.retry.restart_at.is_some());
    assert!(n.retry.next_effect_at.is_none(), "cleanup is not delayed");
    assert!(
        n.facts.lease.is_some(),
        "the lease stays recorded until it is destroyed"
    );
}

#[test]
fn observations_fold_only_into_the_session_they_name() {
    let (mut run, store) = run_with_nodes();
    let id = "workers-0";
    let created = result(
        &run,
        id,
        Outcome::Succeeded(ResultFacts {
            lease: Some(contract::LeaseId::new("l", "lease-1").unwrap()),
            endpoint: Some(contract::Endpoint::new("e", "10.0.0.1:22").unwrap()),
            session: None,
        }),
    );
    let _ = run.fold_result(&created, T0).unwrap();
    let _ = pass(&mut run, &store, T0);
    let attempt = run.node(&node(id)).unwrap().attempt;
    let session = contract::SessionId::new("s", "sess-1").unwrap();
    let obs = |seq, stage| Observation {
        run_uid: UID,
        node: node(id),
        attempt,
        session: session.clone(),
        seq,
        stage,
        detail: String::new(),
        at: T0,
        trace: TraceContext::default(),
    };
    // Before the start result names the session: kept for a replay, not acked.
    assert_eq!(
        run.fold_observation(&obs(1, contract::BootstrapStage::Connected), T0)
            .unwrap(),
        Fold::Discarded(Discard::SessionNotYetKnown)
    );
    let started = result(
        &run,
        id,
        Outcome::Succeeded(ResultFacts {
            session: Some(session.clone()),
            ..ResultFacts::default()
        }),
    );
    let _ = run.fold_result(&started, T0).unwrap();
    assert_eq!(run.take_replays(), vec![(session.clone(), 0)]);
    assert_eq!(
        run.fold_observation(&obs(1, contract::BootstrapStage::Connected), T0)
            .unwrap(),
        Fold::Folded
    );
    assert_eq!(
        run.fold_observation(&obs(1, contract::BootstrapStage::Connected), T0)
            .unwrap(),
        Fold::Discarded(Discard::Duplicate)
    );
    let mut other = obs(2, contract::BootstrapStage::BootCheck);
    other.session = contract::SessionId::new("s", "sess-old").unwrap();
    assert_eq!(
        run.fold_observation(&other, T0).unwrap(),
        Fold::Discarded(Discard::StaleSession)
    );
    // A stage past the next one (2 and 3 have not arrived: a reconnected
    // stream sends new stages before the replay of older ones) is left for
    // a replay after the last folded one, and not acknowledged.
    assert_eq!(
        run.fold_observation(&obs(4, contract::BootstrapStage::Converged), T0)
            .unwrap(),
        Fold::Discarded(Discard::Gap)
    );
    assert_eq!(run.take_replays(), vec![(session.clone(), 1)]);
    assert_eq!(run.node(&node(id)).unwrap().stage, NodeStage::BootstrapRunning);
    for (seq, stage) in [
        (2, contract::BootstrapStage::BootCheck),
        (3, contract::BootstrapStage::Joined),
        (4, contract::BootstrapStage::Converged),
    ] {
        assert_eq!(run.fold_observation(&obs(seq, stage), T0).unwrap(), Fold::Folded);
    }
    // Nothing after the session's end is folded: it would take the node
    // back to a stage it has passed.
    assert_eq!(
        run.fold_observation(&obs(5, contract::BootstrapStage::Joined), T0)
            .unwrap(),
        Fold::Discarded(Discard::AfterEnd)
    );
    assert_eq!(
        run.node(&node(id))
            .unwrap()
            .facts
            .bootstrap
            .as_ref()
            .map(|b| b.stage),
        Some(contract::BootstrapStage::Converged)
    );
    assert_eq!(run.node(&node(id)).unwrap().stage, NodeStage::Joined);
    let acked: Vec<u64> = run
        .take_commit()
        .persist_to(&store)
        .unwrap()
        .acks
        .iter()
        .filter_map(|a| match a {
            AckRef::Observation { seq, .. } => Some(*seq),
            _ => None,
        })
        .collect();
    assert_eq!(acked, [1, 1, 2, 2, 3, 4, 5], "the gap is not acknowledged");
    // Convergence is a driver transition: the node becomes ready.
    let _ = pass(&mut run, &store, T0);
    let n = run.node(&node(id)).unwrap();
    assert_eq!(n.stage, NodeStage::Dormant);
    assert_eq!(n.retry.consecutive_failures, 0);
    assert!(n.facts.session.is_none());
}

#[test]
fn clock_saturation_is_an_error_not_a_panic_or_a_spin() {
    let mut run = RunState::create(shape(1), UID, Epoch::new(1), policy(), T0).unwrap();
    let store = MemStore::new();
    let near_end = UnixMillis::new(u64::MAX - 10);
    let _ = pass(&mut run, &store, near_end);
    let before = fingerprint(&run);
    // Dispatching needs a deadline that does not fit: the pass errors.
    let plan = run.begin_pass(near_end).unwrap();
    let out = {
        let view = run.desired_view();
        decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), near_end)
    };
    let err = run.apply_decisions(plan, out, near_end).unwrap_err();
    assert!(matches!(err, CoreError::Clock(_)), "{err:?}");
    // No operation was recorded for the node whose deadline overflowed.
    assert!(run.nodes().all(|n| n.pending.is_none()), "{before}");
    // And a second pass is not left wedged in progress.
    assert!(run.begin_pass(near_end).is_ok());
}

#[test]
fn a_pass_applies_decisions_only_to_the_state_they_were_made_from() {
    let (mut run, store) = run_with_nodes();
    run.mark_all_dirty();
    let plan = run.begin_pass(T0).unwrap();
    // A result folds while the decider is deciding.
    let created = result(
        &run,
        "workers-2",
        Outcome::Succeeded(ResultFacts {
            lease: Some(contract::LeaseId::new("l", "lease-7").unwrap()),
            ..ResultFacts::default()
        }),
    );
    let out = {
        let view = run.desired_view();
        decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), T0)
    };
    let _ = run.fold_result(&created, T0).unwrap();
    let mut outcome = run.apply_decisions(plan, out, T0).unwrap();
    let _ = outcome.take_commit().persist_to(&store).unwrap();
    // The decision for workers-2 was made before the fold: skipped, and a
    // follow-up pass is requested.
    assert!(outcome.stale >= 1 && outcome.follow_up, "{outcome:?}");
    assert!(run.needs_pass(T0));
    let next = pass(&mut run, &store, T0);
    assert!(
        next.operations
            .iter()
            .any(|o| o.node == node("workers-2") && o.input.effect() == Effect::LookupEndpoint)
    );
}

fn orphan(id: &str, attempt: u64, session_live: bool) -> driver_svc::core::OrphanResource {
    driver_svc::core::OrphanResource {
        node: node(id),
        attempt: contract::AttemptId::new(attempt),
        lease: Some(contract::LeaseId::new("lease", &format!("lease-{id}-{attempt}")).unwrap()),
        endpoint: Some(contract::Endpoint::new("endpoint", "127.0.0.1:9").unwrap()),
        session_live,
    }
}

fn succeed(run: &mut RunState, id: &str) {
    let r = result(run, id, Outcome::Succeeded(ResultFacts::default()));
    assert_eq!(run.fold_result(&r, T0).unwrap(), Fold::Folded);
}

#[test]
fn an_orphan_of_a_gone_run_is_destroyed_through_the_deletion_path() {
    let mut run = RunState::reclaim(
        RunId::parse("run_id", "train").unwrap(),
        UID,
        Epoch::new(4),
        policy(),
        T0,
    );
    let store = MemStore::new();
    assert!(run.is_reclaim() && run.is_deleting());
    assert!(run.adopt_orphan(&orphan("workers-7", 3, true)));
    assert!(
        !run.adopt_orphan(&orphan("workers-7", 5, false)),
        "one attempt per slot"
    );
    let mut without_lease = orphan("workers-8", 1, false);
    without_lease.lease = None;
    assert!(!run.adopt_orphan(&without_lease), "nothing to destroy by id");
    let _ = run.take_commit().persist_to(&store).unwrap();
    let stored = store.load_all().unwrap();
    assert!(stored[0].meta.reclaim && stored[0].meta.deleting);
    assert_eq!(stored[0].meta.next_attempt, 4, "attempts above the orphan's");

    // Cancel first (the session id is unknown: by identity), then destroy,
    // each recorded pending before it is returned, on ids the attempt never
    // used.
    let cancel = pass(&mut run, &store, T0);
    assert_eq!(cancel.operations.len(), 1);
    let op = &cancel.operations[0];
    assert_eq!(
        op.input,
        contract::OperationInput::CancelBootstrap { session: None }
    );
    assert_eq!(op.id.attempt().get(), 3);
    assert!(op.id.seq() >= driver_svc::core::ORPHAN_SEQ_BASE);
    assert_eq!(op.epoch, Epoch::new(4));
    let rec = &store.load_all().unwrap()[0].nodes[0];
    assert_eq!(rec.node.pending.map(|p| p.id), Some(op.id));
    succeed(&mut run, "workers-7");
    let destroy = pass(&mut run, &store, T0);
    assert_eq!(destroy.operations.len(), 1);
    assert_eq!(
        destroy.operations[0].input,
        contract::OperationInput::DestroyLease {
            lease: Some(contract::LeaseId::new("lease", "lease-workers-7-3").unwrap())
        }
    );
    succeed(&mut run, "workers-7");
    for _ in 0..3 {
        if run.is_gone() {
            break;
        }
        let _ = pass(&mut run, &store, T0);
    }
    assert!(
        run.is_gone(),
        "destroyed and reaped: {:?}",
        run.nodes().collect::<Vec<_>>()
    );
}

#[test]
fn an_orphan_of_a_live_run_is_adopted_only_into_a_free_slot() {
    let (mut run, store) = run_with_nodes();
    let held: Vec<String> = run.nodes().map(|n| n.id.to_string()).collect();
    assert!(!run.adopt_orphan(&orphan("workers-1", 99, false)), "held slot");
    assert!(run.adopt_orphan(&orphan("workers-9", 2, false)));
    let before = fingerprint_of(&run, &held);
    let out = pass(&mut run, &store, T0);
    let orphan_ops: Vec<_> = out
        .operations
        .iter()
        .filter(|o| o.node == node("workers-9"))
        .collect();
    assert_eq!(orphan_ops.len(), 1);
    assert_eq!(orphan_ops[0].input.effect(), Effect::DestroyLease);
    assert!(!run.is_deleting(), "the run itself is not deleted");
    assert_eq!(
        fingerprint_of(&run, &held),
        before,
        "the run's own nodes are untouched by the adoption"
    );
    assert_eq!(
        run.node(&node("workers-9")).unwrap().stage,
        NodeStage::EndpointKnown
    );
}

fn fingerprint_of(run: &RunState, ids: &[String]) -> String {
    format!(
        "{:?}",
        run.nodes()
            .filter(|n| ids.contains(&n.id.to_string()))
            .map(|n| (&n.id, n.attempt, n.stage, n.pending.map(|p| p.id)))
            .collect::<Vec<_>>()
    )
}

#[test]
fn a_burst_of_results_is_gathered_into_one_pass_and_a_pause_ends_it() {
    let ms = Duration::from_millis;
    let at = |t: u64| T0.checked_add(ms(t)).unwrap();
    let policy = Arc::new(Policy {
        pass_batch: ms(50),
        ..(*policy()).clone()
    });
    let mut run = RunState::create(shape(1), UID, Epoch::new(1), policy, T0).unwrap();
    let store = MemStore::new();
    let _ = pass(&mut run, &store, T0);
    let creates = pass(&mut run, &store, T0);
    assert_eq!(creates.operations.len(), 5);
    let fold = |run: &mut RunState, id: &str, t: u64| {
        let mut r = result(run, id, Outcome::Succeeded(ResultFacts::default()));
        r.completed_at = at(t);
        assert_eq!(run.fold_result(&r, at(t)).unwrap(), Fold::Folded);
    };

    // One result: the pass waits one window for more.
    fold(&mut run, "ctrl-0", 0);
    assert!(!run.needs_pass(at(0)));
    assert_eq!(run.poll_timeout(), Some(at(50)));
    // Another within the window, with most still outstanding: the batch
    // stretches to one window after the latest result.
    fold(&mut run, "ctrl-1", 40);
    assert!(
        !run.needs_pass(at(60)),
        "a streaming burst ended after one window"
    );
    assert_eq!(run.poll_timeout(), Some(at(90)));
    // A pause of one window ends it.
    assert!(run.needs_pass(at(90)));
    // So does having folded at least as many as are still pending.
    fold(&mut run, "workers-0", 60);
    assert!(run.needs_pass(at(60)), "half the burst is in: decide now");
    // One pass takes the three results.
    let decided = pass(&mut run, &store, at(60));
    assert_eq!(decided.acks.len(), 3, "{decided:?}");
}

/// SPEC §8: a lost resource fails the attempt it names (then row 4 cleans it
/// up and the slot restarts under backoff); a loss of another run or attempt
/// changes nothing; every change is acknowledged only by a commit.
#[test]
fn a_lost_resource_fails_only_the_attempt_it_names() {
    let (mut run, store) = run_with_nodes();
    let id = node("ctrl-0");
    let attempt = run.node(&id).unwrap().attempt;
    let lost = |run_uid: RunUid, attempt: contract::AttemptId, seq: u64| contract::ResourceChange {
        run_uid,
        node: id.clone(),
        attempt,
        seq,
        change: contract::Change::Lost {
            reason: "node agent pid 7 was killed by signal 9".to_owned(),
        },
        at: T0,
        trace: TraceContext::default(),
    };
    let before = fingerprint(&run);
    let other_attempt = contract::AttemptId::new(attempt.get() + 1000);
    assert_eq!(
        run.fold_resource_change(&lost(UID, other_attempt, 1), T0)
            .unwrap(),
        Fold::Discarded(Discard::SupersededAttempt)
    );
    assert_eq!(
        run.fold_resource_change(&lost(RunUid::from_u128(0xdef), attempt, 2), T0)
            .unwrap(),
        Fold::Discarded(Discard::OtherRun)
    );
    assert_eq!(fingerprint(&run), before, "a discarded change changed the run");

    assert_eq!(
        run.fold_resource_change(&lost(UID, attempt, 3), T0).unwrap(),
        Fold::Folded
    );
    let n = run.node(&id).unwrap();
    assert_eq!(n.stage, NodeStage::Failed);
    assert_eq!(
        n.facts.failure.as_ref().unwrap().reason,
        "resource lost: node agent pid 7 was killed by signal 9"
    );
    assert_eq!(n.retry.consecutive_failures, 1);
    assert!(n.retry.restart_at.is_some(), "the restart backs off");
    // The same loss again is a duplicate.
    assert_eq!(
        run.fold_resource_change(&lost(UID, attempt, 3), T0).unwrap(),
        Fold::Discarded(Discard::Duplicate)
    );
    // The changes of this run are acknowledged once committed; the other
    // run's is not this run's to acknowledge.
    let acks = run.take_commit().persist_to(&store).unwrap().acks;
    let changes: Vec<u64> = acks
        .iter()
        .filter_map(|a| match a {
            AckRef::Change { seq } => Some(*seq),
            _ => None,
        })
        .collect();
    assert_eq!(changes, [1, 3, 3]);
    // The next pass begins its cleanup (row 4).
    let p = pass(&mut run, &store, T0);
    assert!(p.transitions >= 1);
    assert_eq!(run.node(&id).unwrap().intent, contract::Intent::Deleting);
}

/// SPEC §8: health is a fact of the attempt it names. The first unhealthy
/// report stores the remediation deadline (`since` plus the group's
/// `unhealthy_after`) and counts in the group's day-2 counts; a report
/// ordered before the one folded is stale; a healthy one clears both.
#[test]
fn a_health_report_is_a_fact_with_its_times_and_counts() {
    let (mut run, _store) = run_with_nodes();
    let at = |t: u64| T0.checked_add(std::time::Duration::from_millis(t)).unwrap();
    let id = node("ctrl-0");
    let attempt = run.node(&id).unwrap().attempt;
    let report = |healthy: bool, seq: u64, t: u64| contract::ResourceChange {
        run_uid: UID,
        node: id.clone(),
        attempt,
        seq,
        change: contract::Change::Health {
            healthy,
            detail: if healthy {
                "probe answered"
            } else {
                "no answer within 200 ms"
            }
            .to_owned(),
        },
        at: at(t),
        trace: TraceContext::default(),
    };
    let ctrl = contract::GroupId::parse("id", "ctrl").unwrap();
    // The day-2 counts alone (the rollout's are tested on their own).
    let day2 = |run: &RunState| -> Vec<(contract::GroupId, u32, u32)> {
        run.group_counts()
            .into_iter()
            .filter(|(_, c)| c.unhealthy + c.remediating > 0)
            .map(|(g, c)| (g, c.unhealthy, c.remediating))
            .collect()
    };
    assert!(day2(&run).is_empty());

    assert_eq!(
        run.fold_resource_change(&report(false, 2, 100), at(100)).unwrap(),
        Fold::Folded
    );
    let h = run.node(&id).unwrap().facts.health.clone().unwrap();
    assert!(!h.healthy);
    assert_eq!(h.since, at(100));
    let unhealthy_after = contract::HealthPolicy::default().unhealthy_after_ms;
    assert_eq!(h.remediate_at, Some(at(100 + unhealthy_after)));
    assert_eq!(day2(&run), [(ctrl.clone(), 1, 0)]);
    // Still unhealthy later: `since` and the deadline stay.
    assert_eq!(
        run.fold_resource_change(&report(false, 3, 500), at(500)).unwrap(),
        Fold::Folded
    );
    let h = run.node(&id).unwrap().facts.health.clone().unwrap();
    assert_eq!((h.since, h.observed_at), (at(100), at(500)));
    assert_eq!(h.remediate_at, Some(at(100 + unhealthy_after)));

    // An older report, re-sent after a newer one was folded, is stale.
    assert_eq!(
        run.fold_resource_change(&report(true, 1, 50), at(600)).unwrap(),
        Fold::Discarded(Discard::Duplicate)
    );
    assert!(!run.node(&id).unwrap().facts.health.as_ref().unwrap().healthy);

    assert_eq!(
        run.fold_resource_change(&report(true, 4, 700), at(700)).unwrap(),
        Fold::Folded
    );
    let h = run.node(&id).unwrap().facts.health.clone().unwrap();
    assert!(h.healthy);
    assert_eq!((h.since, h.remediate_at), (at(700), None));
    assert!(day2(&run).is_empty(), "{:?}", run.group_counts());
    assert!(run.indexes_consistent());
}

/// SPEC §8, events: a loss and a health change are logged in the same
/// commit as the fold they describe; a repeat is only stored again, never
/// logged twice; a run restored from its store keeps its log and numbering.
#[test]
fn events_are_written_with_the_change_they_describe_and_outlive_a_restart() {
    use contract::{EventReason, Subject};
    let (mut run, store) = run_with_nodes();
    let _ = run.take_commit().persist_to(&store).unwrap();
    let id = node("workers-1");
    let attempt = run.node(&id).unwrap().attempt;
    let change = |seq: u64, change: contract::Change| contract::ResourceChange {
        run_uid: UID,
        node: id.clone(),
        attempt,
        seq,
        change,
        at: T0,
        trace: TraceContext::default(),
    };
    let sick = contract::Change::Health {
        healthy: false,
        detail: "no answer within 200 ms".into(),
    };
    assert_eq!(
        run.fold_resource_change(&change(1, sick.clone()), T0).unwrap(),
        Fold::Folded
    );
    // The same state reported again logs nothing new.
    let later = T0.checked_add(Duration::from_millis(10)).unwrap();
    let mut again = change(2, sick);
    again.at = later;
    assert_eq!(run.fold_resource_change(&again, later).unwrap(), Fold::Folded);
    let lost = contract::Change::Lost {
        reason: "pid 9 killed by signal 9".into(),
    };
    let mut gone = change(3, lost);
    gone.at = later;
    assert_eq!(run.fold_resource_change(&gone, later).unwrap(), Fold::Folded);

    let reasons: Vec<EventReason> = run.events().map(|e| e.reason).collect();
    assert_eq!(reasons, [EventReason::NodeUnhealthy, EventReason::NodeLost]);
    let lost_event = run.events().last().unwrap().clone();
    assert_eq!(
        lost_event.subject,
        Subject::Node {
            node: id.clone(),
            attempt
        }
    );
    assert!(
        lost_event.message.contains("pid 9 killed by signal 9"),
        "{}",
        lost_event.message
    );

    // Both go out in the commit that carries the folds, with their acks.
    let commit = run.take_commit();
    assert_eq!(commit.delta().events.len(), 2);
    assert!(commit.delta().upserts.iter().any(|r| r.node.id == id));
    assert_eq!(commit.acks().len(), 3);
    let _ = commit.persist_to(&store).unwrap();
    assert!(!run.uncommitted());

    // A repeat of the latest event raises its count and is written again
    // under its number.
    run.record_event(
        EventReason::NodeLost,
        lost_event.subject.clone(),
        lost_event.message.clone(),
        later,
    );
    assert_eq!(run.event_mark(), (lost_event.seq, 2));
    let commit = run.take_commit();
    assert_eq!(commit.delta().events.len(), 1);
    assert_eq!(commit.delta().events[0].seq, lost_event.seq);
    let _ = commit.persist_to(&store).unwrap();

    // Restored from the store (as after a restart): the same log, and the
    // next event numbered after it.
    let stored = store.load_all().unwrap().pop().unwrap();
    let mut restored = RunState::restore(stored, Epoch::new(2), policy());
    let log: Vec<(u64, EventReason, u32)> = restored.events().map(|e| (e.seq, e.reason, e.count)).collect();
    assert_eq!(
        log,
        [
            (lost_event.seq - 1, EventReason::NodeUnhealthy, 1),
            (lost_event.seq, EventReason::NodeLost, 2)
        ]
    );
    restored.record_event(EventReason::Restored, Subject::Run, "restored".into(), later);
    assert_eq!(restored.event_mark(), (lost_event.seq + 1, 1));
}

/// The log is bounded: past the policy's limit the oldest events go, from
/// memory and (through the commit) from the store.
#[test]
fn the_event_log_keeps_the_latest_events_up_to_its_limit() {
    use contract::{EventReason, Subject};
    let policy = Arc::new(Policy {
        event_limit: 3,
        ..(*policy()).clone()
    });
    let mut run = RunState::create(shape(1), UID, Epoch::new(1), policy.clone(), T0).unwrap();
    let store = MemStore::new();
    for i in 0..5u64 {
        run.record_event(EventReason::Applied, Subject::Run, format!("event {i}"), T0);
    }
    let seqs: Vec<u64> = run.events().map(|e| e.seq).collect();
    assert_eq!(seqs, [3, 4, 5]);
    let commit = run.take_commit();
    assert_eq!(commit.delta().events_below, Some(3));
    let _ = commit.persist_to(&store).unwrap();
    let stored = store.load_all().unwrap().pop().unwrap();
    assert_eq!(stored.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [3, 4, 5]);
    // One more pushes out one more, in the store too.
    run.record_event(EventReason::Applied, Subject::Run, "event 5".into(), T0);
    let _ = run.take_commit().persist_to(&store).unwrap();
    let stored = store.load_all().unwrap().pop().unwrap();
    assert_eq!(stored.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [4, 5, 6]);
    // A log stored under a larger limit is cut to a smaller one at restore.
    let smaller = Arc::new(Policy {
        event_limit: 2,
        ..(*policy).clone()
    });
    let mut restored = RunState::restore(stored, Epoch::new(2), smaller);
    assert_eq!(restored.events().map(|e| e.seq).collect::<Vec<_>>(), [5, 6]);
    assert_eq!(restored.take_commit().delta().events_below, Some(5));
}

/// A permanent failure and a remediation held by its budget are logged once,
/// when they begin, not at every pass that finds them so.
#[test]
fn a_permanent_failure_is_logged_once() {
    use contract::EventReason;
    let (mut run, store) = run_with_nodes();
    let id = node("ctrl-0");
    let r = result(
        &run,
        "ctrl-0",
        Outcome::Permanent {
            reason: "no such image".into(),
        },
    );
    assert_eq!(run.fold_result(&r, T0).unwrap(), Fold::Folded);
    for _ in 0..3 {
        let _ = pass(&mut run, &store, T0);
    }
    let permanent: Vec<_> = run
        .events()
        .filter(|e| e.reason == EventReason::NodeFailedPermanently)
        .collect();
    assert_eq!(permanent.len(), 1, "{permanent:?}");
    assert!(
        permanent[0].message.contains("no such image"),
        "{}",
        permanent[0].message
    );
    assert_eq!(
        permanent[0].subject,
        contract::Subject::Node {
            node: id.clone(),
            attempt: r.id.attempt()
        }
    );
}

// ---------------------------------------------------------------------------
// Rollouts (SPEC §9)
// ---------------------------------------------------------------------------

/// One group `workers` of `count` on `image`, under `rollout`.
fn rolling_shape(generation: u64, count: u32, image: &str, rollout: contract::RolloutPolicy) -> ClusterShape {
    let mut g = contract::NodeGroup::new(
        contract::GroupId::parse("id", "workers").unwrap(),
        count,
        Arc::new(contract::shape::example_template("fake", image)),
    );
    g.policy.rollout = rollout;
    ClusterShape {
        run_id: RunId::parse("run_id", "train").unwrap(),
        generation: Generation::new(generation),
        labels: Default::default(),
        groups: vec![g],
    }
}

/// A provider in the test: every operation succeeds at once and every
/// bootstrap converges, except that a start on an image named `bad` fails
/// (retryably: the attempt fails and restarts). Passes and answers until
/// nothing is pending and no pass is needed, at most `rounds` times.
fn drive(run: &mut RunState, store: &MemStore, now: UnixMillis, bad: Option<&str>, rounds: usize) {
    let mut session = 0u64;
    for _ in 0..rounds {
        if run.needs_pass(now) {
            let _ = pass(run, store, now);
        }
        // Every attempt with an operation pending, a slot's successor too.
        let pending: Vec<(LogicalNodeId, contract::AttemptId, contract::PendingOp, bool)> = run
            .nodes()
            .chain(run.successors())
            .filter_map(|n| {
                let p = n.pending?;
                Some((n.id.clone(), n.attempt, p, Some(n.spec.image.as_str()) == bad))
            })
            .collect();
        if pending.is_empty() && !run.needs_pass(now) {
            return;
        }
        for (id, attempt, p, fails) in pending {
            let name = id.to_string();
            let outcome = match p.effect {
                Effect::CreateLease | Effect::LookupEndpoint => Outcome::Succeeded(ResultFacts {
                    lease: Some(contract::LeaseId::new("l", &format!("lease-{name}-{attempt}")).unwrap()),
                    endpoint: Some(contract::Endpoint::new("e", "10.0.0.1:22").unwrap()),
                    session: None,
                }),
                Effect::StartBootstrap if fails => Outcome::Retryable {
                    reason: "the image does not boot".into(),
                },
                Effect::StartBootstrap => {
                    session += 1;
                    Outcome::Succeeded(ResultFacts {
                        session: Some(
                            contract::SessionId::new("s", &format!("sess-{name}-{session}")).unwrap(),
                        ),
                        ..ResultFacts::default()
                    })
                }
                Effect::CancelBootstrap | Effect::DestroyLease => Outcome::Succeeded(ResultFacts::default()),
            };
            let r = OperationResult {
                run_uid: UID,
                node: id.clone(),
                id: p.id,
                effect: p.effect,
                outcome,
                completed_at: now,
                late: false,
                replayed: false,
                trace: TraceContext::default(),
            };
            assert_eq!(run.fold_result(&r, now).unwrap(), Fold::Folded);
            if p.effect == Effect::StartBootstrap && !fails {
                let n = run
                    .node(&id)
                    .filter(|n| n.attempt == attempt)
                    .or_else(|| run.successor(&id))
                    .unwrap();
                let o = Observation {
                    run_uid: UID,
                    node: id.clone(),
                    attempt,
                    session: n.facts.session.clone().unwrap(),
                    seq: 1,
                    stage: contract::BootstrapStage::Converged,
                    detail: String::new(),
                    at: now,
                    trace: TraceContext::default(),
                };
                assert_eq!(run.fold_observation(&o, now).unwrap(), Fold::Folded);
            }
        }
        let _ = run.take_commit().persist_to(store).unwrap();
    }
}

/// A run of `count` workers on `img:1` under `rollout`, driven until nothing
/// is left to do.
fn settled(count: u32, rollout: contract::RolloutPolicy) -> (RunState, MemStore) {
    let store = MemStore::new();
    let mut run = RunState::create(
        rolling_shape(1, count, "img:1", rollout),
        UID,
        Epoch::new(1),
        policy(),
        T0,
    )
    .unwrap();
    drive(&mut run, &store, T0, None, 200);
    (run, store)
}

fn workers_id() -> contract::GroupId {
    contract::GroupId::parse("id", "workers").unwrap()
}

fn reasons(run: &RunState) -> Vec<&'static str> {
    run.events().map(|e| e.reason.name()).collect()
}

#[test]
fn a_rollout_is_tracked_from_start_to_completion_and_the_group_is_stable_after() {
    let budget = contract::RolloutPolicy {
        max_unavailable: contract::Budget::Count(2),
        max_surge: contract::Budget::Count(0),
        ..Default::default()
    };
    let (mut run, store) = settled(5, budget);
    assert!(run.is_converged());
    let workers = workers_id();
    assert!(run.rollout(&workers).is_none(), "a fresh group has no rollout");
    assert_eq!(run.meta().stable.len(), 1);
    assert_eq!(run.meta().stable[0].generation, Generation::new(1));

    assert_eq!(
        run.apply_shape(rolling_shape(2, 5, "img:2", budget)).unwrap(),
        Applied::Changed
    );
    // The first pass replaces two (the budget) and holds three under rule 17.
    let _ = pass(&mut run, &store, T0);
    let rules: Vec<_> = run.nodes().filter_map(|n| run.last_rule(&n.id)).collect();
    assert_eq!(
        rules
            .iter()
            .filter(|r| **r == contract::Rule::BeginDelete)
            .count(),
        2,
        "{rules:?}"
    );
    assert_eq!(
        rules
            .iter()
            .filter(|r| **r == contract::Rule::RolloutBudget)
            .count(),
        3,
        "{rules:?}"
    );
    let r = run.rollout(&workers).unwrap().clone();
    assert_eq!(r.generation, Generation::new(2));
    assert!(reasons(&run).contains(&"RolloutStarted"));
    // The rollout survives a restart from the store.
    let restored = RunState::restore(store.load_all().unwrap().remove(0), Epoch::new(2), policy());
    assert_eq!(restored.rollout(&workers), Some(&r));

    drive(&mut run, &store, T0, None, 400);
    assert!(run.is_converged(), "{:?}", run.nodes().collect::<Vec<_>>());
    assert!(run.rollout(&workers).is_none());
    assert!(reasons(&run).contains(&"RolloutCompleted"));
    assert_eq!(run.meta().stable[0].generation, Generation::new(2));
    assert_eq!(run.meta().stable[0].group.template.image, "img:2");
}

#[test]
fn a_failing_template_halts_its_rollout_and_reverts_once() {
    let budget = contract::RolloutPolicy {
        max_unavailable: contract::Budget::Count(1),
        max_surge: contract::Budget::Count(0),
        failure_threshold: 2,
        auto_revert: true,
        ..Default::default()
    };
    let (mut run, store) = settled(4, budget);
    assert!(run.is_converged());
    let workers = workers_id();

    run.apply_shape(rolling_shape(2, 4, "img:bad", budget)).unwrap();
    // The bad template fails; its restarts back off, so time moves on.
    let mut now = T0;
    for _ in 0..60 {
        drive(&mut run, &store, now, Some("img:bad"), 50);
        if run.shape().generation == Generation::new(3) {
            break;
        }
        now = run.poll_timeout().unwrap_or(now).max(now);
    }
    assert_eq!(run.shape().generation, Generation::new(3), "{:?}", reasons(&run));
    assert_eq!(
        run.shape().groups[0].template.image,
        "img:1",
        "reverted to the stable template"
    );
    let events = reasons(&run);
    for r in ["RolloutStarted", "RolloutHalted", "RolloutReverted"] {
        assert!(events.contains(&r), "no {r}: {events:?}");
    }
    // The revert is a rollout of its own, recorded as one (it may have
    // completed already: only one slot left the old template).
    match run.rollout(&workers) {
        Some(revert) => {
            assert_eq!(revert.reverted_from, Some(Generation::new(2)));
            assert!(revert.canary_done(), "a revert has no canary");
        }
        None => assert!(
            run.events()
                .any(|e| e.reason.name() == "RolloutCompleted"
                    && e.message.contains("reverted from generation 2")),
            "{events:?}"
        ),
    }
    // Only one slot ever left the old template (max_unavailable 1).
    let on_bad = run.nodes().filter(|n| n.spec.image == "img:bad").count();
    assert!(on_bad <= 1, "{on_bad} nodes on the bad template");

    drive(&mut run, &store, now, Some("img:bad"), 400);
    assert!(run.is_converged(), "the revert converges");
    assert!(run.rollout(&workers).is_none());
    assert!(run.nodes().all(|n| n.spec.image == "img:1"));
    assert_eq!(
        reasons(&run).iter().filter(|r| **r == "RolloutReverted").count(),
        1,
        "reverted once"
    );
}

#[test]
fn a_halted_rollout_holds_its_drifted_nodes_until_a_newer_apply() {
    let budget = contract::RolloutPolicy {
        max_unavailable: contract::Budget::Count(1),
        max_surge: contract::Budget::Count(0),
        failure_threshold: 1,
        ..Default::default()
    };
    let (mut run, store) = settled(3, budget);
    let workers = workers_id();
    run.apply_shape(rolling_shape(2, 3, "img:bad", budget)).unwrap();
    drive(&mut run, &store, T0, Some("img:bad"), 100);
    let r = run.rollout(&workers).unwrap();
    assert!(r.halted.is_some(), "{r:?}");
    assert!(r.halted.as_ref().unwrap().reason.contains("failure_threshold 1"));
    // No revert without auto_revert; the drifted nodes wait under rule 17.
    assert_eq!(run.shape().generation, Generation::new(2));
    let held = run
        .nodes()
        .filter(|n| run.last_rule(&n.id) == Some(contract::Rule::RolloutBudget))
        .count();
    assert_eq!(held, 2);
    // Held by the rollout, not by the remediation budget.
    assert_eq!(run.remediation_held().count(), 0);
    assert!(run.group_counts().iter().any(|(g, c)| *g == workers && c.halted));

    // A newer apply (a fixed template) ends the halt, and the run converges.
    run.apply_shape(rolling_shape(3, 3, "img:3", budget)).unwrap();
    assert!(run.rollout(&workers).is_none(), "the halted rollout is over");
    drive(&mut run, &store, T0, Some("img:bad"), 400);
    assert!(run.is_converged());
    assert!(run.nodes().all(|n| n.spec.image == "img:3"));
}

#[test]
fn a_rollout_without_progress_halts_at_its_deadline() {
    let budget = contract::RolloutPolicy {
        max_unavailable: contract::Budget::Count(1),
        max_surge: contract::Budget::Count(0),
        progress_deadline_ms: 60_000,
        ..Default::default()
    };
    let (mut run, store) = settled(2, budget);
    let workers = workers_id();
    run.apply_shape(rolling_shape(2, 2, "img:2", budget)).unwrap();
    // One pass: a node begins its replacement; nothing answers after that.
    let _ = pass(&mut run, &store, T0);
    let deadline = run
        .rollout(&workers)
        .unwrap()
        .deadline(&run.shape().groups[0])
        .unwrap();
    assert_eq!(deadline, T0.checked_add(Duration::from_secs(60)).unwrap());
    assert!(run.poll_timeout().is_some_and(|t| t <= deadline));
    let later = deadline.checked_add(Duration::from_millis(1)).unwrap();
    assert!(run.needs_pass(later));
    let _ = pass(&mut run, &store, later);
    let r = run.rollout(&workers).unwrap();
    assert!(
        r.halted
            .as_ref()
            .is_some_and(|h| h.reason.contains("progress deadline")),
        "{r:?}"
    );
}

/// Surge (SPEC §9): with no node to take down and one successor allowed, a
/// template change provisions each slot's successor while its current
/// attempt serves, hands the slot over once the successor serves, and never
/// holds more than one successor in the group, nor fewer than all slots
/// serving.
#[test]
fn a_surge_rollout_keeps_every_slot_serving() {
    let budget = contract::RolloutPolicy {
        max_unavailable: contract::Budget::Count(0),
        max_surge: contract::Budget::Count(1),
        ..Default::default()
    };
    let (mut run, store) = settled(3, budget);
    assert!(run.is_converged());
    let before: Vec<contract::AttemptId> = run.nodes().map(|n| n.attempt).collect();
    run.apply_shape(rolling_shape(2, 3, "img:2", budget)).unwrap();
    let serving = |run: &RunState| {
        run.nodes()
            .chain(run.successors())
            .filter(|n| n.intent == contract::Intent::Active && n.stage.is_ready())
            .map(|n| n.id.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    };
    let mut surged = 0;
    let mut restored_once = false;
    for _ in 0..200 {
        drive(&mut run, &store, T0, None, 1);
        assert_eq!(
            serving(&run),
            3,
            "a slot stopped serving: {:?}",
            run.nodes().collect::<Vec<_>>()
        );
        let successors = run.successors().count();
        assert!(successors <= 1, "{successors} successors at once");
        surged += successors;
        // A slot holding two attempts round-trips the store.
        if successors == 1 && !restored_once && !run.uncommitted() {
            restored_once = true;
            let restored = RunState::restore(store.load_all().unwrap().remove(0), Epoch::new(2), policy());
            assert_eq!(
                restored.successors().collect::<Vec<_>>(),
                run.successors().collect::<Vec<_>>()
            );
            assert!(restored.indexes_consistent());
        }
        if run.is_converged() {
            break;
        }
    }
    assert!(run.is_converged(), "{:?}", run.nodes().collect::<Vec<_>>());
    assert!(surged > 0, "no successor was ever provisioned");
    assert!(restored_once, "the store never held a successor between passes");
    assert!(run.nodes().all(|n| n.spec.image == "img:2"));
    // Each slot's new attempt is the successor the rollout provisioned.
    assert!(run.nodes().all(|n| !before.contains(&n.attempt)));
    assert!(reasons(&run).contains(&"RolloutCompleted"));
}
