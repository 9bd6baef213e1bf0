//! Piece geometry of a blob, the piece-size rule and registry runs; piece hashes are
//! in [`crate::chain`].

use serde::{Deserialize, Serialize};

pub use crate::chain::{PieceHash, PieceHasher};
use crate::Error;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// Bounds every agent and the tracker enforce on a swarm's geometry, whoever proposed
/// it: a piece is what a receiver may have to hold in flight, and the piece count sizes
/// bitfields, hash lists and the scheduler's tables.
pub const MIN_PIECE_SIZE: u64 = 64 * KIB;
pub const MAX_PIECE_SIZE: u64 = 256 * MIB;
pub const MAX_PIECES: u32 = 1 << 16;
/// Almost 16 TiB (one piece is the head's): far above any image layer or checkpoint
/// shard, far below overflow.
pub const MAX_BLOB_SIZE: u64 = MAX_PIECE_SIZE * (MAX_PIECES as u64 - 1);

/// How long one piece should take on the node's link. Pieces propagate
/// store-and-forward (a piece is verified before it is served onward), so each hop
/// adds one piece time to the tail and to a non-seed's first byte; per-piece costs
/// (a request frame, a hash finalisation, a HAVE to each connected peer) are a few
/// microseconds, so 25 ms keeps them below 1 % at any link speed. See BENCHMARKS.md
/// (issue 11, piece size) for the sweep this was chosen from.
pub const PIECE_TIME_MS: u64 = 25;

/// The link speed assumed when the agent knows none (no limits configured): 10 Gbit/s.
pub const ASSUMED_LINK_BYTES_PER_SEC: u64 = 1_250_000_000;

/// Smallest and largest piece the rule picks (the validated bounds are wider).
pub const RULE_MIN_PIECE: u64 = 256 * KIB;
pub const RULE_FLOOR_PIECE: u64 = MIB;
pub const RULE_MAX_PIECE: u64 = 64 * MIB;

/// A blob should have at least this many pieces so a swarm can trade them: with fewer,
/// nodes that start together wait on the few holders of the first pieces.
pub const RULE_MIN_PIECES: u64 = 32;

/// The piece size for a blob on a node whose link moves `link_bytes_per_sec`:
/// one piece per [`PIECE_TIME_MS`] on the link, a power of two between 1 and 64 MiB;
/// smaller (down to 256 KiB) so a small blob still has [`RULE_MIN_PIECES`] pieces;
/// larger so a huge one has at most [`MAX_PIECES`].
pub fn piece_size_for(blob_size: u64, link_bytes_per_sec: Option<u64>) -> u64 {
    let link = link_bytes_per_sec
        .filter(|&l| l > 0)
        .unwrap_or(ASSUMED_LINK_BYTES_PER_SEC);
    let target = link.saturating_mul(PIECE_TIME_MS) / 1000;
    let mut p = pow2_floor(target.clamp(RULE_FLOOR_PIECE, RULE_MAX_PIECE));
    while p > RULE_MIN_PIECE && blob_size.div_ceil(p) < RULE_MIN_PIECES {
        p /= 2;
    }
    while p < MAX_PIECE_SIZE && PieceLayout::piece_count(blob_size, p) > MAX_PIECES as u64 {
        p *= 2;
    }
    p
}

/// The piece size a swarm of `blob_size` is laid out in when its first member proposes
/// `proposed`: what the rule would pick for that blob on some link, from the slowest to
/// the fastest, or `operators` (the tracker's configured piece size) exactly.
///
/// Why: every member lays the blob out as the first proposal says, and nobody can check
/// a link speed. A member proposing 256 MiB pieces for a 1 GiB layer would leave the
/// swarm four pieces to trade (store-and-forward of a quarter of the blob per hop); one
/// proposing 64 KiB pieces for a 4 GiB layer would give every member 65,536 piece
/// frames, hashes and HAVEs to handle. An honest agent's proposal is the rule for its
/// own link, so it is never changed here.
pub fn admitted_piece_size(blob_size: u64, proposed: u64, operators: Option<u64>) -> u64 {
    if operators == Some(proposed) {
        return proposed;
    }
    let slowest_link = piece_size_for(blob_size, Some(1));
    let fastest_link = piece_size_for(blob_size, Some(u64::MAX));
    proposed.clamp(slowest_link, fastest_link)
}

