//! Results: per strategy time-to-ready percentiles, registry egress and cross-rack
//! bytes; a text table, JSON, and hand-written SVG charts (CDF of time-to-ready per
//! strategy; time vs nodes when the scenario sweeps job sizes).

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
    pub cross_rack_bytes: f64,
    /// Bytes each job node had to fetch (layers it did not hold), averaged.
    pub bytes_per_node: f64,
    /// Physical limit for the bytes moved: direct pulls N·S/U_registry; otherwise
    /// max(S/U_origin, S/D_node, N·S/(U_origin + N·U_node)).
    pub bound_s: f64,
    pub source_elections: u32,
    /// Registry bytes each swarm source streamed, by node (which agents the tracker
    /// elected decides how fast the image enters the cluster).
    pub source_bytes: std::collections::BTreeMap<String, f64>,
    pub announces: u64,
    pub piece_transfers: u64,
    pub failed_requests: u64,
    pub refused_requests: u64,
    /// Piece requests that waited in line for an upload slot (large swarms).
    pub queued_requests: u64,
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
    pub piece_size: u64,
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

/// The transfer-time lower bound for `n` nodes each fetching `s` bytes.
pub fn bound(
    sc: &Scenario,
    transport: Transport,
    n: usize,
    s: f64,
    largest_layer: f64,
    layers: usize,
) -> f64 {
    if s <= 0.0 || n == 0 {
        return 0.0;
    }
    let mut down = sc.cluster.nic_down.0;
    if let Some(d) = sc.cluster.disk_write {
        down = down.min(d.0);
    }
    let mut up = sc.cluster.nic_up.0;
    let reg = sc.registry.egress.0;
    let conn = sc.registry.per_connection.map_or(f64::INFINITY, |r| r.0);
    let n = n as f64;
    match transport {
        Transport::Direct => (n * s / reg).max(s / down.min(conn)),
        Transport::SharedCache => (s / reg.min(conn * layers.max(1) as f64))
            .max(largest_layer / reg.min(conn))
            .max(s / down)
            .max(n * s / sc.cache.egress.0),
        Transport::P2p => {
            if let Some(l) = sc.starling.upload_limit {
                up = up.min(l.0);
            }
            if let Some(l) = sc.starling.download_limit {
                down = down.min(l.0);
            }
            // One source per layer, each on one registry connection.
            let origin = reg.min(conn * layers.max(1) as f64);
            (s / origin)
                .max(largest_layer / reg.min(conn))
                .max(s / down)
                .max(n * s / (origin + n * up))
        }
    }
}

pub fn result(
    sc: &Scenario,
    spec: &StrategySpec,
    nodes: usize,
    o: Outcome,
    bytes_per_node: f64,
    largest_layer: f64,
    layers: usize,
) -> StrategyResult {
    let mut r = o.ready_s.clone();
    r.sort_by(f64::total_cmp);
    let mean = if r.is_empty() {
        f64::NAN
    } else {
        r.iter().sum::<f64>() / r.len() as f64
    };
    let needing = nodes; // bound over the nodes of the job
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
        bytes_per_node,
        bound_s: bound(
            sc,
            spec.transport(),
            needing,
            bytes_per_node,
            largest_layer,
            layers,
        ),
        failed_requests: o.failed_requests,
        refused_requests: o.refused_requests,
        queued_requests: o.queued_requests,
        source_elections: o.source_elections,
        source_bytes: o.source_bytes,
        announces: o.announces,
        piece_transfers: o.piece_transfers,
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

pub fn human_bytes(b: f64) -> String {
    let units = ["B", "KB", "MB", "GB", "TB", "PB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1000.0 && i < units.len() - 1 {
        v /= 1000.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.2} {}", units[i])
    }
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
            "scenario {}: {} nodes, image {}, piece {}{}",
            self.scenario,
            self.nodes,
            human_bytes(self.image_bytes as f64),
            human_bytes(self.piece_size as f64),
            if self.quantum_ms > 0.0 {
                format!(", quantum {} ms", self.quantum_ms)
            } else {
                String::new()
            }
        );
        if !self.description.is_empty() {
            let _ = writeln!(t, "  {}", self.description);
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
                human_bytes(r.registry_bytes),
                human_bytes(r.cross_rack_bytes),
                human_bytes(r.p2p_bytes),
                r.wall_s,
                if r.stuck_nodes > 0 {
                    format!("  ({} nodes never ready)", r.stuck_nodes)
                } else {
                    String::new()
                }
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
                    human_bytes(p.registry_bytes)
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
