//! `starling tracker --redis URL`: the swarm state every replica shares, in Redis.
//!
//! Keys (prefix `st:` by default; `{d}` is the blob digest in a hash tag, so one swarm's
//! keys share a Redis Cluster slot):
//!
//! | key | type | what | TTL |
//! |---|---|---|---|
//! | `st:{d}:meta` | HASH size, piece_size, born | geometry, set once (`HSETNX`) | swarm idle TTL |
//! | `st:{d}:members` | HASH node → binary [`SharedPeer`] ([`crate::member_entry`]) | members and bitfields | swarm idle TTL |
//! | `st:{d}:changes` | STREAM `n` → node | which members changed ([`crate::redis_members`]) | swarm idle TTL, `MAXLEN ~` 2 × members |
//! | `st:{d}:seen` | ZSET node → last stored `last_seen` | the janitor's expiry | swarm idle TTL |
//! | `st:{d}:source` | STRING node | the one registry fetcher (`SET NX PX`) | peer TTL, renewed by its announces |
//! | `st:{d}:hashes` | HASH piece → 32 bytes | hashes from the source only | swarm idle TTL |
//! | `st:{d}:elections`, `st:{d}:elected` | counter, LIST | elections across replicas | swarm idle TTL |
//! | `st:swarms` | ZSET digest → last announce | the janitor's index | trimmed by the janitor |
//! | `st:lease:janitor` | STRING replica | the one replica sweeping (`SET NX PX`, renewed) | 10 s |
//!
//! Every announce is one script ([`COMMIT`]), so a change is whole or absent: there is
//! nothing to repair when Redis comes back. Reads of members and hashes refresh a
//! replica's copy at most every `refresh` per swarm, and read only the members that
//! changed since the last read ([`crate::redis_members`]); the source and the
//! geometry are read at every announce.
//!
//! Upgrading from a version that stored members as JSON in `st:{d}:peers`: that key
//! is no longer read or written (it expires with the swarm's idle TTL). Replicas of
//! the old and the new version share elections, geometry and hashes, but each sees
//! only the members announced to its own version until the last old replica stops;
//! agents announce every second, so the new replicas' member sets are whole again
//! one announce interval after that.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oci::Digest;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use redis::aio::ConnectionManager;
use swarm::state::{SharedPeer, SharedReport, SharedSwarm};
use swarm::PieceHash;
use tracing::{info, warn};

use crate::redis_members::{self, MemberCopies, ReadKind};
use crate::store::{Elections, Outcome, Refresh, Settled, SourceIntent, StoreFuture, SwarmStore};
use crate::{member_entry, Error, ReasonLabels};

/// Swarms whose last refresh time is remembered; beyond it the table starts over.
const MAX_REFRESH_ENTRIES: usize = 100_000;
/// Failed health pings in a row before the replica says it is not ready.
const PINGS_BEFORE_DOWN: u32 = 2;

/// Settles one announce atomically: geometry set once, the member entry, the election
/// (`SET NX PX`, renewed by the source's announces, released when it finishes or
/// leaves), the source's hashes, TTLs. The member entry is stored, and its node
/// appended to the change stream, when the member is new or leaves, when its shape
/// (address, topology, completion: [`member_entry`]'s bytes 0 and 9..11+m) changed, or
/// when the stored one is a heartbeat old; otherwise (only the bitfield or `last_seen`
/// moved) nothing is written for it. Returns the stored size and piece size, the
/// current source ('' for none) and 1 when this call elected it.
///
/// KEYS: meta, members, source, hashes, elections, elected, changes, seen.
/// ARGV: node, member entry ('' = leaving), intent (claim|release|keep), source TTL
/// ms, idle TTL ms, size ('' = unknown), piece size ('0' = unknown), born, now ms,
/// heartbeat ms, least stream length kept, this replica (the stream entry's writer:
/// its own reads skip it), the source the decision demoted ('' = none; a claim
/// deletes the role first if that node still holds it), '1' when the source voids its
/// hashes (they are deleted and the meta's `hashes_epoch` counts one more), then hash
/// pairs.
const COMMIT: &str = r"
local function shape(e)
  if #e < 11 then return '' end
  local m = string.byte(e, 10) * 256 + string.byte(e, 11)
  return string.sub(e, 1, 1) .. string.sub(e, 10, 11 + m)
end
local function stored_at(e)
  local v = 0
  for i = 2, 9 do v = v * 256 + (string.byte(e, i) or 0) end
  return v
