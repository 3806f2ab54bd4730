//! An incremental decoder of AWS's binary event-stream framing
//! (`application/vnd.amazon.eventstream`), in which Bedrock's `converse-stream` and
//! `invoke-with-response-stream` replies arrive. Each message is
//!
//! ```text
//! total length u32 | headers length u32 | prelude CRC32 (of the 8 bytes before)
//! headers | payload | message CRC32 (of every byte before it)
//! ```
//!
//! big-endian, CRC32 with the IEEE polynomial (the gzip one), 16 bytes of overhead. A
//! header is `name length u8 | name | value type u8 | value`, the value's encoding set by
//! its type (0 true, 1 false, 2 byte, 3 short, 4 int, 5 long, 6 bytes with a u16 length,
//! 7 string with a u16 length, 8 timestamp, 9 UUID). Feed the body in whatever chunks the
//! proxy delivers; whole messages come out. Memory is bounded: at most one message is
//! buffered, and a message larger than the limit, a bad CRC or a malformed header breaks
//! the stream: nothing after it is read (lengths after a corruption cannot be trusted),
//! and what came before stands. Nothing here panics on any input.

/// Bytes of a message that are not headers or payload: prelude (8), its CRC (4), the
/// message CRC (4).
const OVERHEAD: usize = 16;
const PRELUDE: usize = 12;

/// Why a stream stopped being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamError {
    BadPreludeCrc,
    BadMessageCrc,
    /// The prelude announces a message larger than the limit.
    TooLarge,
    /// Lengths that do not fit together, or headers that run past their section.
    Malformed,
}

/// One decoded message: its string headers (other header types are read past) and its
/// payload.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
}

impl Message {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

#[derive(Debug)]
pub struct EventStreamDecoder {
    /// The start of a message not yet complete (at most `max_message_bytes`).
    partial: Vec<u8>,
    max_message_bytes: usize,
    broken: Option<StreamError>,
}

impl EventStreamDecoder {
    pub fn new(max_message_bytes: usize) -> EventStreamDecoder {
        EventStreamDecoder { partial: Vec::new(), max_message_bytes: max_message_bytes.max(OVERHEAD), broken: None }
    }

    /// Why the stream stopped being read, if it did.
    pub fn broken(&self) -> Option<StreamError> {
        self.broken
    }

    /// Whether the bytes so far end inside a message (a cut-off stream).
    pub fn mid_message(&self) -> bool {
        !self.partial.is_empty()
    }

    pub fn feed(&mut self, mut chunk: &[u8], on_message: &mut impl FnMut(Message)) {
        while !chunk.is_empty() && self.broken.is_none() {
            if self.partial.is_empty() {
                // Whole messages are decoded straight from the chunk, unbuffered.
                match self.message_length(chunk) {
                    Ok(Some(total)) if chunk.len() >= total => {
                        let (message, rest) = chunk.split_at(total);
                        self.deliver(message, on_message);
                        chunk = rest;
                    }
                    // Shorter than its prelude or than the message it announces (which
                    // is within the limit): kept for the next chunk.
                    Ok(_) => {
                        self.partial.extend_from_slice(chunk);
                        return;
                    }
                    Err(error) => self.broken = Some(error),
                }
                continue;
            }
            // Complete the buffered message, taking no more than it needs.
            let wanted = match self.message_length(&self.partial) {
                Ok(Some(total)) => total,
                Ok(None) => PRELUDE,
                Err(error) => {
                    self.broken = Some(error);
                    break;
                }
            };
            let (head, rest) = chunk.split_at(wanted.saturating_sub(self.partial.len()).min(chunk.len()));
            self.partial.extend_from_slice(head);
            chunk = rest;
            match self.message_length(&self.partial) {
                Ok(Some(total)) if self.partial.len() >= total => {
                    let message = std::mem::take(&mut self.partial);
                    self.deliver(&message, on_message);
                }
                Ok(_) => {}
                Err(error) => self.broken = Some(error),
            }
        }
        if self.broken.is_some() {
            self.partial = Vec::new();
        }
    }

