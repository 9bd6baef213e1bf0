//! Peers that misbehave: a liar, a peer, a stripe member or a downloader frozen
//! mid-transfer, peers alive for the tracker that nobody can dial (an only holder,
//! rack-mates), a seed whose cached blob was deleted, a holder that never sends, or
//! sends every blob but one.

use std::time::Duration;

use testkit::peer::{start_mute_holder, MuteAnswer};
use testkit::{Registry, RegistryAuth, TestImage};

use super::common::{keep_announcing, pull_via};
use super::{
    agent, blocking, holders, metric, seed_holding, spawn_pull, spawn_source_pull, tracker,
    until_metric_above, TOKEN,
};

/// A seed's cached blob is deleted behind its back (an operator cleaning the disk at
/// 3 a.m.). The seed finds out when a downloader's request reaches the file; it must
/// say so to the downloader and to the tracker. Before, it dropped the queued request
/// silently: the newcomer waited on it, and counted the seed a complete holder, for
/// good (elected once the seed's entry lapsed, it still read nothing from the registry,
/// as every piece had a holder).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_seed_whose_cached_blob_was_deleted_does_not_hang_a_pull() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/deleted", "1", &[16 << 20], 51).unwrap();
    let t = tracker(dir.path(), &[]).await;
    let _seed = seed_holding(dir.path(), &t.url(), &registry, &image, &[]).await;
    let layer = dir
        .path()
        .join("seed/blobs")
        .join(image.layers[0].digest.replace(':', "/"));
    // The reader has every byte a moment before the blob is committed under its name.
    testkit::until(
        "the seed to commit the layer",
        Duration::from_millis(5),
        Duration::from_secs(30),
        || async { layer.exists() },
    )
    .await;
    std::fs::remove_file(&layer).expect("the seed's copy of the layer");
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(60), pull_via(&b.url(), &image))
        .await
        .expect("the pull finishes although the seed lost the layer")
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await >= image.layers[0].size,
        "the newcomer read the layer from the registry"
    );
}

/// A holder that takes piece requests and never sends them, while it keeps its
/// connection alive (a bug like the one above, or a tenant claiming blobs it does not
/// give). Its claim is worth what it delivers: after 30 s of nothing the downloader
/// reports it, is elected in its place and reads the registry. Before, the only
/// "complete holder" kept every newcomer waiting for good, and nobody was elected.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_never_sends_what_it_claims_does_not_hang_a_pull() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/withheld", "1", &[16 << 20], 53).unwrap();
    let t = tracker(dir.path(), &[]).await;
    let _seed = seed_holding(
        dir.path(),
        &t.url(),
        &registry,
        &image,
        &["--withhold-pieces"],
    )
    .await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(120), pull_via(&b.url(), &image))
        .await
        .expect("the pull finishes although the only holder sends nothing")
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert!(metric(&b, "starling_agent_p2p_peers_silent_total").await >= 1);
    assert_eq!(
        metric(&b, "starling_agent_p2p_peer_bytes_total").await,
        0,
        "the withholding holder sent nothing"
    );
    assert!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await >= image.layers[0].size,
        "the newcomer, elected in its place, read the layer from the registry"
    );
}

/// A holder that serves a node every blob but one, on the one connection they share (a
/// tenant starving one layer, or a broken holder). The downloader used to excuse a
/// holder that was sending it other blobs for as long as it did, so the starved layer
/// waited until the other one was done. Now it waits at most `SILENT_WHILE_BUSY_MS`
/// (2 min): the holder is reported for that blob, the downloader is elected in its
/// place and reads it from the registry while the other layer is still arriving.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_starves_one_blob_while_serving_another_is_left_behind_for_it() {
    // Layer 0 is starved; layer 1 trickles at the holder's upload limit for ~190 s.
    starved_layer_arrives_before_the_others("swarm/starved", &[8 << 20, 24 << 20], "128KiB", 57)
        .await;
}

