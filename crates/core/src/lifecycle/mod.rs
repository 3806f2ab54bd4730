//! One request's life, as plain Rust over [`Host`]: identified, planned, decided (from a
//! lease, locally, or by the companion), forwarded or answered, then settled once from the
//! usage its reply reports. docs/architecture.md draws the walk.
//!
//! The worker ([`Worker`]) holds what outlives a request; each callback borrows it.

use crate::accounting::breaker::Dispatch;
use crate::accounting::bucket::{check_and_charge, decode_states, encode_states, level_at, BucketState};
use crate::accounting::calibration::{Calibration, Lesson};
use crate::accounting::lease::TenantLeases;
use crate::accounting::reply_floor::{self, ReplySight};
use crate::accounting::reservation::{actual_usage, credit, Ending, OutputAverage, TokenCounts};
use crate::api::dialect::Dialect;
use crate::api::identity::{read_credential, tenant_id, Credential, IdentitySource, TenantIds, ANONYMOUS_TENANT};
use crate::config::{
    FailureMode, Measure, MissingIdentity, Mode, Policy, RecordMode, Store, UnknownPaths, UnreadableBody,
};
use crate::effects::average_store::LocalAverages;
use crate::effects::calibration_store::LocalCalibrations;
use crate::effects::host::{shared_update, Action, Host, HostKind, LogLevel, Metric, Owner};
use crate::effects::lease_table::{self, DryOut, Hold, Holder, Taken};
use crate::effects::provider_state::{self, Judgement, ProviderState};
use crate::effects::provider_word::{self, ProviderWord};
use crate::effects::tables::{queued_slot, update_own, update_own_or_oldest, TenantTable};
use crate::parse::sse::UsageChunkRemover;
use crate::plan::charge::{plan, ChargePlan, Learned};
use crate::plan::series::{self, Decision, TokenStage, TokenType};
use crate::protocol::keys;
use crate::protocol::{
    ChargeRequest, LeaseRequest, LimitCharge, LimitKind, LimitStatus, LimitsReply, Reservation, Settlement,
    SettlementBatch, StandIn, Suspension, Wait, CHARGE_PATH, LEASE_PATH, RELEASE_PATH,
};
use crate::providers;
use crate::providers::bedrock;
use crate::readers::request::Api;
use crate::readers::usage::{EventStreamUsage, ReplyUsage, ReportedUsage, StreamUsage};
use crate::replies::answers::{self, Caller};
use crate::replies::decision::{
    self, DEGRADED_HEADER, OVERFLOW_HEADER, PROVIDER_HEADER, QUEUED_HEADER, RESERVED_TOKENS_HEADER, SHADOW_HEADER,
};
use crate::replies::reply::{Header, LocalReply};
use crate::tokens::prompt_cache::PromptCache;
use crate::tokens::Encoding;
use crate::worker::{adjustments, callout_reply, settlement, Worker};
use std::rc::Rc;
use std::time::Duration;

/// Largest SSE event (or Bedrock event-stream message) read for usage; larger SSE events
/// are skipped, a larger event-stream message ends the reading as a bad CRC does.
const MAX_SSE_EVENT: usize = 1 << 20;
/// How long after its longest wait an abandoned request's cancellation may still arrive.
const CANCEL_WINDOW_MS: u64 = 10_000;
/// How long a charge with nothing to settle keeps its record for the refund of an
/// upstream 401/403. Providers refuse a credential before they generate anything, so the
/// status comes within this; past it the charge stands (no credit is ever unbacked). Such
/// records are never deleted by a settlement, so this bounds their memory in Redis:
/// requests/s x 10 s x ~226 B.
const REFUND_WINDOW_MS: u64 = 10_000;
/// In the degraded mode a concurrency limit is a bucket that does not refill (a slot comes
/// back when its request ends); this window makes the refill negligible.
const LOCAL_SLOTS_NEVER_REFILL_MS: u64 = u64::MAX / 4;
/// Releasing slots at once waits at least this long for the companion.
const RELEASE_TIMEOUT: Duration = Duration::from_millis(500);

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
    /// Decided locally while the companion was away; reconciled with Redis later by a
    /// stand-in for the charge under this reservation, whose record the request's
    /// settlement is made against.
    Local(String),
    /// Charged in this proxy's local store (`"store": "local"`) at this time (ms), under
    /// this reservation id (its slots' holder).
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

/// What the lease has to say about a request (lease mode).
enum FromLease {
    Decided(Verdict),
    AskForLease,
    ChargeDirectly,
    /// Wait for the grant out for this entry.
    Await(String),
}

/// Reads the reply for its usage.
enum ReplyReader {
    Json(ReplyUsage),
    Stream(StreamUsage),
    /// AWS's binary event stream (Bedrock).
    EventStream(EventStreamUsage),
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
            Verdict::Forward(headers) => headers.push((name, value)),
            Verdict::Reply(reply) => reply.headers.push((name, value)),
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
    /// Lease mode: whether the request has waited for a grant another asked for (the
    /// worker keeps until when: no longer than such a grant can be out). A request waits
    /// once; woken, it takes from the lease again and, if that falls short, asks for itself.
    waited_for_lease: bool,
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
            admission: None,
            response_headers: Vec::new(),
            reply: None,
            upstream_error: false,
            usage_remover: None,
            body_len: 0,
            queued: false,
            lease_hold: None,
            waited_for_lease: false,
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

    // ---- host callbacks ----

