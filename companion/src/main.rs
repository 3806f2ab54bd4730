//! The companion: a small stateless HTTP service through which llm-ratelimit's proxy-wasm
//! filter runs its Lua scripts in Redis, Valkey, Redis Cluster or Redis behind Sentinel.
//! The filter cannot open
//! TCP connections to Redis itself (proxy-wasm offers HTTP callouts only), so it calls
//! this service through a proxy upstream.
//!
//! Endpoints: `POST /v1/token_bucket` (a charge, of any kind of limit: the path predates
//! sliding windows and slots), `POST /v1/lease`, `POST /v1/settle`, `POST /v1/touch` and
//! `POST /v1/release`, `POST /v1/calibration` (JSON in and out, see
//! `llm_ratelimit_protocol`), `POST /v1/ledger` (a worker's spend-ledger batch, see
//! `ledger`); for operators, `POST /v1/usage` (where a tenant stands, charging nothing),
//! `POST /v1/admin/reset`, `GET /v1/admin/spend` (the ledger) and the plans' admin API
//! (`/v1/admin/plan`, `/v1/admin/plans`, see `plans`); `GET /healthz` and `GET /metrics`
//! (Prometheus). Every endpoint but `/healthz` and `/metrics` requires a credential in
//! `x-llmrl-token`: a data-plane one for the filter's endpoints, an admin one for usage
//! and reset (see `credentials`). Each runs `lua/limits.lua` (see `limits`) by EVALSHA, but the
//! calibration exchange, which runs `lua/calibration.lua`, and the ledger (`lua/ledger.lua`).

mod batcher;
mod calibration;
mod credentials;
mod ledger;
mod limits;
mod metrics;
mod plans;
mod pools;
mod provider;
mod queue;
mod refusals;
mod reservations;
mod sentinel;
mod store;

use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use batcher::Batcher;
use clap::Parser;
use credentials::{Credentials, Right};
use limits::Op;
use llm_ratelimit_protocol::duration::parse_duration;
use llm_ratelimit_protocol::ledger::{LedgerBatch, LEDGER_PATH, SPEND_PATH};
use llm_ratelimit_protocol::plan_admin::{HISTORY_PATH, IMPORT_PATH, MAX_IMPORT_BYTES, PLANS_PATH, PLAN_PATH};
use llm_ratelimit_protocol::{
    CalibrationExchange, ChargeRequest, LeaseRequest, ProviderExchange, ResetReply, SettleOutcome, SettleReply,
    SettlementBatch, TenantLimits, CALIBRATION_PATH, CHARGE_PATH, HEALTH_PATH, LEASE_PATH, PROVIDER_PATH, RELEASE_PATH,
    RESET_PATH, SETTLE_PATH, TOKEN_HEADER, TOUCH_PATH, USAGE_PATH,
};
use metrics::{MetricOp, Metrics, Outcome};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use store::{Access, Script, Store, Target};

