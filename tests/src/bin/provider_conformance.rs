//! `provider-conformance`: the provider conformance kit (SPEC.md section 10).
//!
//! ```sh
//! cargo build --workspace --bins
//! target/debug/provider-conformance --plugin "python3 examples/python-provider/provider.py --listen unix:/tmp/p.sock --testing --state-file /tmp/p.json"
//! target/debug/provider-conformance --plugin unix:/run/my-provider.sock --seeds 4
//! ```
//!
//! `--plugin` is an address (`unix:/path`, or `host:port` in plaintext) of a
//! plugin that is running, or a command that starts one (it must print
//! `provider-listening <address>`); the kit can restart a plugin it started,
//! so the restart contract is checked only then. Serve the plugin's testing
//! hooks (the losses and health changes the kit inflicts).
//!
//! First the seam contracts, called directly as an executor would, each
//! printed `PASS`, `FAIL` or `SKIP`; then the guarantee battery (the level-2
//! conformance battery) through the three services, the executor hosting
//! the plugin: seeded traces of applies, rejected updates, link cuts,
//! executor restarts, losses and sickness, checked by the same oracle as the
//! other levels, and a failing trace shrunk before it is printed. Exits 0
//! when everything passed, 1 when anything failed, 2 when the plugin could
//! not be reached.

#![forbid(unsafe_code)]

use std::{process::ExitCode, time::Instant};

use clap::Parser;
use provisioning_tests::{
    conformance::{
        input::format_trace,
        runner::run_sut,
        services::{self, Backend, ServiceSut},
        shrink::shrink,
        world::{Alphabet, generate, prefix_len},
    },
    kit::{self, Plugin, Target},
};

#[derive(Debug, Parser)]
#[command(
    name = "provider-conformance",
    version,
    about = "Checks a provider plugin against the provider protocol's contracts"
)]
struct Cli {
    /// The plugin: `unix:/path` or `host:port` (running), or a command that
    /// starts it.
    #[arg(long)]
    plugin: String,
    /// The provider name to check (default: the first its GetInfo names).
    #[arg(long)]
    provider: Option<String>,
    /// Seeds of the guarantee battery (0: the seam contracts only).
    #[arg(long, default_value_t = 2)]
    seeds: u64,
    /// Runs a failing battery trace may take to shrink it (each starts the
    /// services again).
    #[arg(long, default_value_t = 6)]
    shrink_runs: usize,
    /// Where a plugin the kit starts writes its standard error (default:
    /// the kit's).
    #[arg(long)]
    plugin_log: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("provider-conformance: {e}");
            return ExitCode::from(2);
        }
    };
    let mut plugin = match rt.block_on(Plugin::start(Target::parse(&cli.plugin), cli.plugin_log.clone())) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("provider-conformance: cannot reach the plugin: {e:#}");
            return ExitCode::from(2);
        }
    };
    println!("provider-conformance: the plugin at {}", plugin.address);
    let report = match rt.block_on(kit::run(&mut plugin, cli.provider.as_deref())) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("provider-conformance: {e:#}");
            rt.block_on(plugin.stop());
            return ExitCode::from(2);
        }
    };
    let mut failed = report.failed();
    // The battery needs a provider that answers (GetInfo passed).
    if cli.seeds > 0
        && let Some(provider) = &report.provider
    {
        failed |= !battery(&cli, &plugin.address, provider);
    }
    rt.block_on(plugin.stop());
    if failed {
        println!("provider-conformance: FAILED");
        ExitCode::from(1)
    } else {
        println!("provider-conformance: every contract held");
        ExitCode::SUCCESS
    }
}

/// The guarantee battery through the services; `true` when every seed held.
fn battery(cli: &Cli, address: &str, provider: &str) -> bool {
    let backend = Backend::Plugin {
        address: address.to_owned(),
        provider: provider.to_owned(),
    };
    let run = |seed: u64, trace: &[provisioning_tests::conformance::input::Input]| {
        let world = services::world(seed);
        let mut sut = ServiceSut::start_on(&world, backend.clone())
            .map_err(|e| format!("cannot start the services: {e:#}"))?;
        let w = sut.world().clone();
        let out = run_sut(&mut sut, &w, trace);
        sut.stop();
        out.map_err(|vs| {
            let v = &vs[0];
            format!(
                "{:?} ({}) at {}: {}",
                v.guarantee,
                v.guarantee.text(),
                v.at,
                v.detail
            )
        })
    };
    let mut all = true;
    for seed in 1..=cli.seeds {
        let started = Instant::now();
        let trace = generate(seed, Alphabet::Services, prefix_len(seed, Alphabet::Services));
        match run(seed, &trace) {
            Ok(out) => println!(
                "PASS  guarantee battery, seed {seed}: {} inputs, converged in {} of {} passes; {:.1?}",
                trace.len(),
                out.tail_passes,
                out.tail_bound,
                started.elapsed()
            ),
            Err(why) => {
                all = false;
                let mut runs = 0;
                let shrunk = shrink(&trace, cli.shrink_runs, |t| {
                    runs += 1;
                    run(seed, t).is_err()
                });
                println!(
                    "FAIL  guarantee battery, seed {seed}: {why}\n      trace: {}\n      shrunk ({runs} runs): {}",
                    format_trace(&trace),
                    if shrunk.is_empty() {
                        "(no input: the initial shape alone)".to_owned()
                    } else {
                        format_trace(&shrunk)
                    }
                );
            }
        }
    }
    all
}
