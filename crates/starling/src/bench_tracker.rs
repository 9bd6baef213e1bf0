//! `starling bench tracker`: plays N agents against one or several trackers and reports
//! what the tracker sustains (announces/s, latency, its CPU and memory).
//!
//! Each simulated agent downloads `--blobs` large blobs. Its bitfields fill over
//! `--fill` in a per-agent piece order (starting at a random progress, so a run sees
//! every fill level at once, as in a pull under way); it announces each incomplete
//! blob at the interval the tracker asks for, sends the seeding batch of its complete
//! blobs every second and its inventory report every `--report-interval`, like the
//! agent. The agent the tracker elects source publishes piece hashes as it gains pieces.
//!
//! The client is built not to be the bottleneck: `--connections` workers, each owning
//! one keep-alive HTTP/1.1 connection and a share of the agents, one reused body
//! buffer per worker, responses read into a lean struct that skips the peer list.
//! Its own CPU time is printed next to the tracker's so a reader can tell.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;

mod agents;

use agents::{advance, make_agent, on_answer, report_body, AgentSim, LeanAnswer};

#[derive(Args, Clone)]
pub struct TrackerBenchArgs {
    /// Tracker base URL(s), comma-separated or repeated (plain http://). Without it the
    /// bench starts its own tracker (plain HTTP with a cluster token: the bench measures
    /// the tracker's work, not TLS). With several, the simulated agents are spread over
    /// them (by connection), each agent always talking to the same one.
    #[arg(long, value_delimiter = ',')]
    tracker: Vec<String>,
    /// The pid(s) of the given trackers (comma-separated or repeated), to read their CPU
    /// time (summed) and peak RSS (the largest) from /proc.
    #[arg(long, value_delimiter = ',')]
    tracker_pid: Vec<u32>,
    /// Cluster token the trackers require.
    #[arg(long, env = "STARLING_CLUSTER_TOKEN", hide_env_values = true)]
    cluster_token: Option<String>,
    /// Simulated agents.
    #[arg(long, default_value_t = 1000)]
    peers: usize,
    /// Blobs each agent downloads at once (the same blobs on every agent: one swarm each).
    #[arg(long, default_value_t = 1)]
    blobs: usize,
    /// Size of each blob.
    #[arg(long, default_value = "15GiB")]
    blob_size: String,
    /// Piece size proposed in the first announce.
    #[arg(long, default_value = "1MiB")]
    piece_size: String,
    /// Time a blob takes to fill from empty to complete.
    #[arg(long, default_value = "120s")]
    fill: humantime::Duration,
    /// Inventory report interval (the agent's is 3 s); 0s disables reports.
    #[arg(long, default_value = "3s")]
    report_interval: humantime::Duration,
    /// Concurrent keep-alive connections (one worker each).
    #[arg(long, default_value_t = 256)]
    connections: usize,
    /// Time before measuring (connections, first announces, elections).
    #[arg(long, default_value = "5s")]
    warmup: humantime::Duration,
    /// Measured time.
    #[arg(long, default_value = "30s")]
    duration: humantime::Duration,
    /// With a tracker started by the bench: its --announce-interval.
    #[arg(long, default_value = "1s")]
    announce_interval: humantime::Duration,
    /// Downloaders learn piece hashes from peers (HAVE from the source's neighbours) as
    /// soon as the source publishes them, so announce answers carry none. Without it
    /// they learn them only from the tracker: the worst case, every peer out of the
    /// source's reach.
    #[arg(long)]
    hashes_from_peers: bool,
    /// Manifests and small blobs (4 KiB) every agent holds from the start and adds to
    /// every `agent::SMALL_SEEDING_EVERY`th seeding batch as the agent does, the same
    /// ones on every agent (a node the registry cannot answer finds them so).
    #[arg(long, default_value_t = 0)]
    seeded_small: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// With trackers started by the bench: share their state through this Redis
    /// (`starling tracker --redis`), under a key prefix of their own.
    #[arg(long, value_name = "URL")]
    redis: Option<String>,
    /// With trackers started by the bench: how many replicas (more than one needs
    /// --redis); the simulated agents are spread over them.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// The pid of the Redis server, to report its CPU time next to the trackers'.
    #[arg(long)]
    redis_pid: Option<u32>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Announce(u16),
    Seeding,
    Report,
}

#[derive(Default)]
struct Tally {
    announce_us: Vec<u32>,
    report_us: Vec<u32>,
    seeding_us: Vec<u32>,
    errors: u64,
    reconnects: u64,
    /// Requests sent more than 100 ms after they were due (the client or the tracker
    /// could not keep up).
    late: u64,
}

