//! `--redis`: the cluster layer's state in Redis, shared by every replica (issue 14):
//! node inventory, prewarm jobs with their per-node state, and the mailboxes where
//! assignments wait for their nodes. The decisions stay the cluster crate's
//! (`cluster::JobStore`, `cluster::Inventory`), on each replica's copy; this module
//! only keeps the copies one state.
//!
//! Keys (prefix `st:` by default):
//!
//! | key | type | what | TTL |
//! |---|---|---|---|
//! | `st:inv:…` | | node inventory: see [`crate::redis_inventory`] | |
//! | `st:prewarm:jobs` | HASH id → JSON job header (the job without its nodes) | jobs | none (persisted) |
//! | `st:prewarm:version` | counter | bumped by every header change | none |
//! | `st:prewarm:lock` | STRING replica | one header change or planner step at a time (`SET NX PX`) | 5 s |
//! | `st:prewarm:nodes:<id>` | HASH node → JSON state | each target node's state | none (persisted) |
//! | `st:prewarm:revisions:<id>` | ZSET node → revision | when each node was last written | none |
//! | `st:prewarm:revision` | counter | node revisions, one counter for every job | none |
//! | `st:prewarm:touched` | ZSET id → newest node revision | which jobs' nodes changed since a revision | none |
//! | `st:mbox:<node>`, `st:mbox:nodes` | LIST, SET | assignments waiting for collection | 2 min |
//! | `st:lease:prewarm` | STRING replica | the one replica planning (`RedisStore::lead_fenced`) | 5 s |
//! | `st:lease:prewarm:epoch` | counter | bumped when a replica takes the lease: the planner's writes carry it and are refused once it moved | none |
//!
//! Every size read back is bounded (node count, report bytes, jobs, mailbox entries):
//! Redis is trusted no more than an agent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::prewarm::MAX_SHARED_NODE_BYTES;
use cluster::wire::Assignment;
use cluster::{
    Begun, ClusterShare, ClusterState, NodeRecord, NodeWrite, NodesPulled, PublishQueue,
    ShareFuture,
};
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::redis_store::{wall_ms, RedisStore};

/// How long the job lock lasts when its holder dies mid-change.
const JOB_LOCK_TTL: Duration = Duration::from_secs(5);
/// How long a change waits for the job lock before it gets 503.
const JOB_LOCK_WAIT: Duration = Duration::from_secs(3);
/// The prewarm planner's lease: another replica plans after this much silence.
pub const PREWARM_LEASE: Duration = Duration::from_secs(5);
/// A mailbox key lives this long without a post (uncollected entries fail after 30 s).
const MAILBOX_TTL_MS: u64 = 120_000;
/// Nodes with waiting assignments read at most per expiry round.
const MAX_MAILBOXES: usize = 100_000;
/// A stored assignment longer than this is dropped when read.
const MAX_ASSIGNMENT_BYTES: usize = 4 << 20;
/// Node states read per Redis call.
const NODES_PAGE: usize = 2000;
/// Node states read of one job per pull at most (a job targets at most the
/// inventory's nodes, 20,000 by default): a hostile store cannot make a replica loop.
const MAX_JOB_NODES: usize = 200_000;

fn shared_err(what: &str) -> impl Fn(redis::RedisError) -> cluster::Error + '_ {
    move |e| cluster::Error::Shared(format!("redis {what}: {e}"))
}

/// Writes the changed job headers and releases the lock, only while the caller holds
/// it and (with a fence, ARGV[2] not 0) while the planner epoch is still the fence.
/// KEYS: lock, jobs, version, epoch. ARGV: lock token, fence, then id/JSON pairs.
/// Returns the version, -1 when the lock was lost (expired and taken), -2 when a newer
/// planner leads: nothing is written then.
const COMMIT_JOBS: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if ARGV[2] ~= '0' and redis.call('GET', KEYS[4]) ~= ARGV[2] then
  redis.call('DEL', KEYS[1])
  return -2
