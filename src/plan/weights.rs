//! Weight storage schemes for the memory planner: which format each tensor
//! ends up in under `--weights mxfp4|bf16|fp8|q4_k_m`, and how many bytes
//! that costs, block scales included.
//!
//! Formats and their cost per element (bits/weight, scales included):
//!
//! | format | layout | b/w |
//! |---|---|---|
//! | `bf16`, `f16` | plain | 16 |
//! | `f32` | plain | 32 |
//! | `fp8` | E4M3 + one f32 scale per 128×128 block (DeepSeek-V3 / Kimi K2) | 8 + 32/16384 |
//! | `mxfp4` | 32 × E2M1 + one E8M0 scale per block (OCP MX v1.0) | 4.25 |
//! | `q4_k` | llama.cpp super-block of 256: 144 bytes | 4.5 |
//! | `q5_0` | llama.cpp block of 32: 22 bytes | 5.5 |
//! | `q6_k` | llama.cpp super-block of 256: 210 bytes | 6.5625 |
//! | `q8_0` | llama.cpp block of 32: 34 bytes | 8.5 |

use std::str::FromStr;

use serde::Serialize;

use super::shape::{Component, TensorKind, TensorSpec};
use crate::error::{Error, Result};

/// A whole-model storage scheme, as chosen with `--weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightScheme {
    /// The real Kimi K3 layout: routed experts MXFP4, every other tensor BF16.
    Mxfp4,
    /// BF16 everywhere.
    Bf16,
    /// DeepSeek-V3 / Kimi K2 block FP8: text linear layers E4M3 with f32
    /// 128×128 block scales; embedding, lm_head, router, vectors, convs and
    /// the vision side BF16.
    Fp8,
    /// llama.cpp's `Q4_K_M` mix (see [`format_for`]).
    #[serde(rename = "q4_k_m")]
    Q4KM,
}

impl WeightScheme {
    /// Every scheme, in the order the report compares them.
    pub const ALL: [WeightScheme; 4] = [
        WeightScheme::Mxfp4,
        WeightScheme::Bf16,
        WeightScheme::Fp8,
        WeightScheme::Q4KM,
    ];

    /// The `--weights` spelling.
    pub fn name(self) -> &'static str {
        match self {
            WeightScheme::Mxfp4 => "mxfp4",
            WeightScheme::Bf16 => "bf16",
            WeightScheme::Fp8 => "fp8",
            WeightScheme::Q4KM => "q4_k_m",
        }
    }

    /// One line saying what the scheme stores where.
    pub fn describe(self) -> &'static str {
        match self {
            WeightScheme::Mxfp4 => "routed experts MXFP4 (4.25 b/w incl. E8M0 scales), everything else BF16",
            WeightScheme::Bf16 => "BF16 everywhere (16 b/w)",
            WeightScheme::Fp8 => {
                "text linear layers FP8 E4M3 + f32 scale per 128x128 block; embedding, lm_head, router, vectors, vision BF16"
            }
            WeightScheme::Q4KM => {
                "llama.cpp Q4_K_M: Q4_K (4.5 b/w); Q6_K (6.5625) for lm_head and ffn_down of ~half the layers; \
                 vectors/router/convs F32; vision F16 (mmproj)"
            }
        }
    }
}

impl FromStr for WeightScheme {
    type Err = Error;

    fn from_str(s: &str) -> Result<WeightScheme> {
        match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "mxfp4" => Ok(WeightScheme::Mxfp4),
            "bf16" | "fp16" | "f16" => Ok(WeightScheme::Bf16),
            "fp8" | "f8" => Ok(WeightScheme::Fp8),
            "q4_k_m" | "q4km" => Ok(WeightScheme::Q4KM),
            _ => Err(Error::Config(format!(
                "--weights must be one of mxfp4, bf16, fp8, q4_k_m; got `{s}`"
            ))),
        }
    }
}

/// The storage format of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageFormat {
    /// OCP MXFP4: 32 E2M1 elements + one E8M0 scale.
    Mxfp4,
    /// llama.cpp Q4_K.
    Q4K,
    /// llama.cpp Q5_0 (Q4_K's fallback for rows not a multiple of 256).
    Q5_0,
    /// llama.cpp Q6_K.
    Q6K,
    /// FP8 E4M3 with f32 128×128 block scales.
    Fp8Block,
    /// llama.cpp Q8_0 (Q6_K's fallback).
    Q8_0,
    /// bfloat16.
    Bf16,
    /// float16 (llama.cpp mmproj, fallback for rows not a multiple of 32).
    F16,
    /// float32.
    F32,
}

