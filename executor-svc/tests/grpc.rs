//! The executor through its gRPC surface: a real server on 127.0.0.1:0 with the
//! fake backend, driven through `ExecutorClient` as a driver would.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context as _, bail, ensure};
use contract::{
    Clock, RunUid, SystemClock,
    pb::{self, executor_client::ExecutorClient, executor_message::Kind},
    shape::example_template,
};
use executor_svc::{
    fake::FakeConfig,
    fake_backend::FakeBackend,
    server::{self, Config, ServerError},
};
use tokio::{
    net::TcpListener,
    sync::{mpsc, oneshot},
    task::JoinHandle,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Streaming, transport::Channel};

type TestResult = anyhow::Result<()>;

const RUN: RunUid = RunUid::from_u128(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// How long a test waits for a message it expects.
const PATIENCE: Duration = Duration::from_secs(5);

/// A directory of the test's own, removed when the guard drops.
fn temp_dir() -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix("executor-svc-grpc-").tempdir()?)
}

fn fake(latency_ms: u64) -> FakeConfig {
    FakeConfig {
        latency_ms: (latency_ms, latency_ms),
        stage_interval_ms: 20,
        ..FakeConfig::default()
    }
}

struct Harness {
    addr: SocketAddr,
    backend: FakeBackend,
    stop: Option<oneshot::Sender<()>>,
    server: JoinHandle<Result<(), ServerError>>,
}

impl Harness {
    async fn start(config: FakeConfig, state_file: Option<PathBuf>) -> anyhow::Result<Self> {
        Self::start_with(config, state_file, None).await
    }

    /// With `state_dir`, the executor keeps fencing and results across restarts.
    async fn start_with(
        config: FakeConfig,
        state_file: Option<PathBuf>,
        state_dir: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        Self::start_full(config, state_file, state_dir, false).await
    }

    /// With `control`, the executor serves the fake's control service.
    async fn start_full(
        config: FakeConfig,
        state_file: Option<PathBuf>,
        state_dir: Option<PathBuf>,
        control: bool,
    ) -> anyhow::Result<Self> {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let backend = FakeBackend::start(config, state_file, Arc::clone(&clock))?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let config = Config {
            shutdown_grace: Duration::from_secs(3),
            state_dir,
            fake_control: control.then(|| backend.clone()),
            ..Config::default()
        };
        let server = tokio::spawn(server::run(
            listener,
            shutdown,
            config,
            Arc::new(backend.clone()),
            clock,
        ));
        Ok(Self {
            addr,
            backend,
            stop: Some(stop),
            server,
        })
    }

    async fn channel(&self) -> anyhow::Result<Channel> {
        Ok(Channel::from_shared(format!("http://{}", self.addr))?
            .connect()
            .await?)
    }

    async fn client(&self) -> anyhow::Result<ExecutorClient<Channel>> {
        Ok(ExecutorClient::new(self.channel().await?))
    }

    async fn link(&self) -> anyhow::Result<Link> {
        let (tx, rx) = mpsc::channel(64);
        let inbound = self
            .client()
            .await?
            .link(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Link { tx, inbound })
    }

    /// Triggers shutdown and waits for the server to finish.
    async fn shutdown(mut self) -> TestResult {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(10), &mut self.server)
            .await
            .context("the server did not stop")???;
        Ok(())
    }
}

/// One driver link.
struct Link {
    tx: mpsc::Sender<pb::DriverMessage>,
    inbound: Streaming<pb::ExecutorMessage>,
}

impl Link {
    async fn send(&self, kind: pb::driver_message::Kind) -> TestResult {
        let msg = pb::DriverMessage {
            kind: Some(kind),
            trace: None,
        };
        self.tx.send(msg).await.context("the link is closed")
    }

    async fn claim(&self, epoch: u64) -> TestResult {
        self.send(pb::driver_message::Kind::Claim(pb::Claim {
            run_uid: RUN.to_string(),
            run_id: "train".to_owned(),
            epoch,
        }))
        .await
    }

