//! `starling demo`: a tracker and N agents as separate processes on loopback, a
//! synthetic training image behind an egress-limited origin playing the shared
//! registry, every node pulling at once, compared with the direct baseline and the
//! physical bound in the same run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

mod procs;
mod report;

use procs::wait_ready_with;
pub(crate) use procs::{free_port, metric, proc_usage, spawn, wait_ready, Procs};
use report::{
    histogram_quantile_le, percentile, BlobFirstBytes, CounterSeries, NodeReport, Report,
};

/// A run that spent this much of the machine waiting on the disk was held back by
/// writeback: on this project's 2-core VM, 4 × 100 MiB/s at 0.12–0.18 was 1.37–1.47 × T*
/// and 1.09–1.17 with the caches in memory (BENCHMARKS.md, thirty-ninth session).
const DISK_BOUND_IOWAIT: f64 = 0.1;

#[derive(Args, Clone)]
pub struct DemoArgs {
    /// Agents (nodes) pulling at once.
    #[arg(long, default_value_t = 8)]
    pub nodes: usize,
    /// Image size multiplier: 1.0 ≈ 4.9 GiB CUDA-like training image; default ≈ 250 MiB.
    #[arg(long, default_value_t = 0.05)]
    pub scale: f64,
    /// Registry egress limit per second (shared by all nodes).
    #[arg(long, default_value = "50MiB")]
    pub registry_limit: String,
    /// The registry's round trip, held before it answers each request (0: next door).
    /// A cloud registry or CDN answers in 10–100 ms, and a source pays it on every
    /// Range request of its registry runs.
    #[arg(long, default_value = "0s")]
    pub registry_latency: humantime::Duration,
    /// Per-node upload and download limit per second (emulated NIC).
    #[arg(long, default_value = "25MiB")]
    pub node_limit: String,
    /// Piece size the agents propose, or "auto" (the rule: from blob size and link).
    #[arg(long, default_value = "auto")]
    pub piece_size: String,
    #[arg(long, default_value = "1MiB")]
    pub p2p_threshold: String,
    /// Tracker announce interval while downloading.
    #[arg(long, default_value = "1s")]
    pub announce_interval: String,
    /// Pieces each agent sends at once (the agent's default).
    #[arg(long, default_value_t = swarm::upload::DEFAULT_MAX_ACTIVE)]
    pub max_uploads: usize,
    /// Piece requests in flight per agent (the agent's default).
    #[arg(long, default_value_t = swarm::upload::DEFAULT_REQUEST_BUDGET as usize)]
    pub max_piece_requests: usize,
    /// Layers each node's pull client fetches at once (containerd: 3).
    #[arg(long, default_value_t = 4)]
    pub client_concurrency: usize,
    /// Skip the direct baseline run.
    #[arg(long)]
    pub no_direct: bool,
    /// Keep generated files and logs here instead of a temporary directory.
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Before the pulls, write and delete a scratch file as large as what the agents
    /// will store, so their page-cache writes land in memory the machine already backs.
    /// For VMs that hand freed pages back to the host (virtio-balloon free page
    /// reporting), where the first write into such a page costs 1.5-2.4 CPU-s/GiB that
    /// a bare-metal node does not pay. The report says whether it was on.
    #[arg(long)]
    pub pretouch: bool,
    /// Run the cluster with mutual TLS: a throwaway cluster CA, the tracker on HTTPS
    /// with client certificates, agents joining with a bootstrap token and speaking the
    /// peer protocol over TLS. Without it the demo runs plain HTTP with a cluster
    /// token (and says so): the way to measure what TLS costs.
    #[arg(long)]
    pub tls: bool,
}

/// A pull client that reaches the demo's registry `origin_host` through `endpoint`
/// (an agent, or the registry itself).
fn pull_client(origin_host: &str, endpoint: &str) -> Result<oci::Upstream, oci::Error> {
    let mut ucfg = oci::UpstreamConfig::default();
    ucfg.endpoints
        .insert(origin_host.to_owned(), endpoint.to_owned());
    oci::Upstream::new(ucfg)
}

