//! Rotary position embeddings, computed as Hugging Face transformers 5.x does.
//!
//! [`Rope::new`] reproduces `modeling_rope_utils.py`: the default rope,
//! `linear`, `yarn` and `llama3` scalings, step by step in f32 with torch's
//! operation order, so `inv_freq` is bit-identical to torch's except where
//! torch's `pow` rounds differently (below). The angle is
//! `freq = (pos as f32) · inv_freq` in f32 and the tables are
//! `cos(freq)·attention_factor`, `sin(freq)·attention_factor`.
//!
//! **Float32 rounding of `base^(2i/dim)`.** The exponent is `f32(2i) / f32(dim)`
//! as torch computes it; the power is evaluated in f64 and rounded once to f32
//! (correctly rounded). On AVX2/AVX-512 CPUs torch evaluates it with SLEEF's
//! vectorised `powf` (error ≤ 1 ulp), which lands on the other side of a
//! near-tie in about 1 of 90 cases (27 of 2352 sampled `(theta, dim, i)`;
//! e.g. `50000^(10/64)`, index 5 of Kimi K2's rope), giving a 1-ulp difference
//! in that `inv_freq` entry. Its effect on an angle, `pos·6e-8` relative, is
//! of the order of the f32 rounding of `pos·inv_freq` itself. Every other
//! step matches torch bit for bit (checked against torch 2.15 in the tests).
//!
//! Two layouts:
//! - [`Rope::apply_rotate_half`]: Llama/HF `rotate_half` convention, pairs
//!   `(x[j], x[j + dim/2])` rotated by frequency `j`.
//! - [`Rope::apply_interleaved`]: adjacent pairs `(x[2j], x[2j+1])` rotated by
//!   frequency `j` (DeepSeek-V3 / Kimi K2 MLA, `rope_interleave=True`). HF's
//!   `apply_rotary_pos_emb_interleave` returns the same rotated values in the
//!   order `[even outputs…, odd outputs…]`; we keep them in place (output
//!   `2j` is HF's output `j`, output `2j+1` is HF's `dim/2 + j`). The same
//!   fixed permutation is applied to queries and keys, so every `q·k` dot
//!   product, and hence attention, is unchanged.

use std::f64::consts::PI;

/// The `rope_scaling` / `rope_parameters` variants Caracal supports.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_type: "default"`).
    Default,
    /// Position interpolation: every `inv_freq` divided by `factor`.
    Linear {
        /// Context extension factor.
        factor: f32,
    },
    /// YaRN (`rope_type: "yarn"`), as in HF `_compute_yarn_parameters`.
    Yarn {
        /// Context extension factor.
        factor: f32,
        /// Context length the model was pretrained with.
        original_max_position_embeddings: usize,
        /// Rotations above which dimensions extrapolate (HF default 32; 0 means the default).
        beta_fast: f32,
        /// Rotations below which dimensions interpolate (HF default 1; 0 means the default).
        beta_slow: f32,
        /// Numerator mscale for the attention factor (DeepSeek).
        mscale: Option<f32>,
        /// Denominator mscale for the attention factor (DeepSeek).
        mscale_all_dim: Option<f32>,
        /// Round the correction range to whole dimensions (HF default true).
        truncate: bool,
        /// Explicit cos/sin scale; inferred from `factor` and the mscales when absent.
        attention_factor: Option<f32>,
    },
    /// Llama 3.1 frequency-dependent scaling (`rope_type: "llama3"`).
    Llama3 {
        /// Scale applied to low frequencies.
        factor: f32,
        /// Wavelengths above `original/low_freq_factor` are fully scaled.
        low_freq_factor: f32,
        /// Wavelengths below `original/high_freq_factor` are left alone.
        high_freq_factor: f32,
        /// Context length the model was pretrained with.
        original_max_position_embeddings: usize,
    },
}

/// Precomputed rotary frequencies for one rotary dimension.
#[derive(Clone, Debug)]
pub struct Rope {
    /// Rotated values per head (even); `inv_freq` has `dim / 2` entries.
    pub dim: usize,
    /// Inverse frequency of each rotated pair, as torch computes it.
    pub inv_freq: Vec<f32>,
    /// Scale applied to cos and sin (YaRN's mscale ratio; 1 otherwise).
    pub attention_factor: f32,
}

/// YaRN's magnitude correction: `0.1·mscale·ln(scale) + 1` for `scale > 1`, else 1.
pub fn yarn_get_mscale(scale: f32, mscale: f32) -> f32 {
    mscale_f64(scale as f64, mscale as f64) as f32
}

