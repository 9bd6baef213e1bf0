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
    pub async fn wait(&self, d: &Digest) {
        let notify = self.by_digest.lock().entry(d.clone()).or_default().clone();
        self.waiting.inc();
        let _ = tokio::time::timeout(SIZE_RECHECK, notify.notified()).await;
        self.waiting.dec();
        let mut map = self.by_digest.lock();
        // The map's reference and ours: nobody else waits on this digest.
        if Arc::strong_count(&notify) <= 2 {
            map.remove(d);
        }
    }

    /// An announce carrying `d`'s size was decided: wake those waiting for it.
    pub fn size_known(&self, d: &Digest) {
        if let Some(n) = self.by_digest.lock().get(d) {
            n.notify_waiters();
        }
    }
}
