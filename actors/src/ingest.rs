//! Ingest: decoding and preprocessing of client media on a CPU pool of its own.
//!
//! ```text
//! gateway ──prepare_image(bytes, cfg, limits)──▶ slot (bounded: full → overloaded)
//!         ──prepare_frames(frames, times, cfg)─▶   │ ingest pool thread (rayon, own threads)
//!                                                  │ caracal_media: decode, resize, normalise,
//!                                                  │ patchify; content hash
//!         ◀──────────── oneshot ───────────────────┘ PreparedMedia / Vec<PreparedChunk>
//! ```
//!
//! Nothing here runs on the caller's async task: a request takes a slot (at most
//! `queue_capacity` jobs queued or running; beyond that the answer is an immediate
//! [`IngestError::Overloaded`]), the job runs on one of the pool's threads, and the
//! answer comes back over a oneshot. Media errors (size limits, corrupt files, bad
//! frames) come back typed as [`IngestError::Media`] with the media crate's stable
//! `kind()`; a panic inside a job is caught and reported, never taking a thread down.
//!
//! The output is ready for the [`crate::vision::VisionEncoder`]: a
//! [`VisionInput`] and the content hash its cache and the radix keys use (of the encoded
//! bytes for an image; `caracal_media::frames_hash` of the frames for a video chunk).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use caracal_media::{
    chunk_frames, content_hash, process_image_bytes, DecodeLimits, ImageProcessorConfig,
    MediaError, RgbImage,
};
use tokio::sync::oneshot;

use crate::engine::VisionInput;

/// Ingest settings.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Pool threads (default 2; 1..=64). Preprocessing is CPU-bound: more threads than
    /// cores only adds latency to everything else.
    pub threads: usize,
    /// Jobs queued or running before new ones are refused as overloaded (default 64).
    pub queue_capacity: usize,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            threads: 2,
            queue_capacity: 64,
        }
    }
}

/// Why a media item could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// Too many jobs are queued; retry later.
    #[error("media ingest is overloaded: {capacity} jobs are already queued")]
    Overloaded {
        /// The configured `queue_capacity`.
        capacity: usize,
    },
    /// The media itself was rejected (limits, format, corrupt data, bad frames).
    #[error(transparent)]
    Media(#[from] MediaError),
    /// The pool could not be started or a job failed unexpectedly.
    #[error("media ingest failed: {0}")]
    Internal(String),
}

impl IngestError {
    /// A stable, machine-readable type string for client error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            IngestError::Overloaded { .. } => "overloaded",
            IngestError::Media(e) => e.kind(),
            IngestError::Internal(_) => "media_internal_error",
        }
    }
}

/// One image, preprocessed.
#[derive(Debug, Clone)]
pub struct PreparedMedia {
    /// `content_hash` of the encoded bytes.
    pub hash: u64,
    /// Patches and grid for the vision tower.
    pub input: VisionInput,
    /// LM tokens the image occupies.
    pub num_tokens: usize,
    /// Width of the decoded image in pixels (before any resize).
    pub width: u32,
    /// Height of the decoded image in pixels.
    pub height: u32,
}

/// One video chunk, preprocessed.
#[derive(Debug, Clone)]
pub struct PreparedChunk {
    /// `frames_hash` of the chunk's frames.
    pub hash: u64,
    /// Patches (`[t·h·w, 3, p, p]`) and grid `[t, h, w]`.
    pub input: VisionInput,
    /// LM tokens the chunk occupies (one frame's worth).
    pub num_tokens: usize,
    /// Index of the chunk's first frame among the frames given.
    pub first_frame: usize,
    /// Time of the chunk's first frame in seconds.
    pub timestamp: f64,
    /// The chunk's prompt, `HH:MM:SS.mmm<|media_begin|>video<|media_content|><|media_pad|><|media_end|>`.
    pub prompt: String,
}

/// Counts jobs queued or running against a bound.
#[derive(Debug)]
struct Slots {
    used: AtomicUsize,
    capacity: usize,
}

impl Slots {
    fn try_acquire(self: &Arc<Self>) -> Option<SlotGuard> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.capacity).then_some(n + 1)
            })
            .ok()
            .map(|_| SlotGuard(self.clone()))
    }
}

/// Gives its slot back when the job ends, however it ends.
struct SlotGuard(Arc<Slots>);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0.used.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Handle to the ingest pool; cheap to clone.
#[derive(Clone)]
pub struct Ingest {
    /// The pool's own threads.
    pool: Arc<rayon::ThreadPool>,
    /// The job bound.
    slots: Arc<Slots>,
}

