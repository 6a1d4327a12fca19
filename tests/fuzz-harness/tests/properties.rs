//! Property tests of validation and the wire mappings: valid shapes validate
//! and survive the wire every way it carries them; ids print as they parse;
//! decisions survive the wire; and the fuzz entry points
//! (`fuzz_harness`) find no broken property on random and on mutated
//! valid inputs, the cheap cousin of the fuzz runs for every `cargo test`.

use std::sync::Arc;

use contract::{
    AttemptId, ClusterShape, Decision, Effect, GroupId, LogicalNodeId, NodeGroup, NodeTemplate, Param,
    Params, ProviderShape, Rule, RunId, RunUid, ShapeLimits, UnixMillis,
    decision::Action,
    ids::Generation,
    pb,
    shape::Accelerator,
    wire::{
        REDACTED, TemplateTable, shape_from_wire, shape_from_wire_with_table, shape_to_wire_redacted,
        shape_to_wire_with_table,
    },
};
use fuzz_harness::{self as fuzzing, Verdict};
use proptest::{collection, prelude::*};
use prost::Message;

fn label() -> impl Strategy<Value = String> {
    "[a-z]([a-z0-9-]{0,20}[a-z0-9])?"
}

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9:/._ é-]{0,24}"
}

fn nonempty_text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9:/._ é-]{1,24}"
}

fn quantity() -> impl Strategy<Value = f64> {
    prop_oneof![Just(0.0), Just(-0.0), 0.0..1.0e9f64]
}

fn params() -> impl Strategy<Value = Params> {
    collection::btree_map(
        nonempty_text(),
        (text(), any::<bool>()).prop_map(|(value, secret)| Param { value, secret }),
        0..5,
    )
}

fn template() -> impl Strategy<Value = NodeTemplate> {
    let provider = (
        nonempty_text(),
        text(),
        quantity(),
        quantity(),
        collection::vec(
            (nonempty_text(), any::<u32>()).prop_map(|(kind, count)| Accelerator { kind, count }),
            0..3,
        ),
        text(),
        collection::btree_map(text(), text(), 0..4),
    )
        .prop_map(
            |(name, machine_type, cpu, memory_gib, accelerators, zone, labels)| ProviderShape {
                name,
                machine_type,
                cpu,
                memory_gib,
                accelerators,
                zone,
                labels,
            },
        );
    (text(), provider, nonempty_text(), params(), params()).prop_map(|(role, provider, image, boot, join)| {
        NodeTemplate {
            role,
            provider,
            image,
            boot,
            join,
        }
    })
}

/// Shapes within the default limits; some groups share a template.
fn valid_shape() -> impl Strategy<Value = ClusterShape> {
    (
        label(),
        1..u64::MAX,
        collection::btree_map(label(), (0..=1000u32, template(), any::<bool>()), 0..6),
    )
        .prop_filter_map("ids parse", |(run, generation, groups)| {
            let mut out: Vec<NodeGroup> = Vec::new();
            for (id, (count, template, share)) in groups {
                let template = match out.last() {
                    Some(last) if share => Arc::clone(&last.template),
                    _ => Arc::new(template),
                };
                out.push(NodeGroup {
                    id: GroupId::parse("id", &id).ok()?,
                    count,
                    template,
                    policy: Default::default(),
                });
            }
            Some(ClusterShape {
                run_id: RunId::parse("run_id", &run).ok()?,
                generation: Generation::new(generation),
                labels: Default::default(),
                groups: out,
            })
        })
}

