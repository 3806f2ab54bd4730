//! The lifecycle on the fake host for what issue 15 added: answers in the caller's API's
//! shape (chosen from the path when the headers arrive, or fixed by `error_format`), and
//! token limits that count one part of a request's tokens, reserved and settled apart.

use super::tests::{config, lease_of, settle};
use crate::effects::host::HostKind;
use crate::protocol::{ChargeRequest, Settlement};
use crate::testing::{FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::{json, Value};

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];
const MESSAGES: &str =
    r#"{"model":"claude-sonnet-4-5","max_tokens":300,"messages":[{"role":"user","content":"hello world"}]}"#;
/// What MESSAGES counts as in the proxy (no model rule: o200k_base, as for chat).
const MESSAGES_PROMPT: u64 = 9;

/// `request` sent to `path` instead.
fn at(path: &str, mut request: Request) -> Request {
    for (name, value) in &mut request.headers {
        if name == ":path" {
            *value = path.to_string();
        }
    }
    request
}

fn body(flight: &InFlight) -> Value {
    serde_json::from_str(&flight.replied().expect("a local reply").body).expect("a JSON body")
}

fn header<'a>(flight: &'a InFlight, name: &str) -> Option<&'a str> {
    flight.replied()?.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
}

fn credits(settlement: &Settlement) -> Vec<(&str, i64)> {
    settlement.limits.iter().map(|a| (a.name.as_str(), a.credit)).collect()
}

fn costs(flight: &InFlight) -> Vec<u64> {
    let charge: ChargeRequest = serde_json::from_value(flight.host.last_callout().body.clone()).expect("a charge");
    charge.limits.iter().map(|l| l.cost).collect()
}

