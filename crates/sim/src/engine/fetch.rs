//! Bytes from the registry: direct pulls, the shared cache, and a swarm source's
//! registry runs (disjoint slices over separate connections, download.rs
//! `plan_runs`/`begin_run`, each piece held as its last byte is written).

use swarm::pieces::{piece_size_for, plan_registry_runs, registry_run_bytes, registry_streams_for};
use swarm::PieceLayout;

use super::flows::Owner;
use super::pull::{Phase, Run};
use super::{Engine, Timer};
use crate::flow::FlowPath;
use crate::model::Origin;

impl Engine<'_> {
    /// The registry path (`lead_from_registry`): one GET, then the whole blob.
    pub(crate) fn start_direct(&mut self, s: u32, l: u32) {
        let p = self.pull(s, l);
        if p.phase == Phase::Direct {
            return;
        }
        p.phase = Phase::Direct;
        let t = self.now + self.registry_latency(s, l);
        self.at(t, Timer::DirectStart { slot: s, layer: l });
    }

    pub(crate) fn direct_start(&mut self, s: u32, l: u32) {
        let bytes = self.sizes[l as usize] as f64;
        self.add_net_flow(
            Origin::Registry,
            s,
            bytes,
            Owner::Whole { slot: s, layer: l },
        );
    }

    /// The cache's chunk: cut-through reads advance by this much.
    fn cache_chunk(&self, l: u32) -> PieceLayout {
        let size = self.sizes[l as usize];
        PieceLayout::new(size, piece_size_for(size, Some(self.net.link_rate)))
    }

    pub(crate) fn cache_next(&mut self, s: u32, l: u32) {
        self.pull(s, l).phase = Phase::Cache;
        let chunks = self.cache_chunk(l);
        let cursor = self.pull_ref(s, l).cursor;
        if cursor >= chunks.count() {
            self.layer_done(s, l);
            return;
        }
        if cursor < self.cache_have[l as usize] {
            let len = chunks.len(cursor) as f64;
            self.add_net_flow(
                Origin::Cache,
                s,
                len,
                Owner::CacheRead { slot: s, layer: l },
            );
            return;
        }
        self.cache_waiters[l as usize].push(s);
        if !self.cache_filling[l as usize] {
            self.cache_filling[l as usize] = true;
            let t = self.now + self.registry_latency(u32::MAX, l);
            self.at(t, Timer::CacheFillStart { layer: l });
        }
    }

    pub(crate) fn cache_fill_start(&mut self, l: u32) {
        let len = self.cache_chunk(l).len(0) as f64;
        let path = self.net.cache_fill_path();
        self.add_flow(path, len, Owner::CacheFill { layer: l });
    }

    /// A plain flow reached its milestone.
    pub(crate) fn flow_milestone(&mut self, id: u32) {
        match self.flows[id as usize].owner {
            Owner::Whole { slot, layer } => {
                let bytes = self.sizes[layer as usize] as f64;
                self.out.registry_bytes += bytes;
                if self.sc.cluster.nodes_per_rack > 0 {
                    self.out.cross_rack_bytes += bytes;
                }
                self.remove_flow(id);
                self.layer_done(slot, layer);
            }
            Owner::CacheFill { layer } => {
                let chunks = self.cache_chunk(layer);
                let piece = self.cache_have[layer as usize];
                self.out.registry_bytes += chunks.len(piece) as f64;
                self.cache_have[layer as usize] = piece + 1;
                if piece + 1 < chunks.count() {
                    self.extend_flow(id, chunks.len(piece + 1) as f64);
                } else {
                    self.remove_flow(id);
                }
                let waiters = std::mem::take(&mut self.cache_waiters[layer as usize]);
                for s in waiters {
                    self.cache_next(s, layer);
                }
            }
            Owner::CacheRead { slot, layer } => {
                let chunks = self.cache_chunk(layer);
                let cursor = self.pull_ref(slot, layer).cursor;
                let len = chunks.len(cursor) as f64;
                self.out.cache_bytes += len;
                if self.sc.cluster.nodes_per_rack > 0 {
                    self.out.cross_rack_bytes += len;
                }
                let next = cursor + 1;
                self.pull(slot, layer).cursor = next;
                if next < chunks.count() && next < self.cache_have[layer as usize] {
                    self.extend_flow(id, chunks.len(next) as f64);
                } else {
                    self.remove_flow(id);
                    self.cache_next(slot, layer);
                }
            }
            Owner::Run { slot, layer, first } => self.run_piece_done(id, slot, layer, first),
            Owner::StreamW | Owner::StreamR => {}
        }
    }

    /// Registry connections a source may use for this blob (the agent's
    /// `registry_stream_cap`).
    pub(crate) fn registry_stream_cap(&self, layout: PieceLayout) -> u32 {
        registry_streams_for(layout.blob_size, self.sc.starling.registry_streams)
    }

    /// The runs to start for `[a, b)`, one per idle registry connection, sized from the
    /// rate so far: the agent's `plan_runs`, through the same
    /// `swarm::pieces::plan_registry_runs`.
    pub(crate) fn plan_runs(
        &self,
        s: u32,
        l: u32,
        layout: PieceLayout,
        a: u32,
        b: u32,
    ) -> Vec<(u32, u32)> {
        let p = self.pull_ref(s, l);
        let streams = self.registry_stream_cap(layout);
        let busy = p.runs.len() as u32 + p.pending_runs;
        let seconds = p.registry_since.map_or(0.0, |t| self.now - t);
        let run_bytes = registry_run_bytes(p.registry_bytes as u64, seconds, streams);
        plan_registry_runs(
            layout,
            a,
            b,
            streams.saturating_sub(busy),
            streams,
            run_bytes,
        )
    }

    /// Starts registry runs for `[a, b)`: the first on `open` (the source's first GET,
    /// already answered) if given, each other after its own Range GET's round trip,
    /// one after the other (the task awaits each `get_blob_range`).
    pub(crate) fn begin_runs(&mut self, s: u32, l: u32, a: u32, b: u32, open: bool) {
        let Some(layout) = self.pull_ref(s, l).layout else {
            return;
        };
        let lat = self.registry_latency(s, l);
        let mut t = self.now;
        let plan = self.plan_runs(s, l, layout, a, b);
        let now = self.now;
        self.pull(s, l).registry_since.get_or_insert(now);
        // Claimed now, as the agent's task claims a run before it plans the next: a
        // connection freed meanwhile must not plan the same pieces.
        if let Some(sch) = self.pull(s, l).sched.as_mut() {
            for &(x, y) in &plan {
                for i in x..y {
                    sch.claim(i);
                }
            }
        }
        self.pull(s, l).pending_runs += plan.len() as u32;
        for (i, (x, y)) in plan.into_iter().enumerate() {
            if i > 0 || !open {
                t += lat;
            }
            self.at(
                t,
                Timer::RunStart {
                    slot: s,
                    layer: l,
                    first: x,
                    end: y,
                },
            );
        }
    }

    pub(crate) fn run_start(&mut self, s: u32, l: u32, first: u32, end: u32) {
        let p = self.pull(s, l);
        p.pending_runs = p.pending_runs.saturating_sub(1);
        if p.done || p.phase != Phase::Swarm {
            return;
        }
        let Some(layout) = p.layout else {
            return;
        };
        if p.sched.is_none() {
            return;
        }
        let start = first;
        let len = layout.len(start) as f64;
        let flow = self.add_net_flow(
            Origin::Registry,
            s,
            len,
            Owner::Run {
                slot: s,
                layer: l,
                first,
            },
        );
        self.out.registry_connections += 1;
        self.pull(s, l).runs.push(Run {
            first,
            end,
            next: start,
            flow,
        });
        // A new registry fetcher says so at once, so the tracker keeps the election.
        self.announce(s, l);
    }

    fn run_piece_done(&mut self, id: u32, s: u32, l: u32, first: u32) {
        let Some(ri) = self
            .pull_ref(s, l)
            .runs
            .iter()
            .position(|r| r.first == first)
        else {
            self.remove_flow(id);
            return;
        };
        let Some(layout) = self.pull_ref(s, l).layout else {
            return;
        };
        let run = self.pull_ref(s, l).runs[ri];
        let piece = run.next;
        let len = layout.len(piece) as f64;
        self.out.registry_bytes += len;
        if self.sc.cluster.nodes_per_rack > 0 {
            self.out.cross_rack_bytes += len;
        }
        let node = self.nodes[s as usize].node as usize;
        *self
            .out
            .source_bytes
            .entry(self.names[node].to_string())
            .or_default() += len;
        self.pull(s, l).registry_bytes += len;
        let next = piece + 1;
        if next < run.end {
            self.pull(s, l).runs[ri].next = next;
            self.extend_flow(id, layout.len(next) as f64);
            self.registry_piece(s, l, piece);
        } else {
            self.remove_flow(id);
            self.pull(s, l).runs.remove(ri);
            self.registry_piece(s, l, piece);
            self.refill_runs(s, l);
        }
    }
}

impl crate::model::Network {
    /// The registry filling the shared cache (only the registry side is modelled).
    pub fn cache_fill_path(&self) -> FlowPath {
        FlowPath::new(&[0], self.per_connection)
    }
}
