//! The one place that decides where a blob's bytes come from: the cache, a download
//! already running in this agent (join it), the swarm, the registry, or — when the
//! disk cannot take the blob — straight from the registry without caching
//! (passthrough). `blob.rs` only shapes HTTP around the [`Source`] chosen here.
//!
//! Rate limits are arguments, not side tables: the node's download limit applies to
//! every byte this agent fetches (swarm or registry, tracker or not), and a prewarm's
//! limit travels with the fetch it throttles.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use oci::{Digest, Error};
use ratelimit::TokenBucket;
use store::{Begin, Inflight, Status};
use tracing::{info, warn};

use crate::Agent;

/// How long a blob whose download filled the disk is streamed without caching.
const UNCACHEABLE_FOR: Duration = Duration::from_secs(60);

/// A registry body that yields nothing for this long publishes what is buffered, so a
/// reader waiting on a few bytes of a cold blob over a slow link gets them when they
/// arrive, not when a full write buffer has.
const QUIET_FLUSH: Duration = Duration::from_millis(5);

pub(crate) enum Source {
    Complete,
    /// A download running in this agent, and how it gets the blob.
    Inflight(Arc<Inflight>, Via),
    /// Stream the registry's bytes without caching them, and why.
    Passthrough(Uncached),
}

/// Why a blob is streamed from the registry without caching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Uncached {
    /// The cache has no room it may free for it (disk full, over budget, the rest
    /// pinned or being read), or this blob filled the disk within `UNCACHEABLE_FOR`.
    NoRoom,
    /// The store failed to start the download (an I/O error).
    StoreFailed,
    /// A download of this digest from an origin not trusted with it is running.
    OtherOrigin,
    /// The registry sent the blob without a length.
    NoLength,
}

impl std::fmt::Display for Uncached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Uncached::NoRoom => "the cache has no room it may free for it",
            Uncached::StoreFailed => "the store cannot start a download",
            Uncached::OtherOrigin => {
                "a download of this digest from an origin not trusted with it is running"
            }
            Uncached::NoLength => "the registry sends it without a length",
        })
    }
}

/// How a running download gets its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Via {
    /// Piece by piece through the swarm (from peers, or from the registry as the
    /// blob's elected source).
    Swarm,
    /// This agent alone, from the registry.
    Registry,
}

/// How a running download that a request joined gets its bytes: only a swarm download
/// writes in piece mode, and a reader sees the size only once that mode is set.
fn joined_via(inf: &Inflight) -> Via {
    if inf.layout().is_some() {
        Via::Swarm
    } else {
        Via::Registry
    }
}

impl Source {
    /// Where a response's bytes come from, one name for the `starling-source` header,
    /// the `source` label of the served-bytes metrics and the blob's log line: an
    /// operator reading the dashboard sees the same split as `starling get` prints.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Source::Complete => "cache",
            Source::Inflight(_, Via::Swarm) => "swarm",
            Source::Inflight(_, Via::Registry) => "registry",
            Source::Passthrough(_) => "passthrough",
        }
    }
}

impl Agent {
    /// Finds or starts the download of a blob and learns its size. Errors here happen
    /// before any byte is sent, so they become proper HTTP statuses. `limit`: a rate
    /// for the download this call starts (a prewarm's); joining a running download
    /// does not change its rate.
    pub(crate) async fn acquire(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        limit: Option<Arc<TokenBucket>>,
    ) -> Result<(Source, u64), Error> {
        let acquired = self.acquire_source(registry, repo, d, limit).await;
        if let Ok((_, size)) = &acquired {
            self.note_wildcard_swarm(registry, d, *size);
        }
        acquired
    }

    /// Notes a blob large enough for a swarm, read from a registry only a wildcard
    /// admits, for seeding (`registry_swarms`). Only once the registry answered for it:
    /// a client naming digests no registry has cannot grow the index.
    fn note_wildcard_swarm(&self, registry: &str, d: &Digest, size: u64) {
        if self.p2p.as_ref().is_none_or(|p2p| size < p2p.threshold) {
            return;
        }
        if let Some(swarm) = self.upstream.wildcard_swarm_of(registry, d) {
            self.registry_swarms.note(d, &swarm);
        }
    }

