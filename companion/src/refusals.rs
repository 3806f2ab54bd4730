//! The log line for refused credentials. A filter with the wrong token makes every one of
//! its calls fail, hundreds a second, so the companion says so at most once per interval,
//! with how many it refused since it last said so. The token itself is never logged.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one line per this long.
const INTERVAL: Duration = Duration::from_secs(10);

pub struct RefusalLog {
    /// When the last line was written (`None`: never).
    last: Mutex<Option<Instant>>,
    /// Refusals since the last line.
    unreported: AtomicU64,
}

impl RefusalLog {
    pub fn new() -> RefusalLog {
        RefusalLog { last: Mutex::new(None), unreported: AtomicU64::new(0) }
    }

    /// Notes one refused call; returns the line to log, if one is due.
    pub fn refused(&self, token_present: bool, now: Instant) -> Option<String> {
        self.unreported.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if last.is_some_and(|at| now.duration_since(at) < INTERVAL) {
            return None;
        }
        *last = Some(now);
        let reported = self.unreported.swap(0, Ordering::Relaxed);
        let what = if token_present { "a wrong" } else { "no" };
        Some(format!(
            "companion: refused credentials: a call carried {what} x-llmrl-token (401; {reported} refused \
             since the last such line, at most one line per {}s). A filter whose companion.token differs from this \
             companion's token decides every request locally: fix its config",
            INTERVAL.as_secs()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_with_the_count_in_between() {
        let log = RefusalLog::new();
        let start = Instant::now();
        let first = log.refused(true, start).unwrap();
        assert!(first.contains("a wrong x-llmrl-token") && first.contains("1 refused"), "{first}");
        for i in 1..100 {
            assert_eq!(log.refused(true, start + Duration::from_millis(i)), None);
        }
        let next = log.refused(false, start + INTERVAL).unwrap();
        assert!(next.contains("carried no x-llmrl-token") && next.contains("100 refused"), "{next}");
    }
}
