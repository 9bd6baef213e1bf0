#![allow(clippy::unwrap_used)] // a load tool: a failed request ends the run
//! A load run of prewarm progress reports against running trackers (issue 14): how many
//! `POST /api/v1/prewarm/{id}/nodes/{node}` a job of many nodes takes per second, and
//! what the trackers (and Redis) spend on them.
//!
//! ```text
//! cargo run --release -p tracker --example prewarm_reports -- \
//!     --tracker http://127.0.0.1:7001,http://127.0.0.1:7002 --nodes 1000 --rounds 5 \
//!     --concurrency 64 --pids 1234,1235,1236
//! ```
//!
//! Plain-HTTP trackers (`--insecure-plain-http`, no cluster token on these routes). It
//! reports `--nodes` simulated nodes into the inventory, submits one job over all of
//! them (a file source, so no registry is asked), then sends `--rounds` progress
//! reports per node, node `i` to tracker `i mod T`, `--concurrency` at once, and
//! measures that phase: reports/s, p50/p99, non-2xx answers, CPU of `--pids` (trackers,
//! Redis) and of the whole machine (`/proc/stat`). Then every node reports Done and the
//! run waits until every tracker shows the job done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Args {
    trackers: Vec<String>,
    nodes: usize,
    rounds: usize,
    concurrency: usize,
    pids: Vec<u32>,
}

fn parse_args() -> Args {
    let mut a = Args {
        trackers: Vec::new(),
        nodes: 1000,
        rounds: 5,
        concurrency: 64,
        pids: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let number = || value.parse::<usize>().expect("a number");
        match flag.as_str() {
            "--tracker" => a.trackers = value.split(',').map(str::to_owned).collect(),
            "--nodes" => a.nodes = number(),
            "--rounds" => a.rounds = number(),
            "--concurrency" => a.concurrency = number().max(1),
            "--pids" => {
                a.pids = value
                    .split(',')
                    .map(|p| p.parse().expect("a pid"))
                    .collect()
            }
            other => panic!("unknown flag {other}"),
        }
    }
    assert!(!a.trackers.is_empty(), "--tracker URL[,URL] is required");
    a
}

fn report(node: &str) -> serde_json::Value {
    serde_json::json!({
        "node": node,
        "generation": 1,
        "labels": {"load": "prewarm"},
        "cache_budget": 1u64 << 40,
        "cache_used": 0,
        "cache_free": 1u64 << 40,
        "blobs": [],
        "images": [],
    })
}

/// CPU ticks (user + system) of a process.
fn process_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    n(11) + n(12)
}

/// (busy, total) ticks of the whole machine.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = cpu.iter().sum();
    let idle = cpu.get(3).copied().unwrap_or(0) + cpu.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// Sends `work` (node index, body) with `concurrency` workers; node `i` goes to
/// tracker `i mod T`. Returns the latencies of 2xx answers and the count of others.
async fn send_all(
    client: &reqwest::Client,
    trackers: &[String],
    job: u64,
    work: Vec<(usize, serde_json::Value)>,
    concurrency: usize,
) -> (Vec<Duration>, usize) {
    let work = Arc::new(work);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (work, next, client) = (work.clone(), next.clone(), client.clone());
        let trackers = trackers.to_vec();
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut bad) = (Vec::new(), 0usize);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((node, body)) = work.get(i) else {
                    break;
                };
                let url = format!(
                    "{}/api/v1/prewarm/{job}/nodes/n{node:05}",
                    trackers[node % trackers.len()]
                );
                let t = Instant::now();
                match client.post(&url).json(body).send().await {
                    Ok(r) if r.status().is_success() => lat.push(t.elapsed()),
                    _ => bad += 1,
                }
            }
            (lat, bad)
        }));
    }
    let (mut lat, mut bad) = (Vec::new(), 0);
    for t in tasks {
        let (l, b) = t.await.expect("worker");
        lat.extend(l);
        bad += b;
    }
    (lat, bad)
}

