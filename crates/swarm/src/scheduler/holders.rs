//! Who holds what: each peer's pieces (a row of one allocation per peer), the holder
//! counts per piece, and the queries about peers.

use super::outcomes::{speed_class, window_for};
use super::*;

/// Every peer's bitfield, one row per slot, all in one allocation: a scheduling pass
/// tests each peer's pieces, and a HAVE sets one bit, which in a simulated swarm of
/// 10,000 schedulers was a cache miss per peer while each bitfield had an allocation
/// of its own. A complete peer's row is not read.
#[derive(Clone, Debug, Default)]
pub(super) struct Rows {
    pub(super) bytes: Vec<u8>,
    /// Bytes per row (the blob's bitfield length).
    pub(super) width: usize,
}

/// Whether two bitfields' bytes share a set bit: eight bytes at a time, a 64-byte
/// block between checks (a scheduling pass asks it of every candidate peer, and byte
/// by byte with an exit after each was a twentieth of the simulator's 10,000-node run).
pub(super) fn intersects(a: &[u8], b: &[u8]) -> bool {
    let word = |c: &[u8]| u64::from_ne_bytes(c.try_into().unwrap_or([0; 8]));
    let (mut a, mut b) = (a, b);
    while !a.is_empty() && !b.is_empty() {
        let n = a.len().min(b.len()).min(64);
        let (ha, ta) = a.split_at(n);
        let (hb, tb) = b.split_at(n);
        let mut any = 0u64;
        let (ca, cb) = (ha.chunks_exact(8), hb.chunks_exact(8));
        for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
            any |= (x & y) as u64;
        }
        for (x, y) in ca.zip(cb) {
            any |= word(x) & word(y);
        }
        if any != 0 {
            return true;
        }
        (a, b) = (ta, tb);
    }
    false
}

impl Rows {
    pub(super) fn row(&self, slot: u32) -> &[u8] {
        let at = slot as usize * self.width;
        &self.bytes[at..at + self.width]
    }

    pub(super) fn get(&self, slot: u32, piece: u32) -> bool {
        self.bytes[slot as usize * self.width + (piece / 8) as usize] & (1 << (piece % 8)) != 0
    }

    fn set(&mut self, slot: u32, piece: u32) {
        self.bytes[slot as usize * self.width + (piece / 8) as usize] |= 1 << (piece % 8);
    }

    pub(super) fn clear(&mut self, slot: u32, piece: u32) {
        self.bytes[slot as usize * self.width + (piece / 8) as usize] &= !(1 << (piece % 8));
    }

    /// Writes a slot's row (`bits`: a bitfield's bytes, or empty for all clear).
    pub(super) fn write(&mut self, slot: u32, bits: &[u8]) {
        let at = slot as usize * self.width;
        if self.bytes.len() < at + self.width {
            self.bytes.resize(at + self.width, 0);
        }
        let row = &mut self.bytes[at..at + self.width];
        row.fill(0);
        let n = bits.len().min(self.width);
        row[..n].copy_from_slice(&bits[..n]);
    }
}

impl PieceScheduler {
    pub(super) fn slot(&self, id: &str) -> Option<(u32, &Slot)> {
        let i = *self.by_name.get(id)?;
        self.slots[i as usize].as_ref().map(|s| (i, s))
    }

    /// Whether the usable peer in `slot` holds `piece`.
    pub(super) fn holds(&self, slot: u32, s: &Slot, piece: u32) -> bool {
        !s.banned && (s.complete || self.rows.get(slot, piece))
    }

    pub(super) fn count_holdings(&mut self, slot: u32, sign: i32, now_ms: u64) {
        let Some(s) = self.slots[slot as usize].as_ref() else {
            return;
        };
        if s.banned {
            return;
        }
        let near = s.distance == 0;
        if s.complete {
            self.complete_holders = (self.complete_holders as i64 + sign as i64) as u32;
            if near {
                self.complete_near_holders =
                    (self.complete_near_holders as i64 + sign as i64) as u32;
            }
            if sign > 0 {
                for t in &mut self.first_seen {
                    *t = (*t).min(now_ms);
                }
            }
            return;
        }
        let width = self.rows.width;
        let at = slot as usize * width;
        for byte in 0..width {
            let mut bits = self.rows.bytes[at + byte];
            while bits != 0 {
                let i = byte * 8 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                self.count_holder(i as u32, near, sign);
                if sign > 0 {
                    let t = &mut self.first_seen[i];
                    *t = (*t).min(now_ms);
                }
            }
        }
    }

    /// Adds a peer or replaces what it holds (a bitfield, a tracker answer); `have =
    /// None` means it holds everything. `distance`: 0 same rack, 1 same zone, 2 far.
    pub fn set_peer(&mut self, id: &str, have: Option<Bitfield>, distance: u8) {
        self.set_peer_at(id, have, distance, 0);
    }

