//! `starling get SOURCE DEST`: model weights and other large files through the node's
//! agent, so the swarm, single flight, the cache and pins apply to them as to image
//! layers. SOURCE is an OCI artifact (`oci://REGISTRY/REPO:TAG` or `@DIGEST`: one file
//! per layer, named by its `org.opencontainers.image.title`) or an `http(s)://` URL.
//! With no agent reachable it downloads straight from the registry or the origin and
//! says so. The transfer of one file is `get_file`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use futures::StreamExt;
use oci::Digest;

use crate::get_file::{self, FileJob, FileReport, Origin};

const TITLE: &str = "org.opencontainers.image.title";
const MAX_MANIFEST: usize = 4 << 20;
const ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, \
    application/vnd.docker.distribution.manifest.v2+json, \
    application/vnd.oci.image.index.v1+json";

#[derive(Args)]
pub struct GetArgs {
    /// oci://REGISTRY/REPO:TAG, oci://REGISTRY/REPO@sha256:…, or an http(s):// URL.
    source: String,
    /// A directory for oci:// sources (created if missing); for a URL a file path, or an
    /// existing directory (the file is named after the URL's last path segment).
    dest: PathBuf,
    /// The node's agent.
    #[arg(long, env = "STARLING_AGENT", default_value = "http://127.0.0.1:5050")]
    agent: String,
    /// Do not use the agent: download straight from the registry or the origin.
    #[arg(long)]
    no_agent: bool,
    /// sha256:… of a URL's content: the whole file is verified against it (and it names
    /// the file in the swarm and the cache).
    #[arg(long)]
    digest: Option<String>,
    /// Files fetched at once.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Registry credentials USER:PASSWORD for downloads without the agent (the agent
    /// uses its own).
    #[arg(long, env = "STARLING_PULL_CREDS", hide_env_values = true)]
    creds: Option<String>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// What SOURCE names.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Artifact(oci::ImageReference),
    Url(url::Url),
}

pub(crate) fn parse_source(s: &str) -> Result<Source> {
    if let Some(rest) = s.strip_prefix("oci://") {
        let r = oci::ImageReference::parse(rest).context("oci:// reference")?;
        if !rest.starts_with(&r.registry) && !rest.starts_with("index.docker.io") {
            bail!("oci:// needs the registry host first: oci://REGISTRY/REPO:TAG");
        }
        return Ok(Source::Artifact(r));
    }
    if s.starts_with("http://") || s.starts_with("https://") {
        let u = url::Url::parse(s).context("URL")?;
        if u.host_str().is_none() {
            bail!("the URL has no host");
        }
        return Ok(Source::Url(u));
    }
    bail!("SOURCE is oci://REGISTRY/REPO:TAG, oci://REGISTRY/REPO@sha256:…, or an http(s):// URL")
}

/// An image or artifact reference for the cluster commands (`prewarm`, `where`): an
/// `oci://` source is the artifact's reference; `sha256:<key>` names a file by its key.
/// URLs are resolved by [`file_source`].
pub(crate) fn cluster_reference(s: &str) -> Result<String> {
    if is_url(s) {
        bail!("{s}: a URL's key is asked of an agent (internal error: not resolved)");
    }
    if s.starts_with("sha256:") {
        let d = Digest::parse(s).context("file key")?;
        return Ok(cluster::wire::file_reference(&d));
    }
    Ok(s.strip_prefix("oci://").unwrap_or(s).to_owned())
}

pub(crate) fn is_url(s: &str) -> bool {
    s.starts_with("http://") || s.starts_with("https://")
}

