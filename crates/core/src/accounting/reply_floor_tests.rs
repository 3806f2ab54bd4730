//! Replies the filter could not read, through the whole lifecycle on the fake host, for
//! Envoy's and ngx_wasm_module's semantics: each is charged at least its reservation.

use crate::effects::host::HostKind;
use crate::protocol::{ChargeRequest, Settlement};
use crate::testing::{usage_reply, FakeCompanion, InFlight, Proxy, Request, World};
use serde_json::{json, Value};

const HOSTS: [HostKind; 2] = [HostKind::Envoy, HostKind::Nginx];

fn config(extra: Value) -> String {
    let mut config = json!({"companion": {"upstream": "companion", "token": "test-token-0123456789"}, "failure_mode": "deny",
        "limits": [{"name": "rpm", "requests": 100, "window": "1m"}, {"name": "tpm", "tokens": 100000, "window": "1m"}]});
    if let (Some(config), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        config.extend(extra.clone());
    }
    config.to_string()
}

fn chat(model: &str, stream: bool) -> String {
    json!({"model": model, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 300, "stream": stream})
        .to_string()
}

/// What the request reserved against `tpm`, as its charge said.
fn reserved(flight: &InFlight) -> i64 {
    let charge: ChargeRequest = serde_json::from_value(flight.host.last_callout().body.clone()).expect("a charge");
    charge.limits.iter().find(|l| l.name == "tpm").map(|l| l.cost as i64).expect("tpm charged")
}

/// The reply's headers, then `chunks`, the last one ending the stream when `ends`, then
/// the host's end of the request (as when the client resets the connection).
fn reply(proxy: &mut Proxy, flight: &mut InFlight, headers: &[(&str, &str)], chunks: &[&str], ends: bool) {
    flight.host.in_response_phases = true;
    flight.host.response_headers = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
    flight.filter.on_response_headers(&mut flight.host);
    for (i, chunk) in chunks.iter().enumerate() {
        flight.host.response_chunk = chunk.as_bytes().to_vec();
        let last = ends && i + 1 == chunks.len();
        flight.filter.on_response_body(&mut flight.host, &mut proxy.worker, chunk.len(), last);
    }
    proxy.done(flight);
}

/// The `tpm` credit the worker's next settlement carries.
fn tpm_credit(proxy: &mut Proxy, companion: &mut FakeCompanion) -> i64 {
    let before = companion.settled.len();
    proxy.tick(Some(companion));
    let settled: Vec<Settlement> = companion.settled[before..].to_vec();
    settled.iter().flat_map(|s| &s.limits).filter(|l| l.name == "tpm").map(|l| l.credit).sum()
}

/// Whether the worker knows an average for (`key`, `model`): stored, or taught since its tick.
fn has_average(proxy: &mut Proxy, key: &str, model: &str) -> bool {
    let config = proxy.worker.config().expect("configured").clone();
    let tenant = crate::api::identity::tenant_id(key);
    proxy.worker.averages.get(&mut proxy.root, &config, &tenant, model).is_some()
}