#[derive(Parser, Debug)]
#[command(version, about = "Runs llm-ratelimit's Lua scripts in Redis for the proxy-wasm filter")]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "LLMRL_LISTEN", default_value = "127.0.0.1:8081")]
    listen: String,
    /// redis://host:port/db, rediss://..., redis+cluster://host:port,host:port for a cluster,
    /// or redis+sentinel://host:port,host:port/master-name[/db] (rediss+sentinel:// for TLS to
    /// the Sentinels and the data nodes) for the primary the Sentinels name, followed across
    /// failovers. A password in the URL (redis://user:password@host) works (on a Sentinel
    /// URL it is the data nodes'), but prefer LLMRL_REDIS_PASSWORD or --redis-password-file:
    /// there is no password flag, as a command line is visible to every user of the machine.
    /// Logged with its password masked.
    #[arg(long, env = "LLMRL_REDIS_URL", default_value = "redis://127.0.0.1:6379", hide_env_values = true)]
    redis_url: String,
    /// The Redis ACL user (default: the URL's, else Redis's `default`).
    #[arg(long, env = "LLMRL_REDIS_USERNAME")]
    redis_username: Option<String>,
    /// File holding the Redis password (trailing whitespace ignored); or set
    /// LLMRL_REDIS_PASSWORD.
    #[arg(long, env = "LLMRL_REDIS_PASSWORD_FILE", value_name = "FILE")]
    redis_password_file: Option<std::path::PathBuf>,
    /// redis+sentinel://: the Sentinels' ACL user, if they have one (the data nodes' is
    /// --redis-username).
    #[arg(long, env = "LLMRL_REDIS_SENTINEL_USERNAME")]
    redis_sentinel_username: Option<String>,
    /// redis+sentinel://: file holding the Sentinels' password (their `requirepass`;
    /// trailing whitespace ignored); or set LLMRL_REDIS_SENTINEL_PASSWORD. The data nodes'
    /// is LLMRL_REDIS_PASSWORD or --redis-password-file.
    #[arg(long, env = "LLMRL_REDIS_SENTINEL_PASSWORD_FILE", value_name = "FILE")]
    redis_sentinel_password_file: Option<std::path::PathBuf>,
    /// rediss://: the CA bundle (PEM) that signed the servers' certificates; default the
    /// system's trust store.
    #[arg(long, env = "LLMRL_REDIS_CA_FILE", value_name = "FILE")]
    redis_ca_file: Option<std::path::PathBuf>,
    /// rediss:// with client certificates: the companion's certificate (PEM).
    #[arg(long, env = "LLMRL_REDIS_CLIENT_CERT", value_name = "FILE", requires = "redis_client_key")]
    redis_client_cert: Option<std::path::PathBuf>,
    /// rediss:// with client certificates: its private key (PEM).
    #[arg(long, env = "LLMRL_REDIS_CLIENT_KEY", value_name = "FILE", requires = "redis_client_cert")]
    redis_client_key: Option<std::path::PathBuf>,
    /// Prefix of every key this service writes.
    #[arg(long, env = "LLMRL_KEY_PREFIX", default_value = "llmrl:")]
    key_prefix: String,
    /// Longest wait for one Redis call, and for a call's turn to be sent. A call may wait
    /// its turn and then run, so twice this stays below the filter's `companion.timeout`
    /// (50ms by default) with room for the hop.
    #[arg(long, env = "LLMRL_REDIS_TIMEOUT", default_value = "20ms", value_parser = parse_duration)]
    redis_timeout: Duration,
    /// Longest wait for Redis at start-up before giving up.
    #[arg(long, env = "LLMRL_STARTUP_WAIT", default_value = "30s", value_parser = parse_duration)]
    startup_wait: Duration,
    /// Threads serving requests. One serves a request start to end with no hand-over
    /// between threads; more use more cores.
    #[arg(long, env = "LLMRL_THREADS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    threads: u16,
    /// The data-plane credentials (what the filters send), comma-separated: several during
    /// a rotation. Prefer the environment variable or --token-file.
    #[arg(long, env = "LLMRL_COMPANION_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the data-plane credentials, one per line.
    #[arg(long, env = "LLMRL_COMPANION_TOKEN_FILE")]
    token_file: Option<std::path::PathBuf>,
    /// The admin credentials (usage, reset: what `llm-ratelimit` sends), comma-separated.
    /// Unset: the admin endpoints refuse every call.
    #[arg(long, env = "LLMRL_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// File holding the admin credentials, one per line.
    #[arg(long, env = "LLMRL_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<std::path::PathBuf>,
    /// Serve `GET /metrics` on this address only (not on --listen), e.g. a port that only
    /// the Prometheus scraper reaches. Unset: on --listen, like /healthz, without the token.
    #[arg(long, env = "LLMRL_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// How long the spend ledger keeps an owner's day after its last addition.
    #[arg(long, env = "LLMRL_LEDGER_RETENTION", default_value = "366d", value_parser = parse_duration)]
    ledger_retention: Duration,
    /// The models an owner's day in the ledger counts apart; further models are counted
    /// together as `other`.
    #[arg(long, env = "LLMRL_LEDGER_MAX_MODELS", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    ledger_max_models: u64,
}

/// The path Prometheus scrapes.
const METRICS_PATH: &str = "/metrics";

struct App {
    /// Every script call goes through it (`lua/limits.lua`, see `batcher`).
    batcher: Arc<Batcher>,
    credentials: Credentials,
    key_prefix: String,
    metrics: Arc<Metrics>,
    /// `lua/calibration.lua`, run alone (see `calibration`).
    calibration: Script,
    /// `lua/provider.lua`, run alone (see `provider`).
    provider: Script,
    /// `lua/ledger.lua`, once per owner of a batch (see `ledger`).
    ledger: Script,
    /// `lua/plans.lua`, an admin's change to a plan (see `plans`).
    plans: Script,
    keeping: ledger::Keeping,
    refusals: refusals::RefusalLog,
    /// This companion's waiters, by tenant (see `queue`).
    lines: Arc<queue::Lines>,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, [("content-type", "application/json")], json!({"error": message.into()}).to_string()).into_response()
}

fn authorised(app: &App, headers: &HeaderMap, right: Right) -> bool {
    let authorised = app.credentials.allow(right, headers.get(TOKEN_HEADER).map(|v| v.as_bytes()));
    if !authorised {
        app.metrics.auth_failures.inc();
        if let Some(line) = app.refusals.refused(headers.contains_key(TOKEN_HEADER), std::time::Instant::now()) {
            eprintln!("{line}");
        }
    }
    authorised
}

fn unauthorised() -> Response {
    error(StatusCode::UNAUTHORIZED, format!("missing or wrong {TOKEN_HEADER}"))
}

/// Parses and validates a JSON body, or says what is wrong with it (for a 400).
fn parse_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    validate: impl Fn(&T) -> Result<(), String>,
) -> Result<T, String> {
    let request: T = serde_json::from_slice(body).map_err(|err| format!("invalid request body: {err}"))?;
    validate(&request).map_err(|message| format!("invalid request: {message}"))?;
    Ok(request)
}

