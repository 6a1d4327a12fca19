//! A real etcd for tests and benchmarks (feature `etcd`): one member on
//! loopback with a temporary data directory (Debian's `etcd-server`), and the
//! reads tests make of the driver's keys.

use std::{
    net::{TcpListener, TcpStream},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use etcd_client::{EventType, GetOptions, WatchOptions};

/// The driver's default key prefix.
pub const PREFIX: &str = "/provisioning/v1/";

/// One etcd member on loopback; killed when dropped.
#[derive(Debug)]
pub struct Etcd {
    child: Child,
    pub endpoint: String,
    _dir: tempfile::TempDir,
}

/// A loopback port free now, for a process started a moment later to bind.
///
/// Chosen below the kernel's ephemeral range (32768 and up on Linux), where
/// the outgoing connections of every test running alongside take theirs and
/// a port asked of the kernel (`bind` to port 0) would come from: a free
/// port from there can be taken by any connection before its process binds
/// it. Ports are handed out once per test process, starting at an offset
/// drawn from the process id.
pub fn free_port() -> anyhow::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7919) % SPAN,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..SPAN {
        let port = u16::try_from(LOW + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN)?;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    anyhow::bail!("no free loopback port between {LOW} and {}", LOW + SPAN)
}

impl Etcd {
    pub fn start() -> anyhow::Result<Self> {
        Self::start_on("127.0.0.1")
    }

    /// A member that serves its clients on `listen_host` (`0.0.0.0`: also
    /// to private test hosts, at this namespace's address on their links);
    /// [`Etcd::endpoint`] is on loopback either way.
    pub fn start_on(listen_host: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let (client, peer) = (free_port()?, free_port()?);
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "test", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &format!("http://{listen_host}:{client}")])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting etcd (Debian package etcd-server; .ci/run installs it)")?;
        let etcd = Self {
            child,
            endpoint: format!("127.0.0.1:{client}"),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(&etcd.endpoint).is_err() {
            anyhow::ensure!(Instant::now() < deadline, "etcd did not start listening");
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(etcd)
    }

    /// Kills the member (the process this value started) and waits for it.
    pub fn kill(&mut self) -> std::io::Result<()> {
        self.child.kill()?;
        self.child.wait().map(|_| ())
    }

    /// The port it serves its clients on.
    pub fn port(&self) -> u16 {
        self.endpoint
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or_default()
    }

    /// The member's process id (to pause it, as a stalled etcd).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A client, once etcd answers.
    pub async fn client(&self) -> anyhow::Result<etcd_client::Client> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = etcd_client::Client::connect([self.endpoint.as_str()], None).await
                && c.status().await.is_ok()
            {
                return Ok(c);
            }
            anyhow::ensure!(Instant::now() < deadline, "etcd did not answer");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// etcd members started with the arguments the caller gives each (a
/// manifest's, mapped onto loopback); all killed when dropped.
#[derive(Debug)]
pub struct EtcdMembers {
    children: Vec<Child>,
    /// Each member's client endpoint (`127.0.0.1:port`), in start order.
    pub endpoints: Vec<String>,
}

/// Why a start of [`EtcdMembers`] failed.
#[derive(Debug)]
pub enum MembersStart {
    /// A member could not bind a port it was given (another process took it
    /// between its choice and the member's start): start again on others.
    PortTaken(anyhow::Error),
    Failed(anyhow::Error),
}

impl EtcdMembers {
    /// Starts every member at once (they wait for each other to form the
    /// cluster) and returns when each listens on its client endpoint. Each
    /// member's log is `logs/etcd-<i>.log`; a member that exits early is
    /// reported with the end of its log.
    pub fn start(members: Vec<(Vec<String>, String)>, logs: &std::path::Path) -> Result<Self, MembersStart> {
        let failed = MembersStart::Failed;
        let mut started = Self {
            children: Vec::new(),
            endpoints: Vec::new(),
        };
        let mut log_paths = Vec::new();
        for (i, (args, endpoint)) in members.into_iter().enumerate() {
            let log_path = logs.join(format!("etcd-{i}.log"));
            let log = std::fs::File::create(&log_path)
                .context("creating an etcd log")
                .map_err(failed)?;
            let child = Command::new("etcd")
                .args(&args)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .context("starting etcd (Debian package etcd-server; .ci/run installs it)")
                .map_err(failed)?;
            started.children.push(child);
            started.endpoints.push(endpoint);
            log_paths.push(log_path);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for (i, endpoint) in started.endpoints.iter().enumerate() {
            while TcpStream::connect(endpoint).is_err() {
                let exited = started.children[i]
                    .try_wait()
                    .context("waiting on etcd")
                    .map_err(failed)?;
                if let Some(status) = exited {
                    let log = std::fs::read_to_string(&log_paths[i]).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(5).collect();
                    let error = anyhow::anyhow!(
                        "etcd member {i} exited with {status}; its log ends:\n{}",
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                    return Err(if log.contains("address already in use") {
                        MembersStart::PortTaken(error)
                    } else {
                        MembersStart::Failed(error)
                    });
                }
                if Instant::now() >= deadline {
                    return Err(failed(anyhow::anyhow!("etcd member {i} did not start listening")));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(started)
    }

    /// Kills member `i` (SIGKILL) and waits for it.
    pub fn kill(&mut self, i: usize) -> anyhow::Result<()> {
        let child = self.children.get_mut(i).context("no such member")?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }
}

impl Drop for EtcdMembers {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A plain HTTP/1.0 GET on loopback, as a kubelet's `httpGet` probe: the
/// status code and the body.
pub fn http_get(addr: &str, path: &str) -> anyhow::Result<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("not an HTTP response: {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((code, body))
}

/// The owner id in a run's ownership key, if any.
pub async fn owner(etcd: &mut etcd_client::Client, uid: &str) -> anyhow::Result<Option<String>> {
    let r = etcd.get(format!("{PREFIX}owners/{uid}"), None).await?;
    Ok(r.kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
}

/// A key's history: `(revision, value)`, `None` for a deletion. Every key the
/// driver writes is under [`PREFIX`], so a watch of the prefix from the first
/// revision has seen everything once it reaches the current revision.
pub async fn history(
    etcd: &mut etcd_client::Client,
    key: &str,
) -> anyhow::Result<Vec<(i64, Option<String>)>> {
    let head = etcd
        .get(key, Some(GetOptions::new().with_keys_only()))
        .await?
        .header()
        .map_or(0, |h| h.revision());
    let mut stream = etcd
        .watch(
            PREFIX,
            Some(WatchOptions::new().with_prefix().with_start_revision(1)),
        )
        .await?;
    let mut out = Vec::new();
    let read = async {
        let mut seen = 0;
        while seen < head {
            let Some(resp) = stream.message().await? else {
                anyhow::bail!("the watch ended at revision {seen} of {head}");
            };
            for e in resp.events() {
                let Some(kv) = e.kv() else { continue };
                seen = seen.max(kv.mod_revision());
                if kv.key() != key.as_bytes() {
                    continue;
                }
                let value = match e.event_type() {
                    EventType::Put => Some(String::from_utf8_lossy(kv.value()).into_owned()),
                    EventType::Delete => None,
                };
                out.push((kv.mod_revision(), value));
            }
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .context("reading a key's history from etcd")??;
    Ok(out)
}
