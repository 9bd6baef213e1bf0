//! Checks for the swarm's network input: bitfields, the peer wire protocol's frames
//! (anything can connect to an agent's peer port), and announces to the tracker.

use std::collections::{BTreeSet, HashMap};

use bytes::{Buf, BytesMut};
use oci::Digest;
use swarm::pieces::{validate_geometry, PieceHash, MAX_PIECES};
use swarm::protocol::{AnnounceRequest, Role, Topology};
use swarm::wire::{
    Frame, RejectReason, MAX_CONTROL_FRAME, MAX_DATA_CHUNK, MAX_HASHES_PER_FRAME, MAX_NODE_NAME,
};
use swarm::{Bitfield, SwarmConfig, TrackerState};

use crate::Input;

// ---------------------------------------------------------------------------------
// bitfield
// ---------------------------------------------------------------------------------

/// A bitfield from raw bytes, base64 or JSON (the first byte picks which, then a piece
/// count). Invariants: at most `MAX_PIECES` pieces; the byte array is exactly the
/// pieces' bytes with zero padding; counts, prefix and comparisons agree with the bits;
/// every form round-trips.
pub fn bitfield(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let mode = input.u8() % 3;
    let len = input.number() as u32;
    let rest = input.rest();
    let parsed = match mode {
        0 => Bitfield::from_bytes(rest.to_vec(), len).ok(),
        1 => std::str::from_utf8(rest)
            .ok()
            .and_then(|s| Bitfield::from_base64(s, len).ok()),
        _ => serde_json::from_slice::<Bitfield>(rest).ok(),
    };
    let Some(b) = parsed else {
        return false;
    };
    if mode != 2 {
        assert_eq!(b.len(), len);
    }
    check_bitfield(&b);
    if mode == 0 {
        for i in 0..b.len() {
            assert_eq!(b.get(i), rest[(i / 8) as usize] & (1 << (i % 8)) != 0);
        }
    }
    true
}

fn check_bitfield(b: &Bitfield) {
    let len = b.len();
    assert!(len <= MAX_PIECES);
    let bytes = b.as_bytes();
    assert_eq!(bytes.len(), (len as usize).div_ceil(8));
    if !len.is_multiple_of(8) {
        let last = bytes[bytes.len() - 1];
        assert_eq!(last >> (len % 8), 0, "padding bits are zero");
    }
    let ones = (0..len).filter(|&i| b.get(i)).count() as u32;
    assert_eq!(b.count(), ones);
    assert_eq!(b.iter_ones().count() as u32, ones);
    assert!(!b.get(len), "nothing past the end");
    assert_eq!(b.is_complete(), ones == len);
    let prefix = (0..len).find(|&i| !b.get(i)).unwrap_or(len);
    assert_eq!(b.prefix(), prefix);
    for from in [
        0,
        len / 3,
        len / 2,
        len.saturating_sub(1),
        len,
        len.saturating_add(5),
    ] {
        let want = (from..len).find(|&i| !b.get(i)).unwrap_or(len);
        assert_eq!(b.first_missing_from(from), want);
    }
    assert_eq!(b.count_not_in(b), 0);
    assert_eq!(b.count_not_in(&Bitfield::new(len)), ones);
    assert_eq!(b.count_not_in(&Bitfield::full(len)), 0);
    assert_eq!(Bitfield::full(len).count_not_in(b), len - ones);
    assert_eq!(
        Bitfield::from_base64(&b.to_base64(), len).ok().as_ref(),
        Some(b)
    );
    assert_eq!(
        Bitfield::from_bytes(bytes.to_vec(), len).ok().as_ref(),
        Some(b)
    );
    let json = serde_json::to_string(b).unwrap_or_default();
    assert_eq!(
        serde_json::from_str::<Bitfield>(&json).ok().as_ref(),
        Some(b)
    );
}

// ---------------------------------------------------------------------------------
// frames
// ---------------------------------------------------------------------------------

