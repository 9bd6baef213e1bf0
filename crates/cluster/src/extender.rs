//! kube-scheduler extender (v1 wire format) and a plain ranking function for other
//! schedulers. Everything here answers from memory: the inventory and an
//! [`ImageCatalog`].
//!
//! Score of a node = estimated seconds saved there, mapped to 0–10:
//! for the pod's images (shared layers counted once) with `total` bytes, a node
//! holding `held` bytes with observed throughput `tp` pulls in
//! `pull = (total − held) / tp` seconds; its cold pull would take `total / tp`.
//! `ref` = the slowest cold pull among the known candidates; seconds saved =
//! `ref − pull`; score = round(10 × saved / ref). No size clamp (unlike the built-in
//! ImageLocality plugin's 23 MiB–1000 MiB), no spread scaling. Nodes the inventory
//! does not know, or whose agent stopped reporting, score 0 and are not failed.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;

use oci::ImageReference;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::inventory::{union_blobs, BlobRef, Inventory, NodeStatus, ResolvedImage};

/// Pod annotation: `"true"` makes `filter` fail nodes that miss any byte of the pod's images.
pub const REQUIRE_WARM_ANNOTATION: &str = "starling.io/require-warm";

/// What a catalog lookup at the source found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    Found(ResolvedImage),
    NotFound,
    /// The registry may not be contacted (not configured or not allowed); the message
    /// says why. Nothing was sent to it.
    Denied(String),
    /// The registry failed or did not answer in time.
    Failed(String),
}

/// A lookup in flight.
pub type LookupFuture<'a> = Pin<Box<dyn Future<Output = Lookup> + Send + 'a>>;

/// Resolves image references to their blobs. The tracker implements it over the
/// registry (with a cache); [`Inventory`] implements it from agent reports.
pub trait ImageCatalog: Send + Sync {
    /// From memory only. Must not block or wait on I/O: the scheduler extender calls
    /// it with the inventory locked, within the scheduler's deadline.
    fn resolve(&self, image: &ImageReference) -> Option<ResolvedImage>;

    /// Called after a `resolve` miss: start looking the image up in the background
    /// so a later `resolve` finds it. Must not block. Default: nothing.
    fn prefetch(&self, _image: &ImageReference) {}

    /// Looks the image up at its source, within a bounded time. Called with no lock
    /// held. Default: the in-memory answer.
    fn fetch<'a>(&'a self, image: &'a ImageReference) -> LookupFuture<'a> {
        let found = self.resolve(image);
        Box::pin(std::future::ready(match found {
            Some(x) => Lookup::Found(x),
            None => Lookup::NotFound,
        }))
    }
}

impl ImageCatalog for Inventory {
    fn resolve(&self, image: &ImageReference) -> Option<ResolvedImage> {
        Inventory::resolve(self, image)
    }
}

/// Tries `first`, then `second`.
pub struct Chain<'a>(pub &'a dyn ImageCatalog, pub &'a dyn ImageCatalog);

impl ImageCatalog for Chain<'_> {
    fn resolve(&self, image: &ImageReference) -> Option<ResolvedImage> {
        self.0.resolve(image).or_else(|| self.1.resolve(image))
    }
}

// ---- wire format (Go field names, no json tags) ----

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ObjectMeta {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Container {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub image: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PodSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub containers: Option<Vec<Container>>,
    #[serde(
        rename = "initContainers",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub init_containers: Option<Vec<Container>>,
}

/// The parts of a v1.Pod the extender reads (other fields are ignored).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Pod {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: PodSpec,
}

/// A v1.NodeList; items are kept verbatim so a filter reply returns them unchanged.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeList {
    #[serde(default)]
    pub items: Vec<serde_json::Value>,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

fn item_name(v: &serde_json::Value) -> Option<&str> {
    v.get("metadata")?.get("name")?.as_str()
}

