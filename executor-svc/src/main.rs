//! The `executor-svc` binary: flags, logging, the chosen backend, and the gRPC
//! server until SIGTERM or SIGINT.

#![forbid(unsafe_code)]

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use contract::{Clock, SystemClock};
use executor_svc::{
    backend::Backend,
    fake::{FakeConfig, FaultRates, parse_latency},
    fake_backend::FakeBackend,
    plugin::{PluginBackend, PluginConfig, PluginTarget},
    process::{ProcessBackend, ProcessConfig},
    providers::Providers,
    server::{self, Config},
};
use platform::{
    runtime::{CommonArgs, bind_and_announce, init_telemetry, shutdown_signal},
    tls::{PeerArgs, PeerPolicy},
};

/// jemalloc rather than glibc's malloc: see docs/profile-notes.md, "The
/// allocator".
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The executor: runs provider operations for drivers, deduplicated and fenced.
#[derive(Debug, Parser)]
#[command(name = "executor-svc", version, about)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    peers: PeerArgs,
    /// The provider built into the executor, served under its own name
    /// (`fake` or `process`, which node templates choose by
    /// `provider.name`); `none` serves plugins only.
    #[arg(long, env = "EXECUTOR_BACKEND", value_enum, default_value_t = BackendKind::Fake)]
    backend: BackendKind,
    /// A provider plugin that is already running, at `unix:/path` or
    /// `host:port` (over TCP with the same TLS settings as the executor's
    /// own clients). Repeat for several; the plugin's `GetInfo` names the
    /// providers it serves.
    #[arg(
        long = "plugin",
        env = "EXECUTOR_PLUGINS",
        value_delimiter = ',',
        value_name = "ADDRESS"
    )]
    plugins: Vec<String>,
    /// A provider plugin the executor starts (`sh -c COMMAND`) and
    /// supervises: it must print `provider-listening <address>` on its
    /// standard output once it listens; it is health-checked and started
    /// again with backoff when it exits or stops answering. Repeat for
    /// several.
    #[arg(long = "plugin-command", value_name = "COMMAND")]
    plugin_commands: Vec<String>,
    /// How long the executor waits at start for each plugin to answer (a
    /// command's, to announce its address too) before it refuses to start.
    #[arg(long, env = "EXECUTOR_PLUGIN_START_TIMEOUT_MS", default_value_t = 30_000)]
    plugin_start_timeout_ms: u64,
    /// How often each plugin is asked whether it answers (`GetInfo`); three
    /// checks failed in a row take it down (its operations wait) and, for a
    /// supervised one, restart it.
    #[arg(long, env = "EXECUTOR_PLUGIN_HEALTH_INTERVAL_MS", default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(10..))]
    plugin_health_interval_ms: u64,
    /// Messages queued for one driver link before it counts as stuck and is
    /// closed. Large: a run of many nodes sends results in bursts, and closing a
    /// busy link only makes the driver reconnect and ask for them again.
    #[arg(long, env = "EXECUTOR_LINK_BUFFER", default_value_t = 1 << 20)]
    link_buffer: usize,
    /// The fake backend keeps its resources in this file, so they outlive a restart.
    #[arg(long, env = "EXECUTOR_FAKE_STATE_FILE")]
    fake_state_file: Option<PathBuf>,
    /// Seed of the fake backend's fault injection and latency.
    #[arg(long, env = "EXECUTOR_FAKE_SEED", default_value_t = 0)]
    fake_seed: u64,
    /// Latency of one fake call, uniform between MIN and MAX milliseconds.
    #[arg(long, env = "EXECUTOR_FAKE_LATENCY_MS", value_name = "MIN,MAX", default_value = "1,5",
          value_parser = parse_latency)]
    fake_latency_ms: (u64, u64),
    /// A fake lease's endpoint becomes ready this long after the lease is created.
    #[arg(long, env = "EXECUTOR_FAKE_ENDPOINT_DELAY_MS", default_value_t = 0)]
    fake_endpoint_delay_ms: u64,
    /// Time between a fake bootstrap's stages.
    #[arg(long, env = "EXECUTOR_FAKE_STAGE_INTERVAL_MS", default_value_t = 10)]
    fake_stage_interval_ms: u64,
    /// Faults the fake backend injects.
    #[arg(long, env = "EXECUTOR_FAKE_FAULTS", value_enum, default_value_t = Faults::None)]
    fake_faults: Faults,
    /// Serve the fake backend's control service (FakeControl: lose, sicken or
    /// heal one fake resource on request), for tests that drive the binaries.
    /// A test double: only with `--backend fake`.
    #[arg(long, env = "EXECUTOR_FAKE_CONTROL")]
    fake_control: bool,
    /// The process backend keeps one directory per node agent under this root;
    /// an executor started over the same root adopts the agents it finds.
    /// Defaults to a directory under the system's temporary directory.
    #[arg(long, env = "EXECUTOR_PROCESS_STATE_DIR")]
    process_state_dir: Option<PathBuf>,
    /// The node agent binary. Defaults to `node-agent` next to this executable.
    #[arg(long, env = "EXECUTOR_NODE_AGENT_PATH")]
    node_agent_path: Option<PathBuf>,
    /// How long a destroyed node agent gets between SIGTERM and SIGKILL.
    #[arg(long, env = "EXECUTOR_PROCESS_KILL_GRACE_MS", default_value_t = 2000)]
    process_kill_grace_ms: u64,
    /// Keep fencing epochs and completed results here, so that after an
    /// executor restart an old driver stays fenced and a resubmitted operation
    /// is replayed rather than run again. Without it they are kept in memory.
    #[arg(long, env = "EXECUTOR_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// A key file (32 bytes, raw or 64 hex digits, mode 600) that opens the
    /// secret parameter values earlier executors sealed in the state
    /// directory (they kept an operation's input until its result was
    /// acknowledged). This one writes no parameter value there: a completed
    /// operation is kept as its input's digest and its result.
    #[arg(long, env = "EXECUTOR_SECRETS_KEY_FILE")]
    secrets_key_file: Option<PathBuf>,
    /// At most this many backend calls in flight at once (the provider's
    /// budget); more wait their turn. Unset: no cap.
    #[arg(long, env = "EXECUTOR_BUDGET_INFLIGHT", value_parser = clap::value_parser!(u64).range(1..))]
    budget_inflight: Option<u64>,
    /// At most this many backend calls started per second (the provider's
    /// budget). Unset: no cap.
    #[arg(long, env = "EXECUTOR_BUDGET_RATE", value_parser = positive_rate)]
    budget_rate: Option<f64>,
    /// At most this many backend calls of one run in flight at once.
    #[arg(long, env = "EXECUTOR_RUN_BUDGET_INFLIGHT", value_parser = clap::value_parser!(u64).range(1..))]
    run_budget_inflight: Option<u64>,
    /// At most this many backend calls of one run started per second.
    #[arg(long, env = "EXECUTOR_RUN_BUDGET_RATE", value_parser = positive_rate)]
    run_budget_rate: Option<f64>,
}

