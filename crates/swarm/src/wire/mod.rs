//! The peer wire protocol: frames exchanged on one long-lived connection from a
//! downloader to a holder. Encoding and decoding only, no I/O, so the codec can be
//! fuzzed and the agent's connection tasks stay thin.
//!
//! Every frame is `u32 length (big endian) | u8 type | payload`, where the length
//! counts the type byte and the payload. A [`Frame::Data`] frame is followed by
//! `len` raw bytes that the length does not count: the holder sends them straight from
//! its page cache (`sendfile`), and the receiver reads them straight into its buffer.
//!
//! A connection carries many blobs: the downloader opens a *channel* per blob (its own
//! number), the holder answers with what it holds and then keeps it posted (`Have`)
//! until the channel is closed. Only the downloader asks for pieces; a node that wants
//! pieces from the other side opens its own connection.
//!
//! Everything here is hostile input: lengths, counts and indexes are bounded before
//! anything is allocated, and a malformed frame is an error, never a panic.

mod codec;

use crate::pieces::PieceHash;
use crate::Bitfield;

/// 2: piece hashes are the blob's sha256 chaining values (`crate::chain`), not BLAKE3.
/// 3: a blob's first piece is a small head piece (`crate::pieces::HEAD_DIVISOR`), so
/// piece boundaries moved.
/// 4: HAVE_FILTER (a downloader asks a far holder for its rack stripe's HAVEs only).
/// 5: pieces of every size the rule picks (up to 64 MiB) begin with a small head piece
/// (`crate::pieces::HEAD_MAX_PIECE`; version 3 split only pieces of at most 1 MiB).
/// Agents of different versions refuse each other at HELLO instead of failing each
/// other's pieces (upgrade a cluster's agents together; see README).
pub const PROTOCOL_VERSION: u16 = 5;

/// Largest control frame (a bitfield of [`MAX_PIECES`](crate::pieces::MAX_PIECES) is
/// 8 KiB, a hash batch 128 KiB).
pub const MAX_CONTROL_FRAME: usize = 256 << 10;
/// Largest run of raw bytes after one `Data` header.
pub const MAX_DATA_CHUNK: u32 = 1 << 20;
/// Hashes per `Hashes` frame.
pub const MAX_HASHES_PER_FRAME: usize = 4096;
pub const MAX_NODE_NAME: usize = 253;
/// Longest `Goodbye` reason, in bytes.
pub const MAX_GOODBYE: usize = 1024;

pub type ChannelId = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// The holder's upload line is full: ask someone else, or again shortly.
    Busy,
    /// The holder does not hold the piece (anymore).
    NotHeld,
    /// The request made no sense (unknown channel, piece out of range).
    Invalid,
    /// The downloader cancelled it before it was served.
    Cancelled,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// First frame each way. `nonce` is the challenge the other side must answer
    /// in its proof; `proof` answers the other side's nonce (zeros from the dialer,
    /// which has not seen the holder's nonce yet).
    Hello {
        version: u16,
        node: String,
        /// Where the sender's own peer listener is (`host:port`), so a holder can open
        /// a channel back to a new member of a swarm without waiting for the tracker.
        /// A claim like any other: the holder dials it and checks who answers.
        addr: String,
        nonce: [u8; 16],
        proof: [u8; 32],
    },
    /// The dialer's answer to the holder's nonce.
    Auth {
        proof: [u8; 32],
    },
    /// Downloader → holder: subscribe to a blob on channel `chan`.
    Open {
        chan: ChannelId,
        digest: [u8; 32],
        blob_size: u64,
        piece_size: u64,
    },
    Close {
        chan: ChannelId,
    },
    /// Holder → downloader: the pieces held now (answer to `Open`).
    Bitfield {
        chan: ChannelId,
        have: Bitfield,
    },
    /// Holder → downloader: every piece is held.
    Complete {
        chan: ChannelId,
    },
    /// Holder → downloader: nothing of this blob here (or another geometry).
    NotHeld {
        chan: ChannelId,
    },
    /// Holder → downloader: a piece became available. `hash` is the holder's record
    /// of the piece's hash; a downloader only trusts it from the blob's source.
    Have {
        chan: ChannelId,
        piece: u32,
        hash: Option<PieceHash>,
    },
    /// Downloader → holder. `urgent`: a reader waits on this piece (read head).
    Request {
        chan: ChannelId,
        piece: u32,
        urgent: bool,
    },
    Cancel {
        chan: ChannelId,
        piece: u32,
    },
    Reject {
        chan: ChannelId,
        piece: u32,
        reason: RejectReason,
    },
    /// Holder → downloader: `len` raw bytes of `piece` from `offset` follow.
    Data {
        chan: ChannelId,
        piece: u32,
        offset: u32,
        len: u32,
    },
    /// Downloader → holder: send the piece hashes of a complete blob.
    HashesRequest {
        chan: ChannelId,
    },
    Hashes {
        chan: ChannelId,
        first: u32,
        hashes: Vec<PieceHash>,
    },
    Ping {
        nonce: u64,
    },
    Pong {
        nonce: u64,
    },
    /// Either side, before closing: why.
    Goodbye {
        reason: String,
    },
    /// Downloader → holder: from now on send HAVEs on `chan` only for the pieces
    /// `filter` admits (`crate::links::HaveFilter`).
    HaveFilter {
        chan: ChannelId,
        filter: crate::links::HaveFilter,
    },
}

/// The proof that answers a nonce: HMAC-SHA256 over (role, nonce, the prover's name)
/// with the cluster token. The token itself never crosses the wire, so a peer address
/// forged in the tracker only yields a failed handshake, not the token (issue 12,
/// finding 11).
pub fn handshake_proof(token: &[u8], role: u8, nonce: &[u8; 16], prover: &str) -> [u8; 32] {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token);
    let mut ctx = ring::hmac::Context::with_key(&key);
    ctx.update(b"starling-peer-v1");
    ctx.update(&[role]);
    ctx.update(nonce);
    ctx.update(prover.as_bytes());
    let tag = ctx.sign();
    let mut out = [0u8; 32];
    out.copy_from_slice(tag.as_ref());
    out
}

/// Constant-time comparison of proofs.
pub fn proofs_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Role bytes for [`handshake_proof`]: the holder (accepting side) and the dialer.
pub const ROLE_HOLDER: u8 = b'H';
pub const ROLE_DIALER: u8 = b'D';

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_token_role_nonce_and_name() {
        let p = handshake_proof(b"t", ROLE_DIALER, &[1; 16], "a");
        assert!(proofs_equal(
            &p,
            &handshake_proof(b"t", ROLE_DIALER, &[1; 16], "a")
        ));
        for other in [
            handshake_proof(b"u", ROLE_DIALER, &[1; 16], "a"),
            handshake_proof(b"t", ROLE_HOLDER, &[1; 16], "a"),
            handshake_proof(b"t", ROLE_DIALER, &[2; 16], "a"),
            handshake_proof(b"t", ROLE_DIALER, &[1; 16], "b"),
        ] {
            assert!(!proofs_equal(&p, &other));
        }
    }
}
