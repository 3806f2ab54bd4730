//! Each request's record, as the host's access log reads it (`record`), on both hosts'
//! semantics: what it used and cost as settled, how it was decided, published once.

use crate::effects::host::HostKind;
use crate::lifecycle::record::FIELD_PROPERTIES;
use crate::lifecycle::tests::{config, tenant};
use crate::testing::{usage_reply, FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::{json, Value};

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];
const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello world"}],"max_tokens":300}"#;

fn limits() -> Value {
    json!([{"name": "rpm", "requests": 2, "window": "1m"}, {"name": "tpm", "tokens": 100000, "window": "1m"},
           {"name": "usd", "usd": 10, "window": "1d"}])
}

fn prices() -> Value {
    json!({"prices": [{"match": "gpt-4o*", "input": 2.5, "output": 10.0}]})
}

/// The JSON record the request published last: once on Envoy, whose access log reads what
/// `on_log` set; on Nginx, whose log is written before, also once as the response began.
fn record_of(flight: &InFlight, kind: HostKind) -> Value {
    let name = if kind == HostKind::Nginx { "ngx.llm_ratelimit" } else { "llm_ratelimit" };
    let published: Vec<&Vec<u8>> = flight.host.properties.iter().filter(|(n, _)| n == name).map(|(_, v)| v).collect();
    let most = if kind == HostKind::Nginx { 2 } else { 1 };
    assert!((1..=most).contains(&published.len()), "{kind:?}: records as {name}: {:?}", flight.host.properties);
    serde_json::from_slice(published[published.len() - 1]).expect("a JSON record")
}

/// What the access log would read when it is written: on Nginx, before `on_log`.
fn logged_before_on_log(flight: &InFlight) -> Value {
    let published = flight.host.properties.iter().rev().find(|(n, _)| n == "ngx.llm_ratelimit").expect("a record");
    serde_json::from_slice(&published.1).expect("a JSON record")
}

#[test]
fn a_settled_request_records_its_usage_cost_and_how_it_was_decided() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(limits(), prices()));
        let mut companion = FakeCompanion::default();
        let mut flight = proxy.send(Request::chat("sk-rec", CHAT), &mut companion);
        assert!(flight.forwarded(), "{kind:?}");
        assert!(flight.host.properties.is_empty(), "{kind:?}: nothing before it is settled");
        proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
        let record = record_of(&flight, kind);
        assert_eq!(record["tenant"], tenant("sk-rec"), "{kind:?}: the tenant's id, never the key");
        assert!(!record.to_string().contains("sk-rec"), "{kind:?}: {record}");
        assert_eq!((record["provider"].as_str(), record["api"].as_str()), (Some("openai"), Some("chat_completions")));
        assert_eq!(record["model"], "gpt-4o");
        assert_eq!((record["input_tokens"].as_u64(), record["output_tokens"].as_u64()), (Some(9), Some(41)));
        // 9 x $2.50 + 41 x $10.00 per million, in micro-dollars, rounded up.
        assert_eq!(record["cost_micro_usd"], 433, "{kind:?}");
        assert_eq!(record["decision"], "charge");
        assert_eq!(record["refused_by"], Value::Null);
        let before_the_end = flight.host.properties.len();
        proxy.done(&mut flight);
        assert_eq!(flight.host.properties.len(), before_the_end, "{kind:?}: not published again at the end");
    }
}

#[test]
fn a_refused_request_records_the_limit_that_refused_it() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(limits(), prices()));
        let mut companion = FakeCompanion::default();
        for _ in 0..2 {
            let mut flight = proxy.send(Request::chat("sk-rec", CHAT), &mut companion);
            proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
        }
        let mut refused = proxy.send(Request::chat("sk-rec", CHAT), &mut companion);
        assert_eq!(refused.replied().map(|r| r.status), Some(429), "{kind:?}");
        proxy.done(&mut refused);
        let record = record_of(&refused, kind);
        assert_eq!((record["decision"].as_str(), record["refused_by"].as_str()), (Some("refused"), Some("rpm")));
        assert_eq!((record["input_tokens"].as_u64(), record["cost_micro_usd"].as_u64()), (Some(0), Some(0)));
    }
}

#[test]
fn a_client_leaving_mid_reply_records_what_it_was_charged() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(limits(), prices()));
        let mut companion = FakeCompanion::default();
        let mut flight = proxy.send(Request::chat("sk-rec", CHAT), &mut companion);
        flight.host.in_response_phases = true;
        flight.host.response_headers =
            vec![(":status".into(), "200".into()), ("content-type".into(), "application/json".into())];
        flight.filter.on_response_headers(&mut flight.host);
        if kind == HostKind::Nginx {
            // Nginx writes its access log before `on_log`: what it reads is the record
            // published as the response began, at the reservation a cut reply is charged.
            let early = logged_before_on_log(&flight);
            assert_eq!((early["output_tokens"].as_u64(), early["decision"].as_str()), (Some(300), Some("charge")));
        }
        proxy.done(&mut flight);
        let record = record_of(&flight, kind);
        // Cut off after its headers: at least its reservation (9 counted, 300 allowed).
        assert!(record["input_tokens"].as_u64() >= Some(9), "{kind:?}: {record}");
        assert_eq!(record["output_tokens"], 300, "{kind:?}");
        assert_eq!(record["decision"], "charge");
    }
}