impl StorageFormat {
    /// Short lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            StorageFormat::Mxfp4 => "mxfp4",
            StorageFormat::Q4K => "q4_k",
            StorageFormat::Q5_0 => "q5_0",
            StorageFormat::Q6K => "q6_k",
            StorageFormat::Fp8Block => "fp8",
            StorageFormat::Q8_0 => "q8_0",
            StorageFormat::Bf16 => "bf16",
            StorageFormat::F16 => "f16",
            StorageFormat::F32 => "f32",
        }
    }

    /// Bytes of one row of `cols` elements; block formats round up to whole blocks
    /// (FP8 block scales are per matrix and added by [`tensor_bytes`]).
    pub fn row_bytes(self, cols: u64) -> u64 {
        let blocks = |n: u64| cols.div_ceil(n);
        match self {
            StorageFormat::Mxfp4 => blocks(32) * 17,
            StorageFormat::Q4K => blocks(256) * 144,
            StorageFormat::Q5_0 => blocks(32) * 22,
            StorageFormat::Q6K => blocks(256) * 210,
            StorageFormat::Q8_0 => blocks(32) * 34,
            StorageFormat::Fp8Block => cols,
            StorageFormat::Bf16 | StorageFormat::F16 => cols * 2,
            StorageFormat::F32 => cols * 4,
        }
    }
}

/// llama.cpp's `use_more_bits(i_layer, n_layers)`: the first and last eighth
/// of the layers and every third layer in between get the larger type.
pub fn use_more_bits(layer: usize, n_layers: usize) -> bool {
    layer < n_layers / 8 || layer >= 7 * n_layers / 8 || (layer - n_layers / 8) % 3 == 2
}

/// llama.cpp's fallback when a row is not a whole number of 256-element
/// super-blocks: Q4_K → Q5_0, Q6_K → Q8_0, and F16 if not even 32 divides it.
fn k_quant(format: StorageFormat, cols: u64) -> StorageFormat {
    if cols.is_multiple_of(256) {
        format
    } else if cols.is_multiple_of(32) {
        if format == StorageFormat::Q6K {
            StorageFormat::Q8_0
        } else {
            StorageFormat::Q5_0
        }
    } else {
        StorageFormat::F16
    }
}

/// The format `spec` is stored in under `scheme`, for a text model of `n_layers` layers.
///
/// `q4_k_m` follows llama.cpp's `llama_tensor_get_type`: base type Q4_K
/// (token embedding included); `output.weight` (lm_head) Q6_K; `ffn_down`
/// (dense, shared and routed experts alike) Q6_K where `use_more_bits(layer,
/// n_layers)`; 1-D tensors, the router (`ffn_gate_inp`) and convs stay F32.
/// MLA has no `attn_v.weight`, so the attn_v rule does not apply. The vision
/// tower and projector go to a separate `mmproj` file, priced as F16.
pub fn format_for(scheme: WeightScheme, spec: &TensorSpec, n_layers: usize) -> StorageFormat {
    let vision = matches!(
        spec.component,
        Component::VisionTower | Component::Projector
    );
    let matrix = matches!(spec.kind, TensorKind::Linear | TensorKind::FfnDown);
    match scheme {
        WeightScheme::Bf16 => StorageFormat::Bf16,
        WeightScheme::Mxfp4 => {
            if spec.component == Component::RoutedExperts && spec.cols.is_multiple_of(32) {
                StorageFormat::Mxfp4
            } else {
                StorageFormat::Bf16
            }
        }
        WeightScheme::Fp8 => {
            if matrix && !vision {
                StorageFormat::Fp8Block
            } else {
                StorageFormat::Bf16
            }
        }
        WeightScheme::Q4KM => {
            if vision {
                return StorageFormat::F16;
            }
            match spec.kind {
                TensorKind::Small | TensorKind::Router => StorageFormat::F32,
                TensorKind::LmHead => k_quant(StorageFormat::Q6K, spec.cols),
                TensorKind::FfnDown if spec.layer.is_some_and(|l| use_more_bits(l, n_layers)) => {
                    k_quant(StorageFormat::Q6K, spec.cols)
                }
                TensorKind::Embedding | TensorKind::Linear | TensorKind::FfnDown => {
                    k_quant(StorageFormat::Q4K, spec.cols)
                }
            }
        }
    }
}

