//! [`ConstraintFactory`]: one per model, shared by all requests, turning a
//! [`ConstraintSpec`] into a [`GrammarConstraint`] (llguidance's `Matcher`
//! behind the [`Constraint`] trait).
//!
//! Compilation does all the work that can fail on a bad request — schema
//! checks, grammar construction, lexer and parser set-up — before any token
//! is generated. Per step the matcher's work is bounded by
//! [`ConstraintLimits`]: a step that would exceed them fails with
//! [`ConstraintError::Stuck`] instead of stalling the batch.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::earley::SlicedBiasComputer;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use toktrie::InferenceCapabilities;

use super::formats::tools_grammar;
use super::lark::{json_rule, JsonLayout};
use super::{
    schema, CompileError, Constraint, ConstraintError, ConstraintSpec, TokenEnv, TokenMask,
};

/// Bounds on grammars and on the work of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConstraintLimits {
    /// Symbols in a grammar's productions. Default 200,000 (schemas of a few
    /// hundred KB); llguidance's own default is 500,000.
    pub max_grammar_size: usize,
    /// Lexer work to build a grammar's initial regexes. Default 1,000,000
    /// (about 20 ms).
    pub initial_lexer_fuel: u64,
    /// Lexer work for one token mask. Default 200,000 (about 15 ms, a
    /// bound rarely approached: typical masks take tens of µs).
    pub step_lexer_fuel: u64,
    /// Earley items created for one token mask. Default 50,000 (about 2.5 ms).
    pub step_max_items: usize,
    /// Lexer states kept per grammar (1–2 kB each). Default 250,000.
    pub max_lexer_states: usize,
    /// Tool calls one turn may hold with `parallel_tool_calls`. Default 8, 1..=64.
    pub max_parallel_calls: usize,
}

impl Default for ConstraintLimits {
    fn default() -> Self {
        ConstraintLimits {
            max_grammar_size: 200_000,
            initial_lexer_fuel: 1_000_000,
            step_lexer_fuel: 200_000,
            step_max_items: 50_000,
            max_lexer_states: 250_000,
            max_parallel_calls: 8,
        }
    }
}

impl ConstraintLimits {
    fn parser_limits(&self) -> ParserLimits {
        ParserLimits {
            max_grammar_size: self.max_grammar_size,
            initial_lexer_fuel: self.initial_lexer_fuel,
            step_lexer_fuel: self.step_lexer_fuel,
            step_max_items: self.step_max_items,
            max_lexer_states: self.max_lexer_states,
            // Errors are sent to clients: no grammar dumps in them.
            verbose_errors: false,
            ..ParserLimits::default()
        }
    }
}

/// Compiles [`ConstraintSpec`]s for one model's vocabulary.
pub struct ConstraintFactory {
    /// The vocabulary.
    env: TokenEnv,
    /// llguidance's shared factory (token trie slices, limits).
    parsers: Arc<ParserFactory>,
    /// The limits in force.
    limits: ConstraintLimits,
}

impl std::fmt::Debug for ConstraintFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintFactory")
            .field("env", &self.env)
            .field("limits", &self.limits)
            .finish()
    }
}

impl ConstraintFactory {
    /// A factory with the default limits.
    pub fn new(env: TokenEnv) -> Result<ConstraintFactory, CompileError> {
        ConstraintFactory::with_limits(env, ConstraintLimits::default())
    }

    /// A factory with the given limits.
    pub fn with_limits(
        env: TokenEnv,
        limits: ConstraintLimits,
    ) -> Result<ConstraintFactory, CompileError> {
        if !(1..=64).contains(&limits.max_parallel_calls) {
            return Err(CompileError::InvalidField {
                field: "max_parallel_calls",
                detail: format!("must be 1 to 64, got {}", limits.max_parallel_calls),
            });
        }
        let caps = InferenceCapabilities {
            ff_tokens: true,
            ..InferenceCapabilities::default()
        };
        let mut parsers =
            ParserFactory::new(env.tok_env(), caps, &SlicedBiasComputer::general_slices())
                .map_err(|e| CompileError::Tokenizer(e.to_string()))?;
        parsers.quiet();
        *parsers.limits_mut() = limits.parser_limits();
        Ok(ConstraintFactory {
            env,
            parsers: Arc::new(parsers),
            limits,
        })
    }

    /// The vocabulary.
    pub fn env(&self) -> &TokenEnv {
        &self.env
    }

