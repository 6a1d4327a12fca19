//! What a seed fixes besides the trace (the initial shape, the fake backend's
//! configuration, the driver's policy, the delivery mode), how shape inputs turn
//! into shapes, and the seeded generator of traces.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use contract::{
    Accelerator, BackoffPolicy, ClusterShape, Effect, Generation, GroupId, NodeGroup, NodeTemplate, Param,
    ProviderShape, RunId, ShapeLimits,
};
use driver_svc::core::Policy;
use executor_svc::fake::FakeConfig;

use super::input::{Bad, Change, FaultMix, Forced, Group, Input};
use crate::sim::{Delivery, Rng};

/// The run every trace drives.
pub const RUN_ID: &str = "conf";

/// Nodes per group and in total that shape changes stay within, so that runs
/// stay small and fast.
pub const MAX_PER_GROUP: u32 = 5;
pub const MAX_TOTAL: u32 = 10;

/// The configured per-group limit; `Bad::OverLimit` exceeds it.
pub const LIMIT_PER_GROUP: u32 = 16;

/// Everything a seed fixes besides the trace.
#[derive(Debug, Clone)]
pub struct World {
    pub seed: u64,
    pub delivery: Delivery,
    pub initial: ClusterShape,
    pub fake: FakeConfig,
    pub policy: Policy,
}

fn template(group: Group, image: &str) -> NodeTemplate {
    let (role, machine, cpu, memory, accelerators) = match group {
        Group::Ctrl => ("ctrl", "standard-2", 2.0, 8.0, Vec::new()),
        Group::Work => ("worker", "standard-4", 4.0, 16.0, Vec::new()),
        Group::Gpu => (
            "gpu",
            "accel-8",
            8.0,
            64.0,
            vec![Accelerator {
                kind: "a100".to_owned(),
                count: 1,
            }],
        ),
    };
    NodeTemplate {
        role: role.to_owned(),
        provider: ProviderShape {
            name: "fake".to_owned(),
            machine_type: machine.to_owned(),
            cpu,
            memory_gib: memory,
            accelerators,
            zone: "local-a".to_owned(),
            labels: BTreeMap::new(),
        },
        image: image.to_owned(),
        boot: BTreeMap::new(),
        join: BTreeMap::new(),
    }
}

/// The policy of every group the battery makes: nodes are probed (a TCP
/// probe: for the fake, its own say; for the process backend, a ping) every
/// 200 ms, and a node unhealthy for two seconds is replaced, one per group at
/// a time. (`max_unhealthy` stays at 100%: a group held by it converges only
/// once its nodes heal, which a trace need not do, and fair convergence would
/// not hold.) In memory there is no prober: the simulation reports health as
/// one would. Template changes roll out within the default budget.
pub fn group_policy() -> contract::GroupPolicy {
    contract::GroupPolicy {
        health: contract::HealthPolicy {
            probe: contract::Probe::Tcp,
            interval_ms: 200,
            timeout_ms: 200,
            unhealthy_after_ms: 2_000,
            ..Default::default()
        },
        remediation: contract::RemediationPolicy {
            max_in_flight: 1,
            max_unhealthy: contract::Budget::Percent(100),
        },
        // A progress deadline as long as any: the battery's faults can hold
        // a rollout up for longer than the default ten minutes of simulated
        // time, and a halted rollout waits for a newer apply, which fair
        // convergence does not make.
        rollout: contract::RolloutPolicy {
            progress_deadline_ms: contract::rollout::MAX_PROGRESS_DEADLINE_MS,
            // No surge but where a template change picks one
            // ([`with_surge`]).
            max_surge: contract::Budget::Count(0),
            ..Default::default()
        },
    }
}

/// The rollout budget (`max_unavailable`) of a template change to generation
/// `next`: counts and percentages, one that rounds to nothing (25% of a
/// small group, moving one node at a time), and all at once.
pub fn rollout_budget(next: u64) -> contract::Budget {
    const BUDGETS: [contract::Budget; 5] = [
        contract::Budget::Count(1),
        contract::Budget::Percent(25),
        contract::Budget::Count(2),
        contract::Budget::Percent(50),
        contract::Budget::Percent(100),
    ];
    BUDGETS[(next % BUDGETS.len() as u64) as usize]
}

