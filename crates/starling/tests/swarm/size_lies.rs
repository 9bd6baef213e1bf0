//! A cluster member that lies about a blob's size, or proposes a piece size no link
//! would choose, to the tracker before anyone pulls it: the first announce fixes the
//! swarm's layout for every member, so a lie believed would spoil that layer for the
//! whole cluster for as long as the liar keeps announcing.

use std::time::Duration;

use testkit::{Registry, RegistryAuth, TestImage};

use super::common::{keep_announcing, pull_via};
use super::{
    agent, blocking, metric, probe_announce, registry_blob, spawn_source_pull, tracker, TOKEN,
};

/// The liar announces `size_of(real)` for the layer every second, as a member
/// (`complete`: holding the whole blob) at an address nobody answers on; two honest
/// agents then pull the image one after the other, and each must get it whole.
async fn a_lie_about_the_size_spoils_nothing(size_of: fn(u64) -> u64, seed: u64, complete: bool) {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/sizelie", "1", &[12 << 20], seed).unwrap();
    let layer = image.layers[0].clone();
    let t = tracker(dir.path(), &[]).await;
    let lie = size_of(layer.size);
    let announcing = lie_about_the_size(&t.url(), &layer.digest, lie, complete).await;
    let mut agents = Vec::new();
    for name in ["b", "c"] {
        let a = agent(dir.path(), name, &t.url(), &registry, &[]).await;
        let began = std::time::Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(90), pull_via(&a.url(), &image))
            .await
            .unwrap_or_else(|_| panic!("{name}'s pull finishes despite the size lie"))
            .unwrap_or_else(|e| panic!("{name}'s pull succeeds despite the size lie: {e}"));
        // Printed for BENCHMARKS.md, never asserted.
        eprintln!(
            "{name}'s pull despite a lie of {lie} bytes: {:.3} s",
            began.elapsed().as_secs_f64()
        );
        assert_eq!(r.manifest_digest.to_string(), image.digest);
        agents.push(a);
    }
    let (b, c) = (&agents[0], &agents[1]);
    assert!(
        metric(b, "starling_agent_p2p_swarm_size_corrections_total").await >= 1,
        "b, elected in the liar's place, told the tracker the registry's size"
    );
    assert_eq!(
        metric(b, "starling_agent_p2p_registry_bytes_total").await,
        layer.size,
        "b read the layer from the registry once, at the right size"
    );
    assert_eq!(
        probe_announce(&t.url(), &layer.digest).await["size"].as_u64(),
        Some(layer.size),
        "the swarm is laid out by the registry's size, although the liar still announces"
    );
    assert_eq!(
        metric(c, "starling_agent_p2p_peer_bytes_total").await,
        layer.size,
        "c took the whole layer from b through the mended swarm"
    );
    assert_eq!(
        metric(c, "starling_agent_p2p_registry_bytes_total").await,
        0
    );
    announcing.abort();
}

/// Announces `size` for `digest` every second as member "liar" (`complete`: holding
/// the whole blob) at an address nobody answers on; returns once the tracker has
/// taken it.
async fn lie_about_the_size(
    tracker: &str,
    digest: &str,
    size: u64,
    complete: bool,
) -> tokio::task::JoinHandle<()> {
    let body = serde_json::json!({
        "node": "liar", "addr": "127.0.0.1:1", "digest": digest, "size": size,
        "complete": complete,
    });
    let announcing = keep_announcing(tracker, TOKEN, body, Duration::from_secs(1));
    testkit::until(
        "the tracker to take the liar's announce",
        Duration::from_millis(20),
        Duration::from_secs(10),
        || async { probe_announce(tracker, digest).await["size"].as_u64() == Some(size) },
    )
    .await;
    announcing
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_announcing_a_short_size_first_spoils_nothing() {
    a_lie_about_the_size_spoils_nothing(|real| real / 2, 71, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_announcing_a_long_size_first_spoils_nothing() {
    a_lie_about_the_size_spoils_nothing(|real| real + (3 << 20), 72, false).await;
}

/// A size below the swarm threshold makes the tracker treat the layer as a small blob,
/// which every node fetches from the registry directly, and a small swarm elects no
/// source to mend a size. A liar that only fetches is no member of a small swarm, so
/// its size does not outlast it; this one is a regression check.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_announcing_a_small_size_first_spoils_nothing() {
    a_lie_about_the_size_spoils_nothing(|_| 4096, 76, false).await;
}

/// The same lie from a member that claims to hold the layer whole: it stays a member,
/// so its small size stood and each node waited 10 s, then read the layer from the
/// registry itself (one copy per node). Now the nodes that checked the size report it,
/// and the first is elected on the registry's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_claiming_to_hold_a_large_blob_at_a_small_size_first_spoils_nothing() {
    a_lie_about_the_size_spoils_nothing(|_| 4096, 77, true).await;
}

/// The liar says first that it holds the whole blob, at a wrong size: with a complete
/// holder in the swarm no node is elected to fetch, and the holder's claim would also
/// keep a source from moving the size. Nodes that checked the size with the registry
/// report it, and the cluster still reads the layer from the registry once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_claiming_to_hold_a_blob_of_a_wrong_size_first_spoils_nothing() {
    a_lie_about_the_size_spoils_nothing(|real| real - (1 << 20), 75, true).await;
}

