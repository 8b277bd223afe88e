//! Sampling and length fields shared by every generation endpoint, read
//! from client JSON into a [`ValidRequest`] (validation at the edge: each
//! error names the field and the limit).

use caracal_actors::messages::{StopConditions, ValidRequest};
use caracal_kernels::sampling::SamplingParams;

use super::error::{ApiError, ApiResult};
use super::fields::Fields;
use super::AppState;
use crate::request::MAX_OUTPUT_TOKENS;

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

/// Reads `temperature`, `top_p`, `top_k`, `min_p`, `seed`, the penalties,
/// `stop`, and the first present of `max_keys` as the output budget.
pub fn read_sampling(f: &Fields<'_>, max_keys: &[&str]) -> ApiResult<Sampling> {
    let mut max_tokens = None;
    for key in max_keys {
        if let Some(n) = f.int_in(key, 1, MAX_OUTPUT_TOKENS as i64)? {
            max_tokens = Some(n as usize);
            break;
        }
    }
    let top_k = match f.get::<i64>("top_k", "an integer")? {
        None | Some(-1) | Some(0) => 0,
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
            temperature: f.float_in("temperature", 0.0, 2.0, false)?.unwrap_or(1.0),
            top_p: f.float_in("top_p", 0.0, 1.0, true)?.unwrap_or(1.0),
            top_k,
            min_p: f.float_in("min_p", 0.0, 1.0, false)?.unwrap_or(0.0),
            seed,
            repetition_penalty: f
                .float_in("repetition_penalty", 0.0, 2.0, true)?
                .unwrap_or(1.0),
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

/// Refuses `logprobs` / `top_logprobs`: the engine streams ids without
/// their log-probabilities.
pub fn refuse_logprobs(f: &Fields<'_>) -> ApiResult<()> {
    let asked = match f.raw("logprobs") {
        None => false,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(serde_json::Value::Number(n)) => n.as_u64() != Some(0),
        Some(_) => true,
    };
    if asked {
        return Err(ApiError::unsupported(
            "logprobs",
            "this engine does not return log-probabilities",
        ));
    }
    if f.get::<i64>("top_logprobs", "an integer")?
        .is_some_and(|n| n > 0)
    {
        return Err(ApiError::unsupported(
            "top_logprobs",
            "this engine does not return log-probabilities",
        ));
    }
    Ok(())
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
    })
}
