//! The byte layout of [`Frame`]s: encoding, and decoding that bounds every length and
//! count before allocating. Kept apart from the frame vocabulary so the hostile-input
//! limits can be reviewed and fuzzed on their own.

use bytes::{Buf, BufMut, BytesMut};

use super::{
    Frame, RejectReason, MAX_CONTROL_FRAME, MAX_DATA_CHUNK, MAX_GOODBYE, MAX_HASHES_PER_FRAME,
    MAX_NODE_NAME,
};
use crate::pieces::{validate_geometry, PieceHash, MAX_PIECES};
use crate::{Bitfield, Error};

impl RejectReason {
    fn code(self) -> u8 {
        match self {
            Self::Busy => 1,
            Self::NotHeld => 2,
            Self::Invalid => 3,
            Self::Cancelled => 4,
        }
    }

    fn from_code(c: u8) -> Result<Self, Error> {
        Ok(match c {
            1 => Self::Busy,
            2 => Self::NotHeld,
            3 => Self::Invalid,
            4 => Self::Cancelled,
            other => return Err(wire(format!("unknown reject reason {other}"))),
        })
    }
}

mod code {
    pub const HELLO: u8 = 1;
    pub const AUTH: u8 = 2;
    pub const OPEN: u8 = 3;
    pub const CLOSE: u8 = 4;
    pub const BITFIELD: u8 = 5;
    pub const COMPLETE: u8 = 6;
    pub const NOT_HELD: u8 = 7;
    pub const HAVE: u8 = 8;
    pub const REQUEST: u8 = 9;
    pub const CANCEL: u8 = 10;
    pub const REJECT: u8 = 11;
    pub const DATA: u8 = 12;
    pub const HASHES_REQUEST: u8 = 13;
    pub const HASHES: u8 = 14;
    pub const PING: u8 = 15;
    pub const PONG: u8 = 16;
    pub const GOODBYE: u8 = 17;
    pub const HAVE_FILTER: u8 = 18;
}

