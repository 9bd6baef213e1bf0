//! A swarm member as the Redis mode stores it (`st:{d}:members`): a compact binary
//! entry instead of JSON with a base64 bitfield (≈ 1,950 bytes for a 15,360-piece
//! bitfield instead of ≈ 2,600, and no JSON or base64 to decode when read back).
//!
//! ```text
//! [0]        format (1)
//! [1..9]     last_seen, u64 big-endian (wall-clock ms)
//! [9..11]    m = length of the shape, u16 big-endian
//! [11..11+m] shape: complete (u8), addr, zone, rack (each u16 length + bytes;
//!            0xFFFF = absent)
//! [11+m..]   bitfield: nothing (none), or pieces (u32 big-endian) + the bit array
//! ```
//!
//! The store's commit script compares the format byte and the shape of the stored
//! entry with the new one without decoding them ([`crate::redis_store`]'s `COMMIT`):
//! a changed shape (joined, address, topology, completion) is published to the
//! swarm's change stream at once, a changed bitfield or `last_seen` only every
//! heartbeat. Keep the layout of the first 11 bytes, or change the script with it.

use swarm::state::SharedPeer;
use swarm::{Bitfield, Topology};

/// The only format written; another first byte is not read.
const FORMAT: u8 = 1;
/// Bytes before the shape: format, last_seen, shape length.
const HEADER: usize = 11;
/// A string field's length that means "absent".
const ABSENT: u16 = u16::MAX;

/// The stored entry of `p`, or `None` when a field does not fit the format (an
/// address or topology label of 64 KiB or more; the announce's validation keeps them
/// far shorter).
pub fn encode(p: &SharedPeer) -> Option<Vec<u8>> {
    let mut shape = Vec::with_capacity(64);
    shape.push(u8::from(p.complete));
    put_str(&mut shape, Some(&p.addr))?;
    put_str(&mut shape, p.topology.zone.as_deref())?;
    put_str(&mut shape, p.topology.rack.as_deref())?;
    let shape_len = u16::try_from(shape.len()).ok()?;
    let bits = p.have.as_ref().map_or(0, |h| 4 + h.as_bytes().len());
    let mut out = Vec::with_capacity(HEADER + shape.len() + bits);
    out.push(FORMAT);
    out.extend_from_slice(&p.last_seen.to_be_bytes());
    out.extend_from_slice(&shape_len.to_be_bytes());
    out.extend_from_slice(&shape);
    if let Some(h) = &p.have {
        out.extend_from_slice(&h.len().to_be_bytes());
        out.extend_from_slice(h.as_bytes());
    }
    Some(out)
}

/// The member a stored entry describes; `None` for anything malformed (another
/// format, lengths that do not add up, a bitfield of the wrong size): Redis is
/// trusted no more than an agent.
pub fn decode(entry: &[u8]) -> Option<SharedPeer> {
    let mut r = Reader(entry);
    if r.u8()? != FORMAT {
        return None;
    }
    let last_seen = u64::from_be_bytes(r.take(8)?.try_into().ok()?);
    let shape_len = usize::from(r.u16()?);
    let mut shape = Reader(r.take(shape_len)?);
    let complete = match shape.u8()? {
        0 => false,
        1 => true,
        _ => return None,
    };
    let addr = shape.string()??;
    let zone = shape.string()?;
    let rack = shape.string()?;
    if !shape.0.is_empty() {
        return None;
    }
    let have = if r.0.is_empty() {
        None
    } else {
        let pieces = u32::from_be_bytes(r.take(4)?.try_into().ok()?);
        Some(Bitfield::from_bytes(r.0.to_vec(), pieces).ok()?)
    };
    Some(SharedPeer {
        addr,
        topology: Topology { zone, rack },
        have,
        complete,
        last_seen,
    })
}

fn put_str(out: &mut Vec<u8>, s: Option<&str>) -> Option<()> {
    match s {
        None => out.extend_from_slice(&ABSENT.to_be_bytes()),
        Some(s) => {
            let n = u16::try_from(s.len()).ok().filter(|n| *n != ABSENT)?;
            out.extend_from_slice(&n.to_be_bytes());
            out.extend_from_slice(s.as_bytes());
        }
    }
    Some(())
}

/// A cursor over untrusted bytes: every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    /// `Some(None)`: an absent field; `None`: malformed.
    fn string(&mut self) -> Option<Option<String>> {
        let n = self.u16()?;
        if n == ABSENT {
            return Some(None);
        }
        let bytes = self.take(usize::from(n))?;
        Some(Some(String::from_utf8(bytes.to_vec()).ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(pieces: Option<u32>) -> SharedPeer {
        SharedPeer {
            addr: "10.0.0.7:7070".into(),
            topology: Topology {
                zone: Some("eu-1a".into()),
                rack: None,
            },
            have: pieces.map(|n| {
                let mut b = Bitfield::new(n);
                for i in (0..n).step_by(3) {
                    b.set(i);
                }
                b
            }),
            complete: false,
            last_seen: 1_764_000_000_123,
        }
    }

    #[test]
    fn an_entry_reads_back_as_written() {
        for p in [member(Some(15_360)), member(Some(13)), member(None)] {
            let entry = encode(&p).expect("fits");
            assert_eq!(decode(&entry), Some(p));
        }
        let mut seeder = member(None);
        seeder.complete = true;
        seeder.topology.rack = Some("r7".into());
        assert_eq!(decode(&encode(&seeder).expect("fits")), Some(seeder));
    }

    #[test]
    fn the_entry_is_smaller_than_the_json_form() {
        let p = member(Some(15_360));
        let binary = encode(&p).expect("fits").len();
        let json = serde_json::to_vec(&p).expect("serialises").len();
        assert!(binary < json * 8 / 10, "{binary} bytes against {json}");
    }

    #[test]
    fn the_shape_sits_where_the_commit_script_compares_it() {
        // The script compares byte 0 and bytes 9..11+m; last_seen and the bitfield
        // may differ without the shape differing.
        let a = member(Some(64));
        let mut b = a.clone();
        b.last_seen += 5_000;
        b.have.as_mut().expect("bits").set(1);
        let shape = |e: &[u8]| {
            let m = usize::from(u16::from_be_bytes([e[9], e[10]]));
            [&e[..1], &e[9..HEADER + m]].concat()
        };
        let (ea, eb) = (encode(&a).expect("fits"), encode(&b).expect("fits"));
        assert_eq!(shape(&ea), shape(&eb));
        b.complete = true;
        assert_ne!(shape(&ea), shape(&encode(&b).expect("fits")));
    }

    #[test]
    fn malformed_entries_are_refused_without_panicking() {
        let good = encode(&member(Some(100))).expect("fits");
        for cut in 0..good.len() {
            // Every prefix but the one ending where the bitfield starts is malformed.
            let shape_end = HEADER + usize::from(u16::from_be_bytes([good[9], good[10]]));
            if cut != shape_end {
                assert_eq!(decode(&good[..cut]), None, "prefix of {cut} bytes");
            }
        }
        let mut other_format = good.clone();
        other_format[0] = b'{';
        assert_eq!(decode(&other_format), None);
        let mut long_shape = good.clone();
        long_shape[9] = 0xff;
        assert_eq!(decode(&long_shape), None);
        let mut wrong_pieces = good;
        let at = wrong_pieces.len() - 13 - 4;
        wrong_pieces[at..at + 4].copy_from_slice(&200u32.to_be_bytes());
        assert_eq!(
            decode(&wrong_pieces),
            None,
            "200 pieces need 25 bytes, not 13"
        );
        assert_eq!(decode(b""), None);
    }
}
