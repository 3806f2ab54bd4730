//! One request's life, as plain Rust over [`Host`]: identified, planned, decided (from a
//! lease, locally, or by the companion), forwarded or answered, then settled once from the
//! usage its reply reports. docs/architecture.md draws the walk.
//!
//! This file holds the request's state, the host callbacks that move it through its
//! phases, and the dispatcher: each admission route is a file of its own that returns an
//! outcome here (a [`Verdict`], or its own enum) and never calls another route
//! (`scripts/check_layers.py` fails if one does):
//!
//! - `identify.rs`: the tenant, the upstream's credential, the tier and the charge's plan;
//! - `provider.rs`: the provider's word on its own limits (`provider_limits`);
//! - `overflow.rs`: a refused request sent to a fallback backend instead;
//! - `lease.rs`: admitted from this proxy's lease, or a grant asked or waited for;
//! - `direct.rs`: charged in Redis by one callout, under a reservation record;
//! - `queue.rs`: a direct charge waiting in the companion for capacity;
//! - `degraded.rs`: decided without the companion (`failure_mode`);
//! - `store.rs`: charged in this proxy's local store (`"store": "local"`).
//!
//! What every route shares, naming none: `answer.rs` (counting, the 429 and headers,
//! carrying a verdict out) and `settle.rs` (the reply read for what it used, the credits
//! of its settlement, its record and ledger entry). `record.rs` formats the record. Each
//! route settles what it admitted (`settle_*`), as the dispatcher's `settle_admission`
//! hands it the credits.
//!
//! A newcomer reads this file's callbacks and dispatcher first, then the route a question
//! is about.
//!
//! The worker ([`Worker`]) holds what outlives a request; each callback borrows it.

use crate::accounting::breaker::Dispatch;
use crate::accounting::reply_floor::ReplySight;
use crate::accounting::reservation::{Ending, TokenCounts};
use crate::api::dialect::Dialect;
use crate::config::{Mode, Policy, Store};
use crate::effects::host::{Action, Host, HostKind, Metric};
use crate::effects::lease_table::{self, Hold, Holder};
use crate::effects::provider_state::ProviderState;
use crate::effects::provider_word::ProviderWord;
use crate::parse::sse::UsageChunkRemover;
use crate::plan::charge::{ChargePlan, Grant};
use crate::protocol::{LimitKind, LimitsReply, Suspension, Wait};
use crate::providers;
use crate::readers::usage::ReplyReader;
use crate::replies::decision::{self, DEGRADED_HEADER, OVERFLOW_HEADER, QUEUED_HEADER};
use crate::replies::reply::{Header, LocalReply};
use crate::worker::companion::callout_reply;
use crate::worker::Worker;
use degraded::Degraded;
use identify::Recognised;
use lease::FromLease;
use provider::ProviderSays;
use std::rc::Rc;

/// How long after its longest wait an abandoned request's cancellation may still arrive.
const CANCEL_WINDOW_MS: u64 = 10_000;
/// How long a charge with nothing to settle keeps its record for the refund of an
/// upstream 401/403. Providers refuse a credential before they generate anything, so the
/// status comes within this; past it the charge stands (no credit is ever unbacked). Such
/// records are never deleted by a settlement, so this bounds their memory in Redis:
/// requests/s x 10 s x ~226 B.
const REFUND_WINDOW_MS: u64 = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Headers not seen yet, or no config, or bypassed.
    Starting,
    /// Waiting for the end of the request body, to count it.
    ReadingBody,
    /// A callout is out; the request waits.
    Deciding,
    /// Lease mode: the lease ran dry while a grant for it is out (another request's, or
    /// a renewal); the request waits for it, then takes from the lease again.
    AwaitingLease,
    /// Admitted and sent upstream.
    Forwarded,
    /// Answered by the filter.
    Replied,
}

/// What the outstanding callout asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ask {
    /// Charge the request in Redis (direct mode).
    Charge,
    /// Grant this proxy a lease that covers the request (lease mode).
    Lease,
}

