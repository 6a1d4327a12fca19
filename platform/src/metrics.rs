//! The services' Prometheus metrics: a registry on the Prometheus
//! project's Rust client (`prometheus-client`) and the HTTP endpoint that
//! serves it.
//!
//! Three kinds of metric families, each with a fixed list of label names:
//! [`Counter`], [`Gauge`] and [`Histogram`]. [`Registry::render`] writes
//! them in the Prometheus text format (version 0.0.4), and
//! [`Registry::render_openmetrics`] in OpenMetrics 1.0; [`serve`] answers
//! `GET /metrics` with the one the scraper's `Accept` header asks for over a
//! minimal HTTP/1.1 responder, so the services need no HTTP framework for
//! one read-only page.
//!
//! What this module adds to the client: families registered by name on
//! first use and shared after (several services started in one process,
//! as tests do, share the process-wide [`global`] registry and their series
//! add up, as they would in one scrape of that process); label values
//! passed as a slice in the family's label order, each series' handle
//! cached so that counting a known series allocates nothing; series
//! exported from registration (a family without labels at zero, a closed
//! set of label values declared with [`Counter::init`]), so a rate over it
//! starts from a sample rather than from its first event; and scrape hooks
//! ([`Registry::on_scrape`]) that fill in values cheaper to read than to
//! maintain (nodes by stage, runs by phase) just before each render.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, MutexGuard, OnceLock},
    time::Duration,
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{
        counter::{ConstCounter, Counter as ClientCounter},
        family::{Family as ClientFamily, MetricConstructor},
        gauge::{ConstGauge, Gauge as ClientGauge},
        histogram::Histogram as ClientHistogram,
        info::Info,
    },
    registry::Registry as ClientRegistry,
};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};

/// Latency buckets in seconds, from a millisecond to a minute: operations and
/// passes in this system take from about a millisecond (a fake backend) to
/// tens of seconds (a real bootstrap).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The process-wide registry every service registers its metrics in.
pub fn global() -> &'static Registry {
    static GLOBAL: OnceLock<Registry> = OnceLock::new();
    GLOBAL.get_or_init(Registry::default)
}

/// Locks a mutex, recovering the data if a panicking thread poisoned it: a
/// metric value is never left half-written by a panic, so the data is sound.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A callback run before each render; it returns `false` once the state it
/// reads is gone, and is then dropped.
type ScrapeHook = Box<dyn Fn() -> bool + Send + Sync>;

/// A series' labels as the client encodes them: (name, value) in the
/// family's label order.
type Labels = Vec<(&'static str, String)>;

/// A set of metric families.
#[derive(Default)]
pub struct Registry {
    client: Mutex<ClientRegistry>,
    families: Mutex<Vec<Family>>,
    hooks: Mutex<Vec<ScrapeHook>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = lock(&self.families).iter().map(|f| f.name().to_owned()).collect();
        f.debug_struct("Registry")
            .field("families", &names)
            .finish_non_exhaustive()
    }
}

#[derive(Clone)]
enum Family {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(Histogram),
}

impl Family {
    fn name(&self) -> &str {
        match self {
            Family::Counter(c) => &c.0.desc.name,
            Family::Gauge(g) => &g.0.desc.name,
            Family::Histogram(h) => &h.0.desc.name,
        }
    }
}

#[derive(Debug)]
struct Desc {
    name: String,
    labels: Vec<&'static str>,
}

