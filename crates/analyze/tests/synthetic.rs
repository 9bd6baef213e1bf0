//! Exact figures on images built deterministically with the test layer builder.
#![allow(clippy::unwrap_used)]
mod common;

use analyze::engine::{Compression, ProblemKind};
use analyze::rules::{LayerRole, Rule};
use common::*;

const LONG: &str = "app/a-directory-name-that-is-quite-long-to-need-pax/another-rather-long-directory-name-for-pax-records/and-a-file-name-too.txt";

pub fn main_layers() -> Vec<Layer> {
    let l0 = tar_layer(&[
        E::Dir("usr"),
        E::Dir("usr/bin"),
        E::File("usr/bin/gcc", bytes(1000, 1)),
        E::File("usr/local/cuda-12.1/include/cuda.h", bytes(500, 2)),
        E::File(
            "usr/local/cuda-12.1/lib64/libcublas_static.a",
            bytes(2000, 3),
        ),
        E::File("usr/local/cuda-12.1/lib64/libcublas.so.12", bytes(3000, 4)),
        E::File("etc/config", bytes(100, 5)),
        E::Dir("opt/old"),
        E::File("opt/old/a", bytes(400, 6)),
        E::File("opt/old/b", bytes(600, 7)),
        E::File("tmp/big", bytes(5000, 8)),
    ]);
    let l1 = tar_layer(&[
        E::File("app/main.py", bytes(200, 9)),
        E::File("app/.git/objects/pack/p.pack", bytes(700, 10)),
        E::File("app/model.safetensors", bytes(20000, 11)),
        E::Hardlink("app/main_link.py", "app/main.py"),
        E::Symlink("app/latest", "main.py"),
        E::PaxFile(LONG, bytes(50, 12)),
        E::File("etc/config", bytes(150, 13)),
    ]);
    let l2 = tar_layer(&[
        E::File(
            "usr/lib/python3/site-packages/nvidia/cublas/lib/libcublas.so.12",
            bytes(2500, 14),
        ),
        E::File("root/.cache/pip/http/abc", bytes(800, 15)),
        E::File(
            "usr/lib/python3/site-packages/torch/__pycache__/x.cpython-311.pyc",
            bytes(300, 16),
        ),
        E::File(
            "var/lib/apt/lists/archive.ubuntu.com_Packages",
            bytes(400, 17),
        ),
        E::Whiteout("tmp/big"),
        E::Opaque("opt/old"),
        E::File("opt/old/c", bytes(50, 18)),
    ]);
    let l3 = tar_layer(&[E::Whiteout("etc/config")]);
    vec![
        Layer::gz(l0, "/bin/sh -c #(nop) ADD file:0123 in / "),
        Layer::zst(l1, "COPY . /app # buildkit"),
        Layer::gz(
            l2,
            "RUN /bin/sh -c pip install -r requirements.txt # buildkit",
        ),
        Layer::gz(l3, "RUN /bin/sh -c rm -f /etc/config # buildkit"),
    ]
}