fn wire(msg: String) -> Error {
    Error::Wire(msg)
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary:
/// a name or reason cut in the middle of a character would not decode (found by the
/// `frame_roundtrip` fuzz target).
fn cut(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Frame {
    /// Appends the encoded frame to `out`. Never fails for frames built by this crate;
    /// oversized contents (a name past [`MAX_NODE_NAME`], too many hashes) are cut to
    /// the limits the decoder enforces.
    pub fn encode(&self, out: &mut BytesMut) {
        let at = out.len();
        out.put_u32(0);
        match self {
            Frame::Hello {
                version,
                node,
                addr,
                nonce,
                proof,
            } => {
                out.put_u8(code::HELLO);
                out.put_u16(*version);
                let name = cut(node, MAX_NODE_NAME);
                out.put_u8(name.len() as u8);
                out.put_slice(name.as_bytes());
                let addr = cut(addr, MAX_NODE_NAME);
                out.put_u8(addr.len() as u8);
                out.put_slice(addr.as_bytes());
                out.put_slice(nonce);
                out.put_slice(proof);
            }
            Frame::Auth { proof } => {
                out.put_u8(code::AUTH);
                out.put_slice(proof);
            }
            Frame::Open {
                chan,
                digest,
                blob_size,
                piece_size,
            } => {
                out.put_u8(code::OPEN);
                out.put_u32(*chan);
                out.put_slice(digest);
                out.put_u64(*blob_size);
                out.put_u64(*piece_size);
            }
            Frame::Close { chan } => {
                out.put_u8(code::CLOSE);
                out.put_u32(*chan);
            }
            Frame::Bitfield { chan, have } => {
                out.put_u8(code::BITFIELD);
                out.put_u32(*chan);
                out.put_u32(have.len());
                out.put_slice(have.as_bytes());
            }
            Frame::Complete { chan } => {
                out.put_u8(code::COMPLETE);
                out.put_u32(*chan);
            }
            Frame::NotHeld { chan } => {
                out.put_u8(code::NOT_HELD);
                out.put_u32(*chan);
            }
            Frame::Have { chan, piece, hash } => {
                out.put_u8(code::HAVE);
                out.put_u32(*chan);
                out.put_u32(*piece);
                match hash {
                    Some(h) => {
                        out.put_u8(1);
                        out.put_slice(&h.0);
                    }
                    None => out.put_u8(0),
                }
            }
            Frame::Request {
                chan,
                piece,
                urgent,
            } => {
                out.put_u8(code::REQUEST);
                out.put_u32(*chan);
                out.put_u32(*piece);
                out.put_u8(u8::from(*urgent));
            }
            Frame::Cancel { chan, piece } => {
                out.put_u8(code::CANCEL);
                out.put_u32(*chan);
                out.put_u32(*piece);
            }
            Frame::Reject {
                chan,
                piece,
                reason,
            } => {
                out.put_u8(code::REJECT);
                out.put_u32(*chan);
                out.put_u32(*piece);
                out.put_u8(reason.code());
            }
            Frame::Data {
                chan,
                piece,
                offset,
                len,
            } => {
                out.put_u8(code::DATA);
                out.put_u32(*chan);
                out.put_u32(*piece);
                out.put_u32(*offset);
                out.put_u32(*len);
            }
            Frame::HashesRequest { chan } => {
                out.put_u8(code::HASHES_REQUEST);
                out.put_u32(*chan);
            }
            Frame::Hashes {
                chan,
                first,
                hashes,
            } => {
                out.put_u8(code::HASHES);
                out.put_u32(*chan);
                out.put_u32(*first);
                let n = hashes.len().min(MAX_HASHES_PER_FRAME);
                out.put_u16(n as u16);
                for h in &hashes[..n] {
                    out.put_slice(&h.0);
                }
            }
            Frame::Ping { nonce } => {
                out.put_u8(code::PING);
                out.put_u64(*nonce);
            }
            Frame::Pong { nonce } => {
                out.put_u8(code::PONG);
                out.put_u64(*nonce);
            }
            Frame::Goodbye { reason } => {
                out.put_u8(code::GOODBYE);
                let r = cut(reason, MAX_GOODBYE);
                out.put_u16(r.len() as u16);
                out.put_slice(r.as_bytes());
            }
            Frame::HaveFilter { chan, filter } => {
                out.put_u8(code::HAVE_FILTER);
                out.put_u32(*chan);
                out.put_u32(filter.modulus);
                out.put_u32(filter.residue);
            }
        }
        let len = (out.len() - at - 4) as u32;
        out[at..at + 4].copy_from_slice(&len.to_be_bytes());
    }

    /// Decodes one frame from the front of `buf`, consuming it. `Ok(None)`: more bytes
    /// are needed. For a `Data` frame only the header is consumed; the caller reads
    /// the `len` raw bytes that follow (some may already be in `buf`).
    pub fn decode(buf: &mut BytesMut) -> Result<Option<Frame>, Error> {
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len == 0 || len > MAX_CONTROL_FRAME {
            return Err(wire(format!("frame length {len} out of bounds")));
        }
        if buf.len() < 4 + len {
            return Ok(None);
        }
        buf.advance(4);
        let mut body = buf.split_to(len);
        let frame = parse_body(&mut body)?;
        if body.has_remaining() {
            return Err(wire(format!(
                "{} trailing bytes after a frame",
                body.remaining()
            )));
        }
        Ok(Some(frame))
    }
}

struct Reader<'a>(&'a mut BytesMut);

impl Reader<'_> {
    fn need(&self, n: usize) -> Result<(), Error> {
        if self.0.remaining() < n {
            Err(wire(format!(
                "frame truncated: need {n} bytes, have {}",
                self.0.remaining()
            )))
        } else {
            Ok(())
        }
    }
    fn u8(&mut self) -> Result<u8, Error> {
        self.need(1)?;
        Ok(self.0.get_u8())
    }
    fn u16(&mut self) -> Result<u16, Error> {
        self.need(2)?;
        Ok(self.0.get_u16())
    }
    fn u32(&mut self) -> Result<u32, Error> {
        self.need(4)?;
        Ok(self.0.get_u32())
    }
    fn u64(&mut self) -> Result<u64, Error> {
        self.need(8)?;
        Ok(self.0.get_u64())
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        self.need(N)?;
        let mut a = [0u8; N];
        self.0.copy_to_slice(&mut a);
        Ok(a)
    }
    fn bytes(&mut self, n: usize) -> Result<Vec<u8>, Error> {
        self.need(n)?;
        Ok(self.0.split_to(n).to_vec())
    }
}

