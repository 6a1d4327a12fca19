//! Real binaries as separate processes on loopback, for end-to-end tests.
//!
//! Each service starts on port 0 (or a given port, to restart one in place)
//! and announces its bound address in a ready file; nothing here guesses a
//! port. Children are killed when their handle drops, so a failing test leaves
//! no process behind.
//!
//! A cluster runs with TLS unless [`ClusterOptions::insecure`] says otherwise:
//! it writes a development CA and certificates into `<dir>/tls/` ([`TestPki`]),
//! and every service started in that directory gets its own certificate. The
//! clients here connect the way the real ones do: [`Cluster::client`] as
//! `provisionctl`, [`Cluster::executor_client`] as the driver.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::Context;
use contract::pb::{self, executor_client::ExecutorClient, provisioning_client::ProvisioningClient};
use platform::tls::{
    TlsMaterial, Transport,
    dev::{self, Validity},
};
use tokio::process::{Child, Command};
use tonic::transport::{Channel, Endpoint};

/// Where cargo put the workspace's binaries: beside the running executable
/// (a binary such as the bench), or one level up (a test in `deps/`).
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let here = exe.parent().context("the executable has no directory")?;
    if here.join("driver-svc").exists() {
        return Ok(here.to_path_buf());
    }
    let dir = here
        .parent()
        .context("test executable has no grandparent directory")?;
    Ok(dir.to_path_buf())
}

pub fn bin_path(name: &str) -> anyhow::Result<PathBuf> {
    let p = bin_dir()?.join(name);
    anyhow::ensure!(
        p.exists(),
        "{} not found: build the workspace binaries first (cargo test --workspace builds them)",
        p.display()
    );
    Ok(p)
}

/// The development PKI of a test cluster: a CA and a certificate for each
/// service and for `provisionctl`, in `<cluster dir>/tls/`.
#[derive(Debug, Clone)]
pub struct TestPki {
    pub dir: PathBuf,
    /// The CA, kept by the cluster that made it (to issue more certificates).
    ca: Option<std::sync::Arc<dev::DevCa>>,
}

impl TestPki {
    /// The directory under a cluster's directory that holds its PKI.
    pub const SUBDIR: &str = "tls";

    /// Writes a new CA and certificates (valid for `localhost` and
    /// `127.0.0.1`, for a day) into `<dir>/tls/`.
    pub fn create(dir: &Path) -> anyhow::Result<Self> {
        let pki = dir.join(Self::SUBDIR);
        let validity = Validity::days_from_now(1);
        let ca = dev::DevCa::new("test CA", validity)?;
        dev::write_pki_with(&ca, &pki, &Self::hosts(), validity)?;
        Ok(Self {
            dir: pki,
            ca: Some(std::sync::Arc::new(ca)),
        })
    }

    /// What the services' certificates are valid for.
    pub fn hosts() -> Vec<String> {
        vec!["localhost".to_owned(), "127.0.0.1".to_owned()]
    }

    /// The PKI a cluster wrote into `dir`, if it wrote one.
    pub fn find(dir: &Path) -> Option<Self> {
        let pki = dir.join(Self::SUBDIR);
        pki.join(dev::CA_FILE)
            .exists()
            .then_some(Self { dir: pki, ca: None })
    }

    /// Issues one more certificate from this PKI's CA (only the [`TestPki`]
    /// that created it has the CA) and writes it as `<stem>.pem`/`.key`.
    pub fn issue(&self, stem: &str, leaf: &dev::Leaf) -> anyhow::Result<(PathBuf, PathBuf)> {
        let ca = self
            .ca
            .as_ref()
            .context("this PKI was found on disk; only the one that created it can issue")?;
        Ok(dev::write_issued(&self.dir, stem, &ca.issue(leaf)?)?)
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.join(dev::CA_FILE)
    }

    /// `name`'s certificate and key files.
    pub fn cert_and_key(&self, name: &str) -> (PathBuf, PathBuf) {
        dev::cert_and_key(&self.dir, name)
    }

    /// The flags that start service `name` with its certificate.
    pub fn service_args(&self, name: &str) -> Vec<String> {
        let (cert, key) = self.cert_and_key(name);
        vec![
            "--tls-cert".into(),
            cert.display().to_string(),
            "--tls-key".into(),
            key.display().to_string(),
            "--tls-ca".into(),
            self.ca().display().to_string(),
        ]
    }

    /// The transport of a client that presents `name`'s certificate (none
    /// with `None`) and trusts the CA.
    pub fn transport(&self, name: Option<&str>) -> anyhow::Result<Transport> {
        let files = name.map(|n| self.cert_and_key(n));
        let identity = files.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
        Ok(Transport::Tls(std::sync::Arc::new(TlsMaterial::load(
            &self.ca(),
            identity,
        )?)))
    }

