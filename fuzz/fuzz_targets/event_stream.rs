//! Any bytes as a Bedrock event stream (`converse-stream` or
//! `invoke-with-response-stream`), cut into chunks at the positions the first bytes pick:
//! decoded without a panic, and the same messages and usage whatever the chunking. Half
//! the inputs are framed here with valid CRCs (each piece between 0xff bytes a message,
//! its first byte picking the event type), so the fuzzer reaches headers and payloads
//! and not only the CRC checks.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::parse::eventstream::{encode, EventStreamDecoder, Message};
use llm_ratelimit_core::readers::usage::EventStreamUsage;
use llm_ratelimit_core::tokens::Encoding;
use llm_ratelimit_core::api::ReportedUsage;

const EVENTS: [&str; 5] = ["chunk", "contentBlockDelta", "metadata", "messageStart", "messageStop"];

fn framed(data: &[u8]) -> Vec<u8> {
    data.split(|&b| b == 0xff)
        .flat_map(|piece| {
            let (kind, payload) = piece.split_first().map_or((0, &[][..]), |(k, p)| (usize::from(*k), p));
            let headers = match EVENTS.get(kind % 6) {
                Some(event) => {
                    vec![(":event-type", *event), (":content-type", "application/json"), (":message-type", "event")]
                }
                None => vec![(":exception-type", "throttlingException"), (":message-type", "exception")],
            };
            encode(&headers, payload)
        })
        .collect()
}

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
    let Some((&first, rest)) = data.split_first() else { return };
    let split = (usize::from(first) % 8).min(rest.len());
    let (cuts, stream) = rest.split_at(split);
    let stream = if first & 0x80 != 0 { framed(stream) } else { stream.to_vec() };
    assert_eq!(read(&stream, cuts), read(&stream, &[]));
});
