//! Bounded per-tenant state in shared data. Proxy-wasm shared data has no delete, so a key
//! per tenant (or per tenant and model) would grow every proxy's memory with each API key
//! or model name a client invents. Instead each table has a fixed number of slots
//! (`memory.*_slots`): a tenant's entry sits at one of [`CHOICES`] slots its id hashes to
//! (tried in order: the first free one is taken when others hold those before it) and
//! carries that id, so a colliding newcomer sees someone else's entry and never takes it
//! for its own. Memory per proxy is at most slots x entry size, whatever the traffic.
//!
//! Why eight choices: a newcomer finds no room only when every one of its slots holds a
//! live entry. With two choices the first refusal came once 2 to 6% of the slots were
//! live (a real Nginx answered its first 503 after 435 to 1,309 live tenants of 16,384
//! slots); with eight it comes near 40% (about 6,500 of 16,384; the lifecycle's tests
//! pin it). A tenant whose entry sits at its k-th slot reads k slots per step; a newcomer
//! reads all eight once.
//!
//! Who may replace whose entry is the caller's rule: a tenant's lease entry only once its
//! leases have expired and been returned; a local limiter's entry only once it counts
//! nothing (else a newcomer would hand its owner a fresh budget), except that in the
//! degraded mode a newcomer finding all its slots held takes the least recently used one
//! holding no live slot rather than be refused service (`update_own_or_oldest`, as
//! `local_limiter::Room` says). (The
//! running averages, a table of their own, are in `average_store`.)
//!
//! Slots come from a keyed hash (SipHash-2-4) whose key is derived from the companion
//! token, which clients never see: a client cannot grind credentials offline for one
//! whose slots are another tenant's (or its own, to reset its local entry).

use crate::config::Policy;
use crate::effects::host::{shared_get_read, shared_read, shared_update, shared_update_from, Host, SharedRead};
use crate::protocol::keys;

/// Tenant ids are 32 hex digits, or `anonymous`; a shared pool's lease entry is named by
/// its owner id, at most 33 characters (`plan::pools::pool_owner`). Stored padded to this
/// many bytes.
pub const TENANT_BYTES: usize = 33;

/// The per-tenant tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantTable {
    /// Leased budgets (lease mode).
    Leases,
    /// The local limiter's entries (`local_limiter`): the degraded mode's, or the local
    /// store's.
    Local,
}

impl TenantTable {
    /// The shared-data key of this table's slot `slot` (not `memory.slot_key`, the key of
    /// the hash that picks a tenant's slots).
    pub fn shared_key(self, config: &Policy, slot: u32) -> String {
        match self {
            TenantTable::Leases => keys::lease_key(&config.domain, slot),
            TenantTable::Local => keys::local_key(&config.domain, slot),
        }
    }

    /// The slots `tenant`'s entry may sit at, in the order they are tried: distinct
    /// (double hashing with a step coprime to the table's size), so a table of at least
    /// [`CHOICES`] slots gives every tenant that many places.
    pub fn slots(config: &Policy, tenant: &str) -> [u32; CHOICES] {
        let size = u64::from(config.memory.tenant_slots.max(1));
        let hash = keyed_hash(config.memory.slot_key, &[tenant]);
        let mut step = if size > 1 { 1 + (hash.rotate_left(32) ^ hash >> 7) % (size - 1) } else { 1 };
        while gcd(step, size) != 1 {
            step += 1; // ends: step = 1 (mod size) is coprime
        }
        let mut slots = [0; CHOICES];
        let mut at = hash % size;
        for slot in &mut slots {
            *slot = at as u32;
            at = (at + step) % size;
        }
        slots
    }
}

/// How many slots a tenant's entry may sit at (see the module's docs for why eight).
pub const CHOICES: usize = 8;

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// What a tenant finds in its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry<'a> {
    /// Its own state.
    Own(&'a [u8]),
    /// Nobody's.
    Vacant,
    /// Another tenant's state.
    Other { tenant: &'a str, payload: &'a [u8] },
}

/// The slot another tenant holds and may not be evicted from yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// The entry `stored` in a slot, as `tenant` sees it.
pub fn entry<'a>(stored: Option<&'a [u8]>, tenant: &str) -> Entry<'a> {
    match stored.and_then(split_entry) {
        None => Entry::Vacant,
        Some((owner, payload)) if owner == tenant => Entry::Own(payload),
        Some((owner, payload)) => Entry::Other { tenant: owner, payload },
    }
}