    /// The environment that points `provisionctl` at this PKI, with its
    /// client certificate.
    pub fn provisionctl_env(&self) -> Vec<(String, String)> {
        let (cert, key) = self.cert_and_key(dev::CLIENT);
        vec![
            ("PROVISIONCTL_TLS_CA".into(), self.ca().display().to_string()),
            ("PROVISIONCTL_TLS_CERT".into(), cert.display().to_string()),
            ("PROVISIONCTL_TLS_KEY".into(), key.display().to_string()),
        ]
    }
}

/// Whether `args` (or `env`) already choose the service's transport.
fn chooses_transport(args: &[String], env: &[(String, String)]) -> bool {
    args.iter().any(|a| a == "--insecure" || a == "--tls-cert")
        || env
            .iter()
            .any(|(k, _)| k == "PROVISIONING_INSECURE" || k == "PROVISIONING_TLS_CERT")
}

/// One running service.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    pub addr: SocketAddr,
    /// The PKI the service was started with; `None` in plaintext.
    pub tls: Option<TestPki>,
    /// Where the service serves Prometheus metrics, when it was started with
    /// `--metrics-listen` (read from `<ready file>.metrics`).
    pub metrics_addr: Option<SocketAddr>,
    child: Child,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// What it was started through (see [`Service::start_wrapped`]).
    wrapper: Vec<String>,
    ready_file: PathBuf,
    log_file: PathBuf,
}

impl Service {
    /// Starts `name` with `args` plus `--listen` and `--ready-file`, and waits
    /// for the ready file.
    pub async fn start(name: &str, dir: &Path, listen: &str, args: &[String]) -> anyhow::Result<Self> {
        Self::start_with_env(name, dir, listen, args, &[]).await
    }

    /// As [`Service::start`], with extra environment variables (for example
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`, or `PROVISIONING_METRICS_LISTEN`).
    ///
    /// Unless `args` or `env` choose the transport themselves, the service
    /// gets its certificate from the PKI in `dir` ([`TestPki::find`]), or
    /// `--insecure` when there is none.
    pub async fn start_with_env(
        name: &str,
        dir: &Path,
        listen: &str,
        args: &[String],
        env: &[(String, String)],
    ) -> anyhow::Result<Self> {
        Self::start_wrapped(name, dir, listen, args, env, &[]).await
    }

    /// As [`Service::start_with_env`], run through `wrapper` (a command
    /// that execs the rest of its line, such as `ip netns exec NS`), so the
    /// process is still the service's.
    pub async fn start_wrapped(
        name: &str,
        dir: &Path,
        listen: &str,
        args: &[String],
        env: &[(String, String)],
        wrapper: &[&str],
    ) -> anyhow::Result<Self> {
        let ready_file = dir.join(format!("{name}.ready"));
        let metrics_file = platform::telemetry::metrics_ready_file(&ready_file);
        let _ = std::fs::remove_file(&metrics_file);
        let _ = std::fs::remove_file(&ready_file);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{name}.log")))?;
        let (tls, transport_args) = if chooses_transport(args, env) {
            (None, Vec::new())
        } else {
            match TestPki::find(dir) {
                Some(pki) => {
                    let args = pki.service_args(name);
                    (Some(pki), args)
                }
                None => (None, vec!["--insecure".to_owned()]),
            }
        };
        let mut cmd = match wrapper.split_first() {
            None => Command::new(bin_path(name)?),
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(bin_path(name)?);
                c
            }
        };
        cmd.arg("--listen")
            .arg(listen)
            .arg("--ready-file")
            .arg(&ready_file)
            .args(&transport_args)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("TEST_SERVICE_LOG").unwrap_or_else(|_| "info".into()),
            )
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let mut child = cmd.spawn().with_context(|| format!("spawning {name}"))?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let addr = loop {
            if let Ok(s) = std::fs::read_to_string(&ready_file)
                && let Ok(a) = s.trim().parse::<SocketAddr>()
            {
                break a;
            }
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "{name} exited early ({status}); see {}",
                    dir.join(format!("{name}.log")).display()
                );
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{name} did not become ready in 30s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // The metrics address is written before the ready file, so it is
        // there by now if the service serves metrics at all.
        let metrics_addr = std::fs::read_to_string(&metrics_file)
            .ok()
            .and_then(|s| s.trim().parse::<SocketAddr>().ok());
        Ok(Self {
            name: name.to_owned(),
            addr,
            tls,
            metrics_addr,
            child,
            args: args.to_vec(),
            env: env.to_vec(),
            wrapper: wrapper.iter().map(|w| (*w).to_owned()).collect(),
            ready_file,
            log_file: dir.join(format!("{name}.log")),
        })
    }

    /// `https://` with TLS, `http://` in plaintext.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// An endpoint for this service that, with TLS, trusts the cluster's CA
    /// and presents `as_name`'s certificate (none with `None`).
    pub fn endpoint(&self, as_name: Option<&str>) -> anyhow::Result<Endpoint> {
        let transport = match &self.tls {
            Some(pki) => pki.transport(as_name)?,
            None => Transport::Insecure,
        };
        Ok(transport.endpoint(&self.url())?)
    }

