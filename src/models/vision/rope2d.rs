//! MoonViT's 2D rotary embedding (reference `kimi-architecture.md` §3.1):
//! with head width `D` and `f_i = θ^{−4i/D}` for `i < D/4`, the adjacent
//! pair `(x[2m], x[2m+1])` (real, imaginary) of each head is rotated by
//! `col · f_{m/2}` when `m` is even and by `row · f_{m/2}` when it is odd.
//! Applied to q and k of every block; a chunk's `t` frames reuse the table
//! of one frame.
//!
//! This is the published (Moonshot) layout of `wqkv`. transformers 5.x
//! permutes q/k rows at load time (`PermuteForRope`) and rotates halves
//! instead; its `save_pretrained` writes them back in this layout, so one
//! layout is all the loader needs.

/// Frequencies of one head width.
pub struct Rope2d {
    /// Per-head width (a multiple of 4).
    head_dim: usize,
    /// `f_i`, `i < head_dim / 4`, as transformers computes them in f32.
    inv_freq: Vec<f32>,
}

/// `cos`/`sin` of every token's `head_dim / 2` angles.
pub struct RopeTable {
    /// `[n, head_dim / 2]`.
    pub cos: Vec<f32>,
    /// `[n, head_dim / 2]`.
    pub sin: Vec<f32>,
}

impl Rope2d {
    /// The rotation of heads `head_dim` wide (a multiple of 4) with base `theta`.
    pub fn new(head_dim: usize, theta: f32) -> Rope2d {
        assert!(
            head_dim.is_multiple_of(4),
            "rope2d: head_dim must be a multiple of 4"
        );
        let spatial = (head_dim / 2) as f32;
        let inv_freq = (0..head_dim / 4)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / spatial))
            .collect();
        Rope2d { head_dim, inv_freq }
    }

    /// Angles of the tokens at `(row, col)`.
    pub fn table(&self, positions: &[(usize, usize)]) -> RopeTable {
        let half = self.head_dim / 2;
        let mut cos = vec![0.0; positions.len() * half];
        let mut sin = vec![0.0; positions.len() * half];
        for (n, &(row, col)) in positions.iter().enumerate() {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                for (m, pos) in [(2 * i, col), (2 * i + 1, row)] {
                    let a = pos as f32 * f;
                    cos[n * half + m] = a.cos();
                    sin[n * half + m] = a.sin();
                }
            }
        }
        RopeTable { cos, sin }
    }

    /// Rotates `x` (`[n, heads · head_dim]`) in place.
    pub fn apply(&self, x: &mut [f32], table: &RopeTable) {
        let half = self.head_dim / 2;
        let n = table.cos.len() / half;
        let width = x.len() / n.max(1);
        assert_eq!(x.len(), n * width, "rope2d: x is not [n, heads·head_dim]");
        for (t, row) in x.chunks_exact_mut(width).enumerate() {
            self.apply_token(row, table, t);
        }
    }

    /// Rotates every head of token `t`'s row (`[heads · head_dim]`).
    pub fn apply_token(&self, row: &mut [f32], table: &RopeTable, t: usize) {
        let (hd, half) = (self.head_dim, self.head_dim / 2);
        let (c, s) = (
            &table.cos[t * half..(t + 1) * half],
            &table.sin[t * half..(t + 1) * half],
        );
        for head in row.chunks_exact_mut(hd) {
            for (m, pair) in head.chunks_exact_mut(2).enumerate() {
                let (re, im) = (pair[0], pair[1]);
                pair[0] = re * c[m] - im * s[m];
                pair[1] = re * s[m] + im * c[m];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_pairs_turn_with_the_column_odd_pairs_with_the_row() {
        let r = Rope2d::new(8, 10000.0);
        let t = r.table(&[(3, 5)]);
        // Pair 0: col 5 · f_0 (= 1); pair 1: row 3 · f_0; pair 2: col 5 · f_1.
        let f1 = 1.0 / 10000f32.powf(0.5);
        for (m, a) in [(0, 5.0f32), (1, 3.0), (2, 5.0 * f1), (3, 3.0 * f1)] {
            assert!((t.cos[m] - a.cos()).abs() < 1e-6 && (t.sin[m] - a.sin()).abs() < 1e-6);
        }
        let mut x = vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0];
        r.apply(&mut x, &t);
        assert!((x[0] - 5f32.cos()).abs() < 1e-6 && (x[1] - 5f32.sin()).abs() < 1e-6);
        assert!((x[2] + 3f32.sin()).abs() < 1e-6 && (x[3] - 3f32.cos()).abs() < 1e-6);
    }
}
