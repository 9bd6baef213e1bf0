//! The kube-scheduler extender against recorded ExtenderArgs fixtures (real Pod and
//! NodeList JSON shapes), and the plain ranking function.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use cluster::extender::{
    self, Chain, ExtenderArgs, HostPriority, Presence, RankRequest, ScoreConfig,
};
use cluster::inventory::Inventory;
use cluster::Error;
use common::*;

fn fixture(name: &str) -> ExtenderArgs {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("fixture");
    serde_json::from_str(&text).expect("ExtenderArgs parses")
}

/// gpu-a holds both images, gpu-b holds the 1 GiB layer and the shared base, gpu-c
/// nothing (50 MiB/s), gpu-d never reported, gpu-e stopped reporting 120 s ago.
fn cluster() -> (Inventory, MapCatalog) {
    let mut inv = Inventory::new(60);
    let mut a = full(&train());
    a.extend(full(&busybox()));
    inv.apply(report("gpu-a", 1, &a), NOW).expect("a");
    inv.apply(
        report(
            "gpu-b",
            1,
            &[(blob(2, GIB), GIB), (blob(4, 100 * MIB), 100 * MIB)],
        ),
        NOW,
    )
    .expect("b");
    let mut c = report("gpu-c", 1, &[]);
    c.throughput_bytes_per_sec = Some((50 * MIB) as f64);
    inv.apply(c, NOW).expect("c");
    inv.apply(report("gpu-e", 1, &a), NOW - 120).expect("e");
    (inv, MapCatalog::with(&[train(), busybox()]))
}

#[test]
fn fixtures_parse_with_go_field_names() {
    let args = fixture("filter_nodenames_require_warm.json");
    assert_eq!(args.nodes, None, "Nodes: null");
    assert_eq!(
        args.candidate_names(),
        ["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-e"]
    );
    assert_eq!(
        extender::pod_images(&args.pod),
        ["registry.example.com/ml/train:v1.4.2", "busybox:1.36"],
        "containers then initContainers, duplicates once"
    );
    assert!(extender::requires_warm(&args.pod));
    let args = fixture("filter_nodes_require_warm.json");
    assert_eq!(args.node_names, None);
    assert_eq!(
        args.candidate_names(),
        ["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-e"]
    );
    assert!(!extender::requires_warm(
        &fixture("prioritize_nodenames.json").pod
    ));
}

#[test]
fn filter_with_require_warm_and_node_names() {
    let (inv, cat) = cluster();
    let res = extender::filter(
        &fixture("filter_nodenames_require_warm.json"),
        &inv,
        &cat,
        NOW,
    );
    let json = serde_json::to_value(&res).expect("json");
    assert_eq!(
        json,
        serde_json::json!({
            "Nodes": null,
            "NodeNames": ["gpu-a"],
            "FailedNodes": {
                "gpu-b": "starling: missing 2.00 GiB of 3.10 GiB for 2 image(s); require-warm",
                "gpu-c": "starling: missing 3.10 GiB of 3.10 GiB for 2 image(s); require-warm",
                "gpu-d": "starling: node unknown to the tracker (no agent report); require-warm",
                "gpu-e": "starling: agent has not reported for over 60 s, cache contents unknown; require-warm"
            },
            "FailedAndUnresolvableNodes": {},
            "Error": ""
        })
    );
}

#[test]
fn filter_with_a_node_list_returns_the_passing_node_objects_verbatim() {
    let (inv, cat) = cluster();
    let args = fixture("filter_nodes_require_warm.json");
    let res = extender::filter(&args, &inv, &cat, NOW);
    assert_eq!(res.node_names, None);
    let list = res.nodes.expect("Nodes in reply");
    assert_eq!(list.items.len(), 1);
    let original = args.nodes.expect("nodes").items[0].clone();
    assert_eq!(list.items[0], original, "node object unchanged");
    assert_eq!(
        list.rest.get("metadata"),
        Some(&serde_json::json!({"resourceVersion": "48213380"}))
    );
    assert_eq!(res.failed_nodes.len(), 4);
}

