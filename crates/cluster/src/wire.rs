//! What crosses the wire between the cluster layer and its clients: agents' inventory
//! reports and prewarm progress in, assignments out, operators' prewarm requests. The
//! agent, the CLI and the tracker's state machine all use these types; nothing here
//! keeps state.

use std::collections::BTreeMap;

use oci::Digest;
use serde::{Deserialize, Serialize};

/// Bytes by where they came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceBytes {
    #[serde(default)]
    pub cache: u64,
    #[serde(default)]
    pub peer: u64,
    #[serde(default)]
    pub registry: u64,
}

impl SourceBytes {
    /// Bytes the registry did not have to send.
    pub fn saved(&self) -> u64 {
        self.cache.saturating_add(self.peer)
    }
    pub fn total(&self) -> u64 {
        self.saved().saturating_add(self.registry)
    }
}

/// One blob in the node's store, complete or partial.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobHolding {
    pub digest: Digest,
    pub size: u64,
    /// Equal to `size` when complete; the verified prefix length of a partial blob.
    pub bytes_held: u64,
    pub complete: bool,
}

/// A blob of an image (config or layer).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRef {
    pub digest: Digest,
    pub size: u64,
}

/// One image the node has pulled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImageRecord {
    pub manifest_digest: Digest,
    /// The multi-arch index the manifest was selected from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_digest: Option<Digest>,
    /// References it was pulled as (`docker.io/library/python:3.12`).
    #[serde(default)]
    pub references: Vec<String>,
    /// Config and layer blobs.
    #[serde(default)]
    pub blobs: Vec<BlobRef>,
    /// Unix seconds.
    #[serde(default)]
    pub last_pull: Option<u64>,
    #[serde(default)]
    pub last_use: Option<u64>,
    /// Where the bytes of the last pull came from.
    #[serde(default)]
    pub bytes_by_source: SourceBytes,
    /// Wall time of the last pull.
    #[serde(default)]
    pub pull_seconds: Option<f64>,
}

/// A pin held by the agent (never evicted until `expires_at`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    pub reference: String,
    #[serde(default)]
    pub digest: Option<Digest>,
    /// Unix seconds; none = until unpinned.
    #[serde(default)]
    pub expires_at: Option<u64>,
}

/// A download in progress on the node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Download {
    pub digest: Digest,
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// A full report from one agent. Sent periodically and on change; `generation` must
/// grow across reports and across agent restarts (start it at the agent's start time
/// in milliseconds, for example).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    pub node: String,
    pub generation: u64,
    /// Including zone / rack / pool labels (`topology.kubernetes.io/zone`, ...).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The agent's mirror URL, shown to operators. Never dialled: the tracker does not
    /// connect to agents (they collect their assignments).
    #[serde(default)]
    pub agent_url: Option<String>,
    #[serde(default)]
    pub blobs: Vec<BlobHolding>,
    #[serde(default)]
    pub images: Vec<ImageRecord>,
    #[serde(default)]
    pub pins: Vec<Pin>,
    pub cache_budget: u64,
    pub cache_used: u64,
    pub cache_free: u64,
    #[serde(default)]
    pub downloads_in_flight: Vec<Download>,
    /// Observed download throughput (bytes/s), from recent pulls.
    #[serde(default)]
    pub throughput_bytes_per_sec: Option<f64>,
}

/// Default label that names a node's pool.
pub const DEFAULT_POOL_LABEL: &str = "starling.io/pool";
/// Pin TTL when the request gives none.
pub const DEFAULT_PIN_TTL_SECONDS: u64 = 24 * 3600;
/// Longest pin: content a prewarm pins is beyond GC's reach until then, so a typo (or
/// a forged request) must not pin for decades. Agents refuse longer pins too.
pub const MAX_PIN_TTL_SECONDS: u64 = 30 * 24 * 3600;
/// Longest deadline: a prewarm is for a job about to start.
pub const MAX_DEADLINE_SECONDS: u64 = 7 * 24 * 3600;

