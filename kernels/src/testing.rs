//! Deterministic pseudo-random data for tests, benches and examples.
//!
//! [`Rng`] is Marsaglia's xorshift64 (shifts 13, 7, 17): one `u64` of state,
//! no dependency, the same stream on every machine. It is not the generator
//! that samples tokens (that is [`crate::sampling::Rng`], xoshiro256**), and
//! it is not for anything that must be unpredictable.
//!
//! The streams are part of the tests' inputs: changing the algorithm or the
//! float mapping changes the data every kernel test and bench runs on.

/// The golden-ratio odd constant that [`Rng::seeded`] multiplies seeds by.
const SEED_MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// A xorshift64 generator (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator whose state is exactly `state`. Zero, the one state
    /// xorshift never leaves, is replaced by an odd constant. Small states
    /// give a few values near −1 first; [`Rng::seeded`] avoids that.
    pub fn new(state: u64) -> Rng {
        Rng(if state == 0 { SEED_MIX } else { state })
    }

    /// A generator for a small seed (0, 1, 2, …): the seed is spread over
    /// the state (`seed · 0x9E37_79B9_7F4A_7C15 | 1`), so that neighbouring
    /// seeds give unrelated streams from their first value on.
    pub fn seeded(seed: u64) -> Rng {
        Rng::new(seed.wrapping_mul(SEED_MIX) | 1)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `[-1, 1)`, on a grid of 2⁻²³ (the top 24 bits of
    /// [`Rng::next_u64`]).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `len` values uniform in `[-scale, scale)`.
    pub fn vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.next_f32() * scale).collect()
    }
}

/// `len` values uniform in `[-1, 1)` from [`Rng::seeded`]`(seed)`.
pub fn values(seed: u64, len: usize) -> Vec<f32> {
    Rng::seeded(seed).vec(len, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_is_xorshift64_with_13_7_17_shifts() {
        // The first outputs from state 1, worked by hand:
        // 1 ^ 1<<13 = 0x2001; ^ >>7 = 0x2041; ^ <<17 = 0x4082_2041.
        let mut r = Rng::new(1);
        assert_eq!(r.next_u64(), 0x4082_2041);
        let mut z = Rng::new(0);
        assert_ne!(z.next_u64(), 0, "state 0 is replaced");
    }

    #[test]
    fn floats_are_uniform_in_minus_one_to_one() {
        let v = Rng::seeded(3).vec(100_000, 1.0);
        assert!(v.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        let below = v.iter().filter(|&&x| x < -0.5).count() as f64 / v.len() as f64;
        assert!((below - 0.25).abs() < 0.01, "quarter below -0.5: {below}");
        assert_eq!(values(3, 10), v[..10]);
        assert_ne!(values(4, 10), v[..10], "seeds give different streams");
    }
}