/// ExtenderArgs: `Nodes` when nodeCacheCapable is false, `NodeNames` when true.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderArgs {
    #[serde(rename = "Pod", default)]
    pub pod: Pod,
    #[serde(rename = "Nodes", default)]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames", default)]
    pub node_names: Option<Vec<String>>,
}

impl ExtenderArgs {
    /// Candidate node names, from `NodeNames` or else `Nodes.items[].metadata.name`.
    pub fn candidate_names(&self) -> Vec<String> {
        if let Some(n) = &self.node_names {
            return n.clone();
        }
        self.nodes
            .as_ref()
            .map(|l| {
                l.items
                    .iter()
                    .filter_map(item_name)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes")]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames")]
    pub node_names: Option<Vec<String>>,
    #[serde(rename = "FailedNodes")]
    pub failed_nodes: BTreeMap<String, String>,
    #[serde(rename = "FailedAndUnresolvableNodes")]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    #[serde(rename = "Error")]
    pub error: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    #[serde(rename = "Host")]
    pub host: String,
    #[serde(rename = "Score")]
    pub score: i64,
}

// ---- estimates ----

/// Scoring knobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoreConfig {
    /// Throughput assumed for a node that has not reported one (bytes/s).
    pub default_throughput_bytes_per_sec: f64,
}

impl Default for ScoreConfig {
    fn default() -> Self {
        Self {
            default_throughput_bytes_per_sec: 100.0 * 1024.0 * 1024.0,
        }
    }
}

/// Images named by a pod: containers then initContainers, first occurrence kept.
pub fn pod_images(pod: &Pod) -> Vec<String> {
    let mut seen = BTreeSet::new();
    pod.spec
        .containers
        .iter()
        .flatten()
        .chain(pod.spec.init_containers.iter().flatten())
        .filter(|c| !c.image.is_empty())
        .filter(|c| seen.insert(c.image.clone()))
        .map(|c| c.image.clone())
        .collect()
}

/// A set of images resolved to their union of blobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Workload {
    pub images: Vec<String>,
    pub resolved: Vec<ResolvedImage>,
    /// References that do not parse or that the catalog cannot resolve.
    pub unresolved: Vec<String>,
    /// Unique blobs of the resolved images.
    pub blobs: Vec<BlobRef>,
    pub total_bytes: u64,
}

impl Workload {
    pub fn new(images: &[String], catalog: &dyn ImageCatalog) -> Self {
        let mut resolved = Vec::new();
        let mut unresolved = Vec::new();
        for i in images {
            match ImageReference::parse(i)
                .ok()
                .and_then(|r| catalog.resolve(&r))
            {
                Some(r) => resolved.push(r),
                None => unresolved.push(i.clone()),
            }
        }
        let blobs = union_blobs(&resolved);
        let total_bytes = blobs.iter().map(|b| b.size).fold(0, u64::saturating_add);
        Self {
            images: images.to_vec(),
            resolved,
            unresolved,
            blobs,
            total_bytes,
        }
    }
}

/// Whether the inventory knows a node, and whether it is still reporting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Presence {
    Known,
    /// Reported once, silent for longer than the timeout.
    Unknown,
    /// Never reported.
    Absent,
}

/// One node's figures for a workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeEstimate {
    pub node: String,
    pub presence: Presence,
    pub bytes_held: u64,
    pub missing_bytes: u64,
    pub throughput_bytes_per_sec: Option<f64>,
    /// None when the node's contents are not known.
    pub expected_pull_seconds: Option<f64>,
    pub seconds_saved: f64,
    pub score: i64,
}