/// Bytes per registry connection before a source opens another one for the same blob.
pub const REGISTRY_SLICE: u64 = 256 * MIB;

/// Registry connections a source may use for one blob (the agent's `registry_streams`).
pub const DEFAULT_REGISTRY_STREAMS: u32 = 4;

/// How many registry connections a source uses for `bytes` of one blob: one per
/// [`REGISTRY_SLICE`], at most `max`. Registries and CDNs cap each connection (the
/// `seed-100x5gb` scenario's registry: 4 of its 10 Gbit/s per connection), and the
/// slices are disjoint, so the registry still sends about one copy.
pub fn registry_streams_for(bytes: u64, max: u32) -> u32 {
    (bytes.div_ceil(REGISTRY_SLICE) as u32).clamp(1, max.max(1))
}

/// How long one registry run should last when a source reads over several connections.
/// A run's bytes reach the in-order reader (a runtime unpacking a layer, `starling get`
/// writing a file) and get their piece hashes (the blob's sha256 state at each piece's
/// end, `crate::chain`) only when the runs before it are on disk, so both trail the
/// fetch by about one run: the swarm receives the source's registry pieces in bursts
/// of `streams` runs. Each run costs one Range request's round trip. Half a second
/// chosen in the simulator (BENCHMARKS.md, issue 11, "chained piece hashes"): with 2 s
/// runs the bursts cost `scale-1000x15gb` 1.27 → 1.39 × T*; at 0.5 s it is 1.29–1.30,
/// on par with the unchained hashes. (Halves of the blob per connection left `starling
/// get` trailing by half the file: BENCHMARKS.md, issue 13, "registry runs".)
pub const REGISTRY_RUN_SECONDS: f64 = 0.5;
/// Shortest and longest run; the shortest before any rate is measured.
pub const REGISTRY_RUN_MIN: u64 = 16 * MIB;
pub const REGISTRY_RUN_MAX: u64 = REGISTRY_SLICE;

/// Bytes per registry run from the rate measured so far (`bytes` over `seconds`, shared
/// by `streams` connections): [`REGISTRY_RUN_SECONDS`] of one connection's share.
pub fn registry_run_bytes(bytes: u64, seconds: f64, streams: u32) -> u64 {
    if seconds <= 0.0 || bytes == 0 {
        return REGISTRY_RUN_MIN;
    }
    let per_stream = bytes as f64 / seconds / streams.max(1) as f64;
    let run = per_stream * REGISTRY_RUN_SECONDS;
    if run.is_finite() {
        (run as u64).clamp(REGISTRY_RUN_MIN, REGISTRY_RUN_MAX)
    } else {
        REGISTRY_RUN_MAX
    }
}

/// The registry runs to start for the open stretch `[a, b)` when `free` of the blob's
/// `streams` connections are idle: consecutive runs from `a`, so the connections fetch
/// neighbouring stretches near the front and the in-order prefix grows at their sum.
/// One connection reads the stretch in order in one run.
pub fn plan_registry_runs(
    layout: PieceLayout,
    a: u32,
    b: u32,
    free: u32,
    streams: u32,
    run_bytes: u64,
) -> Vec<(u32, u32)> {
    if a >= b || free == 0 {
        return Vec::new();
    }
    if streams <= 1 {
        return vec![(a, b)];
    }
    let by_rate = (run_bytes / layout.piece_size.max(1)).max(1);
    let per = by_rate.min((b - a).div_ceil(free) as u64).max(1) as u32;
    (0..free)
        .map(|i| {
            (
                a.saturating_add(i.saturating_mul(per)),
                a.saturating_add((i + 1).saturating_mul(per)).min(b),
            )
        })
        .filter(|(x, y)| x < y)
        .collect()
}

fn pow2_floor(x: u64) -> u64 {
    if x == 0 {
        1
    } else {
        1 << (63 - x.leading_zeros())
    }
}

