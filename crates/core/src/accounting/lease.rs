//! Leased budgets: blocks of a tenant's budget that one proxy instance (all its worker
//! VMs, through proxy-wasm shared data) takes from Redis and then admits from with no
//! callout. A lease is charged to the tenant's bucket in Redis when granted, so leases
//! never let an instance admit more than the limit: what they cost is budget that sits in
//! one instance's lease while another instance could have used it. Leases expire, and
//! what is left is given back; they are renewed before they run out, sized by how fast
//! they were used.
//!
//! All leases of one tenant are stored as one value, so admitting against several limits
//! is a single compare-and-swap.

use crate::protocol::{LeaseAsk, LimitCharge, LimitOutcome, LimitStatus, LimitsReply};

/// One limit's lease.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Lease {
    /// Budget left to admit from. Below zero after a settlement took more than reserved.
    pub remaining: f64,
    /// The last grant: the size the next one is based on.
    pub granted: f64,
    /// The bucket's level in Redis after the last grant, for headers.
    pub global_remaining: f64,
    pub expires_ms: u64,
    /// When this instance last asked for a renewal (0: not asked, or answered): while its
    /// callout may be out no worker asks again.
    pub renewal_asked_ms: u64,
    /// Redis refused a grant of `blocked_cost`: until this time a request needing as much
    /// is refused here, without asking again.
    pub blocked_until_ms: u64,
    pub blocked_cost: f64,
}

/// How leases are sized and renewed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeasePolicy {
    pub ttl_ms: u64,
    /// Renew when less than this fraction of the last grant is left.
    pub low_water: f64,
    /// The first lease of a limit: this fraction of its capacity.
    pub initial_fraction: f64,
    /// No lease larger than this fraction of the capacity.
    pub max_fraction: f64,
    /// How long a renewal asked is awaited before another may be asked: the longest its
    /// callout can be out.
    pub renewal_wait_ms: u64,
}

const LEASE_BYTES: usize = 56;

impl Lease {
    pub fn is_live(&self, now_ms: u64) -> bool {
        now_ms < self.expires_ms
    }

    /// Whether this lease should be renewed now: running low, or close to expiring while
    /// in use, and no renewal of it out (asked less than `renewal_wait_ms` ago, and not
    /// answered yet).
    pub fn wants_renewal(&self, policy: &LeasePolicy, now_ms: u64) -> bool {
        if self.renewal_in_flight(policy, now_ms) {
            return false;
        }
        let low = self.remaining < self.granted * policy.low_water;
        let ending = self.expires_ms.saturating_sub(now_ms) < policy.ttl_ms / 5 && self.remaining < self.granted;
        self.granted > 0.0 && (low || ending)
    }

    /// A renewal's callout has answered (granted or not): another may be asked.
    pub fn renewal_answered(&mut self) {
        self.renewal_asked_ms = 0;
    }

    /// Whether a renewal of this lease was asked and may still be out.
    pub fn renewal_in_flight(&self, policy: &LeasePolicy, now_ms: u64) -> bool {
        self.renewal_asked_ms != 0 && now_ms < self.renewal_asked_ms + policy.renewal_wait_ms
    }

    /// The size to ask for next: double when the last grant was used up in less than half
    /// its life, half when most of it was left at the end, else the same; within
    /// `[1, max_fraction x capacity]`.
    pub fn next_size(&self, policy: &LeasePolicy, capacity: u64, now_ms: u64) -> f64 {
        let capacity = capacity as f64;
        let ceiling = (capacity * policy.max_fraction).max(1.0);
        if self.granted <= 0.0 {
            return (capacity * policy.initial_fraction).clamp(1.0, ceiling);
        }
        let life_left = self.expires_ms.saturating_sub(now_ms) as f64 / policy.ttl_ms.max(1) as f64;
        let used = 1.0 - self.remaining.max(0.0) / self.granted;
        let size = if used >= 1.0 - policy.low_water && life_left > 0.5 {
            self.granted * 2.0
        } else if used < 0.5 && life_left < 0.2 {
            self.granted / 2.0
        } else {
            self.granted
        };
        size.clamp(1.0, ceiling)
    }

