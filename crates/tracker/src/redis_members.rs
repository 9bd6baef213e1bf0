//! `--redis`: each replica's copy of a swarm's members, kept current by reading only
//! what changed (issue 14).
//!
//! Every member change that matters is appended to the swarm's change stream
//! (`st:{d}:changes`, one entry per change naming the node, `XADD MAXLEN ~`) in the
//! same script that writes the member ([`crate::redis_store`]'s `COMMIT`, and the
//! janitor's `TRIM` for members it removes). A replica remembers the stream id it read
//! up to and, when its copy is due, reads ([`READ`], one script, atomic):
//!
//! - the entries after its id, and the current entry of each node they name (a node
//!   gone from the members hash left the swarm), except nodes whose last change this
//!   replica wrote itself (its commit put them in its copy): what others changed, not
//!   the whole swarm;
//! - everything (`HGETALL`) instead when it has no id yet (start, a swarm new to it, a
//!   copy not read for [`FORGET_AFTER_MS`]), when the stream was trimmed past its id
//!   or ends before it (Redis lost data), when the changes are more than the members,
//!   and every [`crate::RedisOptions::full_reread`] as a safety net;
//! - the piece hashes only when their count moved (they are only ever added).
//!
//! Which changes are appended: a member joining or leaving, or changing its address,
//! topology or completion, at once; a new bitfield or `last_seen` alone only when the
//! stored entry is a heartbeat old ([`heartbeat_ms`]). So at 10,000 members announcing
//! every second a replica reads a few thousand compact entries per second, not 10,000
//! JSON ones (≈ 26 MB), and a member another replica serves is never older in this
//! copy than heartbeat + announce interval + refresh, within the peer TTL.

use std::collections::{BTreeMap, HashMap};

use oci::Digest;
use parking_lot::Mutex;
use swarm::state::SharedPeer;

use crate::member_entry;

/// Lua: `older(a, b)`, whether stream id `a` comes before `b` (an id Redis did not
/// make counts as older: the caller reads everything).
macro_rules! lua_stream_order {
    () => {
        r"
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  if not am or not bm then return true end
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
"
    };
}
pub(crate) use lua_stream_order;

