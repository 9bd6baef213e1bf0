//! Shared by the `starling get` tests: agents and a tracker as processes, the `get`
//! command, its JSON report, a real nginx origin and a small tmpfs.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use super::Proc;
use testkit::Registry;

pub const TOKEN: &str = "test-cluster-token";

pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

pub async fn tracker(dir: &Path) -> Proc {
    super::start_tracker(dir, &["--cluster-token", TOKEN], &[]).await
}

pub async fn agent(
    dir: &Path,
    name: &str,
    tracker: Option<&str>,
    registry: &Registry,
    extra: &[&str],
) -> Proc {
    agent_with_cache(dir, name, tracker, registry, &dir.join(name), extra).await
}

/// An agent whose cache lives at `cache` (a small tmpfs, say).
pub async fn agent_with_cache(
    dir: &Path,
    name: &str,
    tracker: Option<&str>,
    registry: &Registry,
    cache: &Path,
    extra: &[&str],
) -> Proc {
    let port = testkit::free_port();
    let cache = cache.to_path_buf();
    let host = registry.host();
    let mut args = super::args(&[
        "agent",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--cache-dir",
        &cache.display().to_string(),
        "--registry-endpoint",
        &format!("{host}={}", registry.url()),
        "--node-name",
        name,
        "--min-free",
        "0",
    ]);
    if let Some(t) = tracker {
        args.extend(super::args(&[
            "--tracker",
            t,
            "--cluster-token",
            TOKEN,
            "--insecure-plain-http",
        ]));
    }
    args.extend(super::args(extra));
    Proc::start(args, port, dir.join(format!("{name}.log")), cache).await
}

pub async fn get(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_starling"))
            .arg("get")
            .args(&args)
            .env("STARLING_LOG", "warn")
            .output()
            .expect("run starling get")
    })
    .await
}

/// Any `starling` command as a process.
pub async fn cli(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_starling"))
            .args(&args)
            .env("STARLING_LOG", "warn")
            .output()
            .expect("run starling")
    })
    .await
}

/// Waits until the tracker's inventory lists `n` nodes.
pub async fn wait_for_nodes(tracker_url: &str, n: usize) {
    for _ in 0..200 {
        let out = cli(&["nodes", "--tracker", tracker_url, "--json"]).await;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if v["nodes"].as_array().is_some_and(|l| l.len() == n) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{n} nodes never reported to {tracker_url}");
}

pub fn report(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "get failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice(&out.stdout).expect("JSON report")
}

pub fn file_report<'a>(r: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    r["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in report {r}"))
}

/// Names of what is in `dir` (recursively, relative), partial files included.
pub fn listing(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, d: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.push(p.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// What most URL tests start from: the real registry (every agent has one) and an
/// nginx origin serving `w.bin`, `size` random bytes from `seed`.
pub struct Origin {
    pub registry: Registry,
    pub nginx: Nginx,
    pub bytes: Vec<u8>,
}

pub async fn origin_with_file(size: usize, seed: u64) -> Origin {
    let registry = blocking(|| Registry::start(testkit::RegistryAuth::None)).await;
    let nginx = blocking(Nginx::start).await;
    let bytes = testkit::random_bytes(size, seed);
    nginx.put("w.bin", &bytes);
    Origin {
        registry,
        nginx,
        bytes,
    }
}

/// A real nginx on a free loopback port serving `www` (Range and ETag come with it),
/// logging every response's body size.
pub struct Nginx {
    pub child: std::process::Child,
    pub port: u16,
    pub dir: tempfile::TempDir,
}

impl Nginx {
    pub fn start() -> Nginx {
        Nginx::start_with("")
    }

    /// With more directives in its `server` block (a `location` that redirects, say).
    pub fn start_with(server_extra: &str) -> Nginx {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("www")).unwrap();
        std::fs::create_dir_all(d.join("tmp")).unwrap();
        let port = testkit::free_port();
        let p = |s: &str| d.join(s).display().to_string();
        let conf = format!(
            "daemon off;\nmaster_process off;\nerror_log {err};\npid {pid};\n\
             events {{ worker_connections 256; }}\n\
             http {{\n  log_format bytes '$request_method $uri $status $body_bytes_sent';\n\
               access_log {log} bytes;\n  client_body_temp_path {tmp};\n  proxy_temp_path {tmp};\n\
               fastcgi_temp_path {tmp};\n  uwsgi_temp_path {tmp};\n  scgi_temp_path {tmp};\n\
               server {{ listen 127.0.0.1:{port}; root {www}; {server_extra} }}\n}}\n",
            err = p("error.log"),
            pid = p("nginx.pid"),
            log = p("access.log"),
            tmp = p("tmp"),
            www = p("www"),
        );
        std::fs::write(d.join("nginx.conf"), conf).unwrap();
        let child = Command::new("nginx")
            .args(["-c", &p("nginx.conf"), "-p", &d.display().to_string()])
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nginx installed");
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Nginx { child, port, dir }
    }

    pub fn put(&self, name: &str, bytes: &[u8]) {
        std::fs::write(self.dir.path().join("www").join(name), bytes).unwrap();
    }

    pub fn url(&self, name: &str) -> String {
        format!("http://127.0.0.1:{}/{name}", self.port)
    }

    pub fn origin(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Responses for `name` so far that carried more than a one-byte probe.
    pub fn body_responses(&self, name: &str) -> usize {
        let log = std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default();
        log.lines()
            .filter(|l| l.split(' ').nth(1) == Some(&format!("/{name}")))
            .filter(|l| l.rsplit(' ').next().and_then(|b| b.parse::<u64>().ok()) > Some(1))
            .count()
    }

    /// Body bytes sent for `name` so far.
    pub fn bytes_sent(&self, name: &str) -> u64 {
        let log = std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default();
        log.lines()
            .filter(|l| l.split(' ').nth(1) == Some(&format!("/{name}")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One home for the tmpfs helper: `testkit` (re-exported for `get.rs`).
#[allow(unused_imports)]
pub use testkit::Tmpfs;
