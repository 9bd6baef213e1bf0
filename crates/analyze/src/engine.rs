//! Streams layers: sniffs the compression (gzip, zstd or plain tar), decompresses,
//! reads tar headers and skips content (hashing it only when asked), with a cap on
//! decompressed bytes. Layers are processed in parallel on a bounded set of threads.
//! Nothing is written anywhere: every layer becomes a list of [`LayerEntry`]s.

use std::cell::RefCell;
use std::io::{self, BufRead, BufReader, Read};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use oci::{Descriptor, Digest};
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::source::LayerOpener;

/// How to scan.
#[derive(Clone, Debug)]
pub struct ScanOptions {
    /// Hash file contents (sha256) — needed by `diff` for file-level reuse.
    pub hash_files: bool,
    /// Stop a layer after this many decompressed bytes (decompression bomb guard).
    pub max_layer_bytes: u64,
    /// Stop a layer whose decompressed/compressed ratio exceeds this, once past
    /// `ratio_grace` decompressed bytes.
    pub max_ratio: u64,
    pub ratio_grace: u64,
    /// Worker threads; 0 = available parallelism.
    pub jobs: usize,
    /// Check each blob against its digest.
    pub verify_digests: bool,
}

impl Default for ScanOptions {
    fn default() -> Self {
        Self {
            hash_files: false,
            max_layer_bytes: 64 << 30,
            max_ratio: 1000,
            ratio_grace: 1 << 30,
            jobs: 0,
            verify_digests: true,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    Gzip,
    Zstd,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Hardlink,
    Other,
    /// `.wh.<name>`: `path` is the removed path.
    Whiteout,
    /// `.wh..wh..opq`: `path` is the directory made opaque.
    Opaque,
}

/// One tar entry, normalized (relative, no `.`/`..`, no trailing slash).
#[derive(Clone, Debug, Serialize)]
pub struct LayerEntry {
    pub path: String,
    pub kind: EntryKind,
    /// Bytes the entry carries in the layer (0 for links and directories).
    pub size: u64,
    /// Symlink or hard-link target.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
    #[serde(skip)]
    pub hash: Option<[u8; 32]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProblemKind {
    Open,
    Truncated,
    Corrupt,
    DecompressionBomb,
    UnsafePath,
    SizeMismatch,
    DigestMismatch,
    UnknownMediaType,
    DanglingHardlink,
}

/// Something wrong with the input, reported instead of crashing.
#[derive(Clone, Debug, Serialize)]
pub struct Problem {
    pub layer: Option<usize>,
    pub kind: ProblemKind,
    pub message: String,
}

/// What one layer holds.
#[derive(Clone, Debug, Serialize)]
pub struct LayerScan {
    pub index: usize,
    pub digest: Digest,
    pub media_type: String,
    /// Size the manifest declares.
    pub declared_size: u64,
    /// Bytes actually read from the blob.
    pub compressed_size: u64,
    /// Bytes of the decompressed tar stream.
    pub uncompressed_size: u64,
    pub compression: Compression,
    #[serde(skip)]
    pub entries: Vec<LayerEntry>,
    pub problems: Vec<Problem>,
    /// Harmless oddities (e.g. a tar stream missing its final padding).
    pub notes: Vec<String>,
    /// The whole layer was read without error.
    pub complete: bool,
}

impl LayerScan {
    /// A layer that was not read (shared with another image).
    pub fn empty(index: usize, desc: &Descriptor) -> Self {
        Self::new(index, desc)
    }

    fn new(index: usize, desc: &Descriptor) -> Self {
        Self {
            index,
            digest: desc.digest.clone(),
            media_type: desc.media_type.clone(),
            declared_size: desc.size,
            compressed_size: 0,
            uncompressed_size: 0,
            compression: Compression::None,
            entries: Vec::new(),
            problems: Vec::new(),
            notes: Vec::new(),
            complete: false,
        }
    }

    fn problem(&mut self, kind: ProblemKind, message: impl Into<String>) {
        self.problems.push(Problem {
            layer: Some(self.index),
            kind,
            message: message.into(),
        });
    }
}

/// Whether a layer media type is one the analyzer can read.
pub fn is_known_layer_type(mt: &str) -> bool {
    if mt.contains("encrypted") {
        return false;
    }
    mt.is_empty()
        || mt.starts_with("application/vnd.oci.image.layer.")
        || mt.starts_with("application/vnd.docker.image.rootfs.")
}

/// Scans every layer of `layers` in parallel; results are in layer order.
pub fn scan_layers(
    opener: &dyn LayerOpener,
    layers: &[Descriptor],
    opts: &ScanOptions,
) -> Vec<LayerScan> {
    let jobs = if opts.jobs == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    } else {
        opts.jobs
    }
    .clamp(1, layers.len().max(1));
    // Largest first: the longest job starts early, which balances the threads.
    let mut order: Vec<usize> = (0..layers.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(layers[i].size));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<LayerScan>>> = Mutex::new(vec![None; layers.len()]);
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(&i) = order.get(k) else { break };
                let scan = scan_layer(opener, i, &layers[i], opts);
                if let Ok(mut r) = results.lock() {
                    r[i] = Some(scan);
                }
            });
        }
    });
    let results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    results
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            r.unwrap_or_else(|| {
                let mut l = LayerScan::new(i, &layers[i]);
                l.problem(ProblemKind::Open, "layer was not scanned");
                l
            })
        })
        .collect()
}

