//! Our counter against tiktoken-rs's `count_ordinary` (which equals OpenAI's tiktoken:
//! the same vendored code and regexes) on random and generated text. Native only: the
//! oracle's fancy-regex needs no more than std, but proptest needs OS randomness.

use super::{Encoding, LONG_PIECE};
use proptest::prelude::*;

const ENCODINGS: [Encoding; 2] = [Encoding::O200kBase, Encoding::Cl100kBase];

fn oracle(encoding: Encoding, text: &str) -> u64 {
    let bpe = match encoding {
        Encoding::O200kBase => tiktoken_rs::o200k_base_singleton(),
        Encoding::Cl100kBase => tiktoken_rs::cl100k_base_singleton(),
    };
    bpe.count_ordinary(text) as u64
}

fn assert_counts_as_tiktoken(text: &str) {
    for encoding in ENCODINGS {
        let (ours, theirs) = (encoding.count(text), oracle(encoding, text));
        if ours != theirs {
            panic!(
                "{}: {ours} tokens, tiktoken {theirs}, in {}",
                encoding.name(),
                smallest_differing_line(encoding, text)
            );
        }
    }
}

/// The shortest line (or the whole text) on which the two counts differ, for the message.
fn smallest_differing_line(encoding: Encoding, text: &str) -> String {
    let line = text
        .split_inclusive('\n')
        .filter(|line| encoding.count(line) != oracle(encoding, line))
        .min_by_key(|line| line.len())
        .unwrap_or(text);
    format!("{line:?}")
}

/// Pieces of text where the pre-tokenizers' alternatives meet: letters of every case
/// class and script, marks, numbers of every kind, whitespace of every kind, contractions,
/// punctuation, symbols, emoji, special-token text.
const FRAGMENTS: &[&str] = &[
    "a",
    "Z",
    "hello",
    "World",
    "HELLO",
    "camelCase",
    "PascalCase",
    "x",
    "I",
    "s",
    "'s",
    "'S",
    "'t",
    "'re",
    "'RE",
    "'ve",
    "'m",
    "'ll",
    "'Ll",
    "'d",
    "'ſ",
    "'",
    "’s",
    "''",
    "0",
    "7",
    "12",
    "123",
    "4567",
    "3.14",
    "1,000",
    "٣",
    "१२",
    "１２",
    "½",
    "²",
    "Ⅻ",
    "〇",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "\r",
    "\n\n",
    " \n",
    "\u{b}",
    "\u{c}",
    "\u{85}",
    "\u{a0}",
    "\u{1680}",
    "\u{2003}",
    "\u{2028}",
    "\u{2029}",
    "\u{202f}",
    "\u{205f}",
    "\u{3000}",
    "\u{200b}",
    "\u{feff}",
    "!",
    "?",
    ".",
    ",",
    ";",
    ":",
    "-",
    "_",
    "/",
    "//",
    "\\",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "\"",
    "@",
    "#",
    "$",
    "%",
    "^",
    "&",
    "*",
    "+",
    "=",
    "<",
    ">",
    "|",
    "~",
    "`",
    "...",
    "—",
    "«",
    "»",
    "€",
    "™",
    "©",
    "°",
    "→",
    "─",
    "■",
    "é",
    "É",
    "ß",
    "ẞ",
    "ñ",
    "\u{301}",
    "e\u{301}",
    "\u{308}",
    "\u{20dd}",
    "\u{5bf}",
    "\u{93f}",
    "ǅ",
    "ǈ",
    "ʰ",
    "ˆ",
    "ー",
    "々",
    "ſ",
    "K",
    "Å",
    "ﬁ",
    "İ",
    "ı",
    "Σ",
    "ς",
    "你好",
    "世界",
    "東京",
    "カタカナ",
    "ひらがな",
    "한국어",
    "Здравствуй",
    "мир",
    "Ελληνικά",
    "مرحبا",
    "שלום",
    "नमस्ते",
    "ไทย",
    "ᏣᎳᎩ",
    "ⴰ",
    "😀",
    "🎉",
    "👩\u{200d}👩\u{200d}👧",
    "🇫🇷",
    "✔\u{fe0f}",
    "🚀",
    "\u{1f3fb}",
    "𝔸",
    "𝟙",
    "𐐀",
    "𐐨",
    "<|endoftext|>",
    "<|endofprompt|>",
    "<|fim_prefix|>",
    "https://",
    "snake_case",
    "kebab-case",
    "\u{0}",
    "\u{7f}",
    "\u{ad}",
    "\u{e000}",
    "\u{10ffff}",
    "\u{e0041}",
];

