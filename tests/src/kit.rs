//! The provider conformance kit's seam contracts (SPEC.md section 10): what
//! every provider plugin must do at the protocol, checked by calling it
//! directly, as an executor would, and reading back what it lists and
//! reports. `provider-conformance` runs them, then the guarantee battery
//! through an executor that hosts the plugin.
//!
//! Each contract ends [`Verdict::Pass`], [`Verdict::Fail`] (with what was
//! seen) or [`Verdict::Skip`] (with why it cannot be checked here: the
//! restart contract needs a plugin the kit starts itself, the health contract
//! one that reports health). The kit's resources live under a run uid of its
//! own and are destroyed at the end.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    process::Stdio,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use contract::{ResourceIdentity, RunUid, shape::example_template};
use prost::Message as _;
use provider_sdk::wire::{identity_to_wire, pb, template_to_wire};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tonic::transport::Channel;

type Client = pb::provider_client::ProviderClient<Channel>;
type TestingClient = pb::provider_testing_client::ProviderTestingClient<Channel>;

/// How long one contract may wait for what it expects.
const PATIENCE: Duration = Duration::from_secs(60);
/// The deadline each call carries.
const CALL_DEADLINE: Duration = Duration::from_secs(30);

/// Where the plugin under test is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Already running: `unix:/path` or `host:port` (plaintext).
    Address(String),
    /// Started by the kit (`sh -c COMMAND`), which reads its announcement
    /// and can restart it.
    Command(String),
}

impl Target {
    /// `unix:/path` and `host:port` are addresses; anything else is a
    /// command.
    pub fn parse(s: &str) -> Self {
        let address = s.starts_with("unix:")
            || (!s.contains(char::is_whitespace) && s.parse::<std::net::SocketAddr>().is_ok());
        if address {
            Target::Address(s.to_owned())
        } else {
            Target::Command(s.to_owned())
        }
    }
}

/// The plugin under test, started (for a command) and connected.
#[derive(Debug)]
pub struct Plugin {
    pub target: Target,
    pub address: String,
    child: Option<tokio::process::Child>,
    /// Where a started plugin's standard error goes.
    pub log: Option<PathBuf>,
}

impl Plugin {
    /// Connects to the plugin, starting it first if it is a command.
    pub async fn start(target: Target, log: Option<PathBuf>) -> anyhow::Result<Self> {
        match &target {
            Target::Address(a) => Ok(Self {
                address: a.clone(),
                target,
                child: None,
                log,
            }),
            Target::Command(c) => {
                let (child, address) = spawn(c, log.as_deref()).await?;
                Ok(Self {
                    address,
                    target,
                    child: Some(child),
                    log,
                })
            }
        }
    }

    pub fn can_restart(&self) -> bool {
        self.child.is_some()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(tokio::process::Child::id)
    }

    /// SIGKILLs the plugin (a crash, not a shutdown) and starts it again.
    pub async fn crash_and_restart(&mut self) -> anyhow::Result<()> {
        let Target::Command(c) = &self.target else {
            anyhow::bail!("the kit did not start this plugin");
        };
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        let (child, address) = spawn(c, self.log.as_deref()).await?;
        self.child = Some(child);
        self.address = address;
        Ok(())
    }

    /// Ends a plugin the kit started: SIGTERM, then SIGKILL after 5 s.
    pub async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            if tokio::time::timeout(Duration::from_secs(5), child.wait())
                .await
                .is_ok()
            {
                return;
            }
        }
        let _ = child.kill().await;
    }

    pub fn client(&self) -> anyhow::Result<Client> {
        Ok(Client::new(self.channel()?))
    }

    pub fn testing(&self) -> anyhow::Result<TestingClient> {
        Ok(TestingClient::new(self.channel()?))
    }

    fn channel(&self) -> anyhow::Result<Channel> {
        executor_svc::plugin::channel(&self.address, &platform::tls::Transport::Insecure)
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.address))
    }
}

