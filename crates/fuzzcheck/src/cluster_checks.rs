//! Checks for the cluster layer's network input: label selectors, node reports and
//! prewarm requests (JSON bodies the tracker takes from agents and operators).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use cluster::inventory::{Applied, BlobHolding, BlobRef, Download, ImageRecord, Pin, SourceBytes};
use cluster::prewarm::{MAX_DEADLINE_SECONDS, MAX_PIN_TTL_SECONDS};
use cluster::selector::{validate_key, validate_value, Requirement};
use cluster::{Inventory, InventoryLimits, JobStore, NodeReport, PrewarmRequest, Selector};
use oci::{Digest, ImageReference};
use regex::Regex;

// ---------------------------------------------------------------------------------
// selector
// ---------------------------------------------------------------------------------

static NAME: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$").expect("regex")
});
static DNS_LABEL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$").expect("regex"));

fn model_key(k: &str) -> bool {
    match k.split_once('/') {
        Some((prefix, name)) => {
            prefix.len() <= 253
                && prefix.split('.').all(|l| DNS_LABEL.is_match(l))
                && NAME.is_match(name)
        }
        None => NAME.is_match(k),
    }
}

/// Label selectors (`--selector`, prewarm targets). Invariants: key and value
/// grammars agree with Kubernetes' regular expressions; an accepted selector prints
/// to text that parses back to the same selector; matching follows each
/// requirement's meaning on labels built from the selector itself.
pub fn selector(data: &[u8]) -> bool {
    let Ok(s) = std::str::from_utf8(data) else {
        return false;
    };
    assert_eq!(
        validate_key(s).is_ok(),
        model_key(s),
        "key grammar on {s:?}"
    );
    assert_eq!(
        validate_value(s).is_ok(),
        s.is_empty() || NAME.is_match(s),
        "value grammar on {s:?}"
    );
    let Ok(sel) = Selector::parse(s) else {
        return false;
    };
    let text = sel.to_string();
    let again = Selector::parse(&text);
    assert_eq!(again.as_ref().ok(), Some(&sel), "{s:?} → {text:?}");
    assert_eq!(sel.is_empty(), sel.requirements.is_empty());
    assert!(sel.matches(&BTreeMap::new()) || !sel.is_empty());
    for r in &sel.requirements {
        let (key, yes, no) = match r {
            Requirement::Equals(k, v) => (k, Some(v.clone()), None),
            Requirement::In(k, vs) => (k, vs.first().cloned(), None),
            Requirement::NotEquals(k, v) => (k, None, Some(v.clone())),
            Requirement::NotIn(k, vs) => (k, None, vs.first().cloned()),
            Requirement::Exists(k) => (k, Some(String::new()), None),
            Requirement::DoesNotExist(k) => (k, None, Some(String::new())),
        };
        assert!(validate_key(key).is_ok());
        if let Some(v) = yes {
            assert!(r.matches(&BTreeMap::from([(key.clone(), v)])), "{r:?}");
        }
        if let Some(v) = no {
            assert!(!r.matches(&BTreeMap::from([(key.clone(), v)])), "{r:?}");
        }
    }
    true
}

// ---------------------------------------------------------------------------------
// node reports
// ---------------------------------------------------------------------------------

fn limits() -> InventoryLimits {
    InventoryLimits {
        max_nodes: 4,
        node_expiry_s: 1000,
        max_report_blobs: 64,
        max_report_images: 16,
        max_report_image_blobs: 128,
        max_image_references: 8,
        max_report_list: 16,
        max_labels: 16,
        max_string_bytes: 256,
        max_total_entries: 400,
        max_catalog_keys: 32,
    }
}

pub(crate) fn blob(n: u8, size: u64) -> BlobRef {
    BlobRef {
        digest: Digest::from_sha256([n; 32]),
        size,
    }
}

