//! One read of many items as a stream of messages, each under a size bound.
//!
//! An inventory holds about 130 bytes a resource, so one message of a million
//! resources is over 130 MB: past every message limit, and as much again held
//! while it is encoded. A paged answer (`InventoryPages`, a plugin's
//! `ListResourcePages`) splits one read into messages of at most
//! [`PAGE_BYTES`], each built only when the reader is ready for it, and marks
//! the last one, so a stream cut short is an error and never a shorter list.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

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

/// A read that arrives in chunks (a backend's pages), as pages of at most
/// [`PAGE_BYTES`] each, in order, the last marked. A page is built when the
/// transport asks for the next message, from as many chunks as fill it, so
/// what is held is a chunk and a page, never the whole read. A chunk that
/// fails ends the stream with its status: a read cut short is never a
/// shorter list. The last page may be empty (the chunks ended just after a
/// full page).
pub fn stream_chunks<P, S>(chunks: S) -> PageStream<P>
where
    P: Page + Send + Unpin + 'static,
    P::Item: Send + Unpin,
    S: Stream<Item = Result<Vec<P::Item>, tonic::Status>> + Send + 'static,
{
    Box::pin(ChunkPages::<P> {
        chunks: Box::pin(chunks),
        held: Vec::new().into_iter(),
        page: None,
        bytes: 0,
        page_bytes: PAGE_BYTES,
        done: false,
    })
}

type Chunks<T> = Pin<Box<dyn Stream<Item = Result<Vec<T>, tonic::Status>> + Send>>;

/// See [`stream_chunks`].
struct ChunkPages<P: Page> {
    chunks: Chunks<P::Item>,
    /// What is left of the chunk being paged.
    held: std::vec::IntoIter<P::Item>,
    /// The page being filled, kept across a wait for the next chunk.
    page: Option<P>,
    bytes: usize,
    page_bytes: usize,
    done: bool,
}

impl<P> Stream for ChunkPages<P>
where
    P: Page + Unpin,
    P::Item: Unpin,
{
    type Item = Result<P, tonic::Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            let Some(next) = this.held.as_slice().first() else {
                match this.chunks.as_mut().poll_next(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(chunk))) => {
                        this.held = chunk.into_iter();
                        continue;
                    }
                    Poll::Ready(Some(Err(status))) => {
                        this.done = true;
                        this.page = None;
                        return Poll::Ready(Some(Err(status)));
                    }
                    Poll::Ready(None) => {
                        this.done = true;
                        let mut page = this.page.take().unwrap_or_default();
                        page.set_last();
                        return Poll::Ready(Some(Ok(page)));
                    }
                }
            };
            // Field 1, length-delimited: a one-byte key, the length, the bytes.
            let len = next.encoded_len();
            let field = 1 + prost::length_delimiter_len(len) + len;
            let page = this.page.get_or_insert_with(P::default);
            if !page.items_mut().is_empty() && this.bytes + field > this.page_bytes {
                this.bytes = 0;
                return Poll::Ready(this.page.take().map(Ok));
            }
            this.bytes += field;
            if let Some(item) = this.held.next() {
                page.items_mut().push(item);
            }
        }
    }
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

    /// Every item a chunked pager yields, polled to its end with nothing
    /// pending (the chunks are all ready).
    fn drain<P: Page + Unpin>(mut stream: Pin<&mut ChunkPages<P>>) -> Vec<Result<P, tonic::Status>>
    where
        P::Item: Unpin,
    {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut out = Vec::new();
        loop {
            match stream.as_mut().poll_next(&mut cx) {
                Poll::Ready(Some(item)) => out.push(item),
                Poll::Ready(None) => return out,
                Poll::Pending => panic!("ready chunks left the pager pending"),
            }
        }
    }

    fn chunked(
        chunks: Vec<Result<Vec<pb::Resource>, tonic::Status>>,
        page_bytes: usize,
    ) -> ChunkPages<pb::InventoryResponse> {
        ChunkPages {
            chunks: Box::pin(tokio_stream::iter(chunks)),
            held: Vec::new().into_iter(),
            page: None,
            bytes: 0,
            page_bytes,
            done: false,
        }
    }

    #[test]
    fn chunks_are_paged_as_the_whole_read_would_be() {
        let all: Vec<pb::Resource> = (0..5_000).map(resource).collect();
        let bound = 16 << 10;
        // Chunks of every kind: empty ones, one of a single item, and
        // boundaries that fall inside a page.
        let mut chunks = Vec::new();
        let mut rest = all.as_slice();
        for size in [0, 1, 700, 0, 2_299, 2_000] {
            let (chunk, tail) = rest.split_at(size);
            chunks.push(Ok(chunk.to_vec()));
            rest = tail;
        }
        assert!(rest.is_empty());
        let mut stream = chunked(chunks, bound);
        let got: Vec<pb::InventoryResponse> = drain(Pin::new(&mut stream))
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
        let whole: Vec<pb::InventoryResponse> = pages(all, bound).collect();
        assert!(whole.len() > 1, "{} pages", whole.len());
        assert_eq!(got, whole);
    }

    #[test]
    fn a_failed_chunk_ends_the_stream_with_its_status_and_no_last_page() {
        let chunks = vec![
            Ok((0..100).map(resource).collect()),
            Err(tonic::Status::unavailable("the provider went away")),
            Ok((100..200).map(resource).collect()),
        ];
        let mut stream = chunked(chunks, 1 << 10);
        let got = drain(Pin::new(&mut stream));
        let (last, pages) = got.split_last().unwrap();
        let status = last.as_ref().unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(!pages.is_empty());
        for page in pages {
            let page = page.as_ref().unwrap();
            assert!(!page.last);
            assert!(
                page.resources.iter().all(|r| r.attempt <= 100),
                "a page past the failure"
            );
        }
    }

    #[test]
    fn no_chunks_make_one_empty_last_page_and_a_wait_keeps_the_page_open() {
        let mut empty = chunked(Vec::new(), PAGE_BYTES);
        let got: Vec<_> = drain(Pin::new(&mut empty))
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(
            got,
            [pb::InventoryResponse {
                resources: Vec::new(),
                last: true
            }]
        );
        // A chunk read, then the next one not ready: no page goes until it
        // is full or the read ends.
        use tokio_stream::StreamExt as _;
        let first = tokio_stream::iter(vec![Ok((0..3).map(resource).collect())]);
        let mut waiting = ChunkPages::<pb::InventoryResponse> {
            chunks: Box::pin(first.chain(tokio_stream::pending())),
            held: Vec::new().into_iter(),
            page: None,
            bytes: 0,
            page_bytes: PAGE_BYTES,
            done: false,
        };
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(Pin::new(&mut waiting).poll_next(&mut cx).is_pending());
        assert_eq!(waiting.page.as_ref().map(|p| p.resources.len()), Some(3));
    }
}
