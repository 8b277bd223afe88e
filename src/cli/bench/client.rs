//! The HTTP side of `caracal bench --url`: one streamed OpenAI request over a
//! plain HTTP/1.1 connection (hyper's client connection on a tokio socket),
//! timed as its server-sent events arrive. Knows the chunk shapes of Chat
//! Completions (`choices[0].delta.content`) and Completions
//! (`choices[0].text`) and the final `usage` chunk that
//! `stream_options.include_usage` asks for.

use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, Uri};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

/// Largest error body kept for a message.
const ERROR_BODY_CHARS: usize = 400;

/// Failures the server (rather than the network) caused, as their own types so a
/// report can count them by kind (connection failures are the `std::io::Error`
/// under the `connecting to` context; the rest are the transport's).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A non-2xx status.
    #[error("HTTP {status} from {url}: {body}")]
    Status {
        /// The status code.
        status: u16,
        /// The request URL.
        url: String,
        /// The start of the response body.
        body: String,
    },
    /// An `error` object inside the event stream.
    #[error("error event: {0}")]
    Event(String),
    /// The stream closed before its `[DONE]` event.
    #[error("the event stream ended without [DONE]")]
    Truncated,
}

/// Where requests go: the server's address, the path prefix before `/v1`
/// and the bearer key.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port` to connect to (also the `Host` header).
    authority: String,
    /// Path before `/v1` (empty for a server at the root).
    prefix: String,
    /// Sent as `Authorization: Bearer …` when present.
    api_key: Option<String>,
}

/// Token counts a server reported in `usage`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: usize,
    /// `usage.completion_tokens`.
    pub completion_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens`, when the server reports it.
    pub cached_tokens: Option<usize>,
}

/// What one streamed request measured.
#[derive(Debug, Clone)]
pub struct Streamed {
    /// Seconds from sending the request to the first non-empty content delta.
    pub ttft: Option<f64>,
    /// Seconds between consecutive content deltas.
    pub itl: Vec<f64>,
    /// Seconds from sending the request to the end of the stream.
    pub e2e: f64,
    /// The generated text, concatenated.
    pub text: String,
    /// Non-empty content deltas received.
    pub deltas: usize,
    /// The final usage chunk, if the server sent one.
    pub usage: Option<Usage>,
}

impl Streamed {
    /// Output tokens: the server's count, else the number of content deltas.
    pub fn output_tokens(&self) -> usize {
        self.usage
            .map(|u| u.completion_tokens)
            .unwrap_or(self.deltas)
    }
}

impl Target {
    /// Parses `http://host[:port][/prefix]`; a trailing `/v1` is dropped, so
    /// both `http://127.0.0.1:8000` and `http://127.0.0.1:8000/v1` work.
    pub fn parse(url: &str, api_key: Option<String>) -> Result<Target> {
        let uri: Uri = url
            .parse()
            .with_context(|| format!("`--url {url}` is not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => bail!("`--url` must be plain http://, got {other}://"),
            None => bail!("`--url` needs a scheme, e.g. http://127.0.0.1:8000"),
        }
        let host = uri
            .host()
            .ok_or_else(|| anyhow!("`--url {url}` has no host"))?;
        let port = uri.port_u16().unwrap_or(80);
        let mut prefix = uri.path().trim_end_matches('/').to_string();
        if let Some(p) = prefix.strip_suffix("/v1") {
            prefix = p.to_string();
        }
        Ok(Target {
            authority: format!("{host}:{port}"),
            prefix,
            api_key: api_key.filter(|k| !k.is_empty()),
        })
    }

    /// The URL of `path` (which starts with `/v1/...`), for messages.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}{}", self.authority, self.prefix, path)
    }

    /// Sends one request on a fresh connection and returns its response.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<hyper::Response<hyper::body::Incoming>> {
        let stream = TcpStream::connect(&self.authority)
            .await
            .with_context(|| format!("connecting to {}", self.authority))?;
        stream.set_nodelay(true)?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .context("HTTP handshake")?;
        tokio::spawn(async move {
            // The connection ends with the response; its error, if any,
            // surfaces on the response body.
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{}", self.prefix, path))
            .header(hyper::header::HOST, &self.authority);
        if let Some(key) = &self.api_key {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let bytes = match body {
            Some(v) => {
                req = req.header(hyper::header::CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(v)?)
            }
            None => Bytes::new(),
        };
        let req = req.body(Full::new(bytes))?;
        let resp = sender
            .send_request(req)
            .await
            .with_context(|| format!("{} {}", "sending to", self.url(path)))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.into_body().collect().await?.to_bytes();
            let text: String = String::from_utf8_lossy(&body)
                .chars()
                .take(ERROR_BODY_CHARS)
                .collect();
            return Err(ServerError::Status {
                status: status.as_u16(),
                url: self.url(path),
                body: text,
            }
            .into());
        }
        Ok(resp)
    }

    /// `GET path` as text (e.g. `/metrics`).
    pub async fn get_text(&self, path: &str) -> Result<String> {
        let resp = self.send(Method::GET, path, None).await?;
        let body = resp.into_body().collect().await?.to_bytes();
        String::from_utf8(body.to_vec()).with_context(|| format!("{} is not UTF-8", self.url(path)))
    }

    /// `GET path` as JSON.
    pub async fn get_json(&self, path: &str) -> Result<Value> {
        let resp = self.send(Method::GET, path, None).await?;
        let body = resp.into_body().collect().await?.to_bytes();
        serde_json::from_slice(&body).with_context(|| format!("{} is not JSON", self.url(path)))
    }

    /// `POST path` with a streaming body and times its events.
    pub async fn stream(&self, path: &str, body: &Value) -> Result<Streamed> {
        let t0 = Instant::now();
        let resp = self.send(Method::POST, path, Some(body)).await?;
        let mut body = resp.into_body();
        let mut sse = SseBuffer::default();
        let mut out = Streamed {
            ttft: None,
            itl: Vec::new(),
            e2e: 0.0,
            text: String::new(),
            deltas: 0,
            usage: None,
        };
        let mut last = t0;
        let mut done = false;
        while !done {
            let Some(frame) = body.frame().await else {
                break;
            };
            let frame = frame.context("reading the event stream")?;
            let Some(chunk) = frame.data_ref() else {
                continue;
            };
            let now = Instant::now();
            sse.push(chunk);
            while let Some(data) = sse.next_event() {
                if data.trim() == "[DONE]" {
                    done = true;
                    break;
                }
                let v: Value = serde_json::from_str(&data)
                    .with_context(|| format!("an event that is not JSON: {data}"))?;
                if let Some(err) = v.get("error") {
                    return Err(ServerError::Event(err.to_string()).into());
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    out.usage = Some(parse_usage(u));
                }
                let text = content_delta(&v);
                if text.is_empty() {
                    continue;
                }
                match out.ttft {
                    None => out.ttft = Some((now - t0).as_secs_f64()),
                    Some(_) => out.itl.push((now - last).as_secs_f64()),
                }
                last = now;
                out.deltas += 1;
                out.text.push_str(&text);
            }
        }
        if !done {
            return Err(ServerError::Truncated.into());
        }
        out.e2e = t0.elapsed().as_secs_f64();
        Ok(out)
    }
}