end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
local v
if #ARGV > 2 then v = redis.call('INCR', KEYS[3]) else v = tonumber(redis.call('GET', KEYS[3]) or '0') end
redis.call('DEL', KEYS[1])
return v
";

/// What a fenced write answers when a newer planner leads.
const FENCED: &str = "a newer prewarm planner holds the lease; this step's writes are refused";

/// Returns the version and, when it differs from ARGV[1] (or ARGV[1] is 0), every job
/// (at most ARGV[2] of them; more is an error). KEYS: jobs, version.
const READ_JOBS: &str = r"
local v = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) == v and v ~= 0 then return {v} end
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[2]) then return redis.error_reply('too many prewarm jobs') end
local out = redis.call('HVALS', KEYS[1])
table.insert(out, 1, v)
return out
";

/// Writes node states of one job, each only if its revision is still the one named
/// (0: the node is new); with a fence (ARGV[2] not 0), nothing unless the planner epoch
/// is still the fence (an error). KEYS: states, revisions, counter, touched, epoch.
/// ARGV: job id, fence, then (node, expected revision, JSON) triples. Returns per
/// triple the new revision, or -1.
const WRITE_NODES: &str = r"
if ARGV[2] ~= '0' and redis.call('GET', KEYS[5]) ~= ARGV[2] then
  return redis.error_reply('FENCED')
end
local out = {}
local newest = nil
for i = 3, #ARGV, 3 do
  local have = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[i]) or '0')
  if have ~= tonumber(ARGV[i + 1]) then
    table.insert(out, -1)
  else
    local rev = redis.call('INCR', KEYS[3])
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
    redis.call('ZADD', KEYS[2], rev, ARGV[i])
    newest = rev
    table.insert(out, rev)
  end
end
if newest then redis.call('ZADD', KEYS[4], newest, ARGV[1]) end
return out
";

/// The node counter and the jobs whose nodes were written after ARGV[1] (all of them
/// when the counter is below it: the data was lost), at most ARGV[2].
/// KEYS: counter, touched. Returns {counter, reset (0/1), id...}.
const TOUCHED_SINCE: &str = r"
local c = tonumber(redis.call('GET', KEYS[1]) or '0')
local since = ARGV[1]
local reset = 0
if c < tonumber(since) then since = '0'; reset = 1 end
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. since, '+inf', 'LIMIT', 0, tonumber(ARGV[2]))
table.insert(ids, 1, reset)
table.insert(ids, 1, c)
return ids
";

/// Node states of one job written after revision ARGV[1], oldest first, at most
/// ARGV[2]; a state longer than ARGV[3] bytes comes back empty.
/// KEYS: states, revisions. Returns {node, revision, JSON, ...}.
const READ_NODES: &str = r"
local entries = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for i = 1, #entries, 2 do
  local v = ''
  if redis.call('HSTRLEN', KEYS[1], entries[i]) <= tonumber(ARGV[3]) then
    v = redis.call('HGET', KEYS[1], entries[i]) or ''
  end
  table.insert(out, entries[i])
  table.insert(out, entries[i + 1])
  table.insert(out, v)
end
return out
";

/// One node's revision and state ({} when absent; the state empty when longer than
/// ARGV[2]). KEYS: states, revisions. ARGV: node, max bytes.
const READ_NODE: &str = r"
local rev = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not rev then return {} end
local v = ''
if redis.call('HSTRLEN', KEYS[1], ARGV[1]) <= tonumber(ARGV[2]) then
  v = redis.call('HGET', KEYS[1], ARGV[1]) or ''
end
return {rev, v}
";

/// Queues an assignment unless the node has ARGV[2] waiting (0) or, with a fence
/// (ARGV[5] not 0), a newer planner leads (2). KEYS: mailbox, index, epoch.
/// ARGV: entry JSON, max, TTL ms, node, fence.
const POST: &str = r"
if ARGV[5] ~= '0' and redis.call('GET', KEYS[3]) ~= ARGV[5] then return 2 end
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
";

