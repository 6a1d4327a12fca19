//! The driver: the sole writer of every run's state.
//!
//! [`core`] is the sans-IO state machine of one run ([`core::RunState`]): shape
//! updates under the revision contract, passes (plan → decide → record →
//! commit → submit), folding of results, observations and deadlines. The async
//! shell that drives it over gRPC builds on it.

#![forbid(unsafe_code)]

pub mod core;
