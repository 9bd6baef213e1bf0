#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use futures::StreamExt;
use oci::Digest;
use store::{Begin, Store, StoreConfig};
use swarm::chain::piece_hashes;
use swarm::PieceHash;

fn data(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed as u32)
                .to_le_bytes()[1]
        })
        .collect()
}

async fn collect(
    s: impl futures::Stream<Item = Result<bytes::Bytes, store::Error>>,
) -> Result<Vec<u8>, store::Error> {
    let mut out = Vec::new();
    futures::pin_mut!(s);
    while let Some(c) = s.next().await {
        out.extend_from_slice(&c?);
    }
    Ok(out)
}

fn open(dir: &std::path::Path) -> Store {
    Store::open(StoreConfig::new(dir)).unwrap()
}

/// A fresh store leading the download of `body` in pieces of `piece_size`, its bytes
/// coming from `source`. The directory lives as long as the returned handle.
async fn lead_pieces(
    body: &[u8],
    piece_size: u64,
    source: &str,
) -> (
    tempfile::TempDir,
    Store,
    Digest,
    swarm::PieceLayout,
    store::PieceWriter,
) {
    let dir = tempfile::tempdir().unwrap();
    let d = Digest::of(body);
    let layout = swarm::PieceLayout::new(body.len() as u64, piece_size);
    let store = open(dir.path());
    let Begin::Lead(w) = store.begin(&d, None, source).await.unwrap() else {
        panic!("a fresh store leads the download")
    };
    let (w, _) = w.into_pieces(layout);
    (dir, store, d, layout, w)
}

#[tokio::test]
async fn single_writer_cut_through_readers_and_completion() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let body = data(3 << 20, 1);
    let d = Digest::of(&body);
    let Begin::Lead(mut w) = store
        .begin(&d, Some(body.len() as u64), "test")
        .await
        .unwrap()
    else {
        panic!("expected lead")
    };
    // A second request joins instead of starting a second download.
    let Begin::Join(inf) = store.begin(&d, None, "test").await.unwrap() else {
        panic!("expected join")
    };
    let reader = tokio::spawn(collect(store::read_inflight(inf.clone(), 0, None)));
    let ranged = tokio::spawn(collect(store::read_inflight(inf, 1000, Some(2_000_000))));
    for chunk in body.chunks(100_000) {
        w.write(chunk).await.unwrap();
        tokio::task::yield_now().await;
    }
    assert_eq!(w.finish().await.unwrap(), body.len() as u64);
    assert_eq!(reader.await.unwrap().unwrap(), body);
    assert_eq!(ranged.await.unwrap().unwrap(), body[1000..2_000_000]);
    assert!(
        matches!(store.begin(&d, None, "test").await.unwrap(), Begin::Complete(n) if n == body.len() as u64)
    );
    let open = store.open_complete(&d).unwrap().unwrap();
    let all = collect(store::read_file(
        open.file.clone(),
        open.path.clone(),
        0,
        open.size,
    ))
    .await
    .unwrap();
    assert_eq!(all, body);
}

#[tokio::test]
async fn wrong_bytes_are_never_stored_and_readers_get_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(dir.path());
    let good = data(500_000, 2);
    let d = Digest::of(&good);
    let Begin::Lead(mut w) = store.begin(&d, None, "test").await.unwrap() else {
        panic!()
    };
    let Begin::Join(inf) = store.begin(&d, None, "test").await.unwrap() else {
        panic!()
    };
    let reader = tokio::spawn(collect(store::read_inflight(inf, 0, None)));
    let mut bad = good.clone();
    bad[12345] ^= 1;
    w.write(&bad).await.unwrap();
    assert!(w.finish().await.is_err());
    assert!(
        reader.await.unwrap().is_err(),
        "reader must not see a clean end of a corrupt blob"
    );
    assert!(store.stat(&d).is_none());
    assert_eq!(
        store.partial_len(&d),
        None,
        "corrupt partial must be discarded"
    );
    // Size lies are caught before the bytes are even hashed to the end.
    let Begin::Lead(mut w) = store.begin(&d, Some(10), "test").await.unwrap() else {
        panic!()
    };
    assert!(w.write(&good).await.is_err());
}