fn json_reply(value: impl serde::Serialize) -> Response {
    (StatusCode::OK, [("content-type", "application/json")], json!(value).to_string()).into_response()
}

/// A request that runs the script once and answers with its outcome per limit: a charge
/// or a lease.
trait LimitsCall: serde::de::DeserializeOwned {
    /// A charge that may wait for capacity, run by the queue; `None` for any other call.
    async fn charge_waiting(&self, _app: &App) -> Option<Result<llm_ratelimit_protocol::LimitsReply, String>> {
        None
    }
    fn check(&self) -> Result<(), String>;
    fn call(&self, prefix: &str) -> limits::Call;
    fn names(&self) -> Vec<&str>;
    /// How its decision is counted.
    fn metric_op(&self) -> MetricOp;
    /// Runs it: one script call (`Err` starting `redis:` when Redis failed).
    async fn decide(&self, app: &App) -> Result<llm_ratelimit_protocol::LimitsReply, String> {
        let value = app.batcher.decide(self.call(&app.key_prefix)).await.map_err(|err| format!("redis: {err}"))?;
        limits::reply(self.names().into_iter(), &value).map_err(|err| format!("unexpected script reply: {err}"))
    }
}

impl LimitsCall for ChargeRequest {
    async fn charge_waiting(&self, app: &App) -> Option<Result<llm_ratelimit_protocol::LimitsReply, String>> {
        let wait = self.wait.as_ref()?;
        Some(queue::charge_waiting(&app.batcher, &app.metrics, &app.lines, &app.key_prefix, self, wait).await)
    }

    fn check(&self) -> Result<(), String> {
        self.validate()
    }
    fn call(&self, prefix: &str) -> limits::Call {
        limits::charge(prefix, self)
    }
    fn names(&self) -> Vec<&str> {
        self.limits.iter().map(|l| l.name.as_str()).collect()
    }
    fn metric_op(&self) -> MetricOp {
        if self.wait.is_some() {
            MetricOp::Queue
        } else {
            MetricOp::Charge
        }
    }
    /// Split by owner on a cluster (see `pools`).
    async fn decide(&self, app: &App) -> Result<llm_ratelimit_protocol::LimitsReply, String> {
        pools::charge(&app.batcher, &app.key_prefix, self).await
    }
}

impl LimitsCall for LeaseRequest {
    fn check(&self) -> Result<(), String> {
        self.validate()
    }
    fn call(&self, prefix: &str) -> limits::Call {
        limits::lease(prefix, self)
    }
    fn names(&self) -> Vec<&str> {
        self.limits.iter().map(|l| l.name.as_str()).collect()
    }
    fn metric_op(&self) -> MetricOp {
        MetricOp::Lease
    }
    /// Split by owner on a cluster (see `pools`).
    async fn decide(&self, app: &App) -> Result<llm_ratelimit_protocol::LimitsReply, String> {
        pools::lease(&app.batcher, &app.key_prefix, self).await
    }
}

fn decided(app: &App, op: MetricOp, allowed: bool, reply: impl serde::Serialize) -> Response {
    app.metrics.decision(op, if allowed { Outcome::Allowed } else { Outcome::Limited });
    json_reply(reply)
}

fn failed(app: &App, op: MetricOp, status: StatusCode, message: String) -> Response {
    app.metrics.decision(op, Outcome::Error);
    error(status, message)
}

