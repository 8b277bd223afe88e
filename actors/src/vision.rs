//! The VisionEncoder: one actor that turns preprocessed media into LM input rows with
//! the model's vision tower, batching requests from every session and caching results
//! by content hash.
//!
//! ```text
//! sessions ──EncodeRequest{hash, VisionInput}──▶ bounded queue (try_send: full → overloaded)
//!                                                  │
//!                          coordinator thread: EncoderState
//!                            cache hit ──────────▶ answer now
//!                            same key in flight ─▶ wait for that encode (no duplicate work)
//!                            miss ───────────────▶ pending
//!                            worker idle ────────▶ drain pending up to the patch budget
//!                                                  │ EncodeBatch (one packed call)
//!                          encode thread: model.vision().encode(&[VisionInput])
//!                                                  │ BatchDone
//!                          EncoderState::complete: cache rows (LRU bounded in bytes),
//!                          answer every waiter through its oneshot
//! ```
//!
//! The coordinator never runs the tower, so requests that arrive during an encode are
//! looked up, deduplicated and queued at once, and the next batch packs all of them.
//! [`EncoderState`] holds the rules (cache, in-flight table, pending queue, counters) as
//! plain methods, unit-tested without threads; the two threads only move messages.
//!
//! Cache keys are [`MediaKey`]s: the content hash the caller computed (of the encoded
//! bytes for an image, of the frames for a video chunk) together with the grid, so the
//! same bytes preprocessed to another grid never share rows. One encoder serves one
//! model, so the processor settings are otherwise fixed. Results are `Arc<[f32]>`
//! (`[num_tokens, out_dim]` row-major), shared between the cache and every request that
//! asked for them. [`VisionStats`] is published after every event (before the answers it counts) for `/metrics`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, watch};

use crate::engine::{CausalLm, VisionInfo, VisionInput};

/// Encoder settings.
#[derive(Debug, Clone)]
pub struct VisionConfig {
    /// Requests waiting for an answer (queued, or waiting on an encode) before new ones
    /// are refused as overloaded; also the command queue's capacity. Default 256.
    pub queue_capacity: usize,
    /// Bytes of encoded rows kept for reuse (`--mm-cache-bytes`); 0 disables the cache.
    /// Default 512 MiB (about 18,000 K2.5 image tokens of 7168 `f32`).
    pub cache_bytes: usize,
    /// Most patches packed into one tower call (an item larger than this is encoded
    /// alone). Default 65,536: four 4096-patch images, or one 720p video chunk of 4
    /// frames and more.
    pub max_batch_patches: usize,
}

impl Default for VisionConfig {
    fn default() -> Self {
        VisionConfig {
            queue_capacity: 256,
            cache_bytes: 512 << 20,
            max_batch_patches: 65_536,
        }
    }
}

/// One media item to encode: the message a session sends to the encoder.
#[derive(Debug, Clone)]
pub struct EncodeRequest {
    /// Content hash of the media (`caracal_media::content_hash` of the encoded bytes,
    /// or `frames_hash` of a chunk's frames).
    pub hash: u64,
    /// The preprocessed patches and their grid.
    pub input: VisionInput,
}

/// What a request gets back: the item's rows, `[num_tokens, out_dim]` row-major.
pub type EncodeResult = Result<Arc<[f32]>, VisionError>;

/// Cache and in-flight identity of a media item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MediaKey {
    /// The caller's content hash.
    pub hash: u64,
    /// `[t, h, w]` of the preprocessed item.
    pub grid_thw: [usize; 3],
}

/// Why an encode request failed; `Clone` because one failure answers every request
/// that waited on the same encode.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VisionError {
    /// Too many requests are waiting; retry later.
    #[error("the vision encoder is overloaded: {capacity} requests are already waiting")]
    Overloaded {
        /// The configured `queue_capacity`.
        capacity: usize,
    },
    /// The loaded model has no vision tower.
    #[error("the model has no vision tower")]
    NoVisionTower,
    /// The input does not fit the tower (shape or frame count).
    #[error("invalid vision input: {0}")]
    InvalidInput(String),
    /// The tower itself failed, or returned rows of the wrong shape.
    #[error("vision tower failed: {0}")]
    Encode(String),
    /// The encoder's threads are gone.
    #[error("the vision encoder has stopped")]
    Stopped,
}

