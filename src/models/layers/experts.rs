//! Loading one routed expert's MLP from any of the checkpoint layouts
//! Caracal reads.
//!
//! Per-expert tensors come first: `{moe}.experts.{j}.{gate,up,down}.weight`
//! in a float dtype, or their compressed-tensors MXFP4 form
//! (`….weight_packed` + `….weight_scale`, what `caracal quantize` writes and
//! how Kimi K3 ships its experts; [`Checkpoint::matrix`] handles both). When
//! they are absent, the fused layout is read: `{moe}.experts.gate_up_proj`
//! `[E, 2I, H]` and `{moe}.experts.down_proj` `[E, H, I]`, either as gpt-oss
//! MXFP4 `_blocks` / `_scales` tensors or as float tensors
//! ([`Checkpoint::fused_expert_matrix`]). In the fused layout gate is rows
//! `[0, I)` and up rows `[I, 2I)` (transformers' concatenated halves, not
//! gpt-oss's interleaving). Every MoE architecture loads its experts here
//! ([`super::moe::MoeBlock::load`]), so each layout loads for each of them.

use super::{GluAct, Mlp};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// Loads routed expert `expert` of the MoE block at `moe_prefix`
/// (`model.layers.3.mlp`, `model.layers.3.block_sparse_moe`).
///
/// `names` are the per-expert sub-names (`["gate_proj", "up_proj",
/// "down_proj"]` or `["w1", "w3", "w2"]`); `hidden` is the model width and
/// `inter` the expert's intermediate width.
pub fn load_expert_mlp(
    ckpt: &Checkpoint,
    moe_prefix: &str,
    expert: usize,
    names: [&str; 3],
    hidden: usize,
    inter: usize,
    act: GluAct,
) -> Result<Mlp> {
    load_expert(ckpt, moe_prefix, expert, &[names], hidden, inter, act)
}

/// [`load_expert_mlp`] accepting several spellings of the per-expert
/// sub-names (the published one first; a checkpoint may use any of them),
/// then the fused layout. The error for a missing expert names the first
/// spelling and the fused tensors.
pub fn load_expert(
    ckpt: &Checkpoint,
    moe_prefix: &str,
    expert: usize,
    spellings: &[[&str; 3]],
    hidden: usize,
    inter: usize,
    act: GluAct,
) -> Result<Mlp> {
    let per_expert = format!("{moe_prefix}.experts.{expert}");
    for names in spellings {
        if ckpt.has_matrix(&format!("{per_expert}.{}.weight", names[0])) {
            return Mlp::load(ckpt, &per_expert, *names, hidden, inter, act);
        }
    }
    let gate_up = format!("{moe_prefix}.experts.gate_up_proj");
    let down = format!("{moe_prefix}.experts.down_proj");
    let fused = |base: &str| ckpt.has(base) || ckpt.has(&format!("{base}_blocks"));
    if !(fused(&gate_up) && fused(&down)) {
        let first = spellings.first().map_or("gate_proj", |n| n[0]);
        return Err(Error::MissingTensor {
            name: format!("{per_expert}.{first}.weight (nor fused {gate_up} / {down})"),
        });
    }
    Ok(Mlp {
        gate_proj: ckpt.fused_expert_matrix(&gate_up, expert, 0, inter, hidden)?,
        up_proj: ckpt.fused_expert_matrix(&gate_up, expert, inter, inter, hidden)?,
        down_proj: ckpt.fused_expert_matrix(&down, expert, 0, hidden, inter)?,
        act,
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use caracal_kernels::Matrix;
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;

    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    fn temp(tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("caracal-experts-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        p
    }

    fn write(dir: &std::path::Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.clone(),
                    TensorView::new(*d, s.clone(), b).expect("valid view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write");
    }

    fn mx(m: &Matrix) -> (Vec<u8>, Vec<u8>) {
        let (blocks, scales) = m.row_bytes();
        (blocks.into_owned(), scales.expect("mxfp4").into_owned())
    }

    #[test]
    fn fused_gpt_oss_layout_gives_the_same_mlp_as_per_expert_tensors() {
        let (e, inter, hidden) = (2usize, 32usize, 64usize);
        let (mut per, mut gu_b, mut gu_s, mut d_b, mut d_s) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for j in 0..e {
            let g = Matrix::quantize_mxfp4(inter, hidden, &values(inter * hidden, 1 + j as u64))
                .expect("quantize");
            let u = Matrix::quantize_mxfp4(inter, hidden, &values(inter * hidden, 11 + j as u64))
                .expect("quantize");
            let d = Matrix::quantize_mxfp4(hidden, inter, &values(hidden * inter, 21 + j as u64))
                .expect("quantize");
            for (name, m) in [("w1", &g), ("w3", &u), ("w2", &d)] {
                let (b, s) = mx(m);
                per.push((
                    format!("moe.experts.{j}.{name}.weight_packed"),
                    Dtype::U8,
                    vec![m.rows, m.cols / 2],
                    b,
                ));
                per.push((
                    format!("moe.experts.{j}.{name}.weight_scale"),
                    Dtype::U8,
                    vec![m.rows, m.cols / 32],
                    s,
                ));
            }
            for m in [&g, &u] {
                let (b, s) = mx(m);
                gu_b.extend(b);
                gu_s.extend(s);
            }
            let (b, s) = mx(&d);
            d_b.extend(b);
            d_s.extend(s);
        }
        let fused = vec![
            (
                "moe.experts.gate_up_proj_blocks".to_string(),
                Dtype::U8,
                vec![e, 2 * inter, hidden / 32, 16],
                gu_b,
            ),
            (
                "moe.experts.gate_up_proj_scales".to_string(),
                Dtype::U8,
                vec![e, 2 * inter, hidden / 32],
                gu_s,
            ),
            (
                "moe.experts.down_proj_blocks".to_string(),
                Dtype::U8,
                vec![e, hidden, inter / 32, 16],
                d_b,
            ),
            (
                "moe.experts.down_proj_scales".to_string(),
                Dtype::U8,
                vec![e, hidden, inter / 32],
                d_s,
            ),
        ];
        let (dp, df) = (temp("per"), temp("fused"));
        write(&dp, &per);
        write(&df, &fused);
        let (cp, cf) = (
            Checkpoint::open(&dp).expect("open"),
            Checkpoint::open(&df).expect("open"),
        );
        let x = values(3 * hidden, 7);
        for j in 0..e {
            let a = load_expert_mlp(
                &cp,
                "moe",
                j,
                ["w1", "w3", "w2"],
                hidden,
                inter,
                GluAct::Silu,
            )
            .expect("per-expert");
            let b = load_expert_mlp(
                &cf,
                "moe",
                j,
                ["w1", "w3", "w2"],
                hidden,
                inter,
                GluAct::Silu,
            )
            .expect("fused");
            // Same bytes through the same kernels: bit-identical outputs.
            assert_eq!(a.forward(&x), b.forward(&x), "expert {j}");
        }
        let err = load_expert_mlp(
            &cp,
            "other",
            0,
            ["w1", "w3", "w2"],
            hidden,
            inter,
            GluAct::Silu,
        )
        .err()
        .expect("missing")
        .to_string();
        assert!(
            err.contains("other.experts.0.w1.weight") && err.contains("other.experts.gate_up_proj"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dp);
        let _ = std::fs::remove_dir_all(&df);
    }
}
