//! Health probing of the resources the executor holds (SPEC.md section 8).
//!
//! [`HealthWatch`] is the schedule, free of I/O: which resources to probe
//! (those with an endpoint whose run's driver asked for a probe of their
//! group), when each is next due, and what each probe result changes. It
//! reports a node's first answered probe and every change between healthy and
//! unhealthy, never a repeat, so an idle healthy run sends nothing. A failed
//! probe within the group's `startup_grace` of the node's first sighting does
//! not count. [`run`] drives it: it refreshes the targets from the backend's
//! inventory, runs the due probes (at most [`MAX_CONCURRENT_PROBES`] at once)
//! through [`Backend::probe`], and sends the changes to the core's change sink,
//! which sequences them and keeps them until the driver acknowledges them.

use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
    time::Duration,
};

use contract::{
    Change, Clock, Endpoint, Epoch, GroupId, HealthPolicy, Probe, ResourceIdentity, RunUid, UnixMillis,
    WatchHealth,
};
use futures::FutureExt as _;
use tokio::{sync::mpsc, task::JoinSet};

use crate::backend::{Backend, ChangeSink, InventoryItem, RawChange};

/// Probes in flight at once, so that a slow network never makes the executor
/// hold a socket per node.
pub const MAX_CONCURRENT_PROBES: usize = 512;

#[derive(Debug, Clone)]
struct Target {
    endpoint: Endpoint,
    policy: HealthPolicy,
    first_seen: UnixMillis,
    next_at: UnixMillis,
    /// The last state reported; `None` before the first counted probe.
    reported: Option<bool>,
    in_flight: bool,
}

/// A probe to run now.
#[derive(Debug, Clone, PartialEq)]
pub struct DueProbe {
    pub identity: ResourceIdentity,
    pub endpoint: Endpoint,
    pub timeout: Duration,
}

/// The probe schedule. See the module documentation.
#[derive(Debug, Default)]
pub struct HealthWatch {
    policies: HashMap<RunUid, (Epoch, HashMap<GroupId, HealthPolicy>)>,
    targets: HashMap<ResourceIdentity, Target>,
    /// `(next_at, identity)` of every target not in flight.
    queue: BTreeSet<(UnixMillis, ResourceIdentity)>,
}

impl HealthWatch {
    pub fn new() -> Self {
        Self::default()
    }

    /// A run's policies, replacing the earlier ones. One from an epoch below
    /// the latest seen for the run is ignored (returns `false`).
    pub fn set_policy(&mut self, w: WatchHealth) -> bool {
        if let Some((epoch, _)) = self.policies.get(&w.run_uid)
            && w.epoch < *epoch
        {
            return false;
        }
        let groups: HashMap<GroupId, HealthPolicy> = w
            .groups
            .into_iter()
            .filter(|(_, p)| p.probe != Probe::None)
            .collect();
        // Targets whose group lost its probe go; the others take the new
        // policy from their next probe on.
        let gone: Vec<ResourceIdentity> = self
            .targets
            .iter_mut()
            .filter(|(id, _)| id.run_uid == w.run_uid)
            .filter_map(|(id, t)| match groups.get(id.node.group()) {
                Some(p) => {
                    t.policy = *p;
                    None
                }
                None => Some(id.clone()),
            })
            .collect();
        for id in gone {
            self.remove(&id);
        }
        self.policies.insert(w.run_uid, (w.epoch, groups));
        true
    }

    /// The run is forgotten: nothing of it is probed again.
    pub fn forget_run(&mut self, run_uid: RunUid) {
        self.policies.remove(&run_uid);
        let gone: Vec<_> = self
            .targets
            .keys()
            .filter(|id| id.run_uid == run_uid)
            .cloned()
            .collect();
        for id in gone {
            self.remove(&id);
        }
    }

    /// Brings the targets in line with the backend's inventory: every live
    /// resource with an endpoint whose group has a probe, and nothing else.
    pub fn sync(&mut self, inventory: &[InventoryItem], now: UnixMillis) {
        let mut live = std::collections::HashSet::with_capacity(inventory.len());
        for item in inventory {
            let Some(endpoint) = &item.endpoint else { continue };
            let Some(policy) = self
                .policies
                .get(&item.identity.run_uid)
                .and_then(|(_, groups)| groups.get(item.identity.node.group()))
            else {
                continue;
            };
            live.insert(&item.identity);
            match self.targets.get_mut(&item.identity) {
                Some(t) => t.endpoint = endpoint.clone(),
                None => {
                    self.targets.insert(
                        item.identity.clone(),
                        Target {
                            endpoint: endpoint.clone(),
                            policy: *policy,
                            first_seen: now,
                            next_at: now,
                            reported: None,
                            in_flight: false,
                        },
                    );
                    self.queue.insert((now, item.identity.clone()));
                }
            }
        }
        let gone: Vec<_> = self
            .targets
            .keys()
            .filter(|id| !live.contains(id))
            .cloned()
            .collect();
        for id in gone {
            self.remove(&id);
        }
    }

