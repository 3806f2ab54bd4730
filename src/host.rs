//! [`Host`] over the proxy-wasm ABI. Every call handles the host's status: failures are
//! logged or surface as values, never as a panic. What carries client or upstream bytes
//! (header values, bodies) and the shared data go through `abi`, not the SDK's wrappers,
//! which panic on a value that is not UTF-8 or a status they do not expect.

use crate::abi::{self, HeaderPairs, SharedWrite};
use llm_ratelimit_core::config::Policy;
use llm_ratelimit_core::effects::host::{Host, LogLevel, Metric, Owner, SharedWriteError};
use llm_ratelimit_core::plan::series;
use llm_ratelimit_core::replies::reply::LocalReply;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::time::Duration;

/// What the glue keeps per VM for the host adapter: metric ids and warnings already given.
#[derive(Default)]
pub struct HostState {
    metric_ids: Vec<Option<u32>>,
    /// Counter increments not yet given to the host, by `Metric`: a request adds to
    /// several counters, and each increment would be a call into the host on the
    /// request's path; the root's tick hands them over together.
    pending: Vec<u64>,
    /// The labelled counters (`series::names`), defined for the config loaded, and their
    /// increments not yet given to the host, in the same way.
    series_ids: Vec<Option<u32>>,
    series_pending: Vec<u64>,
    /// Whether any count waits: an idle tick then walks none of the counters.
    anything_pending: bool,
    /// Callouts sent by requests the root woke (see `ProxyHost::acting_for`): each one's
    /// token and the request it answers. The SDK hands their answers to the root. As many
    /// as woken requests asking at once.
    pub routed: Vec<(u32, u32)>,
    warned: BTreeSet<&'static str>,
    /// Gauge ids by name, defined once each, with the value this VM last recorded: the
    /// names come from the config (its limits and model rules), so this stays as small as
    /// the config.
    gauge_ids: BTreeMap<String, (u32, u64)>,
}

impl HostState {
    pub fn define_metrics(&mut self) {
        self.metric_ids =
            Metric::ALL.iter().map(|m| hostcalls::define_metric(MetricType::Counter, m.name()).ok()).collect();
        self.pending = vec![0; Metric::ALL.len()];
    }

    /// Defines the labelled counters of `config` (defining one the host already has
    /// gives its id back, so a reload keeps the counts).
    pub fn define_series(&mut self, config: &Policy) {
        let names = series::names(config);
        self.series_ids = names.iter().map(|name| hostcalls::define_metric(MetricType::Counter, name).ok()).collect();
        self.series_pending = vec![0; names.len()];
    }

    /// The request the answer to callout `token` is for, if a woken request sent it.
    pub fn take_routed(&mut self, token: u32) -> Option<u32> {
        let at = self.routed.iter().position(|(t, _)| *t == token)?;
        Some(self.routed.swap_remove(at).1)
    }

    /// Gives the host the counts gathered since the last flush.
    pub fn flush_metrics(&mut self) {
        if !std::mem::take(&mut self.anything_pending) {
            return;
        }
        let counters = self.metric_ids.iter().zip(self.pending.iter_mut());
        let series = self.series_ids.iter().zip(self.series_pending.iter_mut());
        for (id, pending) in counters.chain(series) {
            let amount = std::mem::take(pending);
            if let (Some(id), Ok(amount @ 1..)) = (id, i64::try_from(amount)) {
                let _ = hostcalls::increment_metric(*id, amount);
            }
        }
    }
}

/// The host as seen from one context (a request's, or the root's), with what one callback
/// has read of it: the clock, and each header map as one read. A request's lifecycle reads
/// several headers and the time several times per callback; each read is a call into the
/// host, which costs more than the lookup itself.
pub struct ProxyHost {
    pub context_id: u32,
    pub root_id: u32,
    pub state: Rc<RefCell<HostState>>,
    now: Option<u128>,
    request_headers: Option<HeaderPairs>,
    response_headers: Option<HeaderPairs>,
    /// Pseudo-headers the map's pairs did not hold, as read on their own this callback.
    pseudo: Vec<(MapType, String, Option<String>)>,
    /// Acting for a request from the root's callback: a callout the request sends is filed
    /// by the SDK under the root, which hands its answer on (`HostState::routed`).
    for_root: bool,
}