/// The same starving holder on a link fast enough that it sends many other pieces
/// meanwhile: twelve other layers of 256 KiB pieces at 3 MiB/s. The downloader used to
/// excuse it for as long as the others arrived and 30 s beyond; now it is reported
/// once it has passed a waiting request over for `swarm::upload::starving_after_pieces`
/// other pieces (256 here, about two thirds of them), and the starved layer is read
/// from the registry while the others are still arriving.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_starves_one_blob_among_many_is_left_behind_after_a_count_of_pieces() {
    starved_layer_arrives_before_the_others("swarm/starved-many", &[8 << 20; 13], "3MiB", 59).await;
}

/// One holder of an image of `sizes` serves b every layer but the first at
/// `upload_limit`: b must report it, be elected for the first layer and read it from
/// the registry while the other layers are still arriving.
async fn starved_layer_arrives_before_the_others(
    repo: &str,
    sizes: &[usize],
    upload_limit: &str,
    seed: u64,
) {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, repo, "1", sizes, seed).unwrap();
    let starved = &image.layers[0];
    let t = tracker(dir.path(), &[]).await;
    let _seed = seed_holding(
        dir.path(),
        &t.url(),
        &registry,
        &image,
        &[
            "--withhold-pieces-of",
            starved.digest.as_str(),
            "--upload-limit",
            upload_limit,
        ],
    )
    .await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let pull = spawn_pull(&b, &image);
    let in_cache = |l: &testkit::Blob| dir.path().join("b/blobs").join(l.digest.replace(':', "/"));
    let starved_file = in_cache(starved);
    testkit::until(
        "the starved layer to be complete on b",
        Duration::from_millis(100),
        Duration::from_secs(175),
        || async { starved_file.exists() },
    )
    .await;
    let others_complete = image.layers[1..]
        .iter()
        .filter(|l| in_cache(l).exists())
        .count();
    assert!(
        others_complete < image.layers.len() - 1,
        "the other layers still arriving: the starved one did not wait for them ({others_complete} complete)"
    );
    assert!(metric(&b, "starling_agent_p2p_peers_silent_total").await >= 1);
    assert!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await >= starved.size,
        "b, elected in the holder's place, read the starved layer from the registry"
    );
    pull.abort();
}

/// A holder that sends every piece of a blob but its first: the blob's pieces keep
/// coming, so the holder was counted only once it had gone quiet on the blob for a
/// second, and the reader waited until the holder had sent all the rest. Now it is
/// reported once it has sent `swarm::upload::starving_after_pieces` other pieces (256
/// of 384 here) past that request, of any blob; the downloader, elected in its place,
/// reads the first piece and the rest from the registry, so the reader's first byte
/// comes before the holder's other pieces are all in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_passes_over_a_blobs_first_piece_is_left_behind_after_a_count_of_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/first-withheld", "1", &[24 << 20], 61)
        .unwrap();
    let layer = image.layers[0].clone();
    // The operator's piece size, on the tracker as on the holder (it bounds others').
    let t = tracker(dir.path(), &["--piece-size", "64KiB"]).await;
    let _seed = seed_holding(
        dir.path(),
        &t.url(),
        &registry,
        &image,
        &[
            "--piece-size",
            "64KiB",
            "--withhold-pieces-of",
            layer.digest.as_str(),
            "--withhold-piece",
            "0",
            "--upload-limit",
            "3MiB",
        ],
    )
    .await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let url = format!("{}/v2/{}/blobs/{}", b.url(), image.repo, layer.digest);
    let mut body = reqwest::get(url).await.unwrap().error_for_status().unwrap();
    let first = tokio::time::timeout(Duration::from_secs(120), body.chunk())
        .await
        .expect("the first bytes come")
        .unwrap()
        .expect("a non-empty body");
    let from_peers = metric(&b, "starling_agent_p2p_peer_bytes_total").await;
    assert!(
        from_peers < layer.size - (64 << 10),
        "the first bytes came before the holder's other pieces were all in ({from_peers} of {} bytes from peers)",
        layer.size
    );
    assert!(metric(&b, "starling_agent_p2p_peers_silent_total").await >= 1);
    let mut whole = first.to_vec();
    while let Some(c) = body.chunk().await.unwrap() {
        whole.extend_from_slice(&c);
    }
    assert_eq!(testkit::sha256_digest(&whole), layer.digest);
    assert!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await >= 64 << 10,
        "b, elected in the holder's place, read the first piece from the registry"
    );
}

