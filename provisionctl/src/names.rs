//! Words for the wire's numbers: stages, phases, effects, action kinds and the
//! ladder's rules, as people read them.
//!
//! Every name here is also what the JSON and YAML outputs carry, so scripts
//! and people see the same words.

use contract::{Rule, pb};

pub fn stage(v: i32) -> &'static str {
    pb::NodeStage::try_from(v).map_or("unknown", |s| match s {
        pb::NodeStage::Unspecified => "unknown",
        pb::NodeStage::New => "new",
        pb::NodeStage::LeaseRequested => "lease-requested",
        pb::NodeStage::LeaseCreated => "lease-created",
        pb::NodeStage::EndpointKnown => "endpoint-known",
        pb::NodeStage::BootstrapRunning => "bootstrapping",
        pb::NodeStage::Joined => "joined",
        pb::NodeStage::HandedOff => "handed-off",
        pb::NodeStage::Dormant => "ready",
        pb::NodeStage::Failed => "failed",
        pb::NodeStage::Destroyed => "destroyed",
    })
}

/// The order stages are shown in: the path toward ready, then the way out.
pub fn stage_order(v: i32) -> u8 {
    pb::NodeStage::try_from(v).map_or(99, |s| match s {
        pb::NodeStage::New => 0,
        pb::NodeStage::LeaseRequested => 1,
        pb::NodeStage::LeaseCreated => 2,
        pb::NodeStage::EndpointKnown => 3,
        pb::NodeStage::BootstrapRunning => 4,
        pb::NodeStage::Joined => 5,
        pb::NodeStage::HandedOff => 6,
        pb::NodeStage::Dormant => 7,
        pb::NodeStage::Failed => 8,
        pb::NodeStage::Destroyed => 9,
        pb::NodeStage::Unspecified => 10,
    })
}

pub fn phase(v: i32) -> &'static str {
    pb::RunPhase::try_from(v).map_or("unknown", |p| match p {
        pb::RunPhase::Unspecified => "unknown",
        pb::RunPhase::Progressing => "progressing",
        pb::RunPhase::Converged => "converged",
        pb::RunPhase::Paused => "paused",
        pb::RunPhase::Deleting => "deleting",
        pb::RunPhase::Deleted => "deleted",
    })
}

pub fn intent(v: i32) -> &'static str {
    pb::Intent::try_from(v).map_or("unknown", |i| match i {
        pb::Intent::Unspecified => "unknown",
        pb::Intent::Active => "active",
        pb::Intent::Deleting => "deleting",
    })
}

pub fn effect(v: i32) -> &'static str {
    pb::Effect::try_from(v).map_or("unknown", |e| match e {
        pb::Effect::Unspecified => "none",
        pb::Effect::CreateLease => "create-lease",
        pb::Effect::LookupEndpoint => "lookup-endpoint",
        pb::Effect::StartBootstrap => "start-bootstrap",
        pb::Effect::CancelBootstrap => "cancel-bootstrap",
        pb::Effect::DestroyLease => "destroy-lease",
    })
}

pub fn kind(v: i32) -> &'static str {
    pb::ActionKind::try_from(v).map_or("unknown", |k| match k {
        pb::ActionKind::Unspecified => "unknown",
        pb::ActionKind::Insert => "insert",
        pb::ActionKind::Reap => "reap",
        pb::ActionKind::Restart => "restart",
        pb::ActionKind::BeginDelete => "begin-delete",
        pb::ActionKind::Dispatch => "dispatch",
        pb::ActionKind::MarkDestroyed => "mark-destroyed",
        pb::ActionKind::ObserveConvergence => "observe-convergence",
        pb::ActionKind::Wait => "wait",
        pb::ActionKind::Surge => "surge",
    })
}

pub fn bootstrap_stage(v: i32) -> &'static str {
    pb::BootstrapStage::try_from(v).map_or("unknown", |s| match s {
        pb::BootstrapStage::Unspecified => "not started",
        pb::BootstrapStage::Connected => "connected",
        pb::BootstrapStage::BootCheck => "boot-check",
        pb::BootstrapStage::AgentStarted => "agent-started",
        pb::BootstrapStage::Joined => "joined",
        pb::BootstrapStage::Converged => "converged",
        pb::BootstrapStage::FailedConnect => "failed to connect",
        pb::BootstrapStage::FailedBootCheck => "failed the boot check",
        pb::BootstrapStage::FailedAgentStart => "failed to start the agent",
        pb::BootstrapStage::FailedJoin => "failed to join",
        pb::BootstrapStage::FailedClosed => "session closed before it converged",
    })
}

/// A rule's short name, stable for scripts (`rule_name` in JSON).
pub fn rule(n: u32) -> &'static str {
    Rule::from_number(n).map_or("unknown", Rule::name)
}

/// What a rule means, in a few plain words (the row of SPEC.md's ladder).
pub fn rule_meaning(n: u32) -> &'static str {
    Rule::from_number(n).map_or("a rule this client does not know", |r| match r {
        Rule::Insert => "a desired slot has no node yet: add one",
        Rule::Reap => "the node is destroyed and its slot is no longer wanted: forget it",
        Rule::Restart => "the node is destroyed but still wanted: start a fresh attempt",
        Rule::RestartBackoff => "the node is destroyed and waiting before it restarts",
        Rule::BeginDelete => "the attempt is unwanted, outdated or failed: begin its cleanup",
        Rule::Pending => "waiting for a pending operation",
        Rule::ReissueCreate => "a create ended ambiguously: re-issue it so the provider adopts what it made",
        Rule::CancelBootstrap => "cleanup: cancel the bootstrap session",
        Rule::DestroyLease => "cleanup: destroy the lease",
        Rule::MarkDestroyed => "cleanup is complete: mark the node destroyed",
        Rule::RetryBackoff => "backing off after a failure before the next try",
        Rule::Ready => "ready: nothing to do",
        Rule::CreateLease => "no lease yet: create one",
        Rule::LookupEndpoint => "the lease exists: look up its endpoint",
        Rule::ObserveConvergence => "the bootstrap converged: the node becomes ready",
        Rule::AwaitBootstrap => "the bootstrap is running: waiting for its stages",
        Rule::StartBootstrap => "the endpoint is known: start the bootstrap",
        Rule::RolloutBudget => "on an older template, but its group's rollout holds its replacement",
        Rule::RemediationBudget => "unhealthy, but its group's remediation budget holds its replacement",
        Rule::SurgeInsert => "on an older template: a successor is provisioned while this attempt serves",
    })
}

/// `rule 5 (pending)`.
pub fn rule_label(n: u32) -> String {
    format!("rule {n} ({})", rule(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_has_a_distinct_name_and_a_meaning() {
        let mut seen = std::collections::BTreeSet::new();
        for r in Rule::ALL {
            assert!(seen.insert(rule(r.number())), "duplicate name for {r}");
            assert!(!rule_meaning(r.number()).contains("does not know"));
        }
        assert_eq!(rule(5), "pending");
        assert_eq!(rule_meaning(5), "waiting for a pending operation");
        assert_eq!(rule(99), "unknown");
        assert_eq!(rule_label(11), "rule 11 (ready)");
    }

    #[test]
    fn stage_order_follows_the_path_to_ready() {
        let ready = pb::NodeStage::Dormant as i32;
        let new = pb::NodeStage::New as i32;
        assert!(stage_order(new) < stage_order(ready));
        assert_eq!(stage(ready), "ready");
    }
}