#[test]
fn main_image_exact_figures() {
    let dir = tempfile::tempdir().unwrap();
    let mut lay = Layout::new(dir.path());
    let layers = main_layers();
    let sizes: Vec<u64> = layers.iter().map(|l| l.size()).collect();
    let d = lay.image(&layers, "amd64");
    lay.tag(d, "latest");
    let image = open(&format!("oci:{}:latest", dir.path().display()));
    let a = analyze::analyze(&image, &opts());
    let r = &a.report;
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    // Efficiency: cumulative 37750, wasted = etc/config 250 + opt/old/{a,b} 1000 + tmp/big 5000.
    assert_eq!(r.efficiency.cumulative_bytes, 37_750);
    assert_eq!(r.efficiency.wasted_bytes, 6_250);
    assert_eq!(r.efficiency.kept_bytes, 31_500);
    assert!((r.efficiency.efficiency - 31_500.0 / 37_750.0).abs() < 1e-12);
    // Per layer.
    let ch: Vec<(u64, u64, u64)> = r
        .layers
        .iter()
        .map(|l| (l.changes.added, l.changes.changed, l.changes.deleted))
        .collect();
    assert_eq!(ch, vec![(8, 0, 0), (6, 1, 0), (5, 0, 3), (0, 0, 1)]);
    assert_eq!(r.layers[2].changes.deleted_bytes, 6000);
    assert_eq!(r.layers[3].changes.deleted_bytes, 150);
    assert_eq!(r.layers[1].compression, Compression::Zstd);
    assert_eq!(r.layers[0].compression, Compression::Gzip);
    let comp: Vec<u64> = r.layers.iter().map(|l| l.compressed_size).collect();
    assert_eq!(comp, sizes);
    for (l, layer) in r.layers.iter().zip(&layers) {
        assert!(l.complete);
        // uncompressed = tar stream length, which diff_id hashes.
        assert_eq!(l.uncompressed_size % 512, 0);
        let _ = layer;
    }
    let roles: Vec<LayerRole> = r.layers.iter().map(|l| l.role).collect();
    assert_eq!(
        roles,
        vec![
            LayerRole::Base,
            LayerRole::Code,
            LayerRole::DependencyInstall,
            LayerRole::Other
        ]
    );
    // PAX long name, hard link and symlink are in the merged tree.
    assert_eq!(a.model.tree.get(LONG).map(|n| n.size), Some(50));
    assert_eq!(
        a.model
            .tree
            .get("app/main_link.py")
            .and_then(|n| n.link.clone())
            .as_deref(),
        Some("app/main.py")
    );
    assert_eq!(
        a.model
            .tree
            .get("app/latest")
            .and_then(|n| n.link.clone())
            .as_deref(),
        Some("main.py")
    );
    assert!(!a.model.tree.contains_key("tmp/big") && !a.model.tree.contains_key("opt/old/a"));
    assert!(a.model.tree.contains_key("opt/old/c") && !a.model.tree.contains_key("etc/config"));
    // Findings, exact bytes.
    assert_eq!(r.rule_bytes(Rule::PackageCache), 1200);
    let titles: Vec<&str> = r
        .finding(Rule::PackageCache)
        .map(|f| f.title.as_str())
        .collect();
    assert_eq!(
        titles,
        vec!["pip cache in the image", "apt-lists cache in the image"]
    );
    assert_eq!(r.rule_bytes(Rule::Pycache), 300);
    assert_eq!(r.rule_bytes(Rule::BuildToolchain), 3500);
    assert_eq!(r.rule_bytes(Rule::NvidiaDuplicate), 2500);
    assert_eq!(r.rule_bytes(Rule::ModelWeights), 20_000);
    assert!(
        r.finding(Rule::ModelWeights)
            .all(|f| f.fix.contains("starling get")),
        "the weights finding points at `starling get`"
    );
    assert_eq!(r.rule_bytes(Rule::GitDirectory), 700);
    assert_eq!(r.rule_bytes(Rule::DeletedLater), 6250);
    // The dependency install in layer 2 comes after the COPY in layer 1: it re-ships.
    assert_eq!(r.rule_bytes(Rule::LayerOrder), sizes[2]);
    assert_eq!(r.finding(Rule::MutableTag).count(), 1);
    assert_eq!(r.cost.cold_bytes, sizes.iter().sum::<u64>());
    assert_eq!(r.cost.update_from_layer, Some(1));
    assert_eq!(r.cost.update_bytes, sizes[1] + sizes[2] + sizes[3]);
    assert!(!r.cost.update_assumed);
    // Wasted path list: kept copy never counted (dive #684).
    let w: Vec<(&str, u64)> = r
        .wasted
        .iter()
        .map(|w| (w.path.as_str(), w.wasted_bytes))
        .collect();
    assert_eq!(
        w,
        vec![
            ("tmp/big", 5000),
            ("opt/old/b", 600),
            ("opt/old/a", 400),
            ("etc/config", 250)
        ]
    );
}

#[test]
fn overwrite_keeps_smallest_copy_and_whiteout_only_layer() {
    // dive bug #684: a path written twice wastes only the larger copy.
    let dir = tempfile::tempdir().unwrap();
    let mut lay = Layout::new(dir.path());
    let layers = vec![
        Layer::gz(
            tar_layer(&[
                E::File("data/x", bytes(300, 1)),
                E::File("data/y", bytes(10, 1)),
            ]),
            "COPY base /",
        ),
        Layer::gz(tar_layer(&[E::File("data/x", bytes(100, 2))]), "RUN gen"),
        Layer::gz(
            tar_layer(&[E::Whiteout("data/nothing-there")]),
            "RUN rm -f /data/nothing-there",
        ),
        Layer::gz(tar_layer(&[]), "RUN true"),
    ];
    let d = lay.image(&layers, "amd64");
    lay.tag(d, "v1");
    let image = open(&format!("oci:{}:v1", dir.path().display()));
    let r = analyze::analyze(&image, &opts()).report;
    assert_eq!(
        (
            r.efficiency.cumulative_bytes,
            r.efficiency.kept_bytes,
            r.efficiency.wasted_bytes
        ),
        (410, 110, 300)
    );
    assert_eq!(r.layers[2].changes, Default::default());
    assert_eq!(r.layers[1].changes.changed, 1);
    assert_eq!(r.finding(Rule::MutableTag).count(), 0);
    assert!(r.problems.is_empty());
}

