//! What crosses the driver–executor link: claims, operations, results with their
//! explicit outcome classes, bootstrap observations, resource changes and
//! rejections.

use std::sync::Arc;

use crate::{
    health::HealthPolicy,
    ids::{
        AttemptId, Endpoint, Epoch, GroupId, LeaseId, LogicalNodeId, OperationId, RunId, RunUid, SessionId,
    },
    shape::{NodeTemplate, Params},
    state::{BootstrapStage, Effect},
    time::UnixMillis,
};

/// W3C trace context, carried inside every streamed message.
#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub struct TraceContext {
    pub traceparent: String,
    pub tracestate: String,
}

/// The identity every provider request is keyed on. A backend adopts an existing
/// resource with this identity before it creates one.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceIdentity {
    pub run_uid: RunUid,
    pub run_id: RunId,
    pub node: LogicalNodeId,
    pub attempt: AttemptId,
}

/// One resource the executor holds, as its inventory lists it: the identity,
/// the live facts the backend knows of it, and the highest epoch the executor
/// has seen for its run (zero: none), so that a driver reclaiming it claims
/// the run above that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryResource {
    pub identity: ResourceIdentity,
    pub lease: Option<LeaseId>,
    /// Known once the resource's endpoint is bound.
    pub endpoint: Option<Endpoint>,
    /// A bootstrap session exists on the resource (neither cancelled nor
    /// destroyed).
    pub session_live: bool,
    pub epoch: Epoch,
}

/// An effect with its input.
#[derive(Debug, Clone, PartialEq)]
pub enum OperationInput {
    CreateLease {
        template: Arc<NodeTemplate>,
    },
    LookupEndpoint {
        lease: LeaseId,
    },
    StartBootstrap {
        lease: LeaseId,
        endpoint: Endpoint,
        boot: Params,
        join: Params,
    },
    /// `session` is `None` when its existence is ambiguous: cancel by identity.
    CancelBootstrap {
        session: Option<SessionId>,
    },
    /// `lease` is `None` when its existence is ambiguous: destroy by identity.
    DestroyLease {
        lease: Option<LeaseId>,
    },
}

impl OperationInput {
    pub fn effect(&self) -> Effect {
        match self {
            OperationInput::CreateLease { .. } => Effect::CreateLease,
            OperationInput::LookupEndpoint { .. } => Effect::LookupEndpoint,
            OperationInput::StartBootstrap { .. } => Effect::StartBootstrap,
            OperationInput::CancelBootstrap { .. } => Effect::CancelBootstrap,
            OperationInput::DestroyLease { .. } => Effect::DestroyLease,
        }
    }
}

/// One dispatched effect.
#[derive(Debug, Clone, PartialEq)]
pub struct Operation {
    pub run_uid: RunUid,
    pub run_id: RunId,
    pub node: LogicalNodeId,
    pub id: OperationId,
    pub epoch: Epoch,
    pub deadline: UnixMillis,
    /// The provider that serves the node: its template's `provider.name`,
    /// carried by every operation of the attempt so the executor routes each
    /// to the provider that holds the resource. Empty from a driver that
    /// predates it: the executor's default provider.
    pub provider: Arc<str>,
    pub input: OperationInput,
    pub trace: TraceContext,
}

impl Operation {
    pub fn identity(&self) -> ResourceIdentity {
        ResourceIdentity {
            run_uid: self.run_uid,
            run_id: self.run_id.clone(),
            node: self.node.clone(),
            attempt: self.id.attempt(),
        }
    }

    /// The executor's dedup comparison: the same operation id must carry the same
    /// node and input. Epoch, deadline and trace context are not compared, so a
    /// resubmission after a driver restart is a replay.
    pub fn same_input(&self, other: &Operation) -> bool {
        self.run_uid == other.run_uid
            && self.run_id == other.run_id
            && self.node == other.node
            && self.id == other.id
            && self.input == other.input
    }
}

/// Facts a successful operation reports.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResultFacts {
    pub lease: Option<LeaseId>,
    pub endpoint: Option<Endpoint>,
    pub session: Option<SessionId>,
}

/// The outcome classes, explicit on the wire. A backend that does not know
/// whether an effect happened must say `Ambiguous`: a definite failure after a
/// half-done create leaks a provider resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Succeeded(ResultFacts),
    /// The resource exists but is not ready yet (an endpoint not bound); a probe,
    /// not a failure.
    NotReady {
        reason: String,
    },
    /// Definitely did not happen; trying again may work.
    Retryable {
        reason: String,
    },
    /// Definitely did not happen; trying the same input again will not work.
    Permanent {
        reason: String,
    },
    /// May or may not have happened.
    Ambiguous {
        reason: String,
    },
}

