//! Token counts of long texts, remembered per VM. A chat client resends the whole
//! conversation every turn: on the twentieth turn nineteen of the twenty messages were
//! counted before, and counting is most of what a long prompt costs the filter. A text
//! is looked up by a hash of its bytes, seeded per VM so a client cannot aim a crafted
//! text at another's entry; the table is direct-mapped and fixed in size, so memory does
//! not grow with what clients send, and a miss only costs the count it would have cost.

use crate::tokens::Encoding;

/// Texts shorter than this are counted every time: looking them up costs about as much.
const MIN_CACHED_BYTES: usize = 32;
/// Entries per VM (16 bytes each).
pub const PROMPT_CACHE_SLOTS: usize = 4096;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Slot {
    /// Hash of the text and its encoding; 0: empty.
    hash: u64,
    /// The text's length, checked with the hash.
    len: u32,
    tokens: u32,
}

#[derive(Debug)]
pub struct PromptCache {
    seed: u64,
    slots: Vec<Slot>,
    /// Lookups answered from the table, and long texts counted: what shows the table works
    /// (the tests read them; no metric exports them yet).
    hits: u64,
    misses: u64,
}

impl PromptCache {
    pub fn new(seed: u64) -> PromptCache {
        PromptCache { seed, slots: vec![Slot::default(); PROMPT_CACHE_SLOTS], hits: 0, misses: 0 }
    }

    /// Tokens in `text` under `encoding`, as `Encoding::count` counts them.
    pub fn count(&mut self, encoding: Encoding, text: &str) -> u64 {
        let Ok(len) = u32::try_from(text.len()) else { return encoding.count(text) };
        if text.len() < MIN_CACHED_BYTES {
            return encoding.count(text);
        }
        let hash = self.hash(encoding, text).max(1);
        let index = (hash % PROMPT_CACHE_SLOTS as u64) as usize;
        if let Some(slot) = self.slots.get(index).filter(|s| s.hash == hash && s.len == len) {
            self.hits += 1;
            return u64::from(slot.tokens);
        }
        self.misses += 1;
        let tokens = encoding.count(text);
        if let (Some(slot), Ok(tokens32)) = (self.slots.get_mut(index), u32::try_from(tokens)) {
            *slot = Slot { hash, len, tokens: tokens32 };
        }
        tokens
    }

    /// 64-bit multiply-xorshift over 8-byte words, seeded: a few instructions per word
    /// where counting costs hundreds per word.
    fn hash(&self, encoding: Encoding, text: &str) -> u64 {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        let mix = |h: u64, word: u64| {
            let h = (h ^ word).wrapping_mul(K);
            h ^ (h >> 29)
        };
        let mut h = mix(self.seed ^ K, encoding as u64 + 1);
        let mut words = text.as_bytes().chunks_exact(8);
        for word in &mut words {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(word);
            h = mix(h, u64::from_le_bytes(bytes));
        }
        let mut last = [0u8; 8];
        for (to, from) in last.iter_mut().zip(words.remainder()) {
            *to = *from;
        }
        mix(mix(h, u64::from_le_bytes(last)), text.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long(text: &str) -> String {
        format!("{} {}", text, "long enough to be remembered.".repeat(2))
    }

    #[test]
    fn remembers_long_texts_and_counts_exactly() {
        let mut cache = PromptCache::new(7);
        let text = long("The first message of a conversation");
        let exact = Encoding::O200kBase.count(&text);
        assert_eq!(cache.count(Encoding::O200kBase, &text), exact);
        assert_eq!(cache.count(Encoding::O200kBase, &text), exact);
        assert_eq!((cache.hits, cache.misses), (1, 1));
        // Same text, another encoding: another entry.
        assert_eq!(cache.count(Encoding::Cl100kBase, &text), Encoding::Cl100kBase.count(&text));
        assert_eq!(cache.misses, 2);
        // Short texts are not looked up.
        assert_eq!(cache.count(Encoding::O200kBase, "hello world"), 2);
        assert_eq!((cache.hits, cache.misses), (1, 2));
    }

    #[test]
    fn a_text_in_a_taken_slot_is_counted_not_mistaken() {
        let mut cache = PromptCache::new(1);
        // Far more texts than slots: every answer must still be the exact count.
        for i in 0..(PROMPT_CACHE_SLOTS * 2) {
            let text = long(&format!("message number {i}"));
            assert_eq!(cache.count(Encoding::O200kBase, &text), Encoding::O200kBase.count(&text), "{i}");
        }
        assert_eq!(cache.slots.len(), PROMPT_CACHE_SLOTS, "the table never grows");
        let text = long("message number 1");
        let hash_a = cache.hash(Encoding::O200kBase, &text);
        assert_ne!(hash_a, PromptCache::new(2).hash(Encoding::O200kBase, &text), "the seed changes every hash");
    }
}
