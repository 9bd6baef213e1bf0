//! Scheduling passes: the agent's `schedule` after each event, for every download
//! task the event made schedulable, run before time moves on.
//!
//! (Running a batch's passes on two threads was measured and dropped: at 10,000 nodes
//! the passes took 21 % less wall time but the run took 11 % more, the helper's
//! waiting slowing the main thread; BENCHMARKS.md, issue 11, twentieth session.)

use std::time::Instant;

use super::pull::Phase;
use super::{Engine, Timer};

impl Engine<'_> {
    /// Whether `next_requests` could return anything: the read head is open, or the
    /// budget and the blob's cap leave room, or the blob is in endgame. Otherwise it
    /// returns nothing and changes nothing, and the pass is skipped.
    fn could_request(&self, s: u32, l: u32) -> bool {
        let Some(sch) = self.pull_ref(s, l).sched.as_ref() else {
            return false;
        };
        let have = sch.have();
        let head = have.prefix();
        (head < have.len() && !sch.is_inflight(head))
            || have.len() - have.count() <= self.sched_cfg.endgame
            || (self.nodes[s as usize].budget.available() > 0
                && sch.inflight_count() < self.sched_cfg.max_inflight_total)
    }

    /// Queues a scheduling pass for the task (run before time moves on).
    pub(crate) fn mark(&mut self, s: u32, l: u32) {
        let p = self.pull(s, l);
        if !p.queued_pump {
            p.queued_pump = true;
            self.to_pump.push((s, l));
        }
    }

    pub(crate) fn pump_all(&mut self) {
        while !self.to_pump.is_empty() {
            let batch = std::mem::take(&mut self.to_pump);
            for (s, l) in batch {
                self.pump(s, l);
            }
        }
    }

    /// `schedule`: the scheduler's next requests, sent over the peers' channels.
    fn pump(&mut self, s: u32, l: u32) {
        let now_ms = self.now_ms();
        let avail = self.nodes[s as usize].budget.available();
        let p = self.pull(s, l);
        p.queued_pump = false;
        if p.done || p.phase != Phase::Swarm || !self.could_request(s, l) {
            return;
        }
        self.out.counters.passes += 1;
        let Some(sch) = self.pull(s, l).sched.as_mut() else {
            return;
        };
        let t0 = Instant::now();
        let reqs = sch.next_requests(now_ms, avail);
        self.out.scheduler_wall_s += t0.elapsed().as_secs_f64();
        let lat = self.peer_latency();
        for r in reqs {
            let h = self.slot_named(&r.peer);
            let p = self.pull(s, l);
            let linked = h.and_then(|h| p.links.get(&h)).is_some_and(|k| k.connected);
            let (Some(h), true) = (h, linked) else {
                if let Some(sch) = p.sched.as_mut() {
                    sch.on_failed(r.piece, &r.peer, false);
                }
                continue;
            };
            if !r.urgent {
                if !p.budgeted.contains(&(r.piece, h)) {
                    p.budgeted.push((r.piece, h));
                }
                self.nodes[s as usize].budget.take(1);
            }
            self.out.counters.requests += 1;
            self.at(
                self.now + lat,
                Timer::Request {
                    slot: s,
                    layer: l,
                    piece: r.piece,
                    holder: h,
                    urgent: r.urgent,
                },
            );
        }
        let used = self.nodes[s as usize].budget.used();
        self.out.counters.peak_requests = self.out.counters.peak_requests.max(used);
        let avail = self.nodes[s as usize].budget.available();
        self.pull(s, l).budget_seen = avail;
    }
}
