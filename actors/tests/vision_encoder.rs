//! The VisionEncoder actor end to end, with a hand-built vision tower whose output is a
//! deterministic function of each item's patches: batching, answers equal to encoding
//! alone, in-flight deduplication, the byte-bounded LRU, errors and overload.

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use caracal_actors::engine::{
    CausalLm, EngineError, ModelInfo, SeqBatch, SeqState, VisionInfo, VisionInput, VisionTower,
};
use caracal_actors::vision::{
    EncodeRequest, VisionConfig, VisionEncoder, VisionError, VisionStats,
};
use caracal_kernels::paged::KvPool;

const PATCH: usize = 2;
const OUT_DIM: usize = 3;

/// Rows of one item: for merged cell `c` and output column `d`,
/// `(d + 1) · mean over frames of Σ (values of the cell's 4 patches)`; an item whose
/// first value is NaN makes the whole call fail.
fn reference_rows(item: &VisionInput) -> Vec<f32> {
    let [t, h, w] = item.grid_thw;
    let patch_len = 3 * PATCH * PATCH;
    let mut out = Vec::with_capacity(h * w / 4 * OUT_DIM);
    for i in 0..h / 2 {
        for j in 0..w / 2 {
            let mut sum = 0f32;
            for f in 0..t {
                for (di, dj) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    let p = f * h * w + (2 * i + di) * w + 2 * j + dj;
                    sum += item.pixel_values[p * patch_len..(p + 1) * patch_len]
                        .iter()
                        .sum::<f32>();
                }
            }
            out.extend((0..OUT_DIM).map(|d| (d + 1) as f32 * sum / t as f32));
        }
    }
    out
}

/// A tower that records the size of every call and can hold a call until released.
struct TestTower {
    info: VisionInfo,
    calls: Mutex<Vec<usize>>,
    /// When set, each call first reports it started and then waits for a release.
    gate: Mutex<Option<(std_mpsc::Sender<()>, std_mpsc::Receiver<()>)>>,
}

impl VisionTower for TestTower {
    fn info(&self) -> &VisionInfo {
        &self.info
    }

    fn encode(&self, items: &[VisionInput]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.calls.lock().expect("calls").push(items.len());
        if let Some((started, release)) = self.gate.lock().expect("gate").as_ref() {
            let _ = started.send(());
            let _ = release.recv_timeout(Duration::from_secs(10));
        }
        if items.iter().any(|i| i.pixel_values[0].is_nan()) {
            return Err(EngineError::InvalidInput("NaN in pixel values".into()));
        }
        Ok(items.iter().map(reference_rows).collect())
    }
}

/// A model that exposes only the tower (text forwards are not part of these tests).
struct VisionOnly {
    info: ModelInfo,
    tower: Option<TestTower>,
}

