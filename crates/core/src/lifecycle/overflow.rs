//! Overflow: a request its limits (or the provider) refuse sent to a fallback backend
//! instead of a 429 (`limits[].overflow`, `provider_limits.overflow`), charged from then on
//! against the fallback's limits. The second charge is the dispatcher's to send.

use super::RequestFilter;
use crate::config::{Mode, Policy};
use crate::effects::host::Host;
use crate::plan::series::{self, Decision};
use crate::protocol::{LimitStatus, LimitsReply};

impl RequestFilter {
    /// Whether a refusal of this request may send it to a fallback instead: not in
    /// shadow mode (nothing is refused), not twice, and only while a header still routes.
    pub(super) fn can_overflow(&self, config: &Policy) -> bool {
        config.mode != Mode::Shadow && self.overflow.is_none() && self.route_open
    }

    /// Sends the request to `backend` instead of refusing it: charged from now on against
    /// the fallback's limits (its own and those every route shares), not the primary's.
    pub(super) fn overflow_to(&mut self, config: &Policy, backend: &str) {
        self.overflow = Some(backend.to_string());
        if let Some(plan) = self.plan.as_mut() {
            plan.route_to(config, Some(backend));
        }
    }

    /// The backend a refusal in `reply` sends this request to (in shadow mode: would send
    /// it to): that of the first limit that refused, when every limit that refused
    /// overflows (one that does not refuses), and the route can still change.
    pub(super) fn overflow_target(&self, config: &Policy, reply: &LimitsReply) -> Option<String> {
        if self.overflow.is_some() || !self.route_open {
            return None;
        }
        let relevant = self.relevant(reply);
        let refusing = relevant.limits.iter().filter(|o| o.status != LimitStatus::Allowed).map(|o| o.name.as_str());
        let mut backends =
            series::limit_indices(config, refusing).map(|i| config.limits.get(i).and_then(|l| l.overflow.clone()));
        let first = backends.next()??;
        backends.all(|b| b.is_some()).then_some(first)
    }

    /// Counts an overflow under each limit that refused `reply`, and routes the request to
    /// `backend`: charged from now on against the fallback's limits.
    pub(super) fn reroute(&mut self, host: &mut impl Host, config: &Policy, reply: &LimitsReply, backend: &str) {
        let relevant = self.relevant(reply);
        let refusing = relevant.limits.iter().filter(|o| o.status != LimitStatus::Allowed).map(|o| o.name.as_str());
        for limit in series::limit_indices(config, refusing) {
            host.add_series(series::decision(limit, Decision::Overflowed), 1);
        }
        self.overflow_to(config, backend);
    }
}