/// A URL as the cluster layer knows it: its key and size, as the agent at `agent`
/// computes them from the origin's current answer (the identity needs the origin's
/// ETag), or the content digest when given.
pub(crate) async fn file_source(
    url: &str,
    agent: &str,
    digest: Option<&Digest>,
) -> Result<cluster::wire::FileSource> {
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .build()?;
    let agent = agent.trim_end_matches('/');
    let mut ask = format!(
        "{agent}/files/v1/fetch?url={}",
        url::form_urlencoded::byte_serialize(url.as_bytes()).collect::<String>()
    );
    if let Some(d) = digest {
        ask.push_str(&format!("&digest={d}"));
    }
    let shown = oci::upstream::policy::redact_url(url);
    let resp = http
        .head(ask)
        .send()
        .await
        .with_context(|| format!("asking the agent at {agent} for the key of {shown}"))?;
    if !resp.status().is_success() {
        bail!(
            "the agent at {agent} answered {} for {shown}",
            resp.status()
        );
    }
    let key = resp
        .headers()
        .get(get_file::KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .context("the agent did not name the file's key")?;
    let key = Digest::parse(key).context("the agent's file key")?;
    // The header itself: reqwest's `content_length()` is the body's, 0 for a HEAD.
    let size = resp
        .headers()
        .get(reqwest::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .context("the agent did not give the file's size")?;
    Ok(cluster::wire::FileSource {
        key,
        url: url.to_owned(),
        size,
        content_digest: digest.is_some(),
    })
}

/// Errors about a file name taken from an annotation or a URL.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct UnsafeName(pub String);

impl std::fmt::Display for UnsafeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UnsafeName {}

/// A relative path inside DEST from a name the source chose: no absolute paths, no `..`,
/// no empty or `.` components, no backslashes or control characters, bounded lengths.
/// Subdirectories (`shards/model-00001.safetensors`) are allowed.
pub(crate) fn safe_relative_path(name: &str) -> Result<PathBuf, UnsafeName> {
    let bad = |why: &str| Err(UnsafeName(format!("file name {name:?} refused: {why}")));
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > 1024 {
        return bad("longer than 1024 bytes");
    }
    if name.chars().any(|c| c.is_control()) {
        return bad("control character");
    }
    if name.contains('\\') {
        return bad("backslash");
    }
    if name.starts_with('/') {
        return bad("absolute path");
    }
    let mut out = PathBuf::new();
    for part in name.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return bad("empty, `.` or `..` path component (path traversal)");
        }
        if part.len() > 255 {
            return bad("a component longer than 255 bytes");
        }
        if part.ends_with(".starling-partial") || part.ends_with(".starling-partial.id") {
            return bad("reserved for partial files");
        }
        out.push(part);
    }
    // Belt and braces: whatever `Path` makes of it must be plain components.
    if !out.components().all(|c| matches!(c, Component::Normal(_))) {
        return bad("not a plain relative path");
    }
    Ok(out)
}

/// Creates the directories between DEST and a file, refusing to pass through a symlink
/// (which could lead outside DEST).
fn prepare_parent(dest: &Path, rel: &Path) -> Result<PathBuf> {
    let mut dir = dest.to_path_buf();
    if let Some(parent) = rel.parent() {
        for c in parent.components() {
            dir.push(c);
            match std::fs::symlink_metadata(&dir) {
                Ok(m) if m.file_type().is_symlink() => {
                    bail!(
                        "{} is a symlink; refusing to write through it",
                        dir.display()
                    )
                }
                Ok(m) if m.is_dir() => {}
                Ok(_) => bail!("{} exists and is not a directory", dir.display()),
                Err(_) => std::fs::create_dir(&dir)
                    .with_context(|| format!("creating {}", dir.display()))?,
            }
        }
    }
    let path = dest.join(rel);
    if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
        bail!("{} is a directory", path.display());
    }
    Ok(path)
}

/// Totals shown by the progress bar and reported: bytes by where they came from.
pub(crate) struct Progress {
    bar: indicatif::ProgressBar,
    by_source: parking_lot::Mutex<BTreeMap<String, u64>>,
}

