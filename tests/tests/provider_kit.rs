//! The provider conformance kit (`provider-conformance`) against real
//! plugins: the fake and process backends served as plugins
//! (`builtin-provider`) and the Python example pass it, seam contracts and
//! guarantee battery alike; three plugins broken on purpose
//! (`broken-provider`) are each caught, by the contract they break.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{path::Path, process::Command, time::Duration};

use provisioning_tests::{kit, procs::bin_path};

/// Runs the kit against `plugin` (a command) with `seeds` battery seeds:
/// its exit code and standard output.
fn kit_run(plugin: &str, seeds: u64, log: &Path) -> (i32, String) {
    let mut child = Command::new(bin_path("provider-conformance").unwrap())
        .args([
            "--plugin",
            plugin,
            "--seeds",
            &seeds.to_string(),
            "--shrink-runs",
            "2",
        ])
        .arg("--plugin-log")
        .arg(log)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    // Bounded: a kit that hangs fails the test instead of holding CI.
    let until = std::time::Instant::now() + Duration::from_secs(600);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the kit did not finish within 10 minutes: {plugin}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("{stdout}");
    (out.status.code().unwrap_or(-1), stdout)
}

/// Every seam contract passed (or, where the plugin cannot be asked,
/// was skipped for a reason the kit gives) and every battery seed held.
fn assert_passes(code: i32, out: &str, seeds: u64, skipped: &[&str]) {
    assert_eq!(code, 0, "the kit failed:\n{out}");
    for contract in kit::CONTRACTS {
        let pass = out.lines().any(|l| l == format!("PASS  {contract}"));
        let skip =
            skipped.contains(&contract) && out.lines().any(|l| l.starts_with(&format!("SKIP  {contract}: ")));
        assert!(pass || skip, "{contract:?} did not pass:\n{out}");
    }
    let battery = out
        .lines()
        .filter(|l| l.starts_with("PASS  guarantee battery, seed "))
        .count();
    assert_eq!(battery as u64, seeds, "{out}");
    assert!(!out.contains("FAIL"), "{out}");
}

#[test]
fn the_fake_backend_served_as_a_plugin_passes_the_kit() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = format!(
        "{} --backend fake --listen unix:{} --testing --fake-state-file {}",
        bin_path("builtin-provider").unwrap().display(),
        dir.path().join("p.sock").display(),
        dir.path().join("state.json").display()
    );
    let (code, out) = kit_run(&plugin, 4, &dir.path().join("plugin.log"));
    assert_passes(code, &out, 4, &[]);
}

#[test]
fn the_process_plugin_passes_the_kit() {
    let dir = tempfile::tempdir().unwrap();
    let agents = dir.path().join("agents");
    let plugin = format!(
        "{} --backend process --process-state-dir {} --listen unix:{} --testing",
        bin_path("builtin-provider").unwrap().display(),
        agents.display(),
        dir.path().join("p.sock").display(),
    );
    let (code, out) = kit_run(&plugin, 2, &dir.path().join("plugin.log"));
    assert_passes(code, &out, 2, &[]);
    // The kit and the battery destroyed every agent they made.
    assert!(
        provisioning_tests::procs::live_agent_pids(&agents).is_empty(),
        "agents outlived the kit"
    );
}

/// The Python example (`examples/python-provider`), with grpcio from
/// `.ci/needs`.
#[test]
fn the_python_example_passes_the_kit() {
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = root.join("examples/python-provider/provider.py");
    let plugin = format!(
        "python3 {} --listen unix:{} --testing --state-file {}",
        script.display(),
        dir.path().join("py.sock").display(),
        dir.path().join("py.json").display()
    );
    let (code, out) = kit_run(&plugin, 2, &dir.path().join("plugin.log"));
    if code == 2 {
        panic!(
            "the Python example did not start (is grpcio installed? `.ci/needs --install`): {}",
            std::fs::read_to_string(dir.path().join("plugin.log")).unwrap_or_default()
        );
    }
    assert_passes(code, &out, 2, &[]);
}

/// A broken plugin fails the kit (exit 1) with `contract` named FAIL.
fn caught(defect: &str, contract: &str) {
    let dir = tempfile::tempdir().unwrap();
    let plugin = format!(
        "{} --defect {defect} --listen unix:{} --testing --state-file {}",
        bin_path("broken-provider").unwrap().display(),
        dir.path().join("b.sock").display(),
        dir.path().join("b.state").display()
    );
    let (code, out) = kit_run(&plugin, 0, &dir.path().join("plugin.log"));
    assert_eq!(code, 1, "{defect}: the kit did not fail:\n{out}");
    assert!(
        out.lines().any(|l| l.starts_with(&format!("FAIL  {contract}: "))),
        "{defect}: not caught by {contract:?}:\n{out}"
    );
}

#[test]
fn the_kit_holds_a_correct_plugin_and_catches_three_broken_ones() {
    // The same plugin without its defect passes, so what catches the
    // defects is the defect.
    let dir = tempfile::tempdir().unwrap();
    let plugin = format!(
        "{} --listen unix:{} --testing --state-file {}",
        bin_path("broken-provider").unwrap().display(),
        dir.path().join("b.sock").display(),
        dir.path().join("b.state").display()
    );
    let (code, out) = kit_run(&plugin, 1, &dir.path().join("plugin.log"));
    assert_passes(code, &out, 1, &[kit::HEALTH]);

    caught("definite-failure", kit::DEFINITE_FAILURE);
    caught("double-create", kit::ONE_RESOURCE);
    caught("forget-on-restart", kit::RESTART);
}