/// Starts `command` and reads its announcement.
async fn spawn(
    command: &str,
    log: Option<&std::path::Path>,
) -> anyhow::Result<(tokio::process::Child, String)> {
    let stderr = match log {
        Some(path) => Stdio::from(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?,
        ),
        None => Stdio::inherit(),
    };
    let mut child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(format!("exec {command}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {command:?}"))?;
    let stdout = child.stdout.take().context("the plugin's standard output")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .context("the plugin announced no address within 30 s")??
        .context("the plugin exited before announcing its address")?;
    let address = provider_sdk::announced_address(&line)
        .map_err(anyhow::Error::msg)?
        .to_owned();
    // Later lines are not the protocol's: drained so it never blocks.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, address))
}

/// How one contract ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail(String),
    Skip(String),
}

impl Verdict {
    /// A pass when nothing went wrong, else a failure saying all of it.
    fn of(problems: Vec<String>) -> Self {
        if problems.is_empty() {
            Verdict::Pass
        } else {
            Verdict::Fail(problems.join("; "))
        }
    }
}

/// The contracts' verdicts, in the order they ran.
#[derive(Debug, Default)]
pub struct Report {
    pub verdicts: Vec<(&'static str, Verdict)>,
    /// The provider name the contracts were checked for.
    pub provider: Option<String>,
}

impl Report {
    pub fn failed(&self) -> bool {
        self.verdicts.iter().any(|(_, v)| matches!(v, Verdict::Fail(_)))
    }

    fn record(&mut self, name: &'static str, v: Verdict) {
        println!("{}", line(name, &v));
        self.verdicts.push((name, v));
    }
}

/// A contract's line: `PASS`, `FAIL` or `SKIP`, the contract, and why.
fn line(name: &str, v: &Verdict) -> String {
    match v {
        Verdict::Pass => format!("PASS  {name}"),
        Verdict::Fail(why) => format!("FAIL  {name}: {why}"),
        Verdict::Skip(why) => format!("SKIP  {name}: {why}"),
    }
}

pub const INFO: &str = "GetInfo speaks protocol version 1 and names its providers";
pub const ONE_RESOURCE: &str = "one identity never yields two resources (a create again adopts)";
pub const CONCURRENT: &str = "concurrent creates of one identity yield one resource";
pub const ADOPT_AMBIGUOUS: &str = "a create adopts what an ambiguous create left";
pub const DEFINITE_FAILURE: &str = "a definite failure leaves nothing behind";
pub const NOT_READY: &str = "not-ready is not a failure (the endpoint is bound in time)";
pub const BOOTSTRAP: &str = "a bootstrap starts once per identity and reports its stages";
pub const ABSENT: &str = "cancel and destroy of an absent resource succeed";
pub const DESTROY: &str = "a destroy removes the resource, and again succeeds";
pub const LIST: &str = "list agrees with what exists";
pub const PAGES: &str = "the paged list agrees with the one-message list, its last page marked";
pub const LOSS: &str = "a loss is reported";
pub const HEALTH: &str = "health changes are reported";
pub const RESTART: &str = "a restart of the plugin loses nothing it reported";

/// Every contract, for the output's legend and the tests.
pub const CONTRACTS: [&str; 14] = [
    INFO,
    ONE_RESOURCE,
    CONCURRENT,
    ADOPT_AMBIGUOUS,
    DEFINITE_FAILURE,
    NOT_READY,
    BOOTSTRAP,
    ABSENT,
    DESTROY,
    LIST,
    PAGES,
    LOSS,
    HEALTH,
    RESTART,
];

/// Whether `ListResourcePages` lists what `ListResources` does, in order,
/// each page under its bound and only the last marked; a plugin without it
/// (UNIMPLEMENTED) is skipped: the executor reads it with `ListResources`.
async fn paged_list(client: &mut Client) -> anyhow::Result<Verdict> {
    let whole = client
        .list_resources(Kit::request(pb::ListResourcesRequest {}, CALL_DEADLINE))
        .await
        .context("ListResources")?
        .into_inner()
        .resources;
    let mut stream = match client
        .list_resource_pages(Kit::request(pb::ListResourcePagesRequest {}, CALL_DEADLINE))
        .await
    {
        Ok(stream) => stream.into_inner(),
        Err(s) if s.code() == tonic::Code::Unimplemented => {
            return Ok(Verdict::Skip(
                "it does not serve ListResourcePages (read with ListResources)".into(),
            ));
        }
        Err(s) => {
            return Ok(Verdict::Fail(format!(
                "ListResourcePages: {:?}: {}",
                s.code(),
                s.message()
            )));
        }
    };
    let mut problems = Vec::new();
    let mut paged = Vec::new();
    let mut last = false;
    loop {
        match stream.message().await {
            Ok(Some(page)) => {
                if last {
                    problems.push("a page came after the one marked last".to_owned());
                }
                if page.encoded_len() > contract::pages::PAGE_BYTES && page.resources.len() > 1 {
                    problems.push(format!("a page of {} bytes", page.encoded_len()));
                }
                last = page.last;
                paged.extend(page.resources);
            }
            Ok(None) => break,
            Err(s) => {
                problems.push(format!("the stream failed: {:?}: {}", s.code(), s.message()));
                break;
            }
        }
    }
    if !last {
        problems.push("no page was marked last".to_owned());
    }
    // The kit makes no call between the two reads, so the same resources are
    // held (an endpoint may have been bound meanwhile: not compared).
    let held = |list: &[pb::Resource]| -> Vec<(Option<pb::Identity>, String, String)> {
        list.iter()
            .map(|r| (r.identity.clone(), r.lease_id.clone(), r.provider_name.clone()))
            .collect()
    };
    if held(&paged) != held(&whole) {
        problems.push(format!(
            "the pages list {} resources, ListResources {}",
            paged.len(),
            whole.len()
        ));
    }
    Ok(Verdict::of(problems))
}

/// What the plugin reported on its Watch stream, as the kit keeps it.
#[derive(Debug, Default)]
struct Seen {
    events: Vec<pb::WatchEvent>,
}

/// The kit's state across the contracts.
struct Kit {
    provider: String,
    run_uid: RunUid,
    seen: Arc<Mutex<Seen>>,
    watch: Option<tokio::task::JoinHandle<()>>,
    /// Creates answered with a definite failure whose identity the plugin
    /// then listed.
    leaked_after_failure: Vec<String>,
    next_op: u64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// An answer's class and reason.
fn class(answer: Option<&pb::Answer>) -> (&'static str, String) {
    use pb::answer::Outcome;
    match answer.and_then(|a| a.outcome.as_ref()) {
        Some(Outcome::Succeeded(_)) => ("succeeded", String::new()),
        Some(Outcome::NotReady(n)) => ("not-ready", n.reason.clone()),
        Some(Outcome::Failed(f)) if f.kind == pb::FailureKind::Permanent as i32 => {
            ("failed-permanent", f.reason.clone())
        }
        Some(Outcome::Failed(f)) => ("failed-retryable", f.reason.clone()),
        Some(Outcome::Ambiguous(a)) => ("ambiguous", a.reason.clone()),
        None => ("no-answer", String::new()),
    }
}

impl Kit {
    fn identity(&self, node: &str) -> ResourceIdentity {
        ResourceIdentity {
            run_uid: self.run_uid,
            run_id: contract::RunId::parse("run_id", "provider-kit").unwrap_or_else(|_| unreachable!()),
            node: contract::LogicalNodeId::parse("node", node).unwrap_or_else(|_| unreachable!()),
            attempt: contract::AttemptId::new(1),
        }
    }

