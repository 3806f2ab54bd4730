//! What `build.rs`, which writes the tables, and the counter, which reads them, agree on:
//! the character class bits of the pre-tokenizer's table and the vocabulary index's hash
//! and entry format. `build.rs` includes this file.

/// `\p{L}`.
pub const LETTER: u8 = 1;
/// `\p{N}`.
pub const NUMBER: u8 = 2;
/// `\s`: Unicode White_Space.
pub const SPACE: u8 = 4;
/// o200k's `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`, the class a word's capitals are drawn from.
pub const UPPER_LIKE: u8 = 8;
/// o200k's `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`, the class a word's lowercase tail is drawn from.
pub const LOWER_LIKE: u8 = 16;

/// Code points per block of the two-level character class table: the index holds one
/// byte per block naming its (deduplicated) row of class bytes.
pub const CLASS_BLOCK: usize = 128;

/// An index entry holds a token's rank in its low bits, its length less one above them,
/// and a fingerprint of its hash in the top bits, so that a probe rejects nearly every other
/// token without reading it.
pub const RANK_BITS: u32 = 18;
pub const RANK_MASK: u32 = (1 << RANK_BITS) - 1;
pub const LENGTH_BITS: u32 = 7;
/// The longest token an entry can describe.
#[allow(dead_code)] // build.rs checks it
pub const LONGEST_TOKEN: usize = 1 << LENGTH_BITS;
/// A free slot: its rank bits are all ones, which no token has (`build.rs` checks).
pub const EMPTY_SLOT: u32 = u32::MAX;

/// A token's bytes are kept as one little-endian u64 per rank: for a token of up to 8
/// bytes its `short_word`, for a longer one the offset of its bytes in a second table.
pub const SHORT_TOKEN: usize = 8;

/// Up to the first 8 bytes of `bytes` as one integer: for strings of one length up to 8
/// bytes, equal integers mean equal strings (shorter strings are read in overlapping
/// parts, without a loop or a copy).
#[inline(always)]
pub fn short_word(bytes: &[u8]) -> u64 {
    let len = bytes.len();
    let u32_at = |at: usize| {
        bytes.get(at..at + 4).and_then(|b| b.try_into().ok()).map_or(0, |b| u64::from(u32::from_le_bytes(b)))
    };
    let byte = |at: usize| bytes.get(at).map_or(0, |&b| u64::from(b));
    match bytes.first_chunk::<8>() {
        Some(word) => u64::from_le_bytes(*word),
        None if len >= 4 => u32_at(0) | (u32_at(len - 4) << 32),
        None if len > 0 => byte(0) | (byte(len / 2) << 8) | (byte(len - 1) << 16),
        None => 0,
    }
}

/// The 8-byte words of a string longer than 8 bytes: each whole one, then the last 8
/// bytes (overlapping the one before unless the length is a multiple of 8).
pub fn long_words(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    let whole = bytes.chunks_exact(8);
    let last = match whole.remainder() {
        [] => None,
        _ => bytes.last_chunk::<8>().map(|word| u64::from_le_bytes(*word)),
    };
    whole.filter_map(|word| word.first_chunk::<8>()).map(|word| u64::from_le_bytes(*word)).chain(last)
}

const MUL: u64 = 0x9e37_79b9_7f4a_7c15;

/// The finaliser of MurmurHash3: the slot is taken from the top bits, the fingerprint from
/// the low ones, and both must depend on every input bit.
#[inline(always)]
fn mix(mut hash: u64) -> u64 {
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^ (hash >> 33)
}

/// Hash of a string of `len` bytes, at most 8, whose `short_word` is `word`.
#[inline(always)]
pub fn short_token_hash(word: u64, len: usize) -> u64 {
    mix(((len as u64).wrapping_mul(MUL) ^ word).wrapping_mul(MUL))
}

/// Hash of a string longer than 8 bytes.
pub fn long_token_hash(bytes: &[u8]) -> u64 {
    let mut hash = (bytes.len() as u64).wrapping_mul(MUL);
    for word in long_words(bytes) {
        hash = (hash ^ word).wrapping_mul(MUL).rotate_left(27);
    }
    mix(hash)
}

/// Hash of a byte string for the vocabulary index.
#[allow(dead_code)] // build.rs's; the reader calls the two halves itself
pub fn token_hash(bytes: &[u8]) -> u64 {
    if bytes.len() <= 8 {
        short_token_hash(short_word(bytes), bytes.len())
    } else {
        long_token_hash(bytes)
    }
}

/// The slot a token's probe starts at in an index of `1 << index_bits` slots.
pub fn home_slot(hash: u64, index_bits: u32) -> usize {
    (hash >> (64 - index_bits)) as usize
}

/// An entry without its rank: what a probe for a `len`-byte string (1 to LONGEST_TOKEN)
/// of this hash looks for.
pub fn entry_tag(hash: u64, len: usize) -> u32 {
    const FINGERPRINT_MASK: u32 = !((1 << (RANK_BITS + LENGTH_BITS)) - 1);
    ((hash as u32) & FINGERPRINT_MASK) | ((len.wrapping_sub(1) as u32) << RANK_BITS & !FINGERPRINT_MASK)
}
