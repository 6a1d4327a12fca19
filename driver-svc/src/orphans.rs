//! The orphan report and the orphan sweep.
//!
//! An orphan is a resource of ours that no run wants: a node an operator
//! abandoned (the driver forgot it, and records what it left behind), or a
//! resource the sweep found in the executor's inventory that matches no node
//! the driver holds at that attempt. The report is kept in memory, in the
//! driver's registry; it is not persisted (a restarted driver finds the
//! still-live resources again with its first sweeps, and lists what its
//! reclaim runs hold from the start).
//!
//! The sweep compares the executor's inventory with the driver's state. The
//! inventory is read *before* the driver's state: a resource exists only
//! after the driver recorded its node at that attempt, so a resource of a
//! node's current attempt is always recognised. A resource is reported only
//! when two consecutive sweeps find it unwanted, so a resource whose node was
//! reaped (or whose create result is still in flight) between the two reads
//! is not misreported. Orphans are reported (log line, `ListOrphans`,
//! metrics) and, unless the driver runs with `--orphan-policy report`,
//! destroyed through the normal deletion path (`Driver::destroy_orphans`): a
//! resource of a run the driver holds is adopted by that run as a node being
//! deleted; one of a run the driver no longer has goes to a *reclaim run*, a
//! stored run for that uid that is deleting from the start and is never
//! listed as a run. Either way each cleanup operation is recorded pending
//! before it is dispatched, retried with backoff, and survives a restart. An
//! adopted orphan stays in the report, marked as being destroyed, until it is
//! gone from the inventory.
//!
//! The same reading of the inventory makes the inventory resync's finding
//! too (SPEC section 8): a lease a run believes live that the inventory lacks
//! at two consecutive looks is lost (the sweep task looks again within a
//! second when a look finds one missing). The inventory arrives decoded
//! ([`Inventory`], read and decoded by the sweep task in `server`); this
//! module speaks no wire type, and the API turns an [`Orphan`] into its wire
//! form.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Mutex,
    time::Duration,
};

use contract::{AttemptId, Epoch, InventoryResource, LogicalNodeId, ResourceIdentity, RunUid, UnixMillis};
use platform::metrics::{Counter, Gauge};

use crate::core::AbandonedNode;

/// Why an orphan is listed: the `source` label of the metrics.
pub const ABANDONED: &str = "abandoned";
pub const SWEEP: &str = "sweep";
pub const DESTROYING: &str = "destroying";

/// A resource's identity as the comparison keys it: (run uid, node, attempt).
pub type ResourceKey = (RunUid, LogicalNodeId, AttemptId);

pub fn key_of(r: &InventoryResource) -> ResourceKey {
    (r.identity.run_uid, r.identity.node.clone(), r.identity.attempt)
}

/// What the driver holds: run uid → node → its current attempt and any
/// successor.
pub type Holdings = HashMap<RunUid, HashMap<LogicalNodeId, Attempts>>;

/// The attempts a run holds for one slot: its current attempt, and a
/// successor while a rollout's surge provisions one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempts {
    pub current: AttemptId,
    pub successor: Option<AttemptId>,
}

impl Attempts {
    pub fn one(current: AttemptId) -> Self {
        Self {
            current,
            successor: None,
        }
    }

    pub fn contains(&self, attempt: AttemptId) -> bool {
        self.current == attempt || self.successor == Some(attempt)
    }
}

/// One reading of the executor's inventory, decoded where it was read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inventory {
    pub resources: Vec<InventoryResource>,
    /// Entries that did not decode: logged where they were read and left out
    /// of `resources`.
    pub undecodable: usize,
}

/// An entry of the orphan report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Orphan {
    pub resource: InventoryResource,
    pub reason: String,
    /// When the driver first recorded it (`None`: not known, for an orphan
    /// handed to a deletion path without having been listed first).
    pub recorded_at: Option<UnixMillis>,
}

/// What one sweep found.
#[derive(Debug, Default)]
#[must_use]
pub struct Findings {
    /// Orphans this sweep reported for the first time.
    pub orphans: Vec<Orphan>,
    /// Leases missing from the inventory at this look and the one before:
    /// lost.
    pub lost: Vec<ResourceKey>,
}

