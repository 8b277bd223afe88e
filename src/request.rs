//! Validating client requests at the edge.
//!
//! A [`RequestSpec`] is what clients send (a `caracal batch` line, later the
//! OpenAI HTTP body); [`RequestSpec::validate`] turns it into the runtime's
//! [`ValidRequest`] or a [`ValidationError`] naming the field and the limit
//! (`max_tokens must be <= 32768, got 40000`).

use caracal_actors::messages::{StopConditions, ValidRequest};
use caracal_kernels::sampling::SamplingParams;
use serde::Deserialize;

use crate::constrain::{CompileError, ConstraintSpec, ToolFormat, ToolsSpec};
use crate::text::tokenizer::ChatFormat;

use crate::text::tokenizer::TextTokenizer;

/// Largest `max_tokens` a request may ask for.
pub const MAX_OUTPUT_TOKENS: usize = 32768;

/// A generation request as clients write it (vLLM/OpenAI field names).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestSpec {
    /// Prompt text (tokenized with the model's tokenizer).
    pub prompt: Option<String>,
    /// Prompt token ids (instead of `prompt`).
    pub prompt_ids: Option<Vec<u32>>,
    /// Most new tokens (default 16, as in the OpenAI completions API).
    pub max_tokens: Option<usize>,
    /// Softmax temperature, `[0, 2]` (default 1; 0 is greedy).
    pub temperature: Option<f32>,
    /// Nucleus mass, `(0, 1]`.
    pub top_p: Option<f32>,
    /// Top-k cut (0 or -1 disables).
    pub top_k: Option<i64>,
    /// Min-p cut, `[0, 1]`.
    pub min_p: Option<f32>,
    /// Sampler seed.
    pub seed: Option<u64>,
    /// Repetition penalty, `(0, 2]`.
    pub repetition_penalty: Option<f32>,
    /// Presence penalty, `[-2, 2]`.
    pub presence_penalty: Option<f32>,
    /// Frequency penalty, `[-2, 2]`.
    pub frequency_penalty: Option<f32>,
    /// Stop strings (one string or a list).
    pub stop: Option<StopSpec>,
    /// Extra stop ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep generating past EOS.
    pub ignore_eos: Option<bool>,
    /// Session key for fairness and cache pinning.
    pub session: Option<String>,
    /// Function tools (Chat Completions shape) whose calls are constrained.
    pub tools: Option<serde_json::Value>,
    /// `auto` (default), `none`, `required`, or `{"type":"function","function":{"name"}}`.
    pub tool_choice: Option<serde_json::Value>,
    /// Several calls in one output (default true).
    pub parallel_tool_calls: Option<bool>,
    /// `{"type":"json_schema","json_schema":{"schema"}}` or `{"type":"json_object"}`.
    pub response_format: Option<serde_json::Value>,
}

/// `stop` as a single string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// One string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// A request that failed validation. Each variant names the field and the
/// limit it broke; [`ValidationError::code`] is a stable string for clients.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValidationError {
    /// Both `prompt` and `prompt_ids` were given.
    #[error("give either `prompt` or `prompt_ids`, not both")]
    PromptAndIds,
    /// Neither `prompt` nor `prompt_ids` was given.
    #[error("`prompt` or `prompt_ids` is required")]
    NoPrompt,
    /// A text prompt on a model without a tokenizer.
    #[error("the model has no tokenizer; send `prompt_ids`")]
    NoTokenizer,
    /// The tokenizer refused the text.
    #[error("`prompt` could not be tokenized: {detail}")]
    Tokenize {
        /// The tokenizer's message.
        detail: String,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A prompt id at or past the vocabulary size.
    #[error("`prompt_ids` contains {id}, outside the vocabulary (size {vocab_size})")]
    OutsideVocabulary {
        /// The offending id.
        id: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// The prompt does not leave room for one new token in the context.
    #[error("prompt has {prompt_tokens} tokens, but the model's context length is {context}")]
    ContextLength {
        /// Tokens in the prompt.
        prompt_tokens: usize,
        /// The model's context length.
        context: usize,
    },
    /// A number outside its allowed interval (`interval` as written in the
    /// message, e.g. `[0, 2]` or `(0, 1]`).
    #[error("`{field}` must be in {interval}, got {got}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The allowed interval.
        interval: String,
        /// What was sent.
        got: String,
    },
    /// `top_k` below -1.
    #[error("`top_k` must be -1, 0 or positive, got {got}")]
    TopK {
        /// What was sent.
        got: i64,
    },
    /// Too many stop strings, or an empty one.
    /// `tools`, `tool_choice` or `response_format` cannot be constrained.
    #[error("{0}")]
    Constraint(#[from] CompileError),
    /// Both `tools` (callable) and `response_format` were given.
    #[error("give either callable `tools` or a constrained `response_format`, not both")]
    ToolsAndFormat,
    #[error("`stop` takes at most {limit} non-empty strings")]
    StopStrings {
        /// Most stop strings.
        limit: usize,
    },
}

impl ValidationError {
    /// The request field at fault, when there is one.
    pub fn field(&self) -> Option<&'static str> {
        Some(match self {
            ValidationError::PromptAndIds | ValidationError::NoPrompt => "prompt",
            ValidationError::NoTokenizer
            | ValidationError::Tokenize { .. }
            | ValidationError::EmptyPrompt => "prompt",
            ValidationError::OutsideVocabulary { .. } => "prompt_ids",
            ValidationError::ContextLength { .. } => "prompt",
            ValidationError::OutOfRange { field, .. } => field,
            ValidationError::TopK { .. } => "top_k",
            ValidationError::StopStrings { .. } => "stop",
            ValidationError::Constraint(CompileError::InvalidField { field, .. }) => field,
            ValidationError::Constraint(
                CompileError::InvalidTool { .. } | CompileError::UnknownTool { .. },
            ) => "tools",
            ValidationError::Constraint(_) | ValidationError::ToolsAndFormat => "response_format",
        })
    }

    /// Stable error code for clients (OpenAI's spellings where they exist).
    pub fn code(&self) -> &'static str {
        match self {
            ValidationError::ContextLength { .. } => "context_length_exceeded",
            ValidationError::PromptAndIds | ValidationError::NoPrompt => "invalid_request",
            ValidationError::NoTokenizer => "unsupported",
            ValidationError::Constraint(e) => e.kind(),
            _ => "invalid_value",
        }
    }
}

