//! The single writer of one blob: sequential (registry stream) or piece by piece (P2P).

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use swarm::{Bitfield, PieceLayout};

use crate::inflight::{Inflight, Status};
use crate::piecewise::PieceWriter;
use crate::{meta, now_secs, BlobRecord, Error, Store};
use oci::Verifier;

/// Flush granularity: readers following a download see new bytes in steps of this size.
const FLUSH_BYTES: usize = 1 << 20;

/// The single writer of one blob. Dropping it without `finish` marks the download
/// failed (readers are told) and keeps the partial file for a later resume.
pub struct BlobWriter {
    store: Store,
    inflight: Arc<Inflight>,
    pub(crate) verifier: Verifier,
    /// Bytes `[0, written)` are on disk, contiguous and fed to the verifier.
    pub(crate) written: u64,
    buf: Vec<u8>,
    /// The previous flush, still being written on the blocking pool while the next
    /// buffer fills; its bytes count as written (and are published) once it returns.
    pending: Option<PendingWrite>,
    expected: Option<u64>,
    source: String,
    done: bool,
    /// Pieces a previous run wrote beyond the prefix; untrusted until re-verified.
    pub(crate) claimed: Option<Sidecar>,
    /// Sequential mode: the digest runs on its own thread, so hashing overlaps with
    /// receiving, writing and serving instead of adding to them. `verifier` is taken
    /// out while this runs and put back by `join_hasher`.
    hasher: Option<BackgroundHasher>,
}

struct PendingWrite {
    len: u64,
    done: tokio::task::JoinHandle<(std::io::Result<()>, Vec<u8>)>,
}

struct BackgroundHasher {
    chunks: tokio::sync::mpsc::Sender<Bytes>,
    done: tokio::task::JoinHandle<Verifier>,
}

/// Chunks queued for the hasher: bounds the memory a download holds when the hash
/// is slower than the network.
const HASH_QUEUE_CHUNKS: usize = 16;

/// `partial/<hex>.pieces`: which pieces a P2P download has written, so a restart keeps
/// them. A torn or unreadable sidecar is ignored (only the re-hashed prefix is kept).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Sidecar {
    pub layout: PieceLayout,
    pub have: Bitfield,
}

impl Sidecar {
    pub fn load(path: &Path) -> Option<Self> {
        let text = std::fs::read(path).ok()?;
        serde_json::from_slice(&text).ok()
    }

    pub fn prefix_bytes(&self) -> u64 {
        let p = self.have.prefix();
        if p == 0 {
            0
        } else {
            self.layout.range(p - 1).1
        }
    }
}

pub(crate) fn sidecar_path(partial: &Path) -> PathBuf {
    partial.with_extension("pieces")
}

impl BlobWriter {
    pub(crate) fn new(
        store: Store,
        inflight: Arc<Inflight>,
        expected: Option<u64>,
        source: &str,
    ) -> Self {
        let verifier = Verifier::new(inflight.digest.clone());
        Self {
            store,
            inflight,
            verifier,
            written: 0,
            buf: Vec::new(),
            pending: None,
            expected,
            source: source.to_owned(),
            done: false,
            claimed: None,
            hasher: None,
        }
    }

    /// Stops the background hasher (if running) and puts its verifier back.
    async fn join_hasher(&mut self) -> Result<(), Error> {
        if let Some(h) = self.hasher.take() {
            drop(h.chunks);
            self.verifier = h
                .done
                .await
                .map_err(|e| Error::Db(format!("hasher task: {e}")))?;
        }
        Ok(())
    }

