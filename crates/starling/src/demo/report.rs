//! What `starling demo` and `starling bench swarm` report: per node, per blob's first
//! bytes, and the run against the physical bound.

use serde::Serialize;

#[derive(Serialize)]
pub(super) struct NodeReport {
    /// Time to first byte of each swarm blob this node did not fetch from the
    /// registry (seconds), the figure a non-seeding node waits.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) non_seed_first_byte_seconds: Vec<f64>,
    pub(super) node: String,
    pub(super) seconds: f64,
    pub(super) first_byte_seconds: f64,
    pub(super) bytes_from_peers: u64,
    pub(super) bytes_from_registry: u64,
    pub(super) bytes_uploaded: u64,
    /// Peers this node reported unreachable, downloads whose rack stripe went quiet
    /// and downloaders it cut off for not reading: the swarm's safety nets, 0 in a
    /// healthy run.
    pub(super) peers_unreachable: u64,
    /// Peers it reported for sending nothing they were asked for in 30 s.
    pub(super) peers_silent: u64,
    pub(super) stripes_distrusted: u64,
    pub(super) readers_stalled: u64,
}

/// When each node asked for a swarm blob and when its first byte came, from the start
/// of that node's pull (the pulls start together): lines a non-seed's first byte up
/// against the elected source's, which no peer can beat.
#[derive(Serialize)]
pub(super) struct BlobFirstBytes {
    pub(super) bytes: u64,
    pub(super) piece_size: u64,
    /// (requested at, first byte at) on the node that fetched it from the registry.
    pub(super) source: Option<(f64, f64)>,
    /// (requested at, first byte at) on every other node.
    pub(super) non_seeds: Vec<(f64, f64)>,
}

#[derive(Serialize)]
pub(super) struct Report {
    pub(super) nodes: usize,
    pub(super) image_bytes: u64,
    pub(super) layers: usize,
    pub(super) registry_limit_bytes_per_sec: u64,
    pub(super) registry_latency_ms: u64,
    pub(super) node_limit_bytes_per_sec: u64,
    /// What the agents were told to propose ("auto": the rule).
    pub(super) piece_size: String,
    /// The piece sizes the swarms used, by blob size.
    pub(super) swarm_piece_sizes: Vec<(u64, u64)>,
    pub(super) registry_bytes: u64,
    pub(super) registry_bytes_ratio: f64,
    pub(super) all_nodes_seconds: f64,
    pub(super) bound_seconds: f64,
    pub(super) ratio_to_bound: f64,
    pub(super) direct_all_nodes_seconds: Option<f64>,
    pub(super) direct_registry_bytes: Option<u64>,
    pub(super) speedup_vs_direct: Option<f64>,
    pub(super) per_node: Vec<NodeReport>,
    pub(super) agent_cpu_seconds_per_gib: f64,
    pub(super) agent_peak_rss_mib_max: f64,
    /// The whole machine's CPU busy fraction during the P2P run (all processes: the
    /// agents, the pulling clients, the registry): near 1 means CPU-bound.
    pub(super) machine_cpu_busy: f64,
    /// Part of that the hypervisor took for other guests (steal time).
    pub(super) machine_cpu_steal: f64,
    /// The machine's fraction waiting on the disk (writeback throttling): a run can be
    /// disk-bound at a low busy fraction.
    pub(super) machine_cpu_iowait: f64,
    /// One core's sha256 rate measured just before the run (MB/s): compare runs made
    /// at different times with it.
    pub(super) sha256_reference_mb_per_s: f64,
    /// CPU-seconds one core spent per GiB written into fresh page cache, measured
    /// before the agents start (`machine::page_cache_write_cpu_s_per_gib`): part of
    /// `agent_cpu_seconds_per_gib` that is the machine's, not Starling's. Null where it
    /// could not be measured.
    pub(super) page_cache_write_reference_cpu_s_per_gib: Option<f64>,
    /// Whether `--pretouch` backed the page cache's memory before the run.
    pub(super) pretouch: bool,
    /// Whether the cluster ran with mutual TLS (`--tls`) or plain HTTP.
    pub(super) tls: bool,
    /// Time to first byte of swarm blobs on nodes that did not fetch them from the
    /// registry: 50th and 95th percentile and maximum (seconds).
    pub(super) non_seed_first_byte_p50: f64,
    pub(super) non_seed_first_byte_p95: f64,
    pub(super) non_seed_first_byte_max: f64,
    /// What the swarm adds to a non-seed's first byte: its first byte after the later
    /// of its own request and the elected source's first byte (seconds; 95th
    /// percentile). The source's own wait (the tracker's election and the registry's
    /// first byte) is in every non-seed's figure above and no peer can shorten it.
    pub(super) non_seed_first_byte_after_source_p95: f64,
    /// The agents' own share of a non-seed's first byte: from the request's arrival at
    /// the agent to its first body byte, for blobs served while they came through the
    /// swarm (`starling_agent_blob_first_byte_seconds{source="swarm"}` of every agent),
    /// 95th percentile as the upper bound of its histogram bucket (seconds). Beside the
    /// client's figure it tells the agents' wait from the harness's own queueing on a
    /// busy machine.
    pub(super) agent_swarm_first_byte_p95_le: Option<f64>,
    /// One piece of the largest blob at the node limit (seconds): the TTFB
    /// goal is this plus 20 ms.
    pub(super) piece_time_seconds: f64,
    /// Each swarm blob's request and first-byte times on every node, by blob size.
    pub(super) first_bytes_by_blob: Vec<BlobFirstBytes>,
    /// (seconds, bytes each agent had received from peers and the registry), every
    /// half second of the P2P run.
    pub(super) receive_series: CounterSeries,
    /// (seconds, bytes each agent had uploaded to peers), at the same instants: with
    /// the registry sending each byte once, the swarm meets T* only if the members'
    /// uplinks stay nearly full (N - 1 copies of the image through N uplinks).
    pub(super) upload_series: CounterSeries,
}

