//! Requests whose limits are counted per different things (`limits[].per`), and shadow
//! limits, through the whole lifecycle on the fake host, for every host kind.

use crate::effects::host::HostKind;
use crate::plan::pools::pool_owner;
use crate::protocol::{ChargeRequest, FairClaim, LimitCharge, LimitKind};
use crate::testing::{usage_reply, FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::json;

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];
const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;

fn config(limits: serde_json::Value) -> String {
    super::tests::config(limits, json!({}))
}

fn charge_of(flight: &InFlight) -> ChargeRequest {
    serde_json::from_value(flight.host.last_callout().body.clone()).expect("a charge")
}

/// A requests limit's counter, as the fake companion holds it.
fn requests(name: &str, capacity: u64, owner: Option<String>) -> LimitCharge {
    LimitCharge {
        name: name.into(),
        capacity,
        window_ms: 60_000,
        cost: 0,
        min_cost: None,
        kind: LimitKind::TokenBucket,
        period_bounds_ms: Vec::new(),
        provisional: false,
        look_only: false,
        shadow: false,
        owner,
        fair: None,
    }
}

fn key_team_upstream() -> String {
    config(json!([
        {"name": "key", "requests": 10, "window": "1m"},
        {"name": "team", "requests": 3, "window": "1m", "per": {"header": "x-team-id"}},
        {"name": "upstream", "requests": 5, "window": "1m", "per": "all", "models": ["gpt-4o*"]},
    ]))
}

#[test]
fn a_key_team_and_upstream_limit_are_charged_together_and_refused_together() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &key_team_upstream());
        let mut companion = FakeCompanion::default();
        let team_a = pool_owner("x-team-id", "team-a");
        for i in 0..3 {
            let chat = proxy.send(Request::chat("sk-a", CHAT).header("x-team-id", "team-a"), &mut companion);
            assert!(chat.forwarded(), "{kind:?} request {i}");
            let charge = charge_of(&chat);
            let owners: Vec<Option<&str>> = charge.limits.iter().map(|l| l.owner.as_deref()).collect();
            assert_eq!(owners, [None, Some(team_a.as_str()), Some("all")], "{kind:?}");
            assert!(!chat.host.last_callout().body.to_string().contains("team-a"), "a header value is never sent");
        }
        // Team A's pool is spent: the fourth request is refused, and charged nowhere.
        let refused = proxy.send(Request::chat("sk-a", CHAT).header("x-team-id", "team-a"), &mut companion);
        assert_eq!(refused.replied().map(|r| r.status), Some(429), "{kind:?}");
        let now = proxy.now();
        let key_a = crate::api::identity::tenant_id("sk-a");
        assert_eq!(companion.level(&key_a, &requests("key", 10, None), now), 7.0, "{kind:?}");
        assert_eq!(companion.level(&key_a, &requests("upstream", 5, Some("all".into())), now), 2.0, "{kind:?}");
        // Another key of another team shares the upstream's quota only.
        for _ in 0..2 {
            let chat = proxy.send(Request::chat("sk-b", CHAT).header("x-team-id", "team-b"), &mut companion);
            assert!(chat.forwarded(), "{kind:?}");
        }
        let refused = proxy.send(Request::chat("sk-b", CHAT).header("x-team-id", "team-b"), &mut companion);
        assert_eq!(refused.replied().map(|r| r.status), Some(429), "{kind:?}: the upstream quota is spent");
        let key_b = crate::api::identity::tenant_id("sk-b");
        let team_b = pool_owner("x-team-id", "team-b");
        assert_eq!(companion.level(&key_b, &requests("key", 10, None), now), 8.0, "{kind:?}");
        assert_eq!(companion.level(&key_b, &requests("team", 3, Some(team_b)), now), 1.0, "{kind:?}");
        // Another model is not the upstream quota's: it still goes.
        let other = r#"{"model":"o3","messages":[{"role":"user","content":"hi"}]}"#;
        let chat = proxy.send(Request::chat("sk-b", other).header("x-team-id", "team-b"), &mut companion);
        assert!(chat.forwarded(), "{kind:?}");
    }
}

#[test]
fn a_missing_header_leaves_its_limit_out_or_counts_under_the_default_and_a_repeated_one_is_refused() {
    for kind in HOSTS {
        let world = World::new(kind);
        let config = config(json!([
            {"name": "key", "requests": 10, "window": "1m"},
            {"name": "team", "requests": 1, "window": "1m", "per": {"header": "x-team-id"}},
            {"name": "org", "requests": 2, "window": "1m", "per": {"header": "x-org-id", "default": "no-org"}},
        ]));
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        for i in 0..2 {
            let chat = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
            assert!(chat.forwarded(), "{kind:?} {i}: no team header, the team limit does not apply");
            let charge = charge_of(&chat);
            assert!(charge.limits[1].look_only && charge.limits[1].cost == 0, "{kind:?}");
            assert_eq!(charge.limits[2].owner, Some(pool_owner("x-org-id", "no-org")), "{kind:?}");
        }
        let third = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
        assert_eq!(third.replied().map(|r| r.status), Some(429), "{kind:?}: the default org's pool is spent");
        let twice = Request::chat("sk-a", CHAT).header("x-team-id", "a").header("x-team-id", "b");
        let twice = proxy.send(twice, &mut companion);
        let reply = twice.replied().expect("a local reply");
        assert_eq!(reply.status, 400, "{kind:?}");
        assert!(reply.body.contains("x-team-id"), "{}", reply.body);
    }
}