/// A rate in calls per second: a finite number above zero.
fn positive_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("{s}: a rate is a number of calls per second above zero")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    /// In memory, seeded faults, virtual latency.
    Fake,
    /// Each lease is a node-agent child process with a TCP endpoint.
    Process,
    /// No built-in provider: only plugins (`--plugin`, `--plugin-command`).
    None,
}

impl BackendKind {
    /// The `provider.name` the built-in is served under.
    fn provider_name(self) -> Option<&'static str> {
        match self {
            BackendKind::Fake => Some("fake"),
            BackendKind::Process => Some("process"),
            BackendKind::None => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Faults {
    None,
    /// Frequent recoverable faults of every kind.
    Chaos,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    platform::runtime::exit_code(serve_until_stopped().await)
}

async fn serve_until_stopped() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let telemetry = init_telemetry("executor-svc", &cli.common)?;
    let transport = cli.common.transport("executor-svc")?;
    let peers = PeerPolicy::new(transport.clone(), cli.peers.identities());
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    if cli.fake_control && cli.backend != BackendKind::Fake {
        anyhow::bail!("--fake-control controls the fake backend: it needs --backend fake");
    }
    let mut fake_control = None;
    let builtin: Option<Arc<dyn Backend>> = match cli.backend {
        BackendKind::Fake => {
            let config = FakeConfig {
                seed: cli.fake_seed,
                faults: match cli.fake_faults {
                    Faults::None => FaultRates::none(),
                    Faults::Chaos => FaultRates::chaos(),
                },
                latency_ms: cli.fake_latency_ms,
                endpoint_delay_ms: cli.fake_endpoint_delay_ms,
                stage_interval_ms: cli.fake_stage_interval_ms,
            };
            let fake = FakeBackend::start(config, cli.fake_state_file.clone(), Arc::clone(&clock))
                .context("starting the fake backend")?;
            if cli.fake_control {
                tracing::warn!("serving the fake backend's control service (a test double)");
                fake_control = Some(fake.clone());
            }
            Some(Arc::new(fake))
        }
        BackendKind::Process => {
            let agent_path = match cli.node_agent_path.clone() {
                Some(path) => path,
                None => ProcessConfig::agent_next_to_current_exe()
                    .context("locating the node agent next to the executor")?,
            };
            let state_dir = cli
                .process_state_dir
                .clone()
                .unwrap_or_else(ProcessConfig::default_state_dir);
            let config = ProcessConfig {
                kill_grace: Duration::from_millis(cli.process_kill_grace_ms),
                ..ProcessConfig::new(state_dir, agent_path)
            };
            let backend =
                ProcessBackend::start(config, Arc::clone(&clock)).context("starting the process backend")?;
            tracing::info!(state_dir = %backend.state_dir().display(), "process backend ready");
            Some(Arc::new(backend))
        }
        BackendKind::None => None,
    };
    let mut host = Providers::builder();
    if let (Some(backend), Some(name)) = (builtin, cli.backend.provider_name()) {
        host = host.builtin(name, backend);
    }
    let targets = cli
        .plugins
        .iter()
        .map(|a| PluginTarget::Address(a.clone()))
        .chain(
            cli.plugin_commands
                .iter()
                .map(|c| PluginTarget::Command(c.clone())),
        );
    for target in targets {
        let config = PluginConfig {
            start_timeout: Duration::from_millis(cli.plugin_start_timeout_ms),
            health_interval: Duration::from_millis(cli.plugin_health_interval_ms),
            ..PluginConfig::new(target, transport.clone())
        };
        let plugin = PluginBackend::start(config, Arc::clone(&clock))
            .await
            .context("starting a provider plugin")?;
        host = host.plugin(plugin);
    }
    let providers = host.build()?;
    let backend: Arc<dyn Backend> = Arc::new(providers.clone());
    let listener = bind_and_announce(
        "executor-svc",
        cli.common.listen,
        cli.common.ready_file.as_deref(),
    )
    .await
    .with_context(|| format!("binding {}", cli.common.listen))?;
    let secrets = match &cli.secrets_key_file {
        Some(path) => platform::secrets::Sealer::new(Some(
            platform::secrets::SecretKey::load(path).context("loading the secrets key")?,
        )),
        None => platform::secrets::Sealer::default(),
    };
    let config = Config {
        link_buffer: cli.link_buffer,
        shutdown_grace: cli.common.shutdown_grace(),
        messages: cli.common.messages,
        state_dir: cli.state_dir.clone(),
        peers,
        secrets,
        budget: executor_svc::budget::BudgetConfig {
            inflight: cli
                .budget_inflight
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            rate: cli.budget_rate,
            run_inflight: cli
                .run_budget_inflight
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            run_rate: cli.run_budget_rate,
        },
        fake_control,
        providers: Some(providers.served()),
        ..Config::default()
    };
    let grace = config.shutdown_grace;
    let result = server::run(listener, shutdown_signal(), config, backend, clock).await;
    // Supervised plugins are ended (SIGTERM, then SIGKILL) with the executor.
    providers.shutdown(grace).await;
    // Spans of the last operations are exported before the process ends.
    telemetry.shutdown().await;
    Ok(result?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_ranges_parse() {
        assert_eq!(parse_latency("1,5"), Ok((1, 5)));
        assert_eq!(parse_latency(" 7 , 7 "), Ok((7, 7)));
        assert_eq!(parse_latency("20"), Ok((20, 20)));
        assert!(parse_latency("5,1").is_err());
        assert!(parse_latency("a,1").is_err());
        assert!(parse_latency("").is_err());
    }

    #[test]
    fn the_cli_is_well_formed() {
        use clap::CommandFactory as _;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "executor-svc",
            "--fake-latency-ms",
            "2,9",
            "--fake-faults",
            "chaos",
        ]);
        assert!(
            matches!(cli, Ok(c) if c.fake_latency_ms == (2, 9) && c.fake_faults == Faults::Chaos
            && !c.fake_control)
        );
        let cli = Cli::try_parse_from(["executor-svc", "--fake-control"]);
        assert!(matches!(cli, Ok(c) if c.fake_control && c.backend == BackendKind::Fake));
        let cli = Cli::try_parse_from([
            "executor-svc",
            "--backend",
            "process",
            "--process-state-dir",
            "/tmp/agents",
            "--process-kill-grace-ms",
            "300",
        ]);
        assert!(matches!(cli, Ok(c) if c.backend == BackendKind::Process
            && c.process_state_dir == Some(PathBuf::from("/tmp/agents"))
            && c.process_kill_grace_ms == 300
            && c.node_agent_path.is_none()));
    }
}
