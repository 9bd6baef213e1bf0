//! The cluster layer (inventory, prewarm, scheduler extender, dashboard) mounted on the
//! tracker: a registry-backed image catalog so prewarm resolves tags the cluster has
//! never pulled, the dispatcher that hands prewarm assignments to agents, and the
//! endpoint agents report prewarm progress to.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cluster::inventory::BlobRef;
use cluster::prewarm::NodeUpdate;
use cluster::{ClusterState, ImageCatalog, ResolvedImage};
use http::StatusCode;
use oci::{ImageReference, Manifest};
use tracing::{info, warn};

/// Resolves references against the registry (tag → digest at submit time), picking
/// the host platform from an index.
pub struct RegistryCatalog {
    pub upstream: oci::Upstream,
    pub runtime: tokio::runtime::Handle,
    /// Answers (and failures) are reused for a minute so the scheduler extender never
    /// waits on the registry twice for the same image.
    pub cache: parking_lot::Mutex<
        std::collections::HashMap<String, (std::time::Instant, Option<ResolvedImage>)>,
    >,
}

impl RegistryCatalog {
    pub fn new(upstream: oci::Upstream, runtime: tokio::runtime::Handle) -> Self {
        Self {
            upstream,
            runtime,
            cache: parking_lot::Mutex::new(std::collections::HashMap::new()),
        }
    }
}

impl RegistryCatalog {
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
        let key = image.to_string();
        if let Some((at, r)) = self.cache.lock().get(&key) {
            let ttl = if image.digest.is_some() && r.is_some() {
                Duration::MAX
            } else {
                Duration::from_secs(60)
            };
            if at.elapsed() < ttl {
                return r.clone();
            }
        }
        let r = self.resolve_uncached(image);
        let mut c = self.cache.lock();
        if c.len() > 10_000 {
            c.clear();
        }
        c.insert(key, (std::time::Instant::now(), r.clone()));
        r
    }
}

impl RegistryCatalog {
    fn resolve_uncached(&self, image: &ImageReference) -> Option<ResolvedImage> {
        // Called from request handlers on a multi-thread runtime.
        let r = tokio::task::block_in_place(|| self.runtime.block_on(self.resolve_async(image)));
        match r {
            Ok(x) => Some(x),
            Err(e) => {
                warn!(image = %image, error = %e, "cannot resolve image in the registry");
                None
            }
        }
    }
}

/// Sends new prewarm assignments to their agents every second and ticks the state.
pub fn spawn_dispatcher(state: ClusterState, token: Option<Arc<str>>) {
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .build()
        .unwrap_or_default();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            if let Err(e) = state.tick() {
                warn!(error = %e, "cluster tick failed");
            }
            let assignments = match state.next_assignments() {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "cannot plan prewarm assignments");
                    continue;
                }
            };
            for a in assignments {
                let Some(url) = a.agent_url.clone() else {
                    let _ = state.update_prewarm_node(
                        a.job_id,
                        &a.node,
                        NodeUpdate::Failed {
                            reason: "agent did not report its URL".into(),
                        },
                    );
                    continue;
                };
                let mut req = http
                    .post(format!("{}/api/v1/prewarm", url.trim_end_matches('/')))
                    .json(&a)
                    .timeout(Duration::from_secs(5));
                if let Some(t) = &token {
                    req = req.bearer_auth(t.as_ref());
                }
                match req.send().await {
                    Ok(r) if r.status().is_success() => {
                        info!(job = a.job_id, node = %a.node, seed = a.seed, "prewarm assignment sent")
                    }
                    Ok(r) => {
                        let _ = state.update_prewarm_node(
                            a.job_id,
                            &a.node,
                            NodeUpdate::Failed {
                                reason: format!("agent refused the assignment: {}", r.status()),
                            },
                        );
                    }
                    Err(e) => {
                        let _ = state.update_prewarm_node(
                            a.job_id,
                            &a.node,
                            NodeUpdate::Failed {
                                reason: format!("agent unreachable: {e}"),
                            },
                        );
                    }
                }
            }
        }
    });
}

pub async fn node_update(
    State(state): State<ClusterState>,
    Path((id, node)): Path<(u64, String)>,
    Json(update): Json<NodeUpdate>,
) -> Response {
    match state.update_prewarm_node(id, &node, update) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => (
            cluster::http::status_of(&e),
            Json(serde_json::json!({"error": e.to_string()})),
        )
            .into_response(),
    }
}
