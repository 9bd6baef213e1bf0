//! Transfers and their milestones.
//!
//! A *flow* crosses a few resources and gets a max-min fair rate. Plain flows (a
//! direct pull, a registry run, the cache) count bytes down to their next milestone.
//!
//! A *stream* is one peer connection's pieces in one direction (holder → downloader):
//! the holder's writer sends the pieces the upload line handed it, one after the
//! other, into the socket, paced by its upload bucket (flow `w`, absent without an
//! upload limit: then it writes as fast as the socket takes it); the network and the
//! downloader's reader move them on (flow `r`: the holder's NIC, rack and zone links,
//! the downloader's downlink and download bucket). What is written but not delivered
//! sits in the socket buffers, at most `socket_buffer` bytes: the writer can run that
//! far ahead of the reader and no further, and the reader never passes the writer. A
//! piece's upload slot is freed when its last byte is written (serve.rs), and it
//! reaches the downloader when its last byte is delivered.

use std::cmp::Reverse;
use std::collections::VecDeque;

use crate::flow::FlowPath;
use crate::model::Origin;

use super::{ns, Engine};

#[derive(Clone, Copy, Debug)]
pub(crate) enum Owner {
    Whole {
        slot: u32,
        layer: u32,
    },
    Run {
        slot: u32,
        layer: u32,
        first: u32,
    },
    CacheFill {
        layer: u32,
    },
    CacheRead {
        slot: u32,
        layer: u32,
    },
    /// A stream's writer (paced by the holder's upload bucket) and reader: their
    /// positions live in the `Stream`, not in `remaining`.
    StreamW,
    StreamR,
}

pub(crate) struct FlowRec {
    pub path: FlowPath,
    pub rate: f64,
    pub live: bool,
    pub owner: Owner,
    /// Plain flows: bytes to the next milestone, as of `at`.
    pub remaining: f64,
    pub at: f64,
    pub gen: u32,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Job {
    pub layer: u32,
    pub piece: u32,
    pub start: f64,
    pub end: f64,
    /// Its upload slot is free (every byte written into the socket).
    pub released: bool,
    /// The downloader's connection claimed the piece when its bytes began (`None`:
    /// not begun); a copy it could not claim is read and dropped.
    pub claimed: Option<bool>,
}

pub(crate) struct Stream {
    pub holder: u32,
    pub dst: u32,
    pub jobs: VecDeque<Job>,
    /// Bytes written into the socket and delivered to the reader, counted from the
    /// stream's creation.
    pub written: f64,
    pub delivered: f64,
    pub total: f64,
    pub w: Option<u32>,
    pub r: Option<u32>,
    pub at: f64,
    pub gen: u32,
    pub cross: bool,
    /// The writer is paced by an upload bucket (else it is never the bottleneck).
    pub bucket: bool,
    /// 0: buffer partly full, 1: empty (reader waits on the writer), 2: full.
    pub coupling: u8,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Due {
    Flow(u32, u32),
    Stream(u32, u32),
}

/// Payload-free ordering for the due heap (time and sequence decide).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DueBox(pub Due);
impl PartialEq for DueBox {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for DueBox {}
impl PartialOrd for DueBox {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for DueBox {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

/// Bytes within which a position counts as having reached its target (rounding of
/// event times to nanoseconds moves positions by rate × 1 ns).
fn tol(rate: f64) -> f64 {
    1.0 + rate * 2e-9
}

impl Engine<'_> {
    pub(crate) fn add_flow(&mut self, path: FlowPath, bytes: f64, owner: Owner) -> u32 {
        let rec = FlowRec {
            path,
            rate: 0.0,
            live: true,
            owner,
            remaining: bytes,
            at: self.now,
            gen: 0,
        };
        self.dirty = true;
        match self.free_flows.pop() {
            Some(id) => {
                let gen = self.flows[id as usize].gen.wrapping_add(1);
                self.flows[id as usize] = FlowRec { gen, ..rec };
                id
            }
            None => {
                self.flows.push(rec);
                (self.flows.len() - 1) as u32
            }
        }
    }

    pub(crate) fn remove_flow(&mut self, id: u32) {
        let f = &mut self.flows[id as usize];
        if f.live {
            f.live = false;
            f.rate = 0.0;
            f.gen = f.gen.wrapping_add(1);
            self.free_flows.push(id);
            self.dirty = true;
        }
    }

