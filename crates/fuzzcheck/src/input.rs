//! Structured values drawn from fuzz bytes. Reading past the end yields zeros, so every
//! input, however short, builds something.

pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        head
    }

    pub fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let b = self.bytes(N);
        out[..b.len()].copy_from_slice(b);
        out
    }

    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.array())
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.array())
    }

    pub fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.array())
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// A number biased to small values and to the edges: a selector byte picks the
    /// width, so the fuzzer reaches 0, 1, `u8`, `u16`, `u32` and `u64` magnitudes.
    pub fn number(&mut self) -> u64 {
        match self.u8() % 6 {
            0 => u64::from(self.u8()),
            1 => u64::from(self.u16()),
            2 => u64::from(self.u32()),
            3 => self.u64(),
            4 => u64::MAX - u64::from(self.u8()),
            _ => 1u64 << (self.u8() % 64),
        }
    }

    /// Up to `max` bytes as a string (invalid UTF-8 replaced, so multi-byte
    /// characters and U+FFFD appear).
    pub fn string(&mut self, max: usize) -> String {
        let n = usize::from(self.u16()) % (max + 1);
        String::from_utf8_lossy(self.bytes(n)).into_owned()
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.data.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_past_the_end_are_zeros() {
        let mut i = Input::new(&[1, 2, 3]);
        assert_eq!(i.u16(), 0x0102);
        assert_eq!(i.u32(), 0x0300_0000);
        assert!(i.is_empty());
        assert_eq!(i.u64(), 0);
        assert_eq!(i.string(10), "");
    }
}
