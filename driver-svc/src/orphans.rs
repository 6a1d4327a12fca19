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

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Mutex,
    time::Duration,
};

use contract::pb;
use platform::metrics::{Counter, Gauge};

use crate::core::AbandonedNode;

/// Why an orphan is listed: the `source` label of the metrics.
pub const ABANDONED: &str = "abandoned";
pub const SWEEP: &str = "sweep";
pub const DESTROYING: &str = "destroying";

/// A resource's identity: (run uid, node, attempt).
pub type ResourceKey = (String, String, u64);

pub fn key_of(r: &pb::Resource) -> ResourceKey {
    (r.run_uid.clone(), r.node_id.clone(), r.attempt)
}

/// What the driver holds: run uid → node → current attempt.
pub type Holdings = HashMap<String, HashMap<String, u64>>;

/// Resources of the inventory that no held node wants at their attempt.
pub fn unwanted<'a>(inventory: &'a [pb::Resource], held: &Holdings) -> Vec<&'a pb::Resource> {
    inventory
        .iter()
        .filter(|r| {
            held.get(&r.run_uid)
                .and_then(|nodes| nodes.get(&r.node_id))
                .is_none_or(|attempt| *attempt != r.attempt)
        })
        .collect()
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
    abandoned: Vec<pb::Orphan>,
    /// Orphans found by the sweep, by identity (the last sweep's findings).
    swept: BTreeMap<ResourceKey, pb::Orphan>,
    /// What the previous sweep found unwanted.
    suspects: BTreeSet<ResourceKey>,
    /// Orphans handed to a deletion path, until they leave the inventory.
    destroying: BTreeMap<ResourceKey, pb::Orphan>,
}

