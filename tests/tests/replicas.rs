//! Driver replicas on etcd, with real processes: a real etcd on loopback, the
//! decider, the executor on the process backend (every lease a node-agent
//! process) and driver replicas sharing the etcd store.
//!
//! - The owner of a run is SIGKILLed mid-convergence: another replica takes
//!   the run over under a higher epoch and it converges.
//! - The owner is paused (SIGSTOP) past its lease: another takes over; the old
//!   one, resumed (SIGCONT), writes and dispatches nothing for the run and
//!   exits.
//! - Two replicas started together race for a run whose owner went: one
//!   takes it, and only one ever writes it.
//! - The owner is stopped on purpose (SIGTERM): it resigns, and another
//!   replica takes the run long before any lease could expire.
//! - etcd stops answering (SIGSTOP) for less than a lease: the owner's
//!   writes fail and the run halts; once etcd answers again the owner
//!   reloads the run from the store under a new epoch and it converges.
//! - deploy/k8s-replicated/ matches the binaries and the schema: three etcd
//!   members started with exactly 10-etcd.yaml's arguments form the store,
//!   three replicas started with exactly 40-driver.yaml's share a run on it,
//!   and the run goes on when one member is killed.
//!
//! Order is shown by etcd revisions (the run's ownership key and its writer
//! key, which every write of the run sets) and by epochs in the executor's
//! and drivers' event traces, never by timing; failover times are printed as
//! figures. Throughout, a sampler reads the process table: no identity and no
//! slot ever has two live agents. The executor must start no operation that
//! carries an epoch older than the newest claim it accepted for the run.
//!
//! Needs a driver built with the `etcd` feature, and etcd (Debian's
//! `etcd-server`): `cargo build -p driver-svc --features etcd && cargo test -p
//! provisioning-tests --features etcd --test replicas` (`.ci/run` does both).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use contract::{ClusterShape, Param, pb, pb::provisioning_client::ProvisioningClient};
use platform::event_trace::{TraceEvent, TraceLine, parse_line};
use provisioning_tests::{
    etcd::{self, Etcd, EtcdMembers, MembersStart, PREFIX},
    netns::{Direction, Host},
    procs::{
        self, AgentsDir, Cluster, ClusterOptions, Sampler, Service, bin_path, live_agent_pids, run_events,
        watch_until,
    },
    shapes::{shape, with_template},
};
use tonic::{Code, transport::Channel};

const RUN: &str = "shared";
const CONVERGE: Duration = Duration::from_secs(90);
/// The replicas' lease (seconds): a replica that stops renewing loses its
/// runs this long after its last renewal.
const LEASE_TTL_S: &str = "2";

/// The driver under test must have the etcd store.
fn require_etcd_driver() {
    let help = Command::new(bin_path("driver-svc").unwrap())
        .arg("--help")
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&help.stdout).contains("--etcd-endpoints"),
        "target/debug/driver-svc was built without the etcd feature: run \
         `cargo build -p driver-svc --features etcd` first"
    );
}

impl Replicated {
    /// Opens a link to the executor as the run's owner at `epoch` would,
    /// claims the run and submits a fresh operation (a copy of one the
    /// executor received under that epoch, with an unused sequence number);
    /// expects both refused as fenced. Returns the operation's id.
    async fn replay_as_old_owner(&self, uid: &str, epoch: u64) -> String {
        let old = read_trace(&self.trace_path("executor"))
            .into_iter()
            .find_map(|l| match l.event {
                TraceEvent::OpReceived { op, .. } if op.run == uid && op.epoch == epoch => Some(op),
                _ => None,
            })
            .expect("an operation the old owner sent");
        let mut op: pb::Operation = platform::event_trace::unhex(&old.wire).unwrap();
        let id = op.id.as_mut().unwrap();
        id.seq = 999;
        let stale = format!("a{}.{}", id.attempt, id.seq);
        let mut executor = self.cluster.executor_client().await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let message = |kind| pb::DriverMessage {
            kind: Some(kind),
            trace: None,
        };
        tx.send(message(pb::driver_message::Kind::Claim(pb::Claim {
            run_uid: uid.to_owned(),
            run_id: RUN.to_owned(),
            epoch,
        })))
        .await
        .unwrap();
        tx.send(message(pb::driver_message::Kind::Submit(op)))
            .await
            .unwrap();
        let mut inbound = executor
            .link(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut refused = Vec::new();
        let read = async {
            while refused.len() < 2 {
                let Some(m) = inbound.message().await.unwrap() else {
                    break;
                };
                if let Some(pb::executor_message::Kind::Rejection(rej)) = m.kind {
                    refused.push(rej);
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(10), read).await;
        drop(tx);
        assert_eq!(refused.len(), 2, "claim and operation refused: {refused:?}");
        for rej in &refused {
            assert_eq!(rej.reason, pb::RejectionReason::Fenced as i32, "{rej:?}");
            assert!(rej.highest_epoch > epoch, "{rej:?}");
        }
        assert!(refused[1].id.is_some(), "{refused:?}");
        stale
    }
}

async fn owner(etcd: &mut etcd_client::Client, uid: &str) -> Option<String> {
    etcd::owner(etcd, uid).await.unwrap()
}

async fn history(etcd: &mut etcd_client::Client, key: &str) -> Vec<(i64, Option<String>)> {
    etcd::history(etcd, key).await.unwrap()
}

fn now_us() -> u64 {
    u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros()).unwrap()
}

fn read_trace(path: &Path) -> Vec<TraceLine> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| parse_line(l).unwrap())
        .collect()
}

/// `workers` agents whose bootstrap takes a while, so that a replica goes
/// mid-convergence.
fn workers(generation: u64, count: u32) -> ClusterShape {
    with_template(
        shape(RUN, generation, "process", &[("workers", count, "img:1")]),
        "workers",
        |t| {
            for (k, v) in [("stage_delay_ms", "400"), ("fault.endpoint_delay_ms", "300")] {
                t.boot.insert(
                    k.into(),
                    Param {
                        value: v.into(),
                        secret: false,
                    },
                );
            }
        },
    )
}

/// The services, with driver replicas `d1..` on one etcd.
struct Replicated {
    agents: AgentsDir,
    etcd: Etcd,
    cluster: Cluster,
    /// Replicas started after the cluster's own driver (`d1`): (owner id,
    /// service).
    extra: Vec<(String, Service)>,
    driver_args: Vec<String>,
}

impl Replicated {
    /// etcd, the decider, the executor and replica `d1`.
    async fn start() -> Self {
        Self::start_with_lease(LEASE_TTL_S).await
    }

    /// As [`Replicated::start`], the replicas' leases `lease_s` seconds long.
    async fn start_with_lease(lease_s: &str) -> Self {
        Self::start_with(lease_s, false).await
    }

    /// As [`Replicated::start`], with etcd, the decider and the executor
    /// listening on every address, for replicas on private test hosts
    /// ([`Replicated::add_on_host`]).
    async fn start_reachable() -> Self {
        Self::start_with(LEASE_TTL_S, true).await
    }

