//! The executor service: provider I/O, operation dedup, adoption and bootstrap
//! observation streams.
//!
//! The logic is sans-IO. [`core`] holds the executor's deterministic state machine
//! (epoch fencing, the `(RunUid, OperationId)` dedup table, at most one running
//! operation per attempt, deadlines, unacknowledged results and sequenced
//! bootstrap observations); it takes `now` as an argument and returns what to do
//! as values. [`fake`] is the seeded in-memory provider used by simulations and
//! tests. Neither reads a clock nor depends on tokio: the async shell, the
//! backends that do real I/O and the gRPC service wrap them.

#![forbid(unsafe_code)]

pub mod core;
pub mod fake;
