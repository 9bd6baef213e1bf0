//! Which peer links a download task keeps for one blob. I/O-free and shared by the
//! agent (`p2p/download.rs`) and the simulator.
//!
//! Every link costs its holder a HAVE per piece (a holder tells every channel open on
//! the blob), so a swarm of `n` nodes with `k` links each and `p` pieces carries about
//! `p · n · k` HAVEs. Up to [`MAX_LINKS`] links are kept, and only stale links without
//! a channel are dropped beyond that. In swarms of more than [`LARGE_SWARM_MEMBERS`]
//! (the tracker's count), links to other racks are bounded too: at most
//! [`MAX_FAR_LINKS`] of them, a far link that gave nothing for [`IDLE_FAR_LINK_MS`]
//! with nothing in flight giving way. Rack stripes keep most pieces inside the rack, so
//! a node takes few pieces from afar and needs few far neighbours.

/// Links kept per blob: twice the tracker's handout, so peers handed out in earlier
/// announces stay connected while they are useful.
pub const MAX_LINKS: usize = 48;
pub use crate::scheduler::LARGE_SWARM_MEMBERS;
/// Far (other-rack) links kept per blob in a large swarm.
pub const MAX_FAR_LINKS: usize = 16;
/// A far link idle this long (no piece, nothing in flight) may be dropped.
pub const IDLE_FAR_LINK_MS: u64 = 6_000;

/// Which HAVEs a holder sends on one channel: those of pieces `p` with
/// `p % modulus == residue`, or all (`modulus` 0 or 1). A downloader in a rack-striped
/// swarm asks its far holders only for its stripe: it may take no other piece from
/// afar before the stripe's patience, and those HAVEs were 61 % of all HAVE deliveries
/// at 1,000 nodes with no effect on the pull (BENCHMARKS.md, issue 11, ninth session).
/// The bitfield at a channel's opening still carries every piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct HaveFilter {
    pub modulus: u32,
    pub residue: u32,
}

impl HaveFilter {
    pub const ALL: Self = Self {
        modulus: 0,
        residue: 0,
    };

    pub fn admits(&self, piece: u32) -> bool {
        self.admits_remembering(piece, &mut (0, 0))
    }

    /// [`HaveFilter::admits`] for one piece over many filters: `division` keeps the
    /// last modulus and the piece's remainder by it, so filters sharing a modulus (a
    /// rack's stripe count) cost one division, not one each.
    pub fn admits_remembering(&self, piece: u32, division: &mut (u32, u32)) -> bool {
        if self.modulus <= 1 {
            return true;
        }
        if division.0 != self.modulus {
            *division = (self.modulus, piece % self.modulus);
        }
        division.1 == self.residue
    }

    /// Whether every piece `other` admits, this one admits too. A holder whose channel
    /// gets a filter admitting pieces the old one did not sends its bitfield again, so
    /// the HAVEs it held back are not lost.
    pub fn covers(&self, other: &Self) -> bool {
        self.modulus <= 1
            || (other.modulus > 1
                && other.modulus.is_multiple_of(self.modulus)
                && other.residue % self.modulus == self.residue)
    }

    /// What a downloader asks of a holder at `distance` (0 same rack), given its rack
    /// stripe (`(index, members)`, from the tracker; only swarms of 64 or more members
    /// have one). The elected source too, when it is far: hearing of every fresh piece
    /// there started the patience clock of pieces this node may not take from afar, and
    /// it then asked the source for them (`scale-1000x15gb` 1.371/1.322/1.314 × T* with
    /// the source's HAVEs kept, 1.282/1.297/1.293 filtered). The hashes of the other
    /// pieces come from the tracker, as for a node not connected to the source (30 % more
    /// waits for a hash there).
    pub fn for_link(distance: u8, stripe: Option<(u32, u32)>) -> Self {
        match stripe {
            Some((index, members)) if distance > 0 && members > 1 => Self {
                modulus: members,
                residue: index % members,
            },
            _ => Self::ALL,
        }
    }
}

/// What the keep/drop decision needs to know of one link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkState<K> {
    pub key: K,
    /// 0 same rack, 1 same zone, 2 far.
    pub distance: u8,
    /// A channel is open, or being opened.
    pub live: bool,
    /// The latest tracker answer named it.
    pub fresh: bool,
    /// Requests in flight to it.
    pub inflight: u32,
    /// When it last gave a piece, or when it was handed out (ms).
    pub useful_ms: u64,
}

