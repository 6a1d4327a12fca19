//! Conversions between the generated `provisioning.v1` messages ([`crate::pb`]) and
//! the plain-Rust domain types. Nothing outside this module and the service edges
//! should touch a `pb` type.
//!
//! Wire → domain is `TryFrom<pb::X> for X` with `Error = FieldError`. The error
//! names the offending field as a path relative to the message being converted
//! (`groups[1].template.provider.cpu`, `id.attempt`, `node_id`); a caller that
//! converts a nested message prefixes the path with [`FieldError::within`]. The
//! checks are structural: ids parse, enum values are set and known, integers fit
//! and are not negative, numbers are finite, required sub-messages are present,
//! and a shape's groups are unique and belong to the shape's run. Configured
//! limits (group and node counts, string lengths, parameter counts) are not
//! checked here: [`ClusterShape::validate`] checks them against the limits the
//! driver is configured with.
//!
//! Domain → wire is `From<&X> for pb::X` (or `From<X>` for `Copy` types) and
//! never fails.
//!
//! The wire conventions this module maps:
//! - Times are milliseconds since the Unix epoch and `0` means unset
//!   ([`UnixMillis::from_wire`]); a required deadline of `0` is `Missing`.
//! - An empty string is an absent optional id (a lease, an endpoint, a session).
//! - Attempts start at 1, so attempt `0` is refused, except in a `Decision`,
//!   where it means "no attempt yet" (an insert).
//! - Enum value `0` (`*_UNSPECIFIED`) is refused wherever a value is required.
//!   Converting a `pb` enum alone gives an error with an empty field path, which
//!   the caller's [`FieldError::within`] fills in.
//! - A `NodeState` names its templates by index into a table carried by the
//!   enclosing message ([`TemplateTable`]), so a template shared by 100,000 nodes
//!   crosses the wire once, and the decoded nodes share one `Arc` again.
//! - Secret parameter values travel in full between the services, because the
//!   executor needs them; read paths serve [`redacted`] shapes.
//!
//! Three mappings are not exact, by the shape of the wire messages:
//! `BootstrapProgress::detail` is not carried in `NodeFacts` (it decodes as
//! empty); a `Failure` or `PermanentFailure` with an empty reason is sent with
//! the reason [`NO_REASON`], because an empty reason means "none" on the wire;
//! and a group's optional `run_id` is checked on the way in but never sent.

use std::{
    borrow::Cow,
    collections::{HashMap, HashSet},
    sync::Arc,
};

use crate::{
    decision::{Action, Decision, Rule},
    error::{FieldError, Problem},
    events::{Event, EventReason, Subject},
    health::{Budget, GroupPolicy, HealthPolicy, NodeHealth, Probe, RemediationPolicy},
    ids::{
        AttemptId, Endpoint, Epoch, Generation, GroupId, GroupInterner, LeaseId, LogicalNodeId, OperationId,
        RunId, RunUid, SessionId,
    },
    ops::{
        Change, Claim, InventoryResource, Observation, Operation, OperationInput, OperationResult, Outcome,
        Rejection, RejectionReason, ResourceChange, ResourceIdentity, ResultFacts, TraceContext, WatchHealth,
    },
    pb,
    rollout::RolloutPolicy,
    shape::{Accelerator, ClusterShape, NodeGroup, NodeTemplate, Param, Params, ProviderShape},
    state::{
        BootstrapProgress, BootstrapStage, Effect, Failure, Intent, ManagedNode, NodeFacts, NodeStage,
        PendingOp, PermanentFailure, RetryState, Surge,
    },
    time::UnixMillis,
};

pub mod answer;
pub mod encode;
pub mod request;

/// What a secret parameter's value reads as on a read path.
pub const REDACTED: &str = "<redacted>";

/// The reason sent for a failure recorded without one: on the wire an empty
/// reason means "no failure", and a permanent failure must not vanish in transit
/// because it blocks restarts.
pub const NO_REASON: &str = "(no reason given)";

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// Prefixes an error's field path; for `map_err`.
fn within(parent: &str) -> impl FnOnce(FieldError) -> FieldError + '_ {
    move |e| e.within(parent)
}

/// Converts a repeated field element by element, naming the failing element.
fn convert_all<W, D>(
    field: &str,
    items: Vec<W>,
    mut convert: impl FnMut(W) -> Result<D, FieldError>,
) -> Result<Vec<D>, FieldError> {
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| convert(item).map_err(|e| e.within(&format!("{field}[{i}]"))))
        .collect()
}

fn required<T>(field: &str, v: Option<T>) -> Result<T, FieldError> {
    v.ok_or_else(|| FieldError::new(field, Problem::Missing))
}

/// A count sent as `int64` so that a negative one is reported, not wrapped.
fn count_from_wire(field: &str, v: i64) -> Result<u32, FieldError> {
    if v < 0 {
        return Err(FieldError::new(field, Problem::Negative));
    }
    u32::try_from(v).map_err(|_| {
        FieldError::new(
            field,
            Problem::OverConfiguredLimit {
                said: "is",
                value: v.unsigned_abs(),
                noun: "",
                limit: None,
                flag: "max-nodes-per-group",
            },
        )
    })
}

fn quantity_from_wire(field: &str, v: f64) -> Result<f64, FieldError> {
    if !v.is_finite() {
        return Err(FieldError::new(field, Problem::NotFinite));
    }
    if v < 0.0 {
        return Err(FieldError::new(field, Problem::Negative));
    }
    Ok(v)
}

fn attempt_from_wire(field: &str, v: u64) -> Result<AttemptId, FieldError> {
    if v == 0 {
        return Err(FieldError::new(field, Problem::Malformed("attempts start at 1")));
    }
    Ok(AttemptId::new(v))
}

/// A deadline the domain requires; `0` (unset) is missing.
fn deadline_from_wire(field: &str, ms: u64) -> Result<UnixMillis, FieldError> {
    UnixMillis::from_wire(ms).ok_or_else(|| FieldError::new(field, Problem::Missing))
}

/// An optional id: empty is absent, anything else must parse.
fn optional<T>(
    field: &str,
    s: &str,
    parse: impl FnOnce(&str, &str) -> Result<T, FieldError>,
) -> Result<Option<T>, FieldError> {
    if s.is_empty() {
        Ok(None)
    } else {
        parse(field, s).map(Some)
    }
}

fn optional_to_wire(s: Option<&str>) -> String {
    s.map_or_else(String::new, str::to_owned)
}

fn failure_reason_to_wire(reason: &str) -> String {
    if reason.is_empty() {
        NO_REASON.to_owned()
    } else {
        reason.to_owned()
    }
}

/// Decodes an enum field: the `i32` must name a known wire value, and that value
/// must map to a domain value (`*_UNSPECIFIED` does not).
fn enum_from_wire<W, D>(field: &str, v: i32) -> Result<D, FieldError>
where
    W: TryFrom<i32>,
    D: TryFrom<W, Error = FieldError>,
{
    let w = W::try_from(v).map_err(|_| FieldError::new(field, Problem::UnknownValue(v)))?;
    D::try_from(w).map_err(within(field))
}

// ---------------------------------------------------------------------------
// Enums
// ---------------------------------------------------------------------------

/// Maps a domain enum to the generated enum of the same name and variants.
macro_rules! wire_enum {
    ($name:ident { $($variant:ident),+ $(,)? }) => {
        impl From<$name> for pb::$name {
            fn from(v: $name) -> Self {
                match v {
                    $($name::$variant => pb::$name::$variant,)+
                }
            }
        }

        impl TryFrom<pb::$name> for $name {
            type Error = FieldError;

            /// Fails with an empty field path on `*_UNSPECIFIED`.
            fn try_from(v: pb::$name) -> Result<Self, FieldError> {
                match v {
                    $(pb::$name::$variant => Ok($name::$variant),)+
                    other => Err(FieldError::new("", Problem::UnknownValue(other as i32))),
                }
            }
        }
    };
}

wire_enum!(NodeStage {
    New,
    LeaseRequested,
    LeaseCreated,
    EndpointKnown,
    BootstrapRunning,
    Joined,
    HandedOff,
    Dormant,
    Failed,
    Destroyed,
});
wire_enum!(Intent { Active, Deleting });
wire_enum!(BootstrapStage {
    Connected,
    BootCheck,
    AgentStarted,
    Joined,
    Converged,
    FailedConnect,
    FailedBootCheck,
    FailedAgentStart,
    FailedJoin,
    FailedClosed,
});
wire_enum!(Effect {
    CreateLease,
    LookupEndpoint,
    StartBootstrap,
    CancelBootstrap,
    DestroyLease,
});
wire_enum!(RejectionReason {
    Fenced,
    ConflictingInput,
    UnknownRun,
    Invalid,
});

/// The ladder rule numbered `n` (0 = insert, 1..=16 = the ladder); the error has
/// an empty field path.
pub fn rule_from_wire(n: u32) -> Result<Rule, FieldError> {
    Rule::from_number(n)
        .ok_or_else(|| FieldError::new("", Problem::UnknownValue(i32::try_from(n).unwrap_or(i32::MAX))))
}

/// An action as the `kind`, `effect` and `until_ms` fields of a `pb::Decision`.
/// `effect` is unspecified unless the action dispatches; `until_ms` is 0 unless
/// it waits for a deadline.
pub fn action_to_wire(a: Action) -> (pb::ActionKind, pb::Effect, u64) {
    match a {
        Action::Insert => (pb::ActionKind::Insert, pb::Effect::Unspecified, 0),
        Action::Reap => (pb::ActionKind::Reap, pb::Effect::Unspecified, 0),
        Action::Restart => (pb::ActionKind::Restart, pb::Effect::Unspecified, 0),
        Action::BeginDelete => (pb::ActionKind::BeginDelete, pb::Effect::Unspecified, 0),
        Action::MarkDestroyed => (pb::ActionKind::MarkDestroyed, pb::Effect::Unspecified, 0),
        Action::ObserveConvergence => (pb::ActionKind::ObserveConvergence, pb::Effect::Unspecified, 0),
        Action::Surge => (pb::ActionKind::Surge, pb::Effect::Unspecified, 0),
        Action::Dispatch(e) => (pb::ActionKind::Dispatch, e.into(), 0),
        Action::Wait { until } => (
            pb::ActionKind::Wait,
            pb::Effect::Unspecified,
            UnixMillis::to_wire(until),
        ),
    }
}

/// The inverse of [`action_to_wire`]. Errors name `kind` or `effect`; an effect
/// on a non-dispatch action and a deadline on a non-wait action are ignored.
pub fn action_from_wire(kind: i32, effect: i32, until_ms: u64) -> Result<Action, FieldError> {
    let kind =
        pb::ActionKind::try_from(kind).map_err(|_| FieldError::new("kind", Problem::UnknownValue(kind)))?;
    Ok(match kind {
        pb::ActionKind::Unspecified => {
            return Err(FieldError::new("kind", Problem::UnknownValue(kind as i32)));
        }
        pb::ActionKind::Insert => Action::Insert,
        pb::ActionKind::Reap => Action::Reap,
        pb::ActionKind::Restart => Action::Restart,
        pb::ActionKind::BeginDelete => Action::BeginDelete,
        pb::ActionKind::MarkDestroyed => Action::MarkDestroyed,
        pb::ActionKind::ObserveConvergence => Action::ObserveConvergence,
        pb::ActionKind::Surge => Action::Surge,
        pb::ActionKind::Dispatch => Action::Dispatch(enum_from_wire::<pb::Effect, Effect>("effect", effect)?),
        pb::ActionKind::Wait => Action::Wait {
            until: UnixMillis::from_wire(until_ms),
        },
    })
}

// ---------------------------------------------------------------------------
// Desired shape
// ---------------------------------------------------------------------------

impl From<pb::Param> for Param {
    fn from(p: pb::Param) -> Self {
        Self {
            value: p.value,
            secret: p.secret,
        }
    }
}

