#![cfg(target_arch = "wasm32")]
//! The proxy-wasm glue: maps each callback onto `llm-ratelimit-core` and implements its
//! [`Host`](llm_ratelimit_core::effects::host::Host) over the ABI (`host.rs`). No judgement lives
//! here: the request lifecycle is `lifecycle::RequestFilter`, the VM's state and
//! background work `worker::Worker`, both tested natively on the core's fake host.

mod abi;
mod host;

use host::{HostState, ProxyHost};
use llm_ratelimit_core::effects::host::Action as CoreAction;
use llm_ratelimit_core::effects::host::TICK;
use llm_ratelimit_core::lifecycle::RequestFilter;
use llm_ratelimit_core::worker::Worker;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::cell::RefCell;
use std::rc::{Rc, Weak};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn RootContext> {
        Box::new(Root {
            context_id,
            worker: Rc::new(RefCell::new(Worker::new())),
            state: Rc::new(RefCell::new(HostState::default())),
            acted_for: Rc::new(RefCell::new(Vec::new())),
        })
    });
}}

fn action(action: CoreAction) -> Action {
    match action {
        CoreAction::Continue => Action::Continue,
        CoreAction::Pause => Action::Pause,
    }
}

/// The requests of this VM the root acts for, by context: those waiting for a lease grant
/// another asked for (`Phase::AwaitingLease`), and those it woke that then asked a grant of
/// their own. Each is woken, and handed the answer to its ask, from the root's callbacks.
/// Entries leave when their request is decided or ends (`RequestFilter::waits_for_grant`,
/// `root_acts_for` say when; this keeps only the contexts, which the SDK owns).
type ActedFor = Rc<RefCell<Vec<(u32, Weak<RefCell<RequestFilter>>)>>>;

/// One per VM: holds the worker every request of this VM borrows.
struct Root {
    context_id: u32,
    worker: Rc<RefCell<Worker>>,
    state: Rc<RefCell<HostState>>,
    acted_for: ActedFor,
}

impl Root {
    fn host(&self) -> ProxyHost {
        ProxyHost::new(self.context_id, self.context_id, self.state.clone())
    }
}

/// Runs `f` for the request `context_id` the root acts for, with its context effective
/// (only hosts that honour the switch let requests wait: `HostKind::resumes_other_contexts`),
/// then makes the root's context effective again. False if it cannot now (its filter is
/// in a callback of its own, or the host refused the switch); a request that is gone is
/// dropped.
fn act_for(
    acted_for: &ActedFor,
    root: &ProxyHost,
    context_id: u32,
    f: impl FnOnce(&mut RequestFilter, &mut ProxyHost),
) -> bool {
    let found = acted_for.borrow().iter().find(|(c, _)| *c == context_id).and_then(|(_, f)| f.upgrade());
    let Some(filter) = found else {
        forget(acted_for, context_id);
        return true;
    };
    let Ok(mut request) = filter.try_borrow_mut() else { return false };
    if !host::make_effective(context_id) {
        return false;
    }
    let mut host = ProxyHost::acting_for(context_id, root.root_id, root.state.clone());
    f(&mut request, &mut host);
    if !request.root_acts_for() {
        forget(acted_for, context_id);
    }
    host::make_effective(root.context_id);
    true
}

/// The root no longer acts for `context_id`.
fn forget(acted_for: &ActedFor, context_id: u32) {
    acted_for.borrow_mut().retain(|(c, _)| *c != context_id);
}

/// Resumes the waiting requests the worker says are due, each in its own context, from a
/// root callback: a callout a woken request sends is the root's to the SDK, whose answer
/// `Root::on_http_call_response` hands back to it. One that cannot be resumed now is due
/// again at the next tick, never dropped (it would wait until its stream's timeout).
fn wake_waiters(worker: &mut Worker, acted_for: &ActedFor, root: &ProxyHost) {
    let mut not_now = Vec::new();
    for context_id in worker.waiters_due() {
        if !act_for(acted_for, root, context_id, |request, host| request.on_lease_news(host, worker)) {
            not_now.push(context_id);
        }
    }
    worker.due_again(not_now);
}

