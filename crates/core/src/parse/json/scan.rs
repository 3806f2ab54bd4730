//! The fast path of `JsonDoc`'s parse: one forward pass over the text that appends the
//! nodes directly, with no deserializer between, and string text skipped eight bytes at a
//! time. It reads JSON as serde_json does but gives up (`None`) on anything it is not sure
//! of: an error of any kind, a duplicate key, deep nesting. The caller then reads the text
//! with serde_json, which decides and words the error. So this path never accepts what
//! serde_json refuses, and what it accepts it reads into the same nodes (the tests compare
//! both on generated and broken documents). Numbers other than non-negative integers that
//! fit a u64 (a fraction, an exponent, a sign, a larger integer) are read by serde_json
//! itself, one token at a time: they are rare in a body and must round as it rounds.

use super::{Builder, Node};
use serde_json::Number;
use std::borrow::Cow;

/// Containers open at once that this path follows: serde_json refuses a document nested
/// 128 deep, and nothing near that depth is worth reading fast.
const MOST_DEPTH: u32 = 100;

pub(super) fn document<'a>(text: &'a str, builder: &mut Builder<'a>) -> Option<()> {
    let mut scan = Scan { text, bytes: text.as_bytes(), at: 0, builder };
    scan.whitespace();
    scan.value(0)?;
    scan.whitespace();
    (scan.at == scan.bytes.len()).then_some(())
}

struct Scan<'a, 'b> {
    text: &'a str,
    bytes: &'a [u8],
    at: usize,
    builder: &'b mut Builder<'a>,
}

