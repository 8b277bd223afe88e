//! The Realtime protocol's text subset over a real socket: session events,
//! items (create, retrieve, delete, truncate), a response streamed through
//! `response.done` with cached-token usage and Caracal's cache report,
//! a tool result turn, cancellation, and errors that keep the session.

mod common;
mod gateway_support;

use gateway_support::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn realtime_text_session_runs_turns_rewinds_and_cancels() {
    let server = start_default(Default::default()).await;
    let mut c = WsClient::connect(server.addr, "/v1/realtime?model=kimi-k3-tiny").await;
    let created = c.next().await.unwrap();
    assert_eq!(created["type"], "session.created");
    assert_eq!(created["session"]["object"], "realtime.session");
    assert!(created["event_id"].is_string());
    assert_eq!(c.next().await.unwrap()["type"], "conversation.created");
    c.send(&json!({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
        "instructions": "You are a terse assistant.", "max_output_tokens": 5,
        "tools": [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}],
        "tool_choice": "auto", "audio": {"output": {"voice": "alloy"}}}})).await;
    let updated = c.next().await.unwrap();
    assert_eq!(updated["type"], "session.updated");
    assert_eq!(
        updated["session"]["instructions"],
        "You are a terse assistant."
    );
    c.send(
        &json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "What time is it?"}]}}),
    )
    .await;
    let added = c.next().await.unwrap();
    assert_eq!(added["type"], "conversation.item.added");
    let user_item = added["item"]["id"].as_str().unwrap().to_string();
    assert_eq!(c.next().await.unwrap()["type"], "conversation.item.done");

    let mut usage = Vec::new();
    for turn in 0..2 {
        if turn == 1 {
            // The random-weight model calls no tool itself: the client adds the call and its result.
            c.send(
                &json!({"type": "conversation.item.create", "item": {"type": "function_call",
                "call_id": "call_1", "name": "get_time", "arguments": "{}"}}),
            )
            .await;
            c.send(
                &json!({"type": "conversation.item.create", "item": {"type": "function_call_output",
                "call_id": "call_1", "output": "12:00"}}),
            )
            .await;
            for _ in 0..2 {
                assert_eq!(c.next().await.unwrap()["type"], "conversation.item.added");
                assert_eq!(c.next().await.unwrap()["type"], "conversation.item.done");
            }
        }
        c.send(&json!({"type": "response.create"})).await;
        let mut kinds = Vec::new();
        let done = loop {
            let ev = c.next().await.unwrap();
            kinds.push(ev["type"].as_str().unwrap().to_string());
            if ev["type"] == "response.done" {
                break ev;
            }
            assert_ne!(ev["type"], "error", "{ev}");
        };
        assert_eq!(kinds[0], "response.created");
        assert!(
            kinds.contains(&"caracal.cache_report".to_string()),
            "{kinds:?}"
        );
        let r = &done["response"];
        assert_eq!(r["object"], "realtime.response");
        assert!(
            ["completed", "incomplete"].contains(&r["status"].as_str().unwrap()),
            "{r}"
        );
        assert_eq!(r["usage"]["output_tokens"], 5);
        assert!(r["usage"]["input_token_details"]["cached_tokens"].is_u64());
        usage.push(r["usage"].clone());
    }
    assert!(
        usage[1]["input_token_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "the second turn reuses the first: {usage:?}"
    );

    // Rewind: delete the user item; retrieve it fails; truncate answers.
    c.send(&json!({"type": "conversation.item.retrieve", "item_id": user_item}))
        .await;
    assert_eq!(
        c.next().await.unwrap()["type"],
        "conversation.item.retrieved"
    );
    c.send(&json!({"type": "conversation.item.truncate", "item_id": user_item, "content_index": 0, "audio_end_ms": 0})).await;
    assert_eq!(
        c.next().await.unwrap()["type"],
        "conversation.item.truncated"
    );
    c.send(&json!({"type": "conversation.item.delete", "item_id": user_item}))
        .await;
    let deleted = c.next().await.unwrap();
    assert_eq!(
        (deleted["type"].as_str(), deleted["item_id"].as_str()),
        (Some("conversation.item.deleted"), Some(user_item.as_str()))
    );
    c.send(
        &json!({"type": "conversation.item.retrieve", "item_id": user_item, "event_id": "evt_1"}),
    )
    .await;
    let err = c.next().await.unwrap();
    assert_eq!(err["type"], "error");
    assert_eq!(err["error"]["code"], "item_not_found");
    assert_eq!(err["error"]["event_id"], "evt_1");

    // Errors keep the session: unknown events, audio buffers, bad JSON.
    for (frame, code) in [
        (
            json!({"type": "session.frobnicate"}).to_string(),
            "unknown_event",
        ),
        (
            json!({"type": "input_audio_buffer.append", "audio": "AAAA"}).to_string(),
            "unsupported_parameter",
        ),
        ("{oops".to_string(), "invalid_json"),
    ] {
        c.send_text(&frame).await;
        let e = c.next().await.unwrap();
        assert_eq!(
            (e["type"].as_str(), e["error"]["code"].as_str()),
            (Some("error"), Some(code)),
            "{frame}"
        );
    }

    // Cancel a long response mid-stream.
    c.send(&json!({"type": "response.create", "response": {"max_output_tokens": 2000}}))
        .await;
    let created = c.next().await.unwrap();
    assert_eq!(created["type"], "response.created");
    c.send(&json!({"type": "response.cancel"})).await;
    let done = loop {
        let ev = c.next().await.unwrap();
        if ev["type"] == "response.done" {
            break ev;
        }
    };
    let status = done["response"]["status"].as_str().unwrap();
    assert!(status == "cancelled" || status == "completed", "{done}");
    if status == "cancelled" {
        assert_eq!(
            done["response"]["status_details"]["reason"],
            "client_cancelled"
        );
    }
    drop(c);
    server.wait_engine_idle().await;
    server.shutdown().await.unwrap();
}

