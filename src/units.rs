//! Byte sizes in IEC units: the one place they are formatted and parsed.

/// Formats a byte count with IEC binary prefixes ("1.50 GiB"); exact bytes under 1 KiB.
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// `part` as a percentage of `whole`; 0 when `whole` is 0 (no capacity
/// known).
pub fn percent_of(part: f64, whole: u64) -> f64 {
    match whole {
        0 => 0.0,
        w => part / w as f64 * 100.0,
    }
}

/// A change in percent, signed, one decimal: `+12.5%`, `-0.3%`.
pub fn fmt_signed_pct(p: f64) -> String {
    format!("{p:+.1}%")
}

/// A signed size: `+1.00 MiB`, `-1.00 MiB` (a margin, a difference).
pub fn fmt_signed_bytes(b: i64) -> String {
    match b < 0 {
        true => format!("-{}", fmt_bytes(b.unsigned_abs())),
        false => format!("+{}", fmt_bytes(b as u64)),
    }
}

/// The unit [`fmt_bytes`] writes `bytes` in, and that unit's size in
/// bytes: a column of sizes can then name its unit once, in its header.
pub fn iec_unit(bytes: u64) -> (&'static str, u64) {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let (mut unit, mut size) = (0, 1u64);
    while unit + 1 < UNITS.len() && bytes / size >= 1024 {
        size *= 1024;
        unit += 1;
    }
    (UNITS[unit], size)
}

/// Parses "512MiB", "2GiB", "1.5 GiB", "4096" (bytes), "2GB" (decimal) into bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| {
        format!("`{text}` is not a size: expected a number with a unit, like 512MiB or 2GiB")
    })?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "tib" | "t" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "`{text}` has an unknown unit `{other}`: use B, KiB, MiB, GiB or TiB"
            ));
        }
    };
    let out_of_range = || format!("`{text}` is out of range: a size is below 2^64 bytes (16 EiB)");
    // Whole numbers exactly: an f64 rounds 2^64 - 1 up to 2^64, which
    // `as u64` would then saturate into "no limit" instead of refusing.
    if let Ok(whole) = num.parse::<u128>() {
        return whole
            .checked_mul(mult as u128)
            .and_then(|b| u64::try_from(b).ok())
            .ok_or_else(out_of_range);
    }
    let bytes = value * mult;
    // 2^64 as f64: `u64::MAX as f64` is 2^64 too, so compare with >=.
    if !bytes.is_finite() || !(0.0..18_446_744_073_709_551_616.0).contains(&bytes) {
        return Err(out_of_range());
    }
    Ok(bytes.round() as u64)
}

/// A byte size written as `--host-memory` takes it (`64GiB`, `512MiB`),
/// checked as the scalar is read so that its error is located.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl serde::Serialize for Bytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Bytes;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a size such as 64GiB or 512MiB")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Bytes, E> {
                parse_bytes(v)
                    .and_then(positive_bytes)
                    .map(Bytes)
                    .map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Bytes, E> {
                positive_bytes(v).map(Bytes).map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// A capacity of zero bytes holds nothing: refused where it is given.
pub fn positive_bytes(b: u64) -> Result<u64, String> {
    match b {
        0 => Err("must be more than 0 bytes".into()),
        b => Ok(b),
    }
}

/// Seconds since the Unix epoch now (0 on a clock set before it).
pub fn now_unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The UTC (year, month, day, hour, minute, second) of `unix_s` seconds
/// since 1970, by Howard Hinnant's days-to-civil algorithm (the proleptic
/// Gregorian calendar in 400-year eras of 146,097 days, years starting in
/// March so that the leap day comes last).
pub fn utc_civil(unix_s: u64) -> (i64, u64, u64, u64, u64, u64) {
    let days = (unix_s / 86_400) as i64 + 719_468; // days since 0000-03-01
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    let secs = unix_s % 86_400;
    (
        year,
        month as u64,
        day as u64,
        secs / 3_600,
        secs / 60 % 60,
        secs % 60,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages() {
        assert_eq!(percent_of(20.0, 80), 25.0);
        assert_eq!(percent_of(5.0, 0), 0.0, "no capacity known");
        assert_eq!(fmt_signed_pct(12.54), "+12.5%");
        assert_eq!(fmt_signed_pct(-0.3), "-0.3%");
        assert_eq!(fmt_signed_pct(0.0), "+0.0%");
    }

    #[test]
    fn iec_unit_is_the_unit_fmt_bytes_writes() {
        for b in [
            0,
            1023,
            1024,
            5 << 20,
            (1 << 30) - 1,
            70 << 30,
            3 << 40,
            u64::MAX,
        ] {
            let (unit, size) = iec_unit(b);
            assert!(fmt_bytes(b).ends_with(&format!(" {unit}")), "{b}: {unit}");
            assert!(b < 1024 || b / size >= 1, "{b}");
        }
        assert_eq!(iec_unit(70 << 30), ("GiB", 1 << 30));
        // The largest unit not above: what a chart axis up to `b` counts in.
        assert_eq!(iec_unit(1023), ("B", 1));
        assert_eq!(iec_unit(8 << 20), ("MiB", 1 << 20));
        assert_eq!(iec_unit((80 << 30) - 1), ("GiB", 1 << 30));
        assert_eq!(iec_unit(u64::MAX), ("EiB", 1 << 60));
    }

    #[test]
    fn formats_iec() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(1024), "1.00 KiB");
        assert_eq!(fmt_bytes(3 * 1024 * 1024 / 2), "1.50 MiB");
        assert_eq!(fmt_bytes(80 << 30), "80.00 GiB");
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("GiB").is_err());
    }
}
