//! What a provider reports outside its calls, sent to every open `Watch`
//! stream.
//!
//! The hub keeps the latest stage of each live session and the latest health
//! of each resource. A stream owes its reader, in order, each identity whose
//! stage or health changed since the reader last took it, and every loss: a
//! stream that opens owes the latest state of everything, and a stage
//! superseded before the reader took it is not sent at all (stages and health
//! are levels; the executor sequences what it is sent). So what a stream owes
//! is bounded by what the provider holds, however many changes happen while
//! its reader is slow, and a stream is never closed for holding more live
//! sessions than a buffer (a stream that closes at a buffer's size never
//! keeps up with a provider holding more, and every new stream starts the
//! snapshot again). Only a reader so stuck that the losses owed to it pass
//! the bound has its stream closed; the executor opens a new one.

use std::{
    collections::{HashMap, VecDeque},
    pin::Pin,
    sync::{Arc, Mutex, PoisonError},
};

use contract::{BootstrapStage, ResourceIdentity, SessionId, UnixMillis};
use futures::Stream;
use tokio::sync::Notify;

use crate::wire::{identity_to_wire, pb, stage_to_wire};

/// Items a stream may owe beyond twice what the hub holds before the
/// superseded ones are dropped from it.
const SLACK: usize = 16 * 1024;

/// Items a stream takes from the hub under one lock.
const BATCH: usize = 256;

/// A `Watch` stream's events.
pub(crate) type Watch = Pin<Box<dyn Stream<Item = pb::WatchEvent> + Send>>;

/// Where a provider reports stages, losses and health changes. Cheap to
/// clone; every clone reports to the same streams.
#[derive(Debug, Clone, Default)]
pub struct Events {
    hub: Arc<Mutex<Hub>>,
}

/// A value and the number of the change that set it.
#[derive(Debug)]
struct Latest<T> {
    value: T,
    change: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stage,
    Health,
}

/// One item a stream owes its reader.
#[derive(Debug, Clone)]
enum Owed {
    /// The identity's latest stage or health, unless a later change (owed
    /// further on) or its end superseded `change`.
    Latest(ResourceIdentity, Kind, u64),
    Lost(pb::Lost),
}

#[derive(Debug)]
struct Subscriber {
    owed: VecDeque<Owed>,
    wake: Arc<Notify>,
}

#[derive(Debug, Default)]
struct Hub {
    stages: HashMap<ResourceIdentity, Latest<pb::StageReached>>,
    health: HashMap<ResourceIdentity, Latest<pb::HealthChanged>>,
    streams: HashMap<u64, Subscriber>,
    next_stream: u64,
    changes: u64,
}

/// Whether `item` is still owed: a loss always, a latest value while it is
/// the current one.
fn current(
    stages: &HashMap<ResourceIdentity, Latest<pb::StageReached>>,
    health: &HashMap<ResourceIdentity, Latest<pb::HealthChanged>>,
    item: &Owed,
) -> bool {
    match item {
        Owed::Latest(identity, Kind::Stage, change) => {
            stages.get(identity).is_some_and(|l| l.change == *change)
        }
        Owed::Latest(identity, Kind::Health, change) => {
            health.get(identity).is_some_and(|l| l.change == *change)
        }
        Owed::Lost(_) => true,
    }
}

impl Hub {
    fn next_change(&mut self) -> u64 {
        self.changes += 1;
        self.changes
    }

    /// Every stream owes `item` too.
    fn owe(&mut self, item: Owed) {
        let Hub {
            stages,
            health,
            streams,
            ..
        } = self;
        let bound = 2 * (stages.len() + health.len()) + SLACK;
        streams.retain(|_, s| {
            s.owed.push_back(item.clone());
            if s.owed.len() > bound {
                s.owed.retain(|o| current(stages, health, o));
            }
            // Still over it after that: losses its reader has not taken.
            let keep = s.owed.len() <= bound;
            if !keep {
                tracing::warn!("a Watch stream's reader is stuck: closing it (the executor opens a new one)");
            }
            s.wake.notify_one();
            keep
        });
    }
}

/// One open stream's end of the hub. Dropping it (the stream ended)
/// unregisters it.
struct Subscription {
    hub: Arc<Mutex<Hub>>,
    id: u64,
    wake: Arc<Notify>,
    ready: VecDeque<pb::WatchEvent>,
}

enum Taken {
    Some,
    Nothing,
    Closed,
}

