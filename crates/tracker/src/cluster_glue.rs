//! The cluster layer (inventory, prewarm, scheduler extender, dashboard) mounted on the
//! tracker: a registry-backed image catalog so prewarm resolves tags the cluster has
//! never pulled, and the
//! endpoint agents report prewarm progress to.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cluster::wire::{BlobRef, NodeUpdate};
use cluster::{ClusterState, ImageCatalog, Lookup, LookupFuture, ResolvedImage};
use http::StatusCode;
use oci::{ImageReference, Manifest};
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use tracing::warn;

/// How long a registry answer (or its absence) is reused for a tag; digests are
/// immutable and kept until the cache is cleared.
const CATALOG_TTL: Duration = Duration::from_secs(60);
/// Registry lookups started in the background (extender misses) at once.
const BACKGROUND_LOOKUPS: usize = 8;
/// Background lookups waiting at most; more misses are dropped (asked again later).
const MAX_PENDING: usize = 1024;
/// Answers cached at most; the cache is cleared beyond.
const MAX_CACHED: usize = 10_000;

/// Resolves references against the registry (tag → digest at submit time), picking
/// the host platform from an index. Every lookup is bounded by `timeout` and runs with
/// no lock held; answers and failures are cached so the scheduler extender, which
/// only reads the cache, finds them.
#[derive(Clone)]
pub struct RegistryCatalog {
    inner: Arc<CatalogInner>,
}

struct CatalogInner {
    upstream: oci::Upstream,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
    cache: Mutex<HashMap<String, (Instant, Option<ResolvedImage>)>>,
    pending: Mutex<HashSet<String>>,
    background: Arc<Semaphore>,
}

impl RegistryCatalog {
    /// A catalog whose lookups take at most 10 s.
    pub fn new(upstream: oci::Upstream, runtime: tokio::runtime::Handle) -> Self {
        Self::with_timeout(upstream, runtime, Duration::from_secs(10))
    }

    /// `timeout`: the longest one lookup (all its registry requests) may take.
    pub fn with_timeout(
        upstream: oci::Upstream,
        runtime: tokio::runtime::Handle,
        timeout: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(CatalogInner {
                upstream,
                runtime,
                timeout,
                cache: Mutex::new(HashMap::new()),
                pending: Mutex::new(HashSet::new()),
                background: Arc::new(Semaphore::new(BACKGROUND_LOOKUPS)),
            }),
        }
    }
}

impl CatalogInner {
    /// A fresh cached answer: `Some(None)` is a cached "not found / failed".
    fn cached(&self, image: &ImageReference) -> Option<Option<ResolvedImage>> {
        let cache = self.cache.lock();
        let (at, r) = cache.get(&image.to_string())?;
        let ttl = if image.digest.is_some() && r.is_some() {
            Duration::MAX
        } else {
            CATALOG_TTL
        };
        (at.elapsed() < ttl).then(|| r.clone())
    }

    fn remember(&self, image: &ImageReference, r: Option<ResolvedImage>) {
        let mut c = self.cache.lock();
        if c.len() >= MAX_CACHED {
            c.clear();
        }
        c.insert(image.to_string(), (Instant::now(), r));
    }

    /// One lookup at the registry, bounded in time; the answer is cached.
    async fn lookup(&self, image: &ImageReference) -> Lookup {
        let r = tokio::time::timeout(self.timeout, self.resolve_async(image)).await;
        let found = match r {
            Ok(Ok(x)) => Lookup::Found(x),
            Ok(Err(e @ oci::Error::Denied { .. })) => return Lookup::Denied(e.to_string()),
            Ok(Err(e)) if e.is_not_found() => Lookup::NotFound,
            Ok(Err(e)) => {
                warn!(image = %image, error = %e, "cannot resolve image in the registry");
                Lookup::Failed(e.to_string())
            }
            Err(_) => {
                warn!(image = %image, timeout = ?self.timeout, "registry lookup timed out");
                Lookup::Failed(format!("no answer within {:?}", self.timeout))
            }
        };
        self.remember(
            image,
            match &found {
                Lookup::Found(x) => Some(x.clone()),
                _ => None,
            },
        );
        found
    }

    async fn resolve_async(&self, image: &ImageReference) -> Result<ResolvedImage, oci::Error> {
        let up = &self.upstream;
        let (reg, repo) = (&image.registry, &image.repository);
        let (meta, body) = up
            .get_manifest(
                reg,
                repo,
                &image.manifest_ref().to_string(),
                oci::media::DEFAULT_ACCEPT,
            )
            .await?;
        let mut m = Manifest::parse(&body)?;
        let mut digest = meta.digest;
        if m.is_index() {
            let (os, arch) = oci::media::host_platform();
            let child = m
                .select_platform(os, arch)
                .ok_or_else(|| oci::Error::ManifestInvalid(format!("no {os}/{arch} image")))?
                .digest
                .clone();
            let (m2, b2) = up
                .get_manifest(reg, repo, &child.to_string(), oci::media::DEFAULT_ACCEPT)
                .await?;
            m = Manifest::parse(&b2)?;
            digest = m2.digest;
        }
        Ok(ResolvedImage {
            reference: image.to_string(),
            manifest_digest: digest,
            blobs: m
                .blobs()
                .map(|d| BlobRef {
                    digest: d.digest.clone(),
                    size: d.size,
                })
                .collect(),
        })
    }
}

impl ImageCatalog for RegistryCatalog {
    fn resolve(&self, image: &ImageReference) -> Option<ResolvedImage> {
        self.inner.cached(image).flatten()
    }

    fn prefetch(&self, image: &ImageReference) {
        if self.inner.cached(image).is_some() {
            return;
        }
        // A registry this tracker may not contact is never looked up, not even later.
        if self.inner.upstream.check_registry(&image.registry).is_err() {
            return;
        }
        let key = image.to_string();
        {
            let mut p = self.inner.pending.lock();
            if p.len() >= MAX_PENDING || !p.insert(key.clone()) {
                return;
            }
        }
        let (inner, image) = (self.inner.clone(), image.clone());
        self.inner.runtime.spawn(async move {
            if let Ok(_slot) = inner.background.clone().acquire_owned().await {
                inner.lookup(&image).await;
            }
            inner.pending.lock().remove(&key);
        });
    }

    fn fetch<'a>(&'a self, image: &'a ImageReference) -> LookupFuture<'a> {
        Box::pin(async move {
            match self.inner.cached(image) {
                Some(Some(x)) => Lookup::Found(x),
                Some(None) => Lookup::NotFound,
                None => self.inner.lookup(image).await,
            }
        })
    }
}

pub async fn node_update(
    State(state): State<ClusterState>,
    Path((id, node)): Path<(u64, String)>,
    me: Option<axum::Extension<cluster::http::AuthenticatedNode>>,
    Json(update): Json<NodeUpdate>,
) -> Response {
    // The access layer checked the path already; the decoded name is checked again here
    // so that no spelling of the path gets a node past it.
    if let Some(refused) = crate::access::refuse_other_node(me.as_deref(), &node) {
        return refused;
    }
    let changed = state.report_prewarm_node(id, &node, update).await;
    match changed {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => (
            cluster::http::status_of(&e),
            Json(serde_json::json!({"error": e.to_string()})),
        )
            .into_response(),
    }
}