    /// Switches to piece mode (P2P). Pieces inside the verified prefix count as held.
    /// Also returns pieces a previous run wrote past the prefix (from its piece map):
    /// the caller re-verifies each against its piece hash with
    /// [`PieceWriter::verify_existing`] before it counts.
    pub fn into_pieces(mut self, layout: PieceLayout) -> (PieceWriter, Vec<u32>) {
        debug_assert!(self.hasher.is_none(), "piece mode after sequential writes");
        // `PieceWriter::new` tells readers the size once the piece state is in place.
        self.expect_total(layout.blob_size);
        let claims = match self.claimed.take() {
            Some(sc) if sc.layout == layout => sc.have.iter_ones().collect(),
            _ => Vec::new(),
        };
        // The writer's verified prefix (re-hashed on resume) counts as held pieces.
        let hashed = if self.written == self.verifier.len() && self.buf.is_empty() {
            self.verifier.len()
        } else {
            0
        };
        self.done = true;
        let pw = PieceWriter::new(
            self.store.clone(),
            self.inflight.clone(),
            layout,
            hashed,
            self.source.clone(),
        );
        let held = pw.held();
        let claims = claims.into_iter().filter(|&i| !held.get(i)).collect();
        (pw, claims)
    }

    /// Where the next byte goes: resume the upstream fetch from here.
    pub fn offset(&self) -> u64 {
        self.written + self.pending.as_ref().map_or(0, |p| p.len) + self.buf.len() as u64
    }

    /// Where the bytes came from (`registry`, `peer`), recorded with the blob.
    pub fn set_source(&mut self, source: &str) {
        self.source = source.to_owned();
    }

    pub fn inflight(&self) -> Arc<Inflight> {
        self.inflight.clone()
    }

    /// The blob's size, told to readers waiting for it.
    pub fn set_total(&mut self, total: u64) {
        self.expect_total(total);
        self.inflight
            .progress
            .send_modify(|p| p.total = Some(total));
    }

    /// The blob's size, for [`Self::reserve`], not told to readers yet: a download that
    /// goes on in piece mode tells them in [`Self::into_pieces`], so a reader that sees
    /// the size also sees the piece mode ([`Inflight::layout`]).
    pub fn expect_total(&mut self, total: u64) {
        self.expected = Some(total);
    }

    pub(crate) fn publish(&self) {
        let written = self.written;
        self.inflight.progress.send_modify(|p| p.written = written);
    }

    pub async fn write(&mut self, chunk: &[u8]) -> Result<(), Error> {
        self.write_bytes(Bytes::copy_from_slice(chunk)).await
    }

    /// [`BlobWriter::write`] without copying the chunk for the hasher.
    pub async fn write_bytes(&mut self, chunk: Bytes) -> Result<(), Error> {
        if let Some(exp) = self.expected {
            if self.offset() + chunk.len() as u64 > exp {
                let actual = self.offset() + chunk.len() as u64;
                return Err(oci::Error::SizeMismatch {
                    expected: exp,
                    actual,
                }
                .into());
            }
        }
        self.buf.extend_from_slice(&chunk);
        self.hash(chunk).await?;
        if self.buf.len() >= FLUSH_BYTES {
            self.flush().await?;
        }
        Ok(())
    }

    async fn hash(&mut self, chunk: Bytes) -> Result<(), Error> {
        let h = match &mut self.hasher {
            Some(h) => h,
            None => {
                let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(HASH_QUEUE_CHUNKS);
                let mut v = std::mem::replace(
                    &mut self.verifier,
                    Verifier::new(self.inflight.digest.clone()),
                );
                let done = tokio::task::spawn_blocking(move || {
                    while let Some(c) = rx.blocking_recv() {
                        v.update(&c);
                    }
                    v
                });
                self.hasher.insert(BackgroundHasher { chunks: tx, done })
            }
        };
        if h.chunks.send(chunk).await.is_err() {
            // The hasher thread died (panicked): nothing it computed can be trusted.
            self.hasher = None;
            return Err(Error::Db("hasher stopped".into()));
        }
        Ok(())
    }

    /// Writes and publishes whatever is buffered now, so readers waiting on those
    /// bytes get them without waiting for a full buffer (a slow upstream: a small
    /// Range on a cold blob would otherwise wait for [`FLUSH_BYTES`] to arrive).
    pub async fn publish_buffered(&mut self) -> Result<(), Error> {
        self.flush().await?;
        self.settle().await.map(drop)
    }

