//! The Responses WebSocket mode over real sockets: a multi-turn tool loop
//! chained by `previous_response_id` with only the new items (`store:
//! false`), whose later turns come from the cache; `generate: false`
//! warm-up; `stream_id` lanes; errors in the WebSocket shape while the
//! session keeps serving; disconnect mid-turn; the session limit; and
//! shutdown with a session open.

mod common;
mod gateway_support;

use std::time::Duration;

use caracal::gateway::GatewayConfig;
use caracal_actors::runtime::EngineConfig;
use gateway_support::*;
use serde_json::{json, Value};

fn tools() -> Value {
    json!([{"type": "function", "name": "read_file", "description": "Read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
            "strict": true}])
}

/// Long coding-agent instructions: the stable prefix every turn shares.
fn instructions() -> String {
    let rule = "You are a coding agent working in a Rust repository. Read files before you change them, \
                keep edits small, run the tests after each change, and report what you did in one short paragraph. ";
    rule.repeat(40)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_loop_over_the_socket_prefills_only_the_new_items() {
    let server = start_default(GatewayConfig::default()).await;
    let mut c = WsClient::connect(server.addr, "/v1/responses").await;
    // Warm-up: instructions and tools cached, nothing generated.
    c.send(
        &json!({"type": "response.create", "store": false, "generate": false,
                   "instructions": instructions(), "tools": tools(), "input": []}),
    )
    .await;
    let warm = c.until_done().await;
    assert_eq!(warm.len(), 2, "{warm:?}");
    assert_eq!(warm[0]["type"], "response.created");
    assert_eq!(warm[1]["type"], "response.completed");
    assert_eq!(warm[1]["response"]["output"], json!([]));
    let mut prev = warm[1]["response"]["id"].as_str().unwrap().to_string();
    let mut ratios = Vec::new();
    for turn in 0..4 {
        // The random-weight model writes no tool calls of its own, so the
        // agent replays the call with its result, as clients may.
        let input = if turn == 0 {
            json!([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Open main.rs"}]}])
        } else {
            let call_id = format!("call_{turn}");
            json!([
                {"type": "function_call", "call_id": call_id, "name": "read_file",
                 "arguments": format!("{{\"path\":\"src/file{turn}.rs\"}}")},
                {"type": "function_call_output", "call_id": call_id, "output": format!("fn f{turn}() {{}}")},
            ])
        };
        c.send(
            &json!({"type": "response.create", "store": false, "previous_response_id": prev,
                       "instructions": instructions(), "tools": tools(), "input": input,
                       "max_output_tokens": 4, "temperature": 0}),
        )
        .await;
        let events = c.until_done().await;
        let last = events.last().unwrap();
        assert!(
            last["type"] == "response.completed" || last["type"] == "response.incomplete",
            "{last}"
        );
        assert_eq!(last["response"]["previous_response_id"], prev.as_str());
        let usage = &last["response"]["usage"];
        let input_tokens = usage["input_tokens"].as_u64().unwrap() as f64;
        let cached = usage["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap() as f64;
        ratios.push(cached / input_tokens);
        prev = last["response"]["id"].as_str().unwrap().to_string();
    }
    eprintln!("cached share of the prompt per turn: {ratios:?}");
    // Turns after the first: the first turn after the warm-up hits only up to
    // the warm-up's last KDA snapshot (chunk and page boundaries of the prefill).
    for (turn, r) in ratios.iter().enumerate().skip(1) {
        assert!(
            *r >= 0.9,
            "turn {turn}: only {:.1}% of the prompt came from cache ({ratios:?})",
            r * 100.0
        );
    }
    // A store: false chain lives only on this connection.
    let (status, _) = json(
        server.addr,
        "GET",
        &format!("/v1/responses/{prev}"),
        &Value::Null,
    )
    .await;
    assert_eq!(status, 404);
    let mut other = WsClient::connect(server.addr, "/v1/responses").await;
    other
        .send(&json!({"type": "response.create", "previous_response_id": prev, "input": "hi"}))
        .await;
    let err = other.next().await.unwrap();
    assert_eq!(err["type"], "error");
    assert_eq!(err["status"], 400);
    assert_eq!(err["error"]["code"], "previous_response_not_found");
    assert_eq!(err["error"]["type"], "invalid_request_error");
    drop(c);
    drop(other);
    server.wait_engine_idle().await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_run_concurrently_fifo_within_a_lane_and_echo_their_stream_id() {
    let server = start_llama().await;
    let mut c = WsClient::connect(server.addr, "/v1/responses").await;
    let create = |lane: &str, text: &str| json!({"type": "response.create", "stream_id": lane, "input": text, "max_output_tokens": 5, "temperature": 0});
    c.send(&create("lane.a", "first on a")).await;
    c.send(&create("lane.a", "second on a")).await;
    c.send(&create("lane-b", "first on b")).await;
    let mut terminal = Vec::new();
    let mut created = Vec::new();
    while terminal.len() < 3 {
        let ev = c.next().await.unwrap();
        let lane = ev["stream_id"]
            .as_str()
            .expect("every event echoes its lane")
            .to_string();
        match ev["type"].as_str().unwrap() {
            "response.created" => created.push((lane, ev["response"]["id"].clone())),
            "response.completed" | "response.incomplete" => {
                terminal.push((lane, ev["response"]["id"].clone()))
            }
            "error" => panic!("{ev}"),
            _ => {}
        }
    }
    let a: Vec<&Value> = terminal
        .iter()
        .filter(|(l, _)| l == "lane.a")
        .map(|(_, id)| id)
        .collect();
    let a_created: Vec<&Value> = created
        .iter()
        .filter(|(l, _)| l == "lane.a")
        .map(|(_, id)| id)
        .collect();
    assert_eq!(a.len(), 2);
    assert_eq!(a, a_created, "lane.a runs its requests in order");
    assert_eq!(terminal.iter().filter(|(l, _)| l == "lane-b").count(), 1);
    // A bad lane name is refused with the lane's own error shape.
    c.send(&json!({"type": "response.create", "stream_id": "bad lane!", "input": "x"}))
        .await;
    let err = c.next().await.unwrap();
    assert_eq!(err["error"]["code"], "invalid_stream_id");
    assert_eq!(err["stream_id"], "bad lane!");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_get_ws_errors_unknown_events_are_ignored_and_the_session_keeps_serving() {
    let config = GatewayConfig {
        max_message_bytes: 2048,
        ..GatewayConfig::default()
    };
    let server = start(&fixture("tiny-llama"), config, EngineConfig::default()).await;
    let mut c = WsClient::connect(server.addr, "/v1/responses").await;
    c.send_text("{not json").await;
    let e = c.next().await.unwrap();
    assert_eq!(
        (
            e["type"].as_str(),
            e["status"].as_u64(),
            e["error"]["code"].as_str()
        ),
        (Some("error"), Some(400), Some("invalid_json"))
    );
    c.send_text(&format!(
        "{{\"type\":\"response.create\",\"input\":\"{}\"}}",
        "x".repeat(3000)
    ))
    .await;
    let e = c.next().await.unwrap();
    assert_eq!(e["error"]["code"], "message_too_large");
    assert_eq!(e["status"], 413);
    c.send(&json!({"type": "response.create", "input": "x", "temperature": "hot"}))
        .await;
    let e = c.next().await.unwrap();
    assert_eq!(
        (e["error"]["code"].as_str(), e["error"]["param"].as_str()),
        (Some("invalid_type"), Some("temperature"))
    );
    c.send(&json!({"type": "response.steer", "previous_response_id": "resp_x", "input": "faster"}))
        .await;
    let e = c.next().await.unwrap();
    assert_eq!(e["type"], "response.steer.failed");
    assert_eq!(e["error"]["code"], "steering_not_supported");
    c.send(&json!({"type": "response.processed", "response_id": "resp_x"}))
        .await;
    c.send(&json!({"type": "response.create", "input": "still there?", "max_output_tokens": 3}))
        .await;
    let evs = c.until_done().await;
    assert_eq!(
        evs[0]["type"], "response.created",
        "response.processed got no answer"
    );
    assert!(
        evs.iter().all(|e| e.get("stream_id").is_none()),
        "default-lane events carry no stream_id"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_mid_turn_leaks_no_page_or_lock() {
    let server = start_llama().await;
    let mut c = WsClient::connect(server.addr, "/v1/responses").await;
    c.send(
        &json!({"type": "response.create", "input": "a long story", "max_output_tokens": 220,
                   "ignore_eos": true}),
    )
    .await;
    loop {
        let ev = c.next().await.unwrap();
        if ev["type"] == "response.output_text.delta" {
            break;
        }
    }
    drop(c);
    server.wait_engine_idle().await;
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_limit_refuses_with_a_retryable_code() {
    let config = GatewayConfig {
        max_sessions: 1,
        ..GatewayConfig::default()
    };
    let server = start(&fixture("tiny-llama"), config, EngineConfig::default()).await;
    let _first = WsClient::connect(server.addr, "/v1/responses").await;
    let err = tokio_tungstenite::connect_async(format!("ws://{}/v1/responses", server.addr)).await;
    match err {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            assert_eq!(resp.status(), 429);
            let body: Value = serde_json::from_slice(resp.body().as_deref().unwrap()).unwrap();
            assert_eq!(body["error"]["code"], "websocket_connection_limit_reached");
        }
        other => panic!("expected a refused upgrade, got {other:?}"),
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_an_open_session_with_a_close_frame() {
    let config = GatewayConfig {
        shutdown_timeout: Duration::from_secs(10),
        ..GatewayConfig::default()
    };
    let mut server = start(&fixture("tiny-llama"), config, EngineConfig::default()).await;
    let mut c = WsClient::connect(server.addr, "/v1/responses").await;
    c.send(&json!({"type": "response.create", "input": "hi", "max_output_tokens": 2}))
        .await;
    c.until_done().await;
    server.trigger_shutdown();
    let code = loop {
        match c.next().await {
            Ok(_) => continue,
            Err(code) => break code,
        }
    };
    assert_eq!(code, Some(1001), "a graceful drain closes with 1001");
    server.join().await.unwrap();
}
