//! Fixtures shared by the decider service's tests: a server on `127.0.0.1:0`,
//! a client for it, and a run whose nodes reach most rows of the ladder.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc};

use contract::{
    AttemptId, BootstrapProgress, BootstrapStage, ClusterShape, Effect, Endpoint, Failure, Generation,
    GroupId, Intent, LeaseId, LogicalNodeId, ManagedNode, NodeGroup, NodeStage, NodeTemplate, OperationId,
    Param, PendingOp, PermanentFailure, RetryState, RunId, SessionId, TraceContext, UnixMillis,
    pb::decider_client::DeciderClient, shape::example_template,
};
use decider::SlotSet;
use decider_svc::server::{Config, run};
use tokio::{sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

pub const NOW: u64 = 1_700_000_000_000;

pub fn now() -> UnixMillis {
    UnixMillis::new(NOW)
}

pub fn at(offset_ms: i64) -> UnixMillis {
    UnixMillis::new(NOW.checked_add_signed(offset_ms).unwrap())
}

pub fn trace() -> TraceContext {
    TraceContext {
        traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
        tracestate: "vendor=1".to_owned(),
    }
}

/// A decider served on an ephemeral loopback port until the value is dropped
/// or [`Server::stop`] is called.
pub struct Server {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), decider_svc::server::ServerError>>,
}

impl Server {
    pub async fn start(config: Config) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run(
            listener,
            async {
                let _ = stopped.await;
            },
            config,
        ));
        Server {
            addr,
            stop: Some(stop),
            task,
        }
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn client(&self) -> DeciderClient<Channel> {
        DeciderClient::new(self.channel().await)
    }

    /// What the driver calls the decider through ([`decider_svc::decide_call`]).
    pub async fn decider_channel(&self) -> decider_svc::DeciderChannel<Channel> {
        decider_svc::DeciderChannel::new(self.channel().await)
    }

    /// Stops the server and checks that it shut down cleanly.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.unwrap().unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Sends `requests` and returns the status the decider refused them with.
