//! Findings: what to cut, with bytes and a concrete fix. Works on the merged
//! [`Model`] plus the layer history; pure, no I/O.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::engine::{EntryKind, LayerScan};
use crate::model::Model;

/// Where bytes go, for the per-layer chart and the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Category {
    PackageCache,
    Pycache,
    Toolchain,
    CudaDevel,
    Weights,
    Git,
    Other,
}

impl Category {
    pub const ALL: [Category; 7] = [
        Category::PackageCache,
        Category::Pycache,
        Category::Toolchain,
        Category::CudaDevel,
        Category::Weights,
        Category::Git,
        Category::Other,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Category::PackageCache => "package caches",
            Category::Pycache => "__pycache__/*.pyc",
            Category::Toolchain => "compilers (gcc, nvcc)",
            Category::CudaDevel => "CUDA headers + static libs",
            Category::Weights => "model weights",
            Category::Git => ".git",
            Category::Other => "other",
        }
    }

    pub fn color(self) -> &'static str {
        match self {
            Category::PackageCache => "#e4572e",
            Category::Pycache => "#f3a712",
            Category::Toolchain => "#a8c686",
            Category::CudaDevel => "#669bbc",
            Category::Weights => "#8e44ad",
            Category::Git => "#29335c",
            Category::Other => "#b0b0b0",
        }
    }
}

/// Rule identifiers (stable, used in JSON and CI output).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    PackageCache,
    Pycache,
    BuildToolchain,
    NvidiaDuplicate,
    ModelWeights,
    GitDirectory,
    DeletedLater,
    LayerOrder,
    MutableTag,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Finding {
    pub rule: Rule,
    pub title: String,
    /// Bytes the fix would save (uncompressed file bytes; for layer order, compressed
    /// layer bytes re-shipped on every code change).
    pub bytes: u64,
    pub files: u64,
    pub layers: Vec<usize>,
    /// Largest paths involved, with their sizes.
    pub examples: Vec<(String, u64)>,
    pub fix: String,
}

fn segs(path: &str) -> impl Iterator<Item = &str> {
    path.split('/')
}

/// True when `path` contains the directory sequence `dir` (e.g. `.cache/pip`).
fn has_dir(path: &str, dir: &str) -> bool {
    let p = format!("/{path}/");
    p.contains(&format!("/{dir}/"))
}

fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// `Some(rest)` when the path lies under a CUDA toolkit root (`usr/local/cuda*/`).
fn cuda_rest(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("usr/local/")?;
    let (root, rest) = rest.split_once('/')?;
    root.starts_with("cuda").then_some(rest)
}

/// Which package cache a path belongs to.
pub fn cache_kind(path: &str) -> Option<&'static str> {
    if has_dir(path, ".cache/pip") {
        return Some("pip");
    }
    if has_dir(path, ".cache/huggingface") {
        return Some("huggingface");
    }
    if has_dir(path, ".cache/torch") {
        return Some("torch");
    }
    if has_dir(path, ".cache/yarn") || has_dir(path, ".yarn-cache") {
        return Some("yarn");
    }
    if has_dir(path, ".npm") {
        return Some("npm");
    }
    if path.starts_with("var/lib/apt/lists/") && !path.ends_with("/lock") {
        return Some("apt-lists");
    }
    if path.starts_with("var/cache/apt/") {
        return Some("apt-archives");
    }
    let parts: Vec<&str> = segs(path).collect();
    for w in parts.windows(2) {
        let root = w[0].to_ascii_lowercase();
        if w[1] == "pkgs"
            && (root.contains("conda") || root.contains("mamba") || root.contains("miniforge"))
        {
            return Some("conda");
        }
    }
    None
}

