//! Leases across owners. A request's limits are leased from its tenant's entry in the
//! lease table and, for the limits counted in a shared pool (`limits[].per`: a header's
//! value, or `"all"`), from the pool's own entry, named by the pool's owner id: a pool
//! every request touches is then leased once per proxy, not once per tenant, and costs
//! Redis a renewal now and then instead of a round trip per request. Every entry holds a
//! lease per configured limit, in config order, and uses those of the limits its owner
//! counts (the others stay empty).
//!
//! Shared data has a compare-and-swap per key, not across keys, so a request is taken
//! from entry after entry (the tenant's first, then the pools in config order); when one
//! entry cannot cover its part, what the entries before it gave is put back. Nothing is
//! admitted that a lease does not hold, and every lease was charged in Redis when it was
//! granted; what the put-back costs is a concurrent request finding a lease short for
//! that moment (it asks Redis, or is refused), never an admission past a capacity.
//!
//! When some entries are short, the parts the others cover stay taken (held) while Redis
//! is asked for the short ones only: a hot pool's lease is not grown by every tenant's
//! renewal, and what the held parts took goes back if the grant is refused or fails.

use crate::accounting::lease::{lease_asks, LeaseEntry, LeasePolicy, TenantLeases};
use crate::config::Policy;
use crate::effects::host::Host;
use crate::effects::tables::{read_own, update_own, update_own_at, Busy, TenantTable, ENTRY_ROOM};
use crate::protocol::{LeaseAsk, LimitCharge, LimitOutcome, LimitStatus, LimitsReply};

/// One entry of the lease table a request draws from: whose it is (the tenant's id or a
/// pool's owner id) and the limits (config indices) it holds for the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub name: String,
    pub indices: Vec<usize>,
}

/// The entries a request whose limit `i` is counted by `owner(i)` (`None`: the tenant)
/// over `limits` limits draws from: the tenant's first, then each pool in config order.
pub fn holders<'a>(tenant: &str, owner: impl Fn(usize) -> Option<&'a str>, limits: usize) -> Vec<Holder> {
    let mut holders = vec![Holder { name: tenant.to_string(), indices: Vec::with_capacity(limits) }];
    for i in 0..limits {
        let name = owner(i).unwrap_or(tenant);
        match holders.iter_mut().find(|h| h.name == name) {
            Some(holder) => holder.indices.push(i),
            None => holders.push(Holder { name: name.to_string(), indices: vec![i] }),
        }
    }
    holders.retain(|h| !h.indices.is_empty());
    holders
}

/// What the lease table says about a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Taken {
    /// Every entry covered its part, which is taken. `renew`: the entries that ran low
    /// and are now marked as renewing (the caller asks for them); `leases`: each limit's
    /// lease after the take, from its entry, for headers; `slots`: where the entries sit.
    Admitted { renew: Vec<Holder>, leases: TenantLeases, slots: Vec<u32> },
    /// An entry remembers Redis refusing as much, until its retry time: this reply.
    Refused(LimitsReply),
    /// Some entries are short: ask Redis for a lease covering their part. The others'
    /// parts are taken and held meanwhile (kept once the grant comes, else put back).
    Ask(Hold),
    /// Charge the request directly: an entry was seen for the first time (a one-off
    /// tenant or pool costs no lease), another's entry holds its slot, or a write was
    /// refused.
    Direct,
    /// This entry ran dry while a grant for it is out (a renewal, or another request's
    /// ask): wait for it rather than ask Redis too. Nothing is taken meanwhile.
    Await(String),
}

/// What a take does with an entry that ran dry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DryOut {
    /// Every request that finds it dry asks Redis: the host cannot resume one request from
    /// another's callback (ngx_wasm_module), so none could wait for another's grant.
    AskEach,
    /// One request asks and marks the entry; while that grant is out the others wait for
    /// it, then take again (`may_wait`: this request is within its bound on waiting; past
    /// it, it asks for itself even while a grant is out).
    Coalesce { may_wait: bool },
}

/// A request's take while it asks Redis for what its short entries lack.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Hold {
    /// Entries whose part is taken.
    pub held: Vec<Holder>,
    /// Entries to ask a grant for.
    pub short: Vec<Holder>,
    /// The held entries' leases after the take.
    pub leases: TenantLeases,
    /// Held entries that ran low and are marked as renewing.
    pub renew: Vec<Holder>,
    /// Where the held entries sit.
    pub slots: Vec<u32>,
    /// Short entries this request marked as asked for: their marker is lifted when its
    /// grant answers (or it ends unanswered), and whoever waits for them takes again.
    pub marked: Vec<Holder>,
}

