//! Piece hashes are the blob's own sha256 cut at piece boundaries: the hash of piece
//! *i* is SHA-256's chaining value (its internal state) after the blob's bytes up to
//! the end of piece *i*, and the hash of the last piece is the blob's sha256 itself.
//!
//! Why: the whole-blob sha256 is mandatory, and a second hash per piece cost a second
//! pass over every received byte (BENCHMARKS.md, issue 11, "where the receiving
//! peer's CPU goes"). With chaining values a receiver verifies piece *i* by running
//! the compression function from the published value of piece *i − 1* over the
//! piece's bytes while they are still in cache, and the chain of verified pieces that
//! ends in the digest *is* the whole-blob check: one hash pass in all.
//!
//! A piece verifies against the values published by the elected source, exactly as a
//! separate piece hash did. Forging piece *i* for a given pair of values means finding
//! a second preimage of SHA-256's compression function. Whether the published values
//! belong to the digest is proven only when the chain reaches it. That was also true
//! of separate piece hashes, and the blob's digest check still decides at the end.

use sha2::digest::generic_array::GenericArray;
use sha2::digest::typenum::U64;
use sha2::Digest as _;

use crate::pieces::PieceLayout;
use crate::Error;

/// SHA-256's initial state (FIPS 180-4, 5.3.3).
const SHA256_IV: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];
const BLOCK: usize = 64;
/// Blocks compressed per call.
const BATCH: usize = 64;

/// A piece's hash: the blob's SHA-256 chaining value at the piece's end (big-endian
/// words), or for the last piece the blob's sha256 digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PieceHash(pub [u8; 32]);

impl PieceHash {
    /// The hash of `bytes` as a whole one-piece blob: their sha256.
    pub fn of(bytes: &[u8]) -> Self {
        Self(sha2::Sha256::digest(bytes).into())
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(s: &str) -> Result<Self, Error> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)
            .map_err(|e| Error::Hash(format!("piece hash {s:.80}: {e}")))?;
        Ok(Self(out))
    }

    fn from_state(state: &[u32; 8]) -> Self {
        let mut out = [0u8; 32];
        for (chunk, word) in out.chunks_exact_mut(4).zip(state) {
            chunk.copy_from_slice(&word.to_be_bytes());
        }
        Self(out)
    }

    fn to_state(self) -> [u32; 8] {
        let mut state = [0u32; 8];
        for (word, chunk) in state.iter_mut().zip(self.0.chunks_exact(4)) {
            *word = u32::from_be_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
        state
    }
}

impl std::fmt::Debug for PieceHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PieceHash({})", &self.to_hex()[..16])
    }
}

/// A blob's SHA-256 from some block boundary on, whose state can be read at any block
/// boundary and restarted from a published chaining value.
#[derive(Clone)]
pub struct BlobSha256 {
    state: [u32; 8],
    pending: [u8; BLOCK],
    filled: usize,
    /// Bytes of the blob hashed so far, counted from its start.
    offset: u64,
}

impl Default for BlobSha256 {
    fn default() -> Self {
        Self::new()
    }
}

impl BlobSha256 {
    /// From the blob's first byte.
    pub fn new() -> Self {
        Self {
            state: SHA256_IV,
            pending: [0; BLOCK],
            filled: 0,
            offset: 0,
        }
    }

    /// From byte `offset`, the end of a piece whose hash is `chaining`. `None` if
    /// `offset` is not a block boundary (no valid geometry puts a piece end there).
    pub fn resume(offset: u64, chaining: PieceHash) -> Option<Self> {
        offset.is_multiple_of(BLOCK as u64).then(|| Self {
            state: chaining.to_state(),
            pending: [0; BLOCK],
            filled: 0,
            offset,
        })
    }

