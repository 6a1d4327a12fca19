//! The services on private test hosts joined by real links (network
//! namespaces and veth pairs, `provisioning_tests::netns`), and those links
//! cut for real while a run converges: not a stopped process standing for
//! a partition, but packets that go nowhere.
//!
//! Needs root (or `CAP_NET_ADMIN`) and iproute2: without them the tests
//! fail, naming the command that failed, rather than skip.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeMap, time::Duration};

use contract::pb;
use provisioning_tests::{
    netns::{Link, NetCluster},
    procs::watch_until,
    shapes::shape,
};

const CONVERGE: Duration = Duration::from_secs(120);

fn apply_req(run: &str, workers: u32) -> pb::ApplyRequest {
    pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            run,
            1,
            "fake",
            &[("workers", workers, "img:1")],
        ))),
    }
}

fn get(run: &str) -> pb::GetRunRequest {
    pb::GetRunRequest {
        run_id: run.to_owned(),
        include_nodes: true,
    }
}

/// The three services with operation deadlines of 1.5 s (and 0.5 s of
/// grace), and a fake provider slow enough that creates are in flight when
/// a link goes.
async fn short_deadlines() -> NetCluster {
    NetCluster::start(
        &[
            "--operation-timeout-ms",
            "1500",
            "--result-grace-ms",
            "500",
            "--backoff-base-ms",
            "50",
            "--backoff-cap-ms",
            "500",
        ],
        &[
            "--backend",
            "fake",
            "--fake-latency-ms",
            "300,900",
            "--fake-stage-interval-ms",
            "200",
        ],
    )
    .await
    .unwrap()
}

