//! `starling sim`: run a scenario, print a table or JSON, write SVG charts.

use std::path::PathBuf;
use std::time::Instant;

use crate::report::{self, Report, SweepPoint};
use crate::scenario::Scenario;
use crate::Error;

#[derive(Clone, Debug, clap::Args)]
#[command(
    about = "Simulate pulling an image onto N nodes with each strategy (drives the real tracker and piece scheduler)"
)]
pub struct SimArgs {
    /// Scenario file (TOML), e.g. scenarios/swarm16.toml.
    pub scenario: PathBuf,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write SVG charts (time-to-ready CDF; time vs nodes with a sweep) into this directory.
    #[arg(long)]
    pub svg_dir: Option<PathBuf>,
    /// Override the job's node count.
    #[arg(long)]
    pub nodes: Option<usize>,
    /// Run only these strategies (by name; repeatable).
    #[arg(long = "strategy")]
    pub strategies: Vec<String>,
    /// Override the piece size every agent proposes (e.g. 4MiB), or "auto" for the
    /// agent's rule.
    #[arg(long)]
    pub piece_size: Option<String>,
    /// Override `sim.seed`: draws the pseudo-random latencies (who wins a source race)
    /// anew.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Override the rate-recompute quantum in ms (0 = exact event-driven).
    #[arg(long)]
    pub quantum_ms: Option<f64>,
    /// Override the registry's total egress (e.g. 50MiB/s).
    #[arg(long)]
    pub registry_egress: Option<String>,
    /// Override Starling's per-node upload and download limits (e.g. 25MiB/s).
    #[arg(long)]
    pub node_limit: Option<String>,
    /// Read the image's blobs from this OCI layout instead of the scenario's layers: the
    /// config and the layers, in the order a pull client fetches them.
    #[arg(long)]
    pub oci_layout: Option<PathBuf>,
    /// Job sizes for the time-vs-nodes chart, e.g. 16,64,256 (overrides the scenario's).
    #[arg(long, value_delimiter = ',')]
    pub sweep: Option<Vec<usize>>,
    /// Drop racks and zones (every node "far" from every other; no rack links).
    #[arg(long)]
    pub no_topology: bool,
    /// Skip the scenario's sweep (time-vs-nodes) runs.
    #[arg(long, conflicts_with = "sweep")]
    pub no_sweep: bool,
}

/// Loads the scenario with the command line's overrides applied.
pub fn load(args: &SimArgs) -> Result<Scenario, Error> {
    let mut sc = Scenario::load(&args.scenario)?;
    if let Some(n) = args.nodes {
        sc.job.nodes = n;
        if sc.cluster.nodes.is_some_and(|c| c < n) {
            sc.cluster.nodes = Some(n);
        }
    }
    if let Some(p) = &args.piece_size {
        sc.starling.piece_size = if p.trim() == "auto" {
            None
        } else {
            Some(crate::scenario::Bytes(
                crate::scenario::parse_bytes(p).map_err(|e| Error::Scenario(e.to_string()))?,
            ))
        };
    }
    if let Some(seed) = args.seed {
        sc.sim.seed = seed;
    }
    if let Some(q) = args.quantum_ms {
        sc.sim.quantum_ms = q;
    }
    if let Some(r) = &args.registry_egress {
        sc.registry.egress = crate::scenario::Rate(
            crate::scenario::parse_rate(r).map_err(|e| Error::Scenario(e.to_string()))?,
        );
    }
    if let Some(r) = &args.node_limit {
        let v = crate::scenario::Rate(
            crate::scenario::parse_rate(r).map_err(|e| Error::Scenario(e.to_string()))?,
        );
        sc.starling.upload_limit = Some(v);
        sc.starling.download_limit = Some(v);
    }
    if let Some(dir) = &args.oci_layout {
        sc.image.layers =
            crate::model::pull_blobs_from_oci_layout(dir, sc.image.reference.as_deref())?;
    }
    if let Some(s) = &args.sweep {
        sc.job.sweep_nodes = s.clone();
    }
    if args.no_topology {
        sc.cluster.nodes_per_rack = 0;
        sc.cluster.racks_per_zone = 0;
    }
    if args.no_sweep {
        sc.job.sweep_nodes.clear();
    }
    if !args.strategies.is_empty() {
        let names: Vec<String> = sc.strategies.iter().map(|s| s.label()).collect();
        for want in &args.strategies {
            if !names.contains(want) {
                return Err(Error::Scenario(format!(
                    "no strategy `{want}` (have: {})",
                    names.join(", ")
                )));
            }
        }
        sc.strategies
            .retain(|s| args.strategies.contains(&s.label()));
    }
    sc.validate()?;
    Ok(sc)
}