struct RawState<'a> {
    reader: Box<dyn Read + Send + 'a>,
    n: u64,
    hasher: Option<Sha256>,
}

/// Reads the blob through a shared handle so that the tail can be drained after
/// the decompressor is done (for the size and digest checks).
struct Counting<'a>(Rc<RefCell<RawState<'a>>>);

impl Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut st = self.0.borrow_mut();
        let n = st.reader.read(buf)?;
        st.n += n as u64;
        if let Some(h) = st.hasher.as_mut() {
            h.update(&buf[..n]);
        }
        Ok(n)
    }
}

const BOMB: &str = "decompression cap exceeded";

struct Capped<'a, R> {
    inner: R,
    n: u64,
    cap: u64,
    max_ratio: u64,
    grace: u64,
    raw: Rc<RefCell<RawState<'a>>>,
    tripped: Rc<RefCell<Option<String>>>,
}

impl<R: Read> Read for Capped<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        if self.n > self.cap {
            *self.tripped.borrow_mut() = Some(format!(
                "decompressed size passed the cap of {} bytes; stopped reading",
                self.cap
            ));
            return Err(io::Error::other(BOMB));
        }
        if self.n > self.grace {
            let c = self.raw.borrow().n.max(1);
            if self.n / c > self.max_ratio {
                *self.tripped.borrow_mut() = Some(format!(
                    "compression ratio above {}:1 ({} bytes from {c}); stopped reading",
                    self.max_ratio, self.n
                ));
                return Err(io::Error::other(BOMB));
            }
        }
        Ok(n)
    }
}

/// Some writers (umoci 0.4.7 among them) end the tar stream right after the last
/// file's data, without the padding to 512 bytes and the end-of-archive blocks. When
/// the stream ends exactly where an entry's data ends, the missing zeros are supplied
/// (and noted); an end anywhere else stays a truncation.
struct Tolerant<R> {
    inner: R,
    pos: u64,
    data_end: Rc<std::cell::Cell<u64>>,
    synth: u64,
    padded: Rc<std::cell::Cell<bool>>,
}

impl<R: Read> Read for Tolerant<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.synth > 0 {
            let n = (buf.len() as u64).min(self.synth) as usize;
            buf[..n].fill(0);
            self.synth -= n as u64;
            return Ok(n);
        }
        let n = self.inner.read(buf)?;
        self.pos += n as u64;
        if n == 0
            && !buf.is_empty()
            && !self.padded.get()
            && !self.pos.is_multiple_of(512)
            && self.pos == self.data_end.get()
        {
            self.padded.set(true);
            self.synth = (512 - self.pos % 512) + 1024;
            return self.read(buf);
        }
        Ok(n)
    }
}

/// Why a tar path is unsafe to place under the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsafePath(pub String);

impl std::fmt::Display for UnsafePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Normalizes a tar path; `Err` explains why it is unsafe.
pub fn normalize_path(raw: &[u8]) -> std::result::Result<String, UnsafePath> {
    let s = String::from_utf8_lossy(raw);
    if s.trim_matches('/').is_empty() {
        return Ok(String::new()); // the root directory itself
    }
    if s.starts_with('/') {
        return Err(UnsafePath(format!("absolute path {s:.200}")));
    }
    let mut parts = Vec::new();
    for c in s.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err(UnsafePath(format!("path escapes the root: {s:.200}"))),
            c => parts.push(c),
        }
    }
    Ok(parts.join("/"))
}

