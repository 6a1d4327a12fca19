//! Health probing of the resources the executor holds (SPEC.md section 8).
//!
//! [`HealthWatch`] is the schedule, free of I/O: which resources to probe
//! (those with an endpoint whose run's driver asked for a probe of their
//! group), when each is next due, and what each probe result changes. It
//! reports a node's first answered probe and every change between healthy and
//! unhealthy, never a repeat, so an idle healthy run sends nothing. A failed
//! probe within the group's `startup_grace` of the node's first sighting does
//! not count. [`run`] drives it: it refreshes the targets from the backend's
//! inventory when it may have changed ([`InventoryHint`]; reads spaced by
//! their own cost, [`READ_COST_FACTOR`]), runs the due probes
//! (at most [`MAX_CONCURRENT_PROBES`] at once) through [`Backend::probe`], and
//! sends the changes to the core's change sink, which sequences them and keeps
//! them until the driver acknowledges them.
//!
//! The executor probes every watched resource once per interval (100,000 a
//! second in the bench's health row), so a probe's own cost is kept to a
//! queue pop, a slot lookup and the backend's answer: targets live in a slot
//! table and probes carry [`Key`]s, and each probe interval has a queue that
//! is in due order without sorting.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use contract::{
    Change, Clock, Endpoint, Epoch, GroupId, HealthPolicy, Probe, ResourceIdentity, RunUid, UnixMillis,
    WatchHealth,
};
use futures::{FutureExt as _, StreamExt as _};
use tokio::{sync::mpsc, task::JoinSet};

use crate::backend::{Backend, ChangeSink, InventoryItem, RawChange};

/// Probes in flight at once, so that a slow network never makes the executor
/// hold a socket per node.
pub const MAX_CONCURRENT_PROBES: usize = 512;

/// A target's place in the watch: its slot, and the slot's generation, so
/// that the key of a target since removed (its slot perhaps reused) finds
/// nothing. Probes carry keys rather than identities: the probe loop touches
/// each target without hashing or cloning its identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    slot: u32,
    generation: u32,
}

/// One read of the inventory into a [`HealthWatch`], a page at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncRead(u64);

#[derive(Debug, Clone)]
struct Target {
    identity: ResourceIdentity,
    endpoint: Endpoint,
    policy: HealthPolicy,
    first_seen: UnixMillis,
    next_at: UnixMillis,
    /// The last state reported; `None` before the first counted probe.
    reported: Option<bool>,
    in_flight: bool,
    /// The last [`HealthWatch::sync`] that found the resource.
    seen: u64,
}

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    target: Option<Target>,
}

