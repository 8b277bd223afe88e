//! Kimi K3 (text backbone): Kimi Linear's 3:1 KDA / NoPE-MLA hybrid with
//! Block Attention Residuals, a bounded KDA forget gate, full-rank output
//! gates, gated MLA, SiTU activations and a latent MoE with MXFP4 experts.
//!
//! Papers: "Kimi Linear" (arXiv 2510.26692), "Attention Residuals"
//! (arXiv 2603.15031), "Kimi K3 Technical Report" (arXiv 2607.24653).
//! Reference implementations: Moonshot's `modeling_kimi_linear.py` shipped
//! with `moonshotai/Kimi-K3` (read through third-party transcriptions) and
//! TokenSpeed's `kimi_k3.py`; formulas in the reference doc §1, §2, §4.1,
//! §6.3. The numbers are checked against `tools/k3_reference.py`, built
//! from transformers' `kimi_linear` modules plus the K3 pieces.
//!
//! Per layer `l` (block size `B = attn_res_block_size`, §2.3):
//!
//! ```text
//! h = input_layernorm(Mix_attn(blocks + [prefix]))
//! if l % B == 0 { blocks.push(prefix); prefix = attn(h) } else { prefix += attn(h) }
//! h = post_attention_layernorm(Mix_mlp(blocks + [prefix]))
//! prefix += ffn(h)                       # dense SiTU MLP (layer 0) or latent MoE
//! ```
//!
//! then `logits = lm_head(norm(Mix_out(blocks + [prefix])))`, where `prefix`
//! starts as the embedding. Without `attn_res_block_size` the layers use the
//! plain pre-norm residual of Kimi Linear.
//!
//! Checkpoint layout: the multimodal wrapper (`model_type: "kimi_k3"`,
//! `text_config`, `vision_config`; tensors `language_model.model.*` and
//! `language_model.lm_head.weight`) or a text-only one (flat config,
//! `model.*`, `lm_head.weight`). When the wrapper's `vision_config` is set
//! and the checkpoint has the tower (`vision_tower.*`, `mm_projector.*`),
//! the MoonViT3d tower with K3's switches (RMSNorm, no biases,
//! `qkv_hidden_size`, bilinear position grid, `patchmergerv2`) is loaded
//! through [`super::vision`] and offered as [`CausalLm::vision`]; a wrapper
//! without tower tensors loads text-only. Routed experts load as MXFP4
//! (`weight_packed` + `weight_scale`) or float `.weight`.
//!
//! Choices where sources disagree (all switchable from `config.json`):
//! - `A_log` shape: `linear_attn_config.a_log_layout` (see
//!   [`crate::checkpoint::arch::ALogLayout`]).
//! - eps of `q_a_layernorm` / `kv_a_layernorm`: `mla_latent_norm_eps`
//!   (Caracal key), default 1e-6 as Moonshot's module builds them
//!   (TokenSpeed and vLLM use `rms_norm_eps`).

use caracal_kernels::paged::KvPool;
use caracal_kernels::Matrix;

use super::kimi_linear::Mixer;
use super::layers::attn_res::{AttnResWeights, BlockHistory};
use super::layers::moe::{impl_moe_model, Ffn};
use super::layers::{
    add_inplace, check_linear_states, load_lm_head, logits, model_info, BatchLayout, MissingHead,
    RmsNorm,
};
use super::vision::MoonVit3d;
use super::{CausalLm, EngineError, ModelInfo, MoeModel, SeqBatch, SeqState, VisionTower};
use crate::checkpoint::arch::Arch;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// The K3 `config.json` keys (read once, into the [`Arch`]) and the text
/// part of a K3 config.
pub use crate::checkpoint::arch::keys::{K3Extensions, K3LinearAttnConfig};
pub use crate::checkpoint::arch::text_config;

/// The two AttnRes mixes of a decoder layer.
struct LayerAttnRes {
    /// Before the token mixer (`self_attention_res_{norm,proj}`).
    attn: AttnResWeights,
    /// Before the FFN (`mlp_res_{norm,proj}`).
    mlp: AttnResWeights,
}

struct Layer {
    attn_res: Option<LayerAttnRes>,
    input_layernorm: RmsNorm,
    mixer: Mixer,
    post_attention_layernorm: RmsNorm,
    /// Dense SiTU MLP (layer 0) or latent MoE.
    ffn: Ffn,
}

/// A loaded Kimi K3 text model.
pub struct KimiK3 {
    info: ModelInfo,
    embed_tokens: Matrix,
    layers: Vec<Layer>,
    /// AttnRes block size (`None`: plain residuals).
    block_size: Option<usize>,
    /// The final mix before `norm` (`output_attn_res_{norm,proj}`).
    output_attn_res: Option<AttnResWeights>,
    norm: RmsNorm,
    lm_head: Matrix,
    /// `rms_norm_eps`, also the eps of AttnRes scores.
    eps: f32,
    /// The vision tower, when the checkpoint has one.
    vision: Option<MoonVit3d>,
}

