//! Prompt and completion token counting with OpenAI's BPE encodings (tiktoken-rs), and the
//! choice of encoding for a model.
//!
//! Only the vocabularies compiled in (cargo features `o200k`, `cl100k`) are linked: the
//! singletons are referenced one by one, never through `get_bpe_from_model`, which would
//! link every vocabulary. Each is built on first use.

use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
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
        if text.is_empty() {
            return 0;
        }
        // BPE is quadratic in the length of one pre-tokenized piece, and a run without
        // whitespace is one piece: a 1.2 MB prompt of one repeated character took 25 s to
        // count. Such runs are counted in slices of LONG_RUN bytes; text without them is
        // counted whole, exactly as tiktoken does.
        let mut total = 0;
        let mut start = 0;
        for cut in long_run_cuts(text) {
            total += self.count_exactly(text.get(start..cut).unwrap_or(""));
            start = cut;
        }
        total + self.count_exactly(text.get(start..).unwrap_or(""))
    }

    fn count_exactly(self, text: &str) -> u64 {
        if text.is_empty() {
            return 0;
        }
        match self {
            #[cfg(feature = "o200k")]
            Encoding::O200kBase => tiktoken_rs::o200k_base_singleton().count_ordinary(text) as u64,
            #[cfg(feature = "cl100k")]
            Encoding::Cl100kBase => tiktoken_rs::cl100k_base_singleton().count_ordinary(text) as u64,
            #[allow(unreachable_patterns)]
            _ => 0,
        }
    }

    /// Builds the vocabulary now rather than on the first request that needs it.
    pub fn warm_up(self) {
        self.count("warm up");
    }
}

/// Longest run of non-whitespace counted as one piece (see `Encoding::count`).
const LONG_RUN: usize = 512;

/// Byte offsets at which runs of non-whitespace longer than `LONG_RUN` are cut, at char
/// boundaries; none for ordinary text.
fn long_run_cuts(text: &str) -> Vec<usize> {
    let mut cuts = Vec::new();
    if text.len() <= LONG_RUN {
        return cuts; // no run can be longer than the text
    }
    let mut run_start = None;
    for (at, c) in text.char_indices() {
        if c.is_whitespace() {
            run_start = None;
            continue;
        }
        let start = *run_start.get_or_insert(at);
        if at - start >= LONG_RUN {
            cuts.push(at);
            run_start = Some(at);
        }
    }
    cuts
}

/// How a model's tokens are counted and capped.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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

/// OpenAI's model families, tried after the operator's own rules.
pub fn builtin_rules() -> Vec<ModelRule> {
    let rule = |pattern: &str, encoding| ModelRule { pattern: pattern.into(), encoding, factor: 1.0, max_output: None };
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
    let cl100k = ["gpt-4*", "gpt-3.5*", "gpt-35*", "text-embedding-3*", "text-embedding-ada-002*"];
    o200k
        .iter()
        .map(|p| rule(p, Encoding::O200kBase))
        .chain(cl100k.iter().map(|p| rule(p, Encoding::Cl100kBase)))
        .collect()
}

/// `*` matches any run of characters, everything else itself; case-sensitive.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty(); // no `*`: exact match
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_run_without_whitespace_is_counted_quickly_and_closely() {
        let run = "x".repeat(1_200_000);
        let started = std::time::Instant::now();
        let counted = Encoding::O200kBase.count(&run);
        assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
        // Slices of 512 'x' count as tiktoken counts each slice.
        let slice = Encoding::O200kBase.count_exactly(&"x".repeat(LONG_RUN));
        assert_eq!(
            counted,
            slice * (1_200_000 / LONG_RUN) as u64
                + Encoding::O200kBase.count_exactly(&"x".repeat(1_200_000 % LONG_RUN))
        );
        // Ordinary text is never cut.
        assert!(long_run_cuts("hello world, a sentence of ordinary words.").is_empty());
        assert_eq!(long_run_cuts(&"é".repeat(300)), vec![512], "cut at a char boundary");
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

    #[test]
    fn builtin_rules_put_families_before_prefixes_they_share() {
        let rules = builtin_rules();
        let pick = |model: &str| rules.iter().find(|r| glob_match(&r.pattern, model)).map(|r| r.encoding);
        assert_eq!(pick("gpt-4o-mini"), Some(Encoding::O200kBase));
        assert_eq!(pick("gpt-4.1-nano"), Some(Encoding::O200kBase));
        assert_eq!(pick("gpt-4-turbo"), Some(Encoding::Cl100kBase));
        assert_eq!(pick("o3-mini"), Some(Encoding::O200kBase));
        assert_eq!(pick("text-embedding-3-small"), Some(Encoding::Cl100kBase));
        assert_eq!(pick("claude-sonnet-4-5"), None);
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
        let table: Table = serde_json::from_str(include_str!("../../../tests/cases/token_counts.json")).expect("table");
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
