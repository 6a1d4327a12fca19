//! The executor as a host of providers (SPEC.md section 10): built-ins and
//! plugins side by side, each operation routed by its `provider` (the node
//! template's `provider.name`), and the list of what is served, with each
//! plugin's availability, for the drivers.
//!
//! [`Providers`] is itself a [`Backend`]: the executor's shell and core see
//! one backend whatever is behind it. Its inventory is every provider's; a
//! provider that cannot list makes the whole reading fail, so a driver's
//! resync never takes a plugin that is down for resources that are gone.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
};

use contract::{
    Endpoint, Operation, OperationInput, Outcome, ProviderKind, ResourceIdentity, RunUid, ServedProvider,
};
use futures::{
    StreamExt as _,
    future::{BoxFuture, join_all},
    stream::{self, BoxStream},
};
use tokio::sync::watch;

use crate::{
    backend::{Backend, BackendError, ChangeSink, InventoryItem, ObservationSink, tcp_probe},
    plugin::PluginBackend,
};

/// One provider entry: a backend and the names it serves.
struct Entry {
    names: Vec<String>,
    backend: Arc<dyn Backend>,
    kind: ProviderKind,
    reports_health: bool,
    reports_loss: bool,
    detail: String,
    plugin: Option<PluginBackend>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProvidersError {
    #[error("provider name {name:?} is served twice: by {first} and by {second}")]
    Duplicate {
        name: String,
        first: String,
        second: String,
    },
    #[error("no provider is served: give --backend, --plugin or --plugin-command")]
    Empty,
}

/// Builds a [`Providers`].
#[derive(Default)]
pub struct ProvidersBuilder {
    entries: Vec<Entry>,
}

impl std::fmt::Debug for ProvidersBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProvidersBuilder")
            .field("entries", &self.entries.len())
            .finish()
    }
}

impl ProvidersBuilder {
    /// A backend compiled into the executor, served under `name`. Built-ins
    /// report losses themselves and leave health to the executor's probes.
    pub fn builtin(mut self, name: &str, backend: Arc<dyn Backend>) -> Self {
        self.entries.push(Entry {
            names: vec![name.to_owned()],
            backend,
            kind: ProviderKind::Builtin,
            reports_health: false,
            reports_loss: true,
            detail: format!("built into the executor ({name})"),
            plugin: None,
        });
        self
    }

    /// A plugin, served under the names it gave at start.
    pub fn plugin(mut self, plugin: PluginBackend) -> Self {
        let info = plugin.info();
        let detail = if info.description.is_empty() {
            plugin.target().to_string()
        } else {
            format!("{}: {}", plugin.target(), info.description)
        };
        self.entries.push(Entry {
            names: info.provider_names,
            backend: Arc::new(plugin.clone()),
            kind: ProviderKind::Plugin,
            reports_health: info.reports_health,
            reports_loss: info.reports_loss,
            detail,
            plugin: Some(plugin),
        });
        self
    }

    /// The host; an error when two providers claim one name or none is
    /// given. The first entry is the default for an operation that names no
    /// provider (from a driver that predates the field).
    pub fn build(self) -> Result<Providers, ProvidersError> {
        if self.entries.is_empty() {
            return Err(ProvidersError::Empty);
        }
        let mut by_name: HashMap<String, usize> = HashMap::new();
        for (i, entry) in self.entries.iter().enumerate() {
            for name in &entry.names {
                if let Some(&first) = by_name.get(name) {
                    return Err(ProvidersError::Duplicate {
                        name: name.clone(),
                        first: self.entries[first].detail.clone(),
                        second: entry.detail.clone(),
                    });
                }
                by_name.insert(name.clone(), i);
            }
        }
        let entries: Arc<[Entry]> = self.entries.into();
        let (served, _) = watch::channel(served_now(&entries, &vec![true; entries.len()]));
        let providers = Providers {
            entries,
            by_name: Arc::new(by_name),
            holders: Arc::default(),
            served: Arc::new(served),
        };
        providers.follow_availability();
        Ok(providers)
    }
}

fn served_now(entries: &[Entry], available: &[bool]) -> Vec<ServedProvider> {
    let mut served: Vec<ServedProvider> = entries
        .iter()
        .zip(available)
        .flat_map(|(e, &up)| {
            e.names.iter().map(move |name| ServedProvider {
                name: name.clone(),
                kind: e.kind,
                available: up,
                reports_health: e.reports_health,
                reports_loss: e.reports_loss,
                detail: e.detail.clone(),
            })
        })
        .collect();
    served.sort_by(|a, b| a.name.cmp(&b.name));
    served
}

/// Every provider the executor serves, as one [`Backend`]. Cheap to clone.
#[derive(Clone)]
pub struct Providers {
    entries: Arc<[Entry]>,
    by_name: Arc<HashMap<String, usize>>,
    /// Which entry holds each resource, when there are several: for probes,
    /// which carry no provider name.
    holders: Arc<Mutex<HashMap<ResourceIdentity, usize>>>,
    served: Arc<watch::Sender<Vec<ServedProvider>>>,
}

