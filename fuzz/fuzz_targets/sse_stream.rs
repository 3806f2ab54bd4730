//! Any bytes as a streamed reply, cut into chunks at the positions the first bytes pick:
//! usage read and the usage chunk removed without a panic, and the same usage whatever
//! the chunking.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::parse::sse::UsageChunkRemover;
use llm_ratelimit_core::tokens::Encoding;
use llm_ratelimit_core::readers::usage::StreamUsage;

fn read(stream: &[u8], cuts: &[u8]) -> (llm_ratelimit_core::api::ReportedUsage, u64) {
    let mut usage = StreamUsage::new(Encoding::O200kBase, 1 << 16);
    let mut remover = UsageChunkRemover::default();
    let mut rest = stream;
    for &cut in cuts {
        let (head, tail) = rest.split_at((cut as usize).min(rest.len()));
        usage.feed(head);
        let _ = remover.filter(head, false);
        rest = tail;
    }
    usage.feed(rest);
    let _ = remover.filter(rest, true);
    usage.finish();
    (usage.reported(), usage.output_tokens())
}

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |&n| (n as usize % 8).min(data.len().saturating_sub(1)));
    let (cuts, stream) = data.get(1..).unwrap_or(&[]).split_at(split);
    assert_eq!(read(stream, cuts), read(stream, &[]));
});
