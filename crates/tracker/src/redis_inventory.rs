//! `--redis`: node inventory reports shared by every replica (issue 14). A report a
//! replica takes is published (the whole report when its contents changed, a
//! heartbeat otherwise); every replica applies the others' to its own copy with the
//! same checks as an agent's.
//!
//! Keys (prefix `st:` by default):
//!
//! | key | type | what | TTL |
//! |---|---|---|---|
//! | `st:inv:nodes` | ZSET node → last report (ms) | who reported when (heartbeats) | trimmed past the node expiry |
//! | `st:inv:report:<node>` | STRING JSON `NodeReport` | the node's last full report | node expiry |
//! | `st:inv:gen:<node>` | STRING generation | so a replica fetches only new reports | node expiry |
//! | `st:inv:changes` | STREAM `n` → node | whose full report changed | `MAXLEN ~` 4 × max nodes |
//!
//! Reading back: every second, a replica reads the change stream after the id it read
//! up to and fetches those nodes' reports (pipelined); every
//! [`crate::RedisOptions::inventory_sweep`] (10 s; a node is Unknown after 60 s without
//! a heartbeat by default), and when the stream was trimmed past its id, or at
//! start) it reads the whole index: heartbeats of every node, and any report it does
//! not hold. Before, every replica read the index and all generations each second
//! and fetched changed reports one call each: at 10,000 nodes that was ≈ 10,000
//! entries per replica per second for a few hundred changes.
//!
//! Publishing: [`cluster::PublishQueue`] holds the latest report per node; the
//! publisher takes them in batches and sends each batch as two pipelines (heartbeats,
//! then full reports).

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use cluster::{ClusterState, PublishQueue, Published};
use redis::aio::ConnectionManager;
use tracing::{debug, warn};

use crate::redis_members::{lua_stream_order, StreamId};
use crate::redis_store::{wall_ms, RedisStore};

/// How often a replica reads the reports other replicas changed.
const INVENTORY_PULL_EVERY: Duration = Duration::from_secs(1);
/// Reports read again behind the newest one seen (clocks of replicas differ a little).
const INVENTORY_PULL_OVERLAP_MS: u64 = 5_000;
/// Generations and reports read per Redis pipeline.
const PULL_CHUNK: usize = 1000;
/// Reports fetched per pipeline (each up to the report limit in size).
const FETCH_CHUNK: usize = 64;
/// Reports published per batch.
const PUBLISH_BATCH: usize = 512;

/// Stores a node's full report unless the node is new and the index is full, and
/// appends the node to the change stream.
/// KEYS: report, gen, index, changes. ARGV: node, JSON, generation, TTL ms, now ms,
/// max nodes, stream length kept.
const PUBLISH_REPORT: &str = r"
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) and redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[6]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[1])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'n', ARGV[1])
return 1
";

/// A heartbeat: refreshes the node's entries if its report of that generation is
/// there; 0 when it is not (the caller publishes the whole report).
/// KEYS: report, gen, index. ARGV: node, generation, TTL ms, now ms.
const PUBLISH_HEARTBEAT: &str = r"
if redis.call('GET', KEYS[2]) ~= ARGV[2] or redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
return 1
";

/// A report if it is not longer than ARGV[1] bytes ('' otherwise). KEYS: report.
const GET_BOUNDED: &str = r"
if redis.call('STRLEN', KEYS[1]) > tonumber(ARGV[1]) then return '' end
return redis.call('GET', KEYS[1]) or ''
";

