//! `starling bench get`: N nodes `starling get` the same large file from one origin at
//! once, with the swarm benchmark's limits, side by side with N direct downloads in the
//! same run. The origin is a real nginx behind a proxy that plays the shared origin
//! link (one token bucket for every connection: the registry limit) and counts its
//! egress; each node's link is the agent's upload and download limit (and, for the
//! direct downloads, a per-connection bucket at the node limit in the proxy).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::demo::{free_port, proc_usage, spawn, wait_ready, Procs};
use crate::machine::CpuTicks;

#[derive(Args, Clone)]
pub struct GetBenchArgs {
    #[arg(long, default_value_t = 8)]
    nodes: usize,
    /// Size of the file every node fetches.
    #[arg(long, default_value = "2GiB")]
    size: String,
    /// The origin's egress limit per second (shared by all connections).
    #[arg(long, default_value = "50MiB")]
    registry_limit: String,
    /// Per-node upload and download limit per second.
    #[arg(long, default_value = "25MiB")]
    node_limit: String,
    /// Skip the direct baseline.
    #[arg(long)]
    no_direct: bool,
    /// Work directory (the file, nginx, caches, destinations); a temporary one by default.
    #[arg(long)]
    workdir: Option<PathBuf>,
    /// Make the file all zeros, written sparse: the origin reads holes, and on a
    /// compressing filesystem (btrfs `compress=zstd`) the caches and destinations take
    /// almost no disk. For memory runs with files larger than the disk, not for speed.
    #[arg(long)]
    sparse_zeros: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    nodes: usize,
    file_bytes: u64,
    registry_limit_bytes_per_sec: u64,
    node_limit_bytes_per_sec: u64,
    /// Bytes the origin sent during the swarm run, and that over the file size.
    origin_bytes: u64,
    origin_bytes_ratio: f64,
    all_nodes_seconds: f64,
    bound_seconds: f64,
    ratio_to_bound: f64,
    per_node_seconds: Vec<f64>,
    agent_peak_rss_mib: Vec<f64>,
    get_peak_rss_mib: Vec<f64>,
    /// CPU seconds per GiB delivered to a node: the agents' and the get clients'.
    agent_cpu_seconds_per_gib: f64,
    get_cpu_seconds_per_gib: f64,
    machine_cpu_busy: f64,
    /// Part of that the hypervisor took for other guests (steal time).
    machine_cpu_steal: f64,
    /// Waiting on the disk: eight caches and eight destinations written at once can
    /// be throttled by writeback at a low busy fraction.
    machine_cpu_iowait: f64,
    /// One core's sha256 rate just before the run (MB/s), to compare runs across time.
    sha256_reference_mb_per_s: f64,
    /// CPU-seconds per GiB written into fresh page cache on this machine, just before
    /// the run (the agents and `starling get` both pay it; see `starling demo`).
    page_cache_write_reference_cpu_s_per_gib: Option<f64>,
    direct_all_nodes_seconds: Option<f64>,
    direct_origin_bytes: Option<u64>,
    direct_machine_cpu_busy: Option<f64>,
    speedup_vs_direct: Option<f64>,
}

/// A TCP proxy in front of the origin: every byte it returns pays the shared bucket
/// (and a per-connection one when set); `sent` counts them.
struct LimitingProxy {
    addr: std::net::SocketAddr,
    sent: Arc<AtomicU64>,
    per_connection: Arc<parking_lot::Mutex<Option<u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl LimitingProxy {
    async fn start(upstream: std::net::SocketAddr, shared_rate: u64) -> Result<LimitingProxy> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let sent = Arc::new(AtomicU64::new(0));
        let per_connection: Arc<parking_lot::Mutex<Option<u64>>> = Arc::default();
        let shared = Arc::new(ratelimit::TokenBucket::new(shared_rate));
        let task = {
            let (sent, per_connection) = (sent.clone(), per_connection.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let (sent, shared) = (sent.clone(), shared.clone());
                    let own = (*per_connection.lock()).map(ratelimit::TokenBucket::new);
                    tokio::spawn(async move {
                        let Ok(origin) = tokio::net::TcpStream::connect(upstream).await else {
                            return;
                        };
                        let _ = client.set_nodelay(true);
                        let (mut cr, mut cw) = client.into_split();
                        let (mut or, mut ow) = origin.into_split();
                        let up = tokio::spawn(async move {
                            let _ = tokio::io::copy(&mut cr, &mut ow).await;
                            let _ = ow.shutdown().await;
                        });
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            let n = match or.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            shared.acquire(n as u64).await;
                            if let Some(b) = &own {
                                b.acquire(n as u64).await;
                            }
                            if cw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                            sent.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        let _ = cw.shutdown().await;
                        up.abort();
                    });
                }
            })
        };
        Ok(LimitingProxy {
            addr,
            sent,
            per_connection,
            task,
        })
    }
}