/// [`yarn_get_mscale`] in f64, as HF evaluates it in Python floats.
fn mscale_f64(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// `base^(2i/dim)` for `i < dim/2`: exponent in f32 as torch does
/// (`arange(0, dim, 2).float() / dim`), power in f64 rounded once to f32.
fn pos_freqs(dim: usize, base: f32) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            (base as f64).powf(e as f64) as f32
        })
        .collect()
}

/// YaRN's `find_correction_dim` in f64.
fn correction_dim(rotations: f64, dim: usize, base: f64, max_pos: f64) -> f64 {
    (dim as f64 * (max_pos / (rotations * 2.0 * PI)).ln()) / (2.0 * base.ln())
}

impl Rope {
    /// Frequencies for `dim` rotated values per head (even), base `theta`
    /// (`rope_theta`), and the given scaling.
    pub fn new(dim: usize, theta: f32, scaling: &RopeScaling) -> Rope {
        assert!(
            dim >= 2 && dim.is_multiple_of(2),
            "rope dim must be even and positive, got {dim}"
        );
        let half = dim / 2;
        let pf = pos_freqs(dim, theta);
        // torch: `1.0 / t` is `t.reciprocal() * 1.0`.
        let base_inv: Vec<f32> = pf.iter().map(|&p| 1.0 / p).collect();
        let (inv_freq, attention_factor) = match *scaling {
            RopeScaling::Default => (base_inv, 1.0),
            RopeScaling::Linear { factor } => (base_inv.iter().map(|&f| f / factor).collect(), 1.0),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                truncate,
                attention_factor,
            } => {
                let factor64 = factor as f64;
                let af = match attention_factor {
                    Some(a) => a as f64,
                    None => match (mscale, mscale_all_dim) {
                        // HF: `if mscale and mscale_all_dim` (both set and non-zero).
                        (Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
                            mscale_f64(factor64, m as f64) / mscale_f64(factor64, ma as f64)
                        }
                        _ => mscale_f64(factor64, 1.0),
                    },
                };
                // HF: `beta_fast or 32`, `beta_slow or 1`.
                let beta_fast = if beta_fast == 0.0 {
                    32.0
                } else {
                    beta_fast as f64
                };
                let beta_slow = if beta_slow == 0.0 {
                    1.0
                } else {
                    beta_slow as f64
                };
                let orig = original_max_position_embeddings as f64;
                let mut low = correction_dim(beta_fast, dim, theta as f64, orig);
                let mut high = correction_dim(beta_slow, dim, theta as f64, orig);
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min((dim - 1) as f64);
                if low == high {
                    high += 0.001; // HF: prevent a zero-width ramp
                }
                // (arange(half) - low) / (high - low), clamped; the Python
                // numbers become f32 scalars, the difference is taken in f64.
                let (low32, width32) = (low as f32, (high - low) as f32);
                let interp: Vec<f32> = pf.iter().map(|&p| 1.0 / (factor * p)).collect();
                let inv = (0..half)
                    .map(|i| {
                        let ramp = ((i as f32 - low32) / width32).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interp[i] * (1.0 - extrapolation_factor)
                            + base_inv[i] * extrapolation_factor
                    })
                    .collect();
                (inv, af as f32)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old_ctx = original_max_position_embeddings as f64;
                let low_wavelen = (old_ctx / low_freq_factor as f64) as f32;
                let high_wavelen = (old_ctx / high_freq_factor as f64) as f32;
                let two_pi = (2.0 * PI) as f32;
                let span = (high_freq_factor as f64 - low_freq_factor as f64) as f32;
                let inv = base_inv
                    .iter()
                    .map(|&f| {
                        // torch: `2π / inv_freq` is `inv_freq.reciprocal() * 2π`.
                        let wavelen = (1.0 / f) * two_pi;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        // HF: `~(wavelen < high) * ~(wavelen > low)`; wavelengths are finite.
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium {
                            let smooth =
                                ((1.0 / wavelen) * old_ctx as f32 - low_freq_factor) / span;
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
        };
        Rope {
            dim,
            inv_freq,
            attention_factor,
        }
    }

    /// The `dim/2` cos and sin values at position `pos`, already multiplied
    /// by `attention_factor` (angles `(pos as f32)·inv_freq` in f32).
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let half = self.dim / 2;
        assert!(
            cos.len() >= half && sin.len() >= half,
            "cos_sin: tables need dim/2 = {half} values"
        );
        let p = pos as f32;
        for (j, &f) in self.inv_freq.iter().enumerate() {
            let angle = (p * f) as f64;
            cos[j] = angle.cos() as f32 * self.attention_factor;
            sin[j] = angle.sin() as f32 * self.attention_factor;
        }
    }

    /// Rotates `x` `[t, heads·head_stride]` in place, Llama `rotate_half`
    /// convention: inside each head the `dim` values starting at `offset`
    /// form pairs `(j, j + dim/2)` rotated by `positions[token]·inv_freq[j]`.
    pub fn apply_rotate_half(
        &self,
        x: &mut [f32],
        positions: &[usize],
        heads: usize,
        head_stride: usize,
        offset: usize,
    ) {
        let table = self.table(positions);
        self.rotate_with(x, &table, RopePairs::Half, heads, head_stride, offset);
    }

    /// Rotates `x` `[t, heads·head_stride]` in place with adjacent pairs
    /// `(x[2j], x[2j+1])` (offset by `offset` inside each head) rotated by
    /// `positions[token]·inv_freq[j]`. Equals DeepSeek-V3's interleaved rope
    /// up to a fixed output permutation (see the module docs).
    pub fn apply_interleaved(
        &self,
        x: &mut [f32],
        positions: &[usize],
        heads: usize,
        head_stride: usize,
        offset: usize,
    ) {
        let table = self.table(positions);
        self.rotate_with(x, &table, RopePairs::Adjacent, heads, head_stride, offset);
    }

    /// [`Rope::apply_rotate_half`] / [`Rope::apply_interleaved`] with the
    /// tables of a [`RopeTable`] (one per row of `x`), so that a batch's
    /// layers compute them once.
    pub fn rotate_with(
        &self,
        x: &mut [f32],
        table: &RopeTable,
        pairs: RopePairs,
        heads: usize,
        head_stride: usize,
        offset: usize,
    ) {
        let half = self.dim / 2;
        self.apply(
            x,
            table,
            heads,
            head_stride,
            offset,
            |head, cos, sin| match pairs {
                RopePairs::Half => {
                    let (a, b) = head.split_at_mut(half);
                    for j in 0..half {
                        let (x1, x2) = (a[j], b[j]);
                        // HF: q·cos + rotate_half(q)·sin, rotate_half(q) = [-x2, x1].
                        a[j] = x1 * cos[j] - x2 * sin[j];
                        b[j] = x2 * cos[j] + x1 * sin[j];
                    }
                }
                RopePairs::Adjacent => {
                    for (j, pair) in head.chunks_exact_mut(2).enumerate() {
                        let (x1, x2) = (pair[0], pair[1]);
                        pair[0] = x1 * cos[j] - x2 * sin[j];
                        pair[1] = x2 * cos[j] + x1 * sin[j];
                    }
                }
            },
        );
    }

    /// The cos and sin tables of every position in `positions`
    /// ([`Rope::cos_sin`]), for [`Rope::rotate_with`].
    pub fn table(&self, positions: &[usize]) -> RopeTable {
        let half = self.dim / 2;
        let mut cos = vec![0.0f32; positions.len() * half];
        let mut sin = vec![0.0f32; positions.len() * half];
        if half > 0 {
            for ((c, s), &pos) in cos
                .chunks_exact_mut(half)
                .zip(sin.chunks_exact_mut(half))
                .zip(positions)
            {
                self.cos_sin(pos, c, s);
            }
        }
        RopeTable {
            half,
            rows: positions.len(),
            cos,
            sin,
            inv_freq: self.inv_freq.clone(),
            attention_factor: self.attention_factor,
        }
    }

    /// Shared walk over tokens and heads: hands each head's `dim` rotary
    /// values and its token's tables to `rotate`.
    fn apply(
        &self,
        x: &mut [f32],
        table: &RopeTable,
        heads: usize,
        head_stride: usize,
        offset: usize,
        rotate: impl Fn(&mut [f32], &[f32], &[f32]),
    ) {
        let row = heads * head_stride;
        assert!(
            offset + self.dim <= head_stride,
            "rope: offset {offset} + dim {} exceeds head stride {head_stride}",
            self.dim
        );
        assert!(
            table.made_by(self),
            "rope: the table was made by another rotary embedding"
        );
        assert_eq!(
            x.len(),
            table.rows * row,
            "rope: x must be [positions, heads·head_stride]"
        );
        let half = table.half;
        for (t, token) in x.chunks_exact_mut(row.max(1)).enumerate().take(table.rows) {
            let (cos, sin) = (
                &table.cos[t * half..(t + 1) * half],
                &table.sin[t * half..(t + 1) * half],
            );
            for head in token.chunks_exact_mut(head_stride) {
                rotate(&mut head[offset..offset + self.dim], cos, sin);
            }
        }
    }
}

/// How the rotary values of a head pair up ([`Rope::rotate_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopePairs {
    /// Llama's `rotate_half`: `(j, j + dim/2)`.
    Half,
    /// Adjacent `(2j, 2j + 1)`: DeepSeek-V3's interleaved rope.
    Adjacent,
}

/// The cos and sin tables of a batch's positions ([`Rope::table`]), `dim/2`
/// values per position each.
#[derive(Clone, Debug)]
pub struct RopeTable {
    /// Values per position (`dim/2`).
    half: usize,
    /// Positions.
    rows: usize,
    /// `[rows, half]`.
    cos: Vec<f32>,
    /// `[rows, half]`.
    sin: Vec<f32>,
    /// The frequencies and factor of the [`Rope`] that made the table.
    inv_freq: Vec<f32>,
    attention_factor: f32,
}

impl RopeTable {
    /// Whether `rope` (same frequencies and factor, bit for bit, so that a
    /// NaN frequency still matches itself) made this table.
    pub fn made_by(&self, rope: &Rope) -> bool {
        self.inv_freq.len() == rope.inv_freq.len()
            && self
                .inv_freq
                .iter()
                .zip(&rope.inv_freq)
                .all(|(a, b)| a.to_bits() == b.to_bits())
            && self.attention_factor.to_bits() == rope.attention_factor.to_bits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference values from torch 2.15 / transformers 5.24 (`ROPE_INIT_FUNCTIONS`,
    // cos/sin = `(pos.float()[:, None] * inv_freq).cos() * attention_factor`).

    // dim 64, theta 100000, default.
    #[rustfmt::skip]
    const DEFAULT_100000_64: [f32; 32] = [
        1.0, 0.69783056, 0.48696753, 0.33982083, 0.23713736, 0.1654817, 0.1154782, 0.08058421, 0.05623413, 0.0392419,
        0.027384195, 0.01910953, 0.013335215, 0.00930572, 0.0064938166, 0.0045315837, 0.0031622779, 0.0022067341,
        0.0015399265, 0.0010746078, 0.0007498942, 0.0005232991, 0.0003651741, 0.00025482968, 0.00017782794,
        0.00012409377, 8.659643e-05, 6.0429637e-05, 4.2169653e-05, 2.9427272e-05, 2.053525e-05, 1.4330127e-05,
    ];
    #[rustfmt::skip]
    const DEFAULT_100000_64_COS_1000: [f32; 32] = [
        0.56237906, 0.92222613, -0.99978644, 0.86340064, -0.052861076, -0.5210583, -0.7243361, 0.45609352, 0.9509386,
        0.028006924, -0.62930435, 0.96639675, 0.7187149, -0.992921, 0.9778991, -0.1798217, -0.9997861, -0.5939323,
        0.030864894, 0.47607714, 0.731761, 0.8661752, 0.9340616, 0.96770626, 0.9842302, 0.9923102, 0.9962529,
        0.99817467, 0.999111, 0.99956703, 0.9997892, 0.9998973,
    ];
    #[rustfmt::skip]
    const DEFAULT_100000_64_SIN_131071: [f32; 32] = [
        -0.5752417, 0.8536982, 0.40559572, -0.74756783, -0.8846223, 0.29158375, -0.3425737, 0.21669555, 0.46816137,
        -0.6349345, 0.9999907, -0.7552119, 0.9063103, 0.6976653, 0.21876352, -0.19692154, -0.20583814, 0.21074495,
        0.70169705, 0.49838904, -0.78333354, -0.5018236, -0.6741737, 0.9154962, -0.9679506, -0.52875364, -0.9377485,
        0.9977836, -0.68599224, -0.6559718, 0.43498075, 0.953103,
    ];
    // Kimi K2: dim 64, theta 50000, yarn factor 32, orig 4096, beta 1/1, mscale 1/1.
    #[rustfmt::skip]
    const YARN_K2: [f32; 32] = [
        1.0, 0.7131111, 0.50852746, 0.36263654, 0.25860015, 0.18441062, 0.13150527, 0.09377786, 0.066874035,
        0.047688615, 0.034007277, 0.024250967, 0.017293634, 0.012332281, 0.008794286, 0.0062713036, 0.004472136,
        0.0031891298, 0.0022742038, 0.00162176, 3.6140467e-05, 2.5772168e-05, 1.837842e-05, 1.3105854e-05, 9.34593e-06,
        6.664686e-06, 4.7526614e-06, 3.3891756e-06, 2.4168587e-06, 1.7234888e-06, 1.229039e-06, 8.764413e-07,
    ];
    #[rustfmt::skip]
    const YARN_K2_COS_1000: [f32; 32] = [
        0.56237906, -0.99953645, 0.9169038, -0.21570703, 0.54905677, -0.5870773, 0.9040574, 0.8916024, -0.6211513,
        -0.8447363, -0.85239863, 0.6357827, 0.014874271, 0.9727259, -0.807738, 0.9999294, -0.23794833, -0.9988703,
        -0.6468201, -0.050941624, 0.999347, 0.99966794, 0.99983114, 0.9999141, 0.9999563, 0.99997777, 0.99998873,
        0.9999943, 0.9999971, 0.9999985, 0.9999992, 0.99999964,
    ];
    #[rustfmt::skip]
    const YARN_K2_SIN_131071: [f32; 32] = [
        -0.5752417, -0.45923126, 0.92206657, -0.9184075, -0.33096796, -0.50476617, 0.98397774, 0.997086, 0.20216376,
        -0.9227447, 0.52464634, -0.63895005, -0.9993963, 0.99848795, 0.28461093, -0.89625484, 0.9663055, -0.1697618,
        0.36082166, -0.8736217, -0.999698, -0.23419568, 0.6688902, 0.9892148, 0.94079924, 0.7666114, 0.58342224,
        0.42975608, 0.31150848, 0.223983, 0.16039555, 0.11462354,
    ];
    // Kimi K2.5-like: yarn factor 64, beta_fast 32, beta_slow 1 (low/high = 8/20).
    #[rustfmt::skip]
    const YARN_K25: [f32; 32] = [
        1.0, 0.7131111, 0.50852746, 0.36263654, 0.25860015, 0.18441062, 0.13150527, 0.09377786, 0.066874035,
        0.043776657, 0.028427958, 0.018282956, 0.01161916, 0.0072741196, 0.0044658487, 0.0026702038, 0.0015372967,
        0.0008346551, 0.00040864607, 0.00015837497, 1.8070234e-05, 1.2886084e-05, 9.18921e-06, 6.552927e-06,
        4.672965e-06, 3.332343e-06, 2.3763307e-06, 1.6945878e-06, 1.2084294e-06, 8.617444e-07, 6.145195e-07,
        4.3822064e-07,
    ];
    // Qwen-style yarn: dim 32, theta 1e6, factor 4, orig 32768, no mscale,
    // truncate false (attention_factor = 0.1·ln 4 + 1 = 1.1386294).
    #[rustfmt::skip]
    const YARN_NOTRUNC: [f32; 16] = [
        1.0, 0.4216965, 0.17782794, 0.074989416, 0.03162278, 0.013335215, 0.0055172704, 0.0018835026, 0.000607408,
        0.00017734423, 4.4456985e-05, 1.8747356e-05, 7.905694e-06, 3.3338035e-06, 1.4058534e-06, 5.9284343e-07,
    ];
    #[rustfmt::skip]
    const YARN_NOTRUNC_COS_1000: [f32; 16] = [
        0.64034134, 0.85370624, -0.3667634, 1.0448021, 1.1143566, 0.81834996, 0.8206655, -0.35028204, 0.934963,
        1.1207708, 1.1375043, 1.1384294, 1.1385939, 1.1386231, 1.1386284, 1.1386292,
    ];
    // dim 32, theta 10000, linear factor 4.
    #[rustfmt::skip]
    const LINEAR_4: [f32; 16] = [
        0.25, 0.14058533, 0.07905694, 0.044456985, 0.025, 0.014058532, 0.007905695, 0.0044456986, 0.0025, 0.0014058533,
        0.00079056947, 0.00044456986, 0.00025, 0.00014058533, 7.905695e-05, 4.4456985e-05,
    ];
    // dim 64, theta 500000, llama3 factor 8, low 1, high 4, orig 8192.
    #[rustfmt::skip]
    const LLAMA3: [f32; 32] = [
        1.0, 0.6636013, 0.44036663, 0.29222783, 0.19392276, 0.12868738, 0.0853971, 0.05666962, 0.03760603, 0.024955409,
        0.01656044, 0.010989529, 0.007292665, 0.0048394212, 0.003211446, 0.0013718937, 0.000524846, 0.00017850779,
        7.7846555e-05, 5.165907e-05, 3.4281024e-05, 2.2748929e-05, 1.5096218e-05, 1.0017869e-05, 6.6478697e-06,
        4.4115345e-06, 2.9274997e-06, 1.9426925e-06, 1.2891732e-06, 8.554969e-07, 5.677088e-07, 3.7673226e-07,
    ];

    fn k2() -> RopeScaling {
        RopeScaling::Yarn {
            factor: 32.0,
            original_max_position_embeddings: 4096,
            beta_fast: 1.0,
            beta_slow: 1.0,
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            truncate: true,
            attention_factor: None,
        }
    }

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// Every entry equals torch bit for bit, except at most `max_off` entries
    /// that are 1 ulp away (torch's SLEEF `powf` rounding a near-tie the other
    /// way; see the module docs). Returns the indices that differ.
    fn assert_inv_freq(got: &[f32], want: &[f32], max_off: usize, what: &str) -> Vec<usize> {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let off: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
        for &i in &off {
            assert!(
                ulps(got[i], want[i]) <= 1,
                "{what}[{i}]: {} vs torch {} (more than 1 ulp)",
                got[i],
                want[i]
            );
        }
        assert!(
            off.len() <= max_off,
            "{what}: {} entries differ from torch: {off:?}",
            off.len()
        );
        off
    }

    /// cos/sin vs torch: 2 ulps of the table scale (SLEEF's cos/sin are
    /// within 1 ulp, ours are correctly rounded) plus the angle difference a
    /// differing inv_freq entry causes at this position.
    fn assert_table(
        got: &[f32],
        want: &[f32],
        pos: usize,
        rope: &Rope,
        torch_inv: &[f32],
        what: &str,
    ) {
        for j in 0..got.len() {
            let angle = pos as f32 * rope.inv_freq[j];
            let dangle = (pos as f64 * (rope.inv_freq[j] as f64 - torch_inv[j] as f64)).abs()
                + 2.0 * f32::EPSILON as f64 * angle.abs() as f64;
            let tol = (2.4e-7
                + if rope.inv_freq[j] == torch_inv[j] {
                    0.0
                } else {
                    dangle
                })
                * rope.attention_factor as f64;
            assert!(
                (got[j] as f64 - want[j] as f64).abs() <= tol,
                "{what}[{j}]: {} vs torch {} (tol {tol})",
                got[j],
                want[j]
            );
        }
    }

    #[test]
    fn default_inv_freq_matches_torch() {
        let rope = Rope::new(64, 100000.0, &RopeScaling::Default);
        assert_inv_freq(&rope.inv_freq, &DEFAULT_100000_64, 0, "default");
        assert_eq!(rope.attention_factor, 1.0);
    }

    #[test]
    fn kimi_k2_yarn_matches_torch_and_splits_at_19_20() {
        let rope = Rope::new(64, 50000.0, &k2());
        // Index 5 is 50000^(10/64), a near-tie torch's SLEEF powf rounds the other way.
        let off = assert_inv_freq(&rope.inv_freq, &YARN_K2, 1, "yarn K2");
        assert!(off.iter().all(|&i| i == 5), "{off:?}");
        assert_eq!(rope.attention_factor, 1.0);
        // low = 19, high = 20: dims < 20 extrapolate (plain base^-2i/d), >= 20 interpolate (/32).
        let base = Rope::new(64, 50000.0, &RopeScaling::Default);
        for i in 0..32 {
            let want = if i < 20 {
                base.inv_freq[i]
            } else {
                1.0 / (32.0 * (1.0 / base.inv_freq[i]))
            };
            assert!(ulps(rope.inv_freq[i], want) <= 1, "{i}");
        }
    }

    #[test]
    fn kimi_k25_yarn_ramp_matches_torch() {
        let scaling = RopeScaling::Yarn {
            factor: 64.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            truncate: true,
            attention_factor: None,
        };
        let rope = Rope::new(64, 50000.0, &scaling);
        assert_inv_freq(&rope.inv_freq, &YARN_K25, 1, "yarn K2.5");
    }

    #[test]
    fn untruncated_yarn_and_inferred_attention_factor_match_torch() {
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            truncate: false,
            attention_factor: None,
        };
        let rope = Rope::new(32, 1_000_000.0, &scaling);
        let off = assert_inv_freq(&rope.inv_freq, &YARN_NOTRUNC, 0, "yarn no-truncate");
        assert!(off.is_empty());
        assert_eq!(rope.attention_factor, 1.1386294);
        let (mut cos, mut sin) = (vec![0.0; 16], vec![0.0; 16]);
        rope.cos_sin(1000, &mut cos, &mut sin);
        assert_table(
            &cos,
            &YARN_NOTRUNC_COS_1000,
            1000,
            &rope,
            &YARN_NOTRUNC,
            "cos@1000",
        );
    }

    #[test]
    fn linear_and_llama3_match_torch() {
        let rope = Rope::new(32, 10000.0, &RopeScaling::Linear { factor: 4.0 });
        assert_inv_freq(&rope.inv_freq, &LINEAR_4, 0, "linear");
        let llama3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let rope = Rope::new(64, 500000.0, &llama3);
        assert_inv_freq(&rope.inv_freq, &LLAMA3, 0, "llama3");
    }

    #[test]
    fn a_table_serves_only_the_rope_that_made_it() {
        let a = Rope::new(64, 100000.0, &RopeScaling::Default);
        let b = Rope::new(64, 50000.0, &RopeScaling::Default);
        let positions = [0, 7, 4096];
        let table = a.table(&positions);
        assert!(table.made_by(&a) && !table.made_by(&b));
        // Rows through the table equal rows rotated one position at a time.
        let x: Vec<f32> = (0..3 * 2 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut batched = x.clone();
        a.rotate_with(&mut batched, &table, RopePairs::Half, 2, 64, 0);
        for (t, &pos) in positions.iter().enumerate() {
            let mut one = x[t * 128..(t + 1) * 128].to_vec();
            a.apply_rotate_half(&mut one, &[pos], 2, 64, 0);
            assert_eq!(one, batched[t * 128..(t + 1) * 128]);
        }
        let r = std::panic::catch_unwind(|| {
            let mut y = x.clone();
            b.rotate_with(&mut y, &table, RopePairs::Half, 2, 64, 0);
        });
        assert!(r.is_err(), "another rope's table is refused");
    }

    #[test]
    fn cos_sin_tables_match_torch() {
        let (mut cos, mut sin) = (vec![0.0; 32], vec![0.0; 32]);
        let rope = Rope::new(64, 100000.0, &RopeScaling::Default);
        rope.cos_sin(1000, &mut cos, &mut sin);
        assert_table(
            &cos,
            &DEFAULT_100000_64_COS_1000,
            1000,
            &rope,
            &DEFAULT_100000_64,
            "default cos@1000",
        );
        rope.cos_sin(131071, &mut cos, &mut sin);
        assert_table(
            &sin,
            &DEFAULT_100000_64_SIN_131071,
            131071,
            &rope,
            &DEFAULT_100000_64,
            "default sin@131071",
        );
        let rope = Rope::new(64, 50000.0, &k2());
        rope.cos_sin(1000, &mut cos, &mut sin);
        assert_table(
            &cos,
            &YARN_K2_COS_1000,
            1000,
            &rope,
            &YARN_K2,
            "K2 cos@1000",
        );
        rope.cos_sin(131071, &mut cos, &mut sin);
        assert_table(
            &sin,
            &YARN_K2_SIN_131071,
            131071,
            &rope,
            &YARN_K2,
            "K2 sin@131071",
        );
    }

    #[test]
    fn mscale_follows_deepseek_formula() {
        assert_eq!(yarn_get_mscale(1.0, 1.0), 1.0);
        assert_eq!(yarn_get_mscale(0.5, 1.0), 1.0);
        // K2: 0.1·ln 32 + 1 = 1.34657359 (softmax scale uses its square, 1.8133).
        assert!((yarn_get_mscale(32.0, 1.0) - 1.346_573_6).abs() < 1e-6);
        assert!((yarn_get_mscale(32.0, 1.0).powi(2) - 1.8133).abs() < 1e-4);
        // Unequal mscales give the ratio as attention factor.
        let rope = Rope::new(
            64,
            10000.0,
            &RopeScaling::Yarn {
                factor: 40.0,
                original_max_position_embeddings: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: Some(0.707),
                mscale_all_dim: Some(1.0),
                truncate: true,
                attention_factor: None,
            },
        );
        let want = (0.1 * 0.707f64 * 40f64.ln() + 1.0) / (0.1 * 40f64.ln() + 1.0);
        assert!((rope.attention_factor as f64 - want).abs() < 1e-7);
    }

    /// Scalar reference: rotate one head slice by explicit angles in f64.
    fn rotate_ref(v: &[f32], pairs: &[(usize, usize)], rope: &Rope, pos: usize) -> Vec<f64> {
        let mut out: Vec<f64> = v.iter().map(|&a| a as f64).collect();
        for (j, &(a, b)) in pairs.iter().enumerate() {
            let ang = (pos as f32 * rope.inv_freq[j]) as f64;
            let (c, s) = (
                ang.cos() * rope.attention_factor as f64,
                ang.sin() * rope.attention_factor as f64,
            );
            out[a] = v[a] as f64 * c - v[b] as f64 * s;
            out[b] = v[b] as f64 * c + v[a] as f64 * s;
        }
        out
    }

    fn test_input(len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919) % 113) as f32 / 56.5 - 1.0)
            .collect()
    }

