//! Level 2: the three real binaries over gRPC as a [`SystemUnderTest`].
//!
//! The run is driven through the public API and the executor's link goes
//! through a [`Proxy`] that can cut it. Faults come from the fake backend's
//! seeded chaos (`--fake-faults chaos --fake-seed`: failed, hung and
//! ambiguous calls, and resources lost, sickened and healed at its fault
//! ticks), and are switched by restarting the executor with other flags; its
//! state file keeps the provider's resources (and which are sick) across the
//! restart, as a real provider would. The `lose`, `sicken` and `heal` inputs
//! go through the fake's control service (`--fake-control`, a test double):
//! the executor reports the loss on the link, and its prober finds the
//! sickness (every group the battery makes is probed). The fair tail restarts
//! the executor with `--fake-faults none`; a resource still sick then is the
//! driver's to replace for health.
//!
//! The oracle sees two things after every round. States: the run's status
//! with every node (attempts, stages, facts, pending operations, retry state)
//! and the executor's `Inventory` of live resources, polled. And events: each
//! service runs with `--event-trace` and writes what it received, decided,
//! recorded and dispatched as JSON lines, and [`super::traces`] reads the new
//! lines after every round and rebuilds the events the in-memory system
//! records (transitions with their cause, passes, submissions, backend calls,
//! the executor's results), so the event checks run here too. Every executor
//! of a seed keeps its dedup table and fencing epochs in one state directory,
//! so a restarted executor replays what it completed, as a deployed one does.
//!
//! # What is still not checked across processes
//!
//! - Guarantee 16 (determinism): real processes on a wall clock do not replay
//!   a trace identically; the replays run at level 1.
//! - Guarantee 20's spin check: in memory a due wake-up with no pass to run is
//!   seen directly; the driver writes no line for a timer that wakes and finds
//!   nothing, so only runs of barren passes at one millisecond are counted.
//!   Its limit probes (a pass at a saturated clock, an exhausted attempt
//!   allocator) and guarantee 15's probe need a copy of the driver's state.
//! - Guarantee 4 at rest: the driver's committed store is a redb file its
//!   process holds; guarantee 4 is checked at every submission instead (the
//!   trace's commit lines say what was committed before each dispatch).
//!   Likewise guarantee 8's "no operation kept for resubmission" and
//!   guarantee 1's allocator read the store.
//! - Guarantee 7's conflicting resubmissions: nothing outside the processes
//!   can submit on the driver's link, so the level-2 alphabet has no conflict
//!   probe; replays and re-sends are checked.
//! - Inside the backend: the checks on backend calls (guarantee 10, a destroy
//!   while the session streams; guarantee 19, a create while another attempt
//!   of the slot holds a resource; no double-create, a second lease made) read
//!   a model built from the executor's results and observations
//!   ([`super::traces`]), not the provider's own state; the polled inventory
//!   (and at level 3 the process table) checks the provider's.
//! - Forced outcomes (`inject`), resends of chosen messages, driver restarts
//!   and clock jumps are not in the level-2 alphabet: faults come from the
//!   fake backend's chaos, link cuts, executor restarts and the day-2 inputs.
//! - Day 2, timing: the status is read before the traces, so a health or
//!   loss report can be on its way while a converged status is read.
//!   Guarantee 23 counts a report as the executor's word only from the round
//!   after the executor received the driver's acknowledgement of it (the
//!   driver acknowledges after its commit); converged-leaks-nothing counts a
//!   converged run that does not match the backend only when the same
//!   mismatch is read at the next round too; guarantee 15's comparison
//!   around the safety tick leaves out the health reports folded meanwhile
//!   (probes go on while it waits). A report the driver never acknowledges
//!   is not counted at all.
//! - Guarantee 21 is judged when the fair tail ends without converging: a
//!   level-2 run converges as soon as its status says so, possibly before
//!   the prober's first probe of a node still sick after the executor's
//!   restart, which the tail then never waits for.
//! - Guarantee 22 is checked on the driver's transitions from its trace;
//!   the executor's probes themselves (their timing, the startup grace) are
//!   not checked, only what they reported.
//!
//! Level 3 ([`ServiceSut::start_process`]) is the same system with the process
//! backend: agent faults travel in the templates' boot parameters
//! ([`world_l3`], [`faulty_shape`]), the tail applies [`clean_shape`], and every
//! round also carries samples of the live agents in the OS process table
//! ([`live_agents`]). The day-2 inputs signal the attempt's node agent, found
//! in that table: `lose` kills it (SIGKILL; the executor's pidfd watch reports
//! it), `sicken` stops it (SIGSTOP; its kernel still accepts connections, so
//! only the executor's `ping` probe finds it) and `heal` continues it
//! (SIGCONT). An agent still stopped when the tail starts is the driver's to
//! replace for health.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use contract::{
    AttemptId, ClusterShape, Generation, LogicalNodeId, NodeTemplate, Param, RunUid, UnixMillis, pb,
    pb::{fake::v1::Fault, provisioning_client::ProvisioningClient},
    shape::example_template,
    wire::{node_from_wire, shape_from_wire},
};
use tonic::{Code, transport::Channel};

