//! Real test images built with `umoci` and pushed with `skopeo`.

use std::path::Path;
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};

use crate::registry::{Registry, RegistryAuth};
use crate::util::{random_bytes, run_ok, sha256_digest, skopeo_ok};

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// Manifest format written to the registry by `skopeo copy --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManifestFormat {
    /// `--format oci` (OCI image manifest, `tar+gzip` layers).
    Oci,
    /// `--format v2s2` (Docker schema 2 manifest).
    DockerV2S2,
}

impl ManifestFormat {
    fn skopeo_arg(self) -> &'static str {
        match self {
            ManifestFormat::Oci => "oci",
            ManifestFormat::DockerV2S2 => "v2s2",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
}

impl Platform {
    pub fn new(os: &str, architecture: &str) -> Platform {
        Platform {
            os: os.into(),
            architecture: architecture.into(),
        }
    }
}

/// A content descriptor as listed in a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blob {
    pub digest: String,
    pub size: u64,
    pub media_type: String,
}

/// A single-platform image as stored in the registry.
#[derive(Debug, Clone)]
pub struct PushedImage {
    /// `HOST/repo:tag` (or `HOST/repo@digest` for index children).
    pub reference: String,
    pub repo: String,
    /// Empty for index children (they are untagged).
    pub tag: String,
    /// Manifest digest as reported by the registry (`Docker-Content-Digest`,
    /// checked equal to sha256 of [`Self::raw_manifest`]).
    pub digest: String,
    /// Manifest media type (registry `Content-Type`).
    pub media_type: String,
    pub config: Blob,
    pub layers: Vec<Blob>,
    pub platform: Platform,
    /// Manifest bytes exactly as served by the registry.
    pub raw_manifest: Vec<u8>,
}

impl PushedImage {
    pub fn config_digest(&self) -> &str {
        &self.config.digest
    }

    /// `HOST/repo@sha256:...`
    pub fn digest_reference(&self) -> String {
        let host = self.reference.split('/').next().unwrap_or_default();
        format!("{host}/{}@{}", self.repo, self.digest)
    }

    /// Sum of compressed layer sizes.
    pub fn total_layer_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.size).sum()
    }
}

/// A multi-platform OCI index as stored in the registry.
#[derive(Debug, Clone)]
pub struct PushedIndex {
    /// `HOST/repo:tag`
    pub reference: String,
    pub repo: String,
    pub tag: String,
    pub digest: String,
    pub media_type: String,
    pub raw_manifest: Vec<u8>,
    /// One per platform, in index order.
    pub manifests: Vec<PushedImage>,
}

impl PushedIndex {
    pub fn for_arch(&self, architecture: &str) -> Option<&PushedImage> {
        self.manifests
            .iter()
            .find(|m| m.platform.architecture == architecture)
    }
}

/// Builders for real test images (see crate docs).
pub struct TestImage;

impl TestImage {
    /// Builds an image whose layer `i` holds one file of `layers[i]` bytes of
    /// incompressible data (seeded by `seed`, distinct per layer), for
    /// linux/amd64, and pushes it as an OCI manifest to `reg` as `repo:tag`.
    pub fn push_multilayer(
        reg: &Registry,
        repo: &str,
        tag: &str,
        layers: &[usize],
        seed: u64,
    ) -> Result<PushedImage> {
        Self::push_multilayer_format(reg, repo, tag, layers, seed, ManifestFormat::Oci)
    }

    /// [`Self::push_multilayer`] with an explicit manifest format.
    pub fn push_multilayer_format(
        reg: &Registry,
        repo: &str,
        tag: &str,
        layers: &[usize],
        seed: u64,
        format: ManifestFormat,
    ) -> Result<PushedImage> {
        let work = tempfile::Builder::new()
            .prefix("testkit-image-")
            .tempdir()?;
        let layout = work.path().join("layout");
        umoci_init(&layout)?;
        build_image(&layout, work.path(), "img", layers, seed, "amd64")?;
        push_layout(reg, &layout, "img", repo, tag, Some(format), false)?;
        fetch_image(reg, repo, tag)
    }

