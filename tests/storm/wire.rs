//! Raw-socket clients for the storm tests: HTTP/1.1 written by hand (so a
//! client can stop at any byte of a request, or stop reading at any frame
//! of an answer), SSE events read off chunked bodies, `/metrics` parsed,
//! and WebSocket sessions on tokio-tungstenite (or handshakes written by
//! hand, for the half-open ones).

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Longest wait for any single answer: past it the server counts as hung.
pub const ANSWER: Duration = Duration::from_secs(90);

/// The bytes of one request (`Connection: close`, JSON body if any).
pub fn request(method: &str, path: &str, body: Option<&[u8]>) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body.unwrap_or_default());
    out
}

/// A TCP connection to `addr` whose receive buffer is `rcvbuf` bytes
/// (`None`: the system defaults). With a small one the connection also
/// announces a small segment size, which keeps the server's send buffer
/// (sized from it at connect time) small as well: a client that stops
/// reading then stalls the server after kilobytes, not megabytes.
pub async fn connect(addr: SocketAddr, rcvbuf: Option<u32>) -> io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    if let Some(n) = rcvbuf {
        socket.set_recv_buffer_size(n)?;
        set_max_segment(&socket, 536)?;
    }
    socket.connect(addr).await
}

/// `TCP_MAXSEG` on a socket before it connects.
fn set_max_segment(socket: &TcpSocket, bytes: libc::c_int) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid socket descriptor and a pointer to a c_int that
    // outlives the call, with its size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_MAXSEG,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A whole answer.
#[derive(Debug)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The decoded body.
    pub body: Vec<u8>,
}

impl Response {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }

    /// The body as JSON (a string when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&self.body).into_owned()))
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// How the body is delimited.
enum Framing {
    /// Chunked: the chunk-size line is next.
    ChunkSize,
    /// Chunked: this many bytes of the current chunk are left.
    ChunkData(usize),
    /// Chunked: the CRLF after a chunk's data is next.
    ChunkEnd,
    /// `Content-Length`: this many bytes are left.
    Length(usize),
    /// Until the server closes.
    Close,
}

/// An answer being read: the head parsed, the body decoded as it comes.
pub struct Reader {
    /// The connection.
    pub stream: TcpStream,
    /// Bytes read but not yet decoded.
    raw: Vec<u8>,
    /// Status code.
    pub status: u16,
    /// Headers, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// Body framing state.
    framing: Framing,
    /// The body ended.
    done: bool,
}

