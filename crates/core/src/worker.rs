//! Per-VM state and the root context's background work. One `Worker` per VM (the glue's
//! root context holds it; each request borrows it for the length of a callback): the
//! settlement queue, the leases this VM renews and returns, the slots it keeps alive, and
//! the callouts the root owns. No state lives anywhere else.

use crate::accounting::breaker::{Breaker, Dispatch};
use crate::accounting::lease::{lease_asks, LeaseEntry, TenantLeases};
use crate::accounting::ledger::{Ledger, MAX_ROWS as LEDGER_ROWS};
use crate::accounting::owner_plans::OwnerPlans;
use crate::api::identity::TenantIds;
use crate::config::{FailureMode, Policy, Store};
use crate::effects::average_store::LocalAverages;
use crate::effects::calibration_store::LocalCalibrations;
use crate::effects::host::{detect_kind, shared_read, shared_update, Host, HostKind, LogLevel, Metric, Owner};
use crate::effects::lease_table::{self, Holder};
use crate::effects::provider_state::LocalProviderWords;
use crate::effects::settle_queue::{Queued, SettleQueue};
use crate::effects::tables::{self, read_own, update_slot, TenantTable};
use crate::plan::charge::limit_charge;
use crate::protocol::keys;
use crate::protocol::ledger::{LedgerReply, LEDGER_PATH};
use crate::protocol::{
    Adjustment, CalibrationReply, LeaseAsk, LeaseRequest, LimitCharge, LimitKind, LimitsReply, SettleReply, Settlement,
    SettlementBatch, CALIBRATION_PATH, LEASE_PATH, SETTLE_PATH, TOKEN_HEADER, TOUCH_PATH,
};
use crate::protocol::{ProviderReply, PROVIDER_PATH};
use crate::tokens::prompt_cache::PromptCache;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::time::Duration;

pub use crate::effects::host::{TICK, WAIT_TICK};
/// How often expired leases are looked for, in ticks.
const EXPIRY_TICKS: u32 = 10;

