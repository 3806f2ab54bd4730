//! The local store (`"store": "local"`) on the fake host: two workers of one proxy (two
//! `Proxy` values over one `World`, so they share its shared data and clock) keep every
//! limit kind exactly between them, with no callout at all; each test runs for both hosts
//! (on Nginx every write to an existing key must carry its CAS).

use crate::effects::host::{HostKind, Metric};
use crate::testing::{advance, usage_reply, FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::{json, Value};
use std::cell::RefCell;
use std::rc::Rc;

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];
const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;

fn local(limits: Value, extra: Value) -> String {
    let mut config = json!({"store": "local", "limits": limits});
    if let (Some(config), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        config.extend(extra.clone());
    }
    config.to_string()
}

/// Two workers of one proxy.
fn workers(kind: HostKind, config: &str) -> (Rc<RefCell<World>>, [Proxy; 2]) {
    let world = World::new(kind);
    let workers = [Proxy::new(&world, config), Proxy::new(&world, config)];
    (world, workers)
}

/// A request through a worker: decided at once, never by a callout.
fn send(proxy: &mut Proxy, request: Request) -> InFlight {
    // No companion exists: one that answered anything would fail the test below.
    let mut nobody = FakeCompanion::failing(599);
    let flight = proxy.send(request, &mut nobody);
    assert!(flight.host.callouts.is_empty(), "the local store calls out to nobody");
    assert!(nobody.calls.is_empty());
    flight
}

fn reply_header(flight: &InFlight, name: &str) -> Option<String> {
    let reply = flight.replied()?;
    reply.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
}

fn header(flight: &InFlight, name: &str) -> Option<String> {
    flight.host.response_header_value(name).map(str::to_string)
}

#[test]
fn a_request_limit_holds_exactly_across_two_workers_with_no_callout() {
    for kind in HOSTS {
        let (_world, mut workers) =
            workers(kind, &local(json!([{"name": "rpm", "requests": 5, "window": "1m"}]), json!({})));
        let mut remaining = Vec::new();
        for i in 0..5 {
            let worker = &mut workers[i % 2];
            let mut flight = send(worker, Request::chat("sk-a", CHAT));
            assert!(flight.forwarded(), "{kind:?} request {i}");
            worker.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
            remaining.push(header(&flight, "x-ratelimit-remaining-requests").unwrap_or_default());
            assert_eq!(header(&flight, "x-llm-ratelimit-degraded"), None, "the mode, not a failure");
        }
        assert_eq!(remaining, ["4", "3", "2", "1", "0"], "{kind:?}: one budget for both workers");
        let refused = send(&mut workers[1], Request::chat("sk-a", CHAT));
        let reply = refused.replied().expect("refused");
        assert_eq!(reply.status, 429, "{kind:?}");
        // A full bucket of 5 a minute refills one request in 12 s.
        assert_eq!(reply_header(&refused, "retry-after").as_deref(), Some("12"), "{kind:?}");
        assert_eq!(reply_header(&refused, "x-ratelimit-limit-requests").as_deref(), Some("5"));
        // Another tenant has its own budget.
        assert!(send(&mut workers[0], Request::chat("sk-b", CHAT)).forwarded(), "{kind:?}");
        for worker in &mut workers {
            for _ in 0..40 {
                worker.tick(None);
            }
            assert!(worker.root.callouts.is_empty(), "{kind:?}: no settlement, renewal or exchange goes out");
            assert_eq!(worker.root.metric(Metric::SettlementsFailed), 0);
        }
        assert_eq!(refused.host.metric(Metric::Limited), 1);
        assert_eq!(refused.host.metric(Metric::DegradedDecisions), 0, "not the degraded mode");
    }
}

