//! What the filter sends a client itself: a reply (status, headers, body) and the header
//! pairs every response may carry, below both what decides them (`crate::replies::decision`) and
//! what shapes them for the caller's API (`crate::replies::answers`), and below the `Host` that
//! sends them.

use crate::protocol::{LimitOutcome, LimitsReply};

pub type Header = (&'static str, String);

/// A response the filter sends itself instead of forwarding the request.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<Header>,
    pub body: String,
}

impl LocalReply {
    /// The same reply with no body (for a host that cannot send one just then): the
    /// status, `retry-after` and the rate-limit headers still say what happened.
    pub fn without_body(mut self) -> LocalReply {
        self.headers.retain(|(name, _)| *name != "content-type");
        self.body.clear();
        self
    }
}

/// The most restrictive of the reply's limits whose name `of_kind` accepts: fewest left;
/// on a tie, longest to reset.
pub(crate) fn tightest(reply: &LimitsReply, of_kind: impl Fn(&str) -> bool) -> Option<&LimitOutcome> {
    reply.limits.iter().filter(|o| of_kind(&o.name)).min_by_key(|o| (o.remaining, std::cmp::Reverse(o.reset_after_ms)))
}
