//! What the core asks of a proxy-wasm host, as one small trait. The cdylib implements it
//! over the proxy-wasm ABI; [`crate::testing::FakeHost`] implements it for native tests and
//! plays the semantics that differ between hosts.
//!
//! Every method reports failure as a value: a host call that fails must never panic, since
//! a panic aborts the VM and takes the worker's traffic with it.

use crate::replies::reply::LocalReply;
use std::time::Duration;

/// How often the host calls each VM's root timer, on which it sends queued settlements,
/// renews leases (and, once, warms the tokenizer), and within which a shared-data read
/// counts as fresh.
pub const TICK: Duration = Duration::from_millis(50);

/// How often a worker writes the lessons that barely moved what it learned (completion
/// averages, calibrations), and how long a learned average it read stands for it: the
/// lessons that matter go out on the next tick (see `effects::average_store`).
pub const SETTLE: Duration = Duration::from_secs(1);

/// The root timer's period while requests of the VM wait for a lease grant another asked
/// for (`Worker::has_waiters`): each such tick wakes those whose grant landed, so a waiter
/// waits about this long more than the grant itself. The full tick's work still runs
/// every `TICK`.
pub const WAIT_TICK: Duration = Duration::from_millis(1);

/// What the host does with the stream after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
}

/// The hosts whose semantics differ in ways the filter must know (see
/// docs/nginx.md#what-differs-between-the-hosts). Detected at start-up by [`detect_kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostKind {
    /// Envoy (V8): end of stream is reported on headers; a request body is delivered while
    /// its headers are held (with `allow_on_headers_stop_iteration`).
    #[default]
    Envoy,
    /// Nginx with ngx_wasm_module: the body is delivered only in the content phase, end
    /// of stream is never set on request headers, a request without a body gets no body
    /// callback at all, and a shared-data write without CAS fails on an existing key.
    Nginx,
}

impl HostKind {
    pub fn name(self) -> &'static str {
        match self {
            HostKind::Envoy => "envoy",
            HostKind::Nginx => "nginx",
        }
    }

    /// Whether the host delivers the request body while the request headers are paused.
    pub fn reads_body_while_headers_wait(self) -> bool {
        self == HostKind::Envoy
    }

    /// Whether a request may dispatch a callout once its response has begun (response
    /// callbacks, `on_log`). ngx_wasm_module allows callouts only in the request phases,
    /// on ticks and in callout responses; elsewhere the call traps and the VM is reset.
    pub fn dispatches_in_response_phases(self) -> bool {
        self == HostKind::Envoy
    }

    /// Whether a local reply with a body may be sent from the response of a callout that
    /// carried a body and got none back (a timeout, or an empty answer). ngx_wasm_module
    /// reuses the callout's body buffer for the reply and then empties it: the client gets
    /// an empty reply, and a debug build aborts the worker (see
    /// docs/nginx.md#what-differs-between-the-hosts).
    /// There, such a reply goes out without its body: status and headers say it all.
    pub fn replies_after_an_empty_callout(self) -> bool {
        self == HostKind::Envoy
    }

    /// Whether one request's callback (or the root's) may resume another request, by making
    /// it the effective context first. Envoy switches contexts; ngx_wasm_module's
    /// `proxy_set_effective_context` does nothing, and a resume there acts on the request
    /// whose callback runs. Only where this holds does a request wait for a lease grant
    /// another request asked for (see `lease_table::DryOut`).
    pub fn resumes_other_contexts(self) -> bool {
        self == HostKind::Envoy
    }

    /// Whether a request with a body may be decided, and resumed, before its body has been
    /// read. ngx_wasm_module starts reading the body when the headers are paused; a resume
    /// that comes first runs the content handler anyway, and the upstream gets the headers
    /// (with their content-length) but no body: the request hangs. There, a request with a
    /// body is decided at the end of its body even when the decision needs nothing from it.
    pub fn decides_before_the_body_is_read(self) -> bool {
        self == HostKind::Envoy
    }

    /// Whether a request header the filter sets once the body is read can still choose the
    /// request's route when the headers went ahead meanwhile (not held). Envoy routes on
    /// the headers as they continue: after that, a header changes nothing. ngx_wasm_module
    /// reads the body and runs the filter in its own content handler, and only then runs
    /// the location's (`proxy_pass`), whose variables (a `map` of the header) are
    /// evaluated there. Overflow needs the route open.
    pub fn routes_after_the_body_is_read(self) -> bool {
        self == HostKind::Nginx
    }

    /// Whether the access log is written after the filter's last callback (`on_log`), so
    /// that what the filter sets there reaches it. ngx_wasm_module calls `on_log` in
    /// Nginx's log phase after the log module wrote the line (its handler runs first):
    /// there, a request's record is published as soon as it is known, and once more when
    /// the response begins with what a reply cut off then would be charged.
    pub fn logs_after_on_log(self) -> bool {
        self == HostKind::Envoy
    }

    /// Whether the root may dispatch a callout from another callout's response. On
    /// ngx_wasm_module that response runs in a temporary context freed when it returns: a
    /// callout dispatched there whose body cannot be sent at once resumes into the freed
    /// context and the worker dies (signal 11, seen with a 267 KB settlement batch sent on
    /// after an outage). There, the next batch waits for the tick.
    pub fn dispatches_from_callout_replies(self) -> bool {
        self == HostKind::Envoy
    }

    /// Whether `end_of_stream` on request headers can be trusted to say "no body".
    pub fn reports_end_of_stream_on_headers(self) -> bool {
        self == HostKind::Envoy
    }
}

