//! The event loop: nodes arrive, pull layers (direct, through the shared cache, or
//! through the swarm driven by the real `TrackerState` and `PieceScheduler`), flows
//! share bandwidth max-min fairly, completions trigger the next requests.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::time::Instant;

use oci::Digest;
use swarm::pieces::piece_size_for;
use swarm::scheduler::{seed_for, SchedulerConfig};
use swarm::{PieceLayout, PieceScheduler, SwarmConfig, TrackerState};

use crate::flow::{FlowPath, Solver};
use crate::model::{Network, Origin};
use crate::scenario::{Scenario, Transport};
use crate::strategy::Plan;
use crate::Error;

mod p2p;

const REGISTRY_PEER: &str = "registry";

/// What one simulated run measured.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Time-to-ready per job node (seconds after the job starts; includes arrival
    /// offset and `start_overhead_s`).
    pub ready_s: Vec<f64>,
    pub registry_bytes: f64,
    pub cache_bytes: f64,
    pub p2p_bytes: f64,
    pub cross_rack_bytes: f64,
    pub source_elections: u32,
    /// Registry bytes streamed by each swarm source, by node name.
    pub source_bytes: BTreeMap<String, f64>,
    pub announces: u64,
    pub steps: u64,
    pub piece_transfers: u64,
    /// Piece requests to a peer that did not hold the piece.
    pub failed_requests: u64,
    /// Piece requests refused because the holder's upload slots were full (503).
    pub refused_requests: u64,
    /// Piece requests that waited for an upload slot.
    pub queued_requests: u64,
    pub wall_s: f64,
    pub tracker_wall_s: f64,
    pub scheduler_wall_s: f64,
    pub solver_wall_s: f64,
    /// Nodes that never became ready (stopped at `max_seconds` or stuck).
    pub stuck: usize,
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// A whole layer from the registry (direct pull).
    Whole { slot: u32, layer: u32 },
    /// One piece of the source's sequential registry stream.
    RegPiece { slot: u32, layer: u32, piece: u32 },
    /// The holder paces one piece through its upload token bucket (its upload slot
    /// held, as for the response body that follows).
    Upload {
        slot: u32,
        layer: u32,
        piece: u32,
        from: u32,
    },
    /// The head of a piece's response body, while the holder's upload slot is held
    /// (all but the last `socket_buffer` bytes).
    Body {
        slot: u32,
        layer: u32,
        piece: u32,
        from: u32,
    },
    /// A piece request, then the (rest of the) response body, paced by the reader.
    /// `wait`: the request may wait in line for the holder's upload slot.
    Piece {
        slot: u32,
        layer: u32,
        piece: u32,
        from: u32,
        wait: bool,
    },
    /// The shared cache filling from the registry.
    CacheFill { layer: u32, piece: u32 },
    /// A node reading one piece from the shared cache.
    CacheRead { slot: u32, layer: u32 },
}

struct Flow {
    path: FlowPath,
    remaining: f64,
    bytes: f64,
    kind: Kind,
    cross_rack: bool,
}

#[derive(Clone, Copy, Debug)]
enum Timer {
    Arrive(u32),
    Announce {
        slot: u32,
        layer: u32,
    },
    Heartbeat {
        slot: u32,
        layer: u32,
    },
    /// The node's pull client has the manifest: its layer fetches begin.
    Manifest(u32),
    Start(Kind),
    /// A request waiting for `from`'s upload slot gives up (503) unless served.
    UploadWait {
        from: u32,
        id: u64,
    },
}

#[derive(Default)]
struct Pull {
    active: bool,
    done: bool,
    sched: Option<PieceScheduler>,
    /// Peers from the latest tracker reply (the agent drops the others).
    peers: Vec<String>,
    layout: Option<PieceLayout>,
    streaming: bool,
    direct: bool,
    known_hashes: u32,
    hashes_sent: u32,
    /// The tracker's latest `wait_for_upload_slots`.
    wait: bool,
    /// Cache read cursor.
    cursor: u32,
}

