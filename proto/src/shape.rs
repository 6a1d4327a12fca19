//! The desired state: a run's shape, its groups and their node templates, with
//! the validation every shape passes before the driver accepts it.

use std::{collections::BTreeMap, sync::Arc};

use crate::{
    error::{FieldError, Problem},
    health::GroupPolicy,
    ids::{Generation, GroupId, LogicalNodeId, RunId},
};

/// A boot or join parameter. Secret values never appear in logs or reads.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Param {
    pub value: String,
    pub secret: bool,
}

impl std::fmt::Debug for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.secret {
            f.write_str("<redacted>")
        } else {
            write!(f, "{:?}", self.value)
        }
    }
}

/// Boot or join parameters, ordered so that equal maps compare and hash equal.
pub type Params = BTreeMap<String, Param>;

#[derive(Debug, Clone, PartialEq)]
pub struct Accelerator {
    pub kind: String,
    pub count: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ProviderShape {
    /// Backend name, e.g. `fake` or `process`.
    pub name: String,
    pub machine_type: String,
    pub cpu: f64,
    pub memory_gib: f64,
    pub accelerators: Vec<Accelerator>,
    pub zone: String,
    pub labels: BTreeMap<String, String>,
}

/// The immutable template of an attempt. Any difference between a node's
/// template and its group's current one is drift, and drift replaces the attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeTemplate {
    pub role: String,
    pub provider: ProviderShape,
    pub image: String,
    pub boot: Params,
    pub join: Params,
}

impl NodeTemplate {
    /// Equality with a cheap pointer check first: templates are shared through
    /// `Arc` between a group and its nodes, so the common case is one compare.
    pub fn same(a: &Arc<NodeTemplate>, b: &Arc<NodeTemplate>) -> bool {
        Arc::ptr_eq(a, b) || **a == **b
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct NodeGroup {
    pub id: GroupId,
    pub count: u32,
    pub template: Arc<NodeTemplate>,
    /// Health probing and the remediation budget; outside the template, so
    /// changing it replaces nothing.
    pub policy: GroupPolicy,
}

impl NodeGroup {
    /// A group with the default policy.
    pub fn new(id: GroupId, count: u32, template: Arc<NodeTemplate>) -> Self {
        Self {
            id,
            count,
            template,
            policy: GroupPolicy::default(),
        }
    }
}

/// A run's desired shape at one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterShape {
    pub run_id: RunId,
    pub generation: Generation,
    pub groups: Vec<NodeGroup>,
    /// The run's labels: content (a change is a new generation), in no
    /// node's template (nothing is replaced for them).
    pub labels: BTreeMap<String, String>,
}

/// At most this many labels on a run.
pub const MAX_LABELS: usize = 64;
/// The longest label key or value.
pub const MAX_LABEL_LEN: usize = 63;

/// A label key (`name`: not empty) or value: at most [`MAX_LABEL_LEN`]
/// letters, digits, `-`, `_`, `.` or `/`.
fn check_label(field: &str, s: &str, key: bool) -> Result<(), FieldError> {
    if key && s.is_empty() {
        return Err(FieldError::new(field, Problem::Empty));
    }
    if s.len() > MAX_LABEL_LEN {
        return Err(FieldError::new(
            field,
            Problem::TooLong {
                len: s.len(),
                max: MAX_LABEL_LEN,
            },
        ));
    }
    if !s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    {
        return Err(FieldError::new(
            field,
            Problem::Malformed("only letters, digits, '-', '_', '.' and '/'"),
        ));
    }
    Ok(())
}

/// Configured limits a shape must fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeLimits {
    pub max_groups: usize,
    pub max_nodes_per_group: u32,
    pub max_nodes_total: u64,
    pub max_params: usize,
    pub max_string_len: usize,
    /// Upper bound on the encoded size of one shape.
    pub max_payload_bytes: usize,
}

impl Default for ShapeLimits {
    fn default() -> Self {
        Self {
            max_groups: 256,
            max_nodes_per_group: 100_000,
            max_nodes_total: 200_000,
            max_params: 256,
            max_string_len: 4096,
            max_payload_bytes: 1 << 20,
        }
    }
}

impl ClusterShape {
    /// The group that holds `node`'s slot, if the slot is desired.
    pub fn desired_group(&self, node: &LogicalNodeId) -> Option<&NodeGroup> {
        self.groups
            .iter()
            .find(|g| &g.id == node.group() && node.index() < g.count)
    }

    pub fn group(&self, id: &GroupId) -> Option<&NodeGroup> {
        self.groups.iter().find(|g| &g.id == id)
    }

