//! Model architectures, one file each, and the interface the engine drives.
//!
//! Every architecture implements [`CausalLm`]: a batched forward over
//! several sequences at once (continuous batching), each sequence carrying
//! its own [`SeqState`] (block table into the shared [`KvPool`], length, and
//! recurrent state for linear-attention layers). Prefill and decode are the
//! same call: a sequence contributes one or many new tokens.
//!
//! | file | `model_type` | paper / reference implementation |
//! |---|---|---|
//! | [`llama`] | `llama` | LLaMA; transformers `modeling_llama.py` |
//! | [`deepseek_v3`] | `deepseek_v3`, `kimi_k2` | DeepSeek-V3 (arXiv 2412.19437); transformers `modeling_deepseek_v3.py` |
//! | [`kimi_linear`] | `kimi_linear` | Kimi Linear (arXiv 2510.26692); transformers `modeling_kimi_linear.py` |
//! | [`kimi_k25`] | `kimi_k25` | Kimi K2.5 / K2.6: DeepSeek-V3 text + MoonViT3d ([`vision`]); transformers `modeling_kimi_k25.py` |
//! | [`kimi_k3`] | `kimi_k3` | Kimi K3 text backbone (AttnRes arXiv 2603.15031); Moonshot `modeling_kimi_linear.py`, TokenSpeed `kimi_k3.py` |

pub mod deepseek_v3;
pub mod kimi_k25;
pub mod kimi_k3;
pub mod kimi_linear;
pub mod layers;
pub mod llama;
pub mod vision;

use std::path::Path;

use crate::checkpoint::arch::{Arch, ModelType};
use crate::checkpoint::config::{eos_ids, read_json};
use crate::checkpoint::Checkpoint;
pub use crate::checkpoint::LoadOptions;
use crate::error::{Error, Result};

pub use caracal_actors::engine::{
    CausalLm, EmbedSpan, EngineError, ExpertDispatch, ExpertFfn, LinearState, LogitsMode,
    ModelInfo, MoeModel, SeqBatch, SeqState, VisionInfo, VisionInput, VisionTower,
};

/// Loads the model in `dir` with the default [`LoadOptions`] (f32
/// activations for quantized weights).
pub fn load(dir: &Path) -> Result<Box<dyn CausalLm>> {
    load_with(dir, &LoadOptions::default())
}

/// Loads the model in `dir`: `config.json` is parsed once into an [`Arch`]
/// checked against the checkpoint's tensor headers, then the model of its
/// `model_type` is built from that description. Every quantized matrix
/// carries `opts.activations`.
pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn CausalLm>> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.exists() {
        return Err(Error::io(
            &cfg_path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "config.json is missing"),
        ));
    }
    let config = read_json(&cfg_path, "config.json")?;
    let ckpt = Checkpoint::open_with(dir, opts)?;
    let arch = Arch::for_checkpoint(&config, &ckpt)?;
    let eos = eos_ids(dir, &config);
    let model: Box<dyn CausalLm> = match arch.model_type {
        ModelType::Llama => Box::new(llama::Llama::load(&arch, &ckpt, eos)?),
        ModelType::DeepseekV3 | ModelType::KimiK2 => {
            Box::new(deepseek_v3::DeepseekV3::load(&arch, &ckpt, eos)?)
        }
        ModelType::KimiLinear => Box::new(kimi_linear::KimiLinear::load(&arch, &ckpt, eos)?),
        ModelType::KimiK3 => Box::new(kimi_k3::KimiK3::load(&arch, &ckpt, eos)?),
        ModelType::KimiK25 => Box::new(kimi_k25::KimiK25::load(&arch, &ckpt, eos)?),
    };
    Ok(model)
}
