//! Unit tests of the inventory: generations, silence, holders, the catalog, limits.
use super::*;

pub(crate) fn d(n: u8) -> Digest {
    Digest::from_sha256([n; 32])
}

fn report(node: &str, generation: u64, blobs: &[(u8, u64, u64)]) -> NodeReport {
    NodeReport {
        node: node.into(),
        generation,
        labels: BTreeMap::new(),
        agent_url: None,
        blobs: blobs
            .iter()
            .map(|&(n, size, held)| BlobHolding {
                digest: d(n),
                size,
                bytes_held: held,
                complete: held == size,
            })
            .collect(),
        images: vec![],
        pins: vec![],
        cache_budget: 1000,
        cache_used: 0,
        cache_free: 1000,
        downloads_in_flight: vec![],
        throughput_bytes_per_sec: None,
    }
}

#[test]
fn stale_generations_are_refused_and_same_generation_is_a_heartbeat() {
    let mut inv = Inventory::new(30);
    assert_eq!(
        inv.apply(report("n1", 5, &[(1, 100, 100)]), 1000).ok(),
        Some(Applied::New)
    );
    let err = inv.apply(report("n1", 4, &[]), 1001).expect_err("stale");
    assert_eq!(
        err.to_string(),
        "stale report from n1: generation 4 < current 5"
    );
    assert_eq!(
        inv.entry("n1").map(|e| e.report.blobs.len()),
        Some(1),
        "stale report did not replace"
    );
    assert_eq!(
        inv.apply(report("n1", 5, &[]), 1010).ok(),
        Some(Applied::Heartbeat)
    );
    assert_eq!(
        inv.entry("n1")
            .map(|e| (e.report.blobs.len(), e.last_heartbeat)),
        Some((1, 1010))
    );
    let mut stale = report("n1", 3, &[]);
    stale.images = vec![ImageRecord {
        manifest_digest: d(50),
        index_digest: None,
        references: vec!["python:3.12".into()],
        blobs: vec![],
        last_pull: Some(1),
        last_use: None,
        bytes_by_source: SourceBytes::default(),
        pull_seconds: None,
    }];
    assert!(inv.apply(stale, 1015).is_err());
    let py = ImageReference::parse("python:3.12").expect("ref");
    assert_eq!(
        inv.resolve(&py),
        None,
        "a refused report does not feed the catalog"
    );
    assert_eq!(
        inv.apply(report("n1", 6, &[]), 1020).ok(),
        Some(Applied::Updated)
    );
    assert_eq!(inv.entry("n1").map(|e| e.report.blobs.len()), Some(0));
}

#[test]
fn silent_nodes_become_unknown_not_empty() {
    let mut inv = Inventory::new(30);
    inv.apply(report("n1", 1, &[(1, 100, 100)]), 1000)
        .expect("apply");
    assert_eq!(inv.status("n1", 1030), Some(NodeStatus::Known));
    assert_eq!(inv.status("n1", 1031), Some(NodeStatus::Unknown));
    let h = inv.holders(
        &[BlobRef {
            digest: d(1),
            size: 100,
        }],
        1031,
    );
    assert_eq!(
        h,
        vec![Holding {
            node: "n1".into(),
            status: NodeStatus::Unknown,
            bytes_held: 100,
            total_bytes: 100
        }]
    );
    inv.heartbeat("n1", 1, 1040).expect("heartbeat");
    assert_eq!(inv.status("n1", 1041), Some(NodeStatus::Known));
    assert!(matches!(inv.heartbeat("nope", 1, 1), Err(Error::UnknownNode(n)) if n == "nope"));
    assert!(matches!(
        inv.heartbeat("n1", 2, 1),
        Err(Error::InvalidRequest(_))
    ));
    assert_eq!(inv.status("nope", 0), None);
}

#[test]
fn holders_count_shared_layers_once_and_partials_by_bytes() {
    let mut inv = Inventory::new(30);
    inv.apply(report("a", 1, &[(1, 100, 100), (2, 50, 20)]), 0)
        .expect("a");
    inv.apply(report("b", 1, &[(2, 50, 50)]), 0).expect("b");
    inv.apply(report("c", 1, &[(9, 10, 10)]), 0).expect("c");
    let blobs = [
        BlobRef {
            digest: d(1),
            size: 100,
        },
        BlobRef {
            digest: d(2),
            size: 50,
        },
        BlobRef {
            digest: d(1),
            size: 100,
        }, // shared layer listed twice
        BlobRef {
            digest: d(3),
            size: 7,
        },
    ];
    let h = inv.holders(&blobs, 0);
    assert_eq!(
        h.iter()
            .map(|h| (h.node.as_str(), h.bytes_held, h.total_bytes))
            .collect::<Vec<_>>(),
        vec![("a", 120, 157), ("b", 50, 157)]
    );
    assert_eq!(inv.bytes_held("c", &blobs), Some(0));
    assert_eq!(inv.bytes_held("zz", &blobs), None);
}

