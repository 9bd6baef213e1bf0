//! OCI image layout directories (`oci-layout`, `index.json`, `blobs/sha256/…`).

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use oci::{Descriptor, Digest, Manifest};

use super::{
    read_limited, select_platform, verify_blob, Image, ImageConfig, LayerOpener, OpenOptions,
    MAX_JSON_BYTES,
};
use crate::error::{Error, Result};

const REF_NAME: &str = "org.opencontainers.image.ref.name";

pub struct LayoutOpener {
    dir: PathBuf,
}

impl LayoutOpener {
    fn blob_path(&self, d: &Digest) -> PathBuf {
        self.dir.join("blobs").join("sha256").join(d.hex())
    }

    fn read_json_blob(&self, desc: &Descriptor, what: &str) -> Result<Vec<u8>> {
        let path = self.blob_path(&desc.digest);
        let f = File::open(&path).map_err(|e| Error::io(path.display().to_string(), e))?;
        let bytes = read_limited(f, MAX_JSON_BYTES, what)?;
        verify_blob(desc, &bytes, what)?;
        Ok(bytes)
    }
}

impl LayerOpener for LayoutOpener {
    fn open_layer(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>> {
        let path = self.blob_path(&desc.digest);
        let f = File::open(&path).map_err(|e| Error::io(path.display().to_string(), e))?;
        Ok(Box::new(BufReader::with_capacity(256 << 10, f)))
    }
}

/// Opens the image tagged `tag` (or the only one) in a layout directory.
pub fn open(dir: &Path, tag: Option<&str>, opts: &OpenOptions) -> Result<Image> {
    if !dir.join("oci-layout").is_file() {
        return Err(Error::Source(format!(
            "{}: not an OCI image layout (no oci-layout file)",
            dir.display()
        )));
    }
    let index_path = dir.join("index.json");
    let f = File::open(&index_path).map_err(|e| Error::io(index_path.display().to_string(), e))?;
    let index = Manifest::parse(&read_limited(f, MAX_JSON_BYTES, "index.json")?)?;
    let name_of = |d: &Descriptor| {
        d.annotations
            .as_ref()
            .and_then(|a| a.get(REF_NAME))
            .cloned()
    };
    let chosen = match tag {
        Some(t) => index
            .manifests
            .iter()
            .find(|d| name_of(d).as_deref() == Some(t))
            .ok_or_else(|| {
                let tags: Vec<String> = index.manifests.iter().filter_map(name_of).collect();
                Error::Source(format!(
                    "{}: no tag {t} (tags: {})",
                    dir.display(),
                    tags.join(", ")
                ))
            })?,
        None if index.manifests.len() == 1 => &index.manifests[0],
        None => {
            let tags: Vec<String> = index.manifests.iter().filter_map(name_of).collect();
            return Err(Error::Source(format!(
                "{}: holds {} images; name one as DIR:TAG (tags: {})",
                dir.display(),
                index.manifests.len(),
                tags.join(", ")
            )));
        }
    };
    let shown_tag = tag.map(str::to_owned).or_else(|| name_of(chosen));
    let opener = LayoutOpener {
        dir: dir.to_owned(),
    };
    let mut desc = chosen.clone();
    let mut platform = None;
    // Follow (possibly nested) indexes down to an image manifest.
    for _ in 0..4 {
        let bytes = opener.read_json_blob(&desc, "manifest")?;
        let m = Manifest::parse(&bytes)?;
        if m.is_index() {
            let d = select_platform(&m, opts.platform.as_deref())?;
            platform = d
                .platform
                .as_ref()
                .map(|p| format!("{}/{}", p.os, p.architecture));
            desc = d.clone();
            continue;
        }
        let config_desc = m
            .config
            .clone()
            .ok_or_else(|| Error::Manifest("image manifest has no config".into()))?;
        let config = ImageConfig::parse(&opener.read_json_blob(&config_desc, "config")?)?;
        return Ok(Image {
            name: format!(
                "oci:{}{}",
                dir.display(),
                shown_tag
                    .as_ref()
                    .map(|t| format!(":{t}"))
                    .unwrap_or_default()
            ),
            tag: shown_tag,
            pinned: false,
            manifest_digest: Some(desc.digest.clone()),
            manifest: m,
            config,
            platform,
            opener: Box::new(opener),
        });
    }
    Err(Error::Manifest("index nesting too deep".into()))
}
