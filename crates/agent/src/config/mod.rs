//! Agent configuration: every setting once, in the `agent_settings!` table below (TOML
//! key, type, default, help, flag, environment variable). [`load`] layers a TOML file,
//! environment variables and flags over the defaults and says where a bad value came
//! from; [`AgentConfig::validate`] checks the whole.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use oci::size::{ByteSize, SizeOrAuto};
use serde::{Deserialize, Serialize};

mod load;
pub mod settings;

pub use load::{load, CliValue, RegistryCliValue, RegistryField};
use settings::agent_settings;
pub use settings::{How, Setting, Source, Sources};

agent_settings! {
    /// Address the mirror listens on (what containerd's hosts.toml points at).
    listen: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 5050)),
        Value("--listen", "STARLING_LISTEN");
    /// Cache directory: blobs, partial downloads and the metadata database (the
    /// default needs root).
    cache_dir: PathBuf = PathBuf::from("/var/lib/starling"),
        Value("--cache-dir", "STARLING_CACHE_DIR");
    /// Cache budget, e.g. 200GiB. GC keeps usage between the watermarks below it.
    cache_budget: ByteSize = ByteSize(100 << 30),
        Value("--cache-budget", "STARLING_CACHE_BUDGET");
    /// Fraction of the cache budget at which GC starts evicting.
    gc_high_watermark: f64 = 0.90,
        Value("--gc-high-watermark", "STARLING_GC_HIGH_WATERMARK");
    /// Fraction of the cache budget GC evicts down to.
    gc_low_watermark: f64 = 0.80,
        Value("--gc-low-watermark", "STARLING_GC_LOW_WATERMARK");
    /// Space always left free on the cache filesystem, e.g. 1GiB.
    min_free: ByteSize = ByteSize(1 << 30),
        Value("--min-free", "STARLING_MIN_FREE");
    /// Allocate every blob's disk blocks when its download starts, whatever its size
    /// (see --preallocate-from). Costs small blobs a wait on the filesystem's journal
    /// before their first byte when many start at once.
    preallocate: bool = false,
        Switch("--preallocate", "STARLING_PREALLOCATE");
    /// Blobs at least this large get their disk blocks allocated when their download
    /// starts: ext4 then does not reserve and map blocks page by page as the bytes are
    /// written (the receiving agent of a 1.5 GB peer pull 0.88 × the CPU, the pull 1.11 ×
    /// as fast), and a blob that cannot fit fails before its first byte, not in the
    /// middle. Small blobs are left out: the allocation waits for the journal, which
    /// delayed first bytes when eight agents began many blobs at once (BENCHMARKS.md,
    /// issue 11, twenty-first and twenty-sixth sessions). A size above any blob, e.g.
    /// 16TiB, turns it off.
    preallocate_from: ByteSize = ByteSize(256 << 20),
        Value("--preallocate-from", "STARLING_PREALLOCATE_FROM");
    /// Registry used when a request carries no ?ns= (Docker registry-mirrors, skopeo).
    default_registry: String = "docker.io".into(),
        Value("--default-registry", "STARLING_DEFAULT_REGISTRY");
    /// How long a tag's digest is trusted before a HEAD checks it again, e.g. 60s.
    tag_ttl: Duration [serde(with = "humantime_serde_compat")] = Duration::from_secs(60),
        Value("--tag-ttl", "STARLING_TAG_TTL");
    /// When the upstream is unreachable, answer tags with the last known digest
    /// (--no-stale-tags refuses instead).
    serve_stale_tags: bool = true,
        SwitchOff("--no-stale-tags", "STARLING_NO_STALE_TAGS");
    /// Image whose content GC never evicts, e.g. docker.io/library/python:3.12
    /// (repeatable).
    pin: Vec<String> = Vec::new(),
        List("--pin", "STARLING_PIN", "IMAGE");
    /// Per-registry settings, keyed by registry host ("docker.io", "ghcr.io", ...):
    /// endpoint, username, password, ca_file, client_cert, client_key, skip_verify
    /// (flags: --registry-endpoint, --registry-credentials, --registry-ca, ...).
    registries: HashMap<String, RegistryConfig> = HashMap::new(),
        FileOnly;
    /// Registry beyond the configured ones that requests (?ns=, prewarm) may name:
    /// HOST, *.DOMAIN, or * for any (dangerous: whoever reaches the agent can make it
    /// connect to any host; loopback, link-local and metadata addresses stay refused
    /// unless configured). Repeatable.
    allowed_registries: Vec<String> = Vec::new(),
        List("--allowed-registry", "STARLING_ALLOWED_REGISTRIES", "PATTERN");
    /// Origin of plain files (starling get https://…) the agent may fetch: HOST[:PORT]
    /// (may be a loopback or private address), *.DOMAIN or * (public addresses only).
    /// Repeatable; none: the file route refuses every URL.
    allowed_file_origins: Vec<String> = Vec::new(),
        List("--allowed-file-origin", "STARLING_ALLOWED_FILE_ORIGINS", "PATTERN");
    /// Client connections served at once; further ones are closed as they arrive.
    max_connections: usize = 4096,
        Value("--max-connections", "STARLING_MAX_CONNECTIONS");
    /// Time a connection has to send a complete request head, and the longest idle
    /// keep-alive between requests.
    header_read_timeout: Duration [serde(with = "humantime_serde_compat")] = Duration::from_secs(10),
        Value("--header-read-timeout", "STARLING_HEADER_READ_TIMEOUT");
    /// On shutdown, how long responses in flight may still run before connections close.
    shutdown_grace: Duration [serde(with = "humantime_serde_compat")] = Duration::from_secs(10),
        Value("--shutdown-grace", "STARLING_SHUTDOWN_GRACE");
    /// A docker config.json to read registry credentials from.
    docker_config: Option<PathBuf> = None,
        Value("--docker-config", "STARLING_DOCKER_CONFIG");
    /// Longest time to open a connection to a registry.
    connect_timeout: Duration [serde(with = "humantime_serde_compat")] = Duration::from_secs(5),
        Value("--connect-timeout", "STARLING_CONNECT_TIMEOUT");
    /// A registry body with no bytes for this long counts as a dead connection and is
    /// resumed elsewhere.
    stall_timeout: Duration [serde(with = "humantime_serde_compat")] = Duration::from_secs(20),
        Value("--stall-timeout", "STARLING_STALL_TIMEOUT");
    /// This node's name in the swarm and the inventory (default: the host name).
    node_name: String = default_node_name(),
        Value("--node-name", "STARLING_NODE_NAME");
    /// host:port other agents dial to fetch pieces from this one (default: the peer
    /// listener's address).
    advertise: Option<String> = None,
        Value("--advertise", "STARLING_ADVERTISE");
    /// Where the peer listener binds (default: all interfaces on the advertised port,
    /// or the mirror's address on a port of the system's choosing).
    peer_listen: Option<SocketAddr> = None,
        Value("--peer-listen", "STARLING_PEER_LISTEN");
    /// Zone label: the tracker prefers peers in the same rack, then the same zone,
    /// then anywhere.
    zone: Option<String> = None,
        Value("--zone", "STARLING_ZONE");
    /// Rack label: the tracker prefers peers in the same rack; large swarms fetch each
    /// piece into a rack about once and spread it inside.
    rack: Option<String> = None,
        Value("--rack", "STARLING_RACK");
    /// Node label reported to the tracker (prewarm selectors, pools), KEY=VALUE
    /// (repeatable).
    labels: std::collections::BTreeMap<String, String> = Default::default(),
        Map("--label", "STARLING_LABELS", "KEY=VALUE");
    /// Tracker URL: join the P2P swarm (without it the agent is a plain caching
    /// mirror). Replicas: several URLs, comma-separated, tried in order when one fails.
    tracker: Option<String> = None,
        Value("--tracker", "STARLING_TRACKER");
    /// Shared cluster secret for the tracker and peers (plain-HTTP mode).
    cluster_token: Option<String> = None,
        Secret("--cluster-token", "STARLING_CLUSTER_TOKEN");
    /// Accept an http:// tracker: cluster and peer traffic unencrypted, nodes
    /// authenticated only by the cluster token. Without it an http:// tracker is
    /// refused at start, so plain HTTP is never what a deployment gets by omission.
    insecure_plain_http: bool = false,
        Switch("--insecure-plain-http", "STARLING_INSECURE_PLAIN_HTTP");
    /// Bootstrap token (starling certs token) to join a cluster whose tracker is
    /// https://: used once, when CACHE_DIR/pki holds no valid node certificate (which
    /// the agent then renews).
    join_token: Option<String> = None,
        Secret("--join", "STARLING_JOIN_TOKEN", "TOKEN");
    /// The cluster CA's pin (sha256:…, printed by starling certs init): the only CA
    /// trusted when joining.
    ca_pin: Option<String> = None,
        Value("--ca-pin", "STARLING_CA_PIN");
    /// Bytes per second this node may send to peers, e.g. 1GiB.
    upload_limit: Option<ByteSize> = None,
        Value("--upload-limit", "STARLING_UPLOAD_LIMIT");
    /// Bytes per second this node may receive from peers and the registry.
    download_limit: Option<ByteSize> = None,
        Value("--download-limit", "STARLING_DOWNLOAD_LIMIT");
    /// Pieces sent to peers at once. Few fast uploads beat many slow ones: a piece is
    /// useful to the swarm only once whole, so splitting the uplink delays every piece.
    max_uploads: usize = swarm::upload::DEFAULT_MAX_ACTIVE,
        Value("--max-uploads", "STARLING_MAX_UPLOADS");
    /// Piece requests one peer connection may have waiting for an upload slot; beyond
    /// that the peer is told "busy" and asks elsewhere.
    upload_queue: usize = swarm::upload::DEFAULT_QUEUE_PER_CONN,
        Value("--upload-queue", "STARLING_UPLOAD_QUEUE");
    /// Piece requests this node keeps in flight across all blobs (a reader's read head
    /// is not counted): enough to fill the download link, more would only make each
    /// piece arrive later.
    max_piece_requests: usize = swarm::upload::DEFAULT_REQUEST_BUDGET as usize,
        Value("--max-piece-requests", "STARLING_MAX_PIECE_REQUESTS");
    /// Blobs below this size skip P2P and go straight to the registry (through the
    /// cache).
    p2p_threshold: ByteSize = ByteSize(swarm::SwarmConfig::default().min_p2p_size),
        Value("--p2p-threshold", "STARLING_P2P_THRESHOLD");
    /// When a client gets an image manifest, start fetching all its layers at once in
    /// the background. --no-prefetch turns that off for lazy pullers (eStargz, SOCI),
    /// which read only parts of layers.
    prefetch_layers: bool = true,
        SwitchOff("--no-prefetch", "STARLING_NO_PREFETCH");
    /// How long the prefetch leaves to the runtime's own first layer requests (sent
    /// a moment after it has the manifest) before it starts the rest: the layers a
    /// runtime waits for join their swarms first and get the free sources.
    prefetch_grace: Duration [serde(with = "humantime_serde_compat")] =
        Duration::from_millis(swarm::prefetch::DEFAULT_PREFETCH_GRACE_MS),
        Value("--prefetch-grace", "STARLING_PREFETCH_GRACE");
    /// A second listener serving only /metrics and /healthz, for a scraper on another
    /// host. Unset: /metrics is on the mirror's listener, where it and the node's
    /// /api/v1/* answer local clients only.
    metrics_listen: Option<SocketAddr> = None,
        Value("--metrics-listen", "STARLING_METRICS_LISTEN");
    /// Bearer token a scraper must present on metrics_listen. Without it that listener
    /// answers whoever reaches it (bind it accordingly).
    metrics_token: Option<String> = None,
        Secret("--metrics-token", "STARLING_METRICS_TOKEN");
    /// Serve the /v2 mirror to clients on other hosts even though this agent holds
    /// registry credentials. Off: with credentials, only local clients get an answer,
    /// so private content stays on the node that was allowed to pull it.
    mirror_remote_clients: bool = false,
        Switch("--mirror-remote-clients", "STARLING_MIRROR_REMOTE_CLIENTS");
    /// Registry connections a swarm source may use for one large blob, each fetching a
    /// disjoint Range slice (registries and CDNs cap each connection): one per 256 MiB,
    /// up to this (swarm::pieces::registry_streams_for).
    registry_streams: usize = swarm::pieces::DEFAULT_REGISTRY_STREAMS as usize,
        Value("--registry-streams", "STARLING_REGISTRY_STREAMS");
    /// The piece size this agent proposes for swarms it starts, e.g. 4MiB, or "auto":
    /// the rule in swarm::pieces::piece_size_for (from the blob size and this node's
    /// link limits). The first agent in a swarm decides for everyone, within what the rule
    /// gives that blob on some link unless the tracker's --piece-size is the same.
    piece_size: SizeOrAuto = SizeOrAuto::Auto,
        Value("--piece-size", "STARLING_PIECE_SIZE");
    /// containerd socket, for prewarms with into_runtime (pull there and pin).
    containerd_socket: Option<PathBuf> = None,
        Value("--containerd-socket", "STARLING_CONTAINERD_SOCKET");
    /// containerd namespace those pulls go to.
    containerd_namespace: String = "k8s.io".into(),
        Value("--containerd-namespace", "STARLING_CONTAINERD_NAMESPACE");
    /// Snapshotter for those pulls (containerd's default when unset).
    containerd_snapshotter: Option<String> = None,
        Value("--containerd-snapshotter", "STARLING_CONTAINERD_SNAPSHOTTER");

    internal {
        /// Test mode: serve corrupted pieces to peers (proves they are rejected).
        #[serde(skip)]
        corrupt_pieces: bool = false;
        /// Test mode: take peers' piece requests and never send them (proves a
        /// holder that serves nothing is left behind).
        #[serde(skip)]
        withhold_pieces: bool = false;
        /// Test mode: the same for one blob only, while other blobs are served (proves
        /// a holder that starves one blob is left behind for it).
        #[serde(skip)]
        withhold_pieces_of: Option<String> = None;
        /// Test mode: with `withhold_pieces_of`, only this piece of that blob (proves
        /// a holder that passes over one request while serving the rest is left
        /// behind).
        #[serde(skip)]
        withhold_piece: Option<u32> = None;
    }
}