/// What a grant merged into the lease table did.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Merged {
    /// Each limit's lease after the grant.
    pub leases: TenantLeases,
    /// The holders whose entry could not take it (another's entry holds the slot, or the
    /// write was refused): their grant is the caller's to give back.
    pub refused: Vec<Holder>,
    /// Where the entries that took it sit.
    pub slots: Vec<u32>,
}

/// One entry's part of a take.
enum Part {
    Took {
        low: bool,
        leases: TenantLeases,
    },
    Blocked,
    /// `marked`: this request marked the entry as asked for (it asks for the others).
    Short {
        marked: bool,
    },
    /// Dry, and a grant for it is out.
    Awaits,
    FirstSeen,
}

/// `costs` with every limit but `indices` at zero.
fn masked(costs: &[u64], indices: &[usize]) -> Vec<u64> {
    costs.iter().enumerate().map(|(i, &c)| if indices.contains(&i) { c } else { 0 }).collect()
}

fn evictable(limits: usize, now: u64) -> impl Fn(&[u8]) -> bool {
    move |payload: &[u8]| LeaseEntry::evictable(payload, limits, now)
}

/// Takes `costs` (one per configured limit; `specs` the request's charges) from the
/// entries of `holders`, all or none.
pub fn take(
    host: &mut impl Host,
    config: &Policy,
    holders: &[Holder],
    specs: &[LimitCharge],
    policy: &LeasePolicy,
    dry_out: DryOut,
    now: u64,
) -> Taken {
    let limits = config.limits.len();
    let costs: Vec<u64> = specs.iter().map(|s| s.cost).collect();
    let mut view = TenantLeases::decode(None, limits);
    let mut renew = Vec::new();
    // What was taken, as the caller's holders: cloned only if it must be held.
    let mut taken: Vec<&Holder> = Vec::new();
    let mut slots: Vec<u32> = Vec::new();
    let mut short: Vec<Holder> = Vec::new();
    let mut marked: Vec<Holder> = Vec::new();
    for holder in holders {
        let part = masked(&costs, &holder.indices);
        if part.iter().all(|&c| c == 0) {
            continue; // nothing to take here (a limit of another model, a missing header)
        }
        let step = update_own_at(host, config, TenantTable::Leases, &holder.name, evictable(limits, now), |payload| {
            let mut entry = LeaseEntry::decode(payload, limits);
            if entry.leases.admit(&part, now) {
                let low =
                    holder.indices.iter().any(|&i| entry.leases.0.get(i).is_some_and(|l| l.wants_renewal(policy, now)));
                if low {
                    for &i in &holder.indices {
                        if let Some(lease) = entry.leases.0.get_mut(i) {
                            lease.renewal_asked_ms = now;
                        }
                    }
                }
                return (Some(entry.encode_with_room(ENTRY_ROOM)), Part::Took { low, leases: entry.leases });
            }
            if entry.leases.blocks(&part, now) {
                return (None, Part::Blocked);
            }
            if entry.repeats(policy.ttl_ms, now) {
                let DryOut::Coalesce { may_wait } = dry_out else { return (None, Part::Short { marked: false }) };
                let asked = |i: &usize| entry.leases.0.get(*i).is_some_and(|l| l.renewal_in_flight(policy, now));
                match (holder.indices.iter().any(asked), may_wait) {
                    (true, true) => return (None, Part::Awaits),
                    (true, false) => return (None, Part::Short { marked: false }),
                    (false, _) => {
                        for &i in &holder.indices {
                            if let Some(lease) = entry.leases.0.get_mut(i) {
                                lease.renewal_asked_ms = now;
                            }
                        }
                        return (Some(entry.encode_with_room(ENTRY_ROOM)), Part::Short { marked: true });
                    }
                }
            }
            entry.seen_ms = now;
            (Some(entry.encode_with_room(ENTRY_ROOM)), Part::FirstSeen)
        });
        let outcome = match step {
            Some(Ok((slot, Part::Took { low, leases }))) => {
                copy_indices(&mut view, &leases, &holder.indices);
                if low {
                    renew.push(holder.clone());
                }
                taken.push(holder);
                slots.push(slot);
                continue;
            }
            Some(Ok((_, Part::Short { marked: was_marked }))) => {
                if was_marked {
                    marked.push(holder.clone());
                }
                short.push(holder.clone());
                continue;
            }
            Some(Ok((_, Part::Awaits))) => Some(Taken::Await(holder.name.clone())),
            Some(Ok((_, Part::Blocked))) => None,
            Some(Ok((_, Part::FirstSeen)) | Err(Busy)) | None => Some(Taken::Direct),
        };
        put_back(host, config, taken, &costs, now);
        // Nobody asks for these now: a later request (or tick) may.
        for holder in marked.iter().chain(&renew) {
            renewal_answered(host, config, holder);
        }
        return outcome.unwrap_or_else(|| {
            let seen = gather(host, config, holders);
            // Not refused after all (a grant came in between): ask for every entry.
            let ask_all = || Taken::Ask(Hold { short: holders.to_vec(), ..Hold::default() });
            seen.refusal(specs, now).map_or_else(ask_all, Taken::Refused)
        });
    }
    if short.is_empty() {
        return Taken::Admitted { renew, leases: view, slots };
    }
    Taken::Ask(Hold { held: taken.into_iter().cloned().collect(), short, leases: view, renew, slots, marked })
}