/// Reports as agents send them (the shape of `agent::cluster::node_report`): a node
/// holding a whole training image, one holding part of it and downloading the rest.
pub(crate) fn real_reports() -> Vec<NodeReport> {
    let layers: Vec<BlobRef> = (1..=4).map(|n| blob(n, u64::from(n) << 24)).collect();
    let image = |last_pull: u64| ImageRecord {
        manifest_digest: Digest::from_sha256([0xa0; 32]),
        index_digest: Some(Digest::from_sha256([0xa1; 32])),
        references: vec![
            "registry.local:5000/team/train:v42".into(),
            "docker.io/library/python:3.12".into(),
        ],
        blobs: layers.clone(),
        last_pull: Some(last_pull),
        last_use: Some(last_pull + 5),
        bytes_by_source: SourceBytes {
            cache: 0,
            peer: 3 << 24,
            registry: 7 << 24,
        },
        pull_seconds: Some(12.5),
    };
    let labels = |gpu: &str, pool: &str| {
        BTreeMap::from([
            ("gpu".to_owned(), gpu.to_owned()),
            ("starling.io/pool".to_owned(), pool.to_owned()),
            (
                "topology.kubernetes.io/zone".to_owned(),
                "us-east-1a".to_owned(),
            ),
        ])
    };
    let warm = NodeReport {
        node: "gpu-1".into(),
        generation: 1_700_000_000_000,
        labels: labels("h100", "train"),
        agent_url: Some("http://10.0.1.1:5050".into()),
        blobs: layers
            .iter()
            .map(|b| BlobHolding {
                digest: b.digest.clone(),
                size: b.size,
                bytes_held: b.size,
                complete: true,
            })
            .collect(),
        images: vec![image(900)],
        pins: vec![Pin {
            reference: "registry.local:5000/team/train:v42".into(),
            digest: Some(Digest::from_sha256([0xa0; 32])),
            expires_at: Some(90_000),
        }],
        cache_budget: 200 << 30,
        cache_used: 10 << 24,
        cache_free: (200 << 30) - (10 << 24),
        downloads_in_flight: vec![],
        throughput_bytes_per_sec: Some(1.25e9),
    };
    let partial = NodeReport {
        node: "gpu-2".into(),
        generation: 1_700_000_000_500,
        labels: labels("a100", "train"),
        agent_url: Some("http://10.0.1.2:5050".into()),
        blobs: vec![
            BlobHolding {
                digest: layers[0].digest.clone(),
                size: layers[0].size,
                bytes_held: layers[0].size,
                complete: true,
            },
            BlobHolding {
                digest: layers[3].digest.clone(),
                size: layers[3].size,
                bytes_held: 1 << 20,
                complete: false,
            },
        ],
        images: vec![ImageRecord {
            manifest_digest: Digest::from_sha256([0xb0; 32]),
            index_digest: None,
            references: vec!["registry.local:5000/team/eval:v1".into()],
            // Layer 5 is held by nobody: a prewarm of this image needs a seed node.
            blobs: vec![layers[0].clone(), blob(5, 1 << 26)],
            last_pull: Some(950),
            last_use: None,
            bytes_by_source: SourceBytes::default(),
            pull_seconds: None,
        }],
        pins: vec![],
        cache_budget: 100 << 30,
        cache_used: 1 << 24,
        cache_free: 50 << 30,
        downloads_in_flight: vec![Download {
            digest: layers[3].digest.clone(),
            bytes_done: 1 << 20,
            bytes_total: layers[3].size,
        }],
        throughput_bytes_per_sec: None,
    };
    let mut idle = partial.clone();
    idle.node = "cpu-1".into();
    idle.generation = 1;
    idle.labels = BTreeMap::from([("starling.io/pool".to_owned(), "batch".to_owned())]);
    idle.blobs.clear();
    idle.images.clear();
    idle.downloads_in_flight.clear();
    vec![warm, partial, idle]
}

/// What a refused report must leave untouched.
fn snapshot(inv: &Inventory, now: u64) -> String {
    format!(
        "{} {} {} {:?}",
        inv.len(),
        inv.digests(),
        inv.catalog_keys(),
        serde_json::to_string(&inv.nodes(now)).unwrap_or_default()
    )
}

/// Node reports (JSON, one per line) into an inventory with small limits. Invariants:
/// a refused report changes nothing; the limits hold (nodes, catalog keys); the
/// interned digests are exactly those some kept report holds; queries answer; the same
/// generation again is a heartbeat and an older one is refused; forgetting every node
/// leaves nothing behind (no digest, no catalog key).
pub fn node_report(data: &[u8]) -> bool {
    let lim = limits();
    let mut inv = Inventory::with_limits(60, lim.clone());
    let mut accepted = false;
    let lines = data
        .split(|&b| b == b'\n')
        .filter_map(|l| serde_json::from_slice::<NodeReport>(l).ok())
        .take(16);
    for (i, report) in lines.enumerate() {
        let now = 100 + 10 * i as u64;
        let before = snapshot(&inv, now);
        let applied = match inv.apply(report.clone(), now) {
            Ok(a) => a,
            Err(_) => {
                assert_eq!(
                    snapshot(&inv, now),
                    before,
                    "a refused report changes nothing"
                );
                continue;
            }
        };
        accepted = true;
        assert!(inv.len() <= lim.max_nodes);
        assert!(inv.catalog_keys() <= lim.max_catalog_keys);
        let held: BTreeSet<&Digest> = inv
            .entries()
            .flat_map(|e| e.report.blobs.iter().map(|b| &b.digest))
            .collect();
        assert_eq!(
            inv.digests(),
            held.len(),
            "interned digests are the held ones"
        );
        let (summary, kept) = inv.node(&report.node, now).expect("just applied");
        if applied != Applied::Heartbeat {
            assert_eq!(kept, &report);
        }
        assert_eq!(summary.blobs, kept.blobs.len());
        let images = kept.images.clone();
        for img in &images {
            let holders = inv.holders(&img.blobs, now);
            for w in holders.windows(2) {
                assert!(w[0].bytes_held >= w[1].bytes_held);
            }
            for h in &holders {
                assert!(h.bytes_held > 0 && inv.entry(&h.node).is_some());
            }
            for r in &img.references {
                if let Ok(r) = ImageReference::parse(r) {
                    inv.tag_seen_moving(&r);
                    if let Some(found) = inv.resolve(&r) {
                        assert_eq!(found.reference, r.to_string());
                    }
                }
            }
        }
        assert_eq!(
            inv.apply(report.clone(), now).ok(),
            Some(Applied::Heartbeat),
            "the same generation again"
        );
        assert!(inv.heartbeat(&report.node, report.generation, now).is_ok());
        if let Some(older) = report.generation.checked_sub(1) {
            let mut stale = report.clone();
            stale.generation = older;
            assert!(
                inv.apply(stale, now).is_err(),
                "an older generation is refused"
            );
        }
        let _ = inv.nodes(now);
    }
    let names: Vec<String> = inv.entries().map(|e| e.report.node.clone()).collect();
    for n in &names {
        assert!(inv.forget(n));
    }
    assert_eq!((inv.len(), inv.digests(), inv.catalog_keys()), (0, 0, 0));
    accepted
}

