//! HTTP `Range: bytes=` parsing and resolution against a known length (RFC 9110 §14).
//! Pure logic: the mirror decides 206, 416 or multipart from the result.
//!
//! A response body is never larger than the blob: [`resolve`] sorts and coalesces
//! overlapping and adjacent ranges, and answers with the whole blob as one range when
//! what is left would be more than [`MAX_RANGES`] parts or a multipart body no smaller
//! than the blob itself. RFC 9110 §14.2 lets a server coalesce ranges and ignore a
//! Range it does not want to honour; answering the whole representation is always
//! correct for the client, where a 416 would make a client that asked for real bytes
//! fail.

use crate::Error;

/// More range specs than this in one header is treated as abuse (400): no client
/// needs them, and each costs parsing and sorting.
pub const MAX_RANGE_SPECS: usize = 64;

/// At most this many parts in a multipart answer, after coalescing; more and the
/// whole blob is sent instead.
pub const MAX_RANGES: usize = 16;

/// An upper bound of the bytes a multipart answer adds per part: boundary line,
/// `Content-Type` and a `Content-Range` with three 20-digit numbers. [`resolve`]
/// budgets this much per part when it checks a multipart body against the blob size.
pub const MULTIPART_PART_OVERHEAD: u64 = 192;

/// The multipart body's closing boundary line, bounded the same way.
pub const MULTIPART_CLOSE_OVERHEAD: u64 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeSpec {
    /// `a-b` (inclusive) or `a-` (to the end).
    From { start: u64, end: Option<u64> },
    /// `-n`: the last n bytes.
    Suffix(u64),
}

/// An inclusive byte interval that lies inside the representation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub start: u64,
    pub end: u64,
}

impl ByteRange {
    pub fn len(&self) -> u64 {
        self.end - self.start + 1
    }
    pub fn is_empty(&self) -> bool {
        false
    }
    pub fn content_range(&self, total: u64) -> String {
        format!("bytes {}-{}/{}", self.start, self.end, total)
    }
}

/// A piece of a `multipart/byteranges` body (RFC 9110 §14.6): framing text, or the
/// bytes of one range of the blob, which the server sends from wherever it keeps them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MultipartPiece {
    Framing(String),
    Range(ByteRange),
}

impl MultipartPiece {
    pub fn len(&self) -> u64 {
        match self {
            MultipartPiece::Framing(t) => t.len() as u64,
            MultipartPiece::Range(r) => r.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Longest boundary used (RFC 2046 §5.1.1 allows 70): with three 20-digit numbers a
/// part's framing is 133 bytes plus the boundary, so this keeps every part within
/// [`MULTIPART_PART_OVERHEAD`], which [`resolve`] budgets.
pub const MAX_BOUNDARY: usize = 56;

/// The `Content-Type` of a multipart answer with `boundary`.
pub fn multipart_content_type(boundary: &str) -> String {
    format!("multipart/byteranges; boundary={boundary}")
}

/// The body of a multipart answer: for each range a boundary line, its headers and its
/// bytes, then the closing boundary. The one framing both servers (the agent and
/// `serve-oci`) use. `boundary` is cut to [`MAX_BOUNDARY`].
pub fn multipart_byteranges(
    ranges: &[ByteRange],
    total: u64,
    boundary: &str,
) -> Vec<MultipartPiece> {
    let boundary = &boundary[..boundary.len().min(MAX_BOUNDARY)];
    let mut out = Vec::with_capacity(ranges.len() * 2 + 1);
    for (i, r) in ranges.iter().enumerate() {
        let lead = if i == 0 { "" } else { "\r\n" };
        out.push(MultipartPiece::Framing(format!(
            "{lead}--{boundary}\r\nContent-Type: application/octet-stream\r\nContent-Range: {}\r\n\r\n",
            r.content_range(total)
        )));
        out.push(MultipartPiece::Range(*r));
    }
    out.push(MultipartPiece::Framing(format!("\r\n--{boundary}--\r\n")));
    out
}

/// Parses the header value. Anything that is not `bytes=` with well-formed specs is an
/// error (the mirror answers 400 rather than silently ignoring a Range it cannot read),
/// and so are more than [`MAX_RANGE_SPECS`] specs.
pub fn parse(header: &str) -> Result<Vec<RangeSpec>, Error> {
    let header = header.trim();
    if header.len() > 4096 {
        return Err(Error::RangeInvalid("Range header too long".into()));
    }
    let Some(specs) = header.strip_prefix("bytes=") else {
        return Err(Error::RangeInvalid(format!(
            "unsupported range unit in {header:.60}"
        )));
    };
    let mut out = Vec::new();
    for raw in specs.split(',') {
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let Some((a, b)) = raw.split_once('-') else {
            return Err(Error::RangeInvalid(format!("malformed range {raw:.60}")));
        };
        let num = |s: &str| -> Result<u64, Error> {
            if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
                return Err(Error::RangeInvalid(format!("malformed range {raw:.60}")));
            }
            s.parse::<u64>()
                .map_err(|_| Error::RangeInvalid(format!("range value out of bounds in {raw:.60}")))
        };
        let spec = match (a.trim(), b.trim()) {
            ("", n) => RangeSpec::Suffix(num(n)?),
            (s, "") => RangeSpec::From {
                start: num(s)?,
                end: None,
            },
            (s, e) => {
                let (s, e) = (num(s)?, num(e)?);
                if e < s {
                    return Err(Error::RangeInvalid(format!(
                        "range end before start in {raw:.60}"
                    )));
                }
                RangeSpec::From {
                    start: s,
                    end: Some(e),
                }
            }
        };
        out.push(spec);
        if out.len() > MAX_RANGE_SPECS {
            return Err(Error::RangeInvalid(format!(
                "more than {MAX_RANGE_SPECS} ranges"
            )));
        }
    }
    if out.is_empty() {
        return Err(Error::RangeInvalid("empty range set".into()));
    }
    Ok(out)
}

/// Resolves specs against a representation of `total` bytes: ends are clamped, specs
/// that cannot be satisfied are dropped, and the rest are sorted and coalesced (see the
/// module doc). An empty result means 416. Otherwise the ranges are disjoint, ascending,
/// at most [`MAX_RANGES`], cover every satisfiable byte asked for, and their bytes plus
/// the multipart overhead of more than one part never exceed `total`.
pub fn resolve(specs: &[RangeSpec], total: u64) -> Vec<ByteRange> {
    let mut ranges: Vec<ByteRange> = specs
        .iter()
        .filter_map(|s| match *s {
            RangeSpec::From { start, end } => {
                if start >= total {
                    return None;
                }
                let end = end.map_or(total - 1, |e| e.min(total - 1));
                Some(ByteRange { start, end })
            }
            RangeSpec::Suffix(n) => {
                if n == 0 || total == 0 {
                    return None;
                }
                Some(ByteRange {
                    start: total.saturating_sub(n),
                    end: total - 1,
                })
            }
        })
        .collect();
    if ranges.len() <= 1 {
        return ranges;
    }
    ranges.sort_by_key(|r| (r.start, r.end));
    let mut merged: Vec<ByteRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match merged.last_mut() {
            Some(last) if r.start <= last.end.saturating_add(1) => {
                last.end = last.end.max(r.end);
            }
            _ => merged.push(r),
        }
    }
    if merged.len() > 1 {
        let parts = merged.len() as u64;
        let payload: u64 = merged.iter().map(ByteRange::len).sum();
        let overhead = parts * MULTIPART_PART_OVERHEAD + MULTIPART_CLOSE_OVERHEAD;
        if merged.len() > MAX_RANGES || payload.saturating_add(overhead) >= total {
            return vec![ByteRange {
                start: 0,
                end: total - 1,
            }];
        }
    }
    merged
}

#[cfg(test)]
mod tests {

