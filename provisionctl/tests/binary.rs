//! The `provisionctl` binary at its process edges, with no server: what it
//! prints and the exit codes it ends with. (The commands against a real
//! driver are `tests/tests/provisionctl.rs`; this target also makes
//! `cargo test --workspace` build the binary those tests run.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::Write as _,
    process::{Command, Output, Stdio},
};

fn provisionctl(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_provisionctl"))
        .args(args)
        .env_remove("PROVISIONCTL_TOKEN")
        .env_remove("PROVISIONCTL_TOKEN_FILE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn token_hash_prints_the_hash_the_tokens_file_keeps() {
    let token = "prov_0123456789abcdef";
    let out = provisionctl(&["token", "hash"], &format!("{token}\n"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8(out.stdout).unwrap();
    let want = platform::token::to_hex(&platform::token::hash_token(token));
    assert_eq!(printed.trim(), want);
}

#[test]
fn token_hash_without_a_token_fails_saying_so() {
    let out = provisionctl(&["token", "hash"], "  \n");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no token on standard input"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_usage_error_exits_2_and_help_exits_0() {
    let bad = provisionctl(&["no-such-command"], "");
    assert_eq!(
        bad.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    let help = provisionctl(&["--help"], "");
    assert!(help.status.success());
    let text = String::from_utf8(help.stdout).unwrap();
    for command in ["apply", "get", "watch", "token"] {
        assert!(text.contains(command), "--help names `{command}`: {text}");
    }
}

/// Boolean environment variables take the usual spellings: with
/// `PROVISIONCTL_INSECURE` true in any of them the client goes on in
/// plaintext (to an unreachable server: exit 4); false in any of them it
/// asks for TLS settings; anything else is a usage error naming the value.
#[test]
fn boolean_environment_variables_take_the_usual_spellings() {
    let run = |value: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_provisionctl"))
            .args(["--server", "127.0.0.1:1", "get", "r"])
            .env("PROVISIONCTL_INSECURE", value)
            .env_remove("PROVISIONCTL_TOKEN")
            .env_remove("PROVISIONCTL_TOKEN_FILE")
            .env_remove("PROVISIONCTL_TLS_CA")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for value in ["1", "true", "yes", "on", "TRUE"] {
        let (code, stderr) = run(value);
        assert_eq!(code, Some(4), "{value}: {stderr}");
    }
    for value in ["0", "false", "no", "off"] {
        let (code, stderr) = run(value);
        assert_eq!(code, Some(2), "{value}: {stderr}");
        assert!(stderr.contains("no TLS settings"), "{value}: {stderr}");
    }
    let (code, stderr) = run("maybe");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("maybe"), "{stderr}");
}
