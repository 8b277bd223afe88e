//! The Responses API: `POST /v1/responses` (JSON or SSE), retrieve, delete
//! and cancel, and its WebSocket mode on `GET /v1/responses`.

pub mod store;
