//! What a provider reports outside its calls, sent to every open `Watch`
//! stream.
//!
//! The hub keeps the latest stage of each live session and the latest health
//! of each resource, and sends them first to a stream that opens: a stage
//! reached while the executor had no stream open (it restarted, the link
//! broke) reaches it when it opens the next. A stream that falls too far
//! behind is closed; the executor opens a new one and starts from the
//! latest state again, so nothing a slow reader missed is lost for good.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
};

use contract::{BootstrapStage, ResourceIdentity, SessionId, UnixMillis};
use tokio::sync::mpsc;

use crate::wire::{identity_to_wire, pb, stage_to_wire};

/// Events a stream may have queued before it counts as stuck and is closed.
const STREAM_BUFFER: usize = 16 * 1024;

/// Where a provider reports stages, losses and health changes. Cheap to
/// clone; every clone reports to the same streams.
#[derive(Debug, Clone, Default)]
pub struct Events {
    hub: Arc<Mutex<Hub>>,
}

#[derive(Debug, Default)]
struct Hub {
    stages: HashMap<ResourceIdentity, pb::StageReached>,
    health: HashMap<ResourceIdentity, pb::HealthChanged>,
    streams: Vec<mpsc::Sender<pb::WatchEvent>>,
}

impl Hub {
    fn send(&mut self, event: pb::watch_event::Event) {
        let event = pb::WatchEvent { event: Some(event) };
        self.streams.retain(|tx| match tx.try_send(event.clone()) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!("a Watch stream fell behind: closing it (the executor opens a new one)");
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        });
    }
}

impl Events {
    fn hub(&self) -> std::sync::MutexGuard<'_, Hub> {
        // The hub's state is whole after every method: a panic elsewhere
        // while it was held leaves nothing half-done to fear.
        self.hub.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A session reached `stage`.
    pub fn stage(
        &self,
        identity: &ResourceIdentity,
        session: &SessionId,
        stage: BootstrapStage,
        detail: impl Into<String>,
        at: UnixMillis,
    ) {
        let reached = pb::StageReached {
            identity: Some(identity_to_wire(identity)),
            session_id: session.as_str().to_owned(),
            stage: stage_to_wire(stage).into(),
            detail: detail.into(),
            at_unix_ms: at.as_millis(),
        };
        let mut hub = self.hub();
        hub.stages.insert(identity.clone(), reached.clone());
        hub.send(pb::watch_event::Event::Stage(reached));
    }

    /// The resource is gone without a destroy (never for one destroyed on
    /// request).
    pub fn lost(&self, identity: &ResourceIdentity, reason: impl Into<String>, at: UnixMillis) {
        let mut hub = self.hub();
        hub.stages.remove(identity);
        hub.health.remove(identity);
        hub.send(pb::watch_event::Event::Lost(pb::Lost {
            identity: Some(identity_to_wire(identity)),
            reason: reason.into(),
            at_unix_ms: at.as_millis(),
        }));
    }

    /// The resource's health (on a change, or when first known).
    pub fn health(
        &self,
        identity: &ResourceIdentity,
        healthy: bool,
        detail: impl Into<String>,
        at: UnixMillis,
    ) {
        let changed = pb::HealthChanged {
            identity: Some(identity_to_wire(identity)),
            healthy,
            detail: detail.into(),
            at_unix_ms: at.as_millis(),
        };
        let mut hub = self.hub();
        hub.health.insert(identity.clone(), changed.clone());
        hub.send(pb::watch_event::Event::Health(changed));
    }

    /// The identity's session ended on request: its stages are no longer
    /// sent to new streams.
    pub(crate) fn session_ended(&self, identity: &ResourceIdentity) {
        self.hub().stages.remove(identity);
    }

    /// The identity's resource was destroyed on request.
    pub(crate) fn destroyed(&self, identity: &ResourceIdentity) {
        let mut hub = self.hub();
        hub.stages.remove(identity);
        hub.health.remove(identity);
    }

    /// A new stream: the latest stage of every live session and every
    /// resource's health are queued first.
    pub(crate) fn subscribe(&self) -> mpsc::Receiver<pb::WatchEvent> {
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let mut hub = self.hub();
        let snapshot = hub
            .stages
            .values()
            .cloned()
            .map(pb::watch_event::Event::Stage)
            .chain(hub.health.values().cloned().map(pb::watch_event::Event::Health));
        for event in snapshot {
            if tx.try_send(pb::WatchEvent { event: Some(event) }).is_err() {
                // More live sessions than a stream buffers: the stream ends
                // and the executor opens another, as with a slow reader.
                return rx;
            }
        }
        hub.streams.push(tx);
        rx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use contract::{AttemptId, RunId, RunUid};

    fn identity(attempt: u64) -> ResourceIdentity {
        ResourceIdentity {
            run_uid: RunUid::from_u128(1),
            run_id: RunId::parse("run", "r").unwrap(),
            node: "w-0".parse().unwrap(),
            attempt: AttemptId::new(attempt),
        }
    }

    fn kind(e: &pb::WatchEvent) -> &'static str {
        match &e.event {
            Some(pb::watch_event::Event::Stage(_)) => "stage",
            Some(pb::watch_event::Event::Lost(_)) => "lost",
            Some(pb::watch_event::Event::Health(_)) => "health",
            None => "none",
        }
    }

    #[tokio::test]
    async fn a_stream_that_opens_late_gets_the_latest_stage_and_health_first() {
        let events = Events::default();
        let session = SessionId::new("s", "s1").unwrap();
        events.stage(
            &identity(1),
            &session,
            BootstrapStage::Joined,
            "",
            UnixMillis::new(1),
        );
        events.stage(
            &identity(1),
            &session,
            BootstrapStage::Converged,
            "",
            UnixMillis::new(2),
        );
        events.health(&identity(1), true, "", UnixMillis::new(3));
        let mut rx = events.subscribe();
        let first = rx.recv().await.unwrap();
        match first.event {
            Some(pb::watch_event::Event::Stage(s)) => assert_eq!(s.stage, pb::Stage::Converged as i32),
            other => panic!("expected the latest stage, got {other:?}"),
        }
        assert_eq!(kind(&rx.recv().await.unwrap()), "health");
        events.lost(&identity(1), "gone", UnixMillis::new(4));
        assert_eq!(kind(&rx.recv().await.unwrap()), "lost");
        // A lost resource's stage is not sent to the next stream.
        let mut later = events.subscribe();
        assert!(later.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_destroyed_resource_is_not_replayed() {
        let events = Events::default();
        let session = SessionId::new("s", "s1").unwrap();
        events.stage(
            &identity(2),
            &session,
            BootstrapStage::Converged,
            "",
            UnixMillis::new(1),
        );
        events.destroyed(&identity(2));
        let mut rx = events.subscribe();
        assert!(rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_closed_stream_is_dropped() {
        let events = Events::default();
        drop(events.subscribe());
        events.health(&identity(3), false, "probe failed", UnixMillis::new(1));
        assert!(events.hub().streams.is_empty());
    }
}
