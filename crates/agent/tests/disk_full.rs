//! A real full filesystem: the cache lives on a small tmpfs. Concurrent downloads that
//! each fit but not together, and a disk that another process fills in the middle of a
//! download (ENOSPC on write). Every client still gets every byte (verified by the
//! client), the agent stays up, no partial file is left holding the space, and the
//! store never holds a blob that is not complete and verified.
//! Needs root (mount), like the containerd tests.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use futures::StreamExt;
use tokio::sync::Notify;

use common::*;
use testkit::{fill_disk, sha256_digest as sha, Registry, RegistryAuth, TestImage, Tmpfs};

fn files_under(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(files_under(&p));
            } else if let Ok(m) = e.metadata() {
                out.push((p, m.len()));
            }
        }
    }
    out
}

/// In front of the real registry: the first blob response stops after `hold_after`
/// bytes until `release` is notified (a network stall the test controls), so the test
/// can fill the disk while the agent is in the middle of writing the blob.
async fn stalling_proxy(upstream: String, hold_after: usize) -> (String, Arc<Notify>, Arc<Notify>) {
    let (held, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let blobs = Arc::new(AtomicUsize::new(0));
    let client = reqwest::Client::new();
    let (h, r) = (held.clone(), release.clone());
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let (client, upstream, held, release, blobs) = (
            client.clone(),
            upstream.clone(),
            h.clone(),
            r.clone(),
            blobs.clone(),
        );
        async move {
            let is_get = req.method() == http::Method::GET;
            let (path, resp, builder) = testkit::forward(&client, &upstream, req).await;
            let first_blob = path.contains("/blobs/")
                && is_get
                && resp.status().is_success()
                && blobs.fetch_add(1, Ordering::SeqCst) == 0;
            let mut sent = 0usize;
            let stream = resp.bytes_stream().then(move |c| {
                let (held, release) = (held.clone(), release.clone());
                let before = sent;
                if let Ok(c) = &c {
                    sent += c.len();
                }
                async move {
                    if first_blob
                        && before < hold_after
                        && before + c.as_ref().map_or(0, |c| c.len()) >= hold_after
                    {
                        held.notify_one();
                        release.notified().await;
                    }
                    c.map_err(std::io::Error::other)
                }
            });
            builder.body(axum::body::Body::from_stream(stream)).unwrap()
        }
    });
    let url = testkit::serve_proxy(app).await;
    (url, held, release)
}

fn no_partials(cache: &Path) {
    let partial = files_under(&cache.join("partial"));
    assert!(
        partial.is_empty(),
        "no partial download left holding the disk: {partial:?}"
    );
}

