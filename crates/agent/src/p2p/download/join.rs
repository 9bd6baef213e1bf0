//! Joining a blob's swarm: the first announce, waiting for an election or for the
//! source to learn the size, the piece layout, and the download task that takes it
//! from there; and leaving.

use super::*;

/// How long the tracker may hold a join until the swarm's size is known.
const SIZE_WAIT_MS: u32 = 1_000;

/// Whom a download may take the blob from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want {
    /// The swarm, which may elect this node to read the registry.
    Swarm,
    /// The registry cannot answer this node (throttled, failing, unreachable): only
    /// members that hold the whole blob, if it is at most `max_size` bytes (the most
    /// the caller takes: a manifest's bound, or what one piece holds). A blob of at
    /// most one piece (`PieceLayout::whole`) is checked against its digest alone.
    FromHolders { max_size: u64 },
}

/// How long a download from holders waits for them: 10 s, and 1 s more per MiB.
fn holders_patience(size: u64) -> Duration {
    Duration::from_secs(10 + size / (1 << 20))
}

pub(crate) enum Start {
    /// The swarm download runs; stream from this inflight.
    Started(Arc<Inflight>, u64),
    /// Not a swarm blob (small, or the tracker is unreachable): the plain registry path,
    /// with the registry's answer when the election already opened it.
    NotSwarm(Box<BlobWriter>, Option<oci::upstream::BlobResponse>),
    Failed(oci::Error),
    /// The store cannot take the blob: stream it without caching.
    Passthrough(u64),
}

