//! The local limiter: every limit of a tenant (or of a shared pool) counted exactly in this
//! proxy's shared data, across its workers, with the math of the Lua script as
//! `counters.rs` models it (token buckets, sliding windows as the log of what each call
//! took, concurrency slots as their holders with the time each expires). Its two users:
//! the local store (`"store": "local"`, `lifecycle/store.rs`), which keeps every limit
//! here, and the degraded mode (`failure_mode: "local"`, `lifecycle/degraded.rs`), which
//! keeps each limit's share of the proxy here while the companion is away.
//!
//! An entry is one of the bounded tenant table's (`tables.rs`, `TenantTable::Local`), so a
//! decision over all of its limits is one compare-and-swap, and memory is the table's size
//! whatever the clients invent. After the table's 33-byte tenant id and the shared value's
//! 8-byte fingerprint: a format byte, the time it was last charged or refused (8 bytes,
//! ms: the degraded mode replaces the least recently used entry), then per limit its kind
//! (1 byte), how many entries follow (2 bytes) and 16 bytes per entry: a bucket's level
//! and time (at most 1 entry), a window's (time, amount) pairs (at most
//! `memory.local_entries`), a slot's holder and expiry (at most the limit's capacity).
//!
//! What the companion keeps in a reservation record the request keeps itself here: the
//! time of its charge (where a window's correction goes) and its slots' holder.

use crate::accounting::counters::{self, Counter};
use crate::config::{Policy, Store};
use crate::effects::host::{shared_update, Host};
use crate::effects::tables::{fnv1a, update_own, update_own_or_oldest, Busy, TenantTable, ENTRY_ROOM};
use crate::protocol::{LimitCharge, LimitKind, LimitsReply};
use std::collections::BTreeMap;

/// The first byte of an entry; an entry of another format reads as fresh counters.
const FORMAT: u8 = 0x4d;
/// The format before the time of use was kept (the local store's until issue 46): read
/// as used at time 0.
const FORMAT_WITHOUT_USE: u8 = 0x4c;
const KIND_BUCKET: u8 = 1;
const KIND_WINDOW: u8 = 2;
const KIND_SLOTS: u8 = 3;
/// Bytes of one entry of a counter.
pub const ENTRY_BYTES: usize = 16;
/// Bytes of a counter before its entries.
pub const COUNTER_HEADER_BYTES: usize = 3;
/// Bytes of an entry's own header: its format and when it was last used.
pub const HEADER_BYTES: usize = 1 + 8;

/// The holder of a request's slots, as its entry names it: a hash of its reservation id.
pub fn holder(reservation: &str) -> String {
    format!("{:016x}", fnv1a(&[reservation]))
}

/// An entry's counters, and when it was last charged or refused (ms).
struct Counted {
    used_ms: u64,
    counters: Vec<Counter>,
}

/// Pairs a counter stores at most (its count is 2 bytes).
const MOST_PAIRS: usize = u16::MAX as usize;

fn encode(counted: &Counted) -> Vec<u8> {
    // Sized once: an entry is written on every charge and every settlement.
    let pairs_at_most = |counter: &Counter| match counter {
        Counter::Bucket(state) => usize::from(state.is_some()),
        Counter::Window(entries) => entries.len().min(MOST_PAIRS),
        Counter::Slots(held) => held.len().min(MOST_PAIRS),
    };
    let counters = &counted.counters;
    let size = ENTRY_ROOM
        + HEADER_BYTES
        + counters.iter().map(|c| COUNTER_HEADER_BYTES + pairs_at_most(c) * ENTRY_BYTES).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.push(FORMAT);
    out.extend_from_slice(&counted.used_ms.to_le_bytes());
    for counter in counters {
        out.push(match counter.kind() {
            LimitKind::TokenBucket | LimitKind::Calendar => KIND_BUCKET,
            LimitKind::SlidingWindow => KIND_WINDOW,
            LimitKind::Slots => KIND_SLOTS,
        });
        let count_at = out.len();
        out.extend_from_slice(&[0, 0]);
        let mut count = 0usize;
        let mut put = |first: u64, second: f64| {
            if count < MOST_PAIRS {
                out.extend_from_slice(&first.to_le_bytes());
                out.extend_from_slice(&second.to_le_bytes());
                count += 1;
            }
        };
        match counter {
            Counter::Bucket(None) => {}
            Counter::Bucket(Some(state)) => put(state.tokens.to_bits(), state.updated_ms),
            Counter::Window(entries) => entries.iter().for_each(|&(at, amount)| put(at.to_bits(), amount)),
            Counter::Slots(held) => held
                .iter()
                .filter_map(|(holder, &expiry)| u64::from_str_radix(holder, 16).ok().map(|h| (h, expiry)))
                .for_each(|(h, expiry)| put(h, expiry)),
        }
        if let Some(field) = out.get_mut(count_at..count_at + 2) {
            field.copy_from_slice(&(count as u16).to_le_bytes());
        }
    }
    out
}

