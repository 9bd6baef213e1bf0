//! A join held at the tracker until the swarm's size is known (`wait_for_size_ms`).
#![allow(clippy::unwrap_used)]

mod common;

use axum::body::Body;
use common::{announce, call};
use http::{Request, StatusCode};
use swarm::{AnnounceRequest, Role, SwarmConfig, Topology};
use tracker::Tracker;

async fn waiting(t: &Tracker) -> u64 {
    let (status, body) = call(t, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(body.to_vec()).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("starling_tracker_announces_waiting_for_size "))
        .expect("the gauge is exported")
        .trim()
        .parse()
        .unwrap()
}

fn join(node: &str, d: &oci::Digest) -> AnnounceRequest {
    AnnounceRequest::new(node, "127.0.0.1:9", &Topology::default(), d)
}

#[tokio::test]
async fn a_join_is_answered_when_the_source_announces_the_size() {
    let t = Tracker::new(SwarmConfig::default(), None);
    let d = oci::Digest::of(b"held");
    let (status, first) = announce(&t, &join("src", &d)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(first.unwrap().role, Role::Source);
    // Without asking to wait, a peer hears at once that the size is unknown.
    let (_, now) = announce(&t, &join("early", &d)).await;
    let now = now.unwrap();
    assert_eq!((now.role, now.size), (Role::Peer, None));

    let mut peer = join("peer", &d);
    peer.wait_for_size_ms = 60_000;
    let held = {
        let t = t.clone();
        tokio::spawn(async move { announce(&t, &peer).await })
    };
    // Announce the size only once the peer's join is being held, so that its answer
    // can only carry the size if the tracker held it.
    tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while waiting(&t).await == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the join is held");
    let mut sized = join("src", &d);
    sized.size = Some(64 << 20);
    sized.piece_size = Some(1 << 20);
    sized.fetching_from_registry = true;
    assert_eq!(announce(&t, &sized).await.1.unwrap().role, Role::Source);
    let (status, answer) = held.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let answer = answer.unwrap();
    assert_eq!(answer.role, Role::Peer);
    assert_eq!(
        answer.size,
        Some(64 << 20),
        "the held join carries the size"
    );
    assert_eq!(waiting(&t).await, 0);
}

#[tokio::test]
async fn a_tracker_short_of_connections_answers_at_once() {
    // A cap this small is always at least half used: nothing may be held.
    let t = Tracker::new(SwarmConfig::default(), None).with_limits(tracker::ServerLimits {
        max_connections: 1,
        ..Default::default()
    });
    let d = oci::Digest::of(b"not held");
    announce(&t, &join("src", &d)).await;
    let mut peer = join("peer", &d);
    peer.wait_for_size_ms = 60_000;
    let asked = {
        let t = t.clone();
        tokio::spawn(async move { announce(&t, &peer).await })
    };
    // Held, the join would show in the gauge for a whole second.
    let mut seen_held = false;
    while !asked.is_finished() {
        seen_held |= waiting(&t).await > 0;
        tokio::task::yield_now().await;
    }
    assert!(
        !seen_held,
        "a join was held with the connections nearly all in use"
    );
    let (status, answer) = asked.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let answer = answer.unwrap();
    assert_eq!((answer.role, answer.size), (Role::Peer, None));
}
