#![cfg(target_arch = "wasm32")]
//! The proxy-wasm glue: reads the config, decides each request, applies the decision,
//! and settles token reservations when replies end. All judgement lives in the pure
//! modules; this layer moves data between them and the host. Host calls go through
//! `host`, which handles every status: a panic here would abort the VM and take the
//! worker's traffic with it.
//!
//! A request's life: headers (identify the tenant) → body, when a limit counts tokens
//! (plan the charge) → a decision, one of:
//! - from this proxy's lease, in shared data, with no callout (lease mode);
//! - from the companion: a charge (or, in lease mode, a new grant), all limits at once;
//! - locally, when the companion fails or the circuit breaker is open (`failure_mode`);
//!
//! → forwarded or answered → reply read for its usage → settled: into the lease, or
//! queued for the companion and sent in batches by the root context.

mod host;

use host::Metric;
use llm_ratelimit_core::breaker::{Breaker, Route};
use llm_ratelimit_core::bucket::{check_and_charge, decode_states, encode_states};
use llm_ratelimit_core::charge::{plan, ChargePlan};
use llm_ratelimit_core::config::{Config, Dimension, FailureMode, MissingIdentity, Mode};
use llm_ratelimit_core::decision::{
    self, Header, LocalReply, DEGRADED_HEADER, QUEUED_HEADER, RESERVED_TOKENS_HEADER, SHADOW_HEADER,
};
use llm_ratelimit_core::identity::{find_credential, tenant_id, ANONYMOUS_TENANT};
use llm_ratelimit_core::lease::{lease_asks, TenantLeases};
use llm_ratelimit_core::protocol::{
    Adjustment, ChargeRequest, LeaseAsk, LeaseRequest, LimitCharge, LimitKind, LimitsReply, Reservation, SettleOutcome,
    SettleReply, Settlement, SettlementBatch, Wait, CHARGE_PATH, LEASE_PATH, RELEASE_PATH, SETTLE_PATH, TOKEN_HEADER,
    TOUCH_PATH,
};
use llm_ratelimit_core::reservation::{actual_usage, credit, Ending, OutputAverage, TokenEstimate};
use llm_ratelimit_core::settle_queue::{Queued, SettleQueue};
use llm_ratelimit_core::sse::UsageChunkRemover;
use llm_ratelimit_core::usage::{ReplyUsage, ReportedUsage, StreamUsage};
use llm_ratelimit_protocol::keys::{self, average_key};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, HashMap};
use std::rc::Rc;
use std::time::Duration;

/// How often each VM sends queued settlements, renews leases (and, once, warms the
/// tokenizer).
const TICK: Duration = Duration::from_millis(50);
/// How often expired leases are looked for, in ticks.
const EXPIRY_TICKS: u32 = 10;
const SETTLE_BATCH: usize = 200;
const SETTLE_QUEUE_CAPACITY: usize = 20_000;
/// Largest SSE event read for usage; larger ones are skipped.
const MAX_SSE_EVENT: usize = 1 << 20;
/// A JSON reply up to this size is parsed whole; past it only its tail is kept.
const REPLY_WINDOW: usize = 256 * 1024;
/// How long after its longest wait an abandoned request's cancellation may still arrive.
const CANCEL_WINDOW_MS: u64 = 10_000;
/// In the degraded mode a concurrency limit is a bucket that does not refill (a slot comes
/// back when its request ends); this window makes the refill negligible.
const LOCAL_SLOTS_NEVER_REFILL_MS: u64 = u64::MAX / 4;

thread_local! {
    static SETTLEMENTS: RefCell<SettleQueue> = RefCell::new(SettleQueue::new(SETTLE_QUEUE_CAPACITY));
    /// Tenants whose leases this VM saw running low: the root renews them.
    static RENEWALS: RefCell<BTreeSet<String>> = const { RefCell::new(BTreeSet::new()) };
    /// Tenants this VM holds leases for: the root returns what expires.
    static LEASED: RefCell<BTreeSet<String>> = const { RefCell::new(BTreeSet::new()) };
    /// Concurrency slots held by this VM's requests, by reservation id: renewed by the
    /// root until the request releases them.
    static SLOTS: RefCell<HashMap<String, Settlement>> = RefCell::new(HashMap::new());
    static RESERVATION_COUNTER: Cell<u64> = const { Cell::new(0) };
    /// This VM's root context, which owns callouts that must outlive a request.
    static ROOT_ID: Cell<u32> = const { Cell::new(0) };
    static VM_NONCE: Cell<u64> = const { Cell::new(0) };
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        ROOT_ID.with(|id| id.set(context_id));
        Box::new(Root { config: None, warmed_up: false, ticks: 0, settling: None, renewing: HashMap::new() })
    });
}}

/// splitmix64: spreads a counter into well-mixed bits.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Unique per request across proxies: a per-VM nonce from the clock at first use (there
/// is no OS randomness in this wasm target), mixed with a per-VM counter.
fn new_reservation_id() -> String {
    let nonce = VM_NONCE.with(|n| {
        if n.get() == 0 {
            n.set(mix(host::now_nanos() as u64) | 1);
        }
        n.get()
    });
    let count = RESERVATION_COUNTER.with(|c| {
        c.set(c.get() + 1);
        c.get()
    });
    format!("{:016x}{count:x}", mix(nonce ^ count))
}

fn lease_key(config: &Config, tenant: &str) -> String {
    keys::lease_key(&config.domain, tenant)
}

fn local_key(config: &Config, tenant: &str) -> String {
    keys::local_key(&config.domain, tenant)
}

fn queue_key(config: &Config) -> String {
    keys::queued_key(&config.domain)
}

fn breaker_key(config: &Config) -> String {
    keys::breaker_key(&config.domain)
}

fn breaker(config: &Config) -> Breaker {
    host::shared_get(&breaker_key(config)).and_then(|b| Breaker::from_bytes(&b)).unwrap_or_default()
}

fn callout_succeeded(config: &Config) {
    let state = breaker(config);
    if state != Breaker::default() {
        host::shared_set(&breaker_key(config), &state.on_success().to_bytes());
        if !state.is_closed() {
            log::info!("llm-ratelimit: the companion answers again; leaving degraded mode");
        }
    }
}

