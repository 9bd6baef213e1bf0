//! Blobs being downloaded: one writer per digest, any number of readers that stream
//! the bytes already on disk and wait for more (cut-through).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use futures::Stream;
use tokio::sync::watch;

use crate::Error;

/// Read size for streaming from disk: large enough that per-chunk overhead vanishes,
/// small enough that eight concurrent streams stay far below the RSS budget.
pub const READ_CHUNK: usize = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    Running,
    /// Verified and moved into the content store.
    Complete,
    /// `retryable` is false when the bytes themselves were wrong (digest or size
    /// mismatch): fetching them again from the same source cannot help.
    Failed {
        reason: String,
        retryable: bool,
    },
}

#[derive(Clone, Debug)]
pub struct Progress {
    /// Bytes durable in the partial file (readers may read up to here).
    pub written: u64,
    pub total: Option<u64>,
    pub status: Status,
    /// Every byte is on disk and matches the digest; only durability (fsync, rename,
    /// metadata) is still pending. Readers may release the final byte from here on:
    /// the client's copy is correct whether or not the cache entry commits.
    pub verified: bool,
}

/// Piece-mode bookkeeping shared by the writer, the peer connections that receive
/// pieces into the file, and the peer server that serves held pieces.
#[derive(Clone, Debug)]
pub struct PieceState {
    pub layout: swarm::PieceLayout,
    /// Verified and on disk: what peers may fetch and what is announced.
    pub held: swarm::Bitfield,
    /// Being written by one peer connection right now (unverified bytes).
    pub receiving: swarm::Bitfield,
    /// The hash of each held piece, as this node knows it.
    pub hashes: Vec<Option<swarm::PieceHash>>,
}

/// Shared state of one download.
pub struct Inflight {
    pub digest: oci::Digest,
    /// Where the download that leads it reads from (the `source` of `Store::begin`):
    /// whoever joins it takes that origin's bytes.
    pub source: String,
    pub(crate) file: Arc<File>,
    pub(crate) path: PathBuf,
    pub(crate) progress: watch::Sender<Progress>,
    /// In piece mode: which pieces are held, being received, and their hashes.
    pub(crate) pieces: parking_lot::Mutex<Option<PieceState>>,
    /// Pieces as they become held, for the peers subscribed to this blob (HAVE).
    pub(crate) held_events: tokio::sync::broadcast::Sender<u32>,
    /// The file's blocks for the whole blob are allocated ([`Inflight::preallocate`]):
    /// the disk's free space already leaves out what this download still has to write.
    pub(crate) preallocated: std::sync::atomic::AtomicBool,
    /// How much of the file's data is written but not yet pushed to the disk.
    pub(crate) disk_push: Arc<DiskPush>,
}

/// Bytes of a file written between two pushes of its data to the disk
/// ([`DiskPush::note_written`]).
pub const DISK_PUSH_EVERY: u64 = 16 << 20;

/// When a file's written data goes to the disk, ahead of its fsync: a blob's in the
/// store, and the file `starling get` writes.
///
/// Why: the kernel keeps written pages in memory up to `dirty_expire` (30 s by
/// default), so a blob fetched in 10 s was all still in memory when its commit's
/// fsync came, and that fsync wrote it out at once. The burst filled the disk's queue,
/// and on ext4 the journal commit it forced held the other agents' writes and creates
/// meanwhile (see `blocking`). Pushing each blob out as it arrives keeps every fsync
/// and journal commit small. The 8 × 25 MiB/s demo on this VM's disk went from
/// 1.16–1.25 × T* to 1.05–1.09 (13 of 14 runs), alike with the commit's fsync left
/// out altogether (BENCHMARKS.md, issue 11, forty-first session).
#[derive(Debug, Default)]
pub struct DiskPush {
    unpushed: std::sync::atomic::AtomicU64,
    pushing: std::sync::atomic::AtomicBool,
}

impl DiskPush {
    /// Counts `len` bytes written; whether a push should start now: past
    /// [`DISK_PUSH_EVERY`] bytes since the last one began, and none under way (a disk
    /// slower than the writes gets one push at a time per blob, not a pile of them).
    fn written(&self, len: u64) -> bool {
        use std::sync::atomic::Ordering;
        if self.unpushed.fetch_add(len, Ordering::Relaxed) + len < DISK_PUSH_EVERY
            || self.pushing.swap(true, Ordering::AcqRel)
        {
            return false;
        }
        self.unpushed.store(0, Ordering::Relaxed);
        true
    }

