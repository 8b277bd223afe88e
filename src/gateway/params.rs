//! Sampling and length fields shared by every generation endpoint, read
//! from client JSON into a [`ValidRequest`] (validation at the edge: each
//! error names the field and the limit), and the output constraint a
//! request asks for (`tools` / `tool_choice` / `parallel_tool_calls`,
//! `response_format`, Responses `text.format`), compiled with the model's
//! shared [`crate::constrain::ConstraintFactory`].

use caracal_actors::constraint::SeqConstraint;
use caracal_actors::messages::{StopConditions, ValidRequest};
use caracal_kernels::sampling::SamplingParams;
use serde_json::Value;

use super::error::{ApiError, ApiResult};
use super::fields::Fields;
use super::AppState;
use crate::chat::toolcall::Message;
use crate::constrain::{CompileError, ConstraintSpec, ToolFormat, ToolsSpec};
use crate::request::MAX_OUTPUT_TOKENS;
use crate::text::tokenizer::ChatFormat;

/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;

/// Sampling settings and stop strings of a request, before the prompt is known.
#[derive(Debug, Clone)]
pub struct Sampling {
    /// The sampler.
    pub params: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Requested output budget, if any.
    pub max_tokens: Option<usize>,
    /// Keep generating past EOS (`ignore_eos`, a vLLM extension).
    pub ignore_eos: bool,
}

/// Sampling values a request gets for the fields it leaves out: OpenAI's
/// defaults (temperature 1, no cuts), replaced by the checkpoint's
/// `generation_config.json` and then by `--override-generation-config`, as
/// vLLM does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    /// `temperature`, `[0, 2]`.
    pub temperature: f32,
    /// `top_p`, `(0, 1]`.
    pub top_p: f32,
    /// `top_k` (0 = off).
    pub top_k: usize,
    /// `min_p`, `[0, 1]`.
    pub min_p: f32,
    /// `repetition_penalty`, `(0, 2]`.
    pub repetition_penalty: f32,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        SamplingDefaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingDefaults {
    /// These defaults with the sampling keys of `v` (a `generation_config.json`
    /// or an override object) applied; `do_sample: false` means greedy. Keys
    /// outside their range are refused, naming the key.
    pub fn apply(mut self, v: &Value) -> Result<SamplingDefaults, String> {
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        let check = |k: &str, x: f64, lo: f64, hi: f64| {
            if x.is_finite() && x >= lo && x <= hi {
                Ok(x as f32)
            } else {
                Err(format!("`{k}` must be in [{lo}, {hi}], got {x}"))
            }
        };
        if let Some(x) = num("temperature") {
            self.temperature = check("temperature", x, 0.0, 2.0)?;
        }
        if let Some(x) = num("top_p") {
            self.top_p = check("top_p", x, f64::MIN_POSITIVE, 1.0)?;
        }
        if let Some(x) = num("top_k") {
            self.top_k = check("top_k", x, 0.0, 1e9)? as usize;
        }
        if let Some(x) = num("min_p") {
            self.min_p = check("min_p", x, 0.0, 1.0)?;
        }
        if let Some(x) = num("repetition_penalty") {
            self.repetition_penalty = check("repetition_penalty", x, f64::MIN_POSITIVE, 2.0)?;
        }
        if v.get("do_sample").and_then(Value::as_bool) == Some(false) {
            self.temperature = 0.0;
        }
        Ok(self)
    }
}

