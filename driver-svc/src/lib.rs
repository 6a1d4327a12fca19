//! The driver: the sole writer of every run's state, and the public API.
//!
//! [`core`] is the sans-IO state machine of one run ([`core::RunState`]): shape
//! updates under the revision contract, passes (plan → decide → record →
//! commit → submit), folding of results, observations and deadlines. Around it:
//! [`actor`] runs one single-writer task per run, given a `RunContext`
//! (the store, clock, link, decider and policy every actor shares);
//! [`driver`] is the registry of runs; [`error`] is what a request fails
//! with; [`metrics`] the driver's metrics; [`link`] keeps the stream to the executor; [`api`] serves clients;
//! [`orphans`] keeps the orphan report and runs the orphan sweep;
//! [`status`] builds what clients read; [`server`] assembles it all;
//! [`crash`] holds the named crash points crash tests arm.
//! [`auth`] authenticates and authorizes the API's callers and [`limits`]
//! bounds what they may ask of it (rates, concurrency, deadlines, watches).

#![forbid(unsafe_code)]

pub mod actor;
pub mod admission;
pub mod api;
pub mod auth;
pub use driver_core as core;
mod context;
pub mod crash;
pub mod driver;
pub mod durable;
pub mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
mod events;
pub mod group_commit;
pub mod limits;
pub mod link;
pub mod metrics;
pub mod orphans;
pub mod replicas;
pub mod server;
pub mod status;
