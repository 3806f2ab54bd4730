//! The pace of a worker's background exchanges with the companion (the calibrations', the
//! provider words'): one out at a time, and the next only so long after the last.

#[derive(Debug, Default)]
pub struct ExchangePace {
    /// When the last exchange was sent; `None` before the first.
    last_ms: Option<u64>,
    /// The token of the exchange out, if one is.
    out: Option<u32>,
}

impl ExchangePace {
    /// Whether an exchange is due at `now`: none is out and the last went at least
    /// `every` ms ago (or none has). A due exchange counts as sent at `now`.
    pub fn due(&mut self, now: u64, every: u64) -> bool {
        if self.out.is_some() || self.last_ms.is_some_and(|last| now.saturating_sub(last) < every) {
            return false;
        }
        self.last_ms = Some(now);
        true
    }

    /// The exchange went out as callout `token`.
    pub fn sent(&mut self, token: u32) {
        self.out = Some(token);
    }

    /// Whether callout `token` is the exchange out; it is no longer out after this.
    pub fn is_reply(&mut self, token: u32) -> bool {
        let ours = self.out == Some(token);
        if ours {
            self.out = None;
        }
        ours
    }
}
