//! The single writer of one blob in piece mode (P2P): pieces arrive in any order,
//! from peers (received into the file by their connections, verified against their
//! piece hash, then marked held here) and from registry runs (trusted bytes streamed
//! in order). The blob's sha256 runs in order on its own thread
//! ([`crate::chain_digest`]): from a run's buffers when they are next in line, from
//! the page cache otherwise, and not at all over a piece a connection verified from
//! the hash before it. Its value at each piece boundary is the piece's hash, so a
//! registry piece is held (and published) once its bytes are on disk and the digest
//! has passed it.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use swarm::pieces::PieceHasher;
use swarm::{Bitfield, PieceHash, PieceLayout};
use tracing::warn;

use crate::chain_digest::{Feed, OrderedDigest};
use crate::inflight::{Inflight, PieceState, Status};
use crate::writer::{commit, fail_download, sidecar_path, Sidecar};
use crate::{Error, Store};

/// Registry-run bytes buffered before they are written (and published).
const RUN_FLUSH_BYTES: usize = 1 << 20;
/// The piece map is persisted at most this often (a restart keeps the pieces it lists).
const SIDECAR_EVERY: Duration = Duration::from_millis(250);

struct PendingWrite {
    start: u64,
    len: u64,
    done: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// A registry run: trusted bytes streamed in order from `pos`.
struct Run {
    /// The first byte not yet received.
    pos: u64,
    end: u64,
    buf: Vec<u8>,
    buf_start: u64,
    /// The first piece not wholly received.
    piece: u32,
    /// The first piece not wholly on disk.
    unsettled: u32,
    pending: Option<PendingWrite>,
    /// Bytes of the run on disk: `[start, settled)`.
    start: u64,
    settled: u64,
}

/// What a registry run chunk changed.
#[derive(Debug, Default)]
pub struct RunChunkOutcome {
    /// Pieces now held, with the hashes computed from the registry's bytes.
    pub held: Vec<(u32, PieceHash)>,
}

pub struct PieceWriter {
    store: Store,
    inflight: Arc<Inflight>,
    layout: PieceLayout,
    /// Pieces `[0, prefix)` are held.
    prefix: u32,
    /// Bytes handed to the digest thread, in order from 0.
    digested: u64,
    digest: OrderedDigest,
    /// Registry pieces on disk whose hash the digest has not reached yet.
    unhashed: Bitfield,
    /// Registry pieces the digest hashed before their bytes were all on disk.
    hashed_early: HashMap<u32, PieceHash>,
    /// Held pieces past the digest, verified from the hash before them when they
    /// arrived: `(before, after)`, so the digest can step over them.
    verified: HashMap<u32, (Option<PieceHash>, PieceHash)>,
    /// Registry runs going, by their first piece.
    runs: std::collections::BTreeMap<u32, Run>,
    source: String,
    done: bool,
    sidecar_written: Option<Instant>,
}

impl PieceWriter {
    /// Piece mode for a download whose first `hashed` bytes are on disk and matched
    /// the digest so far (a resumed prefix). Called by `BlobWriter::into_pieces`.
    pub(crate) fn new(
        store: Store,
        inflight: Arc<Inflight>,
        layout: PieceLayout,
        hashed: u64,
        source: String,
    ) -> Self {
        // A resumed prefix is held; the digest re-reads it from the start, which also
        // gives its pieces their hashes (rare: a sequential download resumed in piece
        // mode).
        let mut held = Bitfield::new(layout.count());
        let mut prefix = 0;
        while prefix < layout.count() && layout.range(prefix).1 <= hashed {
            held.set(prefix);
            prefix += 1;
        }
        let digest = OrderedDigest::start(layout, inflight.file.clone());
        let count = layout.count() as usize;
        *inflight.pieces.lock() = Some(PieceState {
            layout,
            receiving: Bitfield::new(layout.count()),
            hashes: vec![None; count],
            held,
        });
        inflight.progress.send_modify(|p| {
            p.total = Some(layout.blob_size);
            p.written = layout.range(prefix).0;
        });
        Self {
            store,
            inflight,
            layout,
            prefix,
            digested: 0,
            digest,
            unhashed: Bitfield::new(layout.count()),
            hashed_early: HashMap::new(),
            verified: HashMap::new(),
            runs: std::collections::BTreeMap::new(),
            source,
            done: false,
            sidecar_written: None,
        }
    }