fn callout_failed(config: &Config) {
    let state = breaker(config);
    let cooldown = config.fallback.breaker_cooldown.0.as_millis() as u64;
    let next = state.on_failure(host::now_ms(), config.fallback.breaker_failures, cooldown);
    if state.is_closed() && !next.is_closed() {
        log::warn!(
            "llm-ratelimit: {} failed callouts in a row; deciding locally for {cooldown} ms before probing",
            next.consecutive_failures
        );
    }
    host::shared_set(&breaker_key(config), &next.to_bytes());
}

fn queue_settlement(settlement: Settlement) {
    if SETTLEMENTS.with(|q| q.borrow_mut().push(settlement)).is_some() {
        host::increment(Metric::SettlementsFailed);
    }
}

/// Adjustments of configured limits (by index): token buckets with a non-zero credit,
/// and slot limits (released or renewed, whatever the credit).
fn adjustments(config: &Config, credits: impl Iterator<Item = (usize, i64)>) -> Vec<Adjustment> {
    credits
        .filter_map(|(i, credit)| {
            let limit = config.limits.get(i)?;
            let kind = limit.kind();
            (credit != 0 || kind == LimitKind::Slots).then(|| Adjustment {
                name: limit.name.clone(),
                capacity: limit.capacity(),
                window_ms: limit.window_ms(),
                credit,
                kind,
            })
        })
        .collect()
}

fn call_companion(config: &Config, path: &str, body: &[u8], timeout: Duration) -> Result<u32, String> {
    let companion = &config.companion;
    let headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", companion.authority()),
        ("content-type", "application/json"),
        (TOKEN_HEADER, companion.token.expose()),
    ];
    host::dispatch(&companion.upstream, headers, body, timeout)
}

/// The companion's reply to a callout, if it is a usable one.
fn callout_reply<T: serde::de::DeserializeOwned>(body_size: usize) -> Result<T, String> {
    let status = host::callout_status();
    if status != Some(200) {
        return Err(format!("companion answered status {status:?}"));
    }
    serde_json::from_slice(&host::callout_body(body_size)).map_err(|e| format!("companion reply is not valid: {e}"))
}

struct Root {
    config: Option<Rc<Config>>,
    warmed_up: bool,
    ticks: u32,
    /// The settlement batch whose callout is out, by its token.
    settling: Option<(u32, Vec<Queued>)>,
    /// Lease renewals out, by token: the tenant and the buckets asked for.
    renewing: HashMap<u32, (String, Vec<LeaseAsk>)>,
}

impl Root {
    fn send_settlements(&mut self, config: &Config) {
        if self.settling.is_some() || !breaker(config).is_closed() {
            return; // one batch at a time; none while the companion is known to be away
        }
        let batch = SETTLEMENTS.with(|q| q.borrow_mut().take_batch(SETTLE_BATCH));
        if batch.is_empty() {
            return;
        }
        let request = SettlementBatch { settlements: batch.iter().map(|q| q.settlement.clone()).collect() };
        let timeout = config.companion.timeout.0.max(Duration::from_secs(1));
        let sent = serde_json::to_vec(&request)
            .map_err(|e| e.to_string())
            .and_then(|body| call_companion(config, SETTLE_PATH, &body, timeout));
        match sent {
            Ok(token) => self.settling = Some((token, batch)),
            Err(why) => {
                log::warn!("llm-ratelimit: cannot send settlements: {why}");
                requeue(batch, None);
            }
        }
    }

    /// Renews the slots of this VM's requests in flight, so a long stream keeps its slot
    /// while a crashed proxy's slots expire.
    fn touch_slots(&mut self, config: &Config) {
        let settlements: Vec<Settlement> = SLOTS.with(|s| s.borrow().values().cloned().collect());
        for chunk in settlements.chunks(SETTLE_BATCH) {
            let request = SettlementBatch { settlements: chunk.to_vec() };
            let sent = serde_json::to_vec(&request)
                .map_err(|e| e.to_string())
                .and_then(|body| call_companion(config, TOUCH_PATH, &body, Duration::from_secs(1)));
            if let Err(why) = sent {
                log::warn!("llm-ratelimit: cannot renew concurrency slots: {why}");
            }
        }
    }

    /// Asks for fresh grants for the tenants whose leases ran low, one callout each.
    fn renew_leases(&mut self, config: &Config) {
        if !breaker(config).is_closed() {
            return;
        }
        let tenants: Vec<String> = RENEWALS.with(|r| std::mem::take(&mut *r.borrow_mut()).into_iter().collect());
        let now = host::now_ms();
        let policy = config.lease.policy();
        for tenant in tenants {
            if self.renewing.values().any(|(t, _)| *t == tenant) {
                continue;
            }
            let leases =
                TenantLeases::decode(host::shared_get(&lease_key(config, &tenant)).as_deref(), config.limits.len());
            let zero: Vec<LimitCharge> = config
                .limits
                .iter()
                .map(|limit| LimitCharge {
                    name: limit.name.clone(),
                    capacity: limit.capacity(),
                    window_ms: limit.window_ms(),
                    cost: 0,
                    min_cost: None,
                    kind: limit.kind(),
                })
                .collect();
            let limits = lease_asks(&leases, &zero, &policy, now);
            let request = LeaseRequest {
                domain: config.domain.clone(),
                tenant: tenant.clone(),
                limits: limits.clone(),
                share: config.lease.share,
            };
            let sent = serde_json::to_vec(&request)
                .map_err(|e| e.to_string())
                .and_then(|body| call_companion(config, LEASE_PATH, &body, config.companion.timeout.0));
            match sent {
                Ok(token) => {
                    host::increment(Metric::LeaseCallouts);
                    self.renewing.insert(token, (tenant, limits));
                }
                Err(why) => log::warn!("llm-ratelimit: cannot renew a lease: {why}"),
            }
        }
    }