    /// Hands the buffer to the blocking pool and returns once the previous one is on
    /// disk, so writing overlaps with receiving the next buffer.
    async fn flush(&mut self) -> Result<(), Error> {
        let spare = self.settle().await?;
        if self.buf.is_empty() {
            return Ok(());
        }
        let buf = std::mem::replace(&mut self.buf, spare);
        let inflight = self.inflight.clone();
        let pos = self.written;
        self.pending = Some(PendingWrite {
            len: buf.len() as u64,
            done: tokio::task::spawn_blocking(move || {
                let r = inflight.file.write_all_at(&buf, pos);
                if r.is_ok() {
                    inflight.note_written(buf.len() as u64);
                }
                (r, buf)
            }),
        });
        Ok(())
    }

    /// Waits for the write in flight, publishes its bytes and returns its (emptied)
    /// buffer for reuse.
    async fn settle(&mut self) -> Result<Vec<u8>, Error> {
        let Some(p) = self.pending.take() else {
            return Ok(Vec::new());
        };
        let outcome = p
            .done
            .await
            .map_err(|e| Error::Db(format!("writer task: {e}")))
            .and_then(|(res, buf)| {
                res.map(|_| buf)
                    .map_err(|e| Error::io(&self.inflight.path, e))
            });
        let mut buf = match outcome {
            Ok(buf) => buf,
            Err(e) => {
                // The bytes after the failed write cannot be placed without it: drop
                // them, so nothing (not even `Drop`) writes them at the wrong offset.
                self.buf.clear();
                return Err(e);
            }
        };
        self.written += p.len;
        buf.clear();
        self.publish();
        Ok(buf)
    }

    /// Verifies length and digest, makes the blob durable and moves it into the store.
    /// On mismatch the partial file is deleted: those bytes can never become valid.
    pub async fn finish(mut self) -> Result<u64, Error> {
        let flushed = match self.flush().await {
            Ok(()) => self.settle().await.map(drop),
            Err(e) => Err(e),
        };
        if let Err(e) = flushed {
            if e.is_disk_full() {
                // A resume needs space the disk does not have; free what we hold.
                self.abandon(&e.to_string());
            }
            return Err(e);
        }
        self.join_hasher().await?;
        let size = self.written;
        if let Some(exp) = self.expected {
            if size != exp {
                let e: Error = oci::Error::SizeMismatch {
                    expected: exp,
                    actual: size,
                }
                .into();
                self.discard(&e.to_string());
                return Err(e);
            }
        }
        let checked = self.verifier.clone().finish();
        if let Err(e) = checked.or_else(|e| identity_keyed(&self.store, &self.inflight, e)) {
            let e: Error = e.into();
            self.discard(&e.to_string());
            return Err(e);
        }
        self.done = true;
        let r = commit(&self.store, &self.inflight, size, &self.source).await;
        if let Err(e) = &r {
            fail_download(&self.store, &self.inflight, &e.to_string(), true);
        }
        r
    }

    fn discard(&mut self, reason: &str) {
        std::fs::remove_file(&self.inflight.path).ok();
        std::fs::remove_file(sidecar_path(&self.inflight.path)).ok();
        self.fail_with(reason, false);
    }

    /// Marks the download failed and deletes what it wrote: for failures where keeping
    /// the partial file costs more than a resume saves (the disk is full).
    pub fn abandon(&mut self, reason: &str) {
        if self.done {
            return;
        }
        std::fs::remove_file(&self.inflight.path).ok();
        std::fs::remove_file(sidecar_path(&self.inflight.path)).ok();
        self.buf.clear();
        self.fail_with(reason, true);
    }

    /// Marks the download failed; the partial file stays for a resume (unless it is
    /// empty: nothing to resume, and no reason to leave a file behind).
    pub fn fail(&mut self, reason: &str) {
        if !self.done
            && self.pending.is_none()
            && self.buf.is_empty()
            && self.inflight.file.metadata().is_ok_and(|m| m.len() == 0)
        {
            std::fs::remove_file(&self.inflight.path).ok();
        }
        self.fail_with(reason, true)
    }