    fn call(&mut self, identity: &ResourceIdentity, deadline: Duration) -> pb::Call {
        self.next_op += 1;
        pb::Call {
            identity: Some(identity_to_wire(identity)),
            operation_id: format!("a1.{}", self.next_op),
            deadline_unix_ms: now_ms() + deadline.as_millis() as u64,
            provider_name: self.provider.clone(),
        }
    }

    fn request<T>(message: T, timeout: Duration) -> tonic::Request<T> {
        let mut r = tonic::Request::new(message);
        r.set_timeout(timeout);
        r
    }

    /// A create of `identity` whose call and gRPC deadline are `deadline`.
    fn create_request(
        &mut self,
        identity: &ResourceIdentity,
        deadline: Duration,
    ) -> tonic::Request<pb::CreateLeaseRequest> {
        let template = template_to_wire(&example_template(&self.provider, "registry.local/provider-kit:1"));
        let call = self.call(identity, deadline);
        Self::request(
            pb::CreateLeaseRequest {
                call: Some(call),
                template: Some(template),
            },
            deadline,
        )
    }

    /// Destroys what `identity` holds; `Err` says how that answer broke the
    /// contract (absent is success).
    async fn destroy(&mut self, client: &mut Client, identity: &ResourceIdentity) -> Result<(), String> {
        let call = self.call(identity, CALL_DEADLINE);
        let r = client
            .destroy_lease(Self::request(
                pb::DestroyLeaseRequest {
                    call: Some(call),
                    lease_id: String::new(),
                },
                CALL_DEADLINE,
            ))
            .await;
        match r {
            Ok(r) => match class(r.get_ref().answer.as_ref()) {
                ("succeeded", _) => Ok(()),
                (c, reason) => Err(format!(
                    "DestroyLease of {} answered {c}: {reason}",
                    identity.node
                )),
            },
            Err(s) => Err(format!("DestroyLease: {:?}: {}", s.code(), s.message())),
        }
    }