async fn run_limits<R: LimitsCall>(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if !authorised(&app, &headers, Right::DataPlane) {
        return unauthorised();
    }
    let request: R = match parse_body(&body, R::check) {
        Ok(request) => request,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let op = request.metric_op();
    if let Some(result) = request.charge_waiting(&app).await {
        return match result {
            Ok(reply) => decided(&app, op, reply.allowed, reply),
            Err(err) => failed(&app, op, StatusCode::SERVICE_UNAVAILABLE, err),
        };
    }
    match request.decide(&app).await {
        Ok(reply) => decided(&app, op, reply.allowed, reply),
        Err(err) if err.starts_with("redis:") => failed(&app, op, StatusCode::SERVICE_UNAVAILABLE, err),
        Err(err) => failed(&app, op, StatusCode::BAD_GATEWAY, err),
    }
}

/// Where a tenant stands on each limit, charging nothing (the script's peek).
async fn run_usage(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let request = match tenant_request(&app, &headers, &body) {
        Ok(request) => request,
        Err(response) => return *response,
    };
    let value = match app.batcher.decide(limits::tenant(&app.key_prefix, Op::Peek, &request)).await {
        Ok(value) => value,
        Err(err) => return failed(&app, MetricOp::Usage, StatusCode::SERVICE_UNAVAILABLE, format!("redis: {err}")),
    };
    let mut usage = match limits::usage(&request, &value) {
        Ok(usage) => usage,
        Err(err) => {
            return failed(&app, MetricOp::Usage, StatusCode::BAD_GATEWAY, format!("unexpected script reply: {err}"))
        }
    };
    let store = app.batcher.store();
    match reservations::count(store, &app.metrics, &app.key_prefix, &request.domain, &request.tenant).await {
        Ok((count, complete)) => (usage.reservations, usage.reservations_complete) = (count, complete),
        Err(err) => return failed(&app, MetricOp::Usage, StatusCode::SERVICE_UNAVAILABLE, format!("redis: {err}")),
    }
    let room = usage.limits.iter().all(|l| l.remaining > 0);
    decided(&app, MetricOp::Usage, room, usage)
}

/// Deletes a tenant's counters for the limits named: the tenant starts afresh. Logged
/// with the tenant id (a hash, never a credential) and the limits' names.
async fn run_reset(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let request = match tenant_request(&app, &headers, &body) {
        Ok(request) => request,
        Err(response) => return *response,
    };
    let deleted = match app.batcher.decide(limits::tenant(&app.key_prefix, Op::Reset, &request)).await {
        Ok(redis::Value::Array(items)) => match items.first() {
            Some(redis::Value::Int(n)) => u64::try_from(*n).unwrap_or(0),
            _ => return error(StatusCode::BAD_GATEWAY, "unexpected script reply to a reset".to_string()),
        },
        Ok(_) => return error(StatusCode::BAD_GATEWAY, "unexpected script reply to a reset".to_string()),
        Err(err) => return error(StatusCode::SERVICE_UNAVAILABLE, format!("redis: {err}")),
    };
    app.metrics.admin_resets.inc();
    let names: Vec<&str> = request.limits.iter().map(|l| l.name.as_str()).collect();
    eprintln!(
        "companion: admin reset of tenant {} in domain {}: limits {} ({deleted} counters deleted)",
        request.tenant,
        request.domain,
        names.join(", ")
    );
    json_reply(ResetReply { deleted })
}

/// An operator's request about one tenant, authorised and checked; or the answer saying
/// why not.
fn tenant_request(app: &App, headers: &HeaderMap, body: &[u8]) -> Result<TenantLimits, Box<Response>> {
    admin_only(app, headers)?;
    parse_body(body, TenantLimits::validate).map_err(|message| Box::new(error(StatusCode::BAD_REQUEST, message)))
}

/// Whether the call carries an admin credential; or the answer saying why not.
fn admin_only(app: &App, headers: &HeaderMap) -> Result<(), Box<Response>> {
    if !app.credentials.has_admin() {
        app.metrics.auth_failures.inc();
        return Err(Box::new(error(
            StatusCode::FORBIDDEN,
            "the admin endpoints are closed: the companion was started without an admin credential (LLMRL_ADMIN_TOKEN)",
        )));
    }
    if !authorised(app, headers, Right::Admin) {
        let given = headers.get(TOKEN_HEADER).map(|v| v.as_bytes());
        let data_plane = if app.credentials.allow(Right::DataPlane, given) {
            " (the one given is a data-plane credential, which cannot administer)"
        } else {
            ""
        };
        return Err(Box::new(error(
            StatusCode::UNAUTHORIZED,
            format!("missing or wrong {TOKEN_HEADER}: this endpoint takes an admin credential{data_plane}"),
        )));
    }
    Ok(())
}

/// Adds a proxy worker's ledger batch, each owner's part at most once (see `ledger`).
async fn run_ledger(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if !authorised(&app, &headers, Right::DataPlane) {
        return unauthorised();
    }
    let batch = match parse_body(&body, LedgerBatch::validate) {
        Ok(batch) => batch,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let started = std::time::Instant::now();
    let result = ledger::add(app.batcher.store(), &app.ledger, &app.key_prefix, app.keeping, &batch).await;
    app.metrics.redis_call(MetricOp::Ledger, started.elapsed());
    match result {
        Ok(reply) => decided(&app, MetricOp::Ledger, true, reply),
        Err(err) => failed(&app, MetricOp::Ledger, StatusCode::SERVICE_UNAVAILABLE, err),
    }
}

/// The spend ledger for a date range, grouped as asked: `GET SPEND_PATH?domain=llm&
/// from=2026-11-01&to=2026-11-30&by=team,model` (admin credential).
async fn run_spend(State(app): State<Arc<App>>, headers: HeaderMap, uri: axum::http::Uri) -> Response {
    if let Err(response) = admin_only(&app, &headers) {
        return *response;
    }
    let query = uri.query().unwrap_or("");
    let param = |name: &str| {
        query.split('&').find_map(|pair| {
            let (key, value) = pair.split_once('=')?;
            (key == name).then(|| value.replace("%2C", ",").replace("%2c", ","))
        })
    };
    let domain = param("domain").unwrap_or_else(|| "llm".to_string());
    if !llm_ratelimit_protocol::is_key_part(&domain) {
        return error(StatusCode::BAD_REQUEST, "domain must be 1-64 of [A-Za-z0-9_.-]");
    }
    let day = |name: &str| param(name).as_deref().and_then(llm_ratelimit_protocol::ledger::parse_day);
    let (Some(from), Some(to)) = (day("from"), day("to")) else {
        return error(StatusCode::BAD_REQUEST, "from and to are required, as YYYY-MM-DD");
    };
    let by: Vec<String> =
        param("by").map(|by| by.split(',').filter(|d| !d.is_empty()).map(str::to_string).collect()).unwrap_or_default();
    match ledger::spend(app.batcher.store(), &app.key_prefix, &domain, from, to, &by).await {
        Ok(reply) => decided(&app, MetricOp::Spend, true, reply),
        Err((false, message)) => error(StatusCode::BAD_REQUEST, message),
        Err((true, message)) => failed(&app, MetricOp::Spend, StatusCode::SERVICE_UNAVAILABLE, message),
    }
}

/// Settles the reservations of a batch (of any tenants), each at most once.
async fn run_settle(state: State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    run_adjustments(state, headers, body, Op::Settle).await
}

/// Releases the concurrency slots each entry names, ahead of their settlement.
async fn run_release(state: State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    run_adjustments(state, headers, body, Op::Release).await
}

/// Renews the concurrency slots each entry names (a heartbeat from the proxy holding them).
async fn run_touch(state: State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    run_adjustments(state, headers, body, Op::Touch).await
}

/// Runs an adjustment per entry, each its own call in the script (a settlement applied at
/// most once, by its reservation record) with its own outcome, batched (see `batcher`).
async fn run_adjustments(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes, op: Op) -> Response {
    if !authorised(&app, &headers, Right::DataPlane) {
        return unauthorised();
    }
    let metric_op = MetricOp::of_script(op);
    let request = match parse_body(&body, SettlementBatch::validate) {
        Ok(request) => request,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    // On a cluster a settlement of limits of several owners is one call per owner.
    let cluster = app.batcher.store().is_cluster();
    let parts: Vec<Vec<(limits::Call, Vec<usize>)>> =
        request.settlements.iter().map(|settlement| pools::adjust(&app.key_prefix, op, settlement, cluster)).collect();
    let calls = parts.iter().flatten().map(|(call, _)| call.clone()).collect();
    let mut replies = app.batcher.adjust(calls).await.into_iter();
    // How many entries failed with each error: a batch that fails fails whole, so one
    // line per error rather than one per entry (scripts/faults.py counts these lines).
    let mut failures: Vec<(String, usize)> = Vec::new();
    let (mut unbacked, mut capped) = (0usize, 0usize);
    let results = request
        .settlements
        .iter()
        .zip(parts)
        .map(|(settlement, parts)| {
            let replies = parts.into_iter().map(|(_, indices)| {
                let names = indices.iter().map(|&i| settlement.limits[i].name.as_str());
                let reply = replies.next().unwrap_or_else(|| Err("no reply".into()));
                (reply.and_then(|value| limits::reply(names, &value)), indices)
            });
            let outcome = pools::merged_adjustment(settlement, replies.collect());
            app.metrics.decision(metric_op, if outcome.is_ok() { Outcome::Allowed } else { Outcome::Error });
            match outcome {
                Ok(reply) if reply.allowed => {
                    if op == Op::Settle {
                        app.metrics.settlements_applied.inc();
                        refused_credits(&app, settlement, &reply, &mut unbacked, &mut capped);
                    }
                    SettleOutcome::Applied
                }
                Ok(_) => {
                    if op == Op::Settle {
                        app.metrics.settlements_dropped.inc();
                    }
                    SettleOutcome::AlreadySettled
                }
                Err(err) => {
                    match failures.iter_mut().find(|(known, _)| *known == err) {
                        Some((_, count)) => *count += 1,
                        None => failures.push((err, 1)),
                    }
                    SettleOutcome::Failed
                }
            }
        })
        .collect();
    for (err, count) in failures {
        eprintln!("companion: {} failed for {count} of {} entries: {err}", op.name(), request.settlements.len());
    }
    if unbacked + capped > 0 {
        eprintln!(
            "companion: settle: {unbacked} credit(s) refused with nothing behind them, {capped} cut to what their \
             reservation took (of {} entries)",
            request.settlements.len()
        );
    }
    json_reply(SettleReply { results })
}

/// Counts the credits of an applied settlement the script gave back less of than asked
/// (its `charged` is what it gave back): none at all is a credit with no debit behind it.
fn refused_credits(
    app: &App,
    settlement: &llm_ratelimit_protocol::Settlement,
    reply: &llm_ratelimit_protocol::LimitsReply,
    unbacked: &mut usize,
    capped: &mut usize,
) {
    for (asked, outcome) in settlement.limits.iter().zip(&reply.limits) {
        if asked.kind == llm_ratelimit_protocol::LimitKind::Slots || asked.credit <= 0 {
            continue;
        }
        let given = i64::try_from(outcome.charged).unwrap_or(i64::MAX);
        if given == 0 {
            app.metrics.credits_unbacked.inc();
            *unbacked += 1;
        } else if given < asked.credit {
            app.metrics.credits_capped.inc();
            *capped += 1;
        }
    }
}

/// Takes a proxy worker's new calibration samples and answers with the fleet's figures.
async fn run_calibration(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if !authorised(&app, &headers, Right::DataPlane) {
        return unauthorised();
    }
    let request = match parse_body(&body, CalibrationExchange::validate) {
        Ok(request) => request,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let started = std::time::Instant::now();
    let result = calibration::exchange(app.batcher.store(), &app.calibration, &app.key_prefix, &request).await;
    app.metrics.redis_call(MetricOp::Calibration, started.elapsed());
    match result {
        Ok(reply) => decided(&app, MetricOp::Calibration, true, reply),
        Err(err) => failed(&app, MetricOp::Calibration, StatusCode::SERVICE_UNAVAILABLE, err),
    }
}

/// Takes a proxy worker's news of the providers' limits and answers with the fleet's.
async fn run_provider(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if !authorised(&app, &headers, Right::DataPlane) {
        return unauthorised();
    }
    let request = match parse_body(&body, ProviderExchange::validate) {
        Ok(request) => request,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let started = std::time::Instant::now();
    let result = provider::exchange(app.batcher.store(), &app.provider, &app.key_prefix, &request).await;
    app.metrics.redis_call(MetricOp::Provider, started.elapsed());
    match result {
        Ok(reply) => decided(&app, MetricOp::Provider, true, reply),
        Err(err) => failed(&app, MetricOp::Provider, StatusCode::SERVICE_UNAVAILABLE, err),
    }
}

/// Readiness: Redis answers. A refused credential (a password rotated in Redis but not
/// here, an ACL change) is told apart from an unreachable Redis, and counted on its own.
async fn healthz(State(app): State<Arc<App>>) -> Response {
    match app.batcher.store().ping().await {
        Ok(()) => {
            (StatusCode::OK, [("content-type", "application/json")], json!({"redis": "ok"}).to_string()).into_response()
        }
        Err(err) if store::is_auth_failure(&err) => {
            app.metrics.redis_auth_failures.inc();
            let body =
                json!({"redis": "auth_failed", "error": format!("Redis refused the companion's credentials: {err}")});
            (StatusCode::SERVICE_UNAVAILABLE, [("content-type", "application/json")], body.to_string()).into_response()
        }
        Err(err) => error(StatusCode::SERVICE_UNAVAILABLE, format!("redis unreachable: {err}")),
    }
}

async fn metrics_text(State(metrics): State<Arc<Metrics>>) -> Response {
    let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    (StatusCode::OK, [("content-type", content_type)], metrics.render()).into_response()
}

fn read_file(flag: &str, path: &std::path::Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {flag} {}: {e}", path.display()))
}

/// A password from the environment variable `env` or the file of `flag`, not both.
fn secret(env: &str, flag: &str, file: Option<&std::path::Path>) -> Result<Option<String>, String> {
    let password = match (std::env::var(env).ok(), file) {
        (Some(_), Some(_)) => return Err(format!("give {env} or {flag}, not both")),
        (Some(password), None) => Some(password),
        (None, Some(path)) => Some(
            String::from_utf8(read_file(flag, path)?)
                .map_err(|_| format!("{flag}: not UTF-8 text"))?
                .trim_end()
                .to_string(),
        ),
        (None, None) => None,
    };
    if password.as_deref() == Some("") {
        return Err(format!("the password is empty ({env} or {flag})"));
    }
    Ok(password)
}

/// How to authenticate to Redis (and to its Sentinels) and, for rediss://, what TLS to use.
fn redis_access(args: &Args, target: &Target) -> Result<Access, String> {
    let password = secret("LLMRL_REDIS_PASSWORD", "--redis-password-file", args.redis_password_file.as_deref())?;
    let sentinel_password = secret(
        "LLMRL_REDIS_SENTINEL_PASSWORD",
        "--redis-sentinel-password-file",
        args.redis_sentinel_password_file.as_deref(),
    )?;
    let sentinel = matches!(target, Target::Sentinel(_));
    if !sentinel && (sentinel_password.is_some() || args.redis_sentinel_username.is_some()) {
        return Err("the Sentinel user and password need a redis+sentinel:// URL".into());
    }
    let tls = match target {
        Target::Single(url) => url.starts_with("rediss://"),
        Target::Cluster(nodes) => nodes.iter().any(|n| n.starts_with("rediss://")),
        Target::Sentinel(sentinels) => sentinels.tls,
    };
    let wants_tls = args.redis_ca_file.is_some() || args.redis_client_cert.is_some();
    if wants_tls && !tls {
        return Err("--redis-ca-file and --redis-client-cert need a rediss:// URL".into());
    }
    let certificates = if wants_tls {
        let root_cert = args.redis_ca_file.as_deref().map(|p| read_file("--redis-ca-file", p)).transpose()?;
        let client_tls = match (&args.redis_client_cert, &args.redis_client_key) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: read_file("--redis-client-cert", cert)?,
                client_key: read_file("--redis-client-key", key)?,
            }),
            _ => None,
        };
        Some(redis::TlsCertificates { client_tls, root_cert })
    } else {
        None
    };
    Ok(Access {
        username: args.redis_username.clone(),
        password,
        sentinel_username: args.redis_sentinel_username.clone(),
        sentinel_password,
        certificates,
    })
}

/// Redis may come up after us (a fresh stack, a restart): keep trying for a while. What
/// waiting cannot mend (a wrong password, a TLS setup the server refuses) ends the start
/// at once, saying so.
async fn connect(target: &Target, access: &Access, args: &Args) -> Result<Store, String> {
    let deadline = tokio::time::Instant::now() + args.startup_wait;
    loop {
        // A connection Redis takes without credentials may still refuse every command:
        // a PING tells (NOAUTH), before anything else is sent.
        let connected = match Store::connect(target, access, args.redis_timeout).await {
            Ok(store) => store.ping().await.map(|()| store),
            Err(err) => Err(err),
        };
        match connected {
            Ok(store) => return Ok(store),
            Err(err) if store::is_auth_failure(&err) && err.to_string().contains("Sentinels refused") => {
                return Err(format!(
                    "{err}: check the Sentinels' user and password (LLMRL_REDIS_SENTINEL_USERNAME, \
                     LLMRL_REDIS_SENTINEL_PASSWORD or --redis-sentinel-password-file)"
                ))
            }
            Err(err) if store::is_auth_failure(&err) => {
                return Err(format!(
                    "Redis refused the companion's credentials ({err}): check the user and password \
                     (LLMRL_REDIS_USERNAME, LLMRL_REDIS_PASSWORD or --redis-password-file, the URL's user:password@)"
                ))
            }
            Err(err) if err.to_string().contains("no Sentinel monitors") => {
                return Err(format!("{err}: check the master name at the end of the redis+sentinel:// URL"))
            }
            Err(err) if store::is_fatal(&err) => {
                return Err(format!(
                    "cannot connect to Redis ({err}): check the URL's scheme (rediss:// for TLS), \
                     --redis-ca-file and the client certificate"
                ))
            }
            Err(err) if tokio::time::Instant::now() < deadline => {
                eprintln!("companion: waiting for Redis: {err}");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(err) => return Err(format!("cannot reach Redis: {err}")),
        }
    }
}

async fn serve(args: Args) -> Result<(), String> {
    let credentials = Credentials::new(
        args.token.as_deref(),
        args.token_file.as_ref(),
        args.admin_token.as_deref(),
        args.admin_token_file.as_ref(),
    )?;
    let target = Target::parse(&args.redis_url).map_err(|e| format!("--redis-url: {e}"))?;
    let access = redis_access(&args, &target)?;
    if !args.key_prefix.chars().all(|c| c.is_ascii_graphic() && c != '{' && c != '}') {
        return Err("--key-prefix must be printable ASCII without '{' or '}'".into());
    }
    let store = connect(&target, &access, &args).await?;
    let script = Script::new("limits", limits::SOURCE);
    let calibration = Script::new("calibration", calibration::SOURCE);
    let provider = Script::new("provider", provider::SOURCE);
    let ledger_script = Script::new("ledger", ledger::SOURCE);
    let plans_script = Script::new("plans", plans::SOURCE);
    // Both loaded now, so a NOSCRIPT reload later means Redis lost them (the metric's alert).
    let deadline = tokio::time::Instant::now() + args.startup_wait;
    for script in [&script, &calibration, &provider, &ledger_script, &plans_script] {
        while let Err(err) = store.load(script).await {
            if store::is_fatal(&err) || tokio::time::Instant::now() >= deadline {
                return Err(format!("cannot load {}: {err}", script.name));
            }
            eprintln!("companion: retrying SCRIPT LOAD of {}: {err}", script.name);
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        eprintln!("companion: loaded {} ({})", script.name, script.sha);
    }
    let mode = match &target {
        Target::Single(_) => "single server".to_string(),
        Target::Cluster(nodes) => format!("cluster, {} seed node(s)", nodes.len()),
        Target::Sentinel(sentinels) => {
            format!("primary of {:?} named by {} Sentinel(s)", sentinels.master, sentinels.addresses.len())
        }
    };
    let mode = format!("{mode}, {}", store::redacted(&args.redis_url));
    let metrics = Arc::new(Metrics::new());
    let store = store.counting_reloads_in(metrics.noscript_reloads.clone());
    let batcher = Batcher::new(store, script, args.redis_timeout, metrics.clone());
    let (data_plane, admin) = credentials.counts();
    eprintln!("companion: {data_plane} data-plane credential(s), {admin} admin credential(s)");
    let app = Arc::new(App {
        batcher,
        credentials,
        key_prefix: args.key_prefix.clone(),
        metrics: metrics.clone(),
        calibration,
        provider,
        ledger: ledger_script,
        plans: plans_script,
        keeping: ledger::Keeping {
            retention_s: args.ledger_retention.as_secs().max(1),
            max_models: args.ledger_max_models,
        },
        refusals: refusals::RefusalLog::new(),
        lines: Arc::default(),
    });
    let metrics_router = Router::new().route(METRICS_PATH, get(metrics_text)).with_state(metrics);
    let router = Router::new()
        .route(CHARGE_PATH, post(run_limits::<ChargeRequest>))
        .route(SETTLE_PATH, post(run_settle))
        .route(TOUCH_PATH, post(run_touch))
        .route(RELEASE_PATH, post(run_release))
        .route(LEASE_PATH, post(run_limits::<LeaseRequest>))
        .route(CALIBRATION_PATH, post(run_calibration))
        .route(PROVIDER_PATH, post(run_provider))
        .route(USAGE_PATH, post(run_usage))
        .route(RESET_PATH, post(run_reset))
        .route(LEDGER_PATH, post(run_ledger))
        .route(SPEND_PATH, get(run_spend))
        .route(PLAN_PATH, get(plans::run_show).post(plans::run_set).delete(plans::run_delete))
        .route(PLANS_PATH, get(plans::run_list))
        .route(HISTORY_PATH, get(plans::run_history))
        .route(IMPORT_PATH, post(plans::run_import).layer(DefaultBodyLimit::max(MAX_IMPORT_BYTES)))
        .route(HEALTH_PATH, get(healthz))
        .with_state(app);
    let (router, metrics_server) = match &args.metrics_listen {
        None => (router.merge(metrics_router), None),
        Some(address) => {
            let listener = bind(address).await?;
            eprintln!("companion: metrics on {address}{METRICS_PATH}");
            (router, Some(tokio::spawn(run_server(listener, metrics_router))))
        }
    };
    let listener = bind(&args.listen).await?;
    eprintln!("companion: listening on {} (Redis: {mode})", args.listen);
    let served = run_server(listener, router).await;
    if let Some(metrics_server) = metrics_server {
        metrics_server.abort();
    }
    served
}

async fn bind(address: &str) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(address).await.map_err(|e| format!("cannot listen on {address}: {e}"))
}

async fn run_server(listener: tokio::net::TcpListener, router: Router) -> Result<(), String> {
    // Replies are small: without TCP_NODELAY, Nagle and delayed ACKs add ~40 ms.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| format!("server error: {e}"))
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    // rediss://: the one TLS crypto provider, for every connection (redis-rs builds its
    // rustls configs on the process default).
    let _ = rustls::crypto::ring::default_provider().install_default();
    // One thread by default: each request is a few microseconds of work between waits on
    // sockets, and handing it between threads (a futex wake, an eventfd write, another
    // thread scheduled) cost more than the work. Measured (the companion alone, wrk on the
    // same core): 0.075 ms p50 at one connection and 17,800 charges/s at 16, against
    // 0.085 ms and 15,200 with two threads.
    let runtime = match args.threads {
        1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        threads => {
            tokio::runtime::Builder::new_multi_thread().worker_threads(usize::from(threads)).enable_all().build()
        }
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("companion: cannot start the runtime: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("companion: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Args;
    use clap::CommandFactory;

    /// docs/companion.md's table of the companion's flags (`| flag | environment | default | … |`):
    /// each flag's environment variable and default are the ones the companion parses.
    #[test]
    fn the_docs_flag_table_states_the_defaults_and_variables_the_companion_parses() {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/companion.md"))
            .expect("docs/companion.md");
        let table =
            readme.split("| flag | environment | default | meaning |").nth(1).expect("the companion's flag table");
        let command = Args::command();
        let mut checked = 0;
        for row in table.lines().skip(2).take_while(|l| l.starts_with('|')) {
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            let (flags, env, default) = (cells[1], cells[2], cells[3]);
            for (flag, env) in flags.split(", ").zip(env.split(", ")).filter(|(f, _)| !f.is_empty()) {
                let name = flag.trim_matches('`').trim_start_matches("--");
                let arg =
                    command.get_arguments().find(|a| a.get_long() == Some(name)).unwrap_or_else(|| panic!("{flag}"));
                assert_eq!(arg.get_env().and_then(|e| e.to_str()), Some(env.trim_matches('`')), "{flag}");
                let parsed: Vec<String> =
                    arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
                match default.strip_prefix('`').and_then(|d| d.strip_suffix('`')) {
                    Some(stated) => assert_eq!(parsed, [stated], "{flag}"),
                    None => {
                        assert!(
                            parsed.is_empty(),
                            "{flag}: docs/companion.md states no default, the companion has {parsed:?}"
                        )
                    }
                }
                checked += 1;
            }
        }
        assert!(checked >= 15, "{checked} flags checked");
    }
}
