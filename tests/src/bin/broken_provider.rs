//! `broken-provider`: a small in-memory provider plugin for the provider
//! conformance kit's own tests. Without `--defect` it keeps the contract;
//! each defect breaks one clause of it, the way real plugins do:
//!
//! - `definite-failure`: the first create of an identity makes the resource
//!   and then answers `Failed {retryable}` (the leak the protocol's explicit
//!   `Ambiguous` exists to prevent);
//! - `double-create`: every create makes a new resource, also for an
//!   identity that holds one;
//! - `forget-on-restart`: nothing reaches its state file, so a restart loses
//!   every resource it answered `Succeeded` for.
//!
//! Every resource's endpoint is one TCP listener of the plugin's, so an
//! executor's TCP probes find it healthy.

#![forbid(unsafe_code)]

use std::{
    path::PathBuf,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use clap::{Parser, ValueEnum};
use contract::{
    AttemptId, BootstrapStage, Endpoint, LeaseId, LogicalNodeId, NodeTemplate, ResourceIdentity, RunId,
    RunUid, SessionId, UnixMillis,
};
use futures::future::BoxFuture;
use provider_sdk::{Answer, Bootstrap, Call, Events, Info, Provider, Resource, ServeArgs, Testing};

#[derive(Debug, Parser)]
#[command(
    name = "broken-provider",
    about = "A provider plugin with one defect on purpose (a test double)"
)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
    #[arg(long, value_enum, default_value_t = Defect::None)]
    defect: Defect,
    /// Keeps the resources here across restarts (written before a create
    /// is answered).
    #[arg(long)]
    state_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Defect {
    None,
    DefiniteFailure,
    DoubleCreate,
    ForgetOnRestart,
}

#[derive(Debug, Clone)]
struct Held {
    identity: ResourceIdentity,
    lease: String,
    session: Option<String>,
}

#[derive(Default)]
struct State {
    held: Vec<Held>,
    /// Identities whose first create was answered (for `definite-failure`).
    answered: std::collections::BTreeSet<ResourceIdentity>,
    next: u64,
}

#[derive(Clone)]
struct Broken {
    defect: Defect,
    state_file: Option<PathBuf>,
    endpoint: String,
    state: Arc<Mutex<State>>,
    events: Arc<Mutex<Option<Events>>>,
}

fn now() -> UnixMillis {
    UnixMillis::new(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
    )
}

impl Broken {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn events(&self) -> Option<Events> {
        self.events.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// One line per resource: `run_uid run_id node attempt lease`.
    fn persist(&self, state: &State) {
        let Some(path) = &self.state_file else { return };
        if self.defect == Defect::ForgetOnRestart {
            return;
        }
        let text: String = state
            .held
            .iter()
            .map(|h| {
                format!(
                    "{} {} {} {} {}\n",
                    h.identity.run_uid,
                    h.identity.run_id,
                    h.identity.node,
                    h.identity.attempt.get(),
                    h.lease
                )
            })
            .collect();
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, path))
            .is_err()
        {
            eprintln!("broken-provider: cannot write {}", path.display());
        }
    }

    fn load(&self) {
        let Some(path) = &self.state_file else { return };
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        let mut state = self.state();
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            let [uid, run, node, attempt, lease] = f[..] else {
                continue;
            };
            let (Ok(run_uid), Ok(run_id), Ok(node), Ok(attempt)) = (
                RunUid::parse("run_uid", uid),
                RunId::parse("run_id", run),
                LogicalNodeId::parse("node", node),
                attempt.parse::<u64>(),
            ) else {
                continue;
            };
            state.next += 1;
            state.held.push(Held {
                identity: ResourceIdentity {
                    run_uid,
                    run_id,
                    node,
                    attempt: AttemptId::new(attempt),
                },
                lease: lease.to_owned(),
                session: None,
            });
        }
    }
}

impl Provider for Broken {
    fn info(&self) -> Info {
        Info {
            provider_names: vec!["broken".to_owned()],
            reports_health: false,
            reports_loss: true,
            description: format!("a test double with the defect {:?}", self.defect),
        }
    }

    fn start(&self, events: Events) {
        *self.events.lock().unwrap_or_else(PoisonError::into_inner) = Some(events);
    }

