//! HTTP `Range: bytes=` parsing and resolution against a known length (RFC 9110 §14).
//! Pure logic: the mirror decides 206, 416 or multipart from the result.

use crate::Error;

/// At most this many ranges in one request; more is treated as abuse (400).
pub const MAX_RANGES: usize = 64;

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

/// Parses the header value. Anything that is not `bytes=` with well-formed specs is an
/// error (the mirror answers 400 rather than silently ignoring a Range it cannot read).
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
        if out.len() > MAX_RANGES {
            return Err(Error::RangeInvalid(format!(
                "more than {MAX_RANGES} ranges"
            )));
        }
    }
    if out.is_empty() {
        return Err(Error::RangeInvalid("empty range set".into()));
    }
    Ok(out)
}

/// Resolves specs against a representation of `total` bytes, clamping ends; specs that
/// cannot be satisfied are dropped. An empty result means 416.
pub fn resolve(specs: &[RangeSpec], total: u64) -> Vec<ByteRange> {
    specs
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
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(r("bytes=0-1, 10-19", 4000), vec![(0, 1), (10, 19)]);
        assert_eq!(r("bytes=0-0", 1), vec![(0, 0)]);
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
        let many = format!("bytes={}", vec!["0-1"; 100].join(","));
        assert!(parse(&many).is_err());
    }
}