    /// Adds a grant: the budget joins what is left, and the lease lives on from now.
    /// (A renewal's answer also lifts the renewal's marker: [`Lease::renewal_answered`].)
    pub fn add_grant(&mut self, grant: f64, global_remaining: f64, policy: &LeasePolicy, now_ms: u64) {
        if !self.is_live(now_ms) {
            self.remaining = self.remaining.min(0.0); // an expired lease's budget went back
        }
        self.remaining += grant;
        self.granted = grant.max(self.granted * 0.5);
        self.global_remaining = global_remaining;
        self.expires_ms = now_ms + policy.ttl_ms;
        // A renewal still out stays marked: a request's own grant does not answer it.
        self.blocked_until_ms = 0;
    }

    /// Whether a request of `cost` is refused here without asking Redis: Redis recently
    /// refused as much, and this lease cannot cover it.
    pub fn blocks(&self, cost: u64, now_ms: u64) -> bool {
        self.blocked_for(cost, now_ms).is_some() && !(self.is_live(now_ms) && self.remaining >= cost as f64)
    }

    /// Whether Redis recently refused what a request of `cost` needs, and for how much
    /// longer (ms).
    pub fn blocked_for(&self, cost: u64, now_ms: u64) -> Option<u64> {
        (cost > 0 && now_ms < self.blocked_until_ms && cost as f64 >= self.blocked_cost)
            .then(|| self.blocked_until_ms - now_ms)
    }

    fn to_bytes(self, out: &mut Vec<u8>) {
        for value in [self.remaining, self.granted, self.global_remaining] {
            out.extend_from_slice(&value.to_le_bytes());
        }
        out.extend_from_slice(&self.expires_ms.to_le_bytes());
        out.extend_from_slice(&self.renewal_asked_ms.to_le_bytes());
        out.extend_from_slice(&self.blocked_until_ms.to_le_bytes());
        out.extend_from_slice(&self.blocked_cost.to_le_bytes());
    }

    fn from_bytes(bytes: &[u8]) -> Option<Lease> {
        let f = |at: usize| -> Option<f64> { Some(f64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?)) };
        let u = |at: usize| -> Option<u64> { Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?)) };
        let lease = Lease {
            remaining: f(0)?,
            granted: f(8)?,
            global_remaining: f(16)?,
            expires_ms: u(24)?,
            renewal_asked_ms: u(32)?,
            blocked_until_ms: u(40)?,
            blocked_cost: f(48)?,
        };
        let finite =
            [lease.remaining, lease.granted, lease.global_remaining, lease.blocked_cost].iter().all(|v| v.is_finite());
        finite.then_some(lease)
    }
}

/// What to ask Redis for, per limit, to grow a tenant's `leases` for `charges` (one per
/// limit: this request's costs, or all 0 for a renewal). A limit is leased once a request
/// uses it, at the size [`Lease::next_size`] says, and never less than the request needs.
pub fn lease_asks(leases: &TenantLeases, charges: &[LimitCharge], policy: &LeasePolicy, now_ms: u64) -> Vec<LeaseAsk> {
    charges
        .iter()
        .zip(&leases.0)
        .map(|(charge, lease)| LeaseAsk {
            name: charge.name.clone(),
            capacity: charge.capacity,
            window_ms: charge.window_ms,
            owner: charge.owner.clone(),
            wanted: if charge.cost == 0 && lease.granted <= 0.0 {
                0
            } else {
                (lease.next_size(policy, charge.capacity, now_ms).ceil() as u64).max(charge.cost)
            },
            needed: Some(charge.cost),
            kind: charge.kind,
            look_only: charge.look_only,
        })
        .collect()
}

/// A tenant's entry in the lease table: when it was last charged directly (a tenant
/// leases only once it shows repeat traffic) and its leases.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LeaseEntry {
    pub seen_ms: u64,
    pub leases: TenantLeases,
}