    /// The limits in force.
    pub fn limits(&self) -> &ConstraintLimits {
        &self.limits
    }

    /// The Lark grammar `spec` compiles to (for inspection and tests).
    pub fn grammar(&self, spec: &ConstraintSpec) -> Result<String, CompileError> {
        match spec {
            ConstraintSpec::Json(s) => {
                schema::check("response_format", s)?;
                if *s == Value::Bool(false) {
                    return Err(CompileError::InvalidSchema {
                        context: "response_format".into(),
                        detail: "the schema `false` accepts nothing".into(),
                    });
                }
                Ok(format!("start: {}\n", json_rule(s, JsonLayout::Compact)))
            }
            ConstraintSpec::JsonObject => Ok(format!(
                "start: {}\n",
                json_rule(&serde_json::json!({"type": "object"}), JsonLayout::Compact)
            )),
            ConstraintSpec::Tools(t) => tools_grammar(t, &self.env, self.limits.max_parallel_calls),
        }
    }

    /// Compiles `spec` into a fresh constraint for one sequence.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<GrammarConstraint, CompileError> {
        let context = match spec {
            ConstraintSpec::Json(_) | ConstraintSpec::JsonObject => "response_format",
            ConstraintSpec::Tools(_) => "tools",
        };
        let lark = self.grammar(spec)?;
        self.compile_lark(context, &lark)
    }

    /// Compiles `spec` behind the object-safe trait.
    pub fn compile_boxed(
        &self,
        spec: &ConstraintSpec,
    ) -> Result<Box<dyn Constraint>, CompileError> {
        Ok(Box::new(self.compile(spec)?))
    }

    /// Compiles a Lark grammar (`context` names it in errors).
    pub fn compile_lark(
        &self,
        context: &str,
        lark: &str,
    ) -> Result<GrammarConstraint, CompileError> {
        let grammar = TopLevelGrammar::from_lark(lark.to_string());
        // A grammar the engine cannot handle must fail the request, not the
        // server: panics while building it become errors.
        let parsers = &self.parsers;
        let parser = llguidance::panic_utils::catch_unwind(std::panic::AssertUnwindSafe(|| {
            parsers.create_parser(grammar)
        }))
        .map_err(|e| CompileError::from_engine(context, e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(CompileError::from_engine(context, e));
        }
        Ok(GrammarConstraint {
            matcher,
            vocab: self.env.vocab_size(),
            eos: self.env.eos().to_vec(),
        })
    }
}

/// One sequence's grammar state.
pub struct GrammarConstraint {
    /// llguidance's matcher.
    matcher: Matcher,
    /// Vocabulary size masks cover.
    vocab: usize,
    /// Tokens that end the sequence.
    eos: Vec<u32>,
}

impl std::fmt::Debug for GrammarConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarConstraint")
            .field("vocab", &self.vocab)
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl GrammarConstraint {
    fn stuck(&self, fallback: String) -> ConstraintError {
        ConstraintError::Stuck(self.matcher.get_error().unwrap_or(fallback))
    }

    /// Whether the grammar could end here (an end token is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

impl Constraint for GrammarConstraint {
    fn compute_mask(&mut self) -> Result<TokenMask, ConstraintError> {
        if self.matcher.is_stopped() && !self.matcher.is_error() {
            let mut m = TokenMask::none(self.vocab);
            for &t in &self.eos {
                m.allow(t);
            }
            return Ok(m);
        }
        let vob = self
            .matcher
            .compute_mask()
            .map_err(|e| self.stuck(e.to_string()))?;
        Ok(TokenMask::from_words(vob.as_slice().to_vec(), self.vocab))
    }

    fn consume(&mut self, token: u32) -> Result<(), ConstraintError> {
        if self.matcher.is_error() {
            return Err(self.stuck("the grammar failed earlier".into()));
        }
        if self.matcher.is_stopped() {
            return if self.eos.contains(&token) {
                Ok(())
            } else {
                Err(ConstraintError::AfterDone(token))
            };
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError::TokenRejected {
                token,
                reason: e.to_string(),
            })
    }

    fn forced_tokens(&mut self) -> Result<Vec<u32>, ConstraintError> {
        if self.matcher.is_stopped() {
            return Ok(Vec::new());
        }
        let forced = self.matcher.compute_ff_tokens();
        if self.matcher.is_error() {
            return Err(self.stuck("computing forced tokens failed".into()));
        }
        Ok(forced)
    }

    fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}
