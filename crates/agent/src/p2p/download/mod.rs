//! Downloading one blob through the swarm.
//!
//! One task owns the blob's [`PieceWriter`] and a [`PieceScheduler`]. It announces to
//! the tracker for membership, the source election and piece hashes; it keeps a
//! connection (a channel on a shared connection) to each peer it was handed, learns
//! what they hold as it happens (bitfield, then HAVEs), and keeps each peer's window
//! of piece requests full. Pieces are written into the file by the connections as they
//! arrive and kept only once their BLAKE3 hash matches the hash published by the
//! agent that read the piece from the registry. When the tracker elects this agent
//! source, it streams the pieces nobody holds from the registry, hashing them as they
//! pass; peers learn them from its HAVEs (with the hash) and from the tracker. If the
//! tracker is unreachable the task carries on from the registry itself: a pull never
//! fails because of Starling while the registry is up.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use oci::Digest;
use ratelimit::TokenBucket;
use store::{BlobWriter, Inflight, PieceWriter};
use swarm::protocol::MAX_BAD_PEERS;
use swarm::scheduler::{seed_for, SchedulerConfig};
use swarm::wire::{ChannelId, RejectReason};
use swarm::{AnnounceRequest, AnnounceResponse, PieceHash, PieceLayout, PieceScheduler, Role};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::conn::{PeerConn, PeerEvent};
use super::P2p;
use crate::{Agent, Error};

mod join;
mod peer_traffic;
mod registry_run;
mod verify;

pub(crate) use join::{leave, start, start_from_holders, Start, Want};
use peer_traffic::Link;

/// The name the scheduler knows the registry stream by.
const REGISTRY: &str = "\u{0}registry";

/// How long without a tracker answer before the agent may fetch from the registry
/// itself.
const TRACKER_GRACE: Duration = Duration::from_secs(3);

/// Without a tracker, how long nothing must have arrived from the swarm before the
/// agent reads the registry itself. While its connected peers still pass pieces on it
/// waits for them: every member reading the rest at once would send the registry a
/// copy per member (3 of 4 in `a_tracker_that_dies_mid_pull_…` before).
const SWARM_QUIET_WITHOUT_TRACKER_MS: u64 = 2_000;

/// Failed dials in a row (2 s apart) after which a peer is reported to the tracker as
/// unreachable, which then leaves it out of this node's handouts (and everyone's, on
/// a quorum of reporters) like a peer that served bad pieces.
const UNREACHABLE_AFTER: u32 = 3;

/// A holder asked for pieces that sends nothing for this long is reported like an
/// unreachable one. Longer than a holder's own `wire_io::SEND_STALL` (20 s), so a
/// holder whose slots a frozen downloader holds frees them first.
const SILENT_HOLDER_MS: u64 = 30_000;

/// A holder that sends this node other blobs' pieces on the same connection meanwhile
/// is excused from `SILENT_HOLDER_MS` up to this long. Its upload line serves a
/// connection's oldest request after `swarm::upload::REQUEST_PATIENCE` others, so an
/// honest holder gets to this blob well before; one that serves every blob but this
/// one (a hostile or broken peer, or the only holder of the blob) is reported once it
/// has sent `swarm::upload::starving_after_pieces` other pieces past a waiting
/// request, and at the latest now (a slow link), and the swarm goes on without it.
const SILENT_WHILE_BUSY_MS: u64 = 4 * SILENT_HOLDER_MS;

/// Waits between attempts of a completed download's last announce (about a minute
/// in all: a tracker replica restarting, or its Redis).
const FINAL_ANNOUNCE_RETRIES_MS: [u64; 8] = [250, 500, 1_000, 2_000, 4_000, 8_000, 16_000, 30_000];

/// How often a source pushes new piece hashes to the tracker (for peers that are not
/// connected to it), at most.
const HASH_PUSH_EVERY: Duration = Duration::from_millis(100);

/// A registry run that yields nothing for this long publishes what it has buffered.
const RUN_QUIET: Duration = Duration::from_millis(5);

/// Peer links kept per blob (`swarm::links`).
const MAX_LINKS: usize = swarm::links::MAX_LINKS;

