//! What a browser can and cannot do with the gateway's WebSockets, over real
//! sockets: an upgrade carrying a foreign `Origin` is refused with 403
//! `origin_not_allowed` on both socket routes, the server's own origin and
//! `--allowed-origins` (a list, or `*`) pass, clients without an `Origin`
//! pass as before; with `--api-key` the key may come as the subprotocol
//! `openai-insecure-api-key.KEY` (upgrades only), and a handshake offering
//! `realtime` gets it back as the chosen protocol; the console's files are
//! served without the key, the API routes still need it.

mod common;
mod gateway_support;

use std::net::SocketAddr;

use caracal::gateway::upgrade::OriginPolicy;
use caracal::gateway::GatewayConfig;
use caracal_actors::runtime::EngineConfig;
use gateway_support::*;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::Error as WsError;

const ROUTES: [&str; 2] = ["/v1/responses", "/v1/realtime?model=tiny-llama"];

async fn server(config: GatewayConfig) -> TestServer {
    start(&fixture("tiny-llama"), config, EngineConfig::default()).await
}

/// The outcome of one handshake: the status, the chosen subprotocol, and
/// the error body of a refusal.
struct Handshake {
    status: u16,
    protocol: Option<String>,
    body: Value,
}

/// Opens `path` with these extra handshake headers; a 101 is closed at once.
async fn handshake(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Handshake {
    let mut req = format!("ws://{addr}{path}")
        .into_client_request()
        .expect("a valid URL");
    for (k, v) in headers {
        req.headers_mut().insert(
            tokio_tungstenite::tungstenite::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    match tokio_tungstenite::connect_async(req).await {
        Ok((mut ws, resp)) => {
            let protocol = resp
                .headers()
                .get("sec-websocket-protocol")
                .map(|v| v.to_str().unwrap().to_string());
            let _ = ws.close(None).await;
            Handshake {
                status: resp.status().as_u16(),
                protocol,
                body: Value::Null,
            }
        }
        Err(WsError::Http(resp)) => {
            let body = resp
                .body()
                .as_deref()
                .and_then(|b| serde_json::from_slice(b).ok())
                .unwrap_or(Value::Null);
            Handshake {
                status: resp.status().as_u16(),
                protocol: None,
                body,
            }
        }
        Err(e) => panic!("handshake on {path} failed without an HTTP answer: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_origins_are_refused_and_the_servers_own_origin_passes() {
    let s = server(GatewayConfig::default()).await;
    let own = format!("http://{}", s.addr);
    for path in ROUTES {
        let h = handshake(s.addr, path, &[("origin", "https://evil.example")]).await;
        assert_eq!(h.status, 403, "{path}");
        assert_eq!(h.body["error"]["code"], "origin_not_allowed", "{path}");
        assert_eq!(h.body["error"]["type"], "invalid_request_error");
        assert!(
            h.body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--allowed-origins"),
            "{}",
            h.body
        );
        // Same host, another port is another origin; so is `null` (a file:// page).
        let other_port = format!("http://127.0.0.1:{}", s.addr.port() + 1);
        for origin in [other_port.as_str(), "null"] {
            assert_eq!(
                handshake(s.addr, path, &[("origin", origin)]).await.status,
                403,
                "{path} {origin}"
            );
        }
        assert_eq!(
            handshake(s.addr, path, &[("origin", &own)]).await.status,
            101,
            "{path}"
        );
        assert_eq!(
            handshake(s.addr, path, &[("origin", &own.to_uppercase())])
                .await
                .status,
            101,
            "{path}: origins compare without case"
        );
        // A client that is not a browser sends no Origin.
        assert_eq!(handshake(s.addr, path, &[]).await.status, 101, "{path}");
    }
    // Plain HTTP is not a WebSocket upgrade: no origin check there.
    let (status, _) = raw_json(
        s.addr,
        "GET",
        "/v1/models",
        &[("origin", "https://evil.example")],
        None,
    )
    .await;
    assert_eq!(status, 200);
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_origins_admit_the_listed_ones_or_any_with_star() {
    let listed = GatewayConfig {
        allowed_origins: OriginPolicy::parse("http://localhost:3000, https://app.example.com")
            .unwrap(),
        ..GatewayConfig::default()
    };
    let s = server(listed).await;
    for path in ROUTES {
        for (origin, status) in [
            ("http://localhost:3000", 101),
            ("https://app.example.com", 101),
            ("https://app.example.com:443", 101),
            ("http://app.example.com", 403),
            ("http://localhost:3001", 403),
            ("https://evil.example", 403),
        ] {
            assert_eq!(
                handshake(s.addr, path, &[("origin", origin)]).await.status,
                status,
                "{path} {origin}"
            );
        }
    }
    s.shutdown().await.unwrap();
    let any = GatewayConfig {
        allowed_origins: OriginPolicy::parse("*").unwrap(),
        ..GatewayConfig::default()
    };
    let s = server(any).await;
    for path in ROUTES {
        for origin in ["https://evil.example", "null"] {
            assert_eq!(
                handshake(s.addr, path, &[("origin", origin)]).await.status,
                101,
                "{path} {origin}"
            );
        }
    }
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_may_come_as_a_subprotocol_on_both_socket_routes() {
    let config = GatewayConfig {
        api_key: Some("sekret".into()),
        ..GatewayConfig::default()
    };
    let s = server(config).await;
    let own = format!("http://{}", s.addr);
    for path in ROUTES {
        // What a browser sends: Origin, and the key next to `realtime`.
        let h = handshake(
            s.addr,
            path,
            &[
                ("origin", &own),
                (
                    "sec-websocket-protocol",
                    "realtime, openai-insecure-api-key.sekret",
                ),
            ],
        )
        .await;
        assert_eq!(h.status, 101, "{path}");
        assert_eq!(h.protocol.as_deref(), Some("realtime"), "{path}");
        for protocols in [
            "realtime, openai-insecure-api-key.sekreT",
            "realtime, openai-insecure-api-key.",
            "realtime",
        ] {
            let h = handshake(s.addr, path, &[("sec-websocket-protocol", protocols)]).await;
            assert_eq!(h.status, 401, "{path} {protocols}");
            assert_eq!(h.body["error"]["code"], "invalid_api_key");
        }
        // The Bearer header works as before, and no protocol is chosen when none is offered.
        let h = handshake(s.addr, path, &[("authorization", "Bearer sekret")]).await;
        assert_eq!((h.status, h.protocol), (101, None), "{path}");
        // A foreign page with the right key is still refused: the origin comes first.
        let h = handshake(
            s.addr,
            path,
            &[
                ("origin", "https://evil.example"),
                (
                    "sec-websocket-protocol",
                    "realtime, openai-insecure-api-key.sekret",
                ),
            ],
        )
        .await;
        assert_eq!(h.status, 403, "{path}");
    }
    // The subprotocol is no key for plain HTTP routes.
    let (status, body) = raw_json(
        s.addr,
        "GET",
        "/v1/models",
        &[(
            "sec-websocket-protocol",
            "realtime, openai-insecure-api-key.sekret",
        )],
        None,
    )
    .await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (401, &json!("invalid_api_key"))
    );
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_without_the_key_and_keeps_to_its_origin() {
    let config = GatewayConfig {
        api_key: Some("sekret".into()),
        ..GatewayConfig::default()
    };
    let s = server(config).await;
    for (path, kind) in [
        ("/", "text/html"),
        ("/console/console.js", "text/javascript"),
        ("/console/console.css", "text/css"),
    ] {
        let resp = send(s.addr, "GET", path, &[], None).await;
        assert_eq!(resp.status(), 200, "{path}");
        let h = resp.headers();
        assert!(
            h["content-type"].to_str().unwrap().starts_with(kind),
            "{path}"
        );
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(
            csp.contains("default-src 'none'") && csp.contains("script-src 'self'"),
            "{csp}"
        );
    }
    let (status, page) = raw_json(s.addr, "GET", "/", &[], None).await;
    assert_eq!(status, 200);
    let page = page.as_str().unwrap();
    assert!(page.contains("<video") && page.contains("/console/console.js"));
    // The API is not opened by the console's exemption.
    for path in ["/v1/models", "/console", "/metrics"] {
        let (status, _) = raw_json(s.addr, "GET", path, &[], None).await;
        assert_eq!(status, 401, "{path}");
    }
    let (status, _) = raw_json(s.addr, "GET", "/console/nothing", &[], None).await;
    assert_eq!(status, 404);
    s.shutdown().await.unwrap();
}
