//! What a holder sends: the dispatcher that hands the upload line's next request
//! (`swarm::upload::UploadQueue`) to its connection's writer while slots are free, and
//! the writer, which sends each piece in `Data` chunks through the upload limit with
//! `sendfile`, control frames passing between the chunks and while a chunk waits for
//! the uplink's tokens.

use std::sync::Arc;

use swarm::wire::{ChannelId, Frame};
use tokio::sync::mpsc;
use tracing::warn;

use crate::p2p::wire_io::{
    before_send_stall, peer_err, send_file, write_frames, PeerWrite, DATA_CHUNK,
};
use crate::p2p::P2p;
use crate::{Agent, Error};

/// A piece on its way out: where its bytes are, and the upload slot it holds.
pub(crate) struct PieceJob {
    chan: ChannelId,
    piece: u32,
    file: Arc<std::fs::File>,
    offset: u64,
    len: u64,
    /// `Queued::is_reader_head`: its bytes take the uplink's priority lane
    /// (`TokenBucket::acquire_high`).
    reader_head: bool,
    _slot: UploadSlot,
}

/// An upload slot; dropping it (the piece's last byte is in the socket, or the
/// connection died) frees it for the next request in line.
pub(crate) struct UploadSlot {
    p2p: Arc<P2p>,
}

impl Drop for UploadSlot {
    fn drop(&mut self) {
        self.p2p.uploads.lock().done();
        self.p2p.metrics.uploads_active.dec();
        self.p2p.upload_ready.notify_one();
    }
}

/// Hands queued requests to their connections' writers while upload slots are free.
pub(super) async fn dispatch(agent: Agent, p2p: Arc<P2p>) {
    loop {
        p2p.upload_ready.notified().await;
        loop {
            let next = p2p.uploads.lock().next_to_send();
            let Some((conn_id, q)) = next else {
                break;
            };
            p2p.metrics.uploads_active.inc();
            let slot = UploadSlot { p2p: p2p.clone() };
            if p2p.withhold {
                continue;
            }
            let conn = p2p.holders.lock().get(&conn_id).cloned();
            let Some(conn) = conn else {
                continue;
            };
            let chan = conn
                .chans
                .lock()
                .get(&q.chan)
                .map(|c| (c.digest.clone(), c.layout));
            let Some((d, layout)) = chan else {
                continue;
            };
            if p2p
                .withhold_blob
                .as_ref()
                .is_some_and(|w| *w == d.to_string())
                && p2p.withhold_piece.is_none_or(|p| p == q.piece)
            {
                continue;
            }
            let (start, end) = layout.range(q.piece);
            let file = match agent.store.open_complete(&d) {
                Ok(Some(open)) if open.size == layout.blob_size => Some(open.file.clone()),
                _ => agent
                    .store
                    .inflight(&d)
                    .filter(|inf| inf.has_piece(layout, q.piece))
                    .map(|inf| inf.span(start, 0).file),
            };
            let Some(file) = file else {
                // Gone since it was queued (its file deleted behind the store's back,
                // or a download that failed): say so, or the downloader waits on
                // this request, and counts this node a holder, for good.
                warn!(digest = %d, piece = q.piece, "a queued piece is no longer held; telling the downloader");
                let _ = conn.ctl.try_send(Frame::NotHeld { chan: q.chan });
                if agent.store.stat(&d).is_none() && agent.store.inflight(&d).is_none() {
                    // And the tracker, which would hand this node out as a holder
                    // until its seeding announces lapse.
                    let p2p = p2p.clone();
                    tokio::spawn(async move { crate::p2p::download::leave(&p2p, &d, false).await });
                }
                continue;
            };
            let _ = conn.pieces.send(PieceJob {
                chan: q.chan,
                piece: q.piece,
                file,
                offset: start,
                len: end - start,
                reader_head: q.is_reader_head(),
                _slot: slot,
            });
        }
    }
}

