//! Per-VM state and the root context's background work. One `Worker` per VM (the glue's
//! root context holds it; each request borrows it for the length of a callback): the
//! settlement queue, the leases this VM renews and returns, the slots it keeps alive, and
//! the callouts the root owns. No state lives anywhere else.
//!
//! By concern: `companion.rs` (the callouts, the breaker that decides whether to make
//! them, the fleet's exchanges), `settlements.rs` (settlements queued, batched and sent,
//! the spend ledger, concurrency slots kept alive), `leases.rs` (renewals, expiry, the
//! requests waiting for a grant), `ids.rs` (reservation ids). This file holds the state,
//! the configuration and the root's ticks that drive them.

pub(crate) mod companion;
mod ids;
mod leases;
pub(crate) mod settlements;

use crate::accounting::ledger::Ledger;
use crate::accounting::owner_plans::OwnerPlans;
use crate::api::identity::TenantIds;
use crate::config::{FailureMode, Policy, Store};
use crate::effects::average_store::VmAverages;
use crate::effects::calibration_store::VmCalibrations;
use crate::effects::host::{detect_kind, Host, HostKind, LogLevel, Metric, TICK, WAIT_TICK};
use crate::effects::lease_table::Holder;
use crate::effects::provider_state::VmProviderWords;
use crate::effects::settle_queue::{Queued, SettleQueue};
use crate::effects::tables::{self, TenantTable};
use crate::protocol::LeaseAsk;
use crate::tokens::prompt_cache::PromptCache;
use ids::{take_vm_number, ReservationIds};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

const SETTLE_QUEUE_CAPACITY: usize = 20_000;
/// Credentials whose tenant ids a VM keeps: 1,024 clients returning in turn are hashed
/// once each; at most ~300 KB (slots of 32 B, each credential at most 256 B and its id).
const TENANT_ID_CACHE_SLOTS: usize = 1024;

/// The answer to one of the root's callouts: its token, and its body's size.
#[derive(Debug, Clone, Copy)]
struct RootAnswer {
    token: u32,
    body_size: usize,
}

pub struct Worker {
    config: Option<Rc<Policy>>,
    /// Whether the root ticks every `WAIT_TICK` (requests wait for a lease grant), and when
    /// the last full tick ran (ms): the full tick's work still runs every `TICK`.
    fast_ticks: bool,
    full_tick_ms: u64,
    /// The owners' plans this VM has seen in the companion's replies: what the degraded
    /// mode decides with while Redis is away.
    pub owner_plans: OwnerPlans,
    host_kind: HostKind,
    settlements: SettleQueue,
    /// Lease entries (a tenant's, a pool's) this VM saw running low, with the limits each
    /// holds: renewed on the next tick.
    renewals: BTreeMap<String, Vec<usize>>,
    /// Slots of the lease table this VM granted leases into, each with the time its first
    /// lease expires: what expires is returned. Bounded by the table's size.
    leased: BTreeMap<u32, u64>,
    /// Concurrency slots held by this VM's requests, by reservation id, and where: renewed
    /// until the request releases them.
    slots: HashMap<String, settlements::HeldSlots>,
    ids: ReservationIds,
    ticks: u32,
    warmed_up: bool,
    /// The settlement batch whose callout is out, by its token.
    settling: Option<(u32, Vec<Queued>)>,
    /// Lease renewals out, by token: the entry and what was asked.
    renewing: HashMap<u32, (Holder, Vec<LeaseAsk>)>,
    /// Requests of this VM waiting for a lease grant another asked for: each one's context,
    /// the entry it waits on and until when. At most one per request in flight, and only
    /// while a dry-out lasts: a list, which also keeps the module's code small.
    lease_waiters: Vec<(u32, String, u64)>,
    /// Waiting requests to take from the lease again now: the glue resumes each in its own
    /// context from the root's next callback (`waiters_due`).
    waiters_due: Vec<u32>,
    /// Token counts of long prompt texts this VM counted (bounded).
    pub(crate) prompt_cache: PromptCache,
    /// Tenant ids of the credentials this VM saw last (bounded).
    pub(crate) tenant_ids: TenantIds,
    /// What settled replies teach, gathered for the tick, and the calibrations as read.
    pub(crate) calibrations: VmCalibrations,
    /// The completion averages as read, and what replies taught them, for the tick.
    pub(crate) averages: VmAverages,
    /// What providers said of their limits, for the fleet's exchange.
    pub(crate) provider_words: VmProviderWords,
    /// Queue waits not yet counted in `queue_wait_seconds_total`: host counters take whole
    /// numbers, so the milliseconds short of a second wait here for the next wait.
    queue_wait_ms_uncounted: u64,
    /// What this VM's requests used, for the spend ledger (`store: redis` only).
    pub(crate) ledger: Ledger,
}

impl Default for Worker {
    fn default() -> Self {
        Worker::new()
    }
}

/// Whether `host` holds request headers while the body is read under `config` (also what
/// `llm-ratelimit check-config --print-effective` shows).
pub fn holds_request_headers(config: &Policy, host: HostKind) -> bool {
    config.hold_request_headers.unwrap_or(true) && host.reads_body_while_headers_wait()
}

