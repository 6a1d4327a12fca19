//! The one backoff function. The driver computes every retry delay with it when
//! it folds a failure; jitter is derived from the identity, never from a random
//! source, so identical traces give identical deadlines.

use std::time::Duration;

use crate::ids::{AttemptId, RunUid};

/// `delay = min(cap, base × 2^(failures−1)) × (1 − jitter × u)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackoffPolicy {
    pub base: Duration,
    pub cap: Duration,
    /// In `[0, 1]`.
    pub jitter: f64,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(60),
            jitter: 0.2,
        }
    }
}

/// SplitMix64's finaliser: a fixed, well-mixed 64-bit permutation.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `u` in `[0, 1)`, derived from `(run uid, attempt, failures)`.
pub fn jitter_unit(run_uid: RunUid, attempt: AttemptId, failures: u32) -> f64 {
    let uid = run_uid.as_u128();
    // Truncation is intended: both halves of the uid feed the mix.
    let h = mix64(mix64(mix64(uid as u64) ^ (uid >> 64) as u64) ^ attempt.get()) ^ u64::from(failures);
    let h = mix64(h);
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// The delay before the next try after `failures` consecutive failures
/// (`failures >= 1`; zero failures means no delay).
pub fn backoff_delay(policy: &BackoffPolicy, run_uid: RunUid, attempt: AttemptId, failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    let base = u64::try_from(policy.base.as_millis()).unwrap_or(u64::MAX);
    let cap = u64::try_from(policy.cap.as_millis()).unwrap_or(u64::MAX);
    let exp = failures - 1;
    let raw = if exp >= 64 {
        u64::MAX
    } else {
        base.saturating_mul(1u64 << exp)
    };
    let capped = raw.min(cap);
    let jitter = policy.jitter.clamp(0.0, 1.0);
    let u = jitter_unit(run_uid, attempt, failures);
    let scaled = (capped as f64 * (1.0 - jitter * u)).floor();
    // `scaled` is within [0, capped], so the conversion is exact enough and in range.
    Duration::from_millis(scaled as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: RunUid = RunUid::from_u128(42);

    #[test]
    fn doubles_to_the_cap_without_jitter() {
        let p = BackoffPolicy {
            jitter: 0.0,
            ..BackoffPolicy::default()
        };
        let a = AttemptId::new(1);
        let ms: Vec<u128> = (1..=8)
            .map(|f| backoff_delay(&p, UID, a, f).as_millis())
            .collect();
        assert_eq!(ms, [1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000]);
        assert_eq!(backoff_delay(&p, UID, a, 0), Duration::ZERO);
        assert_eq!(backoff_delay(&p, UID, a, u32::MAX).as_millis(), 60000);
    }

    #[test]
    fn jitter_is_deterministic_and_bounded() {
        let p = BackoffPolicy::default();
        for attempt in 1..200 {
            for f in 1..10 {
                let a = AttemptId::new(attempt);
                let d1 = backoff_delay(&p, UID, a, f);
                let d2 = backoff_delay(&p, UID, a, f);
                assert_eq!(d1, d2);
                let full = backoff_delay(&BackoffPolicy { jitter: 0.0, ..p }, UID, a, f);
                assert!(d1 <= full);
                assert!(d1.as_millis() * 10 >= full.as_millis() * 8, "{d1:?} vs {full:?}");
            }
        }
        // Different identities spread out.
        let spread: std::collections::BTreeSet<_> = (1..50)
            .map(|a| backoff_delay(&p, UID, AttemptId::new(a), 3))
            .collect();
        assert!(spread.len() > 30);
    }
}
