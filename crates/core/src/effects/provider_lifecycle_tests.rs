//! Requests' lives with `provider_limits` on, on both hosts of the fake host: a provider's
//! 429 answered here until its retry time (in the caller's API's shape, with the
//! provider's time), one probe after it, a spent quota until its reset, Google's retry
//! time read from the error body, a limit lowered to what the provider says is left, and
//! the fleet giving the probe to one proxy.

use crate::effects::host::{HostKind, Metric};
use crate::protocol::{
    ChargeRequest, ProbeBy, ProviderEntry, ProviderExchange, ProviderReply, CHARGE_PATH, PROVIDER_PATH,
};
use crate::testing::{advance, usage_reply, FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::{json, Value};

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];
const BODY: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}],"max_tokens":50}"#;

fn config(share: bool) -> String {
    json!({"companion": {"upstream": "companion", "token": "test-token-0123456789"}, "failure_mode": "deny",
           "limits": [{"name": "rpm", "requests": 1000, "window": "1m"}, {"name": "tpm", "tokens": 100000, "window": "1m"}],
           "provider_limits": {"enabled": true, "share": share}})
    .to_string()
}

fn header<'a>(flight: &'a InFlight, name: &str) -> Option<&'a str> {
    let reply = flight.replied()?;
    reply.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
}

fn ok(proxy: &mut Proxy, flight: &mut InFlight, headers: &[(&str, &str)]) {
    let body = usage_reply(10, 5);
    proxy.reply_with_headers(flight, 200, "application/json", headers, &[body.as_bytes()]);
}

fn charges(companion: &FakeCompanion) -> usize {
    companion.calls.get(CHARGE_PATH).copied().unwrap_or(0)
}

#[test]
fn a_providers_429_is_answered_here_until_its_retry_time_then_one_probe_goes() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(false));
        let mut companion = FakeCompanion::default();
        let mut first = proxy.send(Request::chat("sk-a", BODY), &mut companion);
        assert!(first.forwarded(), "{kind:?}");
        // OpenAI's 429: no retry-after, its reset header says when (Go's duration).
        let refusal =
            r#"{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
        let headers = [("x-ratelimit-remaining-requests", "0"), ("x-ratelimit-reset-requests", "5s")];
        proxy.reply_with_headers(&mut first, 429, "application/json", &headers, &[refusal.as_bytes()]);
        assert_eq!(first.host.metric(Metric::ProviderRefusalsSeen), 1);
        let before = charges(&companion);
        let second = proxy.send(Request::chat("sk-a", BODY), &mut companion);
        let reply = second.replied().expect("answered here");
        assert_eq!(reply.status, 429, "{kind:?}");
        let body: Value = serde_json::from_str(&reply.body).expect("json");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded", "OpenAI's shape for an OpenAI caller");
        assert_eq!(header(&second, "retry-after"), Some("5"), "the provider's own time");
        assert_eq!(header(&second, "retry-after-ms"), Some("5000"));
        assert_eq!(header(&second, "x-llm-ratelimit-provider"), Some("refused"));
        assert_eq!(second.host.metric(Metric::ProviderRefusalsAnswered), 1);
        assert_eq!(charges(&companion), before, "nothing charged for a request the provider would refuse");
        // Another credential is not held up by this one's refusal.
        assert!(proxy.send(Request::chat("sk-b", BODY), &mut companion).forwarded());
        advance(&world, 5_000);
        let mut probe = proxy.send(Request::chat("sk-a", BODY), &mut companion);
        assert!(probe.forwarded(), "the retry time passed: the probe goes");
        assert_eq!(probe.host.metric(Metric::ProviderProbes), 1);
        let waiting = proxy.send(Request::chat("sk-a", BODY), &mut companion);
        assert_eq!(waiting.replied().map(|r| r.status), Some(429), "one probe at a time");
        assert_eq!(header(&waiting, "retry-after"), Some("1"));
        ok(&mut proxy, &mut probe, &[]);
        assert_eq!(
            probe.host.response_header_value("x-llm-ratelimit-provider"),
            Some("probe"),
            "the probe's response says it was one"
        );
        assert!(proxy.send(Request::chat("sk-a", BODY), &mut companion).forwarded(), "{kind:?}: the provider is back");
    }
}