impl From<&Param> for pb::Param {
    fn from(p: &Param) -> Self {
        Self {
            value: p.value.clone(),
            secret: p.secret,
        }
    }
}

/// A `map<string, Param>` as ordered [`Params`].
pub fn params_from_wire(params: HashMap<String, pb::Param>) -> Params {
    params.into_iter().map(|(k, v)| (k, Param::from(v))).collect()
}

pub fn params_to_wire(params: &Params) -> HashMap<String, pb::Param> {
    params
        .iter()
        .map(|(k, v)| (k.clone(), pb::Param::from(v)))
        .collect()
}

impl TryFrom<pb::Accelerator> for Accelerator {
    type Error = FieldError;

    fn try_from(a: pb::Accelerator) -> Result<Self, FieldError> {
        Ok(Self {
            count: count_from_wire("count", a.count)?,
            kind: a.kind,
        })
    }
}

impl From<&Accelerator> for pb::Accelerator {
    fn from(a: &Accelerator) -> Self {
        Self {
            kind: a.kind.clone(),
            count: i64::from(a.count),
        }
    }
}

impl TryFrom<pb::ProviderShape> for ProviderShape {
    type Error = FieldError;

    fn try_from(p: pb::ProviderShape) -> Result<Self, FieldError> {
        let cpu = quantity_from_wire("cpu", p.cpu)?;
        let memory_gib = quantity_from_wire("memory_gib", p.memory_gib)?;
        let accelerators = convert_all("accelerators", p.accelerators, Accelerator::try_from)?;
        Ok(Self {
            name: p.name,
            machine_type: p.machine_type,
            cpu,
            memory_gib,
            accelerators,
            zone: p.zone,
            labels: p.labels.into_iter().collect(),
        })
    }
}

impl From<&ProviderShape> for pb::ProviderShape {
    fn from(p: &ProviderShape) -> Self {
        Self {
            name: p.name.clone(),
            machine_type: p.machine_type.clone(),
            cpu: p.cpu,
            memory_gib: p.memory_gib,
            accelerators: p.accelerators.iter().map(pb::Accelerator::from).collect(),
            zone: p.zone.clone(),
            labels: p.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        }
    }
}

impl TryFrom<pb::NodeTemplate> for NodeTemplate {
    type Error = FieldError;

    fn try_from(t: pb::NodeTemplate) -> Result<Self, FieldError> {
        let provider = required("provider", t.provider)?;
        Ok(Self {
            role: t.role,
            provider: ProviderShape::try_from(provider).map_err(within("provider"))?,
            image: t.image,
            boot: params_from_wire(t.boot),
            join: params_from_wire(t.join),
        })
    }
}

impl From<&NodeTemplate> for pb::NodeTemplate {
    fn from(t: &NodeTemplate) -> Self {
        Self {
            role: t.role.clone(),
            provider: Some(pb::ProviderShape::from(&t.provider)),
            image: t.image.clone(),
            boot: params_to_wire(&t.boot),
            join: params_to_wire(&t.join),
        }
    }
}

/// Decodes a group's own fields. `from_table` is the group's template when the
/// enclosing message carries it in a template table; the group must then not
/// carry one inline.
fn group_from_wire(g: pb::NodeGroup, from_table: Option<Arc<NodeTemplate>>) -> Result<NodeGroup, FieldError> {
    let id = GroupId::parse("id", &g.id)?;
    let count = count_from_wire("count", g.count)?;
    let template = match (from_table, g.template) {
        (Some(t), None) => t,
        (Some(_), Some(_)) => {
            return Err(FieldError::new(
                "template",
                Problem::Malformed("given by group_template_refs; must not also be inline"),
            ));
        }
        (None, Some(t)) => Arc::new(NodeTemplate::try_from(t).map_err(within("template"))?),
        (None, None) => return Err(FieldError::new("template", Problem::Missing)),
    };
    let policy = GroupPolicy {
        health: g
            .health
            .map(health_from_wire)
            .transpose()
            .map_err(within("health"))?
            .unwrap_or_default(),
        remediation: g
            .remediation
            .map(remediation_from_wire)
            .transpose()
            .map_err(within("remediation"))?
            .unwrap_or_default(),
        rollout: g.rollout.map(rollout_from_wire).unwrap_or_default(),
    };
    Ok(NodeGroup {
        id,
        count,
        template,
        policy,
    })
}

/// Zero times and an unset probe decode as the defaults. Range checks are
/// `GroupPolicy::validate`'s (run by `ClusterShape::validate`).
pub fn health_from_wire(h: pb::HealthPolicy) -> Result<HealthPolicy, FieldError> {
    let d = HealthPolicy::default();
    let probe = match pb::Probe::try_from(h.probe) {
        Ok(pb::Probe::Unspecified | pb::Probe::None) => Probe::None,
        Ok(pb::Probe::Tcp) => Probe::Tcp,
        Err(_) => return Err(FieldError::new("probe", Problem::UnknownValue(h.probe))),
    };
    let or = |v: u64, default: u64| if v == 0 { default } else { v };
    Ok(HealthPolicy {
        probe,
        interval_ms: or(h.interval_ms, d.interval_ms),
        timeout_ms: or(h.timeout_ms, d.timeout_ms),
        unhealthy_after_ms: or(h.unhealthy_after_ms, d.unhealthy_after_ms),
        startup_grace_ms: h.startup_grace_ms,
    })
}

pub fn health_to_wire(h: &HealthPolicy) -> pb::HealthPolicy {
    pb::HealthPolicy {
        probe: match h.probe {
            Probe::None => pb::Probe::None,
            Probe::Tcp => pb::Probe::Tcp,
        } as i32,
        interval_ms: h.interval_ms,
        timeout_ms: h.timeout_ms,
        unhealthy_after_ms: h.unhealthy_after_ms,
        startup_grace_ms: h.startup_grace_ms,
    }
}

/// Unset fields decode as the defaults (`max_in_flight` 1, `max_unhealthy`
/// 100%).
pub fn remediation_from_wire(r: pb::RemediationPolicy) -> Result<RemediationPolicy, FieldError> {
    let d = RemediationPolicy::default();
    Ok(RemediationPolicy {
        max_in_flight: r.max_in_flight.unwrap_or(d.max_in_flight),
        max_unhealthy: budget_from_wire(r.max_unhealthy, d.max_unhealthy),
    })
}

pub fn remediation_to_wire(r: &RemediationPolicy) -> pb::RemediationPolicy {
    pb::RemediationPolicy {
        max_in_flight: Some(r.max_in_flight),
        max_unhealthy: Some(budget_to_wire(r.max_unhealthy)),
    }
}

fn budget_from_wire(b: Option<pb::Budget>, default: Budget) -> Budget {
    match b.and_then(|b| b.value) {
        None => default,
        Some(pb::budget::Value::Count(n)) => Budget::Count(n),
        Some(pb::budget::Value::Percent(p)) => Budget::Percent(p),
    }
}

fn budget_to_wire(b: Budget) -> pb::Budget {
    pb::Budget {
        value: Some(match b {
            Budget::Count(n) => pb::budget::Value::Count(n),
            Budget::Percent(p) => pb::budget::Value::Percent(p),
        }),
    }
}

/// Unset budgets and a zero deadline decode as the defaults (25%, 25%, 10
/// minutes). Range checks are `GroupPolicy::validate`'s.
pub fn rollout_from_wire(r: pb::RolloutPolicy) -> RolloutPolicy {
    let d = RolloutPolicy::default();
    RolloutPolicy {
        max_unavailable: budget_from_wire(r.max_unavailable, d.max_unavailable),
        max_surge: budget_from_wire(r.max_surge, d.max_surge),
        canary: r.canary,
        progress_deadline_ms: if r.progress_deadline_ms == 0 {
            d.progress_deadline_ms
        } else {
            r.progress_deadline_ms
        },
        failure_threshold: r.failure_threshold,
        auto_revert: r.auto_revert,
    }
}

pub fn rollout_to_wire(r: &RolloutPolicy) -> pb::RolloutPolicy {
    pb::RolloutPolicy {
        max_unavailable: Some(budget_to_wire(r.max_unavailable)),
        max_surge: Some(budget_to_wire(r.max_surge)),
        canary: r.canary,
        progress_deadline_ms: r.progress_deadline_ms,
        failure_threshold: r.failure_threshold,
        auto_revert: r.auto_revert,
    }
}

/// A group's policies as the wire carries them (always set, so a reader
/// sees the defaults a shape was accepted with).
struct PolicyFields {
    health: Option<pb::HealthPolicy>,
    remediation: Option<pb::RemediationPolicy>,
    rollout: Option<pb::RolloutPolicy>,
}

fn policy_fields(p: &GroupPolicy) -> PolicyFields {
    PolicyFields {
        health: Some(health_to_wire(&p.health)),
        remediation: Some(remediation_to_wire(&p.remediation)),
        rollout: Some(rollout_to_wire(&p.rollout)),
    }
}

/// A group on its own. Its optional `run_id` is not checked, because a group
/// alone does not know its shape's run; [`ClusterShape`]'s conversion checks it.
impl TryFrom<pb::NodeGroup> for NodeGroup {
    type Error = FieldError;

    fn try_from(g: pb::NodeGroup) -> Result<Self, FieldError> {
        group_from_wire(g, None)
    }
}

/// The group's `run_id` is left empty: the domain group has none, and the
/// enclosing shape names the run.
impl From<&NodeGroup> for pb::NodeGroup {
    fn from(g: &NodeGroup) -> Self {
        let PolicyFields {
            health,
            remediation,
            rollout,
        } = policy_fields(&g.policy);
        Self {
            id: g.id.as_str().to_owned(),
            count: i64::from(g.count),
            template: Some(pb::NodeTemplate::from(&*g.template)),
            run_id: String::new(),
            health,
            remediation,
            rollout,
        }
    }
}

/// Decodes a shape. `from_table`, when given, holds one template per group, in
/// order (see [`shape_from_wire_with_table`]).
fn decode_shape(
    s: pb::ClusterShape,
    from_table: Option<Vec<Arc<NodeTemplate>>>,
) -> Result<ClusterShape, FieldError> {
    let run_id = RunId::parse("run_id", &s.run_id)?;
    if s.generation == 0 {
        return Err(FieldError::new(
            "generation",
            Problem::Malformed("must be at least 1"),
        ));
    }
    let mut from_table = from_table.map(Vec::into_iter);
    // A set rather than a scan of the earlier groups: the group count is not yet
    // limited here, and a hostile shape must not cost quadratic time.
    let mut seen = HashSet::with_capacity(s.groups.len());
    let mut groups = Vec::with_capacity(s.groups.len());
    for (i, g) in s.groups.into_iter().enumerate() {
        let path = || format!("groups[{i}]");
        if !g.run_id.is_empty() && g.run_id != run_id.as_str() {
            return Err(FieldError::new(
                "run_id",
                Problem::ForeignRun {
                    expected: run_id.as_str().to_owned(),
                },
            )
            .within(&path()));
        }
        let template = from_table.as_mut().and_then(Iterator::next);
        let group = group_from_wire(g, template).map_err(|e| e.within(&path()))?;
        if !seen.insert(group.id.clone()) {
            return Err(FieldError::new("id", Problem::Duplicate).within(&path()));
        }
        groups.push(group);
    }
    Ok(ClusterShape {
        run_id,
        generation: Generation::new(s.generation),
        groups,
        labels: s.labels.into_iter().collect(),
    })
}

/// A shape whose groups carry their templates inline, as clients send it. The
/// configured limits are checked afterwards by [`ClusterShape::validate`].
impl TryFrom<pb::ClusterShape> for ClusterShape {
    type Error = FieldError;

    fn try_from(s: pb::ClusterShape) -> Result<Self, FieldError> {
        decode_shape(s, None)
    }
}

impl From<&ClusterShape> for pb::ClusterShape {
    fn from(s: &ClusterShape) -> Self {
        Self {
            run_id: s.run_id.as_str().to_owned(),
            generation: s.generation.get(),
            groups: s.groups.iter().map(pb::NodeGroup::from).collect(),
            labels: s.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        }
    }
}

