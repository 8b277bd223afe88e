//! A live video stream on the Realtime socket: appended bytes → frames taken at
//! the session's `fps` → chunks of up to 4 → the tower → prefilled on the
//! session's key at once, so a question later finds the stream in the cache
//! (`docs/protocol.md`, "Live video (Realtime)"; the wire spec the web console
//! shares; `video-anchors.md` §1 for the chunk prompt, §6 goals 4–8).
//!
//! ```text
//! append / binary ─▶ ops (bytes, ≤ MAX_BUFFERED_BYTES; past it the socket is not read)
//!   ─decode job (spawn_blocking: LiveDecoder::push for containers, image_frame for
//!    stills, LiveSelector by presentation time)─▶ frames on the session clock
//!   ─building (4 frames)─▶ pending chunks (≤ MAX_PENDING_CHUNKS; beyond: the oldest is
//!    dropped → frames_dropped)
//!   ─encode job (Ingest pool: preprocess as file video; VisionEncoder)─▶ encoded chunk
//!   ─prefill job (window + chunk rendered as the stream path, max_tokens 1 on the
//!    session's key)─▶ window ─▶ chunk_added; the superseded path ─DropPath─▶ window_evicted
//! ```
//!
//! [`Live`] is the state of one session's stream: plain fields changed by its
//! methods, which the session task calls on client events and on job results.
//! Every slow step runs as a job off the socket task (decoding on tokio's
//! blocking pool, preprocessing on the Ingest pool, the tower on the
//! VisionEncoder, the prefill in the engine); each stage has at most one job in
//! flight per stream and hands its result back over the session's bounded job
//! channel, so the stages pipeline (the tower encodes chunk `k + 1` while chunk
//! `k` is prefilled) and nothing queues without bound.
//!
//! # The stream path
//! The prompt of a stream is the session's instructions (and tools), then one user
//! message holding the window's chunk prompts
//! (`{HH:MM:SS.mmm}<|media_begin|>video<|media_content|><|media_pad|><|media_end|>`,
//! as file video), cut right after the last chunk: that is what each chunk's
//! prefill computes (only its new tokens, the rest is a cache hit), and what every
//! question's prompt starts with, followed by the conversation items. Answers come
//! after it and never change it.
//!
//! # Backpressure
//! Encoded bytes are never dropped (a container cannot lose bytes): while more than
//! [`MAX_BUFFERED_BYTES`] wait for the decoder the session stops reading its socket, so
//! TCP pushes back on the client. Decoded frames are never dropped either while their
//! chunk is being built; when encoding and prefill fall behind, whole pending chunks
//! are dropped, oldest first, beyond [`MAX_PENDING_CHUNKS`], and the client gets
//! `input_video_buffer.frames_dropped`: the freshest video wins, and memory is bounded
//! by one building chunk, the pending ones and one in each stage.
//!
//! # The window
//! When the media time of the window (first chunk's start to the last chunk's end plus
//! one frame) passes `window_seconds`, the oldest chunks leave at once until it is at
//! most [`WINDOW_LOW_WATER`] of the window. K3's KDA layers are recurrent, so the
//! remaining chunks are prefilled again from their kept embeddings (no tower pass);
//! evicting a quarter of the window at a time amortises that: a window of `W` media
//! seconds at `r` tokens per second re-prefills `0.75·W·r` tokens every `0.25·W`
//! seconds, i.e. 3 tokens per new token (4× the prefill of an unbounded stream, whose
//! context would grow without limit instead). Once the new path is cached the old one
//! is released with [`crate::gateway::engine::EngineHost::drop_path`]
//! (`window_evicted.pages_released`), so the KV pages of a stream stay bounded by its
//! window.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use caracal_actors::messages::CacheReport;
use caracal_media::video::{
    sniff, LiveDecoder, LiveSelector, OutputSize, Sniffed, VideoLimits, VideoOptions,
};
use caracal_media::{format_timestamp, MediaError, RgbImage};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

mod decode;
mod path;

use self::decode::{decode, Op, Source};
use self::path::{path_request, prefill, stream_message};
use super::events::event;
use super::video_settings::{VideoFormat, VideoSettings};
use crate::chat::toolcall::Message;
use crate::gateway::error::{ApiError, ApiResult};
use crate::gateway::media::{self, EncodedChunk};
use crate::gateway::model::ToolChoiceSpec;
use crate::gateway::AppState;
use crate::generate::EncodedMedia;

