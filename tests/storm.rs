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
    let r = wire::call(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(&normal_request()),
    )
    .await;
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
        let addr: SocketAddr = format!("127.0.0.1:{}", server.port)
            .parse()
            .expect("an address");
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
        let mut last: HashMap<String, f64>;
        let mut fds: usize;
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
            assert_eq!(
                g("caracal_panics_total"),
                0.0,
                "{storm}: a panic was caught"
            );
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
            self.server
                .child
                .try_wait()
                .expect("wait on the server")
                .is_none(),
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
    /// A non-streaming request, hung up after a delay without reading.
    Unread,
}

/// Whether a chat chunk carries tool-call arguments.
fn has_arguments(v: &Value) -> bool {
    v["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .is_some_and(|a| !a.is_empty())
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

#[test]
fn slow_readers_stall_their_own_streams_and_others_are_served() {
    storm(600, || async {
        let mut s = Storm::start(&["--max-running-requests", "16"]).await;
        let addr = s.addr;
        let before = wire::metrics(addr).await;
        // Clients that read the head (or the upgrade) and then nothing, on
        // small receive buffers; log-probabilities make every token's frame
        // large, so the socket buffers fill in a few hundred tokens.
        const SSE_READERS: usize = 3;
        const WS_READERS: usize = 1;
        let mut held = Vec::new();
        for i in 0..SSE_READERS {
            let stream = wire::connect(addr, Some(4096)).await.expect("connect");
            let body = json!({"messages": [{"role": "user", "content": format!("Slow reader {i}")}],
                              "max_tokens": 6000, "ignore_eos": true, "stream": true,
                              "logprobs": true, "top_logprobs": 20});
            let sse = Sse::open_on(stream, "/v1/chat/completions", &body)
                .await
                .expect("send")
                .expect("the stream opens");
            held.push(sse);
        }
        let mut sockets = Vec::new();
        for i in 0..WS_READERS {
            let mut ws = wire::ws_small_buffer(addr, "/v1/responses", 4096)
                .await
                .expect("upgrade");
            let create = json!({"type": "response.create", "input": format!("Slow socket {i}"),
                                "max_output_tokens": 6000, "ignore_eos": true, "store": false,
                                "top_logprobs": 20, "include": ["message.output_text.logprobs"]});
            wire::ws_send(&mut ws, &create).await.expect("send");
            sockets.push(ws);
        }
        // The stall: every slow stream's credit runs out and the scheduler
        // stops stepping for them (nothing buffers without bound).
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut prev = -1.0;
        let stalled = loop {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let m = wire::metrics(addr).await;
            let steps = m["caracal_forward_steps_total"];
            if steps == prev && m["caracal_running_sequences"] == (SSE_READERS + WS_READERS) as f64
            {
                break m;
            }
            prev = steps;
            assert!(
                Instant::now() < deadline,
                "the server kept decoding for clients that read nothing ({steps} steps): unbounded buffering"
            );
        };
        let stalls = stalled["caracal_credit_stalls_total"] - before["caracal_credit_stalls_total"];
        assert!(stalls > 0.0, "the slow readers' streams stalled on credit");
        let rss_stalled = rss_kib(s.server.child.id());
        let tokens_per_stream = (stalled["caracal_forward_steps_total"]
            - before["caracal_forward_steps_total"]) as usize;
        // Others are served meanwhile (the slow streams keep their slots).
        for _ in 0..3 {
            assert_eq!(
                normal_answer(addr).await,
                s.reference,
                "a normal client is served"
            );
        }
        let mut ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
        wire::ws_send(&mut ws, &json!({"type": "response.create", "input": "hi", "max_output_tokens": 3, "store": false}))
            .await
            .expect("send");
        loop {
            match wire::ws_next(&mut ws).await {
                WsNext::Event(v)
                    if v["type"] == "response.completed" || v["type"] == "response.incomplete" =>
                {
                    break
                }
                WsNext::Event(v) if v["type"] == "error" => panic!("{v}"),
                WsNext::Event(_) => {}
                other => panic!("the session ended: {other:?}"),
            }
        }
        let _ = ws.close(None).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let later = wire::metrics(addr).await;
        assert_eq!(
            later["caracal_running_sequences"],
            (SSE_READERS + WS_READERS) as f64,
            "the slow streams are still open, paused"
        );
        let rss_later = rss_kib(s.server.child.id());
        eprintln!(
            "slow readers: {SSE_READERS} SSE + {WS_READERS} WebSocket stalled after {tokens_per_stream} steps, \
             {stalls} credit stalls; RSS {rss_stalled} KiB stalled, {rss_later} KiB after 3 more requests"
        );
        drop(held);
        drop(sockets);
        s.settle("slow readers").await;
    });
}

/// The resident set of process `pid` in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// This process's soft and hard open-files limits.
fn own_fd_limits() -> (u64, u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid, writable rlimit.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) };
    assert_eq!(rc, 0, "getrlimit");
    (l.rlim_cur, l.rlim_max)
}