fn cache_fix(kind: &str) -> &'static str {
    match kind {
        "pip" => "pip install --no-cache-dir (or RUN --mount=type=cache,target=/root/.cache/pip)",
        "huggingface" => "do not download models at build time; point HF_HOME at a mounted volume",
        "torch" => "do not download hub models at build time; point TORCH_HOME at a mounted volume",
        "yarn" => "yarn cache clean in the same RUN (or a cache mount)",
        "npm" => "npm ci && npm cache clean --force in the same RUN (or a cache mount)",
        "apt-lists" => "rm -rf /var/lib/apt/lists/* in the same RUN as apt-get install",
        "apt-archives" => "apt-get clean in the same RUN as apt-get install (or --no-install-recommends + cache mount)",
        "conda" => "conda clean -afy in the same RUN as conda install",
        _ => "remove the cache in the same RUN that fills it",
    }
}

fn is_pycache(path: &str) -> bool {
    has_dir(path, "__pycache__") || path.ends_with(".pyc") || path.ends_with(".pyo")
}

fn is_toolchain(path: &str) -> bool {
    if let Some(rest) = cuda_rest(path) {
        return rest.starts_with("bin/") || rest.starts_with("nvvm/");
    }
    if path.starts_with("usr/lib/gcc/") || path.starts_with("usr/libexec/gcc/") {
        return true;
    }
    if path.starts_with("usr/bin/") || path.starts_with("usr/local/bin/") {
        let b = basename(path);
        return matches!(
            b,
            "gcc" | "g++" | "cc" | "c++" | "cpp" | "gfortran" | "nvcc"
        ) || b.starts_with("gcc-")
            || b.starts_with("g++-")
            || b.starts_with("cpp-")
            || b.contains("-linux-gnu-g")
            || b.contains("-linux-gnu-cpp");
    }
    false
}

fn is_cuda_devel(path: &str) -> bool {
    let b = basename(path);
    if let Some(rest) = cuda_rest(path) {
        return has_dir(rest, "include") || b.ends_with(".a");
    }
    b.starts_with("lib") && b.contains("_static") && b.ends_with(".a")
}

const WEIGHT_EXT: [&str; 8] = [
    ".safetensors",
    ".pt",
    ".pth",
    ".ckpt",
    ".bin",
    ".gguf",
    ".onnx",
    ".h5",
];

fn is_weight(path: &str, size: u64, threshold: u64) -> bool {
    size >= threshold && WEIGHT_EXT.iter().any(|e| path.ends_with(e))
}

fn is_git(path: &str) -> bool {
    has_dir(path, ".git")
}

/// The category of a file.
pub fn categorize(path: &str, size: u64, weight_threshold: u64) -> Category {
    if cache_kind(path).is_some() {
        Category::PackageCache
    } else if is_git(path) {
        Category::Git
    } else if is_weight(path, size, weight_threshold) {
        Category::Weights
    } else if is_pycache(path) {
        Category::Pycache
    } else if is_toolchain(path) {
        Category::Toolchain
    } else if is_cuda_devel(path) {
        Category::CudaDevel
    } else {
        Category::Other
    }
}

/// Library key for NVIDIA duplicates: `libcublasLt.so.12.1.0` → `libcublasLt`.
fn nvidia_lib_key(path: &str) -> Option<String> {
    let b = basename(path);
    let (stem, _) = b.split_once(".so")?;
    Some(stem.to_owned())
}

fn is_pip_nvidia(path: &str) -> bool {
    has_dir(path, "site-packages/nvidia") || has_dir(path, "dist-packages/nvidia")
}

fn is_system_nvidia(path: &str) -> bool {
    if cuda_rest(path).is_some() {
        return true;
    }
    let b = basename(path);
    path.starts_with("usr/lib/")
        && (b.starts_with("libcudnn") || b.starts_with("libnccl") || b.starts_with("libcublas"))
}

/// What a history line says a layer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LayerRole {
    /// `COPY`/`ADD` of project files (not `--from=`).
    Code,
    /// `COPY` of only dependency manifests (requirements.txt, lock files…).
    DependencyManifest,
    /// `RUN pip/conda/apt-get/npm install…`.
    DependencyInstall,
    /// `ADD file:<hash> in /`: a base image's root filesystem.
    Base,
    Other,
    Unknown,
}

