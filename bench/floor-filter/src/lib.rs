//! Benchmark baseline: the proxy-wasm host interaction a token-aware filter deciding from
//! a lease has to make for one chat request on Envoy, and nothing else. It reads the
//! credential and the path, holds the headers while the body is buffered, copies the
//! whole body into the VM, reads and compare-and-swaps one shared-data slot (the lease),
//! sets as many rate-limit response headers as llm-ratelimit does with an RPM + TPM
//! policy, and copies each chunk of the reply into the VM (where the usage is). No
//! parsing, counting or deciding: what it costs over the empty filter is the ABI's share
//! of llm-ratelimit's cost, the rest is the filter's own work.
//!
//! Kept in step with the filter (`src/`) and `crates/core/src/lifecycle/` on Envoy: the same
//! callbacks with the same actions, the same 50 ms root tick.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType};
use std::time::Duration;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

/// The worker's tick in llm-ratelimit (`effects::host::TICK`): Envoy calls the root this often.
const TICK: Duration = Duration::from_millis(50);

/// One slot of shared data, standing for the tenant's lease entry.
const LEASE_KEY: &str = "floor-filter:lease";

/// What llm-ratelimit sets on a forwarded reply for an RPM + TPM policy with its default
/// header styles (OpenAI's and the IETF's), with values of the lengths it writes.
const RESPONSE_HEADERS: [(&str, &str); 9] = [
    ("x-ratelimit-limit-requests", "1000000000"),
    ("x-ratelimit-remaining-requests", "999999876"),
    ("x-ratelimit-reset-requests", "60ms"),
    ("x-ratelimit-limit-tokens", "1000000000000"),
    ("x-ratelimit-remaining-tokens", "999999987654"),
    ("x-ratelimit-reset-tokens", "60ms"),
    ("ratelimit-policy", "\"rpm\";q=1000000000;w=60, \"tpm\";q=1000000000000;w=60"),
    ("ratelimit", "\"rpm\";r=999999876;t=1, \"tpm\";r=999999987654;t=1"),
    ("x-llm-ratelimit-reserved-tokens", "72"),
];

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let _ = hostcalls::set_tick_period(TICK);
        true
    }

    fn on_tick(&mut self) {}

    fn create_http_context(&self, _id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Filter))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Filter;

impl Context for Filter {}

impl HttpContext for Filter {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        let _credential = hostcalls::get_map_value(MapType::HttpRequestHeaders, "authorization");
        let _path = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path");
        // As llm-ratelimit on Envoy (`allow_on_headers_stop_iteration`): the headers wait
        // for the decision, which waits for the body.
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause; // Envoy buffers until the end
        }
        let _body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size);
        if let Ok((lease, cas)) = hostcalls::get_shared_data(LEASE_KEY) {
            let lease = lease.unwrap_or_else(|| vec![0; 48]);
            let _ = hostcalls::set_shared_data(LEASE_KEY, Some(&lease), cas);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _: usize, _: bool) -> Action {
        // Whether the reply is an error, and a stream or JSON: how its usage is read.
        let _status = hostcalls::get_map_value(MapType::HttpResponseHeaders, ":status");
        let _content_type = hostcalls::get_map_value(MapType::HttpResponseHeaders, "content-type");
        for (name, value) in RESPONSE_HEADERS {
            let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, _: bool) -> Action {
        let _chunk = hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size);
        Action::Continue
    }
}