    /// Bytes of the blob hashed so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        self.offset += bytes.len() as u64;
        if self.filled > 0 {
            let take = (BLOCK - self.filled).min(bytes.len());
            self.pending[self.filled..self.filled + take].copy_from_slice(&bytes[..take]);
            self.filled += take;
            bytes = &bytes[take..];
            if self.filled < BLOCK {
                return;
            }
            sha2::compress256(&mut self.state, &[*GenericArray::from_slice(&self.pending)]);
            self.filled = 0;
        }
        let whole = bytes.len() - bytes.len() % BLOCK;
        // The compression function takes a slice of block arrays, and viewing bytes as
        // one needs `unsafe`: copy up to 4 KiB at a time into an array of blocks (in
        // L1) and compress them in one call, not one call per block, which loads and
        // stores the state around every block (BENCHMARKS.md, issue 11, "chained").
        let mut blocks = [GenericArray::<u8, U64>::default(); BATCH];
        for batch in bytes[..whole].chunks(BATCH * BLOCK) {
            let n = batch.len() / BLOCK;
            for (block, src) in blocks.iter_mut().zip(batch.chunks_exact(BLOCK)) {
                block.copy_from_slice(src);
            }
            sha2::compress256(&mut self.state, &blocks[..n]);
        }
        let rest = &bytes[whole..];
        self.pending[..rest.len()].copy_from_slice(rest);
        self.filled = rest.len();
    }

    /// The chaining value here, if the bytes so far fill whole blocks.
    pub fn chaining_value(&self) -> Option<PieceHash> {
        (self.filled == 0).then(|| PieceHash::from_state(&self.state))
    }

    /// The sha256 of the blob's bytes so far, as if they were the whole blob.
    pub fn finalize(&self) -> PieceHash {
        let mut state = self.state;
        let mut tail = [0u8; 2 * BLOCK];
        tail[..self.filled].copy_from_slice(&self.pending[..self.filled]);
        tail[self.filled] = 0x80;
        let len = if self.filled + 1 + 8 <= BLOCK {
            BLOCK
        } else {
            2 * BLOCK
        };
        tail[len - 8..len].copy_from_slice(&self.offset.wrapping_mul(8).to_be_bytes());
        for block in tail[..len].chunks_exact(BLOCK) {
            sha2::compress256(
                &mut state,
                std::slice::from_ref(GenericArray::from_slice(block)),
            );
        }
        PieceHash::from_state(&state)
    }
}

/// Hashes one piece as its bytes arrive, in order, continuing the blob's sha256 from
/// the hash of the piece before.
#[derive(Clone)]
pub struct PieceHasher {
    chain: BlobSha256,
    end: u64,
    last: bool,
}

impl PieceHasher {
    /// For piece `piece` of `layout`, starting from `before`, the hash of piece
    /// `piece − 1`. `None` when that hash is needed and not given (or the geometry puts
    /// the piece's start off a block boundary).
    pub fn for_piece(layout: PieceLayout, piece: u32, before: Option<PieceHash>) -> Option<Self> {
        let (start, end) = layout.range(piece);
        let chain = match (piece, before) {
            (0, _) => BlobSha256::new(),
            (_, Some(h)) => BlobSha256::resume(start, h)?,
            (_, None) => return None,
        };
        Some(Self {
            chain,
            end,
            last: piece.saturating_add(1) >= layout.count(),
        })
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.chain.update(bytes);
    }

    /// The piece's hash. A piece cut short or overrun gets a value no honest list
    /// holds (the sha256 of what arrived), so it fails verification.
    pub fn finish(&self) -> PieceHash {
        if !self.last && self.chain.offset() == self.end {
            if let Some(h) = self.chain.chaining_value() {
                return h;
            }
        }
        self.chain.finalize()
    }
}