use super::{
    input::{Bad, FaultMix, Input},
    record::{ApplyKind, ApplyRecord, Phase, Resource, RunSnapshot, StepRecord, StepRef, Verdict},
    runner::SystemUnderTest,
    traces::{TracePaths, TraceTamper, Translator},
    world::{RUN_ID, World, bad_shape, changed_shape, rollout_halt, with_surge},
};
use crate::{
    procs::{Cluster, ClusterOptions, Proxy, Service, live_agent_pids},
    sim::{Delivery, Rng},
};

/// The driver's policy flags at level 2, short so that a run converges in
/// seconds of real time.
const BACKOFF_BASE_MS: u64 = 50;
const BACKOFF_CAP_MS: u64 = 400;
const PROBE_MS: u64 = 20;
const OPERATION_TIMEOUT_MS: u64 = 1_500;
const RESULT_GRACE_MS: u64 = 300;
const STAGE_TIMEOUT_MS: u64 = 2_500;
const SAFETY_TICK_MS: u64 = 500;

/// Real time per scheduler step of a trace, and the longest one `Step` input
/// waits.
const STEP: Duration = Duration::from_millis(15);
const MAX_WAIT: Duration = Duration::from_millis(400);
/// Real time between two polls of the fair tail.
const ROUND: Duration = Duration::from_millis(60);
/// The longest the fair tail (or the deletion) may take in real time.
pub const TAIL_LIMIT: Duration = Duration::from_secs(25);

/// The world of a level-2 seed: its initial shape and the driver policy the
/// flags above give (the oracle's backoff checks need the latter).
pub fn world(seed: u64) -> World {
    let mut w = World::new(seed, Delivery::InOrder);
    let ms = Duration::from_millis;
    w.policy.backoff.base = ms(BACKOFF_BASE_MS);
    w.policy.backoff.cap = ms(BACKOFF_CAP_MS);
    w.policy.probe_interval = ms(PROBE_MS);
    w.policy.operation_timeout = ms(OPERATION_TIMEOUT_MS);
    w.policy.result_grace = ms(RESULT_GRACE_MS);
    w.policy.endpoint_timeout = ms(STAGE_TIMEOUT_MS);
    w.policy.bootstrap_timeout = ms(STAGE_TIMEOUT_MS);
    w.fake.endpoint_delay_ms = 0;
    w
}

fn wall_clock() -> UnixMillis {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    UnixMillis::new(ms)
}

/// Level 3: the world of `seed` for the process backend. Its initial templates
/// carry `fault.*` boot parameters for some groups (the agents themselves fail,
/// crash, hang or delay their endpoint), drawn from the seed.
pub fn world_l3(seed: u64) -> World {
    let mut w = world(seed);
    let mut rng = Rng::new(seed ^ 0x510e_527f_ade6_82d1);
    w.initial = faulty_shape(&w.initial, &mut rng, false);
    w
}

/// The bootstrap stages an agent can be told to fail, crash or hang at.
const STAGES: [&str; 5] = ["connected", "boot-check", "agent-started", "joined", "converged"];

fn strip_faults(t: &mut NodeTemplate) {
    t.boot.retain(|k, _| !k.starts_with("fault."));
}

/// `current` with fresh agent faults: every group loses its `fault.*` boot
/// parameters and about half get one new fault (at the next generation if
/// `bump`).
pub fn faulty_shape(current: &ClusterShape, rng: &mut Rng, bump: bool) -> ClusterShape {
    let mut s = current.clone();
    if bump {
        s.generation = Generation::new(current.generation.get() + 1);
    }
    for g in &mut s.groups {
        let t = Arc::make_mut(&mut g.template);
        strip_faults(t);
        if !rng.chance(0.5) {
            continue;
        }
        let stage = STAGES[rng.below(STAGES.len() as u64) as usize].to_owned();
        let (key, value) = match rng.below(10) {
            0..=2 => ("fault.crash_at", stage),
            3..=5 => ("fault.fail_at", stage),
            6..=8 => (
                "fault.endpoint_delay_ms",
                ["100", "400", "1200"][rng.below(3) as usize].to_owned(),
            ),
            _ => ("fault.hang_at", stage),
        };
        t.boot.insert(key.to_owned(), Param { value, secret: false });
    }
    // A template whose attempts fail halts its rollout after a failure or
    // two and mostly reverts it (`world::rollout_halt`); others never halt.
    for g in &mut s.groups {
        let failing = ["fault.crash_at", "fault.fail_at"]
            .iter()
            .any(|k| g.template.boot.contains_key(*k));
        let rollout = &mut g.policy.rollout;
        (rollout.failure_threshold, rollout.auto_revert) = if failing {
            rollout_halt(s.generation.get())
        } else {
            (0, false)
        };
    }
    s
}

