//! What the client sees: rate-limit headers on every response, and the local replies (429,
//! 401, 403, 413, 503), said here and wrapped in the caller's API's error shape
//! (`crate::replies::answers`), so existing SDKs parse them and back off.

use crate::api::dialect::Dialect;
use crate::api::refusal::Refusal;
use crate::config::{Callers, Dimension, Per, Policy, ProviderHeaders, TokenCount};
use crate::duration::{format_reset, reset_pieces};
use crate::protocol::{LimitCharge, LimitOutcome, LimitStatus, LimitsReply, Suspension};
use crate::providers::{self, ResetForm};
use crate::replies::answers::{error_reply, rfc3339, Caller};
use crate::replies::reply::{Header, HeaderValue, LocalReply};

/// Set on responses that passed without a limiter decision (companion unavailable and
/// `failure_mode: allow`), so operators and clients can tell.
pub const DEGRADED_HEADER: &str = "x-llm-ratelimit-degraded";
/// The tokens a request reserved (prompt counted in the proxy plus completion estimate).
pub const RESERVED_TOKENS_HEADER: &str = "x-llm-ratelimit-reserved-tokens";
/// In shadow mode, on a request that enforcement would have refused: the status it would
/// have had (`429`, `413`, `503`).
pub const SHADOW_HEADER: &str = "x-llm-ratelimit-shadow";
/// How long the request waited in the queue for capacity (ms).
pub const QUEUED_HEADER: &str = "x-llm-ratelimit-queued-ms";
/// On an admitted response, with `refusals.warn_below`: the budgets running low, by name
/// (`"monthly", "usd-day"` as `monthly, usd-day`).
pub const BUDGET_LOW_HEADER: &str = "x-llm-ratelimit-budget-low";

fn dimension_of(config: &Policy, outcome: &LimitOutcome) -> Dimension {
    config.limit(&outcome.name).map_or(Dimension::Requests, |l| l.dimension())
}

/// The rate-limit headers the policy writes (`config.headers`, decided at load): the
/// caller's provider's own (OpenAI's `x-ratelimit-*` or Anthropic's
/// `anthropic-ratelimit-*`, named by the provider's module), each named convention, and
/// the IETF `RateLimit-Policy` / `RateLimit` fields listing every limit. Every admitted
/// request writes them: each quota's tightest outcome is picked and its digits written.
pub fn rate_limit_headers(reply: &LimitsReply, config: &Policy, caller: Caller) -> Vec<Header> {
    let plan = &config.headers;
    let mut headers = Vec::with_capacity(12);
    for (p, provider) in plan.providers.iter().enumerate() {
        let wanted = match provider.to {
            Some(Callers::Every) => true,
            Some(Callers::TheProvidersOwn) => caller.dialect == provider.dialect,
            None => false,
        };
        if wanted {
            provider_headers(p, provider, reply, config, caller.now_ms, &mut headers);
        }
    }
    if plan.ietf {
        ietf_headers(reply, config, caller.now_ms, &mut headers);
    }
    if plan.classic {
        // The most restrictive: the smallest share of its limit left.
        let share = |o: &LimitOutcome| o.remaining as f64 / o.limit.max(1) as f64;
        let windowed = outcomes(reply, config).filter(|(limit, _)| plan.limit(*limit).windowed);
        if let Some((_, o)) = windowed.min_by(|(_, a), (_, b)| share(a).total_cmp(&share(b))) {
            headers.push(("x-ratelimit-limit", decimal(o.limit)));
            headers.push(("x-ratelimit-remaining", decimal(o.remaining)));
            headers.push(("x-ratelimit-reset", decimal(o.reset_after_ms.div_ceil(1000))));
        }
    }
    headers
}

/// Each outcome of `reply` with the index of its limit in `config` (`None`: a limit the
/// config does not name). A reply lists a request's limits in the config's order, so each
/// is looked for from just after the last one found, mostly at the first try.
fn outcomes<'r>(reply: &'r LimitsReply, config: &'r Policy) -> impl Iterator<Item = (Option<usize>, &'r LimitOutcome)> {
    let limits = &config.limits;
    let mut next = 0;
    reply.limits.iter().map(move |o| {
        let from = next.min(limits.len());
        let found = (from..limits.len()).chain(0..from).find(|&i| limits.get(i).is_some_and(|l| l.name == o.name));
        if let Some(i) = found {
            next = i + 1;
        }
        (found, o)
    })
}

/// Most quotas a provider's headers report on (a bit each in `LimitHeaders::quotas`).
const MAX_QUOTAS: usize = 8;

/// A provider's headers (the `p`th of the plan's), each quota's for the most restrictive
/// of the limits the plan says report on it: fewest left; on a tie, longest to reset; on
/// a tie again, the first. A money budget is none of them: the IETF and classic fields
/// cover it.
fn provider_headers(
    p: usize,
    provider: &ProviderHeaders,
    reply: &LimitsReply,
    config: &Policy,
    now_ms: u64,
    headers: &mut Vec<Header>,
) {
    let mut tightest: [Option<&LimitOutcome>; MAX_QUOTAS] = [None; MAX_QUOTAS];
    for (limit, o) in outcomes(reply, config) {
        let quotas = config.headers.limit(limit).quotas.get(p).copied().unwrap_or(0);
        let key = |o: &LimitOutcome| (o.remaining, std::cmp::Reverse(o.reset_after_ms));
        for (q, held) in tightest.iter_mut().enumerate() {
            if quotas & (1 << q) != 0 && held.is_none_or(|held| key(o) < key(held)) {
                *held = Some(o);
            }
        }
    }
    for (quota, o) in provider.names.quotas.iter().zip(tightest) {
        let Some(o) = o else { continue };
        headers.push((quota.limit, decimal(o.limit)));
        headers.push((quota.remaining, decimal(o.remaining)));
        if let Some(reset) = quota.reset {
            let when = match provider.names.reset {
                ResetForm::After => {
                    let mut when = HeaderValue::default();
                    reset_pieces(o.reset_after_ms, &mut |piece| when.push_str(piece));
                    when
                }
                ResetForm::At => rfc3339(now_ms.saturating_add(o.reset_after_ms).div_ceil(1000)).into(),
            };
            headers.push((reset, when));
        }
    }
}

/// A number as header text (every admitted request writes several), kept in place.
pub fn decimal(n: u64) -> HeaderValue {
    HeaderValue::from(itoa::Buffer::new().format(n))
}

fn ietf_headers(reply: &LimitsReply, config: &Policy, now_ms: u64, headers: &mut Vec<Header>) {
    let plan = &config.headers;
    let mut windowed = outcomes(reply, config).filter(|(limit, _)| plan.limit(*limit).windowed).peekable();
    if windowed.peek().is_none() {
        return;
    }
    // Each field written in one string as it goes (every response carries both), from
    // the items the policy made of each limit at load.
    let (mut policy, mut state) = (String::with_capacity(64), String::with_capacity(64));
    for (i, (index, o)) in windowed.enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        let limit = plan.limit(index);
        limit.write_policy_item(&mut policy, &o.name, o.limit, index.and_then(|i| config.limits.get(i)), now_ms);
        // `t` says when `r` is worth asking again: with nothing left, when a request fits
        // again (what `retry-after` says), not when the whole window has refilled, which
        // would keep a client that follows this header waiting many times too long.
        let wait = if o.remaining == 0 && o.retry_after_ms > 0 { o.retry_after_ms } else { o.reset_after_ms };
        limit.write_state_item(&mut state, &o.name, o.remaining, wait.div_ceil(1000));
    }
    headers.push(("ratelimit-policy", policy.into()));
    headers.push(("ratelimit", state.into()));
}