/// Which nodes to warm: explicit `nodes`, or a population (nodes matching
/// `selector` and/or `pool`, all nodes when neither) of which `count` or
/// `percentage` are taken (all when neither).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Targets {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Label key holding the pool name (default `starling.io/pool`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percentage: Option<f64>,
}

/// `POST /api/v1/prewarm` body.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PrewarmRequest {
    pub images: Vec<String>,
    pub targets: Targets,
    /// Nodes downloading at once (default: all targets, after the seed).
    #[serde(default)]
    pub parallelism: Option<u32>,
    #[serde(default)]
    pub per_node_bytes_per_sec: Option<u64>,
    /// Split evenly over `parallelism` slots.
    #[serde(default)]
    pub total_bytes_per_sec: Option<u64>,
    /// Seconds from submission; unfinished nodes fail after it.
    #[serde(default)]
    pub deadline_seconds: Option<u64>,
    /// Seconds from submission the agents keep the content pinned (default 24 h).
    #[serde(default)]
    pub pin_ttl_seconds: Option<u64>,
    /// Higher first.
    #[serde(default)]
    pub priority: i32,
    /// Warm mutable tags anyway.
    #[serde(default)]
    pub force: bool,
    /// Tags the caller has seen moving (refused unless `force`).
    #[serde(default)]
    pub moving_tags: Vec<String>,
    /// Also pull the image into the node's containerd and label it
    /// `io.cri-containerd.pinned=pinned`, so kubelet image GC keeps it.
    #[serde(default)]
    pub into_runtime: bool,
    /// Where the agents fetch the files among `images` (each named
    /// `files.starling.invalid/file@<key>`, see [`file_reference`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<FileSource>,
}

/// The registry part of a file's reference: files (`starling get https://…`) are
/// images of one blob to the cluster layer, named only by their key. `.invalid` can
/// never be a real registry.
pub const FILE_REGISTRY: &str = "files.starling.invalid";

/// A file's image reference: `files.starling.invalid/file@<key>`.
pub fn file_reference(key: &Digest) -> String {
    format!("{FILE_REGISTRY}/file@{key}")
}

/// Longest file URL in a prewarm request (presigned URLs run to a few KiB).
pub const MAX_FILE_URL: usize = 8192;

/// A file a prewarm job warms: the agents read it from `url` (subject to their own
/// `allowed_file_origins`) and keep it under `key`, which the submitter learnt from an
/// agent (the content digest when `content_digest`, else the identity key of the URL
/// path, the origin's validator and the size). An agent that finds another key at the
/// origin (the file changed since) fails its part of the job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSource {
    pub key: Digest,
    /// The whole URL, query included (a presigned URL's signature lives there); shown
    /// to viewers without its query and credentials ([`FileSource::redacted`]).
    pub url: String,
    pub size: u64,
    /// `key` is the sha256 of the content (the whole file is verified against it).
    #[serde(default)]
    pub content_digest: bool,
}

impl FileSource {
    /// The same source with the URL's query and user info hidden: presigned
    /// signatures and credentials are bearer secrets that job views must not show.
    pub fn redacted(&self) -> FileSource {
        let url = oci::upstream::policy::redact_url(&self.url);
        FileSource {
            url,
            ..self.clone()
        }
    }
}

/// What an agent tells the tracker about its part of a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum NodeUpdate {
    Progress { bytes_done: u64 },
    Done,
    Failed { reason: String },
}

/// Assignments waiting for one node at the tracker at most (and so the most an agent
/// takes from one collection).
pub const MAX_WAITING_ASSIGNMENTS: usize = 64;

/// One instruction for a node, collected by its agent from the tracker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    pub job_id: u64,
    pub node: String,
    /// (reference, digest): fetch and pin by digest.
    pub images: Vec<(String, String)>,
    pub blobs: Vec<BlobRef>,
    pub bytes_per_sec: Option<u64>,
    pub pin_until: u64,
    pub deadline_at: Option<u64>,
    pub priority: i32,
    /// First node of a job nobody holds yet: the only one that goes to the registry.
    pub seed: bool,
    /// Pull into containerd and pin there too.
    #[serde(default)]
    pub into_runtime: bool,
    /// Where to read the files among `images` (the request's `files`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<FileSource>,
}