    fn pushed(&self) {
        self.pushing
            .store(false, std::sync::atomic::Ordering::Release);
    }

    /// Counts `len` bytes written to `file` and, every [`DISK_PUSH_EVERY`] bytes,
    /// pushes its data to the disk (`sync_data`) on the blocking pool. The writer's
    /// own fsync at the end still makes the file durable; this only leaves it less
    /// to do.
    pub fn note_written(self: &Arc<Self>, file: &Arc<File>, len: u64) {
        if !self.written(len) {
            return;
        }
        let (me, file) = (self.clone(), file.clone());
        let push = move || {
            if let Err(e) = file.sync_data() {
                tracing::debug!(error = %e, "cannot push written data to the disk ahead of its fsync");
            }
            me.pushed();
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(push);
            }
            Err(_) => push(),
        }
    }
}

impl Inflight {
    /// Counts `len` bytes written to the blob's file ([`DiskPush`]).
    pub(crate) fn note_written(&self, len: u64) {
        self.disk_push.note_written(&self.file, len);
    }

    /// Allocates the blocks of the whole blob (`total` bytes) now, the file's length
    /// unchanged (so a resume still reads how far it got from the length or the piece
    /// map). Why: ext4 then does not reserve and map blocks page by page as the bytes
    /// are written (delayed allocation): 1 GiB of 1 MiB writes cost the writer 0.21
    /// CPU-s instead of 0.36, and the machine, writeback included, 0.31 instead of 0.45
    /// (BENCHMARKS.md, issue 11, twenty-first session); a blob that cannot fit also
    /// fails here, before its first byte, rather than in the middle. A filesystem
    /// that cannot preallocate is left to allocate as the bytes come.
    pub(crate) fn preallocate(&self, total: u64, needed: u64) -> Result<(), Error> {
        use rustix::fs::{fallocate, FallocateFlags};
        let done = crate::blocking::may_block(|| {
            fallocate(&*self.file, FallocateFlags::KEEP_SIZE, 0, total)
        });
        match done {
            Ok(()) => {
                self.preallocated
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            Err(rustix::io::Errno::NOSPC) => {
                let dir = self.path.parent().unwrap_or(&self.path);
                Err(Error::DiskFull {
                    needed,
                    free: crate::space::available_space(dir).unwrap_or(0),
                })
            }
            Err(_) => Ok(()),
        }
    }

    pub fn progress(&self) -> Progress {
        self.progress.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Progress> {
        self.progress.subscribe()
    }

    /// Whether piece `i` of `layout` is on disk (a sequential download counts the
    /// pieces wholly inside its flushed prefix).
    pub fn has_piece(&self, layout: swarm::PieceLayout, i: u32) -> bool {
        if let Some(st) = &*self.pieces.lock() {
            if st.layout.piece_size == layout.piece_size {
                return st.held.get(i);
            }
        }
        let p = self.progress.borrow();
        if i >= layout.count() || p.total.is_some_and(|t| t != layout.blob_size) {
            return false;
        }
        p.written >= layout.range(i).1
    }

    /// Where bytes known to be on disk (a held piece) are, whatever the prefix.
    pub fn span(&self, start: u64, len: usize) -> FileSpan {
        FileSpan {
            file: self.file.clone(),
            path: self.path.clone(),
            offset: start,
            len,
        }
    }

    /// Reads bytes that are known to be on disk (a held piece), whatever the prefix.
    pub async fn read_at(&self, start: u64, len: usize) -> Result<Bytes, Error> {
        let file = self.file.clone();
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            read_exact_at(&file, start, len).map_err(|e| Error::io(&path, e))
        })
        .await
        .map_err(|e| Error::Db(format!("reader task: {e}")))?
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// In piece mode: the layout, the held pieces and their hashes, plus a
    /// subscription to pieces held from now on (subscribed first, so nothing is
    /// missed between the snapshot and the first event).
    pub fn piece_view(&self) -> Option<(PieceState, tokio::sync::broadcast::Receiver<u32>)> {
        let rx = self.held_events.subscribe();
        let st = self.pieces.lock().clone()?;
        Some((st, rx))
    }

    pub fn piece_hash(&self, i: u32) -> Option<swarm::PieceHash> {
        self.pieces
            .lock()
            .as_ref()
            .and_then(|st| st.hashes.get(i as usize).copied().flatten())
    }

    pub fn layout(&self) -> Option<swarm::PieceLayout> {
        self.pieces.lock().as_ref().map(|st| st.layout)
    }

    /// A peer connection starts receiving piece `i` into the file: granted only if the
    /// piece is neither held nor being received by another connection, so unverified
    /// bytes never land on a held piece.
    pub fn claim_piece(&self, i: u32) -> bool {
        let mut g = self.pieces.lock();
        match g.as_mut() {
            Some(st) if i < st.layout.count() && !st.held.get(i) && !st.receiving.get(i) => {
                st.receiving.set(i);
                true
            }
            _ => false,
        }
    }

    /// Whether some connection (or a registry run) is writing piece `i` right now.
    pub fn is_receiving(&self, i: u32) -> bool {
        self.pieces
            .lock()
            .as_ref()
            .is_some_and(|st| st.receiving.get(i))
    }

    /// The claimer gives a piece up (its bytes failed, or the connection died).
    pub fn release_piece_claim(&self, i: u32) {
        if let Some(st) = self.pieces.lock().as_mut() {
            st.receiving.clear(i);
        }
    }

    /// Writes received bytes of a claimed piece (the caller holds the claim).
    pub fn write_claimed(&self, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(bytes, offset)
            .map_err(|e| Error::io(&self.path, e))?;
        self.note_written(bytes.len() as u64);
        Ok(())
    }
}

/// A stretch of a blob file whose bytes are on disk and may be served: `len` bytes at
/// `offset`. Holds the file open, so the bytes stay readable even if the file is
/// renamed into the store or unlinked by GC meanwhile.
#[derive(Clone, Debug)]
pub struct FileSpan {
    pub file: Arc<File>,
    pub path: PathBuf,
    pub offset: u64,
    pub len: usize,
}

impl FileSpan {
    /// Reads the span into memory (on the blocking pool).
    pub async fn read(self) -> Result<Bytes, Error> {
        let FileSpan {
            file,
            path,
            offset,
            len,
        } = self;
        tokio::task::spawn_blocking(move || {
            read_exact_at(&file, offset, len).map_err(|e| Error::io(&path, e))
        })
        .await
        .unwrap_or_else(|e| Err(Error::Db(format!("reader task: {e}"))))
    }
}

/// Streams `[start, end)` of a blob that is being written. `end = None` means to the end
/// of the blob (known once the writer learns the total). Yields an error if the writer
/// fails before the range is covered; the caller decides where to get the rest.
pub fn read_inflight(
    inflight: Arc<Inflight>,
    start: u64,
    end: Option<u64>,
) -> impl Stream<Item = Result<Bytes, Error>> + Send {
    use futures::StreamExt;
    inflight_spans(inflight, start, end, READ_CHUNK).then(|span| async move {
        match span {
            Ok(span) => span.read().await,
            Err(e) => Err(e),
        }
    })
}

/// Like [`read_inflight`], but yields where the bytes are instead of the bytes, each
/// span at most `max_len` long, as soon as they are on disk (cut-through), so the
/// caller can send them without reading them (`sendfile`).
pub fn inflight_spans(
    inflight: Arc<Inflight>,
    start: u64,
    end: Option<u64>,
    max_len: usize,
) -> impl Stream<Item = Result<FileSpan, Error>> + Send {
    let rx = inflight.subscribe();
    let max_len = max_len.max(1);
    futures::stream::unfold(
        (inflight, rx, start, false),
        move |(inf, mut rx, pos, done)| async move {
            if done {
                return None;
            }
            loop {
                let p = rx.borrow_and_update().clone();
                let limit = match (end, p.total) {
                    (Some(e), Some(t)) => Some(e.min(t)),
                    (Some(e), None) => Some(e),
                    (None, t) => t,
                };
                if limit.is_some_and(|l| pos >= l) {
                    return None;
                }
                if let Status::Failed {
                    reason,
                    retryable: false,
                } = &p.status
                {
                    let err = Error::DownloadFailed {
                        digest: inf.digest.to_string(),
                        reason: reason.clone(),
                        retryable: false,
                    };
                    return Some((Err(err), (inf, rx, pos, true)));
                }
                let mut available = p.written.min(limit.unwrap_or(u64::MAX));
                // The last bytes of a blob are held back until the whole blob is verified:
                // a client never sees a clean end of content that fails its digest.
                if p.status != Status::Complete
                    && !p.verified
                    && p.total.is_some_and(|t| available >= t)
                {
                    available = available.saturating_sub(1);
                }
                if available > pos {
                    let len = ((available - pos) as usize).min(max_len);
                    let span = FileSpan {
                        file: inf.file.clone(),
                        path: inf.path.clone(),
                        offset: pos,
                        len,
                    };
                    return Some((Ok(span), (inf, rx, pos + len as u64, false)));
                }
                match &p.status {
                    Status::Failed { reason, retryable } => {
                        let err = Error::DownloadFailed {
                            digest: inf.digest.to_string(),
                            reason: reason.clone(),
                            retryable: *retryable,
                        };
                        return Some((Err(err), (inf, rx, pos, true)));
                    }
                    Status::Complete if limit.is_none() => return None,
                    Status::Complete if p.written <= pos => return None,
                    _ => {}
                }
                if rx.changed().await.is_err() {
                    let err = Error::DownloadFailed {
                        digest: inf.digest.to_string(),
                        reason: "writer vanished".into(),
                        retryable: true,
                    };
                    return Some((Err(err), (inf, rx, pos, true)));
                }
            }
        },
    )
}

/// Reads exactly `len` bytes at `pos` (blocking; run it on the blocking pool).
pub fn read_exact_at_pub(file: &File, pos: u64, len: usize) -> std::io::Result<Bytes> {
    read_exact_at(file, pos, len)
}

pub(crate) fn read_exact_at(file: &File, pos: u64, len: usize) -> std::io::Result<Bytes> {
    let mut buf = vec![0u8; len];
    let mut filled = 0;
    while filled < len {
        let n = file.read_at(&mut buf[filled..], pos + filled as u64)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "blob file shorter than recorded",
            ));
        }
        filled += n;
    }
    Ok(Bytes::from(buf))
}