/// Estimates for each candidate, in the given order (see the module doc for the score).
pub fn estimate(
    w: &Workload,
    candidates: &[String],
    inv: &Inventory,
    now: u64,
    cfg: &ScoreConfig,
) -> Vec<NodeEstimate> {
    let mut out: Vec<NodeEstimate> = Vec::with_capacity(candidates.len());
    let ids = inv.intern_blobs(&w.blobs);
    let mut reference = 0.0f64;
    for name in candidates {
        let entry = inv.entry(name);
        let presence = match entry {
            None => Presence::Absent,
            Some(e) => match inv.status_of(e, now) {
                NodeStatus::Known => Presence::Known,
                NodeStatus::Unknown => Presence::Unknown,
            },
        };
        let held: u64 = entry.map(|e| e.held_sum(&ids)).unwrap_or(0);
        let tp = entry.and_then(|e| e.report.throughput_bytes_per_sec);
        let pull = (presence == Presence::Known).then(|| {
            let t = tp
                .filter(|t| *t > 0.0 && t.is_finite())
                .unwrap_or(cfg.default_throughput_bytes_per_sec);
            reference = reference.max(w.total_bytes as f64 / t);
            w.total_bytes.saturating_sub(held) as f64 / t
        });
        out.push(NodeEstimate {
            node: name.clone(),
            presence,
            bytes_held: held,
            missing_bytes: w.total_bytes.saturating_sub(held),
            throughput_bytes_per_sec: tp,
            expected_pull_seconds: pull,
            seconds_saved: 0.0,
            score: 0,
        });
    }
    if reference > 0.0 {
        for e in &mut out {
            if let Some(p) = e.expected_pull_seconds {
                e.seconds_saved = reference - p;
                e.score = ((10.0 * e.seconds_saved / reference).round() as i64).clamp(0, 10);
            }
        }
    }
    out
}

use oci::size::format_size;

/// Whether the pod asks for warm nodes only.
pub fn requires_warm(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(REQUIRE_WARM_ANNOTATION))
        .is_some_and(|v| v.eq_ignore_ascii_case("true"))
}

/// The `filter` verb. Without the require-warm annotation every node passes. With
/// it, nodes missing any byte (or whose contents are unknown) go to FailedNodes
/// with the reason.
pub fn filter(
    args: &ExtenderArgs,
    inv: &Inventory,
    catalog: &dyn ImageCatalog,
    now: u64,
) -> ExtenderFilterResult {
    let names = args.candidate_names();
    let mut failed = BTreeMap::new();
    if requires_warm(&args.pod) {
        let w = Workload::new(&pod_images(&args.pod), catalog);
        let est = estimate(&w, &names, inv, now, &ScoreConfig::default());
        let total = format_size(w.total_bytes);
        let mut reasons: std::collections::HashMap<u64, String> = std::collections::HashMap::new();
        for e in est {
            let reason = match e.presence {
                Presence::Absent => Some("starling: node unknown to the tracker (no agent report); require-warm".to_owned()),
                Presence::Unknown => Some(format!(
                    "starling: agent has not reported for over {} s, cache contents unknown; require-warm",
                    inv.timeout_s()
                )),
                Presence::Known if !w.unresolved.is_empty() => Some(format!(
                    "starling: image {} is not cached anywhere in the cluster; require-warm",
                    w.unresolved.join(", ")
                )),
                Presence::Known if e.missing_bytes > 0 => Some(
                    // Many nodes miss the same amount (all of it, typically): format once.
                    reasons
                        .entry(e.missing_bytes)
                        .or_insert_with(|| {
                            format!(
                                "starling: missing {} of {} for {} image(s); require-warm",
                                format_size(e.missing_bytes),
                                total,
                                w.resolved.len()
                            )
                        })
                        .clone(),
                ),
                Presence::Known => None,
            };
            if let Some(r) = reason {
                failed.insert(e.node, r);
            }
        }
    }
    let (nodes, node_names) = if let Some(n) = &args.node_names {
        (
            None,
            Some(
                n.iter()
                    .filter(|x| !failed.contains_key(*x))
                    .cloned()
                    .collect(),
            ),
        )
    } else {
        let list = args.nodes.clone().unwrap_or_default();
        let items = list
            .items
            .into_iter()
            .filter(|i| item_name(i).is_none_or(|n| !failed.contains_key(n)))
            .collect();
        (
            Some(NodeList {
                items,
                rest: list.rest,
            }),
            None,
        )
    };
    ExtenderFilterResult {
        nodes,
        node_names,
        failed_nodes: failed,
        failed_and_unresolvable_nodes: BTreeMap::new(),
        error: String::new(),
    }
}

