//! The commands: each talks to the driver's public API and prints through
//! the renderers. Errors come back as [`CliError`], already in the user's
//! words and carrying their exit code.
//!
//! `provisionctl` is a process edge, not part of the driver: its `--timeout`
//! and redraw timers read the machine's monotonic clock directly (the
//! services' injected-clock rule, in their `clippy.toml`, does not apply).

use std::{
    io::{self, IsTerminal, Read, Write},
    time::Duration,
};

use contract::{
    pb::{self, provisioning_client::ProvisioningClient},
    wire::{redacted, shape_from_wire},
};
use serde_json::json;
use tokio::time::Instant;
use tonic::{Code, service::interceptor::InterceptedService, transport::Channel};

use super::{
    cli::{Cli, Command, FollowArgs, RolloutCommand},
    error::{CliError, Doing, Exit, from_change_status, from_status},
    events, explain, plan,
    render::{self, Output},
    text,
    token::BearerToken,
    watch::{Failing, NODE_DETAIL_LIMIT, Painter, is_failing},
};
use crate::{
    config::{self, Config, Context},
    shapefile::{self, Format, ShapeFile, ShapeFileError},
};

/// `provisionctl config ...`: reads and writes the configuration file only.
fn config_command(
    cmd: &super::cli::ConfigCommand,
    cli: &Cli,
    mut config: Config,
    path: Option<&std::path::Path>,
) -> Result<Exit, CliError> {
    use super::cli::ConfigCommand as C;
    let path = || {
        path.ok_or_else(|| {
            CliError::Usage(
                "no configuration file: give --config PATH (or set XDG_CONFIG_HOME or HOME)".to_owned(),
            )
        })
    };
    match cmd {
        C::GetContexts => print_lines(&config.contexts_table())?,
        C::CurrentContext => match &config.current_context {
            Some(name) => print_lines(std::slice::from_ref(name))?,
            None => {
                return Err(CliError::refused(
                    "no current context is set",
                    Some("`provisionctl config use-context NAME` sets one".to_owned()),
                ));
            }
        },
        C::UseContext { name } => {
            config.use_context(name)?;
            config.save(path()?)?;
            print_lines(&[format!("switched to context {name}")])?;
        }
        C::SetContext { name } => {
            let made = config.context(name).is_none();
            config.set_context(Context {
                name: name.clone(),
                server: cli.server.clone(),
                tls_ca: cli.tls.tls_ca.clone(),
                tls_cert: cli.tls.tls_cert.clone(),
                tls_key: cli.tls.tls_key.clone(),
                token_file: cli.token_file.clone(),
                insecure: cli.tls.insecure,
            });
            let file = path()?;
            config.save(file)?;
            print_lines(&[format!(
                "context {name} {} in {}",
                if made { "made" } else { "updated" },
                file.display()
            )])?;
        }
        C::View => {
            let text = serde_yaml_ng::to_string(&config)
                .map_err(|e| CliError::Other(format!("cannot print the configuration: {e}")))?;
            write_bytes(text.as_bytes())?;
        }
    }
    Ok(Exit::Success)
}

type Client = ProvisioningClient<InterceptedService<Channel, BearerToken>>;

/// The live view's fastest redraw.
const LIVE_REDRAW: Duration = Duration::from_millis(100);

/// Runs one command line; the `Exit` is the process's exit code.
pub async fn run(cli: Cli) -> Result<Exit, CliError> {
    if let Command::Certs {
        out,
        hosts,
        also,
        days,
        force,
    } = &cli.command
    {
        return super::tls::write_certs(out, hosts, also, *days, *force);
    }
    if let Command::Token(cmd) = cli.command {
        return super::token::run(cmd);
    }
    let (config, config_path) = load_config(&cli)?;
    if let Command::Config(cmd) = &cli.command {
        return config_command(cmd, &cli, config, config_path.as_deref());
    }
    let ctx = context(&cli, config)?;
    match ctx.dispatch(cli.command).await {
        Err(e) if e.may_be_a_refused_handshake() => Err(ctx.diagnose(e).await),
        done => done,
    }
}

impl Ctx {
    /// Runs a command that calls the server.
    async fn dispatch(&self, command: Command) -> Result<Exit, CliError> {
        let ctx = self;
        match command {
            Command::Apply {
                file,
                expect_generation,
                wait,
                follow,
                output,
            } => {
                if !wait && (follow.timeout.is_some() || follow.plain || follow.live) {
                    // A usage error (exit 2), like any other clap refuses: these
                    // flags shape the follow-up that only --wait starts.
                    return Err(CliError::Usage(
                        "--timeout, --plain and --live apply to following the run: add --wait".to_owned(),
                    ));
                }
                ctx.apply(&file.file, expect_generation, wait, &follow, output.output)
                    .await
            }
            Command::Plan {
                file,
                detailed_exitcode,
                output,
            } => ctx.plan(&file.file, detailed_exitcode, output.output).await,
            Command::Get { run, nodes, output } => ctx.get(&run, nodes, output.output).await,
            Command::List { selector, output } => ctx.list(selector.as_deref(), output.output).await,
            Command::Watch { run, follow } => {
                let started = Instant::now();
                let mut client = ctx.connect().await?;
                // Read through the run's actor first: the watch stream starts from
                // the last published status, which can predate an apply that has
                // just returned, and would then report the old shape converged.
                let Some(now) = ctx.current(&mut client, &run).await? else {
                    let s = tonic::Status::not_found(format!("run {run} not found"));
                    return Err(ctx.status_error(
                        &s,
                        Doing::Run {
                            verb: "watch",
                            run: &run,
                        },
                    ));
                };
                ctx.follow(&mut client, &run, &follow, now.generation, started)
                    .await
            }
            Command::Explain { run, node, output } => ctx.explain(&run, &node, output.output).await,
            Command::Events {
                run,
                follow,
                tail,
                output,
            } => ctx.events(&run, follow, tail, output.output).await,
            Command::Describe { run, events, output } => ctx.describe(&run, events, output.output).await,
            Command::Delete {
                run,
                wait,
                timeout,
                ignore_not_found,
                output,
            } => {
                ctx.delete(&run, wait, timeout, ignore_not_found, output.output)
                    .await
            }
            Command::Pause { run, output } => ctx.set_paused(&run, true, output.output).await,
            Command::Resume { run, output } => ctx.set_paused(&run, false, output.output).await,
            Command::Rollout(RolloutCommand::Status { run, output }) => {
                ctx.rollout_status(&run, output.output).await
            }
            Command::Rollout(RolloutCommand::Promote { run, group, output }) => {
                ctx.promote(&run, &group, output.output).await
            }
            Command::Abandon {
                run,
                node,
                yes,
                output,
            } => ctx.abandon(&run, &node, yes, output.output).await,
            Command::Orphans { output } => ctx.orphans(output.output).await,
            Command::Providers { output } => ctx.providers(output.output).await,
            // Answered above, without a server.
            Command::Token(cmd) => super::token::run(cmd),
            Command::Config(_) => Ok(Exit::Success),
            Command::Certs {
                out,
                hosts,
                also,
                days,
                force,
            } => super::tls::write_certs(&out, &hosts, &also, days, force),
            Command::Completions { shell } => {
                // The script registers `provisionctl` itself as the completer
                // (`COMPLETE=SHELL provisionctl`), which completes flags and
                // subcommands, and run and node names from the driver.
                let name = match shell {
                    clap_complete::Shell::Bash => "bash",
                    clap_complete::Shell::Zsh => "zsh",
                    clap_complete::Shell::Fish => "fish",
                    clap_complete::Shell::Elvish => "elvish",
                    clap_complete::Shell::PowerShell => "powershell",
                    _ => return Err(CliError::Usage(format!("no completion for {shell}"))),
                };
                let exe = std::env::current_exe().map_err(|e| CliError::Other(format!("where am I: {e}")))?;
                let out = std::process::Command::new(&exe)
                    .env("COMPLETE", name)
                    .output()
                    .map_err(|e| CliError::Other(format!("writing the {name} completion: {e}")))?;
                if !out.status.success() {
                    return Err(CliError::Other(format!(
                        "writing the {name} completion: {}",
                        String::from_utf8_lossy(&out.stderr)
                    )));
                }
                write_bytes(&out.stdout)?;
                Ok(Exit::Success)
            }
        }
    }

