//! Oversize and fragmented frames: bodies and messages past the limits,
//! fragments, pings between fragments, binary and stray frames each get
//! their answer, and the sessions that can go on do.

use super::wire::{self, WsNext};
use crate::{normal_request, storm, Storm, MODEL};
use futures::SinkExt;
use serde_json::{json, Value};
use std::collections::HashMap;
use tokio::io::AsyncWriteExt;
use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
use tokio_tungstenite::tungstenite::protocol::frame::Frame;
use tokio_tungstenite::tungstenite::Message;

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
