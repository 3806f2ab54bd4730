//! An incremental Server-Sent Events parser: feed it the response body in whatever chunks
//! the proxy delivers, get whole events out. Events may be split anywhere, even inside a
//! CRLF or a UTF-8 character; lines may end in LF, CRLF or CR; comments and unknown fields
//! are skipped; several `data:` lines join with `\n`. Memory is bounded: an event larger
//! than the limit is dropped, never buffered without end.

use crate::parse::json::Field;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SseEvent {
    /// The `event:` field, empty if none.
    pub event: String,
    pub data: String,
}

#[derive(Debug)]
pub struct SseParser {
    line: Vec<u8>,
    event: String,
    data: String,
    has_data: bool,
    /// The last chunk ended in CR: a LF starting the next one belongs to it.
    after_cr: bool,
    /// The current event grew past the limit: skip it up to its end.
    oversized: bool,
    max_event_bytes: usize,
}

impl SseParser {
    pub fn new(max_event_bytes: usize) -> SseParser {
        SseParser {
            line: Vec::new(),
            event: String::new(),
            data: String::new(),
            has_data: false,
            after_cr: false,
            oversized: false,
            max_event_bytes,
        }
    }

    pub fn feed(&mut self, mut chunk: &[u8], on_event: &mut impl FnMut(SseEvent)) {
        if self.after_cr && !chunk.is_empty() {
            self.after_cr = false;
            if let Some(rest) = chunk.strip_prefix(b"\n") {
                chunk = rest;
            }
        }
        while let Some(end) = chunk.iter().position(|&b| b == b'\n' || b == b'\r') {
            let (line, rest) = chunk.split_at(end);
            self.push_line_bytes(line);
            self.end_line(on_event);
            let crlf = rest.starts_with(b"\r\n");
            chunk = rest.get(if crlf { 2 } else { 1 }..).unwrap_or(&[]);
            if !crlf && rest.first() == Some(&b'\r') && chunk.is_empty() {
                self.after_cr = true;
            }
        }
        self.push_line_bytes(chunk);
    }

    /// The stream ended: an event not closed by a blank line is still delivered.
    pub fn finish(&mut self, on_event: &mut impl FnMut(SseEvent)) {
        if !self.line.is_empty() {
            self.end_line(on_event);
        }
        self.dispatch(on_event);
    }

    fn push_line_bytes(&mut self, bytes: &[u8]) {
        if self.oversized {
            return;
        }
        if self.line.len() + bytes.len() + self.data.len() > self.max_event_bytes {
            self.oversized = true;
            self.line.clear();
            self.data.clear();
            return;
        }
        self.line.extend_from_slice(bytes);
    }

    fn end_line(&mut self, on_event: &mut impl FnMut(SseEvent)) {
        let line = std::mem::take(&mut self.line);
        if line.is_empty() {
            self.dispatch(on_event);
            return;
        }
        if self.oversized || line.first() == Some(&b':') {
            return;
        }
        let line = String::from_utf8_lossy(&line);
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.event = value.to_string(),
            _ => {}
        }
    }

    fn dispatch(&mut self, on_event: &mut impl FnMut(SseEvent)) {
        let event = SseEvent { event: std::mem::take(&mut self.event), data: std::mem::take(&mut self.data) };
        let deliver = self.has_data && !self.oversized;
        self.has_data = false;
        self.oversized = false;
        if deliver {
            on_event(event);
        }
    }
}

/// Removes the usage-only chunk (`"choices": []` with `usage`) that
/// `stream_options.include_usage` adds to an OpenAI chat stream, for a client that did not
/// ask for it: such a client may read `choices[0]` of every chunk. Complete events pass
/// on as they arrive; an incomplete one waits for its end.
#[derive(Debug, Default)]
pub struct UsageChunkRemover {
    pending: Vec<u8>,
}

impl UsageChunkRemover {
    /// The bytes to pass on for this chunk (`end`: the stream's last).
    pub fn filter(&mut self, chunk: &[u8], end: bool) -> Vec<u8> {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut start = 0;
        while let Some(len) = event_length(self.pending.get(start..).unwrap_or(&[])) {
            let event = self.pending.get(start..start + len).unwrap_or(&[]);
            if !is_usage_only(event) {
                out.extend_from_slice(event);
            }
            start += len;
        }
        self.pending.drain(..start);
        if end {
            out.append(&mut self.pending);
        }
        out
    }
}

