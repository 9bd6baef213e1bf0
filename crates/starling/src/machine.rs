//! The machine a benchmark ran on, in the benchmark's own report: how busy its CPU was,
//! how much of it the hypervisor took, how long it sat waiting on the disk, and how
//! fast it hashed. On a shared VM the same
//! binary runs slower when the host is busy (BENCHMARKS.md, seventh session: the agents'
//! CPU per GiB rose by half within an hour); steal time and a reference hash rate
//! measured in the same run tell that apart from a change in the code.

use std::time::Instant;

use serde::Serialize;
use sha2::Digest as _;

/// Cumulative CPU ticks of the whole machine, from the first line of `/proc/stat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CpuTicks {
    /// Everything but idle and I/O wait (steal included: the machine could not run).
    busy: u64,
    /// Ticks the hypervisor gave to someone else while this machine wanted to run.
    steal: u64,
    /// Idle ticks with a process waiting on I/O: writers held back by the kernel's
    /// dirty-page throttling look idle, not busy.
    iowait: u64,
    total: u64,
}

impl CpuTicks {
    /// Now, or all zeros where `/proc/stat` cannot be read (then fractions are 0).
    pub(crate) fn now() -> Self {
        std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|stat| stat.lines().next().and_then(Self::parse))
            .unwrap_or_default()
    }

    /// `cpu  user nice system idle iowait irq softirq steal guest guest_nice`; guest
    /// time is already counted in user, so only the first eight fields add up.
    fn parse(line: &str) -> Option<Self> {
        let fields: Vec<u64> = line
            .strip_prefix("cpu ")?
            .split_whitespace()
            .take(8)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        let field = |i: usize| fields.get(i).copied().unwrap_or(0);
        let total: u64 = fields.iter().sum();
        Some(Self {
            busy: total.saturating_sub(field(3) + field(4)),
            steal: field(7),
            iowait: field(4),
            total,
        })
    }

    /// What the machine did between `earlier` and `self`.
    pub(crate) fn since(self, earlier: Self) -> MachineCpu {
        let total = self.total.saturating_sub(earlier.total).max(1) as f64;
        MachineCpu {
            busy: self.busy.saturating_sub(earlier.busy) as f64 / total,
            steal: self.steal.saturating_sub(earlier.steal) as f64 / total,
            iowait: self.iowait.saturating_sub(earlier.iowait) as f64 / total,
        }
    }
}

/// Fractions of all cores over an interval.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub(crate) struct MachineCpu {
    /// Near 1: CPU-bound.
    pub busy: f64,
    /// Part of `busy` that the hypervisor took.
    pub steal: f64,
    /// Not busy, but waiting on the disk: high, the run was disk-bound.
    pub iowait: f64,
}

/// How fast one core of this machine runs sha256 right now, in MB/s (best of three
/// passes over 64 MiB in memory): the work that dominates a swarm's CPU, as a yardstick
/// for comparing runs made at different times. Takes ~0.1–0.2 s.
pub(crate) fn sha256_reference_mb_per_s() -> f64 {
    const LEN: usize = 64 << 20;
    let data: Vec<u8> = (0..LEN).map(|i| (i as u8).wrapping_mul(31)).collect();
    let best = (0..3)
        .map(|_| {
            let started = Instant::now();
            std::hint::black_box(sha2::Sha256::digest(std::hint::black_box(&data)));
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    LEN as f64 / best.max(1e-9) / 1e6
}

/// CPU time this thread has run, from `/proc/thread-self/schedstat` (nanoseconds, the
/// scheduler's own count); `None` where that file cannot be read.
fn thread_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
    Some(ns as f64 / 1e9)
}

/// What writing fresh page cache costs this machine right now, in CPU-seconds per GiB:
/// 256 MiB written into a new file in `dir` (then removed), measured as this thread's
/// CPU time. Received pieces are written this way, so it is part of every agent's CPU
/// per GiB. On bare metal it is ~0.1–0.3; a VM that hands freed memory back to its host
/// pays a host fault per fresh page (this project's test VM: 1.9–3.4, against 0.10 to
/// rewrite cached pages; BENCHMARKS.md, issue 11, tenth session). `None` if the file
/// cannot be written or the CPU time not read. Takes 0.05–1 s.
pub(crate) fn page_cache_write_cpu_s_per_gib(dir: &std::path::Path) -> Option<f64> {
    use std::io::Write;
    const LEN: u64 = 256 << 20;
    let path = dir.join("page-cache-reference.scratch");
    let chunk: Vec<u8> = (0..1usize << 20)
        .map(|i| (i as u8).wrapping_mul(7))
        .collect();
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&path)?;
        for _ in 0..LEN / chunk.len() as u64 {
            f.write_all(&chunk)?;
        }
        Ok(())
    };
    let before = thread_cpu_seconds()?;
    let written = write();
    let cpu = thread_cpu_seconds()? - before;
    let _ = std::fs::remove_file(&path);
    written.ok()?;
    Some(cpu * (1u64 << 30) as f64 / LEN as f64)
}

/// [`page_cache_write_cpu_s_per_gib`] off the async runtime's threads, as the
/// benchmarks take it just before their runs.
pub(crate) async fn page_cache_write_reference(dir: &std::path::Path) -> Option<f64> {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || page_cache_write_cpu_s_per_gib(&dir))
        .await
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writing_fresh_page_cache_has_a_measured_cost_and_leaves_nothing() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let cost = page_cache_write_cpu_s_per_gib(dir.path()).expect("measured");
        assert!(cost.is_finite() && cost > 0.0, "{cost}");
        assert_eq!(std::fs::read_dir(dir.path()).expect("listed").count(), 0);
        let missing = dir.path().join("no-such-dir");
        assert_eq!(page_cache_write_cpu_s_per_gib(&missing), None);
    }

    #[test]
    fn steal_iowait_and_busy_come_from_their_own_fields() {
        let before = CpuTicks::parse("cpu  100 0 50 800 50 0 0 0 0 0").expect("parses");
        // 100 more ticks: 40 user, 10 steal, 30 idle, 20 iowait.
        let after = CpuTicks::parse("cpu  140 0 50 830 70 0 0 10 40 0").expect("parses");
        let cpu = after.since(before);
        assert!((cpu.busy - 0.5).abs() < 1e-9, "busy {}", cpu.busy);
        assert!((cpu.steal - 0.1).abs() < 1e-9, "steal {}", cpu.steal);
        assert!((cpu.iowait - 0.2).abs() < 1e-9, "iowait {}", cpu.iowait);
    }

    #[test]
    fn a_line_that_is_not_the_cpu_total_is_not_read() {
        assert_eq!(CpuTicks::parse("cpu0 1 2 3 4 5 6 7 8"), None);
        assert_eq!(CpuTicks::parse("cpu  1 2 x 4"), None);
        let cpu = CpuTicks::default().since(CpuTicks::default());
        assert_eq!((cpu.busy, cpu.steal, cpu.iowait), (0.0, 0.0, 0.0));
    }
}
