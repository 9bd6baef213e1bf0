//! Digests interned as small ids, counted by the nodes that hold them, so the
//! extender's lookups hash a u32 and a digest is forgotten when its last holder is.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use oci::Digest;

/// A fast non-cryptographic hasher (the Fx algorithm) for digest-keyed maps: the
/// keys are sha256 hex, so there is nothing to defend against, and the extender's
/// latency is dominated by these lookups.
#[derive(Default, Clone, Copy)]
pub struct FxHasher(u64);

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        for b in chunks.remainder() {
            self.add(u64::from(*b));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type DigestMap<V> = HashMap<Digest, V, BuildHasherDefault<FxHasher>>;
pub(crate) type IdMap<V> = HashMap<BlobId, V, BuildHasherDefault<FxHasher>>;

/// A digest interned by the inventory (per-node maps are keyed by these, so the
/// extender's 20 × 1,000 lookups hash a u32, not 71 bytes). Ids of forgotten digests
/// are reused; an id is only meaningful while the inventory lock is held.
pub type BlobId = u32;

/// Digest ↔ id, with the number of nodes holding each.
#[derive(Clone, Debug, Default)]
pub(crate) struct Interner {
    ids: DigestMap<BlobId>,
    digests: Vec<Option<Digest>>,
    holders: Vec<u32>,
    free: Vec<BlobId>,
}

impl Interner {
    pub fn get(&self, d: &Digest) -> Option<BlobId> {
        self.ids.get(d).copied()
    }

    /// Digests some node holds.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// The id of `d`, allocated if new. A new id has no holder: the caller must
    /// [`hold`](Self::hold) it before the inventory lock is released.
    pub fn intern(&mut self, d: &Digest) -> BlobId {
        if let Some(id) = self.ids.get(d) {
            return *id;
        }
        let id = match self.free.pop() {
            Some(id) => {
                self.digests[id as usize] = Some(d.clone());
                id
            }
            None => {
                // Bounded far below u32::MAX by the inventory's entry cap.
                let id = BlobId::try_from(self.digests.len()).unwrap_or(BlobId::MAX);
                self.digests.push(Some(d.clone()));
                self.holders.push(0);
                id
            }
        };
        self.ids.insert(d.clone(), id);
        id
    }

    pub fn hold(&mut self, ids: impl IntoIterator<Item = BlobId>) {
        for id in ids {
            if let Some(h) = self.holders.get_mut(id as usize) {
                *h = h.saturating_add(1);
            }
        }
    }

    /// One holder fewer for each id; a digest nobody holds is forgotten.
    pub fn release(&mut self, ids: impl IntoIterator<Item = BlobId>) {
        for id in ids {
            let Some(h) = self.holders.get_mut(id as usize) else {
                continue;
            };
            *h = h.saturating_sub(1);
            if *h == 0 {
                if let Some(d) = self.digests.get_mut(id as usize).and_then(Option::take) {
                    self.ids.remove(&d);
                    self.free.push(id);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_forgotten_with_their_last_holder_and_ids_reused() {
        let d = |n: u8| Digest::from_sha256([n; 32]);
        let mut i = Interner::default();
        let a = i.intern(&d(1));
        let b = i.intern(&d(2));
        i.hold([a, b]);
        i.hold([a]);
        assert_eq!(i.len(), 2);
        i.release([a, b]);
        assert_eq!((i.get(&d(1)), i.get(&d(2))), (Some(a), None));
        let c = i.intern(&d(3));
        assert_eq!(c, b, "the freed id is reused");
        i.hold([c]);
        i.release([a, c]);
        assert_eq!(i.len(), 0);
    }
}
