//! Write a provider plugin in Rust: implement [`Provider`], call [`serve`].
//!
//! A provider plugin is a process that serves the provider protocol
//! (`proto/provisioning/provider/v1/provider.proto`, SPEC.md section 10) so
//! that an executor can create, bootstrap and destroy resources through it.
//! The proto's comments are the contract; this crate keeps the parts of it
//! that are the same for every plugin, so an implementation only says what
//! its provider does:
//!
//! - the gRPC server, over TCP (TLS, or plaintext behind `--insecure`) or a
//!   Unix socket, and the announcement line (`provider-listening <address>`)
//!   on standard output once it listens;
//! - graceful shutdown on SIGTERM or SIGINT;
//! - a call whose deadline has passed, a call still running at its deadline,
//!   and a call that panics are answered [`Answer::Ambiguous`]: never a
//!   definite failure the plugin cannot vouch for;
//! - malformed requests are refused `INVALID_ARGUMENT` naming the field,
//!   before the provider sees them;
//! - [`Events`]: the stages, losses and health changes the provider reports,
//!   sent to every open `Watch` stream, with the latest stage of each live
//!   session and each resource's health sent first to a stream that opens.
//!
//! What stays the provider's: the identity is the idempotency key (create
//! adopts, absent is success), an outcome it is unsure of is ambiguous, and
//! everything it answered `Succeeded` for is listed after its own restart.

#![forbid(unsafe_code)]

mod events;
mod serve;
mod server;
pub mod wire;

use std::sync::Arc;

pub use contract::{
    BootstrapStage, Endpoint, LeaseId, NodeTemplate, Params, ResourceIdentity, SessionId, UnixMillis,
};
pub use events::Events;
use futures::future::BoxFuture;
pub use serve::{Listen, ServeArgs, ServeError, ServeOptions, announce_line, announced_address, serve};

/// The protocol version this crate speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// The first word of the line a plugin writes on standard output once it
/// listens: `provider-listening <address>`.
pub const ANNOUNCEMENT: &str = "provider-listening";

/// How one call ended (the proto's `Answer`), with a success's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer<T> {
    /// The effect happened (or had already happened).
    Succeeded(T),
    /// The resource exists but is not ready for this yet; asked again later.
    NotReady(String),
    /// Nothing happened and nothing was left behind; trying again may work.
    Retryable(String),
    /// Nothing happened and nothing was left behind; the same input never
    /// will work.
    Permanent(String),
    /// The provider does not know whether the effect happened.
    Ambiguous(String),
}

impl<T> Answer<T> {
    /// The same answer with the success's value mapped.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Answer<U> {
        match self {
            Answer::Succeeded(v) => Answer::Succeeded(f(v)),
            Answer::NotReady(r) => Answer::NotReady(r),
            Answer::Retryable(r) => Answer::Retryable(r),
            Answer::Permanent(r) => Answer::Permanent(r),
            Answer::Ambiguous(r) => Answer::Ambiguous(r),
        }
    }

    /// The proto's name for the answer's class.
    pub fn class_name(&self) -> &'static str {
        match self {
            Answer::Succeeded(_) => "succeeded",
            Answer::NotReady(_) => "not-ready",
            Answer::Retryable(_) => "failed-retryable",
            Answer::Permanent(_) => "failed-permanent",
            Answer::Ambiguous(_) => "ambiguous",
        }
    }
}

/// What travels with every operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The idempotency key: one identity, at most one resource.
    pub identity: ResourceIdentity,
    /// The executor's id of the operation (a retry of the same operation
    /// carries the same id); for logs.
    pub operation_id: String,
    /// When the executor stops waiting for the answer. [`serve`] answers
    /// ambiguous for the provider if it has not answered by then.
    pub deadline: Option<UnixMillis>,
    /// The provider name the node's template chose.
    pub provider_name: String,
}

/// What a bootstrap session starts with.
#[derive(Debug, Clone, PartialEq)]
pub struct Bootstrap {
    pub lease: LeaseId,
    pub endpoint: Endpoint,
    pub boot: Params,
    pub join: Params,
}

/// A resource the provider holds, as `ListResources` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    pub identity: ResourceIdentity,
    pub lease: LeaseId,
    /// Known once the endpoint is bound.
    pub endpoint: Option<Endpoint>,
    /// A bootstrap session exists (neither cancelled nor destroyed).
    pub session_live: bool,
    /// The provider name the resource was created for.
    pub provider_name: String,
}

/// What a plugin says of itself (`GetInfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    /// The `provider.name` values it serves; at least one.
    pub provider_names: Vec<String>,
    /// It reports health changes through [`Events::health`]; without it the
    /// executor probes endpoints itself.
    pub reports_health: bool,
    /// It reports losses through [`Events::lost`] as soon as it knows.
    pub reports_loss: bool,
    /// Free text for operators.
    pub description: String,
}

/// A provider, as a plugin implements it. Every method is keyed on the call's
/// identity and must be safe to call again (see the proto's contract).
/// Futures are `'static`: clone what they need out of `self`.
pub trait Provider: Send + Sync + 'static {
    /// What this plugin serves.
    fn info(&self) -> Info;

    /// Called once before the server listens: keep `events` to report
    /// bootstrap stages, losses and health changes (and, after a restart,
    /// the stages of the sessions found running).
    fn start(&self, _events: Events) {}

    /// Makes the identity's resource, or adopts the one it already holds.
    fn create_lease(&self, call: Call, template: NodeTemplate) -> BoxFuture<'static, Answer<LeaseId>>;

    /// The resource's endpoint; [`Answer::NotReady`] until it is bound.
    fn lookup_endpoint(&self, call: Call, lease: LeaseId) -> BoxFuture<'static, Answer<Endpoint>>;

    /// Starts the identity's bootstrap session, or adopts its live one.
    fn start_bootstrap(&self, call: Call, bootstrap: Bootstrap) -> BoxFuture<'static, Answer<SessionId>>;

    /// Ends the identity's session (`None`: whatever it is); absent is
    /// success.
    fn cancel_bootstrap(&self, call: Call, session: Option<SessionId>) -> BoxFuture<'static, Answer<()>>;

    /// Destroys the identity's resource (`None`: whatever it holds); absent
    /// is success.
    fn destroy_lease(&self, call: Call, lease: Option<LeaseId>) -> BoxFuture<'static, Answer<()>>;

    /// Every resource it holds. `Err` when it cannot tell now (the executor
    /// then concludes nothing from this reading).
    fn list(&self) -> BoxFuture<'static, Result<Vec<Resource>, String>>;

    /// The testing hooks ([`Testing`]), served only with
    /// [`ServeOptions::testing`].
    fn testing(&self) -> Option<Arc<dyn Testing>> {
        None
    }
}

/// A plugin's testing hooks (`ProviderTesting`): make one resource lost or
/// sick the way the real world would, for a conformance kit. A test double's
/// controls, never served in production.
pub trait Testing: Send + Sync + 'static {
    /// Makes the resource disappear without a destroy; `false` when the
    /// identity holds none.
    fn lose(&self, identity: ResourceIdentity) -> BoxFuture<'static, bool>;

    /// Makes the resource fail (or pass again) its health checks.
    fn set_healthy(&self, identity: ResourceIdentity, healthy: bool) -> BoxFuture<'static, bool>;
}