/// Checks a geometry a peer or an announce proposes.
pub fn validate_geometry(blob_size: u64, piece_size: u64) -> Result<(), Error> {
    if !(MIN_PIECE_SIZE..=MAX_PIECE_SIZE).contains(&piece_size) || !piece_size.is_power_of_two() {
        return Err(Error::Geometry(format!(
            "piece size {piece_size} is not a power of two in [{MIN_PIECE_SIZE}, {MAX_PIECE_SIZE}]"
        )));
    }
    if blob_size > MAX_BLOB_SIZE {
        return Err(Error::Geometry(format!(
            "blob size {blob_size} exceeds {MAX_BLOB_SIZE}"
        )));
    }
    if PieceLayout::piece_count(blob_size, piece_size) > MAX_PIECES as u64 {
        return Err(Error::Geometry(format!(
            "{blob_size} bytes in pieces of {piece_size} is more than {MAX_PIECES} pieces"
        )));
    }
    Ok(())
}

/// With pieces of at most [`HEAD_MAX_PIECE`] (every size the rule picks), the first
/// piece of a blob is [`HEAD_DIVISOR`] times smaller than the others (at least
/// [`MIN_PIECE_SIZE`]); the second is the rest of the first full piece, and every later
/// piece starts on a multiple of the piece size.
///
/// Why: a blob's first byte on a node that does not fetch it from the registry waits
/// for piece 0 to exist at the source (its share of the registry) and then to reach the
/// node through peers, a piece time per hop, with every node that starts the blob at
/// once asking for the same piece. A head of 1/16 of a piece cuts those terms
/// sixteen-fold; the pieces after it keep the size the rule chose for throughput, and
/// in swarms of up to 16 members the head comes straight from the source to every
/// member (`scheduler`, source stripes), in the links' priority lane (the agent).
/// Measured (BENCHMARKS.md, issue 11, twelfth session):
/// - 2 MiB pieces (4 × 100 MiB/s, real agents): unsplit, the head went through a
///   member's source stripe and readers waited 0.37–1.01 s at the 95th percentile
///   (up to 3.8 s) for a first byte; split, 0.14–0.36 s, at the same throughput.
/// - 64 MiB pieces (the simulator): `seed-100x5gb` over ten seeds 1.276 → 1.271 × T*
///   (first byte p95 1.0–1.45 → 0.11 s); `scale-1000x15gb` seeds 0–2 1.282, 1.314,
///   1.282 → 1.276, 1.260, 1.282 (first byte p50 4.3 → 2.2 s, cross-rack 1.08–1.10 →
///   1.02–1.03 × racks × image); `scale-10000x15gb` seeds 0, 1: 1.462, 1.492 → 1.514,
///   1.486 (cross-rack 1.12–1.21 → 1.005). The eighth session had measured the split
///   at 64 MiB costing `seed-100x5gb` 1.270 → 1.296 with the scheduler of that day.
pub const HEAD_DIVISOR: u64 = 16;
pub const HEAD_MAX_PIECE: u64 = RULE_MAX_PIECE;
/// The largest blob [`PieceLayout::whole`] lays out as one piece: a power of two above
/// [`HEAD_MAX_PIECE`], so the piece is not split, within [`MAX_PIECE_SIZE`].
pub const WHOLE_PIECE_MAX: u64 = 2 * HEAD_MAX_PIECE;

/// Where pieces begin and end in a blob: a small head piece, then pieces of
/// `piece_size` aligned to it (see [`HEAD_DIVISOR`]). Both numbers travel (announce,
/// OPEN); everything else is derived from them here, by every agent, the tracker and
/// the simulator alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceLayout {
    pub blob_size: u64,
    pub piece_size: u64,
}

impl PieceLayout {
    /// A validated layout; see [`validate_geometry`].
    pub fn checked(blob_size: u64, piece_size: u64) -> Result<Self, Error> {
        validate_geometry(blob_size, piece_size)?;
        Ok(Self {
            blob_size,
            piece_size,
        })
    }

    /// A layout from trusted numbers (tests, the simulator); `piece_size` 0 becomes 1.
    pub fn new(blob_size: u64, piece_size: u64) -> Self {
        Self {
            blob_size,
            piece_size: piece_size.max(1),
        }
    }

