//! Synthetic, deterministic "GPU training image" generator.
//!
//! Layers are real `tar+gzip` archives (ustar headers, parent directory entries, files
//! of at most 64 MiB each, end-of-archive blocks) whose file contents are incompressible
//! pseudo-random bytes from xoshiro256++ (a fixed algorithm implemented here, so the
//! digests do not depend on any RNG crate's version). gzip is written at
//! `Compression::none()` (stored deflate blocks): random data does not compress anyway,
//! and "none" costs a memcpy plus CRC32 where level 1 searches for matches that are not
//! there (measured with flate2/zlib-rs on 256 MiB of random data, release build:
//! none ≈ 1.9 GB/s, level 1 ≈ 66 MB/s). The layer is hashed twice on the way out (sha256 of
//! the tar for `diff_id`, of the gzip stream for the blob digest); with SHA-NI this
//! still generates well above 300 MB/s, and layers are generated on all cores in
//! parallel: a 1 GiB image took 2.09 s = **~510 MB/s** on the 2-core development machine
//! (`cargo run --release -p origin --example throughput -- 1`).
//! Everything, including timestamps, is fixed so one seed gives the same digests on
//! every run and machine.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use flate2::{Compression, GzBuilder};
use oci::media::{OCI_CONFIG, OCI_INDEX, OCI_LAYER_GZIP, OCI_MANIFEST};
use oci::{Descriptor, Digest};
use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::layout::REF_NAME;
use crate::Error;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
/// No layer is generated smaller than this by [`SynthSpec::training`].
pub const MIN_LAYER_BYTES: u64 = 4 * KIB;
/// Largest single file inside a layer tar.
pub const MAX_FILE_BYTES: u64 = 64 * MIB;
/// Fixed mtime of every tar entry and the image's `created` (2024-05-01T00:00:00Z).
const EPOCH: u64 = 1_714_521_600;
const CREATED: &str = "2024-05-01T00:00:00Z";
const BUF: usize = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthSpec {
    /// (layer name, approximate uncompressed content bytes), base layer first.
    /// Well-known names (see [`SynthSpec::training`]) get realistic paths and history;
    /// others become `COPY <name> /opt/<name>`.
    pub layers: Vec<(String, u64)>,
    pub seed: u64,
    /// Tag recorded in `index.json` (`org.opencontainers.image.ref.name`).
    pub tag: String,
}

impl SynthSpec {
    /// A CUDA training image shape; at `scale` 1.0 it is ~4.9 GiB in 9 layers:
    /// base OS 80 MiB, CUDA runtime 1 GiB + 900 MiB + 600 MiB, cuDNN 800 MiB,
    /// Python deps 1.5 GiB, extra pip packages 50 MiB, code 20 MiB, config 4 KiB.
    /// `scale` multiplies every size; none goes below [`MIN_LAYER_BYTES`], so small
    /// (below-P2P-threshold) blobs always exist. Seed 0x5eed, tag `train`.
    pub fn training(scale: f64) -> Self {
        let scale = if scale.is_finite() && scale > 0.0 {
            scale
        } else {
            0.0
        };
        let shape: [(&str, u64); 9] = [
            ("base-os", 80 * MIB),
            ("cuda-runtime-1", 1024 * MIB),
            ("cuda-runtime-2", 900 * MIB),
            ("cuda-runtime-3", 600 * MIB),
            ("cudnn", 800 * MIB),
            ("python-deps", 1536 * MIB),
            ("pip-extra", 50 * MIB),
            ("code", 20 * MIB),
            ("config", 4 * KIB),
        ];
        let layers = shape
            .iter()
            .map(|&(n, b)| {
                (
                    n.to_owned(),
                    ((b as f64 * scale) as u64).max(MIN_LAYER_BYTES),
                )
            })
            .collect();
        Self {
            layers,
            seed: 0x5eed,
            tag: "train".to_owned(),
        }
    }