impl Desc {
    fn new(name: &str, labels: &[&'static str]) -> Self {
        Self {
            name: name.to_owned(),
            labels: labels.to_vec(),
        }
    }

    /// Whether `values` has one value per label. A call with the wrong
    /// number of values is a bug in the caller; it is dropped rather than
    /// exported under a wrong name.
    fn fits(&self, values: &[&str]) -> bool {
        debug_assert_eq!(values.len(), self.labels.len(), "label values of {}", self.name);
        values.len() == self.labels.len()
    }

    fn labels(&self, values: &[&str]) -> Labels {
        self.labels
            .iter()
            .zip(values)
            .map(|(n, v)| (*n, (*v).to_owned()))
            .collect()
    }

    /// The cached handle of the series for `values`, made in `family` if it
    /// is new; `None` for the wrong number of values. A series seen before
    /// is found without allocating its key, which matters on paths counted
    /// once per operation.
    fn series<M: Clone, C: MetricConstructor<M>>(
        &self,
        cache: &Mutex<BTreeMap<Vec<String>, M>>,
        family: &ClientFamily<Labels, M, C>,
        values: &[&str],
    ) -> Option<M> {
        /// Families are small (a label set per effect, outcome or reason); a
        /// larger one is searched by its allocated key.
        const SCAN: usize = 64;
        if !self.fits(values) {
            return None;
        }
        let mut cache = lock(cache);
        let same = |k: &Vec<String>| k.iter().map(String::as_str).eq(values.iter().copied());
        if cache.len() <= SCAN
            && let Some((_, m)) = cache.iter().find(|(k, _)| same(k))
        {
            return Some(m.clone());
        }
        let key: Vec<String> = values.iter().map(|v| (*v).to_owned()).collect();
        let m = cache
            .entry(key)
            .or_insert_with(|| family.get_or_create_owned(&self.labels(values)));
        Some(m.clone())
    }
}

impl Desc {
    /// The cached handle of the series for `values`, if it was made.
    fn cached<M: Clone>(&self, cache: &Mutex<BTreeMap<Vec<String>, M>>, values: &[&str]) -> Option<M> {
        let same = |k: &Vec<String>| k.iter().map(String::as_str).eq(values.iter().copied());
        lock(cache).iter().find(|(k, _)| same(k)).map(|(_, m)| m.clone())
    }
}

/// The client appends the period itself.
fn help_text(help: &str) -> &str {
    help.strip_suffix('.').unwrap_or(help)
}

impl Registry {
    /// The counter family `name` (ending in `_total`), registered on first
    /// use.
    pub fn counter(&self, name: &str, help: &str, labels: &[&'static str]) -> Counter {
        let mut families = lock(&self.families);
        for f in families.iter() {
            if let Family::Counter(c) = f
                && c.0.desc.name == name
            {
                return c.clone();
            }
        }
        let c = Counter(Arc::new(CounterInner {
            desc: Desc::new(name, labels),
            family: ClientFamily::default(),
            cache: Mutex::default(),
        }));
        // The client names a counter's samples `<family>_total`.
        let family = name.strip_suffix("_total").unwrap_or(name);
        lock(&self.client).register(family, help_text(help), c.0.family.clone());
        if labels.is_empty() {
            c.init(&[]);
        }
        families.push(Family::Counter(c.clone()));
        c
    }

    /// The gauge family `name`, registered on first use.
    pub fn gauge(&self, name: &str, help: &str, labels: &[&'static str]) -> Gauge {
        let mut families = lock(&self.families);
        for f in families.iter() {
            if let Family::Gauge(g) = f
                && g.0.desc.name == name
            {
                return g.clone();
            }
        }
        let g = Gauge(Arc::new(GaugeInner {
            desc: Desc::new(name, labels),
            family: ClientFamily::default(),
            cache: Mutex::default(),
        }));
        lock(&self.client).register(name, help_text(help), g.0.family.clone());
        if labels.is_empty() {
            g.add(&[], 0.0);
        }
        families.push(Family::Gauge(g.clone()));
        g
    }

    /// The histogram family `name` with `buckets` (upper bounds, ascending),
    /// registered on first use.
    pub fn histogram(&self, name: &str, help: &str, labels: &[&'static str], buckets: &[f64]) -> Histogram {
        let mut families = lock(&self.families);
        for f in families.iter() {
            if let Family::Histogram(h) = f
                && h.0.desc.name == name
            {
                return h.clone();
            }
        }
        let h = Histogram(Arc::new(HistogramInner {
            desc: Desc::new(name, labels),
            family: ClientFamily::new_with_constructor(Buckets(buckets.into())),
            cache: Mutex::default(),
        }));
        lock(&self.client).register(name, help_text(help), h.0.family.clone());
        if labels.is_empty() {
            let _ = h.0.desc.series(&h.0.cache, &h.0.family, &[]);
        }
        families.push(Family::Histogram(h.clone()));
        h
    }

    /// Runs `hook` before every render, until it returns `false`.
    pub fn on_scrape(&self, hook: impl Fn() -> bool + Send + Sync + 'static) {
        lock(&self.hooks).push(Box::new(hook));
    }

    /// Every family in the Prometheus text format (version 0.0.4), in
    /// registration order.
    pub fn render(&self) -> String {
        lock(&self.hooks).retain(|hook| hook());
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &lock(&self.client));
        out
    }

    /// Every family in OpenMetrics 1.0 text, ending with `# EOF`.
    pub fn render_openmetrics(&self) -> String {
        lock(&self.hooks).retain(|hook| hook());
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &lock(&self.client));
        out
    }
}

/// A histogram family's bucket bounds, which each new series gets.
#[derive(Debug, Clone)]
struct Buckets(Arc<[f64]>);

impl MetricConstructor<ClientHistogram> for Buckets {
    fn new_metric(&self) -> ClientHistogram {
        ClientHistogram::new(self.0.iter().copied())
    }
}

/// Registers the standard process metrics (the names every Prometheus client
/// exports: `process_cpu_seconds_total`, `process_resident_memory_bytes`,
/// `process_virtual_memory_bytes`, `process_open_fds`, `process_max_fds`,
/// `process_start_time_seconds`, and `process_threads`), read from `/proc`
/// at each scrape by a collector, and `provisioning_build_info{service,version}`
/// at 1 (an info metric). Where `/proc` is not there, the process families
/// are left out.
pub fn process_metrics(registry: &'static Registry, service: &str) {
    let mut client = lock(&registry.client);
    client.register(
        "provisioning_build",
        "1, labelled with the service and its version (the crate version)",
        Info::new(vec![
            ("service", service.to_owned()),
            ("version", env!("CARGO_PKG_VERSION").to_owned()),
        ]),
    );
    client.register_collector(Box::new(ProcessCollector));
}

/// The process metrics, read from `/proc/self` at each scrape. (The client
/// has no process collector of its own; the one published for it pulls in
/// `procfs` and a second `rustix` for these seven numbers.)
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(p) = read_process() else {
            return Ok(());
        };
        // Clock ticks, 100 a second; the kernel's count only goes up.
        let cpu = ConstCounter::new(p.cpu_centis as f64 / 100.0);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "User and system CPU time the process has used, in seconds.",
            None,
            cpu.metric_type(),
        )?)?;
        for (name, help, v) in [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                p.rss_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                p.vm_bytes,
            ),
            ("process_open_fds", "Open file descriptors.", p.open_fds),
            (
                "process_max_fds",
                "The most file descriptors the process may open.",
                p.max_fds,
            ),
            (
                "process_start_time_seconds",
                "When the process started, seconds since the Unix epoch.",
                p.start_time_s,
            ),
            ("process_threads", "Threads of the process.", p.threads),
        ] {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

/// What `/proc/self` says of this process.
struct ProcessReading {
    rss_bytes: f64,
    vm_bytes: f64,
    open_fds: f64,
    max_fds: f64,
    start_time_s: f64,
    threads: f64,
    cpu_centis: u64,
}

fn read_process() -> Option<ProcessReading> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = |name: &str| -> Option<f64> {
        let v: f64 = status
            .lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        Some(v * 1024.0)
    };
    let threads: f64 = status
        .lines()
        .find(|l| l.starts_with("Threads:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    // /proc/self/stat: fields after the command's closing parenthesis;
    // utime and stime (14th and 15th) and starttime (22nd) are in clock
    // ticks, 100 per second on Linux.
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| -> Option<u64> { fields.get(i)?.parse().ok() };
    let (utime, stime, start) = (tick(11)?, tick(12)?, tick(19)?);
    let boot: f64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find(|l| l.starts_with("btime "))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let max_fds: f64 = std::fs::read_to_string("/proc/self/limits")
        .ok()?
        .lines()
        .find(|l| l.starts_with("Max open files"))?
        .split_whitespace()
        .nth(3)?
        .parse()
        .unwrap_or(f64::INFINITY);
    Some(ProcessReading {
        rss_bytes: kib("VmRSS:")?,
        vm_bytes: kib("VmSize:")?,
        open_fds: std::fs::read_dir("/proc/self/fd").ok()?.count() as f64,
        max_fds,
        start_time_s: boot + start as f64 / 100.0,
        threads,
        cpu_centis: utime + stime,
    })
}

struct CounterInner {
    desc: Desc,
    family: ClientFamily<Labels, ClientCounter>,
    cache: Mutex<BTreeMap<Vec<String>, ClientCounter>>,
}

/// A monotonically increasing count per label set.
#[derive(Clone)]
pub struct Counter(Arc<CounterInner>);

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Counter").field(&self.0.desc.name).finish()
    }
}

