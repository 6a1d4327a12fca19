//! A group's rollout to a new template (SPEC.md section 9), as the driver
//! tracks it: when it started, when it last made progress, how many attempts
//! of the new template failed, its canary and its halt. The decider enforces
//! the budget from the counts the driver sends ([`contract::GroupCounts`]);
//! what needs memory across passes (a deadline, a failure count, a
//! promotion) lives here, stored with the run.
//!
//! Everything here is a plain value and a pure step: [`step`] takes a
//! group's rollout, its tally and `now`, and says what changed.

use std::time::Duration;

use contract::{Generation, GroupId, NodeGroup, UnixMillis};

/// One group's rollout in progress, as stored with the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRollout {
    pub group: GroupId,
    /// The generation that set the template the group rolls to.
    pub generation: Generation,
    pub started_at: UnixMillis,
    /// When the rollout last made progress: it started, a node of the new
    /// template became ready, or a client's apply ended its halt. The
    /// progress deadline counts from here.
    pub progress_at: UnixMillis,
    /// Desired slots ready on the new template at the last progress.
    pub ready: u32,
    /// Attempts of the new template that failed during this rollout.
    pub failures: u32,
    /// A client promoted the canary.
    pub promoted: bool,
    /// The canary pause was reported (one event per rollout).
    pub canary_reached: bool,
    pub halted: Option<Halt>,
    /// This rollout reverts a halted one: the generation it reverted from.
    /// A revert skips the canary and is never reverted itself.
    pub reverted_from: Option<Generation>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Halt {
    pub at: UnixMillis,
    pub reason: String,
}

/// A group as it was when all its desired nodes were last ready on its
/// template: what an auto-revert goes back to.
#[derive(Debug, Clone, PartialEq)]
pub struct StableGroup {
    pub group: NodeGroup,
    pub generation: Generation,
}

/// What the driver counts of one group's desired slots, kept as nodes change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tally {
    /// Desired slots held by a node (any template, any stage).
    pub held: u32,
    /// Of those, holding the group's current template.
    pub updated: u32,
    /// Of those, ready and serving.
    pub updated_ready: u32,
}

impl Tally {
    /// Desired slots held by a node of an older template.
    pub fn drifted(&self) -> u32 {
        self.held.saturating_sub(self.updated)
    }
}

impl GroupRollout {
    pub fn new(group: GroupId, generation: Generation, now: UnixMillis, ready: u32) -> Self {
        Self {
            group,
            generation,
            started_at: now,
            progress_at: now,
            ready,
            failures: 0,
            promoted: false,
            canary_reached: false,
            halted: None,
            reverted_from: None,
        }
    }

    /// When the rollout halts for want of progress, if it is still going.
    pub fn deadline(&self, g: &NodeGroup) -> Option<UnixMillis> {
        if self.halted.is_some() {
            return None;
        }
        self.progress_at
            .checked_add(Duration::from_millis(g.policy.rollout.progress_deadline_ms))
            .ok()
    }

    /// The canary no longer holds the rollout.
    pub fn canary_done(&self) -> bool {
        self.promoted || self.reverted_from.is_some()
    }
}

/// What [`step`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Nothing,
    /// A node of the new template became ready.
    Progressed,
    /// The canary is on the new template: the rollout waits for a promotion.
    CanaryReached,
    /// The rollout halts, for this reason.
    Halted(String),
}

