//! Time as a value. Deadlines are wall-clock milliseconds since the Unix epoch, so
//! a stored deadline keeps its meaning across a driver restart; nothing in this
//! crate reads a clock.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

/// A wall-clock instant in milliseconds since the Unix epoch.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct UnixMillis(u64);

/// Adding a duration overflowed the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("clock saturated: {at} + {by:?} does not fit in a u64 of milliseconds")]
pub struct ClockSaturated {
    pub at: UnixMillis,
    pub by: Duration,
}

impl UnixMillis {
    pub const ZERO: Self = Self(0);
    pub const MAX: Self = Self(u64::MAX);

    pub const fn new(ms: u64) -> Self {
        Self(ms)
    }

    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// `self + d`, or an error rather than a wrap or a silent clamp: a deadline
    /// that saturates would never fire, which is a spin or a hang.
    pub fn checked_add(self, d: Duration) -> Result<Self, ClockSaturated> {
        u64::try_from(d.as_millis())
            .ok()
            .and_then(|ms| self.0.checked_add(ms))
            .map(Self)
            .ok_or(ClockSaturated { at: self, by: d })
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: UnixMillis) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    /// `self` moved by a step of the wall clock: later by `by_ms` when
    /// positive, earlier when negative, saturating at either end (a deadline
    /// that follows a step keeps its distance from the new time).
    pub fn shifted(self, by_ms: i64) -> Self {
        Self(if by_ms >= 0 {
            self.0.saturating_add(by_ms.unsigned_abs())
        } else {
            self.0.saturating_sub(by_ms.unsigned_abs())
        })
    }

    /// Converts the wire's "0 means unset" convention.
    pub fn from_wire(ms: u64) -> Option<Self> {
        (ms != 0).then_some(Self(ms))
    }

    pub fn to_wire(v: Option<Self>) -> u64 {
        v.map_or(0, |t| t.0)
    }
}

impl fmt::Display for UnixMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

impl fmt::Debug for UnixMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}

/// A point on a clock's monotonic timeline: the time since an origin of the
/// clock's own. It never goes back, even when the wall clock is stepped, so
/// it times what is measured in durations (retry delays, ticks, how long a
/// pass took); deadlines that outlive the process are [`UnixMillis`]. Only
/// readings of one clock compare.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Debug)]
pub struct Monotonic(Duration);

impl Monotonic {
    pub const fn from_origin(d: Duration) -> Self {
        Self(d)
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Monotonic) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    /// `self + d`, held at the end of the timeline rather than wrapping.
    pub fn saturating_add(self, d: Duration) -> Self {
        Self(self.0.saturating_add(d))
    }
}

/// Notices steps of the wall clock: it keeps the wall clock's lead over the
/// monotonic one, and a change of that lead by [`StepWatch::STEP`] or more
/// at once is a step (NTP slews by far less). Deadlines kept on the wall
/// clock follow a step by the amount it returns, so that a step forward does
/// not make them all pass at once, nor a step back hold one for the step's
/// length.
#[derive(Debug, Clone, Copy)]
pub struct StepWatch {
    lead_ms: i64,
}

impl StepWatch {
    /// How far the wall clock must move against the monotonic one at once
    /// to count as a step.
    pub const STEP: Duration = Duration::from_secs(1);

    pub fn new(clock: &dyn Clock) -> Self {
        Self {
            lead_ms: Self::lead_ms(clock),
        }
    }

    fn lead_ms(clock: &dyn Clock) -> i64 {
        Self::reading(clock).1
    }

    /// The wall time, and the wall clock's lead over the monotonic one, from
    /// one reading of each.
    fn reading(clock: &dyn Clock) -> (UnixMillis, i64) {
        let now = clock.now();
        let wall = i64::try_from(now.as_millis()).unwrap_or(i64::MAX);
        let mono = i64::try_from(clock.monotonic().0.as_millis()).unwrap_or(i64::MAX);
        (now, wall.saturating_sub(mono))
    }

