use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

#[derive(Args)]
pub struct AgentArgs {
    /// TOML config file; flags and STARLING_* environment variables override its keys.
    #[arg(long, short, env = "STARLING_CONFIG")]
    config: Option<PathBuf>,
    /// Every setting of the agent's table (`agent::config::SETTINGS`) as a flag, and
    /// the `[registries."host"]` flags.
    #[command(flatten)]
    flags: AgentFlags,
    /// Test mode: serve corrupted pieces to peers.
    #[arg(long, hide = true)]
    corrupt_pieces: bool,
    /// Test mode: take peers' piece requests and never send them.
    #[arg(long, hide = true)]
    withhold_pieces: bool,
    /// Test mode: the same for one blob (a digest) while serving the others.
    #[arg(long, hide = true, value_name = "DIGEST")]
    withhold_pieces_of: Option<String>,
    /// Test mode: with --withhold-pieces-of, only this piece of that blob.
    #[arg(
        long,
        hide = true,
        value_name = "PIECE",
        requires = "withhold_pieces_of"
    )]
    withhold_piece: Option<u32>,
    /// Print the effective configuration as TOML (secrets redacted) and exit.
    #[arg(long)]
    print_config: bool,
}

/// The agent's settings as flags, made from the one table in `agent::config`: each
/// flag has its variable, its help from the table's doc comment and the default in use.
/// Then the registry flags. Values stay text here and are read by
/// `agent::config::load`, which is told whether each came from the flag or the variable.
pub struct AgentFlags {
    settings: Vec<agent::config::CliValue>,
    registry: Vec<agent::config::RegistryCliValue>,
}

impl clap::FromArgMatches for AgentFlags {
    fn from_arg_matches(m: &clap::ArgMatches) -> std::result::Result<Self, clap::Error> {
        Ok(Self {
            settings: Self::settings_from(m),
            registry: Self::registry_from(m)?,
        })
    }

    fn update_from_arg_matches(
        &mut self,
        m: &clap::ArgMatches,
    ) -> std::result::Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl Args for AgentFlags {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        RegistryFlagValues::augment_args(Self::setting_args(cmd))
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl AgentFlags {
    fn settings_from(m: &clap::ArgMatches) -> Vec<agent::config::CliValue> {
        use agent::config::How;
        use clap::parser::ValueSource;
        let mut given = Vec::new();
        for s in agent::config::SETTINGS.iter().filter(|s| s.has_flag()) {
            let from_env = match m.value_source(s.key) {
                Some(ValueSource::CommandLine) => false,
                Some(ValueSource::EnvVariable) => true,
                _ => continue,
            };
            let values = match s.how {
                How::Switch | How::SwitchOff if m.get_flag(s.key) => Vec::new(),
                How::Switch | How::SwitchOff => continue,
                _ => m
                    .get_many::<String>(s.key)
                    .map(|v| v.cloned().collect())
                    .unwrap_or_default(),
            };
            given.push(agent::config::CliValue {
                setting: s,
                from_env,
                values,
            });
        }
        given
    }

    fn setting_args(cmd: clap::Command) -> clap::Command {
        use agent::config::How;
        use clap::{Arg, ArgAction};
        let defaults = toml::Value::try_from(agent::AgentConfig::default())
            .ok()
            .and_then(|v| v.as_table().cloned())
            .unwrap_or_default();
        cmd.args(
            agent::config::SETTINGS
                .iter()
                .filter(|s| s.has_flag())
                .map(|s| {
                    let mut help = s.help();
                    if let (How::Value | How::Secret, Some(d)) = (s.how, defaults.get(s.key)) {
                        match d {
                            toml::Value::String(text) => help += &format!(" [default: {text}]"),
                            other => help += &format!(" [default: {other}]"),
                        }
                    }
                    let arg = Arg::new(s.key)
                        .long(s.flag.trim_start_matches("--"))
                        .env(s.env)
                        .help(help);
                    let arg = match s.how {
                        // A variable set by a unit file or a chart is as often `1` or
                        // `yes` as `true`; clap's default takes only `true`/`false`.
                        How::Switch | How::SwitchOff => arg
                            .action(ArgAction::SetTrue)
                            .value_parser(clap::builder::BoolishValueParser::new()),
                        How::List | How::Map => arg.action(ArgAction::Append).value_delimiter(','),
                        How::Secret => arg.hide_env_values(true),
                        How::Value | How::FileOnly => arg,
                    };
                    match (s.how, s.value_name) {
                        (How::Switch | How::SwitchOff, _) => arg,
                        // clap's derive shows the key in capitals; the builder wants
                        // a 'static name, made once per flag for this process.
                        (_, "") => {
                            arg.value_name(&*Box::leak(s.key.to_ascii_uppercase().into_boxed_str()))
                        }
                        (_, name) => arg.value_name(name),
                    }
                }),
        )
    }
}

/// The agent's registry flags as clap sees them (the TLS ones shared with the tracker).
#[derive(Args)]
struct RegistryFlagValues {
    /// Upstream endpoint override, REGISTRY=URL (repeatable), e.g. docker.io=http://127.0.0.1:5000.
    #[arg(
        long = "registry-endpoint",
        value_name = "REGISTRY=URL",
        env = "STARLING_REGISTRY_ENDPOINTS",
        value_delimiter = ','
    )]
    registry_endpoints: Vec<String>,
    /// Upstream credentials, REGISTRY=USER:PASSWORD (repeatable). Prefer the config file or --docker-config.
    #[arg(
        long = "registry-credentials",
        value_name = "REGISTRY=USER:PASSWORD",
        env = "STARLING_REGISTRY_CREDENTIALS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    registry_credentials: Vec<String>,
    #[command(flatten)]
    registry_tls: RegistryTlsArgs,
}