    /// A plain flow from `origin` to the node of `slot`.
    pub(crate) fn add_net_flow(
        &mut self,
        origin: Origin,
        slot: u32,
        bytes: f64,
        owner: Owner,
    ) -> u32 {
        let node = self.nodes[slot as usize].node;
        let path = self.net.path(origin, node);
        self.add_flow(path, bytes, owner)
    }

    /// Gives a plain flow `bytes` more to its next milestone, keeping its rate.
    pub(crate) fn extend_flow(&mut self, id: u32, bytes: f64) {
        let f = &mut self.flows[id as usize];
        f.remaining += bytes;
        f.gen = f.gen.wrapping_add(1);
        self.reschedule_flow(id);
    }

    fn flow_due_at(&self, id: u32) -> f64 {
        let f = &self.flows[id as usize];
        if f.live && f.rate > 0.0 && !matches!(f.owner, Owner::StreamW | Owner::StreamR) {
            f.at + f.remaining.max(0.0) / f.rate
        } else {
            f64::INFINITY
        }
    }

    pub(crate) fn reschedule_flow(&mut self, id: u32) {
        let t = self.flow_due_at(id);
        if t <= self.step_end + 1e-12 {
            let gen = self.flows[id as usize].gen;
            let seq = self.next_seq();
            self.due.push(Reverse((
                ns(t.max(self.now)),
                seq,
                DueBox(Due::Flow(id, gen)),
            )));
        }
    }

    pub(crate) fn reschedule_stream(&mut self, sid: u32) {
        let Some(st) = self.streams[sid as usize].as_mut() else {
            return;
        };
        st.gen = st.gen.wrapping_add(1);
        let gen = st.gen;
        let t = self.stream_next(sid);
        if t <= self.step_end + 1e-12 {
            let seq = self.next_seq();
            self.due.push(Reverse((
                ns(t.max(self.now)),
                seq,
                DueBox(Due::Stream(sid, gen)),
            )));
        }
    }

    /// Max-min rates for every live flow; then the socket buffers couple each
    /// stream's writer and reader (an empty buffer holds the reader to the writer's
    /// pace, a full one the writer to the reader's), and the rates are solved again
    /// with those caps so the capacity they leave goes to others.
    pub(crate) fn solve(&mut self) {
        let ids: Vec<u32> = (0..self.flows.len() as u32)
            .filter(|&i| self.flows[i as usize].live)
            .collect();
        let mut rates = Vec::new();
        {
            let paths: Vec<&FlowPath> = ids.iter().map(|&i| &self.flows[i as usize].path).collect();
            self.solver.solve(&self.net.caps, &paths, &mut rates);
        }
        for (k, &i) in ids.iter().enumerate() {
            self.flows[i as usize].rate = rates[k];
        }
        let b = self.sc.starling.socket_buffer.0 as f64;
        let mut capped: Vec<(u32, f64)> = Vec::new();
        for st in self.streams.iter().flatten() {
            let (Some(w), Some(r)) = (st.w, st.r) else {
                continue;
            };
            let (rw, rr) = (self.flows[w as usize].rate, self.flows[r as usize].rate);
            let gap = st.written - st.delivered;
            if gap <= tol(rr) && rr > rw {
                capped.push((r, rw));
            } else if gap >= b - tol(rw) && rw > rr {
                capped.push((w, rr));
            }
        }
        if capped.is_empty() {
            return;
        }
        for &(f, c) in &capped {
            self.flows[f as usize].path.cap = c;
        }
        {
            let paths: Vec<&FlowPath> = ids.iter().map(|&i| &self.flows[i as usize].path).collect();
            self.solver.solve(&self.net.caps, &paths, &mut rates);
        }
        for (k, &i) in ids.iter().enumerate() {
            self.flows[i as usize].rate = rates[k];
        }
        for &(f, _) in &capped {
            self.flows[f as usize].path.cap = f64::INFINITY;
        }
    }