    /// Checks that the blob (size from `set_total` or `expect_total`) fits the budget
    /// and the disk, evicting older content if needed, and allocates its blocks.
    pub fn reserve(&self) -> Result<(), Error> {
        let Some(total) = self.expected else {
            return Ok(());
        };
        let needed = total.saturating_sub(self.offset());
        self.store
            .make_room_excluding_pub(needed, Some(&self.inflight.digest))?;
        if total < self.store.inner.cfg.preallocate_from {
            return Ok(());
        }
        self.inflight.preallocate(total, needed)
    }

    fn fail_with(&mut self, reason: &str, retryable: bool) {
        if self.done {
            return;
        }
        self.done = true;
        fail_download(&self.store, &self.inflight, reason, retryable);
    }
}

/// Tells readers a download failed and forgets it as in flight.
pub(crate) fn fail_download(
    store: &Store,
    inflight: &Arc<Inflight>,
    reason: &str,
    retryable: bool,
) {
    let d = inflight.digest.clone();
    {
        let mut st = store.inner.state.lock();
        if st
            .inflight
            .get(&d)
            .is_some_and(|i| Arc::ptr_eq(i, inflight))
        {
            st.inflight.remove(&d);
        }
    }
    let reason = reason.to_owned();
    inflight
        .progress
        .send_modify(|p| p.status = Status::Failed { reason, retryable });
}

/// A download whose every byte is on disk and matched the digest: releases the last
/// byte to readers, then makes the entry durable and records it.
/// A file keyed by identity has no content digest to match: its whole-file check is
/// waived (its pieces were verified against the source's hashes).
pub(crate) fn identity_keyed(
    store: &Store,
    inflight: &Inflight,
    e: oci::Error,
) -> Result<(), oci::Error> {
    if store.is_identity_key(&inflight.digest) {
        Ok(())
    } else {
        Err(e)
    }
}

pub(crate) async fn commit(
    store: &Store,
    inflight: &Arc<Inflight>,
    size: u64,
    source: &str,
) -> Result<u64, Error> {
    // Clients following this download get their last byte now; making the entry
    // durable (fsync of the whole blob) is the cache's business, not theirs.
    inflight.progress.send_modify(|p| p.verified = true);
    let d = inflight.digest.clone();
    let file = inflight.file.clone();
    let from = inflight.path.clone();
    let to = store.blob_path(&d);
    let moved = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        file.sync_data()?;
        std::fs::rename(&from, &to)
    })
    .await
    .map_err(|e| Error::Db(format!("finish task: {e}")))?;
    if let Err(e) = moved {
        return Err(Error::io(&inflight.path, e));
    }
    std::fs::remove_file(sidecar_path(&inflight.path)).ok();
    let rec = BlobRecord {
        size,
        media_type: None,
        children: vec![],
        last_access: now_secs(),
        created: now_secs(),
        source: source.to_owned(),
        identity_keyed: store.is_identity_key(&d),
    };
    crate::blocking::may_block(|| meta::put(&store.inner.db, meta::BLOBS, &d.to_string(), &rec))?;
    {
        let mut st = store.inner.state.lock();
        st.index.insert(d.clone(), rec);
        st.inflight.remove(&d);
    }
    inflight.progress.send_modify(|p| {
        p.written = size;
        p.total = Some(size);
        p.status = Status::Complete;
    });
    Ok(size)
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        if !self.done {
            // Keep what was buffered for the resume, but only right after bytes known
            // to be on disk: behind a write still in flight (which may fail) it could
            // leave a hole that the resume would hash as content.
            if !self.buf.is_empty() && self.pending.is_none() {
                let _ = self.inflight.file.write_all_at(&self.buf, self.written);
            }
            self.fail("download abandoned");
        }
    }
}
