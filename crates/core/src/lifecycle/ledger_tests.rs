//! The spend ledger as a worker keeps and sends it: every request with a tenant adds
//! exactly what its record says, under its tenant and each pool's claimant; a batch is
//! kept and resent, same number, until the companion acknowledges it, and added once;
//! while the companion is away the worker keeps counting and sends when it is back.

use crate::effects::host::HostKind;
use crate::lifecycle::tests::config;
use crate::protocol::ledger::{day_of_ms, Spent, LEDGER_PATH, TENANT_LABEL};
use crate::testing::{advance, usage_reply, FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::{json, Value};
use std::collections::BTreeMap;

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];

fn chat(model: &str) -> String {
    json!({"model": model, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 300}).to_string()
}

fn policy(extra: Value) -> String {
    let limits = json!([
        {"name": "rpm", "requests": 4, "window": "1m"},
        {"name": "team-tpm", "tokens": 1_000_000, "window": "1m", "per": {"header": "x-team"}},
        {"name": "usd", "usd": 100, "window": "1d"}
    ]);
    let mut extra = extra;
    extra["prices"] = json!([{"match": "gpt-4o*", "input": 2.5, "output": 10.0},
                              {"match": "o3*", "input": 1.1, "output": 4.4, "cached_input": 0.55}]);
    config(limits, extra)
}

/// The request's record as last published (on Nginx it is published as the response
/// begins too, at the reservation: the settled one comes last).
fn record_of(flight: &InFlight) -> Value {
    let name = if flight.host.kind() == HostKind::Nginx { "ngx.llm_ratelimit" } else { "llm_ratelimit" };
    let published = flight.host.properties.iter().rev().find(|(n, _)| n == name).expect("a record");
    serde_json::from_slice(&published.1).expect("a JSON record")
}

fn spent_of(record: &Value) -> Spent {
    let n = |field: &str| record[field].as_u64().expect(field);
    Spent {
        requests: 1,
        input_tokens: n("input_tokens"),
        output_tokens: n("output_tokens"),
        cached_tokens: n("cached_tokens"),
        reasoning_tokens: n("reasoning_tokens"),
        cost_micro_usd: n("cost_micro_usd"),
    }
}

/// What the records say, summed by (owner, model) as the ledger keeps it: each record
/// under its tenant and its pool's owner; refused ones that used nothing add nothing.
fn expected(records: &[Value]) -> BTreeMap<(String, String), Spent> {
    let mut sums: BTreeMap<(String, String), Spent> = BTreeMap::new();
    for record in records
        .iter()
        .filter(|r| r["decision"] != "refused" || spent_of(r) != Spent { requests: 1, ..Spent::default() })
    {
        let model = record["model"].as_str().filter(|m| !m.is_empty()).unwrap_or("unknown").to_string();
        let mut owners = vec![record["tenant"].as_str().unwrap().to_string()];
        if let Some(team) = record["owners"]["team-tpm"].as_str() {
            owners.push(team.to_string());
        }
        for owner in owners {
            sums.entry((owner, model.clone())).or_default().add(&spent_of(record));
        }
    }
    sums
}

fn ledger_of(companion: &FakeCompanion) -> BTreeMap<(String, String), Spent> {
    let mut sums: BTreeMap<(String, String), Spent> = BTreeMap::new();
    for ((owner, _, model, _), used) in &companion.ledger {
        sums.entry((owner.clone(), model.clone())).or_default().add(used);
    }
    sums
}

fn ticks(proxy: &mut Proxy, companion: &mut FakeCompanion, n: usize) {
    for _ in 0..n {
        proxy.tick(Some(companion));
    }
}

