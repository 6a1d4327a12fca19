//! One read of many items as a stream of messages, each under a size bound.
//!
//! An inventory holds about 130 bytes a resource, so one message of a million
//! resources is over 130 MB: past every message limit, and as much again held
//! while it is encoded. A paged answer (`InventoryPages`, a plugin's
//! `ListResourcePages`) splits one read into messages of at most
//! [`PAGE_BYTES`], each built only when the reader is ready for it, and marks
//! the last one, so a stream cut short is an error and never a shorter list.

use std::pin::Pin;

use prost::Message;
use tonic::codegen::tokio_stream::{self, Stream};

use crate::pb;

/// The most a page's encoding holds, far under the smallest receive limit
/// (4 MiB by default): an item that alone is larger still goes, alone.
pub const PAGE_BYTES: usize = 1 << 20;

/// A message carrying its items in field 1 and a `last` flag.
pub trait Page: Default {
    type Item: Message;
    fn items_mut(&mut self) -> &mut Vec<Self::Item>;
    fn set_last(&mut self);
}

impl Page for pb::InventoryResponse {
    type Item = pb::Resource;
    fn items_mut(&mut self) -> &mut Vec<pb::Resource> {
        &mut self.resources
    }
    fn set_last(&mut self) {
        self.last = true;
    }
}

impl Page for pb::provider::v1::ListResourcesResponse {
    type Item = pb::provider::v1::Resource;
    fn items_mut(&mut self) -> &mut Vec<Self::Item> {
        &mut self.resources
    }
    fn set_last(&mut self) {
        self.last = true;
    }
}

/// `items` as pages of at most `page_bytes` encoded bytes each (a page of
/// one item may be larger, if that item is), in their order; the last is
/// marked, and no items make one empty last page. Items are drawn from the
/// iterator as pages are taken, so a lazy conversion to the wire holds one
/// page at a time.
pub fn pages<P: Page>(
    items: impl IntoIterator<Item = P::Item>,
    page_bytes: usize,
) -> impl Iterator<Item = P> {
    let mut items = items.into_iter().peekable();
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        let mut page = P::default();
        let mut bytes = 0;
        while let Some(next) = items.peek() {
            // Field 1, length-delimited: a one-byte key, the length, the bytes.
            let len = next.encoded_len();
            let field = 1 + prost::length_delimiter_len(len) + len;
            let held = page.items_mut();
            if !held.is_empty() && bytes + field > page_bytes {
                break;
            }
            bytes += field;
            if let Some(item) = items.next() {
                held.push(item);
            }
        }
        if items.peek().is_none() {
            page.set_last();
            done = true;
        }
        Some(page)
    })
}

/// A paged answer, as a gRPC server stream.
pub type PageStream<P> = Pin<Box<dyn Stream<Item = Result<P, tonic::Status>> + Send>>;

/// [`pages`] as a gRPC server stream: each page is built when the transport
/// asks for the next message, so nothing is encoded ahead of the reader and
/// no task runs beside the call.
pub fn stream<P, I>(items: I) -> PageStream<P>
where
    P: Page + Send + 'static,
    P::Item: Send,
    I: IntoIterator<Item = P::Item> + 'static,
    I::IntoIter: Send + 'static,
{
    Box::pin(tokio_stream::iter(pages::<P>(items, PAGE_BYTES).map(Ok)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resource(i: u32) -> pb::Resource {
        pb::Resource {
            run_uid: format!("{i:032x}"),
            run_id: "train".into(),
            node_id: format!("workers-{i}"),
            attempt: u64::from(i) + 1,
            lease_id: format!("lease-{i}"),
            endpoint: format!("10.0.{}.{}:22", i / 256, i % 256),
            session_live: i.is_multiple_of(2),
            ..Default::default()
        }
    }

    #[test]
    fn pages_hold_every_item_in_order_each_full_and_under_the_bound() {
        let all: Vec<pb::Resource> = (0..5_000).map(resource).collect();
        let bound = 16 << 10;
        let pages: Vec<pb::InventoryResponse> = pages(all.clone(), bound).collect();
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
        assert_eq!(joined, all);
    }

    #[test]
    fn an_item_larger_than_a_page_goes_alone_and_none_make_one_empty_last_page() {
        let pages: Vec<pb::provider::v1::ListResourcesResponse> = pages(
            (0..3).map(|i| pb::provider::v1::Resource {
                lease_id: format!("lease-{i}"),
                ..Default::default()
            }),
            10,
        )
        .collect();
        assert_eq!(
            pages.iter().map(|p| p.resources.len()).collect::<Vec<_>>(),
            [1, 1, 1]
        );
        assert_eq!(
            pages.iter().map(|p| p.last).collect::<Vec<_>>(),
            [false, false, true]
        );
        let empty: Vec<pb::InventoryResponse> = super::pages(Vec::new(), PAGE_BYTES).collect();
        assert_eq!(
            empty,
            [pb::InventoryResponse {
                resources: Vec::new(),
                last: true
            }]
        );
    }
}