#[test]
fn tokens_are_reserved_then_settled_from_json_and_sse_replies_across_workers() {
    let sse = concat!(
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":20,\"total_tokens\":29}}\n\n",
        "data: [DONE]\n\n"
    );
    for kind in HOSTS {
        let config = local(json!([{"name": "tpm", "tokens": 1000, "window": "1m"}]), json!({}));
        let (_world, mut workers) = workers(kind, &config);
        let reserved = |flight: &InFlight| -> u64 {
            header(flight, "x-llm-ratelimit-reserved-tokens").and_then(|v| v.parse().ok()).expect("reserved")
        };
        let left = |flight: &InFlight| -> u64 {
            header(flight, "x-ratelimit-remaining-tokens").and_then(|v| v.parse().ok()).expect("remaining")
        };
        // The clock stands still: the bucket refills nothing between the steps.
        let mut first = send(&mut workers[0], Request::chat("sk-a", CHAT));
        workers[0].reply(&mut first, 200, "application/json", &[&usage_reply(9, 41)]);
        assert_eq!(left(&first), 1000 - reserved(&first), "{kind:?}");
        // Settled at what the JSON reply reported: 50 of 1000 used.
        let mut second = send(&mut workers[1], Request::chat("sk-a", CHAT));
        let (a, b) = sse.split_at(37);
        workers[1].reply(&mut second, 200, "text/event-stream", &[a, b]);
        assert_eq!(left(&second), 950 - reserved(&second), "{kind:?}: the other worker sees the settlement");
        // And at what the stream's usage chunk reported: 29 more.
        let third = send(&mut workers[0], Request::chat("sk-a", CHAT));
        assert!(third.forwarded());
        let mut third = third;
        workers[0].reply(&mut third, 200, "application/json", &[&usage_reply(9, 41)]);
        assert_eq!(left(&third), 921 - reserved(&third), "{kind:?}");
    }
}

#[test]
fn a_sliding_window_holds_exactly_across_workers_and_frees_as_entries_leave() {
    for kind in HOSTS {
        let limits = json!([{"name": "rpw", "requests": 3, "window": "10s", "algorithm": "sliding_window"}]);
        let (world, mut workers) = workers(kind, &local(limits, json!({})));
        let go = |worker: usize, workers: &mut [Proxy; 2]| {
            let mut flight = send(&mut workers[worker], Request::chat("sk-a", CHAT));
            if flight.forwarded() {
                workers[worker].reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
            }
            flight
        };
        assert!(go(0, &mut workers).forwarded());
        advance(&world, 4_000);
        assert!(go(1, &mut workers).forwarded());
        assert!(go(0, &mut workers).forwarded());
        advance(&world, 1_000);
        let refused = go(1, &mut workers);
        assert_eq!(refused.replied().map(|r| r.status), Some(429), "{kind:?}");
        // The first entry leaves 10 s after it came, 5 s from now (a bucket would have
        // refilled half a request by now and say less).
        assert_eq!(reply_header(&refused, "retry-after").as_deref(), Some("5"), "{kind:?}");
        advance(&world, 5_001);
        assert!(go(0, &mut workers).forwarded(), "{kind:?}: the first entry left");
        let again = go(1, &mut workers);
        assert_eq!(again.replied().map(|r| r.status), Some(429), "{kind:?}: still 3 in the last 10 s");
        // The two from t=4 s leave at t=14 s: 3.999 s from now, rounded up.
        assert_eq!(reply_header(&again, "retry-after").as_deref(), Some("4"), "{kind:?}");
    }
}

#[test]
fn concurrency_slots_are_shared_released_at_the_end_renewed_while_live_and_expire_when_orphaned() {
    for kind in HOSTS {
        let limits = json!([{"name": "inflight", "concurrency": 2}]);
        let (world, mut workers) = workers(kind, &local(limits, json!({"slots": {"ttl": "3s"}})));
        let mut first = send(&mut workers[0], Request::chat("sk-a", CHAT));
        let second = send(&mut workers[1], Request::chat("sk-a", CHAT));
        assert!(first.forwarded() && second.forwarded(), "{kind:?}");
        let third = send(&mut workers[0], Request::chat("sk-a", CHAT));
        assert_eq!(third.replied().map(|r| r.status), Some(429), "{kind:?}: 2 in flight across the workers");
        // A request that ends gives its slot back at once, to either worker.
        workers[0].reply(&mut first, 200, "application/json", &[&usage_reply(9, 41)]);
        let fourth = send(&mut workers[1], Request::chat("sk-a", CHAT));
        assert!(fourth.forwarded(), "{kind:?}");
        // Worker 1's two requests stay in flight past the ttl: its ticks renew them (every
        // third of the ttl, 20 ticks of 50 ms).
        for _ in 0..2 {
            advance(&world, 1_000);
            for _ in 0..20 {
                workers[1].tick(None);
            }
        }
        advance(&world, 2_000);
        let refused = send(&mut workers[0], Request::chat("sk-a", CHAT));
        assert_eq!(refused.replied().map(|r| r.status), Some(429), "{kind:?}: renewed, so still held at 4 s");
        assert!(workers[1].root.callouts.is_empty());
        // Worker 1 stops ticking (a crashed worker): its slots expire a ttl after their
        // last renewal, and the tenant gets its concurrency back.
        advance(&world, 1_001);
        assert!(send(&mut workers[0], Request::chat("sk-a", CHAT)).forwarded(), "{kind:?}: orphaned slots expired");
        drop((second, fourth));
    }
}

