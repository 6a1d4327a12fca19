//! Validation errors. Every error names the field that is wrong, as a path into
//! the input (`groups[2].template.provider.cpu`), so a client can point at it.

use std::fmt;

/// What is wrong with a field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    Empty,
    Missing,
    Malformed(&'static str),
    TooLong {
        len: usize,
        max: usize,
    },
    Duplicate,
    NotFinite,
    Negative,
    OverLimit {
        value: u64,
        limit: u64,
    },
    /// A group that names another run.
    ForeignRun {
        expected: String,
    },
    /// An enum value that is unset or unknown.
    UnknownValue(i32),
    TooLarge {
        bytes: usize,
        limit: usize,
    },
    /// Over a limit the driver's operator sets with `flag`: `said`, the
    /// value and `noun` read as the field's predicate (`hold 300000 nodes in
    /// all`). `limit` is `None` for a value past any limit the flag can set.
    OverConfiguredLimit {
        said: &'static str,
        value: u64,
        noun: &'static str,
        limit: Option<u64>,
        flag: &'static str,
    },
    /// A provider name no provider the executor serves answers to.
    NotServed {
        name: String,
        served: Vec<String>,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::Empty => f.write_str("must not be empty"),
            Problem::Missing => f.write_str("is required"),
            Problem::Malformed(what) => write!(f, "is malformed: {what}"),
            Problem::TooLong { len, max } => write!(f, "is {len} bytes long; the limit is {max}"),
            Problem::Duplicate => f.write_str("is a duplicate"),
            Problem::NotFinite => f.write_str("must be a finite number"),
            Problem::Negative => f.write_str("must not be negative"),
            Problem::OverLimit { value, limit } => write!(f, "is {value}; the limit is {limit}"),
            Problem::OverConfiguredLimit {
                said,
                value,
                noun,
                limit: Some(limit),
                flag,
            } => write!(
                f,
                "{said} {value}{noun}; the limit is {limit} (driver-svc --{flag})"
            ),
            Problem::OverConfiguredLimit {
                said,
                value,
                noun,
                limit: None,
                flag,
            } => write!(
                f,
                "{said} {value}{noun}, more than any limit allows (driver-svc --{flag} sets it)"
            ),
            Problem::ForeignRun { expected } => write!(f, "names another run (expected {expected:?})"),
            Problem::UnknownValue(v) => write!(f, "has an unset or unknown value {v}"),
            Problem::TooLarge { bytes, limit } => write!(f, "is {bytes} bytes; the limit is {limit}"),
            Problem::NotServed { name, served } if served.is_empty() => {
                write!(
                    f,
                    "is {name:?}, which the executor does not serve (it serves no provider)"
                )
            }
            Problem::NotServed { name, served } => write!(
                f,
                "is {name:?}, which the executor does not serve (it serves: {})",
                served.join(", ")
            ),
        }
    }
}

/// A field of an input that fails validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {problem}")]
pub struct FieldError {
    /// Path of the field in the input, e.g. `groups[1].count`.
    pub field: String,
    pub problem: Problem,
}

impl FieldError {
    pub fn new(field: impl Into<String>, problem: Problem) -> Self {
        Self {
            field: field.into(),
            problem,
        }
    }

    /// Prefixes the field path, for errors raised by a nested validator.
    pub fn within(mut self, parent: &str) -> Self {
        if self.field.is_empty() {
            self.field = parent.to_owned();
        } else if self.field.starts_with('[') {
            self.field = format!("{parent}{}", self.field);
        } else {
            self.field = format!("{parent}.{}", self.field);
        }
        self
    }
}