impl AgentFlags {
    /// (id, flag, variable) of each registry flag, read from its clap definition once.
    fn registry_flag_names() -> &'static [(String, String, String)] {
        static NAMES: std::sync::OnceLock<Vec<(String, String, String)>> =
            std::sync::OnceLock::new();
        NAMES.get_or_init(|| {
            RegistryFlagValues::augment_args(clap::Command::new("agent"))
                .get_arguments()
                .map(|a| {
                    (
                        a.get_id().to_string(),
                        a.get_long().map(|l| format!("--{l}")).unwrap_or_default(),
                        a.get_env()
                            .map(|e| e.to_string_lossy().into_owned())
                            .unwrap_or_default(),
                    )
                })
                .collect()
        })
    }

    /// The registry flags' values with where each came from (flag or variable).
    fn registry_from(
        m: &clap::ArgMatches,
    ) -> std::result::Result<Vec<agent::config::RegistryCliValue>, clap::Error> {
        use agent::config::{RegistryCliValue, RegistryField, Source};
        use clap::parser::ValueSource;
        let v = <RegistryFlagValues as clap::FromArgMatches>::from_arg_matches(m)?;
        let mut given = Vec::new();
        for (id, field, values) in [
            (
                "registry_endpoints",
                RegistryField::Endpoint,
                &v.registry_endpoints,
            ),
            (
                "registry_credentials",
                RegistryField::Credentials,
                &v.registry_credentials,
            ),
            ("ca", RegistryField::CaFile, &v.registry_tls.ca),
            (
                "client_cert",
                RegistryField::ClientCert,
                &v.registry_tls.client_cert,
            ),
            (
                "client_key",
                RegistryField::ClientKey,
                &v.registry_tls.client_key,
            ),
            (
                "skip_verify",
                RegistryField::SkipVerify,
                &v.registry_tls.skip_verify,
            ),
        ] {
            let Some((_, flag, env)) = Self::registry_flag_names().iter().find(|n| n.0 == id)
            else {
                continue;
            };
            let source = match m.value_source(id) {
                Some(ValueSource::CommandLine) => Source::Flag(flag),
                Some(ValueSource::EnvVariable) => Source::Env(env),
                _ => continue,
            };
            given.push(RegistryCliValue {
                field,
                source,
                values: values.clone(),
            });
        }
        Ok(given)
    }
}

