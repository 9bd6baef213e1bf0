//! The request policy: which open piece to ask which peer for, and the windows,
//! stripes and patience that allow it; requests counted in flight and released.

use super::holders::intersects;
use super::*;

/// A peer in the fill loop, with what orders it fixed for the pass.
#[derive(Clone, Debug)]
pub(super) struct Cand {
    slot: u32,
    window: u32,
    distance: u8,
    speed: u8,
    complete: bool,
    tie: u64,
}

impl PieceScheduler {
    /// The window for a peer: its measured rate over `window_ms`, in requests.
    fn window(&self, s: &Slot) -> u32 {
        u32::from(s.window)
    }

    #[cfg(test)]
    fn can_take(&self, s: &Slot, now_ms: u64) -> bool {
        !s.banned && s.busy_until_ms <= now_ms && s.inflight < self.window(s)
    }

    /// May `piece` be fetched from a peer at `distance`? Near peers always; far peers
    /// for this node's stripe, or once the piece has waited `patience_ms` for a near
    /// holder.
    fn far_allowed(&self, piece: u32, distance: u8, now_ms: u64) -> bool {
        match self.stripe {
            Some((idx, n)) if distance > 0 => {
                piece % n == idx
                    || now_ms.saturating_sub(self.first_seen[piece as usize]) >= self.patience_ms()
            }
            _ => true,
        }
    }

    /// May `piece` be asked of the source? Within this node's source stripe, or once it
    /// has waited `source_patience_ms` there for its stripe's member to pass it on.
    fn source_allowed(&self, piece: u32, now_ms: u64) -> bool {
        // A small head piece (`pieces::HEAD_DIVISOR` times smaller than the others) straight
        // from the source to every member of a swarm small enough that all those copies
        // weigh no more than one piece: each node's first byte then waits for one hop,
        // not for the stripe's member to relay it.
        if piece == 0
            && crate::PieceLayout::splits(self.piece_size)
            && (1..=crate::pieces::HEAD_DIVISOR).contains(&(self.members as u64))
        {
            return true;
        }
        match self.source_stripe {
            Some((idx, n)) => {
                piece % n == idx
                    || now_ms.saturating_sub(self.first_seen[piece as usize])
                        >= self.source_patience_ms
            }
            None => true,
        }
    }

    /// Whether this peer may be asked for `piece` now: rack stripes and source stripes.
    fn allowed(&self, piece: u32, s: &Slot, now_ms: u64) -> bool {
        self.far_allowed(piece, s.distance, now_ms)
            && (!s.is_source || self.source_allowed(piece, now_ms))
    }

