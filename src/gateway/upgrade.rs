//! The WebSocket upgrade on the HTTP port: check the handshake headers,
//! answer `101 Switching Protocols` with `Sec-WebSocket-Accept`, and once
//! hyper hands over the connection, wrap it in a tokio-tungstenite
//! [`WebSocketStream`] for the session task. A client that offers the
//! `realtime` subprotocol (browsers, which cannot set `Authorization`, offer it
//! with `openai-insecure-api-key.KEY`) gets `Sec-WebSocket-Protocol: realtime`.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

use super::error::{ApiError, ApiResult};

/// The server side of an upgraded connection.
pub type ServerSocket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// A checked handshake, ready to answer.
pub struct Handshake {
    /// Resolves to the raw connection once the 101 is sent.
    on_upgrade: hyper::upgrade::OnUpgrade,
    /// `Sec-WebSocket-Accept`.
    accept: String,
    /// The subprotocol answered: `realtime` when the client offered it (browsers
    /// offer it with `openai-insecure-api-key.KEY`, which is never echoed).
    protocol: Option<&'static str>,
}

/// Checks the handshake of `req` (version 13, a key, `Upgrade: websocket`).
pub fn accept(req: &mut Request) -> ApiResult<Handshake> {
    let h = req.headers();
    let has_token = |name: header::HeaderName, token: &str| {
        h.get_all(name).iter().any(|v| {
            v.to_str()
                .map(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
                .unwrap_or(false)
        })
    };
    if !has_token(header::UPGRADE, "websocket") || !has_token(header::CONNECTION, "upgrade") {
        return Err(ApiError {
            status: 426,
            kind: "invalid_request_error",
            code: "upgrade_required",
            param: None,
            message:
                "this endpoint needs a WebSocket upgrade (Connection: Upgrade, Upgrade: websocket)"
                    .into(),
        });
    }
    if h.get(header::SEC_WEBSOCKET_VERSION)
        .and_then(|v| v.to_str().ok())
        != Some("13")
    {
        return Err(ApiError::invalid(
            "invalid_value",
            Some("sec-websocket-version"),
            "only WebSocket version 13 is supported",
        ));
    }
    let key = h
        .get(header::SEC_WEBSOCKET_KEY)
        .ok_or_else(|| ApiError::missing("sec-websocket-key"))?;
    let accept = derive_accept_key(key.as_bytes());
    let protocol = offered_protocols(h)
        .any(|p| p == "realtime")
        .then_some("realtime");
    let on_upgrade = req
        .extensions_mut()
        .remove::<hyper::upgrade::OnUpgrade>()
        .ok_or_else(|| ApiError::internal("the connection cannot be upgraded"))?;
    Ok(Handshake {
        on_upgrade,
        accept,
        protocol,
    })
}

impl Handshake {
    /// The 101 response; `run` gets the socket once the client has it.
    pub fn respond<F, Fut>(self, max_message_bytes: usize, run: F) -> Response
    where
        F: FnOnce(ServerSocket) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let on_upgrade = self.on_upgrade;
        tokio::spawn(async move {
            match on_upgrade.await {
                Ok(upgraded) => {
                    let mut cfg = WebSocketConfig::default();
                    cfg.max_message_size = Some(max_message_bytes);
                    cfg.max_frame_size = Some(max_message_bytes);
                    let ws = WebSocketStream::from_raw_socket(
                        TokioIo::new(upgraded),
                        Role::Server,
                        Some(cfg),
                    )
                    .await;
                    run(ws).await;
                }
                Err(e) => tracing::debug!(error = %e, "WebSocket upgrade failed"),
            }
        });
        let mut resp = Response::new(Body::empty());
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let h = resp.headers_mut();
        h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(
            header::SEC_WEBSOCKET_ACCEPT,
            HeaderValue::from_str(&self.accept).expect("base64 is a valid header value"),
        );
        if let Some(p) = self.protocol {
            h.insert(header::SEC_WEBSOCKET_PROTOCOL, HeaderValue::from_static(p));
        }
        resp
    }
}

/// The subprotocols a handshake offers (`Sec-WebSocket-Protocol`, comma-separated).
pub fn offered_protocols(h: &axum::http::HeaderMap) -> impl Iterator<Item = &str> {
    h.get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
}