impl LeaseEntry {
    /// The stored entry, or a fresh one.
    pub fn decode(payload: Option<&[u8]>, limits: usize) -> LeaseEntry {
        let seen = payload.and_then(|p| Some((u64::from_le_bytes(p.get(..8)?.try_into().ok()?), p.get(8..)?)));
        match seen {
            Some((seen_ms, leases)) => LeaseEntry { seen_ms, leases: TenantLeases::decode(Some(leases), limits) },
            None => LeaseEntry { seen_ms: 0, leases: TenantLeases::decode(None, limits) },
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        self.encode_with_room(0)
    }

    /// `encode` in one allocation with `room` bytes to spare, for what its table puts in
    /// front of it (an entry is written on every leased request).
    pub fn encode_with_room(&self, room: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(room + 8 + self.leases.0.len() * LEASE_BYTES);
        out.extend_from_slice(&self.seen_ms.to_le_bytes());
        self.leases.encode_into(&mut out);
        out
    }

    /// Whether another tenant may take this entry's slot: no lease is live and nothing is
    /// left to give back to Redis (an expired lease's remainder is returned first).
    pub fn evictable(payload: &[u8], limits: usize, now_ms: u64) -> bool {
        let entry = LeaseEntry::decode(Some(payload), limits);
        entry.leases.0.iter().all(|l| !l.is_live(now_ms) && l.remaining == 0.0)
    }

    /// Whether the tenant shows repeat traffic: a live lease, or a direct charge less than
    /// `ttl_ms` ago. A tenant seen once is charged directly, so one-off tenants cost no
    /// lease.
    pub fn repeats(&self, ttl_ms: u64, now_ms: u64) -> bool {
        self.leases.0.iter().any(|l| l.is_live(now_ms)) || (self.seen_ms != 0 && now_ms < self.seen_ms + ttl_ms)
    }
}

/// The leases of one tenant, one per configured limit, in config order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TenantLeases(pub Vec<Lease>);

impl TenantLeases {
    /// Stored leases, or fresh ones if there are none or they no longer match the config.
    pub fn decode(bytes: Option<&[u8]>, limits: usize) -> TenantLeases {
        let decoded = bytes.and_then(|bytes| {
            if bytes.len() != limits * LEASE_BYTES {
                return None;
            }
            bytes.chunks(LEASE_BYTES).map(Lease::from_bytes).collect::<Option<Vec<_>>>()
        });
        TenantLeases(decoded.unwrap_or_else(|| vec![Lease::default(); limits]))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.0.len() * LEASE_BYTES);
        self.encode_into(&mut out);
        out
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        for lease in &self.0 {
            lease.to_bytes(out);
        }
    }

    /// Takes `costs[i]` from lease `i`, all or none: only live leases with enough left.
    pub fn admit(&mut self, costs: &[u64], now_ms: u64) -> bool {
        let fits = self.0.len() == costs.len()
            && self
                .0
                .iter()
                .zip(costs)
                .all(|(lease, &cost)| cost == 0 || (lease.is_live(now_ms) && lease.remaining >= cost as f64));
        if fits {
            for (lease, &cost) in self.0.iter_mut().zip(costs) {
                lease.remaining -= cost as f64;
            }
        }
        fits
    }

    /// Applies a settlement to lease `index`: `credit` tokens back (or taken, if
    /// negative). Returns `false` when the lease has expired: the credit then belongs to
    /// Redis.
    pub fn credit(&mut self, index: usize, credit: i64, now_ms: u64) -> bool {
        match self.0.get_mut(index) {
            Some(lease) if lease.is_live(now_ms) => {
                lease.remaining += credit as f64;
                true
            }
            _ => false,
        }
    }

    /// When the first live lease expires (`None`: none is live): until then an expiry
    /// sweep has nothing to give back here.
    pub fn next_expiry_ms(&self, now_ms: u64) -> Option<u64> {
        self.0.iter().filter(|lease| lease.is_live(now_ms)).map(|lease| lease.expires_ms).min()
    }

    /// Expired leases give their remainder (positive or negative) back; returns it per
    /// limit, and leaves those leases empty.
    pub fn expire(&mut self, now_ms: u64) -> Vec<f64> {
        self.0
            .iter_mut()
            .map(|lease| {
                if lease.expires_ms != 0 && !lease.is_live(now_ms) && lease.remaining != 0.0 {
                    std::mem::take(&mut lease.remaining)
                } else {
                    0.0
                }
            })
            .collect()
    }
}

impl TenantLeases {
    /// Remembers that Redis refused this request's needs: for each limit that was
    /// limited, until its retry time.
    pub fn block(&mut self, reply: &LimitsReply, costs: &[u64], now_ms: u64) {
        for ((lease, outcome), &cost) in self.0.iter_mut().zip(&reply.limits).zip(costs) {
            if outcome.status == LimitStatus::Limited && outcome.retry_after_ms > 0 {
                lease.blocked_until_ms = now_ms + outcome.retry_after_ms;
                lease.blocked_cost = cost as f64;
            }
        }
    }

    /// Whether some limit blocks its part of `costs` (see [`Lease::blocks`]): what
    /// [`TenantLeases::refusal`] answers, without building its reply.
    pub fn blocks(&self, costs: &[u64], now_ms: u64) -> bool {
        self.0.iter().zip(costs).any(|(lease, &cost)| lease.blocks(cost, now_ms))
    }

