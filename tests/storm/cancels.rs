//! The cancel storm: Responses cancelled by id from another connection,
//! Realtime `response.cancel` mid-stream, and WebSocket sessions closed or
//! dropped right after `response.create`.

use super::wire::{self, Sse, WsNext};
use crate::{long_prompt, storm, Storm, MODEL};
use serde_json::{json, Value};
use std::time::Duration;

#[test]
fn cancel_storms_end_every_response_and_leak_nothing() {
    storm(600, || async {
        let mut s = Storm::start(&["--max-running-requests", "16"]).await;
        let addr = s.addr;
        // Responses over SSE, cancelled by id from another connection.
        let http: Vec<_> = (0..40)
            .map(|i| {
                tokio::spawn(async move {
                    let body = json!({"input": format!("Write essay {i}"), "stream": true,
                                      "max_output_tokens": 400, "ignore_eos": true});
                    let mut sse = Sse::open(addr, "/v1/responses", &body)
                        .await
                        .expect("connect")
                        .expect("the stream opens");
                    let first = sse.next().await.expect("SSE").expect("response.created");
                    assert_eq!(first["type"], "response.created");
                    let id = first["response"]["id"].as_str().expect("an id").to_string();
                    let mut deltas = 0;
                    while deltas < i % 6 {
                        let v = sse.next().await.expect("SSE").expect("an event");
                        if v["type"].as_str().is_some_and(|t| t.ends_with(".delta")) {
                            deltas += 1;
                        }
                    }
                    let r =
                        wire::call(addr, "POST", &format!("/v1/responses/{id}/cancel"), None).await;
                    assert_eq!(r.status, 200, "cancel answers: {:?}", r.json());
                    assert_eq!(r.json()["status"], "cancelled");
                    let mut last = Value::Null;
                    while let Some(v) = sse.next().await.expect("SSE") {
                        last = v;
                    }
                    assert!(sse.done, "the stream ends with [DONE]");
                    assert_eq!(last["type"], "response.incomplete", "{last}");
                    assert_eq!(last["response"]["status"], "cancelled", "{last}");
                    // A cancelled response is no longer cancellable.
                    let again =
                        wire::call(addr, "POST", &format!("/v1/responses/{id}/cancel"), None).await;
                    assert!(matches!(again.status, 400 | 404), "{:?}", again.json());
                })
            })
            .collect();
        // Realtime: response.cancel mid-stream, then the session serves another response.
        let realtime: Vec<_> = (0..40)
            .map(|i| {
                tokio::spawn(async move {
                    let mut ws = wire::ws(addr, &format!("/v1/realtime?model={MODEL}"))
                        .await
                        .expect("upgrade");
                    let item = json!({"type": "conversation.item.create", "item": {"type": "message",
                        "role": "user", "content": [{"type": "input_text", "text": format!("Hi {i}")}]}});
                    wire::ws_send(&mut ws, &item).await.expect("send");
                    let create = json!({"type": "response.create", "response": {"max_output_tokens": 400}});
                    wire::ws_send(&mut ws, &create).await.expect("send");
                    loop {
                        match wire::ws_next(&mut ws).await {
                            WsNext::Event(v) if v["type"] == "response.created" => break,
                            WsNext::Event(_) => {}
                            other => panic!("the session ended: {other:?}"),
                        }
                    }
                    // The model thinks first (no events): cancel after a while.
                    tokio::time::sleep(Duration::from_millis(100 * (i % 5) as u64)).await;
                    wire::ws_send(&mut ws, &json!({"type": "response.cancel"}))
                        .await
                        .expect("send");
                    let done = loop {
                        match wire::ws_next(&mut ws).await {
                            WsNext::Event(v) if v["type"] == "response.done" => break v,
                            WsNext::Event(v) if v["type"] == "error" => panic!("{v}"),
                            WsNext::Event(_) => {}
                            other => panic!("the session ended: {other:?}"),
                        }
                    };
                    assert_eq!(done["response"]["status"], "cancelled", "{done}");
                    let short = json!({"type": "response.create", "response": {"max_output_tokens": 3}});
                    wire::ws_send(&mut ws, &short).await.expect("send");
                    loop {
                        match wire::ws_next(&mut ws).await {
                            WsNext::Event(v) if v["type"] == "response.done" => {
                                assert_ne!(v["response"]["status"], "cancelled", "{v}");
                                break;
                            }
                            WsNext::Event(v) if v["type"] == "error" => panic!("{v}"),
                            WsNext::Event(_) => {}
                            other => panic!("the session ended: {other:?}"),
                        }
                    }
                    let _ = ws.close(None).await;
                })
            })
            .collect();
        // Responses WebSocket mode: close (or drop) right after response.create.
        let closing: Vec<_> = (0..60)
            .map(|i| {
                tokio::spawn(async move {
                    let mut ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
                    let mut create = json!({"type": "response.create", "input": long_prompt(i, 20 + 10 * (i % 8)),
                                            "max_output_tokens": 400, "store": false});
                    if i % 3 == 0 {
                        create["generate"] = json!(false);
                    }
                    wire::ws_send(&mut ws, &create).await.expect("send");
                    if i % 5 == 1 {
                        // A second lane, queued behind nothing.
                        create["stream_id"] = json!("lane.b");
                        wire::ws_send(&mut ws, &create).await.expect("send");
                    }
                    if i % 2 == 0 {
                        let _ = ws.close(None).await;
                    }
                })
            })
            .collect();
        for t in http.into_iter().chain(realtime).chain(closing) {
            t.await.expect("a client");
        }
        eprintln!("cancel storm: 40 HTTP cancels, 40 Realtime response.cancel, 60 closes right after response.create");
        let m = s.settle("cancel storm").await;
        assert!(
            m["caracal_cancelled_total"] >= 80.0,
            "every cancel counted: {}",
            m["caracal_cancelled_total"]
        );
    });
}

