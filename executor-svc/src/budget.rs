//! Provider budgets: caps on the backend calls an executor runs at once and
//! starts per second, for the provider as a whole and for each run. An
//! operation over a cap waits its turn (first come, first served; a run at its
//! own cap does not hold up the others) instead of failing; the driver is told
//! it waits, and why, so `explain` can say so.
//!
//! Sans-IO: the actor passes `now` in, starts what [`Budget::submit`] and
//! [`Budget::drain`] hand back, reports each call's end with
//! [`Budget::finished`], and wakes at [`Budget::next_wake`] when a rate is
//! what holds the queue.

use std::{
    collections::{HashMap, VecDeque},
    time::Duration,
};

use contract::{Monotonic, Operation, OperationId, RunUid};

/// The caps; `None` is no cap.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BudgetConfig {
    /// Backend calls in flight at once, all runs together.
    pub inflight: Option<usize>,
    /// Backend calls started per second, all runs together.
    pub rate: Option<f64>,
    /// Backend calls in flight at once for one run.
    pub run_inflight: Option<usize>,
    /// Backend calls started per second for one run.
    pub run_rate: Option<f64>,
}

/// A token bucket holding up to one second of its rate (at least one token).
#[derive(Debug, Clone)]
struct Bucket {
    rate: f64,
    tokens: f64,
    at: Monotonic,
}

impl Bucket {
    fn new(rate: f64, now: Monotonic) -> Self {
        Self {
            rate,
            tokens: rate.max(1.0),
            at: now,
        }
    }

    fn refill(&mut self, now: Monotonic) {
        let dt = now.saturating_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.rate.max(1.0));
        self.at = now;
    }

    fn ready(&mut self, now: Monotonic) -> bool {
        self.refill(now);
        self.tokens >= 1.0
    }

    fn take(&mut self) {
        self.tokens -= 1.0;
    }

    /// When the next token is there.
    fn due(&self) -> Monotonic {
        let missing = (1.0 - self.tokens).max(0.0);
        self.at.saturating_add(Duration::from_secs_f64(
            missing / self.rate.max(f64::MIN_POSITIVE),
        ))
    }
}

#[derive(Debug, Default)]
struct RunUse {
    inflight: usize,
    bucket: Option<Bucket>,
}

/// What holds an operation back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    ProviderInflight,
    ProviderRate,
    RunInflight,
    RunRate,
}

impl Held {
    pub fn name(self) -> &'static str {
        match self {
            Held::ProviderInflight => "provider-inflight",
            Held::ProviderRate => "provider-rate",
            Held::RunInflight => "run-inflight",
            Held::RunRate => "run-rate",
        }
    }
}

/// The budget's state.
#[derive(Debug)]
pub struct Budget {
    config: BudgetConfig,
    inflight: usize,
    bucket: Option<Bucket>,
    runs: HashMap<RunUid, RunUse>,
    queue: VecDeque<Operation>,
}

impl Budget {
    pub fn new(config: BudgetConfig, now: Monotonic) -> Self {
        Self {
            config,
            inflight: 0,
            bucket: config.rate.map(|r| Bucket::new(r, now)),
            runs: HashMap::new(),
            queue: VecDeque::new(),
        }
    }

    /// Calls running now.
    pub fn inflight(&self) -> usize {
        self.inflight
    }

    /// Operations waiting their turn.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// What would hold `run`'s next call back now, if anything.
    fn held(&mut self, run: RunUid, now: Monotonic) -> Option<Held> {
        if self.config.inflight.is_some_and(|cap| self.inflight >= cap) {
            return Some(Held::ProviderInflight);
        }
        let config = self.config;
        let usage = self.runs.entry(run).or_default();
        if config.run_inflight.is_some_and(|cap| usage.inflight >= cap) {
            return Some(Held::RunInflight);
        }
        if let Some(rate) = config.run_rate {
            let bucket = usage.bucket.get_or_insert_with(|| Bucket::new(rate, now));
            if !bucket.ready(now) {
                return Some(Held::RunRate);
            }
        }
        if let Some(b) = self.bucket.as_mut()
            && !b.ready(now)
        {
            return Some(Held::ProviderRate);
        }
        None
    }

