//! Byte sizes as operators type them: the one parser behind every size setting and
//! flag (the agent's configuration, the tracker's limits, the analyzer's thresholds,
//! the simulator's scenarios, the demo). Units are case-insensitive: `B`, `k`/`kB`,
//! `M`/`MB`, `G`/`GB`, `T`/`TB` are decimal, `KiB`/`Ki`, `MiB`/`Mi`, `GiB`/`Gi`,
//! `TiB`/`Ti` binary; a fraction is allowed (`1.5GiB`), a space before the unit too.

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

#[cfg(test)]
mod tests {
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
}