struct NodeState {
    node: u32,
    job: bool,
    queue: Vec<u32>,
    active: usize,
    left: usize,
    ready: Option<f64>,
}

pub struct Engine<'a> {
    sc: &'a Scenario,
    net: Network,
    transport: Transport,
    tracker: TrackerState,
    sched_cfg: SchedulerConfig,
    names: Vec<String>,
    digests: Vec<Digest>,
    sizes: Vec<u64>,
    piece_size: Vec<u64>,
    nodes: Vec<NodeState>,
    /// Cluster node → participant slot (`u32::MAX`: not taking part).
    slot_index: Vec<u32>,
    /// Piece uploads in progress per cluster node (the agent's upload slots).
    uploads: Vec<u32>,
    /// Requests waiting for a node's upload slot, in order (tokio's semaphore is
    /// fair), each with the id of its give-up timer.
    upload_waiting: Vec<VecDeque<(u64, Kind)>>,
    upload_wait_ids: u64,
    /// Piece requests running per participant (the agent-wide `max_piece_requests`
    /// semaphore) and those waiting for it, in order (tokio's semaphore is fair).
    requests: Vec<u32>,
    request_queue: Vec<VecDeque<Kind>>,
    /// The read-head lane: requests waiting for it, and the (layer, piece) of those
    /// holding one of its permits.
    head_queue: Vec<VecDeque<Kind>>,
    head_running: Vec<Vec<(u32, u32)>>,
    /// Token-bucket resources (Starling's limits), their tokens and per-step usage.
    buckets: Vec<u32>,
    tokens: Vec<f64>,
    bucket_used: Vec<f64>,
    pulls: Vec<Pull>,
    layers: usize,
    flows: Vec<Flow>,
    rates: Vec<f64>,
    dirty: bool,
    solver: Solver,
    timers: BinaryHeap<Reverse<(u64, u64, TimerBox)>>,
    seq: u64,
    now: f64,
    cache_have: Vec<u32>,
    cache_filling: Vec<bool>,
    cache_waiters: Vec<Vec<u32>>,
    /// Layers some job node must fetch (only those swarms get seed heartbeats).
    needed: Vec<bool>,
    /// Job nodes not ready yet.
    pending: usize,
    /// Last time any byte transfer completed.
    last_progress: f64,
    out: Outcome,
}

