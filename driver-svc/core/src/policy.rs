//! The numbers that shape a run's pacing: backoff, probe interval, stage and
//! operation deadlines, the grace period after a deadline, and shape limits.

use std::time::Duration;

use contract::{BackoffPolicy, Effect, ShapeLimits};

#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub backoff: BackoffPolicy,
    /// Re-probe interval after an endpoint lookup answered "not ready".
    pub probe_interval: Duration,
    /// How long a lease may go without an endpoint before the attempt fails.
    pub endpoint_timeout: Duration,
    /// How long a bootstrap may run before the attempt fails.
    pub bootstrap_timeout: Duration,
    /// Deadline of each operation, from dispatch.
    pub operation_timeout: Duration,
    /// After an operation's deadline, how long the driver waits for the
    /// executor's (ambiguous) result before folding the ambiguity itself.
    pub result_grace: Duration,
    /// While operations are in flight, a fold waits up to this long for more
    /// results before it triggers a pass, so that a burst of results is decided
    /// in one pass instead of many. Zero decides at once. Driver transitions,
    /// shape changes and due deadlines never wait.
    pub pass_batch: Duration,
    pub limits: ShapeLimits,
    /// How many events a run keeps (the oldest go first); at least 1.
    pub event_limit: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            backoff: BackoffPolicy::default(),
            probe_interval: Duration::from_millis(500),
            endpoint_timeout: Duration::from_secs(120),
            bootstrap_timeout: Duration::from_secs(600),
            operation_timeout: Duration::from_secs(60),
            result_grace: Duration::from_secs(5),
            pass_batch: Duration::ZERO,
            limits: ShapeLimits::default(),
            event_limit: contract::events::DEFAULT_EVENT_LIMIT,
        }
    }
}

impl Policy {
    pub fn operation_timeout(&self, _effect: Effect) -> Duration {
        self.operation_timeout
    }
}
