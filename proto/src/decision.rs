//! Decisions as values: what the decider answers for each node, with the ladder
//! rule that fired and a reason a person can read.

use std::{borrow::Cow, fmt};

use crate::{
    ids::{AttemptId, LogicalNodeId},
    state::Effect,
    time::UnixMillis,
};

/// The rules of the decision ladder, numbered as in SPEC.md (0 is the topology
/// insert, seen before row 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Rule {
    /// A desired slot with no node.
    Insert = 0,
    /// `Destroyed`, slot undesired.
    Reap = 1,
    /// `Destroyed`, slot desired, `restart_at` due.
    Restart = 2,
    /// `Destroyed`, restart not due (or blocked by a permanent failure).
    RestartBackoff = 3,
    /// `Active` and (undesired, drifted or `Failed`).
    BeginDelete = 4,
    /// An operation is pending.
    Pending = 5,
    /// `Deleting` with an ambiguous create remembered: re-issue it to adopt.
    ReissueCreate = 6,
    /// `Deleting` with a live (or ambiguous) bootstrap session.
    CancelBootstrap = 7,
    /// `Deleting` with a live (or ambiguous) lease.
    DestroyLease = 8,
    /// `Deleting`, nothing left to clean.
    MarkDestroyed = 9,
    /// Retry backoff not due.
    RetryBackoff = 10,
    /// Ready: steady state.
    Ready = 11,
    /// No lease.
    CreateLease = 12,
    /// A lease but no endpoint.
    LookupEndpoint = 13,
    /// Joined, bootstrap converged.
    ObserveConvergence = 14,
    /// Bootstrap running: await the stream.
    AwaitBootstrap = 15,
    /// Lease and endpoint, no session.
    StartBootstrap = 16,
    /// Ready and drifted, but the group's rollout holds it: its budget of
    /// unavailable slots is spent, its canary waits for a promotion, or the
    /// rollout halted (SPEC.md section 9).
    RolloutBudget = 17,
    /// Unhealthy past its deadline, but the group's remediation budget holds
    /// it (too many in flight, or too many of the group impaired).
    RemediationBudget = 18,
    /// Ready and drifted, and the group's surge budget has room: the slot
    /// gets a successor on the new template while this attempt serves.
    SurgeInsert = 19,
}

impl Rule {
    /// One more than the highest rule number: the size of a table indexed by
    /// [`Rule::number`].
    pub const SLOTS: usize = 20;

    pub const ALL: [Rule; 20] = [
        Rule::Insert,
        Rule::Reap,
        Rule::Restart,
        Rule::RestartBackoff,
        Rule::BeginDelete,
        Rule::Pending,
        Rule::ReissueCreate,
        Rule::CancelBootstrap,
        Rule::DestroyLease,
        Rule::MarkDestroyed,
        Rule::RetryBackoff,
        Rule::Ready,
        Rule::CreateLease,
        Rule::LookupEndpoint,
        Rule::ObserveConvergence,
        Rule::AwaitBootstrap,
        Rule::StartBootstrap,
        Rule::RolloutBudget,
        Rule::RemediationBudget,
        Rule::SurgeInsert,
    ];

    pub fn number(self) -> u32 {
        self as u32
    }

    /// The rule's short name, stable for scripts and metric labels: the
    /// action its ladder row takes.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Insert => "insert",
            Rule::Reap => "reap",
            Rule::Restart => "restart",
            Rule::RestartBackoff => "restart-backoff",
            Rule::BeginDelete => "begin-delete",
            Rule::Pending => "pending",
            Rule::ReissueCreate => "reissue-create",
            Rule::CancelBootstrap => "cancel-bootstrap",
            Rule::DestroyLease => "destroy-lease",
            Rule::MarkDestroyed => "mark-destroyed",
            Rule::RetryBackoff => "retry-backoff",
            Rule::Ready => "ready",
            Rule::CreateLease => "create-lease",
            Rule::LookupEndpoint => "lookup-endpoint",
            Rule::ObserveConvergence => "observe-convergence",
            Rule::AwaitBootstrap => "await-bootstrap",
            Rule::StartBootstrap => "start-bootstrap",
            Rule::RolloutBudget => "rollout-budget",
            Rule::RemediationBudget => "remediation-budget",
            Rule::SurgeInsert => "surge-insert",
        }
    }

    pub fn from_number(n: u32) -> Option<Rule> {
        Rule::ALL.into_iter().find(|r| r.number() == n)
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rule {}", self.number())
    }
}

/// What the driver is to do for one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Driver transition: a new node with a fresh attempt.
    Insert,
    /// Driver transition: remove a destroyed, undesired node.
    Reap,
    /// Driver transition: a fresh attempt with the latest spec.
    Restart,
    /// Driver transition: intent becomes `Deleting`.
    BeginDelete,
    /// Driver transition: cleanup is complete.
    MarkDestroyed,
    /// Driver transition: the bootstrap converged; the node is ready.
    ObserveConvergence,
    /// Driver transition: the slot gets a successor attempt on the desired
    /// template while its current attempt serves (a rollout's surge).
    Surge,
    /// Record and submit an operation for this effect.
    Dispatch(Effect),
    /// Nothing now. `until` is when the node wants another look, if ever on its
    /// own (a stored deadline); `None` waits for an event.
    Wait { until: Option<UnixMillis> },
}

impl Action {
    /// Driver transitions queue the next pass at once.
    pub fn is_transition(self) -> bool {
        !matches!(self, Action::Dispatch(_) | Action::Wait { .. })
    }

    pub fn name(self) -> &'static str {
        match self {
            Action::Insert => "insert",
            Action::Reap => "reap",
            Action::Restart => "restart",
            Action::BeginDelete => "begin-delete",
            Action::MarkDestroyed => "mark-destroyed",
            Action::ObserveConvergence => "observe-convergence",
            Action::Surge => "surge",
            Action::Dispatch(e) => e.name(),
            Action::Wait { .. } => "wait",
        }
    }
}

/// One node's decision for one pass.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub node: LogicalNodeId,
    /// `None` for an insert.
    pub attempt: Option<AttemptId>,
    pub rule: Rule,
    pub action: Action,
    pub reason: Cow<'static, str>,
}

/// Everything one `Decide` returns.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DecideOutput {
    pub decisions: Vec<Decision>,
    /// Earliest future stored deadline among waiting nodes.
    pub requeue_at: Option<UnixMillis>,
}

impl DecideOutput {
    /// Decisions other than waits.
    pub fn actions(&self) -> impl Iterator<Item = &Decision> {
        self.decisions
            .iter()
            .filter(|d| !matches!(d.action, Action::Wait { .. }))
    }
}
