//! `POST /v1/completions`: OpenAI Completions with a text prompt or token
//! ids (`[1, 2, 3]`, or one such list in a list), JSON or SSE. The prompt
//! is used as given (no chat template); output is plain text.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::chat::{collect, usage};
use super::error::{ApiError, ApiResult};
use super::fields::Fields;
use super::generation::{self, Finish, GenEvent, GenRequest, GenSummary, LogprobEntry};
use super::http::{
    check_model, next_or_gone, ok_json, read_json, sse_done, sse_frame, sse_response, SSE_BUFFER,
};
use super::logprobs;
use super::metrics::Endpoint;
use super::params::{read_sampling, refuse_n, valid_request};
use super::{new_id, unix_now, AppState};

/// Handles one request.
pub async fn handle(State(state): State<Arc<AppState>>, body: Body) -> Response {
    state.metrics.request(Endpoint::Completions);
    match run(state.clone(), body).await {
        Ok(r) => r,
        Err(e) => {
            state
                .metrics
                .errors
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            e.into_response()
        }
    }
}

/// The prompt ids of `prompt`: a string (tokenized), ids, or one of either in a list.
fn prompt_ids(state: &AppState, prompt: &Value) -> ApiResult<Vec<u32>> {
    let bad = || {
        ApiError::invalid(
            "invalid_type",
            Some("prompt"),
            "`prompt`: expected a string, an array of token ids, or a one-element array of either",
        )
    };
    match prompt {
        Value::String(s) => state
            .model
            .tokenizer()?
            .encode(s)
            .map_err(|e| ApiError::invalid("invalid_value", Some("prompt"), e.to_string())),
        Value::Array(items) if items.iter().all(Value::is_number) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .filter(|&n| n <= u32::MAX as u64)
                    .map(|n| n as u32)
                    .ok_or_else(bad)
            })
            .collect(),
        Value::Array(items) if items.len() == 1 => prompt_ids(state, &items[0]),
        Value::Array(items) if items.len() > 1 => Err(ApiError::unsupported(
            "prompt",
            "one prompt per request (send several requests)",
        )),
        _ => Err(bad()),
    }
}

fn finish_reason(s: &GenSummary) -> &'static str {
    match s.finish {
        Finish::Length => "length",
        _ => "stop",
    }
}

async fn run(state: Arc<AppState>, body: Body) -> ApiResult<Response> {
    let obj = read_json(&state, body).await?;
    let f = Fields::new(&obj);
    let model = check_model(&state, f.str("model")?.as_deref())?;
    let logprobs = logprobs::read_completions(&f)?;
    refuse_n(&f)?;
    if f.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::unsupported("echo", "the prompt is not echoed"));
    }
    if f.str("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix", "no fill-in-the-middle"));
    }
    let prompt = prompt_ids(
        &state,
        f.raw("prompt").ok_or_else(|| ApiError::missing("prompt"))?,
    )?;
    let mut sampling = read_sampling(&f, &["max_tokens"], &state.config.sampling_defaults)?;
    // The Completions API's default budget is 16 tokens.
    sampling.max_tokens = sampling.max_tokens.or(Some(16));
    let mut valid = valid_request(&state, prompt, &sampling, f.str("user")?)?;
    valid.logprobs = logprobs;
    let want_lp = logprobs.is_some();
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(o) => Fields::nested(o, "stream_options")
            .bool("include_usage")?
            .unwrap_or(false),
        None => false,
    };
    let rx = generation::start(
        &state,
        GenRequest {
            valid,
            parser: None,
            skip_special: true,
            stop: sampling.stop.clone(),
            cancel: None,
        },
    )
    .await?;
    let id = new_id("cmpl-");
    let created = unix_now();
    if !stream {
        let (c, s) = collect(rx).await?;
        return Ok(ok_json(&json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": null,
            "choices": [{"index": 0, "text": c.text,
                         "logprobs": if want_lp { logprobs::completions_json(&c.logprobs, 0) } else { Value::Null },
                         "finish_reason": finish_reason(&s)}],
            "usage": usage(&s),
        })));
    }
    let (tx, frames) = mpsc::channel::<Bytes>(SSE_BUFFER);
    tokio::spawn(async move {
        let mut rx = rx;
        // Entries of tokens whose text has not been sent, and the text sent so far.
        let mut pending: Vec<LogprobEntry> = Vec::new();
        let mut offset = 0usize;
        let chunk = |text: &str, finish: Option<&str>, lp: Value| {
            let mut c = json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": null,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
            });
            if include_usage {
                c["usage"] = Value::Null;
            }
            sse_frame(None, &c)
        };
        while let Some(ev) = next_or_gone(&mut rx, &tx).await {
            let frame = match ev {
                GenEvent::Logprob(e) => {
                    pending.push(e);
                    continue;
                }
                GenEvent::Text(t) => {
                    let lp = if want_lp {
                        logprobs::completions_json(&std::mem::take(&mut pending), offset)
                    } else {
                        Value::Null
                    };
                    offset += t.len();
                    chunk(&t, None, lp)
                }
                GenEvent::Finished(s) => {
                    let lp = if want_lp {
                        logprobs::completions_json(&std::mem::take(&mut pending), offset)
                    } else {
                        Value::Null
                    };
                    if tx
                        .send(chunk("", Some(finish_reason(&s)), lp))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    if include_usage {
                        let u = json!({"id": id, "object": "text_completion", "created": created,
                                       "model": model, "choices": [], "usage": usage(&s)});
                        if tx.send(sse_frame(None, &u)).await.is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(sse_done()).await;
                    return;
                }
                GenEvent::Failed(e) => {
                    let _ = tx.send(sse_frame(None, &e.http_body())).await;
                    let _ = tx.send(sse_done()).await;
                    return;
                }
                _ => continue,
            };
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    });
    Ok(sse_response(frames))
}
