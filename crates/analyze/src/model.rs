//! Applies layer entry streams to an in-memory path map, as a container runtime's
//! snapshotter would: whiteouts (`.wh.<name>`) and opaque directories
//! (`.wh..wh..opq`) hide lower content, later layers overwrite earlier ones, hard
//! links refer to other paths. Pure, no I/O.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use crate::engine::{EntryKind, LayerScan, Problem, ProblemKind};

/// A path in the merged filesystem.
#[derive(Clone, Debug)]
pub struct Node {
    pub kind: EntryKind,
    pub size: u64,
    /// Layer that last wrote the path.
    pub layer: usize,
    pub link: Option<String>,
    pub hash: Option<[u8; 32]>,
}

/// Files added, changed and deleted by one layer (non-directories).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct LayerChanges {
    pub added: u64,
    pub changed: u64,
    pub deleted: u64,
    pub added_bytes: u64,
    pub changed_bytes: u64,
    /// Bytes of lower files this layer hides (they still ship in the lower layer).
    pub deleted_bytes: u64,
    /// Sum of file bytes the layer carries.
    pub file_bytes: u64,
}

/// Every copy of one path across the layers.
#[derive(Clone, Debug, Default)]
pub struct PathCopies {
    /// (layer, size) for each write.
    pub copies: Vec<(usize, u64)>,
    /// Layer whose whiteout or opaque directory removed the path last, when it is
    /// absent from the final image.
    pub deleted_in: Option<usize>,
}

/// The merged image.
#[derive(Clone, Debug, Default)]
pub struct Model {
    /// Final filesystem (directories included).
    pub tree: BTreeMap<String, Node>,
    pub changes: Vec<LayerChanges>,
    /// Non-directory paths ever written, with their copies.
    pub copies: HashMap<String, PathCopies>,
    pub problems: Vec<Problem>,
}

/// Dive-style efficiency with dive's bugs fixed.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Efficiency {
    /// Σ over paths of the bytes of every copy ever shipped.
    pub cumulative_bytes: u64,
    /// Σ over paths of the smallest copy (0 when the path is gone from the image).
    pub kept_bytes: u64,
    /// cumulative − kept.
    pub wasted_bytes: u64,
    /// kept / cumulative (1.0 for an empty image).
    pub efficiency: f64,
}

/// One path's wasted bytes.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct WastedPath {
    pub path: String,
    pub copies: usize,
    pub cumulative_bytes: u64,
    pub wasted_bytes: u64,
    /// Layers that wrote it.
    pub layers: Vec<usize>,
    pub deleted_in: Option<usize>,
}

