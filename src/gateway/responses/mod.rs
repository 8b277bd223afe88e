//! The Responses API: `POST /v1/responses` (JSON or SSE), retrieve, delete
//! and cancel over HTTP ([`http`]), and its WebSocket mode on
//! `GET /v1/responses` ([`ws`]). Both run turns through [`turn`]: the
//! request is read by [`types`], events are built by [`events`], and
//! finished responses are kept in a [`store`] for `previous_response_id`.
//! Agent clients' tool and item shapes are normalised by [`compat`] first.

pub mod compat;
pub mod events;
pub mod http;
pub mod store;
pub mod turn;
pub mod types;
pub mod ws;