const DEP_MANIFESTS: [&str; 18] = [
    "requirements.txt",
    "pyproject.toml",
    "poetry.lock",
    "pipfile",
    "pipfile.lock",
    "setup.cfg",
    "environment.yml",
    "environment.yaml",
    "conda-lock.yml",
    "package.json",
    "package-lock.json",
    "yarn.lock",
    "pnpm-lock.yaml",
    "uv.lock",
    "go.mod",
    "go.sum",
    "cargo.toml",
    "cargo.lock",
];

fn is_dep_manifest(path: &str) -> bool {
    let b = basename(path).to_ascii_lowercase();
    DEP_MANIFESTS.contains(&b.as_str()) || (b.starts_with("requirements") && b.ends_with(".txt"))
}

/// Strips `/bin/sh -c #(nop) ` and ` # buildkit`.
pub fn clean_created_by(s: &str) -> String {
    let s = s.trim();
    let s = s.strip_prefix("/bin/sh -c #(nop)").unwrap_or(s).trim();
    let s = s.strip_suffix("# buildkit").unwrap_or(s).trim();
    s.to_owned()
}

const INSTALLERS: [&str; 15] = [
    "pip install",
    "pip3 install",
    "uv pip install",
    "uv sync",
    "poetry install",
    "pipenv install",
    "conda install",
    "conda env create",
    "mamba install",
    "micromamba install",
    "apt-get install",
    "apt install",
    "npm install",
    "npm ci",
    "yarn install",
];

/// Classifies a layer from its history line and its files.
pub fn layer_role(created_by: Option<&str>, layer: &LayerScan) -> LayerRole {
    let Some(cb) = created_by else {
        return LayerRole::Unknown;
    };
    let c = clean_created_by(cb);
    let upper = c.to_ascii_uppercase();
    if upper.starts_with("ADD FILE:") && c.trim_end().ends_with(" in /") {
        return LayerRole::Base;
    }
    if (upper.starts_with("COPY") || upper.starts_with("ADD")) && !c.contains("--from=") {
        let files: Vec<&str> = layer
            .entries
            .iter()
            .filter(|e| {
                matches!(
                    e.kind,
                    EntryKind::File | EntryKind::Symlink | EntryKind::Hardlink
                )
            })
            .map(|e| e.path.as_str())
            .collect();
        if !files.is_empty() && files.iter().all(|p| is_dep_manifest(p)) {
            return LayerRole::DependencyManifest;
        }
        return LayerRole::Code;
    }
    let lower = c.to_ascii_lowercase();
    if INSTALLERS.iter().any(|i| lower.contains(i))
        || lower.contains("yarn ") && !lower.contains("yarn cache")
    {
        return LayerRole::DependencyInstall;
    }
    LayerRole::Other
}

/// Rule settings.
#[derive(Clone, Debug)]
pub struct RuleOptions {
    /// Weight files at or above this size are flagged.
    pub weight_threshold: u64,
    pub max_examples: usize,
}

impl Default for RuleOptions {
    fn default() -> Self {
        Self {
            weight_threshold: 10 << 20,
            max_examples: 5,
        }
    }
}

#[derive(Default)]
struct Acc {
    bytes: u64,
    files: u64,
    layers: std::collections::BTreeSet<usize>,
    examples: Vec<(String, u64)>,
}

impl Acc {
    fn add(&mut self, path: &str, size: u64, layer: usize) {
        self.bytes += size;
        self.files += 1;
        self.layers.insert(layer);
        self.examples.push((path.to_owned(), size));
    }

    fn finish(mut self, rule: Rule, title: String, fix: &str, max: usize) -> Option<Finding> {
        if self.files == 0 || self.bytes == 0 {
            return None;
        }
        self.examples
            .sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        self.examples.truncate(max);
        Some(Finding {
            rule,
            title,
            bytes: self.bytes,
            files: self.files,
            layers: self.layers.into_iter().collect(),
            examples: self.examples,
            fix: fix.to_owned(),
        })
    }
}

/// Total bytes and (path, size, layer) of one library on one side.
type LibCopies = (u64, Vec<(String, u64, usize)>);

