//! The shape file format clients write (YAML or JSON), converted to the wire
//! shape and checked locally before anything is sent.
//!
//! Unknown fields are errors, and every error names the file location (line
//! and column) and the field path, so a typo never silently becomes a default
//! and a user never has to guess which of many groups is wrong. A file that
//! parses is then put through the same decoding and validation the driver
//! runs (`contract::wire::shape_from_wire` and `ClusterShape::validate` with
//! the default limits); an error found there is located in the file by its
//! field path with [`locate`].
//!
//! ```yaml
//! run_id: demo             # required: lowercase letters, digits, '-'
//! generation: 1            # optional: provisionctl fills in the next one
//! labels: { team: ml, env: prod }  # optional: the run's, for `list -l team=ml`
//! groups:
//!   - id: workers          # required: slots are named workers-0, workers-1, ...
//!     count: 8             # required: 0 or more
//!     template:
//!       role: worker       # optional
//!       image: img:1       # required
//!       provider: { name: fake, machine_type: standard-4, cpu: 4, memory_gib: 16, zone: local-a,
//!                   accelerators: [{ kind: a100, count: 1 }], labels: { pool: general } }
//!       boot: { greeting: hello, token: { value: s3cret, secret: true } }
//!       join: { cluster: demo }
//!     health:              # optional; outside the template, so changing it replaces nothing
//!       probe: tcp         # tcp | none (the default: not probed)
//!       interval: 10s      # between probes; timeout: 2s; startup_grace: 0s
//!       unhealthy_after: 30s   # unhealthy this long: due for replacement
//!     remediation:         # optional: the budget for replacing unhealthy nodes
//!       max_in_flight: 1   # replaced at once (0: report, never replace)
//!       max_unhealthy: 40% # more unhealthy or lost than this: replace none
//!     rollout:             # optional: how a template change replaces the group's nodes
//!       max_unavailable: 1 # desired nodes unavailable at once (default 25%, rounded down)
//!       max_surge: 25%     # successors beyond the count (default 25%, rounded up)
//!       canary: 2          # pause after 2 replacements until `provisionctl rollout promote`
//!       progress_deadline: 10m # no new node ready this long: the rollout halts
//!       failure_threshold: 3   # this many failed new attempts: the rollout halts (0: off)
//!       auto_revert: true  # a halted rollout goes back to the last converged template
//! ```
//!
//! A boot or join parameter is a string (numbers and booleans are taken as
//! their text) or `{ value, secret }`; secret values are redacted on every
//! read path and never appear in any message this module produces.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
};

use contract::{ShapeLimits, pb, wire::shape_from_wire};
use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor},
};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShapeFile {
    pub run_id: String,
    #[serde(default)]
    pub generation: Option<u64>,
    /// The run's labels (`list -l` selects by them).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub groups: Vec<GroupFile>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupFile {
    pub id: String,
    /// Signed so that a negative count is reported as negative, by the same
    /// validation the server runs, rather than as a type error.
    pub count: i64,
    pub template: TemplateFile,
    /// Outside the template: changing it replaces nothing.
    #[serde(default)]
    pub health: Option<HealthFile>,
    #[serde(default)]
    pub remediation: Option<RemediationFile>,
    #[serde(default)]
    pub rollout: Option<RolloutFile>,
}

/// `rollout:` of a group; every field optional (the defaults: 25%
/// unavailable, 25% surge, no canary, a 10m progress deadline, no failure
/// threshold, no auto-revert).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutFile {
    #[serde(default)]
    pub max_unavailable: Option<BudgetFile>,
    #[serde(default)]
    pub max_surge: Option<BudgetFile>,
    #[serde(default)]
    pub canary: Option<u32>,
    #[serde(default)]
    pub progress_deadline: Option<Millis>,
    #[serde(default)]
    pub failure_threshold: Option<u32>,
    #[serde(default)]
    pub auto_revert: Option<bool>,
}

/// `health:` of a group; every field optional (the defaults: no probe,
/// interval 10s, timeout 2s, unhealthy_after 30s, startup_grace 0s).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthFile {
    #[serde(default)]
    pub probe: Option<ProbeFile>,
    #[serde(default)]
    pub interval: Option<Millis>,
    #[serde(default)]
    pub timeout: Option<Millis>,
    #[serde(default)]
    pub unhealthy_after: Option<Millis>,
    #[serde(default)]
    pub startup_grace: Option<Millis>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeFile {
    None,
    Tcp,
}

/// `remediation:` of a group (defaults: `max_in_flight: 1`,
/// `max_unhealthy: 100%`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemediationFile {
    #[serde(default)]
    pub max_in_flight: Option<u32>,
    #[serde(default)]
    pub max_unhealthy: Option<BudgetFile>,
}

