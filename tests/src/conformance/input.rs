//! The input alphabet of a conformance trace, and its text form.
//!
//! A trace is a list of [`Input`]s. Every input is applicable in every state (an
//! input that makes no sense at the moment, such as a reconnect while the link is
//! up, does nothing), so any sub-list of a trace is a trace too: that is what
//! lets the shrinker delete inputs freely.
//!
//! The text form is one whitespace-separated token per input, e.g.
//! `step*12 apply:scale-up:work:2 inject:1:create:ambiguous-done step*40`. It is
//! what a failure prints and what `CONFORMANCE_TRACE` replays.

use std::{fmt, str::FromStr};

use contract::Effect;

pub use crate::sim::Forced;

/// The node groups traces play with. Each has a fixed template that shape
/// changes then vary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Group {
    Ctrl,
    Work,
    Gpu,
}

impl Group {
    pub const ALL: [Group; 3] = [Group::Ctrl, Group::Work, Group::Gpu];

    pub fn name(self) -> &'static str {
        match self {
            Group::Ctrl => "ctrl",
            Group::Work => "work",
            Group::Gpu => "gpu",
        }
    }
}

/// A valid shape update, relative to the run's current shape; the new shape has
/// the next generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Change {
    /// More nodes in a group (the group is added if absent).
    ScaleUp(Group, u8),
    /// Fewer nodes in a group (down to zero; the group stays).
    ScaleDown(Group, u8),
    /// A new image: every node of the group drifts.
    Image(Group),
    /// A new boot parameter: every node of the group drifts.
    Boot(Group),
    /// An image the backend refuses permanently.
    BadImage(Group),
    /// A boot parameter that fails every process-backend agent at its join
    /// (`fault.fail_at`); to the fake, just a new boot parameter. Not
    /// generated: what a test asks for.
    FailingBoot(Group),
    /// The group leaves the shape.
    RemoveGroup(Group),
    /// A generation bump with the same content: nothing may be replaced.
    Bump,
}

/// An update that must be rejected and must change nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bad {
    /// A lower generation (with other content).
    Regress,
    /// The current generation with other content.
    SameGeneration,
    /// Another run id.
    RunId,
    /// A non-finite cpu.
    NanCpu,
    NegativeMemory,
    DuplicateGroup,
    /// A group count above the configured limit.
    OverLimit,
    ZeroGeneration,
    EmptyImage,
}

impl Bad {
    pub const ALL: [Bad; 9] = [
        Bad::Regress,
        Bad::SameGeneration,
        Bad::RunId,
        Bad::NanCpu,
        Bad::NegativeMemory,
        Bad::DuplicateGroup,
        Bad::OverLimit,
        Bad::ZeroGeneration,
        Bad::EmptyImage,
    ];

    fn name(self) -> &'static str {
        match self {
            Bad::Regress => "regress",
            Bad::SameGeneration => "same-generation",
            Bad::RunId => "run-id",
            Bad::NanCpu => "nan-cpu",
            Bad::NegativeMemory => "negative-memory",
            Bad::DuplicateGroup => "duplicate-group",
            Bad::OverLimit => "over-limit",
            Bad::ZeroGeneration => "zero-generation",
            Bad::EmptyImage => "empty-image",
        }
    }
}

/// Fault rates of the fake backend, from the input on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultMix {
    None,
    /// Frequent recoverable faults of every kind.
    Chaos,
    /// Creates fail definitely or ambiguously.
    Creates,
    /// Bootstraps fail at a random stage or hang.
    Bootstraps,
    /// Cancels and destroys fail, destroys also ambiguously.
    Cleanup,
    /// Lookups error and starts fail or time out.
    Lookups,
}

impl FaultMix {
    pub const ALL: [FaultMix; 6] = [
        FaultMix::None,
        FaultMix::Chaos,
        FaultMix::Creates,
        FaultMix::Bootstraps,
        FaultMix::Cleanup,
        FaultMix::Lookups,
    ];

    fn name(self) -> &'static str {
        match self {
            FaultMix::None => "none",
            FaultMix::Chaos => "chaos",
            FaultMix::Creates => "creates",
            FaultMix::Bootstraps => "bootstraps",
            FaultMix::Cleanup => "cleanup",
            FaultMix::Lookups => "lookups",
        }
    }

    /// The fake's rates for this mix.
    pub fn rates(self) -> executor_svc::fake::FaultRates {
        use executor_svc::fake::FaultRates;
        match self {
            FaultMix::None => FaultRates::none(),
            FaultMix::Chaos => FaultRates::chaos(),
            FaultMix::Creates => FaultRates {
                create_retryable: 0.3,
                create_ambiguous: 0.3,
                ..FaultRates::none()
            },
            FaultMix::Bootstraps => FaultRates {
                bootstrap_fail: 0.4,
                bootstrap_hang: 0.2,
                ..FaultRates::none()
            },
            FaultMix::Cleanup => FaultRates {
                cancel_fail: 0.4,
                destroy_fail: 0.3,
                destroy_ambiguous: 0.3,
                ..FaultRates::none()
            },
            FaultMix::Lookups => FaultRates {
                lookup_error: 0.4,
                start_fail: 0.2,
                start_ambiguous: 0.2,
                ..FaultRates::none()
            },
        }
    }
}

