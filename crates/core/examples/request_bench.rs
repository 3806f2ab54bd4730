//! The core's per-request path on the fake host, without a proxy: where a request's cycles
//! go (body parse, tokenization, lease bookkeeping, reply reading) shows here without V8.
//! Usage: cargo run --release --features testing --example request_bench -- [lease|direct|local|local-requests] [small|stream|chat|turns|idle] [N] [TENANTS] [PER_TICK]
//! (`idle`: N ticks of a VM at rest after serving its tenants once each.)
//! (TENANTS: API keys the requests rotate over, 1,000 by default; `scripts/bench_instructions.py` uses 10.)
//! (PER_TICK: requests between two ticks, 250 by default, a proxy at 5,000 requests a second;
//! Envoy under callgrind serves about 4 a tick, where the tick's work weighs more per request.)
//! Prints one JSON line: requests, microseconds per request. Run it under
//! `valgrind --tool=callgrind` for a repeatable per-function profile.

use llm_ratelimit_core::testing::bench::{self, Run};
use llm_ratelimit_core::testing::{advance, World};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map_or("lease", String::as_str);
    let body_kind = args.get(1).map_or("chat", String::as_str);
    let n: usize = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(20_000);
    let tenants: usize = args.get(3).and_then(|n| n.parse().ok()).unwrap_or(1000);
    let per_tick: usize = args.get(4).and_then(|n| n.parse().ok()).unwrap_or(250);
    // Bodies built before timing.
    let bodies = bench::bodies(body_kind);
    let reply = bench::reply(body_kind);
    let mut run = Run::new(mode, tenants, per_tick);
    let world = run.world.clone();
    let started = Instant::now();
    if body_kind == "idle" {
        // The VM at rest after its tenants were served: `n` ticks, 50 ms apart.
        for _ in 0..tenants.max(1) {
            let request = run.request(&bodies[0]);
            let mut flight = run.proxy.send(request, &mut run.companion);
            let chunks: Vec<&str> = reply.chunks.iter().map(String::as_str).collect();
            run.proxy.reply(&mut flight, 200, reply.content_type, &chunks);
            run.served += 1;
        }
        let before = world.borrow().host_calls.clone();
        let started = Instant::now();
        for _ in 0..n {
            advance(&world, 50);
            run.proxy.tick(Some(&mut run.companion));
        }
        let elapsed = started.elapsed();
        println!(
            "{{\"idle_ticks\": {n}, \"us_per_tick\": {:.2}, \"host_calls_per_tick\": {{{}}}}}",
            elapsed.as_secs_f64() * 1e6 / n as f64,
            calls_per(&world, before, n)
        );
        return;
    }
    run.serve_all(&bodies, &reply, n);
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
