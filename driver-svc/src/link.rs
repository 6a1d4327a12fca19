//! The driver's end of the executor link: one long-lived bidirectional stream
//! per driver, reconnected with backoff when it breaks.
//!
//! Run actors send through [`Link::send`]; what the executor sends is routed to
//! the actor of the run it names. Each (re)connection gets a new generation
//! number and every actor is told (`LinkUp`), so it claims its epoch, resubmits
//! its pending operations and asks for the observations after the last sequence
//! it folded. A message sent while the link is down is dropped: pending
//! operations stay recorded and are resubmitted on the next `LinkUp`.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, RwLock},
    time::Duration,
};

use contract::{
    Epoch, Observation, OperationResult, Rejection, ResourceChange, RunUid, ServedProvider, SessionId,
    TraceContext, pb,
    pb::{driver_message, executor_client::ExecutorClient, executor_message::Kind},
};
use platform::tls::PeerEndpoint;
use tokio::sync::mpsc;
use tokio_stream::{StreamExt, wrappers::UnboundedReceiverStream};

use crate::core::{AckRef, ToExecutor};

/// A message from the executor for one run.
#[derive(Debug, Clone)]
pub enum FromExecutor {
    Claimed(contract::Epoch),
    Result(OperationResult),
    Observation(Observation),
    Rejection(Rejection),
    /// A resource the run holds changed (it is lost).
    Change(ResourceChange),
    /// The operation waits for a budget at the executor, or has started.
    Waiting(contract::wire::Waiting),
}

type Outbound = mpsc::UnboundedSender<pb::DriverMessage>;

/// What the link tells a run: its stream came up (with its generation) or
/// went down, or the executor sent it something.
#[derive(Debug, Clone)]
pub enum LinkEvent {
    Up(u64),
    Down,
    Message(FromExecutor),
    /// The executor said again what it serves (a plugin went down or came
    /// back): statuses that name providers are due again.
    Providers,
}

/// Where a run's link events go (its actor's queue); `false` once it is gone.
type Route = Box<dyn Fn(LinkEvent) -> bool + Send + Sync>;

/// How long opening the link stream may take before the driver reconnects.
const LINK_OPEN_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Inner {
    current: Mutex<Option<(u64, Outbound)>>,
    routes: RwLock<HashMap<RunUid, Route>>,
    counters: Mutex<LinkCounters>,
    /// Why the last connection attempt failed, if it did.
    last_error: Mutex<Option<String>>,
    /// What the executor last said it serves; `None` until it has said.
    /// Kept across a broken link: the next link says it again first.
    providers: RwLock<Option<Arc<[ServedProvider]>>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("current", &self.current)
            .field("counters", &self.counters)
            .field("last_error", &self.last_error)
            .field("providers", &self.providers)
            .finish_non_exhaustive()
    }
}

/// Link health counters, for metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LinkCounters {
    pub connects: u64,
    pub disconnects: u64,
    pub sent: u64,
    pub dropped: u64,
    pub received: u64,
    pub undecodable: u64,
    pub unrouted: u64,
}

/// A cheap handle to the link.
#[derive(Debug, Clone, Default)]
pub struct Link {
    inner: Arc<Inner>,
}

impl Link {
    pub fn new() -> Self {
        Self::default()
    }

    /// The generation of the stream that is up, if one is.
    pub fn generation(&self) -> Option<u64> {
        self.inner
            .current
            .lock()
            .ok()
            .and_then(|c| c.as_ref().map(|(g, _)| *g))
    }

    /// Sends on the current stream if it is `generation` (so a message meant
    /// for a stream that has since been replaced is not sent on the new one
    /// before its claim). Returns whether it was sent.
    pub fn send(&self, generation: u64, msg: pb::DriverMessage) -> bool {
        let sent = self.inner.current.lock().ok().is_some_and(|c| match c.as_ref() {
            Some((g, tx)) if *g == generation => tx.send(msg).is_ok(),
            _ => false,
        });
        if let Ok(mut c) = self.inner.counters.lock() {
            if sent {
                c.sent += 1;
            } else {
                c.dropped += 1;
            }
        }
        sent
    }

    /// The providers the executor serves, as it last said (`None`: it has
    /// not said since this driver started).
    pub fn providers(&self) -> Option<Arc<[ServedProvider]>> {
        self.inner.providers.read().ok().and_then(|p| p.clone())
    }

