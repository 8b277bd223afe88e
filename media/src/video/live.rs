//! [`LiveDecoder`]: a video arriving as encoded chunks (a WebSocket of MediaRecorder
//! WebM, MPEG-TS, fragmented MP4 or raw H.264) → frames as they complete.
//!
//! FFmpeg's demuxers pull bytes; a live stream pushes them. The decoder bridges the two
//! with one small demux thread whose AVIO read callback blocks on a queue of pushed
//! bytes:
//!
//! ```text
//! push(chunk) ──append──▶ [pending bytes] ──read callback──▶ demuxer (demux thread)
//!      ▲                                                           │ packets (≤ 64 queued)
//!      └──── frames ◀── FrameDecoder + LiveSelector (caller's thread) ◀┘
//! ```
//!
//! [`LiveDecoder::push`] appends the chunk, then decodes the packets the demuxer
//! produces until the demuxer has consumed every pushed byte and waits for more; only
//! then does it return the frames that completed. So the pending queue is empty between
//! pushes ([`LiveDecoder::buffered_bytes`]), and the only other buffering is what the
//! demuxer itself needs (its probe window while opening, and the next packet's start,
//! which many containers need before they can end the current packet). Decoding,
//! conversion and resizing run on the caller's thread (the vision pool, STYLE §4); the
//! demux thread only parses containers.
//!
//! Frames are chosen by presentation time with [`LiveSelector`] (the module docs of
//! [`crate::video::sample`] relate it to the file samplers); timestamps are relative to
//! the first frame. Joining mid-stream is fine: packets before the first keyframe are
//! dropped, up to `max_packets_without_keyframe`. [`LiveDecoder::finish`] flushes the
//! decoder's delayed frames at the end; dropping the decoder stops the thread.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ffmpeg::Packet;
use ffmpeg_next as ffmpeg;

use crate::error::{MediaError, Result};
use crate::video::container::{check_declared, forward_io, open_input, ProbeBudget};
use crate::video::decoder::{ff_reason, stream_header, FrameDecoder, Picker, StreamHeader};
use crate::video::sample::LiveSelector;
use crate::video::{init, Container, VideoFrame, VideoInfo, VideoOptions};

/// Most demuxed packets waiting for the decoder; the demux thread waits beyond this.
const MAX_QUEUED_PACKETS: usize = 64;

/// Probing for live streams: at most 1 MiB and 0.5 s of media to find the stream
/// parameters, and no frame-rate estimate (it would hold the first frames back).
const LIVE_BUDGET: ProbeBudget = ProbeBudget {
    bytes: 1 << 20,
    micros: 500_000,
    fps_frames: Some(0),
};

/// How long one wait on the demux thread lasts before the deadline is re-checked.
const POLL: Duration = Duration::from_millis(100);