/// Resources of the inventory that no held node wants at their attempt.
pub fn unwanted<'a>(inventory: &'a [InventoryResource], held: &Holdings) -> Vec<&'a InventoryResource> {
    inventory
        .iter()
        .filter(|r| {
            held.get(&r.identity.run_uid)
                .and_then(|nodes| nodes.get(&r.identity.node))
                .is_none_or(|attempts| !attempts.contains(r.identity.attempt))
        })
        .collect()
}

/// Leases a run believes live (`leases`) that the inventory does not list.
pub fn missing(inventory: &[InventoryResource], leases: &[ResourceKey]) -> BTreeSet<ResourceKey> {
    let listed: BTreeSet<ResourceKey> = inventory.iter().map(key_of).collect();
    leases.iter().filter(|k| !listed.contains(*k)).cloned().collect()
}

/// The orphan report and the sweep's memory of the previous sweep.
#[derive(Debug)]
pub struct Orphans {
    inner: Mutex<Inner>,
    metrics: OrphanMetrics,
}

#[derive(Debug, Default)]
struct Inner {
    /// Nodes abandoned by an operator, in order.
    abandoned: Vec<Orphan>,
    /// Orphans found by the sweep, by identity (the last sweep's findings).
    swept: BTreeMap<ResourceKey, Orphan>,
    /// What the previous sweep found unwanted.
    suspects: BTreeSet<ResourceKey>,
    /// Orphans handed to a deletion path, until they leave the inventory.
    destroying: BTreeMap<ResourceKey, Orphan>,
    /// The leases the previous sweep found missing from the inventory.
    missing: BTreeSet<ResourceKey>,
}

#[derive(Debug, Clone)]
struct OrphanMetrics {
    orphans: Gauge,
    sweeps: Counter,
    destroyed: Counter,
    undecodable: Counter,
}

impl OrphanMetrics {
    fn new(r: &platform::metrics::Registry) -> Self {
        let m = Self::register(r);
        for result in ["ok", "error"] {
            m.sweeps.init(&[result]);
        }
        m
    }

    fn register(r: &platform::metrics::Registry) -> Self {
        Self {
            orphans: r.gauge(
                "provisioning_orphans",
                "Orphans in the orphan report, by source: abandoned (nodes an operator abandoned), \
                 sweep (resources in the executor's inventory that no run wants, seen by two \
                 consecutive sweeps) or destroying (orphans handed to a deletion path, until they \
                 leave the inventory).",
                &["source"],
            ),
            sweeps: r.counter(
                "provisioning_orphan_sweeps_total",
                "Orphan sweeps, by result (ok, or error when the inventory could not be read).",
                &["result"],
            ),
            destroyed: r.counter(
                "provisioning_orphans_destroyed_total",
                "Orphans handed to a deletion path that have since left the executor's inventory.",
                &[],
            ),
            undecodable: r.counter(
                "provisioning_inventory_undecodable_total",
                "Entries of the executor's inventory the orphan sweep could not decode and left out.",
                &[],
            ),
        }
    }
}

impl Default for Orphans {
    fn default() -> Self {
        Self::new()
    }
}

