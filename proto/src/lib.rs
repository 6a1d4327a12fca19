//! The contract between the provisioning services.
//!
//! Plain-Rust domain types live at the top: identities ([`ids`]), the desired
//! shape and its validation ([`shape`]), the observed state ([`state`]), decisions
//! ([`decision`]), the run's event log ([`events`]), what crosses the
//! driver–executor link ([`ops`]), time as a value ([`time`]) and the one
//! backoff function ([`backoff`]); they depend on nothing
//! but `thiserror`. With the `wire` feature (on by default) the crate also
//! carries the protos' generated code ([`pb`]: the public `provisioning.v1`,
//! the internal `provisioning.internal.v1` beside it; the fake
//! backend's control service, a test double, in `pb::fake`) and the
//! `TryFrom` conversions between wire and domain types ([`wire`]); the pure
//! decider and the driver core use the crate without it, so they link neither
//! tonic nor prost. What the service binaries share around it (startup,
//! telemetry, metrics, TLS, secrets, tokens) is the `provisioning-platform`
//! crate (`platform/`); the fuzz entry points are `provisioning-fuzz-harness`
//! (`tests/fuzz-harness/`).

#![forbid(unsafe_code)]

pub mod backoff;
pub mod decision;
pub mod error;
pub mod events;
pub mod health;
pub mod ids;
pub mod labels;
pub mod ops;
pub mod rollout;
pub mod shape;
pub mod state;
pub mod time;

#[cfg(feature = "wire")]
pub mod pages;
#[cfg(feature = "wire")]
pub mod wire;

/// Metadata keys of the public API's answers.
#[cfg(feature = "wire")]
pub mod metadata {
    /// The address of the replica that serves a run, on a
    /// `FAILED_PRECONDITION` from a replica that does not; clients follow it.
    pub const OWNER_ADDRESS: &str = "provisioning-owner-address";
    /// That replica's owner id.
    pub const OWNER_ID: &str = "provisioning-owner-id";
}

/// Generated code: the public API (`provisioning.v1`) at the top, with the
/// services' internal protocols (`provisioning.internal.v1`) re-exported
/// beside it, so that the services name both as `pb::...`.
#[cfg(feature = "wire")]
#[allow(clippy::all, missing_debug_implementations, missing_docs)]
pub mod pb {
    tonic::include_proto!("provisioning.v1");

    /// The decider's and the executor's protocols (`provisioning.internal.v1`):
    /// no client calls them. The generated code names `provisioning.v1` types
    /// as `super::super::v1`.
    pub mod internal {
        pub mod v1 {
            tonic::include_proto!("provisioning.internal.v1");
        }
    }
    pub use internal::v1::*;

    /// The driver's durable records (`provisioning.store.v1`).
    pub mod store {
        pub mod v1 {
            tonic::include_proto!("provisioning.store.v1");
        }
    }

    /// `provisioning.v1` under its package path, for generated code in sibling
    /// packages.
    pub mod v1 {
        pub use super::*;
    }

    /// The encoded descriptor set, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptor.bin"));

    /// The fake backend's control service (`provisioning.fake.v1`): a test
    /// double an executor serves only with `--backend fake --fake-control`;
    /// not in [`FILE_DESCRIPTOR_SET`].
    pub mod fake {
        pub mod v1 {
            tonic::include_proto!("provisioning.fake.v1");
        }
    }

    /// The provider plugin protocol (`provisioning.provider.v1`, SPEC.md
    /// section 10): what a provider plugin serves and the executor calls.
    /// Versioned apart from the services' protocol.
    pub mod provider {
        pub mod v1 {
            tonic::include_proto!("provisioning.provider.v1");

            /// The encoded descriptor set of the provider protocol, for a
            /// plugin's gRPC server reflection.
            pub const FILE_DESCRIPTOR_SET: &[u8] =
                include_bytes!(concat!(env!("OUT_DIR"), "/provider_descriptor.bin"));
        }
    }
}

pub use backoff::{BackoffPolicy, backoff_delay};
pub use decision::{Action, DecideOutput, Decision, Rule};
pub use error::{FieldError, Problem};
pub use events::{Event, EventReason, Subject};
pub use health::{Budget, GroupCounts, GroupPolicy, HealthPolicy, NodeHealth, Probe, RemediationPolicy};
pub use ids::{
    AttemptId, Endpoint, Epoch, Generation, GroupId, GroupInterner, LeaseId, LogicalNodeId, OperationId,
    RunId, RunUid, SessionId,
};
pub use ops::{
    Change, Claim, InventoryResource, Observation, Operation, OperationInput, OperationResult, Outcome,
    ProviderKind, Rejection, RejectionReason, ResourceChange, ResourceIdentity, ResultFacts, ServedProvider,
    TraceContext, WatchHealth,
};
pub use rollout::RolloutPolicy;
pub use shape::{
    Accelerator, ClusterShape, NodeGroup, NodeTemplate, Param, Params, ProviderShape, ShapeLimits,
};
pub use state::{
    BootstrapProgress, BootstrapStage, Effect, Failure, Intent, ManagedNode, NodeFacts, NodeStage, PendingOp,
    PermanentFailure, RetryState, Surge,
};
pub use time::{Clock, ClockSaturated, ManualClock, Monotonic, StepWatch, SystemClock, UnixMillis};
