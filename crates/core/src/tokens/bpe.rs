//! The vocabularies, embedded as tables `build.rs` wrote (nothing is built when a VM
//! starts), and the byte-pair merge that counts the tokens of one pre-tokenized piece.

use super::layout::{
    entry_tag, home_slot, long_token_hash, long_words, short_token_hash, short_word, EMPTY_SLOT, RANK_MASK, SHORT_TOKEN,
};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// One encoding's ordinary tokens (see layout.rs): `index`, an open-addressing hash table
/// of `1 << index_bits` little-endian u32 entries, which no probe reads more than
/// `max_probes` of; `words`, a little-endian u64 per rank holding a short token's bytes or
/// where a long one's are in `long_tokens`.
pub(super) struct Vocabulary {
    pub index_bits: u32,
    pub max_probes: usize,
    /// The longest token, in bytes: a longer string is no token.
    pub longest: usize,
    pub index: &'static [u8],
    pub words: &'static [u8],
    pub long_tokens: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/vocabularies.rs"));

type Rank = u32;
const NO_RANK: Rank = Rank::MAX;

/// Pieces up to this many bytes are merged in arrays on the stack.
const SHORT_PIECE: usize = 64;

fn u32_at(table: &[u8], at: usize) -> Option<u32> {
    let word = table.get(at * 4..at * 4 + 4)?;
    Some(u32::from_le_bytes(word.try_into().ok()?))
}

fn u64_at(table: &[u8], at: usize) -> Option<u64> {
    let word = table.get(at * 8..at * 8 + 8)?;
    Some(u64::from_le_bytes(word.try_into().ok()?))
}

impl Vocabulary {
    /// The rank of the token whose bytes are `key`, if it is one.
    #[inline]
    pub fn rank(&self, key: &[u8]) -> Option<Rank> {
        if key.len() <= SHORT_TOKEN {
            let word = short_word(key);
            self.find(short_token_hash(word, key.len()), key.len(), |rank| {
                u64_at(self.words, rank as usize) == Some(word)
            })
        } else {
            self.long_rank(key)
        }
    }

    #[inline(never)]
    fn long_rank(&self, key: &[u8]) -> Option<Rank> {
        if key.len() > self.longest {
            return None;
        }
        // Compared 8 bytes at a time: a slice comparison is a byte loop in wasm.
        let is_key = |rank: Rank| {
            let start = u64_at(self.words, rank as usize).unwrap_or(u64::MAX) as usize;
            self.long_tokens
                .get(start..start.saturating_add(key.len()))
                .is_some_and(|token| long_words(token).eq(long_words(key)))
        };
        self.find(long_token_hash(key), key.len(), is_key)
    }

    /// The probe for a string of `len` bytes (1 or more) and this hash: `is_key` tells
    /// whether a candidate rank is the string's.
    #[inline(always)]
    fn find(&self, hash: u64, len: usize, is_key: impl Fn(Rank) -> bool) -> Option<Rank> {
        if len == 0 {
            return None;
        }
        let tag = entry_tag(hash, len);
        let mask = (1usize << self.index_bits) - 1;
        let mut slot = home_slot(hash, self.index_bits);
        for _ in 0..self.max_probes {
            let entry = u32_at(self.index, slot)?;
            if entry == EMPTY_SLOT {
                return None;
            }
            if entry & !RANK_MASK == tag && is_key(entry & RANK_MASK) {
                return Some(entry & RANK_MASK);
            }
            slot = (slot + 1) & mask;
        }
        None
    }

    fn pair_rank(&self, piece: &[u8], start: usize, end: usize) -> Rank {
        piece.get(start..end).and_then(|key| self.rank(key)).unwrap_or(NO_RANK)
    }

    /// Tokens tiktoken encodes `piece` (one pre-tokenized piece) into: one if the piece is
    /// a token, else the parts left when adjacent parts are merged, lowest-ranked pair
    /// first and leftmost among equals, until no adjacent pair is a token.
    pub fn count_piece(&self, piece: &[u8]) -> u64 {
        if piece.len() <= 1 || self.rank(piece).is_some() {
            return piece.len().min(1) as u64;
        }
        if piece.len() <= SHORT_PIECE {
            self.merge_short(piece)
        } else {
            self.merge_long(piece)
        }
    }

