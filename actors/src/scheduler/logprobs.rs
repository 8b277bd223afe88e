//! Per-token log-probabilities.
//!
//! Log-probabilities are the log-softmax of the model's raw logits row
//! (before penalties, temperature and grammar masks), as vLLM reports them
//! by default: `logprob(t) = l_t − max − ln Σ_j exp(l_j − max)`. The top-k
//! alternatives are the k largest logits, ties broken by the smaller id.

use crate::messages::TokenLogprob;

/// Log-probability of `token` and the `k` most likely tokens under the
/// softmax of `logits`.
pub(super) fn token_logprob(logits: &[f32], token: u32, k: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let norm = max + sum.ln() as f32;
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| l - norm);
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() == k && l <= top[k - 1].1 {
                continue;
            }
            let at = top.partition_point(|&(_, v)| v >= l);
            top.insert(at, (i as u32, l));
            top.truncate(k);
        }
    }
    for e in &mut top {
        e.1 -= norm;
    }
    TokenLogprob { logprob, top }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_with_sorted_alternatives() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let lp = token_logprob(&logits, 2, 3);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        // Tolerance: f32 rounding of a 5-term softmax.
        assert!((lp.logprob - (2.0f32.exp() / z).ln()).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 2], "ties keep the smaller id first");
        assert!((lp.top[0].1 - (3.0f32.exp() / z).ln()).abs() < 1e-6);
        let total: f32 = token_logprob(&logits, 0, 5)
            .top
            .iter()
            .map(|t| t.1.exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(token_logprob(&logits, 0, 0).top.is_empty());
    }
}