/// One input of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Input {
    /// This many scheduler rounds: deadline folds, a pass if one is wanted,
    /// backend progress, delivery; the clock jumps to the next event when idle.
    Step(u16),
    /// The periodic safety tick: the next pass decides every node.
    Tick,
    /// The clock jumps ahead by this many milliseconds.
    Advance(u64),
    Apply(Change),
    Reject(Bad),
    /// The current shape again, same generation: an idempotent no-op.
    Reapply,
    Faults(FaultMix),
    /// The next operation with `effect` (any effect when `None`) that the
    /// backend runs for the slot at `slot` (modulo the slots the run holds, in
    /// slot order) ends with `outcome`.
    Inject {
        slot: u8,
        effect: Option<Effect>,
        outcome: Forced,
    },
    /// The executor link breaks; messages on it are lost.
    LinkDown,
    /// The link comes back; the driver resynchronises.
    Reconnect,
    /// The executor sends every unacknowledged result and observation again.
    Replay,
    /// A recently delivered message arrives again.
    Resend(u8),
    /// The driver resubmits every pending operation.
    Resubmit,
    /// Another client resubmits a seen operation id with other input.
    Conflict(u8),
    /// The driver restarts from its store.
    RestartDriver,
    /// The run is deleted.
    Delete,
    /// The provider loses the resource of the slot at `slot` (modulo the
    /// slots the run holds, in slot order) behind the executor's back, and
    /// the executor reports it. Over the services: the fake's control service
    /// loses it, or (level 3) its node agent is killed (SIGKILL).
    Lose(u8),
    /// The executor reports the slot's node unhealthy (its probes fail). Over
    /// the services: the fake's resource fails its probes, or the node agent
    /// is stopped (SIGSTOP), and the executor's prober finds it.
    Sicken(u8),
    /// The executor reports the slot's node healthy again. Over the services:
    /// the fake's resource answers its probes again, or the node agent is
    /// continued (SIGCONT).
    Heal(u8),
}

fn effect_name(e: Effect) -> &'static str {
    match e {
        Effect::CreateLease => "create",
        Effect::LookupEndpoint => "lookup",
        Effect::StartBootstrap => "start",
        Effect::CancelBootstrap => "cancel",
        Effect::DestroyLease => "destroy",
    }
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Change::ScaleUp(g, n) => write!(f, "scale-up:{}:{n}", g.name()),
            Change::ScaleDown(g, n) => write!(f, "scale-down:{}:{n}", g.name()),
            Change::Image(g) => write!(f, "image:{}", g.name()),
            Change::Boot(g) => write!(f, "boot:{}", g.name()),
            Change::BadImage(g) => write!(f, "bad-image:{}", g.name()),
            Change::FailingBoot(g) => write!(f, "failing-boot:{}", g.name()),
            Change::RemoveGroup(g) => write!(f, "remove:{}", g.name()),
            Change::Bump => f.write_str("bump"),
        }
    }
}

impl fmt::Display for Input {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Input::Step(1) => f.write_str("step"),
            Input::Step(n) => write!(f, "step*{n}"),
            Input::Tick => f.write_str("tick"),
            Input::Advance(ms) => write!(f, "advance:{ms}"),
            Input::Apply(c) => write!(f, "apply:{c}"),
            Input::Reject(b) => write!(f, "reject:{}", b.name()),
            Input::Reapply => f.write_str("reapply"),
            Input::Faults(m) => write!(f, "faults:{}", m.name()),
            Input::Inject {
                slot,
                effect,
                outcome,
            } => {
                let effect = effect.map_or("any", effect_name);
                write!(f, "inject:{slot}:{effect}:{}", outcome.name())
            }
            Input::LinkDown => f.write_str("link-down"),
            Input::Reconnect => f.write_str("reconnect"),
            Input::Replay => f.write_str("replay"),
            Input::Resend(k) => write!(f, "resend:{k}"),
            Input::Resubmit => f.write_str("resubmit"),
            Input::Conflict(k) => write!(f, "conflict:{k}"),
            Input::Lose(k) => write!(f, "lose:{k}"),
            Input::Sicken(k) => write!(f, "sicken:{k}"),
            Input::Heal(k) => write!(f, "heal:{k}"),
            Input::RestartDriver => f.write_str("restart-driver"),
            Input::Delete => f.write_str("delete"),
        }
    }
}

/// Why a token of a trace's text form did not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    pub token: String,
    pub why: &'static str,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot parse trace input {:?}: {}", self.token, self.why)
    }
}

impl std::error::Error for ParseError {}

fn lookup<T: Copy>(all: &[T], name: impl Fn(T) -> &'static str, s: &str) -> Option<T> {
    all.iter().copied().find(|x| name(*x) == s)
}

impl FromStr for Input {
    type Err = ParseError;

