//! A load test on loopback against the three real binaries: many clients,
//! each with its own token and connection, apply, read and watch as fast as
//! they can for a bounded time, through a driver whose limits are set low
//! enough to be reached. It checks that excess load is answered
//! `RESOURCE_EXHAUSTED` (shed or rate-limited) and nothing else — no
//! timeouts, no failures, no crashes —, that the watch streams stay open
//! throughout, that every run still converges afterwards, that the driver
//! holds no watch once the clients are gone, and that its memory stays
//! bounded. It prints the figures: calls, shed and rate-limited counts,
//! latency percentiles, the driver's RSS before and after.
//!
//! Short by default (a few seconds, for CI); `LOAD_CLIENTS=200 LOAD_SECS=30`
//! is the bigger setting.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use contract::pb;
use provisioning_tests::{
    auth::{AuthedClient, Grant, Tokens, client},
    procs::{Cluster, ClusterOptions},
    shapes::shape,
};
use tonic::Code;

/// No call may take longer than this; one that does is a failure (the
/// limits must answer, not queue).
const CALL_LIMIT: Duration = Duration::from_secs(10);
/// The most calls one client makes, whatever the time allows.
const MAX_CALLS_PER_CLIENT: usize = 100_000;
/// Driver RSS growth over the whole test that counts as unbounded.
const RSS_GROWTH_LIMIT_KIB: u64 = 256 * 1024;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn apply_req(run: &str, generation: u64, count: u32) -> pb::ApplyRequest {
    pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            run,
            generation,
            "fake",
            &[("workers", count, "img:1")],
        ))),
    }
}

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Ok,
    /// RESOURCE_EXHAUSTED: over the concurrency limit.
    Shed,
    /// RESOURCE_EXHAUSTED: over the client's rate limit.
    RateLimited,
    /// RESOURCE_EXHAUSTED for another reason.
    Exhausted,
    /// Anything else, or no answer within `CALL_LIMIT`.
    Failed,
}

fn classify(r: &Result<(), tonic::Status>) -> Outcome {
    match r {
        Ok(()) => Outcome::Ok,
        Err(s) if s.code() == Code::ResourceExhausted => {
            if s.message().contains("--max-concurrent-requests") {
                Outcome::Shed
            } else if s.message().contains("--rate-limit") {
                Outcome::RateLimited
            } else {
                Outcome::Exhausted
            }
        }
        Err(_) => Outcome::Failed,
    }
}

#[derive(Debug, Default)]
struct ClientReport {
    calls: Vec<(Outcome, Duration)>,
    failures: Vec<String>,
    /// The last generation an apply of this client's run was accepted at,
    /// and its node count.
    applied: (u64, u32),
}

async fn timed<T>(
    f: impl std::future::Future<Output = Result<T, tonic::Status>>,
) -> (Result<(), tonic::Status>, Duration) {
    let start = Instant::now();
    let r = match tokio::time::timeout(CALL_LIMIT, f).await {
        Ok(r) => r.map(|_| ()),
        Err(_) => Err(tonic::Status::deadline_exceeded(
            "no answer within the test's call limit",
        )),
    };
    (r, start.elapsed())
}