    pub fn on_request_headers(&mut self, host: &mut impl Host, worker: &mut Worker, end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else { return Action::Continue };
        if config.overflows() {
            // Only the filter says where a request overflows: a client's own header would
            // send it to the fallback, bypassed or charged on the primary's limits.
            host.remove_request_header(OVERFLOW_HEADER);
        }
        let raw_path = host.request_header(":path").unwrap_or_default();
        // The one reading of the path: bypass and routing both see it.
        let path = crate::parse::path::normalised(&raw_path);
        self.request_id = match host.request_header("x-request-id") {
            Some(id) if is_request_id(&id) => id,
            _ => "llmrl-".to_string() + &worker.new_reservation_id(host),
        };
        if !config.bypass.paths.is_empty() && config.bypass.path(&path) {
            host.add_metric(Metric::Bypassed, 1);
            return Action::Continue;
        }
        self.route = providers::route_normalised(&path);
        // Known before any body, so every answer, even one that never reads it, is in the
        // caller's shape.
        self.dialect = config.error_format.dialect(self.route.as_ref().map_or(Dialect::OpenAi, |route| route.dialect));
        let unknown = self.route.is_none() && config.unknown_paths == UnknownPaths::Refuse;
        if unknown || crate::parse::path::is_batch_or_realtime(&path) {
            return self.apply(host, &config, Verdict::Reply(decision::path_refused(self.dialect)), false);
        }
        match self.identify(host, &config, &raw_path, &mut worker.tenant_ids) {
            Ok(tenant) => self.tenant = tenant,
            Err(verdict) => return self.apply(host, &config, verdict, false),
        }
        if config.provider_limits.enabled {
            self.provider.credential = match config.identity.sources {
                None => self.tenant.clone(),
                Some(_) => self.upstream_credential(host, &raw_path),
            };
        }
        if config.bypass.tenant(&self.tenant) {
            host.add_metric(Metric::Bypassed, 1);
            return Action::Continue;
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

    /// How the reply is to be read: its status, and for a request with tokens reserved
    /// its encoding and framing.
    fn read_reply_headers(&mut self, host: &mut impl Host) {
        // Read once: each read is a call into the host.
        let status: u32 = host.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        self.credential_refused = matches!(status, 401 | 403);
        if self.plan.as_ref().is_some_and(|p| p.estimate.is_some()) {
            self.upstream_error = status >= 400;
            self.sight.started = true;
            self.sight.unreadable =
                !reply_floor::readable_encoding(host.response_header("content-encoding").as_deref());
            let content_type = host.response_header("content-type").unwrap_or_default();
            let encoding = self.plan.as_ref().map_or(crate::tokens::Encoding::O200kBase, |p| p.encoding);
            // Gemini streams without `alt=sse` as one JSON array of responses.
            let json_array =
                self.plan.as_ref().and_then(|p| p.request.as_ref()).map(|r| r.api) == Some(Api::StreamGenerateContent);
            self.reply = Some(if content_type.contains("text/event-stream") {
                ReplyReader::Stream(StreamUsage::new(encoding, MAX_SSE_EVENT))
            } else if content_type.contains(bedrock::EVENT_STREAM_CONTENT_TYPE) {
                ReplyReader::EventStream(EventStreamUsage::new(encoding, MAX_SSE_EVENT))
            } else if json_array {
                self.usage_remover = None;
                ReplyReader::Stream(StreamUsage::json_array(encoding, MAX_SSE_EVENT))
            } else {
                self.usage_remover = None;
                ReplyReader::Json(ReplyUsage::new())
            });
        }
    }

    pub fn on_response_body(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let Some(config) = self.config.clone() else { return Action::Continue };
        if let Some((_, body)) = self.provider.pending.as_mut() {
            let room = provider_word::MAX_ERROR_BODY.saturating_sub(body.len()).min(body_size);
            body.extend_from_slice(host.response_body(body_size).get(..room).unwrap_or_default());
            if end_of_stream {
                self.hear_provider(host, worker, &config);
            }
        }
        if self.reply.is_none() || self.admission.is_none() {
            return Action::Continue;
        }
        let chunk = host.response_body(body_size);
        match self.reply.as_mut() {
            Some(ReplyReader::Json(reader)) => reader.feed(&chunk),
            Some(ReplyReader::Stream(reader)) => reader.feed(&chunk),
            Some(ReplyReader::EventStream(reader)) => reader.feed(&chunk),
            None => {}
        }
        if let Some(remover) = self.usage_remover.as_mut() {
            let passed = remover.filter(&chunk, end_of_stream);
            if passed != chunk && !host.replace_response_body(body_size, &passed) {
                host.warn_once("response-body", "llm-ratelimit: the host refused to rewrite a response body");
            }
        }
        if end_of_stream {
            // A Bedrock stream that carried an exception ended before its reply did, and
            // teaches nothing. Throttling is the provider's rate limit stopping the model:
            // settled at the prompt and what was streamed (all it generated), and heard
            // as the provider's refusal. Any other is settled as an interrupted reply.
            let exception = match &self.reply {
                Some(ReplyReader::EventStream(reader)) => reader.exception.clone(),
                _ => None,
            };
            let throttled = exception.as_deref().and_then(provider_word::read_stream_exception);
            let ending = match (self.upstream_error, &exception, &throttled) {
                (true, _, _) => Ending::UpstreamError,
                (false, _, Some(word)) => {
                    self.hear_mid_stream(host, &config, word);
                    Ending::Throttled
                }
                (false, Some(_), None) => Ending::Interrupted,
                (false, None, None) => Ending::Completed,
            };
            self.settle(host, worker, &config, ending);
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

    // ---- deciding ----

    /// The tenant, from the places the request's upstream authenticates (or the
    /// operator's own headers): all of them, so that two credentials are refused rather
    /// than one chosen.
    fn identify(
        &self,
        host: &mut impl Host,
        config: &Policy,
        path: &str,
        ids: &mut TenantIds,
    ) -> Result<String, Verdict> {
        let query = path.split_once('?').map_or("", |(_, query)| query.split('#').next().unwrap_or(""));
        let values = |name: &str| host.request_header_values(name);
        let credential = match (&config.identity.sources, &self.route) {
            (Some(sources), _) => read_credential(sources.iter().map(IdentitySource::place), values, ""),
            (None, Some(route)) => read_credential(route.provider.credentials().iter().copied(), values, query),
            (None, None) => read_credential(providers::EVERY_CREDENTIAL_PLACE, values, query),
        };
        match (credential, config.identity.missing) {
            (Credential::Conflicting, _) => {
                host.add_metric(Metric::Unidentified, 1);
                Err(Verdict::Reply(decision::conflicting_credentials(self.dialect)))
            }
            (Credential::Found(credential), _) => Ok(ids.of(&credential)),
            (Credential::Missing, MissingIdentity::Anonymous) => Ok(ANONYMOUS_TENANT.to_string()),
            (Credential::Missing, MissingIdentity::Reject) => {
                host.add_metric(Metric::Unidentified, 1);
                Err(Verdict::Reply(decision::missing_identity(self.dialect)))
            }
        }
    }

    /// The id of the credential the upstream sees, from its API's own places (the
    /// operator identifies tenants otherwise); `anonymous` when there is none (a later
    /// filter adds it: one credential for every request).
    fn upstream_credential(&self, host: &mut impl Host, path: &str) -> String {
        let query = path.split_once('?').map_or("", |(_, query)| query.split('#').next().unwrap_or(""));
        let values = |name: &str| host.request_header_values(name);
        let credential = match &self.route {
            Some(route) => read_credential(route.provider.credentials().iter().copied(), values, query),
            None => read_credential(providers::EVERY_CREDENTIAL_PLACE, values, query),
        };
        match credential {
            Credential::Found(credential) => tenant_id(&credential),
            Credential::Missing | Credential::Conflicting => ANONYMOUS_TENANT.to_string(),
        }
    }

    /// What the provider last said for this request's credential and model: a refusal
    /// answered here (or sent to `provider_limits.overflow`, and judged there), the probe
    /// taken, or the limits lowered to what is left.
    fn consult_provider(&mut self, host: &mut impl Host, config: &Policy, now: u64) -> Option<Verdict> {
        let (key, state) = loop {
            let plan = self.plan.as_ref()?;
            let key = provider_state::key_of(config, &self.provider.credential, plan.backend.as_deref(), &plan.model);
            self.provider.key = Some(key);
            let estimate = plan.estimate.unwrap_or(TokenCounts { prompt: 0, output: 0 });
            let needs = [1, estimate.prompt.saturating_add(estimate.output), estimate.prompt, estimate.output];
            let (judgement, state) = provider_state::judge(host, config, key, now, needs);
            match judgement {
                Judgement::Refuse { wait_ms, quota } => {
                    if let Some(backend) =
                        config.provider_limits.overflow.as_deref().filter(|_| self.can_overflow(config))
                    {
                        host.add_metric(Metric::ProviderOverflowed, 1);
                        self.overflow_to(config, backend);
                        continue;
                    }
                    host.add_metric(Metric::ProviderRefusalsAnswered, 1);
                    let left =
                        |q: provider_word::Quota| state.and_then(|s| s.left.get(q.index()).map(|l| l.0)).unwrap_or(0);
                    let short = quota.map(|q| (q.error_type(), q.name(), left(q)));
                    return Some(Verdict::Reply(decision::provider_refusal(self.dialect, wait_ms, short)));
                }
                Judgement::Probe => {
                    host.add_metric(Metric::ProviderProbes, 1);
                    self.provider.mark = Some("probe");
                    self.provider.heard = state;
                }
                Judgement::Forward => {}
            }
            break (key, state);
        };
        self.provider.key = Some(key);
        let plan = self.plan.as_mut()?;
        let lowered = config.provider_limits.lower_limits
            && state.is_some_and(|state| state.lower(&config.limits, &mut plan.buckets, now));
        if lowered {
            host.add_metric(Metric::ProviderLowered, 1);
            self.provider.mark = self.provider.mark.or(Some("lowered"));
        }
        None
    }

    /// Whether a refusal of this request may send it to a fallback instead: not in
    /// shadow mode (nothing is refused), not twice, and only while a header still routes.
    fn can_overflow(&self, config: &Policy) -> bool {
        config.mode != Mode::Shadow && self.overflow.is_none() && self.route_open
    }

    /// Sends the request to `backend` instead of refusing it: charged from now on against
    /// the fallback's limits (its own and those every route shares), not the primary's.
    fn overflow_to(&mut self, config: &Policy, backend: &str) {
        self.overflow = Some(backend.to_string());
        if let Some(plan) = self.plan.as_mut() {
            plan.route_to(config, Some(backend));
        }
    }

    /// The backend a refusal in `reply` sends this request to (in shadow mode: would send
    /// it to): that of the first limit that refused, when every limit that refused
    /// overflows (one that does not refuses), and the route can still change.
    fn overflow_target(&self, config: &Policy, reply: &LimitsReply) -> Option<String> {
        if self.overflow.is_some() || !self.route_open {
            return None;
        }
        let relevant = self.relevant(reply);
        let refusing = relevant.limits.iter().filter(|o| o.status != LimitStatus::Allowed).map(|o| o.name.as_str());
        let mut backends =
            series::limit_indices(config, refusing).map(|i| config.limits.get(i).and_then(|l| l.overflow.clone()));
        let first = backends.next()??;
        backends.all(|b| b.is_some()).then_some(first)
    }

    /// Counts an overflow under each limit that refused, and charges the fallback's limits
    /// with a second callout, after asking what the provider said of the fallback.
    fn recharge(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        reply: &LimitsReply,
        backend: &str,
        now: u64,
    ) -> Verdict {
        let relevant = self.relevant(reply);
        let refusing = relevant.limits.iter().filter(|o| o.status != LimitStatus::Allowed).map(|o| o.name.as_str());
        for limit in series::limit_indices(config, refusing) {
            host.add_series(series::decision(limit, Decision::Overflowed), 1);
        }
        self.overflow_to(config, backend);
        if config.provider_limits.enabled {
            if let Some(verdict) = self.consult_provider(host, config, now) {
                return verdict;
            }
            if let (Some(taken), Some(key)) = (self.provider.heard.take(), self.provider.key) {
                worker.provider_words.note(config, key, taken);
            }
        }
        match self.send(host, worker, config, now) {
            Ok(()) => Verdict::Recharging,
            Err(why) => self.callout_failed(host, worker, config, &why),
        }
    }

    /// Reads what the response's headers say of the provider's limits; a throttling
    /// error whose body may hold its retry time (Google's) is read to its end first.
    fn read_provider_headers(&mut self, host: &mut impl Host, config: &Policy) {
        let status: u32 = host.response_header(":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        let now = host.now_ms();
        let word = provider_word::read_headers(status, &mut |name| host.response_header(name), now);
        if !word.said_anything() && !(200..300).contains(&status) {
            // Another error (the upstream down, a bad request) says nothing of the limits.
            return;
        }
        // Google's throttling bodies carry their retry time (RetryInfo): read by the
        // provider the path names, whatever shape `error_format` gives our own answers.
        let google = self.route.as_ref().is_some_and(|route| route.provider == providers::Provider::Gemini);
        if word.refused && word.retry_after_ms.is_none() && google {
            self.provider.pending = Some((word, Vec::new()));
            return;
        }
        self.take_word(host, config, &word);
    }

    fn take_word(&mut self, host: &mut impl Host, config: &Policy, word: &ProviderWord) {
        let Some(key) = self.provider.key.take() else { return };
        if word.refused {
            host.add_metric(Metric::ProviderRefusalsSeen, 1);
        }
        self.provider.heard = provider_state::hear(host, config, key, word, self.provider.sent_ms);
    }

    /// The provider refused mid-stream (its reply's headers, heard already, said it
    /// served): heard under the request's key as a refusal, for the fleet's next exchange.
    fn hear_mid_stream(&mut self, host: &mut impl Host, config: &Policy, word: &ProviderWord) {
        let Some(plan) = self.plan.as_ref().filter(|_| config.provider_limits.enabled) else { return };
        let key = provider_state::key_of(config, &self.provider.credential, plan.backend.as_deref(), &plan.model);
        self.provider.key = Some(key);
        self.take_word(host, config, word);
    }

    /// Takes in a throttling error's body read so far, and hands what was heard to the
    /// fleet's next exchange.
    fn hear_provider(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy) {
        if let Some((mut word, body)) = self.provider.pending.take() {
            word.retry_after_ms = provider_word::retry_info_ms(&body);
            self.take_word(host, config, &word);
        }
        if let (Some(state), Some(plan)) = (self.provider.heard.take(), self.plan.as_ref()) {
            let key = provider_state::key_of(config, &self.provider.credential, plan.backend.as_deref(), &plan.model);
            worker.provider_words.note(config, key, state);
        }
    }

    fn costs(&self) -> Vec<u64> {
        self.plan.as_ref().map(|p| p.buckets.iter().map(|b| b.cost).collect()).unwrap_or_default()
    }

    fn reserved_tokens(&self) -> u64 {
        self.plan.as_ref().map_or(0, ChargePlan::reserved_tokens)
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

    /// An admission: counted in `requests_allowed` and under every limit that applies.
    fn count_admission(&self, host: &mut impl Host, config: &Policy, decision: Decision) {
        host.add_metric(Metric::Allowed, 1);
        self.count_per_limit(host, config, decision);
    }

    fn count_per_limit(&self, host: &mut impl Host, config: &Policy, decision: Decision) {
        self.count_per_limit_in(host, config, decision, None);
    }

    /// As `count_per_limit`, a shadow limit that had no room in `reply` counted as
    /// `shadow` (it refused nothing).
    fn count_per_limit_in(
        &self,
        host: &mut impl Host,
        config: &Policy,
        decision: Decision,
        reply: Option<&LimitsReply>,
    ) {
        let Some(plan) = self.plan.as_ref() else { return };
        for limit in (0..config.limits.len()).filter(|&i| plan.applies(i)) {
            let short = reply.and_then(|r| r.limits.get(limit)).is_some_and(|o| o.status != LimitStatus::Allowed);
            let shadowed = config.limits.get(limit).is_some_and(|l| l.shadow) && short;
            host.add_series(series::decision(limit, if shadowed { Decision::Shadow } else { decision }), 1);
        }
    }

    /// A refusal: counted in `requests_limited` and under each limit that had no room
    /// (as `shadow` when shadow mode lets it through).
    fn count_refusal(&mut self, host: &mut impl Host, config: &Policy, reply: &LimitsReply) {
        host.add_metric(Metric::Limited, 1);
        let decision = if config.mode == Mode::Shadow { Decision::Shadow } else { Decision::Limited };
        let relevant = self.relevant(reply);
        // The limit the 429 names: one that can never fit, else the one binding longest.
        let never = relevant.limits.iter().find(|o| o.status == LimitStatus::Never);
        let binding = never.or_else(|| {
            relevant.limits.iter().filter(|o| o.status == LimitStatus::Limited).max_by_key(|o| o.retry_after_ms)
        });
        self.recorded.refused_by = binding.map(|o| o.name.clone());
        let refusing = relevant.limits.iter().filter(|o| o.status != LimitStatus::Allowed).map(|o| o.name.as_str());
        for limit in series::limit_indices(config, refusing) {
            // A shadow limit with no room refused nothing: the others did.
            let shadowed = config.limits.get(limit).is_some_and(|l| l.shadow);
            host.add_series(series::decision(limit, if shadowed { Decision::Shadow } else { decision }), 1);
        }
    }

    /// The 429 for `reply`, decided at `now` (ms).
    fn rejection(&self, config: &Policy, reply: &LimitsReply, now: u64) -> Verdict {
        let charged = self.plan.as_ref().map_or(&[][..], |p| p.buckets.as_slice());
        Verdict::Reply(decision::rejection(&self.relevant(reply), config, charged, self.caller(now)))
    }

    /// Who the filter's answers to this request are for, at `now` (ms).
    fn caller(&self, now: u64) -> Caller {
        Caller { dialect: self.dialect, now_ms: now }
    }

    /// Plans the charge and decides it. `body` is `None` when the body is not read.
    fn charge(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, body: Option<&[u8]>) -> Action {
        let tier_value = config.tier.as_ref().and_then(|t| single_header(host, &t.header));
        self.tier = config.tier_of(&self.tenant, tier_value.as_deref()).to_string();
        // The clock, read once for the decision.
        let now = host.now_ms();
        let mut learned = ProxyKnowledge {
            host,
            now,
            config,
            tenant: &self.tenant,
            prompt_cache: &mut worker.prompt_cache,
            calibrations: &mut worker.calibrations,
            averages: &mut worker.averages,
        };
        let mut plan = plan(config, self.route.as_ref(), &self.tier, body, &mut learned);
        plan.date(config, now);
        let counters =
            crate::plan::pools::counters(config, &self.tenant, &self.tier, plan.end_user.as_deref(), |name| {
                host.request_header_values(name)
            });
        match counters {
            Ok(counters) if crate::plan::pools::unnamed_end_user(config, &plan, &counters) => {
                self.plan = Some(plan);
                let verdict = Verdict::Reply(decision::no_end_user(self.dialect));
                return self.apply(host, config, verdict, false);
            }
            Ok(counters) => {
                crate::plan::pools::assign(config, &mut plan, &counters);
                self.recorded.pools = crate::plan::pools::claimants(config, &counters);
            }
            Err(crate::plan::pools::RepeatedHeader(header)) => {
                self.plan = Some(plan);
                let verdict = Verdict::Reply(decision::repeated_pool_header(&header, self.dialect));
                return self.apply(host, config, verdict, false);
            }
        }
        self.body_len = body.map_or(0, <[u8]>::len);
        let unpriced = plan.unpriced.then(|| plan.model.clone());
        let unreadable = plan.unreadable.clone().filter(|_| config.tokens.unreadable_body == UnreadableBody::Refuse);
        self.plan = Some(plan);
        if let Some(why) = unreadable {
            return self.apply(host, config, Verdict::Reply(decision::unreadable_body(&why, self.dialect)), false);
        }
        if let Some(model) = unpriced {
            return self.apply(host, config, Verdict::Reply(decision::model_not_priced(&model, self.dialect)), false);
        }
        if config.provider_limits.enabled {
            if let Some(verdict) = self.consult_provider(host, config, now) {
                return self.apply(host, config, verdict, false);
            }
            // The probe taken: the fleet learns that it went out.
            if let (Some(taken), Some(key)) = (self.provider.heard.take(), self.provider.key) {
                worker.provider_words.note(config, key, taken);
            }
        }
        if config.store == Store::Local {
            let verdict = self.decide_in_store(host, worker, config, now);
            return self.apply(host, config, verdict, false);
        }
        self.admit_or_ask(host, worker, config, now, Resumed::InOwnCallback)
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
                    self.waited_for_lease = true;
                    return self.admit_or_ask(host, worker, config, now, run);
                }
                FromLease::Await(entry) => match worker.take_renewal(&entry) {
                    // The grant it would wait for is this VM's renewal, not sent yet: the
                    // request asks for it now instead, and its answer is the renewal's.
                    Some(renewal) => {
                        self.ask = Ask::Lease;
                        self.lease_hold =
                            Some(Hold { short: self.holders(config), marked: vec![renewal], ..Hold::default() });
                    }
                    None => {
                        self.phase = Phase::AwaitingLease;
                        self.waited_for_lease = true;
                        let until = now.saturating_add(config.lease_policy().renewal_wait_ms);
                        worker.await_lease(host.context_id(), entry, until);
                        return Action::Pause;
                    }
                },
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

    /// Lifts the markers this request set on the lease entries it asks a grant for, once
    /// that grant answers or never will: whoever waits for them takes again.
    fn lift_marks(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy) {
        let Some(hold) = self.lease_hold.as_mut() else { return };
        for holder in std::mem::take(&mut hold.marked) {
            lease_table::renewal_answered(host, config, &holder);
            worker.lease_news(&holder.name);
        }
    }

    /// Sends the callout the mode calls for: a lease covering the request, or the charge.
    fn send(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, now: u64) -> Result<(), String> {
        // In shadow mode nothing waits: the queue would enforce.
        let wait =
            if config.lease.enabled || config.mode == Mode::Shadow { None } else { self.join_queue(host, config) };
        let Some(plan) = self.plan.as_ref() else { return Err("no plan".into()) };
        let timeout = config.companion.timeout + if self.queued { config.queue.max_wait } else { Duration::ZERO };
        if self.ask == Ask::Lease {
            host.add_metric(Metric::LeaseCallouts, 1);
            let short = self.lease_hold.as_ref().map_or_else(|| self.holders(config), |hold| hold.short.clone());
            let request = LeaseRequest {
                domain: config.domain.clone(),
                tenant: self.tenant.clone(),
                limits: lease_table::asks(host, config, &short, &plan.buckets, &config.lease_policy(), now),
                share: config.lease.share,
            };
            return worker.call_companion(host, config, LEASE_PATH, &request, timeout, Owner::Request).map(drop);
        }
        // Every charge keeps a reservation record: it holds tokens to settle, names the
        // request's slots and its place in the queue, and backs the refund an upstream
        // 401/403 gives (the companion credits nothing a record does not back).
        let id = worker.new_reservation_id(host);
        self.admission = Some(Admission::Reserved(id.clone()));
        let mut limits = plan.buckets.clone();
        if wait.is_none() {
            // Only the queue reads it: a charge that cannot wait goes out as before this
            // field existed, which a companion older than the filter still takes.
            limits.iter_mut().for_each(|limit| limit.provisional = false);
        }
        let request = ChargeRequest {
            domain: config.domain.clone(),
            tenant: self.tenant.clone(),
            limits,
            reservation: Some(Reservation { id, ttl_ms: self.record_ttl_ms(config, wait.as_ref()) }),
            wait,
        };
        let sent = worker.call_companion(host, config, CHARGE_PATH, &request, timeout, Owner::Request).map(drop);
        if sent.is_err() {
            self.admission = None; // never sent: nothing can happen in Redis
        }
        sent
    }

    /// How long a charge's (or a stand-in's) record lives: tokens are settled against it
    /// within `tokens.reservation_ttl`; a waiting charge's refund (its client gave up)
    /// within its wait; anything else only ever settles a refund, decided by the reply's
    /// status.
    fn record_ttl_ms(&self, config: &Policy, wait: Option<&Wait>) -> u64 {
        match (self.plan.as_ref().and_then(|p| p.estimate), wait) {
            (Some(_), _) => config.tokens.reservation_ttl.as_millis() as u64,
            (None, Some(wait)) => wait.max_ms + CANCEL_WINDOW_MS,
            (None, None) => REFUND_WINDOW_MS,
        }
    }

    /// Takes a place in the queue, if queueing is on and this proxy's queue has room: the
    /// charge may then wait for capacity, in the companion, at this request's priority.
    fn join_queue(&mut self, host: &mut impl Host, config: &Policy) -> Option<Wait> {
        let queue = &config.queue;
        if !queue.enabled() {
            return None;
        }
        // A place of the tenant's share first, then of the whole queue.
        let own = keys::queued_tenant_key(&config.domain, queued_slot(config, &self.tenant));
        if !take_place(host, &own, queue.max_per_tenant) {
            return None;
        }
        if !take_place(host, &keys::queued_key(&config.domain), queue.max_length) {
            give_place(host, &own);
            return None;
        }
        self.queued = true;
        let priority = queue
            .priority_header
            .as_deref()
            .and_then(|name| single_header(host, name))
            .and_then(|value| value.trim().parse::<u8>().ok())
            .filter(|p| *p <= 9)
            .or_else(|| queue.tier_priorities.get(&self.tier).copied())
            .unwrap_or(queue.default_priority);
        Some(Wait { max_ms: queue.max_wait.as_millis() as u64, priority, aging_ms: queue.aging.as_millis() as u64 })
    }

    fn leave_queue(&mut self, host: &mut impl Host, config: &Policy) {
        if std::mem::take(&mut self.queued) {
            give_place(host, &keys::queued_key(&config.domain));
            give_place(host, &keys::queued_tenant_key(&config.domain, queued_slot(config, &self.tenant)));
        }
    }

    /// Admits from this proxy's leases (the tenant's, and each shared pool's), if they
    /// cover the request, or refuses it if Redis recently refused as much; otherwise says
    /// how to ask Redis: for a lease once the tenant (and each pool) shows repeat traffic,
    /// else (and when another's lease holds the slot) a direct charge. Marks the entries
    /// that run low for renewal.
    fn admit_from_lease(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, now: u64) -> FromLease {
        let holders = self.holders(config);
        let policy = config.lease_policy();
        let dry_out = if worker.host_kind().resumes_other_contexts() {
            DryOut::Coalesce { may_wait: !self.waited_for_lease }
        } else {
            DryOut::AskEach
        };
        let specs = self.plan.as_ref().map_or(&[][..], |p| &p.buckets);
        match lease_table::take(host, config, &holders, specs, &policy, dry_out, now) {
            Taken::Admitted { renew, leases, slots } => {
                for holder in renew {
                    worker.want_renewal(holder);
                }
                host.add_metric(Metric::LeaseAdmissions, 1);
                FromLease::Decided(self.admitted_from_lease(host, worker, config, &leases, &slots, now))
            }
            Taken::Refused(refusal) => {
                self.count_refusal(host, config, &refusal);
                FromLease::Decided(self.rejection(config, &refusal, now))
            }
            Taken::Ask(hold) => {
                for holder in hold.renew.iter().cloned() {
                    worker.want_renewal(holder);
                }
                self.lease_hold = Some(hold);
                FromLease::AskForLease
            }
            Taken::Direct => FromLease::ChargeDirectly,
            Taken::Await(entry) => FromLease::Await(entry),
        }
    }

    /// Gives back the parts of the request its lease entries hold, when no grant will
    /// make them an admission.
    fn put_back_hold(&mut self, host: &mut impl Host, config: &Policy) {
        if let Some(hold) = self.lease_hold.take() {
            let now = host.now_ms();
            lease_table::put_back(host, config, &hold.held, &self.costs(), now);
        }
    }

    /// The lease entries this request draws from: its tenant's, and each shared pool's.
    fn holders(&self, config: &Policy) -> Vec<Holder> {
        lease_table::holders(&self.tenant, &self.owners(), config.limits.len())
    }

    fn admitted_from_lease(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        leases: &TenantLeases,
        slots: &[u32],
        now: u64,
    ) -> Verdict {
        self.count_admission(host, config, Decision::Allowed);
        worker.note_leased(slots, leases, now);
        self.admission = Some(Admission::Leased);
        let reply = leases.as_reply(self.plan.as_ref().map_or(&[][..], |p| &p.buckets));
        Verdict::Forward(self.admitted_headers(host, config, reply, now))
    }

    fn admitted_headers(&self, host: &mut impl Host, config: &Policy, reply: LimitsReply, now: u64) -> Vec<Header> {
        let reply = self.keep_relevant(reply);
        let mut headers = decision::rate_limit_headers(&reply, config, self.caller(now));
        headers.extend(decision::budget_low(&reply, config, now));
        if let Some(plan) = self.plan.as_ref() {
            if let Some(estimate) = plan.estimate {
                count_tokens(host, config, plan.rule, TokenStage::Reserved, estimate);
            }
        }
        if self.plan.as_ref().is_some_and(|p| p.estimate.is_some()) {
            let reserved = self.reserved_tokens();
            host.add_metric(Metric::TokensReserved, reserved);
            headers.push((RESERVED_TOKENS_HEADER, decision::decimal(reserved)));
        }
        headers
    }

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
        if waited > 0 {
            worker.count_queue_wait(host, waited);
            self.recorded.queued_ms = waited;
        }
        let verdict = self.decide_reply(host, worker, config, reply);
        if waited == 0 {
            return verdict;
        }
        verdict.with_header(QUEUED_HEADER, waited.to_string())
    }

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
                // Later requests that need as much are refused here until the retry time.
                let short = self.lease_hold.as_ref().map_or_else(|| self.holders(config), |hold| hold.short.clone());
                lease_table::block(host, config, &short, &reply, &self.costs(), now);
                self.put_back_hold(host, config);
            }
            return self.rejection(config, &reply, now);
        }
        match self.ask {
            Ask::Lease => {
                let costs = self.costs();
                let hold =
                    self.lease_hold.take().unwrap_or_else(|| Hold { short: self.holders(config), ..Hold::default() });
                let lease_table::Merged { mut leases, refused, mut slots } =
                    lease_table::merge(host, config, &hold.short, |i| reply.limits.get(i), Some(&costs), now);
                slots.extend(&hold.slots);
                for holder in &hold.held {
                    for &i in &holder.indices {
                        if let (Some(to), Some(from)) = (leases.0.get_mut(i), hold.leases.0.get(i)) {
                            *to = *from;
                        }
                    }
                }
                if refused.is_empty() {
                    return self.admitted_from_lease(host, worker, config, &leases, &slots, now);
                }
                // Part of the grant cannot be kept as a lease (another's lease holds the
                // slot): what that part granted beyond this request goes back, and the
                // request stands charged there. Its settlement finds no lease for that
                // part and sends the part's credits to Redis.
                let surplus = refused
                    .iter()
                    .flat_map(|h| h.indices.iter().copied())
                    .filter_map(|i| Some((i, reply.limits.get(i)?.charged as i64 - *costs.get(i)? as i64)));
                let surplus: Vec<(usize, i64)> = surplus.collect();
                worker.settle_credits(host, config, &self.tenant, None, false, &self.owners(), surplus.into_iter());
                if hold.held.is_empty() && refused.len() == hold.short.len() {
                    self.count_admission(host, config, Decision::Allowed);
                    self.admission = Some(Admission::Charged);
                    return Verdict::Forward(self.admitted_headers(host, config, reply, now));
                }
                self.admitted_from_lease(host, worker, config, &leases, &slots, now)
            }
            Ask::Charge => {
                host.add_metric(Metric::Allowed, 1);
                self.count_per_limit_in(host, config, Decision::Allowed, Some(&reply));
                self.rewrite_body(host, config, &reply);
                if let (true, Some(Admission::Reserved(id))) = (config.has_concurrency(), &self.admission) {
                    let costs = self.costs();
                    let held = config
                        .limits
                        .iter()
                        .enumerate()
                        .filter(|(i, l)| l.kind == LimitKind::Slots && costs.get(*i).is_some_and(|&c| c > 0))
                        .map(|(i, _)| (i, 0));
                    let held = adjustments(config, &self.owners(), held, now);
                    let slots = settlement(config, &self.tenant, Some(id.clone()), false, held);
                    worker.hold_slots(id.clone(), slots);
                }
                Verdict::Forward(self.admitted_headers(host, config, reply, now))
            }
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
        self.admission = None; // nothing was charged
        host.add_metric(Metric::Limited, 1);
        host.add_metric(Metric::Suspended, 1);
        self.recorded.how = record::How::Suspended;
        self.recorded.refused_by = Some(suspension.limit.clone());
        if let Some(owner) = self.owner_of(config, &suspension.limit) {
            worker.owner_plans.suspend(&owner, &suspension.reason, now);
            if self.ask == Ask::Lease {
                for holder in self.holders(config).iter().filter(|h| h.name == owner) {
                    lease_table::end(host, config, holder, now);
                }
            }
        }
        if self.ask == Ask::Lease {
            self.put_back_hold(host, config);
        }
        Verdict::Reply(decision::suspension(suspension, config, self.caller(now)))
    }

    /// Notes, for the degraded mode, the limits whose capacity the companion answered
    /// other than the filter sent it: an owner's plan.
    fn learn_plans(&self, worker: &mut Worker, reply: &LimitsReply, now: u64) {
        let Some(plan) = self.plan.as_ref() else { return };
        // The common case, on every reply: no plan answered, none known: nothing to do.
        let differs = plan.buckets.iter().zip(&reply.limits).any(|(sent, answered)| sent.capacity != answered.limit);
        if !differs && worker.owner_plans.is_empty() {
            return;
        }
        let owners = crate::plan::pools::owners(plan);
        for (i, (sent, answered)) in plan.buckets.iter().zip(&reply.limits).enumerate() {
            if !plan.applies(i) || answered.name != sent.name {
                continue;
            }
            let owner = owners.get(i).cloned().flatten().unwrap_or_else(|| self.tenant.clone());
            worker.owner_plans.answered(&owner, i, sent.capacity, answered.limit, now);
        }
    }

    /// The owner of limit `name`'s counter for this request: the tenant, or a pool's id.
    fn owner_of(&self, config: &Policy, name: &str) -> Option<String> {
        let index = config.limits.iter().position(|l| l.name == name)?;
        let owners = self.owners();
        Some(owners.get(index).cloned().flatten().unwrap_or_else(|| self.tenant.clone()))
    }

    fn callout_failed(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, why: &str) -> Verdict {
        self.leave_queue(host, config);
        host.add_metric(Metric::CalloutFailures, 1);
        worker.record_callout_failure(host, config);
        self.fail_over(host, worker, config, why)
    }

    /// Decides without the companion, as `failure_mode` says. A charge sent but never
    /// answered may still happen in Redis (a companion paused, or Redis slow, runs it
    /// later): it never counts on its own. Admitted locally, the request's debits stand
    /// in for it (applied only if it did not happen, and it then never will); otherwise it
    /// is cancelled (refunded if it happened).
    fn fail_over(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, why: &str) -> Verdict {
        let unanswered = match self.admission.take() {
            Some(Admission::Reserved(id)) => Some(id),
            _ => None,
        };
        self.put_back_hold(host, config);
        host.log(
            LogLevel::Debug,
            &format!("llm-ratelimit: no decision from the companion ({why}); failure_mode {:?}", config.failure_mode),
        );
        host.add_metric(Metric::DegradedDecisions, 1);
        let verdict = match config.failure_mode {
            FailureMode::Local => self.decide_locally(host, worker, config, unanswered.as_deref()),
            FailureMode::Allow => {
                self.recorded.how = record::How::DegradedAllowed;
                self.count_per_limit(host, config, Decision::Degraded);
                Verdict::Forward(vec![(DEGRADED_HEADER, "companion-unavailable".to_string())])
            }
            FailureMode::Deny => Verdict::Reply(decision::limiter_unavailable(self.dialect)),
        };
        if let Some(id) = unanswered.filter(|_| !matches!(self.admission, Some(Admission::Local(_)))) {
            self.give_up_charge(host, worker, config, id);
        }
        verdict
    }

    /// The degraded mode: each limit divided by `fallback.instances`, as token buckets in
    /// shared data, decided with the same model the Lua script follows. What is admitted
    /// is queued as a debit, so Redis learns of it when it is back. A shared pool is
    /// counted in its own local entry (named by its owner id, as in the lease table), so
    /// it holds its share for this proxy whatever the number of tenants; the tenant's
    /// entry and each pool's are charged in turn, all or nothing, each given back when a
    /// later one refuses.
    fn decide_locally(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        unanswered: Option<&str>,
    ) -> Verdict {
        let mut specs = self.plan.as_ref().map(|plan| local_specs(config, plan)).unwrap_or_default();
        let now_ms = host.now_ms();
        // The owners' plans as this VM last saw them: a suspension holds through the
        // outage, a plan's capacity sizes the local share as the config's would.
        let owners = self.owners();
        for (i, spec) in specs.iter_mut().enumerate() {
            let owner = owners.get(i).and_then(Option::as_deref).unwrap_or(&self.tenant);
            if let Some(reason) = worker.owner_plans.suspended(owner) {
                let suspension = Suspension { limit: spec.name.clone(), reason: reason.to_string() };
                return self
                    .refuse_suspended(host, worker, config, &suspension, now_ms)
                    .with_header(DEGRADED_HEADER, "local".to_string());
            }
            if let Some(capacity) = worker.owner_plans.capacity(owner, i) {
                spec.capacity = capacity.div_ceil(u64::from(config.fallback.instances));
            }
        }
        let holders = self.holders(config);
        let mut charged: Vec<&Holder> = Vec::new();
        let mut outcomes: Vec<Option<crate::protocol::LimitOutcome>> = vec![None; specs.len()];
        let mut allowed = true;
        for holder in &holders {
            let part = holder_specs(&specs, &holder.indices);
            let Some(reply) = charge_local(host, config, &holder.name, &part, now_ms) else {
                for done in &charged {
                    give_back_local(host, config, done, &specs, now_ms);
                }
                return Verdict::Reply(decision::limiter_unavailable(self.dialect));
            };
            for &i in &holder.indices {
                if let (Some(slot), Some(outcome)) = (outcomes.get_mut(i), reply.limits.get(i)) {
                    *slot = Some(outcome.clone());
                }
            }
            if !reply.allowed {
                allowed = false;
                for done in &charged {
                    give_back_local(host, config, done, &specs, now_ms);
                }
                break;
            }
            charged.push(holder);
        }
        let limits = specs
            .iter()
            .zip(outcomes)
            .map(|(spec, outcome)| {
                outcome.unwrap_or_else(|| crate::protocol::LimitOutcome {
                    name: spec.name.clone(),
                    status: LimitStatus::Allowed,
                    limit: spec.capacity,
                    remaining: spec.capacity,
                    reset_after_ms: 0,
                    retry_after_ms: 0,
                    charged: 0,
                })
            })
            .collect();
        let reply = LimitsReply { allowed, waited_ms: 0, limits, suspended: None };
        if !reply.allowed {
            self.count_refusal(host, config, &reply);
            return self.rejection(config, &reply, now_ms).with_header(DEGRADED_HEADER, "local".to_string());
        }
        self.count_admission(host, config, Decision::Degraded);
        // Redis learns of the budget spent here; slots are this proxy's alone.
        let debits = specs.iter().enumerate().filter(|(_, b)| b.kind != LimitKind::Slots);
        let debits = debits.map(|(i, b)| (i, -(b.cost as i64)));
        // Standing in for the charge (unanswered, or never sent while the breaker is
        // open), which the stand-in stops; an unanswered one may hold Redis slots, which
        // it releases.
        let releases = if unanswered.is_some() { self.slot_releases(config) } else { Vec::new() };
        let id = unanswered.map_or_else(|| worker.new_reservation_id(host), str::to_string);
        let limits = adjustments(config, &self.owners(), debits.chain(releases), now_ms);
        if !limits.is_empty() {
            let stand_in = Some(StandIn { record_ttl_ms: self.record_ttl_ms(config, None) });
            let queued = settlement(config, &self.tenant, Some(id.clone()), false, limits);
            worker.queue_settlement(host, Settlement { stand_in, ..queued });
        }
        self.admission = Some(Admission::Local(id));
        Verdict::Forward(self.admitted_headers(host, config, reply, now_ms))
            .with_header(DEGRADED_HEADER, "local".to_string())
    }

    /// Sends upstream the body the charge calls for: the output cap clamped to what was
    /// granted, stream usage requested. Only while the headers are still held can
    /// content-length follow the new body, so nothing changes otherwise.
    fn rewrite_body(&mut self, host: &mut impl Host, config: &Policy, reply: &LimitsReply) {
        let signed = self.plan.as_ref().and_then(|p| p.request.as_ref()).is_some_and(|r| r.body_is_signed);
        if signed {
            // Reserved at its whole cap instead (see `charge::plan`).
            if config.tokens.clamp_max_tokens {
                host.add_metric(Metric::SignedNotClamped, 1);
            }
            return;
        }
        if !self.holding_headers {
            return;
        }
        let Some(plan) = self.plan.as_mut() else { return };
        let charged: Vec<u64> = reply.limits.iter().map(|o| o.charged).collect();
        let Some(body) = plan.apply_grant(config, &charged) else { return };
        if host.replace_request_body(self.body_len, &body)
            && host.set_request_header("content-length", &body.len().to_string())
            && config.tokens.request_stream_usage
            && plan.request.as_ref().is_some_and(|r| r.wants_usage_added())
        {
            self.usage_remover = Some(UsageChunkRemover::default());
        }
    }

    /// Carries a verdict out, as shadow mode has it. `paused` says whether the request is
    /// waiting on us.
    fn apply(&mut self, host: &mut impl Host, config: &Policy, verdict: Verdict, paused: bool) -> Action {
        let verdict = self.shadow(host, config, verdict);
        self.carry_out(host, verdict, paused)
    }

    /// In shadow mode a refusal is forwarded instead, marked with what it would have been.
    fn shadow(&mut self, host: &mut impl Host, config: &Policy, verdict: Verdict) -> Verdict {
        match verdict {
            Verdict::Reply(reply) if config.mode == Mode::Shadow && matches!(reply.status, 403 | 413 | 429 | 503) => {
                host.add_metric(Metric::ShadowRefusals, 1);
                self.recorded.shadow = true;
                let mut headers: Vec<Header> = reply
                    .headers
                    .into_iter()
                    .filter(|(name, _)| *name != "retry-after" && !answers::belongs_to_the_error(name))
                    .collect();
                let would = if self.shadow_overflow { "overflow".to_string() } else { reply.status.to_string() };
                headers.push((SHADOW_HEADER, would));
                Verdict::Forward(headers)
            }
            other => other,
        }
    }

    fn carry_out(&mut self, host: &mut impl Host, verdict: Verdict, paused: bool) -> Action {
        match verdict {
            Verdict::Forward(mut headers) => {
                self.phase = Phase::Forwarded;
                self.provider.sent_ms = host.now_ms();
                if let Some(mark) = self.provider.mark {
                    headers.push((PROVIDER_HEADER, mark.to_string()));
                }
                if let Some(backend) = &self.overflow {
                    // The route table (Envoy clears its route cache on a header the filter
                    // sets) or the config's `map` (Nginx) sends the request there.
                    if !host.set_request_header(OVERFLOW_HEADER, backend) {
                        host.warn_once("overflow", "llm-ratelimit: the host refused the overflow request header");
                    }
                    headers.push((OVERFLOW_HEADER, backend.clone()));
                }
                self.response_headers = headers;
                if paused {
                    host.resume_request();
                }
                Action::Continue
            }
            Verdict::Reply(mut reply) => {
                self.phase = Phase::Replied;
                if self.recorded.how != record::How::Suspended {
                    self.recorded.how = record::How::Refused;
                }
                // Final now, and before the log phase, whatever the host.
                if let Some(config) = self.config.clone() {
                    self.publish_record(host, &config);
                }
                // Nothing goes upstream: nothing will be heard.
                self.provider.key = None;
                self.response_headers.clear();
                // OpenAI's SDK reads `x-request-id`, Anthropic's `request-id`: a caller can
                // quote either when it asks why it was refused.
                if !self.request_id.is_empty() {
                    reply.headers.push(("x-request-id", self.request_id.clone()));
                    reply.headers.push(("request-id", self.request_id.clone()));
                }
                host.send_reply(&reply);
                Action::Pause
            }
            // The fallback's charge is out: its answer resumes the request or refuses it.
            Verdict::Recharging => Action::Pause,
        }
    }

    // ---- settling ----

    /// Settles this request, once: the difference between what it reserved and what it
    /// cost (in tokens, and in money for budgets) goes back where the reservation came
    /// from, and its slots are released.
    /// Settles the request as it `ending`, then publishes its record.
    fn settle(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy, ending: Ending) {
        self.note_how_admitted();
        self.settle_admission(host, worker, config, ending);
        self.publish_record(host, config);
        self.add_to_ledger(host, worker, config);
    }

    /// How the request was admitted, for its record (while it holds its admission).
    fn note_how_admitted(&mut self) {
        if let Some(admission) = &self.admission {
            self.recorded.how = match admission {
                Admission::Reserved(_) | Admission::Charged => record::How::Charged,
                Admission::Leased => record::How::Leased,
                Admission::Local(_) => record::How::Degraded,
                Admission::Stored { .. } => record::How::LocalStore,
            };
        }
    }

    /// Where the access log is written before `on_log` (`HostKind::logs_after_on_log`):
    /// the record as the response begins, at what the request is charged if it is cut off
    /// now (its reservation; an upstream error its prompt), published again when settled
    /// before the log phase.
    fn publish_provisional_record(&mut self, host: &mut impl Host, config: &Policy) {
        self.note_how_admitted();
        let Some(plan) = self.plan.as_ref() else { return self.publish_record_now(host, config) };
        if let (Some(estimate), Some(_)) = (plan.estimate, &self.admission) {
            let used = if self.upstream_error { TokenCounts { output: 0, ..estimate } } else { estimate };
            let price = plan.settlement_price(config, None);
            self.recorded.used = record::Used {
                input: used.prompt,
                output: used.output,
                cost_micro_usd: price.map_or(0, |price| price.micro_usd_cached(used, 0)),
                ..record::Used::default()
            };
        }
        self.publish_record_now(host, config);
    }

    /// Publishes the request's record, once (`record`).
    fn publish_record(&mut self, host: &mut impl Host, config: &Policy) {
        if self.recorded.published {
            return;
        }
        self.publish_record_now(host, config);
        self.recorded.published = true;
    }

    fn publish_record_now(&mut self, host: &mut impl Host, config: &Policy) {
        if config.record == RecordMode::Off {
            return;
        }
        let owners = self.owners();
        let owners = config
            .limits
            .iter()
            .zip(&owners)
            .filter_map(|(limit, owner)| Some((limit.name.as_str(), owner.as_deref()?)));
        let route = self.route.as_ref();
        let record = record::Record {
            tenant: &self.tenant,
            owners: owners.collect(),
            provider: route.map(|r| r.provider),
            api: self
                .plan
                .as_ref()
                .and_then(|p| p.request.as_ref())
                .map(|r| r.api)
                .or_else(|| route.and_then(|r| r.api)),
            model: self.plan.as_ref().map_or("", |p| p.model.as_str()),
            used: self.recorded.used,
            how: self.recorded.how,
            refused_by: self.recorded.refused_by.as_deref(),
            queued_ms: self.recorded.queued_ms,
            overflow: self.overflow.as_deref(),
            shadow: self.recorded.shadow,
        };
        record::publish(host, self.host_kind, config.record, &record);
    }

    /// Adds what the request's record says it used to the worker's ledger aggregate, under
    /// its tenant and each pool's claimant: every request with a tenant, with exactly the
    /// record's counts, but a refused one that used nothing (a refusal is not a request
    /// served). Only with the companion (`store: redis`): the local store keeps no ledger.
    fn add_to_ledger(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy) {
        if std::mem::replace(&mut self.recorded.in_ledger, true) {
            return;
        }
        let refused = matches!(self.recorded.how, record::How::Refused | record::How::Suspended)
            && self.recorded.used == record::Used::default();
        // A credential the upstream refused did no work and is refunded; its row would
        // keep an id a client may have invented in Redis for the retention.
        let invented = self.credential_refused && self.phase == Phase::Forwarded;
        if config.store != crate::config::Store::Redis || self.tenant.is_empty() || refused || invented {
            return;
        }
        let used = self.recorded.used;
        let mut owners = vec![(self.tenant.as_str(), crate::protocol::ledger::TENANT_LABEL)];
        owners.extend(self.recorded.pools.iter().map(|(owner, label)| (owner.as_str(), label.as_str())));
        let entry = crate::accounting::ledger::Entry {
            owners,
            model: self.plan.as_ref().map_or("", |p| p.model.as_str()),
            day: crate::protocol::ledger::day_of_ms(host.now_ms()),
            used: crate::protocol::ledger::Spent {
                requests: 1,
                input_tokens: used.input,
                output_tokens: used.output,
                cached_tokens: used.cached,
                reasoning_tokens: used.reasoning,
                cost_micro_usd: used.cost_micro_usd,
            },
        };
        worker.ledger.add(&entry);
    }

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
        let reservation = match admission {
            Admission::Reserved(id) => {
                // Released at once where the host lets a finished request call out; the
                // settlement below releases them too, within a tick, everywhere.
                let slots = worker.take_slots(&id);
                if let Some(slots) = slots.filter(|_| worker.host_kind().dispatches_in_response_phases()) {
                    release_now(host, worker, config, slots);
                }
                Some(id)
            }
            Admission::Local(id) => {
                // This proxy's own slots go back at once; the credits go to Redis, against
                // the stand-in's record (or the late charge's, if it came first).
                if !slot_limits.is_empty() {
                    self.release_local_slots(host, config, &slot_limits);
                }
                let credits = credits.into_iter();
                worker.settle_credits(host, config, &self.tenant, Some(id), false, &self.owners(), credits);
                return;
            }
            Admission::Leased => {
                let now = host.now_ms();
                // What finds its lease expired (or evicted) meanwhile belongs to Redis.
                let left = lease_table::credit(host, config, &self.holders(config), &credits, now);
                if !left.is_empty() {
                    worker.settle_credits(host, config, &self.tenant, None, false, &self.owners(), left.into_iter());
                }
                return;
            }
            Admission::Charged => None,
            Admission::Stored { id, charged_at_ms } => {
                self.settle_in_store(host, worker, config, &id, charged_at_ms, &credits);
                return;
            }
        };
        let with_slots = reservation.is_some();
        let releases = slot_limits.into_iter().filter(|_| with_slots).map(|i| (i, 0));
        let credits = credits.into_iter().chain(releases);
        worker.settle_credits(host, config, &self.tenant, reservation, false, &self.owners(), credits);
    }

    /// What gives back all this request took from each limit but slots (released on
    /// their own): requests, tokens and dollars alike.
    fn refund_everything(&self, config: &Policy) -> Vec<(usize, i64)> {
        let Some(plan) = self.plan.as_ref() else { return Vec::new() };
        let limits = config.limits.iter().zip(&plan.buckets).enumerate().filter(|(i, _)| plan.applies(*i));
        limits
            .filter(|(_, (limit, _))| limit.kind != LimitKind::Slots)
            .map(|(i, (_, bucket))| (i, i64::try_from(bucket.cost).unwrap_or(i64::MAX)))
            .collect()
    }

    /// The client gave up while the charge waited in the queue: stop the charge if it has
    /// not happened yet, and refund everything it took if it has (one script call does
    /// both, so one of the two is true).
    fn cancel_queued(&mut self, host: &mut impl Host, worker: &mut Worker, config: &Policy) {
        let Some(Admission::Reserved(id)) = self.admission.take() else { return };
        self.give_up_charge(host, worker, config, id);
    }

    /// Stops the charge of reservation `id` if it has not happened yet, and refunds
    /// everything it took (its slots too) if it has: one script call does both.
    fn give_up_charge(&self, host: &mut impl Host, worker: &mut Worker, config: &Policy, id: String) {
        worker.take_slots(&id);
        let costs = self.costs();
        let refunds = config.limits.iter().zip(&costs).enumerate().map(|(i, (limit, &cost))| {
            (i, if limit.kind == LimitKind::Slots { 0 } else { i64::try_from(cost).unwrap_or(i64::MAX) })
        });
        let limits = adjustments(config, &self.owners(), refunds, host.now_ms());
        worker.queue_settlement(host, settlement(config, &self.tenant, Some(id), true, limits));
    }

    /// A release of each slot limit (credit 0) this request's charge would hold.
    fn slot_releases(&self, config: &Policy) -> Vec<(usize, i64)> {
        let costs = self.costs();
        let slots = config.limits.iter().enumerate().filter(|(_, l)| l.kind == LimitKind::Slots);
        slots.filter(|(i, _)| costs.get(*i).is_some_and(|&c| c > 0)).map(|(i, _)| (i, 0)).collect()
    }

    /// What to give back for this request (negative: to take) to each token and cost
    /// limit it applies to (per-model limits may not), by limit index: of the part of its
    /// tokens the limit counts, or in micro-dollars, what it reserved less what the reply
    /// says it used. Updates the running average of completions.
    fn credits(
        &mut self,
        host: &mut impl Host,
        worker: &mut Worker,
        config: &Policy,
        ending: Ending,
    ) -> Vec<(usize, i64)> {
        let Some(plan) = self.plan.as_ref() else { return Vec::new() };
        let Some(estimate) = plan.estimate else { return Vec::new() };
        if plan.charged_most {
            return Vec::new();
        }
        // Of a JSON reply, the bytes of text that passed to the client, for a cut one.
        let mut passed_text_bytes = None;
        let (reported, streamed_output, reply_model) = match self.reply.as_mut() {
            Some(ReplyReader::Json(reader)) => {
                passed_text_bytes = Some(reader.value_bytes());
                (reader.finish(), None, reader.model())
            }
            Some(ReplyReader::Stream(reader)) => {
                reader.finish();
                (reader.reported(), Some(reader.output_tokens()), reader.model())
            }
            Some(ReplyReader::EventStream(reader)) => {
                if let Some(why) = reader.broken() {
                    host.warn_once("event-stream", &format!("llm-ratelimit: a Bedrock event stream stopped being read ({why:?}); settled on what came before"));
                }
                (reader.reported(), Some(reader.output_tokens()), None)
            }
            None => (ReportedUsage::default(), None, None),
        };
        let price = plan.settlement_price(config, reply_model);
        let forwarded = self.phase == Phase::Forwarded;
        // A request that never went upstream cost nothing.
        self.sight.stream_without_usage = streamed_output.is_some() && reported.output.is_none();
        // Matched only where it can matter (a stream that ended without its usage): the
        // patterns are many (13 by default) and most replies report their usage.
        self.sight.hidden_output_model = self.sight.stream_without_usage
            && reply_floor::hides_output(&config.tokens.hidden_output_models, &plan.model);
        let floor = reply_floor::floor(ending, self.sight, config.tokens.on_client_abort).filter(|_| forwarded);
        let used = if forwarded {
            let used = actual_usage(estimate, ending, reported, streamed_output, config.tokens.on_upstream_error);
            match floor {
                // Cut after its text and before its usage: a reservation set by a history
                // the client chose may be far below what it already received.
                Some(reply_floor::Floor::Cut) if reported.output.is_none() => {
                    let asked =
                        plan.request.as_ref().and_then(|r| r.max_output.map(|most| most.saturating_mul(r.choices)));
                    let passed = reply_floor::passed_output(passed_text_bytes.unwrap_or(0), asked);
                    let floored = reply_floor::at_least_reserved(estimate, used);
                    TokenCounts { output: floored.output.max(passed), ..floored }
                }
                Some(_) => reply_floor::at_least_reserved(estimate, used),
                None => used,
            }
        } else {
            TokenCounts { prompt: 0, output: 0 }
        };
        host.add_metric(Metric::TokensCharged, used.total());
        count_tokens(host, config, plan.rule, TokenStage::Charged, used);
        // A reply the filter could not read teaches nothing: its visible part would teach
        // the next reservations that completions are short.
        if ending == Ending::Completed && forwarded && floor.is_none() {
            let output = reported.output.or(streamed_output).filter(|_| plan.produces_output());
            if let Some(output) = output {
                worker.averages.teach(host, config, &self.tenant, &plan.model, output);
            }
            // What the provider counted against what the proxy did, for the next reservations.
            let prompt = reported.input.map(|input| (plan.counted_prompt, input));
            worker.calibrations.note(config, plan.rule, Lesson { prompt, output });
        }
        let cached = if forwarded { reported.cached_input.unwrap_or(0) } else { 0 };
        self.recorded.used = record::Used {
            input: used.prompt,
            output: used.output,
            cached,
            reasoning: if forwarded { reported.reasoning.unwrap_or(0) } else { 0 },
            cost_micro_usd: price.map_or(0, |price| price.micro_usd_cached(used, cached)),
        };
        let credits = config.limits.iter().zip(&plan.buckets).enumerate().filter(|(i, _)| plan.applies(*i));
        credits
            .filter_map(|(i, (limit, bucket))| match limit.measure {
                Measure::Tokens { count, .. } => Some((i, credit(count.reserved(estimate), count.used(used, cached)))),
                // Against what the budget was charged, at the price of each part used.
                Measure::Usd { .. } => {
                    let cost = price.map_or(0, |price| credit(bucket.cost, price.micro_usd_cached(used, cached)));
                    Some((i, cost))
                }
                Measure::Requests(_) | Measure::Concurrency(_) => None,
            })
            .collect()
    }

    fn release_local_slots(&self, host: &mut impl Host, config: &Policy, indices: &[usize]) {
        let Some(plan) = self.plan.as_ref() else { return };
        let specs = local_specs(config, plan);
        let credits: Vec<i64> = (0..specs.len()).map(|i| i64::from(indices.contains(&i))).collect();
        let now = host.now_ms() as f64;
        for holder in self.holders(config).iter().filter(|h| h.indices.iter().any(|i| indices.contains(i))) {
            let credits: Vec<i64> =
                credits.iter().enumerate().map(|(i, &c)| if holder.indices.contains(&i) { c } else { 0 }).collect();
            credit_local(host, config, &holder.name, &specs, &credits, now);
        }
    }
}

/// What this proxy knows for one request's plan: the tenant's completion averages and the
/// calibrations as this worker last read them (with what it learned since), and the
/// counts this VM remembers.
struct ProxyKnowledge<'a, H> {
    host: &'a mut H,
    now: u64,
    config: &'a Policy,
    tenant: &'a str,
    prompt_cache: &'a mut PromptCache,
    calibrations: &'a mut LocalCalibrations,
    averages: &'a mut LocalAverages,
}

impl<H: Host> Learned for ProxyKnowledge<'_, H> {
    fn average(&mut self, model: &str) -> Option<OutputAverage> {
        self.averages.get(self.host, self.config, self.tenant, model)
    }

