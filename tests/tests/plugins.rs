//! Provider plugins through the three services (SPEC.md section 10): the
//! executor hosts the process backend as a supervised plugin
//! (`builtin-provider`, over the provider protocol on a Unix socket), the
//! driver refuses shapes naming a provider nobody serves, and a plugin killed
//! in the middle of a convergence is started again, finds its agents through
//! its list, and neither orphans nor doubles one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeMap, path::Path, time::Duration};

use contract::pb;
use provisioning_tests::{
    procs::{
        AgentsDir, Cluster, ClusterOptions, bin_path, eventually, live_agent_pids, proc_table, watch_until,
    },
    shapes::shape,
};
use tonic::Code;

const CONVERGE: Duration = Duration::from_secs(90);
const RUN: &str = "plugged";

/// An executor serving only the process backend, as a plugin it starts.
fn plugin_cluster(dir: &Path, agents: &Path) -> ClusterOptions {
    let plugin = format!(
        "{} --backend process --process-state-dir {} --listen unix:{} --health-interval-ms 200",
        bin_path("builtin-provider").unwrap().display(),
        agents.display(),
        dir.join("provider.sock").display(),
    );
    ClusterOptions::default()
        .executor("--backend", "none")
        .executor("--plugin-command", &plugin)
        .executor("--plugin-health-interval-ms", "100")
}

/// Live agents under `root` per slot.
fn agents_per_slot(root: &Path) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for (_, node, _) in live_agent_pids(root) {
        *out.entry(node).or_default() += 1;
    }
    out
}

/// The executor's supervised plugin process.
fn plugin_pid(executor: u32) -> Option<u32> {
    proc_table()
        .into_iter()
        .find(|p| p.ppid == executor && p.comm.starts_with("builtin-provid") && p.state != 'Z')
        .map(|p| p.pid)
}

/// Deletes the run and waits until no agent under `root` lives.
async fn delete_and_see_every_agent_gone(
    c: &mut contract::pb::provisioning_client::ProvisioningClient<tonic::transport::Channel>,
    root: &Path,
) {
    c.delete_run(pb::DeleteRunRequest {
        run_id: RUN.to_owned(),
    })
    .await
    .unwrap();
    eventually(Duration::from_secs(60), "every agent gone", || async {
        live_agent_pids(root).is_empty().then_some(())
    })
    .await
    .unwrap();
}

/// The provider list once the driver knows it (its link to the executor is up).
async fn known_providers(cluster: &Cluster) -> pb::ListProvidersResponse {
    eventually(Duration::from_secs(20), "the provider list", || async {
        let p = providers(cluster).await;
        p.known.then_some(p)
    })
    .await
    .unwrap()
}

async fn run_status(cluster: &Cluster) -> pb::RunStatus {
    let mut c = cluster.client().await.unwrap();
    c.get_run(pb::GetRunRequest {
        run_id: RUN.to_owned(),
        include_nodes: false,
    })
    .await
    .unwrap()
    .into_inner()
}