#[tokio::test]
async fn partial_download_resumes_after_restart_and_is_not_complete() {
    let dir = tempfile::tempdir().unwrap();
    let body = data(2 << 20, 3);
    let d = Digest::of(&body);
    {
        let store = open(dir.path());
        let Begin::Lead(mut w) = store
            .begin(&d, Some(body.len() as u64), "test")
            .await
            .unwrap()
        else {
            panic!()
        };
        w.write(&body[..700_000]).await.unwrap();
        // Simulated crash: the writer is dropped without finishing.
        drop(w);
    }
    let store = open(dir.path());
    assert!(
        store.stat(&d).is_none(),
        "a partial blob must not be complete after restart"
    );
    assert!(store.open_complete(&d).unwrap().is_none());
    let Begin::Lead(mut w) = store
        .begin(&d, Some(body.len() as u64), "test")
        .await
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(w.offset(), 700_000);
    w.write(&body[700_000..]).await.unwrap();
    w.finish().await.unwrap();
    drop(store);
    let store = open(dir.path());
    assert_eq!(store.stat(&d).unwrap().size, body.len() as u64);
}

#[tokio::test]
async fn corrupted_partial_is_caught_at_finish() {
    let dir = tempfile::tempdir().unwrap();
    let body = data(1 << 20, 4);
    let d = Digest::of(&body);
    {
        let store = open(dir.path());
        let Begin::Lead(mut w) = store.begin(&d, None, "test").await.unwrap() else {
            panic!()
        };
        w.write(&body[..300_000]).await.unwrap();
        drop(w);
    }
    // Someone scribbles on the partial file while the agent is down.
    let p = dir.path().join("partial").join(d.hex());
    let mut raw = std::fs::read(&p).unwrap();
    raw[10] ^= 0xff;
    std::fs::write(&p, raw).unwrap();
    let store = open(dir.path());
    let Begin::Lead(mut w) = store.begin(&d, None, "test").await.unwrap() else {
        panic!()
    };
    w.write(&body[w.offset() as usize..]).await.unwrap();
    assert!(w.finish().await.is_err());
    assert!(store.stat(&d).is_none());
}

#[tokio::test]
async fn gc_evicts_lru_but_keeps_pinned_and_served_blobs() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path());
    cfg.budget_bytes = 10 << 20;
    cfg.min_free_bytes = 0;
    let store = Store::open(cfg).unwrap();
    let mut digests = Vec::new();
    for i in 0..4u8 {
        let b = data(2 << 20, 10 + i);
        let d = Digest::of(&b);
        let Begin::Lead(mut w) = store.begin(&d, Some(b.len() as u64), "test").await.unwrap()
        else {
            panic!()
        };
        w.write(&b).await.unwrap();
        w.finish().await.unwrap();
        digests.push(d);
    }
    // Pin blob 0 through a manifest that references it; hold blob 1 open.
    let manifest = format!("{{\"schemaVersion\":2,\"layers\":[\"{}\"]}}", digests[0]);
    let md = Digest::of(manifest.as_bytes());
    store
        .put_manifest(
            &md,
            oci::media::OCI_MANIFEST,
            manifest.as_bytes(),
            vec![digests[0].clone()],
        )
        .unwrap();
    store.pin(&md, None, "test").unwrap();
    let served = store.open_complete(&digests[1]).unwrap().unwrap();
    let report = store.gc_to(0).unwrap();
    assert_eq!(report.evicted, 2);
    assert!(store.stat(&digests[0]).is_some(), "pinned content survives");
    assert!(
        store.stat(&digests[1]).is_some(),
        "content being served survives"
    );
    assert!(store.stat(&digests[2]).is_none() && store.stat(&digests[3]).is_none());
    drop(served);
    store.unpin(&md).unwrap();
    let report = store.gc_to(0).unwrap();
    assert_eq!(report.evicted, 3);
    // Over-budget request is refused so the caller streams without caching.
    let big = Digest::of(b"big");
    assert!(matches!(store.begin(&big, Some(20 << 20), "test").await, Err(e) if e.is_disk_full()));
}

/// What a peer connection does with a piece: claim it, write it, then the download
/// task marks it held once it hashed from the piece before's hash to its own.
async fn receive(w: &mut store::PieceWriter, hashes: &[PieceHash], i: u32, bytes: &[u8]) {
    let inf = w.inflight();
    assert!(inf.claim_piece(i), "piece {i} is free to receive");
    inf.write_claimed(w.layout().range(i).0, bytes).unwrap();
    let before = i.checked_sub(1).map(|j| hashes[j as usize]);
    assert!(w
        .mark_received(i, before, hashes[i as usize])
        .await
        .unwrap());
}