    pub fn layout(&self) -> PieceLayout {
        self.layout
    }

    pub fn inflight(&self) -> Arc<Inflight> {
        self.inflight.clone()
    }

    /// Held pieces now.
    pub fn held(&self) -> Bitfield {
        self.inflight
            .pieces
            .lock()
            .as_ref()
            .map(|s| s.held.clone())
            .unwrap_or_else(|| Bitfield::new(self.layout.count()))
    }

    pub fn is_complete(&self) -> bool {
        self.prefix >= self.layout.count()
    }

    pub fn set_source(&mut self, source: &str) {
        self.source = source.to_owned();
    }

    /// A piece a peer connection received into the file and verified: hashed from
    /// `before` (the hash of the piece before it; `None` for the first) to `hash`.
    /// Returns `false` if it was already held.
    pub async fn mark_received(
        &mut self,
        piece: u32,
        before: Option<PieceHash>,
        hash: PieceHash,
    ) -> Result<bool, Error> {
        let new = {
            let mut g = self.inflight.pieces.lock();
            let Some(st) = g.as_mut() else {
                return Err(Error::Db("not in piece mode".into()));
            };
            st.receiving.clear(piece);
            if piece >= self.layout.count() || st.held.get(piece) {
                false
            } else {
                st.held.set(piece);
                st.hashes[piece as usize] = Some(hash);
                true
            }
        };
        if new {
            self.verified.insert(piece, (before, hash));
            let _ = self.inflight.held_events.send(piece);
            self.advance().await?;
        }
        Ok(new)
    }

    /// Reads a piece back from the file and keeps it if it hashes from `before` to
    /// `expected` (pieces a previous run left on disk). Returns whether it was kept.
    pub async fn verify_existing(
        &mut self,
        piece: u32,
        before: Option<PieceHash>,
        expected: PieceHash,
    ) -> Result<bool, Error> {
        if piece >= self.layout.count() || self.held().get(piece) {
            return Ok(false);
        }
        if self.hash_stored(piece, before).await? != Some(expected) {
            return Ok(false);
        }
        if !self.inflight.claim_piece(piece) {
            return Ok(false);
        }
        self.mark_received(piece, before, expected).await
    }

    /// Hashes piece `piece` as it is in the file, from `before`, the hash of the piece
    /// before it (a piece that arrived before that hash was known). `None` when
    /// `before` is needed and missing.
    pub async fn hash_stored(
        &self,
        piece: u32,
        before: Option<PieceHash>,
    ) -> Result<Option<PieceHash>, Error> {
        let Some(mut hasher) = PieceHasher::for_piece(self.layout, piece, before) else {
            return Ok(None);
        };
        let (a, b) = self.layout.range(piece);
        let file = self.inflight.file.clone();
        let path = self.inflight.path.clone();
        tokio::task::spawn_blocking(move || -> Result<Option<PieceHash>, Error> {
            let mut buf = vec![0u8; (b - a) as usize];
            file.read_exact_at(&mut buf, a)
                .map_err(|e| Error::io(&path, e))?;
            hasher.update(&buf);
            Ok(Some(hasher.finish()))
        })
        .await
        .map_err(|e| Error::Db(format!("reader task: {e}")))?
    }