/// What the decoder must enforce on any frame it returns.
fn check_frame_bounds(f: &Frame) {
    match f {
        Frame::Hello { node, addr, .. } => {
            assert!(node.len() <= MAX_NODE_NAME, "name {}", node.len());
            assert!(addr.len() <= MAX_NODE_NAME, "address {}", addr.len());
        }
        Frame::Open {
            blob_size,
            piece_size,
            ..
        } => assert!(validate_geometry(*blob_size, *piece_size).is_ok()),
        Frame::Bitfield { have, .. } => check_bitfield(have),
        Frame::Data { len, .. } => assert!((1..=MAX_DATA_CHUNK).contains(len)),
        Frame::Hashes { first, hashes, .. } => {
            assert!(hashes.len() <= MAX_HASHES_PER_FRAME);
            assert!(u64::from(*first) + hashes.len() as u64 <= u64::from(MAX_PIECES));
        }
        Frame::Goodbye { reason } => assert!(reason.len() <= 1024),
        _ => {}
    }
}

fn encode(f: &Frame) -> BytesMut {
    let mut b = BytesMut::new();
    f.encode(&mut b);
    b
}

/// `Frame::decode` on a hostile stream (what anything connecting to the peer port
/// sends). Invariants: "need more bytes" only while a frame of a bounded declared
/// length is incomplete, and then nothing is consumed; every decoded frame is within
/// the protocol's bounds, re-encodes to a frame that decodes to itself, and to the
/// very bytes it came from when those were canonical (zero bitfield padding, UTF-8
/// goodbye reason). `Data` headers are followed by their raw bytes, skipped here.
pub fn frame_decode(data: &[u8]) -> bool {
    let mut buf = BytesMut::from(data);
    let mut frames = 0;
    loop {
        let before = buf.clone();
        match Frame::decode(&mut buf) {
            Err(_) => break,
            Ok(None) => {
                assert_eq!(buf, before, "nothing consumed while waiting");
                if before.len() >= 4 {
                    let declared =
                        u32::from_be_bytes([before[0], before[1], before[2], before[3]]) as usize;
                    assert!(
                        (1..=MAX_CONTROL_FRAME).contains(&declared) && before.len() < 4 + declared,
                        "waiting for a frame of {declared} bytes with {} here",
                        before.len()
                    );
                }
                break;
            }
            Ok(Some(f)) => {
                frames += 1;
                let consumed = &before[..before.len() - buf.len()];
                check_frame_bounds(&f);
                let enc = encode(&f);
                let mut again = enc.clone();
                assert_eq!(Frame::decode(&mut again).ok().flatten().as_ref(), Some(&f));
                assert!(again.is_empty());
                match &f {
                    Frame::Bitfield { have, .. } => {
                        let mut canonical = consumed.to_vec();
                        if !have.len().is_multiple_of(8) {
                            let last = canonical.len() - 1;
                            canonical[last] &= (1u8 << (have.len() % 8)) - 1;
                        }
                        assert_eq!(&enc[..], &canonical[..]);
                    }
                    Frame::Goodbye { .. } if std::str::from_utf8(&consumed[7..]).is_err() => {}
                    _ => assert_eq!(&enc[..], consumed, "{f:?} re-encodes to its bytes"),
                }
                if let Frame::Data { len, .. } = f {
                    let skip = (len as usize).min(buf.len());
                    buf.advance(skip);
                }
            }
        }
    }
    frames > 0
}