/// One client: its run, then calls as fast as it can until `until`.
async fn run_client(mut c: AuthedClient, run: String, until: Instant) -> ClientReport {
    let mut report = ClientReport::default();
    let mut generation = 1;
    let mut count = 2;
    let mut i = 0usize;
    while Instant::now() < until && i < MAX_CALLS_PER_CLIENT {
        i += 1;
        let (r, took) = match i % 8 {
            // Every eighth call changes the run (alternately 1 and 2 nodes).
            0 => {
                let next = if count == 2 { 1 } else { 2 };
                let (r, took) = timed(c.apply(apply_req(&run, generation + 1, next))).await;
                if r.is_ok() {
                    generation += 1;
                    count = next;
                    report.applied = (generation, count);
                }
                (r, took)
            }
            1 | 4 => timed(c.list_runs(pb::ListRunsRequest::default())).await,
            5 => {
                timed(c.explain_node(pb::ExplainNodeRequest {
                    run_id: run.clone(),
                    node_id: "workers-0".into(),
                }))
                .await
            }
            _ => {
                timed(c.get_run(pb::GetRunRequest {
                    run_id: run.clone(),
                    include_nodes: true,
                }))
                .await
            }
        };
        let outcome = classify(&r);
        if outcome == Outcome::Failed
            && let Err(s) = &r
        {
            // NOT_FOUND from explain is an answer about the run (its node
            // may be between attempts), not a failure of the service.
            if s.code() == Code::NotFound {
                report.calls.push((Outcome::Ok, took));
                continue;
            }
            report.failures.push(format!("{:?}: {}", s.code(), s.message()));
        }
        if matches!(outcome, Outcome::Shed | Outcome::RateLimited) {
            // A polite client waits as hinted, briefly (the test's clock is short).
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        report.calls.push((outcome, took));
    }
    report
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_applying_and_watching_get_served_or_resource_exhausted() {
    let clients = env_or("LOAD_CLIENTS", 32) as usize;
    let secs = env_or("LOAD_SECS", 3);
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..clients).map(|i| format!("client-{i}")).collect();
    let grants: Vec<Grant<'_>> = names.iter().map(|n| Grant::write(n)).collect();
    let tokens = Tokens::write(dir.path(), &grants).unwrap();
    let opts = ClusterOptions::default()
        .tokens_file(&tokens.path)
        .driver("--max-concurrent-requests", "8")
        .driver("--overload-retry-ms", "20")
        .driver("--rate-limit", "8")
        .driver("--rate-limit-window-ms", "1000")
        .driver("--max-watches-per-client", "2")
        .driver("--safety-tick-ms", "600000")
        .service_env("driver-svc", "PROVISIONING_METRICS_LISTEN", "127.0.0.1:0");
    let mut cluster = Cluster::start_in(dir, opts).await.unwrap();
    let pid = cluster.driver.pid().unwrap();
    let rss_before = rss_kib(pid).unwrap();

    // Each client: its connection, its run, two watch streams (the cap) and
    // a third that is refused.
    let mut conns = Vec::new();
    let mut watchers = Vec::new();
    let mut refused_watches = 0;
    for (i, name) in names.iter().enumerate() {
        let mut c = client(&cluster, Some(tokens.token(name).unwrap())).await.unwrap();
        let run = format!("load-{i}");
        c.apply(apply_req(&run, 1, 2)).await.unwrap();
        for w in 0..3 {
            match c
                .watch_run(pb::WatchRunRequest {
                    run_id: run.clone(),
                    include_nodes: false,
                })
                .await
            {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    watchers.push(tokio::spawn(async move {
                        let mut seen = 0u64;
                        // Ends with an error only if the stream breaks; the
                        // test aborts it when the load is over.
                        loop {
                            match stream.message().await {
                                Ok(Some(_)) => seen += 1,
                                Ok(None) => return Ok(seen),
                                Err(s) => return Err(format!("{:?}: {}", s.code(), s.message())),
                            }
                        }
                    }));
                }
                Err(s) => {
                    assert_eq!((w, s.code()), (2, Code::ResourceExhausted), "{s:?}");
                    refused_watches += 1;
                }
            }
        }
        conns.push((c, run));
    }
    assert_eq!(
        refused_watches, clients,
        "each client's third watch is over its cap"
    );

    let started = Instant::now();
    let until = started + Duration::from_secs(secs);
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|(c, run)| tokio::spawn(run_client(c, run, until)))
        .collect();
    let mut reports = Vec::new();
    for t in tasks {
        reports.push(t.await.unwrap());
    }
    let elapsed = started.elapsed();
    let rss_peak_after_load = rss_kib(pid).unwrap();

    // The watch streams lived through the load.
    for w in &watchers {
        assert!(!w.is_finished(), "a watch stream ended during the load");
    }

    let mut by_outcome: BTreeMap<Outcome, usize> = BTreeMap::new();
    let mut ok_latency = Vec::new();
    let mut refused_latency = Vec::new();
    let mut failures = Vec::new();
    for r in &reports {
        for (o, d) in &r.calls {
            *by_outcome.entry(*o).or_default() += 1;
            if *o == Outcome::Ok {
                ok_latency.push(*d);
            } else {
                refused_latency.push(*d);
            }
        }
        failures.extend(r.failures.iter().cloned());
    }
    ok_latency.sort();
    refused_latency.sort();
    let total: usize = by_outcome.values().sum();
    let count = |o| by_outcome.get(&o).copied().unwrap_or(0);

    // Every run converges to what its client last applied: still serving.
    let mut check = client(&cluster, Some(tokens.token(&names[0]).unwrap()))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    for (i, r) in reports.iter().enumerate() {
        let run = format!("load-{i}");
        let (generation, nodes) = if r.applied.0 == 0 { (1, 2) } else { r.applied };
        let mut c = client(&cluster, Some(tokens.token(&names[i]).unwrap()))
            .await
            .unwrap();
        loop {
            match c
                .get_run(pb::GetRunRequest {
                    run_id: run.clone(),
                    include_nodes: false,
                })
                .await
            {
                Ok(s) if s.get_ref().converged && s.get_ref().generation == generation => {
                    assert_eq!(s.get_ref().ready_count, nodes, "{run}");
                    break;
                }
                Ok(_) => {}
                Err(s) => assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}"),
            }
            if Instant::now() > deadline {
                let s = c
                    .get_run(pb::GetRunRequest {
                        run_id: run.clone(),
                        include_nodes: true,
                    })
                    .await;
                cluster.dump_logs();
                panic!("{run} did not converge at generation {generation}: {s:#?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let listed = loop {
        match check.list_runs(pb::ListRunsRequest::default()).await {
            Ok(r) => break r.into_inner().runs.len(),
            Err(s) => {
                assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(listed, clients);

    // The clients go away; the driver holds none of their watches.
    for w in &watchers {
        w.abort();
    }
    drop(watchers);
    let mut open_watches = None;
    for _ in 0..100 {
        let m = cluster.driver.scrape().await.unwrap();
        open_watches = provisioning_tests::procs::sample(&m, "provisioning_api_watches");
        if open_watches == Some(0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rss_after = rss_kib(pid).unwrap();
    let metrics = cluster.driver.scrape().await.unwrap();
    let refused: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("provisioning_api_refused_total{"))
        .collect();

    println!(
        "load: {clients} clients for {:.1} s (each its own token and connection; driver limits: 8 calls in \
         flight, 8 calls/s per client, 2 watches per client); {} CPUs",
        elapsed.as_secs_f64(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "load: {total} calls ({:.0}/s): {} ok, {} shed (RESOURCE_EXHAUSTED, in flight), {} rate-limited \
         (RESOURCE_EXHAUSTED), {} other RESOURCE_EXHAUSTED, {} failed; {} watches open through it, {} \
         refused over the cap",
        total as f64 / elapsed.as_secs_f64(),
        count(Outcome::Ok),
        count(Outcome::Shed),
        count(Outcome::RateLimited),
        count(Outcome::Exhausted),
        count(Outcome::Failed),
        2 * clients,
        refused_watches
    );
    println!(
        "load: latency ok p50 {} p99 {} max {}; refused p50 {} p99 {}",
        ms(percentile(&ok_latency, 0.5)),
        ms(percentile(&ok_latency, 0.99)),
        ms(ok_latency.last().copied().unwrap_or_default()),
        ms(percentile(&refused_latency, 0.5)),
        ms(percentile(&refused_latency, 0.99)),
    );
    println!(
        "load: driver RSS {} MiB before, {} MiB after the load, {} MiB once the clients left",
        rss_before / 1024,
        rss_peak_after_load / 1024,
        rss_after / 1024
    );
    println!("load: driver counters: {}", refused.join(", "));

    assert!(
        failures.is_empty(),
        "calls failed other than RESOURCE_EXHAUSTED: {failures:?}"
    );
    assert_eq!(count(Outcome::Failed), 0);
    assert!(count(Outcome::Ok) > 0, "nothing was served");
    assert!(
        count(Outcome::Shed) + count(Outcome::RateLimited) > 0,
        "the load never reached a limit: {by_outcome:?}"
    );
    assert_eq!(open_watches, Some(0.0), "watches left open on the driver");
    assert!(
        rss_after.saturating_sub(rss_before) < RSS_GROWTH_LIMIT_KIB,
        "the driver's RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
    for s in [&mut cluster.driver, &mut cluster.executor, &mut cluster.decider] {
        assert!(s.is_running(), "{} is not running", s.name);
    }
}
