//! This filter beside an older companion (docs/companion.md, Upgrading): such a
//! companion refuses (400) the fields it does not know and does not serve the
//! calibration exchange (404). Each refusal costs what docs/companion.md lists, on both hosts.

use super::tests::{config, settle};
use crate::effects::host::{HostKind, Metric};
use crate::protocol::{ChargeRequest, CALIBRATION_PATH, SETTLE_PATH};
use crate::testing::{advance, usage_reply, FakeCompanion, Proxy, Request, World};
use serde_json::json;

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];
const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;

/// A companion of the release before `provisional`, the calibration exchange,
/// `stand_in`, `once` and `look_only`.
fn older_companion() -> FakeCompanion {
    let mut companion = FakeCompanion::default();
    companion.unknown_fields = vec!["provisional", "stand_in", "once", "look_only"];
    companion.unknown_paths = vec![CALIBRATION_PATH];
    companion
}

fn status(flight: &crate::testing::InFlight) -> Option<u32> {
    flight.replied().map(|reply| reply.status)
}

/// A limit that does not apply to the request goes out `look_only`: refused, the request
/// fails over to `failure_mode`; a request every limit applies to is served as before.
#[test]
fn a_look_only_limit_fails_the_request_over_to_failure_mode() {
    for kind in HOSTS {
        let world = World::new(kind);
        let limits = json!([{"name": "rpm", "requests": 100, "window": "1m"},
                            {"name": "mini_tpm", "tokens": 1000, "window": "1m", "models": ["gpt-4o-mini"]}]);
        let mut proxy = Proxy::new(&world, &config(limits, json!({"failure_mode": "deny"})));
        let mut companion = older_companion();
        let other_model = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        let sent: ChargeRequest = serde_json::from_value(other_model.host.last_callout().body.clone()).expect("charge");
        assert!(sent.limits[1].look_only, "{kind:?}");
        assert_eq!(status(&other_model), Some(503), "{kind:?}: refused by the companion, denied here");
        let mini = CHAT.replace("gpt-4o", "gpt-4o-mini");
        assert!(proxy.send(Request::chat("sk-a", &mini), &mut companion).forwarded(), "{kind:?}");
    }
}

/// A charge that may wait in the queue marks its token limits `provisional`: refused.
#[test]
fn a_charge_that_may_wait_in_the_queue_fails_over_to_failure_mode() {
    for kind in HOSTS {
        let world = World::new(kind);
        let limits = json!([{"name": "tpm", "tokens": 10000, "window": "1m"}]);
        let queued = json!({"failure_mode": "deny", "queue": {"max_wait": "5s"}});
        let mut proxy = Proxy::new(&world, &config(limits.clone(), queued));
        let mut companion = older_companion();
        assert_eq!(status(&proxy.send(Request::chat("sk-a", CHAT), &mut companion)), Some(503), "{kind:?}");
        // With the queue off, the same charge goes through.
        let mut proxy = Proxy::new(&world, &config(limits, json!({"failure_mode": "deny"})));
        assert!(proxy.send(Request::chat("sk-a", CHAT), &mut companion).forwarded(), "{kind:?}");
    }
}

/// The calibration exchange answered 404: the proxy learns alone, as before the exchange.
#[test]
fn without_the_calibration_exchange_a_proxy_learns_alone() {
    for kind in HOSTS {
        let world = World::new(kind);
        let limits = json!([{"name": "tpm", "tokens": 10000, "window": "1m"}]);
        let mut proxy = Proxy::new(&world, &config(limits, json!({})));
        let mut companion = older_companion();
        proxy.tick(Some(&mut companion));
        let mut flight = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(21, 41)]);
        for _ in 0..40 {
            advance(&world, 50);
            proxy.tick(Some(&mut companion));
        }
        assert_eq!(companion.calls.get(CALIBRATION_PATH), Some(&2), "{kind:?}: asked, 404, asked again a second later");
        assert_eq!(
            proxy.root.gauges.get("model_rule=.=gpt-4o;.;llm_ratelimit_prompt_factor_thousandths"),
            Some(&2333),
            "{kind:?}: 21 counted by the provider for 9 here, learned by this proxy"
        );
        assert_eq!(proxy.root.metric(Metric::SettlementsFailed), 0, "{kind:?}: the settlement went through");
    }
}