/// Length of the first complete event in `bytes`, its closing blank line included.
fn event_length(bytes: &[u8]) -> Option<usize> {
    (0..bytes.len()).find_map(|i| {
        let rest = bytes.get(i..)?;
        [&b"\r\n\r\n"[..], b"\n\n", b"\r\r"].iter().find(|end| rest.starts_with(end)).map(|end| i + end.len())
    })
}

fn is_usage_only(event: &[u8]) -> bool {
    let text = String::from_utf8_lossy(event);
    let data: String = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|value| value.strip_prefix(' ').unwrap_or(value))
        .collect::<Vec<_>>()
        .join("\n");
    match serde_json::from_str::<serde_json::Value>(&data) {
        Ok(chunk) => chunk.at("choices").as_array().is_some_and(|c| c.is_empty()) && chunk.at("usage").is_object(),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut parser = SseParser::new(1 << 20);
        let mut events = Vec::new();
        for chunk in chunks {
            parser.feed(chunk, &mut |e| events.push(e));
        }
        parser.finish(&mut |e| events.push(e));
        events
    }

    fn ev(event: &str, data: &str) -> SseEvent {
        SseEvent { event: event.into(), data: data.into() }
    }

    #[test]
    fn parses_fields_comments_and_line_endings() {
        let text = b": keep-alive\r\nevent: message_start\r\ndata: {\"a\":1}\r\n\r\ndata:x\rdata: y\r\rid: 7\nretry: 10\ndata\n\n";
        assert_eq!(parse_all(&[text]), vec![ev("message_start", "{\"a\":1}"), ev("", "x\ny"), ev("", "")]);
    }

    #[test]
    fn an_event_without_data_is_not_delivered() {
        assert_eq!(parse_all(&[b"event: ping\n\n: comment\n\n"]), vec![]);
    }

    #[test]
    fn delivers_an_unterminated_last_event_at_the_end() {
        assert_eq!(parse_all(&[b"data: [DONE]"]), vec![ev("", "[DONE]")]);
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn every_split_gives_the_same_events() {
        let text = "event: a\r\ndata: h\u{e9}llo \u{1F600}\r\n\r\ndata: 2\rdata: 3\r\r: c\ndata: end\n\n".as_bytes();
        let whole = parse_all(&[text]);
        assert_eq!(whole.len(), 3);
        for i in 0..=text.len() {
            for j in i..=text.len() {
                let (a, rest) = text.split_at(i);
                let (b, c) = rest.split_at(j - i);
                assert_eq!(parse_all(&[a, b, c]), whole, "split at {i}, {j}");
            }
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn removes_only_the_usage_chunk_whatever_the_split() {
        let stream = include_str!("../../../../tests/cases/streams/openai_chat_usage.sse").as_bytes();
        let events: Vec<&str> = std::str::from_utf8(stream).expect("utf8").split_inclusive("\n\n").collect();
        let expected: String = events.iter().filter(|e| !e.contains(r#""choices":[]"#)).copied().collect();
        assert_eq!(events.len(), expected.split_inclusive("\n\n").count() + 1);
        for at in 0..=stream.len() {
            let mut remover = UsageChunkRemover::default();
            let (a, b) = stream.split_at(at);
            let mut out = remover.filter(a, false);
            out.extend(remover.filter(b, true));
            assert_eq!(String::from_utf8(out).expect("utf8"), expected, "split at {at}");
        }
    }

    #[test]
    fn drops_an_oversized_event_and_carries_on() {
        let mut parser = SseParser::new(64);
        let mut events = Vec::new();
        let big = format!("data: {}\n\ndata: small\n\n", "x".repeat(200));
        for chunk in big.as_bytes().chunks(7) {
            parser.feed(chunk, &mut |e| events.push(e));
        }
        assert_eq!(events, vec![ev("", "small")]);
    }
}
