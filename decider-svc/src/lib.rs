//! The decider as a gRPC service: a stateless shell around the pure `decider`
//! crate, plus the client the driver uses to call it.
//!
//! [`server`] answers `provisioning.internal.v1.Decider/Decide`. A call is a bidirectional
//! stream: the driver sends a header (desired shape, `now`, template table), node
//! batches, slot batches and `end`; the service decodes each node as it arrives,
//! decides it at once with [`decider::decide_node`] and streams decision batches
//! back, then the inserts for missing slots and a summary. Nothing is kept between
//! calls and no message grows with the run, so a 100,000-node pass fits tonic's
//! default 4 MiB message limit in both directions. [`server::run`] serves it with
//! standard health checking and reflection.
//!
//! [`client`] is the other end: [`client::encode_call`] turns the driver's
//! domain values into a call, and [`client::decide_call`] streams it (the
//! slots as ranges when the decider's response headers say it reads them) and
//! collects the answer into a [`contract::DecideOutput`] equal to what
//! [`decider::decide`] returns in-process for the same input.

#![forbid(unsafe_code)]

pub mod client;
mod codec;
pub mod route;
pub mod server;

pub use client::{
    DecideCall, DecideError, DeciderChannel, SlotEncoding, decide, decide_call, encode_call, encode_request,
    encode_request_with_counts,
};
pub use server::{CallError, Config, DeciderService, SLOT_RANGES_HEADER, run, serve};