end
local node = ARGV[1]
local now = tonumber(ARGV[9])
if ARGV[6] ~= '' then redis.call('HSETNX', KEYS[1], 'size', ARGV[6]) end
if ARGV[7] ~= '0' then redis.call('HSETNX', KEYS[1], 'piece_size', ARGV[7]) end
redis.call('HSETNX', KEYS[1], 'born', ARGV[8])
local geo = redis.call('HMGET', KEYS[1], 'size', 'piece_size')
local changed = false
if ARGV[2] == '' then
  changed = redis.call('HDEL', KEYS[2], node) == 1
  redis.call('ZREM', KEYS[8], node)
else
  local old = redis.call('HGET', KEYS[2], node)
  if not old or shape(old) == '' or shape(old) ~= shape(ARGV[2])
      or math.abs(now - stored_at(old)) >= tonumber(ARGV[10]) then
    redis.call('HSET', KEYS[2], node, ARGV[2])
    redis.call('ZADD', KEYS[8], now, node)
    changed = true
  end
end
if changed then
  local keep = math.max(tonumber(ARGV[11]), 2 * redis.call('HLEN', KEYS[2]))
  redis.call('XADD', KEYS[7], 'MAXLEN', '~', keep, '*', 'n', node, 'r', ARGV[12])
end
local cur = redis.call('GET', KEYS[3])
if ARGV[3] == 'claim' and ARGV[13] ~= '' and cur == ARGV[13] then
  redis.call('DEL', KEYS[3])
  cur = false
end
local elected = 0
if cur == node and ARGV[3] ~= 'release' then
  redis.call('PEXPIRE', KEYS[3], ARGV[4])
elseif not cur and ARGV[3] == 'claim' then
  redis.call('SET', KEYS[3], node, 'PX', ARGV[4])
  cur = node
  elected = 1
  redis.call('INCR', KEYS[5])
  redis.call('RPUSH', KEYS[6], node)
  redis.call('LTRIM', KEYS[6], 0, 7)
end
if cur == node and ARGV[14] == '1' then
  redis.call('DEL', KEYS[4])
  redis.call('HINCRBY', KEYS[1], 'hashes_epoch', 1)
elseif cur == node then
  for i = 15, #ARGV, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
end
if cur == node and ARGV[3] == 'release' then
  redis.call('DEL', KEYS[3])
  cur = false
end
for i = 1, 8 do
  if i ~= 3 then redis.call('PEXPIRE', KEYS[i], ARGV[5]) end
end
return {geo[1] or '', geo[2] or '', cur or '', elected}
";

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

/// A report's field in `{d}:reports`: the accused's length, then both names (any
/// bytes, so no separator is safe).
fn encode_report(accused: &str, reporter: &str) -> Vec<u8> {
    let mut field = format!("{}:", accused.len()).into_bytes();
    field.extend_from_slice(accused.as_bytes());
    field.extend_from_slice(reporter.as_bytes());
    field
}

fn decode_reports(fields: HashMap<Vec<u8>, u64>) -> Vec<SharedReport> {
    fields
        .into_iter()
        .filter_map(|(field, until)| {
            let colon = field.iter().position(|&b| b == b':')?;
            let len: usize = std::str::from_utf8(&field[..colon]).ok()?.parse().ok()?;
            let names = field.get(colon + 1..)?;
            let (accused, reporter) = (names.get(..len)?, names.get(len..)?);
            Some(SharedReport {
                accused: String::from_utf8(accused.to_vec()).ok()?,
                reporter: String::from_utf8(reporter.to_vec()).ok()?,
                until,
            })
        })
        .collect()
}

fn parse_u64(v: Option<&String>) -> Option<u64> {
    v.and_then(|s| s.parse().ok())
}

fn shared_swarm(
    meta: HashMap<String, String>,
    source: Option<String>,
    peers: Option<BTreeMap<String, SharedPeer>>,
    hashes: Option<HashMap<u32, Vec<u8>>>,
) -> SharedSwarm {
    SharedSwarm {
        size: parse_u64(meta.get("size")),
        piece_size: parse_u64(meta.get("piece_size")).unwrap_or(0),
        born: parse_u64(meta.get("born")).unwrap_or(0),
        hashes_epoch: parse_u64(meta.get("hashes_epoch"))
            .and_then(|e| u32::try_from(e).ok())
            .unwrap_or(0),
        source,
        peers,
        reports: None,
        hashes: hashes.map(|m| {
            m.into_iter()
                .filter_map(|(i, h)| Some((i, PieceHash(h.try_into().ok()?))))
                .collect()
        }),
    }
}