    /// Sum of the approximate layer sizes.
    pub fn approx_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.1).sum()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthLayer {
    pub name: String,
    /// Digest and size of the compressed blob (what a registry serves).
    pub digest: Digest,
    pub size: u64,
    /// sha256 of the uncompressed tar (`rootfs.diff_ids`).
    pub diff_id: Digest,
    pub uncompressed_size: u64,
    /// Regular files in the tar.
    pub files: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthImage {
    pub layout_dir: PathBuf,
    pub tag: String,
    pub manifest_digest: Digest,
    pub manifest_size: u64,
    pub config_digest: Digest,
    pub config_size: u64,
    pub layers: Vec<SynthLayer>,
    /// Manifest + config + layer blob bytes: what a full pull transfers.
    pub total_bytes: u64,
}

/// Paths and Dockerfile line of a layer name.
struct Profile {
    dir: String,
    stem: String,
    ext: &'static str,
    created_by: String,
}

fn profile(name: &str) -> Profile {
    let p = |dir: &str, stem: &str, ext, by: &str| Profile {
        dir: dir.to_owned(),
        stem: stem.to_owned(),
        ext,
        created_by: by.to_owned(),
    };
    match name {
        "base-os" => p("usr/lib/x86_64-linux-gnu", "libbase", "so", "FROM nvidia/cuda:12.4-runtime-ubuntu22.04"),
        n if n.starts_with("cuda") => Profile {
            dir: "usr/local/cuda/lib64".into(),
            stem: format!("lib{}", sanitize(n)),
            ext: "so",
            created_by: format!("RUN /bin/sh -c apt-get install -y --no-install-recommends cuda-libraries-12-4 # {n} # buildkit"),
        },
        "cudnn" => p("usr/lib/x86_64-linux-gnu", "libcudnn_engines", "so.9", "RUN /bin/sh -c apt-get install -y libcudnn9-cuda-12 # buildkit"),
        "python-deps" => p("usr/local/lib/python3.11/site-packages/torch/lib", "libtorch_cuda", "so", "RUN /bin/sh -c pip install -r requirements.txt # buildkit"),
        "pip-extra" => p("usr/local/lib/python3.11/site-packages/extra", "_native", "so", "RUN /bin/sh -c pip install wandb deepspeed # buildkit"),
        "code" => p("workspace/src", "module", "pyc", "COPY . /workspace # buildkit"),
        "config" => p("workspace/config", "train", "yaml", "COPY config/ /workspace/config # buildkit"),
        other => Profile {
            dir: format!("opt/{}", sanitize(other)),
            stem: "data".to_owned(),
            ext: "bin",
            created_by: format!("COPY {other} /opt/{} # buildkit", sanitize(other)),
        },
    }
}

fn sanitize(s: &str) -> String {
    let out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(40)
        .collect();
    if out.is_empty() || out.chars().all(|c| c == '.') {
        "layer".into()
    } else {
        out
    }
}

/// xoshiro256++ seeded through splitmix64.
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Self([next(), next(), next(), next()])
    }

    #[inline]
    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    fn fill(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&last[..n]);
    }
}

/// Counts and hashes what passes through.
struct HashWriter<W> {
    inner: W,
    hasher: Sha256,
    count: u64,
}

impl<W: Write> HashWriter<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }
    fn finish(self) -> (W, Digest, u64) {
        (
            self.inner,
            Digest::from_sha256(self.hasher.finalize().into()),
            self.count,
        )
    }
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn blobs_dir(dir: &Path) -> PathBuf {
    dir.join("blobs").join("sha256")
}

