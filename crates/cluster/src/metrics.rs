//! Cluster metrics (`starling_cluster_*`). Names are the contract with
//! `deploy/grafana/starling.json`.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PullLabels {
    pub image: String,
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabels {
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabels {
    pub verb: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

/// Every metric the cluster layer exports. Cloning shares the values.
#[derive(Clone)]
pub struct ClusterMetrics {
    /// `starling_cluster_pull_seconds{image,node}`: last pull's wall time (at most
    /// `metric_node_labels` series; the rest as `{image="other",node="other"}`, their max).
    pub pull_seconds: Family<PullLabels, Gauge<f64, AtomicU64>>,
    /// `starling_cluster_registry_bytes_saved_total`: pulled bytes served from a cache or a peer.
    pub registry_bytes_saved: Counter,
    /// `starling_cluster_registry_bytes_total`: pulled bytes that came from the registry.
    pub registry_bytes: Counter,
    /// `starling_cluster_prewarm_lead_seconds`: first use of a prewarmed image − warm done.
    pub prewarm_lead_seconds: Histogram,
    /// `starling_cluster_nodes{status}`: known / unknown.
    pub nodes: Family<StatusLabels, Gauge>,
    /// `starling_cluster_node_cached_bytes{node}`.
    pub node_cached_bytes: Family<NodeLabels, Gauge>,
    /// `starling_cluster_node_cache_budget_bytes{node}`.
    pub node_cache_budget_bytes: Family<NodeLabels, Gauge>,
    /// `starling_cluster_prewarm_jobs{status}`.
    pub prewarm_jobs: Family<StatusLabels, Gauge>,
    /// `starling_cluster_prewarm_nodes{status}`: node states over all jobs.
    pub prewarm_nodes: Family<StatusLabels, Gauge>,
    /// `starling_cluster_extender_seconds{verb}`: filter / prioritize / rank compute time.
    pub extender_seconds: Family<VerbLabels, Histogram>,
    /// `starling_cluster_reports_refused_total{reason}`: too_large, capacity, stale, invalid.
    pub reports_refused: Family<ReasonLabels, Counter>,
    /// `starling_cluster_inventory_digests`: distinct digests held by the nodes kept.
    pub inventory_digests: Gauge,
}

impl Default for ClusterMetrics {
    fn default() -> Self {
        Self {
            pull_seconds: Family::default(),
            registry_bytes_saved: Counter::default(),
            registry_bytes: Counter::default(),
            prewarm_lead_seconds: Histogram::new(exponential_buckets(1.0, 2.0, 18)),
            nodes: Family::default(),
            node_cached_bytes: Family::default(),
            node_cache_budget_bytes: Family::default(),
            prewarm_jobs: Family::default(),
            prewarm_nodes: Family::default(),
            extender_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.0, 16))
            }),
            reports_refused: Family::default(),
            inventory_digests: Gauge::default(),
        }
    }
}

/// Names (as exposed) of the cluster metrics, for checking dashboards.
pub const METRIC_NAMES: &[&str] = &[
    "starling_cluster_pull_seconds",
    "starling_cluster_registry_bytes_saved_total",
    "starling_cluster_registry_bytes_total",
    "starling_cluster_prewarm_lead_seconds",
    "starling_cluster_nodes",
    "starling_cluster_node_cached_bytes",
    "starling_cluster_node_cache_budget_bytes",
    "starling_cluster_prewarm_jobs",
    "starling_cluster_prewarm_nodes",
    "starling_cluster_extender_seconds",
    "starling_cluster_reports_refused_total",
    "starling_cluster_inventory_digests",
];

impl ClusterMetrics {
    /// Registers every metric under the `starling_cluster` prefix of `registry` (pass
    /// an unprefixed registry; the tracker can merge ours into its own this way).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("starling_cluster");
        r.register(
            "pull_seconds",
            "Wall time of the last pull of an image on a node",
            self.pull_seconds.clone(),
        );
        r.register(
            "registry_bytes_saved",
            "Pulled bytes served from a node cache or a peer instead of the registry",
            self.registry_bytes_saved.clone(),
        );
        r.register(
            "registry_bytes",
            "Pulled bytes that came from the registry",
            self.registry_bytes.clone(),
        );
        r.register(
            "prewarm_lead_seconds",
            "Time from a node finishing a prewarm to the image's first use there",
            self.prewarm_lead_seconds.clone(),
        );
        r.register("nodes", "Nodes by inventory status", self.nodes.clone());
        r.register(
            "node_cached_bytes",
            "Bytes held in a node's cache",
            self.node_cached_bytes.clone(),
        );
        r.register(
            "node_cache_budget_bytes",
            "A node's cache budget",
            self.node_cache_budget_bytes.clone(),
        );
        r.register(
            "prewarm_jobs",
            "Prewarm jobs by status",
            self.prewarm_jobs.clone(),
        );
        r.register(
            "prewarm_nodes",
            "Prewarm node assignments by state",
            self.prewarm_nodes.clone(),
        );
        r.register(
            "extender_seconds",
            "Compute time of scheduler extender and rank requests",
            self.extender_seconds.clone(),
        );
        r.register(
            "reports_refused",
            "Agent reports refused, by reason (too_large, capacity, stale, invalid)",
            self.reports_refused.clone(),
        );
        r.register(
            "inventory_digests",
            "Distinct blob digests held by the nodes in the inventory",
            self.inventory_digests.clone(),
        );
    }
}
