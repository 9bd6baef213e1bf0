//! Downloading one blob through the swarm.
//!
//! One task owns the blob's writer and a [`PieceScheduler`]. It announces to the
//! tracker every `interval_ms`, learns peers and piece hashes, asks peers for pieces
//! (verifying each against its hash before it is stored, served or announced), and,
//! when the tracker elects it source, streams runs of pieces nobody holds from the
//! registry and publishes their hashes. If the tracker is unreachable the task carries
//! on from the registry itself: a pull never fails because of Starling while the
//! registry is up.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use oci::Digest;
use sha2::{Digest as _, Sha256};
use store::{BlobWriter, Inflight};
use swarm::scheduler::SchedulerConfig;
use swarm::{AnnounceRequest, Bitfield, PieceLayout, PieceScheduler, Role};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::P2p;
use crate::Agent;

const REGISTRY: &str = "\u{0}registry";

/// How long without a tracker answer before the agent fetches from the registry itself.
const TRACKER_GRACE: Duration = Duration::from_secs(2);

pub(crate) enum Start {
    /// The swarm download runs; stream from this inflight.
    Started(Arc<Inflight>, u64),
    /// Not a swarm blob (small, or no tracker): use the plain registry path.
    Fallback(BlobWriter),
    Failed(oci::Error),
    /// The store cannot take the blob: stream it without caching.
    Passthrough(u64),
}

enum Event {
    Piece {
        piece: u32,
        from: String,
        data: Result<Bytes, String>,
    },
    /// A registry run ended; pieces in `undelivered` were claimed but not produced.
    RegistryEnded {
        undelivered: Vec<u32>,
        error: Option<String>,
    },
}

fn sha_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

pub(crate) async fn start(
    agent: Agent,
    p2p: Arc<P2p>,
    registry: String,
    repo: String,
    d: Digest,
    mut writer: BlobWriter,
) -> Start {
    let mut req = base_request(&p2p, &d);
    let mut resp = match p2p.announce(&req).await {
        Ok(r) => r,
        Err(e) => {
            p2p.metrics.tracker_errors.inc();
            warn!(digest = %d, error = %e, "tracker unreachable; fetching from the registry directly");
            return Start::Fallback(writer);
        }
    };
    // Peers may have to wait a moment for the source to learn the size.
    let deadline = Instant::now() + Duration::from_secs(10);
    while resp.role == Role::Peer && resp.size.is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        match p2p.announce(&req).await {
            Ok(r) => resp = r,
            Err(_) => return Start::Fallback(writer),
        }
    }
    let mut first_stream = None;
    let size = match (resp.role, resp.size) {
        (Role::Direct, _) => return Start::Fallback(writer),
        (_, Some(s)) => s,
        (Role::Source, None) if writer.offset() == 0 => {
            // The source learns the size from the registry's answer and keeps that stream.
            match agent.upstream.get_blob(&registry, &repo, &d, 0).await {
                Ok(r) => match r.total {
                    Some(t) => {
                        first_stream = Some(r.stream);
                        t
                    }
                    None => return Start::Fallback(writer),
                },
                Err(e) => {
                    writer.fail(&e.to_string());
                    return Start::Failed(e);
                }
            }
        }
        _ => match agent.upstream.head_blob(&registry, &repo, &d).await {
            Ok(s) => s,
            Err(e) => {
                writer.fail(&e.to_string());
                return Start::Failed(e);
            }
        },
    };
    if size < p2p.threshold && resp.role != Role::Source {
        return Start::Fallback(writer);
    }
    let layout = PieceLayout::new(
        size,
        if resp.piece_size > 1 {
            resp.piece_size
        } else {
            swarm::pieces::piece_size_for(size, p2p.piece_size)
        },
    );
    writer.set_total(size);
    if let Err(e) = writer.reserve() {
        warn!(digest = %d, error = %e, "cannot cache blob; streaming it without caching");
        writer.fail(&e.to_string());
        return Start::Passthrough(size);
    }
    let claims = writer.enable_pieces(layout);
    req.size = Some(size);
    req.piece_size = Some(layout.piece_size);
    let inflight = writer.inflight();
    let sched = PieceScheduler::new(
        writer
            .pieces()
            .cloned()
            .unwrap_or_else(|| Bitfield::new(layout.count())),
        SchedulerConfig {
            seed: swarm::scheduler::seed_for(&p2p.node),
            ..Default::default()
        },
    );
    let mut dl = Download {
        agent,
        p2p,
        registry,
        repo,
        d,
        writer,
        layout,
        sched,
        hashes: BTreeMap::new(),
        new_hashes: BTreeMap::new(),
        bad: Vec::new(),
        role: Role::Peer,
        peers: HashMap::new(),
        registry_running: false,
        last_tracker_ok: Instant::now(),
        pending: HashMap::new(),
        claims,
        started: Instant::now(),
        peer_bytes: 0,
        registry_bytes: 0,
        interval_ms: resp.interval_ms,
        complete_peers: Vec::new(),
        last_hash_fetch: None,
        wait_for_upload_slots: false,
    };
    dl.absorb(resp);
    tokio::spawn(dl.run(first_stream));
    Start::Started(inflight, size)
}