    async fn submit(&self, op: pb::Operation) -> TestResult {
        self.send(pb::driver_message::Kind::Submit(op)).await
    }

    async fn ack_result(&self, id: pb::OperationId) -> TestResult {
        self.send(pb::driver_message::Kind::Ack(pb::Ack {
            results: vec![pb::ResultRef {
                run_uid: RUN.to_string(),
                id: Some(id),
            }],
            observations: Vec::new(),
            changes: Vec::new(),
        }))
        .await
    }

    async fn next_message(&mut self) -> anyhow::Result<pb::ExecutorMessage> {
        match tokio::time::timeout(PATIENCE, self.inbound.message()).await {
            Err(_) => bail!("no message within {PATIENCE:?}"),
            Ok(Err(status)) => bail!("the link failed: {status}"),
            Ok(Ok(None)) => bail!("the link ended"),
            Ok(Ok(Some(msg))) => Ok(msg),
        }
    }

    async fn next(&mut self) -> anyhow::Result<Kind> {
        self.next_message()
            .await?
            .kind
            .context("a message without a kind")
    }

    async fn claimed(&mut self, epoch: u64) -> TestResult {
        match self.next().await? {
            Kind::Claimed(c) => {
                ensure!(c.epoch == epoch && c.run_uid == RUN.to_string(), "{c:?}");
                Ok(())
            }
            other => bail!("expected a claim acceptance, got {other:?}"),
        }
    }

    /// The next result, skipping observations.
    async fn result(&mut self) -> anyhow::Result<pb::OperationResult> {
        loop {
            match self.next().await? {
                Kind::Result(r) => return Ok(r),
                Kind::Observation(_) => {}
                other => bail!("expected a result, got {other:?}"),
            }
        }
    }

    async fn rejection(&mut self) -> anyhow::Result<pb::Rejection> {
        match self.next().await? {
            Kind::Rejection(r) => Ok(r),
            other => bail!("expected a rejection, got {other:?}"),
        }
    }

    /// Nothing arrives for `quiet`.
    async fn silent_for(&mut self, quiet: Duration) -> TestResult {
        match tokio::time::timeout(quiet, self.inbound.message()).await {
            Err(_) => Ok(()),
            Ok(got) => bail!("expected silence, got {got:?}"),
        }
    }
}

fn deadline_in(ms: u64) -> u64 {
    SystemClock.now().as_millis() + ms
}

fn op_id(attempt: u64, seq: u32) -> pb::OperationId {
    pb::OperationId { attempt, seq }
}

fn op(id: pb::OperationId, epoch: u64, deadline_ms: u64, input: pb::operation::Input) -> pb::Operation {
    pb::Operation {
        run_uid: RUN.to_string(),
        run_id: "train".to_owned(),
        node_id: "workers-0".to_owned(),
        id: Some(id),
        epoch,
        deadline_ms,
        provider: "fake".to_owned(),
        input: Some(input),
        trace: Some(pb::TraceContext {
            traceparent: TRACEPARENT.to_owned(),
            tracestate: String::new(),
        }),
    }
}

fn create_input() -> pb::operation::Input {
    pb::operation::Input::CreateLease(pb::CreateLeaseInput {
        template: Some(pb::NodeTemplate::from(&example_template("fake", "img:1"))),
    })
}

fn create(epoch: u64, deadline_ms: u64) -> pb::Operation {
    op(op_id(1, 0), epoch, deadline_ms, create_input())
}

fn outcome(r: &pb::OperationResult) -> pb::OutcomeClass {
    pb::OutcomeClass::try_from(r.outcome).unwrap_or(pb::OutcomeClass::Unspecified)
}

fn reason(r: &pb::Rejection) -> pb::RejectionReason {
    pb::RejectionReason::try_from(r.reason).unwrap_or(pb::RejectionReason::Unspecified)
}