fn default_node_name() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "node".into())
}

#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RegistryConfig {
    /// Endpoint override, e.g. "http://127.0.0.1:5000" for an air-gapped origin.
    pub endpoint: Option<String>,
    pub username: Option<String>,
    pub password: Option<String>,
    /// PEM file with one or more CA certificates trusted for this registry only, on
    /// top of the system trust store (containerd's hosts.toml `ca`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate (chain) for mutual TLS with this registry (`client`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<PathBuf>,
    /// PEM private key of `client_cert`. Its path is shown, never its contents.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_key: Option<PathBuf>,
    /// DANGEROUS: accept any TLS certificate from this registry (`skip_verify`).
    /// Anyone on the path can then impersonate it, point its tags at digests of their
    /// choice and read the credentials sent to it. Logged at warn at start-up.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skip_verify: bool,
}

/// The registries this agent may contact: those named in its configuration
/// (`registries`, `default_registry`, `pin`) and those matching `allowed_registries`.
pub fn registry_policy(cfg: &AgentConfig) -> Result<oci::upstream::RegistryPolicy, crate::Error> {
    for p in &cfg.allowed_registries {
        let host = p.trim().strip_prefix("*.").unwrap_or(p.trim());
        if p.trim() != "*" && oci::reference::validate_registry(host).is_err() {
            return Err(crate::Error::Config(format!(
                "allowed_registries{}: {p:?} is not a registry host, \"*.domain\" or \"*\"",
                cfg.sources.of("allowed_registries")
            )));
        }
    }
    let pins = cfg
        .pin
        .iter()
        .filter_map(|r| oci::ImageReference::parse(r).ok().map(|r| r.registry));
    let configured = cfg
        .registries
        .keys()
        .cloned()
        .chain(std::iter::once(cfg.default_registry.clone()))
        .chain(pins);
    Ok(oci::upstream::RegistryPolicy::new(
        configured,
        cfg.allowed_registries.clone(),
    ))
}