/// Reads `temperature`, `top_p`, `top_k`, `min_p`, `seed`, the penalties,
/// `stop`, and the first present of `max_keys` as the output budget; fields
/// left out take `defaults`.
pub fn read_sampling(
    f: &Fields<'_>,
    max_keys: &[&str],
    defaults: &SamplingDefaults,
) -> ApiResult<Sampling> {
    let mut max_tokens = None;
    for key in max_keys {
        if let Some(n) = f.int_in(key, 1, MAX_OUTPUT_TOKENS as i64)? {
            max_tokens = Some(n as usize);
            break;
        }
    }
    let top_k = match f.get::<i64>("top_k", "an integer")? {
        None => defaults.top_k,
        Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "invalid_value",
                Some("top_k"),
                format!("`top_k` must be -1, 0 or positive, got {k}"),
            ))
        }
    };
    let stop = match f.raw("stop") {
        None => Vec::new(),
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(_) => f.require::<Vec<String>>("stop", "a string or an array of strings")?,
    };
    if stop.len() > MAX_STOP_STRINGS || stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("stop"),
            format!("`stop` takes at most {MAX_STOP_STRINGS} non-empty strings"),
        ));
    }
    let seed = match f.raw("seed") {
        None => None,
        Some(_) => Some(f.require::<i64>("seed", "an integer")? as u64),
    };
    Ok(Sampling {
        params: SamplingParams {
            temperature: f
                .float_in("temperature", 0.0, 2.0, false)?
                .unwrap_or(defaults.temperature),
            top_p: f
                .float_in("top_p", 0.0, 1.0, true)?
                .unwrap_or(defaults.top_p),
            top_k,
            min_p: f
                .float_in("min_p", 0.0, 1.0, false)?
                .unwrap_or(defaults.min_p),
            seed,
            repetition_penalty: f
                .float_in("repetition_penalty", 0.0, 2.0, true)?
                .unwrap_or(defaults.repetition_penalty),
            presence_penalty: f
                .float_in("presence_penalty", -2.0, 2.0, false)?
                .unwrap_or(0.0),
            frequency_penalty: f
                .float_in("frequency_penalty", -2.0, 2.0, false)?
                .unwrap_or(0.0),
        },
        stop,
        max_tokens,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
    })
}

/// Refuses `n` > 1 (one choice per request).
pub fn refuse_n(f: &Fields<'_>) -> ApiResult<()> {
    match f.int_in("n", 1, 128)? {
        Some(n) if n > 1 => Err(ApiError::unsupported("n", "one choice per request")),
        _ => Ok(()),
    }
}

/// The [`ValidRequest`] for `prompt` with these settings; the output budget
/// defaults to `--default-max-tokens` and is capped by the context left.
pub fn valid_request(
    state: &AppState,
    prompt: Vec<u32>,
    s: &Sampling,
    session: Option<String>,
) -> ApiResult<ValidRequest> {
    let info = &state.model.info;
    state.model.check_prompt(prompt.len())?;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("prompt"),
            format!(
                "token id {bad} is outside the vocabulary (size {})",
                info.vocab_size
            ),
        ));
    }
    let room = info.max_position - prompt.len();
    let max_tokens = s
        .max_tokens
        .unwrap_or(state.config.default_max_tokens)
        .min(room)
        .max(1);
    let ids = if s.ignore_eos {
        Vec::new()
    } else {
        info.eos_ids.clone()
    };
    Ok(ValidRequest {
        session,
        prompt,
        cache_key: None,
        max_tokens,
        sampling: s.params.clone(),
        stop: StopConditions {
            ids,
            strings: s.stop.clone(),
        },
        ..Default::default()
    })
}

/// A compile error of a request's constraint as a 400 naming the problem
/// (`invalid_schema`, `unsupported_schema_keyword`, `unknown_tool`, ...).
fn compile_error(param: &str, e: CompileError) -> ApiError {
    ApiError::invalid(e.kind(), Some(param), e.to_string())
}

/// Reads a `response_format` / `text.format` object (`param` names it);
/// `None` for `text` or absent. A constrained format on a server without a
/// constraint factory is refused.
pub fn read_output_format(
    state: &AppState,
    param: &str,
    v: Option<&Value>,
) -> ApiResult<Option<ConstraintSpec>> {
    let kind = v.and_then(|v| v.get("type")).and_then(Value::as_str);
    let constrained = v.is_some_and(|v| !v.is_null()) && kind != Some("text");
    if constrained && state.engine.constraints().factory.is_none() {
        return Err(ApiError::unsupported(
            param,
            "this server has no token trie for its model, so it cannot constrain output",
        ));
    }
    ConstraintSpec::from_response_format(v).map_err(|e| compile_error(param, e))
}