fn lease_of(r: &pb::OperationResult) -> anyhow::Result<String> {
    let lease = r.facts.as_ref().map(|f| f.lease_id.clone()).unwrap_or_default();
    ensure!(!lease.is_empty(), "no lease in {r:?}");
    Ok(lease)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resubmitted_operation_replays_and_conflicting_input_is_rejected() -> TestResult {
    let h = Harness::start(fake(5), None).await?;
    let mut link = h.link().await?;
    link.claim(1).await?;
    link.claimed(1).await?;

    let first = create(1, deadline_in(30_000));
    link.submit(first.clone()).await?;
    let result = link.result().await?;
    ensure!(outcome(&result) == pb::OutcomeClass::Succeeded, "{result:?}");
    ensure!(!result.replayed && !result.late, "{result:?}");
    ensure!(result.id == Some(op_id(1, 0)), "{result:?}");
    let lease = lease_of(&result)?;
    ensure!(
        result.trace.as_ref().map(|t| t.traceparent.as_str()) == Some(TRACEPARENT),
        "the result carries the operation's trace: {result:?}"
    );
    link.ack_result(op_id(1, 0)).await?;

    // Another deadline is not another input: a replay of the recorded result.
    let mut again = first;
    again.deadline_ms = deadline_in(60_000);
    link.submit(again).await?;
    let replay = link.result().await?;
    ensure!(replay.replayed, "{replay:?}");
    ensure!(outcome(&replay) == pb::OutcomeClass::Succeeded, "{replay:?}");
    ensure!(lease_of(&replay)? == lease);
    ensure!(
        h.backend.with_provider(|p| p.calls()) == 1,
        "a replay does not call the backend"
    );

    let other = op(
        op_id(1, 0),
        1,
        deadline_in(30_000),
        pb::operation::Input::DestroyLease(pb::DestroyLeaseInput { lease_id: lease }),
    );
    link.submit(other).await?;
    let rejected = link.rejection().await?;
    ensure!(
        reason(&rejected) == pb::RejectionReason::ConflictingInput,
        "{rejected:?}"
    );
    ensure!(rejected.id == Some(op_id(1, 0)), "{rejected:?}");

    // An undecodable operation is rejected as invalid, naming the field.
    let mut broken = create(1, 0);
    broken.id = Some(op_id(1, 1));
    link.submit(broken).await?;
    let invalid = link.rejection().await?;
    ensure!(reason(&invalid) == pb::RejectionReason::Invalid, "{invalid:?}");
    ensure!(invalid.message.contains("deadline_ms"), "{invalid:?}");
    ensure!(invalid.id == Some(op_id(1, 1)), "{invalid:?}");
    h.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_epoch_is_fenced() -> TestResult {
    let h = Harness::start(fake(1), None).await?;
    let mut current = h.link().await?;
    current.claim(2).await?;
    current.claimed(2).await?;

    let mut stale = h.link().await?;
    stale.claim(1).await?;
    let fenced = stale.rejection().await?;
    ensure!(reason(&fenced) == pb::RejectionReason::Fenced, "{fenced:?}");
    ensure!(fenced.highest_epoch == 2 && fenced.id.is_none(), "{fenced:?}");

    stale.submit(create(1, deadline_in(30_000))).await?;
    let fenced = stale.rejection().await?;
    ensure!(reason(&fenced) == pb::RejectionReason::Fenced, "{fenced:?}");
    ensure!(fenced.id == Some(op_id(1, 0)), "{fenced:?}");
    ensure!(
        h.backend.with_provider(|p| p.calls()) == 0,
        "nothing fenced reaches the backend"
    );

    // The fenced driver cannot acknowledge on the current driver's behalf.
    stale.ack_result(op_id(1, 0)).await?;
    let refused = stale.rejection().await?;
    ensure!(reason(&refused) == pb::RejectionReason::UnknownRun, "{refused:?}");
    current.silent_for(Duration::from_millis(100)).await?;
    h.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_stages_stream_in_sequence_and_replay_from_a_cursor() -> TestResult {
    let h = Harness::start(fake(1), None).await?;
    let mut link = h.link().await?;
    link.claim(1).await?;
    link.claimed(1).await?;

    link.submit(create(1, deadline_in(30_000))).await?;
    let created = link.result().await?;
    let lease = lease_of(&created)?;
    let endpoint = created
        .facts
        .as_ref()
        .map(|f| f.endpoint.clone())
        .unwrap_or_default();
    ensure!(!endpoint.is_empty(), "{created:?}");
    link.ack_result(op_id(1, 0)).await?;

    let start = pb::operation::Input::StartBootstrap(pb::StartBootstrapInput {
        lease_id: lease,
        endpoint,
        boot: Default::default(),
        join: Default::default(),
    });
    link.submit(op(op_id(1, 1), 1, deadline_in(30_000), start))
        .await?;

    let mut session = None;
    let mut observations = Vec::new();
    loop {
        match link.next().await? {
            Kind::Result(r) => {
                ensure!(outcome(&r) == pb::OutcomeClass::Succeeded, "{r:?}");
                session = r.facts.map(|f| f.session_id);
            }
            Kind::Observation(o) => {
                let converged = o.stage == pb::BootstrapStage::Converged as i32;
                observations.push(o);
                if converged {
                    break;
                }
            }
            other => bail!("unexpected {other:?}"),
        }
    }
    if session.is_none() {
        session = link.result().await?.facts.map(|f| f.session_id);
    }
    let session = session.context("the start reports its session")?;
    let seqs: Vec<u64> = observations.iter().map(|o| o.seq).collect();
    ensure!(seqs == [1, 2, 3, 4, 5], "{observations:?}");
    for o in &observations {
        ensure!(
            o.session_id == session && o.attempt == 1 && o.node_id == "workers-0",
            "{o:?}"
        );
        ensure!(
            o.trace.as_ref().map(|t| t.traceparent.as_str()) == Some(TRACEPARENT),
            "an observation joins the trace of the start: {o:?}"
        );
    }

    link.send(pb::driver_message::Kind::ObserveFrom(pb::ObserveFrom {
        run_uid: RUN.to_string(),
        after: vec![pb::ObservationRef {
            run_uid: String::new(),
            session_id: session.clone(),
            seq: 2,
        }],
    }))
    .await?;
    let mut replayed = Vec::new();
    for _ in 0..3 {
        match link.next().await? {
            Kind::Observation(o) => replayed.push((o.seq, o.stage)),
            other => bail!("expected a replayed observation, got {other:?}"),
        }
    }
    let expected = [
        (3, pb::BootstrapStage::AgentStarted as i32),
        (4, pb::BootstrapStage::Joined as i32),
        (5, pb::BootstrapStage::Converged as i32),
    ];
    ensure!(replayed == expected, "{replayed:?}");
    link.silent_for(Duration::from_millis(200)).await?;
    h.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_is_kept_until_acknowledged_across_links() -> TestResult {
    let h = Harness::start(fake(200), None).await?;
    let mut first = h.link().await?;
    first.claim(1).await?;
    first.claimed(1).await?;
    first.submit(create(1, deadline_in(30_000))).await?;
    // Once the backend has the call, the driver goes away before the result exists.
    let started = async {
        while h.backend.with_provider(|p| p.calls()) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(PATIENCE, started).await?;
    drop(first);
    tokio::time::sleep(Duration::from_millis(400)).await;

    let mut second = h.link().await?;
    second.claim(1).await?;
    second.claimed(1).await?;
    let result = second.result().await?;
    ensure!(result.id == Some(op_id(1, 0)), "{result:?}");
    ensure!(outcome(&result) == pb::OutcomeClass::Succeeded, "{result:?}");
    ensure!(!result.replayed, "{result:?}");
    second.ack_result(op_id(1, 0)).await?;
    // A link's messages are handled in order: once a claim sent after the
    // acknowledgement is answered, the acknowledgement was taken.
    second.claim(1).await?;
    second.claimed(1).await?;

    // Acknowledged, it is not sent to the next claimant.
    let mut third = h.link().await?;
    third.claim(1).await?;
    third.claimed(1).await?;
    third.silent_for(Duration::from_millis(200)).await?;
    h.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_past_its_deadline_is_ambiguous() -> TestResult {
    let h = Harness::start(fake(1_500), None).await?;
    let mut link = h.link().await?;
    link.claim(1).await?;
    link.claimed(1).await?;
    link.submit(create(1, deadline_in(300))).await?;

    let abandoned = link.result().await?;
    ensure!(
        outcome(&abandoned) == pb::OutcomeClass::Ambiguous,
        "{abandoned:?}"
    );
    ensure!(!abandoned.late, "{abandoned:?}");
    // The backend call was aborted, so no late completion follows; a resubmission
    // replays the ambiguous result rather than running again.
    link.silent_for(Duration::from_millis(1_700)).await?;
    link.submit(create(1, deadline_in(30_000))).await?;
    let replay = link.result().await?;
    ensure!(
        replay.replayed && outcome(&replay) == pb::OutcomeClass::Ambiguous,
        "{replay:?}"
    );
    h.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_in_the_state_file_outlive_the_executor() -> TestResult {
    let dir = temp_dir()?;
    let state_file = dir.path().join("fake-state.json");
    let first = Harness::start(fake(1), Some(state_file.clone())).await?;
    let mut link = first.link().await?;
    link.claim(1).await?;
    link.claimed(1).await?;
    link.submit(create(1, deadline_in(30_000))).await?;
    let lease = lease_of(&link.result().await?)?;
    link.ack_result(op_id(1, 0)).await?;

    // Shutting down closes the open link with UNAVAILABLE.
    first.shutdown().await?;
    match tokio::time::timeout(PATIENCE, link.inbound.message()).await? {
        Err(status) => ensure!(status.code() == tonic::Code::Unavailable, "{status}"),
        Ok(other) => bail!("expected the link to fail, got {other:?}"),
    }

    let second = Harness::start(fake(1), Some(state_file)).await?;
    let inventory = second
        .client()
        .await?
        .inventory(pb::InventoryRequest {
            run_uid: RUN.to_string(),
        })
        .await?
        .into_inner();
    ensure!(inventory.resources.len() == 1, "{inventory:?}");
    let resource = &inventory.resources[0];
    ensure!(resource.lease_id == lease, "{resource:?}");
    ensure!(
        resource.node_id == "workers-0" && resource.attempt == 1,
        "{resource:?}"
    );
    ensure!(!resource.endpoint.is_empty(), "{resource:?}");

    // Another run's filter lists nothing.
    let none = second
        .client()
        .await?
        .inventory(pb::InventoryRequest {
            run_uid: RunUid::from_u128(1).to_string(),
        })
        .await?
        .into_inner();
    ensure!(none.resources.is_empty(), "{none:?}");

    // A new executor knows no claim; after one, the same create adopts the lease.
    let mut link = second.link().await?;
    link.submit(create(1, deadline_in(30_000))).await?;
    let unknown = link.rejection().await?;
    ensure!(reason(&unknown) == pb::RejectionReason::UnknownRun, "{unknown:?}");
    link.claim(1).await?;
    link.claimed(1).await?;
    link.submit(create(1, deadline_in(30_000))).await?;
    let adopted = link.result().await?;
    ensure!(outcome(&adopted) == pb::OutcomeClass::Succeeded, "{adopted:?}");
    ensure!(!adopted.replayed, "the new executor ran it: {adopted:?}");
    ensure!(lease_of(&adopted)? == lease);
    let counts = second
        .backend
        .with_provider(|p| (p.creates(), p.adoptions(), p.live_resources(RUN)));
    ensure!(counts == (0, 1, 1), "creates, adoptions, live: {counts:?}");
    second.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inventory_filter_must_be_a_run_uid() -> TestResult {
    let h = Harness::start(fake(1), None).await?;
    let err = h
        .client()
        .await?
        .inventory(pb::InventoryRequest {
            run_uid: "not-a-uid".to_owned(),
        })
        .await
        .err()
        .context("a malformed filter is refused")?;
    ensure!(err.code() == tonic::Code::InvalidArgument, "{err}");
    ensure!(err.message().contains("run_uid"), "{err}");
    h.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_are_served() -> TestResult {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };

    let h = Harness::start(fake(1), None).await?;
    let channel = h.channel().await?;
    let health = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: "provisioning.internal.v1.Executor".to_owned(),
        })
        .await?
        .into_inner();
    ensure!(health.status == ServingStatus::Serving as i32, "{health:?}");

    let names = reflected_services(channel).await?;
    ensure!(
        names.iter().any(|n| n == "provisioning.internal.v1.Executor"),
        "{names:?}"
    );
    h.shutdown().await
}

/// The services server reflection lists.
async fn reflected_services(channel: Channel) -> anyhow::Result<Vec<String>> {
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter([request]))
        .await?
        .into_inner();
    let response = responses.message().await?.context("a reflection response")?;
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        bail!("expected a service list, got {response:?}");
    };
    Ok(list.service.into_iter().map(|s| s.name).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_completed_before_a_restart_is_replayed_not_run_again() -> TestResult {
    let dir = temp_dir()?;
    let state_file = dir.path().join("fake-state.json");
    let state_dir = dir.path().join("executor-state");
    let first = Harness::start_with(fake(1), Some(state_file.clone()), Some(state_dir.clone())).await?;
    let mut link = first.link().await?;
    link.claim(2).await?;
    link.claimed(2).await?;
    link.submit(create(2, deadline_in(30_000))).await?;
    let lease = lease_of(&link.result().await?)?;
    ensure!(first.backend.with_provider(|p| p.calls()) == 1);
    // Completed, not acknowledged: the executor restarts.
    first.shutdown().await?;

    let second = Harness::start_with(fake(1), Some(state_file), Some(state_dir)).await?;
    let mut link = second.link().await?;
    // The old incarnation's epoch stays fenced across the restart.
    link.claim(1).await?;
    let fenced = link.rejection().await?;
    ensure!(reason(&fenced) == pb::RejectionReason::Fenced, "{fenced:?}");
    ensure!(fenced.highest_epoch == 2, "{fenced:?}");
    link.claim(2).await?;
    link.claimed(2).await?;
    // Nothing is sent unasked: the driver resubmits what it holds pending.
    // The resubmission is answered from the record without a backend call,
    // first as the result re-sent (the last incarnation may never have
    // sent it), then as replays.
    link.submit(create(2, deadline_in(30_000))).await?;
    let resent = link.result().await?;
    ensure!(!resent.replayed, "{resent:?}");
    ensure!(lease_of(&resent)? == lease, "{resent:?}");
    link.submit(create(2, deadline_in(30_000))).await?;
    let replayed = link.result().await?;
    ensure!(replayed.replayed, "{replayed:?}");
    ensure!(lease_of(&replayed)? == lease, "{replayed:?}");
    ensure!(
        second.backend.with_provider(|p| p.calls()) == 0,
        "the operation ran again against the backend"
    );
    // An operation stamped with the old epoch has no effect (and the next
    // message is its rejection: no result came unasked).
    link.submit(op(op_id(3, 1), 1, deadline_in(30_000), create_input()))
        .await?;
    let old = link.rejection().await?;
    ensure!(reason(&old) == pb::RejectionReason::Fenced, "{old:?}");
    ensure!(second.backend.with_provider(|p| p.calls()) == 0);
    second.shutdown().await
}

/// The fake's control service is served only on request; through it a
/// resource is lost behind the executor's back, which the executor reports on
/// the link as it reports any loss, and a second loss of it names nothing.
/// Reflection never lists the test double.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_control_service_loses_a_resource_only_when_served() -> TestResult {
    use contract::pb::fake::v1::{Fault, InflictRequest, fake_control_client::FakeControlClient};

    let inflict = |attempt: u64| InflictRequest {
        run_uid: RUN.to_string(),
        node_id: "workers-0".to_owned(),
        attempt,
        fault: Fault::Lose as i32,
    };
    let plain = Harness::start(fake(1), None).await?;
    let refused = FakeControlClient::new(plain.channel().await?)
        .inflict(inflict(1))
        .await
        .err()
        .context("an executor started without the control service served it")?;
    ensure!(refused.code() == tonic::Code::Unimplemented, "{refused:?}");
    plain.shutdown().await?;

    let h = Harness::start_full(fake(1), None, None, true).await?;
    let names = reflected_services(h.channel().await?).await?;
    ensure!(
        names.iter().all(|n| !n.contains("FakeControl")),
        "reflection lists the test double: {names:?}"
    );
    let mut link = h.link().await?;
    link.claim(1).await?;
    link.claimed(1).await?;
    link.submit(create(1, deadline_in(30_000))).await?;
    let made = link.result().await?;
    ensure!(outcome(&made) == pb::OutcomeClass::Succeeded, "{made:?}");
    link.ack_result(op_id(1, 0)).await?;

    let mut control = FakeControlClient::new(h.channel().await?);
    control.inflict(inflict(1)).await?;
    let change = loop {
        match link.next().await? {
            Kind::Change(c) => break c,
            Kind::Observation(_) => {}
            other => bail!("expected the loss, got {other:?}"),
        }
    };
    ensure!(
        change.attempt == 1
            && change.node_id == "workers-0"
            && matches!(change.change, Some(pb::resource_change::Change::Lost(_))),
        "{change:?}"
    );
    let listed = h
        .client()
        .await?
        .inventory(pb::InventoryRequest::default())
        .await?
        .into_inner()
        .resources;
    ensure!(listed.is_empty(), "the lost resource is still listed: {listed:?}");
    let again = control.inflict(inflict(1)).await.err().context("a second loss")?;
    ensure!(again.code() == tonic::Code::NotFound, "{again:?}");
    let bad = control
        .inflict(InflictRequest {
            node_id: "Workers".to_owned(),
            ..inflict(1)
        })
        .await
        .err()
        .context("a malformed node id")?;
    ensure!(
        bad.code() == tonic::Code::InvalidArgument && bad.message().starts_with("node_id"),
        "{bad:?}"
    );
    h.shutdown().await
}

/// `InventoryPages` reads the backend a page at a time (the fake's pages
/// hold 4,096 resources): every resource is listed once, in order, with its
/// run's epoch, the last page marked and the stream ended after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inventory_pages_list_a_read_of_many_backend_pages_once() -> TestResult {
    const HELD: u64 = 5_000;
    let h = Harness::start(fake(0), None).await?;
    let mut link = h.link().await?;
    link.claim(2).await?;
    link.claimed(2).await?;
    for batch in (1..=HELD).collect::<Vec<_>>().chunks(250) {
        for &attempt in batch {
            link.submit(op(op_id(attempt, 0), 2, deadline_in(30_000), create_input()))
                .await?;
        }
        for _ in batch {
            let r = link.result().await?;
            ensure!(outcome(&r) == pb::OutcomeClass::Succeeded, "{r:?}");
        }
    }
    let mut pages = h
        .client()
        .await?
        .inventory_pages(pb::InventoryRequest::default())
        .await?
        .into_inner();
    let mut listed = Vec::new();
    let mut marked_last = 0;
    while let Some(page) = tokio::time::timeout(PATIENCE, pages.message()).await?? {
        ensure!(marked_last == 0, "a page after the last one");
        marked_last += usize::from(page.last);
        listed.extend(page.resources);
    }
    ensure!(marked_last == 1, "{marked_last} pages marked last");
    let attempts: Vec<u64> = listed.iter().map(|r| r.attempt).collect();
    ensure!(
        attempts == (1..=HELD).collect::<Vec<_>>(),
        "{} listed, first {:?}",
        attempts.len(),
        attempts.iter().take(5).collect::<Vec<_>>()
    );
    ensure!(
        listed
            .iter()
            .all(|r| r.epoch == 2 && r.run_uid == RUN.to_string() && !r.lease_id.is_empty()),
        "a resource without its run's epoch or lease"
    );
    // The one-message read lists the same.
    let whole = h
        .client()
        .await?
        .inventory(pb::InventoryRequest::default())
        .await?
        .into_inner();
    ensure!(whole.resources == listed, "the whole read differs from the pages");
    h.shutdown().await
}