/// Why a shared-data write did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedWriteError {
    /// Another worker wrote the key since it was read: read again and retry.
    CasMismatch,
    /// The host refused the write for another reason (full, not allowed...).
    Refused(String),
}

/// Who owns a callout: the request (cancelled with it) or the worker's root context
/// (outlives the request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    Request,
    Root,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}

/// The filter's counters, as the host exports them (`wasmcustom.<name>` in Envoy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Metric {
    Allowed,
    Limited,
    Unidentified,
    /// Callouts to the companion that failed or timed out (the filter's view; the
    /// companion's own series are `llm_ratelimit_companion_*`).
    CalloutFailures,
    /// Callouts the companion refused with 401: the filter's token is not the companion's.
    CalloutCredentialRefusals,
    TokensReserved,
    TokensCharged,
    SettlementsFailed,
    /// Requests decided without the companion, whatever `failure_mode` then did (decided
    /// locally, let through, refused with 503).
    DegradedDecisions,
    LeaseAdmissions,
    LeaseCallouts,
    Queued,
    /// Whole seconds the queued requests waited (see `Worker::count_queue_wait`).
    QueueWaitSeconds,
    Bypassed,
    ShadowRefusals,
    SharedWritesRefused,
    /// Requests `tokens.clamp_max_tokens` would have clamped but whose body is signed
    /// (Bedrock): reserved at their whole output cap instead.
    SignedNotClamped,
    /// Replies on which the provider refused a request for its own rate limits (429,
    /// Bedrock's ThrottlingException), with `provider_limits` on.
    ProviderRefusalsSeen,
    /// Requests answered here because the provider had said it refuses (a 429 until its
    /// retry time, a spent quota until its reset, a request larger than what is left).
    ProviderRefusalsAnswered,
    /// Requests sent as the one probe after a provider's retry time.
    ProviderProbes,
    /// Requests whose limits were charged lowered to what the provider said is left.
    ProviderLowered,
    /// Provider words taken from the fleet's exchange that changed what this proxy knew.
    ProviderFleetWords,
    /// Requests sent to `provider_limits.overflow` while the provider refused, instead of
    /// being answered here (by limit: `decision="overflowed"` of the decisions series).
    ProviderOverflowed,
    /// Requests refused because an owner's plan suspends it (also in `requests_limited`).
    Suspended,
}

impl Metric {
    pub const ALL: [Metric; 24] = [
        Metric::Allowed,
        Metric::Limited,
        Metric::Unidentified,
        Metric::CalloutFailures,
        Metric::CalloutCredentialRefusals,
        Metric::TokensReserved,
        Metric::TokensCharged,
        Metric::SettlementsFailed,
        Metric::DegradedDecisions,
        Metric::LeaseAdmissions,
        Metric::LeaseCallouts,
        Metric::Queued,
        Metric::QueueWaitSeconds,
        Metric::Bypassed,
        Metric::ShadowRefusals,
        Metric::SharedWritesRefused,
        Metric::SignedNotClamped,
        Metric::ProviderRefusalsSeen,
        Metric::ProviderRefusalsAnswered,
        Metric::ProviderProbes,
        Metric::ProviderLowered,
        Metric::ProviderFleetWords,
        Metric::ProviderOverflowed,
        Metric::Suspended,
    ];