/// Sets this process's soft open-files limit.
fn set_own_soft_fd_limit(soft: u64) {
    let (_, hard) = own_fd_limits();
    let l = libc::rlimit {
        rlim_cur: soft.min(hard),
        rlim_max: hard,
    };
    // SAFETY: `l` is a valid rlimit; the kernel only reads it.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) };
    assert_eq!(rc, 0, "setrlimit");
}

#[test]
fn a_thousand_idle_and_half_open_connections_do_not_starve_a_client() {
    const CONNECTIONS: usize = 1000;
    let (_, hard) = own_fd_limits();
    if hard < 2 * CONNECTIONS as u64 + 256 {
        eprintln!("note: skipping the idle-connection storm: the hard open-files limit is {hard}");
        return;
    }
    storm(600, || async {
        // The server starts under the usual soft limit of 1024 and must
        // raise its own; this process needs more than that for its clients.
        set_own_soft_fd_limit(1024);
        let mut s = Storm::start(&["--max-sessions", "1100"]).await;
        set_own_soft_fd_limit(hard);
        let pid = s.server.child.id();
        let (server_soft, _) = wire::fd_limits(pid).expect("the server's limits");
        assert!(
            server_soft > 2 * CONNECTIONS as u64,
            "the server raised its soft open-files limit from 1024 (now {server_soft})"
        );
        let addr = s.addr;
        let chat = serde_json::to_vec(&normal_request()).expect("JSON");
        let post = wire::request("POST", "/v1/chat/completions", Some(&chat));
        let head_len = post.len() - chat.len();
        let mut held = Vec::with_capacity(CONNECTIONS);
        let mut kinds: HashMap<&str, usize> = HashMap::new();
        for i in 0..CONNECTIONS {
            let mut c = wire::connect(addr, None).await.expect("connect");
            let kind = match i % 20 {
                // Connected, nothing sent.
                0..=7 => "idle TCP",
                // Half a request head.
                8..=11 => {
                    c.write_all(&post[..head_len / 2]).await.expect("write");
                    "half a request head"
                }
                // A whole head and half its body.
                12 | 13 => {
                    c.write_all(&post[..head_len + chat.len() / 2])
                        .await
                        .expect("write");
                    "half a request body"
                }
                // Half a WebSocket handshake.
                14 | 15 => {
                    let h = wire::ws_handshake("/v1/responses");
                    c.write_all(&h[..h.len() / 2]).await.expect("write");
                    "half a WebSocket handshake"
                }
                // Upgraded sessions, idle or with half a frame sent.
                _ => {
                    let path = if i % 20 == 16 {
                        format!("/v1/realtime?model={MODEL}")
                    } else {
                        "/v1/responses".to_string()
                    };
                    c.write_all(&wire::ws_handshake(&path))
                        .await
                        .expect("write");
                    let r = wire::Reader::start(c).await.expect("an upgrade answer");
                    assert_eq!(r.status, 101, "upgraded");
                    c = r.stream;
                    if i % 20 == 19 {
                        // A masked text frame announcing 100 bytes, 10 of them sent.
                        let mut frame = vec![0x81, 0x80 | 100, 1, 2, 3, 4];
                        frame.extend_from_slice(&[b'x' ^ 1; 10]);
                        c.write_all(&frame).await.expect("write");
                        "WebSocket session, half a frame"
                    } else {
                        "idle WebSocket session"
                    }
                }
            };
            *kinds.entry(kind).or_default() += 1;
            held.push(c);
        }
        let sessions: usize = kinds
            .iter()
            .filter(|(k, _)| k.starts_with("WebSocket session") || k.starts_with("idle WebSocket"))
            .map(|(_, n)| n)
            .sum();
        let m = wire::metrics(addr).await;
        assert_eq!(
            m["caracal_sessions"], sessions as f64,
            "every upgraded connection holds a session"
        );
        let fds_held = wire::open_fds(pid);
        assert!(
            fds_held >= s.fds + CONNECTIONS,
            "the server holds every connection ({fds_held} fds)"
        );
        // A normal client is served, over HTTP and over a WebSocket session.
        assert_eq!(normal_answer(addr).await, s.reference);
        let mut ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
        wire::ws_send(&mut ws, &json!({"type": "response.create", "input": "hi", "max_output_tokens": 3, "store": false}))
            .await
            .expect("send");
        loop {
            match wire::ws_next(&mut ws).await {
                WsNext::Event(v)
                    if v["type"] == "response.completed" || v["type"] == "response.incomplete" =>
                {
                    break
                }
                WsNext::Event(v) if v["type"] == "error" => panic!("{v}"),
                WsNext::Event(_) => {}
                other => panic!("the session ended: {other:?}"),
            }
        }
        let _ = ws.close(None).await;
        let health = wire::call(addr, "GET", "/health", None).await;
        assert_eq!(health.status, 200);
        let mut lines: Vec<String> = kinds.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        lines.sort();
        eprintln!(
            "idle storm: {CONNECTIONS} connections held ({}), server fds {fds_held}, soft limit raised to {server_soft}",
            lines.join(", ")
        );
        drop(held);
        s.settle("idle and half-open connections").await;
    });
}

