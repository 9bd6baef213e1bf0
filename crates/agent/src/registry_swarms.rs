//! Blobs this node was asked for through a registry that only an `allowed_registries`
//! wildcard admits. Such a registry's blobs are shared in a swarm of their own (the
//! digest and the registry, `oci::upstream::swarm_scope`), and a node holding one
//! otherwise seeds only the digest's swarm: the next node pulling it from that
//! registry found no holder and read it from the registry once more. The blob held
//! has passed its digest, so seeding it there hands out nothing but the digest's
//! bytes. Kept in `CACHE_DIR/registry-swarms.json`, so a restarted agent still seeds
//! them; bounded, and written atomically when it changes.

use oci::Digest;

/// Blobs remembered; the least recently asked for are forgotten first.
const MAX_BLOBS: usize = 4096;
/// Wildcard-admitted registries remembered per blob; the oldest give way.
const MAX_SWARMS_PER_BLOB: usize = 8;

#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
struct Entry {
    /// The blob's swarms besides the digest's, oldest first.
    swarms: Vec<Digest>,
    /// Unix seconds of the last request.
    last_asked: u64,
}

pub(crate) struct RegistrySwarms {
    entries: crate::json_file::JsonIndex<Digest, Entry>,
}

impl RegistrySwarms {
    pub(crate) fn open(cache_dir: &std::path::Path) -> RegistrySwarms {
        RegistrySwarms {
            entries: crate::json_file::JsonIndex::open(
                cache_dir,
                "registry-swarms.json",
                "the wildcard registries' swarms",
                MAX_BLOBS,
                |e: &Entry| e.last_asked,
            ),
        }
    }

    /// Records that `blob` was asked for in swarm `swarm`; persists when that pair is
    /// new (not for the time alone).
    pub(crate) fn note(&self, blob: &Digest, swarm: &Digest) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.entries.change(|m| {
            let e = m.entry(blob.clone()).or_default();
            e.last_asked = now;
            let new = !e.swarms.contains(swarm);
            if new {
                if e.swarms.len() >= MAX_SWARMS_PER_BLOB {
                    e.swarms.remove(0);
                }
                e.swarms.push(swarm.clone());
            }
            new
        });
    }

    /// The swarms this node seeds besides the digests' own: each one noted for a blob
    /// the store holds whole, with the size it holds (`held_size`).
    pub(crate) fn seeded_swarms(
        &self,
        held_size: impl Fn(&Digest) -> Option<u64>,
    ) -> Vec<(Digest, u64)> {
        self.entries.read(|m| {
            m.iter()
                .filter_map(|(d, e)| Some((held_size(d)?, e)))
                .flat_map(|(size, e)| e.swarms.iter().map(move |s| (s.clone(), size)))
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_blobs_held_are_seeded_in_their_noted_swarms_and_the_notes_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (held, missing) = (Digest::of(b"held"), Digest::of(b"missing"));
        let (r1, r2) = (Digest::of(b"swarm 1"), Digest::of(b"swarm 2"));
        let index = RegistrySwarms::open(dir.path());
        index.note(&held, &r1);
        index.note(&held, &r2);
        index.note(&held, &r1);
        index.note(&missing, &r1);
        let size = |d: &Digest| (*d == held).then_some(42);
        let mut seeded = index.seeded_swarms(size);
        seeded.sort();
        let mut want = vec![(r1.clone(), 42), (r2.clone(), 42)];
        want.sort();
        assert_eq!(seeded, want);
        let reopened = RegistrySwarms::open(dir.path());
        let mut again = reopened.seeded_swarms(size);
        again.sort();
        assert_eq!(again, want);
    }

    #[test]
    fn a_blob_remembers_a_bounded_number_of_swarms() {
        let dir = tempfile::tempdir().unwrap();
        let blob = Digest::of(b"popular");
        let index = RegistrySwarms::open(dir.path());
        for i in 0..(MAX_SWARMS_PER_BLOB + 3) {
            index.note(&blob, &Digest::of(format!("registry {i}").as_bytes()));
        }
        let seeded = index.seeded_swarms(|_| Some(1));
        assert_eq!(seeded.len(), MAX_SWARMS_PER_BLOB);
        assert!(!seeded.iter().any(|(s, _)| *s == Digest::of(b"registry 0")));
    }
}