#[test]
fn a_spent_quota_is_answered_until_its_reset_in_anthropics_shape() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(false));
        let mut companion = FakeCompanion::default();
        let anthropic = |key: &str| {
            let body = r#"{"model":"claude-sonnet-4-5","max_tokens":50,"messages":[{"role":"user","content":"hi"}]}"#;
            let mut request = Request::chat(key, body);
            request.headers.retain(|(n, _)| n != "authorization" && n != ":path");
            request.header(":path", "/v1/messages").header("x-api-key", key)
        };
        let mut first = proxy.send(anthropic("sk-ant"), &mut companion);
        assert!(first.forwarded());
        // A success that spends the last request: Anthropic's reset is an RFC 3339 time.
        let reset = crate::replies::answers::rfc3339(proxy.now() / 1000 + 30);
        let headers =
            [("anthropic-ratelimit-requests-remaining", "0"), ("anthropic-ratelimit-requests-reset", reset.as_str())];
        let reply = r#"{"id":"m","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[],"usage":{"input_tokens":5,"output_tokens":3}}"#;
        proxy.reply_with_headers(&mut first, 200, "application/json", &headers, &[reply.as_bytes()]);
        let second = proxy.send(anthropic("sk-ant"), &mut companion);
        let answered = second.replied().expect("answered here");
        let body: Value = serde_json::from_str(&answered.body).expect("json");
        assert_eq!((answered.status, body["error"]["type"].as_str()), (429, Some("rate_limit_error")), "{kind:?}");
        let wait: u64 = header(&second, "retry-after").and_then(|v| v.parse().ok()).expect("retry-after");
        assert!((29..=30).contains(&wait), "until the provider's reset: {wait}");
        advance(&world, 30_000);
        assert!(proxy.send(anthropic("sk-ant"), &mut companion).forwarded(), "past the reset: no probe needed");
    }
}

/// A Gemini `generateContent` request, its key where Google reads it.
fn gemini_request() -> Request {
    let body = r#"{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}"#;
    let mut request = Request::chat("g", body);
    request.headers.retain(|(n, _)| n != "authorization" && n != ":path");
    request.header(":path", "/v1beta/models/gemini-2.5-flash:generateContent").header("x-goog-api-key", "AIza-test")
}

#[test]
fn googles_retry_time_is_read_from_the_error_body() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(false));
        let mut companion = FakeCompanion::default();
        let mut first = proxy.send(gemini_request(), &mut companion);
        assert!(first.forwarded());
        let error = r#"{"error":{"code":429,"message":"Resource has been exhausted","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"22s"}]}}"#;
        let (a, b) = error.split_at(40);
        proxy.reply_with_headers(&mut first, 429, "application/json", &[], &[a.as_bytes(), b.as_bytes()]);
        let second = proxy.send(gemini_request(), &mut companion);
        let answered = second.replied().expect("answered here");
        let body: Value = serde_json::from_str(&answered.body).expect("json");
        assert_eq!(body["error"]["status"], "RESOURCE_EXHAUSTED", "{kind:?}: Google's shape");
        assert_eq!(body["error"]["details"][0]["retryDelay"], "22s", "the provider's RetryInfo, passed on");
        assert_eq!(header(&second, "retry-after"), Some("22"));
    }
}

/// Issue 46: whether Google's RetryInfo is read from a throttling body is the provider's
/// business (the path says Gemini), not the answer's shape: with `error_format: openai` in
/// front of Gemini it was never read, and the next request went upstream to be refused.
#[test]
fn googles_retry_time_is_read_whatever_shape_the_answers_take() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut written: Value = serde_json::from_str(&config(false)).expect("json");
        written["error_format"] = json!("openai");
        let mut proxy = Proxy::new(&world, &written.to_string());
        let mut companion = FakeCompanion::default();
        let mut first = proxy.send(gemini_request(), &mut companion);
        assert!(first.forwarded());
        let error = r#"{"error":{"code":429,"message":"Resource has been exhausted","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"22s"}]}}"#;
        proxy.reply_with_headers(&mut first, 429, "application/json", &[], &[error.as_bytes()]);
        let second = proxy.send(gemini_request(), &mut companion);
        let answered = second.replied().expect("answered here, from the provider's retry time");
        let body: Value = serde_json::from_str(&answered.body).expect("json");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{kind:?}: OpenAI's shape, as configured");
        assert_eq!(header(&second, "retry-after"), Some("22"), "{kind:?}");
    }
}

