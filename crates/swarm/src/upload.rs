//! The holder's upload line: which queued piece request to serve next. I/O-free and
//! shared by the agent (one per agent, behind a lock) and the simulator.
//!
//! A holder serves at most `max_active` pieces at a time: few fast uploads beat many
//! slow ones, because a piece is worth something to the swarm only once it is whole
//! (it is verified, then announced and served onward), so splitting the uplink across
//! many pieces delays all of them. Requests beyond that wait in line instead of being
//! refused: on a persistent connection a queued request costs nothing, and the uplink
//! goes to the next piece without a round trip. Only a line past its bounds answers
//! "busy".
//!
//! Order: urgent requests (a reader waits on them) first; then the piece this holder
//! has sent the fewest times, so its uplink goes to pieces the swarm does not have yet
//! — when every downloader sees a fresh piece at the source at once and asks for it,
//! the source sends it once and then other fresh pieces, and the copies spread from
//! the first recipient (the downloaders move their requests there: `scheduler`);
//! then connections in turn, so one downloader with a deep window cannot starve the
//! others. Fewest-sent bows to fairness: a connection passed over two rounds of the
//! waiting connections ([`FRESHER_FIRST_ROUNDS`]) is served next, the longest-waiting
//! first.
//! Within one connection's line fewest-sent bows to age the same way: a request that
//! has watched [`REQUEST_PATIENCE`] others of its line served goes next when its line
//! is served. One connection carries every blob two nodes share, so without it a blob
//! whose pieces this holder had sent before waited for as long as another blob had
//! fresh ones, and the downloader could not tell that holder from one that had stopped
//! serving the blob (`SILENT_HOLDER_MS` in the agent).
//! A node that fell behind (its link went to a registry fetch, say) asks for pieces
//! every holder has sent many times, so under fewest-sent alone it lost to every fresh
//! request and received at a third of its link until the others finished (16 × 8 MiB/s,
//! BENCHMARKS.md, issue 11, "laggard").

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash, Hasher};

use crate::wire::ChannelId;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queued {
    pub chan: ChannelId,
    /// The blob, as the holder numbers them (for counting what it has sent).
    pub blob: u64,
    pub piece: u32,
    pub urgent: bool,
    /// The blob's head piece, smaller than the others (`PieceLayout::is_small_head`):
    /// urgent, it may take the slot beyond `max_active`.
    pub small_head: bool,
}

