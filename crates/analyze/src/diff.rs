//! `starling diff A B`: what a node holding A must fetch for B, and how much of
//! B's changed layers already existed in A file by file.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use serde::Serialize;

use crate::cost::{human_seconds, Bandwidths, Estimate};
use crate::engine::{EntryKind, LayerScan, Problem};
use crate::report::Style;
use oci::size::format_size;

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SharedLayer {
    pub digest: oci::Digest,
    pub size: u64,
    pub index_a: usize,
    pub index_b: usize,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ChangedLayer {
    pub index: usize,
    pub digest: oci::Digest,
    pub compressed_size: u64,
    pub created_by: Option<String>,
    pub files: u64,
    pub file_bytes: u64,
    /// Files whose content (sha256) already existed somewhere in A.
    pub reused_files: u64,
    pub reused_bytes: u64,
    /// Bytes that are really new.
    pub new_bytes: u64,
    /// Compressed bytes that would remain if only new content shipped (pro rata).
    pub ideal_compressed: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct DiffReport {
    pub a: String,
    pub b: String,
    pub shared: Vec<SharedLayer>,
    pub shared_bytes: u64,
    /// Compressed bytes a node holding A must fetch for B.
    pub fetch_bytes: u64,
    pub changed: Vec<ChangedLayer>,
    pub reused_bytes: u64,
    /// Estimated compressed bytes a layer order that isolates changes would fetch.
    pub ideal_fetch_bytes: u64,
    pub fetch: Estimate,
    pub problems: Vec<Problem>,
}

/// Compares scans of A and B (B's changed layers must be scanned with hashing).
pub fn diff(
    a_name: &str,
    a: &[LayerScan],
    b_name: &str,
    b: &[LayerScan],
    b_history: &[Option<String>],
    nodes: u64,
    bw: Bandwidths,
) -> DiffReport {
    let a_by_digest: HashMap<&oci::Digest, usize> =
        a.iter().map(|l| (&l.digest, l.index)).collect();
    let a_hashes: HashSet<[u8; 32]> = a
        .iter()
        .flat_map(|l| l.entries.iter())
        .filter_map(|e| (e.kind == EntryKind::File).then_some(e.hash).flatten())
        .collect();
    let mut shared = Vec::new();
    let mut changed = Vec::new();
    let mut seen = HashSet::new();
    for l in b {
        if let Some(&ia) = a_by_digest.get(&l.digest) {
            shared.push(SharedLayer {
                digest: l.digest.clone(),
                size: l.declared_size,
                index_a: ia,
                index_b: l.index,
            });
            continue;
        }
        if !seen.insert(&l.digest) {
            continue; // the same new blob twice is fetched once
        }
        let mut c = ChangedLayer {
            index: l.index,
            digest: l.digest.clone(),
            compressed_size: l.declared_size,
            created_by: b_history.get(l.index).cloned().flatten(),
            files: 0,
            file_bytes: 0,
            reused_files: 0,
            reused_bytes: 0,
            new_bytes: 0,
            ideal_compressed: 0,
        };
        for e in l.entries.iter().filter(|e| e.kind == EntryKind::File) {
            c.files += 1;
            c.file_bytes += e.size;
            if e.hash.is_some_and(|h| a_hashes.contains(&h)) {
                c.reused_files += 1;
                c.reused_bytes += e.size;
            }
        }
        c.new_bytes = c.file_bytes - c.reused_bytes;
        c.ideal_compressed = if c.file_bytes == 0 {
            c.compressed_size
        } else {
            (c.compressed_size as u128 * c.new_bytes as u128 / c.file_bytes as u128) as u64
        };
        changed.push(c);
    }
    let fetch_bytes = changed.iter().map(|c| c.compressed_size).sum();
    let mut problems: Vec<Problem> = a
        .iter()
        .chain(b)
        .flat_map(|l| l.problems.iter().cloned())
        .collect();
    problems.dedup_by(|x, y| x.message == y.message && x.layer == y.layer);
    DiffReport {
        a: a_name.to_owned(),
        b: b_name.to_owned(),
        shared_bytes: shared.iter().map(|s| s.size).sum(),
        shared,
        fetch_bytes,
        reused_bytes: changed.iter().map(|c| c.reused_bytes).sum(),
        ideal_fetch_bytes: changed.iter().map(|c| c.ideal_compressed).sum(),
        changed,
        fetch: Estimate::new(fetch_bytes, nodes, &bw),
        problems,
    }
}

pub fn render_text(d: &DiffReport, st: Style) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{} {}\n  → {}", st.bold("Diff"), d.a, d.b);
    let _ = writeln!(
        o,
        "\n{} {} layer(s), {}",
        st.bold("Shared"),
        d.shared.len(),
        format_size(d.shared_bytes)
    );
    for s in &d.shared {
        let _ = writeln!(
            o,
            "  A#{} = B#{}  {}  {}",
            s.index_a,
            s.index_b,
            &s.digest.hex()[..12],
            format_size(s.size)
        );
    }
    let _ = writeln!(
        o,
        "\n{} a node holding A fetches {} in {} layer(s)",
        st.bold("Fetch"),
        st.yellow(&format_size(d.fetch_bytes)),
        d.changed.len()
    );
    for c in &d.changed {
        let pct = if c.file_bytes == 0 {
            0.0
        } else {
            c.reused_bytes as f64 * 100.0 / c.file_bytes as f64
        };
        let _ = writeln!(
            o,
            "  B#{} {}  {}  files {}  already in A: {} ({pct:.1} %)  new: {}  {}",
            c.index,
            &c.digest.hex()[..12],
            format_size(c.compressed_size),
            c.files,
            format_size(c.reused_bytes),
            format_size(c.new_bytes),
            st.dim(&crate::rules::clean_created_by(
                c.created_by.as_deref().unwrap_or("")
            ))
        );
    }
    let _ = writeln!(
        o,
        "\n  {} of the changed content already existed in A; a layer order that kept it in unchanged layers would fetch ≈ {} instead of {}",
        format_size(d.reused_bytes),
        st.green(&format_size(d.ideal_fetch_bytes)),
        format_size(d.fetch_bytes)
    );
    let _ = writeln!(
        o,
        "  to {} nodes: direct {}, P2P {}",
        d.fetch.nodes,
        human_seconds(d.fetch.direct_seconds),
        human_seconds(d.fetch.p2p_seconds)
    );
    for p in &d.problems {
        let _ = writeln!(o, "  {} {}", st.red(&format!("{:?}", p.kind)), p.message);
    }
    o
}