    /// A connection to this service as `as_name` (see [`Service::endpoint`]).
    pub async fn channel(&self, as_name: Option<&str>) -> anyhow::Result<Channel> {
        Ok(self.endpoint(as_name)?.connect().await?)
    }

    /// The file the service's stderr (its logs) goes to.
    pub fn log_file(&self) -> &Path {
        &self.log_file
    }

    /// One scrape of the service's metrics endpoint: the exposition text.
    pub async fn scrape(&self) -> anyhow::Result<String> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let addr = self
            .metrics_addr
            .with_context(|| format!("{} was started without --metrics-listen", self.name))?;
        let mut conn = tokio::net::TcpStream::connect(addr).await?;
        conn.write_all(format!("GET /metrics HTTP/1.1\r\nhost: {addr}\r\n\r\n").as_bytes())
            .await?;
        let mut response = String::new();
        tokio::time::timeout(Duration::from_secs(10), conn.read_to_string(&mut response)).await??;
        let (head, body) = response
            .split_once("\r\n\r\n")
            .context("the metrics response has no header end")?;
        anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "metrics scrape failed: {head}");
        Ok(body.to_owned())
    }

    /// The child's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// SIGKILL: no chance to clean up.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }

    /// SIGTERM, then wait for a clean exit.
    pub async fn terminate(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status();
        }
        Ok(tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await??)
    }

    /// Sets (`Some`) or removes (`None`) a flag for the next [`Service::restart`].
    pub fn set_flag(&mut self, flag: &str, value: Option<&str>) {
        if let Some(i) = self.args.iter().position(|a| a == flag) {
            let end = (i + 2).min(self.args.len());
            self.args.drain(i..end);
        }
        if let Some(v) = value {
            self.args.push(flag.to_owned());
            self.args.push(v.to_owned());
        }
    }

    /// Waits up to `within` for the process to exit on its own; `None` if it
    /// is still running then.
    pub async fn wait_exit(&mut self, within: Duration) -> anyhow::Result<Option<std::process::ExitStatus>> {
        match tokio::time::timeout(within, self.child.wait()).await {
            Ok(status) => Ok(Some(status?)),
            Err(_) => Ok(None),
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Starts the same service again on the same address.
    pub async fn restart(&mut self, dir: &Path) -> anyhow::Result<()> {
        let _ = self.child.kill().await;
        let _ = self.child.wait().await;
        let _ = std::fs::remove_file(&self.ready_file);
        let listen = self.addr.to_string();
        // The port was just freed; retry briefly in case it lingers.
        let mut last = None;
        for _ in 0..50 {
            let wrapper: Vec<&str> = self.wrapper.iter().map(String::as_str).collect();
            match Service::start_wrapped(&self.name, dir, &listen, &self.args, &self.env, &wrapper).await {
                Ok(s) => {
                    *self = s;
                    return Ok(());
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("restart failed")))
    }
}

/// How many of its log's last lines a service prints when a test fails.
const LOG_TAIL_LINES: usize = 80;

/// A failing test shows the end of each of its services' logs: the logs live
/// in the test's temporary directory, which goes with the test, so a failure
/// seen once (in CI, say) can still be read.
impl Drop for Service {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprint!("{}", log_tail(&self.name, &self.log_file, LOG_TAIL_LINES));
        }
    }
}

