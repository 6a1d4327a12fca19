//! A delta-debugging shrinker over the list of inputs.
//!
//! Every sub-list of a trace is a trace (inputs never depend on earlier ones
//! being present), so the shrinker removes chunks of inputs, halving the chunk
//! size down to single inputs, then simplifies the inputs that are left (fewer
//! rounds, shorter clock jumps, slot 0) and merges adjacent rounds, until
//! nothing more can go or the budget of runs is spent. The world (seed) is kept:
//! a shrunk trace is replayable from the seed and the printed trace.

use super::input::{Change, Input};

/// Candidates that are simpler versions of one input, simplest first.
fn simpler(input: &Input) -> Vec<Input> {
    match input {
        Input::Step(n) if *n > 1 => {
            let mut v = vec![Input::Step(1)];
            if *n > 3 {
                v.push(Input::Step(n / 2));
            }
            v.push(Input::Step(n - 1));
            v
        }
        Input::Advance(ms) if *ms > 100 => vec![Input::Advance(ms / 10)],
        Input::Inject {
            slot,
            effect,
            outcome,
        } if *slot > 0 => vec![Input::Inject {
            slot: 0,
            effect: *effect,
            outcome: *outcome,
        }],
        Input::Resend(k) if *k > 0 => vec![Input::Resend(0)],
        Input::Conflict(k) if *k > 0 => vec![Input::Conflict(0)],
        Input::Lose(k) if *k > 0 => vec![Input::Lose(0)],
        Input::Sicken(k) if *k > 0 => vec![Input::Sicken(0)],
        Input::Heal(k) if *k > 0 => vec![Input::Heal(0)],
        Input::Apply(Change::ScaleUp(g, n)) if *n > 1 => vec![Input::Apply(Change::ScaleUp(*g, 1))],
        Input::Apply(Change::ScaleDown(g, n)) if *n > 1 => vec![Input::Apply(Change::ScaleDown(*g, 1))],
        _ => Vec::new(),
    }
}

/// Shrinks `trace` while `fails` holds, spending at most `budget` calls of
/// `fails`. Returns the smallest failing trace found (`trace` itself if nothing
/// smaller fails).
pub fn shrink(trace: &[Input], budget: usize, mut fails: impl FnMut(&[Input]) -> bool) -> Vec<Input> {
    let mut cur = trace.to_vec();
    let mut spent = 0usize;
    let mut attempt = |candidate: &[Input], spent: &mut usize| -> bool {
        if *spent >= budget {
            return false;
        }
        *spent += 1;
        fails(candidate)
    };
    loop {
        let before = cur.clone();
        // Remove chunks, from halves down to single inputs.
        let mut chunk = cur.len().div_ceil(2).max(1);
        while chunk >= 1 && !cur.is_empty() && spent < budget {
            let mut start = 0;
            let mut removed = false;
            while start < cur.len() && spent < budget {
                let end = (start + chunk).min(cur.len());
                let mut candidate = cur[..start].to_vec();
                candidate.extend_from_slice(&cur[end..]);
                if attempt(&candidate, &mut spent) {
                    cur = candidate;
                    removed = true;
                } else {
                    start += chunk;
                }
            }
            if chunk == 1 && !removed {
                break;
            }
            if !removed {
                chunk /= 2;
            }
        }
        // Simplify single inputs.
        let mut i = 0;
        while i < cur.len() && spent < budget {
            for s in simpler(&cur[i]) {
                let mut candidate = cur.clone();
                candidate[i] = s;
                if attempt(&candidate, &mut spent) {
                    cur = candidate;
                    break;
                }
            }
            i += 1;
        }
        // Merge adjacent rounds into one input.
        let mut i = 0;
        while i + 1 < cur.len() && spent < budget {
            if let (Input::Step(a), Input::Step(b)) = (&cur[i], &cur[i + 1]) {
                let mut candidate = cur.clone();
                candidate[i] = Input::Step(a.saturating_add(*b));
                candidate.remove(i + 1);
                if attempt(&candidate, &mut spent) {
                    cur = candidate;
                    continue;
                }
            }
            i += 1;
        }
        if cur == before || spent >= budget {
            return cur;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shrinks_to_the_inputs_that_matter() {
        // Fails when a delete follows a tick, with at least 5 rounds between.
        let fails = |t: &[Input]| {
            let tick = t.iter().position(|i| *i == Input::Tick);
            let delete = t.iter().position(|i| *i == Input::Delete);
            match (tick, delete) {
                (Some(a), Some(b)) if a < b => {
                    let rounds: u32 = t[a..b]
                        .iter()
                        .map(|i| match i {
                            Input::Step(n) => u32::from(*n),
                            _ => 0,
                        })
                        .sum();
                    rounds >= 5
                }
                _ => false,
            }
        };
        let mut trace = vec![Input::Step(3), Input::Replay, Input::Tick];
        for _ in 0..10 {
            trace.extend([Input::Step(4), Input::Resubmit, Input::Advance(70_000)]);
        }
        trace.extend([Input::Delete, Input::Step(9)]);
        assert!(fails(&trace));
        let small = shrink(&trace, 1_000, fails);
        assert!(fails(&small));
        assert_eq!(small, vec![Input::Tick, Input::Step(5), Input::Delete]);
    }
}
