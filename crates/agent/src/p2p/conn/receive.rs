//! The reading half of a peer connection: frames from the holder become
//! [`PeerEvent`]s for the blob's download task, and DATA payloads go straight into the
//! blob's partial file (only pieces this agent asked for and could claim, hashed as
//! they arrive).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use swarm::pieces::PieceHasher;
use swarm::wire::{ChannelId, Frame};
use swarm::{Bitfield, PieceLayout};

use super::{PeerConn, PeerEvent, RecvChan};
use crate::p2p::wire_io::{peer_err, FrameReader, PeerRead};
use crate::p2p::P2p;
use crate::Error;

/// A connection with requests outstanding that has been silent this long gets a Ping.
const PING_AFTER: Duration = Duration::from_secs(1);
/// ... and is dropped if the Pong (or any frame) does not come within this long. A
/// holder that queues our requests behind others still answers at once, so only a
/// peer that stopped (hung, frozen, its host gone) is dropped.
const PONG_TIMEOUT: Duration = Duration::from_secs(2);
/// The raw bytes after a `Data` header arrive right behind it (the holder paces
/// before the header): a payload that takes longer than this is a stall.
const PAYLOAD_TIMEOUT: Duration = Duration::from_secs(5);

/// The piece being received on a connection (a holder sends one piece at a time).
struct Receiving {
    chan_id: ChannelId,
    chan: Arc<RecvChan>,
    piece: u32,
    got: u64,
    /// `None`: the hash before it was not known; the download hashes the stored piece.
    hasher: Option<PieceHasher>,
    /// False: the piece could not be claimed; its bytes are read and dropped.
    claimed: bool,
    last_progress: Instant,
}

