//! A built-in backend served as a provider plugin: the other side of
//! [`crate::plugin`]. The `builtin-provider` binary serves the fake or the
//! process backend over the provider protocol through [`BackendProvider`], so
//! an executor can host them out of process exactly as it hosts a third
//! party's plugin, and the provider conformance kit has plugins to check
//! whose behaviour the rest of the tests already pin down.
//!
//! The mapping is one to one: a call becomes the operation the executor
//! would have run in process, and its outcome the answer. Stages and losses
//! the backend reports go to the plugin's [`Events`]. Health is reported by
//! the plugin (`reports_health`): every resource the backend lists is probed
//! with the backend's own probe on an interval, and a change is reported, so
//! a fake resource (which has no socket) and a stopped agent (which still
//! accepts connections) are judged as the executor would judge them in
//! process.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use contract::{
    Clock, Epoch, LeaseId, NodeTemplate, Operation, OperationId, OperationInput, Outcome, ResourceIdentity,
    SessionId, TraceContext, UnixMillis,
};
use futures::future::BoxFuture;
use provider_sdk::{Answer, Bootstrap, Call, Events, Info, Provider, Resource, Testing};
use tokio::sync::mpsc;

use crate::{
    backend::{Backend, ChangeSink, ObservationSink},
    fake_backend::{FakeBackend, ResourceFault},
    process::ProcessBackend,
};

/// How long an operation may take when the call names no deadline.
const DEFAULT_DEADLINE: Duration = Duration::from_secs(60);

/// A [`Backend`] as a [`Provider`].
pub struct BackendProvider {
    name: String,
    description: String,
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    /// How often every held resource is probed for the health reports.
    health_interval: Duration,
    testing: Option<Arc<dyn Testing>>,
    /// Where the backend's stages and changes go once the server started.
    sinks: Mutex<Option<(ObservationSink, ChangeSink)>>,
}

impl std::fmt::Debug for BackendProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendProvider")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl BackendProvider {
    /// `backend` served under `name`.
    pub fn new(name: &str, description: &str, backend: Arc<dyn Backend>, clock: Arc<dyn Clock>) -> Self {
        Self {
            name: name.to_owned(),
            description: description.to_owned(),
            backend,
            clock,
            health_interval: Duration::from_millis(500),
            testing: None,
            sinks: Mutex::new(None),
        }
    }

    /// Probes every held resource this often (default 500 ms).
    pub fn with_health_interval(mut self, interval: Duration) -> Self {
        self.health_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// Serves these testing hooks (with `--testing` only).
    pub fn with_testing(mut self, testing: Arc<dyn Testing>) -> Self {
        self.testing = Some(testing);
        self
    }

    fn operation(&self, call: &Call, input: OperationInput) -> Operation {
        let identity = &call.identity;
        // `a<attempt>.<seq>`: the backends key on the identity; the sequence
        // only names the operation in their logs.
        let seq = call
            .operation_id
            .rsplit_once('.')
            .and_then(|(_, s)| s.parse().ok())
            .unwrap_or(0);
        let deadline = call.deadline.unwrap_or_else(|| {
            UnixMillis::new(
                self.clock
                    .now()
                    .as_millis()
                    .saturating_add(DEFAULT_DEADLINE.as_millis() as u64),
            )
        });
        Operation {
            run_uid: identity.run_uid,
            run_id: identity.run_id.clone(),
            node: identity.node.clone(),
            id: OperationId::new(identity.attempt, seq),
            // The backends do not fence: the executor that calls the plugin
            // does.
            epoch: Epoch::new(0),
            deadline,
            provider: self.name.as_str().into(),
            input,
            trace: TraceContext::default(),
        }
    }

    fn run<T: Send + 'static>(
        &self,
        call: &Call,
        input: OperationInput,
        value: impl FnOnce(contract::ResultFacts) -> Option<T> + Send + 'static,
    ) -> BoxFuture<'static, Answer<T>> {
        let op = self.operation(call, input);
        let sink = self
            .sinks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|(o, _)| o.clone());
        let Some(sink) = sink else {
            return Box::pin(async { Answer::Retryable("the provider is not started yet".into()) });
        };
        let run = self.backend.execute(op, sink);
        Box::pin(async move {
            match run.await {
                Outcome::Succeeded(facts) => match value(facts) {
                    Some(v) => Answer::Succeeded(v),
                    // The backend did it but did not say what it made: the
                    // executor adopts on the ambiguous answer.
                    None => Answer::Ambiguous("the backend succeeded without the result's value".into()),
                },
                Outcome::NotReady { reason } => Answer::NotReady(reason),
                Outcome::Retryable { reason } => Answer::Retryable(reason),
                Outcome::Permanent { reason } => Answer::Permanent(reason),
                Outcome::Ambiguous { reason } => Answer::Ambiguous(reason),
            }
        })
    }
}