/// Most stop strings a request may carry.
pub const MAX_STOP_STRINGS: usize = 16;

fn range(
    name: &'static str,
    v: Option<f32>,
    lo: f32,
    hi: f32,
    lo_open: bool,
) -> Result<(), ValidationError> {
    if let Some(x) = v {
        let ok = x.is_finite() && (if lo_open { x > lo } else { x >= lo }) && x <= hi;
        if !ok {
            let l = if lo_open { "(" } else { "[" };
            return Err(ValidationError::OutOfRange {
                field: name,
                interval: format!("{l}{lo}, {hi}]"),
                got: x.to_string(),
            });
        }
    }
    Ok(())
}

/// The tool-call format of a model with this tokenizer (its chat format):
/// Kimi K3 XTML (thinking as K3's default prompt opens it), Kimi K2
/// sections, Hermes `<tool_call>` JSON for Jinja templates.
pub fn tool_format_for(tokenizer: &TextTokenizer) -> Option<ToolFormat> {
    Some(match tokenizer.chat_format()? {
        ChatFormat::KimiK3 => ToolFormat::KimiK3 {
            thinking: crate::chat::toolcall::K3Options::default().thinking,
        },
        ChatFormat::KimiK2 => ToolFormat::KimiK2 {
            first_call_index: 0,
            thinking: false,
        },
        ChatFormat::Jinja(_) => ToolFormat::Hermes,
    })
}

impl RequestSpec {
    /// What `tools` / `tool_choice` / `parallel_tool_calls` /
    /// `response_format` ask to constrain, in the model's tool `format`;
    /// `None` when nothing is.
    pub fn constraint_spec(
        &self,
        format: Option<ToolFormat>,
    ) -> Result<Option<ConstraintSpec>, ValidationError> {
        let output = ConstraintSpec::from_response_format(self.response_format.as_ref())?;
        let tools = match format {
            Some(format) => ToolsSpec::from_openai(
                self.tools.as_ref(),
                self.tool_choice.as_ref(),
                self.parallel_tool_calls,
                format,
            )?,
            None if self.tools.is_some() => {
                return Err(CompileError::Tokenizer(
                    "the model has no chat format, so no tool-call format".into(),
                )
                .into())
            }
            None => None,
        };
        match (output, tools) {
            (Some(_), Some(_)) => Err(ValidationError::ToolsAndFormat),
            (Some(o), None) => Ok(Some(o)),
            (None, t) => Ok(t.map(ConstraintSpec::Tools)),
        }
    }

