//! Live video on the Realtime socket over real sockets against the real server
//! on the built-in default model (the synthesized Kimi K3 whose MoonViT3d tower
//! runs), with clips and stills made by the `ffmpeg` CLI: chunks taken at the
//! session's fps by presentation time and cut by 4, prefilled as they complete
//! (`chunk_added`), token counts and chunk hashes equal to the file-video path
//! for the same frames, questions served from the cache, cadence questions with
//! their metadata, the window evicting with its pages released, backpressure
//! dropping frames, and bad bytes answered with an error while the session
//! goes on.
//!
//! Expected counts are computed here from first principles: a 160×120 frame
//! fits the K3 frame budget (no resize), pads to 168×140, i.e. a 10×12 patch
//! grid and 30 tokens per chunk; frames are taken at `k / fps` of media time.
//!
//! The long run (`LIVE_MINUTES=30 cargo test --release --test gateway_live --
//! --ignored live_long`) streams generated video faster than real time for that
//! many media minutes with a window and a cadence, and prints per media minute the
//! server's RSS, `caracal_kv_pages_used`, an on-demand question's TTFT, the cadence
//! questions' cached fraction and the chunk latency p50/p99 (`live_long.csv`, or
//! `LIVE_CSV`); `LIVE_WINDOW_SECONDS` (default 60) sets the window and
//! `LIVE_MM_CACHE_BYTES` the server's `--mm-cache-bytes`.

mod common;
mod gateway_support;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use caracal::gateway::media::processor_for;
use caracal::gateway::GatewayConfig;
use futures::SinkExt;
use gateway_support::*;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

const MODEL: &str = "/v1/realtime?model=kimi-k3-tiny";

/// Runs the `ffmpeg` CLI (installed by `.ci/run`) with `args`.
fn ffmpeg(args: &[&str]) {
    let status = Command::new("ffmpeg")
        .args(["-y", "-loglevel", "error"])
        .args(args)
        .status()
        .expect("the ffmpeg CLI runs");
    assert!(status.success(), "ffmpeg {args:?}");
}

/// A `testsrc` clip of `seconds` at `rate` fps and `size`, in `format` (`mpegts`,
/// `webm`, `h264`).
fn clip(dir: &Path, name: &str, seconds: u32, rate: u32, size: &str, format: &str) -> Vec<u8> {
    let out = dir.join(name);
    let src = format!("testsrc=duration={seconds}:size={size}:rate={rate}");
    let codec: &[&str] = match format {
        "webm" => &["-c:v", "libvpx", "-b:v", "200k", "-g", "10"],
        _ => &[
            "-c:v", "libx264", "-pix_fmt", "yuv420p", "-bf", "0", "-g", "10",
        ],
    };
    let mut args = vec!["-f", "lavfi", "-i", &src];
    args.extend_from_slice(codec);
    args.extend_from_slice(&["-f", format]);
    let path = out.to_string_lossy().into_owned();
    args.push(&path);
    ffmpeg(&args);
    std::fs::read(&out).expect("the clip was written")
}

/// `count` JPEG stills of `testsrc` at `size`, one per half second of its time.
fn stills(dir: &Path, tag: &str, count: u32, size: &str) -> Vec<Vec<u8>> {
    let pattern = dir.join(format!("{tag}_%04d.jpg"));
    let src = format!("testsrc=size={size}:rate=2");
    let n = count.to_string();
    let path = pattern.to_string_lossy().into_owned();
    ffmpeg(&[
        "-f",
        "lavfi",
        "-i",
        &src,
        "-frames:v",
        &n,
        "-q:v",
        "4",
        &path,
    ]);
    (1..=count)
        .map(|i| std::fs::read(dir.join(format!("{tag}_{i:04}.jpg"))).expect("a still"))
        .collect()
}

/// Tokens of one chunk of `w`×`h` frames under the K3 frame budget.
fn chunk_tokens(w: u32, h: u32) -> usize {
    let cfg = processor_for("kimi_k3");
    let plan = caracal_media::plan_resize(w, h, &cfg.frame_config()).unwrap();
    let merge = cfg.merge_kernel_size as usize;
    plan.grid_h * plan.grid_w / (merge * merge)
}

/// A Realtime client with the events it has seen.
struct Session {
    ws: WsClient,
    /// Every event so far, in order.
    seen: Vec<Value>,
}