/// Runs every strategy of the scenario (and the sweep) and builds the report.
pub fn simulate_all(sc: &Scenario) -> Result<Report, Error> {
    let wall = Instant::now();
    let n = sc.job.nodes;
    let mut results = Vec::new();
    for spec in &sc.strategies {
        let plan = crate::strategy::Plan::new(sc, spec, n);
        let bytes: f64 = plan
            .job
            .iter()
            .map(|&j| {
                sc.image
                    .layers
                    .iter()
                    .zip(&plan.holds[j as usize])
                    .filter(|(_, h)| !**h)
                    .map(|(l, _)| l.size.0 as f64)
                    .sum::<f64>()
            })
            .sum::<f64>()
            / n as f64;
        // Layers someone must fetch (bound terms).
        let moving: Vec<f64> = (0..sc.image.layers.len())
            .filter(|&l| plan.job.iter().any(|&j| !plan.holds[j as usize][l]))
            .map(|l| sc.image.layers[l].size.0 as f64)
            .collect();
        let o = crate::engine::Engine::new(sc, &plan).run()?;
        results.push(report::result(sc, spec, n, o, bytes, &moving));
    }
    let mut sweep = Vec::new();
    for &m in &sc.job.sweep_nodes {
        let mut s2 = sc.clone();
        s2.job.nodes = m;
        if s2.cluster.nodes.is_some_and(|c| c < m) {
            s2.cluster.nodes = Some(m);
        }
        for spec in &sc.strategies {
            let o = crate::engine::simulate(&s2, spec, m)?;
            let mut r = o.ready_s.clone();
            r.sort_by(f64::total_cmp);
            sweep.push(SweepPoint {
                strategy: spec.label(),
                nodes: m,
                stuck_nodes: o.stuck,
                p50_s: report::percentile(&r, 50.0),
                max_s: r.last().copied().unwrap_or(f64::NAN),
                registry_bytes: o.registry_bytes,
            });
        }
    }
    Ok(Report {
        scenario: if sc.name.is_empty() {
            "scenario".into()
        } else {
            sc.name.clone()
        },
        description: sc.description.clone(),
        nodes: n,
        image_bytes: sc.image.layers.iter().map(|l| l.size.0).sum(),
        piece_size: sc.starling.piece_size.map_or(0, |b| b.0),
        warnings: sc.warnings.clone(),
        quantum_ms: sc.sim.quantum_ms,
        results,
        sweep,
        wall_s: wall.elapsed().as_secs_f64(),
        peak_rss_kib: report::peak_rss_kib(),
    })
}

/// The `starling sim` entry point. Returns the process exit code (1 when some node
/// never became ready).
pub fn run(args: &SimArgs) -> Result<i32, Error> {
    let sc = load(args)?;
    let rep = simulate_all(&sc)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rep).map_err(|e| Error::Io(e.to_string()))?
        );
    } else {
        print!("{}", rep.table());
    }
    if let Some(dir) = &args.svg_dir {
        for p in rep.write_svgs(dir)? {
            if !args.json {
                println!("wrote {}", p.display());
            }
        }
    }
    Ok(if rep.results.iter().any(|r| r.stuck_nodes > 0) {
        1
    } else {
        0
    })
}

/// Runs this process again with glibc's heap on transparent huge pages
/// (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`), once, unless the variable is set
/// already; returns only if that cannot be done. A 10,000-node run reads ~600 MiB of
/// schedulers at random, one cache line here and there, and with 4 KiB pages most of
/// those reads also missed the TLB: huge pages took 17–21 % off the wall time of the
/// 1,000-node scenario, with the same simulated results (BENCHMARKS.md, issue 11,
/// seventh session). Where THP is off, or not glibc, the variable does nothing. For
/// the binaries' `main`, before any thread starts.
pub fn reexec_with_huge_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        /// Where glibc reads its malloc tunables from, at start only.
        const GLIBC_TUNABLES: &str = "GLIBC_TUNABLES";
        if std::env::var_os(GLIBC_TUNABLES).is_some() {
            return;
        }
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let mut args = std::env::args_os();
        let mut cmd = std::process::Command::new(exe);
        if let Some(arg0) = args.next() {
            cmd.arg0(arg0);
        }
        // `exec` returns only on failure: then the run goes on without.
        let _ = cmd
            .args(args)
            .env(GLIBC_TUNABLES, "glibc.malloc.hugetlb=1")
            .exec();
    }
}