impl ProxyHost {
    pub fn new(context_id: u32, root_id: u32, state: Rc<RefCell<HostState>>) -> ProxyHost {
        ProxyHost {
            context_id,
            root_id,
            state,
            now: None,
            request_headers: None,
            response_headers: None,
            pseudo: Vec::new(),
            for_root: false,
        }
    }

    /// The host of request `context_id` as the root's callback acts for it, with the
    /// request's context made effective (`make_effective`).
    pub fn acting_for(context_id: u32, root_id: u32, state: Rc<RefCell<HostState>>) -> ProxyHost {
        ProxyHost { for_root: true, ..ProxyHost::new(context_id, root_id, state) }
    }

    /// A new callback: what was read in the last may have changed (the time has; another
    /// filter may have changed headers in between).
    pub fn begin_callback(&mut self) {
        self.now = None;
        self.request_headers = None;
        self.response_headers = None;
        self.pseudo.clear();
    }

    /// The first value of `name`, from the map read once per callback. A pseudo-header
    /// (`:path`, `:status`) the pairs do not hold is read on its own, once per callback:
    /// Envoy's pairs hold them all, ngx_wasm_module's the request's but not `:status`.
    /// Each read that returns a value costs the host a call back into this VM to allocate
    /// it, several times the lookup.
    fn header(&mut self, map: MapType, name: &str) -> Option<String> {
        let pseudo = name.starts_with(':');
        let (first, again) = {
            let mut values = self.pairs(map).values(name);
            (values.next().map(<[u8]>::to_vec), values.next().is_some())
        };
        match first {
            None if !pseudo => return None,
            // A pseudo-header twice in the pairs is not the host's alone (a client's line
            // that got through): the host's own reading decides, as it always did.
            Some(value) if !pseudo || !again => return Some(abi::text(value)),
            _ => {}
        }
        if let Some((_, _, value)) = self.pseudo.iter().find(|(m, n, _)| *m == map && n == name) {
            return value.clone();
        }
        let value = abi::header_value(map, name).map(abi::text);
        self.pseudo.push((map, name.to_string(), value.clone()));
        value
    }

    fn pairs(&mut self, map: MapType) -> &HeaderPairs {
        let slot = match map {
            MapType::HttpResponseHeaders => &mut self.response_headers,
            _ => &mut self.request_headers,
        };
        slot.get_or_insert_with(|| abi::header_pairs(map))
    }

    /// Our own write to a map: its next read asks the host again.
    fn forget(&mut self, map: MapType) {
        match map {
            MapType::HttpResponseHeaders => self.response_headers = None,
            _ => self.request_headers = None,
        }
        self.pseudo.retain(|(m, _, _)| *m != map);
    }
}

pub fn plugin_configuration() -> Vec<u8> {
    abi::buffer(BufferType::PluginConfiguration, 0, usize::MAX)
}

/// Makes `context_id` the context later host calls act on. Whether the host did.
pub fn make_effective(context_id: u32) -> bool {
    // SAFETY: a plain host call taking an integer; any status is handled.
    unsafe { proxy_set_effective_context(context_id) == 0 }
}

pub fn set_tick_period(period: Duration) {
    if let Err(status) = hostcalls::set_tick_period(period) {
        log::warn!("llm-ratelimit: cannot set the tick period: {status:?}");
    }
}

// The SDK's wrapper panics on a status it does not expect, and a host may not implement
// this call: it is declared here to handle every answer.
#[link(wasm_import_module = "env")]
extern "C" {
    pub(crate) fn proxy_set_effective_context(context_id: u32) -> u32;
}

