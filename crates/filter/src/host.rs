//! The one place that talks to the proxy-wasm host. Each call handles the host's status:
//! failures are logged or surface as `None`/`Err`, never as a panic.

use llm_ratelimit_core::decision::LocalReply;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};
use std::cell::Cell;
use std::time::{Duration, UNIX_EPOCH};

#[derive(Clone, Copy)]
pub enum Metric {
    Allowed,
    Limited,
    Unidentified,
    CompanionFailures,
    TokensReserved,
    TokensCharged,
    SettlementsFailed,
    LocalDecisions,
    LeaseAdmissions,
    LeaseCallouts,
    Queued,
    QueuedMs,
    Bypassed,
    ShadowRefusals,
}

const METRICS: [(&str, MetricType); 14] = [
    ("llm_ratelimit.requests_allowed", MetricType::Counter),
    ("llm_ratelimit.requests_limited", MetricType::Counter),
    ("llm_ratelimit.requests_unidentified", MetricType::Counter),
    ("llm_ratelimit.companion_failures", MetricType::Counter),
    ("llm_ratelimit.tokens_reserved", MetricType::Counter),
    ("llm_ratelimit.tokens_charged", MetricType::Counter),
    ("llm_ratelimit.settlements_failed", MetricType::Counter),
    ("llm_ratelimit.local_decisions", MetricType::Counter),
    ("llm_ratelimit.lease_admissions", MetricType::Counter),
    ("llm_ratelimit.lease_callouts", MetricType::Counter),
    ("llm_ratelimit.queued_requests", MetricType::Counter),
    ("llm_ratelimit.queued_ms", MetricType::Counter),
    ("llm_ratelimit.requests_bypassed", MetricType::Counter),
    ("llm_ratelimit.shadow_refusals", MetricType::Counter),
];

thread_local! {
    static METRIC_IDS: Cell<[Option<u32>; METRICS.len()]> = const { Cell::new([None; METRICS.len()]) };
}

pub fn define_metrics() {
    let mut ids = [None; METRICS.len()];
    for (id, (name, kind)) in ids.iter_mut().zip(METRICS) {
        *id = hostcalls::define_metric(kind, name).ok();
    }
    METRIC_IDS.with(|cell| cell.set(ids));
}

/// Sets a gauge, defining it on first use.
pub fn gauge(name: &str, value: u64) {
    if let (Ok(id), Ok(value)) = (hostcalls::define_metric(MetricType::Gauge, name), i64::try_from(value)) {
        let _ = hostcalls::record_metric(id, value as u64);
    }
}

pub fn add(metric: Metric, amount: u64) {
    let id = METRIC_IDS.with(|cell| cell.get().get(metric as usize).copied().flatten());
    if let (Some(id), Ok(amount)) = (id, i64::try_from(amount)) {
        let _ = hostcalls::increment_metric(id, amount);
    }
}

pub fn increment(metric: Metric) {
    add(metric, 1);
}

pub fn plugin_configuration() -> Vec<u8> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok().flatten().unwrap_or_default()
}

pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name).ok().flatten()
}

pub fn set_request_header(name: &str, value: &str) -> bool {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value)).is_ok()
}

pub fn response_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpResponseHeaders, name).ok().flatten()
}

pub fn set_response_header(name: &str, value: &str) {
    if let Err(status) = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value)) {
        log::warn!("llm-ratelimit: cannot set response header {name}: {status:?}");
    }
}

pub fn request_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size).ok().flatten().unwrap_or_default()
}

pub fn replace_request_body(size: usize, body: &[u8]) -> bool {
    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, body).is_ok()
}

pub fn response_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size).ok().flatten().unwrap_or_default()
}

pub fn replace_response_body(size: usize, body: &[u8]) {
    if let Err(status) = hostcalls::set_buffer(BufferType::HttpResponseBody, 0, size, body) {
        log::warn!("llm-ratelimit: cannot rewrite the response body: {status:?}");
    }
}