impl Queued {
    /// A reader waits on it and it is the blob's small head piece: it may take a slot
    /// beyond `max_active` ([`URGENT_EXTRA_SLOTS`]), and the agent sends it in the
    /// uplink's priority lane.
    pub fn is_reader_head(&self) -> bool {
        self.urgent && self.small_head
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    Queued,
    /// The line is full: the requester should ask someone else.
    Busy,
}

/// Pieces a holder sends at once (the agent's `max_uploads`).
pub const DEFAULT_MAX_ACTIVE: usize = 4;
/// Slots beyond `max_active` that only an urgent request for a blob's small head piece (a
/// reader waits on its first byte) may take: with every slot busy on whole pieces, it
/// waited for one of them to finish, up to a piece time at the slot's share of the
/// uplink (≈ 160 ms at 25 MiB/s and four slots). The head piece is 1/16 of a piece
/// (`pieces::HEAD_DIVISOR`), so the slot takes little from the others; open to every
/// urgent request it cost `seed-100x5gb` ≈ 1 % (BENCHMARKS.md, issue 11, "head piece").
pub const URGENT_EXTRA_SLOTS: usize = 1;
/// Requests one connection may have waiting in a holder's line (the agent's
/// `upload_queue`): above any downloader's window, so only a misbehaving peer hits it.
pub const DEFAULT_QUEUE_PER_CONN: usize = 64;
/// Times a connection with requests waiting may be passed over for fresher pieces
/// before it is served regardless: at least this many, and at least
/// [`FRESHER_FIRST_ROUNDS`] turns of every waiting connection (one round made the
/// simulated 16 × 8 MiB/s swarm 1.45 × T* on one seed, two were as good as none).
pub const FRESHER_FIRST_SKIPS: u32 = 4;
pub const FRESHER_FIRST_ROUNDS: u32 = 2;
/// Requests of the same connection a waiting request may see served before it goes
/// next in its line: above a downloader's usual window at a holder, so fresh pieces
/// still go first among the requests one download has waiting.
pub const REQUEST_PATIENCE: u64 = 32;
/// Requests a holder keeps waiting over all connections.
pub const DEFAULT_QUEUE_TOTAL: usize = 4096;
/// Piece requests an agent keeps in flight over all blobs, read heads aside (the
/// agent's `max_piece_requests`): enough to fill a download link while some wait in
/// busy holders' lines, few enough that each piece arrives soon. At 16 × 8 MiB/s,
/// where every uplink must stay ~94 % busy (each byte leaves the registry once), 16
/// left some uplinks idle while requests waited at the holders of the freshest pieces
/// (the least busy uplink 14–84 % over T*, ≤ 1.15 × T* in six of thirteen runs); 32
/// kept it at 53–83 % (1.09–1.14 in eight of eight). At 4 × 100 MiB/s 32 costs ≈ 4 %
/// (BENCHMARKS.md, issue 11, sixth session). A download in a swarm of 64 or more
/// members uses only part of it (`SchedulerConfig::large_swarm_withheld_requests`).
pub const DEFAULT_REQUEST_BUDGET: u32 = 32;

#[derive(Clone, Debug)]
pub struct UploadConfig {
    pub max_active: usize,
    /// Requests one connection may have waiting (above any downloader's window).
    pub max_queued_per_conn: usize,
    pub max_queued_total: usize,
    /// Slots beyond `max_active` for urgent head-piece requests ([`URGENT_EXTRA_SLOTS`]).
    pub urgent_extra: usize,
}

impl Default for UploadConfig {
    fn default() -> Self {
        Self {
            max_active: DEFAULT_MAX_ACTIVE,
            max_queued_per_conn: DEFAULT_QUEUE_PER_CONN,
            max_queued_total: DEFAULT_QUEUE_TOTAL,
            urgent_extra: URGENT_EXTRA_SLOTS,
        }
    }
}

#[derive(Debug)]
pub struct UploadQueue<C> {
    cfg: UploadConfig,
    active: usize,
    queued: usize,
    /// Waiting requests that may take an urgent extra slot (urgent, for a small head
    /// piece): with every ordinary slot busy, `next_to_send` — called for every
    /// request that arrives — has nothing to look for when there are none.
    urgent_heads: usize,
    lines: HashMap<C, Line, BuildHasherDefault<LocalKeyHasher>>,
    /// Connections with something waiting, in serving order, each with the times it
    /// was passed over since it was last served (kept here, not in a map by
    /// connection: `next_to_send` reads every waiting connection's count and adds to it).
    turn: VecDeque<(C, u32)>,
    /// Times each (blob, piece) was sent.
    sent: HashMap<(u64, u32), u32, BuildHasherDefault<LocalKeyHasher>>,
}

/// One connection's waiting requests, oldest first, each with the count of this
/// line's requests served before it arrived.
#[derive(Debug, Default)]
struct Line {
    served: u64,
    waiting: VecDeque<(Queued, u64)>,
}

impl Line {
    /// Requests of this line served while the oldest waiting one waited.
    fn oldest_passed_over(&self) -> u64 {
        self.waiting
            .front()
            .map_or(0, |&(_, arrived)| self.served - arrived)
    }
}

/// A multiply-and-fold hasher for the line's keys: `(blob, piece)` and connections.
/// `next_to_send` looks up every waiting connection's line and requests' counts on
/// every call (SipHash was most of its time in the simulator's 10,000-node run). Not
/// keyed: the keys are numbers this holder assigned (its connections, its blobs) and
/// pieces it holds (it queues no request for a piece it lacks), so a peer cannot
/// choose colliding ones.
#[derive(Default)]
struct LocalKeyHasher(u64);

impl Hasher for LocalKeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }

    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }

    fn write_u64(&mut self, v: u64) {
        // (FxHash's step, then a fold so the high bits reach the bucket index.)
        let m = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
        self.0 = m ^ (m >> 29);
    }
}

