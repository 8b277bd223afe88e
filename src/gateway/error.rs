//! Client-facing errors: one [`ApiError`] type with a stable `type` and
//! `code`, rendered in the three wire shapes the protocols use.
//!
//! - HTTP: `{"error":{"message","type","param","code"}}` with the status
//!   code (what the OpenAI SDK reads into its exception classes);
//! - Responses WebSocket mode: `{"type":"error","status","error":{type,code,message,param}}`;
//! - Responses SSE / Realtime: built by their event writers from the same fields.
//!
//! Codes in use (`docs/protocol.md` lists them with their statuses):
//! `invalid_json`, `invalid_type`, `missing_required_parameter`,
//! `invalid_value`, `unsupported_parameter`, `context_length_exceeded`,
//! `body_too_large`, `message_too_large`, `previous_response_not_found`,
//! `response_not_found`, `unknown_tool`, `invalid_api_key`, `not_found`,
//! `method_not_allowed`, `overloaded`, `shutting_down`,
//! `websocket_connection_limit_reached`, `invalid_stream_id`,
//! `websocket_stream_limit_reached`, `unknown_event`, `internal_error`.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// An error a client gets back, with a stable type and code.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{kind}/{code}: {message}")]
pub struct ApiError {
    /// The equivalent HTTP status.
    pub status: u16,
    /// OpenAI's error `type` (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// Stable machine-readable code.
    pub code: &'static str,
    /// The request field concerned, if any.
    pub param: Option<String>,
    /// Human-readable message naming the field and the limit.
    pub message: String,
}

/// Result alias of the gateway.
pub type ApiResult<T> = std::result::Result<T, ApiError>;

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn invalid(code: &'static str, param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            kind: "invalid_request_error",
            code,
            param: param.map(String::from),
            message: message.into(),
        }
    }

    /// A body or frame that is not JSON.
    pub fn invalid_json(e: impl std::fmt::Display) -> Self {
        Self::invalid(
            "invalid_json",
            None,
            format!("the body is not valid JSON: {e}"),
        )
    }

    /// A required field is absent.
    pub fn missing(param: &str) -> Self {
        Self::invalid(
            "missing_required_parameter",
            Some(param),
            format!("missing required parameter: `{param}`"),
        )
    }

    /// A field the server cannot honour (names the field).
    pub fn unsupported(param: &str, why: impl std::fmt::Display) -> Self {
        Self::invalid(
            "unsupported_parameter",
            Some(param),
            format!("`{param}` is not supported: {why}"),
        )
    }

    /// A 404.
    pub fn not_found(code: &'static str, param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            status: 404,
            kind: "invalid_request_error",
            code,
            param: param.map(String::from),
            message: message.into(),
        }
    }

    /// A 401 for a missing or wrong API key.
    pub fn unauthorized() -> Self {
        ApiError {
            status: 401,
            kind: "invalid_request_error",
            code: "invalid_api_key",
            param: None,
            message: "missing or incorrect API key (send `Authorization: Bearer <key>`)".into(),
        }
    }

    /// The server is full; retry later.
    pub fn overloaded(message: impl Into<String>) -> Self {
        ApiError {
            status: 503,
            kind: "server_error",
            code: "overloaded",
            param: None,
            message: message.into(),
        }
    }

    /// The server is shutting down.
    pub fn shutting_down() -> Self {
        ApiError {
            status: 503,
            kind: "server_error",
            code: "shutting_down",
            param: None,
            message: "the server is shutting down".into(),
        }
    }

    /// A failure inside the server.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: 500,
            kind: "server_error",
            code: "internal_error",
            param: None,
            message: message.into(),
        }
    }

    /// The `{message,type,param,code}` object.
    pub fn body(&self) -> Value {
        json!({
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        })
    }

    /// The HTTP body `{"error":{...}}`.
    pub fn http_body(&self) -> Value {
        json!({ "error": self.body() })
    }

    /// The Responses WebSocket-mode error event.
    pub fn ws_event(&self, stream_id: Option<&str>) -> Value {
        let mut v = json!({ "type": "error", "status": self.status, "error": self.body() });
        if let Some(s) = stream_id {
            v["stream_id"] = json!(s);
        }
        v
    }

    /// Whether retrying the same request may succeed (SDKs retry 5xx, 429):
    /// a full engine, shutdown, and every 429 (session slots, a lane's queue).
    pub fn retryable(&self) -> bool {
        self.status == 429 || matches!(self.code, "overloaded" | "shutting_down")
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = json_response(status, &self.http_body());
        let headers = resp.headers_mut();
        if self.retryable() {
            headers.insert("retry-after", HeaderValue::from_static("1"));
        } else if self.status >= 500 {
            // A failure that a replay would repeat: tell the SDK not to retry.
            headers.insert("x-should-retry", HeaderValue::from_static("false"));
        }
        resp
    }
}

pub fn json_response(status: StatusCode, body: &Value) -> Response {
    let text = serde_json::to_vec(body).expect("a JSON value always serialises");
    let mut resp = Response::new(Body::from(text));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_server_answers_carry_retry_after() {
        for e in [
            ApiError::overloaded("full"),
            ApiError::shutting_down(),
            crate::gateway::responses::ws::connection_limit(),
        ] {
            let resp = e.clone().into_response();
            assert_eq!(resp.headers()["retry-after"], "1", "{e}");
            assert!(resp.headers().get("x-should-retry").is_none(), "{e}");
        }
        let resp = ApiError::internal("bug").into_response();
        assert!(resp.headers().get("retry-after").is_none());
        assert_eq!(resp.headers()["x-should-retry"], "false");
    }

    #[test]
    fn http_and_ws_shapes_carry_type_code_and_param() {
        let e = ApiError::unsupported("logprobs", "the engine returns no log-probabilities");
        assert_eq!(e.http_body()["error"]["code"], "unsupported_parameter");
        assert_eq!(e.http_body()["error"]["param"], "logprobs");
        let ws = e.ws_event(Some("lane.a"));
        assert_eq!(ws["type"], "error");
        assert_eq!(ws["status"], 400);
        assert_eq!(ws["error"]["type"], "invalid_request_error");
        assert_eq!(ws["stream_id"], "lane.a");
    }
}