impl Counter {
    fn series(&self, labels: &[&str]) -> Option<ClientCounter> {
        self.0.desc.series(&self.0.cache, &self.0.family, labels)
    }

    pub fn inc(&self, labels: &[&str]) {
        self.add(labels, 1);
    }

    pub fn add(&self, labels: &[&str], n: u64) {
        if let Some(c) = self.series(labels) {
            c.inc_by(n);
        }
    }

    /// Exports the series for `labels` at zero until it is counted: for
    /// label values known when the family is registered.
    pub fn init(&self, labels: &[&str]) {
        let _ = self.series(labels);
    }

    /// Sets the total of a count kept elsewhere (copied in by a scrape
    /// hook). A total below the one already shown is ignored, so the series
    /// never goes down.
    pub fn mirror(&self, labels: &[&str], total: u64) {
        if let Some(c) = self.series(labels) {
            c.inner().fetch_max(total, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The current value for `labels` (0 if never counted).
    pub fn get(&self, labels: &[&str]) -> u64 {
        self.0.desc.cached(&self.0.cache, labels).map_or(0, |c| c.get())
    }
}

struct GaugeInner {
    desc: Desc,
    family: ClientFamily<Labels, ClientGauge<f64, std::sync::atomic::AtomicU64>>,
    cache: Mutex<BTreeMap<Vec<String>, ClientGauge<f64, std::sync::atomic::AtomicU64>>>,
}

/// A value that goes up and down, per label set.
#[derive(Clone)]
pub struct Gauge(Arc<GaugeInner>);

impl std::fmt::Debug for Gauge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Gauge").field(&self.0.desc.name).finish()
    }
}

impl Gauge {
    fn series(&self, labels: &[&str]) -> Option<ClientGauge<f64, std::sync::atomic::AtomicU64>> {
        self.0.desc.series(&self.0.cache, &self.0.family, labels)
    }

