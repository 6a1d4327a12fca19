//! The `executor-svc` binary: flags, logging, the chosen backend, and the gRPC
//! server until SIGTERM or SIGINT.

#![forbid(unsafe_code)]

use std::{path::PathBuf, sync::Arc};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use contract::{
    Clock, SystemClock,
    runtime::{CommonArgs, bind_and_announce, init_logging, shutdown_signal},
};
use executor_svc::{
    backend::Backend,
    fake::{FakeConfig, FaultRates},
    fake_backend::FakeBackend,
    server::{self, Config},
};

/// The executor: runs provider operations for drivers, deduplicated and fenced.
#[derive(Debug, Parser)]
#[command(name = "executor-svc", version, about)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    /// Which provider backend runs the operations.
    #[arg(long, env = "EXECUTOR_BACKEND", value_enum, default_value_t = BackendKind::Fake)]
    backend: BackendKind,
    /// Messages queued for one driver link before it counts as stuck and is closed.
    #[arg(long, env = "EXECUTOR_LINK_BUFFER", default_value_t = 4096)]
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    /// In memory, seeded faults, virtual latency.
    Fake,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Faults {
    None,
    /// Frequent recoverable faults of every kind.
    Chaos,
}

/// Parses `MIN,MAX` (or a single `N` for a fixed latency).
fn parse_latency(s: &str) -> Result<(u64, u64), String> {
    let number = |part: &str| {
        part.trim()
            .parse::<u64>()
            .map_err(|e| format!("{part:?} is not a number of milliseconds: {e}"))
    };
    let (min, max) = match s.split_once(',') {
        Some((min, max)) => (number(min)?, number(max)?),
        None => {
            let n = number(s)?;
            (n, n)
        }
    };
    if min > max {
        return Err(format!("the minimum {min} is above the maximum {max}"));
    }
    Ok((min, max))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.common.log_json);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let backend: Arc<dyn Backend> = match cli.backend {
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
            Arc::new(
                FakeBackend::start(config, cli.fake_state_file.clone(), Arc::clone(&clock))
                    .context("starting the fake backend")?,
            )
        }
    };
    let listener = bind_and_announce(
        "executor-svc",
        cli.common.listen,
        cli.common.ready_file.as_deref(),
    )
    .await
    .context("binding the listen address")?;
    let config = Config {
        link_buffer: cli.link_buffer,
        shutdown_grace: cli.common.shutdown_grace(),
        ..Config::default()
    };
    server::run(listener, shutdown_signal(), config, backend, clock).await?;
    Ok(())
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
        assert!(matches!(cli, Ok(c) if c.fake_latency_ms == (2, 9) && c.fake_faults == Faults::Chaos));
    }
}
