//! What every node holds: agent reports in, queries out. Pure state; the tracker
//! feeds it reports (`apply`) and heartbeats and passes `now` (unix seconds).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use oci::{Digest, ImageReference};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Bytes by where they came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceBytes {
    #[serde(default)]
    pub cache: u64,
    #[serde(default)]
    pub peer: u64,
    #[serde(default)]
    pub registry: u64,
}

impl SourceBytes {
    /// Bytes the registry did not have to send.
    pub fn saved(&self) -> u64 {
        self.cache + self.peer
    }
    pub fn total(&self) -> u64 {
        self.cache + self.peer + self.registry
    }
}

/// One blob in the node's store, complete or partial.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobHolding {
    pub digest: Digest,
    pub size: u64,
    /// Equal to `size` when complete; the verified prefix length of a partial blob.
    pub bytes_held: u64,
    pub complete: bool,
}

/// A blob of an image (config or layer).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRef {
    pub digest: Digest,
    pub size: u64,
}

/// One image the node has pulled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImageRecord {
    pub manifest_digest: Digest,
    /// The multi-arch index the manifest was selected from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_digest: Option<Digest>,
    /// References it was pulled as (`docker.io/library/python:3.12`).
    #[serde(default)]
    pub references: Vec<String>,
    /// Config and layer blobs.
    #[serde(default)]
    pub blobs: Vec<BlobRef>,
    /// Unix seconds.
    #[serde(default)]
    pub last_pull: Option<u64>,
    #[serde(default)]
    pub last_use: Option<u64>,
    /// Where the bytes of the last pull came from.
    #[serde(default)]
    pub bytes_by_source: SourceBytes,
    /// Wall time of the last pull.
    #[serde(default)]
    pub pull_seconds: Option<f64>,
}

/// A pin held by the agent (never evicted until `expires_at`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    pub reference: String,
    #[serde(default)]
    pub digest: Option<Digest>,
    /// Unix seconds; none = until unpinned.
    #[serde(default)]
    pub expires_at: Option<u64>,
}

/// A download in progress on the node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Download {
    pub digest: Digest,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// A full report from one agent. Sent periodically and on change; `generation` must
/// grow across reports and across agent restarts (start it at the agent's start time
/// in milliseconds, for example).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    pub node: String,
    pub generation: u64,
    /// Including zone / rack / pool labels (`topology.kubernetes.io/zone`, ...).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The agent's URL, for the tracker to send assignments to.
    #[serde(default)]
    pub agent_url: Option<String>,
    #[serde(default)]
    pub blobs: Vec<BlobHolding>,
    #[serde(default)]
    pub images: Vec<ImageRecord>,
    #[serde(default)]
    pub pins: Vec<Pin>,
    pub cache_budget: u64,
    pub cache_used: u64,
    pub cache_free: u64,
    #[serde(default)]
    pub downloads_in_flight: Vec<Download>,
    /// Observed download throughput (bytes/s), from recent pulls.
    #[serde(default)]
    pub throughput_bytes_per_sec: Option<f64>,
}

/// Known: reported within the timeout. Unknown: silent for longer: we do not know
/// what it holds (it is *not* treated as empty).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeStatus {
    Known,
    Unknown,
}

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

type DigestMap<V> = HashMap<Digest, V, BuildHasherDefault<FxHasher>>;
type IdMap<V> = HashMap<BlobId, V, BuildHasherDefault<FxHasher>>;

/// A digest interned by the inventory (per-node maps are keyed by these, so the
/// extender's 20 × 1,000 lookups hash a u32, not 71 bytes).
pub type BlobId = u32;

/// A node as the inventory keeps it.
#[derive(Clone, Debug)]
pub struct NodeEntry {
    pub report: NodeReport,
    pub first_seen: u64,
    pub last_report: u64,
    pub last_heartbeat: u64,
    /// blob id → bytes held (complete or partial), for O(1) lookups.
    held: IdMap<u64>,
}

impl NodeEntry {
    /// Bytes held of one interned blob.
    pub fn held_id(&self, id: BlobId) -> u64 {
        self.held.get(&id).copied().unwrap_or(0)
    }

    /// Bytes held of a set of interned blobs (`(id, size)`, see [`Inventory::intern_blobs`]).
    pub fn held_sum(&self, blobs: &[(BlobId, u64)]) -> u64 {
        if self.held.is_empty() {
            return 0;
        }
        blobs
            .iter()
            .map(|&(id, size)| self.held_id(id).min(size))
            .sum()
    }
}

