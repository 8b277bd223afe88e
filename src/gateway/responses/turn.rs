//! One Responses turn, shared by HTTP and the WebSocket mode: rebuild the
//! context from the previous response (its conversation and cached ids),
//! render and tokenize the prompt, run the generation, stream the events,
//! and return what the next turn needs.

use std::sync::Arc;

use serde_json::Value;
use tokio::sync::{mpsc, watch};

use super::events::ResponseBuilder;
use super::store::StoredResponse;
use super::types::{prompt_messages, text_format_of, ResponseRequest};
use crate::chat::toolcall::Message;
use crate::gateway::error::{ApiError, ApiResult};
use crate::gateway::generation::{self, GenEvent, GenRequest};
use crate::gateway::http::next_or_gone;
use crate::gateway::media;
use crate::gateway::model::{CachedPrefix, Conversation};
use crate::gateway::params::{
    compile_constraint, read_output_format, valid_request, OutputConstraint,
};
use crate::gateway::AppState;
use crate::generate::EncodedMedia;

/// A turn with its prompt built.
pub struct Turn {
    /// The request.
    pub req: ResponseRequest,
    /// Events and the response object.
    pub builder: ResponseBuilder,
    /// Previous context plus this turn's input.
    pub context: Vec<Message>,
    /// The rendered prompt.
    pub prompt_text: String,
    /// Its ids.
    pub prompt_ids: Vec<u32>,
    /// Its images and video chunks, encoded (video parts were resolved
    /// into chunk prompts before rendering; `context` keeps them as sent).
    pub media: Vec<EncodedMedia>,
}

/// Builds the prompt of `req` on top of `prev`, encoding its media first.
pub async fn prepare(
    state: &AppState,
    req: ResponseRequest,
    prev: Option<&StoredResponse>,
) -> ApiResult<Turn> {
    let mut context = prev.map(|p| p.context.clone()).unwrap_or_default();
    context.extend(req.messages.iter().cloned());
    name_tool_results(&mut context);
    let messages = prompt_messages(req.instructions.as_deref(), &context);
    let mut conv = Conversation {
        messages,
        tools: req.chat_tools.clone(),
        tool_choice: req.tool_choice.clone(),
        thinking: req.thinking,
    };
    let encoded = media::encode_media(state, &context).await?;
    encoded.substitute(&mut conv.messages);
    let prompt_text = state.model.render(&conv)?;
    let prompt_ids = state.model.encode(&prompt_text, prev.map(|p| &p.prefix))?;
    let builder = ResponseBuilder::new(&req);
    Ok(Turn {
        req,
        builder,
        context,
        prompt_text,
        prompt_ids,
        media: encoded.items,
    })
}

/// Gives each tool result the name of the call it answers (formats such
/// as Kimi K3 render it), looking through the whole conversation.
pub fn name_tool_results(context: &mut [Message]) {
    for i in 0..context.len() {
        if context[i].role != "tool" || context[i].name.is_some() {
            continue;
        }
        let Some(call_id) = context[i].tool_call_id.clone() else {
            continue;
        };
        let name = context[..i].iter().rev().find_map(|m| {
            m.tool_calls
                .iter()
                .flatten()
                .find(|c| c.id == call_id)
                .map(|c| c.function.name.clone())
        });
        context[i].name = name;
    }
}

/// A turn whose generation has been accepted by the engine.
pub struct Running {
    /// The turn.
    pub turn: Turn,
    /// Its generation events.
    rx: mpsc::Receiver<GenEvent>,
}