impl AgentConfig {
    /// Whether any registry has credentials configured: content fetched with them is
    /// private to whoever may use them.
    pub fn holds_registry_credentials(&self) -> bool {
        self.registries
            .values()
            .any(|r| r.username.is_some() || r.password.is_some())
    }

    /// Every problem with this configuration at once (so an operator fixes them in one
    /// round), as one [`crate::Error::Config`] naming each key.
    pub fn validate(&self) -> Result<(), crate::Error> {
        problems_to_result(self.problems())
    }

    /// What [`validate`](Self::validate) reports, one line per problem, each naming
    /// its key and, when not a default, where the value came from.
    pub(crate) fn problems(&self) -> Vec<String> {
        let src = |key: &str| self.sources.of(key);
        let mut problems: Vec<String> = Vec::new();
        if !(0.0 < self.gc_low_watermark
            && self.gc_low_watermark <= self.gc_high_watermark
            && self.gc_high_watermark <= 1.0)
        {
            problems.push(format!(
                "gc_low_watermark {}{} / gc_high_watermark {}{}: need 0 < low <= high <= 1",
                self.gc_low_watermark,
                src("gc_low_watermark"),
                self.gc_high_watermark,
                src("gc_high_watermark"),
            ));
        }
        if self.cache_budget.bytes() == 0 {
            problems.push(format!(
                "cache_budget{}: must be more than 0",
                src("cache_budget")
            ));
        }
        for (name, r) in &self.registries {
            let at = src(&format!("registries.{name:?}"));
            if let Err(e) =
                oci::reference::validate_registry(&oci::reference::canonical_registry(name))
            {
                problems.push(format!("registries.{name:?}{at}: {e}"));
            }
            if let Some(ep) = &r.endpoint {
                if !(ep.starts_with("http://") || ep.starts_with("https://")) {
                    problems.push(format!(
                        "registries.{name:?}.endpoint {ep:?}{at}: must start with http:// or https://"
                    ));
                }
            }
            if r.username.is_some() != r.password.is_some() {
                problems.push(format!(
                    "registries.{name:?}{at}: username and password go together"
                ));
            }
        }
        match self.tracker.as_deref() {
            None => {
                for (key, set) in [
                    ("join_token", self.join_token.is_some()),
                    ("cluster_token", self.cluster_token.is_some()),
                    ("advertise", self.advertise.is_some()),
                    ("peer_listen", self.peer_listen.is_some()),
                ] {
                    if set {
                        problems.push(format!(
                            "{key}{}: set, but there is no tracker (it only applies to a swarm)",
                            src(key)
                        ));
                    }
                }
            }
            Some(t) => {
                let at = src("tracker");
                match crate::tracker_endpoints::TrackerEndpoints::parse(t) {
                    Err(e) => problems.push(format!("{}{at}", config_text(e))),
                    Ok(list) if list.is_https() => {
                        if self.cluster_token.is_some() {
                            problems.push(format!(
                                "cluster_token{}: not used with an https:// tracker (nodes are their certificates)",
                                src("cluster_token")
                            ));
                        }
                    }
                    Ok(_) if !self.insecure_plain_http => problems.push(format!(
                        "tracker {t}{at}: plain http:// would leave cluster and peer traffic unencrypted \
                         and nodes authenticated only by the cluster token. Use an https:// tracker \
                         (--join TOKEN --ca-pin sha256:…, see `starling certs`), or opt in with \
                         --insecure-plain-http"
                    )),
                    Ok(_) => {}
                }
            }
        }
        if let Some(pin) = &self.ca_pin {
            if pin.parse::<pki::CaPin>().is_err() {
                problems.push(format!(
                    "ca_pin {pin:?}{}: expected sha256:<64 hex>",
                    src("ca_pin")
                ));
            }
        }
        if let Some(size) = self.piece_size.bytes() {
            let (min, max) = (swarm::pieces::MIN_PIECE_SIZE, swarm::pieces::MAX_PIECE_SIZE);
            if !(min..=max).contains(&size) {
                problems.push(format!(
                    "piece_size{}: {} is outside {}..={}",
                    src("piece_size"),
                    self.piece_size,
                    ByteSize(min),
                    ByteSize(max)
                ));
            }
        }
        if let Err(e) = registry_policy(self) {
            problems.push(config_text(e));
        }
        if self.metrics_token.is_some() && self.metrics_listen.is_none() {
            problems.push(format!(
                "metrics_token{}: set without metrics_listen (it guards that listener only)",
                src("metrics_token")
            ));
        }
        problems
    }

