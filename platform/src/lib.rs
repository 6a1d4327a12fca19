//! What the three service binaries (and provisionctl) share around the
//! contract: the service platform.
//!
//! Flags and startup ([`runtime`], with the ready file in [`announce`]); tracing, trace propagation and logs
//! ([`telemetry`]); the Prometheus registry with its endpoint ([`metrics`]);
//! the event trace tests read across processes ([`event_trace`]); TLS with the
//! peer-identity rule ([`tls`], and with `certgen` a development CA in
//! [`tls::dev`]); calls spread over a name's replicas ([`balance`]). With `secrets`, sealing secret parameter values at rest
//! ([`secrets`]); with `token`, the bearer-token format the driver and its
//! clients share ([`token`]).
//!
//! The domain types and the wire live in the contract crate; nothing here
//! decides anything.

#![forbid(unsafe_code)]

pub mod announce;
pub mod balance;
pub mod event_trace;
pub mod metrics;
pub mod runtime;
pub mod telemetry;
pub mod tls;

#[cfg(feature = "secrets")]
pub mod secrets;

#[cfg(feature = "token")]
pub mod token;

/// What [`operation_span!`] names from the caller's crate.
#[doc(hidden)]
pub mod __macro {
    pub use contract::Operation;
    pub use tracing;
}
