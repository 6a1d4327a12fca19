//! The three real binaries as separate processes on loopback, driven through
//! the public gRPC API.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeMap, time::Duration};

use contract::pb::{self, provisioning_client::ProvisioningClient};
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, Proxy, eventually, watch_until},
    shapes::{shape, with_template},
};
use tonic::{Code, transport::Channel};

const CONVERGE: Duration = Duration::from_secs(60);

fn wire(s: &contract::ClusterShape) -> pb::ClusterShape {
    pb::ClusterShape::from(s)
}

fn groups(workers: u32, gpu: u32, image: &str) -> contract::ClusterShape {
    shape(
        "e2e",
        1,
        "fake",
        &[
            ("ctrl", 3, "img:1"),
            ("workers", workers, "img:1"),
            ("gpu", gpu, image),
        ],
    )
}

fn at(mut s: contract::ClusterShape, generation: u64) -> contract::ClusterShape {
    s.generation = contract::Generation::new(generation);
    s
}

async fn apply(c: &mut ProvisioningClient<Channel>, s: &contract::ClusterShape) -> pb::ApplyResponse {
    c.apply(pb::ApplyRequest { shape: Some(wire(s)) })
        .await
        .unwrap()
        .into_inner()
}

async fn converged(cluster: &Cluster, c: &mut ProvisioningClient<Channel>, generation: u64) -> pb::RunStatus {
    match watch_until(c, "e2e", CONVERGE, |s| s.converged && s.generation == generation).await {
        Ok(s) => s,
        Err(e) => {
            cluster.dump_logs();
            let s = c
                .get_run(pb::GetRunRequest {
                    run_id: "e2e".into(),
                    include_nodes: true,
                })
                .await;
            if let Ok(s) = s {
                for n in &s.get_ref().nodes {
                    eprintln!("{:?} last={:?}", n.state, n.last_decision);
                }
            }
            panic!("{e}");
        }
    }
}

/// Slot → attempts holding live resources, from the executor's inventory.
async fn resources_by_slot(cluster: &Cluster) -> BTreeMap<String, Vec<u64>> {
    let mut m: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for r in cluster.inventory().await.unwrap() {
        m.entry(r.node_id).or_default().push(r.attempt);
    }
    m
}

