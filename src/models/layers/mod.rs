//! Blocks shared by the model files: norms, MLPs, the three attention kinds,
//! the MoE block, Block Attention Residuals, and the bookkeeping of a batched
//! forward.
//!
//! Each block owns its weights (as stored: bf16 stays bf16) and runs on the
//! flat `[rows, width]` activations of the whole batch; only attention needs
//! to know where each sequence's rows start ([`BatchLayout`]).

pub mod attn_res;
pub mod experts;
pub mod gqa;
pub mod kda;
pub mod mla;
pub mod moe;

use caracal_kernels::activation;
use caracal_kernels::norm;
use caracal_kernels::rope::{Rope, RopeTable};
use caracal_kernels::Matrix;

use crate::checkpoint::arch::{Arch, AttentionKind, Family};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::models::{EmbedSpan, EngineError, LogitsMode, ModelInfo, SeqBatch};

/// Where each sequence's rows sit in the flat batch.
#[derive(Debug, Clone)]
pub struct SeqSlice {
    /// First row of this sequence in the batch.
    pub row: usize,
    /// Number of new tokens.
    pub len: usize,
    /// Position of the first new token.
    pub start_pos: usize,
    /// Copy of the sequence's block table (pages already reserved).
    pub block_table: Vec<u32>,
    /// Which logits the sequence wants.
    pub logits: LogitsMode,
}

/// The shape of a batched forward: one [`SeqSlice`] per sequence.
#[derive(Debug, Clone)]
pub struct BatchLayout {
    /// Per-sequence slices, in batch order.
    pub seqs: Vec<SeqSlice>,
    /// Total rows (new tokens over all sequences).
    pub rows: usize,
    /// Flat token ids of all rows.
    pub tokens: Vec<u32>,
    /// Position of every row.
    pub positions: Vec<usize>,
    /// Media rows replacing token embeddings: `(first batch row, span)`.
    pub embeds: Vec<(usize, EmbedSpan)>,
    /// The rotary tables of `positions`, made by the first layer that asks
    /// ([`BatchLayout::rope_table`]) and shared by the others.
    rope: std::sync::OnceLock<RopeTable>,
}

impl BatchLayout {
    /// Checks context limits, reserves KV pages, and lays the batch out.
    pub fn prepare(
        batch: &mut [SeqBatch<'_>],
        cache: &mut caracal_kernels::paged::KvPool,
        needs_pages: bool,
        max_position: usize,
    ) -> Result<BatchLayout> {
        let mut seqs = Vec::with_capacity(batch.len());
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut embeds = Vec::new();
        for s in batch.iter_mut() {
            if s.tokens.is_empty() {
                return Err(Error::InvalidRequest(
                    "a sequence in the batch has no new tokens".into(),
                ));
            }
            let end = s.state.len + s.tokens.len();
            if end > max_position {
                return Err(Error::PromptTooLong {
                    prompt: end,
                    context: max_position,
                    max_tokens: 0,
                });
            }
            if needs_pages {
                cache.ensure_capacity(&mut s.state.block_table, end)?;
            }
            seqs.push(SeqSlice {
                row: tokens.len(),
                len: s.tokens.len(),
                start_pos: s.state.len,
                block_table: s.state.block_table.clone(),
                logits: s.logits,
            });
            for e in s.embeds {
                check_embed_span(e, s.tokens.len())?;
                embeds.push((tokens.len() + e.offset, e.clone()));
            }
            positions.extend(s.state.len..end);
            tokens.extend_from_slice(s.tokens);
        }
        Ok(BatchLayout {
            rows: tokens.len(),
            seqs,
            tokens,
            positions,
            embeds,
            rope: std::sync::OnceLock::new(),
        })
    }

    /// The cos/sin tables of every row's position under `rope`, computed
    /// once per forward: a model's attention layers share one rotary
    /// embedding, so each layer's q and k rotations read the same tables.
    ///
    /// A later caller with another `rope` (other frequencies) gets the
    /// first one's table, which [`Rope::rotate_with`] refuses (it panics).
    pub fn rope_table(&self, rope: &Rope) -> &RopeTable {
        self.rope.get_or_init(|| rope.table(&self.positions))
    }

    /// The sequences decoding one token this step, for the batched decode
    /// attention (the others are prefill chunks).
    pub fn decode_seqs(&self) -> Vec<caracal_kernels::flash::DecodeSeq<'_>> {
        self.seqs
            .iter()
            .filter(|s| s.len == 1)
            .map(|s| caracal_kernels::flash::DecodeSeq {
                row: s.row,
                pos: s.start_pos,
                block_table: &s.block_table,
            })
            .collect()
    }

