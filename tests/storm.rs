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
//!
//! This file is the harness (a server per storm, its baseline, the checks
//! after a storm); the storms live in `storm/`, one module each, and
//! `storm/wire.rs` speaks HTTP, SSE and WebSocket over raw sockets.

mod common;
mod storm {
    pub mod wire;

    mod cancels;
    mod disconnects;
    mod flood;
    mod frames;
    mod idle;
    mod slow_readers;
}

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::serve::ServeProcess;
use serde_json::{json, Value};
use storm::wire;

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

/// One short Responses WebSocket turn that must complete (a normal socket client is served).
async fn normal_ws_turn(addr: SocketAddr) {
    let mut ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
    let create =
        json!({"type": "response.create", "input": "hi", "max_output_tokens": 3, "store": false});
    wire::ws_send(&mut ws, &create).await.expect("send");
    loop {
        match wire::ws_next(&mut ws).await {
            wire::WsNext::Event(v)
                if v["type"] == "response.completed" || v["type"] == "response.incomplete" =>
            {
                break
            }
            wire::WsNext::Event(v) if v["type"] == "error" => panic!("{v}"),
            wire::WsNext::Event(_) => {}
            other => panic!("the session ended: {other:?}"),
        }
    }
    let _ = ws.close(None).await;
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