    /// A failure that a refused TLS handshake may be behind, told as what
    /// the server refused when a second handshake shows it (see
    /// `TlsMaterial::handshake_error`); else the failure as it was.
    async fn diagnose(&self, failure: CliError) -> CliError {
        let Ok(platform::tls::Transport::Tls(material)) = self.tls.transport() else {
            return failure;
        };
        let Ok(endpoint) =
            platform::tls::Transport::Tls(std::sync::Arc::clone(&material)).endpoint(&self.server)
        else {
            return failure;
        };
        let uri = endpoint.uri();
        let Some(host) = uri.host() else {
            return failure;
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        match material
            .handshake_error(host, uri.port_u16().unwrap_or(443))
            .await
        {
            Some(text) => super::error::connection_problem(&[text], &self.server).unwrap_or(failure),
            None => failure,
        }
    }
}

/// Writes to standard output; a closed pipe (`provisionctl get x | head`)
/// ends the output quietly instead of failing the command.
fn write_bytes(b: &[u8]) -> Result<(), CliError> {
    let mut out = io::stdout().lock();
    match out.write_all(b).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(CliError::Other(format!("cannot write the output: {e}"))),
    }
}

fn print_lines(lines: &[String]) -> Result<(), CliError> {
    let mut s = lines.join("\n");
    s.push('\n');
    write_bytes(s.as_bytes())
}

/// The configuration file `cli` names (or the default one, if any), and
/// where it is.
fn load_config(cli: &Cli) -> Result<(Config, Option<std::path::PathBuf>), CliError> {
    let path = cli.config.clone().or_else(config::default_path);
    let config = match &path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    Ok((config, path))
}

/// How to reach the driver: each setting from its flag or environment
/// variable, else from the configuration file's context, else the default.
fn context(cli: &Cli, config: Config) -> Result<Ctx, CliError> {
    let context = config
        .active(cli.context.as_deref())?
        .cloned()
        .unwrap_or_default();
    let server = cli
        .server
        .clone()
        .or(context.server)
        .unwrap_or_else(|| super::cli::DEFAULT_SERVER.to_owned());
    let mut tls = cli.tls.clone();
    tls.tls_ca = tls.tls_ca.or(context.tls_ca);
    if tls.tls_cert.is_none() && tls.tls_key.is_none() {
        tls.tls_cert = context.tls_cert;
        tls.tls_key = context.tls_key;
    }
    tls.insecure = tls.insecure.or(context.insecure);
    let token_file = cli.token_file.clone().or(context.token_file);
    let token = BearerToken::from_args(token_file.as_deref())?;
    super::error::set_reach(super::error::Reach {
        tls_ca: tls.tls_ca.as_ref().map(|p| p.display().to_string()),
        tls_cert: tls.tls_cert.as_ref().map(|p| p.display().to_string()),
        insecure: tls.insecure.unwrap_or(false),
    });
    Ok(Ctx { server, token, tls })
}

/// Shell completion: the runs the driver has (`None`: the node names of
/// `run`), reached as `cli` says. Nothing is printed.
pub async fn completion_names(cli: &Cli, run: Option<&str>) -> Result<Vec<String>, CliError> {
    let ctx = context(cli, load_config(cli)?.0)?;
    match run {
        None => Ok(ctx.runs("").await?.into_iter().map(|r| r.run_id).collect()),
        Some(run) => Ok(ctx
            .run_status(run, true)
            .await?
            .nodes
            .into_iter()
            .filter_map(|n| n.state.map(|s| s.node_id))
            .collect()),
    }
}

/// Sends an idempotent read, again when the server shed it
/// (`RESOURCE_EXHAUSTED`: after the pause its `grpc-retry-pushback-ms` asks
/// for, at most 5 s) or was unavailable for a moment (after 200 ms, then
/// 400 ms); at most four tries. Changes are never sent twice: an unknown
/// outcome is the user's to check.
async fn read<T, Fut>(mut call: impl FnMut() -> Fut) -> Result<T, tonic::Status>
where
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let mut backoff = Duration::from_millis(200);
    let mut tries = 1;
    loop {
        match call().await {
            Ok(r) => return Ok(r.into_inner()),
            Err(s) if tries < 4 && matches!(s.code(), Code::ResourceExhausted | Code::Unavailable) => {
                let asked = super::error::retry_pushback(&s);
                tokio::time::sleep(asked.unwrap_or(backoff).min(Duration::from_secs(5))).await;
                backoff *= 2;
                tries += 1;
            }
            Err(s) => return Err(s),
        }
    }
}

fn print_doc(v: &serde_json::Value, output: Output) -> Result<(), CliError> {
    let text = render::render(v, output).map_err(CliError::Usage)?;
    write_bytes(text.as_bytes())
}

/// A shape file's text, from a path or standard input.
fn read_source(file: &str) -> Result<(String, String), CliError> {
    if file == "-" {
        let mut s = String::new();
        io::stdin().read_to_string(&mut s).map_err(|e| CliError::Read {
            path: "standard input".to_owned(),
            reason: e.to_string(),
        })?;
        Ok(("<stdin>".to_owned(), s))
    } else {
        let s = std::fs::read_to_string(file).map_err(|e| CliError::Read {
            path: file.to_owned(),
            reason: e.to_string(),
        })?;
        Ok((file.to_owned(), s))
    }
}

/// A shape file parsed and checked locally, before any request is sent.
#[derive(Debug)]
struct Loaded {
    name: String,
    text: String,
    file: ShapeFile,
}

impl Loaded {
    fn read(file: &str) -> Result<Self, CliError> {
        let (name, text) = read_source(file)?;
        let parsed = shapefile::parse(&name, &text)?;
        // Checked at a stand-in generation (the file's own, or 1): everything
        // but the generation is known before the server is asked for it, and
        // a bad file must be reported with nothing sent.
        parsed.check(&name, &text, 1)?;
        Ok(Self {
            name,
            text,
            file: parsed,
        })
    }

    fn wire(&self, generation: u64) -> Result<pb::ClusterShape, CliError> {
        Ok(self.file.check(&self.name, &self.text, generation)?)
    }

    /// The server rejected a field the local check let through (a provider
    /// its executor does not serve, or limits stricter than the defaults):
    /// said with the field's place in the file, like a local error.
    fn server_rejection(&self, status: &tonic::Status) -> CliError {
        let msg = status.message();
        let msg = msg.strip_prefix("invalid shape: ").unwrap_or(msg);
        let msg = msg.strip_prefix("shape.").unwrap_or(msg);
        let field = msg.split_whitespace().next().unwrap_or("");
        let problem = msg[field.len()..].trim();
        let located = ShapeFileError::Invalid {
            source_name: self.name.clone(),
            location: shapefile::locate(Format::detect(&self.name, &self.text), &self.text, field),
            field: field.to_owned(),
            problem: problem.to_owned(),
        };
        // Why this client let it through: the server knows what its
        // executor serves, and its limits may be stricter than the defaults.
        let why = if problem.contains("does not serve") {
            " (`provisionctl providers` lists the providers the server's executor serves)"
        } else if problem.contains("limit") {
            " (the server's limits are stricter than the defaults checked here)"
        } else {
            ""
        };
        CliError::refused(
            format!("{located}{why}"),
            Some("the server rejected the shape; nothing was changed".to_owned()),
        )
    }
}