/// A shape from the wire, with field paths relative to the shape. The same as
/// `ClusterShape::try_from`.
pub fn shape_from_wire(s: pb::ClusterShape) -> Result<ClusterShape, FieldError> {
    ClusterShape::try_from(s)
}

/// A shape whose group templates go into `table` rather than inline, as in
/// `DecideHeader`: returns the shape with no group templates, and
/// `group_template_refs` (one table index per group).
pub fn shape_to_wire_with_table(
    shape: &ClusterShape,
    table: &mut TemplateTable,
) -> (pb::ClusterShape, Vec<u32>) {
    let refs = shape.groups.iter().map(|g| table.intern(&g.template)).collect();
    let wire = pb::ClusterShape {
        run_id: shape.run_id.as_str().to_owned(),
        generation: shape.generation.get(),
        groups: shape
            .groups
            .iter()
            .map(|g| {
                let PolicyFields {
                    health,
                    remediation,
                    rollout,
                } = policy_fields(&g.policy);
                pb::NodeGroup {
                    id: g.id.as_str().to_owned(),
                    count: i64::from(g.count),
                    template: None,
                    run_id: String::new(),
                    health,
                    remediation,
                    rollout,
                }
            })
            .collect(),
        labels: shape.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    };
    (wire, refs)
}

/// The inverse of [`shape_to_wire_with_table`], for a message such as
/// `DecideHeader` that carries `desired`, `templates` and `group_template_refs`;
/// `templates` is the decoded table ([`TemplateTable::from_wire`]). Field paths
/// are relative to that message (`desired.groups[0].id`,
/// `group_template_refs[2]`). With no refs, every group must carry its template
/// inline; with refs, there must be one per group and no group may also carry
/// one inline. Groups decoded from the table share its `Arc`s, so they compare
/// with the nodes' specs by pointer.
pub fn shape_from_wire_with_table(
    desired: Option<pb::ClusterShape>,
    group_template_refs: &[u32],
    templates: &[Arc<NodeTemplate>],
) -> Result<ClusterShape, FieldError> {
    let desired = required("desired", desired)?;
    let from_table = if group_template_refs.is_empty() {
        None
    } else {
        if group_template_refs.len() != desired.groups.len() {
            return Err(FieldError::new(
                "group_template_refs",
                Problem::Malformed("expected one entry per desired group"),
            ));
        }
        let resolved = group_template_refs
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                template_at(templates, r).map_err(|e| e.within(&format!("group_template_refs[{i}]")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Some(resolved)
    };
    decode_shape(desired, from_table).map_err(within("desired"))
}

fn redact_params(params: &mut HashMap<String, pb::Param>) {
    for p in params.values_mut().filter(|p| p.secret) {
        p.value = REDACTED.to_owned();
    }
}

/// Replaces the values of the template's secret parameters with [`REDACTED`].
pub fn redact_template(t: &mut pb::NodeTemplate) {
    redact_params(&mut t.boot);
    redact_params(&mut t.join);
}

/// A copy of `shape` for a read path: every secret parameter value reads
/// [`REDACTED`]; everything else is kept.
pub fn redacted(shape: &pb::ClusterShape) -> pb::ClusterShape {
    let mut shape = shape.clone();
    for t in shape.groups.iter_mut().filter_map(|g| g.template.as_mut()) {
        redact_template(t);
    }
    shape
}

/// `shape` on the wire for a read path, secrets redacted.
pub fn shape_to_wire_redacted(shape: &ClusterShape) -> pb::ClusterShape {
    let mut wire = pb::ClusterShape::from(shape);
    for t in wire.groups.iter_mut().filter_map(|g| g.template.as_mut()) {
        redact_template(t);
    }
    wire
}

// ---------------------------------------------------------------------------
// Template tables
// ---------------------------------------------------------------------------

/// The encoding side of a message's template table: each distinct template once,
/// referred to by index.
///
/// Nodes share their group's template through an `Arc`, so interning first looks
/// the `Arc` up by address (O(1)); only an address not seen before is compared by
/// value with the templates already in the table. The table keeps a clone of every
/// `Arc` it has seen, so no address it maps can be freed and reused by another
/// template while the table lives.
#[derive(Debug, Default)]
pub struct TemplateTable {
    templates: Vec<Arc<NodeTemplate>>,
    by_addr: HashMap<usize, u32>,
    /// `Arc`s equal to an entry but not the same allocation, kept alive only so
    /// that their addresses in `by_addr` stay theirs.
    aliases: Vec<Arc<NodeTemplate>>,
}

impl TemplateTable {
    /// The index of `t` in the table, adding it if no equal template is there.
    ///
    /// A table holds fewer than `u32::MAX` templates in practice (each one is a
    /// heap allocation that is also encoded into one message).
    pub fn intern(&mut self, t: &Arc<NodeTemplate>) -> u32 {
        let addr = Arc::as_ptr(t).addr();
        if let Some(&index) = self.by_addr.get(&addr) {
            return index;
        }
        let index = match self.templates.iter().position(|known| **known == **t) {
            Some(i) => {
                self.aliases.push(Arc::clone(t));
                i
            }
            None => {
                self.templates.push(Arc::clone(t));
                self.templates.len() - 1
            }
        };
        let index = u32::try_from(index).unwrap_or(u32::MAX);
        self.by_addr.insert(addr, index);
        index
    }

    /// Distinct templates interned so far.
    pub fn len(&self) -> usize {
        self.templates.len()
    }

    pub fn is_empty(&self) -> bool {
        self.templates.is_empty()
    }

    /// The table in index order, for the enclosing message's `templates` field.
    pub fn into_wire(self) -> Vec<pb::NodeTemplate> {
        self.templates
            .iter()
            .map(|t| pb::NodeTemplate::from(&**t))
            .collect()
    }

    /// The decoding side: the table in index order, for [`node_from_wire`] and
    /// [`shape_from_wire_with_table`]. Errors are named `templates[i]…`.
    pub fn from_wire(templates: Vec<pb::NodeTemplate>) -> Result<Vec<Arc<NodeTemplate>>, FieldError> {
        convert_all("templates", templates, |t| {
            NodeTemplate::try_from(t).map(Arc::new)
        })
    }
}

/// The table entry at `r`; the error has an empty field path.
fn template_at(templates: &[Arc<NodeTemplate>], r: u32) -> Result<Arc<NodeTemplate>, FieldError> {
    usize::try_from(r)
        .ok()
        .and_then(|i| templates.get(i))
        .cloned()
        .ok_or_else(|| match templates.len().checked_sub(1) {
            None => FieldError::new(
                "",
                Problem::Malformed("the enclosing message carries no templates"),
            ),
            Some(last) => FieldError::new(
                "",
                Problem::OverLimit {
                    value: u64::from(r),
                    limit: u64::try_from(last).unwrap_or(u64::MAX),
                },
            ),
        })
}

// ---------------------------------------------------------------------------
// Observed state
// ---------------------------------------------------------------------------

impl TryFrom<pb::OperationId> for OperationId {
    type Error = FieldError;

    fn try_from(id: pb::OperationId) -> Result<Self, FieldError> {
        Ok(OperationId::new(
            attempt_from_wire("attempt", id.attempt)?,
            id.seq,
        ))
    }
}

impl From<OperationId> for pb::OperationId {
    fn from(id: OperationId) -> Self {
        Self {
            attempt: id.attempt().get(),
            seq: id.seq(),
        }
    }
}

/// A required operation id field.
fn op_id_from_wire(field: &str, id: Option<pb::OperationId>) -> Result<OperationId, FieldError> {
    OperationId::try_from(required(field, id)?).map_err(within(field))
}

/// An executor's word that an operation waits for a budget (`Some(reason)`)
/// or has started after waiting (`None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    pub run_uid: RunUid,
    pub id: OperationId,
    pub reason: Option<String>,
}

impl TryFrom<pb::OperationWaiting> for Waiting {
    type Error = FieldError;

    fn try_from(w: pb::OperationWaiting) -> Result<Self, FieldError> {
        Ok(Self {
            run_uid: RunUid::parse("run_uid", &w.run_uid)?,
            id: op_id_from_wire("id", w.id)?,
            reason: w.waiting.then_some(w.reason),
        })
    }
}

impl TryFrom<pb::PendingOperation> for PendingOp {
    type Error = FieldError;

    fn try_from(p: pb::PendingOperation) -> Result<Self, FieldError> {
        Ok(Self {
            id: op_id_from_wire("id", p.id)?,
            effect: enum_from_wire::<pb::Effect, Effect>("effect", p.effect)?,
            deadline: deadline_from_wire("deadline_ms", p.deadline_ms)?,
            dispatched_at: UnixMillis::new(p.dispatched_at_ms),
        })
    }
}

impl From<&PendingOp> for pb::PendingOperation {
    fn from(p: &PendingOp) -> Self {
        Self {
            id: Some(p.id.into()),
            effect: pb::Effect::from(p.effect) as i32,
            deadline_ms: p.deadline.as_millis(),
            dispatched_at_ms: p.dispatched_at.as_millis(),
        }
    }
}

/// Bootstrap progress is present when `bootstrap_stage` is set; its `detail` is
/// not on the wire and decodes as empty. A failure is present when
/// `failure_reason` is non-empty.
impl TryFrom<pb::NodeFacts> for NodeFacts {
    type Error = FieldError;

    fn try_from(f: pb::NodeFacts) -> Result<Self, FieldError> {
        facts_from_wire(&f)
    }
}

/// [`NodeFacts::try_from`] from a borrowed message: its strings are copied
/// where the facts keep them.
fn facts_from_wire(f: &pb::NodeFacts) -> Result<NodeFacts, FieldError> {
    let bootstrap = if f.bootstrap_stage == pb::BootstrapStage::Unspecified as i32 {
        None
    } else {
        Some(BootstrapProgress {
            stage: enum_from_wire::<pb::BootstrapStage, BootstrapStage>(
                "bootstrap_stage",
                f.bootstrap_stage,
            )?,
            seq: f.bootstrap_seq,
            at: UnixMillis::new(f.bootstrap_stage_at_ms),
            detail: String::new(),
        })
    };
    Ok(NodeFacts {
        lease: optional("lease_id", &f.lease_id, LeaseId::new)?,
        endpoint: optional("endpoint", &f.endpoint, Endpoint::new)?,
        session: optional("session_id", &f.session_id, SessionId::new)?,
        bootstrap,
        failure: (!f.failure_reason.is_empty()).then(|| Failure {
            reason: f.failure_reason.clone(),
            at: UnixMillis::new(f.failed_at_ms),
        }),
        ambiguous_create: f.ambiguous_create,
        ambiguous_bootstrap: f.ambiguous_bootstrap,
        lost: f.lost,
        health: f.health.as_ref().map(|h| NodeHealth {
            healthy: h.healthy,
            since: UnixMillis::new(h.since_ms),
            observed_at: UnixMillis::new(h.observed_at_ms),
            seq: h.seq,
            detail: h.detail.clone(),
            remediate_at: UnixMillis::from_wire(h.remediate_at_ms),
        }),
    })
}

impl From<&NodeFacts> for pb::NodeFacts {
    fn from(f: &NodeFacts) -> Self {
        let (bootstrap_stage, bootstrap_seq, bootstrap_stage_at_ms) = match &f.bootstrap {
            Some(b) => (pb::BootstrapStage::from(b.stage) as i32, b.seq, b.at.as_millis()),
            None => (pb::BootstrapStage::Unspecified as i32, 0, 0),
        };
        let (failure_reason, failed_at_ms) = match &f.failure {
            Some(fail) => (failure_reason_to_wire(&fail.reason), fail.at.as_millis()),
            None => (String::new(), 0),
        };
        Self {
            lease_id: optional_to_wire(f.lease.as_ref().map(LeaseId::as_str)),
            endpoint: optional_to_wire(f.endpoint.as_ref().map(Endpoint::as_str)),
            session_id: optional_to_wire(f.session.as_ref().map(SessionId::as_str)),
            bootstrap_stage,
            bootstrap_seq,
            failure_reason,
            failed_at_ms,
            ambiguous_create: f.ambiguous_create,
            ambiguous_bootstrap: f.ambiguous_bootstrap,
            bootstrap_stage_at_ms,
            lost: f.lost,
            health: f.health.as_ref().map(|h| pb::NodeHealth {
                healthy: h.healthy,
                since_ms: h.since.as_millis(),
                observed_at_ms: h.observed_at.as_millis(),
                seq: h.seq,
                detail: h.detail.clone(),
                remediate_at_ms: UnixMillis::to_wire(h.remediate_at),
            }),
        }
    }
}

fn retry_to_wire(r: &RetryState, table: &mut TemplateTable) -> pb::RetryState {
    let (permanent_failure, permanent_template_ref) = match &r.permanent {
        Some(p) => (failure_reason_to_wire(&p.reason), table.intern(&p.spec)),
        None => (String::new(), 0),
    };
    pb::RetryState {
        consecutive_failures: r.consecutive_failures,
        next_effect_at_ms: UnixMillis::to_wire(r.next_effect_at),
        restart_at_ms: UnixMillis::to_wire(r.restart_at),
        permanent_failure,
        permanent_template_ref,
        remediating: r.remediating,
    }
}

fn retry_from_wire(r: &pb::RetryState, templates: &[Arc<NodeTemplate>]) -> Result<RetryState, FieldError> {
    let permanent = if r.permanent_failure.is_empty() {
        None
    } else {
        Some(PermanentFailure {
            spec: template_at(templates, r.permanent_template_ref)
                .map_err(within("permanent_template_ref"))?,
            reason: r.permanent_failure.clone(),
        })
    };
    Ok(RetryState {
        consecutive_failures: r.consecutive_failures,
        next_effect_at: UnixMillis::from_wire(r.next_effect_at_ms),
        restart_at: UnixMillis::from_wire(r.restart_at_ms),
        permanent,
        remediating: r.remediating,
    })
}

/// One node's state, its templates interned into `table` (which the caller sends
/// as the enclosing message's `templates`).
pub fn node_to_wire(n: &ManagedNode, table: &mut TemplateTable) -> pb::NodeState {
    let template_ref = table.intern(&n.spec);
    pb::NodeState {
        node_id: n.id.to_wire(),
        attempt: n.attempt.get(),
        intent: pb::Intent::from(n.intent) as i32,
        stage: pb::NodeStage::from(n.stage) as i32,
        facts: Some(pb::NodeFacts::from(&n.facts)),
        pending: n.pending.as_ref().map(pb::PendingOperation::from),
        retry: Some(retry_to_wire(&n.retry, table)),
        stage_deadline_ms: UnixMillis::to_wire(n.stage_deadline),
        template_ref,
        successor_attempt: match n.surge {
            Surge::Current { successor, .. } => successor.get(),
            _ => 0,
        },
        successor_ready: matches!(
            n.surge,
            Surge::Current {
                successor_ready: true,
                ..
            }
        ),
        successor: n.surge == Surge::Successor,
    }
}

/// One node's state; `templates` is the enclosing message's decoded table
/// ([`TemplateTable::from_wire`]). Absent `facts` and `retry` decode as their
/// defaults (a fresh attempt has none). Field paths are relative to the
/// `NodeState` (`template_ref`, `pending.id.attempt`).
pub fn node_from_wire(n: pb::NodeState, templates: &[Arc<NodeTemplate>]) -> Result<ManagedNode, FieldError> {
    node_from_wire_ref(&n, templates, &mut GroupInterner::default())
}

/// [`node_from_wire`] for one of many nodes of a message stream, from a
/// borrowed message (one decoded into a buffer that is used again for the
/// next node): the node's group id is shared with the others of its group
/// through `groups`, and its strings are copied where the node keeps them.
pub fn node_from_wire_ref(
    n: &pb::NodeState,
    templates: &[Arc<NodeTemplate>],
    groups: &mut GroupInterner,
) -> Result<ManagedNode, FieldError> {
    let id = groups.node("node_id", &n.node_id)?;
    let attempt = attempt_from_wire("attempt", n.attempt)?;
    let intent = enum_from_wire::<pb::Intent, Intent>("intent", n.intent)?;
    let stage = enum_from_wire::<pb::NodeStage, NodeStage>("stage", n.stage)?;
    let facts = match &n.facts {
        Some(f) => facts_from_wire(f).map_err(within("facts"))?,
        None => NodeFacts::default(),
    };
    let pending = n
        .pending
        .map(PendingOp::try_from)
        .transpose()
        .map_err(within("pending"))?;
    let spec = template_at(templates, n.template_ref).map_err(within("template_ref"))?;
    let retry = match &n.retry {
        Some(r) => retry_from_wire(r, templates).map_err(within("retry"))?,
        None => RetryState::default(),
    };
    let surge = match (n.successor, n.successor_attempt) {
        (true, 0) => Surge::Successor,
        (false, 0) => Surge::None,
        (false, a) => Surge::Current {
            successor: attempt_from_wire("successor_attempt", a)?,
            successor_ready: n.successor_ready,
        },
        (true, _) => {
            return Err(FieldError::new(
                "successor_attempt",
                Problem::Malformed("a successor has no successor"),
            ));
        }
    };
    Ok(ManagedNode {
        id,
        attempt,
        spec,
        intent,
        stage,
        facts,
        pending,
        retry,
        stage_deadline: UnixMillis::from_wire(n.stage_deadline_ms),
        surge,
    })
}

// ---------------------------------------------------------------------------
// Decisions
// ---------------------------------------------------------------------------

/// Attempt `0` is an insert's "no attempt yet".
impl TryFrom<pb::Decision> for Decision {
    type Error = FieldError;

    fn try_from(d: pb::Decision) -> Result<Self, FieldError> {
        decision_from_wire(d, &mut GroupInterner::default())
    }
}

/// One of many decisions of an answer, its node's group id shared with the
/// others of its group through `groups`.
pub fn decision_from_wire(d: pb::Decision, groups: &mut GroupInterner) -> Result<Decision, FieldError> {
    decision_from_parts(
        &d.node_id, d.attempt, d.rule, d.kind, d.effect, d.until_ms, d.reason, groups,
    )
}

/// A decision from its fields as the wire carries them: what
/// [`decision_from_wire`] and [`answer::decision_from_raw`] both check.
#[allow(clippy::too_many_arguments)]
fn decision_from_parts(
    node_id: &str,
    attempt: u64,
    rule: u32,
    kind: i32,
    effect: i32,
    until_ms: u64,
    reason: String,
    groups: &mut GroupInterner,
) -> Result<Decision, FieldError> {
    Ok(Decision {
        node: groups.node("node_id", node_id)?,
        attempt: (attempt != 0).then(|| AttemptId::new(attempt)),
        rule: rule_from_wire(rule).map_err(within("rule"))?,
        action: action_from_wire(kind, effect, until_ms)?,
        reason: Cow::Owned(reason),
    })
}

impl From<&Decision> for pb::Decision {
    fn from(d: &Decision) -> Self {
        let (kind, effect, until_ms) = action_to_wire(d.action);
        Self {
            node_id: d.node.to_wire(),
            attempt: d.attempt.map_or(0, AttemptId::get),
            rule: d.rule.number(),
            kind: kind as i32,
            effect: effect as i32,
            reason: d.reason.clone().into_owned(),
            until_ms,
        }
    }
}

// ---------------------------------------------------------------------------
// The executor link
// ---------------------------------------------------------------------------

impl From<pb::TraceContext> for TraceContext {
    fn from(t: pb::TraceContext) -> Self {
        Self {
            traceparent: t.traceparent,
            tracestate: t.tracestate,
        }
    }
}

impl From<&TraceContext> for pb::TraceContext {
    fn from(t: &TraceContext) -> Self {
        Self {
            traceparent: t.traceparent.clone(),
            tracestate: t.tracestate.clone(),
        }
    }
}

/// An optional `trace` field; absent is the empty context.
pub fn trace_from_wire(t: Option<pb::TraceContext>) -> TraceContext {
    t.map(TraceContext::from).unwrap_or_default()
}

/// A `SlotRanges.bounds` field: `start, end` pairs, each half-open range
/// non-empty. The error names the offending bound (`bounds[3]`).
pub fn slot_ranges_from_wire(bounds: &[u32]) -> Result<impl Iterator<Item = (u32, u32)> + '_, FieldError> {
    if !bounds.len().is_multiple_of(2) {
        return Err(FieldError::new(
            format!("bounds[{}]", bounds.len() - 1),
            Problem::Malformed("bounds come in `start, end` pairs; the last has no end"),
        ));
    }
    if let Some(i) = bounds.chunks_exact(2).position(|p| p[0] >= p[1]) {
        return Err(FieldError::new(
            format!("bounds[{}]", 2 * i + 1),
            Problem::Malformed("a range's end must be greater than its start"),
        ));
    }
    Ok(bounds.chunks_exact(2).map(|p| (p[0], p[1])))
}

