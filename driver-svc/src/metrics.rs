//! The driver's metrics: its own totals (for tests and [`crate::driver::Driver::metrics`])
//! and the Prometheus families the metrics endpoint serves, each documented in
//! docs/observability.md, "Metrics".

use std::sync::atomic::{AtomicU64, Ordering};

use platform::metrics::{Counter, Gauge, Histogram};

use crate::core::PassOutcome;

/// Driver-wide counters, and the driver's Prometheus metrics (each is
/// documented in docs/observability.md, "Metrics"). The atomics are the driver's
/// own totals for tests and callers of [`Driver::metrics`]; the registry
/// handles are what the metrics endpoint serves.
#[derive(Debug)]
pub struct Metrics {
    pub passes: AtomicU64,
    pub operations: AtomicU64,
    pub transitions: AtomicU64,
    pub stale_decisions: AtomicU64,
    pub decider_errors: AtomicU64,
    pub actions_by_rule: [AtomicU64; contract::Rule::SLOTS],
    pub(crate) exported: Exported,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            passes: AtomicU64::default(),
            operations: AtomicU64::default(),
            transitions: AtomicU64::default(),
            stale_decisions: AtomicU64::default(),
            decider_errors: AtomicU64::default(),
            actions_by_rule: Default::default(),
            exported: Exported::new(platform::metrics::global()),
        }
    }
}

/// The work queue's name in the `name` label, as client-go's work queues
/// label theirs: one key per run.
pub(crate) const QUEUE: &str = "runs";

/// The controller's name in the `controller` label, as controller-runtime
/// labels its reconcile metrics: the driver reconciles runs.
pub(crate) const CONTROLLER: &str = "run";

/// The driver's metric families, in the controller-runtime / client-go work
/// queue conventions where one applies.
#[derive(Debug, Clone)]
pub(crate) struct Exported {
    pub(crate) queue_depth: Gauge,
    pub(crate) queue_adds: Counter,
    pub(crate) queue_duration: Histogram,
    pub(crate) queue_retries: Counter,
    pub(crate) work_duration: Histogram,
    pub(crate) reconcile: Counter,
    pub(crate) reconcile_errors: Counter,
    pub(crate) pass_duration: Histogram,
    pub(crate) actions: Counter,
    pub(crate) stale_decisions: Counter,
    pub(crate) dispatched: Counter,
    pub(crate) in_flight: Gauge,
    pub(crate) operation_duration: Histogram,
    pub(crate) folds: Counter,
    pub(crate) discarded: Counter,
    pub(crate) converged: Counter,
    pub(crate) lost: Counter,
    pub(crate) sessions_asked_again: Counter,
    pub(crate) health: Counter,
    pub(crate) remediated: Counter,
    pub(crate) unhealthy: Gauge,
    pub(crate) remediation_held: Gauge,
    pub(crate) admission_waiting: Gauge,
    pub(crate) takeovers: Counter,
    pub(crate) reloads: Counter,
    pub(crate) store_commits: Counter,
    pub(crate) store_node_writes: Counter,
    pub(crate) nodes: Gauge,
    pub(crate) runs: Gauge,
    pub(crate) link_up: Gauge,
    pub(crate) link_events: Counter,
}

/// A pass's result in `provisioning_reconcile_total{result}`.
pub(crate) const RECONCILE_RESULTS: [&str; 4] = ["success", "requeue", "requeue_after", "error"];

/// Why a pass failed, in `provisioning_reconcile_errors_total{reason}`.
pub(crate) const RECONCILE_ERRORS: [&str; 4] = [
    "decider_unavailable",
    "decider_rejected",
    "decider_undecodable",
    "apply",
];

/// What was folded, in `provisioning_folds_total{kind}`.
pub(crate) const FOLD_KINDS: [&str; 4] = ["result", "observation", "change", "rejection"];

/// A health report's state, in `provisioning_node_health_changes_total{state}`.
pub(crate) const HEALTH_STATES: [&str; 2] = ["healthy", "unhealthy"];

impl Exported {
    fn new(r: &platform::metrics::Registry) -> Self {
        let e = Self::register(r);
        e.declare();
        e
    }