    /// Rows whose logits were asked for, in batch order.
    pub fn logit_rows(&self) -> Vec<usize> {
        let mut rows = Vec::new();
        for s in &self.seqs {
            match s.logits {
                LogitsMode::Last => rows.push(s.row + s.len - 1),
                LogitsMode::All => rows.extend(s.row..s.row + s.len),
                LogitsMode::None => {}
            }
        }
        rows
    }

    /// Input rows of the batch: token embeddings from `table`, with media
    /// spans' rows written over their placeholder positions.
    pub fn embed(&self, table: &Matrix) -> Result<Vec<f32>> {
        let mut x = embed(table, &self.tokens)?;
        let d = table.cols;
        for (row, e) in &self.embeds {
            let have = e.rows.len() / d;
            if e.rows.len() % d != 0 || e.first_row + e.len > have {
                return Err(Error::InvalidRequest(format!(
                    "media span wants rows {}..{} of {} values ({have} rows of width {d})",
                    e.first_row,
                    e.first_row + e.len,
                    e.rows.len()
                )));
            }
            let src = &e.rows[e.first_row * d..(e.first_row + e.len) * d];
            x[row * d..(row + e.len) * d].copy_from_slice(src);
        }
        Ok(x)
    }

    /// Advances every sequence's length after a successful forward.
    pub fn commit(&self, batch: &mut [SeqBatch<'_>]) {
        for (s, sl) in batch.iter_mut().zip(&self.seqs) {
            s.state.len = sl.start_pos + sl.len;
        }
    }
}

/// RMSNorm with an f32 weight.
pub struct RmsNorm {
    /// Per-channel scale.
    pub weight: Vec<f32>,
    /// Added to the mean square.
    pub eps: f32,
}

impl RmsNorm {
    /// Loads `name` of width `dim`.
    pub fn load(ckpt: &Checkpoint, name: &str, dim: usize, eps: f32) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: ckpt.vector(name, dim)?,
            eps,
        })
    }

    /// Normalises every row of `x`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        norm::rms_norm(x, &self.weight, self.eps, &mut out);
        out
    }
}

pub use crate::checkpoint::arch::GluAct;

impl GluAct {
    /// `gate = act(gate) · up`: [`GluAct::apply`] without an output buffer,
    /// bit-identical.
    pub fn apply_in_place(self, gate: &mut [f32], up: &[f32]) {
        match self {
            GluAct::Silu => activation::swiglu_in_place(gate, up),
            GluAct::Situ {
                beta,
                linear_beta: Some(lb),
            } => activation::situ_glu_in_place(gate, up, beta, lb),
            GluAct::Situ {
                beta,
                linear_beta: None,
            } => {
                assert_eq!(gate.len(), up.len(), "situ: gate and up lengths differ");
                for (g, &u) in gate.iter_mut().zip(up) {
                    *g = beta * (*g / beta).tanh() * activation::sigmoid(*g) * u;
                }
            }
        }
    }

    /// `out = act(gate) · up`.
    pub fn apply(self, gate: &[f32], up: &[f32], out: &mut [f32]) {
        assert_eq!(gate.len(), out.len(), "glu: out length differs");
        out.copy_from_slice(gate);
        self.apply_in_place(out, up);
    }
}

/// A gated MLP: `down(act(gate(x)) · up(x))`.
pub struct Mlp {
    /// `[intermediate, hidden]`.
    pub gate_proj: Matrix,
    /// `[intermediate, hidden]`.
    pub up_proj: Matrix,
    /// `[hidden, intermediate]`.
    pub down_proj: Matrix,
    /// The activation.
    pub act: GluAct,
}