async fn nodes(c: &mut ProvisioningClient<Channel>) -> BTreeMap<String, pb::NodeState> {
    let s = c
        .get_run(pb::GetRunRequest {
            run_id: "e2e".into(),
            include_nodes: true,
        })
        .await
        .unwrap()
        .into_inner();
    s.nodes
        .into_iter()
        .filter_map(|n| n.state)
        .map(|n| (n.node_id.clone(), n))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn converge_scale_replace_and_delete_across_three_processes() {
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    let mut c = cluster.client().await.unwrap();

    let created = apply(&mut c, &groups(12, 6, "img:1")).await;
    assert!(created.created);
    let s = converged(&cluster, &mut c, 1).await;
    assert_eq!(s.ready_count, 21);
    assert_eq!(resources_by_slot(&cluster).await.len(), 21);
    let before = nodes(&mut c).await;

    // Scale up: the new slots appear, the old ones keep their attempts.
    apply(&mut c, &at(groups(16, 6, "img:1"), 2)).await;
    converged(&cluster, &mut c, 2).await;
    let after_up = nodes(&mut c).await;
    assert_eq!(after_up.len(), 25);
    for (id, n) in &before {
        assert_eq!(after_up[id].attempt, n.attempt, "{id} replaced by scale-up");
    }

    // Scale down: only the highest indices go.
    apply(&mut c, &at(groups(4, 6, "img:1"), 3)).await;
    converged(&cluster, &mut c, 3).await;
    let after_down = nodes(&mut c).await;
    let workers: Vec<&String> = after_down.keys().filter(|k| k.starts_with("workers-")).collect();
    assert_eq!(workers, ["workers-0", "workers-1", "workers-2", "workers-3"]);
    let inv = resources_by_slot(&cluster).await;
    assert_eq!(inv.len(), 13, "{inv:?}");

    // Image change: every gpu node is replaced, nothing else is.
    let changed = with_template(at(groups(4, 6, "img:1"), 4), "gpu", |t| t.image = "img:2".into());
    apply(&mut c, &changed).await;
    converged(&cluster, &mut c, 4).await;
    let after_img = nodes(&mut c).await;
    for (id, n) in &after_img {
        if id.starts_with("gpu-") {
            assert!(n.attempt > after_down[id].attempt, "{id} not replaced");
        } else {
            assert_eq!(n.attempt, after_down[id].attempt, "{id} replaced needlessly");
        }
    }
    for (slot, attempts) in resources_by_slot(&cluster).await {
        assert_eq!(attempts.len(), 1, "{slot} holds resources of {attempts:?}");
    }

    // Delete: the run goes away and the inventory is empty.
    c.delete_run(pb::DeleteRunRequest { run_id: "e2e".into() })
        .await
        .unwrap();
    watch_until(&mut c, "e2e", CONVERGE, |s| {
        s.phase == pb::RunPhase::Deleted as i32
    })
    .await
    .unwrap();
    let inv = cluster.inventory().await.unwrap();
    assert!(inv.is_empty(), "leaked after delete: {inv:?}");
    let gone = c
        .get_run(pb::GetRunRequest {
            run_id: "e2e".into(),
            include_nodes: false,
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decider_outage_stops_decisions_until_it_returns() {
    // Slow stages so the run is mid-way when the decider goes.
    let opts = ClusterOptions::default().executor("--fake-stage-interval-ms", "300");
    let mut cluster = Cluster::start(opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    apply(&mut c, &groups(12, 6, "img:1")).await;
    // A watcher sees the latest status, not every intermediate one: wait for
    // the nodes to exist (bootstraps then take ~1.5 s at this pace).
    watch_until(&mut c, "e2e", CONVERGE, |s| s.node_count == 21 && !s.converged)
        .await
        .unwrap();

    cluster.decider.kill().await.unwrap();
    // Let in-flight results arrive and fold.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during: pb::RunStatus = c
        .get_run(pb::GetRunRequest {
            run_id: "e2e".into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later: pb::RunStatus = c
        .get_run(pb::GetRunRequest {
            run_id: "e2e".into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        during.passes, later.passes,
        "a pass was applied while the decider was down"
    );
    assert!(!later.converged);
    // Folding went on: observations kept arriving while no decision was made.
    assert!(
        later.folded_observations > during.folded_observations
            || later.folded_results >= during.folded_results,
        "nothing was folded during the outage"
    );

    cluster.decider.restart(cluster.dir.path()).await.unwrap();
    let s = converged(&cluster, &mut c, 1).await;
    assert!(s.passes > later.passes);
    assert_eq!(s.ready_count, 21);
}

/// Decide calls `service` answered, from its metrics.
async fn decides_served(service: &provisioning_tests::procs::Service) -> f64 {
    service
        .scrape()
        .await
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("grpc_server_handled_total{") && l.contains("grpc_method=\"Decide\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Two deciders named to the driver (`--decider a,b`; a headless Service's
/// name resolving to both is the same) share the Decide calls in turn; when
/// one is gone, the other takes them and the run converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decide_calls_are_shared_by_the_deciders_and_outlive_one() {
    let opts = ClusterOptions::default().deciders(2).service_env(
        "decider-svc",
        "PROVISIONING_METRICS_LISTEN",
        "127.0.0.1:0",
    );
    let mut cluster = Cluster::start(opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    apply(&mut c, &groups(12, 6, "img:1")).await;
    let s = converged(&cluster, &mut c, 1).await;
    let first = decides_served(&cluster.decider).await;
    let second = decides_served(&cluster.more_deciders[0]).await;
    // In turn: the two counts differ by at most the one call in flight.
    assert!(
        first >= 2.0 && second >= 2.0 && (first - second).abs() <= 1.0,
        "{first} and {second} Decide calls over {} passes",
        s.passes
    );

    cluster.more_deciders[0].kill().await.unwrap();
    apply(&mut c, &at(groups(16, 6, "img:1"), 2)).await;
    let s = converged(&cluster, &mut c, 2).await;
    assert_eq!(s.ready_count, 25);
    assert!(decides_served(&cluster.decider).await > first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_restart_resubmits_and_adopts() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("fake-state.json");
    let opts = ClusterOptions::default()
        .executor("--fake-state-file", &state.display().to_string())
        .executor("--fake-latency-ms", "50,200");
    let mut cluster = Cluster::start_in(dir, opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    apply(&mut c, &groups(12, 6, "img:1")).await;
    watch_until(&mut c, "e2e", CONVERGE, |s| s.ready_count >= 3)
        .await
        .unwrap();

    cluster.executor.kill().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.executor.restart(cluster.dir.path()).await.unwrap();

    let s = converged(&cluster, &mut c, 1).await;
    assert_eq!(s.ready_count, 21);
    let by_slot = resources_by_slot(&cluster).await;
    assert_eq!(by_slot.len(), 21, "{by_slot:?}");
    let states = nodes(&mut c).await;
    for (slot, attempts) in by_slot {
        assert_eq!(
            attempts,
            vec![states[&slot].attempt],
            "{slot}: resources of other attempts"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_stream_loses_no_result_or_observation() {
    let proxy = Proxy::start().await.unwrap();
    // Long deadlines: a lost message would stall the run past the test's limit
    // instead of being papered over by a deadline fold or a safety tick.
    let mut opts = ClusterOptions::default()
        .driver("--operation-timeout-ms", "600000")
        .driver("--safety-tick-ms", "600000")
        .executor("--fake-stage-interval-ms", "40");
    opts.executor_via = Some(format!("http://{}", proxy.addr));
    let cluster = Cluster::start(opts).await.unwrap();
    proxy.set_target(cluster.executor.addr);
    let mut c = cluster.client().await.unwrap();
    apply(&mut c, &groups(12, 6, "img:1")).await;
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(120)).await;
        proxy.cut();
    }
    let s = converged(&cluster, &mut c, 1).await;
    assert_eq!(s.ready_count, 21);
    // Without faults each node runs exactly two operations (create, which
    // reports the endpoint, and start-bootstrap) and its bootstrap streams five
    // stages: every one of them folded exactly once, none lost.
    assert_eq!(s.folded_results, 42, "{s:?}");
    assert_eq!(s.folded_observations, 21 * 5, "{s:?}");
    assert_eq!(cluster.inventory().await.unwrap().len(), 21);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_its_status_and_changes_nothing() {
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    apply(&mut c, &at(groups(2, 1, "img:1"), 5)).await;
    let get = |c: &mut ProvisioningClient<Channel>| {
        let mut c = c.clone();
        async move {
            c.get_run(pb::GetRunRequest {
                run_id: "e2e".into(),
                include_nodes: false,
            })
            .await
            .unwrap()
            .into_inner()
        }
    };
    let before = get(&mut c).await;

    let good = wire(&at(groups(2, 1, "img:1"), 6));
    let mut cases: Vec<(&str, pb::ClusterShape, Code, &str)> = Vec::new();
    let mut s = good.clone();
    s.run_id = "E2E!".into();
    cases.push(("malformed run id", s, Code::InvalidArgument, "shape.run_id"));
    let mut s = good.clone();
    s.groups[1].id = "Workers".into();
    cases.push((
        "malformed group id",
        s,
        Code::InvalidArgument,
        "shape.groups[1].id",
    ));
    let mut s = good.clone();
    s.groups[1].id = "ctrl".into();
    cases.push((
        "duplicate group id",
        s,
        Code::InvalidArgument,
        "shape.groups[1].id",
    ));
    let mut s = good.clone();
    s.groups[0]
        .template
        .as_mut()
        .unwrap()
        .provider
        .as_mut()
        .unwrap()
        .cpu = f64::NAN;
    cases.push((
        "non-finite cpu",
        s,
        Code::InvalidArgument,
        "shape.groups[0].template.provider.cpu",
    ));
    let mut s = good.clone();
    s.groups[0]
        .template
        .as_mut()
        .unwrap()
        .provider
        .as_mut()
        .unwrap()
        .memory_gib = -2.0;
    cases.push((
        "negative memory",
        s,
        Code::InvalidArgument,
        "shape.groups[0].template.provider.memory_gib",
    ));
    let mut s = good.clone();
    s.groups[0].count = -1;
    cases.push((
        "negative count",
        s,
        Code::InvalidArgument,
        "shape.groups[0].count",
    ));
    let mut s = good.clone();
    s.groups[0].count = 1_000_000;
    cases.push((
        "count over the limit",
        s,
        Code::InvalidArgument,
        "shape.groups[0].count is 1000000; the limit is 100000 (driver-svc --max-nodes-per-group)",
    ));
    let mut s = good.clone();
    s.groups[0].count = 4_294_967_297;
    cases.push((
        "count past any limit",
        s,
        Code::InvalidArgument,
        "shape.groups[0].count is 4294967297, more than any limit allows (driver-svc --max-nodes-per-group",
    ));
    let mut s = good.clone();
    s.groups[0].run_id = "other".into();
    cases.push((
        "foreign-run group",
        s,
        Code::InvalidArgument,
        "shape.groups[0].run_id",
    ));
    let mut s = good.clone();
    s.generation = 4;
    cases.push((
        "generation regression",
        s,
        Code::FailedPrecondition,
        "generation 4",
    ));
    let mut s = good.clone();
    s.generation = 5;
    s.groups[0].count = 7;
    cases.push((
        "same generation, other content",
        s,
        Code::FailedPrecondition,
        "generation 5",
    ));

    for (what, shape, code, needle) in cases {
        let err = c
            .apply(pb::ApplyRequest { shape: Some(shape) })
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{what}: {err:?}");
        assert!(
            err.message().contains(needle),
            "{what}: {:?} does not name {needle}",
            err.message()
        );
        let now = get(&mut c).await;
        assert_eq!(now.generation, before.generation, "{what} changed the generation");
        assert_eq!(now.shape, before.shape, "{what} changed the shape");
    }

    // Same generation, same content: an idempotent no-op.
    let same = c
        .apply(pb::ApplyRequest {
            shape: Some(wire(&at(groups(2, 1, "img:1"), 5))),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!same.changed);

    // Run and node ids are checked at the edge, by field; a well-formed id
    // of nothing is NOT_FOUND. Abandoning nothing changes nothing.
    let err = c
        .explain_node(pb::ExplainNodeRequest {
            run_id: "e2e".into(),
            node_id: "W 0".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("node_id"), "{err:?}");
    let err = c
        .abandon_node(pb::AbandonNodeRequest {
            run_id: "e2e".into(),
            node_id: "".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("node_id"), "{err:?}");
    let err = c
        .explain_node(pb::ExplainNodeRequest {
            run_id: "E2E!".into(),
            node_id: "w-0".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("run_id"), "{err:?}");
    let err = c
        .abandon_node(pb::AbandonNodeRequest {
            run_id: "e2e".into(),
            node_id: "w-99".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let err = c
        .delete_run(pb::DeleteRunRequest {
            run_id: "nothing".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let now = get(&mut c).await;
    assert_eq!((now.generation, &now.shape), (before.generation, &before.shape));

    // Apply to a deleting run is refused.
    c.delete_run(pb::DeleteRunRequest { run_id: "e2e".into() })
        .await
        .unwrap();
    let err = c.apply(pb::ApplyRequest { shape: Some(good) }).await;
    if let Err(err) = err {
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    } else {
        // The run may already be fully gone, in which case a new run is made.
        let s = get(&mut c).await;
        assert_eq!(s.generation, 6);
    }

    // Unknown run, bad run id on reads.
    let err = c
        .get_run(pb::GetRunRequest {
            run_id: "nope".into(),
            include_nodes: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .get_run(pb::GetRunRequest {
            run_id: "No Such".into(),
            include_nodes: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c.apply(pb::ApplyRequest { shape: None }).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("shape"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_answers_health_and_reflection() {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    for (svc, name) in [
        (&cluster.decider, "provisioning.internal.v1.Decider"),
        (&cluster.executor, "provisioning.internal.v1.Executor"),
        (&cluster.driver, "provisioning.v1.Provisioning"),
    ] {
        // As the driver: the decider and the executor answer reflection
        // only to it (health checks, to any certificate from the CA).
        let ch = svc.channel(Some(platform::tls::DRIVER)).await.unwrap();
        let mut health = HealthClient::new(ch.clone());
        let r = health
            .check(HealthCheckRequest { service: name.into() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{name}");

        let mut refl = ServerReflectionClient::new(ch);
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = refl
            .server_reflection_info(tokio_stream::iter(vec![req]))
            .await
            .unwrap()
            .into_inner();
        let msg = resp.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
            panic!("unexpected reflection answer from {name}");
        };
        // Exactly what the port serves: a driver's public port does not
        // advertise the internal Decider and Executor.
        let mut listed: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
        listed.sort_unstable();
        let mut want = vec![
            name,
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ];
        want.sort_unstable();
        assert_eq!(listed, want, "{name}");

        // The older reflection protocol, as older grpcurl and Python's
        // grpcio-reflection speak it, answers too.
        use tonic_reflection::pb::v1alpha::{
            ServerReflectionRequest as AlphaRequest,
            server_reflection_client::ServerReflectionClient as AlphaClient,
            server_reflection_request::MessageRequest as AlphaMessage,
            server_reflection_response::MessageResponse as AlphaResponse,
        };
        let ch = svc.channel(Some(platform::tls::DRIVER)).await.unwrap();
        let mut alpha = AlphaClient::new(ch);
        let mut resp = alpha
            .server_reflection_info(tokio_stream::iter(vec![AlphaRequest {
                host: String::new(),
                message_request: Some(AlphaMessage::ListServices(String::new())),
            }]))
            .await
            .unwrap()
            .into_inner();
        let msg = resp.message().await.unwrap().unwrap();
        let Some(AlphaResponse::ListServicesResponse(list)) = msg.message_response else {
            panic!("unexpected v1alpha reflection answer from {name}");
        };
        assert!(list.service.iter().any(|s| s.name == name), "{name}: {list:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_restart_loses_no_accepted_work() {
    let opts = ClusterOptions::default()
        .executor("--fake-latency-ms", "30,150")
        .executor("--fake-stage-interval-ms", "60");
    let mut cluster = Cluster::start(opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    apply(&mut c, &groups(12, 6, "img:1")).await;
    watch_until(&mut c, "e2e", CONVERGE, |s| s.ready_count >= 2)
        .await
        .unwrap();
    let before = nodes(&mut c).await;
    // Accepted, then the driver dies before it can act on it.
    let accepted = apply(&mut c, &at(groups(16, 6, "img:1"), 2)).await;
    assert!(accepted.changed);
    cluster.driver.kill().await.unwrap();
    cluster.driver.restart(cluster.dir.path()).await.unwrap();

    let mut c = cluster.client().await.unwrap();
    let s = c
        .get_run(pb::GetRunRequest {
            run_id: "e2e".into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.generation, 2, "the accepted apply was lost");
    assert_eq!(s.epoch, 2, "a restarted driver takes a new, larger epoch");
    let s = converged(&cluster, &mut c, 2).await;
    assert_eq!(s.ready_count, 25);
    let after = nodes(&mut c).await;
    for (id, n) in &before {
        assert!(after[id].attempt >= n.attempt, "{id}: attempt went backwards");
    }
    let states = nodes(&mut c).await;
    for (slot, attempts) in resources_by_slot(&cluster).await {
        assert_eq!(
            attempts,
            vec![states[&slot].attempt],
            "{slot}: resources of other attempts"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_driver_while_a_client_still_watches() {
    let mut cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    apply(&mut c, &groups(2, 1, "img:1")).await;
    converged(&cluster, &mut c, 1).await;
    // A watcher that never hangs up.
    let mut watch = c
        .watch_run(pb::WatchRunRequest {
            run_id: "e2e".into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(watch.message().await.unwrap().is_some());
    let status = cluster.driver.terminate().await.expect("the driver did not stop");
    assert!(status.success(), "{status}");
    // The watch ended with the driver rather than hanging.
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = watch.message().await {}
    })
    .await;
    assert!(end.is_ok(), "the watch stream outlived the driver");
}

/// Reads the run's nodes until `done` holds of them and of whether the run
/// is converged.
async fn nodes_until(
    c: &ProvisioningClient<Channel>,
    what: &str,
    done: impl Fn(&BTreeMap<String, pb::NodeState>, bool) -> bool,
) -> anyhow::Result<BTreeMap<String, pb::NodeState>> {
    let done = &done;
    eventually(CONVERGE, what, || {
        let mut c = c.clone();
        async move {
            let s = c
                .get_run(pb::GetRunRequest {
                    run_id: "e2e".into(),
                    include_nodes: true,
                })
                .await
                .ok()?
                .into_inner();
            let now: BTreeMap<String, pb::NodeState> = s
                .nodes
                .into_iter()
                .filter_map(|n| n.state)
                .map(|n| (n.node_id.clone(), n))
                .collect();
            done(&now, s.converged).then_some(now)
        }
    })
    .await
}

/// A resource lost or made sick through the fake's control service (a test
/// double the executor serves with `--fake-control`) is seen by the running
/// services as a real provider's would be: the lost slot is replaced on a
/// later attempt; a sick node is found by the executor's probes and replaced
/// once it has been unhealthy for its group's `unhealthy_after`, or, healed
/// before that, is healthy again on its own attempt; and the run converges
/// with one resource per slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_resources_lost_sick_or_healed_on_request() {
    use contract::pb::fake::v1::{Fault, InflictRequest};

    let opts = ClusterOptions {
        executor_args: [
            ClusterOptions::default().executor_args,
            vec!["--fake-control".into()],
        ]
        .concat(),
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    let mut s = shape(
        "e2e",
        1,
        "fake",
        &[("workers", 3, "img:1"), ("steady", 1, "img:1")],
    );
    for (g, unhealthy_after_ms) in s.groups.iter_mut().zip([500, 60_000]) {
        g.policy.health = contract::HealthPolicy {
            probe: contract::Probe::Tcp,
            interval_ms: 100,
            timeout_ms: 100,
            unhealthy_after_ms,
            startup_grace_ms: 0,
        };
    }
    let uid = apply(&mut c, &s).await.run_uid;
    converged(&cluster, &mut c, 1).await;
    let before = nodes(&mut c).await;
    let mut control = cluster.fake_control().await.unwrap();
    let inflict = |node: &str, fault: Fault| InflictRequest {
        run_uid: uid.clone(),
        node_id: node.to_owned(),
        attempt: before[node].attempt,
        fault: fault as i32,
    };
    let healthy = |n: &pb::NodeState| {
        n.facts
            .as_ref()
            .and_then(|f| f.health.as_ref())
            .map(|h| h.healthy)
    };

    control.inflict(inflict("steady-0", Fault::Sicken)).await.unwrap();
    let sick = nodes_until(&c, "steady-0 reported unhealthy", |n, converged| {
        !converged && healthy(&n["steady-0"]) == Some(false)
    })
    .await
    .unwrap_or_else(|e| {
        cluster.dump_logs();
        panic!("{e}")
    });
    assert_eq!(sick["steady-0"].attempt, before["steady-0"].attempt);
    control.inflict(inflict("steady-0", Fault::Heal)).await.unwrap();
    control.inflict(inflict("workers-0", Fault::Lose)).await.unwrap();
    control
        .inflict(inflict("workers-1", Fault::Sicken))
        .await
        .unwrap();
    let later = |n: &BTreeMap<String, pb::NodeState>, id: &str| n[id].attempt > before[id].attempt;
    let after = nodes_until(
        &c,
        "the lost and sick workers replaced, the run converged",
        |n, converged| {
            converged
                && healthy(&n["steady-0"]) == Some(true)
                && later(n, "workers-0")
                && later(n, "workers-1")
        },
    )
    .await
    .unwrap_or_else(|e| {
        cluster.dump_logs();
        panic!("{e}")
    });
    for (id, n) in &after {
        let replaced = n.attempt != before[id].attempt;
        assert_eq!(
            replaced,
            id == "workers-0" || id == "workers-1",
            "{id}: attempt {} -> {}",
            before[id].attempt,
            n.attempt
        );
        assert!(n.attempt >= before[id].attempt, "{id}");
        // A replacement need not have answered its first probe yet.
        assert_ne!(healthy(n), Some(false), "{id}");
    }
    for (slot, attempts) in resources_by_slot(&cluster).await {
        assert_eq!(attempts, [after[&slot].attempt], "{slot}");
    }
    // The lost attempt is gone: the control service finds nothing of it.
    let gone = control
        .inflict(inflict("workers-0", Fault::Heal))
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
}
