//! The accept loop: every TCP connection is served by hyper's HTTP/1
//! connection (with upgrades, for the WebSocket routes) on a task of its
//! own, under a timer that closes a connection waiting too long for a
//! request head.
//!
//! Why not `axum::serve`: it sets no timer, so hyper's header read timeout
//! never runs and a client that connects and sends nothing, or half a
//! request head, or half a WebSocket handshake, holds a descriptor and a
//! task for as long as it likes (slowloris). Here the timeout
//! (`--timeout-keep-alive`, [`ConnLimits::head_timeout`]) is hyper's
//! `header_read_timeout`, which runs whenever the connection waits for a
//! head: on a fresh connection until its first head is complete, and on a
//! kept-alive one from the end of a response to the next head — the
//! header read timeout of hyper and nginx's `client_header_timeout`, and
//! uvicorn's `--timeout-keep-alive` in one. It does not run while a body
//! is read or a response streams, and an upgraded connection (a WebSocket
//! session) has left hyper: sessions are ended by their own idle timeout.
//!
//! Shutdown: once `drain` resolves the listener is dropped (no new
//! connections), every connection is told to finish gracefully (hyper
//! closes it after its response in flight), and [`serve`] returns when the
//! last one has ended.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

/// How connections are served.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// A connection waiting this long for a complete request head (fresh,
    /// or idle between requests) is closed; `None`: never.
    pub head_timeout: Option<Duration>,
}

/// Pause after an accept error other than a connection's own (e.g. out of
/// descriptors, EMFILE), so the loop does not spin while the cause lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `app` on `listener` until `drain` resolves, then lets open
/// connections finish; returns when the last one has closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    drain: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let (drain_tx, drain_rx) = watch::channel(false);
    // Every connection task holds a clone; `recv` yields `None` once all are gone.
    let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
    tokio::pin!(drain);
    loop {
        let accepted = tokio::select! {
            _ = &mut drain => break,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, _peer)) => {
                let conn = connection(stream, app.clone(), limits, drain_rx.clone());
                let alive = alive_tx.clone();
                tokio::spawn(async move {
                    conn.await;
                    drop(alive);
                });
            }
            Err(e) if is_connection_error(&e) => {}
            Err(e) => {
                tracing::warn!("accept failed: {e}; retrying in {ACCEPT_BACKOFF:?}");
                tokio::select! {
                    _ = &mut drain => break,
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                }
            }
        }
    }
    drop(listener);
    let _ = drain_tx.send(true);
    drop(alive_tx);
    let _ = alive_rx.recv().await;
    Ok(())
}

/// Serves one connection until it closes, finishing gracefully once
/// `drain` turns true.
async fn connection(
    stream: TcpStream,
    app: Router,
    limits: ConnLimits,
    mut drain: watch::Receiver<bool>,
) {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.head_timeout);
    let conn = builder
        .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app))
        .with_upgrades();
    tokio::pin!(conn);
    let mut draining = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            _ = drain.wait_for(|d| *d), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Errors that concern one connection only (it was reset or aborted before
/// it was accepted): the next accept goes on at once.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}
