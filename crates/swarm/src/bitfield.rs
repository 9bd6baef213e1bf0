//! Which pieces a node holds. Serialised as base64 of a little-endian bit array.

use base64::Engine as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::Error;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bitfield {
    bits: Vec<u8>,
    len: u32,
    ones: u32,
}

impl Bitfield {
    pub fn new(len: u32) -> Self {
        Self {
            bits: vec![0; (len as usize).div_ceil(8)],
            len,
            ones: 0,
        }
    }

    pub fn full(len: u32) -> Self {
        let mut bits = vec![0xff; (len as usize).div_ceil(8)];
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
        Ok(Self { bits, len, ones })
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
}
