//! The `node-agent` binary: one leased node of the process backend. It only
//! parses flags, sets up logging and runs [`executor_svc::process::agent::run`]
//! until SIGTERM or SIGINT; see that module for what an agent does.

#![forbid(unsafe_code)]

use std::{path::PathBuf, time::Duration};

use anyhow::Context as _;
use clap::Parser;
use contract::{AttemptId, LogicalNodeId, ResourceIdentity, RunId, RunUid};
use executor_svc::process::agent::{self, AgentConfig};
use platform::runtime::{init_logging, shutdown_signal};

/// A node agent: binds a TCP endpoint and streams a bootstrap session.
#[derive(Debug, Parser)]
#[command(name = "node-agent", version, about)]
struct Cli {
    /// The run's uid (32 hex digits).
    #[arg(long)]
    run_uid: String,
    #[arg(long)]
    run_id: String,
    /// The logical node, `{group}-{index}`.
    #[arg(long)]
    node: String,
    #[arg(long)]
    attempt: u64,
    /// Where the agent records its identity, endpoint and session.
    #[arg(long)]
    state_dir: PathBuf,
    /// Bind the endpoint this long after starting.
    #[arg(long, default_value_t = 0)]
    endpoint_delay_ms: u64,
    /// Time between bootstrap stages unless the boot parameters say otherwise.
    #[arg(long, env = "NODE_AGENT_STAGE_DELAY_MS", default_value_t = 20)]
    stage_delay_ms: u64,
    /// Log as JSON lines.
    #[arg(long, env = "PROVISIONING_LOG_JSON", value_parser = clap::builder::BoolishValueParser::new(), default_value_t = false)]
    log_json: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_json);
    let identity = ResourceIdentity {
        run_uid: RunUid::parse("--run-uid", &cli.run_uid)?,
        run_id: RunId::parse("--run-id", &cli.run_id)?,
        node: LogicalNodeId::parse("--node", &cli.node)?,
        attempt: AttemptId::new(cli.attempt),
    };
    let config = AgentConfig {
        identity,
        state_dir: cli.state_dir,
        endpoint_delay: Duration::from_millis(cli.endpoint_delay_ms),
        default_stage_delay_ms: cli.stage_delay_ms,
    };
    agent::run(config, shutdown_signal())
        .await
        .context("the node agent failed")
}