/// Streams `[start, end)` of a complete blob file.
pub fn read_file(
    file: Arc<File>,
    path: PathBuf,
    start: u64,
    end: u64,
) -> impl Stream<Item = Result<Bytes, Error>> + Send {
    futures::stream::unfold(start, move |pos| {
        let file = file.clone();
        let path = path.clone();
        async move {
            if pos >= end {
                return None;
            }
            let len = ((end - pos) as usize).min(READ_CHUNK);
            let r = tokio::task::spawn_blocking(move || {
                read_exact_at(&file, pos, len).map_err(|e| Error::io(&path, e))
            })
            .await
            .unwrap_or_else(|e| Err(Error::Db(format!("reader task: {e}"))));
            match r {
                Ok(b) => Some((Ok(b), pos + len as u64)),
                Err(e) => Some((Err(e), end)),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{DiskPush, DISK_PUSH_EVERY};

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_blobs_data_is_pushed_every_so_many_bytes_one_push_at_a_time() {
        let p = DiskPush::default();
        let every = DISK_PUSH_EVERY / MIB;
        let mut starts = Vec::new();
        for mib in 1..=3 * every {
            if p.written(MIB) {
                starts.push(mib);
                p.pushed();
            }
        }
        assert_eq!(starts, [every, 2 * every, 3 * every]);

        // A disk slower than the writes: while one push is under way no other starts,
        // and the next starts with the first write after it ends.
        assert!(p.written(DISK_PUSH_EVERY));
        assert!(!p.written(DISK_PUSH_EVERY), "one push at a time");
        assert!(!p.written(MIB));
        p.pushed();
        assert!(p.written(MIB), "what was written meanwhile goes next");
        p.pushed();
        assert!(!p.written(MIB));
    }
}