/// Encoded bytes waiting for the decoder before the session stops reading its socket.
pub const MAX_BUFFERED_BYTES: usize = 8 << 20;
/// Chunks waiting for the tower beyond which the oldest is dropped (the backpressure
/// policy; one more is in the tower and one in prefill).
pub const MAX_PENDING_CHUNKS: usize = 2;
/// After an eviction the window holds at most this share of `window_seconds`.
pub const WINDOW_LOW_WATER: f64 = 0.75;
/// Frames per chunk (Kimi's `temporal_merge_kernel_size`).
const CHUNK_FRAMES: usize = 4;
/// Job results waiting for the session task.
const JOB_CHANNEL: usize = 16;
/// The `param` of live video errors.
const PARAM: &str = "input_video_buffer";

/// The session's instructions and tools: what precedes the chunks in the stream path.
#[derive(Debug, Clone)]
pub struct PathContext {
    /// System text.
    pub instructions: String,
    /// Tools in chat shape.
    pub tools: Vec<Value>,
    /// The session's tool choice (decides which tools the prompt lists).
    pub tool_choice: ToolChoiceSpec,
}

/// A frame the sampler took.
struct Frame {
    /// RGB at the processor's per-frame size.
    image: RgbImage,
    /// Seconds on the session's media clock (streams continue each other).
    time: f64,
    /// When the bytes that completed it arrived.
    arrival: Instant,
    /// Its index among the frames taken in this session.
    index: u64,
}

/// What a chunk is, besides its pixels.
#[derive(Debug, Clone)]
struct ChunkMeta {
    /// Order of formation (commit bookkeeping).
    seq: u64,
    /// Index of its first frame among the frames taken.
    frame_index: u64,
    /// Frames in it (1..=4).
    frames: usize,
    /// Its first frame's time in seconds.
    start: f64,
    /// Its last frame's time in seconds.
    end: f64,
    /// When its last frame arrived (`latency_ms` starts here).
    arrival: Instant,
}

impl ChunkMeta {
    fn of(seq: u64, frames: &[Frame]) -> ChunkMeta {
        let (first, last) = (&frames[0], &frames[frames.len() - 1]);
        ChunkMeta {
            seq,
            frame_index: first.index,
            frames: frames.len(),
            start: first.time,
            end: last.time,
            arrival: last.arrival,
        }
    }
}

/// Frames cut into a chunk, waiting for the tower.
struct RawChunk {
    meta: ChunkMeta,
    frames: Vec<Frame>,
}

/// A chunk whose tokens are in the cache.
#[derive(Debug, Clone)]
struct WindowChunk {
    /// `chunk_index`: chunks added before it in this session.
    index: u64,
    /// Frames and times.
    meta: ChunkMeta,
    /// Its embeddings and prompt (kept, so a re-prefill needs no tower pass).
    chunk: EncodedChunk,
}

/// The stream path as cached: its radix key and where the chunks begin.
#[derive(Debug, Clone)]
struct StreamPath {
    key: Vec<u64>,
    /// Tokens before the first chunk (instructions, tools, the message opening).
    head: usize,
}

/// A prefill being run: the window it makes.
struct PathPlan {
    /// The window once it succeeds (the new chunk last).
    window: Vec<WindowChunk>,
    /// Chunks it leaves out.
    evicted: Vec<WindowChunk>,
    /// Its path.
    path: StreamPath,
    /// Stream-path tokens.
    tokens: usize,
}

/// What `window_evicted` reports.
#[derive(Debug, Clone, Copy)]
struct EvictedSummary {
    chunks: usize,
    first: u64,
    last: u64,
    tokens: usize,
}