/// Writes `bytes` of zeros to `path` and deletes it: the freed page-cache pages are
/// reused by the next writes before the VM can report them free to its host.
async fn pretouch_page_cache(path: &Path, bytes: u64) -> Result<()> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || -> Result<()> {
        use std::io::Write;
        let chunk = vec![0u8; 1 << 20];
        let mut f = std::fs::File::create(&path)?;
        for _ in 0..bytes.div_ceil(chunk.len() as u64) {
            f.write_all(&chunk)?;
        }
        drop(f);
        std::fs::remove_file(&path)?;
        Ok(())
    })
    .await?
}

/// A throwaway cluster CA for `--tls`: the pin and a bootstrap token the agents join
/// with, and a viewer certificate for the demo's own queries.
struct DemoTls {
    dir: PathBuf,
    pin: String,
    token: String,
    viewer_pem: String,
    ca_pem: String,
}

impl DemoTls {
    fn create(dir: &Path) -> Result<DemoTls> {
        let _ = std::fs::remove_dir_all(dir);
        let (ca, key) = pki::init_pki_dir(dir, "starling-demo", pki::DEFAULT_CA_LIFETIME)?;
        let token = key.create_token(Duration::from_secs(3600), None)?;
        let viewer = ca.issue(&pki::CertRequest::new(pki::Identity::viewer("demo")?))?;
        let viewer_pem = format!(
            "{}{}",
            viewer.chain_pem(),
            viewer.key_pem().unwrap_or_default()
        );
        Ok(DemoTls {
            dir: dir.to_owned(),
            pin: ca.pin().to_string(),
            token,
            viewer_pem,
            ca_pem: ca.cert_pem().to_owned(),
        })
    }

    fn viewer_client(&self) -> Result<reqwest::Client> {
        Ok(reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(self.ca_pem.as_bytes())?)
            .identity(reqwest::Identity::from_pem(self.viewer_pem.as_bytes())?)
            .build()?)
    }
}