    fn calibration(&mut self, rule: usize) -> Calibration {
        self.calibrations.get(self.host, self.config, rule, self.now)
    }

    fn count(&mut self, encoding: Encoding, text: &str) -> u64 {
        self.prompt_cache.count(encoding, text)
    }
}

/// Whether the request, by its headers, has no body to wait for: `content-length: 0`, or,
/// on a host that never reports end of stream on request headers (ngx_wasm_module), no
/// `content-length` and no `transfer-encoding` either. Such a request gets no body
/// callback there, so waiting for one would let it through uncharged.
/// Takes a place in the waiter count at `key` if fewer than `most` wait there.
fn take_place(host: &mut impl Host, key: &str, most: u32) -> bool {
    let joined = shared_update(host, key, |bytes| {
        let waiting = bytes.and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes);
        let room = waiting < most;
        (room.then(|| (waiting + 1).to_le_bytes().to_vec()), room)
    });
    joined == Some(true)
}

/// Gives back a place taken with `take_place`.
fn give_place(host: &mut impl Host, key: &str) {
    shared_update(host, key, |bytes| {
        let waiting = bytes.and_then(|b| b.try_into().ok()).map_or(0, u32::from_le_bytes);
        (Some(waiting.saturating_sub(1).to_le_bytes().to_vec()), ())
    });
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

fn has_no_body(host: &mut impl Host, worker: &Worker) -> bool {
    match host.request_header("content-length") {
        Some(length) => length.trim() == "0",
        None => {
            !worker.host_kind().reports_end_of_stream_on_headers() && host.request_header("transfer-encoding").is_none()
        }
    }
}

/// The degraded mode's buckets: each limit divided by `fallback.instances`; a slot comes
/// back when its request ends, not with time.
fn local_specs(config: &Policy, plan: &ChargePlan) -> Vec<LimitCharge> {
    let instances = u64::from(config.fallback.instances);
    plan.buckets
        .iter()
        .map(|b| LimitCharge {
            capacity: b.capacity.div_ceil(instances),
            min_cost: None,
            window_ms: if b.kind == LimitKind::Slots { LOCAL_SLOTS_NEVER_REFILL_MS } else { b.window_ms },
            ..b.clone()
        })
        .collect()
}

/// `specs` as `holder`'s local entry charges them: its limits at their cost, the others
/// at none.
fn holder_specs(specs: &[LimitCharge], indices: &[usize]) -> Vec<LimitCharge> {
    let part = specs.iter().enumerate();
    part.map(|(i, s)| if indices.contains(&i) { s.clone() } else { LimitCharge { cost: 0, ..s.clone() } }).collect()
}

/// Charges `specs` in the local entry `name` (a tenant's or a pool's), if it admits;
/// `None` when its slot is another's that may not be taken yet, or the write failed.
fn charge_local(
    host: &mut impl Host,
    config: &Policy,
    name: &str,
    specs: &[LimitCharge],
    now_ms: u64,
) -> Option<LimitsReply> {
    let now = now_ms as f64;
    // A colliding entry's local bucket may be replaced only once it has admitted nothing
    // for a whole window: taken sooner, its owner would find a fresh budget.
    let idle = |payload: &[u8]| {
        let states = decode_states(Some(payload), specs.len());
        states.iter().zip(specs).all(|(state, spec)| state.is_none_or(|s| now - s.updated_ms >= spec.window_ms as f64))
    };
    // Failing that, when all its slots are held, the entry written longest ago that holds
    // no concurrency slot: an outage must not refuse a newcomer service because the
    // table remembers older tenants (a day's limit keeps every entry for a day). What
    // that tenant spent here is in Redis's debits all the same; only its local share
    // starts afresh (see `tables`).
    let left_at = |payload: &[u8]| {
        let states = decode_states(Some(payload), specs.len());
        let holds_slot = states.iter().zip(specs).any(|(state, spec)| {
            spec.kind == LimitKind::Slots && state.is_some_and(|s| s.tokens < spec.capacity as f64)
        });
        (!holds_slot).then(|| states.iter().flatten().map(|s| s.updated_ms as u64).max().unwrap_or(0))
    };
    let reply = update_own_or_oldest(host, config, TenantTable::Local, name, idle, left_at, |payload| {
        let mut states = decode_states(payload, specs.len());
        let reply = check_and_charge(&mut states, specs, now);
        if !reply.allowed {
            // Its own entry is written as of now (the same levels): a tenant refused here
            // is still in use, so its spent entry is never the one a newcomer takes as
            // written longest ago. A newcomer refused takes no place.
            if payload.is_none() {
                return (None, reply);
            }
            for (state, spec) in states.iter_mut().zip(specs) {
                *state = state.map(|s| BucketState { tokens: level_at(spec, Some(s), now), updated_ms: now });
            }
        }
        (Some(encode_states(&states)), reply)
    });
    reply.and_then(Result::ok)
}

/// Gives back to `holder`'s local entry what a request took of it.
fn give_back_local(host: &mut impl Host, config: &Policy, holder: &Holder, specs: &[LimitCharge], now_ms: u64) {
    let credits: Vec<i64> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| if holder.indices.contains(&i) { i64::try_from(s.cost).unwrap_or(i64::MAX) } else { 0 })
        .collect();
    credit_local(host, config, &holder.name, specs, &credits, now_ms as f64);
}

