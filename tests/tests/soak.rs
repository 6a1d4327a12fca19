//! A soak: churn across several runs (apply, scale, template change,
//! delete) with seeded SIGKILLs of every service, for `SOAK_SECS` seconds
//! (120 in CI; `SOAK_SECS=3600` is the long run), sampling each service's
//! resident memory, open descriptors and threads. After the warm-up (the
//! first quarter) they must stay flat, and at the end every run there is
//! converges and every deleted one is gone.
//!
//! `SOAK_SEED` picks the churn; a failure prints it. `SOAK_KILL_EVERY_SECS`
//! (5 by default) is the least time between two kills: a large value lets
//! each process live long, so a slow leak within one process's life shows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use contract::pb;
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, Service, watch_until},
    shapes::shape,
    sim::Rng,
};
use tonic::Code;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One reading of a process: resident KiB, open descriptors, threads.
#[derive(Debug, Clone, Copy, Default)]
struct Reading {
    rss_kib: u64,
    fds: u64,
    threads: u64,
}

fn read(pid: u32) -> Option<Reading> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    Some(Reading {
        rss_kib: field("VmRSS:")?,
        threads: field("Threads:")?,
        fds: std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64,
    })
}

/// A run the churn keeps: its generation, workers and image.
#[derive(Debug, Clone)]
struct Kept {
    generation: u64,
    workers: u32,
    image: u32,
}

fn apply_req(run: &str, k: &Kept) -> pb::ApplyRequest {
    pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            run,
            k.generation,
            "fake",
            &[("workers", k.workers, &format!("img:{}", k.image))],
        ))),
    }
}

