//! The stream path as a request: the session's instructions and tools, then one
//! user message holding the window's chunk prompts, cut right after the last chunk
//! (see the parent module's docs), prefilled by a request that samples one greedy
//! token and discards it, so its tokens (and the KDA state at its last page
//! boundary) are committed to the cache on the session's key.

use caracal_actors::messages::{CacheReport, TokenEvent, ValidRequest};
use caracal_kernels::sampling::SamplingParams;

use super::{PathContext, WindowChunk};
use crate::chat::toolcall::{ContentPart, Message, MessageContent};
use crate::gateway::engine::event_error;
use crate::gateway::error::{ApiError, ApiResult};
use crate::gateway::media;
use crate::gateway::model::Conversation;
use crate::gateway::params::{valid_request, Sampling};
use crate::gateway::responses::types::prompt_messages;
use crate::gateway::AppState;
use crate::generate::EncodedMedia;

/// The user message holding the chunk prompts.
pub(super) fn stream_message(prompts: String) -> Message {
    Message {
        content: Some(MessageContent::Parts(vec![ContentPart::video(prompts)])),
        ..Message::text("user", "")
    }
}

/// The prefill request of the stream path over `window`, and the tokens before its
/// first chunk.
pub(super) fn path_request(
    state: &AppState,
    session: &str,
    ctx: &PathContext,
    window: &[WindowChunk],
) -> ApiResult<(ValidRequest, usize)> {
    let prompts: String = window.iter().map(|c| c.chunk.prompt.as_str()).collect();
    let conv = Conversation {
        messages: prompt_messages(Some(&ctx.instructions), &[stream_message(prompts.clone())]),
        tools: ctx.tools.clone(),
        tool_choice: ctx.tool_choice.clone(),
        thinking: true,
    };
    let text = state.model.render(&conv)?;
    let at = text
        .rfind(&prompts)
        .ok_or_else(|| ApiError::internal("the chat format dropped the video chunks"))?;
    let ids = state.model.encode(&text[..at + prompts.len()], None)?;
    let head_ids = state.model.encode(&text[..at], None)?;
    let head = ids
        .iter()
        .zip(&head_ids)
        .take_while(|(a, b)| a == b)
        .count();
    let sampling = Sampling {
        params: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        stop: Vec::new(),
        max_tokens: Some(1),
        ignore_eos: true,
    };
    let mut valid = valid_request(state, ids, &sampling, Some(session.to_string()))?;
    let items: Vec<EncodedMedia> = window.iter().map(|c| c.chunk.item.clone()).collect();
    media::splice(state, &mut valid, &items)?;
    Ok((valid, head))
}

/// Runs a prefill-only request (one greedy token, discarded) and waits for it to be
/// committed to the cache.
pub(super) async fn prefill(state: &AppState, valid: ValidRequest) -> ApiResult<CacheReport> {
    let mut rx = state.engine.submit(valid).await?;
    while let Some(ev) = rx.recv().await {
        match ev {
            TokenEvent::Finished { cache, .. } => return Ok(cache),
            TokenEvent::Error { kind, message } => return Err(event_error(kind, message)),
            TokenEvent::Token { .. } => {}
        }
    }
    Err(ApiError::shutting_down())
}