    /// The next requests to send, already counted as in flight. `max_new` caps the
    /// non-urgent ones (the agent-wide request budget); the read head is not capped.
    pub fn next_requests(&mut self, now_ms: u64, max_new: u32) -> Vec<Request> {
        let mut out = Vec::new();
        if self.have.is_complete() {
            return out;
        }
        // The read head: urgent, to the best holder even past its window.
        let head = self.have.prefix();
        if self.head_since.0 != head {
            self.head_since = (head, now_ms);
        }
        if head < self.have.len() && !self.inflight_any.get(head) {
            if let Some(p) = self.pick_peer(head, now_ms, true, &[]) {
                self.assign(head, p, now_ms);
                out.push(self.request(head, p, true));
                self.head_asked_urgently = Some(head);
            }
        } else if head < self.have.len()
            && self.head_asked_urgently != Some(head)
            && !self.claimed.get(head)
            && self.inflight[head as usize].len() < 2
            && now_ms.saturating_sub(self.head_since.1) >= HEAD_PATIENCE_MS
        {
            // The head was asked for as an ordinary request before it became the head,
            // and that request may wait in a holder's line behind fresher pieces while
            // the reader gets nothing (seen for 20–80 s at 16 × 8 MiB/s): ask another
            // holder urgently, once; the first copy wins and the other is cancelled.
            let busy = self.inflight[head as usize].clone();
            if let Some(p) = self.pick_peer(head, now_ms, true, &busy) {
                self.assign(head, p, now_ms);
                out.push(self.request(head, p, true));
                self.head_asked_urgently = Some(head);
            }
        }
        let mut budget = if self.large {
            max_new.saturating_sub(self.cfg.large_swarm_withheld_requests)
        } else {
            max_new
        };
        let total_cap = self.cfg.max_inflight_total;
        // Fill windows, one request at a time to the least-loaded peer that can take
        // one, so requests spread over peers instead of filling the first.
        let mut total = self.inflight_count();
        if budget > 0
            && total < total_cap
            && self.any_open_piece()
            && self.fill_worth_running(now_ms)
        {
            let mut cands = self.fill_candidates(now_ms);
            while budget > 0 && total < total_cap {
                let Some(k) = self.least_loaded_of(&cands) else {
                    break;
                };
                let p = cands[k].slot;
                match self.best_piece_for(p, now_ms, head) {
                    Some(piece) => {
                        self.assign(piece, p, now_ms);
                        out.push(self.request(piece, p, false));
                        budget -= 1;
                        total += 1;
                    }
                    None => {
                        cands.swap_remove(k);
                    }
                }
            }
            self.cands_scratch = cands;
        }
        // Endgame: every missing piece is in flight and few remain. A duplicate of the
        // read head is urgent like the head; any other duplicate is an ordinary
        // request and takes from `max_new` (found by the scheduler property test: the
        // duplicates overdrew the agent-wide request budget).
        self.endgame_requests(head, budget, now_ms, &mut out);
        out
    }

    /// Endgame: when every missing piece is in flight and few remain, a second peer is
    /// asked for each. A duplicate of the read head is urgent; others take `budget`.
    pub(super) fn endgame_requests(
        &mut self,
        head: u32,
        mut budget: u32,
        now_ms: u64,
        out: &mut Vec<Request>,
    ) {
        let missing = self.have.len() - self.have.count();
        if missing > self.cfg.endgame {
            return;
        }
        let pieces: Vec<u32> = (0..self.have.len())
            .filter(|&i| !self.have.get(i))
            .collect();
        if !pieces.iter().all(|&i| self.inflight_any.get(i)) {
            return;
        }
        for piece in pieces {
            let urgent = piece == head;
            if self.inflight[piece as usize].len() >= 2
                || self.claimed.get(piece)
                || (!urgent && budget == 0)
            {
                continue;
            }
            let busy = self.inflight[piece as usize].clone();
            if let Some(p) = self.pick_peer(piece, now_ms, false, &busy) {
                self.assign(piece, p, now_ms);
                out.push(self.request(piece, p, urgent));
                if !urgent {
                    budget -= 1;
                }
            }
        }
    }

    pub(super) fn request(&self, piece: u32, slot: u32, urgent: bool) -> Request {
        Request {
            piece,
            peer: self.slots[slot as usize]
                .as_ref()
                .map(|_| self.names[slot as usize].clone())
                .unwrap_or_default(),
            urgent,
        }
    }