    fn from_str(token: &str) -> Result<Self, Self::Err> {
        let err = |why| ParseError {
            token: token.to_owned(),
            why,
        };
        let parts: Vec<&str> = token.split(':').collect();
        let num = |i: usize| -> Result<u64, ParseError> {
            parts
                .get(i)
                .ok_or_else(|| err("missing number"))?
                .parse::<u64>()
                .map_err(|_| err("not a number"))
        };
        let small = |i: usize| -> Result<u8, ParseError> {
            u8::try_from(num(i)?).map_err(|_| err("number above 255"))
        };
        let group = |i: usize| -> Result<Group, ParseError> {
            let s = parts.get(i).ok_or_else(|| err("missing group"))?;
            lookup(&Group::ALL, Group::name, s).ok_or_else(|| err("unknown group"))
        };
        let input = match parts[0] {
            "step" => Input::Step(1),
            s if s.starts_with("step*") => {
                Input::Step(s["step*".len()..].parse().map_err(|_| err("bad step count"))?)
            }
            "tick" => Input::Tick,
            "advance" => Input::Advance(num(1)?),
            "apply" => Input::Apply(match *parts.get(1).ok_or_else(|| err("missing change"))? {
                "scale-up" => Change::ScaleUp(group(2)?, small(3)?),
                "scale-down" => Change::ScaleDown(group(2)?, small(3)?),
                "image" => Change::Image(group(2)?),
                "boot" => Change::Boot(group(2)?),
                "bad-image" => Change::BadImage(group(2)?),
                "failing-boot" => Change::FailingBoot(group(2)?),
                "remove" => Change::RemoveGroup(group(2)?),
                "bump" => Change::Bump,
                _ => return Err(err("unknown change")),
            }),
            "reject" => Input::Reject(
                parts
                    .get(1)
                    .and_then(|s| lookup(&Bad::ALL, Bad::name, s))
                    .ok_or_else(|| err("unknown rejection"))?,
            ),
            "reapply" => Input::Reapply,
            "faults" => Input::Faults(
                parts
                    .get(1)
                    .and_then(|s| lookup(&FaultMix::ALL, FaultMix::name, s))
                    .ok_or_else(|| err("unknown fault mix"))?,
            ),
            "inject" => Input::Inject {
                slot: small(1)?,
                effect: match parts.get(2) {
                    Some(&"any") => None,
                    Some(s) => {
                        Some(lookup(&Effect::ALL, effect_name, s).ok_or_else(|| err("unknown effect"))?)
                    }
                    None => return Err(err("missing effect")),
                },
                outcome: parts
                    .get(3)
                    .and_then(|s| lookup(&Forced::ALL, Forced::name, s))
                    .ok_or_else(|| err("unknown outcome"))?,
            },
            "link-down" => Input::LinkDown,
            "reconnect" => Input::Reconnect,
            "replay" => Input::Replay,
            "resend" => Input::Resend(small(1)?),
            "resubmit" => Input::Resubmit,
            "conflict" => Input::Conflict(small(1)?),
            "lose" => Input::Lose(small(1)?),
            "sicken" => Input::Sicken(small(1)?),
            "heal" => Input::Heal(small(1)?),
            "restart-driver" => Input::RestartDriver,
            "delete" => Input::Delete,
            _ => return Err(err("unknown input")),
        };
        Ok(input)
    }
}

/// A trace in its text form.
pub fn format_trace(trace: &[Input]) -> String {
    trace
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Parses a trace's text form.
pub fn parse_trace(s: &str) -> Result<Vec<Input>, ParseError> {
    s.split_whitespace().map(str::parse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_input_round_trips_through_text() {
        let mut all = vec![
            Input::Step(1),
            Input::Step(17),
            Input::Tick,
            Input::Advance(65_000),
            Input::Reapply,
            Input::LinkDown,
            Input::Reconnect,
            Input::Replay,
            Input::Resend(3),
            Input::Resubmit,
            Input::Conflict(2),
            Input::Lose(4),
            Input::Sicken(3),
            Input::Heal(3),
            Input::RestartDriver,
            Input::Delete,
        ];
        for g in Group::ALL {
            all.extend([
                Input::Apply(Change::ScaleUp(g, 2)),
                Input::Apply(Change::ScaleDown(g, 1)),
                Input::Apply(Change::Image(g)),
                Input::Apply(Change::Boot(g)),
                Input::Apply(Change::BadImage(g)),
                Input::Apply(Change::RemoveGroup(g)),
            ]);
        }
        all.push(Input::Apply(Change::Bump));
        all.extend(Bad::ALL.map(Input::Reject));
        all.extend(FaultMix::ALL.map(Input::Faults));
        for effect in Effect::ALL.map(Some).into_iter().chain([None]) {
            for outcome in Forced::ALL {
                all.push(Input::Inject {
                    slot: 7,
                    effect,
                    outcome,
                });
            }
        }
        let text = format_trace(&all);
        assert_eq!(parse_trace(&text), Ok(all));
        assert!(parse_trace("step*x").is_err());
        assert!(parse_trace("inject:1:create:sometimes").is_err());
    }
}