/// Writes `bytes` as a blob (atomically: temp file then rename) and returns its digest.
fn write_blob(dir: &Path, bytes: &[u8]) -> Result<Digest, Error> {
    let d = Digest::of(bytes);
    let path = blobs_dir(dir).join(d.hex());
    let tmp = blobs_dir(dir).join(format!(".tmp-{}", d.hex()));
    std::fs::write(&tmp, bytes).map_err(Error::io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(Error::io(&path))?;
    Ok(d)
}

fn tar_header(path: &str, size: u64, dir: bool) -> Result<[u8; 512], Error> {
    let mut h = tar::Header::new_ustar();
    h.set_path(path)
        .map_err(|e| Error::Spec(format!("tar path {path}: {e}")))?;
    h.set_size(size);
    h.set_mode(if dir { 0o755 } else { 0o644 });
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(EPOCH);
    h.set_entry_type(if dir {
        tar::EntryType::Directory
    } else {
        tar::EntryType::Regular
    });
    h.set_username("root")
        .map_err(|e| Error::Spec(e.to_string()))?;
    h.set_groupname("root")
        .map_err(|e| Error::Spec(e.to_string()))?;
    h.set_cksum();
    let mut out = [0u8; 512];
    out.copy_from_slice(h.as_bytes());
    Ok(out)
}

/// File sizes of a layer: pieces of at most [`MAX_FILE_BYTES`], varied a little so the
/// tar does not look machine-made, summing exactly to `total`.
fn file_sizes(total: u64, rng: &mut Rng) -> Vec<u64> {
    let mut out = Vec::new();
    let mut left = total;
    while left > 0 {
        // Between 3/4 of and the full maximum, unless what is left is smaller.
        let jitter = rng.next_u64() % (MAX_FILE_BYTES / 4);
        let n = left.min(MAX_FILE_BYTES - jitter);
        out.push(n);
        left -= n;
    }
    if out.is_empty() {
        out.push(0);
    }
    out
}

fn write_layer(
    dir: &Path,
    index: usize,
    name: &str,
    approx: u64,
    seed: u64,
) -> Result<SynthLayer, Error> {
    let prof = profile(name);
    let mut rng = Rng::new(seed ^ (index as u64 + 1).wrapping_mul(0xa076_1d64_78bd_642f));
    let tmp = blobs_dir(dir).join(format!(".tmp-layer-{index}-{}", std::process::id()));
    let file = File::create(&tmp).map_err(Error::io(&tmp))?;
    let blob = HashWriter::new(BufWriter::with_capacity(BUF, file));
    let gz = GzBuilder::new().mtime(0).write(blob, Compression::none());
    let mut tar = HashWriter::new(gz);
    let io = |e| Error::Io {
        path: tmp.clone(),
        source: e,
    };

    // Parent directories, then the files.
    let mut prefix = String::new();
    for comp in prof.dir.split('/') {
        prefix.push_str(comp);
        prefix.push('/');
        tar.write_all(&tar_header(&prefix, 0, true)?).map_err(io)?;
    }
    let sizes = file_sizes(approx, &mut rng);
    let mut buf = vec![0u8; BUF];
    for (i, &size) in sizes.iter().enumerate() {
        let path = format!("{}/{}-{}.{}", prof.dir, prof.stem, i, prof.ext);
        tar.write_all(&tar_header(&path, size, false)?)
            .map_err(io)?;
        let mut left = size;
        while left > 0 {
            let n = left.min(BUF as u64) as usize;
            rng.fill(&mut buf[..n]);
            tar.write_all(&buf[..n]).map_err(io)?;
            left -= n as u64;
        }
        let pad = (512 - (size % 512) as usize) % 512;
        tar.write_all(&[0u8; 512][..pad]).map_err(io)?;
    }
    tar.write_all(&[0u8; 1024]).map_err(io)?;
    let (gz, diff_id, uncompressed_size) = tar.finish();
    let blob = gz.finish().map_err(io)?;
    let (mut file, digest, size) = blob.finish();
    file.flush().map_err(io)?;
    drop(file);
    let path = blobs_dir(dir).join(digest.hex());
    std::fs::rename(&tmp, &path).map_err(Error::io(&path))?;
    Ok(SynthLayer {
        name: name.to_owned(),
        digest,
        size,
        diff_id,
        uncompressed_size,
        files: sizes.len(),
    })
}

#[derive(Serialize)]
struct ImageConfig<'a> {
    created: &'a str,
    architecture: &'a str,
    os: &'a str,
    config: RunConfig<'a>,
    rootfs: RootFs,
    history: Vec<History>,
}