// The VM's environment, through WASI as both hosts offer it to proxy-wasm modules (Envoy
// fills it from `vm_config.environment_variables`; ngx_wasm_module from the worker's
// environment, which nginx's `env` directive controls). Declared by hand: the target is
// wasm32-unknown-unknown, which has no WASI library.
#[link(wasm_import_module = "wasi_snapshot_preview1")]
extern "C" {
    fn environ_sizes_get(count: *mut u32, buffer_size: *mut u32) -> i32;
    fn environ_get(pointers: *mut u32, buffer: *mut u8) -> i32;
}

/// Every `NAME=value` of the VM's environment (none if the host will not say).
fn read_environment() -> Vec<(String, String)> {
    let (mut count, mut size) = (0u32, 0u32);
    // SAFETY: both pointers are to live u32s the host writes once.
    if unsafe { environ_sizes_get(&mut count, &mut size) } != 0 || count == 0 {
        return Vec::new();
    }
    let mut pointers = vec![0u32; count as usize];
    let mut buffer = vec![0u8; size as usize];
    // SAFETY: the host writes `count` pointers and `size` bytes, the sizes it just gave.
    if unsafe { environ_get(pointers.as_mut_ptr(), buffer.as_mut_ptr()) } != 0 {
        return Vec::new();
    }
    buffer
        .split(|b| *b == 0)
        .filter_map(|entry| std::str::from_utf8(entry).ok()?.split_once('='))
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect()
}

impl Host for ProxyHost {
    fn context_id(&self) -> u32 {
        self.context_id
    }

    fn environment_variables(&mut self) -> Vec<(String, String)> {
        read_environment()
    }

    fn now_nanos(&mut self) -> u128 {
        *self.now.get_or_insert_with(|| u128::from(abi::now_nanos()))
    }

    fn request_header(&mut self, name: &str) -> Option<String> {
        self.header(MapType::HttpRequestHeaders, name)
    }

    fn request_header_values(&mut self, name: &str) -> Vec<String> {
        let pairs = self.pairs(MapType::HttpRequestHeaders);
        pairs.values(name).map(|value| abi::text(value.to_vec())).collect()
    }

    fn set_request_header(&mut self, name: &str, value: &str) -> bool {
        self.forget(MapType::HttpRequestHeaders);
        abi::replace_header(MapType::HttpRequestHeaders, name, value).is_ok()
    }

    fn remove_request_header(&mut self, name: &str) -> bool {
        self.forget(MapType::HttpRequestHeaders);
        abi::remove_header(MapType::HttpRequestHeaders, name).is_ok()
    }

    fn response_header(&mut self, name: &str) -> Option<String> {
        self.header(MapType::HttpResponseHeaders, name)
    }

    fn set_response_header(&mut self, name: &str, value: &str) {
        self.forget(MapType::HttpResponseHeaders);
        if let Err(status) = abi::replace_header(MapType::HttpResponseHeaders, name, value) {
            log::warn!("llm-ratelimit: cannot set response header {name}: status {status}");
        }
    }

    fn request_body(&mut self, size: usize) -> Vec<u8> {
        abi::buffer(BufferType::HttpRequestBody, 0, size)
    }

    fn replace_request_body(&mut self, size: usize, body: &[u8]) -> bool {
        abi::set_buffer(BufferType::HttpRequestBody, 0, size, body).is_ok()
    }

    fn response_body(&mut self, size: usize) -> Vec<u8> {
        abi::buffer(BufferType::HttpResponseBody, 0, size)
    }