/// A waiting request's place in the serving order (see [`UploadQueue::next_to_send`]).
type LineKey = (bool, bool, i64, u32, usize, usize);

/// Sent counts remembered (then forgotten all at once): bounds the holder's memory.
const MAX_SENT_ENTRIES: usize = 1 << 20;

impl<C: Copy + Eq + Hash> UploadQueue<C> {
    pub fn new(cfg: UploadConfig) -> Self {
        Self {
            cfg,
            active: 0,
            queued: 0,
            urgent_heads: 0,
            lines: HashMap::default(),
            turn: VecDeque::new(),
            sent: HashMap::default(),
        }
    }

    /// Times this holder has sent a piece.
    pub fn sent_count(&self, blob: u64, piece: u32) -> u32 {
        self.sent.get(&(blob, piece)).copied().unwrap_or(0)
    }

    pub fn active(&self) -> usize {
        self.active
    }

    pub fn queued(&self) -> usize {
        self.queued
    }

    pub fn push(&mut self, conn: C, q: Queued) -> Admit {
        let line = self.lines.entry(conn).or_default();
        if line.waiting.len() >= self.cfg.max_queued_per_conn
            || self.queued >= self.cfg.max_queued_total
        {
            return Admit::Busy;
        }
        if line.waiting.is_empty() {
            self.turn.push_back((conn, 0));
        }
        line.waiting.push_back((q, line.served));
        self.queued += 1;
        self.urgent_heads += q.is_reader_head() as usize;
        Admit::Queued
    }

    /// The next request to serve, if a slot is free (see the module's order). The
    /// slot is taken; give it back with [`UploadQueue::done`].
    pub fn next_to_send(&mut self) -> Option<(C, Queued)> {
        let max_active = self.cfg.max_active.max(1);
        if self.active >= max_active + self.cfg.urgent_extra || self.queued == 0 {
            return None;
        }
        let only_urgent = self.active >= max_active;
        debug_assert_eq!(
            self.urgent_heads,
            self.lines
                .values()
                .flat_map(|l| &l.waiting)
                .filter(|(q, _)| q.is_reader_head())
                .count(),
            "the count of waiting urgent head requests"
        );
        if only_urgent && self.urgent_heads == 0 {
            return None;
        }
        let patience =
            FRESHER_FIRST_SKIPS.max((self.turn.len() as u32).saturating_mul(FRESHER_FIRST_ROUNDS));
        // (urgent first; passed over too often first, the longest-waiting of those
        // first; fewest sent, within a starved line too; connection's place in turn;
        // place in its line)
        let mut best: Option<(LineKey, C)> = None;
        for (t, &(conn, skipped)) in self.turn.iter().enumerate() {
            let Some(line) = self.lines.get(&conn) else {
                continue;
            };
            let starved = skipped >= patience;
            let wait_rank = if starved { -(skipped as i64) } else { 0 };
            for (k, (q, _)) in line.waiting.iter().enumerate() {
                if only_urgent && !q.is_reader_head() {
                    continue;
                }
                let head = (!q.urgent, !starved, wait_rank);
                // Later requests come later in (turn, place): with the best's head ahead,
                // or level and its piece never sent, this one cannot pass it, and its
                // sent count (a lookup per waiting request) is not needed.
                if let Some(((urgent, starved, wait, sent, _, _), _)) = best {
                    let best_head = (urgent, starved, wait);
                    if head > best_head || (head == best_head && sent == 0) {
                        continue;
                    }
                }
                let key = (
                    head.0,
                    head.1,
                    head.2,
                    self.sent_count(q.blob, q.piece),
                    t,
                    k,
                );
                if best.is_none_or(|(b, _)| key < b) {
                    best = Some((key, conn));
                }
            }
        }
        let ((not_urgent, _, _, _, t, mut k), conn) = best?;
        let line = self.lines.get_mut(&conn)?;
        // The line is served: by its oldest request if that one has waited long enough
        // (unless a reader waits on the one chosen).
        if not_urgent && line.oldest_passed_over() >= REQUEST_PATIENCE {
            k = 0;
        }
        let (q, _) = line.waiting.remove(k)?;
        line.served += 1;
        self.turn.remove(t);
        let still_waiting = !line.waiting.is_empty();
        if still_waiting {
            self.turn.push_back((conn, 0));
        }
        for (other, skipped) in &mut self.turn {
            if *other != conn {
                *skipped += 1;
            }
        }
        self.queued -= 1;
        self.urgent_heads -= q.is_reader_head() as usize;
        self.active += 1;
        if self.sent.len() >= MAX_SENT_ENTRIES {
            self.sent.clear();
        }
        *self.sent.entry((q.blob, q.piece)).or_insert(0) += 1;
        Some((conn, q))
    }

