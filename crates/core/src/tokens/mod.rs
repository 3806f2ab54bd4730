//! Prompt and completion token counting with OpenAI's BPE encodings, and the choice of
//! encoding for a model.
//!
//! Counts equal OpenAI's tiktoken (`count_ordinary`: special-token text is ordinary text).
//! The counter is our own: the pre-tokenizer regexes written out by hand
//! (`pretokenize`) and the byte-pair merge over vocabularies that `build.rs` turns into
//! tables embedded in the binary (`bpe`), so that a VM builds nothing when it starts and
//! the filter links no regex engine. tiktoken-rs, which ships OpenAI's vocabulary files,
//! is only read at build time and is the oracle of the tests.
//!
//! Only the vocabularies of the cargo features `o200k` and `cl100k` are linked.

mod bpe;
mod layout;
#[cfg(all(test, not(target_arch = "wasm32")))]
mod oracle_tests;
mod pretokenize;
pub mod prompt_cache;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// GPT-4o, GPT-4.1, GPT-4.5, GPT-5, o-series, gpt-oss.
    O200kBase,
    /// GPT-4, GPT-3.5, text-embedding-3 and ada-002.
    Cl100kBase,
}

impl Encoding {
    pub fn name(self) -> &'static str {
        match self {
            Encoding::O200kBase => "o200k_base",
            Encoding::Cl100kBase => "cl100k_base",
        }
    }

    /// Whether this build links the vocabulary.
    pub fn available(self) -> bool {
        match self {
            Encoding::O200kBase => cfg!(feature = "o200k"),
            Encoding::Cl100kBase => cfg!(feature = "cl100k"),
        }
    }

    /// Tokens in `text`, special-token text counted as ordinary text (as it is billed when
    /// a user sends it). Zero for an encoding the build lacks (config validation refuses
    /// those, so this does not happen in a running filter).
    pub fn count(self, text: &str) -> u64 {
        match self {
            #[cfg(feature = "o200k")]
            Encoding::O200kBase => count_pieces(text.as_bytes(), &bpe::O200K_BASE, pretokenize::o200k_piece_end),
            #[cfg(feature = "cl100k")]
            Encoding::Cl100kBase => count_pieces(text.as_bytes(), &bpe::CL100K_BASE, pretokenize::cl100k_piece_end),
            #[allow(unreachable_patterns)]
            _ => 0,
        }
    }

    /// Touches the tables before the first request does. There is nothing to build: the
    /// vocabularies are in the module's data.
    pub fn warm_up(self) {
        self.count("warm up");
    }
}

/// Longest piece merged whole. The merge takes O(n log n) time and at most 28 bytes of
/// memory per byte of a piece (under 2 MB at this bound). A longer piece, a run of 64 KiB
/// of letters, whitespace or punctuation without a break, which no real text has, is
/// counted in slices of this size, which can differ from tiktoken by a token per slice.
/// (tiktoken-rs's own regex overflows an 8 MB stack on 1.2 million spaces.)
const LONG_PIECE: usize = 64 << 10;

fn count_pieces(text: &[u8], vocabulary: &bpe::Vocabulary, piece_end: impl Fn(&[u8], usize) -> usize) -> u64 {
    let mut total = 0;
    let mut start = 0;
    while start < text.len() {
        // piece_end always moves forward within the text; the clamp only makes that
        // certain.
        let end = piece_end(text, start).clamp(start + 1, text.len());
        let mut piece = text.get(start..end).unwrap_or_default();
        while piece.len() > LONG_PIECE {
            let Some((slice, rest)) = piece.split_at_checked(char_boundary_before(piece, LONG_PIECE)) else {
                break;
            };
            total += vocabulary.count_piece(slice);
            piece = rest;
        }
        total += vocabulary.count_piece(piece);
        start = end;
    }
    total
}

/// The last character boundary of UTF-8 `text` at or before `at`, but at least 1.
fn char_boundary_before(text: &[u8], at: usize) -> usize {
    let is_continuation = |at: usize| text.get(at).is_some_and(|byte| byte & 0xc0 == 0x80);
    (1..=at).rev().find(|&at| !is_continuation(at)).unwrap_or(at)
}

