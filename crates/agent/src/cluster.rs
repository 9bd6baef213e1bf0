//! The agent's side of the cluster layer: periodic inventory reports to the tracker
//! and node preload of the configured `pin` images. Prewarm assignments are
//! `crate::prewarm`'s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cluster::wire::{BlobHolding, BlobRef, Download, ImageRecord, NodeReport, Pin, SourceBytes};
use oci::{Digest, ImageReference, Manifest};
use tracing::{debug, info, warn};

use crate::Agent;

static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Unix seconds of the last warning about a refused report (0: none yet).
static LAST_REFUSAL_WARNING: AtomicU64 = AtomicU64::new(0);

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Agent {
    /// What this node holds, for the tracker's inventory.
    pub fn node_report(&self) -> NodeReport {
        let start_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        // Grows across reports and across restarts: wall clock in ms, at least previous + 1.
        let prev = GENERATION
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |g| {
                Some(start_ms.max(g + 1))
            })
            .unwrap_or(0);
        let generation = start_ms.max(prev + 1);
        let usage = self.store.usage();
        let list = self.store.list();
        let by_digest: std::collections::HashMap<&Digest, &store::BlobRecord> =
            list.iter().map(|(d, r)| (d, r)).collect();
        let mut blobs: Vec<BlobHolding> = list
            .iter()
            .filter(|(_, r)| r.media_type.is_none())
            .map(|(d, r)| BlobHolding {
                digest: d.clone(),
                size: r.size,
                bytes_held: r.size,
                complete: true,
            })
            .collect();
        let mut downloads = Vec::new();
        for (d, written, total) in self.store.inflight_list() {
            blobs.push(BlobHolding {
                digest: d.clone(),
                size: total.unwrap_or(written),
                bytes_held: written,
                complete: false,
            });
            downloads.push(Download {
                digest: d,
                bytes_done: written,
                bytes_total: total.unwrap_or(0),
            });
        }
        let mut images: Vec<ImageRecord> = Vec::new();
        for tag in self.store.all_tags().unwrap_or_default() {
            let Ok(top) = Digest::parse(&tag.digest) else {
                continue;
            };
            let reference = format!("{}/{}:{}", tag.registry, tag.repository, tag.tag);
            let mut candidates = vec![(top.clone(), None)];
            if let Ok(Some((_, body))) = self.store.get_manifest(&top) {
                if let Ok(m) = Manifest::parse(&body) {
                    if m.is_index() {
                        candidates = m
                            .manifests
                            .iter()
                            .map(|c| (c.digest.clone(), Some(top.clone())))
                            .collect();
                    }
                }
            }
            for (md, index) in candidates {
                let Ok(Some((_, body))) = self.store.get_manifest(&md) else {
                    continue;
                };
                let Ok(m) = Manifest::parse(&body) else {
                    continue;
                };
                if let Some(existing) = images.iter_mut().find(|i| i.manifest_digest == md) {
                    if !existing.references.contains(&reference) {
                        existing.references.push(reference.clone());
                    }
                    continue;
                }
                let mut sources = SourceBytes::default();
                for b in m.blobs() {
                    match by_digest.get(&b.digest).map(|r| r.source.as_str()) {
                        Some("peer") => sources.peer += b.size,
                        Some(_) => sources.registry += b.size,
                        None => {}
                    }
                }
                images.push(ImageRecord {
                    manifest_digest: md.clone(),
                    index_digest: index,
                    references: vec![reference.clone()],
                    blobs: m
                        .blobs()
                        .map(|b| BlobRef {
                            digest: b.digest.clone(),
                            size: b.size,
                        })
                        .collect(),
                    last_pull: Some(tag.checked),
                    last_use: by_digest.get(&md).map(|r| r.last_access),
                    bytes_by_source: sources,
                    pull_seconds: None,
                });
            }
        }
        images.extend(
            self.files
                .images(|d| self.store.stat(d).is_some() || self.store.inflight(d).is_some()),
        );
        let pins = self
            .store
            .pins()
            .into_iter()
            .map(|(d, p)| Pin {
                reference: p.reason,
                digest: Some(d),
                expires_at: p.until,
            })
            .collect();
        let mut labels = self.cfg.labels.clone();
        if let Some(z) = &self.cfg.zone {
            labels
                .entry("topology.kubernetes.io/zone".into())
                .or_insert(z.clone());
        }
        if let Some(r) = &self.cfg.rack {
            labels.entry("starling.io/rack".into()).or_insert(r.clone());
        }
        NodeReport {
            node: self.cfg.node_name.clone(),
            generation,
            labels,
            agent_url: self
                .p2p
                .as_ref()
                .map(|_| format!("http://{}", self.cfg.listen)),
            blobs,
            images,
            pins,
            cache_budget: usage.budget_bytes,
            cache_used: usage.used_bytes,
            cache_free: usage
                .budget_bytes
                .saturating_sub(usage.used_bytes)
                .min(usage.free_disk_bytes),
            downloads_in_flight: downloads,
            throughput_bytes_per_sec: None,
        }
    }

    /// Reports the inventory every few seconds (and the tracker learns a restarted
    /// agent's content within one period).
    pub(crate) fn spawn_reporter(&self) {
        let Some(p2p) = self.p2p.clone() else { return };
        let _ = p2p;
        let agent = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(3));
            loop {
                tick.tick().await;
                agent.report_now().await;
            }
        });
    }

    /// Sends the inventory now (also called when content changed, e.g. after a prewarm).
    pub(crate) async fn report_now(&self) {
        let Some(p2p) = &self.p2p else { return };
        let report = self.node_report();
        match p2p
            .trackers()
            .send(|base| {
                p2p.authed(
                    p2p.http
                        .post(format!("{base}/api/v1/reports"))
                        .json(&report),
                )
                .timeout(Duration::from_secs(5))
            })
            .await
        {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => {
                // A refused report leaves this node stale in the tracker's inventory
                // (prewarm and the scheduler see old contents): say so, once a minute.
                let now = unix_now();
                let last = LAST_REFUSAL_WARNING.load(Ordering::Relaxed);
                if now.saturating_sub(last) >= 60
                    && LAST_REFUSAL_WARNING
                        .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                {
                    let status = r.status();
                    let reason = read_prefix(r, 1024).await;
                    warn!(%status, %reason, blobs = report.blobs.len(), "tracker refused the inventory report; the cluster sees stale contents for this node");
                } else {
                    debug!(status = %r.status(), "tracker refused the inventory report");
                }
            }
            Err(e) => debug!(error = %e, "cannot send the inventory report"),
        }
    }

    /// Node preload: fetch every configured `pin` image in full, then pin it.
    pub(crate) async fn preload(&self, reference: &ImageReference, manifest: &Digest) {
        let done = AtomicU64::new(0);
        let Ok(Some((_, body))) = self.store.get_manifest(manifest) else {
            return;
        };
        let Ok(m) = Manifest::parse(&body) else {
            return;
        };
        for b in m.blobs() {
            if let Err(e) = self
                .warm_blob(
                    &reference.registry,
                    &reference.repository,
                    &b.digest,
                    &done,
                    None,
                )
                .await
            {
                warn!(image = %reference, error = %e, "preload incomplete");
                return;
            }
        }
        info!(image = %reference, bytes = done.load(Ordering::Relaxed), "preloaded");
    }
}

/// At most `cap` bytes of a response body, as text (for log lines).
async fn read_prefix(r: reqwest::Response, cap: usize) -> String {
    let mut out = Vec::new();
    let mut stream = r.bytes_stream();
    while out.len() < cap {
        match tokio::time::timeout(
            Duration::from_secs(2),
            futures::StreamExt::next(&mut stream),
        )
        .await
        {
            Ok(Some(Ok(c))) => out.extend_from_slice(&c[..c.len().min(cap - out.len())]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
