//! The inventory in pages (`InventoryPages`).
//!
//! A resource encodes to about 130 bytes, so the one-message `Inventory` of a
//! million resources is over 130 MB: past every message limit, and as much
//! again held in the executor while it is encoded. The pages split one read
//! of the backend into messages of at most [`PAGE_BYTES`], each encoded only
//! when the reader is ready for it.

use contract::{InventoryResource, pb};
use prost::Message;

/// The most a page's encoding holds, far under the smallest receive limit
/// (4 MiB by default): a resource that alone is larger still goes, alone.
pub const PAGE_BYTES: usize = 1 << 20;

/// `resources` as pages of at most `page_bytes` encoded bytes each (a page
/// of one resource may be larger, if that resource is), in their order; the
/// last is marked `last`, and no resources make one empty last page.
pub fn pages(
    resources: impl IntoIterator<Item = InventoryResource>,
    page_bytes: usize,
) -> impl Iterator<Item = pb::InventoryResponse> {
    let mut resources = resources.into_iter().peekable();
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        let mut page = pb::InventoryResponse::default();
        let mut bytes = 0;
        while let Some(next) = resources.peek() {
            let resource = pb::Resource::from(next);
            // Field 1, length-delimited: a one-byte key, the length, the bytes.
            let len = resource.encoded_len();
            let field = 1 + prost::length_delimiter_len(len) + len;
            if !page.resources.is_empty() && bytes + field > page_bytes {
                break;
            }
            bytes += field;
            page.resources.push(resource);
            resources.next();
        }
        if resources.peek().is_none() {
            page.last = true;
            done = true;
        }
        Some(page)
    })
}

#[cfg(test)]
mod tests {
    use contract::{AttemptId, Endpoint, Epoch, LeaseId, LogicalNodeId, ResourceIdentity, RunId, RunUid};

    use super::*;

    fn resource(i: u32) -> InventoryResource {
        InventoryResource {
            identity: ResourceIdentity {
                run_uid: RunUid::from_u128(7),
                run_id: RunId::parse("run_id", "train").unwrap(),
                node: LogicalNodeId::parse("node", &format!("workers-{i}")).unwrap(),
                attempt: AttemptId::new(u64::from(i) + 1),
            },
            lease: Some(LeaseId::new("lease", &format!("lease-{i}")).unwrap()),
            endpoint: Some(Endpoint::new("endpoint", &format!("10.0.{}.{}:22", i / 256, i % 256)).unwrap()),
            session_live: i.is_multiple_of(2),
            epoch: Epoch::new(3),
        }
    }

    #[test]
    fn pages_hold_every_resource_in_order_each_under_the_bound() {
        let all: Vec<InventoryResource> = (0..5_000).map(resource).collect();
        let whole = pb::InventoryResponse {
            resources: all.iter().map(pb::Resource::from).collect(),
            last: false,
        };
        let bound = 16 << 10;
        let pages: Vec<_> = pages(all, bound).collect();
        assert!(pages.len() > 1, "{} pages", pages.len());
        for (i, page) in pages.iter().enumerate() {
            assert!(
                page.encoded_len() <= bound,
                "page {i}: {} bytes",
                page.encoded_len()
            );
            assert!(!page.resources.is_empty(), "page {i} is empty");
            assert_eq!(page.last, i + 1 == pages.len(), "page {i} of {}", pages.len());
        }
        // Full: each page but the last would have gone over with the next one.
        for pair in pages.windows(2) {
            let mut over = pair[0].clone();
            over.resources.push(pair[1].resources[0].clone());
            assert!(over.encoded_len() > bound);
        }
        let joined: Vec<pb::Resource> = pages.into_iter().flat_map(|p| p.resources).collect();
        assert_eq!(joined, whole.resources);
    }

    #[test]
    fn a_resource_larger_than_a_page_goes_alone_and_none_make_one_empty_last_page() {
        let pages: Vec<_> = pages((0..3).map(resource), 10).collect();
        assert_eq!(
            pages.iter().map(|p| p.resources.len()).collect::<Vec<_>>(),
            [1, 1, 1]
        );
        assert_eq!(
            pages.iter().map(|p| p.last).collect::<Vec<_>>(),
            [false, false, true]
        );
        let empty: Vec<_> = super::pages(Vec::new(), PAGE_BYTES).collect();
        assert_eq!(
            empty,
            [pb::InventoryResponse {
                resources: Vec::new(),
                last: true
            }]
        );
    }
}