/// The probe schedule. See the module documentation.
#[derive(Debug, Default)]
pub struct HealthWatch {
    policies: HashMap<RunUid, (Epoch, HashMap<GroupId, HealthPolicy>)>,
    slots: Vec<Slot>,
    /// Slots without a target, for the next one.
    free: Vec<u32>,
    index: HashMap<ResourceIdentity, u32>,
    /// `(next_at, key)` of every target not in flight, in due order without
    /// sorting: `fresh` holds the targets never probed (due when found), and
    /// `lanes` one queue per probe interval, to whose back a target goes
    /// when its probe is recorded, due one interval later. (A wall clock set
    /// back only delays the probes queued behind.) Entries of targets
    /// removed since (`stale` of them) are skipped when they come up.
    fresh: VecDeque<(UnixMillis, Key)>,
    lanes: BTreeMap<u64, VecDeque<(UnixMillis, Key)>>,
    /// Entries in `fresh` and `lanes`, stale ones included.
    queued: usize,
    stale: usize,
    /// Syncs so far; the latest is the stamp of every target it found.
    syncs: u64,
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
        let mut gone = Vec::new();
        for (key, t) in self.targets_mut() {
            if t.identity.run_uid != w.run_uid {
                continue;
            }
            match groups.get(t.identity.node.group()) {
                Some(p) => t.policy = *p,
                None => gone.push(key),
            }
        }
        for key in gone {
            self.remove(key);
        }
        self.policies.insert(w.run_uid, (w.epoch, groups));
        true
    }

    /// The run is forgotten: nothing of it is probed again.
    pub fn forget_run(&mut self, run_uid: RunUid) {
        self.policies.remove(&run_uid);
        let gone: Vec<Key> = self
            .targets_mut()
            .filter(|(_, t)| t.identity.run_uid == run_uid)
            .map(|(key, _)| key)
            .collect();
        for key in gone {
            self.remove(key);
        }
    }

    /// Whether any run asks for probes (without one, the inventory need not
    /// be read).
    pub fn has_policies(&self) -> bool {
        !self.policies.is_empty()
    }

    /// Brings the targets in line with the backend's inventory: every live
    /// resource with an endpoint whose group has a probe, and nothing else.
    /// One index lookup per resource; a resource already watched costs no
    /// policy lookup and no allocation.
    pub fn sync(&mut self, inventory: &[InventoryItem], now: UnixMillis) {
        let read = self.begin_sync();
        self.sync_page(read, inventory, now);
        self.end_sync(read);
    }

    /// Starts a [`HealthWatch::sync`] read a page at a time: each page goes to
    /// [`HealthWatch::sync_page`], and once every page has, [`HealthWatch::end_sync`]
    /// drops what none of them listed. A read that fails is not ended: its
    /// pages added what they listed, and the next read drops what is gone.
    pub fn begin_sync(&mut self) -> SyncRead {
        self.syncs += 1;
        SyncRead(self.syncs)
    }

    /// One page of a read begun by [`HealthWatch::begin_sync`].
    pub fn sync_page(&mut self, read: SyncRead, inventory: &[InventoryItem], now: UnixMillis) {
        let stamp = read.0;
        // The inventory lists a group's resources together: the last group's
        // policy answers most lookups.
        let mut last: Option<(RunUid, GroupId, Option<HealthPolicy>)> = None;
        for item in inventory {
            let Some(endpoint) = &item.endpoint else { continue };
            if let Some(&slot) = self.index.get(&item.identity)
                && let Some(t) = self.slots.get_mut(slot as usize).and_then(|s| s.target.as_mut())
            {
                t.seen = stamp;
                if t.endpoint != *endpoint {
                    t.endpoint = endpoint.clone();
                }
                continue;
            }
            let (run_uid, group) = (item.identity.run_uid, item.identity.node.group());
            let policy = match &last {
                Some((uid, g, policy)) if *uid == run_uid && g == group => *policy,
                _ => {
                    let policy = self
                        .policies
                        .get(&run_uid)
                        .and_then(|(_, groups)| groups.get(group))
                        .copied();
                    last = Some((run_uid, group.clone(), policy));
                    policy
                }
            };
            if let Some(policy) = policy {
                self.insert(Target {
                    identity: item.identity.clone(),
                    endpoint: endpoint.clone(),
                    policy,
                    first_seen: now,
                    next_at: now,
                    reported: None,
                    in_flight: false,
                    seen: stamp,
                });
            }
        }
    }

    /// Ends a read whose every page was synced: a target none of them
    /// listed is gone. A later read begun since supersedes this one, which
    /// then drops nothing.
    pub fn end_sync(&mut self, read: SyncRead) {
        if read.0 != self.syncs {
            return;
        }
        let gone: Vec<Key> = self
            .targets_mut()
            .filter(|(_, t)| t.seen != read.0)
            .map(|(key, _)| key)
            .collect();
        for key in gone {
            self.remove(key);
        }
    }

    fn targets_mut(&mut self) -> impl Iterator<Item = (Key, &mut Target)> {
        self.slots.iter_mut().enumerate().filter_map(|(i, s)| {
            let key = Key {
                slot: u32::try_from(i).ok()?,
                generation: s.generation,
            };
            s.target.as_mut().map(|t| (key, t))
        })
    }

    fn get_mut(&mut self, key: Key) -> Option<&mut Target> {
        self.slots
            .get_mut(key.slot as usize)
            .filter(|s| s.generation == key.generation)
            .and_then(|s| s.target.as_mut())
    }

    fn insert(&mut self, target: Target) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => match u32::try_from(self.slots.len()) {
                Ok(slot) => {
                    self.slots.push(Slot::default());
                    slot
                }
                // Four billion targets: the next one is not watched.
                Err(_) => return,
            },
        };
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return;
        };
        let key = Key {
            slot,
            generation: s.generation,
        };
        self.index.insert(target.identity.clone(), slot);
        self.fresh.push_back((target.next_at, key));
        self.queued += 1;
        s.target = Some(target);
    }

    fn remove(&mut self, key: Key) {
        let Some(s) = self
            .slots
            .get_mut(key.slot as usize)
            .filter(|s| s.generation == key.generation)
        else {
            return;
        };
        let Some(t) = s.target.take() else {
            return;
        };
        s.generation = s.generation.wrapping_add(1);
        self.free.push(key.slot);
        self.index.remove(&t.identity);
        if !t.in_flight {
            // Its queue entry stays until it comes up, or until stale
            // entries outnumber live ones and the queue is rebuilt.
            self.stale += 1;
            if self.stale > self.queued / 2 {
                self.rebuild_queue();
            }
        }
    }

    fn rebuild_queue(&mut self) {
        let mut lanes: BTreeMap<u64, VecDeque<(UnixMillis, Key)>> = BTreeMap::new();
        let mut queued = 0;
        for (key, t) in self.targets_mut() {
            if !t.in_flight {
                lanes
                    .entry(t.policy.interval_ms)
                    .or_default()
                    .push_back((t.next_at, key));
                queued += 1;
            }
        }
        for lane in lanes.values_mut() {
            lane.make_contiguous().sort_unstable();
        }
        self.fresh.clear();
        self.lanes = lanes;
        self.queued = queued;
        self.stale = 0;
    }

    /// The queue whose head is due first (`None`: `fresh`), and when.
    fn earliest(&self) -> Option<(UnixMillis, Option<u64>)> {
        let mut best = self.fresh.front().map(|(at, _)| (*at, None));
        for (interval, lane) in &self.lanes {
            if let Some((at, _)) = lane.front()
                && best.is_none_or(|(b, _)| *at < b)
            {
                best = Some((*at, Some(*interval)));
            }
        }
        best
    }

    /// When the next probe is due, if any target waits (possibly earlier:
    /// an entry of a removed target counts until it is skipped).
    pub fn next_due(&self) -> Option<UnixMillis> {
        self.earliest().map(|(at, _)| at)
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Up to `limit` probes due at `now`, each marked in flight until its
    /// [`HealthWatch::record`]; [`HealthWatch::target`] tells what each
    /// probes.
    pub fn take_due(&mut self, now: UnixMillis, limit: usize) -> Vec<Key> {
        let mut out = Vec::new();
        while out.len() < limit {
            let Some((at, lane)) = self.earliest() else {
                break;
            };
            if at > now {
                break;
            }
            let popped = match lane {
                None => self.fresh.pop_front(),
                Some(interval) => {
                    let popped = self.lanes.get_mut(&interval).and_then(VecDeque::pop_front);
                    if self.lanes.get(&interval).is_some_and(VecDeque::is_empty) {
                        self.lanes.remove(&interval);
                    }
                    popped
                }
            };
            let Some((at, key)) = popped else {
                break;
            };
            self.queued = self.queued.saturating_sub(1);
            match self.get_mut(key) {
                Some(t) if !t.in_flight && t.next_at == at => {
                    t.in_flight = true;
                    out.push(key);
                }
                _ => self.stale = self.stale.saturating_sub(1),
            }
        }
        out
    }

    /// What a due probe probes: the resource, its endpoint, and the time
    /// the probe may take. `None` once the target is gone.
    pub fn target(&self, key: Key) -> Option<(&ResourceIdentity, &Endpoint, Duration)> {
        self.slots
            .get(key.slot as usize)
            .filter(|s| s.generation == key.generation)
            .and_then(|s| s.target.as_ref())
            .map(|t| {
                (
                    &t.identity,
                    &t.endpoint,
                    Duration::from_millis(t.policy.timeout_ms),
                )
            })
    }

    /// The key of a watched resource.
    pub fn key_of(&self, id: &ResourceIdentity) -> Option<Key> {
        let slot = *self.index.get(id)?;
        let s = self.slots.get(slot as usize)?;
        s.target.as_ref()?;
        Some(Key {
            slot,
            generation: s.generation,
        })
    }

    /// A probe's result: schedules the next probe, and returns the change to
    /// report, if the node's state changed (or this is its first counted
    /// probe). A result for a target no longer watched, or not in flight,
    /// changes nothing.
    pub fn record(&mut self, key: Key, result: Result<(), String>, now: UnixMillis) -> Option<RawChange> {
        let t = self.get_mut(key).filter(|t| t.in_flight)?;
        t.in_flight = false;
        let interval = t.policy.interval_ms;
        t.next_at = now
            .checked_add(Duration::from_millis(interval))
            .unwrap_or(UnixMillis::MAX);
        let next = t.next_at;
        let healthy = result.is_ok();
        let in_grace = now
            .saturating_since(t.first_seen)
            .lt(&Duration::from_millis(t.policy.startup_grace_ms));
        let change = if (!healthy && in_grace && t.reported.is_none()) || t.reported == Some(healthy) {
            None
        } else {
            t.reported = Some(healthy);
            let detail = match result {
                Ok(()) => "probe answered".to_owned(),
                Err(why) => why,
            };
            Some(RawChange {
                identity: t.identity.clone(),
                change: Change::Health { healthy, detail },
                at: now,
            })
        };
        self.lanes.entry(interval).or_default().push_back((next, key));
        self.queued += 1;
        change
    }
}

