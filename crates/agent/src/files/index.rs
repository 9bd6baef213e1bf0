//! The files this agent was asked for (key → origin identity), kept in
//! `CACHE_DIR/files.json` so the inventory can report them after a restart: the store
//! knows a file's bytes by key only. Bounded; written atomically when it changes.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cluster::inventory::{BlobRef, ImageRecord, SourceBytes};
use oci::Digest;
use serde::{Deserialize, Serialize};

/// Files remembered; the least recently asked for are forgotten first.
const MAX_FILES: usize = 4096;
/// Inventory strings are bounded by the tracker (1 KiB); longer URLs are cut.
const MAX_REPORTED_URL: usize = 1000;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct FileEntry {
    /// Scheme, host, port and path: no query.
    pub url: String,
    pub size: u64,
    /// Unix seconds of the last request.
    pub last_get: u64,
    /// Whether the key is the content digest (else the identity key).
    pub content_digest: bool,
    /// A file keyed by its content digest is shared in a swarm of its own
    /// (`FileOrigin::swarm_key`): once held, this node seeds it there too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swarm: Option<Digest>,
}

pub(crate) struct FileIndex {
    entries: crate::json_file::JsonIndex<String, FileEntry>,
    /// Versions of files whose bytes failed the digest their caller named, by their
    /// registration key (URL, version, size and digest), with when: not read again
    /// for [`MISMATCH_MEMORY`]. A `get` resumes a cut body, and a job naming a wrong
    /// digest asks on every node: each ask would read the whole file again.
    mismatched: parking_lot::Mutex<HashMap<String, Instant>>,
}

/// How long a file version that failed its named digest is refused without reading it.
pub(crate) const MISMATCH_MEMORY: Duration = Duration::from_secs(600);

/// Failed file versions remembered at once (the oldest go first).
const MAX_MISMATCHED: usize = 1024;

impl FileIndex {
    pub(crate) fn open(cache_dir: &std::path::Path) -> FileIndex {
        FileIndex {
            entries: crate::json_file::JsonIndex::open(
                cache_dir,
                "files.json",
                "the file index",
                MAX_FILES,
                |e: &FileEntry| e.last_get,
            ),
            mismatched: parking_lot::Mutex::new(HashMap::new()),
        }
    }

    /// The version registered under `registry_key` failed the digest it was named by.
    pub(crate) fn note_mismatch(&self, registry_key: &str) {
        let mut m = self.mismatched.lock();
        m.retain(|_, at| at.elapsed() < MISMATCH_MEMORY);
        if m.len() >= MAX_MISMATCHED {
            if let Some(oldest) = m.iter().min_by_key(|(_, at)| **at).map(|(k, _)| k.clone()) {
                m.remove(&oldest);
            }
        }
        m.insert(registry_key.to_owned(), Instant::now());
    }

    /// How long ago the version under `registry_key` failed its digest, if within
    /// [`MISMATCH_MEMORY`].
    pub(crate) fn recent_mismatch(&self, registry_key: &str) -> Option<Duration> {
        let age = self.mismatched.lock().get(registry_key)?.elapsed();
        (age < MISMATCH_MEMORY).then_some(age)
    }

    /// Records a request for `key`; persists when the entry is new or its URL or size
    /// changed (not for the time alone).
    pub(crate) fn note(&self, key: &Digest, entry: FileEntry) {
        self.entries.change(|m| {
            let k = key.to_string();
            let changed = m.get(&k).is_none_or(|e| {
                e.url != entry.url || e.size != entry.size || e.swarm != entry.swarm
            });
            m.insert(k, entry);
            changed
        });
    }

    /// The swarms of the files the store holds whole (`held_size(key)`) that are not
    /// their key's own (files named by a content digest), with their sizes: what this
    /// node seeds for them besides the digest itself. Only where the blob held has the
    /// size the origin gave (a cached blob served for a URL that names its digest but
    /// holds something else is not that file).
    pub(crate) fn seeded_swarms(
        &self,
        held_size: impl Fn(&Digest) -> Option<u64>,
    ) -> Vec<(Digest, u64)> {
        self.entries.read(|m| {
            m.iter()
                .filter_map(|(k, e)| {
                    let swarm = e.swarm.clone()?;
                    (held_size(&Digest::parse(k).ok()?)? == e.size).then_some((swarm, e.size))
                })
                .collect()
        })
    }

