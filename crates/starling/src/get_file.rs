//! One file of `starling get`: where its bytes come from (the local agent's mirror or
//! file route, or straight from the registry or the origin), and how they land in DEST:
//! a hidden partial file next to the destination, appended to and hashed on a blocking
//! thread, resumed with `Range` after a cut or a restart, checked against the digest
//! (when there is one) and renamed into place. Memory per file is a few chunks in a
//! bounded channel, whatever the file's size.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use oci::Digest;
use sha2::{Digest as _, Sha256};

use crate::get_cmd::Progress;

/// Chunks queued between the network and the writer thread.
const WRITE_QUEUE: usize = 8;
/// Re-opens after a cut body before giving up (each resumes where the file ends).
const MAX_REOPENS: u32 = 5;
/// Error bodies are read up to this size.
const MAX_ERROR_BODY: usize = 64 << 10;
/// The agent's answer header naming where the bytes come from.
pub(crate) const SOURCE_HEADER: &str = "starling-source";
/// The agent's answer header naming a URL's key in its cache and the swarm.
pub(crate) const KEY_HEADER: &str = "starling-file-key";

/// Where one file's bytes come from.
#[derive(Clone)]
pub(crate) enum Origin {
    /// A blob through the local agent's `/v2` mirror (`?ns=` names the registry).
    AgentBlob {
        agent: String,
        registry: String,
        repo: String,
    },
    /// A blob straight from the registry (no agent reachable).
    DirectBlob {
        upstream: oci::Upstream,
        registry: String,
        repo: String,
    },
    /// A URL through the local agent's file route.
    AgentUrl { agent: String, url: String },
    /// A URL straight from the origin (no agent reachable).
    DirectUrl { url: String },
}

pub(crate) struct FileJob {
    /// The name shown and reported (relative to DEST for artifacts).
    pub name: String,
    pub path: PathBuf,
    pub size: Option<u64>,
    pub digest: Option<Digest>,
    pub origin: Origin,
}

#[derive(Debug, serde::Serialize)]
pub(crate) struct FileReport {
    pub name: String,
    pub path: PathBuf,
    pub bytes: u64,
    /// sha256 of what was written (equal to the expected digest when there was one).
    pub sha256: String,
    /// Whether the whole file was checked against a digest known in advance.
    pub verified_digest: bool,
    /// Bytes already on disk from an interrupted get.
    pub resumed_from: u64,
    /// Bytes fetched by this run.
    pub fetched: u64,
    /// Where the agent said the bytes came from (`cache`, `swarm`, `registry`,
    /// `passthrough`), or `direct`.
    pub source: String,
    /// The file's key in the agent's cache and the swarm (a URL's content digest or
    /// identity key), as the agent said; `starling where` finds it under
    /// `…@<key>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Already complete in DEST (verified by re-hashing), nothing fetched.
    pub already_present: bool,
    pub seconds: f64,
}

/// An opened body: where it starts, the whole file's size and its identity.
struct Opened {
    total: u64,
    source: String,
    /// ETag (or Last-Modified) of a URL, to notice an origin that changes.
    identity: Option<String>,
    /// The agent's `starling-file-key`.
    key: Option<String>,
    stream: std::pin::Pin<Box<dyn Stream<Item = Result<Bytes>> + Send>>,
}

/// The partial file of a destination: hidden, next to it (so the rename stays on one
/// filesystem), named by the content it will hold so another file's partial is never
/// resumed.
pub(crate) fn partial_path(path: &Path, digest: Option<&Digest>) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let key = digest.map_or("url", |d| &d.hex()[..16]);
    path.with_file_name(format!(".{name}.{key}.starling-partial"))
}

/// The identity (ETag/Last-Modified) a partial of a URL was started with.
fn identity_path(partial: &Path) -> PathBuf {
    let mut s = partial.as_os_str().to_owned();
    s.push(".id");
    PathBuf::from(s)
}

