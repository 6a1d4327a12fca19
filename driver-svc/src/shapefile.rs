//! The shape file format clients write (YAML or JSON), converted to the wire
//! shape. Unknown fields are errors, and a parse error names the line and the
//! field, so a typo never silently becomes a default.
//!
//! ```yaml
//! run_id: demo
//! generation: 1            # optional: provisionctl fills in the next one
//! groups:
//!   - id: workers
//!     count: 8
//!     template:
//!       role: worker
//!       image: img:1
//!       provider: { name: fake, machine_type: standard-4, cpu: 4, memory_gib: 16, zone: local-a }
//!       boot: { greeting: hello, token: { value: s3cret, secret: true } }
//!       join: { cluster: demo }
//! ```

use std::collections::{BTreeMap, HashMap};

use contract::pb;
use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShapeFile {
    pub run_id: String,
    #[serde(default)]
    pub generation: Option<u64>,
    #[serde(default)]
    pub groups: Vec<GroupFile>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupFile {
    pub id: String,
    pub count: i64,
    pub template: TemplateFile,
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

/// A parameter: a plain string, or `{ value, secret }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ParamFile {
    Plain(String),
    Full {
        value: String,
        #[serde(default)]
        secret: bool,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum ShapeFileError {
    #[error("{source_name}: {message}")]
    Parse { source_name: String, message: String },
}

/// Parses a shape file; JSON if it starts with `{`, YAML otherwise (YAML is a
/// superset of JSON, but the JSON parser gives better messages for JSON).
pub fn parse(source_name: &str, text: &str) -> Result<ShapeFile, ShapeFileError> {
    let parsed = if text.trim_start().starts_with('{') {
        serde_json::from_str::<ShapeFile>(text)
            .map_err(|e| format!("line {} column {}: {e}", e.line(), e.column()))
    } else {
        serde_yaml::from_str::<ShapeFile>(text).map_err(|e| match e.location() {
            Some(l) => format!("line {} column {}: {e}", l.line(), l.column()),
            None => e.to_string(),
        })
    };
    parsed.map_err(|message| ShapeFileError::Parse {
        source_name: source_name.to_owned(),
        message,
    })
}

fn params(p: &BTreeMap<String, ParamFile>) -> HashMap<String, pb::Param> {
    p.iter()
        .map(|(k, v)| {
            let param = match v {
                ParamFile::Plain(value) => pb::Param {
                    value: value.clone(),
                    secret: false,
                },
                ParamFile::Full { value, secret } => pb::Param {
                    value: value.clone(),
                    secret: *secret,
                },
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
            groups: self
                .groups
                .iter()
                .map(|g| pb::NodeGroup {
                    id: g.id.clone(),
                    count: g.count,
                    run_id: String::new(),
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_parse_and_unknown_fields_fail_with_a_line() {
        let yaml = "run_id: demo\ngroups:\n  - id: w\n    count: 2\n    template:\n      image: img:1\n      provider: { name: fake }\n      boot: { a: b, t: { value: s, secret: true } }\n";
        let f = parse("s.yaml", yaml).unwrap();
        let w = f.to_wire(3);
        assert_eq!(w.generation, 3);
        let t = w.groups[0].template.as_ref().unwrap();
        assert!(t.boot["t"].secret);
        assert!(!t.boot["a"].secret);

        let bad = "run_id: demo\ngroups:\n  - id: w\n    count: 2\n    colour: blue\n";
        let err = parse("s.yaml", bad).unwrap_err().to_string();
        assert!(err.contains("line 3") || err.contains("line 5"), "{err}");
        assert!(err.contains("colour"), "{err}");

        let json = r#"{"run_id":"demo","generation":4,"groups":[]}"#;
        assert_eq!(parse("s.json", json).unwrap().to_wire(1).generation, 4);
    }
}