    /// Starts a registry run over pieces `[first, end)`, named by `first`: the caller
    /// streams the registry's bytes from that piece's start with
    /// [`PieceWriter::write_run`]. Several runs may go at once (disjoint slices of a
    /// blob over several registry connections). The pieces are claimed so no peer
    /// connection writes into them meanwhile.
    pub fn start_run(&mut self, first: u32, end: u32) -> Result<u32, Error> {
        let end = end.min(self.layout.count());
        if first >= end {
            return Err(Error::Db(format!("empty registry run {first}..{end}")));
        }
        if self.runs.values().any(|r| {
            first < self.layout.piece_of(r.end.saturating_sub(1)) + 1
                && self.layout.piece_of(r.start) < end
        }) {
            return Err(Error::Db("registry runs overlap".into()));
        }
        let start = self.layout.range(first).0;
        let stop = self.layout.range(end - 1).1;
        {
            let mut g = self.inflight.pieces.lock();
            if let Some(st) = g.as_mut() {
                for i in first..end {
                    if !st.held.get(i) {
                        st.receiving.set(i);
                    }
                }
            }
        }
        self.runs.insert(
            first,
            Run {
                pos: start,
                end: stop,
                buf: Vec::with_capacity(RUN_FLUSH_BYTES),
                buf_start: start,
                piece: first,
                unsettled: first,
                pending: None,
                start,
                settled: start,
            },
        );
        Ok(first)
    }

    /// Where run `id` is (the next byte it expects), if it is still going.
    pub fn run_position(&self, id: u32) -> Option<u64> {
        self.runs.get(&id).map(|r| r.pos)
    }

    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Registry bytes for run `id`, in order. Returns the pieces that became held
    /// (their bytes on disk and hashed by the digest) with their hashes.
    pub async fn write_run(&mut self, id: u32, chunk: Bytes) -> Result<RunChunkOutcome, Error> {
        let layout = self.layout;
        let mut out = RunChunkOutcome::default();
        let (full, written) = {
            let Some(run) = self.runs.get_mut(&id) else {
                return Err(Error::Db("no such registry run".into()));
            };
            if run.pos + chunk.len() as u64 > run.end {
                return Err(oci::Error::SizeMismatch {
                    expected: run.end,
                    actual: run.pos + chunk.len() as u64,
                }
                .into());
            }
            let mut rest: &[u8] = &chunk;
            let mut head_done = false;
            while !rest.is_empty() {
                let piece_end = layout.range(run.piece).1;
                let take = ((piece_end - run.pos) as usize).min(rest.len());
                run.buf.extend_from_slice(&rest[..take]);
                run.pos += take as u64;
                rest = &rest[take..];
                if run.pos == piece_end {
                    head_done |= layout.is_small_head(run.piece);
                    run.piece += 1;
                }
            }
            // The small head piece is what every reader of the blob waits on first:
            // it is written (and so published) as soon as it is complete, not once a
            // whole flush's worth has come in behind it.
            (
                run.buf.len() >= RUN_FLUSH_BYTES || run.pos == run.end || head_done,
                run.pending.as_ref().is_some_and(|p| p.done.is_finished()),
            )
        };
        // Written pieces become held as soon as their write returns.
        if written {
            out.held.extend(self.settle_run(id).await?);
        }
        if full {
            out.held.extend(self.flush_run(id).await?);
        }
        Ok(out)
    }

    /// Writes what run `id` has buffered (the registry stream went quiet, or the run
    /// ended), returning pieces that became held.
    pub async fn flush_run(&mut self, id: u32) -> Result<Vec<(u32, PieceHash)>, Error> {
        let mut held = self.settle_run(id).await?;
        let Some(run) = self.runs.get_mut(&id) else {
            return Ok(held);
        };
        if run.buf.is_empty() {
            return Ok(held);
        }
        let bytes = Bytes::from(std::mem::replace(
            &mut run.buf,
            Vec::with_capacity(RUN_FLUSH_BYTES),
        ));
        let start = run.buf_start;
        let len = bytes.len() as u64;
        run.buf_start += len;
        let finished = run.pos == run.end;
        let inflight = self.inflight.clone();
        let for_disk = bytes.clone();
        run.pending = Some(PendingWrite {
            start,
            len,
            done: tokio::task::spawn_blocking(move || {
                inflight.file.write_all_at(&for_disk, start)?;
                inflight.note_written(len);
                Ok(())
            }),
        });
        // In order and next in line: the digest takes these bytes without a re-read.
        // The digest only ever reads what is verified or trusted: these are registry
        // bytes, and the blob's sha256 is what decides.
        if start == self.digested {
            self.digest.feed(Feed::Bytes(bytes)).await?;
            self.digested = start + len;
        }
        if finished {
            held.extend(self.settle_run(id).await?);
        }
        Ok(held)
    }