/// Memory is the tenant table's size whatever clients invent: a thousand keys fill at
/// most `memory.tenant_slots` entries.
#[test]
fn invented_keys_fill_a_bounded_table() {
    for kind in HOSTS {
        let config =
            local(json!([{"name": "rpm", "requests": 5, "window": "1m"}]), json!({"memory": {"tenant_slots": 16}}));
        let (world, mut workers) = workers(kind, &config);
        let mut statuses = std::collections::BTreeMap::new();
        for i in 0..1_000 {
            let flight = send(&mut workers[i % 2], Request::chat(&format!("sk-invented-{i}"), CHAT));
            *statuses.entry(flight.replied().map_or(200, |r| r.status)).or_insert(0) += 1;
        }
        let local_keys = world.borrow().keys().iter().filter(|k| k.starts_with("llmrl.local.")).count();
        assert!(local_keys <= 16, "{kind:?}: {local_keys} entries");
        // A tenant whose slots all hold others' live counters is refused, not let through
        // uncounted; those that found room were counted.
        assert_eq!(statuses.keys().copied().collect::<Vec<_>>(), [200, 503], "{kind:?} {statuses:?}");
    }
}

/// A host that refuses a write (Nginx's `shm_kv` zone with no room left) answers the
/// request 503, counted in `shared_writes_refused`: never admitted uncounted
/// (docs/getting-started.md#limits-without-redis-the-local-store).
#[test]
fn a_refused_write_is_answered_503_and_counted() {
    for kind in HOSTS {
        let (world, mut workers) =
            workers(kind, &local(json!([{"name": "rpm", "requests": 5, "window": "1m"}]), json!({})));
        assert!(send(&mut workers[0], Request::chat("sk-a", CHAT)).forwarded(), "{kind:?}");
        world.borrow_mut().full = true;
        if kind == HostKind::Envoy {
            // Envoy's table is made whole at load (`tables::make_table`): a full host
            // refuses no write of it.
            assert!(send(&mut workers[1], Request::chat("sk-new", CHAT)).forwarded());
            continue;
        }
        let refused = send(&mut workers[1], Request::chat("sk-new", CHAT));
        assert_eq!(refused.replied().map(|r| r.status), Some(503), "{kind:?}");
        assert_eq!(refused.host.metric(Metric::SharedWritesRefused), 1, "{kind:?}");
        assert_eq!(refused.host.metric(Metric::Allowed), 0, "{kind:?}");
        assert!(
            refused.host.logs.iter().any(|(_, m)| m.contains("the host refused a shared data write (NoMemory)")),
            "{kind:?}: {:?}",
            refused.host.logs
        );
        // A tenant whose entry exists is still counted in it.
        let mut known = send(&mut workers[1], Request::chat("sk-a", CHAT));
        workers[1].reply(&mut known, 200, "application/json", &[&usage_reply(9, 41)]);
        assert_eq!(header(&known, "x-ratelimit-remaining-requests").as_deref(), Some("3"), "{kind:?}");
    }
}