impl Reader {
    /// Reads the head of the answer on `stream`.
    pub async fn start(mut stream: TcpStream) -> io::Result<Reader> {
        let mut raw = Vec::new();
        let end = loop {
            if let Some(p) = find(&raw, b"\r\n\r\n") {
                break p;
            }
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "closed before a response head",
                ));
            }
            raw.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&raw[..end]).into_owned();
        raw.drain(..end + 4);
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, head.clone()))?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let framing = if header(&headers, "transfer-encoding")
            .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
        {
            Framing::ChunkSize
        } else if let Some(n) = header(&headers, "content-length").and_then(|v| v.parse().ok()) {
            Framing::Length(n)
        } else if status == 101 {
            Framing::Length(0)
        } else {
            Framing::Close
        };
        Ok(Reader {
            stream,
            raw,
            status,
            headers,
            framing,
            done: false,
        })
    }

    /// Reads more bytes; false at the end of the stream.
    async fn fill(&mut self) -> io::Result<bool> {
        let mut buf = [0u8; 16384];
        let n = self.stream.read(&mut buf).await?;
        self.raw.extend_from_slice(&buf[..n]);
        Ok(n > 0)
    }

    /// The next decoded body bytes; empty at the end of the body.
    pub async fn chunk(&mut self) -> io::Result<Vec<u8>> {
        loop {
            if self.done {
                return Ok(Vec::new());
            }
            match self.framing {
                Framing::ChunkSize => {
                    if let Some(p) = find(&self.raw, b"\r\n") {
                        let line = String::from_utf8_lossy(&self.raw[..p]).into_owned();
                        self.raw.drain(..p + 2);
                        let hex = line.split(';').next().unwrap_or("").trim();
                        let n = usize::from_str_radix(hex, 16).map_err(|_| {
                            io::Error::new(
                                io::ErrorKind::InvalidData,
                                format!("chunk size {line:?}"),
                            )
                        })?;
                        if n == 0 {
                            self.done = true;
                        } else {
                            self.framing = Framing::ChunkData(n);
                        }
                        continue;
                    }
                }
                Framing::ChunkData(n) if !self.raw.is_empty() => {
                    let k = n.min(self.raw.len());
                    let out: Vec<u8> = self.raw.drain(..k).collect();
                    self.framing = if k == n {
                        Framing::ChunkEnd
                    } else {
                        Framing::ChunkData(n - k)
                    };
                    return Ok(out);
                }
                Framing::ChunkEnd if self.raw.len() >= 2 => {
                    self.raw.drain(..2);
                    self.framing = Framing::ChunkSize;
                    continue;
                }
                Framing::Length(0) => {
                    self.done = true;
                    continue;
                }
                Framing::Length(n) if !self.raw.is_empty() => {
                    let k = n.min(self.raw.len());
                    let out: Vec<u8> = self.raw.drain(..k).collect();
                    self.framing = Framing::Length(n - k);
                    return Ok(out);
                }
                Framing::Close if !self.raw.is_empty() => {
                    return Ok(std::mem::take(&mut self.raw));
                }
                _ => {}
            }
            if !self.fill().await? {
                self.done = true;
            }
        }
    }

    /// The rest of the body.
    pub async fn all(mut self) -> io::Result<Response> {
        let mut body = Vec::new();
        loop {
            let c = self.chunk().await?;
            if c.is_empty() {
                break;
            }
            body.extend(c);
        }
        Ok(Response {
            status: self.status,
            headers: self.headers,
            body,
        })
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Reads the whole answer on `stream` (a missing answer within [`ANSWER`]
/// is a hang).
pub async fn read_answer(stream: TcpStream) -> Response {
    let fut = async { Reader::start(stream).await?.all().await };
    tokio::time::timeout(ANSWER, fut)
        .await
        .unwrap_or_else(|_| panic!("no answer within {ANSWER:?}"))
        .unwrap_or_else(|e| panic!("reading the answer: {e}"))
}

/// Sends one request on a fresh connection and reads the whole answer.
pub async fn call(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Response {
    let bytes = body.map(|b| serde_json::to_vec(b).expect("JSON serialises"));
    let fut = async {
        let mut s = connect(addr, None).await?;
        s.write_all(&request(method, path, bytes.as_deref()))
            .await?;
        Reader::start(s).await?.all().await
    };
    tokio::time::timeout(ANSWER, fut)
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no answer within {ANSWER:?}"))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// An SSE stream being read event by event.
pub struct Sse {
    /// The answer.
    pub reader: Reader,
    /// Decoded text not yet split into events.
    text: String,
    /// `data: [DONE]` was seen.
    pub done: bool,
}

impl Sse {
    /// Opens `path` with `body` on `stream`: the stream, or the whole
    /// answer when it is not a 200.
    pub async fn open_on(
        mut stream: TcpStream,
        path: &str,
        body: &Value,
    ) -> io::Result<Result<Sse, Response>> {
        let bytes = serde_json::to_vec(body).expect("JSON serialises");
        stream
            .write_all(&request("POST", path, Some(&bytes)))
            .await?;
        let reader = Reader::start(stream).await?;
        if reader.status != 200 {
            return Ok(Err(reader.all().await?));
        }
        Ok(Ok(Sse {
            reader,
            text: String::new(),
            done: false,
        }))
    }

    /// [`Sse::open_on`] a fresh connection.
    pub async fn open(
        addr: SocketAddr,
        path: &str,
        body: &Value,
    ) -> io::Result<Result<Sse, Response>> {
        Sse::open_on(connect(addr, None).await?, path, body).await
    }

    /// The next `data:` JSON; `None` at `[DONE]` or the end of the body.
    pub async fn next(&mut self) -> io::Result<Option<Value>> {
        loop {
            if let Some(data) = crate::common::take_sse_data(&mut self.text) {
                if data == "[DONE]" {
                    self.done = true;
                    return Ok(None);
                }
                return serde_json::from_str(&data)
                    .map(Some)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e));
            }
            let c = self.reader.chunk().await?;
            if c.is_empty() {
                return Ok(None);
            }
            self.text.push_str(&String::from_utf8_lossy(&c));
        }
    }
}

/// `GET /metrics` as name (with labels) → value.
pub async fn metrics(addr: SocketAddr) -> HashMap<String, f64> {
    let r = call(addr, "GET", "/metrics", None).await;
    assert_eq!(r.status, 200, "/metrics answers");
    String::from_utf8_lossy(&r.body)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

/// A WebSocket client session.
pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Opens a WebSocket on `path` (`/v1/responses`, `/v1/realtime?model=…`).
pub async fn ws(addr: SocketAddr, path: &str) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
    tokio_tungstenite::connect_async(format!("ws://{addr}{path}"))
        .await
        .map(|(ws, _)| ws)
}

/// [`ws`] over a connection with a `rcvbuf`-byte receive buffer.
pub async fn ws_small_buffer(
    addr: SocketAddr,
    path: &str,
    rcvbuf: u32,
) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
    let stream = connect(addr, Some(rcvbuf)).await?;
    tokio_tungstenite::client_async(format!("ws://{addr}{path}"), MaybeTlsStream::Plain(stream))
        .await
        .map(|(ws, _)| ws)
}

/// Sends one JSON event.
pub async fn ws_send(ws: &mut Ws, v: &Value) -> Result<(), tokio_tungstenite::tungstenite::Error> {
    ws.send(Message::text(v.to_string())).await
}

/// What came next on a socket.
#[derive(Debug)]
pub enum WsNext {
    /// A JSON text frame.
    Event(Value),
    /// A close frame with its code.
    Closed(Option<u16>),
    /// The stream ended or failed without a close frame.
    Gone,
}

/// The next JSON event (pings and pongs skipped).
pub async fn ws_next(ws: &mut Ws) -> WsNext {
    loop {
        let msg = tokio::time::timeout(ANSWER, ws.next())
            .await
            .unwrap_or_else(|_| panic!("the server sent nothing for {ANSWER:?}"));
        return match msg {
            Some(Ok(Message::Text(t))) => match serde_json::from_str(t.as_str()) {
                Ok(v) => WsNext::Event(v),
                Err(e) => panic!("a text frame that is not JSON ({e}): {t}"),
            },
            Some(Ok(Message::Close(f))) => WsNext::Closed(f.map(|f| u16::from(f.code))),
            Some(Ok(_)) => continue,
            Some(Err(_)) | None => WsNext::Gone,
        };
    }
}

/// A hand-written WebSocket handshake for `path` (half-open clients send
/// part of it).
pub fn ws_handshake(path: &str) -> Vec<u8> {
    format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    .into_bytes()
}

/// The server process's open descriptors (`/proc/<pid>/fd`).
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The soft and hard open-files limits of process `pid` (`/proc/<pid>/limits`).
pub fn fd_limits(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    let mut nums = line
        .split_whitespace()
        .skip(3)
        .filter_map(|w| w.parse::<u64>().ok());
    Some((nums.next()?, nums.next()?))
}