/// What a config cannot do on this host, in the words the filter logs at load (also run
/// by `llm-ratelimit check-config --host`).
pub fn check_for_host(config: &Policy, host: HostKind) -> Result<(), String> {
    if config.hold_request_headers == Some(true) && !host.reads_body_while_headers_wait() {
        return Err(format!(
            "invalid filter config: field `hold_request_headers`: {} does not deliver a request body while \
             its headers are held, so every request would hang; leave it unset (the filter then waits for \
             the body without holding the headers)",
            host.name()
        ));
    }
    Ok(())
}

impl Worker {
    pub fn new() -> Worker {
        Worker {
            config: None,
            fast_ticks: false,
            full_tick_ms: 0,
            owner_plans: OwnerPlans::default(),
            host_kind: HostKind::default(),
            settlements: SettleQueue::new(SETTLE_QUEUE_CAPACITY),
            renewals: BTreeMap::new(),
            leased: BTreeMap::new(),
            slots: HashMap::new(),
            ids: ReservationIds::default(),
            ticks: 0,
            warmed_up: false,
            settling: None,
            renewing: HashMap::new(),
            lease_waiters: Vec::new(),
            waiters_due: Vec::new(),
            prompt_cache: PromptCache::new(0),
            tenant_ids: TenantIds::new(TENANT_ID_CACHE_SLOTS),
            calibrations: VmCalibrations::default(),
            averages: VmAverages::default(),
            provider_words: VmProviderWords::default(),
            queue_wait_ms_uncounted: 0,
            ledger: Ledger::default(),
        }
    }

    pub fn config(&self) -> Option<&Rc<Policy>> {
        self.config.as_ref()
    }

    pub fn host_kind(&self) -> HostKind {
        self.host_kind
    }

    /// Learns which host this is, then parses, checks against the host, and takes the
    /// plugin configuration. On an error the host should refuse the config; the message
    /// says why.
    pub fn configure(&mut self, host: &mut impl Host, bytes: &[u8]) -> Result<(), String> {
        self.host_kind = detect_kind(host);
        // A seed no client can know (there is no randomness in the VM: the clock's
        // nanoseconds at start-up will do for keeping crafted texts off others' entries).
        self.prompt_cache = PromptCache::new(host.now_nanos() as u64);
        let environment = host.environment_variables();
        let variable = |name: &str| environment.iter().find(|(key, _)| key == name).map(|(_, value)| value.clone());
        let mut config = Policy::from_json_in(bytes, &variable).map_err(|e| e.to_string())?;
        if config.store == Store::Local {
            config.memory.slot_key = crate::effects::local_limiter::slot_key(host, &config.domain);
        }
        if self.ids.vm == 0 {
            self.ids.vm = take_vm_number(host, &config.domain);
        }
        check_for_host(&config, self.host_kind)?;
        // After the checks: a config this host refuses makes no table. Each table the
        // config writes is made before the VM serves (see `tables::make_table`): the lease
        // table is written from a tenant's first request on (when it was first seen), the
        // local table from the first request (the local store) or the first of an outage,
        // which may be the proxy's first.
        let local = config.store == Store::Local || config.failure_mode == FailureMode::Local;
        for (table, used) in [(TenantTable::Leases, config.lease.enabled), (TenantTable::Local, local)] {
            if used {
                tables::make_table(host, &config, self.host_kind, table);
            }
        }
        host.log(
            LogLevel::Info,
            &format!(
                "llm-ratelimit: configured {} limit(s) in domain {:?}, {}, host {}{}",
                config.limits.len(),
                config.domain,
                match config.store {
                    Store::Redis => format!("companion {:?}", config.companion.upstream),
                    Store::Local => "local store (no companion)".to_string(),
                },
                self.host_kind.name(),
                if config.lease.enabled { ", leases on" } else { "" }
            ),
        );
        if config.lease.enabled {
            // The most of each limit one proxy can hold unused in a tenant's lease: what
            // leases can cost other proxies (they never let proxies admit more).
            for limit in &config.limits {
                let bound = (limit.capacity() as f64 * config.lease.max_fraction).ceil() as u64;
                host.set_gauge(&crate::plan::series::limit_gauge(crate::plan::series::LEASE_BOUND, &limit.name), bound);
            }
        }
        if config.tokens.calibrate && config.counts_tokens() {
            // What the workers learned before this config (shared data outlives it).
            for (index, model) in config.tokens.all_rules() {
                let learned = crate::effects::calibration_store::read(host, &config, index);
                crate::effects::calibration_store::show(host, model, learned);
            }
        }
        // What the old config's replies taught is written under it (its rules by their
        // indices there); the new one reads afresh.
        if let Some(old) = self.config.clone() {
            let now = host.now_ms();
            self.averages.settle(host, &old);
            self.calibrations.settle(host, &old, now);
        }
        self.averages.forget();
        self.config = Some(Rc::new(config));
        self.warmed_up = false;
        Ok(())
    }

