//! The provider protocol's gRPC services over a [`Provider`]: requests
//! checked and decoded, every call guarded (deadline, panic), answers
//! encoded, `Watch` fed from [`Events`].

use std::{panic::AssertUnwindSafe, pin::Pin, sync::Arc, time::Duration};

use contract::{
    Endpoint, FieldError, LeaseId, SessionId, UnixMillis,
    pages::{self, PageStream},
};
use futures::{FutureExt as _, Stream, future::BoxFuture};
use tokio_stream::StreamExt as _;
use tonic::{Request, Response, Status};

use crate::{
    Answer, Bootstrap, Call, Events, Provider, Resource, Testing,
    wire::{answer_to_wire, identity_from_wire, identity_to_wire, params_from, pb, template_from_wire},
};

/// The `Provider` service of one plugin.
pub(crate) struct ProviderService<P> {
    provider: Arc<P>,
    events: Events,
    /// The provider names it serves (its `Info`), the first the default.
    names: Arc<[String]>,
}

impl<P: Provider> ProviderService<P> {
    pub(crate) fn new(provider: Arc<P>, events: Events) -> Self {
        let names = provider.info().provider_names.into();
        Self {
            provider,
            events,
            names,
        }
    }

    /// The call, with an empty provider name made the plugin's first; a
    /// name it does not serve is answered `Failed {PERMANENT}` for it.
    fn decode_call(&self, call: Option<pb::Call>) -> Result<Result<Call, Answer<()>>, Status> {
        let mut call = decode_call(call)?;
        if call.provider_name.is_empty()
            && let Some(first) = self.names.first()
        {
            call.provider_name.clone_from(first);
        }
        if !self.names.contains(&call.provider_name) {
            return Ok(Err(Answer::Permanent(format!(
                "provider name {:?} is not served by this plugin (it serves {})",
                call.provider_name,
                self.names.join(", ")
            ))));
        }
        Ok(Ok(call))
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

impl<P: Provider> ProviderService<P> {
    /// Every resource the provider holds, from one read.
    async fn list(&self) -> Result<Vec<Resource>, Status> {
        match AssertUnwindSafe(self.provider.list()).catch_unwind().await {
            Ok(Ok(resources)) => Ok(resources),
            Ok(Err(reason)) => Err(Status::unavailable(format!(
                "the provider cannot list now: {reason}"
            ))),
            Err(_) => Err(Status::internal("the provider panicked while listing")),
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
        let call = match self.decode_call(r.call)? {
            Ok(call) => call,
            Err(refused) => {
                return Ok(Response::new(pb::CreateLeaseResponse {
                    answer: Some(answer_to_wire(&refused)),
                    ..Default::default()
                }));
            }
        };
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
        let call = match self.decode_call(r.call)? {
            Ok(call) => call,
            Err(refused) => {
                return Ok(Response::new(pb::LookupEndpointResponse {
                    answer: Some(answer_to_wire(&refused)),
                    ..Default::default()
                }));
            }
        };
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
        let call = match self.decode_call(r.call)? {
            Ok(call) => call,
            Err(refused) => {
                return Ok(Response::new(pb::StartBootstrapResponse {
                    answer: Some(answer_to_wire(&refused)),
                    ..Default::default()
                }));
            }
        };
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
        let call = match self.decode_call(r.call)? {
            Ok(call) => call,
            Err(refused) => {
                return Ok(Response::new(pb::CancelBootstrapResponse {
                    answer: Some(answer_to_wire(&refused)),
                }));
            }
        };
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
        let call = match self.decode_call(r.call)? {
            Ok(call) => call,
            Err(refused) => {
                return Ok(Response::new(pb::DestroyLeaseResponse {
                    answer: Some(answer_to_wire(&refused)),
                }));
            }
        };
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
        let resources = self.list().await?;
        Ok(Response::new(pb::ListResourcesResponse {
            resources: resources.iter().map(resource_to_wire).collect(),
            last: false,
        }))
    }

    type ListResourcePagesStream = PageStream<pb::ListResourcesResponse>;

    /// One read of the provider, encoded a page at a time as the executor
    /// reads them.
    async fn list_resource_pages(
        &self,
        _: Request<pb::ListResourcePagesRequest>,
    ) -> Result<Response<Self::ListResourcePagesStream>, Status> {
        let resources = self.list().await?;
        Ok(Response::new(pages::stream(
            resources.into_iter().map(|r| resource_to_wire(&r)),
        )))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, _: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        Ok(Response::new(Box::pin(self.events.subscribe().map(Ok))))
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

// Tests panic on purpose when an expectation fails.
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use contract::{AttemptId, LogicalNodeId, RunId, RunUid, shape::example_template};
    use pb::provider_server::Provider as _;

    use super::*;
    use crate::{Info, Resource, wire::template_to_wire};

    /// Creates by node: `w-0` succeeds, `w-1` panics, `w-2` sleeps a minute.
    struct Toy;

    impl Provider for Toy {
        fn info(&self) -> Info {
            Info {
                provider_names: vec!["toy".into(), "toy-2".into()],
                reports_health: false,
                reports_loss: false,
                description: String::new(),
            }
        }

        fn create_lease(
            &self,
            call: Call,
            _t: contract::NodeTemplate,
        ) -> BoxFuture<'static, Answer<LeaseId>> {
            Box::pin(async move {
                match call.identity.node.to_string().as_str() {
                    "w-1" => panic!("the toy's create broke"),
                    "w-2" => {
                        tokio::time::sleep(Duration::from_secs(60)).await;
                        Answer::Retryable("too late".into())
                    }
                    _ => Answer::Succeeded(
                        LeaseId::new("lease", &format!("l-{}", call.provider_name)).unwrap(),
                    ),
                }
            })
        }

        fn lookup_endpoint(&self, _: Call, _: LeaseId) -> BoxFuture<'static, Answer<Endpoint>> {
            Box::pin(async { Answer::NotReady("not yet".into()) })
        }

        fn start_bootstrap(&self, _: Call, _: Bootstrap) -> BoxFuture<'static, Answer<SessionId>> {
            Box::pin(async { Answer::Retryable("no".into()) })
        }

        fn cancel_bootstrap(&self, _: Call, _: Option<SessionId>) -> BoxFuture<'static, Answer<()>> {
            Box::pin(async { Answer::Succeeded(()) })
        }

        fn destroy_lease(&self, _: Call, _: Option<LeaseId>) -> BoxFuture<'static, Answer<()>> {
            Box::pin(async { Answer::Succeeded(()) })
        }

