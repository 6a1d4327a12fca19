//! `provisionctl`: the command-line client of the driver's public API.
//!
//! Exit codes: 0 success (for `watch`, converged or deleted); 1 an error (bad
//! file, refused request, unreachable server); 2 `watch --timeout` expired.

use std::{io::Read, process::ExitCode, time::Duration};

use anyhow::Context;
use clap::{Parser, Subcommand};
use contract::pb::{self, provisioning_client::ProvisioningClient};
use driver_svc::shapefile;
use tonic::transport::Channel;

#[derive(Debug, Parser)]
#[command(name = "provisionctl", version, about = "Provisioning client")]
struct Cli {
    /// The driver's address.
    #[arg(
        long,
        global = true,
        env = "PROVISIONCTL_SERVER",
        default_value = "http://127.0.0.1:7000"
    )]
    server: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply a shape file (YAML or JSON; `-` reads standard input).
    Apply {
        #[arg(short = 'f', long = "file")]
        file: String,
    },
    /// Show a run.
    Get {
        run: String,
        #[arg(short = 'o', long = "output", default_value = "table")]
        output: Output,
        #[arg(long)]
        nodes: bool,
    },
    /// Follow a run until it converges (or is deleted).
    Watch {
        run: String,
        /// Give up after this many seconds (exit 2).
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Delete a run.
    Delete { run: String },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Output {
    Table,
    Json,
}

fn read_source(file: &str) -> anyhow::Result<String> {
    if file == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s)?;
        Ok(s)
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {file}"))
    }
}

fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{}: {}", code_name(s.code()), s.message())
}

fn code_name(c: tonic::Code) -> &'static str {
    use tonic::Code as C;
    match c {
        C::InvalidArgument => "invalid argument",
        C::FailedPrecondition => "refused",
        C::NotFound => "not found",
        C::Unavailable => "unavailable",
        C::ResourceExhausted => "resource exhausted",
        C::Unauthenticated => "unauthenticated",
        C::PermissionDenied => "permission denied",
        _ => "error",
    }
}

fn stage_name(v: i32) -> &'static str {
    pb::NodeStage::try_from(v).map_or("unknown", |s| match s {
        pb::NodeStage::Unspecified => "unknown",
        pb::NodeStage::New => "new",
        pb::NodeStage::LeaseRequested => "lease-requested",
        pb::NodeStage::LeaseCreated => "lease-created",
        pb::NodeStage::EndpointKnown => "endpoint-known",
        pb::NodeStage::BootstrapRunning => "bootstrapping",
        pb::NodeStage::Joined => "joined",
        pb::NodeStage::HandedOff => "handed-off",
        pb::NodeStage::Dormant => "ready",
        pb::NodeStage::Failed => "failed",
        pb::NodeStage::Destroyed => "destroyed",
    })
}

fn phase_name(v: i32) -> &'static str {
    pb::RunPhase::try_from(v).map_or("unknown", |p| match p {
        pb::RunPhase::Unspecified => "unknown",
        pb::RunPhase::Progressing => "progressing",
        pb::RunPhase::Converged => "converged",
        pb::RunPhase::Paused => "paused",
        pb::RunPhase::Deleting => "deleting",
        pb::RunPhase::Deleted => "deleted",
    })
}

fn summary_line(s: &pb::RunStatus) -> String {
    let desired: u32 = s.groups.iter().map(|g| g.desired).sum();
    let groups: Vec<String> = s
        .groups
        .iter()
        .map(|g| {
            let stages: Vec<String> = g
                .stages
                .iter()
                .map(|c| format!("{}={}", stage_name(c.stage), c.count))
                .collect();
            format!("{} {}/{} [{}]", g.group_id, g.ready, g.desired, stages.join(" "))
        })
        .collect();
    format!(
        "{} gen {} {}: {}/{} ready, {} pending; {}",
        s.run_id,
        s.generation,
        phase_name(s.phase),
        s.ready_count,
        desired,
        s.pending_operations,
        groups.join("; ")
    )
}

async fn connect(server: &str) -> anyhow::Result<ProvisioningClient<Channel>> {
    let ch = tonic::transport::Endpoint::from_shared(server.to_owned())?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("connecting to {server}"))?;
    Ok(ProvisioningClient::new(ch))
}

