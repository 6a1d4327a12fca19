//! How a group moves to a new template (SPEC.md section 9): the budget a
//! rollout stays within, its canary, and when it halts. Like the day-2
//! policy, a group's rollout policy is outside its node template, so changing
//! it replaces nothing.

use crate::{
    error::{FieldError, Problem},
    health::Budget,
};

/// The default progress deadline: ten minutes without a new node ready.
pub const DEFAULT_PROGRESS_DEADLINE_MS: u64 = 600_000;
/// The longest progress deadline (a week): a typo must not mean "never".
pub const MAX_PROGRESS_DEADLINE_MS: u64 = 7 * 86_400_000;
/// The shortest (a second): shorter would halt on the first pass.
pub const MIN_PROGRESS_DEADLINE_MS: u64 = 1_000;

/// `rollout:` of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RolloutPolicy {
    /// Desired slots of the group that may be unavailable while it rolls
    /// out (a percentage rounds down).
    pub max_unavailable: Budget,
    /// Successor attempts the group may hold beyond its desired count (a
    /// percentage rounds up).
    pub max_surge: Budget,
    /// Replacements that must be ready before the rollout pauses for a
    /// promotion; 0: no canary.
    pub canary: u32,
    /// With no new node ready for this long, the rollout halts.
    pub progress_deadline_ms: u64,
    /// This many failed attempts of the new template halt the rollout; 0:
    /// failures alone never halt it.
    pub failure_threshold: u32,
    /// A halted rollout applies the group's last converged template again.
    pub auto_revert: bool,
}

impl Default for RolloutPolicy {
    /// As a Kubernetes Deployment: 25% unavailable, 25% surge.
    fn default() -> Self {
        Self {
            max_unavailable: Budget::Percent(25),
            max_surge: Budget::Percent(25),
            canary: 0,
            progress_deadline_ms: DEFAULT_PROGRESS_DEADLINE_MS,
            failure_threshold: 0,
            auto_revert: false,
        }
    }
}

/// A rollout budget resolved against a group's desired count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    pub max_unavailable: u32,
    pub max_surge: u32,
}

impl RolloutPolicy {
    /// Field paths relative to the policy (`max_unavailable`, ...).
    pub fn validate(&self) -> Result<(), FieldError> {
        for (field, b) in [
            ("max_unavailable", self.max_unavailable),
            ("max_surge", self.max_surge),
        ] {
            if let Budget::Percent(p) = b
                && p > 100
            {
                return Err(FieldError::new(
                    field,
                    Problem::OverLimit {
                        value: u64::from(p),
                        limit: 100,
                    },
                ));
            }
        }
        if self.max_unavailable.is_zero() && self.max_surge.is_zero() {
            return Err(FieldError::new(
                "max_unavailable",
                Problem::Malformed("must not be 0 when max_surge is 0 too: no node could ever be replaced"),
            ));
        }
        let d = self.progress_deadline_ms;
        if d < MIN_PROGRESS_DEADLINE_MS {
            return Err(FieldError::new(
                "progress_deadline",
                Problem::Malformed("must be at least 1s"),
            ));
        }
        if d > MAX_PROGRESS_DEADLINE_MS {
            return Err(FieldError::new(
                "progress_deadline",
                Problem::OverLimit {
                    value: d,
                    limit: MAX_PROGRESS_DEADLINE_MS,
                },
            ));
        }
        Ok(())
    }

    /// The budget for a group of `desired` nodes: unavailable rounds down,
    /// surge rounds up. Should both come to 0 (a small group with small
    /// percentages), one node may be unavailable, so a rollout can always
    /// move; a group of no nodes has nothing to roll.
    pub fn resolve(&self, desired: u32) -> Resolved {
        let max_unavailable = self.max_unavailable.resolve(desired);
        let max_surge = self.max_surge.resolve_up(desired);
        if max_unavailable == 0 && max_surge == 0 && desired > 0 {
            return Resolved {
                max_unavailable: 1,
                max_surge: 0,
            };
        }
        Resolved {
            max_unavailable,
            max_surge,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_a_deployments() {
        let r = RolloutPolicy::default().resolve(10);
        assert_eq!((r.max_unavailable, r.max_surge), (2, 3));
        let r = RolloutPolicy::default().resolve(3);
        assert_eq!((r.max_unavailable, r.max_surge), (0, 1));
        // 25% of one node: nothing unavailable, one successor.
        let r = RolloutPolicy::default().resolve(1);
        assert_eq!((r.max_unavailable, r.max_surge), (0, 1));
    }

    #[test]
    fn a_budget_that_rounds_to_nothing_still_moves() {
        let p = RolloutPolicy {
            max_unavailable: Budget::Percent(10),
            max_surge: Budget::Count(0),
            ..RolloutPolicy::default()
        };
        assert_eq!(p.resolve(5).max_unavailable, 1);
        assert_eq!(p.resolve(20).max_unavailable, 2);
        assert_eq!(p.resolve(0).max_unavailable, 0);
    }

    #[test]
    fn validation_names_the_field() {
        let mut p = RolloutPolicy {
            max_unavailable: Budget::Count(0),
            max_surge: Budget::Percent(0),
            ..RolloutPolicy::default()
        };
        assert_eq!(p.validate().unwrap_err().field, "max_unavailable");
        p.max_surge = Budget::Count(1);
        assert!(p.validate().is_ok());
        p.max_surge = Budget::Percent(150);
        assert_eq!(p.validate().unwrap_err().field, "max_surge");
        p.max_surge = Budget::Count(1);
        p.progress_deadline_ms = 10;
        assert_eq!(p.validate().unwrap_err().field, "progress_deadline");
        p.progress_deadline_ms = MAX_PROGRESS_DEADLINE_MS + 1;
        assert_eq!(p.validate().unwrap_err().field, "progress_deadline");
    }
}
