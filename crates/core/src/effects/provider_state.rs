//! What the providers last said about their own limits (`crate::effects::provider_word`), kept per
//! upstream credential and model, and what follows from it for a request:
//!
//! - while the provider refuses (a 429 until its retry time, or a quota it said is spent
//!   until its reset) the request is answered here, in its API's shape, with the
//!   provider's own retry time, instead of being forwarded into a certain refusal;
//! - once a 429's retry time has passed, one request goes through as the probe (one per
//!   proxy, or per fleet when shared); its reply says whether the provider is back;
//! - while the provider says less is left of a quota than a configured limit holds, the
//!   limit is charged as if its size were what is left (never above its configured size).
//!
//! Kept in a fixed table of shared data (`provider_limits.slots` entries, each owned by a
//! keyed hash of the credential's id and the model), so memory is bounded whatever
//! credentials and models clients send, and every worker of a proxy knows what any
//! worker heard. Across proxies (`provider_limits.share`) each worker hands what it heard
//! to the companion (`lua/provider.lua`) and takes back what the fleet heard, including
//! who sends the probe: at most one proxy of the fleet probes per retry period.

use crate::config::{Limit, Measure, Policy, ProviderLimits, TokenCount};
use crate::effects::host::{shared_read, shared_update, Host, Metric};
use crate::effects::provider_word::{ProviderWord, Quota};
use crate::effects::tables::keyed_hash;
use crate::protocol::{
    is_provider_key, keys, LimitCharge, LimitKind, ProbeBy, ProviderEntry, ProviderExchange, ProviderReply,
    ProviderReport, MAX_PROVIDER_REPORTS, QUOTAS,
};
use std::collections::BTreeMap;

/// How long a probe holds its right to be the only request through: its reply's headers
/// normally come much sooner; if they never do (the client left), another probe may go.
pub const PROBE_MS: u64 = crate::protocol::PROBE_HOLD_MS;
/// With the fleet sharing, how long past a retry time a proxy waits for the fleet to say
/// who probes before it probes by itself (the companion may be away).
pub const AWAIT_FLEET_MS: u64 = 3_000;
/// The wait a client is told while a probe is out: the probe's answer comes in about one
/// request's time to its first byte.
pub const PROBE_WAIT_MS: u64 = 1_000;
/// How often a worker with news exchanges it with the fleet, and how often one without asks.
pub const EXCHANGE_MS: u64 = 200;
pub const IDLE_EXCHANGE_MS: u64 = 1_000;

/// Who may send the probe, as this proxy knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Probe {
    /// Whoever asks first (no fleet to ask).
    #[default]
    Anyone = 0,
    /// The fleet gave it to this proxy: the first request takes it.
    Mine = 1,
    /// A request of this proxy is the probe, until `probe_until_ms`.
    Taken = 2,
    /// Another proxy of the fleet probes, until `probe_until_ms`.
    Another = 3,
    /// The fleet has not said yet: wait for it until `probe_until_ms`.
    AwaitFleet = 4,
}

impl Probe {
    fn from_byte(byte: u8) -> Probe {
        match byte {
            1 => Probe::Mine,
            2 => Probe::Taken,
            3 => Probe::Another,
            4 => Probe::AwaitFleet,
            _ => Probe::Anyone,
        }
    }
}

/// What the provider last said for one key, by the proxy's clock (ms since the epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProviderState {
    /// When the request whose reply said it was sent: a reply to an earlier request is
    /// older news, and changes nothing.
    pub said_ms: u64,
    /// Until when the provider refuses (0: it does not).
    pub out_until_ms: u64,
    /// It refused with a 429 (a probe goes first after `out_until_ms`), rather than said a
    /// quota was spent (whole again at its reset).
    pub refused: bool,
    pub probe: Probe,
    pub probe_until_ms: u64,
    /// Per quota: what is left and until when that holds (0: not said).
    pub left: [(u64, u64); QUOTAS],
}