#[test]
fn multi_platform_index_picks_platform() {
    let dir = tempfile::tempdir().unwrap();
    let mut lay = Layout::new(dir.path());
    let amd = lay.image(
        &[Layer::gz(
            tar_layer(&[E::File("amd", bytes(11, 0))]),
            "COPY amd /",
        )],
        "amd64",
    );
    let arm = lay.image(
        &[Layer::gz(
            tar_layer(&[E::File("arm", bytes(22, 0))]),
            "COPY arm /",
        )],
        "arm64",
    );
    lay.tag_index(vec![amd, arm], "multi");
    let spec = analyze::source::SourceSpec::parse(&format!("oci:{}:multi", dir.path().display()));
    let o = analyze::source::OpenOptions {
        platform: Some("linux/arm64".into()),
        ..Default::default()
    };
    let image = analyze::source::open(&spec, &o).unwrap();
    let r = analyze::analyze(&image, &opts()).report;
    assert_eq!(r.efficiency.cumulative_bytes, 22);
    assert_eq!(r.platform.as_deref(), Some("linux/arm64"));
    let o = analyze::source::OpenOptions {
        platform: Some("linux/s390x".into()),
        ..Default::default()
    };
    let err = analyze::source::open(&spec, &o).unwrap_err().to_string();
    assert!(
        err.contains("linux/s390x") && err.contains("linux/arm64"),
        "{err}"
    );
    // Default: the host platform.
    let host = analyze::source::open(&spec, &Default::default()).unwrap();
    let r = analyze::analyze(&host, &opts()).report;
    let expect = if std::env::consts::ARCH == "aarch64" {
        22
    } else {
        11
    };
    assert_eq!(r.efficiency.cumulative_bytes, expect);
}

#[test]
fn bad_input_is_reported_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let mut lay = Layout::new(dir.path());
    let good = Layer::gz(tar_layer(&[E::File("ok", bytes(10, 0))]), "COPY ok /");
    // `..` and absolute names written raw into the header.
    let evil = Layer::gz(
        tar_layer(&[
            E::RawName(b"../../etc/evil", bytes(7, 0)),
            E::RawName(b"/etc/abs", bytes(9, 0)),
            E::File("fine", bytes(5, 0)),
            E::Hardlink("link", "ok"),
        ]),
        "RUN evil",
    );
    // Truncated gzip: the manifest agrees with the short blob (no size lie).
    let full = gzip(&tar_layer(&[E::File("t/big", bytes(100_000, 3))]));
    let truncated = Layer::new(full[..full.len() / 2].to_vec(), GZIP, b"", "RUN truncated");
    // Gzip bomb: 64 MiB of zeros, capped at 8 MiB below.
    let bomb_tar = tar_layer(&[E::File("zeros", vec![0u8; 64 << 20])]);
    let bomb = Layer::new(gzip(&bomb_tar), GZIP, &bomb_tar, "RUN bomb");
    assert!(bomb.size() < 200_000);
    let mut unknown = Layer::gz(tar_layer(&[E::File("u", bytes(3, 0))]), "RUN helm");
    unknown.media_type = "application/vnd.cncf.helm.chart.content.v1.tar+gzip".into();
    let mut liar = Layer::gz(tar_layer(&[E::File("l", bytes(3, 0))]), "RUN lie");
    liar.declared_size = Some(liar.size() + 10);
    let mut wrong_digest = Layer::gz(tar_layer(&[E::File("w", bytes(3, 0))]), "RUN wd");
    wrong_digest.declared_digest = Some(sha(b"something else"));
    let mut corrupt_blob = gzip(&tar_layer(&[E::File("c", bytes(50_000, 9))]));
    let mid = corrupt_blob.len() / 2;
    for b in &mut corrupt_blob[mid..mid + 64] {
        *b ^= 0x5a;
    }
    let corrupt = Layer::new(corrupt_blob, GZIP, b"", "RUN corrupt");
    let layers = vec![
        good,
        evil,
        truncated,
        bomb,
        unknown,
        liar,
        wrong_digest,
        corrupt,
    ];
    let d = lay.image(&layers, "amd64");
    lay.tag(d, "bad");
    let image = open(&format!("oci:{}:bad", dir.path().display()));
    let mut o = opts();
    o.scan.max_layer_bytes = 8 << 20;
    let a = analyze::analyze(&image, &o);
    let r = &a.report;
    let kinds: Vec<(Option<usize>, ProblemKind)> =
        r.problems.iter().map(|p| (p.layer, p.kind)).collect();
    assert_eq!(
        kinds,
        vec![
            (Some(1), ProblemKind::UnsafePath),
            (Some(1), ProblemKind::UnsafePath),
            (Some(2), ProblemKind::Truncated),
            (Some(3), ProblemKind::DecompressionBomb),
            (Some(4), ProblemKind::UnknownMediaType),
            (Some(5), ProblemKind::SizeMismatch),
            (Some(6), ProblemKind::DigestMismatch),
            (Some(7), ProblemKind::Corrupt),
        ],
        "{:#?}",
        r.problems
    );
    assert!(r.problems[0].message.contains("../../etc/evil"));
    assert!(r.problems[1].message.contains("absolute path /etc/abs"));
    assert!(r.problems[3].message.contains("8388608"));
    // The good content of the evil layer is kept; nothing escaped.
    assert!(a.model.tree.contains_key("fine") && a.model.tree.contains_key("link"));
    assert!(!a
        .model
        .tree
        .keys()
        .any(|k| k.contains("evil") || k.contains("abs")));
    let complete: Vec<bool> = r.layers.iter().map(|l| l.complete).collect();
    assert_eq!(
        complete,
        vec![true, true, false, false, false, true, true, false]
    );
}

