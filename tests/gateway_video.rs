//! Videos through the gateway over real sockets on the built-in default
//! model (the synthesized Kimi K3, whose MoonViT3d tower runs), with clips
//! made by the `ffmpeg` CLI: Chat Completions `video_url`, Responses and
//! Realtime `input_video` parts are sampled at their fps, cut into chunks of
//! up to 4 frames, encoded once per chunk and rendered as one timestamped
//! wrapper per chunk; the same video again encodes nothing and its spans
//! come from the prefix cache; bad and over-limit videos get a 400 with the
//! media error's kind and the server keeps serving. `caracal generate
//! --video` is run as a binary.
//!
//! Expected token counts are computed here from first principles:
//! transformers' sampler takes `int(N / src_fps · fps)` frames at indices
//! `floor(k · N / n)`, chunks are `ceil(frames / 4)`, each chunk costs one
//! frame's tokens (`plan_resize` of the frame under the K3 frame budget,
//! `gh·gw / 4`) plus its wrapper (the tokenized `chunk_prompt` minus its
//! `<|media_pad|>`).

mod common;
mod gateway_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use caracal::gateway::media::{processor_for, MediaConfig};
use caracal::gateway::GatewayConfig;
use caracal::text::tokenizer::TextTokenizer;
use caracal_actors::runtime::EngineConfig;
use gateway_support::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};

/// Source frames per second and seconds of the test clip.
const SRC_FPS: u32 = 25;
const SECONDS: u32 = 3;
/// Clip size: 128×96 fits the frame budget, so no resize; padded to 140×112.
const SIZE: (u32, u32) = (128, 96);

/// An H.264 MP4 of `testsrc` (or `source`) made by the `ffmpeg` CLI.
fn clip(dir: &Path, name: &str, source: &str) -> PathBuf {
    let spec = format!(
        "{source}=duration={SECONDS}:size={}x{}:rate={SRC_FPS}",
        SIZE.0, SIZE.1
    );
    lavfi_clip(dir, name, &spec, &[])
}

/// An H.264 MP4 of the lavfi source `spec` (`testsrc=duration=…`), with
/// `extra` encoder options, made by the `ffmpeg` CLI.
fn lavfi_clip(dir: &Path, name: &str, spec: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let status = Command::new("ffmpeg")
        .args(["-y", "-loglevel", "error", "-f", "lavfi", "-i", spec])
        .args(["-c:v", "libx264", "-pix_fmt", "yuv420p"])
        .args(extra)
        .arg(&out)
        .status()
        .expect("the ffmpeg CLI runs (installed by .ci/run)");
    assert!(status.success(), "ffmpeg made {name}");
    out
}

/// A video part's URL and optional fps.
type VideoPart = (String, Option<f64>);

/// A Chat Completions body: `videos` then the text.
fn chat_with(videos: &[VideoPart], text: &str) -> Value {
    let mut content: Vec<Value> = videos
        .iter()
        .map(|(u, fps)| match fps {
            Some(f) => json!({"type": "video_url", "video_url": {"url": u, "fps": f}}),
            None => json!({"type": "video_url", "video_url": {"url": u}}),
        })
        .collect();
    content.push(json!({"type": "text", "text": text}));
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": 3,
           "temperature": 0, "reasoning_effort": "none"})
}

/// The timestamps of the chunks transformers' sampler makes of the clip at
/// `fps`, and the frame count.
fn expected_chunks(fps: f64) -> (usize, Vec<f64>) {
    let total = f64::from(SRC_FPS * SECONDS);
    let n = (total / f64::from(SRC_FPS) * fps) as usize;
    let step = total / n as f64;
    let index = |k: usize| (k as f64 * step).floor();
    let starts = (0..n.div_ceil(4))
        .map(|c| index(4 * c) / f64::from(SRC_FPS))
        .collect();
    (n, starts)
}

