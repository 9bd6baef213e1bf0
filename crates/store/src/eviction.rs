//! GC execution: sweeping idle partial downloads and evicting complete blobs down to a
//! target, in the order [`crate::gc`]'s I/O-free policy chooses.

use oci::Digest;
use tracing::info;

use crate::{gc, meta, now_secs, Error, Store, PARTIAL_IDLE_LIMIT};

impl Store {
    /// Runs GC if usage is above the high watermark.
    pub fn maybe_gc(&self) -> Result<gc::GcReport, Error> {
        self.sweep_partials(PARTIAL_IDLE_LIMIT);
        let cfg = &self.inner.cfg;
        let used = self.usage().used_bytes;
        if used as f64 > cfg.budget_bytes as f64 * cfg.high_watermark {
            self.gc_to((cfg.budget_bytes as f64 * cfg.low_watermark) as u64)
        } else {
            Ok(gc::GcReport::default())
        }
    }

    /// Deletes partial downloads nobody is writing that were last touched `idle_for`
    /// ago or earlier, and returns the bytes freed. A partial is only worth its space
    /// while a resume is likely; abandoned ones would otherwise fill the disk forever.
    pub fn sweep_partials(&self, idle_for: std::time::Duration) -> u64 {
        let Ok(entries) = std::fs::read_dir(&self.inner.partial_dir) else {
            return 0;
        };
        // Under the state lock: `begin` opens partial files under it too, so a download
        // cannot start on a file that is being deleted.
        let st = self.inner.state.lock();
        let cutoff = std::time::SystemTime::now()
            .checked_sub(idle_for)
            .unwrap_or(std::time::UNIX_EPOCH);
        let mut freed = 0;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let hex = name.split('.').next().unwrap_or_default();
            let busy =
                Digest::parse(&format!("sha256:{hex}")).is_ok_and(|d| st.inflight.contains_key(&d));
            let Ok(meta) = e.metadata() else { continue };
            if busy || meta.modified().is_ok_and(|m| m > cutoff) {
                continue;
            }
            if std::fs::remove_file(e.path()).is_ok() {
                freed += meta.len();
            }
        }
        if freed > 0 {
            info!(bytes = freed, "removed abandoned partial downloads");
        }
        freed
    }

    /// Evicts least-recently-used unprotected blobs until usage ≤ `target` bytes.
    pub fn gc_to(&self, target: u64) -> Result<gc::GcReport, Error> {
        let victims = {
            let st = self.inner.state.lock();
            let now = now_secs();
            let roots: Vec<Digest> = st
                .pins
                .iter()
                .filter(|(_, p)| p.until.is_none_or(|u| u > now))
                .map(|(d, _)| d.clone())
                .collect();
            let protected = gc::closure(&roots, |d| {
                st.index
                    .get(d)
                    .map(|r| r.children.clone())
                    .unwrap_or_default()
            });
            let used: u64 = st.index.values().map(|r| r.size).sum::<u64>()
                + st.inflight
                    .values()
                    .map(|i| i.progress.borrow().total.unwrap_or(0))
                    .sum::<u64>();
            let candidates = st
                .index
                .iter()
                .filter(|(d, _)| {
                    !protected.contains(*d)
                        && !st.serving.contains_key(*d)
                        && !st.inflight.contains_key(*d)
                })
                .map(|(d, r)| gc::Candidate {
                    digest: d.clone(),
                    size: r.size,
                    last_access: r.last_access,
                });
            gc::choose_victims(candidates, used, target)
        };
        let mut report = gc::GcReport::default();
        if victims.is_empty() {
            return Ok(report);
        }
        let mut keys = Vec::new();
        {
            let mut st = self.inner.state.lock();
            for v in &victims {
                // Re-check under the lock: a reader may have opened it meanwhile.
                if st.serving.contains_key(&v.digest) || st.inflight.contains_key(&v.digest) {
                    continue;
                }
                if let Some(rec) = st.index.remove(&v.digest) {
                    report.evicted += 1;
                    report.bytes += rec.size;
                    keys.push(v.digest.to_string());
                    std::fs::remove_file(self.blob_path(&v.digest)).ok();
                }
            }
            st.evictions += report.evicted;
            st.evicted_bytes += report.bytes;
        }
        meta::remove(&self.inner.db, meta::BLOBS, &keys)?;
        info!(
            evicted = report.evicted,
            bytes = report.bytes,
            "gc evicted blobs"
        );
        Ok(report)
    }
}
