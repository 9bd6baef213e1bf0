//! The scenario file (TOML): cluster, registry, cache, Starling settings, image, job and
//! strategies. Sizes are bytes or strings (`"5GB"`, `"512MiB"`); bandwidths are bytes/s
//! or strings (`"200Mbit/s"`, `"50MiB/s"`, `"10Gbit/s"`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer};

use crate::Error;

/// A byte count.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bytes(pub u64);
/// Bytes per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate(pub f64);

#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    Int(u64),
    Float(f64),
    Str(String),
}

/// Parses `"5GB"`, `"512MiB"`, `"4096"` (the project's one size parser).
pub fn parse_bytes(s: &str) -> Result<u64, oci::Error> {
    oci::size::parse_size(s)
}

/// Parses `"200Mbit/s"`, `"10Gbps"`, `"50MiB/s"`, `"1.25GB/s"` into bytes/s (the
/// project's one rate parser).
pub fn parse_rate(s: &str) -> Result<f64, oci::Error> {
    oci::size::parse_rate(s)
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match NumOrStr::deserialize(d)? {
            NumOrStr::Int(n) => Ok(Bytes(n)),
            NumOrStr::Float(f) if f >= 0.0 => Ok(Bytes(f as u64)),
            NumOrStr::Float(f) => Err(serde::de::Error::custom(format!("negative size {f}"))),
            NumOrStr::Str(s) => parse_bytes(&s).map(Bytes).map_err(serde::de::Error::custom),
        }
    }
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match NumOrStr::deserialize(d)? {
            NumOrStr::Int(n) => Ok(Rate(n as f64)),
            NumOrStr::Float(f) => Ok(Rate(f)),
            NumOrStr::Str(s) => parse_rate(&s).map(Rate).map_err(serde::de::Error::custom),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub cluster: Cluster,
    pub registry: Registry,
    #[serde(default)]
    pub cache: Cache,
    #[serde(default, rename = "starling")]
    starling_raw: Option<StarlingPartial>,
    #[serde(skip)]
    pub starling: Starling,
    /// Things in the file that were accepted but have no effect (old keys).
    #[serde(skip)]
    pub warnings: Vec<String>,
    pub image: Image,
    pub job: Job,
    #[serde(default)]
    pub sim: SimCfg,
    #[serde(rename = "strategy")]
    pub strategies: Vec<StrategySpec>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// Nodes in the cluster (the job runs on `job.nodes` of them); default `job.nodes`.
    #[serde(default)]
    pub nodes: Option<usize>,
    /// 0: no topology (every pair of nodes is "far", no rack links modelled).
    #[serde(default)]
    pub nodes_per_rack: usize,
    #[serde(default)]
    pub racks_per_zone: usize,
    /// Each rack's uplink, per direction (oversubscribed: below the sum of its NICs).
    #[serde(default)]
    pub rack_uplink: Option<Rate>,
    #[serde(default)]
    pub zone_uplink: Option<Rate>,
    pub nic_up: Rate,
    pub nic_down: Rate,
    #[serde(default)]
    pub disk_write: Option<Rate>,
    /// All nodes share one machine (a single-host benchmark): every transfer crosses
    /// this resource (the host's CPU, memory and disk bandwidth for moving bytes).
    #[serde(default)]
    pub shared_host: Option<Rate>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registry {
    pub egress: Rate,
    #[serde(default)]
    pub per_connection: Option<Rate>,
    #[serde(default)]
    pub latency_ms: f64,
    /// Each registry request (manifest, blob, source stream) takes `latency_ms` plus a
    /// deterministic pseudo-random share of this. Which agent announces a blob first,
    /// and so becomes its source, is decided by such jitter when nodes start together.
    #[serde(default)]
    pub latency_jitter_ms: f64,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cache {
    pub egress: Rate,
    #[serde(default)]
    pub latency_ms: f64,
}

impl Default for Cache {
    fn default() -> Self {
        Self {
            egress: Rate(10e9 / 8.0),
            latency_ms: 1.0,
        }
    }
}

/// Starling's settings. Every default is the agent's, read from the `swarm` crate
/// (`SwarmConfig`, `SchedulerConfig`, `UploadConfig` and the constants beside them),
/// so the simulator follows the agent when its defaults move.
#[derive(Clone, Debug)]
pub struct Starling {
    pub upload_limit: Option<Rate>,
    pub download_limit: Option<Rate>,
    /// The piece size of the agents and the tracker (`starling demo --piece-size`);
    /// `None` ("auto", the default): the first announcer proposes one by the agent's
    /// rule, `swarm::pieces::piece_size_for(blob, link)`, with the link the tighter of
    /// the two limits, or the NIC rate when neither is set; a swarm started by seeding
    /// heartbeats (which propose none) gets the tracker's rule for an unknown link.
    pub piece_size: Option<Bytes>,
    /// The tracker's `interval_ms` (how often a downloading agent announces).
    pub announce_interval_ms: u64,
    pub peer_ttl_ms: u64,
    pub max_peers: usize,
    pub min_p2p_size: Bytes,
    /// Swarms of at least this many members get rack stripes.
    pub stripe_min_members: usize,
    /// The scheduler's per-peer window: at least `min_window` requests, enough for
    /// `window_ms` at the measured rate, at most `max_window`.
    pub min_window: u32,
    pub max_window: u32,
    pub window_ms: u64,
    pub max_inflight_total: u32,
    /// Rack stripes: how long a piece seen only outside the rack waits for the member
    /// whose stripe it is in.
    pub patience_ms: u64,
    /// ... in swarms of more than `swarm::scheduler::LARGE_SWARM_MEMBERS`.
    pub large_patience_ms: u64,
    /// ... in swarms of more than `swarm::scheduler::HUGE_SWARM_MEMBERS`.
    pub huge_patience_ms: u64,
    /// One-way delay of a frame between two agents (request, HAVE, bitfield, reject,
    /// cancel); a new connection costs three (TCP and the HELLO/AUTH exchange).
    pub peer_latency_ms: f64,
    /// Round trip of an announce or a hash fetch to the tracker.
    pub tracker_rtt_ms: f64,
    /// A blob request from the pull client reaches the agent's swarm code (and its
    /// first announce the tracker) after a pseudo-random share of this, fixed per
    /// (node, blob, `sim.seed`): the scheduling noise of a busy host. The first
    /// announcer of a blob becomes its source, so this decides how the sourcing is
    /// shared when nodes start together (see swarm16.toml for the measured value).
    pub request_jitter_ms: f64,
    /// Pieces a holder sends at once (`UploadQueue`'s `max_active`).
    pub max_uploads: u32,
    /// Slots beyond those for urgent requests (`UploadConfig::urgent_extra`).
    pub urgent_upload_slots: u32,
    /// Requests one connection may have waiting in a holder's line; beyond, "busy".
    pub upload_queue: u32,
    /// Requests a holder keeps waiting over all connections; beyond, "busy".
    pub upload_queue_total: u32,
    /// The agent-wide `RequestBudget` (read heads aside).
    pub max_piece_requests: u32,
    /// Registry connections a source may use for one blob.
    pub registry_streams: u32,
    /// How often an agent re-announces the complete blobs it holds (the agent's
    /// `/swarm/v1/seeding` loop: every second).
    pub seed_heartbeat_ms: u64,
    /// How far a holder's writes can run ahead of the reader: the socket buffers
    /// between them. The upload slot is held until a piece's last byte is written into
    /// the socket (serve.rs), so with pieces larger than this it is held for all but
    /// its last `socket_buffer` bytes. Default 4 MiB, Linux's `net.ipv4.tcp_wmem`
    /// maximum; on loopback with a reader paced at 8 MiB/s, `sendall` of a 4–16 MiB
    /// body returned when 2.7–4 MiB of it were still unread (BENCHMARKS.md, issue 6).
    pub socket_buffer: Bytes,
    /// The agent's layer prefetch (`prefetch_layers`, on by default): when it serves
    /// the manifest, every layer of at least `min_p2p_size` starts after
    /// `prefetch_grace_ms`, beside the pull client's own `layer_concurrency` fetches.
    /// The model then has the client's later requests for those layers join them
    /// (they take no client slot), so only the small blobs wait for the client's turns.
    pub prefetch_layers: bool,
    pub prefetch_grace_ms: u64,
}

impl Default for Starling {
    fn default() -> Self {
        let s = swarm::SwarmConfig::default();
        let p = swarm::scheduler::SchedulerConfig::default();
        let u = swarm::upload::UploadConfig::default();
        Self {
            upload_limit: None,
            download_limit: None,
            piece_size: s.piece_size.map(Bytes),
            announce_interval_ms: s.announce_interval_ms,
            peer_ttl_ms: s.peer_ttl_ms,
            max_peers: s.max_peers,
            min_p2p_size: Bytes(s.min_p2p_size),
            stripe_min_members: s.stripe_min_members,
            min_window: p.min_window,
            max_window: p.max_window,
            window_ms: p.window_ms,
            max_inflight_total: p.max_inflight_total,
            patience_ms: p.patience_ms,
            large_patience_ms: p.large_patience_ms,
            huge_patience_ms: p.huge_patience_ms,
            peer_latency_ms: 0.25,
            tracker_rtt_ms: 2.0,
            request_jitter_ms: 0.0,
            max_uploads: u.max_active as u32,
            urgent_upload_slots: u.urgent_extra as u32,
            upload_queue: u.max_queued_per_conn as u32,
            upload_queue_total: u.max_queued_total as u32,
            max_piece_requests: swarm::upload::DEFAULT_REQUEST_BUDGET,
            registry_streams: swarm::pieces::DEFAULT_REGISTRY_STREAMS,
            seed_heartbeat_ms: 1000,
            socket_buffer: Bytes(4 << 20),
            prefetch_layers: true,
            prefetch_grace_ms: swarm::prefetch::DEFAULT_PREFETCH_GRACE_MS,
        }
    }
}

/// Keys of the old protocol's model (one HTTP request per piece, 503s, a timed wait
/// line, a read-head request lane): accepted so old scenario files still load, and
/// reported as ignored.
const OLD_KEYS: [&str; 2] = ["upload_wait_ms", "head_requests"];

impl Starling {
    fn fill(partial: StarlingPartial, warnings: &mut Vec<String>) -> Self {
        let d = Self::default();
        for (k, set) in OLD_KEYS.iter().zip([
            partial.upload_wait_ms.is_some(),
            partial.head_requests.is_some(),
        ]) {
            if set {
                warnings.push(format!(
                    "starling.{k} is ignored: it modelled the old peer protocol (the agent now queues every request and has no read-head lane)"
                ));
            }
        }
        Self {
            upload_limit: partial.upload_limit,
            download_limit: partial.download_limit,
            piece_size: match partial.piece_size {
                Some(PieceSize::Auto) => None,
                Some(PieceSize::Fixed(b)) => Some(b),
                None => d.piece_size,
            },
            announce_interval_ms: partial
                .announce_interval_ms
                .unwrap_or(d.announce_interval_ms),
            peer_ttl_ms: partial.peer_ttl_ms.unwrap_or(d.peer_ttl_ms),
            max_peers: partial.max_peers.unwrap_or(d.max_peers),
            min_p2p_size: partial.min_p2p_size.unwrap_or(d.min_p2p_size),
            stripe_min_members: partial.stripe_min_members.unwrap_or(d.stripe_min_members),
            min_window: partial
                .min_window
                .or(partial.max_inflight_per_peer)
                .unwrap_or(d.min_window),
            max_window: partial.max_window.unwrap_or(d.max_window),
            window_ms: partial.window_ms.unwrap_or(d.window_ms),
            max_inflight_total: partial.max_inflight_total.unwrap_or(d.max_inflight_total),
            patience_ms: partial.patience_ms.unwrap_or(d.patience_ms),
            large_patience_ms: partial.large_patience_ms.unwrap_or(d.large_patience_ms),
            huge_patience_ms: partial.huge_patience_ms.unwrap_or(d.huge_patience_ms),
            peer_latency_ms: partial.peer_latency_ms.unwrap_or(d.peer_latency_ms),
            tracker_rtt_ms: partial.tracker_rtt_ms.unwrap_or(d.tracker_rtt_ms),
            request_jitter_ms: partial.request_jitter_ms.unwrap_or(d.request_jitter_ms),
            max_uploads: partial.max_uploads.unwrap_or(d.max_uploads),
            urgent_upload_slots: partial.urgent_upload_slots.unwrap_or(d.urgent_upload_slots),
            upload_queue: partial.upload_queue.unwrap_or(d.upload_queue),
            upload_queue_total: partial.upload_queue_total.unwrap_or(d.upload_queue_total),
            max_piece_requests: partial.max_piece_requests.unwrap_or(d.max_piece_requests),
            registry_streams: partial.registry_streams.unwrap_or(d.registry_streams),
            seed_heartbeat_ms: partial.seed_heartbeat_ms.unwrap_or(d.seed_heartbeat_ms),
            socket_buffer: partial.socket_buffer.unwrap_or(d.socket_buffer),
            prefetch_layers: partial.prefetch_layers.unwrap_or(d.prefetch_layers),
            prefetch_grace_ms: partial.prefetch_grace_ms.unwrap_or(d.prefetch_grace_ms),
        }
    }
}

/// `piece_size = "auto"` or a size.
#[derive(Clone, Copy, Debug)]
enum PieceSize {
    Auto,
    Fixed(Bytes),
}

impl<'de> Deserialize<'de> for PieceSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match NumOrStr::deserialize(d)? {
            NumOrStr::Str(s) if s.trim() == "auto" => Ok(PieceSize::Auto),
            NumOrStr::Str(s) => parse_bytes(&s)
                .map(|b| PieceSize::Fixed(Bytes(b)))
                .map_err(serde::de::Error::custom),
            NumOrStr::Int(n) => Ok(PieceSize::Fixed(Bytes(n))),
            NumOrStr::Float(f) => Ok(PieceSize::Fixed(Bytes(f as u64))),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StarlingPartial {
    upload_limit: Option<Rate>,
    download_limit: Option<Rate>,
    piece_size: Option<PieceSize>,
    announce_interval_ms: Option<u64>,
    peer_ttl_ms: Option<u64>,
    max_peers: Option<usize>,
    min_p2p_size: Option<Bytes>,
    stripe_min_members: Option<usize>,
    min_window: Option<u32>,
    /// The old name of `min_window`.
    max_inflight_per_peer: Option<u32>,
    max_window: Option<u32>,
    window_ms: Option<u64>,
    max_inflight_total: Option<u32>,
    patience_ms: Option<u64>,
    large_patience_ms: Option<u64>,
    huge_patience_ms: Option<u64>,
    peer_latency_ms: Option<f64>,
    tracker_rtt_ms: Option<f64>,
    request_jitter_ms: Option<f64>,
    max_uploads: Option<u32>,
    urgent_upload_slots: Option<u32>,
    upload_queue: Option<u32>,
    upload_queue_total: Option<u32>,
    max_piece_requests: Option<u32>,
    registry_streams: Option<u32>,
    seed_heartbeat_ms: Option<u64>,
    socket_buffer: Option<Bytes>,
    prefetch_layers: Option<bool>,
    prefetch_grace_ms: Option<u64>,
    upload_wait_ms: Option<f64>,
    head_requests: Option<u32>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    pub name: String,
    pub size: Bytes,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Image {
    #[serde(default)]
    pub layers: Vec<Layer>,
    /// An OCI image layout directory (relative to the scenario file); its layers'
    /// sizes are read from the manifest.
    #[serde(default)]
    pub oci_layout: Option<PathBuf>,
    /// Tag (`org.opencontainers.image.ref.name`) or digest in the layout; default: the
    /// first manifest.
    #[serde(default)]
    pub reference: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Job {
    pub nodes: usize,
    /// Node arrivals spread uniformly over this many seconds (0: all at once).
    #[serde(default)]
    pub arrival_spread_s: f64,
    /// Added to every node's time-to-ready (container start once the image is there).
    #[serde(default)]
    pub start_overhead_s: f64,
    /// Layers a node pulls at once (containerd's `max_concurrent_downloads`, 3).
    #[serde(default = "three")]
    pub layer_concurrency: usize,
    /// Extra job sizes for the time-vs-nodes chart.
    #[serde(default)]
    pub sweep_nodes: Vec<usize>,
}

fn three() -> usize {
    3
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimCfg {
    /// 0: exact event-driven. >0: rates are recomputed at most once per quantum (flows
    /// finishing inside a quantum complete at their exact time, but the capacity they
    /// free is reassigned at the quantum's end).
    #[serde(default)]
    pub quantum_ms: f64,
    #[serde(default)]
    pub seed: u64,
    /// Safety stop (simulated seconds).
    #[serde(default)]
    pub max_seconds: Option<f64>,
    /// Stop when no transfer has completed for this long (default 300 s): the nodes
    /// still waiting are reported as never ready.
    #[serde(default)]
    pub stall_seconds: Option<f64>,
    /// Record every piece a holder begins to send (`Outcome::uploads`).
    #[serde(default)]
    pub trace: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Every node pulls every layer from the registry.
    Direct,
    /// A shared pull-through cache fetches each blob once; nodes read from it.
    SharedCache,
    /// Starling's swarm: one source per blob, pieces between agents.
    P2p,
    /// P2P after `prewarm_fraction` of the job's nodes already hold the image.
    P2pPrewarm,
    /// The job scheduler places the job on nodes holding the image first
    /// (`cached_fraction` of the cluster holds it); the rest pull with `transport`.
    Locality,
    /// Every node holds the previous version: only `changed_layers` move (`transport`).
    CodeUpdate,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    Direct,
    SharedCache,
    P2p,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StrategySpec {
    #[serde(default)]
    pub name: Option<String>,
    pub kind: Kind,
    #[serde(default)]
    pub transport: Option<Transport>,
    #[serde(default)]
    pub prewarm_fraction: f64,
    #[serde(default)]
    pub cached_fraction: f64,
    #[serde(default)]
    pub changed_layers: Option<Vec<String>>,
}

impl StrategySpec {
    pub fn label(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| format!("{:?}", self.kind).to_lowercase())
    }

    pub fn transport(&self) -> Transport {
        match self.kind {
            Kind::Direct => Transport::Direct,
            Kind::SharedCache => Transport::SharedCache,
            Kind::P2p | Kind::P2pPrewarm => Transport::P2p,
            Kind::Locality | Kind::CodeUpdate => self.transport.unwrap_or(Transport::P2p),
        }
    }
}

impl Scenario {
    pub fn parse(text: &str, base_dir: &Path) -> Result<Self, Error> {
        let mut s: Scenario = toml::from_str(text).map_err(|e| Error::Scenario(e.to_string()))?;
        let raw = s.starling_raw.take().unwrap_or_default();
        s.starling = Starling::fill(raw, &mut s.warnings);
        // A new transfer gets bandwidth only at a quantum's end: a quantum near the
        // requesters' stall timeout makes waiting requests look stalled (at 10,000
        // nodes a 250 ms quantum turned 8 M requests into stall cancels).
        let stall = swarm::scheduler::SchedulerConfig::default().stall_ms as f64;
        if s.sim.quantum_ms * 2.0 > stall {
            s.warnings.push(format!(
                "sim.quantum_ms = {} is more than half the agents' stall timeout ({stall} ms, swarms of {}+ members): requests will look stalled; use {} or less",
                s.sim.quantum_ms,
                swarm::scheduler::STALL_MIN_MEMBERS,
                stall / 4.0
            ));
        }
        if let Some(dir) = s.image.oci_layout.clone() {
            let dir = if dir.is_absolute() {
                dir
            } else {
                base_dir.join(dir)
            };
            if !s.image.layers.is_empty() {
                return Err(Error::Scenario(
                    "image: give either `layers` or `oci_layout`, not both".into(),
                ));
            }
            s.image.layers =
                crate::model::layers_from_oci_layout(&dir, s.image.reference.as_deref())?;
        }
        s.validate()?;
        Ok(s)
    }

    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        Self::parse(&text, path.parent().unwrap_or(Path::new("."))).map_err(|e| match e {
            Error::Scenario(m) => Error::Scenario(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    pub fn validate(&self) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Scenario(m));
        if self.job.nodes == 0 {
            return bad("job.nodes must be at least 1".into());
        }
        let cluster = self.cluster_nodes();
        if cluster < self.job.nodes {
            return bad(format!(
                "cluster.nodes ({cluster}) is smaller than job.nodes ({})",
                self.job.nodes
            ));
        }
        if self.image.layers.is_empty() {
            return bad(
                "image: no layers (give `layers = [{ name, size }]` or `oci_layout`)".into(),
            );
        }
        for (i, l) in self.image.layers.iter().enumerate() {
            if l.size.0 == 0 {
                return bad(format!("image.layers[{i}] ({}): size must be > 0", l.name));
            }
            if self.image.layers[..i].iter().any(|o| o.name == l.name) {
                return bad(format!("image.layers: duplicate layer name `{}`", l.name));
            }
        }
        let rates = [
            ("cluster.nic_up", Some(self.cluster.nic_up)),
            ("cluster.nic_down", Some(self.cluster.nic_down)),
            ("cluster.disk_write", self.cluster.disk_write),
            ("cluster.rack_uplink", self.cluster.rack_uplink),
            ("cluster.zone_uplink", self.cluster.zone_uplink),
            ("cluster.shared_host", self.cluster.shared_host),
            ("registry.egress", Some(self.registry.egress)),
            ("registry.per_connection", self.registry.per_connection),
            ("cache.egress", Some(self.cache.egress)),
            ("starling.upload_limit", self.starling.upload_limit),
            ("starling.download_limit", self.starling.download_limit),
        ];
        for (name, r) in rates {
            if let Some(Rate(v)) = r {
                if !(v.is_finite() && v > 0.0) {
                    return bad(format!("{name} must be a positive rate, got {v}"));
                }
            }
        }
        if let Some(p) = self.starling.piece_size {
            if !(swarm::pieces::MIN_PIECE_SIZE..=swarm::pieces::MAX_PIECE_SIZE).contains(&p.0)
                || !p.0.is_power_of_two()
            {
                return bad(format!(
                    "starling.piece_size {} must be \"auto\" or a power of two between 64KiB and 256MiB (the agent refuses other geometries)",
                    p.0
                ));
            }
        }
        let st = &self.starling;
        if st.announce_interval_ms == 0
            || st.max_inflight_total == 0
            || st.min_window == 0
            || st.max_uploads == 0
            || st.upload_queue == 0
            || st.max_piece_requests == 0
            || st.registry_streams == 0
            || st.seed_heartbeat_ms == 0
        {
            return bad("starling: announce_interval_ms, min_window, max_inflight_total, max_uploads, upload_queue, max_piece_requests, registry_streams and seed_heartbeat_ms must be > 0".into());
        }
        if !(st.peer_latency_ms >= 0.0 && st.tracker_rtt_ms >= 0.0 && st.request_jitter_ms >= 0.0) {
            return bad(
                "starling: peer_latency_ms, tracker_rtt_ms and request_jitter_ms must be ≥ 0"
                    .into(),
            );
        }
        if self.job.layer_concurrency == 0 {
            return bad("job.layer_concurrency must be at least 1".into());
        }
        if self.strategies.is_empty() {
            return bad("no [[strategy]] given".into());
        }
        for s in &self.strategies {
            let l = s.label();
            if !(0.0..=1.0).contains(&s.prewarm_fraction)
                || !(0.0..=1.0).contains(&s.cached_fraction)
            {
                return bad(format!("strategy `{l}`: fractions must be within [0, 1]"));
            }
            if s.kind == Kind::CodeUpdate && s.changed_layers.is_none() {
                return bad(format!(
                    "strategy `{l}`: code_update needs `changed_layers = [...]` (layer names)"
                ));
            }
            for c in s.changed_layers.iter().flatten() {
                if !self.image.layers.iter().any(|x| &x.name == c) {
                    let names: Vec<&str> =
                        self.image.layers.iter().map(|x| x.name.as_str()).collect();
                    return bad(format!(
                        "strategy `{l}`: changed layer `{c}` is not in the image (layers: {})",
                        names.join(", ")
                    ));
                }
            }
            if s.kind == Kind::Locality && cluster == self.job.nodes && s.cached_fraction < 1.0 {
                // Allowed, but locality has nothing to choose from.
            }
        }
        if self.cluster.racks_per_zone > 0 && self.cluster.nodes_per_rack == 0 {
            return bad("cluster.racks_per_zone needs cluster.nodes_per_rack".into());
        }
        Ok(())
    }

    pub fn cluster_nodes(&self) -> usize {
        self.cluster.nodes.unwrap_or(self.job.nodes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse_bytes("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_bytes("4MiB").unwrap(), 4 << 20);
        assert_eq!(parse_rate("200Mbit/s").unwrap(), 25e6);
        assert_eq!(parse_rate("10Gbps").unwrap(), 1.25e9);
        assert_eq!(parse_rate("50MiB/s").unwrap(), 50.0 * 1048576.0);
        assert!(parse_rate("5 furlongs/s").is_err());
    }
}