/// What the executor's actor tells the prober.
#[derive(Debug)]
pub enum Command {
    Policy(WatchHealth),
    Forget(RunUid),
}

/// How often the targets may be refreshed from the inventory: a resource
/// made or destroyed is probed, or no longer, within this.
pub const TARGET_REFRESH: Duration = Duration::from_secs(1);

/// How often the inventory is read when nothing says it changed: a safety
/// net for a change no [`InventoryHint`] announced (an operation abandoned
/// at its deadline whose effect happened after all).
pub const TARGET_RESYNC: Duration = Duration::from_secs(30);

/// The least time between two inventory reads, as a multiple of what the
/// last read (and the sync after it) took: reading lists every resource, so
/// while a large run converges (a hint after every backend call) reads take
/// at most about a twentieth of the prober's time instead of all of it. A
/// read that takes under 50 ms keeps [`TARGET_REFRESH`]; at a million
/// resources a new one is probed within seconds rather than one.
pub const READ_COST_FACTOR: u32 = 20;

/// Tells the prober that the backend's resources may have changed (a
/// backend call finished, a change was reported), so that its next refresh
/// reads the inventory. Reading the inventory costs a pass over every
/// resource, so the prober reads it only on this hint, while a resource
/// waits for its endpoint, and every [`TARGET_RESYNC`]: an idle run costs
/// its probes and nothing else. Cheap to clone and to mark.
#[derive(Debug, Clone)]
pub struct InventoryHint(Arc<AtomicBool>);

