//! Sizes as people write them on command lines (`512MiB`, `1.5TB`, `139 GiB`),
//! parsed in one place for every flag that takes one (`--kv-cache-memory`,
//! `caracal plan --memory`).

/// A size that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not a size: {why} (examples: 512MiB, 2GiB, 1.5TB, 12345)")]
pub struct SizeError {
    /// What was given.
    pub input: String,
    /// What is wrong with it.
    pub why: &'static str,
}

/// Parses a byte count: a number (decimals allowed) and an optional unit,
/// decimal (`B`, `K`/`KB`, `M`/`MB`, `G`/`GB`, `T`/`TB`) or binary (`KiB`,
/// `MiB`, `GiB`, `TiB`), case-insensitive, spaces allowed around the unit.
/// Zero, negative and non-finite sizes are refused.
pub fn parse_bytes(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let err = |why| SizeError {
        input: s.to_string(),
        why,
    };
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (t[..split].trim(), t[split..].trim());
    let value: f64 = num.parse().map_err(|_| err("no number"))?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        _ => return Err(err("unknown unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")),
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes > u64::MAX as f64 {
        return Err(err("too large"));
    }
    if bytes < 1.0 {
        return Err(err("must be at least one byte"));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_decimal_and_binary_units() {
        assert_eq!(parse_bytes("512GB").unwrap(), 512_000_000_000);
        assert_eq!(parse_bytes("139 GiB").unwrap(), 139 * (1 << 30));
        assert_eq!(parse_bytes("2TiB").unwrap(), 2 << 40);
        assert_eq!(parse_bytes("1TB").unwrap(), 1_000_000_000_000);
        assert_eq!(parse_bytes("1.5tb").unwrap(), 1_500_000_000_000);
        assert_eq!(parse_bytes("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_bytes("64k").unwrap(), 64_000);
        assert_eq!(parse_bytes("12345").unwrap(), 12345);
    }

    #[test]
    fn refuses_what_is_not_a_size() {
        for bad in ["lots", "5 parsecs", "", "0", "0.1", "-3GB", "1e400"] {
            let e = parse_bytes(bad).unwrap_err();
            assert_eq!(e.input, bad);
            assert!(e.to_string().contains("is not a size"), "{e}");
        }
    }
}