// ---------------------------------------------------------------------------------
// prewarm requests
// ---------------------------------------------------------------------------------

const NOW: u64 = 1000;

fn prewarm_inventory() -> Inventory {
    let mut inv = Inventory::with_limits(60, limits());
    for r in real_reports() {
        let _ = inv.apply(r, NOW - 10);
    }
    inv
}

/// Prewarm request bodies against an inventory of three nodes that reported a
/// training image. Invariants: accepted pin TTLs and deadlines are within their
/// maxima; a planned job's targets are known nodes without duplicates, as many as
/// asked for; its times are within the maxima from now; the first assignments respect
/// the seed rule (one node while nobody holds the image) and parallelism, name each
/// node once and never give a zero rate.
pub fn prewarm_request(data: &[u8]) -> bool {
    let Ok(req) = serde_json::from_slice::<PrewarmRequest>(data) else {
        return false;
    };
    let inv = prewarm_inventory();
    let Ok(refs) = cluster::prewarm::validate(&req, &inv) else {
        return false;
    };
    assert_eq!(refs.len(), req.images.len());
    if let Some(t) = req.pin_ttl_seconds {
        assert!((1..=MAX_PIN_TTL_SECONDS).contains(&t));
    }
    if let Some(d) = req.deadline_seconds {
        assert!((1..=MAX_DEADLINE_SECONDS).contains(&d));
    }
    let mut images = Vec::new();
    for r in &refs {
        let Some(mut img) = inv.resolve(r) else {
            return true;
        };
        img.reference = r.to_string();
        images.push(img);
    }
    let Ok(mut store) = JobStore::in_memory() else {
        panic!("in-memory job store");
    };
    let job = match store.submit(req.clone(), images, &inv, NOW) {
        Ok(j) => j.clone(),
        Err(_) => return true,
    };
    let targets: BTreeSet<&String> = job.nodes.keys().collect();
    for n in &targets {
        assert!(inv.entry(n).is_some(), "target {n} is known");
    }
    let t = &req.targets;
    if !t.nodes.is_empty() {
        let asked: BTreeSet<&String> = t.nodes.iter().collect();
        assert_eq!(targets, asked);
    } else if let Some(c) = t.count {
        assert_eq!(targets.len(), c as usize);
    }
    assert!(job.pin_until > NOW && job.pin_until - NOW <= MAX_PIN_TTL_SECONDS);
    if let Some(d) = job.deadline_at {
        assert!(d > NOW && d - NOW <= MAX_DEADLINE_SECONDS);
    }
    let total = job
        .blobs
        .iter()
        .map(|b| b.size)
        .fold(0u64, u64::saturating_add);
    assert_eq!(job.total_bytes, total);
    let (first, _) = store.next_assignments_deferred(&inv, NOW);
    let (second, _) = store.next_assignments_deferred(&inv, NOW + 1);
    let mut named = BTreeSet::new();
    for a in first.iter().chain(&second) {
        assert_eq!(a.job_id, job.id);
        assert!(targets.contains(&a.node), "{} is a target", a.node);
        assert!(named.insert(a.node.clone()), "{} assigned twice", a.node);
        assert_ne!(a.bytes_per_sec, Some(0));
        assert_eq!(a.pin_until, job.pin_until);
    }
    let limit = req.parallelism.map_or(usize::MAX, |p| p as usize);
    assert!(named.len() <= limit.max(1));
    if first.iter().any(|a| a.seed) {
        assert_eq!(first.len(), 1, "one seed while nobody holds the image");
    }
    true
}