impl Session {
    async fn open(server: &TestServer, video: Value) -> Session {
        let mut ws = WsClient::connect(server.addr, MODEL).await;
        let created = ws.next().await.unwrap();
        assert_eq!(created["type"], "session.created");
        assert_eq!(created["session"]["video"]["fps"], 2.0, "{created}");
        assert_eq!(ws.next().await.unwrap()["type"], "conversation.created");
        let mut s = Session {
            ws,
            seen: Vec::new(),
        };
        s.send(json!({"type": "session.update", "session": {"video": video}}))
            .await;
        let updated = s.until("session.updated").await;
        assert!(
            updated["session"]["video"]["window_seconds"].is_number(),
            "{updated}"
        );
        s
    }

    async fn send(&mut self, v: Value) {
        self.ws.send(&v).await;
    }

    /// A still (base64, with its time) or raw bytes (binary message).
    async fn append(&mut self, bytes: &[u8], timestamp_ms: Option<u64>) {
        use base64::Engine as _;
        let video = base64::engine::general_purpose::STANDARD.encode(bytes);
        let mut ev = json!({"type": "input_video_buffer.append", "video": video});
        if let Some(t) = timestamp_ms {
            ev["timestamp_ms"] = json!(t);
        }
        self.send(ev).await;
    }

    async fn binary(&mut self, bytes: &[u8]) {
        self.ws
            .ws
            .send(Message::binary(bytes.to_vec()))
            .await
            .expect("send");
    }

    /// Events until one of `kind` (returned; every event is kept in `seen`).
    async fn until(&mut self, kind: &str) -> Value {
        loop {
            let ev = self.ws.next().await.expect("an event");
            // Shown when a test fails.
            eprintln!("{:?} {}", Instant::now(), short(&ev));
            self.seen.push(ev.clone());
            if ev["type"] == kind {
                return ev;
            }
        }
    }

    /// The events of `kind` seen so far.
    fn of(&self, kind: &str) -> Vec<Value> {
        self.seen
            .iter()
            .filter(|e| e["type"] == kind)
            .cloned()
            .collect()
    }

    /// Asks a question; returns `(cache_report, response.done)`.
    async fn ask(&mut self, text: &str) -> (Value, Value) {
        self.send(
            json!({"type": "conversation.item.create", "item": {"type": "message",
            "role": "user", "content": [{"type": "input_text", "text": text}]}}),
        )
        .await;
        self.until("conversation.item.done").await;
        self.send(json!({"type": "response.create", "response": {"max_output_tokens": 2}}))
            .await;
        let report = self.until("caracal.cache_report").await;
        let done = self.until("response.done").await;
        (report, done)
    }
}

/// An event in one line, without its bulky fields.
fn short(ev: &Value) -> String {
    let mut v = ev.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("event_id");
        o.remove("session");
        if let Some(r) = o.get_mut("response").and_then(Value::as_object_mut) {
            r.remove("output");
        }
    }
    let text = v.to_string();
    text.chars().take(300).collect()
}