    /// The writer's and the reader's rates, as the socket buffer lets them go.
    fn stream_rates(&self, st: &Stream) -> (f64, f64) {
        let rr = st.r.map_or(0.0, |f| self.flows[f as usize].rate);
        if !st.bucket {
            return (f64::INFINITY, rr);
        }
        // No writer flow: everything is written, the reader only drains the buffer.
        let Some(w) = st.w else {
            return (0.0, rr);
        };
        let mut rw = self.flows[w as usize].rate;
        let mut rr = rr;
        let gap = st.written - st.delivered;
        let b = self.sc.starling.socket_buffer.0 as f64;
        if gap <= tol(rr) && rr > rw {
            rr = rw;
        }
        if gap >= b - tol(rw) && rw > rr {
            rw = rr;
        }
        (rw, rr)
    }

    pub(crate) fn stream_advance(&mut self, sid: u32, t: f64) {
        let b = self.sc.starling.socket_buffer.0 as f64;
        let Some(st) = self.streams[sid as usize].as_ref() else {
            return;
        };
        let dt = t - st.at;
        if dt <= 0.0 {
            return;
        }
        let (rw, rr) = self.stream_rates(st);
        let Some(st) = self.streams[sid as usize].as_mut() else {
            return;
        };
        if st.bucket {
            let w2 = (st.written + rw * dt).min(st.total);
            let d2 = (st.delivered + rr * dt).min(w2);
            st.written = w2.min(d2 + b);
            st.delivered = d2;
        } else {
            st.delivered = (st.delivered + rr * dt).min(st.total);
            st.written = (st.delivered + b).min(st.total);
        }
        st.at = t;
    }

    /// When the stream next reaches a milestone at its current rates.
    fn stream_next(&self, sid: u32) -> f64 {
        let Some(st) = self.streams[sid as usize].as_ref() else {
            return f64::INFINITY;
        };
        let b = self.sc.starling.socket_buffer.0 as f64;
        let (rw, rr) = self.stream_rates(st);
        let mut best = f64::INFINITY;
        if let Some(j) = st.jobs.front() {
            if rr > 0.0 {
                best = best.min(st.at + (j.end - st.delivered).max(0.0) / rr);
            }
        }
        if let Some(j) = st.jobs.iter().find(|j| !j.released) {
            let t = if st.bucket {
                if j.end <= st.written {
                    st.at
                } else if rw > 0.0 {
                    st.at + (j.end - st.written) / rw
                } else {
                    f64::INFINITY
                }
            } else {
                let target = j.end - b;
                if target <= st.delivered {
                    st.at
                } else if rr > 0.0 {
                    st.at + (target - st.delivered) / rr
                } else {
                    f64::INFINITY
                }
            };
            best = best.min(t);
        }
        if st.bucket && st.w.is_some() {
            let gap = st.written - st.delivered;
            if rr > rw && gap > tol(rr) {
                best = best.min(st.at + gap / (rr - rw));
            } else if rw > rr && gap < b - tol(rw) {
                best = best.min(st.at + (b - gap) / (rw - rr));
            }
        }
        best
    }

    pub(crate) fn next_milestone(&self) -> f64 {
        let mut next = f64::INFINITY;
        for i in 0..self.flows.len() as u32 {
            next = next.min(self.flow_due_at(i));
        }
        for sid in 0..self.streams.len() as u32 {
            if self.streams[sid as usize].is_some() {
                next = next.min(self.stream_next(sid));
            }
        }
        next
    }

    pub(crate) fn collect_due(&mut self) {
        self.due.clear();
        for i in 0..self.flows.len() as u32 {
            let t = self.flow_due_at(i);
            if t <= self.step_end + 1e-12 {
                let gen = self.flows[i as usize].gen;
                let seq = self.next_seq();
                self.due
                    .push(Reverse((ns(t), seq, DueBox(Due::Flow(i, gen)))));
            }
        }
        for sid in 0..self.streams.len() as u32 {
            let Some(gen) = self.streams[sid as usize].as_ref().map(|s| s.gen) else {
                continue;
            };
            let t = self.stream_next(sid);
            if t <= self.step_end + 1e-12 {
                let seq = self.next_seq();
                self.due
                    .push(Reverse((ns(t), seq, DueBox(Due::Stream(sid, gen)))));
            }
        }
    }

    pub(crate) fn advance_flow(&mut self, id: u32, t: f64) {
        let f = &mut self.flows[id as usize];
        if f.live && t > f.at {
            f.remaining = (f.remaining - f.rate * (t - f.at)).max(0.0);
            f.at = t;
        }
    }

