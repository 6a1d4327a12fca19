//! The executor service: provider I/O, operation dedup, adoption and bootstrap
//! observation streams.
//!
//! The logic is sans-IO. [`core`] holds the executor's deterministic state machine
//! (epoch fencing, the `(RunUid, OperationId)` dedup table, at most one running
//! operation per attempt, deadlines, unacknowledged results and sequenced
//! bootstrap observations); it takes `now` as an argument and returns what to do
//! as values. [`fake`] is the seeded in-memory provider used by simulations and
//! tests. Neither reads a clock nor depends on tokio.
//!
//! The async shell wraps them: [`backend`] is the trait a provider backend
//! implements (run one operation, stream bootstrap stages, list resources),
//! [`fake_backend`] puts the fake provider behind it (with real latency and an
//! optional state file), [`fake_control`] is its control service for tests
//! that drive the binaries (a test double, served only on request),
//! [`process`] is the real backend in which each lease is
//! a node-agent child process with a TCP endpoint (the `node-agent` binary is
//! its agent), and [`server`] is the gRPC service, in which one actor
//! task owns the core and folds events from driver links, backend calls and
//! timers; [`durable`] keeps what must survive an executor restart (fencing
//! epochs, retired attempts, completed results). The `executor-svc` binary only parses flags and calls
//! [`server::run`].

#![forbid(unsafe_code)]

pub mod backend;
pub mod budget;
pub mod core;
pub mod durable;
pub mod fake;
pub mod fake_backend;
pub mod fake_control;
pub mod health;
pub mod hosted;
pub mod plugin;
pub mod process;
pub mod providers;
pub mod retired;
pub mod server;
