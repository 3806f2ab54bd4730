//! The lifecycle on the fake host for plans set at runtime (issue 44): a suspension is a
//! 403 in the caller's shape that no SDK retries; a plan's capacity shows in the headers;
//! what the VM saw of the plans holds through an outage; a suspension ends this proxy's
//! leases of the owner.

use super::tests::{config, tenant};
use crate::effects::host::{HostKind, Metric};
use crate::testing::{advance, FakeCompanion, FakePlan, InFlight, Proxy, Request, World};
use serde_json::{json, Value};

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];

fn header<'a>(flight: &'a InFlight, name: &str) -> Option<&'a str> {
    flight.replied()?.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
}

fn body(flight: &InFlight) -> Value {
    serde_json::from_str(&flight.replied().expect("a local reply").body).expect("a JSON body")
}

fn suspended(reason: &str) -> FakePlan {
    FakePlan { suspended: Some(reason.into()), ..FakePlan::default() }
}

fn capacity(limit: &str, capacity: u64) -> FakePlan {
    FakePlan { capacities: [(limit.to_string(), capacity)].into(), ..FakePlan::default() }
}

#[test]
fn a_suspended_key_is_refused_403_in_its_apis_shape_and_no_sdk_retries_it() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy =
            Proxy::new(&world, &config(json!([{"name": "rpm", "requests": 10, "window": "1m"}]), json!({})));
        let mut companion = FakeCompanion::default();
        companion.plans.insert(tenant("sk-a"), suspended("key leaked, rotate it"));
        let refused = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
        assert_eq!(refused.replied().map(|r| r.status), Some(403), "{kind:?}");
        assert_eq!(header(&refused, "x-should-retry"), Some("false"), "{kind:?}");
        assert_eq!(header(&refused, "retry-after"), None, "{kind:?}");
        let error = &body(&refused)["error"];
        assert_eq!((&error["type"], &error["code"]), (&json!("permission_error"), &json!("account_suspended")));
        let message = error["message"].as_str().unwrap_or_default();
        assert!(message.contains("This API key is suspended: key leaked, rotate it"), "{message}");
        assert_eq!(refused.host.metric(Metric::Suspended), 1, "{kind:?}");
        // Another key is not touched; lifted, the key goes through on its next request.
        assert!(proxy.send(Request::get("sk-b", "/v1/models"), &mut companion).forwarded(), "{kind:?}");
        companion.plans.clear();
        assert!(proxy.send(Request::get("sk-a", "/v1/models"), &mut companion).forwarded(), "{kind:?}");
    }
}

#[test]
fn a_suspended_team_is_named_as_the_team_not_the_key() {
    let world = World::new(HostKind::Envoy);
    let limits = json!([{"name": "team-rpm", "requests": 100, "window": "1m", "per": {"header": "x-team"}}]);
    let mut proxy = Proxy::new(&world, &config(limits, json!({})));
    let mut companion = FakeCompanion::default();
    companion.plans.insert(crate::plan::pools::pool_owner("x-team", "red"), suspended("invoice unpaid"));
    let red = proxy.send(Request::get("sk-a", "/v1/models").header("x-team", "red"), &mut companion);
    assert_eq!(red.replied().map(|r| r.status), Some(403));
    let message = body(&red)["error"]["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("The x-team this request counts under is suspended: invoice unpaid"), "{message}");
    assert!(!message.contains("red"), "the header's value is not echoed: {message}");
    let blue = proxy.send(Request::get("sk-a", "/v1/models").header("x-team", "blue"), &mut companion);
    assert!(blue.forwarded());
}

#[test]
fn a_plans_capacity_is_the_one_enforced_and_shown() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(json!([{"name": "rpm", "requests": 1, "window": "1m"}]), json!({})));
        let mut companion = FakeCompanion::default();
        companion.plans.insert(tenant("sk-a"), capacity("rpm", 3));
        for i in 0..3 {
            let flight = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
            assert!(flight.forwarded(), "{kind:?}: request {i}");
        }
        let fourth = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
        assert_eq!(fourth.replied().map(|r| r.status), Some(429), "{kind:?}");
        assert_eq!(header(&fourth, "x-ratelimit-limit-requests"), Some("3"), "{kind:?}");
    }
}