fn build_frame(input: &mut Input) -> Frame {
    let chan = input.u32();
    match input.u8() % 17 {
        0 => Frame::Hello {
            version: input.u16(),
            node: input.string(300),
            addr: input.string(300),
            nonce: input.array(),
            proof: input.array(),
        },
        1 => Frame::Auth {
            proof: input.array(),
        },
        2 => Frame::Open {
            chan,
            digest: input.array(),
            blob_size: input.number(),
            piece_size: input.number(),
        },
        3 => Frame::Close { chan },
        4 => {
            let len = (input.number() % (u64::from(MAX_PIECES) + 16)) as u32;
            let mut have = Bitfield::new(len);
            for _ in 0..input.u8() {
                have.set(input.u32() % len.max(1));
            }
            Frame::Bitfield { chan, have }
        }
        5 => Frame::Complete { chan },
        6 => Frame::NotHeld { chan },
        7 => Frame::Have {
            chan,
            piece: input.u32(),
            hash: input.bool().then(|| PieceHash(input.array())),
        },
        8 => Frame::Request {
            chan,
            piece: input.u32(),
            urgent: input.bool(),
        },
        9 => Frame::Cancel {
            chan,
            piece: input.u32(),
        },
        10 => Frame::Reject {
            chan,
            piece: input.u32(),
            reason: [
                RejectReason::Busy,
                RejectReason::NotHeld,
                RejectReason::Invalid,
                RejectReason::Cancelled,
            ][usize::from(input.u8() % 4)],
        },
        11 => Frame::Data {
            chan,
            piece: input.u32(),
            offset: input.u32(),
            len: input.number() as u32,
        },
        12 => Frame::HashesRequest { chan },
        13 => {
            let first = input.number() as u32;
            let n = usize::from(input.u16()) % (MAX_HASHES_PER_FRAME + 100);
            Frame::Hashes {
                chan,
                first,
                hashes: (0..n).map(|_| PieceHash(input.array())).collect(),
            }
        }
        14 => Frame::Ping { nonce: input.u64() },
        15 => Frame::Pong { nonce: input.u64() },
        _ => Frame::Goodbye {
            reason: input.string(1100),
        },
    }
}

fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// What decoding an encoded frame must give: the frame itself, with names and reasons
/// cut to their bounds on a character boundary and hashes to a frame's worth; `None`
/// when the frame is outside what a peer may send (the decoder must refuse it).
fn expected(f: &Frame) -> Option<Frame> {
    let mut f = f.clone();
    match &mut f {
        Frame::Hello { node, addr, .. } => {
            *node = cut(node, MAX_NODE_NAME);
            *addr = cut(addr, MAX_NODE_NAME);
        }
        Frame::Goodbye { reason } => *reason = cut(reason, 1024),
        Frame::Open {
            blob_size,
            piece_size,
            ..
        } => validate_geometry(*blob_size, *piece_size).ok()?,
        Frame::Bitfield { have, .. } if have.len() > MAX_PIECES => return None,
        Frame::Data { len, .. } if !(1..=MAX_DATA_CHUNK).contains(len) => return None,
        Frame::Hashes { first, hashes, .. } => {
            hashes.truncate(MAX_HASHES_PER_FRAME);
            if u64::from(*first) + hashes.len() as u64 > u64::from(MAX_PIECES) {
                return None;
            }
        }
        _ => {}
    }
    Some(f)
}

/// Frames built from the input, encoded, decoded. Invariants: the length prefix is the
/// frame's length; every strict prefix of a frame is "need more bytes"; a frame
/// within the protocol's bounds decodes to itself (names and reasons cut on a
/// character boundary) and re-encodes to the same bytes; two frames back to back
/// decode one after the other; a frame outside the bounds is refused.
pub fn frame_roundtrip(data: &[u8]) -> bool {
    let mut input = Input::new(data);
    let f = build_frame(&mut input);
    let enc = encode(&f);
    let declared = u32::from_be_bytes([enc[0], enc[1], enc[2], enc[3]]) as usize;
    assert_eq!(declared, enc.len() - 4);
    let want = expected(&f);
    if want.is_some() {
        let cuts = (0..enc.len().min(12)).chain([enc.len() / 2, enc.len() - 1]);
        for n in cuts {
            let mut prefix = BytesMut::from(&enc[..n]);
            assert_eq!(
                Frame::decode(&mut prefix).ok(),
                Some(None),
                "{n} bytes of {f:?}"
            );
            assert_eq!(prefix.len(), n, "nothing consumed");
        }
    }
    let mut two = enc.clone();
    two.extend_from_slice(&enc);
    let got = Frame::decode(&mut two);
    match want {
        Some(w) => {
            assert_eq!(got.ok().flatten().as_ref(), Some(&w), "{f:?}");
            assert_eq!(two.len(), enc.len(), "exactly one frame consumed");
            assert_eq!(Frame::decode(&mut two).ok().flatten().as_ref(), Some(&w));
            assert!(two.is_empty());
            assert_eq!(
                encode(&w),
                enc,
                "the decoded frame re-encodes to the same bytes"
            );
            true
        }
        None => {
            assert!(got.is_err(), "{f:?} must be refused, got {got:?}");
            false
        }
    }
}