    /// Flushes every run (the registry went quiet on all of them).
    pub async fn flush_runs(&mut self) -> Result<Vec<(u32, PieceHash)>, Error> {
        let ids: Vec<u32> = self.runs.keys().copied().collect();
        let mut held = Vec::new();
        for id in ids {
            held.extend(self.flush_run(id).await?);
        }
        Ok(held)
    }

    async fn settle_run(&mut self, id: u32) -> Result<Vec<(u32, PieceHash)>, Error> {
        let Some(run) = self.runs.get_mut(&id) else {
            return Ok(Vec::new());
        };
        let Some(p) = run.pending.take() else {
            return Ok(Vec::new());
        };
        p.done
            .await
            .map_err(|e| Error::Db(format!("writer task: {e}")))?
            .map_err(|e| Error::io(&self.inflight.path, e))?;
        run.settled = p.start + p.len;
        let settled = run.settled;
        let layout = self.layout;
        let first = run.unsettled;
        while run.unsettled < layout.count() && layout.range(run.unsettled).1 <= settled {
            run.unsettled += 1;
        }
        let on_disk = first..run.unsettled;
        let finished = run.pos == run.end && run.buf.is_empty();
        let mut hashed = Vec::new();
        for i in on_disk {
            self.unhashed.set(i);
            if let Some(h) = self.hashed_early.remove(&i) {
                hashed.push((i, h));
            }
        }
        let mut held = self.take_hashes(hashed);
        self.advance().await?;
        let ready = self.digest.ready_hashes();
        held.extend(self.hold_ready(ready).await?);
        if finished {
            self.runs.remove(&id);
        }
        Ok(held)
    }

    /// Piece hashes the digest computed since the last call, waiting for at least one
    /// (cancel-safe). Hand them to [`PieceWriter::hold_hashed`].
    pub async fn next_hashes(&mut self) -> Vec<(u32, PieceHash)> {
        self.digest.next_hashes().await
    }

    /// Holds the registry pieces that `hashes` (from [`PieceWriter::next_hashes`])
    /// complete, returning them with their hashes (to publish).
    pub async fn hold_hashed(
        &mut self,
        hashes: Vec<(u32, PieceHash)>,
    ) -> Result<Vec<(u32, PieceHash)>, Error> {
        let mut held = self.hold_ready(hashes).await?;
        if !self.hashed_early.is_empty() {
            // The digest outran a run's write of those pieces. Writes already done
            // are settled now rather than at the run's next chunk, which a paced
            // registry may send only tens of milliseconds later. For the small head
            // piece, which every reader waits on first, the write under way is
            // awaited too; for other pieces the run reads on meanwhile.
            let head = self
                .hashed_early
                .keys()
                .any(|&i| self.layout.is_small_head(i));
            let writing: Vec<u32> = self
                .runs
                .iter()
                .filter(|(_, r)| {
                    r.pending
                        .as_ref()
                        .is_some_and(|p| head || p.done.is_finished())
                })
                .map(|(&id, _)| id)
                .collect();
            for id in writing {
                held.extend(self.settle_run(id).await?);
            }
        }
        Ok(held)
    }