impl VisionError {
    /// A stable, machine-readable type string for client error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            VisionError::Overloaded { .. } => "overloaded",
            VisionError::NoVisionTower => "vision_unsupported",
            VisionError::InvalidInput(_) => "vision_input_invalid",
            VisionError::Encode(_) => "vision_encode_failed",
            VisionError::Stopped => "vision_stopped",
        }
    }
}

/// Counters and gauges of the encoder, published after every event.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VisionStats {
    /// Tower calls made.
    pub encodes: u64,
    /// Items encoded by those calls.
    pub items_encoded: u64,
    /// Patches encoded by those calls.
    pub patches_encoded: u64,
    /// Requests answered from the cache.
    pub cache_hits: u64,
    /// Requests whose item had to be encoded (one per distinct key, see `coalesced`).
    pub cache_misses: u64,
    /// Requests that joined an encode of the same key already queued or running.
    pub coalesced: u64,
    /// Requests refused because the queue was full.
    pub overloaded: u64,
    /// Requests answered with an error (invalid input or a failed encode).
    pub errors: u64,
    /// Cache entries evicted to make room.
    pub evictions: u64,
    /// Bytes of rows held in the cache now.
    pub bytes_cached: u64,
    /// Items in the cache now.
    pub entries: u64,
    /// Requests waiting for an answer now (queued or in flight).
    pub waiting: u64,
    /// Items in the tower call running now.
    pub in_flight: u64,
}

/// An LRU map from [`MediaKey`] to rows, bounded by the rows' bytes.
#[derive(Debug, Default)]
pub struct ByteLru {
    /// Rows and last-use stamp per key.
    map: HashMap<MediaKey, (Arc<[f32]>, u64)>,
    /// Keys by last-use stamp, oldest first.
    order: BTreeMap<u64, MediaKey>,
    /// Sum of the cached rows' bytes.
    bytes: usize,
    /// The byte bound.
    capacity: usize,
    /// Next use stamp.
    clock: u64,
    /// Entries evicted so far.
    evictions: u64,
}

impl ByteLru {
    /// An empty cache holding at most `capacity` bytes of rows.
    pub fn new(capacity: usize) -> ByteLru {
        ByteLru {
            capacity,
            ..ByteLru::default()
        }
    }

    fn size_of(rows: &[f32]) -> usize {
        std::mem::size_of_val(rows)
    }

    /// The rows under `key`, marking them most recently used.
    pub fn get(&mut self, key: &MediaKey) -> Option<Arc<[f32]>> {
        let (rows, stamp) = self.map.get_mut(key)?;
        self.order.remove(stamp);
        self.clock += 1;
        *stamp = self.clock;
        self.order.insert(self.clock, *key);
        Some(rows.clone())
    }

