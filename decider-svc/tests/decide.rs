//! The decider service through a real server on `127.0.0.1:0`: answers equal
//! the in-process decider's, inserts come last, bad input is refused with the
//! field named, limits hold, and health and reflection answer.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;

use common::{Mixed, Server, at, mixed, now, refusal, trace};
use contract::{
    Action, DecideOutput, Rule,
    pb::{self, decide_request::Part},
};
use decider::{DesiredView, decide as decide_in_process};
use decider_svc::{DecideError, decide, encode_request, server::Config};
use tonic::{Code, Status, transport::Channel};

fn in_process(m: &Mixed, deleting: bool) -> DecideOutput {
    decide_in_process(&DesiredView::new(&m.shape, deleting), &m.nodes, &m.slots, now())
}

fn requests(m: &Mixed, deleting: bool) -> Vec<pb::DecideRequest> {
    encode_request(&m.shape, deleting, &m.nodes, &m.slots, now(), &trace())
}

#[tokio::test]
async fn a_remote_decide_equals_the_in_process_one() {
    let server = Server::start(Config::default()).await;
    let m = mixed();
    let remote = decide(&mut server.client().await, requests(&m, false))
        .await
        .unwrap();
    let local = in_process(&m, false);
    assert_eq!(remote, local);

    // The fixture must exercise what it claims to: many rules, and a requeue
    // chosen among several future waits with a past one left out.
    let rules: BTreeSet<Rule> = local.decisions.iter().map(|d| d.rule).collect();
    assert!(rules.len() >= 14, "only {rules:?}");
    assert_eq!(local.requeue_at, Some(at(1_000)));
    server.stop().await;
}

#[tokio::test]
async fn a_deleting_run_equals_the_in_process_one_and_gets_no_inserts() {
    let server = Server::start(Config::default()).await;
    let m = mixed();
    let remote = decide(&mut server.client().await, requests(&m, true))
        .await
        .unwrap();
    assert_eq!(remote, in_process(&m, true));
    assert_eq!(remote.decisions.len(), m.nodes.len());
    assert!(remote.decisions.iter().all(|d| d.rule != Rule::Insert));
    // Every active node that is not destroyed begins its cleanup.
    let begins = remote
        .decisions
        .iter()
        .filter(|d| d.rule == Rule::BeginDelete)
        .count();
    assert_eq!(begins, 10);
    server.stop().await;
}

#[tokio::test]
async fn inserts_for_missing_slots_follow_the_node_decisions() {
    let server = Server::start(Config::default()).await;
    let m = mixed();
    let out = decide(&mut server.client().await, requests(&m, false))
        .await
        .unwrap();
    let (nodes, inserts) = out.decisions.split_at(m.nodes.len());
    // Nodes a group budget decides (here, drifted ready ones under the
    // rollout budget) are answered after the others, once the budget has
    // seen every node of the call.
    let view = decider::DesiredView::new(&m.shape, false);
    let (budgeted, plain): (Vec<_>, Vec<_>) = m
        .nodes
        .iter()
        .partition(|n| decider::rolls_within_budget(&view, n));
    let sent: Vec<_> = plain.iter().chain(&budgeted).map(|n| n.id.to_string()).collect();
    let decided: Vec<_> = nodes.iter().map(|d| d.node.to_string()).collect();
    assert_eq!(decided, sent, "node decisions come first, in the order sent");
    let inserted: Vec<_> = inserts.iter().map(|d| d.node.to_string()).collect();
    // `cpu-6` has a node that was not sent (it needs no decision): no insert.
    assert_eq!(inserted, ["cpu-7", "gpu-4"]);
    assert!(
        inserts
            .iter()
            .all(|d| d.action == Action::Insert && d.attempt.is_none())
    );
    server.stop().await;
}

#[tokio::test]
async fn every_message_carries_the_trace_context_and_the_template_table_dedups() {
    let m = mixed();
    let reqs = requests(&m, false);
    assert!(
        reqs.iter()
            .all(|r| r.trace == Some(pb::TraceContext::from(&trace())))
    );
    let Some(Part::Header(header)) = &reqs[0].part else {
        panic!("the first message is not a header");
    };
    // cpu, gpu and the old template; the value-equal copy of cpu is not repeated.
    assert_eq!(header.templates.len(), 3);
    assert!(matches!(reqs.last().unwrap().part, Some(Part::End(_))));
}