/// Whether two shapes have the same content once secrets are redacted on
/// both sides (the server never sends a secret back, so a change of a secret
/// value alone cannot be seen here; the caller asks the server instead).
fn same_redacted(a: &pb::ClusterShape, b: &pb::ClusterShape) -> bool {
    match (shape_from_wire(redacted(a)), shape_from_wire(redacted(b))) {
        (Ok(a), Ok(b)) => a.same_content(&b),
        _ => false,
    }
}

/// A refused apply or plan, with what is known about the run around it.
#[derive(Debug)]
struct Refusal<'a> {
    run: &'a str,
    source: &'a str,
    verb: &'a str,
    /// The file named its generation (rather than provisionctl choosing).
    explicit: bool,
    /// The generation provisionctl read before sending (`None`: no run).
    read: Option<u64>,
    sent: u64,
    /// The run's generation and phase after the refusal (`None`: gone).
    now: Option<(u64, i32)>,
    server_said: &'a str,
}

/// Says why the server refused, in terms of what happened to the run and
/// what to do next, rather than the revision contract's vocabulary.
fn refusal(r: &Refusal<'_>) -> CliError {
    let Refusal {
        run, source, verb, ..
    } = *r;
    let server_said = format!("(the server said: {})", r.server_said);
    let Some((now, phase)) = r.now else {
        return CliError::refused(
            format!(
                "run {run} disappeared while this {verb} was on its way; nothing was changed {server_said}"
            ),
            Some(format!("run `provisionctl {verb} -f {source}` again")),
        );
    };
    if phase == pb::RunPhase::Deleting as i32 || phase == pb::RunPhase::Deleted as i32 {
        return CliError::refused(
            format!(
                "run {run} is being deleted, and a run that is being deleted takes no new shape; nothing was changed"
            ),
            Some(format!(
                "wait until it is gone (`provisionctl delete {run} --wait`), then apply again to create it afresh"
            )),
        );
    }
    if r.explicit {
        return CliError::refused(
            format!(
                "generation {} in {source} cannot be applied: run {run} is at generation {now}, and a \
                 generation must go up whenever the content changes (a lower one, or the same one with \
                 other content, is refused). Nothing was changed {server_said}",
                r.sent
            ),
            Some(format!(
                "remove `generation:` from the file to let provisionctl pick the next one, or set it above {now}"
            )),
        );
    }
    if r.read == Some(now) {
        return CliError::refused(
            format!("the server refused this {verb} of run {run}; nothing was changed {server_said}"),
            None,
        );
    }
    let was = r.read.map_or_else(
        || "did not exist".to_owned(),
        |g| format!("was at generation {g}"),
    );
    CliError::refused(
        format!(
            "run {run} changed on the server while this {verb} was on its way: it {was} when provisionctl \
             read it and is now at generation {now}. Someone else applied a change; nothing was changed \
             by this {verb} {server_said}"
        ),
        Some(format!(
            "see what the run is now with `provisionctl get {run} -o yaml`, check `provisionctl plan -f \
             {source}`, then apply again"
        )),
    )
}

#[derive(Debug)]
struct Ctx {
    server: String,
    /// Sent on every call (see `client::token`).
    token: BearerToken,
    /// TLS or plaintext, resolved when a command first calls the server.
    tls: super::tls::TlsClientArgs,
}

impl Ctx {
    async fn connect(&self) -> Result<Client, CliError> {
        self.connect_to(&self.server).await
    }

    /// A client of the driver replica that serves `run`: the server asked
    /// answers for a run another replica serves with `FAILED_PRECONDITION`
    /// and that replica's address (`provisioning-owner-address`), which this
    /// follows once.
    async fn connect_run(&self, run: &str) -> Result<Client, CliError> {
        let mut client = self.connect().await?;
        let asked = client
            .get_run(pb::GetRunRequest {
                run_id: run.to_owned(),
                include_nodes: false,
            })
            .await;
        if let Err(s) = asked
            && s.code() == Code::FailedPrecondition
            && let Some(owner) = s
                .metadata()
                .get(contract::metadata::OWNER_ADDRESS)
                .and_then(|v| v.to_str().ok())
        {
            return self.connect_to(owner).await;
        }
        Ok(client)
    }

    async fn connect_to(&self, server: &str) -> Result<Client, CliError> {
        let unreachable = |reason: String| CliError::Unavailable {
            message: format!(
                "cannot reach the server at {server}: {reason}\nis driver-svc running there? \
                 --server or PROVISIONCTL_SERVER sets the address"
            ),
        };
        // `host:port` gets the transport's scheme (https, or http with
        // --insecure); a URL must carry the matching one.
        let transport = self.tls.transport()?;
        let endpoint = transport
            .endpoint(server)
            .map_err(super::tls::tls_error)?
            .connect_timeout(Duration::from_secs(5));
        if matches!(transport, platform::tls::Transport::Insecure)
            && let Some(host) = endpoint.uri().host()
            && super::error::speaks_tls(
                host.trim_start_matches('[').trim_end_matches(']'),
                endpoint.uri().port_u16().unwrap_or(80),
            )
            .await
                == Some(true)
        {
            let texts = [super::error::SPEAKS_TLS.to_owned()];
            if let Some(problem) = super::error::connection_problem(&texts, server) {
                return Err(problem);
            }
        }
        let channel = endpoint.connect().await.map_err(|e| {
            let texts = super::error::chain(&e);
            super::error::connection_problem(&texts, server)
                .unwrap_or_else(|| unreachable(texts.last().cloned().unwrap_or_default()))
        })?;
        Ok(ProvisioningClient::with_interceptor(channel, self.token.clone()))
    }

    fn status_error(&self, s: &tonic::Status, doing: Doing<'_>) -> CliError {
        from_status(s, doing, &self.server)
    }

    /// As `status_error`, for a call that changes something (its outcome
    /// may be unknown).
    fn change_error(&self, s: &tonic::Status, doing: Doing<'_>) -> CliError {
        from_change_status(s, doing, &self.server)
    }

    /// The run's status, or `None` if the server has no such run.
    async fn current(&self, client: &mut Client, run: &str) -> Result<Option<pb::RunStatus>, CliError> {
        match client
            .get_run(pb::GetRunRequest {
                run_id: run.to_owned(),
                include_nodes: false,
            })
            .await
        {
            Ok(r) => Ok(Some(r.into_inner())),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(self.status_error(&s, Doing::Run { verb: "read", run })),
        }
    }

    /// Explains a `FAILED_PRECONDITION` on an apply or a plan in terms of
    /// what happened to the run, asking the server where it is now.
    async fn explain_refusal(
        &self,
        client: &mut Client,
        loaded: &Loaded,
        read: Option<u64>,
        sent: u64,
        status: &tonic::Status,
        verb: &str,
    ) -> CliError {
        let run = loaded.file.run_id.as_str();
        match self.current(client, run).await {
            Ok(now) => refusal(&Refusal {
                run,
                source: &loaded.name,
                verb,
                explicit: loaded.file.generation.is_some(),
                read,
                sent,
                now: now.as_ref().map(|s| (s.generation, s.phase)),
                server_said: status.message(),
            }),
            Err(e) => e,
        }
    }

