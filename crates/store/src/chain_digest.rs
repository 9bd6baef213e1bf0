//! The blob's sha256 in piece mode, computed in order on a blocking thread. It reports
//! the chaining value at each piece boundary it passes: that value is the piece's hash
//! (`swarm::chain`), which is how a source learns what to publish. A piece a
//! connection already verified from the value of the piece before is stepped over
//! without reading it, when the digest reaches it in exactly that state. That is why a
//! receiving node hashes each byte once.

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use bytes::Bytes;
use swarm::chain::BlobSha256;
use swarm::{PieceHash, PieceLayout};
use tokio::sync::mpsc;

use crate::Error;

/// Feeds queued for the digest thread: bounds the memory held when the hash is slower
/// than the network.
const DIGEST_QUEUE: usize = 16;

/// The next bytes of the blob, in order.
pub(crate) enum Feed {
    Bytes(Bytes),
    /// On disk (read back through the page cache).
    File {
        offset: u64,
        len: u64,
    },
    /// The next piece, verified as `before → after` when its bytes arrived.
    Verified {
        piece: u32,
        before: Option<PieceHash>,
        after: PieceHash,
    },
}

/// What the digest saw: how many bytes, and their sha256.
pub(crate) struct Digested {
    pub(crate) len: u64,
    pub(crate) sha256: PieceHash,
}

pub(crate) struct OrderedDigest {
    tx: Option<mpsc::Sender<Feed>>,
    hashes: mpsc::UnboundedReceiver<(u32, PieceHash)>,
    done: Option<tokio::task::JoinHandle<std::io::Result<Digested>>>,
}

impl OrderedDigest {
    pub(crate) fn start(layout: PieceLayout, file: Arc<std::fs::File>) -> Self {
        let (tx, mut rx) = mpsc::channel::<Feed>(DIGEST_QUEUE);
        // At most one value per piece, and the piece count is bounded (MAX_PIECES).
        let (hash_tx, hashes) = mpsc::unbounded_channel();
        let done = tokio::task::spawn_blocking(move || {
            let mut walk = Walk {
                layout,
                chain: BlobSha256::new(),
                last: None,
                out: hash_tx,
                buf: Vec::new(),
            };
            while let Some(feed) = rx.blocking_recv() {
                match feed {
                    Feed::Bytes(b) => walk.absorb(&b),
                    Feed::File { offset, len } => walk.read(&file, offset, len)?,
                    Feed::Verified {
                        piece,
                        before,
                        after,
                    } => walk.step_over(&file, piece, before, after)?,
                }
            }
            Ok(walk.outcome())
        });
        Self {
            tx: Some(tx),
            hashes,
            done: Some(done),
        }
    }

    pub(crate) async fn feed(&mut self, f: Feed) -> Result<(), Error> {
        match &self.tx {
            Some(tx) => tx
                .send(f)
                .await
                .map_err(|_| Error::Db("digest thread stopped".into())),
            None => Err(Error::Db("digest already finished".into())),
        }
    }

    /// Piece hashes the digest computed since the last call, waiting for at least one.
    /// Cancel-safe; never returns once the digest is finished.
    pub(crate) async fn next_hashes(&mut self) -> Vec<(u32, PieceHash)> {
        let Some(first) = self.hashes.recv().await else {
            return std::future::pending().await;
        };
        let mut out = vec![first];
        out.extend(self.ready_hashes());
        out
    }

    /// Piece hashes computed and not yet taken, without waiting.
    pub(crate) fn ready_hashes(&mut self) -> Vec<(u32, PieceHash)> {
        let mut out = Vec::new();
        while let Ok(h) = self.hashes.try_recv() {
            out.push(h);
        }
        out
    }

    pub(crate) async fn finish(&mut self) -> Result<Digested, Error> {
        self.tx = None;
        let done = self
            .done
            .take()
            .ok_or_else(|| Error::Db("digest already finished".into()))?;
        done.await
            .map_err(|e| Error::Db(format!("digest task: {e}")))?
            .map_err(|e| Error::Db(format!("digest read: {e}")))
    }
}

/// The digest thread's walk through the blob.
struct Walk {
    layout: PieceLayout,
    chain: BlobSha256,
    /// The last piece was stepped over: its verified value is the blob's sha256 (and
    /// any byte fed after it lengthens the blob, so the size check fails).
    last: Option<Digested>,
    out: mpsc::UnboundedSender<(u32, PieceHash)>,
    buf: Vec<u8>,
}

impl Walk {
    fn absorb(&mut self, mut bytes: &[u8]) {
        let size = self.layout.blob_size;
        while !bytes.is_empty() {
            let at = self.chain.offset();
            if let Some(last) = &mut self.last {
                // More bytes than the blob has: counted, so the length check fails.
                last.len += bytes.len() as u64;
                return;
            }
            if at >= size {
                self.chain.update(bytes);
                return;
            }
            let piece = self.layout.piece_of(at);
            let end = self.layout.range(piece).1;
            let take = ((end - at) as usize).min(bytes.len());
            self.chain.update(&bytes[..take]);
            bytes = &bytes[take..];
            if self.chain.offset() == end {
                let hash = if end == size {
                    self.chain.finalize()
                } else {
                    // Piece sizes are powers of two of at least 64 KiB: whole blocks.
                    self.chain
                        .chaining_value()
                        .unwrap_or_else(|| self.chain.finalize())
                };
                let _ = self.out.send((piece, hash));
            }
        }
    }

    fn read(&mut self, file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = ((end - pos) as usize).min(1 << 20);
            if self.buf.len() < n {
                self.buf.resize(n, 0);
            }
            let mut buf = std::mem::take(&mut self.buf);
            let r = file.read_exact_at(&mut buf[..n], pos);
            if r.is_ok() {
                self.absorb(&buf[..n]);
            }
            self.buf = buf;
            r?;
            pos += n as u64;
        }
        Ok(())
    }

    /// A verified piece: skipped when the digest is exactly where it was verified
    /// from, read otherwise (the published values disagree with the bytes before it;
    /// the final digest check will say so).
    fn step_over(
        &mut self,
        file: &std::fs::File,
        piece: u32,
        before: Option<PieceHash>,
        after: PieceHash,
    ) -> std::io::Result<()> {
        let (start, end) = self.layout.range(piece);
        if self.chain.offset() != start || self.last.is_some() {
            return Err(std::io::Error::other(format!(
                "digest at byte {} given piece {piece} at {start}",
                self.chain.offset()
            )));
        }
        let from = match before {
            Some(h) if piece > 0 => Some(h),
            None if piece == 0 => BlobSha256::new().chaining_value(),
            _ => None,
        };
        if from.is_none() || self.chain.chaining_value() != from {
            return self.read(file, start, end - start);
        }
        let _ = self.out.send((piece, after));
        if end == self.layout.blob_size {
            self.last = Some(Digested {
                len: end,
                sha256: after,
            });
        } else {
            match BlobSha256::resume(end, after) {
                Some(c) => self.chain = c,
                None => return self.read(file, start, end - start),
            }
        }
        Ok(())
    }

    fn outcome(self) -> Digested {
        self.last.unwrap_or_else(|| Digested {
            len: self.chain.offset(),
            sha256: self.chain.finalize(),
        })
    }
}