/// Keys of a tenant table made per tick (see `Worker::make_tables`): 16,384 slots in 16
/// ticks, under a second, at two host calls a key.
const TABLE_KEYS_PER_TICK: u32 = 1_024;
/// Most settlements in one callout: all a call may carry. The companion applies them in
/// script calls of a hundred, so a large batch costs few round trips; with one batch out
/// at a time, a smaller one capped what a worker could settle (200 per 50 ms tick fell
/// behind a worker's 5,500 token requests/s, and the full queue dropped settlements).
const SETTLE_BATCH: usize = crate::protocol::MAX_SETTLEMENTS_PER_CALL;
const SETTLE_QUEUE_CAPACITY: usize = 20_000;
/// Credentials whose tenant ids a VM keeps: 1,024 clients returning in turn are hashed
/// once each; at most ~300 KB (slots of 32 B, each credential at most 256 B and its id).
const TENANT_ID_CACHE_SLOTS: usize = 1024;
/// How often the ledger's aggregate goes to the companion, in ticks (a second), and how
/// often a batch the companion did not acknowledge is sent again.
const LEDGER_TICKS: u32 = 20;
/// Settlement batches and slot heartbeats wait at least this long for the companion.
const BACKGROUND_TIMEOUT: Duration = Duration::from_secs(1);

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
    /// Concurrency slots held by this VM's requests, by reservation id: renewed until the
    /// request releases them.
    slots: HashMap<String, Settlement>,
    ids: ReservationIds,
    ticks: u32,
    warmed_up: bool,
    /// The settlement batch whose callout is out, by its token.
    settling: Option<(u32, Vec<Queued>)>,
    /// Lease renewals out, by token: the entry and what was asked.
    renewing: HashMap<u32, (Holder, Vec<LeaseAsk>)>,
    /// Tenant tables whose keys this VM still makes, empty, a share each tick, with the next
    /// slot to make (see `tables::made_ahead`): the lease table and the degraded mode's
    /// local table, used from a tenant's second request and from an outage on, so made in
    /// the first second rather than before the VM serves. The local store's is made at load.
    tables_to_make: Vec<(TenantTable, u32)>,
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
    pub(crate) calibrations: LocalCalibrations,
    /// The completion averages as read, and what replies taught them, for the tick.
    pub(crate) averages: LocalAverages,
    /// What providers said of their limits, for the fleet's exchange.
    pub(crate) provider_words: LocalProviderWords,
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
            tables_to_make: Vec::new(),
            lease_waiters: Vec::new(),
            waiters_due: Vec::new(),
            prompt_cache: PromptCache::new(0),
            tenant_ids: TenantIds::new(TENANT_ID_CACHE_SLOTS),
            calibrations: LocalCalibrations::default(),
            averages: LocalAverages::default(),
            provider_words: LocalProviderWords::default(),
            queue_wait_ms_uncounted: 0,
            ledger: Ledger::default(),
        }
    }

    pub fn config(&self) -> Option<&Rc<Policy>> {
        self.config.as_ref()
    }

    /// How many slots of the lease table this VM watches for expiry (bounded by the table).
    pub fn leased_slots(&self) -> usize {
        self.leased.len()
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
            config.memory.slot_key = crate::effects::local_store::slot_key(host, &config.domain);
        }
        if self.ids.vm == 0 {
            self.ids.vm = take_vm_number(host, &config.domain);
        }
        check_for_host(&config, self.host_kind)?;
        // After the checks: a config this host refuses makes no table.
        if config.store == Store::Local {
            crate::effects::local_store::create_table(host, &config, self.host_kind);
        }
        self.tables_to_make.clear();
        if tables::made_ahead(&config, self.host_kind) {
            let degraded = config.store == Store::Redis && config.failure_mode == FailureMode::Local;
            for (table, used) in [(TenantTable::Leases, config.lease.enabled), (TenantTable::Local, degraded)] {
                if used && !tables::table_made(host, &config, table) {
                    self.tables_to_make.push((table, 0));
                }
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
        // What the old config's replies taught is written under it; the new one reads afresh.
        if let Some(old) = self.config.clone() {
            self.averages.flush(host, &old);
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
            self.wake_stale_waiters(host, &config, now);
            self.renew_leases(host, &config, now);
            if self.ticks % EXPIRY_TICKS == 0 {
                self.return_expired_leases(host, &config, now);
            }
        }
        self.make_tables(host, &config);
        self.calibrations.flush(host, &config, now);
        self.averages.flush(host, &config);
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

    /// A callout the root owns has answered.
    pub fn on_callout_response(&mut self, host: &mut impl Host, token: u32, body_size: usize) {
        let Some(config) = self.config.clone() else { return };
        if self.ledger.is_sending(token) {
            let answer = callout_reply::<LedgerReply>(host, body_size);
            if let Err(why) = &answer {
                host.log(LogLevel::Debug, &format!("llm-ratelimit: ledger batch not acknowledged, kept: {why}"));
            }
            self.ledger.answered(answer.is_ok());
            return;
        }
        if self.calibrations.is_exchange(token) {
            match callout_reply::<CalibrationReply>(host, body_size) {
                Ok(reply) => {
                    let now = host.now_ms();
                    self.calibrations.take_reply(host, &config, &reply, now);
                }
                Err(why) => host.log(LogLevel::Debug, &format!("llm-ratelimit: calibration exchange failed: {why}")),
            }
            return;
        }
        if self.provider_words.is_exchange(token) {
            match callout_reply::<ProviderReply>(host, body_size) {
                Ok(reply) => {
                    let now = host.now_ms();
                    self.provider_words.take_reply(host, &config, &reply, now);
                }
                Err(why) => host.log(LogLevel::Debug, &format!("llm-ratelimit: provider words exchange failed: {why}")),
            }
            return;
        }
        if let Some((holder, asked)) = self.renewing.remove(&token) {
            // Answered (or failed): the next renewal of this entry may be asked, and
            // whoever waits for it takes again once this callback is over.
            lease_table::renewal_answered(host, &config, &holder);
            self.lease_news(&holder.name);
            match callout_reply::<LimitsReply>(host, body_size) {
                Ok(reply) if reply.allowed && reply.limits.len() == asked.len() => {
                    self.callout_succeeded(host, &config);
                    let now = host.now_ms();
                    // The renewal asked for the holder's limits only, in its order.
                    let outcome =
                        |i: usize| holder.indices.iter().position(|&at| at == i).and_then(|k| reply.limits.get(k));
                    let holders = std::slice::from_ref(&holder);
                    let merged = lease_table::merge(host, &config, holders, outcome, None, now);
                    self.note_leased(&merged.slots, &merged.leases, now);
                }
                Ok(LimitsReply { suspended: Some(suspension), .. }) => {
                    // Suspended by its plan: this proxy's leases of the owner end now
                    // rather than at their expiry (what is left goes back with the expired).
                    self.callout_succeeded(host, &config);
                    let now = host.now_ms();
                    lease_table::end(host, &config, &holder, now);
                    self.owner_plans.suspend(&holder.name, &suspension.reason, now);
                }
                Ok(_) => {}
                Err(why) => {
                    self.record_callout_failure(host, &config);
                    host.log(LogLevel::Warn, &format!("llm-ratelimit: lease renewal failed: {why}"));
                }
            }
            return;
        }
        match self.settling.take() {
            Some((expected, batch)) if expected == token => {
                // A full batch: a backlog, maybe, which goes on at once rather than a tick
                // later; smaller batches wait for the tick, so that they stay batches.
                let full = batch.len() >= SETTLE_BATCH;
                match callout_reply::<SettleReply>(host, body_size) {
                    Ok(reply) if reply.results.len() == batch.len() => self.requeue(host, batch, Some(&reply.results)),
                    _ => self.requeue(host, batch, None),
                }
                if full && self.host_kind().dispatches_from_callout_replies() {
                    self.send_settlements(host, &config);
                }
            }
            other => self.settling = other,
        }
    }

    /// Hands this worker's new calibration samples to the companion, when an exchange is due.
    fn exchange_calibrations(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        let Some(exchange) = self.calibrations.exchange(config, now) else { return };
        match self.call_companion(host, config, CALIBRATION_PATH, &exchange, BACKGROUND_TIMEOUT, Owner::Root) {
            Ok(token) => self.calibrations.sent(token),
            Err(why) => host.log(LogLevel::Debug, &format!("llm-ratelimit: no calibration exchange: {why}")),
        }
    }

    /// Hands what this worker heard from providers to the companion, and takes the
    /// fleet's, when an exchange is due.
    fn exchange_provider_words(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        let Some(exchange) = self.provider_words.exchange(host, config, now) else { return };
        match self.call_companion(host, config, PROVIDER_PATH, &exchange, BACKGROUND_TIMEOUT, Owner::Root) {
            Ok(token) => self.provider_words.sent(token),
            Err(why) => host.log(LogLevel::Debug, &format!("llm-ratelimit: no provider words exchange: {why}")),
        }
    }

    // ---- what requests and the root share ----

    pub(crate) fn queue_settlement(&mut self, host: &mut impl Host, settlement: Settlement) {
        if self.settlements.push(settlement).is_some() {
            host.add_metric(Metric::SettlementsFailed, 1);
        }
    }

    /// Queues, for `tenant`, the adjustments of `credits` (by limit index), if any, each
    /// on its limit's counter (`owners`, by limit index: a pool's, see `crate::plan::pools`;
    /// none or `None`: the tenant's).
    // Each argument is a part of the settlement's address or content; a struct for them
    // would be built at every one of the few call sites and read once here.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn settle_credits(
        &mut self,
        host: &mut impl Host,
        config: &Policy,
        tenant: &str,
        reservation: Option<String>,
        cancel: bool,
        owners: &[Option<String>],
        credits: impl Iterator<Item = (usize, i64)>,
    ) {
        let limits = adjustments(config, owners, credits, host.now_ms());
        if !limits.is_empty() {
            // Without a reservation record to settle against, an id of its own keeps it
            // from being applied twice when a batch is sent again after a lost answer.
            let once = reservation.is_none().then(|| self.ids.next(host));
            let settlement = Settlement { once, ..settlement(config, tenant, reservation, cancel, limits) };
            self.queue_settlement(host, settlement);
        }
    }

    pub(crate) fn hold_slots(&mut self, id: String, slots: Settlement) {
        self.slots.insert(id, slots);
    }

    pub(crate) fn take_slots(&mut self, id: &str) -> Option<Settlement> {
        self.slots.remove(id)
    }

    /// Makes the next `TABLE_KEYS_PER_TICK` keys of the first table still to make. Not while
    /// this VM decides locally (the breaker open): the degraded mode's entries are written
    /// then, and a write landing between a key's read and its empty write would be lost.
    fn make_tables(&mut self, host: &mut impl Host, config: &Policy) {
        let Some(&(table, next)) = self.tables_to_make.first() else { return };
        if !self.breaker(host, config).is_closed() {
            return;
        }
        match (tables::make_keys(host, config, table, next, TABLE_KEYS_PER_TICK), self.tables_to_make.first_mut()) {
            (Some(next), Some(making)) => making.1 = next,
            _ => {
                self.tables_to_make.remove(0);
            }
        }
    }

    /// `context` waits, until `until` at the latest, for the grant out for the lease entry
    /// `entry`.
    pub(crate) fn await_lease(&mut self, context: u32, entry: String, until: u64) {
        self.lease_waiters.retain(|(c, _, _)| *c != context);
        self.lease_waiters.push((context, entry, until));
    }

    /// `context` is over: it waits for nothing.
    pub(crate) fn stop_waiting(&mut self, context: u32) {
        self.lease_waiters.retain(|(c, _, _)| *c != context);
        self.waiters_due.retain(|&c| c != context);
    }

    /// A grant for `entry` answered: every request of this VM waiting for it is due.
    pub(crate) fn lease_news(&mut self, entry: &str) {
        self.wake_waiters(|waited, _| waited == entry);
    }

    fn wake_waiters(&mut self, mut due: impl FnMut(&str, u64) -> bool) {
        let waiters_due = &mut self.waiters_due;
        self.lease_waiters.retain(|(context, entry, until)| {
            let wake = due(entry, *until);
            if wake {
                waiters_due.push(*context);
            }
            !wake
        });
    }

    /// Whether requests of this VM wait for a lease grant: the glue then ticks the root
    /// every `WAIT_TICK`, which wakes them (`on_wait_tick`) soon after their grant lands.
    pub fn has_waiters(&self) -> bool {
        !self.lease_waiters.is_empty() || !self.waiters_due.is_empty()
    }

    /// The requests to resume now, each with `RequestFilter::on_lease_news` in its own
    /// context, from the root's callback: their grant answered (here, or in another
    /// worker), or they waited their longest.
    pub fn waiters_due(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.waiters_due)
    }

    /// Waiters the glue could not resume just now: due at its next chance.
    pub fn due_again(&mut self, contexts: Vec<u32>) {
        self.waiters_due.extend(contexts);
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

    /// The short tick between two full ones while requests wait (`has_waiters`): wakes those
    /// whose grant is no longer out.
    pub fn on_wait_tick(&mut self, host: &mut impl Host) {
        let Some(config) = self.config.clone() else { return };
        let now = host.now_ms();
        self.wake_stale_waiters(host, &config, now);
    }

    /// Waiters whose entry has no grant out any more (another worker's grant landed: its
    /// answer wakes only that worker's waiters; or the one asked can no longer answer), and
    /// those that waited their longest.
    fn wake_stale_waiters(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        if self.lease_waiters.is_empty() {
            return;
        }
        let policy = config.lease_policy();
        // Each entry waited on is read once, however many wait on it: whether its grant landed.
        let mut waited_on: Vec<(String, bool)> = Vec::new();
        for (_, entry, _) in &self.lease_waiters {
            if !waited_on.iter().any(|(seen, _)| seen == entry) {
                waited_on.push((entry.clone(), !lease_table::grant_out(host, config, entry, &policy, now)));
            }
        }
        self.wake_waiters(|entry, until| now >= until || waited_on.iter().any(|(e, landed)| *landed && e == entry));
    }

    pub(crate) fn want_renewal(&mut self, holder: Holder) {
        self.renewals.insert(holder.name, holder.indices);
    }

    pub(crate) fn new_reservation_id(&mut self, host: &mut impl Host) -> String {
        self.ids.next(host)
    }

    pub(crate) fn breaker(&self, host: &mut impl Host, config: &Policy) -> Breaker {
        shared_read(host, &keys::breaker_key(&config.domain)).and_then(|b| Breaker::from_bytes(&b)).unwrap_or_default()
    }

    /// The breaker's one read-modify-write: `change` takes its state and returns the next
    /// one (`None`: unchanged) and what to answer; `None` if the host refused every write.
    fn update_breaker<R>(
        host: &mut impl Host,
        config: &Policy,
        mut change: impl FnMut(Breaker) -> (Option<Breaker>, R),
    ) -> Option<R> {
        shared_update(host, &keys::breaker_key(&config.domain), |bytes| {
            let (next, answer) = change(bytes.and_then(Breaker::from_bytes).unwrap_or_default());
            (next.map(|state| state.to_bytes().to_vec()), answer)
        })
    }

    /// Where a decision goes now: to the companion, or local while the breaker is open.
    pub(crate) fn dispatch(&mut self, host: &mut impl Host, config: &Policy, now: u64) -> Dispatch {
        let cooldown = config.fallback.breaker_cooldown.as_millis() as u64;
        Self::update_breaker(host, config, |state| {
            let (chosen, probe) = state.dispatch(now, cooldown);
            (probe, chosen)
        })
        .unwrap_or(Dispatch::Local)
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

    pub(crate) fn callout_succeeded(&mut self, host: &mut impl Host, config: &Policy) {
        let reopened = Self::update_breaker(host, config, |state| {
            let changed = state != Breaker::default();
            (changed.then(|| state.on_success()), !state.is_closed())
        });
        if reopened == Some(true) {
            host.log(LogLevel::Info, "llm-ratelimit: the companion answers again; leaving degraded mode");
        }
    }

    pub(crate) fn record_callout_failure(&mut self, host: &mut impl Host, config: &Policy) {
        let cooldown = config.fallback.breaker_cooldown.as_millis() as u64;
        let now = host.now_ms();
        let opened = Self::update_breaker(host, config, |state| {
            let next = state.on_failure(now, config.fallback.breaker_failures, cooldown);
            (Some(next), (state.is_closed() && !next.is_closed()).then_some(next.consecutive_failures))
        });
        if let Some(failures) = opened.flatten() {
            host.log(
                LogLevel::Warn,
                &format!("llm-ratelimit: {failures} failed callouts in a row; deciding locally for {cooldown} ms before probing"),
            );
        }
    }

    /// Sends a JSON POST to the companion; returns the callout token.
    pub(crate) fn call_companion(
        &self,
        host: &mut impl Host,
        config: &Policy,
        path: &str,
        message: &impl Serialize,
        timeout: Duration,
        owner: Owner,
    ) -> Result<u32, String> {
        let body = serde_json::to_vec(message).map_err(|e| e.to_string())?;
        let companion = &config.companion;
        let headers = [
            (":method", "POST"),
            (":path", path),
            (":authority", companion.authority()),
            ("content-type", "application/json"),
            (TOKEN_HEADER, companion.token.expose()),
        ];
        host.dispatch(&companion.upstream, &headers, &body, timeout, owner)
            .map_err(|why| format!("callout to {:?} refused by the host: {why}", companion.upstream))
    }

    /// Remembers that lease entries sit at `slots` and when the first of `leases` expires
    /// (should another tenant take such a slot later, the sweep returns that one's leases).
    pub(crate) fn note_leased(&mut self, slots: &[u32], leases: &TenantLeases, now: u64) {
        let Some(expiry) = leases.next_expiry_ms(now) else { return };
        for &slot in slots {
            let due = self.leased.entry(slot).or_insert(expiry);
            *due = (*due).min(expiry);
        }
    }

    // ---- the root's background work ----

    fn send_settlements(&mut self, host: &mut impl Host, config: &Policy) {
        // The breaker is read last: an idle tick makes no call into the host for it.
        if self.settling.is_some() || self.settlements.is_empty() || !self.breaker(host, config).is_closed() {
            return; // one batch at a time; none while the companion is known to be away
        }
        let batch = self.settlements.take_batch(SETTLE_BATCH, host.now_ms());
        if batch.is_empty() {
            return;
        }
        let request = SettlementBatch { settlements: batch.iter().map(|q| q.settlement.clone()).collect() };
        let timeout = config.companion.timeout.max(BACKGROUND_TIMEOUT);
        match self.call_companion(host, config, SETTLE_PATH, &request, timeout, Owner::Root) {
            Ok(token) => self.settling = Some((token, batch)),
            Err(why) => {
                host.log(LogLevel::Warn, &format!("llm-ratelimit: cannot send settlements: {why}"));
                self.requeue(host, batch, None);
            }
        }
    }

    /// Seals the ledger's aggregate as the next batch every second (sooner when it fills
    /// up) and sends the batch out, the same one until the companion acknowledges it;
    /// none while the companion is known to be away, when the aggregate keeps growing
    /// (bounded, see `accounting::ledger`).
    fn send_ledger(&mut self, host: &mut impl Host, config: &Policy) {
        if self.ledger.is_empty() {
            return;
        }
        if self.ticks % LEDGER_TICKS != 0 && self.ledger.rows() < LEDGER_ROWS / 2 {
            return;
        }
        self.ledger.seal();
        if self.ledger.out().is_none_or(|out| out.token.is_some()) || !self.breaker(host, config).is_closed() {
            return;
        }
        let vm = self.ids.ledger_id(host);
        let Some(batch) = self.ledger.to_send(&config.domain, &vm) else { return };
        let timeout = config.companion.timeout.max(BACKGROUND_TIMEOUT);
        match self.call_companion(host, config, LEDGER_PATH, &batch, timeout, Owner::Root) {
            Ok(token) => self.ledger.sent(token),
            Err(why) => host.log(LogLevel::Warn, &format!("llm-ratelimit: cannot send the ledger batch: {why}")),
        }
    }

    fn requeue(
        &mut self,
        host: &mut impl Host,
        batch: Vec<Queued>,
        outcomes: Option<&[crate::protocol::SettleOutcome]>,
    ) {
        let now = host.now_ms();
        let given_up = self.settlements.requeue(batch, outcomes, now);
        if given_up > 0 {
            host.add_metric(Metric::SettlementsFailed, given_up as u64);
            host.log(
                LogLevel::Warn,
                &format!("llm-ratelimit: gave up {given_up} settlement(s); their reservations will expire as charged"),
            );
        }
    }

    /// Renews the slots of this VM's requests in flight, so a long stream keeps its slot
    /// while a crashed proxy's slots expire.
    fn touch_slots(&mut self, host: &mut impl Host, config: &Policy) {
        if config.store == Store::Local {
            let specs: Vec<LimitCharge> = config.limits.iter().map(|limit| limit_charge(limit, 0)).collect();
            for held in self.slots.values() {
                let holder = held.reservation.as_deref().unwrap_or_default();
                crate::effects::local_store::touch(host, config, &held.tenant, &specs, holder);
            }
            return;
        }
        let settlements: Vec<Settlement> = self.slots.values().cloned().collect();
        for chunk in settlements.chunks(SETTLE_BATCH) {
            let request = SettlementBatch { settlements: chunk.to_vec() };
            if let Err(why) = self.call_companion(host, config, TOUCH_PATH, &request, BACKGROUND_TIMEOUT, Owner::Root) {
                host.log(LogLevel::Warn, &format!("llm-ratelimit: cannot renew concurrency slots: {why}"));
            }
        }
    }

    /// Asks for fresh grants for the lease entries that ran low, one callout each, for
    /// the limits each holds (a pool's entry is renewed under the pool's owner id).
    fn renew_leases(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        if self.renewals.is_empty() || !self.breaker(host, config).is_closed() {
            return;
        }
        for (name, indices) in std::mem::take(&mut self.renewals) {
            self.renew(host, config, Holder { name, indices }, now);
        }
    }

    /// Hands the renewal of `entry` this VM holds for its next tick to a request that
    /// found the entry dry: the request asks for it now, as its own callout (whose answer
    /// comes back to it: the SDK routes an answer to the context that dispatched it), and
    /// lifts the marker the renewal set when it answers.
    pub(crate) fn take_renewal(&mut self, entry: &str) -> Option<Holder> {
        let (name, indices) = self.renewals.remove_entry(entry)?;
        Some(Holder { name, indices })
    }

    fn renew(&mut self, host: &mut impl Host, config: &Policy, holder: Holder, now: u64) {
        if self.renewing.values().any(|(h, _)| h.name == holder.name) {
            return;
        }
        let stored = read_own(host, config, TenantTable::Leases, &holder.name);
        let entry = LeaseEntry::decode(stored.as_deref(), config.limits.len());
        let held = TenantLeases(holder.indices.iter().filter_map(|&i| entry.leases.0.get(i).copied()).collect());
        // A renewal charges nothing itself; it sizes the grant by how the lease was used.
        let unused: Vec<LimitCharge> =
            holder.indices.iter().filter_map(|&i| config.limits.get(i)).map(|limit| limit_charge(limit, 0)).collect();
        let request = LeaseRequest {
            domain: config.domain.clone(),
            tenant: holder.name.clone(),
            limits: lease_asks(&held, &unused, &config.lease_policy(), now),
            share: config.lease.share,
        };
        match self.call_companion(host, config, LEASE_PATH, &request, config.companion.timeout, Owner::Root) {
            Ok(token) => {
                host.add_metric(Metric::LeaseCallouts, 1);
                self.renewing.insert(token, (holder, request.limits));
            }
            Err(why) => {
                host.log(LogLevel::Warn, &format!("llm-ratelimit: cannot renew a lease: {why}"));
                // None is out: whoever waits for it asks.
                lease_table::renewal_answered(host, config, &holder);
                self.lease_news(&holder.name);
            }
        }
    }

    /// Gives back to Redis what is left of expired leases.
    fn return_expired_leases(&mut self, host: &mut impl Host, config: &Policy, now: u64) {
        let limits = config.limits.len();
        // Only slots whose first lease has expired are read: a sweep costs what expired,
        // not one shared-data read per tenant served.
        let due: Vec<u32> = self.leased.iter().filter(|(_, &due)| due <= now).map(|(&slot, _)| slot).collect();
        for slot in due {
            let returned = update_slot(host, config, TenantTable::Leases, slot, |tenant, payload| {
                let mut entry = LeaseEntry::decode(Some(payload), limits);
                let amounts = entry.leases.expire(now);
                let changed = amounts.iter().any(|&a| a != 0.0);
                let next_expiry = entry.leases.next_expiry_ms(now);
                (changed.then(|| entry.encode()), (tenant.to_string(), amounts, next_expiry))
            });
            let Some((tenant, amounts, next_expiry)) = returned else {
                self.leased.remove(&slot);
                continue;
            };
            let credits = amounts.iter().enumerate().map(|(i, a)| (i, a.round() as i64));
            self.settle_credits(host, config, &tenant, None, false, &[], credits);
            match next_expiry {
                Some(expiry) => {
                    self.leased.insert(slot, expiry);
                }
                None => {
                    self.leased.remove(&slot);
                }
            }
        }
    }
}

/// The one way a settlement is made.
pub(crate) fn settlement(
    config: &Policy,
    tenant: &str,
    reservation: Option<String>,
    cancel: bool,
    limits: Vec<Adjustment>,
) -> Settlement {
    Settlement {
        domain: config.domain.clone(),
        tenant: tenant.to_string(),
        reservation,
        once: None,
        cancel,
        stand_in: None,
        limits,
    }
}

/// Adjustments of configured limits (by index): buckets and windows with a non-zero
/// credit, and slot limits (released or renewed, whatever the credit), each on the
/// counter of its owner in `owners` (by index; missing: the tenant's); calendar budgets
/// dated at `now_ms`.
pub(crate) fn adjustments(
    config: &Policy,
    owners: &[Option<String>],
    credits: impl Iterator<Item = (usize, i64)>,
    now_ms: u64,
) -> Vec<Adjustment> {
    credits
        .filter_map(|(i, credit)| {
            let limit = config.limits.get(i)?;
            let kind = limit.kind;
            (credit != 0 || kind == LimitKind::Slots).then(|| Adjustment {
                name: limit.name.clone(),
                capacity: limit.capacity(),
                window_ms: limit.window_ms(),
                credit,
                kind,
                period_bounds_ms: limit.period_bounds_ms(now_ms),
                owner: owners.get(i).cloned().flatten(),
            })
        })
        .collect()
}

/// The companion's reply to the callout being delivered, if it is a usable one.
pub(crate) fn callout_reply<T: DeserializeOwned>(host: &mut impl Host, body_size: usize) -> Result<T, String> {
    let status = host.callout_status();
    if status == Some(401) {
        // Not an outage: the companion is up and refuses this filter's token. Every
        // decision stays local until someone fixes the config, so say so loudly, once per
        // VM (not once per request), and count it apart from failures.
        host.add_metric(Metric::CalloutCredentialRefusals, 1);
        host.warn_once(
            "companion-credentials",
            "llm-ratelimit: credential mismatch: the companion refused this filter's token (401); \
             `companion.token` does not match the companion's token, so every decision is made locally \
             (failure_mode) until they match. This is a configuration error, not an outage",
        );
        return Err("companion refused the filter's credentials (401)".into());
    }
    if status != Some(200) {
        return Err(format!("companion answered status {status:?}"));
    }
    serde_json::from_slice(&host.callout_body(body_size)).map_err(|e| format!("companion reply is not valid: {e}"))
}

/// Reservation ids, unique per request across proxies: a per-VM nonce from the clock at
/// first use and the VM's number in its proxy (there is no OS randomness in this wasm
/// target), mixed with a counter. The clock alone is not enough: ngx_wasm_module's has
/// millisecond resolution, and two workers whose first requests fell in the same
/// millisecond drew the same nonce (seen on a real nginx: four requests on two workers
/// left one reservation record, and their settlements one another's).
#[derive(Debug, Default)]
struct ReservationIds {
    nonce: Option<u64>,
    /// This VM's number among the proxy's (see `take_vm_number`); 0 if none was taken.
    vm: u64,
    counter: u64,
}

impl ReservationIds {
    fn next(&mut self, host: &mut impl Host) -> String {
        let vm = self.vm;
        // `mix` is a bijection: VMs with different numbers draw different nonces even when
        // they read the same time.
        let nonce = *self.nonce.get_or_insert_with(|| mix(host.now_nanos() as u64 ^ mix(vm)));
        self.counter += 1;
        // `{:016x}{:x}` of the two, written by hand: every request draws one.
        let mut id = String::with_capacity(32);
        push_hex(&mut id, mix(nonce ^ self.counter), 16);
        let digits = (64 - self.counter.leading_zeros()).div_ceil(4).max(1) as usize;
        push_hex(&mut id, self.counter, digits);
        id
    }
}

impl ReservationIds {
    /// This VM's id in the spend ledger (16 hex digits): its batches are numbered apart
    /// from every other VM's.
    fn ledger_id(&mut self, host: &mut impl Host) -> String {
        let vm = self.vm;
        let nonce = *self.nonce.get_or_insert_with(|| mix(host.now_nanos() as u64 ^ mix(vm)));
        let mut id = String::with_capacity(16);
        push_hex(&mut id, mix(nonce ^ 0x6c65_6467_6572), 16);
        id
    }
}

/// The next number among this proxy's VMs (1, 2, ...), from a counter in shared data.
fn take_vm_number(host: &mut impl Host, domain: &str) -> u64 {
    let taken = shared_update(host, &keys::vm_numbers_key(domain), |stored| {
        let before = stored.and_then(|b| b.get(..8)).and_then(|b| b.try_into().ok()).map_or(0, u64::from_le_bytes);
        let number = before.wrapping_add(1);
        (Some(number.to_le_bytes().to_vec()), number)
    });
    taken.unwrap_or(0)
}

/// The low `digits` hex digits of `value`, most significant first, in lower case.
fn push_hex(out: &mut String, value: u64, digits: usize) {
    for shift in (0..digits).rev() {
        let nibble = ((value >> (4 * shift)) & 0xf) as u8;
        out.push(char::from(if nibble < 10 { b'0' + nibble } else { b'a' + nibble - 10 }));
    }
}

/// splitmix64: spreads a counter into well-mixed bits.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
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

    #[test]
    fn reservation_ids_are_the_hex_of_the_mixed_nonce_and_the_counter() {
        for value in [0u64, 1, 9, 10, 15, 16, 255, 4096, u64::MAX] {
            let digits = (64 - value.leading_zeros()).div_ceil(4).max(1) as usize;
            let mut written = String::new();
            push_hex(&mut written, value, 16);
            push_hex(&mut written, value, digits);
            assert_eq!(written, format!("{value:016x}{value:x}"));
        }
    }
}