/// A masked client frame written by hand: `fin`, `opcode`, and a payload
/// header announcing `announced` bytes, of which `payload` is sent.
fn raw_frame(fin: bool, opcode: u8, announced: u64, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![(u8::from(fin) << 7) | opcode];
    match announced {
        0..=125 => f.push(0x80 | announced as u8),
        126..=0xFFFF => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(announced as u16).to_be_bytes());
        }
        _ => {
            f.push(0x80 | 127);
            f.extend_from_slice(&announced.to_be_bytes());
        }
    }
    let mask = [0x37, 0xfa, 0x21, 0x3d];
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// Writes raw bytes under a tungstenite client.
async fn write_raw(ws: &mut wire::Ws, bytes: &[u8]) {
    match ws.get_mut() {
        tokio_tungstenite::MaybeTlsStream::Plain(s) => s.write_all(bytes).await.expect("write"),
        _ => unreachable!("loopback sockets are plain"),
    }
}

/// Reads events until a terminal response event; its type.
async fn until_terminal(ws: &mut wire::Ws) -> String {
    loop {
        match wire::ws_next(ws).await {
            WsNext::Event(v) => {
                let t = v["type"].as_str().unwrap_or("").to_string();
                if matches!(
                    t.as_str(),
                    "response.completed" | "response.incomplete" | "response.failed" | "error"
                ) {
                    return t;
                }
            }
            other => panic!("the session ended: {other:?}"),
        }
    }
}

/// A terminal event of a served response (`max_output_tokens` makes it incomplete).
fn assert_served(terminal: &str) {
    assert!(
        matches!(terminal, "response.completed" | "response.incomplete"),
        "the response was served: {terminal}"
    );
}