    pub fn total_nodes(&self) -> u64 {
        self.groups.iter().map(|g| u64::from(g.count)).sum()
    }

    /// The same content, ignoring the generation: the revision contract's test.
    pub fn same_content(&self, other: &ClusterShape) -> bool {
        self.run_id == other.run_id && self.groups == other.groups && self.labels == other.labels
    }

    /// Checks everything the type cannot: uniqueness, finiteness, signs and the
    /// configured limits. Field paths are relative to the shape.
    pub fn validate(&self, limits: &ShapeLimits) -> Result<(), FieldError> {
        if self.generation.get() == 0 {
            return Err(FieldError::new(
                "generation",
                Problem::Malformed("must be at least 1"),
            ));
        }
        if self.labels.len() > MAX_LABELS {
            return Err(FieldError::new(
                "labels",
                Problem::OverLimit {
                    value: self.labels.len() as u64,
                    limit: MAX_LABELS as u64,
                },
            ));
        }
        for (k, v) in &self.labels {
            check_label(&format!("labels[{k:?}]"), k, true)?;
            check_label(&format!("labels[{k:?}]"), v, false)?;
        }
        if self.groups.len() > limits.max_groups {
            return Err(FieldError::new(
                "groups",
                Problem::OverConfiguredLimit {
                    said: "are",
                    value: self.groups.len() as u64,
                    noun: " groups",
                    limit: Some(limits.max_groups as u64),
                    flag: "max-groups",
                },
            ));
        }
        for (i, g) in self.groups.iter().enumerate() {
            let path = format!("groups[{i}]");
            if self.groups[..i].iter().any(|earlier| earlier.id == g.id) {
                return Err(FieldError::new(format!("{path}.id"), Problem::Duplicate));
            }
            if g.count > limits.max_nodes_per_group {
                return Err(FieldError::new(
                    format!("{path}.count"),
                    Problem::OverConfiguredLimit {
                        said: "is",
                        value: u64::from(g.count),
                        noun: "",
                        limit: Some(u64::from(limits.max_nodes_per_group)),
                        flag: "max-nodes-per-group",
                    },
                ));
            }
            validate_template(&g.template, limits).map_err(|e| e.within(&format!("{path}.template")))?;
            g.policy.validate().map_err(|e| e.within(&path))?;
        }
        let total = self.total_nodes();
        if total > limits.max_nodes_total {
            return Err(FieldError::new(
                "groups",
                Problem::OverConfiguredLimit {
                    said: "hold",
                    value: total,
                    noun: " nodes in all",
                    limit: Some(limits.max_nodes_total),
                    flag: "max-nodes-total",
                },
            ));
        }
        Ok(())
    }
}

fn check_string(field: &str, s: &str, limits: &ShapeLimits) -> Result<(), FieldError> {
    if s.len() > limits.max_string_len {
        return Err(FieldError::new(
            field,
            Problem::TooLong {
                len: s.len(),
                max: limits.max_string_len,
            },
        ));
    }
    Ok(())
}

fn check_number(field: &str, v: f64) -> Result<(), FieldError> {
    if !v.is_finite() {
        return Err(FieldError::new(field, Problem::NotFinite));
    }
    if v < 0.0 {
        return Err(FieldError::new(field, Problem::Negative));
    }
    Ok(())
}

fn check_params(field: &str, params: &Params, limits: &ShapeLimits) -> Result<(), FieldError> {
    if params.len() > limits.max_params {
        return Err(FieldError::new(
            field,
            Problem::OverLimit {
                value: params.len() as u64,
                limit: limits.max_params as u64,
            },
        ));
    }
    for (k, v) in params {
        if k.is_empty() {
            return Err(FieldError::new(format!("{field}[\"\"]"), Problem::Empty));
        }
        check_string(&format!("{field}[{k:?}]"), k, limits)?;
        check_string(&format!("{field}[{k:?}]"), &v.value, limits)?;
    }
    Ok(())
}