    /// [`PieceScheduler::set_peer`] with the current time (for rack-stripe patience).
    pub fn set_peer_at(&mut self, id: &str, have: Option<Bitfield>, distance: u8, now_ms: u64) {
        let have = have.filter(|h| !h.is_complete() || h.len() != self.have.len());
        let have = match have {
            Some(h) if h.len() != self.have.len() => Some(Bitfield::new(self.have.len())),
            other => other,
        };
        let complete = have.is_none();
        let held = have.as_ref().map_or(0, Bitfield::count);
        let idx = match self.by_name.get(id) {
            Some(&i) => {
                self.count_holdings(i, -1, now_ms);
                if let Some(s) = self.slots[i as usize].as_mut() {
                    s.complete = complete;
                    s.held = held;
                    s.distance = distance;
                }
                i
            }
            None => {
                let slot = Slot {
                    complete,
                    held,
                    distance,
                    inflight: 0,
                    banned: false,
                    rate: 0.0,
                    window: window_for(0.0, &self.cfg, self.piece_size),
                    speed: speed_class(0.0),
                    tie: mix(self.cfg.seed ^ seed_for(id), 0),
                    mark_ms: None,
                    busy_until_ms: 0,
                    last_progress_ms: now_ms,
                    is_source: self.source.as_deref() == Some(id),
                };
                let i = match self.slots.iter().position(Option::is_none) {
                    Some(free) => {
                        self.slots[free] = Some(slot);
                        self.names[free] = id.to_owned();
                        free as u32
                    }
                    None => {
                        self.slots.push(Some(slot));
                        self.names.push(id.to_owned());
                        (self.slots.len() - 1) as u32
                    }
                };
                self.by_name.insert(id.to_owned(), i);
                i
            }
        };
        self.rows
            .write(idx, have.as_ref().map_or(&[][..], Bitfield::as_bytes));
        self.count_holdings(idx, 1, now_ms);
    }

    /// A HAVE: the peer now holds `piece`. Unknown peers and pieces are ignored.
    pub fn peer_has(&mut self, id: &str, piece: u32, now_ms: u64) {
        if let Some(&i) = self.by_name.get(id) {
            self.peer_has_handle(i, piece, now_ms);
        }
    }

    /// The peer's handle for [`PieceScheduler::peer_has_handle`]: valid until the peer
    /// is removed (its slot may then go to another peer).
    pub fn peer_handle(&self, id: &str) -> Option<u32> {
        self.by_name.get(id).copied()
    }

    /// [`PieceScheduler::peer_has`] by handle: a simulated swarm delivers millions of
    /// HAVEs, and looking each peer's name up dominated its run.
    pub fn peer_has_handle(&mut self, i: u32, piece: u32, now_ms: u64) {
        if piece >= self.have.len() {
            return;
        }
        let Some(s) = self.slots.get_mut(i as usize).and_then(Option::as_mut) else {
            return;
        };
        if s.complete || self.rows.get(i, piece) {
            return;
        }
        self.rows.set(i, piece);
        s.held += 1;
        let (usable, near, held) = (!s.banned, s.distance == 0, s.held);
        if usable {
            self.count_holder(piece, near, 1);
            let t = &mut self.first_seen[piece as usize];
            *t = (*t).min(now_ms);
        }
        if held == self.have.len() {
            self.count_holdings(i, -1, now_ms);
            if let Some(s) = self.slots[i as usize].as_mut() {
                s.complete = true;
            }
            self.count_holdings(i, 1, now_ms);
        }
    }

    /// Reads, and changes nothing, what a HAVE for `piece` reads of this node's own
    /// state: its bits and the in-flight bits, the piece's holder count and first
    /// sighting. Returns a value made of all of them, for `std::hint::black_box`.
    ///
    /// A caller handing one HAVE to many schedulers reads ahead for all of them
    /// before delivering it to each, so their cache misses overlap instead of coming
    /// one after another: the simulator hands 130 M HAVEs to 10,000 schedulers, and
    /// those misses were most of its run. See also
    /// [`PieceScheduler::read_ahead_peer`].
    pub fn read_ahead_piece(&self, piece: u32) -> u64 {
        let i = piece as usize;
        let byte = i / 8;
        let have = self.have.as_bytes().get(byte).copied().unwrap_or(0);
        let busy = self.inflight_any.as_bytes().get(byte).copied().unwrap_or(0);
        let avail = self.avail.get(i).map_or(0, |h| h.any ^ h.near);
        let seen = self.first_seen.get(i).copied().unwrap_or(0);
        (have as u64) ^ ((busy as u64) << 8) ^ ((avail as u64) << 16) ^ seen
    }

    /// [`PieceScheduler::read_ahead_piece`] for what the HAVE reads of the peer with
    /// `handle` ([`PieceScheduler::peer_handle`]): its slot and its row.
    pub fn read_ahead_peer(&self, handle: u32, piece: u32) -> u64 {
        let Some(s) = self.slots.get(handle as usize).and_then(Option::as_ref) else {
            return 0;
        };
        let at = handle as usize * self.rows.width + piece as usize / 8;
        let row = self.rows.bytes.get(at).copied().unwrap_or(0);
        (row as u64)
            ^ (s.held as u64)
            ^ s.busy_until_ms
            ^ s.rate.to_bits()
            ^ ((s.inflight as u64) << 32)
            ^ ((s.complete as u64) << 40)
    }