    async fn acquire_source(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        limit: Option<Arc<TokenBucket>>,
    ) -> Result<(Source, u64), Error> {
        if self.recently_filled_the_disk(d) {
            return self
                .passthrough_source(registry, repo, d, Uncached::NoRoom)
                .await;
        }
        // The registry's answer when it could not give the blob: the next lead takes
        // it from the members that hold it instead.
        let mut registry_unavailable: Option<Error> = None;
        for _ in 0..3 {
            match self.store.begin(d, None, registry).await {
                Ok(Begin::Complete(size)) => return Ok((Source::Complete, size)),
                Ok(Begin::Join(inf)) if !self.may_take_bytes_read_for(&inf.source, registry, d) => {
                    // Another origin's bytes under this digest (a tenant's file named by
                    // it): read our own, uncached, while that download lasts.
                    info!(digest = %d, theirs = %inf.source, "not joining a download from an origin not trusted with this digest");
                    return self
                        .passthrough_source(registry, repo, d, Uncached::OtherOrigin)
                        .await;
                }
                Ok(Begin::Join(inf)) => {
                    let mut rx = inf.subscribe();
                    loop {
                        let p = rx.borrow_and_update().clone();
                        if let Some(t) = p.total {
                            let via = joined_via(&inf);
                            return Ok((Source::Inflight(inf, via), t));
                        }
                        if matches!(p.status, Status::Failed { .. }) || rx.changed().await.is_err()
                        {
                            break;
                        }
                    }
                }
                Ok(Begin::Lead(writer)) => {
                    if let Some(refused) = registry_unavailable.take() {
                        return self
                            .take_from_holders(registry, repo, d, writer, limit, refused)
                            .await;
                    }
                    let (writer, opened) = match &self.p2p {
                        Some(p2p)
                            if self
                                .declared_sizes
                                .lock()
                                .size(registry, repo, d)
                                .is_none_or(|s| s >= p2p.threshold) =>
                        {
                            match crate::p2p::start(
                                self.clone(),
                                registry.to_owned(),
                                repo.to_owned(),
                                d.clone(),
                                writer,
                                limit.clone(),
                                crate::p2p::Want::Swarm,
                            )
                            .await
                            {
                                crate::p2p::Start::Started(inf, total) => {
                                    return Ok((Source::Inflight(inf, Via::Swarm), total))
                                }
                                crate::p2p::Start::Passthrough(total) => {
                                    return Ok((Source::Passthrough(Uncached::NoRoom), total))
                                }
                                crate::p2p::Start::Failed(e) => return Err(blob_err(e, d)),
                                crate::p2p::Start::NotSwarm(w, opened) => (w, opened),
                            }
                        }
                        _ => (writer, None),
                    };
                    match self
                        .lead_from_registry(registry, repo, d, *writer, opened, limit.clone())
                        .await
                    {
                        Err(e) if self.p2p.is_some() && e.registry_unavailable() => {
                            registry_unavailable = Some(e);
                        }
                        led => return led,
                    }
                }
                Err(e) if e.is_disk_full() || matches!(e, store::Error::Io { .. }) => {
                    warn!(digest = %d, error = %e, "store cannot take blob; streaming it without caching");
                    let why = if e.is_disk_full() {
                        Uncached::NoRoom
                    } else {
                        Uncached::StoreFailed
                    };
                    return self.passthrough_source(registry, repo, d, why).await;
                }
                Err(e) => return Err(store_err(e)),
            }
        }
        Err(Error::Transport {
            registry: registry.to_owned(),
            message: format!("download of {d} keeps failing"),
        })
    }

