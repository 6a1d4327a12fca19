//! The provider protocol's messages as the workspace's domain types, both
//! ways: a plugin (through [`crate::serve`]) and the executor hosting it
//! share these conversions, so the two sides cannot read a field
//! differently.

use std::collections::HashMap;

use contract::{
    Accelerator, AttemptId, BootstrapStage, FieldError, LogicalNodeId, NodeTemplate, Param, Params, Problem,
    ProviderShape, ResourceIdentity, RunId, RunUid, UnixMillis,
};

pub use contract::pb::provider::v1 as pb;

use crate::Answer;

/// A resource identity on the wire.
pub fn identity_to_wire(identity: &ResourceIdentity) -> pb::Identity {
    pb::Identity {
        run_uid: identity.run_uid.to_string(),
        run_id: identity.run_id.as_str().to_owned(),
        node_id: identity.node.to_string(),
        attempt: identity.attempt.get(),
    }
}

/// A resource identity from the wire; `field` names the message field in the
/// error (`call.identity`, say).
pub fn identity_from_wire(
    field: &str,
    identity: Option<&pb::Identity>,
) -> Result<ResourceIdentity, FieldError> {
    let Some(identity) = identity else {
        return Err(FieldError::new(field, Problem::Missing));
    };
    Ok(ResourceIdentity {
        run_uid: RunUid::parse(&format!("{field}.run_uid"), &identity.run_uid)?,
        run_id: RunId::parse(&format!("{field}.run_id"), &identity.run_id)?,
        node: LogicalNodeId::parse(&format!("{field}.node_id"), &identity.node_id)?,
        attempt: AttemptId::new(identity.attempt),
    })
}

fn params_to_wire(params: &Params) -> HashMap<String, pb::Param> {
    params
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                pb::Param {
                    value: v.value.clone(),
                    secret: v.secret,
                },
            )
        })
        .collect()
}

fn params_from_wire(params: HashMap<String, pb::Param>) -> Params {
    params
        .into_iter()
        .map(|(k, v)| {
            (
                k,
                Param {
                    value: v.value,
                    secret: v.secret,
                },
            )
        })
        .collect()
}

/// Boot or join parameters on the wire.
pub fn params(params: &Params) -> HashMap<String, pb::Param> {
    params_to_wire(params)
}

/// Boot or join parameters from the wire.
pub fn params_from(params: HashMap<String, pb::Param>) -> Params {
    params_from_wire(params)
}

/// A node template's provider-facing part (its provider name travels in the
/// call).
pub fn template_to_wire(t: &NodeTemplate) -> pb::Template {
    pb::Template {
        role: t.role.clone(),
        image: t.image.clone(),
        machine_type: t.provider.machine_type.clone(),
        cpu: t.provider.cpu,
        memory_gib: t.provider.memory_gib,
        accelerators: t
            .provider
            .accelerators
            .iter()
            .map(|a| pb::Accelerator {
                kind: a.kind.clone(),
                count: a.count,
            })
            .collect(),
        zone: t.provider.zone.clone(),
        labels: t.provider.labels.clone().into_iter().collect(),
        boot: params_to_wire(&t.boot),
        join: params_to_wire(&t.join),
    }
}

/// A node template from the wire, for the provider `provider_name`.
pub fn template_from_wire(
    field: &str,
    t: Option<pb::Template>,
    provider_name: &str,
) -> Result<NodeTemplate, FieldError> {
    let Some(t) = t else {
        return Err(FieldError::new(field, Problem::Missing));
    };
    if t.image.is_empty() {
        return Err(FieldError::new(format!("{field}.image"), Problem::Empty));
    }
    Ok(NodeTemplate {
        role: t.role,
        provider: ProviderShape {
            name: provider_name.to_owned(),
            machine_type: t.machine_type,
            cpu: t.cpu,
            memory_gib: t.memory_gib,
            accelerators: t
                .accelerators
                .into_iter()
                .map(|a| Accelerator {
                    kind: a.kind,
                    count: a.count,
                })
                .collect(),
            zone: t.zone,
            labels: t.labels.into_iter().collect(),
        },
        image: t.image,
        boot: params_from_wire(t.boot),
        join: params_from_wire(t.join),
    })
}

/// A bootstrap stage on the wire.
pub fn stage_to_wire(stage: BootstrapStage) -> pb::Stage {
    match stage {
        BootstrapStage::Connected => pb::Stage::Connected,
        BootstrapStage::BootCheck => pb::Stage::BootCheck,
        BootstrapStage::AgentStarted => pb::Stage::AgentStarted,
        BootstrapStage::Joined => pb::Stage::Joined,
        BootstrapStage::Converged => pb::Stage::Converged,
        BootstrapStage::FailedConnect => pb::Stage::FailedConnect,
        BootstrapStage::FailedBootCheck => pb::Stage::FailedBootCheck,
        BootstrapStage::FailedAgentStart => pb::Stage::FailedAgentStart,
        BootstrapStage::FailedJoin => pb::Stage::FailedJoin,
        BootstrapStage::FailedClosed => pb::Stage::FailedClosed,
    }
}

/// A bootstrap stage from the wire; `None` for an unknown or unset one.
pub fn stage_from_wire(stage: i32) -> Option<BootstrapStage> {
    Some(match pb::Stage::try_from(stage).ok()? {
        pb::Stage::Unspecified => return None,
        pb::Stage::Connected => BootstrapStage::Connected,
        pb::Stage::BootCheck => BootstrapStage::BootCheck,
        pb::Stage::AgentStarted => BootstrapStage::AgentStarted,
        pb::Stage::Joined => BootstrapStage::Joined,
        pb::Stage::Converged => BootstrapStage::Converged,
        pb::Stage::FailedConnect => BootstrapStage::FailedConnect,
        pb::Stage::FailedBootCheck => BootstrapStage::FailedBootCheck,
        pb::Stage::FailedAgentStart => BootstrapStage::FailedAgentStart,
        pb::Stage::FailedJoin => BootstrapStage::FailedJoin,
        pb::Stage::FailedClosed => BootstrapStage::FailedClosed,
    })
}