/// The counters of `specs` as stored; a payload of another shape (other limits, another
/// format, cut short) reads as fresh counters, never used.
fn decode(payload: Option<&[u8]>, specs: &[LimitCharge]) -> Counted {
    let fresh = || Counted { used_ms: 0, counters: specs.iter().map(|spec| Counter::new(spec.kind)).collect() };
    payload.and_then(|bytes| decode_exactly(bytes, specs)).unwrap_or_else(fresh)
}

fn decode_exactly(bytes: &[u8], specs: &[LimitCharge]) -> Option<Counted> {
    let (&format, rest) = bytes.split_first()?;
    let (used_ms, mut rest) = match format {
        FORMAT => {
            let (used, rest) = rest.split_at_checked(8)?;
            (u64::from_le_bytes(used.try_into().ok()?), rest)
        }
        FORMAT_WITHOUT_USE => (0, rest),
        _ => return None,
    };
    let mut counters = Vec::with_capacity(specs.len());
    for spec in specs {
        let (header, after) = rest.split_at_checked(COUNTER_HEADER_BYTES)?;
        let (&kind, count) = header.split_first()?;
        let count = usize::from(u16::from_le_bytes(count.try_into().ok()?));
        let (entries, after) = after.split_at_checked(count * ENTRY_BYTES)?;
        rest = after;
        // Read in place: a bucket (most limits) keeps no list of its one pair.
        let mut pairs = entries.chunks_exact(ENTRY_BYTES).map(|chunk| {
            let (first, second) = chunk.split_at(8);
            let word = |bytes: &[u8]| <[u8; 8]>::try_from(bytes).unwrap_or_default();
            (u64::from_le_bytes(word(first)), f64::from_le_bytes(word(second)))
        });
        let counter = match (kind, spec.kind) {
            (KIND_BUCKET, LimitKind::TokenBucket | LimitKind::Calendar) => {
                Counter::Bucket(pairs.next().map(|(tokens, updated_ms)| crate::accounting::bucket::BucketState {
                    tokens: f64::from_bits(tokens),
                    updated_ms,
                }))
            }
            (KIND_WINDOW, LimitKind::SlidingWindow) => {
                Counter::Window(pairs.map(|(at, amount)| (f64::from_bits(at), amount)).collect())
            }
            (KIND_SLOTS, LimitKind::Slots) => Counter::Slots(
                pairs.map(|(holder, expiry)| (format!("{holder:016x}"), expiry)).collect::<BTreeMap<_, _>>(),
            ),
            _ => return None,
        };
        let finite = match &counter {
            Counter::Bucket(state) => state.is_none_or(|s| s.tokens.is_finite() && s.updated_ms.is_finite()),
            Counter::Window(entries) => entries.iter().all(|(at, amount)| at.is_finite() && amount.is_finite()),
            Counter::Slots(held) => held.values().all(|expiry| expiry.is_finite()),
        };
        if !finite {
            return None;
        }
        counters.push(counter);
    }
    rest.is_empty().then_some(Counted { used_ms, counters })
}

/// The most entries a limit's counter keeps: a bucket 1, a window `memory.local_entries`
/// (see `Counter::bound`), slots the capacity (what the local store allows, and the
/// degraded mode's share of it: the limit over `fallback.instances`).
fn entries_at_most(config: &Policy, limit: &crate::config::Limit) -> usize {
    match limit.kind {
        LimitKind::TokenBucket | LimitKind::Calendar => 1,
        LimitKind::SlidingWindow => config.memory.local_entries as usize,
        LimitKind::Slots if config.store == Store::Local => limit.capacity() as usize,
        LimitKind::Slots => limit.capacity().div_ceil(u64::from(config.fallback.instances.max(1))) as usize,
    }
}

/// Bytes of an entry at most, for the config's limits: what `memory.tenant_slots` entries
/// cost (the sizing of Nginx's `shm_kv` in docs/getting-started.md#what-is-kept-and-how
/// and docs/nginx.md comes from this).
pub fn entry_bytes_at_most(config: &Policy) -> usize {
    let counters: usize = config
        .limits
        .iter()
        .map(|limit| COUNTER_HEADER_BYTES + entries_at_most(config, limit).min(usize::from(u16::MAX)) * ENTRY_BYTES)
        .sum();
    crate::effects::host::FINGERPRINT_BYTES + crate::effects::tables::TENANT_BYTES + HEADER_BYTES + counters
}

