//! Log-probabilities on the wire: reading what a request asks for, and
//! writing the per-token entries in each protocol's shape.
//!
//! - Chat Completions: `logprobs: true` with `top_logprobs` 0–20; the
//!   answer's `choices[].logprobs = {"content": [entry…], "refusal": null}`
//!   (streamed chunks carry the entries of their own tokens).
//! - Completions: `logprobs: N` (0–20); `choices[].logprobs = {"tokens",
//!   "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
//! - Responses: `include: ["message.output_text.logprobs"]` and/or
//!   `top_logprobs` 0–20; `output_text` parts and `response.output_text.delta`
//!   events carry `logprobs: [entry…]`.
//!
//! An entry is `{"token", "logprob", "bytes", "top_logprobs": [{"token",
//! "logprob", "bytes"}]}`. Values are the log-softmax of the model's raw
//! logits (before penalties, temperature and grammar masks), as vLLM's
//! default; stop tokens get no entry. Requests that ask for them are decoded
//! without jump-forward, so every token has its own.

use caracal_actors::messages::MAX_TOP_LOGPROBS;
use serde_json::{json, Value};

use super::error::{ApiError, ApiResult};
use super::fields::Fields;
use super::generation::LogprobEntry;

const MAX_TOP: i64 = MAX_TOP_LOGPROBS as i64;

/// Chat Completions: `logprobs` (bool) and `top_logprobs` (needs `logprobs`).
pub fn read_chat(f: &Fields<'_>) -> ApiResult<Option<usize>> {
    let on = f.bool("logprobs")?.unwrap_or(false);
    let top = f.int_in("top_logprobs", 0, MAX_TOP)?;
    match (on, top) {
        (true, top) => Ok(Some(top.unwrap_or(0) as usize)),
        (false, Some(n)) if n > 0 => Err(ApiError::invalid(
            "invalid_value",
            Some("top_logprobs"),
            "`top_logprobs` needs `logprobs: true`",
        )),
        (false, _) => Ok(None),
    }
}

/// Completions: `logprobs` (an integer, the alternatives per token).
pub fn read_completions(f: &Fields<'_>) -> ApiResult<Option<usize>> {
    Ok(f.int_in("logprobs", 0, MAX_TOP)?.map(|n| n as usize))
}

/// Responses: `top_logprobs`, or `include` naming `message.output_text.logprobs`.
pub fn read_responses(f: &Fields<'_>) -> ApiResult<Option<usize>> {
    let top = f.int_in("top_logprobs", 0, MAX_TOP)?;
    let included = f
        .array("include")?
        .is_some_and(|a| a.iter().any(|v| v == "message.output_text.logprobs"));
    Ok(match top {
        Some(n) if n > 0 || included => Some(n as usize),
        _ if included => Some(0),
        _ => None,
    })
}

/// One entry in the Chat / Responses shape.
pub fn entry_json(e: &LogprobEntry) -> Value {
    let top: Vec<Value> = e
        .top
        .iter()
        .map(|(t, b, l)| json!({"token": t, "logprob": l, "bytes": b}))
        .collect();
    json!({"token": e.token, "logprob": e.logprob, "bytes": e.bytes, "top_logprobs": top})
}

/// Entries as a JSON array (Responses `logprobs`).
pub fn entries_json(entries: &[LogprobEntry]) -> Value {
    Value::Array(entries.iter().map(entry_json).collect())
}

/// A Chat Completions choice's `logprobs` object.
pub fn chat_json(entries: &[LogprobEntry]) -> Value {
    json!({"content": entries_json(entries), "refusal": null})
}

/// A Completions choice's `logprobs` object; `offset` is the text length
/// before the first entry (0 for a whole answer, the streamed length so far
/// for a chunk).
pub fn completions_json(entries: &[LogprobEntry], mut offset: usize) -> Value {
    let mut tokens = Vec::with_capacity(entries.len());
    let mut values = Vec::with_capacity(entries.len());
    let mut tops = Vec::with_capacity(entries.len());
    let mut offsets = Vec::with_capacity(entries.len());
    for e in entries {
        tokens.push(json!(e.token));
        values.push(json!(e.logprob));
        let top: serde_json::Map<String, Value> = e
            .top
            .iter()
            .map(|(t, _, l)| (t.clone(), json!(l)))
            .collect();
        tops.push(Value::Object(top));
        offsets.push(json!(offset));
        offset += e.token.len();
    }
    json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets})
}

#[cfg(test)]
mod tests {
    use serde_json::Map;

    use super::*;

    fn fields(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn each_protocol_reads_its_own_spelling() {
        let o = fields(json!({"logprobs": true, "top_logprobs": 3}));
        assert_eq!(read_chat(&Fields::new(&o)).ok(), Some(Some(3)));
        let o = fields(json!({"logprobs": false}));
        assert_eq!(read_chat(&Fields::new(&o)).ok(), Some(None));
        let o = fields(json!({"top_logprobs": 2}));
        let e = read_chat(&Fields::new(&o)).err().map(|e| e.http_body());
        assert_eq!(
            e.as_ref().map(|b| b["error"]["param"].clone()),
            Some(json!("top_logprobs"))
        );
        let o = fields(json!({"logprobs": true, "top_logprobs": 21}));
        assert!(read_chat(&Fields::new(&o)).is_err());
        let o = fields(json!({"logprobs": 2}));
        assert_eq!(read_completions(&Fields::new(&o)).ok(), Some(Some(2)));
        let o = fields(json!({"include": ["message.output_text.logprobs"]}));
        assert_eq!(read_responses(&Fields::new(&o)).ok(), Some(Some(0)));
        let o = fields(json!({"top_logprobs": 0}));
        assert_eq!(read_responses(&Fields::new(&o)).ok(), Some(None));
    }

    #[test]
    fn completions_offsets_follow_the_token_text() {
        let e = |t: &str| LogprobEntry {
            token: t.into(),
            bytes: t.as_bytes().to_vec(),
            logprob: -0.5,
            top: vec![(t.into(), t.as_bytes().to_vec(), -0.5)],
        };
        let v = completions_json(&[e("Hel"), e("lo")], 4);
        assert_eq!(v["text_offset"], json!([4, 7]));
        assert_eq!(v["top_logprobs"][1], json!({"lo": -0.5}));
        assert_eq!(entry_json(&e("a"))["bytes"], json!([97]));
    }
}