pub(crate) async fn fetch_file(
    http: &reqwest::Client,
    job: &FileJob,
    progress: &Arc<Progress>,
) -> Result<FileReport> {
    let started = std::time::Instant::now();
    if let (Some(d), Ok(meta)) = (&job.digest, std::fs::symlink_metadata(&job.path)) {
        if meta.is_file() && job.size.is_none_or(|s| s == meta.len()) {
            let (path, d2) = (job.path.clone(), d.clone());
            let same = tokio::task::spawn_blocking(move || hash_prefix(&path, u64::MAX))
                .await?
                .is_ok_and(|(_, h)| h == d2);
            if same {
                progress.skip(meta.len());
                return Ok(FileReport {
                    name: job.name.clone(),
                    path: job.path.clone(),
                    bytes: meta.len(),
                    sha256: d.to_string(),
                    verified_digest: true,
                    resumed_from: 0,
                    fetched: 0,
                    source: "dest".into(),
                    key: None,
                    already_present: true,
                    seconds: started.elapsed().as_secs_f64(),
                });
            }
        }
    }
    let partial = partial_path(&job.path, job.digest.as_ref());
    let id_file = identity_path(&partial);
    let mut start = std::fs::metadata(&partial).map_or(0, |m| m.len());
    // Without a digest, a partial is only resumed against the identity it started with.
    let saved_identity = if job.digest.is_none() && start > 0 {
        std::fs::read_to_string(&id_file).ok()
    } else {
        None
    };
    if job.digest.is_none() && start > 0 && saved_identity.is_none() {
        start = 0;
    }
    if job.size.is_some_and(|s| start > s) {
        start = 0;
    }
    let mut opened = match open(http, job, start, saved_identity.as_deref()).await {
        Ok(o) => o,
        Err(e) => {
            // A partial of a version the origin no longer serves can never be resumed.
            if e.is::<OriginChanged>() {
                remove_partial(&partial);
            }
            return Err(e);
        }
    };
    if let Some(saved) = &saved_identity {
        if opened.identity.as_deref() != Some(saved.as_str()) {
            remove_partial(&partial);
            bail!(
                "{}: the origin's file changed since the interrupted get (identity {saved} → {}); \
                 the partial file was removed, run the get again to start over",
                job.name,
                opened.identity.as_deref().unwrap_or("none")
            );
        }
    }
    let total = opened.total;
    if let Some(size) = job.size {
        if total != size {
            bail!(
                "{}: the source has {total} bytes, the manifest says {size}",
                job.name
            );
        }
    }
    if start > total {
        bail!(
            "{}: partial file longer than the file; remove {}",
            job.name,
            partial.display()
        );
    }
    let dir = job.path.parent().unwrap_or(Path::new("."));
    let free = store::available_space(dir).unwrap_or(u64::MAX);
    if total - start > free {
        bail!(
            "{}: needs {} more bytes, {} has {} free",
            job.name,
            total - start,
            dir.display(),
            free
        );
    }
    if job.digest.is_none() {
        match &opened.identity {
            Some(id) => std::fs::write(&id_file, id)
                .with_context(|| format!("writing {}", id_file.display()))?,
            None => {
                let _ = std::fs::remove_file(&id_file);
            }
        }
    }
    let writer = Writer::start(&partial, start)?;
    let mut pos = start;
    let mut reopens = 0;
    let mut cuts_before_last_byte = 0;
    let mut fetched = 0u64;
    let source = opened.source.clone();
    let outcome: Result<()> = async {
        loop {
            while let Some(chunk) = opened.stream.next().await {
                match chunk {
                    Ok(c) => {
                        let n = c.len() as u64;
                        if pos + n > total {
                            bail!("{}: the source sent more than {total} bytes", job.name);
                        }
                        writer.send(c).await?;
                        pos += n;
                        fetched += n;
                        progress.add(&opened.source, n);
                    }
                    Err(e) => {
                        tracing::warn!(file = %job.name, offset = pos, error = %format!("{e:#}"), "body cut; resuming");
                        break;
                    }
                }
            }
            if pos == total {
                return Ok(());
            }
            // The agent holds a blob's last byte back until the whole content is
            // verified; a body that stops there twice means verification failed.
            if pos + 1 == total && job.digest.is_some() {
                cuts_before_last_byte += 1;
                if cuts_before_last_byte >= 2 {
                    return Err(anyhow!(SourceRefused {
                        status: 409,
                        message: format!(
                            "the agent could not verify the content against {}: it does not \
                             match its digest (wrong --digest, or the origin sends other bytes)",
                            job.digest.as_ref().map_or(String::new(), |d| d.to_string())
                        ),
                    }))
                    .with_context(|| job.name.clone());
                }
            }
            reopens += 1;
            if reopens > MAX_REOPENS {
                bail!("{}: the source keeps cutting the body (at byte {pos} of {total})", job.name);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200 * u64::from(reopens))).await;
            let id = opened.identity.clone();
            opened = open(http, job, pos, id.as_deref()).await?;
            if opened.total != total || opened.identity != id {
                return Err(anyhow!(OriginChanged(format!(
                    "{}: the origin's file changed during the get (size {total} → {}, identity {} → {})",
                    job.name,
                    opened.total,
                    id.as_deref().unwrap_or("none"),
                    opened.identity.as_deref().unwrap_or("none")
                ))));
            }
        }
    }
    .await;
    let written = writer.finish().await;
    if let Err(e) = outcome {
        // The writer's own failure (a full disk) explains a stopped writer best.
        let e = match written {
            Err(w) => {
                if is_disk_full(&w) {
                    remove_partial(&partial);
                    return Err(
                        w.context(format!("{}: the disk is full; nothing was kept", job.name))
                    );
                }
                w
            }
            Ok(_) => e,
        };
        // A changed origin or bad content leaves nothing; a cut keeps the partial.
        if e.is::<OriginChanged>() || is_definitive(&e) {
            remove_partial(&partial);
        }
        return Err(e);
    }
    // Without a digest nothing checks the whole file: the origin must still name the
    // version the get started with (an in-place rewrite can mix two versions).
    if job.digest.is_none() {
        let now = current_identity(http, job).await?;
        if now != opened.identity {
            remove_partial(&partial);
            bail!(OriginChanged(format!(
                "{}: the origin's file changed during the get (identity {} → {}); nothing was kept",
                job.name,
                opened.identity.as_deref().unwrap_or("none"),
                now.as_deref().unwrap_or("none")
            )));
        }
    }
    let (len, sha) = match written {
        Ok(w) => w,
        Err(e) => {
            if is_disk_full(&e) {
                remove_partial(&partial);
            }
            return Err(e);
        }
    };
    if len != total {
        bail!("{}: wrote {len} bytes of {total}", job.name);
    }
    if let Some(d) = &job.digest {
        if &sha != d {
            remove_partial(&partial);
            bail!(
                "{}: content does not match its digest (expected {d}, got {sha}); nothing was kept",
                job.name
            );
        }
    }
    std::fs::rename(&partial, &job.path)
        .with_context(|| format!("renaming into {}", job.path.display()))?;
    let _ = std::fs::remove_file(&id_file);
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(FileReport {
        name: job.name.clone(),
        path: job.path.clone(),
        bytes: total,
        sha256: sha.to_string(),
        verified_digest: job.digest.is_some(),
        resumed_from: start,
        fetched,
        source,
        key: opened.key.clone(),
        already_present: false,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// An origin whose file changed under the get: the partial is worthless.
#[derive(Debug)]
struct OriginChanged(String);

impl std::fmt::Display for OriginChanged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for OriginChanged {}

/// Errors from the agent that say the content itself is wrong or gone.
fn is_definitive(e: &anyhow::Error) -> bool {
    e.downcast_ref::<SourceRefused>()
        .is_some_and(|r| matches!(r.status, 404 | 409 | 410 | 412))
}

fn is_disk_full(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(28))
    })
}

