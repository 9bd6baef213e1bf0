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
}