pub(super) async fn read_loop(
    p2p: &Arc<P2p>,
    conn: &Arc<PeerConn>,
    reader: &mut FrameReader<PeerRead>,
) -> Result<(), Error> {
    let node = conn.node.clone();
    let mut cur: Option<Receiving> = None;
    let mut buf: Vec<u8> = Vec::new();
    let result = async {
        let mut last_frame = tokio::time::Instant::now();
        let mut pinged: Option<tokio::time::Instant> = None;
        loop {
            let deadline = match pinged {
                Some(at) => at + PONG_TIMEOUT,
                None => last_frame + PING_AFTER,
            };
            let frame = tokio::select! {
                f = reader.next() => match f? {
                    Some(f) => f,
                    None => break,
                },
                _ = tokio::time::sleep_until(deadline) => {
                    let waiting = conn.chans.lock().values().any(|c| !c.requested.lock().is_empty());
                    match pinged {
                        Some(_) if waiting => {
                            p2p.metrics.peers_stalled.inc();
                            return Err(peer_err(&node, "peer stopped answering with requests outstanding"));
                        }
                        Some(_) => pinged = None,
                        None if waiting => {
                            pinged = Some(tokio::time::Instant::now());
                            let _ = conn.ctl.try_send(Frame::Ping { nonce: rand::random() });
                        }
                        None => last_frame = tokio::time::Instant::now(),
                    }
                    continue;
                }
            };
            last_frame = tokio::time::Instant::now();
            pinged = None;
            let chan_of = |c: ChannelId| conn.chans.lock().get(&c).cloned();
            match frame {
                Frame::Bitfield { chan, have } => {
                    if let Some(c) = chan_of(chan) {
                        let have = (have.len() == c.layout.count()).then_some(have);
                        let _ = c
                            .events
                            .send(PeerEvent::Holds {
                                peer: node.clone(),
                                have: Some(have.unwrap_or_else(|| Bitfield::new(c.layout.count()))),
                            })
                            .await;
                    }
                }
                Frame::Complete { chan } => {
                    if let Some(c) = chan_of(chan) {
                        let _ = c
                            .events
                            .send(PeerEvent::Holds {
                                peer: node.clone(),
                                have: None,
                            })
                            .await;
                    }
                }
                Frame::NotHeld { chan } => {
                    if let Some(c) = chan_of(chan) {
                        let _ = c.events.send(PeerEvent::NotHeld { peer: node.clone() }).await;
                    }
                }
                Frame::Have { chan, piece, hash } => {
                    if let Some(c) = chan_of(chan) {
                        if piece < c.layout.count() {
                            let _ = c
                                .events
                                .send(PeerEvent::Have {
                                    peer: node.clone(),
                                    piece,
                                    hash,
                                })
                                .await;
                        }
                    }
                }
                Frame::Reject {
                    chan,
                    piece,
                    reason,
                } => {
                    if let Some(c) = chan_of(chan) {
                        c.requested.lock().remove(&piece);
                        let _ = c
                            .events
                            .send(PeerEvent::Rejected {
                                peer: node.clone(),
                                piece,
                                reason,
                            })
                            .await;
                    }
                }
                Frame::Hashes {
                    chan,
                    first,
                    hashes,
                } => {
                    if let Some(c) = chan_of(chan) {
                        let _ = c
                            .events
                            .send(PeerEvent::Hashes {
                                peer: node.clone(),
                                first,
                                hashes,
                            })
                            .await;
                    }
                }
                Frame::Data {
                    chan,
                    piece,
                    offset,
                    len,
                } => {
                    if offset == 0 {
                        conn.receiving
                            .store((((chan as u64) << 32) | piece as u64) + 1, Ordering::Release);
                    }
                    conn.last_data_ms
                        .store(conn.opened.elapsed().as_millis() as u64, Ordering::Relaxed);
                    receive_data(p2p, &node, reader, &mut cur, &mut buf, chan, chan_of(chan), piece, offset, len)
                        .await?;
                    if cur.is_none() {
                        conn.receiving.store(0, Ordering::Release);
                    }
                }
                Frame::Pong { .. } => {}
                Frame::Ping { nonce } => {
                    let _ = conn.ctl.send(Frame::Pong { nonce }).await;
                }
                Frame::Goodbye { reason } => {
                    return Err(peer_err(&node, format!("peer said goodbye: {reason:.200}")));
                }
                other => {
                    return Err(peer_err(
                        &node,
                        format!("unexpected frame from a holder: {other:?}"),
                    ))
                }
            }
        }
        Ok(())
    }
    .await;
    // A piece cut mid-way: its claim goes, so another peer can deliver it.
    if let Some(r) = cur.take() {
        if r.claimed {
            r.chan.inflight.release_piece_claim(r.piece);
        }
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn receive_data(
    p2p: &Arc<P2p>,
    node: &str,
    reader: &mut FrameReader<PeerRead>,
    cur: &mut Option<Receiving>,
    buf: &mut Vec<u8>,
    chan_id: ChannelId,
    chan: Option<Arc<RecvChan>>,
    piece: u32,
    offset: u32,
    len: u32,
) -> Result<(), Error> {
    let at = cur.as_ref().map(|r| InProgress {
        chan: r.chan_id,
        piece: r.piece,
        got: r.got,
    });
    let open = chan.as_ref().map(|c| OpenChan {
        id: chan_id,
        layout: c.layout,
        requested: c.requested.lock().contains_key(&piece),
    });
    let step = data_step(at, open, piece, offset, len).map_err(|e| peer_err(node, e))?;
    let chan = match (step, chan) {
        (DataStep::Begin, Some(chan)) => {
            let before = chan.requested.lock().get(&piece).copied().flatten();
            let claimed = chan.inflight.claim_piece(piece);
            *cur = Some(Receiving {
                chan_id,
                chan: chan.clone(),
                piece,
                got: 0,
                hasher: PieceHasher::for_piece(chan.layout, piece, before),
                claimed,
                last_progress: Instant::now(),
            });
            chan
        }
        (DataStep::Continue, Some(chan)) => chan,
        _ => {
            // A channel we closed (a blob that finished while a copy was on its way):
            // the bytes still have to be read off the stream, and the piece it cut
            // ends here, so the next piece on the connection begins cleanly.
            if let Some(prev) = cur.take() {
                if prev.claimed {
                    prev.chan.inflight.release_piece_claim(prev.piece);
                }
            }
            return reader.skip_payload(len as usize).await;
        }
    };
    let Some(r) = cur.as_mut() else {
        return Err(peer_err(node, "data continues a piece that never began"));
    };
    let piece_len = chan.layout.len(piece);
    // The small head piece is what a reader waits for first: it takes the link's
    // priority lane, as on the holder's uplink (`serve::send::send_piece`).
    match &p2p.download {
        Some(l) if chan.layout.is_small_head(piece) => l.acquire_high(len as u64).await,
        Some(l) => l.acquire(len as u64).await,
        None => {}
    }
    if let Some(l) = &chan.limit {
        l.acquire(len as u64).await;
    }
    if buf.len() < len as usize {
        buf.resize(len as usize, 0);
    }
    let bytes = &mut buf[..len as usize];
    tokio::time::timeout(PAYLOAD_TIMEOUT, reader.read_payload(bytes))
        .await
        .map_err(|_| {
            p2p.metrics.peers_stalled.inc();
            peer_err(node, "peer stopped in the middle of a piece")
        })??;
    if r.claimed {
        if let Some(h) = &mut r.hasher {
            h.update(bytes);
        }
        let at = chan.layout.range(piece).0 + offset as u64;
        let t = Instant::now();
        let written = chan.inflight.write_claimed(at, bytes);
        p2p.metrics
            .store_write_seconds
            .inc_by(t.elapsed().as_secs_f64());
        if let Err(e) = written {
            chan.inflight.release_piece_claim(piece);
            *cur = None;
            return Err(peer_err(node, format!("cannot store piece bytes: {e}")));
        }
    }
    r.got += len as u64;
    p2p.metrics.peer_bytes.inc_by(len as u64);
    if r.got < piece_len {
        if r.last_progress.elapsed() > Duration::from_millis(100) {
            r.last_progress = Instant::now();
            let _ = chan.events.try_send(PeerEvent::Progress {
                peer: node.to_owned(),
            });
        }
        return Ok(());
    }
    let Some(done) = cur.take() else {
        return Ok(());
    };
    chan.requested.lock().remove(&piece);
    let ev = if done.claimed {
        PeerEvent::Received {
            peer: node.to_owned(),
            piece,
            hash: done.hasher.as_ref().map(PieceHasher::finish),
        }
    } else {
        PeerEvent::Dropped {
            peer: node.to_owned(),
            piece,
        }
    };
    if chan.events.send(ev).await.is_err() && done.claimed {
        // The download is gone; nobody will check these bytes.
        chan.inflight.release_piece_claim(piece);
    }
    Ok(())
}

/// The piece in progress on a connection, as [`data_step`] sees it.
#[derive(Clone, Copy, Debug)]
struct InProgress {
    chan: ChannelId,
    piece: u32,
    got: u64,
}

/// The channel a DATA frame names, when this side still has it open.
#[derive(Clone, Copy, Debug)]
struct OpenChan {
    id: ChannelId,
    layout: PieceLayout,
    /// Whether the piece the frame carries was asked for on it.
    requested: bool,
}

/// What a DATA frame's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DataStep {
    /// For a channel this side closed: read off the stream and dropped. A holder sends
    /// one piece at a time, so a piece in progress is the one the close cut: it ends.
    Discard,
    /// The first bytes of a requested piece.
    Begin,
    /// The next bytes of the piece in progress.
    Continue,
}

/// Where a DATA frame (`piece`, `offset`, `len`) fits, given the piece in progress on
/// the connection (`at`) and the frame's channel (`None`: closed by this side). I/O-free,
/// so every rule a holder's bytes must follow is tested on its own; an error fails the
/// connection.
fn data_step(
    at: Option<InProgress>,
    chan: Option<OpenChan>,
    piece: u32,
    offset: u32,
    len: u32,
) -> Result<DataStep, String> {
    let Some(chan) = chan else {
        return Ok(DataStep::Discard);
    };
    if piece >= chan.layout.count() || offset as u64 + len as u64 > chan.layout.len(piece) {
        return Err(format!("data beyond piece {piece}"));
    }
    match at {
        _ if offset == 0 && at.is_some() => {
            Err("a new piece began before the last one ended".to_owned())
        }
        _ if offset == 0 && !chan.requested => Err(format!("piece {piece} was not requested")),
        _ if offset == 0 => Ok(DataStep::Begin),
        None => Err("data continues a piece that never began".to_owned()),
        Some(r) if r.chan != chan.id || r.piece != piece || r.got != offset as u64 => {
            Err("data out of order".to_owned())
        }
        Some(_) => Ok(DataStep::Continue),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn open(id: ChannelId, requested: bool) -> Option<OpenChan> {
        Some(OpenChan {
            id,
            // 4 MiB in 1 MiB pieces: a 64 KiB head, then the rest of the first MiB.
            layout: PieceLayout::new(4 * MIB, MIB),
            requested,
        })
    }

    fn at(chan: ChannelId, piece: u32, got: u64) -> Option<InProgress> {
        Some(InProgress { chan, piece, got })
    }

    #[test]
    fn bytes_for_a_closed_channel_end_the_cut_piece_and_the_next_piece_begins() {
        // Channel 1's blob finished while a copy of piece 2 was on its way, so this
        // side closed it; the holder still sends the rest of that piece, then a piece
        // on channel 2.
        let cut = at(1, 2, 64 * 1024);
        assert_eq!(
            data_step(cut, None, 2, 64 * 1024, 4096),
            Ok(DataStep::Discard)
        );
        // `receive_data` ends the piece in progress on a discard: the next piece
        // starts from nothing in progress and is welcome.
        assert_eq!(
            data_step(None, open(2, true), 3, 0, 4096),
            Ok(DataStep::Begin)
        );
        // Had the cut piece stayed in progress, the connection would have failed.
        assert!(data_step(cut, open(2, true), 3, 0, 4096).is_err());
    }

    #[test]
    fn a_holder_that_breaks_the_order_of_its_bytes_fails_the_connection() {
        let reading = at(1, 2, 4096);
        assert_eq!(
            data_step(reading, open(1, true), 2, 4096, 4096),
            Ok(DataStep::Continue)
        );
        for (what, step) in [
            ("a gap", data_step(reading, open(1, true), 2, 8192, 4096)),
            (
                "another piece",
                data_step(reading, open(1, true), 3, 4096, 4096),
            ),
            (
                "another channel",
                data_step(reading, open(2, true), 2, 4096, 4096),
            ),
            (
                "a new piece mid-way",
                data_step(reading, open(1, true), 3, 0, 4096),
            ),
            ("never began", data_step(None, open(1, true), 2, 4096, 4096)),
            ("not requested", data_step(None, open(1, false), 2, 0, 4096)),
            (
                "past the piece",
                data_step(None, open(1, true), 2, 0, (MIB + 1) as u32),
            ),
            ("past the blob", data_step(None, open(1, true), 99, 0, 1)),
            // The head piece is 64 KiB: its second piece ends at the first MiB.
            (
                "past the head",
                data_step(None, open(1, true), 0, 0, 64 * 1024 + 1),
            ),
        ] {
            assert!(step.is_err(), "{what}: {step:?}");
        }
    }
}