    /// A blob the registry could not give (`refused`, which the caller gets if nobody
    /// else can either), taken whole from members that hold it: small enough to go to
    /// the registry first (an image config, a small layer), it is in no swarm until
    /// then. Its digest proves the bytes (`PieceLayout::whole`).
    async fn take_from_holders(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        writer: Box<store::BlobWriter>,
        limit: Option<Arc<TokenBucket>>,
        refused: Error,
    ) -> Result<(Source, u64), Error> {
        let taken = crate::p2p::start_from_holders(
            self.clone(),
            registry,
            repo,
            d,
            writer,
            limit,
            swarm::pieces::WHOLE_PIECE_MAX,
        )
        .await;
        let Some((inf, total)) = taken else {
            return Err(blob_err(refused, d));
        };
        info!(digest = %d, %registry, error = %refused, "the registry cannot answer; taking the blob from a member that holds it");
        self.metrics.taken_from_holders.inc();
        Ok((Source::Inflight(inf, Via::Swarm), total))
    }

    /// The registry's bytes streamed to the client without caching, with the size the
    /// registry gives.
    async fn passthrough_source(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        why: Uncached,
    ) -> Result<(Source, u64), Error> {
        let total = self
            .upstream
            .head_blob(registry, repo, d)
            .await
            .map_err(|e| blob_err(e, d))?;
        Ok((Source::Passthrough(why), total))
    }

    /// Whether a request for `d` from `registry` may stream the bytes a download from
    /// `theirs` is writing: when `theirs` is trusted with every digest (a registry the
    /// operator named: its swarm is the digest's), or is read in the same swarm as ours. The
    /// same rule keeps swarms apart (`oci::upstream::swarm_scope`); the whole-blob
    /// check would fail such bytes, but only at the end, as late as their origin chose.
    fn may_take_bytes_read_for(&self, theirs: &str, registry: &str, d: &Digest) -> bool {
        let their_swarm = self.upstream.swarm_of(theirs, d).key;
        their_swarm == *d || their_swarm == self.upstream.swarm_of(registry, d).key
    }

