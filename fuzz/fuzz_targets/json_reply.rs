//! Any bytes as a non-streamed reply, in chunks, with a small window so the tail scan runs.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::usage::ReplyUsage;

fuzz_target!(|data: &[u8]| {
    let mut reply = ReplyUsage::new(64);
    for chunk in data.chunks(17) {
        reply.feed(chunk);
    }
    let _ = reply.finish();
    let _ = llm_ratelimit_core::usage::usage_in_json(data);
});