/// Format and bytes of all `spec.count` copies of a tensor under `scheme`.
pub fn tensor_bytes(
    scheme: WeightScheme,
    spec: &TensorSpec,
    n_layers: usize,
) -> (StorageFormat, u64) {
    let format = format_for(scheme, spec, n_layers);
    let mut one = spec.rows * format.row_bytes(spec.cols);
    if format == StorageFormat::Fp8Block {
        one += spec.rows.div_ceil(128) * spec.cols.div_ceil(128) * 4;
    }
    (format, one * spec.count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(
        component: Component,
        kind: TensorKind,
        rows: u64,
        cols: u64,
        layer: Option<usize>,
    ) -> TensorSpec {
        TensorSpec {
            name: "t".into(),
            component,
            kind,
            rows,
            cols,
            count: 3,
            active_count: 3,
            layer,
        }
    }

    #[test]
    fn block_formats_cost_their_published_bits_per_weight() {
        // Whole blocks: bytes·8/elements is exactly the table in the module docs.
        let cols = 7168u64;
        let bpw = |f: StorageFormat| (f.row_bytes(cols) * 8) as f64 / cols as f64;
        assert_eq!(bpw(StorageFormat::Mxfp4), 4.25);
        assert_eq!(bpw(StorageFormat::Q4K), 4.5);
        assert_eq!(bpw(StorageFormat::Q5_0), 5.5);
        assert_eq!(bpw(StorageFormat::Q6K), 6.5625);
        assert_eq!(bpw(StorageFormat::Q8_0), 8.5);
        assert_eq!(bpw(StorageFormat::Bf16), 16.0);
    }

    #[test]
    fn fp8_adds_one_f32_scale_per_128_block() {
        let s = spec(
            Component::SharedExperts,
            TensorKind::Linear,
            300,
            7168,
            Some(4),
        );
        let (f, bytes) = tensor_bytes(WeightScheme::Fp8, &s, 10);
        assert_eq!(f, StorageFormat::Fp8Block);
        // 3 copies × (300·7168 bytes + ceil(300/128)=3 × 56 blocks × 4 bytes).
        assert_eq!(bytes, 3 * (300 * 7168 + 3 * 56 * 4));
    }

    #[test]
    fn use_more_bits_picks_46_of_93_layers() {
        // n/8 = 11, 7n/8 = 81: layers 0..=10, 81..=92, and 13, 16, …, 79 (23 of them).
        let picked: Vec<usize> = (0..93).filter(|&l| use_more_bits(l, 93)).collect();
        assert_eq!(picked.len(), 11 + 12 + 23);
        assert!(
            picked.contains(&13)
                && !picked.contains(&12)
                && !picked.contains(&14)
                && picked.contains(&79)
        );
        assert!(
            !picked.contains(&80)
                && picked.contains(&81)
                && picked.contains(&10)
                && !picked.contains(&11)
        );
    }

    #[test]
    fn q4_k_m_routes_tensors_like_llama_cpp() {
        let n = 93;
        let f = |c, k, cols, layer| format_for(WeightScheme::Q4KM, &spec(c, k, 8, cols, layer), n);
        assert_eq!(
            f(Component::RoutedExperts, TensorKind::FfnDown, 3072, Some(0)),
            StorageFormat::Q6K
        );
        assert_eq!(
            f(
                Component::RoutedExperts,
                TensorKind::FfnDown,
                3072,
                Some(12)
            ),
            StorageFormat::Q4K
        );
        assert_eq!(
            f(Component::LmHead, TensorKind::LmHead, 7168, None),
            StorageFormat::Q6K
        );
        assert_eq!(
            f(Component::Embedding, TensorKind::Embedding, 7168, None),
            StorageFormat::Q4K
        );
        assert_eq!(
            f(Component::KdaAttention, TensorKind::Linear, 128, Some(1)),
            StorageFormat::Q5_0
        );
        assert_eq!(
            f(Component::Router, TensorKind::Router, 7168, Some(1)),
            StorageFormat::F32
        );
        assert_eq!(
            f(Component::VisionTower, TensorKind::Linear, 1024, None),
            StorageFormat::F16
        );
    }

    #[test]
    fn mxfp4_scheme_only_packs_routed_experts() {
        let e = spec(
            Component::RoutedExperts,
            TensorKind::Linear,
            3072,
            3584,
            Some(1),
        );
        let a = spec(
            Component::MlaAttention,
            TensorKind::Linear,
            3072,
            3584,
            Some(1),
        );
        assert_eq!(
            tensor_bytes(WeightScheme::Mxfp4, &e, 93),
            (StorageFormat::Mxfp4, 3 * 3072 * 3584 * 17 / 32)
        );
        assert_eq!(
            tensor_bytes(WeightScheme::Mxfp4, &a, 93),
            (StorageFormat::Bf16, 3 * 3072 * 3584 * 2)
        );
    }

    #[test]
    fn scheme_names_round_trip() {
        for s in WeightScheme::ALL {
            assert_eq!(s.name().parse::<WeightScheme>().unwrap(), s);
        }
        assert!("int3"
            .parse::<WeightScheme>()
            .unwrap_err()
            .to_string()
            .contains("--weights"));
    }
}
