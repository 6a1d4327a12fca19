//! Test support shared by the cross-service tests: the in-memory composition of
//! the three cores on a virtual clock ([`sim`]) shape builders ([`shapes`]), and the real binaries as processes ([`procs`]).

#![forbid(unsafe_code)]

pub mod procs;
pub mod shapes;
pub mod sim;