/// Per-agent counters sampled over a run: (seconds since the pulls began, one value
/// per agent).
pub(super) type CounterSeries = Vec<(f64, Vec<u64>)>;

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The upper bound of the histogram bucket that holds quantile `q` of `name`'s
/// observations with `label` (e.g. `source="swarm"`), summed over several Prometheus
/// text expositions. `None` without observations.
pub(super) fn histogram_quantile_le(
    texts: &[String],
    name: &str,
    label: &str,
    q: f64,
) -> Option<f64> {
    let prefix = format!("{name}_bucket{{");
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for line in texts.iter().flat_map(|t| t.lines()) {
        let Some(rest) = line.strip_prefix(&prefix) else {
            continue;
        };
        let Some((labels, count)) = rest.split_once("} ") else {
            continue;
        };
        if !labels.split(',').any(|l| l == label) {
            continue;
        }
        let Some(le) = labels
            .split(',')
            .find_map(|l| l.strip_prefix("le=\""))
            .map(|v| v.trim_end_matches('"'))
        else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            match le.parse::<f64>() {
                Ok(v) => v,
                Err(_) => continue,
            }
        };
        let Ok(count) = count.trim().parse::<f64>() else {
            continue;
        };
        match buckets.iter_mut().find(|(b, _)| *b == le) {
            Some(b) => b.1 += count,
            None => buckets.push((le, count)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = (q * total).ceil().max(1.0);
    buckets
        .iter()
        .find(|(_, cumulative)| *cumulative >= rank)
        .map(|(le, _)| *le)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histograms_quantile_is_its_buckets_upper_bound_summed_over_agents() {
        let agent = |fast: u32, slow: u32| {
            format!(
                "# TYPE x histogram\n\
                 x_bucket{{source=\"swarm\",le=\"0.01\"}} {fast}\n\
                 x_bucket{{source=\"swarm\",le=\"0.1\"}} {}\n\
                 x_bucket{{source=\"swarm\",le=\"+Inf\"}} {}\n\
                 x_bucket{{source=\"cache\",le=\"0.01\"}} 0\n\
                 x_bucket{{source=\"cache\",le=\"0.1\"}} 0\n\
                 x_bucket{{source=\"cache\",le=\"+Inf\"}} 50\n",
                fast + slow,
                fast + slow
            )
        };
        // 19 fast and 1 slow over two agents: the 95th is the 19th, fast.
        let texts = [agent(10, 0), agent(9, 1)];
        assert_eq!(
            histogram_quantile_le(&texts, "x", "source=\"swarm\"", 0.95),
            Some(0.01)
        );
        // One more slow one: the 95th of 21 is the 20th, slow.
        let texts = [agent(10, 1), agent(9, 1)];
        assert_eq!(
            histogram_quantile_le(&texts, "x", "source=\"swarm\"", 0.95),
            Some(0.1)
        );
        // Observations beyond the last finite bucket.
        assert_eq!(
            histogram_quantile_le(&texts, "x", "source=\"cache\"", 0.5),
            Some(f64::INFINITY)
        );
        assert_eq!(
            histogram_quantile_le(&texts, "x", "source=\"registry\"", 0.95),
            None
        );
    }
}