    async fn apply(
        &self,
        file: &str,
        expect_generation: Option<u64>,
        wait: bool,
        follow: &FollowArgs,
        output: Output,
    ) -> Result<Exit, CliError> {
        let loaded = Loaded::read(file)?;
        let run = loaded.file.run_id.clone();
        let started = Instant::now();
        let mut client = self.connect_run(&run).await?;
        let current = self.current(&mut client, &run).await?;
        let read = current.as_ref().map(|c| c.generation);
        if let Some(expected) = expect_generation {
            let actual = read.unwrap_or(0);
            if actual != expected {
                let now = match read {
                    Some(g) => format!("is at generation {g}"),
                    None => "does not exist".to_owned(),
                };
                return Err(CliError::refused(
                    format!(
                        "run {run} {now}, not at generation {expected} as expected: it changed since. \
                         Nothing was changed"
                    ),
                    Some(format!(
                        "check `provisionctl plan -f {}` against the run as it is now, then apply again",
                        loaded.name
                    )),
                ));
            }
        }
        // The generation: the file's, or the next after the server's. When the
        // content is what the server already has, the same generation is sent
        // so that a repeated apply is a no-op rather than a new generation.
        let (first, fallback) = match (loaded.file.generation, &current) {
            (Some(g), _) => (g, None),
            (None, None) => (1, None),
            (None, Some(cur)) => {
                let next = cur.generation.saturating_add(1);
                let same = cur
                    .shape
                    .as_ref()
                    .is_some_and(|s| same_redacted(s, &loaded.file.to_wire(cur.generation)));
                if same {
                    (cur.generation, Some(next))
                } else {
                    (next, None)
                }
            }
        };
        let mut sent = first;
        let mut result = client
            .apply(pb::ApplyRequest {
                shape: Some(loaded.wire(first)?),
            })
            .await;
        if let (Err(s), Some(next)) = (&result, fallback)
            && s.code() == Code::FailedPrecondition
        {
            // Same content but for secret values, which cannot be compared
            // here: the server said it differs, so it is a change after all.
            sent = next;
            result = client
                .apply(pb::ApplyRequest {
                    shape: Some(loaded.wire(next)?),
                })
                .await;
        }
        let resp = match result {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == Code::FailedPrecondition => {
                return Err(self
                    .explain_refusal(&mut client, &loaded, read, sent, &s, "apply")
                    .await);
            }
            Err(s) if s.code() == Code::InvalidArgument => return Err(loaded.server_rejection(&s)),
            Err(s) => {
                return Err(self.change_error(
                    &s,
                    Doing::Run {
                        verb: "apply",
                        run: &run,
                    },
                ));
            }
        };
        let nodes: i64 = loaded.file.groups.iter().map(|g| g.count).sum();
        match output {
            Output::Table | Output::Wide => {
                let what = if resp.created {
                    format!(
                        "run {run} created at generation {} ({} in {})",
                        resp.generation,
                        text::nodes(usize::try_from(nodes).unwrap_or(0)),
                        text::count(loaded.file.groups.len(), "group")
                    )
                } else if resp.changed {
                    format!(
                        "run {run} updated to generation {} (was {})",
                        resp.generation,
                        read.unwrap_or(0)
                    )
                } else {
                    format!(
                        "run {run} unchanged at generation {}: the server already has this shape",
                        resp.generation
                    )
                };
                print_lines(&[what])?;
            }
            _ => print_doc(
                &json!({
                    "run_id": run, "run_uid": resp.run_uid, "generation": resp.generation,
                    "previous_generation": read, "created": resp.created, "changed": resp.changed,
                }),
                output,
            )?,
        }
        if wait {
            return self
                .follow(&mut client, &run, follow, resp.generation, started)
                .await;
        }
        Ok(Exit::Success)
    }

    async fn plan(&self, file: &str, detailed_exitcode: bool, output: Output) -> Result<Exit, CliError> {
        let loaded = Loaded::read(file)?;
        let run = loaded.file.run_id.clone();
        let mut client = self.connect_run(&run).await?;
        let current = self.current(&mut client, &run).await?;
        let read = current.as_ref().map(|c| c.generation);
        // As apply chooses: the file's generation, or the run's own when the
        // file holds what the run does (an identical file changes nothing),
        // else the next one. A change of a secret value alone cannot be seen
        // here: the server refuses the same generation for it, and the plan
        // is asked again at the next.
        let (mut generation, fallback) = match (loaded.file.generation, &current) {
            (Some(g), _) => (g, None),
            (None, None) => (1, None),
            (None, Some(cur)) => {
                let same = cur
                    .shape
                    .as_ref()
                    .is_some_and(|s| same_redacted(s, &loaded.file.to_wire(cur.generation)));
                if same {
                    (cur.generation, Some(cur.generation.saturating_add(1)))
                } else {
                    (cur.generation.saturating_add(1), None)
                }
            }
        };
        let mut result = client
            .plan(pb::PlanRequest {
                shape: Some(loaded.wire(generation)?),
            })
            .await;
        if let (Err(s), Some(next)) = (&result, fallback)
            && s.code() == Code::FailedPrecondition
        {
            generation = next;
            result = client
                .plan(pb::PlanRequest {
                    shape: Some(loaded.wire(next)?),
                })
                .await;
        }
        let resp = match result {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == Code::FailedPrecondition => {
                return Err(self
                    .explain_refusal(&mut client, &loaded, read, generation, &s, "plan")
                    .await);
            }
            Err(s) if s.code() == Code::InvalidArgument => return Err(loaded.server_rejection(&s)),
            Err(s) => {
                return Err(self.status_error(
                    &s,
                    Doing::Run {
                        verb: "plan",
                        run: &run,
                    },
                ));
            }
        };
        let proposed = loaded.wire(generation)?;
        let changed = read.is_none_or(|g| g != generation);
        let input = plan::PlanInput {
            source: &loaded.name,
            run_id: &run,
            generation,
            current: current.as_ref(),
            proposed: loaded
                .file
                .groups
                .iter()
                .map(|g| (g.id.clone(), g.count))
                .collect(),
            response: &resp,
            changes: plan::field_changes(current.as_ref().and_then(|c| c.shape.as_ref()), &proposed),
            changed,
        };
        match output {
            Output::Table | Output::Wide => print_lines(&plan::plan_table(&input))?,
            _ => print_doc(&plan::plan_json(&input), output)?,
        }
        Ok(if detailed_exitcode && changed {
            Exit::CHANGES
        } else {
            Exit::Success
        })
    }

    /// The run's status, as `get` reads it; with `nodes`, every node read a
    /// page at a time after it.
    async fn run_status(&self, run: &str, nodes: bool) -> Result<pb::RunStatus, CliError> {
        let client = self.connect_run(run).await?;
        let request = pb::GetRunRequest {
            run_id: run.to_owned(),
            include_nodes: false,
        };
        let mut status = read(|| {
            let (mut c, r) = (client.clone(), request.clone());
            async move { c.get_run(r).await }
        })
        .await
        .map_err(|s| self.status_error(&s, Doing::Run { verb: "get", run }))?;
        if nodes {
            status.nodes = self.all_nodes(&client, run).await?;
        }
        Ok(status)
    }