    /// Whether requests hold their headers while the body is read: as configured, and
    /// only where the host can deliver the body meanwhile.
    pub fn holds_request_headers(&self, config: &Policy) -> bool {
        holds_request_headers(config, self.host_kind)
    }

    /// The root's timer.
    pub fn on_tick(&mut self, host: &mut impl Host) {
        let Some(config) = self.config.clone() else { return };
        if !self.warmed_up && config.tokens.warm_up && config.counts_tokens() {
            self.warmed_up = true;
            config.tokens.default_encoding.warm_up();
            for model in config.tokens.rules.iter().filter(|m| m.configured) {
                model.rule.encoding.warm_up();
            }
        }
        self.ticks = self.ticks.wrapping_add(1);
        let now = host.now_ms();
        if config.lease.enabled {
            self.tend_leases(host, &config, now);
        }
        self.calibrations.flush(host, &config, now);
        self.averages.flush(host, &config, now);
        // The local store has no companion: nothing to exchange or send.
        if config.store == Store::Redis {
            self.exchange_calibrations(host, &config, now);
            self.exchange_provider_words(host, &config, now);
            self.send_settlements(host, &config);
            self.send_ledger(host, &config);
        }
        if config.has_concurrency() {
            let every = (config.slots.ttl.as_millis() / 3 / TICK.as_millis()).max(1) as u32;
            if self.ticks % every == 0 {
                self.touch_slots(host, &config);
            }
        }
    }

    /// A callout the root owns has answered: the concern that sent it takes the answer.
    pub fn on_callout_response(&mut self, host: &mut impl Host, token: u32, body_size: usize) {
        let Some(config) = self.config.clone() else { return };
        let answer = RootAnswer { token, body_size };
        let _taken = self.ledger_answered(host, answer)
            || self.exchange_answered(host, &config, answer)
            || self.renewal_answered(host, &config, answer)
            || self.settlements_answered(host, &config, answer);
    }

    /// The root's tick, whatever its period: the full tick's work (`on_tick`) every `TICK`,
    /// and between two, while requests wait, the short one that only wakes them (a timer
    /// may fire a little early or late). Returns whether the full tick ran.
    pub fn on_root_tick(&mut self, host: &mut impl Host) -> bool {
        let now = host.now_ms();
        let (tick, wait_tick) = (TICK.as_millis() as u64, WAIT_TICK.as_millis() as u64);
        let full = !self.fast_ticks || now.saturating_sub(self.full_tick_ms) + wait_tick >= tick;
        if full {
            self.full_tick_ms = now;
            self.on_tick(host);
        } else {
            self.on_wait_tick(host);
        }
        full
    }

    /// The root's tick period when it must change: `WAIT_TICK` once requests wait for a
    /// lease grant (`has_waiters`), `TICK` again once none does; `None` while it stays.
    pub fn tick_period_change(&mut self) -> Option<std::time::Duration> {
        let fast = self.has_waiters();
        if self.fast_ticks == fast {
            return None;
        }
        self.fast_ticks = fast;
        Some(if fast { WAIT_TICK } else { TICK })
    }

    /// Counts a request that waited `waited_ms` in the companion's queue, and its wait in
    /// whole seconds (what is short of a second is carried to the next wait, so the
    /// counter is behind by less than a second per VM).
    pub(crate) fn count_queue_wait(&mut self, host: &mut impl Host, waited_ms: u64) {
        host.add_metric(Metric::Queued, 1);
        let waited_ms = self.queue_wait_ms_uncounted.saturating_add(waited_ms);
        host.add_metric(Metric::QueueWaitSeconds, waited_ms / 1000);
        self.queue_wait_ms_uncounted = waited_ms % 1000;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{advance, Proxy, World};

    /// The root's pacing, which the glue only carries out: `TICK` while no request waits;
    /// `WAIT_TICK` while some wait for a lease grant, the full tick's work still every
    /// `TICK` between the short ones; `TICK` again once none waits.
    #[test]
    fn the_root_ticks_fast_only_while_requests_wait_and_its_full_work_stays_every_tick() {
        let world = World::new(HostKind::Envoy);
        let config = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"},
            "limits": [{"name": "rpm", "requests": 100, "window": "1m"}]}"#;
        let mut proxy = Proxy::new(&world, config);
        let worker = &mut proxy.worker;
        assert_eq!(worker.tick_period_change(), None, "no waiter: the period set at configure stays");
        assert!(worker.on_root_tick(&mut proxy.root));
        let until = proxy.root.now_ms() + 1_000;
        worker.await_lease(7, "entry".into(), until);
        assert_eq!(worker.tick_period_change(), Some(WAIT_TICK));
        assert_eq!(worker.tick_period_change(), None, "said once");
        let wait = WAIT_TICK.as_millis() as u64;
        let full: Vec<bool> = (0..60)
            .map(|_| {
                advance(&world, wait);
                worker.on_root_tick(&mut proxy.root)
            })
            .collect();
        let fulls = full.iter().filter(|&&f| f).count();
        assert_eq!(fulls, 60 / (TICK.as_millis() as usize), "the full work every TICK: {full:?}");
        worker.stop_waiting(7);
        assert_eq!(worker.tick_period_change(), Some(TICK));
    }
}