#[test]
fn a_limit_is_charged_lowered_to_what_the_provider_says_is_left() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(false));
        let mut companion = FakeCompanion::default();
        let mut first = proxy.send(Request::chat("sk-low", BODY), &mut companion);
        ok(&mut proxy, &mut first, &[("x-ratelimit-remaining-tokens", "4000"), ("x-ratelimit-reset-tokens", "30s")]);
        let second = proxy.send(Request::chat("sk-low", BODY), &mut companion);
        assert!(second.forwarded());
        let charge: ChargeRequest = serde_json::from_value(second.host.last_callout().body.clone()).expect("charge");
        let tpm = charge.limits.iter().find(|l| l.name == "tpm").expect("tpm");
        assert_eq!((tpm.capacity, tpm.window_ms), (4_000, 2_400), "{kind:?}: lowered, at the configured refill rate");
        let rpm = charge.limits.iter().find(|l| l.name == "rpm").expect("rpm");
        assert_eq!(rpm.capacity, 1000, "a quota the provider did not mention stays as configured");
        assert_eq!(second.host.metric(Metric::ProviderLowered), 1);
        advance(&world, 30_000);
        let third = proxy.send(Request::chat("sk-low", BODY), &mut companion);
        let charge: ChargeRequest = serde_json::from_value(third.host.last_callout().body.clone()).expect("charge");
        assert_eq!(charge.limits.iter().find(|l| l.name == "tpm").map(|l| l.capacity), Some(100_000), "past its reset");
    }
}

#[test]
fn the_fleet_gives_the_probe_to_one_proxy() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(true));
        let mut companion = FakeCompanion::default();
        let mut first = proxy.send(Request::chat("sk-f", BODY), &mut companion);
        proxy.reply_with_headers(&mut first, 429, "application/json", &[("retry-after", "2")], &[b"{}"]);
        // The next tick hands the refusal to the fleet.
        proxy.tick(None);
        let exchange = proxy.root.callouts.iter().rev().find(|c| c.path == PROVIDER_PATH).expect("an exchange").clone();
        let sent: ProviderExchange = serde_json::from_value(exchange.body.clone()).expect("exchange");
        assert_eq!(sent.reports.len(), 1, "{kind:?}");
        let report = &sent.reports[0];
        assert!(report.refused && report.out_until_ms > proxy.now());
        advance(&world, 2_000);
        // Past the retry time, the fleet has not said who probes: this proxy waits.
        assert_eq!(proxy.send(Request::chat("sk-f", BODY), &mut companion).replied().map(|r| r.status), Some(429));
        let entry = |probe, probe_until_ms| ProviderEntry {
            key: report.key.clone(),
            said_ms: report.said_ms,
            out_until_ms: report.out_until_ms,
            refused: true,
            probe,
            probe_until_ms,
            left: report.left.clone(),
        };
        let reply = |entry| serde_json::to_vec(&ProviderReply { entries: vec![entry] }).expect("json");
        let until = proxy.now() + 2_000;
        proxy.root_answer(exchange.token, 200, reply(entry(ProbeBy::Another, until)));
        assert_eq!(
            proxy.send(Request::chat("sk-f", BODY), &mut companion).replied().map(|r| r.status),
            Some(429),
            "{kind:?}: another proxy probes"
        );
        // A later exchange gives it to this proxy: one request goes, and the fleet hears so.
        advance(&world, 2_000);
        proxy.tick(None);
        let exchange = proxy.root.callouts.iter().rev().find(|c| c.path == PROVIDER_PATH).expect("exchange").clone();
        let until = proxy.now() + 2_000;
        proxy.root_answer(exchange.token, 200, reply(entry(ProbeBy::You, until)));
        assert!(proxy.send(Request::chat("sk-f", BODY), &mut companion).forwarded(), "{kind:?}: the probe");
        assert_eq!(proxy.send(Request::chat("sk-f", BODY), &mut companion).replied().map(|r| r.status), Some(429));
        advance(&world, 300);
        proxy.tick(None);
        let probing = proxy.root.callouts.iter().rev().find(|c| c.path == PROVIDER_PATH).expect("exchange");
        let sent: ProviderExchange = serde_json::from_value(probing.body.clone()).expect("exchange");
        assert!(sent.reports.iter().any(|r| r.probing), "the fleet learns the probe went out");
    }
}

#[test]
fn another_error_says_nothing_of_the_providers_limits() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(false));
        let mut companion = FakeCompanion::default();
        let mut refused = proxy.send(Request::chat("sk-e", BODY), &mut companion);
        let mut failed = proxy.send(Request::chat("sk-e", BODY), &mut companion);
        proxy.reply_with_headers(&mut refused, 429, "application/json", &[("retry-after", "5")], &[b"{}"]);
        // The upstream's 503 to a request sent as early: not the provider serving again.
        proxy.reply_with_headers(&mut failed, 503, "text/plain", &[], &[b"upstream connect error"]);
        let next = proxy.send(Request::chat("sk-e", BODY), &mut companion);
        assert_eq!(next.replied().map(|r| r.status), Some(429), "{kind:?}");
        assert_eq!(header(&next, "retry-after"), Some("5"));
    }
}

