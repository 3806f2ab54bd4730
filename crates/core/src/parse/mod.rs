//! The base parsers: bytes to structure, knowing nothing of APIs or limits. A JSON scanner
//! that reads only what is asked of it, the two streamed framings replies come in (SSE,
//! AWS event stream) and Gemini's streamed JSON array, and the one normalisation of a
//! request path.

pub mod eventstream;
pub(crate) mod json;
pub mod json_array_stream;
pub mod path;
pub mod sse;

/// For testing eight bytes at a time: `ONES` repeats a byte across a word, `HIGHS` is each
/// byte's high bit, and `zero_in(x)` sets the high bit of each byte of `x` that is zero
/// (exactly for the lowest such byte, which is the one searches want).
pub(crate) const ONES: u64 = 0x0101_0101_0101_0101;
pub(crate) const HIGHS: u64 = 0x8080_8080_8080_8080;

pub(crate) fn zero_in(x: u64) -> u64 {
    x.wrapping_sub(ONES) & !x & HIGHS
}

/// The first byte of `bytes` that `matches`, `in_word` testing eight at a time (it sets
/// the high bit of each matching byte of a little-endian word, exactly for the lowest).
pub(crate) fn first_match(bytes: &[u8], in_word: impl Fn(u64) -> u64, matches: impl Fn(u8) -> bool) -> Option<usize> {
    let mut words = bytes.chunks_exact(8);
    let mut at = 0;
    for word in words.by_ref() {
        let mut eight = [0u8; 8];
        eight.copy_from_slice(word);
        let found = in_word(u64::from_le_bytes(eight));
        if found != 0 {
            return Some(at + (found.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    words.remainder().iter().position(|&byte| matches(byte)).map(|i| at + i)
}

/// The first position of `a` or `b` in `bytes`. What `memchr::memchr2` does, but the
/// filter runs as wasm32 without SIMD, where memchr falls back to four bytes a word and a
/// setup per call that the short strings and lines of a reply or stream pay on each search.
pub(crate) fn find2(a: u8, b: u8, bytes: &[u8]) -> Option<usize> {
    let (spread_a, spread_b) = (ONES * u64::from(a), ONES * u64::from(b));
    first_match(bytes, |word| zero_in(word ^ spread_a) | zero_in(word ^ spread_b), |byte| byte == a || byte == b)
}

#[cfg(test)]
mod tests {
    #[cfg(not(target_arch = "wasm32"))]
    use proptest::prelude::*;

    #[cfg_attr(not(target_arch = "wasm32"), test)]
    #[cfg_attr(target_arch = "wasm32", wasm_bindgen_test::wasm_bindgen_test)]
    fn find2_finds_the_first_of_either_byte_at_every_position() {
        for len in 0..40 {
            for at in 0..len {
                for byte in [b'"', b'\\'] {
                    let mut bytes = vec![b'a'; len];
                    bytes[at] = byte;
                    if let Some(later) = bytes.get_mut(at + 3) {
                        *later = b'"';
                    }
                    assert_eq!(super::find2(b'"', b'\\', &bytes), Some(at), "{len} {at}");
                }
            }
            assert_eq!(super::find2(b'"', b'\\', &vec![0x80 | b'"'; len]), None);
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    proptest! {
        #[test]
        fn find2_agrees_with_memchr2(bytes in proptest::collection::vec(any::<u8>(), 0..100), a in any::<u8>(), b in any::<u8>()) {
            prop_assert_eq!(super::find2(a, b, &bytes), memchr::memchr2(a, b, &bytes));
        }
    }
}