/// Takes everything waiting (at most ARGV[1] entries). KEYS: mailbox, index. ARGV: max, node.
const COLLECT: &str = r"
local out = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
return out
";

/// Removes entries posted before ARGV[1] (ms) and returns them. KEYS: mailbox, index.
/// ARGV: cutoff, node.
const EXPIRE_POSTS: &str = r"
local gone = {}
for _, e in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local ok, v = pcall(cjson.decode, e)
  if not ok or type(v) ~= 'table' or (tonumber(v.posted_ms) or 0) < tonumber(ARGV[1]) then
    redis.call('LREM', KEYS[1], 1, e)
    table.insert(gone, e)
  end
end
if redis.call('LLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], ARGV[2]) end
return gone
";

impl ClusterShare for RedisStore {
    fn begin(&self, version: u64) -> ShareFuture<'_, Begun> {
        Box::pin(async move {
            let mut con = self.connection();
            let lock_key = self.prefixed("prewarm:lock");
            let token = format!("{}-{}", self.replica(), wall_ms());
            let give_up = Instant::now() + JOB_LOCK_WAIT;
            loop {
                let took: Option<String> = redis::cmd("SET")
                    .arg(&lock_key)
                    .arg(&token)
                    .arg("NX")
                    .arg("PX")
                    .arg(JOB_LOCK_TTL.as_millis() as u64)
                    .query_async(&mut con)
                    .await
                    .map_err(|e| {
                        self.count_error("jobs");
                        shared_err("job lock")(e)
                    })?;
                if took.is_some() {
                    break;
                }
                if Instant::now() >= give_up {
                    return Err(cluster::Error::Shared(
                        "another replica holds the prewarm job lock; retry".into(),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            match read_jobs(self, &mut con, version).await {
                Ok((jobs, version)) => Ok(Begun {
                    lock: token,
                    jobs,
                    version,
                }),
                Err(e) => {
                    let _ = release(self, &mut con, &token).await;
                    Err(e)
                }
            }
        })
    }

    fn commit(
        &self,
        lock: String,
        fence: Option<u64>,
        changed: Vec<(u64, Vec<u8>)>,
    ) -> ShareFuture<'_, u64> {
        Box::pin(async move {
            let mut con = self.connection();
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(COMMIT_JOBS)
                .arg(4)
                .arg(self.prefixed("prewarm:lock"))
                .arg(self.prefixed("prewarm:jobs"))
                .arg(self.prefixed("prewarm:version"))
                .arg(self.prefixed(PLANNER_EPOCH))
                .arg(&lock)
                .arg(fence.unwrap_or(0));
            for (id, json) in &changed {
                cmd.arg(id).arg(json.as_slice());
            }
            let v: i64 = cmd.query_async(&mut con).await.map_err(|e| {
                self.count_error("jobs");
                shared_err("job commit")(e)
            })?;
            match v {
                -2 => Err(cluster::Error::Shared(FENCED.into())),
                v => u64::try_from(v).map_err(|_| {
                    cluster::Error::Shared(
                        "the prewarm job lock expired before the change was written; retry".into(),
                    )
                }),
            }
        })
    }

    fn read(&self, version: u64) -> ShareFuture<'_, (Option<Vec<Vec<u8>>>, u64)> {
        Box::pin(async move { read_jobs(self, &mut self.connection(), version).await })
    }

    fn pull_nodes(&self, since: u64, fresh: Vec<u64>) -> ShareFuture<'_, NodesPulled> {
        Box::pin(async move {
            pull_nodes(self, since, fresh).await.map_err(|e| {
                self.count_error("jobs");
                shared_err("job node read")(e)
            })
        })
    }

    fn read_node(&self, job: u64, node: String) -> ShareFuture<'_, Option<NodeRecord>> {
        Box::pin(async move {
            let keys = job_node_keys(self, job);
            let reply: Vec<Vec<u8>> = redis::cmd("EVAL")
                .arg(READ_NODE)
                .arg(2)
                .arg(&keys.states)
                .arg(&keys.revisions)
                .arg(&node)
                .arg(MAX_SHARED_NODE_BYTES)
                .query_async(&mut self.connection())
                .await
                .map_err(|e| {
                    self.count_error("jobs");
                    shared_err("job node read")(e)
                })?;
            let mut it = reply.into_iter();
            let (Some(revision), Some(json)) = (it.next(), it.next()) else {
                return Ok(None);
            };
            Ok(Some(NodeRecord {
                job,
                node,
                revision: parse_revision(&revision)?,
                json,
            }))
        })
    }

    fn write_nodes(
        &self,
        job: u64,
        fence: Option<u64>,
        writes: Vec<NodeWrite>,
    ) -> ShareFuture<'_, Vec<Option<u64>>> {
        Box::pin(async move {
            let keys = job_node_keys(self, job);
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(WRITE_NODES)
                .arg(5)
                .arg(&keys.states)
                .arg(&keys.revisions)
                .arg(self.prefixed("prewarm:revision"))
                .arg(self.prefixed("prewarm:touched"))
                .arg(self.prefixed(PLANNER_EPOCH))
                .arg(job)
                .arg(fence.unwrap_or(0));
            for w in &writes {
                cmd.arg(&w.node).arg(w.expect).arg(w.json.as_slice());
            }
            let revisions: Vec<i64> =
                cmd.query_async(&mut self.connection()).await.map_err(|e| {
                    if e.code() == Some("FENCED") {
                        return cluster::Error::Shared(FENCED.into());
                    }
                    self.count_error("jobs");
                    shared_err("job node write")(e)
                })?;
            Ok(revisions
                .into_iter()
                .map(|r| u64::try_from(r).ok())
                .collect())
        })
    }
}