    /// The blob as one piece, whose hash is the blob's digest: a small blob or a
    /// manifest taken whole from a holder, verified with no hash list. `None` above
    /// [`WHOLE_PIECE_MAX`].
    pub fn whole(blob_size: u64) -> Option<Self> {
        (blob_size <= WHOLE_PIECE_MAX).then_some(Self {
            blob_size,
            piece_size: WHOLE_PIECE_MAX,
        })
    }

    /// The head piece's size for pieces of `piece_size`; equal to it when the pieces
    /// are too small to split.
    pub fn head_size(piece_size: u64) -> u64 {
        if piece_size > HEAD_MAX_PIECE {
            return piece_size.max(1);
        }
        (piece_size / HEAD_DIVISOR)
            .max(MIN_PIECE_SIZE)
            .min(piece_size.max(1))
    }

    /// Pieces in `blob_size` bytes cut by `piece_size` (u64: a hostile geometry may not
    /// fit a u32).
    pub fn piece_count(blob_size: u64, piece_size: u64) -> u64 {
        let piece_size = piece_size.max(1);
        let full = blob_size.div_ceil(piece_size);
        if Self::splits(piece_size) && blob_size > Self::head_size(piece_size) {
            full + 1
        } else {
            full
        }
    }

    /// Whether pieces of `piece_size` begin with a smaller head piece.
    pub fn splits(piece_size: u64) -> bool {
        Self::head_size(piece_size) < piece_size
    }

    fn split(&self) -> bool {
        Self::splits(self.piece_size)
    }

    pub fn count(&self) -> u32 {
        Self::piece_count(self.blob_size, self.piece_size).min(u32::MAX as u64) as u32
    }

    /// Byte range `[start, end)` of piece `i`.
    pub fn range(&self, i: u32) -> (u64, u64) {
        let i = i as u64;
        let p = self.piece_size;
        let (start, end) = if !self.split() {
            let start = i.saturating_mul(p);
            (start, start.saturating_add(p))
        } else {
            let head = Self::head_size(p);
            match i {
                0 => (0, head),
                1 => (head, p),
                _ => ((i - 1).saturating_mul(p), i.saturating_mul(p)),
            }
        };
        (start.min(self.blob_size), end.min(self.blob_size))
    }

    pub fn len(&self, i: u32) -> u64 {
        let (a, b) = self.range(i);
        b - a
    }

    /// The length of piece `i` in a blob long enough to hold it whole: what a scheduler
    /// that knows only the piece size expects the piece to weigh.
    pub fn nominal_len(piece_size: u64, i: u32) -> u64 {
        Self::new(MAX_BLOB_SIZE, piece_size).len(i)
    }

    pub fn is_empty(&self) -> bool {
        self.blob_size == 0
    }

    /// Whether piece `i` is a head piece smaller than the pieces after it.
    pub fn is_small_head(&self, i: u32) -> bool {
        i == 0 && self.split() && self.count() > 1
    }