    #[test]
    fn multipart_framing_is_exact_and_within_the_budgeted_overhead() {
        let total = u64::MAX / 2;
        let ranges = [
            ByteRange { start: 0, end: 9 },
            ByteRange {
                start: total - 10,
                end: total - 1,
            },
        ];
        let boundary = "b".repeat(100);
        let pieces = multipart_byteranges(&ranges, total, &boundary);
        assert_eq!(pieces.len(), 5);
        let mut body = String::new();
        for p in &pieces {
            match p {
                MultipartPiece::Framing(t) => {
                    assert!(t.len() as u64 <= MULTIPART_PART_OVERHEAD);
                    body.push_str(t);
                }
                MultipartPiece::Range(r) => body.push_str(&"x".repeat(r.len() as usize)),
            }
        }
        let b = &boundary[..MAX_BOUNDARY];
        assert!(body.starts_with(&format!("--{b}\r\n")));
        assert!(body.ends_with(&format!("\r\n--{b}--\r\n")));
        assert_eq!(body.matches(&format!("--{b}\r\n")).count(), 2);
        let len: u64 = pieces.iter().map(MultipartPiece::len).sum();
        assert_eq!(len, body.len() as u64);
    }

    use super::*;
    use proptest::prelude::*;

    fn r(h: &str, total: u64) -> Vec<(u64, u64)> {
        resolve(&parse(h).unwrap(), total)
            .iter()
            .map(|b| (b.start, b.end))
            .collect()
    }

    #[test]
    fn spec_examples() {
        assert_eq!(r("bytes=500-1499", 4000), vec![(500, 1499)]);
        assert_eq!(r("bytes=500-", 4000), vec![(500, 3999)]);
        assert_eq!(r("bytes=-500", 4000), vec![(3500, 3999)]);
        assert_eq!(r("bytes=2000-5000", 4000), vec![(2000, 3999)]);
        assert_eq!(r("bytes=-5000", 4000), vec![(0, 3999)]);
        assert!(r("bytes=4000-", 4000).is_empty());
        assert!(r("bytes=-0", 4000).is_empty());
        assert_eq!(r("bytes=0-1, 1000-1019", 4000), vec![(0, 1), (1000, 1019)]);
        assert_eq!(r("bytes=0-0", 1), vec![(0, 0)]);
    }

