//! The token usage a provider reports, read from a JSON reply or a stream of SSE events,
//! whichever API produced it:
//!
//! | API | where |
//! |---|---|
//! | OpenAI chat/completions, embeddings | `usage.prompt_tokens`, `usage.completion_tokens`; streamed: the last chunk |
//! | OpenAI Responses | `usage.input_tokens`, `usage.output_tokens`; streamed: `response.completed` |
//! | Anthropic messages | `usage.input_tokens` (+ cache creation and reads), `usage.output_tokens`; streamed: `message_start`, then `message_delta` (cumulative) |
//!
//! A stream without usage is settled on its text: the streamed deltas are counted with
//! the tokenizer.

use crate::json::Field;
use crate::sse::{SseEvent, SseParser};
use crate::tokens::Encoding;
use serde_json::Value;

/// Tokens as billed. `input` includes cached and cache-creation tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub input: u64,
    pub output: u64,
}

impl Usage {
    pub fn total(self) -> u64 {
        self.input + self.output
    }
}

/// What one message reported; later reports override earlier ones field by field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReportedUsage {
    pub input: Option<u64>,
    pub output: Option<u64>,
    /// Of the input, tokens read from the provider's prompt cache (billed at a lower
    /// price by most providers).
    pub cached_input: Option<u64>,
}

impl ReportedUsage {
    fn merge(&mut self, later: ReportedUsage) {
        self.input = later.input.or(self.input);
        self.output = later.output.or(self.output);
        self.cached_input = later.cached_input.or(self.cached_input);
    }

    pub fn is_empty(self) -> bool {
        self.input.is_none() && self.output.is_none()
    }
}

/// Usage from a usage object, or from a message holding one at `usage`, `message.usage`
/// or `response.usage`.
pub fn reported_usage(message: &Value) -> ReportedUsage {
    let mut found = ReportedUsage::default();
    for usage in [&message.at("usage"), &message.at("message").at("usage"), &message.at("response").at("usage")] {
        if usage.is_object() {
            found.merge(from_usage_object(usage));
        }
    }
    found
}

fn from_usage_object(usage: &Value) -> ReportedUsage {
    let field = |name: &str| usage.at(name).as_u64();
    let input = field("prompt_tokens").or_else(|| {
        let base = field("input_tokens")?;
        Some(base + field("cache_creation_input_tokens").unwrap_or(0) + field("cache_read_input_tokens").unwrap_or(0))
    });
    let output = field("completion_tokens").or_else(|| field("output_tokens"));
    // Embeddings report prompt tokens only: their output is zero, not unknown.
    let output = output.or_else(|| (input.is_some() && usage.get("total_tokens").is_some()).then_some(0));
    let cached_input = usage
        .at("prompt_tokens_details")
        .at("cached_tokens")
        .as_u64()
        .or_else(|| usage.at("input_tokens_details").at("cached_tokens").as_u64())
        .or_else(|| field("cache_read_input_tokens"));
    ReportedUsage { input, output, cached_input }
}

/// Usage from a whole JSON reply held by `ReplyUsage`'s window (see there).
pub fn usage_in_json(body: &[u8]) -> ReportedUsage {
    match serde_json::from_slice::<Value>(body) {
        Ok(value) => reported_usage(&value),
        Err(_) => usage_after_key(body),
    }
}

/// The object after the last `"usage":` in a fragment of JSON: how the usage of a reply
/// too large to keep is found in its tail (providers write usage last). Inside a JSON
/// string a quote is escaped, so the pattern cannot match text.
fn usage_after_key(fragment: &[u8]) -> ReportedUsage {
    const KEY: &[u8] = b"\"usage\"";
    let mut best = ReportedUsage::default();
    let mut from = 0;
    while let Some(at) = fragment.get(from..).and_then(|rest| rest.windows(KEY.len()).position(|w| w == KEY)) {
        let after = from + at + KEY.len();
        from = after;
        let rest = fragment.get(after..).unwrap_or(&[]);
        let rest = rest.trim_ascii_start();
        let Some(rest) = rest.strip_prefix(b":") else {
            continue;
        };
        let mut values = serde_json::Deserializer::from_slice(rest).into_iter::<Value>();
        if let Some(Ok(usage)) = values.next() {
            let found = from_usage_object(&usage);
            if !found.is_empty() {
                best = found;
            }
        }
    }
    best
}

/// Collects a non-streamed reply for its usage: the whole body while it is small, then
/// only its head and tail, so a large reply (embeddings) costs bounded memory.
#[derive(Debug)]
pub struct ReplyUsage {
    body: Vec<u8>,
    tail: Vec<u8>,
    window: usize,
    truncated: bool,
}