/// The keys of one job's node states.
struct JobNodeKeys {
    states: String,
    revisions: String,
}

fn job_node_keys(store: &RedisStore, job: u64) -> JobNodeKeys {
    JobNodeKeys {
        states: store.prefixed(&format!("prewarm:nodes:{job}")),
        revisions: store.prefixed(&format!("prewarm:revisions:{job}")),
    }
}

/// A revision as a sorted set's score (an integer written by `WRITE_NODES`).
fn parse_revision(raw: &[u8]) -> cluster::Result<u64> {
    std::str::from_utf8(raw)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|f| f.is_finite() && *f >= 0.0)
        .map(|f| f as u64)
        .ok_or_else(|| cluster::Error::Shared("a prewarm node revision is not a number".into()))
}

/// Node states written after `since` (of every job whose nodes moved), and all nodes
/// of `fresh` jobs, in pages.
async fn pull_nodes(
    store: &RedisStore,
    since: u64,
    fresh: Vec<u64>,
) -> redis::RedisResult<NodesPulled> {
    let mut con = store.connection();
    let head: Vec<u64> = redis::cmd("EVAL")
        .arg(TOUCHED_SINCE)
        .arg(2)
        .arg(store.prefixed("prewarm:revision"))
        .arg(store.prefixed("prewarm:touched"))
        .arg(since)
        .arg(cluster::prewarm::MAX_SHARED_JOBS)
        .query_async(&mut con)
        .await?;
    let mut it = head.into_iter();
    let revision = it.next().unwrap_or(0);
    let reset = it.next() == Some(1);
    let since = if reset { 0 } else { since };
    // Fresh jobs from their first node; touched ones after `since`.
    let mut jobs: std::collections::BTreeMap<u64, u64> =
        fresh.into_iter().map(|id| (id, 0)).collect();
    for id in it {
        jobs.entry(id).or_insert(since);
    }
    let mut out = NodesPulled {
        nodes: Vec::new(),
        revision,
        reset,
    };
    for (job, from) in jobs {
        let keys = job_node_keys(store, job);
        let (mut after, mut read) = (from, 0usize);
        loop {
            let page: Vec<Vec<u8>> = redis::cmd("EVAL")
                .arg(READ_NODES)
                .arg(2)
                .arg(&keys.states)
                .arg(&keys.revisions)
                .arg(after)
                .arg(NODES_PAGE)
                .arg(MAX_SHARED_NODE_BYTES)
                .query_async(&mut con)
                .await?;
            let entries = page.len() / 3;
            let mut it = page.into_iter();
            while let (Some(node), Some(rev), Some(json)) = (it.next(), it.next(), it.next()) {
                let Ok(rev) = parse_revision(&rev) else {
                    continue;
                };
                after = after.max(rev);
                let Ok(node) = String::from_utf8(node) else {
                    continue;
                };
                if json.is_empty() || node.len() > cluster::inventory::MAX_NODE_NAME {
                    warn!(job, %node, "unreadable or oversized shared prewarm node state; skipped");
                    continue;
                }
                out.nodes.push(NodeRecord {
                    job,
                    node,
                    revision: rev,
                    json,
                });
            }
            read += entries;
            if entries < NODES_PAGE || read >= MAX_JOB_NODES {
                break;
            }
        }
    }
    Ok(out)
}

