//! Byte sizes as operators type them: the one parser behind every size setting and
//! flag (the agent's configuration, the tracker's limits, the analyzer's thresholds,
//! the simulator's scenarios, the demo). Units are case-insensitive: `B`, `k`/`kB`,
//! `M`/`MB`, `G`/`GB`, `T`/`TB` are decimal, `KiB`/`Ki`, `MiB`/`Mi`, `GiB`/`Gi`,
//! `TiB`/`Ti` binary; a fraction is allowed (`1.5GiB`), a space before the unit too.
//!
//! Why not the `bytesize` crate (read at 2.x): it accepts the same units, but its
//! parse error is a `String` (our errors are typed and name the setting), a value too
//! large for `u64` saturates silently where a configuration must be refused, and its
//! `Display` rounds (`1.1 GiB`), so a printed configuration would not read back to
//! the value in use. The parser here is ~40 lines with its own tests and fuzz target.

use crate::Error;

/// Parses `512MiB`, `2 GB`, `1.5GiB`, `4096`. Negative, non-finite or too large values
/// and unknown units are errors that name the input.
pub fn parse_size(s: &str) -> Result<u64, Error> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| Error::SizeInvalid(format!("{t:?}: expected a number, then a unit")))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "ki" | "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mi" | "mib" => 1_048_576.0,
        "g" | "gb" => 1e9,
        "gi" | "gib" => 1_073_741_824.0,
        "t" | "tb" => 1e12,
        "ti" | "tib" => 1_099_511_627_776.0,
        other => {
            return Err(Error::SizeInvalid(format!(
                "{t:?}: unknown unit {other:?} (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )))
        }
    };
    let bytes = (n * mult).round();
    if !bytes.is_finite() || bytes > u64::MAX as f64 {
        return Err(Error::SizeInvalid(format!("{t:?}: too large")));
    }
    Ok(bytes as u64)
}

/// Parses a rate in bytes per second, as operators and network people type it: bits
/// with a lower-case `b` or `bit` (`200Mbit/s`, `10Gbps`, `25Gb/s`, `10Gbit`, decimal
/// prefixes, or binary with `i`: `1Gib/s`), otherwise a size per second with
/// [`parse_size`]'s units (`50MiB/s`, `1.25GB/s`, `1000`). `/s` or `ps` may follow.
/// The one rate parser: the analyzer's bandwidths, the simulator's links.
pub fn parse_rate(s: &str) -> Result<f64, Error> {
    let t = s.trim();
    let bad = |why: &str| {
        Error::RateInvalid(format!(
            "{t:?}: {why} (use e.g. 200Mbit/s, 10Gbps, 50MiB/s, 1.25GB/s)"
        ))
    };
    let per = t
        .strip_suffix("/s")
        .or_else(|| t.strip_suffix("ps"))
        .unwrap_or(t)
        .trim_end();
    let split = per
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(per.len());
    let (num, unit) = per.split_at(split);
    let unit = unit.trim();
    let bits_prefix = unit
        .strip_suffix("bit")
        .or_else(|| unit.strip_suffix("Bit"))
        .or_else(|| unit.strip_suffix('b'));
    let rate = match bits_prefix {
        Some(prefix) => {
            let n: f64 = num
                .parse()
                .map_err(|_| bad("expected a number, then a unit"))?;
            let (binary, letter) = match prefix.strip_suffix('i') {
                Some(l) => (true, l),
                None => (false, prefix),
            };
            let exp = match letter {
                "" => 0,
                "k" | "K" => 1,
                "M" => 2,
                "G" => 3,
                "T" => 4,
                _ => return Err(bad("unknown rate unit")),
            };
            let base: f64 = if binary { 1024.0 } else { 1000.0 };
            n * base.powi(exp) / 8.0
        }
        None => parse_size(per).map_err(|_| bad("unknown rate unit"))? as f64,
    };
    if !(rate.is_finite() && rate > 0.0) {
        return Err(bad("must be positive"));
    }
    Ok(rate)
}

/// Renders a byte count for people, in binary units with two decimals: `812 B`,
/// `1.50 GiB`. The one formatter behind every report, table and log line.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// A byte count in configuration: read from what operators type (`"200GiB"`, `"1.5GB"`,
/// or a plain integer) when the configuration is loaded, so a bad value is an error at
/// start-up and code downstream holds a number. Written back exactly (`"200GiB"`,
/// `"1536KiB"`, `"1000"`), so a printed configuration reads back to the same value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

impl std::str::FromStr for ByteSize {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        parse_size(s).map(ByteSize)
    }
}

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const UNITS: [(u64, &str); 4] = [
            (1 << 40, "TiB"),
            (1 << 30, "GiB"),
            (1 << 20, "MiB"),
            (1 << 10, "KiB"),
        ];
        for (unit, name) in UNITS {
            if self.0 >= unit && self.0.is_multiple_of(unit) {
                return write!(f, "{}{name}", self.0 / unit);
            }
        }
        write!(f, "{}", self.0)
    }
}

