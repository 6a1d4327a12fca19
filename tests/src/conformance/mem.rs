//! Level 1: the three cores in memory with the fake backend (the simulation of
//! [`crate::sim`]) as a [`SystemUnderTest`].

use std::{
    panic::{AssertUnwindSafe, catch_unwind},
    sync::Arc,
    time::Duration,
};

use contract::{
    ClusterShape, Generation, GroupId, LogicalNodeId, NodeGroup, NodeTemplate, UnixMillis,
    shape::example_template,
};
use driver_svc::core::{Applied, ApplyError, CoreError, MemStore, RunState, RunStore};
use executor_svc::fake::FaultRates;

use super::panic_message;
use super::{
    input::Input,
    mutants::{Mutant, ViewTamper},
    record::{
        ApplyKind, ApplyRecord, Phase, Probe, Resource, RunSnapshot, StepRecord, StepRef, StoreRow, Verdict,
    },
    runner::SystemUnderTest,
    world::{World, bad_shape, changed_shape, has_bad_image, repaired_shape, with_surge},
};
use crate::sim::Sim;

/// The in-memory system: the simulation, recording everything.
#[derive(Debug)]
pub struct MemSut {
    pub sim: Sim,
    round: u64,
    mutant: Option<Mutant>,
    view: Option<ViewTamper>,
}

impl MemSut {
    /// The system of `world`, with the cores applying independent work in reverse
    /// order when `permute` is set, and `mutant` installed.
    pub fn new(world: &World, permute: bool, mutant: Option<Mutant>) -> anyhow::Result<Self> {
        let mut sim = Sim::with_policy(
            world.initial.clone(),
            world.fake,
            world.delivery,
            world.seed,
            world.policy.clone(),
        )?;
        sim.record = true;
        sim.permute = permute;
        let mut sut = Self {
            sim,
            round: 0,
            mutant,
            view: mutant.and_then(Mutant::view),
        };
        if let Some(m) = mutant {
            m.install(&mut sut.sim);
        }
        Ok(sut)
    }

    fn snapshot(&self) -> RunSnapshot {
        let run = &self.sim.run;
        let meta = run.meta();
        let nodes = self.sim.nodes();
        let desired = run.desired_view();
        let spec_current = nodes
            .iter()
            .map(|(id, n)| {
                let current = desired
                    .template_for(id)
                    .is_some_and(|t| NodeTemplate::same(t, &n.spec));
                (id.clone(), current)
            })
            .collect();
        let store = self
            .sim
            .store
            .load_all()
            .ok()
            .and_then(|runs| runs.into_iter().find(|r| r.meta.uid == run.uid()))
            .map(|r| {
                r.nodes
                    .into_iter()
                    .map(|rec| {
                        let row = StoreRow {
                            pending: rec.node.pending,
                            inflight: rec.inflight.map(|op| op.id),
                        };
                        (rec.node.id, row)
                    })
                    .collect()
            })
            .unwrap_or_default();
        RunSnapshot {
            uid: run.uid(),
            gone: run.is_gone(),
            deleting: meta.deleting,
            generation: meta.shape.generation,
            observed_generation: meta.observed_generation,
            shape: Some(meta.shape.clone()),
            converged: run.is_converged(),
            next_attempt: Some(meta.next_attempt),
            nodes,
            successors: self.sim.successors(),
            spec_current,
            store: Some(store),
            passes: self.sim.passes,
        }
    }

    fn inventory(&self) -> Vec<Resource> {
        let uid = self.sim.run.uid();
        self.sim
            .fake
            .inventory()
            .into_iter()
            .filter(|r| r.identity.run_uid == uid)
            .map(|r| Resource {
                node: r.identity.node,
                attempt: r.identity.attempt,
                lease: r.lease.to_string(),
                session_live: r.session_live,
            })
            .collect()
    }

    fn record(
        &mut self,
        phase: Phase,
        index: Option<usize>,
        input: Option<Input>,
        apply: Option<ApplyRecord>,
        probes: Vec<Probe>,
    ) -> StepRecord {
        let mut rec = StepRecord {
            at: StepRef {
                phase,
                input: index,
                round: self.round,
            },
            input,
            now: self.sim.now,
            events: std::mem::take(&mut self.sim.events),
            apply,
            state: self.snapshot(),
            inventory: Some(self.inventory()),
            processes: Vec::new(),
            quiescent: self.sim.quiescent(),
            probes,
            events_after_state: false,
        };
        if let Some(v) = &mut self.view {
            v.tamper(&mut rec);
        }
        rec
    }

    fn apply_shape(&mut self, kind: ApplyKind, shape: ClusterShape) -> anyhow::Result<ApplyRecord> {
        let before = self.snapshot();
        let verdict = if self.sim.run.is_gone() {
            Verdict::Skipped
        } else {
            let mut r = self.sim.apply_shape(shape.clone())?;
            if let (Some(Mutant::LenientRevision), Err(ApplyError::SameGenerationOtherContent(g))) =
                (self.mutant, &r)
            {
                // The mutant's driver takes other content at the same
                // generation as a bump instead of rejecting it.
                let mut bumped = shape.clone();
                bumped.generation = Generation::new(g.get() + 1);
                r = self.sim.apply_shape(bumped)?;
            }
            match r {
                Ok(Applied::Changed) => Verdict::Changed,
                Ok(Applied::Unchanged) => Verdict::Unchanged,
                Err(e) => Verdict::Rejected(e.to_string()),
            }
        };
        Ok(ApplyRecord {
            kind,
            submitted: shape,
            verdict,
            before,
            exact: true,
        })
    }

