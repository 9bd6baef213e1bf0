//! The scheduler's unit tests, split along the same lines as its code; here the
//! helpers they share.

use super::*;

mod holders;
mod outcomes;
mod picking;
mod stripes;

const MB: u64 = 1 << 20;

fn bits(len: u32, ones: &[u32]) -> Bitfield {
    let mut b = Bitfield::new(len);
    for &i in ones {
        b.set(i);
    }
    b
}

fn sched(len: u32, cfg: SchedulerConfig) -> PieceScheduler {
    PieceScheduler::new(Bitfield::new(len), MB, cfg)
}

fn with_rate(s: &mut PieceScheduler, peer: &str, rate: f64) {
    let i = s.by_name[peer] as usize;
    let (cfg, piece_size) = (s.cfg.clone(), s.piece_size);
    s.slots[i]
        .as_mut()
        .unwrap()
        .set_rate(rate, &cfg, piece_size);
}
