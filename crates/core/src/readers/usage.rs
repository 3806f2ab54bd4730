//! The token usage a provider reports, read from a JSON reply or a stream of SSE events,
//! whichever API produced it:
//!
//! Where a reply carries it: a usage object at `usage` (OpenAI, Anthropic, Bedrock),
//! `message.usage` (Anthropic's `message_start`), `response.usage` (OpenAI Responses'
//! events) or `x_groq.usage` (Groq's streams), or Gemini's `usageMetadata`. What each
//! provider's objects and streamed events hold is its module's (`crate::providers`); this
//! follows the framings (a JSON reply, SSE, a JSON array, AWS's event stream).
//!
//! A stream without usage is settled on its text: the streamed deltas are counted with
//! the tokenizer.

use crate::parse::eventstream::{EventStreamDecoder, Message, StreamError};
use crate::parse::json::{closes_string, Json};
use crate::parse::json_array_stream::JsonArrayStream;
use crate::parse::sse::{SseEvent, SseParser};
use crate::providers::bedrock::{self, StreamPart};
use crate::providers::{self, openai};
use crate::tokens::Encoding;

use crate::api::ReportedUsage;

/// Usage from a usage object, or from a message holding one at `usage`, `message.usage`,
/// `response.usage`, `usageMetadata` (Gemini) or `x_groq.usage` (Groq's streams).
pub fn reported_usage(message: Json) -> ReportedUsage {
    let mut found = ReportedUsage::default();
    for usage in [
        message.at("usage"),
        message.at("message").at("usage"),
        message.at("response").at("usage"),
        message.at("x_groq").at("usage"),
    ] {
        if usage.is_object() {
            found.merge(providers::usage_object(usage));
        }
    }
    let metadata = message.at("usageMetadata");
    if metadata.is_object() {
        found.merge(providers::usage_metadata(metadata));
    }
    found
}

/// Where the APIs put usage in a JSON reply, in the order later reports override earlier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UsagePath {
    /// `usage`: OpenAI chat, completions, embeddings, Responses; Anthropic messages.
    Top,
    /// `message.usage`, `response.usage`: the same objects wrapped, as some APIs' events
    /// carry them.
    Message,
    Response,
    /// `usageMetadata`: Gemini and Vertex AI.
    Metadata,
}

/// The key of a field on the way to a usage object; every other key is `Other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathKey {
    Usage,
    UsageMetadata,
    Message,
    Response,
    /// `model`: which model answered, at the top of the reply.
    Model,
    Other,
}

impl PathKey {
    fn of(key: &[u8]) -> PathKey {
        match key {
            b"usage" => PathKey::Usage,
            b"usageMetadata" => PathKey::UsageMetadata,
            b"message" => PathKey::Message,
            b"model" => PathKey::Model,
            b"response" => PathKey::Response,
            _ => PathKey::Other,
        }
    }
}

/// Long enough for the longest key that matters (`usageMetadata`): a key is kept up to
/// one byte more, so a longer key never reads as one that matters.
const KEPT_KEY_BYTES: usize = 13;
/// A usage object is a few hundred bytes; a larger one is not what it claims.
const MAX_USAGE_OBJECT: usize = 16 * 1024;
/// Room a usage object is first given: most fit, so the capture is not grown by halves.
const USUAL_USAGE_OBJECT: usize = 512;
/// Containers whose kind (object or array) is tracked: usage sits at depth 3 at most.
const TRACKED_DEPTH: u32 = 64;

/// A key as far as it matters: up to one byte past the longest that does, in place.
#[derive(Debug, Default)]
struct KeptKey {
    bytes: [u8; KEPT_KEY_BYTES + 1],
    len: usize,
}

impl KeptKey {
    /// Adds what of `more` fits; the rest is dropped.
    fn extend(&mut self, more: &[u8]) {
        let Some(room) = self.bytes.get_mut(self.len..) else { return };
        let taken = room.len().min(more.len());
        if let (Some(to), Some(from)) = (room.get_mut(..taken), more.get(..taken)) {
            to.copy_from_slice(from);
            self.len += taken;
        }
    }

    fn bytes(&self) -> &[u8] {
        self.bytes.get(..self.len).unwrap_or_default()
    }

    fn clear(&mut self) {
        self.len = 0;
    }
}