/// The last `lines` lines of `path`, headed with `name` and the file.
fn log_tail(name: &str, path: &Path, lines: usize) -> String {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => return format!("--- {name}: no log at {} ({e})\n", path.display()),
    };
    let all: Vec<&str> = text.lines().collect();
    let from = all.len().saturating_sub(lines);
    let mut out = format!(
        "--- {name}: the last {} of {} log lines ({})\n",
        all.len() - from,
        all.len(),
        path.display()
    );
    for line in &all[from..] {
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The three services.
#[derive(Debug)]
pub struct Cluster {
    pub decider: Service,
    /// Deciders beyond the first ([`ClusterOptions::deciders`]): the
    /// driver's `--decider` lists them all.
    pub more_deciders: Vec<Service>,
    pub executor: Service,
    pub driver: Service,
    /// The cluster's PKI; `None` when it runs in plaintext.
    pub tls: Option<TestPki>,
    /// Holds the services' logs: declared last, so it goes after them (a
    /// failing test's services print their logs' ends as they go).
    pub dir: tempfile::TempDir,
}

/// Knobs for a test cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub executor_args: Vec<String>,
    pub driver_args: Vec<String>,
    /// Put the driver's executor link through this address instead (a
    /// proxy): `host:port`, or a URL whose scheme the cluster's transport
    /// sets (an `http://` one becomes `https://` with TLS).
    pub executor_via: Option<String>,
    /// Environment variables every service gets (for example the `OTEL_*`
    /// variables, or `PROVISIONING_METRICS_LISTEN`).
    pub env: Vec<(String, String)>,
    /// Environment variables of one service: `(service, key, value)`; they
    /// win over `env`.
    pub service_env: Vec<(String, String, String)>,
    /// TLS between everything (the default), or plaintext with `--insecure`
    /// everywhere ([`ClusterOptions::insecure`]).
    pub tls: bool,
    /// How many deciders (one unless [`ClusterOptions::deciders`]).
    pub deciders: usize,
    /// Where the decider and the executor listen: loopback, or every
    /// address ([`ClusterOptions::reachable_from_hosts`]).
    pub services_listen: &'static str,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            executor_args: vec![
                "--backend".into(),
                "fake".into(),
                "--fake-latency-ms".into(),
                "1,5".into(),
                "--fake-stage-interval-ms".into(),
                "5".into(),
            ],
            driver_args: vec![
                "--backoff-base-ms".into(),
                "50".into(),
                "--backoff-cap-ms".into(),
                "500".into(),
                "--probe-interval-ms".into(),
                "20".into(),
                "--safety-tick-ms".into(),
                "2000".into(),
                // Tests that check authentication give --tokens-file instead
                // (`ClusterOptions::tokens_file`).
                ALLOW_UNAUTHENTICATED.into(),
            ],
            executor_via: None,
            env: Vec::new(),
            service_env: Vec::new(),
            tls: true,
            deciders: 1,
            services_listen: "127.0.0.1:0",
        }
    }
}

const ALLOW_UNAUTHENTICATED: &str = "--allow-unauthenticated";

fn set_flag(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => args[i + 1] = value.to_owned(),
        _ => {
            args.push(flag.to_owned());
            args.push(value.to_owned());
        }
    }
}

impl ClusterOptions {
    /// Every service in plaintext (`--insecure`), clients too.
    pub fn insecure(mut self) -> Self {
        self.tls = false;
        self
    }

    /// `n` deciders (at least one), each its own process; the driver's
    /// `--decider` lists them all.
    pub fn deciders(mut self, n: usize) -> Self {
        self.deciders = n.max(1);
        self
    }

    /// The decider and the executor listen on every address, so that a
    /// process on a private test host ([`crate::netns::Host`]) reaches them
    /// at this namespace's address on its link.
    pub fn reachable_from_hosts(mut self) -> Self {
        self.services_listen = "0.0.0.0:0";
        self
    }

    /// Sets (or replaces) an executor flag.
    pub fn executor(mut self, flag: &str, value: &str) -> Self {
        set_flag(&mut self.executor_args, flag, value);
        self
    }

    /// Sets (or replaces) a driver flag.
    pub fn driver(mut self, flag: &str, value: &str) -> Self {
        set_flag(&mut self.driver_args, flag, value);
        self
    }

    /// The driver authenticates its callers with the tokens in `path`
    /// (instead of `--allow-unauthenticated`).
    pub fn tokens_file(mut self, path: &Path) -> Self {
        self.driver_args.retain(|a| a != ALLOW_UNAUTHENTICATED);
        set_flag(
            &mut self.driver_args,
            "--tokens-file",
            &path.display().to_string(),
        );
        self
    }

    /// Sets (or replaces) an environment variable of every service.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Sets (or replaces) an environment variable of one service (by binary
    /// name, e.g. `driver-svc`).
    pub fn service_env(mut self, service: &str, key: &str, value: &str) -> Self {
        self.service_env.retain(|(s, k, _)| !(s == service && k == key));
        self.service_env
            .push((service.to_owned(), key.to_owned(), value.to_owned()));
        self
    }

    /// The environment `service` is started with.
    fn env_of(&self, service: &str) -> Vec<(String, String)> {
        let mut env = self.env.clone();
        for (s, k, v) in &self.service_env {
            if s == service {
                env.retain(|(key, _)| key != k);
                env.push((k.clone(), v.clone()));
            }
        }
        env
    }
}

