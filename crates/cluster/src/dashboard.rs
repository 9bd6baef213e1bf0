//! What the dashboard draws (`GET /api/v1/dashboard`), computed from the inventory,
//! the job store and the saved-bytes series in one pass.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::inventory::NodeStatus;
use crate::state::ClusterState;

impl ClusterState {
    /// Everything the dashboard draws, in one object.
    pub fn dashboard(&self) -> Dashboard {
        let now = self.now();
        let inv = self.inventory();
        let mut images: BTreeMap<String, DashImage> = BTreeMap::new();
        for e in inv.entries() {
            for i in &e.report.images {
                let key = i.manifest_digest.to_string();
                let total = i.blobs.iter().map(|b| b.size).fold(0, u64::saturating_add);
                images.entry(key.clone()).or_insert_with(|| DashImage {
                    reference: i.references.first().cloned().unwrap_or_else(|| key.clone()),
                    manifest_digest: key,
                    total_bytes: total,
                    blobs: i.blobs.clone(),
                });
            }
        }
        let images: Vec<DashImage> = images.into_values().collect();
        let image_ids: Vec<_> = images.iter().map(|i| inv.intern_blobs(&i.blobs)).collect();
        let matrix = inv
            .entries()
            .map(|e| DashRow {
                node: e.report.node.clone(),
                status: inv.status_of(e, now),
                cache_used: e.report.cache_used,
                cache_budget: e.report.cache_budget,
                bytes: image_ids.iter().map(|ids| e.held_sum(ids)).collect(),
            })
            .collect();
        let sources = inv
            .entries()
            .map(|e| DashSources {
                node: e.report.node.clone(),
                pulls: {
                    let mut p: Vec<DashPull> = e
                        .report
                        .images
                        .iter()
                        .map(|i| DashPull {
                            reference: i
                                .references
                                .first()
                                .cloned()
                                .unwrap_or_else(|| i.manifest_digest.to_string()),
                            last_pull: i.last_pull,
                            cache: i.bytes_by_source.cache,
                            peer: i.bytes_by_source.peer,
                            registry: i.bytes_by_source.registry,
                            pull_seconds: i.pull_seconds,
                        })
                        .collect();
                    p.sort_by_key(|x| std::cmp::Reverse(x.last_pull));
                    p.truncate(5);
                    p
                },
            })
            .collect();
        let mut swarms: BTreeMap<String, DashSwarm> = BTreeMap::new();
        for e in inv.entries() {
            for d in &e.report.downloads_in_flight {
                let s = swarms
                    .entry(d.digest.to_string())
                    .or_insert_with(|| DashSwarm {
                        digest: d.digest.to_string(),
                        nodes: Vec::new(),
                        bytes_done: 0,
                        bytes_total: 0,
                    });
                s.nodes.push(e.report.node.clone());
                s.bytes_done = s.bytes_done.saturating_add(d.bytes_done);
                s.bytes_total = s.bytes_total.saturating_add(d.bytes_total);
            }
        }
        let jobs = self
            .inner
            .jobs
            .lock()
            .list()
            .map(|j| DashJob {
                id: j.id,
                images: j.images.iter().map(|i| i.reference.clone()).collect(),
                progress: j.progress(),
            })
            .collect();
        let sv = self.inner.saved.lock();
        Dashboard {
            now,
            nodes: inv.nodes(now),
            images: images
                .into_iter()
                .map(|mut i| {
                    i.blobs.clear();
                    i
                })
                .collect(),
            matrix,
            swarms: swarms.into_values().collect(),
            jobs,
            registry_bytes_saved: sv.total_saved,
            registry_bytes: sv.total_registry,
            saved_series: sv.series.iter().copied().collect(),
            sources,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashImage {
    pub reference: String,
    pub manifest_digest: String,
    pub total_bytes: u64,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub blobs: Vec<crate::inventory::BlobRef>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashRow {
    pub node: String,
    pub status: NodeStatus,
    pub cache_used: u64,
    pub cache_budget: u64,
    /// Bytes held of each image, in `images` order.
    pub bytes: Vec<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashPull {
    pub reference: String,
    pub last_pull: Option<u64>,
    pub cache: u64,
    pub peer: u64,
    pub registry: u64,
    pub pull_seconds: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashSources {
    pub node: String,
    /// Up to five most recent pulls.
    pub pulls: Vec<DashPull>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashSwarm {
    pub digest: String,
    pub nodes: Vec<String>,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DashJob {
    pub id: u64,
    pub images: Vec<String>,
    pub progress: crate::prewarm::JobProgress,
}

/// `GET /api/v1/dashboard`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Dashboard {
    pub now: u64,
    pub nodes: Vec<crate::inventory::NodeSummary>,
    pub images: Vec<DashImage>,
    pub matrix: Vec<DashRow>,
    pub swarms: Vec<DashSwarm>,
    pub jobs: Vec<DashJob>,
    pub registry_bytes_saved: u64,
    pub registry_bytes: u64,
    /// (unix seconds, cumulative bytes saved).
    pub saved_series: Vec<(u64, u64)>,
    pub sources: Vec<DashSources>,
}