fn parse_body(body: &mut BytesMut) -> Result<Frame, Error> {
    let mut r = Reader(body);
    let kind = r.u8()?;
    Ok(match kind {
        code::HELLO => {
            let version = r.u16()?;
            let n = r.u8()? as usize;
            if n > MAX_NODE_NAME {
                return Err(wire(format!("node name of {n} bytes")));
            }
            let name = r.bytes(n)?;
            let node =
                String::from_utf8(name).map_err(|_| wire("node name is not UTF-8".into()))?;
            let n = r.u8()? as usize;
            if n > MAX_NODE_NAME {
                return Err(wire(format!("address of {n} bytes")));
            }
            let addr =
                String::from_utf8(r.bytes(n)?).map_err(|_| wire("address is not UTF-8".into()))?;
            Frame::Hello {
                version,
                node,
                addr,
                nonce: r.array()?,
                proof: r.array()?,
            }
        }
        code::AUTH => Frame::Auth { proof: r.array()? },
        code::OPEN => {
            let chan = r.u32()?;
            let digest = r.array()?;
            let blob_size = r.u64()?;
            let piece_size = r.u64()?;
            validate_geometry(blob_size, piece_size)?;
            Frame::Open {
                chan,
                digest,
                blob_size,
                piece_size,
            }
        }
        code::CLOSE => Frame::Close { chan: r.u32()? },
        code::BITFIELD => {
            let chan = r.u32()?;
            let count = r.u32()?;
            if count > MAX_PIECES {
                return Err(wire(format!("bitfield of {count} pieces")));
            }
            let bits = r.bytes((count as usize).div_ceil(8))?;
            Frame::Bitfield {
                chan,
                have: Bitfield::from_bytes(bits, count)?,
            }
        }
        code::COMPLETE => Frame::Complete { chan: r.u32()? },
        code::NOT_HELD => Frame::NotHeld { chan: r.u32()? },
        code::HAVE => {
            let chan = r.u32()?;
            let piece = r.u32()?;
            let hash = match r.u8()? {
                0 => None,
                1 => Some(PieceHash(r.array()?)),
                other => return Err(wire(format!("HAVE hash flag {other}"))),
            };
            Frame::Have { chan, piece, hash }
        }
        code::REQUEST => {
            let chan = r.u32()?;
            let piece = r.u32()?;
            let urgent = match r.u8()? {
                0 => false,
                1 => true,
                other => return Err(wire(format!("request flag {other}"))),
            };
            Frame::Request {
                chan,
                piece,
                urgent,
            }
        }
        code::CANCEL => Frame::Cancel {
            chan: r.u32()?,
            piece: r.u32()?,
        },
        code::REJECT => Frame::Reject {
            chan: r.u32()?,
            piece: r.u32()?,
            reason: RejectReason::from_code(r.u8()?)?,
        },
        code::DATA => {
            let chan = r.u32()?;
            let piece = r.u32()?;
            let offset = r.u32()?;
            let len = r.u32()?;
            if len == 0 || len > MAX_DATA_CHUNK {
                return Err(wire(format!("data chunk of {len} bytes")));
            }
            Frame::Data {
                chan,
                piece,
                offset,
                len,
            }
        }
        code::HASHES_REQUEST => Frame::HashesRequest { chan: r.u32()? },
        code::HASHES => {
            let chan = r.u32()?;
            let first = r.u32()?;
            let n = r.u16()? as usize;
            if n > MAX_HASHES_PER_FRAME || first as u64 + n as u64 > MAX_PIECES as u64 {
                return Err(wire(format!("{n} hashes from {first}")));
            }
            let mut hashes = Vec::with_capacity(n);
            for _ in 0..n {
                hashes.push(PieceHash(r.array()?));
            }
            Frame::Hashes {
                chan,
                first,
                hashes,
            }
        }
        code::PING => Frame::Ping { nonce: r.u64()? },
        code::PONG => Frame::Pong { nonce: r.u64()? },
        code::GOODBYE => {
            let n = r.u16()? as usize;
            if n > MAX_GOODBYE {
                return Err(wire(format!("goodbye reason of {n} bytes")));
            }
            // Invalid UTF-8 is replaced, which can triple the length: cut again.
            let reason = String::from_utf8_lossy(&r.bytes(n)?).into_owned();
            Frame::Goodbye {
                reason: cut(&reason, MAX_GOODBYE).to_owned(),
            }
        }
        code::HAVE_FILTER => {
            let chan = r.u32()?;
            let (modulus, residue) = (r.u32()?, r.u32()?);
            if modulus > MAX_PIECES || (modulus > 1 && residue >= modulus) {
                return Err(wire(format!("HAVE filter {residue} mod {modulus}")));
            }
            Frame::HaveFilter {
                chan,
                filter: crate::links::HaveFilter { modulus, residue },
            }
        }
        other => return Err(wire(format!("unknown frame type {other}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(f: Frame) {
        let mut b = BytesMut::new();
        f.encode(&mut b);
        let mut partial = BytesMut::from(&b[..b.len() - 1]);
        assert_eq!(
            Frame::decode(&mut partial).unwrap(),
            None,
            "{f:?} needs its last byte"
        );
        let got = Frame::decode(&mut b).unwrap().unwrap();
        assert_eq!(got, f);
        assert!(b.is_empty());
    }

    #[test]
    fn every_frame_roundtrips() {
        let mut bits = Bitfield::new(13);
        bits.set(3);
        bits.set(12);
        for f in [
            Frame::Hello {
                version: 1,
                node: "node-7".into(),
                addr: "10.0.0.7:5051".into(),
                nonce: [7; 16],
                proof: [9; 32],
            },
            Frame::Auth { proof: [1; 32] },
            Frame::HaveFilter {
                chan: 3,
                filter: crate::links::HaveFilter {
                    modulus: 32,
                    residue: 31,
                },
            },
            Frame::Open {
                chan: 3,
                digest: [5; 32],
                blob_size: 10 << 20,
                piece_size: 1 << 20,
            },
            Frame::Close { chan: 3 },
            Frame::Bitfield {
                chan: 3,
                have: bits,
            },
            Frame::Complete { chan: 1 },
            Frame::NotHeld { chan: 1 },
            Frame::Have {
                chan: 1,
                piece: 9,
                hash: Some(PieceHash::of(b"x")),
            },
            Frame::Have {
                chan: 1,
                piece: 9,
                hash: None,
            },
            Frame::Request {
                chan: 1,
                piece: 2,
                urgent: true,
            },
            Frame::Cancel { chan: 1, piece: 2 },
            Frame::Reject {
                chan: 1,
                piece: 2,
                reason: RejectReason::Busy,
            },
            Frame::Data {
                chan: 1,
                piece: 2,
                offset: 4096,
                len: 65536,
            },
            Frame::HashesRequest { chan: 4 },
            Frame::Hashes {
                chan: 4,
                first: 10,
                hashes: vec![PieceHash::of(b"a"), PieceHash::of(b"b")],
            },
            Frame::Ping { nonce: 42 },
            Frame::Pong { nonce: 42 },
            Frame::Goodbye {
                reason: "bye".into(),
            },
        ] {
            roundtrip(f);
        }
    }

    #[test]
    fn hostile_frames_are_errors_not_allocations() {
        let mut huge = BytesMut::from(&[0xff, 0xff, 0xff, 0xff, code::DATA][..]);
        assert!(Frame::decode(&mut huge).is_err(), "4 GiB frame");
        let mut open = BytesMut::new();
        Frame::Open {
            chan: 1,
            digest: [0; 32],
            blob_size: 1 << 20,
            piece_size: 1 << 40,
        }
        .encode(&mut open);
        assert!(Frame::decode(&mut open).is_err(), "2^40-byte pieces");
        let mut data = BytesMut::new();
        Frame::Data {
            chan: 1,
            piece: 0,
            offset: 0,
            len: MAX_DATA_CHUNK + 1,
        }
        .encode(&mut data);
        assert!(Frame::decode(&mut data).is_err(), "oversized chunk");
        let mut bf = BytesMut::new();
        bf.put_u32(9);
        bf.put_u8(code::BITFIELD);
        bf.put_u32(1);
        bf.put_u32(u32::MAX);
        assert!(Frame::decode(&mut bf).is_err(), "bitfield count");
        for (modulus, residue) in [(4, 4), (4, u32::MAX), (MAX_PIECES + 1, 0)] {
            let mut f = BytesMut::new();
            f.put_u32(13);
            f.put_u8(code::HAVE_FILTER);
            f.put_u32(1);
            f.put_u32(modulus);
            f.put_u32(residue);
            assert!(
                Frame::decode(&mut f).is_err(),
                "filter {residue} mod {modulus}"
            );
        }
        let mut trailing = BytesMut::new();
        trailing.put_u32(6);
        trailing.put_u8(code::CLOSE);
        trailing.put_u32(1);
        trailing.put_u8(0);
        assert!(Frame::decode(&mut trailing).is_err());
        let mut unknown = BytesMut::from(&[0, 0, 0, 1, 200][..]);
        assert!(Frame::decode(&mut unknown).is_err());
    }

    /// Found by the `frame_roundtrip` fuzz target: names and reasons past their
    /// bounds were cut in the middle of a character, and the frame did not decode.
    #[test]
    fn long_names_and_reasons_are_cut_on_a_character_boundary() {
        let node = "é".repeat(150);
        let mut b = BytesMut::new();
        Frame::Hello {
            version: 1,
            node: node.clone(),
            addr: node.clone(),
            nonce: [0; 16],
            proof: [0; 32],
        }
        .encode(&mut b);
        match Frame::decode(&mut b) {
            Ok(Some(Frame::Hello {
                node: got, addr, ..
            })) => {
                assert_eq!(got, "é".repeat(MAX_NODE_NAME / 2));
                assert_eq!(addr, got);
            }
            other => panic!("{other:?}"),
        }
        let reason = "→".repeat(400);
        let mut b = BytesMut::new();
        Frame::Goodbye {
            reason: reason.clone(),
        }
        .encode(&mut b);
        match Frame::decode(&mut b) {
            Ok(Some(Frame::Goodbye { reason: got })) => {
                assert_eq!(got, "→".repeat(MAX_GOODBYE / 3));
            }
            other => panic!("{other:?}"),
        }
    }

    /// Found reviewing the decoder, confirmed by the `frame_decode` check on
    /// crafted inputs (now in its corpus): a Hello could carry a 254- or 255-byte
    /// name, and a Goodbye of 1024 invalid bytes decoded to a 3072-byte reason;
    /// neither re-encoded to what was received.
    #[test]
    fn decoded_names_and_reasons_stay_within_their_bounds() {
        let mut hello = BytesMut::new();
        hello.put_u32(1 + 2 + 1 + 254 + 16 + 32);
        hello.put_u8(code::HELLO);
        hello.put_u16(1);
        hello.put_u8(254);
        hello.put_slice(&[b'a'; 254]);
        hello.put_slice(&[0; 48]);
        assert!(Frame::decode(&mut hello).is_err(), "254-byte name");
        let mut bye = BytesMut::new();
        bye.put_u32(1 + 2 + 1024);
        bye.put_u8(code::GOODBYE);
        bye.put_u16(1024);
        bye.put_slice(&[0xff; 1024]);
        let Ok(Some(Frame::Goodbye { reason })) = Frame::decode(&mut bye) else {
            panic!("a goodbye with an invalid reason is still a goodbye");
        };
        assert_eq!(reason, "\u{fffd}".repeat(MAX_GOODBYE / 3));
    }
}
