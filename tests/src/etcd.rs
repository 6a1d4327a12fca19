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

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Etcd {
    pub fn start() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let (client, peer) = (free_port()?, free_port()?);
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new("etcd")
            .args(["--name", "test", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &client_url])
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

impl EtcdMembers {
    /// Starts every member at once (they wait for each other to form the
    /// cluster) and returns when each listens on its client endpoint.
    pub fn start(members: Vec<(Vec<String>, String)>) -> anyhow::Result<Self> {
        let mut started = Self {
            children: Vec::new(),
            endpoints: Vec::new(),
        };
        for (args, endpoint) in members {
            let child = Command::new("etcd")
                .args(&args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting etcd (Debian package etcd-server; .ci/run installs it)")?;
            started.children.push(child);
            started.endpoints.push(endpoint);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for (i, endpoint) in started.endpoints.iter().enumerate() {
            while TcpStream::connect(endpoint).is_err() {
                if let Some(status) = started.children[i].try_wait()? {
                    anyhow::bail!("etcd member {i} exited with {status}");
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "etcd member {i} did not start listening"
                );
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