fn proc_cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat(5) (utime, stime), counted after the comm field.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn proc_peak_rss_kib(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU ticks of all the given processes; none when any cannot be read (a sum that
/// silently left one out would understate the trackers' cost).
fn trackers_cpu_ticks(pids: &[String]) -> Option<u64> {
    if pids.is_empty() {
        return None;
    }
    pids.iter().map(|p| proc_cpu_ticks(p)).sum()
}

/// Linux reports process CPU in clock ticks of 1/100 s on every architecture it runs
/// GPU nodes on (USER_HZ).
const TICKS_PER_SEC: f64 = 100.0;

struct OwnTracker {
    child: tokio::process::Child,
    _dir: tempfile::TempDir,
}

async fn start_own_tracker(
    a: &TrackerBenchArgs,
    token: &str,
    redis_prefix: &str,
) -> Result<(String, OwnTracker)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let dir = tempfile::tempdir()?;
    let log = std::fs::File::create(dir.path().join("tracker.log"))?;
    let child = tokio::process::Command::new(std::env::current_exe()?)
        .args(["tracker", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--insecure-plain-http")
        .args(["--cluster-token", token])
        .args(["--announce-interval", &a.announce_interval.to_string()])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env("RUST_LOG", "warn")
        .envs(a.redis.iter().flat_map(|url| {
            [
                ("STARLING_TRACKER_REDIS", url.as_str()),
                ("STARLING_TRACKER_REDIS_PREFIX", redis_prefix),
            ]
        }))
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .context("starting the tracker")?;
    let url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    for _ in 0..100 {
        if http
            .get(format!("{url}/healthz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok((url, OwnTracker { child, _dir: dir }));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the tracker started by the bench did not come up on {url}")
}

/// One keep-alive HTTP/1.1 connection to one tracker.
struct Conn {
    addr: String,
    host: String,
    auth: Option<String>,
    sender: Option<hyper::client::conn::http1::SendRequest<Full<Bytes>>>,
}

impl Conn {
    async fn connect(&mut self) -> Result<()> {
        let tcp = tokio::net::TcpStream::connect(&self.addr).await?;
        tcp.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        self.sender = Some(sender);
        Ok(())
    }

    /// POSTs `body` and returns the answer's body when it is a 2xx.
    async fn post(&mut self, path: &str, body: Bytes) -> Result<Bytes> {
        if self.sender.as_ref().is_none_or(|s| s.is_closed()) {
            self.connect().await?;
        }
        let Some(sender) = self.sender.as_mut() else {
            bail!("not connected")
        };
        sender.ready().await?;
        let mut req = http::Request::post(path)
            .header(http::header::HOST, &self.host)
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(a) = &self.auth {
            req = req.header(http::header::AUTHORIZATION, a);
        }
        let resp = sender.send_request(req.body(Full::new(body))?).await?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), 16 << 20)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading the answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            bail!("tracker answered {status}");
        }
        Ok(body)
    }
}

/// The size of each `--seeded-small` entry: a manifest's or an image config's.
const SMALL_SEEDED_SIZE: u64 = 4 << 10;

struct Plan {
    blob_digests: Vec<oci::Digest>,
    /// Held by every agent from the start and seeded every second (`--seeded-small`).
    small_digests: Vec<oci::Digest>,
    blob_size: u64,
    piece_size: u64,
    fill: Duration,
    report_every: Option<Duration>,
    started: Instant,
    measure_from: Instant,
    measure_until: Instant,
    /// Hashes each blob's source has published (shared across workers), read by
    /// downloaders with `--hashes-from-peers`.
    published: Vec<std::sync::atomic::AtomicU32>,
    hashes_from_peers: bool,
}

async fn worker(mut conn: Conn, mut agents: Vec<AgentSim>, plan: std::sync::Arc<Plan>) -> Tally {
    let mut tally = Tally::default();
    let mut due: BinaryHeap<Reverse<(Instant, usize, Kind)>> = BinaryHeap::new();
    let spread = Duration::from_secs(1);
    let n = agents.len().max(1) as u32;
    for (i, a) in agents.iter().enumerate() {
        let first = plan.started + spread * i as u32 / n;
        for b in 0..a.blobs.len() {
            due.push(Reverse((first, i, Kind::Announce(b as u16))));
        }
        due.push(Reverse((
            first + Duration::from_millis(500),
            i,
            Kind::Seeding,
        )));
        if let Some(every) = plan.report_every {
            due.push(Reverse((first + every * i as u32 / n, i, Kind::Report)));
        }
    }
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    while let Some(Reverse((at, i, kind))) = due.pop() {
        if at >= plan.measure_until {
            break;
        }
        tokio::time::sleep_until(at.into()).await;
        let now = Instant::now();
        // Behind schedule (the tracker is saturated): stop at the end all the same.
        if now >= plan.measure_until {
            break;
        }
        let measuring = now >= plan.measure_from;
        if measuring && now.duration_since(at) > Duration::from_millis(100) {
            tally.late += 1;
        }
        let agent = &mut agents[i];
        buf.clear();
        let (path, next) =
            match kind {
                Kind::Announce(b) => {
                    let blob = &mut agent.blobs[b as usize];
                    if blob.req.complete {
                        // Announced complete once; from now on it is in the seeding batch.
                        continue;
                    }
                    advance(blob, &plan, now);
                    if serde_json::to_writer(&mut buf, &blob.req).is_err() {
                        tally.errors += 1;
                        continue;
                    }
                    ("/swarm/v1/announce", None)
                }
                Kind::Seeding => {
                    let with_small = agent.seedings.is_multiple_of(agent::SMALL_SEEDING_EVERY);
                    agent.seedings += 1;
                    let small = plan.small_digests.iter().filter(|_| with_small).map(|d| {
                        tracker::SeedBlob {
                            digest: d.clone(),
                            size: SMALL_SEEDED_SIZE,
                        }
                    });
                    let complete: Vec<tracker::SeedBlob> = agent
                        .blobs
                        .iter()
                        .filter(|b| b.req.complete)
                        .map(|b| tracker::SeedBlob {
                            digest: b.req.digest.clone(),
                            size: plan.blob_size,
                        })
                        .chain(small)
                        .collect();
                    due.push(Reverse((
                        next_slot(at, now, Duration::from_secs(1)),
                        i,
                        Kind::Seeding,
                    )));
                    if complete.is_empty() {
                        continue;
                    }
                    let Some(first) = agent.blobs.first() else {
                        continue;
                    };
                    let req = tracker::SeedingRequest {
                        node: agent.name.clone(),
                        addr: first.req.addr.clone(),
                        topology: first.req.topology.clone(),
                        blobs: complete,
                    };
                    if serde_json::to_writer(&mut buf, &req).is_err() {
                        tally.errors += 1;
                        continue;
                    }
                    ("/swarm/v1/seeding", None)
                }
                Kind::Report => {
                    agent.generation += 1;
                    if serde_json::to_writer(&mut buf, &report_body(agent, &plan)).is_err() {
                        tally.errors += 1;
                        continue;
                    }
                    let every = plan.report_every.unwrap_or(Duration::from_secs(3));
                    ("/api/v1/reports", Some(next_slot(at, now, every)))
                }
            };
        let sent = Instant::now();
        let answer = conn.post(path, Bytes::copy_from_slice(&buf)).await;
        let micros = sent.elapsed().as_micros().min(u32::MAX as u128) as u32;
        let mut reschedule = next;
        match answer {
            Ok(body) => {
                if measuring {
                    match kind {
                        Kind::Announce(_) => tally.announce_us.push(micros),
                        Kind::Seeding => tally.seeding_us.push(micros),
                        Kind::Report => tally.report_us.push(micros),
                    }
                }
                if let Kind::Announce(b) = kind {
                    let blob = &mut agent.blobs[b as usize];
                    match serde_json::from_slice::<LeanAnswer>(&body) {
                        Ok(ans) => {
                            on_answer(blob, &ans);
                            let interval = Duration::from_millis(ans.interval_ms.clamp(50, 60_000));
                            reschedule = Some(next_slot(at, now, interval));
                        }
                        Err(_) => {
                            tally.errors += u64::from(measuring);
                            reschedule = Some(now + Duration::from_secs(1));
                        }
                    }
                }
            }
            Err(_) => {
                tally.errors += u64::from(measuring);
                tally.reconnects += 1;
                conn.sender = None;
                if let Kind::Announce(_) = kind {
                    reschedule = Some(now + Duration::from_secs(1));
                }
            }
        }
        if let Some(t) = reschedule {
            due.push(Reverse((t, i, kind)));
        }
    }
    tally
}

/// The next time a periodic request is due: one period after this one, or after now
/// when this one went out late. Missed slots are skipped, not made up in a burst: a
/// saturated tracker shows as lateness and a lower rate, not as a client that floods.
fn next_slot(at: Instant, now: Instant, period: Duration) -> Instant {
    now.checked_sub(period).map_or(at, |t| at.max(t)) + period
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)] as f64 / 1000.0
}

