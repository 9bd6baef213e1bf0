//! Serving manifests: by digest from the cache forever, by tag with a short TTL checked
//! by HEAD, and from the last known digest when the upstream is unreachable.

use bytes::Bytes;
use oci::media::accept_admits;
use oci::{Digest, Error, Manifest, ManifestRef};
use store::TagRecord;
use tracing::{info, warn};

use crate::Agent;

pub struct ServedManifest {
    pub media_type: String,
    pub digest: Digest,
    pub body: Bytes,
}

impl Agent {
    pub(crate) async fn manifest(
        &self,
        registry: &str,
        repo: &str,
        reference: &ManifestRef,
        accept: Option<&str>,
    ) -> Result<ServedManifest, Error> {
        match reference {
            ManifestRef::Digest(d) => self.manifest_by_digest(registry, repo, d, accept).await,
            ManifestRef::Tag(tag) => self.manifest_by_tag(registry, repo, tag, accept).await,
        }
    }

    async fn manifest_by_digest(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        accept: Option<&str>,
    ) -> Result<ServedManifest, Error> {
        if let Some((media_type, body)) = self.store.get_manifest(d).map_err(to_oci)? {
            self.metrics.cache_hits.inc();
            return Ok(ServedManifest {
                media_type,
                digest: d.clone(),
                body,
            });
        }
        self.metrics.cache_misses.inc();
        let accept_up = accept.unwrap_or(oci::media::DEFAULT_ACCEPT);
        let (meta, body) = match self
            .upstream
            .get_manifest(registry, repo, &d.to_string(), accept_up)
            .await
        {
            Ok(got) => got,
            Err(e) if e.registry_unavailable() => {
                let e = self.upstream_failed(e);
                return self
                    .manifest_from_holders(registry, repo, d, accept, e)
                    .await;
            }
            Err(e) => return Err(self.upstream_failed(e)),
        };
        self.remember(&meta.digest, &meta.media_type, &body);
        Ok(ServedManifest {
            media_type: meta.media_type,
            digest: meta.digest,
            body,
        })
    }

    async fn manifest_by_tag(
        &self,
        registry: &str,
        repo: &str,
        tag: &str,
        accept: Option<&str>,
    ) -> Result<ServedManifest, Error> {
        let known: Vec<TagRecord> = self
            .store
            .tags(registry, repo, tag)
            .map_err(to_oci)?
            .into_iter()
            .filter(|t| accept_admits(accept, &t.media_type))
            .collect();
        let now = store::now_secs();
        let ttl = self.cfg.tag_ttl.as_secs();
        if let Some(fresh) = known
            .iter()
            .filter(|t| now.saturating_sub(t.checked) < ttl)
            .max_by_key(|t| t.checked)
        {
            if let Some(m) = self.cached(fresh)? {
                self.metrics.cache_hits.inc();
                return Ok(m);
            }
        }
        let accept_up = accept.unwrap_or(oci::media::DEFAULT_ACCEPT);
        let head = self
            .upstream
            .head_manifest(registry, repo, tag, accept_up)
            .await;
        let meta = match head {
            Ok(meta) if accept_admits(accept, &meta.media_type) => meta,
            Ok(meta) => {
                return Err(Error::Upstream {
                    registry: registry.into(),
                    status: 404,
                    code: Some(oci::ErrorCode::ManifestUnknown),
                    message: format!(
                        "{repo}:{tag} is {} which the client does not accept",
                        meta.media_type
                    ),
                    retry_after: None,
                })
            }
            Err(e) if e.is_not_found() => return Err(self.upstream_failed(e)),
            // A TLS failure (certificate changed or not trusted) counts as unreachable:
            // the last digest was verified over a trusted connection.
            Err(e) if (e.is_retryable() || e.is_tls()) && self.cfg.serve_stale_tags => {
                self.metrics.upstream_errors.inc();
                if let Some(stale) = known.iter().max_by_key(|t| t.checked) {
                    if let Some(m) = self.cached(stale)? {
                        self.metrics.stale_tags_served.inc();
                        warn!(%registry, %repo, %tag, digest = %m.digest, age_s = now.saturating_sub(stale.checked), error = %e, "upstream unreachable; serving last known digest for tag");
                        return Ok(m);
                    }
                }
                return Err(e);
            }
            Err(e) => {
                self.metrics.upstream_errors.inc();
                return Err(e);
            }
        };
        let rec = TagRecord {
            registry: registry.into(),
            repository: repo.into(),
            tag: tag.into(),
            digest: meta.digest.to_string(),
            media_type: meta.media_type.clone(),
            size: meta.size,
            checked: now,
        };
        let served = match self.cached(&rec)? {
            Some(m) => {
                self.metrics.cache_hits.inc();
                m
            }
            None => {
                self.metrics.cache_misses.inc();
                match self
                    .upstream
                    .get_manifest(registry, repo, &meta.digest.to_string(), accept_up)
                    .await
                {
                    Ok((meta, body)) => {
                        self.remember(&meta.digest, &meta.media_type, &body);
                        ServedManifest {
                            media_type: meta.media_type,
                            digest: meta.digest,
                            body,
                        }
                    }
                    // The registry named the digest (a HEAD, which pull quotas such as
                    // Docker Hub's do not count) but will not give the manifest.
                    Err(e) if e.registry_unavailable() => {
                        let e = self.upstream_failed(e);
                        self.manifest_from_holders(registry, repo, &meta.digest, accept, e)
                            .await?
                    }
                    Err(e) => return Err(self.upstream_failed(e)),
                }
            }
        };
        if let Some(prev) = known.iter().find(|t| t.media_type == rec.media_type) {
            if prev.digest != rec.digest {
                info!(%registry, %repo, %tag, from = %prev.digest, to = %rec.digest, "tag moved");
            }
        }
        if let Err(e) = self.store.put_tag(&rec) {
            warn!(error = %e, "cannot record tag");
        }
        Ok(served)
    }

