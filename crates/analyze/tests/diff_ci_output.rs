//! `diff`, CI thresholds and the three output formats.
#![allow(clippy::unwrap_used)]
mod common;

use analyze::cli::{AnalyzeArgs, CommonArgs, DiffArgs};
use clap::Parser;
use common::*;

#[derive(Parser)]
struct A {
    #[command(flatten)]
    a: AnalyzeArgs,
}

#[derive(Parser)]
struct D {
    #[command(flatten)]
    d: DiffArgs,
}

fn analyze_args(args: &[&str]) -> AnalyzeArgs {
    A::parse_from(std::iter::once("analyze").chain(args.iter().copied())).a
}

fn diff_args(args: &[&str]) -> DiffArgs {
    D::parse_from(std::iter::once("diff").chain(args.iter().copied())).d
}

fn base() -> Vec<u8> {
    tar_layer(&[E::File("usr/lib/libc.so", bytes(4000, 1))])
}

fn deps(mtime: u64) -> Vec<u8> {
    tar_layer_at(
        &[
            E::File("usr/lib/python3/site-packages/torch/lib.so", bytes(9000, 2)),
            E::File(
                "usr/lib/python3/site-packages/numpy/core.so",
                bytes(3000, 3),
            ),
        ],
        mtime,
    )
}

fn code(v: u8) -> Vec<u8> {
    tar_layer(&[
        E::File("app/main.py", bytes(500, v)),
        E::File("app/util.py", bytes(700, 7)),
    ])
}

/// Writes two versions in both layer orders; returns (good_v1, good_v2, bad_v1, bad_v2) specs.
fn versions(dir: &Path) -> (String, String, String, String, Vec<u64>) {
    let mut lay = Layout::new(dir);
    let b = Layer::gz(base(), "/bin/sh -c #(nop) ADD file:abc in / ");
    let good1 = vec![
        Layer::gz(base(), "/bin/sh -c #(nop) ADD file:abc in / "),
        Layer::gz(deps(1), "RUN pip install -r requirements.txt"),
        Layer::gz(code(1), "COPY . /app"),
    ];
    let good2 = vec![
        Layer::gz(base(), "/bin/sh -c #(nop) ADD file:abc in / "),
        Layer::gz(deps(1), "RUN pip install -r requirements.txt"),
        Layer::gz(code(2), "COPY . /app"),
    ];
    // Bad order: code first, so the (identical) dependencies are rebuilt.
    let bad1 = vec![
        Layer::gz(base(), "/bin/sh -c #(nop) ADD file:abc in / "),
        Layer::gz(code(1), "COPY . /app"),
        Layer::gz(deps(1), "RUN pip install -r requirements.txt"),
    ];
    let bad2 = vec![
        Layer::gz(base(), "/bin/sh -c #(nop) ADD file:abc in / "),
        Layer::gz(code(2), "COPY . /app"),
        Layer::gz(deps(2), "RUN pip install -r requirements.txt"),
    ];
    let sizes = vec![b.size(), good2[2].size(), bad2[1].size(), bad2[2].size()];
    for (layers, tag) in [
        (good1, "good1"),
        (good2, "good2"),
        (bad1, "bad1"),
        (bad2, "bad2"),
    ] {
        let d = lay.image(&layers, "amd64");
        lay.tag(d, tag);
    }
    let p = dir.display();
    (
        format!("oci:{p}:good1"),
        format!("oci:{p}:good2"),
        format!("oci:{p}:bad1"),
        format!("oci:{p}:bad2"),
        sizes,
    )
}

use std::path::Path;

#[test]
fn diff_shared_layers_and_file_level_reuse() {
    let t = tempfile::tempdir().unwrap();
    let (g1, g2, b1, b2, sizes) = versions(t.path());
    let out = analyze::cli::diff_to_string(&diff_args(&[&g1, &g2, "--json"])).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["shared"].as_array().unwrap().len(), 2);
    assert_eq!(v["fetch_bytes"], sizes[1]);
    // util.py (700) is unchanged; main.py (500) is new.
    assert_eq!(v["changed"][0]["reused_bytes"], 700);
    assert_eq!(v["changed"][0]["new_bytes"], 500);
    assert_eq!(v["reused_bytes"], 700);

    let out = analyze::cli::diff_to_string(&diff_args(&[&b1, &b2, "--json"])).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["shared"].as_array().unwrap().len(), 1);
    assert_eq!(v["fetch_bytes"], sizes[2] + sizes[3]);
    // The rebuilt dependency layer is byte-for-byte the same files: all reusable.
    assert_eq!(v["changed"][1]["files"], 2);
    assert_eq!(v["changed"][1]["reused_bytes"], 12_000);
    assert_eq!(v["changed"][1]["new_bytes"], 0);
    assert_eq!(v["changed"][1]["ideal_compressed"], 0);
    assert_eq!(v["reused_bytes"], 12_700);
    let text = analyze::cli::diff_to_string(&diff_args(&[&b1, &b2, "--color", "never"])).unwrap();
    assert!(text.contains("Shared 1 layer(s)"), "{text}");
    assert!(text.contains("already existed in A"), "{text}");
}

