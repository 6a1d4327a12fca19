//! Day-2 policy of a group (SPEC.md section 8): how its ready nodes are
//! probed, and the budget that limits their replacement for health. A group's
//! policy is outside its node template, so changing it replaces nothing.

use crate::{
    error::{FieldError, Problem},
    rollout::RolloutPolicy,
    time::UnixMillis,
};

/// How the executor checks that a node still serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Probe {
    /// Not probed: only a lost resource (its process exited, its lease is
    /// gone) is noticed.
    #[default]
    None,
    /// A TCP connection to the node's endpoint, answered within the timeout.
    Tcp,
}

impl Probe {
    pub fn name(self) -> &'static str {
        match self {
            Probe::None => "none",
            Probe::Tcp => "tcp",
        }
    }

    pub fn from_name(s: &str) -> Option<Self> {
        [Probe::None, Probe::Tcp].into_iter().find(|p| p.name() == s)
    }
}

/// `health:` of a group. Times are milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HealthPolicy {
    pub probe: Probe,
    /// Between two probes of one node.
    pub interval_ms: u64,
    /// A probe not answered within this failed.
    pub timeout_ms: u64,
    /// A node unhealthy this long is due for remediation (a deadline the
    /// driver stores when it folds the first failed probe).
    pub unhealthy_after_ms: u64,
    /// Failed probes this soon after the executor starts watching a node do not
    /// count.
    pub startup_grace_ms: u64,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            probe: Probe::None,
            interval_ms: 10_000,
            timeout_ms: 2_000,
            unhealthy_after_ms: 30_000,
            startup_grace_ms: 0,
        }
    }
}

/// The shortest probe interval and timeout the driver accepts: a probe loop
/// faster than this costs the executor more than it tells.
pub const MIN_PROBE_MS: u64 = 50;
/// The longest any health time may be (a day): a typo must not mean "never".
pub const MAX_HEALTH_MS: u64 = 86_400_000;

impl HealthPolicy {
    /// Field paths relative to the policy (`interval`, `timeout`, ...).
    pub fn validate(&self) -> Result<(), FieldError> {
        for (field, v, min) in [
            ("interval", self.interval_ms, MIN_PROBE_MS),
            ("timeout", self.timeout_ms, MIN_PROBE_MS),
            ("unhealthy_after", self.unhealthy_after_ms, 0),
            ("startup_grace", self.startup_grace_ms, 0),
        ] {
            if v < min {
                return Err(FieldError::new(
                    field,
                    Problem::Malformed("must be at least 50ms"),
                ));
            }
            if v > MAX_HEALTH_MS {
                return Err(FieldError::new(
                    field,
                    Problem::OverLimit {
                        value: v,
                        limit: MAX_HEALTH_MS,
                    },
                ));
            }
        }
        if self.timeout_ms > self.interval_ms {
            return Err(FieldError::new(
                "timeout",
                Problem::Malformed("must not be longer than the interval"),
            ));
        }
        Ok(())
    }
}

/// A number of a group's desired nodes, given as a count or a percentage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Budget {
    Count(u32),
    Percent(u32),
}

impl Budget {
    /// The budget for a group of `desired` nodes. A percentage rounds down, so
    /// "40%" of 3 nodes is 1.
    pub fn resolve(self, desired: u32) -> u32 {
        match self {
            Budget::Count(n) => n,
            Budget::Percent(p) => ((u64::from(desired) * u64::from(p)) / 100) as u32,
        }
    }

    /// The budget for a group of `desired` nodes, a percentage rounded up
    /// ("25%" of 3 nodes is 1).
    pub fn resolve_up(self, desired: u32) -> u32 {
        match self {
            Budget::Count(n) => n,
            Budget::Percent(p) => (u64::from(desired) * u64::from(p)).div_ceil(100) as u32,
        }
    }

    /// Zero whatever the group's size.
    pub fn is_zero(self) -> bool {
        matches!(self, Budget::Count(0) | Budget::Percent(0))
    }

    /// `3` or `40%`.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        match s.strip_suffix('%') {
            Some(p) => p.trim().parse().ok().map(Budget::Percent),
            None => s.parse().ok().map(Budget::Count),
        }
    }
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Count(n) => write!(f, "{n}"),
            Budget::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// `remediation:` of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemediationPolicy {
    /// At most this many of the group's nodes replaced for health at once
    /// (0: unhealthy nodes are reported, never replaced).
    pub max_in_flight: u32,
    /// When more of the group's desired nodes than this are unhealthy or lost,
    /// remediation of the group stops.
    pub max_unhealthy: Budget,
}

