//! `provisionctl`'s command line: every command, flag and its help.
//!
//! Kept in the library, not the binary, so that shell completions, the help
//! text and the parsing can be tested without spawning a process.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use super::{error::EXIT_CODES_HELP, render::Output};

#[derive(Debug, Parser)]
#[command(
    name = "provisionctl",
    version,
    about = "Declare compute runs, see what the reconciler will do and why, and follow it",
    long_about = None,
    after_help = EXIT_CODES_HELP,
)]
pub struct Cli {
    /// The driver's address: `host:port` (https, or http with --insecure),
    /// or a URL with the matching scheme [default: the context's, else
    /// 127.0.0.1:7000].
    #[arg(long, global = true, env = "PROVISIONCTL_SERVER", value_name = "URL")]
    pub server: Option<String>,
    #[command(flatten)]
    pub tls: super::tls::TlsClientArgs,
    /// A file holding the bearer token to call the server with (the token
    /// may instead be in PROVISIONCTL_TOKEN; `token new` makes one).
    #[arg(long, global = true, env = "PROVISIONCTL_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<std::path::PathBuf>,
    /// The context of the configuration file to use instead of its current
    /// one (flags and environment variables still win over it).
    #[arg(long, global = true, env = "PROVISIONCTL_CONTEXT", value_name = "NAME")]
    pub context: Option<String>,
    /// The configuration file [default: $XDG_CONFIG_HOME/provisionctl/config.yaml,
    /// else ~/.config/provisionctl/config.yaml].
    #[arg(long, global = true, env = "PROVISIONCTL_CONFIG", value_name = "PATH")]
    pub config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

/// The driver's address when neither a flag nor a context gives one.
pub const DEFAULT_SERVER: &str = "127.0.0.1:7000";

#[derive(Debug, Clone, Args)]
pub struct OutputArg {
    /// How to print the answer: table, json, yaml, name (`run/NAME` per
    /// run) or jsonpath=TEMPLATE (kubectl's form, e.g. `jsonpath='{.phase}'`
    /// or `jsonpath='{.runs[*].run_id}'`).
    #[arg(short = 'o', long = "output", value_name = "FORMAT", default_value = "table", value_parser = Output::parse)]
    pub output: Output,
}

#[derive(Debug, Clone, Args)]
pub struct FileArg {
    /// The shape file, YAML or JSON; `-` reads standard input.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: String,
}

#[derive(Debug, Clone, Args)]
pub struct FollowArgs {
    /// Give up after this long (exit 3): `90`, `90s`, `1500ms`, `5m`, `1h`.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub timeout: Option<Duration>,
    /// Plain lines even on a terminal (the default when output is not a terminal).
    #[arg(long, conflicts_with = "live")]
    pub plain: bool,
    /// The in-place view even when output is not a terminal.
    #[arg(long)]
    pub live: bool,
    /// One JSON document per line, each status as it arrives (as `get -o
    /// json` prints it), instead of the view.
    #[arg(long, conflicts_with_all = ["live", "plain"])]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply a shape file: create the run, or move it to the file's shape.
    ///
    /// Without `generation:` in the file, the next generation after the
    /// server's is used (the same one if nothing changed). If the run changes
    /// on the server meanwhile, the apply is refused and nothing changes.
    Apply {
        #[command(flatten)]
        file: FileArg,
        /// Refuse unless the run is at this generation now (0: the run must not exist),
        /// e.g. the one a `plan` was made against.
        #[arg(long, value_name = "GENERATION")]
        expect_generation: Option<u64>,
        /// Then follow the run as `watch` does, with the same exit codes.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        follow: FollowArgs,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Show what applying a shape file would do, field by field and node by
    /// node, without doing it.
    Plan {
        #[command(flatten)]
        file: FileArg,
        /// Exit 0 when applying the file would change nothing, 2 when it
        /// would change the run, 1 on an error (as terraform's).
        #[arg(long)]
        detailed_exitcode: bool,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Show a run: phase, groups, counts by stage (and every node with --nodes).
    Get {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        /// Also list every node with its stage, pending operation and last rule.
        #[arg(long)]
        nodes: bool,
        #[command(flatten)]
        output: OutputArg,
    },
    /// List the runs.
    List {
        /// Only the runs whose labels match: `key=value`, `key!=value`,
        /// `key`, `!key`, comma-separated, all of which must hold.
        #[arg(short = 'l', long = "selector", value_name = "SELECTOR")]
        selector: Option<String>,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Follow a run live until it converges (exit 0) or is deleted (exit 0);
    /// a lost connection to the driver (a restart, a failover) is
    /// reconnected, with backoff, until --timeout.
    Watch {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        #[command(flatten)]
        follow: FollowArgs,
    },
    /// Show a run's event log, oldest first: nodes lost, unhealthy or
    /// replaced, remediation held, permanent failures, dependencies lost and
    /// back, takeovers.
    Events {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        /// Then print each new event as it is recorded (until the run is
        /// deleted, or Ctrl-C); with `-o json`, one JSON object per line.
        #[arg(long, short = 'w', visible_alias = "watch")]
        follow: bool,
        /// Only the latest N events.
        #[arg(long, value_name = "N")]
        tail: Option<usize>,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Describe a run: its phase, conditions and groups, then its recent events.
    Describe {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        /// How many of the latest events to show.
        #[arg(long, value_name = "N", default_value_t = 20)]
        events: usize,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Explain one node: its facts, what it waits for, and the rule that applies now.
    Explain {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        /// The node, `GROUP-INDEX` (e.g. `workers-3`).
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::nodes))]
        node: String,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Delete a run: every node is cleaned up, then the run is gone.
    Delete {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        /// Wait until every node is cleaned up and the run is gone.
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this long (exit 3).
        #[arg(long, value_name = "DURATION", value_parser = parse_duration, requires = "wait")]
        timeout: Option<Duration>,
        /// A run that does not exist is not an error: there is nothing to
        /// delete (exit 0).
        #[arg(long)]
        ignore_not_found: bool,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Pause a run: nothing new is dispatched; operations in flight finish.
    Pause {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Resume a paused run.
    Resume {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        #[command(flatten)]
        output: OutputArg,
    },
    /// A run's rollouts: `rollout status RUN`, `rollout promote RUN GROUP`.
    #[command(subcommand)]
    Rollout(RolloutCommand),
    /// Forget a node whose cleanup fails for good; what it leaves behind is recorded as an orphan.
    Abandon {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::nodes))]
        node: String,
        /// Do not ask for confirmation.
        #[arg(long, short = 'y')]
        yes: bool,
        #[command(flatten)]
        output: OutputArg,
    },
    /// List what abandoned nodes left behind at the provider.
    Orphans {
        #[command(flatten)]
        output: OutputArg,
    },
    /// List the providers the driver's executor serves (the names node
    /// templates choose by `provider.name`), built in or plugins, whether
    /// each answers now, and what it reports itself.
    Providers {
        #[command(flatten)]
        output: OutputArg,
    },
    /// Make bearer tokens for the driver's tokens file (no server involved).
    #[command(subcommand)]
    Token(TokenCommand),
    /// The configuration file's contexts: named ways to reach a driver (no
    /// server involved).
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Write a development CA and certificates for the three services and for
    /// provisionctl (no server involved).
    ///
    /// `provisionctl certs --out certs/` writes `ca.pem`, and `<name>.pem`
    /// with `<name>.key` (owner-only) for decider-svc, executor-svc,
    /// driver-svc and provisionctl. Each certificate's identity is the URI
    /// `spiffe://provisioning/<name>`; the services' are valid for --host.
    Certs {
        /// The directory to write into (created if missing; files already
        /// there are kept unless --force).
        #[arg(long, value_name = "DIR")]
        out: std::path::PathBuf,
        /// A host name or IP address the services' certificates are valid
        /// for (repeat for several).
        #[arg(long = "host", value_name = "HOST", default_values_t = platform::tls::dev::DEFAULT_HOSTS.map(String::from))]
        hosts: Vec<String>,
        /// Also write `<NAME>.pem` and `<NAME>.key` for NAME, like a
        /// service's (for --host, serving and calling): `--also etcd` for
        /// the etcd members the driver replicas use (repeat for several).
        #[arg(long = "also", value_name = "NAME", value_parser = also_name)]
        also: Vec<String>,
        /// How long the certificates are valid, in days.
        #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=3650))]
        days: u32,
        /// Replace certificates and keys already in DIR (a new CA: every
        /// service and client holding the old ones must get the new ones).
        #[arg(long)]
        force: bool,
    },
    /// Print a shell completion script: `provisionctl completions bash > /etc/bash_completion.d/provisionctl`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum RolloutCommand {
    /// Each group's rollout: nodes on the new template and the old, the
    /// budget in use, the canary, and whether (and why) it halted.
    Status {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Let a group's rollout go on past its canary.
    Promote {
        #[arg(add = clap_complete::engine::ArgValueCompleter::new(crate::complete::runs))]
        run: String,
        group: String,
        #[command(flatten)]
        output: OutputArg,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum ConfigCommand {
    /// List the contexts; `*` marks the current one.
    GetContexts,
    /// Print the current context's name.
    CurrentContext,
    /// Make NAME the current context.
    UseContext { name: String },
    /// Create the context NAME, or update it, from the connection flags
    /// given with it (--server, --tls-ca, --tls-cert, --tls-key,
    /// --token-file, --insecure, and their environment variables); the first
    /// context made becomes the current one.
    ///
    /// `provisionctl config set-context prod --server driver:7000 --tls-ca ca.pem --token-file prod.token`
    SetContext { name: String },
    /// Print the configuration file.
    View,
}

#[derive(Debug, Clone, Subcommand)]
pub enum TokenCommand {
    /// Make a fresh random token: its tokens-file entry (name, SHA-256,
    /// access, runs) goes to standard output, the token itself to --save
    /// (or, without it, to standard error, shown once).
    ///
    /// `provisionctl token new ci --access write --save ci.token >> tokens.yaml`
    New {
        /// The token holder's name (in the driver's logs and limits).
        name: String,
        /// `read`: get, list, watch, explain, plan, orphans, providers, events, describe, rollout status;
        /// `write`: those and apply, delete, pause, resume, rollout promote, abandon.
        #[arg(long, value_enum)]
        access: platform::token::Access,
        /// Limit the token to this run (repeat for several); without it,
        /// every run.
        #[arg(long = "run", value_name = "RUN")]
        runs: Vec<String>,
        /// Write the token to this new file (mode 600; never overwritten).
        #[arg(long, value_name = "PATH")]
        save: Option<std::path::PathBuf>,
        /// The token stops being accepted then: an RFC 3339 time
        /// (`2027-01-31T00:00:00Z`), or a duration from now (`30d`, `12h`).
        #[arg(long, value_name = "WHEN")]
        expires: Option<String>,
    },
    /// Print the SHA-256 (hex) of the token on standard input, as the
    /// tokens file keeps it.
    Hash,
}

/// A duration: a number of seconds, or humantime's form (`1500ms`, `1.5s`,
/// `5m`, `1h30m`, `2h 15m`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration: {e} (try 90, 90s, 1500ms, 5m, 1h30m)"))
}

/// A name for `certs --also`: a file stem and an identity's last segment.
fn also_name(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-');
    if !ok {
        return Err("a name of lowercase letters, digits and '-' (at most 63)".to_owned());
    }
    if platform::tls::dev::SERVICES.contains(&s) || s == platform::tls::dev::CLIENT {
        return Err(format!("{s} is written anyway"));
    }
    Ok(s.to_owned())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_parse_with_and_without_units() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2h 15m"), Ok(Duration::from_secs(8100)));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn certs_also_takes_a_plain_new_name() {
        let parsed = Cli::try_parse_from(["provisionctl", "certs", "--out", "x", "--also", "etcd"]).unwrap();
        assert!(matches!(parsed.command, Command::Certs { also, .. } if also == ["etcd"]));
        for bad in ["Etcd", "../etcd", "-x", "driver-svc", "provisionctl", ""] {
            assert!(
                Cli::try_parse_from(["provisionctl", "certs", "--out", "x", "--also", bad]).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn help_lists_the_exit_codes() {
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("Exit codes:") && help.contains("130"), "{help}");
    }

    #[test]
    fn read_commands_take_an_output_format() {
        for args in [
            &["provisionctl", "get", "r", "-o", "yaml"][..],
            &["provisionctl", "list", "-o", "json"],
            &["provisionctl", "explain", "r", "w-0", "-o", "json"],
            &["provisionctl", "plan", "-f", "-", "-o", "json"],
        ] {
            Cli::try_parse_from(args).unwrap();
        }
        assert!(Cli::try_parse_from(["provisionctl", "get", "r", "-o", "xml"]).is_err());
        assert!(Cli::try_parse_from(["provisionctl", "delete", "r", "--timeout", "3"]).is_err());
    }
}
