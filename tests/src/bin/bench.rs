//! `bench`: the benchmark table, side by side in one run.
//!
//! ```sh
//! cargo build --release --workspace --bins
//! target/release/bench                       # every row, sizes 1 to 100k
//! target/release/bench --sizes 1000,10000 --only decider,rpc
//! target/release/bench --only health --health-nodes 100000 --health-window-s 30
//! target/release/bench --sizes 100000 --only rollout   # not in the default set
//! target/release/bench --sizes 1000000 --only runs --runs 100
//! ```
//!
//! `rollout` changes every node's template in process (driver core, decider
//! library, executor core and fake provider) once with `max_surge: 10%` and
//! nothing taken down, and once with every node allowed down at once, and
//! reports each change's time and passes.
//!
//! Prints a table and writes it as CSV (`--csv`, default `target/bench.csv`).
//! Figures are wall-clock on the machine that runs it; ratios compare rows
//! measured in the same run.
//!
//! Rows: `decider` (the library's `decide`, per node), `rpc` (the `Decide`
//! RPC against the library, and its bytes per node each way), `rpc-parts`
//! (each step of a `Decide` call's conversions and
//! prost coding timed on its own in process, per node), `sweep` (the
//! driver's orphan sweep over an inventory of each size, every resource held
//! by its run, in process, per resource), `throughput` (executor round trips against a
//! bare streaming echo), `plugin` (round trips through a provider plugin,
//! `builtin-provider` supervised by the executor, against the same backend
//! built in: the fake at the throughput row's volume, and 200 process-backend
//! creates and destroys of real agents), `e2e` (convergence in one process and as three
//! processes, passes, driver memory) for each of `--sizes`, `runs` (each
//! size split into `--runs` runs, 100 by default, applied together and
//! followed until all have converged; sizes below `--runs` are skipped), and `health`
//! (about a minute at the default 100,000 nodes): a run of
//! `--health-nodes` fake nodes probed every second, converged, then watched
//! idle for `--health-window-s` seconds. It reports the executor's CPU in the
//! window as a share of one core (the target is under 5%), its RSS, the
//! driver's passes and the executor's health reports in the window (both 0
//! for an idle run), and how often the driver's link to the executor
//! connected (1: it never broke). Each `e2e` size also has a `cpu` row per
//! service: the CPU seconds it used over the three-process convergence on
//! the memory store, per 1,000 nodes.

use std::{
    collections::BTreeSet,
    io::Write as _,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context;
use contract::{
    AttemptId, BootstrapProgress, BootstrapStage, ClusterShape, Endpoint, Epoch, Generation, GroupId, Intent,
    LeaseId, LogicalNodeId, ManagedNode, NodeGroup, NodeStage, Operation, RetryState, RunId, RunUid,
    SessionId, UnixMillis, pb,
    pb::{
        executor_client::ExecutorClient,
        executor_server::{Executor, ExecutorServer},
    },
    shape::example_template,
};
use decider::{DesiredView, SlotSet};
use driver_svc::core::{MemStore, Policy, RunState};
use executor_svc::{
    core::{ExecutorCore, Output},
    fake::{FakeConfig, FakeProvider},
};
use provisioning_tests::procs::{Cluster, ClusterOptions, eventually, sample, watch_until};
use tokio_stream::{StreamExt, wrappers::ReceiverStream};

/// The services' allocator, so that what runs in this process (the decider
/// behind the `rpc` row, the in-process composition, the cores) allocates as
/// the services do.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Debug, Clone)]
struct Row {
    bench: String,
    size: u64,
    metric: String,
    value: f64,
    unit: String,
    ratio: String,
}

#[derive(Debug, Default)]
struct Table(Vec<Row>);

impl Table {
    fn add(&mut self, bench: &str, size: u64, metric: &str, value: f64, unit: &str, ratio: String) {
        let row = Row {
            bench: bench.into(),
            size,
            metric: metric.into(),
            value,
            unit: unit.into(),
            ratio,
        };
        println!(
            "{:<12} {:>8} {:<34} {:>14.3} {:<8} {}",
            row.bench, row.size, row.metric, row.value, row.unit, row.ratio
        );
        let _ = std::io::stdout().flush();
        self.0.push(row);
    }

    fn write_csv(&self, path: &str) -> anyhow::Result<()> {
        let mut s = String::from("bench,size,metric,value,unit,ratio\n");
        for r in &self.0 {
            s.push_str(&format!(
                "{},{},{},{},{},\"{}\"\n",
                r.bench, r.size, r.metric, r.value, r.unit, r.ratio
            ));
        }
        std::fs::write(path, s).with_context(|| format!("writing {path}"))
    }
}

const NOW: UnixMillis = UnixMillis::new(1_800_000_000_000);

fn shape(n: u64) -> ClusterShape {
    named_shape(
        RunId::parse("run_id", "bench").unwrap_or_else(|_| unreachable!()),
        n,
    )
}

/// The bench's shape of `n` nodes in four groups, as run `run_id`.
fn named_shape(run_id: RunId, n: u64) -> ClusterShape {
    let per = u32::try_from(n / 4).unwrap_or(u32::MAX);
    let groups = ["ctrl", "workers", "gpu", "storage"];
    ClusterShape {
        run_id,
        generation: Generation::new(1),
        labels: Default::default(),
        groups: groups
            .iter()
            .enumerate()
            .map(|(i, g)| NodeGroup {
                id: GroupId::parse("id", g).unwrap_or_else(|_| unreachable!()),
                count: if i == 0 {
                    per + u32::try_from(n % 4).unwrap_or(0)
                } else {
                    per
                },
                template: Arc::new(example_template("fake", "img:1")),
                policy: Default::default(),
            })
            .collect(),
    }
}

/// A snapshot of `n` nodes in mixed stages: most ready, the rest spread over
/// the ladder, some drifted, some undesired, some deleting.
fn snapshot(shape: &ClusterShape) -> Vec<ManagedNode> {
    let mut out = Vec::new();
    let mut attempt = 1u64;
    let lease = LeaseId::new("l", "lease-x").ok();
    let endpoint = Endpoint::new("e", "127.0.0.1:1").ok();
    let session = SessionId::new("s", "sess-x").ok();
    for g in &shape.groups {
        for i in 0..g.count {
            let mut n = ManagedNode::new(
                LogicalNodeId::new(g.id.clone(), i),
                AttemptId::new(attempt),
                g.template.clone(),
                RetryState::default(),
            );
            attempt += 1;
            match i % 10 {
                0..=5 => {
                    n.stage = NodeStage::Dormant;
                    n.facts.lease = lease.clone();
                    n.facts.endpoint = endpoint.clone();
                }
                6 => {
                    n.stage = NodeStage::BootstrapRunning;
                    n.facts.lease = lease.clone();
                    n.facts.endpoint = endpoint.clone();
                    n.facts.session = session.clone();
                    n.facts.bootstrap = Some(BootstrapProgress {
                        stage: BootstrapStage::AgentStarted,
                        seq: 3,
                        at: NOW,
                        detail: String::new(),
                    });
                }
                7 => {
                    n.stage = NodeStage::LeaseCreated;
                    n.facts.lease = lease.clone();
                    n.retry.next_effect_at = Some(UnixMillis::new(NOW.as_millis() + 500));
                }
                8 => n.intent = Intent::Deleting,
                _ => {}
            }
            out.push(n);
        }
    }
    out
}

fn slots(nodes: &[ManagedNode]) -> SlotSet {
    let mut s = SlotSet::new();
    for n in nodes {
        s.insert(&n.id);
    }
    s.finish();
    s
}

/// Median of `reps` timings of `f`.
fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> Duration {
    let mut v: Vec<Duration> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed()
        })
        .collect();
    v.sort();
    v[v.len() / 2]
}

