//! `starling tracker --redis URL`: the swarm state every replica shares, in Redis.
//!
//! Keys (prefix `st:` by default; `{d}` is the blob digest in a hash tag, so one swarm's
//! keys share a Redis Cluster slot):
//!
//! | key | type | what | TTL |
//! |---|---|---|---|
//! | `st:{d}:meta` | HASH size, piece_size, born | geometry, set once (`HSETNX`) | swarm idle TTL |
//! | `st:{d}:members` | HASH node → binary [`SharedPeer`](swarm::state::SharedPeer) ([`crate::member_entry`]) | members and bitfields | swarm idle TTL |
//! | `st:{d}:changes` | STREAM `n` → node | which members changed ([`crate::redis_members`]) | swarm idle TTL, `MAXLEN ~` 2 × members |
//! | `st:{d}:seen` | ZSET node → last stored `last_seen` | the janitor's expiry | swarm idle TTL |
//! | `st:{d}:source` | STRING node | the one registry fetcher (`SET NX PX`) | peer TTL, renewed by its announces |
//! | `st:{d}:hashes` | HASH piece → 32 bytes | hashes from the source only | swarm idle TTL |
//! | `st:{d}:elections`, `st:{d}:elected` | counter, LIST | elections across replicas | swarm idle TTL |
//! | `st:swarms` | ZSET digest → last announce | the janitor's index | trimmed by the janitor |
//! | `st:lease:janitor` | STRING replica | the one replica sweeping (`SET NX PX`, renewed) | 10 s |
//!
//! Every announce is one script ([`COMMIT`](announce::COMMIT)), so a change is whole
//! or absent: there is nothing to repair when Redis comes back. Reads of members and
//! hashes refresh a replica's copy at most every `refresh` per swarm, and read only
//! the members that changed since the last read ([`crate::redis_members`]); the
//! source and the geometry are read at every announce.
//!
//! Upgrading from a version that stored members as JSON in `st:{d}:peers`: that key
//! is no longer read or written (it expires with the swarm's idle TTL). Replicas of
//! the old and the new version share elections, geometry and hashes, but each sees
//! only the members announced to its own version until the last old replica stops;
//! agents announce every second, so the new replicas' member sets are whole again
//! one announce interval after that.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oci::Digest;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use redis::aio::ConnectionManager;
use tracing::{info, warn};

use crate::redis_members::{self, MemberCopies};
use crate::{Error, ReasonLabels};

mod announce;

/// Swarms whose last refresh time is remembered; beyond it the table starts over.
const MAX_REFRESH_ENTRIES: usize = 100_000;
/// Failed health pings in a row before the replica says it is not ready.
const PINGS_BEFORE_DOWN: u32 = 2;

/// Takes the lease KEYS[1] for ARGV[1] (SET NX PX) or renews it if ARGV[1] holds it;
/// 1 while ARGV[1] leads.
const LEAD: &str = r"
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
elseif cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// [`LEAD`] with an epoch: taking the lease bumps KEYS[2]. Returns the epoch while
/// ARGV[1] leads, 0 otherwise.
const LEAD_FENCED: &str = r"
local cur = redis.call('GET', KEYS[1])
if not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return redis.call('INCR', KEYS[2])
elseif cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local e = tonumber(redis.call('GET', KEYS[2]) or '0')
  if e == 0 then e = redis.call('INCR', KEYS[2]) end
  return e
end
return 0
";

/// Drops the members of a swarm stored last before ARGV[1] (at most 10,000 per
/// call), appending each to the change stream (with no writer: every replica reads
/// it, the janitor's own included); returns how many.
/// KEYS: members, seen, changes. ARGV: cutoff ms, least stream length kept.
const TRIM: &str = r"
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[1], 'LIMIT', 0, 10000)
local keep = math.max(tonumber(ARGV[2]), 2 * redis.call('HLEN', KEYS[1]))
for _, n in ipairs(gone) do
  redis.call('HDEL', KEYS[1], n)
  redis.call('ZREM', KEYS[2], n)
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', keep, '*', 'n', n)
end
return #gone
";

/// Stream entries kept at least per swarm (beyond, twice its members): a replica
/// reading every second finds its place in it unless it fell this far behind.
const MIN_STREAM_LEN: usize = 1024;

/// How long the janitor lease lasts without renewal, and how often it is tried.
const JANITOR_LEASE: Duration = Duration::from_secs(10);
const JANITOR_EVERY: Duration = Duration::from_secs(3);
/// Swarms the janitor looks at per round.
const JANITOR_BATCH: isize = 1000;

