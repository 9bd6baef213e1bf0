//! Where images come from: an OCI image layout directory, a `docker save` archive or
//! a registry. Each source yields the manifest, the config (history) and a way to
//! open every layer blob as a plain `Read`; nothing is ever extracted to disk.

pub mod docker_archive;
pub mod layout;
pub mod registry;

use std::io::Read;

use oci::{Descriptor, Digest, Manifest};
use serde::Deserialize;

use crate::error::{Error, Result};

/// Largest manifest, index or config accepted from any source.
pub const MAX_JSON_BYTES: u64 = 16 << 20;

/// Opens layer blobs of one image.
pub trait LayerOpener: Send + Sync {
    fn open_layer(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>>;
}

/// One `history` entry of the image config.
#[derive(Clone, Debug, Default, Deserialize, serde::Serialize)]
pub struct History {
    #[serde(default)]
    pub created_by: Option<String>,
    #[serde(default)]
    pub empty_layer: Option<bool>,
    #[serde(default)]
    pub comment: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

/// The parts of the image config the analyzer reads.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ImageConfig {
    #[serde(default)]
    pub architecture: Option<String>,
    #[serde(default)]
    pub os: Option<String>,
    #[serde(default)]
    rootfs: Option<RootFs>,
    #[serde(default)]
    pub history: Vec<History>,
}

impl ImageConfig {
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        serde_json::from_slice(bytes).map_err(|e| Error::Manifest(format!("image config: {e}")))
    }

    pub fn diff_ids(&self) -> Vec<String> {
        self.rootfs
            .as_ref()
            .map(|r| r.diff_ids.clone())
            .unwrap_or_default()
    }

    /// `created_by` for each layer: history entries that are not `empty_layer`, in order.
    /// `None` when the history does not line up with the layers.
    pub fn layer_history(&self, layers: usize) -> Vec<Option<String>> {
        let non_empty: Vec<&History> = self
            .history
            .iter()
            .filter(|h| !h.empty_layer.unwrap_or(false))
            .collect();
        if non_empty.len() != layers {
            // Misaligned history (squashed or hand-made images): align from the end,
            // which is where the code layers that matter live.
            let mut out = vec![None; layers];
            for (i, h) in non_empty.iter().rev().enumerate() {
                if i >= layers {
                    break;
                }
                out[layers - 1 - i] = h.created_by.clone();
            }
            return out;
        }
        non_empty.iter().map(|h| h.created_by.clone()).collect()
    }
}

/// A resolved image, ready to be streamed.
pub struct Image {
    /// What the user typed, for display.
    pub name: String,
    /// The tag the image was referenced by, if any (a mutable name).
    pub tag: Option<String>,
    /// Whether the reference was pinned by digest.
    pub pinned: bool,
    pub manifest_digest: Option<Digest>,
    pub manifest: Manifest,
    pub config: ImageConfig,
    pub platform: Option<String>,
    pub opener: Box<dyn LayerOpener>,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("name", &self.name)
            .field("layers", &self.manifest.layers.len())
            .finish()
    }
}

/// How the user named an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceSpec {
    /// `oci:DIR[:TAG]`, or a directory holding an `oci-layout` file.
    Layout {
        dir: std::path::PathBuf,
        tag: Option<String>,
    },
    /// `docker-archive:FILE[:REPO:TAG]`, or an existing file.
    DockerArchive {
        file: std::path::PathBuf,
        tag: Option<String>,
    },
    /// `docker://REF`, or anything else: a registry reference.
    Registry(String),
}