impl Drop for LimitingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn start_nginx(dir: &Path, www: &Path) -> Result<(Child, std::net::SocketAddr)> {
    let port = free_port()?;
    let tmp = dir.join("nginx-tmp");
    std::fs::create_dir_all(&tmp)?;
    let p = |x: &Path| x.display().to_string();
    let conf = format!(
        "daemon off;\nmaster_process off;\nerror_log {err};\npid {pid};\n\
         events {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {tmp};\n  proxy_temp_path {tmp};\n\
           fastcgi_temp_path {tmp};\n  uwsgi_temp_path {tmp};\n  scgi_temp_path {tmp};\n\
           sendfile on;\n  server {{ listen 127.0.0.1:{port}; root {www}; }}\n}}\n",
        err = p(&dir.join("nginx-error.log")),
        pid = p(&dir.join("nginx.pid")),
        tmp = p(&tmp),
        www = p(www),
    );
    let conf_path = dir.join("nginx.conf");
    std::fs::write(&conf_path, conf)?;
    let child = Command::new("nginx")
        .args(["-c", &p(&conf_path), "-p", &p(dir)])
        .stderr(Stdio::null())
        .spawn()
        .context("starting nginx (installed?)")?;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    for _ in 0..200 {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok((child, addr));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    bail!(
        "nginx did not start (see {})",
        dir.join("nginx-error.log").display()
    )
}

/// Incompressible bytes (xorshift), written in 4 MiB blocks.
fn write_file(path: &Path, size: u64) -> Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut block = vec![0u8; 4 << 20];
    let mut left = size;
    while left > 0 {
        for chunk in block.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes());
        }
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n])?;
        left -= n as u64;
    }
    f.flush()?;
    Ok(())
}