fn base_request(p2p: &P2p, d: &Digest) -> AnnounceRequest {
    AnnounceRequest {
        node: p2p.node.clone(),
        addr: p2p.addr.clone(),
        topology: p2p.topology.clone(),
        digest: d.clone(),
        size: None,
        piece_size: None,
        have: None,
        complete: false,
        fetching_from_registry: false,
        hashes: BTreeMap::new(),
        known_hashes: 0,
        bad_peers: vec![],
        leaving: false,
    }
}

async fn leave(p2p: &P2p, d: &Digest) {
    let mut req = base_request(p2p, d);
    req.leaving = true;
    let _ = p2p.announce(&req).await;
}

struct Download {
    agent: Agent,
    p2p: Arc<P2p>,
    registry: String,
    repo: String,
    d: Digest,
    writer: BlobWriter,
    layout: PieceLayout,
    sched: PieceScheduler,
    hashes: BTreeMap<u32, String>,
    new_hashes: BTreeMap<u32, String>,
    bad: Vec<String>,
    role: Role,
    /// node → address
    peers: HashMap<String, String>,
    registry_running: bool,
    last_tracker_ok: Instant,
    /// Pieces received before their hash was known.
    pending: HashMap<u32, (String, Bytes)>,
    /// Pieces on disk from before a restart, to re-verify once hashes are known.
    claims: Vec<u32>,
    started: Instant,
    peer_bytes: u64,
    registry_bytes: u64,
    interval_ms: u64,
    /// Addresses of peers holding the whole (verified) blob.
    complete_peers: Vec<String>,
    last_hash_fetch: Option<Instant>,
    /// The tracker's advice: ask holders to keep requests in line (large swarms).
    wait_for_upload_slots: bool,
}

impl Download {
    fn known_prefix(&self) -> u32 {
        (0..self.layout.count())
            .find(|i| !self.hashes.contains_key(i))
            .unwrap_or(self.layout.count())
    }

    fn request(&mut self) -> AnnounceRequest {
        let mut r = base_request(&self.p2p, &self.d);
        r.size = Some(self.layout.blob_size);
        r.piece_size = Some(self.layout.piece_size);
        r.have = Some(self.sched.have().clone());
        r.fetching_from_registry = self.registry_running;
        r.hashes = self.new_hashes.clone();
        r.known_hashes = self.known_prefix();
        r.bad_peers = self.bad.clone();
        r
    }

    fn absorb(&mut self, resp: swarm::AnnounceResponse) {
        self.wait_for_upload_slots = resp.wait_for_upload_slots;
        if resp.role == Role::Source && self.role != Role::Source {
            info!(digest = %self.d, "elected to fetch from the registry");
            self.p2p.metrics.source_roles.inc();
        }
        self.role = resp.role;
        for (i, h) in resp.hashes {
            self.hashes.entry(i).or_insert(h);
        }
        self.p2p.metrics.swarm_peers.set(resp.peers.len() as i64);
        let mut seen = Vec::new();
        self.complete_peers = resp
            .peers
            .iter()
            .filter(|p| p.have.is_none())
            .map(|p| p.addr.clone())
            .collect();
        for p in resp.peers {
            let distance = self.p2p.topology.distance(&p.topology);
            seen.push(p.node.clone());
            self.peers.insert(p.node.clone(), p.addr.clone());
            self.sched.set_peer(&p.node, p.have, distance);
        }
        let gone: Vec<String> = self
            .peers
            .keys()
            .filter(|n| !seen.contains(n))
            .cloned()
            .collect();
        for n in gone {
            self.peers.remove(&n);
            self.sched.remove_peer(&n);
        }
    }