/// The configuration: the file (`--config`), then the settings' variables and flags,
/// then the registry flags, which fill `[registries."host"]` entries.
pub fn build_config(a: &AgentArgs) -> Result<agent::AgentConfig> {
    let mut cfg = agent::config::load(a.config.as_deref(), &a.flags.settings, &a.flags.registry)?;
    cfg.corrupt_pieces = a.corrupt_pieces;
    cfg.withhold_pieces = a.withhold_pieces;
    cfg.withhold_pieces_of = a.withhold_pieces_of.clone();
    cfg.withhold_piece = a.withhold_piece;
    Ok(cfg)
}

/// Per-registry TLS flags, the common cases of `[registries."host"]` TLS keys (the
/// agent) and the only way to give them to the tracker's registry catalog.
#[derive(Args, Default)]
pub struct RegistryTlsArgs {
    /// Extra CA certificates (PEM) trusted for one registry only, REGISTRY=PATH
    /// (repeatable), on top of the system trust store.
    #[arg(
        long = "registry-ca",
        value_name = "REGISTRY=PATH",
        env = "STARLING_REGISTRY_CA",
        value_delimiter = ','
    )]
    ca: Vec<String>,
    /// Client certificate (PEM) for mutual TLS with a registry, REGISTRY=PATH
    /// (repeatable; needs --registry-client-key).
    #[arg(
        long = "registry-client-cert",
        value_name = "REGISTRY=PATH",
        env = "STARLING_REGISTRY_CLIENT_CERT",
        value_delimiter = ','
    )]
    client_cert: Vec<String>,
    /// Private key (PEM) of the registry's client certificate, REGISTRY=PATH (repeatable).
    #[arg(
        long = "registry-client-key",
        value_name = "REGISTRY=PATH",
        env = "STARLING_REGISTRY_CLIENT_KEY",
        value_delimiter = ','
    )]
    client_key: Vec<String>,
    /// DANGEROUS: do not verify this registry's TLS certificate (repeatable). Anyone on
    /// the path can then impersonate it; logged at warn at start-up.
    #[arg(
        long = "registry-skip-verify",
        value_name = "REGISTRY",
        env = "STARLING_REGISTRY_SKIP_VERIFY",
        value_delimiter = ','
    )]
    skip_verify: Vec<String>,
}

impl RegistryTlsArgs {
    /// Registry (as written) → its TLS settings from the flags.
    pub fn parse(&self) -> Result<std::collections::BTreeMap<String, oci::upstream::RegistryTls>> {
        let mut out: std::collections::BTreeMap<String, oci::upstream::RegistryTls> =
            Default::default();
        let pair = |flag: &str, v: &str| -> Result<(String, PathBuf)> {
            match v.split_once('=') {
                Some((r, p)) if !r.trim().is_empty() && !p.trim().is_empty() => {
                    Ok((r.trim().to_owned(), PathBuf::from(p.trim())))
                }
                _ => bail!("{flag} wants REGISTRY=PATH, got {v:?}"),
            }
        };
        for v in &self.ca {
            let (r, p) = pair("--registry-ca", v)?;
            out.entry(r).or_default().ca_file = Some(p);
        }
        for v in &self.client_cert {
            let (r, p) = pair("--registry-client-cert", v)?;
            out.entry(r).or_default().client_cert = Some(p);
        }
        for v in &self.client_key {
            let (r, p) = pair("--registry-client-key", v)?;
            out.entry(r).or_default().client_key = Some(p);
        }
        for r in &self.skip_verify {
            if r.trim().is_empty() || r.contains('=') {
                bail!("--registry-skip-verify wants a REGISTRY, got {r:?}");
            }
            out.entry(r.trim().to_owned()).or_default().skip_verify = true;
        }
        Ok(out)
    }
}

pub async fn run_agent(a: AgentArgs) -> Result<()> {
    let cfg = build_config(&a)?;
    if a.print_config {
        print!("{}", toml::to_string_pretty(&cfg.redacted())?);
        return Ok(());
    }
    let listen = cfg.listen;
    // Before the agent starts: it needs the certificate to talk to an https:// tracker.
    agent::identity::join_if_needed(&cfg)
        .await
        .context("joining the cluster")?;
    let agent = agent::Agent::new(cfg).context("starting agent")?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("listening on {listen}"))?;
    agent.serve(listener, crate::shutdown_signal()).await?;
    Ok(())
}