    /// Pushes an OCI index with linux/amd64 and linux/arm64 images, each with
    /// two distinct layers (1 MiB and 256 KiB).
    pub fn push_multiplatform_index(reg: &Registry, repo: &str, tag: &str) -> Result<PushedIndex> {
        Self::push_multiplatform_index_with(reg, repo, tag, &[1 << 20, 256 << 10], 0x5eed)
    }

    /// [`Self::push_multiplatform_index`] with chosen layer sizes and seed.
    pub fn push_multiplatform_index_with(
        reg: &Registry,
        repo: &str,
        tag: &str,
        layers: &[usize],
        seed: u64,
    ) -> Result<PushedIndex> {
        let work = tempfile::Builder::new()
            .prefix("testkit-index-")
            .tempdir()?;
        let layout = work.path().join("layout");
        umoci_init(&layout)?;
        let arches = ["amd64", "arm64"];
        for (i, arch) in arches.iter().enumerate() {
            let s = seed ^ ((i as u64 + 1) << 32);
            build_image(&layout, work.path(), arch, layers, s, arch)?;
        }
        // Assemble the index blob and reference it from index.json as `index`.
        let index_path = layout.join("index.json");
        let mut top: Value = serde_json::from_slice(&std::fs::read(&index_path)?)?;
        let descs = top
            .get("manifests")
            .and_then(Value::as_array)
            .cloned()
            .ok_or_else(|| anyhow!("index.json without manifests"))?;
        let mut children = Vec::new();
        for arch in arches {
            let d = descs
                .iter()
                .find(|d| d["annotations"]["org.opencontainers.image.ref.name"] == arch)
                .ok_or_else(|| anyhow!("tag {arch} missing from layout index.json"))?;
            children.push(json!({
                "mediaType": OCI_MANIFEST,
                "digest": d["digest"],
                "size": d["size"],
                "platform": {"architecture": arch, "os": "linux"},
            }));
        }
        let index = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": children});
        let bytes = serde_json::to_vec(&index)?;
        let digest = sha256_digest(&bytes);
        let hex = digest.trim_start_matches("sha256:");
        std::fs::write(layout.join("blobs/sha256").join(hex), &bytes)?;
        let manifests = top
            .get_mut("manifests")
            .and_then(Value::as_array_mut)
            .ok_or_else(|| anyhow!("index.json without manifests"))?;
        manifests.push(json!({
            "mediaType": OCI_INDEX,
            "digest": digest,
            "size": bytes.len(),
            "annotations": {"org.opencontainers.image.ref.name": "index"},
        }));
        std::fs::write(&index_path, serde_json::to_vec(&top)?)?;

        push_layout(reg, &layout, "index", repo, tag, None, true)?;
        fetch_index(reg, repo, tag)
    }
}

fn umoci(args: &[&str]) -> Result<()> {
    run_ok(Command::new("umoci").args(args)).map(|_| ())
}

fn umoci_init(layout: &Path) -> Result<()> {
    let l = layout.to_string_lossy();
    umoci(&["init", "--layout", &l])
}

/// Adds tag `tag` to `layout`: one layer per entry of `layers`, then sets the
/// platform in the config.
fn build_image(
    layout: &Path,
    scratch: &Path,
    tag: &str,
    layers: &[usize],
    seed: u64,
    arch: &str,
) -> Result<()> {
    let image = format!("{}:{tag}", layout.display());
    umoci(&["new", "--image", &image])?;
    for (i, &size) in layers.iter().enumerate() {
        let file = scratch.join(format!("{tag}-layer{i}.bin"));
        let layer_seed = seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(i as u64 + 1);
        std::fs::write(&file, random_bytes(size, layer_seed))?;
        let f = file.to_string_lossy();
        umoci(&[
            "insert",
            "--image",
            &image,
            &f,
            &format!("/testkit/layer{i}.bin"),
        ])?;
        std::fs::remove_file(&file)?;
    }
    umoci(&[
        "config",
        "--image",
        &image,
        "--os",
        "linux",
        "--architecture",
        arch,
    ])
}