    /// The peers the fill loop may ask: not banned, not resting, with room in their
    /// window and an open piece (a peer without one now has none later in the same
    /// pass, and a full window stays full: a pass only adds requests), each with its
    /// window (its rate does not change during a pass) and its static tie keys, in
    /// slot order.
    fn fill_candidates(&mut self, now_ms: u64) -> Vec<Cand> {
        // The peers' own fields first: when no peer has room (often, in a big swarm),
        // the piece masks below are not built and no bitfield is read.
        let mut cands = std::mem::take(&mut self.cands_scratch);
        cands.clear();
        cands.extend(
            self.slots
                .iter()
                .enumerate()
                .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
                .filter(|&(_, s)| !s.banned && s.busy_until_ms <= now_ms)
                .filter_map(|(i, s)| {
                    let window = self.window(s);
                    (s.inflight < window).then_some(Cand {
                        slot: i,
                        window,
                        distance: s.distance,
                        speed: s.speed,
                        complete: s.complete,
                        tie: s.tie,
                    })
                }),
        );
        if cands.is_empty() {
            return cands;
        }
        // The open pieces (neither held nor in flight), and those of them a far peer
        // may give, once per pass: each peer is then one AND over the bytes (at 1,000
        // nodes, testing each peer's pieces one by one was a fifth of the run). The
        // masks live in buffers kept between passes.
        let len = self.have.len();
        let mut open = std::mem::take(&mut self.open_scratch);
        let mut open_far = std::mem::take(&mut self.open_far_scratch);
        open.clear();
        open.extend(
            self.have
                .as_bytes()
                .iter()
                .zip(self.inflight_any.as_bytes())
                .map(|(&m, &b)| !m & !b),
        );
        if let Some(last) = open.last_mut() {
            if !len.is_multiple_of(8) {
                *last &= (1u8 << (len % 8)) - 1;
            }
        }
        open_far.clear();
        open_far.extend_from_slice(&open);
        // (Each open piece's patience is read only if a far peer is a candidate: in a
        // large swarm most passes have none with room. And only outside the stripe,
        // for pieces a far peer may hold: every piece if one is complete, else those
        // some partial peer holds.)
        if self.stripe.is_some() && cands.iter().any(|c| c.distance > 0) {
            let every_piece_far = self.complete_holders > self.complete_near_holders;
            let stripe = self.stripe_pieces.as_bytes();
            let held = self.partly_held.as_bytes();
            for (byte, bits) in open_far.iter_mut().enumerate() {
                let far_held = if every_piece_far { 0xff } else { held[byte] };
                let mut rest = *bits & !stripe[byte] & far_held;
                while rest != 0 {
                    let bit = rest.trailing_zeros();
                    rest &= rest - 1;
                    if !self.far_allowed(byte as u32 * 8 + bit, 2, now_ms) {
                        *bits &= !(1u8 << bit);
                    }
                }
            }
        }
        let source_allowed = |mask: &[u8]| -> Vec<u8> {
            let mut out = mask.to_vec();
            for (byte, bits) in out.iter_mut().enumerate() {
                let mut rest = *bits;
                while rest != 0 {
                    let bit = rest.trailing_zeros();
                    rest &= rest - 1;
                    if !self.source_allowed(byte as u32 * 8 + bit, now_ms) {
                        *bits &= !(1u8 << bit);
                    }
                }
            }
            out
        };
        let any_open = |i: u32, s: &Slot| {
            let base = if s.distance > 0 { &open_far } else { &open };
            let for_source;
            let mask = if s.is_source && self.source_stripe.is_some() {
                for_source = source_allowed(base);
                &for_source
            } else {
                base
            };
            if s.complete {
                mask.iter().any(|&b| b != 0)
            } else {
                intersects(mask, self.rows.row(i))
            }
        };
        cands.retain(|c| {
            self.slots[c.slot as usize]
                .as_ref()
                .is_some_and(|s| any_open(c.slot, s))
        });
        self.open_scratch = open;
        self.open_far_scratch = open_far;
        cands
    }

    /// `least_loaded` over the candidates: fewest in flight relative to the window,
    /// then nearest, fastest (in [`speed_class`](super::outcomes::speed_class)es),
    /// partial before complete, this requester's own order. Returns an index into
    /// `cands`.
    fn least_loaded_of(&self, cands: &[Cand]) -> Option<usize> {
        let mut best: Option<(usize, f64)> = None;
        for (k, c) in cands.iter().enumerate() {
            let inflight = self.slots[c.slot as usize]
                .as_ref()
                .map_or(u32::MAX, |s| s.inflight);
            if inflight >= c.window {
                continue;
            }
            let load = inflight as f64 / c.window as f64;
            let better = match best {
                None => true,
                Some((b, bl)) => {
                    let o = &cands[b];
                    load.total_cmp(&bl)
                        .then(c.distance.cmp(&o.distance))
                        .then(o.speed.cmp(&c.speed))
                        .then(c.complete.cmp(&o.complete))
                        .then(c.tie.cmp(&o.tie))
                        .is_lt()
                }
            };
            if better {
                best = Some((k, load));
            }
        }
        best.map(|(k, _)| k)
    }