    /// Each file the store holds (`held(key)` is `Some` for those) as an image of one
    /// blob, so `starling nodes`, `where` (by `@sha256:<key>`) and the scheduler
    /// ranking see files as they see images.
    pub(crate) fn images(&self, held: impl Fn(&Digest) -> bool) -> Vec<ImageRecord> {
        self.entries.read(|m| {
            m.iter()
                .filter_map(|(k, e)| {
                    let d = Digest::parse(k).ok()?;
                    if !held(&d) {
                        return None;
                    }
                    let mut url = e.url.clone();
                    if url.len() > MAX_REPORTED_URL {
                        let mut cut = MAX_REPORTED_URL;
                        while !url.is_char_boundary(cut) {
                            cut -= 1;
                        }
                        url.truncate(cut);
                    }
                    Some(ImageRecord {
                        manifest_digest: d.clone(),
                        index_digest: None,
                        references: vec![url],
                        blobs: vec![BlobRef {
                            digest: d,
                            size: e.size,
                        }],
                        last_pull: Some(e.last_get),
                        last_use: None,
                        bytes_by_source: SourceBytes::default(),
                        pull_seconds: None,
                    })
                })
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_named_file_is_seeded_in_its_swarm_only_when_held_at_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let idx = FileIndex::open(dir.path());
        let (named, by_identity) = (Digest::of(b"named"), Digest::of(b"identity"));
        let swarm = Digest::of(b"its swarm");
        let entry = |swarm: Option<Digest>| FileEntry {
            url: "https://o.example/w.bin".into(),
            size: 10,
            last_get: 1,
            content_digest: swarm.is_some(),
            swarm,
        };
        idx.note(&named, entry(Some(swarm.clone())));
        idx.note(&by_identity, entry(None));
        assert_eq!(idx.seeded_swarms(|_| Some(10)), vec![(swarm, 10)]);
        assert_eq!(idx.seeded_swarms(|_| Some(11)), vec![]);
        assert_eq!(idx.seeded_swarms(|_| None), vec![]);
    }

    #[test]
    fn failed_versions_are_remembered_within_a_bound() {
        let dir = tempfile::tempdir().unwrap();
        let idx = FileIndex::open(dir.path());
        assert_eq!(idx.recent_mismatch("file:a"), None);
        idx.note_mismatch("file:a");
        assert!(idx.recent_mismatch("file:a").is_some());
        for i in 0..MAX_MISMATCHED {
            idx.note_mismatch(&format!("file:{i}"));
        }
        assert_eq!(idx.mismatched.lock().len(), MAX_MISMATCHED);
        assert_eq!(idx.recent_mismatch("file:a"), None, "the oldest went first");
        assert!(idx
            .recent_mismatch(&format!("file:{}", MAX_MISMATCHED - 1))
            .is_some());
    }

    #[test]
    fn files_survive_a_restart_and_only_held_ones_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let entry = |url: &str| FileEntry {
            url: url.into(),
            size: 10,
            last_get: 1,
            content_digest: false,
            swarm: None,
        };
        {
            let idx = FileIndex::open(dir.path());
            idx.note(&a, entry("https://o.example/a.bin"));
            idx.note(
                &b,
                entry(&format!("https://o.example/{}", "x".repeat(2000))),
            );
        }
        let idx = FileIndex::open(dir.path());
        let all = idx.images(|_| true);
        assert_eq!(all.len(), 2);
        assert!(all
            .iter()
            .all(|i| i.references[0].len() <= MAX_REPORTED_URL));
        let only_a = idx.images(|d| d == &a);
        assert_eq!(only_a.len(), 1);
        assert_eq!(
            only_a[0].references,
            vec!["https://o.example/a.bin".to_owned()]
        );
        assert_eq!(only_a[0].blobs[0].digest, a);
    }
}