    /// Checks every field and tokenizes the prompt.
    pub fn validate(
        &self,
        tokenizer: Option<&TextTokenizer>,
        vocab_size: usize,
        context: usize,
        eos_ids: &[u32],
    ) -> Result<ValidRequest, ValidationError> {
        let prompt = match (&self.prompt, &self.prompt_ids) {
            (Some(_), Some(_)) => return Err(ValidationError::PromptAndIds),
            (None, None) => return Err(ValidationError::NoPrompt),
            (None, Some(ids)) => ids.clone(),
            (Some(text), None) => tokenizer
                .ok_or(ValidationError::NoTokenizer)?
                .encode(text)
                .map_err(|e| ValidationError::Tokenize {
                    detail: e.to_string(),
                })?,
        };
        if prompt.is_empty() {
            return Err(ValidationError::EmptyPrompt);
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ValidationError::OutsideVocabulary {
                id: *bad,
                vocab_size,
            });
        }
        if prompt.len() >= context {
            return Err(ValidationError::ContextLength {
                prompt_tokens: prompt.len(),
                context,
            });
        }
        let max_tokens = self.max_tokens.unwrap_or(16);
        if max_tokens == 0 || max_tokens > MAX_OUTPUT_TOKENS {
            return Err(ValidationError::OutOfRange {
                field: "max_tokens",
                interval: format!("[1, {MAX_OUTPUT_TOKENS}]"),
                got: max_tokens.to_string(),
            });
        }
        range("temperature", self.temperature, 0.0, 2.0, false)?;
        range("top_p", self.top_p, 0.0, 1.0, true)?;
        range("min_p", self.min_p, 0.0, 1.0, false)?;
        range(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            2.0,
            true,
        )?;
        range("presence_penalty", self.presence_penalty, -2.0, 2.0, false)?;
        range(
            "frequency_penalty",
            self.frequency_penalty,
            -2.0,
            2.0,
            false,
        )?;
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => return Err(ValidationError::TopK { got: k }),
        };
        let mut ids: Vec<u32> = if self.ignore_eos.unwrap_or(false) {
            Vec::new()
        } else {
            eos_ids.to_vec()
        };
        ids.extend(self.stop_token_ids.iter().flatten().copied());
        let strings = match &self.stop {
            None => Vec::new(),
            Some(StopSpec::One(s)) => vec![s.clone()],
            Some(StopSpec::Many(v)) => v.clone(),
        };
        if strings.len() > MAX_STOP_STRINGS || strings.iter().any(|s| s.is_empty()) {
            return Err(ValidationError::StopStrings {
                limit: MAX_STOP_STRINGS,
            });
        }
        Ok(ValidRequest {
            session: self.session.clone(),
            prompt,
            cache_key: None,
            max_tokens,
            sampling: SamplingParams {
                temperature: self.temperature.unwrap_or(1.0),
                top_p: self.top_p.unwrap_or(1.0),
                top_k,
                min_p: self.min_p.unwrap_or(0.0),
                seed: self.seed,
                repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
                presence_penalty: self.presence_penalty.unwrap_or(0.0),
                frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            },
            stop: StopConditions { ids, strings },
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: &str) -> RequestSpec {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn errors_name_the_field_and_the_limit() {
        let e = spec(r#"{"prompt_ids":[1,2],"max_tokens":40000}"#)
            .validate(None, 10, 100, &[])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "`max_tokens` must be in [1, 32768], got 40000"
        );
        let e = spec(r#"{"prompt_ids":[1,2],"temperature":3}"#)
            .validate(None, 10, 100, &[])
            .unwrap_err();
        assert!(
            e.to_string().starts_with("`temperature` must be in [0, 2]"),
            "{}",
            e.to_string()
        );
        let e = spec(r#"{"prompt_ids":[1,99]}"#)
            .validate(None, 10, 100, &[])
            .unwrap_err();
        assert!(
            e.to_string().contains("99") && e.to_string().contains("vocabulary"),
            "{}",
            e.to_string()
        );
        let e = spec(r#"{"prompt_ids":[1,2,3]}"#)
            .validate(None, 10, 3, &[])
            .unwrap_err();
        assert!(
            e.to_string().contains("context length is 3"),
            "{}",
            e.to_string()
        );
    }

    #[test]
    fn errors_carry_their_field_and_a_stable_code() {
        let e = spec(r#"{"prompt_ids":[1,2,3]}"#)
            .validate(None, 10, 3, &[])
            .unwrap_err();
        assert_eq!(
            (e.field(), e.code()),
            (Some("prompt"), "context_length_exceeded")
        );
        let e = spec(r#"{"prompt_ids":[1],"top_p":0}"#)
            .validate(None, 10, 100, &[])
            .unwrap_err();
        assert_eq!((e.field(), e.code()), (Some("top_p"), "invalid_value"));
        assert_eq!(e.to_string(), "`top_p` must be in (0, 1], got 0");
        let e = spec(r#"{"prompt_ids":[1],"stop":["a",""]}"#)
            .validate(None, 10, 100, &[])
            .unwrap_err();
        assert_eq!(e, ValidationError::StopStrings { limit: 16 });
        let e = spec(r#"{"max_tokens":3}"#)
            .validate(None, 10, 100, &[])
            .unwrap_err();
        assert_eq!((e.field(), e.code()), (Some("prompt"), "invalid_request"));
    }

    #[test]
    fn unknown_fields_are_rejected() {
        assert!(serde_json::from_str::<RequestSpec>(r#"{"prompt":"x","temprature":1}"#).is_err());
    }

    #[test]
    fn eos_is_a_stop_id_unless_ignored() {
        let r = spec(r#"{"prompt_ids":[1],"stop_token_ids":[7]}"#)
            .validate(None, 10, 100, &[2])
            .unwrap();
        assert_eq!(r.stop.ids, vec![2, 7]);
        let r = spec(r#"{"prompt_ids":[1],"ignore_eos":true,"stop":"END"}"#)
            .validate(None, 10, 100, &[2])
            .unwrap();
        assert!(r.stop.ids.is_empty());
        assert_eq!(r.stop.strings, vec!["END".to_string()]);
    }
}
