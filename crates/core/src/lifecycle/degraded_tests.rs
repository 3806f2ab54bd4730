//! The degraded mode (`failure_mode: "local"`) counts with the local limiter, the local
//! store's exact counters (issue 46): a sliding window is the window, not a bucket that
//! refills; a concurrency slot is held, renewed while its request is in flight, released
//! when it ends, and lost by a worker that stops renewing it; a window takes back what a
//! request reserved and did not use.

use super::tests::config;
use crate::effects::host::HostKind;
use crate::testing::{advance, usage_reply, FakeCompanion, Proxy, Request, World};
use serde_json::json;
use std::cell::RefCell;
use std::rc::Rc;

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];
const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;

fn degraded(limits: &serde_json::Value) -> String {
    config(
        limits.clone(),
        json!({"failure_mode": "local", "fallback": {"breaker_failures": 1}, "slots": {"ttl": "3s"}}),
    )
}

/// A proxy on `kind` with these limits in the degraded mode, and a companion that fails.
fn outage(kind: HostKind, limits: &serde_json::Value) -> (Rc<RefCell<World>>, Proxy, FakeCompanion) {
    let world = World::new(kind);
    let proxy = Proxy::new(&world, &degraded(limits));
    (world, proxy, FakeCompanion::failing(500))
}

fn status(proxy: &mut Proxy, companion: &mut FakeCompanion, key: &str) -> Option<u32> {
    let mut flight = proxy.send(Request::get(key, "/v1/models"), companion);
    proxy.done(&mut flight);
    flight.replied().map(|r| r.status)
}

/// Four a minute, all at the start: half a minute later a bucket of four a minute has
/// refilled two (what the degraded mode admitted until issue 46); the window still holds
/// all four until the first leaves it, a minute after it was admitted.
#[test]
fn a_sliding_window_in_the_degraded_mode_is_exact() {
    for kind in HOSTS {
        let limits = json!([{"name": "rpw", "requests": 4, "window": "1m", "algorithm": "sliding_window"}]);
        let (world, mut proxy, mut companion) = outage(kind, &limits);
        let first: Vec<Option<u32>> = (0..5).map(|_| status(&mut proxy, &mut companion, "sk-a")).collect();
        assert_eq!(first, [None, None, None, None, Some(429)], "{kind:?}");
        advance(&world, 30_000);
        let flight = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
        let reply = flight.replied().expect("refused");
        assert_eq!(reply.status, 429, "{kind:?}: a bucket would have refilled two by now");
        let retry = reply.headers.iter().find(|(n, _)| *n == "retry-after").map(|(_, v)| v.clone());
        assert_eq!(retry.as_deref(), Some("30"), "{kind:?}: until the first call leaves the window");
        let mode = reply.headers.iter().find(|(n, _)| *n == "x-llm-ratelimit-degraded").map(|(_, v)| v.as_str());
        assert_eq!(mode, Some("local"), "{kind:?}");
        advance(&world, 30_000);
        let again: Vec<Option<u32>> = (0..5).map(|_| status(&mut proxy, &mut companion, "sk-a")).collect();
        assert_eq!(again, [None, None, None, None, Some(429)], "{kind:?}: the window has moved on");
    }
}

/// A slot is held while its request streams, longer than `slots.ttl`, because the worker
/// renews it on its tick as the local store's; it comes back when the request ends. A
/// worker that stops renewing (its proxy crashed) loses it once the ttl has passed.
#[test]
fn a_degraded_slot_is_renewed_while_in_flight_and_released_at_the_end() {
    for kind in HOSTS {
        let limits = json!([{"name": "inflight", "concurrency": 1}]);
        let (world, mut proxy, mut companion) = outage(kind, &limits);
        let mut open = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
        assert!(open.forwarded(), "{kind:?}");
        assert_eq!(status(&mut proxy, &mut companion, "sk-a"), Some(429), "{kind:?}: the one slot is held");
        for _ in 0..200 {
            advance(&world, 50); // 10 s of ticks, past the 3 s ttl
            proxy.tick(Some(&mut companion));
        }
        assert_eq!(status(&mut proxy, &mut companion, "sk-a"), Some(429), "{kind:?}: renewed, still held");
        proxy.reply(&mut open, 200, "application/json", &["{}"]);
        assert_eq!(status(&mut proxy, &mut companion, "sk-a"), None, "{kind:?}: released at the end");

        // Another worker of the proxy shares the slot; this one stops ticking.
        let mut other = Proxy::new(&world, &degraded(&limits));
        let open = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
        assert!(open.forwarded(), "{kind:?}");
        assert_eq!(status(&mut other, &mut companion, "sk-a"), Some(429), "{kind:?}: held across workers");
        for _ in 0..80 {
            advance(&world, 50);
            other.tick(Some(&mut companion));
        }
        assert_eq!(status(&mut other, &mut companion, "sk-a"), None, "{kind:?}: not renewed, it expired");
    }
}

/// A window takes back what a request reserved and did not use when it settles, as the
/// local store's does: three chats reserve 927 of 1,000 tokens, use 14 each, and a fourth
/// finds room (Redis is told the same credits, as
/// `what_was_admitted_locally_is_reconciled_with_redis` pins).
#[test]
fn a_degraded_window_takes_back_what_a_request_did_not_use() {
    for kind in HOSTS {
        let limits = json!([{"name": "tpw", "tokens": 1000, "window": "1m", "algorithm": "sliding_window"}]);
        let (_world, mut proxy, mut companion) = outage(kind, &limits);
        let mut flights: Vec<_> = (0..3).map(|_| proxy.send(Request::chat("sk-a", CHAT), &mut companion)).collect();
        assert!(flights.iter().all(|f| f.forwarded()), "{kind:?}");
        assert_eq!(proxy.send(Request::chat("sk-a", CHAT), &mut companion).replied().map(|r| r.status), Some(429));
        for flight in &mut flights {
            proxy.reply(flight, 200, "application/json", &[&usage_reply(9, 5)]);
        }
        let fourth = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        assert!(fourth.forwarded(), "{kind:?}: the unused reservations came back");
    }
}