/// Orders timers by (time in ns, sequence); the payload does not take part.
#[derive(Clone, Copy, Debug)]
struct TimerBox(Timer);
impl PartialEq for TimerBox {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl Eq for TimerBox {}
impl PartialOrd for TimerBox {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for TimerBox {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

fn ns(t: f64) -> u64 {
    (t * 1e9).round().max(0.0) as u64
}

impl<'a> Engine<'a> {
    pub fn new(sc: &'a Scenario, plan: &Plan) -> Self {
        let net = Network::build(sc, plan.transport);
        let n = net.nodes;
        let layers = sc.image.layers.len();
        let st = &sc.starling;
        let cfg = SwarmConfig {
            peer_ttl_ms: st.peer_ttl_ms,
            max_peers: st.max_peers,
            min_p2p_size: st.min_p2p_size.0,
            piece_size: Some(st.piece_size.0),
            announce_interval_ms: st.announce_interval_ms,
            ..SwarmConfig::default()
        };
        let sched_cfg = SchedulerConfig {
            min_window: st.max_inflight_per_peer,
            max_inflight_total: st.max_inflight_total,
            ..SchedulerConfig::default()
        };
        let sizes: Vec<u64> = sc.image.layers.iter().map(|l| l.size.0).collect();
        let piece_size = sizes
            .iter()
            .map(|&s| piece_size_for(s, None).max(st.piece_size.0))
            .collect();
        let digests = sc
            .image
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| Digest::of(format!("{}#{i}#{}", sc.name, l.name).as_bytes()))
            .collect();
        // Participants: the job's nodes, plus non-job nodes holding something (seeds).
        let mut slot_of = vec![u32::MAX; n];
        let mut nodes = Vec::new();
        let mut needed = vec![false; layers];
        for &j in &plan.job {
            slot_of[j as usize] = nodes.len() as u32;
            let queue: Vec<u32> = (0..layers as u32)
                .filter(|&l| !plan.holds[j as usize][l as usize])
                .collect();
            for &l in &queue {
                needed[l as usize] = true;
            }
            nodes.push(NodeState {
                node: j,
                job: true,
                left: queue.len(),
                queue,
                active: 0,
                ready: None,
            });
        }
        if plan.transport == Transport::P2p {
            for (i, h) in plan.holds.iter().enumerate() {
                if slot_of[i] == u32::MAX && h.iter().any(|&x| x) {
                    slot_of[i] = nodes.len() as u32;
                    nodes.push(NodeState {
                        node: i as u32,
                        job: false,
                        queue: vec![],
                        active: 0,
                        left: 0,
                        ready: None,
                    });
                }
            }
        }
        let mut pulls = Vec::with_capacity(nodes.len() * layers);
        for ns in &nodes {
            for l in 0..layers {
                let held = plan.holds[ns.node as usize][l];
                pulls.push(Pull {
                    done: held,
                    ..Pull::default()
                });
            }
        }
        let participants = nodes.len();
        let buckets: Vec<u32> = (0..net.burst.len() as u32)
            .filter(|&r| net.burst[r as usize] > 0.0)
            .collect();
        // Buckets start full, as `TokenBucket::new` does.
        let tokens = net.burst.clone();
        let bucket_used = vec![0.0; net.burst.len()];
        Self {
            sc,
            net,
            transport: plan.transport,
            tracker: TrackerState::new(cfg),
            sched_cfg,
            names: (0..n).map(|i| format!("n{i}")).collect(),
            digests,
            sizes,
            piece_size,
            nodes,
            slot_index: slot_of,
            uploads: vec![0; n],
            upload_waiting: vec![VecDeque::new(); n],
            upload_wait_ids: 0,
            requests: vec![0; participants],
            request_queue: vec![VecDeque::new(); participants],
            head_queue: vec![VecDeque::new(); participants],
            head_running: vec![Vec::new(); participants],
            buckets,
            tokens,
            bucket_used,
            pulls,
            layers,
            flows: Vec::new(),
            rates: Vec::new(),
            dirty: true,
            solver: Solver::default(),
            timers: BinaryHeap::new(),
            seq: 0,
            now: 0.0,
            cache_have: vec![0; layers],
            cache_filling: vec![false; layers],
            cache_waiters: vec![Vec::new(); layers],
            needed,
            pending: plan.job.len(),
            last_progress: 0.0,
            out: Outcome::default(),
        }
    }

    fn at(&mut self, t: f64, timer: Timer) {
        self.seq += 1;
        self.timers
            .push(Reverse((ns(t), self.seq, TimerBox(timer))));
    }

    /// One registry request's latency for participant `s` and layer `l` (`u32::MAX`:
    /// the manifest): `latency_ms` plus a pseudo-random share of `latency_jitter_ms`
    /// that is fixed by (node, layer), so runs stay reproducible.
    fn registry_latency(&self, s: u32, l: u32) -> f64 {
        let r = &self.sc.registry;
        let u = seed_for(&format!("{s}/{l}")) as f64 / u64::MAX as f64;
        (r.latency_ms + r.latency_jitter_ms * u) / 1e3
    }

    fn pull(&mut self, slot: u32, layer: u32) -> &mut Pull {
        &mut self.pulls[slot as usize * self.layers + layer as usize]
    }