/// Finds a JSON reply's usage as its bytes pass, whatever its size: the reply is scanned
/// once, chunk by chunk, and only the usage objects (at `usage`, `message.usage`,
/// `response.usage` or `usageMetadata`) and the top-level `model` are kept, then read when the reply ends. Text inside strings is
/// skipped a chunk at a time, so a long reply costs little more than its copy from the
/// host. Malformed JSON yields what was found before it broke, never an error.
#[derive(Debug, Default)]
pub struct ReplyUsage {
    /// Open containers.
    depth: u32,
    /// Bit `n` set: the container at depth `n + 1` is an object (for the first levels).
    objects: u64,
    in_string: bool,
    escaped: bool,
    /// The next string of the current object is a key.
    expect_key: bool,
    /// The string being read is a key at depth 1 or 2, collected into `key`.
    reading_key: bool,
    /// The string being read is a key, at any depth.
    in_key: bool,
    key: KeptKey,
    /// The keys leading to the current position at depths 1 and 2.
    path: [Option<PathKey>; 2],
    /// A `:` was the last structural byte: the next value belongs to the last key.
    after_colon: bool,
    /// The usage object being collected: where it belongs and its bytes so far.
    capture: Option<(UsagePath, Vec<u8>)>,
    /// The last object found at each path.
    found: [Option<Vec<u8>>; 4],
    /// The top-level `model` string being read (its raw JSON text), and the last one read.
    model_text: Option<Vec<u8>>,
    model: Option<String>,
    /// Bytes of the string values read below the top level (the completion's text among
    /// them), escapes included: a bound on the tokens of what passed to the client, since
    /// a token is at least a byte of text and an escape at least as long as what it
    /// stands for.
    value_bytes: u64,
}

impl ReplyUsage {
    pub fn new() -> ReplyUsage {
        ReplyUsage::default()
    }

    /// Inside a string that is a value (not a key) below the top level.
    #[inline]
    fn in_value_below_top(&self) -> bool {
        !self.in_key && self.depth >= 2
    }

    /// See `value_bytes`: read only when the reply was cut before its usage.
    pub fn value_bytes(&self) -> u64 {
        self.value_bytes
    }

    fn in_object(&self) -> bool {
        self.depth >= 1 && self.depth <= TRACKED_DEPTH && self.objects & (1 << (self.depth - 1)) != 0
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        let mut at = 0;
        while at < chunk.len() {
            if self.in_string && !self.escaped {
                // Skip string text up to the next quote or escape in one search; a key
                // keeps what `byte` would have kept of it.
                let rest = chunk.get(at..).unwrap_or(&[]);
                let skip = crate::parse::find2(b'"', b'\\', rest).unwrap_or(rest.len());
                let text = rest.get(..skip).unwrap_or(&[]);
                if self.in_value_below_top() {
                    self.value_bytes += text.len() as u64;
                }
                if let Some((_, bytes)) = self.capture.as_mut() {
                    bytes.extend_from_slice(text);
                    if bytes.len() > MAX_USAGE_OBJECT {
                        self.capture = None;
                    }
                }
                if self.reading_key {
                    self.key.extend(text);
                }
                self.keep_model_text(text);
                at += skip;
                if at >= chunk.len() {
                    break;
                }
            }
            let Some(&byte) = chunk.get(at) else { break };
            at += 1;
            self.byte(byte);
        }
    }