/// Where the request's budget was taken from, so its settlement goes back there.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Admission {
    /// Charged in Redis under this reservation.
    Reserved(String),
    /// Taken from this proxy's lease.
    Leased,
    /// Decided by the local limiter while the companion was away (the degraded mode), at
    /// this time (ms); reconciled with Redis later by a stand-in for the charge under this
    /// reservation (its slots' holder too), whose record the request's settlement is made
    /// against.
    Degraded { id: String, charged_at_ms: u64 },
    /// Charged by the local limiter under the local store (`"store": "local"`) at this
    /// time (ms), under this reservation id (its slots' holder).
    Stored { id: String, charged_at_ms: u64 },
    /// Charged in Redis by a lease grant that could not be kept as a lease: the
    /// settlement's credits go to Redis on their own, backed by what the grant took.
    Charged,
}

/// Where a request is decided from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resumed {
    /// In one of its own callbacks.
    InOwnCallback,
    /// Woken, paused, from the root's callback after waiting for a lease grant another
    /// asked for. A callout it sends there is the root's to the SDK, which hands the answer
    /// to the root: the glue passes it on to this request (see `src/lib.rs`).
    ByRoot,
}

/// What to do with the paused request.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Forward(Vec<Header>),
    Reply(LocalReply),
    /// The request overflowed: a second charge, on the fallback's limits, is out and
    /// decides it when it answers.
    Recharging,
}

impl Verdict {
    /// The same verdict, its response carrying one more header.
    fn with_header(mut self, name: &'static str, value: String) -> Verdict {
        match &mut self {
            Verdict::Forward(headers) => headers.push((name, value.into())),
            Verdict::Reply(reply) => reply.headers.push((name, value.into())),
            Verdict::Recharging => {}
        }
        self
    }
}

pub struct RequestFilter {
    config: Option<Rc<Policy>>,
    phase: Phase,
    tenant: String,
    /// The tenant's tier, when tiers are configured.
    tier: String,
    plan: Option<ChargePlan>,
    /// What the decision granted beyond the plan: a clamped output allowance (the plan
    /// itself is never changed by a decision; see `reserved`).
    grant: Option<Grant>,
    ask: Ask,
    /// Set once admitted, until settled.
    admission: Option<Admission>,
    /// Added to the upstream's response once it arrives.
    response_headers: Vec<Header>,
    reply: Option<ReplyReader>,
    upstream_error: bool,
    /// Present when the filter asked for stream usage the client did not.
    usage_remover: Option<UsageChunkRemover>,
    /// Size of the request body as read, for replacing it.
    body_len: usize,
    /// The charge may wait in the queue: this request counts against its length.
    queued: bool,
    /// Lease mode: the parts of the request its covered lease entries gave, held while a
    /// grant for the short ones is asked.
    lease_hold: Option<Hold>,
    /// Lease mode: until when the request may wait for grants others asked for, set when
    /// it first waits: no longer, in all, than one such grant can be out. Woken, it takes
    /// from the lease again; if that falls short while a newer grant is out it waits for
    /// that one too (a grant of its own beside it would be a second grant of the tenant
    /// out), and past this time it asks for itself.
    lease_wait_until: Option<u64>,
    /// Whether the headers are held while the body is read.
    holding_headers: bool,
    /// What the request's `:path` says, read once when its headers arrive; `None` for a
    /// path no API is recognised in.
    route: Option<providers::Route>,
    /// Whose shape the filter's own answers to this request take.
    dialect: Dialect,
    /// What the filter's own replies carry as `x-request-id` and `request-id`: the
    /// proxy's `x-request-id` (Envoy sets one), else one of the filter's own.
    request_id: String,
    /// What the filter saw of the reply, for the least its settlement charges.
    sight: ReplySight,
    /// The upstream refused the request's credential (401 or 403): it did no work, and a
    /// forged request must not use up the tenant it names.
    credential_refused: bool,
    /// What the provider says of its limits, for this request (`provider_limits`).
    provider: ProviderSide,
    /// The fallback backend the request was sent to instead of a 429 (`overflow`).
    overflow: Option<String>,
    /// Whether a request header set now still chooses the route: not once the headers
    /// went ahead without waiting for the decision.
    route_open: bool,
    /// Shadow mode: enforcement would have sent this refused request to its limits'
    /// overflow backend instead (what its shadow header says).
    shadow_overflow: bool,
    /// What the request's record says that the rest of its state does not (`record`).
    recorded: RecordState,
    host_kind: HostKind,
}

