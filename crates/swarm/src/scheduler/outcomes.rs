//! What happens after a request: a piece done, a failure, "busy", "not held", a
//! cancel or a stall; the rate measured from it, which sizes the peer's window.

use super::*;

impl PieceScheduler {
    /// Requests whose bytes may not have begun for `stall_ms` (swarms of
    /// [`STALL_MIN_MEMBERS`] or more).
    /// Each is reported once per `stall_ms`; the caller cancels those whose bytes have
    /// not begun (a holder that has begun sending goes on) and tells the scheduler the
    /// holder's answer with [`PieceScheduler::on_cancelled`].
    pub fn stalled_requests(&mut self, now_ms: u64) -> Vec<Request> {
        if !self.large {
            return Vec::new();
        }
        let mut out = Vec::new();
        for k in 0..self.asked.len() {
            let (piece, slot, at) = self.asked[k];
            if now_ms.saturating_sub(at) < self.cfg.stall_ms {
                continue;
            }
            self.asked[k].2 = now_ms;
            if !self.stall_cancelled.contains(&(piece, slot)) {
                self.stall_cancelled.push((piece, slot));
            }
            out.push(self.request(piece, slot, piece == self.have.prefix()));
        }
        out
    }

    /// The holder confirmed a cancel: the request is gone. One cancelled for a stall
    /// rests the holder, so the piece is asked of someone else.
    pub fn on_cancelled(&mut self, piece: u32, peer: &str, now_ms: u64) {
        let Some(&i) = self.by_name.get(peer) else {
            return;
        };
        let stalled = self.stall_cancelled.contains(&(piece, i));
        if piece < self.have.len() {
            self.release(piece, i);
        }
        if stalled {
            let backoff = self.cfg.stall_backoff_ms;
            if let Some(s) = self.slots[i as usize].as_mut() {
                s.busy_until_ms = s.busy_until_ms.max(now_ms + backoff);
            }
        }
    }

    /// A verified piece arrived from `from` (a peer, or anything else: the registry
    /// stream, the disk). Returns `true` if it was new. Other requests for the piece
    /// (endgame duplicates) stay in flight until they end: the caller cancels them.
    pub fn on_done(&mut self, piece: u32, from: &str, now_ms: u64) -> bool {
        if piece >= self.have.len() {
            return false;
        }
        self.last_arrival_ms = Some(now_ms);
        if let Some(&i) = self.by_name.get(from) {
            self.last_peer_arrival_ms = Some(now_ms);
            self.measure(i, piece, now_ms);
            self.release(piece, i);
            // Only this node's stripe: pieces fetched after the patience ran out
            // would feed the patience back into itself.
            let in_stripe = self.source_stripe.is_some_and(|(idx, n)| piece % n == idx);
            if in_stripe
                && !self.have.get(piece)
                && self.slots[i as usize].as_ref().is_some_and(|s| s.is_source)
            {
                self.measure_fresh_latency(piece, now_ms);
            }
        }
        self.claimed.clear(piece);
        if self.inflight[piece as usize].is_empty() {
            self.inflight_any.clear(piece);
        }
        let new = !self.have.get(piece);
        self.have.set(piece);
        new
    }