/// Reads swarm changes after a stream id, or everything.
///
/// KEYS: members, changes, hashes. ARGV: stream id read up to ('' = read
/// everything), the hash count the copy holds (-1 = send them), the most entries a
/// delta may have, this replica (a node whose last change this replica wrote is
/// skipped: its commit put the entry in the copy already). Returns {'changes'|'full', last id, names | flat HGETALL, values
/// (per name, nil = gone) | {}, hashes (flat HGETALL) | nil, hash count}.
pub(crate) const READ: &str = concat!(
    lua_stream_order!(),
    r"
local hlen = redis.call('HLEN', KEYS[3])
local hashes = false
if hlen ~= tonumber(ARGV[2]) then hashes = redis.call('HGETALL', KEYS[3]) end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local last_id = '0-0'
if last[1] then last_id = last[1][1] end
local cursor = ARGV[1]
if cursor ~= '' then
  local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
  if first[1] and not older(cursor, first[1][1]) and not older(last_id, cursor) then
    local limit = tonumber(ARGV[3])
    local entries = redis.call('XRANGE', KEYS[2], '(' .. cursor, '+', 'COUNT', limit)
    if #entries < limit then
      local writer, order, names = {}, {}, {}
      for _, e in ipairs(entries) do
        local n = e[2][2]
        if n then
          if writer[n] == nil then order[#order + 1] = n end
          writer[n] = e[2][4] or ''
        end
      end
      for _, n in ipairs(order) do
        if writer[n] ~= ARGV[4] then names[#names + 1] = n end
      end
      local values = {}
      for i = 1, #names, 1000 do
        local chunk = redis.call('HMGET', KEYS[1], unpack(names, i, math.min(i + 999, #names)))
        for j = 1, #chunk do values[#values + 1] = chunk[j] end
      end
      return {'changes', last_id, names, values, hashes, hlen}
    end
  end
end
return {'full', last_id, redis.call('HGETALL', KEYS[1]), {}, hashes, hlen}
"
);

/// A copy not read for this long is read whole next time: the replica's own copy of
/// the swarm may have expired meanwhile (its members were silent), and the stream may
/// have been trimmed past it.
pub(crate) const FORGET_AFTER_MS: u64 = 10_000;
/// Members kept per swarm at most (a hostile or corrupted store cannot make a replica
/// allocate without bound): far above the 10,000-node target.
pub(crate) const MAX_MEMBERS: usize = 100_000;
/// A stored member entry longer than this is skipped (a 65,536-piece bitfield is
/// 8 KiB).
pub(crate) const MAX_MEMBER_BYTES: usize = 64 * 1024;
/// Swarms whose copy is kept; beyond it the copies start over (full reads).
const MAX_COPIES: usize = 10_000;

/// How long a member's stored entry may stay unchanged in the stream's eyes while
/// only its bitfield and `last_seen` move: a third of the peer TTL (5 s by default:
/// 1.7 s). A member another replica serves is then at most heartbeat + one announce
/// interval + one refresh old in this copy (≈ 3.7 s at the defaults), inside the TTL
/// after which handouts leave it out.
pub(crate) fn heartbeat_ms(peer_ttl_ms: u64) -> u64 {
    (peer_ttl_ms / 3).max(1)
}

/// A Redis stream id (`ms-seq`), ordered as Redis orders them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct StreamId(u64, u64);

impl StreamId {
    pub fn parse(s: &str) -> Option<StreamId> {
        let (ms, seq) = s.split_once('-')?;
        Some(StreamId(ms.parse().ok()?, seq.parse().ok()?))
    }

    pub fn arg(self) -> String {
        format!("{}-{}", self.0, self.1)
    }
}

/// What one [`READ`] brought.
pub(crate) struct SwarmRead {
    last_id: StreamId,
    members: MemberRead,
    /// Piece hashes (index → 32 bytes), when their count moved.
    pub hashes: Option<HashMap<u32, Vec<u8>>>,
    hash_count: i64,
}

enum MemberRead {
    /// Every member (node → stored entry).
    Full(HashMap<String, Vec<u8>>),
    /// The nodes named by the changes, with their entry now (`None`: gone).
    Changes(Vec<(String, Option<Vec<u8>>)>),
}

fn parsing(e: impl std::fmt::Display) -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Parse, "member read", e.to_string()))
}

/// The reply of [`READ`]; an answer of another shape is an error.
pub(crate) fn parse_read(v: redis::Value) -> Result<SwarmRead, redis::RedisError> {
    let redis::Value::Array(parts) = v else {
        return Err(parsing("not an array"));
    };
    let [kind, last_id, members, values, hashes, hash_count]: [redis::Value; 6] =
        parts.try_into().map_err(|_| parsing("not 6 parts"))?;
    let kind: String = redis::from_redis_value(kind).map_err(parsing)?;
    let last_id: String = redis::from_redis_value(last_id).map_err(parsing)?;
    let last_id = StreamId::parse(&last_id).ok_or_else(|| parsing("stream id"))?;
    let members = match kind.as_str() {
        "full" => MemberRead::Full(redis::from_redis_value(members).map_err(parsing)?),
        "changes" => {
            let names: Vec<String> = redis::from_redis_value(members).map_err(parsing)?;
            let values: Vec<Option<Vec<u8>>> = redis::from_redis_value(values).map_err(parsing)?;
            if names.len() != values.len() {
                return Err(parsing("names and values differ in number"));
            }
            MemberRead::Changes(names.into_iter().zip(values).collect())
        }
        _ => return Err(parsing("unknown kind")),
    };
    Ok(SwarmRead {
        last_id,
        members,
        hashes: redis::from_redis_value(hashes).map_err(parsing)?,
        hash_count: redis::from_redis_value(hash_count).map_err(parsing)?,
    })
}

/// One swarm's copy.
struct SwarmCopy {
    /// The stream id the members are current up to.
    cursor: StreamId,
    members: BTreeMap<String, SharedPeer>,
    /// The hash count the copy holds (-1: none read yet).
    hash_count: i64,
    read_at: u64,
    full_at: u64,
}

/// Every swarm's copy on this replica.
#[derive(Default)]
pub(crate) struct MemberCopies {
    copies: Mutex<HashMap<Digest, SwarmCopy>>,
}

/// What a read did to a copy, for the `redis_member_reads` metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadKind {
    Full,
    Changes,
}

impl MemberCopies {
    /// The [`READ`] arguments for swarm `d`: the stream id ('' = everything) and the
    /// hash count held.
    pub fn next_read(&self, d: &Digest, now: u64, full_every_ms: u64) -> (String, i64) {
        let copies = self.copies.lock();
        match copies.get(d) {
            Some(c)
                if now.saturating_sub(c.read_at) < FORGET_AFTER_MS
                    && now.saturating_sub(c.full_at) < full_every_ms =>
            {
                (c.cursor.arg(), c.hash_count)
            }
            _ => (String::new(), -1),
        }
    }

    /// Applies a read of swarm `d` to its copy. Returns the members the replica
    /// should adopt (all of them; `None` when nothing changed and `always` is false)
    /// and what kind of read it was. Members silent since `expired_before` are
    /// dropped (the janitor removes them from Redis at the same age).
    pub fn apply(
        &self,
        d: &Digest,
        read: SwarmRead,
        now: u64,
        expired_before: u64,
        always: bool,
    ) -> (Option<BTreeMap<String, SharedPeer>>, ReadKind) {
        let mut copies = self.copies.lock();
        if copies.len() >= MAX_COPIES && !copies.contains_key(d) {
            copies.retain(|_, c| now.saturating_sub(c.read_at) < FORGET_AFTER_MS);
            if copies.len() >= MAX_COPIES {
                copies.clear();
            }
        }
        let copy = copies.entry(d.clone()).or_insert_with(|| SwarmCopy {
            cursor: StreamId::default(),
            members: BTreeMap::new(),
            hash_count: -1,
            read_at: 0,
            full_at: 0,
        });
        let kind = match &read.members {
            MemberRead::Full(_) => ReadKind::Full,
            MemberRead::Changes(_) => ReadKind::Changes,
        };
        // Two reads of one swarm answered out of order: the older one is not applied.
        if read.last_id < copy.cursor && kind == ReadKind::Changes {
            return (always.then(|| copy.members.clone()), kind);
        }
        let mut changed = false;
        match read.members {
            MemberRead::Full(all) => {
                copy.members = all
                    .into_iter()
                    .filter(|(_, v)| v.len() <= MAX_MEMBER_BYTES)
                    .filter_map(|(n, v)| Some((n, member_entry::decode(&v)?)))
                    .take(MAX_MEMBERS)
                    .collect();
                copy.full_at = now;
                changed = true;
            }
            MemberRead::Changes(changes) => {
                for (node, entry) in changes {
                    let member = entry
                        .filter(|v| v.len() <= MAX_MEMBER_BYTES)
                        .and_then(|v| member_entry::decode(&v));
                    match member {
                        Some(m) => {
                            if copy.members.len() < MAX_MEMBERS || copy.members.contains_key(&node)
                            {
                                copy.members.insert(node, m);
                            }
                        }
                        None => {
                            copy.members.remove(&node);
                        }
                    }
                    changed = true;
                }
            }
        }
        let before = copy.members.len();
        copy.members.retain(|_, m| m.last_seen >= expired_before);
        changed |= copy.members.len() != before;
        copy.cursor = match kind {
            // Redis is the truth, also when its stream went back (it lost data).
            ReadKind::Full => read.last_id,
            ReadKind::Changes => copy.cursor.max(read.last_id),
        };
        if read.hashes.is_some() {
            copy.hash_count = read.hash_count;
        }
        copy.read_at = now;
        ((changed || always).then(|| copy.members.clone()), kind)
    }

    /// What this replica itself just stored for `node` of swarm `d` (`None`: it
    /// left): the copy is never older than this replica's own announces, also when
    /// the stored change was not appended to the stream (a heartbeat not due yet).
    pub fn note_commit(&self, d: &Digest, node: &str, peer: Option<&SharedPeer>) {
        let mut copies = self.copies.lock();
        let Some(copy) = copies.get_mut(d) else {
            return;
        };
        match peer {
            Some(p) => {
                if copy.members.len() < MAX_MEMBERS || copy.members.contains_key(node) {
                    copy.members.insert(node.to_owned(), p.clone());
                }
            }
            None => {
                copy.members.remove(node);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids_order_as_redis_orders_them() {
        let id = |s| StreamId::parse(s).expect("an id");
        assert!(id("1700000000000-5") < id("1700000000001-0"));
        assert!(id("99-10") > id("99-9"), "numerically, not as text");
        assert_eq!(id("5-1").arg(), "5-1");
        assert_eq!(StreamId::parse("5"), None);
        assert_eq!(StreamId::parse("x-1"), None);
    }

    #[test]
    fn the_heartbeat_leaves_room_inside_the_peer_ttl() {
        // Heartbeat + announce interval (1 s) + refresh (1 s) within the 5 s TTL.
        assert!(heartbeat_ms(5_000) + 2_000 < 5_000);
        assert_eq!(heartbeat_ms(0), 1);
    }
}
