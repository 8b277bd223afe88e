//! Prometheus metrics in the text exposition format (version 0.0.4),
//! written by hand: counters and histograms are atomics updated by the
//! request tasks; gauges (queue length, running sequences, KV pages,
//! sessions, expert selections) are read from the engine at scrape time.
//! Every name carries the `caracal_` prefix, except
//! `process_resident_memory_bytes`, which keeps Prometheus' standard name so
//! dashboards and the soak bench (`caracal bench --duration`) find it.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use super::engine::EngineSnapshot;

/// Bucket bounds in seconds for time-to-first-token.
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Bucket bounds in seconds for inter-token latency.
const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// A cumulative histogram.
#[derive(Debug)]
pub struct Histogram {
    /// Upper bounds.
    bounds: &'static [f64],
    /// Observations at or below each bound (not cumulative; summed when written).
    counts: Vec<AtomicU64>,
    /// Observations above the last bound.
    over: AtomicU64,
    /// Sum of observations in microseconds.
    sum_us: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            over: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    /// Records one observation in seconds.
    pub fn observe(&self, seconds: f64) {
        let s = seconds.max(0.0);
        match self.bounds.iter().position(|&b| s <= b) {
            Some(i) => self.counts[i].fetch_add(1, Ordering::Relaxed),
            None => self.over.fetch_add(1, Ordering::Relaxed),
        };
        self.sum_us.fetch_add((s * 1e6) as u64, Ordering::Relaxed);
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.over.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {cum}");
    }
}

/// The gateway's counters.
#[derive(Debug)]
pub struct Metrics {
    /// Requests received, by endpoint (index into [`ENDPOINTS`]).
    pub requests: Vec<AtomicU64>,
    /// Requests answered with an error.
    pub errors: AtomicU64,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: AtomicU64,
    /// Of those, tokens served from the prefix cache.
    pub cached_tokens: AtomicU64,
    /// Generated tokens.
    pub generation_tokens: AtomicU64,
    /// Times a stream's client was slower than decoding (its buffer was full).
    pub credit_stalls: AtomicU64,
    /// Generations cancelled by their client.
    pub cancelled: AtomicU64,
    /// WebSocket sessions open now.
    pub sessions: AtomicU64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between tokens.
    pub itl: Histogram,
}

/// Endpoint labels of `caracal_requests_total`.
pub const ENDPOINTS: &[&str] = &[
    "chat_completions",
    "completions",
    "responses",
    "responses_ws",
    "realtime",
];

/// An endpoint label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    ChatCompletions = 0,
    /// `/v1/completions`.
    Completions = 1,
    /// `POST /v1/responses`.
    Responses = 2,
    /// A `response.create` over the WebSocket mode.
    ResponsesWs = 3,
    /// A Realtime `response.create`.
    Realtime = 4,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: ENDPOINTS.iter().map(|_| AtomicU64::new(0)).collect(),
            errors: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            credit_stalls: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            sessions: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
        }
    }
}

fn counter(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
    );
}