/// `ranges` as a `SlotRanges.bounds` field.
pub fn slot_ranges_to_wire(ranges: impl IntoIterator<Item = (u32, u32)>) -> Vec<u32> {
    ranges.into_iter().flat_map(|(start, end)| [start, end]).collect()
}

/// A `trace` field; the empty context is sent as absent.
pub fn trace_to_wire(t: &TraceContext) -> Option<pb::TraceContext> {
    (!t.traceparent.is_empty() || !t.tracestate.is_empty()).then(|| pb::TraceContext::from(t))
}

/// Field paths are relative to `pb::Operation`, whose oneof fields name the
/// variant (`create_lease.template.provider.cpu`, `lookup_endpoint.lease_id`).
impl TryFrom<pb::operation::Input> for OperationInput {
    type Error = FieldError;

    fn try_from(input: pb::operation::Input) -> Result<Self, FieldError> {
        use pb::operation::Input;
        Ok(match input {
            Input::CreateLease(c) => {
                let template = required("create_lease.template", c.template)?;
                let template = NodeTemplate::try_from(template).map_err(within("create_lease.template"))?;
                OperationInput::CreateLease {
                    template: Arc::new(template),
                }
            }
            Input::LookupEndpoint(l) => OperationInput::LookupEndpoint {
                lease: LeaseId::new("lookup_endpoint.lease_id", &l.lease_id)?,
            },
            Input::StartBootstrap(s) => OperationInput::StartBootstrap {
                lease: LeaseId::new("start_bootstrap.lease_id", &s.lease_id)?,
                endpoint: Endpoint::new("start_bootstrap.endpoint", &s.endpoint)?,
                boot: params_from_wire(s.boot),
                join: params_from_wire(s.join),
            },
            Input::CancelBootstrap(c) => OperationInput::CancelBootstrap {
                session: optional("cancel_bootstrap.session_id", &c.session_id, SessionId::new)?,
            },
            Input::DestroyLease(d) => OperationInput::DestroyLease {
                lease: optional("destroy_lease.lease_id", &d.lease_id, LeaseId::new)?,
            },
        })
    }
}

impl From<&OperationInput> for pb::operation::Input {
    fn from(input: &OperationInput) -> Self {
        use pb::operation::Input;
        match input {
            OperationInput::CreateLease { template } => Input::CreateLease(pb::CreateLeaseInput {
                template: Some(pb::NodeTemplate::from(&**template)),
            }),
            OperationInput::LookupEndpoint { lease } => Input::LookupEndpoint(pb::LookupEndpointInput {
                lease_id: lease.as_str().to_owned(),
            }),
            OperationInput::StartBootstrap {
                lease,
                endpoint,
                boot,
                join,
            } => Input::StartBootstrap(pb::StartBootstrapInput {
                lease_id: lease.as_str().to_owned(),
                endpoint: endpoint.as_str().to_owned(),
                boot: params_to_wire(boot),
                join: params_to_wire(join),
            }),
            OperationInput::CancelBootstrap { session } => Input::CancelBootstrap(pb::CancelBootstrapInput {
                session_id: optional_to_wire(session.as_ref().map(SessionId::as_str)),
            }),
            OperationInput::DestroyLease { lease } => Input::DestroyLease(pb::DestroyLeaseInput {
                lease_id: optional_to_wire(lease.as_ref().map(LeaseId::as_str)),
            }),
        }
    }
}