    fn count(&self, layer: u32) -> u32 {
        PieceLayout::new(self.sizes[layer as usize], self.piece_size[layer as usize]).count()
    }

    fn piece_len(&self, layer: u32, piece: u32) -> u64 {
        PieceLayout::new(self.sizes[layer as usize], self.piece_size[layer as usize]).len(piece)
    }

    /// Runs to completion.
    pub fn run(mut self) -> Result<Outcome, Error> {
        let wall = Instant::now();
        let job_nodes = self.nodes.iter().filter(|n| n.job).count();
        let spread = self.sc.job.arrival_spread_s;
        // Nodes that arrive together announce in no particular order (in the benchmark
        // the first of 16 agents to announce becomes the source: any of them). Firing
        // them in slot order would always elect `n0`, the name every scheduler prefers
        // on ties (`PieceScheduler::pick_peer`), and pile requests onto the source.
        let mut order: Vec<u32> = (0..self.nodes.len() as u32).collect();
        order.sort_by_key(|&s| seed_for(&format!("arrive{s}")));
        for s in order {
            let sn = &self.nodes[s as usize];
            let t = if sn.job && spread > 0.0 && job_nodes > 1 {
                spread * s as f64 / (job_nodes - 1) as f64
            } else {
                0.0
            };
            self.at(t, Timer::Arrive(s));
        }
        let quantum = self.sc.sim.quantum_ms / 1e3;
        let max_t = self.sc.sim.max_seconds.unwrap_or(36_000.0);
        let mut done_buf: Vec<(f64, Flow)> = Vec::new();
        loop {
            if self.pending == 0 {
                break;
            }
            if self.dirty {
                let t0 = Instant::now();
                let paths: Vec<&FlowPath> = self.flows.iter().map(|f| &f.path).collect();
                self.solver.solve(&self.net.caps, &paths, &mut self.rates);
                self.out.solver_wall_s += t0.elapsed().as_secs_f64();
                self.dirty = false;
            }
            let mut next = f64::INFINITY;
            for (f, &r) in self.flows.iter().zip(&self.rates) {
                if r > 0.0 {
                    next = next.min(self.now + f.remaining / r);
                }
            }
            if let Some(Reverse((t, _, _))) = self.timers.peek() {
                next = next.min(*t as f64 / 1e9);
            }
            if !next.is_finite() || next > max_t {
                break;
            }
            // Nothing has arrived anywhere for `stall_seconds`: the swarm is stuck (the
            // remaining nodes are reported as never ready).
            if self.now - self.last_progress > self.sc.sim.stall_seconds.unwrap_or(300.0) {
                break;
            }
            let t_end = next.max(self.now + quantum);
            self.out.steps += 1;
            // Advance flows; collect those finishing by t_end with their exact time.
            let dt = t_end - self.now;
            if !self.buckets.is_empty() {
                self.refill_buckets(dt);
            }
            let mut i = 0;
            while i < self.flows.len() {
                let r = self.rates[i];
                let f = &mut self.flows[i];
                if r > 0.0 && f.remaining <= r * dt * (1.0 + 1e-12) + 1e-3 {
                    let fin = self.now + f.remaining / r;
                    let f = self.flows.swap_remove(i);
                    self.rates.swap_remove(i);
                    done_buf.push((fin, f));
                    self.dirty = true;
                } else {
                    f.remaining -= r * dt;
                    i += 1;
                }
            }
            done_buf.sort_by(|a, b| a.0.total_cmp(&b.0));
            let mut di = 0;
            let done: Vec<(f64, Flow)> = std::mem::take(&mut done_buf);
            loop {
                let tc = done.get(di).map(|d| d.0);
                let tt = self
                    .timers
                    .peek()
                    .map(|Reverse((t, _, _))| *t as f64 / 1e9)
                    .filter(|&t| t <= t_end + 1e-12);
                match (tc, tt) {
                    (None, None) => break,
                    (Some(c), Some(t)) if t < c => self.fire_timer(),
                    (None, Some(_)) => self.fire_timer(),
                    (Some(c), _) => {
                        self.now = c.max(self.now);
                        let kind = done[di].1.kind;
                        let (bytes, cross) = (done[di].1.bytes, done[di].1.cross_rack);
                        di += 1;
                        self.flow_done(kind, bytes, cross);
                    }
                }
            }
            done_buf = done;
            done_buf.clear();
            self.now = t_end;
        }
        self.out.source_elections = self
            .tracker
            .stats()
            .iter()
            .map(|s| s.source_elections)
            .sum();
        let overhead = self.sc.job.start_overhead_s;
        for n in &self.nodes {
            if n.job {
                match n.ready {
                    Some(t) => self.out.ready_s.push(t + overhead),
                    None => self.out.stuck += 1,
                }
            }
        }
        self.out.wall_s = wall.elapsed().as_secs_f64();
        Ok(self.out)
    }