#[tokio::test]
async fn the_first_message_must_be_a_header() {
    let server = Server::start(Config::default()).await;
    let m = mixed();
    let mut reqs = requests(&m, false);
    reqs.remove(0);
    let status = refusal(&server, reqs).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("`header`"), "{}", status.message());

    let status = refusal(&server, Vec::new()).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("`header`"), "{}", status.message());

    let mut reqs = requests(&m, false);
    let header = reqs[0].clone();
    reqs.insert(2, header);
    let status = refusal(&server, reqs).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("`header` was sent twice"),
        "{}",
        status.message()
    );
    server.stop().await;
}

#[tokio::test]
async fn a_malformed_node_is_refused_with_its_field_path() {
    let server = Server::start(Config::default()).await;
    let m = mixed();
    let mut reqs = requests(&m, false);
    let Some(Part::Nodes(batch)) = &mut reqs[1].part else {
        panic!("the second message is not a node batch");
    };
    batch.nodes[3].node_id = "cpu-03".to_owned();
    let status = refusal(&server, reqs).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("nodes[3].node_id "),
        "{}",
        status.message()
    );

    // The index counts across batches: the third node of the second batch.
    let nodes: Vec<_> = (0..1030)
        .map(|i| common::N::new(&format!("cpu-{i}"), &m.shape.groups[0].template).0)
        .collect();
    let mut reqs = encode_request(&m.shape, false, &nodes, &m.slots, now(), &trace());
    let Some(Part::Nodes(batch)) = &mut reqs[2].part else {
        panic!("the third message is not a node batch");
    };
    batch.nodes[2].pending = Some(pb::PendingOperation {
        id: Some(pb::OperationId { attempt: 0, seq: 1 }),
        effect: pb::Effect::CreateLease as i32,
        deadline_ms: 1,
        dispatched_at_ms: 0,
    });
    let status = refusal(&server, reqs).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("nodes[1026].pending.id.attempt "),
        "{}",
        status.message()
    );
    server.stop().await;
}

#[tokio::test]
async fn a_malformed_header_or_slot_batch_is_refused_with_its_field_path() {
    let server = Server::start(Config::default()).await;
    let m = mixed();
    let mut reqs = requests(&m, false);
    let Some(Part::Header(header)) = &mut reqs[0].part else {
        panic!("the first message is not a header");
    };
    header.templates[1].provider.as_mut().unwrap().cpu = f64::NAN;
    let status = refusal(&server, reqs).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("header.templates[1].provider.cpu "),
        "{}",
        status.message()
    );

    let mut reqs = requests(&m, false);
    let slots = reqs
        .iter_mut()
        .find_map(|r| match &mut r.part {
            Some(Part::Slots(s)) => Some(s),
            _ => None,
        })
        .unwrap();
    slots.group_id = "Not A Group".to_owned();
    let status = refusal(&server, reqs).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("slots.group_id "),
        "{}",
        status.message()
    );

    let mut reqs = requests(&m, false);
    reqs[1].part = None;
    let status = refusal(&server, reqs).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("`part` is required"),
        "{}",
        status.message()
    );
    server.stop().await;
}

#[tokio::test]
async fn a_stream_without_end_is_invalid_argument() {
    let server = Server::start(Config::default()).await;
    let m = mixed();
    let mut reqs = requests(&m, false);
    assert!(matches!(reqs.pop().unwrap().part, Some(Part::End(_))));
    let status = refusal(&server, reqs).await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("before `end`"), "{}", status.message());
    server.stop().await;
}