/// Waits until the digest has hashed the registry pieces and they are held (or
/// `done` says so earlier).
async fn hold_hashed_until(
    w: &mut store::PieceWriter,
    held: &mut Vec<(u32, PieceHash)>,
    done: impl Fn(&store::PieceWriter) -> bool,
) {
    let count = w.layout().count() as usize;
    tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while !done(w) && held.len() < count {
            let hashes = w.next_hashes().await;
            held.extend(w.hold_hashed(hashes).await.unwrap());
        }
    })
    .await
    .expect("the digest reaches every piece on disk");
}

/// Stores `body` in a store whose `preallocate_from` is `from`, and returns the
/// partial file's metadata right after `reserve`, before the first byte. The blob is
/// stored and served whole either way.
async fn partial_after_reserve(body: &[u8], from: u64) -> std::fs::Metadata {
    let dir = tempfile::tempdir().unwrap();
    let d = Digest::of(body);
    let mut cfg = StoreConfig::new(dir.path());
    cfg.preallocate_from = from;
    let store = Store::open(cfg).unwrap();
    let Begin::Lead(mut w) = store.begin(&d, None, "registry").await.unwrap() else {
        panic!()
    };
    let inf = w.inflight();
    w.set_total(body.len() as u64);
    w.reserve().unwrap();
    let meta = std::fs::metadata(inf.path()).unwrap();
    w.write(body).await.unwrap();
    w.finish().await.unwrap();
    let open = store.open_complete(&d).unwrap().expect("stored");
    assert_eq!(open.size, body.len() as u64);
    meta
}

/// From `preallocate_from` on, `reserve` allocates the whole blob's blocks before its
/// first byte, the partial file's length unchanged (a resume reads progress from it).
#[tokio::test]
async fn reserve_allocates_the_blob_s_blocks_and_keeps_the_length() {
    use std::os::unix::fs::MetadataExt;
    let body = data(8 << 20, 3);
    let meta = partial_after_reserve(&body, 8 << 20).await;
    assert_eq!(meta.len(), 0, "the length still says nothing is written");
    assert!(
        meta.blocks() * 512 >= body.len() as u64,
        "{} bytes allocated for {}",
        meta.blocks() * 512,
        body.len()
    );
}

/// Below `preallocate_from` a blob is left to ext4's delayed allocation: nothing is
/// allocated before its bytes come.
#[tokio::test]
async fn a_blob_below_the_preallocation_size_is_not_allocated_ahead() {
    use std::os::unix::fs::MetadataExt;
    let body = data(4 << 20, 4);
    let meta = partial_after_reserve(&body, (4 << 20) + 1).await;
    assert_eq!(
        meta.blocks(),
        0,
        "blocks allocated for a blob below the size"
    );
}

/// A reader that joins a download waits for its size; a download going on in piece
/// mode (the agent's swarm) tells the size only with the piece state in place, so
/// the reader also sees the mode: the agent names the bytes it serves by it
/// (`starling-source`, the served-bytes metrics). Before, the size went out first,
/// and a reader joining in between named swarm bytes "registry" (the swarm process
/// test `eight_agents_pull_at_once_…` failed 3 runs of 6 on that).
#[tokio::test]
async fn a_reader_sees_the_size_of_a_piece_mode_download_with_its_layout() {
    let dir = tempfile::tempdir().unwrap();
    let body = data(3 << 20, 5);
    let d = Digest::of(&body);
    let layout = swarm::PieceLayout::new(body.len() as u64, 1 << 20);
    let store = open(dir.path());
    let Begin::Lead(mut w) = store.begin(&d, None, "peer").await.unwrap() else {
        panic!()
    };
    let inf = w.inflight();
    w.expect_total(layout.blob_size);
    w.reserve().unwrap();
    assert_eq!(inf.progress().total, None, "the size waits for the mode");
    assert_eq!(inf.layout(), None);
    let (_w, _) = w.into_pieces(layout);
    assert_eq!(inf.progress().total, Some(layout.blob_size));
    assert_eq!(inf.layout(), Some(layout));
}

