//! Any bytes as a Gemini stream sent as a JSON array (`streamGenerateContent` without
//! `alt=sse`), cut into chunks at the positions the first bytes pick: the elements split
//! out and the usage read are the same whatever the chunking, nothing is kept past the
//! limit, and nothing panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llm_ratelimit_core::parse::json_array_stream::JsonArrayStream;
use llm_ratelimit_core::tokens::Encoding;
use llm_ratelimit_core::api::ReportedUsage;
use llm_ratelimit_core::readers::usage::StreamUsage;

const MAX_ELEMENT: usize = 1 << 12;

fn read(stream: &[u8], cuts: &[u8]) -> (Vec<Vec<u8>>, ReportedUsage, u64) {
    let mut splitter = JsonArrayStream::new(MAX_ELEMENT);
    let mut usage = StreamUsage::json_array(Encoding::O200kBase, MAX_ELEMENT);
    let mut elements = Vec::new();
    let mut rest = stream;
    for &cut in cuts.iter().chain(std::iter::once(&u8::MAX)) {
        let (head, tail) = rest.split_at(if cut == u8::MAX { rest.len() } else { (cut as usize).min(rest.len()) });
        splitter.feed(head, &mut |element| {
            assert!(element.len() <= MAX_ELEMENT);
            elements.push(element.to_vec());
        });
        usage.feed(head);
        rest = tail;
    }
    usage.finish();
    (elements, usage.reported(), usage.output_tokens())
}

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |&n| (n as usize % 8).min(data.len().saturating_sub(1)));
    let (cuts, stream) = data.get(1..).unwrap_or(&[]).split_at(split);
    assert_eq!(read(stream, cuts), read(stream, &[]));
});