fn bench_decider(t: &mut Table, n: u64) -> Duration {
    let s = shape(n);
    let nodes = snapshot(&s);
    let set = slots(&nodes);
    let view = DesiredView::new(&s, false);
    let reps = if n >= 100_000 { 5 } else { 15 };
    let d = time(reps, || decider::decide(&view, nodes.iter(), &set, NOW));
    let ns = d.as_nanos() as f64 / n as f64;
    t.add(
        "decider",
        n,
        "library decide, per node",
        ns,
        "ns",
        format!("target <= 100 ns: {:.2}x", ns / 100.0),
    );
    d
}

async fn bench_rpc(t: &mut Table, n: u64, library: Duration) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(decider_svc::run(
        listener,
        async move {
            let _ = stop_rx.await;
        },
        decider_svc::Config::default(),
    ));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = decider_svc::DeciderChannel::new(channel).max_decoding_message_size(64 << 20);
    let s = shape(n);
    let nodes = snapshot(&s);
    let set = slots(&nodes);
    let trace = contract::TraceContext::default();
    // What the driver does: the call encoded with its slots kept, then sent
    // with them in the form the decider reads (ranges from this decider, past
    // `EAGER_SLOTS`).
    let encode_call =
        || decider_svc::client::encode_call(&s, false, nodes.iter(), set.clone(), &[], NOW, &trace);
    let encode = time(5, encode_call);
    let mut rpc = Vec::new();
    let mut bytes = (0, 0);
    // Enough calls for a steady median at small sizes, where one call is a
    // fraction of a millisecond; `BENCH_RPC_CALLS` sets the count (for a
    // profile).
    let calls = std::env::var("BENCH_RPC_CALLS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or((200_000 / n).clamp(5, 200));
    for _ in 0..calls {
        let call = encode_call();
        let sent = call.clone();
        let start = Instant::now();
        let (out, encoding) = decider_svc::client::decide_call(&mut client, call)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        rpc.push(start.elapsed());
        // The bytes of the form the call used.
        bytes.0 = sent.into_encoded(encoding).iter().map(|m| m.len()).sum::<usize>();
        anyhow::ensure!(
            encoding == decider_svc::client::SlotEncoding::Ranges
                || n as usize <= decider_svc::client::EAGER_SLOTS,
            "the decider did not take slot ranges"
        );
        anyhow::ensure!(out.decisions.len() as u64 >= n, "short answer");
        bytes.1 = out
            .decisions
            .iter()
            .map(|d| prost::Message::encoded_len(&pb::Decision::from(d)) + 2)
            .sum::<usize>();
    }
    rpc.sort();
    let rpc = rpc[rpc.len() / 2] + encode;
    let per = |d: Duration| d.as_nanos() as f64 / n as f64;
    t.add(
        "rpc",
        n,
        "client encode, per node",
        per(encode),
        "ns",
        String::new(),
    );
    t.add(
        "rpc",
        n,
        "Decide RPC incl. encode, per node",
        per(rpc),
        "ns",
        format!(
            "{:.1}x library",
            rpc.as_secs_f64() / library.as_secs_f64().max(1e-9)
        ),
    );
    t.add(
        "rpc",
        n,
        "Decide bytes per node, request / answer",
        bytes.0 as f64 / n as f64,
        "B",
        format!("answer {:.1} B", bytes.1 as f64 / n as f64),
    );
    let transport = rpc.saturating_sub(encode).saturating_sub(library);
    t.add(
        "rpc",
        n,
        "transport+decode, per node",
        per(transport),
        "ns",
        String::new(),
    );
    let _ = stop_tx.send(());
    let _ = server.await;
    Ok(())
}

/// Where a `Decide` call's time goes, in process: each step of the call
/// (both sides' conversions and prost coding) timed on its own, per node.
fn bench_rpc_parts(t: &mut Table, n: u64) -> anyhow::Result<()> {
    use prost::Message as _;
    let s = shape(n);
    let nodes = snapshot(&s);
    let set = slots(&nodes);
    let trace = contract::TraceContext::default();
    let reps = if n >= 100_000 { 5 } else { 15 };
    let reqs = decider_svc::encode_request(&s, false, nodes.iter(), &set, NOW, &trace);
    // What the driver does: the request's bytes written from its nodes.
    let encode = time(reps, || {
        decider_svc::encode_call(&s, false, nodes.iter(), set.clone(), &[], NOW, &trace)
            .into_encoded(decider_svc::SlotEncoding::Ranges)
    });
    let bytes: Vec<Vec<u8>> = reqs.iter().map(|r| r.encode_to_vec()).collect();
    // What the decider does: each request read with its nodes left as
    // bytes, then each node decoded into one scratch message and converted.
    use contract::wire::request::{IncomingPart, NodeRanges, NodeScratch, decode_request};
    let read_requests = time(reps, || {
        bytes
            .iter()
            .map(|b| decode_request(&mut b.as_slice()))
            .collect::<Vec<_>>()
    });
    let ranges: Vec<NodeRanges> = bytes
        .iter()
        .filter_map(|b| match decode_request(&mut b.as_slice()) {
            Ok(r) => match r.part {
                Some(IncomingPart::Nodes(n)) => Some(n),
                _ => None,
            },
            Err(_) => None,
        })
        .collect();
    let table = match &reqs[0].part {
        Some(pb::decide_request::Part::Header(h)) => {
            contract::wire::TemplateTable::from_wire(h.templates.clone())
                .map_err(|e| anyhow::anyhow!("{e}"))?
        }
        _ => anyhow::bail!("no header"),
    };
    // As the decider does it: one node at a time, each dropped before the
    // next is read (collected, the nodes' vector and its page faults were
    // most of this row at 100,000).
    let from_wire = time(reps, || {
        let mut scratch = NodeScratch::default();
        let mut groups = contract::GroupInterner::default();
        let mut converted = 0_usize;
        for body in ranges.iter().flat_map(NodeRanges::iter) {
            if let Ok(n) = scratch.read(body)
                && let Ok(node) = contract::wire::node_from_wire_ref(n, &table, &mut groups)
            {
                converted += usize::from(std::hint::black_box(&node).attempt.get() != 0);
            }
        }
        converted
    });
    let view = DesiredView::new(&s, false);
    let decisions = decider::decide(&view, nodes.iter(), &set, NOW).decisions;
    // What the decider does: each decision written into its batch's bytes.
    let answer_encode = time(reps, || {
        let mut batch = Vec::new();
        let mut one = Vec::new();
        for d in &decisions {
            one.clear();
            contract::wire::encode::encode_decision(d, &mut one);
            contract::wire::encode::put_message(&mut batch, 1, &one);
        }
        batch
    });
    let wire: Vec<pb::Decision> = decisions.iter().map(pb::Decision::from).collect();
    let batch = pb::DecisionBatch { decisions: wire };
    // What the driver does with the answer: its bytes read into raw
    // decisions, each then checked into a `Decision`.
    let answer = pb::DecideResponse {
        part: Some(pb::decide_response::Part::Decisions(batch.clone())),
    }
    .encode_to_vec();
    let raw = match contract::wire::answer::decode_answer(&mut answer.as_slice()) {
        Ok(contract::wire::answer::Answer::Decisions(raw)) => raw,
        other => anyhow::bail!("the answer read back as {other:?}"),
    };
    let answer_decode = time(reps, || {
        contract::wire::answer::decode_answer(&mut answer.as_slice())
    });
    let answer_from = time(reps, || {
        let mut groups = contract::GroupInterner::default();
        (0..raw.len())
            .filter_map(|i| raw.decision(i, &mut groups))
            .collect::<Vec<_>>()
    });
    for (what, d) in [
        ("encode_call (the request's bytes)", encode),
        ("decode_request (nodes left as bytes)", read_requests),
        ("NodeScratch::read + node_from_wire_ref", from_wire),
        ("encode_decision (the answer's bytes)", answer_encode),
        ("decode_answer (the answer's bytes)", answer_decode),
        ("Decisions::decision (each checked)", answer_from),
    ] {
        t.add(
            "rpc-parts",
            n,
            what,
            d.as_nanos() as f64 / n as f64,
            "ns",
            String::new(),
        );
    }
    Ok(())
}

