//! Announces that wait for a swarm's size. A downloader that is not the source cannot
//! lay out the blob until the source has seen the registry's answer and announced the
//! size; instead of asking again every 20 ms it may ask the tracker to hold the answer
//! (`AnnounceRequest::wait_for_size_ms`). The answer then leaves as soon as the size
//! reaches this replica, or at the next 20 ms look at the shared state (a size
//! announced through another replica), and at the latest after the wait asked for
//! (bounded by [`MAX_SIZE_WAIT`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use oci::Digest;
use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
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

    /// Waits until [`SizeWaiters::size_known`] names `d`, or `SIZE_RECHECK` passes.
    /// Cancel-safe: a client that goes away drops the wait, and the count and the
    /// digest's entry are put right all the same.
    pub async fn wait(&self, d: &Digest) {
        let held = Held {
            waiters: self,
            digest: d,
            notify: self.by_digest.lock().entry(d.clone()).or_default().clone(),
        };
        self.waiting.inc();
        let _ = tokio::time::timeout(SIZE_RECHECK, held.notify.notified()).await;
    }

    /// An announce carrying `d`'s size was decided: wake those waiting for it.
    pub fn size_known(&self, d: &Digest) {
        if let Some(n) = self.by_digest.lock().get(d) {
            n.notify_waiters();
        }
    }
}

/// One held announce: undoes its count and, if it was the last, its digest's entry.
struct Held<'a> {
    waiters: &'a SizeWaiters,
    digest: &'a Digest,
    notify: Arc<Notify>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.waiters.waiting.dec();
        let mut map = self.waiters.by_digest.lock();
        // The map's reference and ours: nobody else waits on this digest.
        if Arc::strong_count(&self.notify) <= 2 {
            map.remove(self.digest);
        }
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
            let held = w.wait(&d);
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
}
