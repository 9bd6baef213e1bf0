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
use tokio::task::JoinHandle;

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

/// On a connection receiving at least this fast, a `Data` payload of at least
/// [`HASH_ASIDE_MIN`] is hashed on a blocking thread while the connection reads and
/// stores the next one: its bytes then use two cores, not one (receive and store here,
/// sha256 there). One core does all three at roughly 1 GB/s (an estimate from the
/// per-GiB costs profiled in BENCHMARKS.md: receive copy 0.26, sha256 0.57, page-cache
/// write 0.25 CPU-s), so a slower connection gains nothing from the hand-over and pays
/// for it in wake-ups
/// (measured: the 8 × 25 MiB/s demo 1.075 against 1.056 × T* with every large payload
/// hashed aside). Shorter payloads (a small head piece, a blob's tail) stay in place.
const HASH_ASIDE_RATE: f64 = 256.0 * (1 << 20) as f64;
const HASH_ASIDE_MIN: usize = 128 << 10;

/// A connection's receive rate, smoothed over its payloads (the time from the end of
/// one to the end of the next; one pause between pieces is one sample of many).
#[derive(Default)]
struct PayloadPace {
    last: Option<Instant>,
    bytes_per_sec: f64,
}

impl PayloadPace {
    fn observe(&mut self, len: usize, now: Instant) -> f64 {
        if let Some(last) = self.last {
            let rate = len as f64 / now.duration_since(last).as_secs_f64().max(1e-6);
            self.bytes_per_sec = if self.bytes_per_sec > 0.0 {
                0.75 * self.bytes_per_sec + 0.25 * rate
            } else {
                rate
            };
        }
        self.last = Some(now);
        self.bytes_per_sec
    }
}

/// Where a piece's running hash is.
enum PieceHash {
    /// The hash before it was not known; the download hashes the stored piece.
    Unknown,
    Here(PieceHasher),
    /// On a blocking thread with the last payload; it comes back with the buffer.
    Aside(JoinHandle<(PieceHasher, Vec<u8>)>),
}

impl PieceHash {
    /// The hasher, once it has taken every payload handed to it. The buffer of a
    /// payload hashed aside becomes `spare`.
    async fn settle(&mut self, spare: &mut Vec<u8>, node: &str) -> Result<(), Error> {
        if let PieceHash::Aside(job) = self {
            let (hasher, buf) = job
                .await
                .map_err(|e| peer_err(node, format!("hashing a piece failed: {e}")))?;
            *spare = buf;
            *self = PieceHash::Here(hasher);
        }
        Ok(())
    }

    /// Hashes the payload `buf[..len]` after every one before it, aside when `fast`
    /// and it is long: `buf` then goes with it and `spare` takes its place, so the
    /// caller reads the next payload into a buffer nobody else holds.
    async fn take(
        &mut self,
        (buf, spare): (&mut Vec<u8>, &mut Vec<u8>),
        len: usize,
        fast: bool,
        node: &str,
    ) -> Result<(), Error> {
        self.settle(spare, node).await?;
        let PieceHash::Here(mut hasher) = std::mem::replace(self, PieceHash::Unknown) else {
            return Ok(());
        };
        if fast && len >= HASH_ASIDE_MIN {
            let mut payload = std::mem::replace(buf, std::mem::take(spare));
            payload.truncate(len);
            *self = PieceHash::Aside(tokio::task::spawn_blocking(move || {
                hasher.update(&payload);
                (hasher, payload)
            }));
        } else {
            hasher.update(&buf[..len]);
            *self = PieceHash::Here(hasher);
        }
        Ok(())
    }
}