    fn byte(&mut self, byte: u8) {
        if let Some((_, bytes)) = self.capture.as_mut() {
            bytes.push(byte);
            if bytes.len() > MAX_USAGE_OBJECT {
                self.capture = None;
            }
        }
        if self.in_string {
            if byte == b'"' && !self.escaped {
                if let Some(text) = self.model_text.take() {
                    self.model = model_name(&text);
                }
            } else {
                self.keep_model_text(&[byte]);
                if self.in_value_below_top() {
                    self.value_bytes += 1;
                }
            }
            if closes_string(&mut self.escaped, byte) {
                self.in_string = false;
                if self.reading_key {
                    self.reading_key = false;
                    let key = PathKey::of(self.key.bytes());
                    match self.depth {
                        1 => self.path = [Some(key), None],
                        2 => self.path[1] = Some(key),
                        _ => {}
                    }
                    // A repeated key's last value is the one that counts, as in any
                    // JSON reader: forget what the earlier one held.
                    let replaced = match self.path {
                        [Some(PathKey::Usage), None] => Some(UsagePath::Top),
                        [Some(PathKey::UsageMetadata), None] => Some(UsagePath::Metadata),
                        [Some(PathKey::Message), None | Some(PathKey::Usage)] => Some(UsagePath::Message),
                        [Some(PathKey::Response), None | Some(PathKey::Usage)] => Some(UsagePath::Response),
                        _ => None,
                    };
                    if let Some(path) = replaced.filter(|_| self.depth <= 2) {
                        *self.found_at(path) = None;
                    }
                    if self.depth == 1 && key == PathKey::Model {
                        self.model = None;
                    }
                }
                return;
            }
            if self.reading_key {
                self.key.extend(&[byte]);
            }
            return;
        }
        if matches!(byte, b' ' | b'\t' | b'\n' | b'\r') {
            return; // `"usage": {` is as much after the colon as `"usage":{`
        }
        let after_colon = std::mem::take(&mut self.after_colon);
        match byte {
            b'"' => {
                if after_colon && self.depth == 1 && self.in_object() && self.path[0] == Some(PathKey::Model) {
                    self.model_text = Some(Vec::with_capacity(32));
                }
                self.in_string = true;
                self.in_key = self.expect_key;
                self.reading_key = self.expect_key && self.depth <= 2;
                self.expect_key = false;
                self.key.clear();
            }
            b'{' => {
                let usage_path = match (after_colon && self.in_object(), self.depth, self.path) {
                    (true, 1, [Some(PathKey::Usage), _]) => Some(UsagePath::Top),
                    (true, 1, [Some(PathKey::UsageMetadata), _]) => Some(UsagePath::Metadata),
                    (true, 2, [Some(PathKey::Message), Some(PathKey::Usage)]) => Some(UsagePath::Message),
                    (true, 2, [Some(PathKey::Response), Some(PathKey::Usage)]) => Some(UsagePath::Response),
                    _ => None,
                };
                if let Some(path) = usage_path {
                    let mut bytes = Vec::with_capacity(USUAL_USAGE_OBJECT);
                    bytes.push(b'{');
                    self.capture = Some((path, bytes));
                }
                self.open(true);
            }
            b'[' => self.open(false),
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                self.expect_key = false;
                let closes_capture = match &self.capture {
                    Some((UsagePath::Top | UsagePath::Metadata, _)) => self.depth == 1,
                    Some(_) => self.depth == 2,
                    None => false,
                };
                if closes_capture {
                    if let Some((path, bytes)) = self.capture.take() {
                        *self.found_at(path) = Some(bytes);
                    }
                }
            }
            b',' => self.expect_key = self.in_object(),
            b':' => self.after_colon = true,
            _ => {}
        }
    }

    fn found_at(&mut self, path: UsagePath) -> &mut Option<Vec<u8>> {
        let [top, message, response, metadata] = &mut self.found;
        match path {
            UsagePath::Top => top,
            UsagePath::Message => message,
            UsagePath::Response => response,
            UsagePath::Metadata => metadata,
        }
    }

    fn open(&mut self, object: bool) {
        self.depth = self.depth.saturating_add(1);
        if self.depth <= TRACKED_DEPTH {
            let bit = 1u64 << (self.depth - 1);
            self.objects = if object { self.objects | bit } else { self.objects & !bit };
        }
        if self.depth == 2 {
            self.path[1] = None;
        }
        self.expect_key = object;
    }

    /// Adds to the `model` string being read; one too long for a model name is not kept.
    #[inline]
    fn keep_model_text(&mut self, bytes: &[u8]) {
        if let Some(text) = self.model_text.as_mut() {
            text.extend_from_slice(bytes);
            if text.len() > crate::providers::MAX_MODEL_NAME {
                self.model_text = None;
            }
        }
    }

    /// The reply's top-level `model`, if it had a non-empty one.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    pub fn finish(&self) -> ReportedUsage {
        let mut usage = ReportedUsage::default();
        let [top, message, response, metadata] = &self.found;
        for bytes in [top, message, response].into_iter().flatten() {
            if let Ok(object) = Json::parse(bytes) {
                usage.merge(providers::usage_object(object.root()));
            }
        }
        if let Some(Ok(object)) = metadata.as_deref().map(Json::parse) {
            usage.merge(providers::usage_metadata(object.root()));
        }
        usage
    }
}

/// A reply's `model` from the raw text of its JSON string: unescaped, non-empty, bounded.
fn model_name(text: &[u8]) -> Option<String> {
    if text.is_empty() || text.len() > crate::providers::MAX_MODEL_NAME {
        return None;
    }
    let mut quoted = Vec::with_capacity(text.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(text);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted).ok().filter(|m| !m.is_empty())
}

/// Follows a streamed reply: the usage it reports, and the text it streamed (counted only
/// if the stream never reports its output tokens).
#[derive(Debug)]
pub struct StreamUsage {
    parser: Framing,
    read: StreamRead,
}

/// What a stream's messages said so far: kept apart from the framing's parser, which lends
/// each message to it while the parser is borrowed.
#[derive(Debug)]
struct StreamRead {
    reported: ReportedUsage,
    encoding: Encoding,
    text: String,
    counted_output: u64,
    /// The last non-empty `model` a message named.
    model: Option<String>,
    /// True once the stream said it was complete (`[DONE]`, `message_stop`,
    /// `response.completed`).
    finished: bool,
}

/// How a stream's messages are framed.
#[derive(Debug)]
enum Framing {
    Sse(SseParser),
    /// A JSON array of messages (Gemini's `streamGenerateContent` without `alt=sse`).
    JsonArray(JsonArrayStream),
}

/// Streamed text is counted in pieces of about this size, so memory stays bounded.
const TEXT_FLUSH_BYTES: usize = 16 * 1024;

impl StreamUsage {
    /// A stream of Server-Sent Events.
    pub fn new(encoding: Encoding, max_event_bytes: usize) -> StreamUsage {
        StreamUsage::framed(encoding, Framing::Sse(SseParser::new(max_event_bytes)))
    }

    /// A stream of messages sent as one JSON array.
    pub fn json_array(encoding: Encoding, max_message_bytes: usize) -> StreamUsage {
        StreamUsage::framed(encoding, Framing::JsonArray(JsonArrayStream::new(max_message_bytes)))
    }

