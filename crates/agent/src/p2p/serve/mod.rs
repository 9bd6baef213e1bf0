//! The holder side of peer connections: a listener for other agents, which open
//! channels on blobs, get this node's bitfield and then its HAVEs as pieces complete,
//! and ask for pieces. Only verified bytes are served: pieces of a complete blob, or
//! pieces this node holds (verified against their hash, or read from the registry by
//! this node as the blob's source).
//!
//! Requests go into the agent's upload line (`swarm::upload::UploadQueue`); a
//! dispatcher hands the next one to its connection's writer (`send`), which sends it in `Data`
//! frames straight from the page cache, interleaved with control frames.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use oci::Digest;
use swarm::pieces::PieceHasher;
use swarm::upload::{Admit, Queued};
use swarm::wire::{self, ChannelId, Frame, RejectReason};
use swarm::{PieceHash, PieceLayout};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tracing::{debug, warn};

mod send;

use send::{dispatch, write_loop, PieceJob};

use super::wire_io::{
    peer_err, split_tcp, split_tls, write_frames, FrameReader, PeerRead, PeerWrite,
    HANDSHAKE_TIMEOUT,
};
use super::P2p;
use crate::metrics::ReasonLabels;
use crate::{Agent, Error};

/// How long a channel opened on a blob this node has not started yet waits for it.
const OPEN_WAIT: Duration = Duration::from_secs(60);

struct Chan {
    digest: Digest,
    /// The blob as the upload line counts it.
    blob: u64,
    layout: PieceLayout,
    task: AbortHandle,
    /// Which HAVEs the downloader asked for (its `HAVE_FILTER`), read by `watch_blob`.
    filter: tokio::sync::watch::Sender<swarm::links::HaveFilter>,
}

/// A stable number for a blob (the upload line counts sends per blob and piece).
fn blob_key(d: &Digest) -> u64 {
    let raw = super::conn::raw_digest(d);
    u64::from_le_bytes([
        raw[0], raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7],
    ])
}

/// One accepted connection, as the dispatcher sees it.
pub(crate) struct HolderConn {
    pieces: mpsc::UnboundedSender<PieceJob>,
    /// The connection's control frames, for `dispatch` to say a blob is gone.
    ctl: mpsc::Sender<Frame>,
    chans: parking_lot::Mutex<HashMap<ChannelId, Chan>>,
}

static CONN_IDS: AtomicU64 = AtomicU64::new(1);

/// Accepts peer connections until the listener fails or the task is aborted.
pub(crate) async fn serve_peers(agent: Agent, p2p: Arc<P2p>, listener: TcpListener) {
    tokio::spawn(dispatch(agent.clone(), p2p.clone()));
    loop {
        let (tcp, from) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "peer accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (agent, p2p) = (agent.clone(), p2p.clone());
        tokio::spawn(async move {
            if let Err(e) = serve_conn(agent, p2p, tcp).await {
                debug!(%from, error = %e, "peer connection ended");
            }
        });
    }
}

