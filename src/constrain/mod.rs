//! Constrained decoding: tool calls and structured output that always parse.
//!
//! A sequence may carry a [`Constraint`]: before each sampling step it gives
//! a [`TokenMask`] of the tokens the grammar allows next (the sampler sets
//! the others to `-inf` with [`TokenMask::apply`]), it consumes the sampled
//! token, it reports runs of tokens the grammar forces (jump-forward) and
//! says when the grammar is complete. The trait, the mask and
//! [`ConstraintError`] know nothing of tokenizers or of this crate: they
//! live in [`caracal_actors::constraint`], next to the scheduler that runs
//! them, and are re-exported here.
//!
//! Behind the trait sits llguidance:
//!
//! ```text
//! TextTokenizer ─► TokenEnv (token trie, once per model)
//!                      │
//!                      ▼
//! ConstraintSpec ─► ConstraintFactory::compile ─► Lark grammar ─► Matcher
//!  (Json / JsonObject /     (shared ParserFactory,                 │
//!   Tools in the model's     limits, compact JSON)                 ▼
//!   own format)                                     GrammarConstraint: Constraint
//! ```
//!
//! - [`tokens`]: [`TokenEnv`], the token trie over each token's bytes, built
//!   from a `tokenizer.json` or from Kimi's tiktoken ranks (special tokens
//!   included, as llguidance's special-token entries).
//! - [`spec`]: what a request asks for ([`ConstraintSpec`]), read from the
//!   OpenAI shapes (`tools`, `tool_choice`, `parallel_tool_calls`,
//!   `response_format`, Responses `text.format`).
//! - [`schema`]: checks a JSON schema before compiling it (unsupported
//!   keywords, unresolvable `$ref`s) so the error names the problem and
//!   where it is.
//! - [`formats`]: one Lark grammar builder per tool-call format — Kimi K2
//!   sections, Kimi K3 XTML, Hermes `<tool_call>` JSON — each accepting
//!   exactly what that format's parser in [`crate::chat::toolcall`] (or
//!   [`formats::hermes`]) parses back.
//! - [`matcher`]: [`ConstraintFactory`] and [`GrammarConstraint`].
//!
//! `tool_choice: "auto"` compiles to a lazy grammar: free text (with the
//! format's control markers excluded from it) until the model opens its
//! tool-call section, constrained from there. `"required"` and a named tool
//! constrain from the first token (after reasoning, for thinking formats);
//! `"none"` compiles to no constraint at all.

pub mod error;
pub mod formats;
pub mod lark;
pub mod matcher;
pub mod schema;
pub mod spec;
pub mod tokens;

pub use error::CompileError;
pub use matcher::{ConstraintFactory, ConstraintLimits, GrammarConstraint};
pub use spec::{ConstraintSpec, ToolChoice, ToolDecl, ToolFormat, ToolsSpec};
pub use tokens::TokenEnv;

pub use caracal_actors::constraint::{Constraint, ConstraintError, SeqConstraint, TokenMask};