/// Sets the root's tick period when the worker says it changes (`Worker::tick_period_change`).
fn tick_for(worker: &mut Worker, root_id: u32, context_id: u32) {
    let Some(period) = worker.tick_period_change() else { return };
    // The tick is the root's: set as the root, whichever callback asks.
    let switch = context_id != root_id;
    if switch {
        host::make_effective(root_id);
    }
    host::set_tick_period(period);
    if switch {
        host::make_effective(context_id);
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let mut host = self.host();
        let Ok(mut worker) = self.worker.try_borrow_mut() else { return };
        let routed = self.state.borrow_mut().take_routed(token);
        match routed {
            // A woken request's own ask: its answer is that request's.
            Some(context_id) => {
                let handed = act_for(&self.acted_for, &host, context_id, |request, host| {
                    request.on_callout_response(host, &mut worker, body_size)
                });
                if !handed {
                    // Not seen: a request is never in a callback of its own while the root's
                    // runs. Said, since the request then waits for its stream's timeout.
                    log::warn!("llm-ratelimit: the answer to a woken request's ask could not be handed to it");
                }
            }
            None => worker.on_callout_response(&mut host, token, body_size),
        }
        wake_waiters(&mut worker, &self.acted_for, &host);
        tick_for(&mut worker, self.context_id, self.context_id);
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
        let Ok(mut worker) = self.worker.try_borrow_mut() else { return };
        let full = worker.on_root_tick(&mut host);
        wake_waiters(&mut worker, &self.acted_for, &host);
        tick_for(&mut worker, self.context_id, self.context_id);
        drop(worker);
        if full {
            self.state.borrow_mut().flush_metrics();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; a VM whose config was refused gets pass-through contexts.
        let filter = self.worker.try_borrow().map_or_else(|_| RequestFilter::pass_through(), |w| RequestFilter::on(&w));
        let host = ProxyHost::new(context_id, self.context_id, self.state.clone());
        let filter = Rc::new(RefCell::new(filter));
        Some(Box::new(Http { filter, host, worker: self.worker.clone(), acted_for: self.acted_for.clone() }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    /// Shared with the root's `ActedFor` while the root acts for the request.
    filter: Rc<RefCell<RequestFilter>>,
    host: ProxyHost,
    worker: Rc<RefCell<Worker>>,
    acted_for: ActedFor,
}

impl Http {
    /// Runs `f` with the worker; a re-entrant callback (the worker or the filter already
    /// borrowed) passes the stream on rather than panic. A request left waiting for a lease
    /// grant is the root's to wake.
    fn with_worker(&mut self, f: impl FnOnce(&mut RequestFilter, &mut ProxyHost, &mut Worker) -> CoreAction) -> Action {
        self.host.begin_callback();
        let worker = self.worker.clone();
        let (Ok(mut worker), Ok(mut filter)) = (worker.try_borrow_mut(), self.filter.try_borrow_mut()) else {
            return Action::Continue;
        };
        let next = f(&mut filter, &mut self.host, &mut worker);
        if filter.waits_for_grant() {
            let context_id = self.host.context_id;
            forget(&self.acted_for, context_id);
            self.acted_for.borrow_mut().push((context_id, Rc::downgrade(&self.filter)));
            tick_for(&mut worker, self.host.root_id, self.host.context_id);
        }
        action(next)
    }

    fn with_filter(&mut self, f: impl FnOnce(&mut RequestFilter, &mut ProxyHost) -> CoreAction) -> Action {
        self.host.begin_callback();
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
        let context_id = self.host.context_id;
        forget(&self.acted_for, context_id);
        self.host.state.borrow_mut().routed.retain(|(_, routed_to)| *routed_to != context_id);
    }
}