/// Runs the holder's side of the handshake; returns the dialer's name and the address
/// it says its own peer listener has. `certified`: under TLS, the node name of the
/// dialer's verified certificate, which its HELLO must repeat.
async fn handshake(
    p2p: &P2p,
    reader: &mut FrameReader<PeerRead>,
    w: &mut PeerWrite,
    certified: Option<&str>,
) -> Result<(String, String), Error> {
    let first = reader.next().await?;
    let Some(Frame::Hello {
        version,
        node: dialer,
        addr: dialer_addr,
        nonce: dialer_nonce,
        ..
    }) = first
    else {
        return Err(peer_err("?", "expected HELLO"));
    };
    if version != wire::PROTOCOL_VERSION {
        return Err(peer_err(&dialer, format!("protocol version {version}")));
    }
    // Under TLS the certificate says who the dialer is; a HELLO claiming another name
    // (to be handed pieces, or blamed, as someone else) ends the connection.
    if let Some(certified) = certified {
        if dialer != certified {
            p2p.metrics.peer_auth_failures.inc();
            return Err(peer_err(
                certified,
                format!("HELLO claims to be {dialer:.80}, the certificate says {certified}"),
            ));
        }
    }
    reader.set_peer(&dialer);
    let nonce: [u8; 16] = rand::random();
    let proof = p2p.proof(wire::ROLE_HOLDER, &dialer_nonce, &p2p.node);
    write_frames(
        w,
        &[Frame::Hello {
            version: wire::PROTOCOL_VERSION,
            node: p2p.node.clone(),
            addr: p2p.addr.clone(),
            nonce,
            proof,
        }],
        &dialer,
    )
    .await?;
    let Some(Frame::Auth { proof }) = reader.next().await? else {
        return Err(peer_err(&dialer, "expected AUTH"));
    };
    if !p2p.proof_ok(&proof, wire::ROLE_DIALER, &nonce, &dialer) {
        p2p.metrics.peer_auth_failures.inc();
        let _ = write_frames(
            w,
            &[Frame::Goodbye {
                reason: "wrong cluster token".into(),
            }],
            &dialer,
        )
        .await;
        return Err(peer_err(&dialer, "failed the cluster-token challenge"));
    }
    Ok((dialer, dialer_addr))
}

async fn serve_conn(agent: Agent, p2p: Arc<P2p>, tcp: TcpStream) -> Result<(), Error> {
    let (r, mut w, certified) = match &p2p.peer_tls {
        None => {
            let (r, w) = split_tcp(tcp);
            (r, w, None)
        }
        Some(tls) => {
            let refused = |reason: &'static str| {
                p2p.metrics
                    .tls_handshakes_refused
                    .get_or_create(&ReasonLabels { reason })
                    .inc();
            };
            let accepted = tokio::time::timeout(HANDSHAKE_TIMEOUT, pki::accept(&tls.acceptor, tcp))
                .await
                .map_err(|_| {
                    refused("timeout");
                    peer_err("?", "TLS handshake timed out")
                })?;
            let (stream, identity) = accepted.map_err(|e| {
                p2p.metrics.peer_auth_failures.inc();
                refused(e.reason());
                peer_err("?", format!("TLS: {e}"))
            })?;
            // peer_server_config requires a node certificate, so there is one.
            let node = identity
                .map(|id| id.name().to_owned())
                .ok_or_else(|| peer_err("?", "no client certificate"))?;
            let (r, w) = split_tls(stream);
            (r, w, Some(node))
        }
    };
    let mut reader = FrameReader::new(r, "?");
    let (dialer, dialer_addr) = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        handshake(&p2p, &mut reader, &mut w, certified.as_deref()),
    )
    .await
    .map_err(|_| peer_err("?", "handshake timed out"))??;
    let id = CONN_IDS.fetch_add(1, Ordering::Relaxed);
    let (ctl_tx, ctl_rx) = mpsc::channel::<Frame>(4096);
    let (piece_tx, piece_rx) = mpsc::unbounded_channel::<PieceJob>();
    let conn = Arc::new(HolderConn {
        pieces: piece_tx,
        ctl: ctl_tx.clone(),
        chans: parking_lot::Mutex::new(HashMap::new()),
    });
    p2p.holders.lock().insert(id, conn.clone());
    let mut writer = tokio::spawn(write_loop(p2p.clone(), w, ctl_rx, piece_rx, dialer.clone()));
    let result = tokio::select! {
        r = read_loop(
            &agent,
            &p2p,
            id,
            &conn,
            &mut reader,
            &ctl_tx,
            &dialer,
            &dialer_addr,
        ) => r,
        // A writer that gave up (a downloader that stopped reading: `SEND_STALL`)
        // ends the connection: its slot and its place in the line go to the others.
        w = &mut writer => match w {
            Ok(Err(e)) => Err(e),
            _ => Ok(()),
        },
    };
    // Gone: its waiting requests leave the line, its channels stop forwarding.
    p2p.holders.lock().remove(&id);
    p2p.uploads.lock().drop_waiting(id, None);
    for (_, c) in conn.chans.lock().drain() {
        c.task.abort();
    }
    drop(ctl_tx);
    writer.abort();
    result
}