/// What the caller's thread and the demux thread share.
struct Shared {
    /// The state below.
    state: Mutex<State>,
    /// Signalled on every change of `state`.
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means the other side panicked; its state is still consistent
        // for our purposes (flags and queues), so keep going and let it report.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The demux thread's inputs and outputs.
#[derive(Default)]
struct State {
    /// Pushed bytes the demuxer has not read yet.
    pending: VecDeque<u8>,
    /// The caller finished the stream: reads return end of file once `pending` is empty.
    eof: bool,
    /// The decoder was dropped: reads fail at once.
    abort: bool,
    /// The demuxer is blocked in a read with `pending` empty.
    starved: bool,
    /// The stream header, published once after the demuxer opened.
    header: Option<StreamHeader>,
    /// Demuxed video packets for the decoder.
    packets: VecDeque<Packet>,
    /// Set when the demux thread ends: `Ok` at end of stream, else why it failed.
    done: Option<Result<()>>,
}

/// The demuxer's AVIO source: blocks until bytes are pushed.
struct ChunkReader {
    shared: Arc<Shared>,
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut st = self.shared.lock();
        loop {
            if st.abort {
                return Err(io::Error::other("live stream dropped"));
            }
            if !st.pending.is_empty() {
                let n = buf.len().min(st.pending.len());
                for (dst, src) in buf.iter_mut().zip(st.pending.drain(..n)) {
                    *dst = src;
                }
                return Ok(n);
            }
            if st.eof {
                return Ok(0);
            }
            st.starved = true;
            self.shared.changed.notify_all();
            st = self
                .shared
                .changed
                .wait(st)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Decodes one live stream incrementally; see the module docs.
pub struct LiveDecoder {
    /// State shared with the demux thread.
    shared: Arc<Shared>,
    /// The demux thread, joined on drop.
    worker: Option<JoinHandle<()>>,
    /// The declared container.
    container: Container,
    /// Options for this stream.
    options: VideoOptions,
    /// The decoder, built when the header arrives.
    decoder: Option<FrameDecoder>,
    /// The stream description, once known.
    info: Option<VideoInfo>,
    /// Picks frames by presentation time.
    picker: Picker,
    /// Encoded bytes pushed so far (checked against `max_bytes`).
    bytes: u64,
    /// Set after `finish` or an error: later calls fail with `VideoClosed`.
    closed: bool,
}

impl LiveDecoder {
    /// Starts a decoder for a stream in `container` ([`Container::Auto`] probes the
    /// first bytes). Nothing is read until the first [`push`](Self::push).
    pub fn new(container: Container, options: &VideoOptions) -> Result<LiveDecoder> {
        options.validate()?;
        init();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let thread_shared = Arc::clone(&shared);
        let thread_options = options.clone();
        let worker = std::thread::Builder::new()
            .name("caracal-demux".into())
            .spawn(move || demux(thread_shared, container, thread_options))
            .map_err(|e| MediaError::VideoOpen {
                container: container.name(),
                reason: format!("could not start the demux thread: {e}"),
            })?;
        Ok(LiveDecoder {
            shared,
            worker: Some(worker),
            container,
            options: options.clone(),
            decoder: None,
            info: None,
            picker: Picker::Live(LiveSelector::new(options.fps)),
            bytes: 0,
            closed: false,
        })
    }

    /// Appends one encoded chunk and returns the frames it completed (possibly none).
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<VideoFrame>> {
        if self.closed {
            return Err(MediaError::VideoClosed);
        }
        if chunk.is_empty() {
            return Ok(Vec::new());
        }
        if self.bytes == 0 {
            // The first bytes carry the magic: refuse a contradicted declaration before
            // the demuxer sees anything.
            if let Err(e) = check_declared(self.container, chunk) {
                self.closed = true;
                return Err(e);
            }
        }
        self.bytes += chunk.len() as u64;
        if let Err(e) = self.options.limits.check_bytes(self.bytes) {
            self.closed = true;
            return Err(e);
        }
        {
            let mut st = self.shared.lock();
            st.pending.extend(chunk);
            st.starved = false;
            self.shared.changed.notify_all();
        }
        self.guarded(false)
    }

    /// Ends the stream: decodes what the demuxer still holds and flushes the decoder's
    /// delayed frames. Later calls fail with [`MediaError::VideoClosed`].
    pub fn finish(&mut self) -> Result<Vec<VideoFrame>> {
        if self.closed {
            return Err(MediaError::VideoClosed);
        }
        {
            let mut st = self.shared.lock();
            st.eof = true;
            self.shared.changed.notify_all();
        }
        let frames = self.guarded(true);
        self.closed = true;
        frames
    }

    /// The stream description, once the demuxer has read the header.
    pub fn info(&self) -> Option<&VideoInfo> {
        self.info.as_ref()
    }

    /// Pushed bytes the demuxer has not consumed yet (0 between pushes).
    pub fn buffered_bytes(&self) -> usize {
        self.shared.lock().pending.len()
    }

    /// Frames decoded so far (kept or not).
    pub fn decoded_frames(&self) -> u64 {
        self.decoder.as_ref().map_or(0, |d| d.decoded)
    }

    /// [`pump`](Self::pump), closing the stream on error.
    fn guarded(&mut self, until_done: bool) -> Result<Vec<VideoFrame>> {
        let result = self.pump(until_done);
        if result.is_err() {
            self.closed = true;
        }
        result
    }

    /// Decodes packets until the demuxer waits for input (`until_done`: until it ends).
    fn pump(&mut self, until_done: bool) -> Result<Vec<VideoFrame>> {
        let started = Instant::now();
        let mut out = Vec::new();
        loop {
            let (header, packets, done, idle) = {
                let mut st = self.shared.lock();
                loop {
                    let idle = st.starved && st.pending.is_empty();
                    if st.header.is_some()
                        || !st.packets.is_empty()
                        || st.done.is_some()
                        || (idle && !until_done)
                    {
                        break;
                    }
                    if let Some(limit) = self.options.limits.max_decode_time {
                        if started.elapsed() > limit {
                            return Err(MediaError::VideoDecodeTimeout {
                                limit_ms: limit.as_millis() as u64,
                            });
                        }
                    }
                    st = self
                        .shared
                        .changed
                        .wait_timeout(st, POLL)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                let idle = st.starved && st.pending.is_empty();
                let packets: Vec<Packet> = st.packets.drain(..).collect();
                self.shared.changed.notify_all();
                (st.header.take(), packets, st.done.take(), idle)
            };
            if let Some(header) = header {
                self.decoder = Some(FrameDecoder::new(&header, &self.options, true)?);
                self.info = Some(header.info);
            }
            if let Some(decoder) = self.decoder.as_mut() {
                for packet in &packets {
                    decoder.send(packet, &mut self.picker, &mut out, started)?;
                }
            }
            if let Some(done) = done {
                done?;
                let decoder = self.decoder.as_mut().ok_or(MediaError::VideoNoStream)?;
                decoder.finish(&mut self.picker, &mut out)?;
                if decoder.decoded == 0 {
                    return Err(MediaError::VideoNoFrames {
                        packets: decoder.packets,
                    });
                }
                return Ok(out);
            }
            if idle && !until_done {
                return Ok(out);
            }
        }
    }
}

impl Drop for LiveDecoder {
    fn drop(&mut self) {
        {
            let mut st = self.shared.lock();
            st.abort = true;
            self.shared.changed.notify_all();
        }
        if let Some(worker) = self.worker.take() {
            // The thread ends at its next read or queue wait; a panic there has nothing
            // left to report to.
            let _ = worker.join();
        }
    }
}

/// The demux thread: opens the container over the chunk queue and forwards packets.
fn demux(shared: Arc<Shared>, container: Container, options: VideoOptions) {
    let result = demux_packets(&shared, container, &options);
    let mut st = shared.lock();
    st.done = Some(result);
    shared.changed.notify_all();
}

fn demux_packets(shared: &Arc<Shared>, container: Container, options: &VideoOptions) -> Result<()> {
    let reader = ChunkReader {
        shared: Arc::clone(shared),
    };
    let mut input = open_input(forward_io(reader)?, container, LIVE_BUDGET)?;
    let header = stream_header(&input, container.name(), options)?;
    let index = header.index;
    {
        let mut st = shared.lock();
        st.header = Some(header);
        shared.changed.notify_all();
    }
    let mut packet = Packet::empty();
    loop {
        match packet.read(&mut input) {
            Ok(()) if packet.stream() == index => {
                let mut st = shared.lock();
                while st.packets.len() >= MAX_QUEUED_PACKETS && !st.abort {
                    st = shared.changed.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                if st.abort {
                    return Ok(());
                }
                st.packets
                    .push_back(std::mem::replace(&mut packet, Packet::empty()));
                shared.changed.notify_all();
            }
            Ok(()) => {}
            Err(ffmpeg::Error::Eof) => return Ok(()),
            Err(ffmpeg::Error::InvalidData) if !options.strict => {}
            Err(e) => {
                return Err(MediaError::VideoDemux {
                    reason: ff_reason(&e),
                })
            }
        }
    }
}
