//! An incremental Server-Sent Events parser: feed it the response body in whatever chunks
//! the proxy delivers, get whole events out. Events may be split anywhere, even inside a
//! CRLF or a UTF-8 character; lines may end in LF, CRLF or CR; comments and unknown fields
//! are skipped; several `data:` lines join with `\n`. Memory is bounded: an event larger
//! than the limit is dropped, never buffered without end.

/// One event, borrowed from the parser until the callback returns (its buffers are kept
/// for the next event: a stream of many events allocates for none of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SseEvent<'a> {
    /// The `event:` field, empty if none.
    pub event: &'a str,
    pub data: &'a str,
}

/// The room an event's data keeps for the next one; events are mostly far smaller.
const KEPT_DATA_BYTES: usize = 16 * 1024;

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

    pub fn feed(&mut self, mut chunk: &[u8], on_event: &mut impl FnMut(SseEvent<'_>)) {
        if self.after_cr && !chunk.is_empty() {
            self.after_cr = false;
            if let Some(rest) = chunk.strip_prefix(b"\n") {
                chunk = rest;
            }
        }
        while let Some(end) = super::find2(b'\n', b'\r', chunk) {
            let (line, rest) = chunk.split_at(end);
            if self.line.is_empty() {
                // The whole line is in this chunk: read in place, measured as
                // `push_line_bytes` would measure it.
                if !self.oversized && line.len() + self.data.len() > self.max_event_bytes {
                    self.oversized = true;
                    self.data.clear();
                }
                self.take_line(line, on_event);
            } else {
                self.push_line_bytes(line);
                let line = std::mem::take(&mut self.line);
                self.take_line(&line, on_event);
                self.line = line;
                self.line.clear();
            }
            let crlf = rest.starts_with(b"\r\n");
            chunk = rest.get(if crlf { 2 } else { 1 }..).unwrap_or(&[]);
            if !crlf && rest.first() == Some(&b'\r') && chunk.is_empty() {
                self.after_cr = true;
            }
        }
        self.push_line_bytes(chunk);
    }

    /// The stream ended: an event not closed by a blank line is still delivered.
    pub fn finish(&mut self, on_event: &mut impl FnMut(SseEvent<'_>)) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.take_line(&line, on_event);
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

    /// One whole line (without its end): a blank one ends the event, and so does any line
    /// of an event grown past the limit (dropped).
    fn take_line(&mut self, line: &[u8], on_event: &mut impl FnMut(SseEvent<'_>)) {
        if line.is_empty() || self.oversized {
            self.dispatch(on_event);
            return;
        }
        if line.first() == Some(&b':') {
            return;
        }
        let line = match std::str::from_utf8(line) {
            Ok(text) => std::borrow::Cow::Borrowed(text),
            Err(_) => String::from_utf8_lossy(line),
        };
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
            "event" => {
                self.event.clear();
                self.event.push_str(value);
            }
            _ => {}
        }
    }

    fn dispatch(&mut self, on_event: &mut impl FnMut(SseEvent<'_>)) {
        if self.has_data && !self.oversized {
            on_event(SseEvent { event: &self.event, data: &self.data });
        }
        self.event.clear();
        self.data.clear();
        if self.data.capacity() > KEPT_DATA_BYTES {
            // A large event's room is not kept for the rest of the stream.
            self.data = String::new();
        }
        self.has_data = false;
        self.oversized = false;
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
    /// The bytes to pass on for this chunk (`end`: the stream's last), or `None` when they
    /// are the chunk as it came: whole events, none of them the usage chunk (most chunks).
    pub fn filter(&mut self, chunk: &[u8], end: bool) -> Option<Vec<u8>> {
        let held = self.pending.len();
        self.pending.extend_from_slice(chunk);
        let mut removed: Vec<std::ops::Range<usize>> = Vec::new();
        let mut start = 0;
        // What was held was looked through already, but for a blank line it may end in.
        let mut from = held.saturating_sub(3);
        while let Some(len) = event_length(self.pending.get(start..).unwrap_or(&[]), from) {
            if is_usage_only(self.pending.get(start..start + len).unwrap_or(&[])) {
                removed.push(start..start + len);
            }
            start += len;
            from = 0;
        }
        let passed = if end { self.pending.len() } else { start };
        if held == 0 && removed.is_empty() && passed == self.pending.len() {
            self.pending.clear();
            return None;
        }
        let mut out = Vec::with_capacity(passed);
        let mut from = 0;
        for range in removed {
            out.extend_from_slice(self.pending.get(from..range.start).unwrap_or(&[]));
            from = range.end;
        }
        out.extend_from_slice(self.pending.get(from..passed).unwrap_or(&[]));
        self.pending.drain(..passed);
        Some(out)
    }
}

/// Length of the first complete event in `bytes`, its closing blank line included, looking
/// for that line from `from` on (an event held over many chunks is not read again from its
/// start each time).
fn event_length(bytes: &[u8], mut from: usize) -> Option<usize> {
    // Every way a blank line ends starts with CR or LF: only those places are looked at.
    while let Some(at) = super::find2(b'\n', b'\r', bytes.get(from..)?) {
        let i = from + at;
        let rest = bytes.get(i..)?;
        if let Some(end) = [&b"\r\n\r\n"[..], b"\n\n", b"\r\r"].iter().find(|end| rest.starts_with(end)) {
            return Some(i + end.len());
        }
        from = i + 1;
    }
    None
}

/// Whether `event` is the usage-only chunk: its data (its `data:` lines joined, as the
/// SSE parser joins them) a JSON object with `"choices": []` and a `usage` object.
fn is_usage_only(event: &[u8]) -> bool {
    let mut data: Option<std::borrow::Cow<'_, [u8]>> = None;
    let mut start = 0;
    let ends = memchr::memchr_iter(b'\n', event).chain(std::iter::once(event.len()));
    for end in ends {
        let line = event.get(start..end).unwrap_or(&[]);
        start = end + 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(value) = line.strip_prefix(b"data:") else { continue };
        let value = value.strip_prefix(b" ").unwrap_or(value);
        data = Some(match data {
            None => std::borrow::Cow::Borrowed(value),
            Some(joined) => std::borrow::Cow::Owned([&joined[..], b"\n", value].concat()),
        });
    }
    let Some(data) = data else { return false };
    // `"choices": []` can only be written as `[`, JSON's whitespace, `]`: data without an
    // empty array (every chunk of text) is not parsed.
    if !has_empty_array(&data) {
        return false;
    }
    let Ok(chunk) = crate::parse::json::Json::parse(&data) else { return false };
    let chunk = chunk.root();
    chunk.at("choices").as_array().is_some_and(|mut choices| choices.next().is_none()) && chunk.at("usage").is_object()
}

/// Whether `text` holds `[` followed by nothing but JSON whitespace and `]` (in a string
/// or not).
fn has_empty_array(text: &[u8]) -> bool {
    memchr::memchr_iter(b'[', text).any(|at| {
        let after = text.get(at + 1..).unwrap_or(&[]);
        after.iter().find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r')) == Some(&b']')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(chunks: &[&[u8]]) -> Vec<(String, String)> {
        let mut parser = SseParser::new(1 << 20);
        let mut events = Vec::new();
        for chunk in chunks {
            parser.feed(chunk, &mut |e| events.push(ev(e.event, e.data)));
        }
        parser.finish(&mut |e| events.push(ev(e.event, e.data)));
        events
    }

    fn ev(event: &str, data: &str) -> (String, String) {
        (event.into(), data.into())
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
            let mut out = remover.filter(a, false).unwrap_or_else(|| a.to_vec());
            out.extend(remover.filter(b, true).unwrap_or_else(|| b.to_vec()));
            assert_eq!(String::from_utf8(out).expect("utf8"), expected, "split at {at}");
        }
    }

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn an_oversized_event_is_dropped_alike_whatever_the_split() {
        // A line read in place (whole in one chunk) is measured as a buffered one is.
        let text =
            format!("data: {}\ndata: after\n\ndata: small\n\n: {}\ndata: x\r\n\r\n", "y".repeat(70), "c".repeat(80));
        let text = text.as_bytes();
        let parse = |chunks: &[&[u8]]| {
            let mut parser = SseParser::new(64);
            let mut events = Vec::new();
            for chunk in chunks {
                parser.feed(chunk, &mut |e| events.push(ev(e.event, e.data)));
            }
            parser.finish(&mut |e| events.push(ev(e.event, e.data)));
            events
        };
        let whole = parse(&[text]);
        assert!(whole.contains(&ev("", "small")) && whole.contains(&ev("", "x")), "{whole:?}");
        for i in 0..=text.len() {
            for j in (i..=text.len()).step_by(3) {
                let (a, rest) = text.split_at(i);
                let (b, c) = rest.split_at(j - i);
                assert_eq!(parse(&[a, b, c]), whole, "split at {i}, {j}");
            }
        }
    }

    #[test]
    fn whole_events_without_the_usage_chunk_pass_as_they_came() {
        let mut remover = UsageChunkRemover::default();
        let delta = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n";
        assert_eq!(remover.filter(delta, false), None, "nothing to copy");
        // Half an event is held back until its end comes.
        let (head, tail) = delta.split_at(10);
        assert_eq!(remover.filter(head, false), Some(Vec::new()));
        assert_eq!(remover.filter(tail, false), Some(delta.to_vec()));
        let usage = b"data: {\"choices\":[],\"usage\":{\"total_tokens\":3}}\n\n";
        assert_eq!(
            remover.filter(&[&delta[..], usage, b"data: [DONE]\n\n"].concat(), true),
            Some([&delta[..], b"data: [DONE]\n\n"].concat())
        );
    }

    #[test]
    fn drops_an_oversized_event_and_carries_on() {
        let mut parser = SseParser::new(64);
        let mut events = Vec::new();
        let big = format!("data: {}\n\ndata: small\n\n", "x".repeat(200));
        for chunk in big.as_bytes().chunks(7) {
            parser.feed(chunk, &mut |e| events.push(ev(e.event, e.data)));
        }
        assert_eq!(events, vec![ev("", "small")]);
    }
}