pub async fn run(a: TrackerBenchArgs) -> Result<()> {
    let blob_size = crate::parse_size(&a.blob_size)?;
    let piece_size = crate::parse_size(&a.piece_size)?;
    if a.peers == 0 || a.blobs == 0 || a.connections == 0 {
        bail!("--peers, --blobs and --connections must be at least 1");
    }
    if a.blobs > 1000 {
        bail!("--blobs: at most 1000 blobs per agent");
    }
    let admitted = swarm::pieces::admitted_piece_size(blob_size, piece_size, None);
    if admitted != piece_size {
        bail!(
            "--piece-size {piece_size}: the tracker lays a {blob_size}-byte blob out in pieces of {admitted} \
             (the rule's range for some link), and the fake agents' reports would not match"
        );
    }
    let pieces = swarm::PieceLayout::piece_count(blob_size, piece_size);
    if pieces > u32::MAX as u64 {
        bail!("{blob_size} bytes in {piece_size}-byte pieces is too many pieces");
    }
    let token = a
        .cluster_token
        .clone()
        .unwrap_or_else(|| "bench-token".into());
    if a.replicas == 0 || (a.replicas > 1 && a.redis.is_none()) {
        bail!("--replicas: at least 1, and more than 1 only with --redis (shared state)");
    }
    let (urls, own, pids): (Vec<String>, Vec<OwnTracker>, Vec<String>) = if a.tracker.is_empty() {
        // A prefix of this run's own: earlier runs' swarms in the same Redis stay apart.
        let run = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let prefix = format!("bench-{}-{run}:", std::process::id());
        let (mut urls, mut own, mut pids) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..a.replicas {
            let (url, t) = start_own_tracker(&a, &token, &prefix).await?;
            pids.extend(t.child.id().map(|p| p.to_string()));
            urls.push(url);
            own.push(t);
        }
        (urls, own, pids)
    } else {
        let pids = a.tracker_pid.iter().map(|p| p.to_string()).collect();
        (a.tracker.clone(), Vec::new(), pids)
    };
    let mut endpoints = Vec::new();
    for u in &urls {
        let Some(hostport) = u.trim_end_matches('/').strip_prefix("http://") else {
            bail!("{u}: the bench speaks plain http:// only");
        };
        endpoints.push(hostport.to_owned());
    }
    let auth = Some(format!("Bearer {token}"));
    let connections = a.connections.min(a.peers);
    let started = Instant::now();
    let warmup: Duration = a.warmup.into();
    let duration: Duration = a.duration.into();
    let plan = std::sync::Arc::new(Plan {
        blob_digests: (0..a.blobs)
            .map(|b| oci::Digest::of(format!("starling-bench-blob-{b}").as_bytes()))
            .collect(),
        small_digests: (0..a.seeded_small)
            .map(|b| oci::Digest::of(format!("starling-bench-small-{b}").as_bytes()))
            .collect(),
        blob_size,
        piece_size,
        fill: Duration::from(a.fill).max(Duration::from_secs(1)),
        report_every: Some(Duration::from(a.report_interval)).filter(|d| !d.is_zero()),
        started,
        measure_from: started + warmup,
        measure_until: started + warmup + duration,
        published: (0..a.blobs)
            .map(|_| std::sync::atomic::AtomicU32::new(0))
            .collect(),
        hashes_from_peers: a.hashes_from_peers,
    });
    let mut shares: Vec<Vec<AgentSim>> = (0..connections).map(|_| Vec::new()).collect();
    for i in 0..a.peers {
        shares[i % connections].push(make_agent(i, &plan));
    }
    let mut tasks = Vec::new();
    for (w, agents) in shares.into_iter().enumerate() {
        let addr = endpoints[w % endpoints.len()].clone();
        let conn = Conn {
            host: addr.clone(),
            addr,
            auth: auth.clone(),
            sender: None,
        };
        tasks.push(tokio::spawn(worker(conn, agents, plan.clone())));
    }
    tokio::time::sleep_until(plan.measure_from.into()).await;
    let self_pid = std::process::id().to_string();
    let redis_pid = a.redis_pid.map(|p| p.to_string());
    let r0 = redis_pid.as_deref().and_then(proc_cpu_ticks);
    let (t0, c0, m0) = (
        trackers_cpu_ticks(&pids),
        proc_cpu_ticks(&self_pid),
        crate::machine::CpuTicks::now(),
    );
    tokio::time::sleep_until(plan.measure_until.into()).await;
    let r1 = redis_pid.as_deref().and_then(proc_cpu_ticks);
    let (t1, c1, m1) = (
        trackers_cpu_ticks(&pids),
        proc_cpu_ticks(&self_pid),
        crate::machine::CpuTicks::now(),
    );
    let peak_rss = pids.iter().filter_map(|p| proc_peak_rss_kib(p)).max();
    let mut total = Tally::default();
    for t in tasks {
        let t = t.await?;
        total.announce_us.extend(t.announce_us);
        total.report_us.extend(t.report_us);
        total.seeding_us.extend(t.seeding_us);
        total.errors += t.errors;
        total.reconnects += t.reconnects;
        total.late += t.late;
    }
    drop(own);
    total.announce_us.sort_unstable();
    total.report_us.sort_unstable();
    total.seeding_us.sort_unstable();
    let secs = duration.as_secs_f64();
    let cpu = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / TICKS_PER_SEC),
        _ => None,
    };
    let tracker_cpu = cpu(t0, t1);
    let redis_cpu = cpu(r0, r1);
    let client_cpu = cpu(c0, c1);
    let machine_cpu = m1.since(m0);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let out = serde_json::json!({
        "trackers": urls,
        "tracker_started_by_bench": a.tracker.is_empty(),
        "state": if a.redis.is_some() { "redis" } else if a.tracker.is_empty() { "embedded" } else { "as given" },
        "redis_cpu_cores": redis_cpu.map(|c| c / secs),
        "transport": "plain HTTP with a cluster token (--insecure-plain-http)",
        "peers": a.peers,
        "blobs_per_peer": a.blobs,
        "pieces_per_blob": pieces,
        "connections": connections,
        "hashes_from_peers": a.hashes_from_peers,
        "seconds": secs,
        "announces_per_s": total.announce_us.len() as f64 / secs,
        "announce_p50_ms": percentile(&total.announce_us, 0.50),
        "announce_p99_ms": percentile(&total.announce_us, 0.99),
        "seeding_per_s": total.seeding_us.len() as f64 / secs,
        "seeding_p99_ms": percentile(&total.seeding_us, 0.99),
        "reports_per_s": total.report_us.len() as f64 / secs,
        "report_p99_ms": percentile(&total.report_us, 0.99),
        "errors": total.errors,
        "reconnects": total.reconnects,
        "late_requests": total.late,
        "tracker_cpu_s": tracker_cpu,
        "tracker_cores_used": tracker_cpu.map(|c| c / secs),
        "tracker_peak_rss_mib": peak_rss.map(|k| k as f64 / 1024.0),
        "client_cpu_s": client_cpu,
        "client_cores_used": client_cpu.map(|c| c / secs),
        "machine_cores": cores,
        "machine_cpu_busy": machine_cpu.busy,
        "machine_cpu_steal": machine_cpu.steal,
        "machine_cpu_iowait": machine_cpu.iowait,
    });
    if a.json {
        println!("{out}");
        return Ok(());
    }
    let f = |v: Option<f64>| v.map_or("n/a".to_owned(), |v| format!("{v:.2}"));
    println!(
        "tracker(s): {} ({}; plain HTTP with a cluster token, --insecure-plain-http)",
        urls.join(","),
        if a.tracker.is_empty() {
            "started by the bench"
        } else {
            "given"
        }
    );
    println!(
        "peers={} blobs/peer={} pieces/blob={pieces} connections={connections} hashes_from_peers={} measured={secs:.0}s after {:.0}s warmup",
        a.peers,
        a.blobs,
        a.hashes_from_peers,
        warmup.as_secs_f64()
    );
    println!(
        "announces/s={:.0} p50={:.2}ms p99={:.2}ms | seeding/s={:.0} p99={:.2}ms | reports/s={:.0} p99={:.2}ms",
        total.announce_us.len() as f64 / secs,
        percentile(&total.announce_us, 0.50),
        percentile(&total.announce_us, 0.99),
        total.seeding_us.len() as f64 / secs,
        percentile(&total.seeding_us, 0.99),
        total.report_us.len() as f64 / secs,
        percentile(&total.report_us, 0.99),
    );
    println!(
        "errors={} reconnects={} late(>100ms behind schedule)={}",
        total.errors, total.reconnects, total.late
    );
    println!(
        "tracker cpu={} s ({} cores) peak_rss={} MiB | client cpu={} s ({} cores) | machine busy={:.0}% of {cores} cores (steal {:.0}%)",
        f(tracker_cpu),
        f(tracker_cpu.map(|c| c / secs)),
        f(peak_rss.map(|k| k as f64 / 1024.0)),
        f(client_cpu),
        f(client_cpu.map(|c| c / secs)),
        machine_cpu.busy * 100.0,
        machine_cpu.steal * 100.0,
    );
    if let Some(c) = redis_cpu {
        println!("redis cpu={c:.2} s ({:.2} cores)", c / secs);
    }
    println!("{out}");
    Ok(())
}