fn complete_entries_verify(agent: &RunningAgent, cache: &Path, layers: &[testkit::Blob]) -> usize {
    let mut complete = 0;
    for l in layers {
        let d = oci::Digest::parse(&l.digest).unwrap();
        if agent.agent.store.stat(&d).is_some() {
            complete += 1;
            let bytes = std::fs::read(cache.join("blobs/sha256").join(d.hex()))
                .expect("a complete blob has its file");
            assert_eq!(sha(&bytes), l.digest, "a complete entry is verified");
        }
    }
    complete
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_downloads_that_do_not_fit_together_lose_nothing() {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img =
        TestImage::push_multilayer(&registry, "full/tmpfs", "1", &[6 << 20, 6 << 20], 47).unwrap();
    let fs = Tmpfs::mount("10m");
    let cache = fs.mount.join("cache");
    let agent = start_agent(&cache, &registry.host(), &registry.url(), None, |c| {
        c.cache_budget = oci::size::ByteSize(1 << 30);
    })
    .await;
    let fetches = img.layers.iter().map(|l| {
        let url = format!("{}/v2/full/tmpfs/blobs/{}", agent.url(), l.digest);
        async move {
            let r = get(&url, &[]).await;
            (r.status().as_u16(), r.bytes().await.map(|b| sha(&b)))
        }
    });
    for (l, (status, body)) in img
        .layers
        .iter()
        .zip(futures::future::join_all(fetches).await)
    {
        assert_eq!(status, 200);
        assert_eq!(
            body.expect("a complete body"),
            l.digest,
            "verified by the client"
        );
    }
    for l in &img.layers {
        let url = format!("{}/v2/full/tmpfs/blobs/{}", agent.url(), l.digest);
        let r = get(&url, &[]).await;
        assert_eq!(r.status(), 200);
        assert_eq!(sha(&r.bytes().await.unwrap()), l.digest);
    }
    assert!(complete_entries_verify(&agent, &cache, &img.layers) <= 1);
    no_partials(&cache);
    agent.stop().await;
}

/// One 6 MiB layer fetched through an agent whose cache is a 16 MiB tmpfs; 2 MiB into
/// the blob another process takes every free byte, then the rest arrives.
struct FilledMidDownload {
    agent: RunningAgent,
    cache: std::path::PathBuf,
    layer: testkit::Blob,
    url: String,
    /// The client's answer: status and the sha256 of the body it read.
    status: u16,
    body: reqwest::Result<String>,
    _fs: Tmpfs,
    _registry: Registry,
}

async fn fill_the_disk_mid_download(repo: &str, seed: u64, preallocate: bool) -> FilledMidDownload {
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let img = TestImage::push_multilayer(&registry, repo, "1", &[6 << 20], seed).unwrap();
    let layer = img.layers[0].clone();
    let (proxy, held, release) = stalling_proxy(registry.url(), 2 << 20).await;
    let fs = Tmpfs::mount("16m");
    let cache = fs.mount.join("cache");
    let agent = start_agent(&cache, &registry.host(), &proxy, None, |c| {
        c.cache_budget = oci::size::ByteSize(1 << 30);
        c.preallocate = preallocate;
    })
    .await;
    let url = format!("{}/v2/{repo}/blobs/{}", agent.url(), layer.digest);
    let client = tokio::spawn({
        let url = url.clone();
        async move {
            let r = get(&url, &[]).await;
            (r.status().as_u16(), r.bytes().await.map(|b| sha(&b)))
        }
    });
    held.notified().await;
    fill_disk(&fs.mount.join("filler"));
    release.notify_one();
    let (status, body) = client.await.unwrap();
    FilledMidDownload {
        agent,
        cache,
        layer,
        url,
        status,
        body,
        _fs: fs,
        _registry: registry,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_disk_filled_by_someone_else_mid_download_degrades_to_passthrough() {
    // Blocks allocated as the bytes arrive (the default): the next write after the
    // disk fills fails.
    let f = fill_the_disk_mid_download("full/other", 53, false).await;
    assert_eq!(f.status, 200);
    assert_eq!(
        f.body.expect("a complete body, not a cut one"),
        f.layer.digest
    );
    assert!(
        f.agent.metric("starling_agent_disk_full_total") >= 1.0,
        "the write really failed with ENOSPC"
    );
    assert_eq!(
        complete_entries_verify(&f.agent, &f.cache, std::slice::from_ref(&f.layer)),
        0
    );
    no_partials(&f.cache);

    // Still serving, still correct, while the disk stays full.
    let r = get(&f.url, &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(sha(&r.bytes().await.unwrap()), f.layer.digest);
    let r = get(&format!("{}/v2/", f.agent.url()), &[]).await;
    assert_eq!(r.status(), 200);
    f.agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_preallocated_download_keeps_writing_when_someone_else_fills_the_disk() {
    // The blob's blocks were allocated when its download started, so its writes do
    // not fail.
    let f = fill_the_disk_mid_download("full/kept", 59, true).await;
    assert_eq!(f.status, 200);
    assert_eq!(f.body.expect("a complete body"), f.layer.digest);
    assert_eq!(
        f.agent.metric("starling_agent_disk_full_total"),
        0.0,
        "no write failed"
    );
    // Whether the entry can be recorded on a full disk is the commit's business (its
    // metadata needs room too); once it has run, what is kept is verified, and nothing
    // half-done stays.
    let d = oci::Digest::parse(&f.layer.digest).unwrap();
    for _ in 0..1000 {
        if f.agent.agent.store.inflight(&d).is_none() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        f.agent.agent.store.inflight(&d).is_none(),
        "the commit ended"
    );
    complete_entries_verify(&f.agent, &f.cache, std::slice::from_ref(&f.layer));
    no_partials(&f.cache);
    f.agent.stop().await;
}
