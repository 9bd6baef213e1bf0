//! Extender latency: filter + prioritize for 1,000 nodes and a 20-layer image,
//! answered from memory, over 1,000 iterations. Prints p50/p99 (run with
//! `--nocapture`; `--release` for production figures); wall-clock is not asserted.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::sync::Arc;
use std::time::Instant;

use cluster::extender::ExtenderArgs;
use cluster::inventory::{BlobRef, ResolvedImage};
use cluster::{ClusterConfig, ClusterState, JobStore};
use common::*;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[test]
fn filter_and_prioritize_1000_nodes_20_layers() {
    let layers: Vec<BlobRef> = (1..=20u8)
        .map(|i| blob(i, u64::from(i) * 100 * MIB))
        .collect();
    let image = ResolvedImage {
        reference: "registry.example.com/ml/big:2026.11".into(),
        manifest_digest: d(250),
        blobs: layers.clone(),
    };
    let state = ClusterState::with_options(
        ClusterConfig::default(),
        JobStore::in_memory().expect("store"),
        None,
        Arc::new(|| NOW),
    );
    let names: Vec<String> = (0..1000).map(|i| format!("node-{i:04}")).collect();
    for (i, n) in names.iter().enumerate() {
        // node-i holds the first (i % 21) layers; half of the nodes also hold 50 unrelated blobs.
        let mut held: Vec<(BlobRef, u64)> = layers
            .iter()
            .take(i % 21)
            .map(|b| (b.clone(), b.size))
            .collect();
        if i % 2 == 0 {
            held.extend((0..50u8).map(|j| (blob(100 + j, MIB), MIB)));
        }
        let mut r = report(n, 1, &held);
        if i == 0 {
            r.images = vec![image_record(&image, NOW, Default::default(), 1.0)];
        }
        state.ingest(r).expect("ingest");
    }
    let body = serde_json::json!({
        "Pod": {"metadata": {"name": "p", "namespace": "ml", "annotations": {"starling.io/require-warm": "true"}},
                "spec": {"containers": [{"name": "main", "image": "registry.example.com/ml/big:2026.11"}]}},
        "NodeNames": names,
    })
    .to_string();

    let iterations = 1000;
    let mut core = Vec::with_capacity(iterations);
    let mut filter_only = Vec::with_capacity(iterations);
    let mut prioritize_only = Vec::with_capacity(iterations);
    let mut with_json = Vec::with_capacity(iterations);
    let mut last = None;
    for _ in 0..iterations {
        let t0 = Instant::now();
        let args: ExtenderArgs = serde_json::from_str(&body).expect("args");
        let t1 = Instant::now();
        let f = state.filter(&args);
        let tf = Instant::now();
        let p = state.prioritize(&args);
        let t2 = Instant::now();
        filter_only.push((tf - t1).as_secs_f64() * 1e3);
        prioritize_only.push((t2 - tf).as_secs_f64() * 1e3);
        let out = (
            serde_json::to_vec(&f).expect("f").len(),
            serde_json::to_vec(&p).expect("p").len(),
        );
        let t3 = Instant::now();
        core.push((t2 - t1).as_secs_f64() * 1e3);
        with_json.push((t3 - t0).as_secs_f64() * 1e3);
        last = Some((f, p, out));
    }
    core.sort_by(f64::total_cmp);
    filter_only.sort_by(f64::total_cmp);
    prioritize_only.sort_by(f64::total_cmp);
    println!(
        "per request: filter p50 {:.3} ms p99 {:.3} ms; prioritize p50 {:.3} ms p99 {:.3} ms",
        percentile(&filter_only, 0.5),
        percentile(&filter_only, 0.99),
        percentile(&prioritize_only, 0.5),
        percentile(&prioritize_only, 0.99)
    );
    with_json.sort_by(f64::total_cmp);
    println!(
        "extender 1000 nodes x 20 layers, {iterations} iterations: filter+prioritize p50 {:.3} ms p99 {:.3} ms; with JSON parse+encode p50 {:.3} ms p99 {:.3} ms",
        percentile(&core, 0.5),
        percentile(&core, 0.99),
        percentile(&with_json, 0.5),
        percentile(&with_json, 0.99)
    );
    let (f, p, _) = last.expect("ran");
    // Nodes holding all 20 layers: i % 21 == 20 → 47 of 1000.
    assert_eq!(f.node_names.as_ref().map(Vec::len), Some(47));
    assert_eq!(f.failed_nodes.len(), 953);
    assert_eq!(p.len(), 1000);
    let score = |n: &str| p.iter().find(|h| h.host == n).map(|h| h.score);
    assert_eq!(score("node-0020"), Some(10));
    assert_eq!(score("node-0000"), Some(0));
    // node-0010 holds layers 1..10: 5,500 MiB of 21,000 MiB → 2.6 → 3.
    assert_eq!(score("node-0010"), Some(3));
}