/// Whether another tenant's entry may be replaced: only once none of its counters holds
/// anything (else the newcomer would hand its owner a fresh budget).
fn idle(payload: &[u8], specs: &[LimitCharge], now: f64) -> bool {
    let counted = decode(Some(payload), specs);
    counted.counters.iter().zip(specs).all(|(counter, spec)| counter.is_idle(spec, now))
}

/// When an entry holding no live slot was last used (`None`: it holds one, and stays).
fn used_unless_holding(payload: &[u8], specs: &[LimitCharge], now: f64) -> Option<u64> {
    let counted = decode(Some(payload), specs);
    let holds_slot = counted.counters.iter().any(|counter| match counter {
        Counter::Slots(held) => held.values().any(|&expiry| expiry > now),
        _ => false,
    });
    (!holds_slot).then_some(counted.used_ms)
}

fn bounded(mut counted: Counted, config: &Policy) -> Vec<u8> {
    for counter in &mut counted.counters {
        counter.bound(config.memory.local_entries as usize);
    }
    encode(&counted)
}

/// Whose entry a newcomer may take when none of its slots of the table is free.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// Only an idle one (see [`idle`]): refused otherwise (`Busy`). The local store, whose
    /// counters are the only ones: replacing a live entry would hand its owner a fresh
    /// budget.
    IdleOnly,
    /// Failing an idle one, the least recently used one holding no live slot, so that an
    /// outage never refuses a newcomer service because the table remembers older tenants
    /// (a day's limit keeps every entry for a day): the degraded mode, whose admissions
    /// Redis learns of all the same; only the replaced tenant's local share starts afresh.
    /// A refusal counts as a use: a tenant refused here is still in use, so its spent
    /// entry is never the least recently used.
    OrLeastRecentlyUsed,
}

/// Charges `entry`'s limits (`specs`, this request's costs; a tenant's entry or a pool's)
/// all or none at `now_ms`; `holder` names the slots it takes. `Err(Busy)` when the
/// entry found no room (see [`Room`]); `None` when the host refused the write.
pub fn charge(
    host: &mut impl Host,
    config: &Policy,
    entry: &str,
    specs: &[LimitCharge],
    holder: &str,
    now_ms: u64,
    room: Room,
) -> Option<Result<LimitsReply, Busy>> {
    let now = now_ms as f64;
    let evictable = |payload: &[u8]| idle(payload, specs, now);
    let change = |payload: Option<&[u8]>| {
        let mut counted = decode(payload, specs);
        let reply = counters::charge(&mut counted.counters, specs, Some(holder), now);
        // A newcomer refused takes no place; a refused tenant's entry is in use all the
        // same where the least recently used one may be replaced.
        let write = reply.allowed || (room == Room::OrLeastRecentlyUsed && payload.is_some());
        counted.used_ms = now_ms;
        (write.then(|| bounded(counted, config)), reply)
    };
    match room {
        Room::IdleOnly => update_own(host, config, TenantTable::Local, entry, evictable, change),
        Room::OrLeastRecentlyUsed => {
            let left = |payload: &[u8]| used_unless_holding(payload, specs, now);
            update_own_or_oldest(host, config, TenantTable::Local, entry, evictable, left, change)
        }
    }
}

/// Settles a request charged at `charged_at_ms`: `credits` (by limit index; negative: a
/// further debit) go back to `entry`'s counters, and the slots `holder` took are released.
pub fn settle(
    host: &mut impl Host,
    config: &Policy,
    entry: &str,
    specs: &[LimitCharge],
    credits: &[(usize, i64)],
    charged_at_ms: u64,
    holder: &str,
) {
    update_existing(host, config, entry, specs, |counters, now| {
        for &(i, credit) in credits.iter().filter(|(_, credit)| *credit != 0) {
            if let (Some(counter), Some(spec)) = (counters.get_mut(i), specs.get(i)) {
                counter.give_back(credit, charged_at_ms as f64, spec, now);
            }
        }
        counters.iter_mut().for_each(|counter| counter.release(holder));
    });
}

