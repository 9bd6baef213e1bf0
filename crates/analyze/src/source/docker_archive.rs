//! `docker save` archives: a tar holding `manifest.json`, the config and one tar per
//! layer. The outer tar is indexed once; each layer is then read in place through a
//! bounded window of the file, never extracted.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use oci::{Descriptor, Digest, Manifest};
use serde::Deserialize;

use super::{read_limited, Image, ImageConfig, LayerOpener, MAX_JSON_BYTES};
use crate::error::{Error, Result};

pub const DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Entry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

pub struct ArchiveOpener {
    file: PathBuf,
    /// digest hex → (offset, size) of the member inside the archive.
    members: HashMap<String, (u64, u64)>,
}

impl LayerOpener for ArchiveOpener {
    fn open_layer(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>> {
        let (off, size) = *self
            .members
            .get(desc.digest.hex())
            .ok_or_else(|| Error::Source(format!("layer {} not in archive", desc.digest)))?;
        let mut f =
            File::open(&self.file).map_err(|e| Error::io(self.file.display().to_string(), e))?;
        f.seek(SeekFrom::Start(off))
            .map_err(|e| Error::io(self.file.display().to_string(), e))?;
        Ok(Box::new(BufReader::with_capacity(256 << 10, f.take(size))))
    }
}

fn index(file: &Path) -> Result<HashMap<String, (u64, u64)>> {
    let f = File::open(file).map_err(|e| Error::io(file.display().to_string(), e))?;
    let mut ar = tar::Archive::new(BufReader::new(f));
    let mut out = HashMap::new();
    let ctx = |e| Error::io(file.display().to_string(), e);
    let mut links = Vec::new();
    for entry in ar.entries_with_seek().map_err(ctx)? {
        let entry = entry.map_err(ctx)?;
        let name = entry
            .path()
            .map_err(ctx)?
            .to_string_lossy()
            .trim_start_matches("./")
            .to_owned();
        if entry.header().entry_type().is_symlink() {
            // Old-style `<id>/layer.tar -> ../<hex>.tar`: resolve inside the archive.
            if let Some(t) = entry.link_name().map_err(ctx)? {
                let dir = name.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                let mut parts: Vec<&str> = dir.split('/').filter(|p| !p.is_empty()).collect();
                let target = t.to_string_lossy().into_owned();
                for c in target.split('/') {
                    match c {
                        "" | "." => {}
                        ".." => {
                            parts.pop();
                        }
                        c => parts.push(c),
                    }
                }
                let resolved = parts.join("/");
                links.push((name.clone(), resolved));
            }
            continue;
        }
        out.insert(name, (entry.raw_file_position(), entry.size()));
    }
    for (name, target) in links {
        if let Some(v) = out.get(&target).copied() {
            out.insert(name, v);
        }
    }
    Ok(out)
}

fn read_member(file: &Path, members: &HashMap<String, (u64, u64)>, name: &str) -> Result<Vec<u8>> {
    let (off, size) = *members
        .get(name.trim_start_matches("./"))
        .ok_or_else(|| Error::Source(format!("{}: no member {name}", file.display())))?;
    let mut f = File::open(file).map_err(|e| Error::io(file.display().to_string(), e))?;
    f.seek(SeekFrom::Start(off))
        .map_err(|e| Error::io(file.display().to_string(), e))?;
    read_limited(f.take(size), MAX_JSON_BYTES, name)
}

/// Opens the image tagged `tag` (or the first) in a docker-save archive.
pub fn open(file: &Path, tag: Option<&str>) -> Result<Image> {
    let members = index(file)?;
    let manifest_json = read_member(file, &members, "manifest.json")?;
    let entries: Vec<Entry> = serde_json::from_slice(&manifest_json)
        .map_err(|e| Error::Manifest(format!("{}: manifest.json: {e}", file.display())))?;
    let entry = match tag {
        Some(t) => entries
            .iter()
            .find(|e| {
                e.repo_tags
                    .iter()
                    .flatten()
                    .any(|rt| rt == t || rt.rsplit_once(':').is_some_and(|(_, x)| x == t))
            })
            .ok_or_else(|| Error::Source(format!("{}: no image tagged {t}", file.display())))?,
        None => entries
            .first()
            .ok_or_else(|| Error::Manifest("manifest.json lists no image".into()))?,
    };
    let config_bytes = read_member(file, &members, &entry.config)?;
    let config = ImageConfig::parse(&config_bytes)?;
    let diff_ids = config.diff_ids();
    let mut by_digest = HashMap::new();
    let mut layers = Vec::new();
    for (i, l) in entry.layers.iter().enumerate() {
        let key = l.trim_start_matches("./");
        let &(off, size) = members
            .get(key)
            .ok_or_else(|| Error::Source(format!("layer member {l} missing")))?;
        // blobs/sha256/<hex> (new docker), <hex>.tar (skopeo), <id>/layer.tar (old docker).
        let base = key
            .rsplit('/')
            .next()
            .unwrap_or(key)
            .trim_end_matches(".tar");
        let digest = Digest::parse(&format!("sha256:{base}"))
            .ok()
            .or_else(|| diff_ids.get(i).and_then(|d| Digest::parse(d).ok()))
            .ok_or_else(|| Error::Manifest(format!("cannot tell the digest of layer {l}")))?;
        by_digest.insert(digest.hex().to_owned(), (off, size));
        layers.push(Descriptor {
            media_type: DOCKER_LAYER_TAR.to_owned(),
            digest,
            size,
            platform: None,
            annotations: None,
        });
    }
    let tag = tag.map(str::to_owned).or_else(|| {
        entry
            .repo_tags
            .iter()
            .flatten()
            .next()
            .and_then(|t| t.rsplit_once(':').map(|(_, t)| t.to_owned()))
    });
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(oci::media::DOCKER_MANIFEST.to_owned()),
        config: Some(Descriptor {
            media_type: "application/vnd.docker.container.image.v1+json".into(),
            digest: Digest::of(&config_bytes),
            size: config_bytes.len() as u64,
            platform: None,
            annotations: None,
        }),
        layers,
        manifests: Vec::new(),
    };
    Ok(Image {
        name: format!("docker-archive:{}", file.display()),
        tag,
        pinned: false,
        manifest_digest: None,
        manifest,
        config,
        platform: None,
        opener: Box::new(ArchiveOpener {
            file: file.to_owned(),
            members: by_digest,
        }),
    })
}
