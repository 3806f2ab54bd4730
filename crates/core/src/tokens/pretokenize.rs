//! The pre-tokenizers: where tiktoken's regex for each encoding ends the piece that starts
//! at a given offset, written out by hand (tiktoken runs the regex with fancy-regex, a
//! backtracking engine: the alternatives below are tried in the pattern's order and each
//! takes what its greedy quantifiers would). The character classes come from the same
//! Unicode tables as the regex crate's (see build.rs).
//!
//! Offsets are byte offsets into valid UTF-8 at character boundaries; every function
//! returns an end past `start` and at most the text's length.

use super::layout::{CLASS_BLOCK, LETTER, LOWER_LIKE, NUMBER, SPACE, UPPER_LIKE};

include!(concat!(env!("OUT_DIR"), "/char_classes.rs"));

/// The class bits (layout.rs) and byte length of the character at `at`; (0, 1) past the
/// end, which no caller asks for.
#[inline(always)]
fn char_at(text: &[u8], at: usize) -> (u8, usize) {
    let Some(&lead) = text.get(at) else {
        return (0, 1);
    };
    if lead < 0x80 {
        return (CLASS_ROWS.get(usize::from(lead)).copied().unwrap_or(0), 1);
    }
    let cont = |i: usize| u32::from(text.get(at + i).copied().unwrap_or(0) & 0x3f);
    let (code, len) = match lead {
        0xc0..=0xdf => ((u32::from(lead & 0x1f) << 6) | cont(1), 2),
        0xe0..=0xef => ((u32::from(lead & 0x0f) << 12) | (cont(1) << 6) | cont(2), 3),
        _ => ((u32::from(lead & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3), 4),
    };
    let code = code as usize;
    let row = CLASS_INDEX.get(code / CLASS_BLOCK).copied().unwrap_or(0);
    (CLASS_ROWS.get(usize::from(row) * CLASS_BLOCK + code % CLASS_BLOCK).copied().unwrap_or(0), len)
}

fn is_newline(text: &[u8], at: usize) -> bool {
    matches!(text.get(at), Some(b'\r' | b'\n'))
}

/// `[^\r\n\p{L}\p{N}]`: what may stand before a word.
fn is_word_prefix(class: u8, text: &[u8], at: usize) -> bool {
    class & (LETTER | NUMBER) == 0 && !is_newline(text, at)
}

/// `[^\s\p{L}\p{N}]`: punctuation, symbols, marks (to cl100k) and the rest.
fn is_other(class: u8) -> bool {
    class & (LETTER | NUMBER | SPACE) == 0
}

/// The end of the run of characters from `at` whose class has one of `bits`.
fn run_end(text: &[u8], mut at: usize, bits: u8) -> usize {
    while at < text.len() {
        let (class, len) = char_at(text, at);
        if class & bits == 0 {
            break;
        }
        at += len;
    }
    at
}

/// The end of up to three numbers from `at`: `\p{N}{1,3}`.
fn numbers_end(text: &[u8], mut at: usize) -> usize {
    for _ in 0..3 {
        if at >= text.len() {
            break;
        }
        let (class, len) = char_at(text, at);
        if class & NUMBER == 0 {
            break;
        }
        at += len;
    }
    at
}

/// The end of `'s|'t|'re|'ve|'m|'ll|'d` (case-insensitive) at `at`, both encodings'
/// contractions. Case-insensitive is the regex crate's simple case folding, under which
/// only ſ (U+017F) joins the ASCII letters: it folds to s.
fn contraction_end(text: &[u8], at: usize) -> Option<usize> {
    if text.get(at) != Some(&b'\'') {
        return None;
    }
    let letter = |at: usize, lower: u8| -> Option<usize> {
        match text.get(at..) {
            Some([byte, ..]) if byte | 0x20 == lower => Some(at + 1),
            Some([0xc5, 0xbf, ..]) if lower == b's' => Some(at + 2),
            _ => None,
        }
    };
    let first = at + 1;
    [b's', b't', b'm', b'd'].into_iter().find_map(|lower| letter(first, lower)).or_else(|| {
        [(b'r', b'e'), (b'v', b'e'), (b'l', b'l')].into_iter().find_map(|(a, b)| letter(letter(first, a)?, b))
    })
}

/// A word and what follows it: the contraction if there is one.
fn with_contraction(text: &[u8], word_end: usize) -> usize {
    contraction_end(text, word_end).unwrap_or(word_end)
}

/// `[UPPER_LIKE]*[LOWER_LIKE]+` from `at`: the capitals run as far as they go but must leave
/// at least one lowercase-like character, which may be the last of the capitals'
/// run (the classes overlap).
fn capitals_then_lowercase(text: &[u8], at: usize) -> Option<usize> {
    let mut end = at;
    let mut after_last_lower = None;
    while end < text.len() {
        let (class, len) = char_at(text, end);
        if class & UPPER_LIKE == 0 {
            if class & LOWER_LIKE != 0 {
                return Some(run_end(text, end, LOWER_LIKE));
            }
            break;
        }
        end += len;
        if class & LOWER_LIKE != 0 {
            after_last_lower = Some(end);
        }
    }
    // The run of capitals gives back its characters up to the last lowercase-like one,
    // which the lowercase part then takes alone: what follows it is not lowercase-like.
    after_last_lower
}

/// `[UPPER_LIKE]+[LOWER_LIKE]*` from `at`.
fn capitals_then_any_lowercase(text: &[u8], at: usize) -> Option<usize> {
    let capitals_end = run_end(text, at, UPPER_LIKE);
    (capitals_end > at).then(|| run_end(text, capitals_end, LOWER_LIKE))
}

/// ` ?[^\s\p{L}\p{N}]+` then any of `tail`'s bytes.
fn punctuation_end(text: &[u8], start: usize, tail: &[u8]) -> Option<usize> {
    let mut at = start;
    if text.get(at) == Some(&b' ') {
        at += 1;
    }
    if at >= text.len() || !is_other(char_at(text, at).0) {
        return None;
    }
    while at < text.len() {
        let (class, len) = char_at(text, at);
        if !is_other(class) {
            break;
        }
        at += len;
    }
    while text.get(at).is_some_and(|byte| tail.contains(byte)) {
        at += 1;
    }
    Some(at)
}

/// Where the letters start in the commonest piece, all ASCII: a word with at most one
/// character before it, which `[^\r\n\p{L}\p{N}]` allows (a space, punctuation). None when
/// the piece does not start so.
#[inline(always)]
fn ascii_word_start(text: &[u8], start: usize) -> Option<usize> {
    let first = *text.get(start)?;
    if first.is_ascii_alphabetic() {
        return Some(start);
    }
    let prefix = first.is_ascii() && !first.is_ascii_digit() && first != b'\r' && first != b'\n';
    (prefix && text.get(start + 1).is_some_and(u8::is_ascii_alphabetic)).then_some(start + 1)
}

/// The end of the run of bytes from `at` that `in_run` accepts, if what follows it is
/// ASCII or the end: a non-ASCII character might belong to the run, and the general path
/// decides then.
#[inline(always)]
fn ascii_run_end(text: &[u8], mut at: usize, in_run: impl Fn(&u8) -> bool) -> Option<usize> {
    while text.get(at).is_some_and(&in_run) {
        at += 1;
    }
    text.get(at).is_none_or(u8::is_ascii).then_some(at)
}

/// A run of whitespace from `start` and what the patterns' whitespace alternatives make
/// of it.
struct Whitespace {
    /// Where the run ends.
    end: usize,
    /// Just past the run's last `\r` or `\n`, if it has one.
    after_last_newline: Option<usize>,
    /// Where the run's last character starts.
    last_start: usize,
    /// Whether the run is one character.
    single: bool,
}

fn whitespace(text: &[u8], start: usize) -> Whitespace {
    let mut run = Whitespace { end: start, after_last_newline: None, last_start: start, single: true };
    while run.end < text.len() {
        let (class, len) = char_at(text, run.end);
        if class & SPACE == 0 {
            break;
        }
        if is_newline(text, run.end) {
            run.after_last_newline = Some(run.end + 1);
        }
        run.single = run.end == start;
        run.last_start = run.end;
        run.end += len;
    }
    run
}

/// o200k_base's pattern:
/// ```text
/// [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
/// |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
/// |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
/// ```
pub(super) fn o200k_piece_end(text: &[u8], start: usize) -> usize {
    // ASCII capitals then lowercase letters: the two word alternatives agree then.
    let ascii_word = ascii_word_start(text, start)
        .and_then(|letters| ascii_run_end(text, letters, u8::is_ascii_uppercase))
        .and_then(|capitals_end| ascii_run_end(text, capitals_end, u8::is_ascii_lowercase));
    if let Some(word_end) = ascii_word {
        return with_contraction(text, word_end);
    }
    let (first, first_len) = char_at(text, start);
    let prefixed = is_word_prefix(first, text, start);
    let after_prefix = start + first_len;
    // A mark is both a possible prefix and a letter-like character: with the prefix
    // taken the word may fail where without it it matches.
    let word = (prefixed.then(|| capitals_then_lowercase(text, after_prefix)).flatten())
        .or_else(|| capitals_then_lowercase(text, start))
        .or_else(|| prefixed.then(|| capitals_then_any_lowercase(text, after_prefix)).flatten())
        .or_else(|| capitals_then_any_lowercase(text, start));
    if let Some(word_end) = word {
        return with_contraction(text, word_end);
    }
    if first & NUMBER != 0 {
        return numbers_end(text, start);
    }
    if let Some(end) = punctuation_end(text, start, b"\r\n/") {
        return end;
    }
    if first & SPACE != 0 {
        let run = whitespace(text, start);
        return match run.after_last_newline {
            Some(end) => end,                                       // \s*[\r\n]+
            None if run.end == text.len() || run.single => run.end, // \s+(?!\S) at the end; \s+
            None => run.last_start,                                 // \s+(?!\S)
        };
    }
    after_prefix // not reached: every character starts one of the alternatives
}

/// cl100k_base's pattern:
/// ```text
/// '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+
/// |\s++$|\s*[\r\n]|\s+(?!\S)|\s
/// ```
pub(super) fn cl100k_piece_end(text: &[u8], start: usize) -> usize {
    if let Some(end) = contraction_end(text, start) {
        return end;
    }
    if let Some(end) =
        ascii_word_start(text, start).and_then(|letters| ascii_run_end(text, letters, u8::is_ascii_alphabetic))
    {
        return end;
    }
    let (first, first_len) = char_at(text, start);
    // The prefix is possessive: once taken it is not given back.
    let letters_start = if is_word_prefix(first, text, start) { start + first_len } else { start };
    let letters_end = run_end(text, letters_start, LETTER);
    if letters_end > letters_start {
        return letters_end;
    }
    if first & NUMBER != 0 {
        return numbers_end(text, start);
    }
    if let Some(end) = punctuation_end(text, start, b"\r\n") {
        return end;
    }
    if first & SPACE != 0 {
        let run = whitespace(text, start);
        return match run.after_last_newline {
            _ if run.end == text.len() => run.end, // \s++$
            Some(end) => end,                      // \s*[\r\n]
            None if run.single => run.end,         // \s
            None => run.last_start,                // \s+(?!\S)
        };
    }
    start + first_len // not reached: every character starts one of the alternatives
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The classes build.rs packed are the regex crate's, for every code point.
    #[cfg(not(target_arch = "wasm32"))]
    #[test]
    fn every_code_point_has_the_regex_crates_classes() {
        use super::super::oracle_tests::class_ranges;
        let mut expected = vec![0u8; 0x11_0000];
        for (class, bit) in [
            (r"\p{L}", LETTER),
            (r"\p{N}", NUMBER),
            (r"\s", SPACE),
            (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", UPPER_LIKE),
            (r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", LOWER_LIKE),
        ] {
            for (first, last) in class_ranges(class) {
                expected[first as usize..=last as usize].iter_mut().for_each(|bits| *bits |= bit);
            }
        }
        let mut utf8 = [0u8; 4];
        for c in (0..=0x10ffff).filter_map(char::from_u32) {
            let encoded = c.encode_utf8(&mut utf8).as_bytes();
            assert_eq!(char_at(encoded, 0), (expected[c as usize], encoded.len()), "U+{:04X}", c as u32);
        }
    }

    fn pieces(text: &str, piece_end: fn(&[u8], usize) -> usize) -> Vec<&str> {
        let mut pieces = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let end = piece_end(text.as_bytes(), start);
            pieces.push(&text[start..end]);
            start = end;
        }
        pieces
    }

    #[test]
    fn o200k_pieces() {
        let cases: &[(&str, &[&str])] = &[
            ("Hello world", &["Hello", " world"]),
            ("don't STOP", &["don't", " STOP"]),
            ("HELLOworld aB", &["HELLOworld", " a", "B"]),
            ("12345", &["123", "45"]),
            ("  x", &[" ", " x"]),
            ("a  \n\n b", &["a", "  \n\n", " b"]),
            ("end  ", &["end", "  "]),
            ("x !!\n/y", &["x", " !!\n/", "y"]),
            ("\t HELLO—", &["\t", " HELLO", "—"]),
            ("naïve Añb", &["naïve", " Añb"]),
        ];
        for (text, expected) in cases {
            assert_eq!(pieces(text, o200k_piece_end), *expected, "{text:?}");
        }
    }

    #[test]
    fn cl100k_pieces() {
        let cases: &[(&str, &[&str])] = &[
            ("don't", &["don", "'t"]),
            ("'Sup", &["'S", "up"]),
            ("12345", &["123", "45"]),
            ("a \n  ", &["a", " \n  "]),
            ("a \n  b", &["a", " \n", " ", " b"]),
        ];
        for (text, expected) in cases {
            assert_eq!(pieces(text, cl100k_piece_end), *expected, "{text:?}");
        }
    }
}