impl Outcome {
    pub fn class_name(&self) -> &'static str {
        match self {
            Outcome::Succeeded(_) => "succeeded",
            Outcome::NotReady { .. } => "not-ready",
            Outcome::Retryable { .. } => "failed-retryable",
            Outcome::Permanent { .. } => "failed-permanent",
            Outcome::Ambiguous { .. } => "ambiguous",
        }
    }

    pub fn reason(&self) -> &str {
        match self {
            Outcome::Succeeded(_) => "",
            Outcome::NotReady { reason }
            | Outcome::Retryable { reason }
            | Outcome::Permanent { reason }
            | Outcome::Ambiguous { reason } => reason,
        }
    }
}

/// The result of one operation.
#[derive(Debug, Clone, PartialEq)]
pub struct OperationResult {
    pub run_uid: RunUid,
    pub node: LogicalNodeId,
    pub id: OperationId,
    pub effect: Effect,
    pub outcome: Outcome,
    pub completed_at: UnixMillis,
    /// A completion that arrived after the executor abandoned the operation.
    pub late: bool,
    /// A replay of a recorded result.
    pub replayed: bool,
    pub trace: TraceContext,
}

/// One stage of a bootstrap session, sequenced per session.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    pub run_uid: RunUid,
    pub node: LogicalNodeId,
    pub attempt: AttemptId,
    pub session: SessionId,
    pub seq: u64,
    pub stage: BootstrapStage,
    pub detail: String,
    pub at: UnixMillis,
    pub trace: TraceContext,
}

/// What happened to a resource outside any operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// The resource is gone (its process exited, its machine was deleted).
    Lost { reason: String },
    /// The resource's health probes changed state (or were first answered).
    Health { healthy: bool, detail: String },
}

impl Change {
    pub fn name(&self) -> &'static str {
        match self {
            Change::Lost { .. } => "lost",
            Change::Health { healthy: true, .. } => "healthy",
            Change::Health { healthy: false, .. } => "unhealthy",
        }
    }
}

/// A change the executor saw in a resource it holds, sequenced per run from 1
/// and kept until the driver acknowledges it.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceChange {
    pub run_uid: RunUid,
    pub node: LogicalNodeId,
    pub attempt: AttemptId,
    pub seq: u64,
    pub change: Change,
    pub at: UnixMillis,
    pub trace: TraceContext,
}

/// How to probe a claimed run's resources, per group, sent after every claim
/// and whenever the run's shape changes; it replaces what was sent before. A
/// group not listed (or with `Probe::None`) is not probed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchHealth {
    pub run_uid: RunUid,
    pub epoch: Epoch,
    pub groups: Vec<(GroupId, HealthPolicy)>,
}

/// A driver takes ownership of a run at the executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub run_uid: RunUid,
    pub run_id: RunId,
    pub epoch: Epoch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectionReason {
    /// An epoch lower than the highest seen for the run.
    Fenced,
    /// The same operation id with another effect or input.
    ConflictingInput,
    /// The run has not been claimed at this epoch.
    UnknownRun,
    /// The message could not be understood.
    Invalid,
}

impl RejectionReason {
    pub fn name(self) -> &'static str {
        match self {
            RejectionReason::Fenced => "fenced",
            RejectionReason::ConflictingInput => "conflicting-input",
            RejectionReason::UnknownRun => "unknown-run",
            RejectionReason::Invalid => "invalid",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub run_uid: RunUid,
    /// `None` for a rejected claim.
    pub id: Option<OperationId>,
    pub reason: RejectionReason,
    pub message: String,
    pub highest_epoch: Epoch,
}

/// Whether a provider is compiled into the executor or reached as a plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderKind {
    Builtin,
    Plugin,
}

impl ProviderKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Builtin => "builtin",
            ProviderKind::Plugin => "plugin",
        }
    }
}

/// A provider an executor serves, as it tells its drivers (SPEC.md section
/// 10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedProvider {
    /// The `provider.name` node templates choose it by.
    pub name: String,
    pub kind: ProviderKind,
    /// False while its plugin cannot be reached.
    pub available: bool,
    pub reports_health: bool,
    pub reports_loss: bool,
    /// Where the plugin is reached, and what it says of itself.
    pub detail: String,
}