    /// Caches `rows` under `key`, evicting least recently used entries until they fit.
    /// Rows larger than the whole cache are not cached. Returns whether they were.
    pub fn insert(&mut self, key: MediaKey, rows: Arc<[f32]>) -> bool {
        let size = Self::size_of(&rows);
        if size > self.capacity {
            return false;
        }
        if let Some((old, stamp)) = self.map.remove(&key) {
            self.order.remove(&stamp);
            self.bytes -= Self::size_of(&old);
        }
        while self.bytes + size > self.capacity {
            let (_, oldest) = self
                .order
                .pop_first()
                .expect("bytes > 0 means an entry is cached");
            let (old, _) = self.map.remove(&oldest).expect("order and map agree");
            self.bytes -= Self::size_of(&old);
            self.evictions += 1;
        }
        self.clock += 1;
        self.order.insert(self.clock, key);
        self.map.insert(key, (rows, self.clock));
        self.bytes += size;
        true
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether `key` is cached (without touching its recency).
    pub fn contains(&self, key: &MediaKey) -> bool {
        self.map.contains_key(key)
    }
}

/// What [`EncoderState::submit`] did with a request.
#[derive(Debug)]
pub enum Submitted<W> {
    /// Answer the waiter now.
    Answer(W, EncodeResult),
    /// The waiter waits for an encode (new, or one already queued or running).
    Waiting,
}

/// The items of one tower call.
#[derive(Debug)]
pub struct EncodeBatch {
    /// Keys, in the order of `inputs`.
    pub keys: Vec<MediaKey>,
    /// The items, one per distinct key.
    pub inputs: Vec<VisionInput>,
}

/// The encoder's rules as plain state: the cache, the table of keys being encoded (with
/// their waiters), the pending queue, and the counters. `W` is whatever answers a
/// request (a oneshot sender in the actor, a plain value in tests).
#[derive(Debug)]
pub struct EncoderState<W> {
    /// The tower's static facts, for input checks.
    info: VisionInfo,
    /// Settings.
    config: VisionConfig,
    /// Encoded rows by key.
    cache: ByteLru,
    /// Waiters per key that is queued or being encoded.
    waiters: HashMap<MediaKey, Vec<W>>,
    /// Keys waiting for a tower call, with their inputs, oldest first.
    pending: VecDeque<(MediaKey, VisionInput)>,
    /// Keys in the running tower call.
    in_flight: Vec<MediaKey>,
    /// Requests waiting for an answer (sum of `waiters` lengths).
    waiting: usize,
    /// Counters.
    stats: VisionStats,
}

impl<W> EncoderState<W> {
    /// Fresh state for a tower described by `info`.
    pub fn new(info: VisionInfo, config: VisionConfig) -> EncoderState<W> {
        EncoderState {
            cache: ByteLru::new(config.cache_bytes),
            info,
            config,
            waiters: HashMap::new(),
            pending: VecDeque::new(),
            in_flight: Vec::new(),
            waiting: 0,
            stats: VisionStats::default(),
        }
    }

    /// Checks that `input` is a well-formed item for this tower.
    pub fn check_input(&self, input: &VisionInput) -> Result<(), VisionError> {
        let [t, h, w] = input.grid_thw;
        let (p, m) = (self.info.patch_size, self.info.merge_size);
        let bad = |reason: String| Err(VisionError::InvalidInput(reason));
        if t == 0 || t > self.info.max_frames {
            return bad(format!(
                "a media item has 1..={} frames, got {t}",
                self.info.max_frames
            ));
        }
        if h == 0 || w == 0 || h % m != 0 || w % m != 0 {
            return bad(format!(
                "the patch grid {h}x{w} must be non-empty multiples of the {m}x{m} merge window"
            ));
        }
        let want = t * h * w * 3 * p * p;
        if input.pixel_values.len() != want {
            return bad(format!(
                "grid [{t}, {h}, {w}] needs {want} pixel values ([t·h·w, 3, {p}, {p}]), got {}",
                input.pixel_values.len()
            ));
        }
        Ok(())
    }

    /// Takes one request: answered from the cache, refused, or left waiting.
    pub fn submit(&mut self, request: EncodeRequest, waiter: W) -> Submitted<W> {
        let key = MediaKey {
            hash: request.hash,
            grid_thw: request.input.grid_thw,
        };
        if let Some(rows) = self.cache.get(&key) {
            self.stats.cache_hits += 1;
            return Submitted::Answer(waiter, Ok(rows));
        }
        if self.waiting >= self.config.queue_capacity {
            self.stats.overloaded += 1;
            let capacity = self.config.queue_capacity;
            return Submitted::Answer(waiter, Err(VisionError::Overloaded { capacity }));
        }
        if let Some(list) = self.waiters.get_mut(&key) {
            list.push(waiter);
            self.waiting += 1;
            self.stats.coalesced += 1;
            return Submitted::Waiting;
        }
        if let Err(e) = self.check_input(&request.input) {
            self.stats.errors += 1;
            return Submitted::Answer(waiter, Err(e));
        }
        self.stats.cache_misses += 1;
        self.waiters.insert(key, vec![waiter]);
        self.waiting += 1;
        self.pending.push_back((key, request.input));
        Submitted::Waiting
    }