/// What the provider's word means for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    Forward,
    /// Forward it as the one probe.
    Probe,
    /// Answer it here: the provider would refuse it for `wait_ms` more; `quota` is the
    /// quota it would not fit in, when that is the reason.
    Refuse {
        wait_ms: u64,
        quota: Option<Quota>,
    },
}

const BYTES: usize = 8 + 8 + 1 + 1 + 8 + QUOTAS * 16;

impl ProviderState {
    pub fn to_bytes(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BYTES);
        out.extend_from_slice(&self.said_ms.to_le_bytes());
        out.extend_from_slice(&self.out_until_ms.to_le_bytes());
        out.push(u8::from(self.refused));
        out.push(self.probe as u8);
        out.extend_from_slice(&self.probe_until_ms.to_le_bytes());
        for (remaining, until) in self.left {
            out.extend_from_slice(&remaining.to_le_bytes());
            out.extend_from_slice(&until.to_le_bytes());
        }
        out
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<ProviderState> {
        let u64_at = |at: usize| bytes.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        let mut state = ProviderState {
            said_ms: u64_at(0)?,
            out_until_ms: u64_at(8)?,
            refused: *bytes.get(16)? == 1,
            probe: Probe::from_byte(*bytes.get(17)?),
            probe_until_ms: u64_at(18)?,
            left: [(0, 0); QUOTAS],
        };
        for (i, left) in state.left.iter_mut().enumerate() {
            *left = (u64_at(26 + 16 * i)?, u64_at(34 + 16 * i)?);
        }
        Some(state)
    }

    /// This state with `word` taken in: said on the reply of a request sent at `sent_ms`,
    /// heard at `now`. `None` when it is older news than what is kept.
    pub fn hear(self, word: &ProviderWord, sent_ms: u64, now: u64, config: &ProviderLimits) -> Option<ProviderState> {
        if sent_ms < self.said_ms {
            return None;
        }
        let mut next = self;
        next.said_ms = sent_ms;
        for (kept, said) in next.left.iter_mut().zip(word.left) {
            if let Some(said) = said {
                *kept = (said.remaining, now.saturating_add(said.reset_after_ms.min(config.max_retry_ms)));
            }
        }
        match word.out_for_ms(config.default_retry_ms) {
            Some(wait) => {
                next.out_until_ms = now.saturating_add(wait.clamp(1, config.max_retry_ms));
                next.refused = word.refused;
                (next.probe, next.probe_until_ms) = if config.share && word.refused {
                    (Probe::AwaitFleet, next.out_until_ms.saturating_add(AWAIT_FLEET_MS))
                } else {
                    (Probe::Anyone, 0)
                };
            }
            None => {
                next.out_until_ms = 0;
                next.refused = false;
                (next.probe, next.probe_until_ms) = (Probe::Anyone, 0);
            }
        }
        Some(next)
    }

    /// What this state means at `now` for a request that needs `needs` of each quota;
    /// with the state to write back when the request takes the probe.
    pub fn judge(&self, now: u64, needs: [u64; QUOTAS]) -> (Judgement, Option<ProviderState>) {
        if self.out_until_ms > now {
            return (Judgement::Refuse { wait_ms: self.out_until_ms - now, quota: None }, None);
        }
        if self.out_until_ms != 0 && self.refused {
            let waiting = matches!(self.probe, Probe::Taken | Probe::Another | Probe::AwaitFleet);
            if waiting && self.probe_until_ms > now {
                let wait_ms = (self.probe_until_ms - now).min(PROBE_WAIT_MS);
                return (Judgement::Refuse { wait_ms, quota: None }, None);
            }
            let taken = ProviderState { probe: Probe::Taken, probe_until_ms: now.saturating_add(PROBE_MS), ..*self };
            return (Judgement::Probe, Some(taken));
        }
        for (quota, (&(remaining, until), &need)) in Quota::ALL.iter().zip(self.left.iter().zip(&needs)) {
            if until > now && need > remaining {
                return (Judgement::Refuse { wait_ms: until - now, quota: Some(*quota) }, None);
            }
        }
        (Judgement::Forward, None)
    }