/// What `--redis` and its companions say.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// `redis://[:password@]host:port[/db]` or `rediss://…` (TLS).
    pub url: String,
    /// Key prefix, so that one Redis can serve several clusters.
    pub prefix: String,
    /// How often a replica re-reads a swarm's members and hashes at most (the
    /// changes since its last read).
    pub refresh: Duration,
    /// How often a replica reads a swarm's members whole even though the change
    /// stream says what changed: a safety net, not the normal path.
    pub full_reread: Duration,
    /// How often a replica reads the whole shared inventory index (every node's
    /// heartbeat); changed reports are read every second from a change stream.
    pub inventory_sweep: Duration,
    /// A swarm nobody announced for this long is dropped from Redis.
    pub swarm_idle: Duration,
    /// Connection and response timeout of one Redis call: beyond it the announce gets
    /// 503 and the agent tries another tracker.
    pub timeout: Duration,
}

impl RedisOptions {
    pub fn new(url: impl Into<String>) -> Self {
        RedisOptions {
            url: url.into(),
            prefix: "st:".into(),
            refresh: Duration::from_secs(1),
            full_reread: Duration::from_secs(300),
            inventory_sweep: Duration::from_secs(10),
            swarm_idle: Duration::from_secs(600),
            timeout: Duration::from_secs(1),
        }
    }
}

/// Redis health and errors, metric families of the tracker's registry.
#[derive(Clone, Default)]
pub struct RedisMetrics {
    pub(crate) up: Gauge,
    pub(crate) errors: Family<ReasonLabels, Counter>,
    /// 1 while this replica holds the janitor lease.
    pub(crate) leader: Gauge,
    /// 1 while this replica holds the prewarm planner lease.
    pub(crate) prewarm_leader: Gauge,
    /// Member reads by kind: `changes` (the normal path) or `full`.
    pub(crate) member_reads: Family<ReadLabels, Counter>,
    /// Shared inventory reads by kind: `changes` (every second) or `sweep`.
    pub(crate) inventory_reads: Family<ReadLabels, Counter>,
}

/// How a replica read a swarm's members or the inventory.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub(crate) struct ReadLabels {
    pub kind: &'static str,
}

pub struct RedisStore {
    con: ConnectionManager,
    /// A connection of its own for bulk background work (the inventory read back every
    /// second), so that a large reply never delays an announce queued behind it.
    background: ConnectionManager,
    /// This replica's name in leases: unique per process start.
    replica: String,
    prefix: String,
    refresh_ms: u64,
    full_reread_ms: u64,
    inventory_sweep: Duration,
    source_ttl_ms: u64,
    /// See [`redis_members::heartbeat_ms`].
    heartbeat_ms: u64,
    idle_ms: u64,
    /// This replica's copies of swarms' members, kept by reading changes.
    members: MemberCopies,
    /// Per swarm, when this replica last read its members (wall-clock ms).
    refreshed: Mutex<HashMap<Digest, u64>>,
    up: AtomicBool,
    failed_pings: AtomicU32,
    metrics: RedisMetrics,
    /// The URL without its password, for logs.
    shown: String,
}

/// Milliseconds since the Unix epoch: the clock replicas share through Redis.
pub(crate) fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The URL with its password replaced, for logs and errors.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