/// The nodes named in the change stream after id ARGV[1], at most ARGV[2] entries;
/// {'sweep'} when the stream cannot say (trimmed past the id, gone, or behind it).
/// KEYS: changes. Returns {'changes', last id, node...} or {'sweep'}.
const CHANGED_SINCE: &str = concat!(
    lua_stream_order!(),
    r"
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if not last[1] then
  if ARGV[1] == '0-0' then return {'changes', '0-0'} end
  return {'sweep'}
end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
if older(ARGV[1], first[1][1]) or older(last[1][1], ARGV[1]) then return {'sweep'} end
local entries = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', tonumber(ARGV[2]))
if #entries >= tonumber(ARGV[2]) then return {'sweep'} end
local out = {'changes', last[1][1]}
local seen = {}
for _, e in ipairs(entries) do
  local n = e[2][2]
  if n and not seen[n] then
    seen[n] = true
    out[#out + 1] = n
  end
end
return out
"
);

/// The id of the stream KEYS[1]'s last entry ('0-0' when it has none).
const LAST_ID: &str = r"
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if last[1] then return last[1][1] end
return '0-0'
";

/// Starts publishing what `queue` receives and reading the other replicas' reports.
pub(crate) fn spawn(store: &Arc<RedisStore>, state: &ClusterState, queue: Arc<PublishQueue>) {
    tokio::spawn(publish_reports(Arc::downgrade(store), state.clone(), queue));
    tokio::spawn(pull_reports(Arc::downgrade(store), state.clone()));
}

struct InventoryKeys {
    report: String,
    generation: String,
    index: String,
}

fn inventory_keys(store: &RedisStore, node: &str) -> InventoryKeys {
    InventoryKeys {
        report: store.prefixed(&format!("inv:report:{node}")),
        generation: store.prefixed(&format!("inv:gen:{node}")),
        index: store.prefixed("inv:nodes"),
    }
}

/// Entries the change stream keeps: four times the nodes the inventory may hold
/// (every node changing its report four times between two reads of a replica).
fn stream_len(state: &ClusterState) -> usize {
    state.config().limits.max_nodes.saturating_mul(4).max(1024)
}

async fn publish_reports(store: Weak<RedisStore>, state: ClusterState, queue: Arc<PublishQueue>) {
    loop {
        let batch = queue.take(PUBLISH_BATCH).await;
        let Some(store) = store.upgrade() else { return };
        if let Err(e) = publish_batch(&store, &state, batch).await {
            store.count_error("inventory");
            debug!(error = %e, "cannot publish inventory reports; the nodes' next reports will");
        }
    }
}

async fn publish_batch(
    store: &RedisStore,
    state: &ClusterState,
    batch: Vec<Published>,
) -> redis::RedisResult<()> {
    let limits = &state.config().limits;
    let ttl_ms = limits.node_expiry_s.saturating_mul(1000).max(1);
    let mut con = store.background_connection();
    let now = wall_ms();
    let (beats, mut full): (Vec<Published>, Vec<Published>) =
        batch.into_iter().partition(|p| p.report.is_none());
    if !beats.is_empty() {
        let mut pipe = redis::pipe();
        for p in &beats {
            let keys = inventory_keys(store, &p.node);
            pipe.cmd("EVAL")
                .arg(PUBLISH_HEARTBEAT)
                .arg(3)
                .arg(&keys.report)
                .arg(&keys.generation)
                .arg(&keys.index)
                .arg(&p.node)
                .arg(p.generation)
                .arg(ttl_ms)
                .arg(now);
        }
        let fresh: Vec<u32> = pipe.query_async(&mut con).await?;
        for (p, fresh) in beats.into_iter().zip(fresh) {
            if fresh == 1 {
                continue;
            }
            // Redis lost it (restart, eviction): the whole report from this copy.
            let held = state.inventory().entry(&p.node).map(|e| e.report.clone());
            if let Some(r) = held.filter(|r| r.generation == p.generation) {
                full.push(Published {
                    report: Some(r),
                    ..p
                });
            }
        }
    }
    let mut pipe = redis::pipe();
    let mut nodes = Vec::new();
    for p in full {
        let Some(report) = p.report else { continue };
        let Ok(json) = serde_json::to_vec(&report) else {
            continue;
        };
        let keys = inventory_keys(store, &p.node);
        pipe.cmd("EVAL")
            .arg(PUBLISH_REPORT)
            .arg(4)
            .arg(&keys.report)
            .arg(&keys.generation)
            .arg(&keys.index)
            .arg(store.prefixed("inv:changes"))
            .arg(&p.node)
            .arg(json)
            .arg(report.generation)
            .arg(ttl_ms)
            .arg(now)
            .arg(limits.max_nodes)
            .arg(stream_len(state));
        nodes.push(p.node);
    }
    if nodes.is_empty() {
        return Ok(());
    }
    let stored: Vec<u32> = pipe.query_async(&mut con).await?;
    for (node, stored) in nodes.iter().zip(stored) {
        if stored == 0 {
            warn!(%node, "shared inventory full; this node is known to this replica only");
        }
    }
    Ok(())
}

/// Where a replica is in the other replicas' reports.
#[derive(Default)]
struct PullCursor {
    /// The change stream id read up to (`None`: sweep first).
    stream: Option<StreamId>,
    /// The newest index score seen by a sweep.
    newest_ms: u64,
    swept_at: Option<Instant>,
}

/// Every second: the reports other replicas changed since the last look are applied
/// here (same checks as an agent's); every sweep interval, everyone's
/// heartbeats too, and nodes silent past the expiry leave the index.
async fn pull_reports(store: Weak<RedisStore>, state: ClusterState) {
    let mut tick = tokio::time::interval(INVENTORY_PULL_EVERY);
    let mut cursor = PullCursor::default();
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else { return };
        match pull_once(&store, &state, &mut cursor).await {
            Ok(()) => state.note_shared_inventory_read(),
            Err(e) => {
                // Start over with a sweep: what failed may have been half applied.
                cursor.stream = None;
                store.count_error("inventory");
                debug!(error = %e, "cannot read the shared inventory");
            }
        }
    }
}