    /// Records what the executor serves and tells every run, when it changed.
    fn set_providers(&self, served: Vec<ServedProvider>) {
        let changed = self.inner.providers.write().is_ok_and(|mut p| {
            if p.as_deref() == Some(served.as_slice()) {
                return false;
            }
            tracing::info!(
                providers = %served
                    .iter()
                    .map(|s| if s.available { s.name.clone() } else { format!("{} (unavailable)", s.name) })
                    .collect::<Vec<_>>()
                    .join(", "),
                "the executor serves"
            );
            *p = Some(served.into());
            true
        });
        if changed {
            self.broadcast(|| LinkEvent::Providers);
        }
    }

    pub fn counters(&self) -> LinkCounters {
        self.inner.counters.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Routes the run's link events to `route` (its actor); tells it at
    /// once if the link is up.
    pub fn register(&self, uid: RunUid, route: impl Fn(LinkEvent) -> bool + Send + Sync + 'static) {
        if let Some(g) = self.generation() {
            route(LinkEvent::Up(g));
        }
        if let Ok(mut r) = self.inner.routes.write() {
            r.insert(uid, Box::new(route));
        }
    }

    pub fn unregister(&self, uid: RunUid) {
        if let Ok(mut r) = self.inner.routes.write() {
            r.remove(&uid);
        }
    }

    fn broadcast(&self, ev: impl Fn() -> LinkEvent) {
        if let Ok(r) = self.inner.routes.read() {
            for route in r.values() {
                route(ev());
            }
        }
    }

    fn route(&self, uid: RunUid, msg: FromExecutor) {
        let routed = self
            .inner
            .routes
            .read()
            .ok()
            .and_then(|r| r.get(&uid).map(|route| route(LinkEvent::Message(msg))))
            .unwrap_or(false);
        if !routed && let Ok(mut c) = self.inner.counters.lock() {
            c.unrouted += 1;
        }
    }

    fn count(&self, f: impl FnOnce(&mut LinkCounters)) {
        if let Ok(mut c) = self.inner.counters.lock() {
            f(&mut c);
        }
    }

    /// Keeps the stream up until `shutdown` resolves.
    pub async fn run(self, endpoint: PeerEndpoint, shutdown: impl std::future::Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut generation = 0u64;
        let mut delay = Duration::from_millis(100);
        loop {
            generation += 1;
            let attempt = self.connect_once(endpoint.clone(), generation);
            tokio::select! {
                () = &mut shutdown => break,
                connected = attempt => {
                    if connected {
                        delay = Duration::from_millis(100);
                    }
                }
            }
            if let Ok(mut c) = self.inner.current.lock() {
                *c = None;
            }
            self.broadcast(|| LinkEvent::Down);
            tokio::select! {
                () = &mut shutdown => break,
                () = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
        if let Ok(mut c) = self.inner.current.lock() {
            *c = None;
        }
    }

    /// One stream's life. Returns whether it connected at all.
    async fn connect_once(&self, endpoint: PeerEndpoint, generation: u64) -> bool {
        let channel = match endpoint.connect().await {
            Ok(c) => c,
            Err(e) => {
                // The whole chain: a refused TLS handshake says why (for
                // example a server that is not the executor) only deep down.
                let mut why = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(s) = source {
                    why = format!("{why}: {s}");
                    source = s.source();
                }
                // Loud once per reason, quiet while it stays the same.
                let repeated = self
                    .inner
                    .last_error
                    .lock()
                    .map(|mut last| last.replace(why.clone()).as_deref() == Some(why.as_str()))
                    .unwrap_or(false);
                if repeated {
                    tracing::debug!(error = %why, "executor not reachable");
                } else {
                    tracing::warn!(error = %why, "executor not reachable");
                }
                return false;
            }
        };
        if let Ok(mut last) = self.inner.last_error.lock() {
            *last = None;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        // Through the tracing layer: the link call has a client span (one per
        // connection); the operations on it carry their own trace contexts.
        let mut client = ExecutorClient::new(platform::telemetry::grpc::traced(
            channel,
            endpoint.target().clone(),
        ))
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
        // Install the sender before the call: the request stream must carry the
        // claims that actors send once they hear `LinkUp`.
        if let Ok(mut c) = self.inner.current.lock() {
            *c = Some((generation, tx));
        }
        // An executor that accepted the connection but never answers the call
        // (its actor stalled) must not hold the link down for good: give up
        // and reconnect.
        let response =
            tokio::time::timeout(LINK_OPEN_TIMEOUT, client.link(UnboundedReceiverStream::new(rx))).await;
        let mut inbound = match response {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) => {
                tracing::warn!(%status, "executor refused the link");
                return false;
            }
            Err(_) => {
                tracing::warn!(timeout = ?LINK_OPEN_TIMEOUT, "executor did not answer the link; reconnecting");
                return false;
            }
        };
        self.count(|c| c.connects += 1);
        tracing::info!(generation, "executor link up");
        self.broadcast(|| LinkEvent::Up(generation));
        while let Some(item) = inbound.next().await {
            match item {
                Ok(msg) => self.dispatch(msg),
                Err(status) => {
                    tracing::warn!(%status, "executor link broke");
                    break;
                }
            }
        }
        self.count(|c| c.disconnects += 1);
        tracing::info!(generation, "executor link down");
        true
    }

    fn dispatch(&self, msg: pb::ExecutorMessage) {
        self.count(|c| c.received += 1);
        let decoded = match msg.kind {
            Some(Kind::Claimed(c)) => RunUid::parse("run_uid", &c.run_uid)
                .map(|uid| (uid, FromExecutor::Claimed(contract::Epoch::new(c.epoch)))),
            Some(Kind::Result(r)) => {
                OperationResult::try_from(r).map(|r| (r.run_uid, FromExecutor::Result(r)))
            }
            Some(Kind::Observation(o)) => {
                Observation::try_from(o).map(|o| (o.run_uid, FromExecutor::Observation(o)))
            }
            Some(Kind::Rejection(r)) => {
                Rejection::try_from(r).map(|r| (r.run_uid, FromExecutor::Rejection(r)))
            }
            Some(Kind::Change(c)) => {
                ResourceChange::try_from(c).map(|c| (c.run_uid, FromExecutor::Change(c)))
            }
            Some(Kind::Waiting(w)) => {
                contract::wire::Waiting::try_from(w).map(|w| (w.run_uid, FromExecutor::Waiting(w)))
            }
            Some(Kind::Providers(p)) => {
                match p
                    .providers
                    .into_iter()
                    .enumerate()
                    .map(|(i, p)| {
                        ServedProvider::try_from(p).map_err(|e| e.within(&format!("providers[{i}]")))
                    })
                    .collect::<Result<Vec<_>, _>>()
                {
                    Ok(served) => self.set_providers(served),
                    Err(e) => {
                        self.count(|c| c.undecodable += 1);
                        tracing::warn!(error = %e, "undecodable provider list from the executor");
                    }
                }
                return;
            }
            None => return,
        };
        match decoded {
            Ok((uid, m)) => self.route(uid, m),
            Err(e) => {
                self.count(|c| c.undecodable += 1);
                tracing::warn!(error = %e, "undecodable message from the executor");
            }
        }
    }
}

/// What the run's link session emitted, as the message that carries it;
/// `trace` goes in the message (and, for a submission, in the operation).
pub fn encode(uid: RunUid, m: ToExecutor, trace: &TraceContext) -> pb::DriverMessage {
    let observation = |session: SessionId, seq: u64| pb::ObservationRef {
        run_uid: uid.to_string(),
        session_id: session.to_string(),
        seq,
    };
    let kind = match m {
        ToExecutor::Claim(claim) => driver_message::Kind::Claim(pb::Claim {
            run_uid: claim.run_uid.to_string(),
            run_id: claim.run_id.to_string(),
            epoch: claim.epoch.get(),
        }),
        ToExecutor::Submit { op, .. } => {
            let mut wire = pb::Operation::from(&op);
            wire.trace = contract::wire::trace_to_wire(trace);
            driver_message::Kind::Submit(wire)
        }
        ToExecutor::ObserveFrom(after) => driver_message::Kind::ObserveFrom(pb::ObserveFrom {
            run_uid: uid.to_string(),
            after: after.into_iter().map(|(s, seq)| observation(s, seq)).collect(),
        }),
        ToExecutor::Watch(w) => driver_message::Kind::Watch(pb::WatchHealth::from(&w)),
        ToExecutor::Ack(acks) => {
            let mut ack = pb::Ack::default();
            for a in acks {
                match a {
                    AckRef::Result(id) => ack.results.push(pb::ResultRef {
                        run_uid: uid.to_string(),
                        id: Some(id.into()),
                    }),
                    AckRef::Observation { session, seq } => ack.observations.push(observation(session, seq)),
                    AckRef::Change { seq } => ack.changes.push(pb::ChangeRef {
                        run_uid: uid.to_string(),
                        seq,
                    }),
                }
            }
            driver_message::Kind::Ack(ack)
        }
    };
    pb::DriverMessage {
        kind: Some(kind),
        trace: contract::wire::trace_to_wire(trace),
    }
}

/// The message that tells the executor a deleted run's epoch is done with.
pub fn forget(uid: RunUid, epoch: Epoch) -> pb::DriverMessage {
    pb::DriverMessage {
        kind: Some(driver_message::Kind::Forget(pb::ForgetRun {
            run_uid: uid.to_string(),
            epoch: epoch.get(),
        })),
        trace: contract::wire::trace_to_wire(&TraceContext::default()),
    }
}
