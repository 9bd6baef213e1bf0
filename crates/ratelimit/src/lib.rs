//! Rate limiting. Bytes: a token bucket shared by every stream it limits (an origin's
//! total egress, an agent's upload or download link, a prewarm assignment's rate).
//! Requests: [`KeyedAdmission`], a refusing bucket per client (joins at the tracker).
//! Its own crate so the agent and the demo registry share it without depending on
//! each other.
//!
//! Why not `governor`: it counts cells (requests) against a quota and refuses or
//! delays a request that exceeds the burst, while streams here reserve chunks of up
//! to 1 MiB that may exceed the burst and must still go through, paying it back as
//! debt; emulating that with `governor` means splitting every chunk into burst-sized
//! cells and one `until_n_ready` call each.
//!
//! Model: tokens are bytes; they refill continuously at `rate` bytes/s up to `burst`.
//! [`TokenBucket::acquire`] takes `n` tokens at once and may drive the bucket into debt;
//! the caller then sleeps until the debt it created is repaid. Because each stream
//! holds at most one reservation at a time (it sends its chunk, then asks again),
//! concurrent streams interleave their reservations and share the rate evenly, and a
//! reservation larger than the burst still completes (it just waits longer). Sleeping is
//! done with `tokio::time`, whose granularity is 1 ms; with 256 KiB chunks at 32 MiB/s a
//! chunk is paced every ~8 ms, in line with a ~10 ms refill granularity.
//!
//! The accounting itself ([`TokenBucket::reserve_at`]) is a pure function of a caller
//! supplied clock so it can be tested exactly, without wall-clock assertions.

#![forbid(unsafe_code)]

mod admission;

pub use admission::KeyedAdmission;

use std::sync::Mutex;
use std::time::Duration;

const NANOS: u128 = 1_000_000_000;

/// Default burst: 1/20 of a second's worth, at least 256 KiB (one read chunk).
pub fn default_burst(rate: u64) -> u64 {
    (rate / 20).max(256 * 1024)
}

#[derive(Debug)]
pub struct TokenBucket {
    rate: u64,
    burst: u64,
    origin: tokio::time::Instant,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Available tokens scaled by 1e9 (byte·ns/s), so refills are exact integers.
    /// Negative means debt. Every reservation takes from it.
    scaled: i128,
    /// The same, as seen by high-priority reservations: only they take from it, so
    /// they never wait behind low-priority debt (low-priority ones do wait behind
    /// theirs, through `scaled`).
    scaled_high: i128,
    /// Clock reading of the last update.
    last: Duration,
}

impl TokenBucket {
    /// A bucket of `rate` bytes/s with the [`default_burst`], starting full.
    pub fn new(rate: u64) -> Self {
        Self::with_burst(rate, default_burst(rate))
    }

    pub fn with_burst(rate: u64, burst: u64) -> Self {
        let rate = rate.max(1);
        let burst = burst.max(1);
        Self {
            rate,
            burst,
            origin: tokio::time::Instant::now(),
            state: Mutex::new(State {
                scaled: burst as i128 * NANOS as i128,
                scaled_high: burst as i128 * NANOS as i128,
                last: Duration::ZERO,
            }),
        }
    }