fn quantile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let a = parse_args();
    let client = reqwest::Client::new();
    let t0 = &a.trackers[0];
    // Inventory: every node reports once (spread over the trackers).
    let mut posts = Vec::new();
    for i in 0..a.nodes {
        let (c, url) = (
            client.clone(),
            format!("{}/api/v1/reports", a.trackers[i % a.trackers.len()]),
        );
        posts.push(tokio::spawn(async move {
            c.post(url)
                .json(&report(&format!("n{i:05}")))
                .send()
                .await
                .map(|r| r.status().is_success())
                .unwrap_or(false)
        }));
        if posts.len() >= 64 {
            for p in posts.drain(..) {
                assert!(p.await.unwrap(), "inventory report refused");
            }
        }
    }
    for p in posts {
        assert!(p.await.unwrap(), "inventory report refused");
    }
    // A replica drops reports it cannot publish fast enough (agents report again
    // every few seconds): what is missing is sent again, as an agent's next report.
    for t in &a.trackers {
        let mut waited = 0u32;
        loop {
            let v: serde_json::Value = client
                .get(format!("{t}/api/v1/nodes"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let listed: std::collections::HashSet<&str> = v["nodes"]
                .as_array()
                .map(|n| n.iter().filter_map(|x| x["name"].as_str()).collect())
                .unwrap_or_default();
            if listed.len() >= a.nodes {
                break;
            }
            waited += 1;
            if waited.is_multiple_of(10) {
                for i in (0..a.nodes).filter(|i| !listed.contains(format!("n{i:05}").as_str())) {
                    client
                        .post(format!(
                            "{}/api/v1/reports",
                            a.trackers[i % a.trackers.len()]
                        ))
                        .json(&report(&format!("n{i:05}")))
                        .send()
                        .await
                        .unwrap();
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let key = oci::Digest::of(format!("prewarm-load-{}", std::process::id()).as_bytes());
    let size = 1u64 << 30;
    let nodes: Vec<String> = (0..a.nodes).map(|i| format!("n{i:05}")).collect();
    let job: serde_json::Value = client
        .post(format!("{t0}/api/v1/prewarm"))
        .json(&serde_json::json!({
            "images": [cluster::wire::file_reference(&key)],
            "files": [{"key": key, "url": "http://127.0.0.1:9/load", "size": size}],
            "targets": {"nodes": nodes},
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = job["id"].as_u64().unwrap_or_else(|| panic!("job: {job}"));

    let work: Vec<(usize, serde_json::Value)> = (1..=a.rounds)
        .flat_map(|r| {
            (0..a.nodes).map(move |i| {
                let done = size / (a.rounds as u64 + 1) * r as u64;
                (
                    i,
                    serde_json::json!({"kind": "progress", "bytes_done": done}),
                )
            })
        })
        .collect();
    let before: Vec<u64> = a.pids.iter().map(|p| process_ticks(*p)).collect();
    let machine_before = machine_ticks();
    let started = Instant::now();
    let (mut lat, bad) = send_all(&client, &a.trackers, id, work, a.concurrency).await;
    let secs = started.elapsed().as_secs_f64();
    let machine_after = machine_ticks();
    let after: Vec<u64> = a.pids.iter().map(|p| process_ticks(*p)).collect();
    lat.sort();
    // USER_HZ is 100 on Linux.
    let cores: Vec<String> = before
        .iter()
        .zip(&after)
        .map(|(b, e)| format!("{:.2}", (e - b) as f64 / 100.0 / secs))
        .collect();
    let busy = (machine_after.0 - machine_before.0) as f64
        / (machine_after.1 - machine_before.1).max(1) as f64;
    println!(
        "progress: {} reports in {secs:.2} s = {:.0}/s, p50 {:.1} ms, p99 {:.1} ms, non-2xx {bad}, \
         CPU of pids {:?} = [{}] cores, machine busy {:.0} %",
        lat.len() + bad,
        (lat.len() + bad) as f64 / secs,
        quantile(&lat, 0.5),
        quantile(&lat, 0.99),
        a.pids,
        cores.join(", "),
        busy * 100.0
    );

    let done: Vec<(usize, serde_json::Value)> = (0..a.nodes)
        .map(|i| (i, serde_json::json!({"kind": "done"})))
        .collect();
    let (_, bad_done) = send_all(&client, &a.trackers, id, done, a.concurrency).await;
    let finishing = Instant::now();
    for t in &a.trackers {
        loop {
            let v: serde_json::Value = client
                .get(format!("{t}/api/v1/prewarm/{id}"))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap_or_default();
            if v["progress"]["status"] == "done" {
                break;
            }
            if finishing.elapsed() > Duration::from_secs(120) {
                println!("{t}: job not done: {}", v["progress"]);
                std::process::exit(1);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    println!("done: non-2xx {bad_done}; the job is done on every tracker");
}