/// `current` without any agent fault, at the next generation: what the fair
/// tail applies at level 3.
pub fn clean_shape(current: &ClusterShape) -> ClusterShape {
    let mut s = current.clone();
    s.generation = Generation::new(current.generation.get() + 1);
    for g in &mut s.groups {
        strip_faults(Arc::make_mut(&mut g.template));
        (g.policy.rollout.failure_threshold, g.policy.rollout.auto_revert) = (0, false);
    }
    s
}

/// `shape` with the battery's provider name (`fake`) replaced by
/// `provider`. Only that name: a shape made invalid on purpose keeps its
/// fault.
fn named(mut shape: ClusterShape, provider: &str) -> ClusterShape {
    if provider != "fake" {
        for g in &mut shape.groups {
            if g.template.provider.name == "fake" {
                Arc::make_mut(&mut g.template).provider.name = provider.to_owned();
            }
        }
    }
    shape
}

/// A `lose`, `sicken` or `heal` through a plugin's testing hooks
/// (`ProviderTesting`). A resource the plugin does not hold is left alone.
async fn test_hook(
    address: &str,
    run_uid: RunUid,
    node: &LogicalNodeId,
    attempt: AttemptId,
    fault: Fault,
) -> anyhow::Result<()> {
    use provider_sdk::wire::{identity_to_wire, pb as ppb};
    let channel = executor_svc::plugin::channel(address, &platform::tls::Transport::Insecure)
        .map_err(|e| anyhow::anyhow!("{address}: {e}"))?;
    let mut testing = ppb::provider_testing_client::ProviderTestingClient::new(channel);
    let identity = Some(identity_to_wire(&contract::ResourceIdentity {
        run_uid,
        run_id: contract::RunId::parse("run_id", RUN_ID)?,
        node: node.clone(),
        attempt,
    }));
    match fault {
        Fault::Lose => {
            testing.lose(ppb::LoseRequest { identity }).await?;
        }
        Fault::Sicken | Fault::Heal | Fault::Unspecified => {
            testing
                .set_healthy(ppb::SetHealthyRequest {
                    identity,
                    healthy: fault != Fault::Sicken,
                })
                .await?;
        }
    }
    Ok(())
}

/// Live node agents whose state is under `root`, from the OS process table
/// (`/proc`), as resources whose lease is the agent's PID. A zombie has an
/// empty command line and is not live.
pub fn live_agents(root: &Path) -> Vec<Resource> {
    live_agent_pids(root)
        .into_iter()
        .filter_map(|(pid, node, attempt)| {
            Some(Resource {
                node: LogicalNodeId::parse("node_id", &node).ok()?,
                attempt: AttemptId::new(attempt.parse().ok()?),
                lease: pid.to_string(),
                session_live: false,
            })
        })
        .collect()
}

