//! Overflow instead of a 429 (`limits[].overflow`, `provider_limits.overflow`), on both
//! hosts of the fake host: a request a limit refuses goes out with the overflow header
//! the route table matches, charged against the fallback's limits and not the refused
//! ones; a fallback that refuses too gives the 429; a client's own overflow header never
//! reaches the route table; where the headers already went ahead, nothing can re-route.

use crate::effects::host::{HostKind, Metric};
use crate::plan::series::{decision, Decision};
use crate::protocol::CHARGE_PATH;
use crate::testing::{usage_reply, FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::{json, Value};

const BODY: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}],"max_tokens":50}"#;
const HEADER: &str = "x-llm-ratelimit-overflow";

/// Two requests a minute on the primary, overflowing to `backup`, which allows three;
/// and a tenant's budget every route shares.
fn config(extra: Value) -> String {
    let mut config = json!({"companion": {"upstream": "companion", "token": "test-token-0123456789"}, "failure_mode": "deny",
           "limits": [
               {"name": "primary-rpm", "requests": 2, "window": "1m", "overflow": "backup"},
               {"name": "backup-rpm", "requests": 3, "window": "1m", "backend": "backup"},
               {"name": "tenant-rpm", "requests": 100, "window": "1m"}]});
    if let (Some(config), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        config.extend(extra.clone());
    }
    config.to_string()
}

fn request_header<'a>(flight: &'a InFlight, name: &str) -> Option<&'a str> {
    flight.host.request_headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

/// The limits the request's last charge asked to take something from, by name.
fn charged(flight: &InFlight) -> Vec<String> {
    let charges: Vec<&Value> = flight.host.callouts.iter().filter(|c| c.path == CHARGE_PATH).map(|c| &c.body).collect();
    let last = charges.last().expect("a charge");
    last["limits"]
        .as_array()
        .expect("limits")
        .iter()
        .filter(|l| l["cost"].as_u64().unwrap_or(0) > 0)
        .map(|l| l["name"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn a_refused_request_overflows_to_the_fallback_charged_on_its_limits() {
    let world = World::new(HostKind::Envoy);
    let mut proxy = Proxy::new(&world, &config(json!({})));
    let mut companion = FakeCompanion::default();
    for _ in 0..2 {
        let first = proxy.send(Request::chat("sk-a", BODY), &mut companion);
        assert!(first.forwarded());
        assert_eq!(request_header(&first, HEADER), None, "the primary's room: no overflow");
        assert_eq!(charged(&first), ["primary-rpm", "tenant-rpm"], "the fallback's limit is not the primary's");
    }
    for n in 0..3 {
        let mut over = proxy.send(Request::chat("sk-a", BODY), &mut companion);
        assert!(over.forwarded(), "overflow {n}: sent on instead of a 429");
        assert!(over.host.replies.is_empty());
        assert_eq!(request_header(&over, HEADER), Some("backup"), "the header the route table matches");
        assert_eq!(charged(&over), ["backup-rpm", "tenant-rpm"], "charged on the fallback's and the shared limits");
        assert_eq!(
            over.host.series_value(decision(0, Decision::Overflowed)),
            1,
            "counted under the limit that refused"
        );
        assert_eq!(over.host.metric(Metric::Limited), 0, "an overflow is no refusal");
        let body = usage_reply(10, 5);
        proxy.reply_with_headers(&mut over, 200, "application/json", &[], &[body.as_bytes()]);
        assert_eq!(over.host.response_header_value(HEADER), Some("backup"), "the client sees where it went");
    }
    // The fallback's own limit spent: the 429 names it (nothing overflows twice).
    let refused = proxy.send(Request::chat("sk-a", BODY), &mut companion);
    let reply = refused.replied().expect("refused");
    assert_eq!(reply.status, 429);
    assert!(reply.body.contains("backup-rpm"), "{}", reply.body);
    assert_eq!(refused.host.series_value(decision(1, Decision::Limited)), 1);
    assert_eq!(refused.host.series_value(decision(0, Decision::Overflowed)), 1);
    // Another tenant still has the primary's room.
    let other = proxy.send(Request::chat("sk-b", BODY), &mut companion);
    assert_eq!(request_header(&other, HEADER), None);
}

#[test]
fn a_clients_own_overflow_header_never_reaches_the_route_table() {
    for kind in [HostKind::Envoy, HostKind::Nginx] {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(json!({})));
        let mut companion = FakeCompanion::default();
        let sent = proxy.send(Request::chat("sk-a", BODY).header(HEADER, "backup"), &mut companion);
        assert!(sent.forwarded(), "{kind:?}");
        assert_eq!(request_header(&sent, HEADER), None, "{kind:?}: removed before anything routes on it");
        assert_eq!(charged(&sent), ["primary-rpm", "tenant-rpm"]);
    }
}

#[test]
fn where_the_headers_went_ahead_only_a_host_that_routes_after_the_body_overflows() {
    // Envoy without held headers has routed when the body is decided: the 429 stands.
    // ngx_wasm_module runs the filter's body callbacks in its content handler, before the
    // location's `proxy_pass` evaluates its variables: the request overflows. (A token
    // limit: the decision waits for the body.)
    let limits = json!([
        {"name": "primary-rpm", "requests": 2, "window": "1m", "overflow": "backup"},
        {"name": "backup-rpm", "requests": 3, "window": "1m", "backend": "backup"},
        {"name": "tenant-tpm", "tokens": 100000, "window": "1m"}]);
    let hosts = [(HostKind::Envoy, json!({"hold_request_headers": false}), false), (HostKind::Nginx, json!({}), true)];
    for (kind, mut extra, overflows) in hosts {
        extra["limits"] = limits.clone();
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(extra));
        let mut companion = FakeCompanion::default();
        for _ in 0..2 {
            assert!(proxy.send(Request::chat("sk-a", BODY), &mut companion).forwarded());
        }
        let third = proxy.send(Request::chat("sk-a", BODY), &mut companion);
        assert_eq!(third.forwarded(), overflows, "{kind:?}");
        assert_eq!(third.replied().map(|r| r.status), (!overflows).then_some(429), "{kind:?}");
        assert_eq!(request_header(&third, HEADER), overflows.then_some("backup"), "{kind:?}");
    }
}

#[test]
fn a_request_decided_on_its_headers_overflows_on_both_hosts() {
    // Requests limits only, no model: decided before any body (a GET has none).
    for kind in [HostKind::Envoy, HostKind::Nginx] {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(json!({})));
        let mut companion = FakeCompanion::default();
        for _ in 0..2 {
            assert!(proxy.send(Request::get("sk-a", "/v1/models"), &mut companion).forwarded());
        }
        let over = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
        assert!(over.forwarded(), "{kind:?}");
        assert_eq!(request_header(&over, HEADER), Some("backup"), "{kind:?}");
    }
}