/// One look at a rollout: progress, the canary, and the halt conditions (a
/// failure threshold reached, the progress deadline passed). `new_failures`
/// are the attempts of the new template that failed since the last look.
pub fn step(r: &mut GroupRollout, g: &NodeGroup, t: Tally, new_failures: u32, now: UnixMillis) -> Step {
    let policy = g.policy.rollout;
    r.failures = r.failures.saturating_add(new_failures);
    if r.halted.is_some() {
        return Step::Nothing;
    }
    let mut step = Step::Nothing;
    if t.updated_ready > r.ready {
        r.progress_at = now;
        step = Step::Progressed;
    }
    r.ready = t.updated_ready;
    if policy.failure_threshold > 0 && r.failures >= policy.failure_threshold {
        return halt(
            r,
            now,
            format!(
                "{} attempts of the new template failed (failure_threshold {})",
                r.failures, policy.failure_threshold
            ),
        );
    }
    if r.deadline(g).is_some_and(|d| d <= now) {
        return halt(
            r,
            now,
            format!(
                "no node of the new template became ready within the progress deadline ({}s)",
                policy.progress_deadline_ms / 1000
            ),
        );
    }
    if policy.canary > 0
        && !r.canary_done()
        && !r.canary_reached
        && t.updated >= policy.canary
        && t.drifted() > 0
    {
        r.canary_reached = true;
        return Step::CanaryReached;
    }
    step
}

fn halt(r: &mut GroupRollout, now: UnixMillis, reason: String) -> Step {
    r.halted = Some(Halt {
        at: now,
        reason: reason.clone(),
    });
    Step::Halted(reason)
}

/// One wave of a planned rollout: the slots replaced together, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wave {
    pub group: GroupId,
    /// From 1; the waves of a group follow one another.
    pub number: u32,
    pub slots: Vec<u32>,
    /// What is special about the wave (the canary, nodes that do not wait).
    pub note: String,
}

