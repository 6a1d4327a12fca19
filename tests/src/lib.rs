//! Test support shared by the cross-service tests: the in-memory composition of
//! the three cores on a virtual clock ([`sim`]), shape builders ([`shapes`]), the
//! real binaries as processes ([`procs`]), and the conformance kit that runs one
//! oracle over both ([`conformance`]); [`auth`] makes tokens and clients for
//! a driver that authenticates its callers.

#![forbid(unsafe_code)]

pub mod auth;
pub mod conformance;
pub mod procs;
pub mod shapes;
pub mod sim;