/// Runs the gets at once; returns (seconds per node, peak RSS MiB per get, all-done
/// seconds). Every get must succeed.
async fn run_gets(
    exe: &Path,
    argsets: Vec<Vec<String>>,
    logs: &Path,
) -> Result<(Vec<f64>, Vec<f64>, f64, f64)> {
    let started = Instant::now();
    let mut children = Vec::new();
    for (i, args) in argsets.iter().enumerate() {
        let out = std::fs::File::create(logs.join(format!("get-{i}.json")))?;
        let err = std::fs::File::create(logs.join(format!("get-{i}.log")))?;
        let child = Command::new(exe)
            .args(args)
            .env("STARLING_LOG", "warn")
            .stdout(out)
            .stderr(err)
            .spawn()?;
        children.push(child);
    }
    let n = children.len();
    let mut done: Vec<Option<f64>> = vec![None; n];
    let mut rss = vec![0.0f64; n];
    let mut cpu = vec![0.0f64; n];
    while done.iter().any(Option::is_none) {
        for (i, c) in children.iter_mut().enumerate() {
            if done[i].is_some() {
                continue;
            }
            let (c_cpu, c_rss) = proc_usage(c.id());
            rss[i] = rss[i].max(c_rss);
            cpu[i] = cpu[i].max(c_cpu);
            if let Some(status) = c.try_wait()? {
                if !status.success() {
                    bail!(
                        "get {i} failed: {}",
                        std::fs::read_to_string(logs.join(format!("get-{i}.log")))
                            .unwrap_or_default()
                    );
                }
                done[i] = Some(started.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let secs: Vec<f64> = done.into_iter().map(|d| d.unwrap_or(0.0)).collect();
    let all = secs.iter().copied().fold(0.0, f64::max);
    Ok((secs, rss, all, cpu.iter().sum()))
}

pub async fn run(a: GetBenchArgs) -> Result<()> {
    if a.nodes == 0 {
        bail!("--nodes must be at least 1");
    }
    let size = crate::parse_size(&a.size)?;
    let registry_limit = crate::parse_size(&a.registry_limit)?;
    let node_limit = crate::parse_size(&a.node_limit)?;
    let tmp = tempfile::tempdir()?;
    let work = a.workdir.clone().unwrap_or_else(|| tmp.path().to_owned());
    std::fs::create_dir_all(&work)?;
    let say = |s: String| {
        if !a.json {
            println!("{s}");
        }
    };
    let www = work.join("www");
    std::fs::create_dir_all(&www)?;
    let file = www.join("model.bin");
    if a.sparse_zeros {
        say(format!("[1/5] a sparse {} file of zeros", a.size));
        std::fs::File::create(&file)?.set_len(size)?;
    } else if std::fs::metadata(&file).map_or(true, |m| m.len() != size) {
        say(format!(
            "[1/5] writing a {} file of incompressible bytes",
            a.size
        ));
        let f = file.clone();
        tokio::task::spawn_blocking(move || write_file(&f, size)).await??;
    }
    let (nginx, nginx_addr) = start_nginx(&work, &www)?;
    let mut procs = Procs(vec![nginx]);
    let proxy = LimitingProxy::start(nginx_addr, registry_limit).await?;
    let url = format!("http://{}/model.bin?X-Amz-Signature=bench", proxy.addr);
    say(format!(
        "[2/5] nginx behind a {}/s shared origin link; tracker and {} agents at {}/s up and down",
        a.registry_limit, a.nodes, a.node_limit
    ));
    let exe = std::env::current_exe()?;
    let token = format!("bench-{:x}", std::process::id());
    let tport = free_port()?;
    procs.0.push(spawn(
        &exe,
        &[
            "tracker".into(),
            "--listen".into(),
            format!("127.0.0.1:{tport}"),
            "--cluster-token".into(),
            token.clone(),
            "--data-dir".into(),
            work.join("tracker-data").display().to_string(),
            // A benchmark on loopback: what TLS costs is measured separately (issue 12).
            "--insecure-plain-http".into(),
        ],
        &work.join("tracker.log"),
    )?);
    wait_ready(&format!("http://127.0.0.1:{tport}/healthz")).await?;
    let mut agents = Vec::new();
    for i in 0..a.nodes {
        let port = free_port()?;
        let name = format!("node-{i}");
        let cache = work.join(&name);
        let _ = std::fs::remove_dir_all(&cache);
        let args: Vec<String> = [
            "agent",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--cache-dir",
            &cache.display().to_string(),
            "--tracker",
            &format!("http://127.0.0.1:{tport}"),
            "--cluster-token",
            &token,
            "--insecure-plain-http",
            "--node-name",
            &name,
            "--zone",
            "z1",
            "--rack",
            &format!("r{}", i % 2),
            "--upload-limit",
            &a.node_limit,
            "--download-limit",
            &a.node_limit,
            "--min-free",
            "0",
            "--allowed-file-origin",
            &proxy.addr.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let child = spawn(&exe, &args, &work.join(format!("{name}.log")))?;
        agents.push((port, child.id()));
        procs.0.push(child);
    }
    for (port, _) in &agents {
        wait_ready(&format!("http://127.0.0.1:{port}/healthz")).await?;
    }
    say(format!(
        "[3/5] {} nodes `starling get` the file at once through their agents",
        a.nodes
    ));
    let dests = work.join("dest-swarm");
    let _ = std::fs::remove_dir_all(&dests);
    std::fs::create_dir_all(&dests)?;
    let argsets: Vec<Vec<String>> = agents
        .iter()
        .enumerate()
        .map(|(i, (port, _))| {
            vec![
                "get".into(),
                url.clone(),
                dests.join(format!("node-{i}.bin")).display().to_string(),
                "--agent".into(),
                format!("http://127.0.0.1:{port}"),
                "--json".into(),
            ]
        })
        .collect();
    let sent_before = proxy.sent.load(Ordering::Relaxed);
    let sha256_reference_mb_per_s = crate::machine::sha256_reference_mb_per_s();
    let page_cache_write_reference_cpu_s_per_gib =
        crate::machine::page_cache_write_reference(&work).await;
    let cpu_before = CpuTicks::now();
    let agent_cpu_before: f64 = agents.iter().map(|(_, pid)| proc_usage(*pid).0).sum();
    let (per_node_seconds, get_rss, all_nodes, get_cpu) = run_gets(&exe, argsets, &dests).await?;
    let agent_cpu = agents
        .iter()
        .map(|(_, pid)| proc_usage(*pid).0)
        .sum::<f64>()
        - agent_cpu_before;
    let machine_cpu = CpuTicks::now().since(cpu_before);
    let origin_bytes = proxy.sent.load(Ordering::Relaxed) - sent_before;
    let agent_rss: Vec<f64> = agents.iter().map(|(_, pid)| proc_usage(*pid).1).collect();
    // Agents and their caches go before the baseline: its disk and CPU are its own.
    drop(procs);
    let _ = std::fs::remove_dir_all(&dests);
    for i in 0..a.nodes {
        let _ = std::fs::remove_dir_all(work.join(format!("node-{i}")));
    }
    let (nf, sf, ur, un) = (
        a.nodes as f64,
        size as f64,
        registry_limit as f64,
        node_limit as f64,
    );
    let bound = (sf / ur).max(sf / un).max(nf * sf / (ur + nf * un));
    say(format!(
        "[4/5] swarm: all done in {all_nodes:.1} s = {:.2} × T* ({bound:.1} s); origin sent {:.3} × the file",
        all_nodes / bound,
        origin_bytes as f64 / sf
    ));
    let (mut direct_secs, mut direct_bytes, mut direct_busy) = (None, None, None);
    if !a.no_direct {
        say(format!(
            "[5/5] baseline: {} direct downloads at once, each at most {}/s",
            a.nodes, a.node_limit
        ));
        let (nginx, nginx_addr) = start_nginx(&work, &www)?;
        let _nginx = Procs(vec![nginx]);
        let proxy = LimitingProxy::start(nginx_addr, registry_limit).await?;
        *proxy.per_connection.lock() = Some(node_limit);
        let url = format!("http://{}/model.bin", proxy.addr);
        let dests = work.join("dest-direct");
        let _ = std::fs::remove_dir_all(&dests);
        std::fs::create_dir_all(&dests)?;
        let argsets: Vec<Vec<String>> = (0..a.nodes)
            .map(|i| {
                vec![
                    "get".into(),
                    url.clone(),
                    dests.join(format!("node-{i}.bin")).display().to_string(),
                    "--no-agent".into(),
                    "--json".into(),
                ]
            })
            .collect();
        let direct_before = CpuTicks::now();
        let (_, _, all, _) = run_gets(&exe, argsets, &dests).await?;
        direct_busy = Some(CpuTicks::now().since(direct_before).busy);
        direct_secs = Some(all);
        direct_bytes = Some(proxy.sent.load(Ordering::Relaxed));
        let _ = std::fs::remove_dir_all(&dests);
    }
    let report = Report {
        nodes: a.nodes,
        file_bytes: size,
        registry_limit_bytes_per_sec: registry_limit,
        node_limit_bytes_per_sec: node_limit,
        origin_bytes,
        origin_bytes_ratio: origin_bytes as f64 / sf,
        all_nodes_seconds: all_nodes,
        bound_seconds: bound,
        ratio_to_bound: all_nodes / bound,
        per_node_seconds,
        agent_peak_rss_mib: agent_rss,
        get_peak_rss_mib: get_rss,
        agent_cpu_seconds_per_gib: agent_cpu / (nf * sf / (1u64 << 30) as f64),
        get_cpu_seconds_per_gib: get_cpu / (nf * sf / (1u64 << 30) as f64),
        machine_cpu_busy: machine_cpu.busy,
        machine_cpu_steal: machine_cpu.steal,
        machine_cpu_iowait: machine_cpu.iowait,
        sha256_reference_mb_per_s,
        page_cache_write_reference_cpu_s_per_gib,
        direct_all_nodes_seconds: direct_secs,
        direct_origin_bytes: direct_bytes,
        direct_machine_cpu_busy: direct_busy,
        speedup_vs_direct: direct_secs.map(|d| d / all_nodes),
    };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}