#[derive(Debug, Clone)]
struct OrphanMetrics {
    orphans: Gauge,
    sweeps: Counter,
    destroyed: Counter,
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
    pub fn abandoned(&self, left: &AbandonedNode) -> pb::Orphan {
        let mut reason = String::from("abandoned by an operator");
        if let Some(s) = &left.session {
            reason.push_str(&format!(" (bootstrap session {s})"));
        }
        if let Some(p) = &left.pending {
            reason.push_str(&format!(" (operation {p} was pending)"));
        }
        let orphan = pb::Orphan {
            resource: Some(pb::Resource {
                run_uid: left.run_uid.to_string(),
                run_id: left.run_id.to_string(),
                node_id: left.node.to_string(),
                attempt: left.attempt.get(),
                lease_id: left
                    .lease
                    .as_ref()
                    .map_or_else(String::new, |l| l.as_str().to_owned()),
                endpoint: left
                    .endpoint
                    .as_ref()
                    .map_or_else(String::new, |e| e.as_str().to_owned()),
                session_live: left.session.is_some(),
                epoch: 0,
            }),
            reason,
            recorded_at_ms: left.at.as_millis(),
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

    /// Folds one sweep: `inventory` read from the executor, then `held` read
    /// from the runs. Returns the orphans newly reported by this sweep.
    pub fn sweep(&self, inventory: &[pb::Resource], held: &Holdings, now_ms: u64) -> Vec<pb::Orphan> {
        let unwanted = unwanted(inventory, held);
        let mut inner = self.lock();
        let mut swept = BTreeMap::new();
        let mut new = Vec::new();
        for r in &unwanted {
            let key = key_of(r);
            if !inner.suspects.contains(&key) {
                continue;
            }
            let reason = match held.get(&r.run_uid).map(|nodes| nodes.get(&r.node_id)) {
                Some(Some(attempt)) => format!(
                    "found by the orphan sweep: run {} holds node {} at attempt {attempt}; this older \
                     attempt is destroyed once the slot is free",
                    r.run_id, r.node_id
                ),
                Some(None) => format!(
                    "found by the orphan sweep: run {} holds no node {} at attempt {}",
                    r.run_id, r.node_id, r.attempt
                ),
                None => format!(
                    "found by the orphan sweep: the driver holds no run with uid {}",
                    r.run_uid
                ),
            };
            let orphan = match inner.swept.get(&key) {
                Some(known) => pb::Orphan {
                    resource: Some((*r).clone()),
                    reason,
                    recorded_at_ms: known.recorded_at_ms,
                },
                None => {
                    tracing::warn!(
                        run = %r.run_id, run_uid = %r.run_uid, node = %r.node_id, attempt = r.attempt,
                        lease = %r.lease_id, endpoint = %r.endpoint, session_live = r.session_live,
                        "orphan found: a resource no run wants (seen by two consecutive sweeps)"
                    );
                    let o = pb::Orphan {
                        resource: Some((*r).clone()),
                        reason,
                        recorded_at_ms: now_ms,
                    };
                    new.push(o.clone());
                    o
                }
            };
            swept.insert(key, orphan);
        }
        inner.suspects = unwanted.iter().map(|r| key_of(r)).collect();
        // Being destroyed: held by a run now, so not unwanted; listed until
        // the inventory no longer has it.
        let live: BTreeSet<ResourceKey> = inventory.iter().map(key_of).collect();
        let before = inner.destroying.len();
        inner.destroying.retain(|k, _| live.contains(k));
        let gone = before - inner.destroying.len();
        if gone > 0 {
            tracing::info!(destroyed = gone, "orphans destroyed");
            self.metrics.destroyed.add(&[], gone as u64);
        }
        let destroying: BTreeSet<ResourceKey> = inner.destroying.keys().cloned().collect();
        swept.retain(|k, _| !destroying.contains(k));
        inner.swept = swept;
        self.metrics.orphans.set(&[SWEEP], inner.swept.len() as f64);
        self.metrics
            .orphans
            .set(&[DESTROYING], inner.destroying.len() as f64);
        self.metrics.sweeps.inc(&["ok"]);
        new
    }

    /// The resources the last sweep confirmed as orphans (not yet handed to
    /// a deletion path).
    pub fn confirmed(&self) -> Vec<pb::Resource> {
        self.lock()
            .swept
            .values()
            .filter_map(|o| o.resource.clone())
            .collect()
    }

    /// An orphan was adopted by a run (or a reclaim run) and is being
    /// destroyed through its deletion path.
    pub fn destroying(&self, r: &pb::Resource) {
        let key = key_of(r);
        let mut inner = self.lock();
        let mut orphan = inner.swept.remove(&key).unwrap_or_else(|| pb::Orphan {
            resource: Some(r.clone()),
            reason: "found by the orphan sweep".into(),
            recorded_at_ms: 0,
        });
        orphan
            .reason
            .push_str("; being destroyed through the deletion path");
        tracing::warn!(run = %r.run_id, run_uid = %r.run_uid, node = %r.node_id, attempt = r.attempt,
            lease = %r.lease_id, "orphan handed to the deletion path");
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
            let resource = pb::Resource {
                run_uid: run.uid().to_string(),
                run_id: run.run_id().to_string(),
                node_id: n.id.to_string(),
                attempt: n.attempt.get(),
                lease_id: n
                    .facts
                    .lease
                    .as_ref()
                    .map_or_else(String::new, |l| l.as_str().to_owned()),
                endpoint: n
                    .facts
                    .endpoint
                    .as_ref()
                    .map_or_else(String::new, |e| e.as_str().to_owned()),
                session_live: n.facts.session.is_some() || n.facts.ambiguous_bootstrap,
                epoch: run.epoch().get(),
            };
            let key = key_of(&resource);
            inner.destroying.insert(
                key,
                pb::Orphan {
                    resource: Some(resource),
                    reason: "found by an orphan sweep before a restart; being destroyed through the \
                             deletion path"
                        .into(),
                    recorded_at_ms: run.meta().created_at.as_millis(),
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
    pub fn list(&self) -> Vec<pb::Orphan> {
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

    use super::*;

    fn res(uid: &str, node: &str, attempt: u64) -> pb::Resource {
        pb::Resource {
            run_uid: uid.into(),
            run_id: "r".into(),
            node_id: node.into(),
            attempt,
            lease_id: format!("lease-{node}-{attempt}"),
            ..pb::Resource::default()
        }
    }

    fn held(entries: &[(&str, &str, u64)]) -> Holdings {
        let mut h = Holdings::new();
        for (uid, node, attempt) in entries {
            h.entry((*uid).into())
                .or_default()
                .insert((*node).into(), *attempt);
        }
        h
    }

    #[test]
    fn current_attempts_are_never_orphans() {
        let inv = vec![res("u1", "a-0", 1), res("u1", "a-1", 2)];
        let h = held(&[("u1", "a-0", 1), ("u1", "a-1", 2)]);
        assert!(unwanted(&inv, &h).is_empty());
    }

    #[test]
    fn unknown_run_node_or_attempt_is_unwanted() {
        let inv = vec![
            res("u1", "a-0", 1), // old attempt
            res("u1", "a-9", 1), // no such node
            res("u2", "a-0", 1), // no such run
            res("u1", "a-1", 3), // current
        ];
        let h = held(&[("u1", "a-0", 4), ("u1", "a-1", 3)]);
        let keys: Vec<ResourceKey> = unwanted(&inv, &h).into_iter().map(key_of).collect();
        assert_eq!(
            keys,
            vec![
                ("u1".into(), "a-0".into(), 1),
                ("u1".into(), "a-9".into(), 1),
                ("u2".into(), "a-0".into(), 1)
            ]
        );
    }

    #[test]
    fn an_orphan_is_reported_only_after_two_consecutive_sweeps() {
        let o = Orphans::new();
        let h = held(&[("u1", "a-0", 2)]);
        let inv = vec![res("u1", "a-0", 1), res("u1", "a-0", 2)];
        assert!(
            o.sweep(&inv, &h, 1).is_empty(),
            "first sighting is only a suspect"
        );
        assert!(o.list().is_empty());
        let new = o.sweep(&inv, &h, 2);
        assert_eq!(new.len(), 1);
        assert_eq!(new[0].resource.as_ref().unwrap().attempt, 1);
        assert_eq!(new[0].recorded_at_ms, 2);
        // Seen again: listed, not reported anew, first time kept.
        assert!(o.sweep(&inv, &h, 3).is_empty());
        assert_eq!(o.list().len(), 1);
        assert_eq!(o.list()[0].recorded_at_ms, 2);
        // Gone from the inventory: gone from the report.
        assert!(o.sweep(&[res("u1", "a-0", 2)], &h, 4).is_empty());
        assert!(o.list().is_empty());
    }

    #[test]
    fn a_resource_wanted_in_between_is_not_reported() {
        let o = Orphans::new();
        let inv = vec![res("u1", "a-0", 1)];
        // Unwanted, then wanted (its node appeared), then unwanted again:
        // never two consecutive sightings.
        assert!(o.sweep(&inv, &held(&[]), 1).is_empty());
        assert!(o.sweep(&inv, &held(&[("u1", "a-0", 1)]), 2).is_empty());
        assert!(o.sweep(&inv, &held(&[]), 3).is_empty());
        assert!(o.list().is_empty());
    }
}