/// What to ask Redis for a request's `short` entries: each of their limits sized by
/// [`lease_asks`] (never less than the request needs), every other limit nothing (as
/// look-only: its part is held, or it has none).
pub fn asks(
    host: &mut impl Host,
    config: &Policy,
    short: &[Holder],
    specs: &[LimitCharge],
    policy: &LeasePolicy,
    now: u64,
) -> Vec<LeaseAsk> {
    let leases = gather(host, config, short);
    let mut asks = lease_asks(&leases, specs, policy, now);
    for (i, ask) in asks.iter_mut().enumerate() {
        if !short.iter().any(|h| h.indices.contains(&i)) {
            ask.wanted = 0;
            ask.needed = Some(0);
            ask.look_only = true;
        }
    }
    asks
}

fn copy_indices(view: &mut TenantLeases, from: &TenantLeases, indices: &[usize]) {
    for &i in indices {
        if let (Some(to), Some(lease)) = (view.0.get_mut(i), from.0.get(i)) {
            *to = *lease;
        }
    }
}

/// Gives back what `taken` gave of `costs`. A lease that expired in between keeps it
/// (its remainder went back to Redis without it): the request's cost stays charged there.
pub fn put_back<'h>(
    host: &mut impl Host,
    config: &Policy,
    taken: impl IntoIterator<Item = &'h Holder>,
    costs: &[u64],
    now: u64,
) {
    let credits: Vec<(usize, i64)> =
        costs.iter().enumerate().map(|(i, &c)| (i, i64::try_from(c).unwrap_or(i64::MAX))).collect();
    for holder in taken {
        let part: Vec<(usize, i64)> = credits.iter().copied().filter(|(i, _)| holder.indices.contains(i)).collect();
        credit_entry(host, config, holder, &part, now);
    }
}

/// Each limit's lease from its holder's entry (empty where there is none).
pub fn gather(host: &mut impl Host, config: &Policy, holders: &[Holder]) -> TenantLeases {
    let limits = config.limits.len();
    let mut view = TenantLeases::decode(None, limits);
    for holder in holders {
        let stored = read_own(host, config, TenantTable::Leases, &holder.name);
        let entry = LeaseEntry::decode(stored.as_deref(), limits);
        copy_indices(&mut view, &entry.leases, &holder.indices);
    }
    view
}

/// Whether a grant for `name`'s entry is out (a renewal, or a request's ask): what a
/// request waiting for it waits on.
pub fn grant_out(host: &mut impl Host, config: &Policy, name: &str, policy: &LeasePolicy, now: u64) -> bool {
    let stored = read_own(host, config, TenantTable::Leases, name);
    let entry = LeaseEntry::decode(stored.as_deref(), config.limits.len());
    entry.leases.0.iter().any(|l| l.renewal_in_flight(policy, now))
}

/// Ends `holder`'s leases at `now` (its owner suspended by a plan): nothing more is
/// admitted from them, and what is left is given back with the expired leases.
pub fn end(host: &mut impl Host, config: &Policy, holder: &Holder, now: u64) {
    update_existing(host, config, holder, |entry| {
        for &i in &holder.indices {
            if let Some(lease) = entry.leases.0.get_mut(i) {
                lease.expires_ms = lease.expires_ms.min(now);
            }
        }
        (true, ())
    });
}

/// Lifts the renewal marker of `holder`'s leases: its renewal answered, granted or not.
pub fn renewal_answered(host: &mut impl Host, config: &Policy, holder: &Holder) {
    update_existing(host, config, holder, |entry| {
        for &i in &holder.indices {
            if let Some(lease) = entry.leases.0.get_mut(i) {
                lease.renewal_answered();
            }
        }
        (true, ())
    });
}

/// Read-modify-write of `holder`'s entry where it has one (never taking another's slot):
/// `change` edits it and says whether to write it back, and what to answer (the default
/// when there is no entry or the host refused the write).
fn update_existing<R: Default>(
    host: &mut impl Host,
    config: &Policy,
    holder: &Holder,
    mut change: impl FnMut(&mut LeaseEntry) -> (bool, R),
) -> R {
    let limits = config.limits.len();
    let done = update_own(
        host,
        config,
        TenantTable::Leases,
        &holder.name,
        |_| false,
        |payload| {
            let Some(payload) = payload else { return (None, R::default()) };
            let mut entry = LeaseEntry::decode(Some(payload), limits);
            let (write, result) = change(&mut entry);
            (write.then(|| entry.encode_with_room(ENTRY_ROOM)), result)
        },
    );
    match done {
        Some(Ok(result)) => result,
        _ => R::default(),
    }
}

