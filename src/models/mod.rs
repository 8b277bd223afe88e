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

pub mod deepseek_v3;
pub mod kimi_linear;
pub mod layers;
pub mod llama;

use std::path::Path;

use caracal_kernels::paged::KvPool;

use crate::checkpoint::Checkpoint;
use crate::config::{eos_ids, model_type, read_json};
use crate::error::{Error, Result};

/// What the engine needs to know about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// `model_type` from config.json.
    pub model_type: String,
    /// Logit width.
    pub vocab_size: usize,
    /// Largest position the model accepts (context length).
    pub max_position: usize,
    /// Layers that keep paged KV rows (GQA or MLA layers).
    pub kv_layers: usize,
    /// f32 values per token per KV layer.
    pub kv_width: usize,
    /// Layers with recurrent state (KDA).
    pub linear_layers: usize,
    /// Stop ids from generation_config.json / config.json.
    pub eos_ids: Vec<u32>,
    /// Parameters in the checkpoint.
    pub num_params: usize,
}

/// Recurrent state of one linear-attention (KDA) layer for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearState {
    /// Short-convolution history: `[channels, kernel - 1]` pre-conv inputs.
    pub conv: Vec<f32>,
    /// Delta-rule state: `[heads, k_dim, v_dim]`.
    pub recurrent: Vec<f32>,
}

/// Everything a sequence carries between forward calls.
#[derive(Debug, Clone, Default)]
pub struct SeqState {
    /// Pages of the KV pool holding this sequence's rows, in order.
    pub block_table: Vec<u32>,
    /// Tokens already processed (the position of the next token).
    pub len: usize,
    /// One entry per KDA layer, in layer order.
    pub linear: Vec<LinearState>,
}

/// Which logits a sequence wants back from a forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// Only the last new token's (generation).
    Last,
    /// Every new token's (perplexity).
    All,
    /// None (a prefill chunk that is not the last one).
    None,
}

/// One sequence's share of a batched forward.
pub struct SeqBatch<'a> {
    /// New tokens, appended at position `state.len`.
    pub tokens: &'a [u32],
    /// The sequence's cache state; advanced by the forward.
    pub state: &'a mut SeqState,
    /// Which logits to return.
    pub logits: LogitsMode,
}

/// A decoder-only language model.
pub trait CausalLm: Send + Sync {
    /// Static facts about the model.
    fn info(&self) -> &ModelInfo;

    /// A fresh state for a new sequence (zeroed recurrent states).
    fn new_state(&self) -> SeqState;

    /// Runs the new tokens of every sequence in one batched pass, writing
    /// their KV rows into `cache` and advancing each state. Returns the
    /// requested logits rows, sequence by sequence, each `vocab_size` wide.
    fn forward(&self, cache: &mut KvPool, batch: &mut [SeqBatch<'_>]) -> Result<Vec<f32>>;
}

/// Loads the model in `dir`, dispatching on `model_type`.
pub fn load(dir: &Path) -> Result<Box<dyn CausalLm>> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.exists() {
        return Err(Error::io(&cfg_path, std::io::Error::new(std::io::ErrorKind::NotFound, "config.json is missing")));
    }
    let config = read_json(&cfg_path, "config.json")?;
    let mt = model_type(&config)?;
    let ckpt = Checkpoint::open(dir)?;
    let eos = eos_ids(dir, &config);
    let model: Box<dyn CausalLm> = match mt.as_str() {
        "llama" => Box::new(llama::Llama::load(&config, &cfg_path, &ckpt, eos)?),
        "deepseek_v3" | "kimi_k2" => Box::new(deepseek_v3::DeepseekV3::load(&config, &cfg_path, &ckpt, eos)?),
        "kimi_linear" => Box::new(kimi_linear::KimiLinear::load(&config, &cfg_path, &ckpt, eos)?),
        other => unreachable!("model_type() only returns supported types, got {other}"),
    };
    Ok(model)
}