    /// [`PieceWriter::hold_hashed`] without waiting for writes under way.
    async fn hold_ready(
        &mut self,
        hashes: Vec<(u32, PieceHash)>,
    ) -> Result<Vec<(u32, PieceHash)>, Error> {
        let held = self.take_hashes(hashes);
        if !held.is_empty() {
            self.advance().await?;
        }
        Ok(held)
    }

    /// Records hashes from the digest: a registry piece on disk becomes held; one still
    /// being written keeps its hash until it settles; a held piece without a hash (a
    /// resumed prefix) gets it. Returns what became held or gained a hash.
    fn take_hashes(&mut self, hashes: Vec<(u32, PieceHash)>) -> Vec<(u32, PieceHash)> {
        let mut out = Vec::new();
        {
            let mut g = self.inflight.pieces.lock();
            let Some(st) = g.as_mut() else {
                return out;
            };
            for (i, h) in hashes {
                if i >= self.layout.count() {
                    continue;
                }
                if self.unhashed.get(i) {
                    self.unhashed.clear(i);
                    st.receiving.clear(i);
                    st.held.set(i);
                    st.hashes[i as usize] = Some(h);
                    out.push((i, h));
                } else if !st.held.get(i) {
                    self.hashed_early.insert(i, h);
                } else if st.hashes[i as usize].is_none() {
                    st.hashes[i as usize] = Some(h);
                    out.push((i, h));
                }
            }
        }
        for &(i, _) in &out {
            let _ = self.inflight.held_events.send(i);
        }
        out
    }

    /// Ends run `id` early (its stream failed): whole pieces already received are kept,
    /// the rest of the run is released for someone else to produce.
    pub async fn abort_run(&mut self, id: u32) -> Result<Vec<(u32, PieceHash)>, Error> {
        let layout = self.layout;
        let Some(run) = self.runs.get_mut(&id) else {
            return Ok(Vec::new());
        };
        let first_unproduced = run.piece;
        let claimed_end = layout.piece_of(run.end.saturating_sub(1)) + 1;
        // Bytes of the piece cut short are dropped (those already written stay on disk,
        // unheld, and are overwritten by whoever produces the piece).
        let whole_end = layout.range(run.piece).0.max(run.buf_start);
        run.buf.truncate((whole_end - run.buf_start) as usize);
        run.pos = whole_end;
        run.end = whole_end;
        let mut held = self.flush_run(id).await?;
        held.extend(self.settle_run(id).await?);
        self.runs.remove(&id);
        self.release_unproduced(first_unproduced, claimed_end);
        Ok(held)
    }

    /// Releases run claims on pieces `[first, end)` that were not produced.
    pub fn release_unproduced(&mut self, first: u32, end: u32) {
        let mut g = self.inflight.pieces.lock();
        if let Some(st) = g.as_mut() {
            for i in first..end.min(self.layout.count()) {
                if !st.held.get(i) {
                    st.receiving.clear(i);
                }
            }
        }
    }

    /// Moves the held prefix forward, feeds the digest every piece on disk that
    /// continues what it has (stepping over pieces verified on arrival), and publishes
    /// how far readers may read: the prefix on disk, or further into a registry run
    /// that continues it (the registry's bytes, readable as they reach the disk, as on
    /// the plain mirror path; the blob's sha256 still decides at the end).
    async fn advance(&mut self) -> Result<(), Error> {
        let count = self.layout.count();
        let held = self.held();
        self.prefix = held.first_missing_from(self.prefix);
        let on_disk = |i: u32| held.get(i) || self.unhashed.get(i);
        let mut disk_prefix = self.prefix;
        while disk_prefix < count && on_disk(disk_prefix) {
            disk_prefix += 1;
        }
        let mut feeds = Vec::new();
        while self.digested < self.layout.blob_size {
            let piece = self.layout.piece_of(self.digested);
            if !on_disk(piece) {
                break;
            }
            let (a, b) = self.layout.range(piece);
            feeds.push(match self.verified.remove(&piece) {
                Some((before, after)) if self.digested == a => Feed::Verified {
                    piece,
                    before,
                    after,
                },
                _ => Feed::File {
                    offset: self.digested,
                    len: b - self.digested,
                },
            });
            self.digested = b;
        }
        for f in feeds {
            self.digest.feed(f).await?;
        }
        let prefix_bytes = if disk_prefix >= count {
            self.layout.blob_size
        } else {
            self.layout.range(disk_prefix).0
        };
        let readable = self
            .runs
            .values()
            .filter(|r| r.start <= prefix_bytes)
            .map(|r| r.settled)
            .fold(prefix_bytes, u64::max);
        self.inflight
            .progress
            .send_modify(|p| p.written = p.written.max(readable));
        self.persist_pieces(false);
        Ok(())
    }

