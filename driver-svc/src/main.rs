//! `driver-svc`: the sole writer of run state, serving the public API.

use std::{sync::Arc, time::Duration};

use anyhow::Context;
use clap::Parser;
use contract::{BackoffPolicy, ShapeLimits};
use driver_svc::{
    admission::DEFAULT_MAX_OPERATIONS_IN_FLIGHT,
    core::{MemStore, Policy},
    server::{Config, run},
};
use platform::runtime;

/// jemalloc rather than glibc's malloc: see docs/profile-notes.md, "The
/// allocator".
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Debug, Parser)]
#[command(
    name = "driver-svc",
    version,
    about = "The provisioning driver: sole writer of run state"
)]
struct Cli {
    #[command(flatten)]
    common: runtime::CommonArgs,
    /// The decider's address: `host:port`, or a URL whose scheme matches the
    /// transport (https://127.0.0.1:7001 with TLS, http:// with --insecure).
    /// Several deciders, comma-separated, or a name that resolves to several
    /// addresses (a headless Service over several deciders), spread the calls
    /// over all of them.
    #[arg(long, env = "DRIVER_DECIDER")]
    decider: String,
    /// How often the decider's name is resolved again, to follow replicas
    /// that come and go; 0 resolves it once, at start.
    #[arg(long, env = "DRIVER_DECIDER_RESOLVE_INTERVAL_MS", default_value_t = 30_000)]
    decider_resolve_interval_ms: u64,
    /// The executor's address, as --decider.
    #[arg(long, env = "DRIVER_EXECUTOR")]
    executor: String,
    /// With TLS, who the decider must be: the identity its certificate
    /// carries (a name for `spiffe://provisioning/<name>`, or a whole URI).
    #[arg(long, env = "DRIVER_DECIDER_IDENTITY", default_value = "decider-svc")]
    decider_identity: String,
    /// With TLS, who the executor must be, as --decider-identity.
    #[arg(long, env = "DRIVER_EXECUTOR_IDENTITY", default_value = "executor-svc")]
    executor_identity: String,
    #[arg(long, env = "DRIVER_BACKOFF_BASE_MS", default_value_t = 1000)]
    backoff_base_ms: u64,
    #[arg(long, env = "DRIVER_BACKOFF_CAP_MS", default_value_t = 60_000)]
    backoff_cap_ms: u64,
    #[arg(long, env = "DRIVER_BACKOFF_JITTER", default_value_t = 0.2)]
    backoff_jitter: f64,
    /// Re-probe interval after "endpoint not ready".
    #[arg(long, env = "DRIVER_PROBE_INTERVAL_MS", default_value_t = 500)]
    probe_interval_ms: u64,
    #[arg(long, env = "DRIVER_ENDPOINT_TIMEOUT_MS", default_value_t = 120_000)]
    endpoint_timeout_ms: u64,
    #[arg(long, env = "DRIVER_BOOTSTRAP_TIMEOUT_MS", default_value_t = 600_000)]
    bootstrap_timeout_ms: u64,
    #[arg(long, env = "DRIVER_OPERATION_TIMEOUT_MS", default_value_t = 60_000)]
    operation_timeout_ms: u64,
    /// How long after an operation's deadline the driver folds it as ambiguous.
    #[arg(long, env = "DRIVER_RESULT_GRACE_MS", default_value_t = 5_000)]
    result_grace_ms: u64,
    /// While operations are in flight, how long a fold may wait for more
    /// results before it triggers a pass (0 decides at once).
    #[arg(long, env = "DRIVER_PASS_BATCH_MS", default_value_t = 50)]
    pass_batch_ms: u64,
    /// Every run gets a full pass at least this often (a safety net).
    #[arg(long, env = "DRIVER_SAFETY_TICK_MS", default_value_t = 30_000)]
    safety_tick_ms: u64,
    /// The most operations all runs together may have pending at once (0:
    /// no limit). What a pass decides past it waits in its run, recorded
    /// nowhere, and is decided again when operations finish: work the
    /// executor cannot start before the operations' deadlines is not sent.
    #[arg(long, env = "DRIVER_MAX_OPERATIONS_IN_FLIGHT", default_value_t = DEFAULT_MAX_OPERATIONS_IN_FLIGHT)]
    max_operations_in_flight: usize,
    #[arg(long, env = "DRIVER_MAX_GROUPS", default_value_t = 256)]
    max_groups: usize,
    #[arg(long, env = "DRIVER_MAX_NODES_PER_GROUP", default_value_t = 100_000)]
    max_nodes_per_group: u32,
    #[arg(long, env = "DRIVER_MAX_NODES_TOTAL", default_value_t = 200_000)]
    max_nodes_total: u64,
    /// How many events each run keeps in its durable event log (the oldest
    /// go first).
    #[arg(long, env = "DRIVER_EVENTS_PER_RUN", default_value_t = contract::events::DEFAULT_EVENT_LIMIT,
        value_parser = parse_event_limit)]
    events_per_run: usize,
    /// How often the inventory resync compares the executor's inventory
    /// with the runs (the first look follows the executor link coming up):
    /// resources no run wants are orphans, and leases a run holds that the
    /// inventory lacks at two consecutive looks are lost (a look that
    /// finds one missing is followed within a second); 0 = off.
    #[arg(long, env = "DRIVER_ORPHAN_SWEEP_MS", default_value_t = 60_000)]
    orphan_sweep_ms: u64,
    /// What the sweep does with an orphan it confirmed: `destroy` it through
    /// the normal deletion path (and report it until it is gone), or only
    /// `report` it.
    #[arg(long, env = "DRIVER_ORPHAN_POLICY", value_enum, default_value_t = OrphanPolicy::Destroy)]
    orphan_policy: OrphanPolicy,
    /// Where run state is kept: `redb` (durable, in --data-dir), `memory`
    /// (lost when the process ends), or, in builds with the `etcd` feature,
    /// `etcd` (with --etcd-endpoints) or `etcd://host:port,host:port,...`.
    #[arg(long, env = "DRIVER_STORE", value_parser = parse_store, default_value = "redb")]
    store: StoreChoice,
    /// The durable store's directory.
    #[arg(long, env = "DRIVER_DATA_DIR", default_value = "driver-data")]
    data_dir: std::path::PathBuf,
    /// A key file (32 bytes, raw or 64 hex digits, mode 600) to seal secret
    /// parameter values in the store with. Without it they are stored
    /// unsealed in an owner-only file, and a warning says so.
    #[arg(long, env = "DRIVER_SECRETS_KEY_FILE")]
    secrets_key_file: Option<std::path::PathBuf>,
    /// For crash tests: abort the process at a named point of its work, on
    /// the point's n-th hit (`<point>[:<n>]`; points are listed in
    /// docs/driver.md, "Crash points"). Off unless given.
    #[arg(long, env = "DRIVER_CRASH_AT", value_parser = driver_svc::crash::parse)]
    crash_at: Option<driver_svc::crash::Armed>,
    #[command(flatten)]
    auth: driver_svc::auth::AuthArgs,
    #[command(flatten)]
    limits: driver_svc::limits::LimitArgs,
    #[cfg(feature = "etcd")]
    #[command(flatten)]
    etcd: driver_svc::etcd::EtcdArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum OrphanPolicy {
    Destroy,
    Report,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum StoreKind {
    Redb,
    Memory,
    /// In etcd (built with the `etcd` feature): --etcd-endpoints.
    #[cfg(feature = "etcd")]
    Etcd,
}

/// `--store`: the kind, and the etcd members an `etcd://` value names.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StoreChoice {
    kind: StoreKind,
    endpoints: Vec<String>,
}