    async fn announce(&mut self) {
        let req = self.request();
        match self.p2p.announce(&req).await {
            Ok(resp) => {
                self.last_tracker_ok = Instant::now();
                self.new_hashes.clear();
                self.bad.clear();
                self.absorb(resp);
            }
            Err(e) => {
                self.p2p.metrics.tracker_errors.inc();
                debug!(digest = %self.d, error = %e, "announce failed");
            }
        }
    }

    async fn run(mut self, first_stream: Option<oci::upstream::ByteStream>) {
        let (tx, mut rx) = mpsc::channel::<Event>(8);
        if let Some(stream) = first_stream {
            self.start_registry_run(0, self.layout.count(), Some(stream), &tx);
        }
        let mut tick =
            tokio::time::interval(Duration::from_millis(self.interval_ms.clamp(20, 5_000)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.verify_claims().await;
            self.settle_pending().await;
            if self.sched.is_complete() {
                break;
            }
            // Without a tracker for a while: act as our own source.
            let tracker_lost = self.last_tracker_ok.elapsed() > TRACKER_GRACE;
            if (self.role == Role::Source || tracker_lost) && !self.registry_running {
                if let Some((a, b)) = self.next_registry_run() {
                    self.start_registry_run(a, b, None, &tx);
                }
            }
            let requests = self.sched.next_requests();
            // The read head: the first missing piece (a scan of the bitfield, once).
            let head = self.sched.have().prefix();
            for r in requests {
                let Some(addr) = self.peers.get(&r.peer).cloned() else {
                    self.sched.on_failed(r.piece, &r.peer, false);
                    continue;
                };
                let (p2p, d, tx, ps, wait) = (
                    self.p2p.clone(),
                    self.d.clone(),
                    tx.clone(),
                    self.layout.piece_size,
                    self.wait_for_upload_slots,
                );
                let lane = if r.piece == head {
                    p2p.head_requests.clone()
                } else {
                    p2p.requests.clone()
                };
                tokio::spawn(async move {
                    let _slot = lane.acquire_owned().await;
                    let data = p2p.fetch_piece(&addr, &d, r.piece, ps, wait).await;
                    if let (Ok(b), Some(l)) = (&data, p2p.prewarm_limit(&d)) {
                        l.acquire(b.len() as u64).await;
                    }
                    let _ = tx
                        .send(Event::Piece {
                            piece: r.piece,
                            from: r.peer,
                            data,
                        })
                        .await;
                });
            }
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(ev) => {
                        if let Err(e) = self.handle(ev).await {
                            warn!(digest = %self.d, error = %e, "swarm download failed");
                            self.writer.fail(&e);
                            leave(&self.p2p, &self.d).await;
                            return;
                        }
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    self.announce().await;
                    self.fetch_hashes_if_missing().await;
                }
            }
        }
        let size = self.layout.blob_size;
        let secs = self.started.elapsed().as_secs_f64();
        let mut done_req = self.request();
        done_req.complete = true;
        done_req.have = None;
        let (p2p, d, agent) = (self.p2p.clone(), self.d.clone(), self.agent.clone());
        self.writer
            .set_source(if self.peer_bytes >= self.registry_bytes {
                "peer"
            } else {
                "registry"
            });
        match self.writer.finish().await {
            Ok(_) => {
                info!(
                    digest = %self.d, bytes = size, from_peers = self.peer_bytes, from_registry = self.registry_bytes,
                    seconds = format!("{secs:.3}"), mib_per_s = format!("{:.1}", size as f64 / secs.max(1e-6) / 1048576.0),
                    "blob downloaded through the swarm"
                );
                let _ = p2p.announce(&done_req).await;
                agent.refresh_cache_gauges();
            }
            Err(e) => {
                warn!(digest = %d, error = %e, "swarm download rejected by the final digest check");
                leave(&p2p, &d).await;
            }
        }
    }

    /// The first run of consecutive pieces that nobody can give us.
    fn next_registry_run(&self) -> Option<(u32, u32)> {
        let orphans = self.sched.orphans();
        let first = *orphans.first()?;
        let mut end = first + 1;
        while orphans.contains(&end) {
            end += 1;
        }
        Some((first, end))
    }