    pub fn done(&mut self) {
        self.active = self.active.saturating_sub(1);
    }

    /// Removes a waiting request; `false` if it is not waiting (being served, or gone).
    pub fn cancel(&mut self, conn: C, chan: ChannelId, piece: u32) -> bool {
        let Some(line) = self.lines.get_mut(&conn) else {
            return false;
        };
        let Some(at) = line
            .waiting
            .iter()
            .position(|(q, _)| q.chan == chan && q.piece == piece)
        else {
            return false;
        };
        let q = line.waiting.remove(at);
        self.queued -= 1;
        self.urgent_heads -= q.is_some_and(|(q, _)| q.is_reader_head()) as usize;
        if line.waiting.is_empty() {
            self.turn.retain(|&(c, _)| c != conn);
        }
        true
    }

    /// Drops everything a connection (or one of its channels) has waiting.
    pub fn drop_waiting(&mut self, conn: C, chan: Option<ChannelId>) {
        if let Some(line) = self.lines.get_mut(&conn) {
            let before = line.waiting.len();
            let mut urgent_heads = 0;
            line.waiting.retain(|(q, _)| {
                let keep = chan.is_some_and(|c| q.chan != c);
                urgent_heads += (!keep && q.is_reader_head()) as usize;
                keep
            });
            self.queued -= before - line.waiting.len();
            self.urgent_heads -= urgent_heads;
            if line.waiting.is_empty() {
                self.lines.remove(&conn);
                self.turn.retain(|&(c, _)| c != conn);
            }
        }
    }
}

/// An agent-wide cap on piece requests in flight, shared by every blob's scheduler:
/// a receiver's link split over many concurrent pieces makes each arrive later, and a
/// piece is useful to the swarm only once whole.
#[derive(Debug)]
pub struct RequestBudget {
    limit: u32,
    used: std::sync::atomic::AtomicU32,
}

impl RequestBudget {
    pub fn new(limit: u32) -> Self {
        Self {
            limit: limit.max(1),
            used: std::sync::atomic::AtomicU32::new(0),
        }
    }

