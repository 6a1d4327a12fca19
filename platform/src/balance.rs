//! Client-side load sharing over every address a stateless service's
//! replicas answer at: the addresses one name resolves to (the decider
//! behind a headless Kubernetes Service), or several names listed. One
//! HTTP/2 connection to a ClusterIP would carry every call to one replica;
//! here each address has its own channel (with its endpoint's TLS and
//! identity check, against the name it came from), calls take them in turn,
//! and the names are resolved again on an interval so that replicas coming
//! and going are followed.
//!
//! A call that fails in the transport (the replica is down) sets its
//! member aside for a while (1 s, doubling to 30 s while it keeps failing);
//! the next calls go to the others, and to a member set aside only when all
//! are. A bidirectional stream cannot be replayed, so the failed call itself
//! fails; its caller retries as for any unavailable decider.
//!
//! A single name that resolves to one address (an IP literal, `localhost`,
//! a ClusterIP Service) is one member: the same as a plain channel. A name
//! whose resolution fails keeps the addresses it had; with none at all, a
//! call fails `UNAVAILABLE` naming the names and why.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, Mutex, RwLock, Weak,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use http::{Request, Response};
use tokio::time::Instant;
use tonic::body::Body;
use tower::{Service, ServiceExt as _};

use crate::{
    telemetry::grpc::{TracedBody, TracedChannel},
    tls::PeerEndpoint,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a member whose call failed in the transport is set aside: the
/// first time, and at most.
const ASIDE_FIRST: Duration = Duration::from_secs(1);
const ASIDE_MAX: Duration = Duration::from_secs(30);

/// One replica: the name it came from, its channel and how it has done.
#[derive(Debug, Clone)]
struct Member {
    from: usize,
    channel: TracedChannel,
    health: Arc<Mutex<Health>>,
}

#[derive(Debug, Default)]
struct Health {
    /// Transport failures in a row.
    failures: u32,
    /// Set aside until then.
    aside_until: Option<Instant>,
}

impl Health {
    fn available(&self, now: Instant) -> bool {
        self.aside_until.is_none_or(|t| t <= now)
    }

    fn failed(&mut self, now: Instant) {
        self.failures = self.failures.saturating_add(1);
        let aside = ASIDE_FIRST
            .saturating_mul(1_u32 << self.failures.saturating_sub(1).min(5))
            .min(ASIDE_MAX);
        self.aside_until = Some(now + aside);
    }

    fn succeeded(&mut self) {
        self.failures = 0;
        self.aside_until = None;
    }
}

fn lock(health: &Mutex<Health>) -> std::sync::MutexGuard<'_, Health> {
    health.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The replicas' channels, by address.
#[derive(Debug, Default)]
struct Members {
    channels: BTreeMap<SocketAddr, Member>,
    /// Why the last resolution of a name failed, while it does.
    failures: BTreeMap<usize, String>,
}

/// A channel that spreads calls over the addresses of one name (see the
/// module documentation). Clones share the members; the resolution stops
/// once the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Balanced {
    name: Arc<str>,
    members: Arc<RwLock<Members>>,
    next: Arc<AtomicUsize>,
}

impl Balanced {
    /// Resolves the endpoints' hosts now, then every `every` (never again
    /// with `Duration::ZERO`), in a task of the current runtime.
    pub async fn start(endpoints: Vec<PeerEndpoint>, every: Duration) -> Self {
        let names: Vec<String> = endpoints
            .iter()
            .map(|e| {
                let (host, port) = e.host_and_port();
                format!("{host}:{port}")
            })
            .collect();
        let balanced = Self {
            name: Arc::from(names.join(", ")),
            members: Arc::default(),
            next: Arc::default(),
        };
        resolve(&endpoints, &balanced.members).await;
        if !every.is_zero() {
            let members = Arc::downgrade(&balanced.members);
            tokio::spawn(follow(endpoints, members, every));
        }
        balanced
    }

    /// The addresses calls go to now.
    pub fn addresses(&self) -> Vec<SocketAddr> {
        read(&self.members).channels.keys().copied().collect()
    }

    fn pick(&self) -> Result<Member, BoxError> {
        let members = read(&self.members);
        let n = members.channels.len();
        if n == 0 {
            let why: Vec<&str> = members.failures.values().map(String::as_str).collect();
            return Err(Box::new(tonic::Status::unavailable(format!(
                "{} has no address to call: {}",
                self.name,
                if why.is_empty() {
                    "it resolved to none".to_owned()
                } else {
                    why.join("; ")
                }
            ))));
        }
        // In turn from the next one, skipping members set aside unless all are.
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let now = Instant::now();
        let all: Vec<&Member> = members.channels.values().collect();
        let turn = (0..n).map(|k| all[(start + k) % n]);
        let chosen = turn
            .clone()
            .find(|m| lock(&m.health).available(now))
            .or_else(|| all.get(start).copied());
        chosen
            .cloned()
            .ok_or_else(|| Box::new(tonic::Status::unavailable("no member")) as BoxError)
    }
}

