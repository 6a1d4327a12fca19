//! TLS between the real binaries: the executor and the decider take calls
//! only from a client whose certificate chains to the CA, is in its validity
//! period and names the driver (`spiffe://provisioning/driver-svc`); plaintext
//! needs `--insecure` on both sides.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::Path,
    process::Stdio,
    sync::Arc,
    time::{Duration, SystemTime},
};

use contract::{
    TraceContext, UnixMillis,
    pb::{self, decide_response::Part, decider_client::DeciderClient, executor_client::ExecutorClient},
};
use platform::tls::{
    TlsMaterial, Transport,
    dev::{Leaf, Validity},
};
use provisioning_tests::{
    procs::{Cluster, ClusterOptions, Service, TestPki, bin_path, watch_until},
    shapes::shape,
};
use tonic::{Code, Status};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// A channel to `svc` over `transport`, or the status a failed connection
/// amounts to.
async fn channel(svc: &Service, transport: &Transport) -> Result<tonic::transport::Channel, Status> {
    let url = format!("{}://{}", transport.scheme(), svc.addr);
    let endpoint = transport
        .endpoint(&url)
        .map_err(|e| Status::internal(format!("endpoint: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10));
    endpoint
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("connect: {e:?}")))
}

/// One `Inventory` call to the executor.
async fn inventory(executor: &Service, transport: &Transport) -> Result<usize, Status> {
    let mut client = ExecutorClient::new(channel(executor, transport).await?);
    let r = client.inventory(pb::InventoryRequest::default()).await?;
    Ok(r.into_inner().resources.len())
}

/// One whole `Decide` call (a run of one group, no nodes yet); the number of
/// decisions in the answer.
async fn decide(decider: &Service, transport: &Transport) -> Result<usize, Status> {
    let mut client = DeciderClient::new(channel(decider, transport).await?);
    let s = shape("tls", 1, "fake", &[("w", 2, "img:1")]);
    let requests = decider_svc::encode_request(
        &s,
        false,
        [],
        &decider::SlotSet::new(),
        UnixMillis::new(1_000),
        &TraceContext::default(),
    );
    let mut answer = client.decide(tokio_stream::iter(requests)).await?.into_inner();
    let mut decisions = 0;
    while let Some(msg) = answer.message().await? {
        match msg.part {
            Some(Part::Decisions(batch)) => decisions += batch.decisions.len(),
            Some(Part::Summary(_)) => return Ok(decisions),
            _ => {}
        }
    }
    Err(Status::internal("the answer ended without a summary"))
}

/// A health check of `service` on `svc`.
async fn health(svc: &Service, transport: &Transport, service: &str) -> Result<ServingStatus, Status> {
    let mut client = HealthClient::new(channel(svc, transport).await?);
    let r = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?;
    Ok(r.into_inner().status())
}

/// A failure of the TLS handshake (the server closes the connection), as
/// opposed to an answer from the server.
fn refused_in_handshake<T: std::fmt::Debug>(what: &str, r: &Result<T, Status>) {
    match r {
        Err(s) if matches!(s.code(), Code::Unavailable | Code::Unknown | Code::Cancelled) => {}
        other => panic!("{what}: expected the handshake to fail, got {other:?}"),
    }
}

fn denied<T: std::fmt::Debug>(what: &str, r: &Result<T, Status>) {
    match r {
        Err(s) if s.code() == Code::PermissionDenied => {
            assert!(s.message().contains("may not call"), "{what}: {}", s.message());
        }
        other => panic!("{what}: expected PERMISSION_DENIED, got {other:?}"),
    }
}

/// The material of a client that trusts `pki`'s CA and presents `stem`'s
/// certificate from `holder` (another PKI, or the same).
fn client_of(pki: &TestPki, holder: &TestPki, stem: &str) -> Transport {
    let (cert, key) = holder.cert_and_key(stem);
    Transport::Tls(Arc::new(
        TlsMaterial::load(&pki.ca(), Some((&cert, &key))).unwrap(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_executor_and_the_decider_take_calls_only_from_the_driver() {
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    let pki = cluster.tls.clone().expect("a cluster runs with TLS by default");

    // Another CA's certificate for the driver's very name.
    let elsewhere = tempfile::tempdir().unwrap();
    let other_ca = TestPki::create(elsewhere.path()).unwrap();
    // The driver's name, from the right CA, but expired yesterday.
    let day = Duration::from_secs(86_400);
    let now = SystemTime::now();
    pki.issue(
        "expired-driver",
        &Leaf::service(
            platform::tls::DRIVER,
            &TestPki::hosts(),
            Validity {
                not_before: now - 3 * day,
                not_after: now - day,
            },
        ),
    )
    .unwrap();

    let no_cert = pki.transport(None).unwrap();
    let wrong_ca = client_of(&pki, &other_ca, "driver-svc");
    let expired = client_of(&pki, &pki, "expired-driver");
    let provisionctl = pki.transport(Some("provisionctl")).unwrap();
    let executor_cert = pki.transport(Some("executor-svc")).unwrap();
    let driver = pki.transport(Some("driver-svc")).unwrap();

    // The executor.
    let ex = &cluster.executor;
    refused_in_handshake("executor, no certificate", &inventory(ex, &no_cert).await);
    refused_in_handshake("executor, another CA", &inventory(ex, &wrong_ca).await);
    refused_in_handshake("executor, expired", &inventory(ex, &expired).await);
    denied(
        "executor, provisionctl's certificate",
        &inventory(ex, &provisionctl).await,
    );
    denied(
        "executor, its own certificate",
        &inventory(ex, &executor_cert).await,
    );
    assert!(
        inventory(ex, &driver).await.is_ok(),
        "the driver's certificate must be accepted by the executor"
    );

    // The decider.
    let de = &cluster.decider;
    refused_in_handshake("decider, no certificate", &decide(de, &no_cert).await);
    refused_in_handshake("decider, another CA", &decide(de, &wrong_ca).await);
    refused_in_handshake("decider, expired", &decide(de, &expired).await);
    denied(
        "decider, provisionctl's certificate",
        &decide(de, &provisionctl).await,
    );
    denied(
        "decider, the executor's certificate",
        &decide(de, &executor_cert).await,
    );
    let decisions = decide(de, &driver).await;
    assert!(
        matches!(decisions, Ok(n) if n == 2),
        "the driver's certificate must be accepted by the decider (two inserts): {decisions:?}"
    );

    // Health checks are open to any certificate from the CA, and to no other.
    for (svc, name) in [
        (ex, "provisioning.internal.v1.Executor"),
        (de, "provisioning.internal.v1.Decider"),
    ] {
        let ok = health(svc, &provisionctl, name).await;
        assert!(matches!(ok, Ok(ServingStatus::Serving)), "{name}: {ok:?}");
        refused_in_handshake(name, &health(svc, &no_cert, name).await);
        refused_in_handshake(name, &health(svc, &wrong_ca, name).await);
    }

    // The refusals were logged, each with who was refused.
    let log = std::fs::read_to_string(ex.log_file()).unwrap();
    assert!(
        log.contains("call refused") && log.contains("spiffe://provisioning/provisionctl"),
        "{log}"
    );

    // And the driver, with its certificate, drives a run to convergence
    // through both.
    let mut c = cluster.client().await.unwrap();
    let s = shape("tls", 1, "fake", &[("w", 3, "img:1")]);
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&s)),
    })
    .await
    .unwrap();
    if let Err(e) = watch_until(&mut c, "tls", Duration::from_secs(60), |s| s.converged).await {
        cluster.dump_logs();
        panic!("{e}");
    }
    assert_eq!(cluster.inventory().await.unwrap().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_does_not_reach_a_tls_service() {
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    let plaintext = Transport::Insecure;
    for (svc, name) in [
        (&cluster.decider, "provisioning.internal.v1.Decider"),
        (&cluster.executor, "provisioning.internal.v1.Executor"),
        (&cluster.driver, "provisioning.v1.Provisioning"),
    ] {
        let r = health(svc, &plaintext, name).await;
        assert!(r.is_err(), "{name} answered a plaintext client: {r:?}");
    }
    // The driver's public API takes a client with no certificate of its own
    // (client certificates are optional there), but only over TLS.
    let pki = cluster.tls.clone().unwrap();
    let ok = health(
        &cluster.driver,
        &pki.transport(None).unwrap(),
        "provisioning.v1.Provisioning",
    )
    .await;
    assert!(matches!(ok, Ok(ServingStatus::Serving)), "{ok:?}");
}

/// Runs `name` with `args` and a clean environment until it exits (within
/// 20 s): its exit code and standard error.
async fn run_to_exit(name: &str, args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = tokio::process::Command::new(bin_path(name).unwrap());
    cmd.args(args)
        .env_clear()
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(20), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{name} {args:?} did not exit"))
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_without_tls_settings_or_insecure_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::create(dir.path()).unwrap();
    let ca = pki.ca().display().to_string();
    let listen = ["--listen", "127.0.0.1:0"];
    let driver_extra = [
        "--decider",
        "127.0.0.1:1",
        "--executor",
        "127.0.0.1:2",
        "--store",
        "memory",
    ];
    for name in ["decider-svc", "executor-svc", "driver-svc"] {
        let extra: &[&str] = if name == "driver-svc" { &driver_extra } else { &[] };
        let args: Vec<&str> = listen.iter().chain(extra).copied().collect();
        let (code, err) = run_to_exit(name, &args).await;
        assert_ne!(code, Some(0), "{name} started without TLS settings");
        assert!(
            err.contains("no TLS settings") && err.contains("--insecure") && err.contains("--tls-cert"),
            "{name}: {err}"
        );

        let mut conflicting = args.clone();
        conflicting.extend(["--insecure", "--tls-ca", &ca]);
        let (code, err) = run_to_exit(name, &conflicting).await;
        assert_ne!(code, Some(0), "{name} started with --insecure and --tls-ca");
        assert!(err.contains("cannot be combined with --tls-ca"), "{name}: {err}");

        let mut partial = args.clone();
        partial.extend(["--tls-ca", &ca]);
        let (code, err) = run_to_exit(name, &partial).await;
        assert_ne!(code, Some(0), "{name} started with only --tls-ca");
        assert!(err.contains("--tls-cert is missing"), "{name}: {err}");

        // A certificate with another holder's key: refused at start, naming
        // both files, rather than failing every handshake later.
        let (cert, _) = pki.cert_and_key(name);
        let (_, other_key) = pki.cert_and_key("provisionctl");
        let (cert, other_key) = (cert.display().to_string(), other_key.display().to_string());
        let mut mismatched = args.clone();
        mismatched.extend(["--tls-cert", &cert, "--tls-key", &other_key, "--tls-ca", &ca]);
        let (code, err) = run_to_exit(name, &mismatched).await;
        assert_ne!(
            code,
            Some(0),
            "{name} started with a key that is not its certificate's"
        );
        assert!(
            err.contains(&format!(
                "{cert} and {other_key} are not a pair: the key is not the certificate's; give the key that \
                 was issued with the certificate"
            )),
            "{name}: {err}"
        );
    }

    // With --insecure it starts, and says loudly that it is in plaintext.
    let svc = Service::start(
        "decider-svc",
        dir.path(),
        "127.0.0.1:0",
        &["--insecure".to_owned()],
    )
    .await
    .unwrap();
    let log = std::fs::read_to_string(svc.log_file()).unwrap();
    assert!(
        log.contains("WARN") && log.contains("--insecure: serving and calling in plaintext"),
        "{log}"
    );
    let ok = health(&svc, &Transport::Insecure, "provisioning.internal.v1.Decider").await;
    assert!(matches!(ok, Ok(ServingStatus::Serving)), "{ok:?}");
}

/// `provisionctl` with args and environment; its exit code, stdout and stderr.
async fn provisionctl(args: &[&str], env: &[(String, String)]) -> (i32, String, String) {
    let out = tokio::process::Command::new(bin_path("provisionctl").unwrap())
        .args(args)
        .env_remove("PROVISIONCTL_SERVER")
        .env_remove("PROVISIONCTL_INSECURE")
        .env_remove("PROVISIONCTL_TLS_CA")
        .env_remove("PROVISIONCTL_TLS_CERT")
        .env_remove("PROVISIONCTL_TLS_KEY")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisionctl_writes_certificates_the_services_run_with() {
    // `provisionctl certs` writes a CA and a certificate per holder.
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let out_dir = certs.display().to_string();
    let (code, out, err) = provisionctl(&["certs", "--out", &out_dir, "--days", "2"], &[]).await;
    assert_eq!(code, 0, "{err}");
    for name in ["decider-svc", "executor-svc", "driver-svc", "provisionctl"] {
        let key = certs.join(format!("{name}.key"));
        assert!(out.contains(&key.display().to_string()), "{out}");
        assert_eq!(mode(&key), 0o600, "{name}.key");
        assert!(certs.join(format!("{name}.pem")).exists());
    }
    assert!(certs.join("ca.pem").exists());

    // Writing again over them is refused (a new CA would cut a running stack
    // off), naming what is there, and changes nothing; --force replaces.
    let ca_before = std::fs::read(certs.join("ca.pem")).unwrap();
    let (code, _, err) = provisionctl(&["certs", "--out", &out_dir, "--days", "2"], &[]).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("already holds") && err.contains("ca.pem") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(std::fs::read(certs.join("ca.pem")).unwrap(), ca_before);
    let (code, _, err) = provisionctl(&["certs", "--out", &out_dir, "--days", "2", "--force"], &[]).await;
    assert_eq!(code, 0, "{err}");
    assert_ne!(
        std::fs::read(certs.join("ca.pem")).unwrap(),
        ca_before,
        "--force wrote a new CA"
    );

    // A decider started with them answers the driver's certificate from the
    // same set, and refuses provisionctl's.
    let tls_args = |name: &str| -> Vec<String> {
        vec![
            "--tls-cert".into(),
            certs.join(format!("{name}.pem")).display().to_string(),
            "--tls-key".into(),
            certs.join(format!("{name}.key")).display().to_string(),
            "--tls-ca".into(),
            certs.join("ca.pem").display().to_string(),
        ]
    };
    let decider = Service::start("decider-svc", dir.path(), "127.0.0.1:0", &tls_args("decider-svc"))
        .await
        .unwrap();
    let as_holder = |name: &str| {
        let cert = certs.join(format!("{name}.pem"));
        let key = certs.join(format!("{name}.key"));
        Transport::Tls(Arc::new(
            TlsMaterial::load(&certs.join("ca.pem"), Some((&cert, &key))).unwrap(),
        ))
    };
    assert!(matches!(decide(&decider, &as_holder("driver-svc")).await, Ok(2)));
    denied(
        "decider, provisionctl",
        &decide(&decider, &as_holder("provisionctl")).await,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisionctl_talks_tls_and_plaintext_only_when_told() {
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    let addr = cluster.driver.addr.to_string();
    let env = cluster.provisionctl_env();

    // TLS with the cluster's CA and provisionctl's certificate.
    let (code, out, err) = provisionctl(&["--server", &addr, "list"], &env).await;
    assert_eq!(code, 0, "{out}{err}");

    // Neither TLS settings nor --insecure: a usage error naming both.
    let (code, _, err) = provisionctl(&["--server", &addr, "list"], &[]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--tls-ca") && err.contains("--insecure"), "{err}");

    // Plaintext to a TLS driver does not get through.
    let (code, out, err) = provisionctl(&["--server", &addr, "--insecure", "list"], &[]).await;
    assert_eq!(code, 4, "{out}{err}");
    assert!(out.is_empty(), "{out}");

    // An http:// URL with TLS on is refused rather than sent in plaintext:
    // the command line is wrong (exit 2).
    let url = format!("http://{addr}");
    let (code, _, err) = provisionctl(&["--server", &url, "list"], &env).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("use https://"), "{err}");

    // A CA that did not sign the driver's certificate: the server is not trusted.
    let elsewhere = tempfile::tempdir().unwrap();
    let other = TestPki::create(elsewhere.path()).unwrap();
    let (code, _, err) = provisionctl(&["--server", &addr, "list"], &other.provisionctl_env()).await;
    assert_eq!(code, 4, "{err}");
}

/// A health check through the driver's own kind of channel: one that wants
/// the server to be `expect`.
async fn health_of_peer(svc: &Service, transport: &Transport, expect: &str) -> Result<ServingStatus, Status> {
    let url = format!("{}://{}", transport.scheme(), svc.addr);
    let endpoint = transport
        .peer_endpoint(&url, expect)
        .map_err(|e| Status::internal(format!("endpoint: {e}")))?
        .map(|e| {
            e.connect_timeout(Duration::from_secs(5))
                .timeout(Duration::from_secs(10))
        });
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("connect: {e:?}")))?;
    let r = HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await?;
    Ok(r.into_inner().status())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_reaches_only_the_service_it_names() {
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    let pki = cluster.tls.clone().expect("a cluster runs with TLS by default");
    let driver = pki.transport(Some("driver-svc")).unwrap();

    // The right service, by name or by URI, over both kinds of channel.
    for (svc, name) in [
        (&cluster.decider, "decider-svc"),
        (&cluster.executor, "executor-svc"),
    ] {
        assert_eq!(
            health_of_peer(svc, &driver, name).await.unwrap(),
            ServingStatus::Serving
        );
        let uri = platform::tls::identity_of(name);
        assert_eq!(
            health_of_peer(svc, &driver, &uri).await.unwrap(),
            ServingStatus::Serving
        );
    }
    // A certificate from the same CA for another service is refused in the
    // handshake: the decider cannot pose as the executor, nor the other way.
    let wrong = health_of_peer(&cluster.decider, &driver, "executor-svc").await;
    refused_in_handshake("the decider posing as the executor", &wrong);
    assert!(
        format!("{wrong:?}").contains("is not spiffe://provisioning/executor-svc"),
        "{wrong:?}"
    );
    refused_in_handshake(
        "the executor posing as the decider",
        &health_of_peer(&cluster.executor, &driver, "decider-svc").await,
    );

    // A driver told to expect another executor never links, and says why;
    // the one the cluster runs (with the defaults) converges a run.
    let mut c = cluster.client().await.unwrap();
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            "named",
            1,
            "fake",
            &[("w", 2, "img:1")],
        ))),
    })
    .await
    .unwrap();
    watch_until(&mut c, "named", Duration::from_secs(60), |s| s.converged)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("tls")).unwrap();
    for f in std::fs::read_dir(&pki.dir).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.path().join("tls").join(f.file_name())).unwrap();
    }
    let misled = Service::start(
        "driver-svc",
        dir.path(),
        "127.0.0.1:0",
        &[
            "--decider".into(),
            cluster.decider.url(),
            "--executor".into(),
            cluster.decider.url(),
            "--executor-identity".into(),
            "executor-svc".into(),
            "--allow-unauthenticated".into(),
            "--store".into(),
            "memory".into(),
        ],
    )
    .await
    .unwrap();
    let log = misled.log_file().to_owned();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("is not spiffe://provisioning/executor-svc") {
            assert!(!text.contains("executor link up"), "{text}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the driver did not say why it cannot reach the executor: {text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Each way of pointing provisionctl wrongly at a server is told as what is
/// wrong and what to do, with its exit code: 4 when the server cannot be
/// reached as asked, 2 for a command line that contradicts itself, 1 for
/// files that do not go together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisionctl_says_what_is_wrong_with_a_connection_and_what_to_do() {
    let cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    let pki = cluster.tls.clone().expect("a cluster runs with TLS by default");
    let addr = cluster.driver.addr.to_string();
    let decider = cluster.decider.addr.to_string();
    let env = cluster.provisionctl_env();
    let elsewhere = tempfile::tempdir().unwrap();
    let other = TestPki::create(elsewhere.path()).unwrap();
    let plain_dir = tempfile::tempdir().unwrap();
    let plaintext = Service::start(
        "decider-svc",
        plain_dir.path(),
        "127.0.0.1:0",
        &["--insecure".to_owned()],
    )
    .await
    .unwrap();
    let plain = plaintext.addr.to_string();
    let ca = pki.ca().display().to_string();
    let path = |p: std::path::PathBuf| p.display().to_string();
    let (client_cert, client_key) = pki.cert_and_key("provisionctl");
    let (client_cert, client_key) = (path(client_cert), path(client_key));
    let (_, driver_key) = pki.cert_and_key("driver-svc");
    let (other_cert, other_key) = other.cert_and_key("provisionctl");
    let (other_cert, other_key) = (path(other_cert), path(other_key));
    let with_ca = |extra: &[&str]| -> Vec<String> {
        let mut args = vec!["--tls-ca".to_owned(), ca.clone()];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        args
    };
    // What is tried, the command line, its environment, the exit code and
    // the whole standard error.
    type Case = (&'static str, Vec<String>, Vec<(String, String)>, i32, String);
    let cases: Vec<Case> = vec![
        (
            "a CA that did not issue the driver's certificate",
            vec!["--server".into(), addr.clone(), "list".into()],
            other.provisionctl_env(),
            4,
            format!(
                "provisionctl: the server at {addr} presented a certificate that the CA in {} did not \
                 issue\nprovisionctl: give --tls-ca the CA bundle that issued the driver's certificate \
                 (`provisionctl certs` writes it as ca.pem beside the certificates)\n",
                other.ca().display()
            ),
        ),
        (
            "TLS to a plaintext server",
            [vec!["--server".to_owned(), plain.clone()], with_ca(&["list"])].concat(),
            vec![],
            4,
            format!(
                "provisionctl: the server at {plain} does not speak TLS (it answered in plaintext)\n\
                 provisionctl: if it is a driver started with --insecure, give --insecure \
                 (PROVISIONCTL_INSECURE=true) instead of --tls-ca; else check the address\n"
            ),
        ),
        (
            "plaintext to a TLS driver",
            vec![
                "--server".into(),
                addr.clone(),
                "--insecure".into(),
                "list".into(),
            ],
            vec![],
            4,
            format!(
                "provisionctl: the server at {addr} answered plaintext HTTP/2 with TLS, and --insecure is \
                 plaintext\nprovisionctl: give --tls-ca (PROVISIONCTL_TLS_CA) with the CA that issued the \
                 driver's certificate instead of --insecure\n"
            ),
        ),
        (
            "a certificate with another's key",
            [
                vec!["--server".to_owned(), addr.clone()],
                with_ca(&[
                    "--tls-cert",
                    &client_cert,
                    "--tls-key",
                    &path(driver_key.clone()),
                    "list",
                ]),
            ]
            .concat(),
            vec![],
            1,
            format!(
                "provisionctl: {client_cert} and {} are not a pair: the key is not the certificate's; give \
                 the key that was issued with the certificate\n",
                driver_key.display()
            ),
        ),
        (
            "a client certificate from another CA",
            [
                vec!["--server".to_owned(), addr.clone()],
                with_ca(&["--tls-cert", &other_cert, "--tls-key", &other_key, "list"]),
            ]
            .concat(),
            vec![],
            4,
            format!(
                "provisionctl: the server at {addr} refused this command's client certificate \
                 ({other_cert}): it was not issued by the CA the server trusts\nprovisionctl: give a \
                 certificate from the server's CA, or none (the driver's public port does not require \
                 one)\n"
            ),
        ),
        (
            "the decider's port, with provisionctl's certificate",
            [
                vec!["--server".to_owned(), decider.clone()],
                with_ca(&["--tls-cert", &client_cert, "--tls-key", &client_key, "list"]),
            ]
            .concat(),
            vec![],
            4,
            format!(
                "provisionctl: the server at {decider} is not the driver: spiffe://provisioning/provisionctl \
                 may not call this port: it serves the provisioning services' internal protocol, only to \
                 spiffe://provisioning/driver-svc\nprovisionctl: --server (or PROVISIONCTL_SERVER) should \
                 name driver-svc's public port\n"
            ),
        ),
        (
            "the decider's port, without a certificate",
            [vec!["--server".to_owned(), decider.clone()], with_ca(&["list"])].concat(),
            vec![],
            4,
            format!(
                "provisionctl: the server at {decider} requires a client certificate, and this command gave \
                 none\nprovisionctl: the driver's public port does not require one: if {decider} is the \
                 decider's or the executor's port, --server should name driver-svc's; else give \
                 --tls-cert and --tls-key\n"
            ),
        ),
        (
            "a duration in hours and minutes",
            vec![
                "--server".into(),
                addr.clone(),
                "delete".into(),
                "nothing-here".into(),
                "--wait".into(),
                "--timeout".into(),
                "1h30m".into(),
            ],
            env.clone(),
            1,
            format!(
                "provisionctl: run nothing-here does not exist on {addr}\nprovisionctl: `provisionctl list` \
                 shows the runs there\n"
            ),
        ),
    ];
    for (what, args, env, code, stderr) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (got, out, err) = provisionctl(&args, &env).await;
        assert_eq!((got, err.as_str()), (code, stderr.as_str()), "{what}: {out}");
        assert!(out.is_empty(), "{what}: {out}");
    }
}

/// Writes `bytes` to `path` the way a rotation does: whole, by a rename.
fn replace(path: &Path, bytes: &[u8]) {
    let fresh = path.with_extension("new");
    std::fs::write(&fresh, bytes).unwrap();
    std::fs::rename(&fresh, path).unwrap();
}

/// How many times each service's log says it reloaded its TLS files.
fn reloads(cluster: &Cluster) -> Vec<usize> {
    [&cluster.decider, &cluster.executor, &cluster.driver]
        .iter()
        .map(|s| {
            std::fs::read_to_string(s.log_file())
                .unwrap()
                .matches("TLS files reloaded")
                .count()
        })
        .collect()
}

/// Waits until every service has reloaded `n` times.
async fn reloaded(cluster: &Cluster, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while reloads(cluster).iter().any(|&r| r < n) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every service reloaded {n} times: {:?}",
            reloads(cluster)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Certificates rotate under a converging run the way cert-manager rotates
/// them: the new CA trusted beside the old, every service's (and the
/// client's) certificate replaced by one from the new CA valid for three
/// minutes, then the old CA dropped. No call fails: not the client's, on a
/// connection made before or made afresh, and not the driver's to the
/// decider and the executor. Afterwards only the new CA gets in. A bad new
/// file is logged and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotate_under_a_converging_run_without_a_failed_call() {
    let opts = ClusterOptions::default()
        .env("PROVISIONING_TLS_RELOAD_INTERVAL_MS", "100")
        .executor("--fake-stage-interval-ms", "400")
        .service_env("driver-svc", "PROVISIONING_METRICS_LISTEN", "127.0.0.1:0");
    let cluster = Cluster::start(opts).await.unwrap();
    let pki = cluster.tls.clone().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let next = TestPki::create(elsewhere.path()).unwrap();
    let now = SystemTime::now();
    let minutes = Validity {
        not_before: now - Duration::from_secs(60),
        not_after: now + Duration::from_secs(180),
    };
    let mut short = Vec::new();
    for name in platform::tls::dev::SERVICES {
        let leaf = Leaf::service(name, &TestPki::hosts(), minutes);
        short.push((name, next.issue(&format!("{name}-short"), &leaf).unwrap()));
    }
    let client_leaf = Leaf::client("provisionctl", minutes);
    short.push((
        "provisionctl",
        next.issue("provisionctl-short", &client_leaf).unwrap(),
    ));

    let mut c = cluster.client().await.unwrap();
    c.apply(pb::ApplyRequest {
        shape: Some(pb::ClusterShape::from(&shape(
            "rotating",
            1,
            "fake",
            &[("workers", 12, "img:1")],
        ))),
    })
    .await
    .unwrap();

    // Two readers all along: one on the connection made before, one on a
    // connection made afresh each time from the files as they are.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers = {
        let (stop, mut kept, driver) = (Arc::clone(&stop), c.clone(), cluster.driver.addr);
        let pki = pki.clone();
        tokio::spawn(async move {
            let (mut calls, mut failures) = (0usize, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let get = pb::GetRunRequest {
                    run_id: "rotating".to_owned(),
                    include_nodes: false,
                };
                if let Err(e) = kept.get_run(get.clone()).await {
                    failures.push(format!("kept: {e}"));
                }
                // Between a rotation's two writes the files may not pair up;
                // the call is made once they do.
                if let Ok(transport) = pki.transport(Some("provisionctl"))
                    && let Ok(endpoint) = transport.endpoint(&format!("https://{driver}"))
                {
                    match endpoint.connect().await {
                        Ok(channel) => {
                            if let Err(e) = pb::provisioning_client::ProvisioningClient::new(channel)
                                .get_run(get)
                                .await
                            {
                                failures.push(format!("fresh: {e}"));
                            }
                        }
                        Err(e) => failures.push(format!("fresh connect: {e:?}")),
                    }
                }
                calls += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (calls, failures)
        })
    };

    // 1. The new CA beside the old one.
    let old_ca = std::fs::read(pki.ca()).unwrap();
    let new_ca = std::fs::read(next.ca()).unwrap();
    replace(&pki.ca(), &[old_ca.clone(), new_ca.clone()].concat());
    reloaded(&cluster, 1).await;
    // 2. Every certificate from the new CA, valid for minutes.
    for (name, (cert, key)) in &short {
        let (to_cert, to_key) = pki.cert_and_key(name);
        replace(&to_cert, &std::fs::read(cert).unwrap());
        replace(&to_key, &std::fs::read(key).unwrap());
    }
    reloaded(&cluster, 2).await;
    // 3. The old CA dropped.
    replace(&pki.ca(), &new_ca);
    reloaded(&cluster, 3).await;
    let midway = c
        .get_run(pb::GetRunRequest {
            run_id: "rotating".to_owned(),
            include_nodes: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        !midway.converged,
        "the run converged before the rotation was over"
    );

    let done = watch_until(&mut c, "rotating", Duration::from_secs(60), |s| s.converged)
        .await
        .unwrap();
    assert_eq!(done.ready_count, 12);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (calls, failures) = readers.await.unwrap();
    assert!(calls > 10, "{calls} reads");
    assert!(
        failures.is_empty(),
        "{} of {calls} reads failed: {failures:?}",
        failures.len()
    );
    let metrics = cluster.driver.scrape().await.unwrap();
    let failed: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("grpc_client_handled_total{") && !l.contains("grpc_code=\"OK\""))
        .filter(|l| {
            l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
                > 0.0
        })
        .collect();
    assert!(failed.is_empty(), "the driver's calls failed: {failed:?}");

    // New handshakes present the new certificates: a client of the new CA
    // alone reaches every service; one of the old CA alone reaches none.
    let only_old = tempfile::tempdir().unwrap();
    std::fs::write(only_old.path().join("ca.pem"), &old_ca).unwrap();
    let (old_cert, old_key) = pki
        .issue("old-client", &Leaf::client("provisionctl", minutes))
        .unwrap();
    let old_client = Transport::Tls(Arc::new(
        TlsMaterial::load(&only_old.path().join("ca.pem"), Some((&old_cert, &old_key))).unwrap(),
    ));
    let new_client = next.transport(Some("provisionctl-short")).unwrap();
    for (svc, name) in [
        (&cluster.decider, "provisioning.internal.v1.Decider"),
        (&cluster.executor, "provisioning.internal.v1.Executor"),
        (&cluster.driver, "provisioning.v1.Provisioning"),
    ] {
        let on = health(svc, &new_client, name).await;
        assert!(matches!(on, Ok(ServingStatus::Serving)), "{name}: {on:?}");
        assert!(
            health(svc, &old_client, name).await.is_err(),
            "{name} still takes the old CA's certificates"
        );
    }

    // A bad new file: logged, and the certificate in force stays.
    let (decider_cert, _) = pki.cert_and_key("decider-svc");
    let good = std::fs::read(&decider_cert).unwrap();
    replace(&decider_cert, b"not a certificate");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(cluster.decider.log_file())
        .unwrap()
        .contains("the TLS files changed but do not load")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the bad file was not reported"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let still = health(&cluster.decider, &new_client, "provisioning.internal.v1.Decider").await;
    assert!(matches!(still, Ok(ServingStatus::Serving)), "{still:?}");
    replace(&decider_cert, &good);
}