/// The connection's writer: control frames as soon as they come, pieces in `Data`
/// frames with control frames between chunks.
pub(super) async fn write_loop(
    p2p: Arc<P2p>,
    mut w: PeerWrite,
    mut ctl: mpsc::Receiver<Frame>,
    mut pieces: mpsc::UnboundedReceiver<PieceJob>,
    peer: String,
) -> Result<(), Error> {
    let mut pending = Vec::new();
    loop {
        tokio::select! {
            biased;
            f = ctl.recv() => match f {
                Some(f) => {
                    pending.push(f);
                    while let Ok(more) = ctl.try_recv() {
                        pending.push(more);
                    }
                    let stalled = &p2p.metrics.readers_stalled;
                    before_send_stall(stalled, &peer, write_frames(&mut w, &pending, &peer))
                        .await?;
                    pending.clear();
                }
                None => return Ok(()),
            },
            job = pieces.recv() => match job {
                Some(job) => send_piece(&p2p, &mut w, &mut ctl, job, &peer).await?,
                None => return Ok(()),
            },
        }
    }
}

/// Waits for `wait` (the uplink's tokens for the next chunk) while writing the control
/// frames that come meanwhile. A PONG that waited behind the upload limit came too
/// late once the chunks queued there took more than the downloader's 2 s of patience
/// (a holder limited to 128 KiB/s, or 2 MiB of chunks at 1 MiB/s): every downloader
/// dropped the connection as dead, and nothing was served.
async fn write_control_while(
    w: &mut PeerWrite,
    ctl: &mut mpsc::Receiver<Frame>,
    wait: impl std::future::Future<Output = ()>,
    peer: &str,
    stalled: &prometheus_client::metrics::counter::Counter,
) -> Result<(), Error> {
    tokio::pin!(wait);
    let mut frames = Vec::new();
    loop {
        tokio::select! {
            biased;
            () = &mut wait => return Ok(()),
            f = ctl.recv() => {
                let Some(f) = f else {
                    // The connection is closing: only the wait is left.
                    wait.await;
                    return Ok(());
                };
                frames.push(f);
                while let Ok(more) = ctl.try_recv() {
                    frames.push(more);
                }
                before_send_stall(stalled, peer, write_frames(w, &frames, peer)).await?;
                frames.clear();
            }
        }
    }
}

async fn send_piece(
    p2p: &P2p,
    w: &mut PeerWrite,
    ctl: &mut mpsc::Receiver<Frame>,
    job: PieceJob,
    peer: &str,
) -> Result<(), Error> {
    let mut sent = 0u64;
    while sent < job.len {
        let n = (job.len - sent).min(DATA_CHUNK);
        // A reader's head piece does not queue behind the debt of other pieces'
        // chunks (up to one 512 KiB chunk per active upload, ≈ 80 ms at 25 MiB/s):
        // it is 1/16 of a piece, so the uplink's long-run rate hardly moves.
        let uplink = async {
            match &p2p.upload {
                Some(l) if job.reader_head => l.acquire_high(n).await,
                Some(l) => l.acquire(n).await,
                None => {}
            }
        };
        write_control_while(w, ctl, uplink, peer, &p2p.metrics.readers_stalled).await?;
        let mut frames = Vec::new();
        while let Ok(f) = ctl.try_recv() {
            frames.push(f);
        }
        frames.push(Frame::Data {
            chan: job.chan,
            piece: job.piece,
            offset: sent as u32,
            len: n as u32,
        });
        before_send_stall(
            &p2p.metrics.readers_stalled,
            peer,
            write_frames(w, &frames, peer),
        )
        .await?;
        if p2p.corrupt {
            use std::os::unix::fs::FileExt;
            let mut buf = vec![0u8; n as usize];
            job.file
                .read_exact_at(&mut buf, job.offset + sent)
                .map_err(|e| peer_err(peer, e))?;
            let mid = buf.len() / 2;
            buf[mid] ^= 0x5a;
            before_send_stall(&p2p.metrics.readers_stalled, peer, async {
                w.send(&buf).await.map_err(|e| peer_err(peer, e))
            })
            .await?;
        } else {
            before_send_stall(
                &p2p.metrics.readers_stalled,
                peer,
                send_file(w, &job.file, job.offset + sent, n, peer),
            )
            .await?;
        }
        sent += n;
        p2p.metrics.upload_bytes.inc_by(n);
    }
    Ok(())
}