fn remove_partial(partial: &Path) {
    let _ = std::fs::remove_file(partial);
    let _ = std::fs::remove_file(identity_path(partial));
}

/// An HTTP answer other than 200/206 from the agent or the origin.
#[derive(Debug)]
pub(crate) struct SourceRefused {
    pub status: u16,
    pub message: String,
}

impl std::fmt::Display for SourceRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}: {}", self.status, self.message)
    }
}

impl std::error::Error for SourceRefused {}

async fn open(
    http: &reqwest::Client,
    job: &FileJob,
    start: u64,
    if_range: Option<&str>,
) -> Result<Opened> {
    let d = job.digest.as_ref();
    let (req, source_default) = match &job.origin {
        Origin::DirectBlob {
            upstream,
            registry,
            repo,
        } => {
            let d = d.context("a blob without a digest")?;
            let r = upstream
                .get_blob_range(registry, repo, d, start, None)
                .await
                .with_context(|| format!("{}: fetching {d} from {registry}", job.name))?;
            let total = r
                .total
                .or(job.size)
                .context("the registry sent no length")?;
            return Ok(Opened {
                total,
                source: "direct".into(),
                identity: None,
                key: None,
                stream: Box::pin(r.stream.map(|c| c.map_err(anyhow::Error::from))),
            });
        }
        Origin::AgentBlob {
            agent,
            registry,
            repo,
        } => {
            let d = d.context("a blob without a digest")?;
            let url = format!("{agent}/v2/{repo}/blobs/{d}?ns={}", enc(registry));
            (http.get(url), "agent")
        }
        Origin::AgentUrl { agent, url } => {
            let mut u = format!("{agent}/files/v1/fetch?url={}", enc(url));
            if let Some(d) = d {
                u.push_str(&format!("&digest={d}"));
            }
            (http.get(u), "agent")
        }
        Origin::DirectUrl { url } => (http.get(url), "direct"),
    };
    let mut req = req;
    if start > 0 {
        req = req.header(reqwest::header::RANGE, format!("bytes={start}-"));
        if let Some(id) = if_range {
            req = req.header(reqwest::header::IF_RANGE, id);
        }
    }
    let resp = req
        .send()
        .await
        .map_err(without_url)
        .with_context(|| format!("{}: connecting to {}", job.name, peer_name(&job.origin)))?;
    let status = resp.status().as_u16();
    if status != 200 && status != 206 {
        let message = error_message(resp).await;
        return Err(anyhow!(SourceRefused { status, message })).with_context(|| job.name.clone());
    }
    let headers = resp.headers().clone();
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let identity = header("etag")
        .or(header("last-modified"))
        .map(str::to_owned);
    let total = if status == 206 {
        let cr = header("content-range").unwrap_or("");
        let (first, total) = oci::upstream::parse_content_range(cr)
            .with_context(|| format!("{}: bad Content-Range {cr:.80}", job.name))?;
        if first != start {
            bail!("{}: asked for byte {start}, got {first}", job.name);
        }
        total.with_context(|| format!("{}: Content-Range without a size", job.name))?
    } else {
        let len = resp
            .content_length()
            .with_context(|| format!("{}: no Content-Length", job.name))?;
        if start > 0 {
            // The range was refused or If-Range did not match: the file changed.
            return Err(anyhow!(OriginChanged(format!(
                "{}: the origin answered the resume at byte {start} with the whole file \
                 (it changed, or ignores Range)",
                job.name
            ))));
        }
        len
    };
    let source = header(SOURCE_HEADER).unwrap_or(source_default).to_owned();
    let key = header(KEY_HEADER).map(str::to_owned);
    Ok(Opened {
        total,
        source,
        identity,
        key,
        stream: Box::pin(resp.bytes_stream().map(|c| c.map_err(without_url))),
    })
}