    /// When no tower call is running, the next one: pending items in arrival order up
    /// to `max_batch_patches` (at least one item).
    pub fn next_batch(&mut self) -> Option<EncodeBatch> {
        if !self.in_flight.is_empty() || self.pending.is_empty() {
            return None;
        }
        let mut batch = EncodeBatch {
            keys: Vec::new(),
            inputs: Vec::new(),
        };
        let mut patches = 0;
        while let Some((_, input)) = self.pending.front() {
            let n = input.grid_thw.iter().product::<usize>();
            if !batch.keys.is_empty() && patches + n > self.config.max_batch_patches {
                break;
            }
            let (key, input) = self.pending.pop_front().expect("front exists");
            patches += n;
            batch.keys.push(key);
            batch.inputs.push(input);
        }
        self.in_flight = batch.keys.clone();
        self.stats.encodes += 1;
        self.stats.items_encoded += batch.keys.len() as u64;
        self.stats.patches_encoded += patches as u64;
        Some(batch)
    }

    /// Finishes the running tower call with its `result` (rows per item, in batch
    /// order): caches each item's rows and returns every waiter with its answer.
    pub fn complete(
        &mut self,
        result: Result<Vec<Vec<f32>>, VisionError>,
    ) -> Vec<(W, EncodeResult)> {
        let keys = std::mem::take(&mut self.in_flight);
        let result = result.and_then(|rows| self.check_output(&keys, rows));
        let mut answers = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let waiters = self.waiters.remove(key).unwrap_or_default();
            self.waiting -= waiters.len();
            let answer: EncodeResult = match &result {
                Ok(rows) => {
                    let rows = rows[i].clone();
                    self.cache.insert(*key, rows.clone());
                    Ok(rows)
                }
                Err(e) => {
                    self.stats.errors += waiters.len() as u64;
                    Err(e.clone())
                }
            };
            answers.extend(waiters.into_iter().map(|w| (w, answer.clone())));
        }
        answers
    }

    /// Checks the tower returned one `[num_tokens, out_dim]` block per item.
    fn check_output(
        &self,
        keys: &[MediaKey],
        rows: Vec<Vec<f32>>,
    ) -> Result<Vec<Arc<[f32]>>, VisionError> {
        if rows.len() != keys.len() {
            return Err(VisionError::Encode(format!(
                "the tower returned {} items for {} inputs",
                rows.len(),
                keys.len()
            )));
        }
        let m = self.info.merge_size;
        keys.iter()
            .zip(rows)
            .map(|(key, rows)| {
                let [_, h, w] = key.grid_thw;
                let want = h * w / (m * m) * self.info.out_dim;
                if rows.len() == want {
                    Ok(Arc::from(rows))
                } else {
                    Err(VisionError::Encode(format!(
                        "the tower returned {} values for grid {:?}, expected {want}",
                        rows.len(),
                        key.grid_thw
                    )))
                }
            })
            .collect()
    }

    /// Every waiter still queued or in flight, answered with `error` (shutdown).
    pub fn fail_all(&mut self, error: VisionError) -> Vec<(W, EncodeResult)> {
        self.pending.clear();
        self.in_flight.clear();
        self.waiting = 0;
        self.waiters
            .drain()
            .flat_map(|(_, ws)| ws)
            .map(|w| (w, Err(error.clone())))
            .collect()
    }

    /// Counters and gauges now.
    pub fn stats(&self) -> VisionStats {
        VisionStats {
            evictions: self.cache.evictions,
            bytes_cached: self.cache.bytes() as u64,
            entries: self.cache.len() as u64,
            waiting: self.waiting as u64,
            in_flight: self.in_flight.len() as u64,
            ..self.stats
        }
    }