#[allow(clippy::too_many_arguments)]
async fn read_loop(
    agent: &Agent,
    p2p: &Arc<P2p>,
    id: u64,
    conn: &Arc<HolderConn>,
    reader: &mut FrameReader<PeerRead>,
    ctl: &mpsc::Sender<Frame>,
    dialer: &str,
    dialer_addr: &str,
) -> Result<(), Error> {
    while let Some(frame) = reader.next().await? {
        match frame {
            Frame::Open {
                chan,
                digest,
                blob_size,
                piece_size,
            } => {
                let d = Digest::from_sha256(digest);
                let layout =
                    PieceLayout::checked(blob_size, piece_size).map_err(|e| peer_err(dialer, e))?;
                // A member of this blob's swarm: this node's own download of it (if
                // any) connects back now rather than at its next announce.
                p2p.discovered(&d, dialer, dialer_addr);
                if conn.chans.lock().len() >= 4096 {
                    return Err(peer_err(dialer, "too many channels"));
                }
                let (filter, filter_rx) =
                    tokio::sync::watch::channel(swarm::links::HaveFilter::ALL);
                let task = tokio::spawn(watch_blob(
                    agent.clone(),
                    p2p.clone(),
                    d.clone(),
                    layout,
                    chan,
                    ctl.clone(),
                    filter_rx,
                ))
                .abort_handle();
                if let Some(old) = conn.chans.lock().insert(
                    chan,
                    Chan {
                        blob: blob_key(&d),
                        digest: d,
                        layout,
                        task,
                        filter,
                    },
                ) {
                    old.task.abort();
                }
            }
            Frame::HaveFilter { chan, filter } => {
                p2p.metrics.have_filters_received.inc();
                if let Some(c) = conn.chans.lock().get(&chan) {
                    c.filter.send_replace(filter);
                }
            }
            Frame::Close { chan } => {
                if let Some(c) = conn.chans.lock().remove(&chan) {
                    c.task.abort();
                }
                p2p.uploads.lock().drop_waiting(id, Some(chan));
            }
            Frame::Request {
                chan,
                piece,
                urgent,
            } => {
                let known = conn
                    .chans
                    .lock()
                    .get(&chan)
                    .map(|c| (c.digest.clone(), c.layout, c.blob));
                let reason = match known {
                    None => Some(RejectReason::Invalid),
                    Some((_, layout, _)) if piece >= layout.count() => Some(RejectReason::Invalid),
                    Some((d, layout, _)) if !holds(agent, &d, layout, piece) => {
                        Some(RejectReason::NotHeld)
                    }
                    Some((_, layout, blob)) => {
                        let admit = p2p.uploads.lock().push(
                            id,
                            Queued {
                                chan,
                                blob,
                                piece,
                                urgent,
                                small_head: layout.is_small_head(piece),
                            },
                        );
                        match admit {
                            Admit::Queued => {
                                p2p.upload_ready.notify_one();
                                None
                            }
                            Admit::Busy => {
                                p2p.metrics.uploads_refused.inc();
                                Some(RejectReason::Busy)
                            }
                        }
                    }
                };
                if let Some(reason) = reason {
                    let _ = ctl
                        .send(Frame::Reject {
                            chan,
                            piece,
                            reason,
                        })
                        .await;
                }
            }
            Frame::Cancel { chan, piece } => {
                // Only a request still waiting is cancelled; one being sent goes on.
                if p2p.uploads.lock().cancel(id, chan, piece) {
                    let _ = ctl
                        .send(Frame::Reject {
                            chan,
                            piece,
                            reason: RejectReason::Cancelled,
                        })
                        .await;
                }
            }
            Frame::HashesRequest { chan } => {
                let digest = conn
                    .chans
                    .lock()
                    .get(&chan)
                    .map(|c| (c.digest.clone(), c.layout));
                if let Some((d, layout)) = digest {
                    let (agent, p2p, ctl) = (agent.clone(), p2p.clone(), ctl.clone());
                    tokio::spawn(async move {
                        send_hashes(&agent, &p2p, &d, layout, chan, &ctl).await;
                    });
                }
            }
            Frame::Ping { nonce } => {
                let _ = ctl.send(Frame::Pong { nonce }).await;
            }
            Frame::Goodbye { reason } => {
                debug!(peer = %dialer, %reason, "peer said goodbye");
                return Ok(());
            }
            other => {
                return Err(peer_err(
                    dialer,
                    format!("unexpected frame from a downloader: {other:?}"),
                ))
            }
        }
    }
    Ok(())
}

