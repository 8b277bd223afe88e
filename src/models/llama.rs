//! LLaMA-family decoder (GQA, RoPE, SwiGLU, RMSNorm), e.g. SmolLM2, with an
//! optional DeepSeek-V3 / Kimi K2 MoE feed-forward.
//!
//! Paper: "LLaMA: Open and Efficient Foundation Language Models" (arXiv
//! 2302.13971). Reference: transformers `models/llama/modeling_llama.py`.
//! Tensor names: `model.embed_tokens`, `model.layers.N.{input_layernorm,
//! self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`,
//! `model.norm`, `lm_head` (absent when `tie_word_embeddings`).
//!
//! **MoE extension (Caracal).** A `llama` config that carries the DeepSeek-V3
//! MoE keys (`n_routed_experts`, `num_experts_per_tok`,
//! `moe_intermediate_size`, `n_shared_experts`, `first_k_dense_replace`,
//! `n_group`, `topk_group`, `routed_scaling_factor`, `norm_topk_prob`,
//! `scoring_func`; see [`LlamaMoeConfig`]) keeps LLaMA's GQA attention and
//! turns layers `>= first_k_dense_replace` into the DeepSeek-V3 / Kimi K2 MoE
//! block with its published tensor names: `mlp.gate.weight`,
//! `mlp.gate.e_score_correction_bias`, `mlp.experts.E.{gate,up,down}_proj`,
//! `mlp.shared_experts.{gate,up,down}_proj` (DeepSeek-V3 paper §2.1.2;
//! transformers `modeling_deepseek_v3.py` `DeepseekV3MoE`). No published
//! architecture combines GQA with that MoE: it exists so that an MoE built
//! exactly from a trained dense model (`caracal moeify`) can run, because
//! MLA cannot be derived exactly from GQA. A config without
//! `n_routed_experts` loads the plain dense model. Which layers are MoE and
//! the router settings come from the checkpoint's [`Arch`].

use caracal_kernels::attention::AttnShape;
use caracal_kernels::paged::KvPool;
use caracal_kernels::rope::Rope;
use caracal_kernels::Matrix;

use super::layers::gqa::GqaAttention;
use super::layers::moe::{impl_moe_model, Ffn};
use super::layers::{
    add_inplace, load_lm_head, logits, model_info, BatchLayout, MissingHead, RmsNorm,
};
use super::{CausalLm, EngineError, ModelInfo, MoeModel, SeqBatch, SeqState};
use crate::checkpoint::arch::Arch;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// The `config.json` keys of `llama` and of its MoE extension (read once,
/// into the [`Arch`]; `caracal moeify` writes [`LlamaMoeConfig`]).
pub use crate::checkpoint::arch::keys::{LlamaConfig, LlamaMoeConfig};

/// One decoder layer.
struct LlamaLayer {
    input_layernorm: RmsNorm,
    self_attn: GqaAttention,
    post_attention_layernorm: RmsNorm,
    /// LLaMA's SwiGLU MLP, or the DeepSeek-V3 MoE block.
    mlp: Ffn,
}

/// A loaded LLaMA model.
pub struct Llama {
    info: ModelInfo,
    embed_tokens: Matrix,
    layers: Vec<LlamaLayer>,
    norm: RmsNorm,
    lm_head: Matrix,
    rope: Rope,
}

impl Llama {
    /// Loads the weights `arch` describes from `ckpt`.
    pub fn load(arch: &Arch, ckpt: &Checkpoint, eos_ids: Vec<u32>) -> Result<Llama> {
        let g = arch.gqa.as_ref().expect("a llama Arch has GQA dims");
        if g.bias {
            return Err(Error::Config(
                "llama with attention_bias=true is not supported".into(),
            ));
        }
        let r = arch.rope.as_ref().expect("a llama Arch has RoPE");
        let rope = Rope::new(g.head_dim, r.theta, &r.scaling);
        let (d, eps, root) = (arch.hidden_size, arch.rms_norm_eps, arch.root.as_str());
        let embed_tokens = ckpt.matrix(
            &format!("{root}model.embed_tokens.weight"),
            arch.vocab_size,
            d,
        )?;
        let shape = AttnShape {
            q_heads: g.heads,
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
            v_dim: g.head_dim,
        };
        let mut layers = Vec::with_capacity(arch.num_layers());
        for i in 0..arch.num_layers() {
            let p = format!("{root}model.layers.{i}");
            layers.push(LlamaLayer {
                input_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.input_layernorm.weight"),
                    d,
                    eps,
                )?,
                self_attn: GqaAttention::load(
                    ckpt,
                    &format!("{p}.self_attn"),
                    d,
                    shape,
                    arch.cache_index(i),
                )?,
                post_attention_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.post_attention_layernorm.weight"),
                    d,
                    eps,
                )?,
                mlp: Ffn::load(ckpt, &p, arch, i)?,
            });
        }
        let lm_head = load_lm_head(ckpt, arch, &embed_tokens, root, MissingHead::Tie)?;
        let info = model_info(arch, ckpt, eos_ids);
        Ok(Llama {
            info,
            embed_tokens,
            layers,
            norm: RmsNorm::load(ckpt, &format!("{root}model.norm.weight"), d, eps)?,
            lm_head,
            rope,
        })
    }

    /// Whether any layer is an MoE block (the config carried `n_routed_experts`).
    pub fn is_moe(&self) -> bool {
        self.layers.iter().any(|l| l.mlp.moe().is_some())
    }
}

impl CausalLm for Llama {
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
                &self.rope,
                cache,
            );
            add_inplace(&mut h, &a);
            let x = layer.post_attention_layernorm.forward(&h);
            add_inplace(&mut h, &layer.mlp.forward(&x));
        }
        layout.commit(batch);
        Ok(logits(&h, &layout, &self.norm, &self.lm_head))
    }

    fn as_moe(&self) -> Option<&dyn MoeModel> {
        if self.is_moe() {
            Some(self)
        } else {
            None
        }
    }
}

impl_moe_model!(Llama, mlp);