#[test]
fn a_compressed_reply_is_asked_for_plain_and_charged_its_reservation_if_it_comes_compressed() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(json!({})));
        let mut companion = FakeCompanion::default();
        let request = Request::chat("sk-z", &chat("gpt-4o", false)).header("accept-encoding", "gzip, br");
        let mut flight = proxy.send(request, &mut companion);
        assert!(flight.forwarded(), "{kind:?}");
        let asked: Vec<&str> = flight
            .host
            .request_headers
            .iter()
            .filter(|(n, _)| n == "accept-encoding")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(asked, ["identity"], "{kind:?}: the upstream is asked for a reply the filter reads");
        // The upstream compressed it anyway: the bytes say nothing the filter can read.
        let headers = [(":status", "200"), ("content-type", "application/json"), ("content-encoding", "gzip")];
        reply(&mut proxy, &mut flight, &headers, &["\u{1f}\u{8b}\u{8}\0garbage"], true);
        assert_eq!(tpm_credit(&mut proxy, &mut companion), 0, "{kind:?}: the reservation stands");
        assert!(!has_average(&mut proxy, "sk-z", "gpt-4o"), "{kind:?}: an unread reply teaches no average");
        // A compressed stream (counted as no text at all before) likewise.
        let mut stream = proxy.send(Request::chat("sk-y", &chat("gpt-4o", true)), &mut companion);
        let headers = [(":status", "200"), ("content-type", "text/event-stream"), ("content-encoding", "br")];
        reply(&mut proxy, &mut stream, &headers, &["\u{8b}\u{2}\u{80}binary"], true);
        assert_eq!(tpm_credit(&mut proxy, &mut companion), 0, "{kind:?}");
    }
}

#[test]
fn a_reply_cut_after_its_headers_is_charged_its_reservation_or_what_it_reported_if_more() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(json!({})));
        let mut companion = FakeCompanion::default();
        let json_reply = [(":status", "200"), ("content-type", "application/json")];
        // The client reads the content and resets before the usage object at the end.
        let mut cut = proxy.send(Request::chat("sk-a", &chat("gpt-4o", false)), &mut companion);
        let body = usage_reply(9, 6_000_000);
        let (content, _) = body.split_at(body.find("\"usage\"").expect("usage in the reply"));
        reply(&mut proxy, &mut cut, &json_reply, &[content], false);
        assert_eq!(tpm_credit(&mut proxy, &mut companion), 0, "{kind:?}: the reservation stands");
        // Cut after the usage object, before the end: what it reported, being more.
        let mut late = proxy.send(Request::chat("sk-b", &chat("gpt-4o", false)), &mut companion);
        let reserved = reserved(&late);
        let (head, tail) = body.split_at(body.len() - 1);
        reply(&mut proxy, &mut late, &json_reply, &[head, tail], false);
        assert_eq!(tpm_credit(&mut proxy, &mut companion), reserved - 6_000_009, "{kind:?}");
        // A stream cut after a few deltas: the reservation, not the few deltas.
        let mut stream = proxy.send(Request::chat("sk-c", &chat("gpt-4o", true)), &mut companion);
        let delta = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        reply(&mut proxy, &mut stream, &[(":status", "200"), ("content-type", "text/event-stream")], &[delta], false);
        assert_eq!(tpm_credit(&mut proxy, &mut companion), 0, "{kind:?}");
    }
}

#[test]
fn a_client_who_leaves_before_the_reply_pays_the_reservation_unless_configured_otherwise() {
    for kind in HOSTS {
        for (extra, expected_output_refund) in
            [(json!({}), false), (json!({"tokens": {"on_client_abort": "prompt_only_unpaid_output"}}), true)]
        {
            let world = World::new(kind);
            let mut proxy = Proxy::new(&world, &config(extra.clone()));
            let mut companion = FakeCompanion::default();
            let mut flight = proxy.send(Request::chat("sk-a", &chat("gpt-4o", false)), &mut companion);
            assert!(flight.forwarded());
            proxy.done(&mut flight);
            // CHAT's allowance is its max_tokens, 300 (a tenant with no history).
            let expected = if expected_output_refund { 300 } else { 0 };
            assert_eq!(tpm_credit(&mut proxy, &mut companion), expected, "{kind:?} {extra}");
        }
    }
}

