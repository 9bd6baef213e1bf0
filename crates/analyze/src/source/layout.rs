//! OCI image layout directories (`oci-layout`, `index.json`, `blobs/sha256/…`).

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use oci::{Descriptor, Manifest};

use super::{select_platform, Image, ImageConfig, LayerOpener, OpenOptions};
use crate::error::{Error, Result};

pub struct LayoutOpener {
    layout: oci::layout::Layout,
}

impl LayerOpener for LayoutOpener {
    fn open_layer(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send + '_>> {
        let path = self.layout.blob_path(&desc.digest);
        let f = File::open(&path).map_err(|e| Error::io(path.display().to_string(), e))?;
        Ok(Box::new(BufReader::with_capacity(256 << 10, f)))
    }
}

/// Opens the image tagged `tag` (or the only one) in a layout directory.
pub fn open(dir: &Path, tag: Option<&str>, opts: &OpenOptions) -> Result<Image> {
    let layout = oci::layout::Layout::open(dir)?;
    let chosen = layout.find(tag)?;
    let shown_tag = tag
        .map(str::to_owned)
        .or_else(|| oci::layout::Layout::tag_of(&chosen).map(str::to_owned));
    let opener = LayoutOpener { layout };
    let mut desc = chosen.clone();
    let mut platform = None;
    // Follow (possibly nested) indexes down to an image manifest.
    for _ in 0..4 {
        let bytes = opener.layout.read_json_blob(&desc)?;
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
        let config = ImageConfig::parse(&opener.layout.read_json_blob(&config_desc)?)?;
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
