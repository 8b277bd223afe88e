//! Idle and half-open connections: 1,000 held at once (idle TCP, half a
//! request head or body, half a WebSocket handshake, idle sessions) do not
//! starve a client; after `--timeout-keep-alive` the server has closed
//! every one that never completed a request head or a handshake (and a
//! kept-alive connection idle as long), while upgraded sessions idle for
//! longer still serve, and its descriptors are back to what it holds for
//! the connections that remain.

use super::wire::{self, WsNext};
use crate::{normal_answer, normal_request, normal_ws_turn, storm, Storm, MODEL};
use serde_json::json;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `--timeout-keep-alive` of this storm: long enough for the 1,000
/// connections to be opened and checked while all are held.
const HEAD_TIMEOUT: Duration = Duration::from_secs(15);

/// The kinds of held connection that never complete a request head or a
/// WebSocket handshake: the head timeout closes them.
const HEADLESS: [&str; 3] = [
    "idle TCP",
    "half a request head",
    "half a WebSocket handshake",
];

/// Reads `c` until the server closes it (EOF, or a reset): all it sent,
/// or `None` when it is still open a minute past the head timeout.
async fn until_closed_by_server(mut c: TcpStream) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let read_all = async {
        let mut buf = [0u8; 4096];
        loop {
            match c.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(HEAD_TIMEOUT + Duration::from_secs(60), read_all)
        .await
        .ok()?;
    Some(got)
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
        let mut s = Storm::start(&[
            "--max-sessions",
            "1100",
            "--timeout-keep-alive",
            &HEAD_TIMEOUT.as_secs().to_string(),
        ])
        .await;
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
        // The descriptors open now (the startup baseline can include a transient one).
        let fds_before = wire::open_fds(pid);
        let opening = Instant::now();
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
            held.push((kind, c));
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
            fds_held + 2 >= fds_before + CONNECTIONS,
            "the server holds every connection ({fds_held} fds, {fds_before} before, opened in {:?}, head timeout {HEAD_TIMEOUT:?})",
            opening.elapsed()
        );
        // A normal client is served, over HTTP and over a WebSocket session.
        assert_eq!(normal_answer(addr).await, s.reference);
        normal_ws_turn(addr).await;
        let health = wire::call(addr, "GET", "/health", None).await;
        assert_eq!(health.status, 200);
        let mut lines: Vec<String> = kinds.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        lines.sort();
        eprintln!(
            "idle storm: {CONNECTIONS} connections held ({}), server fds {fds_held}, soft limit raised to {server_soft}",
            lines.join(", ")
        );

        // The head timeout. A kept-alive connection that goes idle after
        // one answer, and a session that stays idle through the timeout.
        let mut kept = wire::connect(addr, None).await.expect("connect");
        kept.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await
            .expect("write");
        let mut idle_ws = wire::ws(addr, "/v1/responses").await.expect("upgrade");
        let (closing, staying): (Vec<_>, Vec<_>) = held
            .into_iter()
            .partition(|(kind, _)| HEADLESS.contains(kind));
        let expect_closed = closing.len();
        let closes: Vec<_> = closing
            .into_iter()
            .map(|(_, c)| tokio::spawn(until_closed_by_server(c)))
            .collect();
        let mut closed = 0;
        for t in closes {
            if t.await.expect("a reader").is_some() {
                closed += 1;
            }
        }
        assert_eq!(
            closed, expect_closed,
            "every connection without a complete head or handshake was closed after the timeout"
        );
        let answer = until_closed_by_server(kept)
            .await
            .expect("the idle kept-alive connection was closed");
        assert!(
            answer.starts_with(b"HTTP/1.1 200"),
            "the kept-alive connection was answered first: {}",
            String::from_utf8_lossy(&answer)
        );
        // What stays: the sessions (idle or with half a frame) and the
        // half bodies (their heads are complete: the body is the handler's
        // to wait for), plus `idle_ws`.
        let remaining = staying.len() + 1;
        let deadline = Instant::now() + Duration::from_secs(30);
        let fds_after = loop {
            let n = wire::open_fds(pid);
            if n <= s.fds + 2 + remaining {
                break n;
            }
            assert!(
                Instant::now() < deadline,
                "the server still holds {n} descriptors after the timeout \
                 (baseline {} + {remaining} connections that remain)",
                s.fds
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let m = wire::metrics(addr).await;
        assert_eq!(
            m["caracal_sessions"],
            (sessions + 1) as f64,
            "no WebSocket session was closed by the head timeout"
        );
        wire::ws_send(&mut idle_ws, &json!({"type": "response.create", "input": "still there?", "max_output_tokens": 3, "store": false}))
            .await
            .expect("send");
        loop {
            match wire::ws_next(&mut idle_ws).await {
                WsNext::Event(v)
                    if v["type"] == "response.completed" || v["type"] == "response.incomplete" =>
                {
                    break
                }
                WsNext::Event(v) if v["type"] == "error" => panic!("{v}"),
                WsNext::Event(_) => {}
                other => panic!("the idle session ended: {other:?}"),
            }
        }
        let _ = idle_ws.close(None).await;
        eprintln!(
            "idle storm: after the {HEAD_TIMEOUT:?} head timeout {closed} connections without a head or handshake \
             and the idle kept-alive one were closed; server fds {fds_after} with {remaining} connections left \
             (baseline {}), {sessions} idle sessions still open and serving",
            s.fds
        );
        drop(staying);
        s.settle("idle and half-open connections").await;
    });
}
