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

/// A pool's lease entry, as the lease table holds it (empty if there is none).
fn pool_lease(proxy: &mut Proxy, owner: &str) -> crate::accounting::lease::TenantLeases {
    let config = proxy.worker.config().expect("configured").clone();
    let stored =
        crate::effects::tables::read_own(&mut proxy.root, &config, crate::effects::tables::TenantTable::Leases, owner);
    crate::accounting::lease::LeaseEntry::decode(stored.as_deref(), config.limits.len()).leases
}

fn lease_asks_of(flight: &InFlight) -> Option<crate::protocol::LeaseRequest> {
    let callout = flight.host.callouts.iter().find(|c| c.path == crate::protocol::LEASE_PATH)?;
    serde_json::from_value(callout.body.clone()).ok()
}

#[test]
fn a_shared_pool_is_leased_once_per_proxy_and_charged_all_or_nothing_with_each_tenants_own_limit() {
    for kind in HOSTS {
        let world = World::new(kind);
        let config = config(json!([
            {"name": "key", "requests": 200, "window": "1m"},
            {"name": "upstream", "requests": 1000, "window": "1m", "per": "all"},
        ]));
        let config = {
            let mut value: serde_json::Value = serde_json::from_str(&config).expect("json");
            value["lease"] = json!({"enabled": true, "ttl": "10s", "initial_fraction": 0.1, "max_fraction": 0.25});
            value.to_string()
        };
        let mut proxy = Proxy::new(&world, &config);
        let mut companion = FakeCompanion::default();
        let mut requests_sent = 0;
        let mut pool_asks = 0;
        for t in 0..10 {
            for _ in 0..10 {
                let flight = proxy.send(Request::get(&format!("sk-{t}"), "/v1/models"), &mut companion);
                requests_sent += 1;
                assert!(flight.forwarded(), "{kind:?}");
                if let Some(ask) = lease_asks_of(&flight) {
                    if ask.limits[1].wanted > 0 {
                        pool_asks += 1;
                    } else {
                        assert!(ask.limits[1].look_only, "{kind:?}: the pool's part is held, not asked");
                    }
                }
            }
            proxy.tick(Some(&mut companion));
        }
        let trips: usize = companion.calls.values().sum();
        let renewals = proxy.root.callouts.iter().filter(|c| c.path == crate::protocol::LEASE_PATH).count();
        let pool_renewals = proxy
            .root
            .callouts
            .iter()
            .filter(|c| c.path == crate::protocol::LEASE_PATH && c.body["tenant"] == "all")
            .count();
        println!("{kind:?}: {requests_sent} requests, {trips} companion calls, {pool_asks} pool grants asked by requests, {renewals} renewals");
        // Each tenant costs a direct charge (seen once) and a lease of its own; the pool is
        // leased by a request once (after one direct charge when first seen), then renewed
        // in the background: far fewer than one trip per request for the pool.
        assert_eq!(pool_asks, 1, "{kind:?}: the pool's lease is asked once by a request");
        assert!(trips <= 2 * 10 + 1 + renewals, "{kind:?}: {trips} calls");
        assert!((1..=2).contains(&pool_renewals), "{kind:?}: {pool_renewals} renewals of the pool");
        let renewal: crate::protocol::LeaseRequest = serde_json::from_value(
            proxy.root.callouts.iter().find(|c| c.body["tenant"] == "all").expect("a pool renewal").body.clone(),
        )
        .expect("a lease request");
        assert_eq!(renewal.limits.len(), 1, "{kind:?}: a pool's renewal asks for the pool's limits only");
        let pool = pool_lease(&mut proxy, "all");
        assert!(pool.0[1].is_live(proxy.now()) && pool.0[1].remaining > 0.0, "{kind:?}: {pool:?}");
        assert_eq!(
            pool.0[0],
            crate::accounting::lease::Lease::default(),
            "{kind:?}: the pool's entry holds its limit only"
        );
        // Redis was charged for every grant and direct charge: what the pool's counter lost
        // is what this proxy admitted plus what its lease still holds.
        let now = proxy.now();
        let upstream = requests("upstream", 1000, Some("all".into()));
        let spent = 1000.0 - companion.level("any", &upstream, now);
        let held = pool_lease(&mut proxy, "all").0[1].remaining;
        assert!((spent - (requests_sent as f64 + held)).abs() < 1.0, "{kind:?}: spent {spent}, held {held}");
        // All or nothing: a tenant past its own limit is refused, and the pool's lease
        // gives nothing for the refusals, nor does Redis's pool counter.
        let mut admitted = 0;
        let mut pool_left = pool_lease(&mut proxy, "all").0[1].remaining;
        while proxy.send(Request::get("sk-0", "/v1/models"), &mut companion).forwarded() {
            admitted += 1;
            assert!(admitted <= 190, "{kind:?}: sk-0 had 190 of its 200 left");
            pool_left = pool_lease(&mut proxy, "all").0[1].remaining;
        }
        assert_eq!(admitted, 190, "{kind:?}");
        // The first refusal was a grant asked for sk-0's lease with the pool's part held:
        // refused, that part went back.
        assert_eq!(pool_lease(&mut proxy, "all").0[1].remaining, pool_left, "{kind:?}: the held part given back");
        let now = proxy.now();
        let (pool_before, redis_before) =
            (pool_lease(&mut proxy, "all").0[1].remaining, companion.level("any", &upstream, now));
        for _ in 0..10 {
            let refused = proxy.send(Request::get("sk-0", "/v1/models"), &mut companion);
            assert_eq!(refused.replied().map(|r| r.status), Some(429), "{kind:?}");
        }
        assert_eq!(
            pool_lease(&mut proxy, "all").0[1].remaining,
            pool_before,
            "{kind:?}: the pool's lease gave nothing"
        );
        assert_eq!(companion.level("any", &upstream, now), redis_before, "{kind:?}: nor did Redis's pool counter");
        // The other tenants still draw on the pool.
        assert!(proxy.send(Request::get("sk-1", "/v1/models"), &mut companion).forwarded(), "{kind:?}");
    }
}

