//! The Responses API over HTTP: `POST /v1/responses` (JSON, or SSE with
//! `stream: true`), `GET` / `DELETE /v1/responses/{id}` and
//! `POST /v1/responses/{id}/cancel`. With `store` (the default) a finished
//! response goes into the bounded in-memory store, where
//! `previous_response_id` finds it; with `store: false` it is not kept.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::compat::normalize;
use super::store::InflightResponses;
use super::turn::{begin, prepare};
use super::types::{parse_request, previous_not_found};
use crate::gateway::error::{ApiError, ApiResult};
use crate::gateway::http::{
    next_or_gone, ok_json, read_json, sse_done, sse_frame, sse_response, SSE_BUFFER,
};
use crate::gateway::metrics::Endpoint;
use crate::gateway::AppState;

/// `POST /v1/responses`.
pub async fn create(State(state): State<Arc<AppState>>, body: Body) -> Response {
    state.metrics.request(Endpoint::Responses);
    match run(state.clone(), body).await {
        Ok(r) => r,
        Err(e) => {
            state
                .metrics
                .errors
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            e.into_response()
        }
    }
}

async fn run(state: Arc<AppState>, body: Body) -> ApiResult<Response> {
    let mut obj = read_json(&state, body).await?;
    let custom = normalize(&mut obj);
    let req = parse_request(&state, &obj, false)?;
    let prev = match &req.previous_response_id {
        Some(id) => Some(state.store.get(id).ok_or_else(|| previous_not_found(id))?),
        None => None,
    };
    let stream = req.stream;
    let store = req.store;
    let session = req.cache_key.clone();
    let turn = prepare(&state, req, prev.as_deref()).await?;
    let id = turn.builder.id.clone();
    let (cancel, guard) = InflightResponses::register(&state, &id);
    let running = begin(&state, turn, session, Some(cancel)).await?;
    let (tx, mut events) = mpsc::channel::<Value>(SSE_BUFFER);
    let st = state.clone();
    let custom_final = custom.clone();
    let driver = tokio::spawn(async move {
        let mut outcome = running.drive(&st, &tx).await;
        custom_final.response(&mut outcome.response);
        if let Some(mut stored) = outcome.stored.filter(|_| store) {
            custom_final.response(&mut stored.object);
            let id = stored.object["id"].as_str().unwrap_or_default().to_owned();
            st.store.put(&id, stored);
        }
        st.inflight.finish(&id, outcome.response.clone());
        drop(guard);
        outcome.response
    });
    if !stream {
        // Drain the events; the final object is the driver's result.
        while events.recv().await.is_some() {}
        let response = driver
            .await
            .map_err(|e| ApiError::internal(format!("the response task failed: {e}")))?;
        return Ok(ok_json(&response));
    }
    let (frames_tx, frames) = mpsc::channel::<Bytes>(SSE_BUFFER);
    tokio::spawn(async move {
        let mut custom_items = std::collections::HashSet::new();
        while let Some(mut ev) = next_or_gone(&mut events, &frames_tx).await {
            if !custom.event(&mut ev, &mut custom_items) {
                continue;
            }
            let kind = ev["type"].as_str().unwrap_or("message").to_string();
            if frames_tx.send(sse_frame(Some(&kind), &ev)).await.is_err() {
                return;
            }
        }
        let _ = frames_tx.send(sse_done()).await;
    });
    Ok(sse_response(frames))
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(
        "response_not_found",
        Some("response_id"),
        format!("Response with id '{id}' not found."),
    )
}

/// `GET /v1/responses/{id}`.
pub async fn retrieve(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match state.store.get(&id) {
        Some(r) => ok_json(&r.object),
        None => not_found(&id).into_response(),
    }
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if state.store.delete(&id) {
        ok_json(&json!({"id": id, "object": "response.deleted", "deleted": true}))
    } else {
        not_found(&id).into_response()
    }
}

/// `POST /v1/responses/{id}/cancel`: stops a response that is generating
/// and returns it (status `cancelled`).
pub async fn cancel(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match state.inflight.cancel(&id) {
        Some(mut done) => {
            let wait = done.wait_for(|v| v.is_some());
            match tokio::time::timeout(std::time::Duration::from_secs(30), wait).await {
                Ok(Ok(v)) => ok_json(v.as_ref().unwrap_or(&Value::Null)),
                _ => ApiError::internal("the response did not stop in time").into_response(),
            }
        }
        None => match state.store.get(&id) {
            Some(_) => ApiError::invalid(
                "response_not_cancellable",
                Some("response_id"),
                format!("Response with id '{id}' is not in progress."),
            )
            .into_response(),
            None => not_found(&id).into_response(),
        },
    }
}