    /// Notes the sizes an image manifest a client just got declares (see
    /// [`DeclaredSizes`]) and starts fetching its layers in the background, so they all
    /// arrive at the link's full rate rather than a few at a time in the order the
    /// runtime asks for them (containerd fetches 3 at once); the
    /// runtime's own requests then join the downloads already running. In a swarm this
    /// also starts every layer's swarm at once, so registry bytes enter through as many
    /// sources as there are layers. Off for lazy pullers (`prefetch_layers = false`),
    /// which read only parts of layers.
    ///
    /// The layers the runtime asks for within `prefetch_grace` start first:
    /// the tracker spreads a start-up's sources over the nodes and holds a blob back
    /// from a node already fetching another (`source_defer_ms`), so whichever swarms
    /// join first get the free nodes, and a layer a runtime waits for must not queue
    /// behind layers nobody has asked for yet.
    pub(crate) fn manifest_served(&self, registry: &str, repo: &str, body: &[u8]) {
        let Ok(m) = oci::Manifest::parse(body) else {
            return;
        };
        if m.is_index() {
            return;
        }
        let min = self.p2p.as_ref().map_or(1 << 20, |p| p.threshold);
        self.declared_sizes.lock().note(registry, repo, m.blobs());
        if !self.cfg.prefetch_layers {
            return;
        }
        let layers: Vec<Digest> =
            swarm::prefetch::prefetched_layers(m.layers.iter().map(|l| l.size), min)
                .map(|i| m.layers[i].digest.clone())
                .collect();
        if layers.is_empty() {
            return;
        }
        let (agent, registry, repo) = (self.clone(), registry.to_owned(), repo.to_owned());
        let grace = self.cfg.prefetch_grace;
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            for d in layers {
                if agent.store.stat(&d).is_some() || agent.store.inflight(&d).is_some() {
                    continue;
                }
                let (agent, registry, repo) = (agent.clone(), registry.clone(), repo.clone());
                tokio::spawn(async move {
                    if let Err(e) = agent.acquire(&registry, &repo, &d, None).await {
                        tracing::debug!(digest = %d, error = %e, "prefetch did not start");
                    }
                });
            }
        });
    }

    /// This agent fetches the blob from the registry itself (no swarm), over `opened`
    /// when the swarm's election already asked the registry for the whole blob.
    async fn lead_from_registry(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        mut writer: store::BlobWriter,
        opened: Option<oci::upstream::BlobResponse>,
        limit: Option<Arc<TokenBucket>>,
    ) -> Result<(Source, u64), Error> {
        let answer = match opened {
            Some(r) if r.start == writer.offset() => Ok(r),
            _ => {
                self.upstream
                    .get_blob(registry, repo, d, writer.offset())
                    .await
            }
        };
        let resp = match answer {
            Ok(r) => r,
            Err(e) => {
                self.metrics.upstream_errors.inc();
                writer.fail(&e.to_string());
                return Err(blob_err(e, d));
            }
        };
        let Some(total) = resp.total else {
            writer.fail("upstream sent no length");
            return Ok((
                Source::Passthrough(Uncached::NoLength),
                self.upstream
                    .head_blob(registry, repo, d)
                    .await
                    .map_err(|e| blob_err(e, d))?,
            ));
        };
        writer.set_total(total);
        if let Err(e) = writer.reserve() {
            warn!(digest = %d, error = %e, "cannot cache blob; streaming it without caching");
            writer.fail(&e.to_string());
            return Ok((Source::Passthrough(Uncached::NoRoom), total));
        }
        let inf = writer.inflight();
        let agent = self.clone();
        tokio::spawn(agent.download(writer, resp.stream, limit));
        Ok((Source::Inflight(inf, Via::Registry), total))
    }

    fn recently_filled_the_disk(&self, d: &Digest) -> bool {
        let mut m = self.uncacheable.lock();
        let now = Instant::now();
        m.retain(|_, until| *until > now);
        m.contains_key(d)
    }

    /// Drives one upstream body into the store. Runs detached from any client, so a
    /// client that disconnects does not waste what other clients are waiting for.
    async fn download(
        self,
        mut writer: store::BlobWriter,
        mut body: oci::upstream::ByteStream,
        limit: Option<Arc<TokenBucket>>,
    ) {
        let d = writer.inflight().digest.clone();
        let started = Instant::now();
        let from = writer.offset();
        loop {
            let chunk = match tokio::time::timeout(QUIET_FLUSH, body.next()).await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(_) => {
                    // Quiet: publish what is buffered, then wait for the rest.
                    if let Err(e) = writer.publish_buffered().await {
                        self.writer_failed(&mut writer, &d, e);
                        return;
                    }
                    match body.next().await {
                        Some(c) => c,
                        None => break,
                    }
                }
            };
            match chunk {
                Ok(c) => {
                    let n = c.len() as u64;
                    if let Some(l) = &self.download_limit {
                        l.acquire(n).await;
                    }
                    if let Some(l) = &limit {
                        l.acquire(n).await;
                    }
                    self.metrics.upstream_bytes.inc_by(n);
                    if let Err(e) = writer.write_bytes(c).await {
                        self.writer_failed(&mut writer, &d, e);
                        return;
                    }
                }
                Err(e) => {
                    self.metrics.upstream_errors.inc();
                    warn!(digest = %d, error = %e, "upstream body failed; partial kept for resume");
                    writer.fail(&e.to_string());
                    return;
                }
            }
        }
        let bytes = writer.offset() - from;
        match writer.finish().await {
            Ok(size) => {
                let secs = started.elapsed().as_secs_f64();
                info!(digest = %d, bytes = size, fetched = bytes, seconds = format!("{secs:.3}"),
                    mib_per_s = format!("{:.1}", bytes as f64 / secs.max(1e-6) / 1048576.0), "blob cached from upstream");
                self.refresh_cache_gauges();
            }
            Err(e) if e.is_disk_full() => {
                self.metrics.disk_full.inc();
                self.uncacheable
                    .lock()
                    .insert(d.clone(), Instant::now() + UNCACHEABLE_FOR);
                warn!(digest = %d, error = %e, "disk full at the end of a download: dropped it; streaming this blob uncached for a while");
            }
            Err(e) => warn!(digest = %d, error = %e, "downloaded blob rejected; discarded"),
        }
    }

    fn writer_failed(&self, writer: &mut store::BlobWriter, d: &Digest, e: store::Error) {
        if e.is_disk_full() {
            self.metrics.disk_full.inc();
            warn!(digest = %d, error = %e, "disk full: dropping the partial download; streaming this blob uncached for a while");
            writer.abandon(&e.to_string());
            self.uncacheable
                .lock()
                .insert(d.clone(), Instant::now() + UNCACHEABLE_FOR);
        } else {
            warn!(digest = %d, error = %e, "cannot write blob; partial kept for resume");
            writer.fail(&e.to_string());
        }
    }

    /// `[start, end)` straight from the registry, asking for exactly that range.
    pub(crate) fn passthrough(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        start: u64,
        end: u64,
    ) -> std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, Error>> + Send>> {
        let up = self.upstream.clone();
        let metrics = self.metrics.clone();
        let limit = self.download_limit.clone();
        let (registry, repo, d) = (registry.to_owned(), repo.to_owned(), d.clone());
        let fut = async move {
            up.get_blob_range(&registry, &repo, &d, start, Some(end))
                .await
        };
        Box::pin(
            futures::stream::once(fut)
                .map(|r| match r {
                    Ok(resp) => resp.stream,
                    Err(e) => Box::pin(futures::stream::once(async move { Err(e) }))
                        as oci::upstream::ByteStream,
                })
                .flatten()
                .then(move |item| {
                    let (metrics, limit) = (metrics.clone(), limit.clone());
                    async move {
                        if let Ok(b) = &item {
                            if let Some(l) = &limit {
                                l.acquire(b.len() as u64).await;
                            }
                            metrics.upstream_bytes.inc_by(b.len() as u64);
                        }
                        item
                    }
                }),
        )
    }
}

