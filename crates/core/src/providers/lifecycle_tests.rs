//! A Gemini and an Azure request's life on the fake host: the model from the path or a
//! deployment, the prompt counted, the reservation, the settlement from `usageMetadata`
//! in both stream framings, Google's error shape on a 429, and an unmapped deployment
//! priced by the model its reply names.

use crate::effects::host::HostKind;
use crate::protocol::ChargeRequest;
use crate::testing::{FakeCompanion, InFlight, Proxy, Request, World};
use crate::tokens::Encoding;
use serde_json::{json, Value};

const GEMINI_BODY: &str =
    r#"{"contents":[{"role":"user","parts":[{"text":"hello world"}]}],"generationConfig":{"maxOutputTokens":300}}"#;
const GEMINI_SSE: &str = include_str!("../../../../tests/cases/streams/gemini_stream.sse");
const GEMINI_ARRAY: &str = include_str!("../../../../tests/cases/streams/gemini_stream.json");
/// What the transcripts report: 12 prompt tokens, 9 candidates and 20 thoughts tokens.
const GEMINI_USED: i64 = 12 + 9 + 20;

fn post(key: &str, path: &str, body: &str) -> Request {
    Request {
        headers: vec![
            (":method".into(), "POST".into()),
            (":path".into(), path.into()),
            ("x-goog-api-key".into(), key.into()),
            ("content-type".into(), "application/json".into()),
            ("content-length".into(), body.len().to_string()),
        ],
        body: body.as_bytes().to_vec(),
    }
}

fn config(limits: Value, extra: Value) -> String {
    let mut config = json!({"companion": {"upstream": "companion", "token": "test-token-0123456789"}, "failure_mode": "deny", "limits": limits,
                            "identity": {"sources": [{"header": "x-goog-api-key"}, {"header": "api-key"}]}});
    if let (Some(config), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        config.extend(extra.clone());
    }
    config.to_string()
}

fn charge_of(flight: &InFlight) -> ChargeRequest {
    serde_json::from_value(flight.host.last_callout().body.clone()).expect("a charge")
}

fn credits(proxy: &mut Proxy, companion: &mut FakeCompanion) -> Vec<(String, i64)> {
    let before = companion.settled.len();
    proxy.tick(Some(companion));
    companion.settled[before..].iter().flat_map(|s| &s.limits).map(|l| (l.name.clone(), l.credit)).collect()
}

/// `text` cut into `pieces` chunks of about equal size, on character boundaries.
fn pieces(text: &str, pieces: usize) -> Vec<&str> {
    let size = text.len().div_ceil(pieces);
    let mut cuts = vec![0];
    let mut at = 0;
    while at < text.len() {
        at = (at + size).min(text.len());
        while !text.is_char_boundary(at) {
            at += 1;
        }
        cuts.push(at);
    }
    cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect()
}