/// Summary row for `GET /api/v1/nodes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeSummary {
    pub name: String,
    pub status: NodeStatus,
    pub generation: u64,
    pub labels: BTreeMap<String, String>,
    pub last_heartbeat: u64,
    pub seconds_since_heartbeat: u64,
    pub cache_budget: u64,
    pub cache_used: u64,
    pub cache_free: u64,
    pub blobs: usize,
    pub bytes_held: u64,
    pub images: usize,
    pub pins: usize,
    pub downloads_in_flight: usize,
    pub throughput_bytes_per_sec: Option<f64>,
}

/// How much of a set of blobs one node holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Holding {
    pub node: String,
    pub status: NodeStatus,
    pub bytes_held: u64,
    pub total_bytes: u64,
}

/// What `apply` did with a report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// First report from this node.
    New,
    /// Newer generation: contents replaced.
    Updated,
    /// Same generation again: counted as a heartbeat.
    Heartbeat,
}

/// An image reference resolved to its manifest and blobs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedImage {
    pub reference: String,
    pub manifest_digest: Digest,
    pub blobs: Vec<BlobRef>,
}

impl ResolvedImage {
    pub fn total_bytes(&self) -> u64 {
        self.blobs.iter().map(|b| b.size).sum()
    }
}

/// Unique blobs of several images (shared layers counted once), in first-seen order.
pub fn union_blobs<'a>(images: impl IntoIterator<Item = &'a ResolvedImage>) -> Vec<BlobRef> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for img in images {
        for b in &img.blobs {
            if seen.insert(b.digest.clone()) {
                out.push(b.clone());
            }
        }
    }
    out
}

/// The cluster's view of every node's cache.
#[derive(Clone, Debug)]
pub struct Inventory {
    nodes: BTreeMap<String, NodeEntry>,
    timeout_s: u64,
    /// "registry/repository:tag" → manifest digests seen for it (a tag seen moving has
    /// more than one).
    tag_history: HashMap<String, BTreeSet<Digest>>,
    /// "tag:<registry/repo:tag>" or "digest:<digest>" → the most recently pulled
    /// image reported under it (an in-memory catalog, so lookups do not scan nodes).
    images: HashMap<String, (u64, ResolvedImage)>,
    /// Interned digests of every blob any node has reported.
    ids: DigestMap<BlobId>,
}

fn tag_key(r: &ImageReference) -> Option<String> {
    r.tag
        .as_ref()
        .map(|t| format!("{}/{}:{t}", r.registry, r.repository))
}

impl Inventory {
    /// `timeout_s`: a node silent for longer than this becomes Unknown.
    pub fn new(timeout_s: u64) -> Self {
        Self {
            nodes: BTreeMap::new(),
            timeout_s,
            tag_history: HashMap::new(),
            images: HashMap::new(),
            ids: DigestMap::default(),
        }
    }

    pub fn timeout_s(&self) -> u64 {
        self.timeout_s
    }

    /// Takes a full report. Older generations are refused; the same generation again
    /// is a heartbeat.
    pub fn apply(&mut self, report: NodeReport, now: u64) -> Result<Applied> {
        if report.node.is_empty() {
            return Err(Error::InvalidRequest("report without a node name".into()));
        }
        if let Some(e) = self.nodes.get_mut(&report.node) {
            if report.generation < e.report.generation {
                return Err(Error::StaleGeneration {
                    node: report.node,
                    have: e.report.generation,
                    got: report.generation,
                });
            }
            if report.generation == e.report.generation {
                e.last_heartbeat = now;
                return Ok(Applied::Heartbeat);
            }
        }
        for img in &report.images {
            let t = img.last_pull.unwrap_or(0);
            let mut keys = vec![format!("digest:{}", img.manifest_digest)];
            if let Some(i) = &img.index_digest {
                keys.push(format!("digest:{i}"));
            }
            for r in &img.references {
                if let Ok(parsed) = ImageReference::parse(r) {
                    if let Some(k) = tag_key(&parsed) {
                        self.tag_history
                            .entry(k.clone())
                            .or_default()
                            .insert(img.manifest_digest.clone());
                        keys.push(format!("tag:{k}"));
                    }
                }
            }
            for k in keys {
                let newer = self.images.get(&k).is_none_or(|(bt, _)| t >= *bt);
                if newer {
                    let resolved = ResolvedImage {
                        reference: k.clone(),
                        manifest_digest: img.manifest_digest.clone(),
                        blobs: img.blobs.clone(),
                    };
                    self.images.insert(k, (t, resolved));
                }
            }
        }
        let mut held = IdMap::default();
        for b in &report.blobs {
            let next = BlobId::try_from(self.ids.len()).unwrap_or(BlobId::MAX);
            let id = *self.ids.entry(b.digest.clone()).or_insert(next);
            held.insert(id, b.bytes_held.min(b.size));
        }
        match self.nodes.get_mut(&report.node) {
            Some(e) => {
                e.report = report;
                e.held = held;
                e.last_report = now;
                e.last_heartbeat = now;
                Ok(Applied::Updated)
            }
            None => {
                self.nodes.insert(
                    report.node.clone(),
                    NodeEntry {
                        report,
                        first_seen: now,
                        last_report: now,
                        last_heartbeat: now,
                        held,
                    },
                );
                Ok(Applied::New)
            }
        }
    }