#[test]
fn while_the_provider_refuses_a_request_goes_to_its_overflow_and_hears_the_fallbacks_word_apart() {
    let world = World::new(HostKind::Envoy);
    let limits = json!({"limits": [{"name": "rpm", "requests": 1000, "window": "1m"}],
                        "provider_limits": {"enabled": true, "share": false, "overflow": "backup"}});
    let mut proxy = Proxy::new(&world, &config(limits));
    let mut companion = FakeCompanion::default();
    let mut first = proxy.send(Request::chat("sk-a", BODY), &mut companion);
    let refusal = r#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#;
    proxy.reply_with_headers(&mut first, 429, "application/json", &[("retry-after", "20")], &[refusal.as_bytes()]);
    // The primary provider refuses for 20 s: the next requests go to the fallback.
    let mut over = proxy.send(Request::chat("sk-a", BODY), &mut companion);
    assert!(over.forwarded());
    assert_eq!(request_header(&over, HEADER), Some("backup"));
    assert_eq!(over.host.metric(Metric::ProviderOverflowed), 1);
    assert_eq!(over.host.metric(Metric::ProviderRefusalsAnswered), 0);
    // The fallback refuses too: its word is kept under its own key, the primary's stands.
    proxy.reply_with_headers(&mut over, 429, "application/json", &[("retry-after", "5")], &[refusal.as_bytes()]);
    let both_out = proxy.send(Request::chat("sk-a", BODY), &mut companion);
    let reply = both_out.replied().expect("answered here");
    assert_eq!(reply.status, 429);
    let wait = reply.headers.iter().find(|(n, _)| *n == "retry-after").map(|(_, v)| v.as_str());
    assert_eq!(wait, Some("5"), "the fallback's own retry time");
    assert_eq!(both_out.host.metric(Metric::ProviderRefusalsAnswered), 1);
    // Another credential has neither refusal.
    let other = proxy.send(Request::chat("sk-b", BODY), &mut companion);
    assert_eq!(request_header(&other, HEADER), None);
}

/// Shadow mode refuses nothing, so nothing overflows; a request enforcement would have
/// sent to its overflow backend says so in its shadow header (`overflow`, not the 429 it
/// never would have got), one with no overflow to go to says 429.
#[test]
fn in_shadow_mode_nothing_overflows_and_the_shadow_header_says_where_it_would_have_gone() {
    for kind in [HostKind::Envoy, HostKind::Nginx] {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(json!({"mode": "shadow"})));
        let mut companion = FakeCompanion::default();
        let shadow = |proxy: &mut Proxy, companion: &mut FakeCompanion, body: &str| {
            let mut flight = proxy.send(Request::chat("sk-a", body), companion);
            assert!(flight.forwarded(), "{kind:?}");
            assert_eq!(request_header(&flight, HEADER), None, "{kind:?}: nothing overflows");
            proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(5, 5)]);
            flight.host.response_header_value("x-llm-ratelimit-shadow").map(str::to_string)
        };
        let marks: Vec<Option<String>> = (0..4).map(|_| shadow(&mut proxy, &mut companion, BODY)).collect();
        assert_eq!(marks, [None, None, Some("overflow".into()), Some("overflow".into())], "{kind:?}");
        // A limit without an overflow: enforcement would have answered 429.
        let limits = json!([{"name": "rpm", "requests": 1, "window": "1m"}]);
        let mut proxy = Proxy::new(&world, &super::tests::config(limits, json!({"mode": "shadow"})));
        let marks: Vec<Option<String>> = (0..2).map(|_| shadow(&mut proxy, &mut companion, BODY)).collect();
        assert_eq!(marks, [None, Some("429".into())], "{kind:?}");
    }
}