impl ReplyUsage {
    pub fn new(window: usize) -> ReplyUsage {
        ReplyUsage { body: Vec::new(), tail: Vec::new(), window, truncated: false }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if !self.truncated && self.body.len() + chunk.len() <= self.window {
            self.body.extend_from_slice(chunk);
            return;
        }
        if !self.truncated {
            self.truncated = true;
            self.tail = std::mem::take(&mut self.body);
        }
        self.tail.extend_from_slice(chunk);
        if self.tail.len() > 2 * self.window {
            self.tail.drain(..self.tail.len() - self.window);
        }
    }

    pub fn finish(&self) -> ReportedUsage {
        if self.truncated {
            usage_after_key(&self.tail)
        } else {
            usage_in_json(&self.body)
        }
    }
}

/// Follows a streamed reply: the usage it reports, and the text it streamed (counted only
/// if the stream never reports its output tokens).
#[derive(Debug)]
pub struct StreamUsage {
    parser: SseParser,
    reported: ReportedUsage,
    encoding: Encoding,
    text: String,
    counted_output: u64,
    /// True once the stream said it was complete (`[DONE]`, `message_stop`,
    /// `response.completed`).
    pub finished: bool,
}

/// Streamed text is counted in pieces of about this size, so memory stays bounded.
const TEXT_FLUSH_BYTES: usize = 16 * 1024;

