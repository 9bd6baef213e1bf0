//! The peer protocol and the tracker seen from outside: hashes after the bitfield,
//! HAVE filters, stale peers expiring, the bounded upload line and rack stripes between
//! real agents.

use std::time::Duration;

use testkit::{Registry, RegistryAuth, TestImage};

use super::common::pull_via;
use super::{
    agent, blocking, holder_in, holders, metric, probe_announce, registry_blob, seed_holding,
    spawn_pull, spawn_source_pull, tracker, SlowHolder, TOKEN,
};

/// A channel opened while the holder (the blob's source) is still fetching it gets the
/// hashes the holder knows from piece 0 in a HASHES frame right after its bitfield, so
/// a downloader can verify its first piece without waiting for the tracker's copy of
/// the hash (which cost non-seeds 0.2–0.3 s of their first byte).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_source_sends_the_hashes_it_knows_after_its_bitfield() {
    use swarm::wire::Frame;
    use testkit::peer::{raw_digest, PeerClient, Read};
    let dir = tempfile::tempdir().unwrap();
    let slow = SlowHolder::start(dir.path(), "swarm/hashes", 23).await;
    let layer = &slow.image.layers[0];
    let blob = registry_blob(&slow.registry, &slow.image.repo, &layer.digest).await;
    let mut found = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let r = probe_announce(&slow.tracker.url(), &layer.digest).await;
        let Some((piece_size, addr)) = holder_in(&r) else {
            continue;
        };
        let mut c = PeerClient::connect(&addr, "downloader", Some(TOKEN))
            .await
            .unwrap();
        c.send(&[Frame::Open {
            chan: 3,
            digest: raw_digest(&layer.digest),
            blob_size: layer.size,
            piece_size,
        }])
        .await
        .unwrap();
        match c.read().await.unwrap() {
            Read::Frame(Frame::Bitfield { have, .. }) if have.count() > 0 => {
                found = Some((piece_size, have.count(), c.read().await.unwrap()));
                break;
            }
            Read::Frame(Frame::Bitfield { .. }) => continue,
            other => panic!("the source finished before it was asked: {other:?}"),
        }
    }
    let (piece_size, held, next) = found.expect("the source held a piece within 10 s");
    let layout = swarm::PieceLayout::new(layer.size, piece_size);
    assert!(layout.is_small_head(0), "{layout:?}: a small head piece");
    let Read::Frame(Frame::Hashes {
        chan: 3,
        first: 0,
        hashes,
    }) = next
    else {
        panic!("expected HASHES after the bitfield, got {next:?}");
    };
    assert!(
        !hashes.is_empty() && hashes.len() as u32 <= held,
        "{} hashes for {held} pieces held",
        hashes.len()
    );
    let mut before = None;
    for (i, h) in hashes.iter().enumerate() {
        let (a, b) = layout.range(i as u32);
        let mut hasher = swarm::pieces::PieceHasher::for_piece(layout, i as u32, before)
            .expect("pieces end on blocks");
        hasher.update(&blob[a as usize..b as usize]);
        assert_eq!(
            *h,
            hasher.finish(),
            "piece {i}'s hash is its chained sha256"
        );
        before = Some(*h);
    }
    slow.pull.await.unwrap().unwrap();
}