/// A job's result, back on the session task.
enum Done {
    /// A decode job returned the stream's source (`None` once it ended or failed).
    Decoded {
        epoch: u64,
        source: Option<Source>,
        frames: Vec<(RgbImage, f64, Instant)>,
        error: Option<MediaError>,
        finished: bool,
    },
    /// The tower encoded a chunk.
    Encoded {
        epoch: u64,
        meta: ChunkMeta,
        result: ApiResult<EncodedChunk>,
    },
    /// A stream path was prefilled.
    Prefilled {
        epoch: u64,
        plan: Box<PathPlan>,
        result: ApiResult<CacheReport>,
    },
    /// A superseded path was released.
    Released {
        evicted: Option<EvictedSummary>,
        pages: usize,
    },
}

/// A job's result, for [`Live::on_done`].
pub struct JobResult(Done);

/// What the session does after a job result besides sending the events.
#[derive(Debug, Default)]
pub struct LiveOutput {
    /// Server events, in order.
    pub events: Vec<Value>,
    /// A cadence question is due.
    pub cadence: bool,
}

/// The live stream of one session; see the module docs.
pub struct Live {
    /// Shared gateway state.
    state: Arc<AppState>,
    /// The session's cache key (`sess_…`).
    session: String,
    /// `session.video`.
    pub settings: VideoSettings,
    /// Bumped by `clear`: results of older jobs are discarded.
    epoch: u64,
    /// The stream's jobs (decode, encode, prefill, path release), aborted and
    /// joined when the session ends so none submits after its `close_session`.
    jobs: JoinSet<()>,
    /// Appends and commits not yet decoded.
    ops: VecDeque<Op>,
    /// Bytes in `ops`.
    ops_bytes: usize,
    /// A stream is open (its first append was taken, no commit or error since).
    open: bool,
    /// The open stream's source, unless a decode job holds it.
    source: Option<Source>,
    /// A decode job runs.
    decoding: bool,
    /// The open stream's zero on the session clock.
    base: f64,
    /// The session clock after the last frame taken (the next stream's zero).
    clock: f64,
    /// Frames of the chunk being built (< 4).
    building: Vec<Frame>,
    /// Chunks waiting for the tower (≤ [`MAX_PENDING_CHUNKS`]).
    pending: VecDeque<RawChunk>,
    /// The chunk in the tower.
    encoding: Option<u64>,
    /// An encoded chunk waiting for the prefill stage.
    encoded: Option<(ChunkMeta, EncodedChunk)>,
    /// The chunk being prefilled.
    prefilling: Option<u64>,
    /// Chunks in context, oldest first.
    window: VecDeque<WindowChunk>,
    /// The cached stream path of `window`.
    path: Option<StreamPath>,
    /// The last path a window move superseded (released again after a response,
    /// whose locks may have kept part of it).
    superseded: Option<(Vec<u64>, usize)>,
    /// Next chunk `seq`, frame index and `chunk_index`.
    next_seq: u64,
    next_frame: u64,
    next_chunk: u64,
    /// `committed` events owed: each is sent once every chunk formed before its commit
    /// (`seq` below the mark) has left the pipeline.
    commits: VecDeque<u64>,
    /// Media time of the next cadence question.
    cadence_next: Option<f64>,
    /// Job results in.
    rx: mpsc::Receiver<JobResult>,
    /// Job results out (cloned into each job).
    tx: mpsc::Sender<JobResult>,
}

/// `a` and `b` agree on their first `n` elements: the largest such `n`.
fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How many of the oldest `starts` leave when a chunk ending at `end` joins a window of
/// `window_seconds` (0: none), each frame lasting `frame`; see the module docs.
fn evictions(starts: &[f64], end: f64, window_seconds: f64, frame: f64) -> usize {
    let span = |i: usize| end + frame - starts.get(i).copied().unwrap_or(end);
    if window_seconds <= 0.0 || span(0) <= window_seconds {
        return 0;
    }
    (0..starts.len())
        .find(|&i| span(i) <= WINDOW_LOW_WATER * window_seconds)
        .unwrap_or(starts.len())
}

/// Whether a cadence tick falls at or before `end` (advancing past it); `next` starts
/// one interval after `start`.
fn cadence_tick(next: &mut Option<f64>, interval: f64, start: f64, end: f64) -> bool {
    let at = next.get_or_insert(start + interval);
    if end + 1e-9 < *at {
        return false;
    }
    while *at <= end + 1e-9 {
        *at += interval;
    }
    true
}