    /// Exports each counter's known label values at zero from the start
    /// (`provisioning_stale_results_discarded_total` with every kind and
    /// reason: a family with no series is not exported at all).
    fn declare(&self) {
        self.queue_adds.init(&[QUEUE]);
        self.queue_retries.init(&[QUEUE]);
        for result in RECONCILE_RESULTS {
            self.reconcile.init(&[CONTROLLER, result]);
        }
        for reason in RECONCILE_ERRORS {
            self.reconcile_errors.init(&[CONTROLLER, reason]);
        }
        for rule in contract::Rule::ALL {
            self.actions.init(&[&rule.number().to_string(), rule_name(rule)]);
        }
        for effect in contract::Effect::ALL {
            self.dispatched.init(&[effect.name()]);
        }
        for kind in FOLD_KINDS {
            for why in crate::core::Discard::ALL {
                self.discarded.init(&[kind, why.name()]);
            }
            self.folds.init(&[kind]);
        }
        for state in HEALTH_STATES {
            self.health.init(&[state]);
        }
        self.store_commits.init(&[]);
        self.store_node_writes.init(&[]);
    }

    fn register(r: &platform::metrics::Registry) -> Self {
        use platform::metrics::LATENCY_BUCKETS;
        Self {
            queue_depth: r.gauge(
                "provisioning_workqueue_depth",
                "Runs whose next pass is wanted but has not started (a pass is in flight, or the \
                 decider is being retried).",
                &["name"],
            ),
            queue_adds: r.counter(
                "provisioning_workqueue_adds_total",
                "Times a run went from needing nothing to wanting a pass; triggers that arrive while \
                 one is already wanted collapse into it.",
                &["name"],
            ),
            queue_duration: r.histogram(
                "provisioning_workqueue_queue_duration_seconds",
                "How long a run wanted a pass before the pass started.",
                &["name"],
                LATENCY_BUCKETS,
            ),
            queue_retries: r.counter(
                "provisioning_workqueue_retries_total",
                "Passes put back with backoff because the decider could not be reached.",
                &["name"],
            ),
            work_duration: r.histogram(
                "provisioning_workqueue_work_duration_seconds",
                "How long processing a run's turn from the queue took: a pass from its start to \
                 its decisions committed.",
                &["name"],
                LATENCY_BUCKETS,
            ),
            reconcile: r.counter(
                "provisioning_reconcile_total",
                "Passes, by result: success (nothing more to do), requeue (another pass at once), \
                 requeue_after (a deadline will wake the run), error.",
                &["controller", "result"],
            ),
            reconcile_errors: r.counter(
                "provisioning_reconcile_errors_total",
                "Passes that failed, by reason.",
                &["controller", "reason"],
            ),
            pass_duration: r.histogram(
                "provisioning_pass_duration_seconds",
                "Time from the start of a pass to its decisions being applied and committed (the \
                 Decide call included).",
                &["controller"],
                LATENCY_BUCKETS,
            ),
            actions: r.counter(
                "provisioning_actions_total",
                "Actions applied (waits excluded), by ladder rule.",
                &["rule", "name"],
            ),
            stale_decisions: r.counter(
                "provisioning_stale_decisions_total",
                "Decisions skipped because their node changed while the decider ran.",
                &[],
            ),
            dispatched: r.counter(
                "provisioning_operations_dispatched_total",
                "Operations recorded pending and submitted to the executor, by effect.",
                &["effect"],
            ),
            in_flight: r.gauge(
                "provisioning_operations_in_flight",
                "Operations recorded pending and not yet folded, by effect.",
                &["effect"],
            ),
            operation_duration: r.histogram(
                "provisioning_operation_duration_seconds",
                "Time from an operation's dispatch to the fold of its outcome, by effect and outcome \
                 class.",
                &["effect", "outcome"],
                LATENCY_BUCKETS,
            ),
            folds: r.counter(
                "provisioning_folds_total",
                "Executor results, bootstrap observations and rejections folded into run state, by kind.",
                &["kind"],
            ),
            discarded: r.counter(
                "provisioning_stale_results_discarded_total",
                "Results and observations discarded instead of folded (superseded attempt, unknown or \
                 expired operation, late completion, stale session, duplicate), by kind and reason.",
                &["kind", "reason"],
            ),
            converged: r.counter(
                "provisioning_runs_converged_total",
                "Times a run reached convergence for its current generation.",
                &[],
            ),
            lost: r.counter(
                "provisioning_nodes_lost_total",
                "Node attempts failed because the executor reported their resource lost; each slot is \
                 replaced on a fresh attempt.",
                &[],
            ),
            sessions_asked_again: r.counter(
                "provisioning_bootstrap_sessions_asked_again_total",
                "Bootstrap sessions asked again for their stages because none was folded between two \
                 safety ticks (a stage lost on the way comes again; a slow bootstrap only answers \
                 nothing new).",
                &[],
            ),
            health: r.counter(
                "provisioning_node_health_changes_total",
                "Health reports the driver folded, by the state reported (healthy, unhealthy): the \
                 executor reports a node's first answered probe and every change.",
                &["state"],
            ),
            remediated: r.counter(
                "provisioning_nodes_remediated_total",
                "Node attempts replaced because they were unhealthy for their group's unhealthy_after, \
                 within its remediation budget.",
                &[],
            ),
            unhealthy: r.gauge(
                "provisioning_nodes_unhealthy",
                "Nodes of every run that are unhealthy or lost now.",
                &[],
            ),
            remediation_held: r.gauge(
                "provisioning_nodes_remediation_held",
                "Unhealthy nodes whose replacement their group's remediation budget holds \
                 (max_in_flight, max_unhealthy).",
                &[],
            ),
            admission_waiting: r.gauge(
                "provisioning_admission_waiting_nodes",
                "Nodes whose next operation waits for room under --max-operations-in-flight, every \
                 run together.",
                &[],
            ),
            takeovers: r.counter(
                "provisioning_run_takeovers_total",
                "Stored runs this replica claimed and restored, at its start or when their owner \
                 went (replicas sharing an etcd store only).",
                &[],
            ),
            reloads: r.counter(
                "provisioning_run_reloads_total",
                "Runs halted by a failed store write and reloaded from the store under a new epoch.",
                &[],
            ),
            store_commits: r.counter(
                "provisioning_store_commits_total",
                "Run commits that wrote something to the store (several runs' commits may share one \
                 transaction).",
                &[],
            ),
            store_node_writes: r.counter(
                "provisioning_store_node_writes_total",
                "Node records written to the store, by the commits above.",
                &[],
            ),
            nodes: r.gauge(
                "provisioning_nodes",
                "Nodes across all runs, by stage.",
                &["stage"],
            ),
            runs: r.gauge("provisioning_runs", "Runs, by phase.", &["phase"]),
            link_up: r.gauge(
                "provisioning_executor_link_up",
                "1 while the driver's stream to the executor is up.",
                &[],
            ),
            link_events: r.counter(
                "provisioning_executor_link_events_total",
                "Executor link events: connects, disconnects, and messages sent, dropped (link down), \
                 received, undecodable or unrouted (no such run).",
                &["event"],
            ),
        }
    }
}