#[tokio::test]
async fn pieces_out_of_order_stream_in_order_and_survive_restart() {
    let dir = tempfile::tempdir().unwrap();
    let body = data(5 << 19, 9);
    let d = Digest::of(&body);
    let layout = swarm::PieceLayout::new(body.len() as u64, 1 << 20);
    // A 64 KiB head, the rest of the first MiB, [1, 2) MiB and [2, 2.5) MiB.
    assert_eq!(layout.count(), 4);
    let hashes = piece_hashes(layout, &body);
    let piece = |i: u32| {
        let (a, b) = layout.range(i);
        bytes::Bytes::copy_from_slice(&body[a as usize..b as usize])
    };
    {
        let store = open(dir.path());
        let Begin::Lead(w) = store.begin(&d, None, "peer").await.unwrap() else {
            panic!()
        };
        let (mut w, claims) = w.into_pieces(layout);
        assert!(claims.is_empty());
        let inf = w.inflight();
        let reader = tokio::spawn(collect(store::read_inflight(inf.clone(), 0, None)));
        receive(&mut w, &hashes, 3, &piece(3)).await;
        assert_eq!(
            inf.progress().written,
            0,
            "a later piece does not advance the in-order prefix"
        );
        assert!(inf.has_piece(layout, 3) && !inf.has_piece(layout, 0));
        assert!(!inf.claim_piece(3), "a held piece is never written again");
        assert!(inf.claim_piece(0));
        assert!(!inf.claim_piece(0), "one receiver per piece");
        inf.release_piece_claim(0);
        assert_eq!(inf.piece_hash(3), Some(hashes[3]));
        assert_eq!(
            &inf.read_at(2 << 20, 16).await.unwrap()[..],
            &body[2 << 20..(2 << 20) + 16]
        );
        // Crash after piece 3 only.
        drop(w);
        assert!(reader.await.unwrap().is_err());
    }
    let store = open(dir.path());
    let Begin::Lead(w) = store.begin(&d, None, "peer").await.unwrap() else {
        panic!()
    };
    let (mut w, claims) = w.into_pieces(layout);
    assert_eq!(
        claims,
        vec![3],
        "the piece written before the crash is offered for re-verification"
    );
    assert!(
        !w.verify_existing(3, Some(hashes[2]), PieceHash::of(b"wrong"))
            .await
            .unwrap(),
        "kept only if it matches its hash"
    );
    assert!(
        !w.verify_existing(3, Some(hashes[1]), hashes[3])
            .await
            .unwrap(),
        "nor if hashed from another piece's hash"
    );
    assert!(w
        .verify_existing(3, Some(hashes[2]), hashes[3])
        .await
        .unwrap());
    let reader = tokio::spawn(collect(store::read_inflight(w.inflight(), 0, None)));
    receive(&mut w, &hashes, 2, &piece(2)).await;
    receive(&mut w, &hashes, 1, &piece(1)).await;
    receive(&mut w, &hashes, 0, &piece(0)).await;
    assert_eq!(w.inflight().progress().written, body.len() as u64);
    w.finish().await.unwrap();
    assert_eq!(reader.await.unwrap().unwrap(), body);
    assert!(!dir
        .path()
        .join("partial")
        .join(format!("{}.pieces", d.hex()))
        .exists());
}

/// A source that publishes a chain of hashes computed over other bytes: every piece
/// matches the false chain, but the chain does not end in the digest, so nothing is
/// kept.
#[tokio::test]
async fn pieces_matching_a_false_chain_are_refused_by_the_digest() {
    let body = data(3 << 20, 7);
    let (_dir, store, d, layout, mut w) = lead_pieces(&body, 1 << 20, "peer").await;
    let mut forged = body.clone();
    forged[(1 << 20) + 99] ^= 0xff;
    let lies = piece_hashes(layout, &forged);
    for i in 0..layout.count() {
        let (a, b) = layout.range(i);
        receive(&mut w, &lies, i, &forged[a as usize..b as usize]).await;
    }
    let err = w
        .finish()
        .await
        .expect_err("the chain ends in another digest");
    assert!(err.to_string().contains("digest"), "{err}");
    assert!(store.open_complete(&d).unwrap().is_none());
}

