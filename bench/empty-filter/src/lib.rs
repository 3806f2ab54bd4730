//! Benchmark baseline: the cheapest useful proxy-wasm filter, adding one response header.
//! What it costs is the floor any proxy-wasm filter pays on this host.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
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
    fn on_http_response_headers(&mut self, _: usize, _: bool) -> Action {
        let _ = proxy_wasm::hostcalls::add_map_value(MapType::HttpResponseHeaders, "x-empty-filter", "1");
        Action::Continue
    }
}
