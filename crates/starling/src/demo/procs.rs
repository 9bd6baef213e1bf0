//! The demo's child processes (a tracker and agents, run from this same binary) and
//! what it reads from them: readiness, metrics, CPU time and peak memory. Shared with
//! `bench get`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Children killed when the demo ends, however it ends.
pub(crate) struct Procs(pub(crate) Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A port on 127.0.0.1 that is free now, for a child to bind in a moment. Chosen
/// below the kernel's ephemeral range: a port from `bind(:0)` could be taken before
/// the child binds it by an agent already running (its outgoing connections and its
/// peer listener draw from that range), which failed one swarm benchmark in about
/// thirty.
pub(crate) fn free_port() -> Result<u16> {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let range = (ephemeral_low / 2).max(1_024)..ephemeral_low;
    if !range.is_empty() {
        use std::hash::{BuildHasher, Hasher};
        // std's per-process random hash keys: enough randomness to spread the picks.
        let keys = std::collections::hash_map::RandomState::new();
        for attempt in 0..256u64 {
            let mut h = keys.build_hasher();
            h.write_u64(attempt);
            let port = range.start + (h.finish() % (range.end - range.start) as u64) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub(crate) fn spawn(exe: &Path, args: &[String], log: &Path) -> Result<Child> {
    let f = std::fs::File::create(log)?;
    Command::new(exe)
        .args(args)
        .env(
            "STARLING_LOG",
            std::env::var("STARLING_DEMO_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(Stdio::null())
        .stderr(f)
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))
}

pub(crate) async fn wait_ready(url: &str) -> Result<()> {
    wait_ready_with(&reqwest::Client::new(), url).await
}

pub(super) async fn wait_ready_with(http: &reqwest::Client, url: &str) -> Result<()> {
    for _ in 0..400 {
        if http
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    bail!("{url} did not become ready")
}

pub(crate) fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// (utime+stime seconds, VmHWM MiB) of a process.
pub(crate) fn proc_usage(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = fields
        .get(11)
        .and_then(|x| x.parse::<f64>().ok())
        .unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|x| x.parse::<f64>().ok())
            .unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    (ticks / 100.0, hwm / 1024.0)
}
