//! The provider backend as the executor's shell sees it: an async trait that
//! runs one operation's effect, streams bootstrap stages through a sink and lists
//! live resources.
//!
//! The shell calls a backend off the link's task (each call on a task of its
//! own), aborts a call the core has abandoned, and sequences whatever stages the
//! backend reports. A backend is any provider: the in-memory fake
//! ([`crate::fake_backend`]) or, later, real child processes.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
};

use contract::{
    AttemptId, BootstrapStage, Change, Endpoint, LeaseId, Operation, Outcome, ResourceIdentity, RunUid,
    SessionId, TraceContext, UnixMillis,
};
use futures::{
    StreamExt as _,
    future::BoxFuture,
    stream::{self, BoxStream},
};
use tokio::sync::{Notify, mpsc};

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
/// Sending never waits: a backend must never block on the executor's actor
/// (which may be waiting on the backend). What the queue holds is bounded
/// instead by coalescing (see [`observation_queue`]).
#[derive(Debug, Clone)]
pub struct ObservationSink {
    tx: ObservationSender,
    trace: TraceContext,
}

impl ObservationSink {
    /// A sink whose observations join `trace`, the trace of the operation that
    /// started the session.
    pub fn new(tx: ObservationSender, trace: TraceContext) -> Self {
        Self { tx, trace }
    }

    /// Sends one stage. Returns `false` once the executor no longer listens
    /// (it is shutting down), so a backend can stop producing.
    pub fn send(&self, mut observation: RawObservation) -> bool {
        observation.trace = self.trace.clone();
        self.tx.send(observation)
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// Past this many queued observations, a session's new stage replaces the one
/// of the same session still waiting, in its place, instead of joining the
/// back of the queue.
pub const COALESCE_PAST: usize = 4096;

/// The queue between the backends and the executor's actor: every session's
/// stages, in the order they were sent.
///
/// A backend reports a stage the moment it happens, and a provider with
/// nothing to wait for (the fake at zero latency, a plugin replaying its
/// sessions) reports a million sessions' stages faster than the actor folds
/// them: an unbounded queue of every stage held all of them at once (five a
/// node). Stages are levels, not events (a new `Watch` stream of a plugin
/// already starts from each session's latest), so while more than
/// [`COALESCE_PAST`] wait, a session's new stage takes the place of the one it
/// supersedes. The queue then holds at most [`COALESCE_PAST`] plus one entry
/// per live session, and a reader that keeps up sees every stage.
///
/// A waiting terminal stage is superseded only by another terminal one (a
/// replay): a stage before the end sent after it is dropped while it waits,
/// as a session reports nothing after its end.
pub fn observation_queue() -> (ObservationSender, ObservationReceiver) {
    let shared = Arc::new(QueueShared {
        queue: Mutex::new(Queue::default()),
        ready: Notify::new(),
        senders: AtomicUsize::new(1),
        receiver_gone: AtomicBool::new(false),
        coalesced: AtomicU64::new(0),
    });
    (
        ObservationSender(Arc::clone(&shared)),
        ObservationReceiver(shared),
    )
}

/// A session of a resource: what a stage supersedes a waiting one by.
type SessionKey = (RunUid, AttemptId, SessionId);

#[derive(Debug, Default)]
struct Queue {
    entries: VecDeque<Queued>,
    /// The position, counted from the queue's start, of `entries[0]`.
    head: u64,
    /// Where each session's indexed entry waits (entries queued past
    /// [`COALESCE_PAST`] are indexed; the ones before are not).
    waiting: HashMap<SessionKey, u64>,
}

#[derive(Debug)]
struct Queued {
    observation: RawObservation,
    indexed: bool,
}

fn key_of(o: &RawObservation) -> SessionKey {
    (o.identity.run_uid, o.identity.attempt, o.session.clone())
}

impl Queue {
    /// Queues `o`, or lets it supersede its session's waiting stage, or
    /// drops it (it is not terminal and follows a waiting terminal stage).
    fn push(&mut self, o: RawObservation) -> Push {
        if self.entries.len() < COALESCE_PAST {
            // Queued behind its session's indexed stage (the backlog went
            // below the mark in between): a later stage must not take that
            // one's place, ahead of this one, so the session's index goes.
            if !self.waiting.is_empty() {
                self.waiting.remove(&key_of(&o));
            }
            self.entries.push_back(Queued {
                observation: o,
                indexed: false,
            });
            return Push::Queued;
        }
        let key = key_of(&o);
        if let Some(&at) = self.waiting.get(&key)
            && let Some(q) = at
                .checked_sub(self.head)
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| self.entries.get_mut(i))
        {
            if q.observation.stage.is_terminal() && !o.stage.is_terminal() {
                return Push::Dropped;
            }
            q.observation = o;
            return Push::Coalesced;
        }
        let at = self.head + self.entries.len() as u64;
        self.entries.push_back(Queued {
            observation: o,
            indexed: true,
        });
        self.waiting.insert(key, at);
        Push::Queued
    }

    fn pop(&mut self) -> Option<RawObservation> {
        let q = self.entries.pop_front()?;
        if q.indexed {
            let key = key_of(&q.observation);
            if self.waiting.get(&key) == Some(&self.head) {
                self.waiting.remove(&key);
            }
        }
        self.head += 1;
        if self.entries.is_empty() && self.entries.capacity() > 2 * COALESCE_PAST {
            // A backlog's storage goes with it.
            self.entries.shrink_to(COALESCE_PAST);
            self.waiting.shrink_to(0);
        }
        Some(q.observation)
    }
}

enum Push {
    Queued,
    Coalesced,
    Dropped,
}

#[derive(Debug)]
struct QueueShared {
    queue: Mutex<Queue>,
    ready: Notify,
    senders: AtomicUsize,
    receiver_gone: AtomicBool,
    coalesced: AtomicU64,
}

impl QueueShared {
    fn locked(&self) -> std::sync::MutexGuard<'_, Queue> {
        // The queue's invariants hold between statements: a panic elsewhere
        // while it was held leaves it usable.
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The sending half of [`observation_queue`]; cheap to clone.
#[derive(Debug)]
pub struct ObservationSender(Arc<QueueShared>);

impl ObservationSender {
    /// Queues one stage. `false` once the receiver is gone.
    pub fn send(&self, o: RawObservation) -> bool {
        if self.is_closed() {
            return false;
        }
        let push = self.0.locked().push(o);
        match push {
            Push::Queued => self.0.ready.notify_one(),
            Push::Coalesced | Push::Dropped => {
                self.0.coalesced.fetch_add(1, Ordering::Relaxed);
            }
        }
        true
    }