/// The 429 for a reply that was not allowed. It names the limit that binds longest; when
/// a limit can never fit the request it says so, gives no `Retry-After` and tells clients
/// not to retry (`Refusal::NeverFits`); when the limit frees the request only past the
/// retry horizon (`refusals.retry_horizon`: a budget spent until its period ends), it is
/// answered as a spent quota (`spent_refusal`). `charged` is what the request asked of
/// each limit (its plan's buckets).
pub fn rejection(reply: &LimitsReply, config: &Policy, charged: &[LimitCharge], caller: Caller) -> LocalReply {
    let never = reply.limits.iter().find(|o| o.status == LimitStatus::Never);
    let binding = never
        .or_else(|| reply.limits.iter().filter(|o| o.status == LimitStatus::Limited).max_by_key(|o| o.retry_after_ms));
    let headers = rate_limit_headers(reply, config, caller);
    let Some(outcome) = binding else {
        // Not allowed yet nothing limited: only an inconsistent reply gets here.
        let message = "Rate limit reached. Please try again in 1s.";
        return refuse(caller.dialect, Refusal::RateLimited("requests"), message, Some(1000), headers);
    };
    let limit_config = config.limit(&outcome.name);
    let dimension = dimension_of(config, outcome);
    let count = limit_config.and_then(|l| l.token_count()).unwrap_or_default();
    let window = limit_config.map_or(String::new(), |l| format!(" per {}", l.window_name()));
    let (name, limit) = (&outcome.name, outcome.limit);
    let needs = charged.iter().find(|b| b.name == *name).map_or(0, |b| b.cost);
    let retry = (outcome.status != LimitStatus::Never).then_some(outcome.retry_after_ms);
    // A slot frees when some request ends, however long the guess: concurrency is never spent.
    if outcome.status == LimitStatus::Limited
        && dimension != Dimension::Concurrency
        && outcome.retry_after_ms > config.refusals.retry_horizon_ms
    {
        let spent = Spent { outcome, limit: limit_config, dimension, count, window: &window, needs };
        return spent_refusal(&spent, config, caller, headers);
    }
    let message = match (outcome.status, dimension) {
        (LimitStatus::Never, Dimension::Tokens) => format!(
            "Request too large for limit \"{name}\": it needs {needs} {} ({}), but the limit allows {limit}{window}, so \
             it can never be admitted. Shorten the prompt or lower max_tokens.",
            count.name(),
            count.reservation()
        ),
        (LimitStatus::Never, Dimension::Cost) => format!(
            "Request too expensive for budget \"{name}\": it may cost more than the whole budget of {}{window}, so it \
             can never be admitted. Shorten the prompt or lower max_tokens.",
            usd(limit)
        ),
        (_, Dimension::Cost) => format!(
            "Budget reached: limit \"{name}\" allows {}{window}, {} left. Please try again in {}.",
            usd(limit),
            usd(outcome.remaining),
            format_reset(outcome.retry_after_ms)
        ),
        (LimitStatus::Never, Dimension::Requests | Dimension::Concurrency) => format!(
            "Request too large for limit \"{name}\": it allows {limit} requests{window}, so this request can never be admitted."
        ),
        (_, Dimension::Concurrency) => format!(
            "Concurrency limit reached: limit \"{name}\" allows {limit} requests in flight at once. Please try again \
             in {}.",
            format_reset(outcome.retry_after_ms)
        ),
        (_, Dimension::Tokens) if needs == 0 => format!(
            "Rate limit reached for {}: limit \"{name}\" allows {limit}{window}, and earlier requests used it up. \
             Please try again in {}.",
            count.name(),
            format_reset(outcome.retry_after_ms)
        ),
        (_, Dimension::Tokens) => format!(
            "Rate limit reached for {}: limit \"{name}\" allows {limit}{window}, {} left, and this request needs \
             {needs} ({}). Please try again in {}.",
            count.name(),
            outcome.remaining,
            count.reservation(),
            format_reset(outcome.retry_after_ms)
        ),
        (_, Dimension::Requests) => format!(
            "Rate limit reached for requests: limit \"{name}\" allows {limit}{window}. Please try again in {}.",
            format_reset(outcome.retry_after_ms)
        ),
    };
    let kind = if dimension == Dimension::Tokens { count.error_type() } else { dimension.name() };
    let refusal =
        if outcome.status == LimitStatus::Never { Refusal::NeverFits(kind) } else { Refusal::RateLimited(kind) };
    refuse(caller.dialect, refusal, &message, retry, headers)
}

/// The 403 for a caller its plan suspends (set at runtime by an operator): who is
/// suspended (the key, its team, its end user, every caller: by the limit the suspension
/// came through) and the operator's reason. No wait lifts it, so no `Retry-After`, and
/// `x-should-retry: false` stops the SDKs' retries.
pub fn suspension(suspension: &Suspension, config: &Policy, caller: Caller) -> LocalReply {
    let who = match config.limit(&suspension.limit).map(|l| &l.per) {
        Some(Per::Header { name, .. }) => format!("The {name} this request counts under is"),
        Some(Per::All) => "This service is".to_string(),
        Some(Per::EndUser { .. }) => "This end user is".to_string(),
        Some(Per::Tenant) | None => "This API key is".to_string(),
    };
    let message = format!("{who} suspended: {}. Contact the operator of this service.", suspension.reason);
    error_reply(caller.dialect, Refusal::Suspended, &message, None)
}

/// The limit a spent refusal names, and what the request asked of it.
struct Spent<'a> {
    outcome: &'a LimitOutcome,
    limit: Option<&'a crate::config::Limit>,
    dimension: Dimension,
    count: TokenCount,
    /// ` per 1d`, ` per calendar month (Europe/Amsterdam)`, or empty.
    window: &'a str,
    needs: u64,
}