    /// Whether `client` is on this host: loopback, or this host's own address (the
    /// connection's local end).
    pub fn is_local_client(client: std::net::SocketAddr, local: std::net::SocketAddr) -> bool {
        client.ip().is_loopback() || client.ip() == local.ip()
    }

    /// Whether a `/v2` request on a connection from `client` to `local` is refused:
    /// another host (neither loopback nor this host's own address), while this agent
    /// holds registry credentials and `mirror_remote_clients` is off.
    pub fn refuses_mirror_client(
        &self,
        client: std::net::SocketAddr,
        local: std::net::SocketAddr,
    ) -> bool {
        !Self::is_local_client(client, local)
            && !self.mirror_remote_clients
            && self.holds_registry_credentials()
    }
}

/// One [`crate::Error::Config`] listing every problem, or `Ok` for none.
pub(crate) fn problems_to_result(problems: Vec<String>) -> Result<(), crate::Error> {
    if problems.is_empty() {
        Ok(())
    } else {
        Err(crate::Error::Config(format!(
            "{} problem(s):\n  - {}",
            problems.len(),
            problems.join("\n  - ")
        )))
    }
}

/// The text of a configuration error without the `configuration: ` prefix, to be
/// one line in a list of problems.
fn config_text(e: crate::Error) -> String {
    match e {
        crate::Error::Config(text) => text,
        other => other.to_string(),
    }
}

