//! Label selectors over a run's labels (`ListRuns`'s `label_selector`,
//! `provisionctl list -l`): comma-separated requirements, all of which must
//! hold. `key=value` (also `key==value`), `key!=value` (a run without the key
//! matches), `key` (has it) and `!key` (has it not), as Kubernetes' equality
//! selectors read.

use crate::error::{FieldError, Problem};

/// One requirement of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
}

/// A parsed selector; the empty one matches every run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector(Vec<Requirement>);

fn word(field: &str, s: &str, what: &'static str) -> Result<String, FieldError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(FieldError::new(field, Problem::Malformed(what)));
    }
    if !s
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
    {
        return Err(FieldError::new(
            field,
            Problem::Malformed("a label is letters, digits, '-', '_', '.' and '/'"),
        ));
    }
    Ok(s.to_owned())
}

fn value(field: &str, s: &str) -> Result<String, FieldError> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(String::new());
    }
    word(field, s, "")
}

impl Selector {
    /// Parses `s`; an error names `field`.
    pub fn parse(field: &str, s: &str) -> Result<Self, FieldError> {
        let mut requirements = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let r = if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(word(field, k, "a key before '!='")?, value(field, v)?)
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                Requirement::Equals(word(field, k, "a key before '='")?, value(field, v)?)
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::Absent(word(field, k, "a key after '!'")?)
            } else {
                Requirement::Exists(word(field, part, "a key")?)
            };
            requirements.push(r);
        }
        Ok(Self(requirements))
    }

    /// Whether labels (as `get` reads them) satisfy every requirement.
    pub fn matches<'a>(&self, get: impl Fn(&str) -> Option<&'a str>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::Absent(k) => get(k).is_none(),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn matches(selector: &str, l: &BTreeMap<String, String>) -> bool {
        Selector::parse("label_selector", selector)
            .unwrap()
            .matches(|k| l.get(k).map(String::as_str))
    }

    #[test]
    fn requirements_all_hold() {
        let ml = labels(&[("team", "ml"), ("env", "prod")]);
        let web = labels(&[("team", "web")]);
        assert!(matches("", &ml) && matches("", &web));
        assert!(matches("team=ml", &ml) && !matches("team=ml", &web));
        assert!(matches("team==ml,env=prod", &ml));
        assert!(!matches("team=ml,env=dev", &ml));
        assert!(matches("env!=prod", &web) && !matches("env!=prod", &ml));
        assert!(matches("env", &ml) && !matches("env", &web));
        assert!(matches("!env", &web) && !matches("!env", &ml));
        assert!(matches(" team = ml , env ", &ml));
    }

    #[test]
    fn a_malformed_selector_names_its_field() {
        for bad in ["=ml", "team=m l", "!", "te am", "!=x"] {
            let e = Selector::parse("label_selector", bad).unwrap_err();
            assert_eq!(e.field, "label_selector", "{bad}: {e}");
        }
    }
}