impl Mlp {
    /// Loads `{prefix}.{gate,up,down}` with the given sub-names (`gate_proj`
    /// or `w1`, ...).
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        names: [&str; 3],
        hidden: usize,
        inter: usize,
        act: GluAct,
    ) -> Result<Mlp> {
        Ok(Mlp {
            gate_proj: ckpt.matrix(&format!("{prefix}.{}.weight", names[0]), inter, hidden)?,
            up_proj: ckpt.matrix(&format!("{prefix}.{}.weight", names[1]), inter, hidden)?,
            down_proj: ckpt.matrix(&format!("{prefix}.{}.weight", names[2]), hidden, inter)?,
            act,
        })
    }

    /// Loads the dense MLP of decoder layer `layer_prefix`
    /// (`model.layers.0`): `{layer_prefix}.mlp.{gate,up,down}_proj`, or,
    /// when only that spelling exists, the other module name the family's
    /// checkpoints are saved with (see [`Family::dense_modules`]).
    pub fn load_dense(
        ckpt: &Checkpoint,
        layer_prefix: &str,
        family: Family,
        hidden: usize,
        inter: usize,
        act: GluAct,
    ) -> Result<Mlp> {
        let modules = family.dense_modules();
        let module = modules
            .iter()
            .map(|m| format!("{layer_prefix}.{m}"))
            .find(|p| ckpt.has_matrix(&format!("{p}.gate_proj.weight")))
            .unwrap_or_else(|| format!("{layer_prefix}.{}", modules[0]));
        Mlp::load(
            ckpt,
            &module,
            ["gate_proj", "up_proj", "down_proj"],
            hidden,
            inter,
            act,
        )
    }

    /// Runs the MLP on `x` `[n, hidden]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        self.down_proj.forward(&self.hidden(x))
    }

    /// [`Mlp::forward`] into `out` `[n, hidden]`.
    pub fn forward_into(&self, x: &[f32], out: &mut [f32]) {
        self.down_proj.matmul(&self.hidden(x), out);
    }

    /// `act(gate(x)) · up(x)`, the input of `down_proj`.
    fn hidden(&self, x: &[f32]) -> Vec<f32> {
        let [mut gate, up] = Matrix::forward_group([&self.gate_proj, &self.up_proj], x);
        self.act.apply_in_place(&mut gate, &up);
        gate
    }
}

/// Checks that a media span lies within its entry's `n` new tokens.
fn check_embed_span(e: &EmbedSpan, n: usize) -> Result<()> {
    if e.offset.checked_add(e.len).is_none_or(|end| end > n) {
        return Err(Error::InvalidRequest(format!(
            "media span (offset {}, {} rows) lies outside its {n} new tokens",
            e.offset, e.len
        )));
    }
    Ok(())
}

/// Looks up embedding rows for `tokens`.
pub fn embed(table: &Matrix, tokens: &[u32]) -> Result<Vec<f32>> {
    let d = table.cols;
    let mut x = vec![0.0; tokens.len() * d];
    for (i, &t) in tokens.iter().enumerate() {
        if t as usize >= table.rows {
            return Err(Error::InvalidRequest(format!(
                "token id {t} is outside the vocabulary (size {})",
                table.rows
            )));
        }
        table.row_f32(t as usize, &mut x[i * d..(i + 1) * d]);
    }
    Ok(x)
}

/// Final norm and LM head on the rows whose logits were requested.
pub fn logits(hidden: &[f32], layout: &BatchLayout, norm: &RmsNorm, lm_head: &Matrix) -> Vec<f32> {
    let d = lm_head.cols;
    let rows = layout.logit_rows();
    let mut picked = Vec::with_capacity(rows.len() * d);
    for r in rows {
        picked.extend_from_slice(&hidden[r * d..(r + 1) * d]);
    }
    if picked.is_empty() {
        return Vec::new();
    }
    lm_head.forward(&norm.forward(&picked))
}

/// Adds `delta` into `x` elementwise.
pub fn add_inplace(x: &mut [f32], delta: &[f32]) {
    for (a, b) in x.iter_mut().zip(delta) {
        *a += b;
    }
}

/// Whether a missing `lm_head.weight` means a tied head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingHead {
    /// Use the input table (llama exports, e.g. SmolLM2's GGUF import, omit a
    /// tied head even when `tie_word_embeddings` is unset).
    Tie,
    /// A missing head is an error naming the tensor.
    Error,
}

