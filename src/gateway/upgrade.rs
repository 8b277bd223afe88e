//! The WebSocket upgrade on the HTTP port: check the handshake headers,
//! answer `101 Switching Protocols` with `Sec-WebSocket-Accept`, and once
//! hyper hands over the connection, wrap it in a tokio-tungstenite
//! [`WebSocketStream`] for the session task.
//!
//! Browsers need two more things here, both checked by the auth layer
//! (`http.rs`) before any route sees the upgrade:
//! - **Origin.** A page on any site may open a WebSocket to any host (no
//!   CORS applies), so an upgrade that carries an `Origin` is accepted only
//!   from the server's own origin (the `Host` it was reached at) or one of
//!   `--allowed-origins` ([`OriginPolicy`]); otherwise 403
//!   `origin_not_allowed`. Clients that are not browsers send no `Origin`
//!   and are not affected.
//! - **The key.** A browser cannot set `Authorization` on a WebSocket, so
//!   the key may come as the subprotocol `openai-insecure-api-key.KEY`
//!   offered next to `realtime` ([`subprotocol_key`]), as OpenAI's browser
//!   clients send it; the 101 then names `realtime` as the chosen protocol
//!   (a browser fails a handshake that offered protocols and got none back).

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use hyper_util::rt::TokioIo;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

use super::error::{ApiError, ApiResult};

/// The server side of an upgraded connection.
pub type ServerSocket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// The subprotocol the server speaks and answers with when it is offered.
pub const REALTIME_PROTOCOL: &str = "realtime";

/// The subprotocol prefix that carries an API key from a browser.
pub const KEY_PROTOCOL_PREFIX: &str = "openai-insecure-api-key.";

/// A checked handshake, ready to answer.
pub struct Handshake {
    /// Resolves to the raw connection once the 101 is sent.
    on_upgrade: hyper::upgrade::OnUpgrade,
    /// `Sec-WebSocket-Accept`.
    accept: String,
    /// The chosen subprotocol (`realtime` when the client offered it).
    protocol: Option<&'static str>,
}

/// The subprotocols a handshake offers (`Sec-WebSocket-Protocol`, comma lists).
pub fn offered_protocols(h: &HeaderMap) -> impl Iterator<Item = &str> {
    h.get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
}

/// The API key offered as the subprotocol `openai-insecure-api-key.KEY`, if any.
pub fn subprotocol_key(h: &HeaderMap) -> Option<&str> {
    offered_protocols(h).find_map(|p| p.strip_prefix(KEY_PROTOCOL_PREFIX))
}

/// Which browser origins may open a WebSocket (`--allowed-origins`): the
/// server's own origin always, plus these.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OriginPolicy {
    /// `*`: any origin.
    any: bool,
    /// Further origins, normalised (`scheme://host[:port]`, lower case, no
    /// default port).
    origins: Vec<String>,
}

/// An `Origin` split into its scheme and its `host[:port]` without the
/// scheme's default port, lower case; `None` for `null` or anything that is
/// not `scheme://authority`.
fn split_origin(origin: &str) -> Option<(String, String)> {
    let origin = origin.trim().trim_end_matches('/').to_ascii_lowercase();
    let (scheme, authority) = origin.split_once("://")?;
    let valid = |c: char| c.is_ascii_alphanumeric() || "-._~:[]".contains(c);
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        || authority.is_empty()
        || !authority.chars().all(valid)
    {
        return None;
    }
    let authority = strip_default_port(scheme, authority).to_string();
    Some((scheme.to_string(), authority))
}

/// `authority` without the default port of `scheme` (`:80` for http/ws, `:443` for https/wss).
fn strip_default_port<'a>(scheme: &str, authority: &'a str) -> &'a str {
    let default = match scheme {
        "http" | "ws" => ":80",
        "https" | "wss" => ":443",
        _ => return authority,
    };
    authority.strip_suffix(default).unwrap_or(authority)
}