/// A downloader's HAVE_FILTER narrows the HAVEs a real holder sends on the channel
/// (a far holder in a rack-striped swarm is asked for the downloader's stripe only),
/// and widening it again brings the bitfield, so no piece goes unheard.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_sends_only_the_haves_its_channel_admits() {
    use swarm::links::HaveFilter;
    use swarm::wire::Frame;
    use testkit::peer::{raw_digest, PeerClient, Read};
    let dir = tempfile::tempdir().unwrap();
    let slow = SlowHolder::start(dir.path(), "swarm/filter", 29).await;
    let layer = &slow.image.layers[0];
    let mut joined = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        joined = holder_in(&probe_announce(&slow.tracker.url(), &layer.digest).await);
        if joined.is_some() {
            break;
        }
    }
    let (piece_size, addr) = joined.expect("the holder joined the swarm within 10 s");
    let mut c = PeerClient::connect(&addr, "downloader", Some(TOKEN))
        .await
        .unwrap();
    let odd = HaveFilter {
        modulus: 2,
        residue: 1,
    };
    // The PONG marks where the holder has taken the filter in: HAVEs after it obey it.
    c.send(&[
        Frame::Open {
            chan: 3,
            digest: raw_digest(&layer.digest),
            blob_size: layer.size,
            piece_size,
        },
        Frame::HaveFilter {
            chan: 3,
            filter: odd,
        },
        Frame::Ping { nonce: 7 },
    ])
    .await
    .unwrap();
    let mut ponged = false;
    let mut odd_haves = Vec::new();
    while odd_haves.len() < 3 {
        match c.read().await.unwrap() {
            Read::Frame(Frame::Pong { nonce: 7 }) => ponged = true,
            Read::Frame(Frame::Have { piece, .. }) if ponged => {
                assert_eq!(
                    piece % 2,
                    1,
                    "HAVE {piece} on a channel that admits odd pieces"
                );
                odd_haves.push(piece);
            }
            Read::Frame(Frame::Complete { .. }) => {
                panic!("the holder finished before three odd pieces: {odd_haves:?}")
            }
            _ => {}
        }
    }
    c.send(&[Frame::HaveFilter {
        chan: 3,
        filter: HaveFilter::ALL,
    }])
    .await
    .unwrap();
    let mut rebased = None;
    loop {
        match c.read().await.unwrap() {
            Read::Frame(Frame::Bitfield { have, .. }) => {
                rebased = Some(have);
            }
            Read::Frame(Frame::Have { piece, .. }) if rebased.is_some() && piece % 2 == 0 => {
                break;
            }
            Read::Frame(Frame::Complete { .. }) => break,
            _ => {}
        }
    }
    let have = rebased.expect("a bitfield after the filter widened");
    for p in &odd_haves {
        assert!(have.get(*p), "the bitfield has piece {p}");
    }
    assert!(
        (0..have.len()).any(|p| p % 2 == 0 && have.get(p)),
        "the bitfield names even pieces the filter held back"
    );
    slow.pull.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_peers_expire_from_handouts() {
    use swarm::wire::Frame;
    use testkit::peer::{raw_digest, PeerClient, Read};
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/stale", "1", &[8 << 20], 17).unwrap();
    let t = tracker(dir.path(), &["--peer-ttl", "1s"]).await;
    let mut a = agent(dir.path(), "gone", &t.url(), &registry, &[]).await;
    pull_via(&a.url(), &image).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let layer = &image.layers[0];
    let held = holders(&t.url(), &layer.digest).await;
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].0, "gone");
    let addr = held[0].1.clone();
    // Peers serve pieces only to holders of the cluster token, and the token itself
    // never crosses the wire (challenge and answer).
    let mut stranger = PeerClient::connect(&addr, "mallory", None).await.unwrap();
    let open = Frame::Open {
        chan: 1,
        digest: raw_digest(&layer.digest),
        blob_size: layer.size,
        piece_size: 1 << 20,
    };
    let _ = stranger
        .send(&[
            open.clone(),
            Frame::Request {
                chan: 1,
                piece: 0,
                urgent: false,
            },
        ])
        .await;
    match stranger.read().await {
        Ok(Read::Frame(Frame::Goodbye { reason })) => assert!(reason.contains("token"), "{reason}"),
        Err(_) => {}
        other => panic!("a peer without the token got {other:?}"),
    }
    let mut member = PeerClient::connect(&addr, "member", Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(member.holder, "gone");
    member.send(&[open]).await.unwrap();
    match member.read().await.unwrap() {
        Read::Frame(Frame::Complete { chan: 1 }) => {}
        other => panic!("expected COMPLETE, got {other:?}"),
    }
    let layout = swarm::PieceLayout::new(layer.size, 1 << 20);
    let mut blob = Vec::new();
    for piece in 0..layout.count() {
        member
            .send(&[Frame::Request {
                chan: 1,
                piece,
                urgent: false,
            }])
            .await
            .unwrap();
        let (bytes, _) = member
            .read_piece(1, piece, layout.len(piece) as usize)
            .await
            .unwrap();
        blob.extend(bytes);
    }
    assert_eq!(
        oci::Digest::of(&blob).to_string(),
        layer.digest,
        "every piece, byte for byte"
    );
    a.kill9();
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(
        holders(&t.url(), &layer.digest).await.is_empty(),
        "a dead peer is not handed out after the TTL"
    );
    // Wrong token: refused.
    let r = reqwest::Client::new()
        .post(format!("{}/swarm/v1/announce", t.url()))
        .bearer_auth("nope")
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

/// Piece requests beyond the upload slots wait in a bounded line on the holder: the
/// one being sent goes on, a waiting one is served once the slot frees (or cancelled
/// on request), and one beyond the line is told "busy" at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn piece_requests_wait_in_a_bounded_upload_line() {
    use swarm::wire::{Frame, RejectReason};
    use testkit::peer::{raw_digest, PeerClient, Read};
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image = TestImage::push_multilayer(&registry, "swarm/line", "1", &[8 << 20], 19).unwrap();
    let t = tracker(dir.path(), &[]).await;
    // One slot, a line of one per connection, paced at 2 MiB/s: a 1 MiB piece holds
    // the slot for about half a second.
    let holder = agent(
        dir.path(),
        "holder",
        &t.url(),
        &registry,
        &[
            "--max-uploads",
            "1",
            "--upload-queue",
            "1",
            "--upload-limit",
            "2MiB",
        ],
    )
    .await;
    pull_via(&holder.url(), &image).await.unwrap();
    let layer = &image.layers[0];
    let addr = holders(&t.url(), &layer.digest)
        .await
        .into_iter()
        .find(|(n, _)| n == "holder")
        .expect("the holder is handed out")
        .1;
    let mut c = PeerClient::connect(&addr, "downloader", Some(TOKEN))
        .await
        .unwrap();
    c.send(&[Frame::Open {
        chan: 7,
        digest: raw_digest(&layer.digest),
        blob_size: layer.size,
        piece_size: 1 << 20,
    }])
    .await
    .unwrap();
    assert!(matches!(
        c.read().await.unwrap(),
        Read::Frame(Frame::Complete { chan: 7 })
    ));
    // Pieces 2 to 5 are whole MiBs (piece 0 is the small head, 1 the rest of the
    // first MiB): named here 0 to 3 for the order they are asked in.
    let layout = swarm::PieceLayout::new(layer.size, 1 << 20);
    assert_eq!(layout.len(2), 1 << 20);
    let req = |piece: u32| Frame::Request {
        chan: 7,
        piece: piece + 2,
        urgent: false,
    };
    c.send(&[req(0)]).await.unwrap();
    // Piece 0 is on its way (its first bytes are here) before the others are asked.
    let first = match c.read().await.unwrap() {
        Read::Data {
            piece: 2,
            offset: 0,
            bytes,
            ..
        } => bytes,
        other => panic!("expected piece 0's first bytes, got {other:?}"),
    };
    c.send(&[req(1), req(2)]).await.unwrap();
    let (rest, others) = c
        .read_piece_from(7, 2, first.len(), (1 << 20) - first.len())
        .await
        .unwrap();
    let mut all_others = others;
    // Piece 2 was beyond the line of one: busy, at once (before piece 0 ended).
    assert!(
        all_others.contains(&Frame::Reject {
            chan: 7,
            piece: 4,
            reason: RejectReason::Busy
        }),
        "the request beyond the line is refused while piece 0 is still being sent: {all_others:?}"
    );
    let mut piece0 = first;
    piece0.extend(rest);
    // Piece 1 waited in line and comes next, whole.
    let (piece1, others) = c.read_piece(7, 3, 1 << 20).await.unwrap();
    all_others.extend(others);
    // Cancel a waiting request: ask for 2 and 3, cancel 3 while 2 is being sent.
    c.send(&[req(2)]).await.unwrap();
    let started = match c.read().await.unwrap() {
        Read::Data {
            piece: 4,
            offset: 0,
            bytes,
            ..
        } => bytes,
        other => panic!("expected piece 2, got {other:?}"),
    };
    c.send(&[req(3), Frame::Cancel { chan: 7, piece: 5 }])
        .await
        .unwrap();
    let (rest2, others) = c
        .read_piece_from(7, 4, started.len(), (1 << 20) - started.len())
        .await
        .unwrap();
    all_others.extend(others);
    let mut tail = Vec::new();
    while !all_others.iter().chain(&tail).any(|f| {
        *f == Frame::Reject {
            chan: 7,
            piece: 5,
            reason: RejectReason::Cancelled,
        }
    }) {
        match c.read().await.unwrap() {
            Read::Frame(f) => tail.push(f),
            Read::Data { piece, .. } => panic!("a cancelled request was served: piece {piece}"),
        }
    }
    let mut piece2 = started;
    piece2.extend(rest2);
    // The bytes are the blob's bytes.
    let blob = registry_blob(&registry, &image.repo, &layer.digest).await;
    let bytes_of = |i: u32| {
        let (a, b) = layout.range(i + 2);
        &blob[a as usize..b as usize]
    };
    assert_eq!(&piece0[..], bytes_of(0));
    assert_eq!(&piece1[..], bytes_of(1));
    assert_eq!(&piece2[..], bytes_of(2));
    assert_eq!(
        metric(&holder, "starling_agent_p2p_uploads_refused_total").await,
        1
    );
    assert_eq!(
        metric(&holder, "starling_agent_p2p_uploads_active").await,
        0,
        "slots are given back"
    );
}