impl SwarmStore for RedisStore {
    fn now_ms(&self) -> u64 {
        wall_ms()
    }

    fn load<'a>(
        &'a self,
        digests: &'a [Digest],
        refresh: Refresh,
    ) -> StoreFuture<'a, Vec<Option<SharedSwarm>>> {
        Box::pin(async move {
            let now = self.now_ms();
            let due: Vec<bool> = digests
                .iter()
                .map(|d| match refresh {
                    Refresh::No => false,
                    Refresh::WhenDue => self.due(d, now),
                    Refresh::Now => {
                        self.due(d, now);
                        true
                    }
                })
                .collect();
            let mut pipe = redis::pipe();
            for (d, due) in digests.iter().zip(&due) {
                pipe.hgetall(self.key(d, "meta")).get(self.key(d, "source"));
                if *due {
                    let (cursor, hash_count) = self.members.next_read(d, now, self.full_reread_ms);
                    pipe.cmd("EVAL")
                        .arg(redis_members::READ)
                        .arg(3)
                        .arg(self.key(d, "members"))
                        .arg(self.key(d, "changes"))
                        .arg(self.key(d, "hashes"))
                        .arg(cursor)
                        .arg(hash_count)
                        .arg(redis_members::MAX_MEMBERS)
                        .arg(&self.replica);
                    pipe.hgetall(self.key(d, "reports"));
                }
            }
            let mut con = self.con.clone();
            let mut values: std::collections::VecDeque<redis::Value> = pipe
                .query_async::<Vec<redis::Value>>(&mut con)
                .await
                .map_err(self.redis_err("load"))?
                .into();
            let mut next = || values.pop_front().unwrap_or(redis::Value::Nil);
            let mut out = Vec::with_capacity(digests.len());
            for (d, due) in digests.iter().zip(due) {
                let decode = self.redis_err("decode");
                let meta: HashMap<String, String> =
                    redis::from_redis_value(next()).map_err(|e| decode(e.into()))?;
                let source: Option<String> =
                    redis::from_redis_value(next()).map_err(|e| decode(e.into()))?;
                let (peers, hashes, reports) = if due {
                    let mut read = redis_members::parse_read(next()).map_err(&decode)?;
                    let reports: HashMap<Vec<u8>, u64> =
                        redis::from_redis_value(next()).map_err(|e| decode(e.into()))?;
                    let hashes = read.hashes.take();
                    let (peers, kind) = self.members.apply(
                        d,
                        read,
                        now,
                        self.expired_before(now),
                        refresh == Refresh::Now,
                    );
                    self.metrics
                        .member_reads
                        .get_or_create(&ReadLabels {
                            kind: match kind {
                                ReadKind::Full => "full",
                                ReadKind::Changes => "changes",
                            },
                        })
                        .inc();
                    (peers, hashes, Some(decode_reports(reports)))
                } else {
                    (None, None, None)
                };
                // Redis is the truth, an empty answer included (a Redis restarted empty).
                let mut shared = shared_swarm(meta, source, peers, hashes);
                shared.reports = reports;
                out.push(Some(shared));
            }
            self.note_ping(true);
            Ok(out)
        })
    }

    fn commit<'a>(&'a self, outcomes: &'a [Outcome]) -> StoreFuture<'a, Vec<Settled>> {
        Box::pin(async move {
            let now = self.now_ms();
            let mut pipe = redis::pipe();
            // A member whose entry does not fit the format (a 64 KiB address) is not
            // shared: stored as leaving.
            let entries: Vec<Option<Vec<u8>>> = outcomes
                .iter()
                .map(|o| o.peer.as_ref().and_then(member_entry::encode))
                .collect();
            for (o, entry) in outcomes.iter().zip(&entries) {
                let d = &o.digest;
                let intent = match o.intent {
                    SourceIntent::Claim => "claim",
                    SourceIntent::Release => "release",
                    SourceIntent::Keep => "keep",
                };
                // The script text travels with every call (EVAL): Redis caches it by
                // its digest, and a Redis restarted empty needs no SCRIPT LOAD.
                let mut cmd = redis::cmd("EVAL");
                cmd.arg(COMMIT).arg(8);
                for part in [
                    "meta",
                    "members",
                    "source",
                    "hashes",
                    "elections",
                    "elected",
                    "changes",
                    "seen",
                ] {
                    cmd.arg(self.key(d, part));
                }
                cmd.arg(&o.node)
                    .arg(entry.as_deref().unwrap_or_default())
                    .arg(intent)
                    .arg(self.source_ttl_ms)
                    .arg(self.idle_ms)
                    .arg(o.size.map(|s| s.to_string()).unwrap_or_default())
                    .arg(o.piece_size)
                    .arg(o.born)
                    .arg(o.peer.as_ref().map_or(now, |p| p.last_seen))
                    .arg(self.heartbeat_ms)
                    .arg(MIN_STREAM_LEN)
                    .arg(&self.replica)
                    .arg(o.deposed.as_deref().unwrap_or_default())
                    .arg(if o.void_hashes { "1" } else { "0" });
                for (i, h) in &o.hashes {
                    cmd.arg(*i).arg(&h.0[..]);
                }
                pipe.add_command(cmd);
                if let Some(last) = o.reports.iter().map(|r| r.1).max() {
                    // Outside the script, which settles the election: a report only
                    // has to reach the replicas' next reads, and lapses on its own.
                    let key = self.key(d, "reports");
                    for (accused, until) in &o.reports {
                        pipe.hset(&key, encode_report(accused, &o.node), *until)
                            .ignore();
                    }
                    pipe.pexpire(&key, last.saturating_sub(now).max(1) as i64)
                        .ignore();
                }
                // The janitor's index of swarms (outside the script: another slot).
                pipe.zadd(
                    self.swarms_key(),
                    d.to_string(),
                    o.peer.as_ref().map_or(0, |p| p.last_seen),
                )
                .ignore();
            }
            let mut con = self.con.clone();
            let rows: Vec<(String, String, String, u32)> = pipe
                .query_async(&mut con)
                .await
                .map_err(self.redis_err("commit"))?;
            for (o, entry) in outcomes.iter().zip(&entries) {
                let stored = entry.as_ref().and(o.peer.as_ref());
                self.members.note_commit(&o.digest, &o.node, stored);
            }
            Ok(rows
                .into_iter()
                .map(|(size, piece_size, source, _elected)| Settled {
                    source: (!source.is_empty()).then_some(source),
                    size: size.parse().ok(),
                    piece_size: piece_size.parse().unwrap_or(0),
                })
                .collect())
        })
    }

    fn elections<'a>(&'a self, digests: &'a [Digest]) -> StoreFuture<'a, Option<Vec<Elections>>> {
        Box::pin(async move {
            let mut pipe = redis::pipe();
            for d in digests {
                pipe.get(self.key(d, "elections"))
                    .lrange(self.key(d, "elected"), 0, 7);
            }
            let mut con = self.con.clone();
            let values: Vec<redis::Value> = pipe
                .query_async(&mut con)
                .await
                .map_err(self.redis_err("elections"))?;
            let decode = self.redis_err("decode");
            let mut out = Vec::with_capacity(digests.len());
            for pair in values.chunks(2) {
                let [count, elected] = pair else { break };
                let count: Option<u32> =
                    redis::from_redis_value(count.clone()).map_err(|e| decode(e.into()))?;
                let elected: Vec<String> =
                    redis::from_redis_value(elected.clone()).map_err(|e| decode(e.into()))?;
                out.push(Elections {
                    count: count.unwrap_or(0),
                    elected,
                });
            }
            Ok(Some(out))
        })
    }

    fn healthy(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    fn kind(&self) -> &'static str {
        "redis"
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

    #[test]
    fn a_report_field_gives_back_both_names_whatever_they_hold() {
        let pairs = [("a:b", "c"), ("", "x"), ("node-1", "12:node"), ("ü", "")];
        let fields: HashMap<Vec<u8>, u64> = pairs
            .iter()
            .enumerate()
            .map(|(i, (a, r))| (encode_report(a, r), i as u64))
            .collect();
        let mut back: Vec<(String, String, u64)> = decode_reports(fields)
            .into_iter()
            .map(|r| (r.accused, r.reporter, r.until))
            .collect();
        back.sort_by_key(|r| r.2);
        let want: Vec<(String, String, u64)> = pairs
            .iter()
            .enumerate()
            .map(|(i, (a, r))| (a.to_string(), r.to_string(), i as u64))
            .collect();
        assert_eq!(back, want);
        // What no replica writes is skipped, not misread.
        let junk: HashMap<Vec<u8>, u64> = [
            (b"99:short".to_vec(), 1),
            (b"nolength".to_vec(), 2),
            (b"x:y".to_vec(), 3),
        ]
        .into();
        assert!(decode_reports(junk).is_empty());
    }
}
