//! The download task's tracker side, as `p2p/download.rs` runs it: the start
//! (announce; the source reads the size from its first registry GET, peers wait for
//! it), the announces and their answers (role, hashes, rack stripe, peers to link
//! to), the seeding heartbeat and the final "complete".

use std::time::Instant;

use swarm::pieces::{piece_size_for, PieceHash};
use swarm::scheduler::{seed_for, SchedulerConfig};
use swarm::{AnnounceRequest, AnnounceResponse, Bitfield, PieceLayout, PieceScheduler, Role};

use super::pull::{Link, Phase, SIZE_POLL};
use super::{Engine, Timer};

impl Engine<'_> {
    pub(crate) fn now_ms(&self) -> u64 {
        (self.now * 1e3) as u64
    }

    /// The pull client asks for the blob: the agent's swarm code starts after the
    /// host's scheduling noise (`request_jitter_ms`).
    pub(crate) fn swarm_start(&mut self, s: u32, l: u32) {
        let now = self.now;
        let p = self.pull(s, l);
        p.phase = Phase::Starting;
        p.size_deadline = now + super::pull::SIZE_WAIT;
        let j = self.sc.starling.request_jitter_ms / 1e3 * self.draw("request", s, l);
        if j > 0.0 {
            self.at(now + j, Timer::SizePoll { slot: s, layer: l });
        } else {
            self.announce(s, l);
        }
    }

    fn request(&self, s: u32, l: u32) -> AnnounceRequest {
        let node = self.nodes[s as usize].node as usize;
        let mut r = AnnounceRequest::new(
            &self.names[node],
            "",
            &self.net.topology[node],
            &self.digests[l as usize],
        );
        let p = self.pull_ref(s, l);
        if p.done {
            r.size = Some(self.sizes[l as usize]);
            r.complete = true;
            r.known_hashes = u32::MAX;
            return r;
        }
        if let (Some(layout), Some(sch)) = (p.layout, p.sched.as_ref()) {
            r.size = Some(layout.blob_size);
            r.piece_size = Some(layout.piece_size);
            r.have = Some(sch.have().clone());
            r.fetching_from_registry = !p.runs.is_empty();
            let hex = &self.hash_hex[l as usize];
            r.hashes = p
                .publish
                .iter()
                .filter_map(|&i| Some((i, hex.get(i as usize)?.clone())))
                .collect();
            r.known_hashes = p.hashes.prefix();
        }
        r
    }

    /// Sends an announce (one at a time); its answer arrives a tracker round trip later.
    pub(crate) fn announce(&mut self, s: u32, l: u32) {
        if self.pull_ref(s, l).announcing {
            return;
        }
        let req = self.request(s, l);
        let t0 = Instant::now();
        let resp = self.tracker.announce(&req, self.now_ms());
        self.out.tracker_wall_s += t0.elapsed().as_secs_f64();
        self.out.counters.announces += 1;
        let now = self.now;
        let sent = req.hashes.len();
        let p = self.pull(s, l);
        p.last_announce = now;
        let Ok(resp) = resp else {
            return;
        };
        p.announcing = true;
        p.publish_sent = sent;
        p.reply = Some(resp);
        let t = self.now + self.sc.starling.tracker_rtt_ms / 1e3;
        self.at(t, Timer::AnnounceReply { slot: s, layer: l });
    }

    /// A complete blob's announce (the seeding loop), and its next one.
    pub(crate) fn heartbeat(&mut self, s: u32, l: u32) {
        let req = self.request(s, l);
        let t0 = Instant::now();
        let _ = self.tracker.announce(&req, self.now_ms());
        self.out.tracker_wall_s += t0.elapsed().as_secs_f64();
        self.out.counters.announces += 1;
        if self.pending > 0 {
            let every = self.sc.starling.seed_heartbeat_ms as f64 / 1e3;
            self.at(self.now + every, Timer::Heartbeat { slot: s, layer: l });
        }
    }

    pub(crate) fn announce_reply(&mut self, s: u32, l: u32) {
        let p = self.pull(s, l);
        p.announcing = false;
        let Some(resp) = p.reply.take() else {
            return;
        };
        match p.phase {
            Phase::Starting => self.on_start_reply(s, l, resp),
            Phase::Swarm if !p.done => {
                let sent = p.publish_sent.min(p.publish.len());
                p.publish.drain(..sent);
                p.publish_sent = 0;
                self.absorb(s, l, resp);
                // The stripe or the source may have changed.
                self.sync_have_filters(s, l);
                self.connect_links(s, l);
                self.settle_unverified(s, l);
            }
            _ => {}
        }
    }

    fn on_start_reply(&mut self, s: u32, l: u32, resp: AnnounceResponse) {
        let size = self.sizes[l as usize];
        match (resp.role, resp.size) {
            (Role::Direct, _) => self.start_direct(s, l),
            (role, Some(_)) => {
                if size < self.sc.starling.min_p2p_size.0 {
                    if role == Role::Source {
                        self.leave_small(s, l);
                    }
                    self.start_direct(s, l);
                } else {
                    self.start_task(s, l, resp, false);
                }
            }
            (Role::Source, None) => {
                // The source learns the size from the registry's answer and keeps that
                // stream for its first run.
                self.pull(s, l).reply = Some(resp);
                let t = self.now + self.registry_latency(s, l);
                self.at(t, Timer::SourceGet { slot: s, layer: l });
            }
            (Role::Peer, None) => {
                // Wait a moment for the source to learn the size. The agent's join is
                // held at the tracker until the size is known (`wait_for_size_ms`);
                // modelled here as asking again every `SIZE_POLL`, the tracker's own
                // look again for a size announced through another replica.
                if self.now < self.pull_ref(s, l).size_deadline {
                    let t = self.now + SIZE_POLL;
                    self.at(t, Timer::SizePoll { slot: s, layer: l });
                } else {
                    self.start_task(s, l, resp, false);
                }
            }
        }
    }

    pub(crate) fn size_poll(&mut self, s: u32, l: u32) {
        if self.pull_ref(s, l).phase == Phase::Starting {
            self.announce(s, l);
        }
    }

    pub(crate) fn source_get(&mut self, s: u32, l: u32) {
        let Some(resp) = self.pull(s, l).reply.take() else {
            return;
        };
        if self.sizes[l as usize] < self.sc.starling.min_p2p_size.0 {
            // As the agent does: the registry's answer is open, so the bytes follow it.
            self.leave_small(s, l);
            self.pull(s, l).phase = Phase::Direct;
            self.direct_start(s, l);
            return;
        }
        self.start_task(s, l, resp, true);
    }

    /// A source elected before the size was known tells the tracker the blob is below
    /// the P2P threshold and leaves, as the agent does (`p2p::download::start`).
    fn leave_small(&mut self, s: u32, l: u32) {
        let mut req = self.request(s, l);
        req.size = Some(self.sizes[l as usize]);
        req.leaving = true;
        let t0 = Instant::now();
        let _ = self.tracker.announce(&req, self.now_ms());
        self.out.tracker_wall_s += t0.elapsed().as_secs_f64();
        self.out.counters.announces += 1;
    }

    /// The download task begins (`Download` created, `run` spawned).
    pub(crate) fn start_task(&mut self, s: u32, l: u32, resp: AnnounceResponse, open_stream: bool) {
        let size = self.sizes[l as usize];
        let piece_size = if resp.piece_size > 1 {
            resp.piece_size
        } else {
            self.sc
                .starling
                .piece_size
                .map_or_else(|| piece_size_for(size, Some(self.net.link_rate)), |b| b.0)
        };
        let layout = PieceLayout::new(size, piece_size);
        let n = layout.count();
        if self.hash_hex[l as usize].len() != n as usize {
            let d = self.digests[l as usize].to_string();
            self.held[l as usize] = vec![Bitfield::new(self.nodes.len() as u32); n as usize];
            self.hash_hex[l as usize] = (0..n)
                .map(|i| PieceHash::of(format!("{d}/{piece_size}/{i}").as_bytes()).to_hex())
                .collect();
        }
        let node = self.nodes[s as usize].node as usize;
        let cfg = SchedulerConfig {
            seed: seed_for(&self.names[node]),
            ..self.sched_cfg.clone()
        };
        let now = self.now;
        let p = self.pull(s, l);
        p.phase = Phase::Swarm;
        p.layout = Some(layout);
        p.sched = Some(PieceScheduler::new(
            Bitfield::new(n),
            layout.piece_size,
            cfg,
        ));
        p.hashes = Bitfield::new(n);
        p.claimed = Bitfield::new(n);
        p.t0 = now;
        p.last_announce = now;
        self.absorb(s, l, resp);
        if open_stream {
            self.begin_runs(s, l, 0, n, true);
        }
        self.connect_links(s, l);
        self.flush_opens(s, l);
        self.at(now, Timer::Tick { slot: s, layer: l });
    }

    fn absorb(&mut self, s: u32, l: u32, resp: AnnounceResponse) {
        let now_ms = self.now_ms();
        let source = resp.source.as_deref().and_then(|n| self.slot_named(n));
        let me = self.nodes[s as usize].node as usize;
        let links: Vec<(u32, u8)> = resp
            .peers
            .iter()
            .filter_map(|p| {
                let slot = self.slot_named(&p.node)?;
                (slot != s).then(|| (slot, self.net.topology[me].distance(&p.topology)))
            })
            .collect();
        let p = self.pull(s, l);
        p.role = resp.role;
        p.source = source;
        p.members = resp.members;
        p.interval = resp.interval_ms.clamp(50, 10_000) as f64 / 1e3;
        if let Some(sch) = p.sched.as_mut() {
            sch.on_announce(&resp, now_ms);
        }
        p.striped = resp.stripe.is_some_and(|[i, n]| n > 1 && i < n);
        for i in resp.hashes.keys() {
            if *i < p.hashes.len() {
                p.hashes.set(*i);
            }
        }
        for link in p.links.values_mut() {
            link.fresh = false;
        }
        for (slot, distance) in links {
            let to_dial = &mut p.to_dial;
            let link = p.links.get_or_insert_with(slot, || {
                to_dial.push(slot);
                Link::handed_out(distance, now_ms)
            });
            link.fresh = true;
            link.distance = distance;
        }
        // The links to keep: the agent's rule (`swarm::links`).
        let states: Vec<swarm::links::LinkState<u32>> = p
            .links
            .iter()
            .map(|(&h, k)| swarm::links::LinkState {
                key: h,
                distance: k.distance,
                live: k.connected || k.connecting,
                fresh: k.fresh,
                inflight: match (k.handle, p.sched.as_ref()) {
                    (Some(hd), Some(sch)) => sch.inflight_to_handle(hd),
                    _ => 0,
                },
                useful_ms: k.useful_ms,
            })
            .collect();
        let members = p.members;
        for h in swarm::links::to_drop(&states, members, now_ms) {
            self.drop_link(s, l, h);
        }
        let p = self.pull(s, l);
        let n = p.links.len();
        self.out.counters.max_links = self.out.counters.max_links.max(n);
        self.mark(s, l);
    }

    /// The blob is complete: the tracker hears it at once.
    pub(crate) fn announce_complete(&mut self, s: u32, l: u32) {
        let req = self.request(s, l);
        let t0 = Instant::now();
        let _ = self.tracker.announce(&req, self.now_ms());
        self.out.tracker_wall_s += t0.elapsed().as_secs_f64();
        self.out.counters.announces += 1;
    }
}
