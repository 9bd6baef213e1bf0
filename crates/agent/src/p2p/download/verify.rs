//! Pieces received from peers are checked against the elected source's hashes before
//! they count: a match is held (announced, served); a mismatch is dropped, the peer
//! banned locally and reported; pieces that arrived before their hash wait for it.
//!
//! A piece's hash continues the blob's sha256 from the hash of the piece before it
//! (`swarm::chain`), so a connection hashes a piece as it arrives only when that hash
//! was known at request time; otherwise the stored piece is hashed once it is.

use super::*;

/// What checking a received piece against the trusted hashes found.
enum Check {
    Match(Option<PieceHash>, PieceHash),
    Mismatch,
    /// A hash it needs is not known yet.
    Wait,
}

impl Download {
    /// The trusted hash of the piece before `piece` (the first piece needs none).
    pub(super) fn hash_before(&self, piece: u32) -> Option<PieceHash> {
        piece
            .checked_sub(1)
            .and_then(|j| self.hashes.get(j as usize).copied().flatten())
    }

    async fn check(&mut self, piece: u32, got: Option<PieceHash>) -> Result<Check, store::Error> {
        let Some(want) = self.hashes.get(piece as usize).copied().flatten() else {
            return Ok(Check::Wait);
        };
        let before = self.hash_before(piece);
        let got = match got {
            Some(h) => Some(h),
            None => {
                let h = self.w.hash_stored(piece, before).await?;
                if h.is_some() {
                    self.p2p.metrics.pieces_hashed_from_disk.inc();
                }
                h
            }
        };
        Ok(match got {
            None => Check::Wait,
            Some(h) if h == want => Check::Match(before, h),
            Some(_) => Check::Mismatch,
        })
    }

    /// A piece's bytes are in the file: keep them if their hash matches the trusted
    /// one, wait for the hashes if they are not known yet, reject them otherwise.
    pub(super) async fn check_piece(
        &mut self,
        piece: u32,
        peer: &str,
        got: Option<PieceHash>,
    ) -> Result<(), store::Error> {
        match self.check(piece, got).await? {
            Check::Match(before, hash) => {
                if piece == 0 {
                    debug!(digest = %self.d, %peer, ms = self.started.elapsed().as_millis() as u64, "first piece verified");
                }
                self.accept(piece, peer, before, hash).await?;
                self.cancel_duplicates(piece).await;
            }
            Check::Mismatch => {
                self.reject(piece, peer.to_owned());
                // Its channel closes below and no answer will come on it: its other
                // requests end now. (A piece on its way from the liar stayed "in
                // flight" for good; the pull stopped at it, the registry never asked.)
                for other in self.sched.release_all_from(peer) {
                    self.request_ended(other, peer);
                }
                if let Some(l) = self.links.get_mut(peer) {
                    if let Some((conn, chan)) = l.conn.take() {
                        conn.close(chan).await;
                    }
                }
            }
            Check::Wait => {
                // Held in the file, claimed, until the hashes arrive.
                self.sched.forget(piece, peer);
                self.sched.claim(piece);
                self.unverified.insert(piece, (peer.to_owned(), got));
            }
        }
        Ok(())
    }

    async fn accept(
        &mut self,
        piece: u32,
        peer: &str,
        before: Option<PieceHash>,
        hash: PieceHash,
    ) -> Result<(), store::Error> {
        if self.w.mark_received(piece, before, hash).await? {
            self.peer_bytes += self.layout.len(piece);
            self.p2p.metrics.pieces_from_peers.inc();
            *self.pieces_by_peer.entry(peer.to_owned()).or_default() += 1;
        }
        self.sched.on_done(piece, peer, self.now_ms());
        Ok(())
    }

    fn reject(&mut self, piece: u32, peer: String) {
        warn!(digest = %self.d, piece, %peer, "piece failed verification; peer reported and avoided");
        self.p2p.metrics.pieces_rejected.inc();
        self.w.inflight().release_piece_claim(piece);
        self.sched.on_failed(piece, &peer, true);
        self.bad.push(peer);
    }

    /// Pieces from peers waiting for a hash that only this node can now compute: it
    /// reads from the registry itself (elected source, or no tracker), so nobody else
    /// will publish those hashes, and its own chain of hashes cannot pass a piece the
    /// registry has not given. Their bytes go and registry runs fetch the pieces.
    /// (Such a piece comes from a peer before any hash, when this node is then elected
    /// in the place of a source that died or of a seeder it reported.)
    pub(super) fn drop_unverifiable(&mut self) {
        let stuck: Vec<u32> = self
            .unverified
            .keys()
            .copied()
            .filter(|&i| self.hashes[i as usize].is_none())
            .collect();
        if stuck.is_empty() {
            return;
        }
        debug!(digest = %self.d, pieces = stuck.len(), "pieces from peers dropped: their hashes are this node's to compute");
        for piece in stuck {
            self.unverified.remove(&piece);
            self.w.inflight().release_piece_claim(piece);
            self.sched.unclaim(piece);
        }
    }

    pub(super) async fn settle_unverified(&mut self) -> Result<(), store::Error> {
        let ready: Vec<u32> = self
            .unverified
            .keys()
            .copied()
            .filter(|&i| self.hashes[i as usize].is_some())
            .collect();
        for piece in ready {
            let Some((peer, got)) = self.unverified.get(&piece).cloned() else {
                continue;
            };
            let check = self.check(piece, got).await?;
            if matches!(check, Check::Wait) {
                continue;
            }
            self.unverified.remove(&piece);
            self.sched.unclaim(piece);
            match check {
                Check::Match(before, hash) => self.accept(piece, &peer, before, hash).await?,
                _ => self.reject(piece, peer),
            }
        }
        // Pieces a previous run left on disk are kept once their hashes check out.
        let ready: Vec<u32> = self
            .claims
            .iter()
            .copied()
            .filter(|&i| {
                self.hashes.get(i as usize).is_some_and(Option::is_some)
                    && (i == 0 || self.hash_before(i).is_some())
            })
            .collect();
        if !ready.is_empty() {
            self.claims.retain(|i| !ready.contains(i));
            let mut kept = 0;
            for i in ready {
                let Some(h) = self.hashes[i as usize] else {
                    continue;
                };
                if !self.sched.have().get(i)
                    && !self.sched.is_inflight(i)
                    && self.w.verify_existing(i, self.hash_before(i), h).await?
                {
                    self.sched.on_done(i, "disk", self.now_ms());
                    kept += 1;
                }
            }
            if kept > 0 {
                info!(digest = %self.d, pieces = kept, "kept verified pieces from before the restart");
            }
        }
        Ok(())
    }
}