/// Content findings on the final filesystem plus the written-then-deleted files.
pub fn content_findings(model: &Model, opts: &RuleOptions) -> Vec<Finding> {
    let mut caches: BTreeMap<&'static str, Acc> = BTreeMap::new();
    let (mut pyc, mut tool, mut devel, mut weights, mut git) = (
        Acc::default(),
        Acc::default(),
        Acc::default(),
        Acc::default(),
        Acc::default(),
    );
    let mut pip_nv: HashMap<String, LibCopies> = HashMap::new();
    let mut sys_nv: HashMap<String, LibCopies> = HashMap::new();
    for (path, n) in model.files() {
        let size = n.size;
        if let Some(k) = cache_kind(path) {
            caches.entry(k).or_default().add(path, size, n.layer);
        } else if is_git(path) {
            git.add(path, size, n.layer);
        } else if is_weight(path, size, opts.weight_threshold) {
            weights.add(path, size, n.layer);
        } else if is_pycache(path) {
            pyc.add(path, size, n.layer);
        } else if is_toolchain(path) {
            tool.add(path, size, n.layer);
        } else if is_cuda_devel(path) {
            devel.add(path, size, n.layer);
        }
        if n.kind == EntryKind::File && size > 0 {
            if let Some(key) = nvidia_lib_key(path) {
                let side = if is_pip_nvidia(path) {
                    Some(&mut pip_nv)
                } else if is_system_nvidia(path) {
                    Some(&mut sys_nv)
                } else {
                    None
                };
                if let Some(side) = side {
                    let e = side.entry(key).or_default();
                    e.0 += size;
                    e.1.push((path.clone(), size, n.layer));
                }
            }
        }
    }
    let max = opts.max_examples;
    let mut out = Vec::new();
    for (k, acc) in caches {
        out.extend(acc.finish(
            Rule::PackageCache,
            format!("{k} cache in the image"),
            cache_fix(k),
            max,
        ));
    }
    out.extend(pyc.finish(
        Rule::Pycache,
        "__pycache__ / *.pyc files".into(),
        "ENV PYTHONDONTWRITEBYTECODE=1 and pip install --no-compile; they are rebuilt at run time",
        max,
    ));
    let mut tc = tool;
    tc.bytes += devel.bytes;
    tc.files += devel.files;
    tc.layers.extend(devel.layers);
    tc.examples.extend(devel.examples);
    out.extend(tc.finish(
        Rule::BuildToolchain,
        "build toolchain in the final image (gcc, nvcc, CUDA headers and static libs)".into(),
        "devel base where runtime would do: build in a nvidia/cuda:*-devel stage and copy the results into a nvidia/cuda:*-runtime final stage",
        max,
    ));
    let mut dup = Acc::default();
    let mut keys: Vec<&String> = pip_nv.keys().filter(|k| sys_nv.contains_key(*k)).collect();
    keys.sort();
    for k in keys {
        let (pb, pf) = &pip_nv[k];
        let (sb, sf) = &sys_nv[k];
        // The smaller side is what removing one copy saves.
        let side = if sb <= pb { sf } else { pf };
        for (p, s, l) in side {
            dup.add(p, *s, *l);
        }
    }
    out.extend(dup.finish(
        Rule::NvidiaDuplicate,
        "NVIDIA libraries present twice (pip nvidia-* wheels and the CUDA toolkit)".into(),
        "torch's pip wheels already ship CUDA (nvidia-* packages): use a base without the CUDA libraries (nvidia/cuda:*-base or python:*-slim), or install a torch build that uses the system CUDA",
        max,
    ));
    out.extend(weights.finish(
        Rule::ModelWeights,
        format!("model weights baked into the image (files ≥ {} bytes)", opts.weight_threshold),
        "keep weights outside the image and fetch them when the job starts with `starling get` (an OCI artifact, oci://REGISTRY/REPO:TAG, or an object-store URL), which goes through the node's agent and the swarm, so the origin serves them about once per cluster; code updates then stop re-shipping them",
        max,
    ));
    out.extend(git.finish(
        Rule::GitDirectory,
        ".git directory in the image".into(),
        "add .git to .dockerignore",
        max,
    ));
    let mut deleted = Acc::default();
    for (path, c) in &model.copies {
        if c.deleted_in.is_some() && !model.tree.contains_key(path) {
            for (l, s) in &c.copies {
                deleted.add(path, *s, *l);
            }
        }
    }
    out.extend(deleted.finish(
        Rule::DeletedLater,
        "files written and deleted in later layers (still shipped)".into(),
        "delete them in the same RUN that creates them, or build in a separate stage; a later rm does not shrink the image",
        max,
    ));
    out
}

