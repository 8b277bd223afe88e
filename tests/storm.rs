//! Fault storms over real sockets against the real `caracal serve` binary
//! (the built-in tiny Kimi K3, small limits, loopback only): hundreds of
//! clients that hang up mid-prefill, mid-decode and mid-tool-call over SSE,
//! the Responses WebSocket mode and Realtime; cancel storms; slow readers;
//! half-open sockets and 1,000 idle connections; oversize and fragmented
//! frames; a flood past the engine's and the sessions' limits.
//!
//! After every storm the server must be back where it started, read from
//! `/metrics`: no sequence running or waiting, no WebSocket session open or
//! pinned, no KV page outside the prefix cache and no cached page locked,
//! no panic caught, the scheduler thread up, no descriptor left open — and
//! it must answer a normal greedy request with the same text as before the
//! storm, in a forward step of its own (the scheduler still steps).
//!
//! Each storm is bounded in clients and in time (every wait has a deadline
//! that counts as a hang), and the storms run one at a time (a lock), since
//! each one is sized for the machine to itself.

mod common;
mod storm {
    pub mod wire;
}

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use caracal_kernels::testing::Rng;
use common::serve::ServeProcess;
use futures::SinkExt;
use serde_json::{json, Value};
use storm::wire::{self, Sse, WsNext};
use tokio::io::AsyncWriteExt;
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::Message;

/// One storm at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// The model the default server serves (Realtime names it in the URL).
const MODEL: &str = "kimi-k3-tiny";

/// A multi-threaded runtime for the clients.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// A server for one storm, with what it looked like before the storm.
struct Storm {
    /// The process.
    server: ServeProcess,
    /// Where it listens.
    addr: SocketAddr,
    /// The greedy answer to [`normal_request`] before the storm.
    reference: Value,
    /// Open descriptors once started and warmed up.
    fds: usize,
}

/// A short greedy chat request whose answer must not change.
fn normal_request() -> Value {
    json!({"messages": [{"role": "user", "content": "Name three colours."}],
           "max_tokens": 12, "temperature": 0, "reasoning_effort": "none"})
}

/// The parts of a chat answer that must be equal across storms.
async fn normal_answer(addr: SocketAddr) -> Value {
    let r = wire::call(addr, "POST", "/v1/chat/completions", Some(&normal_request())).await;
    assert_eq!(r.status, 200, "a normal request is served: {:?}", r.json());
    let v = r.json();
    let c = &v["choices"][0];
    json!({"content": c["message"]["content"], "finish": c["finish_reason"],
           "tokens": v["usage"]["completion_tokens"]})
}

impl Storm {
    /// Starts `caracal serve` with `args` and takes the reference answer
    /// (twice: the second comes from the prefix cache, as later ones will).
    async fn start(args: &[&str]) -> Storm {
        let server = ServeProcess::start(args, 600);
        let addr: SocketAddr = format!("127.0.0.1:{}", server.port).parse().expect("an address");
        let first = normal_answer(addr).await;
        let reference = normal_answer(addr).await;
        assert_eq!(first, reference, "a cached prompt answers as a fresh one");
        assert_eq!(reference["tokens"], 12, "{reference}");
        let fds = wire::open_fds(server.child.id());
        let mut s = Storm {
            server,
            addr,
            reference,
            fds,
        };
        s.settle("startup").await;
        s
    }

    /// Waits until the engine and the gateway are back at their baseline,
    /// then checks the server answers as before. Returns the metrics.
    async fn settle(&mut self, storm: &str) -> HashMap<String, f64> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let pid = self.server.child.id();
        let mut last = HashMap::new();
        let mut fds = 0;
        loop {
            let m = wire::metrics(self.addr).await;
            let g = |k: &str| m.get(k).copied().unwrap_or(-1.0);
            fds = wire::open_fds(pid);
            let ok = g("caracal_engine_up") == 1.0
                && g("caracal_running_sequences") == 0.0
                && g("caracal_queue_length") == 0.0
                && g("caracal_sessions") == 0.0
                && g("caracal_pinned_sessions") == 0.0
                && g("caracal_kv_pages_locked") == 0.0
                && g("caracal_kv_pages_used") == g("caracal_kv_pages_cached")
                && fds <= self.fds + 2;
            assert_eq!(g("caracal_panics_total"), 0.0, "{storm}: a panic was caught");
            last = m;
            if ok {
                break;
            }
            if Instant::now() > deadline {
                let keys = [
                    "caracal_engine_up",
                    "caracal_running_sequences",
                    "caracal_queue_length",
                    "caracal_sessions",
                    "caracal_pinned_sessions",
                    "caracal_kv_pages_locked",
                    "caracal_kv_pages_used",
                    "caracal_kv_pages_cached",
                ];
                let seen: Vec<String> = keys
                    .iter()
                    .map(|k| format!("{k}={}", last.get(*k).copied().unwrap_or(-1.0)))
                    .collect();
                panic!(
                    "{storm}: the server did not return to its baseline in 60 s: {} fds={fds} (baseline {})\n{}",
                    seen.join(" "),
                    self.fds,
                    self.server.drain_log()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            self.server.child.try_wait().expect("wait on the server").is_none(),
            "{storm}: the server exited"
        );
        let steps = last["caracal_forward_steps_total"];
        let answer = normal_answer(self.addr).await;
        assert_eq!(answer, self.reference, "{storm}: the normal answer changed");
        let m = wire::metrics(self.addr).await;
        assert!(
            m["caracal_forward_steps_total"] > steps,
            "{storm}: the scheduler stepped for the normal request"
        );
        eprintln!(
            "{storm}: back at baseline (pages used {} = cached, locked 0, fds {fds}, cancelled {}, stalls {}, errors {})",
            m["caracal_kv_pages_used"],
            m["caracal_cancelled_total"],
            m["caracal_credit_stalls_total"],
            m["caracal_request_errors_total"],
        );
        m
    }
}

/// Runs `f` with every storm's preconditions: the lock, a runtime, a deadline.
fn storm<F: std::future::Future<Output = ()>>(secs: u64, f: impl FnOnce() -> F) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    runtime().block_on(async {
        tokio::time::timeout(Duration::from_secs(secs), f())
            .await
            .unwrap_or_else(|_| panic!("the storm did not finish in {secs} s (a hang)"))
    });
}