    /// Whether a tower call is running or items are pending.
    pub fn busy(&self) -> bool {
        !self.in_flight.is_empty() || !self.pending.is_empty()
    }
}

/// A request with its reply channel, as it travels to the coordinator.
struct EncodeCommand {
    request: EncodeRequest,
    reply: oneshot::Sender<EncodeResult>,
}

/// Handle to a running encoder; cheap to clone. The threads stop when every handle is
/// gone and the work already accepted is answered.
#[derive(Clone)]
pub struct VisionEncoder {
    /// The bounded command queue.
    commands: mpsc::Sender<EncodeCommand>,
    /// The last published counters.
    stats: watch::Receiver<VisionStats>,
    /// The tower's static facts.
    info: VisionInfo,
    /// For the overload error of a full command queue.
    capacity: usize,
}

impl VisionEncoder {
    /// Starts the coordinator and encode threads for `model`'s vision tower.
    pub fn start(model: Arc<dyn CausalLm>, config: VisionConfig) -> Result<Self, VisionError> {
        let info = model
            .vision()
            .ok_or(VisionError::NoVisionTower)?
            .info()
            .clone();
        let capacity = config.queue_capacity.max(1);
        let config = VisionConfig {
            queue_capacity: capacity,
            ..config
        };
        let (commands, command_rx) = mpsc::channel(capacity);
        let (stats_tx, stats) = watch::channel(VisionStats::default());
        let (work_tx, work_rx) = mpsc::channel::<EncodeBatch>(1);
        let (done_tx, done_rx) = mpsc::channel(1);
        let spawn_err =
            |e: std::io::Error| VisionError::Encode(format!("cannot start a thread: {e}"));
        std::thread::Builder::new()
            .name("vision-encode".into())
            .spawn(move || encode_loop(model, work_rx, done_tx))
            .map_err(spawn_err)?;
        let state = EncoderState::new(info.clone(), config);
        std::thread::Builder::new()
            .name("vision-coordinator".into())
            .spawn(move || coordinate(state, command_rx, work_tx, done_rx, stats_tx))
            .map_err(spawn_err)?;
        Ok(VisionEncoder {
            commands,
            stats,
            info,
            capacity,
        })
    }

    /// Queues `request` without waiting: a full queue is an immediate
    /// [`VisionError::Overloaded`]. The receiver yields the answer.
    pub fn submit(
        &self,
        request: EncodeRequest,
    ) -> Result<oneshot::Receiver<EncodeResult>, VisionError> {
        let (reply, rx) = oneshot::channel();
        self.commands
            .try_send(EncodeCommand { request, reply })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => VisionError::Overloaded {
                    capacity: self.capacity,
                },
                mpsc::error::TrySendError::Closed(_) => VisionError::Stopped,
            })?;
        Ok(rx)
    }

    /// Encodes `request` (or finds it cached) and returns its rows.
    pub async fn encode(&self, request: EncodeRequest) -> EncodeResult {
        self.submit(request)?
            .await
            .map_err(|_| VisionError::Stopped)?
    }

    /// The last published counters.
    pub fn stats(&self) -> VisionStats {
        *self.stats.borrow()
    }

    /// The tower's static facts.
    pub fn info(&self) -> &VisionInfo {
        &self.info
    }
}