    fn fire_timer(&mut self) {
        let Some(Reverse((t, _, TimerBox(timer)))) = self.timers.pop() else {
            return;
        };
        self.now = self.now.max(t as f64 / 1e9);
        match timer {
            Timer::Arrive(s) => self.arrive(s),
            Timer::Announce { slot, layer } => {
                let p = &self.pulls[slot as usize * self.layers + layer as usize];
                if p.active && !p.done {
                    self.announce(slot, layer);
                }
            }
            Timer::Heartbeat { slot, layer } => {
                self.announce(slot, layer);
                let every = self.sc.starling.seed_heartbeat_ms as f64 / 1e3;
                if self.pending > 0 {
                    self.at(self.now + every, Timer::Heartbeat { slot, layer });
                }
            }
            Timer::Manifest(s) => self.start_more(s),
            Timer::Start(kind) => self.start_flow(kind),
            Timer::UploadWait { from, id } => self.upload_wait_over(from, id),
        }
    }

    fn arrive(&mut self, s: u32) {
        if self.nodes[s as usize].left == 0 && self.nodes[s as usize].job {
            self.nodes[s as usize].ready = Some(self.now);
            self.pending -= 1;
        }
        // Seeds (complete holders) join the swarm and keep heartbeating.
        if self.transport == Transport::P2p {
            for l in 0..self.layers as u32 {
                if self.pulls[s as usize * self.layers + l as usize].done && self.needed[l as usize]
                {
                    self.announce(s, l);
                    let every = self.sc.starling.seed_heartbeat_ms as f64 / 1e3;
                    self.at(self.now + every, Timer::Heartbeat { slot: s, layer: l });
                }
            }
        }
        // The pull client asks the registry (through the agent) for the manifest first.
        if !self.nodes[s as usize].queue.is_empty() {
            let t = self.now + self.registry_latency(s, u32::MAX);
            self.at(t, Timer::Manifest(s));
        }
    }

    fn start_more(&mut self, s: u32) {
        while self.nodes[s as usize].active < self.sc.job.layer_concurrency
            && !self.nodes[s as usize].queue.is_empty()
        {
            let l = self.nodes[s as usize].queue.remove(0);
            self.nodes[s as usize].active += 1;
            self.pull(s, l).active = true;
            self.start_layer(s, l);
        }
    }

    fn start_layer(&mut self, s: u32, l: u32) {
        match self.transport {
            Transport::Direct => self.start_direct(s, l),
            Transport::SharedCache => {
                let t = self.now + self.sc.cache.latency_ms / 1e3;
                self.pull(s, l).cursor = 0;
                self.at(t, Timer::Start(Kind::CacheRead { slot: s, layer: l }));
            }
            Transport::P2p => self.announce(s, l),
        }
    }

    fn start_direct(&mut self, s: u32, l: u32) {
        let p = self.pull(s, l);
        if p.direct {
            return;
        }
        p.direct = true;
        let t = self.now + self.registry_latency(s, l);
        self.at(t, Timer::Start(Kind::Whole { slot: s, layer: l }));
    }

