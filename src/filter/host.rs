//! The one place that talks to the proxy-wasm host. Each call handles the host's status:
//! failures are logged or surface as `None`/`Err`, never as a panic.

use crate::decision::LocalReply;
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
}

const METRICS: [(&str, MetricType); 7] = [
    ("llm_ratelimit.requests_allowed", MetricType::Counter),
    ("llm_ratelimit.requests_limited", MetricType::Counter),
    ("llm_ratelimit.requests_unidentified", MetricType::Counter),
    ("llm_ratelimit.companion_failures", MetricType::Counter),
    ("llm_ratelimit.tokens_reserved", MetricType::Counter),
    ("llm_ratelimit.tokens_charged", MetricType::Counter),
    ("llm_ratelimit.settlements_failed", MetricType::Counter),
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

pub fn shared_set(key: &str, value: &[u8]) {
    // Without a CAS the write is unconditional: fine for a running average, where a lost
    // update only skips one sample.
    let _ = hostcalls::set_shared_data(key, Some(value), None);
}
