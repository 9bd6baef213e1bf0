//! Deterministic test images: a small layer builder (tar + gzip/zstd) writing OCI
//! image layouts, plus helpers to drive real tools (umoci, skopeo, docker-registry).
#![allow(dead_code, clippy::unwrap_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest as _, Sha256};

pub enum E<'a> {
    Dir(&'a str),
    File(&'a str, Vec<u8>),
    /// A file whose name is written through a PAX `path` record.
    PaxFile(&'a str, Vec<u8>),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
    /// `.wh.<name>` for the path.
    Whiteout(&'a str),
    /// `.wh..wh..opq` inside the directory.
    Opaque(&'a str),
    /// A raw name written into the header bytes, bypassing the builder's checks.
    RawName(&'a [u8], Vec<u8>),
}

pub fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn header(kind: tar::EntryType, size: u64, mtime: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(if kind == tar::EntryType::Directory {
        0o755
    } else {
        0o644
    });
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(mtime);
    h
}

/// An uncompressed layer tar; `mtime` lets two builds of the same content differ.
pub fn tar_layer_at(entries: &[E], mtime: u64) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        match e {
            E::Dir(p) => {
                let mut h = header(tar::EntryType::Directory, 0, mtime);
                b.append_data(&mut h, format!("{p}/"), std::io::empty())
                    .unwrap();
            }
            E::File(p, data) => {
                let mut h = header(tar::EntryType::Regular, data.len() as u64, mtime);
                b.append_data(&mut h, p, &data[..]).unwrap();
            }
            E::PaxFile(p, data) => {
                b.append_pax_extensions([("path", p.as_bytes())]).unwrap();
                let mut h = header(tar::EntryType::Regular, data.len() as u64, mtime);
                h.as_old_mut().name[..9].copy_from_slice(b"truncated");
                h.set_cksum();
                b.append(&h, &data[..]).unwrap();
            }
            E::Symlink(p, t) => {
                let mut h = header(tar::EntryType::Symlink, 0, mtime);
                b.append_link(&mut h, p, t).unwrap();
            }
            E::Hardlink(p, t) => {
                let mut h = header(tar::EntryType::Link, 0, mtime);
                b.append_link(&mut h, p, t).unwrap();
            }
            E::Whiteout(p) => {
                let (dir, name) = p
                    .rsplit_once('/')
                    .map(|(d, n)| (format!("{d}/"), n))
                    .unwrap_or((String::new(), p));
                let mut h = header(tar::EntryType::Regular, 0, mtime);
                b.append_data(&mut h, format!("{dir}.wh.{name}"), std::io::empty())
                    .unwrap();
            }
            E::Opaque(d) => {
                let mut h = header(tar::EntryType::Regular, 0, mtime);
                b.append_data(&mut h, format!("{d}/.wh..wh..opq"), std::io::empty())
                    .unwrap();
            }
            E::RawName(name, data) => {
                let mut h = header(tar::EntryType::Regular, data.len() as u64, mtime);
                let field = &mut h.as_old_mut().name;
                field.fill(0);
                field[..name.len()].copy_from_slice(name);
                h.set_cksum();
                b.append(&h, &data[..]).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

pub fn tar_layer(entries: &[E]) -> Vec<u8> {
    tar_layer_at(entries, 1_700_000_000)
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    enc.write_all(data).unwrap();
    enc.finish().unwrap()
}

pub fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::encode_all(data, 3).unwrap()
}

pub fn sha(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

pub const GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const TAR: &str = "application/vnd.oci.image.layer.v1.tar";

pub struct Layer {
    pub blob: Vec<u8>,
    pub media_type: String,
    pub created_by: String,
    pub diff_id: String,
    /// Overrides the size written in the manifest.
    pub declared_size: Option<u64>,
    /// Overrides the digest written in the manifest (blob stored under it).
    pub declared_digest: Option<String>,
}

impl Layer {
    pub fn gz(tar: Vec<u8>, created_by: &str) -> Self {
        Self::new(gzip(&tar), GZIP, &tar, created_by)
    }
    pub fn zst(tar: Vec<u8>, created_by: &str) -> Self {
        Self::new(zstd(&tar), ZSTD, &tar, created_by)
    }
    pub fn new(blob: Vec<u8>, media_type: &str, tar: &[u8], created_by: &str) -> Self {
        Self {
            blob,
            media_type: media_type.into(),
            created_by: created_by.into(),
            diff_id: sha(tar),
            declared_size: None,
            declared_digest: None,
        }
    }
    pub fn size(&self) -> u64 {
        self.blob.len() as u64
    }
}

/// Writes an OCI image layout.
pub struct Layout {
    pub dir: PathBuf,
    manifests: Vec<serde_json::Value>,
}

impl Layout {
    pub fn new(dir: &Path) -> Self {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Self {
            dir: dir.to_owned(),
            manifests: Vec::new(),
        }
    }

    pub fn put_blob(&self, data: &[u8]) -> String {
        let d = sha(data);
        self.put_blob_as(&d, data);
        d
    }

    pub fn put_blob_as(&self, digest: &str, data: &[u8]) {
        std::fs::write(
            self.dir
                .join("blobs/sha256")
                .join(digest.trim_start_matches("sha256:")),
            data,
        )
        .unwrap();
    }

    /// Writes config + manifest; returns the manifest descriptor.
    pub fn image(&self, layers: &[Layer], arch: &str) -> serde_json::Value {
        let history: Vec<serde_json::Value> = layers
            .iter()
            .map(|l| serde_json::json!({"created_by": l.created_by}))
            .collect();
        let diff_ids: Vec<&str> = layers.iter().map(|l| l.diff_id.as_str()).collect();
        let config = serde_json::json!({
            "architecture": arch, "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": history,
        });
        let config = serde_json::to_vec(&config).unwrap();
        let cd = self.put_blob(&config);
        let mut descs = Vec::new();
        for l in layers {
            let d = match &l.declared_digest {
                Some(d) => {
                    self.put_blob_as(d, &l.blob);
                    d.clone()
                }
                None => self.put_blob(&l.blob),
            };
            descs.push(serde_json::json!({"mediaType": l.media_type, "digest": d, "size": l.declared_size.unwrap_or(l.size())}));
        }
        let m = serde_json::json!({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": config.len()},
            "layers": descs,
        });
        let m = serde_json::to_vec(&m).unwrap();
        let md = self.put_blob(&m);
        serde_json::json!({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": m.len(),
            "platform": {"os": "linux", "architecture": arch}})
    }

    pub fn tag(&mut self, desc: serde_json::Value, tag: &str) {
        let mut d = desc;
        d["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": tag});
        self.manifests.push(d);
        self.write_index();
    }

    /// Tags an index over the given manifest descriptors.
    pub fn tag_index(&mut self, manifests: Vec<serde_json::Value>, tag: &str) {
        let idx = serde_json::json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests});
        let idx = serde_json::to_vec(&idx).unwrap();
        let d = self.put_blob(&idx);
        self.tag(serde_json::json!({"mediaType": "application/vnd.oci.image.index.v1+json", "digest": d, "size": idx.len()}), tag);
    }

    fn write_index(&self) {
        let idx = serde_json::json!({"schemaVersion": 2, "manifests": self.manifests});
        std::fs::write(
            self.dir.join("index.json"),
            serde_json::to_vec(&idx).unwrap(),
        )
        .unwrap();
    }
}

pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn open(spec: &str) -> analyze::source::Image {
    analyze::source::open(
        &analyze::source::SourceSpec::parse(spec),
        &Default::default(),
    )
    .unwrap()
}

pub fn opts() -> analyze::AnalyzeOptions {
    let mut o = analyze::AnalyzeOptions::default();
    o.rules.weight_threshold = 10_000;
    o.top = 100;
    o
}