/// Prompt tokens a clip at `fps` adds: Σ over chunks of the chunk's tokens
/// and its wrapper (timestamp, begin, `video`, content, end).
fn expected_video_tokens(tok: &TextTokenizer, fps: f64) -> (usize, usize) {
    let cfg = processor_for("kimi_k3");
    let plan = caracal_media::plan_resize(SIZE.0, SIZE.1, &cfg.frame_config()).unwrap();
    let merge = cfg.merge_kernel_size as usize;
    let per_chunk = plan.grid_h * plan.grid_w / (merge * merge);
    let (frames, starts) = expected_chunks(fps);
    assert!(
        (frames as f64 - f64::from(SECONDS) * fps).abs() <= 1.0,
        "frames = duration × fps within one frame"
    );
    let total = starts
        .iter()
        .map(|&t| {
            let wrapper = tok
                .encode_chat(&caracal_media::chunk_prompt(t))
                .unwrap()
                .len();
            per_chunk + wrapper - 1
        })
        .sum();
    (starts.len(), total)
}

fn default_tokenizer() -> TextTokenizer {
    let dir = caracal::convert::synth::default_model_dir().unwrap();
    TextTokenizer::from_dir(&dir).expect("the default model has a tokenizer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn videos_are_chunked_encoded_once_and_their_spans_are_cached() {
    let dir = tempdir("caracal-video-ok");
    let a = data_url(
        "video/mp4",
        &std::fs::read(clip(&dir, "a.mp4", "testsrc")).unwrap(),
    );
    let tok = default_tokenizer();
    let (chunks, video_tokens) = expected_video_tokens(&tok, 2.0);
    assert_eq!(chunks, 2, "6 frames at 2 fps: chunks of 4 and 2");

    let server = start_default(GatewayConfig::default()).await;
    let (status, text_only) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[], "What happens?"),
    )
    .await;
    assert_eq!(status, 200, "{text_only}");
    let (status, first) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[(a.clone(), Some(2.0))], "What happens?"),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let with = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let without = text_only["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        (with - without) as usize,
        video_tokens,
        "text + Σ chunk tokens + wrappers"
    );
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        2,
        "one encode per chunk"
    );

    // The same video again (fps from the default): nothing new is encoded, the span is cached.
    let (status, again) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[(a.clone(), None)], "What happens?"),
    )
    .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        again["usage"]["prompt_tokens"],
        first["usage"]["prompt_tokens"]
    );
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        2,
        "no new encode"
    );
    assert_eq!(metric(&server, "caracal_vision_cache_hits_total").await, 2);
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= with / 16 * 16 - 16,
        "the video's spans are cached: {cached} of {with}"
    );
    assert_eq!(
        again["choices"][0]["message"], first["choices"][0]["message"],
        "greedy, same prompt"
    );

    // Responses `input_video` with a part-level fps of 1: 3 frames, one chunk.
    let (one_chunk, tokens_at_1) = expected_video_tokens(&tok, 1.0);
    assert_eq!(one_chunk, 1);
    let responses = |parts: Vec<Value>| {
        json!({"input": [{"role": "user", "content": parts}], "max_output_tokens": 2,
               "temperature": 0, "reasoning": {"effort": "none"}})
    };
    let text = json!({"type": "input_text", "text": "Describe it."});
    let (status, plain) = json(
        server.addr,
        "POST",
        "/v1/responses",
        &responses(vec![text.clone()]),
    )
    .await;
    assert_eq!(status, 200, "{plain}");
    let (status, resp) = json(
        server.addr,
        "POST",
        "/v1/responses",
        &responses(vec![
            json!({"type": "input_video", "video_url": a, "fps": 1}),
            text.clone(),
        ]),
    )
    .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(
        (resp["usage"]["input_tokens"].as_u64().unwrap()
            - plain["usage"]["input_tokens"].as_u64().unwrap()) as usize,
        tokens_at_1
    );
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        3,
        "other frames at 1 fps: one new chunk"
    );
    // At 2 fps it is the Chat video's chunks again.
    let (status, resp2) = json(
        server.addr,
        "POST",
        "/v1/responses",
        &responses(vec![json!({"type": "input_video", "video_url": a}), text]),
    )
    .await;
    assert_eq!(status, 200, "{resp2}");
    assert_eq!(
        (resp2["usage"]["input_tokens"].as_u64().unwrap()
            - plain["usage"]["input_tokens"].as_u64().unwrap()) as usize,
        video_tokens
    );
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        3
    );

    // Realtime: an `input_video` item, then a response.
    let mut c = WsClient::connect(server.addr, "/v1/realtime?model=kimi-k3-tiny").await;
    assert_eq!(c.next().await.unwrap()["type"], "session.created");
    assert_eq!(c.next().await.unwrap()["type"], "conversation.created");
    c.send(&json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
        "content": [{"type": "input_video", "video_url": a}, {"type": "input_text", "text": "And now?"}]}}))
        .await;
    assert_eq!(c.next().await.unwrap()["type"], "conversation.item.added");
    assert_eq!(c.next().await.unwrap()["type"], "conversation.item.done");
    c.send(&json!({"type": "response.create", "response": {"max_output_tokens": 2}}))
        .await;
    let done = loop {
        let ev = c.next().await.unwrap();
        assert_ne!(ev["type"], "error", "{ev}");
        if ev["type"] == "response.done" {
            break ev;
        }
    };
    assert!(
        done["response"]["usage"]["input_tokens"].as_u64().unwrap() as usize > video_tokens,
        "{done}"
    );
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        3,
        "the Realtime item reuses the encoded chunks"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_videos_get_the_media_error_kind_and_the_server_keeps_serving() {
    let dir = tempdir("caracal-video-bad");
    let outside = tempdir("caracal-video-outside");
    let good = std::fs::read(clip(&dir, "ok.mp4", "testsrc")).unwrap();
    let other = std::fs::read(clip(&outside, "other.mp4", "smptebars")).unwrap();
    let png = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("media/tests/fixtures/images/smptebars_250x90.png"),
    )
    .unwrap();
    let model_dir = caracal::convert::synth::default_model_dir().unwrap();
    let mut media = MediaConfig::for_model_type("kimi_k3");
    media.allowed_dir = Some(dir.clone());
    media.max_videos = 1;
    media.max_video_bytes = good.len().max(other.len()) + 16;
    media.video.max_frames = 6;
    let server = start_media(
        &model_dir,
        GatewayConfig::default(),
        EngineConfig::default(),
        Some(media),
    )
    .await;
    let ok = data_url("video/mp4", &good);
    let mut truncated = good.clone();
    truncated.truncate(good.len() / 2);
    let mut corrupt = good.clone();
    for b in corrupt[48..].iter_mut().step_by(7) {
        *b ^= 0x5a;
    }
    let big = vec![0u8; good.len().max(other.len()) + 1024];
    let cases: Vec<(Vec<VideoPart>, &str)> = vec![
        (
            vec![(data_url("video/mp4", &png), None)],
            "video_format_mismatch",
        ),
        (vec![(data_url("video/mp4", &truncated), None)], "video_"),
        (vec![(data_url("video/mp4", &corrupt), None)], "video_"),
        (vec![(data_url("video/mp4", &big), None)], "video_too_large"),
        (vec![(ok.clone(), Some(2.5))], "video_too_many_frames"),
        (vec![(ok.clone(), Some(0.0))], "invalid_value"),
        (
            vec![(ok.clone(), None), (ok.clone(), None)],
            "too_many_videos",
        ),
        (
            vec![("https://example.com/v.mp4".into(), None)],
            "unsupported_parameter",
        ),
        (
            vec![(
                format!("file://{}", outside.join("other.mp4").display()),
                None,
            )],
            "media_path_not_allowed",
        ),
        (
            vec![("data:video/mp4;base64,@@@".into(), None)],
            "invalid_video_url",
        ),
    ];
    for (videos, code) in cases {
        let (status, err) = json(
            server.addr,
            "POST",
            "/v1/chat/completions",
            &chat_with(&videos, "x"),
        )
        .await;
        assert_eq!(status, 400, "{code}: {err}");
        let got = err["error"]["code"].as_str().unwrap_or("");
        assert!(got.starts_with(code), "want {code}: {err}");
        assert!(
            err["error"]["param"]
                .as_str()
                .unwrap_or("")
                .starts_with("messages[0].content"),
            "{err}"
        );
    }
    // The limits name themselves.
    let (_, err) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[(ok.clone(), Some(2.5))], "x"),
    )
    .await;
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.contains("--max-video-frames"), "{msg}");
    // Still serving: the same video from the allowed folder.
    let (status, v) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(
            &[(format!("file://{}", dir.join("ok.mp4").display()), None)],
            "x",
        ),
    )
    .await;
    assert_eq!(status, 200, "a file under --allowed-media-dir is read: {v}");
    server.shutdown().await.unwrap();

    // A model without a tower refuses video by name.
    let llama = start_llama().await;
    let (status, err) = json(
        llama.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[(ok, None)], "x"),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["code"], "unsupported_parameter", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no video"),
        "{err}"
    );
    llama.shutdown().await.unwrap();
}