#[test]
fn resolves_tags_digests_and_detects_moving_tags() {
    let mut inv = Inventory::new(30);
    let img = |m: u8, t: u64| ImageRecord {
        manifest_digest: d(m),
        index_digest: Some(d(200)),
        references: vec!["python:3.12".into()],
        blobs: vec![BlobRef {
            digest: d(m + 1),
            size: 10,
        }],
        last_pull: Some(t),
        last_use: None,
        bytes_by_source: SourceBytes::default(),
        pull_seconds: None,
    };
    let mut r1 = report("a", 1, &[]);
    r1.images = vec![img(10, 100)];
    inv.apply(r1, 0).expect("a");
    let py = ImageReference::parse("docker.io/library/python:3.12").expect("ref");
    assert!(!inv.tag_seen_moving(&py));
    assert_eq!(inv.resolve(&py).map(|r| r.manifest_digest), Some(d(10)));
    let mut r2 = report("b", 1, &[]);
    r2.images = vec![img(20, 200)];
    inv.apply(r2, 0).expect("b");
    assert!(inv.tag_seen_moving(&py));
    assert_eq!(
        inv.resolve(&py).map(|r| r.manifest_digest),
        Some(d(20)),
        "latest pull wins"
    );
    let by_digest = ImageReference::parse(&format!("python@{}", d(10))).expect("ref");
    assert_eq!(
        inv.resolve(&by_digest).map(|r| r.blobs[0].digest.clone()),
        Some(d(11))
    );
    let by_index = ImageReference::parse(&format!("python@{}", d(200))).expect("ref");
    assert!(inv.resolve(&by_index).is_some());
    let other = ImageReference::parse("python:3.13").expect("ref");
    assert_eq!(inv.resolve(&other), None);
}

fn limited() -> Inventory {
    Inventory::with_limits(
        30,
        InventoryLimits {
            max_nodes: 3,
            node_expiry_s: 100,
            max_report_blobs: 4,
            max_total_entries: 10,
            ..Default::default()
        },
    )
}

#[test]
fn node_cap_refuses_new_nodes_until_silent_ones_expire() {
    let mut inv = limited();
    for (i, n) in ["a", "b", "c"].iter().enumerate() {
        inv.apply(report(n, 1, &[(i as u8, 10, 10)]), 1000)
            .expect("room");
    }
    let err = inv.apply(report("d", 1, &[]), 1001).expect_err("full");
    assert!(matches!(err, Error::Capacity(_)), "{err}");
    // Known nodes still report.
    assert_eq!(
        inv.apply(report("a", 2, &[]), 1050).ok(),
        Some(Applied::Updated)
    );
    // b and c silent for over 100 s: forgotten to make room, with their digests.
    assert_eq!(
        inv.apply(report("d", 1, &[]), 1102).ok(),
        Some(Applied::New)
    );
    assert_eq!(inv.len(), 2);
    assert_eq!(
        inv.digests(),
        0,
        "a's new report holds nothing; b and c are gone"
    );
    assert_eq!(inv.expire(1200), vec!["a".to_owned()]);
}

#[test]
fn report_shape_and_total_entries_are_bounded() {
    let mut inv = limited();
    let err = inv
        .apply(
            report(
                "a",
                1,
                &[(1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 1), (5, 1, 1)],
            ),
            0,
        )
        .expect_err("5 blobs > 4");
    assert!(matches!(err, Error::ReportTooLarge(_)), "{err}");
    let err = inv
        .apply(report(&"x".repeat(300), 1, &[]), 0)
        .expect_err("name");
    assert!(matches!(err, Error::InvalidRequest(_)), "{err}");
    inv.apply(
        report("a", 1, &[(1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 1)]),
        0,
    )
    .expect("4 entries");
    inv.apply(
        report("b", 1, &[(1, 1, 1), (2, 1, 1), (3, 1, 1), (5, 1, 1)]),
        0,
    )
    .expect("8 entries");
    let err = inv
        .apply(report("c", 1, &[(6, 1, 1), (7, 1, 1), (8, 1, 1)]), 0)
        .expect_err("11 > 10");
    assert!(matches!(err, Error::Capacity(_)), "{err}");
    // A node shrinking its report makes room.
    inv.apply(report("a", 2, &[(1, 1, 1)]), 0).expect("smaller");
    inv.apply(report("c", 1, &[(6, 1, 1), (7, 1, 1), (8, 1, 1)]), 0)
        .expect("fits now");
    assert_eq!(inv.digests(), 7, "d(2) is still held by b; d(4) by nobody");
    assert!(inv.forget("b"));
    assert_eq!(inv.digests(), 4);
    let d4 = BlobRef {
        digest: d(4),
        size: 1,
    };
    assert!(inv.holders(&[d4], 0).is_empty());
}

#[test]
fn the_catalog_follows_reports_and_forgets_with_them() {
    let mut inv = Inventory::new(30);
    let img = |m: u8, t: u64| ImageRecord {
        manifest_digest: d(m),
        index_digest: None,
        references: vec!["python:3.12".into()],
        blobs: vec![BlobRef {
            digest: d(m + 1),
            size: 10,
        }],
        last_pull: Some(t),
        last_use: None,
        bytes_by_source: SourceBytes::default(),
        pull_seconds: None,
    };
    let py = ImageReference::parse("python:3.12").expect("ref");
    let mut r = report("a", 1, &[]);
    r.images = vec![img(10, 100)];
    inv.apply(r, 0).expect("a");
    assert_eq!(inv.resolve(&py).map(|r| r.manifest_digest), Some(d(10)));
    let mut r = report("a", 2, &[]);
    r.images = vec![];
    inv.apply(r, 1).expect("a again");
    assert_eq!(inv.resolve(&py), None, "nobody reports it any more");
    assert_eq!(inv.catalog_keys(), 0);
    let mut r = report("b", 1, &[]);
    r.images = vec![img(20, 50)];
    inv.apply(r, 2).expect("b");
    assert_eq!(inv.resolve(&py).map(|r| r.manifest_digest), Some(d(20)));
    assert!(inv.tag_seen_moving(&py), "the history outlives the reports");
    inv.forget("b");
    assert_eq!(inv.resolve(&py), None);
}