fn gauge(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

impl Metrics {
    /// Counts a request.
    pub fn request(&self, e: Endpoint) {
        self.requests[e as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The exposition text, with the engine's gauges.
    pub fn render(&self, engine: &EngineSnapshot) -> String {
        let mut out = String::new();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP caracal_requests_total Requests received, by endpoint.\n# TYPE caracal_requests_total counter"
        );
        for (name, c) in ENDPOINTS.iter().zip(&self.requests) {
            let _ = writeln!(
                out,
                "caracal_requests_total{{endpoint=\"{name}\"}} {}",
                ld(c)
            );
        }
        counter(
            &mut out,
            "caracal_request_errors_total",
            "Requests answered with an error.",
            ld(&self.errors),
        );
        counter(
            &mut out,
            "caracal_prompt_tokens_total",
            "Prompt tokens of finished requests.",
            ld(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "caracal_prefix_cache_hit_tokens_total",
            "Prompt tokens served from the prefix cache.",
            ld(&self.cached_tokens),
        );
        counter(
            &mut out,
            "caracal_generation_tokens_total",
            "Tokens generated.",
            ld(&self.generation_tokens),
        );
        counter(
            &mut out,
            "caracal_credit_stalls_total",
            "Times a stream's client read slower than decoding and its sequence waited.",
            ld(&self.credit_stalls),
        );
        counter(
            &mut out,
            "caracal_cancelled_total",
            "Generations cancelled by their client.",
            ld(&self.cancelled),
        );
        gauge(
            &mut out,
            "caracal_sessions",
            "WebSocket sessions open.",
            ld(&self.sessions),
        );
        self.ttft.write(
            &mut out,
            "caracal_time_to_first_token_seconds",
            "Time from request to first token.",
        );
        self.itl.write(
            &mut out,
            "caracal_inter_token_latency_seconds",
            "Time between consecutive tokens of a stream.",
        );
        gauge(
            &mut out,
            "caracal_engine_up",
            "1 while the scheduler thread runs (0: it stopped and no request can be served).",
            u64::from(engine.scheduler.is_some()),
        );
        if let Some(rss) = resident_memory_bytes() {
            gauge(
                &mut out,
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                rss,
            );
        }
        if let Some(s) = &engine.scheduler {
            gauge(
                &mut out,
                "caracal_queue_length",
                "Requests waiting for admission.",
                s.waiting as u64,
            );
            gauge(
                &mut out,
                "caracal_running_sequences",
                "Sequences running.",
                s.running as u64,
            );
            counter(
                &mut out,
                "caracal_forward_steps_total",
                "Batched forward steps.",
                s.steps,
            );
            counter(
                &mut out,
                "caracal_prefill_tokens_total",
                "Prompt tokens computed (not from cache).",
                s.prefill_tokens,
            );
            counter(
                &mut out,
                "caracal_panics_total",
                "Panics caught in the scheduler; the requests behind each got internal_error.",
                s.panics,
            );
        }
        if let Some(m) = &engine.memory {
            let used = m.total_pages.saturating_sub(m.free_pages) as u64;
            gauge(
                &mut out,
                "caracal_kv_pages_used",
                "KV pages in use (cached or running).",
                used,
            );
            gauge(
                &mut out,
                "caracal_kv_pages_cached",
                "KV pages held by the prefix cache (evictable unless locked).",
                m.cached_pages as u64,
            );
            gauge(
                &mut out,
                "caracal_kv_pages_locked",
                "Cached KV pages locked by running requests or session pins (not evictable).",
                m.cached_pages.saturating_sub(m.evictable_pages) as u64,
            );
            gauge(
                &mut out,
                "caracal_kv_pages_free",
                "KV pages free.",
                m.free_pages as u64,
            );
            gauge(
                &mut out,
                "caracal_kv_pages_total",
                "KV pages in the pool.",
                m.total_pages as u64,
            );
            gauge(
                &mut out,
                "caracal_pinned_sessions",
                "Sessions with a pinned cache path.",
                m.pinned_sessions as u64,
            );
            gauge(
                &mut out,
                "caracal_kda_snapshots",
                "Recurrent-state (KDA) snapshots held by the prefix cache.",
                m.snapshots as u64,
            );
            counter(
                &mut out,
                "caracal_prefix_lookup_tokens_total",
                "Prompt tokens looked up in the prefix cache.",
                m.lookup_tokens,
            );
        }
        if let Some(counts) = &engine.expert_counts {
            let _ = writeln!(
                out,
                "# HELP caracal_expert_selections_total Times each routed expert was chosen.\n# TYPE caracal_expert_selections_total counter"
            );
            for (layer, experts) in counts.iter().enumerate() {
                for (expert, n) in experts.iter().enumerate() {
                    let _ = writeln!(
                        out,
                        "caracal_expert_selections_total{{layer=\"{layer}\",expert=\"{expert}\"}} {n}"
                    );
                }
            }
        }
        out
    }
}

/// This process's resident set in bytes: the second field of
/// `/proc/self/statm` (pages) times the page size; `None` where there is no
/// procfs (the gauge is then left out).
pub fn resident_memory_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().map(|p| pages * p)
}

/// The vision encoder's counters (servers whose model takes images).
pub fn render_vision(out: &mut String, v: &caracal_actors::vision::VisionStats) {
    counter(
        out,
        "caracal_vision_encodes_total",
        "Vision-tower passes (each may pack several media items).",
        v.encodes,
    );
    counter(
        out,
        "caracal_vision_items_encoded_total",
        "Media items the vision tower encoded.",
        v.items_encoded,
    );
    counter(
        out,
        "caracal_vision_cache_hits_total",
        "Media items whose embeddings came from the encoder cache.",
        v.cache_hits,
    );
    counter(
        out,
        "caracal_vision_cache_misses_total",
        "Media items that had to be encoded.",
        v.cache_misses,
    );
    counter(
        out,
        "caracal_vision_cache_evictions_total",
        "Embeddings evicted from the encoder cache.",
        v.evictions,
    );
    gauge(
        out,
        "caracal_vision_cache_bytes",
        "Bytes of embeddings held by the encoder cache.",
        v.bytes_cached,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.ttft.observe(0.003);
        m.ttft.observe(0.2);
        m.ttft.observe(100.0);
        m.request(Endpoint::Completions);
        let text = m.render(&EngineSnapshot::default());
        assert!(text.contains("caracal_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("caracal_time_to_first_token_seconds_bucket{le=\"0.25\"} 2\n"));
        assert!(text.contains("caracal_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("caracal_time_to_first_token_seconds_count 3\n"));
        assert!(text.contains("caracal_requests_total{endpoint=\"completions\"} 1\n"));
        // Linux: the resident set of this test process, at least a few pages.
        let rss = text
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .and_then(|v| v.parse::<u64>().ok())
            .expect("the RSS gauge");
        assert!(rss >= 1 << 20, "{rss}");
    }
}
