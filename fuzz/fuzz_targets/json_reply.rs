//! Any bytes as a non-streamed reply, fed in chunks of a size the first byte picks (so
//! every key, string and usage object gets cut somewhere): what was found, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::readers::usage::ReplyUsage;

fuzz_target!(|data: &[u8]| {
    let Some((&size, body)) = data.split_first() else { return };
    let mut reply = ReplyUsage::new();
    for chunk in body.chunks(usize::from(size).max(1)) {
        reply.feed(chunk);
    }
    let _ = reply.finish();
    let _ = reply.model();
});