impl Ingest {
    /// Starts the pool.
    pub fn start(config: IngestConfig) -> Result<Ingest, IngestError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(config.threads.clamp(1, 64))
            .thread_name(|i| format!("ingest-{i}"))
            .build()
            .map_err(|e| IngestError::Internal(format!("cannot start the ingest pool: {e}")))?;
        Ok(Ingest {
            pool: Arc::new(pool),
            slots: Arc::new(Slots {
                used: AtomicUsize::new(0),
                capacity: config.queue_capacity.max(1),
            }),
        })
    }

    /// Jobs queued or running now.
    pub fn queued(&self) -> usize {
        self.slots.used.load(Ordering::Acquire)
    }

    /// Runs `job` on the pool if a slot is free; the receiver yields its result.
    fn spawn<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> Result<T, IngestError> + Send + 'static,
    ) -> Result<oneshot::Receiver<Result<T, IngestError>>, IngestError> {
        let guard = self.slots.try_acquire().ok_or(IngestError::Overloaded {
            capacity: self.slots.capacity,
        })?;
        let (tx, rx) = oneshot::channel();
        self.pool.spawn(move || {
            let result = catch_unwind(AssertUnwindSafe(job)).unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!("ingest job panicked: {what}");
                Err(IngestError::Internal(format!(
                    "preprocessing panicked: {what}"
                )))
            });
            drop(guard);
            let _ = tx.send(result);
        });
        Ok(rx)
    }

    /// Queues an image: decode under `limits` (they replace `cfg`'s decode limits),
    /// preprocess under `cfg`, hash the encoded bytes. A full queue is an immediate
    /// [`IngestError::Overloaded`].
    pub fn submit_image(
        &self,
        bytes: Arc<[u8]>,
        cfg: &ImageProcessorConfig,
        limits: DecodeLimits,
    ) -> Result<oneshot::Receiver<Result<PreparedMedia, IngestError>>, IngestError> {
        let cfg = ImageProcessorConfig {
            max_decoded_side: limits.max_side,
            max_decoded_pixels: limits.max_pixels,
            ..*cfg
        };
        self.spawn(move || {
            let patches = process_image_bytes(&bytes, &cfg)?;
            let (width, height) = (patches.plan.input_width, patches.plan.input_height);
            Ok(PreparedMedia {
                hash: content_hash(&bytes),
                num_tokens: patches.num_tokens,
                width,
                height,
                input: VisionInput {
                    pixel_values: patches.pixel_values,
                    grid_thw: patches.grid_thw,
                },
            })
        })
    }

    /// Decodes and preprocesses an image on the pool ([`Ingest::submit_image`]).
    pub async fn prepare_image(
        &self,
        bytes: Arc<[u8]>,
        cfg: &ImageProcessorConfig,
        limits: DecodeLimits,
    ) -> Result<PreparedMedia, IngestError> {
        let rx = self.submit_image(bytes, cfg, limits)?;
        rx.await
            .map_err(|_| IngestError::Internal("the ingest pool dropped a job".into()))?
    }

    /// Queues decoded video frames (with their times in seconds) to be cut into chunks
    /// as `caracal_media::chunk_frames` does.
    pub fn submit_frames(
        &self,
        frames: Vec<RgbImage>,
        timestamps: Vec<f64>,
        cfg: &ImageProcessorConfig,
    ) -> Result<oneshot::Receiver<Result<Vec<PreparedChunk>, IngestError>>, IngestError> {
        let cfg = *cfg;
        self.spawn(move || {
            let chunks = chunk_frames(&frames, &timestamps, &cfg)?;
            Ok(chunks
                .into_iter()
                .map(|c| PreparedChunk {
                    hash: c.hash,
                    num_tokens: c.num_tokens,
                    first_frame: c.first_frame,
                    timestamp: c.timestamp,
                    prompt: c.prompt(),
                    input: VisionInput {
                        pixel_values: c.pixel_values,
                        grid_thw: c.grid_thw,
                    },
                })
                .collect())
        })
    }

    /// Cuts decoded frames into preprocessed chunks on the pool ([`Ingest::submit_frames`]).
    pub async fn prepare_frames(
        &self,
        frames: Vec<RgbImage>,
        timestamps: Vec<f64>,
        cfg: &ImageProcessorConfig,
    ) -> Result<Vec<PreparedChunk>, IngestError> {
        let rx = self.submit_frames(frames, timestamps, cfg)?;
        rx.await
            .map_err(|_| IngestError::Internal("the ingest pool dropped a job".into()))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_bound_jobs_and_come_back_on_drop() {
        let slots = Arc::new(Slots {
            used: AtomicUsize::new(0),
            capacity: 2,
        });
        let a = slots.try_acquire().expect("free");
        let b = slots.try_acquire().expect("free");
        assert!(slots.try_acquire().is_none(), "bound reached");
        drop(a);
        let c = slots.try_acquire().expect("one came back");
        drop((b, c));
        assert_eq!(slots.used.load(Ordering::Acquire), 0);
    }
}
