//! Any bytes as a Bedrock event stream (`converse-stream` or
//! `invoke-with-response-stream`), cut into chunks at the positions the first bytes pick:
//! decoded without a panic, and the same messages and usage whatever the chunking.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::eventstream::{EventStreamDecoder, Message};
use llm_ratelimit_core::providers::bedrock::EventStreamUsage;
use llm_ratelimit_core::tokens::Encoding;
use llm_ratelimit_core::usage::ReportedUsage;

fn read(stream: &[u8], cuts: &[u8]) -> (Vec<Message>, ReportedUsage, u64, Option<String>) {
    let mut decoder = EventStreamDecoder::new(1 << 16);
    let mut usage = EventStreamUsage::new(Encoding::O200kBase, 1 << 16);
    let mut messages = Vec::new();
    let mut rest = stream;
    for &cut in cuts {
        let (head, tail) = rest.split_at((cut as usize).min(rest.len()));
        decoder.feed(head, &mut |m| messages.push(m));
        usage.feed(head);
        rest = tail;
    }
    decoder.feed(rest, &mut |m| messages.push(m));
    usage.feed(rest);
    (messages, usage.reported(), usage.output_tokens(), usage.exception.clone())
}

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |&n| (n as usize % 8).min(data.len().saturating_sub(1)));
    let (cuts, stream) = data.get(1..).unwrap_or(&[]).split_at(split);
    assert_eq!(read(stream, cuts), read(stream, &[]));
});