// The SDK's wrapper panics on a status it does not expect, and a host may not implement
// this call: it is declared here to handle every answer.
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_set_effective_context(context_id: u32) -> u32;
}

/// Runs `f` as context `context_id` (a callout dispatched inside belongs to it and
/// outlives the current request), then switches back to `current`. `None` if the host
/// refuses the switch.
pub fn as_context<R>(context_id: u32, current: u32, f: impl FnOnce() -> R) -> Option<R> {
    // SAFETY: a plain host call taking an integer; any status is handled.
    if unsafe { proxy_set_effective_context(context_id) } != 0 {
        return None;
    }
    let result = f();
    // SAFETY: as above.
    unsafe { proxy_set_effective_context(current) };
    Some(result)
}

/// Sends a JSON POST to the companion; returns the callout token.
pub fn dispatch(upstream: &str, headers: Vec<(&str, &str)>, body: &[u8], timeout: Duration) -> Result<u32, String> {
    hostcalls::dispatch_http_call(upstream, headers, Some(body), Vec::new(), timeout)
        .map_err(|status| format!("callout to {upstream:?} refused by the host: {status:?}"))
}

pub fn callout_status() -> Option<u32> {
    hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status").ok().flatten()?.parse().ok()
}

pub fn callout_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size).ok().flatten().unwrap_or_default()
}

pub fn resume_request() {
    if let Err(status) = hostcalls::resume_http_request() {
        log::warn!("llm-ratelimit: cannot resume the request: {status:?}");
    }
}

pub fn send_reply(reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    if let Err(status) = hostcalls::send_http_response(reply.status, headers, Some(reply.body.as_bytes())) {
        log::warn!("llm-ratelimit: cannot send the local reply: {status:?}");
    }
}

pub fn set_tick_period(period: Duration) {
    if let Err(status) = hostcalls::set_tick_period(period) {
        log::warn!("llm-ratelimit: cannot set the tick period: {status:?}");
    }
}

/// Nanoseconds since the epoch by the host's clock (0 if it will not say).
pub fn now_nanos() -> u128 {
    hostcalls::get_current_time().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos())
}

/// Shared data is visible to every VM of the same `vm_id` in this proxy process.
pub fn shared_get(key: &str) -> Option<Vec<u8>> {
    hostcalls::get_shared_data(key).ok().and_then(|(value, _cas)| value)
}

/// An unconditional write: for values where a lost update costs nothing that matters (a
/// running average skips a sample, the breaker is re-decided by the next callout).
pub fn shared_set(key: &str, value: &[u8]) {
    let _ = hostcalls::set_shared_data(key, Some(value), None);
}

/// Read-modify-write of one shared value under compare-and-swap, retried when another
/// worker wrote in between. `change` gets the current value and returns the new one (or
/// `None` to write nothing) and a result. `None` if the host refuses or the key stays
/// too contended. A key that does not exist yet carries no CAS, so its first write is
/// unconditional: two workers creating the same key at the same instant can lose one
/// update, once per tenant and process.
pub fn shared_update<R>(key: &str, mut change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, R)) -> Option<R> {
    for _ in 0..32 {
        let (current, cas) = hostcalls::get_shared_data(key).unwrap_or((None, None));
        let (next, result) = change(current.as_deref());
        let Some(next) = next else { return Some(result) };
        match hostcalls::set_shared_data(key, Some(&next), cas) {
            Ok(()) => return Some(result),
            Err(proxy_wasm::types::Status::CasMismatch) => continue,
            Err(status) => {
                log::warn!("llm-ratelimit: cannot write shared data: {status:?}");
                return None;
            }
        }
    }
    log::warn!("llm-ratelimit: shared data key too contended; giving up this update");
    None
}

pub fn now_ms() -> u64 {
    (now_nanos() / 1_000_000) as u64
}
