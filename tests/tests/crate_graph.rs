//! The crate graph shows the design: the client links nothing of the driver,
//! and the pure cores (the decider, the driver core, the domain types) link
//! no runtime and no wire stack. Read from `cargo tree`, the resolved graph
//! a build of each crate alone uses.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{collections::BTreeSet, path::Path, process::Command};

/// The packages in the normal (non-dev, non-build) dependency graph of
/// `package` built alone, with `args` added to `cargo tree`.
fn normal_deps(package: &str, args: &[&str]) -> BTreeSet<String> {
    // The cargo running these tests.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(cargo)
        .current_dir(&root)
        .args([
            "tree",
            "--offline",
            "--locked",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-p",
            package,
        ])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let names: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    assert!(
        names.contains(package),
        "{package} is not in its own tree: {text}"
    );
    names
}

fn assert_none_of(package: &str, deps: &BTreeSet<String>, banned: &[&str]) {
    let found: Vec<&&str> = banned.iter().filter(|b| deps.contains(**b)).collect();
    assert!(found.is_empty(), "{package} depends on {found:?}");
}

#[test]
fn provisionctl_links_nothing_of_the_driver() {
    let deps = normal_deps("provisionctl", &[]);
    assert_none_of(
        "provisionctl",
        &deps,
        &[
            "driver-svc",
            "driver-core",
            "decider",
            "decider-svc",
            "executor-svc",
            "redb",
            "etcd-client",
        ],
    );
    // It does speak the API.
    assert!(deps.contains("provisioning-contract") && deps.contains("tonic"));
}

/// A provider plugin built on the SDK links the protocol and a server, and
/// nothing of the services: an author depends on the SDK alone.
#[test]
fn the_provider_sdk_links_nothing_of_the_services() {
    let deps = normal_deps("provider-sdk", &[]);
    assert_none_of(
        "provider-sdk",
        &deps,
        &[
            "executor-svc",
            "driver-svc",
            "driver-core",
            "decider",
            "decider-svc",
            "redb",
            "etcd-client",
        ],
    );
    assert!(deps.contains("provisioning-contract") && deps.contains("tonic"));
}

#[test]
fn the_pure_cores_link_no_runtime_and_no_wire_stack() {
    let runtime = [
        "tokio",
        "tonic",
        "prost",
        "hyper",
        "tracing",
        "redb",
        "etcd-client",
    ];
    for package in ["driver-core", "decider"] {
        assert_none_of(package, &normal_deps(package, &[]), &runtime);
    }
    let domain = normal_deps("provisioning-contract", &["--no-default-features"]);
    assert_none_of("provisioning-contract (domain types)", &domain, &runtime);
    let others: Vec<&String> = domain
        .iter()
        .filter(|d| !d.starts_with("provisioning-contract") && !d.starts_with("thiserror"))
        .filter(|d| !["proc-macro2", "quote", "syn", "unicode-ident"].contains(&d.as_str()))
        .collect();
    assert!(
        others.is_empty(),
        "the domain types depend only on thiserror: {others:?}"
    );
}

#[test]
fn the_contract_with_its_wire_is_no_service_platform() {
    // The protos and their conversions need the wire stack (tonic brings its
    // own transport: tokio, hyper, rustls), and nothing that runs a service:
    // no flags, no telemetry, no health or reflection, no certificates.
    let wire = normal_deps("provisioning-contract", &[]);
    assert!(wire.contains("tonic") && wire.contains("prost"));
    assert_none_of(
        "provisioning-contract (wire)",
        &wire,
        &[
            "tracing-subscriber",
            "opentelemetry",
            "clap",
            "tonic-health",
            "tonic-reflection",
            "rcgen",
            "serde",
            "provisioning-platform",
        ],
    );
    // The platform is where those live, on top of the contract.
    let platform = normal_deps("provisioning-platform", &[]);
    for needed in [
        "provisioning-contract",
        "opentelemetry",
        "tracing-subscriber",
        "clap",
    ] {
        assert!(platform.contains(needed), "the platform lacks {needed}");
    }
}
