//! MoE routing of one decode token at Kimi shapes: sigmoid scores, the
//! selection-only correction bias, top-k (K3: 896 experts, top-16, one
//! group; K2: 384 experts, top-8, one group). `route` runs once per token
//! and MoE layer on the step's own thread, between the router product and
//! the experts, so its time adds to every decode step.

use std::hint::black_box;

use caracal_kernels::moe::{route, RouterConfig, Scoring};
use caracal_kernels::testing::values;
use criterion::{criterion_group, criterion_main, Criterion};

fn bench_route(c: &mut Criterion) {
    for (experts, top_k) in [(896, 16), (384, 8)] {
        let logits = values(1, experts);
        let bias: Vec<f32> = values(2, experts).iter().map(|b| 0.01 * b).collect();
        let cfg = RouterConfig {
            scoring: Scoring::Sigmoid,
            top_k,
            n_group: 1,
            topk_group: 1,
            renormalize: true,
            routed_scaling_factor: 2.5,
            bias_in_weights: false,
        };
        c.bench_function(&format!("route_{experts}_top{top_k}"), |b| {
            b.iter(|| route(black_box(&logits), Some(&bias), &cfg))
        });
    }
}

criterion_group!(benches, bench_route);
criterion_main!(benches);
