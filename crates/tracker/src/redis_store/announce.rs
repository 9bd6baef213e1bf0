//! The announce path over Redis: [`SwarmStore`] for [`RedisStore`] (load, commit,
//! elections) and the [`COMMIT`] script it runs. Apart from the store's connection,
//! leases and janitor, which run beside announces rather than in them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;

use oci::Digest;
use swarm::state::{SharedPeer, SharedReport, SharedSwarm};
use swarm::PieceHash;

use super::{wall_ms, ReadLabels, RedisStore, MIN_STREAM_LEN};
use crate::member_entry;
use crate::redis_members::{self, ReadKind};
use crate::store::{Elections, Outcome, Refresh, Settled, SourceIntent, StoreFuture, SwarmStore};

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
/// hashes (they are deleted and the meta's `hashes_epoch` counts one more), '1' when
/// the source replaces the size and piece size (read from the registry, against what
/// a member said first) and '2' when a complete holder mends a small swarm's (which
/// has no source: the replica decided it), then hash pairs.
pub(super) const COMMIT: &str = r"
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
if ((cur == node and ARGV[15] == '1') or ARGV[15] == '2') and ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'size', ARGV[6], 'piece_size', ARGV[7])
  geo = {ARGV[6], ARGV[7]}
end
if cur == node and ARGV[14] == '1' then
  redis.call('DEL', KEYS[4])
  redis.call('HINCRBY', KEYS[1], 'hashes_epoch', 1)
elseif cur == node then
  for i = 16, #ARGV, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
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
                    .arg(if o.void_hashes { "1" } else { "0" })
                    .arg(match (o.regeometry, o.intent) {
                        (false, _) => "0",
                        (true, SourceIntent::Claim) => "1",
                        // A small swarm's size mended by a complete holder: a small
                        // swarm has no source whose role could vouch for it.
                        (true, _) => "2",
                    });
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