#[test]
fn filter_without_annotation_passes_every_node() {
    let (inv, cat) = cluster();
    let res = extender::filter(&fixture("prioritize_nodenames.json"), &inv, &cat, NOW);
    assert_eq!(
        res.node_names.as_deref(),
        Some(&["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-e"].map(String::from)[..])
    );
    assert!(res.failed_nodes.is_empty());
}

#[test]
fn filter_require_warm_with_an_image_nobody_has() {
    let (inv, _) = cluster();
    let only_train = MapCatalog::with(&[train()]);
    let res = extender::filter(
        &fixture("filter_nodenames_require_warm.json"),
        &inv,
        &only_train,
        NOW,
    );
    assert_eq!(res.node_names, Some(vec![]));
    assert_eq!(
        res.failed_nodes.get("gpu-a").map(String::as_str),
        Some("starling: image busybox:1.36 is not cached anywhere in the cluster; require-warm")
    );
}

#[test]
fn prioritize_scores_seconds_saved_without_size_clamp() {
    let (inv, cat) = cluster();
    let res = extender::prioritize(
        &fixture("prioritize_nodenames.json"),
        &inv,
        &cat,
        NOW,
        &ScoreConfig::default(),
    );
    // Union: 3,328,094,072 bytes (the 100 MiB base layer counted once).
    // gpu-c cold at 50 MiB/s = 63.48 s is the reference; gpu-b misses
    // 2,149,494,648 bytes at 100 MiB/s = 20.50 s → saved 42.98 s → 6.77 → 7.
    let expected: Vec<HostPriority> = [
        ("gpu-a", 10),
        ("gpu-b", 7),
        ("gpu-c", 0),
        ("gpu-d", 0),
        ("gpu-e", 0),
    ]
    .iter()
    .map(|(h, s)| HostPriority {
        host: (*h).into(),
        score: *s,
    })
    .collect();
    assert_eq!(res, expected);
    assert_eq!(
        serde_json::to_value(&res[1]).expect("json"),
        serde_json::json!({"Host": "gpu-b", "Score": 7})
    );
}

#[test]
fn prioritize_with_inventory_catalog_fallback() {
    // The tracker's catalog knows only busybox; train is resolved from agent reports.
    let (mut inv, _) = cluster();
    let mut r = report("gpu-z", 1, &[]);
    r.images = vec![image_record(&train(), NOW, Default::default(), 1.0)];
    inv.apply(r, NOW).expect("z");
    let cat = MapCatalog::with(&[busybox()]);
    let chain = Chain(&cat, &inv);
    let res = extender::prioritize(
        &fixture("prioritize_nodenames.json"),
        &inv,
        &chain,
        NOW,
        &ScoreConfig::default(),
    );
    assert_eq!(
        res.iter().map(|h| h.score).collect::<Vec<_>>(),
        [10, 7, 0, 0, 0]
    );
}

#[test]
fn rank_sorts_by_expected_pull_time_with_figures() {
    let (inv, cat) = cluster();
    let req = RankRequest {
        image: Some("registry.example.com/ml/train:v1.4.2".into()),
        images: vec![],
        nodes: vec![
            "gpu-c".into(),
            "gpu-d".into(),
            "gpu-b".into(),
            "gpu-a".into(),
            "gpu-e".into(),
        ],
    };
    let res = extender::rank(&req, &inv, &cat, NOW, &ScoreConfig::default()).expect("rank");
    let train_total = 10_000 + 3 * GIB + 100 * MIB;
    assert_eq!(res.total_bytes, train_total);
    assert_eq!(res.manifest_digests, vec![d(100).to_string()]);
    let rows: Vec<(&str, Presence, u64, Option<f64>)> = res
        .nodes
        .iter()
        .map(|n| {
            (
                n.node.as_str(),
                n.presence,
                n.missing_bytes,
                n.expected_pull_seconds,
            )
        })
        .collect();
    let b_missing = train_total - GIB - 100 * MIB;
    assert_eq!(
        rows,
        vec![
            ("gpu-a", Presence::Known, 0, Some(0.0)),
            (
                "gpu-b",
                Presence::Known,
                b_missing,
                Some(b_missing as f64 / (100 * MIB) as f64)
            ),
            (
                "gpu-c",
                Presence::Known,
                train_total,
                Some(train_total as f64 / (50 * MIB) as f64)
            ),
            ("gpu-d", Presence::Absent, train_total, None),
            ("gpu-e", Presence::Unknown, 0, None),
        ]
    );
}