/// A rule's name in the `name` label: the action the ladder row takes.
pub(crate) fn rule_name(rule: contract::Rule) -> &'static str {
    rule.name()
}

impl Metrics {
    pub(crate) fn pass(&self, o: &PassOutcome) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.operations
            .fetch_add(u64::from(o.operations), Ordering::Relaxed);
        self.transitions
            .fetch_add(u64::from(o.transitions), Ordering::Relaxed);
        self.stale_decisions
            .fetch_add(u64::from(o.stale), Ordering::Relaxed);
        for (i, n) in o.actions_by_rule.iter().enumerate() {
            self.actions_by_rule[i].fetch_add(u64::from(*n), Ordering::Relaxed);
        }
        let e = &self.exported;
        e.stale_decisions.add(&[], u64::from(o.stale));
        for (rule, n) in contract::Rule::ALL
            .iter()
            .map(|r| (r, o.actions_by_rule[r.number() as usize]))
        {
            if n > 0 {
                e.actions
                    .add(&[&rule.number().to_string(), rule_name(*rule)], u64::from(n));
            }
        }
    }

    /// Operations a durable pass released for dispatch.
    pub(crate) fn dispatched(&self, ops: &[contract::Operation]) {
        for op in ops {
            self.exported.dispatched.inc(&[op.input.effect().name()]);
        }
    }

    pub(crate) fn decider_error(&self) {
        self.decider_errors.fetch_add(1, Ordering::Relaxed);
    }
}
