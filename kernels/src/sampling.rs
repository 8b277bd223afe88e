//! Next-token sampling from logits.
//!
//! Order of operations follows vLLM: repetition / presence / frequency
//! penalties on the raw logits, then temperature, then top-k, top-p and
//! min-p filtering of the probabilities, then a draw from a seeded PRNG.
//! Temperature 0 is greedy (argmax, first index wins ties).

use std::collections::HashMap;

/// Sampling settings of one request. Defaults: greedy off (temperature 1),
/// no filtering, no penalties.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy. Range `[0, 100]`, default 1.
    pub temperature: f32,
    /// Nucleus mass kept; `1.0` disables. Range `(0, 1]`.
    pub top_p: f32,
    /// Candidates kept; `0` disables.
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p · p_max`; `0` disables.
    pub min_p: f32,
    /// PRNG seed; `None` draws one from the clock.
    pub seed: Option<u64>,
    /// Divide positive (multiply negative) logits of seen tokens; `1.0` disables.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every generated token seen.
    pub presence_penalty: f32,
    /// Subtracted per occurrence of a generated token.
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    /// Whether [`apply_penalties`] changes any logit.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// A small, fast, seedable PRNG (xoshiro256**), seeded through SplitMix64.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator from a 64-bit seed.
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// A generator seeded from the clock.
    pub fn from_clock() -> Rng {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Rng::new(t)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Applies repetition, presence and frequency penalties in place.
/// `prompt` counts for the repetition penalty only; `generated` for all three.
pub fn apply_penalties(logits: &mut [f32], prompt: &[u32], generated: &[u32], p: &SamplingParams) {
    if p.repetition_penalty != 1.0 {
        let mut seen: Vec<u32> = prompt.iter().chain(generated).copied().collect();
        seen.sort_unstable();
        seen.dedup();
        for t in seen {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts: HashMap<u32, usize> = HashMap::new();
        for &t in generated {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
    }
}

/// Index of the largest value (first wins ties, NaN never wins against a
/// number; 0 for an empty slice): [`crate::softmax::argmax`].
pub fn argmax(x: &[f32]) -> usize {
    if x.is_empty() {
        return 0;
    }
    crate::softmax::argmax(x)
}

/// Picks the next token from `logits` (already penalised).
pub fn sample(logits: &[f32], p: &SamplingParams, rng: &mut Rng) -> u32 {
    if p.temperature <= 0.0 || p.top_k == 1 {
        return argmax(logits) as u32;
    }
    // Candidates sorted by logit, descending (ties by lower id).
    let mut idx: Vec<usize> = (0..logits.len())
        .filter(|&i| logits[i].is_finite())
        .collect();
    if idx.is_empty() {
        return argmax(logits) as u32;
    }
    idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if p.top_k > 0 && idx.len() > p.top_k {
        idx.truncate(p.top_k);
    }
    let inv_t = 1.0 / p.temperature as f64;
    let max = logits[idx[0]] as f64;
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i] as f64 - max) * inv_t).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    for q in probs.iter_mut() {
        *q /= total;
    }
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        for (j, &q) in probs.iter().enumerate() {
            cum += q;
            if cum >= p.top_p as f64 {
                keep = j + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = probs[0] * p.min_p as f64;
        keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
    }
    let mass: f64 = probs[..keep].iter().sum();
    let mut r = rng.next_f64() * mass;
    for j in 0..keep {
        r -= probs[j];
        if r <= 0.0 {
            return idx[j] as u32;
        }
    }
    idx[keep - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temperature_zero_is_argmax() {
        let mut rng = Rng::new(1);
        assert_eq!(
            sample(&[0.1, 3.0, 2.9], &SamplingParams::greedy(), &mut rng),
            1
        );
    }

    #[test]
    fn same_seed_gives_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 0.8,
            seed: Some(7),
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut r = Rng::new(7);
            (0..20).map(|_| sample(&logits, &p, &mut r)).collect()
        };
        let b: Vec<u32> = {
            let mut r = Rng::new(7);
            (0..20).map(|_| sample(&logits, &p, &mut r)).collect()
        };
        assert_eq!(a, b);
    }

    #[test]
    fn top_k_restricts_to_the_k_best() {
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            ..Default::default()
        };
        let mut rng = Rng::new(3);
        for _ in 0..200 {
            let t = sample(&logits, &p, &mut rng);
            assert!(t == 0 || t == 1, "got {t}");
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        // p ≈ [0.88, 0.12, ~0]: top_p 0.5 keeps only the first.
        let logits = [2.0, 0.0, -20.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        };
        let mut rng = Rng::new(5);
        for _ in 0..100 {
            assert_eq!(sample(&logits, &p, &mut rng), 0);
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = [0.0, -0.1, -5.0];
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            ..Default::default()
        };
        let mut rng = Rng::new(9);
        for _ in 0..200 {
            assert_ne!(sample(&logits, &p, &mut rng), 2);
        }
    }

    #[test]
    fn sampling_frequencies_follow_the_softmax() {
        let logits = [0.0f32, (2.0f32).ln()]; // p = [1/3, 2/3]
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let mut rng = Rng::new(11);
        let ones = (0..30_000)
            .filter(|_| sample(&logits, &p, &mut rng) == 1)
            .count();
        let frac = ones as f64 / 30_000.0;
        assert!((frac - 2.0 / 3.0).abs() < 0.02, "frequency {frac}");
    }

    #[test]
    fn penalties_push_seen_tokens_down() {
        let mut l = vec![2.0, -2.0, 1.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        apply_penalties(&mut l, &[0], &[1, 1], &p);
        assert_eq!(l[0], 1.0); // 2 / 2
        assert_eq!(l[1], -4.0 - 0.5 - 0.5); // -2·2, presence, 2 × frequency
        assert_eq!(l[2], 1.0);
    }
}
