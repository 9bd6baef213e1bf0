//! The downloader side of peer connections: one long-lived connection per peer node,
//! shared by every blob this agent fetches from it. Each blob opens a channel; the
//! connection's reader turns the peer's frames into [`PeerEvent`]s for that blob's
//! download task and writes received piece bytes straight into the blob's partial
//! file (only pieces this agent asked for and could claim, hashed as they arrive).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use store::Inflight;
use swarm::wire::{self, ChannelId, Frame, RejectReason};
use swarm::{Bitfield, PieceHash, PieceLayout};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tracing::debug;

use super::wire_io::{
    peer_err, split_tcp, split_tls, write_frames, FrameReader, HANDSHAKE_TIMEOUT,
};
use super::P2p;
use crate::Error;

mod receive;
use receive::read_loop;

/// How long dialing a peer may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

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
    requested: parking_lot::Mutex<HashMap<u32, Asked>>,
}

/// One outstanding request of a channel.
#[derive(Clone, Copy)]
struct Asked {
    before: Option<PieceHash>,
    /// `PeerConn::pieces_begun` when it was sent: how many pieces the holder has
    /// sent on the connection since then is what it passed this request over for.
    pieces_begun_at: u64,
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
    /// Pieces of any blob whose bytes began to arrive on the connection.
    pieces_begun: AtomicU64,
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

    /// The most pieces of any blob the holder began to send on this connection while
    /// one request of `chan` has been waiting (0: none waits). An honest holder's line
    /// serves a request after at most `swarm::upload::REQUEST_PATIENCE` others plus
    /// the requests this node sent before it.
    pub(crate) fn most_passed_over(&self, chan: ChannelId) -> u64 {
        let Some(c) = self.chans.lock().get(&chan).cloned() else {
            return 0;
        };
        let now = self.pieces_begun.load(Ordering::Relaxed);
        let oldest = c.requested.lock().values().map(|a| a.pieces_begun_at).min();
        oldest.map_or(0, |at| now.saturating_sub(at))
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
            let pieces_begun_at = self.pieces_begun.load(Ordering::Relaxed);
            c.requested.lock().insert(
                piece,
                Asked {
                    before,
                    pieces_begun_at,
                },
            );
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
        pieces_begun: AtomicU64::new(0),
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