    /// Whether a scheduling pass could now ask the peer with this handle for `piece`
    /// (or for another of its pieces, which is no different for the caller): the piece
    /// is open, the peer usable and allowed to serve it, with room in its window (the
    /// read head needs none); in endgame, always. A caller that ran a pass since
    /// anything else changed needs no new pass for a HAVE without this.
    pub fn could_request_from(&self, handle: u32, piece: u32, now_ms: u64) -> bool {
        if piece >= self.have.len() || self.have.get(piece) {
            return false;
        }
        if self.have.len() - self.have.count() <= self.cfg.endgame {
            return true;
        }
        if self.inflight_any.get(piece) {
            return false;
        }
        let Some(s) = self.slots.get(handle as usize).and_then(Option::as_ref) else {
            return false;
        };
        self.holds(handle, s, piece)
            && s.busy_until_ms <= now_ms
            && self.allowed(piece, s, now_ms)
            && (piece == self.have.prefix() || s.inflight < self.window(s))
    }

    /// `any_fillable_piece`, and in debug builds a check that a pass it skips would
    /// have found no peer to ask.
    fn fill_worth_running(&mut self, now_ms: u64) -> bool {
        let worth = self.any_fillable_piece(now_ms);
        if cfg!(debug_assertions) && !worth {
            let cands = self.fill_candidates(now_ms);
            assert!(
                cands.is_empty(),
                "a skipped pass had peers to ask: {cands:?}"
            );
            self.cands_scratch = cands;
        }
        worth
    }