/// What goes into a request's record besides what the filter keeps anyway.
#[derive(Debug, Default)]
struct RecordState {
    how: record::How,
    used: record::Used,
    refused_by: Option<String>,
    queued_ms: u64,
    shadow: bool,
    /// Each pool's claimant charged (`per` a header): its owner id and `<header>=<value>`.
    pools: Vec<(String, String)>,
    /// Published: a request's record is published once.
    published: bool,
    /// Added to the worker's spend ledger: once.
    in_ledger: bool,
}

/// A request's part in what the provider says of its limits.
#[derive(Debug, Default)]
struct ProviderSide {
    /// The id of the credential the upstream sees (the tenant, unless the operator
    /// identifies tenants otherwise).
    credential: String,
    /// The key of (credential, model), once the request was judged by it; its reply is
    /// heard under it.
    key: Option<u64>,
    /// When the request was forwarded.
    sent_ms: u64,
    /// What the response's headers said, while the body of a throttling error is read for
    /// its retry time (Google's RetryInfo).
    pending: Option<(ProviderWord, Vec<u8>)>,
    /// What was heard, for the fleet's next exchange.
    heard: Option<ProviderState>,
    /// The `x-llm-ratelimit-provider` value the forwarded response carries.
    mark: Option<&'static str>,
}

impl RequestFilter {
    pub(crate) fn new(config: Option<Rc<Policy>>, host_kind: HostKind) -> RequestFilter {
        RequestFilter {
            config,
            phase: Phase::Starting,
            tenant: String::new(),
            tier: String::new(),
            plan: None,
            ask: Ask::Charge,
            grant: None,
            admission: None,
            response_headers: Vec::new(),
            reply: None,
            upstream_error: false,
            usage_remover: None,
            body_len: 0,
            queued: false,
            lease_hold: None,
            lease_wait_until: None,
            holding_headers: false,
            route: None,
            dialect: Dialect::default(),
            request_id: String::new(),
            sight: ReplySight::default(),
            credential_refused: false,
            provider: ProviderSide::default(),
            overflow: None,
            route_open: true,
            shadow_overflow: false,
            recorded: RecordState::default(),
            host_kind,
        }
    }

    /// A request's state on `worker`; pass-through when it has no config.
    pub fn on(worker: &Worker) -> RequestFilter {
        RequestFilter::new(worker.config().cloned(), worker.host_kind())
    }

