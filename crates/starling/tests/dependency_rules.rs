//! The crate graph's rules (ARCHITECTURE.md, "Crate rules"), checked against
//! `cargo metadata`: a new dependency that breaks one fails here, not in review.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::collections::{BTreeMap, BTreeSet};

/// Each workspace crate's direct normal (non-dev, non-build) dependencies.
fn dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let mut graph = BTreeMap::new();
    for p in meta["packages"].as_array().expect("packages") {
        let deps = p["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            .filter(|d| d["kind"].is_null())
            .map(|d| d["name"].as_str().expect("name").to_owned())
            .collect();
        graph.insert(p["name"].as_str().expect("name").to_owned(), deps);
    }
    graph
}

fn deps_of<'a>(graph: &'a BTreeMap<String, BTreeSet<String>>, krate: &str) -> &'a BTreeSet<String> {
    graph
        .get(krate)
        .unwrap_or_else(|| panic!("no crate {krate} in the workspace"))
}

/// Crates that do network, disk or async I/O.
const IO_CRATES: &[&str] = &[
    "tokio",
    "reqwest",
    "hyper",
    "hyper-util",
    "axum",
    "tower",
    "redb",
    "redis",
    "rustix",
    "store",
    "agent",
    "tracker",
    "origin",
    "rustls",
    "tokio-rustls",
];

#[test]
fn the_swarm_core_and_the_simulator_do_no_io() {
    let graph = dependencies();
    for core in ["swarm", "sim"] {
        let io: Vec<_> = deps_of(&graph, core)
            .iter()
            .filter(|d| IO_CRATES.contains(&d.as_str()))
            .collect();
        assert!(io.is_empty(), "{core} depends on I/O crates {io:?}");
    }
}

#[test]
fn product_crates_do_not_depend_on_demo_test_or_sibling_services() {
    let graph = dependencies();
    let forbidden: &[(&str, &[&str])] = &[
        // The demo registry, the simulator and the analyzer are not part of the node agent.
        (
            "agent",
            &[
                "origin",
                "sim",
                "analyze",
                "tracker",
                "testkit",
                "fuzzcheck",
                "anyhow",
                // The shared tracker state is the trackers' business; agents speak HTTP.
                "redis",
            ],
        ),
        (
            "tracker",
            &["agent", "origin", "sim", "testkit", "fuzzcheck", "anyhow"],
        ),
        (
            "cluster",
            &["agent", "tracker", "origin", "testkit", "anyhow"],
        ),
        (
            "swarm",
            &["agent", "tracker", "cluster", "testkit", "anyhow"],
        ),
        (
            "store",
            &["agent", "tracker", "cluster", "origin", "testkit", "anyhow"],
        ),
        (
            "oci",
            &[
                "agent", "tracker", "cluster", "store", "swarm", "origin", "testkit", "anyhow",
            ],
        ),
        (
            "pki",
            &["agent", "tracker", "cluster", "oci", "testkit", "anyhow"],
        ),
        ("ratelimit", &["agent", "tracker", "origin", "anyhow"]),
        ("sim", &["agent", "tracker", "testkit", "anyhow"]),
    ];
    let mut broken = Vec::new();
    for (krate, never) in forbidden {
        for d in deps_of(&graph, krate) {
            if never.contains(&d.as_str()) {
                broken.push(format!("{krate} → {d}"));
            }
        }
    }
    assert!(broken.is_empty(), "forbidden dependencies: {broken:?}");
}

#[test]
fn nothing_depends_on_the_binary() {
    let graph = dependencies();
    let users: Vec<_> = graph
        .iter()
        .filter(|(_, deps)| deps.contains("starling"))
        .map(|(k, _)| k)
        .collect();
    assert!(
        users.is_empty(),
        "{users:?} depend on the starling binary crate"
    );
}