/// The surge (`max_surge`) of a template change to generation `next`:
/// none, one, a percentage that rounds up to one at least, and two.
pub fn rollout_surge(next: u64) -> contract::Budget {
    const SURGES: [contract::Budget; 4] = [
        contract::Budget::Count(0),
        contract::Budget::Count(1),
        contract::Budget::Percent(25),
        contract::Budget::Count(2),
    ];
    SURGES[(next % SURGES.len() as u64) as usize]
}

/// `shape` with the surge its generation picks for each group whose
/// template differs from `current`'s.
pub fn with_surge(current: &ClusterShape, mut shape: ClusterShape) -> ClusterShape {
    let surge = rollout_surge(shape.generation.get());
    for g in &mut shape.groups {
        let changed = current
            .groups
            .iter()
            .find(|c| c.id == g.id)
            .is_some_and(|c| !NodeTemplate::same(&c.template, &g.template));
        if changed {
            g.policy.rollout.max_surge = surge;
        }
    }
    shape
}

/// How the rollout of a bad image to generation `next` halts: after one
/// failed attempt or two, reverting to the group's last converged template
/// or (one time in three) waiting for the client's next apply.
pub fn rollout_halt(next: u64) -> (u32, bool) {
    (1 + (next % 2) as u32, !next.is_multiple_of(3))
}

fn group_id(g: Group) -> GroupId {
    // The names are valid labels by construction.
    GroupId::parse("id", g.name()).unwrap_or_else(|e| unreachable!("{e}"))
}

fn run_id(s: &str) -> RunId {
    RunId::parse("run_id", s).unwrap_or_else(|e| unreachable!("{e}"))
}

/// The shape limits every world configures.
pub fn limits() -> ShapeLimits {
    ShapeLimits {
        max_nodes_per_group: LIMIT_PER_GROUP,
        ..ShapeLimits::default()
    }
}

impl World {
    /// The world of `seed`, delivering in `delivery` mode.
    pub fn new(seed: u64, delivery: Delivery) -> Self {
        let mut rng = Rng::new(seed ^ 0x3c6e_f372_fe94_f82b);
        let mut groups = vec![
            NodeGroup {
                id: group_id(Group::Ctrl),
                count: 1 + rng.below(2) as u32,
                template: Arc::new(template(Group::Ctrl, "img:1")),
                policy: group_policy(),
            },
            NodeGroup {
                id: group_id(Group::Work),
                count: 1 + rng.below(4) as u32,
                template: Arc::new(template(Group::Work, "img:1")),
                policy: group_policy(),
            },
        ];
        if rng.chance(0.3) {
            groups.push(NodeGroup {
                id: group_id(Group::Gpu),
                count: 1 + rng.below(2) as u32,
                template: Arc::new(template(Group::Gpu, "img:1")),
                policy: group_policy(),
            });
        }
        let initial = ClusterShape {
            run_id: run_id(RUN_ID),
            generation: Generation::new(1),
            labels: Default::default(),
            groups,
        };
        let faults = match rng.below(10) {
            0..=4 => FaultMix::Chaos,
            5 | 6 => FaultMix::None,
            7 => FaultMix::Creates,
            8 => FaultMix::Bootstraps,
            _ => FaultMix::Cleanup,
        };
        let fake = FakeConfig {
            seed,
            faults: faults.rates(),
            latency_ms: [(1, 5), (1, 40), (10, 10)][rng.below(3) as usize],
            endpoint_delay_ms: [0, 0, 30, 400][rng.below(4) as usize],
            stage_interval_ms: [5, 10, 30][rng.below(3) as usize],
        };
        let fast = rng.chance(0.5);
        let ms = Duration::from_millis;
        let policy = Policy {
            backoff: if fast {
                BackoffPolicy {
                    base: ms(200),
                    cap: ms(5_000),
                    jitter: 0.2,
                }
            } else {
                BackoffPolicy::default()
            },
            probe_interval: if fast { ms(50) } else { ms(500) },
            endpoint_timeout: if fast { ms(20_000) } else { ms(120_000) },
            bootstrap_timeout: if fast { ms(30_000) } else { ms(600_000) },
            operation_timeout: if fast { ms(10_000) } else { ms(60_000) },
            result_grace: if fast { ms(1_000) } else { ms(5_000) },
            // Both ways of pacing passes: at once, and batched while
            // operations are in flight.
            pass_batch: if fast { ms(0) } else { ms(50) },
            limits: limits(),
            // A short event log too, so its trimming runs under the battery.
            event_limit: if fast {
                8
            } else {
                contract::events::DEFAULT_EVENT_LIMIT
            },
        };
        Self {
            seed,
            delivery,
            initial,
            fake,
            policy,
        }
    }