fn service(cluster: &mut Cluster, which: u64) -> &mut Service {
    match which {
        0 => &mut cluster.decider,
        1 => &mut cluster.executor,
        _ => &mut cluster.driver,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_with_kills_keeps_every_service_flat_and_every_run_converging() {
    let secs = env_u64("SOAK_SECS", 120);
    let kill_every = Duration::from_secs(env_u64("SOAK_KILL_EVERY_SECS", 5));
    let seed = env_u64("SOAK_SEED", 0x50a4);
    let mut rng = Rng::new(seed);
    eprintln!(
        "soak: {secs} s, seed {seed}, a kill at most every {} s (SOAK_SECS, SOAK_SEED, SOAK_KILL_EVERY_SECS)",
        kill_every.as_secs()
    );
    let mut cluster = Cluster::start(ClusterOptions::default().executor("--fake-stage-interval-ms", "20"))
        .await
        .unwrap();
    let started = Instant::now();
    let end = started + Duration::from_secs(secs);
    let mut runs: BTreeMap<String, Kept> = BTreeMap::new();
    let mut deleted: Vec<String> = Vec::new();
    let mut next_name = 0;
    // (seconds since start, service, reading)
    let mut samples: Vec<(f64, &'static str, Reading)> = Vec::new();
    let mut last_sample = Instant::now() - Duration::from_secs(10);
    let mut kills = 0;
    let mut last_kill = Instant::now();
    let (mut changes, mut refused) = (0, 0);

    while Instant::now() < end {
        if last_sample.elapsed() >= Duration::from_secs(1) {
            last_sample = Instant::now();
            let t = started.elapsed().as_secs_f64();
            for (name, svc) in [
                ("decider", &cluster.decider),
                ("executor", &cluster.executor),
                ("driver", &cluster.driver),
            ] {
                if let Some(r) = svc.pid().and_then(read) {
                    samples.push((t, name, r));
                }
            }
        }
        let Ok(mut c) = cluster.client().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        match rng.below(20) {
            // A kill now and then: a seeded service, SIGKILL, restarted.
            0 if last_kill.elapsed() >= kill_every => {
                last_kill = Instant::now();
                let which = rng.below(3);
                let dir = cluster.dir.path().to_owned();
                service(&mut cluster, which).restart(&dir).await.unwrap();
                kills += 1;
            }
            // A new run, while there are fewer than three.
            1..=4 if runs.len() < 3 => {
                let name = format!("soak-{next_name}");
                next_name += 1;
                let k = Kept {
                    generation: 1,
                    workers: 1 + rng.below(4) as u32,
                    image: 1,
                };
                match c.apply(apply_req(&name, &k)).await {
                    Ok(_) => {
                        runs.insert(name, k);
                        changes += 1;
                    }
                    Err(_) => refused += 1,
                }
            }
            // A delete, while there are more than one.
            5 if runs.len() > 1 => {
                let name = runs
                    .keys()
                    .nth(rng.below(runs.len() as u64) as usize)
                    .cloned()
                    .unwrap();
                match c.delete_run(pb::DeleteRunRequest { run_id: name.clone() }).await {
                    Ok(_) => {
                        runs.remove(&name);
                        deleted.push(name);
                        changes += 1;
                    }
                    Err(_) => refused += 1,
                }
            }
            // A scale or a template change of a run.
            6..=9 if !runs.is_empty() => {
                let name = runs
                    .keys()
                    .nth(rng.below(runs.len() as u64) as usize)
                    .cloned()
                    .unwrap();
                let mut k = runs[&name].clone();
                k.generation += 1;
                if rng.below(2) == 0 {
                    k.workers = 1 + rng.below(4) as u32;
                } else {
                    k.image += 1;
                }
                match c.apply(apply_req(&name, &k)).await {
                    Ok(_) => {
                        runs.insert(name, k);
                        changes += 1;
                    }
                    // A change whose answer was lost may have landed: read
                    // the generation back.
                    Err(_) => {
                        refused += 1;
                        if let Ok(s) = c
                            .get_run(pb::GetRunRequest {
                                run_id: name.clone(),
                                include_nodes: false,
                            })
                            .await
                        {
                            let s = s.into_inner();
                            if s.generation == k.generation {
                                runs.insert(name, k);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(100 + rng.below(300))).await;
    }

    // Every run there converges at its last generation; every deleted one
    // is gone.
    let mut c = cluster.client().await.unwrap();
    for (name, k) in &runs {
        let done = watch_until(&mut c, name, Duration::from_secs(120), |s| {
            s.converged && s.generation == k.generation
        })
        .await;
        if let Err(e) = &done {
            cluster.dump_logs();
            panic!(
                "seed {seed}: run {name} did not converge at generation {}: {e}",
                k.generation
            );
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    for name in &deleted {
        loop {
            let r = c
                .get_run(pb::GetRunRequest {
                    run_id: name.clone(),
                    include_nodes: false,
                })
                .await;
            match r {
                Err(s) if s.code() == Code::NotFound => break,
                _ => {
                    assert!(
                        Instant::now() < deadline,
                        "seed {seed}: deleted run {name} is still there: {r:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    // Flat after the warm-up: the last half no higher than the second
    // quarter, with room for noise.
    let total = started.elapsed().as_secs_f64();
    for name in ["decider", "executor", "driver"] {
        let window = |from: f64, to: f64| {
            samples
                .iter()
                .filter(|(t, n, _)| *n == name && *t >= from * total && *t < to * total)
                .map(|(_, _, r)| *r)
                .collect::<Vec<_>>()
        };
        let (warm, late) = (window(0.25, 0.5), window(0.5, 1.0));
        if warm.is_empty() || late.is_empty() {
            continue;
        }
        let max = |v: &[Reading], f: fn(&Reading) -> u64| v.iter().map(f).max().unwrap_or(0);
        let (rss_warm, rss_late) = (max(&warm, |r| r.rss_kib), max(&late, |r| r.rss_kib));
        let (fds_warm, fds_late) = (max(&warm, |r| r.fds), max(&late, |r| r.fds));
        let (thr_warm, thr_late) = (max(&warm, |r| r.threads), max(&late, |r| r.threads));
        eprintln!(
            "soak: {name}: rss {rss_warm} -> {rss_late} KiB, fds {fds_warm} -> {fds_late}, threads {thr_warm} -> {thr_late}"
        );
        assert!(
            rss_late <= rss_warm + rss_warm / 2 + 16 * 1024,
            "seed {seed}: {name}'s memory grew: {rss_warm} KiB after the warm-up, {rss_late} KiB at the end"
        );
        assert!(
            fds_late <= fds_warm + 16,
            "seed {seed}: {name}'s open descriptors grew: {fds_warm} -> {fds_late}"
        );
        assert!(
            thr_late <= thr_warm + 8,
            "seed {seed}: {name}'s threads grew: {thr_warm} -> {thr_late}"
        );
    }
    eprintln!(
        "soak: {changes} changes ({refused} refused or lost), {kills} kills, {} runs at the end, {} deleted",
        runs.len(),
        deleted.len()
    );
    assert!(changes >= 5, "seed {seed}: the churn made only {changes} changes");
}