/// An answer on the wire (its value travels in its response's own field).
pub fn answer_to_wire<T>(answer: &Answer<T>) -> pb::Answer {
    use pb::answer::Outcome;
    let outcome = match answer {
        Answer::Succeeded(_) => Outcome::Succeeded(pb::Succeeded {}),
        Answer::NotReady(reason) => Outcome::NotReady(pb::NotReady {
            reason: reason.clone(),
        }),
        Answer::Retryable(reason) => Outcome::Failed(pb::Failed {
            kind: pb::FailureKind::Retryable.into(),
            reason: reason.clone(),
        }),
        Answer::Permanent(reason) => Outcome::Failed(pb::Failed {
            kind: pb::FailureKind::Permanent.into(),
            reason: reason.clone(),
        }),
        Answer::Ambiguous(reason) => Outcome::Ambiguous(pb::Ambiguous {
            reason: reason.clone(),
        }),
    };
    pb::Answer {
        outcome: Some(outcome),
    }
}

/// An answer from the wire. `value` gives a success its value: `None` (a
/// success without the value it must carry) reads as ambiguous, as does an
/// answer with no outcome set.
pub fn answer_from_wire<T>(answer: Option<pb::Answer>, value: impl FnOnce() -> Option<T>) -> Answer<T> {
    use pb::answer::Outcome;
    match answer.and_then(|a| a.outcome) {
        Some(Outcome::Succeeded(_)) => match value() {
            Some(v) => Answer::Succeeded(v),
            None => Answer::Ambiguous("the plugin answered succeeded without the value it must carry".into()),
        },
        Some(Outcome::NotReady(n)) => Answer::NotReady(n.reason),
        Some(Outcome::Failed(f)) => match pb::FailureKind::try_from(f.kind) {
            Ok(pb::FailureKind::Permanent) => Answer::Permanent(f.reason),
            _ => Answer::Retryable(f.reason),
        },
        Some(Outcome::Ambiguous(a)) => Answer::Ambiguous(a.reason),
        None => Answer::Ambiguous("the plugin's answer had no outcome".into()),
    }
}

/// Milliseconds since the Unix epoch from the wire.
pub fn at_from_wire(ms: u64) -> UnixMillis {
    UnixMillis::new(ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use contract::shape::example_template;

    fn identity() -> ResourceIdentity {
        ResourceIdentity {
            run_uid: RunUid::from_u128(0xabc),
            run_id: RunId::parse("run", "demo").unwrap(),
            node: "workers-3".parse().unwrap(),
            attempt: AttemptId::new(7),
        }
    }

    #[test]
    fn an_identity_survives_the_wire() {
        let wire = identity_to_wire(&identity());
        assert_eq!(
            identity_from_wire("call.identity", Some(&wire)).unwrap(),
            identity()
        );
    }

    #[test]
    fn a_bad_identity_names_its_field() {
        let mut wire = identity_to_wire(&identity());
        wire.run_uid = "nope".into();
        let e = identity_from_wire("call.identity", Some(&wire)).unwrap_err();
        assert_eq!(e.field, "call.identity.run_uid");
        let e = identity_from_wire("call.identity", None).unwrap_err();
        assert_eq!(e.field, "call.identity");
    }

    #[test]
    fn a_template_survives_the_wire() {
        let mut t = example_template("plugin-a", "img:1");
        t.boot.insert(
            "token".into(),
            Param {
                value: "s3cret".into(),
                secret: true,
            },
        );
        let back = template_from_wire("template", Some(template_to_wire(&t)), "plugin-a").unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn every_stage_survives_the_wire() {
        for stage in BootstrapStage::ALL {
            assert_eq!(stage_from_wire(stage_to_wire(stage).into()), Some(stage));
        }
        assert_eq!(stage_from_wire(0), None);
        assert_eq!(stage_from_wire(99), None);
    }

    #[test]
    fn answers_survive_the_wire_and_an_empty_one_is_ambiguous() {
        let cases: Vec<Answer<u8>> = vec![
            Answer::Succeeded(1),
            Answer::NotReady("later".into()),
            Answer::Retryable("busy".into()),
            Answer::Permanent("no such image".into()),
            Answer::Ambiguous("timed out".into()),
        ];
        for a in cases {
            let back = answer_from_wire(Some(answer_to_wire(&a)), || Some(1u8));
            assert_eq!(back, a);
        }
        assert!(matches!(
            answer_from_wire::<u8>(None, || Some(1)),
            Answer::Ambiguous(_)
        ));
        assert!(matches!(
            answer_from_wire::<u8>(Some(pb::Answer { outcome: None }), || Some(1)),
            Answer::Ambiguous(_)
        ));
        // A success without its value cannot be trusted.
        let ok = answer_to_wire(&Answer::Succeeded(()));
        assert!(matches!(
            answer_from_wire::<u8>(Some(ok), || None),
            Answer::Ambiguous(_)
        ));
        // An unspecified failure kind is retryable.
        let unspecified = pb::Answer {
            outcome: Some(pb::answer::Outcome::Failed(pb::Failed {
                kind: 0,
                reason: "x".into(),
            })),
        };
        assert_eq!(
            answer_from_wire::<u8>(Some(unspecified), || None),
            Answer::Retryable("x".into())
        );
    }
}