/// The first code layer, if history shows one.
pub fn first_code_layer(roles: &[LayerRole]) -> Option<usize> {
    roles.iter().position(|r| *r == LayerRole::Code)
}

/// Source code copied before dependency installation.
pub fn layer_order_finding(roles: &[LayerRole], layers: &[LayerScan]) -> Option<Finding> {
    let c = first_code_layer(roles)?;
    let deps: Vec<usize> = (c + 1..roles.len())
        .filter(|&i| roles[i] == LayerRole::DependencyInstall)
        .collect();
    if deps.is_empty() {
        return None;
    }
    let bytes = deps.iter().map(|&i| layers[i].declared_size).sum();
    Some(Finding {
        rule: Rule::LayerOrder,
        title: format!(
            "source code copied (layer {c}) before dependency installation (layer{} {}): a code change re-ships them",
            if deps.len() > 1 { "s" } else { "" },
            deps.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
        ),
        bytes,
        files: 0,
        layers: deps,
        examples: Vec::new(),
        fix: "COPY only the dependency manifests (requirements.txt, lock files) first, RUN the install, then COPY the source".into(),
    })
}

/// A mutable tag such as `latest`.
pub fn mutable_tag_finding(
    tag: Option<&str>,
    pinned: bool,
    digest: Option<&oci::Digest>,
) -> Option<Finding> {
    if pinned {
        return None;
    }
    let t = tag?;
    if t != "latest" {
        return None;
    }
    Some(Finding {
        rule: Rule::MutableTag,
        title: "image referenced by the mutable tag `latest`".into(),
        bytes: 0,
        files: 0,
        layers: Vec::new(),
        examples: Vec::new(),
        fix: match digest {
            Some(d) => format!("pin by digest (…@{d}) or use an immutable version tag, so every node runs the same bytes"),
            None => "pin by digest or use an immutable version tag, so every node runs the same bytes".into(),
        },
    })
}