fn parse_event_limit(value: &str) -> Result<usize, String> {
    let n: usize = value.parse().map_err(|_| format!("{value:?} is not a count"))?;
    let max = contract::events::MAX_EVENT_LIMIT;
    if (1..=max).contains(&n) {
        Ok(n)
    } else {
        Err(format!("{n} is outside 1..={max}"))
    }
}

fn parse_store(value: &str) -> Result<StoreChoice, String> {
    if let Some(members) = value.strip_prefix("etcd://") {
        #[cfg(feature = "etcd")]
        {
            let endpoints: Vec<String> = members
                .split(',')
                .map(str::trim)
                .filter(|m| !m.is_empty())
                .map(str::to_owned)
                .collect();
            if endpoints.is_empty() {
                return Err("etcd:// names no member: give etcd://host:port[,host:port...]".to_owned());
            }
            return Ok(StoreChoice {
                kind: StoreKind::Etcd,
                endpoints,
            });
        }
        #[cfg(not(feature = "etcd"))]
        {
            let _ = members;
            return Err("this driver was built without the etcd store (cargo feature `etcd`)".to_owned());
        }
    }
    let kind = <StoreKind as clap::ValueEnum>::from_str(value, true).map_err(|_| {
        let mut known = vec!["redb", "memory"];
        if cfg!(feature = "etcd") {
            known.extend(["etcd", "etcd://host:port,..."]);
        }
        format!("{value:?} is not a store: use {}", known.join(", "))
    })?;
    Ok(StoreChoice {
        kind,
        endpoints: Vec::new(),
    })
}

impl Cli {
    fn policy(&self) -> anyhow::Result<Policy> {
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.backoff_jitter),
            "--backoff-jitter must be within [0, 1]"
        );
        let ms = Duration::from_millis;
        Ok(Policy {
            backoff: BackoffPolicy {
                base: ms(self.backoff_base_ms),
                cap: ms(self.backoff_cap_ms),
                jitter: self.backoff_jitter,
            },
            probe_interval: ms(self.probe_interval_ms),
            endpoint_timeout: ms(self.endpoint_timeout_ms),
            bootstrap_timeout: ms(self.bootstrap_timeout_ms),
            operation_timeout: ms(self.operation_timeout_ms),
            result_grace: ms(self.result_grace_ms),
            pass_batch: ms(self.pass_batch_ms),
            limits: ShapeLimits {
                max_groups: self.max_groups,
                max_nodes_per_group: self.max_nodes_per_group,
                max_nodes_total: self.max_nodes_total,
                ..ShapeLimits::default()
            },
            event_limit: self.events_per_run,
        })
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    platform::runtime::exit_code(serve_until_stopped().await)
}