impl Progress {
    fn new(total: u64, hidden: bool) -> Progress {
        let bar = if hidden {
            indicatif::ProgressBar::hidden()
        } else {
            indicatif::ProgressBar::new(total)
        };
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
        ) {
            bar.set_style(style);
        }
        Progress {
            bar,
            by_source: Default::default(),
        }
    }

    pub(crate) fn add(&self, source: &str, n: u64) {
        let msg = {
            let mut m = self.by_source.lock();
            *m.entry(source.to_owned()).or_default() += n;
            m.iter()
                .map(|(k, v)| format!("{k} {}", indicatif::HumanBytes(*v)))
                .collect::<Vec<_>>()
                .join(" · ")
        };
        self.bar.inc(n);
        self.bar.set_message(msg);
    }

    /// A file already complete in DEST.
    pub(crate) fn skip(&self, n: u64) {
        self.bar.inc(n);
    }

    fn set_length(&self, n: u64) {
        self.bar.set_length(n);
    }
}

#[derive(serde::Serialize)]
struct Report {
    source: String,
    dest: PathBuf,
    /// `agent` (through the node's agent) or `direct`.
    via: &'static str,
    agent: Option<String>,
    manifest_digest: Option<String>,
    files: Vec<FileReport>,
    /// Layers without a title annotation (not written).
    skipped_untitled: Vec<String>,
    errors: Vec<String>,
    bytes: u64,
    fetched: u64,
    bytes_by_source: BTreeMap<String, u64>,
    /// What the agent received while this get ran, from its metrics: the split between
    /// peers and the origin (agent-wide: other pulls running at the same time count too).
    agent_received: Option<AgentReceived>,
    seconds: f64,
}

#[derive(serde::Serialize, Clone, Copy)]
struct AgentReceived {
    peers: u64,
    origin: u64,
}