#[derive(Serialize)]
struct RunConfig<'a> {
    #[serde(rename = "Env")]
    env: Vec<&'a str>,
    #[serde(rename = "WorkingDir")]
    working_dir: &'a str,
    #[serde(rename = "Cmd")]
    cmd: Vec<&'a str>,
    #[serde(rename = "Labels")]
    labels: std::collections::BTreeMap<&'a str, String>,
}

#[derive(Serialize)]
struct RootFs {
    #[serde(rename = "type")]
    kind: &'static str,
    diff_ids: Vec<Digest>,
}

#[derive(Serialize)]
struct History {
    created: &'static str,
    created_by: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    empty_layer: bool,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ImageManifest<'a> {
    schema_version: u32,
    media_type: &'a str,
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ImageIndex<'a> {
    schema_version: u32,
    media_type: &'a str,
    manifests: Vec<Descriptor>,
}

fn valid_tag(tag: &str) -> bool {
    let b = tag.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-')
}

fn descriptor(media_type: &str, digest: Digest, size: u64) -> Descriptor {
    Descriptor {
        media_type: media_type.to_owned(),
        digest,
        size,
        platform: None,
        annotations: None,
    }
}

/// Writes an OCI image layout at `dir` (created if needed; an existing `index.json` is
/// replaced) holding one image manifest tagged `spec.tag`. Same spec → same digests.
pub fn generate_training_image(dir: &Path, spec: &SynthSpec) -> Result<SynthImage, Error> {
    if spec.layers.is_empty() {
        return Err(Error::Spec("at least one layer is required".into()));
    }
    if !valid_tag(&spec.tag) {
        return Err(Error::Spec(format!("invalid tag {:?}", spec.tag)));
    }
    std::fs::create_dir_all(blobs_dir(dir)).map_err(Error::io(blobs_dir(dir)))?;
    let oci_layout = dir.join("oci-layout");
    std::fs::write(&oci_layout, br#"{"imageLayoutVersion":"1.0.0"}"#)
        .map_err(Error::io(&oci_layout))?;

    // Layers in parallel, largest first, on every core.
    let n = spec.layers.len();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(spec.layers[i].1));
    let results: Mutex<Vec<Option<Result<SynthLayer, Error>>>> =
        Mutex::new((0..n).map(|_| None).collect());
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism()
        .map_or(1, |p| p.get())
        .min(n);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(&i) = order.get(k) else { break };
                let (name, approx) = &spec.layers[i];
                let r = write_layer(dir, i, name, *approx, spec.seed);
                let failed = r.is_err();
                results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
                if failed {
                    next.store(n, Ordering::Relaxed);
                    break;
                }
            });
        }
    });
    let mut layers = Vec::with_capacity(n);
    for r in results.into_inner().unwrap_or_else(|p| p.into_inner()) {
        match r {
            Some(r) => layers.push(r?),
            None => {
                return Err(Error::Spec(
                    "layer generation stopped after an earlier error".into(),
                ))
            }
        }
    }

    let mut history: Vec<History> = layers
        .iter()
        .map(|l| History {
            created: CREATED,
            created_by: profile(&l.name).created_by,
            empty_layer: false,
        })
        .collect();
    for by in [
        "ENV PYTHONUNBUFFERED=1",
        "WORKDIR /workspace",
        "CMD [\"python\", \"train.py\"]",
    ] {
        history.push(History {
            created: CREATED,
            created_by: by.to_owned(),
            empty_layer: true,
        });
    }
    // Put ENV right after the base layer, as a Dockerfile would.
    let env = history.remove(layers.len());
    history.insert(1.min(layers.len()), env);

    let mut labels = std::collections::BTreeMap::new();
    labels.insert(
        "org.opencontainers.image.title",
        "starling synthetic training image".to_owned(),
    );
    labels.insert("io.starling.synth.seed", spec.seed.to_string());
    let config = ImageConfig {
        created: CREATED,
        architecture: "amd64",
        os: "linux",
        config: RunConfig {
            env: vec![
                "PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "NVIDIA_VISIBLE_DEVICES=all",
                "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
                "CUDA_VERSION=12.4.1",
                "PYTHONUNBUFFERED=1",
            ],
            working_dir: "/workspace",
            cmd: vec!["python", "train.py"],
            labels,
        },
        rootfs: RootFs { kind: "layers", diff_ids: layers.iter().map(|l| l.diff_id.clone()).collect() },
        history,
    };
    let config_bytes = serde_json::to_vec(&config)?;
    let config_digest = write_blob(dir, &config_bytes)?;

    let manifest = ImageManifest {
        schema_version: 2,
        media_type: OCI_MANIFEST,
        config: descriptor(OCI_CONFIG, config_digest.clone(), config_bytes.len() as u64),
        layers: layers
            .iter()
            .map(|l| descriptor(OCI_LAYER_GZIP, l.digest.clone(), l.size))
            .collect(),
    };
    let manifest_bytes = serde_json::to_vec(&manifest)?;
    let manifest_digest = write_blob(dir, &manifest_bytes)?;

    let mut ann = std::collections::BTreeMap::new();
    ann.insert(REF_NAME.to_owned(), spec.tag.clone());
    let index = ImageIndex {
        schema_version: 2,
        media_type: OCI_INDEX,
        manifests: vec![Descriptor {
            media_type: OCI_MANIFEST.to_owned(),
            digest: manifest_digest.clone(),
            size: manifest_bytes.len() as u64,
            platform: Some(oci::Platform {
                architecture: "amd64".into(),
                os: "linux".into(),
                variant: None,
            }),
            annotations: Some(ann),
        }],
    };
    let index_path = dir.join("index.json");
    let tmp = dir.join(".index.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&index)?).map_err(Error::io(&tmp))?;
    std::fs::rename(&tmp, &index_path).map_err(Error::io(&index_path))?;

    let total_bytes = manifest_bytes.len() as u64
        + config_bytes.len() as u64
        + layers.iter().map(|l| l.size).sum::<u64>();
    Ok(SynthImage {
        layout_dir: dir.to_owned(),
        tag: spec.tag.clone(),
        manifest_digest,
        manifest_size: manifest_bytes.len() as u64,
        config_digest,
        config_size: config_bytes.len() as u64,
        layers,
        total_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_fixed() {
        // Same seed, same stream; the digests it yields are pinned in tests/registry.rs.
        let mut r = Rng::new(1);
        let a = r.next_u64();
        let mut r2 = Rng::new(1);
        assert_eq!(a, r2.next_u64());
        let mut buf = [0u8; 13];
        r.fill(&mut buf);
        assert_ne!(buf, [0u8; 13]);
        assert_ne!(Rng::new(2).next_u64(), a);
    }

    #[test]
    fn file_sizes_cap_and_sum() {
        let mut r = Rng::new(7);
        for total in [0, 1, 4096, MAX_FILE_BYTES, 5 * MAX_FILE_BYTES + 3] {
            let s = file_sizes(total, &mut r);
            assert_eq!(s.iter().sum::<u64>(), total);
            assert!(s.iter().all(|&x| x <= MAX_FILE_BYTES));
        }
    }

    #[test]
    fn training_shape() {
        let full = SynthSpec::training(1.0);
        let gib = full.approx_bytes() as f64 / (1u64 << 30) as f64;
        assert!((4.5..5.5).contains(&gib), "{gib}");
        assert_eq!(full.layers.len(), 9);
        let tiny = SynthSpec::training(0.0);
        assert!(tiny.layers.iter().all(|l| l.1 == MIN_LAYER_BYTES));
        let tenth = SynthSpec::training(0.1);
        assert_eq!(tenth.layers[0].1, 8 * MIB);
        assert_eq!(tenth.layers[8].1, MIN_LAYER_BYTES);
    }

    #[test]
    fn rejects_bad_specs() {
        let dir = std::env::temp_dir().join(format!("origin-synth-bad-{}", std::process::id()));
        let mut s = SynthSpec::training(0.0);
        s.tag = "bad tag".into();
        assert!(matches!(
            generate_training_image(&dir, &s),
            Err(Error::Spec(_))
        ));
        s.tag = "ok".into();
        s.layers.clear();
        assert!(matches!(
            generate_training_image(&dir, &s),
            Err(Error::Spec(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