    /// The counter's name, the same in Prometheus as in the host's own listing (Envoy's
    /// `/stats`: `wasmcustom.<name>`): counters end in `_total`, times are in seconds, and
    /// no name starts with `llm_ratelimit_companion_`, the companion's own prefix.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Allowed => "llm_ratelimit_requests_allowed_total",
            Metric::Limited => "llm_ratelimit_requests_limited_total",
            Metric::Unidentified => "llm_ratelimit_requests_unidentified_total",
            Metric::CalloutFailures => "llm_ratelimit_callout_failures_total",
            Metric::CalloutCredentialRefusals => "llm_ratelimit_callout_credential_refusals_total",
            Metric::TokensReserved => "llm_ratelimit_tokens_reserved_total",
            Metric::TokensCharged => "llm_ratelimit_tokens_charged_total",
            Metric::SettlementsFailed => "llm_ratelimit_settlements_failed_total",
            Metric::DegradedDecisions => "llm_ratelimit_degraded_decisions_total",
            Metric::LeaseAdmissions => "llm_ratelimit_lease_admissions_total",
            Metric::LeaseCallouts => "llm_ratelimit_lease_callouts_total",
            Metric::Queued => "llm_ratelimit_queued_requests_total",
            Metric::QueueWaitSeconds => "llm_ratelimit_queue_wait_seconds_total",
            Metric::Bypassed => "llm_ratelimit_requests_bypassed_total",
            Metric::ShadowRefusals => "llm_ratelimit_shadow_refusals_total",
            Metric::SharedWritesRefused => "llm_ratelimit_shared_writes_refused_total",
            Metric::SignedNotClamped => "llm_ratelimit_signed_requests_not_clamped_total",
            Metric::ProviderRefusalsSeen => "llm_ratelimit_provider_refusals_seen_total",
            Metric::ProviderRefusalsAnswered => "llm_ratelimit_provider_refusals_answered_total",
            Metric::ProviderProbes => "llm_ratelimit_provider_probes_total",
            Metric::ProviderLowered => "llm_ratelimit_provider_lowered_requests_total",
            Metric::ProviderFleetWords => "llm_ratelimit_provider_fleet_words_total",
            Metric::ProviderOverflowed => "llm_ratelimit_provider_overflowed_requests_total",
            Metric::Suspended => "llm_ratelimit_requests_suspended_total",
        }
    }
}

/// The host, as the core sees it.
pub trait Host {
    /// The proxy-wasm context this host acts for (a request's, or the root's).
    fn context_id(&self) -> u32;

    /// Nanoseconds since the epoch by the host's clock (0 if it will not say).
    fn now_nanos(&mut self) -> u128;

    fn request_header(&mut self, name: &str) -> Option<String>;
    /// Every value of a request header, as the host lists them (a header given twice is
    /// two entries, unless the host joined them: Envoy joins a repeated `authorization`
    /// with `,`). `request_header` gives only the first.
    fn request_header_values(&mut self, name: &str) -> Vec<String>;
    fn set_request_header(&mut self, name: &str, value: &str) -> bool;
    /// Removes every value of a request header.
    fn remove_request_header(&mut self, name: &str) -> bool;
    fn response_header(&mut self, name: &str) -> Option<String>;
    fn set_response_header(&mut self, name: &str, value: &str);
    fn request_body(&mut self, size: usize) -> Vec<u8>;
    fn replace_request_body(&mut self, size: usize, body: &[u8]) -> bool;
    fn response_body(&mut self, size: usize) -> Vec<u8>;
    fn replace_response_body(&mut self, size: usize, body: &[u8]) -> bool;

