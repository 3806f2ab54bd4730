//! The one place that talks to the proxy-wasm host. Each call handles the host's status:
//! failures are logged or surface as `None`/`Err`, never as a panic.

use crate::decision::LocalReply;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};
use std::cell::Cell;
use std::time::Duration;

#[derive(Clone, Copy)]
pub enum Metric {
    Allowed,
    Limited,
    Unidentified,
    CompanionFailures,
}

const METRIC_NAMES: [&str; 4] = [
    "llm_ratelimit.requests_allowed",
    "llm_ratelimit.requests_limited",
    "llm_ratelimit.requests_unidentified",
    "llm_ratelimit.companion_failures",
];

thread_local! {
    static METRIC_IDS: Cell<[Option<u32>; 4]> = const { Cell::new([None; 4]) };
}

pub fn define_metrics() {
    let mut ids = [None; 4];
    for (id, name) in ids.iter_mut().zip(METRIC_NAMES) {
        *id = hostcalls::define_metric(MetricType::Counter, name).ok();
    }
    METRIC_IDS.with(|cell| cell.set(ids));
}

pub fn increment(metric: Metric) {
    let id = METRIC_IDS.with(|cell| cell.get().get(metric as usize).copied().flatten());
    if let Some(id) = id {
        let _ = hostcalls::increment_metric(id, 1);
    }
}

pub fn plugin_configuration() -> Vec<u8> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
        .ok()
        .flatten()
        .unwrap_or_default()
}

pub fn request_header(name: &str) -> Option<String> {
    hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

pub fn set_response_header(name: &str, value: &str) {
    if let Err(status) = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value)) {
        log::warn!("llm-ratelimit: cannot set response header {name}: {status:?}");
    }
}

pub fn dispatch(
    upstream: &str,
    headers: Vec<(&str, &str)>,
    body: &[u8],
    timeout: Duration,
) -> Result<(), String> {
    hostcalls::dispatch_http_call(upstream, headers, Some(body), Vec::new(), timeout)
        .map(|_token| ())
        .map_err(|status| format!("callout to {upstream:?} refused by the host: {status:?}"))
}

pub fn callout_status() -> Option<u32> {
    hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten()?
        .parse()
        .ok()
}

pub fn callout_body(size: usize) -> Vec<u8> {
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size)
        .ok()
        .flatten()
        .unwrap_or_default()
}

pub fn resume_request() {
    if let Err(status) = hostcalls::resume_http_request() {
        log::warn!("llm-ratelimit: cannot resume the request: {status:?}");
    }
}

pub fn send_reply(reply: &LocalReply) {
    let headers: Vec<(&str, &str)> = reply
        .headers
        .iter()
        .map(|(n, v)| (*n, v.as_str()))
        .collect();
    if let Err(status) =
        hostcalls::send_http_response(reply.status, headers, Some(reply.body.as_bytes()))
    {
        log::warn!("llm-ratelimit: cannot send the local reply: {status:?}");
    }
}