    /// The wall time now, and the step since the last look (ms, positive
    /// forward) if the wall clock stepped, from the same reading: a caller
    /// that moves its deadlines by the step before it uses the time never
    /// compares a stepped time with deadlines that have not moved (as it
    /// could if it looked for a step and then read the clock again, and the
    /// step fell between the two).
    pub fn read(&mut self, clock: &dyn Clock) -> (UnixMillis, Option<i64>) {
        let (now, lead) = Self::reading(clock);
        let by = lead.saturating_sub(self.lead_ms);
        self.lead_ms = lead;
        (
            now,
            (u128::from(by.unsigned_abs()) >= Self::STEP.as_millis()).then_some(by),
        )
    }

    /// The step since the last look, if the wall clock stepped (see
    /// [`StepWatch::read`]).
    pub fn stepped(&mut self, clock: &dyn Clock) -> Option<i64> {
        self.read(clock).1
    }
}

/// The one way services read time, so that tests drive a virtual clock and
/// stored deadlines stay wall-clock values across restarts.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// Wall-clock time: what deadlines are stored in.
    fn now(&self) -> UnixMillis;
    /// Monotonic time: what delays and ticks are timed with.
    fn monotonic(&self) -> Monotonic;
}

/// Wall-clock time, and the process's monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> UnixMillis {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        UnixMillis::new(ms)
    }

    fn monotonic(&self) -> Monotonic {
        static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        Monotonic(ORIGIN.get_or_init(std::time::Instant::now).elapsed())
    }
}

/// A clock that moves only when told to. [`ManualClock::advance`] moves
/// both its timelines; [`ManualClock::set`] steps only the wall clock, as an
/// operator or NTP stepping a machine's clock would.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    wall_ms: Arc<AtomicU64>,
    monotonic_ms: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn new(start: UnixMillis) -> Self {
        Self {
            wall_ms: Arc::new(AtomicU64::new(start.as_millis())),
            monotonic_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Steps the wall clock to `t` (forwards or back); monotonic time stays.
    pub fn set(&self, t: UnixMillis) {
        self.wall_ms.store(t.as_millis(), Ordering::SeqCst);
    }

    /// Lets `ms` milliseconds pass.
    pub fn advance(&self, ms: u64) {
        self.wall_ms.fetch_add(ms, Ordering::SeqCst);
        self.monotonic_ms.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> UnixMillis {
        UnixMillis::new(self.wall_ms.load(Ordering::SeqCst))
    }

    fn monotonic(&self) -> Monotonic {
        Monotonic(Duration::from_millis(self.monotonic_ms.load(Ordering::SeqCst)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturation_is_an_error() {
        let t = UnixMillis::new(u64::MAX - 5);
        assert!(t.checked_add(Duration::from_millis(5)).is_ok());
        assert!(t.checked_add(Duration::from_millis(6)).is_err());
        assert!(UnixMillis::ZERO.checked_add(Duration::MAX).is_err());
    }

    #[test]
    fn a_stepped_wall_clock_leaves_monotonic_time_alone() {
        let clock = ManualClock::new(UnixMillis::new(10_000));
        let t0 = clock.monotonic();
        clock.advance(250);
        assert_eq!(clock.now(), UnixMillis::new(10_250));
        assert_eq!(clock.monotonic().saturating_since(t0), Duration::from_millis(250));
        clock.set(UnixMillis::new(1_000));
        assert_eq!(clock.now(), UnixMillis::new(1_000));
        assert_eq!(clock.monotonic().saturating_since(t0), Duration::from_millis(250));
        assert_eq!(t0.saturating_since(clock.monotonic()), Duration::ZERO);
    }

    #[test]
    fn the_system_clocks_monotonic_time_does_not_go_back() {
        let a = SystemClock.monotonic();
        let b = SystemClock.monotonic();
        assert!(b >= a);
        assert_eq!(
            Monotonic::from_origin(Duration::MAX).saturating_add(Duration::from_secs(1)),
            Monotonic::from_origin(Duration::MAX)
        );
    }
}
