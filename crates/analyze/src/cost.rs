//! Distribution cost: how many bytes a node pulls, and how long N nodes take at
//! given bandwidths, directly from the origin versus peer to peer.
//!
//! For one blob of S bytes to N nodes, the lower bound with P2P is
//! `T* = max(S/U_origin, S/D_node, N·S/(U_origin + N·U_node))`; every node pulling
//! straight from the origin takes `max(N·S/U_origin, S/D_node)`.

use serde::Serialize;

use crate::error::{Error, Result};

/// Bandwidths in bytes per second.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Bandwidths {
    pub origin_up: f64,
    pub node_down: f64,
    pub node_up: f64,
}

impl Default for Bandwidths {
    /// 10 Gbit/s origin, 25 Gbit/s node NICs.
    fn default() -> Self {
        Self {
            origin_up: 10e9 / 8.0,
            node_down: 25e9 / 8.0,
            node_up: 25e9 / 8.0,
        }
    }
}

/// Seconds for every node to hold S bytes pulled straight from the origin.
pub fn direct_seconds(s: u64, n: u64, bw: &Bandwidths) -> f64 {
    let s = s as f64;
    let n = n.max(1) as f64;
    (n * s / bw.origin_up).max(s / bw.node_down)
}

/// Lower bound in seconds with peer-to-peer distribution.
pub fn p2p_seconds(s: u64, n: u64, bw: &Bandwidths) -> f64 {
    let s = s as f64;
    let n = n.max(1) as f64;
    (s / bw.origin_up)
        .max(s / bw.node_down)
        .max(n * s / (bw.origin_up + n * bw.node_up))
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Estimate {
    pub bytes: u64,
    pub nodes: u64,
    pub direct_seconds: f64,
    pub p2p_seconds: f64,
}

impl Estimate {
    pub fn new(bytes: u64, nodes: u64, bw: &Bandwidths) -> Self {
        Self {
            bytes,
            nodes,
            direct_seconds: direct_seconds(bytes, nodes, bw),
            p2p_seconds: p2p_seconds(bytes, nodes, bw),
        }
    }
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct DistributionCost {
    /// Bytes a node with nothing cached pulls (all layers, compressed).
    pub cold_bytes: u64,
    /// Bytes a node holding the previous version pulls after a code-only change:
    /// the first code layer and every layer after it (their build cache is invalidated).
    pub update_bytes: u64,
    /// Layer the code-only estimate starts from.
    pub update_from_layer: Option<usize>,
    /// True when no code layer was recognized and the last layer was assumed.
    pub update_assumed: bool,
    pub bandwidths: Bandwidths,
    pub cold: Estimate,
    pub update: Estimate,
}

/// Computes the cost from compressed layer sizes and the first code layer.
pub fn distribution_cost(
    layer_sizes: &[u64],
    code_layer: Option<usize>,
    nodes: u64,
    bw: Bandwidths,
) -> DistributionCost {
    let cold_bytes: u64 = layer_sizes.iter().sum();
    let (from, assumed) = match code_layer {
        Some(c) => (Some(c), false),
        None if layer_sizes.is_empty() => (None, true),
        None => (Some(layer_sizes.len() - 1), true),
    };
    let update_bytes = from.map(|f| layer_sizes[f..].iter().sum()).unwrap_or(0);
    DistributionCost {
        cold_bytes,
        update_bytes,
        update_from_layer: from,
        update_assumed: assumed,
        bandwidths: bw,
        cold: Estimate::new(cold_bytes, nodes, &bw),
        update: Estimate::new(update_bytes, nodes, &bw),
    }
}

/// Parses a bandwidth: `10Gbit`, `10Gbps`, `25Gb/s`, `1.25GB/s`, `800MiB/s`, or a
/// plain number of bytes per second (the project's one rate parser).
pub fn parse_bandwidth(s: &str) -> Result<f64> {
    oci::size::parse_rate(s).map_err(|e| Error::Argument(format!("bandwidth {e}")))
}

/// Parses a size: `123`, `500MiB`, `2GB`, `1.5GiB`, `10k` (the project's one parser).
pub fn parse_size(s: &str) -> Result<u64> {
    oci::size::parse_size(s).map_err(|e| Error::Argument(e.to_string()))
}

pub fn human_seconds(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 120.0 {
        format!("{s:.1} s")
    } else if s < 7200.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        let bw = Bandwidths {
            origin_up: 100.0,
            node_down: 50.0,
            node_up: 10.0,
        };
        // S=1000, N=10: direct = max(10*1000/100, 1000/50) = 100
        assert_eq!(direct_seconds(1000, 10, &bw), 100.0);
        // p2p = max(10, 20, 10*1000/(100+100)=50) = 50
        assert_eq!(p2p_seconds(1000, 10, &bw), 50.0);
        // one node: both are the download bound
        assert_eq!(direct_seconds(1000, 1, &bw), 20.0);
        assert_eq!(p2p_seconds(1000, 1, &bw), 20.0);
        let c = distribution_cost(&[100, 200, 300], Some(1), 4, bw);
        assert_eq!(
            (c.cold_bytes, c.update_bytes, c.update_assumed),
            (600, 500, false)
        );
        let c = distribution_cost(&[100, 200, 300], None, 4, bw);
        assert_eq!(
            (c.update_bytes, c.update_from_layer, c.update_assumed),
            (300, Some(2), true)
        );
    }

    #[test]
    fn units() {
        assert_eq!(parse_bandwidth("10Gbit").unwrap(), 1.25e9);
        assert_eq!(parse_bandwidth("10Gbps").unwrap(), 1.25e9);
        assert_eq!(parse_bandwidth("1.25GB/s").unwrap(), 1.25e9);
        assert_eq!(parse_bandwidth("100MiB/s").unwrap(), 104857600.0);
        assert_eq!(parse_bandwidth("1000").unwrap(), 1000.0);
        assert!(parse_bandwidth("fast").is_err());
        assert_eq!(parse_size("500MiB").unwrap(), 524288000);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("17").unwrap(), 17);
        assert!(parse_size("3 parsecs").is_err());
        assert_eq!(oci::size::format_size(1536), "1.50 KiB");
    }
}