/// A holder that completes the handshake, says it holds the blob, and then answers
/// nothing, not even a PING (a tenant's modified agent). The downloader drops each
/// connection after 3 s of silence and dials again, and each new connection used to
/// start its 30 s of patience over: as the only holder it kept the pull waiting for
/// good. Now connections lost with requests outstanding count: after three in a row
/// without a piece the holder is reported, and the downloader is elected to read the
/// registry in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_answers_no_ping_is_reported_and_does_not_hang_a_pull() {
    only_holder_gives_nothing(MuteAnswer::Nothing, 63).await;
}

/// The same holder answering every request "busy": a busy answer ended the request,
/// so the silent check (requests outstanding, nothing for 30 s) never applied, and
/// the downloader asked again every 25 ms for good. Now a holder that has answered
/// only "busy" for 30 s since its last piece is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_is_always_busy_is_reported_and_does_not_hang_a_pull() {
    only_holder_gives_nothing(MuteAnswer::Busy, 65).await;
}

/// The same holder answering every request "not held" although it said it holds the
/// whole blob.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_holds_nothing_it_claims_is_reported_and_does_not_hang_a_pull() {
    only_holder_gives_nothing(MuteAnswer::NotHeld, 67).await;
}

/// A one-layer pull whose only holder, for the tracker, is a mute peer answering
/// `answer`: it must finish from the registry, with the holder reported.
async fn only_holder_gives_nothing(answer: MuteAnswer, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/mute", "1", &[8 << 20], seed).unwrap();
    let layer = image.layers[0].clone();
    let t = tracker(dir.path(), &[]).await;
    let (addr, mute) = start_mute_holder("mute", TOKEN, answer).await.unwrap();
    // It stays a member for the tracker: it announces the whole layer every second.
    let body = serde_json::json!({
        "node": "mute", "addr": addr, "digest": layer.digest,
        "size": layer.size, "complete": true,
    });
    let announcing = keep_announcing(&t.url(), TOKEN, body, Duration::from_secs(1));
    testkit::until(
        "the tracker to hand out the mute holder",
        Duration::from_millis(20),
        Duration::from_secs(10),
        || async {
            holders(&t.url(), &image.layers[0].digest)
                .await
                .iter()
                .any(|(n, _)| n == "mute")
        },
    )
    .await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(90), pull_via(&b.url(), &image))
        .await
        .expect("the pull finishes although the only holder gives nothing")
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert!(metric(&b, "starling_agent_p2p_peers_silent_total").await >= 1);
    assert!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await >= image.layers[0].size,
        "b, elected in the mute holder's place, read the layer from the registry"
    );
    announcing.abort();
    mute.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corrupt_pieces_are_rejected_and_the_liar_avoided() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/liar", "1", &[16 << 20], 15).unwrap();
    let t = tracker(dir.path(), &[]).await;
    let liar = agent(
        dir.path(),
        "liar",
        &t.url(),
        &registry,
        &["--corrupt-pieces"],
    )
    .await;
    pull_via(&liar.url(), &image).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await; // seeding announce
    let honest = agent(dir.path(), "honest", &t.url(), &registry, &[]).await;
    let r = pull_via(&honest.url(), &image)
        .await
        .expect("pull succeeds despite the liar");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert!(
        metric(&honest, "starling_agent_p2p_pieces_rejected_total").await >= 1,
        "the corrupt piece was caught"
    );
    assert!(honest.log_text().contains("piece failed verification"));
}

/// A holder that stops in the middle of sending (its process frozen, the connection
/// open) is detected by its silence; the downloader drops it and finishes elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_that_stops_mid_stream_is_dropped_and_the_pull_completes() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/frozen", "1", &[48 << 20], 23).unwrap();
    let t = tracker(dir.path(), &["--peer-ttl", "2s"]).await;
    let seed = seed_holding(
        dir.path(),
        &t.url(),
        &registry,
        &image,
        &["--upload-limit", "8MiB"],
    )
    .await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let url = b.url();
    let img = image.clone();
    let pull = tokio::spawn(async move { pull_via(&url, &img).await });
    until_metric_above(
        "b to receive from the seed",
        &b,
        "starling_agent_p2p_peer_bytes_total",
        4 << 20,
    )
    .await;
    let pid = seed.child.id().to_string();
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(stop.success());
    let r = tokio::time::timeout(Duration::from_secs(90), pull).await;
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    let r = r
        .expect("the pull finishes")
        .unwrap()
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert!(
        metric(&b, "starling_agent_p2p_peers_stalled_total").await >= 1,
        "the frozen peer was detected"
    );
    assert!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await > image.config.size,
        "the rest came from the registry"
    );
}