    pub(crate) fn advance_all(&mut self, t: f64) {
        for i in 0..self.flows.len() as u32 {
            self.advance_flow(i, t);
        }
        for sid in 0..self.streams.len() as u32 {
            self.stream_advance(sid, t);
        }
    }

    pub(crate) fn milestone(&mut self, due: DueBox) {
        match due.0 {
            Due::Flow(id, gen) => {
                if !self.flows[id as usize].live || self.flows[id as usize].gen != gen {
                    return;
                }
                let now = self.now;
                self.advance_flow(id, now);
                let f = &self.flows[id as usize];
                if f.remaining > tol(f.rate) {
                    // Not there yet (a rate changed since): look again later.
                    let g = &mut self.flows[id as usize];
                    g.gen = g.gen.wrapping_add(1);
                    self.reschedule_flow(id);
                    return;
                }
                self.flows[id as usize].remaining = 0.0;
                self.last_progress = self.now;
                self.flow_milestone(id);
            }
            Due::Stream(sid, gen) => {
                if self.streams[sid as usize].as_ref().map(|s| s.gen) != Some(gen) {
                    return;
                }
                let now = self.now;
                self.stream_advance(sid, now);
                let holder = self.streams[sid as usize].as_ref().map(|s| s.holder);
                let freed = self.stream_settle(sid);
                if let (Some(h), true) = (holder, freed > 0) {
                    self.slots_freed(h, freed);
                }
            }
        }
    }

    /// Appends a piece to the holder → downloader stream (the writer sends pieces of
    /// a connection one after the other). Returns the upload slots this freed at once
    /// (pieces already wholly written into the socket), for the caller to give back.
    pub(crate) fn append_job(
        &mut self,
        holder: u32,
        dst: u32,
        layer: u32,
        piece: u32,
        len: u64,
    ) -> u32 {
        let b = self.sc.starling.socket_buffer.0 as f64;
        let sid = match self.stream_of.get(&(holder, dst)) {
            Some(&s) => s,
            None => {
                let (hn, dn) = (
                    self.nodes[holder as usize].node,
                    self.nodes[dst as usize].node,
                );
                let st = Stream {
                    holder,
                    dst,
                    jobs: VecDeque::new(),
                    written: 0.0,
                    delivered: 0.0,
                    total: 0.0,
                    w: None,
                    r: None,
                    at: self.now,
                    gen: 0,
                    cross: self.net.cross_rack(Origin::Node(hn), dn),
                    bucket: self.net.upload_bucket(hn).is_some(),
                    coupling: 1,
                };
                let sid = match self.free_streams.pop() {
                    Some(s) => {
                        self.streams[s as usize] = Some(st);
                        s
                    }
                    None => {
                        self.streams.push(Some(st));
                        (self.streams.len() - 1) as u32
                    }
                };
                self.stream_of.insert((holder, dst), sid);
                sid
            }
        };
        let now = self.now;
        self.stream_advance(sid, now);
        let (hn, dn) = (
            self.nodes[holder as usize].node,
            self.nodes[dst as usize].node,
        );
        let need_r;
        let need_w;
        {
            let Some(st) = self.streams[sid as usize].as_mut() else {
                return 0;
            };
            let start = st.total;
            st.total += len as f64;
            st.jobs.push_back(Job {
                layer,
                piece,
                start,
                end: st.total,
                released: false,
                claimed: None,
            });
            if !st.bucket {
                st.written = (st.delivered + b).min(st.total);
            }
            need_r = st.r.is_none();
            need_w = st.bucket && st.w.is_none();
        }
        if need_r {
            let path = self.net.path(Origin::Node(hn), dn);
            let f = self.add_flow(path, f64::INFINITY, Owner::StreamR);
            if let Some(st) = self.streams[sid as usize].as_mut() {
                st.r = Some(f);
            }
        }
        if need_w {
            if let Some(path) = self.net.upload_bucket(hn) {
                let f = self.add_flow(path, f64::INFINITY, Owner::StreamW);
                if let Some(st) = self.streams[sid as usize].as_mut() {
                    st.w = Some(f);
                }
            }
        }
        self.stream_settle(sid)
    }