#[derive(Args)]
pub struct ServeOciArgs {
    /// OCI image layout directory (oci-layout, index.json, blobs/).
    dir: PathBuf,
    #[arg(long, default_value = "127.0.0.1:5000", env = "STARLING_ORIGIN_LISTEN")]
    listen: SocketAddr,
    /// Total egress limit shared by all clients, e.g. 100MiB (per second).
    #[arg(long, env = "STARLING_ORIGIN_EGRESS_LIMIT")]
    egress_limit: Option<String>,
    /// Serve only under this repository name (default: any name).
    #[arg(long)]
    repository: Option<String>,
}

pub async fn run_serve_oci(a: ServeOciArgs) -> Result<()> {
    let limit = a
        .egress_limit
        .as_deref()
        .map(crate::parse_size)
        .transpose()?;
    let cfg = origin::OriginConfig {
        layout_dir: a.dir,
        listen: a.listen,
        egress_limit_bytes_per_sec: limit,
        repository: a.repository,
        latency: None,
    };
    origin::serve(cfg, crate::shutdown_signal())
        .await
        .context("serve-oci")?;
    Ok(())
}

#[derive(Args)]
pub struct PullArgs {
    /// Image reference, e.g. docker.io/library/python:3.12 or 127.0.0.1:5000/train:v1.
    reference: String,
    /// Pull through this mirror (e.g. the local agent http://127.0.0.1:5050) instead of the registry itself.
    #[arg(long, env = "STARLING_MIRROR")]
    mirror: Option<String>,
    /// Platform os/arch for multi-platform images (default: this host's).
    #[arg(long)]
    platform: Option<String>,
    /// Blobs fetched at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Registry credentials USER:PASSWORD.
    #[arg(long, env = "STARLING_PULL_CREDS", hide_env_values = true)]
    creds: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run_pull(a: PullArgs) -> Result<()> {
    let reference = oci::ImageReference::parse(&a.reference).context("image reference")?;
    let mut cfg = oci::UpstreamConfig::default();
    if let Some(m) = &a.mirror {
        cfg.endpoints.insert(reference.registry.clone(), m.clone());
    } else if reference.registry.starts_with("127.") || reference.registry.starts_with("localhost")
    {
        cfg.endpoints.insert(
            reference.registry.clone(),
            format!("http://{}", reference.registry),
        );
    }
    if let Some(c) = &a.creds {
        let Some((u, p)) = c.split_once(':') else {
            bail!("--creds wants USER:PASSWORD")
        };
        cfg.credentials.insert(
            reference.registry.clone(),
            oci::upstream::Credentials {
                username: u.into(),
                password: p.into(),
            },
        );
    }
    let up = oci::Upstream::new(cfg)?;
    let mut opts = oci::pull::PullOptions {
        concurrency: a.concurrency,
        ..Default::default()
    };
    if let Some(p) = &a.platform {
        let Some((os, arch)) = p.split_once('/') else {
            bail!("--platform wants OS/ARCH")
        };
        opts.os = os.into();
        opts.arch = arch.into();
    }
    let report = oci::pull::pull(&up, &reference, &opts)
        .await
        .with_context(|| format!("pulling {reference}"))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "pulled {} ({}) : {} blobs, {} in {:.2}s ({:.1} MiB/s), every blob sha256-verified",
            report.reference,
            report.manifest_digest,
            report.blobs.len(),
            oci::size::format_size(report.bytes),
            report.seconds,
            report.bytes as f64 / 1048576.0 / report.seconds.max(1e-6)
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct TrackerArgs {
    #[arg(
        long,
        default_value = "127.0.0.1:7070",
        env = "STARLING_TRACKER_LISTEN"
    )]
    listen: SocketAddr,
    /// Shared cluster secret agents must present (plain-HTTP mode only).
    #[arg(long, env = "STARLING_CLUSTER_TOKEN", hide_env_values = true)]
    cluster_token: Option<String>,
    /// Cluster TLS: serve HTTPS with a certificate from the CA in DIR (`starling certs
    /// init`), require client certificates and authorize by role; nodes join with
    /// bootstrap tokens from this CA.
    #[arg(long, value_name = "DIR", env = "STARLING_TRACKER_PKI", conflicts_with_all = ["cluster_token", "insecure_plain_http"])]
    pki: Option<PathBuf>,
    /// Extra DNS name or IP address for the tracker certificate (repeatable);
    /// localhost, 127.0.0.1 and ::1 are always in it.
    #[arg(
        long = "tls-san",
        value_name = "DNS|IP",
        value_delimiter = ',',
        env = "STARLING_TRACKER_TLS_SANS"
    )]
    tls_sans: Vec<String>,
    /// The name in the tracker certificate's identity, starling:tracker:NAME.
    #[arg(long, default_value = "tracker")]
    tls_name: String,
    /// Lifetime of node certificates issued at join and renewal (expiry is how a
    /// removed node loses access).
    #[arg(long, default_value = "24h", env = "STARLING_TRACKER_NODE_CERT_TTL")]
    node_cert_ttl: humantime::Duration,
    /// Lifetime of the tracker's own certificate; re-issued from the CA at 2/3 of it
    /// while the tracker runs.
    #[arg(long, default_value = "365days", env = "STARLING_TRACKER_CERT_TTL")]
    tls_cert_ttl: humantime::Duration,
    /// Join requests one client address may make per minute (and in a burst); more get
    /// 429. A node joins once; this bounds token guessing and crash loops.
    #[arg(long, default_value_t = 10, env = "STARLING_TRACKER_JOIN_LIMIT")]
    join_limit: u32,
    /// Serve plain HTTP, without --pki: unencrypted, nodes not authenticated beyond
    /// --cluster-token. Without --pki or this flag the tracker does not start.
    #[arg(
        long,
        env = "STARLING_INSECURE_PLAIN_HTTP",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    insecure_plain_http: bool,
    /// Blobs below this size skip P2P.
    #[arg(long, default_value = "1MiB")]
    p2p_threshold: String,
    /// Piece size for swarms whose first announce proposes none (agents propose one
    /// from their links), or "auto" for the rule with an unknown link. An agent's
    /// proposal is kept within what the rule gives the blob on some link, unless it is
    /// this size.
    #[arg(long, default_value = "auto")]
    piece_size: String,
    /// Peers silent for this long are no longer handed out.
    #[arg(long, default_value = "5s")]
    peer_ttl: humantime::Duration,
    /// How often downloading agents announce: membership, hashes for peers not
    /// connected to the source. Piece availability travels between peers directly.
    #[arg(long, default_value = "1s")]
    announce_interval: humantime::Duration,
    /// Swarms with at least this many members get rack stripes: each member of a
    /// rack fetches only its share of the pieces from other racks and the rack
    /// spreads them inside, and asks its far peers only for its share's HAVEs.
    /// Lower it where racks are small or rack uplinks are the bottleneck.
    #[arg(long, default_value_t = swarm::SwarmConfig::default().stripe_min_members as u32, value_parser = clap::value_parser!(u32).range(2..=1_000_000))]
    stripe_min_members: u32,
    /// Where prewarm jobs are persisted (they survive a tracker restart).
    #[arg(
        long,
        env = "STARLING_TRACKER_DATA_DIR",
        default_value = "/var/lib/starling-tracker"
    )]
    data_dir: PathBuf,
    /// A node that stops reporting for this long becomes "unknown".
    #[arg(long, default_value = "60s")]
    node_timeout: humantime::Duration,
    /// Registry endpoint override for resolving prewarm images, REGISTRY=URL (repeatable).
    #[arg(
        long = "registry-endpoint",
        value_name = "REGISTRY=URL",
        value_delimiter = ','
    )]
    registry_endpoints: Vec<String>,
    /// Registry credentials for resolving prewarm images, REGISTRY=USER:PASSWORD.
    #[arg(
        long = "registry-credentials",
        value_delimiter = ',',
        hide_env_values = true,
        env = "STARLING_TRACKER_REGISTRY_CREDENTIALS"
    )]
    registry_credentials: Vec<String>,
    /// Registry beyond those given an endpoint or credentials that prewarm and
    /// scheduler queries may resolve images in: HOST, *.DOMAIN, or * for any
    /// (dangerous: see README). Repeatable.
    #[arg(
        long = "allowed-registry",
        value_name = "PATTERN",
        env = "STARLING_TRACKER_ALLOWED_REGISTRIES",
        value_delimiter = ','
    )]
    allowed_registries: Vec<String>,
    #[command(flatten)]
    registry_tls: TrackerRegistryTlsArgs,
    /// Longest time one image lookup in a registry may take.
    #[arg(long, default_value = "10s", env = "STARLING_TRACKER_REGISTRY_TIMEOUT")]
    registry_timeout: humantime::Duration,
    /// Client connections served at once; more are closed as they arrive.
    #[arg(
        long,
        default_value_t = 16_384,
        env = "STARLING_TRACKER_MAX_CONNECTIONS"
    )]
    max_connections: usize,
    /// Time a connection has to send a request head, and the longest idle keep-alive.
    #[arg(
        long,
        default_value = "10s",
        env = "STARLING_TRACKER_HEADER_READ_TIMEOUT"
    )]
    header_read_timeout: humantime::Duration,
    /// A request (body included) taking longer is answered 408 and dropped.
    #[arg(long, default_value = "60s", env = "STARLING_TRACKER_REQUEST_TIMEOUT")]
    request_timeout: humantime::Duration,
    /// On SIGTERM, how long requests in flight may still run before the tracker exits.
    #[arg(long, default_value = "5s", env = "STARLING_TRACKER_SHUTDOWN_GRACE")]
    shutdown_grace: humantime::Duration,
    /// Nodes kept in the inventory; reports from new nodes beyond are refused (503).
    #[arg(long, default_value_t = 20_000, env = "STARLING_TRACKER_MAX_NODES")]
    max_nodes: usize,
    /// A node silent for this long is forgotten.
    #[arg(long, default_value = "24h", env = "STARLING_TRACKER_NODE_EXPIRY")]
    node_expiry: humantime::Duration,
    /// Largest inventory report body taken (413 beyond, logged at warn).
    #[arg(
        long,
        default_value = "64MiB",
        env = "STARLING_TRACKER_MAX_REPORT_SIZE"
    )]
    max_report_size: String,
    /// Blobs one inventory report may list (413 beyond).
    #[arg(
        long,
        default_value_t = 200_000,
        env = "STARLING_TRACKER_MAX_REPORT_BLOBS"
    )]
    max_report_blobs: usize,
    /// Per-node series in per-node metric families; other nodes are folded into node="other".
    #[arg(
        long,
        default_value_t = 1000,
        env = "STARLING_TRACKER_METRIC_NODE_LABELS"
    )]
    metric_node_labels: usize,
    #[command(flatten)]
    redis: crate::tracker_redis::RedisArgs,
}