/// A live media error as a client error (the limits name their flag).
fn live_error(e: MediaError) -> ApiError {
    let mut err = media::media_error(PARAM, e);
    if err.code == "video_too_many_bytes" {
        err.code = "video_stream_too_large";
    }
    err
}

fn error_event(e: &ApiError) -> Value {
    event(
        "error",
        json!({"error": {"type": e.kind, "code": e.code, "message": e.message,
                         "param": e.param, "event_id": Value::Null}}),
    )
}

impl Live {
    /// An idle stream for `session`.
    pub fn new(state: Arc<AppState>, session: String) -> Live {
        let (tx, rx) = mpsc::channel(JOB_CHANNEL);
        Live {
            state,
            session,
            settings: VideoSettings::default(),
            epoch: 0,
            jobs: JoinSet::new(),
            ops: VecDeque::new(),
            ops_bytes: 0,
            open: false,
            source: None,
            decoding: false,
            base: 0.0,
            clock: 0.0,
            building: Vec::new(),
            pending: VecDeque::new(),
            encoding: None,
            encoded: None,
            prefilling: None,
            window: VecDeque::new(),
            path: None,
            superseded: None,
            next_seq: 0,
            next_frame: 0,
            next_chunk: 0,
            commits: VecDeque::new(),
            cadence_next: None,
            rx,
            tx,
        }
    }

    /// Runs a job of the stream (finished ones are reaped here, so the set
    /// holds only what still runs).
    fn spawn(&mut self, job: impl std::future::Future<Output = ()> + Send + 'static) {
        while self.jobs.try_join_next().is_some() {}
        self.jobs.spawn(job);
    }

    /// Ends the stream's jobs: aborted, then joined, so that no decode, encode,
    /// prefill or release reaches the engine after this returns.
    pub async fn shutdown(&mut self) {
        self.jobs.abort_all();
        while self.jobs.join_next().await.is_some() {}
    }

    /// Whether a stream is open (then `fps` and `format` are fixed).
    pub fn stream_open(&self) -> bool {
        self.open || !self.ops.is_empty()
    }

    /// Whether the session may read more from its socket (the byte backlog is below
    /// [`MAX_BUFFERED_BYTES`]).
    pub fn accepting(&self) -> bool {
        self.ops_bytes < MAX_BUFFERED_BYTES
    }

    /// Applies new settings (`session.update`); a new cadence interval restarts it.
    pub fn set_settings(&mut self, s: VideoSettings) {
        if s.analysis_interval != self.settings.analysis_interval {
            self.cadence_next = None;
        }
        self.settings = s;
    }

    /// The next job result.
    pub async fn next_done(&mut self) -> JobResult {
        self.rx
            .recv()
            .await
            .expect("the stream holds a sender of its own channel")
    }

    /// The stream's part of a question's prompt: the user message with the window's
    /// chunk prompts and their encoded items (`None` while no chunk is in context).
    pub fn context(&self) -> Option<(Message, Vec<EncodedMedia>)> {
        if self.window.is_empty() {
            return None;
        }
        let prompts = self
            .window
            .iter()
            .map(|c| c.chunk.prompt.as_str())
            .collect();
        let items = self.window.iter().map(|c| c.chunk.item.clone()).collect();
        Some((stream_message(prompts), items))
    }

    /// `input_video_buffer.append`: queues the bytes for the decoder.
    pub fn append(
        &mut self,
        bytes: Vec<u8>,
        timestamp_ms: Option<f64>,
        ctx: &PathContext,
    ) -> Vec<Value> {
        let mut events = Vec::new();
        let Some(cfg) = self.state.media.as_ref().map(|m| m.config()) else {
            return vec![error_event(&ApiError::unsupported(
                PARAM,
                "video: this model takes no video",
            ))];
        };
        if bytes.is_empty() {
            return vec![error_event(&ApiError::invalid(
                "invalid_value",
                Some(PARAM),
                "an append must carry at least one byte",
            ))];
        }
        if self.clock > cfg.video.max_duration {
            return vec![error_event(&live_error(MediaError::VideoTooLong {
                seconds: self.clock,
                limit: cfg.video.max_duration,
            }))];
        }
        self.ops_bytes += bytes.len();
        self.ops.push_back(Op::Append {
            bytes,
            timestamp_ms,
            arrival: Instant::now(),
        });
        self.pump(ctx, &mut events);
        events
    }