    /// Every node of the run, a page at a time (`ListNodes`: a run of any
    /// size); from a driver that predates pages, in its one status message.
    async fn all_nodes(&self, client: &Client, run: &str) -> Result<Vec<pb::NodeStatus>, CliError> {
        let failed = |s: &tonic::Status| self.status_error(s, Doing::Run { verb: "get", run });
        let mut nodes = Vec::new();
        let mut token = String::new();
        loop {
            let request = pb::ListNodesRequest {
                run_id: run.to_owned(),
                page_size: 0,
                page_token: std::mem::take(&mut token),
            };
            let first = request.page_token.is_empty();
            let page = read(|| {
                let (mut c, r) = (client.clone(), request.clone());
                async move { c.list_nodes(r).await }
            })
            .await;
            match page {
                Ok(page) => {
                    nodes.extend(page.nodes);
                    if page.next_page_token.is_empty() {
                        return Ok(nodes);
                    }
                    token = page.next_page_token;
                }
                Err(s) if first && s.code() == Code::Unimplemented => {
                    let request = pb::GetRunRequest {
                        run_id: run.to_owned(),
                        include_nodes: true,
                    };
                    let whole = read(|| {
                        let (mut c, r) = (client.clone(), request.clone());
                        async move { c.get_run(r).await }
                    })
                    .await
                    .map_err(|s| failed(&s))?;
                    return Ok(whole.nodes);
                }
                Err(s) => return Err(failed(&s)),
            }
        }
    }

    async fn get(&self, run: &str, nodes: bool, output: Output) -> Result<Exit, CliError> {
        let s = self.run_status(run, nodes).await?;
        match output {
            Output::Table | Output::Wide => print_lines(&render::status_table(&s))?,
            _ => print_doc(&render::status_json(&s, true, nodes), output)?,
        }
        Ok(Exit::Success)
    }

    /// The runs whose labels match `selector` (empty: every run).
    async fn runs(&self, selector: &str) -> Result<Vec<pb::RunStatus>, CliError> {
        let client = self.connect().await?;
        let request = pb::ListRunsRequest {
            label_selector: selector.to_owned(),
        };
        Ok(read(|| {
            let (mut c, r) = (client.clone(), request.clone());
            async move { c.list_runs(r).await }
        })
        .await
        .map_err(|s| self.status_error(&s, Doing::Server("list runs")))?
        .runs)
    }

    async fn list(&self, selector: Option<&str>, output: Output) -> Result<Exit, CliError> {
        // Checked here first: a malformed selector is a usage error, sent nowhere.
        if let Some(s) = selector {
            contract::labels::Selector::parse("--selector", s).map_err(|e| CliError::Usage(e.to_string()))?;
        }
        let runs = self.runs(selector.unwrap_or_default()).await?;
        match output {
            Output::Table => print_lines(&render::list_table(&runs, false))?,
            Output::Wide => print_lines(&render::list_table(&runs, true))?,
            _ => print_doc(&render::list_json(&runs), output)?,
        }
        Ok(Exit::Success)
    }

    /// The run's event log, the latest `tail` of it (all kept: `None`).
    async fn event_log(
        &self,
        client: &mut Client,
        run: &str,
        tail: Option<usize>,
    ) -> Result<pb::ListEventsResponse, CliError> {
        let mut log = client
            .list_events(pb::ListEventsRequest {
                run_id: run.to_owned(),
                after_seq: 0,
                limit: 0,
            })
            .await
            .map_err(|s| {
                self.status_error(
                    &s,
                    Doing::Run {
                        verb: "read the events of",
                        run,
                    },
                )
            })?
            .into_inner();
        if let Some(n) = tail {
            let skip = log.events.len().saturating_sub(n);
            log.events.drain(..skip);
        }
        Ok(log)
    }

    async fn events(
        &self,
        run: &str,
        follow: bool,
        tail: Option<usize>,
        output: Output,
    ) -> Result<Exit, CliError> {
        let mut client = self.connect_run(run).await?;
        let log = self.event_log(&mut client, run, tail).await?;
        if !follow {
            match output {
                Output::Table | Output::Wide => print_lines(&events::events_table(&log.events, log.now_ms))?,
                _ => print_doc(&events::events_json(run, &log.events), output)?,
            }
            return Ok(Exit::Success);
        }
        // Followed: one line (or one JSON object) per event, the ones kept
        // first, then each as it is recorded.
        let line = |e: &pb::Event| match output {
            Output::Table | Output::Wide => events::event_line(e),
            _ => events::event_json(e).to_string(),
        };
        print_lines(&log.events.iter().map(line).collect::<Vec<_>>())?;
        let mut stream = client
            .watch_events(pb::WatchEventsRequest {
                run_id: run.to_owned(),
                after_seq: log.last_seq,
            })
            .await
            .map_err(|s| {
                self.status_error(
                    &s,
                    Doing::Run {
                        verb: "follow the events of",
                        run,
                    },
                )
            })?
            .into_inner();
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        loop {
            tokio::select! {
                next = stream.message() => match next {
                    Ok(Some(e)) => print_lines(&[line(&e)])?,
                    // The run was deleted: its log ends with it.
                    Ok(None) => return Ok(Exit::Success),
                    Err(s) => return Err(self.status_error(&s, Doing::Run { verb: "follow the events of", run })),
                },
                _ = &mut ctrl_c => return Err(CliError::Interrupted),
            }
        }
    }

    async fn describe(&self, run: &str, tail: usize, output: Output) -> Result<Exit, CliError> {
        let mut client = self.connect_run(run).await?;
        let s = client
            .get_run(pb::GetRunRequest {
                run_id: run.to_owned(),
                include_nodes: false,
            })
            .await
            .map_err(|s| {
                self.status_error(
                    &s,
                    Doing::Run {
                        verb: "describe",
                        run,
                    },
                )
            })?
            .into_inner();
        let log = self.event_log(&mut client, run, Some(tail)).await?;
        match output {
            Output::Table | Output::Wide => {
                let mut lines = render::status_table(&s);
                lines.push(String::new());
                lines.push(format!(
                    "Events (the latest {tail}; `provisionctl events {run}` shows all kept):"
                ));
                lines.extend(events::events_table(&log.events, log.now_ms));
                print_lines(&lines)?;
            }
            _ => {
                let mut doc = render::status_json(&s, false, false);
                if let Some(map) = doc.as_object_mut() {
                    map.insert(
                        "events".to_owned(),
                        serde_json::Value::Array(log.events.iter().map(events::event_json).collect()),
                    );
                }
                print_doc(&doc, output)?;
            }
        }
        Ok(Exit::Success)
    }

    async fn explain(&self, run: &str, node: &str, output: Output) -> Result<Exit, CliError> {
        check_node_id(run, node)?;
        let client = self.connect_run(run).await?;
        let request = pb::ExplainNodeRequest {
            run_id: run.to_owned(),
            node_id: node.to_owned(),
        };
        let e = read(|| {
            let (mut c, r) = (client.clone(), request.clone());
            async move { c.explain_node(r).await }
        })
        .await
        .map_err(|s| {
            self.status_error(
                &s,
                Doing::Node {
                    verb: "explain",
                    run,
                    node,
                },
            )
        })?;
        match output {
            Output::Table | Output::Wide => print_lines(&explain::explain_text(run, &e))?,
            _ => print_doc(&explain::explain_json(run, &e), output)?,
        }
        Ok(Exit::Success)
    }

