//! Slots as ranges: a real decider reads `slot_ranges` as the indices they
//! cover, says so in its response headers, and refuses malformed ranges with
//! the field named; the driver's client sends ranges only to a decider that
//! said so, and indices to one that predates them, with the same answer.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{net::SocketAddr, sync::Arc};

use common::{Server, gid, now, refusal, template, trace};
use contract::{
    ClusterShape, DecideOutput,
    pb::{
        self, DecideRequest, DecideResponse,
        decide_request::Part,
        decider_client::DeciderClient,
        decider_server::{Decider, DeciderServer},
    },
};
use decider::{DesiredView, SlotSet};
use decider_svc::{
    DecideError, SLOT_RANGES_HEADER, SlotEncoding, decide, decide_call, encode_call, server::Config,
};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Code, Request, Response, Status, Streaming};

/// One group of `count` slots.
fn shape(count: u32) -> ClusterShape {
    common::shape(&[("w", count, &Arc::new(template("img:1")))])
}

/// Slots `0..count` of group `w` held but for the given gaps.
fn held_but(count: u32, gaps: &[std::ops::Range<u32>]) -> SlotSet {
    let mut slots = SlotSet::new();
    let mut from = 0;
    for gap in gaps {
        slots.insert_range(&gid("w"), from, gap.start);
        from = gap.end;
    }
    slots.insert_range(&gid("w"), from, count);
    slots.finish();
    slots
}

fn in_process(shape: &ClusterShape, slots: &SlotSet) -> DecideOutput {
    decider::decide(&DesiredView::new(shape, false), [], slots, now())
}

fn inserted(out: &DecideOutput) -> Vec<String> {
    out.decisions.iter().map(|d| d.node.to_string()).collect()
}

#[tokio::test]
async fn ranges_are_read_as_the_indices_they_cover() {
    let server = Server::start(Config::default()).await;
    let s = shape(100);
    let slots = held_but(100, &[3..5, 40..41, 97..100]);
    let call = encode_call(&s, false, [], slots.clone(), &[], now(), &trace());

    let ranges = call.clone().into_messages(SlotEncoding::Ranges);
    let bounds: Vec<&[u32]> = ranges
        .iter()
        .filter_map(|r| match &r.part {
            Some(Part::SlotRanges(b)) => Some(b.bounds.as_slice()),
            Some(Part::Slots(_)) => panic!("indices where ranges are shorter"),
            _ => None,
        })
        .collect();
    assert_eq!(bounds, [[0, 3, 5, 40, 41, 97].as_slice()]);
    let from_ranges = decide(&mut server.client().await, ranges).await.unwrap();

    let indices = call.into_messages(SlotEncoding::Indices);
    assert!(
        indices
            .iter()
            .all(|r| !matches!(r.part, Some(Part::SlotRanges(_))))
    );
    let from_indices = decide(&mut server.client().await, indices).await.unwrap();

    assert_eq!(from_ranges, from_indices);
    assert_eq!(from_ranges, in_process(&s, &slots));
    assert_eq!(
        inserted(&from_ranges),
        ["w-3", "w-4", "w-40", "w-97", "w-98", "w-99"]
    );

    // Ranges in any order, overlapping each other and indices of the same
    // group, read as their union.
    let mut messages =
        encode_call(&s, false, [], SlotSet::new(), &[], now(), &trace()).into_messages(SlotEncoding::Indices);
    let end = messages.pop().unwrap();
    let ranges = |group: &str, bounds: Vec<u32>| DecideRequest {
        part: Some(Part::SlotRanges(pb::SlotRanges {
            group_id: group.to_owned(),
            bounds,
        })),
        trace: None,
    };
    messages.push(ranges("w", vec![50, 100, 0, 2]));
    messages.push(DecideRequest {
        part: Some(Part::Slots(pb::SlotBatch {
            group_id: "w".to_owned(),
            indices: vec![2, 60, 7],
        })),
        trace: None,
    });
    messages.push(ranges("w", vec![1, 10, 60, 70]));
    // A group the shape does not have hides nothing.
    messages.push(ranges("old", vec![0, 100]));
    messages.push(end);
    let out = decide(&mut server.client().await, messages).await.unwrap();
    let want: Vec<String> = (10..50).map(|i| format!("w-{i}")).collect();
    assert_eq!(inserted(&out), want);
    server.stop().await;
}

