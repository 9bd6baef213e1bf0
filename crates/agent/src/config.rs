//! Agent configuration (TOML). Every key can also be set by a flag or an environment
//! variable in the `starling` binary, which builds this struct.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use oci::size::ByteSize;
use serde::{Deserialize, Serialize};

#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// Address the mirror listens on (containerd's hosts.toml points here).
    pub listen: SocketAddr,
    /// Cache directory: blobs, partial downloads and the metadata database.
    pub cache_dir: PathBuf,
    /// Cache budget, e.g. "200GiB".
    pub cache_budget: ByteSize,
    pub gc_high_watermark: f64,
    pub gc_low_watermark: f64,
    /// Space always left free on the cache filesystem, e.g. "1GiB".
    pub min_free: ByteSize,
    /// Registry used when a request carries no `?ns=` (Docker `registry-mirrors`, skopeo).
    pub default_registry: String,
    /// How long a tag's digest is trusted before it is checked again with a HEAD.
    #[serde(with = "humantime_serde_compat")]
    pub tag_ttl: Duration,
    /// When the upstream is unreachable, answer tags with the last known digest.
    pub serve_stale_tags: bool,
    /// Images whose content GC never evicts, e.g. "docker.io/library/python:3.12".
    pub pin: Vec<String>,
    /// Per-registry settings, keyed by registry host ("docker.io", "ghcr.io", ...).
    pub registries: HashMap<String, RegistryConfig>,
    /// Registries requests may name (`?ns=`, prewarm assignments) beyond the configured
    /// ones (`registries`, `default_registry`, `pin`): exact hosts, `*.example.com`, or
    /// `*` for any registry at all. `*` lets whoever reaches the agent make it connect
    /// to any host on the internet; loopback, link-local and metadata addresses stay
    /// refused unless configured.
    pub allowed_registries: Vec<String>,
    /// Origins of plain files (`starling get https://…`) the agent may fetch:
    /// `host[:port]` (may be a loopback or private address), `*.example.com` or `*`
    /// (public addresses only). Empty: the file route refuses every URL.
    pub allowed_file_origins: Vec<String>,
    /// Client connections served at once; further ones are closed as they arrive.
    pub max_connections: usize,
    /// A connection must send a complete request head within this, and may stay idle
    /// between requests no longer than this.
    #[serde(with = "humantime_serde_compat")]
    pub header_read_timeout: Duration,
    /// On shutdown, how long responses in flight may still run before connections close.
    #[serde(with = "humantime_serde_compat")]
    pub shutdown_grace: Duration,
    /// A docker `config.json` to read registry credentials from.
    pub docker_config: Option<PathBuf>,
    #[serde(with = "humantime_serde_compat")]
    pub connect_timeout: Duration,
    /// A body with no bytes for this long counts as a dead connection (then resumed).
    #[serde(with = "humantime_serde_compat")]
    pub stall_timeout: Duration,
    /// This node's name in the swarm and the inventory (default: the host name).
    pub node_name: String,
    /// `host:port` other agents dial to fetch pieces from this one (default: the peer
    /// listener's address).
    pub advertise: Option<String>,
    /// Where the peer listener binds (default: all interfaces on the advertised port,
    /// or the mirror's address on a port of the system's choosing).
    pub peer_listen: Option<SocketAddr>,
    /// Topology labels; the tracker prefers peers in the same rack, then zone.
    pub zone: Option<String>,
    pub rack: Option<String>,
    /// Node labels reported to the tracker (prewarm selectors, pools).
    pub labels: std::collections::BTreeMap<String, String>,
    /// Tracker URL, or several comma-separated (replicas, tried in order when one
    /// fails: see `tracker_endpoints`); without it the agent is a plain caching mirror.
    pub tracker: Option<String>,
    /// Shared secret for the tracker and for peers (plain-HTTP mode).
    pub cluster_token: Option<String>,
    /// Opt in to an `http://` tracker: cluster and peer traffic unencrypted, nodes
    /// authenticated only by `cluster_token`. Without it an `http://` tracker is refused
    /// at start, so plain HTTP is never what a deployment gets by omission.
    pub insecure_plain_http: bool,
    /// Bootstrap token (`starling certs token`) to join a cluster whose tracker is
    /// `https://`: used once, when `<cache_dir>/pki/` holds no valid node certificate.
    pub join_token: Option<String>,
    /// The cluster CA's pin (`sha256:…`, printed by `starling certs init`): the only CA
    /// trusted when joining.
    pub ca_pin: Option<String>,
    /// Token-bucket limits per second, e.g. "1GiB": what this node may send to peers
    /// and receive from peers and the registry.
    pub upload_limit: Option<ByteSize>,
    pub download_limit: Option<ByteSize>,
    /// Pieces sent to peers at once. Few fast uploads beat many slow ones: a piece is
    /// useful to the swarm only once whole, so splitting the uplink delays every piece.
    pub max_uploads: usize,
    /// Piece requests one peer connection may have waiting for an upload slot; beyond
    /// that the peer is told "busy" and asks elsewhere.
    pub upload_queue: usize,
    /// Piece requests this node keeps in flight across all blobs (a reader's read
    /// head is not counted). Enough to fill the download link; more would only make
    /// each piece arrive later.
    pub max_piece_requests: usize,
    /// Blobs below this go straight to the registry (through the cache).
    pub p2p_threshold: ByteSize,
    /// When a client gets an image manifest, start fetching all its layers at once in
    /// the background (the runtime's requests join them). Turn off for lazy pullers
    /// (eStargz, SOCI), which read only parts of layers.
    pub prefetch_layers: bool,
    /// A second listener that serves only `/metrics` and `/healthz`, for a scraper on
    /// another host (Prometheus). Unset: `/metrics` is on the mirror's listener, where
    /// it and the node's `/api/v1/*` answer local clients only.
    pub metrics_listen: Option<SocketAddr>,
    /// Bearer token a scraper must present on `metrics_listen`. Without it that
    /// listener answers whoever reaches it (bind it accordingly).
    pub metrics_token: Option<String>,
    /// Serve the `/v2` mirror to clients on other hosts even though this agent holds
    /// registry credentials. Off: with credentials, only local (loopback) clients get
    /// an answer, so private content stays on the node that was allowed to pull it.
    pub mirror_remote_clients: bool,
    /// Registry connections a swarm source may use for one large blob, each fetching a
    /// disjoint Range slice (registries and CDNs cap each connection); the rule in
    /// `swarm::pieces::registry_streams_for` uses one per 256 MiB, up to this.
    pub registry_streams: usize,
    /// The piece size this agent proposes for swarms it starts, e.g. "4MiB"; unset:
    /// the rule in `swarm::pieces::piece_size_for` (from the blob size and this node's
    /// link limits). The first agent in a swarm decides for everyone.
    pub piece_size: Option<String>,
    /// containerd socket for prewarms with `into_runtime` (pull there and pin).
    pub containerd_socket: Option<PathBuf>,
    pub containerd_namespace: String,
    /// Snapshotter for those pulls (containerd's default when unset).
    pub containerd_snapshotter: Option<String>,
    /// Test mode: serve corrupted pieces to peers (proves they are rejected).
    #[serde(skip)]
    pub corrupt_pieces: bool,
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

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 5050)),
            cache_dir: PathBuf::from("/var/lib/starling"),
            cache_budget: ByteSize(100 << 30),
            gc_high_watermark: 0.90,
            gc_low_watermark: 0.80,
            min_free: ByteSize(1 << 30),
            default_registry: "docker.io".into(),
            tag_ttl: Duration::from_secs(60),
            serve_stale_tags: true,
            pin: Vec::new(),
            registries: HashMap::new(),
            allowed_registries: Vec::new(),
            allowed_file_origins: Vec::new(),
            max_connections: 4096,
            header_read_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(10),
            docker_config: None,
            connect_timeout: Duration::from_secs(5),
            stall_timeout: Duration::from_secs(20),
            node_name: std::fs::read_to_string("/etc/hostname")
                .map(|s| s.trim().to_owned())
                .ok()
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "node".into()),
            advertise: None,
            zone: None,
            rack: None,
            labels: Default::default(),
            tracker: None,
            cluster_token: None,
            insecure_plain_http: false,
            metrics_listen: None,
            metrics_token: None,
            join_token: None,
            ca_pin: None,
            upload_limit: None,
            download_limit: None,
            peer_listen: None,
            max_uploads: swarm::upload::DEFAULT_MAX_ACTIVE,
            upload_queue: swarm::upload::DEFAULT_QUEUE_PER_CONN,
            max_piece_requests: swarm::upload::DEFAULT_REQUEST_BUDGET as usize,
            p2p_threshold: ByteSize(swarm::SwarmConfig::default().min_p2p_size),
            registry_streams: swarm::pieces::DEFAULT_REGISTRY_STREAMS as usize,
            prefetch_layers: true,
            mirror_remote_clients: false,
            piece_size: None,
            corrupt_pieces: false,
            containerd_socket: None,
            containerd_namespace: "k8s.io".into(),
            containerd_snapshotter: None,
        }
    }
}