    /// A request the filter lets through untouched (no config).
    pub fn pass_through() -> RequestFilter {
        RequestFilter::new(None, HostKind::default())
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether, after one of its own callbacks, the request waits for a lease grant another
    /// asked for: its root then acts for it, and wakes it (`on_lease_news`) from a root
    /// callback once the worker says it is due.
    pub fn waits_for_grant(&self) -> bool {
        self.phase == Phase::AwaitingLease
    }

    /// Whether the root still acts for the request after waking it: it waits again, or it
    /// asked for a grant of its own from the root's callback, whose answer the SDK gives the
    /// root to hand on (`on_callout_response`). Otherwise it is decided and its own again.
    pub fn root_acts_for(&self) -> bool {
        matches!(self.phase, Phase::AwaitingLease | Phase::Deciding)
    }

    // ---- host callbacks ----

    pub fn on_request_headers(&mut self, host: &mut impl Host, worker: &mut Worker, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else { return Action::Continue };
        if config.overflows() {
            // Only the filter says where a request overflows: a client's own header would
            // send it to the fallback, bypassed or charged on the primary's limits.
            host.remove_request_header(OVERFLOW_HEADER);
        }
        match self.recognise(host, worker, &config) {
            Recognised::Bypassed => return Action::Continue,
            Recognised::Refused(verdict) => return self.apply(host, &config, verdict, false),
            Recognised::Identified => {}
        }
        // Read before the filter writes a request header: a host reads a map whose
        // headers it changed afresh, all of it.
        let no_body = end_of_stream || has_no_body(host, worker);
        if config.counts_tokens() {
            // A compressed reply hides its usage from the filter: ask for it plain (the
            // reply then costs the client more bandwidth; one the upstream compresses
            // all the same is charged at least its reservation, `reply_floor`).
            host.set_request_header("accept-encoding", "identity");
        }
        if !config.reads_body() && (no_body || worker.host_kind().decides_before_the_body_is_read()) {
            return self.charge(host, worker, &config, None);
        }
        if no_body {
            return self.charge(host, worker, &config, Some(&[]));
        }
        self.phase = Phase::ReadingBody;
        // Holding the headers needs the host to deliver the body meanwhile (Envoy with
        // `allow_on_headers_stop_iteration`); elsewhere they go ahead and the body waits.
        self.holding_headers = worker.holds_request_headers(&config);
        if self.holding_headers {
            Action::Pause
        } else {
            self.route_open = worker.host_kind().routes_after_the_body_is_read();
            Action::Continue
        }
    }

    pub fn on_request_body(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let Some(config) = self.config.clone() else { return Action::Continue };
        match self.phase {
            // Waiting only for the body's end (see `decides_before_the_body_is_read`).
            Phase::ReadingBody if !config.reads_body() => {
                if !end_of_stream {
                    return Action::Pause;
                }
                self.charge(host, worker, &config, None)
            }
            Phase::ReadingBody => {
                if body_size as u64 > config.tokens.max_request_bytes {
                    let reply = Verdict::Reply(decision::body_too_large(config.tokens.max_request_bytes, self.dialect));
                    return self.apply(host, &config, reply, false);
                }
                if !end_of_stream {
                    return Action::Pause; // the host buffers until the end
                }
                let body = host.request_body(body_size);
                self.charge(host, worker, &config, Some(&body))
            }
            // Envoy with `allow_on_headers_stop_iteration` delivers the body while the
            // headers are held, and a Continue here would send both upstream before the
            // decision.
            Phase::Deciding | Phase::AwaitingLease => Action::Pause,
            _ => Action::Continue,
        }
    }

    pub fn on_request_trailers(&mut self) -> Action {
        match self.phase {
            Phase::ReadingBody | Phase::Deciding | Phase::AwaitingLease => Action::Pause,
            _ => Action::Continue,
        }
    }

    /// The companion answered this request's callout.
    pub fn on_callout_response(&mut self, host: &mut impl Host, worker: &mut Worker, body_size: usize) {
        let Some(config) = self.config.clone() else { return };
        if self.phase != Phase::Deciding {
            return;
        }
        let verdict = self.decide(host, worker, &config, body_size);
        let verdict = match self.shadow(host, &config, verdict) {
            Verdict::Reply(reply) if body_size == 0 && !worker.host_kind().replies_after_an_empty_callout() => {
                Verdict::Reply(reply.without_body())
            }
            other => other,
        };
        self.carry_out(host, verdict, true);
    }

    /// The lease grant this request waits for answered, or can no longer be out: the
    /// request takes from the lease again and is admitted, refused, or asks for itself.
    /// Called from the root's callback (the tick, or a root callout's answer) with this
    /// request's context made effective.
    pub fn on_lease_news(&mut self, host: &mut impl Host, worker: &mut Worker) {
        let Some(config) = self.config.clone() else { return };
        if self.phase != Phase::AwaitingLease {
            return;
        }
        self.phase = Phase::Deciding;
        let now = host.now_ms();
        self.admit_or_ask(host, worker, &config, now, Resumed::ByRoot);
    }

    pub fn on_response_headers(&mut self, host: &mut impl Host) -> Action {
        // Before the filter's own rate-limit headers replace the provider's.
        if let (Some(config), true) = (self.config.clone(), self.provider.key.is_some()) {
            self.read_provider_headers(host, &config);
        }
        if self.admission.is_some() {
            self.read_reply_headers(host);
        }
        if !self.host_kind.logs_after_on_log() {
            if let Some(config) = self.config.clone() {
                self.publish_provisional_record(host, &config);
            }
        }
        // Last, so that every read above sees the upstream's own headers: the filter's
        // replace those of the same name.
        for (name, value) in self.response_headers.drain(..) {
            host.set_response_header(name, &value);
        }
        Action::Continue
    }

    pub fn on_response_body(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let Some(config) = self.config.clone() else { return Action::Continue };
        self.hear_throttling_body(host, worker, &config, body_size, end_of_stream);
        if let Some(end) = self.read_reply(host, body_size, end_of_stream) {
            if let Some(word) = &end.throttled {
                self.hear_mid_stream(host, &config, word);
            }
            self.settle(host, worker, &config, end.ending);
        }
        Action::Continue
    }

    /// The request is over (the host's `on_log`/`on_done`): whatever did not end with a
    /// complete reply (the client left, the upstream broke, the reply had no body) is
    /// settled now.
    pub fn on_done(&mut self, host: &mut impl Host, worker: &mut Worker) {
        let Some(config) = self.config.clone() else { return };
        if self.queued && self.phase == Phase::Deciding {
            self.cancel_queued(host, worker, &config);
        }
        self.leave_queue(host, &config);
        if self.phase == Phase::AwaitingLease {
            worker.stop_waiting(host.context_id());
        }
        self.lift_marks(host, worker, &config); // its grant will not be merged
        self.put_back_hold(host, &config); // the client left while a grant was asked
        self.hear_provider(host, worker, &config);
        let ending = if self.upstream_error { Ending::UpstreamError } else { Ending::Interrupted };
        self.settle(host, worker, &config, ending);
        self.publish_record(host, &config);
        self.add_to_ledger(host, worker, &config);
    }

    // ---- the dispatcher: each route's outcome decides the next step ----

    /// Plans the charge and decides it: the provider's word first, then the local store, or
    /// the lease and the companion. `body` is `None` when the body is not read.
    fn charge(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, body: Option<&[u8]>) -> Action {
        let now = match self.plan_request(host, worker, config, body) {
            Ok(now) => now,
            Err(verdict) => return self.apply(host, config, verdict, false),
        };
        if let Some(verdict) = self.ask_provider(host, worker, config, now) {
            return self.apply(host, config, verdict, false);
        }
        if config.store == Store::Local {
            let verdict = self.decide_in_store(host, worker, config, now);
            return self.apply(host, config, verdict, false);
        }
        self.admit_or_ask(host, worker, config, now, Resumed::InOwnCallback)
    }

    /// What the provider last said for this request (`provider_limits`): a refusal to
    /// answer, or nothing, and the request goes ahead (perhaps sent to the provider's
    /// overflow backend, where it is judged again).
    fn ask_provider(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        now: u64,
    ) -> Option<Verdict> {
        if !config.provider_limits.enabled {
            return None;
        }
        loop {
            match self.consult_provider(host, config, now, self.can_overflow(config)) {
                ProviderSays::Refuse(verdict) => return Some(verdict),
                ProviderSays::Overflow(backend) => self.overflow_to(config, &backend),
                ProviderSays::Go => break,
            }
        }
        // The probe taken: the fleet learns that it went out.
        if let (Some(taken), Some(key)) = (self.provider.heard.take(), self.provider.key) {
            worker.provider_words.note(config, key, taken);
        }
        None
    }

    /// Decides from the lease where it can, or sends the callout the mode calls for.
    fn admit_or_ask(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        now: u64,
        run: Resumed,
    ) -> Action {
        let paused = run == Resumed::ByRoot;
        if config.lease.enabled {
            match self.admit_from_lease(host, worker, config, now) {
                FromLease::Decided(verdict) => return self.apply(host, config, verdict, paused),
                FromLease::AskForLease => self.ask = Ask::Lease,
                FromLease::ChargeDirectly => self.ask = Ask::Charge,
                FromLease::Await(_) if !worker.breaker(host, config).is_closed() => {
                    // No grant can be asked while the breaker is open: nothing to wait for,
                    // so take again as a request that may not wait.
                    self.lease_wait_until = Some(now);
                    return self.admit_or_ask(host, worker, config, now, run);
                }
                FromLease::Await(entry) => {
                    if self.wait_for_grant(host, worker, config, entry, now) {
                        return Action::Pause;
                    }
                }
            }
        }
        if worker.dispatch(host, config, now) == Dispatch::Local {
            self.lift_marks(host, worker, config);
            let verdict = self.fail_over(host, worker, config, "circuit breaker open");
            return self.apply(host, config, verdict, paused);
        }
        match self.send(host, worker, config, now) {
            Ok(()) => {
                self.phase = Phase::Deciding;
                Action::Pause
            }
            Err(why) => {
                self.lift_marks(host, worker, config);
                let verdict = self.callout_failed(host, worker, config, &why);
                self.apply(host, config, verdict, paused)
            }
        }
    }

    /// Sends the callout the mode calls for: a grant of the lease covering the request, or
    /// the charge (which may wait in the queue).
    fn send(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, now: u64) -> Result<(), String> {
        if self.ask == Ask::Lease {
            return self.ask_for_lease(host, worker, config, now);
        }
        // In shadow mode nothing waits: the queue would enforce.
        let wait =
            if config.lease.enabled || config.mode == Mode::Shadow { None } else { self.join_queue(host, config) };
        self.send_charge(host, worker, config, wait)
    }

    /// The companion answered the request's callout.
    fn decide(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, body_size: usize) -> Verdict {
        // Its grant answered, as whatever it answered: those waiting for it take again
        // once it is merged (they run after this callback).
        self.lift_marks(host, worker, config);
        let expected = self.plan.as_ref().map_or(0, |p| p.buckets.len());
        let reply = match callout_reply::<LimitsReply>(host, body_size) {
            // A suspension answers for no limit.
            Ok(reply) if reply.limits.len() == expected || reply.suspended.is_some() => reply,
            Ok(_) => {
                return self.callout_failed(host, worker, config, "companion reply has the wrong number of limits")
            }
            Err(why) => return self.callout_failed(host, worker, config, &why),
        };
        worker.callout_succeeded(host, config);
        self.leave_queue(host, config);
        let waited = reply.waited_ms;
        self.note_wait(host, worker, waited);
        let verdict = self.decide_reply(host, worker, config, reply);
        if waited == 0 {
            return verdict;
        }
        verdict.with_header(QUEUED_HEADER, waited.to_string())
    }

    /// The companion's answer, handed to the route it concerns: a suspension, an overflow,
    /// a refusal, the lease's grant or the direct charge.
    fn decide_reply(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        reply: LimitsReply,
    ) -> Verdict {
        let now = host.now_ms();
        if let Some(suspension) = &reply.suspended {
            return self.refuse_suspended(host, worker, config, suspension, now);
        }
        self.learn_plans(worker, &reply, now);
        if !reply.allowed {
            self.admission = None; // nothing was charged
            if let Some(backend) = self.overflow_target(config, &reply) {
                if config.mode != Mode::Shadow {
                    return self.recharge(host, worker, config, &reply, &backend, now);
                }
                self.shadow_overflow = true; // refused nothing: only its mark says so
            }
            self.count_refusal(host, config, &reply);
            if self.ask == Ask::Lease {
                self.block_lease(host, config, &reply, now);
            }
            return self.rejection(config, &reply, now);
        }
        match self.ask {
            Ask::Lease => self.admit_from_grant(host, worker, config, reply, now),
            Ask::Charge => self.admit_charged(host, worker, config, reply, now),
        }
    }

    /// Sends a refused request to `backend` instead: charged again, on the fallback's
    /// limits, after asking what the provider said of the fallback.
    fn recharge(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        reply: &LimitsReply,
        backend: &str,
        now: u64,
    ) -> Verdict {
        self.reroute(host, config, reply, backend);
        if let Some(verdict) = self.ask_provider(host, worker, config, now) {
            return verdict;
        }
        match self.send(host, worker, config, now) {
            Ok(()) => Verdict::Recharging,
            Err(why) => self.callout_failed(host, worker, config, &why),
        }
    }

    /// Refused: an owner of the request is suspended by its plan. No overflow (the caller
    /// is suspended, not a backend short of capacity), no wait; the VM remembers it for
    /// the degraded mode, and this proxy's leases of that owner end now.
    fn refuse_suspended(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        suspension: &Suspension,
        now: u64,
    ) -> Verdict {
        let owner = self.note_suspension(host, worker, config, suspension, now);
        if self.ask == Ask::Lease {
            self.end_leases(host, config, owner.as_deref(), now);
        }
        Verdict::Reply(decision::suspension(suspension, config, self.caller(now)))
    }

    fn callout_failed(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, why: &str) -> Verdict {
        self.leave_queue(host, config);
        host.add_metric(Metric::CalloutFailures, 1);
        worker.record_callout_failure(host, config);
        self.fail_over(host, worker, config, why)
    }

    /// Decides without the companion (`degraded.rs`). A charge sent but never answered may
    /// still happen in Redis (a companion paused, or Redis slow, runs it later): it never
    /// counts on its own. Admitted locally, the request's debits stand in for it (applied
    /// only if it did not happen, and it then never will); otherwise it is cancelled
    /// (refunded if it happened).
    fn fail_over(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, why: &str) -> Verdict {
        let unanswered = match self.admission.take() {
            Some(Admission::Reserved(id)) => Some(id),
            _ => None,
        };
        self.put_back_hold(host, config);
        let verdict = match self.decide_degraded(host, worker, config, why, unanswered.as_deref()) {
            Degraded::Decided(verdict) => verdict,
            Degraded::Suspended(suspension, now) => self
                .refuse_suspended(host, worker, config, &suspension, now)
                .with_header(DEGRADED_HEADER, "local".to_string()),
        };
        if let Some(id) = unanswered.filter(|_| !matches!(self.admission, Some(Admission::Degraded { .. }))) {
            self.give_up_charge(host, worker, config, id);
        }
        verdict
    }

    // ---- settling: what it used (`settle.rs`), given back where its admission came from ----

    /// Settles the request as it `ending`, once, then publishes its record.
    fn settle(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, ending: Ending) {
        self.note_how_admitted();
        self.settle_admission(host, worker, config, ending);
        self.publish_record(host, config);
        self.add_to_ledger(host, worker, config);
    }

    /// The difference between what the request reserved and what it cost (in tokens, and
    /// in money for budgets) goes back where its admission came from, and its slots are
    /// released.
    fn settle_admission(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, ending: Ending) {
        let Some(admission) = self.admission.take() else { return };
        let credits = if self.credential_refused && self.phase == Phase::Forwarded {
            self.refund_everything(config)
        } else {
            self.credits(host, worker, config, ending)
        };
        let applies = |i: usize| self.plan.as_ref().is_some_and(|p| p.applies(i));
        let slot_limits: Vec<usize> = config
            .limits
            .iter()
            .enumerate()
            .filter(|(i, l)| l.kind == LimitKind::Slots && applies(*i))
            .map(|(i, _)| i)
            .collect();
        match admission {
            Admission::Reserved(id) => self.settle_charge(host, worker, config, Some(id), credits, slot_limits),
            Admission::Charged => self.settle_charge(host, worker, config, None, credits, slot_limits),
            Admission::Degraded { id, charged_at_ms } => {
                self.settle_degraded(host, worker, config, id, charged_at_ms, credits)
            }
            Admission::Leased => self.settle_leased(host, worker, config, &credits),
            Admission::Stored { id, charged_at_ms } => {
                self.settle_in_store(host, worker, config, &id, charged_at_ms, &credits)
            }
        }
    }

    // ---- the request's state, as the routes read it ----

    fn costs(&self) -> Vec<u64> {
        self.plan.as_ref().map(|p| p.buckets.iter().map(|b| b.cost).collect()).unwrap_or_default()
    }

    /// What the request holds reserved: its plan's estimate, as the decision granted it;
    /// `None` when no limit counts tokens.
    fn reserved(&self) -> Option<TokenCounts> {
        self.plan.as_ref()?.reserved(self.grant)
    }

    /// The reply as it concerns this request: the limits that apply to it.
    fn relevant(&self, reply: &LimitsReply) -> LimitsReply {
        self.keep_relevant(reply.clone())
    }

    /// [`RequestFilter::relevant`] of a reply the caller is done with (see
    /// `ChargePlan::keep_relevant`).
    fn keep_relevant(&self, reply: LimitsReply) -> LimitsReply {
        match self.plan.as_ref() {
            Some(plan) => plan.keep_relevant(reply),
            None => reply,
        }
    }

    /// The counter each limit of this request is charged on (see `crate::plan::pools`).
    fn owners(&self) -> Vec<Option<String>> {
        self.plan.as_ref().map(crate::plan::pools::owners).unwrap_or_default()
    }

    /// The lease entries this request draws from: its tenant's, and each shared pool's.
    fn holders(&self, config: &Policy) -> Vec<Holder> {
        let buckets = self.plan.as_ref().map_or(&[][..], |plan| &plan.buckets);
        lease_table::holders(&self.tenant, |i| buckets.get(i).and_then(|b| b.owner.as_deref()), config.limits.len())
    }

    /// The owner of limit `name`'s counter for this request: the tenant, or a pool's id.
    fn owner_of(&self, config: &Policy, name: &str) -> Option<String> {
        let index = config.limits.iter().position(|l| l.name == name)?;
        let owners = self.owners();
        Some(owners.get(index).cloned().flatten().unwrap_or_else(|| self.tenant.clone()))
    }

    /// How long a charge's (or a stand-in's) record lives: tokens are settled against it
    /// within `tokens.reservation_ttl`; a waiting charge's refund (its client gave up)
    /// within its wait; anything else only ever settles a refund, decided by the reply's
    /// status.
    fn record_ttl_ms(&self, config: &Policy, wait: Option<&Wait>) -> u64 {
        match (self.reserved(), wait) {
            (Some(_), _) => config.tokens.reservation_ttl.as_millis() as u64,
            (None, Some(wait)) => wait.max_ms + CANCEL_WINDOW_MS,
            (None, None) => REFUND_WINDOW_MS,
        }
    }
}

/// The value of a header the client must not be able to choose by adding a copy (the
/// tier, the priority): `None`, so the default applies, when it was sent more than once,
/// since hosts and the component that sets it disagree on which copy counts.
fn single_header(host: &mut impl Host, name: &str) -> Option<String> {
    let mut values = host.request_header_values(name);
    match values.len() {
        1 => values.pop(),
        _ => None,
    }
}

/// Whether the request, by its headers, has no body to wait for: `content-length: 0`, or,
/// on a host that never reports end of stream on request headers (ngx_wasm_module), no
/// `content-length` and no `transfer-encoding` either. Such a request gets no body
/// callback there, so waiting for one would let it through uncharged.
fn has_no_body(host: &mut impl Host, worker: &Worker) -> bool {
    match host.request_header("content-length") {
        Some(length) => length.trim() == "0",
        None => {
            !worker.host_kind().reports_end_of_stream_on_headers() && host.request_header("transfer-encoding").is_none()
        }
    }
}

mod answer;
#[cfg(test)]
mod answers_tests;
#[cfg(test)]
mod calendar_tests;
mod degraded;
#[cfg(test)]
mod degraded_tests;
mod direct;
mod identify;
mod lease;
#[cfg(test)]
mod ledger_tests;
#[cfg(test)]
mod local_tests;
mod overflow;
#[cfg(test)]
mod overflow_tests;
#[cfg(test)]
mod plans_tests;
#[cfg(test)]
mod pools_tests;
mod provider;
mod queue;
pub mod record;
#[cfg(test)]
mod record_tests;
#[cfg(test)]
mod request_tests;
mod settle;
mod store;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod upgrade_tests;

/// Whether a request's `x-request-id` may be echoed in a reply: short, and only the
/// characters ids are made of (a client may send anything).
fn is_request_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}