    fn create_lease(&self, call: Call, _template: NodeTemplate) -> BoxFuture<'static, Answer<LeaseId>> {
        let mut state = self.state();
        let existing = state
            .held
            .iter()
            .find(|h| h.identity == call.identity)
            .map(|h| h.lease.clone());
        let lease = match existing {
            Some(lease) if self.defect != Defect::DoubleCreate => lease,
            _ => {
                state.next += 1;
                let lease = format!("lease-{}-{}", std::process::id(), state.next);
                state.held.push(Held {
                    identity: call.identity.clone(),
                    lease: lease.clone(),
                    session: None,
                });
                lease
            }
        };
        self.persist(&state);
        let first = state.answered.insert(call.identity.clone());
        let answer = if first && self.defect == Defect::DefiniteFailure {
            Answer::Retryable("out of capacity (it was made all the same)".into())
        } else {
            match LeaseId::new("lease_id", &lease) {
                Ok(l) => Answer::Succeeded(l),
                Err(e) => Answer::Ambiguous(e.to_string()),
            }
        };
        Box::pin(async move { answer })
    }

    fn lookup_endpoint(&self, call: Call, _lease: LeaseId) -> BoxFuture<'static, Answer<Endpoint>> {
        let held = self.state().held.iter().any(|h| h.identity == call.identity);
        let answer = if held {
            match Endpoint::new("endpoint", &self.endpoint) {
                Ok(e) => Answer::Succeeded(e),
                Err(e) => Answer::Ambiguous(e.to_string()),
            }
        } else {
            Answer::Permanent("no such lease".into())
        };
        Box::pin(async move { answer })
    }

    fn start_bootstrap(&self, call: Call, _b: Bootstrap) -> BoxFuture<'static, Answer<SessionId>> {
        let mut state = self.state();
        let Some(h) = state.held.iter_mut().find(|h| h.identity == call.identity) else {
            return Box::pin(async { Answer::Permanent("no such lease".into()) });
        };
        let (session, fresh) = match &h.session {
            Some(s) => (s.clone(), false),
            None => {
                let s = format!("s-{}", h.lease);
                h.session = Some(s.clone());
                (s, true)
            }
        };
        drop(state);
        let Ok(id) = SessionId::new("session_id", &session) else {
            return Box::pin(async { Answer::Ambiguous("a malformed session id".into()) });
        };
        if fresh && let Some(events) = self.events() {
            let identity = call.identity.clone();
            let sid = id.clone();
            tokio::spawn(async move {
                for stage in [
                    BootstrapStage::Connected,
                    BootstrapStage::BootCheck,
                    BootstrapStage::AgentStarted,
                    BootstrapStage::Joined,
                    BootstrapStage::Converged,
                ] {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    events.stage(&identity, &sid, stage, "", now());
                }
            });
        }
        Box::pin(async move { Answer::Succeeded(id) })
    }

    fn cancel_bootstrap(&self, call: Call, _session: Option<SessionId>) -> BoxFuture<'static, Answer<()>> {
        if let Some(h) = self.state().held.iter_mut().find(|h| h.identity == call.identity) {
            h.session = None;
        }
        Box::pin(async { Answer::Succeeded(()) })
    }

    fn destroy_lease(&self, call: Call, _lease: Option<LeaseId>) -> BoxFuture<'static, Answer<()>> {
        let mut state = self.state();
        state.held.retain(|h| h.identity != call.identity);
        self.persist(&state);
        Box::pin(async { Answer::Succeeded(()) })
    }

    fn list(&self) -> BoxFuture<'static, Result<Vec<Resource>, String>> {
        let endpoint = Endpoint::new("endpoint", &self.endpoint).ok();
        let listed: Vec<Resource> = self
            .state()
            .held
            .iter()
            .filter_map(|h| {
                Some(Resource {
                    identity: h.identity.clone(),
                    lease: LeaseId::new("lease_id", &h.lease).ok()?,
                    endpoint: endpoint.clone(),
                    session_live: h.session.is_some(),
                    provider_name: "broken".to_owned(),
                })
            })
            .collect();
        Box::pin(async move { Ok(listed) })
    }

    fn testing(&self) -> Option<Arc<dyn Testing>> {
        Some(Arc::new(self.clone()))
    }
}

impl Testing for Broken {
    fn lose(&self, identity: ResourceIdentity) -> BoxFuture<'static, bool> {
        let mut state = self.state();
        let before = state.held.len();
        state.held.retain(|h| h.identity != identity);
        let found = state.held.len() < before;
        self.persist(&state);
        drop(state);
        if found && let Some(events) = self.events() {
            events.lost(&identity, "lost on request (testing hook)", now());
        }
        Box::pin(async move { found })
    }

    fn set_healthy(&self, _identity: ResourceIdentity, _healthy: bool) -> BoxFuture<'static, bool> {
        // It does not report health: the executor's TCP probe judges it.
        Box::pin(async { false })
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    platform::runtime::exit_code(run().await)
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    platform::runtime::init_logging(cli.serve.log_json);
    // The endpoint every resource shares: a listener that accepts and drops.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = listener.local_addr()?.to_string();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            drop(socket);
        }
    });
    let broken = Broken {
        defect: cli.defect,
        state_file: cli.state_file.clone(),
        endpoint,
        state: Arc::default(),
        events: Arc::default(),
    };
    broken.load();
    let options = cli.serve.options()?;
    provider_sdk::serve(broken, options, platform::runtime::shutdown_signal()).await?;
    Ok(())
}