/// Degraded mode (the companion away): a shared pool is counted once per proxy, in its
/// own local entry at its share (`fallback.instances`), not once per tenant; a request
/// the tenant's own limit refuses takes nothing from the pool. In direct and lease mode.
#[test]
fn without_the_companion_a_pool_is_counted_once_per_proxy_all_or_nothing() {
    for (kind, lease) in
        [(HostKind::Envoy, false), (HostKind::Nginx, false), (HostKind::Envoy, true), (HostKind::Nginx, true)]
    {
        let world = World::new(kind);
        let mut value: serde_json::Value = serde_json::from_str(&config(json!([
            {"name": "key", "requests": 3, "window": "1h"},
            {"name": "upstream", "requests": 20, "window": "1h", "per": "all"},
        ])))
        .expect("json");
        value["failure_mode"] = json!("local");
        value["fallback"] = json!({"instances": 2});
        if lease {
            value["lease"] = json!({"enabled": true});
        }
        let mut proxy = Proxy::new(&world, &value.to_string());
        let mut away = FakeCompanion::failing(503);
        let what = format!("{kind:?}, lease {lease}");
        let mut send = |key: &str| {
            let flight = proxy.send(Request::get(key, "/v1/models"), &mut away);
            assert_eq!(flight.host.metric(crate::effects::host::Metric::DegradedDecisions), 1, "{what}");
            flight.forwarded()
        };
        // The pool's share here is 10 (20 over 2 instances); each key's is 2 (3 over 2).
        let a = (0..5).filter(|_| send("sk-a")).count();
        assert_eq!(a, 2, "{what}: sk-a's own limit");
        let others: usize =
            ["sk-b", "sk-c", "sk-d", "sk-e", "sk-f"].iter().map(|k| (0..2).filter(|_| send(k)).count()).sum();
        assert_eq!(others, 8, "{what}: the pool's 10 for this proxy, less sk-a's 2, and none for sk-a's refusals");
    }
}

/// docs/failures.md: "Leases still valid keep admitting during an
/// outage (they were paid for in Redis), a pool's lease included". With the companion
/// away, a tenant whose own lease and the pool's are live is admitted from them, not
/// decided locally, and the pool's lease gives what it admitted.
#[test]
fn a_live_pool_lease_keeps_admitting_while_the_companion_is_away() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut value: serde_json::Value = serde_json::from_str(&config(json!([
            {"name": "key", "requests": 1000, "window": "1m"},
            {"name": "upstream", "requests": 10_000, "window": "1m", "per": "all"},
        ])))
        .expect("json");
        value["failure_mode"] = json!("local");
        value["lease"] = json!({"enabled": true, "ttl": "10s", "initial_fraction": 0.1, "max_fraction": 0.1});
        let mut proxy = Proxy::new(&world, &value.to_string());
        let mut companion = FakeCompanion::default();
        // Seen once (a direct charge), then leased: the key's lease and the pool's.
        for _ in 0..3 {
            assert!(proxy.send(Request::get("sk-a", "/v1/models"), &mut companion).forwarded(), "{kind:?}");
        }
        let pool_before = pool_lease(&mut proxy, "all").0[1].remaining;
        assert!(pool_before >= 10.0, "{kind:?}: the pool leased ({pool_before})");
        let mut away = FakeCompanion::failing(503);
        for i in 0..10 {
            let flight = proxy.send(Request::get("sk-a", "/v1/models"), &mut away);
            assert!(flight.forwarded(), "{kind:?}: request {i} during the outage");
            assert!(flight.host.callouts.is_empty(), "{kind:?}: admitted from the leases, no callout");
            assert_eq!(
                flight.host.metric(crate::effects::host::Metric::DegradedDecisions),
                0,
                "{kind:?}: not degraded"
            );
        }
        let pool_after = pool_lease(&mut proxy, "all").0[1].remaining;
        assert!((pool_before - pool_after - 10.0).abs() < 1e-9, "{kind:?}: {pool_before} -> {pool_after}");
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