impl Orphans {
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            metrics: OrphanMetrics::new(platform::metrics::global()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Records an abandoned node and returns its entry in the report.
    pub fn abandoned(&self, left: &AbandonedNode) -> Orphan {
        let mut reason = String::from("abandoned by an operator");
        if let Some(s) = &left.session {
            reason.push_str(&format!(" (bootstrap session {s})"));
        }
        if let Some(p) = &left.pending {
            reason.push_str(&format!(" (operation {p} was pending)"));
        }
        let orphan = Orphan {
            resource: InventoryResource {
                identity: ResourceIdentity {
                    run_uid: left.run_uid,
                    run_id: left.run_id.clone(),
                    node: left.node.clone(),
                    attempt: left.attempt,
                },
                lease: left.lease.clone(),
                endpoint: left.endpoint.clone(),
                session_live: left.session.is_some(),
                epoch: Epoch::default(),
            },
            reason,
            recorded_at: Some(left.at),
        };
        tracing::warn!(
            run = %left.run_id, run_uid = %left.run_uid, node = %left.node, attempt = left.attempt.get(),
            lease = ?left.lease.as_ref().map(|l| l.as_str()),
            endpoint = ?left.endpoint.as_ref().map(|e| e.as_str()),
            session = ?left.session.as_ref().map(|s| s.as_str()),
            "node abandoned: the driver forgot it; what it left behind is listed as an orphan"
        );
        let mut inner = self.lock();
        inner.abandoned.push(orphan.clone());
        self.metrics
            .orphans
            .set(&[ABANDONED], inner.abandoned.len() as f64);
        orphan
    }

    /// Folds one sweep: `inventory` read from the executor, then `held` (and
    /// the `leases` the runs believe live) read from the runs. One comparison
    /// makes both findings: the orphans newly reported, and the leases lost.
    ///
    /// A reading with entries that did not decode concludes no absence: it
    /// finds no lease lost (and starts the two looks again) and no orphan
    /// destroyed, since an entry it could not read may be that resource, and
    /// a live node is not replaced on a guess.
    pub fn sweep(
        &self,
        inventory: &Inventory,
        held: &Holdings,
        leases: &[ResourceKey],
        now: UnixMillis,
    ) -> Findings {
        let resources = &inventory.resources;
        let unwanted = unwanted(resources, held);
        let mut inner = self.lock();
        let mut swept = BTreeMap::new();
        let mut new = Vec::new();
        for r in &unwanted {
            let key = key_of(r);
            if !inner.suspects.contains(&key) {
                continue;
            }
            let id = &r.identity;
            let reason = match held.get(&id.run_uid).map(|nodes| nodes.get(&id.node)) {
                Some(Some(Attempts { current: attempt, .. })) => format!(
                    "found by the orphan sweep: run {} holds node {} at attempt {}; this older \
                     attempt is destroyed once the slot is free",
                    id.run_id,
                    id.node,
                    attempt.get()
                ),
                Some(None) => format!(
                    "found by the orphan sweep: run {} holds no node {} at attempt {}",
                    id.run_id,
                    id.node,
                    id.attempt.get()
                ),
                None => format!(
                    "found by the orphan sweep: the driver holds no run with uid {}",
                    id.run_uid
                ),
            };
            let orphan = Orphan {
                resource: (*r).clone(),
                reason,
                recorded_at: Some(now),
            };
            let orphan = match inner.swept.get(&key) {
                Some(known) => Orphan {
                    recorded_at: known.recorded_at,
                    ..orphan
                },
                None => {
                    tracing::warn!(
                        run = %id.run_id, run_uid = %id.run_uid, node = %id.node, attempt = id.attempt.get(),
                        lease = ?r.lease.as_ref().map(|l| l.as_str()),
                        endpoint = ?r.endpoint.as_ref().map(|e| e.as_str()),
                        session_live = r.session_live,
                        "orphan found: a resource no run wants (seen by two consecutive sweeps)"
                    );
                    new.push(orphan.clone());
                    orphan
                }
            };
            swept.insert(key, orphan);
        }
        inner.suspects = unwanted.iter().map(|r| key_of(r)).collect();
        // Absence is concluded only from a reading that decoded whole: an
        // entry that did not decode may be the very resource.
        let complete = inventory.undecodable == 0;
        if complete {
            // Being destroyed: held by a run now, so not unwanted; listed
            // until the inventory no longer has it.
            let live: BTreeSet<ResourceKey> = resources.iter().map(key_of).collect();
            let before = inner.destroying.len();
            inner.destroying.retain(|k, _| live.contains(k));
            let gone = before - inner.destroying.len();
            if gone > 0 {
                tracing::info!(destroyed = gone, "orphans destroyed");
                self.metrics.destroyed.add(&[], gone as u64);
            }
        } else {
            self.metrics.undecodable.add(&[], inventory.undecodable as u64);
        }
        let destroying: BTreeSet<ResourceKey> = inner.destroying.keys().cloned().collect();
        swept.retain(|k, _| !destroying.contains(k));
        inner.swept = swept;
        // The resync's finding, from the same reading: missing at this look
        // and the one before. An incomplete reading starts the looks again.
        let lost = if complete {
            let missing = missing(resources, leases);
            let lost = missing.intersection(&inner.missing).cloned().collect();
            inner.missing = missing;
            lost
        } else {
            inner.missing.clear();
            Vec::new()
        };
        self.metrics.orphans.set(&[SWEEP], inner.swept.len() as f64);
        self.metrics
            .orphans
            .set(&[DESTROYING], inner.destroying.len() as f64);
        self.metrics.sweeps.inc(&["ok"]);
        Findings { orphans: new, lost }
    }

    /// The resources the last sweep confirmed as orphans (not yet handed to
    /// a deletion path).
    pub fn confirmed(&self) -> Vec<InventoryResource> {
        self.lock().swept.values().map(|o| o.resource.clone()).collect()
    }

    /// An orphan was adopted by a run (or a reclaim run) and is being
    /// destroyed through its deletion path.
    pub fn destroying(&self, r: &InventoryResource) {
        let key = key_of(r);
        let mut inner = self.lock();
        let mut orphan = inner.swept.remove(&key).unwrap_or_else(|| Orphan {
            resource: r.clone(),
            reason: "found by the orphan sweep".into(),
            recorded_at: None,
        });
        orphan
            .reason
            .push_str("; being destroyed through the deletion path");
        let id = &r.identity;
        tracing::warn!(run = %id.run_id, run_uid = %id.run_uid, node = %id.node, attempt = id.attempt.get(),
            lease = ?r.lease.as_ref().map(|l| l.as_str()), "orphan handed to the deletion path");
        inner.destroying.insert(key, orphan);
        self.metrics.orphans.set(&[SWEEP], inner.swept.len() as f64);
        self.metrics
            .orphans
            .set(&[DESTROYING], inner.destroying.len() as f64);
    }

    /// A restarted driver lists what a stored reclaim run holds as being
    /// destroyed.
    pub fn recovered(&self, run: &crate::core::RunState) {
        let mut inner = self.lock();
        for n in run.nodes() {
            let resource = InventoryResource {
                identity: ResourceIdentity {
                    run_uid: run.uid(),
                    run_id: run.run_id().clone(),
                    node: n.id.clone(),
                    attempt: n.attempt,
                },
                lease: n.facts.lease.clone(),
                endpoint: n.facts.endpoint.clone(),
                session_live: n.facts.session.is_some() || n.facts.ambiguous_bootstrap,
                epoch: run.epoch(),
            };
            inner.destroying.insert(
                key_of(&resource),
                Orphan {
                    resource,
                    reason: "found by an orphan sweep before a restart; being destroyed through the \
                             deletion path"
                        .into(),
                    recorded_at: Some(run.meta().created_at),
                },
            );
        }
        self.metrics
            .orphans
            .set(&[DESTROYING], inner.destroying.len() as f64);
    }

    pub(crate) fn sweep_failed(&self) {
        self.metrics.sweeps.inc(&["error"]);
    }

    /// The report: abandoned nodes first (in order), then the sweep's
    /// findings, then the orphans being destroyed (each by identity).
    /// The last look found leases a run holds missing from the inventory:
    /// the look that confirms them (or not) is due soon, not a whole
    /// interval later.
    pub fn missing_suspected(&self) -> bool {
        !self.lock().missing.is_empty()
    }

    pub fn list(&self) -> Vec<Orphan> {
        let inner = self.lock();
        inner
            .abandoned
            .iter()
            .cloned()
            .chain(inner.swept.values().cloned())
            .chain(inner.destroying.values().cloned())
            .collect()
    }
}

/// How the sweep task paces itself, and what it does with orphans.
#[derive(Debug, Clone, Copy)]
pub struct SweepConfig {
    /// Between sweeps; zero turns the sweep off.
    pub every: Duration,
    /// After the executor link comes up, before the first sweep.
    pub after_link_up: Duration,
    /// Hand confirmed orphans to the deletion path (else only report them).
    pub destroy: bool,
}

impl SweepConfig {
    pub fn new(every: Duration, destroy: bool) -> Self {
        Self {
            every,
            after_link_up: every.min(Duration::from_secs(1)),
            destroy,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use contract::{LeaseId, RunId};

    use super::*;

    fn uid(n: u128) -> RunUid {
        RunUid::from_u128(n)
    }

    fn node(name: &str) -> LogicalNodeId {
        LogicalNodeId::parse("node", name).unwrap()
    }

    fn key(u: u128, n: &str, attempt: u64) -> ResourceKey {
        (uid(u), node(n), AttemptId::new(attempt))
    }

    fn res(u: u128, n: &str, attempt: u64) -> InventoryResource {
        InventoryResource {
            identity: ResourceIdentity {
                run_uid: uid(u),
                run_id: RunId::parse("run", "r").unwrap(),
                node: node(n),
                attempt: AttemptId::new(attempt),
            },
            lease: Some(LeaseId::new("lease", &format!("lease-{n}-{attempt}")).unwrap()),
            endpoint: None,
            session_live: false,
            epoch: Epoch::default(),
        }
    }

    fn inventory(resources: Vec<InventoryResource>) -> Inventory {
        Inventory {
            resources,
            undecodable: 0,
        }
    }

    fn held(entries: &[(u128, &str, u64)]) -> Holdings {
        let mut h = Holdings::new();
        for (u, n, attempt) in entries {
            h.entry(uid(*u))
                .or_default()
                .insert(node(n), Attempts::one(AttemptId::new(*attempt)));
        }
        h
    }

    fn at(ms: u64) -> UnixMillis {
        UnixMillis::new(ms)
    }

    #[test]
    fn current_attempts_are_never_orphans() {
        let inv = vec![res(1, "a-0", 1), res(1, "a-1", 2)];
        let h = held(&[(1, "a-0", 1), (1, "a-1", 2)]);
        assert!(unwanted(&inv, &h).is_empty());
    }

    #[test]
    fn a_slots_successor_is_held_too() {
        let inv = vec![res(1, "a-0", 1), res(1, "a-0", 5), res(1, "a-0", 4)];
        let mut h = held(&[(1, "a-0", 1)]);
        if let Some(a) = h.get_mut(&uid(1)).and_then(|nodes| nodes.get_mut(&node("a-0"))) {
            a.successor = Some(AttemptId::new(5));
        }
        let keys: Vec<ResourceKey> = unwanted(&inv, &h).into_iter().map(key_of).collect();
        assert_eq!(
            keys,
            vec![key(1, "a-0", 4)],
            "only the attempt neither current nor successor"
        );
    }

    #[test]
    fn unknown_run_node_or_attempt_is_unwanted() {
        let inv = vec![
            res(1, "a-0", 1), // old attempt
            res(1, "a-9", 1), // no such node
            res(2, "a-0", 1), // no such run
            res(1, "a-1", 3), // current
        ];
        let h = held(&[(1, "a-0", 4), (1, "a-1", 3)]);
        let keys: Vec<ResourceKey> = unwanted(&inv, &h).into_iter().map(key_of).collect();
        assert_eq!(keys, vec![key(1, "a-0", 1), key(1, "a-9", 1), key(2, "a-0", 1)]);
    }

    #[test]
    fn an_orphan_is_reported_only_after_two_consecutive_sweeps() {
        let o = Orphans::new();
        let h = held(&[(1, "a-0", 2)]);
        let inv = inventory(vec![res(1, "a-0", 1), res(1, "a-0", 2)]);
        assert!(
            o.sweep(&inv, &h, &[], at(1)).orphans.is_empty(),
            "first sighting is only a suspect"
        );
        assert!(o.list().is_empty());
        let new = o.sweep(&inv, &h, &[], at(2)).orphans;
        assert_eq!(new.len(), 1);
        assert_eq!(new[0].resource, res(1, "a-0", 1));
        assert_eq!(new[0].recorded_at, Some(at(2)));
        assert!(
            new[0].reason.contains("holds node a-0 at attempt 2"),
            "{}",
            new[0].reason
        );
        // Seen again: listed, not reported anew, first time kept.
        assert!(o.sweep(&inv, &h, &[], at(3)).orphans.is_empty());
        assert_eq!(o.list().len(), 1);
        assert_eq!(o.list()[0].recorded_at, Some(at(2)));
        // Gone from the inventory: gone from the report.
        let after = inventory(vec![res(1, "a-0", 2)]);
        assert!(o.sweep(&after, &h, &[], at(4)).orphans.is_empty());
        assert!(o.list().is_empty());
    }

    #[test]
    fn a_resource_wanted_in_between_is_not_reported() {
        let o = Orphans::new();
        let inv = inventory(vec![res(1, "a-0", 1)]);
        // Unwanted, then wanted (its node appeared), then unwanted again:
        // never two consecutive sightings.
        assert!(o.sweep(&inv, &held(&[]), &[], at(1)).orphans.is_empty());
        assert!(
            o.sweep(&inv, &held(&[(1, "a-0", 1)]), &[], at(2))
                .orphans
                .is_empty()
        );
        assert!(o.sweep(&inv, &held(&[]), &[], at(3)).orphans.is_empty());
        assert!(o.list().is_empty());
    }

    #[test]
    fn a_lease_missing_at_two_consecutive_looks_is_lost() {
        let o = Orphans::new();
        let h = held(&[(1, "a-0", 1), (1, "a-1", 1)]);
        let leases = [key(1, "a-0", 1), key(1, "a-1", 1)];
        let inv = inventory(vec![res(1, "a-0", 1)]);
        assert_eq!(
            missing(&inv.resources, &leases),
            BTreeSet::from([key(1, "a-1", 1)])
        );
        assert!(
            o.sweep(&inv, &h, &leases, at(1)).lost.is_empty(),
            "one look is not enough"
        );
        assert_eq!(o.sweep(&inv, &h, &leases, at(2)).lost, vec![key(1, "a-1", 1)]);
        // Listed in between: the two looks start over.
        let whole = inventory(vec![res(1, "a-0", 1), res(1, "a-1", 1)]);
        assert!(o.sweep(&whole, &h, &leases, at(3)).lost.is_empty());
        assert!(o.sweep(&inv, &h, &leases, at(4)).lost.is_empty());
        assert_eq!(o.sweep(&inv, &h, &leases, at(5)).lost, vec![key(1, "a-1", 1)]);
    }

    #[test]
    fn a_reading_with_undecodable_entries_concludes_no_absence() {
        let o = Orphans::new();
        let h = held(&[(1, "a-0", 1), (1, "a-1", 1)]);
        let leases = [key(1, "a-0", 1), key(1, "a-1", 1)];
        let partial = Inventory {
            resources: vec![res(1, "a-0", 1)],
            undecodable: 1,
        };
        let complete = inventory(vec![res(1, "a-0", 1)]);
        // Missing at a complete look, then at one with an entry that did not
        // decode (it may be the lease): not lost, and the looks start over.
        assert!(o.sweep(&complete, &h, &leases, at(1)).lost.is_empty());
        assert!(o.sweep(&partial, &h, &leases, at(2)).lost.is_empty());
        assert!(o.sweep(&complete, &h, &leases, at(3)).lost.is_empty());
        assert_eq!(
            o.sweep(&complete, &h, &leases, at(4)).lost,
            vec![key(1, "a-1", 1)]
        );

        // An orphan being destroyed leaves the report only at a complete
        // reading that lacks it.
        let orphan = res(2, "b-0", 1);
        o.destroying(&orphan);
        assert_eq!(o.list().len(), 1);
        let _ = o.sweep(&partial, &h, &[], at(5));
        assert_eq!(o.list().len(), 1, "an undecodable entry may be the orphan");
        let _ = o.sweep(&complete, &h, &[], at(6));
        assert!(o.list().is_empty());
    }
}
