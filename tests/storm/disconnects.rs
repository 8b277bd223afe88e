//! The disconnect storm: hundreds of clients that hang up mid-prefill,
//! mid-decode and mid-tool-call over chat and Responses SSE, the Responses
//! WebSocket mode and Realtime, or never read a non-streaming answer.

use super::wire::{self, Sse, WsNext};
use crate::{long_prompt, read_file_tool, storm, Storm, MODEL};
use caracal_kernels::testing::Rng;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Where a client of the disconnect storm hung up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Cut {
    /// Before any token came (the prompt was still prefilling, or waiting).
    BeforeFirstToken,
    /// While tokens streamed.
    MidDecode,
    /// While a tool call's arguments streamed.
    MidToolCall,
    /// It finished before its cut point.
    Finished,
    /// A non-streaming request, hung up after a delay without reading.
    Unread,
}

/// Whether a chat chunk carries tool-call arguments.
fn has_arguments(v: &Value) -> bool {
    v["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .is_some_and(|a| !a.is_empty())
}

/// Opens an SSE stream of `body` on `path`, reads `frames` events (or to the end)
/// and hangs up: [`Cut::Finished`] when the stream had ended, else [`Cut::MidDecode`].
async fn hang_up_after(addr: SocketAddr, path: &str, body: &Value, frames: usize) -> Cut {
    let mut sse = Sse::open(addr, path, body)
        .await
        .expect("connect")
        .expect("the stream opens");
    let mut n = 0;
    while n < frames {
        match sse.next().await.expect("SSE frames") {
            Some(_) => n += 1,
            None => break,
        }
    }
    if sse.done {
        Cut::Finished
    } else {
        Cut::MidDecode
    }
}

/// One client of the disconnect storm: kind `i % 7`, cut at a random point.
async fn disconnecting_client(addr: SocketAddr, i: usize, seed: u64) -> (usize, Cut) {
    let mut rng = Rng::seeded(seed);
    let k = 1 + (rng.next_u64() % 12) as usize;
    let kind = i % 7;
    let cut = match kind {
        // Mid-prefill: a long prompt (chunked prefill takes many steps), hung up after a delay.
        0 => {
            let body = json!({"messages": [{"role": "user", "content": long_prompt(i, 200)}],
                              "max_tokens": 200, "stream": true});
            let mut sse = Sse::open(addr, "/v1/chat/completions", &body)
                .await
                .expect("connect")
                .expect("the stream opens");
            let delay = Duration::from_millis(20 + rng.next_u64() % 600);
            let mut tokens = 0;
            let _ = tokio::time::timeout(delay, async {
                while let Ok(Some(v)) = sse.next().await {
                    if v["choices"][0]["delta"].get("role").is_none() {
                        tokens += 1;
                    }
                }
            })
            .await;
            if sse.done {
                Cut::Finished
            } else if tokens == 0 {
                Cut::BeforeFirstToken
            } else {
                Cut::MidDecode
            }
        }
        // Mid-decode over chat SSE.
        1 => {
            let body = json!({"messages": [{"role": "user", "content": format!("Tell story {i}")}],
                              "max_tokens": 300, "stream": true, "ignore_eos": true});
            hang_up_after(addr, "/v1/chat/completions", &body, k + 1).await
        }
        // Mid-tool-call: required tool, arguments streaming.
        2 => {
            let body = json!({"messages": [{"role": "user", "content": format!("Open file {i}")}],
                              "tools": [read_file_tool(false)], "tool_choice": "required",
                              "reasoning_effort": "none", "max_tokens": 200, "stream": true});
            let mut sse = Sse::open(addr, "/v1/chat/completions", &body)
                .await
                .expect("connect")
                .expect("the stream opens");
            let extra = k % 4;
            let mut args = 0;
            let mut cut = Cut::Finished;
            while let Some(v) = sse.next().await.expect("SSE frames") {
                if has_arguments(&v) {
                    args += 1;
                    if args > extra {
                        cut = Cut::MidToolCall;
                        break;
                    }
                }
            }
            cut
        }
        // Responses over SSE, mid-decode.
        3 => {
            let body = json!({"input": format!("Explain topic {i}"), "stream": true,
                              "max_output_tokens": 300, "ignore_eos": true, "store": false});
            hang_up_after(addr, "/v1/responses", &body, k + 4).await
        }
        // Responses WebSocket mode: a tool call or text; half close cleanly, half just drop.
        4 => {
            let mut ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
            let mut create = json!({"type": "response.create", "input": format!("Work item {i}"),
                                    "max_output_tokens": 300, "store": false, "ignore_eos": true});
            let tools = i % 12 == 4;
            if tools {
                create["tools"] = json!([read_file_tool(true)]);
                create["tool_choice"] = json!("required");
                create["reasoning"] = json!({"effort": "none"});
                create
                    .as_object_mut()
                    .expect("an object")
                    .remove("ignore_eos");
            }
            wire::ws_send(&mut ws, &create).await.expect("send");
            let mut n = 0;
            let mut cut = Cut::Finished;
            loop {
                match wire::ws_next(&mut ws).await {
                    WsNext::Event(v) => {
                        let t = v["type"].as_str().unwrap_or("");
                        if t == "response.completed" || t == "response.incomplete" {
                            break;
                        }
                        let counts = if tools {
                            t == "response.function_call_arguments.delta"
                        } else {
                            t.ends_with(".delta")
                        };
                        if counts {
                            n += 1;
                            if n > k % 8 {
                                cut = if tools {
                                    Cut::MidToolCall
                                } else {
                                    Cut::MidDecode
                                };
                                break;
                            }
                        }
                    }
                    other => panic!("the session ended early: {other:?}"),
                }
            }
            if i.is_multiple_of(2) {
                let _ = ws.close(None).await;
            }
            cut
        }
        // Chat without streaming: hung up while the answer is being made.
        6 => {
            let body = json!({"messages": [{"role": "user", "content": long_prompt(i, 20 * k)}],
                              "max_tokens": 300, "ignore_eos": true});
            let mut c = wire::connect(addr, None).await.expect("connect");
            let bytes = serde_json::to_vec(&body).expect("JSON");
            c.write_all(&wire::request("POST", "/v1/chat/completions", Some(&bytes)))
                .await
                .expect("write");
            tokio::time::sleep(Duration::from_millis(50 * k as u64)).await;
            drop(c);
            Cut::Unread
        }
        // Realtime, mid-decode: hung up a while after response.created (the
        // model thinks first, and Realtime streams no reasoning events).
        _ => {
            let mut ws = wire::ws(addr, &format!("/v1/realtime?model={MODEL}"))
                .await
                .expect("upgrade");
            let item = json!({"type": "conversation.item.create", "item": {"type": "message",
                "role": "user", "content": [{"type": "input_text", "text": format!("Hello {i}")}]}});
            wire::ws_send(&mut ws, &item).await.expect("send");
            wire::ws_send(
                &mut ws,
                &json!({"type": "response.create", "response": {"max_output_tokens": 60}}),
            )
            .await
            .expect("send");
            loop {
                match wire::ws_next(&mut ws).await {
                    WsNext::Event(v) if v["type"] == "response.created" => break,
                    WsNext::Event(_) => {}
                    other => panic!("the session ended early: {other:?}"),
                }
            }
            let delay = Duration::from_millis(30 * k as u64);
            let done = tokio::time::timeout(delay, async {
                loop {
                    match wire::ws_next(&mut ws).await {
                        WsNext::Event(v) if v["type"] == "response.done" => return,
                        WsNext::Event(_) => {}
                        other => panic!("the session ended early: {other:?}"),
                    }
                }
            })
            .await;
            if done.is_ok() {
                Cut::Finished
            } else {
                Cut::MidDecode
            }
        }
    };
    (kind, cut)
}

#[test]
fn clients_that_hang_up_at_random_points_leak_nothing() {
    storm(600, || async {
        let mut s = Storm::start(&[
            "--max-running-requests",
            "16",
            "--max-waiting-requests",
            "256",
            "--chunked-prefill-size",
            "64",
        ])
        .await;
        let addr = s.addr;
        const CLIENTS: usize = 200;
        let tasks: Vec<_> = (0..CLIENTS)
            .map(|i| tokio::spawn(disconnecting_client(addr, i, 0x5707 + i as u64)))
            .collect();
        let mut counts: HashMap<(usize, Cut), usize> = HashMap::new();
        for t in tasks {
            let (kind, cut) = t.await.expect("a client task");
            *counts.entry((kind, cut)).or_default() += 1;
        }
        let mut lines: Vec<String> = counts
            .iter()
            .map(|((k, c), n)| format!("kind {k} {c:?}: {n}"))
            .collect();
        lines.sort();
        eprintln!(
            "disconnect storm, {CLIENTS} clients:\n  {}",
            lines.join("\n  ")
        );
        let at = |cut: Cut| {
            counts
                .iter()
                .filter(|((_, c), _)| *c == cut)
                .map(|(_, n)| n)
                .sum::<usize>()
        };
        assert!(
            at(Cut::BeforeFirstToken) > 0,
            "some clients hung up mid-prefill"
        );
        assert!(at(Cut::MidDecode) > 0, "some clients hung up mid-decode");
        assert!(
            at(Cut::MidToolCall) > 0,
            "some clients hung up mid-tool-call"
        );
        let m = s.settle("disconnect storm").await;
        assert!(
            m["caracal_cancelled_total"] > 0.0,
            "the hang-ups were seen as cancellations"
        );
    });
}
