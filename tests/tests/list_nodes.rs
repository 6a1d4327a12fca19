//! `ListNodes`: a run's nodes a page at a time, and a status with every node
//! that does not fit the message limit refused by name rather than failed by
//! the encoder.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use contract::pb::{self, provisioning_client::ProvisioningClient};
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, watch_until},
    shapes::shape,
};
use tonic::{Code, transport::Channel};

/// The driver's public API sends at most this much in one message here: a
/// run of 700 nodes does not fit with its nodes, and its status alone does.
const SEND_LIMIT: usize = 64 << 10;

async fn page(
    c: &mut ProvisioningClient<Channel>,
    run_id: &str,
    page_size: u32,
    page_token: &str,
) -> Result<pb::ListNodesResponse, tonic::Status> {
    c.list_nodes(pb::ListNodesRequest {
        run_id: run_id.into(),
        page_size,
        page_token: page_token.into(),
    })
    .await
    .map(tonic::Response::into_inner)
}

/// Every page from the first, following the tokens; the node ids in order.
async fn all_pages(c: &mut ProvisioningClient<Channel>, page_size: u32) -> (Vec<String>, usize) {
    let mut ids = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let p = page(c, "paged", page_size, &token).await.unwrap();
        pages += 1;
        assert_eq!(p.node_count, 703);
        let bytes = prost::Message::encoded_len(&p);
        assert!(bytes <= SEND_LIMIT, "page {pages}: {bytes} bytes");
        if page_size > 0 {
            assert!(
                p.nodes.len() <= page_size as usize,
                "page {pages}: {} nodes",
                p.nodes.len()
            );
        }
        for n in &p.nodes {
            let state = n.state.as_ref().unwrap();
            assert!(state.attempt > 0, "{state:?}");
            assert_eq!(state.node_id.rsplit_once('-').unwrap().0, n.group_id);
            ids.push(state.node_id.clone());
        }
        if p.next_page_token.is_empty() {
            return (ids, pages);
        }
        assert_eq!(
            Some(&p.next_page_token),
            ids.last(),
            "the token names the page's last slot"
        );
        token = p.next_page_token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_nodes_are_read_in_pages_and_a_status_too_large_with_them_says_so() {
    let cluster =
        Cluster::start(ClusterOptions::default().driver("--max-send-message-bytes", &SEND_LIMIT.to_string()))
            .await
            .unwrap();
    let mut c = cluster.client().await.unwrap();
    let s = shape(
        "paged",
        1,
        "fake",
        &[("ctrl", 3, "img:1"), ("workers", 700, "img:1")],
    );
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await
    .unwrap();
    watch_until(&mut c, "paged", Duration::from_secs(60), |s| s.node_count == 703)
        .await
        .unwrap();

    // Slot by slot in node id order: a group's nodes by their index.
    let expected: Vec<String> = (0..3)
        .map(|i| format!("ctrl-{i}"))
        .chain((0..700).map(|i| format!("workers-{i}")))
        .collect();
    let (ids, pages) = all_pages(&mut c, 100).await;
    assert_eq!(ids, expected);
    assert_eq!(pages, 8);

    // The largest page asked for is cut to what the message limit takes.
    let (ids, pages) = all_pages(&mut c, 10_000).await;
    assert_eq!(ids, expected);
    assert!(pages > 1, "{pages} pages");
    // Size 0 is the default page (1,000 slots, cut the same way).
    let (ids, _) = all_pages(&mut c, 0).await;
    assert_eq!(ids, expected);

    // The status alone fits; with every node it is refused, saying what to
    // read instead, on GetRun and on WatchRun.
    let status = c
        .get_run(pb::GetRunRequest {
            run_id: "paged".into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.node_count, 703);
    let refused = c
        .get_run(pb::GetRunRequest {
            run_id: "paged".into(),
            include_nodes: true,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("include_nodes"), "{refused:?}");
    assert!(refused.message().contains("ListNodes"), "{refused:?}");
    let mut watch = c
        .watch_run(pb::WatchRunRequest {
            run_id: "paged".into(),
            include_nodes: true,
        })
        .await
        .unwrap()
        .into_inner();
    let refused = watch.message().await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("ListNodes"), "{refused:?}");

    // A token that is not a node id names its field; an unknown run is not found.
    let bad = page(&mut c, "paged", 10, "not a node").await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("page_token"), "{bad:?}");
    let missing = page(&mut c, "nope", 10, "").await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
    // A token past the last slot is an empty last page.
    let past = page(&mut c, "paged", 10, "workers-699").await.unwrap();
    assert!(
        past.nodes.is_empty() && past.next_page_token.is_empty(),
        "{past:?}"
    );
}