/// How a model's tokens are counted and capped.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRule {
    /// Model name, with `*` matching any run of characters (`gpt-4o*`, `*-mini`).
    #[serde(rename = "match")]
    pub pattern: String,
    pub encoding: Encoding,
    /// Multiplies counted prompt tokens: for providers whose tokenizer is not OpenAI's.
    #[serde(default = "one")]
    pub factor: f64,
    /// Output cap assumed when the request sets none.
    #[serde(default)]
    pub max_output: Option<u64>,
}

fn one() -> f64 {
    1.0
}

/// One of OpenAI's model families as built in: its rule, and the other patterns its
/// models are also named by. Azure spells GPT-3.5's deployments and models `gpt-35-turbo`:
/// the same family, so one rule, one `model_rule` label and one learned figure, not two.
#[derive(Debug, Clone, PartialEq)]
pub struct BuiltinFamily {
    pub rule: ModelRule,
    pub also: &'static [&'static str],
}

impl BuiltinFamily {
    /// The family's patterns: its rule's first, then the other spellings.
    pub fn patterns(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.rule.pattern.as_str()).chain(self.also.iter().copied())
    }
}

/// OpenAI's model families, tried after the operator's own rules.
pub fn builtin_families() -> Vec<BuiltinFamily> {
    let family = |pattern: &str, encoding| BuiltinFamily {
        rule: ModelRule { pattern: pattern.into(), encoding, factor: 1.0, max_output: None },
        also: match pattern {
            "gpt-3.5*" => &["gpt-35*"],
            _ => &[],
        },
    };
    let o200k = [
        "gpt-4o*",
        "chatgpt-4o*",
        "gpt-4.1*",
        "gpt-4.5*",
        "gpt-5*",
        "o1*",
        "o3*",
        "o4*",
        "gpt-oss*",
        "gpt-realtime*",
        "gpt-audio*",
    ];
    let cl100k = ["gpt-4*", "gpt-3.5*", "text-embedding-3*", "text-embedding-ada-002*"];
    o200k
        .iter()
        .map(|p| family(p, Encoding::O200kBase))
        .chain(cl100k.iter().map(|p| family(p, Encoding::Cl100kBase)))
        .collect()
}