    #[test]
    fn rotate_half_rotates_first_and_second_half_pairs_at_offset() {
        // 2 tokens, 3 heads of stride 12, rotating 8 dims from offset 3; the
        // rest of each head is untouched. Tolerance 1e-6 absolute vs f64.
        let rope = Rope::new(8, 10000.0, &k2_like_small());
        let (heads, stride, offset) = (3, 12, 3);
        let positions = [5usize, 77];
        let orig = test_input(positions.len() * heads * stride);
        let mut x = orig.clone();
        rope.apply_rotate_half(&mut x, &positions, heads, stride, offset);
        let pairs: Vec<(usize, usize)> = (0..4).map(|j| (j, j + 4)).collect();
        for (t, &pos) in positions.iter().enumerate() {
            for h in 0..heads {
                let base = (t * heads + h) * stride;
                let want = rotate_ref(&orig[base + offset..base + offset + 8], &pairs, &rope, pos);
                for k in 0..stride {
                    let got = x[base + k];
                    if (offset..offset + 8).contains(&k) {
                        assert!(
                            (got as f64 - want[k - offset]).abs() < 1e-6,
                            "t{t} h{h} k{k}"
                        );
                    } else {
                        assert_eq!(got, orig[base + k], "untouched t{t} h{h} k{k}");
                    }
                }
            }
        }
    }