    fn start_registry_run(
        &mut self,
        first: u32,
        end: u32,
        stream: Option<oci::upstream::ByteStream>,
        tx: &mpsc::Sender<Event>,
    ) {
        for i in first..end {
            self.sched.claim(i, REGISTRY);
        }
        self.registry_running = true;
        let (agent, p2p, tx) = (self.agent.clone(), self.p2p.clone(), tx.clone());
        let (registry, repo, d, layout) = (
            self.registry.clone(),
            self.repo.clone(),
            self.d.clone(),
            self.layout,
        );
        tokio::spawn(async move {
            let start = layout.range(first).0;
            let mut stream = match stream {
                Some(s) => s,
                None => match agent.upstream.get_blob(&registry, &repo, &d, start).await {
                    Ok(r) => r.stream,
                    Err(e) => {
                        let _ = tx
                            .send(Event::RegistryEnded {
                                undelivered: (first..end).collect(),
                                error: Some(e.to_string()),
                            })
                            .await;
                        return;
                    }
                },
            };
            let mut piece = first;
            let mut buf = BytesMut::with_capacity(layout.piece_size as usize);
            while piece < end {
                match stream.next().await {
                    Some(Ok(mut chunk)) => {
                        if let Some(l) = &p2p.download {
                            l.acquire(chunk.len() as u64).await;
                        }
                        if let Some(l) = p2p.prewarm_limit(&d) {
                            l.acquire(chunk.len() as u64).await;
                        }
                        agent.metrics.upstream_bytes.inc_by(chunk.len() as u64);
                        p2p.metrics.registry_bytes.inc_by(chunk.len() as u64);
                        while !chunk.is_empty() && piece < end {
                            let need = layout.len(piece) as usize - buf.len();
                            let take = need.min(chunk.len());
                            buf.extend_from_slice(&chunk.split_to(take));
                            if buf.len() as u64 == layout.len(piece) {
                                let data = buf.split().freeze();
                                if tx
                                    .send(Event::Piece {
                                        piece,
                                        from: REGISTRY.into(),
                                        data: Ok(data),
                                    })
                                    .await
                                    .is_err()
                                {
                                    return;
                                }
                                piece += 1;
                            }
                        }
                    }
                    Some(Err(e)) => {
                        let _ = tx
                            .send(Event::RegistryEnded {
                                undelivered: (piece..end).collect(),
                                error: Some(e.to_string()),
                            })
                            .await;
                        return;
                    }
                    None => break,
                }
            }
            let _ = tx
                .send(Event::RegistryEnded {
                    undelivered: (piece..end).collect(),
                    error: (piece < end).then(|| "registry stream ended early".into()),
                })
                .await;
        });
    }

