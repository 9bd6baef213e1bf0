//! The benchmark commands themselves, run small: a benchmark that no longer starts
//! (as `bench get` did once plain HTTP became opt-in) is found here, not by the next
//! person measuring. Their figures are bytes, not times: tests never judge speed.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::process::Command;

use serde_json::Value;

fn run_json(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_starling"))
        .args(args)
        .env("STARLING_LOG", "warn")
        .output()
        .expect("run starling");
    assert!(
        out.status.success(),
        "starling {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "starling {args:?} printed no JSON report ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn bench_get_fetches_one_file_onto_every_node_with_about_one_copy_from_the_origin() {
    let report = run_json(&[
        "bench",
        "get",
        "--nodes",
        "3",
        "--size",
        "24MiB",
        "--no-direct",
        "--json",
    ]);
    assert_eq!(report["nodes"], 3);
    let per_node = report["per_node_seconds"]
        .as_array()
        .expect("per-node times");
    assert_eq!(per_node.len(), 3);
    assert!(per_node.iter().all(|s| s.as_f64().is_some_and(|s| s > 0.0)));
    // Three nodes, one file: the swarm asks the origin for it about once, where three
    // direct downloads would take three copies.
    let ratio = report["origin_bytes_ratio"].as_f64().expect("origin ratio");
    assert!(
        (0.99..1.5).contains(&ratio),
        "origin sent {ratio} × the file"
    );
}

#[test]
fn the_demo_pulls_its_image_onto_every_node_with_about_one_copy_from_the_registry() {
    let report = run_json(&[
        "demo",
        "--nodes",
        "3",
        "--scale",
        "0.005",
        "--no-direct",
        "--json",
    ]);
    assert_eq!(report["nodes"], 3);
    assert_eq!(report["per_node"].as_array().map(Vec::len), Some(3));
    let ratio = report["registry_bytes_ratio"]
        .as_f64()
        .unwrap_or_else(|| panic!("no registry ratio in {report}"));
    assert!(
        (0.99..1.5).contains(&ratio),
        "registry sent {ratio} × the image"
    );
}
