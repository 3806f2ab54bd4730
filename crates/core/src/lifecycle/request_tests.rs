//! The lifecycle on the fake host for what issue 26 closed on the request side: the
//! tenant read only where the request's upstream authenticates, conflicting credentials
//! refused (as each host presents a repeated header), and what an upstream refused for
//! its credential given back.

use super::tests::{config, settle};
use crate::effects::host::HostKind;
use crate::protocol::ChargeRequest;
use crate::testing::{FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::{json, Value};

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];
const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;

fn headers(path: &str, credentials: &[(&str, &str)]) -> Request {
    let mut headers: Vec<(String, String)> = vec![
        (":method".into(), "POST".into()),
        (":path".into(), path.into()),
        ("content-type".into(), "application/json".into()),
    ];
    headers.extend(credentials.iter().map(|(n, v)| (n.to_string(), v.to_string())));
    with_body(Request { headers, body: Vec::new() }, CHAT)
}

/// `request` carrying `body`, with its length (without one ngx_wasm_module sees no body).
fn with_body(mut request: Request, body: &str) -> Request {
    request.headers.retain(|(name, _)| name != "content-length");
    request.headers.push(("content-length".into(), body.len().to_string()));
    request.body = body.as_bytes().to_vec();
    request
}

fn tenant_of(flight: &InFlight) -> String {
    let charge: ChargeRequest = serde_json::from_value(flight.host.last_callout().body.clone()).expect("a charge");
    charge.tenant
}

fn refused_body(flight: &InFlight) -> Value {
    let reply = flight.replied().expect("a local reply");
    assert_eq!(reply.status, 400);
    serde_json::from_str(&reply.body).expect("JSON")
}

fn rpm(requests: u64) -> String {
    config(json!([{"name": "rpm", "requests": requests, "window": "1m"}]), json!({}))
}

#[test]
fn the_tenant_is_read_where_the_upstream_authenticates() {
    let azure = "/openai/deployments/gpt4/chat/completions?api-version=2024-10-21";
    let gemini = "/v1beta/models/gemini-2.0-flash:generateContent";
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &rpm(100));
        let mut companion = FakeCompanion::default();
        // A header the upstream ignores does not name the tenant.
        let flight = proxy.send(headers(azure, &[("api-key", "az-1"), ("x-api-key", "random-1")]), &mut companion);
        assert_eq!(tenant_of(&flight), crate::api::identity::tenant_id("az-1"), "{kind:?}");
        let flight = proxy.send(headers(&format!("{gemini}?key=g-1"), &[("x-api-key", "random-2")]), &mut companion);
        assert_eq!(tenant_of(&flight), crate::api::identity::tenant_id("g-1"), "{kind:?}");
        // The same key in two places the upstream reads is one tenant.
        let flight =
            proxy.send(headers(azure, &[("api-key", "az-1"), ("authorization", "Bearer az-1")]), &mut companion);
        assert_eq!(tenant_of(&flight), crate::api::identity::tenant_id("az-1"), "{kind:?}");
    }
}

#[test]
fn conflicting_credentials_are_refused_in_the_apis_shape_on_every_host() {
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);
    let cases: [Case; 5] = [
        ("/openai/deployments/gpt4/chat/completions", &[("api-key", "a"), ("authorization", "Bearer b")], "openai"),
        ("/v1/chat/completions", &[("authorization", "Bearer a"), ("authorization", "Bearer b")], "openai"),
        ("/v1/messages", &[("x-api-key", "a"), ("x-api-key", "a")], "anthropic"),
        ("/v1beta/models/gemini-2.0-flash:generateContent?key=a", &[("x-goog-api-key", "b")], "google"),
        // No family recognised: every place is read, and they must agree.
        ("/v2/unknown", &[("authorization", "Bearer a"), ("x-api-key", "b")], "openai"),
    ];
    for kind in HOSTS {
        let world = World::new(kind);
        let config = config(
            json!([{"name": "rpm", "requests": 100, "window": "1m"}]),
            json!({"identity": {"missing": "anonymous"}}),
        );
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        for (path, credentials, shape) in cases {
            let flight = proxy.send(headers(path, credentials), &mut companion);
            let body = refused_body(&flight);
            match shape {
                "openai" => assert_eq!(body["error"]["code"], "conflicting_credentials", "{kind:?} {path}"),
                "anthropic" => assert_eq!(body["error"]["type"], "invalid_request_error", "{kind:?} {path}"),
                _ => assert_eq!(body["error"]["status"], "INVALID_ARGUMENT", "{kind:?} {path}"),
            }
            assert!(!flight.forwarded(), "{kind:?} {path}");
        }
        assert_eq!(companion.calls.get(crate::protocol::CHARGE_PATH), None, "{kind:?}: nothing was charged");
    }
}