    /// `input_video_buffer.commit`: ends the stream after what was appended.
    pub fn commit(&mut self, ctx: &PathContext) -> Vec<Value> {
        let mut events = Vec::new();
        self.ops.push_back(Op::Commit);
        self.pump(ctx, &mut events);
        events
    }

    /// `input_video_buffer.clear`: drops the stream, every queued frame and every chunk
    /// in context (their cached path released); running jobs' results are discarded.
    pub fn clear(&mut self) -> Vec<Value> {
        self.epoch += 1;
        self.ops.clear();
        self.ops_bytes = 0;
        self.close_stream();
        self.building.clear();
        self.pending.clear();
        self.encoded = None;
        self.window.clear();
        self.commits.clear();
        self.cadence_next = None;
        if let Some(p) = self.path.take() {
            self.release(Some(self.session.clone()), p.key, p.head, None);
        }
        self.superseded = None;
        vec![event("input_video_buffer.cleared", json!({}))]
    }

    /// A response ended: release again the last superseded path (a question may have
    /// held part of it when it was released).
    pub fn after_response(&mut self) {
        if let Some((key, from)) = self.superseded.clone() {
            self.release(None, key, from, None);
        }
    }

    /// Applies a job result and starts what can start next.
    pub fn on_done(&mut self, done: JobResult, ctx: &PathContext) -> LiveOutput {
        let mut out = LiveOutput::default();
        match done.0 {
            Done::Decoded {
                epoch,
                source,
                frames,
                error,
                finished,
            } => {
                self.decoding = false;
                if epoch == self.epoch {
                    self.on_decoded(source, frames, error, finished, &mut out.events);
                }
            }
            Done::Encoded {
                epoch,
                meta,
                result,
            } => {
                self.encoding = None;
                if epoch == self.epoch {
                    match result {
                        Ok(chunk) => self.encoded = Some((meta, chunk)),
                        Err(e) => out.events.push(error_event(&e)),
                    }
                }
            }
            Done::Prefilled {
                epoch,
                plan,
                result,
            } => {
                self.prefilling = None;
                if epoch != self.epoch {
                    // Cleared meanwhile: the prefill pinned a path nobody wants.
                    let StreamPath { key, head } = plan.path;
                    self.release(Some(self.session.clone()), key, head, None);
                } else {
                    match result {
                        Ok(report) => {
                            out.cadence = self.on_prefilled(*plan, report, &mut out.events)
                        }
                        Err(e) => out.events.push(error_event(&e)),
                    }
                }
            }
            Done::Released { evicted, pages } => {
                if let Some(e) = evicted {
                    out.events.push(event(
                        "input_video_buffer.window_evicted",
                        json!({"chunks": e.chunks, "first_chunk_index": e.first,
                               "last_chunk_index": e.last, "tokens": e.tokens,
                               "pages_released": pages}),
                    ));
                }
            }
        }
        self.pump(ctx, &mut out.events);
        out
    }

    /// Starts each idle stage that has work, then sends owed `committed` events.
    fn pump(&mut self, ctx: &PathContext, events: &mut Vec<Value>) {
        self.start_decode(events);
        self.start_encode();
        self.start_prefill(ctx, events);
        self.settle_commits(events);
    }

    /// Video decoding options for the open stream.
    fn options(&self) -> Option<VideoOptions> {
        let cfg = self.state.media.as_ref()?.config();
        Some(VideoOptions {
            fps: self.settings.fps,
            output: OutputSize::Processor(cfg.processor.frame_config()),
            limits: VideoLimits {
                max_bytes: cfg.max_video_bytes as u64,
                ..cfg.video
            },
            ..VideoOptions::default()
        })
    }

    /// Opens a stream for the append at the front of `ops`.
    fn open_stream(&mut self, first: &[u8]) -> Result<(), MediaError> {
        let options = self.options().ok_or(MediaError::VideoNoStream)?;
        let sniffed = sniff(first);
        let format = self.settings.format;
        let still = match (format, sniffed) {
            (VideoFormat::Auto, Some(Sniffed::Png | Sniffed::Jpeg)) => true,
            (VideoFormat::Auto, _) => false,
            (f, _) if f.is_still() => true,
            _ => false,
        };
        self.source = Some(if still {
            Source::Still {
                selector: LiveSelector::new(options.fps),
                first_ms: None,
                started: Instant::now(),
                bytes: 0,
            }
        } else {
            Source::Container(Box::new(LiveDecoder::new(format.container(), &options)?))
        });
        self.open = true;
        self.base = self.clock;
        Ok(())
    }

