//! Routing, authentication and the small endpoints: `GET /health`,
//! `GET /v1/models`, `GET /metrics`; plus the JSON and SSE response helpers
//! the protocol handlers share.
//!
//! The auth layer runs before every route: a WebSocket upgrade's `Origin`
//! is checked first ([`super::upgrade::OriginPolicy`]), then, with
//! `--api-key`, the key: `Authorization: Bearer KEY`, or on an upgrade the
//! subprotocol `openai-insecure-api-key.KEY`. `/health` and the console's
//! static files need no key (the console asks for it and sends it itself).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::error::{json_response, ApiError, ApiResult};
use super::fields::parse_body;
use super::upgrade::subprotocol_key;
use super::{chat, completions, console, realtime, responses, AppState};

/// Frames buffered per SSE response before its producer waits.
pub const SSE_BUFFER: usize = 16;

/// The gateway's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_by_id))
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route(
            "/v1/responses",
            post(responses::http::create).get(responses_get_or_upgrade),
        )
        .route(
            "/v1/responses/{id}",
            get(responses::http::retrieve).delete(responses::http::delete),
        )
        .route("/v1/responses/{id}/cancel", post(responses::http::cancel))
        .route("/v1/realtime", get(realtime::upgrade))
        .merge(console::routes())
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}

/// Constant-time equality (the length is not secret).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= (a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0)) as usize;
    }
    diff == 0
}

/// Checks a WebSocket upgrade's `Origin`, then the key when `--api-key` is
/// set: `Authorization: Bearer <key>`, or on an upgrade the key subprotocol
/// (`/health` and the console are open).
async fn auth(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let upgrade = wants_upgrade(req.headers());
    if upgrade {
        let authority = req.uri().authority().map(|a| a.as_str());
        if let Err(e) = state.config.allowed_origins.check(req.headers(), authority) {
            return e.into_response();
        }
    }
    if let Some(key) = state.config.api_key.as_deref() {
        let path = req.uri().path();
        if path != "/health" && !console::is_public(path) {
            let h = req.headers();
            let bearer = h
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            let given = match bearer {
                Some(b) => b,
                None if upgrade => subprotocol_key(h).unwrap_or(""),
                None => "",
            };
            if !ct_eq(given.trim().as_bytes(), key.as_bytes()) {
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

async fn not_found(method: Method, uri: axum::http::Uri) -> Response {
    ApiError::not_found(
        "not_found",
        None,
        format!("no route for {method} {}", uri.path()),
    )
    .into_response()
}

/// A 200 JSON response.
pub fn ok_json(body: &Value) -> Response {
    json_response(StatusCode::OK, body)
}

/// Reads a request body up to the configured limit and parses it as a JSON
/// object. A body that sends nothing for `--body-read-timeout` gets a 408
/// (`request_timeout`), one that breaks off a 400 (`invalid_body`).
pub async fn read_json(state: &AppState, body: Body) -> ApiResult<Map<String, Value>> {
    use axum::body::HttpBody;
    use futures::StreamExt;
    let limit = state.config.max_body_bytes;
    let too_large = || ApiError {
        status: 413,
        kind: "invalid_request_error",
        code: "body_too_large",
        param: None,
        message: format!("the body is larger than the limit of {limit} bytes (--max-body-bytes)"),
    };
    // A `Content-Length` past the limit is refused before any of the body
    // is read (a client that announces 1 GiB and sends nothing gets its
    // 413 at once instead of holding the connection open).
    if body.size_hint().lower() > limit as u64 {
        return Err(too_large());
    }
    let wait = state.config.body_timeout;
    let mut chunks = body.into_data_stream();
    let mut bytes = Vec::new();
    loop {
        let next = match wait {
            Some(t) => tokio::time::timeout(t, chunks.next())
                .await
                .map_err(|_| ApiError {
                    status: 408,
                    kind: "invalid_request_error",
                    code: "request_timeout",
                    param: None,
                    message: format!(
                        "the request body sent nothing for {} s (--body-read-timeout)",
                        t.as_secs()
                    ),
                })?,
            None => chunks.next().await,
        };
        match next {
            None => break,
            Some(Ok(chunk)) if bytes.len() + chunk.len() > limit => return Err(too_large()),
            Some(Ok(chunk)) => bytes.extend_from_slice(&chunk),
            Some(Err(e)) => {
                return Err(ApiError::invalid(
                    "invalid_body",
                    None,
                    format!("the request body could not be read: {e}"),
                ))
            }
        }
    }
    parse_body(&bytes)
}

/// One SSE frame: `data: <json>\n\n`, with an `event:` line when `event` is given.
pub fn sse_frame(event: Option<&str>, data: &Value) -> Bytes {
    let json = serde_json::to_string(data).expect("a JSON value always serialises");
    match event {
        Some(e) => Bytes::from(format!("event: {e}\ndata: {json}\n\n")),
        None => Bytes::from(format!("data: {json}\n\n")),
    }
}

/// The `data: [DONE]` frame.
pub fn sse_done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// The next item of `rx`, or `None` as soon as the consumer behind `out`
/// is gone. A relay that waited on `rx` alone would notice a client that
/// hung up only at its next send, i.e. after the prompt's whole prefill and
/// the first token; this returns at once, and dropping `rx` then cancels the
/// generation within one scheduler step.
pub async fn next_or_gone<T, U>(rx: &mut mpsc::Receiver<T>, out: &mpsc::Sender<U>) -> Option<T> {
    tokio::select! {
        item = rx.recv() => item,
        () = out.closed() => None,
    }
}

/// An SSE response fed by a bounded channel of frames; when the client
/// goes away the receiver is dropped and the producer's sends fail.
pub fn sse_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), rx))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.shutdown.is_shutting_down() {
        return json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "shutting_down"}),
        );
    }
    ok_json(&json!({"status": "ok", "model": state.model.name}))
}

