//! A node's pull: its arrival, the manifest, which of its layers start when
//! (`layer_concurrency`, the agent's prefetch) and each layer's end. Apart from the
//! run loop because it is the client's per-node bookkeeping, not event dispatch.

use super::{Engine, Timer};
use crate::scenario::Transport;

impl Engine<'_> {
    pub(crate) fn arrive(&mut self, s: u32) {
        if self.nodes[s as usize].left == 0 && self.nodes[s as usize].job {
            self.nodes[s as usize].ready = Some(self.now);
            self.pending -= 1;
        }
        // Seeds (complete holders) join the swarm and keep heartbeating.
        if self.transport == Transport::P2p {
            for l in 0..self.layers as u32 {
                if self.pull_ref(s, l).done && self.needed[l as usize] {
                    self.heartbeat(s, l);
                }
            }
        }
        // The pull client asks the registry (through the agent) for the manifest first.
        if !self.nodes[s as usize].queue.is_empty() {
            let t = self.now + self.registry_latency(s, u32::MAX);
            self.at(t, Timer::Manifest(s));
        }
    }

    /// The agent serves the manifest to the pull client, which starts its first
    /// fetches; with `prefetch_layers`, the agent starts the rest after its grace.
    pub(crate) fn manifest_served(&mut self, s: u32) {
        if self.transport == Transport::P2p && self.sc.starling.prefetch_layers {
            let grace = self.sc.starling.prefetch_grace_ms as f64 / 1e3;
            self.at(self.now + grace, Timer::Prefetch(s));
        }
        self.start_more(s);
    }

    /// `fetch::manifest_served`'s background task: every layer the swarm carries
    /// (`swarm::prefetch`) that is neither held nor started yet begins now.
    pub(crate) fn prefetch(&mut self, s: u32) {
        let threshold = self.sc.starling.min_p2p_size.0;
        let picked: Vec<u32> =
            swarm::prefetch::prefetched_layers(self.sizes.iter().copied(), threshold)
                .map(|l| l as u32)
                .filter(|l| self.nodes[s as usize].queue.contains(l))
                .collect();
        for l in picked {
            self.nodes[s as usize].queue.retain(|&q| q != l);
            let now = self.now;
            let p = self.pull(s, l);
            p.active = true;
            p.prefetched = true;
            p.requested_at = now;
            self.swarm_start(s, l);
        }
    }

    fn start_more(&mut self, s: u32) {
        while self.nodes[s as usize].active < self.sc.job.layer_concurrency
            && !self.nodes[s as usize].queue.is_empty()
        {
            let l = self.nodes[s as usize].queue.remove(0);
            self.nodes[s as usize].active += 1;
            let now = self.now;
            let p = self.pull(s, l);
            p.active = true;
            p.requested_at = now;
            match self.transport {
                Transport::Direct => self.start_direct(s, l),
                Transport::SharedCache => {
                    let t = self.now + self.sc.cache.latency_ms / 1e3;
                    self.at(t, Timer::CacheStart { slot: s, layer: l });
                }
                Transport::P2p => self.swarm_start(s, l),
            }
        }
    }

    pub(crate) fn layer_done(&mut self, s: u32, l: u32) {
        let now = self.now;
        let p = self.pull(s, l);
        if p.done {
            return;
        }
        p.done = true;
        p.finished_at = now;
        let by_client = !p.prefetched;
        let n = &mut self.nodes[s as usize];
        if by_client {
            n.active -= 1;
        }
        n.left -= 1;
        if n.left == 0 && n.ready.is_none() {
            n.ready = Some(self.now);
            if n.job {
                self.pending -= 1;
            }
        }
        self.start_more(s);
    }
}
