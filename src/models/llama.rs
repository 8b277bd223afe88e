//! LLaMA-family dense decoder (GQA, RoPE, SwiGLU, RMSNorm), e.g. SmolLM2.
//!
//! Paper: "LLaMA: Open and Efficient Foundation Language Models" (arXiv
//! 2302.13971). Reference: transformers `models/llama/modeling_llama.py`.
//! Tensor names: `model.embed_tokens`, `model.layers.N.{input_layernorm,
//! self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`,
//! `model.norm`, `lm_head` (absent when `tie_word_embeddings`).

use std::path::Path;

use caracal_kernels::attention::AttnShape;
use caracal_kernels::paged::KvPool;
use caracal_kernels::rope::Rope;
use caracal_kernels::Matrix;
use serde::Deserialize;
use serde_json::Value;

use super::layers::gqa::GqaAttention;
use super::layers::{add_inplace, embed, logits, BatchLayout, GluAct, Mlp, RmsNorm};
use super::{CausalLm, EngineError, ModelInfo, SeqBatch, SeqState};
use crate::checkpoint::Checkpoint;
use crate::config::{defaults, parse_config, rope_from_config};
use crate::error::Result;

/// `config.json` of a `llama` checkpoint (absent keys get transformers' defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size.
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// Model width.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// SwiGLU width.
    #[serde(default = "d_inter")]
    pub intermediate_size: usize,
    /// Decoder layers.
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// Query heads.
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// KV heads (defaults to the query heads).
    pub num_key_value_heads: Option<usize>,
    /// Head size (defaults to hidden / heads).
    pub head_dim: Option<usize>,
    /// Activation of the MLP.
    #[serde(default = "defaults::silu")]
    pub hidden_act: String,
    /// Context length.
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    /// RMSNorm eps.
    #[serde(default = "defaults::eps_1e6")]
    pub rms_norm_eps: f32,
    /// Whether `lm_head` reuses the embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v/o (unsupported when true).
    #[serde(default)]
    pub attention_bias: bool,
}

fn d_vocab() -> usize {
    32000
}
fn d_hidden() -> usize {
    4096
}
fn d_inter() -> usize {
    11008
}
fn d_layers() -> usize {
    32
}
fn d_heads() -> usize {
    32
}
fn d_max_pos() -> usize {
    2048
}

/// One decoder layer.
struct LlamaLayer {
    input_layernorm: RmsNorm,
    self_attn: GqaAttention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
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
    /// Loads the weights named by `config` from `ckpt`.
    pub fn load(config: &Value, cfg_path: &Path, ckpt: &Checkpoint, eos_ids: Vec<u32>) -> Result<Llama> {
        let c: LlamaConfig = parse_config(config, cfg_path)?;
        if c.attention_bias {
            return Err(crate::error::Error::Config("llama with attention_bias=true is not supported".into()));
        }
        let heads = c.num_attention_heads;
        let kv_heads = c.num_key_value_heads.unwrap_or(heads);
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / heads);
        let (theta, scaling) = rope_from_config(config, defaults::theta_10k())?;
        let rope = Rope::new(head_dim, theta, &scaling);
        let act = GluAct::from_name(&c.hidden_act)?;
        let d = c.hidden_size;
        let embed_tokens = ckpt.matrix("model.embed_tokens.weight", c.vocab_size, d)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let shape = AttnShape { q_heads: heads, kv_heads, head_dim, v_dim: head_dim };
            layers.push(LlamaLayer {
                input_layernorm: RmsNorm::load(ckpt, &format!("{p}.input_layernorm.weight"), d, c.rms_norm_eps)?,
                self_attn: GqaAttention::load(ckpt, &format!("{p}.self_attn"), d, shape, i)?,
                post_attention_layernorm: RmsNorm::load(ckpt, &format!("{p}.post_attention_layernorm.weight"), d, c.rms_norm_eps)?,
                mlp: Mlp::load(ckpt, &format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"], d, c.intermediate_size, act)?,
            });
        }
        let lm_head = if c.tie_word_embeddings || !ckpt.has("lm_head.weight") {
            embed_tokens.clone()
        } else {
            ckpt.matrix("lm_head.weight", c.vocab_size, d)?
        };
        let info = ModelInfo {
            model_type: "llama".into(),
            vocab_size: c.vocab_size,
            max_position: c.max_position_embeddings,
            kv_layers: c.num_hidden_layers,
            kv_width: kv_heads * head_dim * 2,
            linear_layers: 0,
            eos_ids,
            num_params: ckpt.total_params(),
        };
        Ok(Llama {
            info,
            embed_tokens,
            layers,
            norm: RmsNorm::load(ckpt, "model.norm.weight", d, c.rms_norm_eps)?,
            lm_head,
            rope,
        })
    }
}

impl CausalLm for Llama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_state(&self) -> SeqState {
        SeqState::default()
    }

    fn forward(&self, cache: &mut KvPool, batch: &mut [SeqBatch<'_>]) -> std::result::Result<Vec<f32>, EngineError> {
        let layout = BatchLayout::prepare(batch, cache, true, self.info.max_position)?;
        let mut h = embed(&self.embed_tokens, &layout.tokens)?;
        for layer in &self.layers {
            let a = layer.self_attn.forward(&layer.input_layernorm.forward(&h), &layout, &self.rope, cache);
            add_inplace(&mut h, &a);
            let m = layer.mlp.forward(&layer.post_attention_layernorm.forward(&h));
            add_inplace(&mut h, &m);
        }
        layout.commit(batch);
        Ok(logits(&h, &layout, &self.norm, &self.lm_head))
    }
}