pub(crate) fn push_layout(
    reg: &Registry,
    layout: &Path,
    src_tag: &str,
    repo: &str,
    tag: &str,
    format: Option<ManifestFormat>,
    all: bool,
) -> Result<()> {
    let src = format!("oci:{}:{src_tag}", layout.display());
    let dst = format!("docker://{}/{repo}:{tag}", reg.host());
    let mut args: Vec<String> = vec!["copy".into(), "--retry-times".into(), "2".into()];
    match reg.cert_dir() {
        // A TLS registry: verified against its CA, with its client certificate.
        Some(dir) => {
            args.push("--dest-tls-verify=true".into());
            args.push("--dest-cert-dir".into());
            args.push(dir.display().to_string());
        }
        None => args.push("--dest-tls-verify=false".into()),
    }
    if let Some(c) = reg.creds_arg() {
        args.push("--dest-creds".into());
        args.push(c);
    }
    if let Some(f) = format {
        args.push("--format".into());
        args.push(f.skopeo_arg().into());
    }
    if all {
        args.push("--all".into());
    }
    args.push(src);
    args.push(dst);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    skopeo_ok(&argv)
        .with_context(|| format!("pushing to {} (log: {})", reg.url(), reg.log_tail(4096)))?;
    Ok(())
}

impl Registry {
    /// Fetches a manifest by tag or digest over plain HTTP, authenticating as
    /// the registry's configured user if needed (Basic, or a bearer token from
    /// the token server). Returns `(content_type, docker_content_digest, body)`
    /// and checks that the digest header equals sha256(body).
    pub fn fetch_manifest(&self, repo: &str, reference: &str) -> Result<(String, String, Vec<u8>)> {
        let accept = [OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST].join(", ");
        let auth_header = self.authorization_for(repo, "pull")?;
        let mut headers = vec![("Accept", accept.as_str())];
        if let Some(a) = &auth_header {
            headers.push(("Authorization", a.as_str()));
        }
        let resp = self.http_get(&format!("/v2/{repo}/manifests/{reference}"), &headers)?;
        if resp.status != 200 {
            bail!(
                "GET manifest {repo}:{reference}: HTTP {}: {}",
                resp.status,
                String::from_utf8_lossy(&resp.body)
            );
        }
        let ct = resp
            .header("content-type")
            .ok_or_else(|| anyhow!("manifest response without Content-Type"))?
            .to_string();
        let digest = resp
            .header("docker-content-digest")
            .ok_or_else(|| anyhow!("manifest response without Docker-Content-Digest"))?
            .to_string();
        let computed = sha256_digest(&resp.body);
        if digest != computed {
            bail!("Docker-Content-Digest {digest} != sha256(body) {computed}");
        }
        Ok((ct, digest, resp.body))
    }

    /// The `Authorization` header value a client of this registry would send
    /// for `actions` (e.g. `"pull"`, `"pull,push"`) on `repo`, or `None`
    /// without auth.
    pub fn authorization_for(&self, repo: &str, actions: &str) -> Result<Option<String>> {
        use base64::Engine;
        let basic = |u: &str, p: &str| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        };
        match self.auth() {
            RegistryAuth::None => Ok(None),
            RegistryAuth::Htpasswd { user, password } => Ok(Some(basic(user, password))),
            RegistryAuth::Token { user, password, .. } => {
                let ts = self
                    .token_server()
                    .ok_or_else(|| anyhow!("token auth without token server"))?;
                let query = url::form_urlencoded::Serializer::new(String::new())
                    .append_pair("service", ts.service())
                    .append_pair("scope", &format!("repository:{repo}:{actions}"))
                    .finish();
                let b = basic(user, password);
                let resp = crate::http::http_get(
                    &format!("{}?{query}", ts.realm()),
                    &[("Authorization", &b)],
                )?;
                if resp.status != 200 {
                    bail!("token request failed: HTTP {}", resp.status);
                }
                let v: Value = serde_json::from_slice(&resp.body)?;
                let tok = v["token"]
                    .as_str()
                    .ok_or_else(|| anyhow!("token response without token"))?;
                Ok(Some(format!("Bearer {tok}")))
            }
        }
    }
}

