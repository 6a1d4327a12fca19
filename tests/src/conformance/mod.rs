//! The conformance kit: seeded traces, an oracle for the twenty guarantees of
//! SPEC.md section 6, the day-2 ones of section 8 (21 to 23) and the rollout
//! ones of section 9 (24 and 25; plus no double-create and
//! converged-leaks-nothing), a
//! shrinker, and a battery that runs the same checks over any system under test.
//!
//! # How a seed is checked
//!
//! A seed fixes a [`World`] (initial shape, fake backend configuration, driver
//! policy) and a generated trace: a faulty prefix of [`Input`]s (shape updates
//! valid and invalid, fault rates, forced outcomes, link cuts, replays,
//! resubmissions, conflicting probes, driver restarts, clock jumps, ticks,
//! deletion). The [`runner`] applies the prefix to a system under test, then the
//! fair tail: faults stop, forced outcomes are dropped, the link comes back, and
//! the run must converge to its latest shape within [`TailBound`] passes; a
//! safety tick over the converged run must change nothing; then the run is
//! deleted and must be gone within the same bound, leaving nothing at the backend.
//! After every round the [`oracle`] checks every guarantee. Guarantee 16 replays
//! the trace (same state after every round) and replays it again with the cores
//! applying independent work in reverse order (the same state, attempt ids
//! renamed).
//!
//! # Levels
//!
//! - Level 1 ([`mem`]): the driver's `RunState`, the decider and the executor's
//!   core over the fake provider, in memory on a virtual clock
//!   ([`crate::sim`]), delivering in order or delayed, reordered and duplicated.
//!   Every event is visible, so every guarantee is checked, over rollouts
//!   with surge too (a slot's current attempt and its successor, read in
//!   two views of each transition: [`oracle`]'s `views`).
//! - Level 2 ([`services`]): the three binaries over gRPC, driven through the
//!   public API with the executor's seeded chaos, the link cut through a proxy,
//!   the executor restarted to switch faults, and resources lost, sickened and
//!   healed through the fake's control service. The oracle reads states (the
//!   run's status with every node, and the executor's inventory) and events:
//!   each service writes an event trace (`--event-trace`, JSON lines) that
//!   [`traces`] turns back into the events the in-memory system records, so the
//!   event checks of every guarantee run too. What still cannot be checked
//!   across processes (guarantee 16's replays, guarantee 20's spin and limit
//!   probes, the committed store at rest, conflicting resubmissions, the
//!   backend's inside) is listed in [`services`]; `CONFORMANCE_KEEP_TRACES=<dir>`
//!   keeps a failing seed's traces.
//! - Level 3 ([`services`] with the process backend, `level3_process_backend`):
//!   the level-2 battery with every lease a real `node-agent` process under a
//!   state directory of the seed's own. Faults come from the agents: templates
//!   of the faulty prefix carry `fault.*` boot parameters (crash, fail or hang at
//!   a stage, a delayed endpoint); an executor-fault input either draws new
//!   agent faults (a new generation) or restarts the executor over the live
//!   agents, which it must adopt; `lose`, `sicken` and `heal` kill, stop and
//!   continue an agent; the fair tail applies a new generation with clean
//!   templates. On top of the level-2 checks, no double-create and
//!   converged-leaks-nothing are checked on the OS process table, sampled every
//!   20 ms ([`record::StepRecord::processes`]). Each seed's agents are deleted
//!   through the run, and any left are killed, even after a failure.
//!
//! # Replaying a failure, soaking
//!
//! A failure prints the guarantee, the seed, the round, the shrunk trace and a
//! command that replays it:
//!
//! ```text
//! CONFORMANCE_SEED=5 CONFORMANCE_DELIVERY=in-order CONFORMANCE_TRACE='step*20 conflict:0' \
//!     cargo test -p provisioning-tests --test conformance replay -- --nocapture
//! ```
//!
//! `CONFORMANCE_DEBUG=1` prints every round (events and every node), and
//! `CONFORMANCE_SHRINK=1` shrinks a replayed trace further. The printed
//! `check_trace(seed, Delivery::…, "…")` line is a regression test to paste into
//! `tests/tests/conformance.rs`.
//!
//! `CONFORMANCE_SEEDS=5000` runs a soak at level 1 (256 seeds per delivery mode
//! by default), `CONFORMANCE_L2_SEEDS` sets level 2's seed count (8 by default),
//! `CONFORMANCE_L3_SEEDS` level 3's (16 by default),
//! and `CONFORMANCE_KEEP_GOING=1` lists every failing seed instead of stopping at
//! the first (for triage; `CONFORMANCE_SKIP_INPUTS=conflict,advance` drops input
//! kinds from generated traces while a known bug is being fixed).
//!
//! # Layout
//!
//! - [`input`]: the input alphabet of a trace and its replayable text form;
//! - [`world`]: what a seed fixes besides the trace, how shape inputs become
//!   shapes, the generator;
//! - [`record`]: what a system reports after each round;
//! - [`oracle`]: one named check per guarantee, and the fair tail's bound;
//! - [`runner`]: the [`runner::SystemUnderTest`] seam, one trace with its fair
//!   tail, guarantee 16's replays, the battery, failure reports;
//! - [`shrink`]: delta debugging over a failing trace's inputs;
//! - [`mutants`]: deliberately broken variants that the oracle must catch;
//! - [`mem`] and [`services`]: the two systems under test;
//! - [`traces`]: level 2's services' event traces read back as events.

pub mod input;
pub mod mem;
pub mod mutants;
pub mod oracle;
pub mod record;
pub mod runner;
pub mod services;
pub mod shrink;
pub mod traces;
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