/// A long prompt (`words` distinct words), unique to `tag`.
fn long_prompt(tag: usize, words: usize) -> String {
    let mut s = format!("Request {tag}. Summarise: ");
    for w in 0..words {
        s.push_str(&format!("w{}x{} ", tag, w));
    }
    s
}

/// A function tool in chat shape and in the flat (Responses) shape.
fn read_file_tool(flat: bool) -> Value {
    let params = json!({"type": "object",
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
        "required": ["path"]});
    if flat {
        json!({"type": "function", "name": "read_file", "description": "Read a file", "parameters": params})
    } else {
        json!({"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": params}})
    }
}

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
}

/// Whether a chat chunk carries tool-call arguments.
fn has_arguments(v: &Value) -> bool {
    v["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .is_some_and(|a| !a.is_empty())
}

/// One client of the disconnect storm: kind `i % 6`, cut at a random point.
async fn disconnecting_client(addr: SocketAddr, i: usize, seed: u64) -> (usize, Cut) {
    let mut rng = Rng::seeded(seed);
    let k = 1 + (rng.next_u64() % 24) as usize;
    let kind = i % 6;
    let cut = match kind {
        // Mid-prefill: a long prompt (chunked prefill takes many steps), hung up after a delay.
        0 => {
            let body = json!({"messages": [{"role": "user", "content": long_prompt(i, 400)}],
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
            let mut sse = Sse::open(addr, "/v1/chat/completions", &body)
                .await
                .expect("connect")
                .expect("the stream opens");
            let mut n = 0;
            while n <= k {
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
            let mut sse = Sse::open(addr, "/v1/responses", &body)
                .await
                .expect("connect")
                .expect("the stream opens");
            let mut n = 0;
            while n <= k + 3 {
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
                create.as_object_mut().expect("an object").remove("ignore_eos");
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
                                cut = if tools { Cut::MidToolCall } else { Cut::MidDecode };
                                break;
                            }
                        }
                    }
                    other => panic!("the session ended early: {other:?}"),
                }
            }
            if i % 2 == 0 {
                let _ = ws.close(None).await;
            }
            cut
        }
        // Realtime, mid-decode.
        _ => {
            let mut ws = wire::ws(addr, &format!("/v1/realtime?model={MODEL}"))
                .await
                .expect("upgrade");
            let item = json!({"type": "conversation.item.create", "item": {"type": "message",
                "role": "user", "content": [{"type": "input_text", "text": format!("Hello {i}")}]}});
            wire::ws_send(&mut ws, &item).await.expect("send");
            wire::ws_send(
                &mut ws,
                &json!({"type": "response.create", "response": {"max_output_tokens": 300}}),
            )
            .await
            .expect("send");
            let mut n = 0;
            let mut cut = Cut::Finished;
            loop {
                match wire::ws_next(&mut ws).await {
                    WsNext::Event(v) => {
                        let t = v["type"].as_str().unwrap_or("");
                        if t == "response.done" {
                            break;
                        }
                        if t.ends_with(".delta") {
                            n += 1;
                            if n > k {
                                cut = Cut::MidDecode;
                                break;
                            }
                        }
                    }
                    other => panic!("the session ended early: {other:?}"),
                }
            }
            cut
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
        let mut lines: Vec<String> = counts.iter().map(|((k, c), n)| format!("kind {k} {c:?}: {n}")).collect();
        lines.sort();
        eprintln!("disconnect storm, {CLIENTS} clients:\n  {}", lines.join("\n  "));
        let at = |cut: Cut| counts.iter().filter(|((_, c), _)| *c == cut).map(|(_, n)| n).sum::<usize>();
        assert!(at(Cut::BeforeFirstToken) > 0, "some clients hung up mid-prefill");
        assert!(at(Cut::MidDecode) > 0, "some clients hung up mid-decode");
        assert!(at(Cut::MidToolCall) > 0, "some clients hung up mid-tool-call");
        let m = s.settle("disconnect storm").await;
        assert!(m["caracal_cancelled_total"] > 0.0, "the hang-ups were seen as cancellations");
    });
}

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
                    let r = wire::call(addr, "POST", &format!("/v1/responses/{id}/cancel"), None).await;
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
                    let again = wire::call(addr, "POST", &format!("/v1/responses/{id}/cancel"), None).await;
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
                    let mut deltas = 0;
                    let mut sent_cancel = false;
                    let done = loop {
                        match wire::ws_next(&mut ws).await {
                            WsNext::Event(v) => {
                                let t = v["type"].as_str().unwrap_or("").to_string();
                                if t == "response.done" {
                                    break v;
                                }
                                if t.ends_with(".delta") {
                                    deltas += 1;
                                }
                                if !sent_cancel && (t == "response.created" && i % 4 == 0 || deltas > i % 5) {
                                    wire::ws_send(&mut ws, &json!({"type": "response.cancel"}))
                                        .await
                                        .expect("send");
                                    sent_cancel = true;
                                }
                            }
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
        assert!(m["caracal_cancelled_total"] >= 80.0, "every cancel counted: {}", m["caracal_cancelled_total"]);
    });
}
