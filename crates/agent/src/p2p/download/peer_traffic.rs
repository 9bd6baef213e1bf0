//! A download's traffic with its peers: the scheduler's requests sent over the
//! peers' channels, and what comes back (holdings, pieces, rejections, lost links),
//! with the cancellations that keep the source's uplink for pieces nobody else has.

use super::*;

impl Download {
    /// Sends the scheduler's next requests over the peers' channels.
    pub(super) async fn schedule(&mut self) {
        let now = self.now_ms();
        let avail = self.p2p.budget.available();
        let reqs = self.sched.next_requests(now, avail);
        for r in reqs {
            if r.piece == 0 {
                debug!(digest = %self.d, peer = %r.peer, ms = self.started.elapsed().as_millis() as u64, urgent = r.urgent, "piece 0 requested");
            }
            let link = self.links.get(&r.peer).and_then(|l| l.conn.clone());
            let Some((conn, chan)) = link else {
                self.sched.on_failed(r.piece, &r.peer, false);
                continue;
            };
            if !r.urgent {
                self.p2p.budget.take(1);
                self.budgeted.insert((r.piece, r.peer.clone()));
            }
            let before = self.hash_before(r.piece);
            if conn.request(chan, r.piece, r.urgent, before).await.is_err() {
                self.request_ended(r.piece, &r.peer);
                self.lost(&r.peer);
            }
        }
    }

    pub(super) fn request_ended(&mut self, piece: u32, peer: &str) {
        if self.budgeted.remove(&(piece, peer.to_owned())) {
            self.p2p.budget.give_back(1);
        }
    }

    /// A connection that failed: its requests end, and the link is dialled again
    /// shortly. A holder whose connections keep failing while it is asked for pieces
    /// (it completes the handshake, then answers no PING) is reported like a silent
    /// one after `UNREACHABLE_AFTER` losses without a piece between them: each new
    /// connection started `SILENT_HOLDER_MS` over, so an only holder that did this
    /// held its downloaders for good.
    pub(super) fn lost(&mut self, peer: &str) {
        let outstanding = self.sched.remove_peer(peer);
        let asked = !outstanding.is_empty();
        for piece in outstanding {
            self.request_ended(piece, peer);
        }
        if let Some(l) = self.links.get_mut(peer) {
            l.conn = None;
            l.connecting = false;
            l.retry_at = Some(Instant::now() + Duration::from_secs(1));
            l.lost_while_asked += asked as u32;
            if l.lost_while_asked >= UNREACHABLE_AFTER {
                l.lost_while_asked = 0;
                // The connection is gone already: nothing to close.
                let _ = self.report_holder(
                    peer,
                    "its connections keep failing while it is asked for pieces",
                );
            }
        }
    }

    /// Reports a holder that delivers nothing of this blob (`why`) to the tracker,
    /// which then leaves it out of this node's handouts (everyone's, on a quorum) and,
    /// if it was the only holder, elects this node to read the registry. Its requests
    /// end and its link rests as long as a report lasts; the caller closes the
    /// channel it returns.
    fn report_holder(
        &mut self,
        peer: &str,
        why: &'static str,
    ) -> Option<(Arc<PeerConn>, ChannelId)> {
        warn!(digest = %self.d, %peer, "{why}; reported to the tracker");
        self.p2p.metrics.peers_silent.inc();
        if !self.bad.iter().any(|b| b == peer) {
            self.bad.push(peer.to_owned());
        }
        for piece in self.sched.remove_peer(peer) {
            self.request_ended(piece, peer);
        }
        let l = self.links.get_mut(peer)?;
        l.retry_at = Some(Instant::now() + Duration::from_secs(60));
        l.conn.take()
    }

    /// Asks each holder on an open channel for the HAVEs this download can use now
    /// (`swarm::links::HaveFilter::for_link`: a far holder, only this node's rack
    /// stripe until the stripe goes quiet), where that changed.
    pub(super) async fn sync_have_filters(&mut self) {
        let stripe = self.sched.far_have_stripe();
        for l in self.links.values_mut() {
            let Some((conn, chan)) = &l.conn else {
                continue;
            };
            let want = swarm::links::HaveFilter::for_link(l.distance, stripe);
            if want != l.have_filter {
                conn.set_have_filter(*chan, want).await;
                l.have_filter = want;
            }
        }
    }