impl Default for RemediationPolicy {
    fn default() -> Self {
        Self {
            max_in_flight: 1,
            max_unhealthy: Budget::Percent(100),
        }
    }
}

impl RemediationPolicy {
    pub fn validate(&self) -> Result<(), FieldError> {
        if let Budget::Percent(p) = self.max_unhealthy
            && p > 100
        {
            return Err(FieldError::new(
                "max_unhealthy",
                Problem::OverLimit {
                    value: u64::from(p),
                    limit: 100,
                },
            ));
        }
        Ok(())
    }
}

/// A group's settings outside its template: changing them replaces nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct GroupPolicy {
    pub health: HealthPolicy,
    pub remediation: RemediationPolicy,
    pub rollout: RolloutPolicy,
}

impl GroupPolicy {
    pub fn validate(&self) -> Result<(), FieldError> {
        self.health.validate().map_err(|e| e.within("health"))?;
        self.remediation.validate().map_err(|e| e.within("remediation"))?;
        self.rollout.validate().map_err(|e| e.within("rollout"))
    }
}

/// What the executor last reported of an attempt's probes. A fact of the
/// attempt: it never carries into a replacement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeHealth {
    pub healthy: bool,
    /// When the current state (healthy or not) began, by the executor's report.
    pub since: UnixMillis,
    /// The latest report, and its sequence number on the link (reports are
    /// ordered by both, so one overtaken by a later report is stale).
    pub observed_at: UnixMillis,
    pub seq: u64,
    pub detail: String,
    /// Unhealthy only: when the node is due for remediation (`since` plus the
    /// group's `unhealthy_after`), stored by the driver when it folded the
    /// first failed probe.
    pub remediate_at: Option<UnixMillis>,
}

impl NodeHealth {
    pub fn is_unhealthy(&self) -> bool {
        !self.healthy
    }

    /// Unhealthy and past its deadline.
    pub fn due(&self, now: UnixMillis) -> bool {
        !self.healthy && self.remediate_at.is_some_and(|t| t <= now)
    }
}

/// A group's day-2 counts, as the driver carries them in the Decide header so
/// that a decision about some of the group's nodes sees the whole group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GroupCounts {
    /// Desired slots whose current attempt is unhealthy or lost.
    pub unhealthy: u32,
    /// Slots being replaced for health (from the decision to replace until the
    /// replacement is ready).
    pub remediating: u32,
    /// Desired slots whose current attempt serves: active, ready, neither
    /// unhealthy nor lost (whatever its template). The rest are unavailable.
    pub available: u32,
    /// Desired slots whose node holds the group's current template.
    pub updated: u32,
    /// The group's rollout no longer pauses for its canary: promoted, or a
    /// revert (which goes straight to the template it reverts to).
    pub canary_done: bool,
    /// The group's rollout halted: drifted ready nodes wait until a newer
    /// apply (or a revert) ends the halt.
    pub halted: bool,
    /// Slots holding a successor attempt (a rollout's surge).
    pub surging: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_resolve_against_the_group() {
        assert_eq!(Budget::Percent(40).resolve(10), 4);
        assert_eq!(Budget::Percent(40).resolve(3), 1);
        assert_eq!(Budget::Percent(100).resolve(7), 7);
        assert_eq!(Budget::Count(2).resolve(10), 2);
        assert_eq!(Budget::parse("40%"), Some(Budget::Percent(40)));
        assert_eq!(Budget::parse("3"), Some(Budget::Count(3)));
        assert_eq!(Budget::parse("x%"), None);
        assert_eq!(Budget::parse("-1"), None);
    }

    #[test]
    fn policies_name_the_wrong_field() {
        let mut p = GroupPolicy::default();
        assert!(p.validate().is_ok());
        p.health.timeout_ms = 20_000;
        assert_eq!(p.validate().unwrap_err().field, "health.timeout");
        p = GroupPolicy::default();
        p.health.interval_ms = 10;
        assert_eq!(p.validate().unwrap_err().field, "health.interval");
        p = GroupPolicy::default();
        p.remediation.max_unhealthy = Budget::Percent(101);
        assert_eq!(p.validate().unwrap_err().field, "remediation.max_unhealthy");
    }

    #[test]
    fn a_node_is_due_only_past_its_stored_deadline() {
        let h = NodeHealth {
            healthy: false,
            since: UnixMillis::new(1_000),
            observed_at: UnixMillis::new(1_000),
            seq: 1,
            detail: String::new(),
            remediate_at: Some(UnixMillis::new(2_000)),
        };
        assert!(!h.due(UnixMillis::new(1_999)));
        assert!(h.due(UnixMillis::new(2_000)));
        assert!(!NodeHealth { healthy: true, ..h }.due(UnixMillis::new(3_000)));
    }
}