impl Subscription {
    /// Moves up to [`BATCH`] events the stream owes into `ready`.
    fn take(&mut self) -> Taken {
        let mut hub = lock(&self.hub);
        let Hub {
            stages,
            health,
            streams,
            ..
        } = &mut *hub;
        let Some(s) = streams.get_mut(&self.id) else {
            return Taken::Closed;
        };
        while self.ready.len() < BATCH {
            let Some(item) = s.owed.pop_front() else {
                break;
            };
            let event = match item {
                Owed::Latest(identity, Kind::Stage, change) => match stages.get(&identity) {
                    Some(l) if l.change == change => pb::watch_event::Event::Stage(l.value.clone()),
                    _ => continue,
                },
                Owed::Latest(identity, Kind::Health, change) => match health.get(&identity) {
                    Some(l) if l.change == change => pb::watch_event::Event::Health(l.value.clone()),
                    _ => continue,
                },
                Owed::Lost(lost) => pb::watch_event::Event::Lost(lost),
            };
            self.ready.push_back(pb::WatchEvent { event: Some(event) });
        }
        if self.ready.is_empty() {
            Taken::Nothing
        } else {
            Taken::Some
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        lock(&self.hub).streams.remove(&self.id);
    }
}

fn lock(hub: &Mutex<Hub>) -> std::sync::MutexGuard<'_, Hub> {
    // The hub's state is whole after every method: a panic elsewhere while
    // it was held leaves nothing half-done to fear.
    hub.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Events {
    fn hub(&self) -> std::sync::MutexGuard<'_, Hub> {
        lock(&self.hub)
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
        let value = pb::StageReached {
            identity: Some(identity_to_wire(identity)),
            session_id: session.as_str().to_owned(),
            stage: stage_to_wire(stage).into(),
            detail: detail.into(),
            at_unix_ms: at.as_millis(),
        };
        let mut hub = self.hub();
        let change = hub.next_change();
        hub.stages.insert(identity.clone(), Latest { value, change });
        hub.owe(Owed::Latest(identity.clone(), Kind::Stage, change));
    }