    fn remove(&mut self, id: &ResourceIdentity) {
        if let Some(t) = self.targets.remove(id)
            && !t.in_flight
        {
            self.queue.remove(&(t.next_at, id.clone()));
        }
    }

    /// When the next probe is due, if any target waits.
    pub fn next_due(&self) -> Option<UnixMillis> {
        self.queue.first().map(|(t, _)| *t)
    }

    pub fn len(&self) -> usize {
        self.targets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Up to `limit` probes due at `now`, each marked in flight until its
    /// [`HealthWatch::record`].
    pub fn take_due(&mut self, now: UnixMillis, limit: usize) -> Vec<DueProbe> {
        let mut out = Vec::new();
        while out.len() < limit {
            let Some((at, id)) = self.queue.first().cloned() else {
                break;
            };
            if at > now {
                break;
            }
            self.queue.remove(&(at, id.clone()));
            if let Some(t) = self.targets.get_mut(&id) {
                t.in_flight = true;
                out.push(DueProbe {
                    identity: id,
                    endpoint: t.endpoint.clone(),
                    timeout: Duration::from_millis(t.policy.timeout_ms),
                });
            }
        }
        out
    }

    /// A probe's result: schedules the next probe, and returns the change to
    /// report, if the node's state changed (or this is its first counted
    /// probe).
    pub fn record(
        &mut self,
        id: &ResourceIdentity,
        result: Result<(), String>,
        now: UnixMillis,
    ) -> Option<RawChange> {
        let t = self.targets.get_mut(id)?;
        t.in_flight = false;
        t.next_at = now
            .checked_add(Duration::from_millis(t.policy.interval_ms))
            .unwrap_or(UnixMillis::MAX);
        self.queue.insert((t.next_at, id.clone()));
        let healthy = result.is_ok();
        let in_grace = now
            .saturating_since(t.first_seen)
            .lt(&Duration::from_millis(t.policy.startup_grace_ms));
        if !healthy && in_grace && t.reported.is_none() {
            return None;
        }
        if t.reported == Some(healthy) {
            return None;
        }
        t.reported = Some(healthy);
        let detail = match result {
            Ok(()) => "probe answered".to_owned(),
            Err(why) => why,
        };
        Some(RawChange {
            identity: id.clone(),
            change: Change::Health { healthy, detail },
            at: now,
        })
    }
}

/// What the executor's actor tells the prober.
#[derive(Debug)]
pub enum Command {
    Policy(WatchHealth),
    Forget(RunUid),
}

/// How often the targets are refreshed from the inventory (a resource made or
/// destroyed is probed, or no longer, within this).
pub const TARGET_REFRESH: Duration = Duration::from_secs(1);

/// Drives a [`HealthWatch`] until `commands` closes or the sink stops
/// listening.
pub async fn run(
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    sink: ChangeSink,
) {
    let mut watch = HealthWatch::new();
    let mut probes: JoinSet<(ResourceIdentity, Result<(), String>)> = JoinSet::new();
    let mut refresh = tokio::time::interval(TARGET_REFRESH);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let now = clock.now();
        let sleep = watch
            .next_due()
            .map_or(TARGET_REFRESH, |t| t.saturating_since(now).min(TARGET_REFRESH));
        tokio::select! {
            cmd = commands.recv() => match cmd {
                None => return,
                Some(Command::Policy(w)) => {
                    let any = !w.groups.is_empty();
                    watch.set_policy(w);
                    if any {
                        refresh.reset_immediately();
                    }
                }
                Some(Command::Forget(uid)) => watch.forget_run(uid),
            },
            _ = refresh.tick() => {
                // Nothing to probe: no need to read the inventory at all.
                if !watch.policies.is_empty() {
                    match backend.inventory().await {
                        Ok(items) => watch.sync(&items, clock.now()),
                        Err(e) => tracing::debug!(error = %e, "health: inventory unavailable"),
                    }
                }
            }
            Some(done) = probes.join_next(), if !probes.is_empty() => {
                if let Ok((id, result)) = done
                    && let Some(change) = watch.record(&id, result, clock.now())
                    && !sink.send(change)
                {
                    return;
                }
            }
            () = tokio::time::sleep(sleep) => {}
        }
        let room = MAX_CONCURRENT_PROBES.saturating_sub(probes.len());
        for p in watch.take_due(clock.now(), room) {
            let mut probe = backend.probe(&p.identity, &p.endpoint);
            // A probe that answers at once (the fake's) costs no task.
            if let Some(result) = (&mut probe).now_or_never() {
                if let Some(change) = watch.record(&p.identity, result, clock.now())
                    && !sink.send(change)
                {
                    return;
                }
                continue;
            }
            probes.spawn(async move {
                let result = match tokio::time::timeout(p.timeout, probe).await {
                    Ok(r) => r,
                    Err(_) => Err(format!("no answer within {} ms", p.timeout.as_millis())),
                };
                (p.identity, result)
            });
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use contract::{AttemptId, LogicalNodeId, RunId};

    use super::*;

    fn uid() -> RunUid {
        RunUid::parse("run_uid", "0123456789abcdef0123456789abcdef").unwrap()
    }

    fn id(i: u32) -> ResourceIdentity {
        ResourceIdentity {
            run_uid: uid(),
            run_id: RunId::parse("run_id", "r").unwrap(),
            node: LogicalNodeId::new(GroupId::parse("g", "workers").unwrap(), i),
            attempt: AttemptId::new(1),
        }
    }

    fn item(i: u32) -> InventoryItem {
        InventoryItem {
            identity: id(i),
            lease: None,
            endpoint: Some(Endpoint::new("endpoint", &format!("127.0.0.1:{}", 1000 + i)).unwrap()),
            session_live: true,
        }
    }

    fn policy(grace: u64) -> WatchHealth {
        WatchHealth {
            run_uid: uid(),
            epoch: Epoch::new(1),
            groups: vec![(
                GroupId::parse("g", "workers").unwrap(),
                HealthPolicy {
                    probe: Probe::Tcp,
                    interval_ms: 1_000,
                    timeout_ms: 500,
                    unhealthy_after_ms: 5_000,
                    startup_grace_ms: grace,
                },
            )],
        }
    }

    fn at(ms: u64) -> UnixMillis {
        UnixMillis::new(ms)
    }

    #[test]
    fn reports_the_first_answer_and_every_change_but_no_repeat() {
        let mut w = HealthWatch::new();
        assert!(w.set_policy(policy(0)));
        w.sync(&[item(0)], at(0));
        let due = w.take_due(at(0), 10);
        assert_eq!(due.len(), 1);
        let first = w.record(&id(0), Ok(()), at(10)).unwrap();
        assert!(matches!(first.change, Change::Health { healthy: true, .. }));
        assert_eq!(w.next_due(), Some(at(1_010)));
        assert!(
            w.take_due(at(1_000), 10).is_empty(),
            "not due before its interval"
        );
        w.take_due(at(1_010), 10);
        assert_eq!(
            w.record(&id(0), Ok(()), at(1_010)),
            None,
            "a repeat is not reported"
        );
        w.take_due(at(2_010), 10);
        let down = w.record(&id(0), Err("refused".into()), at(2_010)).unwrap();
        assert_eq!(
            down.change,
            Change::Health {
                healthy: false,
                detail: "refused".into()
            }
        );
    }

    #[test]
    fn a_failure_within_the_startup_grace_does_not_count() {
        let mut w = HealthWatch::new();
        w.set_policy(policy(3_000));
        w.sync(&[item(0)], at(0));
        w.take_due(at(0), 10);
        assert_eq!(w.record(&id(0), Err("refused".into()), at(0)), None);
        w.take_due(at(1_000), 10);
        assert!(w.record(&id(0), Ok(()), at(1_000)).is_some());
    }

    #[test]
    fn targets_follow_the_inventory_and_the_policy() {
        let mut w = HealthWatch::new();
        w.sync(&[item(0)], at(0));
        assert!(w.is_empty(), "no policy: nothing probed");
        w.set_policy(policy(0));
        w.sync(&[item(0), item(1)], at(0));
        assert_eq!(w.len(), 2);
        w.sync(&[item(1)], at(5));
        assert_eq!(
            w.len(),
            1,
            "a resource gone from the inventory is no longer probed"
        );
        let older = WatchHealth {
            epoch: Epoch::new(0),
            groups: Vec::new(),
            ..policy(0)
        };
        assert!(!w.set_policy(older), "a fenced epoch changes nothing");
        assert_eq!(w.len(), 1);
        w.set_policy(WatchHealth {
            groups: Vec::new(),
            ..policy(0)
        });
        assert!(w.is_empty(), "a group without a probe is not probed");
        assert_eq!(w.next_due(), None);
    }

    #[test]
    fn probes_in_flight_are_bounded() {
        let mut w = HealthWatch::new();
        w.set_policy(policy(0));
        let items: Vec<_> = (0..10).map(item).collect();
        w.sync(&items, at(0));
        assert_eq!(w.take_due(at(0), 4).len(), 4);
        assert_eq!(w.take_due(at(0), 100).len(), 6);
        assert!(w.take_due(at(0), 100).is_empty());
    }
}