    /// Lowers each bucket to what the provider says is left of its limit's quota, while
    /// that holds and is less than the bucket's size; never raises one. A token bucket
    /// keeps its refill rate (its window shrinks with its size); a sliding window keeps
    /// its window. Slots and budgets have no provider quota. Whether any was lowered.
    ///
    /// It applies to every limit it is given: the configured limits now, and the shared
    /// pools' buckets alike once they are part of the plan (they are `LimitCharge`s too).
    pub fn lower(&self, limits: &[Limit], buckets: &mut [LimitCharge], now: u64) -> bool {
        let mut lowered = false;
        for (limit, bucket) in limits.iter().zip(buckets.iter_mut()) {
            let Some(quota) = quota_of(limit) else { continue };
            let Some(&(remaining, until)) = self.left.get(quota.index()) else { continue };
            if until <= now || bucket.kind == LimitKind::Slots || bucket.look_only || remaining >= bucket.capacity {
                continue;
            }
            let size = remaining.max(bucket.cost).max(1);
            if size >= bucket.capacity {
                continue;
            }
            if bucket.kind == LimitKind::TokenBucket {
                let window = u128::from(bucket.window_ms) * u128::from(size) / u128::from(bucket.capacity.max(1));
                bucket.window_ms = u64::try_from(window).unwrap_or(u64::MAX).max(1);
            }
            bucket.capacity = size;
            lowered = true;
        }
        lowered
    }

    /// Whether nothing in it holds any more at `now`: its slot may go to another key.
    fn spent(&self, now: u64) -> bool {
        self.out_until_ms <= now && self.probe_until_ms <= now && self.left.iter().all(|&(_, until)| until <= now)
    }

    fn report(&self, key: u64) -> ProviderReport {
        ProviderReport {
            key: key_hex(key),
            said_ms: self.said_ms,
            out_until_ms: self.out_until_ms,
            refused: self.refused,
            probing: self.probe == Probe::Taken,
            left: self.left.iter().map(|&(r, u)| [r, u]).collect(),
        }
    }

    /// This state with the fleet's `entry` taken in at `now`: its figures if they are
    /// later news, and who probes.
    fn with_fleet(self, entry: &ProviderEntry, now: u64) -> ProviderState {
        let mut next = self;
        if entry.said_ms > self.said_ms {
            next.said_ms = entry.said_ms;
            next.out_until_ms = entry.out_until_ms;
            next.refused = entry.refused;
            for (kept, said) in next.left.iter_mut().zip(&entry.left) {
                *kept = (said[0], said[1]);
            }
            if next.out_until_ms == 0 {
                (next.probe, next.probe_until_ms) = (Probe::Anyone, 0);
            }
        }
        let probing_here = next.probe == Probe::Taken && next.probe_until_ms > now;
        match entry.probe {
            ProbeBy::You if !probing_here => (next.probe, next.probe_until_ms) = (Probe::Mine, entry.probe_until_ms),
            ProbeBy::Another if !probing_here => {
                (next.probe, next.probe_until_ms) = (Probe::Another, entry.probe_until_ms)
            }
            ProbeBy::Nobody if next.refused && next.out_until_ms > now && !probing_here => {
                (next.probe, next.probe_until_ms) =
                    (Probe::AwaitFleet, next.out_until_ms.saturating_add(AWAIT_FLEET_MS))
            }
            _ => {}
        }
        next
    }
}

/// The provider quota a limit counts, if any.
pub fn quota_of(limit: &Limit) -> Option<Quota> {
    match limit.measure {
        Measure::Requests(_) => Some(Quota::Requests),
        Measure::Tokens { count: TokenCount::Total, .. } => Some(Quota::Tokens),
        Measure::Tokens { count: TokenCount::Input, .. } => Some(Quota::InputTokens),
        Measure::Tokens { count: TokenCount::Output, .. } => Some(Quota::OutputTokens),
        Measure::Tokens { count: TokenCount::CachedInput, .. } | Measure::Usd { .. } | Measure::Concurrency(_) => None,
    }
}