#[test]
fn a_reasoning_stream_without_usage_is_charged_its_reservation() {
    let sse = concat!(
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
        "data: [DONE]\n\n"
    );
    let stream = [(":status", "200"), ("content-type", "text/event-stream")];
    for kind in HOSTS {
        let world = World::new(kind);
        // Without the usage chunk being asked for (as where the body cannot be rewritten).
        let mut proxy = Proxy::new(&world, &config(json!({"tokens": {"request_stream_usage": false}})));
        let mut companion = FakeCompanion::default();
        let mut reasoning = proxy.send(Request::chat("sk-a", &chat("o3-mini", true)), &mut companion);
        reply(&mut proxy, &mut reasoning, &stream, &[sse], true);
        assert_eq!(tpm_credit(&mut proxy, &mut companion), 0, "{kind:?}: the reservation stands");
        assert!(!has_average(&mut proxy, "sk-a", "o3-mini"), "{kind:?}: nor teaches that completions are short");
        // A model that shows all it spends is charged what it streamed.
        let mut plain = proxy.send(Request::chat("sk-b", &chat("gpt-4o", true)), &mut companion);
        let reserved = reserved(&plain);
        reply(&mut proxy, &mut plain, &stream, &[sse], true);
        let credit = tpm_credit(&mut proxy, &mut companion);
        assert!(credit > 0 && credit < reserved, "{kind:?}: {credit} of {reserved} given back");
    }
}

#[test]
fn the_hidden_output_patterns_are_bounded_at_load() {
    let mut worker = crate::worker::Worker::new();
    let world = World::new(HostKind::Envoy);
    let mut root = crate::testing::FakeHost::new(&world);
    let many: Vec<String> = (0..65).map(|i| format!("m{i}*")).collect();
    for (bad, field) in [
        (json!({"tokens": {"hidden_output_models": many}}), "tokens.hidden_output_models"),
        (json!({"tokens": {"hidden_output_models": ["o1*", ""]}}), "tokens.hidden_output_models[1]"),
        (json!({"tokens": {"on_client_abort": "prompt_only"}}), "on_client_abort"),
    ] {
        let error = worker.configure(&mut root, config(bad.clone()).as_bytes()).expect_err("refused");
        assert!(error.to_string().contains(field), "{bad}: {error}");
    }
}

/// Issue 43 item 3: a JSON reply cut after its text and before its usage object is charged
/// at least the text that passed to the client (a token per byte at most, up to the
/// request's cap), not the small reservation a history of short completions set.
#[test]
fn a_json_reply_cut_after_its_text_is_charged_at_least_the_text_that_passed() {
    for kind in HOSTS {
        let world = World::new(kind);
        let mut proxy = Proxy::new(&world, &config(json!({})));
        let mut companion = FakeCompanion::default();
        let uncapped = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hello world"}]}).to_string();
        let headers = [(":status", "200"), ("content-type", "application/json")];
        let text = "word ".repeat(2_000);
        let head = format!(
            r#"{{"id":"c1","object":"chat.completion","model":"gpt-4o","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}"}},"finish_reason":"stop"}}],"#
        );
        let mut flight = proxy.send(Request::chat("sk-cut", &uncapped), &mut companion);
        assert!(flight.forwarded(), "{kind:?}");
        let first = reserved(&flight);
        assert!(first < 5_000, "{kind:?}: reserved {first}");
        // The client resets the connection before the usage object.
        reply(&mut proxy, &mut flight, &headers, &[&head], false);
        let charged = first - tpm_credit(&mut proxy, &mut companion);
        let passed = (text.len() + "assistant".len() + "stop".len()) as i64;
        assert!(charged >= 10_000, "{kind:?}: charged {charged} for 10,000 bytes of text");
        assert!(charged <= passed + first, "{kind:?}: charged {charged}, the bound is {passed} bytes");
        // With a cap asked for, no more than it: the provider stops there.
        let capped =
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 300})
                .to_string();
        let mut flight = proxy.send(Request::chat("sk-cut", &capped), &mut companion);
        let second = reserved(&flight);
        reply(&mut proxy, &mut flight, &headers, &[&head], false);
        let charged = second - tpm_credit(&mut proxy, &mut companion);
        assert_eq!(charged, second, "{kind:?}: held to its reservation, which covers its cap of 300");
    }
}