    /// Writes the piece map so a restart keeps what is held (rate-limited).
    fn persist_pieces(&mut self, force: bool) {
        if !force
            && self
                .sidecar_written
                .is_some_and(|t| t.elapsed() < SIDECAR_EVERY)
        {
            return;
        }
        self.sidecar_written = Some(Instant::now());
        let sc = Sidecar {
            layout: self.layout,
            have: self.held(),
        };
        if let Ok(json) = serde_json::to_vec(&sc) {
            let path = sidecar_path(&self.inflight.path);
            if let Err(e) = crate::blocking::may_block(|| std::fs::write(path, json)) {
                warn!(error = %e, "cannot persist piece map; a restart will refetch pieces past the prefix");
            }
        }
    }

    /// Verifies the whole blob's digest and moves it into the store. On mismatch the
    /// partial file is deleted: those bytes can never become valid.
    pub async fn finish(mut self) -> Result<u64, Error> {
        let ids: Vec<u32> = self.runs.keys().copied().collect();
        for id in ids {
            self.flush_run(id).await?;
            self.settle_run(id).await?;
        }
        self.advance().await?;
        let digested = self.digest.finish().await?;
        let rest = self.digest.ready_hashes();
        self.take_hashes(rest);
        self.prefix = self.held().first_missing_from(self.prefix);
        if !self.is_complete() {
            return Err(Error::Db(format!(
                "finish with {} of {} pieces",
                self.prefix,
                self.layout.count()
            )));
        }
        let size = digested.len;
        if size != self.layout.blob_size {
            let e: Error = oci::Error::SizeMismatch {
                expected: self.layout.blob_size,
                actual: size,
            }
            .into();
            self.discard(&e.to_string());
            return Err(e);
        }
        let actual = oci::Digest::from_sha256(digested.sha256.0);
        let checked = if actual == self.inflight.digest {
            Ok(())
        } else {
            Err(oci::Error::DigestMismatch {
                expected: self.inflight.digest.clone(),
                actual,
            })
        };
        if let Err(e) =
            checked.or_else(|e| crate::writer::identity_keyed(&self.store, &self.inflight, e))
        {
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
        self.done = true;
        fail_download(&self.store, &self.inflight, reason, false);
    }

    /// Marks the download failed; held pieces stay on disk (with their map) for a
    /// restart or a later attempt.
    pub fn fail(&mut self, reason: &str) {
        if self.done {
            return;
        }
        self.persist_pieces(true);
        self.done = true;
        fail_download(&self.store, &self.inflight, reason, true);
    }

    /// Marks the download failed and deletes what it wrote (the disk is full, or its
    /// pieces were checked against hashes that turned out to be of bad bytes).
    pub fn abandon(&mut self, reason: &str) {
        if self.done {
            return;
        }
        std::fs::remove_file(&self.inflight.path).ok();
        std::fs::remove_file(sidecar_path(&self.inflight.path)).ok();
        self.done = true;
        fail_download(&self.store, &self.inflight, reason, true);
    }

    pub fn status(&self) -> Status {
        self.inflight.progress().status
    }
}

impl Drop for PieceWriter {
    fn drop(&mut self) {
        if !self.done {
            self.fail("download abandoned");
        }
    }
}