    /// The length of the message `bytes` starts with, once its prelude is there.
    fn message_length(&self, bytes: &[u8]) -> Result<Option<usize>, StreamError> {
        let (Some(total), Some(headers), Some(crc)) = (be_u32(bytes, 0), be_u32(bytes, 4), be_u32(bytes, 8)) else {
            return Ok(None);
        };
        if crc32fast::hash(bytes.get(..8).unwrap_or(&[])) != crc {
            return Err(StreamError::BadPreludeCrc);
        }
        let (total, headers) = (total as usize, headers as usize);
        if total < OVERHEAD || headers > total - OVERHEAD {
            return Err(StreamError::Malformed);
        }
        if total > self.max_message_bytes {
            return Err(StreamError::TooLarge);
        }
        Ok(Some(total))
    }

    /// Checks a whole message (`bytes` is exactly its length) and hands it on.
    fn deliver(&mut self, bytes: &[u8], on_message: &mut impl FnMut(Message)) {
        match decode(bytes) {
            Ok(message) => on_message(message),
            Err(error) => self.broken = Some(error),
        }
    }
}

fn be_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let word: [u8; 4] = bytes.get(at..at + 4)?.try_into().ok()?;
    Some(u32::from_be_bytes(word))
}

fn be_u16(bytes: &[u8], at: usize) -> Option<usize> {
    let word: [u8; 2] = bytes.get(at..at + 2)?.try_into().ok()?;
    Some(usize::from(u16::from_be_bytes(word)))
}

fn decode(bytes: &[u8]) -> Result<Message, StreamError> {
    let body_end = bytes.len().checked_sub(4).ok_or(StreamError::Malformed)?;
    let crc = be_u32(bytes, body_end).ok_or(StreamError::Malformed)?;
    if crc32fast::hash(bytes.get(..body_end).unwrap_or(&[])) != crc {
        return Err(StreamError::BadMessageCrc);
    }
    let headers_len = be_u32(bytes, 4).ok_or(StreamError::Malformed)? as usize;
    let headers_end = PRELUDE.checked_add(headers_len).filter(|&end| end <= body_end).ok_or(StreamError::Malformed)?;
    let headers = headers(bytes.get(PRELUDE..headers_end).unwrap_or(&[]))?;
    let payload = bytes.get(headers_end..body_end).unwrap_or(&[]).to_vec();
    Ok(Message { headers, payload })
}

/// The headers section: string-valued headers kept, the others read past.
fn headers(mut section: &[u8]) -> Result<Vec<(String, String)>, StreamError> {
    let mut found = Vec::new();
    while let Some((&name_len, rest)) = section.split_first() {
        let name_len = usize::from(name_len);
        let name = rest.get(..name_len).ok_or(StreamError::Malformed)?;
        let (&kind, rest) = rest.get(name_len..).and_then(<[u8]>::split_first).ok_or(StreamError::Malformed)?;
        let (value_len, value_at) = match kind {
            0 | 1 => (0, 0),
            2 => (1, 0),
            3 => (2, 0),
            4 => (4, 0),
            5 | 8 => (8, 0),
            6 | 7 => (be_u16(rest, 0).ok_or(StreamError::Malformed)?, 2),
            9 => (16, 0),
            _ => return Err(StreamError::Malformed),
        };
        let value = rest.get(value_at..value_at + value_len).ok_or(StreamError::Malformed)?;
        if kind == 7 {
            found.push((String::from_utf8_lossy(name).into_owned(), String::from_utf8_lossy(value).into_owned()));
        }
        section = rest.get(value_at + value_len..).unwrap_or(&[]);
    }
    Ok(found)
}