impl SourceSpec {
    pub fn parse(s: &str) -> Self {
        use std::path::{Path, PathBuf};
        if let Some(rest) = s.strip_prefix("oci:") {
            let (dir, tag) = split_path_tag(rest);
            return Self::Layout { dir, tag };
        }
        if let Some(rest) = s.strip_prefix("docker-archive:") {
            let (file, tag) = split_path_tag(rest);
            return Self::DockerArchive { file, tag };
        }
        if let Some(rest) = s.strip_prefix("docker://") {
            return Self::Registry(rest.to_owned());
        }
        let p = Path::new(s);
        if p.is_dir() {
            return Self::Layout {
                dir: PathBuf::from(s),
                tag: None,
            };
        }
        if p.is_file() {
            return Self::DockerArchive {
                file: PathBuf::from(s),
                tag: None,
            };
        }
        if let Some((d, t)) = s.rsplit_once(':') {
            if Path::new(d).join("oci-layout").is_file() {
                return Self::Layout {
                    dir: PathBuf::from(d),
                    tag: Some(t.to_owned()),
                };
            }
        }
        Self::Registry(s.to_owned())
    }
}

fn split_path_tag(s: &str) -> (std::path::PathBuf, Option<String>) {
    use std::path::{Path, PathBuf};
    if Path::new(s).exists() {
        return (PathBuf::from(s), None);
    }
    match s.split_once(':') {
        Some((p, t)) if !t.is_empty() => (PathBuf::from(p), Some(t.to_owned())),
        _ => (PathBuf::from(s), None),
    }
}

/// Options for opening a source.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// `os/arch[/variant]`; default: the host's.
    pub platform: Option<String>,
    /// Registry credentials `user:password`.
    pub credentials: Option<(String, String)>,
    /// Use plain HTTP for the registry even when it is not loopback.
    pub plain_http: bool,
}

/// Opens any source.
pub fn open(spec: &SourceSpec, opts: &OpenOptions) -> Result<Image> {
    match spec {
        SourceSpec::Layout { dir, tag } => layout::open(dir, tag.as_deref(), opts),
        SourceSpec::DockerArchive { file, tag } => docker_archive::open(file, tag.as_deref()),
        SourceSpec::Registry(r) => registry::open(r, opts),
    }
}

/// Parses `os/arch[/variant]`, defaulting to the host.
pub fn wanted_platform(p: Option<&str>) -> (String, String, Option<String>) {
    match p {
        Some(p) => {
            let mut it = p.split('/');
            let os = it.next().unwrap_or("linux").to_owned();
            let arch = it.next().unwrap_or("amd64").to_owned();
            (os, arch, it.next().map(str::to_owned))
        }
        None => {
            let (os, arch) = oci::media::host_platform();
            (os.to_owned(), arch.to_owned(), None)
        }
    }
}

/// Picks a manifest from an index for the wanted platform.
pub fn select_platform<'a>(index: &'a Manifest, platform: Option<&str>) -> Result<&'a Descriptor> {
    let (os, arch, variant) = wanted_platform(platform);
    index
        .manifests
        .iter()
        .find(|d| {
            d.platform.as_ref().is_some_and(|p| {
                p.os == os && p.architecture == arch && (variant.is_none() || p.variant == variant)
            })
        })
        .ok_or_else(|| {
            let have: Vec<String> = index
                .manifests
                .iter()
                .filter_map(|d| {
                    d.platform
                        .as_ref()
                        .map(|p| format!("{}/{}", p.os, p.architecture))
                })
                .collect();
            Error::Platform(format!("{os}/{arch} (index offers: {})", have.join(", ")))
        })
}

/// Reads at most `limit` bytes; more is an error.
pub fn read_limited(mut r: impl Read, limit: u64, what: &str) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    (&mut r)
        .take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Error::io(what, e))?;
    if buf.len() as u64 > limit {
        return Err(Error::Manifest(format!(
            "{what} is larger than {limit} bytes"
        )));
    }
    Ok(buf)
}

/// Checks that bytes match a descriptor (digest and size).
pub fn verify_blob(desc: &Descriptor, bytes: &[u8], what: &str) -> Result<()> {
    if bytes.len() as u64 != desc.size {
        return Err(Error::Manifest(format!(
            "{what} {}: descriptor says {} bytes, blob has {}",
            desc.digest,
            desc.size,
            bytes.len()
        )));
    }
    let got = Digest::of(bytes);
    if got != desc.digest {
        return Err(Error::Manifest(format!(
            "{what}: expected digest {}, got {got}",
            desc.digest
        )));
    }
    Ok(())
}