    /// Dials the links that have no channel yet (shared connections are reused).
    pub(super) fn connect_links(&mut self) {
        let now = Instant::now();
        for (node, l) in self.links.iter_mut() {
            if l.conn.is_some() || l.connecting || l.retry_at.is_some_and(|t| t > now) {
                continue;
            }
            if self.sched.is_banned(node) {
                continue;
            }
            l.connecting = true;
            let (p2p, node, addr, tx) = (
                self.p2p.clone(),
                node.clone(),
                l.addr.clone(),
                self.events_tx.clone(),
            );
            let (inflight, layout, limit) = (self.w.inflight(), self.layout, self.limit.clone());
            tokio::spawn(async move {
                let ev = match p2p.pool.get(&p2p, &node, &addr).await {
                    Ok(conn) => match conn.open(inflight, layout, tx.clone(), limit).await {
                        Ok(chan) => PeerEvent::Connected {
                            peer: node,
                            conn,
                            chan,
                        },
                        Err(e) => PeerEvent::ConnectFailed {
                            peer: node,
                            error: e.to_string(),
                        },
                    },
                    Err(e) => PeerEvent::ConnectFailed {
                        peer: node,
                        error: e.to_string(),
                    },
                };
                let _ = tx.send(ev).await;
            });
        }
    }

    pub(super) async fn on_event(&mut self, ev: PeerEvent) -> Result<(), store::Error> {
        let now = self.now_ms();
        match ev {
            PeerEvent::Discovered { peer, addr } => {
                if !self.links.contains_key(&peer) && self.links.len() < MAX_LINKS {
                    let distance = 2;
                    self.links.insert(peer, Link::new(addr, distance, now));
                    self.connect_links();
                }
            }
            PeerEvent::Connected { peer, conn, chan } => match self.links.get_mut(&peer) {
                Some(l) => {
                    l.connecting = false;
                    l.failed_dials = 0;
                    l.conn = Some((conn, chan));
                    l.have_filter = swarm::links::HaveFilter::ALL;
                    self.sync_have_filters().await;
                }
                None => conn.close(chan).await,
            },
            PeerEvent::ConnectFailed { peer, error } => {
                debug!(digest = %self.d, %peer, %error, "cannot reach peer");
                if let Some(l) = self.links.get_mut(&peer) {
                    l.connecting = false;
                    l.retry_at = Some(Instant::now() + Duration::from_secs(2));
                    l.failed_dials += 1;
                    // Alive for the tracker, useless to this node: without the report
                    // the tracker keeps handing it out, and when it is the only
                    // holder nobody is elected to fetch the blob from the registry.
                    if l.failed_dials >= UNREACHABLE_AFTER {
                        l.failed_dials = 0;
                        warn!(digest = %self.d, %peer, addr = %l.addr, %error, "peer unreachable; reported to the tracker");
                        self.p2p.metrics.peers_unreachable.inc();
                        if !self.bad.contains(&peer) {
                            self.bad.push(peer);
                        }
                    }
                }
            }
            PeerEvent::Holds { peer, have } => {
                debug!(digest = %self.d, %peer, ms = self.started.elapsed().as_millis() as u64, held = have.as_ref().map_or(u32::MAX, |h| h.count()), "peer holds");
                let distance = self.links.get(&peer).map_or(2, |l| l.distance);
                self.sched.set_peer_at(&peer, have, distance, now);
            }
            PeerEvent::NotHeld { peer } => {
                for piece in self.sched.remove_peer(&peer) {
                    self.request_ended(piece, &peer);
                }
                if let Some(l) = self.links.get_mut(&peer) {
                    if let Some((conn, chan)) = l.conn.take() {
                        conn.close(chan).await;
                    }
                    l.retry_at = Some(Instant::now() + Duration::from_secs(2));
                }
            }
            PeerEvent::Have { peer, piece, hash } => {
                if let Some(h) = hash {
                    // Only the elected source's word on a hash counts: it read the
                    // piece from the registry. Anyone else's is ignored.
                    if self.source.as_deref() == Some(peer.as_str()) {
                        if let Some(slot) = self.hashes.get_mut(piece as usize) {
                            slot.get_or_insert(h);
                        }
                    }
                }
                self.sched.peer_has(&peer, piece, now);
                self.retarget(piece, &peer).await;
                self.settle_unverified().await?;
            }
            PeerEvent::Progress { peer } => self.sched.on_progress(&peer, now),

            PeerEvent::Received { peer, piece, hash } => {
                self.request_ended(piece, &peer);
                if let Some(l) = self.links.get_mut(&peer) {
                    l.useful_ms = now;
                    l.lost_while_asked = 0;
                    l.refused_since_ms = None;
                }
                self.check_piece(piece, &peer, hash).await?;
            }
            PeerEvent::Dropped { peer, piece } => {
                self.request_ended(piece, &peer);
                self.sched.forget(piece, &peer);
            }
            PeerEvent::Rejected {
                peer,
                piece,
                reason,
            } => {
                self.request_ended(piece, &peer);
                // A holder said it has the whole blob (its store's record) and now
                // lacks a piece of it: its file is gone, or it lies. Either way it
                // holds nothing for this node, and after this answer this node
                // would ask it nothing more while the tracker still counted it a
                // holder: a pull whose only holder did this waited for good.
                if matches!(reason, RejectReason::NotHeld) && self.sched.peer_is_complete(&peer) {
                    let why = "it said it holds the whole blob, then lacked a piece of it";
                    if let Some((conn, chan)) = self.report_holder(&peer, why) {
                        conn.close(chan).await;
                    }
                    return Ok(());
                }
                match reason {
                    RejectReason::Busy => self.sched.on_busy(piece, &peer, now),
                    RejectReason::NotHeld => self.sched.on_not_held(piece, &peer),
                    RejectReason::Invalid => self.sched.on_failed(piece, &peer, false),
                    RejectReason::Cancelled => self.sched.on_cancelled(piece, &peer, now),
                }
                // (A cancel is this node's own doing.)
                if !matches!(reason, RejectReason::Cancelled) {
                    self.refused_without_pieces(&peer, now).await;
                }
            }
            PeerEvent::Hashes {
                peer,
                first,
                hashes,
            } => {
                // The elected source's (sent after its bitfield), trusted as its HAVEs'
                // hashes are; a complete peer's come from a digest-verified blob, used
                // only when no source publishes (see `takes_peer_hash_lists`).
                let from_source = self.source.as_deref() == Some(peer.as_str());
                if from_source
                    || (self.takes_peer_hash_lists() && self.sched.peer_is_complete(&peer))
                {
                    for (k, h) in hashes.into_iter().enumerate() {
                        if let Some(slot) = self.hashes.get_mut(first as usize + k) {
                            slot.get_or_insert(h);
                        }
                    }
                    debug!(digest = %self.d, %peer, from_source, "piece hashes taken from a peer");
                    self.settle_unverified().await?;
                }
            }
            PeerEvent::Lost { peer } => self.lost(&peer),
        }
        Ok(())
    }

