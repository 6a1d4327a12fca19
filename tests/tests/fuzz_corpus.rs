//! The fuzzers' saved corpus and every crash they ever found, replayed as
//! ordinary tests through the entry points the fuzz targets call
//! (`fuzz_harness`), so CI checks them without nightly or cargo-fuzz; and
//! the seed inputs, built from `deploy/examples` and the domain types.
//!
//! `FUZZ_WRITE_SEEDS=1 cargo test -p provisioning-tests --test fuzz_corpus`
//! (re)writes the seeds as `fuzz/corpus/<target>/seed-*`.

use std::{
    collections::BTreeMap,
    fs,
    panic::{self, AssertUnwindSafe},
    path::{Path, PathBuf},
    sync::Arc,
};

use contract::{
    AttemptId, BootstrapProgress, BootstrapStage, Claim, ClusterShape, Effect, Endpoint, Epoch, GroupId,
    Intent, LeaseId, LogicalNodeId, ManagedNode, NodeFacts, NodeStage, NodeTemplate, Observation, Operation,
    OperationId, OperationInput, OperationResult, Outcome, Param, PendingOp, PermanentFailure, Rejection,
    RejectionReason, ResultFacts, RetryState, RunId, RunUid, SessionId, TraceContext, UnixMillis,
    decision::Action,
    pb,
    shape::example_template,
    wire::{TemplateTable, node_to_wire, shape_from_wire, shape_to_wire_with_table, trace_to_wire},
};
use decider::DesiredView;
use fuzz_harness::{self as fuzzing, Verdict, Violation};

type TestResult = anyhow::Result<()>;
type Entry = fn(&[u8]) -> Result<Verdict, Violation>;