    async fn delete(
        &self,
        run: &str,
        wait: bool,
        timeout: Option<Duration>,
        ignore_not_found: bool,
        output: Output,
    ) -> Result<Exit, CliError> {
        let started = Instant::now();
        let mut client = self.connect_run(run).await?;
        let answer = client
            .delete_run(pb::DeleteRunRequest {
                run_id: run.to_owned(),
            })
            .await;
        if ignore_not_found
            && let Err(s) = &answer
            && s.code() == Code::NotFound
        {
            match output {
                Output::Table | Output::Wide => {
                    print_lines(&[format!("run {run} does not exist: nothing to delete")])?
                }
                _ => print_doc(
                    &json!({ "run_id": run, "deleted": false, "found": false }),
                    output,
                )?,
            }
            return Ok(Exit::Success);
        }
        let s = answer
            .map_err(|s| self.change_error(&s, Doing::Run { verb: "delete", run }))?
            .into_inner();
        if output == Output::Table {
            let mut lines = vec![format!(
                "run {run} is being deleted: {} to clean up",
                text::nodes(s.node_count as usize)
            )];
            if s.paused {
                lines.push(format!(
                    "run {run} is paused: nothing is cleaned up until `provisionctl resume {run}`"
                ));
            }
            print_lines(&lines)?;
        }
        if wait && s.paused {
            return Err(CliError::Stalled {
                message: format!(
                    "run {run} is paused, so its cleanup waits: resume it (`provisionctl resume {run}`), then \
                     `provisionctl delete {run} --wait` waits for it to be gone"
                ),
            });
        }
        if !wait {
            if output != Output::Table {
                print_doc(&render::status_json(&s, false, false), output)?;
            }
            return Ok(Exit::Success);
        }
        let deadline = timeout.map(|t| started + t);
        let gone = self.wait_gone(&mut client, run);
        let outcome = tokio::select! {
            r = gone => r,
            () = sleep_until(deadline) => Err(CliError::Timeout {
                message: format!(
                    "run {run} is not gone after {} (`provisionctl watch {run}` follows its cleanup)",
                    text::duration(started.elapsed())
                ),
            }),
            _ = tokio::signal::ctrl_c() => Err(CliError::Interrupted),
        };
        outcome?;
        match output {
            Output::Table | Output::Wide => print_lines(&[format!(
                "run {run} deleted after {}: every node is cleaned up",
                text::duration(started.elapsed())
            )])?,
            _ => print_doc(&json!({ "run_id": run, "deleted": true }), output)?,
        }
        Ok(Exit::Success)
    }

