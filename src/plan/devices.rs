//! Device strings for the memory planner: `8xH200`, `2×B300`, `cpu` (with a
//! `--memory` override), and byte strings such as `512GB` or `480GiB`.
//!
//! Memory per device is the vendor's decimal figure (`H200` = 141e9 B). That
//! is conservative: `nvidia-smi` reports about 143,771 MiB (≈150.8e9 B,
//! ≈140 GiB) total on an H200, of which ~139 GiB can be allocated. Pass
//! `--memory 139GiB` to plan against the measured figure instead.

use serde::Serialize;

use crate::error::{Error, Result};

/// An accelerator (or host) kind the planner knows the memory of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum DeviceKind {
    /// NVIDIA H200, 141 GB HBM3e.
    H200,
    /// NVIDIA H100 SXM, 80 GB.
    H100,
    /// NVIDIA B200, 192 GB.
    B200,
    /// NVIDIA B300, 288 GB.
    B300,
    /// AMD Instinct MI355X, 288 GB.
    MI355X,
    /// NVIDIA A100, 80 GB.
    A100,
    /// NVIDIA GeForce RTX 4090, 24 GB.
    RTX4090,
    /// Host memory; needs a `--memory` figure.
    CPU,
}

impl DeviceKind {
    /// Every known kind, for error messages.
    pub const ALL: [DeviceKind; 8] = [
        DeviceKind::H200,
        DeviceKind::H100,
        DeviceKind::B200,
        DeviceKind::B300,
        DeviceKind::MI355X,
        DeviceKind::A100,
        DeviceKind::RTX4090,
        DeviceKind::CPU,
    ];

    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::H200 => "H200",
            DeviceKind::H100 => "H100",
            DeviceKind::B200 => "B200",
            DeviceKind::B300 => "B300",
            DeviceKind::MI355X => "MI355X",
            DeviceKind::A100 => "A100",
            DeviceKind::RTX4090 => "RTX4090",
            DeviceKind::CPU => "CPU",
        }
    }

    /// Memory per device in bytes (decimal vendor figure), `None` for the CPU.
    pub fn memory_bytes(self) -> Option<u64> {
        let gb = |g: u64| Some(g * 1_000_000_000);
        match self {
            DeviceKind::H200 => gb(141),
            DeviceKind::H100 | DeviceKind::A100 => gb(80),
            DeviceKind::B200 => gb(192),
            DeviceKind::B300 | DeviceKind::MI355X => gb(288),
            DeviceKind::RTX4090 => gb(24),
            DeviceKind::CPU => None,
        }
    }

    /// Case-insensitive lookup (`h200`, `mi355x`, `4090`, `rtx-4090`, `cpu`).
    pub fn parse(s: &str) -> Option<DeviceKind> {
        let key: String = s
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_uppercase();
        match key.as_str() {
            "4090" | "RTX4090" => Some(DeviceKind::RTX4090),
            "MI355" => Some(DeviceKind::MI355X),
            _ => DeviceKind::ALL.into_iter().find(|k| k.name() == key),
        }
    }
}

/// `count` devices of one kind and the memory of each.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceSpec {
    /// How many devices.
    pub count: u64,
    /// Which kind.
    pub kind: DeviceKind,
    /// Memory of one device in bytes (the kind's figure or the override).
    pub bytes_per_device: u64,
}

impl DeviceSpec {
    /// Parses `8xH200`, `8×H200`, `8*H200` or `H200` (one device);
    /// `memory_override` (bytes per device) replaces the kind's figure and is
    /// required for `cpu`.
    pub fn parse(s: &str, memory_override: Option<u64>) -> Result<DeviceSpec> {
        let bad = |why: String| Error::Config(format!("--devices `{s}`: {why}"));
        let t = s.trim();
        let (count, kind) = match t
            .find(['x', 'X', '×', '*'])
            .filter(|&i| t[..i].chars().all(|c| c.is_ascii_digit()) && i > 0)
        {
            Some(i) => {
                let sep = t[i..]
                    .chars()
                    .next()
                    .expect("find returned a char boundary")
                    .len_utf8();
                (
                    t[..i].parse::<u64>().map_err(|e| bad(e.to_string()))?,
                    &t[i + sep..],
                )
            }
            None => (1, t),
        };
        if count == 0 {
            return Err(bad("device count must be at least 1".into()));
        }
        let kind = DeviceKind::parse(kind).ok_or_else(|| {
            let known: Vec<&str> = DeviceKind::ALL.iter().map(|k| k.name()).collect();
            bad(format!(
                "unknown device kind `{kind}`; known: {}",
                known.join(", ")
            ))
        })?;
        let bytes_per_device = memory_override.or(kind.memory_bytes()).ok_or_else(|| {
            bad("CPU has no fixed memory size; pass --memory (e.g. 1536GB)".into())
        })?;
        Ok(DeviceSpec {
            count,
            kind,
            bytes_per_device,
        })
    }
}

/// Parses a `--memory` size through the one size parser ([`crate::units::parse_bytes`]).
pub fn parse_bytes(s: &str) -> Result<u64> {
    crate::units::parse_bytes(s).map_err(|e| Error::Config(format!("--memory {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_count_and_kind_in_every_spelling() {
        for s in ["8xH200", "8×h200", "8*H200", " 8XH200 "] {
            let d = DeviceSpec::parse(s, None).unwrap();
            assert_eq!(
                (d.count, d.kind, d.bytes_per_device),
                (8, DeviceKind::H200, 141_000_000_000),
                "{s}"
            );
        }
        assert_eq!(DeviceSpec::parse("B300", None).unwrap().count, 1);
        assert_eq!(
            DeviceSpec::parse("2x4090", None).unwrap().kind,
            DeviceKind::RTX4090
        );
        assert_eq!(
            DeviceSpec::parse("4xMI355X", None)
                .unwrap()
                .bytes_per_device,
            288_000_000_000
        );
    }

    #[test]
    fn cpu_needs_a_memory_figure() {
        let err = DeviceSpec::parse("cpu", None).unwrap_err().to_string();
        assert!(err.contains("--memory"), "{err}");
        let d = DeviceSpec::parse("1xCPU", Some(parse_bytes("1.5TB").unwrap())).unwrap();
        assert_eq!(d.bytes_per_device, 1_500_000_000_000);
    }

    #[test]
    fn unknown_kind_and_zero_count_are_named() {
        let err = DeviceSpec::parse("8xV100", None).unwrap_err().to_string();
        assert!(err.contains("V100") && err.contains("H200"), "{err}");
        assert!(DeviceSpec::parse("0xH100", None)
            .unwrap_err()
            .to_string()
            .contains("at least 1"));
    }

    #[test]
    fn byte_units_are_decimal_or_binary() {
        assert_eq!(parse_bytes("512GB").unwrap(), 512_000_000_000);
        assert_eq!(parse_bytes("139 GiB").unwrap(), 139 * (1 << 30));
        assert_eq!(parse_bytes("2TiB").unwrap(), 2 << 40);
        assert_eq!(parse_bytes("12345").unwrap(), 12345);
        assert!(parse_bytes("lots").is_err() && parse_bytes("5 parsecs").is_err());
    }
}