    pub fn set(&self, labels: &[&str], v: f64) {
        if let Some(g) = self.series(labels) {
            g.set(v);
        }
    }

    pub fn add(&self, labels: &[&str], v: f64) {
        if let Some(g) = self.series(labels) {
            g.inc_by(v);
        }
    }

    /// Replaces every series at once, so a label set that no longer occurs
    /// (a stage no node is in) disappears instead of keeping its last value.
    pub fn replace_all<'a>(&self, series: impl IntoIterator<Item = (Vec<&'a str>, f64)>) {
        let mut fresh: BTreeMap<Vec<&'a str>, f64> = BTreeMap::new();
        for (labels, v) in series {
            if self.0.desc.fits(&labels) {
                *fresh.entry(labels).or_default() += v;
            }
        }
        // The cache and the family go together, under the cache's lock, so
        // no handle outlives its series.
        let mut cache = lock(&self.0.cache);
        cache.clear();
        self.0.family.clear();
        for (labels, v) in fresh {
            let g = self.0.family.get_or_create_owned(&self.0.desc.labels(&labels));
            g.set(v);
            cache.insert(labels.iter().map(|l| (*l).to_owned()).collect(), g);
        }
    }

    pub fn get(&self, labels: &[&str]) -> f64 {
        self.0.desc.cached(&self.0.cache, labels).map_or(0.0, |g| g.get())
    }
}

struct HistogramInner {
    desc: Desc,
    family: ClientFamily<Labels, ClientHistogram, Buckets>,
    cache: Mutex<BTreeMap<Vec<String>, ClientHistogram>>,
}

/// Observations counted into buckets, per label set.
#[derive(Clone)]
pub struct Histogram(Arc<HistogramInner>);

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Histogram").field(&self.0.desc.name).finish()
    }
}

impl Histogram {
    pub fn observe(&self, labels: &[&str], v: f64) {
        if let Some(h) = self.0.desc.series(&self.0.cache, &self.0.family, labels) {
            h.observe(v);
        }
    }

    pub fn observe_duration(&self, labels: &[&str], d: Duration) {
        self.observe(labels, d.as_secs_f64());
    }
}

/// The longest a scrape connection may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest request head read; a scrape request is a few hundred bytes.
const MAX_REQUEST: usize = 8 * 1024;

