//! An incremental splitter for a stream of JSON objects sent as one top-level array
//! (`[{...},\r\n{...}]`), the framing of Gemini's `streamGenerateContent` without
//! `alt=sse`: feed it the body in whatever chunks the proxy delivers, get each element's
//! bytes as soon as the element closes. Elements may be split anywhere, even inside a
//! string, an escape or a UTF-8 character. Objects at the top level (a reply that is not
//! wrapped in an array) are delivered the same way; anything else between elements
//! (commas, whitespace, stray scalars) is skipped. Memory is bounded: an element larger
//! than the limit is dropped, never buffered without end. Malformed input yields what
//! was complete before it broke, never an error or a panic.

use crate::parse::json::closes_string;

#[derive(Debug)]
pub struct JsonArrayStream {
    /// The element being collected (empty between elements).
    element: Vec<u8>,
    /// Open containers inside the current element (0: between elements).
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// The current element grew past the limit: skip it up to its end.
    oversized: bool,
    max_element_bytes: usize,
    /// Elements dropped for their size.
    pub dropped: u64,
}

impl JsonArrayStream {
    pub fn new(max_element_bytes: usize) -> JsonArrayStream {
        JsonArrayStream {
            element: Vec::new(),
            depth: 0,
            in_string: false,
            escaped: false,
            oversized: false,
            max_element_bytes,
            dropped: 0,
        }
    }

    pub fn feed(&mut self, chunk: &[u8], on_element: &mut impl FnMut(&[u8])) {
        let mut at = 0;
        while at < chunk.len() {
            let rest = chunk.get(at..).unwrap_or(&[]);
            if self.in_string && !self.escaped {
                // String text up to the next quote or escape, in one search.
                let text = super::find2(b'"', b'\\', rest).unwrap_or(rest.len());
                self.keep(rest.get(..text).unwrap_or(&[]));
                at += text;
            } else if self.depth == 0 && !self.in_string {
                // Between elements only an object's opening brace (or a string) matters.
                match super::find2(b'{', b'"', rest) {
                    Some(found) => at += found,
                    None => return,
                }
            }
            let Some(&byte) = chunk.get(at) else { break };
            at += 1;
            self.byte(byte, on_element);
        }
    }

    fn byte(&mut self, byte: u8, on_element: &mut impl FnMut(&[u8])) {
        if self.in_string {
            if closes_string(&mut self.escaped, byte) {
                self.in_string = false;
            }
            self.keep(&[byte]);
            return;
        }
        match byte {
            b'"' => {
                self.in_string = true;
                self.keep(&[byte]);
            }
            b'{' | b'[' => {
                self.depth = self.depth.saturating_add(1);
                self.keep(&[byte]);
            }
            b'}' | b']' if self.depth > 0 => {
                self.keep(&[byte]);
                self.depth -= 1;
                if self.depth == 0 {
                    if !self.oversized {
                        on_element(&self.element);
                    }
                    self.element.clear();
                    self.oversized = false;
                }
            }
            _ => self.keep(&[byte]),
        }
    }

