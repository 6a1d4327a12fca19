//! The observed state of one run, as the driver records it and the decider
//! reads it.

use std::sync::Arc;

use crate::{
    health::NodeHealth,
    ids::{AttemptId, Endpoint, LeaseId, LogicalNodeId, OperationId, SessionId},
    shape::NodeTemplate,
    time::UnixMillis,
};

/// A node's place on the lifecycle ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeStage {
    New,
    LeaseRequested,
    LeaseCreated,
    EndpointKnown,
    BootstrapRunning,
    Joined,
    HandedOff,
    Dormant,
    Failed,
    Destroyed,
}

impl NodeStage {
    pub const ALL: [NodeStage; 10] = [
        NodeStage::New,
        NodeStage::LeaseRequested,
        NodeStage::LeaseCreated,
        NodeStage::EndpointKnown,
        NodeStage::BootstrapRunning,
        NodeStage::Joined,
        NodeStage::HandedOff,
        NodeStage::Dormant,
        NodeStage::Failed,
        NodeStage::Destroyed,
    ];

    /// The stage's position in [`NodeStage::ALL`], for counts kept in an
    /// array.
    pub const fn ordinal(self) -> usize {
        self as usize
    }

    /// `HandedOff` and `Dormant` are the ready steady states.
    pub fn is_ready(self) -> bool {
        matches!(self, NodeStage::HandedOff | NodeStage::Dormant)
    }

    pub fn name(self) -> &'static str {
        match self {
            NodeStage::New => "new",
            NodeStage::LeaseRequested => "lease-requested",
            NodeStage::LeaseCreated => "lease-created",
            NodeStage::EndpointKnown => "endpoint-known",
            NodeStage::BootstrapRunning => "bootstrap-running",
            NodeStage::Joined => "joined",
            NodeStage::HandedOff => "handed-off",
            NodeStage::Dormant => "dormant",
            NodeStage::Failed => "failed",
            NodeStage::Destroyed => "destroyed",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Intent {
    Active,
    Deleting,
}

/// Bootstrap sub-stages, as a node's bootstrap session streams them. The decider
/// branches only on their class ([`BootstrapStage::is_failure`], `Converged`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BootstrapStage {
    Connected,
    BootCheck,
    AgentStarted,
    Joined,
    Converged,
    FailedConnect,
    FailedBootCheck,
    FailedAgentStart,
    FailedJoin,
    /// The session ended before it converged.
    FailedClosed,
}

impl BootstrapStage {
    /// Every stage.
    pub const ALL: [BootstrapStage; 10] = [
        BootstrapStage::Connected,
        BootstrapStage::BootCheck,
        BootstrapStage::AgentStarted,
        BootstrapStage::Joined,
        BootstrapStage::Converged,
        BootstrapStage::FailedConnect,
        BootstrapStage::FailedBootCheck,
        BootstrapStage::FailedAgentStart,
        BootstrapStage::FailedJoin,
        BootstrapStage::FailedClosed,
    ];

    /// The stages of a bootstrap that goes well, in order.
    pub const PROGRESS: [BootstrapStage; 5] = [
        BootstrapStage::Connected,
        BootstrapStage::BootCheck,
        BootstrapStage::AgentStarted,
        BootstrapStage::Joined,
        BootstrapStage::Converged,
    ];

    /// The failure stage reported when a bootstrap fails at this stage (a
    /// session that ends anywhere else ends `FailedClosed`).
    pub fn failure(self) -> BootstrapStage {
        match self {
            BootstrapStage::Connected => BootstrapStage::FailedConnect,
            BootstrapStage::BootCheck => BootstrapStage::FailedBootCheck,
            BootstrapStage::AgentStarted => BootstrapStage::FailedAgentStart,
            BootstrapStage::Joined => BootstrapStage::FailedJoin,
            _ => BootstrapStage::FailedClosed,
        }
    }

    /// A stage after which a session reports nothing more: converged or
    /// failed.
    pub fn is_terminal(self) -> bool {
        self == BootstrapStage::Converged || self.is_failure()
    }

    pub fn is_failure(self) -> bool {
        matches!(
            self,
            BootstrapStage::FailedConnect
                | BootstrapStage::FailedBootCheck
                | BootstrapStage::FailedAgentStart
                | BootstrapStage::FailedJoin
                | BootstrapStage::FailedClosed
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            BootstrapStage::Connected => "connected",
            BootstrapStage::BootCheck => "boot-check",
            BootstrapStage::AgentStarted => "agent-started",
            BootstrapStage::Joined => "joined",
            BootstrapStage::Converged => "converged",
            BootstrapStage::FailedConnect => "failed-connect",
            BootstrapStage::FailedBootCheck => "failed-boot-check",
            BootstrapStage::FailedAgentStart => "failed-agent-start",
            BootstrapStage::FailedJoin => "failed-join",
            BootstrapStage::FailedClosed => "failed-closed",
        }
    }

    /// The stage named `s` (as [`BootstrapStage::name`] spells it).
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.name() == s)
    }
}

/// The provider effects, one per operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Effect {
    CreateLease,
    LookupEndpoint,
    StartBootstrap,
    CancelBootstrap,
    DestroyLease,
}

impl Effect {
    pub const ALL: [Effect; 5] = [
        Effect::CreateLease,
        Effect::LookupEndpoint,
        Effect::StartBootstrap,
        Effect::CancelBootstrap,
        Effect::DestroyLease,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Effect::CreateLease => "create-lease",
            Effect::LookupEndpoint => "lookup-endpoint",
            Effect::StartBootstrap => "start-bootstrap",
            Effect::CancelBootstrap => "cancel-bootstrap",
            Effect::DestroyLease => "destroy-lease",
        }
    }

    /// Cancel and destroy: the cleanup effects.
    pub fn is_destructive(self) -> bool {
        matches!(self, Effect::CancelBootstrap | Effect::DestroyLease)
    }
}