impl OriginPolicy {
    /// Reads `--allowed-origins`: a comma list of origins
    /// (`https://app.example.com`, `http://localhost:3000`) or `*` for any.
    pub fn parse(list: &str) -> Result<OriginPolicy, String> {
        let mut policy = OriginPolicy::default();
        for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            if entry == "*" {
                policy.any = true;
                continue;
            }
            let (scheme, authority) = split_origin(entry).ok_or_else(|| {
                format!("`{entry}` is not an origin: expected `*` or scheme://host[:port], e.g. https://app.example.com")
            })?;
            policy.origins.push(format!("{scheme}://{authority}"));
        }
        Ok(policy)
    }

    /// Whether every origin may connect (`*`).
    pub fn allows_any(&self) -> bool {
        self.any
    }

    /// Whether a handshake's `Origin` may open a WebSocket here; `host` is the
    /// `Host` the request was sent to.
    pub fn allows(&self, origin: &str, host: Option<&str>) -> bool {
        if self.any {
            return true;
        }
        let Some((scheme, authority)) = split_origin(origin) else {
            return false;
        };
        let same_origin = matches!(scheme.as_str(), "http" | "https")
            && host.is_some_and(|h| {
                strip_default_port(&scheme, &h.trim().to_ascii_lowercase()) == authority
            });
        same_origin
            || self
                .origins
                .iter()
                .any(|o| *o == format!("{scheme}://{authority}"))
    }

    /// Checks the `Origin` of an upgrade request: absent (not a browser) or
    /// allowed passes; anything else is 403 `origin_not_allowed`.
    pub fn check(&self, h: &HeaderMap, authority: Option<&str>) -> ApiResult<()> {
        let Some(origin) = h.get(header::ORIGIN) else {
            return Ok(());
        };
        let host = h
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .or(authority);
        let origin = origin.to_str().unwrap_or("");
        if self.allows(origin, host) {
            return Ok(());
        }
        Err(ApiError {
            status: 403,
            kind: "invalid_request_error",
            code: "origin_not_allowed",
            param: Some("origin".into()),
            message: format!(
                "a WebSocket from the origin `{origin}` is not allowed: only the server's own origin \
                 and those of --allowed-origins may connect"
            ),
        })
    }
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
        .any(|p| p == REALTIME_PROTOCOL)
        .then_some(REALTIME_PROTOCOL);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_origin_matches_the_host_with_or_without_default_ports() {
        let p = OriginPolicy::default();
        assert!(p.allows("http://127.0.0.1:8000", Some("127.0.0.1:8000")));
        assert!(p.allows("HTTP://LocalHost:8000", Some("localhost:8000")));
        assert!(p.allows("https://example.com", Some("example.com:443")));
        assert!(p.allows("http://example.com:80", Some("example.com")));
        assert!(p.allows("http://[::1]:8000", Some("[::1]:8000")));
        assert!(!p.allows("http://127.0.0.1:8001", Some("127.0.0.1:8000")));
        assert!(!p.allows("https://evil.example", Some("127.0.0.1:8000")));
        assert!(!p.allows("http://127.0.0.1:8000", None));
        assert!(!p.allows("null", Some("127.0.0.1:8000")));
        assert!(!p.allows("file://127.0.0.1:8000", Some("127.0.0.1:8000")));
    }

    #[test]
    fn allowed_origins_list_and_star() {
        let p = OriginPolicy::parse("https://app.example.com, http://localhost:3000/").unwrap();
        assert!(p.allows("https://app.example.com", Some("127.0.0.1:8000")));
        assert!(p.allows("https://app.example.com:443", Some("127.0.0.1:8000")));
        assert!(p.allows("http://localhost:3000", Some("127.0.0.1:8000")));
        assert!(!p.allows("http://app.example.com", Some("127.0.0.1:8000")));
        assert!(!p.allows("http://localhost:3001", Some("127.0.0.1:8000")));
        let any = OriginPolicy::parse("*").unwrap();
        assert!(any.allows_any());
        assert!(any.allows("null", None));
        assert!(OriginPolicy::parse("app.example.com").is_err());
        assert!(OriginPolicy::parse("https://a.example/path").is_err());
        assert_eq!(OriginPolicy::parse("").unwrap(), OriginPolicy::default());
    }

    #[test]
    fn key_and_protocols_come_from_comma_lists() {
        let mut h = HeaderMap::new();
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("realtime, openai-insecure-api-key.sk-1"),
        );
        assert_eq!(subprotocol_key(&h), Some("sk-1"));
        assert_eq!(
            offered_protocols(&h).collect::<Vec<_>>(),
            ["realtime", "openai-insecure-api-key.sk-1"]
        );
        assert_eq!(subprotocol_key(&HeaderMap::new()), None);
    }
}