/// A client that asks for the blob by digest without the manifest through this agent
/// (no declared size to check the swarm's against): the agent believes the lie until
/// the registry's answer shows it. That request fails (never a 200 of the wrong
/// length completed), the source mends the swarm, and the next request gets the blob.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blob_asked_for_without_its_manifest_fails_once_then_mends_the_swarm() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/sizelie", "1", &[12 << 20], 73).unwrap();
    let layer = image.layers[0].clone();
    let want = registry_blob(&registry, "swarm/sizelie", &layer.digest).await;
    let t = tracker(dir.path(), &[]).await;
    let announcing = lie_about_the_size(&t.url(), &layer.digest, layer.size / 2, false).await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let url = format!("{}/v2/swarm/sizelie/blobs/{}", b.url(), layer.digest);
    let mut answers = Vec::new();
    for _ in 0..20 {
        let got = match reqwest::get(&url).await {
            Ok(r) if r.status() == 200 => r.bytes().await.map(|b| b.to_vec()).ok(),
            _ => None,
        };
        let whole = got.as_deref() == Some(&want[..]);
        // A 200 body that completed is the blob, whole: anything else must have failed.
        assert!(
            got.as_ref().is_none_or(|_| whole),
            "a completed 200 of {} bytes that is not the blob",
            got.map_or(0, |g| g.len())
        );
        answers.push(whole);
        if whole {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        answers.last(),
        Some(&true),
        "the blob, in the end: {answers:?}"
    );
    assert!(metric(&b, "starling_agent_p2p_swarm_size_corrections_total").await >= 1);
    assert_eq!(
        probe_announce(&t.url(), &layer.digest).await["size"].as_u64(),
        Some(layer.size)
    );
    assert_eq!(
        answers.first(),
        Some(&false),
        "the first answer was laid out by the lie, and failed"
    );
    announcing.abort();
}

/// A swarm that an honest source completed: the liar then claims to be fetching from
/// the registry (what a source says after a tracker restart), is elected, and says
/// another size. A complete holder nobody reported proves the size in force, so the
/// lie is not taken, and a client asking by digest alone (nothing to check the size
/// against) gets the blob whole at once. (Before the holder rule, the elected liar laid
/// the swarm out anew and such a client waited for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_elected_after_the_swarm_finished_cannot_move_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/sizelie", "1", &[12 << 20], 74).unwrap();
    let layer = image.layers[0].clone();
    let want = registry_blob(&registry, "swarm/sizelie", &layer.digest).await;
    let t = tracker(dir.path(), &[]).await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    pull_via(&b.url(), &image).await.unwrap();
    let lie = layer.size - (1 << 20);
    let body = serde_json::json!({
        "node": "liar", "addr": "127.0.0.1:1", "digest": layer.digest, "size": lie,
        "fetching_from_registry": true,
    });
    let announcing = keep_announcing(&t.url(), TOKEN, body, Duration::from_millis(200));
    testkit::until(
        "the liar to be elected",
        Duration::from_millis(20),
        Duration::from_secs(20),
        || async { probe_announce(&t.url(), &layer.digest).await["source"] == "liar" },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await; // a few of its announces
    assert_eq!(
        probe_announce(&t.url(), &layer.digest).await["size"].as_u64(),
        Some(layer.size),
        "the elected liar did not move the size"
    );
    let c = agent(dir.path(), "c", &t.url(), &registry, &[]).await;
    let url = format!("{}/v2/swarm/sizelie/blobs/{}", c.url(), layer.digest);
    let got = tokio::time::timeout(Duration::from_secs(60), async {
        reqwest::get(&url).await.unwrap().bytes().await.unwrap()
    })
    .await
    .expect("c's answer comes despite the liar");
    assert!(got[..] == want[..], "c got the blob whole at once");
    announcing.abort();
}

/// A member announces the layer first, at its real size, in the largest pieces the
/// protocol allows: 12 MiB as one 256 MiB piece, so no two nodes could trade it and
/// each would wait for the whole layer at the node before it. It keeps announcing. The
/// tracker lays the swarm out as the rule would for some link instead (256 KiB here),
/// and two honest agents pull the image, the second from the first, in those pieces.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_proposing_a_piece_size_no_link_would_choose_lays_nothing_out() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/piecelie", "1", &[12 << 20], 78).unwrap();
    let layer = image.layers[0].clone();
    let t = tracker(dir.path(), &[]).await;
    let lie = swarm::pieces::MAX_PIECE_SIZE;
    let body = serde_json::json!({
        "node": "liar", "addr": "127.0.0.1:1", "digest": layer.digest, "size": layer.size,
        "piece_size": lie, "leaving": true,
    });
    let announcing = keep_announcing(&t.url(), TOKEN, body, Duration::from_secs(1));
    testkit::until(
        "the tracker to take the liar's announce",
        Duration::from_millis(20),
        Duration::from_secs(10),
        || async {
            probe_announce(&t.url(), &layer.digest).await["size"].as_u64() == Some(layer.size)
        },
    )
    .await;
    let rule = swarm::pieces::piece_size_for(layer.size, None);
    assert_eq!(
        probe_announce(&t.url(), &layer.digest).await["piece_size"].as_u64(),
        Some(rule),
        "laid out as the rule would for some link, not in the liar's {lie}-byte pieces"
    );
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let c = agent(dir.path(), "c", &t.url(), &registry, &[]).await;
    let source = spawn_source_pull(&b, &image).await;
    let r = tokio::time::timeout(Duration::from_secs(90), pull_via(&c.url(), &image))
        .await
        .expect("c's pull finishes")
        .expect("c's pull succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    source.await.unwrap().expect("b's pull succeeds");
    assert_eq!(
        metric(&c, "starling_agent_p2p_peer_bytes_total").await,
        layer.size,
        "c took the whole layer from b through the swarm"
    );
    assert_eq!(
        probe_announce(&t.url(), &layer.digest).await["piece_size"].as_u64(),
        Some(rule),
        "the liar, still announcing, moved nothing"
    );
    announcing.abort();
}