/// A local admission after an unanswered charge settles as a `stand_in`: refused, the
/// admission never reaches Redis; the whole batch it went in is refused with it, so the
/// settlement of a request the companion charged beside it is given up alike, after
/// its retries (its reservation stays charged).
#[test]
fn a_stand_in_is_refused_with_its_batch_and_the_admission_never_reaches_redis() {
    for kind in HOSTS {
        let world = World::new(kind);
        let limits = json!([{"name": "tph", "tokens": 10000, "window": "1h"}]);
        let extra = json!({"failure_mode": "local", "fallback": {"breaker_failures": 100}});
        let mut proxy = Proxy::new(&world, &config(limits, extra));
        let mut companion = older_companion();
        let mut local = proxy.start(Request::chat("sk-a", CHAT));
        let charge: ChargeRequest = serde_json::from_value(local.host.last_callout().body.clone()).expect("charge");
        proxy.time_out(&mut local);
        assert!(local.forwarded(), "{kind:?}: admitted locally");
        let mut charged = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        assert!(charged.forwarded(), "{kind:?}: charged by the companion");
        let reserved = companion.level(&charge.tenant, &charge.limits[0], proxy.now());
        proxy.reply(&mut local, 200, "application/json", &[&usage_reply(9, 41)]);
        proxy.reply(&mut charged, 200, "application/json", &[&usage_reply(9, 41)]);
        for _ in 0..200 {
            advance(&world, 100);
            settle(&mut proxy, &mut companion);
        }
        let attempts = companion.calls.get(SETTLE_PATH).copied().unwrap_or(0);
        assert_eq!(attempts, crate::effects::settle_queue::MAX_ATTEMPTS as usize, "{kind:?}: tried, then given up");
        // The stand-in, the local admission's own settlement against it, and the charged one's.
        assert_eq!(proxy.root.metric(Metric::SettlementsFailed), 3, "{kind:?}");
        let level = companion.level(&charge.tenant, &charge.limits[0], proxy.now());
        // Twenty seconds refill 55 of 10,000 an hour; nothing else moved.
        assert!((level - (reserved + 20_000.0 * 10_000.0 / 3_600_000.0)).abs() < 1.0, "{kind:?}: {reserved} {level}");
    }
}

/// A returned lease carries a `once` id: refused, the lease's remainder stays charged
/// until its window passes.
#[test]
fn a_returned_lease_is_refused_and_its_remainder_stays_charged() {
    for kind in HOSTS {
        let world = World::new(kind);
        let limits = json!([{"name": "rpm", "requests": 600, "window": "1m"}]);
        let mut proxy = Proxy::new(&world, &config(limits, json!({"lease": {"enabled": true}})));
        let mut companion = older_companion();
        for _ in 0..3 {
            proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
        }
        assert!(companion.calls.contains_key(crate::protocol::LEASE_PATH), "{kind:?}: a lease was granted");
        let charge = crate::testing::spec("rpm", 600, 60_000, 0, None, crate::protocol::LimitKind::TokenBucket);
        let tenant = crate::api::identity::tenant_id("sk-a");
        let leased = companion.level(&tenant, &charge, proxy.now());
        // Its lease runs out unused and is returned: the older companion refuses the return.
        for _ in 0..100 {
            advance(&world, 100);
            settle(&mut proxy, &mut companion);
        }
        assert!(companion.calls.contains_key(SETTLE_PATH), "{kind:?}: the return was sent");
        let after = companion.level(&tenant, &charge, proxy.now());
        // Ten seconds refilled 100 of the 600 a minute; nothing came back from the lease.
        assert!((after - (leased + 100.0).min(600.0)).abs() < 1.0, "{kind:?}: {leased} then {after}");
        assert!(companion.settled.is_empty(), "{kind:?}: no return applied");
    }
}
