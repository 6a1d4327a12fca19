//! Test support shared by the cross-service tests: the in-memory composition of
//! the three cores on a virtual clock ([`sim`]) and shape builders ([`shapes`]).

#![forbid(unsafe_code)]

pub mod shapes;
pub mod sim;