/// The owner and payload of a stored entry.
pub fn split_entry(stored: &[u8]) -> Option<(&str, &[u8])> {
    let (id, payload) = stored.split_at_checked(TENANT_BYTES)?;
    let id = std::str::from_utf8(id).ok()?.trim_end_matches('\0');
    (!id.is_empty()).then_some((id, payload))
}

/// Room a payload of a tenant table leaves before its bytes (`Vec::with_capacity`) for what
/// goes in front of it on its way to shared data, the tenant id and the key's
/// fingerprint: an entry written on every request is then not copied twice more.
pub const ENTRY_ROOM: usize = TENANT_BYTES + crate::effects::host::FINGERPRINT_BYTES;

fn encode_entry(tenant: &str, mut payload: Vec<u8>) -> Vec<u8> {
    let mut id = [0u8; TENANT_BYTES];
    let given = tenant.as_bytes();
    let given = given.get(..TENANT_BYTES).unwrap_or(given);
    if let Some(room) = id.get_mut(..given.len()) {
        room.copy_from_slice(given);
    }
    payload.splice(0..0, id);
    payload
}

/// `tenant`'s payload in `table`, if one of its slots holds its entry. Every slot is read
/// until its own: a free one says nothing (the entry may sit past it, written while that
/// slot was held).
pub fn read_own(host: &mut impl Host, config: &Policy, table: TenantTable, tenant: &str) -> Option<Vec<u8>> {
    TenantTable::slots(config, tenant).into_iter().find_map(|slot| {
        let stored = shared_read(host, &table.shared_key(config, slot));
        match entry(stored.as_deref(), tenant) {
            Entry::Own(payload) => Some(payload.to_vec()),
            _ => None,
        }
    })
}

/// Read-modify-write of `tenant`'s entry in `table`. `change` gets its payload (`None`:
/// it has none: the slot is free, or holds another tenant's entry that `evictable` lets
/// go) and returns the payload to write (or `None`) and a result. `Err(Busy)` when
/// another tenant's entry must stay; `None` when the host refused the write.
///
/// The entry goes to the slot holding it, else to the first free or evictable one. The
/// read that finds the slot is the one the write's CAS is based on: a tenant whose entry
/// sits at its first slot (the usual case) costs one read and one write.
pub fn update_own<R>(
    host: &mut impl Host,
    config: &Policy,
    table: TenantTable,
    tenant: &str,
    evictable: impl Fn(&[u8]) -> bool,
    change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, R),
) -> Option<Result<R, Busy>> {
    update_own_at(host, config, table, tenant, evictable, change).map(|done| done.map(|(_, result)| result))
}

/// [`update_own`], saying which slot the entry is in.
pub fn update_own_at<R>(
    host: &mut impl Host,
    config: &Policy,
    table: TenantTable,
    tenant: &str,
    evictable: impl Fn(&[u8]) -> bool,
    change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, R),
) -> Option<Result<(u32, R), Busy>> {
    update_own_choosing(host, config, table, tenant, evictable, |_| None, change)
}

/// [`update_own`] for a table that must find every tenant a place (the degraded mode,
/// where a newcomer refused a place would be refused service): when each of its slots
/// holds another tenant's entry that `evictable` keeps, the one that `left_at` says was
/// last written longest ago takes the newcomer's entry instead (`None`: never, as an
/// entry holding a concurrency slot). Its tenant's next request starts afresh.
pub fn update_own_or_oldest<R>(
    host: &mut impl Host,
    config: &Policy,
    table: TenantTable,
    tenant: &str,
    evictable: impl Fn(&[u8]) -> bool,
    left_at: impl Fn(&[u8]) -> Option<u64>,
    change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, R),
) -> Option<Result<R, Busy>> {
    update_own_choosing(host, config, table, tenant, evictable, left_at, change).map(|done| done.map(|(_, r)| r))
}