#[test]
fn an_entry_full_again_gives_its_place_to_a_newcomer() {
    // 1,000 requests a minute refill one every 60 ms: 100 ms after their last request every
    // entry is full again, and a newcomer whose slots they all hold takes one. (Keeping
    // them a whole window answered such newcomers 503 for that window.)
    for kind in HOSTS {
        let config =
            local(json!([{"name": "rpm", "requests": 1000, "window": "1m"}]), json!({"memory": {"tenant_slots": 16}}));
        let (world, mut workers) = workers(kind, &config);
        let refused = |workers: &mut [Proxy; 2], round: &str| {
            (0..200)
                .filter(|i| {
                    let flight = send(&mut workers[i % 2], Request::chat(&format!("sk-{round}-{i}"), CHAT));
                    advance(&world, 100);
                    flight.replied().is_some_and(|r| r.status == 503)
                })
                .count()
        };
        assert_eq!(refused(&mut workers, "a"), 0, "{kind:?}: each newcomer finds an entry full again");
    }
}

/// What an entry costs: the sizing of Nginx's `shm_kv` for the local store in
/// docs/getting-started.md#what-is-kept-and-how.
#[test]
fn an_entry_is_at_most_the_stated_size() {
    let limits = json!([
        {"name": "rpm", "requests": 5, "window": "1m"},
        {"name": "tpm", "tokens": 100000, "window": "1m"},
        {"name": "rpw", "requests": 64, "window": "1m", "algorithm": "sliding_window"},
        {"name": "inflight", "concurrency": 10}
    ]);
    let policy = crate::config::Policy::from_json(local(limits, json!({})).as_bytes()).expect("config");
    // 8 fingerprint + 33 tenant (or pool) + 1 format + 8 time of use; per limit 3 + 16 per
    // entry: 1, 1, 64, 10.
    assert_eq!(
        crate::effects::local_limiter::entry_bytes_at_most(&policy),
        8 + 33 + 1 + 8 + 4 * 3 + 16 * (1 + 1 + 64 + 10)
    );
    // A full window of 64 requests a minute is that big in shared data (fingerprint aside).
    let window = json!([{"name": "rpw", "requests": 64, "window": "1m", "algorithm": "sliding_window"}]);
    for kind in HOSTS {
        let (world, mut workers) = workers(kind, &local(window.clone(), json!({})));
        let mut admitted = 0;
        for i in 0..70 {
            let mut flight = send(&mut workers[i % 2], Request::chat("sk-a", CHAT));
            if flight.forwarded() {
                admitted += 1;
                workers[i % 2].reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
            }
        }
        assert_eq!(admitted, 64, "{kind:?}");
        // On Envoy the table's keys are made, empty, at load: the one holding the entry.
        let keys = world.borrow().keys();
        let mut entries = keys.iter().filter(|k| k.starts_with("llmrl.local."));
        let stored = entries.find_map(|key| workers[0].root.shared_value(key)).expect("an entry");
        assert_eq!(stored.len(), 33 + 1 + 8 + 3 + 16 * 64, "{kind:?}");
    }
}

#[test]
fn a_calendar_budget_is_kept_locally_and_full_again_at_its_boundary() {
    // A day's budget, in UTC: refused until midnight, whole at midnight, on both workers.
    let at = |rfc3339: &str| rfc3339.parse::<jiff::Timestamp>().map(|t| t.as_millisecond() as u64).expect("time");
    for kind in HOSTS {
        let (world, mut workers) =
            workers(kind, &local(json!([{"name": "rpd", "requests": 3, "window": "day"}]), json!({})));
        world.borrow_mut().now_ms = at("2027-03-01T23:59:50Z");
        for i in 0..3 {
            let worker = &mut workers[i % 2];
            let mut flight = send(worker, Request::chat("sk-a", CHAT));
            assert!(flight.forwarded(), "{kind:?} request {i}");
            worker.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
        }
        let refused = send(&mut workers[1], Request::chat("sk-a", CHAT));
        assert_eq!(refused.replied().map(|r| r.status), Some(429), "{kind:?}: the day's budget is spent");
        assert_eq!(reply_header(&refused, "retry-after").as_deref(), Some("10"), "{kind:?}: until midnight");
        advance(&world, 10_000);
        for i in 0..3 {
            assert!(send(&mut workers[i % 2], Request::chat("sk-a", CHAT)).forwarded(), "{kind:?}: a new day, {i}");
        }
        assert_eq!(send(&mut workers[0], Request::chat("sk-a", CHAT)).replied().map(|r| r.status), Some(429));
    }
}