/// Bytes per category written by each layer (every copy, as shipped).
pub fn layer_categories(layer: &LayerScan, weight_threshold: u64) -> BTreeMap<Category, u64> {
    let mut m = BTreeMap::new();
    for e in &layer.entries {
        if e.kind == EntryKind::File && e.size > 0 {
            *m.entry(categorize(&e.path, e.size, weight_threshold))
                .or_insert(0) += e.size;
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_kinds() {
        let cases = [
            ("root/.cache/pip/http/a/b", Some("pip")),
            ("opt/conda/pkgs/numpy-1.26/info/x", Some("conda")),
            ("root/miniconda3/pkgs/cache/1.json", Some("conda")),
            (
                "root/.cache/huggingface/hub/models--x/blobs/y",
                Some("huggingface"),
            ),
            ("root/.cache/torch/hub/checkpoints/r.pth", Some("torch")),
            ("var/lib/apt/lists/deb.debian.org_dists", Some("apt-lists")),
            ("var/lib/apt/lists/lock", None),
            ("var/cache/apt/archives/gcc_12.deb", Some("apt-archives")),
            ("root/.npm/_cacache/index-v5/aa", Some("npm")),
            ("usr/local/share/.cache/yarn/v6/pkg", Some("yarn")),
            ("opt/pkgs/readme", None),
            ("usr/lib/python3/site-packages/pip/__init__.py", None),
        ];
        for (p, want) in cases {
            assert_eq!(cache_kind(p), want, "{p}");
        }
    }

    #[test]
    fn categories() {
        let t = 100;
        assert_eq!(
            categorize("usr/local/cuda/bin/nvcc", 1, t),
            Category::Toolchain
        );
        assert_eq!(
            categorize("usr/local/cuda-12.4/nvvm/bin/cicc", 1, t),
            Category::Toolchain
        );
        assert_eq!(
            categorize("usr/lib/gcc/x86_64-linux-gnu/12/cc1plus", 1, t),
            Category::Toolchain
        );
        assert_eq!(
            categorize("usr/bin/x86_64-linux-gnu-gcc-12", 1, t),
            Category::Toolchain
        );
        assert_eq!(categorize("usr/bin/python3", 1, t), Category::Other);
        assert_eq!(
            categorize("usr/local/cuda/targets/x86_64-linux/include/cublas.h", 1, t),
            Category::CudaDevel
        );
        assert_eq!(
            categorize("usr/lib/x86_64-linux-gnu/libcudnn_static_v8.a", 1, t),
            Category::CudaDevel
        );
        assert_eq!(
            categorize("usr/local/cuda/lib64/libcudart.so.12", 1, t),
            Category::Other
        );
        assert_eq!(
            categorize("models/m.safetensors", 100, t),
            Category::Weights
        );
        assert_eq!(categorize("models/m.safetensors", 99, t), Category::Other);
        assert_eq!(categorize("srv/x.bin", 500, t), Category::Weights);
        assert_eq!(categorize("app/.git/objects/ab", 1, t), Category::Git);
        assert_eq!(
            categorize("app/x/__pycache__/m.cpython-311.pyc", 1, t),
            Category::Pycache
        );
        assert_eq!(
            nvidia_lib_key("usr/local/cuda/lib64/libcublasLt.so.12.1.0").as_deref(),
            Some("libcublasLt")
        );
    }

    #[test]
    fn created_by_roles() {
        let scan = |paths: &[&str]| {
            let mut l = LayerScan {
                index: 0,
                digest: oci::Digest::of(b""),
                media_type: String::new(),
                declared_size: 0,
                compressed_size: 0,
                uncompressed_size: 0,
                compression: crate::engine::Compression::None,
                entries: Vec::new(),
                problems: Vec::new(),
                notes: Vec::new(),
                complete: true,
            };
            for p in paths {
                l.entries.push(crate::engine::LayerEntry {
                    path: (*p).into(),
                    kind: EntryKind::File,
                    size: 1,
                    link: None,
                    hash: None,
                });
            }
            l
        };
        let code = scan(&["app/main.py", "app/requirements.txt"]);
        let reqs = scan(&["app/requirements.txt", "app/pyproject.toml"]);
        assert_eq!(
            layer_role(Some("COPY . /app # buildkit"), &code),
            LayerRole::Code
        );
        assert_eq!(
            layer_role(Some("/bin/sh -c #(nop) COPY dir:abc in /app "), &code),
            LayerRole::Code
        );
        assert_eq!(
            layer_role(
                Some("COPY requirements.txt pyproject.toml /app/ # buildkit"),
                &reqs
            ),
            LayerRole::DependencyManifest
        );
        assert_eq!(
            layer_role(Some("COPY --from=build /out /app"), &code),
            LayerRole::Other
        );
        assert_eq!(
            layer_role(Some("/bin/sh -c #(nop) ADD file:5d6b in / "), &code),
            LayerRole::Base
        );
        assert_eq!(
            layer_role(
                Some("/bin/sh -c apt-get update && apt-get install -y gcc"),
                &code
            ),
            LayerRole::DependencyInstall
        );
        assert_eq!(
            layer_role(
                Some("RUN |1 X=1 /bin/sh -c uv pip install -r req.txt # buildkit"),
                &code
            ),
            LayerRole::DependencyInstall
        );
        assert_eq!(layer_role(Some("RUN make"), &code), LayerRole::Other);
        assert_eq!(layer_role(None, &code), LayerRole::Unknown);
        let roles = [
            LayerRole::Base,
            LayerRole::DependencyManifest,
            LayerRole::DependencyInstall,
            LayerRole::Code,
        ];
        let layers: Vec<LayerScan> = (0..4).map(|_| scan(&[])).collect();
        assert!(
            layer_order_finding(&roles, &layers).is_none(),
            "the recommended order is not flagged"
        );
    }
}
