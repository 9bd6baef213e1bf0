//! What agents reported they pulled, as a catalog: `tag:<registry/repo:tag>` or
//! `digest:<digest>` → the node whose report has the most recently pulled image under
//! it. Entries point into node reports instead of copying their blob lists, and go
//! away with the reports, so the catalog costs a few hundred bytes per key and never
//! outlives what nodes hold. Both maps are capped; the oldest keys go first.

use std::collections::{BTreeSet, HashMap};

use oci::{Digest, ImageReference};

use crate::inventory::ImageRecord;

/// Digests remembered per tag: more than one already means "seen moving".
const MAX_DIGESTS_PER_TAG: usize = 16;

#[derive(Clone, Debug)]
pub(crate) struct Pointer {
    pub last_pull: u64,
    /// When the entry was (re)written: what the cap evicts by (last_pull comes from
    /// the report and cannot be trusted to age).
    pub added: u64,
    pub node: String,
    pub manifest: Digest,
}

#[derive(Clone, Debug)]
pub(crate) struct ReportedImages {
    pointers: HashMap<String, Pointer>,
    /// Tag key → (last seen, manifest digests seen under it).
    tags: HashMap<String, (u64, BTreeSet<Digest>)>,
    max_keys: usize,
}

pub(crate) fn tag_key(r: &ImageReference) -> Option<String> {
    r.tag
        .as_ref()
        .map(|t| format!("{}/{}:{t}", r.registry, r.repository))
}

/// Tag keys (without the `tag:` prefix) of an image's references.
fn tags_of(img: &ImageRecord) -> impl Iterator<Item = String> + '_ {
    img.references
        .iter()
        .filter_map(|r| ImageReference::parse(r).ok())
        .filter_map(|r| tag_key(&r))
}

fn keys_of(img: &ImageRecord) -> Vec<String> {
    let mut keys = vec![format!("digest:{}", img.manifest_digest)];
    if let Some(i) = &img.index_digest {
        keys.push(format!("digest:{i}"));
    }
    keys.extend(tags_of(img).map(|t| format!("tag:{t}")));
    keys
}

impl ReportedImages {
    pub fn new(max_keys: usize) -> Self {
        Self {
            pointers: HashMap::new(),
            tags: HashMap::new(),
            max_keys: max_keys.max(1),
        }
    }

    pub fn lookup(&self, key: &str) -> Option<&Pointer> {
        self.pointers.get(key)
    }

    pub fn seen_moving(&self, tag_key: &str) -> bool {
        self.tags.get(tag_key).is_some_and(|(_, d)| d.len() > 1)
    }

    pub fn len(&self) -> usize {
        self.pointers.len()
    }

    /// Drops the entries that point at `node` for the images of its old report.
    pub fn remove_node(&mut self, node: &str, images: &[ImageRecord]) {
        for img in images {
            for k in keys_of(img) {
                if self.pointers.get(&k).is_some_and(|p| p.node == node) {
                    self.pointers.remove(&k);
                }
            }
        }
    }

    /// Records what `node` reports: each key points at the most recently pulled image.
    pub fn add_node(&mut self, node: &str, images: &[ImageRecord], now: u64) {
        for img in images {
            for t in tags_of(img) {
                let e = self.tags.entry(t).or_insert_with(|| (now, BTreeSet::new()));
                e.0 = now;
                if e.1.len() < MAX_DIGESTS_PER_TAG {
                    e.1.insert(img.manifest_digest.clone());
                }
            }
            let t = img.last_pull.unwrap_or(0);
            for k in keys_of(img) {
                if self.pointers.get(&k).is_none_or(|p| t >= p.last_pull) {
                    self.pointers.insert(
                        k,
                        Pointer {
                            last_pull: t,
                            added: now,
                            node: node.to_owned(),
                            manifest: img.manifest_digest.clone(),
                        },
                    );
                }
            }
        }
        self.trim();
    }

    /// Over the cap, drops the oldest tenth (in one pass, not one key at a time).
    fn trim(&mut self) {
        if self.pointers.len() > self.max_keys {
            let cut = cutoff(
                self.pointers.values().map(|p| p.added).collect(),
                self.max_keys,
            );
            self.pointers.retain(|_, p| p.added > cut);
        }
        if self.tags.len() > self.max_keys {
            let cut = cutoff(self.tags.values().map(|(s, _)| *s).collect(), self.max_keys);
            self.tags.retain(|_, (s, _)| *s > cut);
        }
    }
}

/// The age at or below which entries go so that `max` less a tenth remain.
fn cutoff(mut ages: Vec<u64>, max: usize) -> u64 {
    let drop = (ages.len() - max + max / 10).min(ages.len()).max(1);
    let (_, nth, _) = ages.select_nth_unstable(drop - 1);
    *nth
}