    fn framed(encoding: Encoding, parser: Framing) -> StreamUsage {
        let read = StreamRead {
            reported: ReportedUsage::default(),
            encoding,
            text: String::new(),
            counted_output: 0,
            model: None,
            finished: false,
        };
        StreamUsage { parser, read }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        let read = &mut self.read;
        match &mut self.parser {
            Framing::Sse(parser) => parser.feed(chunk, &mut |event| read.on_event(event)),
            Framing::JsonArray(parser) => parser.feed(chunk, &mut |message| read.on_message_bytes(message, "")),
        }
    }

    pub fn finish(&mut self) {
        if let Framing::Sse(parser) = &mut self.parser {
            let read = &mut self.read;
            parser.finish(&mut |event| read.on_event(event));
        }
    }

    /// One message's JSON, however it was framed (SSE, a JSON array, AWS's event stream for
    /// Bedrock), and the message's event name if the framing gives one.
    pub(crate) fn on_message(&mut self, message: Json, event_name: &str) {
        self.read.on_message(message, event_name);
    }

    /// Usage a stream reported in a shape of its own; it overrides earlier reports.
    pub(crate) fn add_reported(&mut self, usage: ReportedUsage) {
        self.read.reported.merge(usage);
    }

    /// Generated text a stream carried in a shape of its own, counted if no usage is.
    pub(crate) fn add_text(&mut self, text: &str) {
        self.read.push_text(Some(text));
    }

    /// The stream said it was complete (`[DONE]`, `message_stop`, `response.completed`,
    /// Bedrock's `metadata`).
    pub fn finished(&self) -> bool {
        self.read.finished
    }

    pub(crate) fn set_finished(&mut self) {
        self.read.finished = true;
    }

    pub fn reported(&self) -> ReportedUsage {
        self.read.reported
    }

    /// The model the stream's messages named last, if any.
    pub fn model(&self) -> Option<&str> {
        self.read.model.as_deref()
    }

    /// Output tokens: as reported, or else counted from the streamed text.
    pub fn output_tokens(&self) -> u64 {
        let read = &self.read;
        read.reported.output.unwrap_or_else(|| read.counted_output + read.encoding.count(&read.text))
    }
}

impl StreamRead {
    fn on_event(&mut self, event: SseEvent) {
        if event.data.trim() == openai::DONE {
            self.finished = true;
            return;
        }
        // A document borrowing from the event: a delta's text is read, not copied, until
        // it is added to the text kept for counting. (The parser made the data UTF-8.)
        if let Ok(message) = Json::parse_str(event.data) {
            self.on_message(message.root(), event.event);
        }
    }

    /// One message of the stream as it came (`event`: its SSE event name, if it has one).
    fn on_message_bytes(&mut self, bytes: &[u8], event: &str) {
        if let Ok(message) = Json::parse(bytes) {
            self.on_message(message.root(), event);
        }
    }

    fn on_message(&mut self, message: Json, event_name: &str) {
        self.reported.merge(reported_usage(message));
        let model = message.at("model").as_str().or_else(|| message.at("message").at("model").as_str());
        if let Some(model) = model.filter(|m| !m.is_empty() && m.len() <= crate::providers::MAX_MODEL_NAME) {
            if self.model.as_deref() != Some(model) {
                self.model = Some(model.to_string());
            }
        }
        let kind = message.at("type").as_str().unwrap_or(event_name);
        if providers::ends_stream(message, kind) {
            self.finished = true;
        }
        // The generated text, in whichever provider's shape it is.
        providers::streamed_texts(message, &mut |text| self.push_text(text));
    }

    fn push_text(&mut self, text: Option<&str>) {
        let Some(text) = text else { return };
        self.text.push_str(text);
        if self.text.len() >= TEXT_FLUSH_BYTES {
            self.counted_output += self.encoding.count(&self.text);
            self.text.clear();
        }
    }
}

/// Follows a Bedrock event stream (`converse-stream` or `invoke-with-response-stream`; its
/// events' shapes are `providers::bedrock`'s): the usage it reports, and its text,
/// counted if it reports none.
#[derive(Debug)]
pub struct EventStreamUsage {
    decoder: EventStreamDecoder,
    /// The usage and text found, kept as an SSE stream's are (its SSE parser unused).
    events: StreamUsage,
    /// The exception the stream carried (`:exception-type`, or an error's `:error-code`).
    pub exception: Option<String>,
}