impl Cluster {
    pub async fn start(opts: ClusterOptions) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        Self::start_in(dir, opts).await
    }

    /// Starts the three services in `dir`. This process becomes a child
    /// subreaper first (see [`become_subreaper`]), so node agents orphaned by
    /// a killed executor are re-parented to the test and reaped.
    pub async fn start_in(dir: tempfile::TempDir, opts: ClusterOptions) -> anyhow::Result<Self> {
        become_subreaper()?;
        let tls = if opts.tls {
            Some(TestPki::create(dir.path())?)
        } else {
            None
        };
        let env = |service: &str| opts.env_of(service);
        let decider = Service::start_with_env(
            "decider-svc",
            dir.path(),
            opts.services_listen,
            &[],
            &env("decider-svc"),
        )
        .await?;
        let mut more_deciders = Vec::new();
        for i in 2..=opts.deciders {
            // Each in a directory of its own (its log and ready file), with
            // the cluster's certificate given outright.
            let own = dir.path().join(format!("decider-{i}"));
            std::fs::create_dir_all(&own)?;
            let args = match &tls {
                Some(pki) => pki.service_args("decider-svc"),
                None => vec!["--insecure".to_owned()],
            };
            more_deciders.push(
                Service::start_with_env(
                    "decider-svc",
                    &own,
                    opts.services_listen,
                    &args,
                    &env("decider-svc"),
                )
                .await?,
            );
        }
        // The executor keeps its fencing epochs and results in the cluster's
        // directory, so a restarted executor replays rather than re-runs.
        let mut executor_args = Vec::new();
        if !opts.executor_args.iter().any(|a| a == "--state-dir") {
            executor_args.push("--state-dir".to_owned());
            executor_args.push(dir.path().join("executor-state").display().to_string());
        }
        executor_args.extend(opts.executor_args.iter().cloned());
        let executor = Service::start_with_env(
            "executor-svc",
            dir.path(),
            opts.services_listen,
            &executor_args,
            &env("executor-svc"),
        )
        .await?;
        let executor_url = match &opts.executor_via {
            Some(via) => {
                let bare = via.split_once("://").map_or(via.as_str(), |(_, rest)| rest);
                let scheme = if tls.is_some() { "https" } else { "http" };
                format!("{scheme}://{bare}")
            }
            None => executor.url(),
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let deciders: Vec<String> = std::iter::once(&decider)
            .chain(&more_deciders)
            .map(|d| format!("{scheme}://{}", d.addr))
            .collect();
        let mut args = vec![
            "--decider".into(),
            deciders.join(","),
            "--executor".into(),
            executor_url,
        ];
        // The store in the test's directory, unless the test puts it elsewhere.
        if !opts.driver_args.iter().any(|a| a == "--data-dir") {
            args.push("--data-dir".into());
            args.push(dir.path().join("driver-data").display().to_string());
        }
        args.extend(opts.driver_args.iter().cloned());
        let driver =
            Service::start_with_env("driver-svc", dir.path(), "127.0.0.1:0", &args, &env("driver-svc"))
                .await?;
        Ok(Self {
            dir,
            decider,
            more_deciders,
            executor,
            driver,
            tls,
        })
    }

    pub async fn client(&self) -> anyhow::Result<ProvisioningClient<Channel>> {
        Ok(ProvisioningClient::new(self.channel().await?))
    }

    /// Applies `shape` through the public API.
    pub async fn apply(&self, shape: &contract::ClusterShape) -> anyhow::Result<pb::ApplyResponse> {
        let mut c = self.client().await?;
        let answer = c
            .apply(pb::ApplyRequest {
                shape: Some(pb::ClusterShape::from(shape)),
            })
            .await?;
        Ok(answer.into_inner())
    }

    /// A connection to the driver's public API (for clients with their own
    /// layers, such as a bearer token); with TLS it presents `provisionctl`'s
    /// certificate.
    pub async fn channel(&self) -> anyhow::Result<Channel> {
        self.driver.channel(Some(dev::CLIENT)).await
    }

    /// A client of the executor that, with TLS, presents the driver's
    /// certificate (the only identity the executor lets through).
    pub async fn executor_client(&self) -> anyhow::Result<ExecutorClient<Channel>> {
        Ok(ExecutorClient::new(
            self.executor.channel(Some(platform::tls::DRIVER)).await?,
        ))
    }

    /// The environment `provisionctl` needs to reach this cluster's driver:
    /// the PKI with its client certificate, or `--insecure`.
    pub fn provisionctl_env(&self) -> Vec<(String, String)> {
        let mut env = match &self.tls {
            Some(pki) => pki.provisionctl_env(),
            None => vec![("PROVISIONCTL_INSECURE".into(), "true".into())],
        };
        // The test's own (absent) configuration file, never the user's.
        env.push((
            "PROVISIONCTL_CONFIG".into(),
            self.dir
                .path()
                .join("provisionctl-config.yaml")
                .display()
                .to_string(),
        ));
        env
    }

    /// A client of the fake backend's control service (a test double the
    /// executor serves with `--backend fake --fake-control`), presenting the
    /// driver's certificate as every caller of the executor must.
    pub async fn fake_control(
        &self,
    ) -> anyhow::Result<pb::fake::v1::fake_control_client::FakeControlClient<Channel>> {
        Ok(pb::fake::v1::fake_control_client::FakeControlClient::new(
            self.executor.channel(Some(platform::tls::DRIVER)).await?,
        ))
    }

    /// Every live resource the executor reports, read in pages up to the
    /// last as the driver's orphan sweep reads them.
    pub async fn inventory(&self) -> anyhow::Result<Vec<pb::Resource>> {
        let mut c = self.executor_client().await?;
        let mut pages = c
            .inventory_pages(pb::InventoryRequest::default())
            .await?
            .into_inner();
        let mut resources = Vec::new();
        loop {
            let page = pages
                .message()
                .await?
                .context("the inventory stream ended before its last page")?;
            resources.extend(page.resources);
            if page.last {
                anyhow::ensure!(
                    pages.message().await?.is_none(),
                    "the inventory stream went on past its last page"
                );
                return Ok(resources);
            }
        }
    }

    /// Prints the services' logs (for a failing test).
    pub fn dump_logs(&self) {
        for name in ["decider-svc", "executor-svc", "driver-svc"] {
            if let Ok(s) = std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))) {
                let tail: Vec<&str> = s.lines().rev().take(60).collect();
                eprintln!("----- {name} (last lines) -----");
                for l in tail.iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
    }
}

