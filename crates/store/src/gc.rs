//! Eviction policy, free of I/O: which blobs go when the cache is over budget.

use std::collections::HashSet;

use oci::Digest;

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GcReport {
    pub evicted: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug)]
pub struct Candidate {
    pub digest: Digest,
    pub size: u64,
    pub last_access: u64,
}

/// Least recently used first, until `used` drops to `target`.
pub fn choose_victims(
    candidates: impl Iterator<Item = Candidate>,
    used: u64,
    target: u64,
) -> Vec<Candidate> {
    if used <= target {
        return Vec::new();
    }
    let mut c: Vec<Candidate> = candidates.collect();
    c.sort_by(|a, b| a.last_access.cmp(&b.last_access).then(b.size.cmp(&a.size)));
    let mut freed = 0u64;
    let mut out = Vec::new();
    for cand in c {
        if used - freed <= target {
            break;
        }
        freed += cand.size;
        out.push(cand);
    }
    out
}

/// Everything reachable from `roots` through manifest references.
pub fn closure(roots: &[Digest], children: impl Fn(&Digest) -> Vec<String>) -> HashSet<Digest> {
    let mut seen = HashSet::new();
    let mut stack: Vec<Digest> = roots.to_vec();
    while let Some(d) = stack.pop() {
        if !seen.insert(d.clone()) {
            continue;
        }
        for c in children(&d) {
            if let Ok(cd) = Digest::parse(&c) {
                stack.push(cd);
            }
        }
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(n: u8, size: u64, at: u64) -> Candidate {
        Candidate {
            digest: Digest::of(&[n]),
            size,
            last_access: at,
        }
    }

    #[test]
    fn lru_until_target() {
        let v = choose_victims(
            vec![cand(1, 10, 5), cand(2, 10, 1), cand(3, 10, 3)].into_iter(),
            30,
            15,
        );
        let order: Vec<_> = v.iter().map(|c| c.last_access).collect();
        assert_eq!(order, vec![1, 3]);
        assert!(choose_victims(vec![cand(1, 10, 5)].into_iter(), 10, 20).is_empty());
    }

    #[test]
    fn closure_follows_children() {
        let a = Digest::of(b"a");
        let b = Digest::of(b"b");
        let c = Digest::of(b"c");
        let (b2, c2) = (b.to_string(), c.to_string());
        let set = closure(std::slice::from_ref(&a), |d| {
            if *d == a {
                vec![b2.clone()]
            } else if *d == b {
                vec![c2.clone()]
            } else {
                vec![]
            }
        });
        assert_eq!(set.len(), 3);
    }
}