    /// Gives back to Redis what is left of expired leases.
    fn return_expired_leases(&mut self, config: &Config) {
        let now = host::now_ms();
        let tenants: Vec<String> = LEASED.with(|l| l.borrow().iter().cloned().collect());
        for tenant in tenants {
            let key = lease_key(config, &tenant);
            let returned = host::shared_update(&key, |bytes| {
                let mut leases = TenantLeases::decode(bytes, config.limits.len());
                let amounts = leases.expire(now);
                let changed = amounts.iter().any(|&a| a != 0.0);
                let idle = leases.0.iter().all(|l| !l.is_live(now));
                (changed.then(|| leases.encode()), (amounts, idle))
            });
            let Some((amounts, idle)) = returned else { continue };
            let limits = adjustments(config, amounts.iter().enumerate().map(|(i, a)| (i, a.round() as i64)));
            if !limits.is_empty() {
                queue_settlement(Settlement {
                    domain: config.domain.clone(),
                    tenant: tenant.clone(),
                    reservation: None,
                    cancel: false,
                    limits,
                });
            }
            if idle {
                LEASED.with(|l| l.borrow_mut().remove(&tenant));
            }
        }
    }

    fn on_renewal(&mut self, config: &Config, tenant: String, limits: Vec<LeaseAsk>, body_size: usize) {
        match callout_reply::<LimitsReply>(body_size) {
            Ok(reply) if reply.allowed && reply.limits.len() == limits.len() => {
                callout_succeeded(config);
                merge_grant(config, &tenant, &reply, None);
            }
            Ok(_) => {}
            Err(why) => {
                callout_failed(config);
                log::warn!("llm-ratelimit: lease renewal failed: {why}");
            }
        }
    }
}

fn requeue(batch: Vec<Queued>, outcomes: Option<&[SettleOutcome]>) {
    let given_up = SETTLEMENTS.with(|q| q.borrow_mut().requeue(batch, outcomes));
    if given_up > 0 {
        host::add(Metric::SettlementsFailed, given_up as u64);
        log::warn!("llm-ratelimit: gave up {given_up} settlement(s); their reservations will expire as charged");
    }
}