fn update_own_choosing<R>(
    host: &mut impl Host,
    config: &Policy,
    table: TenantTable,
    tenant: &str,
    evictable: impl Fn(&[u8]) -> bool,
    left_at: impl Fn(&[u8]) -> Option<u64>,
    mut change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, R),
) -> Option<Result<(u32, R), Busy>> {
    // A newcomer replacing the oldest entry may lose that slot to another worker's
    // newcomer between its read and its write: it then chooses again among fresh reads.
    for _ in 0..REPLACEMENT_ATTEMPTS {
        let mut first_usable: Option<(u32, SharedRead)> = None;
        let mut oldest: Option<(u64, u32, SharedRead)> = None;
        let mut own = None;
        for slot in TenantTable::slots(config, tenant) {
            let read = shared_get_read(host, table.shared_key(config, slot));
            match entry(read.value(), tenant) {
                Entry::Own(_) => {
                    own = Some((slot, read));
                    break;
                }
                // Not taken yet: the tenant's entry may sit at a later slot.
                Entry::Vacant => first_usable = first_usable.or(Some((slot, read))),
                Entry::Other { payload, .. } if evictable(payload) => {
                    first_usable = first_usable.or(Some((slot, read)));
                }
                Entry::Other { payload, .. } => {
                    if let Some(at) = left_at(payload).filter(|&at| oldest.as_ref().is_none_or(|(o, ..)| at < *o)) {
                        oldest = Some((at, slot, read));
                    }
                }
            }
        }
        let replacing = own.is_none() && first_usable.is_none() && oldest.is_some();
        let oldest = oldest.map(|(_, slot, read)| (slot, read));
        let Some((slot, chosen)) = own.or(first_usable).or(oldest) else { return Some(Err(Busy)) };
        let mut first_try = true;
        let done = shared_update_from(host, chosen, |stored| {
            let mine = match entry(stored, tenant) {
                Entry::Own(payload) => Some(payload),
                Entry::Vacant => None,
                Entry::Other { payload, .. } if evictable(payload) => None,
                // The entry chosen as the oldest, unless another write came first.
                Entry::Other { .. } if replacing && first_try => None,
                Entry::Other { .. } => return (None, Err(Busy)),
            };
            first_try = false;
            let (next, result) = change(mine);
            (next.map(|payload| encode_entry(tenant, payload)), Ok((slot, result)))
        });
        match done {
            Some(Err(Busy)) if replacing => continue,
            done => return done,
        }
    }
    Some(Err(Busy))
}

/// How many times a newcomer chooses an entry to replace when others' writes keep taking
/// the one it chose.
const REPLACEMENT_ATTEMPTS: usize = 4;

/// The most slots whose keys are made ahead (`make_keys`): 65,536 empty keys cost two host
/// calls each; a larger table is made by its writes.
pub const MOST_SLOTS_MADE_AHEAD: u32 = 65_536;

/// Whether the tenant tables' keys are made ahead on this host (each has
/// `memory.tenant_slots` slots). Envoy makes a key on any write
/// without a CAS, and two workers making one at once both succeed: the first writes of a
/// new tenant's entry on two workers could then lose one (a charge or a concurrency slot
/// uncounted, a lease grant parked nowhere, the marker of a lease grant out erased so that
/// a second is asked beside it). With the keys made, empty, every write carries the key's
/// CAS. ngx_wasm_module makes a key only where none is (a write without a CAS on an
/// existing key fails): nothing to do there.
pub fn made_ahead(config: &Policy, kind: crate::effects::host::HostKind) -> bool {
    kind == crate::effects::host::HostKind::Envoy && config.memory.tenant_slots <= MOST_SLOTS_MADE_AHEAD
}

/// Makes every key of `table`, empty, when a VM loads a config that writes it, where the
/// host needs it (`made_ahead`) and no VM made them yet: before the VM serves, since a
/// table is written from the first request that concerns it (the lease table's entry
/// remembers when its tenant was first seen), and a request may reach a worker a few
/// milliseconds after it loaded the config. A key is made only where none is (no CAS: an
/// existing key, empty or not, is never written), so a live entry is never touched (but a
/// first write landing between the read and the empty write would be: hence before the
/// VM serves). Its last key is made last.
pub fn make_table(host: &mut impl Host, config: &Policy, kind: crate::effects::host::HostKind, table: TenantTable) {
    if !made_ahead(config, kind) || table_made(host, config, table) {
        return;
    }
    for slot in 0..config.memory.tenant_slots.max(1) {
        let key = table.shared_key(config, slot);
        if host.shared_get(&key).1.is_none() {
            // Refused (the host's memory is full) or overwritten meanwhile: the slot is
            // then made by its first write, as it would be without this.
            let _ = host.shared_set(&key, &[], None);
        }
    }
}

/// Whether `table`'s keys are all made: its last key is. A key is there when it has a
/// CAS: Envoy reads a key made empty as no value.
pub fn table_made(host: &mut impl Host, config: &Policy, table: TenantTable) -> bool {
    let last = table.shared_key(config, config.memory.tenant_slots.max(1) - 1);
    host.shared_get(&last).1.is_some()
}

