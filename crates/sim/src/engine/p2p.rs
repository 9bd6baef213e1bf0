//! The agents' side of the swarm: announcing, turning the scheduler's requests into
//! fetches under the agent-wide request cap, and serving pieces (upload slots, the
//! upload bucket stage, the response body).

use std::collections::BTreeMap;
use std::time::Instant;

use swarm::scheduler::{seed_for, SchedulerConfig};
use swarm::{AnnounceRequest, Bitfield, PieceLayout, PieceScheduler, Role};

use super::{Engine, Kind, Timer, REGISTRY_PEER};
use crate::model::Origin;

impl Engine<'_> {
    pub(super) fn announce(&mut self, s: u32, l: u32) {
        let node = self.nodes[s as usize].node;
        let li = l as usize;
        let complete = self.pulls[s as usize * self.layers + li].done;
        let count = self.count(l);
        let p = &self.pulls[s as usize * self.layers + li];
        let mut hashes = BTreeMap::new();
        let mut hashes_sent = p.hashes_sent;
        // The source publishes the hashes of the pieces it streamed (in order).
        if p.streaming || (complete && p.hashes_sent > 0) {
            let upto = if complete {
                count
            } else {
                p.sched.as_ref().map_or(0, |x| x.have().prefix())
            };
            for i in p.hashes_sent..upto {
                hashes.insert(i, format!("{li}:{i}"));
            }
            hashes_sent = hashes_sent.max(upto);
        }
        let req = AnnounceRequest {
            node: self.names[node as usize].clone(),
            addr: String::new(),
            topology: self.net.topology[node as usize].clone(),
            digest: self.digests[li].clone(),
            size: Some(self.sizes[li]),
            piece_size: Some(self.piece_size[li]),
            // Never `None` while incomplete: the tracker hands out a peer whose `have` is
            // `None` as complete (see the report's swarm notes), so a joining agent that
            // knows the blob's size sends an empty bitfield.
            have: if complete {
                None
            } else {
                Some(
                    p.sched
                        .as_ref()
                        .map_or_else(|| Bitfield::new(count), |x| x.have().clone()),
                )
            },
            complete,
            fetching_from_registry: p.streaming && !complete,
            hashes,
            known_hashes: p.known_hashes,
            bad_peers: vec![],
            leaving: false,
        };
        let t0 = Instant::now();
        let Ok(resp) = self.tracker.announce(&req, (self.now * 1e3) as u64) else {
            return;
        };
        self.out.tracker_wall_s += t0.elapsed().as_secs_f64();
        self.out.announces += 1;
        let sched_cfg = self.sched_cfg.clone();
        let size = self.sizes[li];
        let my_topo = self.net.topology[node as usize].clone();
        let p = self.pull(s, l);
        p.hashes_sent = hashes_sent;
        p.wait = false;
        if let Some((&k, _)) = resp.hashes.iter().next_back() {
            p.known_hashes = p.known_hashes.max(k + 1);
        }
        if complete || !p.active {
            return;
        }
        if p.sched.is_none() {
            let layout = PieceLayout::new(size, resp.piece_size);
            p.layout = Some(layout);
            // The agent seeds its piece order with its node name.
            let cfg = SchedulerConfig {
                seed: seed_for(&req.node),
                ..sched_cfg
            };
            p.sched = Some(PieceScheduler::new(Bitfield::new(layout.count()), layout.piece_size, cfg));
        }
        let interval = resp.interval_ms as f64 / 1e3;
        match resp.role {
            Role::Direct => {
                self.start_direct(s, l);
                return;
            }
            Role::Source => {
                let p = self.pull(s, l);
                if !p.streaming {
                    p.streaming = true;
                    if let Some(sch) = p.sched.as_mut() {
                        for i in 0..count {
                            sch.claim(i);
                        }
                    }
                    let first = p.sched.as_ref().map_or(0, |x| x.have().prefix());
                    let t = self.now + self.registry_latency(s, l);
                    self.at(
                        t,
                        Timer::Start(Kind::RegPiece {
                            slot: s,
                            layer: l,
                            piece: first,
                        }),
                    );
                }
            }
            Role::Peer => {
                let t0 = Instant::now();
                let p = &mut self.pulls[s as usize * self.layers + li];
                let seen: Vec<String> = resp.peers.iter().map(|x| x.node.clone()).collect();
                let old = std::mem::replace(&mut p.peers, seen);
                if let Some(sch) = p.sched.as_mut() {
                    // As the agent does: peers missing from the reply are dropped.
                    for gone in old.iter().filter(|o| !p.peers.contains(o)) {
                        sch.remove_peer(gone);
                    }
                    for peer in resp.peers {
                        let d = my_topo.distance(&peer.topology);
                        sch.set_peer(&peer.node, peer.have, d);
                    }
                }
                self.out.scheduler_wall_s += t0.elapsed().as_secs_f64();
                self.pump(s, l);
            }
        }
        self.at(self.now + interval, Timer::Announce { slot: s, layer: l });
    }

    pub(super) fn pump(&mut self, s: u32, l: u32) {
        let t0 = Instant::now();
        let now_ms = (self.now * 1e3) as u64;
        let p = self.pull(s, l);
        let wait = p.wait;
        let (reqs, head) = match p.sched.as_mut() {
            Some(sch) => (sch.next_requests(now_ms, u32::MAX), sch.have().prefix()),
            None => return,
        };
        self.out.scheduler_wall_s += t0.elapsed().as_secs_f64();
        for r in reqs {
            let from: u32 = r
                .peer
                .strip_prefix('n')
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
            let kind = Kind::Piece {
                slot: s,
                layer: l,
                piece: r.piece,
                from,
                wait,
            };
            // The read head has a lane of its own (download.rs, `head_requests`;
            // `head_requests = 0`: none, as before the lane).
            if r.piece == head && self.sc.starling.head_requests > 0 {
                self.head_queue[s as usize].push_back(kind);
            } else {
                self.request_queue[s as usize].push_back(kind);
            }
        }
        self.drain_requests(s);
    }

    /// Starts queued piece requests while the agent-wide caps allow (the read-head
    /// lane, then the shared one). A request counts against the scheduler's per-peer
    /// and per-blob limits from the moment it is queued (the agent spawns it, then
    /// waits for the semaphore), and holds its semaphore permit until its response
    /// ends (body read, or refused).
    pub(super) fn drain_requests(&mut self, s: u32) {
        let si = s as usize;
        let cap = self.sc.starling.max_piece_requests.max(1);
        let head_cap = self.sc.starling.head_requests;
        let lat = self.sc.starling.peer_latency_ms / 1e3;
        loop {
            let kind = if self.head_running[si].len() < head_cap as usize {
                self.head_queue[si].pop_front()
            } else {
                None
            };
            let kind = match kind {
                Some(k @ Kind::Piece { layer, piece, .. }) => {
                    self.head_running[si].push((layer, piece));
                    k
                }
                Some(k) => k,
                None if self.requests[si] < cap => match self.request_queue[si].pop_front() {
                    Some(k) => {
                        self.requests[si] += 1;
                        k
                    }
                    None => break,
                },
                None => break,
            };
            if lat > 0.0 {
                self.at(self.now + lat, Timer::Start(kind));
            } else {
                self.start_flow(kind);
            }
        }
    }

    /// A request's response ended: its permit (read-head lane or shared) frees.
    pub(super) fn release_request(&mut self, s: u32, layer: u32, piece: u32) {
        let si = s as usize;
        if let Some(i) = self.head_running[si]
            .iter()
            .position(|&x| x == (layer, piece))
        {
            self.head_running[si].swap_remove(i);
        } else {
            self.requests[si] = self.requests[si].saturating_sub(1);
        }
    }

    /// The response body of a piece request: from the holder to the requester over the
    /// network, paced by the requester's download limit. The holder's upload slot frees
    /// once the body's last byte is in the socket, i.e. when what is left of the body
    /// fits in the socket buffers: the body is a head (slot held) and a tail of
    /// `socket_buffer` bytes (slot free) over the same path.
    pub(super) fn start_body(&mut self, slot: u32, layer: u32, piece: u32, from: u32) {
        let node = self.nodes[slot as usize].node;
        let len = self.piece_len(layer, piece);
        let buffered = self.sc.starling.socket_buffer.0;
        if len > buffered {
            let head = Kind::Body {
                slot,
                layer,
                piece,
                from,
            };
            self.add_flow(Origin::Node(from), Some(node), len - buffered, head);
        } else {
            self.free_upload_slot(from);
            self.start_tail(slot, layer, piece, from, len);
        }
    }

    /// The body's head is in the socket: the holder's slot frees, the rest follows.
    pub(super) fn body_head_done(
        &mut self,
        slot: u32,
        layer: u32,
        piece: u32,
        from: u32,
        bytes: f64,
        cross: bool,
    ) {
        self.free_upload_slot(from);
        self.out.p2p_bytes += bytes;
        if cross {
            self.out.cross_rack_bytes += bytes;
        }
        let len = self.piece_len(layer, piece);
        let tail = len.min(self.sc.starling.socket_buffer.0);
        self.start_tail(slot, layer, piece, from, tail);
    }

    fn start_tail(&mut self, slot: u32, layer: u32, piece: u32, from: u32, bytes: u64) {
        let node = self.nodes[slot as usize].node;
        let kind = Kind::Piece {
            slot,
            layer,
            piece,
            from,
            wait: false,
        };
        self.add_flow(Origin::Node(from), Some(node), bytes, kind);
    }

    /// Ground truth: does cluster node `node` hold `piece` of `layer`?
    pub(super) fn holds(&self, node: u32, layer: u32, piece: u32) -> bool {
        let Some(slot) = self
            .slot_index
            .get(node as usize)
            .copied()
            .filter(|&s| s != u32::MAX)
        else {
            return false;
        };
        let p = &self.pulls[slot as usize * self.layers + layer as usize];
        if p.done {
            return true;
        }
        p.sched.as_ref().is_some_and(|s| s.have().get(piece))
    }

    /// A piece request reaches the holder (after the request latency).
    pub(super) fn request_piece(
        &mut self,
        slot: u32,
        layer: u32,
        piece: u32,
        from: u32,
        wait: bool,
    ) {
        if !self.holds(from, layer, piece) {
            self.out.failed_requests += 1;
            self.drop_request(slot, layer, piece, from);
            return;
        }
        let st = &self.sc.starling;
        if self.uploads[from as usize] < st.max_uploads {
            self.begin_upload(slot, layer, piece, from);
            return;
        }
        // Slots full: wait in line if asked to (serve.rs), unless the line is full too.
        let waiting = &mut self.upload_waiting[from as usize];
        if wait && (waiting.len() as u32) < st.upload_queue && st.upload_wait_ms > 0.0 {
            self.upload_wait_ids += 1;
            let id = self.upload_wait_ids;
            waiting.push_back((
                id,
                Kind::Piece {
                    slot,
                    layer,
                    piece,
                    from,
                    wait,
                },
            ));
            let t = self.now + st.upload_wait_ms / 1e3;
            self.at(t, Timer::UploadWait { from, id });
            self.out.queued_requests += 1;
            return;
        }
        self.out.refused_requests += 1;
        self.drop_request(slot, layer, piece, from);
    }

    /// A waiting request's time is up: if it is still in line, it is refused (503).
    pub(super) fn upload_wait_over(&mut self, from: u32, id: u64) {
        let waiting = &mut self.upload_waiting[from as usize];
        let Some(at) = waiting.iter().position(|&(i, _)| i == id) else {
            return;
        };
        let Some((
            _,
            Kind::Piece {
                slot, layer, piece, ..
            },
        )) = waiting.remove(at)
        else {
            return;
        };
        self.out.refused_requests += 1;
        self.drop_request(slot, layer, piece, from);
    }

    /// A 404 (a wrong view) or a 503: as the agent does, release the request, drop the
    /// peer until the tracker's next answer (download.rs, `Event::Piece` with an
    /// error), and ask someone else.
    fn drop_request(&mut self, slot: u32, layer: u32, piece: u32, from: u32) {
        self.release_request(slot, layer, piece);
        let name = self.names[from as usize].clone();
        let p = self.pull(slot, layer);
        if let Some(sch) = p.sched.as_mut() {
            sch.on_failed(piece, &name, false);
            sch.remove_peer(&name);
        }
        p.peers.retain(|x| x != &name);
        self.pump(slot, layer);
        self.drain_requests(slot);
    }

    /// The holder has a slot for this request: it is held through the upload bucket
    /// and until the body's last byte is in the socket (serve.rs hands it to the
    /// sendfile stream): see `start_body`.
    fn begin_upload(&mut self, slot: u32, layer: u32, piece: u32, from: u32) {
        let len = self.piece_len(layer, piece);
        self.uploads[from as usize] += 1;
        match self.net.upload_bucket(from) {
            Some(path) => {
                let up = Kind::Upload {
                    slot,
                    layer,
                    piece,
                    from,
                };
                self.add_flow_path(path, len, up, false);
            }
            None => self.start_body(slot, layer, piece, from),
        }
    }

    /// An upload slot frees: the first request in line takes it.
    fn free_upload_slot(&mut self, from: u32) {
        self.uploads[from as usize] = self.uploads[from as usize].saturating_sub(1);
        if let Some((
            _,
            Kind::Piece {
                slot, layer, piece, ..
            },
        )) = self.upload_waiting[from as usize].pop_front()
        {
            self.begin_upload(slot, layer, piece, from);
        }
    }

    /// A piece's body arrived and verified.
    pub(super) fn piece_done(
        &mut self,
        slot: u32,
        layer: u32,
        piece: u32,
        from: u32,
        bytes: f64,
        cross: bool,
    ) {
        self.release_request(slot, layer, piece);
        self.out.p2p_bytes += bytes;
        self.out.piece_transfers += 1;
        if cross {
            self.out.cross_rack_bytes += bytes;
        }
        let name = &self.names[from as usize];
        let p = &mut self.pulls[slot as usize * self.layers + layer as usize];
        if let Some(sch) = p.sched.as_mut() {
            sch.on_done(piece, name, (self.now * 1e3) as u64);
            if sch.is_complete() {
                self.layer_done(slot, layer);
            } else {
                self.pump(slot, layer);
            }
        }
        self.drain_requests(slot);
    }
}
