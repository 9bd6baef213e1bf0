//! Space accounting: what the cache uses and has promised to downloads in flight,
//! what the filesystem has left, and making room by evicting (through [`crate::gc`]'s
//! policy) before a write.

use oci::Digest;

use crate::{Error, Store, Usage};

impl Store {
    /// Ensures `needed` more bytes fit in the budget and on the disk, evicting if needed.
    pub fn make_room(&self, needed: u64) -> Result<(), Error> {
        self.make_room_excluding(needed, None)
    }

    pub(crate) fn used_excluding(&self, exclude: Option<&Digest>) -> u64 {
        let st = self.inner.state.lock();
        st.index.values().map(|r| r.size).sum::<u64>()
            + st.inflight
                .iter()
                .filter(|(d, _)| Some(*d) != exclude)
                .map(|(_, i)| {
                    let p = i.progress.borrow();
                    p.total.unwrap_or(p.written)
                })
                .sum::<u64>()
    }

    /// Bytes other downloads still have to write: the disk must keep room for them,
    /// or concurrent downloads that each fit would together fill it. (A preallocated
    /// download's room is already gone from the disk's free space.)
    pub(crate) fn promised_excluding(&self, exclude: Option<&Digest>) -> u64 {
        let st = self.inner.state.lock();
        st.inflight
            .iter()
            .filter(|(d, _)| Some(*d) != exclude)
            .filter(|(_, i)| !i.preallocated.load(std::sync::atomic::Ordering::Relaxed))
            .map(|(_, i)| {
                let p = i.progress.borrow();
                p.total.unwrap_or(p.written).saturating_sub(p.written)
            })
            .sum()
    }

    pub(crate) fn make_room_excluding(
        &self,
        needed: u64,
        exclude: Option<&Digest>,
    ) -> Result<(), Error> {
        let cfg = &self.inner.cfg;
        let used = self.used_excluding(exclude);
        if used + needed > (cfg.budget_bytes as f64 * cfg.high_watermark) as u64 {
            let target =
                ((cfg.budget_bytes as f64 * cfg.low_watermark) as u64).saturating_sub(needed);
            self.gc_to(target)?;
        }
        let needed_on_disk = needed + cfg.min_free_bytes + self.promised_excluding(exclude);
        let mut free = available_space(&cfg.root).unwrap_or(u64::MAX);
        if free < needed_on_disk && self.sweep_partials(std::time::Duration::ZERO) > 0 {
            free = available_space(&cfg.root).unwrap_or(u64::MAX);
        }
        if free < needed_on_disk {
            let over = needed_on_disk - free;
            let used = self.used_excluding(exclude);
            self.gc_to(used.saturating_sub(over))?;
            let free = available_space(&cfg.root).unwrap_or(u64::MAX);
            if free < needed_on_disk {
                return Err(Error::DiskFull { needed, free });
            }
        }
        let used = self.used_excluding(exclude);
        if used + needed > cfg.budget_bytes {
            return Err(Error::DiskFull {
                needed,
                free: cfg.budget_bytes.saturating_sub(used),
            });
        }
        Ok(())
    }

    pub fn usage(&self) -> Usage {
        let st = self.inner.state.lock();
        let complete_bytes: u64 = st.index.values().map(|r| r.size).sum();
        let inflight_bytes: u64 = st
            .inflight
            .values()
            .map(|i| {
                i.progress
                    .borrow()
                    .total
                    .unwrap_or(i.progress.borrow().written)
            })
            .sum();
        Usage {
            budget_bytes: self.inner.cfg.budget_bytes,
            used_bytes: complete_bytes + inflight_bytes,
            complete_blobs: st.index.len() as u64,
            complete_bytes,
            inflight: st.inflight.len() as u64,
            inflight_bytes,
            pinned_manifests: st.pins.len() as u64,
            evictions: st.evictions,
            evicted_bytes: st.evicted_bytes,
            free_disk_bytes: available_space(&self.inner.cfg.root).unwrap_or(0),
        }
    }
}

/// Bytes an unprivileged writer may still use on the filesystem holding `path`.
pub fn available_space(path: &std::path::Path) -> std::io::Result<u64> {
    let st = rustix::fs::statvfs(path)?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}