/// The key of (upstream credential id, model): a keyed hash no client can steer to
/// another key's slot, the same on every proxy of a fleet (the key derives from the
/// companion token and the domain).
/// The key of what the provider said for `credential` and `model` on the primary route,
/// or on the fallback `backend` a request overflowed to (another provider, or another
/// account of it: its word is its own).
pub fn key_of(config: &Policy, credential: &str, backend: Option<&str>, model: &str) -> u64 {
    match backend {
        None => keyed_hash(config.memory.slot_key, &[credential, model, "provider"]),
        Some(backend) => keyed_hash(config.memory.slot_key, &[credential, model, "provider", backend]),
    }
}

fn key_hex(key: u64) -> String {
    format!("{key:016x}")
}

/// The shared-data key of the slot `key` (the pair's hash) sits at.
fn shared_key(config: &Policy, key: u64) -> String {
    let slots = u64::from(config.provider_limits.slots.max(1));
    keys::provider_key(&config.domain, (key % slots) as u32)
}

/// The state of `key` in its slot, if the slot holds it.
fn own(stored: Option<&[u8]>, key: u64) -> Option<ProviderState> {
    let (owner, state) = stored?.split_at_checked(8)?;
    (owner == key.to_le_bytes()).then(|| ProviderState::from_bytes(state)).flatten()
}

/// Whether `key` may take a slot that `stored` holds: it is free, `key`'s, or its
/// occupant holds nothing any more (or nothing that refuses, and `key` would).
fn may_take(stored: Option<&[u8]>, key: u64, now: u64, refusing: bool) -> bool {
    let Some((owner, state)) = stored.and_then(|s| s.split_at_checked(8)) else { return true };
    owner == key.to_le_bytes()
        || ProviderState::from_bytes(state).is_none_or(|s| s.spent(now) || (refusing && s.out_until_ms <= now))
}

fn encode(key: u64, state: ProviderState) -> Vec<u8> {
    let mut value = key.to_le_bytes().to_vec();
    value.extend_from_slice(&state.to_bytes());
    value
}

/// What `key`'s state means at `now` for a request needing `needs`, taking the probe in
/// shared data when it is the request's (one request of all the workers takes it).
/// Also the state, for lowering the request's limits.
pub fn judge(
    host: &mut impl Host,
    config: &Policy,
    key: u64,
    now: u64,
    needs: [u64; QUOTAS],
) -> (Judgement, Option<ProviderState>) {
    let slot = shared_key(config, key);
    let Some(state) = own(shared_read(host, &slot).as_deref(), key) else { return (Judgement::Forward, None) };
    if !matches!(state.judge(now, needs).0, Judgement::Probe) {
        return (state.judge(now, needs).0, Some(state));
    }
    let taken = shared_update(host, &slot, |stored| match own(stored, key).map(|s| s.judge(now, needs)) {
        Some((Judgement::Probe, Some(taken))) => (Some(encode(key, taken)), (Judgement::Probe, Some(taken))),
        Some((judgement, _)) => (None, (judgement, own(stored, key))),
        None => (None, (Judgement::Forward, None)),
    });
    // The write refused by the host: nobody else took the probe through shared data.
    taken.unwrap_or((Judgement::Forward, Some(state)))
}

