//! `SIM_DEBUG`: a line per sampled instant (who receives, who queues) and, at the
//! end, every node's, stream's and unfinished task's state.

use super::Engine;

impl Engine<'_> {
    pub(crate) fn debug_sample(&self) {
        let mut into = vec![(0usize, 0.0f64); self.nodes.len()];
        let mut out = vec![(0usize, 0.0f64); self.nodes.len()];
        for st in self.streams.iter().flatten() {
            let r = st.r.map_or(0.0, |f| self.flows[f as usize].rate);
            into[st.dst as usize].0 += 1;
            into[st.dst as usize].1 += r;
            out[st.holder as usize].0 += 1;
            out[st.holder as usize].1 += r;
        }
        let mut line = format!("t={:.2}", self.now);
        let tot_in: f64 = into.iter().map(|x| x.1).sum();
        let idle = into
            .iter()
            .zip(&self.nodes)
            .filter(|(x, n)| x.1 == 0.0 && n.ready.is_none())
            .count();
        let used: u32 = self
            .nodes
            .iter()
            .map(|n| self.sc.starling.max_piece_requests - n.budget.available())
            .sum();
        let queued: usize = self.nodes.iter().map(|n| n.uploads.queued()).sum();
        line += &format!(" in {:.0} MiB/s, {idle} not-ready nodes receiving nothing, budget used {used}, queued {queued}, streams {}", tot_in / 1048576.0, self.stream_of.len());
        // How far pieces have spread: the fewest holders of any piece, and the pieces
        // held by fewer than half the nodes.
        for held in &self.held {
            let counts: Vec<u32> = held.iter().map(|b| b.count()).collect();
            let half = self.nodes.len() as u32 / 2;
            line += &format!(
                ", pieces: fewest holders {}, under half {}",
                counts.iter().min().copied().unwrap_or(0),
                counts.iter().filter(|&&c| c < half).count()
            );
        }
        let mut top: Vec<usize> = (0..self.nodes.len()).collect();
        top.sort_by_key(|&i| std::cmp::Reverse(self.nodes[i].uploads.queued()));
        for &i in top.iter().take(4) {
            let n = &self.nodes[i];
            line += &format!(
                " | n{i} in {}:{:.0} out {}:{:.0} q {} act {}",
                into[i].0,
                into[i].1 / 1048576.0,
                out[i].0,
                out[i].1 / 1048576.0,
                n.uploads.queued(),
                n.uploads.active()
            );
        }
        eprintln!("{line}");
    }

    pub(crate) fn debug_dump(&self) {
        for (s, n) in self.nodes.iter().enumerate() {
            let v: Vec<String> = (0..self.layers as u32)
                .map(|l| {
                    let p = self.pull_ref(s as u32, l);
                    format!(
                        "{:.1}-{:.1}{}",
                        p.requested_at,
                        p.finished_at,
                        if p.registry_bytes > 0.0 { "*" } else { "" }
                    )
                })
                .collect();
            eprintln!("node {s} ready {:?}: {}", n.ready, v.join(" "));
        }
        for (sid, st) in self.streams.iter().enumerate() {
            let Some(st) = st else { continue };
            eprintln!(
                "stream {sid} {}->{} jobs {:?} written {} delivered {} total {} w {:?} r {:?} at {} coupling {}",
                st.holder, st.dst,
                st.jobs.iter().map(|j| (j.layer, j.piece, j.released, j.claimed)).collect::<Vec<_>>(),
                st.written, st.delivered, st.total,
                st.w.map(|f| (f, self.flows[f as usize].rate, self.flows[f as usize].live)),
                st.r.map(|f| (f, self.flows[f as usize].rate, self.flows[f as usize].live)),
                st.at, st.coupling
            );
        }
        for (s, n) in self.nodes.iter().enumerate() {
            if n.ready.is_some() {
                continue;
            }
            for l in 0..self.layers as u32 {
                let p = self.pull_ref(s as u32, l);
                if p.done {
                    continue;
                }
                let sch = p.sched.as_ref();
                eprintln!(
                    "slot {s} layer {l}: phase {:?} active {} role {:?} have {:?}/{:?} inflight {:?} links {} unverified {:?} budgeted {} hashes {} avail {} runs {} pending_runs {}",
                    p.phase, p.active, p.role,
                    sch.map(|x| x.have().count()), sch.map(|x| x.have().len()),
                    sch.map(|x| x.inflight_count()), p.links.len(), p.unverified, p.budgeted.len(),
                    p.hashes.count(), n.budget.available(), p.runs.len(), p.pending_runs
                );
                if let Some(x) = sch {
                    let missing: Vec<u32> = (0..x.have().len())
                        .filter(|&i| !x.have().get(i))
                        .take(10)
                        .collect();
                    eprintln!(
                        "   missing {:?} orphans {:?} claimed {:?}",
                        missing,
                        x.orphans().iter().take(10).collect::<Vec<_>>(),
                        missing
                            .iter()
                            .map(|&i| (p.claimed.get(i), x.is_inflight(i)))
                            .collect::<Vec<_>>()
                    );
                }
            }
        }
    }
}