/// The output head: the input table `embed` when the config ties them (or,
/// with [`MissingHead::Tie`], when the checkpoint has none), else
/// `{root}lm_head.weight` `[vocab, d]`.
pub fn load_lm_head(
    ckpt: &Checkpoint,
    arch: &Arch,
    embed: &Matrix,
    root: &str,
    missing: MissingHead,
) -> Result<Matrix> {
    let name = format!("{root}lm_head.weight");
    if arch.tie_word_embeddings || (missing == MissingHead::Tie && !ckpt.has(&name)) {
        Ok(embed.clone())
    } else {
        ckpt.matrix(&name, arch.vocab_size, embed.cols)
    }
}

/// What the engine needs to know of a model built from `arch`.
pub fn model_info(arch: &Arch, ckpt: &Checkpoint, eos_ids: Vec<u32>) -> ModelInfo {
    ModelInfo {
        model_type: arch.model_type.name().into(),
        vocab_size: arch.vocab_size,
        max_position: arch.max_position,
        kv_layers: arch.kv_layers(),
        kv_width: arch.kv_width(),
        kv_segment: arch.kv_segment(),
        linear_layers: arch.count(AttentionKind::Kda),
        eos_ids,
        num_params: ckpt.total_params(),
    }
}

/// Refuses a batch whose sequences carry another model's recurrent state
/// (one [`crate::models::LinearState`] per KDA layer).
pub fn check_linear_states(
    batch: &[SeqBatch<'_>],
    linear_layers: usize,
) -> std::result::Result<(), EngineError> {
    if batch.iter().any(|s| s.state.linear.len() != linear_layers) {
        return Err(EngineError::InvalidInput(
            "sequence state was not made by this model's new_state()".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn situ_f64(g: f64, u: f64, beta: f64, lin: Option<f64>) -> f64 {
        let act = beta * (g / beta).tanh() / (1.0 + (-g).exp());
        act * lin.map(|l| l * (u / l).tanh()).unwrap_or(u)
    }

    #[test]
    fn situ_parses_its_betas_and_matches_the_formula_in_f64() {
        let gate: Vec<f32> = (0..41).map(|i| (i as f32 - 20.0) * 0.9).collect();
        let up: Vec<f32> = (0..41).map(|i| (20.0 - i as f32) * 2.3).collect();
        for (lin, act) in [
            (
                Some(25.0),
                GluAct::from_config("situ", Some(4.0), Some(25.0)).unwrap(),
            ),
            (None, GluAct::from_config("situ", Some(4.0), None).unwrap()),
        ] {
            assert_eq!(
                act,
                GluAct::Situ {
                    beta: 4.0,
                    linear_beta: lin
                }
            );
            let mut out = vec![0.0; gate.len()];
            act.apply(&gate, &up, &mut out);
            let mut in_place = gate.clone();
            act.apply_in_place(&mut in_place, &up);
            assert_eq!(in_place, out, "in place, linear beta {lin:?}");
            for i in 0..gate.len() {
                let want = situ_f64(
                    gate[i] as f64,
                    up[i] as f64,
                    4.0,
                    lin.map(|l: f32| l as f64),
                );
                // f32 evaluation of tanh/sigmoid/products: a few ulps of |want| (≤ ~150).
                assert!(
                    (out[i] as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "i={i} got {} want {want}",
                    out[i]
                );
            }
        }
    }

    #[test]
    fn situ_defaults_and_bad_betas() {
        assert_eq!(
            GluAct::from_name("situ").unwrap(),
            GluAct::Situ {
                beta: 1.0,
                linear_beta: None
            }
        );
        assert_eq!(GluAct::from_name("silu").unwrap(), GluAct::Silu);
        let err = GluAct::from_config("situ", Some(0.0), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("activation_situ_beta"), "{err}");
        let err = GluAct::from_config("situ", Some(4.0), Some(-1.0))
            .unwrap_err()
            .to_string();
        assert!(err.contains("activation_situ_linear_beta"), "{err}");
        let err = GluAct::from_name("gelu").unwrap_err().to_string();
        assert!(err.contains("gelu") && err.contains("situ"), "{err}");
    }
}
