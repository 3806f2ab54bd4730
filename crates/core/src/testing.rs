//! The fake host: implements [`Host`] in memory, records what the core asks of it, and
//! plays the semantics that differ between hosts (see [`HostKind`]): on `Nginx` a
//! shared-data write without the key's CAS fails once the key exists, and the lifecycle
//! is driven as ngx_wasm_module drives it (end of stream never set on request headers, no
//! body callback for a request without a body, the body read only in the content phase and
//! a resume before it is read sending the upstream none). A [`FakeCompanion`] answers callouts with
//! the Rust model of the Lua script, so tests run whole decisions natively.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use crate::accounting::bucket::{self, BucketState};
use crate::accounting::calibration::Running;
use crate::accounting::counters::{self, Counter};
use crate::accounting::fair_share;
use crate::effects::host::{Action, Host, HostKind, LogLevel, Metric, Owner, SharedWriteError};
use crate::lifecycle::RequestFilter;
use crate::protocol::ledger::{LedgerBatch, LedgerReply, Spent, LEDGER_PATH};
use crate::protocol::{
    CalibrationExchange, CalibrationReply, ChargeRequest, LeaseRequest, LimitCharge, LimitKind, LimitOutcome,
    LimitStatus, LimitsReply, RuleFigures, RunningFigure, SettleOutcome, SettleReply, SettlementBatch, Suspension,
    CALIBRATION_PATH, CHARGE_PATH, LEASE_PATH, RELEASE_PATH, SETTLE_PATH, TOUCH_PATH,
};
use crate::replies::reply::LocalReply;
use crate::worker::Worker;
use serde_json::Value;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::rc::Rc;
use std::time::Duration;

/// What the workers of one fake proxy share: shared data and the clock.
#[derive(Debug)]
pub struct World {
    pub kind: HostKind,
    pub now_ms: u64,
    /// Every key lands on one slot, as keys with the same CRC32 do in ngx_wasm_module.
    pub colliding_keys: bool,
    /// Every write of a new key is refused, as ngx_wasm_module refuses one when its
    /// `shm_kv` zone has no room (and eviction is off).
    pub full: bool,
    shared: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    next_token: u32,
    next_context: u32,
    /// Host calls made, by name: each is a crossing into the proxy, which costs far more
    /// in a real host than here.
    pub host_calls: BTreeMap<&'static str, u64>,
    /// The VM's environment variables, as either host hands them over (WASI environ_get).
    pub environment: Vec<(String, String)>,
}

impl World {
    pub fn new(kind: HostKind) -> Rc<RefCell<World>> {
        Rc::new(RefCell::new(World {
            kind,
            now_ms: 1_000_000,
            colliding_keys: false,
            full: false,
            shared: HashMap::new(),
            next_cas: 1,
            next_token: 1,
            next_context: 1,
            host_calls: BTreeMap::new(),
            environment: Vec::new(),
        }))
    }
}

impl World {
    /// Every shared-data key written.
    pub fn keys(&self) -> Vec<String> {
        self.shared.keys().cloned().collect()
    }

    /// How many shared-data keys start with `prefix`.
    pub fn key_count(&self, prefix: &str) -> usize {
        self.shared.keys().filter(|k| k.starts_with(prefix)).count()
    }

    /// The sizes of the values stored under keys starting with `prefix`, without repeats,
    /// but for empty ones (a key made ahead, holding no entry yet).
    pub fn value_sizes(&self, prefix: &str) -> std::collections::BTreeSet<usize> {
        let values = self.shared.iter().filter(|(k, (v, _))| k.starts_with(prefix) && !v.is_empty());
        values.map(|(_, (v, _))| v.len()).collect()
    }

    fn slot<'a>(&self, key: &'a str) -> &'a str {
        if self.colliding_keys {
            "*"
        } else {
            key
        }
    }
}

pub fn advance(world: &Rc<RefCell<World>>, ms: u64) {
    world.borrow_mut().now_ms += ms;
}

/// A callout the core dispatched.
#[derive(Debug, Clone)]
pub struct Callout {
    pub token: u32,
    pub upstream: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    /// The JSON body (`null` for a callout without a body).
    pub body: Value,
    pub timeout: Duration,
    pub owner: Owner,
}

/// One worker's view of the host, for one request (or for the root).
pub struct FakeHost {
    world: Rc<RefCell<World>>,
    /// This host's context, unique in its world.
    pub context_id: u32,
    pub request_headers: Vec<(String, String)>,
    pub request_body: Vec<u8>,
    pub response_headers: Vec<(String, String)>,
    /// The response body chunk being delivered.
    pub response_chunk: Vec<u8>,
    /// Every callout dispatched, in order.
    pub callouts: Vec<Callout>,
    /// The answer of the callout being delivered.
    pub callout_answer: Option<(u32, Vec<u8>)>,
    /// Local replies sent.
    pub replies: Vec<LocalReply>,
    pub resumed: usize,
    pub metrics: BTreeMap<Metric, u64>,
    /// Labelled counters, by `series` index.
    pub series: BTreeMap<usize, u64>,
    pub gauges: BTreeMap<String, u64>,
    pub logs: Vec<(LogLevel, String)>,
    warned: BTreeSet<&'static str>,
    /// The request's response has begun (response callbacks, `on_log`).
    pub in_response_phases: bool,
    /// A callout's answer is being delivered, for a callout that carried a body.
    answering_a_callout_with_a_body: bool,
    /// The request body has been read by the host and delivered to the filter.
    pub body_read: bool,
    /// Properties set, by their path's segments joined with `.`, in the order set.
    pub properties: Vec<(String, Vec<u8>)>,
}

impl FakeHost {
    pub fn new(world: &Rc<RefCell<World>>) -> FakeHost {
        let context_id = {
            let mut w = world.borrow_mut();
            w.next_context += 1;
            w.next_context
        };
        FakeHost {
            world: world.clone(),
            context_id,
            request_headers: Vec::new(),
            request_body: Vec::new(),
            response_headers: Vec::new(),
            response_chunk: Vec::new(),
            callouts: Vec::new(),
            callout_answer: None,
            replies: Vec::new(),
            resumed: 0,
            metrics: BTreeMap::new(),
            series: BTreeMap::new(),
            gauges: BTreeMap::new(),
            logs: Vec::new(),
            warned: BTreeSet::new(),
            in_response_phases: false,
            answering_a_callout_with_a_body: false,
            body_read: false,
            properties: Vec::new(),
        }
    }

    pub fn metric(&self, metric: Metric) -> u64 {
        self.metrics.get(&metric).copied().unwrap_or(0)
    }

    pub fn series_value(&self, series: usize) -> u64 {
        self.series.get(&series).copied().unwrap_or(0)
    }

    pub fn response_header_value(&self, name: &str) -> Option<&str> {
        self.response_headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    pub fn last_callout(&self) -> &Callout {
        self.callouts.last().expect("a callout")
    }

    /// What the filter stored under `key` (without its fingerprint), if it is this key's.
    pub fn shared_value(&mut self, key: &str) -> Option<Vec<u8>> {
        crate::effects::host::shared_read(self, key)
    }

    pub fn kind(&self) -> HostKind {
        self.world.borrow().kind
    }

    fn count_call(&self, name: &'static str) {
        *self.world.borrow_mut().host_calls.entry(name).or_default() += 1;
    }
}

impl Host for FakeHost {
    fn context_id(&self) -> u32 {
        self.context_id
    }

    fn now_nanos(&mut self) -> u128 {
        self.count_call("now_nanos");
        u128::from(self.world.borrow().now_ms) * 1_000_000
    }

    fn request_header(&mut self, name: &str) -> Option<String> {
        self.count_call("request_header");
        self.request_headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }

    fn request_header_values(&mut self, name: &str) -> Vec<String> {
        self.count_call("request_header_values");
        let values: Vec<String> =
            self.request_headers.iter().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect();
        // Envoy keeps `authorization` as one inline header and appends a repeat to it
        // with ','; ngx_wasm_module lists each line.
        if self.kind() == HostKind::Envoy && name == "authorization" && values.len() > 1 {
            return vec![values.join(",")];
        }
        values
    }

    fn set_request_header(&mut self, name: &str, value: &str) -> bool {
        self.count_call("set_request_header");
        self.request_headers.retain(|(n, _)| n != name);
        self.request_headers.push((name.to_string(), value.to_string()));
        true
    }

    fn remove_request_header(&mut self, name: &str) -> bool {
        self.count_call("remove_request_header");
        self.request_headers.retain(|(n, _)| n != name);
        true
    }

    fn response_header(&mut self, name: &str) -> Option<String> {
        self.count_call("response_header");
        self.response_headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }

    fn set_response_header(&mut self, name: &str, value: &str) {
        self.count_call("set_response_header");
        self.response_headers.retain(|(n, _)| n != name);
        self.response_headers.push((name.to_string(), value.to_string()));
    }

    fn request_body(&mut self, size: usize) -> Vec<u8> {
        self.count_call("request_body");
        self.request_body.iter().take(size).copied().collect()
    }

    fn replace_request_body(&mut self, _size: usize, body: &[u8]) -> bool {
        self.count_call("replace_request_body");
        self.request_body = body.to_vec();
        true
    }

    fn response_body(&mut self, size: usize) -> Vec<u8> {
        self.count_call("response_body");
        self.response_chunk.iter().take(size).copied().collect()
    }