/// The generated text in one chunk: chat `delta.content` (and
/// `delta.reasoning_content`) or completions `text`.
fn content_delta(v: &Value) -> String {
    let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
        return String::new();
    };
    let mut s = String::new();
    if let Some(d) = choice.get("delta") {
        for key in ["reasoning_content", "content"] {
            if let Some(t) = d.get(key).and_then(Value::as_str) {
                s.push_str(t);
            }
        }
    } else if let Some(t) = choice.get("text").and_then(Value::as_str) {
        s.push_str(t);
    }
    s
}

/// Reads a `usage` object.
fn parse_usage(u: &Value) -> Usage {
    let n = |v: Option<&Value>| v.and_then(Value::as_u64).map(|x| x as usize);
    Usage {
        prompt_tokens: n(u.get("prompt_tokens")).unwrap_or(0),
        completion_tokens: n(u.get("completion_tokens")).unwrap_or(0),
        cached_tokens: n(u
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))),
    }
}

/// Splits a byte stream into server-sent events and returns each event's
/// joined `data:` lines.
#[derive(Debug, Default)]
struct SseBuffer {
    /// Bytes not yet split into complete events.
    pending: Vec<u8>,
}

impl SseBuffer {
    /// Appends received bytes.
    fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
    }

    /// The data of the next complete event, if one has arrived; events
    /// without data (comments, keep-alives) are skipped.
    fn next_event(&mut self) -> Option<String> {
        loop {
            let (end, sep) = find_event_end(&self.pending)?;
            let raw: Vec<u8> = self.pending.drain(..end + sep).collect();
            let text = String::from_utf8_lossy(&raw[..end]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|l| l.strip_prefix(' ').unwrap_or(l))
                .collect();
            if !data.is_empty() {
                return Some(data.join("\n"));
            }
        }
    }
}

/// Offset and length of the first blank-line separator (`\n\n` or `\r\n\r\n`).
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 <= c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_chunks_and_separators() {
        let mut b = SseBuffer::default();
        b.push(b"data: {\"a\":1}\n\ndata: {\"b\"");
        assert_eq!(b.next_event().as_deref(), Some("{\"a\":1}"));
        assert_eq!(b.next_event(), None);
        b.push(b":2}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n");
        assert_eq!(b.next_event().as_deref(), Some("{\"b\":2}"));
        assert_eq!(b.next_event().as_deref(), Some("[DONE]"));
        assert_eq!(b.next_event(), None);
    }

    #[test]
    fn urls_with_and_without_v1() {
        let t = Target::parse("http://127.0.0.1:8000/v1/", None).expect("url");
        assert_eq!(
            t.url("/v1/models"),
            "http://127.0.0.1:8000/v1/models".to_string()
        );
        let t = Target::parse("http://localhost/api", Some(String::new())).expect("url");
        assert_eq!(t.url("/v1/models"), "http://localhost:80/api/v1/models");
        assert!(t.api_key.is_none());
        assert!(Target::parse("https://x", None).is_err());
        assert!(Target::parse("127.0.0.1:8000", None).is_err());
    }

    #[test]
    fn deltas_and_usage_of_both_endpoints() {
        let chat: Value = serde_json::json!({"choices":[{"delta":{"content":"hi"}}]});
        assert_eq!(content_delta(&chat), "hi");
        let comp: Value = serde_json::json!({"choices":[{"text":" there"}]});
        assert_eq!(content_delta(&comp), " there");
        let u = parse_usage(
            &serde_json::json!({"prompt_tokens": 10, "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 7}}),
        );
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (10, 3, Some(7))
        );
        assert_eq!(parse_usage(&serde_json::json!({})).cached_tokens, None);
    }
}