/// The origin's validator now (through the agent, which asks the origin afresh).
async fn current_identity(http: &reqwest::Client, job: &FileJob) -> Result<Option<String>> {
    let req = match &job.origin {
        Origin::AgentUrl { agent, url } => {
            http.head(format!("{agent}/files/v1/fetch?url={}", enc(url)))
        }
        Origin::DirectUrl { url } => http.get(url).header(reqwest::header::RANGE, "bytes=0-0"),
        _ => return Ok(None),
    };
    let resp = req
        .send()
        .await
        .map_err(without_url)
        .with_context(|| format!("{}: checking the origin's version", job.name))?;
    let status = resp.status().as_u16();
    if status != 200 && status != 206 {
        let message = error_message(resp).await;
        return Err(anyhow!(SourceRefused { status, message }))
            .with_context(|| format!("{}: checking the origin's version", job.name));
    }
    let h = resp.headers();
    Ok(h.get("etag")
        .or(h.get("last-modified"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned))
}

/// Whom a request of `origin` goes to, for messages: the agent, or the origin's URL
/// without its query and user info.
fn peer_name(origin: &Origin) -> String {
    match origin {
        Origin::AgentBlob { agent, .. } | Origin::AgentUrl { agent, .. } => {
            format!("the agent at {agent}")
        }
        Origin::DirectUrl { url } => oci::upstream::policy::redact_url(url),
        Origin::DirectBlob { registry, .. } => registry.clone(),
    }
}

/// reqwest names the whole URL in its errors: a presigned signature (in the URL, or in
/// the agent URL's `?url=`) must not reach the terminal or logs.
fn without_url(e: reqwest::Error) -> anyhow::Error {
    anyhow::Error::from(e.without_url())
}

fn enc(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// The OCI error body's messages, or the start of whatever the body is.
async fn error_message(resp: reqwest::Response) -> String {
    let mut out = Vec::new();
    let mut body = resp.bytes_stream();
    while let Some(Ok(c)) = body.next().await {
        out.extend_from_slice(&c[..c.len().min(MAX_ERROR_BODY - out.len())]);
        if out.len() >= MAX_ERROR_BODY {
            break;
        }
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out) {
        if let Some(errors) = v["errors"].as_array() {
            let parts: Vec<String> = errors
                .iter()
                .map(|e| {
                    format!(
                        "{} {}",
                        e["code"].as_str().unwrap_or(""),
                        e["message"].as_str().unwrap_or("")
                    )
                })
                .collect();
            return parts.join("; ");
        }
    }
    let text = String::from_utf8_lossy(&out);
    text.chars().take(300).collect::<String>().trim().to_owned()
}

/// Appends to the partial file and hashes on a blocking thread.
struct Writer {
    tx: tokio::sync::mpsc::Sender<Bytes>,
    done: tokio::task::JoinHandle<Result<(u64, Digest)>>,
}

impl Writer {
    fn start(partial: &Path, start: u64) -> Result<Writer> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(WRITE_QUEUE);
        let path = partial.to_owned();
        let done = tokio::task::spawn_blocking(move || -> Result<(u64, Digest)> {
            let mut hasher = Sha256::new();
            if start > 0 {
                // Resume: the bytes already there count towards the hash.
                let mut f = std::fs::File::open(&path)?;
                let mut buf = vec![0u8; 1 << 20];
                let mut left = start;
                while left > 0 {
                    let n = f.read(&mut buf[..(left.min(1 << 20)) as usize])?;
                    if n == 0 {
                        bail!("partial file shorter than expected");
                    }
                    hasher.update(&buf[..n]);
                    left -= n as u64;
                }
            }
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(false)
                .open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            f.set_len(start)?;
            // Its data goes to the disk as it comes, not all at the fsync below
            // (`store::DiskPush`: with eight gets of 512 MiB on one disk, each fsync
            // wrote its whole file at once, and the others waited on the disk).
            let for_push = std::sync::Arc::new(f.try_clone()?);
            let push = std::sync::Arc::new(store::DiskPush::default());
            let mut f = std::io::BufWriter::with_capacity(1 << 20, {
                use std::io::Seek;
                f.seek(std::io::SeekFrom::Start(start))?;
                f
            });
            let mut len = start;
            while let Some(c) = rx.blocking_recv() {
                f.write_all(&c)
                    .with_context(|| format!("writing {}", path.display()))?;
                hasher.update(&c);
                len += c.len() as u64;
                push.note_written(&for_push, c.len() as u64);
            }
            let f = f.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
            Ok((len, Digest::from_sha256(hasher.finalize().into())))
        });
        Ok(Writer { tx, done })
    }

    async fn send(&self, c: Bytes) -> Result<()> {
        if self.tx.send(c).await.is_err() {
            bail!("the writer stopped");
        }
        Ok(())
    }

    async fn finish(self) -> Result<(u64, Digest)> {
        drop(self.tx);
        match self.done.await {
            Ok(r) => r,
            Err(e) => Err(anyhow!("writer thread: {e}")),
        }
    }
}

/// sha256 of the first `limit` bytes of a file, and how many there were.
fn hash_prefix(path: &Path, limit: u64) -> Result<(u64, Digest)> {
    let mut f = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n_total = 0u64;
    while n_total < limit {
        let want = (limit - n_total).min(buf.len() as u64) as usize;
        let n = f.read(&mut buf[..want])?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        n_total += n as u64;
    }
    Ok((n_total, Digest::from_sha256(hasher.finalize().into())))
}