async fn read_jobs(
    store: &RedisStore,
    con: &mut ConnectionManager,
    version: u64,
) -> cluster::Result<(Option<Vec<Vec<u8>>>, u64)> {
    let reply: Vec<redis::Value> = redis::cmd("EVAL")
        .arg(READ_JOBS)
        .arg(2)
        .arg(store.prefixed("prewarm:jobs"))
        .arg(store.prefixed("prewarm:version"))
        .arg(version)
        .arg(cluster::prewarm::MAX_SHARED_JOBS)
        .query_async(con)
        .await
        .map_err(|e| {
            store.count_error("jobs");
            shared_err("job read")(e)
        })?;
    let mut it = reply.into_iter();
    let v: u64 = it
        .next()
        .and_then(|v| redis::from_redis_value(v).ok())
        .unwrap_or(0);
    if v == version && v != 0 {
        return Ok((None, v));
    }
    let jobs = it
        .filter_map(|v| redis::from_redis_value::<Vec<u8>>(v).ok())
        .collect();
    Ok((Some(jobs), v))
}

async fn release(
    store: &RedisStore,
    con: &mut ConnectionManager,
    token: &str,
) -> redis::RedisResult<()> {
    let _: i64 = redis::cmd("EVAL")
        .arg("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0")
        .arg(1)
        .arg(store.prefixed("prewarm:lock"))
        .arg(token)
        .query_async(con)
        .await?;
    Ok(())
}

/// Shares `state`'s jobs and inventory with the other replicas through `store`:
/// job changes under its lock, reports taken here published, the others' applied here.
pub fn share_cluster(store: &Arc<RedisStore>, state: &ClusterState) {
    let queue = Arc::new(PublishQueue::new(state.config().limits.max_nodes));
    state.share_with(store.clone(), queue.clone());
    crate::redis_inventory::spawn(store, state, queue);
}

/// What posting an assignment did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PostOutcome {
    Queued,
    /// The node has [`crate::assignments::MAILBOX_MAX`] waiting.
    Full,
    /// A newer planner leads (the fence did not match): nothing was posted.
    Fenced,
}

/// An assignment as it waits in a Redis mailbox.
#[derive(Serialize, Deserialize)]
struct Posted {
    posted_ms: u64,
    assignment: Assignment,
}