    /// A liveness ping between full reports. A generation other than the stored one
    /// is refused (the tracker should ask for a full report).
    pub fn heartbeat(&mut self, node: &str, generation: u64, now: u64) -> Result<()> {
        let e = self
            .nodes
            .get_mut(node)
            .ok_or_else(|| Error::UnknownNode(node.to_owned()))?;
        if generation < e.report.generation {
            return Err(Error::StaleGeneration {
                node: node.to_owned(),
                have: e.report.generation,
                got: generation,
            });
        }
        if generation > e.report.generation {
            return Err(Error::InvalidRequest(format!(
                "heartbeat from {node} carries generation {generation} but the last report was {}: send a full report",
                e.report.generation
            )));
        }
        e.last_heartbeat = now;
        Ok(())
    }

    /// Removes a node (decommissioned).
    pub fn forget(&mut self, node: &str) -> bool {
        self.nodes.remove(node).is_some()
    }

    pub fn status(&self, node: &str, now: u64) -> Option<NodeStatus> {
        self.nodes.get(node).map(|e| self.status_of(e, now))
    }

    pub fn status_of(&self, e: &NodeEntry, now: u64) -> NodeStatus {
        if now.saturating_sub(e.last_heartbeat) > self.timeout_s {
            NodeStatus::Unknown
        } else {
            NodeStatus::Known
        }
    }

    pub fn entry(&self, node: &str) -> Option<&NodeEntry> {
        self.nodes.get(node)
    }

