//! One generation, from a [`ValidRequest`] to protocol-neutral events.
//!
//! [`start`] submits the request and spawns a task that reads the engine's
//! [`TokenEvent`]s, detokenizes them incrementally, cuts the text at a stop
//! string, runs the model's output parser (content, reasoning, tool calls)
//! and forwards [`GenEvent`]s over a bounded channel. The protocol handlers
//! (chat, completions, responses, realtime) only translate those events.
//!
//! Backpressure and cancellation: the task waits (`send().await`) when the
//! client's channel is full, so the engine's own bounded channel fills and
//! the scheduler pauses that sequence (credit). When the consumer goes away
//! (a closed socket, a dropped SSE body) or the request is cancelled
//! (`response.cancel`, shutdown), the task drops the engine receiver, and
//! the scheduler removes the sequence within one step without caching
//! anything it produced.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use caracal_actors::constraint::SeqConstraint;
use caracal_actors::messages::{FinishReason, MissReason, TokenEvent, TokenLogprob, ValidRequest};
use tokio::sync::{mpsc, watch};

use super::engine::event_error;
use super::error::{ApiError, ApiResult};
use super::model::OutputParser;
use super::shutdown::Phase;
use super::{new_id, AppState};
use crate::chat::toolcall::ParseEvent;
use crate::text::tokenizer::StreamDecoder;

/// Events buffered between the generation task and its consumer.
const EVENT_BUFFER: usize = 32;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop id or string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Cancelled by the client or by shutdown.
    Cancelled,
}

/// What a generation produced, at its end.
#[derive(Debug, Clone)]
pub struct GenSummary {
    /// Why it ended.
    pub finish: Finish,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Why the rest of the prompt missed the cache (`None` when it all hit).
    pub miss_reason: Option<MissReason>,
    /// Output ids (the stop id included).
    pub output_ids: Vec<u32>,
    /// Format violations the parser reported (never shown as text).
    pub malformed: Vec<String>,
    /// The prompt's media spans (images, video chunks), in order.
    pub media: Vec<MediaUse>,
}

/// How one media span of the prompt was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaUse {
    /// Its tokens.
    pub tokens: usize,
    /// Whether its whole span came from the prefix cache (no prefill).
    pub cached: bool,
}

impl GenSummary {
    /// Prompt tokens that stand for media.
    pub fn media_tokens(&self) -> usize {
        self.media.iter().map(|m| m.tokens).sum()
    }

    /// Media tokens served from the prefix cache.
    pub fn cached_media_tokens(&self) -> usize {
        self.media
            .iter()
            .filter(|m| m.cached)
            .map(|m| m.tokens)
            .sum()
    }
}

/// What a generation streams.
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// Answer text.
    Text(String),
    /// Reasoning text.
    Reasoning(String),
    /// A tool call begins.
    ToolStart {
        /// 0-based, dense.
        index: usize,
        /// Call id (the model's for Kimi formats, else a fresh `call_…`).
        id: String,
        /// Function name.
        name: String,
    },
    /// More of a call's arguments.
    ToolArgs {
        /// The call.
        index: usize,
        /// JSON text.
        delta: String,
    },
    /// A call is complete.
    ToolEnd {
        /// The call.
        index: usize,
    },
    /// Log-probabilities of the next generated token (sent before its text,
    /// only when the request asked for them; stop ids get none).
    Logprob(LogprobEntry),
    /// The end; nothing follows.
    Finished(GenSummary),
    /// A failure; nothing follows.
    Failed(ApiError),
}

/// One token's log-probabilities, with its text (OpenAI's `token`, `bytes`,
/// `logprob`, `top_logprobs`).
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobEntry {
    /// The token as text (lossy where it is part of a UTF-8 sequence).
    pub token: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// Natural-log probability.
    pub logprob: f32,
    /// The most likely alternatives: text, bytes, log-probability.
    pub top: Vec<(String, Vec<u8>, f32)>,
}