#[test]
fn an_anthropic_caller_is_refused_in_anthropics_shape_with_its_headers() {
    for kind in HOSTS {
        let world = World::new(kind);
        let limits =
            json!([{"name": "rpm", "requests": 1, "window": "1m"}, {"name": "tpm", "tokens": 10000, "window": "1m"}]);
        let mut proxy = Proxy::new(&world, &config(limits, json!({})));
        let mut companion = FakeCompanion::default();
        let first = proxy.send(at("/v1/messages", Request::chat("sk-a", MESSAGES)), &mut companion);
        assert!(first.forwarded(), "{kind:?}");
        let second = proxy.send(at("/v1/messages", Request::chat("sk-a", MESSAGES)), &mut companion);
        assert_eq!(second.replied().map(|r| r.status), Some(429), "{kind:?}");
        assert_eq!(body(&second)["type"], "error");
        assert_eq!(body(&second)["error"]["type"], "rate_limit_error");
        assert!(body(&second)["error"]["message"].as_str().is_some_and(|m| m.contains("limit \"rpm\" allows 1")));
        assert_eq!(header(&second, "anthropic-ratelimit-requests-limit"), Some("1"));
        assert_eq!(header(&second, "anthropic-ratelimit-requests-remaining"), Some("0"));
        // The fake clock stands at 1,000 s after the epoch; the bucket is full 60 s later.
        assert_eq!(header(&second, "anthropic-ratelimit-requests-reset"), Some("1970-01-01T00:17:40Z"));
        assert!(header(&second, "anthropic-ratelimit-tokens-remaining").is_some());
        assert_eq!(header(&second, "x-ratelimit-remaining-requests"), None);
        assert_eq!(header(&second, "retry-after"), Some("60"));
        // An OpenAI caller of the same tenant still gets OpenAI's.
        let chat = proxy.send(Request::chat("sk-a", r#"{"model":"gpt-4o","messages":[]}"#), &mut companion);
        assert_eq!(body(&chat)["error"]["code"], "rate_limit_exceeded");
        assert_eq!(header(&chat, "x-ratelimit-remaining-requests"), Some("0"));
    }
}

#[test]
fn refusals_that_never_read_the_body_answer_in_the_callers_shape() {
    for kind in HOSTS {
        let world = World::new(kind);
        let tokens = json!([{"name": "tpm", "tokens": 10000, "window": "1m"}]);
        let mut proxy = Proxy::new(&world, &config(tokens.clone(), json!({"tokens": {"max_request_bytes": 1024}})));
        let mut companion = FakeCompanion::default();
        // No API key: refused on the headers alone.
        let mut anonymous = at("/v1/messages", Request::chat("x", MESSAGES));
        anonymous.headers.retain(|(name, _)| name != "authorization");
        let refused = proxy.send(anonymous, &mut companion);
        assert_eq!(
            (refused.replied().map(|r| r.status), &body(&refused)["error"]["type"]),
            (Some(401), &json!("authentication_error"))
        );
        // A body too large, on Gemini's path: Google's shape.
        let big = format!(r#"{{"contents":[{{"parts":[{{"text":"{}"}}]}}]}}"#, "a".repeat(2000));
        let google = proxy
            .send(at("/v1beta/models/gemini-2.0-flash:generateContent", Request::chat("sk-a", &big)), &mut companion);
        assert_eq!(google.replied().map(|r| r.status), Some(413), "{kind:?}");
        assert_eq!(body(&google)["error"]["status"], "INVALID_ARGUMENT");
        assert_eq!(body(&google)["error"]["code"], 413);
        // The companion down and `failure_mode: deny`, on Bedrock's path.
        let mut down = FakeCompanion::failing(500);
        let bedrock = at("/model/anthropic.claude-3-haiku/converse", Request::chat("sk-a", MESSAGES));
        let mut bedrock = proxy.start(bedrock);
        proxy.answer(&mut bedrock, &mut down);
        assert_eq!(bedrock.replied().map(|r| r.status), Some(503), "{kind:?}");
        let code = bedrock.replied().and_then(|r| r.headers.iter().find(|(n, _)| *n == "x-amzn-errortype"));
        assert_eq!(code.map(|(_, v)| v.as_str()), Some("ServiceUnavailableException"));
        assert!(body(&bedrock)["message"].is_string());
        // `error_format` fixes the shape whatever the path.
        let mut fixed = Proxy::new(
            &world,
            &config(tokens.clone(), json!({"error_format": "bedrock", "identity": {"missing": "reject"}})),
        );
        let mut anonymous = Request::chat("x", "{}");
        anonymous.headers.retain(|(name, _)| name != "authorization");
        let refused = fixed.send(anonymous, &mut companion);
        let code = refused.replied().and_then(|r| r.headers.iter().find(|(n, _)| *n == "x-amzn-errortype"));
        assert_eq!(code.map(|(_, v)| v.as_str()), Some("AccessDeniedException"), "{kind:?}");
    }
}

fn dimensions(extra: Value) -> String {
    config(
        json!([
            {"name": "itpm", "tokens": 1000, "window": "1m", "count": "input"},
            {"name": "otpm", "tokens": 1000, "window": "1m", "count": "output"},
            {"name": "ctpm", "tokens": 1000, "window": "1m", "count": "cached_input"},
            {"name": "tpm", "tokens": 100000, "window": "1m"}
        ]),
        extra,
    )
}

fn anthropic_usage(input: u64, cached: u64, output: u64) -> String {
    json!({"id": "m1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
           "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
           "usage": {"input_tokens": input, "cache_read_input_tokens": cached, "output_tokens": output}})
    .to_string()
}

#[test]
fn each_part_of_the_tokens_is_reserved_and_settled_against_its_own_limit() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &dimensions(json!({})));
        let mut companion = FakeCompanion::default();
        let mut request = proxy.send(at("/v1/messages", Request::chat("sk-a", MESSAGES)), &mut companion);
        assert!(request.forwarded(), "{kind:?}");
        // Input: the prompt; output: the allowance (max_tokens); cached input: nothing yet;
        // total: both.
        assert_eq!(costs(&request), [MESSAGES_PROMPT, 300, 0, MESSAGES_PROMPT + 300]);
        // The provider counted 30 input tokens, 20 of them read from its cache (Anthropic
        // reports them apart: 10 + 20), and 40 output tokens.
        proxy.reply(&mut request, 200, "application/json", &[&anthropic_usage(10, 20, 40)]);
        let settled = settle(&mut proxy, &mut companion);
        assert_eq!(settled.len(), 1, "{kind:?}");
        assert_eq!(
            credits(&settled[0]),
            [
                ("itpm", MESSAGES_PROMPT as i64 - 30),
                ("otpm", 300 - 40),
                ("ctpm", -20),
                ("tpm", (MESSAGES_PROMPT + 300) as i64 - 70)
            ],
            "{kind:?}"
        );
    }
}

#[test]
fn an_output_limit_refuses_on_the_allowance_and_the_429_names_it() {
    let world = World::new(HostKind::Envoy);
    let limits = json!([
        {"name": "itpm", "tokens": 100000, "window": "1m", "count": "input"},
        {"name": "otpm", "tokens": 500, "window": "1m", "count": "output"}
    ]);
    let mut proxy = Proxy::new(&world, &config(limits, json!({})));
    let mut companion = FakeCompanion::default();
    let first = proxy.send(at("/v1/messages", Request::chat("sk-a", MESSAGES)), &mut companion);
    assert!(first.forwarded());
    let second = proxy.send(at("/v1/messages", Request::chat("sk-a", MESSAGES)), &mut companion);
    let message = body(&second)["error"]["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("output tokens: limit \"otpm\"") && message.contains("needs 300"), "{message}");
    assert_eq!(header(&second, "anthropic-ratelimit-output-tokens-remaining"), Some("200"));
    // The input limit was charged the first request's prompt only: the second took nothing.
    let input_left = (100_000 - MESSAGES_PROMPT).to_string();
    assert_eq!(header(&second, "anthropic-ratelimit-input-tokens-remaining"), Some(input_left.as_str()));
}