/// A Responses WebSocket session that ends while its lanes are still
/// preparing and submitting their requests must leave no pinned path: a
/// request submitted after the session's close would otherwise prefill and
/// pin the session again until the session TTL (10 min), past `settle`'s
/// deadline. The prompts share a long cached prefix, so each lane spends
/// its time rendering and tokenizing (where a hang-up can land) and then
/// prefills its few new tokens in one step.
#[test]
fn sessions_that_end_while_their_lanes_submit_leave_no_pin() {
    storm(600, || async {
        let mut s =
            Storm::start(&["--max-sessions", "512", "--max-waiting-requests", "1024"]).await;
        let addr = s.addr;
        let prefix = long_prompt(0, 1200);
        let warm = json!({"input": prefix.clone(), "max_output_tokens": 1, "store": false});
        let r = wire::call(addr, "POST", "/v1/responses", Some(&warm)).await;
        assert_eq!(r.status, 200, "{:?}", r.json());
        const SESSIONS: usize = 240;
        const LANES: usize = 4;
        let tasks: Vec<_> = (0..SESSIONS)
            .map(|i| {
                let prefix = prefix.clone();
                tokio::spawn(async move {
                    let mut ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
                    for lane in 0..LANES {
                        let create = json!({"type": "response.create", "store": false,
                            "input": format!("{prefix} Session {i} lane {lane}."), "stream_id": format!("l{lane}"),
                            "generate": false});
                        wire::ws_send(&mut ws, &create).await.expect("send");
                    }
                    // Hang up at once or a few milliseconds later, while the
                    // lanes render, tokenize and submit.
                    let delay = (i % 8) as u64;
                    if delay > 0 {
                        tokio::time::sleep(Duration::from_millis(delay)).await;
                    }
                    if i % 2 == 0 {
                        let _ = ws.close(None).await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("a client");
        }
        eprintln!("lane race: {SESSIONS} sessions of {LANES} lanes each hung up mid-submit");
        s.settle("sessions ended mid-submit").await;
    });
}