/// The bytes and text of one token id (exact bytes, partial UTF-8
/// included; the text is their lossy UTF-8).
fn token_piece(state: &AppState, id: u32) -> (String, Vec<u8>) {
    let bytes = state
        .model
        .tokenizer
        .as_deref()
        .and_then(|t| t.token_bytes(id))
        .unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// The wire entry of one token's log-probabilities.
fn logprob_entry(state: &AppState, id: u32, lp: &TokenLogprob) -> LogprobEntry {
    let (token, bytes) = token_piece(state, id);
    let top = lp
        .top
        .iter()
        .map(|&(t, l)| {
            let (s, b) = token_piece(state, t);
            (s, b, l)
        })
        .collect();
    LogprobEntry {
        token,
        bytes,
        logprob: lp.logprob,
        top,
    }
}

/// A generation to run.
pub struct GenRequest {
    /// The validated request.
    pub valid: ValidRequest,
    /// Output parser; `None` streams plain text (completions).
    pub parser: Option<OutputParser>,
    /// Decode without special tokens.
    pub skip_special: bool,
    /// Stop strings, cut from the text.
    pub stop: Vec<String>,
    /// Set to true to cancel.
    pub cancel: Option<watch::Receiver<bool>>,
}

/// Cuts a text stream at the first stop string, holding back a tail that
/// may begin one.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    /// The stop strings.
    stops: Vec<String>,
    /// Held-back text.
    held: String,
    /// A stop string was seen: everything after is dropped.
    pub hit: bool,
}

impl StopMatcher {
    /// A matcher for `stops`.
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops,
            held: String::new(),
            hit: false,
        }
    }

    /// The text of `delta` that is safe to release.
    pub fn push(&mut self, delta: &str) -> String {
        if self.hit {
            return String::new();
        }
        if self.stops.is_empty() {
            return delta.to_string();
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(delta);
        if let Some(pos) = self.stops.iter().filter_map(|s| buf.find(s.as_str())).min() {
            self.hit = true;
            buf.truncate(pos);
            return buf;
        }
        let keep = (1..=buf.len().min(self.max_len().saturating_sub(1)))
            .rev()
            .find(|&k| {
                buf.is_char_boundary(buf.len() - k)
                    && self
                        .stops
                        .iter()
                        .any(|s| s.starts_with(&buf[buf.len() - k..]))
            })
            .unwrap_or(0);
        self.held = buf.split_off(buf.len() - keep);
        buf
    }

    /// Releases held-back text at the end of the stream.
    pub fn finish(&mut self) -> String {
        if self.hit {
            String::new()
        } else {
            std::mem::take(&mut self.held)
        }
    }

    fn max_len(&self) -> usize {
        self.stops.iter().map(|s| s.len()).max().unwrap_or(0)
    }
}

/// Submits `req` and returns its event stream. Errors before the first
/// event (a full server, shutdown) come back here, so HTTP can answer with
/// a status.
pub async fn start(state: &Arc<AppState>, req: GenRequest) -> ApiResult<mpsc::Receiver<GenEvent>> {
    start_with(state, req, None).await
}

/// [`start`] with the output following `constraint` (compiled by
/// [`super::params::compile_constraint`]).
pub async fn start_with(
    state: &Arc<AppState>,
    req: GenRequest,
    constraint: Option<SeqConstraint>,
) -> ApiResult<mpsc::Receiver<GenEvent>> {
    if state.shutdown.is_shutting_down() {
        return Err(ApiError::shutting_down());
    }
    let prompt_tokens = req.valid.prompt.len();
    let stop_ids = req.valid.stop.ids.clone();
    let media_spans: Vec<(usize, usize)> =
        req.valid.media.iter().map(|m| (m.offset, m.len)).collect();
    let t0 = Instant::now();
    let engine_rx = state.engine.submit_with(req.valid, constraint).await?;
    let (tx, rx) = mpsc::channel(EVENT_BUFFER);
    let task = Driver {
        state: state.clone(),
        tx,
        parser: req.parser,
        skip_special: req.skip_special,
        stop: StopMatcher::new(req.stop),
        decoder: StreamDecoder::new(),
        ids: Vec::new(),
        call_ids: Vec::new(),
        malformed: Vec::new(),
        prompt_tokens,
        stop_ids,
        media_spans,
        t0,
        last: None,
    };
    tokio::spawn(task.run(engine_rx, req.cancel));
    Ok(rx)
}