async fn pull_once(
    store: &RedisStore,
    state: &ClusterState,
    cursor: &mut PullCursor,
) -> redis::RedisResult<()> {
    let mut con = store.background_connection();
    let sweep_due = cursor
        .swept_at
        .is_none_or(|t| t.elapsed() >= store.inventory_sweep());
    if let (Some(since), false) = (cursor.stream, sweep_due) {
        let reply: Vec<String> = redis::cmd("EVAL")
            .arg(CHANGED_SINCE)
            .arg(1)
            .arg(store.prefixed("inv:changes"))
            .arg(since.arg())
            .arg(stream_len(state))
            .query_async(&mut con)
            .await?;
        let mut it = reply.into_iter();
        if it.next().as_deref() == Some("changes") {
            let last = it.next().as_deref().and_then(StreamId::parse);
            let nodes: Vec<String> = it
                .filter(|n| n.len() <= cluster::inventory::MAX_NODE_NAME)
                .collect();
            fetch_reports(store, state, &mut con, &nodes, false).await?;
            store.note_inventory_read("changes");
            cursor.stream = last.map(|l| l.max(since));
            return Ok(());
        }
    }
    sweep(store, state, &mut con, cursor).await
}

/// Reads the whole index: heartbeats of every node reported recently, reports this
/// copy does not hold; places the stream cursor before it, so a change during the
/// sweep is read again next time (applying a report twice is a heartbeat).
async fn sweep(
    store: &RedisStore,
    state: &ClusterState,
    con: &mut ConnectionManager,
    cursor: &mut PullCursor,
) -> redis::RedisResult<()> {
    let limits = state.config().limits.clone();
    let last: String = redis::cmd("EVAL")
        .arg(LAST_ID)
        .arg(1)
        .arg(store.prefixed("inv:changes"))
        .query_async(con)
        .await?;
    let stream_at = StreamId::parse(&last).unwrap_or_default();
    let index = store.prefixed("inv:nodes");
    let now = wall_ms();
    let _: u64 = redis::cmd("ZREMRANGEBYSCORE")
        .arg(&index)
        .arg("-inf")
        .arg(now.saturating_sub(limits.node_expiry_s.saturating_mul(1000)))
        .query_async(con)
        .await?;
    let since = cursor
        .newest_ms
        .saturating_sub(INVENTORY_PULL_OVERLAP_MS + store.inventory_sweep().as_millis() as u64);
    let recent: Vec<(String, u64)> = redis::cmd("ZRANGEBYSCORE")
        .arg(&index)
        .arg(since)
        .arg("+inf")
        .arg("WITHSCORES")
        .arg("LIMIT")
        .arg(0)
        .arg(limits.max_nodes)
        .query_async(con)
        .await?;
    let mut newest = cursor.newest_ms;
    let nodes: Vec<String> = recent
        .into_iter()
        .inspect(|(_, at_ms)| newest = newest.max(*at_ms))
        .map(|(node, _)| node)
        .filter(|node| node.len() <= cluster::inventory::MAX_NODE_NAME)
        .collect();
    fetch_reports(store, state, con, &nodes, true).await?;
    cursor.newest_ms = newest;
    cursor.stream = Some(stream_at);
    cursor.swept_at = Some(Instant::now());
    store.note_inventory_read("sweep");
    Ok(())
}

/// Reads the generations of `nodes` and fetches (pipelined) the reports this copy
/// does not hold; with `heartbeats`, a node whose report this copy holds counts as
/// heard from.
async fn fetch_reports(
    store: &RedisStore,
    state: &ClusterState,
    con: &mut ConnectionManager,
    nodes: &[String],
    heartbeats: bool,
) -> redis::RedisResult<()> {
    let max_bytes = state.config().max_report_bytes;
    let mut wanted = Vec::new();
    for chunk in nodes.chunks(PULL_CHUNK) {
        let generations: Vec<Option<u64>> = redis::cmd("MGET")
            .arg(
                chunk
                    .iter()
                    .map(|n| inventory_keys(store, n).generation)
                    .collect::<Vec<_>>(),
            )
            .query_async(con)
            .await?;
        for (node, generation) in chunk.iter().zip(generations) {
            let Some(generation) = generation else {
                continue;
            };
            let have = state.inventory().entry(node).map(|e| e.report.generation);
            match have {
                Some(h) if h == generation => {
                    if heartbeats {
                        let _ = state.heartbeat_shared(node, generation);
                    }
                }
                Some(h) if h > generation => {}
                _ => wanted.push(node),
            }
        }
    }
    for chunk in wanted.chunks(FETCH_CHUNK) {
        let mut pipe = redis::pipe();
        for node in chunk {
            pipe.cmd("EVAL")
                .arg(GET_BOUNDED)
                .arg(1)
                .arg(inventory_keys(store, node).report)
                .arg(max_bytes);
        }
        let reports: Vec<Vec<u8>> = pipe.query_async(con).await?;
        for (node, json) in chunk.iter().zip(reports) {
            if json.is_empty() {
                continue;
            }
            match serde_json::from_slice::<cluster::NodeReport>(&json) {
                Ok(r) if r.node == **node => {
                    if let Err(e) = state.ingest_shared(r) {
                        debug!(%node, error = %e, "shared report not taken");
                    }
                }
                _ => warn!(%node, "unreadable shared inventory report; skipped"),
            }
        }
    }
    Ok(())
}
