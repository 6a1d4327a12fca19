//! `FakeControl`, the fake backend's control service: a test double through
//! which tests that drive the real binaries lose a resource of the fake
//! provider, or make it fail its probes and heal it again
//! (`proto/provisioning/fake/v1/fake_control.proto`).
//!
//! The executor serves it only when it runs the fake backend and is started
//! with `--fake-control`; it is not part of the product's API (not in the
//! descriptor set reflection publishes) and changes nothing but the fake
//! provider. A loss goes to the executor the way every loss does, through the
//! backend's change sink ([`FakeBackend::apply_fault`]); a sickness is found
//! by the executor's prober.

use contract::{
    AttemptId, FieldError, LogicalNodeId, Problem, RunUid,
    pb::fake::v1::{
        Fault, InflictRequest, InflictResponse,
        fake_control_server::{FakeControl, FakeControlServer},
    },
};
use tonic::{Request, Response, Status};

use crate::fake_backend::{FakeBackend, NotHeld, ResourceFault};

/// Why an `Inflict` failed.
#[derive(Debug, thiserror::Error)]
enum ControlError {
    #[error("{0}")]
    Invalid(#[from] FieldError),
    #[error(transparent)]
    NotHeld(#[from] NotHeld),
}

/// The one place where the control service's errors become statuses.
fn to_status(e: ControlError) -> Status {
    match &e {
        ControlError::Invalid(_) => Status::invalid_argument(e.to_string()),
        ControlError::NotHeld(_) => Status::not_found(e.to_string()),
    }
}

/// The service over one fake backend.
#[derive(Debug, Clone)]
pub struct FakeControlService {
    backend: FakeBackend,
}

/// The service, ready to add to a server.
pub fn server(backend: FakeBackend) -> FakeControlServer<FakeControlService> {
    FakeControlServer::new(FakeControlService { backend })
}

/// A request's fields, parsed.
fn parse(req: &InflictRequest) -> Result<(RunUid, LogicalNodeId, AttemptId, ResourceFault), FieldError> {
    let run_uid = RunUid::parse("run_uid", &req.run_uid)?;
    let node = LogicalNodeId::parse("node_id", &req.node_id)?;
    if req.attempt == 0 {
        return Err(FieldError::new(
            "attempt",
            Problem::Malformed("attempt ids start at 1"),
        ));
    }
    let fault = match Fault::try_from(req.fault) {
        Ok(Fault::Lose) => ResourceFault::Lose,
        Ok(Fault::Sicken) => ResourceFault::Sicken,
        Ok(Fault::Heal) => ResourceFault::Heal,
        Ok(Fault::Unspecified) => return Err(FieldError::new("fault", Problem::Missing)),
        Err(_) => return Err(FieldError::new("fault", Problem::UnknownValue(req.fault))),
    };
    Ok((run_uid, node, AttemptId::new(req.attempt), fault))
}

impl FakeControlService {
    fn inflict(&self, req: &InflictRequest) -> Result<(), ControlError> {
        let (run_uid, node, attempt, fault) = parse(req)?;
        self.backend.apply_fault(run_uid, &node, attempt, fault)?;
        tracing::info!(%run_uid, %node, %attempt, ?fault, "fake control: fault inflicted");
        Ok(())
    }
}

#[tonic::async_trait]
impl FakeControl for FakeControlService {
    async fn inflict(&self, request: Request<InflictRequest>) -> Result<Response<InflictResponse>, Status> {
        FakeControlService::inflict(self, request.get_ref()).map_err(to_status)?;
        Ok(Response::new(InflictResponse {}))
    }
}

// Tests panic on purpose when a fixture is malformed or an expectation fails.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use contract::{
        Epoch, Operation, OperationId, OperationInput, Outcome, RunId, SystemClock, TraceContext,
        shape::example_template,
    };
    use tokio::sync::mpsc;
    use tonic::Code;

    use super::*;
    use crate::{
        backend::{Backend, ChangeSink, ObservationSink},
        fake::FakeConfig,
    };

    const UID: &str = "00000000000000000000000000000abc";

    fn request(run_uid: &str, node_id: &str, attempt: u64, fault: Fault) -> Request<InflictRequest> {
        Request::new(InflictRequest {
            run_uid: run_uid.to_owned(),
            node_id: node_id.to_owned(),
            attempt,
            fault: fault as i32,
        })
    }

    #[tokio::test]
    async fn faults_name_their_field_or_the_missing_resource() {
        let backend = FakeBackend::start(FakeConfig::default(), None, Arc::new(SystemClock)).unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        backend.watch(ChangeSink::new(tx));
        let uid = RunUid::parse("run_uid", UID).unwrap();
        let create = Operation {
            run_uid: uid,
            run_id: RunId::parse("run_id", "train").unwrap(),
            node: LogicalNodeId::parse("node", "workers-0").unwrap(),
            id: OperationId::new(AttemptId::new(3), 0),
            epoch: Epoch::new(1),
            deadline: contract::UnixMillis::MAX,
            provider: "fake".into(),
            input: OperationInput::CreateLease {
                template: Arc::new(example_template("fake", "img:1")),
            },
            trace: TraceContext::default(),
        };
        let (otx, _orx) = crate::backend::observation_queue();
        let made = backend
            .execute(create, ObservationSink::new(otx, TraceContext::default()))
            .await;
        assert!(matches!(made, Outcome::Succeeded(_)), "{made:?}");
        let svc = FakeControlService {
            backend: backend.clone(),
        };

        for (req, field) in [
            (request("not-a-uid", "workers-0", 3, Fault::Lose), "run_uid"),
            (request(UID, "Workers_0", 3, Fault::Lose), "node_id"),
            (request(UID, "workers-0", 0, Fault::Lose), "attempt"),
            (request(UID, "workers-0", 3, Fault::Unspecified), "fault"),
        ] {
            let err = FakeControl::inflict(&svc, req).await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
            assert!(err.message().starts_with(field), "{field}: {}", err.message());
        }
        let mut unknown = request(UID, "workers-0", 3, Fault::Lose);
        unknown.get_mut().fault = 42;
        let err = FakeControl::inflict(&svc, unknown).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().starts_with("fault"), "{}", err.message());
        // Nothing changed: the resource is still there, and nothing was reported.
        assert_eq!(backend.inventory().await.unwrap().len(), 1);
        assert!(rx.try_recv().is_err());

        let err = FakeControl::inflict(&svc, request(UID, "workers-0", 4, Fault::Sicken))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound, "{err:?}");
        assert!(err.message().contains("attempt a4"), "{}", err.message());

        FakeControl::inflict(&svc, request(UID, "workers-0", 3, Fault::Lose))
            .await
            .unwrap();
        let lost = rx.recv().await.unwrap();
        assert_eq!(lost.identity.attempt, AttemptId::new(3));
        assert!(backend.inventory().await.unwrap().is_empty());
        let err = FakeControl::inflict(&svc, request(UID, "workers-0", 3, Fault::Lose))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
    }
}