/// The tracker's registry TLS flags: the agent's names, `STARLING_TRACKER_*` variables.
#[derive(Default)]
pub struct TrackerRegistryTlsArgs(RegistryTlsArgs);

impl clap::FromArgMatches for TrackerRegistryTlsArgs {
    fn from_arg_matches(m: &clap::ArgMatches) -> std::result::Result<Self, clap::Error> {
        RegistryTlsArgs::from_arg_matches(m).map(Self)
    }
    fn update_from_arg_matches(
        &mut self,
        m: &clap::ArgMatches,
    ) -> std::result::Result<(), clap::Error> {
        self.0.update_from_arg_matches(m)
    }
}

impl Args for TrackerRegistryTlsArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        RegistryTlsArgs::augment_args(cmd)
            .mut_arg("ca", |a| a.env("STARLING_TRACKER_REGISTRY_CA"))
            .mut_arg("client_cert", |a| {
                a.env("STARLING_TRACKER_REGISTRY_CLIENT_CERT")
            })
            .mut_arg("client_key", |a| {
                a.env("STARLING_TRACKER_REGISTRY_CLIENT_KEY")
            })
            .mut_arg("skip_verify", |a| {
                a.env("STARLING_TRACKER_REGISTRY_SKIP_VERIFY")
            })
    }
    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