    /// Hands the queued ops of the open stream (through its commit) to a decode job.
    fn start_decode(&mut self, events: &mut Vec<Value>) {
        while !self.decoding {
            match self.ops.front() {
                None => return,
                Some(Op::Commit) if !self.open => {
                    self.ops.pop_front();
                    self.commits.push_back(self.next_seq);
                    continue;
                }
                Some(Op::Append { bytes, .. }) if !self.open => {
                    let first = bytes[..bytes.len().min(512)].to_vec();
                    if let Err(e) = self.open_stream(&first) {
                        if let Some(Op::Append { bytes, .. }) = self.ops.pop_front() {
                            self.ops_bytes -= bytes.len();
                        }
                        events.push(error_event(&live_error(e)));
                        continue;
                    }
                }
                Some(_) => {}
            }
            let Some(source) = self.source.take() else {
                return;
            };
            let mut batch = Vec::new();
            while let Some(op) = self.ops.pop_front() {
                let end = matches!(op, Op::Commit);
                if let Op::Append { bytes, .. } = &op {
                    self.ops_bytes -= bytes.len();
                }
                batch.push(op);
                if end {
                    break;
                }
            }
            let Some(options) = self.options() else {
                return;
            };
            let (epoch, tx, format) = (self.epoch, self.tx.clone(), self.settings.format);
            self.decoding = true;
            self.spawn(async move {
                let job =
                    tokio::task::spawn_blocking(move || decode(source, batch, format, &options));
                let done = match job.await {
                    Ok((source, frames, error, finished)) => Done::Decoded {
                        epoch,
                        source,
                        frames,
                        error,
                        finished,
                    },
                    Err(e) => Done::Decoded {
                        epoch,
                        source: None,
                        frames: Vec::new(),
                        error: Some(MediaError::VideoDecode {
                            reason: format!("the decode job failed: {e}"),
                        }),
                        finished: false,
                    },
                };
                let _ = tx.send(JobResult(done)).await;
            });
        }
    }

    /// Frames of a decode job join the stream.
    fn on_decoded(
        &mut self,
        source: Option<Source>,
        frames: Vec<(RgbImage, f64, Instant)>,
        error: Option<MediaError>,
        finished: bool,
        events: &mut Vec<Value>,
    ) {
        let limit = self
            .state
            .media
            .as_ref()
            .map_or(f64::INFINITY, |m| m.config().video.max_duration);
        let step = 1.0 / self.settings.fps;
        let mut error = error.map(live_error);
        for (image, t, arrival) in frames {
            let time = self.base + t;
            if time > limit {
                error = Some(live_error(MediaError::VideoTooLong {
                    seconds: time,
                    limit,
                }));
                break;
            }
            self.clock = self.clock.max(time + step);
            self.building.push(Frame {
                image,
                time,
                arrival,
                index: self.next_frame,
            });
            self.next_frame += 1;
            if self.building.len() == CHUNK_FRAMES {
                self.form_chunk(events);
            }
        }
        let failed = error.is_some();
        if let Some(e) = error {
            events.push(error_event(&e));
        }
        if failed || finished {
            self.close_stream();
            self.form_chunk(events);
        } else {
            self.source = source;
        }
        if finished {
            self.commits.push_back(self.next_seq);
        }
    }

    /// The open stream ends (its decoder dropped); the next append opens a new one.
    fn close_stream(&mut self) {
        self.open = false;
        self.source = None;
    }