    /// A manifest the registry could not give (`refused`, which the caller gets if
    /// nobody else can either), taken from a member that holds it: by digest only, so
    /// its bytes are proven whatever the member is; at most `MAX_MANIFEST_BYTES`.
    async fn manifest_from_holders(
        &self,
        registry: &str,
        repo: &str,
        d: &Digest,
        accept: Option<&str>,
        refused: Error,
    ) -> Result<ServedManifest, Error> {
        if self.p2p.is_none() {
            return Err(refused);
        }
        let inflight = match self.store.begin(d, None, registry).await {
            Ok(store::Begin::Lead(writer)) => {
                let max = oci::media::MAX_MANIFEST_BYTES as u64;
                let taken = crate::p2p::start_from_holders(
                    self.clone(),
                    registry,
                    repo,
                    d,
                    writer,
                    None,
                    max,
                )
                .await;
                let Some((inf, _)) = taken else {
                    return Err(refused);
                };
                Some(inf)
            }
            Ok(store::Begin::Join(inf)) => Some(inf),
            Ok(store::Begin::Complete(_)) => None,
            Err(_) => return Err(refused),
        };
        if let Some(inf) = inflight {
            let mut progress = inf.subscribe();
            loop {
                match progress.borrow_and_update().status.clone() {
                    store::Status::Complete => break,
                    store::Status::Failed { .. } => return Err(refused),
                    store::Status::Running => {}
                }
                if progress.changed().await.is_err() {
                    return Err(refused);
                }
            }
        }
        let path = self.store.blob_path(d);
        let body = match std::fs::read(&path) {
            Ok(b) if b.len() <= oci::media::MAX_MANIFEST_BYTES && Digest::of(&b) == *d => {
                Bytes::from(b)
            }
            _ => return Err(refused),
        };
        let media_type = match Manifest::parse(&body) {
            Ok(m) => m.effective_media_type().to_owned(),
            Err(e) => {
                warn!(digest = %d, error = %e, "content other nodes hold under a manifest's digest is no manifest");
                return Err(refused);
            }
        };
        if !accept_admits(accept, &media_type) {
            return Err(refused);
        }
        info!(%registry, %repo, digest = %d, error = %refused, "the registry cannot answer; took the manifest from a member that holds it");
        self.metrics.taken_from_holders.inc();
        self.remember(d, &media_type, &body);
        Ok(ServedManifest {
            media_type,
            digest: d.clone(),
            body,
        })
    }

    fn cached(&self, t: &TagRecord) -> Result<Option<ServedManifest>, Error> {
        let Ok(d) = Digest::parse(&t.digest) else {
            return Ok(None);
        };
        Ok(self
            .store
            .get_manifest(&d)
            .map_err(to_oci)?
            .map(|(media_type, body)| ServedManifest {
                media_type,
                digest: d,
                body,
            }))
    }

    /// Caches a verified manifest with the blobs it references (what a pin keeps).
    pub(crate) fn remember(&self, d: &Digest, media_type: &str, body: &Bytes) {
        let children = Manifest::parse(body)
            .map(|m| {
                m.blobs()
                    .chain(m.manifests.iter())
                    .map(|x| x.digest.clone())
                    .collect()
            })
            .unwrap_or_default();
        if let Err(e) = self.store.put_manifest(d, media_type, body, children) {
            warn!(digest = %d, error = %e, "cannot cache manifest; serving it anyway");
        }
    }

    fn upstream_failed(&self, e: Error) -> Error {
        self.metrics.upstream_errors.inc();
        e.with_not_found_code(oci::ErrorCode::ManifestUnknown)
    }
}

pub(crate) fn to_oci(e: store::Error) -> Error {
    match e {
        store::Error::Content(c) => c,
        other => Error::Io(std::io::Error::other(other.to_string())),
    }
}
