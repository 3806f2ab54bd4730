//! `request_bench`'s loop built for wasm32 and run by Node's V8 with TurboFan only, as
//! Envoy runs the filter: the core's per-request work as V8's compiled code does it,
//! which differs from the native build by more than a constant (allocation and copies,
//! which V8 makes a call into C, weigh more; the fake host is in the counts, as in
//! `request_bench`).
//! `scripts/bench_v8.py` builds it, runs it under callgrind and prints the slope.

use llm_ratelimit_core::testing::bench::{self, Run};

const MODES: [&str; 3] = ["lease", "local", "direct"];
const BODIES: [&str; 4] = ["small", "chat", "turns", "stream"];

/// Serves `n` requests as `request_bench MODE BODY n tenants per_tick` does (`mode` and
/// `body` index `MODES` and `BODIES`); the requests served, or 0 for an unknown kind.
#[no_mangle]
pub extern "C" fn serve(mode: u32, body: u32, n: u32, tenants: u32, per_tick: u32) -> u32 {
    let (Some(mode), Some(body_kind)) = (MODES.get(mode as usize), BODIES.get(body as usize)) else { return 0 };
    let bodies = bench::bodies(body_kind);
    let reply = bench::reply(body_kind);
    let mut run = Run::new(mode, tenants as usize, per_tick as usize);
    run.serve_all(&bodies, &reply, n as usize);
    run.served as u32
}