    /// A fresh piece now also at `holder`: a request for it still waiting in the
    /// source's line is cancelled, so the source's uplink goes to pieces nobody else
    /// has and this piece comes from the peer that has it.
    pub(super) async fn retarget(&mut self, piece: u32, holder: &str) {
        let Some(source) = self
            .sched
            .retarget_on_have(piece, holder, self.source.as_deref())
        else {
            return;
        };
        if let Some((conn, chan)) = self.links.get(&source).and_then(|l| l.conn.clone()) {
            if !conn.is_receiving(chan, piece) {
                conn.cancel(chan, piece).await;
            }
        }
    }

    /// Requests kept waiting past the stall timeout (swarms of 64 or more): cancelled
    /// unless their bytes have begun; the holder's REJECT (cancelled) then opens the
    /// piece for another holder (`PieceScheduler::on_cancelled`).
    pub(super) async fn cancel_stalled(&mut self) {
        let now = self.now_ms();
        for r in self.sched.stalled_requests(now) {
            if let Some((conn, chan)) = self.links.get(&r.peer).and_then(|l| l.conn.clone()) {
                if !conn.is_receiving(chan, r.piece) {
                    self.p2p.metrics.stall_cancels.inc();
                    conn.cancel(chan, r.piece).await;
                }
            }
        }
    }

