//! The downloader side of peer connections: one long-lived connection per peer node,
//! shared by every blob this agent fetches from it. Each blob opens a channel; the
//! connection's reader turns the peer's frames into [`PeerEvent`]s for that blob's
//! download task and writes received piece bytes straight into the blob's partial
//! file (only pieces this agent asked for and could claim, hashed as they arrive).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use store::Inflight;
use swarm::pieces::PieceHasher;
use swarm::wire::{self, ChannelId, Frame, RejectReason};
use swarm::{Bitfield, PieceHash, PieceLayout};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tracing::debug;

use super::wire_io::{
    peer_err, split_tcp, split_tls, write_frames, FrameReader, PeerRead, HANDSHAKE_TIMEOUT,
};
use super::P2p;
use crate::Error;

/// How long dialing a peer may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection with requests outstanding that has been silent this long gets a Ping.
const PING_AFTER: Duration = Duration::from_secs(1);
/// ... and is dropped if the Pong (or any frame) does not come within this long. A
/// holder that queues our requests behind others still answers at once, so only a
/// peer that stopped (hung, frozen, its host gone) is dropped.
const PONG_TIMEOUT: Duration = Duration::from_secs(2);
/// The raw bytes after a `Data` header arrive right behind it (the holder paces
/// before the header): a payload that takes longer than this is a stall.
const PAYLOAD_TIMEOUT: Duration = Duration::from_secs(5);

/// What a blob's download task hears about one peer.
#[derive(Debug)]
pub(crate) enum PeerEvent {
    /// A peer opened a channel on this blob with us: a swarm member to connect back to.
    Discovered {
        peer: String,
        addr: String,
    },
    Connected {
        peer: String,
        conn: Arc<PeerConn>,
        chan: ChannelId,
    },
    ConnectFailed {
        peer: String,
        error: String,
    },
    /// What the peer holds now; `None`: everything.
    Holds {
        peer: String,
        have: Option<Bitfield>,
    },
    NotHeld {
        peer: String,
    },
    Have {
        peer: String,
        piece: u32,
        hash: Option<PieceHash>,
    },
    /// A piece's bytes are in the file; the piece stays claimed until the download
    /// task compares the hash and keeps or releases it. `hash`: computed on arrival
    /// from the hash of the piece before, if that was known when it was requested.
    Received {
        peer: String,
        piece: u32,
        hash: Option<PieceHash>,
    },
    /// Bytes of a piece arrive (at most every 100 ms per piece): the peer is alive.
    Progress {
        peer: String,
    },
    /// The piece arrived but could not be claimed (another connection had it, or it
    /// became held meanwhile); its bytes were dropped.
    Dropped {
        peer: String,
        piece: u32,
    },
    Rejected {
        peer: String,
        piece: u32,
        reason: RejectReason,
    },
    Hashes {
        peer: String,
        first: u32,
        hashes: Vec<PieceHash>,
    },
    /// The connection is gone; every request on it is lost.
    Lost {
        peer: String,
    },
}

/// One blob on a connection.
struct RecvChan {
    inflight: Arc<Inflight>,
    layout: PieceLayout,
    /// A prewarm's rate for this blob, paid as bytes arrive.
    limit: Option<Arc<ratelimit::TokenBucket>>,
    events: mpsc::Sender<PeerEvent>,
    /// Pieces asked for, each with the hash of the piece before it when known (the
    /// hash its bytes continue from).
    requested: parking_lot::Mutex<HashMap<u32, Option<PieceHash>>>,
}

pub(crate) struct PeerConn {
    pub node: String,
    /// The piece whose bytes are arriving now, as `(chan << 32 | piece) + 1` (0: none).
    receiving: std::sync::atomic::AtomicU64,
    ctl: mpsc::Sender<Frame>,
    chans: parking_lot::Mutex<HashMap<ChannelId, Arc<RecvChan>>>,
    next_chan: AtomicU32,
    tasks: parking_lot::Mutex<Vec<AbortHandle>>,
    closed: AtomicBool,
    /// When the connection opened, and when piece bytes of any blob last arrived on
    /// it (ms since then): a holder busy sending this node other blobs is not silent.
    opened: Instant,
    last_data_ms: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for PeerConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerConn({})", self.node)
    }
}

impl PeerConn {
    /// Whether the bytes of `piece` on `chan` have started to arrive.
    pub(crate) fn is_receiving(&self, chan: ChannelId, piece: u32) -> bool {
        self.receiving.load(Ordering::Acquire) == (((chan as u64) << 32) | piece as u64) + 1
    }