/// Follows a run's watch stream until `done` says so, or `timeout` passes.
/// The run's whole event log, oldest first.
pub async fn run_events(
    client: &mut ProvisioningClient<Channel>,
    run_id: &str,
) -> anyhow::Result<Vec<pb::Event>> {
    Ok(client
        .list_events(pb::ListEventsRequest {
            run_id: run_id.to_owned(),
            after_seq: 0,
            limit: 0,
        })
        .await?
        .into_inner()
        .events)
}

pub async fn watch_until(
    client: &mut ProvisioningClient<Channel>,
    run_id: &str,
    timeout: Duration,
    mut done: impl FnMut(&pb::RunStatus) -> bool,
) -> anyhow::Result<pb::RunStatus> {
    let mut stream = client
        .watch_run(pb::WatchRunRequest {
            run_id: run_id.to_owned(),
            include_nodes: false,
        })
        .await?
        .into_inner();
    let follow = async {
        let mut last = None;
        while let Some(s) = stream.message().await? {
            if done(&s) {
                return Ok(s);
            }
            last = Some(s);
        }
        anyhow::bail!("watch ended; last status: {last:?}")
    };
    tokio::time::timeout(timeout, follow)
        .await
        .map_err(|_| anyhow::anyhow!("timed out after {timeout:?} waiting on {run_id}"))?
}

/// Reads a watch already open until `done`, within `timeout`; the watch
/// ending first, or failing, is an error.
pub async fn read_watch(
    watched: &mut tonic::Streaming<pb::RunStatus>,
    timeout: Duration,
    done: impl Fn(&pb::RunStatus) -> bool,
) -> anyhow::Result<pb::RunStatus> {
    let follow = async {
        while let Some(s) = watched.message().await? {
            if done(&s) {
                return Ok(s);
            }
        }
        anyhow::bail!("the watch ended")
    };
    tokio::time::timeout(timeout, follow)
        .await
        .map_err(|_| anyhow::anyhow!("the watch did not get there within {timeout:?}"))?
}

/// Asks `probe` every 50 ms until it answers `Some`, and returns that; an
/// error names `what` once `within` has passed. The one way tests wait for
/// something to happen: a test waits for the event itself (a status, a
/// counter), never for a fixed time after which it hopes it happened.
pub async fn eventually<T, Fut>(
    within: Duration,
    what: &str,
    mut probe: impl FnMut() -> Fut,
) -> anyhow::Result<T>
where
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(found) = probe().await {
            return Ok(found);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of one series (`name` or `name{labels}`, as exposed) in a
/// Prometheus text exposition; `None` when it is not there.
pub fn sample(exposition: &str, series: &str) -> Option<f64> {
    exposition.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.strip_prefix(' ')?.trim().parse().ok()
    })
}

