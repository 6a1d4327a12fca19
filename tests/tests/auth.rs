//! Client authentication on the public API, against the real binaries: no
//! token and a wrong token are `UNAUTHENTICATED`, a read-only token trying
//! to write and a run-scoped token touching another run are
//! `PERMISSION_DENIED`, and none of them changes anything (every run's full
//! status, nodes included, is the same before and after); a write token
//! succeeds; health stays open; a listed client certificate authenticates
//! without a token; `provisionctl` sends its token; SIGHUP reloads the
//! tokens file; and the driver will not start without either a tokens file
//! or `--allow-unauthenticated`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeMap, path::Path, process::Stdio, time::Duration};

use contract::pb;
use provisioning_tests::{
    auth::{AuthedClient, Grant, Tokens, client},
    procs::{Cluster, ClusterOptions, Service, bin_path},
    shapes::shape,
};
use tonic::Code;

const RUNS: [&str; 2] = ["alpha", "beta"];

fn apply_req(run: &str, generation: u64, count: u32) -> pb::ApplyRequest {
    pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            run,
            generation,
            "fake",
            &[("workers", count, "img:1")],
        ))),
    }
}

fn get_req(run: &str) -> pb::GetRunRequest {
    pb::GetRunRequest {
        run_id: run.to_owned(),
        include_nodes: true,
    }
}