    /// The same world without anything that depends on the order of calls: no
    /// backoff jitter (it depends on attempt ids, which the order of work
    /// decides), a fixed backend latency and no random faults (the fake draws
    /// both from one stream in call order). Guarantee 16's order check runs here.
    pub fn calm_twin(&self) -> World {
        let mut w = self.clone();
        w.policy.backoff.jitter = 0.0;
        w.fake.latency_ms = (3, 3);
        w.fake.faults = FaultMix::None.rates();
        w
    }

    /// Probes a lookup may need before a lease's endpoint is ready, plus one.
    pub fn endpoint_probes(&self) -> u64 {
        let probe = u64::try_from(self.policy.probe_interval.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        self.fake.endpoint_delay_ms.div_ceil(probe) + 1
    }
}

fn find(shape: &ClusterShape, g: Group) -> Option<usize> {
    shape.groups.iter().position(|x| x.id.as_str() == g.name())
}

fn total(shape: &ClusterShape) -> u32 {
    shape.groups.iter().map(|g| g.count).sum()
}

/// The shape `change` makes of `current`, at the next generation.
pub fn changed_shape(current: &ClusterShape, change: Change) -> ClusterShape {
    let mut s = current.clone();
    let next = current.generation.get() + 1;
    s.generation = Generation::new(next);
    let room = MAX_TOTAL.saturating_sub(total(current));
    // A template change rolls out within a budget that the generation picks,
    // so traces replay it and the battery sees several.
    // A bad image or a failing boot also halts its rollout after a failure
    // or two (and then mostly reverts it); other template changes never
    // halt.
    let edit = |s: &mut ClusterShape, g: Group, f: &dyn Fn(&mut NodeTemplate)| {
        if let Some(i) = find(s, g) {
            f(Arc::make_mut(&mut s.groups[i].template));
            let t = &s.groups[i].template;
            let bad = t.image.starts_with("invalid") || t.boot.contains_key("fault.fail_at");
            let rollout = &mut s.groups[i].policy.rollout;
            rollout.max_unavailable = rollout_budget(next);
            (rollout.failure_threshold, rollout.auto_revert) =
                if bad { rollout_halt(next) } else { (0, false) };
        }
    };
    match change {
        Change::ScaleUp(g, n) => {
            let add = u32::from(n).min(room);
            match find(&s, g) {
                Some(i) => {
                    let c = &mut s.groups[i].count;
                    *c = (*c + add).min(MAX_PER_GROUP);
                }
                None => s.groups.push(NodeGroup {
                    id: group_id(g),
                    count: add.min(MAX_PER_GROUP),
                    template: Arc::new(template(g, "img:1")),
                    policy: group_policy(),
                }),
            }
        }
        Change::ScaleDown(g, n) => {
            if let Some(i) = find(&s, g) {
                let c = &mut s.groups[i].count;
                *c = c.saturating_sub(u32::from(n));
            }
        }
        Change::Image(g) => edit(&mut s, g, &|t| t.image = format!("img:{next}")),
        Change::Boot(g) => edit(&mut s, g, &|t| {
            t.boot.insert(
                "flag".to_owned(),
                Param {
                    value: format!("v{next}"),
                    secret: false,
                },
            );
        }),
        Change::BadImage(g) => edit(&mut s, g, &|t| t.image = format!("invalid:{next}")),
        Change::FailingBoot(g) => edit(&mut s, g, &|t| {
            t.boot.insert(
                "fault.fail_at".to_owned(),
                Param {
                    value: "joined".to_owned(),
                    secret: false,
                },
            );
        }),
        Change::RemoveGroup(g) => {
            if let Some(i) = find(&s, g) {
                s.groups.remove(i);
            }
        }
        Change::Bump => {}
    }
    s
}

/// The same content with one count moved by one: content that differs.
fn other_content(current: &ClusterShape) -> ClusterShape {
    let mut s = current.clone();
    match s.groups.first_mut() {
        Some(g) if g.count > 0 => g.count -= 1,
        Some(g) => g.count += 1,
        None => s.groups.push(NodeGroup {
            id: group_id(Group::Work),
            count: 1,
            template: Arc::new(template(Group::Work, "img:1")),
            policy: group_policy(),
        }),
    }
    s
}

/// A shape that the revision contract or validation must reject, built from
/// `current`.
pub fn bad_shape(current: &ClusterShape, bad: Bad) -> ClusterShape {
    let g = current.generation.get();
    let mut s = current.clone();
    s.generation = Generation::new(g + 1);
    if s.groups.is_empty() {
        s.groups.push(NodeGroup {
            id: group_id(Group::Work),
            count: 1,
            template: Arc::new(template(Group::Work, "img:1")),
            policy: group_policy(),
        });
    }
    let first = |s: &mut ClusterShape| (*s.groups[0].template).clone();
    match bad {
        Bad::Regress => {
            s = other_content(current);
            s.generation = Generation::new(g.saturating_sub(1));
        }
        Bad::SameGeneration => {
            s = other_content(current);
            s.generation = current.generation;
        }
        Bad::RunId => s.run_id = run_id("other-run"),
        Bad::NanCpu => {
            let mut t = first(&mut s);
            t.provider.cpu = f64::NAN;
            s.groups[0].template = Arc::new(t);
        }
        Bad::NegativeMemory => {
            let mut t = first(&mut s);
            t.provider.memory_gib = -1.0;
            s.groups[0].template = Arc::new(t);
        }
        Bad::DuplicateGroup => {
            let dup = s.groups[0].clone();
            s.groups.push(dup);
        }
        Bad::OverLimit => s.groups[0].count = LIMIT_PER_GROUP + 1,
        Bad::ZeroGeneration => s.generation = Generation::new(0),
        Bad::EmptyImage => {
            let mut t = first(&mut s);
            t.image.clear();
            s.groups[0].template = Arc::new(t);
        }
    }
    s
}

/// Whether the latest shape holds an image the backend refuses permanently.
pub fn has_bad_image(shape: &ClusterShape) -> bool {
    shape
        .groups
        .iter()
        .any(|g| g.template.image.starts_with("invalid"))
}

/// The repair the fair tail applies when the latest shape cannot converge
/// because the backend refuses a spec permanently: every group whose nodes are
/// blocked gets a fresh, valid image.
pub fn repaired_shape(current: &ClusterShape, blocked: &[GroupId]) -> ClusterShape {
    let mut s = current.clone();
    let next = current.generation.get() + 1;
    s.generation = Generation::new(next);
    for g in &mut s.groups {
        if blocked.contains(&g.id) || g.template.image.starts_with("invalid") {
            Arc::make_mut(&mut g.template).image = format!("img:repair-{next}");
        }
    }
    s
}

/// Which inputs a generated trace may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alphabet {
    /// Every input: the in-memory system.
    Full,
    /// What the real services can be driven with from outside: shape updates,
    /// link cuts, executor fault switches (by restarting it), a resource lost,
    /// sickened or healed (through the fake's control service, or signals to
    /// a node agent) and waiting.
    Services,
}

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.below(xs.len() as u64) as usize]
}

