//! Layer prefetch: which of an image's layers an agent starts fetching when it serves
//! the image's manifest, and when. The agent (`fetch::manifest_served`) and the
//! simulator both take it from here, so a simulated start-up joins its swarms the way
//! real agents do: every large layer a moment after the manifest, not a few at a time
//! in the order the runtime reads them.

/// The agent's `prefetch_grace` default (why a grace: see that setting).
pub const DEFAULT_PREFETCH_GRACE_MS: u64 = 50;

/// At most this many layers of one manifest are started: a manifest may list
/// thousands, and each started layer is a download task.
pub const MAX_PREFETCH_LAYERS: usize = 256;

/// The positions, in manifest order, of the layers a prefetch starts: those of at
/// least `p2p_threshold` bytes (smaller ones skip the swarm and cost the runtime only
/// a registry round trip), the first [`MAX_PREFETCH_LAYERS`] of them.
pub fn prefetched_layers(
    sizes: impl IntoIterator<Item = u64>,
    p2p_threshold: u64,
) -> impl Iterator<Item = usize> {
    sizes
        .into_iter()
        .enumerate()
        .filter(move |&(_, size)| size >= p2p_threshold)
        .map(|(i, _)| i)
        .take(MAX_PREFETCH_LAYERS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_layers_a_swarm_carries_are_prefetched_in_manifest_order() {
        let sizes = [10, 1 << 20, (1 << 20) - 1, 5 << 20];
        let picked: Vec<usize> = prefetched_layers(sizes, 1 << 20).collect();
        assert_eq!(picked, vec![1, 3]);
    }

    #[test]
    fn a_manifest_with_more_layers_than_the_cap_starts_only_the_first_ones() {
        let sizes = vec![1 << 20; MAX_PREFETCH_LAYERS + 10];
        let picked: Vec<usize> = prefetched_layers(sizes, 1 << 20).collect();
        assert_eq!(picked.len(), MAX_PREFETCH_LAYERS);
        assert_eq!(picked.last(), Some(&(MAX_PREFETCH_LAYERS - 1)));
    }
}