/// What `--print-config` and logs show in place of a secret.
pub const REDACTED: &str = "<redacted>";

impl AgentConfig {
    /// A copy with every secret (registry passwords, the cluster token) replaced by
    /// [`REDACTED`], for printing.
    pub fn redacted(&self) -> Self {
        let mut c = self.clone();
        for r in c.registries.values_mut() {
            *r = r.redacted();
        }
        if c.cluster_token.is_some() {
            c.cluster_token = Some(REDACTED.into());
        }
        if c.join_token.is_some() {
            c.join_token = Some(REDACTED.into());
        }
        if c.metrics_token.is_some() {
            c.metrics_token = Some(REDACTED.into());
        }
        c
    }
}

impl RegistryConfig {
    pub fn redacted(&self) -> Self {
        Self {
            password: self.password.as_ref().map(|_| REDACTED.into()),
            ..self.clone()
        }
    }

    /// The TLS settings the upstream client takes.
    pub fn tls(&self) -> oci::upstream::RegistryTls {
        oci::upstream::RegistryTls {
            ca_file: self.ca_file.clone(),
            client_cert: self.client_cert.clone(),
            client_key: self.client_key.clone(),
            skip_verify: self.skip_verify,
        }
    }
}

// Debug goes through the redacted copy, so a secret cannot reach a log line by `?cfg`,
// and a field added later is covered without touching this.
impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match toml::to_string(&self.redacted()) {
            Ok(text) => write!(f, "AgentConfig {{ {} }}", text.trim().replace('\n', ", ")),
            Err(_) => f.write_str("AgentConfig { .. }"),
        }
    }
}