#[test]
fn clamping_fits_the_output_allowance_to_an_output_limit() {
    let world = World::new(HostKind::Envoy);
    let limits = json!([
        {"name": "itpm", "tokens": 100000, "window": "1m", "count": "input"},
        {"name": "otpm", "tokens": 400, "window": "1m", "count": "output"},
        {"name": "tpm", "tokens": 100000, "window": "1m"}
    ]);
    let mut proxy =
        Proxy::new(&world, &config(limits, json!({"tokens": {"clamp_max_tokens": true, "min_output_tokens": 50}})));
    let mut companion = FakeCompanion::default();
    let mut first = proxy.send(at("/v1/messages", Request::chat("sk-a", MESSAGES)), &mut companion);
    assert!(first.forwarded());
    proxy.reply(&mut first, 200, "application/json", &[&anthropic_usage(9, 0, 300)]);
    // 100 output tokens left: the next request is admitted with max_tokens 100, and both
    // the output and the total limit were charged 200 less than asked.
    let second = proxy.send(at("/v1/messages", Request::chat("sk-a", MESSAGES)), &mut companion);
    assert!(second.forwarded());
    let sent: Value = serde_json::from_slice(&second.host.request_body).expect("rewritten body");
    assert_eq!(sent["max_tokens"], 100);
    let charge: ChargeRequest = serde_json::from_value(second.host.last_callout().body.clone()).expect("a charge");
    assert_eq!(charge.limits[1].min_cost, Some(50));
    assert_eq!(charge.limits[0].min_cost, None, "the prompt is not elastic");
}

#[test]
fn leased_requests_settle_each_part_and_redis_ends_at_what_was_used() {
    for kind in HOSTS {
        let world = World::new(kind);
        let limits = json!([
            {"name": "itpm", "tokens": 100000, "window": "366d", "count": "input"},
            {"name": "otpm", "tokens": 100000, "window": "366d", "count": "output"},
            {"name": "ctpm", "tokens": 100000, "window": "366d", "count": "cached_input"}
        ]);
        let mut proxy = Proxy::new(&world, &config(limits, json!({"lease": {"enabled": true, "ttl": "1s"}})));
        let mut companion = FakeCompanion::default();
        for _ in 0..4 {
            let mut request = proxy.send(at("/v1/messages", Request::chat("sk-a", MESSAGES)), &mut companion);
            assert!(request.forwarded(), "{kind:?}");
            proxy.reply(&mut request, 200, "application/json", &[&anthropic_usage(10, 20, 40)]);
            proxy.tick(Some(&mut companion));
        }
        assert_eq!(companion.calls.get(crate::protocol::LEASE_PATH), Some(&1), "{kind:?}: leased from the second");
        // A leased request settles into its leases, the cached input too: that limit's
        // lease holds nothing and goes below zero, and what it owes reaches Redis when
        // the lease ends.
        assert!(companion.settled.iter().all(|s| s.reservation.is_some()), "{kind:?}: no settlement but the first's");
        let cached = lease_of(&mut proxy, "sk-a").0[2].remaining;
        assert!((cached + 60.0).abs() < 0.5, "{kind:?}: the cached-input lease owes {cached}");
        // The leases expire and give back what is left: Redis holds exactly what the four
        // replies used of each part (30 input, 40 output, 20 of the input cached, each).
        crate::testing::advance(&world, 1_500);
        for _ in 0..10 {
            proxy.tick(Some(&mut companion));
        }
        let tenant = crate::api::identity::tenant_id("sk-a");
        let charge: ChargeRequest = serde_json::from_value(json!({"domain": "llm", "tenant": tenant, "limits": [
            {"name": "itpm", "capacity": 100000, "window_ms": 31_622_400_000u64, "cost": 0},
            {"name": "otpm", "capacity": 100000, "window_ms": 31_622_400_000u64, "cost": 0},
            {"name": "ctpm", "capacity": 100000, "window_ms": 31_622_400_000u64, "cost": 0}]}))
        .expect("specs");
        let now = proxy.now();
        let used: Vec<f64> =
            charge.limits.iter().map(|limit| 100_000.0 - companion.level(&tenant, limit, now)).collect();
        for (used, expected) in used.iter().zip([120.0, 160.0, 80.0]) {
            assert!((used - expected).abs() < 1.0, "{kind:?}: used {used}, expected {expected}");
        }
    }
}

#[test]
fn shadow_mode_forwards_a_refusal_without_its_error_headers() {
    let world = World::new(HostKind::Envoy);
    let limits = json!([{"name": "rpm", "requests": 1, "window": "1m"}]);
    let mut proxy = Proxy::new(&world, &config(limits, json!({"mode": "shadow"})));
    let mut companion = FakeCompanion::default();
    let bedrock = || at("/model/anthropic.claude-3-haiku/converse", Request::chat("sk-a", "{}"));
    assert!(proxy.send(bedrock(), &mut companion).forwarded());
    let mut second = proxy.send(bedrock(), &mut companion);
    assert!(second.forwarded(), "shadow mode never refuses");
    proxy.reply(&mut second, 200, "application/json", &["{}"]);
    assert_eq!(second.host.response_header_value("x-llm-ratelimit-shadow"), Some("429"));
    assert_eq!(second.host.response_header_value("x-amzn-errortype"), None, "a 200 is no ThrottlingException");
    assert!(second.host.response_header_value("ratelimit").is_some());
}