/// Without Redis the degraded mode decides with what the VM saw of the plans: a key seen
/// suspended stays refused, a key seen with a larger capacity gets its share of it.
#[test]
fn what_the_vm_saw_of_the_plans_holds_through_an_outage() {
    for kind in HOSTS {
        let world = World::new(kind);
        let extra = json!({"failure_mode": "local", "fallback": {"instances": 1}});
        let mut proxy = Proxy::new(&world, &config(json!([{"name": "rpm", "requests": 1, "window": "1m"}]), extra));
        let mut companion = FakeCompanion::default();
        companion.plans.insert(tenant("sk-a"), suspended("key leaked"));
        companion.plans.insert(tenant("sk-b"), capacity("rpm", 10));
        assert_eq!(
            proxy.send(Request::get("sk-a", "/v1/models"), &mut companion).replied().map(|r| r.status),
            Some(403)
        );
        assert!(proxy.send(Request::get("sk-b", "/v1/models"), &mut companion).forwarded(), "{kind:?}");
        companion.failing = Some(500);
        let during = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
        assert_eq!(during.replied().map(|r| r.status), Some(403), "{kind:?}: still suspended");
        assert_eq!(header(&during, "x-llm-ratelimit-degraded"), Some("local"), "{kind:?}");
        let admitted = (0..5).filter(|_| proxy.send(Request::get("sk-b", "/v1/models"), &mut companion).forwarded());
        assert_eq!(admitted.count(), 5, "{kind:?}: the plan's 10, not the config's 1");
        let unplanned = (0..3).filter(|_| proxy.send(Request::get("sk-c", "/v1/models"), &mut companion).forwarded());
        assert_eq!(unplanned.count(), 1, "{kind:?}: the config's 1");
    }
}

/// A suspension reaches a leasing proxy within one `lease.ttl`: its lease admits until it
/// expires, and the next grant is refused; the refusal ends the proxy's lease at once
/// rather than at its expiry (a renewal's refusal too).
#[test]
fn a_suspension_ends_a_leasing_proxys_lease_within_one_lease_ttl() {
    for kind in HOSTS {
        let world = World::new(kind);
        let extra = json!({"lease": {"enabled": true, "ttl": "2s", "initial_fraction": 0.5, "max_fraction": 0.5}});
        let mut proxy = Proxy::new(&world, &config(json!([{"name": "rpm", "requests": 100, "window": "1m"}]), extra));
        let mut companion = FakeCompanion::default();
        for _ in 0..3 {
            assert!(proxy.send(Request::get("sk-a", "/v1/models"), &mut companion).forwarded(), "{kind:?}");
        }
        assert!(companion.calls.contains_key(crate::protocol::LEASE_PATH), "{kind:?}: leasing");
        companion.plans.insert(tenant("sk-a"), suspended("paused"));
        // Within the lease's life it still admits (the bound), never past it.
        let mut refused_at = None;
        for step in 0..30 {
            advance(&world, 100);
            let flight = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
            proxy.tick(Some(&mut companion));
            if flight.replied().map(|r| r.status) == Some(403) {
                refused_at = Some(step * 100 + 100);
                break;
            }
        }
        let refused_at = refused_at.expect("refused within the lease's ttl");
        assert!(refused_at <= 2_100, "{kind:?}: refused after {refused_at} ms");
        // And from then on, every request.
        for _ in 0..3 {
            let flight = proxy.send(Request::get("sk-a", "/v1/models"), &mut companion);
            assert_eq!(flight.replied().map(|r| r.status), Some(403), "{kind:?}");
        }
    }
}

fn chat_as(key: &str, user: Option<&str>) -> Request {
    let user = user.map_or(String::new(), |u| format!(r#","user":"{u}""#));
    Request::chat(
        key,
        &format!(r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"hi"}}],"max_tokens":5{user}}}"#),
    )
}

