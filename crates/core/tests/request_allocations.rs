//! Heap allocations per request once a worker is warm, counted by a global allocator
//! around the workload of `examples/request_bench.rs` (the fake host, Envoy's semantics):
//! a tiny chat admitted from a lease, and the same on the local store, and a chat of
//! three exchanges. Each count has a fixed ceiling just above what the path makes today,
//! so a change that allocates more per request fails here on any machine, without timing.
//!
//! What is counted: every call into the allocator (allocations and reallocations; frees
//! are not counted) made on the test's thread while a request is served and ticks are
//! run, the fake host's own included (it hands out owned headers, bodies and shared data
//! as the proxy-wasm SDK does, and records what it is given). Building the request is
//! left out. A ceiling lowered by a change that allocates less keeps it honest.
//!
//! The counts are the same under `make test`'s `cargo test --workspace` (where mock-llm's
//! `preserve_order` feature of serde_json is unified into this crate) as alone
//! (`cargo test -p llm-ratelimit-core`): 99.8, 106.8 and 100.7 since request bodies are
//! read without a `serde_json::Value` (issue 48; they were 104.8, 126.8 and 105.7 under
//! the workspace before).

use llm_ratelimit_core::testing::bench::{self, Run};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Whether this thread's allocations are being counted, and how many there were.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static CALLS: Cell<u64> = const { Cell::new(0) };
}

fn note() {
    // `try_with`: a thread being torn down has no locals left, and is not counted.
    let _ = COUNTING.try_with(|on| {
        if on.get() {
            let _ = CALLS.try_with(|calls| calls.set(calls.get() + 1));
        }
    });
}

// SAFETY: every call goes to `System` unchanged; counting touches only const-initialised
// thread locals without destructors, which neither allocate nor re-enter the allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Requests served before counting: the VM's tables, leases and caches settle in.
const WARM_UP: usize = 1_000;
/// Requests counted: whole ticks' worth (250 a tick), so ticks weigh as they do in a run.
const COUNTED: usize = 1_000;

/// Allocator calls per request in `mode` with `body` traffic, once warm.
fn allocations_per_request(mode: &str, body: &str) -> f64 {
    let bodies = bench::bodies(body);
    let reply = bench::reply("small");
    // 10 tenants, as `scripts/bench_instructions.py` runs the benchmark.
    let mut run = Run::new(mode, 10, 250);
    for i in 0..WARM_UP {
        let request = run.request(&bodies[i % bodies.len()]);
        run.serve(request, &reply);
    }
    CALLS.with(|calls| calls.set(0));
    for i in 0..COUNTED {
        let request = run.request(&bodies[i % bodies.len()]);
        COUNTING.with(|on| on.set(true));
        run.serve(request, &reply);
        COUNTING.with(|on| on.set(false));
    }
    let per_request = CALLS.with(Cell::get) as f64 / COUNTED as f64;
    eprintln!("{mode} {body}: {per_request:.2} allocations per request");
    per_request
}

fn assert_at_most(mode: &str, body: &str, ceiling: f64) {
    let per_request = allocations_per_request(mode, body);
    assert!(
        per_request <= ceiling,
        "{mode} {body}: {per_request:.2} allocations per request, more than the {ceiling} allowed: \
         something on the request path allocates again (profile it with request_bench under valgrind)"
    );
}

#[test]
fn a_leased_tiny_chat_allocates_little() {
    assert_at_most("lease", "small", 101.0);
}

#[test]
fn a_leased_chat_allocates_little() {
    assert_at_most("lease", "chat", 108.0);
}

#[test]
fn a_tiny_chat_on_the_local_store_allocates_little() {
    assert_at_most("local", "small", 102.0);
}