impl Provider for BackendProvider {
    fn info(&self) -> Info {
        Info {
            provider_names: vec![self.name.clone()],
            reports_health: true,
            reports_loss: true,
            description: self.description.clone(),
        }
    }

    fn start(&self, events: Events) {
        let (otx, mut orx) = crate::backend::observation_queue();
        let (ctx, mut crx) = mpsc::unbounded_channel();
        let observations = ObservationSink::new(otx, TraceContext::default());
        let changes = ChangeSink::new(ctx);
        self.backend.resume(observations.clone());
        self.backend.watch(changes.clone());
        *self.sinks.lock().unwrap_or_else(PoisonError::into_inner) = Some((observations, changes));
        let stages = events.clone();
        tokio::spawn(async move {
            while let Some(o) = orx.recv().await {
                stages.stage(&o.identity, &o.session, o.stage, o.detail, o.at);
            }
        });
        let losses = events.clone();
        tokio::spawn(async move {
            while let Some(c) = crx.recv().await {
                match c.change {
                    contract::Change::Lost { reason } => losses.lost(&c.identity, reason, c.at),
                    // Health is probed and reported by `report_health`.
                    contract::Change::Health { .. } => {}
                }
            }
        });
        tokio::spawn(report_health(
            Arc::clone(&self.backend),
            Arc::clone(&self.clock),
            events,
            self.health_interval,
        ));
    }

    fn create_lease(&self, call: Call, template: NodeTemplate) -> BoxFuture<'static, Answer<LeaseId>> {
        self.run(
            &call,
            OperationInput::CreateLease {
                template: Arc::new(template),
            },
            |f| f.lease,
        )
    }

    fn lookup_endpoint(&self, call: Call, lease: LeaseId) -> BoxFuture<'static, Answer<contract::Endpoint>> {
        self.run(&call, OperationInput::LookupEndpoint { lease }, |f| f.endpoint)
    }

    fn start_bootstrap(&self, call: Call, b: Bootstrap) -> BoxFuture<'static, Answer<SessionId>> {
        self.run(
            &call,
            OperationInput::StartBootstrap {
                lease: b.lease,
                endpoint: b.endpoint,
                boot: b.boot,
                join: b.join,
            },
            |f| f.session,
        )
    }

    fn cancel_bootstrap(&self, call: Call, session: Option<SessionId>) -> BoxFuture<'static, Answer<()>> {
        self.run(&call, OperationInput::CancelBootstrap { session }, |_| Some(()))
    }

    fn destroy_lease(&self, call: Call, lease: Option<LeaseId>) -> BoxFuture<'static, Answer<()>> {
        self.run(&call, OperationInput::DestroyLease { lease }, |_| Some(()))
    }

    fn list(&self) -> BoxFuture<'static, Result<Vec<Resource>, String>> {
        let reading = self.backend.inventory();
        let name = self.name.clone();
        Box::pin(async move {
            let items = reading.await.map_err(|e| e.to_string())?;
            Ok(items
                .into_iter()
                // A resource whose lease is not known yet is not listed: a
                // create that ends ambiguous is adopted by the next one.
                .filter_map(|i| {
                    Some(Resource {
                        identity: i.identity,
                        lease: i.lease?,
                        endpoint: i.endpoint,
                        session_live: i.session_live,
                        provider_name: name.clone(),
                    })
                })
                .collect())
        })
    }

    fn testing(&self) -> Option<Arc<dyn Testing>> {
        self.testing.clone()
    }
}