impl EventStreamUsage {
    pub fn new(encoding: Encoding, max_message_bytes: usize) -> EventStreamUsage {
        EventStreamUsage {
            decoder: EventStreamDecoder::new(max_message_bytes),
            events: StreamUsage::new(encoding, 0),
            exception: None,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        let mut messages = Vec::new();
        self.decoder.feed(chunk, &mut |message| messages.push(message));
        for message in messages {
            self.on_message(&message);
        }
    }

    fn on_message(&mut self, message: &Message) {
        let (events, exception) = (&mut self.events, &mut self.exception);
        bedrock::read_stream_message(message, &mut |part| match part {
            StreamPart::Exception(kind) => *exception = Some(kind.chars().take(64).collect()),
            StreamPart::Event(event, metrics) => {
                events.on_message(event, "");
                events.add_reported(metrics);
            }
            StreamPart::Text(text) => events.add_text(text),
            StreamPart::End(usage) => {
                if let Some(usage) = usage {
                    events.add_reported(usage);
                }
                events.set_finished();
            }
        });
    }

    pub fn reported(&self) -> ReportedUsage {
        self.events.reported()
    }

    /// Output tokens: as reported, or else counted from the streamed text.
    pub fn output_tokens(&self) -> u64 {
        self.events.output_tokens()
    }

    /// Whether the stream said it was complete (the `metadata` event, `message_stop`).
    pub fn finished(&self) -> bool {
        self.events.finished()
    }

    /// Why the framing stopped being read (a bad CRC, an oversized message), if it did.
    pub fn broken(&self) -> Option<StreamError> {
        self.decoder.broken()
    }
}

/// Reads a reply for its usage, in whichever framing it comes: one way to feed it, one to
/// finish it.
pub enum ReplyReader {
    Json(ReplyUsage),
    Stream(StreamUsage),
    /// AWS's binary event stream (Bedrock).
    EventStream(EventStreamUsage),
}

/// What a reply said of its usage, read as far as it went.
#[derive(Debug, Default)]
pub struct ReadUsage<'a> {
    /// The usage the reply reported.
    pub reported: ReportedUsage,
    /// Of a stream, its output tokens: as reported, or else counted from its text.
    pub streamed_output: Option<u64>,
    /// The reply's own `model`, if it named one (an event stream names none).
    pub model: Option<&'a str>,
    /// Of a JSON reply, the bytes of text that passed to the client (for one cut short).
    pub passed_text_bytes: Option<u64>,
    /// Why an event stream stopped being read, if it did.
    pub broken: Option<StreamError>,
}

impl ReplyReader {
    /// The reader for a reply of `content_type`. `json_array`: a JSON reply that is a stream
    /// of responses in one array (Gemini's `streamGenerateContent` without `alt=sse`).
    pub fn for_reply(content_type: &str, json_array: bool, encoding: Encoding, max_event_bytes: usize) -> ReplyReader {
        if content_type.contains("text/event-stream") {
            ReplyReader::Stream(StreamUsage::new(encoding, max_event_bytes))
        } else if content_type.contains(bedrock::EVENT_STREAM_CONTENT_TYPE) {
            ReplyReader::EventStream(EventStreamUsage::new(encoding, max_event_bytes))
        } else if json_array {
            ReplyReader::Stream(StreamUsage::json_array(encoding, max_event_bytes))
        } else {
            ReplyReader::Json(ReplyUsage::new())
        }
    }