/// Source stripes: each member asks the source only for its own share of the pieces
/// and passes them on. A member that freezes mid-transfer (SIGSTOP: its connections
/// stay open, it answers nothing) must not strand its share: the others take it from
/// the source after their patience, or once the source holds the whole blob and the
/// tracker stops giving stripes, whichever comes first (with the patience set to
/// hours this still passes, by the second way; the patience itself is unit-tested in
/// `swarm::scheduler`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_stripe_member_strands_no_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/stripes", "1", &[32 << 20], 29).unwrap();
    // The tracker keeps the frozen member for the whole test, so its stripe stays.
    let t = tracker(dir.path(), &["--peer-ttl", "300s"]).await;
    let slow = ["--download-limit", "8MiB", "--upload-limit", "8MiB"];
    let src = agent(dir.path(), "src", &t.url(), &registry, &slow).await;
    let src_pull = spawn_source_pull(&src, &image).await;
    let mut members = Vec::new();
    let mut pulls = Vec::new();
    for i in 0..3 {
        let m = agent(dir.path(), &format!("m{i}"), &t.url(), &registry, &slow).await;
        pulls.push(spawn_pull(&m, &image));
        members.push(m);
    }
    let frozen = &members[0];
    until_metric_above(
        "the member to take its share",
        frozen,
        "starling_agent_p2p_peer_bytes_total",
        2 << 20,
    )
    .await;
    let pid = frozen.child.id().to_string();
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(stop.success());
    let frozen_pull = pulls.remove(0);
    let results =
        tokio::time::timeout(Duration::from_secs(120), futures::future::join_all(pulls)).await;
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    for r in results.expect("the other members finish") {
        let r = r.unwrap().expect("and their pulls succeed");
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    src_pull.await.unwrap().expect("the source's own pull");
    frozen_pull.abort();
    // One copy from the registry: the stranded share came from the source's cache
    // or a member, not from a second registry read.
    let upstream = metric(&src, "starling_agent_p2p_registry_bytes_total").await;
    let mut others = 0;
    for m in &members[1..] {
        others += metric(m, "starling_agent_p2p_registry_bytes_total").await;
    }
    assert_eq!(others, 0, "the members read nothing from the registry");
    assert!(upstream <= image.layers[0].size + image.layers[0].size / 20);
}

/// Rack stripes leave each far piece to the rack member whose stripe it is in, and far
/// holders send a member only its stripe's HAVEs. Two rack-mates that are alive for
/// the tracker but cannot reach each other (each advertises a port nothing listens
/// on: a wrong `--advertise`, a firewalled peer port) would each wait forever for the
/// other's half. Once nothing arrives for a while, a member asks far holders for every
/// HAVE again and finishes from them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rack_mates_that_cannot_reach_each_other_strand_no_stripe() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/unreachable", "1", &[32 << 20], 37).unwrap();
    let t = tracker(dir.path(), &["--stripe-min-members", "3"]).await;
    let src = agent(
        dir.path(),
        "src",
        &t.url(),
        &registry,
        &[
            "--download-limit",
            "4MiB",
            "--upload-limit",
            "64MiB",
            "--zone",
            "z",
            "--rack",
            "r0",
        ],
    )
    .await;
    let src_pull = spawn_source_pull(&src, &image).await;
    let mut members = Vec::new();
    let mut pulls = Vec::new();
    for i in 0..2 {
        let mut flags = nobody_can_dial();
        flags.extend(["--zone", "z", "--rack", "r1"].map(String::from));
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let m = agent(dir.path(), &format!("m{i}"), &t.url(), &registry, &flags).await;
        pulls.push(spawn_pull(&m, &image));
        members.push(m);
    }
    let done = tokio::time::timeout(Duration::from_secs(120), futures::future::join_all(pulls))
        .await
        .expect("both members finish although neither can reach the other");
    for r in done {
        let r = r.unwrap().expect("a member's pull");
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    src_pull.await.unwrap().expect("the source's own pull");
    for m in &members {
        assert_eq!(
            metric(m, "starling_agent_p2p_have_filters_received_total").await,
            0,
            "nobody reached the member"
        );
        assert!(
            metric(m, "starling_agent_p2p_stripes_distrusted_total").await >= 1,
            "the member gave up on its rack stripe"
        );
        assert!(
            metric(m, "starling_agent_p2p_registry_bytes_total").await < 1 << 20,
            "the member took the layer from the far source, not the registry"
        );
    }
    assert!(
        metric(&src, "starling_agent_p2p_haves_filtered_total").await > 0,
        "the stripes were in force before the members widened them"
    );
}

