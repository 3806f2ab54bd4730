//! Any bytes as a filter config: an error or a policy, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = llm_ratelimit_core::config::Policy::from_json(data);
});
