#![cfg(target_arch = "wasm32")]
//! The proxy-wasm glue: maps each callback onto `llm-ratelimit-core` and implements its
//! [`Host`](llm_ratelimit_core::effects::host::Host) over the ABI (`host.rs`). No judgement lives
//! here: the request lifecycle is `lifecycle::RequestFilter`, the VM's state and
//! background work `worker::Worker`, both tested natively on the core's fake host.

mod host;

use host::{HostState, ProxyHost};
use llm_ratelimit_core::effects::host::Action as CoreAction;
use llm_ratelimit_core::lifecycle::{Phase, RequestFilter};
use llm_ratelimit_core::worker::{Worker, TICK};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root {
            context_id,
            worker: Rc::new(RefCell::new(Worker::new())),
            state: Rc::new(RefCell::new(HostState::default())),
            waiting: Rc::new(RefCell::new(HashMap::new())),
        })
    });
}}

fn action(action: CoreAction) -> Action {
    match action {
        CoreAction::Continue => Action::Continue,
        CoreAction::Pause => Action::Pause,
    }
}

/// The requests of this VM waiting for a lease grant another asked for, by context: the
/// worker says when each is due, and it is resumed from whichever callback learns it.
type Waiting = Rc<RefCell<HashMap<u32, Weak<RefCell<RequestFilter>>>>>;

/// One per VM: holds the worker every request of this VM borrows.
struct Root {
    context_id: u32,
    worker: Rc<RefCell<Worker>>,
    state: Rc<RefCell<HostState>>,
    waiting: Waiting,
}

impl Root {
    fn host(&self) -> ProxyHost {
        ProxyHost { context_id: self.context_id, root_id: self.context_id, state: self.state.clone() }
    }
}

/// Resumes the waiting requests the worker says are due, each as the effective context
/// (only hosts that honour the switch let requests wait: `HostKind::resumes_other_contexts`),
/// then makes `current`'s context effective again.
fn wake_waiters(worker: &mut Worker, waiting: &Waiting, current: &ProxyHost) {
    let due = worker.waiters_due();
    if due.is_empty() {
        return;
    }
    let mut not_now = Vec::new();
    for context_id in due {
        let Some(filter) = waiting.borrow_mut().remove(&context_id).and_then(|weak| weak.upgrade()) else {
            continue; // its stream is gone
        };
        // Busy (a re-entrant callback) or not switchable to now: due again at the
        // next callback or tick, never dropped (it would wait until the stream's timeout).
        let Ok(mut waiter) = filter.try_borrow_mut() else {
            waiting.borrow_mut().insert(context_id, Rc::downgrade(&filter));
            not_now.push(context_id);
            continue;
        };
        // SAFETY: a plain host call taking an integer; any status is handled.
        if unsafe { host::proxy_set_effective_context(context_id) } != 0 {
            drop(waiter);
            waiting.borrow_mut().insert(context_id, Rc::downgrade(&filter));
            not_now.push(context_id);
            continue;
        }
        let mut host = ProxyHost { context_id, root_id: current.root_id, state: current.state.clone() };
        waiter.on_lease_news(&mut host, worker);
        if waiter.phase() == Phase::AwaitingLease {
            waiting.borrow_mut().insert(context_id, Rc::downgrade(&filter));
        }
    }
    // SAFETY: as above.
    unsafe { host::proxy_set_effective_context(current.context_id) };
    worker.due_again(not_now);
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let mut host = self.host();
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            worker.on_callout_response(&mut host, token, body_size);
            wake_waiters(&mut worker, &self.waiting, &host);
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
            wake_waiters(&mut worker, &self.waiting, &host);
        }
        self.state.borrow_mut().flush_metrics();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; a VM whose config was refused gets pass-through contexts.
        let filter = self.worker.try_borrow().map_or_else(|_| RequestFilter::pass_through(), |w| RequestFilter::on(&w));
        let host = ProxyHost { context_id, root_id: self.context_id, state: self.state.clone() };
        let filter = Rc::new(RefCell::new(filter));
        Some(Box::new(Http { filter, host, worker: self.worker.clone(), waiting: self.waiting.clone() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    /// Shared with `Waiting` while the request waits for a lease grant.
    filter: Rc<RefCell<RequestFilter>>,
    host: ProxyHost,
    worker: Rc<RefCell<Worker>>,
    waiting: Waiting,
}

impl Http {
    /// Runs `f` with the worker, then resumes the waiters it made due; a re-entrant
    /// callback (the worker or the filter already borrowed) passes the stream on rather
    /// than panic.
    fn with_worker(&mut self, f: impl FnOnce(&mut RequestFilter, &mut ProxyHost, &mut Worker) -> CoreAction) -> Action {
        let worker = self.worker.clone();
        let (Ok(mut worker), Ok(mut filter)) = (worker.try_borrow_mut(), self.filter.try_borrow_mut()) else {
            return Action::Continue;
        };
        let next = f(&mut filter, &mut self.host, &mut worker);
        if filter.phase() == Phase::AwaitingLease {
            self.waiting.borrow_mut().insert(self.host.context_id, Rc::downgrade(&self.filter));
        }
        drop(filter);
        wake_waiters(&mut worker, &self.waiting, &self.host);
        action(next)
    }

    fn with_filter(&mut self, f: impl FnOnce(&mut RequestFilter, &mut ProxyHost) -> CoreAction) -> Action {
        match self.filter.try_borrow_mut() {
            Ok(mut filter) => action(f(&mut filter, &mut self.host)),
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
        self.with_filter(|filter, _| filter.on_request_trailers())
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.with_filter(|filter, host| filter.on_response_headers(host))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with_worker(|filter, host, worker| filter.on_response_body(host, worker, body_size, end_of_stream))
    }

    fn on_log(&mut self) {
        self.with_worker(|filter, host, worker| {
            filter.on_done(host, worker);
            CoreAction::Continue
        });
        self.waiting.borrow_mut().remove(&self.host.context_id);
    }
}
