//! DeepSeek-V3 / Kimi K2: MLA attention with a compressed latent cache, YaRN
//! RoPE, and a sigmoid-routed MoE with a selection-only bias, grouped top-k
//! and shared experts.
//!
//! Paper: "DeepSeek-V3 Technical Report" (arXiv 2412.19437); Kimi K2 ships the
//! same architecture as `model_type: kimi_k2`. Reference: transformers
//! `models/deepseek_v3/modeling_deepseek_v3.py`.
//! Tensor names: `model.layers.N.self_attn.{q_a_proj, q_a_layernorm, q_b_proj |
//! q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`,
//! `mlp.{gate.weight, gate.e_score_correction_bias, experts.E.{gate,up,down}_proj,
//! shared_experts.*}` and dense `mlp.{gate,up,down}_proj` below
//! `first_k_dense_replace`.

use caracal_kernels::mla::MlaShape;
use caracal_kernels::paged::KvPool;
use caracal_kernels::rope::{yarn_get_mscale, Rope, RopeScaling};
use caracal_kernels::Matrix;

use super::layers::mla::{MlaAttention, MlaOptions};
use super::layers::moe::{impl_moe_model, Ffn};
use super::layers::{
    add_inplace, load_lm_head, logits, model_info, BatchLayout, MissingHead, RmsNorm,
};
use super::{CausalLm, EngineError, ModelInfo, MoeModel, SeqBatch, SeqState};
use crate::checkpoint::arch::Arch;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// The `config.json` keys of `deepseek_v3` / `kimi_k2` (read once, into the [`Arch`]).
pub use crate::checkpoint::arch::keys::DeepseekV3Config;

struct Layer {
    input_layernorm: RmsNorm,
    self_attn: MlaAttention,
    post_attention_layernorm: RmsNorm,
    /// Dense below `first_k_dense_replace`, MoE from there on.
    ffn: Ffn,
}

/// A loaded DeepSeek-V3 / Kimi K2 model.
pub struct DeepseekV3 {
    info: ModelInfo,
    embed_tokens: Matrix,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Matrix,
    rope: Rope,
}

/// MLA softmax scale: `qk_head_dim^-0.5`, times `mscale²` under YaRN with
/// `mscale_all_dim` (transformers' `yarn_apply_mscale`).
pub fn mla_softmax_scale(qk_head_dim: usize, scaling: &RopeScaling) -> f32 {
    let base = (qk_head_dim as f32).powf(-0.5);
    match scaling {
        RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(m),
            ..
        } if *m != 0.0 => {
            let ms = yarn_get_mscale(*factor, *m);
            base * ms * ms
        }
        _ => base,
    }
}

impl DeepseekV3 {
    /// Loads the weights `arch` describes from `ckpt`.
    pub fn load(arch: &Arch, ckpt: &Checkpoint, eos_ids: Vec<u32>) -> Result<DeepseekV3> {
        let m = arch.mla.as_ref().expect("a deepseek_v3 Arch has MLA dims");
        let r = arch.rope.as_ref().expect("a deepseek_v3 Arch has RoPE");
        let (d, eps, root) = (arch.hidden_size, arch.rms_norm_eps, arch.root.as_str());
        let rope = Rope::new(m.qk_rope_head_dim, r.theta, &r.scaling);
        let shape = MlaShape {
            heads: m.heads,
            nope_dim: m.qk_nope_head_dim,
            rope_dim: m.qk_rope_head_dim,
            v_dim: m.v_head_dim,
            kv_lora_rank: m.kv_lora_rank,
        };
        let opts = MlaOptions {
            q_lora_rank: m.q_lora_rank,
            latent_norm_eps: m.latent_norm_eps,
            scale: mla_softmax_scale(m.qk_nope_head_dim + m.qk_rope_head_dim, &r.scaling),
            rope_interleave: m.rope_interleave,
        };
        let embed_tokens = ckpt.matrix(
            &format!("{root}model.embed_tokens.weight"),
            arch.vocab_size,
            d,
        )?;
        let mut layers = Vec::with_capacity(arch.num_layers());
        for i in 0..arch.num_layers() {
            let p = arch.layer_prefix(i);
            let ffn = Ffn::load(ckpt, &p, arch, i)?;
            layers.push(Layer {
                input_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.input_layernorm.weight"),
                    d,
                    eps,
                )?,
                self_attn: MlaAttention::load(
                    ckpt,
                    &format!("{p}.self_attn"),
                    d,
                    shape,
                    &opts,
                    arch.cache_index(i),
                )?,
                post_attention_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.post_attention_layernorm.weight"),
                    d,
                    eps,
                )?,
                ffn,
            });
        }
        let lm_head = load_lm_head(ckpt, arch, &embed_tokens, root, MissingHead::Error)?;
        let info = model_info(arch, ckpt, eos_ids);
        Ok(DeepseekV3 {
            info,
            embed_tokens,
            layers,
            norm: RmsNorm::load(ckpt, &format!("{root}model.norm.weight"), d, eps)?,
            lm_head,
            rope,
        })
    }
}

impl CausalLm for DeepseekV3 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_state(&self) -> SeqState {
        SeqState::default()
    }

    fn forward(
        &self,
        cache: &mut KvPool,
        batch: &mut [SeqBatch<'_>],
    ) -> std::result::Result<Vec<f32>, EngineError> {
        let layout = BatchLayout::prepare(batch, cache, true, self.info.max_position)?;
        let mut h = layout.embed(&self.embed_tokens)?;
        for layer in &self.layers {
            let a = layer.self_attn.forward(
                &layer.input_layernorm.forward(&h),
                &layout,
                Some(&self.rope),
                cache,
            );
            add_inplace(&mut h, &a);
            let x = layer.post_attention_layernorm.forward(&h);
            add_inplace(&mut h, &layer.ffn.forward(&x));
        }
        layout.commit(batch);
        Ok(logits(&h, &layout, &self.norm, &self.lm_head))
    }

    fn as_moe(&self) -> Option<&dyn MoeModel> {
        Some(self)
    }
}

impl_moe_model!(DeepseekV3, ffn);
