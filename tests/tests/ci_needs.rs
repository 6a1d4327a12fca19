//! `.ci/needs` names every program the workspace's code runs by name, so a
//! machine missing one fails at CI's first step, naming its package, instead
//! of deep in a build script or a test (a fresh machine once lacked
//! protobuf's well-known types that a developer's machine had).
//!
//! The programs are found in the source: `Command::new("...")` and the
//! `let tool = "..."` form the tool checks use. The workspace's own binaries
//! are started by path (`procs::bin_path`) and are not programs from outside.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// The names `.ci/needs` lists: the first word of each need's name.
fn listed(needs: &str) -> BTreeSet<String> {
    let start = needs.find("NEEDS=(").expect("a NEEDS array in .ci/needs");
    let body = &needs[start..];
    let end = body.find("\n)").expect("the NEEDS array ends");
    body[..end]
        .lines()
        .skip(1)
        .filter_map(|l| l.trim().strip_prefix('"'))
        .filter_map(|l| l.split('|').next())
        .filter_map(|name| name.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// Every program named in the `.rs` files under `dir`, with where.
fn programs(dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "fuzz") {
                programs(&path, out);
            }
        } else if name.ends_with(".rs") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for program in named_programs(&text) {
                out.push((program, path.clone()));
            }
        }
    }
}

/// The programs a source text runs by name.
fn named_programs(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for marker in ["Command::new(\"", "let tool = \""] {
        let mut rest = text;
        while let Some(at) = rest.find(marker) {
            rest = &rest[at + marker.len()..];
            if let Some(end) = rest.find('"') {
                let program = &rest[..end];
                // `/usr/bin/etcd` is the program `etcd`; a placeholder
                // (`"..."` in a comment) is none.
                let base = program.rsplit('/').next().unwrap_or(program);
                if base.starts_with(|c: char| c.is_ascii_alphanumeric()) {
                    found.push(base.to_owned());
                }
            }
        }
    }
    found
}

#[test]
fn every_program_the_code_runs_is_in_ci_needs() {
    let needs = std::fs::read_to_string(root().join(".ci/needs")).expect(".ci/needs");
    let listed = listed(&needs);
    for expected in ["protoc", "protobuf", "etcd", "promtool", "kubernetes-validate"] {
        assert!(
            listed.contains(expected),
            "{expected} is not in .ci/needs: {listed:?}"
        );
    }
    let mut found = Vec::new();
    programs(&root(), &mut found);
    assert!(
        found.iter().any(|(p, _)| p == "etcd") && found.iter().any(|(p, _)| p == "promtool"),
        "the scan finds the programs the tests are known to run: {found:?}"
    );
    let missing: Vec<String> = found
        .iter()
        .filter(|(p, _)| !listed.contains(p))
        .map(|(p, at)| format!("{p} (run in {})", at.display()))
        .collect();
    assert!(
        missing.is_empty(),
        "programs run by name but not in .ci/needs (add a line with its check and package): {missing:?}"
    );
}

#[test]
fn ci_installs_the_needs_before_it_builds() {
    for script in [".ci/run", ".ci/test"] {
        let text = std::fs::read_to_string(root().join(script)).expect(script);
        let needs = text.find("\n.ci/needs --install").unwrap_or(usize::MAX);
        let cargo = text.find("\ncargo ").unwrap_or(usize::MAX);
        assert!(needs < cargo, "{script} runs .ci/needs --install before cargo");
    }
    let run = std::fs::read_to_string(root().join(".ci/run")).expect(".ci/run");
    assert!(
        run.contains("\n.ci/test\n"),
        ".ci/run runs the README's test command, .ci/test"
    );
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    assert!(
        readme.contains("\n.ci/test\n"),
        "the README gives .ci/test as the test command"
    );
}

#[test]
fn the_scan_reads_both_forms_and_a_path() {
    let text = r#"let a = Command::new("promtool"); let tool = "kubernetes-validate";
        Command::new("/usr/bin/etcd"); Command::new(bin_path("driver-svc")); Command::new("...")"#;
    assert_eq!(named_programs(text), ["promtool", "etcd", "kubernetes-validate"]);
}