    pub fn rate(&self) -> u64 {
        self.rate
    }

    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Takes `n` tokens at clock reading `now` (time since the bucket's creation, or any
    /// monotonic clock the caller uses consistently) and returns how long the caller must
    /// wait before sending those `n` bytes. A clock reading earlier than the last one is
    /// treated as no time passing.
    pub fn reserve_at(&self, n: u64, now: Duration) -> Duration {
        self.reserve(n, now, false)
    }

    /// [`TokenBucket::reserve_at`] for a high-priority stream: it waits only behind
    /// other high-priority reservations, and every low-priority one waits behind it.
    /// The long-run rate is still the bucket's; in the short run the total may exceed
    /// it by the low-priority reservations already granted (a few chunks).
    pub fn reserve_high_at(&self, n: u64, now: Duration) -> Duration {
        self.reserve(n, now, true)
    }

    fn reserve(&self, n: u64, now: Duration, high: bool) -> Duration {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if now > st.last {
            let elapsed = (now - st.last).as_nanos();
            let cap = self.burst as i128 * NANOS as i128;
            let refill =
                (elapsed.saturating_mul(self.rate as u128)).min(i128::MAX as u128 / 2) as i128;
            st.scaled = st.scaled.saturating_add(refill).min(cap);
            st.scaled_high = st.scaled_high.saturating_add(refill).min(cap);
            st.last = now;
        }
        let cost = n as i128 * NANOS as i128;
        st.scaled -= cost;
        let left = if high {
            st.scaled_high -= cost;
            st.scaled_high
        } else {
            st.scaled
        };
        if left >= 0 {
            Duration::ZERO
        } else {
            // ceil(debt / rate) nanoseconds.
            let debt = (-left) as u128;
            let ns = debt.div_ceil(self.rate as u128);
            Duration::from_nanos(ns.min(u64::MAX as u128) as u64)
        }
    }

    /// Waits until `n` bytes may be sent (tokio time, so paused-clock tests work).
    pub async fn acquire(&self, n: u64) {
        let now = tokio::time::Instant::now();
        let wait = self.reserve_at(n, now.saturating_duration_since(self.origin));
        if !wait.is_zero() {
            tokio::time::sleep_until(now + wait).await;
        }
    }

    /// [`TokenBucket::acquire`] with priority: used for bytes that are new to the
    /// whole swarm (a source's registry stream), which every other node waits for.
    pub async fn acquire_high(&self, n: u64) {
        let now = tokio::time::Instant::now();
        let wait = self.reserve_high_at(n, now.saturating_duration_since(self.origin));
        if !wait.is_zero() {
            tokio::time::sleep_until(now + wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;
    const CHUNK: u64 = 256 * 1024;

    /// Streams that each send `per_stream` bytes in CHUNK pieces, each asking for its next
    /// chunk as soon as the previous one was released. Returns (virtual finish time of all,
    /// largest spread in granted bytes between streams observed at any event).
    fn simulate(
        bucket: &TokenBucket,
        streams: usize,
        per_stream: u64,
    ) -> (Duration, u64, Vec<Duration>) {
        let mut ready = vec![Duration::ZERO; streams];
        let mut granted = vec![0u64; streams];
        let mut finish = vec![Duration::ZERO; streams];
        let mut spread = 0u64;
        while let Some(i) = next_stream(&ready, &granted, per_stream) {
            let n = CHUNK.min(per_stream - granted[i]);
            let wait = bucket.reserve_at(n, ready[i]);
            ready[i] += wait;
            granted[i] += n;
            finish[i] = ready[i];
            let (mx, mn) = (
                granted.iter().max().copied().unwrap_or(0),
                granted.iter().min().copied().unwrap_or(0),
            );
            if granted.iter().all(|&g| g < per_stream) {
                spread = spread.max(mx - mn);
            }
        }
        let end = finish.iter().max().copied().unwrap_or_default();
        (end, spread, finish)
    }

    /// The unfinished stream whose next request comes first; requests at the same instant
    /// are taken in arrival order, i.e. the stream served least goes first (as tokio wakes
    /// tasks that all became ready at once).
    fn next_stream(ready: &[Duration], granted: &[u64], per_stream: u64) -> Option<usize> {
        (0..ready.len())
            .filter(|&i| granted[i] < per_stream)
            .min_by_key(|&i| (ready[i], granted[i], i))
    }

    #[test]
    fn single_transfer_64mib_at_32mibps_takes_about_2s() {
        let b = TokenBucket::new(32 * MIB);
        assert_eq!(b.burst(), 32 * MIB / 20);
        let (end, _, _) = simulate(&b, 1, 64 * MIB);
        // The last byte is released once (64 MiB - burst) have been refilled.
        let expect = Duration::from_secs_f64((64 * MIB - b.burst()) as f64 / (32 * MIB) as f64);
        let diff = end.as_secs_f64() - expect.as_secs_f64();
        assert!(diff.abs() < 1e-6, "end {end:?} expected {expect:?}");
        assert!(end > Duration::from_millis(1900) && end < Duration::from_millis(2000));
    }

    #[test]
    fn four_concurrent_transfers_share_the_rate_fairly() {
        let b = TokenBucket::new(32 * MIB);
        let (end, spread, finish) = simulate(&b, 4, 16 * MIB);
        // Total bytes are bounded by the same budget as one stream: burst + rate * t.
        let expect = (64 * MIB - b.burst()) as f64 / (32 * MIB) as f64;
        assert!((end.as_secs_f64() - expect).abs() < 1e-6, "end {end:?}");
        // Round-robin: no stream is ever more than one chunk ahead of another…
        assert!(spread <= CHUNK, "spread {spread}");
        // …so all finish within a few chunk-times of each other.
        let first = finish.iter().min().copied().unwrap_or_default();
        let chunk_time = CHUNK as f64 / (32 * MIB) as f64;
        assert!(
            end.as_secs_f64() - first.as_secs_f64() <= 4.0 * chunk_time + 1e-9,
            "{finish:?}"
        );
    }

    #[test]
    fn budget_never_exceeds_burst_plus_rate_times_time() {
        let b = TokenBucket::with_burst(1_000_000, 100_000);
        let mut t = Duration::ZERO;
        let mut sent = 0u64;
        for i in 0..500u64 {
            let n = 1 + (i * 7919) % 50_000;
            t += b.reserve_at(n, t);
            sent += n;
            let budget = 100_000.0 + 1_000_000.0 * t.as_secs_f64();
            assert!(sent as f64 <= budget + 1.0, "sent {sent} budget {budget}");
        }
        // And it is not overly conservative: after a long idle the bucket is full again,
        // but only up to the burst.
        t += Duration::from_secs(100);
        assert_eq!(b.reserve_at(100_000, t), Duration::ZERO);
        assert_eq!(b.reserve_at(1_000, t), Duration::from_millis(1));
    }

    #[test]
    fn a_high_priority_stream_takes_the_rate_and_low_ones_share_the_rest() {
        let b = TokenBucket::with_burst(1_000_000, 10_000);
        // A high stream wanting half the rate (10 kB every 20 ms) and four low streams
        // wanting everything, for 10 s of virtual time.
        let mut high_sent = 0u64;
        let mut low_sent = 0u64;
        let mut t_high = Duration::ZERO;
        let mut t_low = [Duration::ZERO; 4];
        let end = Duration::from_secs(10);
        loop {
            let i = (0..4).min_by_key(|&i| t_low[i]).unwrap_or(0);
            if t_high <= t_low[i] {
                if t_high >= end {
                    break;
                }
                let wait = b.reserve_high_at(10_000, t_high);
                high_sent += 10_000;
                t_high += wait.max(Duration::from_millis(20));
            } else {
                if t_low[i] >= end {
                    break;
                }
                t_low[i] += b.reserve_at(10_000, t_low[i]);
                low_sent += 10_000;
            }
        }
        let secs = end.as_secs_f64();
        let high_rate = high_sent as f64 / secs;
        let total = (high_sent + low_sent) as f64 / secs;
        assert!(
            high_rate > 480_000.0,
            "the high stream got what it asked for: {high_rate}"
        );
        assert!(
            total < 1_030_000.0,
            "the bucket's rate still holds: {total}"
        );
        assert!(
            total > 950_000.0,
            "and the low streams used the rest: {total}"
        );
    }

    #[test]
    fn clock_going_backwards_adds_nothing() {
        let b = TokenBucket::with_burst(1000, 1000);
        assert_eq!(b.reserve_at(1000, Duration::from_secs(5)), Duration::ZERO);
        assert_eq!(
            b.reserve_at(500, Duration::from_secs(1)),
            Duration::from_millis(500)
        );
    }

    /// The async path, on tokio's paused (virtual) clock: four tasks share the bucket.
    #[tokio::test(start_paused = true)]
    async fn acquire_paces_concurrent_tasks_on_virtual_time() {
        use std::sync::Arc;
        let b = Arc::new(TokenBucket::new(32 * MIB));
        let start = tokio::time::Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let b = b.clone();
            tasks.push(tokio::spawn(async move {
                let mut sent = 0;
                while sent < 16 * MIB {
                    b.acquire(CHUNK).await;
                    // Sending the chunk yields to the runtime, as a socket write does.
                    tokio::task::yield_now().await;
                    sent += CHUNK;
                }
                tokio::time::Instant::now()
            }));
        }
        let mut ends = Vec::new();
        for t in tasks {
            ends.push(t.await.expect("task").duration_since(start).as_secs_f64());
        }
        let expect = (64 * MIB - b.burst()) as f64 / (32 * MIB) as f64;
        let last = ends.iter().cloned().fold(0.0, f64::max);
        let first = ends.iter().cloned().fold(f64::MAX, f64::min);
        // Virtual time: sleeps are rounded up to whole milliseconds by tokio's timer.
        assert!(
            last >= expect && last < expect + 0.1,
            "last {last} expect {expect}"
        );
        assert!(last - first < 0.05, "{ends:?}");
    }
}
