//! MoE routing: expert scores, the selection-only correction bias,
//! group-limited top-k, and the weights the chosen experts are mixed with.
//!
//! Reference implementation whose numbers we match: transformers 5.x
//! `DeepseekV3TopkRouter` (Kimi K2) and `KimiLinearTopkRouter` (Kimi-Linear;
//! the same code). Reference doc §4.1. For one token with router logits `l`
//! (computed in f32 from the f32 `gate.weight`):
//!
//! ```text
//! s      = sigmoid(l)  or  softmax(l)           scores, f32
//! c      = s + bias                             selection scores (bias only selects)
//! group  = sum of the top-2 c of each of n_group equal groups
//! c      = −inf outside the topk_group best groups
//! idx    = top_k of c
//! w      = s[idx]                               unbiased (see `bias_in_weights`)
//! w      = w / (Σw + 1e-20)   if renormalize
//! w      = w · routed_scaling_factor
//! ```
//!
//! Differences from the reference doc, following transformers: masked groups
//! are filled with `−inf` (the doc, like the older DeepSeek remote code,
//! says `0.0`; with a negative correction bias `0.0` could let a masked
//! expert win). Ties (equal scores) go to the lower index; torch leaves the
//! order of ties unspecified.

use rayon::prelude::*;

/// How router logits become expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// `softmax` over all experts (DeepSeek-V2 style, `scoring_func "softmax"`).
    Softmax,
    /// Independent `sigmoid` per expert (`scoring_func "sigmoid"`: DeepSeek-V3,
    /// Kimi K2, Kimi-Linear, K3).
    Sigmoid,
}

/// Router hyper-parameters, read from a model's config.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Score function (`scoring_func`).
    pub scoring: Scoring,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Expert groups (`n_group`); 1 disables group limiting. Must divide the
    /// expert count.
    pub n_group: usize,
    /// Groups kept per token (`topk_group`), `1..=n_group`.
    pub topk_group: usize,
    /// Renormalise the chosen weights to sum to 1 (`norm_topk_prob`,
    /// Kimi-Linear's `moe_renormalize`).
    pub renormalize: bool,
    /// Multiplier applied to the final weights (`routed_scaling_factor`).
    pub routed_scaling_factor: f32,
    /// Kimi-Linear remote-code quirk: its `KimiMoEGate` adds the correction
    /// bias to the scores in place, so the weights it returns include the
    /// bias. transformers' `KimiLinearTopkRouter` does **not** do this (it
    /// gathers the unbiased scores, like DeepSeek-V3 and vLLM), so `false`
    /// matches transformers; `true` reproduces the remote code.
    pub bias_in_weights: bool,
}

/// Logistic sigmoid in f32.
#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Routes one token: returns `top_k` pairs `(expert, weight)` in the order
/// top-k yields them (descending selection score, ties to the lower index).
///
/// `logits` has one value per expert; `bias` (`e_score_correction_bias`, one
/// per expert) only changes which experts are selected unless
/// `cfg.bias_in_weights`.
///
/// # Panics
/// If `top_k` exceeds the expert count, `n_group` is 0 or does not divide
/// the expert count, `topk_group` is not in `1..=n_group`, or `bias` has the
/// wrong length.
pub fn route(logits: &[f32], bias: Option<&[f32]>, cfg: &RouterConfig) -> Vec<(usize, f32)> {
    let n = logits.len();
    assert!(
        cfg.top_k <= n,
        "route: top_k {} exceeds {n} experts",
        cfg.top_k
    );
    assert!(
        cfg.n_group > 0 && n.is_multiple_of(cfg.n_group),
        "route: n_group {} must divide {n} experts",
        cfg.n_group
    );
    assert!(
        (1..=cfg.n_group).contains(&cfg.topk_group),
        "route: topk_group {} must be in 1..={}",
        cfg.topk_group,
        cfg.n_group
    );
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "route: bias must have one value per expert");
    }

    let scores: Vec<f32> = match cfg.scoring {
        Scoring::Sigmoid => logits.iter().map(|&l| sigmoid(l)).collect(),
        Scoring::Softmax => {
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
            let sum: f32 = e.iter().sum();
            e.into_iter().map(|x| x / sum).collect()
        }
    };
    let mut choice: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };

    if cfg.topk_group < cfg.n_group {
        let size = n / cfg.n_group;
        let group_scores: Vec<f32> = choice
            .chunks_exact(size)
            .map(|grp| {
                let top = top_indices(grp, 2.min(size));
                top.iter().map(|&i| grp[i]).sum()
            })
            .collect();
        let keep = top_indices(&group_scores, cfg.topk_group);
        let mut kept = vec![false; cfg.n_group];
        for g in keep {
            kept[g] = true;
        }
        for (grp, &k) in choice.chunks_exact_mut(size).zip(&kept) {
            if !k {
                grp.fill(f32::NEG_INFINITY);
            }
        }
    }

    let idx = top_indices(&choice, cfg.top_k);
    let mut weights: Vec<f32> = idx
        .iter()
        .map(|&e| match (cfg.bias_in_weights, bias) {
            (true, Some(b)) => scores[e] + b[e],
            _ => scores[e],
        })
        .collect();
    if cfg.renormalize {
        let denom = weights.iter().sum::<f32>() + 1e-20;
        for w in weights.iter_mut() {
            *w /= denom;
        }
    }
    for w in weights.iter_mut() {
        *w *= cfg.routed_scaling_factor;
    }
    idx.into_iter().zip(weights).collect()
}