fn classify_error(e: &io::Error, tripped: &Option<String>) -> (ProblemKind, String) {
    if let Some(t) = tripped {
        return (ProblemKind::DecompressionBomb, t.clone());
    }
    let msg = e.to_string();
    let lower = msg.to_ascii_lowercase();
    if e.kind() == io::ErrorKind::UnexpectedEof
        || lower.contains("unexpected eof")
        || lower.contains("unexpected end")
        || lower.contains("incomplete")
        || lower.contains("failed to fill whole buffer")
        || lower.contains("truncated")
    {
        (ProblemKind::Truncated, format!("layer ends early: {msg}"))
    } else {
        (ProblemKind::Corrupt, format!("layer is corrupt: {msg}"))
    }
}

/// Scans one layer; never panics on bad input, reports problems instead.
pub fn scan_layer(
    opener: &dyn LayerOpener,
    index: usize,
    desc: &Descriptor,
    opts: &ScanOptions,
) -> LayerScan {
    let mut scan = LayerScan::new(index, desc);
    if !is_known_layer_type(&desc.media_type) {
        scan.problem(
            ProblemKind::UnknownMediaType,
            format!(
                "unknown layer media type {:.200}; layer skipped",
                desc.media_type
            ),
        );
        return scan;
    }
    let reader = match opener.open_layer(desc) {
        Ok(r) => r,
        Err(e) => {
            scan.problem(ProblemKind::Open, format!("cannot open layer: {e}"));
            return scan;
        }
    };
    let raw = Rc::new(RefCell::new(RawState {
        reader,
        n: 0,
        hasher: opts.verify_digests.then(Sha256::new),
    }));
    let mut buffered = BufReader::with_capacity(256 << 10, Counting(raw.clone()));
    let magic = match buffered.fill_buf() {
        Ok(b) => b.get(..4).map(|m| m.to_vec()).unwrap_or_else(|| b.to_vec()),
        Err(e) => {
            scan.problem(ProblemKind::Open, format!("cannot read layer: {e}"));
            return scan;
        }
    };
    let decoder: Box<dyn Read + '_> = if magic.starts_with(&[0x1f, 0x8b]) {
        scan.compression = Compression::Gzip;
        Box::new(flate2::bufread::MultiGzDecoder::new(buffered))
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        scan.compression = Compression::Zstd;
        match zstd::stream::read::Decoder::with_buffer(buffered) {
            Ok(d) => Box::new(d),
            Err(e) => {
                scan.problem(ProblemKind::Corrupt, format!("zstd: {e}"));
                return scan;
            }
        }
    } else {
        Box::new(buffered)
    };
    let tripped = Rc::new(RefCell::new(None));
    let capped = Capped {
        inner: decoder,
        n: 0,
        cap: opts.max_layer_bytes,
        max_ratio: opts.max_ratio.max(1),
        grace: opts.ratio_grace,
        raw: raw.clone(),
        tripped: tripped.clone(),
    };
    let data_end = Rc::new(std::cell::Cell::new(0));
    let padded = Rc::new(std::cell::Cell::new(false));
    let tolerant = Tolerant {
        inner: capped,
        pos: 0,
        data_end: data_end.clone(),
        synth: 0,
        padded: padded.clone(),
    };
    let mut archive = tar::Archive::new(tolerant);
    let mut failed = false;
    let result = read_entries(&mut archive, &mut scan, opts.hash_files, &data_end);
    if padded.get() {
        scan.notes.push(
            "tar stream ends without padding/end-of-archive blocks after complete data (tolerated)"
                .into(),
        );
    }
    match result {
        Ok(()) => {
            // Drain the end-of-archive padding so sizes and digests cover the whole blob.
            let mut rest = archive.into_inner();
            let drained = io::copy(&mut rest, &mut io::sink());
            scan.uncompressed_size = rest.inner.n;
            if let Err(e) = drained {
                let (k, m) = classify_error(&e, &tripped.borrow());
                scan.problem(k, m);
                failed = true;
            }
        }
        Err(e) => {
            let (k, m) = classify_error(&e, &tripped.borrow());
            scan.problem(k, m);
            scan.uncompressed_size = archive.into_inner().inner.n;
            failed = true;
        }
    }
    if !failed {
        // Trailing bytes after the compressed stream still belong to the blob.
        let drained = {
            let mut st = raw.borrow_mut();
            let mut tail = 0u64;
            let mut buf = [0u8; 8192];
            loop {
                match st.reader.read(&mut buf) {
                    Ok(0) => break Ok(tail),
                    Ok(n) => {
                        tail += n as u64;
                        st.n += n as u64;
                        if let Some(h) = st.hasher.as_mut() {
                            h.update(&buf[..n]);
                        }
                    }
                    Err(e) => break Err(e),
                }
            }
        };
        let st_n = raw.borrow().n;
        scan.compressed_size = st_n;
        if let Err(e) = drained {
            scan.problem(
                ProblemKind::Truncated,
                format!("reading the blob failed: {e}"),
            );
            failed = true;
        }
        if st_n != desc.size {
            scan.problem(
                ProblemKind::SizeMismatch,
                format!(
                    "manifest says the layer is {} bytes; the blob has {st_n}",
                    desc.size
                ),
            );
        }
        if let Some(h) = raw.borrow_mut().hasher.take() {
            let got = Digest::from_sha256(h.finalize().into());
            if got != desc.digest && st_n == desc.size {
                scan.problem(
                    ProblemKind::DigestMismatch,
                    format!("content hashes to {got}, not {}", desc.digest),
                );
            }
        }
    } else {
        scan.compressed_size = raw.borrow().n;
    }
    scan.complete = !failed;
    scan
}