fn fragment() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => proptest::sample::select(FRAGMENTS).prop_map(String::from),
        1 => any::<char>().prop_map(String::from),
        1 => "[ \t\n]{2,6}",
        1 => "[a-zA-Z]{1,12}",
        1 => "[!-/:-@]{1,5}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_text_counts_as_tiktoken(parts in proptest::collection::vec(fragment(), 0..24)) {
        assert_counts_as_tiktoken(&parts.concat());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Long pieces take the heap merge rather than the one on the stack.
    #[test]
    fn long_pieces_count_as_tiktoken(part in "[a-zA-Z]{1,4}|[!-/]{1,3}|é|東|\\s", times in 10usize..300) {
        assert_counts_as_tiktoken(&part.repeat(times));
    }
}

/// Code points in a few contexts each (after a letter, a capital, a space, an apostrophe,
/// a digit, a newline; doubled; before a contraction): every one below U+0800 (Latin,
/// Greek, Cyrillic, Hebrew, Arabic and their marks), every one where a class of the
/// patterns begins or ends (as the regex crate defines them) and every 127th. (The class
/// of every code point is checked in pretokenize's tests.)
#[test]
fn characters_count_as_tiktoken() {
    let mut codes: std::collections::BTreeSet<u32> = (0..0x800).chain((0..=0x10ffff).step_by(127)).collect();
    for class in [r"\p{L}", r"\p{N}", r"\s", r"\p{Lu}", r"\p{Ll}", r"\p{Lt}", r"\p{Lm}", r"\p{Lo}", r"\p{M}"] {
        for (first, last) in class_ranges(class) {
            codes.extend([first.saturating_sub(1), first, last, last + 1]);
        }
    }
    let chars: Vec<char> = codes.into_iter().filter_map(char::from_u32).collect();
    for block in chars.chunks(512) {
        let mut text = String::new();
        for &c in block {
            for context in ["a", "A", " ", "'", "1", "\n"] {
                text.push_str(context);
                text.push(c);
            }
            text.push(c);
            text.push_str("'s ");
        }
        assert_counts_as_tiktoken(&text);
    }
}

/// The code point ranges of a regex class such as `\p{L}`, as the regex crate defines it.
pub(super) fn class_ranges(class: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let hir = regex_syntax::Parser::new().parse(class).expect("a class");
    let HirKind::Class(Class::Unicode(class)) = hir.kind() else { panic!("not a Unicode class") };
    class.iter().map(|range| (u32::from(range.start()), u32::from(range.end()))).collect()
}

/// A large text from a fixed walk over the fragments, as one string and line by line.
#[test]
fn a_large_generated_text_counts_as_tiktoken() {
    let mut state = 12345u64;
    let mut text = String::new();
    while text.len() < 150_000 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        text.push_str(FRAGMENTS[(state >> 33) as usize % FRAGMENTS.len()]);
    }
    assert_counts_as_tiktoken(&text);
}

#[test]
fn a_piece_as_long_as_the_long_piece_bound_counts_as_tiktoken() {
    assert_counts_as_tiktoken(&"ab".repeat(LONG_PIECE / 2));
}

/// The pre-tokenizers test contraction letters with ASCII case and ſ; that must be the
/// regex crate's case-insensitive class for each letter.
#[test]
fn contraction_letters_fold_as_the_regex_crate_folds_them() {
    for letter in "stmdrevl".chars() {
        let folded: Vec<u32> =
            class_ranges(&format!("(?i){letter}")).into_iter().flat_map(|(first, last)| first..=last).collect();
        let mut ours = vec![u32::from(letter.to_ascii_uppercase()), u32::from(letter)];
        if letter == 's' {
            ours.push(u32::from('ſ'));
        }
        assert_eq!(folded, ours, "(?i){letter}");
    }
}

#[test]
fn the_o200k_pattern_is_the_one_written_out() {
    // pretokenize::o200k_piece_end follows this pattern; a new tiktoken-rs with another
    // pattern must fail here (cl100k's is not exported; the tests above guard it).
    assert_eq!(
        tiktoken_rs::O200K_BASE_PAT_STR,
        concat!(
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
    );
}
