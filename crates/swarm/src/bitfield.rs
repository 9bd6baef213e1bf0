//! Which pieces a node holds. Serialised as base64 of a little-endian bit array.

use base64::Engine as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::SmallVec;

use crate::Error;

/// Bytes held in place before the bits spill to the heap: blobs of up to 256 pieces
/// (a 15 GB blob in 64 MiB pieces is 224). A scheduler reads its own bitfields on every
/// pass and the tracker every candidate's when it ranks a handout; in the simulator's
/// 10,000 tasks each of those reads was a cache miss of its own behind a pointer.
const INLINE_BYTES: usize = 32;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bitfield {
    bits: SmallVec<[u8; INLINE_BYTES]>,
    len: u32,
    ones: u32,
}

impl Bitfield {
    pub fn new(len: u32) -> Self {
        Self {
            bits: smallvec::smallvec![0; (len as usize).div_ceil(8)],
            len,
            ones: 0,
        }
    }

    pub fn full(len: u32) -> Self {
        let mut bits: SmallVec<[u8; INLINE_BYTES]> =
            smallvec::smallvec![0xff; (len as usize).div_ceil(8)];
        if !len.is_multiple_of(8) {
            if let Some(last) = bits.last_mut() {
                *last = (1u8 << (len % 8)) - 1;
            }
        }
        Self {
            bits,
            len,
            ones: len,
        }
    }

    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn count(&self) -> u32 {
        self.ones
    }

    pub fn is_complete(&self) -> bool {
        self.ones == self.len
    }

    pub fn get(&self, i: u32) -> bool {
        i < self.len && self.bits[(i / 8) as usize] & (1 << (i % 8)) != 0
    }

    pub fn set(&mut self, i: u32) {
        if i < self.len && !self.get(i) {
            self.bits[(i / 8) as usize] |= 1 << (i % 8);
            self.ones += 1;
        }
    }

    pub fn clear(&mut self, i: u32) {
        if self.get(i) {
            self.bits[(i / 8) as usize] &= !(1 << (i % 8));
            self.ones -= 1;
        }
    }

    /// Pieces set here and not in `other`: what a holder with `self` can give a
    /// requester with `other`. Bitfields of different lengths (another piece size)
    /// share nothing, so everything counts.
    pub fn count_not_in(&self, other: &Bitfield) -> u32 {
        if other.len != self.len {
            return self.ones;
        }
        self.bits
            .iter()
            .zip(&other.bits)
            .map(|(a, b)| (a & !b).count_ones())
            .sum()
    }

    /// Pieces `[0, n)` all set: how far an in-order reader can go.
    pub fn prefix(&self) -> u32 {
        self.first_missing_from(0)
    }

    /// The first piece at or after `from` that is not set (`len` if none): a scan by
    /// bytes, so a read head far into a large blob costs little.
    pub fn first_missing_from(&self, from: u32) -> u32 {
        let mut i = from;
        while i < self.len {
            let byte = self.bits[(i / 8) as usize];
            if i.is_multiple_of(8) && byte == 0xff {
                i += 8;
                continue;
            }
            if byte & (1 << (i % 8)) == 0 {
                return i;
            }
            i += 1;
        }
        self.len
    }

    /// The raw little-endian bit array (padding bits are zero).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bits
    }

    /// A bitfield from its raw bit array, as received from a peer.
    pub fn from_bytes(mut bits: Vec<u8>, len: u32) -> Result<Self, Error> {
        if len > crate::pieces::MAX_PIECES {
            return Err(Error::Bitfield(format!("{len} pieces is too many")));
        }
        if bits.len() != (len as usize).div_ceil(8) {
            return Err(Error::Bitfield(format!(
                "{} bytes for {len} pieces",
                bits.len()
            )));
        }
        // Clear padding bits a peer might have set, then count.
        if !len.is_multiple_of(8) {
            if let Some(last) = bits.last_mut() {
                *last &= (1u8 << (len % 8)) - 1;
            }
        }
        let ones = bits.iter().map(|x| x.count_ones()).sum();
        Ok(Self {
            bits: SmallVec::from_vec(bits),
            len,
            ones,
        })
    }

    pub fn iter_ones(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len).filter(|&i| self.get(i))
    }

    pub fn to_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(&self.bits)
    }

    pub fn from_base64(s: &str, len: u32) -> Result<Self, Error> {
        if len > crate::pieces::MAX_PIECES || s.len() > (len as usize).div_ceil(8) * 4 / 3 + 4 {
            return Err(Error::Bitfield(format!("bitfield of {len} pieces")));
        }
        let bits = base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(|e| Error::Bitfield(e.to_string()))?;
        Self::from_bytes(bits, len)
    }
}

/// Wire form: `{"len": n, "bits": "<base64>"}`.
#[derive(Serialize, Deserialize)]
struct Wire {
    len: u32,
    bits: String,
}

impl Serialize for Bitfield {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Wire {
            len: self.len,
            bits: self.to_base64(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Bitfield {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = Wire::deserialize(d)?;
        Bitfield::from_base64(&w.bits, w.len).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_roundtrip() {
        let mut b = Bitfield::new(13);
        for i in [0, 1, 2, 7, 12] {
            b.set(i);
        }
        b.set(1);
        assert_eq!(b.count(), 5);
        assert_eq!(b.prefix(), 3);
        let json = serde_json::to_string(&b).unwrap();
        let back: Bitfield = serde_json::from_str(&json).unwrap();
        assert_eq!(back, b);
        assert!(Bitfield::from_base64("AAAA", 3).is_err());
        let padded =
            Bitfield::from_base64(&base64::engine::general_purpose::STANDARD.encode([0xff]), 3)
                .unwrap();
        assert_eq!(padded.count(), 3);
        assert!(Bitfield::full(9).is_complete());
        let mut b = Bitfield::full(40);
        assert_eq!(b.prefix(), 40);
        b.clear(33);
        assert_eq!(b.prefix(), 33);
        assert_eq!(b.first_missing_from(34), 40);
        assert!(Bitfield::from_base64("AAAA", crate::pieces::MAX_PIECES + 1).is_err());
    }

    /// Held in place up to `INLINE_BYTES` bytes, on the heap past them: the same
    /// bitfield either way, through every operation and the wire form.
    #[test]
    fn in_place_and_spilled_bitfields_behave_alike() {
        let inline_bits = (INLINE_BYTES * 8) as u32;
        for len in [1, inline_bits - 1, inline_bits, inline_bits + 1, 10_000] {
            let mut b = Bitfield::new(len);
            let every_third: Vec<u32> = (0..len).step_by(3).collect();
            for &i in &every_third {
                b.set(i);
            }
            assert_eq!(b.count(), every_third.len() as u32, "len {len}");
            assert_eq!(b.prefix(), 1, "len {len}");
            assert!((0..len).all(|i| b.get(i) == (i % 3 == 0)), "len {len}");
            let json = serde_json::to_string(&b).unwrap();
            let back: Bitfield = serde_json::from_str(&json).unwrap();
            assert_eq!(back, b, "len {len}");
            let full = Bitfield::full(len);
            assert!(full.is_complete(), "len {len}");
            assert_eq!(full.count_not_in(&b), len - b.count(), "len {len}");
            assert_eq!(full.as_bytes().len(), (len as usize).div_ceil(8));
            let from_bytes = Bitfield::from_bytes(full.as_bytes().to_vec(), len).unwrap();
            assert_eq!(from_bytes, full, "len {len}");
        }
    }
}