pub(crate) fn store_err(e: store::Error) -> Error {
    match e {
        store::Error::Content(c) => c,
        store::Error::DownloadFailed {
            digest,
            reason,
            retryable: false,
        } => Error::CacheCorrupt(format!("blob {digest}: {reason}")),
        other => Error::Cache(other.to_string()),
    }
}

/// Upstream 404 on a blob is BLOB_UNKNOWN, not the generic NAME_UNKNOWN.
pub(crate) fn blob_err(e: Error, d: &Digest) -> Error {
    match e.with_not_found_code(oci::ErrorCode::BlobUnknown) {
        Error::Upstream {
            registry,
            status: 404,
            code,
            message,
            retry_after,
        } => Error::Upstream {
            registry,
            status: 404,
            code,
            message: format!("blob {d} unknown: {message}"),
            retry_after,
        },
        other => other,
    }
}

/// The sizes manifests this agent served gave their blobs. Two uses:
/// - a blob declared smaller than the P2P threshold (an image config, a small layer)
///   goes to the registry on its first request, without a tracker round trip and an
///   election that learns the size only from the registry;
/// - a swarm laid out by another size than the one declared is checked against the
///   registry before a client is told that size (`p2p::download::join`).
///
/// Keyed by repository: a tenant's manifest that misstates another image's blob
/// touches only its own repository's pulls of it.
#[derive(Default)]
pub(crate) struct DeclaredSizes {
    blobs: std::collections::HashMap<(String, String, Digest), u64>,
}

impl DeclaredSizes {
    /// Entries kept; past it the map starts over (a miss only costs what it saves).
    const CAPACITY: usize = 16_384;

    fn note<'a>(
        &mut self,
        registry: &str,
        repo: &str,
        blobs: impl Iterator<Item = &'a oci::Descriptor>,
    ) {
        for b in blobs.take(1024) {
            if self.blobs.len() >= Self::CAPACITY {
                self.blobs.clear();
            }
            self.blobs.insert(
                (registry.to_owned(), repo.to_owned(), b.digest.clone()),
                b.size,
            );
        }
    }

    pub(crate) fn size(&self, registry: &str, repo: &str, d: &Digest) -> Option<u64> {
        if self.blobs.is_empty() {
            return None;
        }
        self.blobs
            .get(&(registry.to_owned(), repo.to_owned(), d.clone()))
            .copied()
    }
}