    /// Groups whose nodes are blocked by a permanent failure of their current
    /// spec.
    fn blocked_groups(&self) -> Vec<GroupId> {
        let desired = self.sim.run.desired_view();
        let mut out: Vec<GroupId> = self
            .sim
            .run
            .nodes()
            .filter(|n| {
                n.retry.permanent.as_ref().is_some_and(|p| {
                    desired
                        .template_for(&n.id)
                        .is_some_and(|t| NodeTemplate::same(&p.spec, t))
                })
            })
            .map(|n| n.id.group().clone())
            .collect();
        out.dedup();
        out
    }

    /// A pass of a copy of the driver's state under an extreme condition. The
    /// pass must return an error that `expected` accepts, or (unless `must_fail`)
    /// succeed because nothing in it reached the limit.
    fn limits_probe(
        what: &'static str,
        mut run: RunState,
        store: MemStore,
        now: UnixMillis,
        expected: fn(&CoreError) -> bool,
        must_fail: bool,
    ) -> Probe {
        let before: Vec<_> = run.nodes().cloned().collect();
        let result = catch_unwind(AssertUnwindSafe(|| {
            run.mark_all_dirty();
            let plan = match run.begin_pass(now) {
                Ok(plan) => plan,
                // Deadline folds compute every deadline before they change
                // anything, so a failure there must leave the nodes as they were.
                Err(e) => return (Some(e), true),
            };
            let output = {
                let view = run.desired_view();
                let slots = run.slot_set();
                decider::decide(&view, run.plan_nodes(&plan), slots, now)
            };
            match run.apply_decisions(plan, output, now) {
                Ok(mut outcome) => match outcome.take_commit().persist_to(&store) {
                    Ok(_) => (None, false),
                    Err(e) => panic!("the in-memory store refused a commit: {e}"),
                },
                Err(e) => (Some(e), false),
            }
        }));
        match result {
            Err(p) => Probe::Limits {
                what,
                panicked: Some(panic_message(p.as_ref())),
                error: None,
                expected_error: false,
                unchanged: true,
            },
            Ok((error, must_be_unchanged)) => {
                let after: Vec<_> = run.nodes().cloned().collect();
                Probe::Limits {
                    what,
                    panicked: None,
                    expected_error: error.as_ref().map_or(!must_fail, expected),
                    error: error.map(|e| e.to_string()),
                    unchanged: !must_be_unchanged || before == after,
                }
            }
        }
    }

    /// Guarantee 20's limit probes, on copies: a pass at a saturated clock, and a
    /// pass that needs an attempt id with the allocator exhausted.
    fn limit_probes(&self) -> Vec<Probe> {
        let mut probes = vec![Self::limits_probe(
            "a pass at a saturated clock",
            self.sim.run.clone(),
            self.sim.store.clone(),
            UnixMillis::new(u64::MAX - 1),
            |e| matches!(e, CoreError::Clock(_)),
            false,
        )];
        let run = &self.sim.run;
        if run.is_deleting() {
            return probes;
        }
        let stored = self
            .sim
            .store
            .load_all()
            .ok()
            .and_then(|runs| runs.into_iter().find(|r| r.meta.uid == run.uid()));
        if let Some(mut stored) = stored {
            stored.meta.next_attempt = u64::MAX;
            let mut copy = RunState::restore(stored, run.epoch(), Arc::clone(self.sim.policy()));
            let mut shape = run.shape().clone();
            shape.generation = Generation::new(shape.generation.get() + 1);
            shape.groups.push(NodeGroup {
                id: GroupId::parse("id", "spare").unwrap_or_else(|e| unreachable!("{e}")),
                count: 1,
                template: Arc::new(example_template("fake", "img:1")),
                policy: Default::default(),
            });
            if copy.apply_shape(shape).is_ok() {
                probes.push(Self::limits_probe(
                    "a pass with the attempt allocator exhausted",
                    copy,
                    self.sim.store.clone(),
                    self.sim.now,
                    |e| matches!(e, CoreError::AttemptsExhausted),
                    true,
                ));
            }
        }
        probes
    }
}

impl SystemUnderTest for MemSut {
    fn initial(&mut self) -> anyhow::Result<StepRecord> {
        Ok(self.record(Phase::Prefix, None, None, None, Vec::new()))
    }