impl std::fmt::Debug for RegistryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.redacted();
        f.debug_struct("RegistryConfig")
            .field("endpoint", &r.endpoint)
            .field("username", &r.username)
            .field("password", &r.password)
            .field("ca_file", &r.ca_file)
            .field("client_cert", &r.client_cert)
            .field("client_key", &r.client_key)
            .field("skip_verify", &r.skip_verify)
            .finish()
    }
}

mod humantime_serde_compat {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn toml_round_trip() {
        let text = r#"
            listen = "127.0.0.1:6000"
            cache_dir = "/tmp/x"
            tag_ttl = "30s"
            pin = ["docker.io/library/python:3.12"]
            [registries."docker.io"]
            endpoint = "http://127.0.0.1:5000"
        "#;
        let c: AgentConfig = toml::from_str(text).unwrap();
        assert_eq!(c.tag_ttl, Duration::from_secs(30));
        assert_eq!(
            c.registries["docker.io"].endpoint.as_deref(),
            Some("http://127.0.0.1:5000")
        );
        assert!(toml::from_str::<AgentConfig>("bogus_key = 1").is_err());
    }

    #[test]
    fn secrets_never_print() {
        let text = r#"
            cluster_token = "tok-SECRET-1"
            [registries."docker.io"]
            username = "puller"
            password = "pw-SECRET-2"
        "#;
        let c: AgentConfig = toml::from_str(text).expect("config");
        let shown = [
            format!("{c:?}"),
            format!("{:?}", c.registries["docker.io"]),
            toml::to_string(&c.redacted()).expect("TOML"),
        ];
        for s in shown {
            assert!(!s.contains("SECRET"), "{s}");
            assert!(s.contains("puller") && s.contains(REDACTED), "{s}");
        }
        // The real values are still there for the agent itself.
        assert_eq!(c.cluster_token.as_deref(), Some("tok-SECRET-1"));
    }

