//! The three cores in memory on a virtual clock: convergence, scaling,
//! replacement, deletion, and convergence after every fault class.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use contract::{
    BootstrapStage, Effect, Intent, LogicalNodeId, NodeStage, Observation, OperationInput, Outcome,
};
use executor_svc::fake::{FakeConfig, FaultRates};
use provisioning_tests::{
    shapes::{shape, with_template},
    sim::{Delivery, Event, Sim, Tamper, ToDriver},
};

const MAX_STEPS: u64 = 20_000;

fn three_groups(generation: u64) -> contract::ClusterShape {
    shape(
        "train",
        generation,
        "fake",
        &[
            ("ctrl", 3, "img:1"),
            ("workers", 12, "img:1"),
            ("gpu", 6, "img:1"),
        ],
    )
}

fn ready_slots(sim: &Sim) -> Vec<String> {
    sim.run
        .nodes()
        .filter(|n| n.is_ready())
        .map(|n| n.id.to_string())
        .collect()
}

/// Checks that hold over every trace: each operation was recorded pending in
/// the committed store before the executor saw it, and no slot ever had more
/// than two attempts' resources at once (its current one and, under a
/// rollout's surge, one successor; SPEC.md section 9).
fn check_trace(sim: &Sim) {
    for e in &sim.events {
        if let Event::Submitted { op, recorded } = e {
            assert!(
                recorded,
                "operation {} reached the executor before it was recorded",
                op.id
            );
        }
    }
    assert!(
        sim.slots_over(2).is_empty(),
        "more than two live attempts in one slot"
    );
}

#[test]
fn a_shape_of_several_groups_converges() {
    let mut sim = Sim::new(three_groups(1), FakeConfig::default(), Delivery::InOrder, 1).unwrap();
    sim.run_until_converged(MAX_STEPS).unwrap();
    assert_eq!(ready_slots(&sim).len(), 21);
    assert_eq!(sim.fake.inventory().len(), 21);
    check_trace(&sim);
    // A pass over a converged run is a no-op.
    sim.run.mark_all_dirty();
    let before: Vec<_> = sim.run.nodes().cloned().collect();
    let ops_before = sim.run.counters().operations;
    sim.pass().unwrap();
    let after: Vec<_> = sim.run.nodes().cloned().collect();
    assert_eq!(before, after);
    assert_eq!(sim.run.counters().operations, ops_before);
}

#[test]
fn scale_up_and_down_touches_only_the_highest_slots() {
    let mut sim = Sim::new(three_groups(1), FakeConfig::default(), Delivery::InOrder, 2).unwrap();
    sim.run_until_converged(MAX_STEPS).unwrap();
    let attempts: BTreeMap<LogicalNodeId, _> = sim.run.nodes().map(|n| (n.id.clone(), n.attempt)).collect();

    // Scale workers 12 -> 16.
    let up = shape(
        "train",
        2,
        "fake",
        &[
            ("ctrl", 3, "img:1"),
            ("workers", 16, "img:1"),
            ("gpu", 6, "img:1"),
        ],
    );
    sim.run.apply_shape(up).unwrap();
    sim.run_until_converged(MAX_STEPS).unwrap();
    assert_eq!(ready_slots(&sim).len(), 25);
    for (id, a) in &attempts {
        assert_eq!(
            sim.run.node(id).unwrap().attempt,
            *a,
            "{id} was replaced by a scale-up"
        );
    }

    // Scale workers 16 -> 5: only workers-5..15 go.
    let down = shape(
        "train",
        3,
        "fake",
        &[("ctrl", 3, "img:1"), ("workers", 5, "img:1"), ("gpu", 6, "img:1")],
    );
    sim.run.apply_shape(down).unwrap();
    let mut deleting_seen = std::collections::BTreeSet::new();
    for _ in 0..MAX_STEPS {
        for n in sim.run.nodes() {
            if n.intent == Intent::Deleting {
                deleting_seen.insert(n.id.clone());
            }
        }
        if sim.run.is_converged() {
            break;
        }
        sim.step().unwrap();
    }
    assert!(sim.run.is_converged());
    let expected: std::collections::BTreeSet<_> = (5..16)
        .map(|i| LogicalNodeId::parse("n", &format!("workers-{i}")).unwrap())
        .collect();
    assert_eq!(
        deleting_seen, expected,
        "scale-down must remove exactly the highest-index slots"
    );
    assert_eq!(ready_slots(&sim).len(), 14);
    for (id, a) in &attempts {
        if let Some(n) = sim.run.node(id) {
            assert_eq!(n.attempt, *a, "{id} was replaced by a scale-down");
        }
    }
    assert_eq!(sim.fake.inventory().len(), 14);
    check_trace(&sim);
}