/// Routes `logits.len() / n_experts` tokens (`logits` is `[tokens,
/// n_experts]`), in parallel; one result per token, as [`route`].
///
/// # Panics
/// If `n_experts` is 0 or does not divide `logits.len()`, and as [`route`].
pub fn route_batch(
    logits: &[f32],
    n_experts: usize,
    bias: Option<&[f32]>,
    cfg: &RouterConfig,
) -> Vec<Vec<(usize, f32)>> {
    assert!(
        n_experts > 0 && logits.len().is_multiple_of(n_experts),
        "route_batch: logits must be [tokens, n_experts]"
    );
    logits
        .par_chunks(n_experts)
        .map(|row| route(row, bias, cfg))
        .collect()
}

/// Indices of the `k` largest values, largest first; ties go to the lower
/// index. NaN sorts above every number (`f32::total_cmp`), so a NaN logit
/// is visible in the routing rather than silently skipped.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    let order = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_by(order);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> RouterConfig {
        RouterConfig {
            scoring: Scoring::Sigmoid,
            top_k: 2,
            n_group: 1,
            topk_group: 1,
            renormalize: false,
            routed_scaling_factor: 1.0,
            bias_in_weights: false,
        }
    }

    /// Logit whose sigmoid is `p`.
    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    fn experts(r: &[(usize, f32)]) -> Vec<usize> {
        r.iter().map(|&(e, _)| e).collect()
    }

    #[test]
    fn strong_expert_in_weak_group_is_excluded() {
        // 8 experts in 4 groups of 2; keep 2 groups.
        // Group 0 = {0.99, 0.01} sums to 1.00; group 1 = {0.6, 0.6} = 1.2;
        // group 2 = {0.55, 0.55} = 1.1; group 3 = {0.1, 0.1}.
        let p = [0.99, 0.01, 0.6, 0.6, 0.55, 0.55, 0.1, 0.1];
        let logits: Vec<f32> = p.iter().map(|&x| logit(x)).collect();
        let c = RouterConfig {
            n_group: 4,
            topk_group: 2,
            top_k: 3,
            ..cfg()
        };
        let r = route(&logits, None, &c);
        assert_eq!(experts(&r), vec![2, 3, 4]);
        // Without group limiting expert 0 wins.
        let r = route(&logits, None, &RouterConfig { top_k: 3, ..cfg() });
        assert_eq!(experts(&r), vec![0, 2, 3]);
    }

    #[test]
    fn masked_groups_never_win_even_with_negative_selection_scores() {
        // A −2 bias makes every selection score negative. transformers masks
        // dropped groups with −inf, so only kept groups are chosen (a 0.0
        // mask would prefer the masked experts).
        let p = [0.9, 0.8, 0.2, 0.1];
        let logits: Vec<f32> = p.iter().map(|&x| logit(x)).collect();
        let bias = [-2.0; 4];
        let c = RouterConfig {
            n_group: 2,
            topk_group: 1,
            top_k: 2,
            ..cfg()
        };
        let r = route(&logits, Some(&bias), &c);
        assert_eq!(experts(&r), vec![0, 1]);
        let c = RouterConfig {
            n_group: 2,
            topk_group: 1,
            top_k: 2,
            ..cfg()
        };
        let bias = [-2.0, -2.0, 0.0, 0.0];
        let r = route(&logits, Some(&bias), &c);
        assert_eq!(experts(&r), vec![2, 3]);
    }

    #[test]
    fn bias_changes_selection_but_not_weights() {
        // Tolerance 1e-6 absolute.
        let p = [0.9, 0.5, 0.4, 0.3];
        let logits: Vec<f32> = p.iter().map(|&x| logit(x)).collect();
        let bias = [0.0, 0.0, 0.0, 0.7];
        let r = route(&logits, Some(&bias), &cfg());
        assert_eq!(experts(&r), vec![3, 0]); // 0.3 + 0.7 = 1.0 > 0.9
        assert!(
            (r[0].1 - 0.3).abs() < 1e-6,
            "weight of expert 3 is its unbiased score"
        );
        assert!((r[1].1 - 0.9).abs() < 1e-6);
    }

    #[test]
    fn bias_in_weights_quirk_adds_the_bias_to_the_weights() {
        // Tolerance 1e-6 absolute.
        let p = [0.9, 0.5, 0.4, 0.3];
        let logits: Vec<f32> = p.iter().map(|&x| logit(x)).collect();
        let bias = [0.05, 0.0, 0.0, 0.7];
        let c = RouterConfig {
            bias_in_weights: true,
            ..cfg()
        };
        let r = route(&logits, Some(&bias), &c);
        assert_eq!(experts(&r), vec![3, 0]);
        assert!((r[0].1 - 1.0).abs() < 1e-6);
        assert!((r[1].1 - 0.95).abs() < 1e-6);
    }

    #[test]
    fn renormalised_weights_sum_to_the_scaling_factor() {
        // Tolerance 1e-6 relative. w = s / (Σ s + 1e-20) · 2.827.
        let p = [0.2, 0.8, 0.6, 0.1, 0.4];
        let logits: Vec<f32> = p.iter().map(|&x| logit(x)).collect();
        let c = RouterConfig {
            top_k: 3,
            renormalize: true,
            routed_scaling_factor: 2.827,
            ..cfg()
        };
        let r = route(&logits, None, &c);
        assert_eq!(experts(&r), vec![1, 2, 4]);
        let sum = 0.8 + 0.6 + 0.4;
        for (&(_, w), want) in r.iter().zip([0.8, 0.6, 0.4]) {
            let want = want / sum * 2.827f32;
            assert!((w - want).abs() <= 1e-6 * want, "{w} vs {want}");
        }
        let total: f32 = r.iter().map(|x| x.1).sum();
        assert!((total - 2.827).abs() < 1e-5);
    }

    #[test]
    fn softmax_scoring_weights_are_probabilities() {
        // Tolerance 1e-6 absolute against an f64 softmax.
        let logits = [1.0f32, 3.0, -0.5, 2.0];
        let c = RouterConfig {
            scoring: Scoring::Softmax,
            ..cfg()
        };
        let r = route(&logits, None, &c);
        assert_eq!(experts(&r), vec![1, 3]);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((r[0].1 as f64 - 3f64.exp() / z).abs() < 1e-6);
        assert!((r[1].1 as f64 - 2f64.exp() / z).abs() < 1e-6);
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        let r = route(&[0.0; 6], None, &RouterConfig { top_k: 3, ..cfg() });
        assert_eq!(experts(&r), vec![0, 1, 2]);
    }

    #[test]
    fn batch_routes_each_token_like_route() {
        let c = RouterConfig {
            n_group: 2,
            topk_group: 1,
            top_k: 2,
            renormalize: true,
            ..cfg()
        };
        let logits: Vec<f32> = (0..5 * 8)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
            .collect();
        let bias: Vec<f32> = (0..8).map(|i| i as f32 * 0.01).collect();
        let batch = route_batch(&logits, 8, Some(&bias), &c);
        assert_eq!(batch.len(), 5);
        for (t, got) in batch.iter().enumerate() {
            assert_eq!(got, &route(&logits[t * 8..(t + 1) * 8], Some(&bias), &c));
        }
    }
}
