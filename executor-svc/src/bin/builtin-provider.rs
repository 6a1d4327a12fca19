//! `builtin-provider`: the executor's built-in backends (`fake`, `process`)
//! served as a provider plugin over the provider protocol, for an executor
//! that hosts them out of process (`executor-svc --backend none
//! --plugin-command "builtin-provider --backend process"`) and for the
//! provider conformance kit. Prints `provider-listening <address>` once it
//! listens; ends on SIGTERM or SIGINT.

#![forbid(unsafe_code)]

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use contract::{Clock, SystemClock};
use executor_svc::{
    backend::Backend,
    fake::{FakeConfig, FaultRates, parse_latency},
    fake_backend::FakeBackend,
    hosted::{BackendProvider, FakeTesting, ProcessTesting},
    process::{ProcessBackend, ProcessConfig},
};
use provider_sdk::ServeArgs;

/// A built-in backend of the executor, served as a provider plugin.
#[derive(Debug, Parser)]
#[command(name = "builtin-provider", version, about)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
    /// Which backend to serve.
    #[arg(long, env = "PROVIDER_BACKEND", value_enum, default_value_t = Kind::Fake)]
    backend: Kind,
    /// The provider name it serves (default: the backend's, `fake` or
    /// `process`).
    #[arg(long, env = "PROVIDER_NAME")]
    name: Option<String>,
    /// How often every held resource is probed for the health it reports.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(10..))]
    health_interval_ms: u64,
    /// The fake backend keeps its resources in this file, so they outlive a
    /// restart of the plugin.
    #[arg(long)]
    fake_state_file: Option<PathBuf>,
    /// Seed of the fake backend's faults and latency.
    #[arg(long, default_value_t = 0)]
    fake_seed: u64,
    /// Latency of one fake call, uniform between MIN and MAX milliseconds.
    #[arg(long, value_name = "MIN,MAX", default_value = "1,5", value_parser = parse_latency)]
    fake_latency_ms: (u64, u64),
    /// Time between a fake bootstrap's stages.
    #[arg(long, default_value_t = 10)]
    fake_stage_interval_ms: u64,
    /// Frequent recoverable faults of every kind, seeded.
    #[arg(long)]
    fake_chaos: bool,
    /// The process backend keeps one directory per node agent under this
    /// root, and adopts the agents it finds there when it starts again.
    #[arg(long)]
    process_state_dir: Option<PathBuf>,
    /// The node agent binary (default: `node-agent` next to this one).
    #[arg(long)]
    node_agent_path: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Kind {
    Fake,
    Process,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    platform::runtime::exit_code(run().await)
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    platform::runtime::init_logging(cli.serve.log_json);
    let options = cli.serve.options()?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let (name, backend, testing): (&str, Arc<dyn Backend>, Arc<dyn provider_sdk::Testing>) = match cli.backend
    {
        Kind::Fake => {
            let config = FakeConfig {
                seed: cli.fake_seed,
                faults: if cli.fake_chaos {
                    FaultRates::chaos()
                } else {
                    FaultRates::none()
                },
                latency_ms: cli.fake_latency_ms,
                endpoint_delay_ms: 0,
                stage_interval_ms: cli.fake_stage_interval_ms,
            };
            let fake = FakeBackend::start(config, cli.fake_state_file.clone(), Arc::clone(&clock))
                .context("starting the fake backend")?;
            ("fake", Arc::new(fake.clone()), Arc::new(FakeTesting(fake)))
        }
        Kind::Process => {
            let agent = match cli.node_agent_path.clone() {
                Some(p) => p,
                None => ProcessConfig::agent_next_to_current_exe().context("locating the node agent")?,
            };
            let dir = cli
                .process_state_dir
                .clone()
                .unwrap_or_else(ProcessConfig::default_state_dir);
            let backend = ProcessBackend::start(ProcessConfig::new(dir, agent), Arc::clone(&clock))
                .context("starting the process backend")?;
            (
                "process",
                Arc::new(backend.clone()),
                Arc::new(ProcessTesting(backend)),
            )
        }
    };
    let name = cli.name.as_deref().unwrap_or(name);
    let provider = BackendProvider::new(
        name,
        &format!("the executor's {name} backend, served as a plugin"),
        backend,
        clock,
    )
    .with_health_interval(Duration::from_millis(cli.health_interval_ms))
    .with_testing(testing);
    provider_sdk::serve(provider, options, platform::runtime::shutdown_signal()).await?;
    Ok(())
}