/// A piece verified from a published hash that is not what the bytes before it hash
/// to (the published values disagree with each other): the digest does not step over
/// it but reads it back, so the blob's sha256 is still computed over the real bytes.
#[tokio::test]
async fn a_piece_verified_from_a_disagreeing_start_is_read_back_by_the_digest() {
    // Three pieces: the head, the rest of the first MiB, the second MiB.
    let body = data(2 << 20, 8);
    let (_dir, store, d, layout, mut w) = lead_pieces(&body, 1 << 20, "peer").await;
    let hashes = piece_hashes(layout, &body);
    let inf = w.inflight();
    for i in [2, 0] {
        let (a, b) = layout.range(i);
        receive(&mut w, &hashes, i, &body[a as usize..b as usize]).await;
    }
    let (a, b) = layout.range(1);
    assert!(inf.claim_piece(1));
    inf.write_claimed(a, &body[a as usize..b as usize]).unwrap();
    assert!(w
        .mark_received(1, Some(PieceHash::of(b"not piece 0")), hashes[1])
        .await
        .unwrap());
    w.finish().await.unwrap();
    assert!(store.open_complete(&d).unwrap().is_some());
}

#[tokio::test]
async fn a_registry_run_hashes_pieces_as_they_pass_and_readers_follow_its_bytes() {
    let body = data(5 << 20 | 12345, 4);
    let (_dir, _store, _d, layout, mut w) = lead_pieces(&body, 1 << 20, "registry").await;
    let inf = w.inflight();
    let reader = tokio::spawn(collect(store::read_inflight(inf.clone(), 0, None)));
    // Two slices at once, as over two registry connections.
    let half = layout.count() / 2;
    let a = w.start_run(0, half).unwrap();
    let b = w.start_run(half, layout.count()).unwrap();
    assert!(w.start_run(1, 2).is_err(), "runs never overlap");
    assert!(
        !inf.claim_piece(3),
        "a run's pieces are not received from peers"
    );
    let split = layout.range(half).0 as usize;
    let mut held = Vec::new();
    let (mut xs, mut ys) = (body[..split].chunks(100_000), body[split..].chunks(100_000));
    loop {
        let (x, y) = (xs.next(), ys.next());
        if x.is_none() && y.is_none() {
            break;
        }
        if let Some(y) = y {
            held.extend(
                w.write_run(b, bytes::Bytes::copy_from_slice(y))
                    .await
                    .unwrap()
                    .held,
            );
        }
        if let Some(x) = x {
            held.extend(
                w.write_run(a, bytes::Bytes::copy_from_slice(x))
                    .await
                    .unwrap()
                    .held,
            );
        }
    }
    held.extend(w.flush_runs().await.unwrap());
    hold_hashed_until(&mut w, &mut held, |w| w.is_complete()).await;
    held.sort_by_key(|x| x.0);
    assert_eq!(
        held,
        piece_hashes(layout, &body)
            .into_iter()
            .enumerate()
            .map(|(i, h)| (i as u32, h))
            .collect::<Vec<_>>(),
        "each piece once, with the blob's chained sha256 at its end"
    );
    w.finish().await.unwrap();
    assert_eq!(reader.await.unwrap().unwrap(), body);
}

#[tokio::test]
async fn a_registry_runs_head_piece_is_held_before_a_flushs_worth_follows_it() {
    let body = data(5 << 20, 6);
    let (_dir, store, d, layout, mut w) = lead_pieces(&body, 1 << 20, "registry").await;
    assert!(layout.is_small_head(0));
    let head_end = layout.range(0).1 as usize;
    let run = w.start_run(0, layout.count()).unwrap();
    // The head and a little more arrive; the registry then pauses (it paces its
    // streams): nothing else is written and nothing is flushed.
    let mut held = w
        .write_run(run, bytes::Bytes::copy_from_slice(&body[..head_end + 4096]))
        .await
        .unwrap()
        .held;
    hold_hashed_until(&mut w, &mut held, |w| w.held().get(0)).await;
    assert_eq!(
        held,
        vec![(0, piece_hashes(layout, &body)[0])],
        "the head alone, with its chained hash"
    );
    let mut rest = w
        .write_run(run, bytes::Bytes::copy_from_slice(&body[head_end + 4096..]))
        .await
        .unwrap()
        .held;
    hold_hashed_until(&mut w, &mut rest, |w| w.is_complete()).await;
    w.finish().await.unwrap();
    assert!(store.open_complete(&d).unwrap().is_some());
}

