//! `starling bench`: measurements that compare against a baseline in the same run.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::{Args, Subcommand};
use futures::StreamExt;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// The swarm benchmark: same as `starling demo` with explicit limits (see BENCHMARKS.md).
    Swarm(crate::demo::DemoArgs),
    /// N nodes `starling get` one large file at once, through the swarm and directly.
    Get(crate::bench_get::GetBenchArgs),
    /// Mirror benchmarks against a running docker-registry (see scripts/bench-mirror).
    Mirror(MirrorBenchArgs),
    /// Tracker capacity: N simulated agents announcing, seeding and reporting against
    /// one or several trackers (see BENCHMARKS.md, issue 14).
    Tracker(crate::bench_tracker::TrackerBenchArgs),
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
    /// Count the bytes without hashing them: a client that costs little CPU, so the
    /// server's own cost decides the throughput (lengths are still checked).
    #[arg(long)]
    discard: bool,
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
    discard: bool,
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
                        Ok(r) if r.status().is_success() && discard => {
                            let expected = r.content_length();
                            let mut s = r.bytes_stream();
                            let mut got = 0u64;
                            let mut ok = true;
                            while let Some(c) = s.next().await {
                                match c {
                                    Ok(c) => got += c.len() as u64,
                                    Err(_) => {
                                        ok = false;
                                        break;
                                    }
                                }
                            }
                            bytes += got;
                            if !ok || expected != Some(got) {
                                errors += 1;
                            }
                        }
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
        BenchCmd::Swarm(d) => return crate::demo::run_demo(d).await,
        BenchCmd::Get(g) => return crate::bench_get::run(g).await,
        BenchCmd::Tracker(t) => return crate::bench_tracker::run(t).await,
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
        let (bytes, secs, errors) = fetch_all(
            base, &a.repo, &a.blobs, a.clients, a.rounds, a.each, a.discard,
        )
        .await;
        let mibs = bytes as f64 / 1048576.0 / secs.max(1e-9);
        println!("{name:<9} mode={} clients={} bytes={bytes} seconds={secs:.3} MiB/s={mibs:.1} errors={errors}", a.mode, a.clients);
        out.insert(name.into(), serde_json::json!({"bytes": bytes, "seconds": secs, "mib_per_s": mibs, "errors": errors}));
    }
    println!("{}", serde_json::Value::Object(out));
    Ok(())
}