    /// Handles what the stream reached at its current position: freed upload slots,
    /// pieces whose bytes began or ended, an idle writer or reader. Returns the upload
    /// slots freed.
    fn stream_settle(&mut self, sid: u32) -> u32 {
        let b = self.sc.starling.socket_buffer.0 as f64;
        let mut released = 0u32;
        let mut delivered: Vec<Job> = Vec::new();
        let (holder, dst, cross);
        let mut drop_w = None;
        let mut drop_r = None;
        let mut gone = false;
        {
            let rr = self.streams[sid as usize]
                .as_ref()
                .and_then(|s| s.r)
                .map_or(0.0, |f| self.flows[f as usize].rate);
            let rw = self.streams[sid as usize]
                .as_ref()
                .and_then(|s| s.w)
                .map_or(0.0, |f| self.flows[f as usize].rate);
            let Some(st) = self.streams[sid as usize].as_mut() else {
                return 0;
            };
            holder = st.holder;
            dst = st.dst;
            cross = st.cross;
            let (tw, tr) = (tol(rw.max(rr)), tol(rr));
            for j in st.jobs.iter_mut() {
                if j.released {
                    continue;
                }
                if j.end <= st.written + tw {
                    j.released = true;
                    released += 1;
                } else {
                    break;
                }
            }
            while st.jobs.front().is_some_and(|j| j.end <= st.delivered + tr) {
                if let Some(j) = st.jobs.pop_front() {
                    delivered.push(j);
                }
            }
            if st.jobs.is_empty() && st.delivered >= st.total - tr {
                drop_r = st.r.take();
                drop_w = st.w.take();
                gone = true;
            } else if st.bucket && st.w.is_some() && st.written >= st.total - tw {
                st.written = st.total;
                drop_w = st.w.take();
            }
            if st.bucket {
                let gap = st.written - st.delivered;
                let c = if gap <= tr {
                    1
                } else if gap >= b - tw {
                    2
                } else {
                    0
                };
                if c != st.coupling {
                    st.coupling = c;
                    self.dirty = true;
                }
            }
        }
        for f in [drop_w, drop_r].into_iter().flatten() {
            self.remove_flow(f);
        }
        if gone {
            self.streams[sid as usize] = None;
            self.free_streams.push(sid);
            self.stream_of.remove(&(holder, dst));
        }
        for mut j in delivered {
            if j.claimed.is_none() {
                // Its bytes began and ended within one step.
                j.claimed = Some(self.claim_on_arrival(dst, j.layer, j.piece));
            }
            let len = j.end - j.start;
            self.out.p2p_bytes += len;
            if cross {
                self.out.cross_rack_bytes += len;
            }
            self.last_progress = self.now;
            // The last byte left the holder's NIC now; it reaches the downloader one
            // way later (the flows carry rates, not propagation).
            let (lat, claimed) = (self.peer_latency(), j.claimed.unwrap_or(false));
            if lat > 0.0 {
                let t = self.now + lat;
                self.at(
                    t,
                    super::Timer::Delivered {
                        slot: dst,
                        layer: j.layer,
                        piece: j.piece,
                        holder,
                        claimed,
                    },
                );
            } else {
                self.piece_arrived(dst, j.layer, j.piece, holder, claimed);
            }
        }
        // The next piece's bytes begin: the downloader's connection claims it.
        if !gone {
            let head = self.streams[sid as usize]
                .as_ref()
                .and_then(|s| s.jobs.front().copied());
            if let Some(j) = head.filter(|j| j.claimed.is_none()) {
                let claimed = self.claim_on_arrival(dst, j.layer, j.piece);
                if let Some(h) = self.streams[sid as usize]
                    .as_mut()
                    .and_then(|s| s.jobs.front_mut())
                {
                    h.claimed = Some(claimed);
                }
            }
        }
        let _ = holder;
        if !gone {
            self.reschedule_stream(sid);
        }
        released
    }

    /// Whether the piece's bytes are already arriving from `holder` (the agent
    /// cancels only requests whose bytes have not started).
    pub(crate) fn is_receiving(&self, holder: u32, dst: u32, layer: u32, piece: u32) -> bool {
        self.stream_of
            .get(&(holder, dst))
            .and_then(|&s| self.streams[s as usize].as_ref())
            .and_then(|s| s.jobs.front())
            .is_some_and(|j| j.layer == layer && j.piece == piece && j.claimed.is_some())
    }
}
