//! The node's content store: verified blobs addressed by digest and shared across
//! registries and repositories, partial downloads that survive restarts, single-flight
//! writers with cut-through readers, tags with their last known digests, pins, and GC
//! by bytes.
//!
//! Invariants:
//! - A file under `blobs/` was verified against its digest before it was moved there,
//!   and only files under `blobs/` are recorded as complete.
//! - At most one writer per digest in this process; readers of an unfinished blob never
//!   read past the bytes the writer has flushed.
//! - Pinned content, blobs being written and blobs being served are never evicted.
#![forbid(unsafe_code)]

mod blocking;
mod catalog;
mod chain_digest;
mod error;
mod eviction;
pub mod gc;
pub mod inflight;
pub mod meta;
mod piecewise;
mod space;
pub use space::available_space;
mod writer;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio::sync::watch;
use tracing::{info, warn};

pub use error::Error;
pub use inflight::{
    inflight_spans, read_file, read_inflight, DiskPush, FileSpan, Inflight, PieceState, Progress,
    Status,
};
pub use meta::{BlobRecord, PinRecord, TagRecord};
use oci::{Digest, Verifier};
pub use piecewise::{PieceWriter, RunChunkOutcome};
pub use writer::BlobWriter;

pub fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub root: PathBuf,
    /// Cache budget in bytes (blobs + partials).
    pub budget_bytes: u64,
    /// GC starts above `high × budget` and evicts down to `low × budget`.
    pub high_watermark: f64,
    pub low_watermark: f64,
    /// Space always left free on the filesystem.
    pub min_free_bytes: u64,
    /// Blobs at least this large get their blocks allocated when their download
    /// starts (`BlobWriter::reserve`); `u64::MAX`: none, 0: every blob.
    pub preallocate_from: u64,
}

impl StoreConfig {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            budget_bytes: 100 << 30,
            high_watermark: 0.90,
            low_watermark: 0.80,
            min_free_bytes: 256 << 20,
            preallocate_from: u64::MAX,
        }
    }
}

#[derive(Clone)]
pub struct Store {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    cfg: StoreConfig,
    pub(crate) db: redb::Database,
    pub(crate) blobs_dir: PathBuf,
    partial_dir: PathBuf,
    pub(crate) state: Mutex<State>,
}

/// Partial downloads idle this long are deleted by the periodic GC.
const PARTIAL_IDLE_LIMIT: std::time::Duration = std::time::Duration::from_secs(3600);

#[derive(Default)]
pub(crate) struct State {
    pub(crate) index: HashMap<Digest, BlobRecord>,
    pub(crate) inflight: HashMap<Digest, Arc<Inflight>>,
    serving: HashMap<Digest, usize>,
    dirty_access: HashSet<Digest>,
    pins: HashMap<Digest, PinRecord>,
    evictions: u64,
    evicted_bytes: u64,
    /// Keys of files named by identity, not content (see [`Store::register_identity_key`]).
    identity_keys: HashSet<Digest>,
}

/// Result of asking to write a blob.
pub enum Begin {
    /// Already complete; serve it.
    Complete(u64),
    /// Someone is downloading it; read along.
    Join(Arc<Inflight>),
    /// You are the writer. `writer.offset()` tells where to resume.
    Lead(Box<BlobWriter>),
}

/// Held while a complete blob is streamed to a client, so GC leaves it alone.
pub struct ServeGuard {
    store: Store,
    digest: Digest,
}

impl Drop for ServeGuard {
    fn drop(&mut self) {
        let mut st = self.store.inner.state.lock();
        if let Some(n) = st.serving.get_mut(&self.digest) {
            *n -= 1;
            if *n == 0 {
                st.serving.remove(&self.digest);
            }
        }
    }
}