    /// The kit's resources the plugin lists, by node.
    async fn listed(&self, client: &mut Client) -> anyhow::Result<BTreeMap<String, Vec<pb::Resource>>> {
        let all = client
            .list_resources(Self::request(pb::ListResourcesRequest {}, CALL_DEADLINE))
            .await
            .context("ListResources")?
            .into_inner()
            .resources;
        let uid = self.run_uid.to_string();
        let mut out: BTreeMap<String, Vec<pb::Resource>> = BTreeMap::new();
        for r in all {
            if let Some(i) = &r.identity
                && i.run_uid == uid
            {
                out.entry(i.node_id.clone()).or_default().push(r);
            }
        }
        Ok(out)
    }

    /// One create; a definite failure is followed at once by a list, which
    /// must not hold the identity (unless `concurrent`, when another create
    /// may have made it).
    async fn create_once(
        &mut self,
        client: &mut Client,
        identity: &ResourceIdentity,
        concurrent: bool,
    ) -> anyhow::Result<(&'static str, String, String)> {
        let request = self.create_request(identity, CALL_DEADLINE);
        let r = client.create_lease(request).await;
        let (c, reason, lease) = match r {
            Ok(r) => {
                let r = r.into_inner();
                let (c, reason) = class(r.answer.as_ref());
                (c, reason, r.lease_id)
            }
            Err(s) => (
                "ambiguous",
                format!("gRPC {:?}: {}", s.code(), s.message()),
                String::new(),
            ),
        };
        if c.starts_with("failed") && !concurrent {
            let node = identity.node.to_string();
            if self.listed(client).await?.contains_key(&node) {
                self.leaked_after_failure.push(format!(
                    "{node}: CreateLease answered {c} ({reason}), then ListResources held it"
                ));
            }
        }
        Ok((c, reason, lease))
    }

