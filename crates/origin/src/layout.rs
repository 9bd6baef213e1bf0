//! Read-only access to an OCI image layout directory.
//!
//! Only `blobs/sha256/<64 hex>` paths are ever opened, built from a validated
//! [`oci::Digest`], and symlinks are refused, so no request can reach a file outside
//! the layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oci::{Descriptor, Digest};

use crate::Error;

pub use oci::layout::REF_NAME;

/// Largest manifest the origin will serve (manifests are read into memory).
pub const MAX_MANIFEST_BYTES: u64 = 4 * 1024 * 1024;

/// A layout served read-only: [`oci::layout::Layout`] for the index and paths, plus the
/// async blob access the server streams from.
#[derive(Clone, Debug)]
pub struct Layout {
    layout: oci::layout::Layout,
}

fn layout_err(root: &Path) -> impl Fn(oci::Error) -> Error + '_ {
    move |e| Error::Layout {
        path: root.to_owned(),
        reason: e.to_string(),
    }
}

impl Layout {
    /// Opens a layout, checking that `oci-layout` and `index.json` are present and valid.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, Error> {
        let root = root.into();
        let layout = oci::layout::Layout::open(&root).map_err(layout_err(&root))?;
        let layout = Self { layout };
        layout.index()?;
        Ok(layout)
    }

    pub fn root(&self) -> &Path {
        self.layout.root()
    }

    /// The descriptors listed in `index.json` (read on every call: cheap, and a layout
    /// rewritten while served is picked up).
    pub fn index(&self) -> Result<Vec<Descriptor>, Error> {
        self.layout.index().map_err(layout_err(self.root()))
    }

    /// Tag → descriptor, from the `org.opencontainers.image.ref.name` annotations.
    /// The first entry wins when a tag is listed twice.
    pub fn tags(&self) -> Result<BTreeMap<String, Descriptor>, Error> {
        let mut out = BTreeMap::new();
        for d in self.index()? {
            if let Some(tag) = oci::layout::Layout::tag_of(&d).map(str::to_owned) {
                out.entry(tag).or_insert(d);
            }
        }
        Ok(out)
    }

    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.layout.blob_path(digest)
    }

    /// Opens a blob for reading and returns it with its length; `Ok(None)` if absent
    /// (or not a regular file, e.g. a symlink).
    pub async fn open_blob(
        &self,
        digest: &Digest,
    ) -> Result<Option<(tokio::fs::File, u64)>, Error> {
        let path = self.blob_path(digest);
        let meta = match tokio::fs::symlink_metadata(&path).await {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::Io { path, source: e }),
        };
        if !meta.file_type().is_file() {
            return Ok(None);
        }
        let file = match tokio::fs::File::open(&path).await {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::Io { path, source: e }),
        };
        Ok(Some((file, meta.len())))
    }

    /// Reads a (small) blob fully; `Ok(None)` if absent or larger than `limit`.
    pub async fn read_small_blob(
        &self,
        digest: &Digest,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, Error> {
        let Some((file, len)) = self.open_blob(digest).await? else {
            return Ok(None);
        };
        if len > limit {
            return Ok(None);
        }
        use tokio::io::AsyncReadExt;
        let mut buf = Vec::with_capacity(len as usize);
        file.take(limit)
            .read_to_end(&mut buf)
            .await
            .map_err(Error::io(self.blob_path(digest)))?;
        Ok(Some(buf))
    }
}
