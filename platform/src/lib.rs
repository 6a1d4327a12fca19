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

/// An error and the errors under it, as one line (a transport error's own
/// text says little: "h2 protocol error: error reading a body from
/// connection" hides whether the peer reset the stream or went away).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

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