    /// The piece holding byte `offset`.
    pub fn piece_of(&self, offset: u64) -> u32 {
        let p = self.piece_size;
        let i = if !self.split() {
            offset / p
        } else if offset < Self::head_size(p) {
            0
        } else {
            offset / p + 1
        };
        i.min(u32::MAX as u64) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_runs_start_neighbouring_at_the_front() {
        let layout = PieceLayout::new(512 * MIB, MIB);
        // Two idle connections, 16 MiB runs: the first two 16-piece stretches.
        assert_eq!(
            plan_registry_runs(layout, 0, 512, 2, 2, 16 * MIB),
            vec![(0, 16), (16, 32)]
        );
        // One idle connection of two: the next stretch only.
        assert_eq!(
            plan_registry_runs(layout, 32, 512, 1, 2, 16 * MIB),
            vec![(32, 48)]
        );
        // A short stretch is shared, never overrun.
        assert_eq!(
            plan_registry_runs(layout, 500, 505, 2, 2, 16 * MIB),
            vec![(500, 503), (503, 505)]
        );
        // One connection reads the whole stretch in order.
        assert_eq!(
            plan_registry_runs(layout, 0, 512, 1, 1, 16 * MIB),
            vec![(0, 512)]
        );
        assert!(plan_registry_runs(layout, 7, 7, 2, 2, 16 * MIB).is_empty());
        assert!(plan_registry_runs(layout, 0, 512, 0, 2, 16 * MIB).is_empty());
    }

    #[test]
    fn registry_run_length_follows_the_measured_rate() {
        // Nothing measured yet: the shortest run.
        assert_eq!(registry_run_bytes(0, 0.0, 2), REGISTRY_RUN_MIN);
        // 100 MiB/s over 2 connections: half a second of 50 MiB/s.
        assert_eq!(registry_run_bytes(100 * MIB, 1.0, 2), 25 * MIB);
        // Slow and fast links stay within the bounds.
        assert_eq!(registry_run_bytes(MIB, 10.0, 4), REGISTRY_RUN_MIN);
        assert_eq!(registry_run_bytes(u64::MAX, 1e-9, 1), REGISTRY_RUN_MAX);
    }

    #[test]
    fn geometry() {
        // A head of 1 MiB / 16, the rest of the first full piece, then full pieces.
        let l = PieceLayout::new(2 * MIB + 5, MIB);
        assert_eq!(l.count(), 4);
        assert_eq!(l.range(0), (0, 64 * KIB));
        assert_eq!(l.range(1), (64 * KIB, MIB));
        assert_eq!(l.range(2), (MIB, 2 * MIB));
        assert_eq!(l.range(3), (2 * MIB, 2 * MIB + 5));
        assert_eq!(l.len(3), 5);
        assert_eq!(l.piece_of(0), 0);
        assert_eq!(l.piece_of(64 * KIB - 1), 0);
        assert_eq!(l.piece_of(64 * KIB), 1);
        assert_eq!(l.piece_of(MIB), 2);
        assert_eq!(
            l.range(7),
            (2 * MIB + 5, 2 * MIB + 5),
            "past the end: empty"
        );
        assert_eq!(PieceLayout::new(0, MIB).count(), 0);
        // Pieces above HEAD_MAX_PIECE are uniform.
        let big = PieceLayout::new(300 * MIB + 5, 128 * MIB);
        assert_eq!((big.count(), big.range(1)), (3, (128 * MIB, 256 * MIB)));
        assert_eq!(big.piece_of(128 * MIB), 1);
        // Pieces too small to split stay uniform; a blob inside the head is one piece.
        let small = PieceLayout::new(MIB, MIN_PIECE_SIZE);
        assert_eq!((small.count(), small.range(1)), (16, (64 * KIB, 128 * KIB)));
        assert_eq!(PieceLayout::new(60 * KIB, MIB).count(), 1);
        assert_eq!(PieceLayout::new(60 * KIB, MIB).range(0), (0, 60 * KIB));
        assert_eq!(PieceLayout::new(100 * KIB, MIB).count(), 2);
        assert_eq!(
            PieceLayout::new(100 * KIB, MIB).range(1),
            (64 * KIB, 100 * KIB)
        );
        // The smallest split: 128 KiB pieces, a 64 KiB head.
        assert_eq!(PieceLayout::head_size(128 * KIB), 64 * KIB);
        assert_eq!(PieceLayout::nominal_len(MIB, 0), 64 * KIB);
        assert_eq!(PieceLayout::nominal_len(MIB, 1), 960 * KIB);
        assert_eq!(PieceLayout::nominal_len(MIB, 9), MIB);
        // Every piece size the rule picks is split (64 MiB: a 4 MiB head); larger
        // pieces (a proposal beyond the rule) are not.
        assert_eq!(PieceLayout::head_size(HEAD_MAX_PIECE), HEAD_MAX_PIECE / 16);
        assert_eq!(PieceLayout::head_size(64 * MIB), 4 * MIB);
        assert_eq!(PieceLayout::head_size(128 * MIB), 128 * MIB);
        assert_eq!(PieceLayout::new(100 * MIB, 64 * MIB).count(), 3);
        assert_eq!(PieceLayout::new(100 * MIB, 128 * MIB).count(), 1);
        assert!(l.is_small_head(0) && !l.is_small_head(1));
        for size in [1, 677, 64 * KIB + 1, 4 * MIB, WHOLE_PIECE_MAX] {
            let whole = PieceLayout::whole(size).expect("small enough");
            assert!(validate_geometry(size, whole.piece_size).is_ok());
            assert_eq!((whole.count(), whole.range(0)), (1, (0, size)), "{size}");
        }
        assert_eq!(PieceLayout::whole(WHOLE_PIECE_MAX + 1), None);
        assert!(PieceLayout::new(100 * MIB, 64 * MIB).is_small_head(0));
        assert!(!PieceLayout::new(300 * MIB, 128 * MIB).is_small_head(0));
        assert!(
            !PieceLayout::new(60 * KIB, MIB).is_small_head(0),
            "the whole blob"
        );
    }

    proptest::proptest! {
        /// Pieces tile the blob in order with no gap, every piece but the last ends on
        /// a 64-byte block (piece hashes are sha256 states there), and `piece_of` finds
        /// the piece that holds each byte.
        #[test]
        fn pieces_tile_the_blob(size in 0u64..(64 * MIB), shift in 16u32..=24, probe in 0u64..(64 * MIB)) {
            let l = PieceLayout::new(size, 1 << shift);
            let mut at = 0;
            for i in 0..l.count() {
                let (a, b) = l.range(i);
                proptest::prop_assert_eq!(a, at);
                proptest::prop_assert!(b > a, "piece {} of {:?} is empty", i, l);
                proptest::prop_assert!(b == size || b % 64 == 0);
                proptest::prop_assert_eq!(l.piece_of(a), i);
                proptest::prop_assert_eq!(l.piece_of(b - 1), i);
                at = b;
            }
            proptest::prop_assert_eq!(at, size);
            if probe < size {
                let (a, b) = l.range(l.piece_of(probe));
                proptest::prop_assert!(a <= probe && probe < b);
            }
        }
    }

    #[test]
    fn the_rule_follows_the_link_and_the_blob() {
        let gib = 1024 * MIB;
        // The benchmark's slow settings keep the 1 MiB pieces they were tuned with.
        assert_eq!(piece_size_for(500 * MIB, Some(8 * MIB)), MIB);
        assert_eq!(piece_size_for(500 * MIB, Some(25 * MIB)), MIB);
        // 100 MiB/s: 2.5 MiB per 25 ms, rounded down.
        assert_eq!(piece_size_for(gib, Some(100 * MIB)), 2 * MIB);
        // 25 Gbit/s: capped at 64 MiB.
        assert_eq!(piece_size_for(15 * gib, Some(3_125_000_000)), 64 * MIB);
        // Unknown link: 10 Gbit/s assumed.
        assert_eq!(piece_size_for(1536 * MIB, None), 16 * MIB);
        // A small blob still has enough pieces to trade, down to 256 KiB.
        assert_eq!(piece_size_for(12 * MIB, Some(25 * MIB)), 256 * KIB);
        assert_eq!(piece_size_for(64 * MIB, None), 2 * MIB);
        // A huge one stays within the piece count.
        let p = piece_size_for(8 << 40, Some(8 * MIB));
        assert!((8u64 << 40).div_ceil(p) <= MAX_PIECES as u64);
        for (size, link) in [(1, None), (MAX_BLOB_SIZE, None), (5 * gib, Some(1))] {
            let p = piece_size_for(size, link);
            validate_geometry(size, p).expect("the rule's output is always valid");
        }
    }

    #[test]
    fn hostile_geometry_is_refused() {
        assert!(validate_geometry(MIB, 1 << 40).is_err(), "2^40 pieces");
        assert!(
            validate_geometry(MIB, 3 * MIB).is_err(),
            "not a power of two"
        );
        assert!(validate_geometry(MIB, 1024).is_err(), "too small");
        assert!(validate_geometry(u64::MAX, MAX_PIECE_SIZE).is_err());
        // With the head piece, MAX_PIECES - 1 full pieces is the most.
        assert!(validate_geometry(MAX_PIECES as u64 * MIB - MIB + 1, MIB).is_err());
        assert!(validate_geometry(MAX_PIECES as u64 * MIB - MIB, MIB).is_ok());
    }
}
