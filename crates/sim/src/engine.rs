//! The event loop: nodes arrive, pull layers (direct, through the shared cache, or
//! through the swarm), transfers share bandwidth max-min fairly, and their milestones
//! (a piece delivered, an upload slot freed) and timers (frames between agents,
//! tracker answers, registry answers) drive the agents' code.
//!
//! Domain files: `node` (a node's arrival, manifest and layer queue), `flows`
//! (transfers, streams and the step loop's bookkeeping), `fetch` (direct pulls, the
//! shared cache and the source's registry runs), `announce` (the download task's start
//! and its tracker round trips), `download` (the task's links, HAVEs, requests and
//! hashes), `serve` (the holder: its upload line and the pieces it writes), `pull` (a
//! task's state), `outcome` (what a run measured) and `debug` (`SIM_DEBUG`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use oci::Digest;
use swarm::scheduler::{mix, seed_for, SchedulerConfig};
use swarm::upload::{RequestBudget, UploadConfig, UploadQueue};
use swarm::wire::RejectReason;
use swarm::{SwarmConfig, TrackerState};

use crate::flow::Solver;
use crate::model::Network;
use crate::scenario::{Scenario, Transport};
use crate::strategy::Plan;
use crate::Error;

mod announce;
mod debug;
mod download;
mod fetch;
mod flows;
mod node;
mod outcome;
mod passes;
mod pull;
mod queue;
mod serve;

use flows::{FlowRec, Stream};
pub use outcome::{Outcome, SwarmCounters, UploadRecord};
use pull::Pull;

/// A frame or an answer on its way, or a task's wake-up.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Timer {
    Arrive(u32),
    /// The node's pull client has the manifest: its layer fetches begin.
    Manifest(u32),
    /// The agent's layer prefetch, its grace after serving the manifest, starts the
    /// node's large layers the client has not asked for yet.
    Prefetch(u32),
    /// A direct registry fetch's answer: its bytes start.
    DirectStart {
        slot: u32,
        layer: u32,
    },
    CacheStart {
        slot: u32,
        layer: u32,
    },
    CacheFillStart {
        layer: u32,
    },
    /// A complete blob's heartbeat (`/swarm/v1/seeding`).
    Heartbeat {
        slot: u32,
        layer: u32,
    },
    /// The answer to the announce in flight.
    AnnounceReply {
        slot: u32,
        layer: u32,
    },
    /// The download task's housekeeping tick (every 50 ms, as the agent's).
    Tick {
        slot: u32,
        layer: u32,
    },
    /// A peer asks the tracker again whether the source has announced the size.
    SizePoll {
        slot: u32,
        layer: u32,
    },
    /// The source's first registry GET answered (it learns the blob's size).
    SourceGet {
        slot: u32,
        layer: u32,
    },
    /// A registry Range GET for pieces `[first, end)` answered: its bytes start.
    RunStart {
        slot: u32,
        layer: u32,
        first: u32,
        end: u32,
    },
    /// A peer connection is up (or was already), and the channel's Open is sent.
    Connected {
        slot: u32,
        layer: u32,
        holder: u32,
    },
    /// The Open reaches the holder.
    Open {
        slot: u32,
        layer: u32,
        holder: u32,
    },
    /// The holder's bitfield (or "complete") reaches the downloader.
    Holds {
        slot: u32,
        layer: u32,
        holder: u32,
    },
    /// HAVE frames for `piece` reach the holder's subscribers.
    Have {
        holder: u32,
        layer: u32,
        piece: u32,
    },
    Request {
        slot: u32,
        layer: u32,
        piece: u32,
        holder: u32,
        urgent: bool,
    },
    Reject {
        slot: u32,
        layer: u32,
        piece: u32,
        holder: u32,
        reason: RejectReason,
    },
    Cancel {
        slot: u32,
        layer: u32,
        piece: u32,
        holder: u32,
    },
    Close {
        slot: u32,
        layer: u32,
        holder: u32,
    },
    /// A piece's last byte reaches the downloader.
    Delivered {
        slot: u32,
        layer: u32,
        piece: u32,
        holder: u32,
        claimed: bool,
    },
    HashReply {
        slot: u32,
        layer: u32,
    },
    /// A complete peer's hash list arrives (asked for when no source publishes).
    PeerHashes {
        slot: u32,
        layer: u32,
    },
    /// A downloader's HAVE_FILTER reaches the holder.
    Filter {
        slot: u32,
        layer: u32,
        holder: u32,
        filter: swarm::links::HaveFilter,
    },
}