    fn layer_done(&mut self, s: u32, l: u32) {
        let p = self.pull(s, l);
        if p.done {
            return;
        }
        p.done = true;
        p.sched = None;
        let n = &mut self.nodes[s as usize];
        n.active -= 1;
        n.left -= 1;
        if n.left == 0 && n.ready.is_none() {
            n.ready = Some(self.now);
            if n.job {
                self.pending -= 1;
            }
        }
        if self.transport == Transport::P2p {
            // Tell the tracker at once, then keep serving (heartbeats).
            self.announce(s, l);
            let every = self.sc.starling.seed_heartbeat_ms as f64 / 1e3;
            self.at(self.now + every, Timer::Heartbeat { slot: s, layer: l });
        }
        self.start_more(s);
    }

    fn add_flow(&mut self, origin: Origin, dst: Option<u32>, bytes: u64, kind: Kind) {
        let (path, cross) = match dst {
            Some(d) => (
                self.net.path(origin, d),
                matches!(origin, Origin::Node(_)) && self.net.cross_rack(origin, d),
            ),
            // Cache fill: only the registry side is modelled.
            None => (FlowPath::new(&[0], self.net.per_connection), false),
        };
        self.add_flow_path(path, bytes, kind, cross);
    }

    /// Token buckets refill at their rate minus what their flows used over `dt`, up to
    /// the burst. Called before the flows advance by `dt` at their current rates.
    fn refill_buckets(&mut self, dt: f64) {
        for &b in &self.buckets {
            self.bucket_used[b as usize] = 0.0;
        }
        for (f, &r) in self.flows.iter().zip(&self.rates) {
            let busy = if r > 0.0 {
                (f.remaining / r).min(dt)
            } else {
                0.0
            };
            for &res in f.path.resources() {
                if self.net.burst[res as usize] > 0.0 {
                    self.bucket_used[res as usize] += r * busy;
                }
            }
        }
        for &b in &self.buckets {
            let b = b as usize;
            let spare = self.net.caps[b] * dt - self.bucket_used[b];
            self.tokens[b] = (self.tokens[b] + spare).clamp(0.0, self.net.burst[b]);
        }
    }

    fn add_flow_path(&mut self, path: FlowPath, bytes: u64, kind: Kind, cross_rack: bool) {
        // A token bucket with tokens left lets the first bytes through at once (the
        // links behind Starling's limits are much faster than the limits); the rest
        // flows at the bucket's rate.
        let mut remaining = bytes as f64;
        if !self.buckets.is_empty() {
            let free = path
                .resources()
                .iter()
                .filter(|&&r| self.net.burst[r as usize] > 0.0)
                .map(|&r| self.tokens[r as usize])
                .fold(f64::INFINITY, f64::min);
            if free.is_finite() && free > 0.0 {
                let take = free.min(remaining);
                remaining -= take;
                for &r in path.resources() {
                    if self.net.burst[r as usize] > 0.0 {
                        self.tokens[r as usize] -= take;
                    }
                }
            }
        }
        self.flows.push(Flow {
            path,
            remaining,
            bytes: bytes as f64,
            kind,
            cross_rack,
        });
        self.rates.push(0.0);
        self.dirty = true;
    }

    fn start_flow(&mut self, kind: Kind) {
        match kind {
            Kind::Whole { slot, layer } => {
                let node = self.nodes[slot as usize].node;
                self.add_flow(
                    Origin::Registry,
                    Some(node),
                    self.sizes[layer as usize],
                    kind,
                );
            }
            Kind::RegPiece { slot, layer, piece } => {
                let node = self.nodes[slot as usize].node;
                let len = self.piece_len(layer, piece);
                self.add_flow(Origin::Registry, Some(node), len, kind);
            }
            Kind::Piece {
                slot,
                layer,
                piece,
                from,
                wait,
            } => self.request_piece(slot, layer, piece, from, wait),
            Kind::Upload { .. } | Kind::Body { .. } => {}
            Kind::CacheFill { layer, piece } => {
                let len = self.piece_len(layer, piece);
                self.add_flow(Origin::Registry, None, len, kind);
            }
            Kind::CacheRead { slot, layer } => self.cache_next(slot, layer),
        }
    }