/// The driver's orphan sweep over an inventory of `n` resources, every one
/// held by its run (the steady state of a converged run of `n` nodes), in
/// process: per resource.
fn bench_sweep(t: &mut Table, n: u64) {
    use driver_svc::orphans::{Attempts, Holdings, Inventory, Orphans, key_of};
    let uid = RunUid::from_u128(0x5eed);
    let Ok(run_id) = RunId::parse("run_id", "bench") else {
        return;
    };
    let Ok(group) = GroupId::parse("group", "workers") else {
        return;
    };
    let resources: Vec<contract::InventoryResource> = (0..n)
        .map(|i| contract::InventoryResource {
            identity: contract::ResourceIdentity {
                run_uid: uid,
                run_id: run_id.clone(),
                node: LogicalNodeId::new(group.clone(), i as u32),
                attempt: AttemptId::new(i + 1),
            },
            lease: LeaseId::new("lease", &format!("fake-lease-{i}")).ok(),
            endpoint: Endpoint::new("endpoint", "127.0.0.1:1").ok(),
            session_live: true,
            epoch: Epoch::new(1),
        })
        .collect();
    let mut held: Holdings = Holdings::new();
    let nodes = held.entry(uid).or_default();
    for r in &resources {
        nodes.insert(r.identity.node.clone(), Attempts::one(r.identity.attempt));
    }
    let leases: Vec<_> = resources.iter().map(key_of).collect();
    let inventory = Inventory {
        resources,
        undecodable: 0,
    };
    let orphans = Orphans::new();
    let reps = if n >= 100_000 { 3 } else { 15 };
    let d = time(reps, || orphans.sweep(&inventory, &held, &leases, NOW));
    t.add(
        "sweep",
        n,
        "orphan sweep, per resource held",
        d.as_nanos() as f64 / n.max(1) as f64,
        "ns",
        String::new(),
    );
}

/// The three cores in one process, zero backend latency: wall time to converge.
fn in_process(n: u64) -> anyhow::Result<(Duration, u64)> {
    in_process_runs(vec![shape(n)])
}

/// Each shape converged in process, one after another on one thread: the
/// time for all, and the most passes any one took.
fn in_process_runs(shapes: Vec<ClusterShape>) -> anyhow::Result<(Duration, u64)> {
    let start = Instant::now();
    let mut most = 0;
    for s in shapes {
        let mut c = Composition::new(s)?;
        most = most.max(c.converge()?);
    }
    Ok((start.elapsed(), most))
}

/// The driver core, the decider library and the executor core with the
/// fake provider in one thread, as `in_process` composes them.
struct Composition {
    run: RunState,
    store: MemStore,
    exec: ExecutorCore,
    fake: FakeProvider,
    uid: RunUid,
}

impl Composition {
    fn new(shape: ClusterShape) -> anyhow::Result<Self> {
        let uid = RunUid::from_u128(7);
        let run = RunState::create(shape, uid, Epoch::new(1), Arc::new(bench_policy()), NOW)?;
        let mut exec = ExecutorCore::new();
        exec.claim(&contract::Claim {
            run_uid: uid,
            run_id: run.run_id().clone(),
            epoch: Epoch::new(1),
        })
        .map_err(|r| anyhow::anyhow!("{r:?}"))?;
        let fake = FakeProvider::new(FakeConfig {
            latency_ms: (0, 0),
            stage_interval_ms: 0,
            ..FakeConfig::default()
        });
        Ok(Self {
            run,
            store: MemStore::new(),
            exec,
            fake,
            uid,
        })
    }

    /// Passes until the run converges; how many it took.
    fn converge(&mut self) -> anyhow::Result<u64> {
        let Self {
            run,
            store,
            exec,
            fake,
            uid,
        } = self;
        let now = NOW;
        for passes in 0..100_000u64 {
            if run.is_converged() {
                return Ok(passes);
            }
            if !run.needs_pass(now) {
                anyhow::bail!("the run waits for nothing but has not converged");
            }
            let plan = run.begin_pass(now)?;
            let out = {
                let view = run.desired_view();
                decider::decide(&view, run.plan_nodes(&plan), run.slot_set(), now)
            };
            let mut outcome = run.apply_decisions(plan, out, now)?;
            let mut queue: Vec<Operation> = outcome.take_commit().persist_to(&*store)?.operations;
            let mut results = Vec::new();
            while let Some(op) = queue.pop() {
                for o in exec.submit(op, now) {
                    match o {
                        Output::Start(op) => {
                            let call = fake.execute(&op, now);
                            for o in exec.complete(op.run_uid, op.id, call.outcome, now) {
                                match o {
                                    Output::Result(r) => results.push(r),
                                    Output::Start(next) => queue.push(next),
                                    _ => {}
                                }
                            }
                        }
                        Output::Result(r) => results.push(r),
                        _ => {}
                    }
                }
            }
            for r in &results {
                let _ = run.fold_result(r, now)?;
            }
            for fo in fake.due_observations(now) {
                for o in exec.record_observation(
                    &fo.identity,
                    fo.session,
                    fo.stage,
                    fo.detail,
                    fo.at,
                    contract::TraceContext::default(),
                ) {
                    if let Output::Observation(o) = o {
                        let _ = run.fold_observation(&o, now)?;
                    }
                }
            }
            for a in run.take_commit().persist_to(&*store)?.acks {
                if let driver_svc::core::AckRef::Result(id) = a {
                    exec.ack_result(*uid, id);
                }
            }
        }
        anyhow::bail!("in-process composition did not converge")
    }
}