/// A duration: milliseconds as a number, or a string with a unit
/// (`500ms`, `10s`, `2m`, `1h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Millis(pub u64);

impl Millis {
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (n, unit) = s.split_at(split);
        let n: u64 = n.parse().ok()?;
        let scale = match unit.trim() {
            "" | "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            _ => return None,
        };
        n.checked_mul(scale).map(Millis)
    }
}

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Millis;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration: milliseconds, or a string such as \"500ms\", \"10s\", \"2m\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Millis, E> {
                Ok(Millis(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Millis, E> {
                u64::try_from(v)
                    .map(Millis)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Millis, E> {
                Millis::parse(v).ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

/// A count of a group's nodes (`3`) or a percentage of them (`"40%"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetFile(pub contract::Budget);

impl<'de> Deserialize<'de> for BudgetFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = BudgetFile;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a count of nodes (3) or a percentage (\"40%\")")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<BudgetFile, E> {
                u32::try_from(v)
                    .map(|n| BudgetFile(contract::Budget::Count(n)))
                    .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<BudgetFile, E> {
                u32::try_from(v)
                    .map(|n| BudgetFile(contract::Budget::Count(n)))
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<BudgetFile, E> {
                contract::Budget::parse(v)
                    .map(BudgetFile)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

impl HealthFile {
    fn to_wire(&self) -> pb::HealthPolicy {
        let ms = |m: Option<Millis>| m.map_or(0, |m| m.0);
        pb::HealthPolicy {
            probe: match self.probe {
                None => pb::Probe::Unspecified,
                Some(ProbeFile::None) => pb::Probe::None,
                Some(ProbeFile::Tcp) => pb::Probe::Tcp,
            } as i32,
            interval_ms: ms(self.interval),
            timeout_ms: ms(self.timeout),
            unhealthy_after_ms: ms(self.unhealthy_after),
            startup_grace_ms: ms(self.startup_grace),
        }
    }
}

fn budget_to_wire(b: BudgetFile) -> pb::Budget {
    pb::Budget {
        value: Some(match b.0 {
            contract::Budget::Count(n) => pb::budget::Value::Count(n),
            contract::Budget::Percent(p) => pb::budget::Value::Percent(p),
        }),
    }
}

impl RemediationFile {
    fn to_wire(&self) -> pb::RemediationPolicy {
        pb::RemediationPolicy {
            max_in_flight: self.max_in_flight,
            max_unhealthy: self.max_unhealthy.map(budget_to_wire),
        }
    }
}

impl RolloutFile {
    fn to_wire(&self) -> pb::RolloutPolicy {
        pb::RolloutPolicy {
            max_unavailable: self.max_unavailable.map(budget_to_wire),
            max_surge: self.max_surge.map(budget_to_wire),
            canary: self.canary.unwrap_or(0),
            progress_deadline_ms: self.progress_deadline.map_or(0, |m| m.0),
            failure_threshold: self.failure_threshold.unwrap_or(0),
            auto_revert: self.auto_revert.unwrap_or(false),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateFile {
    #[serde(default)]
    pub role: String,
    pub image: String,
    pub provider: ProviderFile,
    #[serde(default)]
    pub boot: BTreeMap<String, ParamFile>,
    #[serde(default)]
    pub join: BTreeMap<String, ParamFile>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderFile {
    pub name: String,
    #[serde(default)]
    pub machine_type: String,
    #[serde(default)]
    pub cpu: f64,
    #[serde(default)]
    pub memory_gib: f64,
    #[serde(default)]
    pub accelerators: Vec<AcceleratorFile>,
    #[serde(default)]
    pub zone: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcceleratorFile {
    pub kind: String,
    pub count: i64,
}

/// A parameter: a plain string, or `{ value, secret }`, where the value may
/// instead come from an environment variable (`from_env: NAME`) or a file
/// (`from_file: PATH`, its content with one trailing newline dropped), read
/// when the file is parsed, so a secret need not be written in the shape
/// file.
///
/// `Debug` never shows a secret value, so a parsed file can be logged.
#[derive(Clone, PartialEq, Eq)]
pub enum ParamFile {
    Plain(String),
    Full { value: String, secret: bool },
}

impl ParamFile {
    pub fn value(&self) -> &str {
        match self {
            ParamFile::Plain(v) | ParamFile::Full { value: v, .. } => v,
        }
    }

    pub fn is_secret(&self) -> bool {
        matches!(self, ParamFile::Full { secret: true, .. })
    }
}

impl fmt::Debug for ParamFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_secret() {
            f.write_str("<redacted>")
        } else {
            write!(f, "{:?}", self.value())
        }
    }
}

/// Hand-written rather than `#[serde(untagged)]`: an untagged enum reports
/// every mistake as "data did not match any variant", which names neither
/// what was expected nor, for the map form, the misspelled key.
impl<'de> Deserialize<'de> for ParamFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ParamVisitor)
    }
}

struct ParamVisitor;

impl<'de> Visitor<'de> for ParamVisitor {
    type Value = ParamFile;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "a string, or a map { value: STRING | from_env: NAME | from_file: PATH, secret: true|false }",
        )
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<ParamFile, E> {
        Ok(ParamFile::Plain(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<ParamFile, E> {
        Ok(ParamFile::Plain(v))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<ParamFile, E> {
        Ok(ParamFile::Plain(v.to_string()))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<ParamFile, E> {
        Ok(ParamFile::Plain(v.to_string()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<ParamFile, E> {
        Ok(ParamFile::Plain(v.to_string()))
    }

    // A float would come back re-formatted (`1.10` as `1.1`), silently
    // changing the parameter; asking for quotes keeps the user's text exact.
    fn visit_f64<E: de::Error>(self, _v: f64) -> Result<ParamFile, E> {
        Err(E::custom(
            "a decimal number is not a valid parameter value; quote it to keep its exact text",
        ))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ParamFile, A::Error> {
        const FIELDS: &[&str] = &["value", "from_env", "from_file", "secret"];
        let mut value: Option<String> = None;
        let mut secret: Option<bool> = None;
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "value" | "from_env" | "from_file" if value.is_some() => {
                    return Err(de::Error::custom(
                        "give the value once: one of value, from_env or from_file",
                    ));
                }
                "value" => value = Some(map.next_value()?),
                "from_env" => {
                    let name: String = map.next_value()?;
                    value = Some(std::env::var(&name).map_err(|_| {
                        de::Error::custom(format!(
                            "from_env: the environment variable {name} is not set (or not UTF-8)"
                        ))
                    })?);
                }
                "from_file" => {
                    let path: String = map.next_value()?;
                    let text = std::fs::read_to_string(&path)
                        .map_err(|e| de::Error::custom(format!("from_file: cannot read {path}: {e}")))?;
                    let text = text
                        .strip_suffix('\n')
                        .map(|t| t.strip_suffix('\r').unwrap_or(t))
                        .unwrap_or(&text);
                    value = Some(text.to_owned());
                }
                "secret" if secret.is_none() => secret = Some(map.next_value()?),
                "secret" => return Err(de::Error::duplicate_field("secret")),
                _ => return Err(de::Error::unknown_field(&key, FIELDS)),
            }
        }
        let value = value.ok_or_else(|| de::Error::missing_field("value (or from_env, or from_file)"))?;
        Ok(ParamFile::Full {
            value,
            secret: secret.unwrap_or(false),
        })
    }
}

/// Which syntax a file is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Yaml,
    Json,
}

impl Format {
    /// By extension when there is a telling one, else by content: JSON if it
    /// starts with `{`. YAML is a superset of JSON, but the JSON parser gives
    /// better messages for JSON.
    pub fn detect(source_name: &str, text: &str) -> Format {
        let lower = source_name.to_ascii_lowercase();
        if lower.ends_with(".json") {
            Format::Json
        } else if lower.ends_with(".yaml") || lower.ends_with(".yml") {
            Format::Yaml
        } else if text.trim_start().starts_with('{') {
            Format::Json
        } else {
            Format::Yaml
        }
    }
}

/// A place in a file, 1-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub line: usize,
    pub column: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeFileError {
    /// The file is not valid YAML/JSON, or does not fit the schema.
    #[error("{source_name}{}: {message}", at(location))]
    Parse {
        source_name: String,
        location: Option<Location>,
        message: String,
    },
    /// The file fits the schema but a value is not acceptable.
    #[error("{source_name}{}: {field} {problem}", at(location))]
    Invalid {
        source_name: String,
        location: Option<Location>,
        /// The field path, e.g. `groups[1].template.provider.cpu`.
        field: String,
        problem: String,
    },
}

fn at(location: &Option<Location>) -> String {
    location.map_or_else(String::new, |l| format!(":{l}"))
}

impl ShapeFileError {
    pub fn location(&self) -> Option<Location> {
        match self {
            ShapeFileError::Parse { location, .. } | ShapeFileError::Invalid { location, .. } => *location,
        }
    }
}

/// Removes the parser's ` at line L column C` (which the error already
/// carries as its location) and says Rust's type names in words.
fn plain_message(message: &str) -> String {
    let mut out = message.to_owned();
    if let Some(i) = out.find(" at line ") {
        let rest = &out[i + " at line ".len()..];
        let digits = |s: &str| s.bytes().take_while(u8::is_ascii_digit).count();
        let line = digits(rest);
        if line > 0 && rest[line..].starts_with(" column ") {
            let after = &rest[line + " column ".len()..];
            let column = digits(after);
            if column > 0 {
                let end = i + " at line ".len() + line + " column ".len() + column;
                out.replace_range(i..end, "");
            }
        }
    }
    for (rust, words) in [
        ("expected i64", "expected a whole number"),
        ("expected u64", "expected a whole number, 0 or more"),
        ("expected f64", "expected a number"),
        ("expected a sequence", "expected a list"),
        ("expected struct ", "expected a map: "),
    ] {
        out = out.replace(rust, words);
    }
    out
}

/// Parses a shape file. The error names the line, the column and (for YAML
/// always, for JSON by the field's own name) the field.
pub fn parse(source_name: &str, text: &str) -> Result<ShapeFile, ShapeFileError> {
    let error = |location: Option<Location>, message: String| ShapeFileError::Parse {
        source_name: source_name.to_owned(),
        location,
        message,
    };
    if text.trim().is_empty() {
        return Err(error(None, "the file is empty".to_owned()));
    }
    match Format::detect(source_name, text) {
        Format::Json => serde_json::from_str::<ShapeFile>(text).map_err(|e| {
            let location = (e.line() > 0).then(|| Location {
                line: e.line(),
                column: e.column(),
            });
            error(location, plain_message(&e.to_string()))
        }),
        Format::Yaml => serde_yaml_ng::from_str::<ShapeFile>(text).map_err(|e| {
            let location = e.location().map(|l| Location {
                line: l.line(),
                column: l.column(),
            });
            error(location, plain_message(&e.to_string()))
        }),
    }
}

/// Parses a file and checks it as the driver would, at `generation` (unless
/// the file names its own): the wire shape, ready to send.
pub fn load(source_name: &str, text: &str, generation: u64) -> Result<pb::ClusterShape, ShapeFileError> {
    let file = parse(source_name, text)?;
    file.check(source_name, text, generation)
}

fn params(p: &BTreeMap<String, ParamFile>) -> HashMap<String, pb::Param> {
    p.iter()
        .map(|(k, v)| {
            let param = pb::Param {
                value: v.value().to_owned(),
                secret: v.is_secret(),
            };
            (k.clone(), param)
        })
        .collect()
}

impl ShapeFile {
    /// The wire shape at `generation` (the file's own, if it names one).
    pub fn to_wire(&self, generation: u64) -> pb::ClusterShape {
        pb::ClusterShape {
            run_id: self.run_id.clone(),
            generation: self.generation.unwrap_or(generation),
            labels: self.labels.clone().into_iter().collect(),
            groups: self
                .groups
                .iter()
                .map(|g| pb::NodeGroup {
                    id: g.id.clone(),
                    count: g.count,
                    run_id: String::new(),
                    health: g.health.as_ref().map(HealthFile::to_wire),
                    remediation: g.remediation.as_ref().map(RemediationFile::to_wire),
                    rollout: g.rollout.as_ref().map(RolloutFile::to_wire),
                    template: Some(pb::NodeTemplate {
                        role: g.template.role.clone(),
                        image: g.template.image.clone(),
                        provider: Some(pb::ProviderShape {
                            name: g.template.provider.name.clone(),
                            machine_type: g.template.provider.machine_type.clone(),
                            cpu: g.template.provider.cpu,
                            memory_gib: g.template.provider.memory_gib,
                            accelerators: g
                                .template
                                .provider
                                .accelerators
                                .iter()
                                .map(|a| pb::Accelerator {
                                    kind: a.kind.clone(),
                                    count: a.count,
                                })
                                .collect(),
                            zone: g.template.provider.zone.clone(),
                            labels: g.template.provider.labels.clone().into_iter().collect(),
                        }),
                        boot: params(&g.template.boot),
                        join: params(&g.template.join),
                    }),
                })
                .collect(),
        }
    }

    /// The wire shape at `generation`, after the driver's own decoding and
    /// validation with the default limits. `text` is the file the shape came
    /// from, to point at the offending field.
    /// A secret whose value is the redaction marker is a shape read back
    /// from the server (`get -o yaml`), not a value: applied, it would make
    /// every node's secret the marker itself.
    fn no_redacted_secrets(&self) -> Result<(), contract::FieldError> {
        for (i, g) in self.groups.iter().enumerate() {
            for (section, params) in [("boot", &g.template.boot), ("join", &g.template.join)] {
                for (key, p) in params {
                    if p.is_secret() && p.value() == contract::wire::REDACTED {
                        return Err(contract::FieldError::new(
                            format!("groups[{i}].template.{section}[\"{key}\"]"),
                            contract::Problem::Malformed(
                                "is the redaction marker of a shape read back from the server, not a value: \
                                 give the value inline, or as { from_env: VARIABLE, secret: true } or \
                                 { from_file: PATH, secret: true }",
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    pub fn check(
        &self,
        source_name: &str,
        text: &str,
        generation: u64,
    ) -> Result<pb::ClusterShape, ShapeFileError> {
        let wire = self.to_wire(generation);
        let checked = self
            .no_redacted_secrets()
            .and_then(|()| shape_from_wire(wire.clone()))
            .and_then(|s| s.validate(&ShapeLimits::default()));
        match checked {
            Ok(()) => Ok(wire),
            Err(e) => Err(ShapeFileError::Invalid {
                source_name: source_name.to_owned(),
                location: locate(Format::detect(source_name, text), text, &e.field),
                field: e.field,
                problem: e.problem.to_string(),
            }),
        }
    }
}

// ---------------------------------------------------------------------------
// Locating a field path in the file
// ---------------------------------------------------------------------------

/// One step of a field path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Index(usize),
}

/// Splits a field path as `FieldError` writes it: `groups[1].template.boot["k"]`.
/// `None` if it is not such a path.
fn segments(path: &str) -> Option<Vec<Segment>> {
    let mut out = Vec::new();
    let mut chars = path.chars().peekable();
    let mut key = String::new();
    while let Some(c) = chars.next() {
        match c {
            '.' => {
                if !key.is_empty() {
                    out.push(Segment::Key(std::mem::take(&mut key)));
                }
            }
            '[' => {
                if !key.is_empty() {
                    out.push(Segment::Key(std::mem::take(&mut key)));
                }
                if chars.peek() == Some(&'"') {
                    chars.next();
                    let mut quoted = String::new();
                    loop {
                        match chars.next()? {
                            '\\' => quoted.push(chars.next()?),
                            '"' => break,
                            c => quoted.push(c),
                        }
                    }
                    if chars.next()? != ']' {
                        return None;
                    }
                    out.push(Segment::Key(quoted));
                } else {
                    let mut digits = String::new();
                    loop {
                        match chars.next()? {
                            ']' => break,
                            c => digits.push(c),
                        }
                    }
                    out.push(Segment::Index(digits.parse().ok()?));
                }
            }
            c => key.push(c),
        }
    }
    if !key.is_empty() {
        out.push(Segment::Key(key));
    }
    Some(out)
}

/// The location of the value at a field path in `text`, or of its nearest
/// enclosing value that the file has (a missing field points at its parent).
///
/// It works by deserializing the file once more with a seed that walks down
/// the path and fails on arrival with a marker error: the parser then stamps
/// the error with the position of the value, which is exactly what we want,
/// with no second YAML parser and no guessing from indentation.
pub fn locate(format: Format, text: &str, field: &str) -> Option<Location> {
    let path = segments(field)?;
    (0..=path.len())
        .rev()
        .find_map(|n| locate_exact(format, text, &path[..n]))
}

const FOUND: &str = "\u{1}provisionctl-located\u{1}";

fn locate_exact(format: Format, text: &str, path: &[Segment]) -> Option<Location> {
    match format {
        Format::Json => {
            let mut de = serde_json::Deserializer::from_str(text);
            match (Find { path }).deserialize(&mut de) {
                Err(e) if e.to_string().contains(FOUND) && e.line() > 0 => Some(Location {
                    line: e.line(),
                    column: e.column(),
                }),
                _ => None,
            }
        }
        Format::Yaml => {
            let de = serde_yaml_ng::Deserializer::from_str(text);
            match (Find { path }).deserialize(de) {
                Err(e) if e.to_string().contains(FOUND) => e.location().map(|l| Location {
                    line: l.line(),
                    column: l.column(),
                }),
                _ => None,
            }
        }
    }
}

/// Walks down `path`; `Ok(())` means the path is not in the file.
struct Find<'p> {
    path: &'p [Segment],
}

impl<'de> DeserializeSeed<'de> for Find<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        match self.path.split_first() {
            None => d.deserialize_any(Arrived),
            Some((first, rest)) => d.deserialize_any(Step { first, rest }),
        }
    }
}

struct Step<'p> {
    first: &'p Segment,
    rest: &'p [Segment],
}

impl<'de> Visitor<'de> for Step<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map or a list")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<AnyKey>()? {
            if matches!((self.first, &key.0), (Segment::Key(want), Some(k)) if want == k) {
                return map.next_value_seed(Find { path: self.rest });
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        loop {
            if matches!(self.first, Segment::Index(want) if *want == i) {
                return seq.next_element_seed(Find { path: self.rest }).map(|_| ());
            }
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Ok(());
            }
            i += 1;
        }
    }

    // A scalar has no children: the path is not there.
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

/// A map key of any scalar type, as text (YAML keys need not be strings).
struct AnyKey(Option<String>);

impl<'de> Deserialize<'de> for AnyKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = AnyKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<AnyKey, E> {
                Ok(AnyKey(Some(v.to_owned())))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<AnyKey, E> {
                Ok(AnyKey(Some(v.to_string())))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<AnyKey, E> {
                Ok(AnyKey(Some(v.to_string())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<AnyKey, E> {
                Ok(AnyKey(Some(v.to_string())))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<AnyKey, E> {
                Ok(AnyKey(Some(v.to_string())))
            }
            fn visit_unit<E: de::Error>(self) -> Result<AnyKey, E> {
                Ok(AnyKey(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<AnyKey, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(AnyKey(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<AnyKey, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(AnyKey(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// Fails on whatever value it meets, so the parser stamps the error with the
/// value's position.
struct Arrived;

impl Arrived {
    fn here<E: de::Error>() -> E {
        E::custom(FOUND)
    }
}

impl<'de> Visitor<'de> for Arrived {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Err(Self::here())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Err(Self::here())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Err(Self::here())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Err(Self::here())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Err(Self::here())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Err(Self::here())
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        Err(Self::here())
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(Self::here())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<(), A::Error> {
        Err(Self::here())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const GOOD: &str = "\
run_id: demo
groups:
  - id: w
    count: 2
    template:
      image: img:1
      provider: { name: fake, cpu: 2 }
      boot: { a: b, port: 8080, t: { value: s3cret, secret: true } }
  - id: gpu
    count: 1
    template:
      image: img:1
      provider:
        name: fake
        accelerators: [{ kind: a100, count: 1 }]
";

    #[test]
    fn yaml_parses_to_the_wire_shape_with_secrets_marked() {
        let f = parse("s.yaml", GOOD).unwrap();
        let w = f.check("s.yaml", GOOD, 3).unwrap();
        assert_eq!(w.generation, 3);
        let t = w.groups[0].template.as_ref().unwrap();
        assert!(t.boot["t"].secret);
        assert!(!t.boot["a"].secret);
        assert_eq!(t.boot["port"].value, "8080");
        assert!(!format!("{f:?}").contains("s3cret"), "Debug must redact");
    }

    #[test]
    fn health_and_remediation_parse_beside_the_template() {
        let text = GOOD.replace(
            "  - id: gpu\n",
            "    health: { probe: tcp, interval: 500ms, timeout: 200, unhealthy_after: 2m }\n    \
             remediation: { max_in_flight: 0, max_unhealthy: 40% }\n  - id: gpu\n",
        );
        let w = load("s.yaml", &text, 1).unwrap();
        let shape = contract::wire::shape_from_wire(w).unwrap();
        let p = shape.groups[0].policy;
        assert_eq!(p.health.probe, contract::Probe::Tcp);
        assert_eq!(
            (
                p.health.interval_ms,
                p.health.timeout_ms,
                p.health.unhealthy_after_ms
            ),
            (500, 200, 120_000)
        );
        assert_eq!(p.remediation.max_in_flight, 0);
        assert_eq!(p.remediation.max_unhealthy, contract::Budget::Percent(40));
        // The group without either keeps the defaults.
        assert_eq!(shape.groups[1].policy, contract::GroupPolicy::default());
    }

    #[test]
    fn a_wrong_health_field_is_named() {
        let with = |h: &str| GOOD.replace("  - id: gpu\n", &format!("    health: {h}\n  - id: gpu\n"));
        let e = parse_err("s.yaml", &with("{ probe: http }"));
        assert!(e.to_string().contains("groups[0].health.probe"), "{e}");
        let e = parse_err("s.yaml", &with("{ interval: 10 parsecs }"));
        assert!(e.to_string().contains("a duration"), "{e}");
        let e = parse_err("s.yaml", &with("{ interval: 1s, timeout: 5s }"));
        assert!(e.to_string().contains("groups[0].health.timeout"), "{e}");
        let bad = GOOD.replace(
            "  - id: gpu\n",
            "    remediation: { max_unhealthy: 140% }\n  - id: gpu\n",
        );
        let e = parse_err("s.yaml", &bad);
        assert!(
            e.to_string().contains("groups[0].remediation.max_unhealthy"),
            "{e}"
        );
    }

    #[test]
    fn a_rollout_parses_beside_the_template_and_its_errors_are_named() {
        let text = GOOD.replace(
            "  - id: gpu\n",
            "    rollout: { max_unavailable: 0, max_surge: 2, canary: 1, progress_deadline: 2m, \
             failure_threshold: 2, auto_revert: true }\n  - id: gpu\n",
        );
        let w = load("s.yaml", &text, 1).unwrap();
        let shape = contract::wire::shape_from_wire(w).unwrap();
        let r = shape.groups[0].policy.rollout;
        assert_eq!(r.max_unavailable, contract::Budget::Count(0));
        assert_eq!(r.max_surge, contract::Budget::Count(2));
        assert_eq!(
            (r.canary, r.progress_deadline_ms, r.failure_threshold),
            (1, 120_000, 2)
        );
        assert!(r.auto_revert);
        assert_eq!(shape.groups[1].policy.rollout, contract::RolloutPolicy::default());
        let with = |r: &str| GOOD.replace("  - id: gpu\n", &format!("    rollout: {r}\n  - id: gpu\n"));
        let e = parse_err("s.yaml", &with("{ max_unavailable: 0, max_surge: 0% }"));
        assert!(e.to_string().contains("groups[0].rollout.max_unavailable"), "{e}");
        let e = parse_err("s.yaml", &with("{ max_surge: 101% }"));
        assert!(e.to_string().contains("groups[0].rollout.max_surge"), "{e}");
        let e = parse_err("s.yaml", &with("{ canaries: 2 }"));
        assert!(e.to_string().contains("canaries"), "{e}");
    }

    #[test]
    fn json_parses_and_its_generation_wins() {
        let json = r#"{"run_id":"demo","generation":4,"groups":[]}"#;
        assert_eq!(load("s.json", json, 1).unwrap().generation, 4);
        // Detected by content when the name says nothing (standard input).
        assert_eq!(load("-", json, 1).unwrap().generation, 4);
    }

    fn parse_err(name: &str, text: &str) -> ShapeFileError {
        load(name, text, 1).unwrap_err()
    }

    #[test]
    fn unknown_field_names_the_line_and_the_field() {
        let bad = GOOD.replace("    count: 1\n", "    count: 1\n    colour: blue\n");
        let e = parse_err("s.yaml", &bad);
        let line = bad.lines().position(|l| l.contains("colour")).unwrap() + 1;
        assert_eq!(e.location().map(|l| l.line), Some(line), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("colour") && msg.contains("groups[1]"), "{msg}");
        assert!(msg.starts_with(&format!("s.yaml:{line}:")), "{msg}");
        assert!(!msg.contains(" at line "), "location said twice: {msg}");
        assert_eq!(
            plain_message("did not find expected node content at line 3 column 1, while parsing a flow node"),
            "did not find expected node content, while parsing a flow node"
        );
    }

    #[test]
    fn wrong_type_names_the_line() {
        let bad = GOOD.replace("count: 2", "count: two");
        let e = parse_err("s.yaml", &bad);
        assert_eq!(e.location().map(|l| l.line), Some(4), "{e}");
        assert!(e.to_string().contains("groups[0].count"), "{e}");
        assert!(e.to_string().contains("expected a whole number"), "{e}");
    }

    #[test]
    fn negative_count_is_located_by_its_field_path() {
        let bad = GOOD.replace("count: 1\n    template", "count: -1\n    template");
        let e = parse_err("s.yaml", &bad);
        match &e {
            ShapeFileError::Invalid { field, location, .. } => {
                assert_eq!(field, "groups[1].count");
                assert_eq!(location.map(|l| l.line), Some(10));
            }
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("must not be negative"), "{e}");
    }

    #[test]
    fn duplicate_group_points_at_the_second_one() {
        let bad = GOOD.replace("id: gpu", "id: w");
        let e = parse_err("s.yaml", &bad);
        assert!(e.to_string().contains("groups[1].id is a duplicate"), "{e}");
        assert_eq!(e.location().map(|l| l.line), Some(9), "{e}");
    }

    #[test]
    fn values_in_flow_maps_and_json_are_located() {
        let bad = GOOD.replace("cpu: 2", "cpu: -2");
        let e = parse_err("s.yaml", &bad);
        assert!(e.to_string().contains("groups[0].template.provider.cpu"), "{e}");
        assert_eq!(e.location().map(|l| l.line), Some(7), "{e}");

        let json = "{\n  \"run_id\": \"demo\",\n  \"groups\": [\n    {\"id\": \"w\", \"count\": 1,\n     \"template\": {\"image\": \"\", \"provider\": {\"name\": \"fake\"}}}\n  ]\n}\n";
        let e = parse_err("s.json", json);
        assert!(
            e.to_string()
                .contains("groups[0].template.image must not be empty"),
            "{e}"
        );
        assert_eq!(e.location().map(|l| l.line), Some(5), "{e}");
    }

    #[test]
    fn a_missing_field_points_at_its_parent_and_bad_ids_are_named() {
        let bad = GOOD.replace("run_id: demo", "run_id: Demo_1");
        let e = parse_err("s.yaml", &bad);
        assert!(e.to_string().starts_with("s.yaml:1:"), "{e}");
        assert!(e.to_string().contains("run_id"), "{e}");

        let missing = "run_id: demo\ngroups:\n  - id: w\n    template: { image: i, provider: { name: f } }\n";
        let e = parse_err("s.yaml", missing);
        assert!(e.to_string().contains("missing field `count`"), "{e}");
        assert_eq!(e.location().map(|l| l.line), Some(3), "{e}");
    }

    #[test]
    fn syntax_errors_and_empty_files_are_reported() {
        let e = parse_err("s.yaml", "run_id: demo\ngroups: [\n");
        assert!(e.location().is_some(), "{e}");
        let e = parse_err("s.json", "{\"run_id\": \"demo\",, }");
        assert_eq!(e.location().map(|l| l.line), Some(1), "{e}");
        assert!(parse_err("s.yaml", "  \n").to_string().contains("empty"));
    }

    #[test]
    fn secret_values_never_appear_in_errors() {
        let bad = GOOD.replace("secret: true }", "secret: true, colour: red }");
        let e = parse_err("s.yaml", &bad).to_string();
        assert!(e.contains("colour") && !e.contains("s3cret"), "{e}");
        let bad = GOOD.replace("value: s3cret, secret: true", "value: s3cret, secret: maybe");
        let e = parse_err("s.yaml", &bad).to_string();
        assert!(!e.contains("s3cret"), "{e}");
    }

    #[test]
    fn a_secret_can_come_from_the_environment_or_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "from-a-file\n").unwrap();
        let text = GOOD.replace(
            "t: { value: s3cret, secret: true }",
            &format!(
                "t: {{ from_file: \"{}\", secret: true }}, p: {{ from_env: PATH }}",
                file.display()
            ),
        );
        let w = load("s.yaml", &text, 1).unwrap();
        let boot = &w.groups[0].template.as_ref().unwrap().boot;
        assert_eq!(boot["t"].value, "from-a-file");
        assert!(boot["t"].secret);
        assert_eq!(boot["p"].value, std::env::var("PATH").unwrap());

        let unset = GOOD.replace(
            "t: { value: s3cret, secret: true }",
            "t: { from_env: PROVISIONCTL_TEST_NEVER_SET_ANYWHERE, secret: true }",
        );
        let e = parse_err("s.yaml", &unset).to_string();
        assert!(
            e.contains("PROVISIONCTL_TEST_NEVER_SET_ANYWHERE is not set"),
            "{e}"
        );
        let missing = GOOD.replace(
            "t: { value: s3cret, secret: true }",
            "t: { from_file: /no/such/file, secret: true }",
        );
        let e = parse_err("s.yaml", &missing).to_string();
        assert!(e.contains("cannot read /no/such/file"), "{e}");
        let both = GOOD.replace(
            "t: { value: s3cret, secret: true }",
            "t: { value: x, from_env: PATH, secret: true }",
        );
        assert!(
            parse_err("s.yaml", &both)
                .to_string()
                .contains("give the value once")
        );
    }

    /// A shape read back with `get -o yaml` carries `<redacted>` for every
    /// secret: applying it would set the secrets to that marker.
    #[test]
    fn a_secret_that_is_the_redaction_marker_is_refused_with_its_field() {
        let text = GOOD.replace("value: s3cret", "value: \"<redacted>\"");
        let e = parse_err("s.yaml", &text);
        let line = text.lines().position(|l| l.contains("<redacted>")).unwrap() + 1;
        assert_eq!(e.location().map(|l| l.line), Some(line), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("groups[0].template.boot[\"t\"]"), "{msg}");
        assert!(msg.contains("from_env") && msg.contains("from_file"), "{msg}");
        // Not secret: a value like any other.
        let plain = GOOD.replace("a: b", "a: \"<redacted>\"");
        assert!(load("s.yaml", &plain, 1).is_ok());
    }

    #[test]
    fn the_shipped_examples_are_valid() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.display().to_string();
            if !(name.ends_with(".yaml") || name.ends_with(".json")) {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            load(&name, &text, 1).unwrap_or_else(|e| panic!("{e}"));
            seen += 1;
        }
        assert!(seen >= 3, "examples missing from {}", dir.display());
    }

    #[test]
    fn field_paths_split() {
        assert_eq!(
            segments("groups[1].template.boot[\"a.b\"]"),
            Some(vec![
                Segment::Key("groups".into()),
                Segment::Index(1),
                Segment::Key("template".into()),
                Segment::Key("boot".into()),
                Segment::Key("a.b".into()),
            ])
        );
        assert_eq!(segments("groups[x]"), None);
    }
}