impl TryFrom<pb::Operation> for Operation {
    type Error = FieldError;

    fn try_from(o: pb::Operation) -> Result<Self, FieldError> {
        Ok(Operation {
            run_uid: RunUid::parse("run_uid", &o.run_uid)?,
            run_id: RunId::parse("run_id", &o.run_id)?,
            node: LogicalNodeId::parse("node_id", &o.node_id)?,
            id: op_id_from_wire("id", o.id)?,
            epoch: Epoch::new(o.epoch),
            deadline: deadline_from_wire("deadline_ms", o.deadline_ms)?,
            provider: Arc::from(o.provider),
            input: OperationInput::try_from(required("input", o.input)?)?,
            trace: trace_from_wire(o.trace),
        })
    }
}

impl From<&Operation> for pb::Operation {
    fn from(o: &Operation) -> Self {
        Self {
            run_uid: o.run_uid.to_string(),
            run_id: o.run_id.as_str().to_owned(),
            node_id: o.node.to_wire(),
            id: Some(o.id.into()),
            epoch: o.epoch.get(),
            deadline_ms: o.deadline.as_millis(),
            input: Some(pb::operation::Input::from(&o.input)),
            provider: o.provider.to_string(),
            trace: trace_to_wire(&o.trace),
        }
    }
}

impl TryFrom<pb::ResultFacts> for ResultFacts {
    type Error = FieldError;

    fn try_from(f: pb::ResultFacts) -> Result<Self, FieldError> {
        Ok(Self {
            lease: optional("lease_id", &f.lease_id, LeaseId::new)?,
            endpoint: optional("endpoint", &f.endpoint, Endpoint::new)?,
            session: optional("session_id", &f.session_id, SessionId::new)?,
        })
    }
}

impl From<&ResultFacts> for pb::ResultFacts {
    fn from(f: &ResultFacts) -> Self {
        Self {
            lease_id: optional_to_wire(f.lease.as_ref().map(LeaseId::as_str)),
            endpoint: optional_to_wire(f.endpoint.as_ref().map(Endpoint::as_str)),
            session_id: optional_to_wire(f.session.as_ref().map(SessionId::as_str)),
        }
    }
}

/// The wire class of an outcome.
pub fn outcome_class(o: &Outcome) -> pb::OutcomeClass {
    match o {
        Outcome::Succeeded(_) => pb::OutcomeClass::Succeeded,
        Outcome::NotReady { .. } => pb::OutcomeClass::NotReady,
        Outcome::Retryable { .. } => pb::OutcomeClass::FailedRetryable,
        Outcome::Permanent { .. } => pb::OutcomeClass::FailedPermanent,
        Outcome::Ambiguous { .. } => pb::OutcomeClass::Ambiguous,
    }
}

/// An outcome as the `outcome`, `reason` and `facts` fields of a
/// `pb::OperationResult`; facts are sent only with a success.
pub fn outcome_to_wire(o: &Outcome) -> (pb::OutcomeClass, String, Option<pb::ResultFacts>) {
    let facts = match o {
        Outcome::Succeeded(f) => Some(pb::ResultFacts::from(f)),
        _ => None,
    };
    (outcome_class(o), o.reason().to_owned(), facts)
}

/// The inverse of [`outcome_to_wire`]. Errors name `outcome` or `facts.…`; a
/// success's reason and a failure's facts are ignored.
pub fn outcome_from_wire(
    class: i32,
    reason: String,
    facts: Option<pb::ResultFacts>,
) -> Result<Outcome, FieldError> {
    let class = pb::OutcomeClass::try_from(class)
        .map_err(|_| FieldError::new("outcome", Problem::UnknownValue(class)))?;
    Ok(match class {
        pb::OutcomeClass::Unspecified => {
            return Err(FieldError::new("outcome", Problem::UnknownValue(class as i32)));
        }
        pb::OutcomeClass::Succeeded => Outcome::Succeeded(match facts {
            Some(f) => ResultFacts::try_from(f).map_err(within("facts"))?,
            None => ResultFacts::default(),
        }),
        pb::OutcomeClass::NotReady => Outcome::NotReady { reason },
        pb::OutcomeClass::FailedRetryable => Outcome::Retryable { reason },
        pb::OutcomeClass::FailedPermanent => Outcome::Permanent { reason },
        pb::OutcomeClass::Ambiguous => Outcome::Ambiguous { reason },
    })
}

impl TryFrom<pb::OperationResult> for OperationResult {
    type Error = FieldError;

    fn try_from(r: pb::OperationResult) -> Result<Self, FieldError> {
        Ok(OperationResult {
            run_uid: RunUid::parse("run_uid", &r.run_uid)?,
            node: LogicalNodeId::parse("node_id", &r.node_id)?,
            id: op_id_from_wire("id", r.id)?,
            effect: enum_from_wire::<pb::Effect, Effect>("effect", r.effect)?,
            outcome: outcome_from_wire(r.outcome, r.reason, r.facts)?,
            completed_at: UnixMillis::new(r.completed_at_ms),
            late: r.late,
            replayed: r.replayed,
            trace: trace_from_wire(r.trace),
        })
    }
}

impl From<&OperationResult> for pb::OperationResult {
    fn from(r: &OperationResult) -> Self {
        let (outcome, reason, facts) = outcome_to_wire(&r.outcome);
        Self {
            run_uid: r.run_uid.to_string(),
            node_id: r.node.to_wire(),
            id: Some(r.id.into()),
            effect: pb::Effect::from(r.effect) as i32,
            outcome: outcome as i32,
            reason,
            facts,
            completed_at_ms: r.completed_at.as_millis(),
            late: r.late,
            replayed: r.replayed,
            trace: trace_to_wire(&r.trace),
        }
    }
}

impl TryFrom<pb::BootstrapObservation> for Observation {
    type Error = FieldError;

    fn try_from(o: pb::BootstrapObservation) -> Result<Self, FieldError> {
        Ok(Observation {
            run_uid: RunUid::parse("run_uid", &o.run_uid)?,
            node: LogicalNodeId::parse("node_id", &o.node_id)?,
            attempt: attempt_from_wire("attempt", o.attempt)?,
            session: SessionId::new("session_id", &o.session_id)?,
            seq: o.seq,
            stage: enum_from_wire::<pb::BootstrapStage, BootstrapStage>("stage", o.stage)?,
            detail: o.detail,
            at: UnixMillis::new(o.at_ms),
            trace: trace_from_wire(o.trace),
        })
    }
}

impl From<&Observation> for pb::BootstrapObservation {
    fn from(o: &Observation) -> Self {
        Self {
            run_uid: o.run_uid.to_string(),
            node_id: o.node.to_wire(),
            attempt: o.attempt.get(),
            session_id: o.session.as_str().to_owned(),
            seq: o.seq,
            stage: pb::BootstrapStage::from(o.stage) as i32,
            detail: o.detail.clone(),
            at_ms: o.at.as_millis(),
            trace: trace_to_wire(&o.trace),
        }
    }
}

impl TryFrom<pb::ResourceChange> for ResourceChange {
    type Error = FieldError;

    fn try_from(c: pb::ResourceChange) -> Result<Self, FieldError> {
        let change = match required("change", c.change)? {
            pb::resource_change::Change::Lost(l) => Change::Lost { reason: l.reason },
            pb::resource_change::Change::Health(h) => Change::Health {
                healthy: h.healthy,
                detail: h.detail,
            },
        };
        Ok(ResourceChange {
            run_uid: RunUid::parse("run_uid", &c.run_uid)?,
            node: LogicalNodeId::parse("node_id", &c.node_id)?,
            attempt: attempt_from_wire("attempt", c.attempt)?,
            seq: c.seq,
            change,
            at: UnixMillis::new(c.at_ms),
            trace: trace_from_wire(c.trace),
        })
    }
}

impl From<&ResourceChange> for pb::ResourceChange {
    fn from(c: &ResourceChange) -> Self {
        Self {
            run_uid: c.run_uid.to_string(),
            node_id: c.node.to_wire(),
            attempt: c.attempt.get(),
            seq: c.seq,
            change: Some(match &c.change {
                Change::Lost { reason } => pb::resource_change::Change::Lost(pb::ResourceLost {
                    reason: reason.clone(),
                }),
                Change::Health { healthy, detail } => {
                    pb::resource_change::Change::Health(pb::ResourceHealth {
                        healthy: *healthy,
                        detail: detail.clone(),
                    })
                }
            }),
            at_ms: c.at.as_millis(),
            trace: trace_to_wire(&c.trace),
        }
    }
}

impl TryFrom<pb::WatchHealth> for WatchHealth {
    type Error = FieldError;

    fn try_from(w: pb::WatchHealth) -> Result<Self, FieldError> {
        let groups = w
            .groups
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                let at = |e: FieldError| e.within(&format!("groups[{i}]"));
                let id = GroupId::parse("group_id", &g.group_id).map_err(at)?;
                let health = health_from_wire(required("health", g.health).map_err(at)?)
                    .map_err(|e| at(e.within("health")))?;
                health.validate().map_err(|e| at(e.within("health")))?;
                Ok((id, health))
            })
            .collect::<Result<_, FieldError>>()?;
        Ok(WatchHealth {
            run_uid: RunUid::parse("run_uid", &w.run_uid)?,
            epoch: Epoch::new(w.epoch),
            groups,
        })
    }
}

impl From<&WatchHealth> for pb::WatchHealth {
    fn from(w: &WatchHealth) -> Self {
        Self {
            run_uid: w.run_uid.to_string(),
            epoch: w.epoch.get(),
            groups: w
                .groups
                .iter()
                .map(|(id, h)| pb::GroupHealth {
                    group_id: id.as_str().to_owned(),
                    health: Some(health_to_wire(h)),
                })
                .collect(),
        }
    }
}

impl TryFrom<pb::Claim> for Claim {
    type Error = FieldError;

    fn try_from(c: pb::Claim) -> Result<Self, FieldError> {
        Ok(Claim {
            run_uid: RunUid::parse("run_uid", &c.run_uid)?,
            run_id: RunId::parse("run_id", &c.run_id)?,
            epoch: Epoch::new(c.epoch),
        })
    }
}

impl From<&Claim> for pb::Claim {
    fn from(c: &Claim) -> Self {
        Self {
            run_uid: c.run_uid.to_string(),
            run_id: c.run_id.as_str().to_owned(),
            epoch: c.epoch.get(),
        }
    }
}

impl TryFrom<pb::Rejection> for Rejection {
    type Error = FieldError;

    fn try_from(r: pb::Rejection) -> Result<Self, FieldError> {
        Ok(Rejection {
            run_uid: RunUid::parse("run_uid", &r.run_uid)?,
            id: r
                .id
                .map(OperationId::try_from)
                .transpose()
                .map_err(within("id"))?,
            reason: enum_from_wire::<pb::RejectionReason, RejectionReason>("reason", r.reason)?,
            message: r.message,
            highest_epoch: Epoch::new(r.highest_epoch),
        })
    }
}

impl From<&Rejection> for pb::Rejection {
    fn from(r: &Rejection) -> Self {
        Self {
            run_uid: r.run_uid.to_string(),
            id: r.id.map(pb::OperationId::from),
            reason: pb::RejectionReason::from(r.reason) as i32,
            message: r.message.clone(),
            highest_epoch: r.highest_epoch.get(),
        }
    }
}