fn credit_local(host: &mut impl Host, config: &Policy, name: &str, specs: &[LimitCharge], credits: &[i64], now: f64) {
    update_own(
        host,
        config,
        TenantTable::Local,
        name,
        |_| false,
        |payload| {
            let Some(payload) = payload else { return (None, ()) }; // replaced meanwhile
            let mut states = decode_states(Some(payload), specs.len());
            crate::accounting::bucket::settle(&mut states, specs, credits, now);
            (Some(encode_states(&states)), ())
        },
    );
}

/// Releases a request's slots at once, in a callout owned by the root context so it
/// outlives the request; its settlement (queued, sent within a tick) releases them too,
/// so nothing is lost if this one fails.
fn release_now(host: &mut impl Host, worker: &Worker, config: &Policy, slots: crate::protocol::Settlement) {
    let request = SettlementBatch { settlements: vec![slots] };
    let timeout = config.companion.timeout.max(RELEASE_TIMEOUT);
    if let Err(why) = worker.call_companion(host, config, RELEASE_PATH, &request, timeout, Owner::Root) {
        host.log(LogLevel::Debug, &format!("llm-ratelimit: cannot release slots at once ({why}); the settlement will"));
    }
}

/// Tokens by `gen_ai.token.type`: the prompt is input, the completion output.
fn count_tokens(host: &mut impl Host, config: &Policy, rule: usize, stage: TokenStage, tokens: TokenCounts) {
    for (kind, amount) in [(TokenType::Input, tokens.prompt), (TokenType::Output, tokens.output)] {
        if amount > 0 {
            host.add_series(series::tokens(config, rule, kind, stage), amount);
        }
    }
}

#[cfg(test)]
mod answers_tests;
#[cfg(test)]
mod calendar_tests;
#[cfg(test)]
mod ledger_tests;
mod local;
#[cfg(test)]
mod local_tests;
#[cfg(test)]
mod overflow_tests;
#[cfg(test)]
mod plans_tests;
#[cfg(test)]
mod pools_tests;
pub mod record;
#[cfg(test)]
mod record_tests;
#[cfg(test)]
mod request_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod upgrade_tests;

/// Whether a request's `x-request-id` may be echoed in a reply: short, and only the
/// characters ids are made of (a client may send anything).
fn is_request_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
}