    pub fn entries(&self) -> impl Iterator<Item = &NodeEntry> {
        self.nodes.values()
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn summary(&self, e: &NodeEntry, now: u64) -> NodeSummary {
        let r = &e.report;
        NodeSummary {
            name: r.node.clone(),
            status: self.status_of(e, now),
            generation: r.generation,
            labels: r.labels.clone(),
            last_heartbeat: e.last_heartbeat,
            seconds_since_heartbeat: now.saturating_sub(e.last_heartbeat),
            cache_budget: r.cache_budget,
            cache_used: r.cache_used,
            cache_free: r.cache_free,
            blobs: r.blobs.len(),
            bytes_held: e.held.values().sum(),
            images: r.images.len(),
            pins: r.pins.len(),
            downloads_in_flight: r.downloads_in_flight.len(),
            throughput_bytes_per_sec: r.throughput_bytes_per_sec,
        }
    }

    /// All nodes, sorted by name.
    pub fn nodes(&self, now: u64) -> Vec<NodeSummary> {
        self.nodes.values().map(|e| self.summary(e, now)).collect()
    }

    /// One node's summary and full last report.
    pub fn node(&self, name: &str, now: u64) -> Option<(NodeSummary, &NodeReport)> {
        self.nodes
            .get(name)
            .map(|e| (self.summary(e, now), &e.report))
    }

    /// The interned id of a digest, if any node ever reported it.
    pub fn blob_id(&self, d: &Digest) -> Option<BlobId> {
        self.ids.get(d).copied()
    }

    /// `(id, size)` of each distinct blob some node has reported (blobs nobody ever
    /// reported are held by nobody and left out; duplicates counted once).
    pub fn intern_blobs(&self, blobs: &[BlobRef]) -> Vec<(BlobId, u64)> {
        let mut seen = BTreeSet::new();
        blobs
            .iter()
            .filter_map(|b| self.blob_id(&b.digest).map(|id| (id, b.size)))
            .filter(|(id, _)| seen.insert(*id))
            .collect()
    }

    /// Bytes of one blob a node holds.
    pub fn held(&self, e: &NodeEntry, d: &Digest) -> u64 {
        self.blob_id(d).map_or(0, |id| e.held_id(id))
    }

    /// Bytes of `blobs` held by one node (duplicates in `blobs` counted once).
    pub fn bytes_held(&self, node: &str, blobs: &[BlobRef]) -> Option<u64> {
        let e = self.nodes.get(node)?;
        Some(e.held_sum(&self.intern_blobs(blobs)))
    }

    /// For a set of blobs, how many bytes each node holding any of them holds (shared
    /// layers counted once). Nodes holding nothing are left out. Sorted by bytes held,
    /// descending, then name.
    pub fn holders(&self, blobs: &[BlobRef], now: u64) -> Vec<Holding> {
        let total: u64 = dedup(blobs).iter().map(|b| b.size).sum();
        let ids = self.intern_blobs(blobs);
        let mut out: Vec<Holding> = self
            .nodes
            .values()
            .filter_map(|e| {
                let held = e.held_sum(&ids);
                (held > 0).then(|| Holding {
                    node: e.report.node.clone(),
                    status: self.status_of(e, now),
                    bytes_held: held,
                    total_bytes: total,
                })
            })
            .collect();
        out.sort_by(|a, b| b.bytes_held.cmp(&a.bytes_held).then(a.node.cmp(&b.node)));
        out
    }

    /// Whether a tag has been reported with more than one manifest digest.
    pub fn tag_seen_moving(&self, r: &ImageReference) -> bool {
        tag_key(r)
            .and_then(|k| self.tag_history.get(&k))
            .is_some_and(|s| s.len() > 1)
    }

    /// Resolves a reference from what agents reported: by digest (manifest or index),
    /// or by tag (the most recently pulled manifest reported under that tag).
    pub fn resolve(&self, r: &ImageReference) -> Option<ResolvedImage> {
        let key = match (&r.digest, tag_key(r)) {
            (Some(d), _) => format!("digest:{d}"),
            (None, Some(t)) => format!("tag:{t}"),
            (None, None) => return None,
        };
        self.images.get(&key).map(|(_, img)| ResolvedImage {
            reference: r.to_string(),
            manifest_digest: img.manifest_digest.clone(),
            blobs: img.blobs.clone(),
        })
    }
}

fn dedup(blobs: &[BlobRef]) -> Vec<BlobRef> {
    let mut seen = BTreeSet::new();
    blobs
        .iter()
        .filter(|b| seen.insert(&b.digest))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn d(n: u8) -> Digest {
        Digest::from_sha256([n; 32])
    }

    fn report(node: &str, generation: u64, blobs: &[(u8, u64, u64)]) -> NodeReport {
        NodeReport {
            node: node.into(),
            generation,
            labels: BTreeMap::new(),
            agent_url: None,
            blobs: blobs
                .iter()
                .map(|&(n, size, held)| BlobHolding {
                    digest: d(n),
                    size,
                    bytes_held: held,
                    complete: held == size,
                })
                .collect(),
            images: vec![],
            pins: vec![],
            cache_budget: 1000,
            cache_used: 0,
            cache_free: 1000,
            downloads_in_flight: vec![],
            throughput_bytes_per_sec: None,
        }
    }

    #[test]
    fn stale_generations_are_refused_and_same_generation_is_a_heartbeat() {
        let mut inv = Inventory::new(30);
        assert_eq!(
            inv.apply(report("n1", 5, &[(1, 100, 100)]), 1000).ok(),
            Some(Applied::New)
        );
        let err = inv.apply(report("n1", 4, &[]), 1001).expect_err("stale");
        assert_eq!(
            err.to_string(),
            "stale report from n1: generation 4 < current 5"
        );
        assert_eq!(
            inv.entry("n1").map(|e| e.report.blobs.len()),
            Some(1),
            "stale report did not replace"
        );
        assert_eq!(
            inv.apply(report("n1", 5, &[]), 1010).ok(),
            Some(Applied::Heartbeat)
        );
        assert_eq!(
            inv.entry("n1")
                .map(|e| (e.report.blobs.len(), e.last_heartbeat)),
            Some((1, 1010))
        );
        let mut stale = report("n1", 3, &[]);
        stale.images = vec![ImageRecord {
            manifest_digest: d(50),
            index_digest: None,
            references: vec!["python:3.12".into()],
            blobs: vec![],
            last_pull: Some(1),
            last_use: None,
            bytes_by_source: SourceBytes::default(),
            pull_seconds: None,
        }];
        assert!(inv.apply(stale, 1015).is_err());
        let py = ImageReference::parse("python:3.12").expect("ref");
        assert_eq!(
            inv.resolve(&py),
            None,
            "a refused report does not feed the catalog"
        );
        assert_eq!(
            inv.apply(report("n1", 6, &[]), 1020).ok(),
            Some(Applied::Updated)
        );
        assert_eq!(inv.entry("n1").map(|e| e.report.blobs.len()), Some(0));
    }

    #[test]
    fn silent_nodes_become_unknown_not_empty() {
        let mut inv = Inventory::new(30);
        inv.apply(report("n1", 1, &[(1, 100, 100)]), 1000)
            .expect("apply");
        assert_eq!(inv.status("n1", 1030), Some(NodeStatus::Known));
        assert_eq!(inv.status("n1", 1031), Some(NodeStatus::Unknown));
        let h = inv.holders(
            &[BlobRef {
                digest: d(1),
                size: 100,
            }],
            1031,
        );
        assert_eq!(
            h,
            vec![Holding {
                node: "n1".into(),
                status: NodeStatus::Unknown,
                bytes_held: 100,
                total_bytes: 100
            }]
        );
        inv.heartbeat("n1", 1, 1040).expect("heartbeat");
        assert_eq!(inv.status("n1", 1041), Some(NodeStatus::Known));
        assert!(matches!(inv.heartbeat("nope", 1, 1), Err(Error::UnknownNode(n)) if n == "nope"));
        assert!(matches!(
            inv.heartbeat("n1", 2, 1),
            Err(Error::InvalidRequest(_))
        ));
        assert_eq!(inv.status("nope", 0), None);
    }

    #[test]
    fn holders_count_shared_layers_once_and_partials_by_bytes() {
        let mut inv = Inventory::new(30);
        inv.apply(report("a", 1, &[(1, 100, 100), (2, 50, 20)]), 0)
            .expect("a");
        inv.apply(report("b", 1, &[(2, 50, 50)]), 0).expect("b");
        inv.apply(report("c", 1, &[(9, 10, 10)]), 0).expect("c");
        let blobs = [
            BlobRef {
                digest: d(1),
                size: 100,
            },
            BlobRef {
                digest: d(2),
                size: 50,
            },
            BlobRef {
                digest: d(1),
                size: 100,
            }, // shared layer listed twice
            BlobRef {
                digest: d(3),
                size: 7,
            },
        ];
        let h = inv.holders(&blobs, 0);
        assert_eq!(
            h.iter()
                .map(|h| (h.node.as_str(), h.bytes_held, h.total_bytes))
                .collect::<Vec<_>>(),
            vec![("a", 120, 157), ("b", 50, 157)]
        );
        assert_eq!(inv.bytes_held("c", &blobs), Some(0));
        assert_eq!(inv.bytes_held("zz", &blobs), None);
    }

    #[test]
    fn resolves_tags_digests_and_detects_moving_tags() {
        let mut inv = Inventory::new(30);
        let img = |m: u8, t: u64| ImageRecord {
            manifest_digest: d(m),
            index_digest: Some(d(200)),
            references: vec!["python:3.12".into()],
            blobs: vec![BlobRef {
                digest: d(m + 1),
                size: 10,
            }],
            last_pull: Some(t),
            last_use: None,
            bytes_by_source: SourceBytes::default(),
            pull_seconds: None,
        };
        let mut r1 = report("a", 1, &[]);
        r1.images = vec![img(10, 100)];
        inv.apply(r1, 0).expect("a");
        let py = ImageReference::parse("docker.io/library/python:3.12").expect("ref");
        assert!(!inv.tag_seen_moving(&py));
        assert_eq!(inv.resolve(&py).map(|r| r.manifest_digest), Some(d(10)));
        let mut r2 = report("b", 1, &[]);
        r2.images = vec![img(20, 200)];
        inv.apply(r2, 0).expect("b");
        assert!(inv.tag_seen_moving(&py));
        assert_eq!(
            inv.resolve(&py).map(|r| r.manifest_digest),
            Some(d(20)),
            "latest pull wins"
        );
        let by_digest = ImageReference::parse(&format!("python@{}", d(10))).expect("ref");
        assert_eq!(
            inv.resolve(&by_digest).map(|r| r.blobs[0].digest.clone()),
            Some(d(11))
        );
        let by_index = ImageReference::parse(&format!("python@{}", d(200))).expect("ref");
        assert!(inv.resolve(&by_index).is_some());
        let other = ImageReference::parse("python:3.13").expect("ref");
        assert_eq!(inv.resolve(&other), None);
    }
}