    /// Piece bytes of some blob arrived on this connection within `within`.
    pub(crate) fn received_within(&self, within: Duration) -> bool {
        let last = Duration::from_millis(self.last_data_ms.load(Ordering::Relaxed));
        self.opened.elapsed().saturating_sub(last) < within
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Opens a channel on a blob; the peer's answer and HAVEs arrive on `events`.
    pub(crate) async fn open(
        &self,
        inflight: Arc<Inflight>,
        layout: PieceLayout,
        events: mpsc::Sender<PeerEvent>,
        limit: Option<Arc<ratelimit::TokenBucket>>,
    ) -> Result<ChannelId, Error> {
        let chan = self.next_chan.fetch_add(1, Ordering::Relaxed);
        let digest = raw_digest(&inflight.digest);
        self.chans.lock().insert(
            chan,
            Arc::new(RecvChan {
                inflight,
                layout,
                limit,
                events,
                requested: parking_lot::Mutex::new(HashMap::new()),
            }),
        );
        self.send(Frame::Open {
            chan,
            digest,
            blob_size: layout.blob_size,
            piece_size: layout.piece_size,
        })
        .await?;
        Ok(chan)
    }

    /// Asks for `piece`; `before` is the trusted hash of the piece before it, if known,
    /// so the bytes are verified as they arrive.
    pub(crate) async fn request(
        &self,
        chan: ChannelId,
        piece: u32,
        urgent: bool,
        before: Option<PieceHash>,
    ) -> Result<(), Error> {
        if let Some(c) = self.chans.lock().get(&chan) {
            c.requested.lock().insert(piece, before);
        }
        self.send(Frame::Request {
            chan,
            piece,
            urgent,
        })
        .await
    }

    pub(crate) async fn cancel(&self, chan: ChannelId, piece: u32) {
        let _ = self.send(Frame::Cancel { chan, piece }).await;
    }

    pub(crate) async fn set_have_filter(&self, chan: ChannelId, filter: swarm::links::HaveFilter) {
        let _ = self.send(Frame::HaveFilter { chan, filter }).await;
    }

    pub(crate) async fn ask_hashes(&self, chan: ChannelId) {
        let _ = self.send(Frame::HashesRequest { chan }).await;
    }

    pub(crate) async fn close(&self, chan: ChannelId) {
        self.chans.lock().remove(&chan);
        let _ = self.send(Frame::Close { chan }).await;
    }

    /// Drops the connection (a stalled peer): every channel hears `Lost`.
    pub(crate) fn kill(&self) {
        self.closed.store(true, Ordering::Release);
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
        let chans: Vec<Arc<RecvChan>> = self.chans.lock().drain().map(|(_, c)| c).collect();
        for c in chans {
            for (p, _) in c.requested.lock().drain() {
                // A piece cut mid-way keeps no claim: someone else may produce it.
                if !c.inflight.has_piece(c.layout, p) {
                    c.inflight.release_piece_claim(p);
                }
            }
            let _ = c.events.try_send(PeerEvent::Lost {
                peer: self.node.clone(),
            });
        }
    }

    async fn send(&self, f: Frame) -> Result<(), Error> {
        if self.is_closed() {
            return Err(peer_err(&self.node, "connection closed"));
        }
        self.ctl
            .send(f)
            .await
            .map_err(|_| peer_err(&self.node, "connection closed"))
    }
}

pub(crate) fn raw_digest(d: &oci::Digest) -> [u8; 32] {
    let mut out = [0u8; 32];
    let _ = hex::decode_to_slice(d.hex(), &mut out);
    out
}

/// Connections by peer node name.
#[derive(Default)]
pub(crate) struct PeerPool {
    conns: parking_lot::Mutex<HashMap<String, Arc<PeerConn>>>,
    /// One dial at a time per peer, so two blobs do not dial the same peer twice; dials
    /// to different peers go in parallel.
    dialing: parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl PeerPool {
    /// The live connection to `node`, dialing `addr` if there is none.
    pub(crate) async fn get(
        &self,
        p2p: &Arc<P2p>,
        node: &str,
        addr: &str,
    ) -> Result<Arc<PeerConn>, Error> {
        if let Some(c) = self.live(node) {
            return Ok(c);
        }
        let gate = self
            .dialing
            .lock()
            .entry(node.to_owned())
            .or_default()
            .clone();
        let _one = gate.lock().await;
        if let Some(c) = self.live(node) {
            return Ok(c);
        }
        let conn =
            tokio::time::timeout(DIAL_TIMEOUT + HANDSHAKE_TIMEOUT, dial(p2p, node, addr)).await;
        if self.dialing.lock().len() > 4096 {
            self.dialing.lock().retain(|_, g| Arc::strong_count(g) > 1);
        }
        let conn = conn.map_err(|_| peer_err(node, "dial timed out"))??;
        self.conns.lock().insert(node.to_owned(), conn.clone());
        Ok(conn)
    }

    fn live(&self, node: &str) -> Option<Arc<PeerConn>> {
        let mut g = self.conns.lock();
        match g.get(node) {
            Some(c) if !c.is_closed() => Some(c.clone()),
            Some(_) => {
                g.remove(node);
                None
            }
            None => None,
        }
    }
}

async fn dial(p2p: &Arc<P2p>, node: &str, addr: &str) -> Result<Arc<PeerConn>, Error> {
    let tcp = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| peer_err(node, format!("connect to {addr} timed out")))?
        .map_err(|e| peer_err(node, format!("connect to {addr}: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let (r, mut w) = match &p2p.peer_tls {
        None => split_tcp(tcp),
        // The peer must hold the certificate of the node the tracker named, whatever
        // address it answers on.
        Some(tls) => {
            let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.connector.connect(node, tcp))
                .await
                .map_err(|_| peer_err(node, "TLS handshake timed out"))?
                .map_err(|e| {
                    p2p.metrics.peer_auth_failures.inc();
                    peer_err(node, format!("TLS: {e}"))
                })?;
            split_tls(stream)
        }
    };
    let mut reader = FrameReader::new(r, node);
    let nonce: [u8; 16] = rand::random();
    write_frames(
        &mut w,
        &[Frame::Hello {
            version: wire::PROTOCOL_VERSION,
            node: p2p.node.clone(),
            addr: p2p.addr.clone(),
            nonce,
            proof: [0; 32],
        }],
        node,
    )
    .await?;
    let hello = tokio::time::timeout(HANDSHAKE_TIMEOUT, reader.next())
        .await
        .map_err(|_| peer_err(node, "handshake timed out"))??;
    let Some(Frame::Hello {
        version,
        node: holder,
        nonce: holder_nonce,
        proof,
        ..
    }) = hello
    else {
        return Err(peer_err(node, "expected HELLO"));
    };
    if version != wire::PROTOCOL_VERSION {
        return Err(peer_err(node, format!("protocol version {version}")));
    }
    // The node at this address must be the node the tracker named, and must prove it
    // holds the cluster token: a forged address gets no further than this.
    if holder != node {
        return Err(peer_err(
            node,
            format!("the agent at {addr} is {holder:.80}"),
        ));
    }
    if !p2p.proof_ok(&proof, wire::ROLE_HOLDER, &nonce, &holder) {
        p2p.metrics.peer_auth_failures.inc();
        return Err(peer_err(node, "failed the cluster-token challenge"));
    }
    let answer = p2p.proof(wire::ROLE_DIALER, &holder_nonce, &p2p.node);
    write_frames(&mut w, &[Frame::Auth { proof: answer }], node).await?;
    let (ctl_tx, mut ctl_rx) = mpsc::channel::<Frame>(4096);
    let conn = Arc::new(PeerConn {
        node: node.to_owned(),
        receiving: std::sync::atomic::AtomicU64::new(0),
        ctl: ctl_tx,
        chans: parking_lot::Mutex::new(HashMap::new()),
        next_chan: AtomicU32::new(1),
        tasks: parking_lot::Mutex::new(Vec::new()),
        closed: AtomicBool::new(false),
        opened: Instant::now(),
        last_data_ms: std::sync::atomic::AtomicU64::new(0),
    });
    let peer = node.to_owned();
    let writer = tokio::spawn(async move {
        let mut batch = Vec::new();
        while let Some(f) = ctl_rx.recv().await {
            batch.push(f);
            while let Ok(more) = ctl_rx.try_recv() {
                batch.push(more);
            }
            if write_frames(&mut w, &batch, &peer).await.is_err() {
                return;
            }
            batch.clear();
        }
    });
    let reader_task = {
        let (conn, p2p) = (conn.clone(), p2p.clone());
        tokio::spawn(async move {
            let r = read_loop(&p2p, &conn, &mut reader).await;
            if let Err(e) = &r {
                debug!(peer = %conn.node, error = %e, "peer connection failed");
            }
            conn.kill();
        })
    };
    conn.tasks
        .lock()
        .extend([writer.abort_handle(), reader_task.abort_handle()]);
    Ok(conn)
}

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

async fn read_loop(
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
    // priority lane, as on the holder's uplink (`serve::send_piece`).
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