/// docs/getting-started.md#what-is-kept-and-how: "a settlement that arrives after its
/// tenant's entry was replaced is dropped". A long request's entry is full again (its window
/// refilled) while the request is in flight, so a newcomer may take its place; the request's settlement then charges
/// nobody: neither the newcomer whose entry sits there now, nor a fresh entry of its own.
#[test]
fn a_settlement_after_its_entry_was_replaced_is_dropped() {
    use crate::effects::tables::{read_own, TenantTable};
    use crate::lifecycle::tests::tenant;
    for kind in HOSTS {
        let config =
            local(json!([{"name": "tps", "tokens": 10_000, "window": "1s"}]), json!({"memory": {"tenant_slots": 16}}));
        let (world, mut workers) = workers(kind, &config);
        let policy = workers[0].worker.config().expect("config").clone();
        let mut long = send(&mut workers[0], Request::chat("sk-long", CHAT));
        assert!(long.forwarded(), "{kind:?}");
        advance(&world, 1_100); // its bucket is full again: its entry holds nothing
        let own =
            |workers: &mut [Proxy; 2]| read_own(&mut workers[0].root, &policy, TenantTable::Local, &tenant("sk-long"));
        let mut newcomers = 0;
        while own(&mut workers).is_some() {
            let mut flight = send(&mut workers[newcomers % 2], Request::chat(&format!("sk-new-{newcomers}"), CHAT));
            workers[newcomers % 2].reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
            advance(&world, 100);
            newcomers += 1;
            assert!(newcomers < 500, "{kind:?}: the long request's entry was never replaced");
        }
        let slots = TenantTable::slots(&policy, &tenant("sk-long"));
        let stored = |workers: &mut [Proxy; 2]| -> Vec<Option<Vec<u8>>> {
            slots
                .iter()
                .map(|&slot| workers[0].root.shared_value(&TenantTable::Local.shared_key(&policy, slot)))
                .collect()
        };
        let before = stored(&mut workers);
        // Its reply reports far more than it reserved: a settlement that landed would show.
        workers[0].reply(&mut long, 200, "application/json", &[&usage_reply(9, 5_000)]);
        workers[0].tick(None);
        assert_eq!(stored(&mut workers), before, "{kind:?}: nobody's entry changed");
        assert!(own(&mut workers).is_none(), "{kind:?}: nor was an entry made for it");
    }
}

/// Envoy makes a key on a write without a CAS whether or not another worker just made it:
/// two workers charging a new tenant at once both succeeded, one charge lost (three
/// streams admitted under a concurrency limit of 3 counted two, and a fourth request got
/// in; e2e `test_concurrency_holds_exactly_across_two_workers_and_slots_come_back` failed
/// one run in four). The table is made at load, so the second of two such writes fails its
/// CAS and is retried on the first's.
#[test]
fn two_workers_charging_a_new_tenant_at_once_never_overwrite_each_other_on_envoy() {
    use crate::effects::host::Host;
    use crate::effects::tables::TenantTable;
    let config = local(json!([{"name": "inflight", "concurrency": 3}]), json!({}));
    let (_world, mut workers) = workers(HostKind::Envoy, &config);
    let policy = workers[0].worker.config().expect("configured").clone();
    let tenant = crate::api::identity::tenant_id("sk-new");
    let key = TenantTable::Local.shared_key(&policy, TenantTable::slots(&policy, &tenant)[0]);
    let [first, second] = &mut workers;
    let (_, cas_a) = first.root.shared_get(&key);
    let (_, cas_b) = second.root.shared_get(&key);
    assert!(cas_a.is_some(), "the slot's key exists before any charge");
    assert!(first.root.shared_set(&key, b"a", cas_a).is_ok());
    assert!(second.root.shared_set(&key, b"b", cas_b).is_err(), "the second write fails its CAS");
    // Three charges of another new tenant, on both workers, all count.
    let flights: Vec<InFlight> = (0..3).map(|i| send(&mut workers[i % 2], Request::chat("sk-race", CHAT))).collect();
    assert!(flights.iter().all(InFlight::forwarded));
    assert!(!send(&mut workers[1], Request::chat("sk-race", CHAT)).forwarded(), "the fourth is refused");
}