/// What the download task learns from the tasks it spawns.
enum Internal {
    Announced(
        Box<Result<AnnounceResponse, Error>>,
        BTreeMap<u32, String>,
        Vec<String>,
    ),
    TrackerHashes(BTreeMap<u32, String>),
}

/// A registry run in progress: pieces `[first, end)` over one registry connection.
struct RegistryRun {
    first: u32,
    end: u32,
    /// Bytes the run still expects (a stream opened before the slices were known may
    /// carry more: it is cut here).
    left: u64,
    stop: futures::stream::AbortHandle,
}

/// The chunks of every registry run, tagged with the run; `None` ends a run's stream.
type RunStreams = futures::stream::SelectAll<
    std::pin::Pin<
        Box<dyn futures::Stream<Item = (u32, Option<Result<bytes::Bytes, oci::Error>>)> + Send>,
    >,
>;

struct Download {
    agent: Agent,
    p2p: Arc<P2p>,
    registry: String,
    repo: String,
    /// The blob: what peers are asked for, and what the store and the whole-blob
    /// check know it by.
    d: Digest,
    /// Its swarm's key on the tracker: `d`, except for a file or a registry only a
    /// wildcard admits (`oci::upstream::swarm_scope`).
    swarm: Digest,
    /// A prewarm's rate limit for this blob (peers and registry alike).
    limit: Option<Arc<TokenBucket>>,
    w: PieceWriter,
    layout: PieceLayout,
    sched: PieceScheduler,
    /// Trusted piece hashes: from the tracker, or from the source's own connection.
    hashes: Vec<Option<PieceHash>>,
    /// Hashes this agent computed from registry bytes, not yet sent to the tracker.
    publish: BTreeMap<u32, String>,
    /// Peers to report to the tracker with the next announce: they served pieces
    /// failing verification, or could not be reached (`UNREACHABLE_AFTER`).
    bad: Vec<String>,
    role: Role,
    /// The agent the tracker elected source (whose HAVE hashes are trusted).
    source: Option<String>,
    links: HashMap<String, Link>,
    events_tx: mpsc::Sender<PeerEvent>,
    internal_tx: mpsc::Sender<Internal>,
    /// Pieces received before their hash was known: their bytes wait in the file,
    /// claimed, with the hash they had.
    unverified: HashMap<u32, (String, Option<PieceHash>)>,
    /// Pieces on disk from before a restart, to re-verify once hashes are known.
    claims: Vec<u32>,
    /// Pieces this source claimed to read from the registry when a connection frees:
    /// peers hold them, but their hashes went with a tracker's lost state, so a copy
    /// could not be checked. Claimed, they are not asked of those peers meanwhile.
    registry_owed: BTreeSet<u32>,
    runs: HashMap<u32, RegistryRun>,
    streams: RunStreams,
    /// Registry connections a source may use for one blob (disjoint Range slices).
    registry_streams: u32,
    /// Requests that took from the agent-wide budget, to give back when they end.
    budgeted: HashSet<(u32, String)>,
    last_tracker_ok: Instant,
    last_announce: Instant,
    announcing: bool,
    last_hash_fetch: Option<Instant>,
    last_peer_hash_ask: Option<Instant>,
    interval: Duration,
    clock: Instant,
    started: Instant,
    peer_bytes: u64,
    registry_bytes: u64,
    /// When the first registry run began: the rate its runs are sized from.
    registry_since: Option<Instant>,
    /// Verified pieces by the peer that sent them (reported when the blob is done).
    pieces_by_peer: BTreeMap<String, u32>,
    registry_retry_at: Option<Instant>,
    /// Registry runs that failed to start since the registry last sent a byte.
    registry_failures: u32,
    /// The registry (or a file's origin) says the content is gone or changed (404,
    /// 410, 412), or to come back later than a request waits (429: its pull quota):
    /// retrying now cannot help, the download fails, and its readers with it.
    origin_refused: Option<String>,
    /// The swarm's hash epoch when this download began (`AnnounceResponse::hashes_epoch`).
    hashes_epoch: Option<u32>,
    /// The epoch moved on while this download held pieces or hashes: they were checked
    /// against hashes from bad registry bytes, and the download starts over.
    hashes_voided: bool,
    /// Taken only from members that hold it, as the registry cannot answer this node
    /// ([`Want::FromHolders`]): the tracker never elects it, and the download ends
    /// at this instant if no holder has delivered the blob by then.
    holders_only_until: Option<Instant>,
    /// The size this blob really has, when it is not the one the swarm was laid out by
    /// (a member said another first): read from the registry, or the tracker's answer
    /// after the source corrected it. The download starts over.
    size_moved: Option<u64>,
}

