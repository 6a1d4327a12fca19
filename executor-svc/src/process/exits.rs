//! Watching the agents the backend holds (SPEC §8): every live agent, spawned
//! by this executor or found at its start, has a watcher on a pidfd, so its
//! exit is seen at once, whoever is its parent. An exit nobody asked for is a
//! lost resource, reported through the executor's change sink; a destroy
//! stops the agent's watcher before it signals the agent.

use std::{collections::HashMap, os::fd::OwnedFd, sync::Arc, time::Duration};

use contract::{Change, ResourceIdentity};
use rustix::process::{Pid, PidfdFlags, pidfd_open};
use tokio::{
    io::{Interest, unix::AsyncFd},
    task::AbortHandle,
};

use super::{Shared, lock, registry};
use crate::backend::{ChangeSink, RawChange};

/// How long a watcher waits for this process's reaper to say how its own
/// child ended, so the reason names the signal or exit code.
const REAP_WAIT: Duration = Duration::from_secs(1);

/// The watch's state in the backend.
#[derive(Debug, Default)]
pub(super) struct Watches {
    sink: Option<ChangeSink>,
    /// The watcher of each live agent, by PID.
    by_pid: HashMap<i32, AbortHandle>,
}

impl Watches {
    /// Stops every watcher (the backend is going away).
    pub(super) fn stop(&mut self) {
        for (_, w) in self.by_pid.drain() {
            w.abort();
        }
    }
}

/// Starts watching: from now on every agent the backend holds is watched.
/// Agents found dead in the state directory (an exit while no executor
/// watched) are reported lost at once.
pub(super) fn start(shared: &Arc<Shared>, sink: ChangeSink) {
    lock(&shared.watches).sink = Some(sink.clone());
    let entries = match registry::scan(&shared.config.state_dir) {
        Ok(entries) => entries,
        Err(e) => {
            tracing::error!(error = %e, "cannot scan the state directory to watch its agents");
            return;
        }
    };
    for entry in entries {
        let Some(identity) = entry.identity() else {
            continue;
        };
        match (entry.live_pid, entry.agent.as_ref()) {
            (Some(pid), Some(agent)) if agent.pid == pid => {
                agent_held(shared, &identity, pid, Some(agent.start_time));
            }
            // Spawned but never recorded: a create that died with the last
            // executor; the driver's re-issued create adopts or replaces it.
            (Some(_), _) => {}
            (None, _) => {
                let pid = entry.last_pid.map_or_else(String::new, |p| format!(" (pid {p})"));
                report(
                    shared,
                    &sink,
                    identity,
                    format!("the node agent{pid} was not running when the executor started"),
                );
            }
        }
    }
}

/// Agent `pid` holds `identity`'s lease (a create succeeded, or the agent was
/// found at start): watch it, once.
pub(super) fn agent_held(
    shared: &Arc<Shared>,
    identity: &ResourceIdentity,
    pid: i32,
    start_time: Option<u64>,
) {
    let mut watches = lock(&shared.watches);
    let Some(sink) = watches.sink.clone() else {
        return;
    };
    if watches.by_pid.get(&pid).is_some_and(|w| !w.is_finished()) {
        return;
    }
    let fd = match Pid::from_raw(pid).map(|p| pidfd_open(p, PidfdFlags::NONBLOCK)) {
        Some(Ok(fd)) => fd,
        Some(Err(e)) => {
            // ESRCH: it is already gone.
            drop(watches);
            report(
                shared,
                &sink,
                identity.clone(),
                format!("node agent pid {pid} is gone ({e})"),
            );
            return;
        }
        None => return,
    };
    // The pidfd names the process that had `pid` when it was opened; if that
    // is no longer the agent (it died and the PID was reused), it is lost.
    let dir = shared.dir_of(identity);
    if !super::is_the_agent(pid, start_time, &dir) {
        drop(watches);
        report(
            shared,
            &sink,
            identity.clone(),
            format!("node agent pid {pid} is gone"),
        );
        return;
    }
    let task = tokio::spawn(watch_exit(Arc::clone(shared), sink, identity.clone(), pid, fd));
    watches.by_pid.insert(pid, task.abort_handle());
}

/// Agent `pid` is about to be stopped on purpose: its exit is no loss.
pub(super) fn agent_released(shared: &Shared, pid: i32) {
    if let Some(w) = lock(&shared.watches).by_pid.remove(&pid) {
        w.abort();
    }
}

/// The pidfd, registered with the reactor.
#[expect(
    deprecated,
    reason = "an OwnedFd keeps the one descriptor it owns for its whole life, which is all the \
              unsafe register_with_interest asks; the safe constructor is deprecated for types \
              that may not"
)]
fn readable_when_it_exits(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    AsyncFd::with_interest(fd, Interest::READABLE)
}

async fn watch_exit(
    shared: Arc<Shared>,
    sink: ChangeSink,
    identity: ResourceIdentity,
    pid: i32,
    fd: OwnedFd,
) {
    match readable_when_it_exits(fd) {
        // A pidfd turns readable when its process exits.
        Ok(fd) => {
            if let Ok(guard) = fd.readable().await {
                drop(guard);
            }
        }
        Err(e) => {
            tracing::warn!(pid, error = %e, "cannot poll the node agent's pidfd; it is not watched");
            lock(&shared.watches).by_pid.remove(&pid);
            return;
        }
    }
    lock(&shared.watches).by_pid.remove(&pid);
    // Our own child: wait a moment for the reaper to say how it ended.
    let reaped = lock(&shared.children).get(&pid).cloned();
    let how = match reaped {
        Some(mut rx) => tokio::time::timeout(REAP_WAIT, rx.wait_for(Option::is_some))
            .await
            .ok()
            .and_then(|r| r.ok().and_then(|how| (*how).clone())),
        None => None,
    };
    let how = how.unwrap_or_else(|| "exited".to_owned());
    report(&shared, &sink, identity, format!("node agent pid {pid} {how}"));
}

fn report(shared: &Shared, sink: &ChangeSink, identity: ResourceIdentity, reason: String) {
    tracing::warn!(?identity, %reason, "a node agent is lost");
    let _ = sink.send(RawChange {
        identity,
        change: Change::Lost { reason },
        at: shared.clock.now(),
    });
}