/// Operations the driver folded with outcome class `outcome`, by its own
/// count (its metrics).
fn ended(metrics: &str, outcome: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("provisioning_operation_duration_seconds_count{")
                && l.contains(&format!("outcome=\"{outcome}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Asserts the executor's inventory holds one resource for each of `slots`
/// slots, read over the test's own link.
async fn one_resource_per_slot(cluster: &NetCluster, slots: usize) {
    let inventory = cluster.inventory().await.unwrap();
    let mut by_slot: BTreeMap<String, usize> = BTreeMap::new();
    for r in &inventory {
        *by_slot.entry(r.node_id.clone()).or_default() += 1;
    }
    assert_eq!(by_slot.len(), slots, "{by_slot:?}");
    assert!(
        by_slot.values().all(|&n| n == 1),
        "a slot holds two resources: {by_slot:?}"
    );
}

/// The driver's link to the executor is cut mid-convergence for longer
/// than the operations' deadline: what was in flight goes ambiguous, and
/// once the link is back it is sent again and adopted. The run converges
/// with one resource per slot: nothing doubled, nothing left over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_executor_link_longer_than_the_deadlines_doubles_nothing() {
    let cluster = short_deadlines().await;
    let mut c = cluster.client().await.unwrap();
    c.apply(apply_req("cut", 16)).await.unwrap();
    // Mid-way: some nodes are on their way, none is ready yet.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = c.get_run(get("cut")).await.unwrap().into_inner();
        if s.pending_operations > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing was dispatched: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.cut(Link::Executor).unwrap();
    // Longer than the operations' deadline and its grace (2 s): they end
    // ambiguous.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let during = c.get_run(get("cut")).await.unwrap().into_inner();
    assert!(!during.converged, "{during:?}");
    cluster.restore(Link::Executor).unwrap();
    let restored = std::time::Instant::now();

    let done = watch_until(&mut c, "cut", CONVERGE, |s| s.converged)
        .await
        .unwrap();
    let reconverged = restored.elapsed();
    assert_eq!(done.ready_count, 16);
    let nodes = c.get_run(get("cut")).await.unwrap().into_inner().nodes;
    assert_eq!(nodes.len(), 16);
    // One live resource per slot, from the executor's own inventory.
    one_resource_per_slot(&cluster, 16).await;
    // What was in flight when the link went ended ambiguous, by the
    // driver's own count.
    let metrics = cluster.driver_metrics().await.unwrap();
    let ambiguous = ended(&metrics, "ambiguous");
    assert!(ambiguous >= 1, "no operation ended ambiguous:\n{metrics}");
    eprintln!(
        "executor link cut 5 s: converged {:.1} s after it was back, {} passes, \
         {ambiguous} operations ambiguous, {} succeeded",
        reconverged.as_secs_f64(),
        done.passes,
        ended(&metrics, "succeeded"),
    );
}

/// The driver's link to the decider is cut: no pass is applied while it
/// is, the folds go on, and once it is back the run converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_decider_link_stops_decisions_until_it_is_back() {
    let cluster = NetCluster::start(
        &["--backoff-base-ms", "50", "--backoff-cap-ms", "500"],
        &[
            "--backend",
            "fake",
            "--fake-latency-ms",
            "20,80",
            "--fake-stage-interval-ms",
            "300",
        ],
    )
    .await
    .unwrap();
    let mut c = cluster.client().await.unwrap();
    c.apply(apply_req("held", 10)).await.unwrap();
    watch_until(&mut c, "held", CONVERGE, |s| s.node_count == 10 && !s.converged)
        .await
        .unwrap();
    cluster.cut(Link::Decider).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = c.get_run(get("held")).await.unwrap().into_inner();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = c.get_run(get("held")).await.unwrap().into_inner();
    assert_eq!(
        during.passes, later.passes,
        "a pass was applied while the decider was cut off"
    );
    assert!(!later.converged);
    cluster.restore(Link::Decider).unwrap();
    let restored = std::time::Instant::now();
    let done = watch_until(&mut c, "held", CONVERGE, |s| s.converged)
        .await
        .unwrap();
    assert_eq!(done.ready_count, 10);
    assert!(done.passes > later.passes);
    eprintln!(
        "decider link cut 3.5 s: converged {:.1} s after it was back, {} passes after",
        restored.elapsed().as_secs_f64(),
        done.passes - later.passes,
    );
}

/// The executor's link cut one way for longer than the deadlines: the
/// driver's operations reach the executor and run, but nothing the executor
/// sends comes back. Every answer is lost, so each operation ends ambiguous,
/// is sent again once the link is whole, and is answered from what the
/// executor already did: one resource per slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_lost_one_way_are_sent_again_and_double_nothing() {
    let cluster = short_deadlines().await;
    let mut c = cluster.client().await.unwrap();
    // The answers stop before anything is sent: every create goes out, runs,
    // and its result is lost.
    cluster.cut_one_way(Link::Executor, true).unwrap();
    c.apply(apply_req("oneway", 8)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let during = c.get_run(get("oneway")).await.unwrap().into_inner();
    assert_eq!(during.ready_count, 0, "{during:?}");
    // The creates did run: the executor holds their leases, which the
    // driver has not heard of.
    let held = cluster.inventory().await.unwrap();
    assert!(!held.is_empty(), "the creates never reached the executor");
    cluster.restore_one_way(Link::Executor, true).unwrap();
    let restored = std::time::Instant::now();

    let done = watch_until(&mut c, "oneway", CONVERGE, |s| s.converged)
        .await
        .unwrap();
    assert_eq!(done.ready_count, 8);
    one_resource_per_slot(&cluster, 8).await;
    let metrics = cluster.driver_metrics().await.unwrap();
    eprintln!(
        "executor answers lost 5 s: converged {:.1} s after the link was whole, \
         {} operations ambiguous, {} succeeded",
        restored.elapsed().as_secs_f64(),
        ended(&metrics, "ambiguous"),
        ended(&metrics, "succeeded"),
    );
}

/// Every link slow and lossy (200 ms ± 100 ms each way, 5% of packets
/// lost, through `netdelay`: this kernel has no netem) for the whole of a
/// 200-node convergence: it converges, with one resource per slot. The
/// time it took and what ended ambiguous are printed for the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_lossy_network_converges_200_nodes_without_doubling() {
    let mut cluster = NetCluster::start(
        &["--backoff-base-ms", "100", "--backoff-cap-ms", "2000"],
        &[
            "--backend",
            "fake",
            "--fake-latency-ms",
            "20,80",
            "--fake-stage-interval-ms",
            "100",
        ],
    )
    .await
    .unwrap();
    cluster.impair(200, 100, 0.05, 7).unwrap();
    let started = std::time::Instant::now();
    let mut c = cluster.client().await.unwrap();
    // The driver's answers are held at least 100 ms: the network is slow.
    let call = std::time::Instant::now();
    c.list_runs(pb::ListRunsRequest::default()).await.unwrap();
    assert!(
        call.elapsed() >= Duration::from_millis(100),
        "a call took {:?} on a link that holds every packet 100-300 ms",
        call.elapsed()
    );
    c.apply(apply_req("slow", 200)).await.unwrap();
    let done = watch_until(&mut c, "slow", Duration::from_secs(300), |s| s.converged)
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(done.ready_count, 200);
    one_resource_per_slot(&cluster, 200).await;
    let metrics = cluster.driver_metrics().await.unwrap();
    let count = |outcome: &str| ended(&metrics, outcome);
    // Packets were lost: about 5% of what was sent.
    let (passed, dropped) = cluster.impaired_packets();
    let lost = dropped as f64 / (passed + dropped).max(1) as f64;
    assert!(
        (0.02..0.10).contains(&lost),
        "{dropped} of {} packets lost",
        passed + dropped
    );
    eprintln!(
        "200 nodes over 200±100 ms and 5% loss: converged in {:.1} s, {} passes, \
         operations succeeded {}, ambiguous {}; {passed} packets delayed, {dropped} dropped",
        took.as_secs_f64(),
        done.passes,
        count("succeeded"),
        count("ambiguous"),
    );
}
