//! The cost of driver replicas on etcd, as a table: convergence of one run
//! of `--nodes` nodes (fake backend, zero latency, three processes) on the
//! embedded store and on etcd, and the failover of that run when its owner is
//! SIGKILLed, converged or mid-convergence.
//!
//! ```text
//! cargo build --release --workspace --bins
//! cargo build --release -p driver-svc --features etcd
//! cargo run --release -p provisioning-tests --features etcd --bin replicas-bench -- --nodes 1000
//! ```
//!
//! Needs etcd (Debian's `etcd-server`) and a driver built with the `etcd`
//! feature beside this binary.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use contract::pb::{self, provisioning_client::ProvisioningClient};
use provisioning_tests::{
    etcd::{Etcd, owner},
    procs::{Cluster, ClusterOptions, Service, bin_path},
    shapes::shape,
};
use tonic::transport::Channel;

const RUN: &str = "bench";

fn options() -> ClusterOptions {
    ClusterOptions::default()
        .insecure()
        .executor("--fake-latency-ms", "0,0")
        .executor("--fake-stage-interval-ms", "0")
        .driver("--probe-interval-ms", "5")
        .driver("--max-nodes-per-group", "1000000")
        .driver("--max-nodes-total", "1000000")
}

fn etcd_args(opts: ClusterOptions, etcd: &Etcd, owner: &str) -> ClusterOptions {
    opts.driver("--store", "etcd")
        .driver("--etcd-endpoints", &etcd.endpoint)
        .driver("--etcd-lease-ttl-s", "2")
        .driver("--etcd-owner-id", owner)
}

fn the_shape(n: u32) -> contract::ClusterShape {
    let per = n / 4;
    shape(
        RUN,
        1,
        "fake",
        &[
            ("a", per + n % 4, "img:1"),
            ("b", per, "img:1"),
            ("c", per, "img:1"),
            ("d", per, "img:1"),
        ],
    )
}

async fn status(c: &mut ProvisioningClient<Channel>) -> anyhow::Result<pb::RunStatus> {
    Ok(c.get_run(pb::GetRunRequest {
        run_id: RUN.into(),
        include_nodes: false,
    })
    .await?
    .into_inner())
}

/// Polls until `done`; returns the status and when it was seen.
async fn until(
    c: &mut ProvisioningClient<Channel>,
    mut done: impl FnMut(&pb::RunStatus) -> bool,
) -> anyhow::Result<(pb::RunStatus, Instant)> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if let Ok(s) = status(c).await
            && done(&s)
        {
            return Ok((s, Instant::now()));
        }
        anyhow::ensure!(Instant::now() < deadline, "the run did not get there in 600 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Applies the shape and waits for convergence; returns the time it took.
async fn converge(cluster: &Cluster, n: u32) -> anyhow::Result<Duration> {
    let mut c = cluster.client().await?;
    let start = Instant::now();
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&the_shape(n))),
    })
    .await?;
    let (_, at) = until(&mut c, |s| s.converged).await?;
    Ok(at - start)
}

/// A second replica of `cluster`'s driver.
async fn second_replica(cluster: &Cluster, etcd: &Etcd) -> anyhow::Result<Service> {
    let dir = cluster.dir.path().join("d2");
    std::fs::create_dir_all(&dir)?;
    let mut args = vec![
        "--decider".to_owned(),
        cluster.decider.url(),
        "--executor".to_owned(),
        cluster.executor.url(),
    ];
    args.extend(etcd_args(options(), etcd, "d2").driver_args);
    Service::start_with_env("driver-svc", &dir, "127.0.0.1:0", &args, &[]).await
}

/// Kills the owner (replica `d1`) once the run converged, or `after` the
/// apply (mid-convergence); returns (the time until `d2` owns the run in
/// etcd, until it serves the run under a new epoch, until the run
/// converges), and whether the kill came before convergence.
async fn failover(n: u32, after: Option<Duration>) -> anyhow::Result<((Duration, Duration, Duration), bool)> {
    let etcd = Etcd::start()?;
    let mut cluster = Cluster::start(etcd_args(options(), &etcd, "d1")).await?;
    let d2 = second_replica(&cluster, &etcd).await?;
    let mut c1 = cluster.client().await?;
    c1.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&the_shape(n))),
    })
    .await?;
    let before = match after {
        None => until(&mut c1, |s| s.converged).await?.0,
        Some(d) => {
            tokio::time::sleep(d).await;
            status(&mut c1).await?
        }
    };
    let mut e = etcd.client().await?;
    cluster.driver.kill().await?;
    let killed = Instant::now();
    let claimed = loop {
        if owner(&mut e, &before.run_uid).await?.as_deref() == Some("d2") {
            break killed.elapsed();
        }
        anyhow::ensure!(
            killed.elapsed() < Duration::from_secs(60),
            "d2 never took the run"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let mut c2 = ProvisioningClient::new(d2.channel(None).await?).max_decoding_message_size(256 << 20);
    let (_, serving) = until(&mut c2, |s| s.epoch > before.epoch).await?;
    let (_, converged) = until(&mut c2, |s| s.converged).await?;
    Ok(((claimed, serving - killed, converged - killed), !before.converged))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut nodes = 1000u32;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--nodes" => nodes = args.next().context("--nodes needs a number")?.parse()?,
            _ => anyhow::bail!("replicas-bench [--nodes 1000]"),
        }
    }
    let help = std::process::Command::new(bin_path("driver-svc")?)
        .arg("--help")
        .output()?;
    anyhow::ensure!(
        String::from_utf8_lossy(&help.stdout).contains("--etcd-endpoints"),
        "the driver beside this binary has no etcd store: build it with --features etcd"
    );

    let redb = converge(&Cluster::start(options()).await?, nodes).await?;
    eprintln!("redb: {redb:?}");
    let etcd = Etcd::start()?;
    let on_etcd = converge(&Cluster::start(etcd_args(options(), &etcd, "d1")).await?, nodes).await?;
    eprintln!("etcd: {on_etcd:?}");
    drop(etcd);
    let (converged, _) = failover(nodes, None).await?;
    eprintln!("failover of a converged run: {converged:?}");
    let (mid, was_mid) = failover(nodes, Some(on_etcd / 2)).await?;
    eprintln!("failover mid-convergence: {mid:?}");
    anyhow::ensure!(
        was_mid,
        "the run converged before half its usual time: no mid-convergence figure"
    );

    let s = |d: Duration| format!("{:.2} s", d.as_secs_f64());
    let ms = |d: Duration| format!("{} ms", d.as_millis());
    println!("| {nodes} nodes, three processes, fake backend at zero latency | time | ratio |");
    println!("|---|---|---|");
    println!("| converge, redb store | {} | 1.00× |", s(redb));
    println!(
        "| converge, etcd store | {} | {:.2}× redb |",
        s(on_etcd),
        on_etcd.as_secs_f64() / redb.as_secs_f64()
    );
    println!(
        "| failover of the converged run: the other replica owns it | {} | {:.2}× the 2 s lease |",
        ms(converged.0),
        converged.0.as_secs_f64() / 2.0
    );
    println!(
        "| failover of the converged run: served under a new epoch | {} | |",
        ms(converged.1)
    );
    println!(
        "| failover mid-convergence: the other replica owns it | {} | |",
        ms(mid.0)
    );
    println!(
        "| failover mid-convergence: converged after the kill | {} | {:.2}× an uninterrupted etcd run |",
        s(mid.2),
        mid.2.as_secs_f64() / on_etcd.as_secs_f64()
    );
    Ok(())
}