    fn k2_like_small() -> RopeScaling {
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
            attention_factor: None,
        }
    }

    #[test]
    fn interleaved_is_deepseek_rope_up_to_a_fixed_permutation() {
        // HF deepseek_v3: out = cat([x_even·cos − x_odd·sin, x_odd·cos + x_even·sin]).
        // Ours keeps pairs adjacent: ours[2j] = hf[j], ours[2j+1] = hf[dim/2 + j],
        // exactly (same f32 operations).
        let rope = Rope::new(16, 50000.0, &k2_like_small());
        let positions = [0usize, 3, 1000];
        let orig = test_input(positions.len() * 2 * 16);
        let mut x = orig.clone();
        rope.apply_interleaved(&mut x, &positions, 2, 16, 0);
        let (mut cos, mut sin) = (vec![0.0; 8], vec![0.0; 8]);
        for (t, &pos) in positions.iter().enumerate() {
            rope.cos_sin(pos, &mut cos, &mut sin);
            for h in 0..2 {
                let v = &orig[(t * 2 + h) * 16..(t * 2 + h + 1) * 16];
                let mut hf = [0.0f32; 16];
                for j in 0..8 {
                    hf[j] = v[2 * j] * cos[j] - v[2 * j + 1] * sin[j];
                    hf[8 + j] = v[2 * j + 1] * cos[j] + v[2 * j] * sin[j];
                }
                let ours = &x[(t * 2 + h) * 16..(t * 2 + h + 1) * 16];
                for j in 0..8 {
                    assert_eq!(ours[2 * j], hf[j]);
                    assert_eq!(ours[2 * j + 1], hf[8 + j]);
                }
            }
        }
    }

    #[test]
    fn rotations_preserve_relative_position_dot_products() {
        // q at position m and k at n: q·k depends only on m − n (attention
        // factor 1 here). Tolerance 1e-4 absolute on O(1) dot products.
        let rope = Rope::new(32, 10000.0, &RopeScaling::Default);
        let q0 = test_input(32);
        let k0: Vec<f32> = test_input(64)[32..].to_vec();
        for interleaved in [false, true] {
            let dot_at = |m: usize, n: usize| {
                let (mut q, mut k) = (q0.clone(), k0.clone());
                if interleaved {
                    rope.apply_interleaved(&mut q, &[m], 1, 32, 0);
                    rope.apply_interleaved(&mut k, &[n], 1, 32, 0);
                } else {
                    rope.apply_rotate_half(&mut q, &[m], 1, 32, 0);
                    rope.apply_rotate_half(&mut k, &[n], 1, 32, 0);
                }
                q.iter().zip(&k).map(|(a, b)| a * b).sum::<f32>()
            };
            assert!((dot_at(10, 3) - dot_at(107, 100)).abs() < 1e-4);
            assert!(
                (dot_at(0, 0) - q0.iter().zip(&k0).map(|(a, b)| a * b).sum::<f32>()).abs() < 1e-5
            );
        }
    }
}