/// A template change of every node of an `n`-node run, in process: once
/// within a rollout budget of `max_surge: 10%` (and nothing taken down),
/// once with no budget to speak of (every node may be down at once).
fn bench_rollout(t: &mut Table, n: u64) -> anyhow::Result<()> {
    let policies = [
        (
            "max_surge 10%",
            contract::RolloutPolicy {
                max_unavailable: contract::Budget::Count(0),
                max_surge: contract::Budget::Percent(10),
                ..Default::default()
            },
        ),
        (
            "max_unavailable 100%",
            contract::RolloutPolicy {
                max_unavailable: contract::Budget::Percent(100),
                max_surge: contract::Budget::Count(0),
                ..Default::default()
            },
        ),
    ];
    let mut figures = Vec::new();
    for (name, policy) in policies {
        let mut first = shape(n);
        for g in &mut first.groups {
            g.policy.rollout = policy;
        }
        let mut c = Composition::new(first.clone())?;
        c.converge()?;
        let mut changed = first;
        changed.generation = Generation::new(2);
        for g in &mut changed.groups {
            Arc::make_mut(&mut g.template).image = "img:2".to_owned();
        }
        c.run.apply_shape(changed)?;
        let start = Instant::now();
        let passes = c.converge()?;
        figures.push((name, start.elapsed(), passes));
    }
    let base = figures.last().map_or(Duration::ZERO, |f| f.1);
    for (name, took, passes) in figures {
        let ratio = if base.is_zero() {
            String::new()
        } else {
            format!(
                "{:.2}x the unbudgeted change",
                took.as_secs_f64() / base.as_secs_f64()
            )
        };
        t.add(
            "rollout",
            n,
            &format!("time ({name})"),
            took.as_secs_f64() * 1e3,
            "ms",
            ratio,
        );
        t.add(
            "rollout",
            n,
            &format!("passes ({name})"),
            passes as f64,
            "",
            String::new(),
        );
    }
    Ok(())
}

fn bench_policy() -> Policy {
    Policy {
        probe_interval: Duration::from_millis(5),
        limits: contract::ShapeLimits {
            max_nodes_per_group: 1_000_000,
            max_nodes_total: 1_000_000,
            ..contract::ShapeLimits::default()
        },
        ..Policy::default()
    }
}

/// CPU time (user + system) a process has used so far, from `/proc`.
fn cpu_time(pid: u32) -> Option<Duration> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after it do not.
    let rest = s.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // Linux reports `USER_HZ` ticks, 100 per second on every supported target.
    Some(Duration::from_millis(ticks * 10))
}

fn rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS:")
}

/// The most a process has held resident so far.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM:")
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// A service's resident memory over a convergence, in KiB: before, after,
/// and its peak.
#[derive(Debug, Clone, Copy)]
struct Memory {
    before: u64,
    after: u64,
    peak: u64,
}

impl Memory {
    fn before(pid: Option<u32>) -> Option<u64> {
        pid.and_then(rss_kib)
    }

    fn after(pid: Option<u32>, before: Option<u64>) -> Option<Self> {
        let pid = pid?;
        Some(Self {
            before: before?,
            after: rss_kib(pid)?,
            peak: peak_rss_kib(pid)?,
        })
    }
}

/// CPU seconds (user and system) a process has used, from `/proc`.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let tick = |i: usize| -> Option<f64> { fields.get(i)?.parse().ok() };
    // utime and stime, the 14th and 15th fields, in clock ticks (100 a
    // second on Linux).
    Some((tick(11)? + tick(12)?) / 100.0)
}

