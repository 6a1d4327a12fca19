//! The `Decider` service's gRPC route, written out: what tonic generates for
//! `provisioning.internal.v1.Decider`, with a codec whose responses are sent
//! as the bytes the call wrote (decisions are encoded once, straight from the
//! ladder's output, not built into `pb::Decision`s and encoded again), and
//! whose requests keep their nodes as bytes until each is decided
//! (`contract::wire::request`). The service's name, path, limits and
//! unknown-method answer are the generated route's.

use std::{
    convert::Infallible,
    sync::Arc,
    task::{Context, Poll},
};

use contract::wire::request::Incoming;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{
    Status,
    body::Body as TonicBody,
    codegen::{Body, BoxFuture, Bytes, Service, StdError, http},
    server::NamedService,
};

use crate::{codec::Encoded, server::DeciderService};

/// The full path of the one method.
const DECIDE: &str = "/provisioning.internal.v1.Decider/Decide";

/// The route: [`DeciderService`] behind the service name
/// `provisioning.internal.v1.Decider`.
#[derive(Debug, Clone)]
pub struct DeciderServer {
    inner: Arc<DeciderService>,
    max_decoding_message_size: Option<usize>,
    max_encoding_message_size: Option<usize>,
}

impl DeciderServer {
    pub fn new(inner: DeciderService) -> Self {
        Self {
            inner: Arc::new(inner),
            max_decoding_message_size: None,
            max_encoding_message_size: None,
        }
    }

    /// The largest request message accepted (tonic's default: 4 MiB).
    #[must_use]
    pub fn max_decoding_message_size(mut self, limit: usize) -> Self {
        self.max_decoding_message_size = Some(limit);
        self
    }

    /// The largest response message sent.
    #[must_use]
    pub fn max_encoding_message_size(mut self, limit: usize) -> Self {
        self.max_encoding_message_size = Some(limit);
        self
    }
}

impl NamedService for DeciderServer {
    const NAME: &'static str = "provisioning.internal.v1.Decider";
}

/// The `Decide` method, for tonic's streaming machinery.
struct DecideMethod(Arc<DeciderService>);

impl tonic::server::StreamingService<Incoming> for DecideMethod {
    type Response = Bytes;
    type ResponseStream = ReceiverStream<Result<Bytes, Status>>;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Incoming>>) -> Self::Future {
        let inner = Arc::clone(&self.0);
        Box::pin(async move { Ok(inner.decide(request)) })
    }
}

impl<B> Service<http::Request<B>> for DeciderServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<TonicBody>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != DECIDE {
            return Box::pin(async {
                let mut response = http::Response::new(TonicBody::default());
                let headers = response.headers_mut();
                headers.insert(Status::GRPC_STATUS, (tonic::Code::Unimplemented as i32).into());
                headers.insert(http::header::CONTENT_TYPE, tonic::metadata::GRPC_CONTENT_TYPE);
                Ok(response)
            });
        }
        let method = DecideMethod(Arc::clone(&self.inner));
        let limits = (self.max_decoding_message_size, self.max_encoding_message_size);
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(Encoded::<Incoming>::default())
                .apply_max_message_size_config(limits.0, limits.1);
            Ok(grpc.streaming(method, request).await)
        })
    }
}