/// Adds a lease grant to the tenant's leases and, when `costs` are given, admits a request
/// from them: the grant covered at least its need, so the admission stands even if
/// another worker spent the lease in between (the lease then runs briefly negative).
fn merge_grant(config: &Config, tenant: &str, reply: &LimitsReply, costs: Option<&[u64]>) -> Option<TenantLeases> {
    let now = host::now_ms();
    let policy = config.lease.policy();
    let merged = host::shared_update(&lease_key(config, tenant), |bytes| {
        let mut leases = TenantLeases::decode(bytes, config.limits.len());
        for (lease, outcome) in leases.0.iter_mut().zip(&reply.limits) {
            lease.add_grant(outcome.charged as f64, outcome.remaining as f64, &policy, now);
        }
        if let Some(costs) = costs {
            if !leases.admit(costs, now) {
                for (lease, &cost) in leases.0.iter_mut().zip(costs) {
                    lease.remaining -= cost as f64;
                }
            }
        }
        (Some(leases.encode()), leases)
    });
    LEASED.with(|l| l.borrow_mut().insert(tenant.to_string()));
    merged
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some(config) = self.config.clone() else { return };
        if let Some((tenant, limits)) = self.renewing.remove(&token) {
            self.on_renewal(&config, tenant, limits, body_size);
            return;
        }
        let Some((expected, batch)) = self.settling.take() else { return };
        if expected != token {
            self.settling = Some((expected, batch));
            return;
        }
        match callout_reply::<SettleReply>(body_size) {
            Ok(reply) if reply.results.len() == batch.len() => requeue(batch, Some(&reply.results)),
            _ => requeue(batch, None),
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = host::plugin_configuration();
        match Config::from_json(&bytes) {
            Ok(config) => {
                host::define_metrics();
                log::info!(
                    "llm-ratelimit: configured {} limit(s) in domain {:?}, companion {:?}{}",
                    config.limits.len(),
                    config.domain,
                    config.companion.upstream,
                    if config.lease.enabled { ", leases on" } else { "" }
                );
                host::set_tick_period(TICK);
                if config.lease.enabled {
                    // The most of each limit one proxy can hold unused in a tenant's lease:
                    // what leases can cost other proxies (they never let proxies admit more).
                    for limit in &config.limits {
                        let bound = (limit.capacity() as f64 * config.lease.max_fraction).ceil() as u64;
                        host::gauge(&format!("llm_ratelimit.lease_bound.{}", limit.name), bound);
                    }
                }
                self.config = Some(Rc::new(config));
                self.warmed_up = false;
                true
            }
            Err(err) => {
                // Returning false makes the host refuse the config; this line says why.
                log::error!("llm-ratelimit: {err}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        let Some(config) = self.config.clone() else { return };
        if !self.warmed_up && config.tokens.warm_up && config.counts_tokens() {
            self.warmed_up = true;
            config.tokens.default_encoding.warm_up();
            for rule in &config.tokens.models {
                rule.encoding.warm_up();
            }
        }
        self.ticks = self.ticks.wrapping_add(1);
        if config.lease.enabled {
            self.renew_leases(&config);
            if self.ticks % EXPIRY_TICKS == 0 {
                self.return_expired_leases(&config);
            }
        }
        self.send_settlements(&config);
        if config.has_concurrency() {
            let every = (config.slots.ttl.0.as_millis() / 3 / TICK.as_millis()).max(1) as u32;
            if self.ticks % every == 0 {
                self.touch_slots(&config);
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; a VM whose config was refused gets pass-through contexts.
        Some(Box::new(RequestFilter::new(self.config.clone(), context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Headers not seen yet, or no config.
    Starting,
    /// Waiting for the end of the request body, to count it.
    ReadingBody,
    /// A callout is out; the request waits.
    Deciding,
    /// Admitted and sent upstream.
    Forwarded,
    /// Answered by the filter.
    Replied,
}

/// What the outstanding callout asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ask {
    /// Charge the request in Redis (direct mode).
    Charge,
    /// Grant this proxy a lease that covers the request (lease mode).
    Lease,
}

/// Where the request's tokens were taken from, so its settlement goes back there.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Admission {
    /// Charged in Redis under this reservation.
    Reserved(String),
    /// Taken from this proxy's lease.
    Leased,
    /// Decided locally while the companion was away; reconciled with Redis later.
    Local,
}

/// Reads the reply for its usage.
enum ReplyReader {
    Json(ReplyUsage),
    Stream(StreamUsage),
}

struct RequestFilter {
    config: Option<Rc<Config>>,
    context_id: u32,
    phase: Phase,
    tenant: String,
    plan: Option<ChargePlan>,
    ask: Ask,
    /// Set once admitted, until settled.
    admission: Option<Admission>,
    /// Added to the upstream's response once it arrives.
    response_headers: Vec<Header>,
    reply: Option<ReplyReader>,
    upstream_error: bool,
    /// Present when the filter asked for stream usage the client did not.
    usage_remover: Option<UsageChunkRemover>,
    /// Size of the request body as read, for replacing it.
    body_len: usize,
    /// The charge may wait in the queue: this request counts against its length.
    queued: bool,
    /// The tenant's tier, when tiers are configured.
    tier: String,
}

/// What to do with the paused request.
enum Verdict {
    Forward(Vec<Header>),
    Reply(LocalReply),
}

impl Verdict {
    /// The same verdict, its response carrying one more header.
    fn with_header(mut self, name: &'static str, value: String) -> Verdict {
        match &mut self {
            Verdict::Forward(headers) => headers.push((name, value)),
            Verdict::Reply(reply) => reply.headers.push((name, value)),
        }
        self
    }
}

impl RequestFilter {
    fn new(config: Option<Rc<Config>>, context_id: u32) -> RequestFilter {
        RequestFilter {
            config,
            context_id,
            phase: Phase::Starting,
            tenant: String::new(),
            plan: None,
            ask: Ask::Charge,
            admission: None,
            response_headers: Vec::new(),
            reply: None,
            upstream_error: false,
            usage_remover: None,
            body_len: 0,
            queued: false,
            tier: String::new(),
        }
    }

    fn identify(&self, config: &Config) -> Result<String, Verdict> {
        match (find_credential(&config.identity.sources, host::request_header), config.identity.missing) {
            (Some(credential), _) => Ok(tenant_id(&credential)),
            (None, MissingIdentity::Anonymous) => Ok(ANONYMOUS_TENANT.to_string()),
            (None, MissingIdentity::Reject) => {
                host::increment(Metric::Unidentified);
                Err(Verdict::Reply(decision::missing_identity()))
            }
        }
    }

    fn costs(&self) -> Vec<u64> {
        self.plan.as_ref().map(|p| p.buckets.iter().map(|b| b.cost).collect()).unwrap_or_default()
    }

    /// Plans the charge and decides it. `body` is `None` when no limit counts tokens.
    fn charge(&mut self, config: &Config, body: Option<&[u8]>) -> Action {
        let path = host::request_header(":path").unwrap_or_default();
        let tier_value = config.tier.as_ref().and_then(|t| host::request_header(&t.header));
        let tier = config.tier_of(&self.tenant, tier_value.as_deref());
        self.tier = tier.to_string();
        let plan = plan(config, &path, tier, body, |model| {
            host::shared_get(&average_key(&config.domain, &self.tenant, model))
                .and_then(|b| OutputAverage::from_bytes(&b))
        });
        self.body_len = body.map_or(0, <[u8]>::len);
        let unpriced = plan.unpriced.then(|| plan.model.clone());
        self.plan = Some(plan);
        if let Some(model) = unpriced {
            return self.apply(Verdict::Reply(decision::model_not_priced(&model)), false);
        }
        if config.lease.enabled {
            if let Some(verdict) = self.admit_from_lease(config) {
                return self.apply(verdict, false);
            }
        }
        let cooldown = config.fallback.breaker_cooldown.0.as_millis() as u64;
        let (route, probe) = breaker(config).route(host::now_ms(), cooldown);
        if let Some(probe) = probe {
            host::shared_set(&breaker_key(config), &probe.to_bytes());
        }
        if route == Route::Local {
            let verdict = self.fail_over(config, "circuit breaker open");
            return self.apply(verdict, false);
        }
        match self.send(config) {
            Ok(()) => {
                self.phase = Phase::Deciding;
                Action::Pause
            }
            Err(why) => {
                let verdict = self.callout_failed(config, &why);
                self.apply(verdict, false)
            }
        }
    }

    /// Sends the callout the mode calls for: a lease covering the request, or the charge.
    fn send(&mut self, config: &Config) -> Result<(), String> {
        // In shadow mode nothing waits: the queue would enforce.
        let wait = if config.lease.enabled || config.mode == Mode::Shadow { None } else { self.join_queue(config) };
        let Some(plan) = self.plan.as_ref() else { return Err("no plan".into()) };
        let (path, body) = if config.lease.enabled {
            self.ask = Ask::Lease;
            host::increment(Metric::LeaseCallouts);
            let now = host::now_ms();
            let policy = config.lease.policy();
            let leases =
                TenantLeases::decode(host::shared_get(&lease_key(config, &self.tenant)).as_deref(), plan.buckets.len());
            let limits = lease_asks(&leases, &plan.buckets, &policy, now);
            let request = LeaseRequest {
                domain: config.domain.clone(),
                tenant: self.tenant.clone(),
                limits,
                share: config.lease.share,
            };
            (LEASE_PATH, serde_json::to_vec(&request))
        } else {
            self.ask = Ask::Charge;
            // A reservation records tokens to settle, and names the request's slots and
            // its place in the queue.
            let reservation =
                (plan.estimate.is_some() || config.has_concurrency() || wait.is_some()).then(new_reservation_id);
            if let Some(id) = &reservation {
                self.admission = Some(Admission::Reserved(id.clone()));
            }
            let request = ChargeRequest {
                domain: config.domain.clone(),
                tenant: self.tenant.clone(),
                limits: plan.buckets.clone(),
                // Only tokens are settled against the record; slots and the queue use the id.
                reservation: reservation.map(|id| Reservation {
                    id,
                    // A waiting charge keeps a record too: if its client gives up, the refund
                    // of what it took is settled against it.
                    // (only while it may still be cancelled, when there are no tokens to settle).
                    ttl_ms: match (plan.estimate, &wait) {
                        (Some(_), _) => config.tokens.reservation_ttl.0.as_millis() as u64,
                        (None, Some(wait)) => wait.max_ms + CANCEL_WINDOW_MS,
                        (None, None) => 0,
                    },
                }),
                wait,
            };
            (CHARGE_PATH, serde_json::to_vec(&request))
        };
        let body = body.map_err(|e| e.to_string())?;
        let timeout = config.companion.timeout.0 + if self.queued { config.queue.max_wait.0 } else { Duration::ZERO };
        call_companion(config, path, &body, timeout).map(|_token| ())
    }

    /// Takes a place in the queue, if queueing is on and this proxy's queue has room: the
    /// charge may then wait for capacity, in the companion, at this request's priority.
    fn join_queue(&mut self, config: &Config) -> Option<Wait> {
        let queue = &config.queue;
        if !queue.enabled() {
            return None;
        }
        let joined = host::shared_update(&queue_key(config), |bytes| {
            let waiting = bytes.and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes);
            let room = waiting < queue.max_length;
            (room.then(|| (waiting + 1).to_le_bytes().to_vec()), room)
        });
        if joined != Some(true) {
            return None;
        }
        self.queued = true;
        let priority = queue
            .priority_header
            .as_deref()
            .and_then(host::request_header)
            .and_then(|value| value.trim().parse::<u8>().ok())
            .filter(|p| *p <= 9)
            .or_else(|| queue.tier_priorities.get(&self.tier).copied())
            .unwrap_or(queue.default_priority);
        Some(Wait { max_ms: queue.max_wait.0.as_millis() as u64, priority, aging_ms: queue.aging.0.as_millis() as u64 })
    }

    fn leave_queue(&mut self, config: &Config) {
        if std::mem::take(&mut self.queued) {
            host::shared_update(&queue_key(config), |bytes| {
                let waiting = bytes.and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes);
                (Some(waiting.saturating_sub(1).to_le_bytes().to_vec()), ())
            });
        }
    }

    /// Admits from this proxy's lease, if it covers the request, or refuses it if Redis
    /// recently refused as much; `None` means: ask. Marks the tenant for renewal when the
    /// lease runs low.
    fn admit_from_lease(&mut self, config: &Config) -> Option<Verdict> {
        let costs = self.costs();
        let specs = self.plan.as_ref().map(|p| p.buckets.clone()).unwrap_or_default();
        let now = host::now_ms();
        let policy = config.lease.policy();
        let (outcome, renew, leases) = host::shared_update(&lease_key(config, &self.tenant), |bytes| {
            let mut leases = TenantLeases::decode(bytes, costs.len());
            if !leases.admit(&costs, now) {
                let refusal = leases.refusal(&specs, now);
                return (None, (refusal.map(Err), false, leases));
            }
            let renew = leases.0.iter().any(|l| l.wants_renewal(&policy, now));
            if renew {
                for lease in &mut leases.0 {
                    lease.renewal_asked_ms = now;
                }
            }
            (Some(leases.encode()), (Some(Ok(())), renew, leases))
        })?;
        if renew {
            RENEWALS.with(|r| r.borrow_mut().insert(self.tenant.clone()));
        }
        match outcome? {
            Ok(()) => {
                host::increment(Metric::LeaseAdmissions);
                Some(self.admitted_from_lease(config, &leases))
            }
            Err(refusal) => {
                host::increment(Metric::Limited);
                let reserved = self.plan.as_ref().and_then(|p| p.estimate).map_or(0, |e| e.total());
                Some(Verdict::Reply(decision::rejection(&self.relevant(&refusal), config, reserved)))
            }
        }
    }

    fn admitted_from_lease(&mut self, config: &Config, leases: &TenantLeases) -> Verdict {
        host::increment(Metric::Allowed);
        LEASED.with(|l| l.borrow_mut().insert(self.tenant.clone()));
        self.admission = Some(Admission::Leased);
        let buckets = self.plan.as_ref().map(|p| p.buckets.clone()).unwrap_or_default();
        Verdict::Forward(self.admitted_headers(config, &leases.as_reply(&buckets)))
    }

    /// The reply as it concerns this request: the limits that apply to it.
    fn relevant(&self, reply: &LimitsReply) -> LimitsReply {
        self.plan.as_ref().map_or_else(|| reply.clone(), |plan| plan.relevant(reply))
    }

    fn admitted_headers(&mut self, config: &Config, reply: &LimitsReply) -> Vec<Header> {
        let mut headers = decision::rate_limit_headers(&self.relevant(reply), config);
        if let Some(reserved) = self.plan.as_ref().and_then(|p| p.estimate).map(|e| e.total()) {
            host::add(Metric::TokensReserved, reserved);
            headers.push((RESERVED_TOKENS_HEADER, reserved.to_string()));
        }
        headers
    }

    fn decide(&mut self, config: &Config, body_size: usize) -> Verdict {
        let expected = self.plan.as_ref().map_or(0, |p| p.buckets.len());
        let reply = match callout_reply::<LimitsReply>(body_size) {
            Ok(reply) if reply.limits.len() == expected => reply,
            Ok(_) => return self.callout_failed(config, "companion reply has the wrong number of limits"),
            Err(why) => return self.callout_failed(config, &why),
        };
        callout_succeeded(config);
        self.leave_queue(config);
        if reply.waited_ms > 0 {
            host::increment(Metric::Queued);
            host::add(Metric::QueuedMs, reply.waited_ms);
        }
        let waited = reply.waited_ms;
        let verdict = self.decide_reply(config, reply);
        if waited == 0 {
            return verdict;
        }
        verdict.with_header(QUEUED_HEADER, waited.to_string())
    }

    fn decide_reply(&mut self, config: &Config, reply: LimitsReply) -> Verdict {
        if !reply.allowed {
            host::increment(Metric::Limited);
            self.admission = None; // nothing was charged
            if self.ask == Ask::Lease {
                // Later requests that need as much are refused here until the retry time.
                let (costs, now) = (self.costs(), host::now_ms());
                host::shared_update(&lease_key(config, &self.tenant), |bytes| {
                    let mut leases = TenantLeases::decode(bytes, costs.len());
                    leases.block(&reply, &costs, now);
                    (Some(leases.encode()), ())
                });
            }
            let reserved = self.plan.as_ref().and_then(|p| p.estimate).map_or(0, |e| e.total());
            return Verdict::Reply(decision::rejection(&self.relevant(&reply), config, reserved));
        }
        match self.ask {
            Ask::Lease => {
                let costs = self.costs();
                match merge_grant(config, &self.tenant, &reply, Some(&costs)) {
                    Some(leases) => self.admitted_from_lease(config, &leases),
                    None => self.fail_over(config, "cannot record the lease"),
                }
            }
            Ask::Charge => {
                host::increment(Metric::Allowed);
                self.rewrite_body(config, &reply);
                if let (true, Some(Admission::Reserved(id))) = (config.has_concurrency(), &self.admission) {
                    let costs = self.costs();
                    let slots = config
                        .limits
                        .iter()
                        .enumerate()
                        .filter(|(i, l)| l.kind() == LimitKind::Slots && costs.get(*i).is_some_and(|&c| c > 0));
                    let settlement = Settlement {
                        domain: config.domain.clone(),
                        tenant: self.tenant.clone(),
                        reservation: Some(id.clone()),
                        cancel: false,
                        limits: adjustments(config, slots.map(|(i, _)| (i, 0))),
                    };
                    SLOTS.with(|s| s.borrow_mut().insert(id.clone(), settlement));
                }
                Verdict::Forward(self.admitted_headers(config, &reply))
            }
        }
    }

    fn callout_failed(&mut self, config: &Config, why: &str) -> Verdict {
        self.leave_queue(config);
        host::increment(Metric::CompanionFailures);
        callout_failed(config);
        self.fail_over(config, why)
    }

    /// Decides without the companion, as `failure_mode` says.
    fn fail_over(&mut self, config: &Config, why: &str) -> Verdict {
        self.admission = None; // nothing was charged in Redis
        log::debug!("llm-ratelimit: no decision from the companion ({why}); failure_mode {:?}", config.failure_mode);
        match config.failure_mode {
            FailureMode::Local => self.decide_locally(config),
            FailureMode::Allow => Verdict::Forward(vec![(DEGRADED_HEADER, "companion-unavailable".to_string())]),
            FailureMode::Deny => Verdict::Reply(decision::limiter_unavailable()),
        }
    }

    /// The degraded mode: each limit divided by `fallback.instances`, as token buckets in
    /// shared data, decided with the same model the Lua script follows. What is admitted
    /// is queued as a debit, so Redis learns of it when it is back.
    fn decide_locally(&mut self, config: &Config) -> Verdict {
        host::increment(Metric::LocalDecisions);
        let instances = u64::from(config.fallback.instances);
        let specs: Vec<LimitCharge> = self
            .plan
            .as_ref()
            .map(|p| {
                p.buckets
                    .iter()
                    .map(|b| LimitCharge {
                        capacity: b.capacity.div_ceil(instances),
                        min_cost: None,
                        // A slot comes back when its request ends, not with time.
                        window_ms: if b.kind == LimitKind::Slots { LOCAL_SLOTS_NEVER_REFILL_MS } else { b.window_ms },
                        ..b.clone()
                    })
                    .collect()
            })
            .unwrap_or_default();
        let now = host::now_ms() as f64;
        let reply = host::shared_update(&local_key(config, &self.tenant), |bytes| {
            let mut states = decode_states(bytes, specs.len());
            let reply = check_and_charge(&mut states, &specs, now);
            (reply.allowed.then(|| encode_states(&states)), reply)
        });
        let Some(reply) = reply else {
            return Verdict::Reply(decision::limiter_unavailable());
        };
        if !reply.allowed {
            host::increment(Metric::Limited);
            let reserved = self.plan.as_ref().and_then(|p| p.estimate).map_or(0, |e| e.total());
            let rejection = Verdict::Reply(decision::rejection(&self.relevant(&reply), config, reserved));
            return rejection.with_header(DEGRADED_HEADER, "local".to_string());
        }
        host::increment(Metric::Allowed);
        // Redis learns of the budget spent here; slots are this proxy's alone.
        let debits = specs.iter().enumerate().filter(|(_, b)| b.kind != LimitKind::Slots);
        let limits = adjustments(config, debits.map(|(i, b)| (i, -(b.cost as i64))));
        if !limits.is_empty() {
            queue_settlement(Settlement {
                domain: config.domain.clone(),
                tenant: self.tenant.clone(),
                reservation: None,
                cancel: false,
                limits,
            });
        }
        self.admission = Some(Admission::Local);
        Verdict::Forward(self.admitted_headers(config, &reply)).with_header(DEGRADED_HEADER, "local".to_string())
    }

    /// Sends upstream the body the charge calls for: the output cap clamped to what was
    /// granted, stream usage requested. Only while the headers are still held can
    /// content-length follow the new body, so nothing changes otherwise.
    fn rewrite_body(&mut self, config: &Config, reply: &LimitsReply) {
        let Some(plan) = self.plan.as_mut() else { return };
        if !config.hold_request_headers {
            return;
        }
        let charged = plan
            .token_buckets(config)
            .next()
            .and_then(|b| reply.limits.iter().find(|o| o.name == b.name))
            .map(|o| o.charged);
        let Some(body) = plan.apply_grant(config, charged) else { return };
        if host::replace_request_body(self.body_len, &body)
            && host::set_request_header("content-length", &body.len().to_string())
            && config.tokens.request_stream_usage
            && plan.request.as_ref().is_some_and(|r| r.wants_usage_added())
        {
            self.usage_remover = Some(UsageChunkRemover::default());
        }
    }

    /// Carries a verdict out. `paused` says whether the request is waiting on us. In
    /// shadow mode a refusal is forwarded instead, marked with what it would have been.
    fn apply(&mut self, verdict: Verdict, paused: bool) -> Action {
        let shadow = self.config.as_ref().is_some_and(|c| c.mode == Mode::Shadow);
        let verdict = match verdict {
            Verdict::Reply(reply) if shadow && matches!(reply.status, 403 | 413 | 429 | 503) => {
                host::increment(Metric::ShadowRefusals);
                let mut headers: Vec<Header> = reply
                    .headers
                    .into_iter()
                    .filter(|(name, _)| *name != "retry-after" && *name != "content-type")
                    .collect();
                headers.push((SHADOW_HEADER, reply.status.to_string()));
                Verdict::Forward(headers)
            }
            other => other,
        };
        match verdict {
            Verdict::Forward(headers) => {
                self.phase = Phase::Forwarded;
                self.response_headers = headers;
                if paused {
                    host::resume_request();
                }
                Action::Continue
            }
            Verdict::Reply(reply) => {
                self.phase = Phase::Replied;
                self.response_headers.clear();
                host::send_reply(&reply);
                Action::Pause
            }
        }
    }

    /// Settles this request, once: the difference between what it reserved and what it
    /// cost (in tokens, and in money for budgets) goes back where the reservation came
    /// from, and its slots are released.
    fn settle(&mut self, config: &Config, ending: Ending) {
        let Some(admission) = self.admission.take() else { return };
        let (token_credit, cost_credit) = self.credits(config, ending);
        // Only the limits this request was charged against (per-model limits may not apply),
        // each with the credit of its dimension.
        let credits: Vec<(usize, i64)> = config
            .limits
            .iter()
            .enumerate()
            .filter(|(i, _)| self.plan.as_ref().is_some_and(|p| p.applies(*i)))
            .filter_map(|(i, limit)| match limit.dimension() {
                Dimension::Tokens => Some((i, token_credit)),
                Dimension::Cost => Some((i, cost_credit)),
                _ => None,
            })
            .collect();
        let slot_limits: Vec<usize> = config
            .limits
            .iter()
            .enumerate()
            .filter(|(i, l)| l.kind() == LimitKind::Slots && self.plan.as_ref().is_some_and(|p| p.applies(*i)))
            .map(|(i, _)| i)
            .collect();
        let reservation = match admission {
            Admission::Reserved(id) => {
                if let Some(slots) = SLOTS.with(|s| s.borrow_mut().remove(&id)) {
                    self.release_now(config, slots);
                }
                Some(id)
            }
            Admission::Local => {
                // This proxy's own slots go back at once; the credits go to Redis.
                if !slot_limits.is_empty() {
                    self.release_local_slots(config, &slot_limits);
                }
                None
            }
            Admission::Leased => {
                let now = host::now_ms();
                let applied = host::shared_update(&lease_key(config, &self.tenant), |bytes| {
                    let mut leases = TenantLeases::decode(bytes, config.limits.len());
                    let live = credits.iter().all(|&(i, credit)| leases.credit(i, credit, now));
                    (live.then(|| leases.encode()), live)
                });
                if applied == Some(true) || credits.iter().all(|&(_, c)| c == 0) {
                    return;
                }
                None // the lease expired meanwhile: the credits belong to Redis
            }
        };
        let with_slots = reservation.is_some();
        let releases = slot_limits.into_iter().filter(|_| with_slots).map(|i| (i, 0));
        let limits = adjustments(config, credits.into_iter().chain(releases));
        if !limits.is_empty() {
            queue_settlement(Settlement {
                domain: config.domain.clone(),
                tenant: self.tenant.clone(),
                reservation,
                cancel: false,
                limits,
            });
        }
    }

    /// The client gave up while the charge waited in the queue: stop the charge if it has
    /// not happened yet, and refund everything it took if it has (one script call does
    /// both, so one of the two is true).
    fn cancel_queued(&mut self, config: &Config) {
        let Some(Admission::Reserved(id)) = self.admission.take() else { return };
        SLOTS.with(|s| s.borrow_mut().remove(&id));
        let costs = self.costs();
        let refunds = config.limits.iter().zip(&costs).enumerate().map(|(i, (limit, &cost))| {
            (i, if limit.kind() == LimitKind::Slots { 0 } else { i64::try_from(cost).unwrap_or(i64::MAX) })
        });
        queue_settlement(Settlement {
            domain: config.domain.clone(),
            tenant: self.tenant.clone(),
            reservation: Some(id),
            cancel: true,
            limits: adjustments(config, refunds),
        });
    }

    /// What to give back for this request (negative: to take), in tokens and in
    /// micro-dollars, from what it reserved and what the reply says it used; updates the
    /// running average of completions.
    fn credits(&mut self, config: &Config, ending: Ending) -> (i64, i64) {
        let Some(plan) = self.plan.as_ref() else { return (0, 0) };
        let Some(estimate) = plan.estimate else { return (0, 0) };
        let (reported, streamed_output) = match self.reply.as_mut() {
            Some(ReplyReader::Json(reader)) => (reader.finish(), None),
            Some(ReplyReader::Stream(reader)) => {
                reader.finish();
                (reader.reported(), Some(reader.output_tokens()))
            }
            None => (ReportedUsage::default(), None),
        };
        // A request that never went upstream cost nothing.
        let used = if self.phase == Phase::Forwarded {
            actual_usage(estimate, ending, reported, streamed_output, config.tokens.on_upstream_error)
        } else {
            TokenEstimate { prompt: 0, output: 0 }
        };
        host::add(Metric::TokensCharged, used.total());
        if ending == Ending::Completed {
            if let Some(output) = reported.output.or(streamed_output) {
                let key = average_key(&config.domain, &self.tenant, &plan.model);
                let average = host::shared_get(&key).and_then(|b| OutputAverage::from_bytes(&b));
                let updated = average.map_or(OutputAverage::first(output), |a| a.update(output));
                host::shared_set(&key, &updated.to_bytes());
            }
        }
        // Against what the budget was charged (every cost limit is charged the same).
        let charged =
            plan.buckets.iter().zip(&config.limits).find(|(b, l)| l.dimension() == Dimension::Cost && b.cost > 0);
        let cost_credit = match (plan.price, charged) {
            (Some(price), Some((bucket, _))) => {
                let signed = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
                let cached = if self.phase == Phase::Forwarded { reported.cached_input.unwrap_or(0) } else { 0 };
                signed(bucket.cost).saturating_sub(signed(price.micro_usd_cached(used, cached)))
            }
            _ => 0,
        };
        (credit(estimate, used.total()), cost_credit)
    }

    /// Releases the request's slots at once, in a callout owned by the root context so it
    /// outlives this request; its settlement (queued, sent within a tick) releases them
    /// too, so nothing is lost if this one fails or the host cannot switch contexts.
    fn release_now(&self, config: &Config, slots: Settlement) {
        let root = ROOT_ID.with(Cell::get);
        let request = SettlementBatch { settlements: vec![slots] };
        let Ok(body) = serde_json::to_vec(&request) else { return };
        let sent = host::as_context(root, self.context_id, || {
            call_companion(config, RELEASE_PATH, &body, config.companion.timeout.0.max(Duration::from_millis(500)))
        });
        if let Some(Err(why)) = sent {
            log::debug!("llm-ratelimit: cannot release slots at once ({why}); the settlement will");
        }
    }

    fn release_local_slots(&self, config: &Config, indices: &[usize]) {
        let Some(plan) = self.plan.as_ref() else { return };
        let instances = u64::from(config.fallback.instances);
        let specs: Vec<LimitCharge> = plan
            .buckets
            .iter()
            .map(|b| LimitCharge {
                capacity: b.capacity.div_ceil(instances),
                window_ms: LOCAL_SLOTS_NEVER_REFILL_MS,
                ..b.clone()
            })
            .collect();
        let credits: Vec<i64> = (0..specs.len()).map(|i| i64::from(indices.contains(&i))).collect();
        let now = host::now_ms() as f64;
        host::shared_update(&local_key(config, &self.tenant), |bytes| {
            let mut states = decode_states(bytes, specs.len());
            llm_ratelimit_core::bucket::settle(&mut states, &specs, &credits, now);
            (Some(encode_states(&states)), ())
        });
    }
}

impl Context for RequestFilter {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some(config) = self.config.clone() else { return };
        if self.phase != Phase::Deciding {
            return;
        }
        let verdict = self.decide(&config, body_size);
        self.apply(verdict, true);
    }
}

impl HttpContext for RequestFilter {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else { return Action::Continue };
        if !config.bypass.paths.is_empty() && config.bypass.path(&host::request_header(":path").unwrap_or_default()) {
            host::increment(Metric::Bypassed);
            return Action::Continue;
        }
        match self.identify(&config) {
            Ok(tenant) => self.tenant = tenant,
            Err(verdict) => return self.apply(verdict, false),
        }
        if config.bypass.tenant(&self.tenant) {
            host::increment(Metric::Bypassed);
            return Action::Continue;
        }
        if !config.reads_body() {
            return self.charge(&config, None);
        }
        if end_of_stream {
            return self.charge(&config, Some(&[]));
        }
        self.phase = Phase::ReadingBody;
        // Holding the headers needs the host to deliver the body meanwhile (Envoy:
        // `allow_on_headers_stop_iteration`); otherwise they go ahead and the body waits.
        if config.hold_request_headers {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else { return Action::Continue };
        match self.phase {
            Phase::ReadingBody => {
                if body_size as u64 > config.tokens.max_request_bytes {
                    return self
                        .apply(Verdict::Reply(decision::body_too_large(config.tokens.max_request_bytes)), false);
                }
                if !end_of_stream {
                    return Action::Pause; // the host buffers until the end
                }
                let body = host::request_body(body_size);
                self.charge(&config, Some(&body))
            }
            // Envoy with `allow_on_headers_stop_iteration` delivers the body while the
            // headers are held, and a Continue here would send both upstream before the
            // decision.
            Phase::Deciding => Action::Pause,
            _ => Action::Continue,
        }
    }

    fn on_http_request_trailers(&mut self, _trailers: usize) -> Action {
        match self.phase {
            Phase::ReadingBody | Phase::Deciding => Action::Pause,
            _ => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        for (name, value) in self.response_headers.drain(..) {
            host::set_response_header(name, &value);
        }
        if self.admission.is_some() && self.plan.as_ref().is_some_and(|p| p.estimate.is_some()) {
            let status: u32 = host::response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
            self.upstream_error = status >= 400;
            let streaming = host::response_header("content-type").is_some_and(|t| t.contains("text/event-stream"));
            let encoding =
                self.plan.as_ref().map(|p| p.encoding).unwrap_or(llm_ratelimit_core::tokens::Encoding::O200kBase);
            self.reply = Some(if streaming {
                ReplyReader::Stream(StreamUsage::new(encoding, MAX_SSE_EVENT))
            } else {
                self.usage_remover = None;
                ReplyReader::Json(ReplyUsage::new(REPLY_WINDOW))
            });
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else { return Action::Continue };
        if self.reply.is_none() || self.admission.is_none() {
            return Action::Continue;
        }
        let chunk = host::response_body(body_size);
        match self.reply.as_mut() {
            Some(ReplyReader::Json(reader)) => reader.feed(&chunk),
            Some(ReplyReader::Stream(reader)) => reader.feed(&chunk),
            None => {}
        }
        if let Some(remover) = self.usage_remover.as_mut() {
            let passed = remover.filter(&chunk, end_of_stream);
            if passed != chunk {
                host::replace_response_body(body_size, &passed);
            }
        }
        if end_of_stream {
            let ending = if self.upstream_error { Ending::UpstreamError } else { Ending::Completed };
            self.settle(&config, ending);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // The stream ended without a complete reply: the client left, the upstream broke,
        // or the reply had no body.
        let Some(config) = self.config.clone() else { return };
        if self.queued && self.phase == Phase::Deciding {
            self.cancel_queued(&config);
        }
        self.leave_queue(&config);
        let ending = if self.upstream_error { Ending::UpstreamError } else { Ending::Interrupted };
        self.settle(&config, ending);
    }
}