    fn replace_response_body(&mut self, size: usize, body: &[u8]) -> bool {
        abi::set_buffer(BufferType::HttpResponseBody, 0, size, body).is_ok()
    }

    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        abi::shared_data(key)
    }

    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedWriteError> {
        match abi::set_shared_data(key, value, cas) {
            SharedWrite::Written => Ok(()),
            SharedWrite::CasMismatch => Err(SharedWriteError::CasMismatch),
            SharedWrite::Refused(status) => Err(SharedWriteError::Refused(format!("status {status}"))),
        }
    }

    fn dispatch(
        &mut self,
        upstream: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
        owner: Owner,
    ) -> Result<u32, String> {
        let send = || {
            // No body at all for an empty one: see `HostKind::replies_after_an_empty_callout`.
            let body = (!body.is_empty()).then_some(body);
            hostcalls::dispatch_http_call(upstream, headers.to_vec(), body, Vec::new(), timeout)
                .map_err(|status| format!("{status:?}"))
        };
        if owner == Owner::Root && self.root_id != self.context_id {
            // A callout dispatched as the root context belongs to it and outlives the
            // request. SAFETY: plain host calls taking an integer; any status is handled.
            if unsafe { proxy_set_effective_context(self.root_id) } != 0 {
                return Err("the host cannot switch to the root context".into());
            }
            let sent = send();
            unsafe { proxy_set_effective_context(self.context_id) };
            return sent;
        }
        let sent = send();
        if let (Ok(token), true) = (&sent, self.for_root) {
            self.state.borrow_mut().routed.push((*token, self.context_id));
        }
        sent
    }

    fn callout_status(&mut self) -> Option<u32> {
        abi::text(abi::header_value(MapType::HttpCallResponseHeaders, ":status")?).parse().ok()
    }

    fn callout_body(&mut self, size: usize) -> Vec<u8> {
        abi::buffer(BufferType::HttpCallResponseBody, 0, size)
    }

    fn resume_request(&mut self) {
        if let Err(status) = abi::continue_request() {
            log::warn!("llm-ratelimit: cannot resume the request: status {status}");
        }
    }

    fn send_reply(&mut self, reply: &LocalReply) {
        let headers: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        if let Err(status) = abi::send_local_response(reply.status, &headers, reply.body.as_bytes()) {
            log::warn!("llm-ratelimit: cannot send the local reply: status {status}");
        }
    }

    fn set_property(&mut self, path: &[&str], value: &[u8]) -> bool {
        abi::set_property(path, value).is_ok()
    }

    fn add_metric(&mut self, metric: Metric, amount: u64) {
        let mut state = self.state.borrow_mut();
        if let Some(pending) = state.pending.get_mut(metric as usize) {
            *pending = pending.saturating_add(amount);
            state.anything_pending = true;
        }
    }

    fn add_series(&mut self, series: usize, amount: u64) {
        let mut state = self.state.borrow_mut();
        if let Some(pending) = state.series_pending.get_mut(series) {
            *pending = pending.saturating_add(amount);
            state.anything_pending = true;
        }
    }

    fn set_gauge(&mut self, name: &str, value: u64) {
        if i64::try_from(value).is_err() {
            return;
        }
        let mut state = self.state.borrow_mut();
        let id = match state.gauge_ids.get_mut(name) {
            // The tick shows what it learned each time; a value unchanged costs no host call.
            Some((_, last)) if *last == value => return,
            Some((id, last)) => {
                *last = value;
                *id
            }
            None => match hostcalls::define_metric(MetricType::Gauge, name) {
                Ok(id) => state.gauge_ids.entry(name.to_string()).or_insert((id, value)).0,
                Err(_) => return,
            },
        };
        drop(state);
        let _ = hostcalls::record_metric(id, value);
    }

    fn log(&mut self, level: LogLevel, message: &str) {
        match level {
            LogLevel::Debug => log::debug!("{message}"),
            LogLevel::Info => log::info!("{message}"),
            LogLevel::Warn => log::warn!("{message}"),
            LogLevel::Error => log::error!("{message}"),
        }
    }

    fn warn_once(&mut self, topic: &'static str, message: &str) {
        if self.state.borrow_mut().warned.insert(topic) {
            log::warn!("{message}");
        }
    }
}