    /// The building frames become a pending chunk; beyond [`MAX_PENDING_CHUNKS`] the
    /// oldest pending chunk is dropped.
    fn form_chunk(&mut self, events: &mut Vec<Value>) {
        if self.building.is_empty() {
            return;
        }
        let frames = std::mem::take(&mut self.building);
        let meta = ChunkMeta::of(self.next_seq, &frames);
        self.next_seq += 1;
        if self.pending.len() >= MAX_PENDING_CHUNKS {
            if let Some(old) = self.pending.pop_front() {
                events.push(event(
                    "input_video_buffer.frames_dropped",
                    json!({"count": old.meta.frames, "first_ms": ms(old.meta.start),
                           "last_ms": ms(old.meta.end), "reason": "backpressure"}),
                ));
            }
        }
        self.pending.push_back(RawChunk { meta, frames });
        // A free tower takes it at once, before later chunks can push it out.
        self.start_encode();
    }

    /// Sends the oldest pending chunk to the tower when it is free.
    fn start_encode(&mut self) {
        if self.encoding.is_some() || self.encoded.is_some() {
            return;
        }
        let Some(raw) = self.pending.pop_front() else {
            return;
        };
        self.encoding = Some(raw.meta.seq);
        let (state, tx, epoch) = (self.state.clone(), self.tx.clone(), self.epoch);
        self.spawn(async move {
            let (images, times) = raw.frames.into_iter().map(|f| (f.image, f.time)).unzip();
            let result = match state.media.as_ref() {
                Some(m) => media::encode_frames(m, images, times, PARAM)
                    .await
                    .and_then(|mut chunks| {
                        chunks.pop().ok_or_else(|| {
                            ApiError::internal("a chunk of frames encoded to nothing")
                        })
                    }),
                None => Err(ApiError::internal("live video without a vision tower")),
            };
            let done = Done::Encoded {
                epoch,
                meta: raw.meta,
                result,
            };
            let _ = tx.send(JobResult(done)).await;
        });
    }

    /// Prefills the stream path with the encoded chunk when the engine stage is free.
    fn start_prefill(&mut self, ctx: &PathContext, events: &mut Vec<Value>) {
        if self.prefilling.is_some() {
            return;
        }
        let Some((meta, chunk)) = self.encoded.take() else {
            return;
        };
        let mut window: Vec<WindowChunk> = self.window.iter().cloned().collect();
        let starts: Vec<f64> = window.iter().map(|c| c.meta.start).collect();
        let gone = evictions(
            &starts,
            meta.end,
            self.settings.window_seconds,
            1.0 / self.settings.fps,
        );
        let evicted: Vec<WindowChunk> = window.drain(..gone.min(window.len())).collect();
        let seq = meta.seq;
        window.push(WindowChunk {
            index: self.next_chunk,
            meta,
            chunk,
        });
        match path_request(&self.state, &self.session, ctx, &window) {
            Ok((valid, head)) => {
                let key = valid.cache_key.clone().unwrap_or_default();
                let plan = Box::new(PathPlan {
                    tokens: key.len(),
                    window,
                    evicted,
                    path: StreamPath { key, head },
                });
                self.prefilling = Some(seq);
                let (state, tx, epoch) = (self.state.clone(), self.tx.clone(), self.epoch);
                self.spawn(async move {
                    let result = prefill(&state, valid).await;
                    let done = Done::Prefilled {
                        epoch,
                        plan,
                        result,
                    };
                    let _ = tx.send(JobResult(done)).await;
                });
            }
            Err(e) => events.push(error_event(&e)),
        }
    }

    /// A chunk's tokens are in the cache: it joins the window, the superseded path is
    /// released; returns whether a cadence question is due.
    fn on_prefilled(
        &mut self,
        plan: PathPlan,
        report: CacheReport,
        events: &mut Vec<Value>,
    ) -> bool {
        let PathPlan {
            window,
            evicted,
            path,
            tokens,
        } = plan;
        let Some(added) = window.last().cloned() else {
            return false;
        };
        self.next_chunk += 1;
        let m = &added.meta;
        events.push(event(
            "input_video_buffer.chunk_added",
            json!({"chunk_index": added.index, "frame_index": m.frame_index, "frames": m.frames,
                   "start_ms": ms(m.start), "end_ms": ms(m.end), "timestamp": format_timestamp(m.start),
                   "tokens": added.chunk.item.num_tokens,
                   "latency_ms": m.arrival.elapsed().as_secs_f64() * 1000.0,
                   "context_tokens": tokens,
                   "prefill_tokens": report.prompt_tokens - report.cached_tokens}),
        ));
        self.window = window.into();
        let old = self.path.replace(path);
        if let (Some(old), Some(new)) = (old, self.path.as_ref()) {
            let from = common_prefix(&old.key, &new.key);
            if from < old.key.len() {
                let summary = evicted
                    .first()
                    .zip(evicted.last())
                    .map(|(f, l)| EvictedSummary {
                        chunks: evicted.len(),
                        first: f.index,
                        last: l.index,
                        tokens: evicted.iter().map(|c| c.chunk.item.num_tokens).sum(),
                    });
                self.superseded = Some((old.key.clone(), from));
                self.release(None, old.key, from, summary);
            }
        }
        match self.settings.analysis_interval {
            Some(interval) => cadence_tick(&mut self.cadence_next, interval, m.start, m.end),
            None => false,
        }
    }