/// Every piece's hash for a whole blob in memory (a source hashing a complete blob,
/// tests).
pub fn piece_hashes(layout: PieceLayout, blob: &[u8]) -> Vec<PieceHash> {
    let mut chain = BlobSha256::new();
    (0..layout.count())
        .map(|i| {
            let (a, b) = layout.range(i);
            let bytes = blob.get(a as usize..b as usize).unwrap_or(&[]);
            chain.update(bytes);
            if i + 1 == layout.count() {
                chain.finalize()
            } else {
                chain.chaining_value().unwrap_or_else(|| chain.finalize())
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pieces::{KIB, MIN_PIECE_SIZE};
    use proptest::prelude::*;

    fn blob(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn the_last_piece_hash_is_the_blob_digest() {
        let b = blob(300 * KIB as usize + 17);
        let layout = PieceLayout::new(b.len() as u64, MIN_PIECE_SIZE);
        let hashes = piece_hashes(layout, &b);
        assert_eq!(hashes.len(), 5);
        assert_eq!(hashes[4], PieceHash::of(&b));
        assert_eq!(hashes[4].0, <[u8; 32]>::from(sha2::Sha256::digest(&b)));
    }

    #[test]
    fn each_piece_verifies_from_the_one_before() {
        let b = blob(4 * MIN_PIECE_SIZE as usize);
        let layout = PieceLayout::new(b.len() as u64, MIN_PIECE_SIZE);
        let hashes = piece_hashes(layout, &b);
        for i in 0..layout.count() {
            let before = i.checked_sub(1).map(|j| hashes[j as usize]);
            let mut h = PieceHasher::for_piece(layout, i, before).unwrap();
            let (a, e) = layout.range(i);
            // Arbitrary chunking, as a socket delivers it.
            for chunk in b[a as usize..e as usize].chunks(1000) {
                h.update(chunk);
            }
            assert_eq!(h.finish(), hashes[i as usize], "piece {i}");
        }
        assert!(
            PieceHasher::for_piece(layout, 2, None).is_none(),
            "a later piece needs the hash before it"
        );
    }

    #[test]
    fn a_changed_byte_or_a_wrong_start_fails() {
        let mut b = blob(3 * MIN_PIECE_SIZE as usize);
        let layout = PieceLayout::new(b.len() as u64, MIN_PIECE_SIZE);
        let hashes = piece_hashes(layout, &b);
        let (a, e) = layout.range(1);
        b[a as usize + 5] ^= 1;
        let mut h = PieceHasher::for_piece(layout, 1, Some(hashes[0])).unwrap();
        h.update(&b[a as usize..e as usize]);
        assert_ne!(h.finish(), hashes[1], "one flipped bit");
        b[a as usize + 5] ^= 1;
        let mut h = PieceHasher::for_piece(layout, 1, Some(hashes[2])).unwrap();
        h.update(&b[a as usize..e as usize]);
        assert_ne!(h.finish(), hashes[1], "started from another piece's value");
        let mut h = PieceHasher::for_piece(layout, 1, Some(hashes[0])).unwrap();
        h.update(&b[a as usize..e as usize - 64]);
        assert_ne!(h.finish(), hashes[1], "cut short by one block");
    }

    #[test]
    fn hex_roundtrip() {
        let h = PieceHash::of(b"hello world");
        assert_eq!(PieceHash::from_hex(&h.to_hex()).unwrap(), h);
        assert!(PieceHash::from_hex("zz").is_err());
        assert!(PieceHash::from_hex(&"ab".repeat(31)).is_err());
    }

    proptest! {
        #[test]
        fn resuming_at_any_block_boundary_matches_sha256(len in 0usize..1000, cut in 0usize..16, split in 0usize..1000) {
            let b = blob(len);
            let cut = (cut * BLOCK).min(len - len % BLOCK);
            let mut head = BlobSha256::new();
            head.update(&b[..cut]);
            let mut rest = BlobSha256::resume(cut as u64, head.chaining_value().unwrap()).unwrap();
            let split = cut + split.min(len - cut);
            rest.update(&b[cut..split]);
            rest.update(&b[split..]);
            prop_assert_eq!(rest.finalize(), PieceHash::of(&b));
        }
    }
}