/// The identity fields of a `pb::Resource`; the caller fills in `lease_id`,
/// `endpoint` and `session_live`.
impl From<&ResourceIdentity> for pb::Resource {
    fn from(id: &ResourceIdentity) -> Self {
        Self {
            run_uid: id.run_uid.to_string(),
            run_id: id.run_id.as_str().to_owned(),
            node_id: id.node.to_wire(),
            attempt: id.attempt.get(),
            ..Self::default()
        }
    }
}

/// The identity of an inventory resource.
impl TryFrom<&pb::Resource> for ResourceIdentity {
    type Error = FieldError;

    fn try_from(r: &pb::Resource) -> Result<Self, FieldError> {
        Ok(ResourceIdentity {
            run_uid: RunUid::parse("run_uid", &r.run_uid)?,
            run_id: RunId::parse("run_id", &r.run_id)?,
            node: LogicalNodeId::parse("node_id", &r.node_id)?,
            attempt: attempt_from_wire("attempt", r.attempt)?,
        })
    }
}

// ----- the event log -------------------------------------------------------

/// An event as clients read it (and as the driver stores it).
pub fn event_to_wire(run_id: &RunId, e: &Event) -> pb::Event {
    let (group_id, node_id, attempt) = match &e.subject {
        Subject::Run => (String::new(), String::new(), 0),
        Subject::Group(g) => (g.to_string(), String::new(), 0),
        Subject::Node { node, attempt } => (node.group().to_string(), node.to_string(), attempt.get()),
    };
    let kind = if e.reason.is_warning() {
        pb::EventType::Warning
    } else {
        pb::EventType::Normal
    };
    pb::Event {
        seq: e.seq,
        r#type: kind as i32,
        reason: e.reason.name().to_owned(),
        message: e.message.clone(),
        group_id,
        node_id,
        attempt,
        generation: e.generation.get(),
        first_at_ms: e.first_at.as_millis(),
        last_at_ms: e.last_at.as_millis(),
        count: e.count,
        run_id: run_id.to_string(),
    }
}

/// An event read back from the store.
pub fn event_from_wire(e: pb::Event) -> Result<Event, FieldError> {
    if e.seq == 0 {
        return Err(FieldError::new(
            "seq",
            Problem::Malformed("events are numbered from 1"),
        ));
    }
    let reason = EventReason::parse(&e.reason)
        .ok_or_else(|| FieldError::new("reason", Problem::Malformed("not an event reason")))?;
    let subject = match (e.node_id.is_empty(), e.group_id.is_empty()) {
        (false, _) => Subject::Node {
            node: LogicalNodeId::parse("node_id", &e.node_id)?,
            attempt: attempt_from_wire("attempt", e.attempt)?,
        },
        (true, false) => Subject::Group(GroupId::parse("group_id", &e.group_id)?),
        (true, true) => Subject::Run,
    };
    Ok(Event {
        seq: e.seq,
        reason,
        subject,
        message: e.message,
        generation: Generation::new(e.generation),
        first_at: UnixMillis::new(e.first_at_ms),
        last_at: UnixMillis::new(e.last_at_ms),
        count: e.count.max(1),
    })
}

impl From<&InventoryResource> for pb::Resource {
    fn from(r: &InventoryResource) -> Self {
        Self {
            lease_id: optional_to_wire(r.lease.as_ref().map(LeaseId::as_str)),
            endpoint: optional_to_wire(r.endpoint.as_ref().map(Endpoint::as_str)),
            session_live: r.session_live,
            epoch: r.epoch.get(),
            ..Self::from(&r.identity)
        }
    }
}

impl TryFrom<&pb::Resource> for InventoryResource {
    type Error = FieldError;

    fn try_from(r: &pb::Resource) -> Result<Self, FieldError> {
        Ok(InventoryResource {
            identity: ResourceIdentity::try_from(r)?,
            lease: optional("lease_id", &r.lease_id, LeaseId::new)?,
            endpoint: optional("endpoint", &r.endpoint, Endpoint::new)?,
            session_live: r.session_live,
            epoch: Epoch::new(r.epoch),
        })
    }
}

// ---------------------------------------------------------------------------
// Served providers
// ---------------------------------------------------------------------------

impl From<&crate::ServedProvider> for pb::ServedProvider {
    fn from(p: &crate::ServedProvider) -> Self {
        Self {
            name: p.name.clone(),
            kind: p.kind.as_str().to_owned(),
            available: p.available,
            reports_health: p.reports_health,
            reports_loss: p.reports_loss,
            detail: p.detail.clone(),
        }
    }
}

impl TryFrom<pb::ServedProvider> for crate::ServedProvider {
    type Error = FieldError;