#[tokio::test]
async fn calls_over_max_nodes_are_resource_exhausted() {
    let m = mixed();
    let sent = u32::try_from(m.nodes.len()).unwrap();
    let held = u32::try_from(m.slots.len()).unwrap();
    assert!(held > sent);
    // At the limit exactly (the slot indices are the largest count), the call
    // goes through.
    let server = Server::start(Config {
        max_nodes: held,
        ..Config::default()
    })
    .await;
    let out = decide(&mut server.client().await, requests(&m, false))
        .await
        .unwrap();
    assert_eq!(out, in_process(&m, false));
    server.stop().await;

    let server = Server::start(Config {
        max_nodes: sent - 1,
        ..Config::default()
    })
    .await;
    let status = refusal(&server, requests(&m, true)).await;
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains(" nodes; the limit is "),
        "{}",
        status.message()
    );

    // Slot indices count too, even with no node sent.
    let status = refusal(
        &server,
        encode_request(&m.shape, true, [], &m.slots, now(), &trace()),
    )
    .await;
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("slot indices"), "{}", status.message());

    // And so do the desired slots, which would all become inserts.
    let small = Server::start(Config {
        max_nodes: 13,
        ..Config::default()
    })
    .await;
    let empty = decider::SlotSet::new();
    let status = refusal(
        &small,
        encode_request(&m.shape, false, [], &empty, now(), &trace()),
    )
    .await;
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("14 desired slots"),
        "{}",
        status.message()
    );
    // A deleting run wants no slot, so its shape is not counted.
    let out = decide(
        &mut small.client().await,
        encode_request(&m.shape, true, [], &empty, now(), &trace()),
    )
    .await
    .unwrap();
    assert_eq!(out, DecideOutput::default());
    server.stop().await;
    small.stop().await;
}

#[tokio::test]
async fn an_unreachable_decider_is_unavailable() {
    // Bind, learn the port, and close it, so nothing listens there.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy();
    let mut client = pb::decider_client::DeciderClient::new(channel);
    let m = mixed();
    match decide(&mut client, requests(&m, false)).await {
        Err(DecideError::Unavailable(_)) => {}
        other => panic!("expected unavailable, got {other:?}"),
    }
}

#[test]
fn statuses_sort_into_rejections_and_unavailability() {
    for code in [
        Code::InvalidArgument,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
    ] {
        assert!(matches!(
            DecideError::from_status(Status::new(code, "")),
            DecideError::Rejected(_)
        ));
    }
    for code in [
        Code::Unavailable,
        Code::DeadlineExceeded,
        Code::Cancelled,
        Code::Unknown,
        Code::Internal,
    ] {
        assert!(matches!(
            DecideError::from_status(Status::new(code, "")),
            DecideError::Unavailable(_)
        ));
    }
}

#[tokio::test]
async fn health_reports_serving_for_the_decider() {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };
    let server = Server::start(Config::default()).await;
    let mut health = HealthClient::new(server.channel().await);
    let response = health
        .check(HealthCheckRequest {
            service: "provisioning.internal.v1.Decider".to_owned(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.status(), ServingStatus::Serving);
    let unknown = health
        .check(HealthCheckRequest {
            service: "provisioning.internal.v1.Nope".to_owned(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    server.stop().await;
}

#[tokio::test]
async fn reflection_lists_the_decider() {
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let server = Server::start(Config::default()).await;
    let mut reflection = ServerReflectionClient::new(server.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer: {response:?}");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.iter().any(|n| n == "provisioning.internal.v1.Decider"),
        "{names:?}"
    );
    assert!(names.iter().any(|n| n == "grpc.health.v1.Health"), "{names:?}");
    server.stop().await;
}

/// The decider's route answers a method it does not serve as tonic's
/// generated routes do: `UNIMPLEMENTED`, on the `Decider` service's path too.
#[tokio::test]
async fn an_unknown_method_is_unimplemented() {
    let server = Server::start(Config::default()).await;
    let mut grpc = tonic::client::Grpc::new(server.channel().await);
    grpc.ready().await.unwrap();
    let status = grpc
        .unary(
            tonic::Request::new(pb::DecideEnd {}),
            tonic::codegen::http::uri::PathAndQuery::from_static("/provisioning.internal.v1.Decider/Nope"),
            tonic_prost::ProstCodec::<pb::DecideEnd, pb::DecideEnd>::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    server.stop().await;
}