pub async fn run_demo(a: DemoArgs) -> Result<()> {
    if a.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    let tmp = tempfile::tempdir()?;
    let work = a.workdir.clone().unwrap_or_else(|| tmp.path().to_owned());
    std::fs::create_dir_all(&work)?;
    let registry_limit = crate::parse_size(&a.registry_limit)?;
    let node_limit = crate::parse_size(&a.node_limit)?;
    let p2p_threshold = crate::parse_size(&a.p2p_threshold)?;
    if a.piece_size != "auto" {
        crate::parse_size(&a.piece_size)?;
    }
    let say = |s: String| {
        if !a.json {
            println!("{s}");
        }
    };
    say(format!(
        "[1/6] generating a synthetic training image (scale {}) ...",
        a.scale
    ));
    let layout = work.join("layout");
    let spec = origin::SynthSpec::training(a.scale);
    let image = tokio::task::spawn_blocking({
        let layout = layout.clone();
        move || origin::generate_training_image(&layout, &spec)
    })
    .await??;
    let s = image.total_bytes;
    say(format!(
        "      {} layers, {:.1} MiB",
        image.layers.len(),
        s as f64 / 1048576.0
    ));
    say(format!(
        "[2/6] registry: serve-oci behind a {}/s egress limit, {} round trip",
        a.registry_limit, a.registry_latency
    ));
    let origin = origin::bind(origin::OriginConfig {
        layout_dir: layout,
        listen: "127.0.0.1:0".parse()?,
        egress_limit_bytes_per_sec: Some(registry_limit),
        repository: None,
        latency: Some(a.registry_latency.into()).filter(|d: &std::time::Duration| !d.is_zero()),
    })
    .await?
    .spawn();
    let origin_host = origin.local_addr().to_string();
    let stats = origin.stats();
    let reference = oci::ImageReference::parse(&format!("{origin_host}/demo/train:{}", image.tag))?;

    let exe = std::env::current_exe()?;
    let mut procs = Procs(Vec::new());
    let token = format!("demo-{:x}", std::process::id());
    let tport = free_port()?;
    let tls = if a.tls {
        Some(DemoTls::create(&work.join("pki"))?)
    } else {
        say(
            "INSECURE plain HTTP between tracker and agents (--insecure-plain-http, cluster token only): --tls for mutual TLS"
                .into(),
        );
        None
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let http = match &tls {
        Some(t) => t.viewer_client()?,
        None => reqwest::Client::new(),
    };
    say(format!(
        "[3/6] tracker on 127.0.0.1:{tport}, {} agents limited to {}/s up and down each",
        a.nodes, a.node_limit
    ));
    procs.0.push(spawn(
        &exe,
        &[
            "tracker".into(),
            "--listen".into(),
            format!("127.0.0.1:{tport}"),
            "--p2p-threshold".into(),
            a.p2p_threshold.clone(),
            "--piece-size".into(),
            a.piece_size.clone(),
            "--announce-interval".into(),
            a.announce_interval.clone(),
            "--data-dir".into(),
            work.join("tracker-data").display().to_string(),
        ]
        .into_iter()
        .chain(match &tls {
            // Every demo agent joins from 127.0.0.1: one address, many nodes.
            Some(t) => vec![
                "--pki".into(),
                t.dir.display().to_string(),
                "--join-limit".into(),
                (a.nodes * 2).max(10).to_string(),
            ],
            None => vec![
                "--cluster-token".into(),
                token.clone(),
                "--insecure-plain-http".into(),
            ],
        })
        .collect::<Vec<String>>(),
        &work.join("tracker.log"),
    )?);
    wait_ready_with(&http, &format!("{scheme}://127.0.0.1:{tport}/healthz")).await?;
    let mut agents = Vec::new();
    for i in 0..a.nodes {
        let port = free_port()?;
        let name = format!("node-{i}");
        // A fresh cache per run: a reused workdir must not turn a cold start warm.
        let _ = std::fs::remove_dir_all(work.join(&name));
        let args: Vec<String> = vec![
            "agent".into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--cache-dir".into(),
            work.join(&name).display().to_string(),
            "--default-registry".into(),
            origin_host.clone(),
            "--registry-endpoint".into(),
            format!("{origin_host}=http://{origin_host}"),
            "--tracker".into(),
            format!("{scheme}://127.0.0.1:{tport}"),
            "--node-name".into(),
            name.clone(),
            "--zone".into(),
            "z1".into(),
            "--rack".into(),
            format!("r{}", i % 2),
            "--upload-limit".into(),
            a.node_limit.clone(),
            "--download-limit".into(),
            a.node_limit.clone(),
            "--p2p-threshold".into(),
            a.p2p_threshold.clone(),
            "--piece-size".into(),
            a.piece_size.clone(),
            "--min-free".into(),
            "0".into(),
            "--max-uploads".into(),
            a.max_uploads.to_string(),
            "--max-piece-requests".into(),
            a.max_piece_requests.to_string(),
        ]
        .into_iter()
        .chain(match &tls {
            Some(t) => vec![
                "--join".into(),
                t.token.clone(),
                "--ca-pin".into(),
                t.pin.clone(),
            ],
            None => vec![
                "--cluster-token".into(),
                token.clone(),
                "--insecure-plain-http".into(),
            ],
        })
        .collect();
        let child = spawn(&exe, &args, &work.join(format!("{name}.log")))?;
        agents.push((name, port, child.id()));
        procs.0.push(child);
    }
    for (_, port, _) in &agents {
        wait_ready(&format!("http://127.0.0.1:{port}/healthz")).await?;
    }
    let page_cache_write_reference_cpu_s_per_gib =
        crate::machine::page_cache_write_reference(&work).await;
    if a.pretouch {
        pretouch_page_cache(&work.join("pretouch.scratch"), s * a.nodes as u64).await?;
    }
    let before_cpu: Vec<f64> = agents
        .iter()
        .map(|(_, _, pid)| proc_usage(*pid).0)
        .collect();

    say(format!(
        "[4/6] all {} nodes pull {} at once through their agents",
        a.nodes, reference
    ));
    let progress: Vec<Arc<AtomicU64>> = (0..a.nodes).map(|_| Arc::new(AtomicU64::new(0))).collect();
    // The clients exist before the clock starts: building one loads the system trust
    // store (about 5-10 ms of CPU each here), which inside the timed window delayed
    // the last node's start by 80 ms and starved the registry, which shares this
    // process, while the first nodes were already pulling.
    let clients = agents
        .iter()
        .map(|(_, port, _)| pull_client(&origin_host, &format!("http://127.0.0.1:{port}")))
        .collect::<Result<Vec<_>, _>>()?;
    let egress_before = stats.egress_bytes();
    let sha256_reference_mb_per_s = crate::machine::sha256_reference_mb_per_s();
    let cpu_before = crate::machine::CpuTicks::now();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (i, up) in clients.into_iter().enumerate() {
        let r = reference.clone();
        let opts = oci::pull::PullOptions {
            concurrency: a.client_concurrency.max(1),
            progress: Some(progress[i].clone()),
            ..Default::default()
        };
        tasks.push(tokio::spawn(async move {
            oci::pull::pull(&up, &r, &opts).await
        }));
    }
    // Bytes each agent received (peers + registry), sampled every half second: shows
    // how busy each node's download link was over the run.
    let series: Arc<std::sync::Mutex<CounterSeries>> = Arc::default();
    let uploads: Arc<std::sync::Mutex<CounterSeries>> = Arc::default();
    let sampler = {
        let series = series.clone();
        let uploads = uploads.clone();
        let ports: Vec<u16> = agents.iter().map(|(_, p, _)| *p).collect();
        tokio::spawn(async move {
            let client = reqwest::Client::new();
            loop {
                let mut row = Vec::with_capacity(ports.len());
                let mut sent = Vec::with_capacity(ports.len());
                for p in &ports {
                    let text = match client
                        .get(format!("http://127.0.0.1:{p}/metrics"))
                        .send()
                        .await
                    {
                        Ok(r) => r.text().await.unwrap_or_default(),
                        Err(_) => String::new(),
                    };
                    row.push(
                        metric(&text, "starling_agent_p2p_peer_bytes_total")
                            + metric(&text, "starling_agent_upstream_bytes_total"),
                    );
                    sent.push(metric(&text, "starling_agent_p2p_upload_bytes_total"));
                }
                let at = started.elapsed().as_secs_f64();
                if let Ok(mut s) = series.lock() {
                    s.push((at, row));
                }
                if let Ok(mut s) = uploads.lock() {
                    s.push((at, sent));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let ticker = {
        let progress = progress.clone();
        let stats = stats.clone();
        let json = a.json;
        let total = s * a.nodes as u64;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if !json {
                    let done: u64 = progress.iter().map(|p| p.load(Ordering::Relaxed)).sum();
                    let bars: String = progress
                        .iter()
                        .map(|p| {
                            ["▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"]
                                [((p.load(Ordering::Relaxed) * 7) / s.max(1)).min(7) as usize]
                        })
                        .collect();
                    println!(
                        "      t={:>5.1}s  nodes [{bars}]  {:>6.1}/{:.1} MiB  registry sent {:>6.1} MiB",
                        started.elapsed().as_secs_f64(),
                        done as f64 / 1048576.0,
                        total as f64 / 1048576.0,
                        (stats.egress_bytes() - egress_before) as f64 / 1048576.0
                    );
                }
            }
        })
    };
    let mut per_node = Vec::new();
    let mut pulls = Vec::new();
    let mut agent_metrics = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t
            .await?
            .with_context(|| format!("pull on {}", agents[i].0))?;
        pulls.push(r.clone());
        let text = reqwest::get(format!("http://127.0.0.1:{}/metrics", agents[i].1))
            .await?
            .text()
            .await?;
        per_node.push(NodeReport {
            non_seed_first_byte_seconds: Vec::new(),
            node: agents[i].0.clone(),
            seconds: r.seconds,
            // Time to first byte of the largest blob: what a cold non-seeding node waits.
            first_byte_seconds: r
                .blobs
                .iter()
                .max_by_key(|b| b.bytes)
                .map_or(0.0, |b| b.first_byte_seconds),
            bytes_from_peers: metric(&text, "starling_agent_p2p_peer_bytes_total"),
            bytes_from_registry: metric(&text, "starling_agent_upstream_bytes_total"),
            bytes_uploaded: metric(&text, "starling_agent_p2p_upload_bytes_total"),
            peers_unreachable: metric(&text, "starling_agent_p2p_peers_unreachable_total"),
            peers_silent: metric(&text, "starling_agent_p2p_peers_silent_total"),
            stripes_distrusted: metric(&text, "starling_agent_p2p_stripes_distrusted_total"),
            readers_stalled: metric(&text, "starling_agent_p2p_readers_stalled_total"),
        });
        agent_metrics.push(text);
    }
    let all_nodes = started.elapsed().as_secs_f64();
    let machine_cpu = crate::machine::CpuTicks::now().since(cpu_before);
    ticker.abort();
    sampler.abort();
    let receive_series = series.lock().map(|s| s.clone()).unwrap_or_default();
    let upload_series = uploads.lock().map(|s| s.clone()).unwrap_or_default();
    // Which node fetched each swarm blob from the registry, and its piece size.
    let swarms: Vec<swarm::state::SwarmStats> = http
        .get(format!("{scheme}://127.0.0.1:{tport}/swarm/v1/swarms"))
        .bearer_auth(&token)
        .send()
        .await?
        .json()
        .await
        .unwrap_or_default();
    let mut ttfb = Vec::new();
    let mut first_bytes_by_blob: Vec<(String, BlobFirstBytes)> = Vec::new();
    for (i, r) in pulls.iter().enumerate() {
        for b in &r.blobs {
            let Some(sw) = swarms.iter().find(|s| s.digest == b.digest.to_string()) else {
                continue;
            };
            // Below the P2P threshold every node reads the blob from the registry
            // (the tracker says "direct"): no swarm, so no non-seed first byte.
            if sw.piece_size <= 1 || b.bytes < p2p_threshold {
                continue;
            }
            let times = (b.started_seconds, b.started_seconds + b.first_byte_seconds);
            let at = match first_bytes_by_blob
                .iter()
                .position(|(d, _)| *d == sw.digest)
            {
                Some(at) => at,
                None => {
                    first_bytes_by_blob.push((
                        sw.digest.clone(),
                        BlobFirstBytes {
                            bytes: b.bytes,
                            piece_size: sw.piece_size,
                            source: None,
                            non_seeds: Vec::new(),
                        },
                    ));
                    first_bytes_by_blob.len() - 1
                }
            };
            if sw.elected.contains(&agents[i].0) {
                first_bytes_by_blob[at].1.source = Some(times);
                continue;
            }
            first_bytes_by_blob[at].1.non_seeds.push(times);
            per_node[i]
                .non_seed_first_byte_seconds
                .push(b.first_byte_seconds);
            ttfb.push(b.first_byte_seconds);
        }
    }
    ttfb.sort_by(f64::total_cmp);
    let mut after_source: Vec<f64> = first_bytes_by_blob
        .iter()
        .filter_map(|(_, b)| Some((b.source?.1, &b.non_seeds)))
        .flat_map(|(source_first, non_seeds)| {
            non_seeds
                .iter()
                .map(move |&(asked, first)| first - asked.max(source_first))
        })
        .collect();
    after_source.sort_by(f64::total_cmp);
    let mut swarm_piece_sizes: Vec<(u64, u64)> = swarms
        .iter()
        .filter_map(|s| Some((s.size?, s.piece_size)))
        .filter(|(_, p)| *p > 1)
        .collect();
    swarm_piece_sizes.sort();
    let largest_piece = swarm_piece_sizes.last().map_or(0, |x| x.1);
    let registry_bytes = stats.egress_bytes() - egress_before;
    let usage: Vec<(f64, f64)> = agents.iter().map(|(_, _, pid)| proc_usage(*pid)).collect();
    let cpu: f64 = usage.iter().zip(&before_cpu).map(|(u, b)| u.0 - b).sum();
    let rss_max = usage.iter().map(|u| u.1).fold(0.0, f64::max);
    drop(procs);

    let n = a.nodes as f64;
    let (sf, ur, un) = (s as f64, registry_limit as f64, node_limit as f64);
    let bound = (sf / ur).max(sf / un).max(n * sf / (ur + n * un));
    say(format!(
        "[5/6] P2P: all nodes done in {all_nodes:.2}s; registry sent {:.2}× the image",
        registry_bytes as f64 / sf
    ));

    let (mut direct_secs, mut direct_bytes) = (None, None);
    if !a.no_direct {
        say(format!("[6/6] baseline: the same {} nodes pull directly from the registry (each limited to {}/s)", a.nodes, a.node_limit));
        // As for the swarm run: the clients are built before the clock starts.
        let clients = (0..a.nodes)
            .map(|_| pull_client(&origin_host, &format!("http://{origin_host}")))
            .collect::<Result<Vec<_>, _>>()?;
        let before = stats.egress_bytes();
        let started = Instant::now();
        let mut tasks = Vec::new();
        for up in clients {
            let r = reference.clone();
            let opts = oci::pull::PullOptions {
                concurrency: 4,
                max_bytes_per_sec: Some(node_limit),
                ..Default::default()
            };
            tasks.push(tokio::spawn(async move {
                oci::pull::pull(&up, &r, &opts).await
            }));
        }
        for t in tasks {
            t.await??;
        }
        direct_secs = Some(started.elapsed().as_secs_f64());
        direct_bytes = Some(stats.egress_bytes() - before);
    }
    let report = Report {
        nodes: a.nodes,
        image_bytes: s,
        layers: image.layers.len(),
        registry_limit_bytes_per_sec: registry_limit,
        registry_latency_ms: std::time::Duration::from(a.registry_latency).as_millis() as u64,
        node_limit_bytes_per_sec: node_limit,
        piece_size: a.piece_size.clone(),
        swarm_piece_sizes,
        registry_bytes,
        registry_bytes_ratio: registry_bytes as f64 / sf,
        all_nodes_seconds: all_nodes,
        bound_seconds: bound,
        ratio_to_bound: all_nodes / bound,
        direct_all_nodes_seconds: direct_secs,
        direct_registry_bytes: direct_bytes,
        speedup_vs_direct: direct_secs.map(|d| d / all_nodes),
        agent_cpu_seconds_per_gib: cpu / (n * sf / (1u64 << 30) as f64),
        pretouch: a.pretouch,
        tls: a.tls,
        agent_peak_rss_mib_max: rss_max,
        machine_cpu_busy: machine_cpu.busy,
        machine_cpu_steal: machine_cpu.steal,
        machine_cpu_iowait: machine_cpu.iowait,
        sha256_reference_mb_per_s,
        page_cache_write_reference_cpu_s_per_gib,
        non_seed_first_byte_p50: percentile(&ttfb, 0.5),
        non_seed_first_byte_p95: percentile(&ttfb, 0.95),
        non_seed_first_byte_max: ttfb.last().copied().unwrap_or(0.0),
        non_seed_first_byte_after_source_p95: percentile(&after_source, 0.95),
        agent_swarm_first_byte_p95_le: histogram_quantile_le(
            &agent_metrics,
            "starling_agent_blob_first_byte_seconds",
            "source=\"swarm\"",
            0.95,
        ),
        piece_time_seconds: largest_piece as f64 / node_limit as f64,
        first_bytes_by_blob: {
            first_bytes_by_blob.sort_by_key(|(_, b)| b.bytes);
            first_bytes_by_blob.into_iter().map(|(_, b)| b).collect()
        },
        receive_series,
        upload_series,
        per_node,
    };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!("\n  node      seconds  first byte  from peers  from registry  uploaded");
    for p in &report.per_node {
        println!(
            "  {:<8} {:>8.2} {:>10.2}s {:>8.1} MiB {:>10.1} MiB {:>7.1} MiB",
            p.node,
            p.seconds,
            p.first_byte_seconds,
            p.bytes_from_peers as f64 / 1048576.0,
            p.bytes_from_registry as f64 / 1048576.0,
            p.bytes_uploaded as f64 / 1048576.0
        );
    }
    println!(
        "\n  image                 {:.1} MiB in {} layers",
        sf / 1048576.0,
        report.layers
    );
    println!(
        "  all nodes (P2P)       {:.2} s   = {:.2} × the bound T* = {:.2} s",
        all_nodes, report.ratio_to_bound, bound
    );
    println!(
        "  registry egress       {:.1} MiB = {:.3} × the image",
        registry_bytes as f64 / 1048576.0,
        report.registry_bytes_ratio
    );
    if let (Some(d), Some(b)) = (direct_secs, direct_bytes) {
        println!("  direct baseline       {:.2} s, registry sent {:.2} × the image  → P2P is {:.1}× faster", d, b as f64 / sf, d / all_nodes);
    }
    println!(
        "  agent CPU             {:.2} CPU-seconds per GiB delivered; peak RSS {:.1} MiB",
        report.agent_cpu_seconds_per_gib, rss_max
    );
    if let Some(c) = report.page_cache_write_reference_cpu_s_per_gib {
        println!(
            "  page cache            writing fresh pages costs this machine {c:.2} CPU-seconds per GiB (part of the agents' figure)"
        );
    }
    println!(
        "  machine CPU busy      {:.0} % during the P2P run (agents, clients and registry share the cores), {:.0} % of it stolen by the hypervisor; {:.0} % waiting on the disk; sha256 {:.0} MB/s on one core",
        machine_cpu.busy * 100.0,
        machine_cpu.steal * 100.0,
        machine_cpu.iowait * 100.0,
        sha256_reference_mb_per_s
    );
    if machine_cpu.iowait >= DISK_BOUND_IOWAIT {
        println!(
            "  disk                  writing the caches may have held this run back ({:.0} % waiting on the disk); --workdir on a faster disk shows the swarm's own figure",
            machine_cpu.iowait * 100.0
        );
    }
    println!(
        "  first byte, non-seed  p50 {:.3} s, p95 {:.3} s, max {:.3} s (one piece at the node limit: {:.3} s)",
        report.non_seed_first_byte_p50,
        report.non_seed_first_byte_p95,
        report.non_seed_first_byte_max,
        report.piece_time_seconds
    );
    println!(
        "  first byte, swarm     p95 {:.3} s after the later of the node's request and the source's first byte",
        report.non_seed_first_byte_after_source_p95
    );
    if let Some(le) = report.agent_swarm_first_byte_p95_le {
        println!(
            "  first byte, agents    p95 ≤ {le:.3} s from a request's arrival at its agent (blobs arriving through the swarm; what the client's figure adds is outside the agents)"
        );
    }
    Ok(())
}
