//! The constraint capability of the scheduler: a per-sequence grammar that
//! masks logits before sampling, consumes each sampled (or forced) token,
//! reports runs of tokens it forces (jump-forward) and says when it is done.
//!
//! Nothing here knows tokenizers or grammar engines: the gateway compiles a
//! request's schema or tools into a `Box<dyn Constraint>` (llguidance in
//! the `caracal` crate's `constrain` module) and hands it to the engine with
//! the request ([`SeqConstraint`]). The scheduler computes masks off its own
//! thread while the forward runs ([`MaskPool`]).

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc as std_mpsc;
use std::sync::OnceLock;

/// A grammar that steers one sequence's sampling.
///
/// Call order per step: [`Constraint::forced_tokens`] (optional; the caller
/// appends them and passes each to [`Constraint::consume`]), then
/// [`Constraint::compute_mask`], sample under the mask, then
/// [`Constraint::consume`] with the sampled token. Stop when
/// [`Constraint::is_done`].
pub trait Constraint: Send {
    /// Allowed next tokens as a bitmask over the vocabulary (bit i = token i
    /// allowed). Once the grammar is complete only the end-of-sequence
    /// tokens are allowed.
    fn compute_mask(&mut self) -> Result<TokenMask, ConstraintError>;
    /// Advances the state with the sampled (or forced) token.
    fn consume(&mut self, token: u32) -> Result<(), ConstraintError>;
    /// Tokens the grammar forces next (jump-forward), possibly empty. They
    /// are not consumed: the caller passes each to [`Constraint::consume`].
    fn forced_tokens(&mut self) -> Result<Vec<u32>, ConstraintError>;
    /// The grammar is complete; the sequence should stop.
    fn is_done(&self) -> bool;
}

/// Why a constraint cannot go on. The sequence carrying it finishes with
/// this error; other sequences are unaffected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// The token is not allowed by the grammar at this point.
    #[error("token {token} is not allowed by the grammar here: {reason}")]
    TokenRejected {
        /// The rejected token id.
        token: u32,
        /// The grammar engine's explanation.
        reason: String,
    },
    /// The grammar cannot continue (it hit a step limit or has no valid
    /// continuation).
    #[error("the grammar cannot continue: {0}")]
    Stuck(String),
    /// A token was consumed after the grammar completed.
    #[error("token {0} consumed after the grammar completed")]
    AfterDone(u32),
}

impl ConstraintError {
    /// A stable name for clients and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ConstraintError::TokenRejected { .. } => "constraint_token_rejected",
            ConstraintError::Stuck(_) => "constraint_stuck",
            ConstraintError::AfterDone(_) => "constraint_after_done",
        }
    }
}

/// Allowed tokens as a bitset over the vocabulary: bit `i % 32` of word
/// `i / 32` is token `i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    /// The bits; bits at or past `len` are zero.
    words: Vec<u32>,
    /// Vocabulary size the mask covers.
    len: usize,
}

impl TokenMask {
    /// A mask over `len` tokens with none allowed.
    pub fn none(len: usize) -> TokenMask {
        TokenMask {
            words: vec![0; len.div_ceil(32)],
            len,
        }
    }

    /// A mask over `len` tokens with all allowed.
    pub fn all(len: usize) -> TokenMask {
        let mut m = TokenMask {
            words: vec![u32::MAX; len.div_ceil(32)],
            len,
        };
        m.clear_tail();
        m
    }

    /// A mask from bitset words (bits past `len` are ignored).
    pub fn from_words(mut words: Vec<u32>, len: usize) -> TokenMask {
        words.resize(len.div_ceil(32), 0);
        let mut m = TokenMask { words, len };
        m.clear_tail();
        m
    }

    fn clear_tail(&mut self) {
        let rem = self.len % 32;
        if rem != 0 {
            if let Some(last) = self.words.last_mut() {
                *last &= (1u32 << rem) - 1;
            }
        }
    }

    /// Vocabulary size the mask covers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mask covers no tokens at all.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bitset words.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Allows `token` (ignored past the end).
    pub fn allow(&mut self, token: u32) {
        let i = token as usize;
        if i < self.len {
            self.words[i / 32] |= 1 << (i % 32);
        }
    }

    /// Whether `token` is allowed (false past the end).
    pub fn is_allowed(&self, token: u32) -> bool {
        let i = token as usize;
        i < self.len && self.words[i / 32] & (1 << (i % 32)) != 0
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The allowed token ids, ascending.
    pub fn allowed(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(wi, &w)| {
            let mut bits = w;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                Some(wi as u32 * 32 + b)
            })
        })
    }

    /// Sets the logits of disallowed tokens to `-inf`. Logits past the
    /// mask's length (a model vocabulary padded beyond the tokenizer's) are
    /// disallowed too.
    pub fn apply(&self, logits: &mut [f32]) {
        for (wi, chunk) in logits.chunks_mut(32).enumerate() {
            let w = self.words.get(wi).copied().unwrap_or(0);
            if w == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if w & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }
}

impl fmt::Debug for dyn Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("done", &self.is_done())
            .finish_non_exhaustive()
    }
}

