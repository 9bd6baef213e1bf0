//! Measures generation and loopback serving throughput.
//!
//! `cargo run --release -p origin --example throughput -- [GIB] [LIMIT_MIB_PER_S]`
//! generates a GIB-sized image (default 1) into a temp dir, reports MB/s, then pulls
//! every layer from a local origin (unlimited) with one connection, and, if a limit is
//! given, pulls a 64 MiB blob alone and 4×16 MiB concurrently through that limit.

use std::net::SocketAddr;
use std::time::Instant;

use origin::{OriginConfig, SynthSpec};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let gib: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let limit_mib: Option<u64> = args.get(2).and_then(|s| s.parse().ok());
    let dir = tempfile::tempdir()?;

    let full = SynthSpec::training(1.0).approx_bytes() as f64 / (1u64 << 30) as f64;
    let spec = SynthSpec::training(gib / full);
    let t = Instant::now();
    let img = origin::generate_training_image(dir.path(), &spec)?;
    let secs = t.elapsed().as_secs_f64();
    println!(
        "generate: {} bytes in {:.2} s = {:.0} MB/s ({} threads)",
        img.total_bytes,
        secs,
        img.total_bytes as f64 / secs / 1e6,
        std::thread::available_parallelism().map_or(1, |p| p.get())
    );

    let client = reqwest::Client::builder().no_proxy().build()?;
    let cfg = |limit| OriginConfig {
        layout_dir: dir.path().to_owned(),
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        egress_limit_bytes_per_sec: limit,
        repository: None,
        latency: None,
    };
    let srv = origin::bind(cfg(None)).await?.spawn();
    let base = format!("http://{}/v2/x/blobs", srv.local_addr());
    let t = Instant::now();
    let mut n = 0u64;
    for l in &img.layers {
        let mut r = client.get(format!("{base}/{}", l.digest)).send().await?;
        while let Some(c) = r.chunk().await? {
            n += c.len() as u64;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "serve (unlimited, 1 connection): {n} bytes in {secs:.2} s = {:.0} MB/s",
        n as f64 / secs / 1e6
    );
    srv.shutdown().await?;

    if let Some(mib) = limit_mib {
        let big = img
            .layers
            .iter()
            .max_by_key(|l| l.size)
            .ok_or("no layers")?
            .clone();
        let srv = origin::bind(cfg(Some(mib << 20))).await?.spawn();
        let base = format!("http://{}/v2/x/blobs", srv.local_addr());
        let t = Instant::now();
        let r = client
            .get(format!("{base}/{}", big.digest))
            .header("range", "bytes=0-67108863")
            .send()
            .await?;
        let got = r.bytes().await?.len();
        println!(
            "limited {mib} MiB/s, 1×64 MiB: {got} bytes in {:.2} s",
            t.elapsed().as_secs_f64()
        );
        let t = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..4u64 {
            let (c, url) = (client.clone(), format!("{base}/{}", big.digest));
            let range = format!("bytes={}-{}", i << 24, ((i + 1) << 24) - 1);
            tasks.push(tokio::spawn(async move {
                let b = c
                    .get(url)
                    .header("range", range)
                    .send()
                    .await?
                    .bytes()
                    .await?;
                Ok::<_, reqwest::Error>((b.len(), Instant::now()))
            }));
        }
        for task in tasks {
            let (len, end) = task.await??;
            println!(
                "  concurrent stream: {len} bytes done at {:.2} s",
                end.duration_since(t).as_secs_f64()
            );
        }
        println!(
            "  origin egress counter: {} bytes",
            srv.stats().egress_bytes()
        );
    }
    Ok(())
}