fn read_entries<R: Read>(
    archive: &mut tar::Archive<R>,
    scan: &mut LayerScan,
    hash: bool,
    data_end: &std::cell::Cell<u64>,
) -> io::Result<()> {
    for entry in archive.entries()? {
        let mut entry = entry?;
        data_end.set(entry.raw_file_position() + entry.size());
        let et = entry.header().entry_type();
        let raw_path = entry.path_bytes().into_owned();
        let path = match normalize_path(&raw_path) {
            Ok(p) => p,
            Err(why) => {
                scan.problem(ProblemKind::UnsafePath, format!("tar entry skipped: {why}"));
                continue;
            }
        };
        if path.is_empty() {
            continue;
        }
        let (parent, base) = match path.rsplit_once('/') {
            Some((p, b)) => (p, b),
            None => ("", path.as_str()),
        };
        let join = |name: &str| {
            if parent.is_empty() {
                name.to_owned()
            } else {
                format!("{parent}/{name}")
            }
        };
        if base == ".wh..wh..opq" {
            scan.entries.push(LayerEntry {
                path: parent.to_owned(),
                kind: EntryKind::Opaque,
                size: 0,
                link: None,
                hash: None,
            });
            continue;
        }
        if base.starts_with(".wh..wh.") {
            continue; // aufs metadata (.wh..wh.plnk, .wh..wh.aufs)
        }
        if let Some(name) = base.strip_prefix(".wh.") {
            scan.entries.push(LayerEntry {
                path: join(name),
                kind: EntryKind::Whiteout,
                size: 0,
                link: None,
                hash: None,
            });
            continue;
        }
        let link = if matches!(et, tar::EntryType::Link | tar::EntryType::Symlink) {
            entry
                .link_name_bytes()
                .map(|b| String::from_utf8_lossy(&b).into_owned())
        } else {
            None
        };
        let kind = match et {
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                EntryKind::File
            }
            tar::EntryType::Directory => EntryKind::Dir,
            tar::EntryType::Symlink => EntryKind::Symlink,
            tar::EntryType::Link => EntryKind::Hardlink,
            tar::EntryType::XGlobalHeader
            | tar::EntryType::XHeader
            | tar::EntryType::GNULongName
            | tar::EntryType::GNULongLink => continue,
            _ => EntryKind::Other,
        };
        let link = match (kind, link) {
            (EntryKind::Hardlink, Some(l)) => match normalize_path(l.as_bytes()) {
                Ok(t) => Some(t),
                Err(why) => {
                    scan.problem(
                        ProblemKind::UnsafePath,
                        format!("hard link {path} skipped: target {why}"),
                    );
                    continue;
                }
            },
            (_, l) => l,
        };
        let size = if kind == EntryKind::File {
            entry.size()
        } else {
            0
        };
        let hash = if hash && kind == EntryKind::File {
            let mut h = Sha256::new();
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = entry.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
            Some(h.finalize().into())
        } else {
            None
        };
        scan.entries.push(LayerEntry {
            path,
            kind,
            size,
            link,
            hash,
        });
    }
    Ok(())
}
