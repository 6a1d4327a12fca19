//! Private test hosts for the three services: a network namespace each,
//! joined by veth pairs with addresses of their own (10.91.0.0/16, never
//! routed anywhere), so that a link between two services can be cut for
//! real (`ip link set ... down`) and restored, instead of stopping a process
//! to stand for a partition.
//!
//! ```text
//!   test (this process) ──api── driver ──dec── decider
//!        │                         └─────exe── executor
//!        └──────────────inspect────────────────┘
//! ```
//!
//! The inspect link lets the test read the executor's inventory as the
//! driver would, apart from the link the test cuts.
//!
//! Made by the test as root with `ip` (iproute2) and torn down when
//! dropped: the services first (by their child handles), then the
//! namespaces, which takes their links with them. A machine where this
//! cannot be done fails the test, naming the command that failed.
//!
//! A link can also be cut one way (`iptables-legacy` dropping what one end
//! sends on it), so that packets go out and nothing comes back.
//!
//! Links can be made slow and lossy ([`NetCluster::impair`]): the kernel
//! here has no `netem` qdisc (`tc` answers "Specified qdisc kind is
//! unknown"), so each service's namespace sends what leaves it through a
//! netfilter queue, where `netdelay` (this crate's) holds each packet for
//! the delay and its jitter, or drops it.

use std::{
    net::SocketAddr,
    path::Path,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{Context as _, bail};

use crate::procs::{Service, TestPki};

/// A link of the test network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    /// The driver and the decider.
    Decider,
    /// The driver and the executor.
    Executor,
    /// The test (this process, as the client) and the driver.
    Api,
    /// The test and the executor (to read its inventory).
    Inspect,
}

/// The namespaces, their links and the services in them.
#[derive(Debug)]
pub struct NetCluster {
    pub decider: Service,
    pub executor: Service,
    pub driver: Service,
    /// The `netdelay`s of an impaired network (stopped before it goes).
    delayers: Delayers,
    net: Net,
    /// Logs and ready files; declared last, so it goes after the services.
    pub dir: tempfile::TempDir,
}

/// The `netdelay` processes and the namespaces whose packets go through
/// them. When dropped (after the services), the namespaces stop queueing
/// first, so that the services' last packets (their connections closing)
/// still go out, and then each `netdelay` is ended by its child handle. A
/// queue with no one reading it loses every packet, and a closing socket
/// that can send nothing keeps its namespace, and that namespace's
/// addresses, alive for minutes.
#[derive(Debug, Default)]
struct Delayers {
    children: Vec<std::process::Child>,
    namespaces: Vec<String>,
}

impl Drop for Delayers {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            let _ = Command::new("ip")
                .args(["netns", "exec", ns, "iptables-legacy", "-F", "OUTPUT"])
                .output();
        }
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The namespaces and links alone (no processes).
#[derive(Debug)]
struct Net {
    /// `<prefix>-d`, `-c`, `-e`: the driver's, the decider's, the executor's.
    prefix: String,
    /// The third octet of the first of the three /30 subnets.
    octet: u32,
}

static NETS: AtomicU32 = AtomicU32::new(0);

/// A network namespace with its loopback up.
fn add_namespace(ns: &str) -> anyhow::Result<()> {
    ip(&["netns", "add", ns])?;
    ip(&["-n", ns, "link", "set", "lo", "up"])
}

/// A veth pair joining its two ends: (namespace, or this one for `None`;
/// interface; address, a /30), each end addressed and up.
fn veth(ends: [(Option<String>, String, String); 2]) -> anyhow::Result<()> {
    let [(_, if_a, _), (_, if_b, _)] = &ends;
    ip(&["link", "add", if_a, "type", "veth", "peer", "name", if_b])?;
    for (ns, ifname, addr) in &ends {
        let mut at: Vec<&str> = Vec::new();
        if let Some(ns) = ns {
            ip(&["link", "set", ifname, "netns", ns])?;
            at.extend(["-n", ns]);
        }
        ip(&[
            at.as_slice(),
            &["addr", "add", &format!("{addr}/30"), "dev", ifname],
        ]
        .concat())?;
        ip(&[at.as_slice(), &["link", "set", ifname, "up"]].concat())?;
    }
    Ok(())
}

