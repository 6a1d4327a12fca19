//! A run's event log (SPEC.md section 8): what happened to the run that a
//! person asks about afterwards — a node lost, unhealthy or replaced, a
//! remediation held by its budget, a permanent failure, a dependency lost and
//! back, a takeover by another replica.
//!
//! Events are facts about the past, kept for people: nothing decides from
//! them. The driver writes each in the same commit as the state change it
//! describes, keeps a bounded number per run (the oldest go first), and
//! folds a repeat of the run's latest event into it (`count`, `last_at`), as
//! Kubernetes does, so a flapping dependency does not push everything else
//! out of the log.

use crate::{AttemptId, Generation, GroupId, LogicalNodeId, UnixMillis};

/// Why an event was recorded: a closed set, each with a CamelCase name a
/// script can branch on and a severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventReason {
    /// A shape was accepted (a new run, or a new generation).
    Applied,
    /// Every desired node is ready and observed so at the current generation.
    Converged,
    /// Nothing more can happen without a change (the Stalled condition).
    Stalled,
    /// A node's resource is gone; its slot is replaced on a fresh attempt.
    NodeLost,
    /// A node failed its health probe.
    NodeUnhealthy,
    /// An unhealthy node passes its health probe again.
    NodeRecovered,
    /// An unhealthy node is being replaced (its remediation was granted).
    NodeRemediated,
    /// The remediation budget holds a group's unhealthy nodes.
    RemediationHeld,
    /// A node's attempt failed permanently: the slot waits for a spec change.
    NodeFailedPermanently,
    /// The decider or the executor link went away.
    DependencyLost,
    /// The decider or the executor link is back.
    DependencyBack,
    /// The run was restored from the store by a driver that restarted.
    Restored,
    /// Another driver replica took the run over.
    TakenOver,
    Paused,
    Resumed,
    /// Deletion was requested: every node is cleaned up, then the run is gone.
    Deleting,
    /// A group's template changed while it held nodes: they are replaced
    /// within its rollout budget.
    RolloutStarted,
    /// A group's canary is on the new template: the rollout waits for a
    /// promotion.
    RolloutPaused,
    /// A client promoted a group's canary: the rollout goes on.
    RolloutPromoted,
    /// Every desired node of a group is ready on its new template.
    RolloutCompleted,
    /// A group's rollout passed its progress deadline or failure threshold:
    /// its drifted nodes keep serving, replaced no further.
    RolloutHalted,
    /// A halted rollout was reverted: the group's last converged template was
    /// applied as a new generation.
    RolloutReverted,
}

impl EventReason {
    pub const ALL: [EventReason; 22] = [
        Self::Applied,
        Self::Converged,
        Self::Stalled,
        Self::NodeLost,
        Self::NodeUnhealthy,
        Self::NodeRecovered,
        Self::NodeRemediated,
        Self::RemediationHeld,
        Self::NodeFailedPermanently,
        Self::DependencyLost,
        Self::DependencyBack,
        Self::Restored,
        Self::TakenOver,
        Self::Paused,
        Self::Resumed,
        Self::Deleting,
        Self::RolloutStarted,
        Self::RolloutPaused,
        Self::RolloutPromoted,
        Self::RolloutCompleted,
        Self::RolloutHalted,
        Self::RolloutReverted,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Self::Applied => "Applied",
            Self::Converged => "Converged",
            Self::Stalled => "Stalled",
            Self::NodeLost => "NodeLost",
            Self::NodeUnhealthy => "NodeUnhealthy",
            Self::NodeRecovered => "NodeRecovered",
            Self::NodeRemediated => "NodeRemediated",
            Self::RemediationHeld => "RemediationHeld",
            Self::NodeFailedPermanently => "NodeFailedPermanently",
            Self::DependencyLost => "DependencyLost",
            Self::DependencyBack => "DependencyBack",
            Self::Restored => "Restored",
            Self::TakenOver => "TakenOver",
            Self::Paused => "Paused",
            Self::Resumed => "Resumed",
            Self::Deleting => "Deleting",
            Self::RolloutStarted => "RolloutStarted",
            Self::RolloutPaused => "RolloutPaused",
            Self::RolloutPromoted => "RolloutPromoted",
            Self::RolloutCompleted => "RolloutCompleted",
            Self::RolloutHalted => "RolloutHalted",
            Self::RolloutReverted => "RolloutReverted",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Whether the event is something going wrong (Kubernetes' `Warning`
    /// type) rather than the run going about its business (`Normal`).
    pub const fn is_warning(self) -> bool {
        matches!(
            self,
            Self::Stalled
                | Self::NodeLost
                | Self::NodeUnhealthy
                | Self::NodeRemediated
                | Self::RemediationHeld
                | Self::NodeFailedPermanently
                | Self::DependencyLost
                | Self::RolloutHalted
                | Self::RolloutReverted
        )
    }
}

impl std::fmt::Display for EventReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What an event is about besides the run itself.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Subject {
    #[default]
    Run,
    Group(GroupId),
    Node {
        node: LogicalNodeId,
        attempt: AttemptId,
    },
}

/// One entry of a run's event log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Per run, from 1, never reused: a reader follows the log by it.
    pub seq: u64,
    pub reason: EventReason,
    pub subject: Subject,
    /// What a person reads.
    pub message: String,
    /// The run generation it happened at.
    pub generation: Generation,
    /// When it first happened, and when it last repeated.
    pub first_at: UnixMillis,
    pub last_at: UnixMillis,
    /// How many times it happened in a row (at least 1).
    pub count: u32,
}

impl Event {
    /// Whether `other` repeats this event (same reason, subject and message),
    /// so it is folded into it rather than logged again.
    pub fn repeats(&self, reason: EventReason, subject: &Subject, message: &str) -> bool {
        self.reason == reason && &self.subject == subject && self.message == message
    }
}

/// How many events a run keeps unless configured otherwise.
pub const DEFAULT_EVENT_LIMIT: usize = 256;
/// The most a run may be configured to keep.
pub const MAX_EVENT_LIMIT: usize = 100_000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_are_distinct() {
        let mut seen = std::collections::BTreeSet::new();
        for r in EventReason::ALL {
            assert_eq!(EventReason::parse(r.name()), Some(r));
            assert!(seen.insert(r.name()), "{r} twice");
        }
        assert_eq!(EventReason::parse("nodelost"), None);
    }

    #[test]
    fn a_repeat_needs_the_same_reason_subject_and_message() {
        let e = Event {
            seq: 1,
            reason: EventReason::DependencyLost,
            subject: Subject::Run,
            message: "the decider cannot be reached".into(),
            generation: Generation::new(1),
            first_at: UnixMillis::new(1),
            last_at: UnixMillis::new(1),
            count: 1,
        };
        assert!(e.repeats(
            EventReason::DependencyLost,
            &Subject::Run,
            "the decider cannot be reached"
        ));
        assert!(!e.repeats(
            EventReason::DependencyBack,
            &Subject::Run,
            "the decider cannot be reached"
        ));
        assert!(!e.repeats(
            EventReason::DependencyLost,
            &Subject::Run,
            "the executor link is down"
        ));
    }
}