fn read(members: &RwLock<Members>) -> std::sync::RwLockReadGuard<'_, Members> {
    members.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Sets the members to the addresses the endpoints' hosts resolve to now:
/// a new address gets a channel, a gone one loses its own (calls on it
/// finish); a name that fails to resolve keeps its addresses.
async fn resolve(endpoints: &[PeerEndpoint], members: &RwLock<Members>) {
    let mut found = Vec::with_capacity(endpoints.len());
    for endpoint in endpoints {
        let (host, port) = endpoint.host_and_port();
        let addrs = tokio::net::lookup_host((host.as_str(), port))
            .await
            .map(|a| a.collect::<Vec<SocketAddr>>());
        found.push((host, addrs));
    }
    let mut m = members.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    for (i, (host, addrs)) in found.into_iter().enumerate() {
        match addrs {
            Ok(addrs) if !addrs.is_empty() => {
                m.failures.remove(&i);
                m.channels
                    .retain(|a, member| member.from != i || addrs.contains(a));
                for addr in addrs {
                    m.channels.entry(addr).or_insert_with(|| Member {
                        from: i,
                        channel: endpoints[i].traced_lazy_to(addr),
                        health: Arc::default(),
                    });
                }
            }
            Ok(_) => {
                m.failures.insert(i, format!("{host} resolved to no address"));
            }
            Err(e) => {
                tracing::warn!(
                    name = %host,
                    error = %e,
                    "resolving failed; its addresses are kept until it resolves again"
                );
                m.failures.insert(i, format!("resolving {host} failed: {e}"));
            }
        }
    }
    tracing::debug!(members = m.channels.len(), "resolved");
}

async fn follow(endpoints: Vec<PeerEndpoint>, members: Weak<RwLock<Members>>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(members) = members.upgrade() else {
            return;
        };
        resolve(&endpoints, &members).await;
    }
}

impl Service<Request<Body>> for Balanced {
    type Response = Response<TracedBody<Body>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Each call waits for its member's readiness in its future.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let picked = self.pick();
        Box::pin(async move {
            let member = picked?;
            match member.channel.oneshot(req).await {
                Ok(response) => {
                    lock(&member.health).succeeded();
                    Ok(response)
                }
                Err(e) => {
                    lock(&member.health).failed(Instant::now());
                    Err(e.into())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::tls::Transport;

    fn endpoints(addrs: &[&str]) -> Vec<PeerEndpoint> {
        addrs
            .iter()
            .map(|a| Transport::Insecure.peer_endpoint(a, "decider-svc").unwrap())
            .collect()
    }

    fn picked(b: &Balanced) -> SocketAddr {
        let m = b.pick().unwrap();
        let members = read(&b.members);
        *members
            .channels
            .iter()
            .find(|(_, x)| Arc::ptr_eq(&x.health, &m.health))
            .unwrap()
            .0
    }

    #[tokio::test]
    async fn calls_take_every_address_in_turn_and_skip_one_set_aside() {
        let b = Balanced::start(
            endpoints(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]),
            Duration::ZERO,
        )
        .await;
        assert_eq!(b.addresses().len(), 3);
        let turn: Vec<SocketAddr> = (0..6).map(|_| picked(&b)).collect();
        assert_eq!(turn[..3], turn[3..], "{turn:?}");
        let mut distinct = turn[..3].to_vec();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 3, "{turn:?}");

        // One fails: it is set aside, and the others take every call.
        let down: SocketAddr = "127.0.0.1:2".parse().unwrap();
        lock(&read(&b.members).channels[&down].health).failed(Instant::now());
        for _ in 0..6 {
            assert_ne!(picked(&b), down);
        }
        // All set aside: calls still go somewhere (the turn's next).
        for m in read(&b.members).channels.values() {
            lock(&m.health).failed(Instant::now());
        }
        let _ = picked(&b);
    }

    #[test]
    fn a_member_is_set_aside_longer_while_it_keeps_failing() {
        let now = Instant::now();
        let mut h = Health::default();
        assert!(h.available(now));
        h.failed(now);
        assert!(!h.available(now));
        assert!(h.available(now + ASIDE_FIRST));
        for _ in 0..10 {
            h.failed(now);
        }
        assert!(!h.available(now + ASIDE_MAX - Duration::from_millis(1)));
        assert!(h.available(now + ASIDE_MAX));
        h.succeeded();
        assert!(h.available(now));
    }

    #[tokio::test]
    async fn a_name_that_resolves_to_nothing_fails_calls_unavailable_naming_it() {
        let b = Balanced::start(endpoints(&["no-such-host.invalid:7001"]), Duration::ZERO).await;
        assert!(b.addresses().is_empty());
        let e = b.pick().err().unwrap();
        let status = e.downcast_ref::<tonic::Status>().unwrap();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(
            status
                .message()
                .starts_with("no-such-host.invalid:7001 has no address to call"),
            "{}",
            status.message()
        );
    }
}