#[test]
fn fields_are_published_apart_when_asked_and_nothing_when_off() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut extra = prices();
        extra["record"] = json!("fields");
        let mut proxy = Proxy::new(&world, &config(limits(), extra));
        let mut companion = FakeCompanion::default();
        let mut flight = proxy.send(Request::chat("sk-rec", CHAT), &mut companion);
        proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
        let prefix = if kind == HostKind::Nginx { "ngx." } else { "" };
        let names: Vec<String> = flight.host.properties.iter().map(|(n, _)| n.clone()).collect();
        let once: Vec<String> = FIELD_PROPERTIES.iter().map(|n| format!("{prefix}{n}")).collect();
        let times = if kind == HostKind::Nginx { 2 } else { 1 };
        let expected: Vec<String> = (0..times).flat_map(|_| once.iter().cloned()).collect();
        assert_eq!(names, expected, "{kind:?}");
        let value = |name: &str| {
            let full = format!("{prefix}{name}");
            flight
                .host
                .properties
                .iter()
                .rev()
                .find(|(n, _)| *n == full)
                .map(|(_, v)| String::from_utf8_lossy(v).to_string())
        };
        assert_eq!(value("llm_ratelimit_output_tokens").as_deref(), Some("41"));
        assert_eq!(value("llm_ratelimit_decision").as_deref(), Some("charge"));

        let mut extra = prices();
        extra["record"] = json!("off");
        let mut proxy = Proxy::new(&World::new(kind), &config(limits(), extra));
        let mut flight = proxy.send(Request::chat("sk-rec", CHAT), &mut companion);
        proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
        proxy.done(&mut flight);
        assert!(flight.host.properties.is_empty(), "{kind:?}");
    }
}

#[test]
fn a_request_decided_locally_records_the_degraded_mode() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut extra = prices();
        extra["failure_mode"] = json!("local");
        let mut proxy = Proxy::new(&world, &config(limits(), extra));
        let mut companion = FakeCompanion::failing(500);
        let mut flight = proxy.send(Request::chat("sk-rec", CHAT), &mut companion);
        assert!(flight.forwarded(), "{kind:?}");
        proxy.reply(&mut flight, 200, "application/json", &[&usage_reply(9, 41)]);
        let record = record_of(&flight, kind);
        assert_eq!((record["decision"].as_str(), record["output_tokens"].as_u64()), (Some("degraded"), Some(41)));
    }
}

/// The record is written by hand (one string, no tree of values): it must read back as the
/// same JSON object serde would write, keys in order, whatever a client puts in the model
/// name or a pool header (quotes, backslashes, control characters, non-ASCII).
#[test]
fn the_json_record_is_exact_json_whatever_the_names() {
    use crate::lifecycle::record::{How, Record, Used};
    for model in ["gpt-4o", "a\"b\\c\nd\u{1}e\u{7f}é😀", ""] {
        let record = Record {
            tenant: "0123456789abcdef0123456789abcdef",
            owners: vec![("team-tpm", "team \"a\""), ("org-usd", "org\\1")],
            provider: Some(crate::providers::Provider::Anthropic),
            api: Some(crate::api::Api::Messages),
            model,
            used: Used { input: 1, output: 2, cached: 3, reasoning: 4, cost_micro_usd: u64::MAX },
            how: How::Leased,
            refused_by: None,
            queued_ms: 7,
            overflow: Some("backup"),
            shadow: true,
        };
        let text = record.json();
        let parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let expected = json!({
            "tenant": "0123456789abcdef0123456789abcdef", "owners": {"team-tpm": "team \"a\"", "org-usd": "org\\1"},
            "provider": "anthropic", "api": "messages", "model": model, "input_tokens": 1, "output_tokens": 2,
            "cached_tokens": 3, "reasoning_tokens": 4, "cost_micro_usd": u64::MAX, "decision": "lease",
            "refused_by": null, "queued_ms": 7, "overflow": "backup", "shadow": true,
        });
        assert_eq!(parsed, expected);
        // Keys in alphabetical order, as the docs show a line (serde's own order depends on
        // whether a crate of the build enables its `preserve_order`: not compared).
        let keys = ["api", "cached_tokens", "cost_micro_usd", "decision", "input_tokens", "model", "output_tokens"];
        let keys =
            keys.iter().chain(&["overflow", "owners", "provider", "queued_ms", "reasoning_tokens", "refused_by"]);
        let at: Vec<usize> =
            keys.chain(&["shadow", "tenant"]).map(|k| text.find(&format!("\"{k}\":")).expect(k)).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{text}");
        assert!(!text.contains('\n'), "one line: {text}");
    }
}
