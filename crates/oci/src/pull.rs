//! Starling's own pull client: resolves a reference, picks the platform from an index,
//! and downloads every blob with sha256 verification, reporting time to first byte and
//! throughput per blob. Used by the demo, benchmarks and `starling pull`.

use std::time::Instant;

use futures::StreamExt;
use serde::Serialize;

use crate::media::{host_platform, DEFAULT_ACCEPT};
use crate::upstream::Upstream;
use crate::{Descriptor, Digest, Error, ImageReference, Manifest, Verifier};

#[derive(Clone, Debug)]
pub struct PullOptions {
    pub os: String,
    pub arch: String,
    /// Blobs downloaded at once.
    pub concurrency: usize,
    /// Caps this pull's download rate (emulates a node's NIC in benchmarks).
    pub max_bytes_per_sec: Option<u64>,
    /// Incremented with every byte received (live progress).
    pub progress: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

impl Default for PullOptions {
    fn default() -> Self {
        let (os, arch) = host_platform();
        Self {
            os: os.into(),
            arch: arch.into(),
            concurrency: 4,
            max_bytes_per_sec: None,
            progress: None,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct BlobPull {
    pub digest: Digest,
    pub bytes: u64,
    /// When this blob's request went out, from the start of the pull (seconds): the
    /// client fetches a few blobs at a time, so later blobs start later.
    pub started_seconds: f64,
    pub first_byte_seconds: f64,
    pub seconds: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct PullReport {
    pub reference: String,
    pub manifest_digest: Digest,
    pub bytes: u64,
    pub seconds: f64,
    pub blobs: Vec<BlobPull>,
}

/// Pulls an image and verifies every byte; the content is discarded (the point is to
/// exercise and measure the path, or to warm the caches on the way).
pub async fn pull(
    up: &Upstream,
    reference: &ImageReference,
    opts: &PullOptions,
) -> Result<PullReport, Error> {
    let started = Instant::now();
    let (reg, repo) = (&reference.registry, &reference.repository);
    let (meta, body) = up
        .get_manifest(
            reg,
            repo,
            &reference.manifest_ref().to_string(),
            DEFAULT_ACCEPT,
        )
        .await?;
    let mut manifest = Manifest::parse(&body)?;
    let mut manifest_digest = meta.digest.clone();
    if manifest.is_index() {
        let chosen = manifest
            .select_platform(&opts.os, &opts.arch)
            .ok_or_else(|| {
                Error::ManifestInvalid(format!(
                    "no {}/{} image in index {}",
                    opts.os, opts.arch, meta.digest
                ))
            })?
            .digest
            .clone();
        let (m2, b2) = up
            .get_manifest(reg, repo, &chosen.to_string(), DEFAULT_ACCEPT)
            .await?;
        manifest = Manifest::parse(&b2)?;
        manifest_digest = m2.digest;
    }
    let blobs: Vec<Descriptor> = manifest.blobs().cloned().collect();
    let pacer = opts.max_bytes_per_sec.map(|r| Pacer {
        rate: r,
        started: Instant::now(),
        bytes: std::sync::atomic::AtomicU64::new(0),
    });
    let results = futures::stream::iter(blobs.into_iter().map(|d| {
        fetch_blob(
            up,
            reg,
            repo,
            d,
            pacer.as_ref(),
            opts.progress.as_deref(),
            started,
        )
    }))
    .buffer_unordered(opts.concurrency.max(1))
    .collect::<Vec<_>>()
    .await;
    let mut out = Vec::new();
    for r in results {
        out.push(r?);
    }
    let bytes = out.iter().map(|b| b.bytes).sum();
    Ok(PullReport {
        reference: reference.to_string(),
        manifest_digest,
        bytes,
        seconds: started.elapsed().as_secs_f64(),
        blobs: out,
    })
}

/// A shared byte budget for one pull: sleeps whenever the pull is ahead of its rate.
struct Pacer {
    rate: u64,
    started: Instant,
    bytes: std::sync::atomic::AtomicU64,
}

impl Pacer {
    async fn take(&self, n: u64) {
        let total = self
            .bytes
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed)
            + n;
        let due = std::time::Duration::from_secs_f64(total as f64 / self.rate as f64);
        let elapsed = self.started.elapsed();
        if due > elapsed {
            tokio::time::sleep(due - elapsed).await;
        }
    }
}

async fn fetch_blob(
    up: &Upstream,
    reg: &str,
    repo: &str,
    desc: Descriptor,
    pacer: Option<&Pacer>,
    progress: Option<&std::sync::atomic::AtomicU64>,
    pull_started: Instant,
) -> Result<BlobPull, Error> {
    let started = Instant::now();
    let resp = up.get_blob(reg, repo, &desc.digest, 0).await?;
    let mut v = Verifier::new(desc.digest.clone());
    let mut first = None;
    let mut stream = resp.stream;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if first.is_none() {
            first = Some(started.elapsed().as_secs_f64());
        }
        v.update(&chunk);
        if let Some(p) = progress {
            p.fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(p) = pacer {
            p.take(chunk.len() as u64).await;
        }
        if v.len() > desc.size {
            return Err(Error::SizeMismatch {
                expected: desc.size,
                actual: v.len(),
            });
        }
    }
    let bytes = v.len();
    if bytes != desc.size {
        return Err(Error::SizeMismatch {
            expected: desc.size,
            actual: bytes,
        });
    }
    v.finish()?;
    Ok(BlobPull {
        digest: desc.digest,
        bytes,
        started_seconds: started.duration_since(pull_started).as_secs_f64(),
        first_byte_seconds: first.unwrap_or(0.0),
        seconds: started.elapsed().as_secs_f64(),
    })
}