/// The close code (or `None` when the connection just ended) after
/// skipping any events.
async fn until_closed(ws: &mut wire::Ws) -> (Vec<Value>, Option<u16>) {
    let mut events = Vec::new();
    loop {
        match wire::ws_next(ws).await {
            WsNext::Event(v) => events.push(v),
            WsNext::Closed(code) => return (events, code),
            WsNext::Gone => return (events, None),
        }
    }
}

#[test]
fn oversize_and_fragmented_frames_get_their_answers() {
    const LIMIT: usize = 64 << 10;
    storm(600, || async {
        let mut s =
            Storm::start(&["--max-message-bytes", "64KiB", "--max-body-bytes", "64KiB"]).await;
        let addr = s.addr;
        let short = json!({"type": "response.create", "input": "hi", "max_output_tokens": 3, "store": false});
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for i in 0..10 {
            // A Content-Length past the limit: 413 before the body is read.
            let mut c = wire::connect(addr, None).await.expect("connect");
            let head = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n",
                4 * LIMIT
            );
            c.write_all(head.as_bytes()).await.expect("write");
            let r = wire::read_answer(c).await;
            assert_eq!(r.status, 413, "{:?}", r.json());
            assert_eq!(r.json()["error"]["code"], "body_too_large");
            *counts
                .entry("HTTP Content-Length past the limit → 413")
                .or_default() += 1;

            // A chunked body that grows past the limit while the answer is read.
            let mut c = wire::connect(addr, None).await.expect("connect");
            let head = "POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                        Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
            c.write_all(head.as_bytes()).await.expect("write");
            let piece = format!("{:x}\r\n{}\r\n", 4096, " ".repeat(4096));
            for _ in 0..(LIMIT / 4096 + 2) {
                c.write_all(piece.as_bytes()).await.expect("write");
            }
            let r = wire::read_answer(c).await;
            assert_eq!(r.status, 413, "{:?}", r.json());
            *counts
                .entry("HTTP chunked body past the limit → 413")
                .or_default() += 1;

            // Just under the limit (padded JSON) is served.
            if i == 0 {
                let mut body = serde_json::to_vec(&normal_request()).expect("JSON");
                body.resize(LIMIT - 16, b' ');
                let mut c = wire::connect(addr, None).await.expect("connect");
                c.write_all(&wire::request("POST", "/v1/chat/completions", Some(&body)))
                    .await
                    .expect("write");
                let r = wire::read_answer(c).await;
                assert_eq!(r.status, 200, "{:?}", r.json());
            }

            // Responses WebSocket: a message past the limit (under twice it):
            // an error, and the session goes on.
            let mut ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
            let big = json!({"type": "response.create", "input": "x".repeat(LIMIT + 1000)});
            wire::ws_send(&mut ws, &big).await.expect("send");
            match wire::ws_next(&mut ws).await {
                WsNext::Event(v) => assert_eq!(v["error"]["code"], "message_too_large", "{v}"),
                other => panic!("expected an error event: {other:?}"),
            }
            wire::ws_send(&mut ws, &short).await.expect("send");
            assert_served(&until_terminal(&mut ws).await);
            *counts
                .entry("WebSocket message past the limit → message_too_large, session goes on")
                .or_default() += 1;

            // The same message in 6 fragments with a ping between them: served.
            let text = serde_json::to_vec(&short).expect("JSON");
            let parts: Vec<&[u8]> = text.chunks(text.len().div_ceil(6)).collect();
            for (j, p) in parts.iter().enumerate() {
                let opcode = if j == 0 {
                    OpCode::Data(Data::Text)
                } else {
                    OpCode::Data(Data::Continue)
                };
                ws.send(Message::Frame(Frame::message(
                    p.to_vec(),
                    opcode,
                    j + 1 == parts.len(),
                )))
                .await
                .expect("send");
                if j == 2 {
                    ws.send(Message::Ping(vec![1, 2, 3].into()))
                        .await
                        .expect("ping");
                }
            }
            assert_served(&until_terminal(&mut ws).await);
            *counts
                .entry("fragmented message (6 frames + ping) → served")
                .or_default() += 1;

            // A binary frame: an error, the session goes on.
            ws.send(Message::Binary(vec![0u8; 16].into()))
                .await
                .expect("send");
            match wire::ws_next(&mut ws).await {
                WsNext::Event(v) => assert_eq!(v["error"]["code"], "unsupported_frame", "{v}"),
                other => panic!("expected an error event: {other:?}"),
            }
            wire::ws_send(&mut ws, &short).await.expect("send");
            assert_served(&until_terminal(&mut ws).await);
            *counts
                .entry("binary frame → unsupported_frame, session goes on")
                .or_default() += 1;

            // Fragments that add up past twice the limit: close 1009.
            let piece = vec![b' '; 4096];
            write_raw(&mut ws, &raw_frame(false, 0x1, 4096, &piece)).await;
            for _ in 0..(2 * LIMIT / 4096) {
                write_raw(&mut ws, &raw_frame(false, 0x0, 4096, &piece)).await;
            }
            let (_, code) = until_closed(&mut ws).await;
            assert_eq!(
                code,
                Some(1009),
                "fragments past twice the limit close with 1009"
            );
            *counts
                .entry("fragments past 2x the limit → 1009")
                .or_default() += 1;

            // One frame announcing more than twice the limit: 1009 before its payload is read.
            let mut ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
            write_raw(
                &mut ws,
                &raw_frame(true, 0x1, 4 * LIMIT as u64, &[b' '; 1024]),
            )
            .await;
            let (_, code) = until_closed(&mut ws).await;
            assert_eq!(
                code,
                Some(1009),
                "a frame past twice the limit closes with 1009"
            );
            *counts.entry("frame past 2x the limit → 1009").or_default() += 1;

            // A continuation with nothing to continue: a protocol error ends the session.
            let mut ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
            write_raw(&mut ws, &raw_frame(true, 0x0, 3, b"abc")).await;
            let (_, code) = until_closed(&mut ws).await;
            assert!(
                matches!(code, None | Some(1002)),
                "a protocol error closes: {code:?}"
            );
            *counts
                .entry("stray continuation frame → closed")
                .or_default() += 1;

            // Realtime: a message past the limit is an error and the session goes on.
            let mut ws = wire::ws(addr, &format!("/v1/realtime?model={MODEL}"))
                .await
                .expect("upgrade");
            let big = json!({"type": "session.update", "session": {"instructions": "y".repeat(LIMIT + 10)}});
            wire::ws_send(&mut ws, &big).await.expect("send");
            loop {
                match wire::ws_next(&mut ws).await {
                    WsNext::Event(v) if v["type"] == "error" => {
                        assert_eq!(v["error"]["code"], "message_too_large", "{v}");
                        break;
                    }
                    WsNext::Event(_) => {}
                    other => panic!("the session ended: {other:?}"),
                }
            }
            wire::ws_send(
                &mut ws,
                &json!({"type": "session.update", "session": {"instructions": "be brief"}}),
            )
            .await
            .expect("send");
            loop {
                match wire::ws_next(&mut ws).await {
                    WsNext::Event(v) if v["type"] == "session.updated" => break,
                    WsNext::Event(v) if v["type"] == "error" => panic!("{v}"),
                    WsNext::Event(_) => {}
                    other => panic!("the session ended: {other:?}"),
                }
            }
            let _ = ws.close(None).await;
            *counts
                .entry("Realtime message past the limit → error, session goes on")
                .or_default() += 1;
        }
        let mut lines: Vec<String> = counts.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        lines.sort();
        eprintln!("oversize storm:\n  {}", lines.join("\n  "));
        s.settle("oversize and fragmented frames").await;
    });
}

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