/// A TCP proxy whose connections can be cut, to break a stream without
/// restarting either end. Its target can be set after it starts (so a service
/// can be told the proxy's address before the proxied service exists);
/// connections before then are refused.
#[derive(Debug)]
pub struct Proxy {
    pub addr: SocketAddr,
    target: tokio::sync::watch::Sender<Option<SocketAddr>>,
    cut: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = tokio::sync::watch::channel(0u64);
        let (target, target_rx) = tokio::sync::watch::channel(None::<SocketAddr>);
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Some(to) = *target_rx.borrow() else {
                    continue;
                };
                let mut cut_rx = cut_rx.clone();
                cut_rx.mark_unchanged();
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(to).await else {
                        return;
                    };
                    let (mut ri, mut wi) = inbound.into_split();
                    let (mut ro, mut wo) = outbound.into_split();
                    tokio::select! {
                        _ = tokio::io::copy(&mut ri, &mut wo) => {}
                        _ = tokio::io::copy(&mut ro, &mut wi) => {}
                        _ = cut_rx.changed() => {}
                    }
                });
            }
        });
        Ok(Self {
            addr,
            target,
            cut,
            task,
        })
    }

    pub fn set_target(&self, to: SocketAddr) {
        self.target.send_replace(Some(to));
    }

    /// Drops every live connection through the proxy.
    pub fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `(pid, --node, --attempt)` of every live node agent under `root`, from
/// `/proc` (a zombie has an empty command line and is not counted).
pub fn live_agent_pids(root: &Path) -> Vec<(u32, String, String)> {
    let needle = root.display().to_string();
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(raw) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.first().is_some_and(|a| a.ends_with("node-agent"))
            || !args.iter().any(|a| a.contains(&needle))
        {
            continue;
        }
        let flag = |name: &str| {
            args.iter()
                .position(|a| a == name)
                .and_then(|i| args.get(i + 1))
                .cloned()
                .unwrap_or_default()
        };
        out.push((pid, flag("--node"), flag("--attempt")));
    }
    out
}

/// Makes this process a child subreaper and starts, once, a thread that reaps
/// the node agents re-parented to it.
///
/// Node agents outlive their executor by design. When a test kills an
/// executor, its agents are re-parented to the nearest subreaper; without one
/// they go to init (which, in a container, may never reap them). As a
/// subreaper, this process receives them, and the thread waits on each one
/// that has ended, by PID and only for processes named `node-agent`, so it
/// never takes the exit status of a service child that tokio waits for.
pub fn become_subreaper() -> anyhow::Result<()> {
    static REAPER: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .context("becoming a child subreaper")?;
    REAPER.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("agent-reaper".to_owned())
            .spawn(|| {
                loop {
                    reap_orphaned_agents();
                    std::thread::sleep(Duration::from_millis(50));
                }
            });
        if let Err(e) = spawned {
            eprintln!("cannot start the agent reaper thread: {e}");
        }
    });
    Ok(())
}

/// One line of `/proc/<pid>/stat`, the parts the zombie checks read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcEntry {
    pub pid: u32,
    /// The command name (kept by the kernel for a zombie, whose command line
    /// is empty).
    pub comm: String,
    /// `R`, `S`, `T`, `Z`, ...
    pub state: char,
    pub ppid: u32,
}

/// Every process in `/proc`, from its `stat` line.
pub fn proc_table() -> Vec<ProcEntry> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // `pid (comm) state ppid ...`; the name may hold spaces and parens.
            let open = text.find('(')?;
            let close = text.rfind(')')?;
            let comm = text.get(open + 1..close)?.to_owned();
            let mut rest = text.get(close + 1..)?.split_whitespace();
            let state = rest.next()?.chars().next()?;
            let ppid = rest.next()?.parse().ok()?;
            Some(ProcEntry {
                pid,
                comm,
                state,
                ppid,
            })
        })
        .collect()
}

/// Zombies among this process's descendants: its own children that nobody
/// reaped, and children that a service (an executor) left unreaped.
pub fn zombie_descendants() -> Vec<ProcEntry> {
    let me = std::process::id();
    let table = proc_table();
    let parent: std::collections::HashMap<u32, u32> = table.iter().map(|p| (p.pid, p.ppid)).collect();
    let descends = |mut pid: u32| {
        // Bounded: a parent chain is short, and a racing table must not loop.
        for _ in 0..64 {
            match parent.get(&pid) {
                Some(&p) if p == me => return true,
                Some(&p) if p > 1 => pid = p,
                _ => return false,
            }
        }
        false
    };
    table
        .into_iter()
        .filter(|p| p.state == 'Z' && descends(p.pid))
        .collect()
}