    /// Whether the reply is a stream of events (SSE, or AWS's), whose usage chunks the
    /// filter may take out.
    pub fn streams_events(&self) -> bool {
        match self {
            ReplyReader::Json(_) => false,
            ReplyReader::Stream(reader) => matches!(reader.parser, Framing::Sse(_)),
            ReplyReader::EventStream(_) => true,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        match self {
            ReplyReader::Json(reader) => reader.feed(chunk),
            ReplyReader::Stream(reader) => reader.feed(chunk),
            ReplyReader::EventStream(reader) => reader.feed(chunk),
        }
    }

    /// The exception an event stream carried, if it did.
    pub fn exception(&self) -> Option<&str> {
        match self {
            ReplyReader::EventStream(reader) => reader.exception.as_deref(),
            _ => None,
        }
    }

    /// What the reply said of its usage, read as far as it went.
    pub fn finish(&mut self) -> ReadUsage<'_> {
        match self {
            ReplyReader::Json(reader) => ReadUsage {
                reported: reader.finish(),
                model: reader.model(),
                passed_text_bytes: Some(reader.value_bytes()),
                ..ReadUsage::default()
            },
            ReplyReader::Stream(reader) => {
                reader.finish();
                ReadUsage {
                    reported: reader.reported(),
                    streamed_output: Some(reader.output_tokens()),
                    model: reader.model(),
                    ..ReadUsage::default()
                }
            }
            ReplyReader::EventStream(reader) => ReadUsage {
                reported: reader.reported(),
                streamed_output: Some(reader.output_tokens()),
                broken: reader.broken(),
                ..ReadUsage::default()
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;

    pub const OPENAI_STREAM: &str = include_str!("../../../../tests/cases/streams/openai_chat_usage.sse");
    pub const OPENAI_STREAM_NO_USAGE: &str = include_str!("../../../../tests/cases/streams/openai_chat_no_usage.sse");
    pub const ANTHROPIC_STREAM: &str = include_str!("../../../../tests/cases/streams/anthropic_messages.sse");
    pub const RESPONSES_STREAM: &str = include_str!("../../../../tests/cases/streams/openai_responses.sse");
    pub const GEMINI_SSE: &str = include_str!("../../../../tests/cases/streams/gemini_stream.sse");
    pub const GEMINI_ARRAY: &str = include_str!("../../../../tests/cases/streams/gemini_stream.json");
    pub const VLLM_STREAM: &str = include_str!("../../../../tests/cases/streams/vllm_continuous_usage.sse");
    pub const GROQ_STREAM: &str = include_str!("../../../../tests/cases/streams/groq_chat_x_groq.sse");
    pub const OLLAMA_STREAM: &str = include_str!("../../../../tests/cases/streams/ollama_chat_usage.sse");
    pub const AZURE_STREAM: &str = include_str!("../../../../tests/cases/streams/azure_chat_usage.sse");

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn a_reply_reader_is_chosen_by_content_type_and_finishes_one_way() {
        let read = |content_type: &str, json_array: bool| {
            ReplyReader::for_reply(content_type, json_array, Encoding::O200kBase, 1 << 20)
        };
        assert!(read("text/event-stream; charset=utf-8", false).streams_events());
        assert!(read(bedrock::EVENT_STREAM_CONTENT_TYPE, false).streams_events());
        assert!(matches!(read("application/json", true), ReplyReader::Stream(_)));
        assert!(!read("application/json", true).streams_events());
        assert!(matches!(read("application/json", false), ReplyReader::Json(_)));
        let mut sse = read("text/event-stream", false);
        sse.feed(OPENAI_STREAM.as_bytes());
        let usage = sse.finish();
        assert!(usage.reported.output.is_some() && usage.streamed_output == usage.reported.output);
        assert_eq!(usage.passed_text_bytes, None);
        let mut json = read("application/json", false);
        json.feed(br#"{"model":"gpt-4o","usage":{"prompt_tokens":3,"completion_tokens":5}}"#);
        let usage = json.finish();
        assert_eq!((usage.reported.input, usage.reported.output, usage.model), (Some(3), Some(5), Some("gpt-4o")));
        assert_eq!(usage.streamed_output, None);
    }

    /// Every SSE transcript, for the tests that run them all (the property tests, which do
    /// not run under wasm).
    #[cfg(not(target_arch = "wasm32"))]
    const SSE_STREAMS: [&str; 9] = [
        OPENAI_STREAM,
        OPENAI_STREAM_NO_USAGE,
        ANTHROPIC_STREAM,
        RESPONSES_STREAM,
        GEMINI_SSE,
        VLLM_STREAM,
        GROQ_STREAM,
        OLLAMA_STREAM,
        AZURE_STREAM,
    ];

    /// `bytes` cut into pieces of the given sizes, then the rest.
    fn in_chunks<'a>(bytes: &'a [u8], sizes: &[usize]) -> Vec<&'a [u8]> {
        let mut rest = bytes;
        let mut chunks = Vec::new();
        for &size in sizes {
            let (head, tail) = rest.split_at(size.min(rest.len()));
            chunks.push(head);
            rest = tail;
        }
        chunks.push(rest);
        chunks
    }

    fn run(stream: &str, chunks: &[usize]) -> (ReportedUsage, u64, bool) {
        run_with(StreamUsage::new(Encoding::O200kBase, 1 << 20), stream, chunks)
    }

    /// A stream sent as a JSON array (Gemini without `alt=sse`).
    fn run_array(stream: &str, chunks: &[usize]) -> (ReportedUsage, u64, bool) {
        run_with(StreamUsage::json_array(Encoding::O200kBase, 1 << 20), stream, chunks)
    }

    fn run_with(mut tracker: StreamUsage, stream: &str, chunks: &[usize]) -> (ReportedUsage, u64, bool) {
        for chunk in in_chunks(stream.as_bytes(), chunks) {
            tracker.feed(chunk);
        }
        tracker.finish();
        (tracker.reported(), tracker.output_tokens(), tracker.finished())
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn reads_each_providers_streamed_usage() {
        let cases = [
            (
                OPENAI_STREAM,
                ReportedUsage { input: Some(19), output: Some(10), cached_input: Some(0), reasoning: Some(0) },
                10,
            ),
            (
                ANTHROPIC_STREAM,
                ReportedUsage { input: Some(472), output: Some(15), cached_input: Some(0), reasoning: None },
                15,
            ),
            (
                RESPONSES_STREAM,
                ReportedUsage { input: Some(37), output: Some(11), cached_input: Some(0), reasoning: Some(0) },
                11,
            ),
            // Cumulative usageMetadata, thinking counted as output, the cached part of the prompt.
            (
                GEMINI_SSE,
                ReportedUsage { input: Some(12), output: Some(29), cached_input: Some(4), reasoning: Some(20) },
                29,
            ),
            // Usage on every chunk (continuous_usage_stats), the last one's counts.
            (VLLM_STREAM, ReportedUsage { input: Some(23), output: Some(5), cached_input: None, reasoning: None }, 5),
            // Usage only in the last chunk's `x_groq`.
            (GROQ_STREAM, ReportedUsage { input: Some(41), output: Some(5), cached_input: None, reasoning: None }, 5),
            (OLLAMA_STREAM, ReportedUsage { input: Some(17), output: Some(9), cached_input: None, reasoning: None }, 9),
            // A first chunk with empty choices and no usage (the prompt's filter results).
            (
                AZURE_STREAM,
                ReportedUsage { input: Some(14), output: Some(5), cached_input: Some(0), reasoning: Some(0) },
                5,
            ),
        ];
        for (stream, usage, output) in cases {
            assert_eq!(run(stream, &[]), (usage, output, true), "{}", &stream[..80]);
        }
        let gemini = ReportedUsage { input: Some(12), output: Some(29), cached_input: Some(4), reasoning: Some(20) };
        assert_eq!(run_array(GEMINI_ARRAY, &[]), (gemini, 29, true));
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn both_gemini_framings_give_the_same_usage_whatever_the_split() {
        let whole = run(GEMINI_SSE, &[]);
        for at in 0..=GEMINI_SSE.len() {
            assert_eq!(run(GEMINI_SSE, &[at]), whole, "SSE split at {at}");
        }
        for at in 0..=GEMINI_ARRAY.len() {
            assert_eq!(run_array(GEMINI_ARRAY, &[at]), whole, "array split at {at}");
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn streams_without_usage_are_counted_from_their_text_thinking_included() {
        let encoding = Encoding::O200kBase;
        let strip = |stream: &str| {
            stream
                .split("\"usageMetadata\"")
                .map(|piece| piece.to_string())
                .collect::<Vec<_>>()
                .join("\"ignoredMetadata\"")
        };
        let gemini_text =
            "Plan: say it {quoted} \"well\".The quick brown fox \"jumps\" [over] the lazy dog. \u{e9}\u{1F600}";
        let (reported, output, _) = run(&strip(GEMINI_SSE), &[]);
        assert_eq!((reported, output), (ReportedUsage::default(), encoding.count(gemini_text)));
        let (reported, output, _) = run_array(&strip(GEMINI_ARRAY), &[]);
        assert_eq!((reported, output), (ReportedUsage::default(), encoding.count(gemini_text)));
        let ollama = OLLAMA_STREAM.replace("\"usage\"", "\"ignored\"");
        assert_eq!(run(&ollama, &[]).1, encoding.count(" Thinking about foxes. The quick brown fox jumps"));
    }

    #[test]
    fn a_reply_names_its_model_and_pretty_printed_usage_is_found() {
        let read = |body: &str| {
            let mut reply = ReplyUsage::new();
            for chunk in body.as_bytes().chunks(3) {
                reply.feed(chunk);
            }
            (reply.finish(), reply.model().map(str::to_string))
        };
        let azure = "{\n  \"choices\": [{\"message\": {\"content\": \"a \\\"model\\\": \\\"x\\\"\"}}],\n  \"model\" : \"gpt-4o-2024-11-20\",\n  \"usage\": {\n    \"prompt_tokens\": 14,\n    \"completion_tokens\": 5\n  }\n}";
        assert_eq!(
            read(azure),
            (
                ReportedUsage { input: Some(14), output: Some(5), cached_input: None, reasoning: None },
                Some("gpt-4o-2024-11-20".into())
            )
        );
        // Gemini's pretty-printed reply: usage at `usageMetadata`, no `model` (it is in the path).
        let gemini = "{\r\n  \"candidates\": [],\r\n  \"usageMetadata\": {\r\n    \"promptTokenCount\": 8,\r\n    \"candidatesTokenCount\": 3,\r\n    \"thoughtsTokenCount\": 2\r\n  },\r\n  \"modelVersion\": \"gemini-2.5-flash\"\r\n}";
        assert_eq!(
            read(gemini),
            (ReportedUsage { input: Some(8), output: Some(5), cached_input: None, reasoning: Some(2) }, None)
        );
        for odd in [r#"{"model":""}"#, r#"{"model":7}"#, r#"{"x":{"model":"inner"}}"#] {
            assert_eq!(read(odd).1, None, "{odd}");
        }
        let escaped = r#"{"model":"a\"b\u00e9"}"#;
        assert_eq!(read(escaped).1.as_deref(), Some("a\"b\u{e9}"));
        let long = format!(r#"{{"model":"{}","usage":{{"prompt_tokens":1}}}}"#, "m".repeat(10_000));
        assert_eq!(
            read(&long),
            (ReportedUsage { input: Some(1), output: None, cached_input: None, reasoning: None }, None)
        );
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
            let whole = {
                let mut reply = ReplyUsage::new();
                reply.feed(body.as_bytes());
                reply.finish()
            };
            assert_eq!(whole, ReportedUsage { input, output, cached_input, reasoning: None }, "{body}");
            for at in 0..=body.len() {
                let mut reply = ReplyUsage::new();
                reply.feed(&body.as_bytes()[..at]);
                reply.feed(&body.as_bytes()[at..]);
                assert_eq!(reply.finish(), whole, "{body} split at {at}");
            }
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn finds_usage_in_the_tail_of_a_large_reply() {
        let filler = format!("\"{}\"", "0.1234,".repeat(50_000));
        let body = format!(
            r#"{{"object":"list","data":[{filler}],"text":"say \"usage\": {{\"prompt_tokens\": 999}}","usage":{{"prompt_tokens":77,"total_tokens":77}}}}"#
        );
        let mut reply = ReplyUsage::new();
        for chunk in body.as_bytes().chunks(1000) {
            reply.feed(chunk);
        }
        assert_eq!(
            reply.finish(),
            ReportedUsage { input: Some(77), output: Some(0), cached_input: None, reasoning: None }
        );
    }

    /// An object of fields from a reply's vocabulary: random JSON, usage objects at the
    /// top, under `message` or `response`, and deeper where they do not count.
    #[cfg(not(target_arch = "wasm32"))]
    fn usage_like_json() -> impl Strategy<Value = String> {
        fn object(fields: Vec<(&str, String)>) -> String {
            let fields: Vec<String> = fields.into_iter().map(|(k, v)| format!("\"{k}\" :{v}")).collect();
            format!("{{{}}}", fields.join(","))
        }
        let number = prop_oneof![(0u64..5000).prop_map(|n| n.to_string()), Just("1.5".to_string())];
        let leaf = prop_oneof![
            number.clone(),
            Just("null".to_string()),
            Just(r#""a \"usage\": {\"prompt_tokens\": 9} \\""#.to_string()),
            Just(r#""gpt-4o-2024-11-20""#.to_string()),
            Just(r#""""#.to_string()),
        ];
        let counts = prop_oneof![
            Just("prompt_tokens"),
            Just("completion_tokens"),
            Just("input_tokens"),
            Just("output_tokens"),
            Just("total_tokens"),
            Just("cache_read_input_tokens"),
            Just("promptTokenCount"),
            Just("candidatesTokenCount"),
            Just("thoughtsTokenCount"),
            Just("cachedContentTokenCount"),
        ];
        let details = prop::collection::vec((Just("cached_tokens"), number.clone()), 0..2).prop_map(object);
        let usage = prop::collection::vec(
            prop_oneof![(counts, number).prop_map(|(k, v)| (k, v)), (Just("prompt_tokens_details"), details)],
            0..5,
        )
        .prop_map(object);
        let keys = prop_oneof![
            Just("usage"),
            Just("usageMetadata"),
            Just("message"),
            Just("response"),
            Just("model"),
            Just("x")
        ];
        let any = leaf.prop_recursive(3, 24, 4, {
            let keys = keys.clone();
            move |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4).prop_map(|items| format!("[{}]", items.join(" , "))),
                    prop::collection::vec((keys.clone(), inner), 0..4).prop_map(object),
                ]
            }
        });
        let value = prop_oneof![usage.clone(), any];
        let wrapped = prop::collection::vec((keys.clone(), value.clone()), 0..4).prop_map(object);
        prop::collection::vec((keys, prop_oneof![value, wrapped]), 0..5).prop_map(object)
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Any split of a stream into any number of chunks gives the same usage.
        #[test]
        fn any_chunking_gives_the_same_usage(cuts in proptest::collection::vec(0usize..400, 0..30), which in 0usize..SSE_STREAMS.len()) {
            let stream = SSE_STREAMS[which];
            prop_assert_eq!(run(stream, &cuts), run(stream, &[]));
            prop_assert_eq!(run_array(GEMINI_ARRAY, &cuts), run_array(GEMINI_ARRAY, &[]));
        }

        /// Random JSON whose keys are the ones usage is made of, at random depths, cut
        /// into random chunks: the scan finds what reading the whole reply as a Value
        /// finds (the tree reads as a serde_json Value does: see json.rs).
        #[test]
        fn the_scan_agrees_with_the_whole_reply(text in usage_like_json(), cuts in proptest::collection::vec(0usize..200, 0..8)) {
            let whole = Json::parse(text.as_bytes()).expect("generated JSON");
            let mut reply = ReplyUsage::new();
            for chunk in in_chunks(text.as_bytes(), &cuts) {
                reply.feed(chunk);
            }
            prop_assert_eq!(reply.finish(), reported_usage(whole.root()));
            prop_assert_eq!(reply.model(), whole.root().at("model").as_str().filter(|m| !m.is_empty()));
        }

        /// Mangled streams and replies never panic.
        #[test]
        fn mutations_never_panic(flips in proptest::collection::vec((0usize..4000, any::<u8>()), 0..40), which in 0usize..SSE_STREAMS.len() + 1, cuts in proptest::collection::vec(0usize..300, 0..10)) {
            let mut bytes = SSE_STREAMS.get(which).unwrap_or(&GEMINI_ARRAY).as_bytes().to_vec();
            for (at, byte) in flips {
                let len = bytes.len();
                bytes[at % len] = byte;
            }
            for mut tracker in [StreamUsage::new(Encoding::O200kBase, 1 << 20), StreamUsage::json_array(Encoding::O200kBase, 1 << 20)] {
                for chunk in in_chunks(&bytes, &cuts) {
                    tracker.feed(chunk);
                }
                tracker.finish();
                let _ = tracker.output_tokens();
            }
            let mut reply = ReplyUsage::new();
            reply.feed(&bytes);
            let _ = reply.finish();
        }
    }
}