pub async fn run_get(a: GetArgs) -> Result<i32> {
    let started = std::time::Instant::now();
    let source = parse_source(&a.source)?;
    let digest = a
        .digest
        .as_deref()
        .map(Digest::parse)
        .transpose()
        .context("--digest")?;
    if digest.is_some() && matches!(source, Source::Artifact(_)) {
        bail!("--digest is for URLs; an oci:// source names its digests itself");
    }
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()?;
    let agent = a.agent.trim_end_matches('/').to_owned();
    let agent_up = !a.no_agent && agent_reachable(&http, &agent).await;
    if !a.no_agent && !agent_up {
        eprintln!(
            "warning: no agent at {agent}: downloading directly from the origin \
             (no swarm, no cache on this node)"
        );
    }
    let before = if agent_up {
        agent_counters(&http, &agent).await
    } else {
        None
    };
    let mut manifest_digest = None;
    let mut skipped_untitled = Vec::new();
    let jobs = match &source {
        Source::Artifact(r) => {
            std::fs::create_dir_all(&a.dest)
                .with_context(|| format!("creating {}", a.dest.display()))?;
            let (body, md) = if agent_up {
                manifest_via_agent(&http, &agent, r).await?
            } else {
                manifest_direct(&direct_upstream(r, a.creds.as_deref())?, r).await?
            };
            manifest_digest = Some(md.to_string());
            let m = oci::Manifest::parse(&body).context("manifest")?;
            if m.is_index() {
                bail!(
                    "{} is an index ({} manifests); name one of them by digest",
                    a.source,
                    m.manifests.len()
                );
            }
            let origin = if agent_up {
                Origin::AgentBlob {
                    agent: agent.clone(),
                    registry: r.registry.clone(),
                    repo: r.repository.clone(),
                }
            } else {
                Origin::DirectBlob {
                    upstream: direct_upstream(r, a.creds.as_deref())?,
                    registry: r.registry.clone(),
                    repo: r.repository.clone(),
                }
            };
            let (jobs, untitled) = artifact_jobs(&m, &a.dest, &origin)?;
            skipped_untitled = untitled;
            jobs
        }
        Source::Url(u) => {
            let path = url_destination(u, &a.dest)?;
            let origin = if agent_up {
                Origin::AgentUrl {
                    agent: agent.clone(),
                    url: u.to_string(),
                }
            } else {
                Origin::DirectUrl { url: u.to_string() }
            };
            vec![FileJob {
                name: path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                path,
                size: None,
                digest: digest.clone(),
                origin,
            }]
        }
    };
    for name in &skipped_untitled {
        eprintln!("warning: layer {name} has no {TITLE} annotation; not written");
    }
    // Free space for every file of known size, before the first byte.
    let known: u64 = jobs
        .iter()
        .filter_map(|j| {
            let have = std::fs::metadata(get_file::partial_path(&j.path, j.digest.as_ref()))
                .map_or(0, |m| m.len());
            j.size.map(|s| s.saturating_sub(have))
        })
        .sum();
    let free = store::available_space(&a.dest).unwrap_or(u64::MAX);
    if known > free {
        bail!(
            "not enough space in {}: the files need {} more bytes, {} are free",
            a.dest.display(),
            known,
            free
        );
    }
    let total: u64 = jobs.iter().filter_map(|j| j.size).sum();
    let progress = Arc::new(Progress::new(total, a.json));
    if jobs.iter().any(|j| j.size.is_none()) {
        progress.set_length(0);
    }
    let results: Vec<Result<FileReport>> = futures::stream::iter(jobs.iter())
        .map(|j| {
            let (http, progress) = (http.clone(), progress.clone());
            async move { get_file::fetch_file(&http, j, &progress).await }
        })
        .buffer_unordered(a.parallel.max(1))
        .collect()
        .await;
    progress.bar.finish_and_clear();
    let mut files = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(f) => files.push(f),
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    files.sort_by(|x, y| x.name.cmp(&y.name));
    let after = if agent_up {
        agent_counters(&http, &agent).await
    } else {
        None
    };
    let agent_received = match (before, after) {
        (Some(b), Some(a)) => Some(AgentReceived {
            peers: a.peers.saturating_sub(b.peers),
            origin: a.origin.saturating_sub(b.origin),
        }),
        _ => None,
    };
    let report = Report {
        source: a.source.clone(),
        dest: a.dest.clone(),
        via: if agent_up { "agent" } else { "direct" },
        agent: agent_up.then(|| agent.clone()),
        manifest_digest,
        bytes: files.iter().map(|f| f.bytes).sum(),
        fetched: files.iter().map(|f| f.fetched).sum(),
        bytes_by_source: progress.by_source.lock().clone(),
        files,
        skipped_untitled,
        errors,
        agent_received,
        seconds: started.elapsed().as_secs_f64(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    if !report.errors.is_empty() {
        if !a.json {
            for e in &report.errors {
                eprintln!("error: {e}");
            }
        }
        return Ok(1);
    }
    Ok(0)
}

fn print_report(r: &Report) {
    for f in &r.files {
        let how = if f.already_present {
            "already present".to_owned()
        } else if f.resumed_from > 0 {
            format!("resumed at {}, from {}", f.resumed_from, f.source)
        } else {
            format!("from {}", f.source)
        };
        let check = if f.verified_digest {
            "sha256 verified"
        } else {
            "no digest given: pieces verified by the swarm, file not"
        };
        println!(
            "{}  {} bytes  {how}  {check}  {}",
            f.path.display(),
            f.bytes,
            f.sha256
        );
    }
    let by: Vec<String> = r
        .bytes_by_source
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    println!(
        "{} file(s), {} bytes ({} fetched: {}) in {:.2}s via {}",
        r.files.len(),
        r.bytes,
        r.fetched,
        if by.is_empty() {
            "-".into()
        } else {
            by.join(", ")
        },
        r.seconds,
        r.via
    );
    if let Some(a) = r.agent_received {
        println!(
            "the agent received {} bytes from peers and {} from the origin meanwhile",
            a.peers, a.origin
        );
    }
}

/// One job per titled layer; the untitled ones are listed (ORAS skips them too).
fn artifact_jobs(
    m: &oci::Manifest,
    dest: &Path,
    origin: &Origin,
) -> Result<(Vec<FileJob>, Vec<String>)> {
    let mut jobs = Vec::new();
    let mut untitled = Vec::new();
    let mut seen = BTreeSet::new();
    for layer in &m.layers {
        let Some(title) = layer.annotations.as_ref().and_then(|a| a.get(TITLE)) else {
            untitled.push(layer.digest.to_string());
            continue;
        };
        let rel = safe_relative_path(title)?;
        if !seen.insert(rel.clone()) {
            bail!("two layers are titled {title:?}");
        }
        let path = prepare_parent(dest, &rel)?;
        jobs.push(FileJob {
            name: title.clone(),
            path,
            size: Some(layer.size),
            digest: Some(layer.digest.clone()),
            origin: origin.clone(),
        });
    }
    if jobs.is_empty() {
        bail!("the artifact has no layer with a {TITLE} annotation: nothing to write");
    }
    Ok((jobs, untitled))
}

/// DEST for a URL: the path itself, or the URL's last segment inside an existing
/// directory (or a DEST ending in `/`).
fn url_destination(u: &url::Url, dest: &Path) -> Result<PathBuf> {
    let is_dir = dest.is_dir() || dest.as_os_str().to_string_lossy().ends_with('/');
    if !is_dir {
        if let Some(parent) = dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        return Ok(dest.to_path_buf());
    }
    let last = u
        .path_segments()
        .and_then(|mut s| s.next_back())
        .filter(|s| !s.is_empty())
        .context("the URL ends in `/`: give DEST as a file path")?;
    let name = agent::routes::percent_decode(last);
    let rel = safe_relative_path(&name)?;
    if rel.components().count() != 1 {
        bail!("the URL's file name {name:?} is not a single path component");
    }
    std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
    prepare_parent(dest, &rel)
}

async fn agent_reachable(http: &reqwest::Client, agent: &str) -> bool {
    let r = tokio::time::timeout(
        Duration::from_secs(2),
        http.get(format!("{agent}/healthz")).send(),
    )
    .await;
    matches!(r, Ok(Ok(resp)) if resp.status().is_success())
}

/// The agent's cumulative bytes from peers and from upstream (registries, origins).
async fn agent_counters(http: &reqwest::Client, agent: &str) -> Option<AgentReceived> {
    let text = tokio::time::timeout(Duration::from_secs(2), async {
        http.get(format!("{agent}/metrics"))
            .send()
            .await?
            .text()
            .await
    })
    .await
    .ok()?
    .ok()?;
    let value = |name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    };
    Some(AgentReceived {
        peers: value("starling_agent_p2p_peer_bytes_total"),
        origin: value("starling_agent_upstream_bytes_total"),
    })
}

async fn manifest_via_agent(
    http: &reqwest::Client,
    agent: &str,
    r: &oci::ImageReference,
) -> Result<(Vec<u8>, Digest)> {
    let reference = r.manifest_ref().to_string();
    let url = format!(
        "{agent}/v2/{}/manifests/{reference}?ns={}",
        r.repository,
        url::form_urlencoded::byte_serialize(r.registry.as_bytes()).collect::<String>()
    );
    let resp = http
        .get(&url)
        .header(reqwest::header::ACCEPT, ACCEPT)
        .send()
        .await
        .with_context(|| format!("asking the agent for {reference}"))?;
    let status = resp.status().as_u16();
    if status != 200 {
        let body = resp.text().await.unwrap_or_default();
        bail!(
            "the agent answered {status} for the manifest of {}/{}:{reference}: {}",
            r.registry,
            r.repository,
            body.chars().take(300).collect::<String>()
        );
    }
    let header_digest = resp
        .headers()
        .get("docker-content-digest")
        .and_then(|v| v.to_str().ok())
        .map(Digest::parse)
        .transpose()
        .context("Docker-Content-Digest")?;
    if resp
        .content_length()
        .is_some_and(|l| l > MAX_MANIFEST as u64)
    {
        bail!("manifest larger than {MAX_MANIFEST} bytes");
    }
    let mut body = Vec::new();
    let mut s = resp.bytes_stream();
    while let Some(c) = s.next().await {
        let c = c?;
        if body.len() + c.len() > MAX_MANIFEST {
            bail!("manifest larger than {MAX_MANIFEST} bytes");
        }
        body.extend_from_slice(&c);
    }
    let actual = Digest::of(&body);
    let expected = r.digest.clone().or(header_digest);
    if let Some(e) = expected {
        if e != actual {
            bail!("manifest digest mismatch: expected {e}, got {actual}");
        }
    }
    Ok((body, actual))
}

fn direct_upstream(r: &oci::ImageReference, creds: Option<&str>) -> Result<oci::Upstream> {
    let mut cfg = oci::UpstreamConfig::default();
    if r.registry.starts_with("127.") || r.registry.starts_with("localhost") {
        cfg.endpoints
            .insert(r.registry.clone(), format!("http://{}", r.registry));
    }
    if let Some(c) = creds {
        let Some((u, p)) = c.split_once(':') else {
            bail!("--creds wants USER:PASSWORD")
        };
        cfg.credentials.insert(
            r.registry.clone(),
            oci::upstream::Credentials {
                username: u.into(),
                password: p.into(),
            },
        );
    }
    Ok(oci::Upstream::new(cfg)?)
}

async fn manifest_direct(up: &oci::Upstream, r: &oci::ImageReference) -> Result<(Vec<u8>, Digest)> {
    let reference = r.manifest_ref().to_string();
    let (_, body) = up
        .get_manifest(&r.registry, &r.repository, &reference, ACCEPT)
        .await
        .with_context(|| format!("fetching the manifest of {}/{}", r.registry, r.repository))?;
    let actual = Digest::of(&body);
    if let Some(e) = &r.digest {
        if *e != actual {
            bail!("manifest digest mismatch: expected {e}, got {actual}");
        }
    }
    Ok((body.to_vec(), actual))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn titles_that_escape_dest_are_refused() {
        for bad in [
            "../x",
            "a/../../x",
            "/etc/passwd",
            "a//b",
            "./a",
            "a/.",
            "",
            "a\\..\\b",
            "a\nb",
            "..",
            "x.starling-partial",
        ] {
            assert!(safe_relative_path(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            safe_relative_path("model.safetensors").unwrap(),
            PathBuf::from("model.safetensors")
        );
        assert_eq!(
            safe_relative_path("shards/model-00001-of-00002.safetensors").unwrap(),
            PathBuf::from("shards").join("model-00001-of-00002.safetensors")
        );
        assert_eq!(
            safe_relative_path("..hidden..").unwrap(),
            PathBuf::from("..hidden..")
        );
        assert!(safe_relative_path(&"a".repeat(256)).is_err());
    }

    #[test]
    fn sources() {
        let Source::Artifact(r) = parse_source("oci://127.0.0.1:5000/models/llama:v1").unwrap()
        else {
            panic!("not an artifact")
        };
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str()),
            ("127.0.0.1:5000", "models/llama")
        );
        assert!(parse_source("oci://models/llama:v1").is_err());
        assert!(matches!(
            parse_source("https://s3.example.com/b/k?X-Amz-Signature=1").unwrap(),
            Source::Url(_)
        ));
        assert!(parse_source("ftp://x/y").is_err());
        assert!(parse_source("/local/file").is_err());
    }

    #[test]
    fn a_symlinked_directory_inside_dest_is_not_followed() {
        let dest = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), dest.path().join("sub")).unwrap();
        let rel = safe_relative_path("sub/f.bin").unwrap();
        assert!(prepare_parent(dest.path(), &rel).is_err());
        let rel = safe_relative_path("new/f.bin").unwrap();
        assert_eq!(
            prepare_parent(dest.path(), &rel).unwrap(),
            dest.path().join("new/f.bin")
        );
    }
}
