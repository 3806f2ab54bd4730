//! Writes the tokenizer's tables into OUT_DIR so that a VM starts with them in its data
//! segment and builds nothing at run time:
//!
//! - the character classes the pre-tokenizers test (letters, numbers, whitespace and
//!   o200k's two cased classes), taken from regex-syntax, the crate that defines what
//!   `\p{L}` and `\s` mean for tiktoken's own regexes: the same Unicode tables;
//! - each linked vocabulary (cargo features `o200k`, `cl100k`), read through tiktoken-rs,
//!   which ships OpenAI's vocabulary files: an open-addressing hash index from token
//!   bytes to rank, and each token's bytes by rank.
//!
//! The formats are in src/tokens/layout.rs, shared with the reader.

use std::collections::HashMap;
use std::path::Path;

#[allow(dead_code)] // the reader's half of the layout
#[path = "src/tokens/layout.rs"]
mod layout;

use layout::{entry_tag, home_slot, short_word, token_hash, EMPTY_SLOT, LONGEST_TOKEN, RANK_MASK, SHORT_TOKEN};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/tokens/layout.rs");
    let out_dir = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    let out = Path::new(&out_dir);

    char_classes(out);
    let mut source = String::from("// Written by build.rs: the linked vocabularies.\n");
    if std::env::var_os("CARGO_FEATURE_O200K").is_some() {
        let bpe = tiktoken_rs::o200k_base().expect("tiktoken-rs builds o200k_base");
        source += &vocabulary(out, "o200k_base", &bpe);
    }
    if std::env::var_os("CARGO_FEATURE_CL100K").is_some() {
        let bpe = tiktoken_rs::cl100k_base().expect("tiktoken-rs builds cl100k_base");
        source += &vocabulary(out, "cl100k_base", &bpe);
    }
    std::fs::write(out.join("vocabularies.rs"), source).expect("write vocabularies.rs");
}

/// The code points of a regex class such as `\p{Lu}`, as regex-syntax defines it.
fn class_members(pattern: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let hir = regex_syntax::Parser::new().parse(pattern).expect("a valid class");
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => {
            class.ranges().iter().map(|range| (u32::from(range.start()), u32::from(range.end()))).collect()
        }
        other => panic!("{pattern} is not a Unicode class: {other:?}"),
    }
}

