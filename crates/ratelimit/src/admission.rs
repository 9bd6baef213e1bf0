//! Admission of requests by key (a client address): a small token bucket per key that
//! refuses instead of going into debt. For endpoints where each request is costly or
//! security-relevant (joining the cluster: a token check and a certificate signature),
//! so that one client cannot hammer them.
//!
//! Memory is bounded: at most `max_keys` keys are tracked. Keys whose bucket has refilled
//! completely carry no information and are forgotten first; when every tracked key is
//! still draining, a new key shares one overflow bucket. So many addresses at once are
//! limited together rather than refused outright or allowed to grow the table.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    last: Duration,
}

/// Per-key request admission; see the module documentation.
#[derive(Debug)]
pub struct KeyedAdmission<K> {
    per_second: f64,
    burst: f64,
    max_keys: usize,
    state: Mutex<Table<K>>,
}

#[derive(Debug)]
struct Table<K> {
    keys: HashMap<K, Bucket>,
    overflow: Option<Bucket>,
}

impl<K: Hash + Eq + Clone> KeyedAdmission<K> {
    /// Each key may make `burst` requests at once, then `per_minute` a minute.
    pub fn new(per_minute: u32, burst: u32, max_keys: usize) -> Self {
        KeyedAdmission {
            per_second: f64::from(per_minute.max(1)) / 60.0,
            burst: f64::from(burst.max(1)),
            max_keys: max_keys.max(1),
            state: Mutex::new(Table {
                keys: HashMap::new(),
                overflow: None,
            }),
        }
    }

    /// Whether a request from `key` at clock reading `now` (any monotonic clock the
    /// caller uses consistently) is admitted; an admitted request takes one token.
    /// When refused: how long until the next one would be admitted.
    pub fn admit_at(&self, key: &K, now: Duration) -> Result<(), Duration> {
        let mut table = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (per_second, burst) = (self.per_second, self.burst);
        if !table.keys.contains_key(key) && table.keys.len() >= self.max_keys {
            table
                .keys
                .retain(|_, b| refilled(*b, now, per_second, burst) < burst);
        }
        let bucket = if table.keys.contains_key(key) || table.keys.len() < self.max_keys {
            table.keys.entry(key.clone()).or_insert(Bucket {
                tokens: burst,
                last: now,
            })
        } else {
            table.overflow.get_or_insert(Bucket {
                tokens: burst,
                last: now,
            })
        };
        bucket.tokens = refilled(*bucket, now, per_second, burst);
        bucket.last = bucket.last.max(now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - bucket.tokens) / per_second))
        }
    }

    /// Keys tracked now (at most `max_keys`).
    pub fn tracked_keys(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys
            .len()
    }
}

/// The bucket's tokens at `now`; a clock reading before its last update adds nothing.
fn refilled(b: Bucket, now: Duration, per_second: f64, burst: f64) -> f64 {
    let elapsed = now.saturating_sub(b.last).as_secs_f64();
    (b.tokens + elapsed * per_second).min(burst)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_key_gets_its_burst_then_its_rate() {
        let a = KeyedAdmission::new(6, 3, 16);
        for _ in 0..3 {
            assert!(a.admit_at(&"x", S).is_ok());
        }
        let wait = a.admit_at(&"x", S).expect_err("burst spent");
        assert_eq!(wait, Duration::from_secs(10), "6 a minute: one every 10 s");
        assert!(a.admit_at(&"x", S * 10).is_err(), "9 s later: not yet");
        assert!(a.admit_at(&"x", S * 11).is_ok(), "10 s later: one more");
        assert!(a.admit_at(&"x", S * 11).is_err());
        // Another key is not affected.
        assert!(a.admit_at(&"y", S * 11).is_ok());
    }

    #[test]
    fn a_clock_going_back_adds_no_tokens() {
        let a = KeyedAdmission::new(60, 1, 16);
        assert!(a.admit_at(&1u32, S * 100).is_ok());
        assert!(a.admit_at(&1u32, S * 50).is_err());
        assert!(a.admit_at(&1u32, S * 100).is_err());
        assert!(a.admit_at(&1u32, S * 101).is_ok());
    }

    #[test]
    fn the_table_is_bounded_and_overflow_keys_share_one_bucket() {
        let a = KeyedAdmission::new(60, 2, 4);
        for k in 0..4u32 {
            assert!(a.admit_at(&k, S).is_ok());
        }
        // Four keys still draining: new keys share the overflow bucket (burst 2).
        assert!(a.admit_at(&100u32, S).is_ok());
        assert!(a.admit_at(&101u32, S).is_ok());
        assert!(a.admit_at(&102u32, S).is_err(), "overflow bucket spent");
        assert_eq!(a.tracked_keys(), 4);
        // Once the tracked keys have refilled they are forgotten and new keys get their own.
        assert!(a.admit_at(&103u32, S * 5).is_ok());
        assert!(a.tracked_keys() <= 4);
        for k in 200..1000u32 {
            let _ = a.admit_at(&k, S * 5);
        }
        assert!(a.tracked_keys() <= 4, "bounded: {}", a.tracked_keys());
    }
}