impl std::fmt::Debug for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Providers")
            .field("names", &self.by_name.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Providers {
    pub fn builder() -> ProvidersBuilder {
        ProvidersBuilder::default()
    }

    /// What is served now, as a channel that changes when a plugin goes down
    /// or comes back.
    pub fn served(&self) -> watch::Receiver<Vec<ServedProvider>> {
        self.served.subscribe()
    }

    /// Stops every plugin's supervisor and watch.
    pub async fn shutdown(&self, grace: std::time::Duration) {
        for entry in self.entries.iter() {
            if let Some(plugin) = &entry.plugin {
                plugin.shutdown(grace).await;
            }
        }
    }

    fn follow_availability(&self) {
        let plugins: Vec<(usize, watch::Receiver<bool>)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.plugin.as_ref().map(|p| (i, p.availability())))
            .collect();
        if plugins.is_empty() {
            return;
        }
        let entries = Arc::clone(&self.entries);
        let served = Arc::clone(&self.served);
        tokio::spawn(async move {
            let mut plugins = plugins;
            loop {
                let mut available = vec![true; entries.len()];
                for (i, rx) in &mut plugins {
                    available[*i] = *rx.borrow_and_update();
                }
                let now = served_now(&entries, &available);
                served.send_if_modified(|v| {
                    let changed = *v != now;
                    *v = now;
                    changed
                });
                let changes = plugins.iter_mut().map(|(_, rx)| Box::pin(rx.changed()));
                let (changed, _, _) = futures::future::select_all(changes).await;
                if changed.is_err() {
                    return;
                }
            }
        });
    }

    fn entry_for(&self, provider: &str) -> Option<usize> {
        if provider.is_empty() {
            return Some(0);
        }
        self.by_name.get(provider).copied()
    }

    fn several(&self) -> bool {
        self.entries.len() > 1
    }

    fn holders(&self) -> std::sync::MutexGuard<'_, HashMap<ResourceIdentity, usize>> {
        self.holders.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Backend for Providers {
    fn execute(&self, op: Operation, observations: ObservationSink) -> BoxFuture<'static, Outcome> {
        let Some(i) = self.entry_for(&op.provider) else {
            let served: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
            let reason = format!(
                "no provider named {:?} is served by this executor (served: {})",
                &*op.provider,
                served.join(", ")
            );
            return Box::pin(async move { Outcome::Permanent { reason } });
        };
        if !self.several() {
            return self.entries[i].backend.execute(op, observations);
        }
        // Only what the holder map needs is kept, not the operation.
        let identity = op.identity();
        let destroy = matches!(op.input, OperationInput::DestroyLease { .. });
        let run = self.entries[i].backend.execute(op, observations);
        let holders = Arc::clone(&self.holders);
        Box::pin(async move {
            let out = run.await;
            if matches!(out, Outcome::Succeeded(_)) {
                let mut holders = holders.lock().unwrap_or_else(PoisonError::into_inner);
                if destroy {
                    holders.remove(&identity);
                } else {
                    holders.insert(identity, i);
                }
            }
            out
        })
    }

    fn inventory_of(&self, run_uid: RunUid) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>> {
        match &self.entries[..] {
            [only] => only.backend.inventory_of(run_uid),
            // Several providers: the listing of every one also tells which
            // holds what.
            _ => crate::backend::only_run(self.inventory(), run_uid),
        }
    }

    fn inventory_pages(&self) -> BoxStream<'static, Result<Vec<InventoryItem>, BackendError>> {
        match &self.entries[..] {
            [only] => only.backend.inventory_pages(),
            // Several providers: the listing of every one also tells which
            // holds what.
            _ => stream::once(self.inventory()).boxed(),
        }
    }

    fn inventory(&self) -> BoxFuture<'static, Result<Vec<InventoryItem>, BackendError>> {
        let readings: Vec<_> = self.entries.iter().map(|e| e.backend.inventory()).collect();
        if !self.several() {
            return readings
                .into_iter()
                .next()
                .unwrap_or_else(|| Box::pin(async { Ok(Vec::new()) }));
        }
        let holders = Arc::clone(&self.holders);
        Box::pin(async move {
            let mut all = Vec::new();
            let mut found = HashMap::new();
            for (i, reading) in join_all(readings).await.into_iter().enumerate() {
                for item in reading? {
                    found.insert(item.identity.clone(), i);
                    all.push(item);
                }
            }
            *holders.lock().unwrap_or_else(PoisonError::into_inner) = found;
            Ok(all)
        })
    }

    fn resume(&self, observations: ObservationSink) {
        for entry in self.entries.iter() {
            entry.backend.resume(observations.clone());
        }
    }

    fn watch(&self, changes: ChangeSink) {
        for entry in self.entries.iter() {
            entry.backend.watch(changes.clone());
        }
    }

    fn probe(
        &self,
        identity: &ResourceIdentity,
        endpoint: &Endpoint,
    ) -> BoxFuture<'static, Result<(), String>> {
        if !self.several() {
            return self.entries[0].backend.probe(identity, endpoint);
        }
        let holder = self.holders().get(identity).copied();
        match holder {
            Some(i) => self.entries[i].backend.probe(identity, endpoint),
            None => tcp_probe(endpoint),
        }
    }
}