    fn cache_next(&mut self, s: u32, l: u32) {
        let count = self.count(l);
        let cursor = self.pull(s, l).cursor;
        if cursor >= count {
            self.layer_done(s, l);
            return;
        }
        if cursor < self.cache_have[l as usize] {
            let node = self.nodes[s as usize].node;
            let len = self.piece_len(l, cursor);
            self.add_flow(
                Origin::Cache,
                Some(node),
                len,
                Kind::CacheRead { slot: s, layer: l },
            );
            return;
        }
        self.cache_waiters[l as usize].push(s);
        if !self.cache_filling[l as usize] {
            self.cache_filling[l as usize] = true;
            let t = self.now + self.registry_latency(u32::MAX, l);
            self.at(t, Timer::Start(Kind::CacheFill { layer: l, piece: 0 }));
        }
    }

    fn flow_done(&mut self, kind: Kind, bytes: f64, cross: bool) {
        self.last_progress = self.now;
        match kind {
            Kind::Whole { slot, layer } => {
                self.out.registry_bytes += bytes;
                self.layer_done(slot, layer);
            }
            Kind::RegPiece { slot, layer, piece } => {
                self.out.registry_bytes += bytes;
                let node = self.nodes[slot as usize].node as usize;
                *self
                    .out
                    .source_bytes
                    .entry(self.names[node].clone())
                    .or_default() += bytes;
                let count = self.count(layer);
                let now_ms = (self.now * 1e3) as u64;
                let p = self.pull(slot, layer);
                let Some(sch) = p.sched.as_mut() else { return };
                sch.on_done(piece, REGISTRY_PEER, now_ms);
                if sch.is_complete() {
                    p.streaming = false;
                    self.layer_done(slot, layer);
                } else {
                    let next = (piece + 1..count).find(|&i| !sch.have().get(i));
                    if let Some(nx) = next {
                        self.start_flow(Kind::RegPiece {
                            slot,
                            layer,
                            piece: nx,
                        });
                    }
                }
            }
            Kind::Upload {
                slot,
                layer,
                piece,
                from,
            } => self.start_body(slot, layer, piece, from),
            Kind::Body {
                slot,
                layer,
                piece,
                from,
            } => self.body_head_done(slot, layer, piece, from, bytes, cross),
            Kind::Piece {
                slot,
                layer,
                piece,
                from,
                ..
            } => self.piece_done(slot, layer, piece, from, bytes, cross),
            Kind::CacheFill { layer, piece } => {
                self.out.registry_bytes += bytes;
                self.cache_have[layer as usize] = piece + 1;
                if piece + 1 < self.count(layer) {
                    self.start_flow(Kind::CacheFill {
                        layer,
                        piece: piece + 1,
                    });
                }
                let waiters = std::mem::take(&mut self.cache_waiters[layer as usize]);
                for s in waiters {
                    self.cache_next(s, layer);
                }
            }
            Kind::CacheRead { slot, layer } => {
                self.out.cache_bytes += bytes;
                self.pull(slot, layer).cursor += 1;
                self.cache_next(slot, layer);
            }
        }
    }
}

/// Convenience: plan and run one strategy at one job size.
pub fn simulate(
    sc: &Scenario,
    strategy: &crate::scenario::StrategySpec,
    job_nodes: usize,
) -> Result<Outcome, Error> {
    let plan = Plan::new(sc, strategy, job_nodes);
    Engine::new(sc, &plan).run()
}