#[test]
fn rank_errors() {
    let (inv, cat) = cluster();
    let cfg = ScoreConfig::default();
    let none = RankRequest::default();
    assert!(matches!(
        extender::rank(&none, &inv, &cat, NOW, &cfg),
        Err(Error::InvalidRequest(_))
    ));
    let bad = RankRequest {
        image: Some("UPPER/case:1".into()),
        ..Default::default()
    };
    assert!(matches!(
        extender::rank(&bad, &inv, &cat, NOW, &cfg),
        Err(Error::BadReference { .. })
    ));
    let missing = RankRequest {
        image: Some("ghcr.io/nobody/nothing:1".into()),
        ..Default::default()
    };
    match extender::rank(&missing, &inv, &cat, NOW, &cfg) {
        Err(Error::UnknownImage(i)) => assert_eq!(i, "ghcr.io/nobody/nothing:1"),
        other => panic!("expected UnknownImage, got {other:?}"),
    }
}

/// A catalog whose registry never answers: `fetch` waits forever. It records the
/// lookups asked for in the background.
#[derive(Default)]
struct HungCatalog {
    known: MapCatalog,
    prefetched: std::sync::Mutex<Vec<String>>,
}

impl cluster::ImageCatalog for HungCatalog {
    fn resolve(&self, image: &oci::ImageReference) -> Option<cluster::ResolvedImage> {
        self.known.resolve(image)
    }
    fn prefetch(&self, image: &oci::ImageReference) {
        if let Ok(mut p) = self.prefetched.lock() {
            p.push(image.to_string());
        }
    }
    fn fetch<'a>(&'a self, _image: &'a oci::ImageReference) -> cluster::LookupFuture<'a> {
        Box::pin(std::future::pending())
    }
}

#[test]
fn the_extender_answers_from_memory_and_asks_for_unknown_images_in_the_background() {
    let catalog = std::sync::Arc::new(HungCatalog {
        known: MapCatalog::with(&[train()]),
        ..Default::default()
    });
    let state = cluster::ClusterState::with_options(
        cluster::ClusterConfig::default(),
        cluster::JobStore::in_memory().expect("store"),
        Some(catalog.clone()),
        std::sync::Arc::new(|| NOW),
    );
    state
        .ingest(report("gpu-a", 1, &full(&train())))
        .expect("report");
    let args: ExtenderArgs = serde_json::from_value(serde_json::json!({
        "Pod": {"metadata": {"name": "p", "annotations": {"starling.io/require-warm": "true"}},
                "spec": {"containers": [{"name": "a", "image": "registry.example.com/ml/train:v1.4.2"},
                                        {"name": "b", "image": "registry.example.com/ml/new:v9"}]}},
        "NodeNames": ["gpu-a"]
    }))
    .expect("args");
    // Neither verb touches `fetch` (which would never return).
    let scores = state.prioritize(&args);
    assert_eq!(scores.len(), 1);
    let filtered = state.filter(&args);
    assert!(
        filtered.failed_nodes["gpu-a"].contains("registry.example.com/ml/new:v9"),
        "{filtered:?}"
    );
    let asked = catalog.prefetched.lock().expect("lock").clone();
    assert!(
        asked.contains(&"registry.example.com/ml/new:v9".to_owned())
            && !asked.contains(&"registry.example.com/ml/train:v1.4.2".to_owned()),
        "only the unknown image is looked up in the background: {asked:?}"
    );
}
