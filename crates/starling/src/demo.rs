//! `starling demo` and `starling bench`: self-contained runs that compare Starling with
//! the direct path in the same process, on loopback.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use futures::StreamExt;
use serde::Serialize;

#[derive(Args)]
pub struct DemoArgs {
    /// Image size multiplier: 1.0 ≈ 4.9 GiB CUDA-like training image; default ≈ 490 MiB.
    #[arg(long, default_value_t = 0.1)]
    scale: f64,
    /// Registry egress limit (plays the shared registry), per second.
    #[arg(long, default_value = "200MiB")]
    registry_limit: String,
    /// Keep generated files here instead of a temporary directory.
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct PassReport {
    name: &'static str,
    seconds: f64,
    registry_bytes: u64,
    mib_per_s: f64,
    max_first_byte_seconds: f64,
}

#[derive(Serialize)]
struct DemoReport {
    image_bytes: u64,
    layers: usize,
    registry_limit_bytes_per_sec: u64,
    passes: Vec<PassReport>,
    warm_speedup_vs_direct: f64,
    cold_overhead_vs_direct: f64,
}

pub async fn run_demo(a: DemoArgs) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let work = a.workdir.clone().unwrap_or_else(|| tmp.path().to_owned());
    let limit = crate::parse_size(&a.registry_limit)?;
    let layout = work.join("layout");
    let say = |s: String| {
        if !a.json {
            println!("{s}")
        }
    };
    say(format!(
        "[1/5] generating a synthetic training image (scale {}) ...",
        a.scale
    ));
    let spec = origin::SynthSpec::training(a.scale);
    let started = Instant::now();
    let image = tokio::task::spawn_blocking({
        let layout = layout.clone();
        move || origin::generate_training_image(&layout, &spec)
    })
    .await??;
    say(format!(
        "      {} layers, {:.1} MiB in {:.1}s",
        image.layers.len(),
        image.total_bytes as f64 / 1048576.0,
        started.elapsed().as_secs_f64()
    ));
    say(format!(
        "[2/5] serving it with serve-oci behind a {}/s egress limit (the shared registry)",
        a.registry_limit
    ));
    let origin = origin::bind(origin::OriginConfig {
        layout_dir: layout,
        listen: "127.0.0.1:0".parse()?,
        egress_limit_bytes_per_sec: Some(limit),
        repository: None,
    })
    .await?
    .spawn();
    let origin_host = origin.local_addr().to_string();
    let stats = origin.stats();
    say("[3/5] starting a node agent with an empty cache".into());
    let mut cfg = agent::AgentConfig {
        cache_dir: work.join("agent-cache"),
        default_registry: origin_host.clone(),
        ..Default::default()
    };
    cfg.registries.insert(
        origin_host.clone(),
        agent::config::RegistryConfig {
            endpoint: Some(format!("http://{origin_host}")),
            ..Default::default()
        },
    );
    let agent = agent::Agent::new(cfg)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let agent_addr = listener.local_addr()?;
    tokio::spawn(agent.serve(listener, std::future::pending()));
    let reference = oci::ImageReference::parse(&format!("{origin_host}/demo/train:{}", image.tag))?;
    let mut passes = Vec::new();
    for (name, via_agent) in [
        ("direct from registry", false),
        ("cold through agent", true),
        ("warm through agent", true),
    ] {
        let step = match name {
            "direct from registry" => "[4/5] pulling directly from the registry (baseline)",
            "cold through agent" => "[5/5] pulling through the agent: cold, then warm",
            _ => "",
        };
        if !step.is_empty() {
            say(step.into());
        }
        let mut ucfg = oci::UpstreamConfig::default();
        let url = if via_agent {
            format!("http://{agent_addr}")
        } else {
            format!("http://{origin_host}")
        };
        ucfg.endpoints.insert(origin_host.clone(), url);
        let up = oci::Upstream::new(ucfg)?;
        let before = stats.egress_bytes();
        let r = oci::pull::pull(
            &up,
            &reference,
            &oci::pull::PullOptions {
                concurrency: 4,
                ..Default::default()
            },
        )
        .await
        .with_context(|| format!("{name} pull"))?;
        let registry_bytes = stats.egress_bytes() - before;
        let ttfb = r
            .blobs
            .iter()
            .map(|b| b.first_byte_seconds)
            .fold(0.0, f64::max);
        say(format!(
            "      {name:<22} {:>7.2}s  {:>8.1} MiB/s  registry sent {:>8.1} MiB  (all {} blobs sha256-verified)",
            r.seconds,
            r.bytes as f64 / 1048576.0 / r.seconds.max(1e-6),
            registry_bytes as f64 / 1048576.0,
            r.blobs.len()
        ));
        passes.push(PassReport {
            name,
            seconds: r.seconds,
            registry_bytes,
            mib_per_s: r.bytes as f64 / 1048576.0 / r.seconds.max(1e-6),
            max_first_byte_seconds: ttfb,
        });
    }
    let report = DemoReport {
        image_bytes: image.total_bytes,
        layers: image.layers.len(),
        registry_limit_bytes_per_sec: limit,
        warm_speedup_vs_direct: passes[0].seconds / passes[2].seconds.max(1e-6),
        cold_overhead_vs_direct: passes[1].seconds / passes[0].seconds.max(1e-6),
        passes,
    };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "\nresult: cold pull through the agent took {:.2}× the direct time; warm pull was {:.1}× faster than direct and the registry sent {} bytes for it.",
            report.cold_overhead_vs_direct, report.warm_speedup_vs_direct, report.passes[2].registry_bytes
        );
        println!("(the multi-node P2P swarm demo arrives with the tracker; see README)");
    }
    drop(origin);
    Ok(())
}

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Mirror benchmarks against a running docker-registry (see scripts/bench-mirror).
    Mirror(MirrorBenchArgs),
    /// Write an OCI layout with incompressible layers of the given sizes (bench input).
    Synth {
        /// Output directory.
        #[arg(long)]
        dir: PathBuf,
        /// Layer sizes, e.g. 1GiB,1GiB.
        #[arg(long, value_delimiter = ',')]
        layers: Vec<String>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

#[derive(Args)]
pub struct MirrorBenchArgs {
    /// Base URL of the registry, e.g. http://127.0.0.1:5000.
    #[arg(long)]
    registry: String,
    /// Base URL of the agent mirroring it.
    #[arg(long)]
    agent: String,
    /// Repository holding the blobs.
    #[arg(long)]
    repo: String,
    /// Blob digest(s) to fetch (repeatable).
    #[arg(long = "blob", required = true)]
    blobs: Vec<String>,
    /// What to measure: cached (a), cold (b), concurrent (d).
    #[arg(long, default_value = "cached")]
    mode: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 1)]
    clients: usize,
    /// Repetitions per client.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Measure only one side: registry or agent.
    #[arg(long)]
    only: Option<String>,
    /// One concurrent client per blob (instead of every client fetching every blob).
    #[arg(long)]
    each: bool,
}