fn pick_group(rng: &mut Rng) -> Group {
    pick(rng, &[Group::Ctrl, Group::Work, Group::Work, Group::Gpu])
}

fn pick_change(rng: &mut Rng, alphabet: Alphabet) -> Change {
    let g = pick_group(rng);
    let n = 1 + rng.below(3) as u8;
    match rng.below(16) {
        0..=3 => Change::ScaleUp(g, n),
        4..=6 => Change::ScaleDown(g, n),
        7..=9 => Change::Image(g),
        10 | 11 => Change::Boot(g),
        12 if alphabet == Alphabet::Full => Change::BadImage(g),
        13 => Change::RemoveGroup(g),
        _ => Change::Bump,
    }
}

fn pick_inject(rng: &mut Rng) -> Input {
    // Most injections hit the slot's next operation whatever it is, so that
    // they land; the rest wait for one effect (a destroy, say) to come.
    let effect = if rng.chance(0.6) {
        None
    } else {
        Some(pick(
            rng,
            &[
                Effect::CreateLease,
                Effect::LookupEndpoint,
                Effect::StartBootstrap,
                Effect::CancelBootstrap,
                Effect::DestroyLease,
                Effect::DestroyLease,
            ],
        ))
    };
    let mut outcomes = vec![
        Forced::Retryable,
        Forced::AmbiguousDone,
        Forced::AmbiguousNotDone,
        Forced::Hang,
        Forced::HangLate,
    ];
    if matches!(
        effect,
        None | Some(Effect::LookupEndpoint) | Some(Effect::StartBootstrap)
    ) {
        outcomes.extend([Forced::NotReady, Forced::NotReady]);
    }
    // Permanent failures are rarer: they block a node until its spec changes.
    let outcome = if rng.chance(0.06) {
        Forced::Permanent
    } else {
        pick(rng, &outcomes)
    };
    Input::Inject {
        slot: rng.below(16) as u8,
        effect,
        outcome,
    }
}

