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
        let mut b = Self::new(len);
        for i in 0..len {
            b.set(i);
        }
        b
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
        (0..self.len).find(|&i| !self.get(i)).unwrap_or(self.len)
    }

    pub fn iter_ones(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.len).filter(|&i| self.get(i))
    }

    pub fn to_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(&self.bits)
    }

    pub fn from_base64(s: &str, len: u32) -> Result<Self, Error> {
        let bits = base64::engine::general_purpose::STANDARD
            .decode(s)
            .map_err(|e| Error::Bitfield(e.to_string()))?;
        if bits.len() != (len as usize).div_ceil(8) {
            return Err(Error::Bitfield(format!(
                "{} bytes for {len} pieces",
                bits.len()
            )));
        }
        let mut b = Self { bits, len, ones: 0 };
        // Clear padding bits a peer might have set, then count.
        if len % 8 != 0 {
            if let Some(last) = b.bits.last_mut() {
                *last &= (1u8 << (len % 8)) - 1;
            }
        }
        b.ones = b.bits.iter().map(|x| x.count_ones()).sum();
        Ok(b)
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
        if w.len > 10_000_000 {
            return Err(serde::de::Error::custom("bitfield too long"));
        }
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
    }
}