fn remove_subtree(
    tree: &mut BTreeMap<String, Node>,
    dir: &str,
    include_self: bool,
    out: &mut Vec<(String, Node)>,
) {
    if include_self {
        if let Some(n) = tree.remove(dir) {
            out.push((dir.to_owned(), n));
        }
    }
    let prefix = if dir.is_empty() {
        String::new()
    } else {
        format!("{dir}/")
    };
    let keys: Vec<String> = tree
        .range(prefix.clone()..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .map(|(k, _)| k.clone())
        .collect();
    for k in keys {
        if let Some(n) = tree.remove(&k) {
            out.push((k, n));
        }
    }
}

impl Model {
    /// Applies the scanned layers in order.
    pub fn build(layers: &[LayerScan]) -> Self {
        let mut m = Model::default();
        for l in layers {
            m.apply(l);
        }
        m
    }

    fn apply(&mut self, layer: &LayerScan) {
        let li = layer.index;
        let mut ch = LayerChanges::default();
        // 1. Whiteouts and opaque directories hide lower content only.
        let mut removed: Vec<(String, Node)> = Vec::new();
        for e in &layer.entries {
            match e.kind {
                EntryKind::Opaque => remove_subtree(&mut self.tree, &e.path, false, &mut removed),
                EntryKind::Whiteout => remove_subtree(&mut self.tree, &e.path, true, &mut removed),
                _ => {}
            }
        }
        let removed_map: HashMap<&str, &Node> =
            removed.iter().map(|(k, n)| (k.as_str(), n)).collect();
        // 2. Content of this layer.
        let mut written: BTreeSet<&str> = BTreeSet::new();
        for e in &layer.entries {
            match e.kind {
                EntryKind::Opaque | EntryKind::Whiteout => continue,
                EntryKind::Dir => {
                    if let Some(old) = self.tree.get(&e.path) {
                        if old.kind == EntryKind::Dir {
                            continue;
                        }
                    }
                    self.tree.insert(
                        e.path.clone(),
                        Node {
                            kind: EntryKind::Dir,
                            size: 0,
                            layer: li,
                            link: None,
                            hash: None,
                        },
                    );
                    continue;
                }
                _ => {}
            }
            let lower = self
                .tree
                .get(&e.path)
                .filter(|n| n.kind != EntryKind::Dir && n.layer != li)
                .is_some()
                || removed_map
                    .get(e.path.as_str())
                    .is_some_and(|n| n.kind != EntryKind::Dir);
            if let Some(old) = self.tree.get(&e.path) {
                if old.kind == EntryKind::Dir {
                    let mut gone = Vec::new();
                    remove_subtree(&mut self.tree, &e.path, false, &mut gone);
                    for (p, n) in gone {
                        if n.kind != EntryKind::Dir {
                            ch.deleted += 1;
                            ch.deleted_bytes += n.size;
                            self.copies.entry(p).or_default().deleted_in = Some(li);
                        }
                    }
                }
            }
            if written.insert(e.path.as_str()) {
                if lower {
                    ch.changed += 1;
                    ch.changed_bytes += e.size;
                } else {
                    ch.added += 1;
                    ch.added_bytes += e.size;
                }
            }
            ch.file_bytes += e.size;
            let c = self.copies.entry(e.path.clone()).or_default();
            c.copies.push((li, e.size));
            c.deleted_in = None;
            self.tree.insert(
                e.path.clone(),
                Node {
                    kind: e.kind,
                    size: e.size,
                    layer: li,
                    link: e.link.clone(),
                    hash: e.hash,
                },
            );
        }
        // 3. What was hidden and not written again is deleted.
        for (p, n) in &removed {
            if n.kind == EntryKind::Dir || written.contains(p.as_str()) {
                continue;
            }
            ch.deleted += 1;
            ch.deleted_bytes += n.size;
            if let Some(c) = self.copies.get_mut(p) {
                c.deleted_in = Some(li);
            }
        }
        // 4. Hard links must point at something that exists.
        for e in &layer.entries {
            if e.kind == EntryKind::Hardlink {
                if let Some(t) = &e.link {
                    if !self.tree.get(t).is_some_and(|n| n.kind != EntryKind::Dir) {
                        self.problems.push(Problem {
                            layer: Some(li),
                            kind: ProblemKind::DanglingHardlink,
                            message: format!("hard link {} points at missing {t}", e.path),
                        });
                    }
                }
            }
        }
        self.changes.push(ch);
    }

    /// Efficiency and wasted bytes: wasted = cumulative − smallest copy per path, the
    /// kept copy is never counted as waste (dive #684), a deleted path keeps nothing.
    pub fn efficiency(&self) -> Efficiency {
        let mut e = Efficiency::default();
        for (p, c) in &self.copies {
            let cum: u64 = c.copies.iter().map(|x| x.1).sum();
            let kept = if self.tree.get(p).is_some_and(|n| n.kind != EntryKind::Dir) {
                c.copies.iter().map(|x| x.1).min().unwrap_or(0)
            } else {
                0
            };
            e.cumulative_bytes += cum;
            e.kept_bytes += kept;
        }
        e.wasted_bytes = e.cumulative_bytes - e.kept_bytes;
        e.efficiency = if e.cumulative_bytes == 0 {
            1.0
        } else {
            e.kept_bytes as f64 / e.cumulative_bytes as f64
        };
        e
    }

    /// Paths with wasted bytes, largest first.
    pub fn wasted_paths(&self) -> Vec<WastedPath> {
        let mut v: Vec<WastedPath> = self
            .copies
            .iter()
            .filter_map(|(p, c)| {
                let cum: u64 = c.copies.iter().map(|x| x.1).sum();
                let present = self.tree.get(p).is_some_and(|n| n.kind != EntryKind::Dir);
                let kept = if present {
                    c.copies.iter().map(|x| x.1).min().unwrap_or(0)
                } else {
                    0
                };
                (cum > kept).then(|| WastedPath {
                    path: p.clone(),
                    copies: c.copies.len(),
                    cumulative_bytes: cum,
                    wasted_bytes: cum - kept,
                    layers: c.copies.iter().map(|x| x.0).collect(),
                    deleted_in: if present { None } else { c.deleted_in },
                })
            })
            .collect();
        v.sort_by(|a, b| {
            b.wasted_bytes
                .cmp(&a.wasted_bytes)
                .then_with(|| a.path.cmp(&b.path))
        });
        v
    }

    /// Size of a final path: a hard link counts as nothing (its target holds the bytes).
    pub fn files(&self) -> impl Iterator<Item = (&String, &Node)> {
        self.tree.iter().filter(|(_, n)| n.kind != EntryKind::Dir)
    }
}
