//! The web console at `GET /`: one page that streams a local video file or
//! the webcam to a Realtime session and shows what the server does with it
//! (chunks taken, frames dropped, window evictions, streamed answers and
//! tool calls), with the session's video settings and a question box.
//!
//! The three files beside this one are compiled into the binary
//! (`include_str!`): no build step, no network fetch, nothing from another
//! origin. The page talks to `/v1/models` and `/v1/realtime?model=…` on the
//! origin it came from; the wire it speaks is `docs/protocol.md` (Realtime
//! and live video). The files are public (no API key to fetch them; the key
//! is typed into the page and sent as the WebSocket subprotocol
//! `openai-insecure-api-key.KEY`), and a Content-Security-Policy keeps the
//! page to its own scripts and its own origin.

use std::sync::Arc;

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::AppState;

/// The page.
const INDEX_HTML: &str = include_str!("index.html");
/// Its script.
const CONSOLE_JS: &str = include_str!("console.js");
/// Its styles.
const CONSOLE_CSS: &str = include_str!("console.css");

/// Where the assets live (`/console/console.js`, `/console/console.css`).
const ASSET_PREFIX: &str = "/console/";

/// Scripts and styles from this origin only; sockets and fetches to this
/// origin; frames come from `blob:` (picked files) and the camera stream.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                   img-src 'self' data: blob:; media-src 'self' blob: mediastream:; \
                   connect-src 'self' ws: wss:; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

/// The console's routes: `/` and its assets.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route(
            "/",
            get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }),
        )
        .route(
            "/console/console.js",
            get(|| async { asset(CONSOLE_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/console/console.css",
            get(|| async { asset(CONSOLE_CSS, "text/css; charset=utf-8") }),
        )
}

/// Whether `path` is one of the console's public files (served without the API key).
pub fn is_public(path: &str) -> bool {
    path == "/" || path.starts_with(ASSET_PREFIX)
}

/// A static file with its type; revalidated on every load, so a new binary's
/// console is what the browser runs.
fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut resp = body.into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_loads_only_its_own_assets() {
        assert!(INDEX_HTML.contains("/console/console.js"));
        assert!(INDEX_HTML.contains("/console/console.css"));
        for file in [INDEX_HTML, CONSOLE_JS, CONSOLE_CSS] {
            assert!(!file.contains("http://") && !file.contains("https://"));
        }
        assert!(is_public("/") && is_public("/console/console.js"));
        assert!(!is_public("/v1/models") && !is_public("/consoles"));
    }
}