        fn list(&self) -> BoxFuture<'static, Result<Vec<Resource>, String>> {
            Box::pin(async { Ok(Vec::new()) })
        }
    }

    fn call(node: &str, provider: &str, deadline_in_ms: i64) -> pb::Call {
        let identity = contract::ResourceIdentity {
            run_uid: RunUid::from_u128(7),
            run_id: RunId::parse("run_id", "r").unwrap(),
            node: LogicalNodeId::parse("node", node).unwrap(),
            attempt: AttemptId::new(1),
        };
        pb::Call {
            identity: Some(identity_to_wire(&identity)),
            operation_id: "a1.1".into(),
            deadline_unix_ms: now_ms().saturating_add_signed(deadline_in_ms),
            provider_name: provider.into(),
        }
    }

    async fn create(
        svc: &ProviderService<Toy>,
        call: Option<pb::Call>,
    ) -> Result<pb::CreateLeaseResponse, Status> {
        svc.create_lease(Request::new(pb::CreateLeaseRequest {
            call,
            template: Some(template_to_wire(&example_template("toy", "img:1"))),
        }))
        .await
        .map(Response::into_inner)
    }

    fn outcome(r: &pb::CreateLeaseResponse) -> &pb::answer::Outcome {
        r.answer.as_ref().and_then(|a| a.outcome.as_ref()).unwrap()
    }

    #[tokio::test]
    async fn calls_are_guarded_and_checked_before_the_provider_sees_them() {
        use pb::answer::Outcome;
        let svc = ProviderService::new(Arc::new(Toy), Events::default());

        // A plain create; an empty provider name is the plugin's first.
        let ok = create(&svc, Some(call("w-0", "", 10_000))).await.unwrap();
        assert!(matches!(outcome(&ok), Outcome::Succeeded(_)), "{ok:?}");
        assert_eq!(ok.lease_id, "l-toy");
        let second = create(&svc, Some(call("w-0", "toy-2", 10_000))).await.unwrap();
        assert_eq!(second.lease_id, "l-toy-2");

        // A panic in the provider is ambiguous, never a definite failure.
        let panicked = create(&svc, Some(call("w-1", "toy", 10_000))).await.unwrap();
        assert!(
            matches!(outcome(&panicked), Outcome::Ambiguous(a) if a.reason.contains("panicked")),
            "{panicked:?}"
        );

        // Still running at the deadline: ambiguous, at the deadline.
        let slow = create(&svc, Some(call("w-2", "toy", 200))).await.unwrap();
        assert!(
            matches!(outcome(&slow), Outcome::Ambiguous(a) if a.reason.contains("deadline")),
            "{slow:?}"
        );

        // Arrived after its deadline: ambiguous without running.
        let late = create(&svc, Some(call("w-0", "toy", -5))).await.unwrap();
        assert!(
            matches!(outcome(&late), Outcome::Ambiguous(a) if a.reason.contains("had passed")),
            "{late:?}"
        );

        // A name the plugin does not serve: a definite, permanent failure.
        let other = create(&svc, Some(call("w-0", "other", 10_000))).await.unwrap();
        assert!(
            matches!(outcome(&other), Outcome::Failed(f) if f.kind == pb::FailureKind::Permanent as i32
                && f.reason.contains("\"other\"")),
            "{other:?}"
        );

        // Malformed: INVALID_ARGUMENT naming the field.
        let missing = create(&svc, None).await.unwrap_err();
        assert_eq!(missing.code(), tonic::Code::InvalidArgument);
        assert!(missing.message().starts_with("call "), "{}", missing.message());
        let mut no_identity = call("w-0", "toy", 10_000);
        no_identity.identity = None;
        let err = create(&svc, Some(no_identity)).await.unwrap_err();
        assert!(err.message().starts_with("call.identity"), "{}", err.message());
        let mut bad_node = call("w-0", "toy", 10_000);
        if let Some(i) = bad_node.identity.as_mut() {
            i.node_id = "Not A Node".into();
        }
        let err = create(&svc, Some(bad_node)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("call.identity"), "{}", err.message());
    }
}