    async fn handle(&mut self, ev: Event) -> Result<(), String> {
        match ev {
            Event::RegistryEnded { undelivered, error } => {
                self.registry_running = false;
                for i in undelivered {
                    self.sched.on_failed(i, REGISTRY, false);
                }
                if let Some(e) = error {
                    warn!(digest = %self.d, error = %e, "registry run ended early; pieces will be retried");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ok(())
            }
            Event::Piece {
                piece,
                from,
                data: Err(e),
            } => {
                debug!(digest = %self.d, piece, peer = %from, error = %e, "piece request failed");
                self.sched.on_failed(piece, &from, false);
                if from != REGISTRY {
                    // Let the tracker's next answer say whether this peer is still there.
                    self.sched.remove_peer(&from);
                    self.peers.remove(&from);
                }
                Ok(())
            }
            Event::Piece {
                piece,
                from,
                data: Ok(data),
            } => {
                if from == REGISTRY {
                    let h = sha_hex(&data);
                    self.registry_bytes += data.len() as u64;
                    if let Some(known) = self.hashes.get(&piece) {
                        if known != &h {
                            // The registry and the swarm disagree: the registry is the
                            // authority, and the final digest check will decide.
                            warn!(digest = %self.d, piece, "registry bytes differ from the published piece hash");
                        }
                    }
                    self.hashes.entry(piece).or_insert_with(|| h.clone());
                    self.new_hashes.insert(piece, h);
                    self.store_piece(piece, REGISTRY, data).await
                } else {
                    self.check_and_store(piece, from, data).await
                }
            }
        }
    }

    async fn check_and_store(
        &mut self,
        piece: u32,
        from: String,
        data: Bytes,
    ) -> Result<(), String> {
        let Some(expected) = self.hashes.get(&piece).cloned() else {
            self.pending.insert(piece, (from, data));
            return Ok(());
        };
        let got = {
            let data = data.clone();
            tokio::task::spawn_blocking(move || sha_hex(&data))
                .await
                .map_err(|e| e.to_string())?
        };
        if got != expected {
            warn!(digest = %self.d, piece, peer = %from, "piece failed verification; peer reported and avoided");
            self.p2p.metrics.pieces_rejected.inc();
            self.sched.on_failed(piece, &from, true);
            self.bad.push(from);
            return Ok(());
        }
        self.peer_bytes += data.len() as u64;
        self.p2p.metrics.peer_bytes.inc_by(data.len() as u64);
        self.p2p.metrics.pieces_from_peers.inc();
        self.store_piece(piece, &from, data).await
    }

    async fn store_piece(&mut self, piece: u32, from: &str, data: Bytes) -> Result<(), String> {
        if !self.sched.on_done(piece, from) {
            return Ok(());
        }
        self.writer
            .write_piece(piece, data)
            .await
            .map_err(|e| e.to_string())
    }

    async fn settle_pending(&mut self) {
        let ready: Vec<u32> = self
            .pending
            .keys()
            .copied()
            .filter(|i| self.hashes.contains_key(i))
            .collect();
        for i in ready {
            if let Some((from, data)) = self.pending.remove(&i) {
                if let Err(e) = self.check_and_store(i, from, data).await {
                    warn!(error = %e, "storing a pending piece failed");
                }
            }
        }
    }

    /// Piece hashes normally come from the source through the tracker. When no source
    /// is publishing (the swarm has only complete seeders, e.g. after a tracker
    /// restart), ask a complete peer: its blob passed the digest check, so hashes
    /// computed from it are as trustworthy as the source's.
    async fn fetch_hashes_if_missing(&mut self) {
        if self.hashes.len() as u32 >= self.layout.count() || self.complete_peers.is_empty() {
            return;
        }
        let needed = !self.pending.is_empty()
            || !self.claims.is_empty()
            || (self.hashes.is_empty() && self.role == Role::Peer);
        if !needed
            || self
                .last_hash_fetch
                .is_some_and(|t| t.elapsed() < Duration::from_secs(2))
        {
            return;
        }
        self.last_hash_fetch = Some(Instant::now());
        let addr = self.complete_peers
            [(self.started.elapsed().as_millis() as usize) % self.complete_peers.len()]
        .clone();
        match self
            .p2p
            .fetch_hashes(&addr, &self.d, self.layout.piece_size)
            .await
        {
            Ok(list) if list.len() as u32 == self.layout.count() => {
                for (i, h) in list.into_iter().enumerate() {
                    self.hashes.entry(i as u32).or_insert(h);
                }
                debug!(digest = %self.d, peer = %addr, "piece hashes taken from a complete peer");
            }
            Ok(list) => {
                warn!(digest = %self.d, peer = %addr, got = list.len(), "peer sent a wrong number of piece hashes")
            }
            Err(e) => {
                debug!(digest = %self.d, peer = %addr, error = %e, "cannot fetch piece hashes")
            }
        }
    }

    /// Pieces a previous run left on disk are kept once their hashes check out.
    async fn verify_claims(&mut self) {
        let ready: Vec<u32> = self
            .claims
            .iter()
            .copied()
            .filter(|i| self.hashes.contains_key(i))
            .collect();
        if ready.is_empty() {
            return;
        }
        self.claims.retain(|i| !ready.contains(i));
        let mut kept = 0;
        for i in ready {
            if self.sched.have().get(i) {
                continue;
            }
            if let Ok(bytes) = self.writer.read_piece(i).await {
                if Some(&sha_hex(&bytes)) == self.hashes.get(&i)
                    && self.writer.accept_existing(i).await.is_ok()
                {
                    self.sched.on_done(i, "disk");
                    kept += 1;
                }
            }
        }
        if kept > 0 {
            info!(digest = %self.d, pieces = kept, "kept verified pieces from before the restart");
        }
    }
}