/// The coordinator: owns [`EncoderState`]; never runs the tower.
fn coordinate(
    mut state: EncoderState<oneshot::Sender<EncodeResult>>,
    mut commands: mpsc::Receiver<EncodeCommand>,
    work: mpsc::Sender<EncodeBatch>,
    mut done: mpsc::Receiver<Result<Vec<Vec<f32>>, VisionError>>,
    stats: watch::Sender<VisionStats>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("vision coordinator cannot start: {e}");
            return;
        }
    };
    runtime.block_on(async move {
        let (mut open, mut stopped) = (true, false);
        // Answers of the last event, sent after the counters that count them, so a
        // caller that reads the counters after its answer sees its own request.
        let mut answers = Vec::new();
        loop {
            if let Some(batch) = state.next_batch() {
                tracing::debug!(items = batch.keys.len(), "vision encode");
                if work.send(batch).await.is_err() {
                    answers.extend(state.fail_all(VisionError::Stopped));
                }
            }
            let _ = stats.send(state.stats());
            answer(std::mem::take(&mut answers));
            if stopped || !open && !state.busy() {
                break;
            }
            tokio::select! {
                command = commands.recv(), if open => match command {
                    Some(EncodeCommand { request, reply }) => {
                        if let Submitted::Answer(reply, result) = state.submit(request, reply) {
                            answers.push((reply, result));
                        }
                    }
                    None => open = false,
                },
                result = done.recv() => match result {
                    Some(result) => answers = state.complete(result),
                    None => {
                        answers = state.fail_all(VisionError::Stopped);
                        stopped = true;
                    }
                },
            }
        }
    });
    tracing::debug!("vision encoder stopped");
}

fn answer(answers: Vec<(oneshot::Sender<EncodeResult>, EncodeResult)>) {
    for (reply, result) in answers {
        // A dropped receiver is a request the caller gave up on; the rows stay cached.
        let _ = reply.send(result);
    }
}