/// Takes in `word`, said on the reply of a request sent at `sent_ms`: the new state, if
/// it changed what is kept.
pub fn hear(
    host: &mut impl Host,
    config: &Policy,
    key: u64,
    word: &ProviderWord,
    sent_ms: u64,
) -> Option<ProviderState> {
    let now = host.now_ms();
    let refusing = word.out_for_ms(config.provider_limits.default_retry_ms).is_some();
    shared_update(host, &shared_key(config, key), |stored| {
        if !may_take(stored, key, now, refusing) {
            return (None, None);
        }
        match own(stored, key).unwrap_or_default().hear(word, sent_ms, now, &config.provider_limits) {
            Some(next) => (Some(encode(key, next)), Some(next)),
            None => (None, None),
        }
    })
    .flatten()
}

/// One worker's side of the fleet's exchange of provider words.
#[derive(Debug, Default)]
pub struct VmProviderWords {
    /// What this worker heard since its last exchange, by key (bounded by
    /// `MAX_PROVIDER_REPORTS`: beyond it, news of new keys waits for the next exchange's
    /// room, and what the fleet says of them meanwhile stands).
    outbox: BTreeMap<u64, ProviderReport>,
    pace: crate::effects::exchange::ExchangePace,
    /// This proxy's id in the fleet (read or made at the first exchange).
    proxy: Option<String>,
}

impl VmProviderWords {
    /// Keeps `state` of `key` for the next exchange.
    pub fn note(&mut self, config: &Policy, key: u64, state: ProviderState) {
        if !config.provider_limits.share
            || (self.outbox.len() >= MAX_PROVIDER_REPORTS && !self.outbox.contains_key(&key))
        {
            return;
        }
        self.outbox.insert(key, state.report(key));
    }

    /// The exchange to send now, if one is due.
    pub fn exchange(&mut self, host: &mut impl Host, config: &Policy, now: u64) -> Option<ProviderExchange> {
        let settings = &config.provider_limits;
        let every = if self.outbox.is_empty() { IDLE_EXCHANGE_MS } else { EXCHANGE_MS };
        if !settings.enabled || !settings.share || !self.pace.due(now, every) {
            return None;
        }
        let proxy = match &self.proxy {
            Some(proxy) => proxy.clone(),
            None => {
                let proxy = proxy_id(host, config)?;
                self.proxy = Some(proxy.clone());
                proxy
            }
        };
        let reports = std::mem::take(&mut self.outbox).into_values().collect();
        Some(ProviderExchange { domain: config.domain.clone(), proxy, reports })
    }

    pub fn sent(&mut self, token: u32) {
        self.pace.sent(token);
    }

    /// Whether callout `token` is the exchange out; it is no longer out after this.
    pub fn is_exchange(&mut self, token: u32) -> bool {
        self.pace.is_reply(token)
    }

    /// Takes what the fleet heard into this proxy's table.
    pub fn take_reply(&mut self, host: &mut impl Host, config: &Policy, reply: &ProviderReply, now: u64) {
        for entry in reply.entries.iter().take(crate::protocol::MAX_PROVIDER_ENTRIES) {
            if !is_provider_key(&entry.key) || entry.left.len() != QUOTAS {
                continue;
            }
            let Ok(key) = u64::from_str_radix(&entry.key, 16) else { continue };
            let refusing = entry.out_until_ms > now;
            let changed = shared_update(host, &shared_key(config, key), |stored| {
                if !may_take(stored, key, now, refusing) {
                    return (None, false);
                }
                let before = own(stored, key);
                let next = before.unwrap_or_default().with_fleet(entry, now);
                let changed = Some(next) != before;
                (changed.then(|| encode(key, next)), changed)
            });
            if changed == Some(true) {
                host.add_metric(Metric::ProviderFleetWords, 1);
            }
        }
    }
}

/// This proxy's id: 16 hex digits, made once by the first worker to ask (from the clock's
/// nanoseconds and the domain), read by the others.
fn proxy_id(host: &mut impl Host, config: &Policy) -> Option<String> {
    let key = keys::proxy_id_key(&config.domain);
    let made = format!("{:016x}", keyed_hash(config.memory.slot_key, &[&host.now_nanos().to_string(), "proxy"]));
    shared_update(host, &key, |stored| match stored.and_then(|s| std::str::from_utf8(s).ok()) {
        Some(id) if is_provider_key(id) => (None, id.to_string()),
        _ => (Some(made.clone().into_bytes()), made.clone()),
    })
}