/// Reaps every node agent that is a zombie child of this process (an agent
/// re-parented here whose executor was killed). Returns their PIDs.
pub fn reap_orphaned_agents() -> Vec<u32> {
    let me = std::process::id();
    let mut reaped = Vec::new();
    for p in proc_table() {
        if p.ppid != me || p.state != 'Z' || p.comm != "node-agent" {
            continue;
        }
        let Some(pid) = i32::try_from(p.pid).ok().and_then(rustix::process::Pid::from_raw) else {
            continue;
        };
        if let Ok(Some(_)) = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG) {
            reaped.push(p.pid);
        }
    }
    reaped
}

/// A test's node-agent directory (pass `root` to the executor's
/// `--process-state-dir`). Dropping it SIGKILLs every agent still running
/// under it (stopped ones included) and reaps those re-parented to the test,
/// so a failing test leaves no process behind: agents outlive their executor
/// by design.
#[derive(Debug)]
pub struct AgentsDir {
    _dir: tempfile::TempDir,
    pub root: PathBuf,
}

impl AgentsDir {
    pub fn new() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let root = dir.path().join("agents");
        Ok(Self { _dir: dir, root })
    }
}

impl Drop for AgentsDir {
    fn drop(&mut self) {
        let pids: Vec<u32> = live_agent_pids(&self.root)
            .into_iter()
            .map(|(pid, _, _)| pid)
            .collect();
        for pid in &pids {
            let _ = std::process::Command::new("kill")
                .arg("-KILL")
                .arg(pid.to_string())
                .status();
        }
        // The killed agents are zombies until their parent waits: the
        // executor, or (its executor gone) this process.
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while pids.iter().any(|pid| Path::new(&format!("/proc/{pid}")).exists())
            && std::time::Instant::now() < until
        {
            reap_orphaned_agents();
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Samples the live agents every few milliseconds until stopped, and keeps
/// every sample in which an identity had two live agents or a slot more than
/// two.
#[derive(Debug)]
pub struct Sampler {
    stop: Arc<AtomicBool>,
    doubles: Arc<Mutex<Vec<String>>>,
    samples: Arc<Mutex<u64>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    pub fn start(root: &Path) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let doubles = Arc::new(Mutex::new(Vec::new()));
        let samples = Arc::new(Mutex::new(0u64));
        let thread = {
            let (stop, doubles, samples, root) =
                (stop.clone(), doubles.clone(), samples.clone(), root.to_path_buf());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let mut per_identity: BTreeMap<(String, String), Vec<u32>> = BTreeMap::new();
                    let mut per_slot: BTreeMap<String, Vec<(u32, String)>> = BTreeMap::new();
                    for (pid, node, attempt) in live_agent_pids(&root) {
                        per_identity
                            .entry((node.clone(), attempt.clone()))
                            .or_default()
                            .push(pid);
                        per_slot.entry(node).or_default().push((pid, attempt));
                    }
                    for ((node, attempt), pids) in &per_identity {
                        if pids.len() > 1 {
                            lock(&doubles).push(format!(
                                "identity {node} attempt {attempt} has live agents {pids:?}"
                            ));
                        }
                    }
                    // A slot holds its current attempt and, under a
                    // rollout's surge, one successor (SPEC.md section 9).
                    for (node, live) in &per_slot {
                        if live.len() > 2 {
                            lock(&doubles).push(format!("slot {node} has live agents {live:?}"));
                        }
                    }
                    *lock(&samples) += 1;
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        };
        Self {
            stop,
            doubles,
            samples,
            thread: Some(thread),
        }
    }

    /// Stops sampling; fails the test if any sample saw two live agents of
    /// one identity, or more than two of one slot.
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let doubles = lock(&self.doubles).clone();
        assert!(doubles.is_empty(), "too many live agents at once: {doubles:?}");
        *lock(&self.samples)
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A lock that a panicked holder does not poison for the test.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_tail_is_the_files_last_lines_under_a_heading() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("driver-svc.log");
        let text: String = (1..=5).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&path, text).unwrap();
        let tail = log_tail("driver-svc", &path, 2);
        let lines: Vec<&str> = tail.lines().collect();
        assert!(
            lines[0].starts_with("--- driver-svc: the last 2 of 5 log lines"),
            "{tail}"
        );
        assert_eq!(&lines[1..], ["line 4", "line 5"]);
        let all = log_tail("driver-svc", &path, 80);
        assert!(
            all.contains("the last 5 of 5") && all.contains("line 1\n"),
            "{all}"
        );
        let missing = log_tail("executor-svc", &dir.path().join("none.log"), 2);
        assert!(missing.starts_with("--- executor-svc: no log at"), "{missing}");
    }
}