/// The state of one generation task.
struct Driver {
    /// Shared gateway state (tokenizer, metrics, shutdown).
    state: Arc<AppState>,
    /// Events out.
    tx: mpsc::Sender<GenEvent>,
    /// Output parser.
    parser: Option<OutputParser>,
    /// Decode without specials.
    skip_special: bool,
    /// Stop strings.
    stop: StopMatcher,
    /// Incremental detokenizer.
    decoder: StreamDecoder,
    /// Output ids so far.
    ids: Vec<u32>,
    /// Issued call ids by index (formats without their own).
    call_ids: Vec<String>,
    /// Parser complaints.
    malformed: Vec<String>,
    /// Prompt length.
    prompt_tokens: usize,
    /// Ids that end generation (no log-probabilities are sent for them).
    stop_ids: Vec<u32>,
    /// `(offset, tokens)` of the prompt's media spans.
    media_spans: Vec<(usize, usize)>,
    /// Submission time.
    t0: Instant,
    /// Time of the previous token.
    last: Option<Instant>,
}

/// The driver could not deliver: its consumer is gone.
struct Gone;

impl Driver {
    async fn run(
        mut self,
        mut engine: mpsc::Receiver<TokenEvent>,
        cancel: Option<watch::Receiver<bool>>,
    ) {
        let shutdown = self.state.shutdown.clone();
        let cancelled = async move {
            match cancel {
                Some(mut c) => {
                    let _ = c.wait_for(|v| *v).await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::pin!(cancelled);
        let stopping = shutdown.reached(Phase::Cancel);
        tokio::pin!(stopping);
        loop {
            let ev = tokio::select! {
                ev = engine.recv() => ev,
                _ = self.tx.closed() => {
                    self.state.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                _ = &mut cancelled => {
                    self.state.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    drop(engine);
                    let _ = self.end(Finish::Cancelled, 0, None).await;
                    return;
                }
                _ = &mut stopping => {
                    drop(engine);
                    let _ = self.tx.send(GenEvent::Failed(ApiError::shutting_down())).await;
                    return;
                }
            };
            let result = match ev {
                Some(TokenEvent::Token { id, logprob }) => self.on_token(id, logprob).await,
                Some(TokenEvent::Finished { reason, cache, .. }) => {
                    let finish = match reason {
                        FinishReason::Stop => Finish::Stop,
                        FinishReason::Length => Finish::Length,
                    };
                    let _ = self
                        .end(finish, cache.cached_tokens, cache.miss_reason)
                        .await;
                    return;
                }
                Some(TokenEvent::Error { kind, message }) => {
                    let _ = self
                        .tx
                        .send(GenEvent::Failed(event_error(kind, message)))
                        .await;
                    return;
                }
                None => {
                    let _ = self
                        .tx
                        .send(GenEvent::Failed(ApiError::internal(
                            "the engine closed the stream",
                        )))
                        .await;
                    return;
                }
            };
            if result.is_err() {
                self.state.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }

    /// Sends one event, counting a stall when the consumer's buffer is full.
    async fn send(&self, ev: GenEvent) -> Result<(), Gone> {
        match self.tx.try_send(ev) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(ev)) => {
                self.state
                    .metrics
                    .credit_stalls
                    .fetch_add(1, Ordering::Relaxed);
                self.tx.send(ev).await.map_err(|_| Gone)
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(Gone),
        }
    }

    async fn on_token(&mut self, id: u32, lp: Option<Box<TokenLogprob>>) -> Result<(), Gone> {
        let now = Instant::now();
        match self.last {
            None => self
                .state
                .metrics
                .ttft
                .observe((now - self.t0).as_secs_f64()),
            Some(prev) => self.state.metrics.itl.observe((now - prev).as_secs_f64()),
        }
        self.last = Some(now);
        self.ids.push(id);
        if self.stop.hit {
            return Ok(());
        }
        if let Some(lp) = lp.filter(|_| !self.stop_ids.contains(&id)) {
            let entry = logprob_entry(&self.state, id, &lp);
            self.send(GenEvent::Logprob(entry)).await?;
        }
        let delta = match self.state.model.tokenizer.as_deref() {
            Some(tok) => self
                .decoder
                .push(tok, id, self.skip_special)
                .unwrap_or_default(),
            None => String::new(),
        };
        let text = self.stop.push(&delta);
        self.emit_text(&text).await
    }

    async fn emit_text(&mut self, text: &str) -> Result<(), Gone> {
        if text.is_empty() {
            return Ok(());
        }
        let events = match self.parser.as_mut() {
            Some(p) => p.push(text),
            None => vec![ParseEvent::Content(text.to_string())],
        };
        self.emit_parsed(events).await
    }

    async fn emit_parsed(&mut self, events: Vec<ParseEvent>) -> Result<(), Gone> {
        for ev in events {
            let out = match ev {
                ParseEvent::Content(t) => GenEvent::Text(t),
                ParseEvent::Reasoning(t) => GenEvent::Reasoning(t),
                ParseEvent::ToolCallStart { index, id, name } => {
                    let keep = self.parser.as_ref().is_some_and(|p| p.keeps_call_ids());
                    let id = if keep { id } else { new_id("call_") };
                    self.call_ids.push(id.clone());
                    GenEvent::ToolStart { index, id, name }
                }
                ParseEvent::ToolCallArgs { index, delta } => GenEvent::ToolArgs { index, delta },
                ParseEvent::ToolCallEnd { index } => GenEvent::ToolEnd { index },
                ParseEvent::Malformed { message, .. } => {
                    tracing::debug!(%message, "model output broke its tool-call format");
                    self.malformed.push(message);
                    continue;
                }
            };
            self.send(out).await?;
        }
        Ok(())
    }

    async fn end(
        &mut self,
        finish: Finish,
        cached: usize,
        miss: Option<MissReason>,
    ) -> Result<(), Gone> {
        if let Some(tok) = self.state.model.tokenizer.as_deref() {
            let rest = self
                .decoder
                .flush(tok, self.skip_special)
                .unwrap_or_default();
            let text = self.stop.push(&rest);
            self.emit_text(&text).await?;
        }
        let tail = self.stop.finish();
        self.emit_text(&tail).await?;
        if let Some(p) = self.parser.as_mut() {
            let events = p.finish();
            self.emit_parsed(events).await?;
        }
        let m = &self.state.metrics;
        m.prompt_tokens
            .fetch_add(self.prompt_tokens as u64, Ordering::Relaxed);
        m.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        m.generation_tokens
            .fetch_add(self.ids.len() as u64, Ordering::Relaxed);
        let summary = GenSummary {
            finish,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: cached,
            miss_reason: miss,
            output_ids: std::mem::take(&mut self.ids),
            malformed: std::mem::take(&mut self.malformed),
            media: self
                .media_spans
                .iter()
                .map(|&(offset, tokens)| MediaUse {
                    tokens,
                    cached: offset + tokens <= cached,
                })
                .collect(),
        };
        self.send(GenEvent::Finished(summary)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_split_text_and_hold_only_prefixes() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("abc E"), "abc ");
        assert_eq!(m.push("x"), "Ex");
        assert_eq!(m.push("yE"), "y");
        assert_eq!(m.push("N"), "");
        assert_eq!(m.push("D more"), "");
        assert!(m.hit);
        assert_eq!(m.push("later"), "");
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("no E"), "no ");
        assert_eq!(m.finish(), "E");
        let mut m = StopMatcher::new(Vec::new());
        assert_eq!(m.push("é"), "é");
    }
}