#[test]
fn ratio_cap_stops_zstd_bomb() {
    let dir = tempfile::tempdir().unwrap();
    let mut lay = Layout::new(dir.path());
    let t = tar_layer(&[E::File("zeros", vec![0u8; 16 << 20])]);
    let layers = vec![Layer::zst(t, "RUN zeros")];
    let d = lay.image(&layers, "amd64");
    lay.tag(d, "z");
    let image = open(&format!("oci:{}:z", dir.path().display()));
    let mut o = opts();
    o.scan.ratio_grace = 1 << 20;
    o.scan.max_ratio = 100;
    let r = analyze::analyze(&image, &o).report;
    assert_eq!(r.problems.len(), 1);
    assert_eq!(r.problems[0].kind, ProblemKind::DecompressionBomb);
    assert!(
        r.problems[0].message.contains("ratio above 100:1"),
        "{}",
        r.problems[0].message
    );
}

#[test]
fn dangling_hardlink_reported() {
    let dir = tempfile::tempdir().unwrap();
    let mut lay = Layout::new(dir.path());
    let layers = vec![Layer::gz(
        tar_layer(&[E::Hardlink("a", "missing")]),
        "RUN x",
    )];
    let d = lay.image(&layers, "amd64");
    lay.tag(d, "h");
    let r = analyze::analyze(&open(&format!("oci:{}:h", dir.path().display())), &opts()).report;
    assert_eq!(r.problems.len(), 1);
    assert_eq!(r.problems[0].kind, ProblemKind::DanglingHardlink);
}

#[test]
fn missing_tar_padding_tolerated_but_cut_data_is_truncation() {
    // umoci 0.4.7 ends layers right after the last file's data; tolerate exactly that.
    let full = tar_layer(&[E::File("a", bytes(700, 1)), E::File("b", bytes(1000, 2))]);
    let data_end = 512 + 1024 + 512 + 1000; // header a, data a padded, header b, data b
    let unpadded = full[..data_end].to_vec();
    let cut = full[..data_end - 1].to_vec();
    let dir = tempfile::tempdir().unwrap();
    let mut lay = Layout::new(dir.path());
    let layers = vec![
        Layer::new(gzip(&unpadded), GZIP, &unpadded, "RUN a"),
        Layer::new(gzip(&cut), GZIP, &cut, "RUN b"),
    ];
    let d = lay.image(&layers, "amd64");
    lay.tag(d, "p");
    let r = analyze::analyze(&open(&format!("oci:{}:p", dir.path().display())), &opts()).report;
    assert_eq!(r.notes.len(), 1, "{:?}", r.notes);
    assert!(r.notes[0].starts_with("layer 0: tar stream ends without padding"));
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    assert_eq!(
        (r.problems[0].layer, r.problems[0].kind),
        (Some(1), ProblemKind::Truncated)
    );
    assert_eq!(r.layers[0].uncompressed_size, data_end as u64);
    assert!(r.layers[0].complete && !r.layers[1].complete);
    assert_eq!(r.layers[0].changes.added_bytes, 1700);
}
