//! The announce protocol between agents and the tracker (JSON over HTTP).

use std::collections::BTreeMap;

use oci::Digest;
use serde::{Deserialize, Serialize};

use crate::Bitfield;

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Topology {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rack: Option<String>,
}

impl Topology {
    /// 0 same rack, 1 same zone, 2 elsewhere or unknown.
    pub fn distance(&self, other: &Topology) -> u8 {
        match (&self.zone, &other.zone, &self.rack, &other.rack) {
            (Some(z1), Some(z2), Some(r1), Some(r2)) if z1 == z2 && r1 == r2 => 0,
            (Some(z1), Some(z2), _, _) if z1 == z2 => 1,
            _ => 2,
        }
    }
}

/// What an agent tells the tracker about one blob, periodically while it downloads
/// and whenever it starts, finishes or drops the blob.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AnnounceRequest {
    pub node: String,
    /// Where other agents reach this one's peer listener, `host:port`.
    pub addr: String,
    #[serde(default)]
    pub topology: Topology,
    pub digest: Digest,
    /// Known once anyone has seen the registry's response.
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub piece_size: Option<u64>,
    /// Verified pieces held.
    #[serde(default)]
    pub have: Option<Bitfield>,
    #[serde(default)]
    pub complete: bool,
    /// This agent is streaming the blob from the registry (a claim that survives a
    /// tracker restart).
    #[serde(default)]
    pub fetching_from_registry: bool,
    /// Piece hashes (hex chained sha256, `crate::chain`) this agent computed from
    /// registry bytes; the tracker keeps them only from the agent it elected source.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub hashes: BTreeMap<u32, String>,
    /// The agent already knows hashes `[0, known_hashes)`; the reply sends the rest.
    #[serde(default)]
    pub known_hashes: u32,
    /// Peers that served pieces failing verification, or that this node cannot reach;
    /// at most [`MAX_BAD_PEERS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bad_peers: Vec<String>,
    /// The agent no longer holds or wants this blob.
    #[serde(default)]
    pub leaving: bool,
    /// A downloader that cannot start before the swarm's size is known: the tracker
    /// may hold its answer until the source has announced the size, at most this many
    /// milliseconds (a tracker caps it; one that does not know the field answers at
    /// once, and the agent asks again).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub wait_for_size_ms: u32,
    /// The hashes this agent published as the elected source came from registry bytes
    /// that failed the blob's digest (a corrupted response): the tracker forgets them
    /// and starts a new hash epoch. Counts only from the elected source.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hashes_void: bool,
    /// The registry cannot answer this node now (throttled, failing, unreachable): it
    /// wants the blob only from members that hold it. It is never elected to read the
    /// registry, and a blob below the P2P threshold, which otherwise has no swarm,
    /// gets a handout of its complete holders instead of "fetch it directly".
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub registry_unavailable: bool,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

impl AnnounceRequest {
    /// An announce that says nothing yet about the blob: the agent is interested.
    pub fn new(node: &str, addr: &str, topology: &Topology, digest: &Digest) -> Self {
        Self {
            node: node.to_owned(),
            addr: addr.to_owned(),
            topology: topology.clone(),
            digest: digest.clone(),
            size: None,
            piece_size: None,
            have: None,
            complete: false,
            fetching_from_registry: false,
            hashes: BTreeMap::new(),
            known_hashes: 0,
            bad_peers: Vec::new(),
            leaving: false,
            wait_for_size_ms: 0,
            hashes_void: false,
            registry_unavailable: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Fetch from the registry (one agent per blob, or a replacement when it died),
    /// publish piece hashes, serve pieces.
    Source,
    /// Fetch pieces from the peers listed.
    Peer,
    /// Skip P2P: the blob is below the threshold; go to the registry through the cache.
    Direct,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerInfo {
    pub node: String,
    pub addr: String,
    #[serde(default)]
    pub topology: Topology,
    /// `None` means complete.
    pub have: Option<Bitfield>,
}

impl PeerInfo {
    pub fn has(&self, piece: u32) -> bool {
        self.have.as_ref().is_none_or(|b| b.get(piece))
    }
}

/// Peers one announce may report: a tracker refuses an announce naming more.
pub const MAX_BAD_PEERS: usize = 64;

/// Swarms up to this size get source stripes: ranking every member is cheap there,
/// and larger swarms have rack stripes and stall timeouts instead.
pub const SOURCE_STRIPE_MAX_MEMBERS: usize = 63;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AnnounceResponse {
    pub role: Role,
    pub size: Option<u64>,
    pub piece_size: u64,
    /// Piece hashes (hex sha256) from `known_hashes` on, as far as known.
    #[serde(default)]
    pub hashes: BTreeMap<u32, String>,
    pub peers: Vec<PeerInfo>,
    /// Whether some agent is fetching the blob from the registry right now.
    pub source_alive: bool,
    /// The agent elected to fetch from the registry: the one whose piece hashes a
    /// downloader trusts when they arrive over a peer connection (HAVE).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// When to announce again while downloading.
    pub interval_ms: u64,
    /// Rack stripe `[index, count]`: fetch from outside the rack only pieces `p` with
    /// `p % count == index` (large swarms; see `scheduler`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stripe: Option<[u32; 2]>,
    /// Source stripe `[index, count]`, while a source fetches the blob: ask the source
    /// only for pieces `p` with `p % count == index` (or once a piece has waited
    /// `source_patience_ms` there); the others come from the member whose stripe they
    /// are in. The source's uplink is what brings fresh pieces into the swarm and it
    /// fills it no faster than it downloads, so each piece should leave it once (see
    /// `scheduler`). Swarms of at most [`SOURCE_STRIPE_MAX_MEMBERS`] members.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_stripe: Option<[u32; 2]>,
    /// Members of the swarm as the tracker counts them: large swarms get bounded
    /// neighbour sets and request stall timeouts (`links`, `scheduler`). 0 from a
    /// tracker that does not say: the small-swarm rules.
    #[serde(default)]
    pub members: u32,
    /// How many times the swarm's piece hashes were voided (`hashes_void`). A
    /// downloader whose epoch moved on holds pieces checked against hashes from bad
    /// bytes: it starts over. 0 from a tracker that does not say.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hashes_epoch: u32,
}