impl RedisStore {
    /// Connects lazily: a replica starts (not ready) while Redis is down, and becomes
    /// ready when it answers. `source_ttl`: the swarm's peer TTL, how long a silent
    /// source keeps the role.
    pub fn connect(
        opts: &RedisOptions,
        source_ttl: Duration,
        metrics: RedisMetrics,
    ) -> Result<Arc<Self>, Error> {
        let shown = redact(&opts.url);
        let bad_url = |source| Error::RedisUrl {
            url: shown.clone(),
            source,
        };
        if opts.url.starts_with("rediss://") {
            // redis-rs builds its rustls configuration from the process default; the
            // workspace uses ring. Already installed (by a test, say) is fine.
            let _ = pki::tokio_rustls::rustls::crypto::ring::default_provider().install_default();
        }
        let client = redis::Client::open(opts.url.as_str()).map_err(bad_url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(opts.timeout))
            .set_response_timeout(Some(opts.timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        let background = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(bad_url)?;
        let con = ConnectionManager::new_lazy_with_config(client, config).map_err(bad_url)?;
        info!(redis = %shown, prefix = %opts.prefix, "tracker state shared in Redis");
        Ok(Arc::new(RedisStore {
            con,
            background,
            replica: {
                // Several stores in one process (tests, a future multi-tenant tracker)
                // are distinct replicas too.
                static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = STARTED.fetch_add(1, Ordering::Relaxed);
                format!("{}-{}-{n}", std::process::id(), wall_ms())
            },
            prefix: opts.prefix.clone(),
            refresh_ms: opts.refresh.as_millis() as u64,
            full_reread_ms: opts.full_reread.as_millis().max(1) as u64,
            inventory_sweep: opts.inventory_sweep,
            source_ttl_ms: source_ttl.as_millis().max(1) as u64,
            heartbeat_ms: redis_members::heartbeat_ms(source_ttl.as_millis() as u64),
            idle_ms: opts.swarm_idle.as_millis().max(1) as u64,
            members: MemberCopies::default(),
            refreshed: Mutex::new(HashMap::new()),
            up: AtomicBool::new(false),
            failed_pings: AtomicU32::new(0),
            metrics,
            shown,
        }))
    }

    /// Pings Redis every second for readiness and the `redis_up` metric, for as long as
    /// the store lives.
    pub fn spawn_health(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let Some(store) = weak.upgrade() else { return };
                let mut con = store.con.clone();
                let pong: Result<String, _> = redis::cmd("PING").query_async(&mut con).await;
                store.note_ping(pong.is_ok());
            }
        });
    }

    /// Takes or renews the lease `name` for this replica: true while it leads. A
    /// replica that stops renewing (dead, cut off) loses it after `ttl`, and the next
    /// replica to ask takes it.
    pub async fn lead(&self, name: &str, ttl: Duration) -> Result<bool, Error> {
        let mut con = self.con.clone();
        let led: u32 = redis::cmd("EVAL")
            .arg(LEAD)
            .arg(1)
            .arg(format!("{}lease:{name}", self.prefix))
            .arg(&self.replica)
            .arg(ttl.as_millis().max(1) as u64)
            .query_async(&mut con)
            .await
            .map_err(self.redis_err("lease"))?;
        Ok(led == 1)
    }

    /// [`lead`](Self::lead) with a fencing epoch (the counter `lease:NAME:epoch`,
    /// bumped each time a replica takes the lease): the epoch while this replica
    /// leads. A leader that was paused past its lease and lost it to another holds a
    /// stale epoch, and the writes that carry it are refused.
    pub async fn lead_fenced(&self, name: &str, ttl: Duration) -> Result<Option<u64>, Error> {
        let mut con = self.con.clone();
        let epoch: u64 = redis::cmd("EVAL")
            .arg(LEAD_FENCED)
            .arg(2)
            .arg(format!("{}lease:{name}", self.prefix))
            .arg(format!("{}lease:{name}:epoch", self.prefix))
            .arg(&self.replica)
            .arg(ttl.as_millis().max(1) as u64)
            .query_async(&mut con)
            .await
            .map_err(self.redis_err("lease"))?;
        Ok((epoch != 0).then_some(epoch))
    }

    /// One janitor round: members silent for ten peer TTLs leave Redis (the embedded
    /// tracker's expiry), swarms idle past their TTL leave the index. Returns the
    /// members removed.
    pub async fn sweep(&self) -> Result<u64, Error> {
        let now = wall_ms();
        let mut con = self.con.clone();
        let index = self.swarms_key();
        let _: () = redis::cmd("ZREMRANGEBYSCORE")
            .arg(&index)
            .arg("-inf")
            .arg(now.saturating_sub(self.idle_ms))
            .query_async(&mut con)
            .await
            .map_err(self.redis_err("sweep"))?;
        let digests: Vec<String> = redis::cmd("ZRANGE")
            .arg(&index)
            .arg(0)
            .arg(JANITOR_BATCH - 1)
            .query_async(&mut con)
            .await
            .map_err(self.redis_err("sweep"))?;
        let cutoff = self.expired_before(now);
        let mut gone = 0u64;
        for d in digests.iter().filter_map(|d| d.parse::<Digest>().ok()) {
            let n: u64 = redis::cmd("EVAL")
                .arg(TRIM)
                .arg(3)
                .arg(self.key(&d, "members"))
                .arg(self.key(&d, "seen"))
                .arg(self.key(&d, "changes"))
                .arg(cutoff)
                .arg(MIN_STREAM_LEN)
                .query_async(&mut con)
                .await
                .map_err(self.redis_err("sweep"))?;
            gone += n;
        }
        Ok(gone)
    }

    /// The janitor: whichever replica holds the `janitor` lease sweeps every few
    /// seconds; the others only try to take the lease.
    pub fn spawn_janitor(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(JANITOR_EVERY);
            loop {
                tick.tick().await;
                let Some(store) = weak.upgrade() else { return };
                let leads = store.lead("janitor", JANITOR_LEASE).await.unwrap_or(false);
                store.metrics.leader.set(i64::from(leads));
                if leads {
                    match store.sweep().await {
                        Ok(0) => {}
                        Ok(n) => tracing::debug!(members = n, "janitor removed silent members"),
                        Err(e) => warn!(error = %e, "janitor round failed"),
                    }
                }
            }
        });
    }

    fn note_ping(&self, ok: bool) {
        if ok {
            self.failed_pings.store(0, Ordering::Relaxed);
            if !self.up.swap(true, Ordering::Relaxed) {
                info!(redis = %self.shown, "Redis reachable: ready");
            }
        } else {
            let failed = self.failed_pings.fetch_add(1, Ordering::Relaxed) + 1;
            self.error("ping");
            if failed >= PINGS_BEFORE_DOWN && self.up.swap(false, Ordering::Relaxed) {
                warn!(redis = %self.shown, "Redis unreachable: not ready, announces get 503");
            }
        }
        self.metrics
            .up
            .set(i64::from(self.up.load(Ordering::Relaxed)));
    }

    fn error(&self, op: &'static str) {
        self.metrics
            .errors
            .get_or_create(&ReasonLabels { reason: op })
            .inc();
    }

    fn redis_err(&self, what: &'static str) -> impl Fn(redis::RedisError) -> Error + '_ {
        move |source| {
            self.error(what);
            Error::Redis { what, source }
        }
    }

    /// A connection for one call (the manager reconnects as needed).
    pub(crate) fn connection(&self) -> ConnectionManager {
        self.con.clone()
    }

    /// The connection for bulk background work (see the field).
    pub(crate) fn background_connection(&self) -> ConnectionManager {
        self.background.clone()
    }

    /// `name` under this store's key prefix.
    pub(crate) fn prefixed(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// See [`RedisOptions::inventory_sweep`].
    pub(crate) fn inventory_sweep(&self) -> Duration {
        self.inventory_sweep
    }

    /// Counts a read of the shared inventory (`changes` or `sweep`).
    pub(crate) fn note_inventory_read(&self, kind: &'static str) {
        self.metrics
            .inventory_reads
            .get_or_create(&ReadLabels { kind })
            .inc();
    }

    /// This replica's name in leases and locks.
    pub(crate) fn replica(&self) -> &str {
        &self.replica
    }

    /// Says in `prewarm_leader` whether this replica plans prewarm.
    pub(crate) fn note_prewarm_leader(&self, leads: bool) {
        self.metrics.prewarm_leader.set(i64::from(leads));
    }

    /// Counts a failed call of `op` in `redis_errors`.
    pub(crate) fn count_error(&self, op: &'static str) {
        self.error(op);
    }

    /// Members stored last before this are expired (ten peer TTLs: the embedded
    /// tracker's expiry).
    fn expired_before(&self, now: u64) -> u64 {
        now.saturating_sub(self.source_ttl_ms.saturating_mul(10))
    }

    fn swarms_key(&self) -> String {
        format!("{}swarms", self.prefix)
    }

    fn key(&self, d: &Digest, part: &str) -> String {
        format!("{}{{{d}}}:{part}", self.prefix)
    }

    /// Whether swarm `d`'s members are due for a read, noting the read if so.
    fn due(&self, d: &Digest, now: u64) -> bool {
        let mut refreshed = self.refreshed.lock();
        if refreshed.len() >= MAX_REFRESH_ENTRIES {
            refreshed.clear();
        }
        match refreshed.get(d) {
            Some(&at) if now.saturating_sub(at) < self.refresh_ms => false,
            _ => {
                refreshed.insert(d.clone(), now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_logs() {
        assert_eq!(
            redact("redis://:s3cret@10.0.0.1:6379/0"),
            "redis://***@10.0.0.1:6379/0"
        );
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
    }
}
