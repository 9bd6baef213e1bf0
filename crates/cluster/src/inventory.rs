//! What every node holds: agent reports in, queries out. Pure state; the tracker
//! feeds it reports (`apply`) and heartbeats and passes `now` (unix seconds).
//!
//! Everything kept is bounded ([`InventoryLimits`]): nodes, what one report may carry,
//! list entries over all nodes, and the catalog of reported images; nodes silent for
//! longer than the expiry are forgotten with their digests.

mod catalog;
mod intern;
mod limits;

use std::collections::{BTreeMap, BTreeSet};

use oci::{Digest, ImageReference};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use catalog::{tag_key, ReportedImages};
pub use intern::{BlobId, FxHasher};
use intern::{IdMap, Interner};
pub use limits::{InventoryLimits, MAX_NODE_NAME};

pub use crate::wire::{BlobHolding, BlobRef, Download, ImageRecord, NodeReport, Pin, SourceBytes};

/// Known: reported within the timeout. Unknown: silent for longer: we do not know
/// what it holds (it is *not* treated as empty).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeStatus {
    Known,
    Unknown,
}

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
            .fold(0, u64::saturating_add)
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
        self.blobs
            .iter()
            .map(|b| b.size)
            .fold(0, u64::saturating_add)
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
    limits: InventoryLimits,
    /// Reported images by tag and digest (an in-memory catalog, so lookups do not scan
    /// nodes), and the digests each tag was seen with.
    catalog: ReportedImages,
    /// Interned digests of the blobs nodes hold.
    ids: Interner,
    /// List entries over all kept reports (see [`InventoryLimits::max_total_entries`]).
    entries: usize,
}

impl Inventory {
    /// `timeout_s`: a node silent for longer than this becomes Unknown.
    pub fn new(timeout_s: u64) -> Self {
        Self::with_limits(timeout_s, InventoryLimits::default())
    }

    pub fn with_limits(timeout_s: u64, limits: InventoryLimits) -> Self {
        Self {
            nodes: BTreeMap::new(),
            timeout_s,
            catalog: ReportedImages::new(limits.max_catalog_keys),
            limits,
            ids: Interner::default(),
            entries: 0,
        }
    }

    pub fn limits(&self) -> &InventoryLimits {
        &self.limits
    }

    /// Distinct digests some node holds.
    pub fn digests(&self) -> usize {
        self.ids.len()
    }

    /// Keys of the reported-image catalog.
    pub fn catalog_keys(&self) -> usize {
        self.catalog.len()
    }

    pub fn timeout_s(&self) -> u64 {
        self.timeout_s
    }

    /// Takes a full report. Older generations are refused; the same generation again
    /// is a heartbeat. Reports over the limits are refused, and so are new nodes when
    /// the node table or the inventory is full (after expiring long-silent nodes).
    pub fn apply(&mut self, report: NodeReport, now: u64) -> Result<Applied> {
        self.limits.check(&report)?;
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
        let is_new = !self.nodes.contains_key(&report.node);
        if is_new && self.nodes.len() >= self.limits.max_nodes {
            self.expire(now);
            if self.nodes.len() >= self.limits.max_nodes {
                return Err(Error::Capacity(format!(
                    "the inventory holds {} nodes, its maximum; a new node is taken when one has been silent for {} s",
                    self.nodes.len(),
                    self.limits.node_expiry_s
                )));
            }
        }
        let old_entries = self
            .nodes
            .get(&report.node)
            .map_or(0, |e| limits::entries(&e.report));
        let new_entries = limits::entries(&report);
        let total = self.entries.saturating_sub(old_entries) + new_entries;
        if total > self.limits.max_total_entries {
            return Err(Error::Capacity(format!(
                "the inventory is full ({} of {} list entries); report from {} with {new_entries} refused",
                self.entries, self.limits.max_total_entries, report.node
            )));
        }
        let mut held = IdMap::default();
        for b in &report.blobs {
            let id = self.ids.intern(&b.digest);
            // A blob is held whole only once its digest was checked: a download whose
            // bytes all arrived but are not yet verified counts one byte short.
            let whole = if b.complete {
                b.size
            } else {
                b.size.saturating_sub(1)
            };
            held.insert(id, b.bytes_held.min(whole));
        }
        // Hold the new set before releasing the old one, so shared digests keep their ids.
        self.ids.hold(held.keys().copied());
        self.entries = total;
        let node = report.node.clone();
        let applied = match self.nodes.get_mut(&node) {
            Some(e) => {
                let old = std::mem::replace(&mut e.held, held);
                let old_report = std::mem::replace(&mut e.report, report);
                e.last_report = now;
                e.last_heartbeat = now;
                self.ids.release(old.into_keys());
                self.catalog.remove_node(&node, &old_report.images);
                Applied::Updated
            }
            None => {
                self.nodes.insert(
                    node.clone(),
                    NodeEntry {
                        report,
                        first_seen: now,
                        last_report: now,
                        last_heartbeat: now,
                        held,
                    },
                );
                Applied::New
            }
        };
        if let Some(e) = self.nodes.get(&node) {
            self.catalog.add_node(&node, &e.report.images, now);
        }
        Ok(applied)
    }

    /// Forgets nodes silent for longer than the expiry; returns their names.
    pub fn expire(&mut self, now: u64) -> Vec<String> {
        let expiry = self.limits.node_expiry_s.max(self.timeout_s);
        let gone: Vec<String> = self
            .nodes
            .values()
            .filter(|e| now.saturating_sub(e.last_heartbeat) > expiry)
            .map(|e| e.report.node.clone())
            .collect();
        for n in &gone {
            self.forget(n);
        }
        gone
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

    /// Removes a node (decommissioned, or silent past the expiry) with what only it held.
    pub fn forget(&mut self, node: &str) -> bool {
        let Some(e) = self.nodes.remove(node) else {
            return false;
        };
        self.entries = self.entries.saturating_sub(limits::entries(&e.report));
        self.ids.release(e.held.into_keys());
        self.catalog.remove_node(node, &e.report.images);
        true
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
            bytes_held: e.held.values().fold(0, |a, b| a.saturating_add(*b)),
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

    /// The interned id of a digest, if some node holds it.
    pub fn blob_id(&self, d: &Digest) -> Option<BlobId> {
        self.ids.get(d)
    }

    /// `(id, size)` of each distinct blob some node holds (blobs nobody holds are left
    /// out; duplicates counted once).
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
        let total: u64 = dedup(blobs)
            .iter()
            .map(|b| b.size)
            .fold(0, u64::saturating_add);
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
        tag_key(r).is_some_and(|k| self.catalog.seen_moving(&k))
    }

    /// Resolves a reference from what agents reported: by digest (manifest or index),
    /// or by tag (the most recently pulled manifest reported under that tag).
    pub fn resolve(&self, r: &ImageReference) -> Option<ResolvedImage> {
        let key = match (&r.digest, tag_key(r)) {
            (Some(d), _) => format!("digest:{d}"),
            (None, Some(t)) => format!("tag:{t}"),
            (None, None) => return None,
        };
        let p = self.catalog.lookup(&key)?;
        let img = self
            .nodes
            .get(&p.node)?
            .report
            .images
            .iter()
            .find(|i| i.manifest_digest == p.manifest)?;
        Some(ResolvedImage {
            reference: r.to_string(),
            manifest_digest: p.manifest.clone(),
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
mod tests;