    /// Creates until it succeeds: retries what may be retried, within
    /// [`PATIENCE`]. Returns the lease.
    async fn create(&mut self, client: &mut Client, identity: &ResourceIdentity) -> Result<String, String> {
        let until = tokio::time::Instant::now() + PATIENCE;
        let mut last = String::new();
        while tokio::time::Instant::now() < until {
            let (c, reason, lease) = self
                .create_once(client, identity, false)
                .await
                .map_err(|e| format!("{e:#}"))?;
            match c {
                "succeeded" if !lease.is_empty() => return Ok(lease),
                "succeeded" => return Err("CreateLease succeeded with no lease_id".into()),
                "failed-permanent" => return Err(format!("CreateLease failed for good: {reason}")),
                _ => last = format!("{c}: {reason}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(format!(
            "CreateLease did not succeed within {PATIENCE:?}; last answer {last}"
        ))
    }

    fn open_watch(&mut self, client: &Client) {
        if let Some(w) = self.watch.take() {
            w.abort();
        }
        let seen = Arc::clone(&self.seen);
        let mut client = client.clone();
        self.watch = Some(tokio::spawn(async move {
            // Reopened when it breaks, as the executor does.
            loop {
                if let Ok(stream) = client.watch(pb::WatchRequest {}).await {
                    let mut stream = stream.into_inner();
                    while let Ok(Some(event)) = stream.message().await {
                        if let Ok(mut s) = seen.lock() {
                            s.events.push(event);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }));
    }

    /// Waits until the Watch events hold one that `pred` accepts.
    async fn wait_event(&self, within: Duration, pred: impl Fn(&pb::watch_event::Event) -> bool) -> bool {
        let until = tokio::time::Instant::now() + within;
        loop {
            let found = self
                .seen
                .lock()
                .map(|s| s.events.iter().filter_map(|e| e.event.as_ref()).any(&pred))
                .unwrap_or(false);
            if found {
                return true;
            }
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn clear_events(&self) {
        if let Ok(mut s) = self.seen.lock() {
            s.events.clear();
        }
    }
}

fn about(identity: &ResourceIdentity, id: Option<&pb::Identity>) -> bool {
    id.is_some_and(|i| i.node_id == identity.node.to_string() && i.run_uid == identity.run_uid.to_string())
}

/// Runs every seam contract against `plugin`, printing a line per contract
/// as it ends. The provider name is `provider`, or the plugin's first.
pub async fn run(plugin: &mut Plugin, provider: Option<&str>) -> anyhow::Result<Report> {
    let mut report = Report::default();
    let mut client = plugin.client()?;

    // GetInfo.
    let info = match client
        .get_info(Kit::request(pb::GetInfoRequest {}, CALL_DEADLINE))
        .await
    {
        Ok(i) => i.into_inner(),
        Err(s) => {
            report.record(
                INFO,
                Verdict::Fail(format!("GetInfo: {:?}: {}", s.code(), s.message())),
            );
            return Ok(report);
        }
    };
    let caps = info.capabilities.unwrap_or_default();
    let name = provider
        .map(str::to_owned)
        .or_else(|| info.provider_names.first().cloned());
    let info_verdict = if info.protocol_version != pb::ProtocolVersion::ProtocolVersion1 as i32 {
        Verdict::Fail(format!("protocol version {}", info.protocol_version))
    } else if info.provider_names.is_empty() {
        Verdict::Fail("it names no provider".into())
    } else if let Some(p) = provider
        && !info.provider_names.iter().any(|n| n == p)
    {
        Verdict::Fail(format!(
            "it does not serve {p:?} (it serves {:?})",
            info.provider_names
        ))
    } else {
        Verdict::Pass
    };
    let failed_info = matches!(info_verdict, Verdict::Fail(_));
    report.record(INFO, info_verdict);
    let Some(name) = name.filter(|_| !failed_info) else {
        return Ok(report);
    };
    report.provider = Some(name.clone());

    let mut kit = Kit {
        provider: name,
        run_uid: RunUid::from_u128(u128::from(now_ms()) << 32 | u128::from(std::process::id())),
        seen: Arc::default(),
        watch: None,
        leaked_after_failure: Vec::new(),
        next_op: 0,
    };
    kit.open_watch(&client);

    // One identity, one resource: create, create again, list.
    let a = kit.identity("kit-0");
    let mut lease_a = None;
    let verdict = match kit.create(&mut client, &a).await {
        Err(e) => Verdict::Fail(e),
        Ok(first) => match kit.create(&mut client, &a).await {
            Err(e) => Verdict::Fail(format!("the second create: {e}")),
            Ok(second) if second != first => Verdict::Fail(format!(
                "the second create of one identity answered another lease ({first} then {second})"
            )),
            Ok(_) => match kit.listed(&mut client).await?.get("kit-0") {
                Some(held) if held.len() == 1 && held[0].lease_id == first => {
                    lease_a = Some(first);
                    Verdict::Pass
                }
                held => Verdict::Fail(format!("after two creates of kit-0 ListResources holds {held:?}")),
            },
        },
    };
    report.record(ONE_RESOURCE, verdict);

    // Concurrent creates.
    let b = kit.identity("kit-1");
    let mut creates = Vec::new();
    for _ in 0..4 {
        let mut c = client.clone();
        let request = kit.create_request(&b, CALL_DEADLINE);
        creates.push(async move { c.create_lease(request).await });
    }
    let answers = futures::future::join_all(creates).await;
    let leases: BTreeSet<String> = answers
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .map(|r| r.get_ref())
        .filter(|r| class(r.answer.as_ref()).0 == "succeeded")
        .map(|r| r.lease_id.clone())
        .collect();
    // Whatever they answered, one more create settles it.
    let settled = kit.create(&mut client, &b).await;
    let held = kit.listed(&mut client).await?.remove("kit-1").unwrap_or_default();
    let verdict = match settled {
        Err(e) => Verdict::Fail(format!("after four concurrent creates: {e}")),
        Ok(_) if leases.len() > 1 => {
            Verdict::Fail(format!("four concurrent creates answered leases {leases:?}"))
        }
        Ok(_) if held.len() != 1 => Verdict::Fail(format!(
            "after four concurrent creates ListResources holds {} resources for kit-1",
            held.len()
        )),
        Ok(_) => Verdict::Pass,
    };
    report.record(CONCURRENT, verdict);

    // An ambiguous create (the caller gave up at once), then a create.
    let c_id = kit.identity("kit-2");
    let given_up = kit.create_request(&c_id, Duration::from_millis(1));
    let _ = client.create_lease(given_up).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let verdict = match kit.create(&mut client, &c_id).await {
        Err(e) => Verdict::Fail(format!("the create after an ambiguous one: {e}")),
        Ok(_) => {
            // The first create may still land: look again a moment later.
            tokio::time::sleep(Duration::from_secs(1)).await;
            let held = kit.listed(&mut client).await?.remove("kit-2").unwrap_or_default();
            if held.len() == 1 {
                Verdict::Pass
            } else {
                Verdict::Fail(format!("ListResources holds {} resources for kit-2", held.len()))
            }
        }
    };
    report.record(ADOPT_AMBIGUOUS, verdict);

    // Every definite failure of a create so far was followed by a list.
    let verdict = if kit.leaked_after_failure.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail(kit.leaked_after_failure.join("; "))
    };
    report.record(DEFINITE_FAILURE, verdict);

    // The endpoint: not-ready until bound, never a failure.
    let mut endpoint_a = None;
    let verdict = match &lease_a {
        None => Verdict::Skip("no lease for kit-0".into()),
        Some(lease) => {
            let until = tokio::time::Instant::now() + PATIENCE;
            let mut verdict = Verdict::Fail(format!("no endpoint within {PATIENCE:?}"));
            while tokio::time::Instant::now() < until {
                let call = kit.call(&a, CALL_DEADLINE);
                let r = client
                    .lookup_endpoint(Kit::request(
                        pb::LookupEndpointRequest {
                            call: Some(call),
                            lease_id: lease.clone(),
                        },
                        CALL_DEADLINE,
                    ))
                    .await;
                match r.map(tonic::Response::into_inner) {
                    Ok(r) => match class(r.answer.as_ref()) {
                        ("succeeded", _) if !r.endpoint.is_empty() => {
                            endpoint_a = Some(r.endpoint);
                            verdict = Verdict::Pass;
                            break;
                        }
                        ("succeeded", _) => {
                            verdict = Verdict::Fail("LookupEndpoint succeeded with no endpoint".into());
                            break;
                        }
                        ("not-ready" | "ambiguous", _) => {}
                        (c, reason) => {
                            verdict = Verdict::Fail(format!(
                                "LookupEndpoint of a held lease answered {c}: {reason}"
                            ));
                            break;
                        }
                    },
                    Err(s) => {
                        verdict = Verdict::Fail(format!("LookupEndpoint: {:?}: {}", s.code(), s.message()));
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            verdict
        }
    };
    report.record(NOT_READY, verdict);

    // Bootstrap: once per identity, its stages on Watch.
    let verdict = match (&lease_a, &endpoint_a) {
        (Some(lease), Some(endpoint)) => {
            let start = |kit: &mut Kit| pb::StartBootstrapRequest {
                call: Some(kit.call(&a, CALL_DEADLINE)),
                lease_id: lease.clone(),
                endpoint: endpoint.clone(),
                boot: Default::default(),
                join: Default::default(),
            };
            let mut sessions = Vec::new();
            let mut verdict = Verdict::Pass;
            for _ in 0..2 {
                let until = tokio::time::Instant::now() + PATIENCE;
                loop {
                    let r = client
                        .start_bootstrap(Kit::request(start(&mut kit), CALL_DEADLINE))
                        .await
                        .map(tonic::Response::into_inner);
                    match r {
                        Ok(r) if class(r.answer.as_ref()).0 == "succeeded" => {
                            sessions.push(r.session_id);
                            break;
                        }
                        Ok(r) => {
                            let (c, reason) = class(r.answer.as_ref());
                            if c == "failed-permanent" || tokio::time::Instant::now() >= until {
                                verdict = Verdict::Fail(format!("StartBootstrap answered {c}: {reason}"));
                                break;
                            }
                        }
                        Err(s) => {
                            verdict =
                                Verdict::Fail(format!("StartBootstrap: {:?}: {}", s.code(), s.message()));
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            if verdict == Verdict::Pass {
                if sessions.len() != 2 || sessions[0] != sessions[1] || sessions[0].is_empty() {
                    verdict = Verdict::Fail(format!(
                        "two starts of one identity answered sessions {sessions:?}"
                    ));
                } else {
                    let session = sessions[0].clone();
                    let converged = kit
                        .wait_event(PATIENCE, |e| {
                            matches!(e, pb::watch_event::Event::Stage(s)
                                if about(&a, s.identity.as_ref()) && s.session_id == session
                                    && s.stage == pb::Stage::Converged as i32)
                        })
                        .await;
                    let live = kit
                        .listed(&mut client)
                        .await?
                        .get("kit-0")
                        .is_some_and(|h| h.iter().any(|r| r.session_live));
                    if !converged {
                        verdict = Verdict::Fail(format!(
                            "Watch reported no CONVERGED stage of session {session} within {PATIENCE:?}"
                        ));
                    } else if !live {
                        verdict = Verdict::Fail("ListResources does not say kit-0's session is live".into());
                    }
                }
            }
            verdict
        }
        _ => Verdict::Skip("kit-0 has no lease and endpoint".into()),
    };
    report.record(BOOTSTRAP, verdict);

    // Absent things.
    let never = kit.identity("kit-99");
    let mut problems = Vec::new();
    let call = kit.call(&never, CALL_DEADLINE);
    match client
        .cancel_bootstrap(Kit::request(
            pb::CancelBootstrapRequest {
                call: Some(call),
                session_id: String::new(),
            },
            CALL_DEADLINE,
        ))
        .await
    {
        Ok(r) => {
            let (c, reason) = class(r.get_ref().answer.as_ref());
            if c != "succeeded" {
                problems.push(format!(
                    "CancelBootstrap of an absent session answered {c}: {reason}"
                ));
            }
        }
        Err(s) => problems.push(format!("CancelBootstrap: {:?}: {}", s.code(), s.message())),
    }
    for _ in 0..2 {
        if let Err(e) = kit.destroy(&mut client, &never).await {
            problems.push(format!("{e} (it holds nothing)"));
        }
    }
    if kit.listed(&mut client).await?.contains_key("kit-99") {
        problems.push("ListResources holds kit-99, which was never created".into());
    }
    report.record(ABSENT, Verdict::of(problems));

    // Destroy, and again.
    let mut problems = Vec::new();
    for _ in 0..2 {
        if let Err(e) = kit.destroy(&mut client, &c_id).await {
            problems.push(e);
        }
    }
    if kit.listed(&mut client).await?.contains_key("kit-2") {
        problems.push("ListResources still holds kit-2 after its destroy".into());
    }
    report.record(DESTROY, Verdict::of(problems));

    // List: exactly kit-0 and kit-1.
    let listed = kit.listed(&mut client).await?;
    let names: Vec<&String> = listed.keys().collect();
    let verdict = if names == ["kit-0", "kit-1"] && listed.values().all(|v| v.len() == 1) {
        Verdict::Pass
    } else {
        Verdict::Fail(format!(
            "after creating kit-0, kit-1, kit-2 and destroying kit-2, ListResources holds {:?}",
            listed
                .iter()
                .map(|(k, v)| format!("{k} ×{}", v.len()))
                .collect::<Vec<_>>()
        ))
    };
    report.record(LIST, verdict);
    report.record(PAGES, paged_list(&mut client).await?);

    // A restart (a crash: SIGKILL) loses nothing it reported.
    if plugin.can_restart() {
        let before = kit.listed(&mut client).await?;
        plugin.crash_and_restart().await?;
        client = plugin.client()?;
        kit.clear_events();
        kit.open_watch(&client);
        let after = kit.listed(&mut client).await?;
        let lease = |m: &BTreeMap<String, Vec<pb::Resource>>, k: &str| {
            m.get(k)
                .map(|v| v.iter().map(|r| r.lease_id.clone()).collect::<Vec<_>>())
        };
        let mut problems = Vec::new();
        for node in before.keys() {
            if lease(&before, node) != lease(&after, node) {
                problems.push(format!(
                    "{node}: held {:?} before the restart, {:?} after",
                    lease(&before, node),
                    lease(&after, node)
                ));
            }
        }
        if problems.is_empty() {
            // A create after the restart adopts.
            match kit.create(&mut client, &a).await {
                Ok(l) if Some(&l) == lease_a.as_ref() => {}
                Ok(l) => problems.push(format!(
                    "a create of kit-0 after the restart answered {l}, not {lease_a:?}"
                )),
                Err(e) => problems.push(format!("a create of kit-0 after the restart: {e}")),
            }
            let held = kit.listed(&mut client).await?.remove("kit-0").unwrap_or_default();
            if held.len() != 1 {
                problems.push(format!(
                    "after the restart and a create, kit-0 is held {} times",
                    held.len()
                ));
            }
        }
        report.record(RESTART, Verdict::of(problems));
    }

    // Loss and health, through the testing hooks.
    let mut testing = plugin.testing()?;
    let hooks = testing
        .set_healthy(pb::SetHealthyRequest {
            identity: Some(identity_to_wire(&never)),
            healthy: true,
        })
        .await;
    let hooks = match hooks {
        Err(s) if s.code() == tonic::Code::Unimplemented => Err(
            "the plugin serves no testing hooks (start it with its testing flag, as for a conformance run)",
        ),
        _ => Ok(()),
    };
    if caps.reports_health {
        let verdict = match hooks {
            Err(why) => Verdict::Fail(why.into()),
            Ok(()) => {
                let mut v = Verdict::Pass;
                for healthy in [false, true] {
                    let found = testing
                        .set_healthy(pb::SetHealthyRequest {
                            identity: Some(identity_to_wire(&a)),
                            healthy,
                        })
                        .await
                        .map(|r| r.into_inner().found);
                    if !matches!(found, Ok(true)) {
                        v = Verdict::Fail(format!("SetHealthy({healthy}) of kit-0: {found:?}"));
                        break;
                    }
                    let seen = kit
                        .wait_event(Duration::from_secs(20), |e| {
                            matches!(e, pb::watch_event::Event::Health(h)
                                if about(&a, h.identity.as_ref()) && h.healthy == healthy)
                        })
                        .await;
                    if !seen {
                        v = Verdict::Fail(format!(
                            "no HealthChanged(healthy: {healthy}) of kit-0 within 20 s"
                        ));
                        break;
                    }
                    kit.clear_events();
                }
                v
            }
        };
        report.record(HEALTH, verdict);
    } else {
        report.record(
            HEALTH,
            Verdict::Skip("it does not report health (the executor probes its endpoints)".into()),
        );
    }
    let verdict = match hooks {
        Err(why) => Verdict::Fail(why.into()),
        Ok(()) => {
            let found = testing
                .lose(pb::LoseRequest {
                    identity: Some(identity_to_wire(&b)),
                })
                .await
                .map(|r| r.into_inner().found);
            if !matches!(found, Ok(true)) {
                Verdict::Fail(format!("Lose of kit-1: {found:?}"))
            } else {
                let reported = !caps.reports_loss
                    || kit
                        .wait_event(Duration::from_secs(20), |e| {
                            matches!(e, pb::watch_event::Event::Lost(l) if about(&b, l.identity.as_ref()))
                        })
                        .await;
                let until = tokio::time::Instant::now() + Duration::from_secs(20);
                let mut gone = false;
                while tokio::time::Instant::now() < until {
                    if !kit.listed(&mut client).await?.contains_key("kit-1") {
                        gone = true;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                if !reported {
                    Verdict::Fail("it reports losses, but Watch reported no Lost of kit-1 within 20 s".into())
                } else if !gone {
                    Verdict::Fail("ListResources still holds kit-1 20 s after it was lost".into())
                } else {
                    Verdict::Pass
                }
            }
        }
    };
    report.record(LOSS, verdict);

    // Clean up: destroy whatever the kit still holds.
    for node in kit.listed(&mut client).await?.into_keys() {
        let id = kit.identity(&node);
        let _ = kit.destroy(&mut client, &id).await;
    }
    if let Some(w) = kit.watch.take() {
        w.abort();
    }
    Ok(report)
}
