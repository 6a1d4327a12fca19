//! The contract between the provisioning services.
//!
//! Plain-Rust domain types live at the top: identities ([`ids`]), the desired
//! shape and its validation ([`shape`]), the observed state ([`state`]), decisions
//! ([`decision`]), what crosses the driver–executor link ([`ops`]), time as a value
//! ([`time`]) and the one backoff function ([`backoff`]). With the `wire` feature
//! (on by default) the crate also carries the `provisioning.v1` protos' generated
//! code ([`pb`]) and the `TryFrom` conversions between wire and domain types
//! ([`wire`]) (the entry points that fuzz what the services decode are the
//! `provisioning-fuzz-harness` crate, `tests/fuzz-harness/`); the pure decider uses the crate without it, so it links
//! neither tonic nor prost. The `runtime` feature adds what every service binary shares:
//! flags and startup ([`runtime`]), tracing, trace propagation and logs
//! ([`telemetry`]), the Prometheus registry with its endpoint ([`metrics`]) and
//! the event trace tests read across processes ([`event_trace`]), and TLS with
//! the peer-identity rule ([`tls`]). The `token` feature adds the bearer-token
//! format the driver and its clients share ([`token`]).

#![forbid(unsafe_code)]

pub mod backoff;
pub mod decision;
pub mod error;
pub mod ids;
pub mod ops;
pub mod shape;
pub mod state;
pub mod time;

#[cfg(feature = "wire")]
pub mod wire;

#[cfg(feature = "secrets")]
pub mod secrets;

#[cfg(feature = "runtime")]
pub mod event_trace;
#[cfg(feature = "runtime")]
pub mod metrics;
#[cfg(feature = "runtime")]
pub mod runtime;
#[cfg(feature = "runtime")]
pub mod telemetry;
#[cfg(feature = "runtime")]
pub mod tls;

#[cfg(feature = "token")]
pub mod token;

/// Metadata keys of the public API's answers.
#[cfg(feature = "wire")]
pub mod metadata {
    /// The address of the replica that serves a run, on a
    /// `FAILED_PRECONDITION` from a replica that does not; clients follow it.
    pub const OWNER_ADDRESS: &str = "provisioning-owner-address";
    /// That replica's owner id.
    pub const OWNER_ID: &str = "provisioning-owner-id";
}

/// Generated code for `provisioning.v1`.
#[cfg(feature = "wire")]
#[allow(clippy::all, missing_debug_implementations, missing_docs)]
pub mod pb {
    tonic::include_proto!("provisioning.v1");

    /// The driver's durable records (`provisioning.store.v1`). The generated
    /// code names `provisioning.v1` types as `super::super::v1`.
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
}

pub use backoff::{BackoffPolicy, backoff_delay};
pub use decision::{Action, DecideOutput, Decision, Rule};
pub use error::{FieldError, Problem};
pub use ids::{
    AttemptId, Endpoint, Epoch, Generation, GroupId, LeaseId, LogicalNodeId, OperationId, RunId, RunUid,
    SessionId,
};
pub use ops::{
    Claim, Observation, Operation, OperationInput, OperationResult, Outcome, Rejection, RejectionReason,
    ResourceIdentity, ResultFacts, TraceContext,
};
pub use shape::{
    Accelerator, ClusterShape, NodeGroup, NodeTemplate, Param, Params, ProviderShape, ShapeLimits,
};
pub use state::{
    BootstrapProgress, BootstrapStage, Effect, Failure, Intent, ManagedNode, NodeFacts, NodeStage, PendingOp,
    PermanentFailure, RetryState,
};
pub use time::{Clock, ClockSaturated, ManualClock, Monotonic, SystemClock, UnixMillis};