#[test]
fn an_image_change_replaces_every_node_of_the_group_with_ordered_cleanup() {
    let mut sim = Sim::new(three_groups(1), FakeConfig::default(), Delivery::InOrder, 3).unwrap();
    sim.run_until_converged(MAX_STEPS).unwrap();
    let old: BTreeMap<LogicalNodeId, _> = sim.run.nodes().map(|n| (n.id.clone(), n.attempt)).collect();
    let events_before = sim.events.len();

    // No surge: each slot's old attempt goes before its new one starts.
    let mut changed = with_template(three_groups(2), "gpu", |t| t.image = "img:2".to_owned());
    for g in &mut changed.groups {
        g.policy.rollout.max_surge = contract::Budget::Count(0);
    }
    sim.run.apply_shape(changed).unwrap();
    sim.run_until_converged(MAX_STEPS).unwrap();

    for n in sim.run.nodes() {
        let was = old[&n.id];
        if n.id.group().as_str() == "gpu" {
            assert!(n.attempt > was, "{} kept its old attempt", n.id);
            assert_eq!(n.spec.image, "img:2");
        } else {
            assert_eq!(
                n.attempt, was,
                "{} was replaced though its group did not change",
                n.id
            );
        }
    }
    // For each replaced slot: the old attempt's cancel (if any) and destroy came
    // before the new attempt's create.
    for (id, was) in old.iter().filter(|(id, _)| id.group().as_str() == "gpu") {
        let mut destroy_at = None;
        let mut create_new_at = None;
        for (i, e) in sim.events[events_before..].iter().enumerate() {
            if let Event::Started(op) = e
                && &op.node == id
            {
                match (&op.input, op.id.attempt() == *was) {
                    (OperationInput::DestroyLease { .. }, true) => destroy_at = Some(i),
                    (OperationInput::CreateLease { .. }, false) if create_new_at.is_none() => {
                        create_new_at = Some(i)
                    }
                    _ => {}
                }
            }
        }
        let (d, c) = (destroy_at.unwrap(), create_new_at.unwrap());
        assert!(
            d < c,
            "{id}: new attempt created before the old one was destroyed"
        );
    }
    assert_eq!(sim.fake.inventory().len(), 21);
    check_trace(&sim);
}

#[test]
fn deleting_the_run_ends_with_an_empty_inventory() {
    let mut sim = Sim::new(three_groups(1), FakeConfig::default(), Delivery::InOrder, 4).unwrap();
    sim.run_until_converged(MAX_STEPS).unwrap();
    assert!(sim.run.delete());
    sim.run_until_gone(MAX_STEPS).unwrap();
    assert!(
        sim.fake.inventory().is_empty(),
        "leaked: {:?}",
        sim.fake.inventory()
    );
    assert_eq!(sim.run.node_count(), 0);
    check_trace(&sim);
}