/// The refusal of a request a limit frees only past the retry horizon: a budget spent
/// until its period ends, or one that refills too slowly for a retry to be worth it. It
/// says when the request fits again (a calendar budget: its period's end) and that
/// retrying sooner will not help; `x-should-retry: false` stops the SDKs' retries, and
/// the API's code for a spent quota tells a program apart from a per-minute limit. The
/// status is `refusals.spent_status`.
///
/// `Retry-After` stays, in whole seconds: it is true (when the request fits again), it is
/// HTTP's field for it on a 429 or 503, and a client that schedules by it learns when to
/// come back. `retry-after-ms`, which only times an SDK's retry, and Google's `RetryInfo`,
/// which asks its clients to retry, are left off.
fn spent_refusal(spent: &Spent, config: &Policy, caller: Caller, headers: Vec<Header>) -> LocalReply {
    let Spent { outcome, limit, dimension, count, window, needs } = *spent;
    let (name, wait_ms) = (&outcome.name, outcome.retry_after_ms);
    let frees_at = caller.now_ms.saturating_add(wait_ms);
    // A calendar budget frees at its period's boundary: the one nearest to the wait Redis
    // counted (by its clock, which may stand a little apart from the proxy's).
    let boundary = limit
        .map(|l| l.period_bounds_ms(caller.now_ms))
        .and_then(|bounds| bounds.into_iter().min_by_key(|b| b.abs_diff(frees_at)));
    let at = rfc3339(boundary.unwrap_or(frees_at).div_ceil(1000));
    let wait = format_reset(wait_ms);
    let amount = |n: u64| match dimension {
        Dimension::Cost => usd(n),
        Dimension::Tokens => format!("{n} {}", count.name()),
        Dimension::Requests | Dimension::Concurrency => format!("{n} requests"),
    };
    // A request needs one of a request limit: only other measures say what it asked.
    let asked = match (needs, dimension) {
        (0, _) | (_, Dimension::Requests | Dimension::Concurrency) => String::new(),
        (needs, Dimension::Tokens) => format!(", and this request needs {} ({})", amount(needs), count.reservation()),
        (needs, _) => format!(", and this request needs {}", amount(needs)),
    };
    let frees = match limit.and_then(|l| l.calendar.as_ref().map(|_| l.window_name())) {
        Some(period) => format!("It is full again when the {period} ends, at {at} (in {wait})"),
        None => format!("It has room for this request again at {at} (in {wait})"),
    };
    let message = format!(
        "Budget spent: limit \"{name}\" allows {}{window}, {} left{asked}. {frees}; retrying sooner will not help.",
        amount(outcome.limit),
        amount(outcome.remaining),
    );
    let refusal = Refusal::QuotaSpent { status: config.refusals.spent_status };
    let mut reply = error_reply(caller.dialect, refusal, &message, None);
    let retry_after = ("retry-after", decimal(retry_after_seconds(wait_ms)));
    reply.headers.splice(0..0, headers.into_iter().chain([retry_after]));
    reply
}

/// Warns the client on an admitted response (`refusals.warn_below`): the names of the
/// budgets that have less than that fraction of their capacity left, in one
/// `x-llm-ratelimit-budget-low` header. A budget is a cost limit, a calendar budget, or
/// any other limit (not concurrency) whose window is longer than the retry horizon: one
/// that, once spent, stays spent past what a retry waits.
pub fn budget_low(reply: &LimitsReply, config: &Policy, now_ms: u64) -> Option<Header> {
    let fraction = config.refusals.warn_below?;
    let low: Vec<&str> = reply
        .limits
        .iter()
        .filter(|o| {
            let Some(limit) = config.limit(&o.name) else { return false };
            let budget = match limit.dimension() {
                Dimension::Concurrency => false,
                Dimension::Cost => true,
                Dimension::Requests | Dimension::Tokens => {
                    limit.calendar.is_some() || limit.window_ms_at(now_ms) > config.refusals.retry_horizon_ms
                }
            };
            budget && (o.remaining as f64) < fraction * o.limit as f64
        })
        .map(|o| o.name.as_str())
        .collect();
    (!low.is_empty()).then(|| (BUDGET_LOW_HEADER, low.join(", ").into()))
}

/// A 429 in `dialect`'s shape with the rate-limit headers and, when a wait helps (`retry_ms`),
/// `retry-after` and `retry-after-ms`.
fn refuse(
    dialect: Dialect,
    refusal: Refusal,
    message: &str,
    retry_ms: Option<u64>,
    headers: Vec<Header>,
) -> LocalReply {
    let mut reply = error_reply(dialect, refusal, message, retry_ms.map(retry_after_seconds));
    reply.headers.splice(0..0, headers.into_iter().chain(retry_ms.into_iter().flat_map(retry_headers)));
    reply
}

/// `retry-after` in whole seconds (HTTP's), and `retry-after-ms`, which the OpenAI and
/// Anthropic SDKs read first, exact to the millisecond (at least 1).
fn retry_headers(ms: u64) -> [Header; 2] {
    [("retry-after", decimal(retry_after_seconds(ms))), ("retry-after-ms", decimal(ms.max(1)))]
}

/// On a response the provider's own word shaped (`provider_limits`): `refused` on a 429
/// the filter answered for the provider, `probe` on the one request sent after its retry
/// time, `lowered` when the request's limits were charged at what the provider said is left.
pub const PROVIDER_HEADER: &str = "x-llm-ratelimit-provider";

/// The backend a refused request was sent to instead of a 429 (`limits[].overflow`,
/// `provider_limits.overflow`): set on the request for the route table (Envoy) or a `map`
/// (Nginx) to match, and on its response for the client to see. A client's own is removed.
pub const OVERFLOW_HEADER: &str = "x-llm-ratelimit-overflow";