impl Default for InventoryHint {
    /// Marked: the first refresh reads the inventory.
    fn default() -> Self {
        Self(Arc::new(AtomicBool::new(true)))
    }
}

impl InventoryHint {
    pub fn mark(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether it was marked since the last call.
    fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}

/// Drives a [`HealthWatch`] until `commands` closes or the sink stops
/// listening.
pub async fn run(
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    sink: ChangeSink,
    hint: InventoryHint,
) {
    let mut watch = HealthWatch::new();
    let mut probes: JoinSet<(Key, Result<(), String>)> = JoinSet::new();
    let mut refresh = tokio::time::interval(TARGET_REFRESH);
    refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When the inventory was last read, and whether it listed a resource
    // still without an endpoint (which may get one without any hint).
    let mut last_read: Option<tokio::time::Instant> = None;
    let mut read_gap = TARGET_REFRESH;
    let mut awaiting_endpoint = false;
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
                        hint.mark();
                        refresh.reset_immediately();
                    }
                }
                Some(Command::Forget(uid)) => watch.forget_run(uid),
            },
            at = refresh.tick() => {
                let since = last_read.map(|t| at.saturating_duration_since(t));
                let resync = since.is_none_or(|d| d >= TARGET_RESYNC);
                let spaced = since.is_none_or(|d| d >= read_gap);
                // Nothing to probe: no need to read the inventory at all.
                // Taken before the read, so a change during it is read next.
                if watch.has_policies() && spaced && (hint.take() || awaiting_endpoint || resync) {
                    last_read = Some(at);
                    let started = clock.monotonic();
                    // A page at a time: the read holds a page, not the
                    // inventory.
                    let read = watch.begin_sync();
                    let mut pages = backend.inventory_pages();
                    let mut awaiting = false;
                    let mut failed = None;
                    while let Some(page) = pages.next().await {
                        match page {
                            Ok(items) => {
                                awaiting |= items.iter().any(|i| i.endpoint.is_none());
                                watch.sync_page(read, &items, clock.now());
                            }
                            Err(e) => {
                                failed = Some(e);
                                break;
                            }
                        }
                    }
                    match failed {
                        None => {
                            awaiting_endpoint = awaiting;
                            watch.end_sync(read);
                        }
                        Some(e) => {
                            hint.mark();
                            tracing::debug!(error = %e, "health: inventory unavailable");
                        }
                    }
                    let took = clock.monotonic().saturating_since(started);
                    read_gap = TARGET_REFRESH.max(took.saturating_mul(READ_COST_FACTOR));
                }
            }
            Some(done) = probes.join_next(), if !probes.is_empty() => {
                if let Ok((key, result)) = done
                    && let Some(change) = watch.record(key, result, clock.now())
                    && !sink.send(change)
                {
                    return;
                }
            }
            () = tokio::time::sleep(sleep) => {}
        }
        let room = MAX_CONCURRENT_PROBES.saturating_sub(probes.len());
        let now = clock.now();
        for key in watch.take_due(now, room) {
            let Some((identity, endpoint, timeout)) = watch.target(key) else {
                continue;
            };
            let mut probe = backend.probe(identity, endpoint);
            // A probe that answers at once (the fake's) costs no task.
            if let Some(result) = (&mut probe).now_or_never() {
                if let Some(change) = watch.record(key, result, now)
                    && !sink.send(change)
                {
                    return;
                }
                continue;
            }
            probes.spawn(async move {
                let result = match tokio::time::timeout(timeout, probe).await {
                    Ok(r) => r,
                    Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
                };
                (key, result)
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

    /// A backend whose inventory lists one resource and takes `cost_ms` of
    /// the clock's time to read.
    struct Listing {
        clock: contract::ManualClock,
        cost_ms: u64,
        reads: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Backend for Listing {
        fn execute(
            &self,
            _op: contract::Operation,
            _observations: crate::backend::ObservationSink,
        ) -> futures::future::BoxFuture<'static, contract::Outcome> {
            Box::pin(std::future::pending())
        }

        fn inventory(
            &self,
        ) -> futures::future::BoxFuture<'static, Result<Vec<InventoryItem>, crate::backend::BackendError>>
        {
            self.reads.fetch_add(1, Ordering::SeqCst);
            self.clock.advance(self.cost_ms);
            Box::pin(std::future::ready(Ok(vec![item(0)])))
        }

        fn probe(
            &self,
            _: &ResourceIdentity,
            _: &Endpoint,
        ) -> futures::future::BoxFuture<'static, Result<(), String>> {
            Box::pin(std::future::ready(Ok(())))
        }
    }

    /// Runs the prober over a backend whose reads cost `cost_ms`, with the
    /// inventory hinted as changed every 100 ms for about `ms`; returns the
    /// reads and the real time it took.
    async fn reads_while_hinted(cost_ms: u64, ms: u64) -> (usize, Duration) {
        let clock = contract::ManualClock::new(at(0));
        let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let backend = Listing {
            clock: clock.clone(),
            cost_ms,
            reads: Arc::clone(&reads),
        };
        let (commands, commands_rx) = mpsc::unbounded_channel();
        let (changes, _changes_rx) = mpsc::unbounded_channel();
        let hint = InventoryHint::default();
        let prober = tokio::spawn(run(
            Arc::new(backend),
            Arc::new(clock),
            commands_rx,
            ChangeSink::new(changes),
            hint.clone(),
        ));
        commands.send(Command::Policy(policy(0))).unwrap();
        // Real time, not the manual clock's: the prober's ticks are tokio's.
        #[allow(clippy::disallowed_methods)]
        let started = std::time::Instant::now();
        for _ in 0..ms / 100 {
            hint.mark();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let took = started.elapsed();
        prober.abort();
        (reads.load(Ordering::SeqCst), took)
    }

    #[tokio::test]
    async fn inventory_reads_are_spaced_by_their_cost() {
        // A read costing 250 ms may come once per 5 s; a cheap one once per
        // TARGET_REFRESH, whenever the hint says the inventory changed.
        let (cheap, costly) = tokio::join!(reads_while_hinted(0, 4_500), reads_while_hinted(250, 4_500));
        let (cheap, took) = cheap;
        assert!(cheap >= 4, "{cheap} cheap reads in {took:?}");
        let (costly, took) = costly;
        let allowed = 1 + usize::try_from(took.as_secs() / 5).unwrap();
        assert!(costly <= allowed, "{costly} reads of 250 ms each in {took:?}");
        assert!(costly >= 1);
    }

    #[test]
    fn reports_the_first_answer_and_every_change_but_no_repeat() {
        let mut w = HealthWatch::new();
        assert!(w.set_policy(policy(0)));
        w.sync(&[item(0)], at(0));
        let due = w.take_due(at(0), 10);
        assert_eq!(due.len(), 1);
        let first = w.record(w.key_of(&id(0)).unwrap(), Ok(()), at(10)).unwrap();
        assert!(matches!(first.change, Change::Health { healthy: true, .. }));
        assert_eq!(w.next_due(), Some(at(1_010)));
        assert!(
            w.take_due(at(1_000), 10).is_empty(),
            "not due before its interval"
        );
        w.take_due(at(1_010), 10);
        assert_eq!(
            w.record(w.key_of(&id(0)).unwrap(), Ok(()), at(1_010)),
            None,
            "a repeat is not reported"
        );
        w.take_due(at(2_010), 10);
        let down = w
            .record(w.key_of(&id(0)).unwrap(), Err("refused".into()), at(2_010))
            .unwrap();
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
        assert_eq!(
            w.record(w.key_of(&id(0)).unwrap(), Err("refused".into()), at(0)),
            None
        );
        w.take_due(at(1_000), 10);
        assert!(w.record(w.key_of(&id(0)).unwrap(), Ok(()), at(1_000)).is_some());
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

    /// Probes `n` due targets at `now`, all answering.
    fn probe_all(w: &mut HealthWatch, now: UnixMillis) -> usize {
        let due = w.take_due(now, usize::MAX);
        for &key in &due {
            assert!(w.target(key).is_some());
            let _ = w.record(key, Ok(()), now);
        }
        due.len()
    }

    #[test]
    fn each_target_is_probed_once_per_interval_in_due_order() {
        let mut w = HealthWatch::new();
        w.set_policy(policy(0));
        w.sync(&(0..3).map(item).collect::<Vec<_>>(), at(0));
        assert_eq!(probe_all(&mut w, at(0)), 3, "found: due at once");
        w.sync(&(0..5).map(item).collect::<Vec<_>>(), at(400));
        assert_eq!(w.next_due(), Some(at(400)), "the new ones first");
        assert_eq!(probe_all(&mut w, at(400)), 2);
        assert_eq!(w.next_due(), Some(at(1_000)));
        assert_eq!(probe_all(&mut w, at(999)), 0);
        assert_eq!(probe_all(&mut w, at(1_000)), 3);
        assert_eq!(w.next_due(), Some(at(1_400)));
        assert_eq!(probe_all(&mut w, at(1_400)), 2);
        assert_eq!(probe_all(&mut w, at(2_000)), 3);
    }

    /// A read a page at a time ends where a whole one does; one that fails
    /// part way, or that a later read supersedes, drops nothing.
    #[test]
    fn a_read_in_pages_drops_only_what_none_of_its_pages_listed() {
        let mut w = HealthWatch::new();
        w.set_policy(policy(0));
        w.sync(&(0..4).map(item).collect::<Vec<_>>(), at(0));
        assert_eq!(w.len(), 4);
        let watched = |w: &HealthWatch| (0..6).filter(|&i| w.key_of(&id(i)).is_some()).collect::<Vec<_>>();

        // Pages listing 0 and 4, then 2 and 5: 1 and 3 go at the end, not before.
        let read = w.begin_sync();
        w.sync_page(read, &[item(0), item(4)], at(10));
        w.sync_page(read, &[item(2), item(5)], at(10));
        assert_eq!(watched(&w), [0, 1, 2, 3, 4, 5]);
        w.end_sync(read);
        assert_eq!(watched(&w), [0, 2, 4, 5]);

        // A read that fails after its first page is not ended: nothing goes.
        let failed = w.begin_sync();
        w.sync_page(failed, &[item(0)], at(20));
        assert_eq!(watched(&w), [0, 2, 4, 5]);

        // A read superseded by a later one drops nothing at its end; the
        // later one's end drops what it did not list.
        let old = w.begin_sync();
        w.sync_page(old, &[item(0)], at(30));
        let new = w.begin_sync();
        w.sync_page(new, &[item(0), item(2)], at(30));
        w.end_sync(old);
        assert_eq!(watched(&w), [0, 2, 4, 5]);
        w.end_sync(new);
        assert_eq!(watched(&w), [0, 2]);
    }

    #[test]
    fn a_removed_target_is_not_probed_and_its_late_result_changes_nothing() {
        let mut w = HealthWatch::new();
        w.set_policy(policy(0));
        w.sync(&[item(0), item(1)], at(0));
        let due = w.take_due(at(0), 1);
        let in_flight = due[0];
        w.sync(&[item(1)], at(10));
        assert_eq!(w.len(), 1);
        assert_eq!(w.record(in_flight, Ok(()), at(20)), None, "the target is gone");
        // Its slot goes to the next resource found; the old key finds nothing.
        w.sync(&[item(1), item(2)], at(30));
        assert_eq!(w.target(in_flight), None);
        assert_eq!(w.record(in_flight, Ok(()), at(30)), None);
        let probed: Vec<_> = w
            .take_due(at(30), 10)
            .into_iter()
            .map(|k| w.target(k).unwrap().0.node.index())
            .collect();
        assert_eq!(probed, [1, 2]);
    }

    #[test]
    fn entries_of_removed_targets_do_not_pile_up() {
        let mut w = HealthWatch::new();
        w.set_policy(policy(0));
        for round in 0..50u32 {
            // A fresh set of resources every round; the last round's are gone.
            let items: Vec<_> = (round * 100..round * 100 + 100).map(item).collect();
            let now = at(u64::from(round) * 10);
            w.sync(&items, now);
            assert_eq!(w.len(), 100);
            assert!(w.queued <= 3 * 100, "round {round}: {} queued", w.queued);
        }
        assert_eq!(probe_all(&mut w, at(1_000)), 100, "only the live ones");
    }

    #[test]
    fn a_new_interval_applies_from_the_next_probe() {
        let mut w = HealthWatch::new();
        w.set_policy(policy(0));
        w.sync(&[item(0)], at(0));
        assert_eq!(probe_all(&mut w, at(0)), 1);
        let mut faster = policy(0);
        faster.groups[0].1.interval_ms = 100;
        faster.groups[0].1.timeout_ms = 100;
        w.set_policy(faster);
        assert_eq!(w.next_due(), Some(at(1_000)), "already scheduled");
        assert_eq!(probe_all(&mut w, at(1_000)), 1);
        assert_eq!(w.next_due(), Some(at(1_100)));
    }
}
