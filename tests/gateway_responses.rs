//! The Responses API over HTTP on real sockets with tiny-llama: the JSON
//! object, the SSE event order the SDK's accumulator enforces, chaining by
//! `previous_response_id` with cached prompt tokens, the store (retrieve,
//! delete, `store: false`), replayed tool items, and cancellation.

mod common;
mod gateway_support;

use gateway_support::*;
use serde_json::{json, Value};

fn body(input: Value) -> Value {
    json!({ "input": input, "max_output_tokens": 6, "temperature": 0,
           "instructions": "You are a terse assistant."})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_responses_chain_by_previous_response_id_and_live_in_the_store() {
    let server = start_llama().await;
    let a = server.addr;
    let (status, first) = json(a, "POST", "/v1/responses", &body(json!("Hello there"))).await;
    assert_eq!(status, 200, "{first}");
    for key in [
        "id",
        "object",
        "created_at",
        "model",
        "output",
        "parallel_tool_calls",
        "tool_choice",
        "tools",
        "status",
        "usage",
        "store",
        "instructions",
        "text",
        "truncation",
    ] {
        assert!(first.get(key).is_some(), "response lacks {key}: {first}");
    }
    assert_eq!(first["object"], "response");
    assert!(first["id"].as_str().unwrap().starts_with("resp_"));
    assert!(["completed", "incomplete"].contains(&first["status"].as_str().unwrap()));
    let usage = &first["usage"];
    assert_eq!(usage["output_tokens"], 6);
    assert!(usage["input_tokens_details"]["cached_tokens"].is_u64());
    assert!(usage["output_tokens_details"]["reasoning_tokens"].is_u64());
    let id = first["id"].as_str().unwrap();

    let mut next = body(json!([{"role": "user", "content": "And then?"}]));
    next["previous_response_id"] = json!(id);
    let (status, second) = json(a, "POST", "/v1/responses", &next).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["previous_response_id"], id);
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let first_prompt = first["usage"]["input_tokens"].as_u64().unwrap();
    assert!(
        cached >= first_prompt / 16 * 16,
        "the second turn reuses the first turn's prompt: {cached} cached, first prompt {first_prompt}"
    );
    assert!(second["usage"]["input_tokens"].as_u64().unwrap() > first_prompt);

    let (status, got) = json(a, "GET", &format!("/v1/responses/{id}"), &Value::Null).await;
    assert_eq!(status, 200);
    assert_eq!(got["id"], id);
    assert_eq!(got["output"], first["output"]);
    let (status, del) = json(a, "DELETE", &format!("/v1/responses/{id}"), &Value::Null).await;
    assert_eq!((status, del["deleted"].as_bool()), (200, Some(true)));
    let (status, err) = json(a, "GET", &format!("/v1/responses/{id}"), &Value::Null).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (404, Some("response_not_found"))
    );
    let (status, err) = json(a, "POST", "/v1/responses", &next).await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["code"], "previous_response_not_found");
    assert_eq!(err["error"]["param"], "previous_response_id");
    assert_eq!(
        err["error"]["message"],
        format!("Previous response with id '{id}' not found.")
    );

    let mut unstored = body(json!("Hi"));
    unstored["store"] = json!(false);
    let (_, r) = json(a, "POST", "/v1/responses", &unstored).await;
    let (status, _) = json(
        a,
        "GET",
        &format!("/v1/responses/{}", r["id"].as_str().unwrap()),
        &Value::Null,
    )
    .await;
    assert_eq!(status, 404, "store: false is not kept");
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_events_follow_the_order_the_sdk_checks() {
    let server = start_llama().await;
    let mut b = body(json!("Hello there"));
    b["stream"] = json!(true);
    let events = sse(server.addr, "/v1/responses", &b).await;
    assert_eq!(events[0]["type"], "response.created");
    assert_eq!(events[1]["type"], "response.in_progress");
    let id = events[0]["response"]["id"].clone();
    let mut added = std::collections::HashMap::new();
    let mut parts = std::collections::HashSet::new();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64, "{e}");
        if let Some(r) = e.get("response") {
            assert_eq!(r["id"], id, "lifecycle identity");
        }
        let t = e["type"].as_str().unwrap();
        match t {
            "response.output_item.added" => {
                assert!(added
                    .insert(e["output_index"].as_u64().unwrap(), e["item"]["id"].clone())
                    .is_none());
            }
            "response.content_part.added" => {
                assert!(added.contains_key(&e["output_index"].as_u64().unwrap()));
                parts.insert((
                    e["output_index"].as_u64().unwrap(),
                    e["content_index"].as_u64().unwrap(),
                ));
            }
            "response.output_text.delta" | "response.reasoning_text.delta" => {
                assert!(parts.contains(&(
                    e["output_index"].as_u64().unwrap(),
                    e["content_index"].as_u64().unwrap()
                )));
                if t == "response.output_text.delta" {
                    assert_eq!(e["logprobs"], json!([]));
                }
            }
            "response.output_item.done" => {
                assert_eq!(
                    added[&e["output_index"].as_u64().unwrap()],
                    e["item"]["id"],
                    "item identity"
                );
            }
            _ => {}
        }
    }
    let last = events.last().unwrap();
    assert!(["response.completed", "response.incomplete"].contains(&last["type"].as_str().unwrap()));
    let output = last["response"]["output"].as_array().unwrap();
    assert_eq!(
        output.len(),
        added.len(),
        "every added item is in the final output"
    );
    assert_eq!(last["response"]["usage"]["output_tokens"], 6);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_tool_items_are_accepted_and_bad_items_get_stable_errors() {
    // Tool declarations need more context than tiny-llama's 256 tokens.
    let server = start_default(Default::default()).await;
    let a = server.addr;
    let tools = json!([{"type": "function", "name": "read_file", "description": "Read a file",
                        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]);
    let mut b = body(json!([
        {"role": "user", "content": [{"type": "input_text", "text": "Open main.rs"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "need the file"}]},
        {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": "{\"path\":\"main.rs\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "fn main() {}"},
    ]));
    b["tools"] = tools.clone();
    let (status, r) = json(a, "POST", "/v1/responses", &b).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["tools"], tools);
    let cases = vec![
        (
            json!([{"type": "function_call_output", "output": "x"}]),
            "missing_required_parameter",
            "input[0].call_id",
        ),
        (
            json!([{"type": "mystery"}]),
            "invalid_value",
            "input[0].type",
        ),
        (
            // The default model takes images: one zero byte is no image format.
            json!([{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]),
            "image_unknown_format",
            "messages[0].content[0]",
        ),
        (json!(42), "invalid_type", "input"),
    ];
    for (input, code, param) in cases {
        let (status, err) = json(a, "POST", "/v1/responses", &body(input.clone())).await;
        assert_eq!(status, 400, "{input}: {err}");
        assert_eq!(err["error"]["code"], code, "{input}: {err}");
        assert_eq!(err["error"]["param"], param, "{input}: {err}");
    }
    let mut bad_choice = body(json!("hi"));
    bad_choice["tools"] = tools;
    bad_choice["tool_choice"] = json!({"type": "function", "name": "write_file"});
    let (status, err) = json(a, "POST", "/v1/responses", &bad_choice).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (400, Some("unknown_tool"))
    );
    let (status, err) = json(a, "GET", "/v1/responses", &Value::Null).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (426, Some("upgrade_required"))
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_streaming_response_and_frees_its_sequence() {
    let server = start_llama().await;
    let a = server.addr;
    let mut b = body(json!("Tell me everything"));
    b["stream"] = json!(true);
    b["max_output_tokens"] = json!(220);
    b["ignore_eos"] = json!(true);
    let mut reader = SseReader::open(a, "/v1/responses", &b).await;
    let created = reader.next().await.unwrap();
    let id = created["response"]["id"].as_str().unwrap().to_string();
    let (status, cancelled) = json(
        a,
        "POST",
        &format!("/v1/responses/{id}/cancel"),
        &Value::Null,
    )
    .await;
    // The stream may have finished before the cancel arrived; then it is no longer cancellable.
    if status == 200 {
        assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
        assert_eq!(cancelled["id"], id.as_str());
        let (rest, _) = reader.all().await;
        let last = rest.last().unwrap();
        assert_eq!(last["response"]["status"], "cancelled");
    } else {
        assert_eq!(
            cancelled["error"]["code"], "response_not_cancellable",
            "{cancelled}"
        );
    }
    server.wait_engine_idle().await;
    let (status, err) = json(a, "POST", "/v1/responses/resp_nope/cancel", &Value::Null).await;
    assert_eq!(
        (status, err["error"]["code"].as_str()),
        (404, Some("response_not_found"))
    );
    server.shutdown().await.unwrap();
}