    #[test]
    fn registry_tls_keys() {
        let text = r#"
            [registries."reg.corp.example:5000"]
            ca_file = "/etc/starling/corp-ca.pem"
            client_cert = "/etc/starling/node.crt"
            client_key = "/etc/starling/node.key"
            password = "pw-SECRET-3"
            [registries."lab.example"]
            skip_verify = true
        "#;
        let c: AgentConfig = toml::from_str(text).expect("config");
        let t = c.registries["reg.corp.example:5000"].tls();
        assert_eq!(
            t.ca_file.as_deref(),
            Some(Path::new("/etc/starling/corp-ca.pem"))
        );
        assert_eq!(
            t.client_key.as_deref(),
            Some(Path::new("/etc/starling/node.key"))
        );
        assert!(!t.skip_verify && c.registries["lab.example"].tls().skip_verify);
        // --print-config keeps the paths (not secrets) and the opt-in, hides the password.
        let printed = toml::to_string(&c.redacted()).expect("TOML");
        assert!(
            printed.contains("/etc/starling/node.key") && printed.contains("skip_verify = true"),
            "{printed}"
        );
        assert!(!printed.contains("SECRET"), "{printed}");
        let back: AgentConfig = toml::from_str(&printed).expect("printed config parses");
        assert_eq!(back.registries["reg.corp.example:5000"].tls(), t);
        let dbg = format!("{:?}", c.registries["reg.corp.example:5000"]);
        assert!(dbg.contains("node.key") && !dbg.contains("SECRET"), "{dbg}");
    }

    /// Issue 12, tenancy: private content (fetched with this agent's credentials) is
    /// served over `/v2` to local clients only, unless the operator opts in.
    #[test]
    fn a_credentialed_mirror_answers_local_clients_only() {
        let local: std::net::SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let lan: std::net::SocketAddr = "10.0.3.17:40000".parse().unwrap();
        let lan6: std::net::SocketAddr = "[fd00::17]:40000".parse().unwrap();
        let me: std::net::SocketAddr = "10.0.3.1:5050".parse().unwrap();
        let me6: std::net::SocketAddr = "[fd00::1]:5050".parse().unwrap();
        let mut cfg = AgentConfig::default();
        assert!(
            !cfg.refuses_mirror_client(lan, me),
            "no credentials: public content only"
        );
        cfg.registries.insert(
            "private.example.com".into(),
            RegistryConfig {
                username: Some("puller".into()),
                password: Some("pw".into()),
                ..Default::default()
            },
        );
        assert!(!cfg.refuses_mirror_client(local, local));
        assert!(
            !cfg.refuses_mirror_client(me, me),
            "this host through its own address"
        );
        assert!(cfg.refuses_mirror_client(lan, me));
        assert!(cfg.refuses_mirror_client(lan6, me6));
        cfg.mirror_remote_clients = true;
        assert!(!cfg.refuses_mirror_client(lan, me), "explicit opt-in");
    }

    #[test]
    fn validation_reports_every_problem_at_once() {
        assert!(
            AgentConfig::default().validate().is_ok(),
            "defaults are valid"
        );
        let cfg: AgentConfig = toml::from_str(
            r#"
            cache_budget = "0"
            gc_high_watermark = 0.5
            gc_low_watermark = 0.9
            tracker = "http://tracker:7070"
            metrics_token = "t"
            ca_pin = "md5:abc"
            [registries."reg.example.com"]
            endpoint = "ftp://reg"
            username = "u"
            "#,
        )
        .expect("parses");
        let msg = cfg.validate().expect_err("invalid").to_string();
        for key in [
            "cache_budget",
            "gc_low_watermark",
            "tracker http://tracker:7070",
            "metrics_token",
            "ca_pin",
            "endpoint \"ftp://reg\"",
            "username and password",
        ] {
            assert!(msg.contains(key), "{key} missing from:\n{msg}");
        }
        assert!(msg.starts_with("configuration: 7 problem(s)"), "{msg}");
    }

    #[test]
    fn sizes_are_read_when_the_configuration_is() {
        let cfg: AgentConfig =
            toml::from_str("cache_budget = \"200GiB\"\nupload_limit = 1048576\n").expect("parses");
        assert_eq!(cfg.cache_budget.bytes(), 200 << 30);
        assert_eq!(cfg.upload_limit.map(|b| b.bytes()), Some(1 << 20));
        let bad = toml::from_str::<AgentConfig>("cache_budget = \"lots\"\n")
            .expect_err("refused at load")
            .to_string();
        assert!(bad.contains("cache_budget"), "{bad}");
    }
}
