//! The provider protocol's gRPC services over a [`Provider`]: requests
//! checked and decoded, every call guarded (deadline, panic), answers
//! encoded, `Watch` fed from [`Events`].

use std::{panic::AssertUnwindSafe, pin::Pin, sync::Arc, time::Duration};

use contract::{Endpoint, FieldError, LeaseId, SessionId, UnixMillis};
use futures::{FutureExt as _, Stream, future::BoxFuture};
use tokio_stream::{StreamExt as _, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};

use crate::{
    Answer, Bootstrap, Call, Events, Provider, Resource, Testing,
    wire::{answer_to_wire, identity_from_wire, identity_to_wire, params_from, pb, template_from_wire},
};

/// The `Provider` service of one plugin.
pub(crate) struct ProviderService<P> {
    provider: Arc<P>,
    events: Events,
}

impl<P> ProviderService<P> {
    pub(crate) fn new(provider: Arc<P>, events: Events) -> Self {
        Self { provider, events }
    }
}

fn invalid(e: FieldError) -> Status {
    Status::invalid_argument(e.to_string())
}

/// The wall clock, as the deadlines on the wire are (milliseconds since the
/// Unix epoch).
fn now_ms() -> u64 {
    use contract::Clock as _;
    contract::SystemClock.now().as_millis()
}

fn decode_call(call: Option<pb::Call>) -> Result<Call, Status> {
    let call = call.ok_or_else(|| invalid(FieldError::new("call", contract::Problem::Missing)))?;
    let identity = identity_from_wire("call.identity", call.identity.as_ref()).map_err(invalid)?;
    Ok(Call {
        identity,
        operation_id: call.operation_id,
        deadline: (call.deadline_unix_ms != 0).then(|| UnixMillis::new(call.deadline_unix_ms)),
        provider_name: call.provider_name,
    })
}

/// An optional opaque id: empty means "not known".
fn optional<T>(
    field: &str,
    s: &str,
    new: fn(&str, &str) -> Result<T, FieldError>,
) -> Result<Option<T>, Status> {
    if s.is_empty() {
        Ok(None)
    } else {
        new(field, s).map(Some).map_err(invalid)
    }
}

/// Runs one provider call: answered ambiguous if the deadline had already
/// passed, if the call is still running at its deadline (dropped then), or if
/// it panics. The provider is never asked to vouch for what it cannot.
async fn guarded<T>(
    call: &Call,
    method: &'static str,
    work: impl FnOnce() -> BoxFuture<'static, Answer<T>>,
) -> Answer<T> {
    let remaining = match call.deadline {
        None => None,
        Some(deadline) => {
            let now = now_ms();
            if deadline.as_millis() <= now {
                tracing::warn!(
                    method,
                    identity = ?call.identity,
                    "the call's deadline had passed when it arrived: answered ambiguous without running it"
                );
                return Answer::Ambiguous(format!(
                    "{method}: the deadline had passed {} ms before the call arrived",
                    now - deadline.as_millis()
                ));
            }
            Some(Duration::from_millis(deadline.as_millis() - now))
        }
    };
    let run = AssertUnwindSafe(work()).catch_unwind();
    let outcome = match remaining {
        None => Ok(run.await),
        Some(d) => tokio::time::timeout(d, run).await,
    };
    match outcome {
        Ok(Ok(answer)) => answer,
        Ok(Err(panic)) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_owned());
            tracing::error!(method, identity = ?call.identity, panic = %what, "the provider panicked: answered ambiguous");
            Answer::Ambiguous(format!("{method}: the provider panicked: {what}"))
        }
        Err(_) => {
            tracing::warn!(method, identity = ?call.identity, "the provider did not answer by the deadline: answered ambiguous");
            Answer::Ambiguous(format!(
                "{method}: the provider did not answer by the call's deadline"
            ))
        }
    }
}

fn value<T: Clone>(answer: &Answer<T>) -> Option<T> {
    match answer {
        Answer::Succeeded(v) => Some(v.clone()),
        _ => None,
    }
}