/// Rack stripes between real agents (the tracker gives them from 3 members here): the
/// two members of one rack each ask the source, in another rack, only for their
/// stripe's HAVEs (HAVE_FILTER), the source holds the others back, and the rack's
/// pulls still complete from the source and each other, the registry read once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn far_peers_in_a_striped_swarm_hear_only_their_stripe() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/have-filter", "1", &[32 << 20], 31).unwrap();
    let t = tracker(dir.path(), &["--stripe-min-members", "3"]).await;
    let rack = |r: &'static str| ["--zone", "z", "--rack", r];
    let slow = ["--download-limit", "4MiB", "--upload-limit", "8MiB"];
    let src = agent(
        dir.path(),
        "src",
        &t.url(),
        &registry,
        &[&slow[..], &rack("r0")[..]].concat(),
    )
    .await;
    let src_pull = spawn_source_pull(&src, &image).await;
    let mut members = Vec::new();
    let mut pulls = Vec::new();
    for i in 0..2 {
        let m = agent(
            dir.path(),
            &format!("m{i}"),
            &t.url(),
            &registry,
            &["--download-limit", "64MiB", "--zone", "z", "--rack", "r1"],
        )
        .await;
        pulls.push(spawn_pull(&m, &image));
        members.push(m);
    }
    for r in futures::future::join_all(pulls).await {
        let r = r.unwrap().expect("a member's pull");
        assert_eq!(r.manifest_digest.to_string(), image.digest);
    }
    src_pull.await.unwrap().expect("the source's own pull");
    let filters = metric(&src, "starling_agent_p2p_have_filters_received_total").await;
    let held_back = metric(&src, "starling_agent_p2p_haves_filtered_total").await;
    let sent = metric(&src, "starling_agent_p2p_haves_sent_total").await;
    assert!(
        filters >= 2,
        "each member asked the far source for its stripe: {filters} HAVE_FILTERs"
    );
    assert!(
        held_back > 0 && sent > 0,
        "the source sent some HAVEs ({sent}) and held others back ({held_back})"
    );
    let mut from_registry = 0;
    for m in &members {
        from_registry += metric(m, "starling_agent_p2p_registry_bytes_total").await;
        assert_eq!(
            metric(m, "starling_agent_p2p_have_filters_received_total").await,
            0,
            "near peers filter nothing"
        );
    }
    // (Blobs under the P2P threshold, the config here, may come from the registry.)
    assert!(
        from_registry < 1 << 20,
        "the members read none of the layer from the registry: {from_registry} bytes"
    );
    let upstream = metric(&src, "starling_agent_p2p_registry_bytes_total").await;
    assert!(upstream <= image.layers[0].size + image.layers[0].size / 20);
}

