//! The agent's download task for one blob, as `p2p/download.rs` runs it (its start
//! and announces are in `announce`): announces every `interval_ms` (a source with new
//! hashes every 100 ms), links to every handed-out peer, bitfields and HAVEs into the `PieceScheduler`, requests
//! from `next_requests` under the node's `RequestBudget`, hashes (the source's HAVEs,
//! the tracker's answers, a fetch every 200 ms while pieces wait), retargeting, the
//! source's registry runs, and the end (links closed, "complete" announced).

use std::collections::BTreeMap;
use std::time::Instant;

use swarm::wire::RejectReason;
use swarm::{Bitfield, Role};

use super::pull::{Phase, HASH_FETCH_EVERY, HASH_PUSH_EVERY, PEER_HASH_ASK_EVERY, TICK};
use super::{Engine, Timer};

/// The name the scheduler knows the registry stream by (download.rs `REGISTRY`).
const REGISTRY: &str = "\u{0}registry";

impl Engine<'_> {
    /// Dials the links that have no channel yet (a connection to the node is reused).
    pub(crate) fn connect_links(&mut self, s: u32, l: u32) {
        let lat = self.peer_latency();
        let mut todo = std::mem::take(&mut self.pull(s, l).to_dial);
        todo.sort_unstable();
        for h in todo {
            if self
                .pull_ref(s, l)
                .links
                .get(&h)
                .is_none_or(|k| k.connected || k.connecting)
            {
                continue;
            }
            if let Some(k) = self.pull(s, l).links.get_mut(&h) {
                k.connecting = true;
            }
            // TCP, then HELLO and AUTH: three one-way trips before the channel opens.
            let delay = if self.conns.insert((s, h)) {
                self.out.counters.connections += 1;
                3.0 * lat
            } else {
                0.0
            };
            self.at(
                self.now + delay,
                Timer::Connected {
                    slot: s,
                    layer: l,
                    holder: h,
                },
            );
        }
    }

    /// Drops a link (`swarm::links::to_drop`): its channel is closed and the peer
    /// leaves the scheduler (a link with requests in flight is never dropped; any
    /// released are given back all the same).
    pub(crate) fn drop_link(&mut self, s: u32, l: u32, h: u32) {
        let name = self.names[self.nodes[h as usize].node as usize].clone();
        let p = self.pull(s, l);
        let Some(k) = p.links.remove(&h) else {
            return;
        };
        let released = p
            .sched
            .as_mut()
            .map(|x| x.remove_peer(&name))
            .unwrap_or_default();
        for piece in released {
            self.request_ended(s, l, piece, h);
        }
        if k.connected {
            self.out.counters.links_dropped += 1;
            let t = self.now + self.peer_latency();
            self.at(
                t,
                Timer::Close {
                    slot: s,
                    layer: l,
                    holder: h,
                },
            );
        }
    }

    pub(crate) fn connected(&mut self, s: u32, l: u32, h: u32) {
        let p = self.pull(s, l);
        let live = !p.done && p.phase == Phase::Swarm;
        match p.links.get_mut(&h) {
            Some(k) if live => {
                k.connecting = false;
                k.connected = true;
            }
            _ => return,
        }
        self.out.counters.channels += 1;
        let t = self.now + self.peer_latency();
        self.at(
            t,
            Timer::Open {
                slot: s,
                layer: l,
                holder: h,
            },
        );
        if let Some(k) = self.pull(s, l).links.get_mut(&h) {
            k.have_filter = swarm::links::HaveFilter::ALL;
        }
        self.sync_have_filters(s, l);
    }

    /// The agent's `sync_have_filters`: each holder on an open channel is asked for the
    /// HAVEs this task can use now (`HaveFilter::for_link`), where that changed.
    pub(crate) fn sync_have_filters(&mut self, s: u32, l: u32) {
        let p = self.pull_ref(s, l);
        let Some(stripe) = p.sched.as_ref().map(|x| x.far_have_stripe()) else {
            return;
        };
        let changes: Vec<(u32, swarm::links::HaveFilter)> = p
            .links
            .iter()
            .filter(|(_, k)| k.connected)
            .filter_map(|(&h, k)| {
                let want = swarm::links::HaveFilter::for_link(k.distance, stripe);
                (want != k.have_filter).then_some((h, want))
            })
            .collect();
        if changes.is_empty() {
            return;
        }
        let t = self.now + self.peer_latency();
        for (h, filter) in changes {
            if let Some(k) = self.pull(s, l).links.get_mut(&h) {
                k.have_filter = filter;
            }
            self.at(
                t,
                Timer::Filter {
                    slot: s,
                    layer: l,
                    holder: h,
                    filter,
                },
            );
        }
    }

    /// The holder's bitfield (or "complete") arrives: the peer enters the scheduler.
    pub(crate) fn holds_arrived(&mut self, s: u32, l: u32, h: u32) {
        let now_ms = self.now_ms();
        let hp = self.pi(h, l);
        let have = if self.pulls[hp].done {
            None
        } else {
            self.pulls[hp].sched.as_ref().map(|x| x.have().clone())
        };
        // The holder's known hashes from piece 0 follow its bitfield (HASHES); only
        // the elected source's count, as its HAVEs' hashes do.
        let known_hashes = if self.pulls[hp].done {
            u32::MAX
        } else {
            self.pulls[hp].hashes.prefix()
        };
        let name = &self.names[self.nodes[h as usize].node as usize];
        let i = self.pi(s, l);
        let p = &mut self.pulls[i];
        if p.done || p.phase != Phase::Swarm {
            return;
        }
        let mut hashes_new = false;
        if p.source == Some(h) {
            for k in 0..known_hashes.min(p.hashes.len()) {
                if !p.hashes.get(k) {
                    p.hashes.set(k);
                    hashes_new = true;
                }
            }
        }
        let Some(distance) = p.links.get(&h).map(|k| k.distance) else {
            return;
        };
        let t0 = Instant::now();
        if let Some(sch) = p.sched.as_mut() {
            sch.set_peer_at(name, have, distance, now_ms);
            let handle = sch.peer_handle(name);
            if let Some(k) = p.links.get_mut(&h) {
                k.handle = handle;
            }
        }
        self.out.scheduler_wall_s += t0.elapsed().as_secs_f64();
        self.out.counters.bitfields += 1;
        if hashes_new {
            self.settle_unverified(s, l);
        }
        let patience = self
            .pull_ref(s, l)
            .sched
            .as_ref()
            .map_or(0, |x| x.patience_ms()) as f64
            / 1e3;
        if distance > 0 && self.pull_ref(s, l).striped {
            let t = self.now + patience;
            self.pull(s, l).wake_at(t);
        }
        self.mark(s, l);
    }

    /// A HAVE from `h`: the piece is requestable at once (no announce needed).
    pub(crate) fn have_arrived(&mut self, s: u32, l: u32, piece: u32, h: u32) {
        let now_ms = self.now_ms();
        let i = self.pi(s, l);
        let hn = self.nodes[h as usize].node as usize;
        let name = &self.names[hn];
        let p = &mut self.pulls[i];
        if p.done || p.phase != Phase::Swarm {
            return;
        }
        let Some(sch) = p.sched.as_mut() else {
            return;
        };
        // (`haves_arrive` skips tasks that hold the piece: it cannot change what they
        // ask for, the scheduler looking only at pieces it lacks; that the peer became
        // complete arrives as the holder's `Complete` frame.)
        if sch.have().get(piece) {
            return;
        }
        // Only the elected source's hash counts: it read the piece from the registry.
        let hash_new = p.source == Some(h) && piece < p.hashes.len() && !p.hashes.get(piece);
        if hash_new {
            p.hashes.set(piece);
        }
        let wanted = !sch.have().get(piece)
            && (!sch.is_inflight(piece)
                || sch.have().len() - sch.have().count() <= self.sched_cfg.endgame);
        let (handle, far) = p
            .links
            .get(&h)
            .map_or((None, false), |k| (k.handle, k.distance > 0));
        match handle {
            Some(handle) => sch.peer_has_handle(handle, piece, now_ms),
            None => sch.peer_has(name, piece, now_ms),
        }
        // The agent runs a scheduling pass after every frame; one here could only send
        // something new if this HAVE opened a request to `h`, or if the node's budget
        // grew since this task's last pass (another blob gave some back); what ripens
        // with time has its wake-up. At 1,000 nodes nine in ten of these passes
        // returned nothing. (A pass skipped here may still differ in the order of
        // requests sent in the same instant, by a tick that comes later.)
        let actionable = wanted
            && (handle.is_none_or(|hd| sch.could_request_from(hd, piece, now_ms))
                || self.nodes[s as usize].budget.available() > p.budget_seen);
        // Only a HAVE from someone other than the source can move a request away from
        // it (`retarget_on_have` says no otherwise). By handle: the scheduler knows a
        // peer exactly while its link has the handle (`holds_arrived`, `drop_link`), so
        // this is `retarget_on_have` with the source's name, without reading names.
        let retarget = match p.source {
            Some(src) if src != h && sch.is_inflight(piece) => p
                .links
                .get(&src)
                .and_then(|k| k.handle)
                .filter(|&sh| sch.retarget_on_have_handle(piece, sh))
                .map(|_| src),
            _ => None,
        };
        let striped = p.striped && far;
        let patience = sch.patience_ms() as f64 / 1e3;
        if let Some(src) = retarget {
            if !self.is_receiving(src, s, l, piece) {
                self.out.counters.retargets += 1;
                let t = self.now + self.peer_latency();
                self.at(
                    t,
                    Timer::Cancel {
                        slot: s,
                        layer: l,
                        piece,
                        holder: src,
                    },
                );
            }
        }
        if hash_new {
            self.settle_unverified(s, l);
        }
        if wanted && striped {
            let t = self.now + patience;
            self.pull(s, l).wake_at(t);
        }
        if actionable {
            self.mark(s, l);
        }
    }

    /// Whether the downloader's connection can claim a piece whose bytes begin.
    pub(crate) fn claim_on_arrival(&mut self, s: u32, l: u32, piece: u32) -> bool {
        if self.traced_piece == Some((s, l, piece)) {
            eprintln!("{:.4} claim s{s} l{l} p{piece}", self.now);
        }
        let p = self.pull(s, l);
        if p.done || p.phase != Phase::Swarm || piece >= p.claimed.len() {
            return false;
        }
        if p.holds(piece) || p.claimed.get(piece) {
            return false;
        }
        p.claimed.set(piece);
        true
    }

    /// A piece's last byte arrived from `h`.
    pub(crate) fn piece_arrived(&mut self, s: u32, l: u32, piece: u32, h: u32, claimed: bool) {
        if self.traced_piece == Some((s, l, piece)) {
            eprintln!(
                "{:.4} arrived s{s} l{l} p{piece} from {h} claimed {claimed}",
                self.now
            );
        }
        let p = self.pull_ref(s, l);
        if p.done || p.phase != Phase::Swarm {
            // The channel is closed: the bytes were read and skipped.
            self.out.counters.dropped_pieces += 1;
            return;
        }
        self.request_ended(s, l, piece, h);
        let now_ms = self.now_ms();
        if let Some(k) = self.pull(s, l).links.get_mut(&h) {
            k.useful_ms = now_ms;
        }
        let name = self.names[self.nodes[h as usize].node as usize].clone();
        if !claimed {
            self.out.counters.dropped_pieces += 1;
            if let Some(sch) = self.pull(s, l).sched.as_mut() {
                sch.forget(piece, &name);
            }
            self.mark(s, l);
            return;
        }
        if self.pull_ref(s, l).hashes.get(piece) {
            self.out.counters.piece_transfers += 1;
            self.piece_held(s, l, piece, &name);
            self.cancel_duplicates(s, l, piece);
        } else {
            // Held in the file, claimed, until the hash arrives.
            self.out.counters.hash_waits += 1;
            let p = self.pull(s, l);
            if let Some(sch) = p.sched.as_mut() {
                sch.forget(piece, &name);
                sch.claim(piece);
            }
            p.unverified.insert(piece, h);
        }
        self.mark(s, l);
    }

    /// A verified piece is held: it is served and announced (HAVE) from now on.
    fn piece_held(&mut self, s: u32, l: u32, piece: u32, from: &str) {
        let now = self.now;
        let now_ms = self.now_ms();
        let t0 = Instant::now();
        let i = self.pi(s, l);
        let p = &mut self.pulls[i];
        let Some(sch) = p.sched.as_mut() else {
            return;
        };
        sch.on_done(piece, from, now_ms);
        let complete = sch.is_complete();
        if let Some(b) = self.held[l as usize].get_mut(piece as usize) {
            b.set(s);
        }
        if piece < p.claimed.len() {
            p.claimed.clear(piece);
        }
        if piece == 0 {
            p.first_piece_at = Some(now);
        }
        self.out.scheduler_wall_s += t0.elapsed().as_secs_f64();
        self.have_out(s, l, piece);
        if complete {
            self.finish(s, l);
        } else if from != REGISTRY {
            self.digest_forward(s, l);
        }
    }

    /// A piece read from the registry by this source: on disk, held once the digest
    /// reaches it.
    pub(crate) fn registry_piece(&mut self, s: u32, l: u32, piece: u32) {
        let p = self.pull(s, l);
        if p.done {
            return;
        }
        p.unhashed.insert(piece);
        self.digest_forward(s, l);
    }

    /// Moves the in-order digest over every piece on disk, holding and publishing the
    /// registry pieces it passes.
    fn digest_forward(&mut self, s: u32, l: u32) {
        loop {
            let p = self.pull(s, l);
            if p.done {
                return;
            }
            let at = p.digest_at;
            let held = p
                .sched
                .as_ref()
                .is_some_and(|x| at < x.have().len() && x.have().get(at));
            let from_registry = p.unhashed.remove(&at);
            if !held && !from_registry {
                return;
            }
            p.digest_at += 1;
            if from_registry && !held {
                if at < p.hashes.len() {
                    p.hashes.set(at);
                }
                p.publish.push(at);
                self.piece_held(s, l, at, REGISTRY);
                self.mark(s, l);
            }
        }
    }

    /// A source's idle registry connections each start a run (the agent's
    /// `refill_registry_runs`: every tick, and the moment a run ends).
    pub(crate) fn refill_runs(&mut self, s: u32, l: u32) {
        let now = self.now;
        let p = self.pull_ref(s, l);
        let cap = p
            .layout
            .map_or(1, |layout| self.registry_stream_cap(layout));
        let p = self.pull_ref(s, l);
        if p.role == Role::Source
            && !p.done
            && (p.runs.len() as u32 + p.pending_runs) < cap
            && now >= p.registry_retry_at
        {
            let unverified = &p.unverified;
            let claimed = &p.claimed;
            let hashes = &p.hashes;
            let run = p.sched.as_ref().and_then(|x| {
                x.registry_run(
                    false,
                    |i| unverified.contains_key(&i) || claimed.get(i),
                    |i| hashes.get(i),
                )
            });
            if let Some((a, b)) = run {
                self.begin_runs(s, l, a, b, false);
            }
        }
    }

    fn cancel_duplicates(&mut self, s: u32, l: u32, piece: u32) {
        let dups = self
            .pull_ref(s, l)
            .sched
            .as_ref()
            .map(|x| x.duplicates_of(piece))
            .unwrap_or_default();
        for peer in dups {
            let Some(h) = self.slot_named(&peer) else {
                continue;
            };
            if let Some(sch) = self.pull(s, l).sched.as_mut() {
                sch.forget(piece, &peer);
            }
            self.request_ended(s, l, piece, h);
            self.out.counters.cancels += 1;
            let t = self.now + self.peer_latency();
            self.at(
                t,
                Timer::Cancel {
                    slot: s,
                    layer: l,
                    piece,
                    holder: h,
                },
            );
        }
    }

    fn request_ended(&mut self, s: u32, l: u32, piece: u32, h: u32) {
        let budgeted = &mut self.pull(s, l).budgeted;
        if let Some(at) = budgeted.iter().position(|&x| x == (piece, h)) {
            budgeted.swap_remove(at);
            self.nodes[s as usize].budget.give_back(1);
        }
    }

    pub(crate) fn rejected(&mut self, s: u32, l: u32, piece: u32, h: u32, reason: RejectReason) {
        let p = self.pull_ref(s, l);
        if p.done || p.phase != Phase::Swarm {
            return;
        }
        self.request_ended(s, l, piece, h);
        let now_ms = self.now_ms();
        let backoff = self.sched_cfg.busy_backoff_ms as f64 / 1e3;
        let name = self.names[self.nodes[h as usize].node as usize].clone();
        let p = self.pull(s, l);
        let Some(sch) = p.sched.as_mut() else {
            return;
        };
        match reason {
            RejectReason::Busy => {
                sch.on_busy(piece, &name, now_ms);
                let t = self.now + backoff;
                self.pull(s, l).wake_at(t);
                self.out.counters.busy_rejects += 1;
            }
            RejectReason::NotHeld => {
                sch.on_not_held(piece, &name);
                self.out.counters.not_held_rejects += 1;
            }
            RejectReason::Invalid => sch.on_failed(piece, &name, false),
            RejectReason::Cancelled => sch.on_cancelled(piece, &name, now_ms),
        }
        self.mark(s, l);
    }

    pub(crate) fn hash_reply(&mut self, s: u32, l: u32) {
        let p = self.pull(s, l);
        let Some(h) = p.hash_reply.take() else {
            return;
        };
        for i in h.keys() {
            if *i < p.hashes.len() {
                p.hashes.set(*i);
            }
        }
        self.settle_unverified(s, l);
    }

    /// A complete peer's hashes (from a digest-verified blob): used only while no
    /// source publishes.
    pub(crate) fn peer_hashes(&mut self, s: u32, l: u32) {
        let p = self.pull(s, l);
        if p.source.is_some() || p.done {
            return;
        }
        p.hashes = Bitfield::full(p.hashes.len());
        self.out.counters.peer_hash_lists += 1;
        self.settle_unverified(s, l);
    }

    /// Pieces waiting for their hash are kept once it is known.
    pub(crate) fn settle_unverified(&mut self, s: u32, l: u32) {
        let p = self.pull_ref(s, l);
        if p.unverified.is_empty() || p.done {
            return;
        }
        let mut ready: Vec<(u32, u32)> = p
            .unverified
            .iter()
            .filter(|(&i, _)| p.hashes.get(i))
            .map(|(&i, &h)| (i, h))
            .collect();
        ready.sort_unstable();
        for (piece, h) in ready {
            let name = self.names[self.nodes[h as usize].node as usize].clone();
            let p = self.pull(s, l);
            p.unverified.remove(&piece);
            if let Some(sch) = p.sched.as_mut() {
                sch.unclaim(piece);
            }
            self.out.counters.piece_transfers += 1;
            self.piece_held(s, l, piece, &name);
            if self.pull_ref(s, l).done {
                return;
            }
        }
        self.mark(s, l);
    }

    /// The task's housekeeping (every 50 ms): announce when due, hashes for waiting
    /// pieces, registry runs for the source, and a scheduling pass if anything the
    /// scheduler depends on moved (the node's budget grew, a rested peer or a stripe's
    /// patience ripened).
    pub(crate) fn tick(&mut self, s: u32, l: u32) {
        let now = self.now;
        let p = self.pull_ref(s, l);
        if p.done || p.phase != Phase::Swarm {
            return;
        }
        let since = now - p.last_announce;
        if !p.announcing
            && (since >= p.interval - 1e-9
                || (!p.publish.is_empty() && since >= HASH_PUSH_EVERY - 1e-9))
        {
            self.announce(s, l);
        }
        // (The agent also redials failed links here; simulated links do not fail.)
        let p = self.pull_ref(s, l);
        if !p.unverified.is_empty() && p.last_hash_fetch.is_none_or(|t| now - t > HASH_FETCH_EVERY)
        {
            let from = p.hashes.prefix();
            let t0 = Instant::now();
            let h: BTreeMap<u32, String> = self.tracker.hashes(&self.digests[l as usize], from);
            self.out.tracker_wall_s += t0.elapsed().as_secs_f64();
            self.out.counters.hash_fetches += 1;
            let p = self.pull(s, l);
            p.last_hash_fetch = Some(now);
            p.hash_reply = Some(h);
            let t = now + self.sc.starling.tracker_rtt_ms / 1e3;
            self.at(t, Timer::HashReply { slot: s, layer: l });
        }
        // No source publishing: ask a complete peer for its hash list.
        let p = self.pull_ref(s, l);
        if p.source.is_none()
            && p.hashes.count() < p.hashes.len()
            && p.last_peer_hash_ask
                .is_none_or(|t| now - t > PEER_HASH_ASK_EVERY)
        {
            // By handle: looking each link's name up every tick was a third of a
            // 10,000-node run once the sources had finished.
            let seeder = p.sched.as_ref().is_some_and(|x| {
                p.links.values().any(|k| {
                    k.connected && k.handle.is_some_and(|hd| x.peer_is_complete_handle(hd))
                })
            });
            if seeder {
                self.pull(s, l).last_peer_hash_ask = Some(now);
                let t = now + 2.0 * self.peer_latency();
                self.at(t, Timer::PeerHashes { slot: s, layer: l });
            }
        }
        self.refill_runs(s, l);
        self.settle_unverified(s, l);
        self.cancel_stalled(s, l);
        let now_ms = self.now_ms();
        if let Some(sch) = self.pull(s, l).sched.as_mut() {
            if sch.check_stripe_quiet(now_ms) {
                self.out.counters.stripes_distrusted += 1;
                self.sync_have_filters(s, l);
            }
        }
        // Scheduling: the agent passes through `schedule` after every tick; here only
        // when it could return something new (events mark the task themselves).
        let avail = self.nodes[s as usize].budget.available();
        let p = self.pull(s, l);
        let mut due = avail > p.budget_seen;
        while p.wake.front().is_some_and(|&t| t <= now + 1e-9) {
            p.wake.pop_front();
            due = true;
        }
        if due {
            self.mark(s, l);
        }
        let next = self.pull_ref(s, l).tick_at(now + TICK);
        self.at(next, Timer::Tick { slot: s, layer: l });
    }

    /// Swarms with stall timeouts: requests whose bytes have not begun after
    /// `stall_ms` are cancelled (the holder confirms, then the scheduler asks someone
    /// else), as the agent's housekeeping does.
    fn cancel_stalled(&mut self, s: u32, l: u32) {
        let now_ms = self.now_ms();
        let Some(sch) = self.pull(s, l).sched.as_mut() else {
            return;
        };
        let stalled = sch.stalled_requests(now_ms);
        for r in stalled {
            let Some(h) = self.slot_named(&r.peer) else {
                continue;
            };
            if self.is_receiving(h, s, l, r.piece) {
                continue;
            }
            self.out.counters.stall_cancels += 1;
            let t = self.now + self.peer_latency();
            self.at(
                t,
                Timer::Cancel {
                    slot: s,
                    layer: l,
                    piece: r.piece,
                    holder: h,
                },
            );
        }
    }

    /// The blob is complete: links closed, budget given back, "complete" announced,
    /// then the seeding loop keeps it in handouts.
    fn finish(&mut self, s: u32, l: u32) {
        let lat = self.peer_latency();
        let p = self.pull(s, l);
        let links: Vec<u32> = p
            .links
            .iter()
            .filter(|(_, k)| k.connected)
            .map(|(&h, _)| h)
            .collect();
        let n = p.budgeted.len() as u32;
        p.budgeted.clear();
        let first = p.first_piece_at;
        let fetched = p.registry_bytes > 0.0;
        let asked = p.requested_at;
        for f in p.runs.drain(..).map(|r| r.flow).collect::<Vec<_>>() {
            self.remove_flow(f);
        }
        self.nodes[s as usize].budget.give_back(n);
        for h in links {
            self.at(
                self.now + lat,
                Timer::Close {
                    slot: s,
                    layer: l,
                    holder: h,
                },
            );
        }
        if let (Some(t), false) = (first, fetched) {
            self.out.non_seed_ttfb.push(t - asked);
        }
        self.layer_done(s, l);
        self.announce_complete(s, l);
        self.complete_out(s, l);
        self.flush_opens(s, l);
        let every = self.sc.starling.seed_heartbeat_ms as f64 / 1e3;
        self.at(self.now + every, Timer::Heartbeat { slot: s, layer: l });
    }
}
