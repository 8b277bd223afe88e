//! Kimi K2.5 / K2.6 (`model_type: "kimi_k25"`): the DeepSeek-V3 / Kimi K2
//! text model ([`super::deepseek_v3`]) with a MoonViT3d vision tower and a
//! `patchmerger` projector ([`super::vision`]).
//!
//! Reference: transformers 5.23 `models/kimi_k25/modeling_kimi_k25.py`
//! (`Kimi_K25ForConditionalGeneration`); the architecture in
//! `kimi-architecture.md` §3.2 and §4. Media enter the LM as rows that
//! overwrite the embeddings of their placeholder tokens
//! ([`crate::models::EmbedSpan`]); the tower runs separately
//! ([`crate::models::VisionTower::encode`]).
//!
//! Both checkpoint spellings load: the published one
//! (`language_model.model.layers.N.*`, `language_model.lm_head.weight`,
//! `vision_tower.*`, `mm_projector.*`) and what transformers 5.x
//! `save_pretrained` writes (`language_model.model.blocks.N.*`,
//! `vision_tower.encoder.patch_embed.proj.*`, `model.mm_projector.pre_norm.*`).

use caracal_kernels::paged::KvPool;

use super::deepseek_v3::DeepseekV3;
use super::vision::MoonVit3d;
use super::{CausalLm, EngineError, ModelInfo, MoeModel, SeqBatch, SeqState, VisionTower};
use crate::checkpoint::arch::Arch;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// A loaded Kimi K2.5 model.
pub struct KimiK25 {
    /// The text decoder.
    text: DeepseekV3,
    /// Tower, merger and projector.
    vision: MoonVit3d,
}

impl KimiK25 {
    /// Loads the text model and the tower `arch` describes from `ckpt`.
    pub fn load(arch: &Arch, ckpt: &Checkpoint, eos_ids: Vec<u32>) -> Result<KimiK25> {
        let cfg = arch.vision_config.as_ref().ok_or_else(|| {
            Error::Config("config.json: a kimi_k25 config needs a `vision_config`".into())
        })?;
        Ok(KimiK25 {
            text: DeepseekV3::load(arch, ckpt, eos_ids)?,
            vision: MoonVit3d::load(ckpt, cfg)?,
        })
    }
}

impl CausalLm for KimiK25 {
    fn info(&self) -> &ModelInfo {
        self.text.info()
    }

    fn new_state(&self) -> SeqState {
        self.text.new_state()
    }

    fn forward(
        &self,
        cache: &mut KvPool,
        batch: &mut [SeqBatch<'_>],
    ) -> std::result::Result<Vec<f32>, EngineError> {
        self.text.forward(cache, batch)
    }

    fn as_moe(&self) -> Option<&dyn MoeModel> {
        self.text.as_moe()
    }

    fn vision(&self) -> Option<&dyn VisionTower> {
        Some(&self.vision)
    }
}