#[test]
fn every_request_adds_exactly_its_record_under_its_tenant_and_its_team() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &policy(json!({})));
        let mut companion = FakeCompanion::default();
        let mut records = Vec::new();
        let cached = r#"{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":120,"completion_tokens":30,"total_tokens":150,"prompt_tokens_details":{"cached_tokens":100},"completion_tokens_details":{"reasoning_tokens":12}}}"#;
        for (i, (key, team, model)) in [
            ("sk-a", Some("team-a"), "gpt-4o"),
            ("sk-a", Some("team-a"), "o3-mini"),
            ("sk-b", Some("team-b"), "gpt-4o"),
            ("sk-c", None, "o3-mini"),
            ("sk-c", None, "o3-mini"),
            ("sk-c", None, "gpt-4o"),
            ("sk-c", None, "gpt-4o"),
            ("sk-c", None, "gpt-4o"), // the fifth of sk-c in the minute: refused by rpm
        ]
        .into_iter()
        .enumerate()
        {
            let mut request = Request::chat(key, &chat(model));
            if let Some(team) = team {
                request = request.header("x-team", team);
            }
            let mut flight = proxy.send(request, &mut companion);
            if flight.forwarded() {
                match i {
                    2 => proxy.reply(&mut flight, 500, "application/json", &[r#"{"error":{"message":"boom"}}"#]),
                    1 | 3 => proxy.reply(&mut flight, 200, "application/json", &[cached]),
                    _ => proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9 + i as u64, 41)]),
                }
            } else {
                proxy.done(&mut flight);
            }
            records.push(record_of(&flight));
        }
        assert_eq!(records.iter().filter(|r| r["decision"] == "refused").count(), 1, "{kind:?}: {records:?}");
        assert!(records.iter().any(|r| r["cached_tokens"] == 100 && r["reasoning_tokens"] == 12), "{records:?}");
        ticks(&mut proxy, &mut companion, 20);
        assert_eq!(ledger_of(&companion), expected(&records), "{kind:?}");
        // A team's rows carry its header and its owner id, never the value in clear; a
        // tenant's say so; all dated today (UTC).
        let labels: Vec<&str> = companion.ledger.keys().map(|(_, label, _, _)| label.as_str()).collect();
        let team = |value: &str| format!("x-team={}", crate::plan::pools::pool_owner("x-team", value));
        assert!(labels.contains(&team("team-a").as_str()) && labels.contains(&team("team-b").as_str()));
        assert!(
            labels.contains(&TENANT_LABEL) && labels.iter().all(|l| !l.contains("team-a") && !l.contains("team-b"))
        );
        assert!(companion.ledger.keys().all(|(_, _, _, day)| *day == day_of_ms(proxy.now())));
        assert_eq!(companion.ledger_batches.len(), 1, "{kind:?}: one batch for the second");
        // Nothing more to send: no further batches.
        ticks(&mut proxy, &mut companion, 40);
        assert_eq!(companion.ledger_batches.len(), 1, "{kind:?}");
    }
}

#[test]
fn a_batch_is_resent_with_its_number_until_acknowledged_and_added_once() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &policy(json!({})));
        let mut companion = FakeCompanion::default();
        let mut records = Vec::new();
        let mut one = |proxy: &mut Proxy, companion: &mut FakeCompanion, key: &str| {
            let mut flight = proxy.send(Request::chat(key, &chat("gpt-4o")), companion);
            proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(7, 11)]);
            records.push(record_of(&flight));
        };
        one(&mut proxy, &mut companion, "sk-a");
        // The companion adds the batch, but its answer is lost (a 503 from the proxy's side).
        for _ in 0..20 {
            proxy.tick(None);
        }
        let sent: Vec<_> = proxy.root.callouts.iter().filter(|c| c.path == LEDGER_PATH).cloned().collect();
        assert_eq!(sent.len(), 1, "{kind:?}");
        let (status, _) = companion.answer(&sent[0], proxy.now());
        assert_eq!(status, 200);
        proxy.root_answer(sent[0].token, 503, b"{}".to_vec());
        one(&mut proxy, &mut companion, "sk-b"); // meanwhile
                                                 // Sent again a second later: the same batch, its number kept; added before, so not again.
        ticks(&mut proxy, &mut companion, 20);
        let batches = &companion.ledger_batches;
        assert_eq!(batches.len(), 2, "{kind:?}");
        assert_eq!(batches[1], batches[0], "{kind:?}: resent as it was");
        // Then the next batch, numbered on, with what came meanwhile.
        ticks(&mut proxy, &mut companion, 20);
        assert_eq!(companion.ledger_batches.len(), 3, "{kind:?}");
        assert_eq!(companion.ledger_batches[2].seq, companion.ledger_batches[0].seq + 1);
        assert_eq!(ledger_of(&companion), expected(&records), "{kind:?}: each request once");
    }
}