pub async fn run_tracker(a: TrackerArgs) -> Result<()> {
    if a.pki.is_none() && !a.insecure_plain_http {
        bail!(
            "no cluster TLS: give --pki DIR (create it with `starling certs init --dir DIR`), \
             or --insecure-plain-http to serve plain HTTP with only --cluster-token \
             (unencrypted; anyone on the network can read and forge cluster traffic)"
        );
    }
    let cfg = swarm::SwarmConfig {
        min_p2p_size: crate::parse_size(&a.p2p_threshold)?,
        piece_size: match a.piece_size.as_str() {
            "auto" => None,
            v => Some(crate::parse_size(v)?),
        },
        peer_ttl_ms: std::time::Duration::from(a.peer_ttl).as_millis() as u64,
        announce_interval_ms: std::time::Duration::from(a.announce_interval).as_millis() as u64,
        stripe_min_members: a.stripe_min_members as usize,
        ..Default::default()
    };
    std::fs::create_dir_all(&a.data_dir)
        .with_context(|| format!("creating {}", a.data_dir.display()))?;
    // With --redis the jobs live in Redis; this replica keeps only a copy.
    let jobs = if a.redis.enabled() {
        cluster::JobStore::in_memory()
    } else {
        cluster::JobStore::open(&a.data_dir.join("jobs.redb"))
    }
    .context("opening the prewarm job store")?;
    let mut ucfg = oci::UpstreamConfig::default();
    let mut configured = Vec::new();
    for e in &a.registry_endpoints {
        let Some((reg, url)) = e.split_once('=') else {
            bail!("--registry-endpoint wants REGISTRY=URL")
        };
        ucfg.endpoints
            .insert(oci::reference::canonical_registry(reg), url.to_owned());
        configured.push(reg.to_owned());
    }
    for e in &a.registry_credentials {
        let Some((reg, up)) = e.split_once('=') else {
            bail!("--registry-credentials wants REGISTRY=USER:PASSWORD")
        };
        let Some((u, p)) = up.split_once(':') else {
            bail!("--registry-credentials wants REGISTRY=USER:PASSWORD")
        };
        ucfg.credentials.insert(
            oci::reference::canonical_registry(reg),
            oci::upstream::Credentials {
                username: u.into(),
                password: p.into(),
            },
        );
        configured.push(reg.to_owned());
    }
    for (reg, t) in a.registry_tls.0.parse()? {
        ucfg.tls.insert(oci::reference::canonical_registry(&reg), t);
        configured.push(reg);
    }
    ucfg.policy = Some(oci::upstream::RegistryPolicy::new(
        configured,
        a.allowed_registries.clone(),
    ));
    let catalog = tracker::cluster_glue::RegistryCatalog::with_timeout(
        oci::Upstream::new(ucfg)?,
        tokio::runtime::Handle::current(),
        a.registry_timeout.into(),
    );
    let ccfg = cluster::ClusterConfig {
        node_timeout_s: std::time::Duration::from(a.node_timeout).as_secs().max(1),
        limits: cluster::InventoryLimits {
            max_nodes: a.max_nodes.max(1),
            node_expiry_s: std::time::Duration::from(a.node_expiry).as_secs().max(1),
            max_report_blobs: a.max_report_blobs,
            ..Default::default()
        },
        max_report_bytes: usize::try_from(crate::parse_size(&a.max_report_size)?)
            .context("--max-report-size")?,
        metric_node_labels: a.metric_node_labels,
        ..Default::default()
    };
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    };
    let state = cluster::ClusterState::with_options(
        ccfg,
        jobs,
        Some(std::sync::Arc::new(catalog)),
        std::sync::Arc::new(now),
    );
    let limits = tracker::ServerLimits {
        max_connections: a.max_connections.max(1),
        header_read_timeout: a.header_read_timeout.into(),
        shutdown_grace: a.shutdown_grace.into(),
        request_timeout: a.request_timeout.into(),
    };
    let mut t = tracker::Tracker::new(cfg, a.cluster_token)
        .with_cluster(state)
        .with_limits(limits);
    if let Some(dir) = &a.pki {
        let opts = tracker::TlsOptions {
            sans: a.tls_sans.clone(),
            name: a.tls_name.clone(),
            node_cert_lifetime: a.node_cert_ttl.into(),
            cert_lifetime: a.tls_cert_ttl.into(),
            joins_per_minute: a.join_limit,
            ..tracker::TlsOptions::new(dir)
        };
        t = t.with_tls(tracker::TrackerTls::load(&opts)?);
    }
    let t = a.redis.apply(t)?;
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    t.serve(listener, crate::shutdown_signal()).await?;
    Ok(())
}