    /// Adds bytes to the current element, or drops it once it passes the limit.
    fn keep(&mut self, bytes: &[u8]) {
        if self.oversized || self.depth == 0 {
            return;
        }
        if self.element.len() + bytes.len() > self.max_element_bytes {
            self.oversized = true;
            self.dropped += 1;
            self.element = Vec::new();
            return;
        }
        self.element.extend_from_slice(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;

    fn elements(chunks: &[&[u8]], max: usize) -> Vec<String> {
        let mut stream = JsonArrayStream::new(max);
        let mut found = Vec::new();
        for chunk in chunks {
            stream.feed(chunk, &mut |e| found.push(String::from_utf8_lossy(e).into_owned()));
        }
        found
    }

    const GEMINI_ARRAY: &str = include_str!("../../../../tests/cases/streams/gemini_stream.json");

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn every_split_of_a_gemini_array_gives_its_elements() {
        let whole: serde_json::Value = serde_json::from_str(GEMINI_ARRAY).expect("the transcript is JSON");
        let expected: Vec<serde_json::Value> = whole.as_array().expect("an array").clone();
        let bytes = GEMINI_ARRAY.as_bytes();
        for at in 0..=bytes.len() {
            let (a, b) = bytes.split_at(at);
            let found: Vec<serde_json::Value> = elements(&[a, b], 1 << 20)
                .iter()
                .map(|e| serde_json::from_str(e).expect("an element is JSON"))
                .collect();
            assert_eq!(found, expected, "split at {at}");
        }
    }

    #[test]
    fn strings_with_brackets_quotes_and_escapes_do_not_confuse_it() {
        let text = r#"[ "a { string", {"t":"}]\"{[\\"}, 7, {"u":[1,{"v":"\u00e9]"}]} ]"#;
        assert_eq!(elements(&[text.as_bytes()], 1 << 10), vec![r#"{"t":"}]\"{[\\"}"#, r#"{"u":[1,{"v":"\u00e9]"}]}"#]);
    }

    #[test]
    fn a_bare_object_and_an_unfinished_array_give_what_is_complete() {
        assert_eq!(elements(&[br#"{"a":1}"#], 64), vec![r#"{"a":1}"#]);
        assert_eq!(elements(&[br#"[{"a":1},{"b":"#], 64), vec![r#"{"a":1}"#]);
        assert_eq!(elements(&[b"]]]}}}", br#"[{"c":2}]"#], 64), vec![r#"{"c":2}"#]);
    }

    #[test]
    fn drops_an_oversized_element_and_carries_on() {
        let big = format!(r#"[{{"x":"{}"}},{{"small":true}}]"#, "y".repeat(500));
        let mut stream = JsonArrayStream::new(64);
        let mut found = Vec::new();
        for chunk in big.as_bytes().chunks(7) {
            stream.feed(chunk, &mut |e| found.push(e.to_vec()));
        }
        assert_eq!(found, vec![br#"{"small":true}"#.to_vec()]);
        assert_eq!(stream.dropped, 1);
    }

    /// A JSON value whose strings are full of the bytes that matter to the splitter.
    #[cfg(not(target_arch = "wasm32"))]
    fn tricky_value() -> impl Strategy<Value = serde_json::Value> {
        let text = prop::collection::vec(
            prop_oneof![
                Just("{"),
                Just("}"),
                Just("["),
                Just("]"),
                Just("\""),
                Just("\\"),
                Just(","),
                Just("é"),
                Just("x")
            ],
            0..8,
        )
        .prop_map(|pieces| serde_json::Value::String(pieces.concat()));
        let leaf = prop_oneof![text, (0u64..1000).prop_map(serde_json::Value::from), Just(serde_json::Value::Null)];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
                prop::collection::vec(("[a-z{}\\]\"]{0,3}", inner), 0..4)
                    .prop_map(|fields| serde_json::Value::Object(fields.into_iter().collect())),
            ]
        })
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// An array of objects, pretty-printed or not, cut into random chunks: the
        /// elements found are the array's, in order, whatever the cuts.
        #[test]
        fn any_chunking_gives_the_arrays_elements(
            objects in prop::collection::vec(prop::collection::vec(("[a-z\"{]{1,3}", tricky_value()), 0..4), 0..6),
            pretty in any::<bool>(),
            cuts in prop::collection::vec(0usize..64, 0..20),
        ) {
            let array = serde_json::Value::Array(
                objects.into_iter().map(|fields| serde_json::Value::Object(fields.into_iter().collect())).collect(),
            );
            let text = if pretty { serde_json::to_string_pretty(&array) } else { serde_json::to_string(&array) }
                .expect("serializable");
            let mut rest = text.as_bytes();
            let mut chunks = Vec::new();
            for cut in cuts {
                let (head, tail) = rest.split_at(cut.min(rest.len()));
                chunks.push(head);
                rest = tail;
            }
            chunks.push(rest);
            let found: Vec<serde_json::Value> = elements(&chunks, 1 << 20)
                .iter()
                .map(|e| serde_json::from_str(e).expect("an element is JSON"))
                .collect();
            prop_assert_eq!(Some(&found), array.as_array());
        }

        /// Any bytes at all: no panic, and nothing kept past the limit.
        #[test]
        fn any_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600), cut in 0usize..600) {
            let mut stream = JsonArrayStream::new(100);
            let (a, b) = bytes.split_at(cut.min(bytes.len()));
            let mut longest = 0;
            stream.feed(a, &mut |e| longest = longest.max(e.len()));
            stream.feed(b, &mut |e| longest = longest.max(e.len()));
            prop_assert!(longest <= 100);
            prop_assert!(stream.element.len() <= 100);
        }
    }
}