/// SIGKILLs every live node agent under `root` (a test's last resort, after
/// the run's deletion); returns how many it killed.
pub fn kill_agents(root: &Path) -> usize {
    let pids = live_agent_pids(root);
    for (pid, _, _) in &pids {
        let _ = std::process::Command::new("kill")
            .arg("-KILL")
            .arg(pid.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
    pids.len()
}

/// Level 3: where the agents live, the seeded faults, and the process-table
/// samples taken since the last round.
#[derive(Debug)]
struct Agents {
    dir: PathBuf,
    rng: Rng,
    samples: Vec<Vec<Resource>>,
}

/// Real time between two samples of the process table while a round waits.
const SAMPLE: Duration = Duration::from_millis(20);

/// How long the agents' kill grace is at level 3.
const KILL_GRACE_MS: u64 = 200;

/// The three services of one seed.
#[derive(Debug)]
pub struct ServiceSut {
    // Declared before the runtime so that the processes are killed first.
    cluster: Cluster,
    agents: Option<Agents>,
    proxy: Proxy,
    client: ProvisioningClient<Channel>,
    backend: Backend,
    world: World,
    uid: Option<String>,
    round: u64,
    /// The services' event traces, read after every round.
    traces: Translator,
    trace_paths: TracePaths,
    rt: tokio::runtime::Runtime,
}

/// Which provider the battery's executor serves its operations through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// The built-in fake, with its seeded chaos (level 2).
    Fake,
    /// The built-in process backend (level 3).
    Process,
    /// The process backend as a plugin the executor starts and supervises
    /// (level 3 through the provider protocol).
    ProcessPlugin,
    /// A plugin already running at `address` that serves `provider` (the
    /// conformance kit's battery): level 2, with its testing hooks.
    Plugin { address: String, provider: String },
}

impl Backend {
    /// The provider name the shapes must carry.
    fn provider(&self) -> &str {
        match self {
            Backend::Fake => "fake",
            Backend::Process | Backend::ProcessPlugin => "process",
            Backend::Plugin { provider, .. } => provider,
        }
    }

    fn has_agents(&self) -> bool {
        matches!(self, Backend::Process | Backend::ProcessPlugin)
    }
}

/// The executor's flags. Every executor of a seed writes the same event
/// trace (a restart appends).
fn executor_args(
    seed: u64,
    faults: FaultMix,
    dir: &Path,
    agents: Option<&Path>,
    backend: &Backend,
) -> Vec<String> {
    let durable = [
        "--event-trace".to_owned(),
        TracePaths::in_dir(dir).executor.display().to_string(),
    ];
    // Through a plugin: one at an address, or the process backend as a plugin
    // the executor starts.
    let plugin = match (backend, agents) {
        (Backend::Plugin { address, .. }, _) => Some(("--plugin", address.clone())),
        (Backend::ProcessPlugin, Some(agents)) => Some((
            "--plugin-command",
            format!(
                "{} --backend process --process-state-dir {} --listen unix:{} --health-interval-ms 200",
                crate::procs::bin_path("builtin-provider")
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|_| "builtin-provider".to_owned()),
                agents.display(),
                dir.join("provider.sock").display(),
            ),
        )),
        _ => None,
    };
    if let Some((flag, value)) = plugin {
        return [
            "--backend",
            "none",
            flag,
            &value,
            "--plugin-health-interval-ms",
            "200",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain(durable)
        .collect();
    }
    if let Some(agents) = agents {
        return [
            "--backend",
            "process",
            "--process-state-dir",
            &agents.display().to_string(),
            "--process-kill-grace-ms",
            &KILL_GRACE_MS.to_string(),
        ]
        .into_iter()
        .map(str::to_owned)
        .chain(durable)
        .collect();
    }
    let state = dir.join("fake-state.json");
    let faults = if faults == FaultMix::None { "none" } else { "chaos" };
    [
        "--backend",
        "fake",
        "--fake-latency-ms",
        "1,20",
        "--fake-stage-interval-ms",
        "5",
        "--fake-faults",
        faults,
        "--fake-seed",
        &seed.to_string(),
        "--fake-state-file",
        &state.display().to_string(),
        // The `lose`, `sicken` and `heal` inputs go through it.
        "--fake-control",
    ]
    .into_iter()
    .map(str::to_owned)
    .chain(durable)
    .collect()
}

impl ServiceSut {
    /// Starts the services for `world`, with the executor's chaos on.
    pub fn start(world: &World) -> anyhow::Result<Self> {
        Self::start_with(world, Backend::Fake, None)
    }

    /// Level 3: starts the services for `world` with the process backend, its
    /// agents under a state directory of their own.
    pub fn start_process(world: &World) -> anyhow::Result<Self> {
        Self::start_with(world, Backend::Process, None)
    }

    /// Starts the services for `world` over `backend`.
    pub fn start_on(world: &World, backend: Backend) -> anyhow::Result<Self> {
        Self::start_with(world, backend, None)
    }

    /// Starts the services for `world` with the reading of their traces
    /// corrupted by `tamper` (to show the trace checks can fail).
    pub fn start_tampered(world: &World, tamper: TraceTamper) -> anyhow::Result<Self> {
        Self::start_with(world, Backend::Fake, Some(tamper))
    }

    fn start_with(world: &World, backend: Backend, tamper: Option<TraceTamper>) -> anyhow::Result<Self> {
        let process = backend.has_agents();
        let mut world = world.clone();
        world.initial = named(world.initial, backend.provider());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let dir = tempfile::tempdir()?;
        let trace_paths = TracePaths::in_dir(dir.path());
        let agents = process.then(|| Agents {
            dir: dir.path().join("agents"),
            rng: Rng::new(world.seed ^ 0x9b05_688c_2b3e_6c1f),
            samples: Vec::new(),
        });
        let executor_args = executor_args(
            world.seed,
            FaultMix::Chaos,
            dir.path(),
            agents.as_ref().map(|a| a.dir.as_path()),
            &backend,
        );
        let (cluster, proxy, client) = rt.block_on(async {
            let proxy = Proxy::start().await?;
            let mut opts = ClusterOptions {
                executor_args,
                ..ClusterOptions::default()
            };
            for (flag, v) in [
                ("--backoff-base-ms", BACKOFF_BASE_MS),
                ("--backoff-cap-ms", BACKOFF_CAP_MS),
                ("--probe-interval-ms", PROBE_MS),
                ("--operation-timeout-ms", OPERATION_TIMEOUT_MS),
                ("--result-grace-ms", RESULT_GRACE_MS),
                ("--endpoint-timeout-ms", STAGE_TIMEOUT_MS),
                ("--bootstrap-timeout-ms", STAGE_TIMEOUT_MS),
                ("--safety-tick-ms", SAFETY_TICK_MS),
                ("--max-nodes-per-group", u64::from(super::world::LIMIT_PER_GROUP)),
            ] {
                opts = opts.driver(flag, &v.to_string());
            }
            // `CONFORMANCE_ORPHAN_SWEEP_MS=<ms>` runs the battery with the
            // orphan sweep on, destroying what it confirms.
            if let Some(ms) = std::env::var("CONFORMANCE_ORPHAN_SWEEP_MS")
                .ok()
                .filter(|v| !v.is_empty())
            {
                opts = opts.driver("--orphan-sweep-ms", &ms);
            }
            opts = opts
                .driver("--event-trace", &trace_paths.driver.display().to_string())
                .service_env(
                    "decider-svc",
                    "PROVISIONING_EVENT_TRACE",
                    &trace_paths.decider.display().to_string(),
                );
            opts.executor_via = Some(format!("http://{}", proxy.addr));
            // A plugin at a TCP address (the kit reaches it in plaintext) is
            // reached by the executor with the cluster's transport: the
            // cluster runs in plaintext then. A Unix socket needs no TLS.
            if let Backend::Plugin { address, .. } = &backend
                && !address.starts_with("unix:")
            {
                opts = opts.insecure();
            }
            let cluster = Cluster::start_in(dir, opts).await?;
            proxy.set_target(cluster.executor.addr);
            let client = cluster.client().await?;
            anyhow::Ok((cluster, proxy, client))
        })?;
        Ok(Self {
            cluster,
            agents,
            proxy,
            client,
            backend,
            world: world.clone(),
            uid: None,
            round: 0,
            traces: Translator::new(&trace_paths, RUN_ID, tamper),
            trace_paths,
            rt,
        })
    }

    /// The world as the services run it: its shapes name the provider the
    /// executor serves. The oracle must judge against this one.
    pub fn world(&self) -> &World {
        &self.world
    }

    /// Level 3: where the agents live.
    pub fn agents_dir(&self) -> Option<&Path> {
        self.agents.as_ref().map(|a| a.dir.as_path())
    }

    /// Level 3's cleanup, also after a failure: deletes the run, waits (a
    /// little) for its agents to be destroyed, then SIGKILLs any agent left
    /// under the state directory. Returns how many it had to kill.
    pub fn reap_agents(&mut self) -> usize {
        let Some(dir) = self.agents.as_ref().map(|a| a.dir.clone()) else {
            return 0;
        };
        let mut c = self.client.clone();
        let deleted = self
            .rt
            .block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(2),
                    c.delete_run(pb::DeleteRunRequest {
                        run_id: RUN_ID.to_owned(),
                    }),
                )
                .await
            })
            .is_ok_and(|r| r.is_ok());
        if deleted {
            let until = std::time::Instant::now() + Duration::from_secs(5);
            while !live_agent_pids(&dir).is_empty() && std::time::Instant::now() < until {
                std::thread::sleep(SAMPLE);
            }
        }
        kill_agents(&dir)
    }

    /// Stops the services.
    pub fn stop(mut self) {
        self.rt.block_on(async {
            for s in [
                &mut self.cluster.driver,
                &mut self.cluster.executor,
                &mut self.cluster.decider,
            ] {
                let _ = s.kill().await;
            }
        });
    }

    /// Prints the services' logs and the end of their event traces (for a
    /// failing seed).
    pub fn dump_logs(&self) {
        self.cluster.dump_logs();
        let p = &self.trace_paths;
        // `CONFORMANCE_KEEP_TRACES=<dir>` keeps the whole traces there.
        let keep = std::env::var_os("CONFORMANCE_KEEP_TRACES").map(PathBuf::from);
        for path in [&p.driver, &p.executor, &p.decider] {
            eprintln!("--- the last lines of {} ---", path.display());
            for line in super::traces::tail(path, 40) {
                eprintln!("{line}");
            }
            if let (Some(dir), Some(name)) = (&keep, path.file_name()) {
                let to = dir.join(format!("seed{}-{}", self.world.seed, name.to_string_lossy()));
                match std::fs::create_dir_all(dir).and_then(|()| std::fs::copy(path, &to)) {
                    Ok(_) => eprintln!("kept {}", to.display()),
                    Err(e) => eprintln!("cannot keep {}: {e}", path.display()),
                }
            }
        }
    }

    /// Trace lines read so far, per service.
    pub fn trace_lines(&self) -> &std::collections::BTreeMap<String, u64> {
        &self.traces.lines
    }

    fn at(&self, phase: Phase, input: Option<usize>) -> StepRef {
        StepRef {
            phase,
            input,
            round: self.round,
        }
    }

    /// The run's status, or `None` once it is gone.
    fn status(&mut self) -> anyhow::Result<Option<pb::RunStatus>> {
        let mut c = self.client.clone();
        let r = self.rt.block_on(c.get_run(pb::GetRunRequest {
            run_id: RUN_ID.to_owned(),
            include_nodes: true,
        }));
        match r {
            Ok(s) => Ok(Some(s.into_inner())),
            Err(e) if e.code() == Code::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn snapshot(&mut self) -> anyhow::Result<RunSnapshot> {
        let uid = |s: &str| RunUid::parse("run_uid", s).unwrap_or(RunUid::from_u128(0));
        let Some(s) = self.status()? else {
            return Ok(RunSnapshot {
                uid: uid(self.uid.as_deref().unwrap_or_default()),
                gone: true,
                deleting: true,
                generation: Generation::new(0),
                observed_generation: Generation::new(0),
                shape: None,
                converged: false,
                next_attempt: None,
                nodes: Default::default(),
                successors: Default::default(),
                spec_current: Default::default(),
                store: None,
                passes: 0,
            });
        };
        self.uid = Some(s.run_uid.clone());
        // Node specs travel as references into a table the status does not
        // carry; a placeholder stands in, and `spec_current` says the rest.
        let max_ref = s
            .nodes
            .iter()
            .filter_map(|n| n.state.as_ref())
            .map(|n| {
                n.template_ref
                    .max(n.retry.as_ref().map_or(0, |r| r.permanent_template_ref))
            })
            .max()
            .unwrap_or(0);
        let placeholder = Arc::new(example_template("fake", "placeholder"));
        let templates: Vec<Arc<NodeTemplate>> = vec![placeholder; max_ref as usize + 1];
        let mut nodes = std::collections::BTreeMap::new();
        let mut successors = std::collections::BTreeMap::new();
        let mut spec_current = std::collections::BTreeMap::new();
        for n in s.nodes {
            let Some(state) = n.state else { continue };
            let node = node_from_wire(state, &templates)?;
            // A slot's successor is listed after the run's nodes.
            if node.surge == contract::Surge::Successor {
                successors.insert(node.id.clone(), node);
                continue;
            }
            spec_current.insert(node.id.clone(), n.spec_current);
            nodes.insert(node.id.clone(), node);
        }
        let phase = pb::RunPhase::try_from(s.phase).unwrap_or(pb::RunPhase::Unspecified);
        Ok(RunSnapshot {
            uid: uid(&s.run_uid),
            gone: phase == pb::RunPhase::Deleted,
            deleting: matches!(phase, pb::RunPhase::Deleting | pb::RunPhase::Deleted),
            generation: Generation::new(s.generation),
            observed_generation: Generation::new(s.observed_generation),
            shape: s.shape.map(shape_from_wire).transpose()?,
            converged: s.converged,
            next_attempt: None,
            nodes,
            successors,
            spec_current,
            store: None,
            passes: s.passes,
        })
    }

    fn inventory(&mut self) -> anyhow::Result<Vec<Resource>> {
        let Some(uid) = self.uid.clone() else {
            return Ok(Vec::new());
        };
        let all = self.rt.block_on(self.cluster.inventory())?;
        let mut out = Vec::new();
        for r in all.into_iter().filter(|r| r.run_uid == uid) {
            out.push(Resource {
                node: LogicalNodeId::parse("node_id", &r.node_id)?,
                attempt: AttemptId::new(r.attempt),
                lease: r.lease_id,
                session_live: r.session_live,
            });
        }
        Ok(out)
    }

    fn record(
        &mut self,
        phase: Phase,
        index: Option<usize>,
        input: Option<Input>,
        apply: Option<ApplyRecord>,
    ) -> anyhow::Result<StepRecord> {
        let state = self.snapshot()?;
        let inventory = self.inventory()?;
        let processes = match &mut self.agents {
            Some(a) => {
                let mut samples = std::mem::take(&mut a.samples);
                samples.push(live_agents(&a.dir));
                samples
            }
            None => Vec::new(),
        };
        let quiescent = state.gone || (state.converged && state.nodes.values().all(|n| n.pending.is_none()));
        // Read after the state: what the traces show up to now covers at least
        // what led to the state just read.
        let events = self.traces.events()?;
        Ok(StepRecord {
            at: self.at(phase, index),
            input,
            now: wall_clock(),
            events,
            apply,
            state,
            inventory: Some(inventory),
            processes,
            quiescent,
            probes: Vec::new(),
            events_after_state: true,
        })
    }

    fn current_shape(&mut self) -> anyhow::Result<Option<ClusterShape>> {
        Ok(self.snapshot()?.shape)
    }

    /// Applies the shape `next` makes of the run's current one, as a client
    /// would: when the driver took a generation of its own (a revert)
    /// between the read and the apply, which refuses the apply's generation,
    /// it reads the run again and makes the shape anew (at most a few times).
    fn apply_next(
        &mut self,
        next: &mut dyn FnMut(&mut Self, &ClusterShape) -> ClusterShape,
    ) -> anyhow::Result<Option<ApplyRecord>> {
        let mut tries = 0;
        loop {
            let Some(current) = self.current_shape()? else {
                return Ok(None);
            };
            let shape = next(self, &current);
            let a = self.apply_valid(shape)?;
            tries += 1;
            let moved = tries < 4
                && matches!(a.verdict, Verdict::Rejected(_))
                && self
                    .current_shape()?
                    .is_some_and(|s| s.generation > current.generation);
            if !moved {
                return Ok(Some(a));
            }
        }
    }

    fn apply_wire(
        &mut self,
        kind: ApplyKind,
        submitted: ClusterShape,
        wire: pb::ClusterShape,
    ) -> anyhow::Result<ApplyRecord> {
        let before = self.snapshot()?;
        let mut c = self.client.clone();
        let r = self.rt.block_on(c.apply(pb::ApplyRequest { shape: Some(wire) }));
        let verdict = match r {
            Ok(resp) if resp.get_ref().changed => Verdict::Changed,
            Ok(_) => Verdict::Unchanged,
            Err(e) if matches!(e.code(), Code::InvalidArgument | Code::FailedPrecondition) => {
                Verdict::Rejected(format!("{:?}: {}", e.code(), e.message()))
            }
            Err(e) => return Err(e.into()),
        };
        Ok(ApplyRecord {
            kind,
            submitted,
            verdict,
            before,
            exact: false,
        })
    }

    fn restart_executor(&mut self, faults: FaultMix) -> anyhow::Result<()> {
        let args = executor_args(
            self.world.seed,
            faults,
            self.cluster.dir.path(),
            self.agents.as_ref().map(|a| a.dir.as_path()),
            &self.backend,
        );
        // A restarted executor keeps its dedup table and fencing epochs where
        // the cluster's first executor keeps them, so it replays what it
        // completed rather than running it again.
        let args: Vec<String> = [
            "--state-dir".to_owned(),
            self.cluster
                .dir
                .path()
                .join("executor-state")
                .display()
                .to_string(),
        ]
        .into_iter()
        .chain(args)
        .collect();
        let dir = self.cluster.dir.path().to_owned();
        let svc = self.rt.block_on(async {
            self.cluster.executor.kill().await?;
            Service::start("executor-svc", &dir, "127.0.0.1:0", &args).await
        })?;
        self.proxy.set_target(svc.addr);
        // The driver's stream went with the old process; it reconnects.
        self.proxy.cut();
        self.cluster.executor = svc;
        Ok(())
    }

    fn wait(&mut self, d: Duration) {
        let Some(a) = &mut self.agents else {
            std::thread::sleep(d);
            return;
        };
        // Level 3 samples the process table while it waits.
        let until = std::time::Instant::now() + d;
        loop {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(SAMPLE));
            a.samples.push(live_agents(&a.dir));
        }
    }

    /// A `lose`, `sicken` or `heal` input: the fault goes to the current
    /// attempt of the slot at `slot` (modulo the slots the run holds, in slot
    /// order), through the fake's control service, or (level 3) as a signal
    /// to the attempt's node agent. A slot with no resource to hit (not yet
    /// created, already gone) is left alone, as in memory.
    fn inflict(&mut self, slot: u8, fault: Fault) -> anyhow::Result<()> {
        let state = self.snapshot()?;
        let nodes: Vec<&contract::ManagedNode> = state.nodes.values().collect();
        if nodes.is_empty() {
            return Ok(());
        }
        let n = nodes[usize::from(slot) % nodes.len()];
        if let Backend::Plugin { address, .. } = &self.backend {
            return self
                .rt
                .block_on(test_hook(address, state.uid, &n.id, n.attempt, fault));
        }
        if let Some(a) = &self.agents {
            let signal = match fault {
                Fault::Lose => rustix::process::Signal::KILL,
                Fault::Sicken => rustix::process::Signal::STOP,
                Fault::Heal | Fault::Unspecified => rustix::process::Signal::CONT,
            };
            let pid = live_agents(&a.dir)
                .into_iter()
                .find(|r| r.node == n.id && r.attempt == n.attempt)
                .and_then(|r| r.lease.parse::<i32>().ok())
                .and_then(rustix::process::Pid::from_raw);
            if let Some(pid) = pid {
                // The agent may have ended since the table was read.
                let _ = rustix::process::kill_process(pid, signal);
            }
            return Ok(());
        }
        let request = pb::fake::v1::InflictRequest {
            run_uid: state.uid.to_string(),
            node_id: n.id.to_string(),
            attempt: n.attempt.get(),
            fault: fault as i32,
        };
        let answer = self.rt.block_on(async {
            let mut control = self.cluster.fake_control().await?;
            anyhow::Ok(control.inflict(request).await)
        })?;
        match answer {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Code::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Level 3: applies `shape` (a valid update) and records it.
    fn apply_valid(&mut self, shape: ClusterShape) -> anyhow::Result<ApplyRecord> {
        let shape = named(shape, self.backend.provider());
        let wire = pb::ClusterShape::from(&shape);
        self.apply_wire(ApplyKind::Valid, shape, wire)
    }
}

impl Drop for ServiceSut {
    /// No agent outlives its test, even one that panicked: the last resort
    /// after [`ServiceSut::reap_agents`].
    fn drop(&mut self) {
        if let Some(a) = &self.agents {
            kill_agents(&a.dir);
        }
    }
}

impl SystemUnderTest for ServiceSut {
    fn initial(&mut self) -> anyhow::Result<StepRecord> {
        let shape = self.world.initial.clone();
        let mut c = self.client.clone();
        let created = self.rt.block_on(c.apply(pb::ApplyRequest {
            shape: Some(pb::ClusterShape::from(&shape)),
        }))?;
        self.uid = Some(created.into_inner().run_uid);
        self.record(Phase::Prefix, None, None, None)
    }

    fn input(&mut self, index: usize, input: &Input) -> anyhow::Result<Vec<StepRecord>> {
        let phase = Phase::Prefix;
        let apply = match input {
            Input::Step(n) => {
                self.wait((STEP * u32::from(*n)).min(MAX_WAIT));
                self.round += 1;
                None
            }
            Input::Apply(c) => {
                self.apply_next(&mut |_, current| with_surge(current, changed_shape(current, *c)))?
            }
            Input::Reject(b) => match self.current_shape()? {
                Some(current) => {
                    let (shape, wire) = if *b == Bad::RunId {
                        // Over the API a shape's run id addresses the run, so
                        // another run id is another run; the run-id contract
                        // is a group that names another run.
                        let shape = named(bad_shape(&current, Bad::SameGeneration), self.backend.provider());
                        let mut s = current.clone();
                        s.generation = Generation::new(current.generation.get() + 1);
                        let mut wire = pb::ClusterShape::from(&s);
                        if let Some(g) = wire.groups.first_mut() {
                            g.run_id = "other-run".to_owned();
                        }
                        (shape, wire)
                    } else {
                        let shape = named(bad_shape(&current, *b), self.backend.provider());
                        let wire = pb::ClusterShape::from(&shape);
                        (shape, wire)
                    };
                    Some(self.apply_wire(ApplyKind::Invalid, shape, wire)?)
                }
                None => None,
            },
            Input::Reapply => match self.current_shape()? {
                Some(current) => {
                    let wire = pb::ClusterShape::from(&current);
                    Some(self.apply_wire(ApplyKind::Same, current, wire)?)
                }
                None => None,
            },
            Input::LinkDown => {
                self.proxy.cut();
                None
            }
            // Level 3: new agent faults in the templates, at a new generation;
            // or (`none`) an executor restart over the same agents, which it
            // must adopt.
            Input::Faults(FaultMix::Chaos) if self.agents.is_some() => {
                self.apply_next(&mut |sut, current| {
                    let a = sut.agents.as_mut().unwrap_or_else(|| unreachable!());
                    with_surge(current, faulty_shape(current, &mut a.rng, true))
                })?
            }
            Input::Faults(m) => {
                self.restart_executor(*m)?;
                None
            }
            Input::Delete => {
                let mut c = self.client.clone();
                self.rt.block_on(c.delete_run(pb::DeleteRunRequest {
                    run_id: RUN_ID.to_owned(),
                }))?;
                None
            }
            Input::Lose(slot) => {
                self.inflict(*slot, Fault::Lose)?;
                None
            }
            Input::Sicken(slot) => {
                self.inflict(*slot, Fault::Sicken)?;
                None
            }
            Input::Heal(slot) => {
                self.inflict(*slot, Fault::Heal)?;
                None
            }
            // Not drivable from outside the processes.
            _ => None,
        };
        Ok(vec![self.record(
            phase,
            Some(index),
            Some(input.clone()),
            apply,
        )?])
    }

    fn calm(&mut self) -> anyhow::Result<StepRecord> {
        if self.agents.is_some() {
            // Level 3: the faults are in the templates; a new generation with
            // clean ones ends them.
            let apply = self.apply_next(&mut |_, current| with_surge(current, clean_shape(current)))?;
            return self.record(Phase::Tail, None, None, apply);
        }
        self.restart_executor(FaultMix::None)?;
        self.record(Phase::Tail, None, None, None)
    }

    fn repair(&mut self) -> anyhow::Result<Option<StepRecord>> {
        // Level-2 traces hold no permanently refused image and the chaos mix has
        // no permanent faults, so there is nothing to repair.
        Ok(None)
    }

    fn round(&mut self, phase: Phase) -> anyhow::Result<StepRecord> {
        self.wait(ROUND);
        self.round += 1;
        self.record(phase, None, None, None)
    }

    fn tick(&mut self, phase: Phase) -> anyhow::Result<StepRecord> {
        // The driver ticks on its own; waiting past one tick covers it.
        self.wait(Duration::from_millis(SAFETY_TICK_MS + 100));
        self.round += 1;
        self.record(phase, None, Some(Input::Tick), None)
    }

    fn delete(&mut self) -> anyhow::Result<StepRecord> {
        let mut c = self.client.clone();
        self.rt.block_on(c.delete_run(pb::DeleteRunRequest {
            run_id: RUN_ID.to_owned(),
        }))?;
        self.record(Phase::Teardown, None, None, None)
    }

    fn endpoint_probes(&self, _world: &World) -> u64 {
        1
    }

    fn extra_passes(&self, elapsed: Duration) -> u64 {
        // One full pass per safety tick.
        u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX) / SAFETY_TICK_MS + 2
    }

    fn max_rounds(&self, _bound: u64) -> u64 {
        (TAIL_LIMIT.as_millis() / ROUND.as_millis()) as u64
    }
}