impl KimiK3 {
    /// Loads the text backbone `arch` describes from `ckpt`.
    pub fn load(arch: &Arch, ckpt: &Checkpoint, eos_ids: Vec<u32>) -> Result<KimiK3> {
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
            let attn_res = match arch.attn_res_block_size {
                Some(_) => Some(LayerAttnRes {
                    attn: AttnResWeights::load(
                        ckpt,
                        &format!("{p}.self_attention_res_norm.weight"),
                        &format!("{p}.self_attention_res_proj.weight"),
                        d,
                    )?,
                    mlp: AttnResWeights::load(
                        ckpt,
                        &format!("{p}.mlp_res_norm.weight"),
                        &format!("{p}.mlp_res_proj.weight"),
                        d,
                    )?,
                }),
                None => None,
            };
            layers.push(Layer {
                attn_res,
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
        let output_attn_res = match arch.attn_res_block_size {
            Some(_) => Some(AttnResWeights::load(
                ckpt,
                &format!("{root}model.output_attn_res_norm.weight"),
                &format!("{root}model.output_attn_res_proj.weight"),
                d,
            )?),
            None => None,
        };
        let lm_head = load_lm_head(ckpt, arch, &embed_tokens, root, MissingHead::Error)?;
        let info = model_info(arch, ckpt, eos_ids);
        let vision = match &arch.vision_config {
            Some(cfg) if ckpt.has_matrix("vision_tower.encoder.blocks.0.wqkv.weight") => {
                Some(MoonVit3d::load(ckpt, cfg)?)
            }
            _ => None,
        };
        Ok(KimiK3 {
            vision,
            info,
            embed_tokens,
            layers,
            block_size: arch.attn_res_block_size,
            output_attn_res,
            norm: RmsNorm::load(ckpt, &format!("{root}model.norm.weight"), d, eps)?,
            lm_head,
            eps,
        })
    }
}

impl CausalLm for KimiK3 {
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
        let d = self.embed_tokens.cols;
        // `prefix`: the running sum of the current block (the residual
        // stream itself when AttnRes is off); it starts as the embedding.
        let mut prefix = layout.embed(&self.embed_tokens)?;
        let mut blocks = BlockHistory::new(layout.rows, d, self.eps);
        for (l, layer) in self.layers.iter().enumerate() {
            match (&layer.attn_res, self.block_size) {
                (Some(res), Some(bs)) => {
                    let h = layer
                        .input_layernorm
                        .forward(&blocks.mix(&res.attn, &prefix));
                    let a = layer.mixer.forward(&h, &layout, batch, cache);
                    if l.is_multiple_of(bs) {
                        // Block boundary: snapshot the finished block, start a new sum.
                        blocks.push(std::mem::replace(&mut prefix, a));
                    } else {
                        add_inplace(&mut prefix, &a);
                    }
                    let h = layer
                        .post_attention_layernorm
                        .forward(&blocks.mix(&res.mlp, &prefix));
                    add_inplace(&mut prefix, &layer.ffn.forward(&h));
                }
                _ => {
                    let a = layer.mixer.forward(
                        &layer.input_layernorm.forward(&prefix),
                        &layout,
                        batch,
                        cache,
                    );
                    add_inplace(&mut prefix, &a);
                    let m = layer
                        .ffn
                        .forward(&layer.post_attention_layernorm.forward(&prefix));
                    add_inplace(&mut prefix, &m);
                }
            }
        }
        let out = match &self.output_attn_res {
            Some(w) => blocks.mix(w, &prefix),
            None => prefix,
        };
        layout.commit(batch);
        Ok(logits(&out, &layout, &self.norm, &self.lm_head))
    }

    fn as_moe(&self) -> Option<&dyn MoeModel> {
        Some(self)
    }

    fn vision(&self) -> Option<&dyn VisionTower> {
        self.vision.as_ref().map(|v| v as &dyn VisionTower)
    }
}

impl_moe_model!(KimiK3, ffn);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::arch::ALogLayout;
    use crate::models::kimi_linear::KimiLinearConfig;

    #[test]
    fn k3_keys_parse_with_their_defaults() {
        let v = serde_json::json!({
            "attn_res_block_size": 12, "mla_use_output_gate": true, "hidden_act": "situ",
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "routed_expert_hidden_size": 3584, "latent_moe_use_norm": true,
            "linear_attn_config": {"num_heads": 96, "head_dim": 128, "use_full_rank_gate": true, "gate_lower_bound": -5.0}
        });
        let x: K3Extensions = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(x.attn_res_block_size, Some(12));
        assert_eq!(x.routed_expert_hidden_size, Some(3584));
        assert_eq!(x.linear_attn_config.gate_lower_bound, Some(-5.0));
        assert_eq!(x.linear_attn_config.a_log_layout, ALogLayout::Auto);
        assert_eq!(x.mla_latent_norm_eps, 1e-6);
        assert_eq!(x.moe_layer_freq, 1);
        let c: KimiLinearConfig = serde_json::from_value(v).unwrap();
        assert_eq!(c.linear_attn_config.num_heads, 96);
        let wrapped =
            serde_json::json!({"model_type": "kimi_k3", "text_config": {"hidden_size": 7}});
        assert_eq!(text_config(&wrapped)["hidden_size"], 7);
        assert_eq!(
            text_config(&serde_json::json!({"hidden_size": 8}))["hidden_size"],
            8
        );
    }
}
