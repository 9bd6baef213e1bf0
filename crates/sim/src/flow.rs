//! Max-min fair bandwidth sharing (progressive filling) over shared resources.
//!
//! Every flow crosses a few resources (a node's uplink, another node's downlink, rack
//! and zone uplinks, the registry's egress) and may carry its own rate cap (the
//! registry's per-connection limit). Rates are raised together; a resource that runs
//! out freezes the flows crossing it at its fair share, a flow that hits its own cap
//! freezes there; the rest keep rising. The result is the unique max-min fair
//! allocation.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Index of a shared resource (capacity in bytes/s).
pub type ResId = u32;

/// Upper bound on resources per flow (src up, dst down, two racks, two zones, origin).
pub const MAX_PATH: usize = 8;

#[derive(Clone, Debug)]
pub struct FlowPath {
    pub res: [ResId; MAX_PATH],
    pub len: u8,
    /// Own cap in bytes/s (`f64::INFINITY` for none).
    pub cap: f64,
}

impl FlowPath {
    pub fn new(res: &[ResId], cap: f64) -> Self {
        let mut a = [0; MAX_PATH];
        let len = res.len().min(MAX_PATH);
        a[..len].copy_from_slice(&res[..len]);
        Self {
            res: a,
            len: len as u8,
            cap,
        }
    }

    pub fn resources(&self) -> &[ResId] {
        &self.res[..self.len as usize]
    }
}

#[derive(PartialEq)]
struct Share(f64, u32);
impl Eq for Share {}
impl PartialOrd for Share {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Share {
    fn cmp(&self, o: &Self) -> Ordering {
        // Min-heap on the share.
        o.0.total_cmp(&self.0).then(o.1.cmp(&self.1))
    }
}

/// Reusable solver state (buffers kept between calls to avoid allocation).
#[derive(Default)]
pub struct Solver {
    rem: Vec<f64>,
    cnt: Vec<u32>,
    start: Vec<u32>,
    members: Vec<u32>,
    frozen: Vec<bool>,
    by_cap: Vec<u32>,
}

impl Solver {
    /// Fills `rates[i]` for every flow in `paths` given resource capacities `caps`.
    pub fn solve(&mut self, caps: &[f64], paths: &[&FlowPath], rates: &mut Vec<f64>) {
        let nr = caps.len();
        let nf = paths.len();
        rates.clear();
        rates.resize(nf, 0.0);
        self.rem.clear();
        self.rem.extend_from_slice(caps);
        self.cnt.clear();
        self.cnt.resize(nr, 0);
        for p in paths {
            for &r in p.resources() {
                self.cnt[r as usize] += 1;
            }
        }
        // CSR: flows per resource.
        self.start.clear();
        self.start.resize(nr + 1, 0);
        for r in 0..nr {
            self.start[r + 1] = self.start[r] + self.cnt[r];
        }
        self.members.clear();
        self.members.resize(self.start[nr] as usize, 0);
        let mut fill: Vec<u32> = self.start[..nr].to_vec();
        for (i, p) in paths.iter().enumerate() {
            for &r in p.resources() {
                self.members[fill[r as usize] as usize] = i as u32;
                fill[r as usize] += 1;
            }
        }
        self.frozen.clear();
        self.frozen.resize(nf, false);
        self.by_cap.clear();
        self.by_cap
            .extend((0..nf as u32).filter(|&i| paths[i as usize].cap.is_finite()));
        self.by_cap
            .sort_by(|&a, &b| paths[a as usize].cap.total_cmp(&paths[b as usize].cap));
        let mut cap_i = 0;
        let mut heap = BinaryHeap::with_capacity(nr);
        for r in 0..nr {
            if self.cnt[r] > 0 {
                heap.push(Share(self.rem[r].max(0.0) / self.cnt[r] as f64, r as u32));
            }
        }
        let mut left = nf;
        while left > 0 {
            // Skip stale heap entries.
            while let Some(Share(s, r)) = heap.peek() {
                let r = *r as usize;
                let cur = if self.cnt[r] == 0 {
                    f64::NAN
                } else {
                    self.rem[r].max(0.0) / self.cnt[r] as f64
                };
                if self.cnt[r] == 0 || cur != *s {
                    heap.pop();
                } else {
                    break;
                }
            }
            while cap_i < self.by_cap.len() && self.frozen[self.by_cap[cap_i] as usize] {
                cap_i += 1;
            }
            let res_level = heap.peek().map(|s| s.0);
            let cap_level = self.by_cap.get(cap_i).map(|&f| paths[f as usize].cap);
            let take_cap = match (res_level, cap_level) {
                (None, None) => break,
                (None, Some(_)) => true,
                (Some(_), None) => false,
                (Some(s), Some(c)) => c <= s,
            };
            if take_cap {
                let f = self.by_cap[cap_i] as usize;
                let c = paths[f].cap;
                self.freeze(f, c, paths, rates, &mut heap);
                left -= 1;
            } else if let Some(Share(s, r)) = heap.pop() {
                let r = r as usize;
                let (a, b) = (self.start[r] as usize, self.start[r + 1] as usize);
                for k in a..b {
                    let f = self.members[k] as usize;
                    if !self.frozen[f] {
                        self.freeze(f, s, paths, rates, &mut heap);
                        left -= 1;
                    }
                }
            }
        }
    }

    fn freeze(
        &mut self,
        f: usize,
        rate: f64,
        paths: &[&FlowPath],
        rates: &mut [f64],
        heap: &mut BinaryHeap<Share>,
    ) {
        self.frozen[f] = true;
        rates[f] = rate;
        for &r in paths[f].resources() {
            let r = r as usize;
            self.rem[r] -= rate;
            self.cnt[r] -= 1;
            if self.cnt[r] > 0 {
                heap.push(Share(self.rem[r].max(0.0) / self.cnt[r] as f64, r as u32));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_max_min() {
        // Link 0 (cap 10) shared by flows a, b; link 1 (cap 4) by b, c.
        let a = FlowPath::new(&[0], f64::INFINITY);
        let b = FlowPath::new(&[0, 1], f64::INFINITY);
        let c = FlowPath::new(&[1], f64::INFINITY);
        let mut rates = Vec::new();
        Solver::default().solve(&[10.0, 4.0], &[&a, &b, &c], &mut rates);
        assert_eq!(rates, vec![8.0, 2.0, 2.0]);
        // A capped flow leaves room for the others.
        let d = FlowPath::new(&[0], 1.0);
        Solver::default().solve(&[10.0, 4.0], &[&a, &d], &mut rates);
        assert_eq!(rates, vec![9.0, 1.0]);
    }
}