// ---------------------------------------------------------------------------------
// announce
// ---------------------------------------------------------------------------------

pub(crate) const BLOB: &[u8] = b"starling fuzz blob";
const MIB: u64 = 1 << 20;

fn topo(zone: &str, rack: &str) -> Topology {
    Topology {
        zone: Some(zone.into()),
        rack: Some(rack.into()),
    }
}

/// The announces a real swarm starts with (seeds of the `announce` corpus too): a
/// source reading from the registry and publishing hashes, partial peers in two racks,
/// a complete seeder, and a blob below the P2P threshold.
pub(crate) fn swarm_announces() -> Vec<AnnounceRequest> {
    let d = Digest::of(BLOB);
    let mut out = Vec::new();
    let mut src = AnnounceRequest::new("src", "10.0.0.1:5051", &topo("z1", "r1"), &d);
    src.size = Some(64 * MIB);
    src.piece_size = Some(MIB);
    src.fetching_from_registry = true;
    let mut have = Bitfield::new(64);
    for i in 0..8 {
        have.set(i);
        src.hashes
            .insert(i, PieceHash::of(&i.to_le_bytes()).to_hex());
    }
    src.have = Some(have);
    out.push(src);
    for (i, rack) in ["r1", "r1", "r2", "r2"].iter().enumerate() {
        let mut p = AnnounceRequest::new(
            &format!("gpu-{i}"),
            &format!("10.0.1.{i}:5051"),
            &topo("z1", rack),
            &d,
        );
        p.size = Some(64 * MIB);
        p.piece_size = Some(MIB);
        let mut have = Bitfield::new(64);
        for j in 0..(i as u32 * 3) {
            have.set(j);
        }
        p.have = Some(have);
        p.known_hashes = 2;
        out.push(p);
    }
    let mut seed = AnnounceRequest::new("seeder", "10.0.2.1:5051", &topo("z2", "r9"), &d);
    seed.size = Some(64 * MIB);
    seed.piece_size = Some(MIB);
    seed.complete = true;
    out.push(seed);
    let small = Digest::of(b"small blob");
    let mut s = AnnounceRequest::new("gpu-0", "10.0.1.0:5051", &topo("z1", "r1"), &small);
    s.size = Some(1000);
    out.push(s);
    out
}

pub(crate) fn tracker_config() -> SwarmConfig {
    SwarmConfig {
        max_peers: 4,
        stripe_min_members: 4,
        ..SwarmConfig::default()
    }
}

fn stats(t: &TrackerState) -> String {
    serde_json::to_string(&t.stats()).unwrap_or_default()
}

/// What the checker remembers of each (blob, node) announce.
#[derive(Clone, Copy)]
struct Seen {
    at: u64,
    gone: bool,
}