#[test]
fn the_operators_own_header_given_twice_is_refused() {
    for kind in HOSTS {
        let world = World::new(kind);
        let config = config(
            json!([{"name": "rpm", "requests": 100, "window": "1m"}]),
            json!({"identity": {"sources": [{"header": "x-tenant"}]}}),
        );
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        let flight =
            proxy.send(headers("/v1/chat/completions", &[("x-tenant", "t1"), ("x-tenant", "t2")]), &mut companion);
        assert_eq!(refused_body(&flight)["error"]["code"], "conflicting_credentials", "{kind:?}");
        let flight = proxy.send(headers("/v1/chat/completions", &[("x-tenant", "t1")]), &mut companion);
        assert_eq!(tenant_of(&flight), crate::api::identity::tenant_id("t1"), "{kind:?}");
    }
}

#[test]
fn a_request_the_upstream_refuses_for_its_credential_costs_nothing() {
    for kind in HOSTS {
        for status in [401, 403] {
            let world = World::new(kind);
            let config = config(
                json!([{"name": "rpm", "requests": 3, "window": "1m"}, {"name": "tpm", "tokens": 100000, "window": "1m"}]),
                json!({}),
            );
            let mut proxy = Proxy::new(&world, &config);
            let mut companion = FakeCompanion::default();
            // Ten forged requests naming the victim, each refused by the upstream.
            for _ in 0..10 {
                let mut forged = proxy.send(Request::chat("victim", CHAT), &mut companion);
                assert!(forged.forwarded(), "{kind:?} {status}: the forged request found room");
                let refusal = r#"{"error":{"message":"Incorrect API key provided","type":"invalid_request_error"}}"#;
                proxy.reply(&mut forged, status, "application/json", &[refusal]);
                let settled = settle(&mut proxy, &mut companion);
                let credits: Vec<i64> = settled.iter().flat_map(|s| s.limits.iter().map(|l| l.credit)).collect();
                assert_eq!(credits, [1, 309], "{kind:?} {status}: the request and its tokens came back");
            }
            let own = proxy.send(Request::chat("victim", CHAT), &mut companion);
            assert!(own.forwarded(), "{kind:?} {status}: the victim's own request is admitted");
        }
    }
}