    /// Releases the cached path `key` from token `from` on (a job; `window_evicted`
    /// follows when `evicted` is given).
    fn release(
        &mut self,
        session: Option<String>,
        key: Vec<u64>,
        from: usize,
        evicted: Option<EvictedSummary>,
    ) {
        let (state, tx) = (self.state.clone(), self.tx.clone());
        self.spawn(async move {
            let pages = state.engine.drop_path(session.as_deref(), key, from).await;
            if evicted.is_some() {
                let _ = tx.send(JobResult(Done::Released { evicted, pages })).await;
            }
        });
    }

    /// Sends each `committed` whose chunks have all left the pipeline.
    fn settle_commits(&mut self, events: &mut Vec<Value>) {
        let oldest = self
            .pending
            .iter()
            .map(|c| c.meta.seq)
            .chain(self.encoding)
            .chain(self.encoded.as_ref().map(|(m, _)| m.seq))
            .chain(self.prefilling)
            .min();
        while let Some(&mark) = self.commits.front() {
            if oldest.is_some_and(|o| o < mark) {
                break;
            }
            self.commits.pop_front();
            events.push(event("input_video_buffer.committed", json!({})));
        }
    }
}

/// Seconds as whole milliseconds.
fn ms(seconds: f64) -> u64 {
    (seconds * 1000.0).round().max(0.0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_evicts_down_to_the_low_water_mark() {
        // Chunks of 2 s (4 frames at 2 fps) starting every 2 s; window 10 s.
        let starts: Vec<f64> = (0..5).map(|i| f64::from(i) * 2.0).collect();
        // A chunk at 8..9.5 joins: span 0..10 = 10 s, nothing leaves.
        assert_eq!(evictions(&starts[..4], 9.5, 10.0, 0.5), 0);
        // At 10..11.5 the span is 12 s > 10: evict until ≤ 7.5 s → starts 6, 8, 10 stay.
        assert_eq!(evictions(&starts, 11.5, 10.0, 0.5), 3);
        assert_eq!(evictions(&starts, 11.5, 0.0, 0.5), 0, "0 = no window");
        // A chunk longer than the low-water mark alone evicts every older one.
        assert_eq!(evictions(&starts, 30.0, 10.0, 0.5), 5);
    }

    #[test]
    fn cadence_ticks_once_per_interval_of_media_time() {
        let mut next = None;
        let ticks: Vec<bool> = (0..8)
            .map(|i| {
                let start = f64::from(i) * 2.0;
                cadence_tick(&mut next, 5.0, 0.0, start + 1.5)
            })
            .collect();
        // Chunk ends 1.5, 3.5, 5.5, 7.5, 9.5, 11.5, 13.5, 15.5; ticks at 5, 10, 15.
        assert_eq!(ticks, [false, false, true, false, false, true, false, true]);
        // A jump over several ticks fires once and moves past them.
        let mut next = Some(5.0);
        assert!(cadence_tick(&mut next, 5.0, 0.0, 23.0));
        assert_eq!(next, Some(25.0));
    }

    #[test]
    fn superseded_paths_diverge_after_the_shared_head() {
        assert_eq!(common_prefix(&[1, 2, 3, 4], &[1, 2, 9]), 2);
        assert_eq!(
            common_prefix(&[1, 2], &[1, 2, 3]),
            2,
            "a prefix is not superseded"
        );
    }
}
