//! Announces that wait for a swarm's size. A downloader that is not the source cannot
//! lay out the blob until the source has seen the registry's answer and announced the
//! size; instead of asking again every 20 ms it may ask the tracker to hold the answer
//! (`AnnounceRequest::wait_for_size_ms`). The answer then leaves as soon as the size
//! reaches this replica, or at the next 20 ms look at the shared state (a size
//! announced through another replica), and at the latest after the wait asked for
//! (bounded by [`MAX_SIZE_WAIT`]).
//!
//! A held announce arms its wake-up before it decides: a size decided between the
//! decision that found none and the wait wakes it at once instead of at the next look.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use oci::Digest;
use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// The longest an announce is held, whatever it asks: below the agents' 2 s request
/// timeout, and short enough that a held connection is not a resource to hoard.
pub const MAX_SIZE_WAIT: Duration = Duration::from_secs(1);
/// How often a held announce looks again without being woken: a size announced
/// through another replica reaches this one only through the shared store.
pub const SIZE_RECHECK: Duration = Duration::from_millis(20);

pub struct SizeWaiters {
    by_digest: Mutex<HashMap<Digest, Arc<Notify>>>,
    /// Announces held right now (`starling_tracker_announces_waiting_for_size`).
    waiting: Gauge,
}

impl SizeWaiters {
    pub fn new(waiting: Gauge) -> Self {
        Self {
            by_digest: Mutex::default(),
            waiting,
        }
    }

    /// Interest in `d`'s size for as long as the announce may be held. Dropping it
    /// (the answer leaves, or the client goes away) removes the digest's entry once
    /// nobody else watches it.
    pub fn watch<'a>(&'a self, d: &'a Digest) -> SizeWatch<'a> {
        SizeWatch {
            waiters: self,
            digest: d,
            notify: self.by_digest.lock().entry(d.clone()).or_default().clone(),
        }
    }

    /// An announce carrying `d`'s size was decided: wake those waiting for it.
    pub fn size_known(&self, d: &Digest) {
        if let Some(n) = self.by_digest.lock().get(d) {
            n.notify_waiters();
        }
    }
}

/// One announce's interest in a digest's size.
pub struct SizeWatch<'a> {
    waiters: &'a SizeWaiters,
    digest: &'a Digest,
    notify: Arc<Notify>,
}

/// A wake-up armed before a decision, so a size decided after it is not missed.
pub type Armed<'a> = Pin<Box<Notified<'a>>>;

impl SizeWatch<'_> {
    /// Arms a wake-up for the next [`SizeWaiters::size_known`] of this digest: a
    /// `Notified` counts `notify_waiters` calls from its creation, polled or not.
    pub fn arm(&self) -> Armed<'_> {
        Box::pin(self.notify.notified())
    }

    /// Waits until `armed` fires or `SIZE_RECHECK` passes, counted as held meanwhile.
    /// Cancel-safe: a client that goes away drops the wait and the count is put right.
    pub async fn wait(&self, armed: Armed<'_>) {
        let _held = Held::new(&self.waiters.waiting);
        let _ = tokio::time::timeout(SIZE_RECHECK, armed).await;
    }
}

impl Drop for SizeWatch<'_> {
    fn drop(&mut self) {
        let mut map = self.waiters.by_digest.lock();
        // The map's reference and ours: nobody else watches this digest.
        if Arc::strong_count(&self.notify) <= 2 {
            map.remove(self.digest);
        }
    }
}

/// Counts one held announce for as long as it lives.
struct Held<'a>(&'a Gauge);

impl<'a> Held<'a> {
    fn new(g: &'a Gauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wait_dropped_midway_leaves_nothing_behind() {
        let w = SizeWaiters::new(Gauge::default());
        let d = Digest::of(b"gone");
        {
            let watch = w.watch(&d);
            let held = watch.wait(watch.arm());
            tokio::pin!(held);
            assert!(futures::poll!(held.as_mut()).is_pending());
            assert_eq!(w.waiting.get(), 1);
            assert!(w.by_digest.lock().contains_key(&d));
        }
        assert_eq!(w.waiting.get(), 0, "the count is put right");
        assert!(
            w.by_digest.lock().is_empty(),
            "and the digest's entry removed"
        );
    }

    /// The window between a decision that found no size and the wait: a size decided
    /// there must wake the wait at once, not at the next look (virtual time).
    #[tokio::test(start_paused = true)]
    async fn a_size_decided_before_the_wait_begins_still_wakes_it() {
        let w = SizeWaiters::new(Gauge::default());
        let d = Digest::of(b"racing");
        let watch = w.watch(&d);
        let armed = watch.arm();
        w.size_known(&d);
        let began = tokio::time::Instant::now();
        watch.wait(armed).await;
        assert!(
            began.elapsed() < SIZE_RECHECK,
            "woken by the size, not by the next look: {:?}",
            began.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_with_no_size_looks_again_after_the_recheck() {
        let w = SizeWaiters::new(Gauge::default());
        let d = Digest::of(b"quiet");
        let other = Digest::of(b"other");
        let watch = w.watch(&d);
        let armed = watch.arm();
        w.size_known(&other);
        let began = tokio::time::Instant::now();
        watch.wait(armed).await;
        assert_eq!(
            began.elapsed(),
            SIZE_RECHECK,
            "another digest's size wakes nothing"
        );
    }
}