pub struct OpenBlob {
    pub file: Arc<File>,
    pub path: PathBuf,
    pub size: u64,
    pub guard: ServeGuard,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Usage {
    pub budget_bytes: u64,
    pub used_bytes: u64,
    pub complete_blobs: u64,
    pub complete_bytes: u64,
    pub inflight: u64,
    pub inflight_bytes: u64,
    pub pinned_manifests: u64,
    pub evictions: u64,
    pub evicted_bytes: u64,
    pub free_disk_bytes: u64,
}

impl Store {
    /// Opens (or creates) a store. Partial files are kept for resumption; records whose
    /// file vanished are dropped; complete files without a record are re-verified.
    pub fn open(cfg: StoreConfig) -> Result<Self, Error> {
        let blobs_dir = cfg.root.join("blobs").join("sha256");
        let partial_dir = cfg.root.join("partial");
        for d in [&blobs_dir, &partial_dir] {
            std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
        }
        let db_path = cfg.root.join("meta.redb");
        let db = redb::Database::create(&db_path)?;
        meta::ensure_tables(&db)?;
        let mut state = State::default();
        let mut stale = Vec::new();
        for (key, rec) in meta::scan::<BlobRecord>(&db, meta::BLOBS, "")? {
            let Ok(d) = Digest::parse(&key) else {
                stale.push(key);
                continue;
            };
            let path = blobs_dir.join(d.hex());
            match std::fs::metadata(&path) {
                Ok(m) if m.len() == rec.size => {
                    state.index.insert(d, rec);
                }
                _ => {
                    warn!(digest = %d, "blob record without a matching file; forgetting it");
                    stale.push(key);
                }
            }
        }
        meta::remove(&db, meta::BLOBS, &stale)?;
        for (key, pin) in meta::scan::<PinRecord>(&db, meta::PINS, "")? {
            if let Ok(d) = Digest::parse(&key) {
                state.pins.insert(d, pin);
            }
        }
        // Files in blobs/ that the database does not know: a crash between rename and
        // commit. They were verified before the rename, but check again to be sure.
        if let Ok(rd) = std::fs::read_dir(&blobs_dir) {
            for entry in rd.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Ok(d) = Digest::parse(&format!("sha256:{name}")) else {
                    continue;
                };
                if state.index.contains_key(&d) {
                    continue;
                }
                let path = entry.path();
                if verify_file(&path, &d).is_ok() {
                    let size = entry.metadata().map(|m| m.len()).unwrap_or(0);
                    let rec = BlobRecord {
                        size,
                        media_type: None,
                        children: vec![],
                        last_access: now_secs(),
                        created: now_secs(),
                        source: "recovered".into(),
                        identity_keyed: false,
                    };
                    meta::put(&db, meta::BLOBS, &d.to_string(), &rec)?;
                    state.index.insert(d, rec);
                } else {
                    warn!(path = %path.display(), "unrecorded blob failed verification; deleting");
                    std::fs::remove_file(&path).ok();
                }
            }
        }
        info!(root = %cfg.root.display(), blobs = state.index.len(), "store opened");
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                db,
                blobs_dir,
                partial_dir,
                state: Mutex::new(state),
            }),
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.inner.cfg
    }

    /// Declares `d` the key of a file named by its identity (origin URL, validator,
    /// size) rather than by its content: its download completes without the whole-file
    /// sha256 check (which cannot hold), relying on piece verification, and its record
    /// says so. Call before [`Store::begin`] for that key.
    pub fn register_identity_key(&self, d: &Digest) {
        let mut st = self.inner.state.lock();
        if st.identity_keys.len() >= 65_536 {
            st.identity_keys.clear();
        }
        st.identity_keys.insert(d.clone());
    }

    /// Whether `d` names a file by identity: registered, or recorded so.
    pub fn is_identity_key(&self, d: &Digest) -> bool {
        let st = self.inner.state.lock();
        st.identity_keys.contains(d) || st.index.get(d).is_some_and(|r| r.identity_keyed)
    }

    pub fn blob_path(&self, d: &Digest) -> PathBuf {
        self.inner.blobs_dir.join(d.hex())
    }

    fn partial_path(&self, d: &Digest) -> PathBuf {
        self.inner.partial_dir.join(d.hex())
    }

    /// The record of a complete blob or manifest.
    pub fn stat(&self, d: &Digest) -> Option<BlobRecord> {
        self.inner.state.lock().index.get(d).cloned()
    }

    pub fn inflight(&self, d: &Digest) -> Option<Arc<Inflight>> {
        self.inner.state.lock().inflight.get(d).cloned()
    }

    /// Bytes of a partial download on disk (resumable), if any.
    pub fn partial_len(&self, d: &Digest) -> Option<u64> {
        std::fs::metadata(self.partial_path(d))
            .ok()
            .map(|m| m.len())
    }

    fn touch(&self, st: &mut State, d: &Digest) {
        if let Some(rec) = st.index.get_mut(d) {
            rec.last_access = now_secs();
            st.dirty_access.insert(d.clone());
        }
    }

    /// Opens a complete blob for serving; the guard keeps it from eviction.
    pub fn open_complete(&self, d: &Digest) -> Result<Option<OpenBlob>, Error> {
        let size = {
            let mut st = self.inner.state.lock();
            let Some(rec) = st.index.get(d) else {
                return Ok(None);
            };
            let size = rec.size;
            self.touch(&mut st, d);
            *st.serving.entry(d.clone()).or_default() += 1;
            size
        };
        let guard = ServeGuard {
            store: self.clone(),
            digest: d.clone(),
        };
        let path = self.blob_path(d);
        match File::open(&path) {
            Ok(f) => Ok(Some(OpenBlob {
                file: Arc::new(f),
                path,
                size,
                guard,
            })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // Deleted behind our back: forget it so it is fetched again.
                warn!(digest = %d, "complete blob missing on disk; forgetting it");
                drop(guard);
                self.forget(d)?;
                Ok(None)
            }
            Err(e) => Err(Error::io(&path, e)),
        }
    }

    fn forget(&self, d: &Digest) -> Result<(), Error> {
        self.inner.state.lock().index.remove(d);
        meta::remove(&self.inner.db, meta::BLOBS, &[d.to_string()])
    }

    /// Starts or joins the download of a blob. `expected_size` (from a manifest or a
    /// HEAD) lets the store check space up front and verify the length.
    pub async fn begin(
        &self,
        d: &Digest,
        expected_size: Option<u64>,
        source: &str,
    ) -> Result<Begin, Error> {
        let inflight = {
            let mut st = self.inner.state.lock();
            if let Some(rec) = st.index.get(d) {
                let size = rec.size;
                self.touch(&mut st, d);
                return Ok(Begin::Complete(size));
            }
            if let Some(inf) = st.inflight.get(d) {
                return Ok(Begin::Join(inf.clone()));
            }
            let path = self.partial_path(d);
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| Error::io(&path, e))?;
            let (tx, _) = watch::channel(Progress {
                written: 0,
                total: expected_size,
                status: Status::Running,
                verified: false,
            });
            let inf = Arc::new(Inflight {
                digest: d.clone(),
                source: source.to_owned(),
                file: Arc::new(file),
                path,
                progress: tx,
                pieces: Mutex::new(None),
                held_events: tokio::sync::broadcast::channel(1024).0,
                preallocated: std::sync::atomic::AtomicBool::new(false),
                disk_push: Default::default(),
            });
            st.inflight.insert(d.clone(), inf.clone());
            inf
        };
        let mut writer = BlobWriter::new(self.clone(), inflight.clone(), expected_size, source);
        if let Some(size) = expected_size {
            if let Err(e) = self.make_room_excluding(size, Some(d)) {
                writer.fail(&e.to_string());
                return Err(e);
            }
        }
        // Resume: re-hash what a previous run left, so verification covers every byte.
        // With a piece sidecar only the contiguous prefix is re-hashed; later pieces are
        // offered to the P2P downloader as claims it re-verifies against piece hashes.
        let sidecar = writer::Sidecar::load(&writer::sidecar_path(&inflight.path));
        let existing = inflight.file.metadata().map(|m| m.len()).unwrap_or(0);
        let limit = match &sidecar {
            Some(sc) => sc.prefix_bytes().min(existing),
            None => expected_size.unwrap_or(u64::MAX).min(existing),
        };
        if limit > 0 {
            let file = inflight.file.clone();
            let mut verifier = writer.verifier.clone();
            let truncate = sidecar.is_none();
            let rehash = tokio::task::spawn_blocking(move || -> std::io::Result<Verifier> {
                let mut pos = 0u64;
                let mut buf = vec![0u8; inflight::READ_CHUNK];
                while pos < limit {
                    let n = ((limit - pos) as usize).min(buf.len());
                    let got = file.read_at(&mut buf[..n], pos)?;
                    if got == 0 {
                        break;
                    }
                    verifier.update(&buf[..got]);
                    pos += got as u64;
                }
                if truncate {
                    file.set_len(pos)?;
                }
                Ok(verifier)
            })
            .await;
            match rehash {
                Ok(Ok(v)) => {
                    writer.written = v.len();
                    writer.verifier = v;
                    writer.claimed = sidecar;
                    info!(digest = %d, bytes = writer.written, "resuming partial download");
                    writer.publish();
                }
                _ => {
                    warn!(digest = %d, "cannot read partial file; starting over");
                    inflight.file.set_len(0).ok();
                }
            }
        } else if existing > 0 && sidecar.is_some() {
            writer.claimed = sidecar;
        }
        Ok(Begin::Lead(Box::new(writer)))
    }

    pub(crate) fn make_room_excluding_pub(
        &self,
        needed: u64,
        exclude: Option<&Digest>,
    ) -> Result<(), Error> {
        self.make_room_excluding(needed, exclude)
    }

    /// Downloads in progress: digest, bytes on disk in order, total when known.
    pub fn inflight_list(&self) -> Vec<(Digest, u64, Option<u64>)> {
        self.inner
            .state
            .lock()
            .inflight
            .iter()
            .map(|(d, i)| {
                let p = i.progress();
                (d.clone(), p.written, p.total)
            })
            .collect()
    }

    /// Complete blobs with their records (for the inventory).
    pub fn list(&self) -> Vec<(Digest, BlobRecord)> {
        self.inner
            .state
            .lock()
            .index
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Writes batched access times to the database.
    pub fn flush_access(&self) -> Result<(), Error> {
        let items: Vec<(String, BlobRecord)> = {
            let mut st = self.inner.state.lock();
            let dirty: Vec<Digest> = st.dirty_access.drain().collect();
            dirty
                .into_iter()
                .filter_map(|d| st.index.get(&d).map(|r| (d.to_string(), r.clone())))
                .collect()
        };
        if items.is_empty() {
            return Ok(());
        }
        meta::put_many(&self.inner.db, meta::BLOBS, &items)
    }
}

fn verify_file(path: &Path, d: &Digest) -> Result<(), Error> {
    use std::io::Read;
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut v = Verifier::new(d.clone());
    let mut buf = vec![0u8; inflight::READ_CHUNK];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        v.update(&buf[..n]);
    }
    Ok(v.finish()?)
}
