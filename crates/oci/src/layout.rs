//! OCI image layout directories (`oci-layout`, `index.json`, `blobs/sha256/<hex>`): the
//! one reader behind `serve-oci`, the analyzer and the simulator's image sizes.
//!
//! Only `blobs/sha256/<64 hex>` paths are built, from a validated [`Digest`], and JSON
//! files are read with a size limit, so a hostile layout can neither point outside
//! itself nor make a reader buffer without bound.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::{Descriptor, Digest, Error, Manifest, Verifier};

/// The annotation carrying a tag in `index.json`.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Largest `index.json`, manifest or config read into memory.
pub const MAX_LAYOUT_JSON_BYTES: u64 = 4 * 1024 * 1024;

/// A layout directory whose `oci-layout` marker has been checked.
#[derive(Clone, Debug)]
pub struct Layout {
    root: PathBuf,
}

fn layout_err(root: &Path, reason: impl std::fmt::Display) -> Error {
    Error::ManifestInvalid(format!("OCI layout {}: {reason}", root.display()))
}

impl Layout {
    /// Opens a layout: `oci-layout` must be there with an `imageLayoutVersion`.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, Error> {
        let root = root.into();
        let marker = root.join("oci-layout");
        let text = read_limited(&marker, MAX_LAYOUT_JSON_BYTES)
            .map_err(|e| layout_err(&root, format_args!("not an OCI image layout: {e}")))?;
        let v: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| layout_err(&root, format_args!("oci-layout: {e}")))?;
        if v.get("imageLayoutVersion")
            .and_then(|v| v.as_str())
            .is_none()
        {
            return Err(layout_err(&root, "oci-layout lacks imageLayoutVersion"));
        }
        Ok(Layout { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The descriptors listed in `index.json` (read on every call: cheap, and a layout
    /// rewritten while in use is picked up).
    pub fn index(&self) -> Result<Vec<Descriptor>, Error> {
        let path = self.root.join("index.json");
        let text =
            read_limited(&path, MAX_LAYOUT_JSON_BYTES).map_err(|e| layout_err(&self.root, e))?;
        let index = Manifest::parse(&text)
            .map_err(|e| layout_err(&self.root, format_args!("index.json: {e}")))?;
        Ok(index.manifests)
    }

    /// The tag of an `index.json` entry, from its ref-name annotation.
    pub fn tag_of(d: &Descriptor) -> Option<&str> {
        d.annotations.as_ref()?.get(REF_NAME).map(String::as_str)
    }

    /// The `index.json` entry named by `reference` — a tag (ref-name annotation) or a
    /// digest — or, without one, the only entry. The error lists the tags there are.
    pub fn find(&self, reference: Option<&str>) -> Result<Descriptor, Error> {
        let index = self.index()?;
        let tags = || {
            let t: Vec<&str> = index.iter().filter_map(Self::tag_of).collect();
            t.join(", ")
        };
        let found = match reference {
            Some(r) => index
                .iter()
                .find(|d| Self::tag_of(d) == Some(r) || d.digest.to_string() == r),
            None if index.len() == 1 => index.first(),
            None => {
                return Err(layout_err(
                    &self.root,
                    format_args!("holds {} images; name one (tags: {})", index.len(), tags()),
                ))
            }
        };
        found.cloned().ok_or_else(|| {
            layout_err(
                &self.root,
                format_args!("no image {} (tags: {})", reference.unwrap_or("-"), tags()),
            )
        })
    }

    /// Where a blob's file is.
    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.root.join("blobs").join("sha256").join(digest.hex())
    }

    /// Reads a small blob (a manifest, an index, a config) whole, refusing more than
    /// [`MAX_LAYOUT_JSON_BYTES`] and checking it against the descriptor's size and
    /// digest.
    pub fn read_json_blob(&self, desc: &Descriptor) -> Result<Vec<u8>, Error> {
        if desc.size > MAX_LAYOUT_JSON_BYTES {
            return Err(layout_err(
                &self.root,
                format_args!(
                    "{} is {} bytes, more than a manifest or config may be",
                    desc.digest, desc.size
                ),
            ));
        }
        let bytes = read_limited(&self.blob_path(&desc.digest), MAX_LAYOUT_JSON_BYTES)?;
        if bytes.len() as u64 != desc.size {
            return Err(Error::SizeMismatch {
                expected: desc.size,
                actual: bytes.len() as u64,
            });
        }
        let mut v = Verifier::new(desc.digest.clone());
        v.update(&bytes);
        v.finish()?;
        Ok(bytes)
    }
}

/// A file read whole, refusing more than `limit` bytes (and symlinks: a layout's files
/// are regular files inside it).
fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, Error> {
    let meta = std::fs::symlink_metadata(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    if !meta.file_type().is_file() {
        return Err(Error::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{}: not a regular file", path.display()),
        )));
    }
    let f = std::fs::File::open(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let mut buf = Vec::new();
    f.take(limit + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > limit {
        return Err(Error::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: larger than {limit} bytes", path.display()),
        )));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layout with one manifest tagged `v1`; returns the manifest's descriptor.
    fn write_layout(dir: &Path) -> Descriptor {
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).expect("mkdir");
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).expect("write");
        let manifest = br#"{"schemaVersion":2,"layers":[]}"#;
        let digest = Digest::of(manifest);
        std::fs::write(blobs.join(digest.hex()), manifest).expect("write");
        let index = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"digest":"{digest}","size":{},"annotations":{{"{REF_NAME}":"v1"}}}}]}}"#,
            manifest.len()
        );
        std::fs::write(dir.join("index.json"), index).expect("write");
        Layout::open(dir)
            .expect("open")
            .find(Some("v1"))
            .expect("v1")
    }

    #[test]
    fn finds_by_tag_digest_or_the_only_entry_and_verifies_blobs() {
        let dir = tempfile::tempdir().expect("tmp");
        let desc = write_layout(dir.path());
        let layout = Layout::open(dir.path()).expect("open");
        assert_eq!(layout.find(None).expect("only").digest, desc.digest);
        assert_eq!(
            layout
                .find(Some(&desc.digest.to_string()))
                .expect("by digest")
                .digest,
            desc.digest
        );
        let missing = layout.find(Some("v2")).expect_err("no v2").to_string();
        assert!(missing.contains("tags: v1"), "{missing}");
        assert!(layout.read_json_blob(&desc).is_ok());
        // A blob whose bytes changed is refused, not returned.
        std::fs::write(
            layout.blob_path(&desc.digest),
            br#"{"schemaVersion":3,"layers":[]}"#,
        )
        .expect("write");
        assert!(layout.read_json_blob(&desc).is_err());
    }

    #[test]
    fn hostile_layouts_are_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        assert!(Layout::open(dir.path()).is_err(), "no oci-layout marker");
        let desc = write_layout(dir.path());
        let layout = Layout::open(dir.path()).expect("open");
        // index.json as a symlink to a file outside the layout.
        let outside = tempfile::NamedTempFile::new().expect("tmp");
        std::fs::remove_file(dir.path().join("index.json")).expect("rm");
        std::os::unix::fs::symlink(outside.path(), dir.path().join("index.json")).expect("ln");
        assert!(layout.index().is_err(), "followed a symlink");
        // A descriptor claiming a huge manifest is not read.
        let huge = Descriptor {
            size: MAX_LAYOUT_JSON_BYTES + 1,
            ..desc
        };
        assert!(layout.read_json_blob(&huge).is_err());
    }
}
