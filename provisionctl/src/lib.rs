//! `provisionctl`, the command-line client of the driver's public API. Its
//! logic is in this library so it can be tested without a terminal or a
//! server; `main.rs` is the thin binary. It depends on the contract (the
//! API's generated client, the token format, TLS) and on nothing of the
//! driver.
//!
//! [`cli`] is the command line; [`commands`] runs each command against the
//! driver's public API; [`complete`] offers run and node names to a shell. What they print comes from pure renderers: [`render`]
//! (runs, nodes, shapes; table, JSON, YAML), [`plan`], [`explain`],
//! [`events`] (a run's event log) and [`watch`] (the live view and its plain
//! form), with [`names`] for the
//! words and [`text`] for layout. [`error`] turns every failure into a
//! sentence about the user's problem and an exit code from one table.
//! [`token`] is the bearer token sent on every call and the `token`
//! commands that make one. [`tls`] is how the client reaches the driver (TLS,
//! or plaintext with `--insecure`) and the `certs` command. [`shapefile`] is
//! the shape-file format (YAML or JSON, with its own error positions).
//!
//! The client never prints a secret: shapes it shows come redacted from the
//! server (and are redacted again here), and a local file is only ever echoed
//! as counts and ids, never as parameter values.

#![forbid(unsafe_code)]

pub mod cli;
pub mod commands;
pub mod complete;
pub mod config;
pub mod error;
pub mod events;
pub mod explain;
pub mod names;
pub mod plan;
pub mod render;
pub mod shapefile;
pub mod text;
pub mod tls;
pub mod token;
pub mod watch;