    /// Each byte of the open pieces (neither held nor in flight), ANDed with `mask`'s
    /// if there is one (a bitfield of the blob's length).
    fn open_and<'a>(
        &'a self,
        mask: Option<&'a Bitfield>,
    ) -> impl Iterator<Item = (usize, u8)> + 'a {
        let mask = mask.map(Bitfield::as_bytes);
        self.have
            .as_bytes()
            .iter()
            .zip(self.inflight_any.as_bytes())
            .enumerate()
            .map(move |(i, (&mine, &infl))| (i, !mine & !infl & mask.map_or(0xff, |m| m[i])))
    }

    /// Whether some unbanned peer may hold a piece neither held nor in flight: without
    /// one no peer has an open piece, and the fill loop need not look at each peer.
    fn any_open_piece(&self) -> bool {
        self.complete_holders > 0 || self.open_and(Some(&self.partly_held)).any(|(_, b)| b != 0)
    }

    /// With rack stripes, whether some open piece has a holder this node may ask now: one
    /// in its rack, or one outside it once `far_allowed`. Without one the fill loop
    /// finds nothing, and it is not run: at 1,000 simulated nodes a quarter of the
    /// passes that reached it found peers with room but nothing they may give, each
    /// after reading every peer's slot and row. Without stripes every holder may be
    /// asked (`any_open_piece`).
    fn any_fillable_piece(&self, now_ms: u64) -> bool {
        if self.stripe.is_none()
            || self.complete_near_holders > 0
            || self
                .open_and(Some(&self.partly_held_near))
                .any(|(_, b)| b != 0)
        {
            return true;
        }
        // No open piece is held in the rack: those held outside it (every one, with a
        // complete far holder), ripe or in stripe.
        let every_piece_far = self.complete_holders > self.complete_near_holders;
        let mut far = self.open_and((!every_piece_far).then_some(&self.partly_held));
        let len = self.have.len();
        let stripe = self.stripe_pieces.as_bytes();
        far.any(|(byte, far_held)| {
            if far_held & stripe[byte] != 0 {
                return true;
            }
            let mut rest = far_held & !stripe[byte];
            while rest != 0 {
                let piece = byte as u32 * 8 + rest.trailing_zeros();
                rest &= rest - 1;
                if piece < len && self.far_allowed(piece, 1, now_ms) {
                    return true;
                }
            }
            false
        })
    }

    /// Load order: fewest in flight relative to the window, then nearest, then fastest,
    /// then partial before complete (so seeds are not the only uploaders).
    #[cfg(test)]
    pub(super) fn least_loaded(&self, now_ms: u64, exclude: &[u32]) -> Option<u32> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
            .filter(|(i, s)| self.can_take(s, now_ms) && !exclude.contains(i))
            .min_by(|(_, a), (_, b)| {
                let la = a.inflight as f64 / self.window(a) as f64;
                let lb = b.inflight as f64 / self.window(b) as f64;
                la.total_cmp(&lb)
                    .then(a.distance.cmp(&b.distance))
                    .then(b.speed.cmp(&a.speed))
                    .then(a.complete.cmp(&b.complete))
                    .then(a.tie.cmp(&b.tie))
            })
            .map(|(i, _)| i)
    }

    /// The rarest open piece this peer holds; ties go to the group of pieces nearest
    /// the read head, then in this node's seeded order.
    pub(super) fn best_piece_for(&self, slot: u32, now_ms: u64, head: u32) -> Option<u32> {
        let group = self.cfg.order_group.max(1);
        let s = self.slots[slot as usize].as_ref()?;
        let have = self.have.as_bytes();
        let busy = self.inflight_any.as_bytes();
        let theirs = (!s.complete).then(|| self.rows.row(slot));
        let mut best: Option<((u32, u32, u64), u32)> = None;
        for (byte, (&mine, &infl)) in have.iter().zip(busy).enumerate() {
            let mut open = !mine & !infl;
            if let Some(t) = theirs {
                open &= t[byte];
            }
            while open != 0 {
                let bit = open.trailing_zeros();
                open &= open - 1;
                let piece = byte as u32 * 8 + bit;
                if piece >= self.have.len() {
                    continue;
                }
                // The key's parts in order, each only while the piece can still win:
                // most lose on the holder count, before the divisions below.
                let holders = self.usable_holders(piece);
                if best.is_some_and(|((h, _, _), _)| holders > h) || !self.allowed(piece, s, now_ms)
                {
                    continue;
                }
                let key = (
                    holders,
                    piece.saturating_sub(head) / group,
                    mix(self.cfg.seed, piece),
                );
                if best.is_none_or(|(k, _)| key < k) {
                    best = Some((key, piece));
                }
            }
        }
        best.map(|(_, p)| p)
    }

    /// The best peer for one piece: idle before busy, near before far, fast before
    /// slow. `urgent` ignores windows (not bans or "busy" answers).
    pub(super) fn pick_peer(
        &self,
        piece: u32,
        now_ms: u64,
        urgent: bool,
        exclude: &[u32],
    ) -> Option<u32> {
        // Often nobody holds the read head yet; then no slot need be read.
        if self.usable_holders(piece) == 0 {
            return None;
        }
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s)))
            // The slot's own fields before its bitfield (another allocation, a cache
            // miss per peer in a simulated swarm).
            .filter(|(i, s)| {
                s.busy_until_ms <= now_ms
                    && (urgent || s.inflight < self.window(s))
                    && !exclude.contains(i)
                    && self.allowed(piece, s, now_ms)
                    && self.holds(*i, s, piece)
            })
            .min_by(|(_, a), (_, b)| {
                a.inflight
                    .cmp(&b.inflight)
                    .then(a.distance.cmp(&b.distance))
                    .then(b.speed.cmp(&a.speed))
                    .then(a.complete.cmp(&b.complete))
                    .then(a.tie.cmp(&b.tie))
            })
            .map(|(i, _)| i)
    }

    pub(super) fn assign(&mut self, piece: u32, slot: u32, now_ms: u64) {
        self.inflight[piece as usize].push(slot);
        self.inflight_any.set(piece);
        if self.large {
            self.asked.push((piece, slot, now_ms));
        }
        if let Some(s) = self.slots[slot as usize].as_mut() {
            if s.inflight == 0 {
                s.mark_ms = Some(now_ms);
                s.last_progress_ms = now_ms;
            }
            s.inflight += 1;
            self.inflight_total += 1;
        }
    }

    pub(super) fn release(&mut self, piece: u32, slot: u32) {
        let v = &mut self.inflight[piece as usize];
        if let Some(at) = v.iter().position(|&x| x == slot) {
            v.swap_remove(at);
            if let Some(k) = self
                .asked
                .iter()
                .position(|&(p, sl, _)| p == piece && sl == slot)
            {
                self.asked.swap_remove(k);
            }
            if let Some(k) = self
                .stall_cancelled
                .iter()
                .position(|&x| x == (piece, slot))
            {
                self.stall_cancelled.swap_remove(k);
            }
            if let Some(s) = self.slots[slot as usize].as_mut() {
                if s.inflight > 0 {
                    s.inflight -= 1;
                    self.inflight_total -= 1;
                }
                if s.inflight == 0 {
                    s.mark_ms = None;
                }
            }
        }
        if v.is_empty() {
            // Give the memory back: 10,000 simulated schedulers keep these.
            *v = Vec::new();
            if !self.claimed.get(piece) {
                self.inflight_any.clear(piece);
            }
        }
    }

    /// A HAVE made `piece` available at `holder`. If this node's only request for it
    /// waits at `source` (the blob's registry fetcher), returns the source: the caller
    /// cancels that request unless its bytes already flow, so the source's uplink goes
    /// to pieces nobody else holds and this one comes from `holder`.
    pub fn retarget_on_have(
        &self,
        piece: u32,
        holder: &str,
        source: Option<&str>,
    ) -> Option<PeerId> {
        let source = source?;
        // Not in flight (the common case): no request to move, and no need to look
        // at the per-piece request lists (nor to compare names).
        if piece >= self.have.len()
            || self.have.get(piece)
            || !self.inflight_any.get(piece)
            || holder == source
        {
            return None;
        }
        let asked = &self.inflight[piece as usize];
        match asked.as_slice() {
            [only] => {
                self.slots[*only as usize].as_ref()?;
                let name = &self.names[*only as usize];
                (name == source).then(|| name.clone())
            }
            _ => None,
        }
    }

    /// [`PieceScheduler::retarget_on_have`] by handle ([`PieceScheduler::peer_handle`])
    /// for a HAVE from a peer other than the source: whether this node's only request
    /// for `piece` waits at the peer with handle `source`. No names are read: in a
    /// simulated swarm, reading the request's slot and name cost two cache misses per
    /// HAVE for a piece in flight.
    pub fn retarget_on_have_handle(&self, piece: u32, source: u32) -> bool {
        piece < self.have.len()
            && !self.have.get(piece)
            && self.inflight_any.get(piece)
            && self.inflight[piece as usize].as_slice() == [source]
    }

    /// The next run of consecutive pieces to fetch from the registry: pieces nobody
    /// can give (`everything`: every piece not on its way, when there is no tracker),
    /// skipping those `busy` says are being produced otherwise. A piece whose hash
    /// `hash_known` says is unknown counts as nobody's, whoever holds it: a copy from
    /// a peer could not be checked, and the source is the one who hashes it. (A
    /// source elected after a Redis restart lost the old source's hashes while its
    /// pieces were still held: asking their holders again and again, it stalled.)
    pub fn registry_run(
        &self,
        everything: bool,
        busy: impl Fn(u32) -> bool,
        hash_known: impl Fn(u32) -> bool,
    ) -> Option<(u32, u32)> {
        let want = |i: u32| {
            !self.have.get(i)
                && !self.inflight_any.get(i)
                && !busy(i)
                && (everything || self.usable_holders(i) == 0 || !hash_known(i))
        };
        let first = (0..self.have.len()).find(|&i| want(i))?;
        let mut end = first + 1;
        while end < self.have.len() && want(end) {
            end += 1;
        }
        Some((first, end))
    }
}