/// `*` matches any run of characters, everything else itself; case-sensitive.
///
/// On bytes and without allocating: a request matches its model against every rule,
/// price and pattern of the config (a dozen built in), on the charge and on the
/// settlement. Bytes match as characters do: a literal part of valid UTF-8 found in valid
/// UTF-8 starts and ends on character boundaries.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (pattern, text) = (pattern.as_bytes(), text.as_bytes());
    // Most patterns (`gpt-4o*`, `o1*`) turn most models away on their first part: that
    // test comes first and alone, before any of the pattern's other parts is looked for.
    let Some(first_star) = memchr::memchr(b'*', pattern) else {
        return pattern == text; // no `*`: exact match
    };
    let first = pattern.get(..first_star).unwrap_or_default();
    let Some(rest) = text.strip_prefix(first) else { return false };
    let last_star = memchr::memrchr(b'*', pattern).unwrap_or(first_star);
    let last = pattern.get(last_star + 1..).unwrap_or_default();
    // The first part opens the text and the last ends it; the middle parts are found,
    // leftmost first (which leaves the most room for the parts after), in between.
    let Some(mut rest) = rest.strip_suffix(last) else { return false };
    let middle = pattern.get(first_star + 1..last_star).unwrap_or_default();
    for part in middle.split(|&b| b == b'*').filter(|part| !part.is_empty()) {
        match memchr::memmem::find(rest, part) {
            Some(at) => rest = rest.get(at + part.len()..).unwrap_or_default(),
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_run_is_counted_quickly_in_slices() {
        let run = "x".repeat(1_200_000);
        let started = std::time::Instant::now();
        let counted = Encoding::O200kBase.count(&run);
        // Not a speed goal (those live in make bench): a bound that only quadratic work on
        // the run (hours, unoptimised) could pass; the counting takes ~2-6 s here in a
        // test build, depending on the machine's load.
        assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
        // Slices of LONG_PIECE 'x' count as each slice alone counts.
        let slice = Encoding::O200kBase.count(&run[..LONG_PIECE]);
        let rest = Encoding::O200kBase.count(&run[..run.len() % LONG_PIECE]);
        assert_eq!(counted, slice * (run.len() / LONG_PIECE) as u64 + rest);
        assert_eq!(char_boundary_before("ééé".as_bytes(), 3), 2, "cut at a char boundary");
        assert_eq!(char_boundary_before("ééé".as_bytes(), 4), 4);
    }

    #[test]
    fn globs() {
        let cases = [
            ("gpt-4o*", "gpt-4o-mini", true),
            ("gpt-4o*", "gpt-4o", true),
            ("gpt-4o*", "gpt-4", false),
            ("*-mini", "gpt-4o-mini", true),
            ("*-mini", "gpt-4o-mini-2024", false),
            ("gpt-*-mini", "gpt-4o-mini", true),
            ("a*b*c", "abc", true),
            ("a*b*c", "aXbYc", true),
            ("a*b*c", "acb", false),
            ("ab*ba", "aba", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
            ("*", "", true),
        ];
        for (pattern, text, expected) in cases {
            assert_eq!(glob_match(pattern, text), expected, "{pattern} vs {text}");
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    /// The definition, by backtracking: `*` takes any run, everything else itself.
    fn glob_reference(pattern: &[u8], text: &[u8]) -> bool {
        match pattern.split_first() {
            None => text.is_empty(),
            Some((b'*', rest)) => (0..=text.len()).any(|skip| glob_reference(rest, &text[skip..])),
            Some((c, rest)) => text.split_first().is_some_and(|(t, text)| t == c && glob_reference(rest, text)),
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest::proptest! {
        #[test]
        fn glob_match_is_the_definition(pattern in "[ab*]{0,7}", text in "[ab]{0,7}") {
            proptest::prop_assert_eq!(glob_match(&pattern, &text), glob_reference(pattern.as_bytes(), text.as_bytes()));
        }
    }

    #[test]
    fn builtin_rules_put_families_before_prefixes_they_share() {
        let families = builtin_families();
        let pick =
            |model: &str| families.iter().find(|f| f.patterns().any(|p| glob_match(p, model))).map(|f| f.rule.encoding);
        assert_eq!(pick("gpt-4o-mini"), Some(Encoding::O200kBase));
        assert_eq!(pick("gpt-4.1-nano"), Some(Encoding::O200kBase));
        assert_eq!(pick("gpt-4-turbo"), Some(Encoding::Cl100kBase));
        assert_eq!(pick("o3-mini"), Some(Encoding::O200kBase));
        assert_eq!(pick("text-embedding-3-small"), Some(Encoding::Cl100kBase));
        assert_eq!(pick("claude-sonnet-4-5"), None);
        // Azure's spelling of GPT-3.5 is that family, not a family of its own.
        let family_of = |model: &str| families.iter().position(|f| f.patterns().any(|p| glob_match(p, model)));
        assert_eq!(family_of("gpt-35-turbo"), family_of("gpt-3.5-turbo"));
        assert_eq!(pick("gpt-35-turbo-16k"), Some(Encoding::Cl100kBase));
    }

    /// Counts from OpenAI's own tiktoken (tests/cases/make_token_counts.py) for a corpus
    /// of prose, code, JSON, CJK, RTL, emoji, numbers and special-token text.
    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn counts_match_openais_tiktoken() {
        #[derive(serde::Deserialize)]
        struct Case {
            text: String,
            o200k_base: u64,
            cl100k_base: u64,
        }
        #[derive(serde::Deserialize)]
        struct Table {
            cases: Vec<Case>,
        }
        let table: Table =
            serde_json::from_str(include_str!("../../../../tests/cases/token_counts.json")).expect("table");
        assert!(table.cases.len() >= 30);
        for case in table.cases {
            assert_eq!(Encoding::O200kBase.count(&case.text), case.o200k_base, "o200k: {:?}", case.text);
            assert_eq!(Encoding::Cl100kBase.count(&case.text), case.cl100k_base, "cl100k: {:?}", case.text);
        }
    }

    #[test]
    fn counts_known_strings() {
        // Checked against OpenAI's tiktoken; tests/cases/token_counts.json holds many more.
        assert_eq!(Encoding::O200kBase.count("hello world"), 2);
        assert_eq!(Encoding::Cl100kBase.count("hello world"), 2);
        assert_eq!(Encoding::O200kBase.count(""), 0);
        assert_eq!(Encoding::Cl100kBase.count("<|endoftext|>"), 7);
    }
}