/// A class byte per code point, stored as an index of one row number per CLASS_BLOCK code
/// points and the distinct rows. Row 0 is the ASCII block, so an ASCII byte's class is
/// `rows[byte]`. Writes them and char_classes.rs, the Rust source that embeds them.
fn char_classes(out: &Path) {
    let mut classes = vec![0u8; 0x11_0000];
    for (pattern, bit) in [
        (r"\p{L}", layout::LETTER),
        (r"\p{N}", layout::NUMBER),
        (r"\s", layout::SPACE),
        (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", layout::UPPER_LIKE),
        (r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]", layout::LOWER_LIKE),
    ] {
        for (first, last) in class_members(pattern) {
            for class in &mut classes[first as usize..=last as usize] {
                *class |= bit;
            }
        }
    }
    // The pre-tokenizers rely on these classes being disjoint.
    for (code, &class) in classes.iter().enumerate() {
        let kinds = [layout::LETTER, layout::NUMBER, layout::SPACE].iter().filter(|&&bit| class & bit != 0).count();
        assert!(kinds <= 1, "U+{code:04X} is in more than one of \\p{{L}}, \\p{{N}}, \\s");
    }
    let mut rows: Vec<&[u8]> = Vec::new();
    let mut row_of: HashMap<&[u8], u8> = HashMap::new();
    let mut index = Vec::new();
    for block in classes.chunks(layout::CLASS_BLOCK) {
        let row = *row_of.entry(block).or_insert_with(|| {
            rows.push(block);
            u8::try_from(rows.len() - 1).expect("at most 256 distinct blocks of character classes")
        });
        index.push(row);
    }
    std::fs::write(out.join("class_index.bin"), &index).expect("write class_index.bin");
    std::fs::write(out.join("class_rows.bin"), rows.concat()).expect("write class_rows.bin");
    let source = "// Written by build.rs: the character classes.\n\
        static CLASS_INDEX: &[u8] = include_bytes!(concat!(env!(\"OUT_DIR\"), \"/class_index.bin\"));\n\
        static CLASS_ROWS: &[u8] = include_bytes!(concat!(env!(\"OUT_DIR\"), \"/class_rows.bin\"));\n";
    std::fs::write(out.join("char_classes.rs"), source).expect("write char_classes.rs");
}

/// The ordinary tokens of `bpe` (special tokens excluded) as tables, and the Rust source
/// of the `Vocabulary` static that embeds them.
fn vocabulary(out: &Path, name: &str, bpe: &tiktoken_rs::CoreBPE) -> String {
    let special: Vec<u32> = bpe.special_tokens().iter().flat_map(|text| bpe.encode_with_special_tokens(text)).collect();
    // Ordinary ranks are 0..n with no gap; the special tokens come after them.
    let tokens: Vec<Vec<u8>> = (0u32..).map_while(|rank| bpe.decode_bytes(&[rank]).ok()).collect();
    let count = tokens.len() as u32;
    assert!(count > 1000, "{name}: only {count} tokens");
    assert!(special.iter().all(|&rank| rank >= count), "{name}: a special token among the ordinary ranks");
    assert!(count < RANK_MASK, "{name}: ranks do not fit the index entry");

    let longest = tokens.iter().map(Vec::len).max().unwrap_or(0);
    assert!(longest <= LONGEST_TOKEN, "{name}: a token of {longest} bytes does not fit the index entry");

    let mut words = Vec::with_capacity(tokens.len() * 8);
    let mut long_tokens = Vec::new();
    for token in &tokens {
        let word = if token.len() <= SHORT_TOKEN { short_word(token) } else { long_tokens.len() as u64 };
        if token.len() > SHORT_TOKEN {
            long_tokens.extend_from_slice(token);
        }
        words.extend_from_slice(&word.to_le_bytes());
    }

    // Load at most 1/2: a miss (most lookups while merging are misses) probes a slot or two.
    let index_bits = (f64::from(count) / 0.5).log2().ceil() as u32;
    let mask = (1usize << index_bits) - 1;
    let mut index = vec![EMPTY_SLOT; 1 << index_bits];
    for (rank, token) in tokens.iter().enumerate() {
        let hash = token_hash(token);
        let mut slot = home_slot(hash, index_bits);
        while index[slot] != EMPTY_SLOT {
            slot = (slot + 1) & mask;
        }
        index[slot] = entry_tag(hash, token.len()) | rank as u32;
    }
    // A probe ends at a free slot, so it reads at most the longest run of full slots and
    // the free one after it.
    let mut max_probes = 0;
    let mut run = 0;
    for slot in 0..2 * index.len() {
        run = if index[slot & mask] == EMPTY_SLOT { 0 } else { run + 1 };
        max_probes = max_probes.max(run + 1);
    }
    let index: Vec<u8> = index.iter().flat_map(|entry| entry.to_le_bytes()).collect();
    for (part, data) in [("index", &index), ("words", &words), ("long_tokens", &long_tokens)] {
        std::fs::write(out.join(format!("{name}_{part}.bin")), data).expect("write a vocabulary table");
    }
    let file = |part: &str| format!("include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{name}_{part}.bin\"))");
    format!(
        "pub(super) static {static_name}: Vocabulary = Vocabulary {{ index_bits: {index_bits}, max_probes: {max_probes}, \
         longest: {longest}, index: {index}, words: {words}, long_tokens: {long_tokens} }};\n",
        static_name = name.to_uppercase(),
        index = file("index"),
        words = file("words"),
        long_tokens = file("long_tokens"),
    )
}
