//! Results: per strategy time-to-ready percentiles, registry egress and cross-rack
//! bytes; a text table, JSON, and hand-written SVG charts (CDF of time-to-ready per
//! strategy; time vs nodes when the scenario sweeps job sizes).

use oci::size::format_size;
use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::engine::Outcome;
use crate::scenario::{Scenario, StrategySpec, Transport};
use crate::Error;

#[derive(Clone, Debug, Serialize)]
pub struct StrategyResult {
    pub strategy: String,
    pub kind: String,
    pub transport: String,
    pub nodes: usize,
    pub p50_s: f64,
    pub p99_s: f64,
    pub max_s: f64,
    pub mean_s: f64,
    pub registry_bytes: f64,
    pub cache_bytes: f64,
    pub p2p_bytes: f64,
    /// Bytes that entered a rack from outside it (peers elsewhere, the registry, the
    /// cache).
    pub cross_rack_bytes: f64,
    /// `cross_rack_bytes` ÷ (racks × bytes a node needed): 1 means each rack took
    /// the image from outside exactly once.
    pub cross_rack_multiple: f64,
    pub racks: usize,
    /// Bytes each job node had to fetch (layers it did not hold), averaged.
    pub bytes_per_node: f64,
    /// Physical limit for the bytes moved (the largest of `bound_terms`).
    pub bound_s: f64,
    pub bound_terms: Bound,
    pub source_elections: u32,
    /// Registry bytes each swarm source streamed, by node (which agents the tracker
    /// elected decides how fast the image enters the cluster).
    pub source_bytes: std::collections::BTreeMap<String, f64>,
    pub registry_connections: u64,
    #[serde(flatten)]
    pub counters: crate::engine::SwarmCounters,
    /// Time to first byte of swarm blobs on nodes that did not fetch them from the
    /// registry (the demo's `non_seed_first_byte_*`).
    pub non_seed_ttfb_p50_s: f64,
    pub non_seed_ttfb_p95_s: f64,
    pub non_seed_ttfb_max_s: f64,
    pub steps: u64,
    pub stuck_nodes: usize,
    pub wall_s: f64,
    pub tracker_wall_s: f64,
    pub scheduler_wall_s: f64,
    pub solver_wall_s: f64,
    #[serde(skip)]
    pub ready_s: Vec<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct SweepPoint {
    pub strategy: String,
    pub nodes: usize,
    /// Nodes that never became ready (p50/max are over the others).
    pub stuck_nodes: usize,
    pub p50_s: f64,
    pub max_s: f64,
    pub registry_bytes: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub scenario: String,
    pub description: String,
    pub nodes: usize,
    pub image_bytes: u64,
    /// The piece size every agent proposes (0: the agent's rule, per blob).
    pub piece_size: u64,
    /// Scenario keys accepted but ignored.
    pub warnings: Vec<String>,
    pub quantum_ms: f64,
    pub results: Vec<StrategyResult>,
    pub sweep: Vec<SweepPoint>,
    pub wall_s: f64,
    /// Peak resident set of this process (VmHWM), KiB; `None` off Linux.
    pub peak_rss_kib: Option<u64>,
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    // Nearest rank.
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The terms of the physical bound, each a time no strategy can beat.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Bound {
    /// Every byte leaves the registry once: S / U_registry, where U_registry is the
    /// registry's total egress, or the per-connection cap times the connections the
    /// strategy opens if that is less (`registry_note` says which).
    pub registry_s: f64,
    pub registry_note: String,
    /// The largest layer through the connections that carry it.
    pub largest_layer_s: f64,
    /// Every node receives S at its download rate (NIC, disk, download limit).
    pub download_s: f64,
    /// N·S bytes through the registry plus every node's upload (P2P), or N·S through
    /// the registry (direct), or through the cache.
    pub upload_s: f64,
}

impl Bound {
    pub fn max(&self) -> f64 {
        self.registry_s
            .max(self.largest_layer_s)
            .max(self.download_s)
            .max(self.upload_s)
    }
}

/// The number of registry connections one blob's source opens, and the registry
/// rate they can draw: one per slice (`registry_streams_for`), capped per connection.
fn registry_rate(sc: &Scenario, connections: u32) -> (f64, String) {
    let reg = sc.registry.egress.0;
    match sc.registry.per_connection {
        Some(c) if c.0 * connections as f64 <= reg => (
            c.0 * connections as f64,
            format!(
                "{connections} connections × {:.2} Gbit/s per connection (below the {:.2} Gbit/s egress)",
                c.0 * 8e-9,
                reg * 8e-9
            ),
        ),
        Some(c) => (
            reg,
            format!(
                "registry egress {:.2} Gbit/s ({connections} connections × {:.2} Gbit/s per connection would carry more)",
                reg * 8e-9,
                c.0 * 8e-9
            ),
        ),
        None => (reg, format!("registry egress {:.2} Gbit/s", reg * 8e-9)),
    }
}

/// The transfer-time lower bound for `n` nodes each fetching the layers `moving`
/// (sizes, bytes).
pub fn bound(sc: &Scenario, transport: Transport, n: usize, moving: &[f64]) -> Bound {
    let s: f64 = moving.iter().sum();
    let largest = moving.iter().copied().fold(0.0, f64::max);
    if s <= 0.0 || n == 0 {
        return Bound::default();
    }
    let mut down = sc.cluster.nic_down.0;
    if let Some(d) = sc.cluster.disk_write {
        down = down.min(d.0);
    }
    let mut up = sc.cluster.nic_up.0;
    let reg = sc.registry.egress.0;
    let conn = sc.registry.per_connection.map_or(f64::INFINITY, |r| r.0);
    let nf = n as f64;
    match transport {
        Transport::Direct => {
            // Every node pulls every layer over its own connection.
            let (u, note) = registry_rate(sc, (n * moving.len()) as u32);
            Bound {
                registry_s: nf * s / u,
                registry_note: note,
                largest_layer_s: largest / down.min(conn),
                download_s: s / down,
                upload_s: 0.0,
            }
        }
        Transport::SharedCache => {
            let (u, note) = registry_rate(sc, moving.len() as u32);
            Bound {
                registry_s: s / u,
                registry_note: note,
                largest_layer_s: largest / reg.min(conn),
                download_s: s / down,
                upload_s: nf * s / sc.cache.egress.0,
            }
        }
        Transport::P2p => {
            if let Some(l) = sc.starling.upload_limit {
                up = up.min(l.0);
            }
            if let Some(l) = sc.starling.download_limit {
                down = down.min(l.0);
            }
            // One source per layer, each over `registry_streams_for` connections, all
            // at once; the source's own download rate caps each layer's intake.
            let k = |b: f64| {
                swarm::pieces::registry_streams_for(b as u64, sc.starling.registry_streams)
            };
            let total_conns: u32 = moving.iter().map(|&b| k(b)).sum();
            let (u, note) = registry_rate(sc, total_conns);
            let u_largest = reg.min(conn * k(largest) as f64).min(down);
            Bound {
                registry_s: s / u,
                registry_note: note,
                largest_layer_s: largest / u_largest,
                download_s: s / down,
                upload_s: nf * s / (u + nf * up),
            }
        }
    }
}

fn percentile_or_nan(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(v, p)
}

pub fn result(
    sc: &Scenario,
    spec: &StrategySpec,
    nodes: usize,
    o: Outcome,
    bytes_per_node: f64,
    moving: &[f64],
) -> StrategyResult {
    let mut r = o.ready_s.clone();
    r.sort_by(f64::total_cmp);
    let mean = if r.is_empty() {
        f64::NAN
    } else {
        r.iter().sum::<f64>() / r.len() as f64
    };
    let racks = if sc.cluster.nodes_per_rack == 0 {
        1
    } else {
        sc.cluster_nodes().div_ceil(sc.cluster.nodes_per_rack)
    };
    let b = bound(sc, spec.transport(), nodes, moving);
    let mut ttfb = o.non_seed_ttfb.clone();
    StrategyResult {
        strategy: spec.label(),
        kind: format!("{:?}", spec.kind).to_lowercase(),
        transport: format!("{:?}", spec.transport()).to_lowercase(),
        nodes,
        p50_s: percentile(&r, 50.0),
        p99_s: percentile(&r, 99.0),
        max_s: r.last().copied().unwrap_or(f64::NAN),
        mean_s: mean,
        registry_bytes: o.registry_bytes,
        cache_bytes: o.cache_bytes,
        p2p_bytes: o.p2p_bytes,
        cross_rack_bytes: o.cross_rack_bytes,
        cross_rack_multiple: if bytes_per_node > 0.0 {
            o.cross_rack_bytes / (racks as f64 * bytes_per_node)
        } else {
            0.0
        },
        racks,
        bytes_per_node,
        bound_s: b.max(),
        bound_terms: b,
        source_elections: o.source_elections,
        source_bytes: o.source_bytes,
        registry_connections: o.registry_connections,
        counters: o.counters,
        non_seed_ttfb_p50_s: percentile_or_nan(&mut ttfb, 50.0),
        non_seed_ttfb_p95_s: percentile_or_nan(&mut ttfb, 95.0),
        non_seed_ttfb_max_s: ttfb.last().copied().unwrap_or(f64::NAN),
        steps: o.steps,
        stuck_nodes: o.stuck,
        wall_s: o.wall_s,
        tracker_wall_s: o.tracker_wall_s,
        scheduler_wall_s: o.scheduler_wall_s,
        solver_wall_s: o.solver_wall_s,
        ready_s: r,
    }
}

/// VmHWM of this process in KiB (Linux).
pub fn peak_rss_kib() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub fn human_secs(s: f64) -> String {
    if !s.is_finite() {
        "-".into()
    } else if s >= 120.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{s:.1} s")
    }
}

impl Report {
    pub fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "scenario {}: {} nodes, image {}, pieces {}{}",
            self.scenario,
            self.nodes,
            format_size(self.image_bytes),
            if self.piece_size == 0 {
                "by the agent's rule".to_owned()
            } else {
                format_size(self.piece_size)
            },
            if self.quantum_ms > 0.0 {
                format!(", quantum {} ms", self.quantum_ms)
            } else {
                String::new()
            }
        );
        if !self.description.is_empty() {
            let _ = writeln!(t, "  {}", self.description);
        }
        for w in &self.warnings {
            let _ = writeln!(t, "  warning: {w}");
        }
        let _ = writeln!(
            t,
            "{:<22} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12} {:>12} {:>6}",
            "strategy", "p50", "p99", "max", "bound", "registry", "cross-rack", "p2p", "wall"
        );
        for r in &self.results {
            let _ = writeln!(
                t,
                "{:<22} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12} {:>12} {:>5.1}s{}",
                r.strategy,
                human_secs(r.p50_s),
                human_secs(r.p99_s),
                human_secs(r.max_s),
                human_secs(r.bound_s),
                format_size(r.registry_bytes as u64),
                format_size(r.cross_rack_bytes as u64),
                format_size(r.p2p_bytes as u64),
                r.wall_s,
                if r.stuck_nodes > 0 {
                    format!("  ({} nodes never ready)", r.stuck_nodes)
                } else {
                    String::new()
                }
            );
        }
        for r in self.results.iter().filter(|r| r.transport == "p2p") {
            let b = &r.bound_terms;
            let _ = writeln!(
                t,
                "  {}: bound {} = max(registry {} [{}], largest layer {}, download {}, upload {}); cross-rack {:.2} × (racks × image); {} requests, {} busy, {} retargeted, {} hash waits",
                r.strategy,
                human_secs(r.bound_s),
                human_secs(b.registry_s),
                b.registry_note,
                human_secs(b.largest_layer_s),
                human_secs(b.download_s),
                human_secs(b.upload_s),
                r.cross_rack_multiple,
                r.counters.requests,
                r.counters.busy_rejects,
                r.counters.retargets,
                r.counters.hash_waits
            );
        }
        if !self.sweep.is_empty() {
            let _ = writeln!(t, "time vs nodes (max time-to-ready):");
            for p in &self.sweep {
                let stuck = if p.stuck_nodes > 0 {
                    format!("  ({} never ready)", p.stuck_nodes)
                } else {
                    String::new()
                };
                let _ = writeln!(
                    t,
                    "  {:<22} N={:<6} p50 {:>9}  max {:>9}  registry {}{stuck}",
                    p.strategy,
                    p.nodes,
                    human_secs(p.p50_s),
                    human_secs(p.max_s),
                    format_size(p.registry_bytes as u64)
                );
            }
        }
        if self.results.iter().any(|r| r.stuck_nodes > 0) {
            let _ = writeln!(t, "note: percentiles are over the nodes that became ready; \"never ready\" = no transfer completed anywhere for sim.stall_seconds");
        }
        let _ = writeln!(
            t,
            "simulated in {:.2} s, peak RSS {}",
            self.wall_s,
            self.peak_rss_kib.map_or("unknown".into(), |k| format!(
                "{:.1} MiB",
                k as f64 / 1024.0
            ))
        );
        t
    }

    /// Writes `cdf.svg` and, with a sweep, `time_vs_nodes.svg` into `dir`.
    pub fn write_svgs(&self, dir: &Path) -> Result<Vec<std::path::PathBuf>, Error> {
        std::fs::create_dir_all(dir).map_err(|e| Error::Io(format!("{}: {e}", dir.display())))?;
        let mut written = Vec::new();
        let series: Vec<(String, Vec<(f64, f64)>)> = self
            .results
            .iter()
            .map(|r| {
                let n = r.ready_s.len().max(1) as f64;
                let mut pts = vec![(0.0, 0.0)];
                for (i, &t) in r.ready_s.iter().enumerate() {
                    pts.push((t, i as f64 / n));
                    pts.push((t, (i + 1) as f64 / n));
                }
                (r.strategy.clone(), pts)
            })
            .collect();
        let p = dir.join(format!("{}-cdf.svg", self.file_stem()));
        let svg = chart(
            &format!(
                "{}: time-to-ready CDF ({} nodes)",
                self.scenario, self.nodes
            ),
            "seconds",
            "fraction of nodes ready",
            &series,
            false,
        );
        std::fs::write(&p, svg).map_err(|e| Error::Io(format!("{}: {e}", p.display())))?;
        written.push(p);
        if !self.sweep.is_empty() {
            let mut names: Vec<String> = Vec::new();
            for s in &self.sweep {
                if !names.contains(&s.strategy) {
                    names.push(s.strategy.clone());
                }
            }
            // Sizes where some node never became ready are left out of the line.
            let series: Vec<(String, Vec<(f64, f64)>)> = names
                .iter()
                .map(|n| {
                    (
                        n.clone(),
                        self.sweep
                            .iter()
                            .filter(|s| &s.strategy == n && s.stuck_nodes == 0)
                            .map(|s| (s.nodes as f64, s.max_s))
                            .collect(),
                    )
                })
                .collect();
            let p = dir.join(format!("{}-time-vs-nodes.svg", self.file_stem()));
            let svg = chart(
                &format!("{}: all-nodes time vs job size", self.scenario),
                "nodes",
                "seconds until every node is ready",
                &series,
                true,
            );
            std::fs::write(&p, svg).map_err(|e| Error::Io(format!("{}: {e}", p.display())))?;
            written.push(p);
        }
        Ok(written)
    }

    fn file_stem(&self) -> String {
        let s: String = self
            .scenario
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        if s.is_empty() {
            "sim".into()
        } else {
            s
        }
    }
}

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn nice_max(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * mag >= v {
            return m * mag;
        }
    }
    10.0 * mag
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A line chart as SVG text. `markers`: draw points (sweep charts).
pub fn chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(String, Vec<(f64, f64)>)],
    markers: bool,
) -> String {
    let (w, h, l, r, t, b) = (760.0, 440.0, 70.0, 200.0, 40.0, 50.0);
    let xmax = nice_max(
        series
            .iter()
            .flat_map(|s| s.1.iter().map(|p| p.0))
            .filter(|x| x.is_finite())
            .fold(0.0, f64::max),
    );
    let ymax = nice_max(
        series
            .iter()
            .flat_map(|s| s.1.iter().map(|p| p.1))
            .filter(|x| x.is_finite())
            .fold(0.0, f64::max),
    );
    let px = |x: f64| l + (x / xmax) * (w - l - r);
    let py = |y: f64| h - b - (y / ymax) * (h - t - b);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        (l + w - r) / 2.0,
        esc(title)
    );
    for i in 0..=5 {
        let fx = xmax * i as f64 / 5.0;
        let fy = ymax * i as f64 / 5.0;
        let _ = writeln!(
            s,
            r##"<line x1="{x}" y1="{}" x2="{x}" y2="{}" stroke="#ddd"/><text x="{x}" y="{}" text-anchor="middle">{}</text>"##,
            t,
            h - b,
            h - b + 16.0,
            fmt_tick(fx),
            x = px(fx)
        );
        let _ = writeln!(
            s,
            r##"<line x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
            l,
            w - r,
            l - 6.0,
            py(fy) + 4.0,
            fmt_tick(fy),
            y = py(fy)
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{l}" y="{t}" width="{}" height="{}" fill="none" stroke="black"/>"#,
        w - l - r,
        h - t - b
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (l + w - r) / 2.0,
        h - 10.0,
        esc(xlabel)
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>"#,
        (t + h - b) / 2.0,
        (t + h - b) / 2.0,
        esc(ylabel)
    );
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let d: Vec<String> = pts
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            d.join(" ")
        );
        if markers {
            for &(x, y) in pts.iter().filter(|p| p.0.is_finite() && p.1.is_finite()) {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#,
                    px(x),
                    py(y)
                );
            }
        }
        let ly = t + 14.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            w - r + 10.0,
            w - r + 30.0,
            w - r + 36.0,
            ly + 4.0,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_tick(v: f64) -> String {
    if v == 0.0 || v.abs() >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}