/// The registries this agent may contact: those named in its configuration
/// (`registries`, `default_registry`, `pin`) and those matching `allowed_registries`.
pub fn registry_policy(cfg: &AgentConfig) -> Result<oci::upstream::RegistryPolicy, crate::Error> {
    for p in &cfg.allowed_registries {
        let host = p.trim().strip_prefix("*.").unwrap_or(p.trim());
        if p.trim() != "*" && oci::reference::validate_registry(host).is_err() {
            return Err(crate::Error::Config(format!(
                "allowed_registries: {p:?} is not a registry host, \"*.domain\" or \"*\""
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
        let mut problems: Vec<String> = Vec::new();
        if !(0.0 < self.gc_low_watermark
            && self.gc_low_watermark <= self.gc_high_watermark
            && self.gc_high_watermark <= 1.0)
        {
            problems.push(format!(
                "gc_low_watermark {} / gc_high_watermark {}: need 0 < low <= high <= 1",
                self.gc_low_watermark, self.gc_high_watermark
            ));
        }
        if self.cache_budget.bytes() == 0 {
            problems.push("cache_budget: must be more than 0".into());
        }
        for (name, r) in &self.registries {
            if let Err(e) =
                oci::reference::validate_registry(&oci::reference::canonical_registry(name))
            {
                problems.push(format!("registries.{name:?}: {e}"));
            }
            if let Some(ep) = &r.endpoint {
                if !(ep.starts_with("http://") || ep.starts_with("https://")) {
                    problems.push(format!(
                        "registries.{name:?}.endpoint {ep:?}: must start with http:// or https://"
                    ));
                }
            }
            if r.username.is_some() != r.password.is_some() {
                problems.push(format!(
                    "registries.{name:?}: username and password go together"
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
                            "{key}: set, but there is no tracker (it only applies to a swarm)"
                        ));
                    }
                }
            }
            Some(t) if t.starts_with("https://") => {
                if self.cluster_token.is_some() {
                    problems.push("cluster_token: not used with an https:// tracker (nodes are their certificates)".into());
                }
            }
            Some(t) if t.starts_with("http://") => {
                if !self.insecure_plain_http {
                    problems.push(format!(
                        "tracker {t}: plain http:// would leave cluster and peer traffic unencrypted \
                         and nodes authenticated only by the cluster token. Use an https:// tracker \
                         (--join TOKEN --ca-pin sha256:…, see `starling certs`), or opt in with \
                         --insecure-plain-http"
                    ));
                }
            }
            Some(t) => problems.push(format!(
                "tracker {t:?}: must start with https:// (or http:// with insecure_plain_http)"
            )),
        }
        if let Some(pin) = &self.ca_pin {
            if pin.parse::<pki::CaPin>().is_err() {
                problems.push(format!("ca_pin {pin:?}: expected sha256:<64 hex>"));
            }
        }
        if self.metrics_token.is_some() && self.metrics_listen.is_none() {
            problems.push(
                "metrics_token: set without metrics_listen (it guards that listener only)".into(),
            );
        }
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

/// Sizes like `512MiB`, `200GiB`, `1.5TB`, `1048576` (the project's one parser).
pub fn parse_size(s: &str) -> Result<u64, crate::Error> {
    oci::size::parse_size(s).map_err(|e| crate::Error::Config(e.to_string()))
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
    fn sizes() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2 GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert!(parse_size("12 parsecs").is_err());
    }

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
            .err()
            .expect("refused at load")
            .to_string();
        assert!(bad.contains("cache_budget"), "{bad}");
    }
}