/// What a proxy admitted on its own under an `"all"` pool reaches the pool's counter in
/// Redis once the companion is back, each admission once (docs/pools.md: "Local
/// admissions are queued as debits on the pool's counter, as for a tenant's").
#[test]
fn what_was_admitted_locally_under_a_pool_is_debited_from_the_pools_counter_once() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut value: serde_json::Value = serde_json::from_str(&config(json!([
            {"name": "key", "requests": 100, "window": "1h"},
            {"name": "upstream", "requests": 50, "window": "1h", "per": "all"},
        ])))
        .expect("json");
        value["failure_mode"] = json!("local");
        value["fallback"] = json!({"breaker_failures": 1, "breaker_cooldown": "1s"});
        let mut proxy = Proxy::new(&world, &value.to_string());
        let mut companion = FakeCompanion::failing(500);
        for key in ["sk-a", "sk-b", "sk-a"] {
            let mut flight = proxy.send(Request::get(key, "/v1/models"), &mut companion);
            assert!(flight.forwarded(), "{kind:?}: admitted locally");
            proxy.reply(&mut flight, 200, "application/json", &["{}"]);
        }
        crate::testing::advance(&world, 1_001);
        companion.failing = None;
        let mut probe = proxy.send(Request::get("sk-c", "/v1/models"), &mut companion);
        assert!(probe.forwarded(), "{kind:?}: the probe closes the breaker");
        proxy.reply(&mut probe, 200, "application/json", &["{}"]);
        for _ in 0..5 {
            crate::testing::advance(&world, 1_000);
            proxy.tick(Some(&mut companion));
        }
        let now = proxy.now();
        let hourly = |name: &str, capacity: u64, owner: Option<String>| LimitCharge {
            window_ms: 3_600_000,
            ..requests(name, capacity, owner)
        };
        let pool = hourly("upstream", 50, Some(crate::protocol::keys::ALL_OWNER.to_string()));
        // 50 less the probe's charge and the three local admissions, each once.
        assert_eq!(companion.level("sk-c", &pool, now).round(), 46.0, "{kind:?}");
        let own =
            |key: &str| companion.level(&crate::api::identity::tenant_id(key), &hourly("key", 100, None), now).round();
        assert_eq!((own("sk-a"), own("sk-b"), own("sk-c")), (98.0, 99.0, 99.0), "{kind:?}: and each tenant's own");
        // Sent again (a lost answer), nothing is applied twice.
        for _ in 0..5 {
            crate::testing::advance(&world, 1_000);
            proxy.tick(Some(&mut companion));
        }
        assert_eq!(companion.level("sk-c", &pool, proxy.now()).round(), 46.0, "{kind:?}");
    }
}

/// The degraded mode decides a pool with fair shares at the proxy's share of it, first
/// come first served: it keeps no claimants (docs/pools.md#fair-shares-of-a-scarce-pool:
/// "the degraded mode knows no shares").
#[test]
fn without_the_companion_a_fair_pool_is_first_come_first_served_at_the_proxys_share() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut value: serde_json::Value = serde_json::from_str(&config(json!([
            {"name": "pool", "requests": 10, "window": "1h", "per": "all",
             "fair_share": {"max_tenants": 16, "idle": "30s"}},
        ])))
        .expect("json");
        value["failure_mode"] = json!("local");
        value["fallback"] = json!({"instances": 2});
        let mut proxy = Proxy::new(&world, &value.to_string());
        let mut away = FakeCompanion::failing(503);
        assert!(proxy.send(Request::get("sk-light", "/v1/models"), &mut away).forwarded(), "{kind:?}");
        // The proxy's share is 5: with shares the heavy tenant would stop short of the
        // light one's reserve; here it takes all that is left.
        let heavy =
            (0..6).filter(|_| proxy.send(Request::get("sk-heavy", "/v1/models"), &mut away).forwarded()).count();
        assert_eq!(heavy, 4, "{kind:?}");
        let light = proxy.send(Request::get("sk-light", "/v1/models"), &mut away);
        assert_eq!(light.replied().map(|r| r.status), Some(429), "{kind:?}: no reserve kept for the light tenant");
    }
}