#[test]
fn a_shadow_limit_is_charged_and_reported_but_refuses_nothing() {
    for kind in HOSTS {
        let world = World::new(kind);
        let config = config(json!([
            {"name": "key", "requests": 10, "window": "1m"},
            {"name": "trial", "requests": 1, "window": "1m", "per": "all", "mode": "shadow"},
        ]));
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        for i in 0..3 {
            let chat = proxy.send(Request::chat("sk-a", CHAT), &mut companion);
            assert!(chat.forwarded(), "{kind:?} {i}: the shadow limit never refuses");
            assert!(charge_of(&chat).limits[1].shadow);
        }
        let now = proxy.now();
        let tenant = crate::api::identity::tenant_id("sk-a");
        assert_eq!(companion.level(&tenant, &requests("key", 10, None), now), 7.0, "{kind:?}");
        // Charged all the same: overdrawn by two.
        let trial = requests("trial", 1, Some("all".into()));
        assert!(companion.level(&tenant, &trial, now) <= 0.0, "{kind:?}");
    }
}

#[test]
fn a_team_token_pool_is_settled_on_the_team_counter() {
    for kind in HOSTS {
        let world = World::new(kind);
        let config = config(json!([
            {"name": "key_tpm", "tokens": 10000, "window": "1m"},
            {"name": "team_tpm", "tokens": 5000, "window": "1m", "per": {"header": "x-team-id"}},
        ]));
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        let mut chat = proxy.send(Request::chat("sk-a", CHAT).header("x-team-id", "t1"), &mut companion);
        assert!(chat.forwarded(), "{kind:?}");
        proxy.reply(&mut chat, 200, "application/json", &[&usage_reply(9, 41)]);
        let settled = super::tests::settle(&mut proxy, &mut companion);
        assert_eq!(settled.len(), 1, "{kind:?}");
        let owners: Vec<Option<String>> = settled[0].limits.iter().map(|l| l.owner.clone()).collect();
        assert_eq!(owners, [None, Some(pool_owner("x-team-id", "t1"))], "{kind:?}");
        let team = LimitCharge { window_ms: 60_000, ..requests("team_tpm", 5000, Some(pool_owner("x-team-id", "t1"))) };
        let now = proxy.now();
        let level = companion.level(&crate::api::identity::tenant_id("sk-a"), &team, now);
        // 50 tokens used (9 + 41), a little refilled since.
        assert!((4950.0..4960.0).contains(&level), "{kind:?}: team pool at {level}");
    }
}

/// A pool with fair shares (`limits[].fair_share`): each request claims it as its tenant,
/// weighted by its tier; a heavy tenant is held to what the light one leaves, and a
/// request of the light one still finds room (the fake companion runs the script's rules,
/// `accounting::fair_share`).
#[test]
fn a_fair_pool_is_claimed_by_the_tenant_and_holds_the_heavy_one_to_what_the_light_one_leaves() {
    for kind in HOSTS {
        let world = World::new(kind);
        let config = super::tests::config(
            json!([
                {"name": "key", "requests": 100, "window": "1m", "tiers": ["free", "gold"]},
                {"name": "pool", "requests": 10, "window": "1m", "per": "all",
                 "fair_share": {"weights": {"gold": 3}, "max_tenants": 16, "idle": "30s"}},
            ]),
            json!({"tier": {"header": "x-tier", "default": "free"}}),
        );
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        let light = proxy.send(Request::chat("sk-light", CHAT), &mut companion);
        assert!(light.forwarded(), "{kind:?}");
        let claim = charge_of(&light).limits[1].fair.clone();
        let want = FairClaim {
            claimant: crate::api::identity::tenant_id("sk-light"),
            weight: 1,
            max_claimants: 16,
            idle_ms: 30_000,
        };
        assert_eq!(claim, Some(want), "{kind:?}");
        assert_eq!(charge_of(&light).limits[0].fair, None, "{kind:?}: a tenant's own limit has no shares");
        let mut heavy_admitted = 0;
        for _ in 0..12 {
            let heavy = proxy.send(Request::chat("sk-heavy", CHAT).header("x-tier", "gold"), &mut companion);
            assert_eq!(charge_of(&heavy).limits[1].fair.as_ref().map(|f| f.weight), Some(3), "{kind:?}: gold weighs 3");
            if heavy.forwarded() {
                heavy_admitted += 1;
            } else {
                assert_eq!(heavy.replied().map(|r| r.status), Some(429), "{kind:?}");
            }
        }
        // 10 in the pool, 1 the light tenant's: the heavy one stops one short of the last,
        // the light tenant's reserve for its next request.
        assert_eq!(heavy_admitted, 8, "{kind:?}");
        let light = proxy.send(Request::chat("sk-light", CHAT), &mut companion);
        assert!(light.forwarded(), "{kind:?}: the light tenant's next request found its room");
    }
}

/// The same pool without `fair_share`: first come, first served, no claim sent.
#[test]
fn a_pool_without_fair_shares_is_first_come_first_served() {
    for kind in HOSTS {
        let world = World::new(kind);
        let config = config(json!([{"name": "pool", "requests": 10, "window": "1m", "per": "all"}]));
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        assert!(proxy.send(Request::chat("sk-light", CHAT), &mut companion).forwarded());
        for _ in 0..9 {
            let heavy = proxy.send(Request::chat("sk-heavy", CHAT), &mut companion);
            assert!(heavy.forwarded(), "{kind:?}");
            assert_eq!(charge_of(&heavy).limits[0].fair, None, "{kind:?}");
        }
        let light = proxy.send(Request::chat("sk-light", CHAT), &mut companion);
        assert_eq!(light.replied().map(|r| r.status), Some(429), "{kind:?}: the heavy tenant took the pool");
    }
}
