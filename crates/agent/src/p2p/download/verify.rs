//! Pieces received from peers are checked against the elected source's hashes before
//! they count: a match is held (announced, served); a mismatch is dropped, the peer
//! banned locally and reported; pieces that arrived before their hash wait for it.

use super::*;

impl Download {
    /// A piece's bytes are in the file: keep them if their hash matches the trusted
    /// one, wait for the hash if it is not known yet, reject them otherwise.
    pub(super) async fn check_piece(
        &mut self,
        piece: u32,
        peer: &str,
        got: PieceHash,
    ) -> Result<(), store::Error> {
        let now = self.now_ms();
        match self.hashes.get(piece as usize).copied().flatten() {
            Some(want) if want == got => {
                if piece == 0 {
                    debug!(digest = %self.d, %peer, ms = self.started.elapsed().as_millis() as u64, "first piece verified");
                }
                if self.w.mark_received(piece, got).await? {
                    let len = self.layout.len(piece);
                    self.peer_bytes += len;
                    self.p2p.metrics.pieces_from_peers.inc();
                    *self.pieces_by_peer.entry(peer.to_owned()).or_default() += 1;
                }
                self.sched.on_done(piece, peer, now);
                self.cancel_duplicates(piece).await;
            }
            Some(_) => {
                warn!(digest = %self.d, piece, %peer, "piece failed verification; peer reported and avoided");
                self.p2p.metrics.pieces_rejected.inc();
                self.w.inflight().release_piece_claim(piece);
                self.sched.on_failed(piece, peer, true);
                self.bad.push(peer.to_owned());
                if let Some(l) = self.links.get_mut(peer) {
                    if let Some((conn, chan)) = l.conn.take() {
                        conn.close(chan).await;
                    }
                }
            }
            None => {
                // Held in the file, claimed, until the hash arrives.
                self.sched.forget(piece, peer);
                self.sched.claim(piece);
                self.unverified.insert(piece, (peer.to_owned(), got));
            }
        }
        Ok(())
    }

    pub(super) async fn settle_unverified(&mut self) -> Result<(), store::Error> {
        let ready: Vec<u32> = self
            .unverified
            .keys()
            .copied()
            .filter(|&i| self.hashes[i as usize].is_some())
            .collect();
        for piece in ready {
            if let Some((peer, got)) = self.unverified.remove(&piece) {
                self.sched.unclaim(piece);
                let now = self.now_ms();
                if self.hashes[piece as usize] == Some(got) {
                    if self.w.mark_received(piece, got).await? {
                        self.peer_bytes += self.layout.len(piece);
                        self.p2p.metrics.pieces_from_peers.inc();
                        *self.pieces_by_peer.entry(peer.clone()).or_default() += 1;
                    }
                    self.sched.on_done(piece, &peer, now);
                } else {
                    warn!(digest = %self.d, piece, %peer, "piece failed verification; peer reported and avoided");
                    self.p2p.metrics.pieces_rejected.inc();
                    self.w.inflight().release_piece_claim(piece);
                    self.sched.on_failed(piece, &peer, true);
                    self.bad.push(peer);
                }
            }
        }
        // Pieces a previous run left on disk are kept once their hashes check out.
        let ready: Vec<u32> = self
            .claims
            .iter()
            .copied()
            .filter(|&i| self.hashes.get(i as usize).is_some_and(Option::is_some))
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
                    && self.w.verify_existing(i, h).await?
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