    /// A shared-data value (visible to every worker of this proxy) and its CAS.
    fn shared_get(&mut self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value` if the key's CAS is still `cas` (`None`: the key does not exist
    /// yet, on every host; Envoy also takes it as "overwrite").
    fn shared_set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SharedWriteError>;

    /// Sends an HTTP call (an empty `body`: none); returns its token.
    fn dispatch(
        &mut self,
        upstream: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
        owner: Owner,
    ) -> Result<u32, String>;
    /// The `:status` of the callout whose response is being delivered.
    fn callout_status(&mut self) -> Option<u32>;
    fn callout_body(&mut self, size: usize) -> Vec<u8>;

    fn resume_request(&mut self);
    fn send_reply(&mut self, reply: &LocalReply);
    /// Sets a property of the request (`path`'s segments), for the host's access log to
    /// read: false when the host refused it.
    fn set_property(&mut self, path: &[&str], value: &[u8]) -> bool;

    fn add_metric(&mut self, metric: Metric, amount: u64);
    /// Adds to a labelled counter: `series` indexes `series::names(config)`.
    fn add_series(&mut self, series: usize, amount: u64);
    fn set_gauge(&mut self, name: &str, value: u64);
    fn log(&mut self, level: LogLevel, message: &str);
    /// Logs a warning the first time `topic` comes up in this VM (for faults that would
    /// otherwise flood the log once per request).
    fn warn_once(&mut self, topic: &'static str, message: &str);

    /// The VM's environment variables (WASI `environ_get`): on Envoy those listed in
    /// `vm_config.environment_variables`, on ngx_wasm_module those the `env` directive
    /// keeps in the worker's environment. Read once, at configure.
    fn environment_variables(&mut self) -> Vec<(String, String)>;

    /// Milliseconds since the epoch.
    fn now_ms(&mut self) -> u64 {
        // Divided as a u64 (a clock fits one until 2554): a u128 division is a library
        // call costing hundreds of instructions, and the lifecycle reads the time often.
        let nanos = self.now_nanos();
        u64::try_from(nanos).map_or((nanos / 1_000_000) as u64, |nanos| nanos / 1_000_000)
    }
}

/// How often a read-modify-write is retried when other workers keep writing the key.
const MAX_CAS_ATTEMPTS: usize = 32;
/// Shared data written only to tell the hosts apart.
const PROBE_KEY: &str = "llmrl.host-probe";

/// Tells the hosts apart by the one difference the standard ABI shows before any request
/// (ngx_wasm_module answers no property outside a request, and some property reads crash
/// its workers there): a second write without CAS to a key is refused by
/// ngx_wasm_module, taken as an overwrite by Envoy.
pub fn detect_kind(host: &mut impl Host) -> HostKind {
    for _ in 0..2 {
        if host.shared_set(PROBE_KEY, b"1", None) == Err(SharedWriteError::CasMismatch) {
            return HostKind::Nginx;
        }
    }
    HostKind::Envoy
}

/// Every shared value starts with a fingerprint of its key: ngx_wasm_module matches keys
/// by their CRC32 alone, so two keys with the same checksum share one value (about a 1%
/// chance among 10,000 keys). A value whose fingerprint is not its key's reads as absent;
/// the next write replaces it.
pub const FINGERPRINT_BYTES: usize = 8;

fn fingerprint(key: &str) -> [u8; FINGERPRINT_BYTES] {
    // FNV-1a, 64 bits: independent of CRC32, so keys that collide there do not here.
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    hash.to_le_bytes()
}

/// The value stored under `key`, if it is this key's.
fn own_value<'a>(key: &str, stored: Option<&'a [u8]>) -> Option<&'a [u8]> {
    let stored = stored?;
    let (tag, value) = stored.split_at_checked(FINGERPRINT_BYTES)?;
    (tag == fingerprint(key)).then_some(value)
}

/// One read of a shared key: its value (if it is this key's) and the CAS a write based
/// on it must match.
pub struct SharedRead {
    key: String,
    stored: Option<Vec<u8>>,
    cas: Option<u32>,
}

impl SharedRead {
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn value(&self) -> Option<&[u8]> {
        own_value(&self.key, self.stored.as_deref())
    }
}

pub fn shared_get_read(host: &mut impl Host, key: String) -> SharedRead {
    let (stored, cas) = host.shared_get(&key);
    SharedRead { key, stored, cas }
}

/// Read-modify-write of one shared value under compare-and-swap, retried when another
/// worker wrote in between. `change` gets the current value and returns the new one (or
/// `None` to write nothing) and a result. `None` when the write was refused or the key
/// stayed too contended: that is counted (`shared_writes_refused`) and logged once, never
/// ignored. Every shared-data write of the filter goes through here: a write without the
/// key's CAS is refused by ngx_wasm_module once the key exists.
pub fn shared_update<R>(
    host: &mut impl Host,
    key: &str,
    change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, R),
) -> Option<R> {
    let read = shared_get_read(host, key.to_string());
    shared_update_from(host, read, change)
}

/// `shared_update` starting from a read the caller already made (each read is a host call
/// that copies the value into the VM: the hot path makes as few as it can).
pub fn shared_update_from<R>(
    host: &mut impl Host,
    mut read: SharedRead,
    mut change: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, R),
) -> Option<R> {
    for attempt in 0..MAX_CAS_ATTEMPTS {
        if attempt > 0 {
            (read.stored, read.cas) = host.shared_get(&read.key);
        }
        let (next, result) = change(read.value());
        let Some(next) = next else { return Some(result) };
        // In place where the value left room at its front (`tables::ENTRY_ROOM`).
        let mut tagged = next;
        tagged.splice(0..0, fingerprint(&read.key));
        match host.shared_set(&read.key, &tagged, read.cas) {
            Ok(()) => return Some(result),
            Err(SharedWriteError::CasMismatch) => continue,
            Err(SharedWriteError::Refused(why)) => {
                host.add_metric(Metric::SharedWritesRefused, 1);
                let message = format!(
                    "llm-ratelimit: the host refused a shared data write ({why}); counted in shared_writes_refused"
                );
                host.warn_once("shared-write-refused", &message);
                return None;
            }
        }
    }
    host.add_metric(Metric::SharedWritesRefused, 1);
    host.warn_once("shared-write-contended", "llm-ratelimit: a shared data key stayed too contended; update given up");
    None
}

/// Reads a shared value (absent if what is stored belongs to another key).
pub fn shared_read(host: &mut impl Host, key: &str) -> Option<Vec<u8>> {
    let (stored, _) = host.shared_get(key);
    own_value(key, stored.as_deref()).map(<[u8]>::to_vec)
}