/// The 429 for a request the provider would refuse, as it said on an earlier reply: for
/// `wait_ms` more, and, when the request does not fit in what is left of a quota,
/// `short` names it (OpenAI's `error.type`, its name in words, what is left).
pub fn provider_refusal(dialect: Dialect, wait_ms: u64, short: Option<(&'static str, &str, u64)>) -> LocalReply {
    let wait = format_reset(wait_ms);
    let (kind, message) = match short {
        None => (
            "requests",
            format!(
                "The upstream provider is refusing requests for this API key and model: it answered an earlier \
                 request with its rate-limit error, or said its quota is spent. Please try again in {wait}."
            ),
        ),
        Some((kind, name, left)) => (
            kind,
            format!(
                "The upstream provider says {left} {name} are left for this API key and model until its limit \
                 resets, less than this request needs. Please try again in {wait}."
            ),
        ),
    };
    let mut reply = refuse(dialect, Refusal::RateLimited(kind), &message, Some(wait_ms), Vec::new());
    reply.headers.push((PROVIDER_HEADER, "refused".into()));
    reply
}

/// Micro-dollars as dollars: `$0.0035`, `$50.00`.
pub fn usd(micro: u64) -> String {
    let dollars = micro as f64 / 1e6;
    if dollars >= 1.0 {
        format!("${dollars:.2}")
    } else {
        format!("${}", format!("{dollars:.6}").trim_end_matches('0').trim_end_matches('.'))
    }
}

/// 403 for a request whose model has no price while a budget applies to it.
pub fn model_not_priced(model: &str, dialect: Dialect) -> LocalReply {
    let shown: String = model.chars().take(100).collect();
    let message =
        format!("The model \"{shown}\" has no price in this gateway's price table, so its budget cannot charge it.");
    error_reply(dialect, Refusal::NotPriced, &message, None)
}

/// 401 for a request without the identifying header, when the config says `reject`. It
/// names the credential the caller's own API uses.
pub fn missing_identity(dialect: Dialect) -> LocalReply {
    error_reply(dialect, Refusal::Unidentified, providers::missing_credential(dialect), None)
}

/// 400 for a request whose credentials disagree: the filter keys on none of them.
pub fn conflicting_credentials(dialect: Dialect) -> LocalReply {
    let message = "The request carries more than one credential (two credential headers that differ, or one header given twice). Send exactly one.";
    error_reply(dialect, Refusal::Unreadable("conflicting_credentials"), message, None)
}

/// 400 for a request that sends a header a limit is counted per (`limits[].per`) more
/// than once: hosts and whatever sets it may disagree on which copy counts.
pub fn repeated_pool_header(header: &str, dialect: Dialect) -> LocalReply {
    let message = format!("The request carries the header '{header}' more than once. Send it exactly once.");
    error_reply(dialect, Refusal::Unreadable("repeated_header"), &message, None)
}

/// 400 for a request a limit counts per end user that names none, where the limit has
/// no default user (`limits[].per.default`).
pub fn no_end_user(dialect: Dialect) -> LocalReply {
    let message = "This API key's requests are limited per end user, and this request names none: set `user` (or \
                   `safety_identifier`; Anthropic: `metadata.user_id`), or the header the operator configured.";
    error_reply(dialect, Refusal::Unreadable("missing_end_user"), message, None)
}

/// 400 for a body on an LLM path that cannot be read as its API's JSON, or that gives a
/// field the filter reads twice (`why` says which).
pub fn unreadable_body(why: &str, dialect: Dialect) -> LocalReply {
    // Bounded: the reason may quote the client's own key names.
    let why: String = why.chars().take(200).collect();
    let message = format!("The request body cannot be read as this API's JSON: {why}.");
    error_reply(dialect, Refusal::Unreadable("invalid_body"), &message, None)
}

/// 400 for a path this gateway does not limit (`unknown_paths: refuse`, or the Batch and
/// Realtime APIs).
pub fn path_refused(dialect: Dialect) -> LocalReply {
    let message = "This gateway does not forward requests on this path.";
    error_reply(dialect, Refusal::Unreadable("unsupported_path"), message, None)
}

/// 413 for a body too large to count.
pub fn body_too_large(limit: u64, dialect: Dialect) -> LocalReply {
    let message = format!("The request body is larger than the {limit} bytes this gateway reads to count tokens.");
    error_reply(dialect, Refusal::TooLarge, &message, None)
}

/// 503 when the limiter cannot decide and the config says `deny`.
pub fn limiter_unavailable(dialect: Dialect) -> LocalReply {
    let message = "The rate limiter is unavailable, so the request was not forwarded. Please try again shortly.";
    let mut reply = error_reply(dialect, Refusal::Unavailable, message, Some(1));
    reply.headers.splice(0..0, retry_headers(1000));
    reply
}

/// Whole seconds, rounded up and at least 1: a client that waits this long finds room.
pub fn retry_after_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HeaderPlan, HeaderStyle};

    fn config() -> Policy {
        let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [
            {"name": "rpm", "requests": 20, "window": "1m"},
            {"name": "rph", "requests": 100, "window": "1h"},
            {"name": "rpd", "requests": 1000, "window": "1d"},
            {"name": "tpm", "tokens": 10000, "window": "1m"},
            {"name": "inflight", "concurrency": 3}]}"#;
        Policy::from_json(json.as_bytes()).expect("config")
    }

    fn outcome(name: &str, status: LimitStatus, limit: u64, remaining: u64, reset: u64, retry: u64) -> LimitOutcome {
        LimitOutcome {
            name: name.into(),
            status,
            limit,
            remaining,
            reset_after_ms: reset,
            retry_after_ms: retry,
            charged: 0,
        }
    }

    /// A bucket of `cost` as the wire has it (fields it defaults left to their defaults).
    fn charge(name: &str, cost: u64) -> LimitCharge {
        let bucket = serde_json::json!({"name": name, "capacity": 1, "window_ms": 1, "cost": cost});
        serde_json::from_value(bucket).expect("a bucket")
    }

    fn header<'a>(headers: &'a [Header], name: &str) -> Option<&'a str> {
        headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn headers_describe_the_tightest_limit_of_each_dimension() {
        let reply = LimitsReply {
            allowed: true,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Allowed, 20, 7, 39_000, 0),
                outcome("rpd", LimitStatus::Allowed, 1000, 7, 600_000, 0),
                outcome("tpm", LimitStatus::Allowed, 10_000, 8_800, 7_200, 0),
            ],
            suspended: None,
        };
        let headers = rate_limit_headers(&reply, &config(), Caller::default());
        assert_eq!(header(&headers, "x-ratelimit-limit-requests"), Some("1000"));
        assert_eq!(header(&headers, "x-ratelimit-remaining-requests"), Some("7"));
        assert_eq!(header(&headers, "x-ratelimit-reset-requests"), Some("10m0s"));
        assert_eq!(header(&headers, "x-ratelimit-limit-tokens"), Some("10000"));
        assert_eq!(header(&headers, "x-ratelimit-remaining-tokens"), Some("8800"));
        assert_eq!(header(&headers, "x-ratelimit-reset-tokens"), Some("7.2s"));
        assert_eq!(
            header(&headers, "ratelimit-policy"),
            Some(r#""rpm";q=20;w=60, "rpd";q=1000;w=86400, "tpm";q=10000;w=60"#)
        );
        assert_eq!(header(&headers, "ratelimit"), Some(r#""rpm";r=7;t=39, "rpd";r=7;t=600, "tpm";r=8800;t=8"#));
    }

    #[test]
    fn concurrency_gets_its_own_headers_and_429() {
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Allowed, 20, 12, 24_000, 0),
                outcome("inflight", LimitStatus::Limited, 3, 0, 0, 800),
            ],
            suspended: None,
        };
        let reply = rejection(&reply, &config(), &[], Caller::default());
        assert_eq!(header(&reply.headers, "x-ratelimit-limit-concurrency"), Some("3"));
        assert_eq!(header(&reply.headers, "x-ratelimit-remaining-concurrency"), Some("0"));
        assert_eq!(header(&reply.headers, "retry-after"), Some("1"));
        assert!(!header(&reply.headers, "ratelimit-policy").unwrap_or("").contains("inflight"));
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["type"], "concurrency");
        assert!(body["error"]["message"].as_str().unwrap_or("").contains("3 requests in flight at once"));
    }

    #[test]
    fn header_styles_are_chosen_by_config() {
        let reply = LimitsReply {
            allowed: true,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Allowed, 20, 15, 15_000, 0),
                outcome("tpm", LimitStatus::Allowed, 10_000, 1_000, 54_000, 0),
            ],
            suspended: None,
        };
        let mut config = config();
        config.headers = HeaderPlan::new(&[HeaderStyle::Classic], &config.limits);
        let headers = rate_limit_headers(&reply, &config, Caller::default());
        let names: Vec<&str> = headers.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"]);
        // tpm has 10% left, rpm 75%: tpm is the most restrictive.
        assert_eq!(header(&headers, "x-ratelimit-limit"), Some("10000"));
        assert_eq!(header(&headers, "x-ratelimit-reset"), Some("54"));
        config.headers = HeaderPlan::new(&[HeaderStyle::Ietf], &config.limits);
        let headers = rate_limit_headers(&reply, &config, Caller::default());
        assert_eq!(header(&headers, "x-ratelimit-remaining-requests"), None);
        assert!(header(&headers, "ratelimit").is_some());
        config.headers = HeaderPlan::new(&[], &config.limits);
        assert!(rate_limit_headers(&reply, &config, Caller::default()).is_empty());
    }

    #[test]
    fn request_only_replies_carry_no_token_headers() {
        let reply = LimitsReply {
            allowed: true,
            waited_ms: 0,
            limits: vec![outcome("rpm", LimitStatus::Allowed, 20, 19, 3_000, 0)],
            suspended: None,
        };
        let headers = rate_limit_headers(&reply, &config(), Caller::default());
        assert_eq!(header(&headers, "x-ratelimit-remaining-tokens"), None);
        assert_eq!(header(&headers, "x-ratelimit-remaining-requests"), Some("19"));
    }

    #[test]
    fn a_429_names_the_limit_that_binds_longest() {
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Limited, 20, 0, 60_000, 2_500),
                outcome("rph", LimitStatus::Limited, 100, 0, 3_600_000, 36_001),
                outcome("rpd", LimitStatus::Allowed, 1000, 500, 100, 0),
            ],
            suspended: None,
        };
        let reply = rejection(&reply, &config(), &[], Caller::default());
        assert_eq!(reply.status, 429);
        assert_eq!(header(&reply.headers, "retry-after"), Some("37"));
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        assert_eq!(body["error"]["type"], "requests");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(message.contains("\"rph\" allows 100 per 1h0m0s"), "{message}");
        assert!(message.contains("try again in 36.001s"), "{message}");
    }

    #[test]
    fn a_token_429_says_what_the_request_needs() {
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Allowed, 20, 12, 24_000, 0),
                outcome("tpm", LimitStatus::Limited, 10_000, 300, 58_200, 5_400),
            ],
            suspended: None,
        };
        let reply = rejection(&reply, &config(), &[charge("tpm", 1_200)], Caller::default());
        assert_eq!(header(&reply.headers, "retry-after"), Some("6"));
        assert_eq!(header(&reply.headers, "x-ratelimit-remaining-tokens"), Some("300"));
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["type"], "tokens");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(message.contains("300 left, and this request needs 1200"), "{message}");
    }

    #[test]
    fn a_request_that_can_never_fit_gets_no_retry_after() {
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![
                outcome("rpm", LimitStatus::Limited, 20, 0, 60_000, 2_500),
                outcome("tpm", LimitStatus::Never, 10_000, 10_000, 0, 0),
            ],
            suspended: None,
        };
        let reply = rejection(&reply, &config(), &[charge("tpm", 12_000)], Caller::default());
        assert_eq!(reply.status, 429);
        assert_eq!(header(&reply.headers, "retry-after"), None);
        assert!(
            reply.body.contains("needs 12000 tokens") && reply.body.contains("can never be admitted"),
            "{}",
            reply.body
        );
    }

    #[test]
    fn a_budget_429_speaks_in_dollars() {
        let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [{"name": "day", "usd": 5, "window": "1d"}],
                       "prices": [{"match": "*", "input": 1, "output": 1}]}"#;
        let config = Policy::from_json(json.as_bytes()).expect("config");
        let reply = LimitsReply {
            allowed: false,
            waited_ms: 0,
            limits: vec![outcome("day", LimitStatus::Limited, 5_000_000, 1_250, 86_000_000, 3_000)],
            suspended: None,
        };
        let reply = rejection(&reply, &config, &[], Caller::default());
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["type"], "cost");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(message.contains("allows $5.00 per 24h0m0s, $0.00125 left"), "{message}");
        assert_eq!(header(&reply.headers, "x-ratelimit-remaining-requests"), None);
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        for (ms, seconds) in [(0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (59_999, 60)] {
            assert_eq!(retry_after_seconds(ms), seconds, "{ms}");
        }
    }

    #[test]
    fn other_local_replies_parse_as_openai_errors() {
        let cases = [
            (missing_identity(Dialect::OpenAi), 401, "missing_api_key"),
            (limiter_unavailable(Dialect::OpenAi), 503, "rate_limiter_unavailable"),
            (body_too_large(1024, Dialect::OpenAi), 413, "request_too_large"),
            (model_not_priced("m", Dialect::OpenAi), 403, "model_not_priced"),
        ];
        for (reply, status, code) in cases {
            assert_eq!(reply.status, status);
            let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
            assert_eq!(body["error"]["code"], code);
        }
    }

    fn replied(allowed: bool, limits: Vec<LimitOutcome>) -> LimitsReply {
        LimitsReply { allowed, waited_ms: 0, limits, suspended: None }
    }

    /// What an OpenAI caller has always seen: the exact body and headers, byte for byte.
    #[test]
    fn the_openai_429_is_unchanged() {
        let reply = replied(
            false,
            vec![
                outcome("rpm", LimitStatus::Limited, 20, 0, 60_000, 2_962),
                outcome("tpm", LimitStatus::Allowed, 10_000, 7_987, 12_100, 0),
            ],
        );
        let reply = rejection(&reply, &config(), &[charge("rpm", 1)], Caller { dialect: Dialect::OpenAi, now_ms: 5 });
        assert_eq!(reply.status, 429);
        // As JSON: the order of its keys follows serde_json's features in the build
        // (sorted in the filter's; tests/adversarial/test_oversized.py pins those bytes end to end).
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        let message = "Rate limit reached for requests: limit \"rpm\" allows 20 per 1m0s. Please try again in 2.962s.";
        assert_eq!(
            body,
            serde_json::json!({"error": {"message": message, "type": "requests", "param": null, "code": "rate_limit_exceeded"}})
        );
        let names: Vec<&str> = reply.headers.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
                "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens",
                "ratelimit-policy",
                "ratelimit",
                "retry-after",
                "retry-after-ms",
                "content-type"
            ]
        );
        assert_eq!(header(&reply.headers, "retry-after"), Some("3"));
        // What the OpenAI and Anthropic SDKs read first: the wait to the millisecond.
        assert_eq!(header(&reply.headers, "retry-after-ms"), Some("2962"));
        // The IETF header agrees with Retry-After where nothing is left (rpm: a request fits
        // in 2.962 s, though the window refills in 60 s); tpm, with room, says its reset.
        assert_eq!(header(&reply.headers, "ratelimit"), Some(r#""rpm";r=0;t=3, "tpm";r=7987;t=13"#));
    }

    #[test]
    fn each_apis_401_names_its_own_credential() {
        for (dialect, credential) in [
            (Dialect::OpenAi, "'Authorization: Bearer <key>'"),
            (Dialect::Anthropic, "'x-api-key'"),
            (Dialect::Google, "'x-goog-api-key'"),
            (Dialect::Bedrock, "AWS Signature Version 4"),
        ] {
            let reply = missing_identity(dialect);
            assert_eq!(reply.status, 401);
            assert!(reply.body.contains(credential), "{dialect:?}: {}", reply.body);
        }
        assert!(!missing_identity(Dialect::Anthropic).body.contains("Bearer"), "Anthropic callers send x-api-key");
    }

    fn dimensions_config() -> Policy {
        let json = r#"{"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [
            {"name": "rpm", "requests": 50, "window": "1m"},
            {"name": "tpm", "tokens": 96000, "window": "1m"},
            {"name": "itpm", "tokens": 80000, "window": "1m", "count": "input"},
            {"name": "otpm", "tokens": 16000, "window": "1m", "count": "output"},
            {"name": "ctpm", "tokens": 5000, "window": "1m", "count": "cached_input"}]}"#;
        Policy::from_json(json.as_bytes()).expect("config")
    }

    #[test]
    fn an_anthropic_caller_gets_anthropics_headers_with_times() {
        let reply = replied(
            true,
            vec![
                outcome("rpm", LimitStatus::Allowed, 50, 49, 1_200, 0),
                outcome("tpm", LimitStatus::Allowed, 96_000, 95_000, 625, 0),
                outcome("itpm", LimitStatus::Allowed, 80_000, 79_000, 750, 0),
                outcome("otpm", LimitStatus::Allowed, 16_000, 15_000, 3_750, 0),
                outcome("ctpm", LimitStatus::Allowed, 5_000, 5_000, 0, 0),
            ],
        );
        // 2026-12-01T15:37:00.500Z.
        let caller = Caller { dialect: Dialect::Anthropic, now_ms: 1_796_139_420_500 };
        let headers = rate_limit_headers(&reply, &dimensions_config(), caller);
        let expected = [
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-requests-reset", "2026-12-01T15:37:02Z"),
            ("anthropic-ratelimit-tokens-limit", "96000"),
            ("anthropic-ratelimit-tokens-remaining", "95000"),
            ("anthropic-ratelimit-tokens-reset", "2026-12-01T15:37:02Z"),
            ("anthropic-ratelimit-input-tokens-limit", "80000"),
            ("anthropic-ratelimit-input-tokens-remaining", "79000"),
            ("anthropic-ratelimit-input-tokens-reset", "2026-12-01T15:37:02Z"),
            ("anthropic-ratelimit-output-tokens-limit", "16000"),
            ("anthropic-ratelimit-output-tokens-remaining", "15000"),
            ("anthropic-ratelimit-output-tokens-reset", "2026-12-01T15:37:05Z"),
        ];
        for (name, value) in expected {
            assert_eq!(header(&headers, name), Some(value), "{name}");
        }
        assert_eq!(header(&headers, "x-ratelimit-remaining-requests"), None, "not OpenAI's");
        assert!(header(&headers, "ratelimit").is_some_and(|v| v.contains("\"ctpm\";r=5000")), "IETF lists every limit");
        // Named conventions apply whatever the caller: OpenAI's on an Anthropic caller,
        // its tokens headers for the tightest token limit of any count.
        let mut config = dimensions_config();
        config.headers = HeaderPlan::new(&[HeaderStyle::Openai], &config.limits);
        let headers = rate_limit_headers(&reply, &config, caller);
        assert_eq!(header(&headers, "x-ratelimit-remaining-tokens"), Some("5000"));
        assert_eq!(header(&headers, "anthropic-ratelimit-requests-limit"), None);
        // Google and Bedrock publish no rate-limit headers: the IETF ones only.
        for dialect in [Dialect::Google, Dialect::Bedrock] {
            let headers = rate_limit_headers(&reply, &dimensions_config(), Caller { dialect, now_ms: 0 });
            let names: Vec<&str> = headers.iter().map(|(n, _)| *n).collect();
            assert_eq!(names, ["ratelimit-policy", "ratelimit"], "{dialect:?}");
        }
    }

    #[test]
    fn a_429_says_which_tokens_ran_out_in_the_callers_shape() {
        let config = dimensions_config();
        let charged =
            [charge("rpm", 1), charge("tpm", 1_300), charge("itpm", 300), charge("otpm", 1_000), charge("ctpm", 0)];
        let refused =
            |name: &str, status: LimitStatus| replied(false, vec![outcome(name, status, 16_000, 200, 45_000, 3_000)]);
        let anthropic = Caller { dialect: Dialect::Anthropic, now_ms: 0 };
        let reply = rejection(&refused("otpm", LimitStatus::Limited), &config, &charged, anthropic);
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "rate_limit_error");
        let message = body["error"]["message"].as_str().expect("message");
        assert!(
            message.contains("Rate limit reached for output tokens: limit \"otpm\"")
                && message.contains("200 left, and this request needs 1000 (its completion allowance)"),
            "{message}"
        );
        assert_eq!(header(&reply.headers, "retry-after"), Some("3"));
        assert_eq!(header(&reply.headers, "anthropic-ratelimit-output-tokens-remaining"), Some("200"));
        let reply = rejection(&refused("itpm", LimitStatus::Never), &config, &charged, Caller::default());
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(body["error"]["type"], "input_tokens");
        assert!(body["error"]["message"].as_str().unwrap_or("").contains("needs 300 input tokens (its prompt)"));
        assert_eq!(header(&reply.headers, "retry-after"), None);
        let reply = rejection(&refused("ctpm", LimitStatus::Limited), &config, &charged, Caller::default());
        assert!(reply.body.contains("Rate limit reached for cached input tokens") && reply.body.contains("used it up"));
        assert!(reply.body.contains(r#""type":"cached_input_tokens""#), "{}", reply.body);
        let google = Caller { dialect: Dialect::Google, now_ms: 0 };
        let reply = rejection(&refused("tpm", LimitStatus::Limited), &config, &charged, google);
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        assert_eq!(
            (body["error"]["status"].as_str(), body["error"]["code"].as_u64()),
            (Some("RESOURCE_EXHAUSTED"), Some(429))
        );
        assert_eq!(body["error"]["details"][0]["retryDelay"], "3s");
        let bedrock = Caller { dialect: Dialect::Bedrock, now_ms: 0 };
        let reply = rejection(&refused("rpm", LimitStatus::Limited), &config, &charged, bedrock);
        assert_eq!(header(&reply.headers, "x-amzn-errortype"), Some("ThrottlingException"));
        assert_eq!(header(&reply.headers, "retry-after"), Some("3"));
    }

    fn refusals_config(refusals: serde_json::Value) -> Policy {
        let json = serde_json::json!({"companion": {"upstream": "c", "token": "test-token-0123456789"}, "limits": [
            {"name": "rpm", "requests": 20, "window": "1m"},
            {"name": "rpd", "requests": 1000, "window": "1d"},
            {"name": "tpd", "tokens": 100_000, "window": "1d"},
            {"name": "usd-day", "usd": 5, "window": "1d"},
            {"name": "monthly", "requests": 300, "window": {"calendar": "month", "time_zone": "Europe/Amsterdam"}},
            {"name": "inflight", "concurrency": 3}],
            "prices": [{"match": "*", "input": 1, "output": 1}], "refusals": refusals});
        Policy::from_json(json.to_string().as_bytes()).expect("config")
    }

    const DIALECTS: [Dialect; 4] = [Dialect::OpenAi, Dialect::Anthropic, Dialect::Google, Dialect::Bedrock];

    /// The error's kind as each shape names it: OpenAI's `error.code`, Anthropic's
    /// `error.type`, Google's `error.status`, Bedrock's `x-amzn-errortype`.
    fn kind_of(reply: &LocalReply, dialect: Dialect) -> String {
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        match dialect {
            Dialect::OpenAi => format!(
                "{}/{}",
                body["error"]["type"].as_str().unwrap_or(""),
                body["error"]["code"].as_str().unwrap_or("")
            ),
            Dialect::Anthropic => body["error"]["type"].as_str().unwrap_or("").to_string(),
            Dialect::Google => format!("{} {}", body["error"]["code"], body["error"]["status"].as_str().unwrap_or("")),
            Dialect::Bedrock => header(&reply.headers, "x-amzn-errortype").unwrap_or("").to_string(),
        }
    }

    fn message_of(reply: &LocalReply) -> String {
        let body: serde_json::Value = serde_json::from_str(&reply.body).expect("json body");
        let message = body["error"]["message"].as_str().or(body["message"].as_str());
        message.unwrap_or("").to_string()
    }

    #[test]
    fn a_request_that_can_never_fit_says_not_to_retry_in_every_shape() {
        let config = refusals_config(serde_json::json!({}));
        let reply = replied(false, vec![outcome("tpd", LimitStatus::Never, 100_000, 100_000, 0, 0)]);
        let expected =
            ["tokens/rate_limit_exceeded", "rate_limit_error", "429 RESOURCE_EXHAUSTED", "ThrottlingException"];
        for (dialect, kind) in DIALECTS.into_iter().zip(expected) {
            let refused = rejection(&reply, &config, &[charge("tpd", 120_000)], Caller { dialect, now_ms: 0 });
            assert_eq!(refused.status, 429, "{dialect:?}");
            assert_eq!(header(&refused.headers, "x-should-retry"), Some("false"), "{dialect:?}");
            assert_eq!(header(&refused.headers, "retry-after"), None, "{dialect:?}");
            assert_eq!(header(&refused.headers, "retry-after-ms"), None, "{dialect:?}");
            assert_eq!(kind_of(&refused, dialect), kind, "{dialect:?}");
            assert!(message_of(&refused).contains("can never be admitted"), "{dialect:?}");
            assert!(!refused.body.contains("RetryInfo"), "{dialect:?}: Google's clients retry on it");
        }
    }

    #[test]
    fn a_spent_calendar_budget_is_a_spent_quota_in_every_shape() {
        let config = refusals_config(serde_json::json!({}));
        // 2026-12-01T15:37:00Z; the month ends in Amsterdam at 2026-12-31T23:00:00Z.
        let now_ms = 1_796_139_420_000;
        let wait_ms = 1_798_758_000_000 - now_ms;
        let reply = replied(
            false,
            vec![
                outcome("rpm", LimitStatus::Allowed, 20, 19, 3_000, 0),
                outcome("monthly", LimitStatus::Limited, 300, 0, wait_ms, wait_ms),
            ],
        );
        let expected = [
            "insufficient_quota/insufficient_quota",
            "billing_error",
            "429 RESOURCE_EXHAUSTED",
            "ServiceQuotaExceededException",
        ];
        for (dialect, kind) in DIALECTS.into_iter().zip(expected) {
            let refused = rejection(&reply, &config, &[charge("monthly", 1)], Caller { dialect, now_ms });
            assert_eq!(refused.status, 429, "{dialect:?}");
            assert_eq!(kind_of(&refused, dialect), kind, "{dialect:?}");
            assert_eq!(header(&refused.headers, "x-should-retry"), Some("false"), "{dialect:?}");
            // When it frees, in HTTP's field; nothing that times an SDK's retry.
            assert_eq!(header(&refused.headers, "retry-after"), Some("2618580"), "{dialect:?}");
            assert_eq!(header(&refused.headers, "retry-after-ms"), None, "{dialect:?}");
            assert!(!refused.body.contains("RetryInfo"), "{dialect:?}");
            let message = message_of(&refused);
            assert!(
                message.contains(
                    "Budget spent: limit \"monthly\" allows 300 requests per calendar month (Europe/Amsterdam), \
                     0 requests left. It is full again when the calendar month \
                     (Europe/Amsterdam) ends, at 2026-12-31T23:00:00Z"
                ) && message.ends_with("retrying sooner will not help."),
                "{dialect:?}: {message}"
            );
        }
    }

    #[test]
    fn a_limit_that_frees_past_the_horizon_is_spent_and_one_within_it_is_unchanged() {
        let config = refusals_config(serde_json::json!({}));
        let refused_by = |name: &str, retry_ms: u64, config: &Policy| {
            let reply = replied(false, vec![outcome(name, LimitStatus::Limited, 100_000, 10, retry_ms, retry_ms)]);
            rejection(&reply, config, &[charge(name, 500)], Caller { dialect: Dialect::OpenAi, now_ms: 0 })
        };
        // A day's token budget that lets this request in only in an hour: spent.
        let spent = refused_by("tpd", 3_600_000, &config);
        assert_eq!(kind_of(&spent, Dialect::OpenAi), "insufficient_quota/insufficient_quota");
        let message = message_of(&spent);
        assert!(
            message.starts_with("Budget spent: limit \"tpd\" allows 100000 tokens per 24h0m0s, 10 tokens left, and this request needs 500 tokens (prompt and completion allowance). It has room for this request again at 1970-01-01T01:00:00Z (in 1h0m0s)"),
            "{message}"
        );
        assert_eq!(header(&spent.headers, "retry-after"), Some("3600"));
        // In dollars for a money budget.
        let money = refused_by("usd-day", 120_000, &config);
        let message = message_of(&money);
        assert!(
            message.contains("allows $0.1 per 24h0m0s, $0.00001 left, and this request needs $0.0005"),
            "{message}"
        );
        // The horizon itself and anything within it: the retryable 429 of old, to the byte.
        for retry_ms in [1, 59_999, 60_000] {
            let within = refused_by("tpd", retry_ms, &config);
            assert_eq!(kind_of(&within, Dialect::OpenAi), "tokens/rate_limit_exceeded", "{retry_ms}");
            assert_eq!(header(&within.headers, "x-should-retry"), None, "{retry_ms}");
            assert_eq!(header(&within.headers, "retry-after-ms"), Some(retry_ms.to_string().as_str()));
        }
        // A longer horizon keeps an hour's wait retryable.
        let patient = refusals_config(serde_json::json!({"retry_horizon": "2h"}));
        assert_eq!(kind_of(&refused_by("tpd", 3_600_000, &patient), Dialect::OpenAi), "tokens/rate_limit_exceeded");
        // A concurrency slot frees when a request ends, whatever the guess: never spent.
        let reply = replied(false, vec![outcome("inflight", LimitStatus::Limited, 3, 0, 0, 600_000)]);
        let slots = rejection(&reply, &config, &[], Caller::default());
        assert_eq!(kind_of(&slots, Dialect::OpenAi), "concurrency/rate_limit_exceeded");
        assert_eq!(header(&slots.headers, "x-should-retry"), None);
    }

    #[test]
    fn a_spent_budget_may_be_a_403() {
        let config = refusals_config(serde_json::json!({"spent_status": 403}));
        let reply = replied(false, vec![outcome("rpd", LimitStatus::Limited, 1000, 0, 86_000_000, 86_000_000)]);
        let expected = [
            "insufficient_quota/insufficient_quota",
            "billing_error",
            "403 PERMISSION_DENIED",
            "ServiceQuotaExceededException",
        ];
        for (dialect, kind) in DIALECTS.into_iter().zip(expected) {
            let refused = rejection(&reply, &config, &[], Caller { dialect, now_ms: 0 });
            assert_eq!((refused.status, kind_of(&refused, dialect)), (403, kind.to_string()), "{dialect:?}");
            assert_eq!(header(&refused.headers, "x-should-retry"), Some("false"), "{dialect:?}");
        }
        // A per-minute limit stays a 429; a request that never fits too.
        let reply = replied(false, vec![outcome("rpm", LimitStatus::Limited, 20, 0, 60_000, 3_000)]);
        assert_eq!(rejection(&reply, &config, &[], Caller::default()).status, 429);
        let reply = replied(false, vec![outcome("tpd", LimitStatus::Never, 100_000, 0, 0, 0)]);
        assert_eq!(rejection(&reply, &config, &[], Caller::default()).status, 429);
    }

    #[test]
    fn budgets_running_low_are_named_on_an_admission() {
        let admitted = replied(
            true,
            vec![
                // Per minute and concurrency: not budgets, however low.
                outcome("rpm", LimitStatus::Allowed, 20, 0, 60_000, 0),
                outcome("inflight", LimitStatus::Allowed, 3, 0, 0, 0),
                // A day's window, past the horizon: a budget, 9.9% left.
                outcome("rpd", LimitStatus::Allowed, 1000, 99, 86_000_000, 0),
                // 10% left exactly: not below.
                outcome("tpd", LimitStatus::Allowed, 100_000, 10_000, 86_000_000, 0),
                outcome("usd-day", LimitStatus::Allowed, 100_000, 1, 86_000_000, 0),
                outcome("monthly", LimitStatus::Allowed, 300, 29, 86_000_000, 0),
            ],
        );
        let config = refusals_config(serde_json::json!({"warn_below": 0.1}));
        assert_eq!(budget_low(&admitted, &config, 0), Some((BUDGET_LOW_HEADER, "rpd, usd-day, monthly".into())));
        // Off by default; and nothing said while every budget has enough.
        assert_eq!(budget_low(&admitted, &refusals_config(serde_json::json!({})), 0), None);
        let config = refusals_config(serde_json::json!({"warn_below": 0.01}));
        assert_eq!(budget_low(&admitted, &config, 0), Some((BUDGET_LOW_HEADER, "usd-day".into())));
        // A horizon longer than a day: a day's window is no budget, the calendar month still is.
        let config = refusals_config(serde_json::json!({"warn_below": 0.1, "retry_horizon": "1d"}));
        assert_eq!(budget_low(&admitted, &config, 0), Some((BUDGET_LOW_HEADER, "usd-day, monthly".into())));
    }

    /// Every header style and provider dialect, over limits of every kind (a calendar
    /// budget, tokens of each count, money, concurrency) and replies in config order, out
    /// of it, with ties, spent limits and a limit the config does not name: the headers as
    /// text, byte for byte, against `decision_headers.golden`. A change to what any client
    /// is sent fails here.
    #[test]
    fn rate_limit_headers_are_unchanged_to_the_byte() {
        const STYLES: [&str; 8] = [
            "[]",
            r#"["provider"]"#,
            r#"["openai"]"#,
            r#"["anthropic"]"#,
            r#"["ietf"]"#,
            r#"["classic"]"#,
            r#"["provider", "ietf"]"#,
            r#"["provider", "openai", "anthropic", "ietf", "classic"]"#,
        ];
        let config = |styles: &str| {
            let json = format!(
                r#"{{"companion": {{"upstream": "c", "token": "test-token-0123456789"}}, "headers": {styles},
                "prices": [{{"match": "*", "input": 1, "output": 1}}], "limits": [
                {{"name": "rpm", "requests": 50, "window": "1m"}},
                {{"name": "rpd", "requests": 1000, "window": "1d"}},
                {{"name": "tpm", "tokens": 96000, "window": "1m"}},
                {{"name": "itpm", "tokens": 80000, "window": "90s", "count": "input"}},
                {{"name": "otpm", "tokens": 16000, "window": "1m", "count": "output"}},
                {{"name": "ctpm", "tokens": 5000, "window": "1m", "count": "cached_input"}},
                {{"name": "usd-day", "usd": 5, "window": "1d"}},
                {{"name": "inflight", "concurrency": 3}},
                {{"name": "monthly", "requests": 300, "window": {{"calendar": "month", "time_zone": "Europe/Amsterdam"}}}}]}}"#
            );
            Policy::from_json(json.as_bytes()).expect("config")
        };
        let every = vec![
            outcome("rpm", LimitStatus::Allowed, 50, 49, 1_200, 0),
            outcome("rpd", LimitStatus::Allowed, 1000, 49, 86_399_001, 0),
            outcome("tpm", LimitStatus::Allowed, 96_000, 95_000, 625, 0),
            outcome("itpm", LimitStatus::Allowed, 80_000, 79_000, 750, 0),
            outcome("otpm", LimitStatus::Allowed, 16_000, 15_000, 3_750, 0),
            outcome("ctpm", LimitStatus::Allowed, 5_000, 5_000, 0, 0),
            outcome("usd-day", LimitStatus::Allowed, 5_000_000, 4_999_000, 86_000_000, 0),
            outcome("inflight", LimitStatus::Allowed, 3, 2, 0, 0),
            outcome("monthly", LimitStatus::Allowed, 300, 120, 1_000_000_000, 0),
        ];
        let replies = [
            ("every limit", every.clone()),
            ("none", vec![]),
            (
                "spent, ties, a lowered limit",
                vec![
                    outcome("rpm", LimitStatus::Limited, 50, 0, 60_000, 2_962),
                    outcome("rpd", LimitStatus::Allowed, 1000, 0, 59_000, 0),
                    outcome("tpm", LimitStatus::Allowed, 96_000, 0, 61_000, 0),
                    outcome("itpm", LimitStatus::Allowed, 40_000, 0, 61_000, 0),
                    outcome("otpm", LimitStatus::Never, 16_000, 16_000, 0, 0),
                    outcome("inflight", LimitStatus::Limited, 3, 0, 0, 800),
                ],
            ),
            ("out of order, one unknown", {
                let mut some = vec![every[4].clone(), every[0].clone(), every[7].clone()];
                some.push(outcome("elsewhere", LimitStatus::Allowed, 7, 3, 4_500, 0));
                some.push(every[2].clone());
                some
            }),
            ("concurrency and money only", vec![every[6].clone(), every[7].clone()]),
            (
                "u64 extremes",
                vec![outcome("tpm", LimitStatus::Allowed, u64::MAX, u64::MAX - 1, u64::MAX / 2, u64::MAX)],
            ),
        ];
        let mut text = String::new();
        for styles in STYLES {
            let config = config(styles);
            for (what, limits) in &replies {
                for dialect in DIALECTS {
                    // 2026-12-01T15:37:00.500Z, within a month of 31 days in Amsterdam.
                    let caller = Caller { dialect, now_ms: 1_796_139_420_500 };
                    let reply = replied(true, limits.clone());
                    text.push_str(&format!("== headers {styles}, {what}, {dialect:?}\n"));
                    for (name, value) in rate_limit_headers(&reply, &config, caller) {
                        text.push_str(&format!("{name}: {value}\n"));
                    }
                }
            }
        }
        let golden = include_str!("decision_headers.golden");
        if golden != text {
            let _ =
                std::fs::write(concat!(env!("CARGO_MANIFEST_DIR"), "/src/replies/decision_headers.golden.new"), &text);
        }
        assert!(golden == text, "the headers changed: see src/replies/decision_headers.golden.new");
    }
}