    fn try_from(p: pb::ServedProvider) -> Result<Self, FieldError> {
        if p.name.is_empty() {
            return Err(FieldError::new("name", Problem::Empty));
        }
        let kind = match p.kind.as_str() {
            "builtin" => crate::ProviderKind::Builtin,
            "plugin" => crate::ProviderKind::Plugin,
            _ => {
                return Err(FieldError::new(
                    "kind",
                    Problem::Malformed("expected builtin or plugin"),
                ));
            }
        };
        Ok(Self {
            name: p.name,
            kind,
            available: p.available,
            reports_health: p.reports_health,
            reports_loss: p.reports_loss,
            detail: p.detail,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use prost::Message;

    use super::*;
    use crate::shape::example_template;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// The error of a conversion that must fail.
    fn err_of<T: std::fmt::Debug>(r: Result<T, FieldError>) -> FieldError {
        match r {
            Ok(v) => panic!("expected an error, got {v:?}"),
            Err(e) => e,
        }
    }

    /// Through the bytes, so the tests also cover what prost keeps and drops.
    fn reencode<M: Message + Default>(m: &M) -> Result<M, prost::DecodeError> {
        M::decode(m.encode_to_vec().as_slice())
    }

    fn param(value: &str, secret: bool) -> Param {
        Param {
            value: value.to_owned(),
            secret,
        }
    }

    fn rich_template() -> NodeTemplate {
        NodeTemplate {
            role: "trainer".to_owned(),
            provider: ProviderShape {
                name: "process".to_owned(),
                machine_type: "gpu-8x".to_owned(),
                cpu: 96.5,
                memory_gib: 1024.25,
                accelerators: vec![
                    Accelerator {
                        kind: "a100".to_owned(),
                        count: 8,
                    },
                    Accelerator {
                        kind: "nvlink".to_owned(),
                        count: 0,
                    },
                ],
                zone: "local-b".to_owned(),
                labels: BTreeMap::from([
                    ("team".to_owned(), "ml".to_owned()),
                    ("tier".to_owned(), "gold".to_owned()),
                ]),
            },
            image: "registry/trainer:7".to_owned(),
            boot: Params::from([
                ("mode".to_owned(), param("fast", false)),
                ("token".to_owned(), param("s3cr3t", true)),
            ]),
            join: Params::from([
                ("ca".to_owned(), param("-----BEGIN-----", true)),
                ("cluster".to_owned(), param("c-1", false)),
            ]),
        }
    }

    fn rich_shape() -> Result<ClusterShape, FieldError> {
        Ok(ClusterShape {
            run_id: RunId::parse("run_id", "train-7")?,
            generation: Generation::new(3),
            labels: BTreeMap::from([
                ("team".to_owned(), "ml".to_owned()),
                ("tier".to_owned(), String::new()),
            ]),
            groups: vec![
                NodeGroup {
                    id: GroupId::parse("id", "gpu")?,
                    count: 4,
                    template: Arc::new(rich_template()),
                    policy: Default::default(),
                },
                NodeGroup {
                    id: GroupId::parse("id", "cpu")?,
                    count: 0,
                    template: Arc::new(example_template("fake", "img:1")),
                    policy: Default::default(),
                },
            ],
        })
    }

    #[test]
    fn rich_shape_round_trips() -> TestResult {
        let shape = rich_shape()?;
        let wire = reencode(&pb::ClusterShape::from(&shape))?;
        assert_eq!(shape_from_wire(wire)?, shape);
        Ok(())
    }

    #[test]
    fn a_group_may_name_its_own_run() -> TestResult {
        let mut wire = pb::ClusterShape::from(&rich_shape()?);
        wire.groups[0].run_id = "train-7".to_owned();
        assert_eq!(shape_from_wire(wire)?, rich_shape()?);
        Ok(())
    }

    #[test]
    fn bad_shapes_name_the_field() -> TestResult {
        type Mutate = fn(&mut pb::ClusterShape);
        fn provider(s: &mut pb::ClusterShape, group: usize) -> &mut pb::ProviderShape {
            match s.groups[group]
                .template
                .as_mut()
                .and_then(|t| t.provider.as_mut())
            {
                Some(p) => p,
                None => panic!("the fixture has a provider"),
            }
        }
        // `Malformed` cases compare the variant only; their text belongs to the id parsers.
        let cases: &[(&str, Mutate, &str, Problem)] = &[
            (
                "malformed run id",
                |s| s.run_id = "Train_7".to_owned(),
                "run_id",
                Problem::Malformed(""),
            ),
            ("empty run id", |s| s.run_id.clear(), "run_id", Problem::Empty),
            (
                "generation 0",
                |s| s.generation = 0,
                "generation",
                Problem::Malformed(""),
            ),
            (
                "bad group id",
                |s| s.groups[0].id = "-gpu".to_owned(),
                "groups[0].id",
                Problem::Malformed(""),
            ),
            (
                "duplicate group",
                |s| s.groups[1].id = s.groups[0].id.clone(),
                "groups[1].id",
                Problem::Duplicate,
            ),
            (
                "foreign run",
                |s| s.groups[0].run_id = "other-run".to_owned(),
                "groups[0].run_id",
                Problem::ForeignRun {
                    expected: "train-7".to_owned(),
                },
            ),
            (
                "NaN cpu",
                |s| provider(s, 0).cpu = f64::NAN,
                "groups[0].template.provider.cpu",
                Problem::NotFinite,
            ),
            (
                "infinite cpu",
                |s| provider(s, 0).cpu = f64::INFINITY,
                "groups[0].template.provider.cpu",
                Problem::NotFinite,
            ),
            (
                "negative memory",
                |s| provider(s, 0).memory_gib = -1.0,
                "groups[0].template.provider.memory_gib",
                Problem::Negative,
            ),
            (
                "negative cpu in the second group",
                |s| provider(s, 1).cpu = -0.5,
                "groups[1].template.provider.cpu",
                Problem::Negative,
            ),
            (
                "negative count",
                |s| s.groups[0].count = -1,
                "groups[0].count",
                Problem::Negative,
            ),
            (
                "count over u32",
                |s| s.groups[0].count = i64::from(u32::MAX) + 1,
                "groups[0].count",
                Problem::OverConfiguredLimit {
                    said: "is",
                    value: u64::from(u32::MAX) + 1,
                    noun: "",
                    limit: None,
                    flag: "max-nodes-per-group",
                },
            ),
            (
                "missing template",
                |s| s.groups[0].template = None,
                "groups[0].template",
                Problem::Missing,
            ),
            (
                "missing provider",
                |s| {
                    if let Some(t) = s.groups[0].template.as_mut() {
                        t.provider = None;
                    }
                },
                "groups[0].template.provider",
                Problem::Missing,
            ),
            (
                "negative accelerator count",
                |s| provider(s, 0).accelerators[1].count = -8,
                "groups[0].template.provider.accelerators[1].count",
                Problem::Negative,
            ),
        ];
        let good = pb::ClusterShape::from(&rich_shape()?);
        for (name, mutate, field, problem) in cases {
            let mut wire = good.clone();
            mutate(&mut wire);
            let err = err_of(shape_from_wire(wire));
            assert_eq!(err.field, *field, "{name}: {err}");
            if let Problem::Malformed(_) = problem {
                assert!(matches!(err.problem, Problem::Malformed(_)), "{name}: {err}");
            } else {
                assert_eq!(err.problem, *problem, "{name}: {err}");
            }
        }
        Ok(())
    }

    #[test]
    fn redaction_hides_secrets_and_keeps_the_rest() -> TestResult {
        let shape = rich_shape()?;
        let wire = pb::ClusterShape::from(&shape);
        for read in [redacted(&wire), shape_to_wire_redacted(&shape)] {
            let Some(t) = read.groups[0].template.as_ref() else {
                panic!("the template is kept");
            };
            assert_eq!(t.boot["token"].value, REDACTED);
            assert!(t.boot["token"].secret);
            assert_eq!(t.join["ca"].value, REDACTED);
            assert_eq!(t.boot["mode"].value, "fast");
            assert_eq!(t.join["cluster"].value, "c-1");
            assert_eq!(t.image, "registry/trainer:7");
            assert_eq!(read.groups[1], wire.groups[1]);
            let redacted_text = format!("{read:?}");
            assert!(!redacted_text.contains("s3cr3t") && !redacted_text.contains("BEGIN"));
        }
        // The input is not touched.
        assert_eq!(shape_from_wire(wire)?, shape);
        Ok(())
    }

    fn rich_node(spec: Arc<NodeTemplate>, failed_spec: Arc<NodeTemplate>) -> Result<ManagedNode, FieldError> {
        let attempt = AttemptId::new(42);
        Ok(ManagedNode {
            id: LogicalNodeId::parse("node_id", "gpu-3")?,
            attempt,
            spec,
            intent: Intent::Deleting,
            stage: NodeStage::BootstrapRunning,
            facts: NodeFacts {
                lease: Some(LeaseId::new("lease", "lease-17")?),
                endpoint: Some(Endpoint::new("endpoint", "127.0.0.1:4242")?),
                session: Some(SessionId::new("session", "sess-9")?),
                bootstrap: Some(BootstrapProgress {
                    stage: BootstrapStage::FailedJoin,
                    seq: 7,
                    at: UnixMillis::new(1_700_000_000_100),
                    // Not on the wire.
                    detail: String::new(),
                }),
                failure: Some(Failure {
                    reason: "join refused".to_owned(),
                    at: UnixMillis::new(1_700_000_000_200),
                }),
                ambiguous_create: true,
                ambiguous_bootstrap: true,
                lost: true,
                health: Some(NodeHealth {
                    healthy: false,
                    since: UnixMillis::new(1_700_000_000_400),
                    observed_at: UnixMillis::new(1_700_000_000_500),
                    seq: 9,
                    detail: "no answer within 500 ms".to_owned(),
                    remediate_at: Some(UnixMillis::new(1_700_000_030_400)),
                }),
            },
            pending: Some(PendingOp {
                id: OperationId::new(attempt, 5),
                effect: Effect::CancelBootstrap,
                deadline: UnixMillis::new(1_700_000_030_000),
                dispatched_at: UnixMillis::new(1_700_000_000_300),
            }),
            retry: RetryState {
                consecutive_failures: 4,
                next_effect_at: Some(UnixMillis::new(1_700_000_008_000)),
                restart_at: Some(UnixMillis::new(1_700_000_009_000)),
                permanent: Some(PermanentFailure {
                    reason: "image not found".to_owned(),
                    spec: failed_spec,
                }),
                remediating: true,
            },
            stage_deadline: Some(UnixMillis::new(1_700_000_060_000)),
            surge: Surge::Current {
                successor: AttemptId::new(43),
                successor_ready: true,
            },
        })
    }

    #[test]
    fn a_node_with_every_fact_round_trips() -> TestResult {
        let node = rich_node(
            Arc::new(rich_template()),
            Arc::new(example_template("process", "bad:1")),
        )?;
        let mut table = TemplateTable::default();
        let wire = reencode(&node_to_wire(&node, &mut table))?;
        assert_eq!(table.len(), 2);
        let templates = TemplateTable::from_wire(table.into_wire())?;
        assert_eq!(node_from_wire(wire, &templates)?, node);
        Ok(())
    }

    #[test]
    fn a_fresh_node_round_trips() -> TestResult {
        let node = ManagedNode::new(
            LogicalNodeId::parse("node_id", "cpu-0")?,
            AttemptId::new(1),
            Arc::new(example_template("fake", "img:1")),
            RetryState::default(),
        );
        let mut table = TemplateTable::default();
        let wire = node_to_wire(&node, &mut table);
        let templates = TemplateTable::from_wire(table.into_wire())?;
        assert_eq!(node_from_wire(wire.clone(), &templates)?, node);
        // Absent facts and retry state are their defaults.
        let bare = pb::NodeState {
            facts: None,
            retry: None,
            ..wire
        };
        assert_eq!(node_from_wire(bare, &templates)?, node);
        Ok(())
    }

    #[test]
    fn an_empty_failure_reason_survives_as_a_placeholder() -> TestResult {
        let spec = Arc::new(example_template("fake", "img:1"));
        let mut node = rich_node(Arc::clone(&spec), Arc::clone(&spec))?;
        if let Some(p) = node.retry.permanent.as_mut() {
            p.reason.clear();
        }
        let mut table = TemplateTable::default();
        let wire = node_to_wire(&node, &mut table);
        let templates = TemplateTable::from_wire(table.into_wire())?;
        let back = node_from_wire(wire, &templates)?;
        assert_eq!(back.retry.permanent.map(|p| p.reason), Some(NO_REASON.to_owned()));
        Ok(())
    }

    #[test]
    fn bad_nodes_name_the_field() -> TestResult {
        let node = rich_node(
            Arc::new(rich_template()),
            Arc::new(example_template("process", "bad:1")),
        )?;
        let mut table = TemplateTable::default();
        let good = node_to_wire(&node, &mut table);
        let templates = TemplateTable::from_wire(table.into_wire())?;

        type Mutate = fn(&mut pb::NodeState);
        let cases: &[(Mutate, &str, Problem)] = &[
            (
                |n| n.template_ref = 2,
                "template_ref",
                Problem::OverLimit { value: 2, limit: 1 },
            ),
            (
                |n| {
                    if let Some(r) = n.retry.as_mut() {
                        r.permanent_template_ref = 9;
                    }
                },
                "retry.permanent_template_ref",
                Problem::OverLimit { value: 9, limit: 1 },
            ),
            (|n| n.stage = 99, "stage", Problem::UnknownValue(99)),
            (|n| n.intent = 0, "intent", Problem::UnknownValue(0)),
            (
                |n| {
                    if let Some(f) = n.facts.as_mut() {
                        f.bootstrap_stage = 42;
                    }
                },
                "facts.bootstrap_stage",
                Problem::UnknownValue(42),
            ),
            (
                |n| {
                    if let Some(p) = n.pending.as_mut() {
                        p.effect = 0;
                    }
                },
                "pending.effect",
                Problem::UnknownValue(0),
            ),
            (
                |n| {
                    if let Some(p) = n.pending.as_mut() {
                        p.id = None;
                    }
                },
                "pending.id",
                Problem::Missing,
            ),
            (
                |n| {
                    if let Some(p) = n.pending.as_mut() {
                        p.deadline_ms = 0;
                    }
                },
                "pending.deadline_ms",
                Problem::Missing,
            ),
        ];
        for (mutate, field, problem) in cases {
            let mut wire = good.clone();
            mutate(&mut wire);
            assert_eq!(
                err_of(node_from_wire(wire, &templates)),
                FieldError::new(*field, problem.clone())
            );
        }

        let mut wire = good.clone();
        wire.attempt = 0;
        assert_eq!(err_of(node_from_wire(wire, &templates)).field, "attempt");
        let mut wire = good.clone();
        if let Some(p) = wire.pending.as_mut() {
            p.id = Some(pb::OperationId { attempt: 0, seq: 1 });
        }
        assert_eq!(
            err_of(node_from_wire(wire, &templates)).field,
            "pending.id.attempt"
        );
        let mut wire = good.clone();
        wire.node_id = "gpu".to_owned();
        assert_eq!(err_of(node_from_wire(wire, &templates)).field, "node_id");
        let err = err_of(node_from_wire(good, &[]));
        assert_eq!(err.field, "template_ref");
        assert!(matches!(err.problem, Problem::Malformed(_)));
        Ok(())
    }

    #[test]
    fn one_shared_template_is_interned_once() -> TestResult {
        let spec = Arc::new(rich_template());
        let mut table = TemplateTable::default();
        for i in 0..1000 {
            let node = ManagedNode::new(
                LogicalNodeId::new(GroupId::parse("id", "gpu")?, i),
                AttemptId::new(u64::from(i) + 1),
                Arc::clone(&spec),
                RetryState::default(),
            );
            assert_eq!(node_to_wire(&node, &mut table).template_ref, 0);
        }
        assert_eq!(table.len(), 1);

        // An equal template in another allocation shares the entry; a different one does not.
        let twin = Arc::new(rich_template());
        assert_eq!(table.intern(&twin), 0);
        assert_eq!(table.intern(&twin), 0);
        let other = Arc::new(example_template("fake", "img:2"));
        assert_eq!(table.intern(&other), 1);
        assert_eq!(table.len(), 2);
        assert_eq!(table.into_wire().len(), 2);
        Ok(())
    }

    #[test]
    fn template_table_errors_name_the_entry() {
        let mut bad = pb::NodeTemplate::from(&rich_template());
        if let Some(p) = bad.provider.as_mut() {
            p.cpu = f64::NAN;
        }
        let ok = pb::NodeTemplate::from(&rich_template());
        assert_eq!(
            err_of(TemplateTable::from_wire(vec![ok, bad])),
            FieldError::new("templates[1].provider.cpu", Problem::NotFinite)
        );
    }

    #[test]
    fn a_shape_with_a_template_table_shares_arcs_with_nodes() -> TestResult {
        let shape = rich_shape()?;
        let node = ManagedNode::new(
            LogicalNodeId::parse("node_id", "gpu-0")?,
            AttemptId::new(1),
            Arc::clone(&shape.groups[0].template),
            RetryState::default(),
        );
        let mut table = TemplateTable::default();
        let (desired, refs) = shape_to_wire_with_table(&shape, &mut table);
        let node_wire = node_to_wire(&node, &mut table);
        assert_eq!(table.len(), 2);
        assert!(desired.groups.iter().all(|g| g.template.is_none()));

        let templates = TemplateTable::from_wire(table.into_wire())?;
        let back = shape_from_wire_with_table(Some(desired.clone()), &refs, &templates)?;
        assert_eq!(back, shape);
        let node_back = node_from_wire(node_wire, &templates)?;
        assert!(Arc::ptr_eq(&back.groups[0].template, &node_back.spec));

        // Inline templates still work without refs.
        let inline = pb::ClusterShape::from(&shape);
        assert_eq!(shape_from_wire_with_table(Some(inline.clone()), &[], &[])?, shape);

        assert_eq!(
            err_of(shape_from_wire_with_table(None, &refs, &templates)),
            FieldError::new("desired", Problem::Missing)
        );
        assert_eq!(
            err_of(shape_from_wire_with_table(
                Some(desired.clone()),
                &refs[..1],
                &templates
            ))
            .field,
            "group_template_refs"
        );
        assert_eq!(
            err_of(shape_from_wire_with_table(
                Some(desired.clone()),
                &[0, 5],
                &templates
            )),
            FieldError::new(
                "group_template_refs[1]",
                Problem::OverLimit { value: 5, limit: 1 }
            )
        );
        assert_eq!(
            err_of(shape_from_wire_with_table(Some(inline), &refs, &templates)).field,
            "desired.groups[0].template"
        );
        let mut bad = desired;
        bad.groups[1].count = -3;
        assert_eq!(
            err_of(shape_from_wire_with_table(Some(bad), &refs, &templates)),
            FieldError::new("desired.groups[1].count", Problem::Negative)
        );
        Ok(())
    }

    fn uid() -> RunUid {
        RunUid::from_u128(0x0123_4567_89ab_cdef_0011_2233_4455_6677)
    }

    fn trace() -> TraceContext {
        TraceContext {
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
            tracestate: "vendor=1".to_owned(),
        }
    }

    fn operation(input: OperationInput) -> Result<Operation, FieldError> {
        Ok(Operation {
            run_uid: uid(),
            run_id: RunId::parse("run_id", "train-7")?,
            node: LogicalNodeId::parse("node_id", "gpu-3")?,
            id: OperationId::new(AttemptId::new(42), 2),
            epoch: Epoch::new(9),
            deadline: UnixMillis::new(1_700_000_030_000),
            provider: "fake".into(),
            input,
            trace: trace(),
        })
    }

    #[test]
    fn every_operation_input_round_trips() -> TestResult {
        let template = rich_template();
        let inputs = [
            OperationInput::CreateLease {
                template: Arc::new(template.clone()),
            },
            OperationInput::LookupEndpoint {
                lease: LeaseId::new("lease", "lease-17")?,
            },
            OperationInput::StartBootstrap {
                lease: LeaseId::new("lease", "lease-17")?,
                endpoint: Endpoint::new("endpoint", "127.0.0.1:4242")?,
                boot: template.boot.clone(),
                join: template.join.clone(),
            },
            OperationInput::CancelBootstrap {
                session: Some(SessionId::new("session", "sess-9")?),
            },
            OperationInput::CancelBootstrap { session: None },
            OperationInput::DestroyLease {
                lease: Some(LeaseId::new("lease", "lease-17")?),
            },
            OperationInput::DestroyLease { lease: None },
        ];
        for input in inputs {
            let op = operation(input)?;
            let wire = reencode(&pb::Operation::from(&op))?;
            assert_eq!(Operation::try_from(wire)?, op);
        }
        // The empty trace context is sent as absent and read back as empty.
        let mut op = operation(OperationInput::DestroyLease { lease: None })?;
        op.trace = TraceContext::default();
        let wire = pb::Operation::from(&op);
        assert!(wire.trace.is_none());
        assert_eq!(Operation::try_from(wire)?, op);
        Ok(())
    }

    #[test]
    fn bad_operations_name_the_field() -> TestResult {
        let good = pb::Operation::from(&operation(OperationInput::CreateLease {
            template: Arc::new(rich_template()),
        })?);
        type Mutate = fn(&mut pb::Operation);
        let cases: &[(Mutate, &str)] = &[
            (|o| o.run_uid = "xyz".to_owned(), "run_uid"),
            (|o| o.run_id.clear(), "run_id"),
            (|o| o.node_id = "gpu-03".to_owned(), "node_id"),
            (|o| o.id = None, "id"),
            (
                |o| o.id = Some(pb::OperationId { attempt: 0, seq: 1 }),
                "id.attempt",
            ),
            (|o| o.deadline_ms = 0, "deadline_ms"),
            (|o| o.input = None, "input"),
            (
                |o| {
                    o.input = Some(pb::operation::Input::CreateLease(pb::CreateLeaseInput {
                        template: None,
                    }))
                },
                "create_lease.template",
            ),
            (
                |o| {
                    if let Some(pb::operation::Input::CreateLease(c)) = o.input.as_mut()
                        && let Some(p) = c.template.as_mut().and_then(|t| t.provider.as_mut())
                    {
                        p.cpu = f64::NAN;
                    }
                },
                "create_lease.template.provider.cpu",
            ),
            (
                |o| {
                    o.input = Some(pb::operation::Input::LookupEndpoint(
                        pb::LookupEndpointInput::default(),
                    ))
                },
                "lookup_endpoint.lease_id",
            ),
            (
                |o| {
                    o.input = Some(pb::operation::Input::StartBootstrap(pb::StartBootstrapInput {
                        lease_id: "lease-1".to_owned(),
                        ..Default::default()
                    }))
                },
                "start_bootstrap.endpoint",
            ),
        ];
        for (mutate, field) in cases {
            let mut wire = good.clone();
            mutate(&mut wire);
            assert_eq!(err_of(Operation::try_from(wire)).field, *field);
        }
        Ok(())
    }

    #[test]
    fn every_outcome_class_round_trips() -> TestResult {
        let outcomes = [
            Outcome::Succeeded(ResultFacts {
                lease: Some(LeaseId::new("lease", "lease-17")?),
                endpoint: Some(Endpoint::new("endpoint", "127.0.0.1:4242")?),
                session: Some(SessionId::new("session", "sess-9")?),
            }),
            Outcome::Succeeded(ResultFacts::default()),
            Outcome::NotReady {
                reason: "port not bound".to_owned(),
            },
            Outcome::Retryable {
                reason: "quota busy".to_owned(),
            },
            Outcome::Permanent {
                reason: "no such image".to_owned(),
            },
            Outcome::Ambiguous {
                reason: "deadline".to_owned(),
            },
        ];
        for (i, outcome) in outcomes.into_iter().enumerate() {
            let result = OperationResult {
                run_uid: uid(),
                node: LogicalNodeId::parse("node_id", "gpu-3")?,
                id: OperationId::new(AttemptId::new(42), 2),
                effect: Effect::ALL[i % Effect::ALL.len()],
                outcome,
                completed_at: UnixMillis::new(1_700_000_001_000),
                late: i % 2 == 0,
                replayed: i % 3 == 0,
                trace: trace(),
            };
            let wire = reencode(&pb::OperationResult::from(&result))?;
            assert_eq!(OperationResult::try_from(wire)?, result);
        }
        assert_eq!(
            err_of(outcome_from_wire(0, String::new(), None)),
            FieldError::new("outcome", Problem::UnknownValue(0))
        );
        assert_eq!(
            err_of(outcome_from_wire(77, String::new(), None)),
            FieldError::new("outcome", Problem::UnknownValue(77))
        );
        Ok(())
    }

    #[test]
    fn observations_claims_rejections_and_resources_round_trip() -> TestResult {
        let obs = Observation {
            run_uid: uid(),
            node: LogicalNodeId::parse("node_id", "gpu-3")?,
            attempt: AttemptId::new(42),
            session: SessionId::new("session", "sess-9")?,
            seq: 12,
            stage: BootstrapStage::AgentStarted,
            detail: "agent pid 4242".to_owned(),
            at: UnixMillis::new(1_700_000_002_000),
            trace: trace(),
        };
        let wire = reencode(&pb::BootstrapObservation::from(&obs))?;
        assert_eq!(Observation::try_from(wire.clone())?, obs);
        let unset_stage = pb::BootstrapObservation { stage: 0, ..wire };
        assert_eq!(
            err_of(Observation::try_from(unset_stage)),
            FieldError::new("stage", Problem::UnknownValue(0))
        );

        let claim = Claim {
            run_uid: uid(),
            run_id: RunId::parse("run_id", "train-7")?,
            epoch: Epoch::new(3),
        };
        assert_eq!(Claim::try_from(reencode(&pb::Claim::from(&claim))?)?, claim);

        for (id, reason) in [
            (None, RejectionReason::Fenced),
            (
                Some(OperationId::new(AttemptId::new(42), 2)),
                RejectionReason::ConflictingInput,
            ),
            (None, RejectionReason::UnknownRun),
            (None, RejectionReason::Invalid),
        ] {
            let rejection = Rejection {
                run_uid: uid(),
                id,
                reason,
                message: "no".to_owned(),
                highest_epoch: Epoch::new(4),
            };
            let wire = reencode(&pb::Rejection::from(&rejection))?;
            assert_eq!(Rejection::try_from(wire)?, rejection);
        }

        let identity = operation(OperationInput::DestroyLease { lease: None })?.identity();
        let resource = pb::Resource {
            lease_id: "lease-17".to_owned(),
            session_live: true,
            ..pb::Resource::from(&identity)
        };
        assert_eq!(ResourceIdentity::try_from(&resource)?, identity);

        let held = InventoryResource {
            identity: identity.clone(),
            lease: Some(LeaseId::new("lease", "lease-17")?),
            endpoint: Some(Endpoint::new("endpoint", "127.0.0.1:4242")?),
            session_live: true,
            epoch: Epoch::new(3),
        };
        let bare = InventoryResource {
            lease: None,
            endpoint: None,
            session_live: false,
            epoch: Epoch::default(),
            ..held.clone()
        };
        for r in [held, bare] {
            let wire = reencode(&pb::Resource::from(&r))?;
            assert_eq!(InventoryResource::try_from(&wire)?, r);
        }
        let unnamed = pb::Resource {
            node_id: String::new(),
            ..pb::Resource::from(&identity)
        };
        assert_eq!(err_of(InventoryResource::try_from(&unnamed)).field, "node_id");
        Ok(())
    }

    #[test]
    fn decisions_with_every_action_round_trip() -> TestResult {
        let node = LogicalNodeId::parse("node_id", "gpu-3")?;
        let mut cases = vec![
            (Rule::Insert, Action::Insert),
            (Rule::Reap, Action::Reap),
            (Rule::Restart, Action::Restart),
            (Rule::BeginDelete, Action::BeginDelete),
            (Rule::MarkDestroyed, Action::MarkDestroyed),
            (Rule::ObserveConvergence, Action::ObserveConvergence),
            (Rule::Pending, Action::Wait { until: None }),
            (
                Rule::RetryBackoff,
                Action::Wait {
                    until: Some(UnixMillis::new(1_700_000_005_000)),
                },
            ),
        ];
        cases.extend(Effect::ALL.map(|e| (Rule::StartBootstrap, Action::Dispatch(e))));
        for (rule, action) in cases {
            let decision = Decision {
                node: node.clone(),
                attempt: (rule != Rule::Insert).then_some(AttemptId::new(42)),
                rule,
                action,
                reason: Cow::Borrowed("because"),
            };
            let wire = reencode(&pb::Decision::from(&decision))?;
            assert_eq!(Decision::try_from(wire)?, decision);
        }
        for rule in Rule::ALL {
            assert_eq!(rule_from_wire(rule.number())?, rule);
        }

        let good = pb::Decision::from(&Decision {
            node,
            attempt: Some(AttemptId::new(42)),
            rule: Rule::CreateLease,
            action: Action::Dispatch(Effect::CreateLease),
            reason: Cow::Borrowed("no lease"),
        });
        let insert = Decision::try_from(pb::Decision {
            attempt: 0,
            ..good.clone()
        })?;
        assert_eq!(insert.attempt, None);
        assert_eq!(
            err_of(Decision::try_from(pb::Decision {
                rule: 20,
                ..good.clone()
            })),
            FieldError::new("rule", Problem::UnknownValue(20))
        );
        assert_eq!(
            err_of(Decision::try_from(pb::Decision {
                kind: 0,
                ..good.clone()
            })),
            FieldError::new("kind", Problem::UnknownValue(0))
        );
        assert_eq!(
            err_of(Decision::try_from(pb::Decision { effect: 0, ..good })),
            FieldError::new("effect", Problem::UnknownValue(0))
        );
        Ok(())
    }

    #[test]
    fn enums_round_trip_and_refuse_unspecified() -> TestResult {
        for s in NodeStage::ALL {
            assert_eq!(NodeStage::try_from(pb::NodeStage::from(s))?, s);
        }
        for e in Effect::ALL {
            assert_eq!(Effect::try_from(pb::Effect::from(e))?, e);
        }
        for i in [Intent::Active, Intent::Deleting] {
            assert_eq!(Intent::try_from(pb::Intent::from(i))?, i);
        }
        for n in 1..=10 {
            let w = pb::BootstrapStage::try_from(n)?;
            let d = BootstrapStage::try_from(w)?;
            assert_eq!(pb::BootstrapStage::from(d), w);
        }
        for n in 1..=4 {
            let w = pb::RejectionReason::try_from(n)?;
            assert_eq!(pb::RejectionReason::from(RejectionReason::try_from(w)?), w);
        }
        assert_eq!(
            err_of(NodeStage::try_from(pb::NodeStage::Unspecified)).problem,
            Problem::UnknownValue(0)
        );
        assert_eq!(
            err_of(Effect::try_from(pb::Effect::Unspecified)).within("effect"),
            FieldError::new("effect", Problem::UnknownValue(0))
        );
        Ok(())
    }
}