impl CausalLm for VisionOnly {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn new_state(&self) -> SeqState {
        SeqState::default()
    }
    fn forward(&self, _: &mut KvPool, _: &mut [SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        Err(EngineError::InvalidInput(
            "this test model has no text path".into(),
        ))
    }
    fn vision(&self) -> Option<&dyn VisionTower> {
        self.tower.as_ref().map(|t| t as &dyn VisionTower)
    }
}

/// Test controls for the gate.
struct Gate {
    started: std_mpsc::Receiver<()>,
    release: std_mpsc::Sender<()>,
}

fn model(gated: bool, with_tower: bool) -> (Arc<VisionOnly>, Option<Gate>) {
    let (gate, controls) = if gated {
        let (started_tx, started_rx) = std_mpsc::channel();
        let (release_tx, release_rx) = std_mpsc::channel();
        (
            Some((started_tx, release_rx)),
            Some(Gate {
                started: started_rx,
                release: release_tx,
            }),
        )
    } else {
        (None, None)
    };
    let info = ModelInfo {
        model_type: "vision_test".into(),
        vocab_size: 8,
        max_position: 64,
        kv_layers: 0,
        kv_width: 0,
        kv_segment: 1,
        linear_layers: 0,
        eos_ids: vec![],
        num_params: 0,
    };
    let tower = with_tower.then(|| TestTower {
        info: VisionInfo {
            patch_size: PATCH,
            merge_size: 2,
            max_frames: 4,
            out_dim: OUT_DIM,
            placeholder_id: 5,
        },
        calls: Mutex::new(Vec::new()),
        gate: Mutex::new(gate),
    });
    (Arc::new(VisionOnly { info, tower }), controls)
}

fn calls(model: &VisionOnly) -> Vec<usize> {
    model
        .tower
        .as_ref()
        .expect("tower")
        .calls
        .lock()
        .expect("calls")
        .clone()
}

/// An item of grid `[t, h, w]` whose values depend on `seed`.
fn item(seed: u64, grid: [usize; 3]) -> VisionInput {
    let n = grid.iter().product::<usize>() * 3 * PATCH * PATCH;
    VisionInput {
        pixel_values: (0..n)
            .map(|i| ((i as u64 * 31 + seed * 17) % 97) as f32 / 97.0 - 0.5)
            .collect(),
        grid_thw: grid,
    }
}

fn request(seed: u64, grid: [usize; 3]) -> EncodeRequest {
    EncodeRequest {
        hash: seed,
        input: item(seed, grid),
    }
}

fn wait_for(encoder: &VisionEncoder, what: &str, pred: impl Fn(&VisionStats) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !pred(&encoder.stats()) {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {:?}",
            encoder.stats()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn concurrent_requests_share_one_packed_call_and_equal_encoding_alone() {
    let (m, gate) = model(true, true);
    let gate = gate.expect("gated");
    let encoder = VisionEncoder::start(m.clone(), VisionConfig::default()).expect("tower");
    let first = encoder.submit(request(0, [1, 2, 2])).expect("queued");
    gate.started
        .recv_timeout(Duration::from_secs(10))
        .expect("first call started");
    // While the first call runs, five sessions ask for five different items.
    let grids = [[1, 2, 4], [4, 2, 2], [2, 4, 2], [1, 2, 2], [3, 2, 2]];
    let waiting: Vec<_> = grids
        .iter()
        .enumerate()
        .map(|(i, &g)| encoder.submit(request(i as u64 + 1, g)).expect("queued"))
        .collect();
    wait_for(&encoder, "five waiting", |s| s.waiting == 6);
    gate.release.send(()).expect("release first");
    gate.started
        .recv_timeout(Duration::from_secs(10))
        .expect("second call started");
    gate.release.send(()).expect("release second");
    let rt = runtime();
    let first = rt.block_on(first).expect("answered").expect("encoded");
    assert_eq!(&first[..], &reference_rows(&item(0, [1, 2, 2]))[..]);
    for (i, (rx, g)) in waiting.into_iter().zip(grids).enumerate() {
        let rows = rt.block_on(rx).expect("answered").expect("encoded");
        assert_eq!(
            &rows[..],
            &reference_rows(&item(i as u64 + 1, g))[..],
            "item {i}"
        );
    }
    assert_eq!(calls(&m), [1, 5], "six requests, two tower calls");
    let s = encoder.stats();
    assert_eq!(
        (s.encodes, s.items_encoded, s.cache_misses, s.waiting),
        (2, 6, 6, 0)
    );
}

#[test]
fn duplicate_hashes_in_flight_are_encoded_once() {
    let (m, gate) = model(true, true);
    let gate = gate.expect("gated");
    let encoder = VisionEncoder::start(m.clone(), VisionConfig::default()).expect("tower");
    let a = encoder.submit(request(7, [2, 2, 2])).expect("queued");
    gate.started
        .recv_timeout(Duration::from_secs(10))
        .expect("call started");
    let b = encoder.submit(request(7, [2, 2, 2])).expect("queued");
    let c = encoder.submit(request(7, [2, 2, 2])).expect("queued");
    wait_for(&encoder, "two coalesced", |s| s.coalesced == 2);
    gate.release.send(()).expect("release");
    let rt = runtime();
    let rows: Vec<_> = [a, b, c]
        .into_iter()
        .map(|rx| rt.block_on(rx).expect("answered").expect("encoded"))
        .collect();
    assert!(
        rows.iter().all(|r| Arc::ptr_eq(r, &rows[0])),
        "one shared result"
    );
    assert_eq!(calls(&m), [1]);
    // Later requests are cache hits: no more calls.
    let again = rt
        .block_on(encoder.encode(request(7, [2, 2, 2])))
        .expect("cached");
    assert!(Arc::ptr_eq(&again, &rows[0]));
    assert_eq!(calls(&m), [1]);
    let s = encoder.stats();
    assert_eq!((s.items_encoded, s.coalesced, s.cache_hits), (1, 2, 1));
}

#[test]
fn cache_is_bounded_in_bytes_and_evicts_least_recently_used() {
    let (m, _) = model(false, true);
    // One [1, 2, 2] item is 1 token x 3 f32 = 12 bytes; room for two.
    let config = VisionConfig {
        cache_bytes: 24,
        ..VisionConfig::default()
    };
    let encoder = VisionEncoder::start(m.clone(), config).expect("tower");
    let rt = runtime();
    let enc = |seed| {
        rt.block_on(encoder.encode(request(seed, [1, 2, 2])))
            .expect("encoded")
    };
    enc(1);
    enc(2);
    enc(1); // hit: 1 becomes the most recent
    enc(3); // evicts 2
    assert_eq!(calls(&m).len(), 3);
    enc(1); // still cached
    assert_eq!(calls(&m).len(), 3);
    enc(2); // evicted earlier: encoded again, evicting 3
    assert_eq!(calls(&m).len(), 4);
    let s = encoder.stats();
    assert_eq!(
        (s.cache_hits, s.evictions, s.entries, s.bytes_cached),
        (2, 2, 2, 24)
    );
    // The same hash with another grid is another item.
    rt.block_on(encoder.encode(request(1, [1, 2, 4])))
        .expect("encoded");
    assert_eq!(calls(&m).len(), 5);
}

#[test]
fn errors_reach_every_waiter_and_are_not_cached() {
    let (m, gate) = model(true, true);
    let gate = gate.expect("gated");
    let encoder = VisionEncoder::start(m.clone(), VisionConfig::default()).expect("tower");
    let mut bad = request(9, [1, 2, 2]);
    bad.input.pixel_values[0] = f32::NAN;
    let a = encoder.submit(bad.clone()).expect("queued");
    gate.started
        .recv_timeout(Duration::from_secs(10))
        .expect("call started");
    let b = encoder.submit(bad.clone()).expect("queued");
    wait_for(&encoder, "coalesced", |s| s.coalesced == 1);
    gate.release.send(()).expect("release");
    let rt = runtime();
    for rx in [a, b] {
        match rt.block_on(rx).expect("answered") {
            Err(VisionError::Encode(m)) => assert!(m.contains("NaN"), "{m}"),
            other => panic!("expected an encode error, got {other:?}"),
        }
    }
    // Not cached: asking again calls the tower again.
    let c = encoder.submit(bad).expect("queued");
    gate.started
        .recv_timeout(Duration::from_secs(10))
        .expect("second call");
    gate.release.send(()).expect("release");
    let err = rt.block_on(c).expect("answered").unwrap_err();
    assert_eq!(err.kind(), "vision_encode_failed");
    assert_eq!(calls(&m), [1, 1]);
    // A malformed item never reaches the tower.
    let mut short = request(10, [1, 2, 2]);
    short.input.pixel_values.truncate(5);
    let err = rt.block_on(encoder.encode(short)).unwrap_err();
    assert!(matches!(err, VisionError::InvalidInput(_)), "{err}");
    assert_eq!(calls(&m).len(), 2);
    assert_eq!(encoder.stats().errors, 4);
    // A model without a tower cannot start an encoder.
    let (plain, _) = model(false, false);
    assert_eq!(
        VisionEncoder::start(plain, VisionConfig::default()).err(),
        Some(VisionError::NoVisionTower)
    );
}

#[test]
fn a_full_queue_answers_overloaded_instead_of_blocking() {
    let (m, gate) = model(true, true);
    let gate = gate.expect("gated");
    let config = VisionConfig {
        queue_capacity: 2,
        ..VisionConfig::default()
    };
    let encoder = VisionEncoder::start(m.clone(), config).expect("tower");
    let a = encoder.submit(request(1, [1, 2, 2])).expect("queued");
    gate.started
        .recv_timeout(Duration::from_secs(10))
        .expect("call started");
    let b = encoder.submit(request(2, [1, 2, 2])).expect("queued");
    wait_for(&encoder, "two waiting", |s| s.waiting == 2);
    // Refused either by the command queue or by the waiting bound, never blocked.
    let rt = runtime();
    let started = Instant::now();
    let err = match encoder.submit(request(3, [1, 2, 2])) {
        Err(e) => e,
        Ok(rx) => rt.block_on(rx).expect("answered").unwrap_err(),
    };
    assert_eq!(err, VisionError::Overloaded { capacity: 2 });
    assert_eq!(err.kind(), "overloaded");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered without waiting"
    );
    gate.release.send(()).expect("release a");
    gate.started
        .recv_timeout(Duration::from_secs(10))
        .expect("b started");
    gate.release.send(()).expect("release b");
    for rx in [a, b] {
        rt.block_on(rx).expect("answered").expect("encoded");
    }
    assert_eq!(encoder.stats().overloaded, 1);
}