/// Model names with a `/` (a Hugging Face repo id as `--served-model-name`)
/// reach the Realtime route percent-encoded, as the OpenAI SDKs send them,
/// or raw; another name is 404 `model_not_found` and a value that is not
/// UTF-8 once decoded 400 `invalid_value`, both before the upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn realtime_model_names_are_percent_decoded() {
    let dir = caracal::convert::synth::default_model_dir().expect("the default model is made");
    let server = start_served(
        &dir,
        "moonshotai/Kimi-K3 tiny",
        Default::default(),
        Default::default(),
        None,
    )
    .await;
    for path in [
        "/v1/realtime?model=moonshotai%2FKimi-K3+tiny",
        "/v1/realtime?model=moonshotai/Kimi-K3%20tiny",
    ] {
        let mut c = WsClient::connect(server.addr, path).await;
        let created = c.next().await.unwrap();
        assert_eq!(created["type"], "session.created", "{path}");
    }
    for (query, status, code) in [
        ("model=moonshotai%2Fother", 404, "model_not_found"),
        ("model=%FF%FE", 400, "invalid_value"),
    ] {
        let url = format!("ws://{}/v1/realtime?{query}", server.addr);
        match tokio_tungstenite::connect_async(url).await {
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                assert_eq!(resp.status(), status, "{query}");
                let body: serde_json::Value =
                    serde_json::from_slice(resp.body().as_deref().unwrap_or_default()).unwrap();
                assert_eq!(body["error"]["code"], code, "{query}: {body}");
                assert_eq!(body["error"]["param"], "model", "{query}: {body}");
            }
            other => panic!("{query}: expected an HTTP error, got {other:?}"),
        }
    }
    // The server keeps serving after the refusals.
    let mut c =
        WsClient::connect(server.addr, "/v1/realtime?model=moonshotai%2FKimi-K3+tiny").await;
    assert_eq!(c.next().await.unwrap()["type"], "session.created");
}