/// A holder whose uplink is limited far below its peers' (`--upload-limit 128KiB`):
/// the chunks waiting for its tokens used to hold back the PONGs its downloader asks
/// for after 1 s of silence, so every downloader dropped the connection as dead every
/// few seconds and a blob that needs 40 s at that rate got a piece a minute. Control
/// frames now pass while a chunk waits for the uplink: the connection lives and the
/// blob comes whole from the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_with_a_slow_uplink_keeps_its_connections_and_serves() {
    let dir = tempfile::tempdir().unwrap();
    let registry = blocking(|| Registry::start(RegistryAuth::None)).await;
    let image =
        TestImage::push_multilayer(&registry, "swarm/slow-up", "1", &[4 << 20], 59).unwrap();
    let t = tracker(dir.path(), &["--piece-size", "1MiB"]).await;
    let _seed = seed_holding(
        dir.path(),
        &t.url(),
        &registry,
        &image,
        // 1 MiB pieces go out in 512 KiB chunks: 4 s of tokens each, more than the
        // downloader's PING after 1 s of silence and 2 s for its PONG.
        &["--upload-limit", "128KiB", "--piece-size", "1MiB"],
    )
    .await;
    let b = agent(dir.path(), "b", &t.url(), &registry, &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(120), pull_via(&b.url(), &image))
        .await
        .expect("the pull finishes at the holder's rate")
        .expect("and succeeds");
    assert_eq!(r.manifest_digest.to_string(), image.digest);
    assert_eq!(
        metric(&b, "starling_agent_p2p_peers_stalled_total").await,
        0,
        "no connection to the slow holder was dropped as dead"
    );
    assert!(
        metric(&b, "starling_agent_p2p_peer_bytes_total").await >= image.layers[0].size,
        "the layer came from the holder"
    );
}
