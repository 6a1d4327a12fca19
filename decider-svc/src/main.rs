//! `decider-svc`: serves the decider over gRPC until SIGTERM or SIGINT.

use anyhow::Context as _;
use clap::Parser;
use decider_svc::server::{Config, DEFAULT_MAX_NODES, serve};
use futures::FutureExt as _;
use platform::{
    runtime::{CommonArgs, bind_and_announce, init_telemetry, shutdown_signal},
    tls::{PeerArgs, PeerPolicy},
};

/// jemalloc rather than glibc's malloc: see docs/profile-notes.md, "The
/// allocator".
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The provisioning decider: a stateless gRPC service that answers the driver.
#[derive(Debug, Parser)]
#[command(name = "decider-svc", version, about)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    peers: PeerArgs,
    /// The most nodes, slot indices or desired slots one Decide call may carry.
    #[arg(long, env = "DECIDER_MAX_NODES", default_value_t = DEFAULT_MAX_NODES,
          value_parser = clap::value_parser!(u32).range(1..))]
    max_nodes: u32,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    platform::runtime::exit_code(serve_until_stopped().await)
}

async fn serve_until_stopped() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let telemetry = init_telemetry("decider-svc", &cli.common)?;
    let policy = PeerPolicy::new(cli.common.transport("decider-svc")?, cli.peers.identities());
    let listener = bind_and_announce("decider-svc", cli.common.listen, cli.common.ready_file.as_deref())
        .await
        .with_context(|| format!("binding {}", cli.common.listen))?;

    // The signal is shared: the server stops accepting on it, and the grace
    // period starts from it, so a call that never finishes cannot hold the
    // process past the grace period.
    let signal = shutdown_signal().shared();
    let grace = cli.common.shutdown_grace();
    let server = serve(
        listener,
        signal.clone(),
        Config {
            max_nodes: cli.max_nodes,
            messages: cli.common.messages,
        },
        &policy,
    );
    let deadline = async move {
        signal.await;
        tokio::time::sleep(grace).await;
    };
    let result = tokio::select! {
        result = server => result,
        () = deadline => {
            tracing::warn!(grace_ms = cli.common.shutdown_grace_ms, "calls still in flight after the grace period; exiting");
            Ok(())
        }
    };
    // Spans of the last calls are exported before the process ends.
    telemetry.shutdown().await;
    Ok(result?)
}