fn parse_blob(v: &Value) -> Result<Blob> {
    Ok(Blob {
        digest: v["digest"]
            .as_str()
            .ok_or_else(|| anyhow!("descriptor without digest: {v}"))?
            .to_string(),
        size: v["size"]
            .as_u64()
            .ok_or_else(|| anyhow!("descriptor without size: {v}"))?,
        media_type: v["mediaType"].as_str().unwrap_or_default().to_string(),
    })
}

fn fetch_image(reg: &Registry, repo: &str, reference: &str) -> Result<PushedImage> {
    let (media_type, digest, raw) = reg.fetch_manifest(repo, reference)?;
    let v: Value = serde_json::from_slice(&raw).context("manifest is not JSON")?;
    if v.get("manifests").is_some() {
        bail!("{repo}:{reference} is an index, expected an image manifest");
    }
    let config = parse_blob(&v["config"])?;
    let layers = v["layers"]
        .as_array()
        .ok_or_else(|| anyhow!("manifest without layers"))?
        .iter()
        .map(parse_blob)
        .collect::<Result<Vec<_>>>()?;
    // Platform comes from the config blob.
    let platform =
        fetch_platform(reg, repo, &config.digest).unwrap_or_else(|_| Platform::new("", ""));
    let (tag, reference) = if reference.starts_with("sha256:") {
        (String::new(), format!("{}/{repo}@{reference}", reg.host()))
    } else {
        (
            reference.to_string(),
            format!("{}/{repo}:{reference}", reg.host()),
        )
    };
    Ok(PushedImage {
        reference,
        repo: repo.into(),
        tag,
        digest,
        media_type,
        config,
        layers,
        platform,
        raw_manifest: raw,
    })
}

fn fetch_platform(reg: &Registry, repo: &str, config_digest: &str) -> Result<Platform> {
    let auth = reg.authorization_for(repo, "pull")?;
    let mut headers = Vec::new();
    if let Some(a) = &auth {
        headers.push(("Authorization", a.as_str()));
    }
    let resp = reg.http_get(&format!("/v2/{repo}/blobs/{config_digest}"), &headers)?;
    if resp.status != 200 {
        bail!("GET config blob: HTTP {}", resp.status);
    }
    let v: Value = serde_json::from_slice(&resp.body)?;
    Ok(Platform::new(
        v["os"].as_str().unwrap_or_default(),
        v["architecture"].as_str().unwrap_or_default(),
    ))
}

fn fetch_index(reg: &Registry, repo: &str, tag: &str) -> Result<PushedIndex> {
    let (media_type, digest, raw) = reg.fetch_manifest(repo, tag)?;
    let v: Value = serde_json::from_slice(&raw).context("index is not JSON")?;
    let list = v["manifests"]
        .as_array()
        .ok_or_else(|| anyhow!("{repo}:{tag} is not an index: {v}"))?;
    let mut manifests = Vec::new();
    for d in list {
        let child = parse_blob(d)?;
        let mut img = fetch_image(reg, repo, &child.digest)?;
        img.platform = Platform::new(
            d["platform"]["os"].as_str().unwrap_or_default(),
            d["platform"]["architecture"].as_str().unwrap_or_default(),
        );
        manifests.push(img);
    }
    Ok(PushedIndex {
        reference: format!("{}/{repo}:{tag}", reg.host()),
        repo: repo.into(),
        tag: tag.into(),
        digest,
        media_type,
        raw_manifest: raw,
        manifests,
    })
}