/// The first of four free /24s of 10.91.0.0/16 (third octets `k..k+4`),
/// none of them on a link of this namespace now: a test network the kernel
/// is still tearing down (its sockets closing) keeps its addresses a while,
/// and a new one on the same subnets would route into it.
fn free_octets() -> anyhow::Result<u32> {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .context("running ip (iproute2): install it, or run .ci/needs --install")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let used: std::collections::BTreeSet<u32> = text
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("10.91."))
        .filter_map(|rest| rest.split('.').next()?.parse().ok())
        .collect();
    let start = NETS.fetch_add(1, Ordering::SeqCst);
    for step in 0..60 {
        let k = ((start + step) * 4) % 240 + 4;
        if (k..k + 4).all(|o| !used.contains(&o)) {
            return Ok(k);
        }
    }
    bail!("no free subnets left in 10.91.0.0/16 (in use: {used:?})")
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2): install it, or run .ci/needs --install")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed (the network tests need root, or CAP_NET_ADMIN): {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Net {
    fn ns(&self, who: char) -> String {
        format!("{}-{who}", self.prefix)
    }

    /// The two ends of `link`: (namespace, interface, address) each, the
    /// driver's (or, for the API link, the test's) first.
    fn ends(&self, link: Link) -> [(Option<String>, String, String); 2] {
        let (k, far, tag) = match link {
            Link::Decider => (self.octet, Some(self.ns('c')), "c"),
            Link::Executor => (self.octet + 1, Some(self.ns('e')), "e"),
            Link::Api => (self.octet + 2, None, "a"),
            Link::Inspect => (self.octet + 3, None, "i"),
        };
        let n = &self.prefix[self.prefix.len().saturating_sub(6)..];
        match link {
            Link::Api => [
                (None, format!("{n}t{tag}"), format!("10.91.{k}.1")),
                (Some(self.ns('d')), format!("{n}d{tag}"), format!("10.91.{k}.2")),
            ],
            Link::Inspect => [
                (None, format!("{n}t{tag}"), format!("10.91.{k}.1")),
                (Some(self.ns('e')), format!("{n}x{tag}"), format!("10.91.{k}.2")),
            ],
            _ => [
                (Some(self.ns('d')), format!("{n}d{tag}"), format!("10.91.{k}.1")),
                (far, format!("{n}x{tag}"), format!("10.91.{k}.2")),
            ],
        }
    }

    fn create() -> anyhow::Result<Self> {
        let octet = free_octets()?;
        let net = Self {
            prefix: format!("pv{}n{octet}", std::process::id() % 100_000),
            octet,
        };
        for who in ['d', 'c', 'e'] {
            add_namespace(&net.ns(who))?;
        }
        for link in [Link::Decider, Link::Executor, Link::Api, Link::Inspect] {
            veth(net.ends(link))?;
        }
        Ok(net)
    }

    /// Drops (or stops dropping) what one end of `link` sends on it: the far
    /// end's sending when `far`, else the driver's (or the test's).
    fn drop_sent(&self, link: Link, far: bool, drop: bool) -> anyhow::Result<()> {
        let [near, far_end] = self.ends(link);
        let (ns, ifname, _) = if far { far_end } else { near };
        let rule = if drop { "-A" } else { "-D" };
        let mut args: Vec<String> = Vec::new();
        if let Some(ns) = &ns {
            args.extend(["netns".into(), "exec".into(), ns.clone()]);
        }
        args.extend(
            ["iptables-legacy", rule, "OUTPUT", "-o", &ifname, "-j", "DROP"]
                .iter()
                .map(|s| (*s).to_owned()),
        );
        let (program, rest) = if ns.is_some() {
            ("ip", &args[..])
        } else {
            ("iptables-legacy", &args[1..])
        };
        let out = Command::new(program)
            .args(rest)
            .output()
            .context("running iptables-legacy (Debian's iptables): install it, or run .ci/needs --install")?;
        if !out.status.success() {
            bail!(
                "`{program} {}` failed: {}",
                rest.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Takes `link` down (`up: false`) or brings it back.
    fn set(&self, link: Link, up: bool) -> anyhow::Result<()> {
        let [(ns, ifname, _), _] = self.ends(link);
        let state = if up { "up" } else { "down" };
        match ns {
            Some(ns) => ip(&["-n", &ns, "link", "set", &ifname, state]),
            None => ip(&["link", "set", &ifname, state]),
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth ends in it, and with them
        // their peers; the API link's end in this namespace goes too.
        for who in ['d', 'c', 'e'] {
            let _ = ip(&["netns", "del", &self.ns(who)]);
        }
    }
}

impl NetCluster {
    /// The three services, each in its namespace, with TLS certificates
    /// that name their addresses there; `driver_args` and `executor_args`
    /// are added to each's flags.
    pub async fn start(driver_args: &[&str], executor_args: &[&str]) -> anyhow::Result<Self> {
        crate::procs::become_subreaper()?;
        let dir = tempfile::tempdir()?;
        let net = Net::create()?;
        let pki = TestPki::create(dir.path())?;
        let [(_, _, driver_dec), (_, _, decider_addr)] = net.ends(Link::Decider);
        let [(_, _, driver_exe), (_, _, executor_addr)] = net.ends(Link::Executor);
        let [_, (_, _, driver_api)] = net.ends(Link::Api);
        let [_, (_, _, executor_inspect)] = net.ends(Link::Inspect);
        // Certificates for the addresses the services are reached at.
        for (name, addrs) in [
            ("decider-svc", vec![decider_addr.clone()]),
            (
                "executor-svc",
                vec![executor_addr.clone(), executor_inspect.clone()],
            ),
            (
                "driver-svc",
                vec![driver_dec.clone(), driver_exe.clone(), driver_api.clone()],
            ),
        ] {
            let mut hosts = TestPki::hosts();
            hosts.extend(addrs);
            let now = std::time::SystemTime::now();
            let validity = platform::tls::dev::Validity {
                not_before: now - std::time::Duration::from_secs(3600),
                not_after: now + std::time::Duration::from_secs(86_400),
            };
            pki.issue(name, &platform::tls::dev::Leaf::service(name, &hosts, validity))?;
        }
        let decider = Service::start_wrapped(
            "decider-svc",
            dir.path(),
            &format!("{decider_addr}:0"),
            &[],
            &[],
            &["ip", "netns", "exec", &net.ns('c')],
        )
        .await?;
        let mut exe_args = vec![
            "--state-dir".to_owned(),
            dir.path().join("executor-state").display().to_string(),
        ];
        exe_args.extend(executor_args.iter().map(|a| (*a).to_owned()));
        let executor = Service::start_wrapped(
            "executor-svc",
            dir.path(),
            // Its address on the driver's link and on the inspect link.
            "0.0.0.0:0",
            &exe_args,
            &[],
            &["ip", "netns", "exec", &net.ns('e')],
        )
        .await?;
        let mut args = vec![
            "--decider".to_owned(),
            decider.url(),
            "--executor".to_owned(),
            format!("https://{executor_addr}:{}", executor.addr.port()),
            "--data-dir".to_owned(),
            dir.path().join("driver-data").display().to_string(),
            "--allow-unauthenticated".to_owned(),
            "--metrics-listen".to_owned(),
            "0.0.0.0:0".to_owned(),
        ];
        args.extend(driver_args.iter().map(|a| (*a).to_owned()));
        let driver = Service::start_wrapped(
            "driver-svc",
            dir.path(),
            // Every address of its namespace: the API link's, and the two
            // links it calls out on.
            "0.0.0.0:0",
            &args,
            &[],
            &["ip", "netns", "exec", &net.ns('d')],
        )
        .await?;
        Ok(Self {
            decider,
            executor,
            driver,
            delayers: Delayers::default(),
            net,
            dir,
        })
    }

    /// Where the test reaches the driver: its address on the API link.
    pub fn driver_addr(&self) -> SocketAddr {
        let [_, (_, _, addr)] = self.net.ends(Link::Api);
        SocketAddr::new(
            addr.parse().unwrap_or([10, 91, 0, 2].into()),
            self.driver.addr.port(),
        )
    }

    /// A client of the driver's API over the API link, as provisionctl
    /// (its certificate).
    pub async fn client(
        &self,
    ) -> anyhow::Result<contract::pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>>
    {
        let pki = TestPki::find(self.dir.path()).context("the cluster's PKI")?;
        let endpoint = pki
            .transport(Some(platform::tls::dev::CLIENT))?
            .endpoint(&format!("https://{}", self.driver_addr()))?;
        Ok(contract::pb::provisioning_client::ProvisioningClient::new(
            endpoint.connect().await?,
        ))
    }

    /// The executor's inventory, read over the inspect link with the
    /// driver's certificate (the only one the executor answers).
    pub async fn inventory(&self) -> anyhow::Result<Vec<contract::pb::Resource>> {
        let pki = TestPki::find(self.dir.path()).context("the cluster's PKI")?;
        let [_, (_, _, addr)] = self.net.ends(Link::Inspect);
        let endpoint = pki
            .transport(Some(platform::tls::DRIVER))?
            .endpoint(&format!("https://{addr}:{}", self.executor.addr.port()))?;
        let mut client = contract::pb::executor_client::ExecutorClient::new(endpoint.connect().await?);
        Ok(client
            .inventory(contract::pb::InventoryRequest::default())
            .await?
            .into_inner()
            .resources)
    }

    /// The driver's metrics (Prometheus text), over the API link.
    pub async fn driver_metrics(&self) -> anyhow::Result<String> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let port = self
            .driver
            .metrics_addr
            .context("the driver serves no metrics")?
            .port();
        let addr = SocketAddr::new(self.driver_addr().ip(), port);
        let mut conn = tokio::net::TcpStream::connect(addr).await?;
        conn.write_all(
            format!("GET /metrics HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
        let mut response = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            conn.read_to_string(&mut response),
        )
        .await??;
        Ok(response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default())
    }

    /// Cuts `link`: both directions, as a pulled cable does.
    pub fn cut(&self, link: Link) -> anyhow::Result<()> {
        self.net.set(link, false)
    }

    /// Brings `link` back.
    pub fn restore(&self, link: Link) -> anyhow::Result<()> {
        self.net.set(link, true)
    }

    /// Cuts `link` one way: what the far end (the decider, the executor)
    /// sends on it is dropped (`toward_driver`), or what the driver sends.
    pub fn cut_one_way(&self, link: Link, toward_driver: bool) -> anyhow::Result<()> {
        self.net.drop_sent(link, toward_driver, true)
    }

    /// Takes back [`NetCluster::cut_one_way`].
    pub fn restore_one_way(&self, link: Link, toward_driver: bool) -> anyhow::Result<()> {
        self.net.drop_sent(link, toward_driver, false)
    }

    /// Makes every link slow and lossy: what each service's namespace sends
    /// on its links is held for `delay_ms` ± `jitter_ms` and dropped with
    /// probability `loss`, so each direction of every link has them (the
    /// test's own sending on the API and inspect links excepted). For the
    /// rest of the cluster's life.
    pub fn impair(&mut self, delay_ms: u64, jitter_ms: u64, loss: f64, seed: u64) -> anyhow::Result<()> {
        use std::io::BufRead as _;
        let netdelay = crate::procs::bin_path("netdelay")?;
        for (i, who) in ['d', 'c', 'e'].into_iter().enumerate() {
            let ns = self.net.ns(who);
            let mut child = Command::new("ip")
                .args(["netns", "exec", &ns])
                .arg(&netdelay)
                .args([
                    "--delay-ms",
                    &delay_ms.to_string(),
                    "--jitter-ms",
                    &jitter_ms.to_string(),
                    "--loss",
                    &loss.to_string(),
                    "--seed",
                    &(seed + i as u64).to_string(),
                    "--stats",
                    &self
                        .dir
                        .path()
                        .join(format!("netdelay-{who}.stats"))
                        .display()
                        .to_string(),
                ])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .context("starting netdelay")?;
            let stdout = child.stdout.take().context("netdelay's output")?;
            self.delayers.children.push(child);
            let mut line = String::new();
            std::io::BufReader::new(stdout).read_line(&mut line)?;
            if line.trim() != "bound" {
                bail!("netdelay in {ns} did not bind its queue (said {line:?})");
            }
            let out = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &ns,
                    "iptables-legacy",
                    "-A",
                    "OUTPUT",
                    "!",
                    "-o",
                    "lo",
                ])
                .args(["-j", "NFQUEUE", "--queue-num", "0"])
                .output()
                .context(
                    "running iptables-legacy (Debian's iptables): install it, or run .ci/needs --install",
                )?;
            self.delayers.namespaces.push(ns.clone());
            if !out.status.success() {
                bail!(
                    "queueing {ns}'s packets to netdelay failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        Ok(())
    }

    /// What the `netdelay`s of [`NetCluster::impair`] have let through and
    /// dropped so far, summed: (passed, dropped).
    pub fn impaired_packets(&self) -> (u64, u64) {
        let mut sum = (0, 0);
        for who in ['d', 'c', 'e'] {
            let path = self.dir.path().join(format!("netdelay-{who}.stats"));
            let text = std::fs::read_to_string(path).unwrap_or_default();
            let words: Vec<&str> = text.split_whitespace().collect();
            if let ["passed", p, "dropped", d] = words[..] {
                sum.0 += p.parse::<u64>().unwrap_or(0);
                sum.1 += d.parse::<u64>().unwrap_or(0);
            }
        }
        sum
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// One private test host: a network namespace joined to this one by a veth
/// pair (this end `near`, the host's end `far`, a /30 of 10.91.0.0/16), for
/// one process that must be cut off from some of what it talks to and not
/// from the rest. Deleted, with its link, when dropped; the processes in it
/// must be ended first.
#[derive(Debug)]
pub struct Host {
    ns: String,
    /// This namespace's address on the link (what the host reaches us at).
    pub near: String,
    /// The host's address on the link.
    pub far: String,
}

/// Which way [`Host::drop_port`] loses packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// What the host sends to the port.
    Out,
    /// What comes back to the host from it.
    In,
}

impl Host {
    pub fn create() -> anyhow::Result<Self> {
        let octet = free_octets()?;
        let name = format!("pv{}h{octet}", std::process::id() % 100_000);
        let host = Self {
            ns: name.clone(),
            near: format!("10.91.{octet}.1"),
            far: format!("10.91.{octet}.2"),
        };
        add_namespace(&host.ns)?;
        veth([
            (None, format!("{name}a"), host.near.clone()),
            (Some(host.ns.clone()), format!("{name}b"), host.far.clone()),
        ])?;
        Ok(host)
    }

    /// The command prefix that runs a program on the host.
    pub fn wrapper(&self) -> [&str; 4] {
        ["ip", "netns", "exec", &self.ns]
    }

    /// Loses (or, with `on: false`, stops losing) the TCP packets between
    /// the host and `port` on this side that go `direction`: a partition
    /// from that one peer, one way or (called for both) both ways, while
    /// every other peer is reached as before.
    pub fn drop_port(&self, port: u16, direction: Direction, on: bool) -> anyhow::Result<()> {
        let port = port.to_string();
        let (chain, peer, match_port) = match direction {
            Direction::Out => ("OUTPUT", "-d", "--dport"),
            Direction::In => ("INPUT", "-s", "--sport"),
        };
        let rule = if on { "-A" } else { "-D" };
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns, "iptables-legacy", rule, chain])
            .args(["-p", "tcp", peer, &self.near, match_port, &port, "-j", "DROP"])
            .output()
            .context("running iptables-legacy (Debian's iptables): install it, or run .ci/needs --install")?;
        if !out.status.success() {
            bail!(
                "dropping {direction:?} packets for port {port} in {} failed: {}",
                self.ns,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        // Takes the veth pair with it.
        let _ = ip(&["netns", "del", &self.ns]);
    }
}