    /// The merge over arrays on the stack: a scan for the lowest rank per merge is
    /// cheapest while pieces are short, which nearly all are.
    fn merge_short(&self, piece: &[u8]) -> u64 {
        // starts[i] is where part i begins (starts[parts] == piece.len());
        // ranks[i] is the rank of parts i and i + 1 together.
        let mut starts = [0u8; SHORT_PIECE + 1];
        let mut ranks = [NO_RANK; SHORT_PIECE];
        let mut parts = piece.len().min(SHORT_PIECE);
        for (at, start) in starts.iter_mut().enumerate() {
            *start = at as u8;
        }
        for (at, rank) in ranks.iter_mut().enumerate().take(parts - 1) {
            *rank = self.pair_rank(piece, at, at + 2);
        }
        let bound = |starts: &[u8], part: usize| starts.get(part).map_or(piece.len(), |&start| usize::from(start));
        loop {
            // The first of equal minima: the leftmost.
            let (mut at, mut rank) = (0, NO_RANK);
            for (candidate, &candidate_rank) in ranks.iter().take(parts - 1).enumerate() {
                if candidate_rank < rank {
                    (at, rank) = (candidate, candidate_rank);
                }
            }
            if rank == NO_RANK {
                return parts as u64;
            }
            // Part at + 1 joins part at.
            remove(&mut starts, at + 1, parts + 1);
            remove(&mut ranks, at + 1, parts);
            parts -= 1;
            let joined = if at + 1 < parts {
                self.pair_rank(piece, bound(&starts, at), bound(&starts, at + 2))
            } else {
                NO_RANK
            };
            if let Some(slot) = ranks.get_mut(at) {
                *slot = joined;
            }
            if let Some(before) = at.checked_sub(1) {
                let joined = self.pair_rank(piece, bound(&starts, before), bound(&starts, at + 1));
                if let Some(slot) = ranks.get_mut(before) {
                    *slot = joined;
                }
            }
        }
    }

    /// The same merge for long pieces, in O(n log n) time: a heap of candidate merges
    /// ordered by (rank, start), where an entry a later merge made stale is skipped when it
    /// comes up. A part is named by the offset it starts at.
    fn merge_long(&self, piece: &[u8]) -> u64 {
        // Falls back to a token per byte only if the bookkeeping below broke, which it
        // cannot: every offset it reads is below the piece's length.
        self.try_merge_long(piece).unwrap_or(piece.len() as u64)
    }

    fn try_merge_long(&self, piece: &[u8]) -> Option<u64> {
        let len = piece.len();
        // end[s]: where the part starting at s ends; prev[s]: where the part before it
        // starts; rank[s]: the rank of the part at s joined with the next, NO_RANK if there
        // is none or s no longer starts a part.
        let mut end: Vec<u32> = (1..=len as u32).collect();
        let mut prev: Vec<u32> = (0..len as u32).map(|start| start.saturating_sub(1)).collect();
        let mut rank: Vec<Rank> = (0..len).map(|start| self.pair_rank(piece, start, start + 2)).collect();
        let candidate = |start: usize, rank: Rank| Reverse((u64::from(rank) << 32) | start as u64);
        let mut heap: BinaryHeap<_> = rank
            .iter()
            .enumerate()
            .filter(|&(_, &rank)| rank != NO_RANK)
            .map(|(start, &rank)| candidate(start, rank))
            .collect();
        let mut parts = len as u64;
        while let Some(Reverse(merge)) = heap.pop() {
            let (merge_rank, left) = ((merge >> 32) as Rank, (merge & 0xffff_ffff) as usize);
            if rank.get(left) != Some(&merge_rank) {
                continue; // stale: a merge since changed the part at `left` or its neighbour
            }
            let right = *end.get(left)? as usize;
            let right_end = *end.get(right)? as usize;
            *end.get_mut(left)? = right_end as u32;
            *rank.get_mut(right)? = NO_RANK;
            parts -= 1;
            let joined = match end.get(right_end) {
                Some(&next_end) => {
                    *prev.get_mut(right_end)? = left as u32;
                    self.pair_rank(piece, left, next_end as usize)
                }
                None => NO_RANK, // the last part
            };
            *rank.get_mut(left)? = joined;
            if joined != NO_RANK {
                heap.push(candidate(left, joined));
            }
            if left > 0 {
                let before = *prev.get(left)? as usize;
                let joined = self.pair_rank(piece, before, right_end);
                *rank.get_mut(before)? = joined;
                if joined != NO_RANK {
                    heap.push(candidate(before, joined));
                }
            }
        }
        Some(parts)
    }
}

/// Removes `items[at]` of the first `len`, moving the ones after it one place left (the
/// last stays as it was).
fn remove<T: Copy>(items: &mut [T], at: usize, len: usize) {
    if let Some(tail) = items.get_mut(at..len).filter(|tail| !tail.is_empty()) {
        tail.copy_within(1.., 0);
    }
}