/// Where a bootstrap session got to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapProgress {
    pub stage: BootstrapStage,
    /// Sequence number of the last folded observation of the session.
    pub seq: u64,
    pub at: UnixMillis,
    pub detail: String,
}

/// Why an attempt, or one of its effects, failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub reason: String,
    pub at: UnixMillis,
}

/// What is known of an attempt's provider resources. These facts belong to one
/// attempt and never carry into its replacement.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeFacts {
    pub lease: Option<LeaseId>,
    pub endpoint: Option<Endpoint>,
    pub session: Option<SessionId>,
    pub bootstrap: Option<BootstrapProgress>,
    pub failure: Option<Failure>,
    /// A `CreateLease` ended ambiguously: a lease may exist that we do not know.
    pub ambiguous_create: bool,
    /// A `StartBootstrap` ended ambiguously: a session may exist.
    pub ambiguous_bootstrap: bool,
    /// The executor reported the attempt's resource gone (the attempt has
    /// failed, and `failure` says why).
    pub lost: bool,
    /// What the executor last reported of the attempt's health probes.
    pub health: Option<NodeHealth>,
}

impl NodeFacts {
    /// True while the attempt may hold a provider resource.
    pub fn holds_resources(&self) -> bool {
        self.lease.is_some() || self.session.is_some() || self.ambiguous_create || self.ambiguous_bootstrap
    }

    pub fn bootstrap_converged(&self) -> bool {
        self.bootstrap
            .as_ref()
            .is_some_and(|b| b.stage == BootstrapStage::Converged)
    }

    /// Unhealthy or lost: what a group's `max_unhealthy` counts.
    pub fn is_impaired(&self) -> bool {
        self.lost || self.health.as_ref().is_some_and(NodeHealth::is_unhealthy)
    }

    pub fn bootstrap_failed(&self) -> bool {
        self.bootstrap.as_ref().is_some_and(|b| b.stage.is_failure())
    }
}

/// The one operation a node may have in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingOp {
    pub id: OperationId,
    pub effect: Effect,
    /// Absolute deadline; the executor abandons the operation then.
    pub deadline: UnixMillis,
    pub dispatched_at: UnixMillis,
}

/// A failure that retrying the same spec cannot fix (invalid image, quota).
#[derive(Debug, Clone, PartialEq)]
pub struct PermanentFailure {
    pub reason: String,
    /// The spec that failed; a restart waits until the desired spec differs.
    pub spec: Arc<NodeTemplate>,
}

/// Per-slot retry bookkeeping. Unlike facts, it carries into a replacement
/// attempt, so a hot restart loop still backs off.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RetryState {
    pub consecutive_failures: u32,
    /// No effect is dispatched before this (backoff or probe interval).
    pub next_effect_at: Option<UnixMillis>,
    /// A destroyed slot is not restarted before this.
    pub restart_at: Option<UnixMillis>,
    pub permanent: Option<PermanentFailure>,
    /// The slot is being replaced for health: set when the driver begins the
    /// unhealthy attempt's cleanup, cleared when the slot is ready again. What
    /// a group's `max_in_flight` counts.
    pub remediating: bool,
}

/// One slot's observed state.
#[derive(Debug, Clone, PartialEq)]
pub struct ManagedNode {
    pub id: LogicalNodeId,
    pub attempt: AttemptId,
    /// The template this attempt was started from; immutable for the attempt.
    pub spec: Arc<NodeTemplate>,
    pub intent: Intent,
    pub stage: NodeStage,
    pub facts: NodeFacts,
    pub pending: Option<PendingOp>,
    pub retry: RetryState,
    /// Deadline of the current stage (endpoint appearance or bootstrap
    /// convergence), stored when the stage is entered.
    pub stage_deadline: Option<UnixMillis>,
    /// The attempt's place in a slot holding two (SPEC.md section 9): the
    /// driver derives it from the slot whenever either attempt changes.
    pub surge: Surge,
}

/// A slot holds its current attempt and, under a rollout's surge, one
/// successor provisioned on the new template while the current one serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Surge {
    /// The slot's only attempt.
    #[default]
    None,
    /// The current attempt of a slot whose successor is `successor`;
    /// `successor_ready` once the successor serves (the current attempt then
    /// hands the slot over).
    Current {
        successor: AttemptId,
        successor_ready: bool,
    },
    /// The slot's successor attempt.
    Successor,
}

impl ManagedNode {
    /// A fresh attempt for a slot.
    pub fn new(id: LogicalNodeId, attempt: AttemptId, spec: Arc<NodeTemplate>, retry: RetryState) -> Self {
        Self {
            id,
            attempt,
            spec,
            intent: Intent::Active,
            stage: NodeStage::New,
            facts: NodeFacts::default(),
            pending: None,
            retry,
            stage_deadline: None,
            surge: Surge::None,
        }
    }

    pub fn is_ready(&self) -> bool {
        self.stage.is_ready()
    }
}

#[cfg(test)]
mod stage_tests {
    use super::NodeStage;

    #[test]
    fn a_stage_ordinal_is_its_place_in_all() {
        for (i, stage) in NodeStage::ALL.iter().enumerate() {
            assert_eq!(stage.ordinal(), i, "{stage:?}");
        }
    }
}