/// A request's constraint as the scheduler receives it.
#[derive(Debug)]
pub struct SeqConstraint {
    /// The grammar state, fresh (nothing consumed yet).
    pub constraint: Box<dyn Constraint>,
    /// Append the runs of tokens the grammar forces without sampling them
    /// one per step; they enter the next forward as one chunk.
    pub jump_forward: bool,
}

impl SeqConstraint {
    /// `constraint` with jump-forward on.
    pub fn new(constraint: Box<dyn Constraint>) -> SeqConstraint {
        SeqConstraint {
            constraint,
            jump_forward: true,
        }
    }
}

/// One sequence's mask to compute off the scheduler thread.
pub(crate) struct MaskJob {
    /// Index of the sequence in the running batch.
    pub(crate) seq: usize,
    /// Its constraint, lent to the pool for the duration of the forward.
    pub(crate) constraint: Box<dyn Constraint>,
    /// The result, once computed.
    pub(crate) mask: Option<Result<TokenMask, ConstraintError>>,
}

/// Masks in flight: one batch of [`MaskJob`]s.
pub(crate) enum PendingMasks {
    /// Computing on the pool; the batch comes back over this channel.
    Running(std_mpsc::Receiver<Vec<MaskJob>>),
    /// Already computed.
    Ready(Vec<MaskJob>),
}

impl PendingMasks {
    /// A batch computed already.
    pub(crate) fn ready(jobs: Vec<MaskJob>) -> PendingMasks {
        PendingMasks::Ready(jobs)
    }

    /// Waits for the batch. Each computation is guarded against panics, so
    /// the pool always sends the batch back.
    pub(crate) fn join(self) -> Vec<MaskJob> {
        match self {
            PendingMasks::Ready(jobs) => jobs,
            PendingMasks::Running(rx) => rx
                .recv()
                .expect("the mask pool sends every batch back (computations are guarded)"),
        }
    }
}

/// The small thread pool that computes token masks while the forward runs.
///
/// It is not the forward's rayon pool: the forward keeps every worker of
/// that pool busy with its matrix kernels, so mask jobs queued there would
/// wait for the forward to end and the overlap would be lost.
pub(crate) struct MaskPool {
    /// The workers.
    pool: rayon::ThreadPool,
}

/// Workers of the mask pool: masks take tens of µs each, a batch of 64
/// fits well inside a forward on two threads.
const MASK_THREADS: usize = 2;

impl MaskPool {
    /// The process-wide mask pool, started on first use.
    pub(crate) fn shared() -> Option<&'static MaskPool> {
        static POOL: OnceLock<Option<MaskPool>> = OnceLock::new();
        POOL.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(MASK_THREADS)
                .thread_name(|i| format!("caracal-mask-{i}"))
                .build()
                .map_err(|e| tracing::error!("cannot start the mask pool: {e}"))
                .ok()
                .map(|pool| MaskPool { pool })
        })
        .as_ref()
    }

    /// Starts computing the masks of `jobs`; join the result after the forward.
    pub(crate) fn start(&self, mut jobs: Vec<MaskJob>) -> PendingMasks {
        let (tx, rx) = std_mpsc::sync_channel(1);
        self.pool.spawn(move || {
            use rayon::prelude::*;
            jobs.par_iter_mut()
                .for_each(|j| j.mask = Some(guarded_mask(j)));
            let _ = tx.send(jobs);
        });
        PendingMasks::Running(rx)
    }
}

/// Computes one mask on the calling thread, a panic becoming an error.
pub(crate) fn guarded_mask(job: &mut MaskJob) -> Result<TokenMask, ConstraintError> {
    let c = &mut job.constraint;
    catch_unwind(AssertUnwindSafe(|| c.compute_mask())).unwrap_or_else(|_| {
        Err(ConstraintError::Stuck(
            "the grammar engine panicked computing a mask".into(),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_sets_disallowed_logits_to_minus_infinity() {
        let mut m = TokenMask::none(70);
        for t in [0, 31, 32, 69, 500] {
            m.allow(t);
        }
        assert_eq!(m.count(), 4);
        assert!(m.is_allowed(31) && m.is_allowed(69) && !m.is_allowed(1) && !m.is_allowed(500));
        assert_eq!(m.allowed().collect::<Vec<_>>(), vec![0, 31, 32, 69]);
        let mut logits = vec![1.0f32; 75];
        m.apply(&mut logits);
        for (i, l) in logits.iter().enumerate() {
            let kept = [0, 31, 32, 69].contains(&i);
            assert_eq!(l.is_finite(), kept, "logit {i}");
        }
    }

    #[test]
    fn full_mask_keeps_every_logit_and_counts_exactly() {
        let m = TokenMask::all(65);
        assert_eq!(m.count(), 65);
        assert!(!m.is_allowed(65));
        let mut logits = vec![0.5f32; 65];
        m.apply(&mut logits);
        assert!(logits.iter().all(|l| *l == 0.5));
        let w = TokenMask::from_words(vec![u32::MAX; 5], 40);
        assert_eq!(w.count(), 40);
        assert_eq!(w.words().len(), 2);
    }

    #[test]
    fn error_kinds_are_stable() {
        assert_eq!(
            ConstraintError::Stuck("x".into()).kind(),
            "constraint_stuck"
        );
        assert_eq!(
            ConstraintError::TokenRejected {
                token: 3,
                reason: "no".into()
            }
            .kind(),
            "constraint_token_rejected"
        );
    }
}