/// Serves `registry` on `listener` until the task is dropped: `GET /metrics`
/// answers the exposition, anything else a short error. Each connection gets
/// one response and is closed, which every Prometheus scraper accepts.
pub async fn serve(listener: TcpListener, registry: &'static Registry) {
    loop {
        match listener.accept().await {
            Ok((conn, _)) => {
                tokio::spawn(async move {
                    if let Err(e) = respond(conn, registry).await {
                        tracing::debug!(error = %e, "metrics request failed");
                    }
                });
            }
            Err(e) => {
                // Running out of file descriptors is the usual cause; waiting a
                // little lets connections close instead of spinning on accept.
                tracing::warn!(error = %e, "accepting a metrics connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn respond(mut conn: TcpStream, registry: &Registry) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let read = async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            let n = conn.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(REQUEST_TIMEOUT, read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request head not received"))??;
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let path = target.split('?').next().unwrap_or_default();
    // OpenMetrics when the scraper asks for it (Prometheus does, first),
    // else the text format every scraper reads.
    let openmetrics = String::from_utf8_lossy(&head)
        .lines()
        .filter_map(|l| l.split_once(':'))
        .any(|(k, v)| k.eq_ignore_ascii_case("accept") && v.contains("application/openmetrics-text"));
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") if openmetrics => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            registry.render_openmetrics(),
        ),
        ("GET" | "HEAD", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            registry.render(),
        ),
        ("GET" | "HEAD", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "metrics are served at /metrics\n".to_owned(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET is served\n".to_owned(),
        ),
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    if method != "HEAD" {
        response.push_str(&body);
    }
    conn.write_all(response.as_bytes()).await?;
    conn.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_is_read_and_exported_with_the_build() {
        let p = read_process().expect("/proc/self on Linux");
        assert!(
            p.rss_bytes > 0.0 && p.threads >= 1.0 && p.open_fds >= 1.0,
            "{}",
            p.rss_bytes
        );
        assert!(p.start_time_s > 1.5e9, "{}", p.start_time_s);
        static REGISTRY: OnceLock<Registry> = OnceLock::new();
        let r = REGISTRY.get_or_init(Registry::default);
        process_metrics(r, "test-svc");
        let text = r.render();
        for line in [
            "# TYPE process_cpu_seconds_total counter\n",
            "# TYPE process_resident_memory_bytes gauge\n",
            "# TYPE process_threads gauge\n",
            "provisioning_build_info{service=\"test-svc\",version=\"",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        let open = r.render_openmetrics();
        assert!(open.contains("# TYPE provisioning_build info\n"), "{open}");
        assert!(open.ends_with("# EOF\n"), "{open}");
    }

    #[test]
    fn the_exposition_follows_the_text_format() {
        let r = Registry::default();
        let c = r.counter("jobs_total", "Jobs done.", &["kind"]);
        c.inc(&["a\"b"]);
        c.add(&["a\"b"], 2);
        let g = r.gauge("depth", "Queue depth.", &[]);
        g.set(&[], 4.0);
        let h = r.histogram("latency_seconds", "Latency.", &["op"], &[0.1, 1.0]);
        h.observe(&["x"], 0.05);
        h.observe(&["x"], 0.5);
        h.observe(&["x"], 5.0);
        let text = r.render();
        let expected = "\
# HELP jobs_total Jobs done.
# TYPE jobs_total counter
jobs_total{kind=\"a\\\"b\"} 3
# HELP depth Queue depth.
# TYPE depth gauge
depth 4.0
# HELP latency_seconds Latency.
# TYPE latency_seconds histogram
latency_seconds_bucket{op=\"x\",le=\"0.1\"} 1
latency_seconds_bucket{op=\"x\",le=\"1\"} 2
latency_seconds_bucket{op=\"x\",le=\"+Inf\"} 3
latency_seconds_sum{op=\"x\"} 5.55
latency_seconds_count{op=\"x\"} 3
";
        assert_eq!(text, expected);
        // The same families in OpenMetrics: a counter's family is named
        // without its `_total`, and the exposition ends with `# EOF`.
        let open = r.render_openmetrics();
        assert!(open.contains("# TYPE jobs counter\njobs_total{kind="), "{open}");
        assert!(open.ends_with("# EOF\n"), "{open}");
    }

    #[test]
    fn each_label_set_keeps_its_own_series_in_small_and_large_families() {
        // Families below and above the size searched without a key.
        for sets in [3u64, 200] {
            let r = Registry::default();
            let c = r.counter("c_total", "C.", &["a", "b"]);
            let g = r.gauge("g", "G.", &["a"]);
            let h = r.histogram("h_seconds", "H.", &["a"], &[1.0]);
            for round in 1..=3u64 {
                for i in 0..sets {
                    let (a, b) = (i.to_string(), (i % 2).to_string());
                    c.add(&[&a, &b], i + 1);
                    g.set(&[&a], (i * 10 + round) as f64);
                    g.add(&[&a], 0.5);
                    h.observe(&[&a], i as f64);
                }
            }
            for i in 0..sets {
                let (a, b) = (i.to_string(), (i % 2).to_string());
                assert_eq!(c.get(&[&a, &b]), 3 * (i + 1), "counter {a}");
                assert_eq!(c.get(&[&a, &((i + 1) % 2).to_string()]), 0, "counter {a} other b");
                assert_eq!(g.get(&[&a]), (i * 10 + 3) as f64 + 0.5, "gauge {a}");
                let line = format!("h_seconds_count{{a=\"{a}\"}} 3\n");
                assert!(r.render().contains(&line), "histogram {a}");
            }
            let text = r.render();
            let series = text.lines().filter(|l| l.starts_with("c_total{")).count();
            assert_eq!(series as u64, sets, "{text}");
        }
    }

    #[test]
    fn families_are_exported_from_registration() {
        let r = Registry::default();
        let plain = r.counter("plain_total", "P.", &[]);
        let known = r.counter("known_total", "K.", &["reason"]);
        for reason in ["a", "b"] {
            known.init(&[reason]);
        }
        r.gauge("level", "L.", &[]);
        r.histogram("took_seconds", "T.", &[], &[1.0]);
        r.counter("learnt_total", "L.", &["x"]);
        let text = r.render();
        for line in [
            "plain_total 0\n",
            "known_total{reason=\"a\"} 0\n",
            "known_total{reason=\"b\"} 0\n",
            "level 0.0\n",
            "took_seconds_bucket{le=\"+Inf\"} 0\n",
            "took_seconds_count 0\n",
        ] {
            assert!(text.contains(line), "{line:?} missing from:\n{text}");
        }
        assert!(!text.contains("learnt_total{"), "{text}");
        // Declaring a series keeps what it has counted.
        known.add(&["a"], 2);
        known.init(&["a"]);
        plain.inc(&[]);
        assert_eq!((known.get(&["a"]), plain.get(&[])), (2, 1));
    }

    #[test]
    fn registration_is_get_or_create() {
        let r = Registry::default();
        r.counter("c_total", "C.", &["x"]).inc(&["1"]);
        r.counter("c_total", "C.", &["x"]).inc(&["1"]);
        assert_eq!(r.counter("c_total", "C.", &["x"]).get(&["1"]), 2);
    }

    #[test]
    fn replace_all_drops_vanished_series_and_hooks_run_before_render() {
        let r = Registry::default();
        let g = r.gauge("nodes", "Nodes.", &["stage"]);
        g.set(&["new"], 3.0);
        let hooked = g.clone();
        r.on_scrape(move || {
            hooked.replace_all([(vec!["ready"], 2.0), (vec!["ready"], 1.0)]);
            true
        });
        let text = r.render();
        assert!(text.contains("nodes{stage=\"ready\"} 3.0\n"), "{text}");
        assert!(!text.contains("stage=\"new\""), "{text}");
    }

    #[tokio::test]
    async fn the_endpoint_answers_get_metrics() {
        static REGISTRY: OnceLock<Registry> = OnceLock::new();
        let registry = REGISTRY.get_or_init(Registry::default);
        registry.counter("served_total", "Served.", &[]).inc(&[]);
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let server = tokio::spawn(serve(listener, registry));
        let get = |path: &'static str, extra: &'static str| async move {
            let mut conn = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("{e}"));
            conn.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\n{extra}\r\n").as_bytes())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let mut out = String::new();
            conn.read_to_string(&mut out)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            out
        };
        let ok = get("/metrics", "").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("text/plain; version=0.0.4"), "{ok}");
        assert!(ok.ends_with("served_total 1\n"), "{ok}");
        // What Prometheus sends: OpenMetrics first.
        let open = get(
            "/metrics",
            "accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n",
        )
        .await;
        assert!(
            open.contains("application/openmetrics-text; version=1.0.0"),
            "{open}"
        );
        assert!(open.ends_with("served_total 1\n# EOF\n"), "{open}");
        let missing = get("/nope", "").await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        server.abort();
    }
}