/// A shared `"all"` pool of a quota is lowered like a tenant's own limit
/// (docs/provider-limits.md: the lowering takes the request's buckets, whatever made them), for every tenant the provider's quota serves (here two tenants named by the
/// operator's header, behind one upstream key).
#[test]
fn a_shared_pool_is_charged_lowered_to_what_the_provider_says_is_left() {
    for kind in HOSTS {
        let world = World::new(kind);
        let config = json!({"companion": {"upstream": "companion", "token": "test-token-0123456789"},
            "failure_mode": "deny", "provider_limits": {"enabled": true, "share": false},
            "identity": {"sources": [{"header": "x-team-key"}]},
            "limits": [{"name": "tpm", "tokens": 100000, "window": "1m"},
                       {"name": "upstream_tpm", "tokens": 50000, "window": "1m", "per": "all"}]});
        let mut proxy = Proxy::new(&world, &config.to_string());
        let mut companion = FakeCompanion::default();
        let as_team = |team: &str| Request::chat("sk-upstream", BODY).header("x-team-key", team);
        let mut first = proxy.send(as_team("team-a"), &mut companion);
        ok(&mut proxy, &mut first, &[("x-ratelimit-remaining-tokens", "4000"), ("x-ratelimit-reset-tokens", "30s")]);
        for key in ["team-a", "team-b"] {
            let next = proxy.send(as_team(key), &mut companion);
            assert!(next.forwarded(), "{kind:?}");
            let charge: ChargeRequest = serde_json::from_value(next.host.last_callout().body.clone()).expect("charge");
            let pool = charge.limits.iter().find(|l| l.name == "upstream_tpm").expect("the pool");
            assert_eq!(pool.owner.as_deref(), Some(crate::protocol::keys::ALL_OWNER), "{kind:?}");
            // 4,000 left of a quota refilled at 50,000 a minute: a 4,000 bucket full in 4.8 s.
            assert_eq!((pool.capacity, pool.window_ms), (4_000, 4_800), "{kind:?} {key}: the pool lowered");
            let own = charge.limits.iter().find(|l| l.name == "tpm").expect("tpm");
            assert_eq!((own.capacity, own.window_ms), (4_000, 2_400), "{kind:?} {key}: and the tenant's own");
        }
    }
}

/// The fleet exchange's pace (docs/provider-limits.md: "about every 200 ms when it heard something, once a
/// second otherwise"): counted on the worker's tick with the clock moved by hand.
#[test]
fn the_fleet_exchange_goes_every_200_ms_after_news_and_every_second_otherwise() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(true));
        let mut companion = FakeCompanion::default();
        // Moves the clock, ticks, and answers the exchanges that went out: their times.
        let step = |proxy: &mut Proxy, ms: u64| -> Vec<u64> {
            advance(&world, ms);
            let before = proxy.root.callouts.len();
            proxy.tick(None);
            let exchanges: Vec<u32> =
                proxy.root.callouts[before..].iter().filter(|c| c.path == PROVIDER_PATH).map(|c| c.token).collect();
            let empty = serde_json::to_vec(&ProviderReply { entries: Vec::new() }).expect("json");
            exchanges.iter().for_each(|token| proxy.root_answer(*token, 200, empty.clone()));
            exchanges.iter().map(|_| proxy.now()).collect()
        };
        let start = proxy.now();
        let mut sent_at = step(&mut proxy, 0);
        for _ in 0..60 {
            sent_at.extend(step(&mut proxy, 50));
        }
        // Nothing heard for 3 s: once a second.
        let quiet: Vec<u64> = sent_at.iter().map(|t| t - start).collect();
        assert_eq!(quiet, [0, 1_000, 2_000, 3_000], "{kind:?}");
        // Each request's reply now says how much is left: every 200 ms.
        let busy = proxy.now();
        let mut sent_at = Vec::new();
        for _ in 0..20 {
            let mut flight = proxy.send(Request::chat("sk-a", BODY), &mut companion);
            ok(
                &mut proxy,
                &mut flight,
                &[("x-ratelimit-remaining-tokens", "90000"), ("x-ratelimit-reset-tokens", "6s")],
            );
            sent_at.extend(step(&mut proxy, 50));
        }
        let heard: Vec<u64> = sent_at.iter().map(|t| t - busy).collect();
        assert_eq!(heard, [200, 400, 600, 800, 1_000], "{kind:?}");
    }
}