impl StreamUsage {
    pub fn new(encoding: Encoding, max_event_bytes: usize) -> StreamUsage {
        StreamUsage {
            parser: SseParser::new(max_event_bytes),
            reported: ReportedUsage::default(),
            encoding,
            text: String::new(),
            counted_output: 0,
            finished: false,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        let mut events = Vec::new();
        self.parser.feed(chunk, &mut |event| events.push(event));
        for event in events {
            self.on_event(event);
        }
    }

    pub fn finish(&mut self) {
        let mut events = Vec::new();
        self.parser.finish(&mut |event| events.push(event));
        for event in events {
            self.on_event(event);
        }
    }

    fn on_event(&mut self, event: SseEvent) {
        if event.data.trim() == "[DONE]" {
            self.finished = true;
            return;
        }
        let Ok(message) = serde_json::from_str::<Value>(&event.data) else {
            return;
        };
        self.reported.merge(reported_usage(&message));
        let kind = message.at("type").as_str().unwrap_or(event.event.as_str());
        if matches!(kind, "message_stop" | "response.completed" | "response.incomplete" | "response.failed") {
            self.finished = true;
        }
        self.collect_text(&message);
    }

    /// The generated text of one event: OpenAI chat deltas (content, refusal, tool
    /// arguments), legacy completions, Anthropic text and tool-input deltas, Responses
    /// text and argument deltas.
    fn collect_text(&mut self, message: &Value) {
        if let Some(choices) = message.at("choices").as_array() {
            for choice in choices {
                let delta = &choice.at("delta");
                for text in
                    [&delta.at("content"), &delta.at("refusal"), &delta.at("reasoning_content"), &choice.at("text")]
                {
                    self.push_text(text.as_str());
                }
                for call in delta.at("tool_calls").as_array().into_iter().flatten() {
                    self.push_text(call.at("function").at("arguments").as_str());
                    self.push_text(call.at("function").at("name").as_str());
                }
            }
        }
        match message.at("type").as_str() {
            Some("content_block_delta") => {
                let delta = &message.at("delta");
                self.push_text(
                    delta.at("text").as_str().or(delta.at("partial_json").as_str()).or(delta.at("thinking").as_str()),
                );
            }
            Some(kind) if kind.starts_with("response.") && kind.ends_with(".delta") => {
                self.push_text(message.at("delta").as_str())
            }
            _ => {}
        }
    }

    fn push_text(&mut self, text: Option<&str>) {
        let Some(text) = text else { return };
        self.text.push_str(text);
        if self.text.len() >= TEXT_FLUSH_BYTES {
            self.counted_output += self.encoding.count(&self.text);
            self.text.clear();
        }
    }

    pub fn reported(&self) -> ReportedUsage {
        self.reported
    }

    /// Output tokens: as reported, or else counted from the streamed text.
    pub fn output_tokens(&self) -> u64 {
        self.reported.output.unwrap_or_else(|| self.counted_output + self.encoding.count(&self.text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;

    pub const OPENAI_STREAM: &str = include_str!("../../../tests/cases/streams/openai_chat_usage.sse");
    pub const OPENAI_STREAM_NO_USAGE: &str = include_str!("../../../tests/cases/streams/openai_chat_no_usage.sse");
    pub const ANTHROPIC_STREAM: &str = include_str!("../../../tests/cases/streams/anthropic_messages.sse");
    pub const RESPONSES_STREAM: &str = include_str!("../../../tests/cases/streams/openai_responses.sse");

    fn run(stream: &str, chunks: &[usize]) -> (ReportedUsage, u64, bool) {
        let mut tracker = StreamUsage::new(Encoding::O200kBase, 1 << 20);
        let bytes = stream.as_bytes();
        let mut at = 0;
        for &size in chunks {
            let end = (at + size).min(bytes.len());
            tracker.feed(&bytes[at..end]);
            at = end;
        }
        tracker.feed(&bytes[at..]);
        tracker.finish();
        (tracker.reported(), tracker.output_tokens(), tracker.finished)
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn reads_each_providers_streamed_usage() {
        let cases = [
            (OPENAI_STREAM, ReportedUsage { input: Some(19), output: Some(10), cached_input: Some(0) }, 10),
            (ANTHROPIC_STREAM, ReportedUsage { input: Some(472), output: Some(15), cached_input: Some(0) }, 15),
            (RESPONSES_STREAM, ReportedUsage { input: Some(37), output: Some(11), cached_input: Some(0) }, 11),
        ];
        for (stream, usage, output) in cases {
            assert_eq!(run(stream, &[]), (usage, output, true));
        }
    }

    /// Higress #2187: a stream without a usage chunk must still be charged.
    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn a_stream_without_usage_is_counted_from_its_text() {
        let (reported, output, finished) = run(OPENAI_STREAM_NO_USAGE, &[]);
        assert_eq!(reported, ReportedUsage::default());
        // " The quick brown fox jumps over the lazy dog." is 10 tokens in o200k_base.
        assert_eq!((output, finished), (10, true));
    }

    /// Higress #4146: an event split across two body callbacks; here at every byte.
    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn every_two_way_split_gives_the_same_usage() {
        for stream in [OPENAI_STREAM, OPENAI_STREAM_NO_USAGE, ANTHROPIC_STREAM, RESPONSES_STREAM] {
            let whole = run(stream, &[]);
            for at in 0..=stream.len() {
                assert_eq!(run(stream, &[at]), whole, "split at {at}");
            }
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn reads_json_replies() {
        let cases = [
            (
                r#"{"object":"chat.completion","usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":4}}}"#,
                (Some(12), Some(5), Some(4)),
            ),
            (r#"{"object":"list","data":[],"usage":{"prompt_tokens":8,"total_tokens":8}}"#, (Some(8), Some(0), None)),
            (
                r#"{"object":"response","usage":{"input_tokens":30,"input_tokens_details":{"cached_tokens":20},"output_tokens":7,"total_tokens":37}}"#,
                (Some(30), Some(7), Some(20)),
            ),
            (
                r#"{"type":"message","usage":{"input_tokens":10,"cache_creation_input_tokens":100,"cache_read_input_tokens":1000,"output_tokens":3}}"#,
                (Some(1110), Some(3), Some(1000)),
            ),
            (r#"{"error":{"message":"bad"}}"#, (None, None, None)),
            (r#"not json"#, (None, None, None)),
        ];
        for (body, (input, output, cached_input)) in cases {
            let mut reply = ReplyUsage::new(1024);
            reply.feed(body.as_bytes());
            assert_eq!(reply.finish(), ReportedUsage { input, output, cached_input }, "{body}");
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn finds_usage_in_the_tail_of_a_large_reply() {
        let filler = format!("\"{}\"", "0.1234,".repeat(50_000));
        let body = format!(
            r#"{{"object":"list","data":[{filler}],"text":"say \"usage\": {{\"prompt_tokens\": 999}}","usage":{{"prompt_tokens":77,"total_tokens":77}}}}"#
        );
        let mut reply = ReplyUsage::new(4096);
        for chunk in body.as_bytes().chunks(1000) {
            reply.feed(chunk);
        }
        assert_eq!(reply.finish(), ReportedUsage { input: Some(77), output: Some(0), cached_input: None });
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Any split of a stream into any number of chunks gives the same usage.
        #[test]
        fn any_chunking_gives_the_same_usage(cuts in proptest::collection::vec(0usize..400, 0..30), which in 0usize..4) {
            let stream = [OPENAI_STREAM, OPENAI_STREAM_NO_USAGE, ANTHROPIC_STREAM, RESPONSES_STREAM][which];
            prop_assert_eq!(run(stream, &cuts), run(stream, &[]));
        }

        /// Mangled streams and replies never panic.
        #[test]
        fn mutations_never_panic(flips in proptest::collection::vec((0usize..4000, any::<u8>()), 0..40), which in 0usize..4, cuts in proptest::collection::vec(0usize..300, 0..10)) {
            let mut bytes = [OPENAI_STREAM, OPENAI_STREAM_NO_USAGE, ANTHROPIC_STREAM, RESPONSES_STREAM][which].as_bytes().to_vec();
            for (at, byte) in flips {
                let len = bytes.len();
                bytes[at % len] = byte;
            }
            let mut tracker = StreamUsage::new(Encoding::O200kBase, 1 << 20);
            let mut rest = bytes.as_slice();
            for cut in cuts {
                let (head, tail) = rest.split_at(cut.min(rest.len()));
                tracker.feed(head);
                rest = tail;
            }
            tracker.feed(rest);
            tracker.finish();
            let _ = tracker.output_tokens();
            let mut reply = ReplyUsage::new(512);
            reply.feed(&bytes);
            let _ = reply.finish();
        }
    }
}