/// One message in the framing, with string headers: what the tests (and the fuzz target)
/// build streams from.
pub fn encode(headers: &[(&str, &str)], payload: &[u8]) -> Vec<u8> {
    let mut section = Vec::new();
    for (name, value) in headers {
        let name = name.as_bytes().get(..usize::from(u8::MAX)).unwrap_or(name.as_bytes());
        let value = value.as_bytes().get(..usize::from(u16::MAX)).unwrap_or(value.as_bytes());
        section.push(name.len() as u8);
        section.extend_from_slice(name);
        section.push(7);
        section.extend_from_slice(&(value.len() as u16).to_be_bytes());
        section.extend_from_slice(value);
    }
    let total = (OVERHEAD + section.len() + payload.len()) as u32;
    let mut message = Vec::with_capacity(total as usize);
    message.extend_from_slice(&total.to_be_bytes());
    message.extend_from_slice(&(section.len() as u32).to_be_bytes());
    let prelude_crc = crc32fast::hash(&message);
    message.extend_from_slice(&prelude_crc.to_be_bytes());
    message.extend_from_slice(&section);
    message.extend_from_slice(payload);
    let crc = crc32fast::hash(&message);
    message.extend_from_slice(&crc.to_be_bytes());
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;

    fn event(kind: &str, payload: &str) -> Vec<u8> {
        encode(
            &[(":event-type", kind), (":content-type", "application/json"), (":message-type", "event")],
            payload.as_bytes(),
        )
    }

    fn stream() -> Vec<u8> {
        [
            event("messageStart", r#"{"role":"assistant"}"#),
            event("contentBlockDelta", r#"{"contentBlockIndex":0,"delta":{"text":"Hello"}}"#),
            event(
                "metadata",
                r#"{"usage":{"inputTokens":5,"outputTokens":1,"totalTokens":6},"metrics":{"latencyMs":9}}"#,
            ),
        ]
        .concat()
    }

    fn decode_in(chunks: &[&[u8]], max: usize) -> (Vec<Message>, Option<StreamError>, bool) {
        let mut decoder = EventStreamDecoder::new(max);
        let mut messages = Vec::new();
        for chunk in chunks {
            decoder.feed(chunk, &mut |m| messages.push(m));
        }
        (messages, decoder.broken(), decoder.mid_message())
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn decodes_a_known_message() {
        // A message from the Elixir event_stream package's documentation (hex.pm), made
        // by an encoder other than ours: {"foo": "bar"} with content-type application/json.
        let known: [u8; 62] = [
            0, 0, 0, 62, 0, 0, 0, 32, 64, 93, 249, 70, 12, 99, 111, 110, 116, 101, 110, 116, 45, 116, 121, 112, 101, 7,
            0, 16, 97, 112, 112, 108, 105, 99, 97, 116, 105, 111, 110, 47, 106, 115, 111, 110, 123, 34, 102, 111, 111,
            34, 58, 32, 34, 98, 97, 114, 34, 125, 111, 162, 191, 59,
        ];
        let (messages, broken, mid) = decode_in(&[&known], 1 << 16);
        assert_eq!((broken, mid), (None, false));
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0].header("content-type"), Some("application/json"));
        assert_eq!(messages[0].payload, br#"{"foo": "bar"}"#);
        assert_eq!(encode(&[("content-type", "application/json")], br#"{"foo": "bar"}"#), known);
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn every_two_way_split_gives_the_same_messages() {
        let bytes = stream();
        let whole = decode_in(&[&bytes], 1 << 16);
        assert_eq!(whole.0.len(), 3);
        assert_eq!(whole.0[2].header(":event-type"), Some("metadata"));
        for at in 0..=bytes.len() {
            let (head, tail) = bytes.split_at(at);
            assert_eq!(decode_in(&[head, tail], 1 << 16), whole, "split at {at}");
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn reads_past_every_header_type() {
        let mut section = Vec::new();
        for (kind, value) in [
            (0u8, vec![]),
            (1, vec![]),
            (2, vec![7]),
            (3, vec![0, 7]),
            (4, vec![0; 4]),
            (5, vec![0; 8]),
            (6, vec![0, 2, 0xff, 0xfe]),
            (8, vec![0; 8]),
            (9, vec![0; 16]),
            (7, [&[0u8, 2][..], b"ok"].concat()),
        ] {
            section.extend_from_slice(&[1, b'h', kind]);
            section.extend_from_slice(&value);
        }
        let mut message = Vec::new();
        message.extend_from_slice(&((OVERHEAD + section.len()) as u32).to_be_bytes());
        message.extend_from_slice(&(section.len() as u32).to_be_bytes());
        message.extend_from_slice(&crc32fast::hash(&message).to_be_bytes());
        message.extend_from_slice(&section);
        message.extend_from_slice(&crc32fast::hash(&message).to_be_bytes());
        let (messages, broken, _) = decode_in(&[&message], 1 << 16);
        assert_eq!(broken, None);
        assert_eq!(messages[0].headers, vec![("h".to_string(), "ok".to_string())]);
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn a_broken_stream_stops_and_keeps_what_came_before() {
        let good = event("contentBlockDelta", r#"{"delta":{"text":"a"}}"#);
        let mut bad_prelude = event("metadata", "{}");
        bad_prelude[9] ^= 1;
        let mut bad_message = event("metadata", "{}");
        let last = bad_message.len() - 6;
        bad_message[last] ^= 0x20;
        let mut bad_header = encode(&[("h", "v")], b"");
        bad_header[12 + 2] = 42; // an unknown value type, CRCs made to match
        let body_end = bad_header.len() - 4;
        let crc = crc32fast::hash(&bad_header[..body_end]).to_be_bytes();
        bad_header[body_end..].copy_from_slice(&crc);
        let cases = [
            (bad_prelude, StreamError::BadPreludeCrc),
            (bad_message, StreamError::BadMessageCrc),
            (bad_header, StreamError::Malformed),
            (event("contentBlockDelta", &"x".repeat(200)), StreamError::TooLarge),
        ];
        for (bad, error) in cases {
            let bytes = [good.clone(), bad, good.clone()].concat();
            let (messages, broken, mid) = decode_in(&[&bytes], 180);
            assert_eq!((messages.len(), broken, mid), (1, Some(error), false), "{error:?}");
        }
        // Announced lengths that cannot hold the overhead.
        let mut short = Vec::from(10u32.to_be_bytes());
        short.extend_from_slice(&0u32.to_be_bytes());
        short.extend_from_slice(&crc32fast::hash(&short).to_be_bytes());
        assert_eq!(decode_in(&[&short], 1 << 16).1, Some(StreamError::Malformed));
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn a_cut_off_stream_is_noticed() {
        let bytes = stream();
        let (messages, broken, mid) = decode_in(&[&bytes[..bytes.len() - 3]], 1 << 16);
        assert_eq!((messages.len(), broken, mid), (2, None, true));
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Any cutting of a stream into chunks gives the messages of the whole.
        #[test]
        fn any_chunking_gives_the_same_messages(cuts in proptest::collection::vec(0usize..120, 0..40)) {
            let bytes = stream();
            let mut chunks = Vec::new();
            let mut rest = &bytes[..];
            for cut in cuts {
                let (head, tail) = rest.split_at(cut.min(rest.len()));
                chunks.push(head);
                rest = tail;
            }
            chunks.push(rest);
            prop_assert_eq!(decode_in(&chunks, 1 << 16), decode_in(&[&bytes], 1 << 16));
        }

        /// A flipped bit anywhere is caught by a CRC (or breaks a length) before a message
        /// carrying it is delivered.
        #[test]
        fn a_flipped_bit_is_detected(at in 0usize..10_000, bit in 0u8..8) {
            let mut bytes = stream();
            let at = at % bytes.len();
            bytes[at] ^= 1 << bit;
            let (messages, broken, mid) = decode_in(&[&bytes], 1 << 16);
            let whole = decode_in(&[&stream()], 1 << 16).0;
            prop_assert!(broken.is_some() || mid, "undetected flip at {}", at);
            prop_assert!(messages.iter().zip(&whole).all(|(a, b)| a == b));
        }

        /// Random bytes, in random chunks, never panic and never buffer past the limit.
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), cut in 0usize..600) {
            let mut decoder = EventStreamDecoder::new(256);
            let (head, tail) = bytes.split_at(cut.min(bytes.len()));
            decoder.feed(head, &mut |_| {});
            decoder.feed(tail, &mut |_| {});
            prop_assert!(decoder.partial.len() <= 256);
        }
    }
}