impl Download {
    fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    fn request(&self) -> AnnounceRequest {
        let mut r = AnnounceRequest::new(
            &self.p2p.node,
            &self.p2p.addr,
            &self.p2p.topology,
            &self.swarm,
        );
        r.size = Some(self.layout.blob_size);
        r.piece_size = Some(self.layout.piece_size);
        r.have = Some(self.w.held());
        r.fetching_from_registry = !self.runs.is_empty();
        r.hashes = self.publish.clone();
        r.known_hashes = self
            .hashes
            .iter()
            .position(Option::is_none)
            .unwrap_or(self.hashes.len()) as u32;
        // The rest wait for the next announce (the sent ones leave `bad` when it lands).
        r.bad_peers = self.bad.iter().take(MAX_BAD_PEERS).cloned().collect();
        r.registry_unavailable = self.holders_only_until.is_some();
        r
    }

    /// Takes in a tracker answer; returns the channels of links it dropped, to close.
    fn absorb(&mut self, resp: AnnounceResponse) -> Vec<(Arc<PeerConn>, ChannelId)> {
        let now = self.now_ms();
        if resp.role == Role::Source && self.role != Role::Source {
            info!(digest = %self.d, "elected to fetch from the registry");
            self.p2p.metrics.source_roles.inc();
        }
        match self.hashes_epoch {
            Some(e) if resp.hashes_epoch > e => {
                if self.hashes.iter().any(Option::is_some) || self.w.held().count() > 0 {
                    self.hashes_voided = true;
                }
                self.hashes_epoch = Some(resp.hashes_epoch);
            }
            Some(_) => {}
            None => self.hashes_epoch = Some(resp.hashes_epoch),
        }
        if let Some(size) = resp.size.filter(|&s| s != self.layout.blob_size) {
            self.size_moved = Some(size);
        }
        self.role = resp.role;
        self.source = resp.source.clone();
        self.interval = Duration::from_millis(resp.interval_ms.clamp(50, 10_000));
        self.sched.on_announce(&resp, now);
        self.learn_hashes(resp.hashes);
        self.p2p.metrics.swarm_peers.set(resp.peers.len() as i64);
        for l in self.links.values_mut() {
            l.fresh = false;
        }
        for p in resp.peers {
            if p.node == self.p2p.node {
                continue;
            }
            let distance = self.p2p.topology.distance(&p.topology);
            let link = self
                .links
                .entry(p.node.clone())
                .or_insert_with(|| Link::new(p.addr.clone(), distance, now));
            link.fresh = true;
            link.distance = distance;
            if link.addr != p.addr && link.conn.is_none() {
                link.addr = p.addr.clone();
            }
        }
        // The links to keep (`swarm::links`): beyond the cap, stale ones without a
        // channel go; in large swarms, idle far links beyond a few.
        let states: Vec<swarm::links::LinkState<String>> = self
            .links
            .iter()
            .map(|(n, l)| swarm::links::LinkState {
                key: n.clone(),
                distance: l.distance,
                live: l.conn.is_some() || l.connecting,
                fresh: l.fresh,
                inflight: self.sched.inflight_to(n),
                useful_ms: l.useful_ms,
            })
            .collect();
        let mut close = Vec::new();
        for n in swarm::links::to_drop(&states, resp.members, now) {
            for piece in self.sched.remove_peer(&n) {
                self.request_ended(piece, &n);
            }
            if let Some(conn) = self.links.remove(&n).and_then(|l| l.conn) {
                close.push(conn);
            }
        }
        close
    }

    fn learn_hashes(&mut self, hashes: BTreeMap<u32, String>) {
        for (i, h) in hashes {
            if let (Some(slot), Ok(h)) = (self.hashes.get_mut(i as usize), PieceHash::from_hex(&h))
            {
                slot.get_or_insert(h);
            }
        }
    }