/// The CPU seconds each service used over a convergence: decider,
/// executor, driver.
type CpuUsed = [(&'static str, f64); 3];

/// What one three-process convergence measured.
struct Converged {
    elapsed: Duration,
    /// The most passes any one run took.
    passes: u64,
    driver: Option<Memory>,
    executor: Option<Memory>,
    /// The peak of a plugin the executor started, if it started one.
    plugin_peak_kib: Option<u64>,
    cpu: CpuUsed,
    /// Node records the driver wrote to its store over the convergence.
    node_writes: Option<f64>,
}

async fn three_processes(n: u64, durable: bool) -> anyhow::Result<Converged> {
    three_processes_runs(vec![shape(n)], durable).await
}

/// The child processes of `pid` (a plugin the executor started), whichever
/// of its threads started them.
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|list| {
            list.split_whitespace()
                .filter_map(|c| c.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// One run of `n` nodes on three processes (memory store) whose executor
/// hosts the fake out of process, as a provider plugin: the executor's
/// memory then is its own, not the test double's. Its peak and growth, and
/// the plugin's peak apart.
async fn bench_e2e_hosted(t: &mut Table, n: u64) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // The plugin's own health loop is pushed out of the way: the bench's
    // shape watches no health, and a probe of every resource every half
    // second would be the plugin's work, not the executor's.
    let command = format!(
        "{} --backend fake --fake-latency-ms 0,0 --fake-stage-interval-ms 0 --health-interval-ms 3600000 \
         --listen unix:{}",
        provisioning_tests::procs::bin_path("builtin-provider")?.display(),
        dir.path().join("fake.sock").display()
    );
    let opts = ClusterOptions::default()
        .executor("--backend", "none")
        .executor("--plugin-command", &command);
    let run = converge(vec![shape(n)], false, opts).await?;
    t.add(
        "e2e",
        n,
        "three processes, fake as a plugin",
        run.elapsed.as_secs_f64(),
        "s",
        format!("memory store; {} passes", run.passes),
    );
    for (service, used) in run.cpu {
        t.add(
            "cpu",
            n,
            &format!("{service} CPU per 1,000 nodes (fake as a plugin)"),
            used * 1000.0 / n as f64,
            "s",
            format!("{used:.2} s over the convergence"),
        );
    }
    if let Some(mem) = run.executor {
        let per_node = mem.after.saturating_sub(mem.before) as f64 * 1024.0 / n as f64;
        t.add(
            "memory",
            n,
            "executor RSS growth per node, fake as a plugin",
            per_node,
            "bytes",
            format!(
                "target <= 1024: {:.2}x; peak {:.1} MiB (target <= 1024 at 1,000,000)",
                per_node / 1024.0,
                mem.peak as f64 / 1024.0
            ),
        );
    }
    if let Some(peak) = run.plugin_peak_kib {
        t.add(
            "memory",
            n,
            "the fake plugin's peak RSS",
            peak as f64 / 1024.0,
            "MiB",
            "a test double's model, apart from the executor".into(),
        );
    }
    Ok(())
}

/// Every shape applied at once to three processes, and followed until all
/// have converged.
async fn three_processes_runs(shapes: Vec<ClusterShape>, durable: bool) -> anyhow::Result<Converged> {
    converge(shapes, durable, ClusterOptions::default()).await
}

/// [`three_processes_runs`] on `opts` (the executor's backend).
async fn converge(
    shapes: Vec<ClusterShape>,
    durable: bool,
    opts: ClusterOptions,
) -> anyhow::Result<Converged> {
    let mut opts = opts
        .executor("--fake-latency-ms", "0,0")
        .executor("--fake-stage-interval-ms", "0")
        .driver("--probe-interval-ms", "5")
        // The product's safety tick, not the tests' 2 s: each tick is a
        // full pass over the run, which at a million nodes is seconds of
        // work, so the tests' tick made the time grow with the square of
        // the size.
        .driver("--safety-tick-ms", "30000")
        .driver("--max-nodes-per-group", "1000000")
        .driver("--max-nodes-total", "1000000")
        // Served for whoever looks into a slow convergence (each service
        // logs its address); nothing scrapes them during the measurement.
        .driver("--metrics-listen", "127.0.0.1:0")
        .executor("--metrics-listen", "127.0.0.1:0");
    if !durable {
        opts = opts.driver("--store", "memory");
    }
    let cluster = Cluster::start(opts).await?;
    let driver_before = Memory::before(cluster.driver.pid());
    let executor_before = Memory::before(cluster.executor.pid());
    let services = [
        ("decider", &cluster.decider),
        ("executor", &cluster.executor),
        ("driver", &cluster.driver),
    ];
    let cpu_now = || services.map(|(name, s)| (name, s.pid().and_then(cpu_seconds).unwrap_or(0.0)));
    let cpu_before = cpu_now();
    let mut c = cluster.client().await?.max_decoding_message_size(256 << 20);
    let start = Instant::now();
    let runs: Vec<String> = shapes.iter().map(|s| s.run_id.to_string()).collect();
    for s in &shapes {
        c.apply(pb::ApplyRequest {
            shape: Some(pb::ClusterShape::from(s)),
        })
        .await?;
    }
    let passes = match runs.as_slice() {
        // Followed on a watch, which the driver sends a phase change on at
        // once: polling would round small runs up to its period.
        [run] => {
            watch_until(&mut c, run, Duration::from_secs(1800), |s| s.converged)
                .await
                .with_context(|| format!("{run} did not converge"))?
                .passes
        }
        // Many runs: one client holds few watches, so the list is polled.
        // Its 20 ms period is small beside any many-run convergence.
        _ => all_converged(&mut c, &runs, Duration::from_secs(1800)).await?,
    };
    let elapsed = start.elapsed();
    let driver = Memory::after(cluster.driver.pid(), driver_before);
    let executor = Memory::after(cluster.executor.pid(), executor_before);
    let plugin_peak_kib = cluster
        .executor
        .pid()
        .map(children)
        .unwrap_or_default()
        .into_iter()
        .filter_map(peak_rss_kib)
        .max();
    let cpu_after = cpu_now();
    let mut cpu = cpu_after;
    for ((_, used), (_, before)) in cpu.iter_mut().zip(cpu_before) {
        *used -= before;
    }
    let node_writes = scraped(&cluster.driver, "provisioning_store_node_writes_total").await;
    Ok(Converged {
        elapsed,
        passes,
        driver,
        executor,
        plugin_peak_kib,
        cpu,
        node_writes,
    })
}

/// Polls the run list until every one of `runs` has converged; the most
/// passes any one took.
async fn all_converged(
    c: &mut contract::pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>,
    runs: &[String],
    timeout: Duration,
) -> anyhow::Result<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        let listed = c
            .list_runs(pb::ListRunsRequest::default())
            .await?
            .into_inner()
            .runs;
        let converged: Vec<&pb::RunStatus> = listed
            .iter()
            .filter(|s| s.converged && runs.contains(&s.run_id))
            .collect();
        if converged.len() == runs.len() {
            return Ok(converged.iter().map(|s| s.passes).max().unwrap_or(0));
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} of {} runs converged after {timeout:?}",
            converged.len(),
            runs.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn bench_e2e(t: &mut Table, n: u64) -> anyhow::Result<()> {
    let (local, local_passes) = in_process(n)?;
    t.add(
        "e2e",
        n,
        "in-process composition",
        local.as_secs_f64(),
        "s",
        String::new(),
    );
    let memory = three_processes(n, false).await?;
    let (split, passes, cpu) = (memory.elapsed, memory.passes, memory.cpu);
    let target = match n {
        1 => " (target <= 20 ms)",
        100 => " (target <= 50 ms)",
        10_000 => " (target <= 0.5 s)",
        100_000 => " (target <= 5 s)",
        1_000_000 => " (target <= 60 s)",
        _ => "",
    };
    t.add(
        "e2e",
        n,
        "three processes, memory store",
        split.as_secs_f64(),
        "s",
        format!(
            "{:.2}x in-process{target}; target split <= 1.5x",
            split.as_secs_f64() / local.as_secs_f64()
        ),
    );
    let redb = three_processes(n, true).await?;
    let durable = redb.elapsed;
    // CPU per 1,000 nodes, so that a regression in any one service shows in
    // one run at any size.
    for (service, used) in cpu {
        t.add(
            "cpu",
            n,
            &format!("{service} CPU per 1,000 nodes (memory store)"),
            used * 1000.0 / n as f64,
            "s",
            format!("{used:.2} s over the convergence (10 ms ticks)"),
        );
    }
    t.add(
        "e2e",
        n,
        "three processes, redb store",
        durable.as_secs_f64(),
        "s",
        format!(
            "{:.2}x memory store (target <= 1.3x)",
            durable.as_secs_f64() / split.as_secs_f64()
        ),
    );
    // The happy path crosses four passes per node: insert, create, start
    // bootstrap, observe convergence.
    const LADDER_DEPTH: f64 = 4.0;
    t.add(
        "passes",
        n,
        "passes to converge (3 processes)",
        passes as f64,
        "passes",
        format!("{:.2}x ladder depth (target <= 3x)", passes as f64 / LADDER_DEPTH),
    );
    // Each write is a record encoded and put in the store's B-tree (redb);
    // a fold and the pass that decides on it are written together.
    for (store, run) in [("memory store", &memory), ("redb store", &redb)] {
        if let Some(writes) = run.node_writes {
            t.add(
                "store",
                n,
                &format!("driver node records written per node, {store}"),
                writes / n as f64,
                "writes",
                format!("{writes:.0} in all"),
            );
        }
    }
    // Under the admission limit a run's passes are bound by it too: two
    // operations a node, at most the limit pending, so at least that many
    // passes that dispatch. The same size without the limit shows what the
    // batching alone does (up to 100,000 nodes: above, the limit is what
    // lets a run converge at all).
    let floor = (2 * n).div_ceil(driver_svc::admission::DEFAULT_MAX_OPERATIONS_IN_FLIGHT as u64);
    if floor > 1 && n <= 100_000 {
        let free = converge(
            vec![shape(n)],
            false,
            ClusterOptions::default().driver("--max-operations-in-flight", "0"),
        )
        .await?;
        t.add(
            "passes",
            n,
            "passes to converge, no admission limit (3 processes)",
            free.passes as f64,
            "passes",
            format!(
                "{:.2}x ladder depth (target <= 3x); with the default limit at least {floor} passes dispatch",
                free.passes as f64 / LADDER_DEPTH
            ),
        );
    }
    t.add(
        "passes",
        n,
        "passes to converge (in-process)",
        local_passes as f64,
        "passes",
        format!("{:.2}x ladder depth", local_passes as f64 / LADDER_DEPTH),
    );
    // The memory store keeps every record in the process (the run's own,
    // until the run changes it); the redb store (the default) keeps records
    // in its file and page cache.
    // The issue's ceilings at 1,000,000 nodes: driver 2.5 GiB, executor
    // 1 GiB, so 2,048 and 1,024 bytes per node of growth.
    for (store, run) in [("memory store", &memory), ("redb store", &redb)] {
        for (service, mem, target) in [("driver", run.driver, 2048.0), ("executor", run.executor, 1024.0)] {
            let Some(mem) = mem else { continue };
            let per_node = (mem.after.saturating_sub(mem.before) as f64 * 1024.0) / n as f64;
            t.add(
                "memory",
                n,
                &format!("{service} RSS growth per node, {store}"),
                per_node,
                "bytes",
                format!(
                    "target <= {target}: {:.2}x; peak {:.1} MiB",
                    per_node / target,
                    mem.peak as f64 / 1024.0
                ),
            );
        }
    }
    Ok(())
}

/// `runs` runs of `n / runs` nodes each, applied together: the time until
/// all have converged, in process and as three processes, with the memory
/// and CPU rows of `e2e`. Against the one run of `n` nodes it shows what a
/// run costs beside its nodes.
async fn bench_runs(t: &mut Table, n: u64, runs: u64) -> anyhow::Result<()> {
    anyhow::ensure!(
        runs > 0 && n >= runs,
        "--runs {runs} needs at least one node a run at size {n}"
    );
    let per_run = n / runs;
    let shapes = || -> anyhow::Result<Vec<ClusterShape>> {
        (0..runs)
            .map(|i| {
                Ok(named_shape(
                    RunId::parse("run_id", &format!("bench-{i:03}"))?,
                    per_run,
                ))
            })
            .collect()
    };
    let size = per_run * runs;
    let what = format!("{runs}x{per_run}");
    let (local, local_passes) = in_process_runs(shapes()?)?;
    t.add(
        "runs",
        size,
        &format!("{what} in-process"),
        local.as_secs_f64(),
        "s",
        String::new(),
    );
    for durable in [false, true] {
        let store = if durable { "redb store" } else { "memory store" };
        let run = three_processes_runs(shapes()?, durable).await?;
        t.add(
            "runs",
            size,
            &format!("{what} three processes, {store}"),
            run.elapsed.as_secs_f64(),
            "s",
            format!(
                "{:.2}x in-process; {:.1} us a node",
                run.elapsed.as_secs_f64() / local.as_secs_f64(),
                run.elapsed.as_secs_f64() * 1e6 / size as f64
            ),
        );
        t.add(
            "runs",
            size,
            &format!("{what} most passes of a run, {store}"),
            run.passes as f64,
            "passes",
            format!("in-process {local_passes}"),
        );
        for (service, used) in run.cpu {
            t.add(
                "runs",
                size,
                &format!("{what} {service} CPU/1,000 nodes, {store}"),
                used * 1000.0 / size as f64,
                "s",
                format!("{used:.2} s over the convergence"),
            );
        }
        for (service, mem) in [("driver", run.driver), ("executor", run.executor)] {
            let Some(mem) = mem else { continue };
            t.add(
                "runs",
                size,
                &format!("{what} {service} peak RSS, {store}"),
                mem.peak as f64 / 1024.0,
                "MiB",
                format!(
                    "growth {:.0} bytes a node",
                    mem.after.saturating_sub(mem.before) as f64 * 1024.0 / size as f64
                ),
            );
        }
    }
    Ok(())
}

/// The group policy of the health row: a probe a second, as issue #18 asks.
const HEALTH_POLICY: contract::HealthPolicy = contract::HealthPolicy {
    probe: contract::Probe::Tcp,
    interval_ms: 1_000,
    timeout_ms: 500,
    unhealthy_after_ms: 30_000,
    startup_grace_ms: 0,
};

/// One series of a service's metrics, `None` while it cannot be read.
async fn scraped(service: &provisioning_tests::procs::Service, series: &str) -> Option<f64> {
    let text = service.scrape().await.ok()?;
    sample(&text, series)
}

/// The bench run's status, without its nodes.
async fn bench_run(
    c: &mut contract::pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>,
) -> anyhow::Result<pb::RunStatus> {
    Ok(c.get_run(pb::GetRunRequest {
        run_id: "bench".into(),
        include_nodes: false,
    })
    .await?
    .into_inner())
}

/// The passes a run has made so far, and whether it is converged.
async fn passes_of(
    c: &mut contract::pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>,
) -> anyhow::Result<(u64, bool)> {
    let s = bench_run(c).await?;
    Ok((s.passes, s.converged))
}

/// Health watching at scale (issue #18): `n` fake nodes whose groups probe
/// every second, on the three services as processes. The run converges, every
/// node's first health report is folded (and the pass it asks for is over);
/// then, for `window`, nothing changes: the executor's CPU as a share of one
/// core, its RSS, and the passes and health reports in the window (both
/// should be 0). The driver's safety tick (a pass every 30 s by default,
/// whatever happens) and its orphan sweep (an inventory read) are pushed out
/// of the way so that the window shows what health watching costs. The
/// default window is the executor's inventory resync period
/// (`executor_svc::health::TARGET_RESYNC`), so it holds one resync.
async fn bench_health(t: &mut Table, n: u64, window: Duration) -> anyhow::Result<()> {
    const HEALTHY: &str = "provisioning_node_health_changes_total{state=\"healthy\"}";
    const UNHEALTHY: &str = "provisioning_node_health_changes_total{state=\"unhealthy\"}";
    const SENT: &str = "provisioning_executor_resource_changes_total{change=\"healthy\"}";
    const CONNECTS: &str = "provisioning_executor_link_events_total{event=\"connect\"}";
    let opts = ClusterOptions::default()
        .executor("--fake-latency-ms", "0,0")
        .executor("--fake-stage-interval-ms", "0")
        .executor("--metrics-listen", "127.0.0.1:0")
        .driver("--metrics-listen", "127.0.0.1:0")
        .driver("--store", "memory")
        .driver("--probe-interval-ms", "5")
        .driver("--max-nodes-per-group", "1000000")
        .driver("--max-nodes-total", "1000000")
        .driver("--safety-tick-ms", "3600000")
        .driver("--orphan-sweep-ms", "0");
    let cluster = Cluster::start(opts).await?;
    let (Some(executor), Some(driver)) = (cluster.executor.pid(), cluster.driver.pid()) else {
        anyhow::bail!("a service exited at start");
    };
    let mut s = shape(n);
    for g in &mut s.groups {
        g.policy.health = HEALTH_POLICY;
    }
    let mut c = cluster.client().await?.max_decoding_message_size(256 << 20);
    let start = Instant::now();
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await?;
    let limit = Duration::from_secs(600);
    let converge = eventually(limit, &format!("{n} nodes converged"), || {
        let mut c = c.clone();
        async move {
            passes_of(&mut c)
                .await
                .ok()
                .filter(|(_, done)| *done)
                .map(|_| start.elapsed())
        }
    })
    .await?;
    let target = n as f64;
    let driver_svc = &cluster.driver;
    let reported = eventually(
        limit,
        &format!("{n} first health reports folded"),
        || async move {
            scraped(driver_svc, HEALTHY)
                .await
                .filter(|v| *v >= target)
                .map(|_| start.elapsed())
        },
    )
    .await?;
    // The first reports mark every node changed once: wait for the passes
    // they ask for to be over (a pass count that holds for a second while
    // the run is converged).
    let mut settled = passes_of(&mut c).await?;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = passes_of(&mut c).await?;
        if now == settled && now.1 {
            break;
        }
        anyhow::ensure!(start.elapsed() < limit, "the run did not settle: {now:?}");
        settled = now;
    }
    let sent_before = scraped(&cluster.executor, SENT).await.unwrap_or(0.0);
    let (cpu_before, driver_before) = (cpu_time(executor), cpu_time(driver));
    let at = Instant::now();
    tokio::time::sleep(window).await;
    let (cpu_after, driver_after) = (cpu_time(executor), cpu_time(driver));
    let elapsed = at.elapsed().as_secs_f64();
    let (passes_after, converged) = passes_of(&mut c).await?;
    let sent_after = scraped(&cluster.executor, SENT).await.unwrap_or(0.0);
    let unhealthy = scraped(driver_svc, UNHEALTHY).await.unwrap_or(0.0);
    let connects = scraped(driver_svc, CONNECTS).await.unwrap_or(0.0);
    anyhow::ensure!(converged, "the run left convergence in the idle window");
    anyhow::ensure!(unhealthy == 0.0, "{unhealthy} nodes reported unhealthy");
    t.add(
        "health",
        n,
        "converge, probes every 1 s",
        converge.as_secs_f64(),
        "s",
        String::new(),
    );
    t.add(
        "health",
        n,
        "every first health report folded",
        reported.as_secs_f64(),
        "s",
        "since apply".into(),
    );
    let share = |before: Option<Duration>, after: Option<Duration>| {
        before
            .zip(after)
            .map(|(b, a)| 100.0 * a.saturating_sub(b).as_secs_f64() / elapsed)
    };
    if let Some(pct) = share(cpu_before, cpu_after) {
        t.add(
            "health",
            n,
            "executor CPU while idle",
            pct,
            "% core",
            format!("target < 5%: {:.2}x; {elapsed:.1} s window", pct / 5.0),
        );
        // Every node is probed once per interval.
        let probes = n as f64 * elapsed * 1_000.0 / HEALTH_POLICY.interval_ms as f64;
        t.add(
            "health",
            n,
            "executor CPU per probe",
            pct / 100.0 * elapsed * 1e9 / probes,
            "ns",
            String::new(),
        );
    }
    if let Some(pct) = share(driver_before, driver_after) {
        t.add("health", n, "driver CPU while idle", pct, "% core", String::new());
    }
    if let Some(kib) = rss_kib(executor) {
        t.add(
            "health",
            n,
            "executor RSS",
            kib as f64 / 1024.0,
            "MiB",
            format!("{:.0} bytes per node", kib as f64 * 1024.0 / n as f64),
        );
    }
    t.add(
        "health",
        n,
        "passes while idle",
        passes_after.saturating_sub(settled.0) as f64,
        "passes",
        "target 0".into(),
    );
    t.add(
        "health",
        n,
        "health reports sent while idle",
        sent_after - sent_before,
        "reports",
        "target 0".into(),
    );
    // A link that breaks (a message over the executor's limit) makes the
    // executor resend all it holds unacknowledged: no run is idle then.
    t.add(
        "health",
        n,
        "executor link connects, whole run",
        connects,
        "connects",
        "target 1".into(),
    );
    Ok(())
}

/// A bare streaming echo with the executor's own messages: each submit is
/// answered at once with a result. The practical ceiling for this transport.
#[derive(Debug, Default)]
struct Echo;

#[tonic::async_trait]
impl Executor for Echo {
    type LinkStream = ReceiverStream<Result<pb::ExecutorMessage, tonic::Status>>;

    async fn link(
        &self,
        req: tonic::Request<tonic::Streaming<pb::DriverMessage>>,
    ) -> Result<tonic::Response<Self::LinkStream>, tonic::Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(async move {
            while let Some(Ok(msg)) = inbound.next().await {
                if let Some(pb::driver_message::Kind::Submit(op)) = msg.kind {
                    let result = pb::OperationResult {
                        run_uid: op.run_uid,
                        node_id: op.node_id,
                        id: op.id,
                        effect: pb::Effect::CreateLease as i32,
                        outcome: pb::OutcomeClass::Succeeded as i32,
                        ..Default::default()
                    };
                    let m = pb::ExecutorMessage {
                        kind: Some(pb::executor_message::Kind::Result(result)),
                        trace: None,
                    };
                    if tx.send(Ok(m)).await.is_err() {
                        break;
                    }
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }

    async fn inventory(
        &self,
        _req: tonic::Request<pb::InventoryRequest>,
    ) -> Result<tonic::Response<pb::InventoryResponse>, tonic::Status> {
        Ok(tonic::Response::new(pb::InventoryResponse::default()))
    }

    type InventoryPagesStream = ReceiverStream<Result<pb::InventoryResponse, tonic::Status>>;

    async fn inventory_pages(
        &self,
        _req: tonic::Request<pb::InventoryRequest>,
    ) -> Result<tonic::Response<Self::InventoryPagesStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("the echo holds no resources"))
    }
}

fn create_op(uid: RunUid, i: u64) -> pb::Operation {
    provider_op(uid, i, "fake", false)
}

/// A create (or, with `destroy`, a destroy) of node `i` at `provider`.
fn provider_op(uid: RunUid, i: u64, provider: &str, destroy: bool) -> pb::Operation {
    let input = if destroy {
        contract::OperationInput::DestroyLease { lease: None }
    } else {
        contract::OperationInput::CreateLease {
            template: Arc::new(example_template(provider, "img:1")),
        }
    };
    let op = Operation {
        run_uid: uid,
        run_id: RunId::parse("r", "bench").unwrap_or_else(|_| unreachable!()),
        node: LogicalNodeId::new(
            GroupId::parse("g", "w").unwrap_or_else(|_| unreachable!()),
            i as u32,
        ),
        id: contract::OperationId::new(AttemptId::new(i + 1), if destroy { 2 } else { 1 }),
        epoch: Epoch::new(1),
        deadline: UnixMillis::new(u64::MAX / 2),
        provider: provider.into(),
        input,
        trace: contract::TraceContext::default(),
    };
    pb::Operation::from(&op)
}

/// Operations per second through a link: submit `n`, read `n` results.
async fn link_rate(url: String, n: u64, claim: bool) -> anyhow::Result<f64> {
    let uid = RunUid::from_u128(0xbe4c);
    let ops: Vec<pb::Operation> = (0..n).map(|i| create_op(uid, i)).collect();
    link_rate_ops(url, uid, ops, claim).await
}

/// Operations per second through a link: submit `ops`, read their results.
async fn link_rate_ops(
    url: String,
    uid: RunUid,
    ops: Vec<pb::Operation>,
    claim: bool,
) -> anyhow::Result<f64> {
    let n = ops.len() as u64;
    let mut client = ExecutorClient::connect(url).await?;
    let (tx, rx) = tokio::sync::mpsc::channel(4096);
    let mut inbound = client.link(ReceiverStream::new(rx)).await?.into_inner();
    if claim {
        tx.send(pb::DriverMessage {
            kind: Some(pb::driver_message::Kind::Claim(pb::Claim {
                run_uid: uid.to_string(),
                run_id: "bench".into(),
                epoch: 1,
            })),
            trace: None,
        })
        .await?;
    }
    let start = Instant::now();
    let sender = tokio::spawn(async move {
        for op in ops {
            let m = pb::DriverMessage {
                kind: Some(pb::driver_message::Kind::Submit(op)),
                trace: None,
            };
            if tx.send(m).await.is_err() {
                break;
            }
        }
        tx
    });
    let mut seen = BTreeSet::new();
    while (seen.len() as u64) < n {
        let Some(m) = inbound.next().await else {
            anyhow::bail!("link ended after {} results", seen.len());
        };
        if let Some(pb::executor_message::Kind::Result(r)) = m?.kind {
            seen.insert(r.id.map(|i| i.attempt));
        }
    }
    let elapsed = start.elapsed();
    drop(sender.await?);
    Ok(n as f64 / elapsed.as_secs_f64())
}

async fn bench_throughput(t: &mut Table, n: u64) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let echo = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ExecutorServer::new(Echo))
            .serve_with_incoming(platform::runtime::incoming(listener)),
    );
    let bare = link_rate(format!("http://{addr}"), n, false).await?;
    echo.abort();
    t.add(
        "throughput",
        n,
        "bare streaming echo",
        bare,
        "ops/s",
        String::new(),
    );

    // Plaintext, like the echo it is compared with.
    let cluster = Cluster::start(
        ClusterOptions::default()
            .insecure()
            .executor("--fake-latency-ms", "0,0"),
    )
    .await?;
    let pid = cluster.executor.pid();
    let cpu_before = pid.and_then(cpu_time);
    let real = link_rate(cluster.executor.url(), n, true).await?;
    let cpu_after = pid.and_then(cpu_time);
    if let Some((before, after)) = cpu_before.zip(cpu_after) {
        // Less sensitive than the rate to whatever else the machine runs.
        t.add(
            "throughput",
            n,
            "executor CPU per round trip",
            after.saturating_sub(before).as_secs_f64() * 1e6 / n as f64,
            "us",
            String::new(),
        );
    }
    t.add(
        "throughput",
        n,
        "executor round trips (fake backend)",
        real,
        "ops/s",
        format!("{:.0}% of echo (target >= 50%)", 100.0 * real / bare),
    );
    Ok(())
}

