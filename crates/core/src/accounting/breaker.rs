//! A circuit breaker over the companion: after `failures` consecutive failed callouts it
//! opens, and for `cooldown` every decision is made locally with no callout (so an outage
//! does not add a timeout to every request). Then one request probes; its success closes
//! the breaker, its failure opens it for another cool-down. The state is shared by every
//! worker of a proxy (proxy-wasm shared data), so one worker's discovery spares the rest.

/// The breaker's state as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Breaker {
    pub consecutive_failures: u32,
    /// While now < this, the breaker is open. 0: closed.
    pub open_until_ms: u64,
    /// A probe is out (half-open); until it answers, others stay local.
    pub probe_started_ms: u64,
}

/// Where a request's decision is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// Ask the companion.
    Call,
    /// Ask the companion as the probe of a half-open breaker.
    Probe,
    /// Decide locally: the breaker is open.
    Local,
}

impl Breaker {
    pub fn is_closed(self) -> bool {
        self.open_until_ms == 0
    }

    /// Where a request goes now, and the state to store if it changed (a probe taken).
    /// A probe that never answers (the request vanished) is retried after `cooldown`.
    pub fn dispatch(self, now_ms: u64, cooldown_ms: u64) -> (Dispatch, Option<Breaker>) {
        if self.is_closed() {
            return (Dispatch::Call, None);
        }
        if now_ms < self.open_until_ms {
            return (Dispatch::Local, None);
        }
        if self.probe_started_ms != 0 && now_ms < self.probe_started_ms + cooldown_ms {
            return (Dispatch::Local, None);
        }
        (Dispatch::Probe, Some(Breaker { probe_started_ms: now_ms, ..self }))
    }

    pub fn on_success(self) -> Breaker {
        Breaker::default()
    }

    pub fn on_failure(self, now_ms: u64, failures: u32, cooldown_ms: u64) -> Breaker {
        let consecutive_failures = self.consecutive_failures.saturating_add(1);
        let open = consecutive_failures >= failures || !self.is_closed();
        Breaker {
            consecutive_failures,
            open_until_ms: if open { now_ms + cooldown_ms } else { 0 },
            probe_started_ms: 0,
        }
    }

    pub fn to_bytes(self) -> [u8; 20] {
        let mut bytes = [0u8; 20];
        bytes[..4].copy_from_slice(&self.consecutive_failures.to_le_bytes());
        bytes[4..12].copy_from_slice(&self.open_until_ms.to_le_bytes());
        bytes[12..].copy_from_slice(&self.probe_started_ms.to_le_bytes());
        bytes
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<Breaker> {
        Some(Breaker {
            consecutive_failures: u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?),
            open_until_ms: u64::from_le_bytes(bytes.get(4..12)?.try_into().ok()?),
            probe_started_ms: u64::from_le_bytes(bytes.get(12..20)?.try_into().ok()?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAILURES: u32 = 3;
    const COOLDOWN: u64 = 500;

    #[test]
    fn opens_after_consecutive_failures_only() {
        let mut b = Breaker::default();
        b = b.on_failure(0, FAILURES, COOLDOWN);
        b = b.on_failure(1, FAILURES, COOLDOWN);
        assert_eq!(b.dispatch(2, COOLDOWN).0, Dispatch::Call);
        b = b.on_success();
        b = b.on_failure(3, FAILURES, COOLDOWN).on_failure(4, FAILURES, COOLDOWN);
        assert!(b.is_closed(), "a success in between resets the count");
        b = b.on_failure(5, FAILURES, COOLDOWN);
        assert_eq!(b.dispatch(6, COOLDOWN).0, Dispatch::Local);
        assert_eq!(b.dispatch(504, COOLDOWN).0, Dispatch::Local);
    }

    #[test]
    fn probes_once_after_the_cooldown_and_recovers() {
        let open = Breaker::default().on_failure(0, 1, COOLDOWN);
        let (route, taken) = open.dispatch(500, COOLDOWN);
        assert_eq!(route, Dispatch::Probe);
        let probing = taken.expect("probe recorded");
        // Others stay local while the probe is out.
        assert_eq!(probing.dispatch(501, COOLDOWN).0, Dispatch::Local);
        // A vanished probe is retried after another cool-down.
        assert_eq!(probing.dispatch(1000, COOLDOWN).0, Dispatch::Probe);
        assert!(probing.on_success().is_closed());
        // A failed probe opens it again for a whole cool-down.
        let reopened = probing.on_failure(600, 1, COOLDOWN);
        assert_eq!(reopened.dispatch(1099, COOLDOWN).0, Dispatch::Local);
        assert_eq!(reopened.dispatch(1100, COOLDOWN).0, Dispatch::Probe);
    }

    #[test]
    fn round_trips_through_bytes() {
        let b = Breaker { consecutive_failures: 7, open_until_ms: 1_700_000_000_123, probe_started_ms: 42 };
        assert_eq!(Breaker::from_bytes(&b.to_bytes()), Some(b));
        assert_eq!(Breaker::from_bytes(&[1, 2]), None);
    }
}
