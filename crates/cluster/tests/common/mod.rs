//! Shared builders for the cluster tests.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};

use cluster::extender::ImageCatalog;
use cluster::inventory::{
    BlobHolding, BlobRef, ImageRecord, NodeReport, ResolvedImage, SourceBytes,
};
use oci::{Digest, ImageReference};

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;
pub const NOW: u64 = 1_000_000;

pub fn d(n: u8) -> Digest {
    Digest::from_sha256([n; 32])
}

pub fn blob(n: u8, size: u64) -> BlobRef {
    BlobRef { digest: d(n), size }
}

/// registry.example.com/ml/train:v1.4.2 → config d1, layers d2 (1 GiB), d3 (2 GiB), d4 (shared base, 100 MiB).
pub fn train() -> ResolvedImage {
    ResolvedImage {
        reference: "registry.example.com/ml/train:v1.4.2".into(),
        manifest_digest: d(100),
        blobs: vec![
            blob(1, 10_000),
            blob(2, GIB),
            blob(3, 2 * GIB),
            blob(4, 100 * MIB),
        ],
    }
}

/// docker.io/library/busybox:1.36 → config d5, shared base d4, d6.
pub fn busybox() -> ResolvedImage {
    ResolvedImage {
        reference: "docker.io/library/busybox:1.36".into(),
        manifest_digest: d(101),
        blobs: vec![blob(5, 1000), blob(4, 100 * MIB), blob(6, 2_000_000)],
    }
}

/// A catalog keyed by the canonical reference string.
#[derive(Default)]
pub struct MapCatalog(pub HashMap<String, ResolvedImage>);

impl MapCatalog {
    pub fn with(images: &[ResolvedImage]) -> Self {
        Self(
            images
                .iter()
                .map(|i| (i.reference.clone(), i.clone()))
                .collect(),
        )
    }
}

impl ImageCatalog for MapCatalog {
    fn resolve(&self, image: &ImageReference) -> Option<ResolvedImage> {
        self.0.get(&image.to_string()).cloned()
    }
}

pub fn report(node: &str, generation: u64, held: &[(BlobRef, u64)]) -> NodeReport {
    NodeReport {
        node: node.into(),
        generation,
        labels: BTreeMap::new(),
        agent_url: Some(format!("http://{node}:5050")),
        blobs: held
            .iter()
            .map(|(b, h)| BlobHolding {
                digest: b.digest.clone(),
                size: b.size,
                bytes_held: *h,
                complete: *h == b.size,
            })
            .collect(),
        images: vec![],
        pins: vec![],
        cache_budget: 200 * GIB,
        cache_used: held.iter().map(|(_, h)| *h).sum(),
        cache_free: 200 * GIB - held.iter().map(|(_, h)| *h).sum::<u64>(),
        downloads_in_flight: vec![],
        throughput_bytes_per_sec: Some((100 * MIB) as f64),
    }
}

pub fn full(img: &ResolvedImage) -> Vec<(BlobRef, u64)> {
    img.blobs.iter().map(|b| (b.clone(), b.size)).collect()
}

pub fn image_record(
    img: &ResolvedImage,
    last_pull: u64,
    src: SourceBytes,
    secs: f64,
) -> ImageRecord {
    ImageRecord {
        manifest_digest: img.manifest_digest.clone(),
        index_digest: None,
        references: vec![img.reference.clone()],
        blobs: img.blobs.clone(),
        last_pull: Some(last_pull),
        last_use: None,
        bytes_by_source: src,
        pull_seconds: Some(secs),
    }
}

pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}