#[test]
fn a_gemini_request_is_charged_by_its_path_model_and_settled_from_usage_metadata() {
    let prompt = Encoding::O200kBase.count("hello world") as i64;
    let streams = [
        ("/v1beta/models/gemini-2.5-flash:generateContent", "application/json", None),
        ("/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse", "text/event-stream", Some(GEMINI_SSE)),
        (
            "/v1beta/models/gemini-2.5-flash:streamGenerateContent",
            "application/json; charset=UTF-8",
            Some(GEMINI_ARRAY),
        ),
        (
            "/v1/projects/p/locations/us-central1/publishers/google/models/gemini-2.5-flash:streamGenerateContent",
            "application/json",
            Some(GEMINI_ARRAY),
        ),
    ];
    let whole_reply = json!({
        "candidates": [{"content": {"parts": [{"text": "hi"}], "role": "model"}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 12, "candidatesTokenCount": 9, "thoughtsTokenCount": 20, "totalTokenCount": 41},
        "modelVersion": "gemini-2.5-flash", "responseId": "r1"
    });
    let whole_reply = serde_json::to_string_pretty(&whole_reply).expect("json");
    for kind in [HostKind::Envoy, HostKind::Nginx] {
        for (path, content_type, stream) in streams {
            let world = World::new(kind);
            let limits = json!([
                {"name": "tpm", "tokens": 10000, "window": "1m"},
                {"name": "gpt-tpm", "tokens": 10000, "window": "1m", "models": ["gpt-*"]},
                {"name": "gemini-tpm", "tokens": 10000, "window": "1m", "models": ["gemini-2.5-*"]}
            ]);
            let mut proxy = Proxy::new(&world, &config(limits, json!({})));
            let mut companion = FakeCompanion::default();
            let mut flight = proxy.send(post("gk-a", path, GEMINI_BODY), &mut companion);
            assert!(flight.forwarded(), "{kind:?} {path}");
            let reserved = prompt + 300;
            let costs: Vec<u64> = charge_of(&flight).limits.iter().map(|l| l.cost).collect();
            assert_eq!(costs, [reserved as u64, 0, reserved as u64], "{path}: the model comes from the path");
            let chunks = pieces(stream.unwrap_or(&whole_reply), 5);
            proxy.reply(&mut flight, 200, content_type, &chunks);
            let settled = credits(&mut proxy, &mut companion);
            let expected = reserved - GEMINI_USED;
            assert_eq!(
                settled,
                [("tpm".to_string(), expected), ("gemini-tpm".to_string(), expected)],
                "{kind:?} {path}"
            );
        }
    }
}

#[test]
fn count_tokens_costs_a_request_and_no_tokens() {
    let world = World::new(HostKind::Envoy);
    let limits =
        json!([{"name": "rpm", "requests": 100, "window": "1m"}, {"name": "tpm", "tokens": 10000, "window": "1m"}]);
    let mut proxy = Proxy::new(&world, &config(limits, json!({})));
    let mut companion = FakeCompanion::default();
    let mut flight =
        proxy.send(post("gk-a", "/v1beta/models/gemini-2.5-flash:countTokens", GEMINI_BODY), &mut companion);
    assert!(flight.forwarded());
    assert_eq!(charge_of(&flight).limits.iter().map(|l| l.cost).collect::<Vec<_>>(), [1, 0]);
    proxy.reply(&mut flight, 200, "application/json", &[r#"{"totalTokens": 31}"#]);
    assert_eq!(credits(&mut proxy, &mut companion), []);
}

#[test]
fn a_refused_gemini_request_gets_googles_error_and_others_openais() {
    let world = World::new(HostKind::Envoy);
    let mut proxy = Proxy::new(&world, &config(json!([{"name": "rpm", "requests": 1, "window": "1m"}]), json!({})));
    let mut companion = FakeCompanion::default();
    let path = "/v1beta/models/gemini-2.5-flash:generateContent";
    assert!(proxy.send(post("gk-a", path, GEMINI_BODY), &mut companion).forwarded());
    let refused = proxy.send(post("gk-a", path, GEMINI_BODY), &mut companion);
    let reply = refused.replied().expect("a 429");
    assert_eq!(reply.status, 429);
    let body: Value = serde_json::from_str(&reply.body).expect("json");
    assert_eq!(
        (body["error"]["code"].as_u64(), body["error"]["status"].as_str()),
        (Some(429), Some("RESOURCE_EXHAUSTED"))
    );
    assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("rpm")), "{body}");
    assert_eq!(body["error"]["details"][0]["@type"], "type.googleapis.com/google.rpc.RetryInfo");
    let chat = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
    let openai = proxy.send(post("gk-a", "/v1/chat/completions", chat), &mut companion);
    let body: Value = serde_json::from_str(&openai.replied().expect("a 429").body).expect("json");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
}

#[test]
fn azure_deployments_map_to_models_and_an_unmapped_one_is_priced_by_its_reply() {
    let world = World::new(HostKind::Envoy);
    let limits = json!([
        {"name": "tpm", "tokens": 100000, "window": "1m"},
        {"name": "4o-tpm", "tokens": 100000, "window": "1m", "models": ["gpt-4o"]},
        {"name": "usd", "usd": 100, "window": "1d"}
    ]);
    let prices = json!([
        {"match": "gpt-4o-mini*", "input": 0.15, "output": 0.6},
        {"match": "gpt-4o*", "input": 2.5, "output": 10.0}
    ]);
    let extra = json!({"deployments": {"prod-4o": "gpt-4o"}, "prices": prices});
    let mut proxy = Proxy::new(&world, &config(limits, extra));
    let mut companion = FakeCompanion::default();
    let body = r#"{"messages":[{"role":"user","content":"hello world"}],"max_tokens":100}"#;
    let reserved = 9 + 100; // the chat formula's 9 for one "hello world" message
    let mapped = proxy.send(
        post("ak-a", "/openai/deployments/prod-4o/chat/completions?api-version=2024-10-21", body),
        &mut companion,
    );
    let costs: Vec<u64> = charge_of(&mapped).limits.iter().map(|l| l.cost).collect();
    // The mapped deployment is gpt-4o: its per-model limit applies, at gpt-4o's price.
    assert_eq!(costs, [reserved, reserved, (9.0 * 2.5 + 100.0 * 10.0_f64).ceil() as u64]);
    // An unmapped deployment: no per-model limit knows it; reserved at the table's highest
    // prices, settled at the price of the model the reply names.
    let mut unmapped = proxy
        .send(post("ak-a", "/openai/deployments/team-x/chat/completions?api-version=2024-10-21", body), &mut companion);
    let charged = charge_of(&unmapped).limits.iter().map(|l| l.cost).collect::<Vec<_>>();
    assert_eq!(charged, [reserved, 0, (9.0 * 2.5 + 100.0 * 10.0_f64).ceil() as u64]);
    let reply = json!({"id": "c1", "object": "chat.completion", "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}});
    proxy.reply(&mut unmapped, 200, "application/json", &[&serde_json::to_string_pretty(&reply).expect("json")]);
    let settled = credits(&mut proxy, &mut companion);
    let at_mini = (10.0 * 0.15 + 20.0 * 0.6_f64).ceil() as i64;
    assert_eq!(settled, [("tpm".to_string(), reserved as i64 - 30), ("usd".to_string(), charged[2] as i64 - at_mini)]);
}
