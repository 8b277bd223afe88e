//! A flood past `--max-running-requests`, `--max-waiting-requests` and
//! `--max-sessions`: refused with `Retry-After`, never queued without bound.

use super::wire::{self, WsNext};
use crate::{read_file_tool, storm, Storm};
use serde_json::{json, Value};
use std::time::Duration;

#[test]
fn a_flood_past_every_limit_is_refused_with_retry_after_never_queued() {
    storm(600, || async {
        let mut s = Storm::start(&[
            "--max-running-requests",
            "2",
            "--max-waiting-requests",
            "4",
            "--max-sessions",
            "8",
        ])
        .await;
        let addr = s.addr;
        // Watch the queues while the flood runs.
        let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
        let watcher = tokio::spawn(async move {
            let (mut queue, mut running) = (0f64, 0f64);
            loop {
                let m = wire::metrics(addr).await;
                queue = queue.max(m["caracal_queue_length"]);
                running = running.max(m["caracal_running_sequences"]);
                tokio::select! {
                    _ = &mut stop_rx => return (queue, running),
                    _ = tokio::time::sleep(Duration::from_millis(30)) => {}
                }
            }
        });
        const FLOOD: usize = 120;
        let tasks: Vec<_> = (0..FLOOD)
            .map(|i| {
                tokio::spawn(async move {
                    let msg = json!([{"role": "user", "content": format!("Flood {i}")}]);
                    let (path, body) = match i % 4 {
                        0 => ("/v1/chat/completions", json!({"messages": msg, "max_tokens": 24, "ignore_eos": true})),
                        1 => ("/v1/chat/completions", json!({"messages": msg, "max_tokens": 24, "ignore_eos": true, "stream": true})),
                        2 => ("/v1/responses", json!({"input": format!("Flood {i}"), "max_output_tokens": 24, "ignore_eos": true, "stream": true, "store": false})),
                        _ => ("/v1/chat/completions", json!({"messages": msg, "max_tokens": 24, "tools": [read_file_tool(false)],
                                                           "tool_choice": "required", "reasoning_effort": "none"})),
                    };
                    let r = wire::call(addr, "POST", path, Some(&body)).await;
                    (i % 4, r)
                })
            })
            .collect();
        let mut ok = [0usize; 4];
        let mut refused = [0usize; 4];
        for t in tasks {
            let (kind, r) = t.await.expect("a client");
            match r.status {
                200 => {
                    if kind == 1 || kind == 2 {
                        let text = String::from_utf8_lossy(&r.body);
                        assert!(text.contains("data: [DONE]"), "the stream ends: {text}");
                    }
                    ok[kind] += 1;
                }
                503 => {
                    assert_eq!(r.json()["error"]["code"], "overloaded", "{:?}", r.json());
                    assert_eq!(
                        r.header("retry-after"),
                        Some("1"),
                        "503 overloaded carries Retry-After"
                    );
                    refused[kind] += 1;
                }
                other => panic!("a flood request got {other}: {:?}", r.json()),
            }
        }
        let _ = stop_tx.send(());
        let (max_queue, max_running) = watcher.await.expect("the watcher");
        eprintln!(
            "HTTP flood of {FLOOD}: served {ok:?}, refused 503 overloaded {refused:?} (chat, chat SSE, Responses SSE, chat+tools); \
             queue peaked at {max_queue}, running at {max_running}"
        );
        assert!(
            refused.iter().sum::<usize>() > 0,
            "a flood past the limits is refused"
        );
        assert!(
            ok.iter().sum::<usize>() >= 2,
            "the requests that fit are served"
        );
        assert!(max_queue <= 4.0 && max_running <= 2.0, "the limits hold");

        // WebSocket: more upgrades than --max-sessions.
        let upgrades: Vec<_> = (0..30)
            .map(|_| tokio::spawn(async move { wire::ws(addr, "/v1/responses").await }))
            .collect();
        let mut sessions = Vec::new();
        let mut too_many = 0;
        for t in upgrades {
            match t.await.expect("a client") {
                Ok(ws) => sessions.push(ws),
                Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                    assert_eq!(resp.status(), 429);
                    assert_eq!(
                        resp.headers()
                            .get("retry-after")
                            .and_then(|v| v.to_str().ok()),
                        Some("1"),
                        "429 carries Retry-After"
                    );
                    let body: Value =
                        serde_json::from_slice(resp.body().as_deref().unwrap_or_default())
                            .expect("a JSON error");
                    assert_eq!(body["error"]["code"], "websocket_connection_limit_reached");
                    too_many += 1;
                }
                Err(e) => panic!("an upgrade failed: {e}"),
            }
        }
        assert_eq!(
            (sessions.len(), too_many),
            (8, 22),
            "8 sessions fit, the rest get 429"
        );
        // In-session overload: every session opens 3 lanes at once
        // (24 requests for 6 engine slots): each ends, served or refused.
        for ws in &mut sessions {
            for lane in ["a", "b", "c"] {
                let create = json!({"type": "response.create", "input": "go", "max_output_tokens": 16,
                                    "ignore_eos": true, "store": false, "stream_id": lane});
                wire::ws_send(ws, &create).await.expect("send");
            }
        }
        let (mut served, mut overloaded) = (0, 0);
        for ws in &mut sessions {
            let mut ended = 0;
            while ended < 3 {
                match wire::ws_next(ws).await {
                    WsNext::Event(v) => match v["type"].as_str().unwrap_or("") {
                        "response.completed" | "response.incomplete" => {
                            served += 1;
                            ended += 1;
                        }
                        "error" => {
                            assert_eq!(v["error"]["code"], "overloaded", "{v}");
                            overloaded += 1;
                            ended += 1;
                        }
                        "response.failed" => {
                            assert_eq!(v["response"]["error"]["code"], "overloaded", "{v}");
                            overloaded += 1;
                            ended += 1;
                        }
                        _ => {}
                    },
                    other => panic!("the session ended: {other:?}"),
                }
            }
        }
        eprintln!("WebSocket flood: 8 sessions, 22 upgrades refused with 429; 24 lane requests: {served} served, {overloaded} overloaded");
        assert!(
            overloaded > 0,
            "in-session requests past the engine's limits are refused"
        );
        for mut ws in sessions {
            let _ = ws.close(None).await;
        }
        s.settle("overload flood").await;
    });
}