fn chaos_then_calm(seed: u64, delivery: Delivery) {
    let cfg = FakeConfig {
        seed,
        faults: FaultRates::chaos(),
        ..FakeConfig::default()
    };
    let mut sim = Sim::new(three_groups(1), cfg, delivery, seed).unwrap();
    // A faulty prefix, with a scale change and an image change in the middle.
    for i in 0..3000 {
        sim.step().unwrap();
        if i == 800 {
            let s = shape(
                "train",
                2,
                "fake",
                &[("ctrl", 3, "img:1"), ("workers", 9, "img:1"), ("gpu", 8, "img:1")],
            );
            sim.run.apply_shape(s).unwrap();
        }
        if i == 1600 {
            let s = with_template(
                shape(
                    "train",
                    3,
                    "fake",
                    &[("ctrl", 3, "img:1"), ("workers", 9, "img:1"), ("gpu", 8, "img:1")],
                ),
                "workers",
                |t| t.image = "img:2".to_owned(),
            );
            sim.run.apply_shape(s).unwrap();
        }
        assert!(
            sim.slots_over(2).is_empty(),
            "seed {seed}: more than two attempts in one slot"
        );
    }
    // Faults stop; the run must converge to the latest shape.
    sim.fake.set_faults(FaultRates::none());
    sim.run_until_converged(MAX_STEPS)
        .unwrap_or_else(|e| panic!("seed {seed} {delivery:?}: {e}"));
    assert_eq!(ready_slots(&sim).len(), 20);
    for n in sim.run.nodes() {
        if n.id.group().as_str() == "workers" {
            assert_eq!(n.spec.image, "img:2");
        }
    }
    // Converged leaks nothing: exactly one resource per desired slot.
    assert_eq!(
        sim.fake.inventory().len(),
        20,
        "seed {seed}: {:?}",
        sim.fake.inventory()
    );
    check_trace(&sim);

    // Every fault class really happened in the prefix.
    let mut classes = std::collections::BTreeSet::new();
    for e in &sim.events {
        if let Event::Completed { outcome, .. } = e {
            classes.insert(outcome.class_name());
        }
    }
    for c in ["succeeded", "failed-retryable", "ambiguous"] {
        assert!(
            classes.contains(c),
            "seed {seed}: no {c} outcome in the faulty prefix: {classes:?}"
        );
    }

    // And deletion still cleans up everything.
    sim.run.delete();
    sim.run_until_gone(MAX_STEPS).unwrap();
    assert!(sim.fake.inventory().is_empty());
}

#[test]
fn converges_after_every_fault_class_in_order() {
    for seed in 1..=6 {
        chaos_then_calm(seed, Delivery::InOrder);
    }
}

#[test]
fn converges_after_every_fault_class_with_chaotic_delivery() {
    for seed in 11..=16 {
        chaos_then_calm(seed, Delivery::Chaotic);
    }
}

#[test]
fn a_broken_link_loses_nothing() {
    let mut sim = Sim::new(three_groups(1), FakeConfig::default(), Delivery::InOrder, 7).unwrap();
    for _ in 0..15 {
        sim.step().unwrap();
    }
    sim.cut_link();
    for _ in 0..200 {
        sim.step().unwrap();
    }
    sim.reconnect().unwrap();
    sim.run_until_converged(MAX_STEPS).unwrap();
    assert_eq!(ready_slots(&sim).len(), 21);
    assert_eq!(sim.fake.inventory().len(), 21);
}

#[test]
fn a_permanent_failure_holds_until_the_spec_changes() {
    let bad = with_template(shape("perm", 1, "fake", &[("w", 2, "img:1")]), "w", |t| {
        t.image = "invalid:image".to_owned()
    });
    let mut sim = Sim::new(bad, FakeConfig::default(), Delivery::InOrder, 8).unwrap();
    for _ in 0..500 {
        sim.step().unwrap();
    }
    let creates = sim
        .events
        .iter()
        .filter(|e| matches!(e, Event::Started(op) if op.input.effect() == Effect::CreateLease))
        .count();
    assert_eq!(
        creates, 2,
        "a permanent failure must not be retried with the same spec"
    );
    for n in sim.run.nodes() {
        assert_eq!(n.stage, NodeStage::Destroyed);
        assert!(n.retry.permanent.is_some());
    }
    let fixed = shape("perm", 2, "fake", &[("w", 2, "img:1")]);
    sim.run.apply_shape(fixed).unwrap();
    sim.run_until_converged(MAX_STEPS).unwrap();
    assert!(sim.events.iter().any(|e| matches!(
        e,
        Event::Completed {
            outcome: Outcome::Permanent { .. },
            ..
        }
    )));
}

/// Loses the first `Converged` stage on its way to the driver: what
/// arrives in its place is the session's first stage again, which the
/// driver discards as a duplicate (and acknowledges only up to it).
#[derive(Debug, Default)]
struct LoseTheLastStage {
    lost: bool,
}