/// Renews the slots `holder` holds in `entry` (its request is still in flight), so a
/// stream longer than `slots.ttl` keeps them while a crashed worker's expire. `specs`: the
/// config's limits.
pub fn touch(host: &mut impl Host, config: &Policy, entry: &str, specs: &[LimitCharge], holder: &str) {
    update_existing(host, config, entry, specs, |counters, now| {
        for (counter, spec) in counters.iter_mut().zip(specs) {
            counter.touch(holder, spec, now);
        }
    });
}

/// Changes `entry`'s counters where it is in the table; an entry replaced meanwhile holds
/// nothing of the request's, so then nothing is written. Its time of use stays.
fn update_existing(
    host: &mut impl Host,
    config: &Policy,
    entry: &str,
    specs: &[LimitCharge],
    mut change: impl FnMut(&mut [Counter], f64),
) {
    let now = host.now_ms() as f64;
    update_own(
        host,
        config,
        TenantTable::Local,
        entry,
        |_| false,
        |payload| {
            let Some(payload) = payload else { return (None, ()) };
            let mut counted = decode(Some(payload), specs);
            change(&mut counted.counters, now);
            (Some(bounded(counted, config)), ())
        },
    );
}

/// The local store's `memory.slot_key`, the key of the tables' slot hash. There is no companion token to derive
/// it from, so the first worker to start draws one from its clock (`now_nanos`; no client
/// knows the proxy's start to the nanosecond) and every worker of the proxy takes that one
/// from shared data (which outlives a config reload; a restart draws another).
pub fn slot_key(host: &mut impl Host, domain: &str) -> [u64; 2] {
    let nanos = host.now_nanos().to_string();
    let drawn = [fnv1a(&[&nanos, domain]), fnv1a(&[domain, &nanos]).rotate_left(29) ^ fnv1a(&[&nanos])];
    let key = crate::protocol::keys::local_secret_key(domain);
    let taken = shared_update(host, &key, |stored| match stored.and_then(|b| <[u8; 16]>::try_from(b).ok()) {
        Some(bytes) => (None, bytes),
        None => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&drawn[0].to_le_bytes());
            bytes[8..].copy_from_slice(&drawn[1].to_le_bytes());
            (Some(bytes.to_vec()), bytes)
        }
    });
    // A write the host refused: this worker's own draw (its slots then differ from the
    // others' until the next config, which the refusal's metric and log say).
    let Some(bytes) = taken else { return drawn };
    let (low, high) = bytes.split_at(8);
    [u64::from_le_bytes(low.try_into().unwrap_or_default()), u64::from_le_bytes(high.try_into().unwrap_or_default())]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accounting::bucket::BucketState;
    use crate::testing::spec;

    #[test]
    fn counters_read_back_as_written_each_kind_and_at_their_bound() {
        let specs = [
            spec("a", 10, 60_000, 1, None, LimitKind::TokenBucket),
            spec("b", 10, 60_000, 1, None, LimitKind::TokenBucket),
            spec("c", 10, 60_000, 1, None, LimitKind::SlidingWindow),
            spec("d", 10, 60_000, 1, None, LimitKind::Slots),
            spec("e", 10, 60_000, 1, None, LimitKind::SlidingWindow),
        ];
        let held: BTreeMap<String, f64> =
            [("00000000000000ff", 5.0), ("0123456789abcdef", 7.5)].map(|(h, e)| (h.to_string(), e)).into();
        let counters = vec![
            Counter::Bucket(None),
            Counter::Bucket(Some(BucketState { tokens: 2.5, updated_ms: 1_000.0 })),
            Counter::Window(vec![(1.0, 2.0), (3.0, 4.5)]),
            Counter::Slots(held),
            // Past what a count of 2 bytes says: the newest are left out.
            Counter::Window((0..MOST_PAIRS + 3).map(|i| (i as f64, 1.0)).collect()),
        ];
        let bytes = encode(&Counted { used_ms: 42, counters: counters.clone() });
        let pairs = 1 + 2 + 2 + MOST_PAIRS;
        assert_eq!(bytes.len(), HEADER_BYTES + specs.len() * COUNTER_HEADER_BYTES + pairs * ENTRY_BYTES);
        let mut expected = counters;
        if let Some(Counter::Window(entries)) = expected.last_mut() {
            entries.truncate(MOST_PAIRS);
        }
        let read = decode(Some(&bytes), &specs);
        assert_eq!((read.used_ms, read.counters), (42, expected));
        // A holder that is not a hash of a reservation id is not kept.
        let odd = Counted { used_ms: 0, counters: vec![Counter::Slots([("not-hex".to_string(), 1.0)].into())] };
        assert_eq!(decode(Some(&encode(&odd)), &specs[3..4]).counters, [Counter::Slots(BTreeMap::new())]);
    }
}