    /// Returns once the server no longer knows the run.
    async fn wait_gone(&self, client: &mut Client, run: &str) -> Result<(), CliError> {
        // The watch stream ends with the run's final status; polling covers a
        // stream that breaks, and confirms the run is really gone.
        if let Ok(r) = client
            .watch_run(pb::WatchRunRequest {
                run_id: run.to_owned(),
                include_nodes: false,
            })
            .await
        {
            let mut stream = r.into_inner();
            while let Ok(Some(s)) = stream.message().await {
                if s.phase == pb::RunPhase::Deleted as i32 {
                    break;
                }
            }
        }
        // While the run's last task winds down the driver can briefly answer
        // UNAVAILABLE for it; that is the run going away, not the server
        // failing, unless it lasts.
        let mut unavailable_since: Option<Instant> = None;
        loop {
            match self.current(client, run).await {
                Ok(None) => return Ok(()),
                Ok(Some(_)) => unavailable_since = None,
                Err(e @ CliError::Unavailable { .. }) => {
                    let since = *unavailable_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > Duration::from_secs(10) {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn rollout_status(&self, run: &str, output: Output) -> Result<Exit, CliError> {
        let s = self.run_status(run, false).await?;
        match output {
            Output::Table | Output::Wide => print_lines(&render::rollout_table(&s))?,
            _ => print_doc(&render::rollouts_json(&s), output)?,
        }
        Ok(Exit::Success)
    }

    async fn promote(&self, run: &str, group: &str, output: Output) -> Result<Exit, CliError> {
        let mut client = self.connect_run(run).await?;
        let req = pb::PromoteRolloutRequest {
            run_id: run.to_owned(),
            group_id: group.to_owned(),
        };
        let s = client
            .promote_rollout(req)
            .await
            .map_err(|s| self.change_error(&s, Doing::Run { verb: "promote", run }))?
            .into_inner();
        match output {
            Output::Table | Output::Wide => print_lines(&[format!(
                "run {run}: the rollout of {group} goes on past its canary"
            )])?,
            _ => print_doc(&render::rollouts_json(&s), output)?,
        }
        Ok(Exit::Success)
    }

    async fn set_paused(&self, run: &str, paused: bool, output: Output) -> Result<Exit, CliError> {
        let mut client = self.connect_run(run).await?;
        let run_id = run.to_owned();
        let verb = if paused { "pause" } else { "resume" };
        let r = if paused {
            client.pause_run(pb::PauseRunRequest { run_id }).await
        } else {
            client.resume_run(pb::ResumeRunRequest { run_id }).await
        };
        let s = r
            .map_err(|s| self.change_error(&s, Doing::Run { verb, run }))?
            .into_inner();
        match output {
            Output::Table | Output::Wide => print_lines(&[if paused {
                format!(
                    "run {run} paused: nothing new is dispatched; operations in flight finish and are \
                     folded. `provisionctl resume {run}` continues"
                )
            } else {
                format!("run {run} resumed ({})", render::phase_text(&s))
            }])?,
            _ => print_doc(&render::status_json(&s, false, false), output)?,
        }
        Ok(Exit::Success)
    }

    async fn abandon(&self, run: &str, node: &str, yes: bool, output: Output) -> Result<Exit, CliError> {
        check_node_id(run, node)?;
        if !yes {
            confirm_abandon(run, node)?;
        }
        let mut client = self.connect_run(run).await?;
        let r = client
            .abandon_node(pb::AbandonNodeRequest {
                run_id: run.to_owned(),
                node_id: node.to_owned(),
            })
            .await
            .map_err(|s| {
                self.change_error(
                    &s,
                    Doing::Node {
                        verb: "abandon",
                        run,
                        node,
                    },
                )
            })?
            .into_inner();
        let orphan = r.orphan.unwrap_or_default();
        match output {
            Output::Table | Output::Wide => {
                let res = orphan.resource.clone().unwrap_or_default();
                print_lines(&[
                    format!("node {node} of run {run} abandoned: the driver no longer manages it"),
                    format!(
                        "recorded as an orphan: lease {}, endpoint {}{} ({})",
                        or_dash(&res.lease_id),
                        or_dash(&res.endpoint),
                        if res.session_live {
                            ", live bootstrap session"
                        } else {
                            ""
                        },
                        orphan.reason
                    ),
                    "`provisionctl orphans` lists what abandoned nodes left behind".to_owned(),
                ])?;
            }
            _ => print_doc(&orphan_json(&orphan), output)?,
        }
        Ok(Exit::Success)
    }

    async fn providers(&self, output: Output) -> Result<Exit, CliError> {
        let client = self.connect().await?;
        let list = read(|| {
            let mut c = client.clone();
            async move { c.list_providers(pb::ListProvidersRequest {}).await }
        })
        .await
        .map_err(|s| self.status_error(&s, Doing::Server("list providers")))?;
        let yes_no = |b: bool| if b { "yes" } else { "no" }.to_owned();
        match output {
            Output::Table | Output::Wide if !list.known => {
                print_lines(&[
                    "not known yet: the driver has not reached its executor since it started".to_owned(),
                ])?;
            }
            Output::Table | Output::Wide => {
                let mut t = text::Table::new(&["NAME", "KIND", "AVAILABLE", "HEALTH", "LOSS", "DETAIL"]);
                for p in &list.providers {
                    t.row(vec![
                        p.name.clone(),
                        p.kind.clone(),
                        yes_no(p.available),
                        if p.reports_health { "reported" } else { "probed" }.to_owned(),
                        if p.reports_loss { "reported" } else { "listed" }.to_owned(),
                        or_dash(&p.detail),
                    ]);
                }
                print_lines(&t.lines())?;
            }
            _ => print_doc(
                &json!({
                    "known": list.known,
                    "providers": list.providers.iter().map(|p| json!({
                        "name": p.name,
                        "kind": p.kind,
                        "available": p.available,
                        "reports_health": p.reports_health,
                        "reports_loss": p.reports_loss,
                        "detail": p.detail,
                    })).collect::<Vec<_>>(),
                }),
                output,
            )?,
        }
        Ok(Exit::Success)
    }

    async fn orphans(&self, output: Output) -> Result<Exit, CliError> {
        let client = self.connect().await?;
        let list = read(|| {
            let mut c = client.clone();
            async move { c.list_orphans(pb::ListOrphansRequest {}).await }
        })
        .await
        .map_err(|s| self.status_error(&s, Doing::Server("list orphans")))?
        .orphans;
        match output {
            Output::Table | Output::Wide => {
                if list.is_empty() {
                    print_lines(&["no orphans".to_owned()])?;
                } else {
                    let mut t = text::Table::new(&["RUN", "NODE", "ATTEMPT", "LEASE", "ENDPOINT", "REASON"]);
                    for o in &list {
                        let r = o.resource.clone().unwrap_or_default();
                        t.row(vec![
                            r.run_id,
                            r.node_id,
                            r.attempt.to_string(),
                            or_dash(&r.lease_id),
                            or_dash(&r.endpoint),
                            o.reason.clone(),
                        ]);
                    }
                    print_lines(&t.lines())?;
                }
            }
            _ => print_doc(
                &json!({ "orphans": list.iter().map(orphan_json).collect::<Vec<_>>() }),
                output,
            )?,
        }
        Ok(Exit::Success)
    }

    /// Opens the watch of `run` again after its stream broke: a fresh
    /// connection (following a redirect to the replica that serves the run
    /// now), retried with backoff from 200 ms to 5 s until `deadline` (or
    /// for a minute without one). `None` when it could not be opened.
    async fn rewatch(
        &self,
        client: &mut Client,
        run: &str,
        reconnects: &mut u32,
        deadline: Option<Instant>,
    ) -> Option<tonic::Streaming<pb::RunStatus>> {
        let give_up = deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(60));
        let mut delay = Duration::from_millis(200);
        if *reconnects == 0 {
            eprintln!("provisionctl: lost the watch of run {run}; reconnecting");
        }
        while Instant::now() + delay < give_up {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(5));
            let Ok(mut fresh) = self.connect_run(run).await else {
                continue;
            };
            let opened = fresh
                .watch_run(pb::WatchRunRequest {
                    run_id: run.to_owned(),
                    include_nodes: false,
                })
                .await;
            if let Ok(stream) = opened {
                *reconnects += 1;
                *client = fresh;
                eprintln!("provisionctl: watching run {run} again");
                return Some(stream.into_inner());
            }
        }
        None
    }

    /// Follows a run until it converges at `generation` or later, or is
    /// deleted (exit 0), the timeout passes (exit 3) or Ctrl-C (exit 130).
    async fn follow(
        &self,
        client: &mut Client,
        run: &str,
        args: &FollowArgs,
        generation: u64,
        started: Instant,
    ) -> Result<Exit, CliError> {
        let live = if args.live {
            true
        } else if args.plain {
            false
        } else {
            io::stdout().is_terminal()
        };
        let width = terminal_width();
        let mut painter = Painter::new(io::stdout(), live, width);
        let deadline = args.timeout.map(|t| started + t);
        let mut stream = client
            .watch_run(pb::WatchRunRequest {
                run_id: run.to_owned(),
                include_nodes: false,
            })
            .await
            .map_err(|s| self.status_error(&s, Doing::Run { verb: "watch", run }))?
            .into_inner();
        // A lost stream (the driver restarted, or the run moved to another
        // replica) is opened again, with backoff, until the deadline.
        let mut reconnects = 0u32;
        let mut latest: Option<pb::RunStatus> = None;
        let mut failing = Failing::Unknown;
        let mut last_fetch: Option<Instant> = None;
        let mut last_draw: Option<Instant> = None;
        // A live view ticks to keep its clock and deadlines moving; plain
        // output changes only with the run, so it ticks just to fetch details.
        let mut tick = tokio::time::interval(if live {
            Duration::from_millis(250)
        } else {
            Duration::from_secs(1)
        });
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let result = loop {
            tokio::select! {
                msg = stream.message() => match msg {
                    Ok(Some(s)) => {
                        let done = (s.converged && s.generation >= generation)
                            || s.phase == pb::RunPhase::Deleted as i32;
                        // Stalled at the generation waited for: nothing more
                        // will happen without a change, so waiting on is
                        // pointless.
                        let stalled = (s.generation >= generation)
                            .then(|| render::condition(&s, "Stalled"))
                            .flatten()
                            .map(|c| c.message.clone());
                        if args.json {
                            print_lines(&[render::status_json(&s, false, false).to_string()])?;
                        }
                        latest = Some(s);
                        if done {
                            break Ok(());
                        }
                        if let Some(message) = stalled {
                            break Err(CliError::Stalled { message });
                        }
                    }
                    Ok(None) => {
                        match self.rewatch(client, run, &mut reconnects, deadline).await {
                            Some(next) => stream = next,
                            None => break Err(CliError::Unavailable {
                                message: format!(
                                    "the server ended the watch of run {run} before it converged, and it \
                                     could not be opened again"
                                ),
                            }),
                        }
                    }
                    Err(s) if reconnectable(&s) => {
                        match self.rewatch(client, run, &mut reconnects, deadline).await {
                            Some(next) => stream = next,
                            None => break Err(self.status_error(&s, Doing::Run { verb: "watch", run })),
                        }
                    }
                    Err(s) => break Err(self.status_error(&s, Doing::Run { verb: "watch", run })),
                },
                _ = tick.tick() => {}
                () = sleep_until(deadline) => {
                    break Err(CliError::Timeout { message: String::new() });
                }
                _ = &mut ctrl_c => break Err(CliError::Interrupted),
            }
            if args.json {
                continue;
            }
            if let Some(s) = &latest {
                let wants_detail = s.groups.iter().any(|g| g.failing > 0);
                if !wants_detail {
                    failing = Failing::Unknown;
                } else if s.node_count >= NODE_DETAIL_LIMIT {
                    failing = Failing::TooLarge;
                } else if last_fetch.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    last_fetch = Some(Instant::now());
                    failing = fetch_failing(client, run).await.unwrap_or(failing);
                }
                // A busy run changes many times a second; a terminal redraw
                // more often than this only flickers.
                if !live || last_draw.is_none_or(|t| t.elapsed() >= LIVE_REDRAW) {
                    last_draw = Some(Instant::now());
                    draw(&mut painter, s, &failing, started.elapsed());
                }
            }
        };
        if let Some(s) = &latest
            && !args.json
        {
            draw(&mut painter, s, &failing, started.elapsed());
        }
        let elapsed = text::duration(started.elapsed());
        match result {
            Ok(()) => {
                let line = match &latest {
                    Some(s) if s.phase == pb::RunPhase::Deleted as i32 => format!("run {run} was deleted"),
                    Some(s) => format!(
                        "run {run} converged after {elapsed}: {}/{} ready at generation {}",
                        s.ready_count,
                        render::desired(s),
                        s.generation
                    ),
                    None => format!("run {run} converged"),
                };
                if args.json {
                    eprintln!("provisionctl: {line}");
                } else {
                    let _ = painter.say(&line);
                }
                Ok(Exit::Success)
            }
            Err(CliError::Timeout { .. }) => Err(CliError::Timeout {
                message: timeout_message(run, latest.as_ref(), &failing, &elapsed),
            }),
            Err(CliError::Stalled { message }) => Err(CliError::Stalled {
                message: format!(
                    "run {run} is stalled after {elapsed}: {message}\n`provisionctl get {run}` shows its conditions; `provisionctl explain {run} NODE` says what a node waits for"
                ),
            }),
            Err(e) => Err(e),
        }
    }
}

/// Whether a broken watch is worth opening again: the connection went (a
/// restart, a failover), not the server saying no.
fn reconnectable(s: &tonic::Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::Unknown | Code::Cancelled)
        && (std::error::Error::source(s).is_some() || s.code() == Code::Unavailable)
}

/// A frame; a terminal that went away must not turn into an error of the run.
fn draw<W: Write>(painter: &mut Painter<W>, s: &pb::RunStatus, failing: &Failing, elapsed: Duration) {
    let _ = painter.draw(s, failing, elapsed);
}

/// What is still missing when a watch gives up, and where to look next.
fn timeout_message(run: &str, s: Option<&pb::RunStatus>, failing: &Failing, elapsed: &str) -> String {
    let Some(s) = s else {
        return format!("run {run}: no status within {elapsed}");
    };
    let mut msg = format!(
        "run {run} did not converge within {elapsed}: {}/{} ready, {} operations pending ({})",
        s.ready_count,
        render::desired(s),
        s.pending_operations,
        render::phase_text(s)
    );
    if let Failing::Nodes { nodes, now_ms } = failing
        && let Some(first) = nodes.first()
    {
        msg.push_str(&format!(
            "\n{} failing, e.g. {}\n`provisionctl explain {run} {}` says why",
            text::nodes(nodes.len()),
            super::watch::failing_line(first, *now_ms),
            first.state.as_ref().map_or("", |st| st.node_id.as_str())
        ));
    } else {
        msg.push_str(&format!(
            "\n`provisionctl get {run} --nodes` shows every node's rule and reason"
        ));
    }
    msg
}

async fn fetch_failing(client: &mut Client, run: &str) -> Option<Failing> {
    let req = client.get_run(pb::GetRunRequest {
        run_id: run.to_owned(),
        include_nodes: true,
    });
    // Bounded so a slow server cannot stall the view (or Ctrl-C).
    let s = tokio::time::timeout(Duration::from_secs(2), req)
        .await
        .ok()?
        .ok()?
        .into_inner();
    let nodes: Vec<pb::NodeStatus> = s.nodes.into_iter().filter(is_failing).collect();
    Some(Failing::Nodes {
        nodes,
        now_ms: s.updated_at_ms,
    })
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn terminal_width() -> usize {
    if let Some((terminal_size::Width(w), _)) = terminal_size::terminal_size() {
        return usize::from(w);
    }
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(120)
}

/// A node id must be `GROUP-INDEX`; said here, before a round trip, in the
/// words of the command rather than as a field error.
fn check_node_id(run: &str, node: &str) -> Result<(), CliError> {
    contract::LogicalNodeId::parse("node", node)
        .map(|_| ())
        .map_err(|_| {
            CliError::refused(
                format!("{node:?} is not a node id: nodes are named GROUP-INDEX, for example workers-3"),
                Some(format!(
                    "`provisionctl get {run} --nodes` lists the nodes of run {run}"
                )),
            )
        })
}

fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".to_owned()
    } else {
        s.to_owned()
    }
}

