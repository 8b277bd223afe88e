//! Engine and gateway flags through the real `caracal serve` binary (the
//! behaviours themselves are tested in-process elsewhere): `--kv-cache-dtype`
//! sizes the page pool by its row bytes (the `caracal_kv_pages_total` gauge
//! equals `pages_for` of the same budget), an int8 server answers, and
//! `--body-read-timeout` answers a stalled body with 408.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use caracal_kernels::paged::KvDtype;

mod common;

use common::serve::ServeProcess;

/// A raw HTTP/1.1 exchange on a fresh connection: sends `request`, reads
/// until the server closes (`Connection: close`) or 30 s pass.
fn exchange(port: u16, request: &[u8]) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(request).expect("send");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn get(port: u16, path: &str) -> String {
    exchange(
        port,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
    )
}

/// The value of an unlabelled gauge in `/metrics`.
fn gauge(port: u16, name: &str) -> u64 {
    let body = get(port, "/metrics");
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{body}")) as u64
}

#[test]
fn kv_cache_dtype_and_body_read_timeout_flags_reach_the_server() {
    let dir = caracal::convert::synth::default_model_dir().expect("the default model is made");
    let model = caracal::models::load(&dir).expect("the default model loads");
    let budget = 4usize << 20;
    let want = |dtype| caracal_actors::runtime::pages_for(model.as_ref(), budget, 16, dtype);

    let bf16 = ServeProcess::start(&["--kv-cache-memory", "4MiB"], 300);
    let bf16_pages = gauge(bf16.port, "caracal_kv_pages_total");
    assert_eq!(bf16_pages as usize, want(KvDtype::Bf16));
    drop(bf16);

    let mut int8 = ServeProcess::start(
        &[
            "--kv-cache-memory",
            "4MiB",
            "--kv-cache-dtype",
            "int8",
            "--body-read-timeout",
            "1",
        ],
        300,
    );
    let int8_pages = gauge(int8.port, "caracal_kv_pages_total");
    assert_eq!(int8_pages as usize, want(KvDtype::Int8));
    assert!(
        int8_pages > bf16_pages,
        "int8 rows are smaller: {int8_pages} pages vs {bf16_pages}"
    );

    let body = r#"{"messages":[{"role":"user","content":"Hello"}],"max_tokens":3}"#;
    let answer = exchange(
        int8.port,
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"chat.completion\""), "{answer}");
    assert!(gauge(int8.port, "caracal_kv_pages_used") > 0);

    // Half a body, then nothing: 408 once the 1 s timeout passes, and the
    // connection closed.
    let stalled = exchange(
        int8.port,
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{}",
            body.len(),
            &body[..body.len() / 2]
        )
        .as_bytes(),
    );
    assert!(stalled.starts_with("HTTP/1.1 408"), "{stalled}");
    assert!(
        stalled.contains("\"code\":\"request_timeout\""),
        "{stalled}"
    );
    // Still serving.
    assert!(get(int8.port, "/v1/models").starts_with("HTTP/1.1 200"));
    assert!(!int8.drain_log().contains("panicked"));
}