/// Every fuzz target, by its name in `fuzz/Cargo.toml`, with its entry point.
const TARGETS: [(&str, Entry); 7] = [
    ("apply_request", fuzzing::apply_request),
    ("plan_request", fuzzing::plan_request),
    ("run_request", fuzzing::run_request),
    ("decide_call", fuzzing::decide_call),
    ("driver_message", fuzzing::driver_message),
    ("executor_message", fuzzing::executor_message),
    ("shape_validation", fuzzing::shape_validation),
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The files directly in `dir`, sorted; none if it does not exist.
fn files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_file() {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

#[test]
fn every_fuzz_target_is_replayed() -> TestResult {
    let manifest = fs::read_to_string(repo().join("fuzz/Cargo.toml"))?;
    let mut declared: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.trim().strip_prefix("name = \""))
        .filter_map(|rest| rest.strip_suffix('"'))
        .filter(|name| *name != "provisioning-fuzz")
        .collect();
    declared.sort_unstable();
    let mut replayed: Vec<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
    replayed.sort_unstable();
    assert_eq!(
        declared, replayed,
        "fuzz/Cargo.toml's targets and this test's differ"
    );
    Ok(())
}

/// Every corpus input and every saved crash: no panic, no broken property,
/// and each target's corpus reaches acceptance.
#[test]
fn the_corpus_and_past_crashes_replay_cleanly() -> TestResult {
    let mut failures = Vec::new();
    for (target, entry) in TARGETS {
        let corpus = files(&repo().join("fuzz/corpus").join(target))?;
        let crashes = files(&repo().join("fuzz/artifacts").join(target))?;
        assert!(!corpus.is_empty(), "fuzz/corpus/{target} is empty or missing");
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for path in corpus.iter().chain(&crashes) {
            let data = fs::read(path)?;
            match panic::catch_unwind(AssertUnwindSafe(|| entry(&data))) {
                Ok(Ok(verdict)) => {
                    let kind = match verdict {
                        Verdict::Undecodable => "undecodable",
                        Verdict::Refused(_) => "refused",
                        Verdict::Accepted => "accepted",
                    };
                    *counts.entry(kind).or_default() += 1;
                }
                Ok(Err(v)) => failures.push(format!("{}: {v}", path.display())),
                Err(_) => failures.push(format!("{}: panicked", path.display())),
            }
        }
        eprintln!(
            "{target}: {} corpus inputs, {} saved crashes: {counts:?}",
            corpus.len(),
            crashes.len()
        );
        assert!(
            counts.get("accepted").copied().unwrap_or(0) > 0,
            "no input in fuzz/corpus/{target} is accepted"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

// ---------------------------------------------------------------------------
// Seeds
// ---------------------------------------------------------------------------

const NOW: u64 = 1_700_000_000_000;

fn uid() -> RunUid {
    RunUid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef)
}

fn trace() -> TraceContext {
    TraceContext {
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        tracestate: "vendor=x".to_owned(),
    }
}

fn node(s: &str) -> anyhow::Result<LogicalNodeId> {
    Ok(LogicalNodeId::parse("node_id", s)?)
}

fn op_id(attempt: u64, seq: u32) -> OperationId {
    OperationId::new(AttemptId::new(attempt), seq)
}

/// The example shape files, as the driver receives them.
fn example_shapes() -> anyhow::Result<Vec<(String, pb::ClusterShape)>> {
    let mut out = Vec::new();
    for name in ["shape.yaml", "shape-v2.yaml", "shape.json", "broken.yaml"] {
        let text = fs::read_to_string(repo().join("deploy/examples").join(name))?;
        let shape = provisionctl::shapefile::load(name, &text, 1)?;
        let stem = name.replace('.', "-");
        out.push((stem, shape));
    }
    Ok(out)
}

/// Nodes in the states the ladder distinguishes, for a shape with groups
/// `ctrl` and `workers`.
fn nodes(shape: &ClusterShape) -> anyhow::Result<Vec<ManagedNode>> {
    let template = |g: &str| -> anyhow::Result<Arc<NodeTemplate>> {
        shape
            .group(&GroupId::parse("id", g)?)
            .map(|g| Arc::clone(&g.template))
            .ok_or_else(|| anyhow::anyhow!("no group {g}"))
    };
    let ctrl = template("ctrl")?;
    let workers = template("workers")?;
    let at = |ms: u64| UnixMillis::new(NOW + ms);
    let lease = LeaseId::new("lease", "lease-7")?;
    let endpoint = Endpoint::new("endpoint", "127.0.0.1:4242")?;
    let session = SessionId::new("session", "session-3")?;

    let fresh = ManagedNode::new(
        node("ctrl-0")?,
        AttemptId::new(1),
        Arc::clone(&ctrl),
        RetryState::default(),
    );

    let mut pending = ManagedNode::new(
        node("ctrl-1")?,
        AttemptId::new(2),
        Arc::clone(&ctrl),
        RetryState::default(),
    );
    pending.stage = NodeStage::LeaseCreated;
    pending.facts.lease = Some(lease.clone());
    pending.pending = Some(PendingOp {
        id: op_id(2, 1),
        effect: Effect::LookupEndpoint,
        deadline: at(5_000),
        dispatched_at: at(0),
    });

    let mut converged = ManagedNode::new(
        node("workers-0")?,
        AttemptId::new(3),
        Arc::clone(&workers),
        RetryState::default(),
    );
    converged.stage = NodeStage::BootstrapRunning;
    converged.facts = NodeFacts {
        lease: Some(lease.clone()),
        endpoint: Some(endpoint.clone()),
        session: Some(session.clone()),
        bootstrap: Some(BootstrapProgress {
            stage: BootstrapStage::Converged,
            seq: 5,
            at: at(0),
            detail: String::new(),
        }),
        failure: None,
        ambiguous_create: false,
        ambiguous_bootstrap: false,
        lost: false,
        health: None,
    };

    let mut bootstrapping = ManagedNode::new(
        node("workers-1")?,
        AttemptId::new(4),
        Arc::clone(&workers),
        RetryState::default(),
    );
    bootstrapping.stage = NodeStage::BootstrapRunning;
    bootstrapping.facts.lease = Some(lease.clone());
    bootstrapping.facts.endpoint = Some(endpoint);
    bootstrapping.facts.session = Some(session);
    bootstrapping.stage_deadline = Some(at(30_000));

    let mut destroyed = ManagedNode::new(
        node("workers-2")?,
        AttemptId::new(5),
        Arc::clone(&workers),
        RetryState {
            consecutive_failures: 3,
            next_effect_at: None,
            restart_at: Some(at(2_000)),
            permanent: Some(PermanentFailure {
                reason: "image not found".to_owned(),
                spec: Arc::clone(&workers),
            }),
            remediating: false,
        },
    );
    destroyed.stage = NodeStage::Destroyed;
    destroyed.facts.failure = Some(contract::Failure {
        reason: "image not found".to_owned(),
        at: at(0),
    });

    let mut deleting = ManagedNode::new(
        node("workers-99")?,
        AttemptId::new(6),
        Arc::clone(&workers),
        RetryState {
            next_effect_at: Some(at(1_000)),
            ..RetryState::default()
        },
    );
    deleting.intent = Intent::Deleting;
    deleting.stage = NodeStage::Failed;
    deleting.facts.lease = Some(lease);
    deleting.facts.ambiguous_bootstrap = true;

    let mut reaped = ManagedNode::new(
        node("ctrl-3")?,
        AttemptId::new(8),
        Arc::clone(&ctrl),
        RetryState::default(),
    );
    reaped.stage = NodeStage::Destroyed;

    let mut restarted = ManagedNode::new(
        node("workers-3")?,
        AttemptId::new(9),
        Arc::clone(&workers),
        RetryState {
            consecutive_failures: 1,
            restart_at: Some(at(0)),
            ..RetryState::default()
        },
    );
    restarted.stage = NodeStage::Destroyed;

    let drifted = ManagedNode::new(
        node("ctrl-2")?,
        AttemptId::new(7),
        Arc::new(example_template("fake", "img:old")),
        RetryState::default(),
    );
    Ok(vec![
        fresh,
        pending,
        converged,
        bootstrapping,
        destroyed,
        deleting,
        reaped,
        restarted,
        drifted,
    ])
}

/// A `Decide` call for `shape` over `nodes`: header (templates by table), the
/// nodes, their slots (as indices, or as one range per slot), `end`.
fn decide_seed(shape: &ClusterShape, nodes: &[ManagedNode], deleting: bool, ranges: bool) -> Vec<u8> {
    let mut table = TemplateTable::default();
    let (desired, group_template_refs) = shape_to_wire_with_table(shape, &mut table);
    let wire_nodes: Vec<pb::NodeState> = nodes.iter().map(|n| node_to_wire(n, &mut table)).collect();
    let mut slots: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for n in nodes {
        slots.entry(n.id.group().as_str()).or_default().push(n.id.index());
    }
    let part = |p| pb::DecideRequest {
        part: Some(p),
        trace: trace_to_wire(&trace()),
    };
    use pb::decide_request::Part;
    let mut requests = vec![part(Part::Header(pb::DecideHeader {
        desired: Some(desired),
        now_ms: NOW,
        templates: table.into_wire(),
        group_template_refs,
        deleting,
        group_counts: Vec::new(),
    }))];
    requests.push(part(Part::Nodes(pb::NodeBatch { nodes: wire_nodes })));
    for (group, indices) in slots {
        requests.push(part(if ranges {
            Part::SlotRanges(pb::SlotRanges {
                group_id: group.to_owned(),
                bounds: indices.iter().flat_map(|&i| [i, i + 1]).collect(),
            })
        } else {
            Part::Slots(pb::SlotBatch {
                group_id: group.to_owned(),
                indices,
            })
        }));
    }
    requests.push(part(Part::End(pb::DecideEnd {})));
    fuzzing::decide_input(&requests)
}

/// A shape small enough for a `Decide` call under the fuzz limit.
fn small(shape: &pb::ClusterShape) -> anyhow::Result<ClusterShape> {
    let mut shape = shape_from_wire(shape.clone())?;
    for g in &mut shape.groups {
        g.count = g.count.min(4);
    }
    Ok(shape)
}

fn driver_messages() -> anyhow::Result<Vec<(String, pb::DriverMessage)>> {
    use pb::driver_message::Kind;
    let run_id = RunId::parse("run_id", "demo")?;
    let msg = |kind| pb::DriverMessage {
        kind: Some(kind),
        trace: trace_to_wire(&trace()),
    };
    let mut out = vec![(
        "claim".to_owned(),
        msg(Kind::Claim(pb::Claim::from(&Claim {
            run_uid: uid(),
            run_id: run_id.clone(),
            epoch: Epoch::new(3),
        }))),
    )];
    let mut params = contract::Params::new();
    params.insert(
        "cluster".to_owned(),
        Param {
            value: "demo".to_owned(),
            secret: false,
        },
    );
    params.insert(
        "token".to_owned(),
        Param {
            value: "s3cret".to_owned(),
            secret: true,
        },
    );
    let inputs = [
        (
            "create-lease",
            OperationInput::CreateLease {
                template: Arc::new(example_template("fake", "img:1")),
            },
        ),
        (
            "lookup-endpoint",
            OperationInput::LookupEndpoint {
                lease: LeaseId::new("lease", "lease-7")?,
            },
        ),
        (
            "start-bootstrap",
            OperationInput::StartBootstrap {
                lease: LeaseId::new("lease", "lease-7")?,
                endpoint: Endpoint::new("endpoint", "127.0.0.1:4242")?,
                boot: params.clone(),
                join: params,
            },
        ),
        (
            "cancel-bootstrap",
            OperationInput::CancelBootstrap { session: None },
        ),
        (
            "destroy-lease",
            OperationInput::DestroyLease {
                lease: Some(LeaseId::new("lease", "lease-7")?),
            },
        ),
    ];
    for (i, (name, input)) in (1u32..).zip(inputs) {
        let op = Operation {
            run_uid: uid(),
            run_id: run_id.clone(),
            node: node("workers-3")?,
            id: op_id(4, i),
            epoch: Epoch::new(3),
            deadline: UnixMillis::new(NOW + 10_000),
            provider: "fake".into(),
            input,
            trace: trace(),
        };
        out.push((
            format!("submit-{name}"),
            msg(Kind::Submit(pb::Operation::from(&op))),
        ));
    }
    out.push((
        "ack".to_owned(),
        msg(Kind::Ack(pb::Ack {
            results: vec![pb::ResultRef {
                run_uid: uid().to_string(),
                id: Some(op_id(4, 1).into()),
            }],
            observations: vec![pb::ObservationRef {
                run_uid: uid().to_string(),
                session_id: "session-3".to_owned(),
                seq: 4,
            }],
            changes: vec![pb::ChangeRef {
                run_uid: uid().to_string(),
                seq: 2,
            }],
        })),
    ));
    out.push((
        "observe-from".to_owned(),
        msg(Kind::ObserveFrom(pb::ObserveFrom {
            run_uid: uid().to_string(),
            after: vec![pb::ObservationRef {
                run_uid: String::new(),
                session_id: "session-3".to_owned(),
                seq: 2,
            }],
        })),
    ));
    out.push((
        "forget".to_owned(),
        msg(Kind::Forget(pb::ForgetRun {
            run_uid: uid().to_string(),
            epoch: 3,
        })),
    ));
    Ok(out)
}

fn executor_messages() -> anyhow::Result<Vec<(String, pb::ExecutorMessage)>> {
    use pb::executor_message::Kind;
    let msg = |kind| pb::ExecutorMessage {
        kind: Some(kind),
        trace: trace_to_wire(&trace()),
    };
    let result = |outcome, effect| -> anyhow::Result<pb::OperationResult> {
        Ok(pb::OperationResult::from(&OperationResult {
            run_uid: uid(),
            node: node("workers-3")?,
            id: op_id(4, 2),
            effect,
            outcome,
            completed_at: UnixMillis::new(NOW),
            late: false,
            replayed: true,
            trace: trace(),
        }))
    };
    let facts = ResultFacts {
        lease: Some(LeaseId::new("lease", "lease-7")?),
        endpoint: Some(Endpoint::new("endpoint", "127.0.0.1:4242")?),
        session: None,
    };
    Ok(vec![
        (
            "claimed".to_owned(),
            msg(Kind::Claimed(pb::ClaimAccepted {
                run_uid: uid().to_string(),
                epoch: 3,
            })),
        ),
        (
            "result-succeeded".to_owned(),
            msg(Kind::Result(result(
                Outcome::Succeeded(facts),
                Effect::CreateLease,
            )?)),
        ),
        (
            "result-ambiguous".to_owned(),
            msg(Kind::Result(result(
                Outcome::Ambiguous {
                    reason: "timed out".to_owned(),
                },
                Effect::StartBootstrap,
            )?)),
        ),
        (
            "observation".to_owned(),
            msg(Kind::Observation(pb::BootstrapObservation::from(&Observation {
                run_uid: uid(),
                node: node("workers-3")?,
                attempt: AttemptId::new(4),
                session: SessionId::new("session", "session-3")?,
                seq: 3,
                stage: BootstrapStage::AgentStarted,
                detail: "agent up".to_owned(),
                at: UnixMillis::new(NOW),
                trace: trace(),
            }))),
        ),
        (
            "resource-lost".to_owned(),
            msg(Kind::Change(pb::ResourceChange::from(
                &contract::ResourceChange {
                    run_uid: uid(),
                    node: node("workers-3")?,
                    attempt: AttemptId::new(4),
                    seq: 1,
                    change: contract::Change::Lost {
                        reason: "node agent pid 42 was killed by signal 9".to_owned(),
                    },
                    at: UnixMillis::new(NOW),
                    trace: trace(),
                },
            ))),
        ),
        (
            "rejection".to_owned(),
            msg(Kind::Rejection(pb::Rejection::from(&Rejection {
                run_uid: uid(),
                id: Some(op_id(4, 2)),
                reason: RejectionReason::Fenced,
                message: "fenced".to_owned(),
                highest_epoch: Epoch::new(9),
            }))),
        ),
    ])
}

/// Every seed, by target: valid inputs the services accept.
fn seeds() -> anyhow::Result<Vec<(&'static str, String, Vec<u8>)>> {
    let mut out = Vec::new();
    let shapes = example_shapes()?;
    for (name, shape) in &shapes {
        let apply = pb::ApplyRequest {
            shape: Some(shape.clone()),
        };
        out.push(("apply_request", name.clone(), fuzzing::encode(&apply)));
        let plan = pb::PlanRequest {
            shape: Some(shape.clone()),
        };
        out.push(("plan_request", name.clone(), fuzzing::encode(&plan)));
    }

    let run = || "demo".to_owned();
    let node_id = || "workers-3".to_owned();
    let run_requests = [
        fuzzing::run_request_input(
            0,
            &pb::GetRunRequest {
                run_id: run(),
                include_nodes: true,
            },
        ),
        fuzzing::run_request_input(1, &pb::ListRunsRequest::default()),
        fuzzing::run_request_input(
            2,
            &pb::WatchRunRequest {
                run_id: run(),
                include_nodes: false,
            },
        ),
        fuzzing::run_request_input(
            3,
            &pb::ExplainNodeRequest {
                run_id: run(),
                node_id: node_id(),
            },
        ),
        fuzzing::run_request_input(4, &pb::DeleteRunRequest { run_id: run() }),
        fuzzing::run_request_input(5, &pb::PauseRunRequest { run_id: run() }),
        fuzzing::run_request_input(6, &pb::ResumeRunRequest { run_id: run() }),
        fuzzing::run_request_input(
            7,
            &pb::AbandonNodeRequest {
                run_id: run(),
                node_id: node_id(),
            },
        ),
        fuzzing::run_request_input(8, &pb::ListOrphansRequest {}),
        fuzzing::run_request_input(
            9,
            &pb::ListEventsRequest {
                run_id: run(),
                after_seq: 3,
                limit: 20,
            },
        ),
        fuzzing::run_request_input(
            10,
            &pb::WatchEventsRequest {
                run_id: run(),
                after_seq: 3,
            },
        ),
        fuzzing::run_request_input(
            11,
            &pb::ListNodesRequest {
                run_id: run(),
                page_size: 100,
                page_token: node_id(),
            },
        ),
    ];
    for (method, input) in fuzzing::RUN_REQUESTS.iter().zip(run_requests) {
        out.push(("run_request", method.to_lowercase(), input));
    }

    let demo = shapes
        .first()
        .map(|(_, s)| small(s))
        .ok_or_else(|| anyhow::anyhow!("no example shapes"))??;
    let demo_nodes = nodes(&demo)?;
    out.push((
        "decide_call",
        "demo".to_owned(),
        decide_seed(&demo, &demo_nodes, false, false),
    ));
    out.push((
        "decide_call",
        "demo-ranges".to_owned(),
        decide_seed(&demo, &demo_nodes, false, true),
    ));
    out.push((
        "decide_call",
        "demo-deleting".to_owned(),
        decide_seed(&demo, &demo_nodes, true, false),
    ));
    // Templates inline rather than by table, and no nodes yet: all inserts.
    use pb::decide_request::Part;
    let inline = fuzzing::decide_input(&[
        pb::DecideRequest {
            part: Some(Part::Header(pb::DecideHeader {
                desired: Some(pb::ClusterShape::from(&demo)),
                now_ms: NOW,
                templates: Vec::new(),
                group_template_refs: Vec::new(),
                deleting: false,
                group_counts: Vec::new(),
            })),
            trace: None,
        },
        pb::DecideRequest {
            part: Some(Part::End(pb::DecideEnd {})),
            trace: None,
        },
    ]);
    out.push(("decide_call", "inline-templates".to_owned(), inline));

    for (name, m) in driver_messages()? {
        out.push(("driver_message", name, fuzzing::encode(&m)));
    }
    for (name, m) in executor_messages()? {
        out.push(("executor_message", name, fuzzing::encode(&m)));
    }
    // Structured input: every byte read as 1 builds a valid shape under the
    // default limits.
    out.push(("shape_validation", "ones".to_owned(), vec![1; 512]));
    Ok(out)
}

#[test]
fn the_seeds_are_accepted() -> TestResult {
    let write = std::env::var_os("FUZZ_WRITE_SEEDS").is_some();
    for (target, name, input) in seeds()? {
        let entry = TARGETS
            .iter()
            .find(|(t, _)| *t == target)
            .map(|(_, e)| *e)
            .ok_or_else(|| anyhow::anyhow!("no target {target}"))?;
        assert_eq!(entry(&input)?, Verdict::Accepted, "{target}/{name}");
        if write {
            let dir = repo().join("fuzz/corpus").join(target);
            fs::create_dir_all(&dir)?;
            fs::write(dir.join(format!("seed-{name}")), &input)?;
        }
    }
    Ok(())
}

/// The decide seed really is decided: one decision per node, of the kind its
/// state calls for, and inserts for the desired slots without a node.
#[test]
fn the_decide_seed_reaches_every_kind_of_decision() -> TestResult {
    let shapes = example_shapes()?;
    let demo = shapes
        .first()
        .map(|(_, s)| small(s))
        .ok_or_else(|| anyhow::anyhow!("no example shapes"))??;
    let nodes = nodes(&demo)?;
    let view = DesiredView::new(&demo, false);
    let actions: Vec<Action> = nodes
        .iter()
        .map(|n| decider::decide_node(&view, n, UnixMillis::new(NOW)).action)
        .collect();
    type Is = fn(&Action) -> bool;
    let kinds: [(&str, Is); 6] = [
        ("dispatch", |a| matches!(a, Action::Dispatch(_))),
        ("wait", |a| matches!(a, Action::Wait { .. })),
        ("restart", |a| matches!(a, Action::Restart)),
        ("reap", |a| matches!(a, Action::Reap)),
        ("begin-delete", |a| matches!(a, Action::BeginDelete)),
        ("observe-convergence", |a| matches!(a, Action::ObserveConvergence)),
    ];
    for (name, is) in kinds {
        assert!(actions.iter().any(is), "no {name} among {actions:?}");
    }
    Ok(())
}