#[cfg(test)]
#[path = "provider_lifecycle_tests.rs"]
mod lifecycle_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::effects::provider_word::Left;

    fn settings(share: bool) -> ProviderLimits {
        ProviderLimits {
            enabled: true,
            share,
            default_retry_ms: 1_000,
            max_retry_ms: 300_000,
            lower_limits: true,
            slots: 64,
            overflow: None,
        }
    }

    fn refusal(retry_ms: u64) -> ProviderWord {
        ProviderWord { refused: true, retry_after_ms: Some(retry_ms), ..ProviderWord::default() }
    }

    #[test]
    fn a_refusal_holds_until_its_retry_time_then_one_probe_goes() {
        let state = ProviderState::default().hear(&refusal(5_000), 1_000, 1_100, &settings(false)).expect("news");
        assert_eq!(state.judge(1_200, [1, 0, 0, 0]).0, Judgement::Refuse { wait_ms: 4_900, quota: None });
        let (judgement, taken) = state.judge(6_100, [1, 0, 0, 0]);
        assert_eq!(judgement, Judgement::Probe, "the retry time has passed: one probe");
        let taken = taken.expect("taken");
        assert_eq!(taken.judge(6_200, [1, 0, 0, 0]).0, Judgement::Refuse { wait_ms: PROBE_WAIT_MS, quota: None });
        // The probe's reply: the provider serves again.
        let back = taken.hear(&ProviderWord::default(), 6_100, 6_400, &settings(false)).expect("news");
        assert_eq!(back.judge(6_500, [1, 0, 0, 0]).0, Judgement::Forward);
        // A reply to a request sent before the refusal is older news.
        assert_eq!(state.hear(&ProviderWord::default(), 900, 1_300, &settings(false)), None);
    }

    #[test]
    fn a_spent_quota_refuses_until_its_reset_and_a_request_larger_than_whats_left() {
        let mut word = ProviderWord::default();
        word.left[0] = Some(Left { remaining: 0, reset_after_ms: 2_000 });
        word.left[1] = Some(Left { remaining: 500, reset_after_ms: 60_000 });
        let state = ProviderState::default().hear(&word, 0, 0, &settings(true)).expect("news");
        assert_eq!(state.judge(1_000, [1, 10, 0, 0]).0, Judgement::Refuse { wait_ms: 1_000, quota: None });
        assert_eq!(
            state.judge(2_000, [1, 10, 0, 0]).0,
            Judgement::Forward,
            "no probe after a reset: the quota is whole"
        );
        assert_eq!(
            state.judge(2_000, [1, 600, 0, 0]).0,
            Judgement::Refuse { wait_ms: 58_000, quota: Some(Quota::Tokens) }
        );
    }

    #[test]
    fn the_fleet_gives_the_probe_to_one_proxy() {
        let heard = ProviderState::default().hear(&refusal(5_000), 0, 0, &settings(true)).expect("news");
        assert_eq!(heard.probe, Probe::AwaitFleet);
        // Past the retry time, the fleet has not said: wait for it, briefly.
        assert!(matches!(heard.judge(5_500, [1, 0, 0, 0]).0, Judgement::Refuse { .. }));
        let entry = |probe| ProviderEntry {
            key: key_hex(7),
            said_ms: 0,
            out_until_ms: 5_000,
            refused: true,
            probe,
            probe_until_ms: 15_000,
            left: vec![[0, 0]; QUOTAS],
        };
        let other = heard.with_fleet(&entry(ProbeBy::Another), 5_600);
        assert!(matches!(other.judge(5_700, [1, 0, 0, 0]).0, Judgement::Refuse { .. }), "another proxy probes");
        let mine = heard.with_fleet(&entry(ProbeBy::You), 5_600);
        assert_eq!(mine.judge(5_700, [1, 0, 0, 0]).0, Judgement::Probe);
        // Without the fleet's word for long, the proxy probes by itself.
        assert_eq!(heard.judge(5_000 + AWAIT_FLEET_MS, [1, 0, 0, 0]).0, Judgement::Probe);
    }

    #[test]
    fn limits_are_lowered_to_whats_left_never_raised() {
        let config = Policy::from_json(
            br#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [
                {"name": "rpm", "requests": 100, "window": "1m"},
                {"name": "tpm", "tokens": 10000, "window": "1m"},
                {"name": "otpm", "tokens": 10000, "count": "output", "window": "1m", "algorithm": "sliding_window"}]}"#,
        )
        .expect("config");
        let bucket = |name: &str, capacity, kind| LimitCharge {
            name: name.into(),
            capacity,
            window_ms: 60_000,
            cost: 10,
            min_cost: None,
            kind,
            period_bounds_ms: Vec::new(),
            provisional: false,
            look_only: false,
            shadow: false,
            owner: None,
            fair: None,
        };
        let mut buckets = vec![
            bucket("rpm", 100, LimitKind::TokenBucket),
            bucket("tpm", 10_000, LimitKind::TokenBucket),
            bucket("otpm", 10_000, LimitKind::SlidingWindow),
        ];
        let mut state = ProviderState::default();
        state.left[0] = (500, 10_000); // more than configured: stays
        state.left[1] = (2_500, 10_000);
        state.left[3] = (1_000, 10_000);
        assert!(state.lower(&config.limits, &mut buckets, 0));
        assert_eq!((buckets[0].capacity, buckets[0].window_ms), (100, 60_000));
        assert_eq!((buckets[1].capacity, buckets[1].window_ms), (2_500, 15_000), "the refill rate kept");
        assert_eq!((buckets[2].capacity, buckets[2].window_ms), (1_000, 60_000), "a sliding window keeps its window");
        let mut fresh = vec![bucket("rpm", 100, LimitKind::TokenBucket), bucket("tpm", 10_000, LimitKind::TokenBucket)];
        assert!(!state.lower(&config.limits, &mut fresh, 10_000), "past the provider's reset: as configured");
    }

    #[test]
    fn state_round_trips_and_short_bytes_read_as_nothing() {
        let mut state = ProviderState::default().hear(&refusal(5_000), 3, 4, &settings(true)).expect("news");
        state.left[2] = (9, 99);
        assert_eq!(ProviderState::from_bytes(&state.to_bytes()), Some(state));
        assert_eq!(ProviderState::from_bytes(&state.to_bytes()[..BYTES - 1]), None);
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            /// Whatever the provider says, the state keeps no wait beyond `max_retry`.
            #[test]
            fn what_is_kept_is_bounded(retry in proptest::option::of(any::<u64>()), reset in any::<u64>(), remaining in any::<u64>(), now in 0u64..1u64 << 50) {
                let mut word = ProviderWord { refused: retry.is_some(), retry_after_ms: retry, ..ProviderWord::default() };
                word.left[1] = Some(crate::effects::provider_word::Left { remaining, reset_after_ms: reset });
                let config = ProviderLimits { enabled: true, share: true, default_retry_ms: 1000, max_retry_ms: 300_000, lower_limits: true, slots: 64, overflow: None };
                let state = ProviderState::default().hear(&word, now, now, &config).expect("news");
                prop_assert!(state.out_until_ms <= now + 300_000);
                prop_assert!(state.left.iter().all(|&(_, until)| until <= now + 300_000));
                prop_assert_eq!(ProviderState::from_bytes(&state.to_bytes()), Some(state));
            }

            #[test]
            fn any_bytes_decode_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
                let _ = ProviderState::from_bytes(&bytes);
                let _ = own(Some(&bytes), 1);
                let _ = may_take(Some(&bytes), 1, 5, true);
            }
        }
    }
}