    async fn start_with(lease_s: &str, reachable: bool) -> Self {
        require_etcd_driver();
        let agents = AgentsDir::new().unwrap();
        let etcd = if reachable {
            Etcd::start_on("0.0.0.0").unwrap()
        } else {
            Etcd::start().unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        let trace = |name: &str| dir.path().join(format!("{name}.trace")).display().to_string();
        let opts = ClusterOptions::default()
            .insecure()
            .executor("--backend", "process")
            .executor("--process-state-dir", &agents.root.display().to_string())
            .executor("--process-kill-grace-ms", "300")
            .executor("--event-trace", &trace("executor"))
            .driver("--operation-timeout-ms", "5000")
            .driver("--result-grace-ms", "500")
            // The sweep runs: a replica must not take another's resources
            // for orphans.
            .driver("--orphan-sweep-ms", "500")
            .driver("--store", "etcd")
            .driver("--etcd-endpoints", &etcd.endpoint)
            .driver("--etcd-lease-ttl-s", lease_s)
            .driver("--metrics-listen", "127.0.0.1:0");
        let opts = if reachable {
            opts.reachable_from_hosts()
        } else {
            opts
        };
        let driver_args = opts.driver_args.clone();
        let opts = opts
            .driver("--etcd-owner-id", "d1")
            .driver("--event-trace", &trace("d1"));
        let cluster = Cluster::start_in(dir, opts).await.unwrap();
        Self {
            agents,
            etcd,
            cluster,
            extra: Vec::new(),
            driver_args,
        }
    }

    fn trace_path(&self, name: &str) -> PathBuf {
        self.cluster.dir.path().join(format!("{name}.trace"))
    }

    /// The arguments replica `id` starts with.
    fn replica_args(&self, id: &str) -> (PathBuf, Vec<String>) {
        let dir = self.cluster.dir.path().join(id);
        std::fs::create_dir_all(&dir).unwrap();
        let mut args = vec![
            "--decider".to_owned(),
            self.cluster.decider.url(),
            "--executor".to_owned(),
            self.cluster.executor.url(),
            "--data-dir".to_owned(),
            dir.join("data").display().to_string(),
            "--etcd-owner-id".to_owned(),
            id.to_owned(),
            "--event-trace".to_owned(),
            self.trace_path(id).display().to_string(),
        ];
        // The replicas started here name etcd in the URL form of --store
        // (`d1` uses --store etcd with --etcd-endpoints).
        let mut given = self.driver_args.iter().cloned();
        while let Some(a) = given.next() {
            match a.as_str() {
                "--store" => {
                    given.next();
                    args.push(a);
                    args.push(format!("etcd://{}", self.etcd.endpoint));
                }
                "--etcd-endpoints" => {
                    given.next();
                }
                _ => args.push(a),
            }
        }
        (dir, args)
    }

    /// Starts replicas `ids` at once.
    async fn add(&mut self, ids: &[&str]) {
        let starts: Vec<_> = ids
            .iter()
            .map(|id| {
                let (dir, args) = self.replica_args(id);
                tokio::spawn(async move {
                    Service::start_with_env("driver-svc", &dir, "127.0.0.1:0", &args, &[])
                        .await
                        .unwrap()
                })
            })
            .collect();
        for (id, s) in ids.iter().zip(starts) {
            self.extra.push(((*id).to_owned(), s.await.unwrap()));
        }
    }

    /// Starts replica `id` on `host`, reaching etcd, the decider and the
    /// executor over the host's link, so that it can be cut off from one
    /// of them alone. Its address is its end of the link.
    async fn add_on_host(&mut self, id: &str, host: &Host) {
        let (dir, mut args) = self.replica_args(id);
        let near = |port: u16| format!("{}:{port}", host.near);
        for i in 0..args.len().saturating_sub(1) {
            let value = match args[i].as_str() {
                "--decider" => format!("http://{}", near(self.cluster.decider.addr.port())),
                "--executor" => format!("http://{}", near(self.cluster.executor.addr.port())),
                "--store" => format!("etcd://{}", near(self.etcd.port())),
                _ => continue,
            };
            args[i + 1] = value;
        }
        let mut service =
            Service::start_wrapped("driver-svc", &dir, "0.0.0.0:0", &args, &[], &host.wrapper())
                .await
                .unwrap();
        service.addr = std::net::SocketAddr::new(host.far.parse().unwrap(), service.addr.port());
        self.extra.push((id.to_owned(), service));
    }

    fn replica(&mut self, id: &str) -> &mut Service {
        if id == "d1" {
            return &mut self.cluster.driver;
        }
        &mut self
            .extra
            .iter_mut()
            .find(|(i, _)| i == id)
            .unwrap_or_else(|| panic!("no replica {id}"))
            .1
    }

    async fn client_of(&mut self, id: &str) -> ProvisioningClient<Channel> {
        ProvisioningClient::new(self.replica(id).channel(None).await.unwrap())
    }

    fn dump_logs(&self) {
        self.cluster.dump_logs();
        for (id, s) in &self.extra {
            if let Ok(log) = std::fs::read_to_string(s.log_file()) {
                eprintln!("----- {id} (last lines) -----");
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                for l in tail.iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
    }

    /// Applies through replica `via`; returns the run uid.
    async fn apply(&mut self, via: &str, s: &ClusterShape) -> Result<String, tonic::Status> {
        let mut c = self.client_of(via).await;
        c.apply(pb::ApplyRequest {
            shape: Some(pb::ClusterShape::from(s)),
        })
        .await
        .map(|r| r.into_inner().run_uid)
    }

    /// Waits until replica `via` has the run mid-convergence: its nodes
    /// recorded and bootstrapping, none ready yet.
    async fn mid_convergence(&mut self, via: &str) -> pb::RunStatus {
        // Some nodes held, not all ready. (Not "operations pending": those
        // are there only while leases are made, a window a watch sampled at
        // most every 100 ms can miss entirely, and then waits out its
        // timeout on a run that converged.)
        self.until(via, |s| {
            !s.converged && s.node_count > 0 && s.ready_count < s.node_count
        })
        .await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        let mut c = self.client_of(via).await;
        let s = get_run(&mut c).await.unwrap();
        assert!(!s.converged, "the run converged before the replica went");
        s
    }

    /// Waits until the run's owner is one of `candidates`; returns it and how
    /// long that took.
    async fn new_owner(
        &self,
        etcd: &mut etcd_client::Client,
        uid: &str,
        candidates: &[&str],
    ) -> (String, Duration) {
        let t = Instant::now();
        loop {
            if let Some(o) = owner(etcd, uid).await
                && candidates.contains(&o.as_str())
            {
                return (o, t.elapsed());
            }
            if t.elapsed() > Duration::from_secs(30) {
                self.dump_logs();
                panic!("no replica took the run over");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Follows the run on replica `via` until `done`.
    async fn until(&mut self, via: &str, done: impl FnMut(&pb::RunStatus) -> bool) -> pb::RunStatus {
        let mut c = self.client_of(via).await;
        match watch_until(&mut c, RUN, CONVERGE, done).await {
            Ok(s) => s,
            Err(e) => {
                self.dump_logs();
                panic!("{e}");
            }
        }
    }

    /// Deletes the run through `via` and waits until it and its agents are
    /// gone.
    async fn delete_and_clean(&mut self, via: &str) {
        let mut c = self.client_of(via).await;
        c.delete_run(pb::DeleteRunRequest { run_id: RUN.into() })
            .await
            .unwrap();
        let t = Instant::now();
        loop {
            let gone = matches!(
                get_run(&mut c).await,
                Err(s) if s.code() == Code::NotFound
            );
            if gone && live_agent_pids(&self.agents.root).is_empty() {
                break;
            }
            if t.elapsed() > CONVERGE {
                self.dump_logs();
                panic!("the run or its agents outlived its deletion");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Checks the executor's trace: every operation of the run it started
    /// carried an epoch at least that of the newest claim it had accepted
    /// for the run by then, and every operation it received with an older
    /// epoch was rejected as fenced. Returns the accepted claims' epochs (in
    /// order) and the fenced rejections counted.
    fn check_executor_fencing(&self, uid: &str) -> (Vec<u64>, usize) {
        let lines = read_trace(&self.trace_path("executor"));
        let mut newest = 0u64;
        let mut claims = Vec::new();
        let mut stale_received: BTreeSet<String> = BTreeSet::new();
        let mut fenced: BTreeSet<String> = BTreeSet::new();
        for l in &lines {
            match &l.event {
                TraceEvent::ClaimReceived {
                    run,
                    epoch,
                    accepted: true,
                    ..
                } if run == uid => {
                    if *epoch > newest {
                        claims.push(*epoch);
                    }
                    newest = newest.max(*epoch);
                }
                TraceEvent::OpReceived { op, .. } if op.run == uid && op.epoch < newest => {
                    stale_received.insert(op.id.clone());
                }
                TraceEvent::CallStarted { op } if op.run == uid => assert!(
                    op.epoch >= newest,
                    "the executor started {} at epoch {} after accepting epoch {newest}",
                    op.id,
                    op.epoch
                ),
                TraceEvent::RejectionOut { rejection }
                    if rejection.run == uid && rejection.reason == "fenced" =>
                {
                    if let Some(id) = &rejection.id {
                        fenced.insert(id.clone());
                    }
                }
                _ => {}
            }
        }
        let unfenced: Vec<&String> = stale_received.difference(&fenced).collect();
        assert!(
            unfenced.is_empty(),
            "operations with an old epoch not rejected: {unfenced:?}"
        );
        (claims, fenced.len())
    }
}

/// Revisions of the run's writer key, by writer.
fn writes_by(history: &[(i64, Option<String>)], who: &str) -> Vec<i64> {
    history
        .iter()
        .filter(|(_, w)| w.as_deref() == Some(who))
        .map(|(r, _)| *r)
        .collect()
}

/// The revision at which `who` took the run (its ownership key put), after
/// revision `after`.
fn claimed_at(owners: &[(i64, Option<String>)], who: &str, after: i64) -> i64 {
    owners
        .iter()
        .find(|(r, o)| *r > after && o.as_deref() == Some(who))
        .map(|(r, _)| *r)
        .unwrap_or_else(|| panic!("{who} never took the run after revision {after}: {owners:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_is_killed_mid_convergence_and_another_replica_takes_over() {
    let mut r = Replicated::start().await;
    let sampler = Sampler::start(&r.agents.root);
    r.add(&["d2", "d3"]).await;
    let mut etcd = r.etcd.client().await.unwrap();

    let uid = r.apply("d1", &workers(1, 8)).await.unwrap();
    assert_eq!(owner(&mut etcd, &uid).await.as_deref(), Some("d1"));
    // Mid-convergence: some agents are up, not all.
    let before = r.mid_convergence("d1").await;
    r.cluster.driver.kill().await.unwrap();
    let (taker, failover) = r.new_owner(&mut etcd, &uid, &["d2", "d3"]).await;
    println!(
        "failover: {taker} owned the run {} ms after its owner was killed (lease {LEASE_TTL_S} s)",
        failover.as_millis()
    );

    // Either survivor serves the run: the other answers with the owner's
    // address and changes nothing.
    let other = if taker == "d2" { "d3" } else { "d2" };
    let mut c = r.client_of(other).await;
    let refused = c
        .apply(pb::ApplyRequest {
            shape: Some(pb::ClusterShape::from(&workers(2, 6))),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused}");
    let taker_addr = r.replica(&taker).addr.to_string();
    assert_eq!(
        refused
            .metadata()
            .get("provisioning-owner-address")
            .and_then(|v| v.to_str().ok()),
        Some(taker_addr.as_str()),
        "{refused}"
    );

    // Listing on either survivor shows the run, and who serves it.
    let listed = c
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert!(listed[0].from_store && listed[0].served_by == taker, "{listed:?}");
    assert_eq!(listed[0].served_at, taker_addr);
    assert_eq!(listed[0].run_uid, uid);
    assert_eq!(listed[0].node_count, 8, "{listed:?}");
    let mut on_taker = r.client_of(&taker).await;
    let listed = on_taker
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert!(listed.len() == 1 && !listed[0].from_store, "{listed:?}");

    // provisionctl, pointed at the replica that does not serve the run,
    // follows it to the one that does.
    let other_addr = r.replica(other).addr.to_string();
    let ctl = Command::new(bin_path("provisionctl").unwrap())
        .args(["--server", &other_addr, "--insecure", "get", RUN, "-o", "json"])
        .env_remove("PROVISIONCTL_SERVER")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&ctl.stdout);
    assert!(
        ctl.status.success() && out.contains(&uid),
        "provisionctl get through {other}: {out} {}",
        String::from_utf8_lossy(&ctl.stderr)
    );

    let after = r.until(&taker, |s| s.converged && s.generation == 1).await;
    assert!(
        after.epoch > before.epoch,
        "the run went on under epoch {} after {}",
        after.epoch,
        before.epoch
    );
    assert_eq!(after.ready_count, 8);
    assert_eq!(live_agent_pids(&r.agents.root).len(), 8);
    let scraped = r.replica(&taker).scrape().await.unwrap();
    assert!(
        scraped.contains("provisioning_run_takeovers_total 1"),
        "{}",
        scraped
            .lines()
            .filter(|l| l.contains("takeovers"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // The old owner's epoch is dead at the executor: a link that claims it
    // and submits a fresh operation under it (as a d1 that never noticed
    // would) gets both refused as fenced, and nothing starts.
    let stale = r.replay_as_old_owner(&uid, before.epoch).await;

    // A change through the new owner converges too.
    r.apply(&taker, &workers(2, 6)).await.unwrap();
    r.until(&taker, |s| s.converged && s.generation == 2).await;
    assert_eq!(live_agent_pids(&r.agents.root).len(), 6);
    // The run's event log, written by both owners, says it was taken over.
    let log = run_events(&mut r.client_of(&taker).await, RUN).await.unwrap();
    let reasons: Vec<&str> = log.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(reasons.first(), Some(&"Applied"), "{reasons:?}");
    assert_eq!(
        reasons.iter().filter(|r| **r == "TakenOver").count(),
        1,
        "{reasons:?}"
    );
    r.delete_and_clean(&taker).await;
    let samples = sampler.finish();

    // Order, by etcd revisions: d1's writes, then its ownership key went
    // with its lease, then the taker's claim, then only the taker's writes.
    let owners = history(&mut etcd, &format!("{PREFIX}owners/{uid}")).await;
    let writers = history(&mut etcd, &format!("{PREFIX}runs/{uid}/writer")).await;
    let released = owners
        .iter()
        .find(|(_, o)| o.is_none())
        .map(|(r, _)| *r)
        .expect("d1's ownership key never went");
    let taken = claimed_at(&owners, &taker, released);
    let d1_writes = writes_by(&writers, "d1");
    let taker_writes = writes_by(&writers, &taker);
    assert!(!d1_writes.is_empty() && !taker_writes.is_empty());
    assert!(d1_writes.iter().all(|w| *w < released), "{writers:?} {owners:?}");
    assert!(taker_writes.iter().all(|w| *w > taken), "{writers:?} {owners:?}");
    assert!(writes_by(&writers, other).is_empty(), "{other} wrote the run");
    assert_eq!(
        owners.iter().filter(|(_, o)| o.is_some()).count(),
        2,
        "one claim in etcd per owner: {owners:?}"
    );
    let (claims, fenced) = r.check_executor_fencing(&uid);
    assert!(claims.len() >= 2, "claims accepted at the executor: {claims:?}");
    assert!(fenced >= 1, "the stale operation was not counted as fenced");
    let started_stale = read_trace(&r.trace_path("executor"))
        .into_iter()
        .any(|l| matches!(&l.event, TraceEvent::CallStarted { op } if op.run == uid && op.id == stale));
    assert!(
        !started_stale,
        "the executor started {stale} under a fenced epoch"
    );
    println!(
        "order: d1 wrote revisions {}..={}, its key went at {released}, {taker} claimed at {taken} and \
         wrote {}..={}; executor epochs {claims:?}, {fenced} operations fenced; {samples} process-table samples",
        d1_writes[0],
        d1_writes[d1_writes.len() - 1],
        taker_writes[0],
        taker_writes[taker_writes.len() - 1],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_resumed_after_a_takeover_writes_and_dispatches_nothing() {
    let mut r = Replicated::start().await;
    let sampler = Sampler::start(&r.agents.root);
    r.add(&["d2"]).await;
    let mut etcd = r.etcd.client().await.unwrap();

    let uid = r.apply("d1", &workers(1, 8)).await.unwrap();
    r.mid_convergence("d1").await;
    let pid = r.cluster.driver.pid().unwrap();
    signal("STOP", pid);
    let (_, failover) = r.new_owner(&mut etcd, &uid, &["d2"]).await;
    println!(
        "failover: d2 owned the run {} ms after its owner was paused (lease {LEASE_TTL_S} s)",
        failover.as_millis()
    );
    // The new owner makes progress before the old one comes back.
    let mut c = r.client_of("d2").await;
    let at_takeover = get_run(&mut c).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let resumed_at = now_us();
    signal("CONT", pid);

    // The old owner finds its lease gone by its own clock: it stops its
    // runs and exits for its supervisor to start it afresh.
    let exited = r
        .cluster
        .driver
        .wait_exit(Duration::from_secs(20))
        .await
        .unwrap()
        .expect("the resumed replica kept running without its lease");
    assert!(!exited.success(), "{exited}");
    let log = std::fs::read_to_string(r.cluster.driver.log_file()).unwrap();
    assert!(log.contains("lost its etcd lease"), "{log}");

    let done = r.until("d2", |s| s.converged && s.generation == 1).await;
    assert!(done.epoch > at_takeover.epoch.min(done.epoch - 1));
    assert_eq!(live_agent_pids(&r.agents.root).len(), 8);

    // After resuming, d1 dispatched nothing and claimed nothing for the run
    // (its trace), and began no write: at most one commit it had sent
    // before it was paused completes after (its write landed before the
    // takeover, which etcd's history below shows), ...
    let d1: Vec<TraceLine> = read_trace(&r.trace_path("d1"))
        .into_iter()
        .filter(|l| l.t_us >= resumed_at)
        .collect();
    let commits = d1
        .iter()
        .filter(|l| matches!(l.event, TraceEvent::Committed { .. }))
        .count();
    assert!(
        commits <= 1,
        "d1 committed {commits} times after it was resumed: {d1:?}"
    );
    for l in &d1 {
        match &l.event {
            TraceEvent::Claim { .. } => panic!("d1 claimed after it was resumed: {l:?}"),
            TraceEvent::Dispatched { sent: true, .. } => {
                panic!("d1 dispatched after it was resumed: {l:?}")
            }
            _ => {}
        }
    }
    // ... etcd took no write of it after d2's claim, and the executor
    // started nothing under d1's epoch after d2's claim.
    let owners = history(&mut etcd, &format!("{PREFIX}owners/{uid}")).await;
    let writers = history(&mut etcd, &format!("{PREFIX}runs/{uid}/writer")).await;
    let taken = claimed_at(&owners, "d2", 0);
    assert!(
        writes_by(&writers, "d1").iter().all(|w| *w < taken),
        "{writers:?} {owners:?}"
    );
    let (claims, fenced) = r.check_executor_fencing(&uid);
    assert!(claims.len() >= 2, "claims accepted at the executor: {claims:?}");
    r.delete_and_clean("d2").await;
    let samples = sampler.finish();
    println!(
        "partition: d2 claimed at revision {taken}; d1 wrote nothing after; executor epochs {claims:?}, \
         {fenced} operations fenced; {} trace lines from d1 after resuming; {samples} samples",
        d1.len()
    );
}

/// The run's owner, on a private test host, is cut off from etcd by a real
/// partition (the kernel loses its packets to etcd, `directions` of them)
/// mid-convergence, while it still reaches the decider and the executor.
/// Another replica takes the run over once the owner's lease lapses; the
/// cut-off owner, finding its lease gone by its own clock, stops and exits.
/// etcd takes no write of it after the takeover, the executor starts
/// nothing under its epoch after the new claim, no slot ever has two live
/// agents, and the run converges under the new owner.
async fn owner_partitioned_from_etcd(directions: &[Direction]) {
    let mut r = Replicated::start_reachable().await;
    let sampler = Sampler::start(&r.agents.root);
    let host = Host::create().unwrap();
    r.add_on_host("p1", &host).await;
    let mut etcd = r.etcd.client().await.unwrap();

    let uid = r.apply("p1", &workers(1, 8)).await.unwrap();
    assert_eq!(owner(&mut etcd, &uid).await.as_deref(), Some("p1"));
    r.mid_convergence("p1").await;
    let cut_at = now_us();
    for d in directions {
        host.drop_port(r.etcd.port(), *d, true).unwrap();
    }
    // The owner still reaches the rest: its API answers from the host.
    let mut c = r.client_of("p1").await;
    get_run(&mut c).await.unwrap();

    let (_, failover) = r.new_owner(&mut etcd, &uid, &["d1"]).await;
    let done = r.until("d1", |s| s.converged && s.generation == 1).await;
    assert_eq!(done.ready_count, 8);
    assert_eq!(live_agent_pids(&r.agents.root).len(), 8);

    // The cut-off owner gave up the run by its own clock, and exited for
    // its supervisor to start it afresh.
    let p1 = r.replica("p1");
    let exited = p1
        .wait_exit(Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the replica cut off from etcd kept running");
    assert!(!exited.success(), "{exited}");
    let log = std::fs::read_to_string(p1.log_file()).unwrap();
    assert!(log.contains("lost its etcd lease"), "{log}");
    for d in directions {
        host.drop_port(r.etcd.port(), *d, false).unwrap();
    }

    // Order from etcd's history: nothing of p1's was written after d1 took
    // the run; and from the executor's trace: nothing started under p1's
    // epoch after d1's claim.
    let owners = history(&mut etcd, &format!("{PREFIX}owners/{uid}")).await;
    let writers = history(&mut etcd, &format!("{PREFIX}runs/{uid}/writer")).await;
    let taken = claimed_at(&owners, "d1", 0);
    assert!(
        writes_by(&writers, "p1").iter().all(|w| *w < taken),
        "{writers:?} {owners:?}"
    );
    let (claims, fenced) = r.check_executor_fencing(&uid);
    assert!(claims.len() >= 2, "claims accepted at the executor: {claims:?}");
    // And from p1's own trace: no operation sent once the cut was a second
    // old (one recorded just before it may still go out: its record is in
    // etcd; none recorded after it can be).
    let sent_after: Vec<TraceLine> = read_trace(&r.trace_path("p1"))
        .into_iter()
        .filter(|l| {
            l.t_us >= cut_at + 1_000_000 && matches!(l.event, TraceEvent::Dispatched { sent: true, .. })
        })
        .collect();
    assert!(
        sent_after.is_empty(),
        "p1 dispatched while cut off: {sent_after:?}"
    );
    r.delete_and_clean("d1").await;
    let samples = sampler.finish();
    println!(
        "etcd partition ({directions:?}): d1 owned the run {} ms after the cut (lease {LEASE_TTL_S} s), \
         claimed at revision {taken}; p1 wrote nothing after; executor epochs {claims:?}, \
         {fenced} operations fenced; {samples} samples",
        failover.as_millis()
    );
    drop(r);
    drop(host);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_partitioned_from_etcd_both_ways_hands_over_and_writes_nothing() {
    owner_partitioned_from_etcd(&[Direction::Out, Direction::In]).await;
}

/// The asymmetric case: what the owner sends reaches etcd, but nothing
/// etcd answers comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_hears_nothing_from_etcd_hands_over_and_writes_nothing() {
    owner_partitioned_from_etcd(&[Direction::In]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_racing_for_a_run_never_both_write_it() {
    let mut r = Replicated::start().await;
    let sampler = Sampler::start(&r.agents.root);
    let mut etcd = r.etcd.client().await.unwrap();
    let uid = r.apply("d1", &workers(1, 6)).await.unwrap();
    r.mid_convergence("d1").await;
    let mut owner_now = "d1".to_owned();
    let mut released_at = Vec::new();
    // Three rounds: the owner is killed, its lease runs out, and two new
    // replicas start at the same moment; each finds the run unowned.
    for round in 0..3 {
        let pair = [format!("r{round}a"), format!("r{round}b")];
        r.replica(&owner_now).kill().await.unwrap();
        let t = Instant::now();
        while owner(&mut etcd, &uid).await.is_some() {
            assert!(t.elapsed() < Duration::from_secs(30), "the lease never ran out");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let head = etcd.get("x", None).await.unwrap().header().unwrap().revision();
        released_at.push(head);
        let ids: Vec<&str> = pair.iter().map(String::as_str).collect();
        r.add(&ids).await;
        let (taker, _) = r.new_owner(&mut etcd, &uid, &ids).await;
        let loser = ids.iter().find(|i| **i != taker).unwrap().to_string();
        // The loser serves the run by pointing at the taker.
        let mut c = r.client_of(&loser).await;
        let s = get_run(&mut c).await.unwrap_err();
        assert_eq!(s.code(), Code::FailedPrecondition, "{s}");
        // Only the next round's pair may race for the run.
        r.replica(&loser).kill().await.unwrap();
        // The taker carries on, and takes a change, before the next round.
        let generation = round + 2;
        r.apply(&taker, &workers(generation, 6 - u32::try_from(round).unwrap()))
            .await
            .unwrap();
        r.until(&taker, |s| s.converged && s.generation == generation)
            .await;
        owner_now = taker;
    }
    r.delete_and_clean(&owner_now).await;
    let samples = sampler.finish();

    // Between two releases, exactly one replica claimed the run and only it
    // wrote; the loser of each round never wrote it nor claimed it at the
    // executor.
    let owners = history(&mut etcd, &format!("{PREFIX}owners/{uid}")).await;
    let writers = history(&mut etcd, &format!("{PREFIX}runs/{uid}/writer")).await;
    for (i, from) in released_at.iter().enumerate() {
        let until = released_at.get(i + 1).copied().unwrap_or(i64::MAX);
        let claims: BTreeSet<&str> = owners
            .iter()
            .filter(|(r, o)| *r > *from && *r < until && o.is_some())
            .filter_map(|(_, o)| o.as_deref())
            .collect();
        let wrote: BTreeSet<&str> = writers
            .iter()
            .filter(|(r, _)| *r > *from && *r < until)
            .filter_map(|(_, w)| w.as_deref())
            .collect();
        assert_eq!(
            claims.len(),
            1,
            "round {i}: claimed by {claims:?}; owners {owners:?}; writers {writers:?}; released {released_at:?}"
        );
        assert!(
            wrote.is_subset(&claims),
            "round {i}: written by {wrote:?}, claimed by {claims:?}"
        );
        let loser = (0..2)
            .map(|k| format!("r{i}{}", ['a', 'b'][k]))
            .find(|id| !claims.contains(id.as_str()))
            .unwrap();
        let started = read_trace(&r.trace_path(&loser))
            .into_iter()
            .any(|l| matches!(l.event, TraceEvent::Claim { .. } | TraceEvent::Committed { .. }));
        assert!(!started, "round {i}: {loser} claimed or wrote the run");
    }
    assert_eq!(
        owners.iter().filter(|(_, o)| o.is_some()).count(),
        4,
        "one claim in etcd per owner: {owners:?}"
    );
    let (claims, fenced) = r.check_executor_fencing(&uid);
    assert_eq!(claims.len(), 4, "one executor claim per owner: {claims:?}");
    println!(
        "race: owners {owners:?}; executor epochs {claims:?}; {fenced} operations fenced; {samples} samples"
    );
}

/// etcd stalls (SIGSTOP) mid-convergence for longer than a request may
/// take and shorter than the lease: an apply's write fails, the run halts
/// and the apply is refused as unavailable, changing nothing. Once etcd
/// answers again the owner reloads the run from the store under a new epoch
/// (claimed at the executor like any new epoch), without exiting and
/// without losing the run; the apply, retried, is accepted, and the run
/// converges to it with one agent per slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_stalls_and_the_owner_reloads_the_run() {
    let mut r = Replicated::start_with_lease("60").await;
    let sampler = Sampler::start(&r.agents.root);
    let mut etcd = r.etcd.client().await.unwrap();
    let uid = r.apply("d1", &workers(1, 3)).await.unwrap();
    r.mid_convergence("d1").await;
    // A watch opened before the stall follows the run across its reload.
    let mut watched = r
        .client_of("d1")
        .await
        .watch_run(pb::WatchRunRequest {
            run_id: RUN.into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();

    signal("STOP", r.etcd.pid());
    let stalled = Instant::now();
    let refused = r.apply("d1", &workers(2, 2)).await.unwrap_err();
    let refused_after = stalled.elapsed();
    // Longer than a request may take, so the reload's first tries fail too.
    tokio::time::sleep(Duration::from_secs(7).saturating_sub(refused_after)).await;
    signal("CONT", r.etcd.pid());
    assert_eq!(refused.code(), Code::Unavailable, "{refused}");
    assert!(refused.message().contains("halted"), "{refused}");

    // The client retries, as told, until the reloaded run takes the apply.
    let t = Instant::now();
    let accepted_after = loop {
        match r.apply("d1", &workers(2, 2)).await {
            Ok(again) => {
                assert_eq!(again, uid, "the run is the same run");
                break t.elapsed();
            }
            Err(s) if s.code() == Code::Unavailable && t.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => {
                r.dump_logs();
                panic!("the run was not reloaded: {s}");
            }
        }
    };
    let done = r.until("d1", |s| s.converged && s.generation == 2).await;
    assert_eq!(done.ready_count, 2);
    let followed = read_watch(&mut watched, |s| s.converged && s.generation == 2).await;
    assert_eq!(followed.ready_count, 2);
    assert!(r.cluster.driver.is_running(), "d1 exited");
    let scraped = r.replica("d1").scrape().await.unwrap();
    assert!(
        scraped.contains("provisioning_run_reloads_total 1"),
        "{}",
        scraped
            .lines()
            .filter(|l| l.contains("reloads"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(owner(&mut etcd, &uid).await.as_deref(), Some("d1"));
    let log = std::fs::read_to_string(r.cluster.driver.log_file()).unwrap();
    assert!(log.contains("run halted"), "{log}");
    assert!(
        log.contains("run reloaded from the store after a failed write"),
        "{log}"
    );
    r.delete_and_clean("d1").await;
    let samples = sampler.finish();
    // The reload took a new epoch and claimed it at the executor.
    let (claims, fenced) = r.check_executor_fencing(&uid);
    assert!(claims.len() >= 2, "no new epoch after the reload: {claims:?}");
    assert!(claims.windows(2).all(|w| w[0] < w[1]), "{claims:?}");
    println!(
        "store stall: apply refused after {refused_after:?}; accepted again {accepted_after:?} after etcd \
         resumed; executor epochs {claims:?}, {fenced} operations fenced; {samples} samples"
    );
}

/// The run's status (without nodes) from the replica `c` is connected to.
async fn get_run<T>(c: &mut ProvisioningClient<T>) -> Result<pb::RunStatus, tonic::Status>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    c.get_run(pb::GetRunRequest {
        run_id: RUN.into(),
        include_nodes: false,
    })
    .await
    .map(tonic::Response::into_inner)
}

/// Reads an open watch until `done`, within [`CONVERGE`]; the watch must not
/// end before.
async fn read_watch(
    watched: &mut tonic::Streaming<pb::RunStatus>,
    done: impl Fn(&pb::RunStatus) -> bool,
) -> pb::RunStatus {
    procs::read_watch(watched, CONVERGE, done).await.unwrap()
}

fn signal(sig: &str, pid: u32) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_on_purpose_hands_its_runs_over_at_once() {
    // Leases far longer than the test waits: the run can move only because
    // its owner gave it up.
    let mut r = Replicated::start_with_lease("120").await;
    let sampler = Sampler::start(&r.agents.root);
    r.add(&["d2"]).await;
    let mut etcd = r.etcd.client().await.unwrap();
    let uid = r.apply("d1", &workers(1, 4)).await.unwrap();
    let before = r.mid_convergence("d1").await;
    let stopped = r.cluster.driver.terminate().await.unwrap();
    assert!(stopped.success(), "{stopped}");
    let log = std::fs::read_to_string(r.cluster.driver.log_file()).unwrap();
    assert!(log.contains("resigned"), "{log}");
    let (_, moved) = r.new_owner(&mut etcd, &uid, &["d2"]).await;
    println!(
        "resignation: d2 owned the run {} ms after d1 was told to stop (leases of 120 s)",
        moved.as_millis()
    );
    let after = r.until("d2", |s| s.converged && s.generation == 1).await;
    assert!(after.epoch > before.epoch);
    assert_eq!(live_agent_pids(&r.agents.root).len(), 4);
    r.delete_and_clean("d2").await;
    sampler.finish();
    let (claims, _) = r.check_executor_fencing(&uid);
    assert_eq!(claims.len(), 2, "{claims:?}");
}

/// The replicated driver manifest: its path, its documents, and its driver
/// container's arguments and environment (the variables set by value).
struct ReplicatedManifest {
    path: PathBuf,
    docs: Vec<serde_yaml_ng::Value>,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

/// A file of deploy/k8s-replicated/: its path and its documents.
fn replicated_docs(file: &str) -> (PathBuf, Vec<serde_yaml_ng::Value>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/k8s-replicated")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    let docs = text
        .split("\n---\n")
        .map(|d| serde_yaml_ng::from_str(d).unwrap())
        .collect();
    (path, docs)
}

fn kind_of(d: &serde_yaml_ng::Value) -> &str {
    d["kind"].as_str().unwrap_or_default()
}

/// The element of a manifest's list (containers, volumes, mounts) with this
/// `name`.
fn named<'a>(list: &'a serde_yaml_ng::Value, name: &str) -> &'a serde_yaml_ng::Value {
    list.as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {name} in {list:?}"))
}

fn strings(v: &serde_yaml_ng::Value) -> Vec<String> {
    v.as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

/// kubernetes-validate on a manifest; a developer's machine without it only
/// says so, CI must have it.
fn validate_schema(path: &Path) {
    let tool = "kubernetes-validate";
    match Command::new(tool).arg("--version").output() {
        Ok(_) => {
            let out = Command::new(tool)
                .args(["--strict", "--quiet", "--kubernetes-version", "1.33.0"])
                .arg(path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{tool} {}: {}{}",
                path.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Err(e) => {
            assert!(std::env::var("CI").is_err(), "{tool} is not on PATH in CI: {e}");
            println!("{tool} not installed ({e}); the schema check did not run");
        }
    }
}

fn replicated_manifest() -> ReplicatedManifest {
    let (path, docs) = replicated_docs("40-driver.yaml");
    let set = docs
        .iter()
        .find(|d| d["kind"].as_str() == Some("StatefulSet"))
        .expect("a StatefulSet");
    let container = named(&set["spec"]["template"]["spec"]["containers"], "driver");
    let args = strings(&container["args"]);
    let env = container["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?.to_owned(), e["value"].as_str()?.to_owned())))
        .collect();
    ReplicatedManifest {
        path,
        docs,
        args,
        env,
    }
}

/// deploy/k8s-replicated/40-driver.yaml against the driver built with the etcd
/// store and against the Kubernetes schema: every flag its container passes
/// and every variable it sets is one the binary takes, it runs replicas on
/// etcd with an owner id and an advertised address per pod, and it keeps
/// two up through disruptions. (The replicas' behaviour under those
/// settings is what the tests above exercise.)
#[test]
fn the_replicated_manifest_matches_the_binary_and_the_schema() {
    require_etcd_driver();
    let ReplicatedManifest {
        path,
        docs,
        args,
        env,
    } = replicated_manifest();
    let kind = |d: &serde_yaml_ng::Value| d["kind"].as_str().unwrap_or_default().to_owned();
    let set = docs
        .iter()
        .find(|d| kind(d) == "StatefulSet")
        .expect("a StatefulSet");
    assert!(set["spec"]["replicas"].as_u64().unwrap() >= 3);
    let pdb = docs
        .iter()
        .find(|d| kind(d) == "PodDisruptionBudget")
        .expect("a PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"].as_u64(), Some(2));
    let headless = docs
        .iter()
        .find(|d| kind(d) == "Service" && d["spec"]["clusterIP"].as_str() == Some("None"))
        .expect("a headless Service");
    assert_eq!(set["spec"]["serviceName"], headless["metadata"]["name"]);
    let help = Command::new(bin_path("driver-svc").unwrap())
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    for flag in args.iter().filter(|a| a.starts_with("--")) {
        assert!(
            help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
            "{flag} is not a driver flag"
        );
    }
    for (name, _) in &env {
        // POD_NAME only feeds the others; the SDK reads OTEL_*.
        if name == "POD_NAME" || name.starts_with("OTEL_") {
            continue;
        }
        assert!(
            help.contains(&format!("[env: {name}")),
            "{name} is not a driver variable"
        );
    }
    // On etcd, with a per-pod owner id and address, and no data volume.
    let store = args
        .iter()
        .position(|a| a == "--store")
        .and_then(|i| args.get(i + 1))
        .expect("--store");
    assert!(store.starts_with("etcd://"), "{store}");
    assert!(!args.iter().any(|a| a == "--data-dir"));
    let value = |name: &str| env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    assert_eq!(value("DRIVER_ETCD_OWNER_ID"), Some("$(POD_NAME)"));
    let advertised = value("DRIVER_ADVERTISE_ADDRESS").expect("an advertised address");
    let peers = headless["metadata"]["name"].as_str().unwrap();
    assert!(
        advertised.starts_with(&format!("$(POD_NAME).{peers}.")),
        "{advertised}"
    );
    // The certificates deploy/gen-secrets.sh issues name that address.
    let secrets_script =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/gen-secrets.sh"))
            .unwrap();
    assert!(
        secrets_script.contains(&format!("*.{peers}.$namespace.svc")),
        "gen-secrets.sh"
    );

    validate_schema(&path);
}

/// deploy/k8s-replicated/10-etcd.yaml: the members' addresses and the etcd
/// container's arguments.
struct EtcdManifest {
    path: PathBuf,
    docs: Vec<serde_yaml_ng::Value>,
    /// The StatefulSet's name: member `i` is the pod `<name>-<i>`.
    name: String,
    /// `<name>-<i>.<service>.<namespace>.svc`, for each member.
    hosts: Vec<String>,
    args: Vec<String>,
    /// The container's ports by name (`client`, `peer`, `metrics`).
    ports: BTreeMap<String, u16>,
    /// Where the `data` volume is mounted.
    data_mount: String,
    /// Where the `tls` volume (the CA, the members' certificate and key) is
    /// mounted, and the Secret it is.
    tls_mount: String,
    tls_secret: String,
    /// The probes' paths on the metrics port: readiness, liveness, startup.
    probe_paths: Vec<String>,
}

fn etcd_manifest() -> EtcdManifest {
    let (path, docs) = replicated_docs("10-etcd.yaml");
    let set = docs
        .iter()
        .find(|d| kind_of(d) == "StatefulSet")
        .expect("a StatefulSet");
    let name = set["metadata"]["name"].as_str().unwrap().to_owned();
    let namespace = set["metadata"]["namespace"].as_str().unwrap();
    let service = set["spec"]["serviceName"].as_str().unwrap();
    let members = set["spec"]["replicas"].as_u64().unwrap();
    let hosts = (0..members)
        .map(|i| format!("{name}-{i}.{service}.{namespace}.svc"))
        .collect();
    let container = named(&set["spec"]["template"]["spec"]["containers"], "etcd");
    assert_eq!(strings(&container["command"]), ["etcd"]);
    let ports = container["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                u16::try_from(p["containerPort"].as_u64().unwrap()).unwrap(),
            )
        })
        .collect();
    let text = |v: &serde_yaml_ng::Value| v.as_str().unwrap().to_owned();
    let data_mount = text(&named(&container["volumeMounts"], "data")["mountPath"]);
    let tls_mount = text(&named(&container["volumeMounts"], "tls")["mountPath"]);
    let tls_secret = text(&named(&set["spec"]["template"]["spec"]["volumes"], "tls")["secret"]["secretName"]);
    let probe_paths = ["readinessProbe", "livenessProbe", "startupProbe"]
        .iter()
        .map(|probe| {
            let get = &container[*probe]["httpGet"];
            assert_eq!(get["port"].as_str(), Some("metrics"), "{probe}");
            get["path"].as_str().unwrap().to_owned()
        })
        .collect();
    let args = strings(&container["args"]);
    EtcdManifest {
        path,
        docs,
        name,
        hosts,
        args,
        ports,
        data_mount,
        tls_mount,
        tls_secret,
        probe_paths,
    }
}

impl EtcdManifest {
    /// Member `i`'s arguments with its name filled in, its data directory
    /// under `data`, the files of its `tls` volume mapped by `tls` (file name
    /// → path), and every address mapped onto loopback: `lo[j]` holds
    /// member `j`'s client, peer and metrics ports.
    fn member_args(
        &self,
        i: usize,
        lo: &[[u16; 3]],
        data: &Path,
        tls: &BTreeMap<&str, PathBuf>,
    ) -> Vec<String> {
        let named = ["client", "peer", "metrics"].map(|p| self.ports[p]);
        let mut args = Vec::new();
        for arg in &self.args {
            let mut a = arg.replace("$(POD_NAME)", &format!("{}-{i}", self.name));
            for (j, host) in self.hosts.iter().enumerate() {
                for (k, port) in named.iter().enumerate() {
                    a = a.replace(&format!("{host}:{port}"), &format!("127.0.0.1:{}", lo[j][k]));
                }
            }
            for (k, port) in named.iter().enumerate() {
                a = a.replace(&format!("0.0.0.0:{port}"), &format!("127.0.0.1:{}", lo[i][k]));
            }
            if let Some(dir) = a.strip_prefix("--data-dir=") {
                let within = dir
                    .strip_prefix(&self.data_mount)
                    .expect("the data directory is on the data volume");
                a = format!(
                    "--data-dir={}",
                    data.join(format!("{}-{i}", self.name))
                        .join(within.trim_start_matches('/'))
                        .display()
                );
            }
            if let Some((flag, file)) = a.split_once(&format!("={}/", self.tls_mount)) {
                let path = tls
                    .get(file)
                    .unwrap_or_else(|| panic!("{file} is not in the tls volume"));
                a = format!("{flag}={}", path.display());
            }
            assert!(
                !a.contains(".svc") && !a.contains("0.0.0.0") && !a.contains("$(") && !a.contains("/etc/"),
                "an address, variable or path left unmapped: {a}"
            );
            args.push(a);
        }
        args
    }

    /// A value naming members as `host:port,...` (the driver's --store),
    /// mapped onto loopback as [`EtcdManifest::member_args`] maps them.
    fn map_endpoints(&self, value: &str, lo: &[[u16; 3]]) -> String {
        let client = self.ports["client"];
        value
            .split(',')
            .map(|member| {
                let j = self
                    .hosts
                    .iter()
                    .position(|h| member == format!("{h}:{client}"))
                    .unwrap_or_else(|| panic!("{member} is not an etcd member's client address"));
                format!("127.0.0.1:{}", lo[j][0])
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn free_port() -> u16 {
    etcd::free_port().unwrap()
}

/// deploy/k8s-replicated/10-etcd.yaml against the schema and the drivers'
/// manifest: the drivers' --store names every member at its client port, the
/// members find each other through a headless Service before they are
/// ready, a quorum stays through disruptions, the drivers (and the members
/// themselves) may reach the client port, and the data lives on a volume.
/// (Members started with its arguments are the next test's store.)
#[test]
fn the_etcd_manifest_serves_the_drivers_store() {
    let m = etcd_manifest();
    let ReplicatedManifest { args, .. } = replicated_manifest();
    let store = args
        .iter()
        .position(|a| a == "--store")
        .and_then(|i| args.get(i + 1))
        .expect("--store");
    let named: BTreeSet<&str> = store.strip_prefix("etcd://").unwrap().split(',').collect();
    let members: BTreeSet<String> = m
        .hosts
        .iter()
        .map(|h| format!("{h}:{}", m.ports["client"]))
        .collect();
    assert_eq!(
        named,
        members.iter().map(String::as_str).collect::<BTreeSet<_>>(),
        "the drivers' --store and the etcd members"
    );
    let set = m.docs.iter().find(|d| kind_of(d) == "StatefulSet").unwrap();
    let headless = m
        .docs
        .iter()
        .find(|d| kind_of(d) == "Service" && d["metadata"]["name"] == set["spec"]["serviceName"])
        .expect("the StatefulSet's Service");
    assert_eq!(headless["spec"]["clusterIP"].as_str(), Some("None"));
    assert_eq!(headless["spec"]["publishNotReadyAddresses"].as_bool(), Some(true));
    let pdb = m
        .docs
        .iter()
        .find(|d| kind_of(d) == "PodDisruptionBudget")
        .expect("a PodDisruptionBudget");
    let quorum = m.hosts.len() / 2 + 1;
    assert_eq!(pdb["spec"]["minAvailable"].as_u64(), Some(quorum as u64));
    let policy = m
        .docs
        .iter()
        .find(|d| kind_of(d) == "NetworkPolicy")
        .expect("a NetworkPolicy");
    let reaches = |from: &str, port: u16| {
        policy["spec"]["ingress"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|rule| {
                rule["from"].as_sequence().unwrap().iter().any(|f| {
                    f["podSelector"]["matchLabels"]["app.kubernetes.io/name"].as_str() == Some(from)
                        && f.get("namespaceSelector").is_none()
                }) && rule["ports"]
                    .as_sequence()
                    .unwrap()
                    .iter()
                    .any(|p| p["port"].as_u64() == Some(u64::from(port)))
            })
    };
    assert!(reaches("driver", m.ports["client"]));
    assert!(reaches("etcd", m.ports["peer"]));
    assert!(!reaches("driver", m.ports["peer"]));
    let data_dir = m
        .args
        .iter()
        .find_map(|a| a.strip_prefix("--data-dir="))
        .expect("--data-dir");
    assert!(data_dir.starts_with(&m.data_mount), "{data_dir}");
    assert!(
        m.args
            .iter()
            .any(|a| a.starts_with("--auto-compaction-retention="))
    );
    // TLS on both ports, a client certificate required of clients and
    // peers; the drivers present one and trust the same CA.
    for flag in [
        "--client-cert-auth=true".to_owned(),
        "--peer-client-cert-auth=true".to_owned(),
        format!("--trusted-ca-file={}/ca.pem", m.tls_mount),
        format!("--peer-trusted-ca-file={}/ca.pem", m.tls_mount),
    ] {
        assert!(m.args.contains(&flag), "{flag}");
    }
    assert!(
        !m.args.iter().any(|a| a.contains("-urls=")
            && !a.starts_with("--listen-metrics-urls=")
            && a.contains("http://")),
        "a client or peer URL without TLS: {:?}",
        m.args
    );
    for flag in ["--etcd-tls-ca", "--etcd-tls-cert", "--etcd-tls-key"] {
        assert!(args.iter().any(|a| a == flag), "the drivers' {flag}");
    }
    // deploy/gen-secrets.sh makes the members' Secret, with a certificate
    // for their names.
    let secrets_script =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/gen-secrets.sh"))
            .unwrap();
    assert!(
        secrets_script.contains(&format!("secret {} ", m.tls_secret)),
        "gen-secrets.sh makes no Secret {}",
        m.tls_secret
    );
    assert!(secrets_script.contains("--also etcd"), "gen-secrets.sh");
    let service = set["spec"]["serviceName"].as_str().unwrap();
    assert!(
        secrets_script.contains(&format!("*.{service}.$namespace.svc")),
        "gen-secrets.sh"
    );
    validate_schema(&m.path);
}

/// Three replicas started with exactly the driver container's arguments and
/// environment from deploy/k8s-replicated/40-driver.yaml, its paths mapped
/// onto the test's certificates, tokens and key, its addresses onto
/// loopback (the pod names kept as owner ids): each passes its health check,
/// a run applied through one is refused by another with the first one's
/// advertised address, and is served there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_started_from_the_manifest_share_a_run() {
    use provisioning_tests::auth::{Grant, Tokens};
    require_etcd_driver();
    let ReplicatedManifest { args, env, .. } = replicated_manifest();
    let m = etcd_manifest();

    // The decider and the executor with TLS; the cluster's own driver is
    // not one of the replicas.
    let cluster = Cluster::start(ClusterOptions::default().driver("--store", "memory"))
        .await
        .unwrap();
    let pki = cluster.tls.clone().unwrap();
    let work = tempfile::tempdir().unwrap();

    // The store: etcd members started with exactly 10-etcd.yaml's arguments,
    // with a certificate from the cluster's CA as the etcd-tls Secret's.
    let (etcd_cert, etcd_key) = pki
        .issue(
            "etcd",
            &platform::tls::dev::Leaf::service(
                "etcd",
                &["127.0.0.1".to_owned()],
                platform::tls::dev::Validity::days_from_now(1),
            ),
        )
        .unwrap();
    let tls_files = BTreeMap::from([
        ("ca.pem", pki.ca()),
        ("tls.pem", etcd_cert),
        ("tls.key", etcd_key),
    ]);
    // Ports are chosen free and bound by etcd a moment later: another
    // process may take one in between, and then the members start again on
    // others (each attempt in a data directory of its own).
    let mut attempt = 0;
    let (lo, mut members) = loop {
        attempt += 1;
        let lo: Vec<[u16; 3]> = m
            .hosts
            .iter()
            .map(|_| [free_port(), free_port(), free_port()])
            .collect();
        let data = work.path().join(format!("attempt-{attempt}"));
        std::fs::create_dir_all(&data).unwrap();
        let start = EtcdMembers::start(
            (0..m.hosts.len())
                .map(|i| {
                    (
                        m.member_args(i, &lo, &data, &tls_files),
                        format!("127.0.0.1:{}", lo[i][0]),
                    )
                })
                .collect(),
            &data,
        );
        match start {
            Ok(members) => break (lo, members),
            Err(MembersStart::PortTaken(e)) if attempt < 3 => eprintln!("{e:#}; again"),
            Err(MembersStart::PortTaken(e) | MembersStart::Failed(e)) => panic!("{e:#}"),
        }
    };
    // Each answers its probes as the kubelet would ask them, once the
    // members have formed the cluster.
    for (i, ports) in lo.iter().enumerate() {
        for path in &m.probe_paths {
            let addr = format!("127.0.0.1:{}", ports[2]);
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let answer = etcd::http_get(&addr, path);
                if let Ok((200, body)) = &answer
                    && body.contains(r#""health":"true""#)
                {
                    break;
                }
                assert!(Instant::now() < deadline, "member {i}, {path}: {answer:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // Over TLS, a client with a certificate from the CA is served; one
    // without a certificate is not.
    let (cert, cert_key) = pki.cert_and_key("driver-svc");
    let tls = |identity: bool| {
        let ca = tonic::transport::Certificate::from_pem(std::fs::read(pki.ca()).unwrap());
        let tls = etcd_client::TlsOptions::new().ca_certificate(ca);
        let tls = if identity {
            tls.identity(tonic::transport::Identity::from_pem(
                std::fs::read(&cert).unwrap(),
                std::fs::read(&cert_key).unwrap(),
            ))
        } else {
            tls
        };
        etcd_client::ConnectOptions::new()
            .with_tls(tls)
            .with_timeout(Duration::from_secs(5))
    };
    let mut admin = etcd_client::Client::connect(members.endpoints.clone(), Some(tls(true)))
        .await
        .unwrap();
    assert_eq!(
        admin.member_list().await.unwrap().members().len(),
        m.hosts.len(),
        "one cluster of every member"
    );
    let refused = match etcd_client::Client::connect(members.endpoints.clone(), Some(tls(false))).await {
        Ok(mut c) => c.member_list().await.map(|_| ()),
        Err(e) => Err(e),
    };
    assert!(refused.is_err(), "a client without a certificate was served");
    let tokens = Tokens::write(work.path(), &[Grant::write("admin")]).unwrap();
    let key = work.path().join("secrets.key");
    std::fs::write(&key, "ab".repeat(32)).unwrap();
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mapped_path = |p: &str| -> String {
        match p {
            "/etc/provisioning/tls/tls.pem" => cert.display().to_string(),
            "/etc/provisioning/tls/tls.key" => cert_key.display().to_string(),
            "/etc/provisioning/tls/ca.pem" => pki.ca().display().to_string(),
            "/etc/provisioning/tokens/tokens.yaml" => tokens.path.display().to_string(),
            "/run/provisioning/keys/secrets.key" => key.display().to_string(),
            other => other.to_owned(),
        }
    };
    let mut replicas = Vec::new();
    for i in 0..3 {
        let pod = format!("driver-{i}");
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut mapped = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let Some(v) = it.clone().next().filter(|_| a.starts_with("--")) else {
                mapped.push(a.clone());
                continue;
            };
            let v = match a.as_str() {
                // The harness gives --listen itself (and the ready file).
                "--listen" => {
                    it.next();
                    continue;
                }
                "--metrics-listen" => "127.0.0.1:0".to_owned(),
                "--decider" => cluster.decider.addr.to_string(),
                "--executor" => cluster.executor.addr.to_string(),
                "--store" => format!(
                    "etcd://{}",
                    m.map_endpoints(v.strip_prefix("etcd://").unwrap(), &lo)
                ),
                _ => mapped_path(v),
            };
            it.next();
            mapped.push(a.clone());
            mapped.push(v);
        }
        let vars: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| {
                let v = v.replace("$(POD_NAME)", &pod);
                let v = if k == "DRIVER_ADVERTISE_ADDRESS" {
                    listen.clone()
                } else {
                    v
                };
                (k.clone(), v)
            })
            .chain([("POD_NAME".to_owned(), pod.clone())])
            .collect();
        let dir = work.path().join(&pod);
        std::fs::create_dir_all(&dir).unwrap();
        let svc = Service::start_with_env("driver-svc", &dir, &listen, &mapped, &vars)
            .await
            .unwrap();
        replicas.push((pod, listen, svc));
    }

    let client = |addr: &str| {
        let endpoint = pki
            .transport(Some("provisionctl"))
            .unwrap()
            .endpoint(addr)
            .unwrap();
        let bearer = provisionctl::token::BearerToken::new(tokens.token("admin").unwrap()).unwrap();
        async move { ProvisioningClient::with_interceptor(endpoint.connect().await.unwrap(), bearer) }
    };
    for (pod, listen, _) in &replicas {
        let channel = pki
            .transport(Some("provisionctl"))
            .unwrap()
            .endpoint(listen)
            .unwrap()
            .connect()
            .await
            .unwrap();
        let status = tonic_health::pb::health_client::HealthClient::new(channel)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .unwrap()
            .into_inner()
            .status();
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving,
            "{pod}"
        );
    }
    let mut first = client(&replicas[0].1).await;
    first
        .apply(pb::ApplyRequest {
            shape: Some(pb::ClusterShape::from(&shape(
                RUN,
                1,
                "fake",
                &[("w", 2, "img:1")],
            ))),
        })
        .await
        .unwrap();
    let mut second = client(&replicas[1].1).await;
    let refused = get_run(&mut second).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused}");
    let owner = refused
        .metadata()
        .get("provisioning-owner-address")
        .and_then(|v| v.to_str().ok())
        .unwrap()
        .to_owned();
    assert_eq!(owner, replicas[0].1);
    assert!(refused.message().contains("driver-0"), "{refused}");
    let mut there = client(&owner).await;
    let mut watched = there
        .watch_run(pb::WatchRunRequest {
            run_id: RUN.into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    let converged = read_watch(&mut watched, |s| s.converged).await;
    assert_eq!(converged.ready_count, 2);

    // One member goes (a node lost, a pod evicted): two of three are a
    // quorum, and the replicas go on with the rest.
    members.kill(m.hosts.len() - 1).unwrap();
    let t = Instant::now();
    loop {
        let applied = there
            .apply(pb::ApplyRequest {
                shape: Some(pb::ClusterShape::from(&shape(
                    RUN,
                    2,
                    "fake",
                    &[("w", 3, "img:1")],
                ))),
            })
            .await;
        match applied {
            Ok(_) => break,
            // A write that went to the member as it died halts the run
            // until it is reloaded: a client retries what is unavailable.
            Err(s) if s.code() == Code::Unavailable && t.elapsed() < Duration::from_secs(30) => {
                println!("apply after the member went: {s}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(s) => panic!("{s}"),
        }
    }
    let scaled = read_watch(&mut watched, |s| s.converged && s.generation == 2).await;
    assert_eq!(scaled.ready_count, 3);
    for (pod, _, svc) in &mut replicas {
        assert!(svc.is_running(), "{pod} exited after an etcd member went");
    }
    let refused = get_run(&mut second).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused}");
}