/// One application key, its users counted apart (OpenAI's `user`): one user's plan holds
/// for that user, another user of the same key is unaffected; a request naming no user
/// is refused 400 where the limit has no default user.
#[test]
fn an_end_users_plan_holds_inside_a_shared_key_and_the_others_are_unaffected() {
    for kind in HOSTS {
        let world = World::new(kind);
        let limits = json!([{"name": "user-rpm", "requests": 1, "window": "1m", "per": "end_user"}]);
        let mut proxy = Proxy::new(&world, &config(limits, json!({})));
        let mut companion = FakeCompanion::default();
        let alice = crate::plan::pools::end_user_owner(&tenant("sk-app"), "alice");
        companion.plans.insert(alice, capacity("user-rpm", 3));
        let sent = |proxy: &mut Proxy, companion: &mut FakeCompanion, user| {
            (0..4).filter(|_| proxy.send(chat_as("sk-app", user), companion).forwarded()).count()
        };
        assert_eq!(sent(&mut proxy, &mut companion, Some("alice")), 3, "{kind:?}: alice's plan");
        assert_eq!(sent(&mut proxy, &mut companion, Some("bob")), 1, "{kind:?}: bob, the config's 1");
        // Another key's alice is another owner.
        assert_eq!(
            (0..4).filter(|_| proxy.send(chat_as("sk-other", Some("alice")), &mut companion).forwarded()).count(),
            1
        );
        let nobody = proxy.send(chat_as("sk-app", None), &mut companion);
        assert_eq!(nobody.replied().map(|r| r.status), Some(400), "{kind:?}");
        assert_eq!(body(&nobody)["error"]["code"], "missing_end_user", "{kind:?}");
        // Suspending one user leaves the others.
        companion.plans.insert(crate::plan::pools::end_user_owner(&tenant("sk-app"), "carol"), suspended("abuse"));
        let carol = proxy.send(chat_as("sk-app", Some("carol")), &mut companion);
        assert_eq!(carol.replied().map(|r| r.status), Some(403), "{kind:?}");
        assert!(body(&carol)["error"]["message"].as_str().is_some_and(|m| m.contains("This end user is suspended")));
        assert!(proxy.send(chat_as("sk-app", Some("dave")), &mut companion).forwarded(), "{kind:?}");
    }
}

/// From a trusted header, with a default user for requests without one; Anthropic's
/// `metadata.user_id` from the body.
#[test]
fn an_end_user_is_read_from_a_trusted_header_with_a_default_or_from_anthropics_metadata() {
    let world = World::new(HostKind::Envoy);
    let limits = json!([
        {"name": "by-header", "requests": 1, "window": "1m", "per": {"end_user": {"header": "x-end-user"}, "default": "anyone"}},
    ]);
    let mut proxy = Proxy::new(&world, &config(limits, json!({})));
    let mut companion = FakeCompanion::default();
    let as_header = |user: &str| Request::get("sk-a", "/v1/models").header("x-end-user", user);
    assert!(proxy.send(as_header("u1"), &mut companion).forwarded());
    assert!(!proxy.send(as_header("u1"), &mut companion).forwarded());
    assert!(proxy.send(as_header("u2"), &mut companion).forwarded());
    assert!(proxy.send(Request::get("sk-a", "/v1/models"), &mut companion).forwarded(), "the default user");
    assert!(!proxy.send(Request::get("sk-a", "/v1/models"), &mut companion).forwarded(), "the default user, once");

    let world = World::new(HostKind::Envoy);
    let limits = json!([{"name": "user-rpm", "requests": 1, "window": "1m", "per": "end_user"}]);
    let mut proxy = Proxy::new(&world, &config(limits, json!({})));
    let messages = |user: &str| {
        let body = format!(
            r#"{{"model":"claude-sonnet-4-5","max_tokens":5,"messages":[{{"role":"user","content":"hi"}}],"metadata":{{"user_id":"{user}"}}}}"#
        );
        let mut request = Request::chat("sk-a", &body);
        for (name, value) in &mut request.headers {
            if name == ":path" {
                *value = "/v1/messages".into();
            }
        }
        request
    };
    assert!(proxy.send(messages("m1"), &mut companion).forwarded());
    assert!(!proxy.send(messages("m1"), &mut companion).forwarded());
    assert!(proxy.send(messages("m2"), &mut companion).forwarded());
}