pub(crate) async fn start(
    agent: Agent,
    registry: String,
    repo: String,
    d: Digest,
    mut writer: Box<BlobWriter>,
    limit: Option<Arc<TokenBucket>>,
    want: Want,
) -> Start {
    let joined = Instant::now();
    let Some(p2p) = agent.p2p.clone() else {
        return Start::NotSwarm(writer, None);
    };
    let holders_only = match want {
        Want::Swarm => None,
        Want::FromHolders { max_size } => Some(max_size),
    };
    // A file, or a registry only a wildcard admits, has a swarm of its own
    // (`oci::upstream::swarm_scope`); peers still ask each other for the blob by `d`.
    let oci::upstream::BlobSwarm {
        key: swarm_key,
        size: known_size,
    } = agent.upstream.swarm_of(&registry, &d);
    let mut req = AnnounceRequest::new(&p2p.node, &p2p.addr, &p2p.topology, &swarm_key);
    // A file's size came with its origin's probe, bound by its swarm's key: said at
    // once, the swarm is laid out before any byte is fetched, and the source asks the
    // origin for bounded runs only. (Learning it from an open-ended first GET cost the
    // origin what that stream had in flight when its first run ended: 2-5 % of a
    // 285 MB file.)
    if let Some(size) = known_size {
        p2p.say_size(&mut req, size);
    }
    // Until the source has the registry's answer there is no size to lay the blob out
    // by: the tracker holds the answer until there is (a tracker that cannot answers at
    // once, and the loop below asks again).
    // (Holders said the size when they seeded: a swarm without one has none to wait for.)
    req.wait_for_size_ms = if holders_only.is_some() {
        0
    } else {
        SIZE_WAIT_MS
    };
    req.registry_unavailable = holders_only.is_some();
    let mut resp = match p2p.announce(&req).await {
        Ok(r) => r,
        Err(e) => {
            p2p.metrics.tracker_errors.inc();
            warn!(digest = %d, error = %e, "tracker unreachable; fetching from the registry directly");
            return Start::NotSwarm(writer, None);
        }
    };
    // Peers may have to wait a moment for the source to learn the size, or for the
    // tracker to elect one (it holds a blob back from a node busy with another).
    let deadline = Instant::now() + Duration::from_secs(10);
    let nobody_has_it = |r: &AnnounceResponse| {
        r.role == Role::Peer
            && (r.size.is_none()
                || (!r.source_alive
                    && r.peers
                        .iter()
                        .all(|p| p.have.as_ref().is_some_and(|h| h.count() == 0))))
    };
    // The size this node can vouch for, against a swarm's that a member said first: a
    // file's, bound in its swarm's key, or the registry's when a manifest this agent
    // served declared another than the swarm's (checked once, with a HEAD).
    let mut vouched = known_size;
    let mut checked = known_size.is_some();
    if let Some(max_size) = holders_only {
        // No registry to ask: a size a manifest this agent served declared is the one
        // to hold the holders to (the digest settles it in the end anyway).
        vouched = vouched.or_else(|| agent.declared_sizes.lock().size(&registry, &repo, &d));
        checked = true;
        let whole_holder = |p: &swarm::PeerInfo| p.have.is_none();
        let acceptable = |s: u64| s <= max_size && vouched.is_none_or(|v| v == s);
        let takeable = resp.role == Role::Peer
            && resp.peers.iter().any(whole_holder)
            && resp.size.is_some_and(acceptable);
        if !takeable {
            debug!(digest = %d, role = ?resp.role, size = resp.size, "no member holds it whole at a size this node takes");
            // Holders of the whole blob at another size than a manifest this agent
            // served declared claim what no blob of this digest is: reported, so that
            // honest holders' size can replace theirs (`TrackerState::announce`).
            let size_liars: Vec<String> = match (vouched, resp.size) {
                (Some(v), Some(s)) if v != s => resp
                    .peers
                    .iter()
                    .filter(|p| whole_holder(p) && p.node != p2p.node)
                    .take(MAX_BAD_PEERS)
                    .map(|p| p.node.clone())
                    .collect(),
                _ => Vec::new(),
            };
            if !size_liars.is_empty() {
                warn!(digest = %d, said = resp.size, size = vouched, holders = ?size_liars, "members claim to hold the blob at a size its manifest does not declare; reporting them");
                leave_reporting(&p2p, &swarm_key, false, size_liars).await;
            } else if resp.role != Role::Direct {
                leave(&p2p, &swarm_key, false).await;
            }
            return Start::NotSwarm(writer, None);
        }
    }
    // This node said the registry's size against the swarm's while not its source.
    let mut told_size = false;
    loop {
        if !checked {
            if let Some(said) = resp.size {
                checked = true;
                vouched =
                    registry_size_if_declared_otherwise(&agent, &registry, &repo, &d, said).await;
            }
        }
        let wrong = vouched.filter(|&v| resp.size.is_some_and(|s| s != v));
        if let Some(size) = wrong {
            p2p.say_size(&mut req, size);
            if resp.role == Role::Source {
                // Elected: this node's word is the registry's, and the tracker lays the
                // swarm out anew by it.
                warn!(digest = %d, said = resp.size, size, "the swarm was laid out by a size the blob does not have; telling the tracker the origin's");
                p2p.metrics.swarm_size_corrections.inc();
            } else {
                told_size = true;
                // The source says a size the registry does not, or a member claims to
                // hold the whole blob at it (the tracker counts no holder whose size
                // differs from the swarm's, so no honest one is named here): reported,
                // until a quorum of such reports demotes them and one of the members
                // waiting here is elected and says the registry's.
                let holders = resp.peers.iter().filter(|p| p.have.is_none());
                req.bad_peers = resp
                    .source
                    .iter()
                    .chain(holders.map(|p| &p.node))
                    .filter(|s| **s != p2p.node)
                    .take(MAX_BAD_PEERS)
                    .cloned()
                    .collect();
            }
        } else if !nobody_has_it(&resp) {
            break;
        }
        if Instant::now() >= deadline {
            if wrong.is_some() {
                warn!(digest = %d, said = resp.size, size = vouched, "the swarm's size stayed wrong; fetching from the registry directly");
                leave(&p2p, &swarm_key, false).await;
                return Start::NotSwarm(writer, None);
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        match p2p.announce(&req).await {
            Ok(r) => resp = r,
            Err(_) => return Start::NotSwarm(writer, None),
        }
    }
    if told_size && resp.role == Role::Source && resp.size.is_some() && resp.size == vouched {
        // A swarm laid out below the threshold has no source to mend it: the tracker
        // took this node's size and elected it.
        warn!(digest = %d, size = vouched, "the swarm was laid out by a size the blob does not have; the tracker took the registry's from this node");
        p2p.metrics.swarm_size_corrections.inc();
    }
    debug!(digest = %d, role = ?resp.role, ms = joined.elapsed().as_millis() as u64, "swarm joined");
    if resp.role == Role::Source {
        // Elected to read a registry that asked this node to wait: its client gets
        // the registry's 429 and the time left rather than a response cut later.
        if let Err(e) = agent.upstream.check_quota(&registry) {
            writer.fail(&e.to_string());
            leave(&p2p, &swarm_key, false).await;
            return Start::Failed(e);
        }
    }
    let mut first_answer = None;
    let size = match (resp.role, resp.size) {
        (Role::Direct, _) => return Start::NotSwarm(writer, None),
        (_, Some(s)) => s,
        (Role::Source, None) if writer.offset() == 0 => {
            // The source learns the size from the registry's answer and keeps that stream.
            match agent.upstream.get_blob(&registry, &repo, &d, 0).await {
                Ok(r) => match r.total {
                    Some(t) => {
                        first_answer = Some(r);
                        t
                    }
                    None => return Start::NotSwarm(writer, None),
                },
                Err(e) => {
                    writer.fail(&e.to_string());
                    // Said at once, or the swarm waits out the tracker's TTL for a
                    // source that will not read.
                    leave(&p2p, &swarm_key, false).await;
                    return Start::Failed(e);
                }
            }
        }
        _ => match agent.upstream.head_blob(&registry, &repo, &d).await {
            Ok(s) => s,
            Err(e) => {
                writer.fail(&e.to_string());
                leave(&p2p, &swarm_key, false).await;
                return Start::Failed(e);
            }
        },
    };
    if size < p2p.threshold && holders_only.is_none() {
        if resp.role == Role::Source {
            // Elected before anyone knew the size (an image config, a small layer):
            // the tracker learns it, so the nodes waiting on this election fetch it
            // directly too, and this node leaves a swarm that has no use.
            let mut req = AnnounceRequest::new(&p2p.node, &p2p.addr, &p2p.topology, &swarm_key);
            req.size = Some(size);
            req.leaving = true;
            let p2p = p2p.clone();
            tokio::spawn(async move {
                if p2p.announce(&req).await.is_err() {
                    p2p.metrics.tracker_errors.inc();
                }
            });
        }
        return Start::NotSwarm(writer, first_answer);
    }
    let first_stream = first_answer.map(|r| r.stream);
    let whole = holders_only.and_then(|_| PieceLayout::whole(size));
    let piece_size = if let Some(whole) = whole {
        // Holders serve any layout of the size they hold: one piece needs no hashes.
        whole.piece_size
    } else if resp.piece_size > 1 {
        resp.piece_size
    } else {
        p2p.piece_size_for(size)
    };
    // The tracker relays what the first announcer proposed: checked like any input.
    let layout = match PieceLayout::checked(size, piece_size) {
        Ok(l) => l,
        Err(e) => {
            warn!(digest = %d, error = %e, "swarm geometry refused; fetching from the registry directly");
            leave(&p2p, &swarm_key, false).await;
            return Start::NotSwarm(writer, None);
        }
    };
    writer.expect_total(size);
    if let Err(e) = writer.reserve() {
        warn!(digest = %d, error = %e, "cannot cache blob; streaming it without caching");
        writer.fail(&e.to_string());
        // This node joined, and may have been elected, but will hold nothing: said
        // at once, or its swarm waits out the tracker's TTL for a source that serves
        // nobody (5.7 s in `a_source_whose_disk_fills_mid_blob_hands_its_swarm_on`).
        leave(&p2p, &swarm_key, false).await;
        return Start::Passthrough(size);
    }
    let (w, claims) = writer.into_pieces(layout);
    let inflight = w.inflight();
    let sched = PieceScheduler::new(
        w.held(),
        layout.piece_size,
        SchedulerConfig {
            seed: seed_for(&p2p.node),
            ..p2p.sched_cfg.clone()
        },
    );
    let registry_streams = p2p.registry_streams;
    let (events_tx, events_rx) = mpsc::channel(1024);
    let (internal_tx, internal_rx) = mpsc::channel(16);
    let mut dl = Download {
        agent,
        p2p,
        registry,
        repo,
        d,
        swarm: swarm_key,
        limit,
        w,
        layout,
        sched,
        hashes: vec![None; layout.count() as usize],
        publish: BTreeMap::new(),
        bad: Vec::new(),
        role: Role::Peer,
        source: None,
        links: HashMap::new(),
        events_tx,
        internal_tx,
        unverified: HashMap::new(),
        registry_owed: BTreeSet::new(),
        claims,
        runs: HashMap::new(),
        streams: RunStreams::new(),
        registry_streams,
        budgeted: HashSet::new(),
        last_tracker_ok: Instant::now(),
        last_announce: Instant::now(),
        announcing: false,
        last_hash_fetch: None,
        last_peer_hash_ask: None,
        interval: Duration::from_millis(resp.interval_ms.clamp(50, 10_000)),
        clock: Instant::now(),
        started: Instant::now(),
        peer_bytes: 0,
        registry_bytes: 0,
        registry_since: None,
        pieces_by_peer: BTreeMap::new(),
        registry_retry_at: None,
        registry_failures: 0,
        origin_refused: None,
        hashes_epoch: None,
        hashes_voided: false,
        holders_only_until: holders_only.map(|_| Instant::now() + holders_patience(size)),
        size_moved: None,
    };
    for (conn, chan) in dl.absorb(resp) {
        conn.close(chan).await;
    }
    dl.p2p
        .downloads
        .lock()
        .insert(dl.d.clone(), dl.events_tx.clone());
    tokio::spawn(dl.run(events_rx, internal_rx, first_stream));
    Start::Started(inflight, size)
}

/// [`start`] from the members that hold the blob whole ([`Want::FromHolders`]): the
/// download and the blob's size, or `None` when nobody can give it at a size of at most
/// `max_size` (then `writer` has failed, and its readers with it).
pub(crate) async fn start_from_holders(
    agent: Agent,
    registry: &str,
    repo: &str,
    d: &Digest,
    writer: Box<BlobWriter>,
    limit: Option<Arc<TokenBucket>>,
    max_size: u64,
) -> Option<(Arc<Inflight>, u64)> {
    let want = Want::FromHolders { max_size };
    let started = start(
        agent,
        registry.to_owned(),
        repo.to_owned(),
        d.clone(),
        writer,
        limit,
        want,
    )
    .await;
    match started {
        Start::Started(inf, total) => Some((inf, total)),
        Start::NotSwarm(mut w, _) => {
            w.fail("no member holds it whole, and the registry cannot answer");
            None
        }
        Start::Passthrough(_) | Start::Failed(_) => None,
    }
}

/// Tells the tracker this node holds nothing any more of the blob whose swarm is
/// `swarm` (a download that failed, or a blob whose file disappeared).
pub(crate) async fn leave(p2p: &P2p, swarm: &Digest, hashes_void: bool) {
    leave_reporting(p2p, swarm, hashes_void, Vec::new()).await;
}

/// [`leave`], reporting `bad_peers` on the way out.
async fn leave_reporting(p2p: &P2p, swarm: &Digest, hashes_void: bool, bad_peers: Vec<String>) {
    let mut req = AnnounceRequest::new(&p2p.node, &p2p.addr, &p2p.topology, swarm);
    req.leaving = true;
    req.hashes_void = hashes_void;
    req.bad_peers = bad_peers;
    let _ = p2p.announce(&req).await;
}

/// The registry's size for `d` when a manifest this agent served declared another than
/// `said`, the swarm's; `None` when they agree, nothing was declared, or the registry
/// does not answer (the swarm's size stands then: the final digest check still holds).
async fn registry_size_if_declared_otherwise(
    agent: &Agent,
    registry: &str,
    repo: &str,
    d: &Digest,
    said: u64,
) -> Option<u64> {
    let declared = agent.declared_sizes.lock().size(registry, repo, d)?;
    if declared == said {
        return None;
    }
    match agent.upstream.head_blob(registry, repo, d).await {
        Ok(size) => Some(size),
        Err(e) => {
            debug!(digest = %d, error = %e, "cannot check the swarm's size with the registry");
            None
        }
    }
}