/// The encode thread: one packed tower call per batch.
fn encode_loop(
    model: Arc<dyn CausalLm>,
    mut work: mpsc::Receiver<EncodeBatch>,
    done: mpsc::Sender<Result<Vec<Vec<f32>>, VisionError>>,
) {
    while let Some(batch) = work.blocking_recv() {
        let result = match model.vision() {
            Some(tower) => tower
                .encode(&batch.inputs)
                .map_err(|e| VisionError::Encode(e.to_string())),
            None => Err(VisionError::NoVisionTower),
        };
        if done.blocking_send(result).is_err() {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> VisionInfo {
        VisionInfo {
            patch_size: 2,
            merge_size: 2,
            max_frames: 4,
            out_dim: 3,
            placeholder_id: 7,
        }
    }

    fn item(grid: [usize; 3]) -> VisionInput {
        let n = grid.iter().product::<usize>() * 3 * 4;
        VisionInput {
            pixel_values: (0..n).map(|i| i as f32).collect(),
            grid_thw: grid,
        }
    }

    fn rows(grid: [usize; 3], value: f32) -> Vec<f32> {
        vec![value; grid[1] * grid[2] / 4 * 3]
    }

    fn config(cache_bytes: usize) -> VisionConfig {
        VisionConfig {
            queue_capacity: 8,
            cache_bytes,
            max_batch_patches: 32,
        }
    }

    #[test]
    fn lru_evicts_least_recently_used_within_the_byte_bound() {
        let key = |hash| MediaKey {
            hash,
            grid_thw: [1, 2, 2],
        };
        let mut lru = ByteLru::new(24); // two entries of 3 f32
        assert!(lru.insert(key(1), Arc::from(vec![1.0; 3])));
        assert!(lru.insert(key(2), Arc::from(vec![2.0; 3])));
        assert!(lru.get(&key(1)).is_some()); // 1 is now the most recent
        assert!(lru.insert(key(3), Arc::from(vec![3.0; 3])));
        assert!(lru.contains(&key(1)) && !lru.contains(&key(2)) && lru.contains(&key(3)));
        assert_eq!((lru.bytes(), lru.len(), lru.evictions), (24, 2, 1));
        // Too large for the whole cache: not cached, nothing evicted.
        assert!(!lru.insert(key(4), Arc::from(vec![4.0; 7])));
        assert_eq!((lru.len(), lru.evictions), (2, 1));
        // Replacing a key frees its old bytes first.
        assert!(lru.insert(key(3), Arc::from(vec![3.5; 6])));
        assert_eq!((lru.bytes(), lru.len(), lru.evictions), (24, 1, 2));
    }

    #[test]
    fn state_batches_dedupes_caches_and_answers_every_waiter() {
        let mut s: EncoderState<u32> = EncoderState::new(info(), config(1 << 20));
        let g = [1, 2, 2]; // 4 patches
        for (waiter, hash) in [(1, 10), (2, 11), (3, 10)] {
            let r = s.submit(
                EncodeRequest {
                    hash,
                    input: item(g),
                },
                waiter,
            );
            assert!(matches!(r, Submitted::Waiting));
        }
        assert_eq!((s.stats().cache_misses, s.stats().coalesced), (2, 1));
        let batch = s.next_batch().expect("pending");
        assert_eq!(batch.keys.len(), 2, "hash 10 is encoded once");
        assert!(s.next_batch().is_none(), "one call at a time");
        let mut answers = s.complete(Ok(vec![rows(g, 1.0), rows(g, 2.0)]));
        answers.sort_by_key(|(w, _)| *w);
        let got: Vec<_> = answers
            .into_iter()
            .map(|(w, r)| (w, r.expect("encoded")[0]))
            .collect();
        assert_eq!(got, [(1, 1.0), (2, 2.0), (3, 1.0)]);
        match s.submit(
            EncodeRequest {
                hash: 10,
                input: item(g),
            },
            4,
        ) {
            Submitted::Answer(4, Ok(r)) => assert_eq!(r[0], 1.0),
            other => panic!("expected a cache hit, got {other:?}"),
        }
        let st = s.stats();
        assert_eq!(
            (st.cache_hits, st.encodes, st.items_encoded, st.entries),
            (1, 1, 2, 2)
        );
        assert_eq!((st.waiting, st.in_flight), (0, 0));
    }

    #[test]
    fn state_respects_the_patch_budget_and_the_queue_bound() {
        let mut s: EncoderState<u32> = EncoderState::new(info(), config(0));
        let big = [4, 2, 4]; // 32 patches: the whole budget
        for hash in 0..3 {
            s.submit(
                EncodeRequest {
                    hash,
                    input: item(big),
                },
                hash as u32,
            );
        }
        assert_eq!(s.next_batch().expect("pending").keys.len(), 1);
        s.complete(Ok(vec![rows(big, 0.0)]));
        assert!(s.stats().entries == 0, "cache_bytes 0 caches nothing");
        for hash in 3..9 {
            s.submit(
                EncodeRequest {
                    hash,
                    input: item(big),
                },
                hash as u32,
            );
        }
        // 2 still pending + 6 new = 8 = queue_capacity: the next is refused.
        match s.submit(
            EncodeRequest {
                hash: 99,
                input: item(big),
            },
            99,
        ) {
            Submitted::Answer(99, Err(VisionError::Overloaded { capacity: 8 })) => {}
            other => panic!("expected overloaded, got {other:?}"),
        }
        assert_eq!(s.stats().overloaded, 1);
    }

    #[test]
    fn state_rejects_bad_inputs_and_bad_outputs() {
        let mut s: EncoderState<u32> = EncoderState::new(info(), config(1 << 20));
        let mut short = item([1, 2, 2]);
        short.pixel_values.pop();
        for (input, what) in [
            (short, "needs 48 pixel values"),
            (item([5, 2, 2]), "1..=4 frames"),
            (item([1, 3, 2]), "multiples of the 2x2 merge window"),
        ] {
            match s.submit(EncodeRequest { hash: 1, input }, 0) {
                Submitted::Answer(0, Err(VisionError::InvalidInput(m))) => {
                    assert!(m.contains(what), "{m}")
                }
                other => panic!("expected invalid input, got {other:?}"),
            }
        }
        s.submit(
            EncodeRequest {
                hash: 2,
                input: item([1, 2, 2]),
            },
            1,
        );
        s.next_batch().expect("pending");
        let answers = s.complete(Ok(vec![vec![0.0; 2]]));
        assert!(matches!(&answers[0].1, Err(VisionError::Encode(m)) if m.contains("expected 3")));
        assert_eq!((s.stats().errors, s.stats().entries), (4, 0));
    }
}