fn decision() -> impl Strategy<Value = Decision> {
    let effect = prop_oneof![
        Just(Effect::CreateLease),
        Just(Effect::LookupEndpoint),
        Just(Effect::StartBootstrap),
        Just(Effect::CancelBootstrap),
        Just(Effect::DestroyLease),
    ];
    let action = prop_oneof![
        Just(Action::Insert),
        Just(Action::Reap),
        Just(Action::Restart),
        Just(Action::BeginDelete),
        Just(Action::MarkDestroyed),
        Just(Action::ObserveConvergence),
        effect.prop_map(Action::Dispatch),
        // On the wire 0 means "no deadline", so a deadline is never 0.
        proptest::option::of(1..u64::MAX).prop_map(|t| Action::Wait {
            until: t.map(UnixMillis::new)
        }),
    ];
    (
        label(),
        any::<u32>(),
        proptest::option::of(1..u64::MAX),
        0..Rule::ALL.len(),
        action,
        text(),
    )
        .prop_filter_map("ids parse", |(group, index, attempt, rule, action, reason)| {
            Some(Decision {
                node: LogicalNodeId::new(GroupId::parse("id", &group).ok()?, index),
                attempt: attempt.map(AttemptId::new),
                rule: *Rule::ALL.get(rule)?,
                action,
                reason: reason.into(),
            })
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn valid_shapes_validate_and_survive_the_wire(shape in valid_shape()) {
        prop_assert_eq!(shape.validate(&ShapeLimits::default()), Ok(()));

        let bytes = pb::ClusterShape::from(&shape).encode_to_vec();
        let back = shape_from_wire(pb::ClusterShape::decode(bytes.as_slice())?)?;
        prop_assert_eq!(&back, &shape);

        let mut table = TemplateTable::default();
        let (wire, refs) = shape_to_wire_with_table(&shape, &mut table);
        // Each distinct template crosses once.
        let distinct: Vec<&NodeTemplate> = shape.groups.iter().fold(Vec::new(), |mut seen, g| {
            if !seen.contains(&&*g.template) {
                seen.push(&*g.template);
            }
            seen
        });
        prop_assert_eq!(table.len(), distinct.len());
        let templates = TemplateTable::from_wire(table.into_wire())?;
        let back = shape_from_wire_with_table(Some(wire), &refs, &templates)?;
        prop_assert_eq!(&back, &shape);
        // Groups decoded through the table share its templates.
        for (g, r) in back.groups.iter().zip(&refs) {
            let shared = templates.get(*r as usize).is_some_and(|t| Arc::ptr_eq(t, &g.template));
            prop_assert!(shared);
        }
    }

    #[test]
    fn read_paths_hide_exactly_the_secrets(shape in valid_shape()) {
        let read = shape_to_wire_redacted(&shape);
        for (g, w) in shape.groups.iter().zip(&read.groups) {
            let t = w.template.as_ref().ok_or_else(|| TestCaseError::fail("no template"))?;
            for (params, wire) in [(&g.template.boot, &t.boot), (&g.template.join, &t.join)] {
                prop_assert_eq!(params.len(), wire.len());
                for (k, p) in params {
                    let w = wire.get(k).ok_or_else(|| TestCaseError::fail("a parameter is gone"))?;
                    prop_assert_eq!(w.secret, p.secret);
                    if p.secret {
                        prop_assert_eq!(w.value.as_str(), REDACTED);
                    } else {
                        prop_assert_eq!(&w.value, &p.value);
                    }
                }
            }
        }
    }

    #[test]
    fn tighter_limits_refuse_what_exceeds_them(shape in valid_shape(), cut in 0usize..4) {
        let largest = shape.groups.iter().map(|g| g.count).max().unwrap_or(0);
        let limits = ShapeLimits {
            max_groups: shape.groups.len().saturating_sub(cut),
            max_nodes_per_group: largest.saturating_sub(u32::try_from(cut).unwrap_or(0)),
            ..ShapeLimits::default()
        };
        let fits = shape.groups.len() <= limits.max_groups
            && shape.groups.iter().all(|g| g.count <= limits.max_nodes_per_group);
        let checked = shape.validate(&limits);
        prop_assert_eq!(checked.is_ok(), fits, "{:?}", checked);
        if let Err(e) = checked {
            prop_assert!(e.field.starts_with("groups"), "{}", e);
        }
    }

    #[test]
    fn node_ids_print_as_they_parse(group in label(), index in any::<u32>()) {
        let group = GroupId::parse("id", &group)?;
        let id = LogicalNodeId::new(group.clone(), index);
        let spelled = id.to_string();
        prop_assert_eq!(LogicalNodeId::parse("node_id", &spelled)?, id);
        // A leading zero is another spelling of the same slot, and refused.
        let padded = format!("{group}-0{index}");
        prop_assert!(LogicalNodeId::parse("node_id", &padded).is_err());
    }

    #[test]
    fn run_uids_print_as_they_parse(v in any::<u128>()) {
        let uid = RunUid::from_u128(v);
        let spelled = uid.to_string();
        prop_assert_eq!(RunUid::parse("run_uid", &spelled)?, uid);
        let upper = spelled.to_uppercase();
        prop_assert_eq!(RunUid::parse("run_uid", &upper).is_ok(), upper == spelled);
    }

    #[test]
    fn decisions_survive_the_wire(d in decision()) {
        let bytes = pb::Decision::from(&d).encode_to_vec();
        prop_assert_eq!(Decision::try_from(pb::Decision::decode(bytes.as_slice())?)?, d);
    }

    #[test]
    fn valid_requests_are_accepted_and_mutations_break_nothing(
        shape in valid_shape(),
        flips in collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let request = fuzzing::encode(&pb::ApplyRequest { shape: Some(pb::ClusterShape::from(&shape)) });
        prop_assert_eq!(fuzzing::apply_request(&request)?, Verdict::Accepted);
        prop_assert_eq!(fuzzing::plan_request(&request)?, Verdict::Accepted);
        let mut mutated = request.clone();
        if !mutated.is_empty() {
            for (at, byte) in &flips {
                let i = at.index(mutated.len());
                mutated[i] ^= *byte;
            }
        }
        fuzzing::apply_request(&mutated)?;
        fuzzing::apply_request(&request[..cut.index(request.len() + 1)])?;
        let op = pb::DriverMessage {
            kind: Some(pb::driver_message::Kind::Submit(pb::Operation {
                input: Some(pb::operation::Input::CreateLease(pb::CreateLeaseInput {
                    template: shape.groups.first().map(|g| pb::NodeTemplate::from(&*g.template)),
                })),
                ..pb::Operation::default()
            })),
            trace: None,
        };
        let mut op = fuzzing::encode(&op);
        for (at, byte) in &flips {
            let i = at.index(op.len());
            op[i] ^= *byte;
        }
        fuzzing::driver_message(&op)?;
    }

    #[test]
    fn random_inputs_break_no_property(data in collection::vec(any::<u8>(), 0..1024)) {
        fuzzing::apply_request(&data)?;
        fuzzing::plan_request(&data)?;
        fuzzing::run_request(&data)?;
        fuzzing::driver_message(&data)?;
        fuzzing::executor_message(&data)?;
        fuzzing::shape_validation(&data)?;
    }
}

/// The structured fuzz input's two ends: all ones builds a valid shape under
/// the default limits, nothing builds one with no generation.
#[test]
fn the_structured_input_builds_what_it_did() -> Result<(), Box<dyn std::error::Error>> {
    assert_eq!(fuzzing::shape_validation(&[1; 512])?, Verdict::Accepted);
    assert!(matches!(fuzzing::shape_validation(&[])?, Verdict::Refused(m) if m.starts_with("generation")));
    Ok(())
}