/// Past one decode running and `--max-waiting-videos 0` waiting, a video request is
/// answered 503 `overloaded` with `Retry-After` at once (no unbounded line); the
/// decodes that were let in finish, and a later request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_video_decode_line_answers_overloaded_and_keeps_serving() {
    let dir = tempdir("caracal-video-line");
    // A clip that takes a while to decode (250 frames of 640×480), sampled sparsely.
    let path = lavfi_clip(
        &dir,
        "long.mp4",
        "testsrc=duration=10:size=640x480:rate=25",
        &["-preset", "ultrafast"],
    );
    let bytes = std::fs::read(&path).unwrap();
    let model_dir = caracal::convert::synth::default_model_dir().unwrap();
    let mut media = MediaConfig::for_model_type("kimi_k3");
    media.ingest.threads = 1;
    media.max_waiting_videos = 0;
    media.max_video_bytes = bytes.len() + 16;
    let server = start_media(
        &model_dir,
        GatewayConfig::default(),
        EngineConfig::default(),
        Some(media),
    )
    .await;
    let body = serde_json::to_vec(&chat_with(
        &[(data_url("video/mp4", &bytes), Some(0.5))],
        "x",
    ))
    .unwrap();
    let addr = server.addr;
    // Six requests at once: one decodes, the others find the line full.
    let sends: Vec<_> = (0..6)
        .map(|_| {
            let body = body.clone();
            tokio::spawn(async move {
                send(addr, "POST", "/v1/chat/completions", &[], Some(body)).await
            })
        })
        .collect();
    let (mut served, mut refused) = (0, 0);
    for s in sends {
        let resp = s.await.expect("the request task");
        let status = resp.status().as_u16();
        let retry = resp.headers().get("retry-after").cloned();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        match status {
            200 => served += 1,
            503 => {
                refused += 1;
                assert_eq!(v["error"]["code"], "overloaded", "{v}");
                let msg = v["error"]["message"].as_str().unwrap_or("");
                assert!(msg.contains("--max-waiting-videos"), "{msg}");
                assert_eq!(retry.expect("a Retry-After header"), "1");
            }
            _ => panic!("unexpected {status}: {v}"),
        }
    }
    eprintln!("video line: {served} served, {refused} refused");
    assert!(served >= 1, "the first video is decoded and answered");
    assert!(refused >= 1, "a full line refuses ({served} served)");
    // Nothing is stuck: the same request alone is served.
    let (status, v) = json(
        addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[(data_url("video/mp4", &bytes), Some(0.5))], "x"),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    server.shutdown().await.unwrap();
}