pub async fn refusal(server: &Server, requests: Vec<contract::pb::DecideRequest>) -> tonic::Status {
    match decider_svc::decide(&mut server.client().await, requests).await {
        Err(decider_svc::DecideError::Rejected(status)) => status,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

pub fn gid(s: &str) -> GroupId {
    GroupId::parse("group", s).unwrap()
}

pub fn nid(s: &str) -> LogicalNodeId {
    LogicalNodeId::parse("node", s).unwrap()
}

/// A template with secrets, labels and accelerators, so that every part of a
/// template crosses the wire.
pub fn template(image: &str) -> NodeTemplate {
    let mut t = example_template("fake", image);
    t.provider.labels = BTreeMap::from([("team".to_owned(), "ml".to_owned())]);
    t.boot.insert(
        "token".to_owned(),
        Param {
            value: "s3cret".to_owned(),
            secret: true,
        },
    );
    t.join.insert(
        "cluster".to_owned(),
        Param {
            value: "c1".to_owned(),
            secret: false,
        },
    );
    t
}

pub fn shape(groups: &[(&str, u32, &Arc<NodeTemplate>)]) -> ClusterShape {
    ClusterShape {
        run_id: RunId::parse("run_id", "train-7").unwrap(),
        generation: Generation::new(3),
        labels: Default::default(),
        groups: groups
            .iter()
            .map(|(id, count, t)| NodeGroup {
                id: gid(id),
                count: *count,
                template: Arc::clone(t),
                policy: Default::default(),
            })
            .collect(),
    }
}

/// Node builder: `N::new("cpu-1", &spec).stage(..).lease()`.
#[derive(Debug, Clone)]
pub struct N(pub ManagedNode);

impl N {
    pub fn new(id: &str, spec: &Arc<NodeTemplate>) -> N {
        N(ManagedNode::new(
            nid(id),
            AttemptId::new(42),
            Arc::clone(spec),
            RetryState::default(),
        ))
    }
    pub fn stage(mut self, s: NodeStage) -> Self {
        self.0.stage = s;
        self
    }
    pub fn deleting(mut self) -> Self {
        self.0.intent = Intent::Deleting;
        self
    }
    pub fn lease(mut self) -> Self {
        self.0.facts.lease = Some(LeaseId::new("lease", "lease-1").unwrap());
        self
    }
    pub fn endpoint(mut self) -> Self {
        self.0.facts.endpoint = Some(Endpoint::new("endpoint", "127.0.0.1:4242").unwrap());
        self
    }
    pub fn session(mut self) -> Self {
        self.0.facts.session = Some(SessionId::new("session", "sess-1").unwrap());
        self
    }
    pub fn bootstrap(mut self, stage: BootstrapStage) -> Self {
        self.0.facts.bootstrap = Some(BootstrapProgress {
            stage,
            seq: 4,
            at: at(-10),
            detail: String::new(),
        });
        self
    }
    pub fn failed(mut self, reason: &str) -> Self {
        self.0.facts.failure = Some(Failure {
            reason: reason.to_owned(),
            at: at(-100),
        });
        self
    }
    pub fn pending(mut self, effect: Effect, deadline: UnixMillis) -> Self {
        self.0.pending = Some(PendingOp {
            id: OperationId::new(AttemptId::new(42), 3),
            effect,
            deadline,
            dispatched_at: at(-1000),
        });
        self
    }
    pub fn next_effect_at(mut self, t: UnixMillis) -> Self {
        self.0.retry.next_effect_at = Some(t);
        self.0.retry.consecutive_failures = 2;
        self
    }
    pub fn restart_at(mut self, t: UnixMillis) -> Self {
        self.0.retry.restart_at = Some(t);
        self
    }
    pub fn permanent(mut self, reason: &str, spec: &Arc<NodeTemplate>) -> Self {
        self.0.retry.permanent = Some(PermanentFailure {
            reason: reason.to_owned(),
            spec: Arc::clone(spec),
        });
        self
    }
    pub fn stage_deadline(mut self, t: UnixMillis) -> Self {
        self.0.stage_deadline = Some(t);
        self
    }
    pub fn ambiguous_create(mut self) -> Self {
        self.0.facts.ambiguous_create = true;
        self
    }
}

/// A run and the nodes the driver would send for one pass.
pub struct Mixed {
    pub shape: ClusterShape,
    pub nodes: Vec<ManagedNode>,
    pub slots: SlotSet,
}

/// Nodes in many stages, drifted, undesired, destroyed and deleting, with
/// waits before and after `now`; slots include one node not sent (`cpu-6`) and
/// leave `cpu-7` and `gpu-4` without a node, so a pass inserts them.
pub fn mixed() -> Mixed {
    let cpu = Arc::new(template("img:2"));
    let gpu = Arc::new(template("cuda:12"));
    let old = Arc::new(template("img:1"));
    // Equal to `cpu` but another allocation, as after a reload from storage:
    // it must not count as drift, and must still cross the wire once.
    let cpu_copy = Arc::new(template("img:2"));
    let shape = shape(&[("cpu", 8, &cpu), ("gpu", 6, &gpu)]);
    let nodes = vec![
        N::new("cpu-0", &cpu).stage(NodeStage::Dormant).lease().endpoint(),
        N::new("cpu-1", &cpu_copy),
        N::new("cpu-2", &cpu).stage(NodeStage::LeaseCreated).lease(),
        N::new("cpu-3", &cpu)
            .stage(NodeStage::EndpointKnown)
            .lease()
            .endpoint(),
        N::new("cpu-4", &cpu)
            .stage(NodeStage::BootstrapRunning)
            .lease()
            .endpoint()
            .session()
            .bootstrap(BootstrapStage::AgentStarted)
            .stage_deadline(at(5_000)),
        N::new("cpu-5", &cpu)
            .stage(NodeStage::Joined)
            .lease()
            .endpoint()
            .session()
            .bootstrap(BootstrapStage::Converged),
        // Drifted: the group's template moved on.
        N::new("gpu-0", &old).stage(NodeStage::Dormant).lease().endpoint(),
        N::new("gpu-1", &gpu)
            .stage(NodeStage::LeaseRequested)
            .pending(Effect::CreateLease, at(3_000)),
        N::new("gpu-2", &gpu)
            .stage(NodeStage::Destroyed)
            .restart_at(at(1_000)),
        N::new("gpu-3", &gpu)
            .stage(NodeStage::Destroyed)
            .permanent("image not found", &gpu),
        // Undesired: beyond the group's count.
        N::new("gpu-9", &gpu).stage(NodeStage::Dormant).lease().endpoint(),
        // Undesired: its group is gone.
        N::new("old-0", &old).stage(NodeStage::Destroyed),
        N::new("old-1", &old)
            .deleting()
            .stage(NodeStage::Failed)
            .lease()
            .failed("boot check failed")
            .next_effect_at(at(2_000)),
        N::new("old-2", &old).deleting().lease().endpoint().session(),
        N::new("old-3", &old).deleting().ambiguous_create(),
        N::new("old-4", &old).deleting().stage(NodeStage::Failed),
        N::new("old-5", &old).deleting().lease(),
        // A wait whose deadline has passed is not a requeue candidate.
        N::new("old-6", &old)
            .deleting()
            .pending(Effect::DestroyLease, at(-5)),
        N::new("gpu-5", &gpu).stage(NodeStage::Failed).lease(),
    ]
    .into_iter()
    .map(|n| n.0)
    .collect::<Vec<_>>();
    let mut slots = SlotSet::new();
    for n in &nodes {
        slots.insert(&n.id);
    }
    slots.insert(&nid("cpu-6"));
    slots.finish();
    Mixed { shape, nodes, slots }
}