async fn providers(cluster: &Cluster) -> pb::ListProvidersResponse {
    let mut c = cluster.client().await.unwrap();
    c.list_providers(pb::ListProvidersRequest {})
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervised_plugin_serves_its_provider_and_other_names_are_refused() {
    let keep = AgentsDir::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(plugin_cluster(dir.path(), &keep.root))
        .await
        .unwrap();

    // The driver knows what the executor serves once the link is up.
    let listed = known_providers(&cluster).await;
    let names: Vec<&str> = listed.providers.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["process"], "{listed:?}");
    let p = &listed.providers[0];
    assert_eq!(p.kind, "plugin");
    assert!(p.available && p.reports_health && p.reports_loss, "{p:?}");
    // `provisionctl providers` shows it.
    let out = std::process::Command::new(bin_path("provisionctl").unwrap())
        .args(["--server", &cluster.driver.url(), "providers"])
        .envs(cluster.provisionctl_env())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = text
        .lines()
        .find(|l| l.starts_with("process"))
        .unwrap_or_else(|| panic!("{text}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cells[..5],
        ["process", "plugin", "yes", "reported", "reported"],
        "{text}"
    );

    // A shape naming a provider nobody serves is refused, naming the field
    // and what is served, and creates nothing.
    let err = cluster
        .apply(&shape(RUN, 1, "fake", &[("workers", 2, "img:1")]))
        .await
        .unwrap_err();
    let status = err.downcast_ref::<tonic::Status>().expect("a gRPC status");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("groups[0].template.provider.name") && status.message().contains("process"),
        "{}",
        status.message()
    );
    let mut c = cluster.client().await.unwrap();
    let runs = c
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .runs;
    assert!(runs.is_empty(), "a refused apply made a run: {runs:?}");
    // Plan refuses it the same way.
    let plan = c
        .plan(pb::PlanRequest {
            shape: Some((&shape(RUN, 1, "nobody", &[("workers", 2, "img:1")])).into()),
        })
        .await
        .unwrap_err();
    assert_eq!(plan.code(), Code::InvalidArgument, "{plan:?}");

    // The served one converges through the plugin, on real agents.
    cluster
        .apply(&shape(RUN, 1, "process", &[("workers", 3, "img:1")]))
        .await
        .unwrap();
    let status = watch_until(&mut c, RUN, CONVERGE, |s| s.converged).await;
    if status.is_err() {
        cluster.dump_logs();
    }
    status.unwrap();
    assert_eq!(
        agents_per_slot(&keep.root),
        BTreeMap::from([
            ("workers-0".to_owned(), 1),
            ("workers-1".to_owned(), 1),
            ("workers-2".to_owned(), 1)
        ])
    );

    // Delete: every agent goes, through the plugin's destroys.
    delete_and_see_every_agent_gone(&mut c, &keep.root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_killed_mid_convergence_is_restarted_and_nothing_is_orphaned_or_doubled() {
    let keep = AgentsDir::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(plugin_cluster(dir.path(), &keep.root))
        .await
        .unwrap();
    let executor = cluster.executor.pid().unwrap();
    known_providers(&cluster).await;

    // Slow stages, so the kill lands while bootstraps are running.
    let mut s = shape(RUN, 1, "process", &[("workers", 6, "img:1")]);
    for g in &mut s.groups {
        std::sync::Arc::make_mut(&mut g.template).boot.insert(
            "stage_delay_ms".to_owned(),
            contract::shape::Param {
                value: "150".into(),
                secret: false,
            },
        );
    }
    cluster.apply(&s).await.unwrap();
    let first = eventually(Duration::from_secs(30), "a few agents up", || async {
        (live_agent_pids(&keep.root).len() >= 2)
            .then(|| plugin_pid(executor))
            .flatten()
    })
    .await
    .unwrap();
    let mut c = cluster.client().await.unwrap();
    let before = run_status(&cluster).await;
    assert!(
        !before.converged,
        "the kill must land mid-convergence: {before:?}"
    );
    let _ = std::process::Command::new("kill")
        .arg("-KILL")
        .arg(first.to_string())
        .status();

    // The executor starts it again; the run converges.
    let second = eventually(Duration::from_secs(30), "the plugin started again", || async {
        plugin_pid(executor).filter(|p| *p != first)
    })
    .await
    .unwrap();
    assert_ne!(first, second);
    let status = watch_until(&mut c, RUN, CONVERGE, |s| s.converged).await;
    if status.is_err() {
        cluster.dump_logs();
    }
    status.unwrap();
    // One agent per slot: nothing created twice, nothing left behind.
    let per_slot = agents_per_slot(&keep.root);
    assert_eq!(per_slot.len(), 6, "{per_slot:?}");
    assert!(per_slot.values().all(|n| *n == 1), "{per_slot:?}");
    let orphans = c
        .list_orphans(pb::ListOrphansRequest {})
        .await
        .unwrap()
        .into_inner()
        .orphans;
    assert!(orphans.is_empty(), "{orphans:?}");
    // The provider is listed available again.
    let listed = providers(&cluster).await;
    assert!(listed.providers.iter().all(|p| p.available), "{listed:?}");
    // Deleted, it leaves nothing: every agent, the adopted ones too, is
    // destroyed through the restarted plugin.
    delete_and_see_every_agent_gone(&mut c, &keep.root).await;
}

/// Starts `builtin-provider` (the fake) on `sock` as the test's own child,
/// and waits for its announcement.
async fn start_fake_plugin(sock: &Path, state: &Path) -> tokio::process::Child {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = tokio::process::Command::new(bin_path("builtin-provider").unwrap())
        .args(["--backend", "fake", "--fake-stage-interval-ms", "5"])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .arg("--fake-state-file")
        .arg(state)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(line.starts_with("provider-listening unix:"), "{line}");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    child
}

/// A plugin reached at an address that goes away: the driver lists it
/// unavailable and the runs that use it say so in their Degraded condition;
/// once it is back (the same state), the run goes on and converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_at_an_address_that_goes_away_shows_in_the_conditions_and_is_used_again() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("fake.sock");
    let state = dir.path().join("fake-state.json");
    let mut plugin = start_fake_plugin(&sock, &state).await;
    let cluster = Cluster::start(
        ClusterOptions::default()
            .executor("--backend", "none")
            .executor("--plugin", &format!("unix:{}", sock.display()))
            .executor("--plugin-health-interval-ms", "100"),
    )
    .await
    .unwrap();
    let mut c = cluster.client().await.unwrap();
    known_providers(&cluster).await;
    cluster
        .apply(&shape(RUN, 1, "fake", &[("workers", 2, "img:1")]))
        .await
        .unwrap();
    watch_until(&mut c, RUN, CONVERGE, |s| s.converged).await.unwrap();

    // The plugin goes away.
    plugin.kill().await.unwrap();
    let listed = eventually(
        Duration::from_secs(20),
        "the provider listed unavailable",
        || async {
            let p = providers(&cluster).await;
            p.providers
                .iter()
                .any(|p| p.name == "fake" && !p.available)
                .then_some(p)
        },
    )
    .await
    .unwrap();
    assert_eq!(listed.providers.len(), 1, "{listed:?}");
    let degraded = eventually(
        Duration::from_secs(20),
        "the run's Degraded condition",
        || async {
            run_status(&cluster)
                .await
                .conditions
                .into_iter()
                .find(|c| c.r#type == "Degraded" && c.status && c.reason == "ProviderUnavailable")
        },
    )
    .await
    .unwrap();
    assert!(degraded.message.contains("fake"), "{degraded:?}");
    // An apply naming it is still accepted: it is served, only down.
    cluster
        .apply(&shape(RUN, 2, "fake", &[("workers", 3, "img:1")]))
        .await
        .unwrap();

    // Back, over the same state: the run converges at the new generation.
    let _plugin = start_fake_plugin(&sock, &state).await;
    let status = watch_until(&mut c, RUN, CONVERGE, |s| s.converged && s.generation == 2).await;
    if status.is_err() {
        cluster.dump_logs();
    }
    status.unwrap();
    let listed = providers(&cluster).await;
    assert!(listed.providers.iter().all(|p| p.available), "{listed:?}");
    let events = provisioning_tests::procs::run_events(&mut c, RUN).await.unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.message.contains("provider fake is unavailable")),
        "{events:?}"
    );
}