fn validate_template(t: &NodeTemplate, limits: &ShapeLimits) -> Result<(), FieldError> {
    check_string("role", &t.role, limits)?;
    if t.image.is_empty() {
        return Err(FieldError::new("image", Problem::Empty));
    }
    check_string("image", &t.image, limits)?;
    let p = &t.provider;
    if p.name.is_empty() {
        return Err(FieldError::new("provider.name", Problem::Empty));
    }
    check_string("provider.name", &p.name, limits)?;
    check_string("provider.machine_type", &p.machine_type, limits)?;
    check_string("provider.zone", &p.zone, limits)?;
    check_number("provider.cpu", p.cpu)?;
    check_number("provider.memory_gib", p.memory_gib)?;
    for (i, a) in p.accelerators.iter().enumerate() {
        if a.kind.is_empty() {
            return Err(FieldError::new(
                format!("provider.accelerators[{i}].kind"),
                Problem::Empty,
            ));
        }
        check_string(&format!("provider.accelerators[{i}].kind"), &a.kind, limits)?;
    }
    if p.labels.len() > limits.max_params {
        return Err(FieldError::new(
            "provider.labels",
            Problem::OverLimit {
                value: p.labels.len() as u64,
                limit: limits.max_params as u64,
            },
        ));
    }
    for (k, v) in &p.labels {
        check_string(&format!("provider.labels[{k:?}]"), k, limits)?;
        check_string(&format!("provider.labels[{k:?}]"), v, limits)?;
    }
    check_params("boot", &t.boot, limits)?;
    check_params("join", &t.join, limits)?;
    Ok(())
}

/// A small valid template, for examples and tests.
pub fn example_template(provider: &str, image: &str) -> NodeTemplate {
    NodeTemplate {
        role: "worker".to_owned(),
        provider: ProviderShape {
            name: provider.to_owned(),
            machine_type: "standard-4".to_owned(),
            cpu: 4.0,
            memory_gib: 16.0,
            accelerators: Vec::new(),
            zone: "local-a".to_owned(),
            labels: BTreeMap::new(),
        },
        image: image.to_owned(),
        boot: Params::new(),
        join: Params::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_checked_and_are_content() {
        let mut s = shape();
        let before = s.clone();
        s.labels.insert("team".into(), "ml".into());
        assert!(s.validate(&ShapeLimits::default()).is_ok());
        assert!(!s.same_content(&before), "a label change is a change");
        for (k, v, field) in [
            ("", "x", "labels[\"\"]"),
            ("a b", "x", "labels[\"a b\"]"),
            ("k", "v v", "labels[\"k\"]"),
            ("k", &"v".repeat(64), "labels[\"k\"]"),
        ] {
            let mut bad = before.clone();
            bad.labels.insert(k.to_owned(), v.to_owned());
            let e = bad.validate(&ShapeLimits::default()).unwrap_err();
            assert_eq!(e.field, field, "{k:?}={v:?}: {e}");
        }
        let mut many = before.clone();
        for i in 0..65 {
            many.labels.insert(format!("k{i}"), String::new());
        }
        assert_eq!(
            many.validate(&ShapeLimits::default()).unwrap_err().field,
            "labels"
        );
    }

    fn shape() -> ClusterShape {
        ClusterShape {
            run_id: RunId::parse("run_id", "r").unwrap(),
            generation: Generation::new(1),
            labels: Default::default(),
            groups: vec![NodeGroup {
                id: GroupId::parse("id", "workers").unwrap(),
                count: 3,
                template: Arc::new(example_template("fake", "img:1")),
                policy: Default::default(),
            }],
        }
    }

    #[test]
    fn validation_names_the_field() {
        let limits = ShapeLimits::default();
        assert!(shape().validate(&limits).is_ok());

        let mut s = shape();
        s.groups.push(s.groups[0].clone());
        assert_eq!(s.validate(&limits).unwrap_err().field, "groups[1].id");

        let mut s = shape();
        Arc::make_mut(&mut s.groups[0].template).provider.cpu = f64::NAN;
        assert_eq!(
            s.validate(&limits).unwrap_err(),
            FieldError::new("groups[0].template.provider.cpu", Problem::NotFinite)
        );

        let mut s = shape();
        Arc::make_mut(&mut s.groups[0].template).provider.memory_gib = -1.0;
        assert_eq!(s.validate(&limits).unwrap_err().problem, Problem::Negative);

        let mut s = shape();
        s.groups[0].count = limits.max_nodes_per_group + 1;
        let e = s.validate(&limits).unwrap_err();
        assert_eq!(e.field, "groups[0].count");
        assert_eq!(
            e.to_string(),
            "groups[0].count is 100001; the limit is 100000 (driver-svc --max-nodes-per-group)"
        );

        // The total is about every group, and names its own flag.
        let mut s = shape();
        s.groups[0].count = 3;
        s.groups.push(NodeGroup {
            id: GroupId::parse("id", "more").unwrap(),
            ..s.groups[0].clone()
        });
        let small = ShapeLimits {
            max_nodes_total: 5,
            ..limits
        };
        assert_eq!(
            s.validate(&small).unwrap_err().to_string(),
            "groups hold 6 nodes in all; the limit is 5 (driver-svc --max-nodes-total)"
        );

        let mut s = shape();
        s.generation = Generation::new(0);
        assert_eq!(s.validate(&limits).unwrap_err().field, "generation");
    }
}
