#![cfg(target_arch = "wasm32")]
//! The proxy-wasm glue: maps each callback onto `llm-ratelimit-core` and implements its
//! [`Host`](llm_ratelimit_core::effects::host::Host) over the ABI (`host.rs`). No judgement lives
//! here: the request lifecycle is `lifecycle::RequestFilter`, the VM's state and
//! background work `worker::Worker`, both tested natively on the core's fake host.

mod abi;
mod host;

use host::{HostState, ProxyHost};
use llm_ratelimit_core::effects::host::Action as CoreAction;
use llm_ratelimit_core::lifecycle::RequestFilter;
use llm_ratelimit_core::worker::{Worker, TICK};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root {
            context_id,
            worker: Rc::new(RefCell::new(Worker::new())),
            state: Rc::new(RefCell::new(HostState::default())),
        })
    });
}}

fn action(action: CoreAction) -> Action {
    match action {
        CoreAction::Continue => Action::Continue,
        CoreAction::Pause => Action::Pause,
    }
}

/// One per VM: holds the worker every request of this VM borrows.
struct Root {
    context_id: u32,
    worker: Rc<RefCell<Worker>>,
    state: Rc<RefCell<HostState>>,
}

impl Root {
    fn host(&self) -> ProxyHost {
        ProxyHost::new(self.context_id, self.context_id, self.state.clone())
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let mut host = self.host();
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            worker.on_callout_response(&mut host, token, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let mut host = self.host();
        let Ok(mut worker) = self.worker.try_borrow_mut() else { return false };
        match worker.configure(&mut host, &host::plugin_configuration()) {
            Ok(()) => {
                let mut state = self.state.borrow_mut();
                state.define_metrics();
                if let Some(config) = worker.config() {
                    state.define_series(config);
                }
                drop(state);
                host::set_tick_period(TICK);
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
        let mut host = self.host();
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            worker.on_tick(&mut host);
        }
        self.state.borrow_mut().flush_metrics();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; a VM whose config was refused gets pass-through contexts.
        let filter = self.worker.try_borrow().map_or_else(|_| RequestFilter::pass_through(), |w| RequestFilter::on(&w));
        let host = ProxyHost::new(context_id, self.context_id, self.state.clone());
        Some(Box::new(Http { filter, host, worker: self.worker.clone() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    filter: RequestFilter,
    host: ProxyHost,
    worker: Rc<RefCell<Worker>>,
}

impl Http {
    /// Runs `f` with the worker; a re-entrant callback (the worker already borrowed)
    /// passes the stream on rather than panic.
    fn with_worker(&mut self, f: impl FnOnce(&mut RequestFilter, &mut ProxyHost, &mut Worker) -> CoreAction) -> Action {
        self.host.begin_callback();
        match self.worker.clone().try_borrow_mut() {
            Ok(mut worker) => action(f(&mut self.filter, &mut self.host, &mut worker)),
            Err(_) => Action::Continue,
        }
    }
}

impl Context for Http {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        self.with_worker(|filter, host, worker| {
            filter.on_callout_response(host, worker, body_size);
            CoreAction::Continue
        });
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        self.with_worker(|filter, host, worker| filter.on_request_headers(host, worker, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with_worker(|filter, host, worker| filter.on_request_body(host, worker, body_size, end_of_stream))
    }

    fn on_http_request_trailers(&mut self, _trailers: usize) -> Action {
        action(self.filter.on_request_trailers())
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.host.begin_callback();
        action(self.filter.on_response_headers(&mut self.host))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with_worker(|filter, host, worker| filter.on_response_body(host, worker, body_size, end_of_stream))
    }

    fn on_log(&mut self) {
        self.with_worker(|filter, host, worker| {
            filter.on_done(host, worker);
            CoreAction::Continue
        });
    }
}