    fn input(&mut self, index: usize, input: &Input) -> anyhow::Result<Vec<StepRecord>> {
        let phase = Phase::Prefix;
        let one = |sut: &mut Self, apply: Option<ApplyRecord>| {
            vec![sut.record(phase, Some(index), Some(input.clone()), apply, Vec::new())]
        };
        let sim = &mut self.sim;
        let records = match input {
            Input::Step(n) => {
                let mut out = Vec::with_capacity(usize::from(*n));
                for _ in 0..*n {
                    self.sim.step()?;
                    self.round += 1;
                    out.push(self.record(phase, Some(index), Some(input.clone()), None, Vec::new()));
                }
                out
            }
            Input::Tick => {
                sim.run.mark_all_dirty();
                one(self, None)
            }
            Input::Advance(ms) => {
                sim.advance(*ms);
                one(self, None)
            }
            Input::Apply(c) => {
                let current = self.sim.run.shape();
                let shape = with_surge(current, changed_shape(current, *c));
                let a = self.apply_shape(ApplyKind::Valid, shape)?;
                one(self, Some(a))
            }
            Input::Reject(b) => {
                let shape = bad_shape(self.sim.run.shape(), *b);
                let a = self.apply_shape(ApplyKind::Invalid, shape)?;
                one(self, Some(a))
            }
            Input::Reapply => {
                let shape = self.sim.run.shape().clone();
                let a = self.apply_shape(ApplyKind::Same, shape)?;
                one(self, Some(a))
            }
            Input::Faults(m) => {
                sim.fake.set_faults(m.rates());
                one(self, None)
            }
            Input::Inject {
                slot,
                effect,
                outcome,
            } => {
                let ids: Vec<LogicalNodeId> = sim.run.nodes().map(|n| n.id.clone()).collect();
                if !ids.is_empty() {
                    let id = ids[usize::from(*slot) % ids.len()].clone();
                    sim.inject(id, *effect, *outcome);
                }
                one(self, None)
            }
            Input::Lose(slot) => {
                let ids: Vec<LogicalNodeId> = sim.run.nodes().map(|n| n.id.clone()).collect();
                if !ids.is_empty() {
                    let id = ids[usize::from(*slot) % ids.len()].clone();
                    sim.lose(&id);
                }
                one(self, None)
            }
            Input::Sicken(slot) | Input::Heal(slot) => {
                let ids: Vec<LogicalNodeId> = sim.run.nodes().map(|n| n.id.clone()).collect();
                if !ids.is_empty() {
                    let id = ids[usize::from(*slot) % ids.len()].clone();
                    sim.report_health(&id, matches!(input, Input::Heal(_)));
                }
                one(self, None)
            }
            Input::LinkDown => {
                sim.cut_link();
                one(self, None)
            }
            Input::Reconnect => {
                if sim.link_down() {
                    sim.reconnect()?;
                }
                one(self, None)
            }
            Input::Replay => {
                if !sim.link_down() {
                    sim.replay_unacked();
                }
                one(self, None)
            }
            Input::Resend(k) => {
                if !sim.link_down() {
                    sim.resend(usize::from(*k));
                }
                one(self, None)
            }
            Input::Resubmit => {
                sim.resubmit_inflight()?;
                one(self, None)
            }
            Input::Conflict(k) => {
                sim.conflict_probe(usize::from(*k));
                one(self, None)
            }
            Input::RestartDriver => {
                sim.restart_driver()?;
                one(self, None)
            }
            Input::Delete => {
                sim.delete_run()?;
                one(self, None)
            }
        };
        Ok(records)
    }

    fn calm(&mut self) -> anyhow::Result<StepRecord> {
        self.sim.fake.set_faults(FaultRates::none());
        self.sim.clear_injections();
        if self.sim.link_down() {
            self.sim.reconnect()?;
        }
        let probes = self.limit_probes();
        Ok(self.record(Phase::Tail, None, None, None, probes))
    }

    fn repair(&mut self) -> anyhow::Result<Option<StepRecord>> {
        let run = &self.sim.run;
        if run.is_deleting() {
            return Ok(None);
        }
        let blocked = self.blocked_groups();
        // A halted rollout waits for the client's next apply, which the
        // repair is.
        let halted = run.meta().rollouts.iter().any(|r| r.halted.is_some());
        if blocked.is_empty() && !has_bad_image(run.shape()) && !halted {
            return Ok(None);
        }
        let shape = repaired_shape(run.shape(), &blocked);
        let a = self.apply_shape(ApplyKind::Valid, shape)?;
        Ok(Some(self.record(Phase::Tail, None, None, Some(a), Vec::new())))
    }

    fn round(&mut self, phase: Phase) -> anyhow::Result<StepRecord> {
        self.sim.step()?;
        self.round += 1;
        Ok(self.record(phase, None, None, None, Vec::new()))
    }

    fn tick(&mut self, phase: Phase) -> anyhow::Result<StepRecord> {
        self.sim.run.mark_all_dirty();
        self.sim.step()?;
        self.round += 1;
        Ok(self.record(phase, None, Some(Input::Tick), None, Vec::new()))
    }

    fn delete(&mut self) -> anyhow::Result<StepRecord> {
        self.sim.delete_run()?;
        Ok(self.record(Phase::Teardown, None, None, None, Vec::new()))
    }

    fn endpoint_probes(&self, world: &World) -> u64 {
        world.endpoint_probes()
    }

    fn extra_passes(&self, _elapsed: Duration) -> u64 {
        0
    }
}