/// Read-modify-write of whatever entry slot `slot` of `table` holds: `change` gets its
/// owner and payload and returns the payload to write back (or `None`) and a result.
/// `None` when the slot is empty or the host refused the write.
pub fn update_slot<R>(
    host: &mut impl Host,
    config: &Policy,
    table: TenantTable,
    slot: u32,
    mut change: impl FnMut(&str, &[u8]) -> (Option<Vec<u8>>, R),
) -> Option<R> {
    shared_update(host, &table.shared_key(config, slot), |stored| match stored.and_then(split_entry) {
        Some((owner, payload)) => {
            let (next, result) = change(owner, payload);
            (next.map(|payload| encode_entry(owner, payload)), Some(result))
        }
        None => (None, None),
    })
    .flatten()
}

/// Counters of waiters per tenant in the queue: a fixed table, so a tenant's share of the
/// queue costs no key per tenant.
pub const QUEUED_SLOTS: u64 = 1024;

/// The slot of `tenant`'s waiter counter (tenants sharing one share its bound).
pub fn queued_slot(config: &Policy, tenant: &str) -> u32 {
    (keyed_hash(config.memory.slot_key, &[tenant, "queued"]) % QUEUED_SLOTS) as u32
}

/// SipHash-2-4 of the parts (each followed by a 0 byte) under `key`: a keyed PRF, so
/// which inputs share a slot cannot be told without the key. std's `SipHasher` is that
/// function exactly; it is deprecated only in favour of `DefaultHasher`, which takes no
/// key, and no SipHash crate is vendored here.
pub(crate) fn keyed_hash(key: [u64; 2], parts: &[&str]) -> u64 {
    use std::hash::Hasher;
    #[allow(deprecated)]
    let mut hasher = std::hash::SipHasher::new_with_keys(key[0], key[1]);
    for part in parts {
        hasher.write(part.as_bytes());
        hasher.write_u8(0);
    }
    hasher.finish()
}

/// FNV-1a over the parts, each followed by a 0 byte (so ("ab", "c") != ("a", "bc")).
pub(crate) fn fnv1a(parts: &[&str]) -> u64 {
    parts
        .iter()
        .flat_map(|p| p.bytes().chain(std::iter::once(0)))
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::slot_key;

    #[test]
    fn an_entry_says_whose_it_is() {
        let stored = encode_entry("0123456789abcdef0123456789abcdef", b"xyz".to_vec());
        assert_eq!(entry(Some(&stored), "0123456789abcdef0123456789abcdef"), Entry::Own(b"xyz"));
        assert_eq!(
            entry(Some(&stored), "anonymous"),
            Entry::Other { tenant: "0123456789abcdef0123456789abcdef", payload: b"xyz" }
        );
        assert_eq!(entry(None, "anonymous"), Entry::Vacant);
        let anonymous = encode_entry("anonymous", Vec::new());
        assert_eq!(entry(Some(&anonymous), "anonymous"), Entry::Own(b""));
        assert_eq!(entry(Some(b"short"), "anonymous"), Entry::Vacant);
    }

    #[test]
    fn slots_spread_and_stay_in_range() {
        let key = slot_key("secret", "llm");
        let mut used = std::collections::BTreeSet::new();
        for i in 0..1000 {
            let slot = keyed_hash(key, &[&format!("tenant-{i}")]) % 64;
            used.insert(slot);
        }
        assert_eq!(used.len(), 64, "1000 tenants reach every one of 64 slots");
        assert_ne!(keyed_hash(key, &["ab", "c"]), keyed_hash(key, &["a", "bc"]));
        assert_ne!(fnv1a(&["ab", "c"]), fnv1a(&["a", "bc"]));
    }

    /// Issue 26 item 9: which tenants share a slot depends on the secret key, so it cannot
    /// be worked out offline. Of 1,000 tenants, those sharing tenant-0's slot under one
    /// token are (almost) all different under another.
    #[test]
    fn which_tenants_collide_depends_on_the_secret() {
        let sharing = |token: &str| -> std::collections::BTreeSet<usize> {
            let key = slot_key(token, "llm");
            let of = |i: usize| keyed_hash(key, &[&format!("tenant-{i}")]) % 64;
            (1..1000).filter(|&i| of(i) == of(0)).collect()
        };
        let (a, b) = (sharing("token-a"), sharing("token-b"));
        assert!(a.len() > 5 && b.len() > 5, "about 1000/64 each: {} and {}", a.len(), b.len());
        assert!(a.intersection(&b).count() <= 3, "{a:?} vs {b:?}");
        assert_ne!(slot_key("t", "llm"), slot_key("t", "other"), "the domain is part of the key");
    }
}
