//! Strategies: which nodes run the job, what they hold when it starts, and how the
//! missing layers travel (direct, shared cache or the swarm).

use crate::scenario::{Kind, Scenario, StrategySpec, Transport};

/// Deterministic splitmix64.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// The starting state a strategy implies.
pub struct Plan {
    pub transport: Transport,
    /// Cluster nodes running the job (`job_nodes` of them).
    pub job: Vec<u32>,
    /// Per cluster node, per layer: held at t = 0.
    pub holds: Vec<Vec<bool>>,
}

impl Plan {
    pub fn new(sc: &Scenario, s: &StrategySpec, job_nodes: usize) -> Self {
        let n = sc.cluster_nodes().max(job_nodes);
        let layers = sc.image.layers.len();
        let mut rng = Rng::new(sc.sim.seed);
        let mut holds = vec![vec![false; layers]; n];
        let mut job: Vec<u32> = (0..job_nodes as u32).collect();
        match s.kind {
            Kind::Direct | Kind::SharedCache | Kind::P2p => {}
            Kind::P2pPrewarm => {
                let k = (s.prewarm_fraction * job_nodes as f64).round() as usize;
                let mut idx = job.clone();
                rng.shuffle(&mut idx);
                for &i in idx.iter().take(k) {
                    holds[i as usize] = vec![true; layers];
                }
            }
            Kind::Locality => {
                let k = (s.cached_fraction * n as f64).round() as usize;
                let mut all: Vec<u32> = (0..n as u32).collect();
                rng.shuffle(&mut all);
                for &i in all.iter().take(k) {
                    holds[i as usize] = vec![true; layers];
                }
                // Cached nodes first, then the others in rack order.
                let mut cached: Vec<u32> = all[..k].to_vec();
                cached.sort_unstable();
                let mut rest: Vec<u32> = all[k..].to_vec();
                rest.sort_unstable();
                job = cached.into_iter().chain(rest).take(job_nodes).collect();
            }
            Kind::CodeUpdate => {
                let changed = s.changed_layers.clone().unwrap_or_default();
                let row: Vec<bool> = sc
                    .image
                    .layers
                    .iter()
                    .map(|l| !changed.contains(&l.name))
                    .collect();
                for h in holds.iter_mut() {
                    h.clone_from(&row);
                }
            }
        }
        Self {
            transport: s.transport(),
            job,
            holds,
        }
    }
}