    pub fn is_closed(&self) -> bool {
        self.0.receiver_gone.load(Ordering::Acquire)
    }
}

impl Clone for ObservationSender {
    fn clone(&self) -> Self {
        self.0.senders.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(&self.0))
    }
}

impl Drop for ObservationSender {
    fn drop(&mut self) {
        if self.0.senders.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.ready.notify_one();
        }
    }
}

/// Nothing is queued now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueEmpty;

/// The receiving half of [`observation_queue`]: the executor's actor.
#[derive(Debug)]
pub struct ObservationReceiver(Arc<QueueShared>);

impl ObservationReceiver {
    /// The next stage in order; `None` once it is empty and every sender is
    /// gone. Cancel-safe: a stage is taken only when it is returned.
    pub async fn recv(&mut self) -> Option<RawObservation> {
        loop {
            if let Some(o) = self.0.locked().pop() {
                return Some(o);
            }
            if self.0.senders.load(Ordering::Acquire) == 0 {
                return None;
            }
            // A send between the look above and this wait leaves a permit,
            // so the wait ends at once.
            self.0.ready.notified().await;
        }
    }

    pub fn try_recv(&mut self) -> Result<RawObservation, QueueEmpty> {
        self.0.locked().pop().ok_or(QueueEmpty)
    }

    /// Stages that superseded a waiting stage of their session (or were
    /// dropped after a waiting terminal one) since the queue was made.
    pub fn coalesced(&self) -> u64 {
        self.0.coalesced.load(Ordering::Relaxed)
    }
}

