//! What the filter sends a client itself: a reply (status, headers, body) and the header
//! pairs every response may carry, below both what decides them (`crate::replies::decision`) and
//! what shapes them for the caller's API (`crate::replies::answers`), and below the `Host` that
//! sends them.

pub type Header = (&'static str, HeaderValue);

/// Bytes a header value holds without an allocation: every number and duration the
/// rate-limit headers carry (a `u64` is 20 digits).
const INLINE_VALUE: usize = 30;

/// A header's value. Short ones (the numbers of the rate-limit headers, several on every
/// admitted response) are kept in place, so writing one costs no allocation; longer
/// ones (the IETF fields, messages) are a `String` as before.
#[derive(Clone)]
pub struct HeaderValue(Text);

#[derive(Clone)]
enum Text {
    Inline { len: u8, bytes: [u8; INLINE_VALUE] },
    Heap(String),
}

impl Default for HeaderValue {
    fn default() -> HeaderValue {
        HeaderValue(Text::Inline { len: 0, bytes: [0; INLINE_VALUE] })
    }
}

impl HeaderValue {
    /// Appends `piece`, in place while it fits.
    pub fn push_str(&mut self, piece: &str) {
        match &mut self.0 {
            Text::Inline { len, bytes } => {
                let at = usize::from(*len);
                match bytes.get_mut(at..at + piece.len()) {
                    Some(room) => {
                        room.copy_from_slice(piece.as_bytes());
                        *len = (at + piece.len()) as u8;
                    }
                    None => {
                        let mut text = String::with_capacity(at + piece.len() + INLINE_VALUE);
                        text.push_str(std::str::from_utf8(bytes.get(..at).unwrap_or_default()).unwrap_or_default());
                        text.push_str(piece);
                        self.0 = Text::Heap(text);
                    }
                }
            }
            Text::Heap(text) => text.push_str(piece),
        }
    }

    pub fn as_str(&self) -> &str {
        match &self.0 {
            // Only ever filled from a `&str` of `len` bytes (see `From<&str>`).
            Text::Inline { len, bytes } => {
                std::str::from_utf8(bytes.get(..usize::from(*len)).unwrap_or_default()).unwrap_or_default()
            }
            Text::Heap(text) => text,
        }
    }
}

impl From<&str> for HeaderValue {
    fn from(text: &str) -> HeaderValue {
        let mut value = HeaderValue::default();
        value.push_str(text);
        value
    }
}

impl From<String> for HeaderValue {
    fn from(text: String) -> HeaderValue {
        HeaderValue(Text::Heap(text))
    }
}

impl std::ops::Deref for HeaderValue {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for HeaderValue {
    fn eq(&self, other: &HeaderValue) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for HeaderValue {}

impl PartialEq<str> for HeaderValue {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for HeaderValue {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for HeaderValue {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other
    }
}

impl std::fmt::Debug for HeaderValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for HeaderValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A response the filter sends itself instead of forwarding the request.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<Header>,
    pub body: String,
}

impl LocalReply {
    /// The same reply with no body (for a host that cannot send one just then): the
    /// status, `retry-after` and the rate-limit headers still say what happened.
    pub fn without_body(mut self) -> LocalReply {
        self.headers.retain(|(name, _)| *name != "content-type");
        self.body.clear();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_value_reads_as_written_in_place_or_past_its_room() {
        let long = "\"rpm\";q=1000000000;w=60, \"tpm\";q=1000000000000;w=60";
        for text in ["", "17ms", "18446744073709551615", &long[..INLINE_VALUE], long] {
            assert_eq!(HeaderValue::from(text), text);
            assert_eq!(HeaderValue::from(text.to_string()).as_str(), text);
            // Piece by piece, crossing from in place to a `String` anywhere.
            let mut pieces = HeaderValue::default();
            for piece in text.split_inclusive(';') {
                pieces.push_str(piece);
            }
            assert_eq!(pieces, HeaderValue::from(text), "{text}");
            assert_eq!(format!("{pieces}"), text);
        }
    }
}
