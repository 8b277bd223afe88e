//! Grouped-query attention with RoPE over the paged KV cache (LLaMA family).

use caracal_kernels::attention::{write_kv, AttnShape};
use caracal_kernels::flash::{decode_attention_batch, paged_attention_tiled};
use caracal_kernels::paged::KvPool;
use caracal_kernels::rope::{Rope, RopePairs};
use caracal_kernels::Matrix;

use super::BatchLayout;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// One GQA self-attention layer.
pub struct GqaAttention {
    /// `[q_heads·head_dim, hidden]`.
    pub q_proj: Matrix,
    /// `[kv_heads·head_dim, hidden]`.
    pub k_proj: Matrix,
    /// `[kv_heads·head_dim, hidden]`.
    pub v_proj: Matrix,
    /// `[hidden, q_heads·head_dim]`.
    pub o_proj: Matrix,
    /// Head counts and sizes.
    pub shape: AttnShape,
    /// Index of this layer among the KV layers of the pool.
    pub kv_layer: usize,
}

impl GqaAttention {
    /// Loads `{prefix}.{q,k,v,o}_proj`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        hidden: usize,
        shape: AttnShape,
        kv_layer: usize,
    ) -> Result<GqaAttention> {
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        Ok(GqaAttention {
            q_proj: ckpt.matrix(&format!("{prefix}.q_proj.weight"), hq * d, hidden)?,
            k_proj: ckpt.matrix(&format!("{prefix}.k_proj.weight"), hkv * d, hidden)?,
            v_proj: ckpt.matrix(
                &format!("{prefix}.v_proj.weight"),
                hkv * shape.v_dim,
                hidden,
            )?,
            o_proj: ckpt.matrix(&format!("{prefix}.o_proj.weight"), hidden, hq * shape.v_dim)?,
            shape,
            kv_layer,
        })
    }

    /// Attention over `x` (normed hidden states of the whole batch).
    pub fn forward(
        &self,
        x: &[f32],
        layout: &BatchLayout,
        rope: &Rope,
        cache: &mut KvPool,
    ) -> Vec<f32> {
        let s = &self.shape;
        let [mut q, mut k, v] =
            Matrix::forward_group([&self.q_proj, &self.k_proj, &self.v_proj], x);
        let table = layout.rope_table(rope);
        rope.rotate_with(&mut q, table, RopePairs::Half, s.q_heads, s.head_dim, 0);
        rope.rotate_with(&mut k, table, RopePairs::Half, s.kv_heads, s.head_dim, 0);
        let scale = (s.head_dim as f32).powf(-0.5);
        let (qw, kw, vw, ow) = (
            s.q_heads * s.head_dim,
            s.kv_heads * s.head_dim,
            s.kv_heads * s.v_dim,
            s.q_heads * s.v_dim,
        );
        let mut out = vec![0.0; layout.rows * ow];
        for sl in &layout.seqs {
            let r = sl.row..sl.row + sl.len;
            write_kv(
                cache,
                self.kv_layer,
                &sl.block_table,
                sl.start_pos,
                &k[r.start * kw..r.end * kw],
                &v[r.start * vw..r.end * vw],
                s,
            );
        }
        // Every decoding sequence (one new token) in one call; prefill
        // chunks one sequence at a time.
        let decode = layout.decode_seqs();
        if !decode.is_empty() {
            decode_attention_batch(&q, cache, self.kv_layer, &decode, s, scale, &mut out);
        }
        for sl in layout.seqs.iter().filter(|sl| sl.len > 1) {
            let r = sl.row..sl.row + sl.len;
            paged_attention_tiled(
                &q[r.start * qw..r.end * qw],
                cache,
                self.kv_layer,
                &sl.block_table,
                sl.start_pos,
                s,
                scale,
                &mut out[r.start * ow..r.end * ow],
            );
        }
        self.o_proj.forward(&out)
    }
}