impl serde::Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size such as \"200GiB\", \"512MB\" or a number of bytes")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("size {v} is negative")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// A size, or `"auto"`: a rule decides (the agent's piece size). Reads and writes
/// `"auto"` or what [`ByteSize`] does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SizeOrAuto {
    #[default]
    Auto,
    Size(ByteSize),
}

impl SizeOrAuto {
    /// The size, or `None` for the rule.
    pub fn bytes(self) -> Option<u64> {
        match self {
            SizeOrAuto::Auto => None,
            SizeOrAuto::Size(s) => Some(s.bytes()),
        }
    }
}

impl std::str::FromStr for SizeOrAuto {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(SizeOrAuto::Auto)
        } else {
            s.parse().map(SizeOrAuto::Size)
        }
    }
}

impl std::fmt::Display for SizeOrAuto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SizeOrAuto::Auto => f.write_str("auto"),
            SizeOrAuto::Size(s) => s.fmt(f),
        }
    }
}

impl serde::Serialize for SizeOrAuto {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for SizeOrAuto {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(SizeOrAuto::Size(ByteSize(n))),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_size_or_auto_reads_back_what_it_writes() {
        for (text, want) in [
            ("auto", SizeOrAuto::Auto),
            ("AUTO", SizeOrAuto::Auto),
            ("4MiB", SizeOrAuto::Size(ByteSize(4 << 20))),
        ] {
            let v: SizeOrAuto = text.parse().unwrap();
            assert_eq!(v, want);
            assert_eq!(v.to_string().parse::<SizeOrAuto>().unwrap(), v);
        }
        assert!("huge".parse::<SizeOrAuto>().is_err());
        assert_eq!(SizeOrAuto::Auto.bytes(), None);
        assert_eq!(SizeOrAuto::Size(ByteSize(7)).bytes(), Some(7));
    }

    #[test]
    fn rates_in_bits_or_bytes_per_second() {
        for (text, want) in [
            ("200Mbit/s", 25e6),
            ("10Gbps", 1.25e9),
            ("10Gbit", 1.25e9),
            ("25Gb/s", 3.125e9),
            ("1Gib/s", 1024.0 * 1024.0 * 1024.0 / 8.0),
            ("1.25GB/s", 1.25e9),
            ("50MiB/s", 50.0 * 1048576.0),
            ("100MiB/s", 104857600.0),
            ("1000", 1000.0),
            ("8 MiB/s", 8.0 * 1048576.0),
        ] {
            assert_eq!(parse_rate(text).unwrap(), want, "{text}");
        }
        for bad in ["fast", "5 furlongs/s", "0", "-1MB/s", "10Xbit/s", ""] {
            assert!(parse_rate(bad).is_err(), "{bad}");
        }
    }

    use super::*;

    #[test]
    fn units_fractions_and_bad_input() {
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2 GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("1.5kib").unwrap(), 1536);
        assert_eq!(parse_size(" 4096 ").unwrap(), 4096);
        assert_eq!(parse_size("10k").unwrap(), 10_000);
        for bad in [
            "",
            "MiB",
            "12 parsecs",
            "-1MiB",
            "1e3",
            "99999999999TiB",
            "1.2.3",
        ] {
            let e = parse_size(bad).expect_err(bad);
            assert!(e.to_string().contains("invalid size"), "{bad}: {e}");
        }
    }

    #[test]
    fn sizes_render_in_binary_units() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(format_size(1536), "1.50 KiB");
        assert_eq!(format_size(15 << 30), "15.00 GiB");
        assert_eq!(format_size(u64::MAX), "16384.00 PiB");
        // What the parser reads back is within the rounding of two decimals.
        let shown = format_size(1_610_612_736);
        assert_eq!(parse_size(&shown).expect("parses"), 1_610_612_736);
    }

    #[test]
    fn byte_sizes_read_and_write_back_exactly() {
        for (typed, bytes, shown) in [
            ("200GiB", 200u64 << 30, "200GiB"),
            ("1.5KiB", 1536, "1536"),
            ("1536KiB", 1536 << 10, "1536KiB"),
            ("2GB", 2_000_000_000, "1953125KiB"),
            ("0", 0, "0"),
        ] {
            let b: ByteSize = typed.parse().expect("parses");
            assert_eq!(b.bytes(), bytes, "{typed}");
            assert_eq!(b.to_string(), shown);
            assert_eq!(b.to_string().parse::<ByteSize>().expect("reads back"), b);
        }
        assert_eq!(ByteSize(1536 << 10).to_string(), "1536KiB");
        assert_eq!(ByteSize(3 << 20).to_string(), "3MiB");
        #[derive(serde::Deserialize)]
        struct C {
            a: ByteSize,
            b: ByteSize,
        }
        let c: C = serde_json::from_str(r#"{"a": "1MiB", "b": 4096}"#).expect("json");
        assert_eq!((c.a.bytes(), c.b.bytes()), (1 << 20, 4096));
        let bad = serde_json::from_str::<C>(r#"{"a": "1 parsec", "b": 1}"#)
            .err()
            .expect("refused")
            .to_string();
        assert!(bad.contains("unknown unit"), "{bad}");
    }
}
