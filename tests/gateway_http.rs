//! The gateway's HTTP side over real sockets on `127.0.0.1:0` with the
//! tiny-llama checkpoint (ChatML template): chat completions (JSON and SSE),
//! completions from text and token ids, models, health, metrics, stable
//! errors for bad input while the server keeps serving, API keys,
//! cancellation by disconnect, and shutdown with a stream open.

mod common;
mod gateway_support;

use std::time::Duration;

use caracal::gateway::GatewayConfig;
use caracal_actors::runtime::EngineConfig;
use gateway_support::*;
use serde_json::{json, Value};

fn chat_body(content: &str, max_tokens: usize) -> Value {
    json!({"model": "tiny-llama", "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_carries_the_same_text_as_json_and_reports_cached_tokens() {
    let server = start_llama().await;
    let (status, full) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_body("Hello there", 12),
    )
    .await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    assert_eq!(full["model"], "tiny-llama");
    let choice = &full["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let text = choice["message"]["content"].as_str().unwrap().to_string();
    let usage = &full["usage"];
    assert_eq!(usage["completion_tokens"], 12);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + 12
    );
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());

    let mut body = chat_body("Hello there", 12);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let events = sse(server.addr, "/v1/chat/completions", &body).await;
    assert!(events
        .iter()
        .all(|e| e["object"] == "chat.completion.chunk"));
    let roles: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"].get("role"))
        .collect();
    assert_eq!(roles, vec![&json!("assistant")], "role is sent once");
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text, "greedy stream equals the JSON answer");
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 12);
    // The same prompt again: its whole-page prefix comes from the cache.
    let prompt = last["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = last["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= prompt / 16 * 16 - 16 && cached > 0,
        "cached {cached} of {prompt}"
    );
    let finish: Vec<&Value> = events
        .iter()
        .filter_map(|e| {
            e["choices"][0]
                .get("finish_reason")
                .filter(|f| !f.is_null())
        })
        .collect();
    assert_eq!(finish, vec![&json!("length")]);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_take_text_or_token_ids_and_stop_strings_cut_the_text() {
    let server = start_llama().await;
    let (status, ids) = json(
        server.addr,
        "POST",
        "/v1/completions",
        &json!({"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{ids}");
    assert_eq!(ids["object"], "text_completion");
    assert_eq!(ids["usage"]["prompt_tokens"], 4);
    assert_eq!(ids["usage"]["completion_tokens"], 6);
    let (status, nested) = json(
        server.addr,
        "POST",
        "/v1/completions",
        &json!({"prompt": [[5, 6, 7, 8]], "max_tokens": 6, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(nested["choices"][0]["text"], ids["choices"][0]["text"]);
    let (status, text) = json(
        server.addr,
        "POST",
        "/v1/completions",
        &json!({"prompt": "The license", "max_tokens": 8, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let full = text["choices"][0]["text"].as_str().unwrap().to_string();
    // Stop at a piece of the greedy text: the answer ends right before it.
    if let Some(cut) = full
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| i > 0 && !full[i..].trim().is_empty())
    {
        let stop: String = full[cut..].chars().take(2).collect();
        let (_, stopped) = json(
            server.addr,
            "POST",
            "/v1/completions",
            &json!({"prompt": "The license", "max_tokens": 8, "temperature": 0, "stop": stop}),
        )
        .await;
        let got = stopped["choices"][0]["text"].as_str().unwrap();
        assert!(!got.contains(stop.as_str()), "{got:?} still has {stop:?}");
        assert!(full.starts_with(got), "{got:?} is not a prefix of {full:?}");
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    }
    let events = sse(
        server.addr,
        "/v1/completions",
        &json!({"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "stream": true}),
    )
    .await;
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, ids["choices"][0]["text"].as_str().unwrap());
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics_describe_the_server() {
    let server = start_llama().await;
    let (status, models) = json(server.addr, "GET", "/v1/models", &Value::Null).await;
    assert_eq!(status, 200);
    let m = &models["data"][0];
    assert_eq!(m["id"], "tiny-llama");
    assert_eq!(m["context_length"], 256);
    assert_eq!(m["input_modalities"], json!(["text"]));
    assert_eq!(m["supports_images"], false);
    let (status, health) = raw_json(server.addr, "GET", "/health", &[], None).await;
    assert_eq!((status, health["status"].as_str()), (200, Some("ok")));
    json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_body("Hi", 3),
    )
    .await;
    let resp = send(server.addr, "GET", "/metrics", &[], None).await;
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    use http_body_util::BodyExt;
    let text = String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    for name in [
        "caracal_requests_total{endpoint=\"chat_completions\"} 1",
        "caracal_time_to_first_token_seconds_bucket",
        "caracal_inter_token_latency_seconds_count",
        "caracal_queue_length",
        "caracal_running_sequences",
        "caracal_kv_pages_used",
        "caracal_kv_pages_free",
        "caracal_prefix_cache_hit_tokens_total",
        "caracal_credit_stalls_total",
        "caracal_generation_tokens_total 3",
        "caracal_kv_pages_cached",
        "caracal_kv_pages_locked",
        "caracal_kda_snapshots",
        "caracal_engine_up 1",
        "process_resident_memory_bytes",
    ] {
        assert!(text.contains(name), "metrics lack {name}:\n{text}");
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_stable_error_and_the_server_keeps_serving() {
    let config = GatewayConfig {
        max_body_bytes: 4096,
        ..GatewayConfig::default()
    };
    let server = start(&fixture("tiny-llama"), config, EngineConfig::default()).await;
    let a = server.addr;
    let post = |body: Vec<u8>| raw_json(a, "POST", "/v1/chat/completions", &[], Some(body));
    let cases: Vec<(Vec<u8>, u16, &str, Option<&str>)> = vec![
        (b"{\"messages\": [".to_vec(), 400, "invalid_json", None),
        (b"[1, 2]".to_vec(), 400, "invalid_type", None),
        (br#"{"model":"tiny-llama"}"#.to_vec(), 400, "missing_required_parameter", Some("messages")),
        (br#"{"messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#.to_vec(), 400, "invalid_type", Some("temperature")),
        (br#"{"messages":[{"role":"user","content":"x"}],"temperature":7}"#.to_vec(), 400, "invalid_value", Some("temperature")),
        (br#"{"messages":[{"role":"wizard","content":"x"}]}"#.to_vec(), 400, "invalid_value", Some("messages[0].role")),
        (br#"{"messages":[{"role":"user","content":"x"}],"model":"gpt-9"}"#.to_vec(), 404, "model_not_found", Some("model")),
        (br#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#.to_vec(), 400, "invalid_value", Some("top_logprobs")),
        (br#"{"messages":[{"role":"user","content":"x"}],"n":2}"#.to_vec(), 400, "unsupported_parameter", Some("n")),
        (br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AA=="}}]}]}"#.to_vec(), 400, "unsupported_parameter", Some("messages[0].content[0]")),
        (br#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}}}"#.to_vec(), 400, "unknown_tool", Some("tool_choice")),
        (br#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{}}}"#.to_vec(), 400, "unsupported_parameter", Some("response_format")),
        (format!(r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#, "words and more words ".repeat(80)).into_bytes(), 400, "context_length_exceeded", None),
        (vec![b' '; 5000], 413, "body_too_large", None),
    ];
    for (body, status, code, param) in cases {
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).into_owned();
        let (got, err) = post(body).await;
        assert_eq!(got, status, "{shown}: {err}");
        assert_eq!(err["error"]["code"], code, "{shown}: {err}");
        assert!(
            err["error"]["type"].is_string() && err["error"]["message"].is_string(),
            "{err}"
        );
        if let Some(p) = param {
            assert_eq!(err["error"]["param"], p, "{shown}: {err}");
        }
    }
    let (status, err) = json(a, "GET", "/v1/nothing", &Value::Null).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let (status, ok) = json(
        a,
        "POST",
        "/v1/chat/completions",
        &chat_body("still there?", 2),
    )
    .await;
    assert_eq!(status, 200, "{ok}");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_except_on_health() {
    let config = GatewayConfig {
        api_key: Some("sekret".into()),
        ..GatewayConfig::default()
    };
    let server = start(&fixture("tiny-llama"), config, EngineConfig::default()).await;
    let body = serde_json::to_vec(&chat_body("hi", 2)).unwrap();
    let (status, err) = raw_json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(body.clone()),
    )
    .await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    let (status, _) = raw_json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &[("authorization", "Bearer wrong")],
        Some(body.clone()),
    )
    .await;
    assert_eq!(status, 401);
    let (status, _) = raw_json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &[("authorization", "Bearer sekret")],
        Some(body),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _) = raw_json(server.addr, "GET", "/health", &[], None).await;
    assert_eq!(status, 200);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_cancels_and_leaks_no_page_or_lock() {
    let server = start_llama().await;
    let mut body = chat_body("Tell me a long story", 200);
    body["stream"] = json!(true);
    body["ignore_eos"] = json!(true);
    let mut reader = SseReader::open(server.addr, "/v1/chat/completions", &body).await;
    for _ in 0..3 {
        reader.next().await.expect("a chunk");
    }
    drop(reader);
    let (cancelled, free, total) = server.wait_engine_idle().await;
    assert!(cancelled >= 1, "the engine saw the cancellation");
    assert!(free > 0 && free <= total);
    // The server still answers.
    let (status, _) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_body("again", 2),
    )
    .await;
    assert_eq!(status, 200);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_a_stream_open_ends_the_stream_and_stops_accepting() {
    let config = GatewayConfig {
        shutdown_timeout: Duration::from_millis(100),
        ..GatewayConfig::default()
    };
    let mut server = start(&fixture("tiny-llama"), config, EngineConfig::default()).await;
    let addr = server.addr;
    let mut body = chat_body("Tell me a long story", 240);
    body["stream"] = json!(true);
    body["ignore_eos"] = json!(true);
    let mut reader = SseReader::open(addr, "/v1/chat/completions", &body).await;
    reader.next().await.expect("first chunk");
    server.trigger_shutdown();
    // The stream ends: it finishes, or is cancelled with an error event, then [DONE].
    let (rest, done) = reader.all().await;
    assert!(done, "the stream is closed properly");
    let last = rest.last().cloned().unwrap_or(Value::Null);
    assert!(
        last.get("error")
            .is_some_and(|e| e["code"] == "shutting_down")
            || rest
                .iter()
                .any(|e| !e["choices"][0]["finish_reason"].is_null()),
        "{last}"
    );
    server.join().await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no longer accepting"
    );
}

/// A body that stops arriving gets a 408 after `--body-read-timeout` and its
/// connection closed, while other clients are served; a body that arrives
/// slowly, but within the timeout between reads, is read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_gets_408_and_a_slow_one_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let config = GatewayConfig {
        body_timeout: Some(Duration::from_millis(1500)),
        ..GatewayConfig::default()
    };
    let server = start(&fixture("tiny-llama"), config, EngineConfig::default()).await;
    let body = serde_json::to_string(&chat_body("Hello", 2)).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    // Stalled: half the body, then nothing.
    let mut stalled = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    stalled.write_all(head.as_bytes()).await.unwrap();
    stalled
        .write_all(&body.as_bytes()[..body.len() / 2])
        .await
        .unwrap();
    // Slow: the body in 4 pieces 500 ms apart (each wait under the timeout).
    let slow = {
        let (addr, head, body) = (server.addr, head.clone(), body.clone());
        tokio::spawn(async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(head.as_bytes()).await.unwrap();
            for piece in body.as_bytes().chunks(body.len().div_ceil(4)) {
                tokio::time::sleep(Duration::from_millis(500)).await;
                s.write_all(piece).await.unwrap();
            }
            let mut buf = vec![0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(60), s.read(&mut buf))
                .await
                .expect("an answer")
                .unwrap();
            String::from_utf8_lossy(&buf[..n]).to_string()
        })
    };
    // Another client meanwhile.
    let (status, v) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_body("Hi", 2),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let answer = answer_and_close(&mut stalled).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"code\":\"request_timeout\""), "{answer}");
    let slow = slow.await.unwrap();
    assert!(slow.starts_with("HTTP/1.1 200"), "{slow}");
    server.shutdown().await.unwrap();
}

/// Everything the server sends on `s` until it closes the connection
/// (within 30 s), as text.
async fn answer_and_close(s: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut answer))
        .await
        .expect("an answer and a close within 30 s")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// A chunked body that breaks off with a malformed chunk gets 400
/// `invalid_body`, and the server goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_chunked_body_gets_400_invalid_body() {
    use tokio::io::AsyncWriteExt;
    let server = start_llama().await;
    let mut s = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\nzz-not-a-size\r\n",
    )
    .await
    .unwrap();
    let answer = answer_and_close(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("\"code\":\"invalid_body\""), "{answer}");
    let (status, v) = json(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &chat_body("Hi", 2),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    server.shutdown().await.unwrap();
}