async fn converged(c: &mut AuthedClient, run: &str, generation: u64) -> pb::RunStatus {
    for _ in 0..600 {
        let s = c.get_run(get_req(run)).await.unwrap().into_inner();
        if s.converged && s.generation == generation {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{run} did not converge at generation {generation} in 30 s");
}

/// Every run's full status, read with a token that sees them all (without
/// `updated_at_ms`, the time of the read).
async fn state(c: &mut AuthedClient, runs: &[&str]) -> BTreeMap<String, pb::RunStatus> {
    let mut out = BTreeMap::new();
    for run in runs {
        let mut s = c.get_run(get_req(run)).await.unwrap().into_inner();
        s.updated_at_ms = 0;
        out.insert((*run).to_owned(), s);
    }
    out
}

/// The state once it stops moving (the last acknowledgements after
/// convergence are folded within moments; nothing else runs: no safety tick).
async fn settled(c: &mut AuthedClient, runs: &[&str]) -> BTreeMap<String, pb::RunStatus> {
    let mut last = state(c, runs).await;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = state(c, runs).await;
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("the runs' status kept changing: {last:?}");
}

/// Asserts the refusal's code and that its message says `says`.
#[track_caller]
fn refused<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, says: &[&str]) {
    let status = r.expect_err("the call should have been refused");
    assert_eq!(status.code(), code, "{status:?}");
    for s in says {
        assert!(
            status.message().contains(s),
            "{:?} does not say {s:?}",
            status.message()
        );
    }
}

/// Every write the API has, on `run`, by a caller that must be refused.
async fn every_write_refused(c: &mut AuthedClient, run: &str, code: Code, says: &[&str]) {
    refused(c.apply(apply_req(run, 2, 5)).await, code, says);
    refused(
        c.delete_run(pb::DeleteRunRequest {
            run_id: run.to_owned(),
        })
        .await,
        code,
        says,
    );
    refused(
        c.pause_run(pb::PauseRunRequest {
            run_id: run.to_owned(),
        })
        .await,
        code,
        says,
    );
    refused(
        c.resume_run(pb::ResumeRunRequest {
            run_id: run.to_owned(),
        })
        .await,
        code,
        says,
    );
    refused(
        c.abandon_node(pb::AbandonNodeRequest {
            run_id: run.to_owned(),
            node_id: "workers-0".to_owned(),
        })
        .await,
        code,
        says,
    );
}

async fn start(dir: tempfile::TempDir, tokens: &Tokens) -> Cluster {
    let opts = ClusterOptions::default()
        .tokens_file(&tokens.path)
        // Nothing but the calls below changes the runs once they converge.
        .driver("--safety-tick-ms", "600000")
        .driver("--orphan-sweep-ms", "0");
    Cluster::start_in(dir, opts).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_calls_change_nothing_and_granted_ones_work() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = Tokens::write(
        dir.path(),
        &[
            Grant::write("admin"),
            Grant::read("viewer"),
            Grant::write("alpha-ops").only(&["alpha"]),
            Grant::read("alpha-viewer").only(&["alpha"]),
        ],
    )
    .unwrap();
    let cluster = start(dir, &tokens).await;
    let mut admin = client(&cluster, Some(tokens.token("admin").unwrap()))
        .await
        .unwrap();
    for run in RUNS {
        admin.apply(apply_req(run, 1, 2)).await.unwrap();
    }
    for run in RUNS {
        converged(&mut admin, run, 1).await;
    }
    let before = settled(&mut admin, &RUNS).await;

    // No token: nothing is served, reads included.
    let mut anonymous = client(&cluster, None).await.unwrap();
    refused(
        anonymous.get_run(get_req("alpha")).await,
        Code::Unauthenticated,
        &["no credentials", "bearer token"],
    );
    refused(
        anonymous.list_runs(pb::ListRunsRequest::default()).await,
        Code::Unauthenticated,
        &["no credentials"],
    );
    every_write_refused(
        &mut anonymous,
        "alpha",
        Code::Unauthenticated,
        &["no credentials"],
    )
    .await;

    // A token the server does not know (well formed, never issued).
    let stranger = driver_svc::auth::new_token().unwrap();
    let mut wrong = client(&cluster, Some(&stranger)).await.unwrap();
    refused(
        wrong.get_run(get_req("beta")).await,
        Code::Unauthenticated,
        &["not one this server accepts"],
    );
    every_write_refused(
        &mut wrong,
        "beta",
        Code::Unauthenticated,
        &["not one this server accepts"],
    )
    .await;
    let e = wrong.get_run(get_req("beta")).await.unwrap_err();
    assert!(!e.message().contains(&stranger), "the refusal echoes the token");

    // A read-only token reads everything and writes nothing.
    let mut viewer = client(&cluster, Some(tokens.token("viewer").unwrap()))
        .await
        .unwrap();
    let listed = viewer
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.runs.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(),
        RUNS
    );
    viewer.get_run(get_req("beta")).await.unwrap();
    viewer
        .plan(pb::PlanRequest {
            shape: apply_req("alpha", 2, 5).shape,
        })
        .await
        .unwrap();
    viewer
        .explain_node(pb::ExplainNodeRequest {
            run_id: "alpha".into(),
            node_id: "workers-0".into(),
        })
        .await
        .unwrap();
    let mut watch = viewer
        .watch_run(pb::WatchRunRequest {
            run_id: "alpha".into(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(watch.message().await.unwrap().unwrap().converged);
    drop(watch);
    for run in RUNS {
        every_write_refused(
            &mut viewer,
            run,
            Code::PermissionDenied,
            &["token \"viewer\" has read access", "needs write access"],
        )
        .await;
    }

    // A token limited to alpha touches nothing of beta, reads included,
    // and lists only alpha.
    let mut alpha_ops = client(&cluster, Some(tokens.token("alpha-ops").unwrap()))
        .await
        .unwrap();
    let scoped = ["limited to runs [alpha]", "run \"beta\" is not one of them"];
    every_write_refused(&mut alpha_ops, "beta", Code::PermissionDenied, &scoped).await;
    refused(
        alpha_ops.get_run(get_req("beta")).await,
        Code::PermissionDenied,
        &scoped,
    );
    refused(
        alpha_ops
            .watch_run(pb::WatchRunRequest {
                run_id: "beta".into(),
                include_nodes: false,
            })
            .await,
        Code::PermissionDenied,
        &scoped,
    );
    refused(
        alpha_ops
            .explain_node(pb::ExplainNodeRequest {
                run_id: "beta".into(),
                node_id: "workers-0".into(),
            })
            .await,
        Code::PermissionDenied,
        &scoped,
    );
    refused(
        alpha_ops
            .plan(pb::PlanRequest {
                shape: apply_req("beta", 2, 5).shape,
            })
            .await,
        Code::PermissionDenied,
        &scoped,
    );
    let listed = alpha_ops
        .list_runs(pb::ListRunsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.runs.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(),
        ["alpha"]
    );
    let orphans = alpha_ops
        .list_orphans(pb::ListOrphansRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        orphans
            .orphans
            .iter()
            .all(|o| o.resource.as_ref().is_some_and(|r| r.run_id == "alpha"))
    );

    // A read token limited to alpha: reads alpha, not beta, writes neither.
    let mut alpha_viewer = client(&cluster, Some(tokens.token("alpha-viewer").unwrap()))
        .await
        .unwrap();
    alpha_viewer.get_run(get_req("alpha")).await.unwrap();
    refused(
        alpha_viewer.get_run(get_req("beta")).await,
        Code::PermissionDenied,
        &scoped,
    );
    every_write_refused(
        &mut alpha_viewer,
        "alpha",
        Code::PermissionDenied,
        &["needs write access"],
    )
    .await;

    // Health and reflection stay open without a token.
    let mut health = tonic_health::pb::health_client::HealthClient::new(cluster.channel().await.unwrap());
    let served = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "provisioning.v1.Provisioning".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        served.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );

    // Not one refused call changed anything.
    let after = state(&mut admin, &RUNS).await;
    assert_eq!(before, after, "a refused call changed a run");

    // Granted writes work: the scoped token on its own run, the admin on any.
    alpha_ops
        .pause_run(pb::PauseRunRequest {
            run_id: "alpha".into(),
        })
        .await
        .unwrap();
    assert!(admin.get_run(get_req("alpha")).await.unwrap().into_inner().paused);
    alpha_ops
        .resume_run(pb::ResumeRunRequest {
            run_id: "alpha".into(),
        })
        .await
        .unwrap();
    let r = alpha_ops
        .apply(apply_req("alpha", 2, 3))
        .await
        .unwrap()
        .into_inner();
    assert!(r.changed);
    let r = admin.apply(apply_req("beta", 2, 4)).await.unwrap().into_inner();
    assert!(r.changed);
    assert_eq!(converged(&mut admin, "alpha", 2).await.ready_count, 3);
    assert_eq!(converged(&mut admin, "beta", 2).await.ready_count, 4);
}

struct Ctl {
    out: std::process::Output,
}

impl Ctl {
    async fn run(server: &str, env: &[(String, String)], token_file: Option<&Path>, args: &[&str]) -> Self {
        let mut cmd = tokio::process::Command::new(bin_path("provisionctl").unwrap());
        cmd.arg("--server")
            .arg(server)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env_remove("PROVISIONCTL_TOKEN")
            .env_remove("PROVISIONCTL_TOKEN_FILE")
            .stdin(Stdio::null());
        if let Some(f) = token_file {
            cmd.arg("--token-file").arg(f);
        }
        let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .unwrap()
            .unwrap();
        Self { out }
    }

    #[track_caller]
    fn expect(&self, code: i32, stderr_says: &[&str]) -> &Self {
        let stderr = String::from_utf8_lossy(&self.out.stderr);
        assert_eq!(self.out.status.code(), Some(code), "stderr: {stderr}");
        for s in stderr_says {
            assert!(stderr.contains(s), "stderr does not say {s:?}: {stderr}");
        }
        self
    }
}

/// `provisionctl token new` makes a token and its entry; the driver takes
/// the entry after a SIGHUP; provisionctl sends the token from a file, and
/// is refused in plain words without one, or with too little access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisionctl_tokens_and_a_reload_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = Tokens::write(dir.path(), &[Grant::write("admin")]).unwrap();
    let cluster = start(tempfile::tempdir().unwrap(), &tokens).await;
    let server = cluster.driver.url();
    let env = cluster.provisionctl_env();
    let mut admin = client(&cluster, Some(tokens.token("admin").unwrap()))
        .await
        .unwrap();
    admin.apply(apply_req("alpha", 1, 1)).await.unwrap();
    converged(&mut admin, "alpha", 1).await;

    // A new read token, limited to alpha, made by provisionctl.
    let saved = dir.path().join("ops.token");
    let made = Ctl::run(
        &server,
        &env,
        None,
        &[
            "token", "new", "ops", "--access", "read", "--run", "alpha", "--save",
        ],
    )
    .await;
    // `--save` wants its path: the call above is a usage error.
    made.expect(2, &[]);
    let made = Ctl::run(
        &server,
        &env,
        None,
        &[
            "token",
            "new",
            "ops",
            "--access",
            "read",
            "--run",
            "alpha",
            "--save",
            saved.to_str().unwrap(),
        ],
    )
    .await;
    made.expect(0, &["saved in"]);
    let entry = String::from_utf8(made.out.stdout.clone()).unwrap();
    let token = std::fs::read_to_string(&saved).unwrap();
    assert!(!entry.contains(token.trim()), "the entry holds the token itself");
    assert!(
        entry.contains(&driver_svc::auth::to_hex(&driver_svc::auth::hash_token(
            token.trim()
        ))),
        "{entry}"
    );

    // Unknown to the driver until the file is reloaded.
    Ctl::run(&server, &env, Some(&saved), &["get", "alpha"])
        .await
        .expect(1, &["did not accept our credentials", "--token-file"]);
    Ctl::run(&server, &env, None, &["list"])
        .await
        .expect(1, &["did not accept our credentials"]);

    let mut file = std::fs::read_to_string(&tokens.path).unwrap();
    file.push_str(&entry);
    std::fs::write(&tokens.path, file).unwrap();
    let pid = cluster.driver.pid().unwrap();
    assert!(
        std::process::Command::new("kill")
            .arg("-HUP")
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success()
    );
    let mut reloaded = false;
    for _ in 0..100 {
        let o = Ctl::run(&server, &env, Some(&saved), &["get", "alpha"]).await;
        if o.out.status.code() == Some(0) {
            reloaded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(reloaded, "the token was not accepted after SIGHUP");

    // Read-only: provisionctl says what is not allowed, and nothing changes.
    let before = settled(&mut admin, &["alpha"]).await;
    Ctl::run(&server, &env, Some(&saved), &["delete", "alpha"])
        .await
        .expect(1, &["not allowed to delete run alpha", "read access"]);
    Ctl::run(&server, &env, Some(&saved), &["pause", "alpha"])
        .await
        .expect(1, &["not allowed to pause run alpha"]);
    assert_eq!(before, state(&mut admin, &["alpha"]).await);

    // The token also works from PROVISIONCTL_TOKEN.
    let o = tokio::process::Command::new(bin_path("provisionctl").unwrap())
        .args(["--server", &server, "get", "alpha"])
        .env_remove("PROVISIONCTL_TOKEN_FILE")
        .env("PROVISIONCTL_TOKEN", token.trim())
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .await
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));

    // A file that does not load keeps the tokens loaded before.
    std::fs::write(&tokens.path, "- {name: broken").unwrap();
    std::process::Command::new("kill")
        .arg("-HUP")
        .arg(pid.to_string())
        .status()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ctl::run(&server, &env, Some(&saved), &["get", "alpha"])
        .await
        .expect(0, &[]);
    let log = std::fs::read_to_string(cluster.driver.log_file()).unwrap();
    assert!(log.contains("the tokens file was not reloaded"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_refuses_to_start_without_authentication_unless_told() {
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = [
        "--decider",
        "http://127.0.0.1:9",
        "--executor",
        "http://127.0.0.1:9",
        "--store",
        "memory",
    ]
    .map(String::from)
    .to_vec();
    let e = Service::start("driver-svc", dir.path(), "127.0.0.1:0", &args)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("exited early"), "{e}");
    let log = std::fs::read_to_string(dir.path().join("driver-svc.log")).unwrap();
    assert!(
        log.contains("refusing to serve the public API without authentication")
            && log.contains("--tokens-file"),
        "{log}"
    );

    // A tokens file that does not parse stops it too, naming the problem.
    let bad = dir.path().join("tokens.yaml");
    std::fs::write(&bad, "- {name: ci, sha256: abc, access: write}\n").unwrap();
    let mut with_bad = args.clone();
    with_bad.extend(["--tokens-file".to_owned(), bad.display().to_string()]);
    assert!(
        Service::start("driver-svc", dir.path(), "127.0.0.1:0", &with_bad)
            .await
            .is_err()
    );
    let log = std::fs::read_to_string(dir.path().join("driver-svc.log")).unwrap();
    assert!(log.contains("sha256 must be 64 hexadecimal digits"), "{log}");

    // With --allow-unauthenticated it serves, and says what that means.
    let mut open = args.clone();
    open.push("--allow-unauthenticated".to_owned());
    let driver = Service::start("driver-svc", dir.path(), "127.0.0.1:0", &open)
        .await
        .unwrap();
    let log = std::fs::read_to_string(driver.log_file()).unwrap();
    assert!(
        log.contains("--allow-unauthenticated: the public API accepts every caller"),
        "{log}"
    );
}

/// Without a token, a client certificate (TLS) whose identity the tokens
/// file names authenticates the call, with that entry's access.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_client_certificate_authenticates_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = Tokens::write(dir.path(), &[Grant::write("admin")]).unwrap();
    // `provisionctl`'s certificate (the one `Cluster::channel` presents) may read.
    let mut file = std::fs::read_to_string(&tokens.path).unwrap();
    file.push_str("- name: ctl-cert\n  client_cert: provisionctl\n  access: read\n");
    std::fs::write(&tokens.path, file).unwrap();
    let cluster = start(tempfile::tempdir().unwrap(), &tokens).await;
    assert!(cluster.tls.is_some(), "the cluster runs with TLS");

    let mut admin = client(&cluster, Some(tokens.token("admin").unwrap()))
        .await
        .unwrap();
    admin.apply(apply_req("alpha", 1, 1)).await.unwrap();
    converged(&mut admin, "alpha", 1).await;
    let before = settled(&mut admin, &["alpha"]).await;

    let mut by_cert = client(&cluster, None).await.unwrap();
    by_cert.get_run(get_req("alpha")).await.unwrap();
    refused(
        by_cert.apply(apply_req("alpha", 2, 2)).await,
        Code::PermissionDenied,
        &["token \"ctl-cert\" has read access"],
    );

    // A connection without a certificate, and without a token, is refused.
    let mut no_cert = contract::pb::provisioning_client::ProvisioningClient::new(
        cluster.driver.channel(None).await.unwrap(),
    );
    refused(
        no_cert.get_run(get_req("alpha")).await,
        Code::Unauthenticated,
        &["no credentials"],
    );
    assert_eq!(before, state(&mut admin, &["alpha"]).await);

    // The certificate's connection with the admin's token writes: a token,
    // when given, is what counts.
    admin.apply(apply_req("alpha", 2, 2)).await.unwrap();
    converged(&mut admin, "alpha", 2).await;
}

/// A tokens-file entry past its `expires` is refused `UNAUTHENTICATED`
/// saying so, one before it is served, each entry's expiry is a metric, and
/// the load warns of the expired one. `provisionctl token new --expires`
/// writes the entry's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_is_refused_saying_so_and_expiries_are_exported() {
    let dir = tempfile::tempdir().unwrap();
    let (fresh, stale) = (
        driver_svc::auth::new_token().unwrap(),
        driver_svc::auth::new_token().unwrap(),
    );
    let mut soon = driver_svc::auth::entry_for("fresh", &fresh, driver_svc::auth::Access::Read, None);
    soon.expires = Some("2999-01-01T00:00:00Z".to_owned());
    let mut old = driver_svc::auth::entry_for("stale", &stale, driver_svc::auth::Access::Write, None);
    old.expires = Some("2020-01-01T00:00:00Z".to_owned());
    let path = dir.path().join("tokens.yaml");
    std::fs::write(&path, serde_yaml_ng::to_string(&[soon, old]).unwrap()).unwrap();
    let opts = ClusterOptions::default().tokens_file(&path).service_env(
        "driver-svc",
        "PROVISIONING_METRICS_LISTEN",
        "127.0.0.1:0",
    );
    let cluster = Cluster::start_in(dir, opts).await.unwrap();

    let mut expired = client(&cluster, Some(&stale)).await.unwrap();
    let e = expired.get_run(get_req("alpha")).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (
            Code::Unauthenticated,
            "the token \"stale\" expired at 2020-01-01T00:00:00Z; its holder needs a new one from this \
             server's operator"
        )
    );
    let e = expired.apply(apply_req("alpha", 1, 1)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let mut valid = client(&cluster, Some(&fresh)).await.unwrap();
    assert!(
        valid
            .list_runs(pb::ListRunsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .runs
            .is_empty()
    );

    let metrics = cluster.driver.scrape().await.unwrap();
    for (token, seconds) in [("fresh", 32_472_144_000.0), ("stale", 1_577_836_800.0)] {
        let series = format!("provisioning_api_token_expiry_timestamp_seconds{{token=\"{token}\"}}");
        let value = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.trim().parse::<f64>().ok());
        assert_eq!(value, Some(seconds), "{series} in:\n{metrics}");
    }
    let log = std::fs::read_to_string(cluster.driver.log_file()).unwrap();
    assert!(
        log.contains("a token in the tokens file has expired") && log.contains("stale"),
        "{log}"
    );

    // provisionctl writes the time an expiry names, and refuses one past.
    let out = std::process::Command::new(bin_path("provisionctl").unwrap())
        .args([
            "token",
            "new",
            "ci",
            "--access",
            "read",
            "--expires",
            "2030-06-01T12:00:00Z",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let entries: Vec<driver_svc::auth::TokenEntry> = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    assert_eq!(entries[0].expires.as_deref(), Some("2030-06-01T12:00:00Z"));
    let out = std::process::Command::new(bin_path("provisionctl").unwrap())
        .args(["token", "new", "ci", "--access", "read", "--expires", "30d"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let entries: Vec<driver_svc::auth::TokenEntry> = serde_yaml_ng::from_slice(&out.stdout).unwrap();
    let at = platform::token::parse_expiry(entries[0].expires.as_deref().unwrap()).unwrap();
    let ahead = at.duration_since(std::time::SystemTime::now()).unwrap();
    assert!(
        ahead > Duration::from_secs(29 * 86_400) && ahead <= Duration::from_secs(30 * 86_400),
        "{ahead:?}"
    );
    let out = std::process::Command::new(bin_path("provisionctl").unwrap())
        .args([
            "token",
            "new",
            "ci",
            "--access",
            "read",
            "--expires",
            "2020-01-01T00:00:00Z",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--expires \"2020-01-01T00:00:00Z\" is in the past"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
