//! A registry's word that it will not serve us for a while (`429 Too Many Requests`
//! with a `Retry-After` longer than a request waits out): kept per registry, so that
//! every later request to it — any repository, manifest or blob, whichever download
//! asks — is answered here with the same 429 and the time left, and the registry is
//! not asked again before it said. Docker Hub and cloud registries count pulls per
//! account or address, and asking during the wait only spends more of the quota.
//!
//! Also the requests that failed every attempt (5xx, no connection): each is held
//! back for a while that doubles with every failure in a row, so that the retries of
//! swarm downloads and runtimes do not add load to a registry that is already failing.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Longest wait honoured, whatever a registry says: a broken or hostile `Retry-After`
/// must not shut a registry out of this node for hours.
pub const MAX_QUOTA_WAIT: Duration = Duration::from_secs(300);

/// Entries remembered at once in each table. A client can name many registries a
/// wildcard admits, and many blobs; past this many, a new refusal or failure is not
/// remembered (requests then go out as before) rather than the table growing.
const MAX_ENTRIES: usize = 1024;

/// Registries that asked to be left alone, and until when.
#[derive(Default)]
pub(super) struct QuotaWaits {
    until: Mutex<HashMap<String, Instant>>,
}

impl QuotaWaits {
    /// The time left before `registry` may be asked again, if it asked us to wait.
    pub(super) fn left(&self, registry: &str, now: Instant) -> Option<Duration> {
        let until = *self.until.lock().get(registry)?;
        let left = until.saturating_duration_since(now);
        (!left.is_zero()).then_some(left)
    }

    /// `registry` refused a request and asked for `wait` (bounded by
    /// [`MAX_QUOTA_WAIT`]). A later, shorter answer does not shorten a longer wait.
    pub(super) fn refused(&self, registry: &str, wait: Duration, now: Instant) {
        let until = now + wait.min(MAX_QUOTA_WAIT);
        let mut m = self.until.lock();
        if !m.contains_key(registry) && m.len() >= MAX_ENTRIES {
            m.retain(|_, u| *u > now);
            if m.len() >= MAX_ENTRIES {
                return;
            }
        }
        let e = m.entry(registry.to_owned()).or_insert(until);
        *e = (*e).max(until);
    }
}

/// First wait after a request that failed every attempt (5xx or transport); each
/// further failure in a row doubles it, up to [`MAX_FAILING_WAIT`].
const FIRST_FAILING_WAIT: Duration = Duration::from_secs(2);
const MAX_FAILING_WAIT: Duration = Duration::from_secs(60);

/// Requests (registry and path: one blob, one manifest) that failed every attempt
/// in a row, and until when they are not sent again. Keyed by path, not registry: a
/// registry that fails one blob (its storage lost it) still serves the others.
#[derive(Default)]
pub(super) struct FailingRequests {
    by_key: Mutex<HashMap<String, (u32, Instant)>>,
}

impl FailingRequests {
    /// Failures in a row and the time left before `key` may be sent again.
    pub(super) fn left(&self, key: &str, now: Instant) -> Option<(u32, Duration)> {
        let (strikes, until) = *self.by_key.lock().get(key)?;
        let left = until.saturating_duration_since(now);
        (!left.is_zero()).then_some((strikes, left))
    }

    pub(super) fn failed(&self, key: &str, now: Instant) {
        let mut m = self.by_key.lock();
        if !m.contains_key(key) && m.len() >= MAX_ENTRIES {
            m.retain(|_, (_, u)| *u + MAX_FAILING_WAIT > now);
            if m.len() >= MAX_ENTRIES {
                return;
            }
        }
        let e = m.entry(key.to_owned()).or_insert((0, now));
        e.0 = e.0.saturating_add(1);
        let wait = FIRST_FAILING_WAIT
            .saturating_mul(1 << (e.0 - 1).min(16))
            .min(MAX_FAILING_WAIT);
        e.1 = now + wait;
    }

    pub(super) fn succeeded(&self, key: &str) {
        let mut m = self.by_key.lock();
        if !m.is_empty() {
            m.remove(key);
        }
    }
}

/// Whole seconds, rounded up: a `Retry-After` of 0 would tell a client to come
/// straight back.
pub(super) fn retry_after_secs(left: Duration) -> Duration {
    Duration::from_secs(left.as_secs() + u64::from(left.subsec_nanos() > 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registry_is_left_alone_for_the_time_it_asked_and_no_longer() {
        let q = QuotaWaits::default();
        let t0 = Instant::now();
        assert_eq!(q.left("r", t0), None);
        q.refused("r", Duration::from_secs(30), t0);
        assert_eq!(q.left("r", t0), Some(Duration::from_secs(30)));
        assert_eq!(
            q.left("r", t0 + Duration::from_secs(29)),
            Some(Duration::from_secs(1))
        );
        assert_eq!(q.left("r", t0 + Duration::from_secs(30)), None);
        assert_eq!(q.left("other", t0), None, "only the registry that asked");
    }

    #[test]
    fn a_shorter_answer_keeps_the_longer_wait_and_no_wait_exceeds_the_bound() {
        let q = QuotaWaits::default();
        let t0 = Instant::now();
        q.refused("r", Duration::from_secs(60), t0);
        q.refused("r", Duration::from_secs(1), t0);
        assert_eq!(q.left("r", t0), Some(Duration::from_secs(60)));
        q.refused("r", Duration::from_secs(u32::MAX as u64), t0);
        assert_eq!(q.left("r", t0), Some(MAX_QUOTA_WAIT));
    }

    #[test]
    fn the_table_stays_bounded_and_forgets_waits_that_ended() {
        let q = QuotaWaits::default();
        let t0 = Instant::now();
        for i in 0..MAX_ENTRIES {
            q.refused(&format!("r{i}"), Duration::from_secs(1), t0);
        }
        q.refused("late", Duration::from_secs(1), t0);
        assert_eq!(q.left("late", t0), None, "full: not remembered");
        let later = t0 + Duration::from_secs(2);
        q.refused("late", Duration::from_secs(1), later);
        assert_eq!(q.left("late", later), Some(Duration::from_secs(1)));
        assert!(q.until.lock().len() <= MAX_ENTRIES);
    }

    #[test]
    fn a_request_that_keeps_failing_is_sent_less_and_less_often_until_it_succeeds() {
        let f = FailingRequests::default();
        let t0 = Instant::now();
        assert_eq!(f.left("r/v2/a/blobs/x", t0), None);
        let mut waits = Vec::new();
        for _ in 0..8 {
            f.failed("r/v2/a/blobs/x", t0);
            waits.push(f.left("r/v2/a/blobs/x", t0).unwrap().1.as_secs());
        }
        assert_eq!(waits, [2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(f.left("r/v2/a/blobs/y", t0), None, "other paths are sent");
        f.succeeded("r/v2/a/blobs/x");
        assert_eq!(f.left("r/v2/a/blobs/x", t0), None);
        f.failed("r/v2/a/blobs/x", t0);
        assert_eq!(f.left("r/v2/a/blobs/x", t0), Some((1, FIRST_FAILING_WAIT)));
    }

    #[test]
    fn the_time_left_is_said_in_whole_seconds_rounded_up() {
        assert_eq!(
            retry_after_secs(Duration::from_millis(1)),
            Duration::from_secs(1)
        );
        assert_eq!(
            retry_after_secs(Duration::from_secs(3)),
            Duration::from_secs(3)
        );
        assert_eq!(
            retry_after_secs(Duration::from_millis(2500)),
            Duration::from_secs(3)
        );
    }
}