pub(crate) fn ns(t: f64) -> u64 {
    (t * 1e9).round().max(0.0) as u64
}

pub(crate) struct NodeState {
    pub node: u32,
    pub job: bool,
    pub queue: Vec<u32>,
    pub active: usize,
    pub left: usize,
    pub ready: Option<f64>,
    /// The agent-wide request budget, shared by the node's download tasks.
    pub budget: RequestBudget,
    /// The node's upload line; connections are named by the downloader's slot.
    pub uploads: UploadQueue<u32>,
}

pub struct Engine<'a> {
    pub(crate) sc: &'a Scenario,
    pub(crate) net: Network,
    pub(crate) transport: Transport,
    pub(crate) tracker: TrackerState,
    pub(crate) sched_cfg: SchedulerConfig,
    /// Node names, shared: the scheduler's calls take a peer's name, and handing one
    /// over (2 million piece arrivals at 10,000 nodes) should not copy it.
    pub(crate) names: Vec<std::rc::Rc<str>>,
    pub(crate) digests: Vec<Digest>,
    pub(crate) sizes: Vec<u64>,
    pub(crate) nodes: Vec<NodeState>,
    /// Cluster node → participant slot (`u32::MAX`: not taking part).
    pub(crate) slot_index: Vec<u32>,
    pub(crate) pulls: Vec<Pull>,
    pub(crate) layers: usize,
    /// Per (holder slot, layer): downloader slots with an open channel (bitfield
    /// sent), each with the HAVEs it asked for (`HAVE_FILTER`), in the order they
    /// subscribed, for HAVE fan-out; and channels opened before the holder could answer.
    pub(crate) subs: Vec<Vec<(u32, swarm::links::HaveFilter)>>,
    pub(crate) pending_opens: Vec<Vec<u32>>,
    /// Peer connections (dialer slot, holder slot): one per pair, shared by blobs.
    pub(crate) conns: std::collections::HashSet<(u32, u32)>,
    /// Piece hashes per layer (hex), computed once the layout is known.
    pub(crate) hash_hex: Vec<Vec<String>>,
    /// Per layer, per piece: the participant slots whose download task holds it. The
    /// same bits as each task's scheduler has, in one place: a HAVE fan-out skips the
    /// holders without touching their state (at 10,000 nodes each of those is a cache
    /// miss, and half the fan-out goes to tasks that hold the piece).
    pub(crate) held: Vec<Vec<swarm::Bitfield>>,
    /// Scratch for `haves_arrive`: the subscribers a HAVE is delivered to.
    pub(crate) have_targets: Vec<u32>,
    /// `SIM_TRACE=slot/layer/piece`: that piece's claim, arrival and requests are
    /// printed. Read once: the checks run for every piece moved.
    pub(crate) traced_piece: Option<(u32, u32, u32)>,
    pub(crate) flows: Vec<FlowRec>,
    pub(crate) free_flows: Vec<u32>,
    pub(crate) streams: Vec<Option<Stream>>,
    pub(crate) free_streams: Vec<u32>,
    pub(crate) stream_of: HashMap<(u32, u32), u32>,
    pub(crate) dirty: bool,
    solver: Solver,
    timers: queue::TimerQueue<Timer>,
    seq: u64,
    pub(crate) now: f64,
    /// End of the current step: milestones up to here are processed in this step.
    pub(crate) step_end: f64,
    /// Milestones due in the current step: (time ns, seq, flow or stream).
    due: BinaryHeap<Reverse<(u64, u64, flows::DueBox)>>,
    /// Download tasks with something new to schedule.
    pub(crate) to_pump: Vec<(u32, u32)>,
    pub(crate) cache_have: Vec<u32>,
    pub(crate) cache_filling: Vec<bool>,
    pub(crate) cache_waiters: Vec<Vec<u32>>,
    /// Layers some job node must fetch (only those swarms get seed heartbeats).
    pub(crate) needed: Vec<bool>,
    /// Job nodes not ready yet.
    pub(crate) pending: usize,
    /// Last time any byte transfer completed.
    pub(crate) last_progress: f64,
    pub(crate) out: Outcome,
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
            // `starling demo --piece-size` configures the tracker and the agents
            // alike; with "auto" the tracker falls back to its rule for announces that
            // propose none (a seeding heartbeat proposes none).
            piece_size: st.piece_size.map(|b| b.0),
            announce_interval_ms: st.announce_interval_ms,
            stripe_min_members: st.stripe_min_members,
            ..SwarmConfig::default()
        };
        let sched_cfg = SchedulerConfig {
            min_window: st.min_window,
            max_window: st.max_window,
            window_ms: st.window_ms,
            max_inflight_total: st.max_inflight_total,
            patience_ms: st.patience_ms,
            large_patience_ms: st.large_patience_ms,
            huge_patience_ms: st.huge_patience_ms,
            ..SchedulerConfig::default()
        };
        let sizes: Vec<u64> = sc.image.layers.iter().map(|l| l.size.0).collect();
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
        let upload_cfg = UploadConfig {
            max_active: st.max_uploads as usize,
            max_queued_per_conn: st.upload_queue as usize,
            max_queued_total: st.upload_queue_total as usize,
            urgent_extra: st.urgent_upload_slots as usize,
        };
        let node_state = |node: u32, job: bool, queue: Vec<u32>| NodeState {
            node,
            job,
            left: queue.len(),
            queue,
            active: 0,
            ready: None,
            budget: RequestBudget::new(st.max_piece_requests),
            uploads: UploadQueue::new(upload_cfg.clone()),
        };
        for &j in &plan.job {
            slot_of[j as usize] = nodes.len() as u32;
            let queue: Vec<u32> = (0..layers as u32)
                .filter(|&l| !plan.holds[j as usize][l as usize])
                .collect();
            for &l in &queue {
                needed[l as usize] = true;
            }
            nodes.push(node_state(j, true, queue));
        }
        if plan.transport == Transport::P2p {
            for (i, h) in plan.holds.iter().enumerate() {
                if slot_of[i] == u32::MAX && h.iter().any(|&x| x) {
                    slot_of[i] = nodes.len() as u32;
                    nodes.push(node_state(i as u32, false, vec![]));
                }
            }
        }
        let mut pulls = Vec::with_capacity(nodes.len() * layers);
        for ns in &nodes {
            for l in 0..layers {
                pulls.push(Pull::new(plan.holds[ns.node as usize][l]));
            }
        }
        let per = nodes.len() * layers;
        Self {
            sc,
            net,
            transport: plan.transport,
            tracker: TrackerState::new(cfg),
            sched_cfg,
            names: (0..n).map(|i| format!("n{i}").into()).collect(),
            digests,
            sizes,
            nodes,
            slot_index: slot_of,
            pulls,
            layers,
            subs: vec![Vec::new(); per],
            pending_opens: vec![Vec::new(); per],
            conns: Default::default(),
            hash_hex: vec![Vec::new(); layers],
            held: vec![Vec::new(); layers],
            have_targets: Vec::new(),
            traced_piece: std::env::var("SIM_TRACE").ok().and_then(|v| {
                let mut it = v.split('/').map(|x| x.parse::<u32>().ok());
                Some((it.next()??, it.next()??, it.next()??))
            }),
            flows: Vec::new(),
            free_flows: Vec::new(),
            streams: Vec::new(),
            free_streams: Vec::new(),
            stream_of: HashMap::new(),
            dirty: true,
            solver: Solver::default(),
            timers: queue::TimerQueue::new(),
            seq: 0,
            now: 0.0,
            step_end: 0.0,
            due: BinaryHeap::new(),
            to_pump: Vec::new(),
            cache_have: vec![0; layers],
            cache_filling: vec![false; layers],
            cache_waiters: vec![Vec::new(); layers],
            needed,
            pending: plan.job.len(),
            last_progress: 0.0,
            out: Outcome::default(),
        }
    }

    pub(crate) fn at(&mut self, t: f64, timer: Timer) {
        self.seq += 1;
        self.timers.push((ns(t), self.seq), timer);
    }

    pub(crate) fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// One registry request's latency for participant `s` and layer `l` (`u32::MAX`:
    /// the manifest): `latency_ms` plus a pseudo-random share of `latency_jitter_ms`
    /// that is fixed by (node, layer), so runs stay reproducible.
    pub(crate) fn registry_latency(&self, s: u32, l: u32) -> f64 {
        let r = &self.sc.registry;
        (r.latency_ms + r.latency_jitter_ms * self.draw("registry", s, l)) / 1e3
    }

    /// A pseudo-random number in [0, 1) fixed by (what, node, layer, `sim.seed`).
    pub(crate) fn draw(&self, what: &str, s: u32, l: u32) -> f64 {
        // FNV-1a alone hardly moves its high bits when only the key's end changes:
        // splitmix spreads them.
        let key = format!("{what}/{s}/{l}");
        (mix(seed_for(&key) ^ self.sc.sim.seed, 0) >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(crate) fn pull(&mut self, slot: u32, layer: u32) -> &mut Pull {
        &mut self.pulls[slot as usize * self.layers + layer as usize]
    }

    pub(crate) fn pull_ref(&self, slot: u32, layer: u32) -> &Pull {
        &self.pulls[slot as usize * self.layers + layer as usize]
    }

    pub(crate) fn pi(&self, slot: u32, layer: u32) -> usize {
        slot as usize * self.layers + layer as usize
    }

    /// The participant slot of a node named by the tracker (`n<index>`).
    pub(crate) fn slot_named(&self, name: &str) -> Option<u32> {
        let node: usize = name.strip_prefix('n')?.parse().ok()?;
        self.slot_index
            .get(node)
            .copied()
            .filter(|&s| s != u32::MAX)
    }

    pub(crate) fn peer_latency(&self) -> f64 {
        self.sc.starling.peer_latency_ms / 1e3
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
        let seed = self.sc.sim.seed;
        order.sort_by_key(|&s| mix(seed_for(&format!("arrive{s}")) ^ seed, 1));
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
        let stall = self.sc.sim.stall_seconds.unwrap_or(300.0);
        let debug = std::env::var_os("SIM_DEBUG").is_some();
        let mut next_sample = 0.0;
        while self.pending > 0 {
            if self.dirty {
                let t0 = Instant::now();
                self.solve();
                self.out.solver_wall_s += t0.elapsed().as_secs_f64();
                self.dirty = false;
            }
            let mut next = self.next_milestone();
            if let Some((t, _)) = self.timers.peek() {
                next = next.min(t as f64 / 1e9);
            }
            if !next.is_finite() || next > max_t {
                break;
            }
            // Nothing has arrived anywhere for `stall_seconds`: the swarm is stuck (the
            // remaining nodes are reported as never ready).
            if self.now - self.last_progress > stall {
                break;
            }
            self.step_end = next.max(self.now + quantum);
            self.out.steps += 1;
            self.collect_due();
            loop {
                let tm = self.due.peek().map(|Reverse((t, s, _))| (*t, *s));
                let tt = self
                    .timers
                    .peek()
                    .filter(|&(t, _)| t as f64 / 1e9 <= self.step_end + 1e-12);
                let fire_timer = match (tm, tt) {
                    (None, None) => break,
                    (Some(_), None) => false,
                    (None, Some(_)) => true,
                    (Some(m), Some(t)) => t < m,
                };
                let t = if fire_timer { tt } else { tm }.map_or(self.now, |x| x.0 as f64 / 1e9);
                // The agents' tasks run between events: what the previous instant made
                // schedulable is requested before time moves on.
                if t > self.now + 1e-12 {
                    self.pump_all();
                    self.now = t;
                }
                if fire_timer {
                    if let Some((_, timer)) = self.timers.pop() {
                        self.fire(timer);
                    }
                } else if let Some(Reverse((_, _, due))) = self.due.pop() {
                    self.milestone(due);
                }
            }
            self.pump_all();
            self.advance_all(self.step_end);
            if debug && self.step_end >= next_sample {
                next_sample += std::env::var("SIM_DEBUG_EVERY")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(5.0);
                self.debug_sample();
            }
            self.now = self.step_end;
        }
        if std::env::var_os("SIM_DEBUG").is_some() {
            self.debug_dump();
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

    fn fire(&mut self, timer: Timer) {
        match timer {
            Timer::Arrive(s) => self.arrive(s),
            Timer::Manifest(s) => self.manifest_served(s),
            Timer::Prefetch(s) => self.prefetch(s),
            Timer::DirectStart { slot, layer } => self.direct_start(slot, layer),
            Timer::CacheStart { slot, layer } => self.cache_next(slot, layer),
            Timer::CacheFillStart { layer } => self.cache_fill_start(layer),
            Timer::Heartbeat { slot, layer } => self.heartbeat(slot, layer),
            Timer::AnnounceReply { slot, layer } => self.announce_reply(slot, layer),
            Timer::Tick { slot, layer } => self.tick(slot, layer),
            Timer::SourceGet { slot, layer } => self.source_get(slot, layer),
            Timer::SizePoll { slot, layer } => self.size_poll(slot, layer),
            Timer::RunStart {
                slot,
                layer,
                first,
                end,
            } => self.run_start(slot, layer, first, end),
            Timer::Connected {
                slot,
                layer,
                holder,
            } => self.connected(slot, layer, holder),
            Timer::Open {
                slot,
                layer,
                holder,
            } => self.open_at_holder(slot, layer, holder),
            Timer::Holds {
                slot,
                layer,
                holder,
            } => self.holds_arrived(slot, layer, holder),
            Timer::Have {
                holder,
                layer,
                piece,
            } => self.haves_arrive(holder, layer, piece),
            Timer::Request {
                slot,
                layer,
                piece,
                holder,
                urgent,
            } => self.request_at_holder(slot, layer, piece, holder, urgent),
            Timer::Reject {
                slot,
                layer,
                piece,
                holder,
                reason,
            } => self.rejected(slot, layer, piece, holder, reason),
            Timer::Cancel {
                slot,
                layer,
                piece,
                holder,
            } => self.cancel_at_holder(slot, layer, piece, holder),
            Timer::Close {
                slot,
                layer,
                holder,
            } => self.close_at_holder(slot, layer, holder),
            Timer::Delivered {
                slot,
                layer,
                piece,
                holder,
                claimed,
            } => self.piece_arrived(slot, layer, piece, holder, claimed),
            Timer::HashReply { slot, layer } => self.hash_reply(slot, layer),
            Timer::PeerHashes { slot, layer } => self.peer_hashes(slot, layer),
            Timer::Filter {
                slot,
                layer,
                holder,
                filter,
            } => self.filter_at_holder(slot, layer, holder, filter),
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
