//! The simulated agents: how each one's bitfields fill, when it becomes source and
//! publishes hashes, and the bodies it sends. Apart from the load loop, which only
//! decides when each request goes out and times the answer.

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Deserialize;
use swarm::{AnnounceRequest, Bitfield, Topology};

use super::Plan;

/// What the client tracks of an answer: the interval, the role and the hashes' keys.
#[derive(Deserialize)]
pub(super) struct LeanAnswer {
    role: swarm::Role,
    size: Option<u64>,
    piece_size: u64,
    pub(super) interval_ms: u64,
    #[serde(default)]
    hashes: BTreeMap<u32, serde::de::IgnoredAny>,
}

pub(super) struct BlobSim {
    pub(super) req: AnnounceRequest,
    /// Pieces this agent gains, in order: `(offset + k * stride) % count`.
    offset: u32,
    stride: u32,
    /// Progress at the start, as a fraction of the pieces.
    start_fraction: f64,
    gained: u32,
    source: bool,
    /// As source: hashes published so far. The source reads the registry in order, so
    /// its hashes go out as `[0, n)`, as many per announce as it gained pieces.
    hashes_sent: u32,
    /// Which of the plan's blobs.
    index: usize,
}

pub(super) struct AgentSim {
    pub(super) name: String,
    pub(super) blobs: Vec<BlobSim>,
    pub(super) generation: u64,
    /// Seeding batches sent: the small entries go in every
    /// `agent::SMALL_SEEDING_EVERY`th, as the agent sends them.
    pub(super) seedings: u64,
}

fn fake_hash(piece: u32) -> String {
    format!("{piece:064x}")
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A cheap per-agent pseudo-random number (splitmix64): the bench needs spread, not
/// quality, and must not draw from a shared generator in the hot path.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

pub(super) fn make_agent(i: usize, plan: &Plan) -> AgentSim {
    let name = format!("bench-node-{i:05}");
    let topology = Topology {
        zone: Some(format!("zone-{}", i % 4)),
        rack: Some(format!("rack-{}", i % 64)),
    };
    let addr = format!("10.{}.{}.{}:5051", (i >> 16) & 255, (i >> 8) & 255, i & 255);
    let blobs = plan
        .blob_digests
        .iter()
        .enumerate()
        .map(|(b, d)| {
            let r = mix((i as u64) << 8 | b as u64);
            let mut req = AnnounceRequest::new(&name, &addr, &topology, d);
            req.size = Some(plan.blob_size);
            req.piece_size = Some(plan.piece_size);
            BlobSim {
                req,
                offset: (r >> 32) as u32,
                stride: 1 + (r as u32 % 997),
                start_fraction: (r % 900) as f64 / 1000.0,
                gained: 0,
                source: false,
                hashes_sent: 0,
                index: b,
            }
        })
        .collect();
    AgentSim {
        name,
        blobs,
        generation: 1,
        seedings: 0,
    }
}

/// Sets the bits this agent holds by now; the source's new pieces become hashes.
pub(super) fn advance(blob: &mut BlobSim, plan: &Plan, now: Instant) {
    let Some(have) = blob.req.have.as_mut() else {
        return;
    };
    let count = have.len();
    if count == 0 {
        return;
    }
    let elapsed = now.duration_since(plan.started).as_secs_f64() / plan.fill.as_secs_f64();
    let target = (((blob.start_fraction + elapsed).min(1.0)) * count as f64) as u32;
    let mut stride = blob.stride % count.max(1);
    while stride == 0 || gcd(stride, count) != 1 {
        stride += 1;
    }
    blob.req.hashes.clear();
    while blob.gained < target {
        let piece =
            ((blob.offset as u64 + blob.gained as u64 * stride as u64) % count as u64) as u32;
        have.set(piece);
        if blob.source && blob.hashes_sent < count {
            blob.req
                .hashes
                .insert(blob.hashes_sent, fake_hash(blob.hashes_sent));
            blob.hashes_sent += 1;
            if let Some(p) = plan.published.get(blob.index) {
                p.fetch_max(blob.hashes_sent, std::sync::atomic::Ordering::Relaxed);
            }
        }
        blob.gained += 1;
    }
    if plan.hashes_from_peers && !blob.source {
        if let Some(p) = plan.published.get(blob.index) {
            let published = p.load(std::sync::atomic::Ordering::Relaxed);
            blob.req.known_hashes = blob.req.known_hashes.max(published);
        }
    }
    blob.req.complete = have.is_complete();
    blob.req.fetching_from_registry = blob.source && !blob.req.complete;
}

pub(super) fn report_body(agent: &AgentSim, plan: &Plan) -> cluster::wire::NodeReport {
    use cluster::wire::{BlobHolding, Download, NodeReport};
    let held = |b: &BlobSim| {
        b.req.have.as_ref().map_or(0, |h| {
            let layout = swarm::PieceLayout::new(plan.blob_size, plan.piece_size);
            (0..layout.count())
                .filter(|&i| h.get(i))
                .map(|i| layout.len(i))
                .sum::<u64>()
        })
    };
    NodeReport {
        node: agent.name.clone(),
        generation: agent.generation,
        labels: BTreeMap::from([("gpu".into(), "h100".into())]),
        agent_url: None,
        blobs: agent
            .blobs
            .iter()
            .map(|b| BlobHolding {
                digest: b.req.digest.clone(),
                size: plan.blob_size,
                bytes_held: held(b),
                complete: b.req.complete,
            })
            .collect(),
        images: Vec::new(),
        pins: Vec::new(),
        cache_budget: 4 << 40,
        cache_used: 1 << 40,
        cache_free: 3 << 40,
        downloads_in_flight: agent
            .blobs
            .iter()
            .filter(|b| !b.req.complete)
            .map(|b| Download {
                digest: b.req.digest.clone(),
                bytes_done: held(b),
                bytes_total: plan.blob_size,
            })
            .collect(),
        throughput_bytes_per_sec: Some(1.0e9),
    }
}

/// The first answer fixes the swarm's geometry (the bitfield length); the source role
/// makes this agent publish hashes; known hashes advance past the contiguous ones.
pub(super) fn on_answer(blob: &mut BlobSim, ans: &LeanAnswer) {
    if blob.req.have.is_none() {
        if let Some(size) = ans.size.filter(|_| ans.piece_size > 0) {
            let count = swarm::PieceLayout::new(size, ans.piece_size).count();
            blob.req.have = Some(Bitfield::new(count));
        }
    }
    blob.source = ans.role == swarm::Role::Source;
    while ans.hashes.contains_key(&blob.req.known_hashes) {
        blob.req.known_hashes += 1;
    }
}
