//! The public API's limits against the real binaries: load over the
//! concurrency limit is shed at once with `RESOURCE_EXHAUSTED` and a retry
//! hint (never queued into a timeout); each client has its own rate limit
//! (a token's, or a peer address's without authentication); watch streams
//! are capped per client and a closed one gives its slot back; messages
//! over the size limits are refused by the driver, the executor and the
//! decider. No refused call changes anything.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeMap, time::Duration};

use contract::pb::{self, decider_client::DeciderClient, executor_client::ExecutorClient};
use provisioning_tests::{
    auth::{AuthedClient, Grant, Tokens, client},
    procs::{Cluster, ClusterOptions, Service},
    shapes::{shape, with_template},
};
use tonic::Code;

const PUSHBACK: &str = "grpc-retry-pushback-ms";

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

fn get_req(run: &str) -> pb::GetRunRequest {
    pb::GetRunRequest {
        run_id: run.to_owned(),
        include_nodes: false,
    }
}

fn watch_req(run: &str) -> pb::WatchRunRequest {
    pb::WatchRunRequest {
        run_id: run.to_owned(),
        include_nodes: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_over_the_concurrency_limit_is_shed_with_a_retry_hint() {
    let opts = ClusterOptions::default()
        .driver("--max-concurrent-requests", "1")
        .driver("--overload-retry-ms", "150")
        .driver("--rate-limit", "0");
    let cluster = Cluster::start(opts).await.unwrap();
    // Plans of a large shape keep the one slot busy for a while; each
    // client has its own connection, so the calls arrive together.
    let big = pb::PlanRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            "big",
            1,
            "fake",
            &[("workers", 20_000, "img:1")],
        ))),
    };
    let mut clients = Vec::new();
    for _ in 0..16 {
        clients.push(cluster.client().await.unwrap());
    }
    let mut codes: BTreeMap<String, usize> = BTreeMap::new();
    let mut shed = None;
    for _round in 0..20 {
        let calls: Vec<_> = clients
            .iter()
            .map(|c| {
                let mut c = c.clone();
                let req = big.clone();
                tokio::spawn(async move { c.plan(req).await })
            })
            .collect();
        for call in calls {
            match call.await.unwrap() {
                Ok(_) => *codes.entry("OK".into()).or_default() += 1,
                Err(s) => {
                    *codes.entry(format!("{:?}", s.code())).or_default() += 1;
                    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
                    shed = Some(s);
                }
            }
        }
        if shed.is_some() {
            break;
        }
    }
    eprintln!("outcomes: {codes:?}");
    let shed = shed.expect("no call was shed with one slot and 16 concurrent clients");
    assert!(
        shed.message()
            .contains("limit of 1 calls in flight (--max-concurrent-requests)")
            && shed.message().contains("retry in 150 ms"),
        "{}",
        shed.message()
    );
    assert_eq!(shed.metadata().get(PUSHBACK).unwrap(), "150");
    assert!(
        codes.get("OK").copied().unwrap_or(0) > 0,
        "nothing was served: {codes:?}"
    );
    // Shed, not broken: the next call is served.
    let mut c = cluster.client().await.unwrap();
    c.apply(apply_req("after", 1, 1)).await.unwrap();
    c.get_run(get_req("after")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_token_has_its_own_rate_limit() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = Tokens::write(dir.path(), &[Grant::write("a"), Grant::write("b")]).unwrap();
    let opts = ClusterOptions::default()
        .tokens_file(&tokens.path)
        .driver("--rate-limit", "5")
        .driver("--rate-limit-window-ms", "600000");
    let cluster = Cluster::start_in(dir, opts).await.unwrap();
    let mut a = client(&cluster, Some(tokens.token("a").unwrap())).await.unwrap();
    let mut b = client(&cluster, Some(tokens.token("b").unwrap())).await.unwrap();
    a.apply(apply_req("mine", 1, 1)).await.unwrap();
    for _ in 0..4 {
        a.list_runs(pb::ListRunsRequest::default()).await.unwrap();
    }
    let before = b.get_run(get_req("mine")).await.unwrap().into_inner();
    // The sixth call in the window: refused, with a hint, and not applied.
    let e = a.apply(apply_req("mine", 2, 3)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message()
            .contains("token \"a\" is over its rate limit of 5 calls per 600000 ms (--rate-limit)"),
        "{}",
        e.message()
    );
    // Five calls per ten minutes: one call's budget comes back every two
    // minutes, and the hint is the time until then, not a whole window.
    let hint: u64 = e
        .metadata()
        .get(PUSHBACK)
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((110_000..=120_000).contains(&hint), "{hint}");
    let e = a.get_run(get_req("mine")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    // Another token's budget is its own.
    let after = b.get_run(get_req("mine")).await.unwrap().into_inner();
    assert_eq!(after.generation, 1);
    assert_eq!(before.generation, after.generation);
    b.apply(apply_req("mine", 2, 2)).await.unwrap();
}

/// Without authentication, the peer address is the client: its rate limit,
/// and the request-size limit (refused as `RESOURCE_EXHAUSTED`, the code gRPC
/// gives an over-large message).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_address_has_a_rate_limit_and_requests_have_a_size_limit() {
    let opts = ClusterOptions::default()
        .driver("--rate-limit", "4")
        .driver("--rate-limit-window-ms", "600000")
        .driver("--max-recv-message-bytes", "4096");
    let cluster = Cluster::start(opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();

    let large = with_template(
        shape("large", 1, "fake", &[("workers", 1, "img:1")]),
        "workers",
        |t| {
            t.role = "r".repeat(5000);
        },
    );
    let e = c
        .apply(pb::ApplyRequest {
            shape: Some(pb::ClusterShape::from(&large)),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message()
            .contains("larger than this server accepts (--max-recv-message-bytes)")
            && e.message().contains("4096"),
        "{}",
        e.message()
    );
    // Refused before the handler: nothing was created.
    c.apply(apply_req("small", 1, 1)).await.unwrap();
    let runs = c
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert_eq!(
        runs.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(),
        ["small"]
    );
    c.get_run(get_req("small")).await.unwrap();

    // Four calls were made from this address in the window: the fifth is refused.
    let e = c.get_run(get_req("small")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains("client 127.0.0.1 is over its rate limit"),
        "{}",
        e.message()
    );
    assert!(e.metadata().get(PUSHBACK).is_some());

    // Health is not limited.
    let mut health = tonic_health::pb::health_client::HealthClient::new(cluster.channel().await.unwrap());
    for _ in 0..10 {
        health
            .check(tonic_health::pb::HealthCheckRequest {
                service: "provisioning.v1.Provisioning".into(),
            })
            .await
            .unwrap();
    }
}

async fn open_watch(
    c: &mut AuthedClient,
    run: &str,
) -> Result<tonic::Streaming<pb::RunStatus>, tonic::Status> {
    let mut s = c.watch_run(watch_req(run)).await?.into_inner();
    // The first status arrives at once: the stream is open.
    s.message().await?.expect("the watch ended at once");
    Ok(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_are_capped_per_client_and_given_back_when_closed() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = Tokens::write(dir.path(), &[Grant::write("a"), Grant::read("b")]).unwrap();
    let opts = ClusterOptions::default()
        .tokens_file(&tokens.path)
        .driver("--max-watches-per-client", "2")
        .service_env("driver-svc", "PROVISIONING_METRICS_LISTEN", "127.0.0.1:0");
    let cluster = Cluster::start_in(dir, opts).await.unwrap();
    let mut a = client(&cluster, Some(tokens.token("a").unwrap())).await.unwrap();
    let mut b = client(&cluster, Some(tokens.token("b").unwrap())).await.unwrap();
    a.apply(apply_req("w", 1, 1)).await.unwrap();

    let first = open_watch(&mut a, "w").await.unwrap();
    let _second = open_watch(&mut a, "w").await.unwrap();
    let e = open_watch(&mut a, "w").await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message()
            .contains("token \"a\" has 2 watch streams open, its limit (--max-watches-per-client)"),
        "{}",
        e.message()
    );
    // Other calls, and other clients' watches, are not affected.
    a.get_run(get_req("w")).await.unwrap();
    let _b1 = open_watch(&mut b, "w").await.unwrap();
    let _b2 = open_watch(&mut b, "w").await.unwrap();

    // A closed stream gives its slot back (once the driver sees it go).
    drop(first);
    let mut reopened = None;
    for _ in 0..100 {
        match open_watch(&mut a, "w").await {
            Ok(s) => {
                reopened = Some(s);
                break;
            }
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    assert!(reopened.is_some(), "the closed watch's slot never came back");

    let metrics = cluster.driver.scrape().await.unwrap();
    let line = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in\n{metrics}"))
            .to_owned()
    };
    let watches: f64 = line("provisioning_api_watches ")
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert_eq!(watches, 4.0);
    let refused: u64 = line("provisioning_api_refused_total{reason=\"watch_limit\"}")
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(refused >= 1, "{refused}");

    // Every stream closed: none is left open on the driver.
    drop((reopened, _second, _b1, _b2));
    let mut open = None;
    for _ in 0..100 {
        let metrics = cluster.driver.scrape().await.unwrap();
        open = provisioning_tests::procs::sample(&metrics, "provisioning_api_watches");
        if open == Some(0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(open, Some(0.0));
}

/// The executor and the decider refuse a message over their
/// `--max-recv-message-bytes` too: the decider's call fails with tonic's
/// `OUT_OF_RANGE`, the executor ends the link without acting on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_executor_and_the_decider_refuse_over_large_messages() {
    let dir = tempfile::tempdir().unwrap();
    let limit = ["--max-recv-message-bytes".to_owned(), "1024".to_owned()];
    let decider = Service::start("decider-svc", dir.path(), "127.0.0.1:0", &limit)
        .await
        .unwrap();
    let mut executor_args = vec!["--backend".to_owned(), "fake".to_owned()];
    executor_args.extend(limit.iter().cloned());
    let executor = Service::start("executor-svc", dir.path(), "127.0.0.1:0", &executor_args)
        .await
        .unwrap();
    let big = "x".repeat(2000);

    let mut d = DeciderClient::new(decider.channel(Some(platform::tls::DRIVER)).await.unwrap());
    let header = pb::DecideRequest {
        part: Some(pb::decide_request::Part::Header(pb::DecideHeader {
            desired: Some(pb::ClusterShape {
                run_id: big.clone(),
                ..Default::default()
            }),
            ..Default::default()
        })),
        trace: None,
    };
    let answer = match d.decide(tokio_stream::iter([header])).await {
        Ok(r) => r.into_inner().message().await.map(|_| ()),
        Err(e) => Err(e),
    };
    let e = answer.unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    assert!(
        e.message().contains("too large") && e.message().contains("1024"),
        "{}",
        e.message()
    );

    // The executor ends a link whose message is too large without acting
    // on it; the same claim, small, is answered.
    let mut x = ExecutorClient::new(executor.channel(Some(platform::tls::DRIVER)).await.unwrap());
    let claim = |run_id: &str| pb::DriverMessage {
        kind: Some(pb::driver_message::Kind::Claim(pb::Claim {
            run_uid: "0123456789abcdef0123456789abcdef".into(),
            run_id: run_id.to_owned(),
            epoch: 1,
        })),
        trace: None,
    };
    let first_answer = |x: &mut ExecutorClient<tonic::transport::Channel>, msg: pb::DriverMessage| {
        let mut x = x.clone();
        async move {
            // The request stream stays open (a link), so the answer is
            // the executor's, not the end of our side.
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tx.send(msg).await.unwrap();
            let mut answers = x
                .link(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            // What the executor serves comes first on every link: not an
            // answer to the message.
            let answer = tokio::time::timeout(Duration::from_secs(10), async {
                loop {
                    match answers.message().await {
                        Ok(Some(pb::ExecutorMessage {
                            kind: Some(pb::executor_message::Kind::Providers(_)),
                            ..
                        })) => {}
                        other => return other,
                    }
                }
            })
            .await
            .expect("no answer in 10 s");
            drop(tx);
            answer
        }
    };
    let answer = first_answer(&mut x, claim(&big)).await;
    assert!(
        matches!(answer, Ok(None) | Err(_)),
        "the executor acted on an over-large message: {answer:?}"
    );
    let answer = first_answer(&mut x, claim("r")).await.unwrap();
    assert!(answer.is_some(), "a small claim was not answered");
    // Still serving: a small call is answered.
    x.inventory(pb::InventoryRequest::default()).await.unwrap();
}

/// The shape-size limits (`--max-groups`, `--max-nodes-per-group`,
/// `--max-nodes-total`) refuse a shape over them with `INVALID_ARGUMENT`
/// naming the field, for apply and plan alike, and nothing is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shapes_over_the_node_and_group_limits_are_refused() {
    let opts = ClusterOptions::default()
        .driver("--max-groups", "2")
        .driver("--max-nodes-per-group", "3")
        .driver("--max-nodes-total", "4");
    let cluster = Cluster::start(opts).await.unwrap();
    let mut c = cluster.client().await.unwrap();
    let cases = [
        (
            shape("big", 1, "fake", &[("workers", 4, "img:1")]),
            "shape.groups[0].count is 4; the limit is 3 (driver-svc --max-nodes-per-group)",
        ),
        (
            shape("big", 1, "fake", &[("a", 3, "img:1"), ("b", 2, "img:1")]),
            "shape.groups hold 5 nodes in all; the limit is 4 (driver-svc --max-nodes-total)",
        ),
        (
            shape(
                "big",
                1,
                "fake",
                &[("a", 1, "img:1"), ("b", 1, "img:1"), ("c", 1, "img:1")],
            ),
            "shape.groups are 3 groups; the limit is 2 (driver-svc --max-groups)",
        ),
    ];
    for (s, says) in cases {
        let wire = Some(pb::ClusterShape::from(&s));
        let e = c
            .apply(pb::ApplyRequest { shape: wire.clone() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(says), "{} does not say {says}", e.message());
        let e = c.plan(pb::PlanRequest { shape: wire }).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    let runs = c
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(runs.runs.is_empty(), "{runs:?}");
    // At the limits exactly, it is accepted.
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            "big",
            1,
            "fake",
            &[("a", 3, "img:1"), ("b", 1, "img:1")],
        ))),
    })
    .await
    .unwrap();
}
