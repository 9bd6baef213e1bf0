//! The holder, as `p2p/serve.rs` runs it: channels opened by downloaders get the
//! bitfield (or "complete") and then a HAVE per piece as it is held; requests go into
//! the node's `UploadQueue` (busy beyond its bounds, `NotHeld` for pieces it lacks);
//! the dispatcher hands the next one to its connection's writer while a slot is free;
//! a waiting request can be cancelled; a closed channel's waiting requests leave.

use swarm::links::HaveFilter;
use swarm::upload::{Admit, Queued};
use swarm::wire::RejectReason;

use super::pull::{Phase, Pull};
use super::{Engine, Timer};

impl Engine<'_> {
    /// A channel's Open reaches the holder (serve.rs `watch_blob`): the bitfield goes
    /// back once the holder has the blob in piece mode, or "complete".
    pub(crate) fn open_at_holder(&mut self, s: u32, l: u32, h: u32) {
        let hp = self.pull_ref(h, l);
        if hp.done || hp.phase == Phase::Swarm {
            self.subscribe(h, l, s);
        } else {
            let i = self.pi(h, l);
            self.pending_opens[i].push(s);
        }
    }

    /// The holder can answer the channels that waited (its task started, or it
    /// completed the blob some other way).
    pub(crate) fn flush_opens(&mut self, h: u32, l: u32) {
        let i = self.pi(h, l);
        for s in std::mem::take(&mut self.pending_opens[i]) {
            self.subscribe(h, l, s);
        }
    }

    fn subscribe(&mut self, h: u32, l: u32, s: u32) {
        let i = self.pi(h, l);
        // The filter the downloader sent with its Open (or since).
        let filter = self
            .pull_ref(s, l)
            .links
            .get(&h)
            .map_or(HaveFilter::ALL, |k| k.have_filter);
        self.set_subscriber(i, s, filter);
        self.holds_out(h, l, s);
    }

    /// Files `s` among the holder's subscribers with `filter`, keeping its place if it
    /// was one (the order HAVEs go out in: filtered subscribers moved to the end heard
    /// of every piece after all near peers, which cost 10,000 nodes 0.05 × T*).
    /// Returns the filter it had, if any.
    fn set_subscriber(&mut self, i: usize, s: u32, filter: HaveFilter) -> Option<HaveFilter> {
        match self.subs[i].iter_mut().find(|(x, _)| *x == s) {
            Some((_, f)) => Some(std::mem::replace(f, filter)),
            None => {
                self.subs[i].push((s, filter));
                None
            }
        }
    }

    fn is_subscribed(&self, i: usize, s: u32) -> bool {
        self.subs[i].iter().any(|&(x, _)| x == s)
    }

    /// The holder's bitfield (or "complete") goes to `s` (serve.rs `watch_blob`).
    fn holds_out(&mut self, h: u32, l: u32, s: u32) {
        let t = self.now + self.peer_latency();
        self.at(
            t,
            Timer::Holds {
                slot: s,
                layer: l,
                holder: h,
            },
        );
    }

    /// A downloader's HAVE_FILTER reaches `h` (serve.rs, `watch_blob`): from now on
    /// only the HAVEs it admits; if it admits more than before, the bitfield again.
    pub(crate) fn filter_at_holder(&mut self, s: u32, l: u32, h: u32, filter: HaveFilter) {
        let i = self.pi(h, l);
        if !self.is_subscribed(i, s) {
            // Not answered yet: `subscribe` reads the filter from the link then.
            return;
        }
        let before = self.set_subscriber(i, s, filter).unwrap_or(HaveFilter::ALL);
        if !before.covers(&filter) {
            self.holds_out(h, l, s);
        }
    }

    /// `h` holds a new piece: a HAVE goes to every open channel that admits it.
    pub(crate) fn have_out(&mut self, h: u32, l: u32, piece: u32) {
        let i = self.pi(h, l);
        // (The event goes out even if no filter admits the piece: when it is delivered
        // decides, as the channels may have changed by then.)
        if !self.subs[i].is_empty() {
            let t = self.now + self.peer_latency();
            self.at(
                t,
                Timer::Have {
                    holder: h,
                    layer: l,
                    piece,
                },
            );
        }
    }

    /// `h` completed the blob: its channels hear `Complete` (the scheduler then counts
    /// it as holding everything).
    pub(crate) fn complete_out(&mut self, h: u32, l: u32) {
        let i = self.pi(h, l);
        for k in 0..self.subs[i].len() {
            let s = self.subs[i][k].0;
            self.holds_out(h, l, s);
        }
    }

    pub(crate) fn haves_arrive(&mut self, h: u32, l: u32, piece: u32) {
        let i = self.pi(h, l);
        let subs = std::mem::take(&mut self.subs[i]);
        // Delivering the HAVE to one task cannot make another hold the piece: the
        // tasks that lack it can be listed first.
        let mut targets = std::mem::take(&mut self.have_targets);
        targets.clear();
        let held = self.held[l as usize].get(piece as usize);
        let mut division = (0, 0);
        for &(s, filter) in &subs {
            if filter.admits_remembering(piece, &mut division) {
                self.out.counters.haves += 1;
                if held.is_none_or(|held| !held.get(s)) {
                    targets.push(s);
                }
            }
        }
        self.read_ahead_haves(&targets, l, piece, h);
        for &s in &targets {
            self.have_arrived(s, l, piece, h);
        }
        self.have_targets = targets;
        // Channels opened meanwhile were answered with a bitfield that has the piece.
        let newer = std::mem::replace(&mut self.subs[i], subs);
        for (s, f) in newer {
            if !self.is_subscribed(i, s) {
                self.subs[i].push((s, f));
            }
        }
    }

    /// Reads, for every task in `targets`, what `have_arrived` will read, one step
    /// of the chain (task, its links and scheduler, the peer's slot) for all of them
    /// at a time: each task's state is a cache miss of its own at 10,000 nodes, and
    /// read this way the misses of one step overlap instead of queueing behind each
    /// other. Changes nothing.
    fn read_ahead_haves(&self, targets: &[u32], l: u32, piece: u32, h: u32) {
        let live = |p: &Pull| !p.done && p.phase == Phase::Swarm;
        let mut acc = 0u64;
        for &s in targets {
            let p = &self.pulls[self.pi(s, l)];
            acc ^= live(p) as u64 ^ p.sched.is_some() as u64 ^ p.links.len() as u64;
            acc ^= p.source.unwrap_or(0) as u64 ^ p.wake.len() as u64 ^ p.striped as u64;
        }
        std::hint::black_box(acc);
        for &s in targets {
            let p = &self.pulls[self.pi(s, l)];
            let Some(sch) = p.sched.as_ref().filter(|_| live(p)) else {
                continue;
            };
            acc ^= p.links.read_ahead() ^ sch.read_ahead_piece(piece);
            acc ^= p.wake.back().map_or(0, |t| t.to_bits());
            acc ^= self.nodes[s as usize].budget.available() as u64;
            if p.source == Some(h) {
                acc ^= p.hashes.get(piece) as u64;
            }
        }
        std::hint::black_box(acc);
        for &s in targets {
            let p = &self.pulls[self.pi(s, l)];
            if live(p) {
                acc ^= p.links.get(&h).map_or(0, |k| k.handle.unwrap_or(0) as u64);
            }
        }
        std::hint::black_box(acc);
        for &s in targets {
            let p = &self.pulls[self.pi(s, l)];
            let Some(sch) = p.sched.as_ref().filter(|_| live(p)) else {
                continue;
            };
            if let Some(handle) = p.links.get(&h).and_then(|k| k.handle) {
                acc ^= sch.read_ahead_peer(handle, piece);
            }
        }
        std::hint::black_box(acc);
    }

    /// A piece request reaches the holder.
    pub(crate) fn request_at_holder(&mut self, s: u32, l: u32, piece: u32, h: u32, urgent: bool) {
        let reply = |reason| Timer::Reject {
            slot: s,
            layer: l,
            piece,
            holder: h,
            reason,
        };
        let t = self.now + self.peer_latency();
        if !self.pull_ref(h, l).holds(piece) {
            self.at(t, reply(RejectReason::NotHeld));
            return;
        }
        let q = Queued {
            chan: l,
            blob: l as u64,
            piece,
            urgent,
            small_head: self
                .pull_ref(h, l)
                .layout
                .is_some_and(|x| x.is_small_head(piece)),
        };
        if self.traced_piece == Some((s, l, piece)) {
            eprintln!(
                "{:.4} request s{s} l{l} p{piece} at {h} urgent {urgent}",
                self.now
            );
        }
        match self.nodes[h as usize].uploads.push(s, q) {
            Admit::Busy => self.at(t, reply(RejectReason::Busy)),
            Admit::Queued => self.dispatch(h),
        }
    }

    /// Hands queued requests to their connections' writers while slots are free.
    pub(crate) fn dispatch(&mut self, h: u32) {
        while let Some((s, q)) = self.nodes[h as usize].uploads.next_to_send() {
            let layout = self.pull_ref(s, q.chan).layout;
            let Some(len) = layout.map(|x| x.len(q.piece)) else {
                self.nodes[h as usize].uploads.done();
                continue;
            };
            if self.sc.sim.trace {
                self.out.uploads.push(super::UploadRecord {
                    t: self.now,
                    holder: self.nodes[h as usize].node,
                    to: self.nodes[s as usize].node,
                    layer: q.chan,
                    piece: q.piece,
                    urgent: q.urgent,
                });
            }
            let freed = self.append_job(h, s, q.chan, q.piece, len);
            for _ in 0..freed {
                self.nodes[h as usize].uploads.done();
            }
        }
    }

    /// Pieces wholly written into their sockets: their slots go to the next requests.
    pub(crate) fn slots_freed(&mut self, h: u32, n: u32) {
        for _ in 0..n {
            self.nodes[h as usize].uploads.done();
        }
        self.dispatch(h);
    }

    /// Only a request still waiting is cancelled; one being sent goes on.
    pub(crate) fn cancel_at_holder(&mut self, s: u32, l: u32, piece: u32, h: u32) {
        if self.nodes[h as usize].uploads.cancel(s, l, piece) {
            let t = self.now + self.peer_latency();
            self.at(
                t,
                Timer::Reject {
                    slot: s,
                    layer: l,
                    piece,
                    holder: h,
                    reason: RejectReason::Cancelled,
                },
            );
        }
    }

    /// The downloader closed its channel (it has the blob): its waiting requests
    /// leave the line and it hears no more HAVEs.
    pub(crate) fn close_at_holder(&mut self, s: u32, l: u32, h: u32) {
        self.nodes[h as usize].uploads.drop_waiting(s, Some(l));
        let i = self.pi(h, l);
        self.subs[i].retain(|&(x, _)| x != s);
        self.pending_opens[i].retain(|&x| x != s);
    }
}