/// The piece being received on a connection (a holder sends one piece at a time).
struct Receiving {
    chan_id: ChannelId,
    chan: Arc<RecvChan>,
    piece: u32,
    got: u64,
    hash: PieceHash,
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
    let mut spare: Vec<u8> = Vec::new();
    let mut pace = PayloadPace::default();
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
                        conn.pieces_begun.fetch_add(1, Ordering::Relaxed);
                    }
                    conn.last_data_ms
                        .store(conn.opened.elapsed().as_millis() as u64, Ordering::Relaxed);
                    receive_data(p2p, &node, reader, &mut cur, (&mut buf, &mut spare, &mut pace), chan, chan_of(chan), piece, offset, len)
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
    (buf, spare, pace): (&mut Vec<u8>, &mut Vec<u8>, &mut PayloadPace),
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
            let before = chan.requested.lock().get(&piece).and_then(|a| a.before);
            let claimed = chan.inflight.claim_piece(piece);
            *cur = Some(Receiving {
                chan_id,
                chan: chan.clone(),
                piece,
                got: 0,
                hash: PieceHasher::for_piece(chan.layout, piece, before)
                    .map_or(PieceHash::Unknown, PieceHash::Here),
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
    let fast = pace.observe(len as usize, Instant::now()) >= HASH_ASIDE_RATE;
    if r.claimed {
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
        r.hash.take((buf, spare), len as usize, fast, node).await?;
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
    let Some(mut done) = cur.take() else {
        return Ok(());
    };
    if let Err(e) = done.hash.settle(spare, node).await {
        if done.claimed {
            chan.inflight.release_piece_claim(piece);
        }
        return Err(e);
    }
    chan.requested.lock().remove(&piece);
    let ev = if done.claimed {
        PeerEvent::Received {
            peer: node.to_owned(),
            piece,
            hash: match &done.hash {
                PieceHash::Here(h) => Some(h.finish()),
                _ => None,
            },
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

    #[test]
    fn only_a_connection_faster_than_the_aside_rate_hashes_aside() {
        let t0 = Instant::now();
        let chunk = 512 << 10;
        let at = |ms: f64| t0 + Duration::from_secs_f64(ms / 1e3);
        // 512 KiB every 20 ms: a 25 MiB/s link.
        let mut slow = PayloadPace::default();
        let rates: Vec<f64> = (0..20)
            .map(|k| slow.observe(chunk, at(20.0 * k as f64)))
            .collect();
        assert!(rates.iter().all(|&r| r < HASH_ASIDE_RATE), "{rates:?}");
        // Every 0.8 ms (640 MiB/s): fast from the second payload on.
        let mut fast = PayloadPace::default();
        let rates: Vec<f64> = (0..20)
            .map(|k| fast.observe(chunk, at(0.8 * k as f64)))
            .collect();
        assert!(
            rates[1..].iter().all(|&r| r >= HASH_ASIDE_RATE),
            "{rates:?}"
        );
        // A link that slows to 25 MiB/s stops handing payloads over within a few.
        let rates: Vec<f64> = (1..=10)
            .map(|k| fast.observe(chunk, at(0.8 * 19.0 + 20.0 * k as f64)))
            .collect();
        assert!(rates[5..].iter().all(|&r| r < HASH_ASIDE_RATE), "{rates:?}");
    }

    #[tokio::test]
    async fn payloads_hashed_aside_and_in_place_give_the_piece_s_hash_in_order() {
        // One 2 MiB piece in payloads long and short, each read into the buffer the
        // last hand-over left, as the read loop does: any payload hashed out of order,
        // twice, or from a buffer overwritten by the next read gives another hash.
        let layout = PieceLayout::new(4 * MIB, 2 * MIB);
        let piece = 1;
        let before = {
            let mut h = PieceHasher::for_piece(layout, 0, None).unwrap();
            h.update(&vec![7u8; layout.len(0) as usize]);
            h.finish()
        };
        let bytes: Vec<u8> = (0..layout.len(piece))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let mut whole = PieceHasher::for_piece(layout, piece, Some(before)).unwrap();
        whole.update(&bytes);

        let sizes = [512 << 10, 100 << 10, 512 << 10, HASH_ASIDE_MIN, 1];
        let rest = bytes.len() - sizes.iter().sum::<usize>();
        let mut hash =
            PieceHash::Here(PieceHasher::for_piece(layout, piece, Some(before)).unwrap());
        let (mut buf, mut spare) = (Vec::new(), Vec::new());
        let mut at = 0;
        for len in sizes.into_iter().chain([rest]) {
            if buf.len() < len {
                buf.resize(len, 0);
            }
            buf[..len].copy_from_slice(&bytes[at..at + len]);
            hash.take((&mut buf, &mut spare), len, true, "peer")
                .await
                .unwrap();
            // The next read lands in `buf` while the hash may still run.
            buf.fill(0xee);
            at += len;
        }
        hash.settle(&mut spare, "peer").await.unwrap();
        match hash {
            PieceHash::Here(h) => assert_eq!(h.finish(), whole.finish()),
            _ => panic!("the hash did not come back"),
        }
    }

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