    /// Holders asked for pieces that sent nothing for `SILENT_HOLDER_MS` (or, while
    /// they send this node other blobs, `SILENT_WHILE_BUSY_MS`) are reported
    /// (`report_holder`), and so is one that began
    /// `swarm::upload::starving_after_pieces` other pieces on the connection while one
    /// request of this blob waited, whether those were this blob's or others'. A peer's
    /// claim to hold pieces is worth what it delivers: before, one that claimed a whole
    /// blob and sent nothing held every newcomer for good, and one that sent every
    /// piece but the blob's first held its reader until the rest had come. A blob of
    /// fewer pieces than the count still waits `SILENT_HOLDER_MS` after its others.
    pub(super) async fn drop_silent_holders(&mut self) {
        let now = self.now_ms();
        let starving_after = swarm::upload::starving_after_pieces(self.p2p.budget.limit());
        let starving: Vec<String> = self
            .links
            .iter()
            .filter(|(_, l)| {
                l.conn
                    .as_ref()
                    .is_some_and(|(conn, chan)| conn.most_passed_over(*chan) > starving_after)
            })
            .map(|(peer, _)| peer.clone())
            .collect();
        for peer in starving {
            let why = "it kept passing over a request of this blob while it sent other pieces on the connection";
            if let Some((conn, chan)) = self.report_holder(&peer, why) {
                conn.close(chan).await;
            }
        }
        let past_any_excuse = self.sched.silent_holders(now, SILENT_WHILE_BUSY_MS);
        for peer in self.sched.silent_holders(now, SILENT_HOLDER_MS) {
            // Silent for this blob, but sending this node other blobs' pieces: its
            // line may serve our other requests first for a while (a multi-layer
            // pull), so it is given longer.
            let busy_elsewhere = self
                .links
                .get(&peer)
                .and_then(|l| l.conn.as_ref())
                .is_some_and(|(conn, _)| {
                    conn.received_within(Duration::from_millis(SILENT_HOLDER_MS))
                });
            if busy_elsewhere && !past_any_excuse.contains(&peer) {
                continue;
            }
            let why = if busy_elsewhere {
                "it was asked for pieces of this blob and sent none for 2 min, only other blobs'"
            } else {
                "it was asked for pieces and sent nothing for 30 s"
            };
            if let Some((conn, chan)) = self.report_holder(&peer, why) {
                conn.close(chan).await;
            }
        }
    }

    /// A holder that has only refused this node's requests (busy, not held, invalid)
    /// for `SILENT_HOLDER_MS` since it last delivered a piece of this blob is reported
    /// like a silent one. A refusal ends the request, so the silent check (requests
    /// outstanding) never saw such a holder, and as the only holder one that answered
    /// "busy" kept its downloaders asking every 25 ms for good. An honest holder
    /// refuses only while its line is full or its view was stale, and serves its line
    /// and its other pieces in between.
    async fn refused_without_pieces(&mut self, peer: &str, now: u64) {
        let Some(l) = self.links.get_mut(peer) else {
            return;
        };
        let since = *l.refused_since_ms.get_or_insert(now);
        if now.saturating_sub(since) < SILENT_HOLDER_MS {
            return;
        }
        l.refused_since_ms = None;
        let why = "it only refused this node's requests for 30 s";
        if let Some((conn, chan)) = self.report_holder(peer, why) {
            conn.close(chan).await;
        }
    }

    pub(super) async fn cancel_duplicates(&mut self, piece: u32) {
        for peer in self.sched.duplicates_of(piece) {
            self.sched.forget(piece, &peer);
            self.request_ended(piece, &peer);
            if let Some((conn, chan)) = self.links.get(&peer).and_then(|l| l.conn.clone()) {
                conn.cancel(chan, piece).await;
            }
        }
    }
}

/// A peer handed out by the tracker, and our channel to it.
pub(super) struct Link {
    pub(super) addr: String,
    pub(super) distance: u8,
    pub(super) conn: Option<(Arc<PeerConn>, ChannelId)>,
    pub(super) connecting: bool,
    pub(super) retry_at: Option<Instant>,
    /// Whether the tracker still hands it out.
    pub(super) fresh: bool,
    /// When it last gave a piece, or when it was handed out (ms since the task's
    /// start), for `swarm::links::to_drop`.
    pub(super) useful_ms: u64,
    /// The HAVEs asked of its holder on the open channel (all, until a HAVE_FILTER).
    pub(super) have_filter: swarm::links::HaveFilter,
    /// Dials that failed since the last that worked.
    pub(super) failed_dials: u32,
    /// Connections lost with requests of this blob outstanding (no PONG, a payload
    /// stalled) since the holder last delivered a piece of it.
    pub(super) lost_while_asked: u32,
    /// When the holder first refused a request (busy, not held, invalid) since it last
    /// delivered a piece of this blob (ms since the task's start).
    pub(super) refused_since_ms: Option<u64>,
}

impl Link {
    /// A peer just learned of: not connected yet, useful as of `now_ms`.
    pub(super) fn new(addr: String, distance: u8, now_ms: u64) -> Self {
        Self {
            addr,
            distance,
            conn: None,
            connecting: false,
            retry_at: None,
            fresh: true,
            useful_ms: now_ms,
            have_filter: swarm::links::HaveFilter::ALL,
            failed_dials: 0,
            lost_while_asked: 0,
            refused_since_ms: None,
        }
    }
}
