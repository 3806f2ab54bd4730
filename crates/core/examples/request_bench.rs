//! The core's per-request path on the fake host, without a proxy: where a request's cycles
//! go (body parse, tokenization, lease bookkeeping, reply reading) shows here without V8.
//! Usage: cargo run --release --features testing --example request_bench -- [lease|direct|local|local-requests] [small|chat|turns|idle] [N] [TENANTS] [PER_TICK]
//! (`idle`: N ticks of a VM at rest after serving its tenants once each.)
//! (TENANTS: API keys the requests rotate over, 1,000 by default; `scripts/bench_instructions.py` uses 10.)
//! (PER_TICK: requests between two ticks, 250 by default, a proxy at 5,000 requests a second;
//! Envoy under callgrind serves about 4 a tick, where the tick's work weighs more per request.)
//! Prints one JSON line: requests, microseconds per request. Run it under
//! `valgrind --tool=callgrind` for a repeatable per-function profile.

use llm_ratelimit_core::effects::host::HostKind;
use llm_ratelimit_core::testing::{advance, FakeCompanion, Proxy, Request, World};
use serde_json::json;
use std::time::Instant;

const SYSTEM: &str = "You are a careful assistant for a logistics company. Answer in plain English, \
cite the shipment id when you refer to one, never invent tracking numbers, and keep answers under \
two hundred words unless the user asks for detail. If a question is about billing, say that billing \
questions go to the accounts team and give the address accounts@example.com.";

fn turn(i: usize) -> (String, String) {
    (
        format!("Where is shipment SH-{i:05}? It left Rotterdam on the {}th and the customer asks daily.", i % 28 + 1),
        format!(
            "Shipment SH-{i:05} cleared customs in Antwerp and is on the truck to Lyon; the carrier expects \
             delivery within {} days. I will flag it if the estimate moves.",
            i % 5 + 1
        ),
    )
}

/// A chat body: the system prompt and `turns` exchanges, then a new question.
fn chat(turns: usize) -> String {
    let mut messages = vec![json!({"role": "system", "content": SYSTEM})];
    for i in 0..turns {
        let (question, answer) = turn(i);
        messages.push(json!({"role": "user", "content": question}));
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    messages.push(json!({"role": "user", "content": turn(turns).0}));
    json!({"model": "gpt-4o-mini", "messages": messages, "max_tokens": 256}).to_string()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map_or("lease", String::as_str);
    let body_kind = args.get(1).map_or("chat", String::as_str);
    let n: usize = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(20_000);
    let limits = json!([{"name": "rpm", "requests": 1_000_000_000u64, "window": "1m"},
                        {"name": "tpm", "tokens": 1_000_000_000_000u64, "window": "1m"}]);
    let companion = json!({"upstream": "companion", "token": "test-token-0123456789"});
    let config = match mode {
        "lease" | "direct" => json!({
            "companion": companion, "failure_mode": "deny", "lease": {"enabled": mode == "lease"}, "limits": limits
        }),
        // Every limit in the proxy's shared data: no companion at all.
        "local" => json!({"store": "local", "limits": limits}),
        "local-requests" => json!({"store": "local", "limits": [limits[0].clone()]}),
        other => panic!("mode lease, direct, local or local-requests, not {other}"),
    }
    .to_string();
    // Bodies built before timing; "turns" is a conversation growing by one exchange per
    // request, as a client resends the whole chat each turn.
    let bodies: Vec<String> = match body_kind {
        "small" => vec![
            json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8})
                .to_string(),
        ],
        "chat" => vec![chat(3)],
        "turns" => (0..20).map(chat).collect(),
        "idle" => vec![chat(0)],
        other => panic!("body small, chat, turns or idle, not {other}"),
    };
    let reply = json!({"id": "c1", "object": "chat.completion", "model": "gpt-4o-mini",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there, how can I help?"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}})
    .to_string();

    let world = World::new(HostKind::Envoy);
    let mut proxy = Proxy::new(&world, &config);
    let mut companion = FakeCompanion::default();
    let tenants: usize = args.get(3).and_then(|n| n.parse().ok()).unwrap_or(1000).max(1);
    let keys: Vec<String> = (0..tenants).map(|i| format!("sk-bench-{i}")).collect();
    let per_tick: usize = args.get(4).and_then(|n| n.parse().ok()).unwrap_or(250).max(1);
    let started = Instant::now();
    if body_kind == "idle" {
        // The VM at rest after its tenants were served: `n` ticks, 50 ms apart.
        for key in &keys {
            let mut flight = proxy.send(Request::chat(key, &bodies[0]), &mut companion);
            proxy.reply(&mut flight, 200, "application/json", &[&reply]);
        }
        let before = world.borrow().host_calls.clone();
        let started = Instant::now();
        for _ in 0..n {
            advance(&world, 50);
            proxy.tick(Some(&mut companion));
        }
        let elapsed = started.elapsed();
        println!(
            "{{\"idle_ticks\": {n}, \"us_per_tick\": {:.2}, \"host_calls_per_tick\": {{{}}}}}",
            elapsed.as_secs_f64() * 1e6 / n as f64,
            calls_per(&world, before, n)
        );
        return;
    }
    for i in 0..n {
        let request = Request::chat(&keys[i % keys.len()], &bodies[i % bodies.len()]);
        let mut flight = proxy.send(request, &mut companion);
        if !flight.forwarded() {
            panic!("request {i} was not forwarded: {:?}", flight.replied());
        }
        proxy.reply(&mut flight, 200, "application/json", &[&reply]);
        // The clock of a proxy serving `per_tick` requests every 50 ms, ticking every 50 ms.
        if (i + 1) * 50 / per_tick > i * 50 / per_tick {
            advance(&world, ((i + 1) * 50 / per_tick - i * 50 / per_tick) as u64);
        }
        if i % per_tick == per_tick - 1 {
            proxy.tick(Some(&mut companion));
        }
    }
    let elapsed = started.elapsed();
    println!(
        "{{\"mode\": \"{mode}\", \"body\": \"{body_kind}\", \"requests\": {n}, \"us_per_request\": {:.2}, \"host_calls_per_request\": {{{}}}}}",
        elapsed.as_secs_f64() * 1e6 / n as f64,
        calls_per(&world, Default::default(), n)
    );
}

/// The host calls made since `before`, per request (or tick), as JSON members.
fn calls_per(
    world: &std::rc::Rc<std::cell::RefCell<World>>,
    before: std::collections::BTreeMap<&'static str, u64>,
    n: usize,
) -> String {
    let world = world.borrow();
    let calls: Vec<String> = world
        .host_calls
        .iter()
        .map(|(name, count)| (name, count - before.get(name).copied().unwrap_or(0)))
        .filter(|(_, count)| *count > 0)
        .map(|(name, count)| format!("\"{name}\": {:.2}", count as f64 / n as f64))
        .collect();
    calls.join(", ")
}