impl Tamper for LoseTheLastStage {
    fn fold(&mut self, _sim: &Sim, msg: &ToDriver) -> Option<ToDriver> {
        match msg {
            ToDriver::Observation(o) if o.stage == BootstrapStage::Converged && !self.lost => {
                self.lost = true;
                Some(ToDriver::Observation(Observation {
                    seq: 1,
                    stage: BootstrapStage::Connected,
                    ..o.clone()
                }))
            }
            _ => None,
        }
    }
}

/// A bootstrap's last stage lost between the executor and the driver: the
/// node waits at its stage (nothing else would bring the stage again before
/// the attempt's bootstrap deadline), and the second safety tick without
/// progress asks the executor for the session again, which sends the stage
/// it still holds unacknowledged: the attempt converges as it is.
#[test]
fn a_bootstrap_stage_lost_on_the_way_comes_again_on_the_safety_tick() {
    let one = shape("train", 1, "fake", &[("workers", 1, "img:1")]);
    let mut sim = Sim::new(one, FakeConfig::default(), Delivery::InOrder, 11).unwrap();
    sim.tamper = Some(Box::new(LoseTheLastStage::default()));
    let node = LogicalNodeId::parse("node", "workers-0").unwrap();
    // Everything but the lost stage arrives; the node waits at its stage.
    for _ in 0..MAX_STEPS {
        let settled =
            sim.quiescent() && sim.fake.next_observation_at().is_none() && !sim.run.needs_pass(sim.now);
        if settled || sim.run.is_converged() {
            break;
        }
        sim.step().unwrap();
    }
    assert!(!sim.run.is_converged(), "the stage was not lost");
    let waiting = sim.run.node(&node).unwrap().clone();
    assert!(
        waiting
            .facts
            .bootstrap
            .as_ref()
            .is_some_and(|b| !b.stage.is_terminal()),
        "{waiting:?}"
    );
    let deadline = waiting.stage_deadline.expect("a bootstrap deadline");
    // The first tick notes where each session is; the second finds it
    // where it was.
    assert_eq!(sim.safety_tick().unwrap(), 0);
    assert_eq!(sim.safety_tick().unwrap(), 1);
    sim.run_until_converged(MAX_STEPS).unwrap();
    assert!(sim.now < deadline, "converged only after the bootstrap deadline");
    assert_eq!(sim.run.node(&node).unwrap().attempt, waiting.attempt);
    // A converged run has no session left to ask for.
    assert_eq!(sim.safety_tick().unwrap(), 0);
    assert_eq!(sim.safety_tick().unwrap(), 0);
    check_trace(&sim);
}

/// SPEC §8: a ready node whose resource is lost fails its attempt; the slot
/// is cleaned up and replaced on a fresh attempt, and only that slot.
#[test]
fn a_lost_resource_is_replaced_on_a_fresh_attempt() {
    let mut sim = Sim::new(three_groups(1), FakeConfig::default(), Delivery::InOrder, 7).unwrap();
    sim.run_until_converged(MAX_STEPS).unwrap();
    let before: BTreeMap<LogicalNodeId, _> = sim.run.nodes().map(|n| (n.id.clone(), n.attempt)).collect();
    let lost = LogicalNodeId::parse("node", "workers-2").unwrap();
    assert!(sim.lose(&lost));
    // The loss is folded when it is delivered; the run is no longer
    // converged before anything else happens.
    sim.deliver().unwrap();
    assert!(!sim.run.is_converged());
    let n = sim.run.node(&lost).unwrap();
    assert_eq!(n.stage, NodeStage::Failed);
    assert!(
        n.facts
            .failure
            .as_ref()
            .is_some_and(|f| f.reason.starts_with("resource lost:")),
        "{n:?}"
    );
    sim.run_until_converged(MAX_STEPS).unwrap();
    for n in sim.run.nodes() {
        if n.id == lost {
            assert!(n.attempt > before[&n.id], "the lost slot kept its attempt");
        } else {
            assert_eq!(n.attempt, before[&n.id], "{} was replaced too", n.id);
        }
    }
    assert_eq!(ready_slots(&sim).len(), 21);
    assert_eq!(sim.fake.inventory().len(), 21);
    assert_eq!(sim.run.counters().lost, 1);
    check_trace(&sim);
}