/// The `prioritize` verb: one entry per candidate, in request order, score 0..10.
pub fn prioritize(
    args: &ExtenderArgs,
    inv: &Inventory,
    catalog: &dyn ImageCatalog,
    now: u64,
    cfg: &ScoreConfig,
) -> Vec<HostPriority> {
    let w = Workload::new(&pod_images(&args.pod), catalog);
    estimate(&w, &args.candidate_names(), inv, now, cfg)
        .into_iter()
        .map(|e| HostPriority {
            host: e.node,
            score: e.score,
        })
        .collect()
}

/// Body of the plain ranking endpoint.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankRequest {
    /// One image ...
    #[serde(default)]
    pub image: Option<String>,
    /// ... or several (a job with sidecars); shared layers counted once.
    #[serde(default)]
    pub images: Vec<String>,
    /// Candidate nodes; empty = every node in the inventory.
    #[serde(default)]
    pub nodes: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankResponse {
    pub images: Vec<String>,
    pub manifest_digests: Vec<String>,
    pub total_bytes: u64,
    /// Fastest expected pull first; nodes with unknown contents last.
    pub nodes: Vec<NodeEstimate>,
}

/// Ranks candidates by expected pull time. Errors: no image given, a reference that
/// does not parse, an image nobody has and the catalog does not know.
pub fn rank(
    req: &RankRequest,
    inv: &Inventory,
    catalog: &dyn ImageCatalog,
    now: u64,
    cfg: &ScoreConfig,
) -> Result<RankResponse> {
    let mut images = req.images.clone();
    if let Some(i) = &req.image {
        images.insert(0, i.clone());
    }
    if images.is_empty() {
        return Err(Error::InvalidRequest("give \"image\" or \"images\"".into()));
    }
    for i in &images {
        ImageReference::parse(i).map_err(|e| Error::BadReference {
            reference: i.clone(),
            message: e.to_string(),
        })?;
    }
    let w = Workload::new(&images, catalog);
    if let Some(u) = w.unresolved.first() {
        return Err(Error::UnknownImage(u.clone()));
    }
    let candidates: Vec<String> = if req.nodes.is_empty() {
        inv.entries().map(|e| e.report.node.clone()).collect()
    } else {
        req.nodes.clone()
    };
    let mut nodes = estimate(&w, &candidates, inv, now, cfg);
    nodes.sort_by(
        |a, b| match (a.expected_pull_seconds, b.expected_pull_seconds) {
            (Some(x), Some(y)) => x.total_cmp(&y).then(a.node.cmp(&b.node)),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => a.node.cmp(&b.node),
        },
    );
    Ok(RankResponse {
        images,
        manifest_digests: w
            .resolved
            .iter()
            .map(|r| r.manifest_digest.to_string())
            .collect(),
        total_bytes: w.total_bytes,
        nodes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_images_dedups_and_includes_init_containers() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {
                "containers": [{"name": "a", "image": "x:1"}, {"name": "b", "image": "y:1"}],
                "initContainers": [{"name": "i", "image": "x:1"}, {"name": "j", "image": "z:1"}]
            }
        }))
        .expect("pod");
        assert_eq!(pod_images(&pod), vec!["x:1", "y:1", "z:1"]);
        let empty: Pod =
            serde_json::from_value(serde_json::json!({"spec": {"containers": null}})).expect("pod");
        assert!(pod_images(&empty).is_empty());
    }
}
