//! A 100,000-node pass: every request message stays under tonic's default
//! 4 MiB limit, and the whole pass through a real server on loopback equals
//! the in-process decider's answer.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{sync::Arc, time::Instant};

use common::{N, Server, at, now, shape, template, trace};
use contract::{BootstrapStage, Effect, ManagedNode, NodeStage, NodeTemplate, pb::decide_request::Part};
use decider::{DesiredView, SlotSet};
use decider_svc::{decide, encode_request, server::Config};
use prost::Message as _;

const NODES: u32 = 100_000;
/// tonic's default decoding limit, which the decider keeps.
const FOUR_MIB: usize = 4 << 20;

struct Run {
    shape: contract::ClusterShape,
    nodes: Vec<ManagedNode>,
    slots: SlotSet,
}

/// Two groups of 50,000 desired slots (plus 5,000 wanted with no node yet), in
/// a spread of stages, with long ids and failure reasons so that a message
/// that grew with the run would pass 4 MiB many times over.
fn big_run() -> Run {
    let a = Arc::new(template("registry.example.com/train/worker:2025-01-01"));
    let b = Arc::new(template("registry.example.com/train/gpu-worker:2025-01-01"));
    let old = Arc::new(template("registry.example.com/train/worker:2024-12-01"));
    let per_group = NODES / 2;
    let shape = shape(&[
        ("workers-long-group-name", per_group + 2_500, &a),
        ("gpus-long-group-name", per_group + 2_500, &b),
    ]);
    let mut nodes = Vec::with_capacity(NODES as usize);
    let mut slots = SlotSet::new();
    for i in 0..NODES {
        let (group, spec) = if i % 2 == 0 {
            ("workers-long-group-name", &a)
        } else {
            ("gpus-long-group-name", &b)
        };
        let spec: &Arc<NodeTemplate> = if i % 97 == 0 { &old } else { spec };
        let id = format!("{group}-{}", i / 2);
        let n = N::new(&id, spec);
        let n = match i % 7 {
            0 => n.stage(NodeStage::Dormant).lease().endpoint(),
            1 => n,
            2 => n
                .stage(NodeStage::LeaseRequested)
                .pending(Effect::CreateLease, at(30_000 + i64::from(i))),
            3 => n.stage(NodeStage::LeaseCreated).lease(),
            4 => n
                .stage(NodeStage::BootstrapRunning)
                .lease()
                .endpoint()
                .session()
                .bootstrap(BootstrapStage::Joined)
                .stage_deadline(at(60_000)),
            5 => n
                .stage(NodeStage::Failed)
                .lease()
                .failed(&"the provider reported an error while booting; ".repeat(4)),
            _ => n
                .stage(NodeStage::Destroyed)
                .restart_at(at(1_000 + i64::from(i % 1000))),
        };
        slots.insert(&n.0.id);
        nodes.push(n.0);
    }
    slots.finish();
    Run { shape, nodes, slots }
}

#[test]
fn every_message_of_a_100k_node_request_is_under_4_mib() {
    let run = big_run();
    let requests = encode_request(&run.shape, false, &run.nodes, &run.slots, now(), &trace());
    let mut total = 0;
    let mut nodes = 0;
    let mut slots = 0;
    for (i, r) in requests.iter().enumerate() {
        let len = r.encoded_len();
        assert!(len < FOUR_MIB, "message {i} is {len} bytes");
        total += len;
        match &r.part {
            Some(Part::Nodes(b)) => {
                assert!(b.nodes.len() <= 1024);
                nodes += b.nodes.len();
            }
            Some(Part::Slots(s)) => {
                assert!(s.indices.len() <= 65_536);
                slots += s.indices.len();
            }
            Some(Part::Header(h)) => {
                // Three distinct templates, each sent once, however many nodes.
                assert_eq!(h.templates.len(), 3);
                assert_eq!(i, 0);
            }
            _ => {}
        }
    }
    assert_eq!(nodes, NODES as usize);
    assert_eq!(slots, NODES as usize);
    // The whole request is far beyond one message's limit: batching matters.
    assert!(total > 2 * FOUR_MIB, "{total}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100k_node_pass_through_a_real_server_equals_the_in_process_one() {
    let run = big_run();
    let server = Server::start(Config::default()).await;
    let mut client = server.client().await;

    let started = Instant::now();
    let requests = encode_request(&run.shape, false, &run.nodes, &run.slots, now(), &trace());
    let remote = decide(&mut client, requests).await.unwrap();
    let elapsed = started.elapsed();

    let local = decider::decide(
        &DesiredView::new(&run.shape, false),
        &run.nodes,
        &run.slots,
        now(),
    );
    assert_eq!(remote.decisions.len(), NODES as usize + 5_000);
    assert!(remote.requeue_at.is_some());
    assert!(
        remote == local,
        "the remote answer differs from the in-process one"
    );
    eprintln!("100,000 nodes through a loopback decider in {elapsed:?}");
    server.stop().await;
}