/// Queues `a` in its node's mailbox, unless it is full or (with a `fence`) a newer
/// planner leads.
pub(crate) async fn post(
    store: &RedisStore,
    a: &Assignment,
    max: usize,
    fence: Option<u64>,
) -> redis::RedisResult<PostOutcome> {
    let entry = serde_json::to_vec(&Posted {
        posted_ms: wall_ms(),
        assignment: a.clone(),
    })
    .map_err(|e| redis::RedisError::from(std::io::Error::other(e)))?;
    let outcome: u32 = redis::cmd("EVAL")
        .arg(POST)
        .arg(3)
        .arg(store.prefixed(&format!("mbox:{}", a.node)))
        .arg(store.prefixed("mbox:nodes"))
        .arg(store.prefixed(PLANNER_EPOCH))
        .arg(entry)
        .arg(max)
        .arg(MAILBOX_TTL_MS)
        .arg(&a.node)
        .arg(fence.unwrap_or(0))
        .query_async(&mut store.connection())
        .await?;
    Ok(match outcome {
        1 => PostOutcome::Queued,
        2 => PostOutcome::Fenced,
        _ => PostOutcome::Full,
    })
}

fn decode_posted(entries: Vec<Vec<u8>>) -> Vec<Assignment> {
    entries
        .into_iter()
        .filter(|e| e.len() <= MAX_ASSIGNMENT_BYTES)
        .filter_map(|e| serde_json::from_slice::<Posted>(&e).ok())
        .map(|p| p.assignment)
        .collect()
}

/// Takes everything waiting for `node` (at most `max`).
pub(crate) async fn collect(
    store: &RedisStore,
    node: &str,
    max: usize,
) -> redis::RedisResult<Vec<Assignment>> {
    let entries: Vec<Vec<u8>> = redis::cmd("EVAL")
        .arg(COLLECT)
        .arg(2)
        .arg(store.prefixed(&format!("mbox:{node}")))
        .arg(store.prefixed("mbox:nodes"))
        .arg(max)
        .arg(node)
        .query_async(&mut store.connection())
        .await?;
    Ok(decode_posted(entries))
}

/// Removes and returns assignments posted more than `within` ago, in every mailbox.
pub(crate) async fn expire(
    store: &RedisStore,
    within: Duration,
) -> redis::RedisResult<Vec<Assignment>> {
    let mut con = store.connection();
    let index = store.prefixed("mbox:nodes");
    let count: usize = redis::cmd("SCARD")
        .arg(&index)
        .query_async(&mut con)
        .await?;
    if count > MAX_MAILBOXES {
        warn!(
            count,
            "more shared mailboxes than nodes can have; leaving them to their TTL"
        );
        return Ok(Vec::new());
    }
    let nodes: Vec<String> = redis::cmd("SMEMBERS")
        .arg(&index)
        .query_async(&mut con)
        .await?;
    let cutoff = wall_ms().saturating_sub(within.as_millis() as u64);
    let mut gone = Vec::new();
    for node in nodes {
        let entries: Vec<Vec<u8>> = redis::cmd("EVAL")
            .arg(EXPIRE_POSTS)
            .arg(2)
            .arg(store.prefixed(&format!("mbox:{node}")))
            .arg(&index)
            .arg(cutoff)
            .arg(&node)
            .query_async(&mut con)
            .await?;
        gone.extend(decode_posted(entries));
    }
    Ok(gone)
}

/// The planner lease's epoch key (`RedisStore::lead_fenced` of `prewarm`): bumped by
/// every replica that takes the lease, so a planner's writes name their term.
const PLANNER_EPOCH: &str = "lease:prewarm:epoch";

/// This replica's planner epoch while it holds the `prewarm` lease (`None`: another
/// replica plans, or Redis cannot be reached); logs changes.
pub(crate) async fn leads_prewarm(store: &RedisStore, was: Option<u64>) -> Option<u64> {
    let epoch = store
        .lead_fenced("prewarm", PREWARM_LEASE)
        .await
        .unwrap_or(None);
    store.note_prewarm_leader(epoch.is_some());
    if epoch != was {
        match epoch {
            Some(e) => info!(epoch = e, "prewarm planner lease taken"),
            None => info!("prewarm planner lease lost"),
        }
    }
    epoch
}