fn cached_fraction(report: &Value) -> f64 {
    report["cached_tokens"].as_f64().unwrap() / report["prompt_tokens"].as_f64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mpegts_stream_is_chunked_like_the_file_path_and_answers_over_it() {
    let dir = tempdir("caracal-live-ts");
    // 3 s at 10 fps, sampled at 2 fps: frames at 0, 0.5, …, 2.5 → chunks of 4 and 2.
    let ts = clip(&dir, "a.ts", 3, 10, "160x120", "mpegts");
    let server = start_default(GatewayConfig::default()).await;
    let mut s = Session::open(&server, json!({"fps": 2, "format": "mpegts"})).await;
    // Half as binary messages, half as base64 appends, in uneven cuts.
    let half = ts.len() / 2;
    for piece in ts[..half].chunks(3001) {
        s.binary(piece).await;
    }
    for piece in ts[half..].chunks(4096) {
        s.append(piece, None).await;
    }
    // fps cannot change while the stream is open.
    s.send(json!({"type": "session.update", "session": {"video": {"fps": 4}}}))
        .await;
    let refused = s.until("error").await;
    assert_eq!(refused["error"]["code"], "video_stream_active", "{refused}");
    s.send(json!({"type": "input_video_buffer.commit"})).await;
    s.until("input_video_buffer.committed").await;
    let chunks = s.of("input_video_buffer.chunk_added");
    let per_chunk = chunk_tokens(160, 120);
    assert_eq!(per_chunk, 30);
    let shape: Vec<_> = chunks
        .iter()
        .map(|c| {
            (
                c["chunk_index"].as_u64().unwrap(),
                c["frame_index"].as_u64().unwrap(),
                c["frames"].as_u64().unwrap(),
                c["start_ms"].as_u64().unwrap(),
                c["end_ms"].as_u64().unwrap(),
                c["timestamp"].as_str().unwrap().to_string(),
                c["tokens"].as_u64().unwrap() as usize,
            )
        })
        .collect();
    assert_eq!(
        shape,
        [
            (0, 0, 4, 0, 1500, "00:00:00.000".into(), per_chunk),
            (1, 4, 2, 2000, 2500, "00:00:02.000".into(), per_chunk),
        ],
        "frames taken = 3 s × 2 fps, chunked by 4, timestamps increasing"
    );
    assert!(chunks
        .iter()
        .all(|c| c["latency_ms"].as_f64().unwrap() >= 0.0));
    assert!(s.of("input_video_buffer.frames_dropped").is_empty());

    // The file path takes the same frames: its chunks are encoder cache hits.
    let encoded = metric(&server, "caracal_vision_items_encoded_total").await;
    let body = json!({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": data_url("video/mp2t", &ts), "fps": 2}},
        {"type": "text", "text": "What happens?"}]}], "max_tokens": 1, "reasoning_effort": "none"});
    let (status, answer) = json(server.addr, "POST", "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["image_tokens"],
        2 * per_chunk,
        "{answer}"
    );
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        encoded,
        "the live chunks are the file path's chunks (same frames, same hashes)"
    );

    // A question over the stream: the chunks are in its prompt and in the cache.
    let (report, done) = s.ask("What happens in the video?").await;
    let usage = &done["response"]["usage"];
    assert_eq!(
        usage["input_token_details"]["image_tokens"],
        2 * per_chunk,
        "{done}"
    );
    let media = report["media"].as_array().unwrap();
    assert_eq!(media.len(), 2);
    assert_eq!(media[0]["cached"], true, "{report}");
    // Whole pages (16 tokens) of the stream path are cached: only its tail page and
    // the question are prefilled.
    let path = chunks[1]["context_tokens"].as_u64().unwrap();
    assert_eq!(
        report["cached_tokens"].as_u64().unwrap(),
        path / 16 * 16,
        "{report}"
    );

    // clear: the context is empty again; a new stream's times continue.
    s.send(json!({"type": "input_video_buffer.clear"})).await;
    s.until("input_video_buffer.cleared").await;
    let (_, done) = s.ask("And now?").await;
    assert_eq!(
        done["response"]["usage"]["input_token_details"]["image_tokens"],
        0
    );
    for piece in ts.chunks(8192) {
        s.binary(piece).await;
    }
    s.send(json!({"type": "input_video_buffer.commit"})).await;
    s.until("input_video_buffer.committed").await;
    let chunks = s.of("input_video_buffer.chunk_added");
    assert_eq!(chunks.len(), 4);
    assert_eq!(chunks[2]["chunk_index"], 2);
    assert!(
        chunks[2]["start_ms"].as_u64().unwrap() >= 3000,
        "the second stream starts after the first: {}",
        chunks[2]
    );
    drop(s);
    server.wait_engine_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn questions_and_cadence_over_a_prefilled_stream_come_from_the_cache() {
    let dir = tempdir("caracal-live-cadence");
    // 320×240 stills: 108 tokens a chunk; 36 chunks make a prompt of ~4,400 tokens,
    // so a question's own tokens (and the stream path's last, partial page) are
    // under 1% of it.
    let frames = stills(&dir, "q", 144, "320x240");
    let per_chunk = chunk_tokens(320, 240);
    assert_eq!(per_chunk, 108);
    let server = start_default(GatewayConfig::default()).await;
    let mut s = Session::open(
        &server,
        json!({"fps": 2, "format": "jpeg", "window_seconds": 0, "analysis_interval": 35,
               "analysis_prompt": "What changed?", "analysis_max_output_tokens": 2}),
    )
    .await;
    for (i, f) in frames.iter().enumerate() {
        s.append(f, Some(500 * i as u64)).await;
        if i % 4 == 3 {
            s.until("input_video_buffer.chunk_added").await;
        }
    }
    let chunks = s.of("input_video_buffer.chunk_added");
    assert_eq!(chunks.len(), 36);
    assert!(chunks.iter().all(|c| c["tokens"] == per_chunk));
    let starts: Vec<u64> = chunks
        .iter()
        .map(|c| c["start_ms"].as_u64().unwrap())
        .collect();
    assert_eq!(starts, (0..36).map(|i| 2000 * i).collect::<Vec<_>>());
    // Cadence every 35 media seconds: chunks end at 1.5 + 2k s, so ticks fire at the
    // chunks ending 35.5 s and 71.5 s (the last).
    let cadence = |s: &Session| {
        s.of("response.done")
            .into_iter()
            .filter(|d| d["response"]["metadata"]["caracal_analysis"] == "cadence")
            .count()
    };
    while cadence(&s) < 2 {
        s.until("response.done").await;
    }
    assert!(s
        .of("response.created")
        .iter()
        .all(|r| r["response"]["metadata"]["caracal_analysis"] == "cadence"));
    let reports = s.of("caracal.cache_report");
    let last = reports.last().unwrap();
    assert!(
        cached_fraction(last) >= 0.99,
        "a cadence question prefills only its own tokens: {last}"
    );
    // On demand: the stream path is a cache hit, and no cadence answer is in the prompt.
    let (report, _) = s.ask("What is on the screen?").await;
    assert!(cached_fraction(&report) >= 0.99, "{report}");
    assert_eq!(report["media"].as_array().unwrap().len(), 36);
    let path = chunks[35]["context_tokens"].as_u64().unwrap();
    let own = report["prompt_tokens"].as_u64().unwrap() - path;
    assert!(
        own < 40,
        "the question adds only its own message: {own} tokens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_window_evicts_old_chunks_and_releases_their_pages() {
    let dir = tempdir("caracal-live-window");
    let frames = stills(&dir, "w", 48, "160x120");
    let server = start_default(GatewayConfig::default()).await;
    // A 6 s window: chunks of 2 s; past 6 s the oldest leave down to 4.5 s.
    let mut s = Session::open(
        &server,
        json!({"fps": 2, "format": "jpeg", "window_seconds": 6}),
    )
    .await;
    let mut pages = Vec::new();
    for (i, f) in frames.iter().enumerate() {
        s.append(f, Some(500 * i as u64)).await;
        if i % 4 == 3 {
            s.until("input_video_buffer.chunk_added").await;
            if i >= 16 {
                pages.push(metric(&server, "caracal_kv_pages_used").await);
            }
        }
    }
    let evictions = s.of("input_video_buffer.window_evicted");
    while s.of("input_video_buffer.window_evicted").len() < evictions.len().max(1) {
        s.until("input_video_buffer.window_evicted").await;
    }
    let evictions = s.of("input_video_buffer.window_evicted");
    assert!(evictions.len() >= 4, "{evictions:?}");
    let first = &evictions[0];
    assert_eq!(first["chunks"], 2, "{first}");
    assert_eq!(first["first_chunk_index"], 0);
    assert_eq!(first["last_chunk_index"], 1);
    assert_eq!(first["tokens"], 60);
    assert!(
        evictions
            .iter()
            .all(|e| e["pages_released"].as_u64().unwrap() > 0),
        "{evictions:?}"
    );
    let chunks = s.of("input_video_buffer.chunk_added");
    assert_eq!(chunks.len(), 12);
    let context: Vec<u64> = chunks
        .iter()
        .map(|c| c["context_tokens"].as_u64().unwrap())
        .collect();
    let (lo, hi) = (
        *context[6..].iter().min().unwrap(),
        *context[6..].iter().max().unwrap(),
    );
    assert!(
        hi < 2 * lo,
        "the stream path stays within the window: {context:?}"
    );
    let (min, max) = (*pages.iter().min().unwrap(), *pages.iter().max().unwrap());
    assert!(
        max <= min + 8,
        "caracal_kv_pages_used stays bounded while the stream goes on: {pages:?}"
    );
    let (report, _) = s.ask("What is there?").await;
    assert!(report["media"].as_array().unwrap().len() <= 3, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_drop_frames_and_bad_bytes_get_errors_while_the_session_goes_on() {
    let dir = tempdir("caracal-live-bad");
    let frames = stills(&dir, "b", 40, "160x120");
    let webm = clip(&dir, "a.webm", 2, 10, "160x120", "webm");
    let server = start_default(GatewayConfig::default()).await;
    let mut s = Session::open(&server, json!({"fps": 2, "window_seconds": 0})).await;
    // 20 s of stills at once: faster than the tower and the prefill.
    for (i, f) in frames.iter().enumerate() {
        s.append(f, Some(500 * i as u64)).await;
    }
    s.send(json!({"type": "input_video_buffer.commit"})).await;
    s.until("input_video_buffer.committed").await;
    let dropped = s.of("input_video_buffer.frames_dropped");
    assert!(
        !dropped.is_empty(),
        "a burst faster than encoding drops frames"
    );
    assert!(dropped.iter().all(|d| d["reason"] == "backpressure"));
    let lost: u64 = dropped.iter().map(|d| d["count"].as_u64().unwrap()).sum();
    let added: u64 = s
        .of("input_video_buffer.chunk_added")
        .iter()
        .map(|c| c["frames"].as_u64().unwrap())
        .sum();
    assert_eq!(
        added + lost,
        40,
        "every frame taken is added or reported dropped"
    );

    // A PNG where the format says JPEG.
    s.send(json!({"type": "session.update", "session": {"video": {"format": "jpeg"}}}))
        .await;
    s.until("session.updated").await;
    let png = {
        let path = dir.join("one.png").to_string_lossy().into_owned();
        ffmpeg(&[
            "-f",
            "lavfi",
            "-i",
            "testsrc=size=160x120",
            "-frames:v",
            "1",
            &path,
        ]);
        std::fs::read(&path).unwrap()
    };
    s.append(&png, Some(0)).await;
    let e = s.until("error").await;
    assert_eq!(e["error"]["code"], "video_format_mismatch", "{e}");
    // Bytes that are no video at all: the demuxer waits for more until the commit.
    s.send(json!({"type": "session.update", "session": {"video": {"format": "webm"}}}))
        .await;
    s.until("session.updated").await;
    s.append(b"definitely not a video", None).await;
    s.send(json!({"type": "input_video_buffer.commit"})).await;
    let e = s.until("error").await;
    assert!(
        e["error"]["code"].as_str().unwrap().starts_with("video_"),
        "{e}"
    );
    s.until("input_video_buffer.committed").await;

    // A WebM whose second VP8 keyframe (1 s in) claims 16383×16383 pixels: hostile
    // bytes mid-stream get an error (before any frame buffer is allocated), the
    // frames before them stay, the session goes on.
    let mut bad = webm.clone();
    let keyframes: Vec<usize> = bad
        .windows(3)
        .enumerate()
        .filter(|(_, w)| *w == [0x9D, 0x01, 0x2A])
        .map(|(i, _)| i)
        .collect();
    assert!(keyframes.len() >= 2, "a keyframe every second");
    bad[keyframes[1] + 3..keyframes[1] + 7].copy_from_slice(&[0xFF, 0x3F, 0xFF, 0x3F]);
    for piece in bad.chunks(2048) {
        s.binary(piece).await;
    }
    s.send(json!({"type": "input_video_buffer.commit"})).await;
    let e = s.until("error").await;
    assert_eq!(e["error"]["code"], "video_frame_too_large", "{e}");
    s.until("input_video_buffer.committed").await;
    // A good WebM stream on the same session, and a question.
    s.send(json!({"type": "session.update", "session": {"video": {"format": "auto"}}}))
        .await;
    s.until("session.updated").await;
    s.send(json!({"type": "input_video_buffer.clear"})).await;
    s.until("input_video_buffer.cleared").await;
    let before = s.of("input_video_buffer.chunk_added").len();
    for piece in webm.chunks(2048) {
        s.binary(piece).await;
    }
    s.send(json!({"type": "input_video_buffer.commit"})).await;
    s.until("input_video_buffer.committed").await;
    assert_eq!(
        s.of("input_video_buffer.chunk_added").len() - before,
        1,
        "2 s → 4 frames"
    );
    let (_, done) = s.ask("Still there?").await;
    assert_eq!(done["response"]["status"], "incomplete", "{done}");
    drop(s);
    server.wait_engine_idle().await;
}

/// One `key value` line of a server's `/metrics`.
async fn serve_metric(addr: std::net::SocketAddr, name: &str) -> u64 {
    let (_, body) = raw_json(addr, "GET", "/metrics", &[], None).await;
    body.as_str()
        .unwrap_or("")
        .lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

/// The `p` quantile of `v` (sorted here), 0 when empty.
fn quantile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n => v[((n - 1) as f64 * p).round() as usize],
    }
}

/// The long run (see the module docs): `LIVE_MINUTES` media minutes (default 30) of
/// MPEG-TS sent in 2-second segments, each sent once the server has added the chunks
/// of all but the last two (as fast as it ingests, no faster), a 60 s window and a
/// cadence every 10 s; at each media minute an on-demand question.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a long run: LIVE_MINUTES=30 cargo test --release --test gateway_live -- --ignored live_long"]
async fn live_long() {
    let minutes: u64 = std::env::var("LIVE_MINUTES")
        .ok()
        .and_then(|m| m.parse().ok())
        .unwrap_or(30);
    let dir = tempdir("caracal-live-long");
    let src = format!("testsrc=duration={}:size=320x240:rate=10", minutes * 60);
    let pattern = dir.join("seg_%05d.ts").to_string_lossy().into_owned();
    ffmpeg(&[
        "-f",
        "lavfi",
        "-i",
        &src,
        "-c:v",
        "libx264",
        "-preset",
        "ultrafast",
        "-pix_fmt",
        "yuv420p",
        "-bf",
        "0",
        "-g",
        "20",
        "-f",
        "segment",
        "-segment_time",
        "2",
        "-segment_format",
        "mpegts",
        &pattern,
    ]);
    let mut segments = Vec::new();
    while let Ok(b) = std::fs::read(dir.join(format!("seg_{:05}.ts", segments.len()))) {
        segments.push(b);
    }
    assert!(
        segments.len() as u64 >= minutes * 30 - 1,
        "{} segments",
        segments.len()
    );
    // The encoder's embedding LRU (`--mm-cache-bytes`, default 512 MiB) keeps every
    // chunk a stream encodes until it is full; `LIVE_MM_CACHE_BYTES` bounds it lower so
    // the run shows where the server's RSS levels off.
    let cache = std::env::var("LIVE_MM_CACHE_BYTES").unwrap_or_else(|_| (512u64 << 20).to_string());
    // `LIVE_WINDOW_SECONDS` (default 60): the media seconds the window keeps.
    let window: f64 = std::env::var("LIVE_WINDOW_SECONDS")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(60.0);
    let server = common::serve::ServeProcess::start(
        &[
            "--served-model-name",
            "kimi-k3-tiny",
            "--mm-cache-bytes",
            &cache,
        ],
        600,
    );
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", server.port).parse().unwrap();
    let mut ws = WsClient::connect(addr, MODEL).await;
    assert_eq!(ws.next().await.unwrap()["type"], "session.created");
    let mut s = Session {
        ws,
        seen: Vec::new(),
    };
    s.until("conversation.created").await;
    s.send(
        json!({"type": "session.update", "session": {"video": {"fps": 2, "format": "mpegts",
        "window_seconds": window, "analysis_interval": 10, "analysis_max_output_tokens": 4}}}),
    )
    .await;
    s.until("session.updated").await;
    let header = "minute,rss_kib,rss_anon_kib,rss_file_kib,kv_pages_used,question_ttft_ms,question_cached,cadence_cached_min,chunk_p50_ms,chunk_p99_ms,chunks,frames_dropped,evictions,prefill_tokens_per_media_s,kda_snapshots,vision_cache_bytes";
    println!("{header}");
    let mut rows = Vec::new();
    let (mut sent, mut added_ms, mut mark) = (0usize, 0u64, 0usize);
    let mut minute = 1;
    while minute <= minutes {
        // Keep two segments in flight.
        while sent < segments.len() && (sent as u64) * 2000 <= added_ms + 4000 {
            s.binary(&segments[sent]).await;
            sent += 1;
        }
        let ev = s.ws.next().await.expect("an event");
        s.seen.push(ev.clone());
        if ev["type"] == "error" {
            panic!("{ev}");
        }
        if ev["type"] != "input_video_buffer.chunk_added" {
            continue;
        }
        added_ms = ev["end_ms"].as_u64().unwrap();
        if added_ms < minute * 60_000 - 500 {
            continue;
        }
        // A media minute is in: ask, once no cadence answer runs.
        let t0 = Instant::now();
        let (ttft, report) = loop {
            s.send(
                json!({"type": "response.create", "response": {"max_output_tokens": 1,
                "conversation": "none", "input": [{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "What is on the screen now?"}]}]}}),
            )
            .await;
            let first = loop {
                let ev = s.ws.next().await.expect("an event");
                s.seen.push(ev.clone());
                let t = ev["type"].as_str().unwrap_or("").to_string();
                if t == "error" || t == "response.created" && ev["response"]["metadata"].is_null() {
                    break ev;
                }
            };
            if first["type"] == "error" {
                s.until("response.done").await;
                continue;
            }
            // One output token: the time to its end is the time to the first token
            // (the prefill of the question and one step).
            let report = s.until("caracal.cache_report").await;
            let ttft = t0.elapsed();
            s.until("response.done").await;
            break (ttft, report);
        };
        let new = &s.seen[mark..];
        mark = s.seen.len();
        let chunks: Vec<&Value> = new
            .iter()
            .filter(|e| e["type"] == "input_video_buffer.chunk_added")
            .collect();
        let mut lat: Vec<f64> = chunks
            .iter()
            .map(|e| e["latency_ms"].as_f64().unwrap())
            .collect();
        let prefill: u64 = chunks
            .iter()
            .map(|e| e["prefill_tokens"].as_u64().unwrap())
            .sum();
        let cadence = new
            .windows(1)
            .filter(|w| w[0]["type"] == "caracal.cache_report")
            .map(|w| cached_fraction(&w[0]))
            .fold(f64::INFINITY, f64::min);
        let dropped: u64 = new
            .iter()
            .filter(|e| e["type"] == "input_video_buffer.frames_dropped")
            .map(|e| e["count"].as_u64().unwrap())
            .sum();
        let row = format!(
            "{minute},{},{},{},{},{:.1},{:.4},{:.4},{:.1},{:.1},{},{dropped},{},{:.1},{},{}",
            server.status_kib("VmRSS"),
            server.status_kib("RssAnon"),
            server.status_kib("RssFile"),
            serve_metric(addr, "caracal_kv_pages_used").await,
            ttft.as_secs_f64() * 1000.0,
            cached_fraction(&report),
            cadence,
            quantile(&mut lat, 0.5),
            quantile(&mut lat, 0.99),
            chunks.len(),
            new.iter()
                .filter(|e| e["type"] == "input_video_buffer.window_evicted")
                .count(),
            prefill as f64 / 60.0,
            serve_metric(addr, "caracal_kda_snapshots").await,
            serve_metric(addr, "caracal_vision_cache_bytes").await,
        );
        println!("{row}");
        rows.push(row);
        minute += 1;
    }
    let csv = std::env::var("LIVE_CSV").unwrap_or_else(|_| "live_long.csv".into());
    std::fs::write(&csv, format!("{header}\n{}\n", rows.join("\n"))).expect("the CSV is written");
    println!("wrote {csv}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_sends_the_api_key_as_a_subprotocol() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let config = GatewayConfig {
        api_key: Some("sekrit".into()),
        ..GatewayConfig::default()
    };
    let server = start_default(config).await;
    let url = format!("ws://{}{MODEL}", server.addr);
    let connect = |protocols: &'static str| {
        let mut req = url.as_str().into_client_request().unwrap();
        req.headers_mut()
            .insert("sec-websocket-protocol", protocols.parse().unwrap());
        tokio_tungstenite::connect_async(req)
    };
    let (mut ws, resp) = connect("realtime, openai-insecure-api-key.sekrit")
        .await
        .expect("the key in the subprotocol is accepted");
    assert_eq!(resp.headers()["sec-websocket-protocol"], "realtime");
    let mut c = WsClient { ws };
    assert_eq!(c.next().await.unwrap()["type"], "session.created");
    ws = c.ws;
    let _ = ws.close(None).await;
    let refused = connect("realtime, openai-insecure-api-key.wrong").await;
    assert!(
        matches!(&refused, Err(tokio_tungstenite::tungstenite::Error::Http(r)) if r.status() == 401),
        "{refused:?}"
    );
}