    fn spawn_announce(&mut self, complete: bool) {
        if self.announcing {
            return;
        }
        self.announcing = true;
        self.last_announce = Instant::now();
        let mut req = self.request();
        if complete {
            req.complete = true;
            req.have = None;
        }
        let sent_hashes = req.hashes.clone();
        let sent_bad = req.bad_peers.clone();
        let (p2p, tx) = (self.p2p.clone(), self.internal_tx.clone());
        tokio::spawn(async move {
            let r = p2p.announce(&req).await;
            let _ = tx
                .send(Internal::Announced(Box::new(r), sent_hashes, sent_bad))
                .await;
        });
    }

    async fn run(
        mut self,
        mut events: mpsc::Receiver<PeerEvent>,
        mut internal: mpsc::Receiver<Internal>,
        first_stream: Option<oci::upstream::ByteStream>,
    ) {
        if let Some(stream) = first_stream {
            let plan = self.plan_runs(0, self.layout.count());
            let mut first = Some(stream);
            for (a, b) in plan {
                self.begin_run(a, b, first.take()).await;
            }
        }
        self.connect_links();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut run_quiet = false;
        loop {
            if self.w.is_complete() {
                break;
            }
            if let Some(reason) = self.origin_refused.take() {
                self.abort(&reason).await;
                return;
            }
            if self.holders_only_until.is_some_and(|t| Instant::now() >= t) {
                self.abort(
                    "no member that holds it delivered it in time, and the registry cannot answer",
                )
                .await;
                return;
            }
            if let Some(size) = self.size_moved {
                self.start_over_at(size).await;
                return;
            }
            self.schedule().await;
            let run_active = !self.runs.is_empty();
            tokio::select! {
                Some((id, chunk)) = self.streams.next(), if run_active => {
                    run_quiet = false;
                    if let Err(e) = self.on_registry_chunk(id, chunk).await {
                        self.abort(&format!("storing registry bytes: {e}")).await;
                        return;
                    }
                }
                _ = tokio::time::sleep(RUN_QUIET), if run_active && !run_quiet => {
                    // The registry went quiet: publish what is buffered for readers.
                    run_quiet = true;
                    match self.w.flush_runs().await {
                        Ok(held) => self.on_registry_pieces(held),
                        Err(e) => {
                            self.abort(&e.to_string()).await;
                            return;
                        }
                    }
                }
                hashes = self.w.next_hashes() => {
                    // The digest passed registry pieces: now held, with hashes to publish.
                    match self.w.hold_hashed(hashes).await {
                        Ok(held) => self.on_registry_pieces(held),
                        Err(e) => {
                            self.abort(&e.to_string()).await;
                            return;
                        }
                    }
                }
                ev = events.recv() => {
                    if let Some(ev) = ev {
                        if let Err(e) = self.on_event(ev).await {
                            self.abort(&e.to_string()).await;
                            return;
                        }
                    }
                }
                msg = internal.recv() => {
                    if let Some(msg) = msg {
                        self.on_internal(msg).await;
                    }
                    if self.hashes_voided && self.size_moved.is_none() {
                        self.start_over().await;
                        return;
                    }
                }
                _ = tick.tick() => {
                    if let Err(e) = self.housekeeping().await {
                        self.abort(&e.to_string()).await;
                        return;
                    }
                }
            }
        }
        self.finish().await;
    }

    async fn abort(&mut self, reason: &str) {
        warn!(digest = %self.d, error = %reason, "swarm download failed");
        self.p2p.downloads.lock().remove(&self.d);
        self.close_links().await;
        self.w.fail(reason);
        leave(&self.p2p, &self.swarm, false).await;
    }

    /// The source voided the swarm's hashes (its registry bytes failed the digest):
    /// what this download holds was checked against them and can never make the
    /// blob. Everything written goes, and the reader's stream fails, so its retry
    /// starts a fresh download on the new hashes. Kept, those pieces made every retry
    /// stop at the last piece, whose hash is the digest itself.
    async fn start_over(&mut self) {
        warn!(digest = %self.d, "the source voided the swarm's piece hashes; dropping this download's pieces to start over");
        self.p2p.downloads.lock().remove(&self.d);
        self.close_links().await;
        self.w
            .abandon("pieces were checked against hashes the source voided");
        leave(&self.p2p, &self.swarm, false).await;
    }