async fn serve_until_stopped() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let telemetry = runtime::init_telemetry("driver-svc", &cli.common)?;
    let transport = cli.common.transport("driver-svc")?;
    let policy = cli.policy()?;
    // Before anything is opened or bound: no authentication, no API.
    let auth = cli.auth.authenticator()?;
    if let Some(armed) = cli.crash_at {
        driver_svc::crash::arm(armed);
        tracing::warn!(
            point = armed.point.name(),
            hit = armed.nth,
            "crash point armed: this driver will abort there"
        );
    }
    // The store is opened before anything listens: a store that cannot be
    // opened (or is damaged) stops the driver here, loudly.
    let sealer = |at_rest: &str| -> anyhow::Result<platform::secrets::Sealer> {
        Ok(match &cli.secrets_key_file {
            Some(path) => platform::secrets::Sealer::new(Some(
                platform::secrets::SecretKey::load(path).context("loading the secrets key")?,
            )),
            None => {
                tracing::warn!(
                    "no --secrets-key-file: secret parameter values are stored unsealed ({at_rest})"
                );
                platform::secrets::Sealer::default()
            }
        })
    };
    #[allow(unused_mut)]
    let mut replicas: Option<Arc<dyn driver_svc::replicas::Replicas>> = None;
    #[allow(unused_mut)]
    let mut advertise: Option<String> = None;
    let store: Box<dyn driver_svc::core::RunStore> = match cli.store.kind {
        StoreKind::Redb => {
            let sealer = sealer("owner-only file")?;
            let store = driver_svc::durable::RedbStore::open_sealed(&cli.data_dir, sealer)
                .with_context(|| format!("opening the store in {}", cli.data_dir.display()))?;
            // Read once now: a store whose secrets this key cannot open is
            // refused here, before anything listens.
            Box::new(store)
        }
        StoreKind::Memory => {
            tracing::warn!("--store memory: run state is lost when this process ends");
            Box::new(MemStore::new())
        }
        #[cfg(feature = "etcd")]
        StoreKind::Etcd => {
            let mut etcd = cli.etcd.clone();
            if !cli.store.endpoints.is_empty() {
                anyhow::ensure!(
                    etcd.etcd_endpoints.is_empty(),
                    "--store etcd://... names the etcd members already: drop --etcd-endpoints"
                );
                etcd.etcd_endpoints = cli.store.endpoints.clone();
            }
            let config = etcd.config()?;
            let store = driver_svc::etcd::EtcdStore::open(
                config,
                sealer("readable by whoever can read the etcd prefix")?,
            )
            .with_context(|| format!("opening the etcd store at {}", etcd.etcd_endpoints.join(",")))?;
            replicas = Some(store.replicas());
            advertise = cli.etcd.advertise_address.clone();
            Box::new(store)
        }
    };
    // Every family at zero before anyone is told the driver is ready.
    driver_svc::server::declare_metrics();
    let listener =
        runtime::bind_and_announce("driver-svc", cli.common.listen, cli.common.ready_file.as_deref())
            .await
            .with_context(|| format!("binding {}", cli.common.listen))?;
    let result = run(
        listener,
        runtime::shutdown_signal(),
        Config {
            decider: cli.decider,
            decider_resolve_interval: Duration::from_millis(cli.decider_resolve_interval_ms),
            executor: cli.executor,
            decider_identity: cli.decider_identity,
            executor_identity: cli.executor_identity,
            policy,
            safety_tick: Duration::from_millis(cli.safety_tick_ms),
            max_operations_in_flight: Some(cli.max_operations_in_flight).filter(|n| *n > 0),
            store,
            clock: Arc::new(contract::SystemClock),
            orphan_sweep: Duration::from_millis(cli.orphan_sweep_ms),
            orphan_destroy: cli.orphan_policy == OrphanPolicy::Destroy,
            transport,
            auth,
            limits: cli.limits.limits(cli.common.messages),
            replicas,
            advertise,
        },
    )
    .await;
    // Spans of the last passes are exported before the process ends.
    telemetry.shutdown().await;
    Ok(result?)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn store_values() {
        assert_eq!(parse_store("redb").unwrap().kind, StoreKind::Redb);
        assert_eq!(parse_store("Memory").unwrap().kind, StoreKind::Memory);
        assert!(parse_store("sqlite").unwrap_err().contains("is not a store"));
        #[cfg(feature = "etcd")]
        {
            let c = parse_store("etcd://a:2379, b:2379,").unwrap();
            assert_eq!(c.kind, StoreKind::Etcd);
            assert_eq!(c.endpoints, vec!["a:2379", "b:2379"]);
            assert!(parse_store("etcd://").unwrap_err().contains("names no member"));
            assert_eq!(parse_store("etcd").unwrap().endpoints, Vec::<String>::new());
        }
        #[cfg(not(feature = "etcd"))]
        assert!(
            parse_store("etcd://a:2379")
                .unwrap_err()
                .contains("without the etcd store")
        );
    }
}