/// Whether this node can serve `piece` of the blob now.
fn holds(agent: &Agent, d: &Digest, layout: PieceLayout, piece: u32) -> bool {
    if agent
        .store
        .stat(d)
        .is_some_and(|r| r.size == layout.blob_size)
    {
        return true;
    }
    agent
        .store
        .inflight(d)
        .is_some_and(|inf| inf.has_piece(layout, piece) && inf.layout() == Some(layout))
}

/// Keeps one channel posted: the bitfield (or "complete") once this node has the
/// blob in piece mode with the same geometry, then a HAVE per piece as it completes.
async fn watch_blob(
    agent: Agent,
    p2p: Arc<P2p>,
    d: Digest,
    layout: PieceLayout,
    chan: ChannelId,
    ctl: mpsc::Sender<Frame>,
    mut filter: tokio::sync::watch::Receiver<swarm::links::HaveFilter>,
) {
    let deadline = tokio::time::Instant::now() + OPEN_WAIT;
    loop {
        if agent
            .store
            .stat(&d)
            .is_some_and(|r| r.size == layout.blob_size)
        {
            let _ = ctl.send(Frame::Complete { chan }).await;
            return;
        }
        if let Some(inf) = agent.store.inflight(&d) {
            if let Some((state, mut events)) = inf.piece_view() {
                if state.layout != layout {
                    break;
                }
                if ctl
                    .send(Frame::Bitfield {
                        chan,
                        have: state.held,
                    })
                    .await
                    .is_err()
                    || send_known_hashes(&state.hashes, chan, &ctl).await.is_err()
                {
                    return;
                }
                let mut admitted = *filter.borrow_and_update();
                loop {
                    // A new filter first: once the holder has read a HAVE_FILTER, no HAVE
                    // it excludes goes out. `resync`: the whole bitfield again, after
                    // HAVEs were missed (a lagging receiver) or held back (a wider filter).
                    let resync = tokio::select! {
                        biased;
                        changed = filter.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            let now = *filter.borrow_and_update();
                            let widened = !admitted.covers(&now);
                            admitted = now;
                            widened
                        }
                        next = events.recv() => match next {
                            Ok(piece) => {
                                if admitted.admits(piece) {
                                    let hash = inf.piece_hash(piece);
                                    if ctl.send(Frame::Have { chan, piece, hash }).await.is_err() {
                                        return;
                                    }
                                    p2p.metrics.haves_sent.inc();
                                } else {
                                    p2p.metrics.haves_filtered.inc();
                                }
                                false
                            }
                            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => true,
                            Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                        },
                    };
                    if resync {
                        let Some((state, fresh)) = inf.piece_view() else {
                            break;
                        };
                        events = fresh;
                        if ctl
                            .send(Frame::Bitfield {
                                chan,
                                have: state.held,
                            })
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                }
                // The download ended: complete, or failed.
                let done = agent
                    .store
                    .stat(&d)
                    .is_some_and(|r| r.size == layout.blob_size);
                let _ = ctl
                    .send(if done {
                        Frame::Complete { chan }
                    } else {
                        Frame::NotHeld { chan }
                    })
                    .await;
                return;
            }
        }
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = ctl.send(Frame::NotHeld { chan }).await;
}

/// Piece hashes of a complete (digest-verified) blob, for downloaders that joined a
/// swarm with no source publishing hashes.
/// After a bitfield: the hashes this holder knows from piece 0 on, in one HASHES frame.
/// A HAVE carries its piece's hash, a bitfield none; without this, a downloader that
/// opened its channel after the source had piece 0 waited for the hash through the
/// tracker (the source publishes every 100 ms, waiting pieces ask every 200 ms), and
/// its first byte with it (0.2–0.4 s at 8 × 25 MiB/s; BENCHMARKS.md, issue 11, "head
/// piece"). Downloaders take these only from the elected source, as a HAVE's hash.
async fn send_known_hashes(
    known: &[Option<PieceHash>],
    chan: ChannelId,
    ctl: &mpsc::Sender<Frame>,
) -> Result<(), mpsc::error::SendError<Frame>> {
    let hashes: Vec<PieceHash> = known
        .iter()
        .take(wire::MAX_HASHES_PER_FRAME)
        .map_while(|h| *h)
        .collect();
    if hashes.is_empty() {
        return Ok(());
    }
    ctl.send(Frame::Hashes {
        chan,
        first: 0,
        hashes,
    })
    .await
}

async fn send_hashes(
    agent: &Agent,
    p2p: &P2p,
    d: &Digest,
    layout: PieceLayout,
    chan: ChannelId,
    ctl: &mpsc::Sender<Frame>,
) {
    let key = (d.clone(), layout.piece_size);
    let cached = p2p.hash_cache.lock().get(&key).cloned();
    let list = match cached {
        Some(l) => l,
        None => {
            let Ok(Some(open)) = agent.store.open_complete(d) else {
                let _ = ctl.send(Frame::NotHeld { chan }).await;
                return;
            };
            if open.size != layout.blob_size {
                let _ = ctl.send(Frame::NotHeld { chan }).await;
                return;
            }
            let file = open.file.clone();
            let computed =
                tokio::task::spawn_blocking(move || -> std::io::Result<Vec<PieceHash>> {
                    use std::os::unix::fs::FileExt;
                    let mut out = Vec::with_capacity(layout.count() as usize);
                    let mut buf = vec![0u8; layout.piece_size as usize];
                    let mut before = None;
                    for i in 0..layout.count() {
                        let (a, b) = layout.range(i);
                        let n = (b - a) as usize;
                        file.read_exact_at(&mut buf[..n], a)?;
                        let mut h = PieceHasher::for_piece(layout, i, before)
                            .ok_or_else(|| std::io::Error::other("piece off a block boundary"))?;
                        h.update(&buf[..n]);
                        let hash = h.finish();
                        before = Some(hash);
                        out.push(hash);
                    }
                    Ok(out)
                })
                .await;
            drop(open);
            let Ok(Ok(list)) = computed else {
                let _ = ctl.send(Frame::NotHeld { chan }).await;
                return;
            };
            let list = Arc::new(list);
            let mut cache = p2p.hash_cache.lock();
            if cache.len() > 1024 {
                cache.clear();
            }
            cache.insert(key, list.clone());
            list
        }
    };
    for (n, batch) in list.chunks(wire::MAX_HASHES_PER_FRAME).enumerate() {
        let first = (n * wire::MAX_HASHES_PER_FRAME) as u32;
        if ctl
            .send(Frame::Hashes {
                chan,
                first,
                hashes: batch.to_vec(),
            })
            .await
            .is_err()
        {
            return;
        }
    }
}