    /// The resource is gone without a destroy (never for one destroyed on
    /// request).
    pub fn lost(&self, identity: &ResourceIdentity, reason: impl Into<String>, at: UnixMillis) {
        let mut hub = self.hub();
        hub.stages.remove(identity);
        hub.health.remove(identity);
        hub.owe(Owed::Lost(pb::Lost {
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
        let value = pb::HealthChanged {
            identity: Some(identity_to_wire(identity)),
            healthy,
            detail: detail.into(),
            at_unix_ms: at.as_millis(),
        };
        let mut hub = self.hub();
        let change = hub.next_change();
        hub.health.insert(identity.clone(), Latest { value, change });
        hub.owe(Owed::Latest(identity.clone(), Kind::Health, change));
    }

    /// The identity's session ended on request: its stages are no longer
    /// sent (a stage owed and not yet taken is dropped too).
    pub(crate) fn session_ended(&self, identity: &ResourceIdentity) {
        self.hub().stages.remove(identity);
    }

    /// The identity's resource was destroyed on request.
    pub(crate) fn destroyed(&self, identity: &ResourceIdentity) {
        let mut hub = self.hub();
        hub.stages.remove(identity);
        hub.health.remove(identity);
    }

    /// A new stream: it owes the latest stage of every live session and
    /// every resource's health first, then each change as it comes.
    pub(crate) fn subscribe(&self) -> Watch {
        let wake = Arc::new(Notify::new());
        let id = {
            let mut hub = self.hub();
            let id = hub.next_stream;
            hub.next_stream += 1;
            let mut owed = VecDeque::with_capacity(hub.stages.len() + hub.health.len());
            owed.extend(
                hub.stages
                    .iter()
                    .map(|(identity, l)| Owed::Latest(identity.clone(), Kind::Stage, l.change)),
            );
            owed.extend(
                hub.health
                    .iter()
                    .map(|(identity, l)| Owed::Latest(identity.clone(), Kind::Health, l.change)),
            );
            hub.streams.insert(
                id,
                Subscriber {
                    owed,
                    wake: Arc::clone(&wake),
                },
            );
            id
        };
        let subscription = Subscription {
            hub: Arc::clone(&self.hub),
            id,
            wake,
            ready: VecDeque::new(),
        };
        Box::pin(futures::stream::unfold(subscription, |mut sub| async move {
            loop {
                if let Some(event) = sub.ready.pop_front() {
                    return Some((event, sub));
                }
                match sub.take() {
                    Taken::Some => {}
                    Taken::Closed => return None,
                    // A change between the take and this wait left a permit:
                    // no wake-up is lost.
                    Taken::Nothing => {
                        let wake = Arc::clone(&sub.wake);
                        wake.notified().await;
                    }
                }
            }
        }))
    }

    /// How many items the stream `id` owes (tests).
    #[cfg(test)]
    fn owed(&self, id: u64) -> Option<usize> {
        self.hub().streams.get(&id).map(|s| s.owed.len())
    }
}

#[cfg(test)]
mod tests {
    use futures::{FutureExt as _, StreamExt as _};

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

    fn stage_of(e: &pb::WatchEvent) -> (u64, i32) {
        match &e.event {
            Some(pb::watch_event::Event::Stage(s)) => (s.identity.as_ref().unwrap().attempt, s.stage),
            other => panic!("expected a stage, got {other:?}"),
        }
    }

    /// The next event if one is ready now.
    fn ready(rx: &mut Watch) -> Option<pb::WatchEvent> {
        rx.next().now_or_never().flatten()
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
        let first = rx.next().await.unwrap();
        assert_eq!(stage_of(&first).1, pb::Stage::Converged as i32);
        assert_eq!(kind(&rx.next().await.unwrap()), "health");
        events.lost(&identity(1), "gone", UnixMillis::new(4));
        assert_eq!(kind(&rx.next().await.unwrap()), "lost");
        // A lost resource's stage is not sent to the next stream.
        let mut later = events.subscribe();
        assert!(ready(&mut later).is_none());
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
        assert!(ready(&mut rx).is_none());
    }

    #[tokio::test]
    async fn a_closed_stream_is_dropped() {
        let events = Events::default();
        drop(events.subscribe());
        events.health(&identity(3), false, "probe failed", UnixMillis::new(1));
        assert!(events.hub().streams.is_empty());
    }

    /// More live sessions than a stream ever buffered: the stream that opens
    /// sends every one of them and stays open for the changes after (a
    /// stream that ended at its buffer's size was opened again and again,
    /// and no later stage of most sessions ever reached the executor).
    #[tokio::test]
    async fn a_stream_opened_on_more_sessions_than_a_buffer_sends_them_all_and_stays_open() {
        let events = Events::default();
        let session = SessionId::new("s", "s1").unwrap();
        let held = 3 * SLACK as u64;
        for attempt in 1..=held {
            events.stage(
                &identity(attempt),
                &session,
                BootstrapStage::Converged,
                "",
                UnixMillis::new(1),
            );
        }
        let mut rx = events.subscribe();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..held {
            seen.insert(stage_of(&rx.next().await.unwrap()).0);
        }
        assert_eq!(seen.len() as u64, held);
        assert!(ready(&mut rx).is_none());
        events.stage(
            &identity(held + 1),
            &session,
            BootstrapStage::Connected,
            "",
            UnixMillis::new(2),
        );
        assert_eq!(stage_of(&rx.next().await.unwrap()).0, held + 1);
    }

    /// A reader that does not read is owed each identity's latest state,
    /// not every change: what a stream holds is bounded by what the hub
    /// holds, and the stream stays open.
    #[tokio::test]
    async fn a_slow_reader_is_owed_the_latest_of_each_and_no_more() {
        let events = Events::default();
        let session = SessionId::new("s", "s1").unwrap();
        let mut rx = events.subscribe();
        let stages = [
            BootstrapStage::Connected,
            BootstrapStage::BootCheck,
            BootstrapStage::AgentStarted,
            BootstrapStage::Joined,
        ];
        for round in 0..(SLACK as u64) {
            for attempt in 1..=4 {
                events.stage(
                    &identity(attempt),
                    &session,
                    stages[(round % 4) as usize],
                    "",
                    UnixMillis::new(round),
                );
            }
            assert!(events.owed(0).unwrap() <= 2 * 4 + SLACK);
        }
        events.stage(
            &identity(2),
            &session,
            BootstrapStage::Converged,
            "",
            UnixMillis::new(u64::MAX / 2),
        );
        let mut got = Vec::new();
        while let Some(e) = ready(&mut rx) {
            got.push(stage_of(&e));
        }
        let last = stage_to_wire(stages[(SLACK - 1) % 4]) as i32;
        assert_eq!(
            got,
            [(1, last), (3, last), (4, last), (2, pb::Stage::Converged as i32)]
        );
    }

    /// A reader that takes nothing while losses pile up past the bound has
    /// its stream closed; a new stream works.
    #[tokio::test]
    async fn a_stuck_reader_owed_too_many_losses_is_closed() {
        let events = Events::default();
        let mut rx = events.subscribe();
        for attempt in 0..=(SLACK as u64) {
            events.lost(&identity(attempt), "gone", UnixMillis::new(1));
        }
        assert!(events.owed(0).is_none());
        assert!(rx.next().await.is_none());
        let mut again = events.subscribe();
        events.lost(&identity(1), "gone", UnixMillis::new(2));
        assert_eq!(kind(&again.next().await.unwrap()), "lost");
    }
}
