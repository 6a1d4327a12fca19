//! The `decider-svc` binary: it announces its port in the ready file, answers
//! health checks, and exits cleanly on SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use tonic::transport::Channel;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

fn ready_file() -> PathBuf {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    std::env::temp_dir().join(format!("decider-svc-{}-{nanos}.ready", std::process::id()))
}

#[tokio::test]
async fn the_binary_serves_until_sigterm() {
    let ready = ready_file();
    let mut child = Command::new(env!("CARGO_BIN_EXE_decider-svc"))
        .env("PROVISIONING_LISTEN", "127.0.0.1:0")
        .env("PROVISIONING_READY_FILE", &ready)
        .env("DECIDER_MAX_NODES", "5000")
        .env("PROVISIONING_INSECURE", "true")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    let started = Instant::now();
    let addr = loop {
        if let Ok(s) = std::fs::read_to_string(&ready) {
            break s.trim().to_owned();
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no ready file");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // The client stays connected through the shutdown: an idle connection
    // must not hold the process open.
    let mut health = HealthClient::new(channel);
    let status = health
        .check(HealthCheckRequest {
            service: "provisioning.internal.v1.Decider".to_owned(),
        })
        .await
        .unwrap()
        .into_inner()
        .status();
    assert_eq!(status, ServingStatus::Serving);

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let started = Instant::now();
    let exit = loop {
        if let Some(exit) = child.try_wait().unwrap() {
            break exit;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(exit.success(), "{exit:?}");
    drop(health);
    let _ = std::fs::remove_file(&ready);
}
