//! Responses kept for `previous_response_id`: a bounded store with a TTL
//! (HTTP with `store: true`, and one per WebSocket connection, where the
//! chain is kept even with `store: false`), and the registry of responses
//! generating now, for `POST /v1/responses/{id}/cancel`.
//!
//! A stored response holds what the next turn needs: the conversation up
//! to and including its output (without `instructions`, which each request
//! brings anew), and the prompt-plus-output text and ids that the engine
//! cached, so the next prompt reuses those ids ([`CachedPrefix`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::watch;

use crate::chat::toolcall::Message;
use crate::gateway::model::CachedPrefix;

/// One finished response.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The response object as returned.
    pub object: Value,
    /// Conversation so far: earlier turns' inputs and outputs plus this one's.
    pub context: Vec<Message>,
    /// Prompt and output as cached by the engine.
    pub prefix: CachedPrefix,
    /// The input items of this turn (for `input_items`-style inspection).
    pub input_items: Vec<Value>,
    /// The WebSocket lane (`stream_id`) that produced it, if any.
    pub lane: Option<String>,
}

/// Entries and their insertion order.
#[derive(Debug, Default)]
struct Inner {
    /// By id, with the time stored.
    map: HashMap<String, (Instant, Arc<StoredResponse>)>,
    /// Ids oldest first (may hold ids already removed).
    order: VecDeque<String>,
}

/// A bounded, expiring map of responses.
#[derive(Debug)]
pub struct ResponseStore {
    /// Entries.
    inner: Mutex<Inner>,
    /// Most entries; the oldest goes first.
    capacity: usize,
    /// Entry lifetime.
    ttl: Duration,
}

impl ResponseStore {
    /// A store of at most `capacity` entries living `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> ResponseStore {
        ResponseStore {
            inner: Mutex::new(Inner::default()),
            capacity: capacity.max(1),
            ttl,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind: keep using it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores (or replaces) `id`.
    pub fn put(&self, id: &str, resp: StoredResponse) {
        let mut g = self.lock();
        if g.map
            .insert(id.to_string(), (Instant::now(), Arc::new(resp)))
            .is_none()
        {
            g.order.push_back(id.to_string());
        }
        while g.map.len() > self.capacity {
            let Some(old) = g.order.pop_front() else {
                break;
            };
            g.map.remove(&old);
        }
        if g.order.len() > 2 * self.capacity {
            let Inner { map, order } = &mut *g;
            order.retain(|k| map.contains_key(k));
        }
    }

    /// The live entry for `id`.
    pub fn get(&self, id: &str) -> Option<Arc<StoredResponse>> {
        let mut g = self.lock();
        let (at, resp) = g.map.get(id)?;
        if at.elapsed() > self.ttl {
            g.map.remove(id);
            return None;
        }
        Some(resp.clone())
    }

    /// Removes `id`; whether it was there.
    pub fn delete(&self, id: &str) -> bool {
        self.lock().map.remove(id).is_some()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The switches of one response that is generating.
#[derive(Debug)]
struct Inflight {
    /// Set to true to cancel.
    cancel: watch::Sender<bool>,
    /// The final response object, once there is one.
    done: watch::Sender<Option<Value>>,
}

/// Responses generating now, by id.
#[derive(Debug, Default)]
pub struct InflightResponses {
    /// By response id.
    map: Mutex<HashMap<String, Inflight>>,
}

/// Removes its response from the registry when dropped.
pub struct InflightGuard {
    /// The registry's owner (shared state outlives every request).
    owner: Arc<crate::gateway::AppState>,
    /// The id.
    id: String,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.owner.inflight.lock().remove(&self.id);
    }
}

impl InflightResponses {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Inflight>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `id`; its cancel switch and a guard that unregisters it.
    pub fn register(
        state: &Arc<crate::gateway::AppState>,
        id: &str,
    ) -> (watch::Receiver<bool>, InflightGuard) {
        let (cancel, rx) = watch::channel(false);
        let (done, _) = watch::channel(None);
        state
            .inflight
            .lock()
            .insert(id.to_string(), Inflight { cancel, done });
        (
            rx,
            InflightGuard {
                owner: state.clone(),
                id: id.to_string(),
            },
        )
    }

    /// Cancels `id` if it is generating; a receiver of its final object.
    pub fn cancel(&self, id: &str) -> Option<watch::Receiver<Option<Value>>> {
        let g = self.lock();
        let entry = g.get(id)?;
        let _ = entry.cancel.send(true);
        Some(entry.done.subscribe())
    }

    /// Publishes the final object of `id`.
    pub fn finish(&self, id: &str, response: Value) {
        if let Some(entry) = self.lock().get(id) {
            let _ = entry.done.send(Some(response));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resp(n: u64) -> StoredResponse {
        StoredResponse {
            object: serde_json::json!({ "n": n }),
            context: Vec::new(),
            prefix: CachedPrefix::default(),
            input_items: Vec::new(),
            lane: None,
        }
    }

    #[test]
    fn evicts_oldest_past_capacity_and_expires_after_ttl() {
        let s = ResponseStore::new(2, Duration::from_secs(60));
        s.put("a", resp(1));
        s.put("b", resp(2));
        s.put("c", resp(3));
        assert!(s.get("a").is_none());
        assert_eq!(s.get("c").unwrap().object["n"], 3);
        assert!(s.delete("b"));
        assert!(!s.delete("b"));
        let s = ResponseStore::new(2, Duration::from_millis(0));
        s.put("a", resp(1));
        std::thread::sleep(Duration::from_millis(2));
        assert!(s.get("a").is_none());
    }
}