#[test]
fn ci_thresholds_fail_with_explanations() {
    let t = tempfile::tempdir().unwrap();
    let (_, _, _, b2, sizes) = versions(t.path());
    let strict = t.path().join("strict.toml");
    std::fs::write(
        &strict,
        format!(
            "min_efficiency = 0.99\nmax_wasted_bytes = 0\nforbid_weights = true\nmax_code_layer_update = {}\n",
            sizes[2] + sizes[3] - 1
        ),
    )
    .unwrap();
    let (code, out) = analyze::cli::analyze_to_string(&analyze_args(&[
        &b2,
        "--ci",
        strict.to_str().unwrap(),
        "--color",
        "never",
    ]))
    .unwrap();
    // Efficiency is 1.0 and no weights: only the code-layer update fails.
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("CI: 1 rule(s) failed"), "{out}");
    assert!(
        out.contains(&format!(
            "a code-only change re-ships {} bytes (from layer 1: COPY . /app)",
            sizes[2] + sizes[3]
        )),
        "{out}"
    );

    // Weights and waste fail too.
    let mut lay = Layout::new(&t.path().join("w"));
    let layers = vec![
        Layer::gz(
            tar_layer(&[
                E::File("models/llama.gguf", bytes(50_000, 1)),
                E::File("tmp/x", bytes(1000, 2)),
            ]),
            "COPY models /models",
        ),
        Layer::gz(tar_layer(&[E::Whiteout("tmp/x")]), "RUN rm /tmp/x"),
    ];
    let d = lay.image(&layers, "amd64");
    lay.tag(d, "v2");
    let spec = format!("oci:{}:v2", t.path().join("w").display());
    let rules = t.path().join("rules.toml");
    std::fs::write(
        &rules,
        "min_efficiency = 0.99\nmax_wasted_bytes = \"500B\"\nforbid_weights = true\n",
    )
    .unwrap();
    let (code, out) = analyze::cli::analyze_to_string(&analyze_args(&[
        &spec,
        "--ci",
        rules.to_str().unwrap(),
        "--json",
        "--weights-threshold",
        "10KiB",
    ]))
    .unwrap();
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let failed: Vec<&str> = v["ci"]["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["rule"].as_str().unwrap())
        .collect();
    assert_eq!(
        failed,
        vec!["min_efficiency", "max_wasted_bytes", "forbid_weights"]
    );
    assert_eq!(v["efficiency"]["wasted_bytes"], 1000);
    assert!(v["ci"]["failures"][2]["message"]
        .as_str()
        .unwrap()
        .contains("/models/llama.gguf"));

    // A lenient file passes.
    let ok = t.path().join("ok.toml");
    std::fs::write(&ok, "min_efficiency = 0.5\nmax_wasted_bytes = \"1MiB\"\n").unwrap();
    let (code, out) = analyze::cli::analyze_to_string(&analyze_args(&[
        &spec,
        "--ci",
        ok.to_str().unwrap(),
        "--color",
        "never",
    ]))
    .unwrap();
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("CI: all thresholds pass"));

    // A bad thresholds file is an error, not a pass.
    let bad = t.path().join("bad.toml");
    std::fs::write(&bad, "min_efficiency = 3\n").unwrap();
    assert!(analyze::cli::analyze_to_string(&analyze_args(&[
        &spec,
        "--ci",
        bad.to_str().unwrap()
    ]))
    .is_err());
    std::fs::write(&bad, "max_wasted = 3\n").unwrap();
    assert!(analyze::cli::analyze_to_string(&analyze_args(&[
        &spec,
        "--ci",
        bad.to_str().unwrap()
    ]))
    .is_err());
}

#[test]
fn text_json_and_html_outputs() {
    let t = tempfile::tempdir().unwrap();
    let (_, _, _, b2, _) = versions(t.path());
    let html = t.path().join("r.html");
    let (code, text) = analyze::cli::analyze_to_string(&analyze_args(&[
        &b2,
        "--html",
        html.to_str().unwrap(),
        "--color",
        "always",
        "--nodes",
        "10",
    ]))
    .unwrap();
    assert_eq!(code, 0);
    assert!(text.contains("\x1b[1mImage\x1b[0m"));
    assert!(
        text.contains("source code copied (layer 1) before dependency installation (layer 2)"),
        "{text}"
    );
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.starts_with("<!doctype html>") && page.contains("<svg") && page.contains("</svg>")
    );
    assert!(!page.contains("<script") && !page.contains("<link") && !page.contains("src="));
    assert_eq!(
        page.matches("<rect").count() - 7,
        3,
        "one bar segment per non-empty layer/category + 7 legend boxes"
    );
    let (_, plain) =
        analyze::cli::analyze_to_string(&analyze_args(&[&b2, "--color", "never"])).unwrap();
    assert!(!plain.contains('\x1b'));
    let (_, json) = analyze::cli::analyze_to_string(&analyze_args(&[
        &b2,
        "--json",
        "--nodes",
        "10",
        "--origin-bandwidth",
        "1000B/s",
        "--node-bandwidth",
        "500B/s",
        "--node-upload",
        "100B/s",
    ]))
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let s = v["cost"]["cold_bytes"].as_f64().unwrap();
    assert_eq!(
        v["cost"]["cold"]["direct_seconds"].as_f64().unwrap(),
        (10.0 * s / 1000.0).max(s / 500.0)
    );
    assert_eq!(
        v["cost"]["cold"]["p2p_seconds"].as_f64().unwrap(),
        (s / 1000.0).max(s / 500.0).max(10.0 * s / 2000.0)
    );
    let _ = CommonArgs::clone;
}