#[tokio::test]
async fn an_aborted_run_keeps_whole_pieces_and_frees_the_rest() {
    // Four pieces: the head, the rest of the first MiB, two more MiBs.
    let body = data(3 << 20, 5);
    let (_dir, store, d, layout, mut w) = lead_pieces(&body, 1 << 20, "registry").await;
    let run = w.start_run(0, 4).unwrap();
    // 1.5 MiB arrives (pieces 0 and 1, half of 2), then the stream dies.
    w.write_run(run, bytes::Bytes::copy_from_slice(&body[..3 << 19]))
        .await
        .unwrap();
    let mut held = w.abort_run(run).await.unwrap();
    hold_hashed_until(&mut w, &mut held, |w| w.held().get(1)).await;
    let now = w.held();
    assert!(
        now.get(0) && now.get(1) && !now.get(2),
        "pieces 0 and 1 kept, the cut piece not: {held:?}"
    );
    let inf = w.inflight();
    for i in 2..4 {
        assert!(inf.claim_piece(i), "piece {i} is free for someone else");
        inf.release_piece_claim(i);
    }
    let hashes = piece_hashes(layout, &body);
    for i in 2..4 {
        let (a, b) = layout.range(i);
        receive(&mut w, &hashes, i, &body[a as usize..b as usize]).await;
    }
    w.finish().await.unwrap();
    assert!(store.open_complete(&d).unwrap().is_some());
}

/// A real full disk (tmpfs) in the middle of a download: what the failed writer left
/// must be a correct prefix, so the resumed download verifies. Needs root (mount).
#[tokio::test]
async fn a_download_cut_by_a_full_disk_resumes_into_the_right_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("fs");
    std::fs::create_dir(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mounting a tmpfs needs root");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    let filler = mnt.join("filler");
    std::fs::write(&filler, vec![1u8; 3 << 20]).unwrap();
    let root = mnt.join("cache");
    // Not `data()`: its bytes repeat every 64 KiB, which would hide misplaced writes.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let body: Vec<u8> = (0..6 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    let d = Digest::of(&body);
    let store = Store::open(StoreConfig::new(&root)).unwrap();
    let Begin::Lead(mut w) = store.begin(&d, None, "test").await.unwrap() else {
        panic!("expected lead")
    };
    let mut failed = false;
    for chunk in body.chunks(64 << 10) {
        if let Err(e) = w.write(chunk).await {
            assert!(e.is_disk_full(), "{e}");
            failed = true;
            break;
        }
    }
    assert!(failed, "the disk filled before the last byte");
    // Space comes back (another download gave up) before the failed writer is dropped:
    // whatever it still buffers must not land where the failed write should have been.
    std::fs::remove_file(&filler).unwrap();
    drop(w);
    let Begin::Lead(mut w) = store.begin(&d, None, "test").await.unwrap() else {
        panic!("expected lead")
    };
    let from = w.offset() as usize;
    assert!(
        from > 0 && from < body.len(),
        "resumes from a prefix: {from}"
    );
    w.write(&body[from..]).await.unwrap();
    assert_eq!(
        w.finish().await.unwrap(),
        body.len() as u64,
        "resumed bytes verify"
    );
}

/// A blob of two pieces in one registry run: once the digest has hashed both, the
/// writer is complete, whichever call took the hashes.
#[tokio::test]
async fn registry_pieces_hashed_by_the_digest_complete_the_blob() {
    let body = data(300 << 10, 3);
    let (_dir, store, d, layout, mut w) = lead_pieces(&body, 256 << 10, "registry").await;
    let run = w.start_run(0, layout.count()).unwrap();
    let mut held = Vec::new();
    for c in body.chunks(16 << 10) {
        held.extend(
            w.write_run(run, bytes::Bytes::copy_from_slice(c))
                .await
                .unwrap()
                .held,
        );
    }
    assert_eq!(w.run_position(run), None, "the run is done");
    hold_hashed_until(&mut w, &mut held, |_| false).await;
    assert!(w.is_complete(), "every piece held: {held:?}");
    w.finish().await.unwrap();
    assert!(store.open_complete(&d).unwrap().is_some());
}