    /// The peers still asked for a piece this node now holds (to cancel).
    pub fn duplicates_of(&self, piece: u32) -> Vec<PeerId> {
        self.inflight
            .get(piece as usize)
            .map(|v| {
                v.iter()
                    .filter_map(|&i| {
                        self.slots[i as usize]
                            .as_ref()
                            .map(|_| self.names[i as usize].clone())
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Forgets a request (cancelled, or answered after the piece came from elsewhere).
    pub fn forget(&mut self, piece: u32, peer: &str) {
        if let Some(&i) = self.by_name.get(peer) {
            if piece < self.have.len() {
                self.release(piece, i);
            }
        }
    }

    fn measure(&mut self, slot: u32, piece: u32, now_ms: u64) {
        let piece_size = crate::PieceLayout::nominal_len(self.piece_size, piece) as f64;
        if let Some(s) = self.slots[slot as usize].as_mut() {
            s.last_progress_ms = now_ms;
            if let Some(mark) = s.mark_ms {
                let secs = (now_ms.saturating_sub(mark)).max(1) as f64 / 1000.0;
                let sample = piece_size / secs;
                let rate = if s.rate == 0.0 {
                    sample
                } else {
                    0.7 * s.rate + 0.3 * sample
                };
                s.set_rate(rate, &self.cfg, self.piece_size);
                s.mark_ms = Some(now_ms);
            }
        }
    }

    /// A piece came from the source: how long it took since the source announced it
    /// sets the patience of source stripes.
    fn measure_fresh_latency(&mut self, piece: u32, now_ms: u64) {
        let seen = self.first_seen[piece as usize];
        if seen == u64::MAX {
            return;
        }
        let sample = now_ms.saturating_sub(seen) as f64;
        let smoothed = match self.fresh_latency_ms {
            None => sample,
            Some(prev) => 0.8 * prev + 0.2 * sample,
        };
        self.fresh_latency_ms = Some(smoothed);
        self.source_patience_ms = ((smoothed * self.cfg.source_patience_factor as f64) as u64)
            .clamp(
                self.cfg.source_patience_min_ms,
                self.cfg
                    .source_patience_max_ms
                    .max(self.cfg.source_patience_min_ms),
            );
    }

    /// Bytes arrived from a peer: it is not stalled.
    pub fn on_progress(&mut self, peer: &str, now_ms: u64) {
        self.last_arrival_ms = Some(now_ms);
        if let Some(&i) = self.by_name.get(peer) {
            self.last_peer_arrival_ms = Some(now_ms);
            if let Some(s) = self.slots[i as usize].as_mut() {
                s.last_progress_ms = now_ms;
            }
        }
    }

    /// A request failed. `corrupt` bans the peer: it served bytes that fail the hash.
    pub fn on_failed(&mut self, piece: u32, peer: &str, corrupt: bool) {
        let Some(&i) = self.by_name.get(peer) else {
            return;
        };
        if piece < self.have.len() {
            self.release(piece, i);
        }
        if corrupt {
            self.count_holdings(i, -1, 0);
            if let Some(s) = self.slots[i as usize].as_mut() {
                s.banned = true;
            }
        }
    }

    /// Every request in flight to `peer` ends now: this node closed the peer's channel
    /// (it served a bad piece), so no answer will come on it. Returns the pieces, open
    /// again for other holders or the registry. The peer stays known, and banned if
    /// it was: a closed channel brings no `remove_peer`.
    pub fn release_all_from(&mut self, peer: &str) -> Vec<u32> {
        let Some(&i) = self.by_name.get(peer) else {
            return Vec::new();
        };
        let asked: Vec<u32> = (0..self.inflight.len() as u32)
            .filter(|&p| self.inflight[p as usize].contains(&i))
            .collect();
        for &p in &asked {
            self.release(p, i);
        }
        asked
    }

    /// The peer's upload line is full: leave it alone for a moment.
    pub fn on_busy(&mut self, piece: u32, peer: &str, now_ms: u64) {
        let Some(&i) = self.by_name.get(peer) else {
            return;
        };
        if piece < self.have.len() {
            self.release(piece, i);
        }
        let backoff = self.cfg.busy_backoff_ms;
        if let Some(s) = self.slots[i as usize].as_mut() {
            // Never shortens a longer rest (after a stall; found by the property test).
            s.busy_until_ms = s.busy_until_ms.max(now_ms + backoff);
        }
    }

    /// The peer does not hold a piece it was asked for (a stale view): forget that it
    /// does, and release the request.
    pub fn on_not_held(&mut self, piece: u32, peer: &str) {
        let Some(&i) = self.by_name.get(peer) else {
            return;
        };
        if piece >= self.have.len() {
            return;
        }
        self.release(piece, i);
        let n = self.have.len();
        if let Some(s) = self.slots[i as usize].as_mut() {
            if s.complete {
                let mut all = Bitfield::full(n);
                all.clear(piece);
                self.count_holdings(i, -1, 0);
                if let Some(s) = self.slots[i as usize].as_mut() {
                    s.complete = false;
                    s.held = all.count();
                }
                self.rows.write(i, all.as_bytes());
                self.count_holdings(i, 1, 0);
            } else if self.rows.get(i, piece) {
                self.rows.clear(i, piece);
                s.held -= 1;
                if !s.banned {
                    let near = s.distance == 0;
                    self.count_holder(piece, near, -1);
                }
            }
        }
    }

    /// Marks a piece as being produced elsewhere (the registry stream).
    pub fn claim(&mut self, piece: u32) {
        if piece < self.have.len() && !self.have.get(piece) {
            self.claimed.set(piece);
            self.inflight_any.set(piece);
        }
    }

    /// The registry stream will not produce a claimed piece after all.
    pub fn unclaim(&mut self, piece: u32) {
        if piece < self.have.len() && self.claimed.get(piece) {
            self.claimed.clear(piece);
            if self.inflight[piece as usize].is_empty() {
                self.inflight_any.clear(piece);
            }
        }
    }
}

/// How peers of equal load and distance rank by speed: in doublings of the measured
/// rate, so peers of about the same speed tie and each requester's own order spreads
/// requests over them. A peer not measured yet ranks first, so every holder is tried
/// once: ranked last (rate 0), a holder that joined after the first rates were taken
/// got only what the others left while the request budget was the limit, so it was
/// never measured — at 16 × 8 MiB/s the four agents that started last ran their
/// uplinks at 23–59 % of the limit while the others ran at 96–99 %.
/// Requests in flight a peer measured at `rate` may have: enough to keep it busy for
/// `window_ms`, within `min_window..=max_window` (and 65,535).
pub(super) fn window_for(rate: f64, cfg: &SchedulerConfig, piece_size: u64) -> u16 {
    let by_rate = (rate * cfg.window_ms as f64 / 1000.0 / piece_size as f64).ceil();
    let window = (by_rate as u32).clamp(cfg.min_window, cfg.max_window.max(cfg.min_window));
    window.min(u16::MAX.into()) as u16
}

impl Slot {
    pub(super) fn set_rate(&mut self, rate: f64, cfg: &SchedulerConfig, piece_size: u64) {
        self.rate = rate;
        self.window = window_for(rate, cfg, piece_size);
        self.speed = speed_class(rate);
    }
}

pub(super) fn speed_class(rate: f64) -> u8 {
    if rate > 0.0 {
        // (At most 1,023 for an f64.)
        (rate.max(1.0).log2() as u32).min(u8::MAX as u32 - 1) as u8
    } else {
        u8::MAX
    }
}
