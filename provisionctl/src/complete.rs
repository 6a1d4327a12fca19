//! Dynamic shell completion of run and node names: the shell asks
//! `provisionctl` itself (`COMPLETE=bash provisionctl -- WORDS`, which
//! `provisionctl completions bash` registers), and the names come from the
//! driver the command line being completed would reach (its `--server`,
//! `--context`, `--config`, token and TLS flags, else the environment and the
//! configuration file, as for any command). Nothing is offered when the
//! driver cannot be reached within a second: completion never hangs a shell.

use std::{ffi::OsStr, time::Duration};

use clap::Parser as _;
use clap_complete::engine::CompletionCandidate;

use crate::cli::Cli;

/// The global flags that say how to reach the driver, with a value.
const WITH_VALUE: [&str; 7] = [
    "--server",
    "--context",
    "--config",
    "--token-file",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
];

/// The words of the command line being completed (after the `--` that
/// `CompleteEnv` puts before them).
fn words() -> Vec<String> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == "--") {
        Some(i) => args[i + 1..].to_vec(),
        None => Vec::new(),
    }
}

/// A command line with the words' connection flags and `list`, parsed as
/// the real one would be (environment variables included).
fn connection(words: &[String]) -> Option<Cli> {
    let mut args = vec!["provisionctl".to_owned()];
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        if let Some((flag, _)) = w.split_once('=')
            && (WITH_VALUE.contains(&flag) || flag == "--insecure")
        {
            args.push(w.clone());
        } else if WITH_VALUE.contains(&w.as_str()) && i + 1 < words.len() {
            args.push(w.clone());
            args.push(words[i + 1].clone());
            i += 1;
        } else if w == "--insecure" {
            args.push(w.clone());
        }
        i += 1;
    }
    args.push("list".to_owned());
    Cli::try_parse_from(args).ok()
}

/// The first positional word after `subcommand` (skipping flags and their
/// values): the run a node is completed for.
fn run_after_subcommand(words: &[String]) -> Option<String> {
    let at = words
        .iter()
        .position(|w| matches!(w.as_str(), "explain" | "abandon"))?;
    let mut rest = words[at + 1..].iter();
    while let Some(w) = rest.next() {
        if WITH_VALUE.contains(&w.as_str()) || w == "-o" || w == "--output" {
            rest.next();
        } else if !w.starts_with('-') {
            return Some(w.clone());
        }
    }
    None
}

fn names(run: Option<&str>, words: &[String]) -> Vec<String> {
    let Some(cli) = connection(words) else {
        return Vec::new();
    };
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
        return Vec::new();
    };
    rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(1),
            crate::commands::completion_names(&cli, run),
        )
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default()
    })
}

fn matching(names: Vec<String>, current: &OsStr) -> Vec<CompletionCandidate> {
    let current = current.to_string_lossy();
    let mut names: Vec<String> = names.into_iter().filter(|n| n.starts_with(&*current)).collect();
    names.sort();
    names.into_iter().map(CompletionCandidate::new).collect()
}

/// The runs of the driver the command line reaches.
pub fn runs(current: &OsStr) -> Vec<CompletionCandidate> {
    matching(names(None, &words()), current)
}

/// The nodes of the run the command line names.
pub fn nodes(current: &OsStr) -> Vec<CompletionCandidate> {
    let words = words();
    match run_after_subcommand(&words) {
        Some(run) => matching(names(Some(&run), &words), current),
        None => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn the_run_of_a_node_is_the_word_after_the_subcommand() {
        assert_eq!(
            run_after_subcommand(&w("provisionctl explain demo wor")),
            Some("demo".to_owned())
        );
        assert_eq!(
            run_after_subcommand(&w("provisionctl --server x:1 abandon -o json demo ")),
            Some("demo".to_owned())
        );
        assert_eq!(run_after_subcommand(&w("provisionctl get demo")), None);
    }

    #[test]
    fn connection_flags_are_kept_and_the_rest_dropped() {
        let cli = connection(&w("provisionctl --server 10.0.0.1:7000 --insecure get de")).unwrap();
        assert_eq!(cli.server.as_deref(), Some("10.0.0.1:7000"));
        let cli = connection(&w("provisionctl --context=prod explain demo")).unwrap();
        assert_eq!(cli.context.as_deref(), Some("prod"));
    }
}
