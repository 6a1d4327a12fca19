//! Provider budgets with the three real binaries: an executor capped at a few
//! backend calls in flight never runs more (sampled from its metrics while a
//! run converges), the operations over the cap wait rather than fail, and
//! `explain` says what a waiting node waits for; and the driver's admission
//! limit on the operations all its runs have pending, likewise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use contract::pb;
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, watch_until},
    shapes::shape,
};

const CAP: f64 = 3.0;

fn gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inflight_cap_is_never_exceeded_and_waiting_shows_in_explain() {
    let cluster = Cluster::start(
        ClusterOptions::default()
            .executor("--fake-latency-ms", "60,90")
            .executor("--budget-inflight", "3")
            // The test samples the gauges and explains every node far faster
            // than a client would (to catch the gauges' maxima): the driver's
            // per-client rate limit would refuse it.
            .driver("--rate-limit", "0")
            .service_env("executor-svc", "PROVISIONING_METRICS_LISTEN", "127.0.0.1:0"),
    )
    .await
    .unwrap();
    let mut c = cluster.client().await.unwrap();
    let s = shape("budget", 1, "fake", &[("workers", 12, "img:1")]);
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await
    .unwrap();

    // Sample the executor's running and waiting gauges, and explain the
    // nodes, until the run converges.
    let mut max_running: f64 = 0.0;
    let mut max_waiting: f64 = 0.0;
    let mut samples = 0;
    let mut notes: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = cluster.executor.scrape().await.unwrap();
        max_running = max_running.max(gauge(&text, "provisioning_executor_operations_running"));
        max_waiting = max_waiting.max(gauge(&text, "provisioning_executor_budget_waiting"));
        samples += 1;
        if notes.is_empty() {
            for i in 0..12 {
                let e = c
                    .explain_node(pb::ExplainNodeRequest {
                        run_id: "budget".into(),
                        node_id: format!("workers-{i}"),
                    })
                    .await;
                if let Ok(e) = e
                    && !e.get_ref().executor_note.is_empty()
                {
                    notes.push(e.into_inner().executor_note);
                }
            }
        }
        let st = c
            .get_run(pb::GetRunRequest {
                run_id: "budget".into(),
                include_nodes: false,
            })
            .await
            .unwrap()
            .into_inner();
        if st.converged {
            assert_eq!(st.ready_count, 12);
            break;
        }
        if Instant::now() > deadline {
            cluster.dump_logs();
            panic!("did not converge under the budget: {st:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!("samples {samples}, max running {max_running}, max waiting {max_waiting}");
    assert!(max_running <= CAP, "{max_running} calls in flight, cap {CAP}");
    assert!(max_running >= 2.0, "the cap was never approached: {max_running}");
    assert!(max_waiting > 0.0, "nothing ever waited for the budget");
    assert!(
        notes
            .iter()
            .any(|n| n.contains("waiting for the provider budget")),
        "explain never showed a wait: {notes:?}"
    );
    let text = cluster.executor.scrape().await.unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("provisioning_executor_budget_waits_total{held=\"provider-inflight\"}")),
        "{text}"
    );
    watch_until(&mut c, "budget", Duration::from_secs(5), |s| s.converged)
        .await
        .unwrap();
}

/// The sum of a gauge's series.
fn gauge_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.trim().parse::<f64>().ok()))
        .sum()
}

/// The driver's admission limit holds across runs: two runs of eight nodes
/// under `--max-operations-in-flight 2` never have more than two operations
/// pending together (sampled from the driver's gauge), a held node says what
/// it waits for in `explain`, and both runs converge with no safety tick to
/// help them (it is ten minutes here): only room given back wakes a run
/// whose nodes wait for it. The waiting nodes' gauge moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drivers_admission_limit_holds_across_runs_and_returned_room_wakes_them() {
    const LIMIT: f64 = 2.0;
    let cluster = Cluster::start(
        ClusterOptions::default()
            .executor("--fake-latency-ms", "20,40")
            .driver("--max-operations-in-flight", "2")
            .driver("--safety-tick-ms", "600000")
            .driver("--rate-limit", "0")
            .service_env("driver-svc", "PROVISIONING_METRICS_LISTEN", "127.0.0.1:0"),
    )
    .await
    .unwrap();
    let mut c = cluster.client().await.unwrap();
    let runs = ["admit-a", "admit-b"];
    for run in runs {
        let s = shape(run, 1, "fake", &[("workers", 8, "img:1")]);
        c.apply(pb::ApplyRequest {
            shape: Some(pb::ClusterShape::from(&s)),
        })
        .await
        .unwrap();
    }
    let mut max_pending: f64 = 0.0;
    let mut max_waiting: f64 = 0.0;
    let mut notes: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let text = cluster.driver.scrape().await.unwrap();
        max_pending = max_pending.max(gauge_sum(&text, "provisioning_operations_in_flight"));
        max_waiting = max_waiting.max(gauge_sum(&text, "provisioning_admission_waiting_nodes"));
        if notes.is_empty() {
            for run in runs {
                for i in 0..8 {
                    let e = c
                        .explain_node(pb::ExplainNodeRequest {
                            run_id: run.into(),
                            node_id: format!("workers-{i}"),
                        })
                        .await;
                    if let Ok(e) = e
                        && e.get_ref().executor_note.contains("waiting for room to dispatch")
                    {
                        notes.push(e.into_inner().executor_note);
                    }
                }
            }
        }
        let mut converged = 0;
        for run in runs {
            let st = c
                .get_run(pb::GetRunRequest {
                    run_id: run.into(),
                    include_nodes: false,
                })
                .await
                .unwrap()
                .into_inner();
            converged += usize::from(st.converged);
        }
        if converged == runs.len() {
            break;
        }
        if Instant::now() > deadline {
            cluster.dump_logs();
            panic!("{converged} of 2 runs converged under the admission limit");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!("max pending {max_pending}, max waiting {max_waiting}, notes {notes:?}");
    assert!(max_waiting > 0.0, "the waiting nodes' gauge never moved");
    assert!(
        max_pending <= LIMIT,
        "{max_pending} operations pending, limit {LIMIT}"
    );
    assert!(max_pending >= 1.0, "no operation was ever seen pending");
    assert!(
        notes.iter().any(|n| n.contains("of 2 operations in flight")),
        "explain never showed a node held for room: {notes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_budget_flag_is_refused_at_start() {
    for (flag, value) in [
        ("--budget-inflight", "0"),
        ("--budget-rate", "-1"),
        ("--run-budget-rate", "x"),
    ] {
        let started = Cluster::start(ClusterOptions::default().executor(flag, value)).await;
        let err = started.expect_err("the executor started with a bad budget");
        assert!(
            err.to_string().contains("executor-svc exited early"),
            "{flag}: {err}"
        );
    }
}