    /// The blob is `size` bytes, not what this download laid it out by: the swarm's
    /// first size was a member's word, and either this node read the registry's as
    /// the source, or the source did and the tracker now says so. A source tells the
    /// tracker, which then lays the swarm out anew; either way what this download
    /// wrote goes, and the reader's retry joins the swarm at the right size.
    async fn start_over_at(&mut self, size: u64) {
        warn!(digest = %self.d, laid_out = self.layout.blob_size, size, source = self.role == Role::Source,
            "the swarm was laid out by a size the blob does not have; starting over at the right one");
        self.p2p.metrics.swarm_size_corrections.inc();
        self.p2p.downloads.lock().remove(&self.d);
        self.close_links().await;
        if self.role == Role::Source {
            let mut req = AnnounceRequest::new(
                &self.p2p.node,
                &self.p2p.addr,
                &self.p2p.topology,
                &self.swarm,
            );
            self.p2p.say_size(&mut req, size);
            if self.p2p.announce(&req).await.is_err() {
                self.p2p.metrics.tracker_errors.inc();
            }
        }
        self.w.abandon(&format!(
            "the swarm was laid out for {} bytes; the blob is {size}",
            self.layout.blob_size
        ));
        if self.role != Role::Source {
            leave(&self.p2p, &self.swarm, false).await;
        }
    }

    async fn close_links(&mut self) {
        for l in self.links.values_mut() {
            if let Some((conn, chan)) = l.conn.take() {
                conn.close(chan).await;
            }
        }
        let n = self.budgeted.len() as u32;
        self.budgeted.clear();
        self.p2p.budget.give_back(n);
    }

    async fn finish(mut self) {
        self.p2p.downloads.lock().remove(&self.d);
        self.close_links().await;
        let size = self.layout.blob_size;
        let secs = self.started.elapsed().as_secs_f64();
        let (p2p, d, agent) = (self.p2p.clone(), self.d.clone(), self.agent.clone());
        let swarm = self.swarm.clone();
        let was_source = self.role == Role::Source;
        let mut done_req = self.request();
        done_req.complete = true;
        done_req.have = None;
        let source = if self.peer_bytes >= self.registry_bytes {
            "peer"
        } else {
            "registry"
        };
        self.w.set_source(source);
        let (peer_bytes, registry_bytes) = (self.peer_bytes, self.registry_bytes);
        let by_peer = self
            .pieces_by_peer
            .iter()
            .map(|(p, n)| format!("{p}:{n}"))
            .collect::<Vec<_>>()
            .join(",");
        match self.w.finish().await {
            Ok(_) => {
                info!(
                    digest = %d, bytes = size, from_peers = peer_bytes, from_registry = registry_bytes, pieces_by_peer = %by_peer,
                    seconds = format!("{secs:.3}"), mib_per_s = format!("{:.1}", size as f64 / secs.max(1e-6) / 1048576.0),
                    "blob downloaded through the swarm"
                );
                agent.refresh_cache_gauges();
                // The last announce carries the hashes of the last pieces a source
                // read: it must reach the tracker, or peers that saw those pieces in a
                // bitfield have nobody to verify them against.
                for wait_ms in FINAL_ANNOUNCE_RETRIES_MS {
                    match p2p.announce(&done_req).await {
                        Ok(_) => break,
                        Err(e) => {
                            debug!(digest = %d, error = %e, wait_ms, "final announce failed; again");
                            tokio::time::sleep(Duration::from_millis(wait_ms)).await;
                        }
                    }
                }
            }
            Err(e) => {
                warn!(digest = %d, error = %e, "swarm download rejected by the final digest check");
                // A source whose registry bytes failed the digest published hashes
                // of bad bytes: the tracker must forget them, or every member's
                // pieces (checked against them) stop at the last piece for good.
                let void = was_source && e.is_content_mismatch();
                leave(&p2p, &swarm, void).await;
            }
        }
    }