/// Announce requests (JSON, one per line) to a tracker that already knows a swarm,
/// one second apart. Invariants: a refused announce changes nothing; a node is never
/// in its own handout, nobody twice; a handout has at most `max_peers` peers; the role
/// `source` goes only to the elected source, and a new source is elected only when
/// the previous one left, completed or went silent for the TTL; hashes are taken only
/// from the elected source and are served from `known_hashes` on; a known size comes
/// with a valid geometry and every handed-out bitfield has its piece count; after
/// expiry nothing older than 10 TTLs remains.
pub fn announce(data: &[u8]) -> bool {
    let mut t = TrackerState::new(tracker_config());
    let ttl = t.cfg.peer_ttl_ms;
    let mut seen: HashMap<(Digest, String), Seen> = HashMap::new();
    let mut sources: HashMap<Digest, String> = HashMap::new();
    let mut accepted = false;
    let mut now = 0;
    let seeded = swarm_announces();
    let lines = data
        .split(|&b| b == b'\n')
        .filter_map(|l| serde_json::from_slice::<AnnounceRequest>(l).ok())
        .take(32);
    for (i, req) in seeded
        .iter()
        .cloned()
        .map(|r| (true, r))
        .chain(lines.map(|r| (false, r)))
        .enumerate()
    {
        let (from_seed, req) = req;
        now = i as u64 * 1000;
        let before = stats(&t);
        let hashes_before = t.hashes(&req.digest, 0);
        let resp = match t.announce(&req, now) {
            Ok(r) => r,
            Err(e) => {
                assert!(!from_seed, "seed announce refused: {e}");
                assert_eq!(stats(&t), before, "a refused announce changes nothing");
                assert_eq!(t.hashes(&req.digest, 0), hashes_before);
                continue;
            }
        };
        accepted |= !from_seed;
        let key = (req.digest.clone(), req.node.clone());
        seen.insert(
            key,
            Seen {
                at: now,
                gone: req.leaving || req.complete,
            },
        );
        let mut names = BTreeSet::new();
        for p in &resp.peers {
            assert_ne!(p.node, req.node, "a node is not handed itself");
            assert!(names.insert(p.node.clone()), "{} handed out twice", p.node);
        }
        assert!(resp.peers.len() <= t.cfg.max_peers.max(1));
        assert_eq!(resp.source_alive, resp.source.is_some());
        if resp.role == Role::Source {
            assert_eq!(resp.source.as_deref(), Some(req.node.as_str()));
        }
        if req.leaving || req.complete {
            assert_ne!(resp.source.as_deref(), Some(req.node.as_str()));
        }
        match (sources.get(&req.digest), &resp.source) {
            (Some(old), Some(new)) if old != new => {
                let prev = seen.get(&(req.digest.clone(), old.clone())).copied();
                assert!(
                    prev.is_none_or(|p| p.gone || now.saturating_sub(p.at) > ttl),
                    "{new} elected while {old} is still the live source"
                );
            }
            _ => {}
        }
        match &resp.source {
            Some(s) => sources.insert(req.digest.clone(), s.clone()),
            None => sources.remove(&req.digest),
        };
        let count = match resp.size {
            Some(size) => {
                assert!(
                    validate_geometry(size, resp.piece_size).is_ok(),
                    "swarm geometry {size} / {}",
                    resp.piece_size
                );
                swarm::PieceLayout::new(size, resp.piece_size).count()
            }
            None => 0,
        };
        for p in &resp.peers {
            if let Some(h) = &p.have {
                assert_eq!(h.len(), count, "{}'s bitfield", p.node);
            }
        }
        for (k, v) in &resp.hashes {
            assert!(*k >= req.known_hashes && *k < count);
            assert!(PieceHash::from_hex(v).is_ok());
        }
        let hashes_after = t.hashes(&req.digest, 0);
        if resp.source.as_deref() != Some(req.node.as_str()) {
            assert_eq!(hashes_after, hashes_before, "hashes only from the source");
        } else {
            for (k, v) in &hashes_after {
                if hashes_before.get(k) != Some(v) {
                    let sent = req.hashes.get(k).and_then(|h| PieceHash::from_hex(h).ok());
                    assert_eq!(sent.map(|h| h.to_hex()).as_ref(), Some(v));
                }
            }
        }
        if let Some([idx, n]) = resp.stripe {
            assert!(n >= 2 && idx < n);
        }
    }
    t.expire(now);
    t.expire(now + ttl * 10 + 1);
    assert!(t.stats().is_empty(), "everything expired");
    accepted
}