    pub fn available(&self) -> u32 {
        self.limit
            .saturating_sub(self.used.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Takes `n` (the caller learned they were available; a race may overshoot by a
    /// few, which costs nothing but a slightly longer line).
    pub fn take(&self, n: u32) {
        self.used.fetch_add(n, std::sync::atomic::Ordering::AcqRel);
    }

    pub fn give_back(&self, n: u32) {
        let _ = self.used.fetch_update(
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
            |u| Some(u.saturating_sub(n)),
        );
    }

    pub fn used(&self) -> u32 {
        self.used.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }
}

/// Pieces a holder may send a downloader on their connection while one of its
/// requests waits before the holder counts as starving that request's blob. An honest
/// line serves a waiting request after at most [`REQUEST_PATIENCE`] others of its
/// connection, and the requests ahead of it are the downloader's own (at most its
/// `request_budget`, read heads aside); four times that leaves room for read heads and
/// pieces already on the wire. Counting pieces rather than time catches a holder that
/// serves every blob but one within seconds on a fast link, where a time limit long
/// enough for a slow one would cost minutes.
pub fn starving_after_pieces(request_budget: u32) -> u64 {
    4 * (REQUEST_PATIENCE + u64::from(request_budget))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(piece: u32, urgent: bool) -> Queued {
        Queued {
            chan: 1,
            blob: 7,
            piece,
            urgent,
            small_head: piece == 0,
        }
    }

    #[test]
    fn round_robin_with_urgent_first_and_bounded_slots() {
        let mut u = UploadQueue::new(UploadConfig {
            max_active: 2,
            max_queued_per_conn: 3,
            max_queued_total: 100,
            urgent_extra: 0,
        });
        for p in 0..3 {
            assert_eq!(u.push('a', q(p, false)), Admit::Queued);
        }
        assert_eq!(u.push('a', q(9, false)), Admit::Busy, "a's line is full");
        u.push('b', q(10, false));
        u.push('c', q(20, false));
        u.push('c', q(21, true));
        let (c1, first) = u.next_to_send().unwrap();
        assert_eq!((c1, first.piece), ('c', 21), "urgent first");
        let (c2, second) = u.next_to_send().unwrap();
        assert_eq!((c2, second.piece), ('a', 0));
        assert!(u.next_to_send().is_none(), "two slots busy");
        u.done();
        assert_eq!(u.next_to_send().map(|(c, x)| (c, x.piece)), Some(('b', 10)));
        u.done();
        assert_eq!(u.next_to_send().map(|(c, x)| (c, x.piece)), Some(('c', 20)));
        u.done();
        assert_eq!(u.next_to_send().map(|(c, x)| (c, x.piece)), Some(('a', 1)));
        assert!(u.cancel('a', 1, 2));
        assert!(!u.cancel('a', 1, 2));
        u.done();
        u.done();
        assert!(u.next_to_send().is_none());
        assert_eq!(u.queued(), 0);
    }

    #[test]
    fn a_read_head_does_not_wait_for_a_busy_slot() {
        let mut u = UploadQueue::new(UploadConfig {
            max_active: 2,
            ..UploadConfig::default()
        });
        for p in 0..4 {
            u.push('a', q(p, false));
        }
        assert!(u.next_to_send().is_some() && u.next_to_send().is_some());
        assert!(
            u.next_to_send().is_none(),
            "both slots busy on whole pieces"
        );
        u.push('b', q(0, true));
        u.push('c', q(0, true));
        assert_eq!(
            u.next_to_send().map(|(c, x)| (c, x.piece, x.urgent)),
            Some(('b', 0, true)),
            "a read head takes the extra slot"
        );
        assert!(
            u.next_to_send().is_none(),
            "one extra slot: the second read head waits"
        );
        u.done();
        assert_eq!(
            u.next_to_send().map(|(c, x)| (c, x.urgent)),
            Some(('c', true)),
            "a freed slot goes to the waiting read head"
        );
        u.done();
        u.done();
        assert_eq!(
            u.next_to_send().map(|(c, x)| (c, x.piece)),
            Some(('a', 2)),
            "ordinary requests only within max_active"
        );
        assert!(u.next_to_send().is_none());
    }

    #[test]
    fn dropping_a_connection_or_channel_forgets_its_line() {
        let mut u = UploadQueue::new(UploadConfig::default());
        u.push(
            1u32,
            Queued {
                chan: 1,
                blob: 1,
                piece: 0,
                urgent: false,
                small_head: false,
            },
        );
        u.push(
            1u32,
            Queued {
                chan: 2,
                blob: 2,
                piece: 0,
                urgent: false,
                small_head: false,
            },
        );
        u.push(
            2u32,
            Queued {
                chan: 1,
                blob: 1,
                piece: 5,
                urgent: false,
                small_head: false,
            },
        );
        u.drop_waiting(1, Some(1));
        assert_eq!(u.queued(), 2);
        u.drop_waiting(1, None);
        assert_eq!(u.queued(), 1);
        assert_eq!(u.next_to_send().map(|(c, x)| (c, x.piece)), Some((2, 5)));
    }

    #[test]
    fn pieces_sent_fewest_times_go_first() {
        let mut u = UploadQueue::new(UploadConfig {
            max_active: 1,
            ..UploadConfig::default()
        });
        // Everyone asks for the fresh piece 9 at once, and two ask for piece 3.
        for c in ['a', 'b', 'c'] {
            u.push(c, q(9, false));
        }
        u.push('d', q(3, false));
        let order: Vec<u32> = (0..4)
            .map(|_| {
                let (_, x) = u.next_to_send().unwrap();
                u.done();
                x.piece
            })
            .collect();
        assert_eq!(
            order,
            vec![9, 3, 9, 9],
            "a fresh piece before a second copy"
        );
        assert_eq!(u.sent_count(7, 9), 3);
    }

    #[test]
    fn a_requester_of_old_pieces_is_not_starved_by_fresh_ones() {
        let mut u = UploadQueue::new(UploadConfig {
            max_active: 1,
            ..UploadConfig::default()
        });
        // Piece 0 went out many times already; a laggard now asks for it while the
        // others keep asking for pieces this holder has never sent.
        for _ in 0..10 {
            u.push('z', q(0, false));
            u.next_to_send();
            u.done();
        }
        u.push('l', q(0, false));
        let mut fresh = 100;
        let mut served_before_laggard = 0;
        loop {
            for c in ['a', 'b', 'c'] {
                u.push(c, q(fresh, false));
                fresh += 1;
            }
            let (c, _) = u.next_to_send().unwrap();
            u.done();
            if c == 'l' {
                break;
            }
            served_before_laggard += 1;
            // Four connections wait (a, b, c and the laggard): two rounds of them.
            assert!(served_before_laggard <= 8, "the laggard waits forever");
        }
        assert_eq!(served_before_laggard, 8, "fresh pieces first until then");
    }

    #[test]
    fn a_blob_sent_before_is_not_starved_on_a_connection_that_carries_fresh_ones() {
        let mut u = UploadQueue::new(UploadConfig {
            max_active: 1,
            ..UploadConfig::default()
        });
        let piece_of = |blob: u64, piece: u32| Queued {
            chan: blob as ChannelId,
            blob,
            piece,
            urgent: false,
            small_head: false,
        };
        // Blob 2's piece 5 went out many times; one connection now asks for it while
        // the same connection keeps asking for blob 1's pieces never sent before.
        for _ in 0..10 {
            u.push('z', piece_of(2, 5));
            u.next_to_send();
            u.done();
        }
        u.push('a', piece_of(2, 5));
        let mut fresh = 0;
        let mut served_before = 0u64;
        loop {
            u.push('a', piece_of(1, fresh));
            fresh += 1;
            let (c, x) = u.next_to_send().unwrap();
            u.done();
            assert_eq!(c, 'a');
            if x.blob == 2 {
                break;
            }
            served_before += 1;
            assert!(
                served_before <= REQUEST_PATIENCE,
                "blob 2 waits for as long as blob 1 has fresh pieces"
            );
        }
        assert_eq!(
            served_before, REQUEST_PATIENCE,
            "fresh pieces first until then"
        );
        // A reader's head still goes before a request that has waited.
        u.push('a', piece_of(2, 5));
        for _ in 0..REQUEST_PATIENCE {
            u.push('a', piece_of(1, fresh));
            fresh += 1;
            u.next_to_send();
            u.done();
        }
        u.push('a', q(0, true));
        assert_eq!(
            u.next_to_send().map(|(_, x)| (x.blob, x.piece)),
            Some((7, 0)),
            "the urgent head first"
        );
        u.done();
        assert_eq!(
            u.next_to_send().map(|(_, x)| (x.blob, x.piece)),
            Some((2, 5)),
            "then the request that waited"
        );
    }

    #[test]
    fn the_budget_never_goes_negative() {
        let b = RequestBudget::new(4);
        b.take(3);
        assert_eq!(b.available(), 1);
        b.give_back(5);
        assert_eq!(b.available(), 4);
    }
}