/// Round trips through a provider plugin against the same backend built
/// in: the fake at volume (`n` creates; what the protocol costs), and the
/// process backend (`agents` creates, then their destroys: real agents).
async fn bench_plugin(t: &mut Table, n: u64, agents: u64) -> anyhow::Result<()> {
    let builtin_provider = provisioning_tests::procs::bin_path("builtin-provider")?;
    let dir = tempfile::tempdir()?;
    for backend in ["fake", "process"] {
        let state = dir.path().join(format!("{backend}-agents"));
        let builtin = ClusterOptions::default()
            .insecure()
            .executor("--backend", backend)
            .executor("--fake-latency-ms", "0,0")
            .executor("--process-state-dir", &state.display().to_string());
        let plugin_state = dir.path().join(format!("{backend}-plugin-agents"));
        let command = format!(
            "{} --backend {backend} --fake-latency-ms 0,0 --process-state-dir {} --listen unix:{}",
            builtin_provider.display(),
            plugin_state.display(),
            dir.path().join(format!("{backend}.sock")).display()
        );
        let plugin = ClusterOptions::default()
            .insecure()
            .executor("--backend", "none")
            .executor("--plugin-command", &command);
        let count = if backend == "fake" { n } else { agents };
        let mut rates = Vec::new();
        for opts in [builtin, plugin] {
            let cluster = Cluster::start(opts).await?;
            let uid = RunUid::from_u128(0xbe4d);
            let url = cluster.executor.url();
            let creates: Vec<pb::Operation> =
                (0..count).map(|i| provider_op(uid, i, backend, false)).collect();
            let created = link_rate_ops(url.clone(), uid, creates, true).await?;
            let rate = if backend == "process" {
                // Every agent is destroyed again, and that is timed too.
                let destroys: Vec<pb::Operation> =
                    (0..count).map(|i| provider_op(uid, i, backend, true)).collect();
                let destroyed = link_rate_ops(url, uid, destroys, true).await?;
                2.0 / (1.0 / created + 1.0 / destroyed)
            } else {
                created
            };
            rates.push(rate);
        }
        for root in [&state, &plugin_state] {
            for (pid, _, _) in provisioning_tests::procs::live_agent_pids(root) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
        let what = if backend == "fake" {
            "creates"
        } else {
            "creates and destroys"
        };
        t.add(
            "plugin",
            count,
            &format!("{backend} built in: {what}"),
            rates[0],
            "ops/s",
            String::new(),
        );
        t.add(
            "plugin",
            count,
            &format!("{backend} as a plugin: {what}"),
            rates[1],
            "ops/s",
            format!("{:.0}% of built in", 100.0 * rates[1] / rates[0]),
        );
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    // The small sizes show a per-pass latency floor (a fixed cost that
    // dominates a small run) coming back; the large ones, scaling.
    let mut sizes = vec![1u64, 10, 100, 1_000, 10_000, 100_000];
    let mut only: Option<BTreeSet<String>> = None;
    let mut csv = "target/bench.csv".to_owned();
    let mut throughput_ops = 20_000u64;
    let mut health_nodes = 100_000u64;
    let mut health_window = Duration::from_secs(30);
    let mut runs = 100u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--sizes" => {
                sizes = args
                    .next()
                    .context("--sizes needs a list")?
                    .split(',')
                    .map(|s| s.trim().parse::<u64>())
                    .collect::<Result<_, _>>()?;
            }
            "--only" => {
                only = Some(
                    args.next()
                        .context("--only needs a list")?
                        .split(',')
                        .map(String::from)
                        .collect(),
                )
            }
            "--csv" => csv = args.next().context("--csv needs a path")?,
            "--throughput-ops" => {
                throughput_ops = args.next().context("--throughput-ops needs a count")?.parse()?;
            }
            "--health-nodes" => {
                health_nodes = args.next().context("--health-nodes needs a count")?.parse()?;
            }
            "--health-window-s" => {
                let secs: f64 = args.next().context("--health-window-s needs seconds")?.parse()?;
                anyhow::ensure!(secs > 0.0, "--health-window-s must be above zero");
                health_window = Duration::try_from_secs_f64(secs)?;
            }
            "--runs" => {
                runs = args.next().context("--runs needs a count")?.parse()?;
            }
            "--help" | "-h" => {
                println!(
                    "bench [--sizes 1,10,100,1000,10000,100000] [--only decider,rpc,rpc-parts,sweep,e2e,e2e-hosted,throughput,health,rollout] \
                     [--csv PATH] [--throughput-ops 20000] [--health-nodes 100000] [--health-window-s 30] \
                     [--runs 100]"
                );
                return Ok(());
            }
            other => anyhow::bail!("unknown argument {other}"),
        }
    }
    let want = |k: &str| only.as_ref().is_none_or(|o| o.contains(k));
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("machine: {cpus} cores; {}", std::env::consts::ARCH);
    println!(
        "{:<12} {:>8} {:<34} {:>14} {:<8} ratio",
        "bench", "size", "metric", "value", "unit"
    );
    let mut t = Table::default();
    for &n in &sizes {
        let lib = if want("decider") || want("rpc") {
            Some(bench_decider(&mut t, n))
        } else {
            None
        };
        if want("rpc-parts") {
            bench_rpc_parts(&mut t, n)?;
        }
        if want("rpc")
            && let Some(lib) = lib
        {
            bench_rpc(&mut t, n, lib).await?;
        }
    }
    if want("sweep") {
        for &n in &sizes {
            bench_sweep(&mut t, n);
        }
    }
    if want("throughput") {
        bench_throughput(&mut t, throughput_ops).await?;
    }
    if want("e2e") {
        for &n in &sizes {
            bench_e2e(&mut t, n).await?;
        }
    }
    // Not in the default set: the fake as a plugin is the plugin row's
    // subject; here it only takes the test double out of the executor.
    if only.as_ref().is_some_and(|o| o.contains("e2e-hosted")) {
        for &n in &sizes {
            bench_e2e_hosted(&mut t, n).await?;
        }
    }
    if want("runs") {
        for &n in sizes.iter().filter(|&&n| n >= runs) {
            bench_runs(&mut t, n, runs).await?;
        }
    }
    if want("plugin") {
        bench_plugin(&mut t, throughput_ops, 200).await?;
    }
    if want("health") {
        bench_health(&mut t, health_nodes, health_window).await?;
    }
    // Not in the default set: at 100,000 nodes it takes minutes.
    if only.as_ref().is_some_and(|o| o.contains("rollout")) {
        for &n in &sizes {
            bench_rollout(&mut t, n)?;
        }
    }
    if let Some(dir) = std::path::Path::new(&csv).parent() {
        std::fs::create_dir_all(dir)?;
    }
    t.write_csv(&csv)?;
    println!("wrote {csv}");
    Ok(())
}