    fn replace_response_body(&mut self, _size: usize, body: &[u8]) -> bool {
        self.count_call("replace_response_body");
        self.response_chunk = body.to_vec();
        true
    }

    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        self.count_call("shared_get");
        let world = self.world.borrow();
        match world.shared.get(world.slot(key)) {
            // Envoy hands an empty value over as no data, its CAS all the same (the SDK,
            // and `abi::shared_data`, read that as no value): a key made ahead, empty.
            Some((value, cas)) if value.is_empty() && world.kind == HostKind::Envoy => (None, Some(*cas)),
            Some((value, cas)) => (Some(value.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedWriteError> {
        self.count_call("shared_set");
        let mut world = self.world.borrow_mut();
        let slot = world.slot(key).to_string();
        let current = world.shared.get(&slot).map(|(_, c)| *c);
        let allowed = match (cas, current) {
            (None, None) => true,
            // Envoy overwrites; ngx_wasm_module takes "no CAS" as "must not exist yet".
            (None, Some(_)) => world.kind == HostKind::Envoy,
            (Some(cas), Some(current)) => cas == current,
            (Some(_), None) => false,
        };
        if !allowed {
            return Err(SharedWriteError::CasMismatch);
        }
        if world.full && current.is_none() {
            return Err(SharedWriteError::Refused("NoMemory".into()));
        }
        let next = world.next_cas;
        world.next_cas += 1;
        world.shared.insert(slot, (value.to_vec(), next));
        Ok(())
    }

    fn dispatch(
        &mut self,
        upstream: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
        owner: Owner,
    ) -> Result<u32, String> {
        self.count_call("dispatch");
        // ngx_wasm_module traps (and resets the VM) on a callout from a response phase.
        assert!(
            !(self.in_response_phases && self.kind() == HostKind::Nginx),
            "host trap: ngx_wasm_module allows no dispatch once the response has begun"
        );
        let token = {
            let mut world = self.world.borrow_mut();
            world.next_token += 1;
            world.next_token
        };
        let header = |name: &str| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string());
        self.callouts.push(Callout {
            token,
            upstream: upstream.to_string(),
            path: header(":path").unwrap_or_default(),
            headers: headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
            body: if body.is_empty() { Value::Null } else { serde_json::from_slice(body).expect("JSON bodies") },
            timeout,
            owner,
        });
        Ok(token)
    }

    fn callout_status(&mut self) -> Option<u32> {
        self.count_call("callout_status");
        self.callout_answer.as_ref().map(|(status, _)| *status)
    }

    fn callout_body(&mut self, size: usize) -> Vec<u8> {
        self.count_call("callout_body");
        self.callout_answer.as_ref().map(|(_, body)| body.iter().take(size).copied().collect()).unwrap_or_default()
    }

    fn resume_request(&mut self) {
        self.count_call("resume_request");
        // ngx_wasm_module runs the content handler on a resume even while the body is
        // still being read: the upstream gets the headers, with their content-length, and
        // no body, and the client waits for an answer that never comes.
        assert!(
            !(self.kind() == HostKind::Nginx && !self.request_body.is_empty() && !self.body_read),
            "nginx: a resume before the request body was read sends the upstream no body"
        );
        self.resumed += 1;
    }

    fn send_reply(&mut self, reply: &LocalReply) {
        self.count_call("send_reply");
        // ngx_wasm_module empties a local reply sent from the answer to a callout that
        // carried a body and got none back (the client gets an empty reply; a debug build
        // aborts the worker).
        let empty_answer = self.callout_answer.as_ref().is_none_or(|(_, body)| body.is_empty());
        assert!(
            !(self.kind() == HostKind::Nginx
                && self.answering_a_callout_with_a_body
                && empty_answer
                && !reply.body.is_empty()),
            "ngx_wasm_module: zero size buf in writer"
        );
        self.replies.push(reply.clone());
    }

    fn add_metric(&mut self, metric: Metric, amount: u64) {
        self.count_call("add_metric");
        *self.metrics.entry(metric).or_default() += amount;
    }

    fn add_series(&mut self, series: usize, amount: u64) {
        self.count_call("add_series");
        *self.series.entry(series).or_default() += amount;
    }

    fn set_gauge(&mut self, name: &str, value: u64) {
        self.count_call("set_gauge");
        self.gauges.insert(name.to_string(), value);
    }

    fn log(&mut self, level: LogLevel, message: &str) {
        self.count_call("log");
        self.logs.push((level, message.to_string()));
    }

    fn environment_variables(&mut self) -> Vec<(String, String)> {
        self.count_call("environment_variables");
        self.world.borrow().environment.clone()
    }

    fn set_property(&mut self, path: &[&str], value: &[u8]) -> bool {
        self.count_call("set_property");
        self.properties.push((path.join("."), value.to_vec()));
        true
    }

    fn warn_once(&mut self, topic: &'static str, message: &str) {
        self.count_call("warn_once");
        if self.warned.insert(topic) {
            self.logs.push((LogLevel::Warn, message.to_string()));
        }
    }
}

/// The companion and Redis, as the Rust model of the scripts: each tenant's limits with
/// the semantics of their kind in `lua/limits.lua` (token buckets by `bucket.rs`, the
/// model the case table pins; sliding windows as the log of what each call took; slots as
/// request ids with their expiry; these two pinned with the script by
/// tests/cases/windows_and_slots.json), reservation records, leases, the fleet's calibrations.
#[derive(Debug, Default)]
pub struct FakeCompanion {
    counters: HashMap<(String, String), Counter>,
    /// Open reservation records: the time of their charge (where a sliding window's
    /// correction goes).
    reservations: BTreeMap<String, f64>,
    /// Once ids of the stand-alone adjustments applied.
    applied_once: BTreeSet<String>,
    /// Reservations whose cancel marker is set: their charge is refused from then on.
    cancelled: BTreeSet<String>,
    /// What lease grants gave of each (owner, limit), as the script's `|granted` counter:
    /// what backs a stand-alone credit (a returned lease); a credit beyond it is refused.
    granted: HashMap<(String, String), f64>,
    /// Settlements applied, as they arrived.
    pub settled: Vec<crate::protocol::Settlement>,
    pub touched: usize,
    pub released: usize,
    /// Answer every call with this status instead (a failing companion).
    pub failing: Option<u32>,
    /// Fields this companion does not know (an older release): a message carrying one is
    /// refused 400, as serde's `deny_unknown_fields` makes the companion refuse it.
    pub unknown_fields: Vec<&'static str>,
    /// Paths this companion does not serve (an older release): answered 404.
    pub unknown_paths: Vec<&'static str>,
    /// Every call answered, by path.
    pub calls: BTreeMap<String, usize>,
    /// The fleet's calibrations by rule fingerprint: prompt ratio and completion length.
    pub calibrations: BTreeMap<String, (Option<Running>, Option<Running>)>,
    /// The claimants of each pool with fair shares, by (owner, limit name), as the script
    /// keeps them (`accounting::fair_share`; settlements do not correct them here).
    pub fair: HashMap<(String, String), fair_share::Claimants>,
    /// The spend ledger as `lua/ledger.lua` keeps it: sums by (owner, label, model, day).
    pub ledger: BTreeMap<(String, String, String, u32), Spent>,
    /// The last batch added per (worker id, owner), as the script's markers.
    pub ledger_marks: BTreeMap<(String, String), u64>,
    /// Every ledger batch received (resent ones too).
    pub ledger_batches: Vec<LedgerBatch>,
    /// The owners' plans, by owner id, as `lua/limits.lua` reads them.
    pub plans: HashMap<String, FakePlan>,
    /// The plan's capacity each token bucket was last counted against (the script's
    /// `pcap`), by (owner, limit name).
    bucket_plan_capacities: HashMap<(String, String), u64>,
}

/// An owner's plan (see `protocol::plans`).
#[derive(Debug, Clone, Default)]
pub struct FakePlan {
    pub capacities: BTreeMap<String, u64>,
    pub suspended: Option<String>,
    pub expires_ms: Option<u64>,
    /// What follows the expiry: a suspension (else the config's limits again).
    pub then_suspend: bool,
}

impl FakePlan {
    /// The plan from its hash's fields (`cap:<name>`, `suspended`, `expires_ms`,
    /// `at_expiry`), as the case table writes them.
    pub fn from_fields(fields: &BTreeMap<String, String>) -> FakePlan {
        let mut plan = FakePlan::default();
        for (field, value) in fields {
            match field.as_str() {
                "suspended" => plan.suspended = Some(value.clone()),
                "expires_ms" => plan.expires_ms = value.parse().ok(),
                "at_expiry" => plan.then_suspend = value == "suspend",
                _ => {
                    if let (Some(name), Ok(capacity)) = (field.strip_prefix("cap:"), value.parse()) {
                        plan.capacities.insert(name.to_string(), capacity);
                    }
                }
            }
        }
        plan
    }
}

impl FakeCompanion {
    /// A companion that answers every call with `status`.
    pub fn failing(status: u32) -> FakeCompanion {
        FakeCompanion { failing: Some(status), ..FakeCompanion::default() }
    }

    /// What a tenant's limit has free at `now_ms` (its capacity when untouched): a
    /// bucket's level, a window's capacity less what it holds, the slots not held.
    pub fn level(&self, tenant: &str, limit: &LimitCharge, now_ms: u64) -> f64 {
        self.counter(tenant, limit).remaining(limit, now_ms as f64) as f64
    }

    /// The counter of `spec` for a call of `tenant`: its owner's (a shared pool), else the
    /// tenant's, as the companion keys them.
    fn counter(&self, tenant: &str, spec: &LimitCharge) -> Counter {
        let owner = spec.owner.as_deref().unwrap_or(tenant).to_string();
        self.counters.get(&(owner, spec.name.clone())).cloned().unwrap_or_else(|| Counter::new(spec.kind))
    }

    fn counter_mut(&mut self, tenant: &str, spec: &LimitCharge) -> &mut Counter {
        let owner = spec.owner.as_deref().unwrap_or(tenant).to_string();
        self.counters.entry((owner, spec.name.clone())).or_insert_with(|| Counter::new(spec.kind))
    }

    /// Applies the owners' plans to `specs` of a call of `tenant` at `now_ms`, as the
    /// script does: each limit's capacity (a token bucket's level moved by a change of its
    /// plan's capacity); the first limit whose owner is suspended.
    fn apply_plans(&mut self, tenant: &str, specs: &mut [LimitCharge], now_ms: u64) -> Option<Suspension> {
        let sent: Vec<u64> = specs.iter().map(|s| s.capacity).collect();
        let suspended = self.plan_capacities(tenant, specs, now_ms);
        for (spec, sent) in specs.iter().zip(sent) {
            if spec.kind != LimitKind::TokenBucket {
                continue;
            }
            let key = (spec.owner.clone().unwrap_or_else(|| tenant.to_string()), spec.name.clone());
            // A capacity of 0 closes the limit without counting against it (the script's `closed`).
            let planned = (spec.capacity != sent && spec.capacity > 0).then_some(spec.capacity);
            let stored = self.bucket_plan_capacities.get(&key).copied();
            if stored == planned {
                continue;
            }
            if let Some(Counter::Bucket(Some(state))) = self.counters.get_mut(&key) {
                state.tokens += planned.unwrap_or(sent) as f64 - stored.unwrap_or(sent) as f64;
            }
            match planned {
                Some(capacity) => self.bucket_plan_capacities.insert(key, capacity),
                None => self.bucket_plan_capacities.remove(&key),
            };
        }
        suspended
    }

    fn plan_capacities(&self, tenant: &str, specs: &mut [LimitCharge], now_ms: u64) -> Option<Suspension> {
        let mut suspended = None;
        for spec in specs.iter_mut() {
            let owner = spec.owner.as_deref().unwrap_or(tenant);
            let Some(plan) = self.plans.get(owner) else { continue };
            let expired = plan.expires_ms.is_some_and(|at| at <= now_ms);
            if expired && !plan.then_suspend {
                continue;
            }
            if expired {
                let reason = plan.suspended.clone().unwrap_or_else(|| crate::protocol::plans::EXPIRED_REASON.into());
                suspended.get_or_insert(Suspension { limit: spec.name.clone(), reason });
                continue;
            }
            if let Some(&capacity) = plan.capacities.get(&spec.name) {
                spec.capacity = capacity;
            }
            if let Some(reason) = &plan.suspended {
                suspended.get_or_insert(Suspension { limit: spec.name.clone(), reason: reason.clone() });
            }
        }
        suspended
    }

    /// A charge as the companion answers it: the plans applied, then charged.
    pub fn charge_with_plans(&mut self, request: &ChargeRequest, now_ms: u64) -> LimitsReply {
        let mut request = request.clone();
        if let Some(suspension) = self.apply_plans(&request.tenant.clone(), &mut request.limits, now_ms) {
            return LimitsReply { allowed: false, waited_ms: 0, limits: Vec::new(), suspended: Some(suspension) };
        }
        self.charge(&request, now_ms as f64)
    }

    /// Charges every limit or none, as the script's charge does, pools with fair shares
    /// judged for their claimant first.
    fn charge(&mut self, request: &ChargeRequest, now: f64) -> LimitsReply {
        let member = request.reservation.as_ref().map(|r| r.id.as_str());
        let mut counters: Vec<Counter> =
            request.limits.iter().map(|spec| self.counter(&request.tenant, spec)).collect();
        let mut limits = request.limits.clone();
        let mut judged = Vec::new();
        for (i, spec) in request.limits.iter().enumerate() {
            let Some(claim) = spec.fair.as_ref().filter(|_| !spec.look_only && !spec.shadow) else { continue };
            let owner = spec.owner.clone().unwrap_or_else(|| request.tenant.clone());
            let stored = self.fair.entry((owner.clone(), spec.name.clone())).or_default();
            let active = fair_share::active(stored, now, spec.window_ms as f64, claim.idle_ms as f64);
            let level = counters[i].remaining(spec, now) as f64;
            let judgement = fair_share::judge(&active, claim, spec.cost as f64, level, spec.capacity as f64);
            judged.push((i, owner, claim.clone(), active, judgement));
        }
        // The room a claimant has is one more bound on the elastic limits' common reduction.
        let reduction = judged
            .iter()
            .map(|(i, .., j)| request.limits[*i].cost.saturating_sub(j.room.max(0.0) as u64))
            .max()
            .unwrap_or(0);
        for spec in limits.iter_mut().filter(|s| s.min() < s.cost && !s.shadow) {
            spec.cost = spec.cost.saturating_sub(reduction).max(spec.min());
        }
        let blocked =
            judged.iter().find(|(i, .., j)| level_fits(j.level, limits[*i].cost) && j.room < limits[*i].cost as f64);
        let reply = match blocked {
            Some((i, .., j)) => {
                let window_ms = limits[*i].window_ms as f64;
                let capacity = limits[*i].capacity as f64;
                let refill = |amount: f64| ((amount - j.level) * window_ms / capacity).ceil() as u64;
                let retry = j.retry_after_ms(limits[*i].cost as f64, window_ms, refill);
                refused_by_share(&limits, &counters, *i, retry, now)
            }
            None => counters::charge(&mut counters, &limits, member, now),
        };
        for (i, owner, claim, active, _) in judged {
            let charged = if reply.allowed { reply.limits[i].charged as f64 } else { 0.0 };
            let stored = self.fair.entry((owner, request.limits[i].name.clone())).or_default();
            fair_share::record(stored, &active, &claim, request.limits[i].cost as f64, charged, now);
        }
        if reply.allowed {
            for (counter, spec) in counters.into_iter().zip(&request.limits) {
                *self.counter_mut(&request.tenant, spec) = counter;
            }
            if let Some(id) = member {
                self.reservations.insert(id.to_string(), now);
            }
        }
        reply
    }

    /// Answers a callout the way the companion would; returns (status, body).
    pub fn answer(&mut self, callout: &Callout, now_ms: u64) -> (u32, Vec<u8>) {
        *self.calls.entry(callout.path.clone()).or_default() += 1;
        if let Some(status) = self.failing {
            return (status, b"{}".to_vec());
        }
        if self.unknown_paths.contains(&callout.path.as_str()) {
            return (404, br#"{"error":"not found"}"#.to_vec());
        }
        if let Some(field) = self.unknown_fields.iter().find(|field| carries_field(&callout.body, field)) {
            return (400, format!(r#"{{"error":"unknown field `{field}`"}}"#).into_bytes());
        }
        let now = now_ms as f64;
        let body = match callout.path.as_str() {
            CHARGE_PATH => {
                let request: ChargeRequest = serde_json::from_value(callout.body.clone()).expect("charge");
                if request.reservation.as_ref().is_some_and(|r| self.cancelled.contains(&r.id)) {
                    // The script's "CANCELLED ..." error, which the companion answers 500.
                    return (500, br#"{"error":"CANCELLED the request was given up before its charge ran"}"#.to_vec());
                }
                serde_json::to_vec(&self.charge_with_plans(&request, now_ms))
            }
            LEASE_PATH => {
                let request: LeaseRequest = serde_json::from_value(callout.body.clone()).expect("lease");
                // Leases are token buckets only (the config refuses the other kinds with them).
                let mut specs: Vec<LimitCharge> = request
                    .limits
                    .iter()
                    .map(|a| LimitCharge {
                        look_only: a.look_only,
                        owner: a.owner.clone(),
                        ..spec(&a.name, a.capacity, a.window_ms, a.wanted, a.needed, LimitKind::TokenBucket)
                    })
                    .collect();
                if let Some(suspension) = self.apply_plans(&request.tenant, &mut specs, now_ms) {
                    let reply =
                        LimitsReply { allowed: false, waited_ms: 0, limits: Vec::new(), suspended: Some(suspension) };
                    return (200, serde_json::to_vec(&reply).unwrap_or_default());
                }
                let mut states: Vec<Option<BucketState>> =
                    specs.iter().map(|s| self.counter(&request.tenant, s).as_bucket(s, now)).collect();
                let reply: LimitsReply = bucket::lease(&mut states, &specs, request.share, now);
                if reply.allowed {
                    for ((spec, state), outcome) in specs.iter().zip(states).zip(&reply.limits) {
                        *self.counter_mut(&request.tenant, spec) = Counter::Bucket(state);
                        let owner = spec.owner.clone().unwrap_or_else(|| request.tenant.clone());
                        *self.granted.entry((owner, spec.name.clone())).or_default() += outcome.charged as f64;
                    }
                }
                serde_json::to_vec(&reply)
            }
            SETTLE_PATH | TOUCH_PATH | RELEASE_PATH => {
                let batch: SettlementBatch = serde_json::from_value(callout.body.clone()).expect("settlements");
                let mut results = Vec::new();
                for settlement in batch.settlements {
                    let mut specs: Vec<LimitCharge> = settlement
                        .limits
                        .iter()
                        .map(|a| LimitCharge {
                            period_bounds_ms: a.period_bounds_ms.clone(),
                            owner: a.owner.clone(),
                            ..spec(&a.name, a.capacity, a.window_ms, 0, None, a.kind)
                        })
                        .collect();
                    // A refund is capped by the plan's capacity; a suspension stops no settlement.
                    let _ = self.apply_plans(&settlement.tenant, &mut specs, now_ms);
                    let member = settlement.reservation.clone();
                    match callout.path.as_str() {
                        TOUCH_PATH => {
                            self.touched += 1;
                            for spec in &specs {
                                member
                                    .iter()
                                    .for_each(|m| self.counter_mut(&settlement.tenant, spec).touch(m, spec, now));
                            }
                        }
                        RELEASE_PATH => {
                            self.released += 1;
                            for spec in &specs {
                                member.iter().for_each(|m| self.counter_mut(&settlement.tenant, spec).release(m));
                            }
                        }
                        _ => {
                            let applies = match (&settlement.reservation, &settlement.once) {
                                // The first stand-in sets the marker; a charge that happened
                                // stands for its debits, its record for theirs.
                                (Some(id), _) if settlement.stand_in.is_some() => {
                                    let applies =
                                        self.cancelled.insert(id.clone()) && !self.reservations.contains_key(id);
                                    if applies {
                                        self.reservations.insert(id.clone(), now);
                                    }
                                    applies.then_some(now)
                                }
                                (Some(id), _) => {
                                    if settlement.cancel {
                                        self.cancelled.insert(id.clone());
                                    }
                                    self.reservations.remove(id)
                                }
                                (None, Some(once)) => self.applied_once.insert(once.clone()).then_some(now),
                                (None, None) => Some(now),
                            };
                            let stand_alone = settlement.reservation.is_none();
                            for (spec, adjustment) in specs.iter().zip(&settlement.limits) {
                                let mut credit = if settlement.stand_in.is_some() {
                                    adjustment.credit.min(0)
                                } else {
                                    adjustment.credit
                                };
                                if stand_alone && credit > 0 && applies.is_some() {
                                    // No credit without a debit: a grant backs it, up to what it gave.
                                    let owner = spec.owner.clone().unwrap_or_else(|| settlement.tenant.clone());
                                    let granted = self.granted.entry((owner, spec.name.clone())).or_default();
                                    credit = credit.min(*granted as i64).max(0);
                                    *granted -= credit as f64;
                                }
                                let counter = self.counter_mut(&settlement.tenant, spec);
                                if let Some(charged_at) = applies.filter(|_| credit != 0) {
                                    counter.give_back(credit, charged_at, spec, now);
                                }
                                // A settlement frees the request's slots whether or not it applies.
                                member.iter().for_each(|m| counter.release(m));
                            }
                            let applied = applies.is_some();
                            results.push(if applied { SettleOutcome::Applied } else { SettleOutcome::AlreadySettled });
                            self.settled.push(settlement);
                            continue;
                        }
                    }
                    results.push(SettleOutcome::Applied);
                }
                serde_json::to_vec(&SettleReply { results })
            }
            CALIBRATION_PATH => {
                let exchange: CalibrationExchange = serde_json::from_value(callout.body.clone()).expect("exchange");
                exchange.validate().expect("a valid exchange");
                let figure = |r: Option<Running>| {
                    r.map(|r| RunningFigure { mean: r.mean, deviation: r.deviation, samples: r.samples })
                };
                let rules = exchange
                    .rules
                    .iter()
                    .map(|rule| {
                        let (ratio, output) = self.calibrations.entry(rule.rule.clone()).or_default();
                        for &x in &rule.prompt_ratios {
                            *ratio = Some(Running::observe(*ratio, x));
                        }
                        for &x in &rule.outputs {
                            *output = Some(Running::observe(*output, x));
                        }
                        RuleFigures { rule: rule.rule.clone(), prompt_ratio: figure(*ratio), output: figure(*output) }
                    })
                    .collect();
                serde_json::to_vec(&CalibrationReply { rules })
            }
            LEDGER_PATH => {
                let batch: LedgerBatch = serde_json::from_value(callout.body.clone()).expect("a ledger batch");
                batch.validate().expect("a valid ledger batch");
                let owners: BTreeSet<String> = batch.rows.iter().map(|row| row.owner.clone()).collect();
                let mut reply = LedgerReply::default();
                for owner in owners {
                    let mark = self.ledger_marks.entry((batch.vm.clone(), owner.clone())).or_default();
                    if batch.seq <= *mark {
                        reply.already += 1;
                        continue;
                    }
                    *mark = batch.seq;
                    reply.added += 1;
                    for row in batch.rows.iter().filter(|row| row.owner == owner) {
                        let key = (row.owner.clone(), row.label.clone(), row.model.clone(), row.day);
                        self.ledger.entry(key).or_default().add(&row.used);
                    }
                }
                self.ledger_batches.push(batch);
                serde_json::to_vec(&reply)
            }
            other => panic!("unknown companion path {other}"),
        };
        (200, body.expect("serialise"))
    }
}

/// Whether `field` is a key anywhere in `value`.
fn carries_field(value: &Value, field: &str) -> bool {
    match value {
        Value::Object(map) => map.iter().any(|(key, inner)| key == field || carries_field(inner, field)),
        Value::Array(items) => items.iter().any(|item| carries_field(item, field)),
        _ => false,
    }
}

/// Whether a pool at `level` has room for `cost` (else the pool itself refuses).
fn level_fits(level: f64, cost: u64) -> bool {
    level >= cost as f64
}

/// The refusal of a charge whose limit `blocked` is a fair pool without room for its
/// claimant now: nothing charged, that limit limited with `retry_ms`.
fn refused_by_share(
    limits: &[LimitCharge],
    counters: &[Counter],
    blocked: usize,
    retry_ms: u64,
    now: f64,
) -> LimitsReply {
    let outcomes = limits
        .iter()
        .zip(counters)
        .enumerate()
        .map(|(i, (spec, counter))| LimitOutcome {
            name: spec.name.clone(),
            status: if i == blocked { LimitStatus::Limited } else { LimitStatus::Allowed },
            limit: spec.capacity,
            remaining: counter.remaining(spec, now),
            reset_after_ms: 0,
            retry_after_ms: if i == blocked { retry_ms } else { 0 },
            charged: 0,
        })
        .collect();
    LimitsReply { allowed: false, waited_ms: 0, limits: outcomes, suspended: None }
}

pub(crate) fn spec(
    name: &str,
    capacity: u64,
    window_ms: u64,
    cost: u64,
    min_cost: Option<u64>,
    kind: LimitKind,
) -> LimitCharge {
    LimitCharge {
        owner: None,
        shadow: false,
        name: name.to_string(),
        capacity,
        window_ms,
        cost,
        min_cost,
        kind,
        period_bounds_ms: Vec::new(),
        provisional: false,
        look_only: false,
        fair: None,
    }
}

/// An OpenAI chat completion (model `gpt-4o`) reporting this usage, as the upstream sends it.
pub fn usage_reply(prompt: u64, completion: u64) -> String {
    serde_json::json!({"id": "c1", "object": "chat.completion", "model": "gpt-4o",
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
    .to_string()
}

/// A request as the tests send it.
pub struct Request {
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn chat(key: &str, body: &str) -> Request {
        Request {
            headers: vec![
                (":method".into(), "POST".into()),
                (":path".into(), "/v1/chat/completions".into()),
                ("authorization".into(), format!("Bearer {key}")),
                ("content-type".into(), "application/json".into()),
                ("content-length".into(), body.len().to_string()),
            ],
            body: body.as_bytes().to_vec(),
        }
    }

    /// A request without a body, as ngx_wasm_module and Envoy see an HTTP/1.1 GET.
    pub fn get(key: &str, path: &str) -> Request {
        Request {
            headers: vec![
                (":method".into(), "GET".into()),
                (":path".into(), path.into()),
                ("authorization".into(), format!("Bearer {key}")),
            ],
            body: Vec::new(),
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Request {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// One proxy worker with its host, driven through whole requests the way its host kind
/// drives them, against a fake companion.
pub struct Proxy {
    pub world: Rc<RefCell<World>>,
    pub worker: Worker,
    /// The root context's host (ticks and root-owned callouts).
    pub root: FakeHost,
}

/// A request in flight: its filter and its host.
pub struct InFlight {
    pub filter: RequestFilter,
    pub host: FakeHost,
    /// What the last callback returned.
    pub action: Action,
}

impl InFlight {
    pub fn replied(&self) -> Option<&LocalReply> {
        self.host.replies.last()
    }

    /// Whether the request went (or goes) upstream.
    pub fn forwarded(&self) -> bool {
        self.filter.phase() == crate::lifecycle::Phase::Forwarded
    }
}

impl Proxy {
    pub fn new(world: &Rc<RefCell<World>>, config: &str) -> Proxy {
        let mut worker = Worker::new();
        let mut root = FakeHost::new(world);
        worker.configure(&mut root, config.as_bytes()).expect("config");
        Proxy { world: world.clone(), worker, root }
    }

    pub fn now(&self) -> u64 {
        self.world.borrow().now_ms
    }

    /// Starts a request: headers, then the body as the host delivers it. Stops where
    /// the filter waits for a callout, or when it has decided.
    pub fn start(&mut self, request: Request) -> InFlight {
        let mut host = FakeHost::new(&self.world);
        host.request_headers = request.headers;
        host.request_body = request.body;
        let mut filter = RequestFilter::on(&self.worker);
        let kind = host.kind();
        let has_body = !host.request_body.is_empty();
        // Envoy reports end of stream on headers for a request without a body;
        // ngx_wasm_module never does.
        let end_on_headers = kind == HostKind::Envoy && !has_body;
        let mut action = filter.on_request_headers(&mut host, &mut self.worker, end_on_headers);
        let waiting_for_body = filter.phase() == crate::lifecycle::Phase::ReadingBody;
        // ngx_wasm_module calls no body callback for a request without a body.
        if waiting_for_body && (has_body || kind == HostKind::Envoy) {
            let size = host.request_body.len();
            host.body_read = true;
            action = filter.on_request_body(&mut host, &mut self.worker, size, true);
        }
        InFlight { filter, host, action }
    }

    /// Starts a request whose body arrives after its headers, in a separate write, and
    /// after the answer to a callout sent from the headers (if any): the order in which a
    /// decision from headers alone resumes a request whose body is still unread.
    pub fn send_with_late_body(&mut self, request: Request, companion: &mut FakeCompanion) -> InFlight {
        let mut host = FakeHost::new(&self.world);
        host.request_headers = request.headers;
        host.request_body = request.body;
        let mut filter = RequestFilter::on(&self.worker);
        let has_body = !host.request_body.is_empty();
        let end_on_headers = host.kind() == HostKind::Envoy && !has_body;
        let action = filter.on_request_headers(&mut host, &mut self.worker, end_on_headers);
        let mut flight = InFlight { filter, host, action };
        if flight.filter.phase() == crate::lifecycle::Phase::Deciding {
            self.answer(&mut flight, companion);
        }
        // Both hosts deliver the body once it arrives, unless the filter already replied.
        if has_body && flight.filter.phase() != crate::lifecycle::Phase::Replied {
            let size = flight.host.request_body.len();
            flight.host.body_read = true;
            flight.action = flight.filter.on_request_body(&mut flight.host, &mut self.worker, size, true);
        }
        if flight.filter.phase() == crate::lifecycle::Phase::Deciding {
            self.answer(&mut flight, companion);
        }
        flight
    }

    /// Answers the request's outstanding callout from `companion`.
    pub fn answer(&mut self, request: &mut InFlight, companion: &mut FakeCompanion) {
        let callout = request.host.last_callout().clone();
        assert_eq!(callout.owner, Owner::Request);
        let (status, body) = companion.answer(&callout, self.now());
        self.answer_with(request, status, body);
    }

    pub fn answer_with(&mut self, request: &mut InFlight, status: u32, body: Vec<u8>) {
        self.deliver(request, Some((status, body)));
    }

    /// The request's outstanding callout times out: no status, no body.
    pub fn time_out(&mut self, request: &mut InFlight) {
        self.deliver(request, None);
    }

    fn deliver(&mut self, request: &mut InFlight, answer: Option<(u32, Vec<u8>)>) {
        let size = answer.as_ref().map_or(0, |(_, body)| body.len());
        request.host.answering_a_callout_with_a_body = !request.host.last_callout().body.is_null();
        request.host.callout_answer = answer;
        request.filter.on_callout_response(&mut request.host, &mut self.worker, size);
        request.host.callout_answer = None;
        request.host.answering_a_callout_with_a_body = false;
    }

    /// Sends a request through to a decision, answering its callout (if any).
    pub fn send(&mut self, request: Request, companion: &mut FakeCompanion) -> InFlight {
        let mut flight = self.start(request);
        // A request that overflowed waits on a second charge, on the fallback's limits.
        while flight.filter.phase() == crate::lifecycle::Phase::Deciding {
            let callouts = flight.host.callouts.len();
            self.answer(&mut flight, companion);
            if flight.host.callouts.len() == callouts {
                break;
            }
        }
        flight
    }

    /// The upstream's reply, in one chunk per element, then the end of the request.
    pub fn reply(&mut self, request: &mut InFlight, status: u32, content_type: &str, chunks: &[&str]) {
        let chunks: Vec<&[u8]> = chunks.iter().map(|chunk| chunk.as_bytes()).collect();
        self.reply_bytes(request, status, content_type, &chunks);
    }

    /// `reply` with chunks of any bytes (a binary framing).
    pub fn reply_bytes(&mut self, request: &mut InFlight, status: u32, content_type: &str, chunks: &[&[u8]]) {
        self.reply_with_headers(request, status, content_type, &[], chunks);
    }

    /// `reply_bytes` with more response headers (a provider's rate-limit headers).
    pub fn reply_with_headers(
        &mut self,
        request: &mut InFlight,
        status: u32,
        content_type: &str,
        headers: &[(&str, &str)],
        chunks: &[&[u8]],
    ) {
        request.host.in_response_phases = true;
        request.host.response_headers =
            vec![(":status".into(), status.to_string()), ("content-type".into(), content_type.into())];
        request.host.response_headers.extend(headers.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        request.filter.on_response_headers(&mut request.host);
        for (i, chunk) in chunks.iter().enumerate() {
            request.host.response_chunk = chunk.to_vec();
            let size = chunk.len();
            request.filter.on_response_body(&mut request.host, &mut self.worker, size, i + 1 == chunks.len());
        }
        self.done(request);
    }

    /// The host's end of the request (`on_log`).
    pub fn done(&mut self, request: &mut InFlight) {
        request.host.in_response_phases = true;
        request.filter.on_done(&mut request.host, &mut self.worker);
    }

    /// One root tick; answers the root's callouts from `companion` (None: leaves them out).
    pub fn tick(&mut self, companion: Option<&mut FakeCompanion>) {
        let before = self.root.callouts.len();
        self.worker.on_tick(&mut self.root);
        let Some(companion) = companion else { return };
        let new: Vec<Callout> = self.root.callouts[before..].to_vec();
        for callout in new {
            let (status, body) = companion.answer(&callout, self.now());
            self.root_answer(callout.token, status, body);
        }
    }

    /// Resumes the waiting requests among `flights` the worker says are due, each in its
    /// own host, as the glue does after every callback on a host that resumes other
    /// contexts. Returns how many it resumed.
    pub fn wake(&mut self, flights: &mut [&mut InFlight]) -> usize {
        let mut woken = 0;
        for context in self.worker.waiters_due() {
            if let Some(flight) = flights.iter_mut().find(|f| f.host.context_id == context) {
                flight.filter.on_lease_news(&mut flight.host, &mut self.worker);
                woken += 1;
            }
        }
        woken
    }

    /// Delivers a root-owned callout's answer.
    pub fn root_answer(&mut self, token: u32, status: u32, body: Vec<u8>) {
        let size = body.len();
        self.root.callout_answer = Some((status, body));
        self.worker.on_callout_response(&mut self.root, token, size);
        self.root.callout_answer = None;
    }
}

/// The per-request workload of `examples/request_bench.rs` and of the allocation test
/// (`tests/request_allocations.rs`): a config per store mode, the request bodies, the
/// upstream's reply, and a proxy serving them as a loaded one does, ticking as it goes.
pub mod bench {
    use super::{advance, FakeCompanion, Proxy, Request, World};
    use crate::effects::host::HostKind;
    use serde_json::json;
    use std::cell::RefCell;
    use std::rc::Rc;

    const SYSTEM: &str = "You are a careful assistant for a logistics company. Answer in plain English, \
cite the shipment id when you refer to one, never invent tracking numbers, and keep answers under \
two hundred words unless the user asks for detail. If a question is about billing, say that billing \
questions go to the accounts team and give the address accounts@example.com.";

    fn turn(i: usize) -> (String, String) {
        (
            format!(
                "Where is shipment SH-{i:05}? It left Rotterdam on the {}th and the customer asks daily.",
                i % 28 + 1
            ),
            format!(
                "Shipment SH-{i:05} cleared customs in Antwerp and is on the truck to Lyon; the carrier expects \
                 delivery within {} days. I will flag it if the estimate moves.",
                i % 5 + 1
            ),
        )
    }

    /// A chat body: the system prompt and `turns` exchanges, then a new question.
    pub fn chat(turns: usize) -> String {
        let mut messages = vec![json!({"role": "system", "content": SYSTEM})];
        for i in 0..turns {
            let (question, answer) = turn(i);
            messages.push(json!({"role": "user", "content": question}));
            messages.push(json!({"role": "assistant", "content": answer}));
        }
        messages.push(json!({"role": "user", "content": turn(turns).0}));
        json!({"model": "gpt-4o-mini", "messages": messages, "max_tokens": 256}).to_string()
    }

    /// The policy of a mode: `lease` or `direct` (a companion, leases on or off), `local`
    /// (every limit in the proxy's shared data), `local-requests` (its request limit only).
    pub fn config(mode: &str) -> String {
        let limits = json!([{"name": "rpm", "requests": 1_000_000_000u64, "window": "1m"},
                            {"name": "tpm", "tokens": 1_000_000_000_000u64, "window": "1m"}]);
        let companion = json!({"upstream": "companion", "token": "test-token-0123456789"});
        match mode {
            "lease" | "direct" => json!({
                "companion": companion, "failure_mode": "deny", "lease": {"enabled": mode == "lease"}, "limits": limits
            }),
            "local" => json!({"store": "local", "limits": limits}),
            "local-requests" => json!({"store": "local", "limits": [limits[0].clone()]}),
            other => panic!("mode lease, direct, local or local-requests, not {other}"),
        }
        .to_string()
    }

    /// The bodies a kind of traffic cycles through: `small` (a tiny chat), `stream` (the
    /// tiny chat streamed, without asking for usage: the proxy asks for it, and takes the
    /// usage chunk out of the stream), `chat` (three exchanges), `turns` (a conversation growing by one
    /// exchange per request, as a client resends the whole chat each turn), `idle` (one
    /// short chat).
    pub fn bodies(kind: &str) -> Vec<String> {
        match kind {
            "small" => vec![json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8})
                .to_string()],
            "stream" => vec![json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8,
                "stream": true})
            .to_string()],
            "chat" => vec![chat(3)],
            "turns" => (0..20).map(chat).collect(),
            "idle" => vec![chat(0)],
            other => panic!("body small, stream, chat, turns or idle, not {other}"),
        }
    }

    /// The upstream's answer to every request: its content type and its body in the pieces
    /// the host hands over.
    pub struct Reply {
        pub content_type: &'static str,
        pub chunks: Vec<String>,
    }

    /// The upstream's answer to every request of body kind `kind`: one JSON completion, or
    /// for `stream` OpenAI's server-sent events, one event a piece (a word each, then the
    /// usage chunk and `[DONE]`), as a streaming upstream sends them.
    pub fn reply(kind: &str) -> Reply {
        let words = ["Hello", " there,", " how", " can", " I", " help", "?", ""];
        if kind != "stream" {
            let text: String = words.concat();
            let body = json!({"id": "c1", "object": "chat.completion", "model": "gpt-4o-mini",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}});
            return Reply { content_type: "application/json", chunks: vec![body.to_string()] };
        }
        let event = |chunk: serde_json::Value| format!("data: {chunk}\n\n");
        let mut chunks: Vec<String> = words
            .iter()
            .enumerate()
            .map(|(i, word)| {
                let finish = (i + 1 == words.len()).then_some("stop");
                event(json!({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini",
                    "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": finish}]}))
            })
            .collect();
        chunks.push(event(json!({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o-mini",
            "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}})));
        chunks.push("data: [DONE]\n\n".to_string());
        Reply { content_type: "text/event-stream", chunks }
    }

    /// A proxy worker serving requests of `tenants` API keys in turn, `per_tick` requests
    /// between two ticks 50 ms apart (250: a proxy at 5,000 requests a second).
    pub struct Run {
        pub world: Rc<RefCell<World>>,
        pub proxy: Proxy,
        pub companion: FakeCompanion,
        keys: Vec<String>,
        per_tick: usize,
        /// Requests served so far.
        pub served: usize,
    }

    impl Run {
        pub fn new(mode: &str, tenants: usize, per_tick: usize) -> Run {
            let world = World::new(HostKind::Envoy);
            let proxy = Proxy::new(&world, &config(mode));
            let keys = (0..tenants.max(1)).map(|i| format!("sk-bench-{i}")).collect();
            Run { world, proxy, companion: FakeCompanion::default(), keys, per_tick: per_tick.max(1), served: 0 }
        }

        /// The next request, with `body`, from the next tenant.
        pub fn request(&self, body: &str) -> Request {
            Request::chat(&self.keys[self.served % self.keys.len()], body)
        }

        /// Serves `request` to the end with `reply`, then moves the clock and ticks as due.
        pub fn serve(&mut self, request: Request, reply: &Reply) {
            let i = self.served;
            let mut flight = self.proxy.send(request, &mut self.companion);
            if !flight.forwarded() {
                panic!("request {i} was not forwarded: {:?}", flight.replied());
            }
            let chunks: Vec<&str> = reply.chunks.iter().map(String::as_str).collect();
            self.proxy.reply(&mut flight, 200, reply.content_type, &chunks);
            drop(flight);
            let per_tick = self.per_tick;
            if (i + 1) * 50 / per_tick > i * 50 / per_tick {
                advance(&self.world, ((i + 1) * 50 / per_tick - i * 50 / per_tick) as u64);
            }
            if i % per_tick == per_tick - 1 {
                self.proxy.tick(Some(&mut self.companion));
            }
            self.served += 1;
        }

        /// Serves `n` requests, the bodies in turn, each answered with `reply`.
        pub fn serve_all(&mut self, bodies: &[String], reply: &Reply, n: usize) {
            for body in bodies.iter().cycle().take(n) {
                let request = self.request(body);
                self.serve(request, reply);
            }
        }
    }
}

/// The JSON block after `<!-- marker -->` in the documentation pages that show policies
/// (docs/configuration.md, docs/pools.md): a policy the tests load as written.
pub fn docs_json_block(marker: &str) -> String {
    let pages = [include_str!("../../../docs/configuration.md"), include_str!("../../../docs/pools.md")];
    pages
        .iter()
        .find_map(|page| page.split(&format!("<!-- {marker} -->")).nth(1))
        .and_then(|rest| rest.split("```json").nth(1))
        .and_then(|rest| rest.split("```").next())
        .unwrap_or_else(|| panic!("no page of docs/ has a JSON block after <!-- {marker} -->"))
        .to_string()
}

/// One bad config of `tests/cases/bad_configs/`: `<name>.json` and, beside it,
/// `<name>.expect` holding the one line the filter logs when it refuses it (and
/// `llm-ratelimit check-config` prints), `None` when that file is missing.
#[derive(Debug)]
pub struct BadConfig {
    pub name: String,
    pub config: Vec<u8>,
    pub expected: Option<String>,
}

/// The folder of bad-config fixtures, shared by the config tests and the CLI's checker.
pub const BAD_CONFIGS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/cases/bad_configs");

/// Every bad-config fixture, by name. Panics on an expectation without its config, so a
/// renamed fixture cannot leave its expectation behind unread.
pub fn bad_configs() -> Vec<BadConfig> {
    let folder = std::path::Path::new(BAD_CONFIGS);
    let mut names: Vec<(String, String)> = std::fs::read_dir(folder)
        .unwrap_or_else(|e| panic!("{BAD_CONFIGS}: {e}"))
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|file| file.rsplit_once('.').map(|(name, ext)| (name.to_string(), ext.to_string())))
        .collect();
    names.sort();
    for (name, ext) in &names {
        assert!(ext == "json" || ext == "expect", "{name}.{ext}: a fixture is <name>.json beside <name>.expect");
        assert!(names.contains(&(name.clone(), "json".into())), "{name}.expect has no {name}.json");
    }
    names
        .into_iter()
        .filter(|(_, ext)| ext == "json")
        .map(|(name, _)| {
            let config = std::fs::read(folder.join(format!("{name}.json"))).unwrap();
            let expected = std::fs::read_to_string(folder.join(format!("{name}.expect")))
                .ok()
                .map(|text| text.trim_end_matches('\n').to_string());
            BadConfig { name, config, expected }
        })
        .collect()
}

/// The fake companion's sliding windows and slots against the case table that
/// tests/lua/test_lua_limits.py runs against lua/limits.lua in a real Redis.
#[cfg(test)]
mod case_table {
    use super::*;
    use crate::protocol::LimitStatus;
    use serde_json::json;

    fn callout(path: &str, body: Value) -> Callout {
        let (upstream, headers) = (String::new(), Vec::new());
        Callout { token: 0, upstream, path: path.into(), headers, body, timeout: Duration::ZERO, owner: Owner::Root }
    }

    fn kind(limit: &Value) -> Value {
        json!(match limit["kind"].as_str() {
            Some("sw") => "sliding_window",
            Some("slots") => "slots",
            other => panic!("not a window or slot limit: {other:?}"),
        })
    }

    #[test]
    fn windows_and_slots_follow_the_shared_case_table() {
        let table: Value =
            serde_json::from_str(include_str!("../../../tests/cases/windows_and_slots.json")).expect("case table");
        let cases = table["cases"].as_array().expect("cases");
        assert!(cases.len() >= 3);
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let limits = case["limits"].as_array().unwrap();
            let mut companion = FakeCompanion::default();
            let mut now = 1_000_000u64;
            for (i, step) in case["steps"].as_array().unwrap().iter().enumerate() {
                let what = format!("{name} / step {i}");
                now += step["advance_ms"].as_u64().unwrap();
                let amounts = step["amounts"].as_array().unwrap();
                assert_eq!(amounts.len(), limits.len(), "{what}");
                let request = step["request"].as_str().unwrap();
                let spec = |amount_field: &str| -> Vec<Value> {
                    limits
                        .iter()
                        .zip(amounts)
                        .map(|(l, amount)| {
                            json!({"name": l["name"], "capacity": l["capacity"], "window_ms": l["window_ms"],
                                   "kind": kind(l), amount_field: amount})
                        })
                        .collect()
                };
                let settlement = |limits| json!({"settlements": [{"domain": "d", "tenant": "t", "reservation": request, "limits": limits}]});
                let op = step["op"].as_str().unwrap_or("charge");
                let (path, body) = match op {
                    "charge" => (
                        CHARGE_PATH,
                        json!({"domain": "d", "tenant": "t", "limits": spec("cost"),
                                                     "reservation": {"id": request, "ttl_ms": 60_000}}),
                    ),
                    "settle" => (SETTLE_PATH, settlement(spec("credit"))),
                    "touch" => (TOUCH_PATH, settlement(spec("credit"))),
                    "release" => (RELEASE_PATH, settlement(spec("credit"))),
                    other => panic!("{what}: op {other}"),
                };
                let (status, reply) = companion.answer(&callout(path, body), now);
                assert_eq!(status, 200, "{what}");
                let done = step["done"].as_bool().unwrap();
                if op != "charge" {
                    let reply: SettleReply = serde_json::from_slice(&reply).unwrap();
                    assert_eq!(
                        reply.results,
                        [if done { SettleOutcome::Applied } else { SettleOutcome::AlreadySettled }]
                    );
                    continue;
                }
                let reply: LimitsReply = serde_json::from_slice(&reply).unwrap();
                assert_eq!(reply.allowed, done, "{what}");
                let outcomes = step["outcomes"].as_array().unwrap();
                assert_eq!(reply.limits.len(), outcomes.len(), "{what}");
                for (got, want) in reply.limits.iter().zip(outcomes) {
                    let status = match got.status {
                        LimitStatus::Allowed => "allowed",
                        LimitStatus::Limited => "limited",
                        LimitStatus::Never => "never",
                    };
                    let got = json!([status, got.remaining, got.reset_after_ms, got.retry_after_ms]);
                    assert_eq!(&got, want, "{what}");
                }
            }
        }
    }
}

/// The fake companion's plans against the case table that tests/lua/test_lua_plans.py runs
/// against lua/limits.lua in a real Redis.
#[cfg(test)]
mod plan_case_table {
    use super::*;
    use crate::protocol::LimitStatus;

    #[test]
    fn plans_follow_the_shared_case_table() {
        let table: Value = serde_json::from_str(include_str!("../../../tests/cases/plans.json")).expect("case table");
        let cases = table["cases"].as_array().expect("cases");
        assert!(cases.len() >= 8);
        let now = 1_800_000_000_000u64;
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let mut companion = FakeCompanion::default();
            let set_plans = |companion: &mut FakeCompanion, plans: &Value| {
                for (owner, fields) in plans.as_object().unwrap() {
                    let mut fields: BTreeMap<String, String> = fields
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_string)))
                        .collect();
                    if let Some(offset) = fields.remove("expires_in_ms") {
                        let offset: i64 = offset.parse().unwrap();
                        fields.insert("expires_ms".into(), (now as i64 + offset).to_string());
                    }
                    let owner = if owner == "team" { "pteam" } else { "t" }.to_string();
                    if fields.is_empty() {
                        companion.plans.remove(&owner);
                    } else {
                        companion.plans.insert(owner, FakePlan::from_fields(&fields));
                    }
                }
            };
            set_plans(&mut companion, &case["plans"]);
            let limits = case["limits"].as_array().unwrap();
            for (step, charge) in case["charges"].as_array().unwrap().iter().enumerate() {
                let what = format!("{name} / charge {step}");
                if let Some(plans) = charge.get("set_plans") {
                    set_plans(&mut companion, plans);
                }
                let costs = charge["cost"].as_array().unwrap();
                let specs = limits
                    .iter()
                    .zip(costs)
                    .map(|(l, cost)| {
                        let kind = match l["kind"].as_str() {
                            Some("sw") => LimitKind::SlidingWindow,
                            _ => LimitKind::TokenBucket,
                        };
                        let capacity = l["capacity"].as_u64().unwrap();
                        let window_ms = l["window_ms"].as_u64().unwrap();
                        LimitCharge {
                            owner: (l["owner"] == "team").then(|| "pteam".to_string()),
                            ..spec(l["name"].as_str().unwrap(), capacity, window_ms, cost.as_u64().unwrap(), None, kind)
                        }
                    })
                    .collect();
                let request = ChargeRequest {
                    domain: "d".into(),
                    tenant: "t".into(),
                    limits: specs,
                    reservation: None,
                    wait: None,
                };
                let reply = companion.charge_with_plans(&request, now);
                if charge["done"] == "suspended" {
                    let suspension = reply.suspended.expect(&what);
                    let at = charge["suspended_limit"].as_u64().unwrap() as usize;
                    assert_eq!(suspension.reason, charge["reason"].as_str().unwrap(), "{what}");
                    assert_eq!(suspension.limit, limits[at]["name"].as_str().unwrap(), "{what}");
                    continue;
                }
                assert_eq!(u64::from(reply.allowed), charge["done"].as_u64().unwrap(), "{what}");
                let statuses: Vec<&str> = reply
                    .limits
                    .iter()
                    .map(|o| match o.status {
                        LimitStatus::Allowed => "allowed",
                        LimitStatus::Limited => "limited",
                        LimitStatus::Never => "never",
                    })
                    .collect();
                assert_eq!(serde_json::json!(statuses), charge["status"], "{what}");
                let capacities: Vec<u64> = reply.limits.iter().map(|o| o.limit).collect();
                assert_eq!(serde_json::json!(capacities), charge["limit"], "{what}");
            }
        }
    }
}