fn pick_steps(rng: &mut Rng) -> Input {
    let n = match rng.below(10) {
        0..=4 => 1 + rng.below(5),
        5..=8 => 6 + rng.below(25),
        _ => 31 + rng.below(50),
    };
    Input::Step(n as u16)
}

/// The trace of `seed` over `alphabet`: a faulty prefix of `len` inputs (the
/// fair tail is not part of the trace; the runner adds it).
pub fn generate(seed: u64, alphabet: Alphabet, len: usize) -> Vec<Input> {
    let mut rng = Rng::new(seed ^ 0x6a09_e667_f3bc_c908);
    let mut trace = Vec::with_capacity(len);
    let mut link_down = false;
    let mut deleted = false;
    for i in 0..len {
        let late = i * 10 >= len * 7;
        let r = rng.below(100);
        let input = match alphabet {
            Alphabet::Full => match r {
                0..=41 => pick_steps(&mut rng),
                42..=49 => Input::Apply(pick_change(&mut rng, alphabet)),
                50..=54 => Input::Reject(pick(&mut rng, &Bad::ALL)),
                55 | 56 => Input::Reapply,
                57..=61 => Input::Faults(pick(&mut rng, &FaultMix::ALL)),
                62..=72 => pick_inject(&mut rng),
                73..=75 => Input::Tick,
                76..=79 => Input::Advance(pick(&mut rng, &[500, 2_000, 15_000, 70_000, 700_000, 7_200_000])),
                80 | 81 if !link_down => {
                    link_down = true;
                    Input::LinkDown
                }
                80..=83 if link_down => {
                    link_down = false;
                    Input::Reconnect
                }
                84 | 85 => Input::Replay,
                86 | 87 => Input::Resend(rng.below(8) as u8),
                88 | 89 => Input::Resubmit,
                90 | 91 => Input::Conflict(rng.below(8) as u8),
                92..=94 => Input::RestartDriver,
                95 if late && !deleted => {
                    deleted = true;
                    Input::Delete
                }
                96 => Input::Lose(rng.below(8) as u8),
                97 | 98 => Input::Sicken(rng.below(8) as u8),
                99 => Input::Heal(rng.below(8) as u8),
                _ => pick_steps(&mut rng),
            },
            Alphabet::Services => match r {
                0..=39 => pick_steps(&mut rng),
                40..=43 => Input::Lose(rng.below(8) as u8),
                44..=47 => Input::Sicken(rng.below(8) as u8),
                48 | 49 => Input::Heal(rng.below(8) as u8),
                50..=69 => Input::Apply(pick_change(&mut rng, alphabet)),
                70..=79 => Input::Reject(pick(&mut rng, &Bad::ALL)),
                80..=84 => Input::Reapply,
                85..=92 => Input::LinkDown,
                _ => Input::Faults(pick(&mut rng, &[FaultMix::None, FaultMix::Chaos])),
            },
        };
        trace.push(input);
    }
    trace
}

/// The length of the prefix generated for `seed`.
pub fn prefix_len(seed: u64, alphabet: Alphabet) -> usize {
    let mut rng = Rng::new(seed ^ 0xbb67_ae85_84ca_a73b);
    match alphabet {
        Alphabet::Full => 15 + rng.below(46) as usize,
        Alphabet::Services => 6 + rng.below(7) as usize,
    }
}
