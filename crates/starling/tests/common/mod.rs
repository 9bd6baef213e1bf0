//! Shared by the process-level tests: `starling` children that are killed on drop,
//! readiness polling and metric scraping.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub mod getkit;
pub mod other_host;
pub mod tls;
pub mod trackers;

pub struct Proc {
    pub child: Child,
    pub port: u16,
    pub cache: PathBuf,
    pub args: Vec<String>,
    pub log: PathBuf,
}

impl Proc {
    /// Spawns `starling ARGS` logging to `log` and waits for `/healthz`.
    pub async fn start(args: Vec<String>, port: u16, log: PathBuf, cache: PathBuf) -> Proc {
        let child = spawn(&args, &log);
        Self::once_ready(child, args, port, log, cache).await
    }

    /// [`start`](Self::start) with `envs` set for the child (not kept for a restart).
    pub async fn start_with_env(
        args: Vec<String>,
        port: u16,
        log: PathBuf,
        cache: PathBuf,
        envs: &[(&str, &str)],
    ) -> Proc {
        let child = spawn_with_env(&args, &log, envs);
        Self::once_ready(child, args, port, log, cache).await
    }

    async fn once_ready(
        child: Child,
        args: Vec<String>,
        port: u16,
        log: PathBuf,
        cache: PathBuf,
    ) -> Proc {
        let p = Proc {
            child,
            port,
            cache,
            args,
            log,
        };
        ready(&p.url()).await;
        p
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn restart(&mut self) {
        self.child = spawn(&self.args, &self.log);
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
        // A failed test's tempdir goes with it, so its processes' last words go to the
        // test's output, which is all CI keeps.
        if std::thread::panicking() {
            print_log_tail(&self.log, 80);
            if let Ok(dir) = std::env::var("STARLING_TEST_KEEP_LOGS") {
                let name = self
                    .log
                    .file_name()
                    .map(|n| n.to_owned())
                    .unwrap_or_default();
                let _ = std::fs::create_dir_all(&dir);
                let _ = std::fs::copy(&self.log, std::path::Path::new(&dir).join(name));
            }
        }
    }
}

fn print_log_tail(log: &Path, lines: usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let tail = &all[all.len().saturating_sub(lines)..];
    eprintln!("---- last {} lines of {} ----", tail.len(), log.display());
    for line in tail {
        eprintln!("{line}");
    }
}

pub fn spawn(args: &[String], log: &Path) -> Child {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log file");
    Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(args)
        .env(
            "STARLING_LOG",
            std::env::var("STARLING_TEST_CHILD_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(Stdio::null())
        .stderr(f)
        .spawn()
        .expect("spawn starling")
}

pub async fn ready(url: &str) {
    for _ in 0..400 {
        if reqwest::get(format!("{url}/healthz"))
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{url} not ready");
}

/// Sum of a Prometheus metric's samples on `base_url/metrics`.
pub async fn metric(base_url: &str, name: &str) -> u64 {
    let text = reqwest::get(format!("{base_url}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    sum_samples(&text, name)
}

/// Sum of the samples in an OpenMetrics text whose series starts with `series`: a
/// metric name (all its label sets) or a name with its labels (`x_total{reason="a"}`).
pub fn sum_samples(text: &str, series: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// `starling ARGS` with extra environment variables. Settings that a test needs but an
/// older binary would not know go through the environment (clap reads `STARLING_*`), so
/// the same test runs against a build without them and shows what it lacked.
pub async fn start_with_env(
    args: Vec<String>,
    envs: &[(&str, &str)],
    port: u16,
    log: PathBuf,
    cache: PathBuf,
) -> Proc {
    let p = Proc {
        child: spawn_with_env(&args, &log, envs),
        port,
        cache,
        args,
        log,
    };
    ready(&p.url()).await;
    p
}

pub fn spawn_with_env(args: &[String], log: &Path, envs: &[(&str, &str)]) -> Child {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log file");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_starling"));
    cmd.args(args).env("STARLING_LOG", "info");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.stdout(Stdio::null())
        .stderr(f)
        .spawn()
        .expect("spawn starling")
}

/// Arguments as owned strings.
pub fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// A tracker on a free port with its data in `dir`; `extra` flags and `envs` added.
/// Plain HTTP (`--insecure-plain-http`) unless `extra` has `--pki`.
pub async fn start_tracker(dir: &Path, extra: &[&str], envs: &[(&str, &str)]) -> Proc {
    let port = testkit::free_port();
    let mut a = args(&[
        "tracker",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--data-dir",
        &dir.join("tdata").display().to_string(),
    ]);
    if !extra.contains(&"--pki") {
        a.push("--insecure-plain-http".into());
    }
    a.extend(args(extra));
    start_with_env(a, envs, port, dir.join("tracker.log"), dir.to_owned()).await
}

/// A minimal agent report as the tracker's API takes it: `blobs` distinct digests
/// derived from `seed`, one image made of them with a pull time.
pub fn forged_report(node: &str, generation: u64, seed: u64, blobs: usize) -> serde_json::Value {
    let digests: Vec<String> = (0..blobs)
        .map(|i| oci::Digest::of(format!("{seed}/{i}").as_bytes()).to_string())
        .collect();
    serde_json::json!({
        "node": node,
        "generation": generation,
        "labels": {"gpu": "h100"},
        "agent_url": format!("http://{node}.invalid:5050"),
        "blobs": digests.iter().map(|d| serde_json::json!({"digest": d, "size": 1048576, "bytes_held": 1048576, "complete": true})).collect::<Vec<_>>(),
        "images": [{
            "manifest_digest": oci::Digest::of(format!("manifest/{seed}").as_bytes()).to_string(),
            "references": [format!("registry.test/forged/{node}:v{seed}")],
            "blobs": digests.iter().map(|d| serde_json::json!({"digest": d, "size": 1048576})).collect::<Vec<_>>(),
            "last_pull": 1_700_000_000u64,
            "pull_seconds": 1.5
        }],
        "pins": [],
        "cache_budget": 1u64 << 40,
        "cache_used": (blobs as u64) << 20,
        "cache_free": (1u64 << 40) - ((blobs as u64) << 20),
        "downloads_in_flight": []
    })
}

/// The metric lines (not comments) of `name` on `base_url/metrics`.
pub async fn metric_lines(base_url: &str, name: &str) -> Vec<String> {
    let text = reqwest::get(format!("{base_url}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// A TCP listener that counts the connections made to it and closes each at once:
/// proof that nothing connected to an address it must not reach.
pub async fn counting_listener() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let n = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = n.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(s);
        }
    });
    (addr, n)
}

/// A "registry" that accepts connections and never answers (a hung server: the one
/// fault a real registry cannot be made to produce on demand). Sockets are held open.
pub async fn hanging_listener() -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    addr
}

/// Sends SIGTERM to a child process.
pub fn sigterm(child: &Child) {
    signal(child, "TERM");
}

/// Sends the signal named `sig` (TERM, STOP, CONT…) to a child process.
pub fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .args([&format!("-{sig}"), &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{sig} failed");
}

/// Waits up to `limit` for the child to exit; the time it took, or None.
pub fn wait_exit(child: &mut Child, limit: Duration) -> Option<Duration> {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(_)) = child.try_wait() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// Whether the server closed the connection (EOF or reset) within `wait`; the bytes it
/// sent before closing, if any.
pub async fn closed_within(s: &mut tokio::net::TcpStream, wait: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 4096];
    let deadline = std::time::Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// Trickles a request head one byte per second (never finishing it) and returns how
/// long the server kept the connection, or None if it was still open after `limit`.
pub async fn slow_loris(addr: &str, limit: Duration) -> Option<Duration> {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    use tokio::io::AsyncWriteExt;
    let head = b"GET /healthz HTTP/1.1\r\nHost: tracker\r\nX-Slow: ";
    let start = std::time::Instant::now();
    let mut i = 0usize;
    while start.elapsed() < limit {
        let b = head.get(i).copied().unwrap_or(b'a');
        i += 1;
        if s.write_all(&[b]).await.is_err() {
            return Some(start.elapsed());
        }
        if closed_within(&mut s, Duration::from_secs(1))
            .await
            .is_some()
        {
            return Some(start.elapsed());
        }
    }
    None
}

/// The attack on a server started with a connection cap of `cap` and a 5 s header
/// timeout: `cap` idle connections fill it and the next one is closed unanswered (and
/// counted in `refused_metric`); idle and slow-header (1 byte/s) connections are
/// closed within the header timeout, with a generous margin.
pub async fn assert_connection_limits(base_url: &str, port: u16, cap: usize, refused_metric: &str) {
    use tokio::io::AsyncWriteExt;
    let addr = format!("127.0.0.1:{port}");
    // Connections of earlier requests (readiness polls) may still hold slots for a
    // moment after their clients hung up.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut idle = Vec::new();
    for _ in 0..cap {
        idle.push(
            tokio::net::TcpStream::connect(&addr)
                .await
                .expect("connect"),
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut extra = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let _ = extra
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: server\r\nConnection: close\r\n\r\n")
        .await;
    let answer = closed_within(&mut extra, Duration::from_secs(3)).await;
    if answer.as_deref().map(<[u8]>::len) != Some(0) {
        // If a slot was still held by an earlier connection, the one refused is one of
        // the idle ones; either way exactly the connection over the cap is closed.
        let mut refused_idle = false;
        for c in &mut idle {
            if closed_within(c, Duration::from_millis(200)).await.is_some() {
                refused_idle = true;
            }
        }
        assert!(
            refused_idle,
            "a connection beyond the cap of {cap} was served: {:?}",
            answer.map(|b| String::from_utf8_lossy(&b).into_owned())
        );
    }

    drop(idle);
    ready(base_url).await;
    // Idle connections do not keep their slot past the header timeout.
    let mut quiet = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let t0 = std::time::Instant::now();
    let closed = closed_within(&mut quiet, Duration::from_secs(15)).await;
    assert!(
        closed.is_some(),
        "an idle connection that never sent a byte was still open after {:?}",
        t0.elapsed()
    );
    assert!(
        metric(base_url, refused_metric).await >= 1,
        "refused connections are counted in {refused_metric}"
    );

    // A client trickling its request head is disconnected within the header timeout.
    let kept = slow_loris(&addr, Duration::from_secs(15)).await;
    assert!(
        kept.is_some(),
        "a slow-header connection (1 byte/s) was kept open for 15 s"
    );
}

/// Pulls `image` through the agent at `agent_url` as containerd would.
pub async fn pull_via(
    agent_url: &str,
    image: &testkit::PushedImage,
) -> Result<oci::pull::PullReport, oci::Error> {
    let reference = oci::ImageReference::parse(&image.reference).unwrap();
    let mut cfg = oci::UpstreamConfig::default();
    cfg.endpoints
        .insert(reference.registry.clone(), agent_url.to_owned());
    let up = oci::Upstream::new(cfg).unwrap();
    oci::pull::pull(&up, &reference, &Default::default()).await
}

/// A hostile member's announce, `body`, sent to `tracker` every `every` with the
/// cluster token until the task is aborted (answers and errors ignored).
pub fn keep_announcing(
    tracker: &str,
    token: &str,
    body: serde_json::Value,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    let (url, token) = (format!("{tracker}/swarm/v1/announce"), token.to_owned());
    tokio::spawn(async move {
        let http = reqwest::Client::new();
        loop {
            let _ = http.post(&url).bearer_auth(&token).json(&body).send().await;
            tokio::time::sleep(every).await;
        }
    })
}