/// The waves in which a group's drifted slots would be replaced: first the
/// ones that are unavailable already (failed, lost, unhealthy, not ready),
/// which never wait; then the ready ones, lowest index first (the decider's
/// order), as many at once as the unavailable and surge budgets leave room
/// for, each wave once the one before is ready. A canary is a wave of its own,
/// followed by the pause for a promotion.
pub fn waves(
    g: &NodeGroup,
    counts: contract::GroupCounts,
    unavailable_drifted: Vec<u32>,
    mut ready_drifted: Vec<u32>,
) -> Vec<Wave> {
    let mut out = Vec::new();
    let mut push = |slots: Vec<u32>, note: String| {
        if !slots.is_empty() {
            let number = u32::try_from(out.len()).unwrap_or(u32::MAX).saturating_add(1);
            out.push(Wave {
                group: g.id.clone(),
                number,
                slots,
                note,
            });
        }
    };
    push(
        unavailable_drifted,
        "unavailable already (not ready, failed, lost or unhealthy): replaced without waiting".to_owned(),
    );
    ready_drifted.sort_unstable();
    let policy = g.policy.rollout;
    let resolved = policy.resolve(g.count);
    // A wave replaces as many as may be unavailable and surging at once.
    let budget = (resolved.max_unavailable + resolved.max_surge).max(1) as usize;
    let mut rest = ready_drifted.as_slice();
    // The first wave uses what the budget has left now.
    let used = g.count.saturating_sub(counts.available) + counts.surging;
    let mut room = budget.saturating_sub(used as usize).max(1);
    if policy.canary > 0 && !counts.canary_done {
        let left = policy.canary.saturating_sub(counts.updated) as usize;
        if left > 0 {
            let n = left.min(room).min(rest.len());
            let (wave, tail) = rest.split_at(n);
            push(
                wave.to_vec(),
                format!(
                    "canary of {}: the rollout then waits for `provisionctl rollout promote`",
                    policy.canary
                ),
            );
            rest = tail;
            room = budget;
        }
    }
    while !rest.is_empty() {
        let n = room.min(rest.len());
        let (wave, tail) = rest.split_at(n);
        push(
            wave.to_vec(),
            format!(
                "at most {} unavailable and {} surging at once",
                resolved.max_unavailable, resolved.max_surge
            ),
        );
        rest = tail;
        room = budget;
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use contract::{Budget, RolloutPolicy, shape::example_template};

    use super::*;

    fn group(policy: RolloutPolicy) -> NodeGroup {
        let id = GroupId::parse("id", "w").unwrap();
        let mut g = NodeGroup::new(id, 4, Arc::new(example_template("fake", "img:1")));
        g.policy.rollout = policy;
        g
    }

    fn at(s: u64) -> UnixMillis {
        UnixMillis::new(s * 1000)
    }

    #[test]
    fn waves_follow_the_budget_and_the_canary() {
        let mut g = group(RolloutPolicy {
            max_unavailable: Budget::Count(1),
            max_surge: Budget::Count(1),
            canary: 1,
            ..RolloutPolicy::default()
        });
        g.count = 6;
        let counts = contract::GroupCounts {
            available: 5,
            ..Default::default()
        };
        let w = waves(&g, counts, vec![2], vec![5, 0, 1, 3, 4]);
        let slots: Vec<Vec<u32>> = w.iter().map(|w| w.slots.clone()).collect();
        assert_eq!(slots, [vec![2], vec![0], vec![1, 3], vec![4, 5]]);
        assert!(w[1].note.contains("canary"), "{w:?}");
        assert_eq!(w.iter().map(|w| w.number).collect::<Vec<_>>(), [1, 2, 3, 4]);
        // Promoted: the budget alone.
        let done = contract::GroupCounts {
            canary_done: true,
            available: 6,
            ..Default::default()
        };
        let slots: Vec<Vec<u32>> = waves(&g, done, vec![], vec![0, 1, 3])
            .into_iter()
            .map(|w| w.slots)
            .collect();
        assert_eq!(slots, [vec![0, 1], vec![3]]);
    }

    #[test]
    fn the_deadline_counts_from_the_last_progress() {
        let g = group(RolloutPolicy {
            progress_deadline_ms: 60_000,
            ..RolloutPolicy::default()
        });
        let mut r = GroupRollout::new(g.id.clone(), Generation::new(2), at(0), 0);
        let t = |ready| Tally {
            held: 4,
            updated: 2,
            updated_ready: ready,
        };
        assert_eq!(step(&mut r, &g, t(0), 0, at(59)), Step::Nothing);
        assert_eq!(step(&mut r, &g, t(1), 0, at(59)), Step::Progressed);
        assert_eq!(step(&mut r, &g, t(1), 0, at(118)), Step::Nothing);
        assert!(matches!(step(&mut r, &g, t(1), 0, at(119)), Step::Halted(_)));
        // Halted stays halted, and has no deadline.
        assert_eq!(step(&mut r, &g, t(2), 0, at(200)), Step::Nothing);
        assert_eq!(r.deadline(&g), None);
    }

    #[test]
    fn failures_past_the_threshold_halt() {
        let g = group(RolloutPolicy {
            failure_threshold: 2,
            max_unavailable: Budget::Count(1),
            ..RolloutPolicy::default()
        });
        let mut r = GroupRollout::new(g.id.clone(), Generation::new(2), at(0), 0);
        let t = Tally {
            held: 4,
            updated: 1,
            updated_ready: 0,
        };
        assert_eq!(step(&mut r, &g, t, 1, at(1)), Step::Nothing);
        let Step::Halted(why) = step(&mut r, &g, t, 1, at(2)) else {
            panic!("two failures of a threshold of 2 halt");
        };
        assert!(why.contains("failure_threshold 2"), "{why}");
    }

    #[test]
    fn the_canary_is_reported_once_and_never_for_a_revert() {
        let g = group(RolloutPolicy {
            canary: 2,
            ..RolloutPolicy::default()
        });
        let t = Tally {
            held: 4,
            updated: 2,
            updated_ready: 2,
        };
        let mut r = GroupRollout::new(g.id.clone(), Generation::new(2), at(0), 2);
        assert_eq!(step(&mut r, &g, t, 0, at(1)), Step::CanaryReached);
        assert_eq!(step(&mut r, &g, t, 0, at(2)), Step::Nothing);
        let mut revert = GroupRollout {
            reverted_from: Some(Generation::new(2)),
            ..GroupRollout::new(g.id.clone(), Generation::new(3), at(0), 2)
        };
        assert_eq!(step(&mut revert, &g, t, 0, at(1)), Step::Nothing);
        assert!(revert.canary_done());
    }
}
