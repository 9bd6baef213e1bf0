//! Prometheus metrics of the mirror.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Where an error answered to a client came from, and whether the agent could have
/// fallen back (`oci::ErrorSource`, `is_retryable`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub source: &'static str,
    pub retryable: bool,
}

/// A fixed reason label (`pki::Error::reason`, "timeout"): bounded cardinality.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// `cache` (complete on disk), `upstream` (fetched for this request or joined a
    /// download in flight), `passthrough` (streamed without caching).
    pub source: &'static str,
}

pub struct Metrics {
    pub registry: Registry,
    pub requests: Family<RouteLabels, Counter>,
    pub bytes_served: Family<SourceLabels, Counter>,
    pub upstream_bytes: Counter,
    pub blob_seconds: Family<SourceLabels, Histogram>,
    /// From a blob request's arrival to its first body byte ready to send: the wait
    /// a runtime sees before a layer starts to flow, the agent's share of it alone.
    pub blob_first_byte_seconds: Family<SourceLabels, Histogram>,
    pub cache_hits: Counter,
    pub cache_misses: Counter,
    pub cache_bytes: Gauge,
    pub cache_budget_bytes: Gauge,
    pub evictions: Counter,
    pub stale_tags_served: Counter,
    /// Manifests and small blobs the registry could not give, taken from members that
    /// hold them.
    pub taken_from_holders: Counter,
    pub upstream_errors: Counter,
    pub disk_full: Counter,
    /// Connections closed at accept because `max_connections` were open.
    pub connections_refused: Counter,
    pub connections_open: Gauge,
    pub error_responses: Family<ErrorLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("starling_agent");
        let requests = Family::<RouteLabels, Counter>::default();
        let bytes_served = Family::<SourceLabels, Counter>::default();
        let upstream_bytes = Counter::default();
        let blob_seconds = Family::<SourceLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.005, 2.0, 16))
        });
        let blob_first_byte_seconds =
            Family::<SourceLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 1.5, 24))
            });
        let cache_hits = Counter::default();
        let cache_misses = Counter::default();
        let cache_bytes = Gauge::default();
        let cache_budget_bytes = Gauge::default();
        let evictions = Counter::default();
        let stale_tags_served = Counter::default();
        let taken_from_holders = Counter::default();
        let upstream_errors = Counter::default();
        let disk_full = Counter::default();
        let connections_refused = Counter::default();
        let connections_open = Gauge::default();
        let error_responses = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "error_responses",
            "Error answers to clients by where the error came from (client, upstream, cache, ...)",
            error_responses.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections closed as they arrived because max_connections were open",
            connections_refused.clone(),
        );
        registry.register(
            "connections_open",
            "Client connections being served",
            connections_open.clone(),
        );
        registry.register(
            "disk_full",
            "Downloads stopped by a full disk (the blob is then streamed uncached)",
            disk_full.clone(),
        );
        registry.register(
            "requests",
            "HTTP requests by route and status",
            requests.clone(),
        );
        registry.register(
            "served_bytes",
            "Blob bytes served to clients, by where they came from (cache, swarm, registry, passthrough)",
            bytes_served.clone(),
        );
        registry.register(
            "upstream_bytes",
            "Bytes received from upstream registries",
            upstream_bytes.clone(),
        );
        registry.register(
            "blob_duration_seconds",
            "Time to serve one whole blob from its request's arrival, by where it came from",
            blob_seconds.clone(),
        );
        registry.register(
            "blob_first_byte_seconds",
            "Time from a blob request's arrival to its first body byte, by where it came from",
            blob_first_byte_seconds.clone(),
        );
        registry.register(
            "cache_hits",
            "Blob and manifest requests answered from the cache",
            cache_hits.clone(),
        );
        registry.register(
            "cache_misses",
            "Blob and manifest requests that needed the upstream",
            cache_misses.clone(),
        );
        registry.register(
            "cache_used_bytes",
            "Bytes held in the cache",
            cache_bytes.clone(),
        );
        registry.register(
            "cache_budget_bytes",
            "Cache budget",
            cache_budget_bytes.clone(),
        );
        registry.register("evictions", "Blobs evicted by GC", evictions.clone());
        registry.register(
            "stale_tags_served",
            "Tags answered from cache because the upstream was unreachable",
            stale_tags_served.clone(),
        );
        registry.register(
            "taken_from_holders",
            "Manifests and small blobs the registry could not give, taken from other nodes that hold them",
            taken_from_holders.clone(),
        );
        registry.register(
            "upstream_errors",
            "Upstream requests that failed",
            upstream_errors.clone(),
        );
        Self {
            registry,
            requests,
            bytes_served,
            upstream_bytes,
            blob_seconds,
            blob_first_byte_seconds,
            cache_hits,
            cache_misses,
            cache_bytes,
            cache_budget_bytes,
            evictions,
            stale_tags_served,
            taken_from_holders,
            upstream_errors,
            disk_full,
            connections_refused,
            connections_open,
            error_responses,
        }
    }
}

impl Metrics {
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
