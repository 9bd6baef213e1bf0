//! Replays every committed fuzz corpus file through the check its target runs, on
//! stable, in every `cargo test` (CI). The corpora live in `fuzz/corpus/<target>/` at
//! the workspace root; the checks in `fuzzcheck` are the very functions the
//! cargo-fuzz targets call.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use fuzzcheck::{seeds, target, TARGETS};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

#[test]
fn every_corpus_file_replays_through_its_check() {
    let corpus = fuzz_dir().join("corpus");
    let mut summary = Vec::new();
    let mut failures = Vec::new();
    for t in TARGETS {
        let dir = corpus.join(t.name);
        let inputs = files(&dir);
        assert!(!inputs.is_empty(), "fuzz/corpus/{} is empty", t.name);
        let mut accepted = 0;
        for path in &inputs {
            let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let result = std::panic::catch_unwind(|| (t.check)(&data));
            match result {
                Ok(true) => accepted += 1,
                Ok(false) => {}
                Err(_) => failures.push(format!("{} ({} bytes)", path.display(), data.len())),
            }
        }
        // A corpus whose every input is refused at the first check would replay
        // nothing of the parser behind it.
        assert!(
            accepted > 0,
            "no input of fuzz/corpus/{} gets past the parser",
            t.name
        );
        summary.push(format!("{} {}/{}", t.name, accepted, inputs.len()));
    }
    println!("accepted/replayed: {}", summary.join(", "));
    assert!(
        failures.is_empty(),
        "inputs failing their check:\n{}",
        failures.join("\n")
    );
}

#[test]
fn corpus_directories_and_fuzz_targets_match_the_checks() {
    let root = fuzz_dir();
    let dirs: BTreeSet<String> = std::fs::read_dir(root.join("corpus"))
        .expect("fuzz/corpus")
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let names: BTreeSet<String> = TARGETS.iter().map(|t| t.name.to_owned()).collect();
    assert_eq!(dirs, names, "one corpus directory per target");
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("fuzz/Cargo.toml");
    let harnesses: BTreeSet<String> = files(&root.join("fuzz_targets"))
        .iter()
        .filter_map(|p| Some(p.file_stem()?.to_string_lossy().into_owned()))
        .collect();
    assert_eq!(harnesses, names, "one fuzz_targets/<name>.rs per target");
    for name in &names {
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] {name}"
        );
        let src = std::fs::read_to_string(root.join("fuzz_targets").join(format!("{name}.rs")))
            .expect("harness");
        assert!(
            src.contains(&format!("fuzzcheck::{name}(")),
            "fuzz_targets/{name}.rs must call fuzzcheck::{name}"
        );
    }
}

#[test]
fn every_seed_passes_its_check() {
    let all = seeds::seeds();
    for t in TARGETS {
        assert!(
            all.iter().any(|(n, _, _)| *n == t.name),
            "no seed for {}",
            t.name
        );
    }
    let mut failures = Vec::new();
    for (name, seed, data) in &all {
        let t = target(name).unwrap_or_else(|| panic!("seed for unknown target {name}"));
        if std::panic::catch_unwind(|| (t.check)(data)).is_err() {
            failures.push(format!("{name}/{seed}"));
        }
    }
    assert!(
        failures.is_empty(),
        "seeds failing their check: {failures:?}"
    );
}