/// Submits the turn (`max_tokens` 1 for `generate: false`, whose output is
/// dropped: the engine prefills and caches the prompt). Errors here come
/// before any event.
pub async fn begin(
    state: &Arc<AppState>,
    turn: Turn,
    session: Option<String>,
    cancel: Option<watch::Receiver<bool>>,
) -> ApiResult<Running> {
    let mut sampling = turn.req.sampling.clone();
    if !turn.req.generate {
        sampling.max_tokens = Some(1);
    }
    let mut valid = valid_request(state, turn.prompt_ids.clone(), &sampling, session)?;
    media::splice(state, &mut valid, &turn.media)?;
    valid.logprobs = turn.req.logprobs.filter(|_| turn.req.generate);
    let constraint = if turn.req.generate {
        let format = read_output_format(
            state,
            "text.format",
            text_format_of(turn.req.echo.get("text")),
        )?;
        compile_constraint(
            state,
            OutputConstraint {
                tools: &turn.req.chat_tools,
                tool_choice: Some(&turn.req.tool_choice_raw),
                parallel_tool_calls: Some(turn.req.parallel_tool_calls),
                format,
                thinking: turn.req.thinking,
                messages: &turn.context,
            },
        )
        .await?
    } else {
        None
    };
    let rx = generation::start_with(
        state,
        GenRequest {
            valid,
            parser: state.model.parser(turn.req.thinking),
            skip_special: state.model.skip_special_in_output(),
            stop: sampling.stop.clone(),
            cancel,
        },
        constraint,
    )
    .await?;
    Ok(Running { turn, rx })
}

/// How a turn ended.
pub struct Outcome {
    /// The final response object.
    pub response: Value,
    /// What the next turn continues from (none after a failure or cancellation).
    pub stored: Option<StoredResponse>,
}

impl Running {
    /// Streams the events into `out` (a closed `out` stops the generation)
    /// and returns the outcome.
    pub async fn drive(mut self, state: &AppState, out: &mpsc::Sender<Value>) -> Outcome {
        let generate = self.turn.req.generate;
        let b = &mut self.turn.builder;
        let first = if generate {
            b.start()
        } else {
            b.created_only()
        };
        let mut alive = send_all(out, first).await;
        while let Some(ev) = next_or_gone(&mut self.rx, out).await {
            match ev {
                GenEvent::Finished(s) => {
                    let b = &mut self.turn.builder;
                    let evs = if generate {
                        b.finish(&s)
                    } else {
                        b.finish_empty(ResponseBuilder::usage_of(
                            &crate::gateway::generation::GenSummary {
                                output_ids: Vec::new(),
                                ..s.clone()
                            },
                        ))
                    };
                    let _ = send_all(out, evs).await;
                    let response = b.response();
                    let cancelled = response["status"] == "cancelled";
                    let stored = (!cancelled).then(|| {
                        let mut context = std::mem::take(&mut self.turn.context);
                        let (output_text, output_ids) = if generate {
                            context.push(b.history());
                            (state.model.raw_text(&s.output_ids), s.output_ids.clone())
                        } else {
                            (String::new(), Vec::new())
                        };
                        StoredResponse {
                            object: response.clone(),
                            context,
                            prefix: CachedPrefix {
                                prompt_text: std::mem::take(&mut self.turn.prompt_text),
                                prompt_ids: std::mem::take(&mut self.turn.prompt_ids),
                                output_text,
                                output_ids,
                            },
                            input_items: std::mem::take(&mut self.turn.req.input_items),
                            lane: self.turn.req.stream_id.clone(),
                        }
                    });
                    return Outcome { response, stored };
                }
                GenEvent::Failed(e) => return self.failed(out, &e).await,
                ev if generate => {
                    if alive {
                        let evs = self.turn.builder.on_event(ev);
                        alive = send_all(out, evs).await;
                    }
                    if !alive {
                        // The consumer is gone: dropping the events cancels the generation.
                        return self
                            .failed(out, &ApiError::internal("the client went away"))
                            .await;
                    }
                }
                _ => {}
            }
        }
        let why = if out.is_closed() {
            // The consumer is gone: dropping the events cancels the generation.
            "the client went away"
        } else {
            "the generation ended without a result"
        };
        self.failed(out, &ApiError::internal(why)).await
    }

    async fn failed(&mut self, out: &mpsc::Sender<Value>, e: &ApiError) -> Outcome {
        let evs = self.turn.builder.fail(e);
        let _ = send_all(out, evs).await;
        Outcome {
            response: self.turn.builder.response(),
            stored: None,
        }
    }
}

async fn send_all(out: &mpsc::Sender<Value>, evs: Vec<Value>) -> bool {
    for e in evs {
        if out.send(e).await.is_err() {
            return false;
        }
    }
    true
}