    #[test]
    fn overlapping_adjacent_and_near_ranges_coalesce() {
        let whole = format!("bytes={}", vec!["0-4194303"; 64].join(","));
        assert_eq!(r(&whole, 4 << 20), vec![(0, (4 << 20) - 1)]);
        assert_eq!(
            r("bytes=1000-1999,1500-2999,0-9", 10_000),
            vec![(0, 9), (1000, 2999)]
        );
        assert_eq!(r("bytes=0-9,10-19", 10_000), vec![(0, 19)]);
        assert_eq!(r("bytes=0-9,100-109", 10_000), vec![(0, 9), (100, 109)]);
        assert_eq!(r("bytes=1000-1009,0-9", 10_000), vec![(0, 9), (1000, 1009)]);
    }

    #[test]
    fn too_many_parts_or_no_saving_means_the_whole_blob() {
        let many: Vec<String> = (0..17)
            .map(|i| format!("{}-{}", i * 1000, i * 1000 + 9))
            .collect();
        let h = format!("bytes={}", many.join(","));
        assert_eq!(r(&h, 1_000_000), vec![(0, 999_999)]);
        let sixteen = format!("bytes={}", many[..16].join(","));
        assert_eq!(r(&sixteen, 1_000_000).len(), 16);
        // Two parts on a small blob would cost more than the blob itself.
        assert_eq!(r("bytes=0-0,300-300", 400), vec![(0, 399)]);
    }

    #[test]
    fn malformed() {
        for h in [
            "items=0-1",
            "bytes=",
            "bytes=a-b",
            "bytes=5-1",
            "bytes=1",
            "bytes=--1",
            "bytes=99999999999999999999999-",
            "bytes= - ",
        ] {
            assert!(parse(h).is_err(), "{h}");
        }
        let many = format!("bytes={}", vec!["0-1"; MAX_RANGE_SPECS + 1].join(","));
        assert!(parse(&many).is_err());
        let ok = format!("bytes={}", vec!["0-1"; MAX_RANGE_SPECS].join(","));
        assert!(parse(&ok).is_ok());
    }

    fn spec() -> impl Strategy<Value = RangeSpec> {
        prop_oneof![
            (0u64..5000, proptest::option::of(0u64..5000)).prop_map(|(a, b)| RangeSpec::From {
                start: a,
                end: b.map(|b| a + b),
            }),
            (0u64..6000).prop_map(RangeSpec::Suffix),
            // Values near the top of u64 must not overflow anything.
            (u64::MAX - 10..=u64::MAX).prop_map(|a| RangeSpec::From {
                start: a,
                end: None
            }),
            (0u64..10).prop_map(|a| RangeSpec::From {
                start: a,
                end: Some(u64::MAX)
            }),
        ]
    }

    /// The bytes each satisfiable spec asks for, as the RFC defines them.
    fn wanted(s: &RangeSpec, total: u64) -> Option<(u64, u64)> {
        match *s {
            RangeSpec::From { start, .. } if start >= total => None,
            RangeSpec::From { start, end } => {
                Some((start, end.map_or(total - 1, |e| e.min(total - 1))))
            }
            RangeSpec::Suffix(0) => None,
            RangeSpec::Suffix(_) if total == 0 => None,
            RangeSpec::Suffix(n) => Some((total.saturating_sub(n), total - 1)),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn resolved_ranges_are_bounded_disjoint_and_cover_the_request(
            specs in proptest::collection::vec(spec(), 1..=MAX_RANGE_SPECS),
            total in 0u64..8000,
        ) {
            let out = resolve(&specs, total);
            let asked: Vec<(u64, u64)> = specs.iter().filter_map(|s| wanted(s, total)).collect();
            // 416 exactly when nothing asked for exists.
            prop_assert_eq!(out.is_empty(), asked.is_empty());
            prop_assert!(out.len() <= MAX_RANGES);
            for r in &out {
                prop_assert!(r.start <= r.end && r.end < total);
            }
            for w in out.windows(2) {
                prop_assert!(w[0].end + 1 < w[1].start, "disjoint, ascending, not adjacent");
            }
            let payload: u64 = out.iter().map(ByteRange::len).sum();
            prop_assert!(payload <= total, "payload {} > blob {}", payload, total);
            if out.len() > 1 {
                let overhead = out.len() as u64 * MULTIPART_PART_OVERHEAD + MULTIPART_CLOSE_OVERHEAD;
                prop_assert!(payload + overhead < total, "a multipart body is smaller than the blob");
            }
            for (a, b) in asked {
                prop_assert!(
                    out.iter().any(|r| r.start <= a && b <= r.end),
                    "bytes {}-{} asked for are covered by {:?}", a, b, out
                );
            }
        }

        #[test]
        fn parse_never_panics_and_bounds_the_spec_count(h in "bytes=[0-9,\\- ]{0,600}") {
            if let Ok(specs) = parse(&h) {
                prop_assert!(!specs.is_empty() && specs.len() <= MAX_RANGE_SPECS);
            }
        }
    }
}
