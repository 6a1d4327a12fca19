//! Test support shared by the cross-service tests: the in-memory composition of
//! the three cores on a virtual clock ([`sim`]), shape builders ([`shapes`]), the
//! real binaries as processes ([`procs`]), and the conformance kit that runs one
//! oracle over both ([`conformance`]); [`auth`] makes tokens and clients for
//! a driver that authenticates its callers; [`kit`] is the provider
//! conformance kit's seam contracts (`provider-conformance`); with the `etcd`
//! feature, `etcd` runs a real etcd for the driver replicas' tests.

#![forbid(unsafe_code)]

pub mod auth;
pub mod conformance;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod kit;
pub mod netns;
pub mod procs;
pub mod shapes;
pub mod sim;
