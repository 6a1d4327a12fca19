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