    /// If a limit recently refused what this request needs (and its lease cannot cover
    /// it), the reply to give without asking Redis again: that limit, with its retry time.
    pub fn refusal(&self, specs: &[LimitCharge], now_ms: u64) -> Option<LimitsReply> {
        if !self.0.iter().zip(specs).any(|(lease, spec)| lease.blocks(spec.cost, now_ms)) {
            return None;
        }
        let mut reply = self.as_reply(specs);
        reply.allowed = false;
        for ((lease, spec), outcome) in self.0.iter().zip(specs).zip(reply.limits.iter_mut()) {
            outcome.charged = 0;
            if let Some(wait) = lease.blocked_for(spec.cost, now_ms) {
                outcome.status = LimitStatus::Limited;
                outcome.retry_after_ms = wait;
            }
        }
        Some(reply)
    }

    /// What this instance can tell a client about each limit: what is left to it (its
    /// lease and the tenant's level in Redis at the last grant), for headers.
    pub fn as_reply(&self, specs: &[LimitCharge]) -> LimitsReply {
        let limits = self
            .0
            .iter()
            .zip(specs)
            .map(|(lease, spec)| {
                let capacity = spec.capacity as f64;
                let left = (lease.global_remaining + lease.remaining.max(0.0)).clamp(0.0, capacity);
                LimitOutcome {
                    name: spec.name.clone(),
                    status: LimitStatus::Allowed,
                    limit: spec.capacity,
                    remaining: left.floor() as u64,
                    reset_after_ms: ((capacity - left) * spec.window_ms as f64 / capacity).ceil() as u64,
                    retry_after_ms: 0,
                    charged: spec.cost,
                }
            })
            .collect();
        LimitsReply { allowed: true, waited_ms: 0, limits, suspended: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::LimitKind;

    const POLICY: LeasePolicy = LeasePolicy {
        ttl_ms: 10_000,
        low_water: 0.2,
        initial_fraction: 0.05,
        max_fraction: 0.25,
        renewal_wait_ms: 1000,
    };

    fn leased(remaining: f64, granted: f64, expires_ms: u64) -> Lease {
        Lease { remaining, granted, expires_ms, ..Lease::default() }
    }

    #[test]
    fn admits_all_or_nothing_from_live_leases() {
        let mut leases = TenantLeases(vec![leased(5.0, 10.0, 1000), leased(100.0, 100.0, 1000)]);
        assert!(leases.admit(&[1, 60], 0));
        assert!(!leases.admit(&[1, 60], 0), "the second lease has 40 left");
        assert_eq!(leases.0[0].remaining, 4.0);
        assert!(!leases.admit(&[1, 1], 1000), "expired");
        assert!(leases.admit(&[0, 40], 999), "a zero cost needs no lease");
        let mut empty = TenantLeases::decode(None, 2);
        assert!(!empty.admit(&[1, 1], 0));
    }

    #[test]
    fn grants_extend_life_and_join_what_is_left() {
        let mut lease = Lease::default();
        lease.add_grant(50.0, 900.0, &POLICY, 100);
        assert_eq!((lease.remaining, lease.expires_ms, lease.global_remaining), (50.0, 10_100, 900.0));
        lease.remaining = 5.0;
        lease.add_grant(50.0, 800.0, &POLICY, 200);
        assert_eq!((lease.remaining, lease.expires_ms), (55.0, 10_200));
        // An expired lease's remainder was given back: a new grant starts from it.
        lease.add_grant(20.0, 700.0, &POLICY, 20_000);
        assert_eq!(lease.remaining, 20.0);
    }

    #[test]
    fn renews_when_low_or_ending_and_not_twice_a_second() {
        let mut lease = leased(50.0, 100.0, 10_000);
        assert!(!lease.wants_renewal(&POLICY, 0));
        lease.remaining = 19.0;
        assert!(lease.wants_renewal(&POLICY, 0));
        lease.renewal_asked_ms = 100;
        assert!(!lease.wants_renewal(&POLICY, 500));
        assert!(lease.wants_renewal(&POLICY, 1100));
        let ending = leased(90.0, 100.0, 10_000);
        assert!(ending.wants_renewal(&POLICY, 8_500));
        assert!(!Lease::default().wants_renewal(&POLICY, 0), "never leased");
    }

    #[test]
    fn sizes_adapt_to_use() {
        let capacity = 10_000;
        assert_eq!(Lease::default().next_size(&POLICY, capacity, 0), 500.0);
        // Used up early: double.
        assert_eq!(leased(10.0, 500.0, 9_000).next_size(&POLICY, capacity, 0), 1000.0);
        // Barely used at the end: half.
        assert_eq!(leased(400.0, 500.0, 1_000).next_size(&POLICY, capacity, 0), 250.0);
        // Never above the ceiling, never below one.
        assert_eq!(leased(0.0, 2_000.0, 9_000).next_size(&POLICY, capacity, 0), 2_500.0);
        assert_eq!(leased(1.0, 1.0, 100).next_size(&POLICY, 3, 0), 1.0);
    }

    #[test]
    fn expiry_returns_the_remainder_once() {
        let mut leases = TenantLeases(vec![leased(7.0, 10.0, 100), leased(-3.0, 10.0, 100), leased(5.0, 10.0, 900)]);
        assert_eq!(leases.expire(500), vec![7.0, -3.0, 0.0]);
        assert_eq!(leases.expire(500), vec![0.0, 0.0, 0.0]);
        assert!(!leases.credit(0, 5, 500), "expired: the credit goes to Redis");
        assert!(leases.credit(2, -2, 500));
        assert_eq!(leases.0[2].remaining, 3.0);
    }

    #[test]
    fn a_refusal_is_remembered_until_its_retry_time() {
        let spec = |cost| LimitCharge {
            owner: None,
            shadow: false,
            name: "tpm".into(),
            capacity: 1000,
            window_ms: 60_000,
            cost,
            min_cost: None,
            kind: LimitKind::TokenBucket,
            period_bounds_ms: Vec::new(),
            provisional: false,
            look_only: false,
            fair: None,
        };
        let mut leases = TenantLeases(vec![leased(5.0, 50.0, 10_000)]);
        let refused = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![LimitOutcome {
                name: "tpm".into(),
                status: LimitStatus::Limited,
                limit: 1000,
                remaining: 3,
                reset_after_ms: 60_000,
                retry_after_ms: 2_000,
                charged: 0,
            }],
            suspended: None,
        };
        leases.block(&refused, &[100], 1_000);
        let reply = leases.refusal(&[spec(100)], 1_500).expect("still refused");
        assert!(!reply.allowed);
        assert_eq!((reply.limits[0].status, reply.limits[0].retry_after_ms), (LimitStatus::Limited, 1_500));
        assert!(leases.refusal(&[spec(150)], 1_500).is_some(), "needing more is refused too");
        assert!(leases.refusal(&[spec(50)], 1_500).is_none(), "needing less may be granted: ask");
        assert!(leases.refusal(&[spec(4)], 1_500).is_none(), "the lease covers it");
        assert!(leases.refusal(&[spec(100)], 3_000).is_none(), "retry time passed");
        let mut renewed = leases.clone();
        renewed.0[0].add_grant(200.0, 500.0, &POLICY, 1_600);
        assert!(renewed.refusal(&[spec(100)], 1_700).is_none(), "a grant lifts it");
    }

    #[test]
    fn headers_count_the_lease_and_what_redis_had_left() {
        let spec = LimitCharge {
            owner: None,
            shadow: false,
            name: "rpm".into(),
            capacity: 100,
            window_ms: 60_000,
            cost: 1,
            min_cost: None,
            kind: LimitKind::TokenBucket,
            period_bounds_ms: Vec::new(),
            provisional: false,
            look_only: false,
            fair: None,
        };
        let leases = TenantLeases(vec![Lease { remaining: 7.0, global_remaining: 50.0, ..leased(7.0, 10.0, 100) }]);
        let reply = leases.as_reply(std::slice::from_ref(&spec));
        assert_eq!((reply.limits[0].remaining, reply.limits[0].reset_after_ms), (57, 25_800));
    }

    #[test]
    fn round_trips_and_rejects_mismatched_configs() {
        let leases = TenantLeases(vec![
            leased(1.5, 2.0, 3),
            Lease { renewal_asked_ms: 9, blocked_until_ms: 10, blocked_cost: 11.0, ..leased(-4.0, 5.0, 6) },
        ]);
        let bytes = leases.encode();
        assert_eq!(TenantLeases::decode(Some(&bytes), 2), leases);
        assert_eq!(TenantLeases::decode(Some(&bytes), 3), TenantLeases::decode(None, 3));
        assert_eq!(TenantLeases::decode(Some(&bytes[..10]), 2).0, vec![Lease::default(); 2]);
    }
}