#[test]
fn cli_generate_takes_a_video_with_chat_and_with_prompt_ids() {
    let dir = tempdir("caracal-video-cli");
    let path = clip(&dir, "a.mp4", "testsrc");
    let tok = default_tokenizer();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_caracal"))
            .arg("generate")
            .args(args)
            .args(["--max-tokens", "2", "--ignore-eos", "--json", "--video"])
            .arg(&path)
            .output()
            .expect("caracal runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).expect("one JSON object")
    };
    let (_, tokens) = expected_video_tokens(&tok, 2.0);
    let v = run(&["--chat", "--prompt", "What happens?"]);
    let per_chunk: Vec<u64> = v["media_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect();
    assert_eq!(per_chunk.len(), 2, "{v}");
    assert_eq!(v["video_chunks"][1]["timestamp"], "00:00:02.000", "{v}");

    // --prompt-ids: the media placeholder stands for the video's chunk prompts.
    let pad = 163_605u32;
    let ids = format!("{pad},100,101");
    let v = run(&["--prompt-ids", &ids, "--fps", "2"]);
    assert_eq!(
        v["prompt_tokens"].as_u64().unwrap() as usize,
        tokens + 2,
        "{v}"
    );
    assert_eq!(v["media_tokens"].as_array().unwrap().len(), 2, "{v}");
}
