//! The driver's one clock read, behind a trait so that tests drive a virtual
//! clock and stored deadlines stay wall-clock values across restarts.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use contract::UnixMillis;

pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    fn now(&self) -> UnixMillis;
}

/// Wall-clock time.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)] // The one place the driver reads the wall clock.
    fn now(&self) -> UnixMillis {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        UnixMillis::new(ms)
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    pub fn new(start: UnixMillis) -> Self {
        Self(Arc::new(AtomicU64::new(start.as_millis())))
    }

    pub fn set(&self, t: UnixMillis) {
        self.0.store(t.as_millis(), Ordering::SeqCst);
    }

    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> UnixMillis {
        UnixMillis::new(self.0.load(Ordering::SeqCst))
    }
}
