//! The proxy-wasm glue: reads the config, asks the companion, applies the decision, and
//! settles token reservations when replies end. All judgement lives in the pure modules;
//! this layer moves data between them and the host. Host calls go through `host`, which
//! handles every status: a panic here would abort the VM and take the worker's traffic
//! with it.
//!
//! A request's life: headers (identify the tenant) → body, when a limit counts tokens
//! (plan the charge) → callout (charge, all limits at once) → forwarded or answered
//! locally → reply read for its usage → settlement queued → sent by the root context.

mod host;

use crate::charge::{average_key, plan, ChargePlan};
use crate::config::{Config, FailureMode, MissingIdentity};
use crate::decision::{self, Header, LocalReply, DEGRADED_HEADER, RESERVED_TOKENS_HEADER};
use crate::identity::{find_credential, tenant_id, ANONYMOUS_TENANT};
use crate::protocol::{
    Adjustment, Reservation, SettleReply, SettleRequest, Settlement, TokenBucketReply, TokenBucketRequest, SETTLE_PATH,
    TOKEN_BUCKET_PATH, TOKEN_HEADER,
};
use crate::reservation::{actual_tokens, credit, Ending, OutputAverage};
use crate::settle_queue::{Queued, SettleQueue};
use crate::sse::UsageChunkRemover;
use crate::usage::{ReplyUsage, ReportedUsage, StreamUsage};
use host::Metric;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

/// How often each VM sends its queued settlements (and, once, warms the tokenizer).
const TICK: Duration = Duration::from_millis(50);
const SETTLE_BATCH: usize = 200;
const SETTLE_QUEUE_CAPACITY: usize = 20_000;
/// Largest SSE event read for usage; larger ones are skipped.
const MAX_SSE_EVENT: usize = 1 << 20;
/// A JSON reply up to this size is parsed whole; past it only its tail is kept.
const REPLY_WINDOW: usize = 256 * 1024;

thread_local! {
    static SETTLEMENTS: RefCell<SettleQueue> = RefCell::new(SettleQueue::new(SETTLE_QUEUE_CAPACITY));
    static RESERVATION_COUNTER: Cell<u64> = const { Cell::new(0) };
    static VM_NONCE: Cell<u64> = const { Cell::new(0) };
}

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(Root { config: None, warmed_up: false, settling: None })
    });
}}

/// splitmix64: spreads a counter into well-mixed bits.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Unique per request across proxies: a per-VM nonce from the clock at first use (there
/// is no OS randomness in this wasm target), mixed with a per-VM counter.
fn new_reservation_id() -> String {
    let nonce = VM_NONCE.with(|n| {
        if n.get() == 0 {
            n.set(mix(host::now_nanos() as u64) | 1);
        }
        n.get()
    });
    let count = RESERVATION_COUNTER.with(|c| {
        c.set(c.get() + 1);
        c.get()
    });
    format!("{:016x}{count:x}", mix(nonce ^ count))
}

struct Root {
    config: Option<Rc<Config>>,
    warmed_up: bool,
    /// The settlement batch whose callout is out, by its token.
    settling: Option<(u32, Vec<Queued>)>,
}

impl Root {
    fn send_settlements(&mut self, config: &Config) {
        if self.settling.is_some() {
            return;
        }
        let batch = SETTLEMENTS.with(|q| q.borrow_mut().take_batch(SETTLE_BATCH));
        if batch.is_empty() {
            return;
        }
        let request = SettleRequest { settlements: batch.iter().map(|q| q.settlement.clone()).collect() };
        let sent = serde_json::to_vec(&request).map_err(|e| e.to_string()).and_then(|body| {
            call_companion(config, SETTLE_PATH, &body, config.companion.timeout.0.max(Duration::from_secs(1)))
        });
        match sent {
            Ok(token) => self.settling = Some((token, batch)),
            Err(why) => {
                log::warn!("llm-ratelimit: cannot send settlements: {why}");
                self.requeue(batch, None);
            }
        }
    }

