//! The provider backend as the executor's shell sees it: an async trait that
//! runs one operation's effect, streams bootstrap stages through a sink and lists
//! live resources.
//!
//! The shell calls a backend off the link's task (each call on a task of its
//! own), aborts a call the core has abandoned, and sequences whatever stages the
//! backend reports. A backend is any provider: the in-memory fake
//! ([`crate::fake_backend`]) or, later, real child processes.

use contract::{
    BootstrapStage, Change, Endpoint, LeaseId, Operation, Outcome, ResourceIdentity, SessionId, TraceContext,
    UnixMillis,
};
use futures::future::BoxFuture;
use tokio::sync::mpsc;

/// One bootstrap stage as a backend reports it, before the core gives it its
/// per-session sequence number.
#[derive(Debug, Clone, PartialEq)]
pub struct RawObservation {
    pub identity: ResourceIdentity,
    pub session: SessionId,
    pub stage: BootstrapStage,
    pub detail: String,
    pub at: UnixMillis,
    /// The trace of the operation that started the session. [`ObservationSink`]
    /// stamps it, so a backend leaves it empty.
    pub trace: TraceContext,
}

impl RawObservation {
    pub fn new(
        identity: ResourceIdentity,
        session: SessionId,
        stage: BootstrapStage,
        detail: String,
        at: UnixMillis,
    ) -> Self {
        Self {
            identity,
            session,
            stage,
            detail,
            at,
            trace: TraceContext::default(),
        }
    }
}

/// Where a backend sends the stages of a bootstrap session. A backend may keep
/// the sink and send stages long after [`Backend::execute`] returned; the sink is
/// cheap to clone.
///
/// The channel is unbounded because a backend must never block on the
/// executor's actor (which may be waiting on the backend). Stages are few per
/// session, so the queue stays small.
#[derive(Debug, Clone)]
pub struct ObservationSink {
    tx: mpsc::UnboundedSender<RawObservation>,
    trace: TraceContext,
}

impl ObservationSink {
    /// A sink whose observations join `trace`, the trace of the operation that
    /// started the session.
    pub fn new(tx: mpsc::UnboundedSender<RawObservation>, trace: TraceContext) -> Self {
        Self { tx, trace }
    }

    /// Sends one stage. Returns `false` once the executor no longer listens
    /// (it is shutting down), so a backend can stop producing.
    pub fn send(&self, mut observation: RawObservation) -> bool {
        observation.trace = self.trace.clone();
        self.tx.send(observation).is_ok()
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// A change a backend saw in a resource it holds, outside any operation
/// (the resource is gone), before the core gives it its sequence number.
#[derive(Debug, Clone, PartialEq)]
pub struct RawChange {
    pub identity: ResourceIdentity,
    pub change: Change,
    pub at: UnixMillis,
}

/// Where a backend reports the changes it sees in the resources it holds.
/// Unbounded for the reason [`ObservationSink`] is; cheap to clone.
#[derive(Debug, Clone)]
pub struct ChangeSink {
    tx: mpsc::UnboundedSender<RawChange>,
}

impl ChangeSink {
    pub fn new(tx: mpsc::UnboundedSender<RawChange>) -> Self {
        Self { tx }
    }

    /// Reports one change. Returns `false` once the executor no longer
    /// listens.
    pub fn send(&self, change: RawChange) -> bool {
        self.tx.send(change).is_ok()
    }
}

/// A live resource, by identity.
#[derive(Debug, Clone, PartialEq)]
pub struct InventoryItem {
    pub identity: ResourceIdentity,
    pub lease: Option<LeaseId>,
    /// Known once the resource's endpoint is bound.
    pub endpoint: Option<Endpoint>,
    /// A bootstrap session exists on the resource (neither cancelled nor
    /// destroyed).
    pub session_live: bool,
}

/// What failed in a backend request that is not an operation (an operation's
/// failures are [`Outcome`]s).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The provider cannot be reached or cannot answer now; asking later may work.
    #[error("the provider backend is unavailable: {0}")]
    Unavailable(String),
    /// The backend itself is broken.
    #[error("the provider backend failed: {0}")]
    Internal(String),
}

/// A provider backend.
///
/// Rules every implementation keeps (SPEC.md section 5):
/// - every provider request is keyed on `op.identity()`;
/// - a create adopts an existing resource with that identity before it makes one,
///   and so does a start of a bootstrap session;
/// - cancel and destroy treat "already absent" as success;
/// - an outcome the backend is not sure of is `Outcome::Ambiguous`, never a
///   definite failure.
///
/// The future of [`Backend::execute`] may be dropped before it completes (the
/// core abandons an operation at its deadline); the effect may then have happened
/// or not, which the core has already reported as ambiguous.
pub trait Backend: Send + Sync + 'static {
    /// Runs one operation's effect. Bootstrap stages of a session it starts go to
    /// `observations`, for as long as the session lasts.
    fn execute(&self, op: Operation, observations: ObservationSink) -> BoxFuture<'static, Outcome>;

    /// Every live resource, by identity.
    fn inventory(&self) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>>;

    /// Called once when the executor starts: sessions the backend found already
    /// running (it adopted them after a restart) stream their stages here,
    /// since no `StartBootstrap` of this executor handed them a sink.
    fn resume(&self, _observations: ObservationSink) {}

    /// Called once when the executor starts: from then on the backend
    /// watches every resource it holds (the ones it creates and the ones it
    /// found at start) and reports each one that is lost to `changes` as soon
    /// as it knows, but never one it destroys on request.
    fn watch(&self, _changes: ChangeSink) {}

    /// One health probe of a resource's endpoint (SPEC.md section 8):
    /// `Err` says what failed. The caller bounds it by the group's timeout.
    /// The default is a TCP connect.
    fn probe(
        &self,
        _identity: &ResourceIdentity,
        endpoint: &Endpoint,
    ) -> BoxFuture<'static, Result<(), String>> {
        tcp_probe(endpoint)
    }
}

/// The default health probe: a TCP connect to the endpoint.
pub fn tcp_probe(endpoint: &Endpoint) -> BoxFuture<'static, Result<(), String>> {
    let addr = endpoint.as_str().to_owned();
    Box::pin(async move {
        tokio::net::TcpStream::connect(&addr)
            .await
            .map(drop)
            .map_err(|e| format!("connect to {addr}: {e}"))
    })
}