impl<'a> Scan<'a, '_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.at).copied()
    }

    fn whitespace(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.at += 1;
        }
    }

    /// Steps over `byte`, which must come next.
    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek()? == byte).then(|| self.at += 1)
    }

    fn literal(&mut self, word: &[u8], node: Node<'a>) -> Option<()> {
        let end = self.at.checked_add(word.len())?;
        (self.bytes.get(self.at..end)? == word).then(|| {
            self.at = end;
            self.builder.push(node);
        })
    }

    fn value(&mut self, depth: u32) -> Option<()> {
        match self.peek()? {
            b'{' => self.object(depth),
            b'[' => self.array(depth),
            b'"' => {
                self.at += 1;
                let text = self.string()?;
                self.builder.push(Node::String(text));
                Some(())
            }
            b't' => self.literal(b"true", Node::Bool(true)),
            b'f' => self.literal(b"false", Node::Bool(false)),
            b'n' => self.literal(b"null", Node::Null),
            b'-' | b'0'..=b'9' => {
                let number = self.number()?;
                self.builder.push(Node::Number(number));
                Some(())
            }
            _ => None,
        }
    }

    fn object(&mut self, depth: u32) -> Option<()> {
        if depth >= MOST_DEPTH {
            return None;
        }
        self.at += 1;
        let at = self.builder.push(Node::Object { end: 0, keys: 0 });
        self.whitespace();
        if self.peek()? == b'}' {
            self.at += 1;
        } else {
            loop {
                self.eat(b'"')?;
                let key = self.string()?;
                self.builder.push(Node::Key { text: key, shadowed: false });
                self.whitespace();
                self.eat(b':')?;
                self.whitespace();
                self.value(depth + 1)?;
                if self.after_item(b'}')? {
                    break;
                }
            }
        }
        self.builder.close(at);
        self.builder.check_keys(at).ok()
    }

    fn array(&mut self, depth: u32) -> Option<()> {
        if depth >= MOST_DEPTH {
            return None;
        }
        self.at += 1;
        let at = self.builder.push(Node::Array { end: 0 });
        self.whitespace();
        if self.peek()? == b']' {
            self.at += 1;
        } else {
            loop {
                self.value(depth + 1)?;
                if self.after_item(b']')? {
                    break;
                }
            }
        }
        self.builder.close(at);
        Some(())
    }

    /// What follows a container's item: a comma (false: another item comes) or `close`
    /// (true: the container ends).
    fn after_item(&mut self, close: u8) -> Option<bool> {
        self.whitespace();
        let byte = self.peek()?;
        self.at += 1;
        if byte == b',' {
            self.whitespace();
            Some(false)
        } else {
            (byte == close).then_some(true)
        }
    }

    /// A string's text, from just past its opening quote to just past its closing one:
    /// borrowed from the text unless it holds escapes.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        let start = self.at;
        let run = special_run(self.bytes.get(start..)?);
        self.at = start + run;
        if self.peek()? == b'"' {
            self.at += 1;
            return self.text.get(start..start + run).map(Cow::Borrowed);
        }
        let mut owned = String::with_capacity(run + 16);
        owned.push_str(self.text.get(start..start + run)?);
        loop {
            match self.peek()? {
                b'"' => {
                    self.at += 1;
                    return Some(Cow::Owned(owned));
                }
                b'\\' => {
                    self.at += 1;
                    self.escape(&mut owned)?;
                }
                // A control character: JSON wants it escaped.
                byte if byte < 0x20 => return None,
                _ => {
                    let from = self.at;
                    let run = special_run(self.bytes.get(from..)?);
                    self.at = from + run;
                    owned.push_str(self.text.get(from..from + run)?);
                }
            }
        }
    }

    /// One escape, after its backslash. A lone surrogate is left to serde_json to refuse.
    fn escape(&mut self, owned: &mut String) -> Option<()> {
        let byte = self.peek()?;
        self.at += 1;
        let unescaped = match byte {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let unit = self.hex4()?;
                let code = match unit {
                    0xD800..=0xDBFF => {
                        self.eat(b'\\')?;
                        self.eat(b'u')?;
                        let low = self.hex4()?;
                        if !(0xDC00..=0xDFFF).contains(&low) {
                            return None;
                        }
                        0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                    }
                    0xDC00..=0xDFFF => return None,
                    unit => unit,
                };
                char::from_u32(code)?
            }
            _ => return None,
        };
        owned.push(unescaped);
        Some(())
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.bytes.get(self.at..self.at.checked_add(4)?)?;
        let mut unit = 0;
        for &digit in digits {
            unit = unit * 16 + char::from(digit).to_digit(16)?;
        }
        self.at += 4;
        Some(unit)
    }

    /// A number: a non-negative integer that fits a u64 read here, any other left to
    /// serde_json, which reads it (or refuses it) as it would within the document.
    fn number(&mut self) -> Option<Number> {
        let start = self.at;
        let mut value: u64 = 0;
        let mut fits = true;
        while let Some(digit @ b'0'..=b'9') = self.peek() {
            let next = value.checked_mul(10).and_then(|v| v.checked_add(u64::from(digit - b'0')));
            fits &= next.is_some();
            value = next.unwrap_or(0);
            self.at += 1;
        }
        let digits = self.at - start;
        let plain = fits
            && digits > 0
            && (digits == 1 || self.bytes.get(start) != Some(&b'0'))
            && !matches!(self.peek(), Some(b'.' | b'e' | b'E' | b'-' | b'+'));
        if plain {
            return Some(Number::from(value));
        }
        while let Some(b'0'..=b'9' | b'.' | b'e' | b'E' | b'-' | b'+') = self.peek() {
            self.at += 1;
        }
        serde_json::from_str::<Number>(self.text.get(start..self.at)?).ok()
    }
}

/// How many bytes of `bytes` come before the first that ends a plain run of string text:
/// a quote, a backslash or a control character (all of `bytes` if none does). Eight bytes
/// are tested at a time: a long prompt costs little more than its copy.
fn special_run(bytes: &[u8]) -> usize {
    use crate::parse::{first_match, zero_in, HIGHS, ONES};
    let in_word = |word: u64| {
        // Equal to `"`, equal to `\`, below 0x20 (its own test: below, not equal).
        zero_in(word ^ (ONES * u64::from(b'"')))
            | zero_in(word ^ (ONES * u64::from(b'\\')))
            | (word.wrapping_sub(ONES * 0x20) & !word & HIGHS)
    };
    first_match(bytes, in_word, |b| b == b'"' || b == b'\\' || b < 0x20).unwrap_or(bytes.len())
}