/// Fetches blobs from one base URL with `clients` concurrent clients and reports bytes,
/// seconds and errors (each body checked for its length and digest).
async fn fetch_all(
    base: &str,
    repo: &str,
    blobs: &[String],
    clients: usize,
    rounds: usize,
    each: bool,
) -> (u64, f64, usize) {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(clients.max(1))
        .build()
        .unwrap_or_default();
    let started = Instant::now();
    let groups: Vec<Vec<String>> = if each {
        blobs.iter().map(|b| vec![b.clone()]).collect()
    } else {
        (0..clients).map(|_| blobs.to_vec()).collect()
    };
    let tasks = groups.into_iter().map(|group| {
        let client = client.clone();
        let urls: Vec<(String, String)> = group
            .iter()
            .map(|b| (format!("{base}/v2/{repo}/blobs/{b}"), b.clone()))
            .collect();
        async move {
            let (mut bytes, mut errors) = (0u64, 0usize);
            for _ in 0..rounds {
                for (u, d) in &urls {
                    let Ok(digest) = oci::Digest::parse(d) else {
                        errors += 1;
                        continue;
                    };
                    match client.get(u).send().await {
                        Ok(r) if r.status().is_success() => {
                            let mut v = oci::Verifier::new(digest);
                            let mut s = r.bytes_stream();
                            let mut ok = true;
                            while let Some(c) = s.next().await {
                                match c {
                                    Ok(c) => v.update(&c),
                                    Err(_) => {
                                        ok = false;
                                        break;
                                    }
                                }
                            }
                            bytes += v.len();
                            if !ok || v.finish().is_err() {
                                errors += 1;
                            }
                        }
                        _ => errors += 1,
                    }
                }
            }
            (bytes, errors)
        }
    });
    let results = futures::future::join_all(tasks).await;
    let secs = started.elapsed().as_secs_f64();
    let bytes = results.iter().map(|r| r.0).sum();
    let errors = results.iter().map(|r| r.1).sum();
    (bytes, secs, errors)
}

pub async fn run_bench(b: BenchCmd) -> Result<()> {
    let a = match b {
        BenchCmd::Mirror(a) => a,
        BenchCmd::Synth { dir, layers, seed } => {
            let layers = layers
                .iter()
                .enumerate()
                .map(|(i, s)| Ok((format!("layer{i}"), crate::parse_size(s)?)))
                .collect::<Result<Vec<_>>>()?;
            let spec = origin::SynthSpec {
                layers,
                seed,
                tag: "bench".into(),
            };
            let img =
                tokio::task::spawn_blocking(move || origin::generate_training_image(&dir, &spec))
                    .await??;
            println!(
                "{}",
                serde_json::json!({"manifest": img.manifest_digest, "layers": img.layers.iter().map(|l| serde_json::json!({"digest": l.digest, "size": l.size})).collect::<Vec<_>>()})
            );
            return Ok(());
        }
    };
    let mut out = serde_json::Map::new();
    for (name, base) in [("registry", &a.registry), ("agent", &a.agent)] {
        if a.only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let (bytes, secs, errors) =
            fetch_all(base, &a.repo, &a.blobs, a.clients, a.rounds, a.each).await;
        let mibs = bytes as f64 / 1048576.0 / secs.max(1e-9);
        println!("{name:<9} mode={} clients={} bytes={bytes} seconds={secs:.3} MiB/s={mibs:.1} errors={errors}", a.mode, a.clients);
        out.insert(name.into(), serde_json::json!({"bytes": bytes, "seconds": secs, "mib_per_s": mibs, "errors": errors}));
    }
    println!("{}", serde_json::Value::Object(out));
    Ok(())
}