    /// Forgets a peer; returns the pieces that were in flight from it (now open).
    pub fn remove_peer(&mut self, id: &str) -> Vec<u32> {
        let Some(i) = self.by_name.remove(id) else {
            return Vec::new();
        };
        self.count_holdings(i, -1, 0);
        let mut released = Vec::new();
        for piece in 0..self.inflight.len() {
            if self.inflight[piece].contains(&i) {
                self.release(piece as u32, i);
                released.push(piece as u32);
            }
        }
        if let Some(s) = self.slots[i as usize].take() {
            self.inflight_total -= s.inflight.min(self.inflight_total);
        }
        released
    }

    pub fn knows_peer(&self, id: &str) -> bool {
        self.by_name.contains_key(id)
    }

    pub fn peers(&self) -> impl Iterator<Item = &str> {
        self.slots
            .iter()
            .zip(&self.names)
            .filter(|(s, _)| s.is_some())
            .map(|(_, name)| name.as_str())
    }

    /// Whether a known peer holds the whole blob.
    pub fn peer_is_complete(&self, id: &str) -> bool {
        self.slot(id).is_some_and(|(_, s)| s.complete && !s.banned)
    }

    /// [`PieceScheduler::peer_is_complete`] by handle ([`PieceScheduler::peer_handle`]).
    pub fn peer_is_complete_handle(&self, handle: u32) -> bool {
        self.slots
            .get(handle as usize)
            .and_then(Option::as_ref)
            .is_some_and(|s| s.complete && !s.banned)
    }

    pub fn is_banned(&self, id: &str) -> bool {
        self.slot(id).is_some_and(|(_, s)| s.banned)
    }

    /// Requests in flight to a peer (by handle, [`PieceScheduler::peer_handle`]).
    pub fn inflight_to_handle(&self, handle: u32) -> u32 {
        self.slots
            .get(handle as usize)
            .and_then(Option::as_ref)
            .map_or(0, |s| s.inflight)
    }

    /// Peers asked for pieces that have sent nothing for `after_ms`, counted from when
    /// they were first asked (idle to busy) or last delivered: a holder that keeps its
    /// connection alive but serves nothing (a bug that drops requests, or a peer
    /// claiming pieces it does not give). Waiting in a holder's line is not silence for
    /// this long: a line moves every piece time.
    pub fn silent_holders(&self, now_ms: u64, after_ms: u64) -> Vec<PeerId> {
        self.slots
            .iter()
            .zip(&self.names)
            .filter_map(|(s, name)| {
                let s = s.as_ref()?;
                (s.inflight > 0 && now_ms.saturating_sub(s.last_progress_ms) >= after_ms)
                    .then(|| name.clone())
            })
            .collect()
    }

    /// Requests in flight to a peer.
    pub fn inflight_to(&self, id: &str) -> u32 {
        self.slot(id).map_or(0, |(_, s)| s.inflight)
    }

    /// Measured throughput from a peer, bytes per second (0: not measured yet).
    pub fn peer_rate(&self, id: &str) -> f64 {
        self.slot(id).map_or(0.0, |(_, s)| s.rate)
    }

    pub(super) fn usable_holders(&self, piece: u32) -> u32 {
        self.avail[piece as usize].any + self.complete_holders
    }

    /// One partial, unbanned holder of `piece` more (`sign` 1) or fewer (-1).
    pub(super) fn count_holder(&mut self, piece: u32, near: bool, sign: i32) {
        let step = |n: u32| (n as i64 + sign as i64).max(0) as u32;
        let h = &mut self.avail[piece as usize];
        h.any = step(h.any);
        if near {
            h.near = step(h.near);
        }
        let (any, near) = (h.any > 0, h.near > 0);
        for (bits, on) in [
            (&mut self.partly_held, any),
            (&mut self.partly_held_near, near),
        ] {
            if on != bits.get(piece) {
                if on {
                    bits.set(piece);
                } else {
                    bits.clear(piece);
                }
            }
        }
    }

    /// Pieces neither held, in flight nor claimed that a usable peer holds but whose
    /// hash `hash_known` says is unknown: a source cannot check a copy of them and
    /// must read them from the registry (`registry_run`).
    pub fn held_without_hash(&self, hash_known: impl Fn(u32) -> bool) -> Vec<u32> {
        (0..self.have.len())
            .filter(|&i| {
                !self.have.get(i)
                    && !self.inflight_any.get(i)
                    && self.usable_holders(i) > 0
                    && !hash_known(i)
            })
            .collect()
    }

    /// Pieces neither held, in flight nor claimed that no usable peer holds.
    pub fn orphans(&self) -> Vec<u32> {
        (0..self.have.len())
            .filter(|&i| {
                !self.have.get(i) && !self.inflight_any.get(i) && self.usable_holders(i) == 0
            })
            .collect()
    }
}