/// The links to drop (closing their channels if open), given every link the task has
/// after a tracker answer.
pub fn to_drop<K: Clone + Ord>(links: &[LinkState<K>], members: u32, now_ms: u64) -> Vec<K> {
    let mut out: Vec<K> = Vec::new();
    if members > LARGE_SWARM_MEMBERS {
        let mut far: Vec<&LinkState<K>> = links.iter().filter(|l| l.distance > 0).collect();
        if far.len() > MAX_FAR_LINKS {
            let idle = |l: &LinkState<K>| {
                l.inflight == 0 && now_ms.saturating_sub(l.useful_ms) >= IDLE_FAR_LINK_MS
            };
            // Busy or recently useful first, then the most recently useful; the tail
            // beyond the bound goes if it is idle.
            far.sort_by(|a, b| {
                idle(a)
                    .cmp(&idle(b))
                    .then(b.useful_ms.cmp(&a.useful_ms))
                    .then(a.key.cmp(&b.key))
            });
            out.extend(
                far[MAX_FAR_LINKS..]
                    .iter()
                    .filter(|l| idle(l) || !l.live)
                    .map(|l| l.key.clone()),
            );
        }
    }
    let left = links.len() - out.len();
    if left > MAX_LINKS {
        let mut stale: Vec<K> = links
            .iter()
            .filter(|l| !l.fresh && !l.live && !out.contains(&l.key))
            .map(|l| l.key.clone())
            .collect();
        stale.sort();
        stale.truncate(left - MAX_LINKS);
        out.extend(stale);
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(
        key: u32,
        distance: u8,
        live: bool,
        fresh: bool,
        inflight: u32,
        useful_ms: u64,
    ) -> LinkState<u32> {
        LinkState {
            key,
            distance,
            live,
            fresh,
            inflight,
            useful_ms,
        }
    }

    #[test]
    fn far_holders_send_only_the_stripe() {
        let stripe = Some((2, 5));
        let far = HaveFilter::for_link(2, stripe);
        assert_eq!(
            far,
            HaveFilter {
                modulus: 5,
                residue: 2
            }
        );
        let admitted: Vec<u32> = (0..16).filter(|&p| far.admits(p)).collect();
        assert_eq!(admitted, vec![2, 7, 12]);
        assert!(HaveFilter::ALL.covers(&far) && !far.covers(&HaveFilter::ALL));
        assert!(
            far.covers(&HaveFilter {
                modulus: 10,
                residue: 7
            }),
            "7, 17, … are 2 mod 5"
        );
        assert!(!far.covers(&HaveFilter {
            modulus: 10,
            residue: 3
        }));
        assert!(
            !far.covers(&HaveFilter {
                modulus: 4,
                residue: 2
            }),
            "6 is not 2 mod 5"
        );
        // `covers` agrees with the pieces admitted.
        for m in 0..7u32 {
            for r in 0..m.max(1) {
                let other = HaveFilter {
                    modulus: m,
                    residue: r,
                };
                for f in [
                    far,
                    HaveFilter::ALL,
                    HaveFilter {
                        modulus: 3,
                        residue: 1,
                    },
                ] {
                    let by_pieces = (0..420).all(|p| !other.admits(p) || f.admits(p));
                    assert_eq!(f.covers(&other), by_pieces, "{f:?} covers {other:?}");
                }
            }
        }
        for (what, f) in [
            ("near", HaveFilter::for_link(0, stripe)),
            ("no stripe", HaveFilter::for_link(2, None)),
            ("a stripe of one", HaveFilter::for_link(1, Some((0, 1)))),
        ] {
            assert_eq!(f, HaveFilter::ALL, "{what}");
            assert!((0..16).all(|p| f.admits(p)), "{what}");
        }
    }

    /// Many filters, one piece, moduli repeating and changing: the remembered
    /// division gives every filter its own answer.
    #[test]
    fn a_remembered_division_answers_as_each_filter_would() {
        let filters: Vec<HaveFilter> = [
            (5, 2),
            (5, 0),
            (0, 0),
            (7, 3),
            (5, 2),
            (1, 0),
            (7, 6),
            (32, 9),
        ]
        .into_iter()
        .map(|(modulus, residue)| HaveFilter { modulus, residue })
        .collect();
        for piece in 0..300 {
            let mut division = (0, 0);
            for f in &filters {
                let expected = f.modulus <= 1 || piece % f.modulus == f.residue;
                assert_eq!(
                    f.admits_remembering(piece, &mut division),
                    expected,
                    "{f:?} {piece}"
                );
            }
        }
    }

    #[test]
    fn beyond_the_cap_only_stale_links_without_a_channel_go() {
        let mut links: Vec<_> = (0..40).map(|k| link(k, 2, true, false, 0, 0)).collect();
        links.extend((40..60).map(|k| link(k, 2, false, k >= 50, 0, 0)));
        let drop = to_drop(&links, 100, 60_000);
        assert_eq!(
            drop,
            (40..50).collect::<Vec<_>>(),
            "stale, not connected, 12 over"
        );
        let few: Vec<_> = (0..48).map(|k| link(k, 2, true, false, 0, 0)).collect();
        assert!(to_drop(&few, 100, 60_000).is_empty());
    }

    #[test]
    fn large_swarms_keep_few_far_links_and_every_near_one() {
        let n = MAX_FAR_LINKS as u32;
        let mut links: Vec<_> = (0..30).map(|k| link(k, 0, true, false, 0, 0)).collect();
        // MAX_FAR_LINKS + 6 far links: 3 busy, MAX_FAR_LINKS - 3 useful lately, 6 idle.
        links.extend((100..103).map(|k| link(k, 2, true, false, 1, 0)));
        links.extend((103..100 + n).map(|k| link(k, 1, true, false, 0, 9_000)));
        links.extend((100 + n..106 + n).map(|k| link(k, 2, true, false, 0, 1_000)));
        let drop = to_drop(&links, 10_000, 10_000);
        assert_eq!(
            drop,
            (100 + n..106 + n).collect::<Vec<_>>(),
            "the idle far links"
        );
        assert!(
            to_drop(&links, LARGE_SWARM_MEMBERS, 10_000).is_empty(),
            "small swarm"
        );
        // A fresh far link from a handout takes an idle one's place, not a useful one's.
        links.push(link(500, 2, false, true, 0, 10_000));
        let drop = to_drop(&links, 10_000, 10_000);
        assert!(!drop.contains(&500) && drop.len() == 6, "{drop:?}");
        // Busy far links are kept even beyond the bound.
        let busy: Vec<_> = (0..2 * n).map(|k| link(k, 2, true, false, 1, 0)).collect();
        assert!(to_drop(&busy, 10_000, 10_000).is_empty());
    }
}