/// The model object of `/v1/models`.
fn model_object(state: &AppState) -> Value {
    let m = &state.model;
    let mut modalities = vec!["text"];
    if m.vision {
        modalities.extend(["image", "video"]);
    }
    json!({
        "id": m.name,
        "object": "model",
        "created": m.created,
        "owned_by": "caracal",
        "context_length": m.info.max_position,
        "max_model_len": m.info.max_position,
        "input_modalities": modalities,
        "output_modalities": ["text"],
        "supports_images": m.vision,
        "supports_video": m.vision,
        "supports_tools": m.format.is_some(),
        "model_type": m.info.model_type,
    })
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    ok_json(&json!({"object": "list", "data": [model_object(&state)]}))
}

async fn model_by_id(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id != state.model.name {
        return ApiError::not_found(
            "model_not_found",
            Some("model"),
            format!(
                "The model `{id}` does not exist (this server serves `{}`)",
                state.model.name
            ),
        )
        .into_response();
    }
    ok_json(&model_object(&state))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let snap = state.engine.snapshot().await;
    let mut text = state.metrics.render(&snap);
    if let Some(media) = &state.media {
        super::metrics::render_vision(&mut text, &media.stats());
    }
    let mut resp = Response::new(Body::from(text));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

/// Checks the request's `model` against the served name (absent is fine).
pub fn check_model(state: &AppState, model: Option<&str>) -> ApiResult<String> {
    match model {
        None | Some("") => Ok(state.model.name.clone()),
        Some(m) if m == state.model.name => Ok(m.to_string()),
        Some(m) => Err(ApiError::not_found(
            "model_not_found",
            Some("model"),
            format!(
                "The model `{m}` does not exist (this server serves `{}`)",
                state.model.name
            ),
        )),
    }
}

/// Whether headers ask for a WebSocket upgrade (`websocket` among the
/// `Upgrade` tokens, as the handshake check reads them).
pub fn wants_upgrade(headers: &HeaderMap) -> bool {
    headers.get_all(header::UPGRADE).iter().any(|v| {
        v.to_str()
            .map(|s| {
                s.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("websocket"))
            })
            .unwrap_or(false)
    })
}

/// `GET /v1/responses`: the WebSocket mode with an upgrade, else 426.
async fn responses_get_or_upgrade(state: State<Arc<AppState>>, req: Request) -> Response {
    if wants_upgrade(req.headers()) {
        return responses::ws::upgrade(state, req).await;
    }
    ApiError {
        status: 426,
        kind: "invalid_request_error",
        code: "upgrade_required",
        param: None,
        message:
            "GET /v1/responses is the WebSocket mode: send an Upgrade request, or POST to create"
                .into(),
    }
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_compare_is_equality() {
        assert!(ct_eq(b"secret", b"secret"));
        assert!(!ct_eq(b"secret", b"secreT"));
        assert!(!ct_eq(b"secret", b"secret2"));
        assert!(!ct_eq(b"", b"x"));
    }
}