async fn apply(server: &str, file: &str) -> anyhow::Result<()> {
    let text = read_source(file)?;
    let parsed = shapefile::parse(file, &text)?;
    let mut client = connect(server).await?;
    let generation = match parsed.generation {
        Some(g) => g,
        None => match client
            .get_run(pb::GetRunRequest {
                run_id: parsed.run_id.clone(),
                include_nodes: false,
            })
            .await
        {
            Ok(r) => r.into_inner().generation + 1,
            Err(s) if s.code() == tonic::Code::NotFound => 1,
            Err(s) => return Err(status_error(s)),
        },
    };
    let resp = client
        .apply(pb::ApplyRequest {
            shape: Some(parsed.to_wire(generation)),
        })
        .await
        .map_err(status_error)?
        .into_inner();
    let what = if resp.created {
        "created"
    } else if resp.changed {
        "updated"
    } else {
        "unchanged"
    };
    println!("run {} {what} at generation {}", parsed.run_id, resp.generation);
    Ok(())
}

async fn get(server: &str, run: &str, output: Output, nodes: bool) -> anyhow::Result<()> {
    let mut client = connect(server).await?;
    let s = client
        .get_run(pb::GetRunRequest {
            run_id: run.to_owned(),
            include_nodes: nodes,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    match output {
        Output::Json => println!("{}", status_json(&s)),
        Output::Table => {
            println!("{}", summary_line(&s));
            for n in &s.nodes {
                if let Some(st) = &n.state {
                    println!("  {:<24} a{:<6} {}", st.node_id, st.attempt, stage_name(st.stage));
                }
            }
        }
    }
    Ok(())
}

fn status_json(s: &pb::RunStatus) -> String {
    let groups: Vec<serde_json::Value> = s
        .groups
        .iter()
        .map(|g| {
            let stages: serde_json::Map<String, serde_json::Value> = g
                .stages
                .iter()
                .map(|c| (stage_name(c.stage).to_owned(), c.count.into()))
                .collect();
            serde_json::json!({"group_id": g.group_id, "desired": g.desired, "ready": g.ready, "failing": g.failing, "stages": stages})
        })
        .collect();
    let nodes: Vec<serde_json::Value> = s
        .nodes
        .iter()
        .filter_map(|n| n.state.as_ref())
        .map(|st| serde_json::json!({"node_id": st.node_id, "attempt": st.attempt, "stage": stage_name(st.stage)}))
        .collect();
    serde_json::json!({
        "run_id": s.run_id, "run_uid": s.run_uid, "generation": s.generation,
        "observed_generation": s.observed_generation, "phase": phase_name(s.phase),
        "converged": s.converged, "paused": s.paused, "node_count": s.node_count,
        "ready_count": s.ready_count, "pending_operations": s.pending_operations,
        "groups": groups, "nodes": nodes,
    })
    .to_string()
}

/// Follows the run; returns whether it converged (or was deleted) in time.
async fn watch(server: &str, run: &str, timeout: Option<u64>) -> anyhow::Result<bool> {
    let mut client = connect(server).await?;
    let mut stream = client
        .watch_run(pb::WatchRunRequest {
            run_id: run.to_owned(),
            include_nodes: false,
        })
        .await
        .map_err(status_error)?
        .into_inner();
    let follow = async {
        let mut last = String::new();
        while let Some(s) = stream.message().await.map_err(status_error)? {
            let line = summary_line(&s);
            if line != last {
                println!("{line}");
                last = line;
            }
            if s.converged || s.phase == pb::RunPhase::Deleted as i32 {
                return Ok::<bool, anyhow::Error>(true);
            }
        }
        anyhow::bail!("the server ended the watch before the run converged")
    };
    match timeout {
        Some(secs) => match tokio::time::timeout(Duration::from_secs(secs), follow).await {
            Ok(r) => r,
            Err(_) => {
                eprintln!("run {run} did not converge within {secs}s");
                Ok(false)
            }
        },
        None => follow.await,
    }
}

async fn delete(server: &str, run: &str) -> anyhow::Result<()> {
    let mut client = connect(server).await?;
    let s = client
        .delete_run(pb::DeleteRunRequest {
            run_id: run.to_owned(),
        })
        .await
        .map_err(status_error)?
        .into_inner();
    println!("{}", summary_line(&s));
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Apply { file } => apply(&cli.server, file).await.map(|()| true),
        Command::Get { run, output, nodes } => get(&cli.server, run, *output, *nodes).await.map(|()| true),
        Command::Watch { run, timeout } => watch(&cli.server, run, *timeout).await,
        Command::Delete { run } => delete(&cli.server, run).await.map(|()| true),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("provisionctl: {e:#}");
            ExitCode::from(1)
        }
    }
}