fn resource_to_wire(r: &Resource) -> pb::Resource {
    pb::Resource {
        identity: Some(identity_to_wire(&r.identity)),
        lease_id: r.lease.as_str().to_owned(),
        endpoint: r
            .endpoint
            .as_ref()
            .map(|e| e.as_str().to_owned())
            .unwrap_or_default(),
        session_live: r.session_live,
        provider_name: r.provider_name.clone(),
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchEvent, Status>> + Send>>;

#[tonic::async_trait]
impl<P: Provider> pb::provider_server::Provider for ProviderService<P> {
    async fn get_info(
        &self,
        _: Request<pb::GetInfoRequest>,
    ) -> Result<Response<pb::GetInfoResponse>, Status> {
        let info = self.provider.info();
        Ok(Response::new(pb::GetInfoResponse {
            protocol_version: pb::ProtocolVersion::ProtocolVersion1.into(),
            provider_names: info.provider_names,
            capabilities: Some(pb::Capabilities {
                reports_health: info.reports_health,
                reports_loss: info.reports_loss,
            }),
            description: info.description,
        }))
    }

    async fn create_lease(
        &self,
        request: Request<pb::CreateLeaseRequest>,
    ) -> Result<Response<pb::CreateLeaseResponse>, Status> {
        let r = request.into_inner();
        let call = decode_call(r.call)?;
        let template = template_from_wire("template", r.template, &call.provider_name).map_err(invalid)?;
        let provider = Arc::clone(&self.provider);
        let c = call.clone();
        let answer = guarded(&call, "CreateLease", move || provider.create_lease(c, template)).await;
        tracing::debug!(identity = ?call.identity, answer = answer.class_name(), "CreateLease");
        Ok(Response::new(pb::CreateLeaseResponse {
            answer: Some(answer_to_wire(&answer)),
            lease_id: value(&answer)
                .map(|l: LeaseId| l.as_str().to_owned())
                .unwrap_or_default(),
        }))
    }

    async fn lookup_endpoint(
        &self,
        request: Request<pb::LookupEndpointRequest>,
    ) -> Result<Response<pb::LookupEndpointResponse>, Status> {
        let r = request.into_inner();
        let call = decode_call(r.call)?;
        let lease = LeaseId::new("lease_id", &r.lease_id).map_err(invalid)?;
        let provider = Arc::clone(&self.provider);
        let c = call.clone();
        let answer = guarded(&call, "LookupEndpoint", move || {
            provider.lookup_endpoint(c, lease)
        })
        .await;
        Ok(Response::new(pb::LookupEndpointResponse {
            answer: Some(answer_to_wire(&answer)),
            endpoint: value(&answer)
                .map(|e: Endpoint| e.as_str().to_owned())
                .unwrap_or_default(),
        }))
    }

    async fn start_bootstrap(
        &self,
        request: Request<pb::StartBootstrapRequest>,
    ) -> Result<Response<pb::StartBootstrapResponse>, Status> {
        let r = request.into_inner();
        let call = decode_call(r.call)?;
        let bootstrap = Bootstrap {
            lease: LeaseId::new("lease_id", &r.lease_id).map_err(invalid)?,
            endpoint: Endpoint::new("endpoint", &r.endpoint).map_err(invalid)?,
            boot: params_from(r.boot),
            join: params_from(r.join),
        };
        let provider = Arc::clone(&self.provider);
        let c = call.clone();
        let answer = guarded(&call, "StartBootstrap", move || {
            provider.start_bootstrap(c, bootstrap)
        })
        .await;
        Ok(Response::new(pb::StartBootstrapResponse {
            answer: Some(answer_to_wire(&answer)),
            session_id: value(&answer)
                .map(|s: SessionId| s.as_str().to_owned())
                .unwrap_or_default(),
        }))
    }

    async fn cancel_bootstrap(
        &self,
        request: Request<pb::CancelBootstrapRequest>,
    ) -> Result<Response<pb::CancelBootstrapResponse>, Status> {
        let r = request.into_inner();
        let call = decode_call(r.call)?;
        let session = optional("session_id", &r.session_id, SessionId::new)?;
        let provider = Arc::clone(&self.provider);
        let c = call.clone();
        let answer = guarded(&call, "CancelBootstrap", move || {
            provider.cancel_bootstrap(c, session)
        })
        .await;
        if matches!(answer, Answer::Succeeded(())) {
            self.events.session_ended(&call.identity);
        }
        Ok(Response::new(pb::CancelBootstrapResponse {
            answer: Some(answer_to_wire(&answer)),
        }))
    }

    async fn destroy_lease(
        &self,
        request: Request<pb::DestroyLeaseRequest>,
    ) -> Result<Response<pb::DestroyLeaseResponse>, Status> {
        let r = request.into_inner();
        let call = decode_call(r.call)?;
        let lease = optional("lease_id", &r.lease_id, LeaseId::new)?;
        let provider = Arc::clone(&self.provider);
        let c = call.clone();
        let answer = guarded(&call, "DestroyLease", move || provider.destroy_lease(c, lease)).await;
        if matches!(answer, Answer::Succeeded(())) {
            self.events.destroyed(&call.identity);
        }
        Ok(Response::new(pb::DestroyLeaseResponse {
            answer: Some(answer_to_wire(&answer)),
        }))
    }

    async fn list_resources(
        &self,
        _: Request<pb::ListResourcesRequest>,
    ) -> Result<Response<pb::ListResourcesResponse>, Status> {
        let listed = AssertUnwindSafe(self.provider.list()).catch_unwind().await;
        match listed {
            Ok(Ok(resources)) => Ok(Response::new(pb::ListResourcesResponse {
                resources: resources.iter().map(resource_to_wire).collect(),
            })),
            Ok(Err(reason)) => Err(Status::unavailable(format!(
                "the provider cannot list now: {reason}"
            ))),
            Err(_) => Err(Status::internal("the provider panicked while listing")),
        }
    }

    type WatchStream = WatchStream;

    async fn watch(&self, _: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let rx = self.events.subscribe();
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }
}

/// The `ProviderTesting` service over a plugin's [`Testing`] hooks.
pub(crate) struct TestingService {
    hooks: Arc<dyn Testing>,
}

impl TestingService {
    pub(crate) fn new(hooks: Arc<dyn Testing>) -> Self {
        Self { hooks }
    }
}

#[tonic::async_trait]
impl pb::provider_testing_server::ProviderTesting for TestingService {
    async fn lose(&self, request: Request<pb::LoseRequest>) -> Result<Response<pb::LoseResponse>, Status> {
        let identity =
            identity_from_wire("identity", request.get_ref().identity.as_ref()).map_err(invalid)?;
        let found = self.hooks.lose(identity).await;
        Ok(Response::new(pb::LoseResponse { found }))
    }

    async fn set_healthy(
        &self,
        request: Request<pb::SetHealthyRequest>,
    ) -> Result<Response<pb::SetHealthyResponse>, Status> {
        let r = request.into_inner();
        let identity = identity_from_wire("identity", r.identity.as_ref()).map_err(invalid)?;
        let found = self.hooks.set_healthy(identity, r.healthy).await;
        Ok(Response::new(pb::SetHealthyResponse { found }))
    }
}