/// Probes every resource the backend holds, each interval, and reports a
/// resource's health when it is first known and whenever it changes.
async fn report_health(backend: Arc<dyn Backend>, clock: Arc<dyn Clock>, events: Events, interval: Duration) {
    let mut known: HashMap<ResourceIdentity, bool> = HashMap::new();
    loop {
        if let Ok(items) = backend.inventory().await {
            let probes: Vec<_> = items
                .iter()
                .filter_map(|i| {
                    let endpoint = i.endpoint.as_ref()?;
                    let probe = backend.probe(&i.identity, endpoint);
                    Some(async move {
                        let result =
                            match tokio::time::timeout(interval.max(Duration::from_millis(200)), probe).await
                            {
                                Ok(r) => r,
                                Err(_) => Err("the probe timed out".to_owned()),
                            };
                        (i.identity.clone(), result)
                    })
                })
                .collect();
            let results = futures::future::join_all(probes).await;
            let now = clock.now();
            let mut seen = HashMap::with_capacity(results.len());
            for (identity, result) in results {
                let healthy = result.is_ok();
                if known.get(&identity) != Some(&healthy) {
                    events.health(&identity, healthy, result.err().unwrap_or_default(), now);
                }
                seen.insert(identity, healthy);
            }
            known = seen;
        }
        tokio::time::sleep(interval).await;
    }
}

/// The fake backend's testing hooks: its control service's faults.
#[derive(Debug, Clone)]
pub struct FakeTesting(pub FakeBackend);

impl Testing for FakeTesting {
    fn lose(&self, identity: ResourceIdentity) -> BoxFuture<'static, bool> {
        let done = self
            .0
            .apply_fault(
                identity.run_uid,
                &identity.node,
                identity.attempt,
                ResourceFault::Lose,
            )
            .is_ok();
        Box::pin(async move { done })
    }

    fn set_healthy(&self, identity: ResourceIdentity, healthy: bool) -> BoxFuture<'static, bool> {
        let fault = if healthy {
            ResourceFault::Heal
        } else {
            ResourceFault::Sicken
        };
        let done = self
            .0
            .apply_fault(identity.run_uid, &identity.node, identity.attempt, fault)
            .is_ok();
        Box::pin(async move { done })
    }
}

/// The process backend's testing hooks, as the real world does it to an
/// agent: lost is SIGKILL, sick is SIGSTOP (it stops answering its pings),
/// healthy again is SIGCONT.
#[derive(Clone, Debug)]
pub struct ProcessTesting(pub ProcessBackend);

impl ProcessTesting {
    fn signal(&self, identity: &ResourceIdentity, signal: rustix::process::Signal) -> bool {
        let Ok(agents) = self.0.agents() else {
            return false;
        };
        agents
            .iter()
            .filter(|a| a.identity().as_ref() == Some(identity))
            .filter_map(|a| a.live_pid.and_then(rustix::process::Pid::from_raw))
            .any(|pid| rustix::process::kill_process(pid, signal).is_ok())
    }
}

impl Testing for ProcessTesting {
    fn lose(&self, identity: ResourceIdentity) -> BoxFuture<'static, bool> {
        let done = self.signal(&identity, rustix::process::Signal::KILL);
        Box::pin(async move { done })
    }

    fn set_healthy(&self, identity: ResourceIdentity, healthy: bool) -> BoxFuture<'static, bool> {
        let signal = if healthy {
            rustix::process::Signal::CONT
        } else {
            rustix::process::Signal::STOP
        };
        let done = self.signal(&identity, signal);
        Box::pin(async move { done })
    }
}