#[tokio::test]
async fn malformed_ranges_are_refused_with_their_field_path() {
    let server = Server::start(Config {
        max_nodes: 1_000,
        ..Config::default()
    })
    .await;
    let s = shape(10);
    let with = |group: &str, bounds: Vec<u32>| {
        let mut messages = encode_call(&s, false, [], SlotSet::new(), &[], now(), &trace())
            .into_messages(SlotEncoding::Indices);
        let end = messages.pop().unwrap();
        messages.push(DecideRequest {
            part: Some(Part::SlotRanges(pb::SlotRanges {
                group_id: group.to_owned(),
                bounds,
            })),
            trace: None,
        });
        messages.push(end);
        messages
    };
    for (group, bounds, field) in [
        ("w", vec![0, 4, 6], "slot_ranges.bounds[2] "),
        ("w", vec![0, 4, 6, 6], "slot_ranges.bounds[3] "),
        ("w", vec![5, 2], "slot_ranges.bounds[1] "),
        ("Not A Group", vec![0, 1], "slot_ranges.group_id "),
    ] {
        let status = refusal(&server, with(group, bounds.clone())).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{bounds:?}");
        assert!(
            status.message().starts_with(field),
            "{bounds:?}: {}",
            status.message()
        );
    }
    // A range counts as the slots it covers against the call's limit.
    let status = refusal(&server, with("w", vec![0, 600, 700, 1_101])).await;
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("slot indices"), "{}", status.message());
    let out = decide(&mut server.client().await, with("w", vec![0, 600, 700, 1_100]))
        .await
        .unwrap();
    assert_eq!(
        out,
        DecideOutput::default(),
        "at the limit exactly, every slot is held"
    );
    server.stop().await;
}

#[tokio::test]
async fn the_decider_says_it_reads_ranges_and_a_large_call_sends_them() {
    let server = Server::start(Config::default()).await;
    let s = shape(200_000);
    let slots = held_but(200_000, &[7..9, 150_000..150_001]);
    let messages =
        encode_call(&s, false, [], slots.clone(), &[], now(), &trace()).into_messages(SlotEncoding::Ranges);
    let response = server
        .client()
        .await
        .decide(tokio_stream::iter(messages))
        .await
        .unwrap();
    assert_eq!(
        response
            .metadata()
            .get(SLOT_RANGES_HEADER)
            .map(|v| v.to_str().unwrap()),
        Some("1")
    );

    let call = encode_call(&s, false, [], slots.clone(), &[], now(), &trace());
    let (out, encoding) = decide_call(&mut server.decider_channel().await, call)
        .await
        .unwrap();
    assert_eq!(encoding, SlotEncoding::Ranges);
    assert_eq!(out, in_process(&s, &slots));
    assert_eq!(inserted(&out), ["w-7", "w-8", "w-150000"]);

    // A run of at most EAGER_SLOTS slots sends indices at once.
    let small = shape(100);
    let few = held_but(100, &[3..4, 50..52]);
    let call = encode_call(&small, false, [], few.clone(), &[], now(), &trace());
    let (out, encoding) = decide_call(&mut server.decider_channel().await, call)
        .await
        .unwrap();
    assert_eq!(encoding, SlotEncoding::Indices);
    assert_eq!(out, in_process(&small, &few));
    server.stop().await;
}

/// A decider of the kind that predates ranges: no header, and a message with
/// a part it does not know refused as one with no part. It answers by asking
/// a real decider once it has the whole call.
struct Predating {
    upstream: SocketAddr,
}

#[tonic::async_trait]
impl Decider for Predating {
    type DecideStream = ReceiverStream<Result<DecideResponse, Status>>;

    async fn decide(
        &self,
        request: Request<Streaming<DecideRequest>>,
    ) -> Result<Response<Self::DecideStream>, Status> {
        let mut requests = request.into_inner();
        let upstream = self.upstream;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut call = Vec::new();
            while let Ok(Some(m)) = requests.message().await {
                if matches!(m.part, Some(Part::SlotRanges(_))) {
                    let _ = tx.send(Err(Status::invalid_argument("`part` is required"))).await;
                    return;
                }
                let end = matches!(m.part, Some(Part::End(_)));
                call.push(m);
                if end {
                    break;
                }
            }
            let mut client = DeciderClient::connect(format!("http://{upstream}"))
                .await
                .unwrap();
            let mut responses = client
                .decide(tokio_stream::iter(call))
                .await
                .unwrap()
                .into_inner();
            while let Some(r) = responses.message().await.transpose() {
                let _ = tx.send(r).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[tokio::test]
async fn a_decider_that_predates_ranges_gets_indices_and_the_same_answer() {
    let real = Server::start(Config::default()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let old = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DeciderServer::new(Predating { upstream: real.addr }))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = DeciderClient::new(channel.clone());
    let mut raw = decider_svc::DeciderChannel::new(channel);

    let s = shape(200_000);
    let slots = held_but(200_000, &[0..1, 199_990..200_000]);
    // The double refuses ranges, as such a decider would.
    let ranges =
        encode_call(&s, false, [], slots.clone(), &[], now(), &trace()).into_messages(SlotEncoding::Ranges);
    assert!(matches!(
        decide(&mut client, ranges).await,
        Err(DecideError::Rejected(status)) if status.code() == Code::InvalidArgument
    ));

    let call = encode_call(&s, false, [], slots.clone(), &[], now(), &trace());
    let (out, encoding) = decide_call(&mut raw, call).await.unwrap();
    assert_eq!(encoding, SlotEncoding::Indices);
    assert_eq!(out, in_process(&s, &slots));
    assert_eq!(inserted(&out).len(), 11);

    let _ = stop.send(());
    old.await.unwrap().unwrap();
    real.stop().await;
}