    fn admit(&mut self, run: RunUid) {
        self.inflight += 1;
        let usage = self.runs.entry(run).or_default();
        usage.inflight += 1;
        if let Some(b) = usage.bucket.as_mut() {
            b.take();
        }
        if let Some(b) = self.bucket.as_mut() {
            b.take();
        }
    }

    /// An operation the core wants started joins the queue; [`Budget::drain`]
    /// then starts what may start, in order.
    pub fn enqueue(&mut self, op: Operation) {
        self.queue.push_back(op);
    }

    /// Whether this operation is waiting.
    pub fn is_waiting(&self, run: RunUid, id: OperationId) -> bool {
        self.queue.iter().any(|q| q.run_uid == run && q.id == id)
    }

    /// The waiting operations, in order.
    pub fn queued(&self) -> impl Iterator<Item = (RunUid, OperationId)> + '_ {
        self.queue.iter().map(|q| (q.run_uid, q.id))
    }

    /// What holds `run`'s next call back now, if anything.
    pub fn hold_of(&mut self, run: RunUid, now: Monotonic) -> Option<Held> {
        self.held(run, now)
    }

    /// A call of `run` ended (completed or aborted).
    pub fn finished(&mut self, run: RunUid) {
        self.inflight = self.inflight.saturating_sub(1);
        if let Some(usage) = self.runs.get_mut(&run) {
            usage.inflight = usage.inflight.saturating_sub(1);
            if usage.inflight == 0 && usage.bucket.is_none() && !self.queue.iter().any(|q| q.run_uid == run) {
                self.runs.remove(&run);
            }
        }
    }

    /// Takes out what may start now, in order: a waiter held by its own run's
    /// cap is passed over, one held by the provider's stops the scan.
    pub fn drain(&mut self, now: Monotonic) -> Vec<Operation> {
        let mut started = Vec::new();
        let mut i = 0;
        while i < self.queue.len() {
            let run = self.queue[i].run_uid;
            match self.held(run, now) {
                None => {
                    self.admit(run);
                    if let Some(op) = self.queue.remove(i) {
                        started.push(op);
                    }
                }
                Some(Held::ProviderInflight | Held::ProviderRate) => break,
                Some(Held::RunInflight | Held::RunRate) => i += 1,
            }
        }
        started
    }

    /// Drops a waiting operation (the core abandoned it). Whether it waited.
    pub fn remove(&mut self, run: RunUid, id: OperationId) -> bool {
        match self.queue.iter().position(|q| q.run_uid == run && q.id == id) {
            Some(i) => {
                self.queue.remove(i);
                true
            }
            None => false,
        }
    }

    /// When a rate will next let a waiter start (caps on calls in flight are
    /// released by [`Budget::finished`], not by time).
    pub fn next_wake(&self) -> Option<Monotonic> {
        if self.queue.is_empty() {
            return None;
        }
        let provider = self.bucket.as_ref().map(Bucket::due);
        let runs = self
            .queue
            .iter()
            .filter_map(|q| {
                self.runs
                    .get(&q.run_uid)
                    .and_then(|u| u.bucket.as_ref())
                    .map(Bucket::due)
            })
            .min();
        match (provider, runs) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Why an operation waits, for the driver's `explain`.
    pub fn describe(&self, held: Held) -> String {
        let c = &self.config;
        match held {
            Held::ProviderInflight => format!(
                "waiting for the provider budget: {} calls in flight, cap {}",
                self.inflight,
                c.inflight.unwrap_or_default()
            ),
            Held::ProviderRate => format!(
                "waiting for the provider budget: at most {} calls per second",
                c.rate.unwrap_or_default()
            ),
            Held::RunInflight => format!(
                "waiting for the run's budget: at most {} calls of a run in flight",
                c.run_inflight.unwrap_or_default()
            ),
            Held::RunRate => format!(
                "waiting for the run's budget: at most {} calls of a run per second",
                c.run_rate.unwrap_or_default()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use contract::{AttemptId, Epoch, LogicalNodeId, OperationInput, RunId, TraceContext, UnixMillis};

    use super::*;

    fn op(run: u128, seq: u32) -> Operation {
        Operation {
            run_uid: RunUid::from_u128(run),
            run_id: RunId::parse("r", "r").unwrap(),
            node: LogicalNodeId::parse("n", "w-0").unwrap(),
            id: OperationId::new(AttemptId::new(1), seq),
            epoch: Epoch::new(1),
            deadline: UnixMillis::new(1),
            provider: "fake".into(),
            input: OperationInput::DestroyLease { lease: None },
            trace: TraceContext::default(),
        }
    }

    fn seqs(ops: &[Operation]) -> Vec<u32> {
        ops.iter().map(|o| o.id.seq()).collect()
    }

    #[test]
    fn unlimited_starts_everything() {
        let now = Monotonic::default();
        let mut b = Budget::new(BudgetConfig::default(), now);
        for i in 0..100 {
            b.enqueue(op(1, i));
        }
        assert_eq!(b.drain(now).len(), 100);
        assert_eq!(b.inflight(), 100);
        assert_eq!(b.waiting(), 0);
    }

    #[test]
    fn an_inflight_cap_queues_in_order_and_never_exceeds() {
        let now = Monotonic::default();
        let mut b = Budget::new(
            BudgetConfig {
                inflight: Some(2),
                ..BudgetConfig::default()
            },
            now,
        );
        for (run, seq) in [(1, 1), (2, 2), (1, 3), (2, 4)] {
            b.enqueue(op(run, seq));
        }
        assert_eq!(seqs(&b.drain(now)), vec![1, 2]);
        assert_eq!(b.hold_of(RunUid::from_u128(1), now), Some(Held::ProviderInflight));
        assert!(b.is_waiting(RunUid::from_u128(1), OperationId::new(AttemptId::new(1), 3)));
        assert!(b.drain(now).is_empty());
        b.finished(RunUid::from_u128(1));
        assert_eq!(seqs(&b.drain(now)), vec![3]);
        assert_eq!(b.inflight(), 2);
        assert!(b.remove(RunUid::from_u128(2), OperationId::new(AttemptId::new(1), 4)));
        assert_eq!(b.waiting(), 0);
    }

    #[test]
    fn a_run_at_its_cap_does_not_hold_up_the_others() {
        let now = Monotonic::default();
        let mut b = Budget::new(
            BudgetConfig {
                run_inflight: Some(1),
                ..BudgetConfig::default()
            },
            now,
        );
        for (run, seq) in [(1, 1), (1, 2), (2, 3)] {
            b.enqueue(op(run, seq));
        }
        assert_eq!(seqs(&b.drain(now)), vec![1, 3], "run 2 goes past run 1's waiter");
        assert_eq!(b.hold_of(RunUid::from_u128(1), now), Some(Held::RunInflight));
        b.finished(RunUid::from_u128(1));
        assert_eq!(seqs(&b.drain(now)), vec![2]);
    }

    #[test]
    fn a_rate_spaces_starts_and_names_its_wake_up() {
        let t0 = Monotonic::default();
        let mut b = Budget::new(
            BudgetConfig {
                rate: Some(2.0),
                ..BudgetConfig::default()
            },
            t0,
        );
        for seq in 1..=3 {
            b.enqueue(op(1, seq));
        }
        assert_eq!(seqs(&b.drain(t0)), vec![1, 2]);
        assert_eq!(b.hold_of(RunUid::from_u128(1), t0), Some(Held::ProviderRate));
        let wake = b.next_wake().unwrap();
        assert!(wake > t0 && wake <= t0.saturating_add(Duration::from_millis(500)));
        assert!(b.drain(t0.saturating_add(Duration::from_millis(100))).is_empty());
        assert_eq!(
            seqs(&b.drain(t0.saturating_add(Duration::from_millis(500)))),
            vec![3]
        );
        assert!(b.next_wake().is_none());
    }
}