    fn requeue(&mut self, batch: Vec<Queued>, outcomes: Option<&[crate::protocol::SettleOutcome]>) {
        let given_up = SETTLEMENTS.with(|q| q.borrow_mut().requeue(batch, outcomes));
        if given_up > 0 {
            host::add(Metric::SettlementsFailed, given_up as u64);
            log::warn!("llm-ratelimit: gave up {given_up} settlement(s); their reservations will expire as charged");
        }
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some((expected, batch)) = self.settling.take() else {
            return;
        };
        if expected != token {
            self.settling = Some((expected, batch));
            return;
        }
        let reply = (host::callout_status() == Some(200))
            .then(|| serde_json::from_slice::<SettleReply>(&host::callout_body(body_size)).ok())
            .flatten()
            .filter(|reply| reply.results.len() == batch.len());
        match reply {
            Some(reply) => self.requeue(batch, Some(&reply.results)),
            None => self.requeue(batch, None),
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = host::plugin_configuration();
        match Config::from_json(&bytes) {
            Ok(config) => {
                host::define_metrics();
                log::info!(
                    "llm-ratelimit: configured {} limit(s) in domain {:?}, companion {:?}",
                    config.limits.len(),
                    config.domain,
                    config.companion.upstream
                );
                if config.counts_tokens() {
                    host::set_tick_period(TICK);
                }
                self.config = Some(Rc::new(config));
                self.warmed_up = false;
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
        let Some(config) = self.config.clone() else {
            return;
        };
        if !self.warmed_up && config.tokens.warm_up {
            self.warmed_up = true;
            config.tokens.default_encoding.warm_up();
            for rule in &config.tokens.models {
                rule.encoding.warm_up();
            }
        }
        self.send_settlements(&config);
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; a VM whose config was refused gets pass-through contexts.
        Some(Box::new(RequestFilter::new(self.config.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

fn call_companion(config: &Config, path: &str, body: &[u8], timeout: Duration) -> Result<u32, String> {
    let companion = &config.companion;
    let headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", companion.authority()),
        ("content-type", "application/json"),
        (TOKEN_HEADER, companion.token.expose()),
    ];
    host::dispatch(&companion.upstream, headers, body, timeout)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Headers not seen yet, or no config.
    Starting,
    /// Waiting for the end of the request body, to count it.
    ReadingBody,
    /// The charge callout is out; the request waits.
    Deciding,
    /// Admitted and sent upstream.
    Forwarded,
    /// Answered by the filter.
    Replied,
}

/// Reads the reply for its usage.
enum ReplyReader {
    Json(ReplyUsage),
    Stream(StreamUsage),
}

struct RequestFilter {
    config: Option<Rc<Config>>,
    phase: Phase,
    tenant: String,
    plan: Option<ChargePlan>,
    /// Set once tokens were charged: the reservation to settle.
    reservation: Option<String>,
    /// Added to the upstream's response once it arrives.
    response_headers: Vec<Header>,
    reply: Option<ReplyReader>,
    upstream_error: bool,
    /// Present when the filter asked for stream usage the client did not.
    usage_remover: Option<UsageChunkRemover>,
    /// Size of the request body as read, for replacing it.
    body_len: usize,
}

/// What to do with the paused request.
enum Verdict {
    Forward(Vec<Header>),
    Reply(LocalReply),
}

impl RequestFilter {
    fn new(config: Option<Rc<Config>>) -> RequestFilter {
        RequestFilter {
            config,
            phase: Phase::Starting,
            tenant: String::new(),
            plan: None,
            reservation: None,
            response_headers: Vec::new(),
            reply: None,
            upstream_error: false,
            usage_remover: None,
            body_len: 0,
        }
    }

    fn identify(&self, config: &Config) -> Result<String, Verdict> {
        match (find_credential(&config.identity.sources, host::request_header), config.identity.missing) {
            (Some(credential), _) => Ok(tenant_id(&credential)),
            (None, MissingIdentity::Anonymous) => Ok(ANONYMOUS_TENANT.to_string()),
            (None, MissingIdentity::Reject) => {
                host::increment(Metric::Unidentified);
                Err(Verdict::Reply(decision::missing_identity()))
            }
        }
    }

    /// Plans the charge and sends it. `body` is `None` when no limit counts tokens.
    fn charge(&mut self, config: &Config, body: Option<&[u8]>) -> Action {
        let path = host::request_header(":path").unwrap_or_default();
        let plan = plan(config, &path, body, |model| {
            host::shared_get(&average_key(&config.domain, &self.tenant, model))
                .and_then(|b| OutputAverage::from_bytes(&b))
        });
        self.body_len = body.map_or(0, <[u8]>::len);
        let reservation = plan.estimate.map(|_| new_reservation_id());
        let request = TokenBucketRequest {
            domain: config.domain.clone(),
            tenant: self.tenant.clone(),
            limits: plan.buckets.clone(),
            reservation: reservation
                .clone()
                .map(|id| Reservation { id, ttl_ms: config.tokens.reservation_ttl.0.as_millis() as u64 }),
        };
        self.plan = Some(plan);
        self.reservation = reservation;
        let sent = serde_json::to_vec(&request)
            .map_err(|e| e.to_string())
            .and_then(|body| call_companion(config, TOKEN_BUCKET_PATH, &body, config.companion.timeout.0));
        match sent {
            Ok(_token) => {
                self.phase = Phase::Deciding;
                Action::Pause
            }
            Err(why) => {
                let verdict = self.companion_failed(config, &why);
                self.apply(verdict, false)
            }
        }
    }

    fn decide(&mut self, config: &Config, body_size: usize) -> Verdict {
        let status = host::callout_status();
        if status != Some(200) {
            return self.companion_failed(config, &format!("companion answered status {status:?}"));
        }
        let expected = self.plan.as_ref().map_or(0, |p| p.buckets.len());
        let reply = match serde_json::from_slice::<TokenBucketReply>(&host::callout_body(body_size)) {
            Ok(reply) if reply.limits.len() == expected => reply,
            Ok(_) => return self.companion_failed(config, "companion reply has the wrong number of limits"),
            Err(err) => return self.companion_failed(config, &format!("companion reply is not valid: {err}")),
        };
        if reply.allowed {
            host::increment(Metric::Allowed);
            self.rewrite_body(config, &reply);
            let reserved = self.plan.as_ref().and_then(|p| p.estimate).map(|e| e.total());
            let mut headers = decision::rate_limit_headers(&reply, config);
            if let Some(reserved) = reserved {
                host::add(Metric::TokensReserved, reserved);
                headers.push((RESERVED_TOKENS_HEADER, reserved.to_string()));
            }
            Verdict::Forward(headers)
        } else {
            host::increment(Metric::Limited);
            self.reservation = None; // nothing was charged
            let reserved = self.plan.as_ref().and_then(|p| p.estimate).map_or(0, |e| e.total());
            Verdict::Reply(decision::rejection(&reply, config, reserved))
        }
    }

    /// Sends upstream the body the charge calls for: the output cap clamped to what was
    /// granted, stream usage requested. Only while the headers are still held can
    /// content-length follow the new body, so nothing changes otherwise.
    fn rewrite_body(&mut self, config: &Config, reply: &TokenBucketReply) {
        let Some(plan) = self.plan.as_mut() else { return };
        if !config.hold_request_headers {
            return;
        }
        let charged = plan
            .token_buckets(config)
            .next()
            .and_then(|b| reply.limits.iter().find(|o| o.name == b.name))
            .map(|o| o.charged);
        let Some(body) = plan.apply_grant(config, charged) else { return };
        if host::replace_request_body(self.body_len, &body)
            && host::set_request_header("content-length", &body.len().to_string())
            && config.tokens.request_stream_usage
            && plan.request.as_ref().is_some_and(|r| r.wants_usage_added())
        {
            self.usage_remover = Some(UsageChunkRemover::default());
        }
    }

    fn companion_failed(&mut self, config: &Config, why: &str) -> Verdict {
        host::increment(Metric::CompanionFailures);
        self.reservation = None; // nothing was charged
        log::warn!("llm-ratelimit: no decision from the companion ({why}); failure_mode {:?}", config.failure_mode);
        match config.failure_mode {
            FailureMode::Allow => Verdict::Forward(vec![(DEGRADED_HEADER, "companion-unavailable".to_string())]),
            FailureMode::Deny => Verdict::Reply(decision::limiter_unavailable()),
        }
    }

    /// Carries a verdict out. `paused` says whether the request is waiting on us.
    fn apply(&mut self, verdict: Verdict, paused: bool) -> Action {
        match verdict {
            Verdict::Forward(headers) => {
                self.phase = Phase::Forwarded;
                self.response_headers = headers;
                if paused {
                    host::resume_request();
                }
                Action::Continue
            }
            Verdict::Reply(reply) => {
                self.phase = Phase::Replied;
                self.response_headers.clear();
                host::send_reply(&reply);
                Action::Pause
            }
        }
    }

    /// Queues the settlement of this request's reservation, once.
    fn settle(&mut self, config: &Config, ending: Ending) {
        let (Some(reservation), Some(plan)) = (self.reservation.take(), self.plan.as_ref()) else {
            return;
        };
        let Some(estimate) = plan.estimate else {
            return;
        };
        let (reported, streamed_output) = match self.reply.as_mut() {
            Some(ReplyReader::Json(reader)) => (reader.finish(), None),
            Some(ReplyReader::Stream(reader)) => {
                reader.finish();
                (reader.reported(), Some(reader.output_tokens()))
            }
            None => (ReportedUsage::default(), None),
        };
        // A request that never went upstream cost nothing.
        let actual = if self.phase == Phase::Forwarded {
            actual_tokens(estimate, ending, reported, streamed_output, config.tokens.on_upstream_error)
        } else {
            0
        };
        host::add(Metric::TokensCharged, actual);
        if ending == Ending::Completed {
            if let Some(output) = reported.output.or(streamed_output) {
                let key = average_key(&config.domain, &self.tenant, &plan.model);
                let average = host::shared_get(&key).and_then(|b| OutputAverage::from_bytes(&b));
                let updated = average.map_or(OutputAverage::first(output), |a| a.update(output));
                host::shared_set(&key, &updated.to_bytes());
            }
        }
        let credit = credit(estimate, actual);
        if credit == 0 {
            return; // the charge was right; the reservation record expires by itself
        }
        let settlement = Settlement {
            domain: config.domain.clone(),
            tenant: self.tenant.clone(),
            reservation,
            limits: plan
                .token_buckets(config)
                .map(|b| Adjustment { name: b.name.clone(), capacity: b.capacity, window_ms: b.window_ms, credit })
                .collect(),
        };
        if SETTLEMENTS.with(|q| q.borrow_mut().push(settlement)).is_some() {
            host::increment(Metric::SettlementsFailed);
        }
    }
}

impl Context for RequestFilter {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some(config) = self.config.clone() else {
            return;
        };
        if self.phase != Phase::Deciding {
            return;
        }
        let verdict = self.decide(&config, body_size);
        self.apply(verdict, true);
    }
}

impl HttpContext for RequestFilter {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else {
            return Action::Continue;
        };
        match self.identify(&config) {
            Ok(tenant) => self.tenant = tenant,
            Err(verdict) => return self.apply(verdict, false),
        }
        if !config.counts_tokens() {
            return self.charge(&config, None);
        }
        if end_of_stream {
            return self.charge(&config, Some(&[]));
        }
        self.phase = Phase::ReadingBody;
        // Holding the headers needs the host to deliver the body meanwhile (Envoy:
        // `allow_on_headers_stop_iteration`); otherwise they go ahead and the body waits.
        if config.hold_request_headers {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else {
            return Action::Continue;
        };
        match self.phase {
            Phase::ReadingBody => {
                if body_size as u64 > config.tokens.max_request_bytes {
                    return self
                        .apply(Verdict::Reply(decision::body_too_large(config.tokens.max_request_bytes)), false);
                }
                if !end_of_stream {
                    return Action::Pause; // the host buffers until the end
                }
                let body = host::request_body(body_size);
                self.charge(&config, Some(&body))
            }
            // Envoy with `allow_on_headers_stop_iteration` delivers the body while the
            // headers are held, and a Continue here would send both upstream before the
            // decision.
            Phase::Deciding => Action::Pause,
            _ => Action::Continue,
        }
    }

    fn on_http_request_trailers(&mut self, _trailers: usize) -> Action {
        match self.phase {
            Phase::ReadingBody | Phase::Deciding => Action::Pause,
            _ => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        for (name, value) in self.response_headers.drain(..) {
            host::set_response_header(name, &value);
        }
        if self.reservation.is_some() {
            let status: u32 = host::response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
            self.upstream_error = status >= 400;
            let streaming = host::response_header("content-type").is_some_and(|t| t.contains("text/event-stream"));
            let encoding = self.plan.as_ref().map(|p| p.encoding).unwrap_or(crate::tokens::Encoding::O200kBase);
            self.reply = Some(if streaming {
                ReplyReader::Stream(StreamUsage::new(encoding, MAX_SSE_EVENT))
            } else {
                self.usage_remover = None;
                ReplyReader::Json(ReplyUsage::new(REPLY_WINDOW))
            });
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else {
            return Action::Continue;
        };
        if self.reply.is_none() || self.reservation.is_none() {
            return Action::Continue;
        }
        let chunk = host::response_body(body_size);
        match self.reply.as_mut() {
            Some(ReplyReader::Json(reader)) => reader.feed(&chunk),
            Some(ReplyReader::Stream(reader)) => reader.feed(&chunk),
            None => {}
        }
        if let Some(remover) = self.usage_remover.as_mut() {
            let passed = remover.filter(&chunk, end_of_stream);
            if passed != chunk {
                host::replace_response_body(body_size, &passed);
            }
        }
        if end_of_stream {
            let ending = if self.upstream_error { Ending::UpstreamError } else { Ending::Completed };
            self.settle(&config, ending);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // The stream ended without a complete reply: the client left, the upstream broke,
        // or the reply had no body.
        let Some(config) = self.config.clone() else {
            return;
        };
        let ending = if self.upstream_error { Ending::UpstreamError } else { Ending::Interrupted };
        self.settle(&config, ending);
    }
}