fn orphan_json(o: &pb::Orphan) -> serde_json::Value {
    let r = o.resource.clone().unwrap_or_default();
    json!({
        "run_id": r.run_id, "run_uid": r.run_uid, "node_id": r.node_id, "attempt": r.attempt,
        "lease_id": r.lease_id, "endpoint": r.endpoint, "session_live": r.session_live,
        "reason": o.reason, "recorded_at_ms": o.recorded_at_ms,
    })
}

/// Abandoning gives up on cleaning a node up, so it asks first: the user
/// types the node's id, on a terminal only (a script passes `--yes`).
fn confirm_abandon(run: &str, node: &str) -> Result<(), CliError> {
    if !io::stdin().is_terminal() {
        return Err(CliError::refused(
            format!(
                "abandoning node {node} of run {run} needs confirmation, and standard input is not a terminal"
            ),
            Some("run it in a terminal, or pass --yes".to_owned()),
        ));
    }
    eprint!(
        "Abandon node {node} of run {run}? The driver stops cleaning it up and forgets it; whatever it \
         still holds at the provider is recorded as an orphan.\nType the node id to confirm: "
    );
    let _ = io::stderr().flush();
    let mut answer = String::new();
    io::stdin().read_line(&mut answer).map_err(|e| CliError::Read {
        path: "standard input".to_owned(),
        reason: e.to_string(),
    })?;
    if answer.trim() == node {
        Ok(())
    } else {
        Err(CliError::refused(
            format!("not confirmed; node {node} was not abandoned"),
            None,
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn redacted_comparison_ignores_the_generation_and_sees_changes() {
        let text = "run_id: demo\ngroups:\n  - id: w\n    count: 2\n    template:\n      image: i\n      provider: { name: fake }\n      join: { t: { value: a, secret: true } }\n";
        let f = shapefile::parse("s.yaml", text).unwrap();
        let mut server = redacted(&f.to_wire(4));
        assert!(same_redacted(&server, &f.to_wire(5)));
        server.groups[0].count = 3;
        assert!(!same_redacted(&server, &f.to_wire(5)));
    }

    #[test]
    fn refusals_say_what_happened_and_what_to_do() {
        let base = Refusal {
            run: "demo",
            source: "shape.yaml",
            verb: "apply",
            explicit: false,
            read: Some(3),
            sent: 4,
            now: Some((4, pb::RunPhase::Progressing as i32)),
            server_said: "generation 4 was already applied with other content",
        };
        let e = refusal(&base);
        assert_eq!(e.exit(), Exit::Failed);
        let m = e.to_string();
        assert!(
            m.contains("changed on the server while this apply was on its way: it was at generation 3")
                && m.contains("now at generation 4")
                && m.contains("nothing was changed")
                && m.contains("provisionctl plan -f shape.yaml"),
            "{m}"
        );
        let m = refusal(&Refusal {
            read: None,
            sent: 1,
            now: Some((1, pb::RunPhase::Progressing as i32)),
            ..base
        })
        .to_string();
        assert!(m.contains("it did not exist when provisionctl read it"), "{m}");
        let m = refusal(&Refusal {
            explicit: true,
            sent: 2,
            ..base
        })
        .to_string();
        assert!(
            m.contains("generation 2 in shape.yaml cannot be applied") && m.contains("above 4"),
            "{m}"
        );
        let m = refusal(&Refusal {
            now: Some((4, pb::RunPhase::Deleting as i32)),
            ..base
        })
        .to_string();
        assert!(
            m.contains("is being deleted") && m.contains("delete demo --wait"),
            "{m}"
        );
        let m = refusal(&Refusal { now: None, ..base }).to_string();
        assert!(m.contains("disappeared"), "{m}");
    }

    #[test]
    fn a_timeout_names_what_is_missing() {
        let s = crate::render::tests::status();
        let failing = Failing::Nodes {
            nodes: vec![crate::render::tests::failing_node()],
            now_ms: 10_000,
        };
        let m = timeout_message("demo", Some(&s), &failing, "30.0s");
        assert!(m.contains("did not converge within 30.0s: 4/6 ready"), "{m}");
        assert!(m.contains("provisionctl explain demo workers-3"), "{m}");
    }
}