    /// Whether piece hashes may come from a complete peer's list: when no source
    /// publishes them (the swarm has only seeders), or when this node is the source
    /// and holds pieces from peers that it did not read itself (a tracker that lost
    /// its state — a Redis restart — elects it while the old source's hashes are
    /// gone; found by `tracker_redis`). The whole-blob digest still checks them.
    fn takes_peer_hash_lists(&self) -> bool {
        self.source
            .as_deref()
            .is_none_or(|source| source == self.p2p.node)
    }

    async fn on_internal(&mut self, msg: Internal) {
        match msg {
            Internal::Announced(r, sent_hashes, sent_bad) => {
                self.announcing = false;
                match *r {
                    Ok(resp) => {
                        self.last_tracker_ok = Instant::now();
                        for k in sent_hashes.keys() {
                            self.publish.remove(k);
                        }
                        self.bad.retain(|b| !sent_bad.contains(b));
                        let was_source = self.role == Role::Source;
                        for (conn, chan) in self.absorb(resp) {
                            conn.close(chan).await;
                        }
                        if was_source && self.role == Role::Peer {
                            self.stop_reading_the_registry().await;
                        }
                        if !was_source && self.role == Role::Source {
                            // Elected now: read the registry before the next tick,
                            // and before peers are asked for what only it can check.
                            self.refill_registry_runs().await;
                        }
                        // The stripe or the source may have changed.
                        self.sync_have_filters().await;
                        self.connect_links();
                        if let Err(e) = self.settle_unverified().await {
                            warn!(digest = %self.d, error = %e, "cannot keep verified pieces");
                        }
                    }
                    Err(e) => {
                        self.p2p.metrics.tracker_errors.inc();
                        debug!(digest = %self.d, error = %e, "announce failed");
                    }
                }
            }
            Internal::TrackerHashes(h) => {
                self.learn_hashes(h);
                if let Err(e) = self.settle_unverified().await {
                    warn!(digest = %self.d, error = %e, "cannot keep verified pieces");
                }
            }
        }
    }

    async fn housekeeping(&mut self) -> Result<(), store::Error> {
        let since = self.last_announce.elapsed();
        if since >= self.interval || (!self.publish.is_empty() && since >= HASH_PUSH_EVERY) {
            self.spawn_announce(false);
        }
        self.connect_links();
        self.cancel_stalled().await;
        self.drop_silent_holders().await;
        if self.sched.check_stripe_quiet(self.now_ms()) {
            warn!(digest = %self.d, "nothing arrived from the rack stripe; asking far holders for every piece");
            self.p2p.metrics.stripes_distrusted.inc();
            self.sync_have_filters().await;
        }
        // Pieces waiting for hashes: ask the tracker (it has them from the source).
        if (!self.unverified.is_empty() || !self.claims.is_empty())
            && self
                .last_hash_fetch
                .is_none_or(|t| t.elapsed() > Duration::from_millis(200))
        {
            self.last_hash_fetch = Some(Instant::now());
            let from = self.hashes.iter().position(Option::is_none).unwrap_or(0) as u32;
            let (p2p, swarm, tx) = (
                self.p2p.clone(),
                self.swarm.clone(),
                self.internal_tx.clone(),
            );
            tokio::spawn(async move {
                if let Ok(h) = p2p.tracker_hashes(&swarm, from).await {
                    let _ = tx.send(Internal::TrackerHashes(h)).await;
                }
            });
        }
        // No other source publishing: ask a complete peer for its hash list.
        if self.takes_peer_hash_lists()
            && self.hashes.iter().any(Option::is_none)
            && self
                .last_peer_hash_ask
                .is_none_or(|t| t.elapsed() > Duration::from_secs(2))
        {
            let seeder = self
                .links
                .iter()
                .find(|(n, l)| l.conn.is_some() && self.sched.peer_is_complete(n))
                .and_then(|(_, l)| l.conn.clone());
            if let Some((conn, chan)) = seeder {
                self.last_peer_hash_ask = Some(Instant::now());
                conn.ask_hashes(chan).await;
            }
        }
        self.refill_registry_runs().await;
        self.settle_unverified().await
    }
}