/// Agent flags for a node alive for the tracker that no peer can dial: its peer
/// listener is up, but it advertises a port nothing listens on (a wrong `--advertise`,
/// a firewalled peer port).
pub(super) fn nobody_can_dial() -> Vec<String> {
    let listen = format!("127.0.0.1:{}", testkit::free_port());
    let nowhere = format!("127.0.0.1:{}", testkit::free_port());
    vec![
        "--peer-listen".into(),
        listen,
        "--advertise".into(),
        nowhere,
    ]
}

/// The only holder of a blob is alive for the tracker but nobody can reach it (it
/// advertises a port nothing listens on). A newcomer must still get the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_only_holder_does_not_hang_a_pull() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/unreachable-seed", "1", &[16 << 20], 41)
            .unwrap();
    let t = tracker(dir.path(), &[]).await;
    let unreachable = nobody_can_dial();
    let flags: Vec<&str> = unreachable.iter().map(String::as_str).collect();
    let _seed = seed_holding(dir.path(), &t.url(), &registry, &image, &flags).await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(120), pull_via(&b.url(), &image))
        .await
        .expect("the pull finishes although the only holder cannot be reached")
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert!(
        metric(&b, "starling_agent_p2p_peers_unreachable_total").await >= 1,
        "the newcomer reported the holder it could not reach"
    );
    assert!(
        metric(&b, "starling_agent_p2p_registry_bytes_total").await >= image.layers[0].size,
        "and, elected in its place, read the layer from the registry"
    );
}

/// A downloader that freezes while a holder is sending it a piece (SIGSTOP: its
/// kernel keeps the connection open with a zero window, as a crashed node's link does
/// for the quarter of an hour TCP takes to give up) must not keep the holder's upload
/// slot. 64 MiB pieces, more than loopback's socket buffers hold, so the holder's write
/// really stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_downloader_that_freezes_mid_piece_does_not_keep_the_upload_slot() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/frozen-reader", "1", &[192 << 20], 47)
        .unwrap();
    let t = tracker(dir.path(), &["--peer-ttl", "300s", "--piece-size", "64MiB"]).await;
    let seed = seed_holding(
        dir.path(),
        &t.url(),
        &registry,
        &image,
        &[
            "--max-uploads",
            "1",
            "--upload-limit",
            "64MiB",
            "--piece-size",
            "64MiB",
        ],
    )
    .await;
    let a = agent(dir.path(), "a", &t.url(), &registry, &[]).await;
    let a_pull = spawn_pull(&a, &image);
    until_metric_above(
        "a to receive from the seed",
        &a,
        "starling_agent_p2p_peer_bytes_total",
        8 << 20,
    )
    .await;
    let pid = a.child.id().to_string();
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(stop.success());
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(120), pull_via(&b.url(), &image)).await;
    let r = r
        .expect("the pull finishes although the frozen downloader had the only upload slot")
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    // Nothing is left to send but to the frozen downloader: the seed must have let go
    // of it. (b itself may get by on the extra slot kept for readers' head pieces.)
    testkit::until(
        "the seed to free the upload slot the frozen downloader held",
        Duration::from_millis(50),
        Duration::from_secs(60),
        || async { metric(&seed, "starling_agent_p2p_uploads_active").await == 0 },
    )
    .await;
    assert!(metric(&seed, "starling_agent_p2p_readers_stalled_total").await >= 1);
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    a_pull.abort();
}