#[test]
fn a_request_refused_for_its_credential_is_refunded_under_requests_limits_alone() {
    // No token limit: nothing is reserved, so nothing but the refund is ever settled.
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &rpm(3));
        let mut companion = FakeCompanion::default();
        for _ in 0..10 {
            let mut forged = proxy.send(Request::chat("victim", CHAT), &mut companion);
            assert!(forged.forwarded(), "{kind:?}: the forged request found room");
            // The companion credits only what a record backs: the charge must leave one.
            let charge: ChargeRequest =
                serde_json::from_value(forged.host.last_callout().body.clone()).expect("charge");
            let record = charge.reservation.expect("a requests-only charge keeps a reservation record");
            assert!(record.ttl_ms >= 5_000, "{kind:?}: the record outlives the reply's status ({record:?})");
            proxy.reply(&mut forged, 403, "application/json", &[r#"{"message":"bad signature"}"#]);
            let settled = settle(&mut proxy, &mut companion);
            let credits: Vec<i64> = settled.iter().flat_map(|s| s.limits.iter().map(|l| l.credit)).collect();
            assert_eq!(credits, [1], "{kind:?}: the request came back");
            let against: Vec<Option<&str>> = settled.iter().map(|s| s.reservation.as_deref()).collect();
            assert_eq!(against, [Some(record.id.as_str())], "{kind:?}: the refund is settled against the record");
        }
        // An admitted request's charge simply stands.
        let mut own = proxy.send(Request::chat("victim", CHAT), &mut companion);
        assert!(own.forwarded(), "{kind:?}: the victim's own request is admitted");
        proxy.reply(&mut own, 200, "application/json", &[r#"{"choices":[]}"#]);
        assert!(settle(&mut proxy, &mut companion).is_empty(), "{kind:?}: nothing to settle");
    }
}

#[test]
fn each_choice_is_reserved_its_output_allowance() {
    // `n`, `best_of`, `candidateCount`: the provider bills every completion it generates.
    let cases = [
        (
            "/v1/chat/completions",
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300,"n":64}"#,
            9 + 300 * 64,
        ),
        (
            "/v1/completions",
            r#"{"model":"gpt-3.5-turbo-instruct","prompt":"hello world","max_tokens":300,"n":2,"best_of":5}"#,
            0,
        ),
        (
            "/v1beta/models/gemini-2.0-flash:generateContent",
            r#"{"contents":[{"parts":[{"text":"hello world"}]}],"generationConfig":{"maxOutputTokens":300,"candidateCount":8}}"#,
            0,
        ),
    ];
    for kind in HOSTS {
        let world = World::new(kind);
        let config = config(json!([{"name": "tpm", "tokens": 1_000_000, "window": "1m"}]), json!({}));
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        let mut one = Vec::new();
        for (path, body, expected) in cases {
            let request = with_body(headers(path, &[("authorization", "Bearer k"), ("x-goog-api-key", "k")]), body);
            let flight = proxy.send(request, &mut companion);
            let charge: ChargeRequest =
                serde_json::from_value(flight.host.last_callout().body.clone()).expect("charge");
            let single = body
                .replace(r#","n":64"#, "")
                .replace(r#","n":2,"best_of":5"#, "")
                .replace(r#","candidateCount":8"#, "");
            let request = with_body(headers(path, &[("authorization", "Bearer k"), ("x-goog-api-key", "k")]), &single);
            let flight = proxy.send(request, &mut companion);
            let base: ChargeRequest = serde_json::from_value(flight.host.last_callout().body.clone()).expect("charge");
            one.push((charge.limits[0].cost, base.limits[0].cost, expected));
        }
        // The prompt is the same; the output allowance is 300 per choice.
        let [(chat, chat1, expected), (completions, completions1, _), (gemini, gemini1, _)] = one[..] else { panic!() };
        assert_eq!(chat, expected, "{kind:?}");
        assert_eq!(chat - chat1, 300 * 63, "{kind:?}");
        assert_eq!(completions - completions1, 300 * 4, "{kind:?}: best_of 5 candidates are generated");
        assert_eq!(gemini - gemini1, 300 * 7, "{kind:?}");
    }
}

#[test]
fn a_clamped_grant_is_shared_by_the_choices() {
    // Where the host lets the body be rewritten after the decision (see
    // `clamping_rewrites_the_output_cap_to_the_grant`).
    {
        let kind = HostKind::Envoy;
        let world = World::new(kind);
        // 9 prompt tokens + 4 choices: 1,000 tokens left gives each choice (1000-21)/4.
        let config = config(
            json!([{"name": "tpm", "tokens": 1000, "window": "1m"}]),
            json!({"tokens": {"clamp_max_tokens": true, "min_output_tokens": 10}}),
        );
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":4000,"n":4}"#;
        let request = with_body(headers("/v1/chat/completions", &[("authorization", "Bearer k")]), body);
        let flight = proxy.send(request, &mut companion);
        assert!(flight.forwarded(), "{kind:?}");
        let sent: Value = serde_json::from_slice(&flight.host.request_body).expect("rewritten body");
        let per_choice = sent["max_tokens"].as_u64().expect("a cap");
        // 1,000 left less the prompt's bound (21 tokens), in four equal parts.
        assert_eq!(per_choice, (1000 - 21) / 4, "{kind:?}");
    }
}

fn tpm(extra: Value) -> String {
    config(
        json!([{"name": "rpm", "requests": 100, "window": "1m"},
               {"name": "tpm", "tokens": 1_000_000, "window": "1m"},
               {"name": "gpt4o-tpm", "tokens": 1_000_000, "window": "1m", "models": ["gpt-4o*"]}]),
        extra,
    )
}

/// Bodies Python's `json` or Go's `encoding/json` read one way and serde_json another,
/// or that upstreams disagree on: never charged less than they cost.
const UNREADABLE: [&str; 6] = [
    r#"{"model":"gpt-4o","max_tokens":1e400,"messages":[]}"#,
    r#"{"model":"gpt-4o","messages":[{"role":"user","content":"\ud800"}]}"#,
    r#"{"model":"gpt-4o","max_tokens":10,"max_tokens":100000,"messages":[]}"#,
    r#"{"model":"gpt-4o-mini","model":"gpt-4o","messages":[]}"#,
    r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi","content":"ho"}]}"#,
    "not json at all",
];

fn deep() -> String {
    format!(r#"{{"model":"gpt-4o","messages":[],"x":{}1{}}}"#, "[".repeat(200), "]".repeat(200))
}

#[test]
fn a_body_the_filter_cannot_read_is_refused_in_the_apis_shape() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &tpm(json!({})));
        let mut companion = FakeCompanion::default();
        for body in UNREADABLE.iter().map(|b| b.to_string()).chain([deep()]) {
            let flight = proxy.send(with_body(Request::chat("k", ""), &body), &mut companion);
            assert_eq!(refused_body(&flight)["error"]["code"], "invalid_body", "{kind:?} {body}");
            assert!(!flight.forwarded());
        }
        let messages = with_body(
            headers("/v1/messages", &[("x-api-key", "k")]),
            r#"{"model":"claude","max_tokens":10,"max_tokens":20,"messages":[]}"#,
        );
        let flight = proxy.send(messages, &mut companion);
        assert_eq!(refused_body(&flight)["error"]["type"], "invalid_request_error", "{kind:?}");
        assert_eq!(companion.calls.get(crate::protocol::CHARGE_PATH), None, "{kind:?}");
        // A UTF-8 byte order mark is read past, as Python's json.loads reads bytes.
        let bom = format!("\u{feff}{CHAT}");
        let flight = proxy.send(with_body(Request::chat("k", ""), &bom), &mut companion);
        let charge: ChargeRequest = serde_json::from_value(flight.host.last_callout().body.clone()).expect("charge");
        assert_eq!(charge.limits.iter().map(|l| l.cost).collect::<Vec<_>>(), [1, 309, 309], "{kind:?}");
    }
}

#[test]
fn charge_most_charges_an_unreadable_body_its_bytes_and_the_cap_under_every_limit() {
    for kind in HOSTS {
        let world = World::new(kind);
        let extra = json!({"tokens": {"unreadable_body": "charge_most", "default_max_output": 4096}});
        let mut proxy = Proxy::new(&world, &tpm(extra));
        let mut companion = FakeCompanion::default();
        let body = UNREADABLE[0];
        let flight = proxy.send(with_body(Request::chat("k", ""), body), &mut companion);
        assert!(flight.forwarded(), "{kind:?}");
        let charge: ChargeRequest = serde_json::from_value(flight.host.last_callout().body.clone()).expect("charge");
        let most = body.len() as u64 + 4096;
        assert_eq!(charge.limits.iter().map(|l| l.cost).collect::<Vec<_>>(), [1, most, most], "{kind:?}");
    }
}

#[test]
fn the_path_is_read_once_for_routing_and_bypass() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &tpm(json!({"bypass": {"paths": ["/v1/models*"]}})));
        let mut companion = FakeCompanion::default();
        for path in ["/v1/models/../chat/completions", "/v1/models/%2E%2E/chat/completions", "//v1/chat//completions/"]
        {
            let flight = proxy.send(with_body(headers(path, &[("authorization", "Bearer k")]), CHAT), &mut companion);
            let charge: ChargeRequest =
                serde_json::from_value(flight.host.last_callout().body.clone()).expect("charge");
            assert_eq!(charge.limits.iter().map(|l| l.cost).collect::<Vec<_>>(), [1, 309, 309], "{kind:?} {path}");
        }
        let before = companion.calls.get(crate::protocol::CHARGE_PATH).copied();
        let listing = proxy.send(Request::get("k", "/v1/models/gpt-4o"), &mut companion);
        assert!(listing.replied().is_none(), "{kind:?}");
        assert_eq!(companion.calls.get(crate::protocol::CHARGE_PATH).copied(), before, "{kind:?}: bypassed");
    }
}

#[test]
fn batch_realtime_and_if_asked_unknown_paths_are_refused() {
    for kind in HOSTS {
        for (unknown_paths, unknown_refused) in [("charge", false), ("refuse", true)] {
            let world = World::new(kind);
            let mut proxy = Proxy::new(&world, &tpm(json!({"unknown_paths": unknown_paths})));
            let mut companion = FakeCompanion::default();
            for path in ["/v1/batches", "/v1/realtime?model=gpt-4o-realtime-preview", "/v1/messages/batches"] {
                let flight =
                    proxy.send(with_body(headers(path, &[("authorization", "Bearer k")]), "{}"), &mut companion);
                assert_eq!(flight.replied().map(|r| r.status), Some(400), "{kind:?} {path}");
            }
            let flight = proxy
                .send(with_body(headers("/v1/assistants", &[("authorization", "Bearer k")]), "{}"), &mut companion);
            assert_eq!(flight.replied().is_some(), unknown_refused, "{kind:?} {unknown_paths}");
            assert_eq!(flight.forwarded(), !unknown_refused, "{kind:?} {unknown_paths}");
        }
    }
}