#[test]
fn while_the_companion_is_away_requests_decided_locally_are_counted_and_sent_once_it_is_back() {
    for kind in HOSTS {
        let world = World::new(kind);
        let extra = json!({"failure_mode": "local", "fallback": {"breaker_failures": 1, "breaker_cooldown": "1s"}});
        let mut proxy = Proxy::new(&world, &policy(extra));
        let mut companion = FakeCompanion::failing(500);
        let mut records = Vec::new();
        for team in ["team-a", "team-b", "team-a"] {
            let mut flight = proxy.send(Request::chat("sk-a", &chat("gpt-4o")).header("x-team", team), &mut companion);
            assert!(flight.forwarded(), "{kind:?}");
            proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
            records.push(record_of(&flight));
        }
        assert!(records.iter().all(|r| r["decision"] == "degraded"), "{kind:?}: {records:?}");
        // While the breaker is open no batch is sent, whatever the ticks.
        let before = companion.calls.get(LEDGER_PATH).copied().unwrap_or(0);
        ticks(&mut proxy, &mut companion, 20);
        assert_eq!(companion.calls.get(LEDGER_PATH).copied().unwrap_or(0), before, "{kind:?}");
        advance(&world, 1_001);
        companion.failing = None;
        // The next request probes the companion and closes the breaker.
        let mut probe = proxy.send(Request::chat("sk-b", &chat("gpt-4o")).header("x-team", "team-b"), &mut companion);
        proxy.reply(&mut probe, 200, "application/json", &[&usage_reply(5, 6)]);
        let record = record_of(&probe);
        assert_eq!(record["decision"], "charge", "{kind:?}");
        records.push(record);
        ticks(&mut proxy, &mut companion, 40);
        assert_eq!(ledger_of(&companion), expected(&records), "{kind:?}");
    }
}

#[test]
fn the_local_store_keeps_no_ledger() {
    let world = World::new(HostKind::Envoy);
    let limits = json!([{"name": "rpm", "requests": 5, "window": "1m"}]);
    let mut proxy = Proxy::new(&world, &json!({"store": "local", "limits": limits}).to_string());
    let mut nobody = FakeCompanion::failing(599);
    let mut flight = proxy.send(Request::chat("sk-a", &chat("gpt-4o")), &mut nobody);
    proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
    ticks(&mut proxy, &mut nobody, 40);
    assert!(proxy.root.callouts.is_empty() && nobody.calls.is_empty());
}

/// Keys a client invents are refused by the upstream (401, 403): such a request did no work
/// and is refunded, and it adds nothing to the ledger, whose rows Redis keeps for the
/// retention (a year): a row per invented key would grow Redis with what clients invent.
#[test]
fn a_request_whose_credential_the_upstream_refused_adds_nothing() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &policy(json!({})));
        let mut companion = FakeCompanion::default();
        for (key, status) in [("sk-invented-1", 401), ("sk-invented-2", 403), ("sk-real", 200)] {
            let mut flight = proxy.send(Request::chat(key, &chat("gpt-4o")), &mut companion);
            assert!(flight.forwarded(), "{kind:?}");
            let body =
                if status == 200 { usage_reply(9, 41) } else { r#"{"error":{"message":"bad key"}}"#.to_string() };
            proxy.reply(&mut flight, status, "application/json", &[&body]);
        }
        ticks(&mut proxy, &mut companion, 20);
        let owners: Vec<String> = ledger_of(&companion).into_keys().map(|(owner, _)| owner).collect();
        let real = crate::api::identity::tenant_id("sk-real");
        assert_eq!(owners, [real], "{kind:?}: only the key the upstream took");
    }
}