/// Adds a grant to the entries of `holders`: `outcome(i)` is what limit `i` was granted
/// (`None`: not asked). With `costs`, a request is admitted from the grant too: it covered
/// at least the request's need, so the admission stands even if another worker spent the
/// lease in between (which then runs briefly negative).
pub fn merge<'a>(
    host: &mut impl Host,
    config: &Policy,
    holders: &[Holder],
    outcome: impl Fn(usize) -> Option<&'a LimitOutcome>,
    costs: Option<&[u64]>,
    now: u64,
) -> Merged {
    let limits = config.limits.len();
    let policy = config.lease_policy();
    let mut done = Merged { leases: TenantLeases::decode(None, limits), ..Merged::default() };
    for holder in holders {
        let merged =
            update_own_at(host, config, TenantTable::Leases, &holder.name, evictable(limits, now), |payload| {
                let mut entry = LeaseEntry::decode(payload, limits);
                for &i in &holder.indices {
                    if let (Some(lease), Some(granted)) = (entry.leases.0.get_mut(i), outcome(i)) {
                        lease.add_grant(granted.charged as f64, granted.remaining as f64, &policy, now);
                    }
                }
                if let Some(costs) = costs {
                    let part = masked(costs, &holder.indices);
                    if !entry.leases.admit(&part, now) {
                        for (lease, &cost) in entry.leases.0.iter_mut().zip(&part) {
                            lease.remaining -= cost as f64;
                        }
                    }
                }
                (Some(entry.encode_with_room(ENTRY_ROOM)), entry.leases)
            });
        match merged {
            Some(Ok((slot, leases))) => {
                copy_indices(&mut done.leases, &leases, &holder.indices);
                done.slots.push(slot);
            }
            _ => done.refused.push(holder.clone()),
        }
    }
    done
}

/// Applies a settlement's `credits` (limit index, tokens back or, if negative, taken) to
/// the leases they came from. Returns those that found no live lease (it expired, or was
/// evicted): they belong to Redis.
pub fn credit(
    host: &mut impl Host,
    config: &Policy,
    holders: &[Holder],
    credits: &[(usize, i64)],
    now: u64,
) -> Vec<(usize, i64)> {
    let mut left = Vec::new();
    for holder in holders {
        let part: Vec<(usize, i64)> =
            credits.iter().copied().filter(|&(i, c)| c != 0 && holder.indices.contains(&i)).collect();
        if !part.is_empty() && !credit_entry(host, config, holder, &part, now) {
            left.extend(part);
        }
    }
    left
}

/// Applies `credits` to `holder`'s entry, all or none: whether they were.
fn credit_entry(host: &mut impl Host, config: &Policy, holder: &Holder, credits: &[(usize, i64)], now: u64) -> bool {
    update_existing(host, config, holder, |entry| {
        let live = credits.iter().all(|&(i, credit)| entry.leases.credit(i, credit, now));
        (live, live)
    })
}

/// Remembers in each holder's entry that Redis refused a lease for `costs`: a later
/// request needing as much of a limit that refused is refused here until its retry time.
pub fn block(host: &mut impl Host, config: &Policy, holders: &[Holder], reply: &LimitsReply, costs: &[u64], now: u64) {
    let limits = config.limits.len();
    for holder in holders {
        let refusing =
            holder.indices.iter().any(|&i| reply.limits.get(i).is_some_and(|o| o.status == LimitStatus::Limited));
        if !refusing {
            continue;
        }
        let part = masked(costs, &holder.indices);
        update_own(host, config, TenantTable::Leases, &holder.name, evictable(limits, now), |payload| {
            let mut entry = LeaseEntry::decode(payload, limits);
            entry.leases.block(reply, &part, now);
            (Some(entry.encode_with_room(ENTRY_ROOM)), ())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tenant_comes_first_then_each_pool_once() {
        let owners = [None, Some("all"), Some("pteam"), Some("all"), None];
        let names: Vec<(String, Vec<usize>)> =
            holders("t1", |i| owners[i], 5).into_iter().map(|h| (h.name, h.indices)).collect();
        assert_eq!(
            names,
            [("t1".into(), vec![0, 4]), ("all".into(), vec![1, 3]), ("pteam".into(), vec![2])],
            "one entry per owner, limits in config order"
        );
        let pools_only = holders("t1", |_| Some("all"), 1);
        assert_eq!(pools_only, [Holder { name: "all".into(), indices: vec![0] }], "no empty tenant entry");
        assert_eq!(holders("t1", |_| None, 2), [Holder { name: "t1".into(), indices: vec![0, 1] }]);
    }
}
