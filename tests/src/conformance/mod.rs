//! The conformance kit: seeded traces, an oracle for the twenty guarantees of
//! SPEC.md section 6, a shrinker, and a battery that runs over any system under
//! test.
//!
//! Layout:
//! - [`input`]: the input alphabet of a trace and its replayable text form;
//! - [`world`]: what a seed fixes besides the trace (initial shape, fake backend,
//!   policy, delivery mode), how shape inputs become shapes, the generator;
//! - [`record`]: what a system reports after each round;
//! - [`oracle`]: one named check per guarantee, plus no double-create and
//!   converged-leaks-nothing, and the fair tail's pass bound;
//! - [`runner`]: the [`runner::SystemUnderTest`] seam, one trace with its fair
//!   tail, guarantee 16's replays, the battery, failure reports;
//! - [`shrink`]: delta debugging over a failing trace's inputs;
//! - [`mutants`]: deliberately broken variants that the oracle must catch;
//! - [`mem`]: level 1, the cores in memory with the fake backend;
//! - [`services`]: level 2, the three real binaries over gRPC.

pub mod input;
pub mod mem;
pub mod mutants;
pub mod oracle;
pub mod record;
pub mod runner;
pub mod services;
pub mod shrink;
pub mod world;

pub use input::{Input, format_trace, parse_trace};
pub use mutants::Mutant;
pub use oracle::{Guarantee, TailBound, Violation};
pub use runner::{Battery, Failure, RunOutcome, check_explicit, run_battery};
pub use world::World;

/// The message of a caught panic.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}