impl Drop for ObservationReceiver {
    fn drop(&mut self) {
        self.0.receiver_gone.store(true, Ordering::Release);
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

/// What `listing` lists of run `run_uid`.
pub fn only_run(
    listing: BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>>,
    run_uid: RunUid,
) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>> {
    Box::pin(async move {
        let mut items = listing.await?;
        items.retain(|item| item.identity.run_uid == run_uid);
        Ok(items)
    })
}

/// Every page of `pages` as one listing: a backend whose reads are paged
/// answers [`Backend::inventory`] with it.
pub fn all_pages(
    mut pages: BoxStream<'static, Result<Vec<InventoryItem>, BackendError>>,
) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>> {
    Box::pin(async move {
        let mut all = Vec::new();
        while let Some(page) = pages.next().await {
            all.extend(page?);
        }
        Ok(all)
    })
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

    /// Every live resource, read a page at a time, for a reader that looks
    /// at each resource once and keeps little of it (the driver's orphan
    /// sweep, the health prober): what the read holds is a page, not a
    /// listing as large as the executor. A resource that lives through the
    /// whole read is in exactly one page; one made or destroyed during it
    /// may be in one or in none, as it may be in a listing read at once. An
    /// error ends the read: it is never a shorter one. The default is one
    /// page of [`Backend::inventory`].
    fn inventory_pages(&self) -> BoxStream<'static, Result<Vec<InventoryItem>, BackendError>> {
        stream::once(self.inventory()).boxed()
    }

    /// The live resources of one run, for an `Inventory` or
    /// `InventoryPages` request that names its run. The default lists every
    /// run and keeps the one; a backend that can list one run alone says so
    /// here (a listing of every run of a large executor is as large as the
    /// executor). The driver's orphan sweep names no run: it reads
    /// [`Backend::inventory_pages`].
    fn inventory_of(&self, run_uid: RunUid) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>> {
        only_run(self.inventory(), run_uid)
    }

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

#[cfg(test)]
mod tests {
    use contract::{LogicalNodeId, RunId};

    use super::*;

    fn stage_of(attempt: u64, stage: BootstrapStage) -> RawObservation {
        let identity = ResourceIdentity {
            run_uid: RunUid::from_u128(7),
            run_id: RunId::parse("run_id", "r").unwrap(),
            node: LogicalNodeId::parse("node", &format!("w-{attempt}")).unwrap(),
            attempt: AttemptId::new(attempt),
        };
        let session = SessionId::new("session", &format!("s-{attempt}")).unwrap();
        RawObservation::new(identity, session, stage, String::new(), UnixMillis::new(attempt))
    }

    fn drain(rx: &mut ObservationReceiver) -> Vec<(u64, BootstrapStage)> {
        std::iter::from_fn(|| rx.try_recv().ok())
            .map(|o| (o.identity.attempt.get(), o.stage))
            .collect()
    }

    /// The stages of `attempt`'s session among what is queued, draining it.
    fn stages_of(rx: &mut ObservationReceiver, attempt: u64) -> Vec<BootstrapStage> {
        drain(rx)
            .into_iter()
            .filter(|(a, _)| *a == attempt)
            .map(|(_, s)| s)
            .collect()
    }

    /// A session's stage queued behind its indexed one, after the backlog
    /// went below the mark, is never overtaken: the stage after it goes to
    /// the back, not to the indexed one's place. (A `converged` that took
    /// the place of an earlier `agent-started` arrived before the `joined`
    /// queued after it, and the driver folded `joined` last: the node
    /// waited at `joined` until its bootstrap timeout.)
    #[test]
    fn a_stage_queued_below_the_mark_is_not_overtaken_by_a_later_one() {
        let (tx, mut rx) = observation_queue();
        let fill = |tx: &ObservationSender, from: u64, n: u64| {
            for attempt in from..from + n {
                assert!(tx.send(stage_of(attempt, BootstrapStage::Connected)));
            }
        };
        fill(&tx, 1_000, COALESCE_PAST as u64);
        // Past the mark: indexed.
        assert!(tx.send(stage_of(1, BootstrapStage::AgentStarted)));
        // The reader takes some: below the mark again.
        for _ in 0..10 {
            assert!(rx.try_recv().is_ok());
        }
        assert!(tx.send(stage_of(1, BootstrapStage::Joined)));
        fill(&tx, 100_000, 20);
        assert!(tx.send(stage_of(1, BootstrapStage::Converged)));
        assert_eq!(
            stages_of(&mut rx, 1),
            [
                BootstrapStage::AgentStarted,
                BootstrapStage::Joined,
                BootstrapStage::Converged
            ]
        );
    }

    #[test]
    fn a_reader_that_keeps_up_gets_every_stage_in_order() {
        let (tx, mut rx) = observation_queue();
        for attempt in 1..=3 {
            for stage in [
                BootstrapStage::Connected,
                BootstrapStage::Joined,
                BootstrapStage::Converged,
            ] {
                assert!(tx.send(stage_of(attempt, stage)));
            }
        }
        let got = drain(&mut rx);
        assert_eq!(got.len(), 9);
        assert_eq!(got[0], (1, BootstrapStage::Connected));
        assert_eq!(got[8], (3, BootstrapStage::Converged));
        assert_eq!(rx.coalesced(), 0);
    }

    /// Past [`COALESCE_PAST`] waiting, a session's later stages take the
    /// place of its waiting one: the queue grows by sessions, not stages, and
    /// each session's latest is still delivered, in the place of its first.
    #[test]
    fn a_backlog_holds_one_stage_a_session_and_the_latest() {
        let (tx, mut rx) = observation_queue();
        let sessions = COALESCE_PAST as u64 + 1000;
        // Every stage of a session that converges, in order.
        for stage in BootstrapStage::ALL.into_iter().filter(|s| !s.is_failure()) {
            for attempt in 1..=sessions {
                assert!(tx.send(stage_of(attempt, stage)));
            }
        }
        let got = drain(&mut rx);
        // The first COALESCE_PAST stages went in before the backlog began,
        // unindexed: their sessions' second stages queued once more, and every
        // later stage took the place of its session's waiting one.
        assert_eq!(got.len(), sessions as usize + COALESCE_PAST);
        let last = got
            .iter()
            .filter(|(_, s)| *s == BootstrapStage::Converged)
            .count();
        assert_eq!(last as u64, sessions, "every session's latest stage arrives");
        // Within a session, stages never go backwards.
        let mut seen: HashMap<u64, BootstrapStage> = HashMap::new();
        for (attempt, stage) in &got {
            if let Some(before) = seen.insert(*attempt, *stage) {
                let at = |s: &BootstrapStage| BootstrapStage::ALL.iter().position(|x| x == s);
                assert!(at(&before) < at(stage), "{attempt}: {before:?} then {stage:?}");
            }
        }
        assert!(rx.coalesced() > 0);
    }

    #[test]
    fn a_waiting_terminal_stage_is_not_superseded() {
        let (tx, mut rx) = observation_queue();
        for attempt in 1..=COALESCE_PAST as u64 {
            tx.send(stage_of(attempt, BootstrapStage::Connected));
        }
        tx.send(stage_of(9_999, BootstrapStage::FailedJoin));
        tx.send(stage_of(9_999, BootstrapStage::AgentStarted));
        tx.send(stage_of(9_999, BootstrapStage::Converged));
        assert_eq!(stages_of(&mut rx, 9_999), [BootstrapStage::Converged]);
        // A non-terminal stage after a waiting terminal one is dropped.
        for attempt in 1..=COALESCE_PAST as u64 {
            tx.send(stage_of(attempt, BootstrapStage::Connected));
        }
        tx.send(stage_of(9_998, BootstrapStage::FailedConnect));
        tx.send(stage_of(9_998, BootstrapStage::Connected));
        assert_eq!(stages_of(&mut rx, 9_998), [BootstrapStage::FailedConnect]);
    }

    #[tokio::test]
    async fn the_queue_ends_with_its_senders_and_refuses_without_its_receiver() {
        let (tx, mut rx) = observation_queue();
        let tx2 = tx.clone();
        tx.send(stage_of(1, BootstrapStage::Connected));
        drop(tx);
        let waiter = tokio::spawn(async move {
            let first = rx.recv().await.map(|o| o.stage);
            let second = rx.recv().await.map(|o| o.stage);
            let end = rx.recv().await;
            (first, second, end.is_none())
        });
        tokio::task::yield_now().await;
        assert!(tx2.send(stage_of(1, BootstrapStage::Joined)));
        drop(tx2);
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            got,
            (
                Some(BootstrapStage::Connected),
                Some(BootstrapStage::Joined),
                true
            )
        );

        let (tx, rx) = observation_queue();
        drop(rx);
        assert!(tx.is_closed());
        assert!(!tx.send(stage_of(1, BootstrapStage::Connected)));
    }
}
