//! How fast the chained piece hash runs against the plain sha256 it replaces two
//! passes of: `cargo run --release -p swarm --example piece_hash_speed [MiB]`.
use std::time::Instant;

use sha2::Digest as _;
use swarm::chain::BlobSha256;

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    let data: Vec<u8> = (0..mib << 20).map(|i| (i % 251) as u8).collect();
    for round in 0..3 {
        let t = Instant::now();
        let plain = sha2::Sha256::digest(&data);
        let plain_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut chain = BlobSha256::new();
        for chunk in data.chunks(256 << 10) {
            chain.update(chunk);
        }
        let chained = chain.finalize();
        let chain_s = t.elapsed().as_secs_f64();
        assert_eq!(chained.0, <[u8; 32]>::from(plain));
        let gib = data.len() as f64 / (1u64 << 30) as f64;
        // The connection's case: a 512 KiB payload just copied from the socket, in cache.
        let hot = &data[..512 << 10];
        let reps = data.len() / hot.len();
        let t = Instant::now();
        let mut plain = sha2::Sha256::new();
        for _ in 0..reps {
            plain.update(hot);
        }
        let _ = plain.finalize();
        let hot_plain_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut chain = BlobSha256::new();
        for _ in 0..reps {
            chain.update(hot);
        }
        let _ = chain.finalize();
        let hot_chain_s = t.elapsed().as_secs_f64();
        println!(
            "round {round}: from memory: sha256 {:.3} s/GiB, chained {:.3} ({:.2}x); in cache: sha256 {:.3}, chained {:.3} ({:.2}x)",
            plain_s / gib,
            chain_s / gib,
            chain_s / plain_s,
            hot_plain_s / gib,
            hot_chain_s / gib,
            hot_chain_s / hot_plain_s
        );
    }
}
