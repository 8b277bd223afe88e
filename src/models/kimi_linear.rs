//! Kimi Linear: a 3:1 hybrid of Kimi Delta Attention (linear, recurrent)
//! and NoPE MLA layers, with a DeepSeek-style sigmoid-routed MoE.
//!
//! Paper: "Kimi Linear: An Expressive, Efficient Attention Architecture"
//! (arXiv 2510.26692). Reference: transformers
//! `models/kimi_linear/modeling_kimi_linear.py` and Moonshot's
//! `modeling_kimi.py`. Published tensor names: KDA layers
//! `self_attn.{q,k,v}_proj, {q,k,v}_conv1d, f_a_proj, f_b_proj, dt_bias, A_log,
//! b_proj, g_a_proj, g_b_proj, o_norm, o_proj`; MLA layers as DeepSeek with
//! `q_proj`; MoE `block_sparse_moe.{gate, experts.E.{w1,w2,w3},
//! shared_experts}`; dense layers `mlp.{gate,up,down}_proj` (transformers
//! 5.x saves them as `block_sparse_moe.{gate,up,down}_proj`, also read).
//! Layer lists in `linear_attn_config` are 1-based; which layers are KDA or
//! MoE is decided by the checkpoint's [`Arch`].

use caracal_kernels::mla::MlaShape;
use caracal_kernels::paged::KvPool;
use caracal_kernels::Matrix;

use super::layers::kda::{KdaAttention, KdaOptions};
use super::layers::mla::{MlaAttention, MlaOptions};
use super::layers::moe::{impl_moe_model, Ffn};
use super::layers::{
    add_inplace, check_linear_states, load_lm_head, logits, model_info, BatchLayout, MissingHead,
    RmsNorm,
};
use super::{CausalLm, EngineError, ModelInfo, MoeModel, SeqBatch, SeqState};
use crate::checkpoint::arch::{Arch, AttentionKind};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::models::LinearState;

/// The `config.json` keys of `kimi_linear` (read once, into the [`Arch`]).
pub use crate::checkpoint::arch::keys::{KimiLinearConfig, LinearAttnConfig};

/// Token mixer of a Kimi Linear / K3 layer.
pub(super) enum Mixer {
    /// Kimi Delta Attention (recurrent state).
    Kda(Box<KdaAttention>),
    /// NoPE MLA (KV cache), with K3's output gate when configured.
    Mla(Box<MlaAttention>),
}

impl Mixer {
    /// Loads the token mixer of layer `i` (`{layer_prefix}.self_attn`).
    pub(super) fn load(
        ckpt: &Checkpoint,
        layer_prefix: &str,
        arch: &Arch,
        i: usize,
    ) -> Result<Mixer> {
        let attn_p = format!("{layer_prefix}.self_attn");
        let d = arch.hidden_size;
        Ok(match arch.layers[i].attention {
            AttentionKind::Kda => Mixer::Kda(Box::new(KdaAttention::load_with(
                ckpt,
                &attn_p,
                &KdaOptions::from_arch(arch)?,
                arch.cache_index(i),
            )?)),
            _ => {
                let m = arch.mla.as_ref().expect("a Kimi Arch has MLA dims");
                if !m.nope {
                    return Err(Error::Config(format!(
                        "{} with mla_use_nope=false is not supported",
                        arch.model_type.name()
                    )));
                }
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
                    scale: ((m.qk_nope_head_dim + m.qk_rope_head_dim) as f32).powf(-0.5),
                    rope_interleave: false,
                };
                let mla = MlaAttention::load(ckpt, &attn_p, d, shape, &opts, arch.cache_index(i))?;
                Mixer::Mla(Box::new(if m.output_gate {
                    mla.with_output_gate(ckpt, &attn_p, d)?
                } else {
                    mla
                }))
            }
        })
    }

    /// Runs the mixer on normed input `x`.
    pub(super) fn forward(
        &self,
        x: &[f32],
        layout: &BatchLayout,
        batch: &mut [SeqBatch<'_>],
        cache: &mut KvPool,
    ) -> Vec<f32> {
        match self {
            Mixer::Kda(kda) => kda.forward(x, layout, batch),
            Mixer::Mla(mla) => mla.forward(x, layout, None, cache),
        }
    }

    /// A fresh recurrent state, for KDA layers.
    pub(super) fn new_state(&self) -> Option<LinearState> {
        match self {
            Mixer::Kda(k) => Some(k.new_state()),
            Mixer::Mla(_) => None,
        }
    }
}

struct Layer {
    input_layernorm: RmsNorm,
    mixer: Mixer,
    post_attention_layernorm: RmsNorm,
    ffn: Ffn,
}

/// A loaded Kimi Linear model.
pub struct KimiLinear {
    info: ModelInfo,
    embed_tokens: Matrix,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Matrix,
}

impl KimiLinear {
    /// Loads the weights `arch` describes from `ckpt`.
    pub fn load(arch: &Arch, ckpt: &Checkpoint, eos_ids: Vec<u32>) -> Result<KimiLinear> {
        let (d, eps, root) = (arch.hidden_size, arch.rms_norm_eps, arch.root.as_str());
        let embed_tokens = ckpt.matrix(
            &format!("{root}model.embed_tokens.weight"),
            arch.vocab_size,
            d,
        )?;
        let mut layers = Vec::with_capacity(arch.num_layers());
        for i in 0..arch.num_layers() {
            let p = format!("{root}model.layers.{i}");
            let mixer = Mixer::load(ckpt, &p, arch, i)?;
            let ffn = Ffn::load(ckpt, &p, arch, i)?;
            layers.push(Layer {
                input_layernorm: RmsNorm::load(
                    ckpt,
                    &format!("{p}.input_layernorm.weight"),
                    d,
                    eps,
                )?,
                mixer,
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
        Ok(KimiLinear {
            info,
            embed_tokens,
            layers,
            norm: RmsNorm::load(ckpt, &format!("{root}model.norm.weight"), d, eps)?,
            lm_head,
        })
    }
}

impl CausalLm for KimiLinear {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_state(&self) -> SeqState {
        SeqState {
            linear: self
                .layers
                .iter()
                .filter_map(|l| l.mixer.new_state())
                .collect(),
            ..SeqState::default()
        }
    }

    fn forward(
        &self,
        cache: &mut KvPool,
        batch: &mut [SeqBatch<'_>],
    ) -> std::result::Result<Vec<f32>, EngineError> {
        check_linear_states(batch, self.info.linear_layers)?;
        let layout = BatchLayout::prepare(
            batch,
            cache,
            self.info.kv_layers > 0,
            self.info.max_position,
        )?;
        let mut h = layout.embed(&self.embed_tokens)?;
        for layer in &self.layers {
            let x = layer.input_layernorm.forward(&h);
            let a = layer.mixer.forward(&x, &layout, batch, cache);
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

impl_moe_model!(KimiLinear, ffn);