/// The served model's tool-call format, as its output parser reads it:
/// Kimi K3 XTML, Kimi K2 sections (ids counted over the conversation's
/// calls), Hermes `<tool_call>` JSON for Jinja (ChatML) templates.
pub fn tool_format(state: &AppState, thinking: bool, messages: &[Message]) -> Option<ToolFormat> {
    Some(match state.model.format.as_ref()? {
        ChatFormat::KimiK3 => ToolFormat::KimiK3 { thinking },
        ChatFormat::KimiK2 => ToolFormat::KimiK2 {
            first_call_index: messages
                .iter()
                .map(|m| m.tool_calls.as_ref().map_or(0, Vec::len))
                .sum(),
            thinking: false,
        },
        ChatFormat::Jinja(_) => ToolFormat::Hermes,
    })
}

/// What a request asks to constrain, before compilation.
#[derive(Debug, Clone, Default)]
pub struct OutputConstraint<'a> {
    /// Chat-shaped `tools`.
    pub tools: &'a [Value],
    /// `tool_choice` as given.
    pub tool_choice: Option<&'a Value>,
    /// `parallel_tool_calls`.
    pub parallel_tool_calls: Option<bool>,
    /// `response_format` / `text.format`, read by [`read_output_format`].
    pub format: Option<ConstraintSpec>,
    /// The prompt opened the model's reasoning channel.
    pub thinking: bool,
    /// The conversation (Kimi K2 numbers its call ids over it).
    pub messages: &'a [Message],
}

/// Compiles what `c` asks for into the constraint the scheduler runs, or
/// `None` (nothing asked, `tool_choice: "none"`, tool calls unconstrained
/// by `--tool-call-constraint off`, or no factory). Errors are 400s that
/// name the problem, before any token; compilation runs off the socket
/// threads.
pub async fn compile_constraint(
    state: &AppState,
    c: OutputConstraint<'_>,
) -> ApiResult<Option<SeqConstraint>> {
    let setup = state.engine.constraints();
    let Some(factory) = setup.factory.clone() else {
        return Ok(None);
    };
    let constrains_tools =
        !c.tools.is_empty() && !matches!(c.tool_choice.and_then(Value::as_str), Some("none"));
    let (spec, param) = match c.format {
        Some(_) if constrains_tools => {
            return Err(ApiError::unsupported(
                "response_format",
                "a structured output format together with callable tools; set `tool_choice` to `none` or drop the format",
            ))
        }
        Some(spec) => (spec, "response_format"),
        None if constrains_tools && setup.tool_calls => {
            let Some(format) = tool_format(state, c.thinking, c.messages) else {
                return Ok(None);
            };
            let tools = Value::Array(c.tools.to_vec());
            match ToolsSpec::from_openai(
                Some(&tools),
                c.tool_choice,
                c.parallel_tool_calls,
                format,
            )
            .map_err(|e| compile_error("tools", e))?
            {
                Some(t) => (ConstraintSpec::Tools(t), "tools"),
                None => return Ok(None),
            }
        }
        None => return Ok(None),
    };
    let jump_forward = setup.jump_forward;
    let _slot = state.engine.compile_slot()?;
    let compiled = tokio::task::spawn_blocking(move || factory.compile_boxed(&spec))
        .await
        .map_err(|e| ApiError::internal(format!("compiling the constraint: {e}")))?;
    let constraint = compiled.map_err(|e| compile_error(param, e))?;
    Ok(Some(SeqConstraint {
        constraint,
        jump_forward,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_config_keys_replace_the_defaults_and_are_checked() {
        let d = SamplingDefaults::default()
            .apply(&serde_json::json!({"temperature": 0.6, "top_p": 0.9, "top_k": 40, "bos_token_id": 1}))
            .unwrap();
        assert_eq!((d.temperature, d.top_p, d.top_k), (0.6, 0.9, 40));
        assert_eq!(d.min_p, 0.0);
        let greedy = d.apply(&serde_json::json!({"do_sample": false})).unwrap();
        assert_eq!(greedy.temperature, 0.0);
        let e = SamplingDefaults::default()
            .apply(&serde_json::json!({"temperature": 7}))
            .unwrap_err();
        assert_eq!(e, "`temperature` must be in [0, 2], got 7");
    }
}
