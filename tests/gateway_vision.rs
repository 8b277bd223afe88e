//! Images through the gateway over real sockets on the built-in default
//! model (the synthesized Kimi K3, whose MoonViT3d tower runs): Chat
//! Completions `image_url` and Responses `input_image` parts are encoded,
//! spliced and cached; the same image again costs no encode and its span
//! comes from the prefix cache; bad image input gets a stable error and the
//! server keeps serving.

mod common;
mod gateway_support;

use caracal::gateway::media::MediaConfig;
use caracal::gateway::GatewayConfig;
use caracal_actors::runtime::EngineConfig;
use gateway_support::*;
use serde_json::{json, Value};

/// A committed PNG (made by the `ffmpeg` CLI for the media fixtures).
fn png(name: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("media/tests/fixtures/images")
            .join(name),
    )
    .expect("fixture image")
}

fn chat_with(images: &[String], text: &str) -> Value {
    let mut content: Vec<Value> = images
        .iter()
        .map(|u| json!({"type": "image_url", "image_url": {"url": u}}))
        .collect();
    content.push(json!({"type": "text", "text": text}));
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": 3,
           "temperature": 0, "reasoning_effort": "none"})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_are_encoded_once_and_their_span_is_cached() {
    let server = start_default(GatewayConfig::default()).await;
    let (_, models) = raw_json(server.addr, "GET", "/v1/models", &[], None).await;
    assert_eq!(models["data"][0]["supports_images"], true, "{models}");

    let a = data_url("image/png", &png("testsrc2_320x240.png"));
    let (status, first) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(std::slice::from_ref(&a), "What is this?"),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    let (status, text_only) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[], "What is this?"),
    )
    .await;
    assert_eq!(status, 200, "{text_only}");
    let with = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let without = text_only["usage"]["prompt_tokens"].as_u64().unwrap();
    // 320×240 under K3's limits: padded to 336×252, 24×18 patches, 2×2 merged.
    assert_eq!(
        with - without,
        108 + 4,
        "108 image tokens and the wrapper: begin, `image`, content, end"
    );
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        1
    );

    let (status, again) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(std::slice::from_ref(&a), "What is this?"),
    )
    .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        1,
        "no new encode"
    );
    assert_eq!(metric(&server, "caracal_vision_cache_hits_total").await, 1);
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= with / 16 * 16 - 16,
        "the image span is cached: {cached} of {with}"
    );
    assert_eq!(
        again["choices"][0]["message"], first["choices"][0]["message"],
        "greedy, same prompt"
    );

    // Another picture at the same place: encoded, and the cache stops at its span.
    let b = data_url("image/png", &png("smptebars_250x90.png"));
    let (status, other) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(std::slice::from_ref(&b), "What is this?"),
    )
    .await;
    assert_eq!(status, 200, "{other}");
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        2
    );
    let cached_other = other["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached_other < cached, "{cached_other} vs {cached}");

    // Two images in one request, and the Responses shape.
    let (status, two) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[a.clone(), b.clone()], "Compare."),
    )
    .await;
    assert_eq!(status, 200, "{two}");
    let body = json!({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": a}, {"type": "input_text", "text": "Describe it."}]}],
        "max_output_tokens": 3, "temperature": 0, "reasoning": {"effort": "none"}});
    let (status, resp) = json(server.addr, "POST", "/v1/responses", &body).await;
    assert_eq!(status, 200, "{resp}");
    assert!(
        resp["usage"]["input_tokens"].as_u64().unwrap() > 108,
        "{resp}"
    );
    assert_eq!(
        metric(&server, "caracal_vision_items_encoded_total").await,
        2,
        "both images were seen before"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_images_get_errors_that_name_the_problem_and_the_server_keeps_serving() {
    let allowed = tempdir("caracal-media-ok");
    let outside = tempdir("caracal-media-outside");
    std::fs::write(allowed.join("ok.png"), png("smptebars_250x90.png")).unwrap();
    std::fs::write(outside.join("secret.png"), png("smptebars_250x90.png")).unwrap();
    let dir = caracal::convert::synth::default_model_dir().unwrap();
    let mut media = MediaConfig::for_model_type("kimi_k3");
    media.allowed_dir = Some(allowed.clone());
    media.max_images = 2;
    media.max_image_bytes = 8_000;
    let server = start_media(
        &dir,
        GatewayConfig::default(),
        EngineConfig::default(),
        Some(media),
    )
    .await;
    let ok_file = format!("file://{}", allowed.join("ok.png").display());
    let escape = format!(
        "file://{}/../{}/secret.png",
        allowed.display(),
        outside.file_name().unwrap().to_string_lossy()
    );
    let mut corrupt = png("smptebars_250x90.png");
    corrupt.truncate(100);
    let small = data_url("image/png", &png("smptebars_250x90.png"));
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["https://example.com/cat.png".into()],
            "unsupported_parameter",
        ),
        (vec![escape], "media_path_not_allowed"),
        (
            vec!["data:image/png;base64,@@@".into()],
            "invalid_image_url",
        ),
        (vec![data_url("image/png", &corrupt)], "image_decode_failed"),
        (
            vec![data_url("image/png", &png("testsrc2_320x240.png"))],
            "image_too_large",
        ),
        (
            vec![small.clone(), small.clone(), small.clone()],
            "too_many_images",
        ),
    ];
    for (urls, code) in cases {
        let (status, err) = json(
            server.addr,
            "POST",
            "/v1/chat/completions",
            &chat_with(&urls, "x"),
        )
        .await;
        assert_eq!(status, 400, "{code}: {err}");
        assert_eq!(err["error"]["code"], code, "{err}");
        assert!(
            err["error"]["param"]
                .as_str()
                .unwrap_or("")
                .starts_with("messages[0].content"),
            "{err}"
        );
    }
    let (status, v) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[ok_file], "x"),
    )
    .await;
    assert_eq!(status, 200, "a file under --allowed-media-dir is read: {v}");
    server.shutdown().await.unwrap();

    // A model without a tower refuses images by name.
    let llama = start_llama().await;
    let (status, err) = json(
        llama.addr,
        "POST",
        "/v1/chat/completions",
        &chat_with(&[small], "x"),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["code"], "unsupported_parameter", "{err}");
    llama.shutdown().await.unwrap();
}
