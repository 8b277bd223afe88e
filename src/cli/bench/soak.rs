//! `caracal bench --url URL --scenario agent-loop --duration D`: the soak.
//!
//! `--sessions` agent-loop sessions run without pause until `D` has elapsed;
//! each runs conversations of `--turns` turns (the agent loop of [`super::load`])
//! and starts a fresh conversation after the last, so the context stays bounded
//! and the server's prefix cache keeps filling and evicting. Every
//! `--sample-interval` (default 60 s) the collector scrapes the server's
//! `/metrics` (`process_resident_memory_bytes`, `caracal_kv_pages_used`,
//! `caracal_kv_pages_total`) and writes one [`Row`]: those gauges, the TTFT
//! p50/p99 of the turns that finished in that interval, their count, the
//! errors by [`ErrorKind`] and the output tokens per second. Rows go to the
//! `--csv` file as they are taken (flushed, so a killed run keeps its rows),
//! and at the end to the `--plot` PNG ([`super::plot`]).
//!
//! The summary is a leak check: least-squares slopes of RSS (bytes/min) and
//! KV pages (pages/min) over the samples after warm-up (the first
//! [`WARMUP_SHARE`] of `D`), TTFT p99 of the first against the last interval,
//! and the error counts. Sessions send each finished turn to the collector
//! over a bounded channel; when `D` is reached the sessions are aborted (their
//! in-flight turns are not counted: the client closing a stream is not a
//! server error).

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use caracal_kernels::sampling::Rng;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::client::{ServerError, Streamed, Target};
use super::plot;
use super::workload::{append_turn, words, Dist, LoadConfig, Shape, SoakConfig};

/// Share of the duration treated as warm-up (excluded from the slopes).
pub const WARMUP_SHARE: f64 = 0.2;
/// Finished turns the channel to the collector holds before sessions wait.
const TURN_CHANNEL: usize = 1024;
/// Longest one turn may take before it counts as a `timeout` error.
const TURN_TIMEOUT: Duration = Duration::from_secs(120);
/// Longest a `/metrics` scrape may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed turn before the session starts over (no hot error loop).
const ERROR_BACKOFF: Duration = Duration::from_millis(200);
/// Error messages kept in the report.
const KEPT_ERRORS: usize = 8;

/// Parses `30m`, `120s`, `1h`, `500ms` or a bare number of seconds.
pub fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (e.g. 30m, 120s, 1h, 500ms)"))?;
    let secs = match unit.trim() {
        "" | "s" => v,
        "ms" => v / 1e3,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        other => return Err(format!("unknown unit `{other}` in `{s}` (ms, s, m, h)")),
    };
    if secs.is_nan() || secs <= 0.0 || secs.is_infinite() {
        return Err(format!("`{s}` must be a positive duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Kinds of failed turns, counted per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The TCP connection could not be made.
    Connect,
    /// A 4xx answer (429 overloaded included).
    Http4xx,
    /// A 5xx answer.
    Http5xx,
    /// An `error` event inside the stream.
    ErrorEvent,
    /// The stream broke off or was malformed.
    Stream,
    /// The turn took longer than [`TURN_TIMEOUT`].
    Timeout,
    /// A `/metrics` scrape failed.
    Metrics,
}

impl ErrorKind {
    /// Every kind, in CSV column order.
    pub const ALL: [ErrorKind; 7] = [
        ErrorKind::Connect,
        ErrorKind::Http4xx,
        ErrorKind::Http5xx,
        ErrorKind::ErrorEvent,
        ErrorKind::Stream,
        ErrorKind::Timeout,
        ErrorKind::Metrics,
    ];

    /// The name in the CSV header and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::Connect => "connect",
            ErrorKind::Http4xx => "http_4xx",
            ErrorKind::Http5xx => "http_5xx",
            ErrorKind::ErrorEvent => "error_event",
            ErrorKind::Stream => "stream",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Metrics => "metrics",
        }
    }

    /// The kind of a failed request.
    fn of(e: &anyhow::Error) -> ErrorKind {
        for cause in e.chain() {
            if let Some(s) = cause.downcast_ref::<ServerError>() {
                return match s {
                    ServerError::Status { status, .. } if *status < 500 => ErrorKind::Http4xx,
                    ServerError::Status { .. } => ErrorKind::Http5xx,
                    ServerError::Event(_) => ErrorKind::ErrorEvent,
                    ServerError::Truncated => ErrorKind::Stream,
                };
            }
            if cause.downcast_ref::<std::io::Error>().is_some()
                && e.to_string().starts_with("connecting to")
            {
                return ErrorKind::Connect;
            }
        }
        ErrorKind::Stream
    }
}

/// One sample of the run.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Seconds since the sessions started.
    pub elapsed_s: f64,
    /// `process_resident_memory_bytes` of the server; `None` when not reported.
    pub rss_bytes: Option<u64>,
    /// `caracal_kv_pages_used`.
    pub kv_pages_used: Option<u64>,
    /// `caracal_kv_pages_total`.
    pub kv_pages_total: Option<u64>,
    /// TTFT of the turns finished in this interval.
    pub ttft_ms: Dist,
    /// Turns finished in this interval.
    pub requests: usize,
    /// Failures in this interval, by kind (every kind present, zeros included).
    pub errors: BTreeMap<&'static str, usize>,
    /// Output tokens of this interval per second.
    pub tokens_per_s: f64,
}

impl Row {
    /// Failures of every kind in this interval.
    fn error_total(&self) -> usize {
        self.errors.values().sum()
    }
}

/// The end-of-run figures.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    /// Sessions run at once.
    pub sessions: usize,
    /// Turns per conversation before a session starts a new one.
    pub turns: usize,
    /// The requested duration.
    pub duration_s: f64,
    /// Seconds between rows.
    pub sample_interval_s: f64,
    /// Samples before this many seconds are warm-up (excluded from the slopes).
    pub warmup_s: f64,
    /// Turns that finished.
    pub requests: usize,
    /// Failures by kind over the whole run.
    pub errors: BTreeMap<&'static str, usize>,
    /// The first few failure messages.
    pub error_messages: Vec<String>,
    /// Output tokens, summed.
    pub output_tokens: usize,
    /// Output tokens per second over the run.
    pub output_throughput: f64,
    /// Mean server RSS after warm-up, bytes.
    pub rss_mean_bytes: Option<f64>,
    /// Least-squares slope of the server RSS after warm-up, bytes per minute.
    pub rss_slope_bytes_per_min: Option<f64>,
    /// Least-squares slope of the KV pages in use after warm-up, pages per minute.
    pub kv_pages_slope_per_min: Option<f64>,
    /// Most KV pages in use in any sample, and the pool size.
    pub kv_pages_max: Option<u64>,
    /// The pool size the server reports.
    pub kv_pages_total: Option<u64>,
    /// TTFT p99 of the first interval, ms.
    pub ttft_p99_first_ms: f64,
    /// TTFT p99 of the last interval, ms.
    pub ttft_p99_last_ms: f64,
    /// Every sample.
    pub rows: Vec<Row>,
}

/// A finished turn, as a session reports it to the collector.
struct TurnDone {
    /// What it measured, or why it failed.
    result: std::result::Result<Streamed, (ErrorKind, String)>,
}

/// What the collector gathers between two rows.
#[derive(Default)]
struct Interval {
    /// TTFT of each finished turn, seconds.
    ttft: Vec<f64>,
    /// Finished turns.
    requests: usize,
    /// Output tokens of those turns.
    output_tokens: usize,
    /// Failures by kind.
    errors: BTreeMap<ErrorKind, usize>,
}

impl Interval {
    fn fail(&mut self, kind: ErrorKind) {
        *self.errors.entry(kind).or_default() += 1;
    }
}

/// The gauges a row reads from `/metrics`.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Gauges {
    rss: Option<u64>,
    used: Option<u64>,
    total: Option<u64>,
}

/// Reads the unlabelled samples the soak needs from Prometheus text.
fn parse_gauges(text: &str) -> Gauges {
    let mut g = Gauges::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let mut it = line.split_whitespace();
        let (Some(name), Some(value)) = (it.next(), it.next()) else {
            continue;
        };
        let v = value.parse::<f64>().ok().map(|v| v as u64);
        match name {
            "process_resident_memory_bytes" => g.rss = v,
            "caracal_kv_pages_used" => g.used = v,
            "caracal_kv_pages_total" => g.total = v,
            _ => {}
        }
    }
    g
}

/// Least-squares slope of `y` against `x`; `None` under two points or with
/// all `x` equal.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// One session: conversations of `turns` turns, one after another, until aborted.
async fn session(
    target: Arc<Target>,
    shape: Arc<Shape>,
    id: usize,
    seed: u64,
    cfg: Arc<LoadConfig>,
    tx: mpsc::Sender<TurnDone>,
) {
    let mut rng = Rng::new(seed);
    for round in 0usize.. {
        let mut convo = shape.first(words(&mut rng, cfg.input_len));
        for t in 0..cfg.turns.max(1) {
            let body = shape.body(convo.clone(), shape.max_tokens);
            let result = match tokio::time::timeout(
                TURN_TIMEOUT,
                target.stream(shape.endpoint.path(), &body),
            )
            .await
            {
                Ok(Ok(s)) => Ok(s),
                Ok(Err(e)) => Err((ErrorKind::of(&e), format!("{e:#}"))),
                Err(_) => Err((
                    ErrorKind::Timeout,
                    format!("a turn took over {} s", TURN_TIMEOUT.as_secs()),
                )),
            };
            let answer = result.as_ref().ok().map(|s| s.text.clone());
            if tx.send(TurnDone { result }).await.is_err() {
                return;
            }
            let Some(answer) = answer else {
                tokio::time::sleep(ERROR_BACKOFF).await;
                break;
            };
            let tool = words(&mut rng, cfg.tool_result_len);
            append_turn(
                &mut convo,
                shape.endpoint,
                &answer,
                &tool,
                id,
                round * 1000 + t,
            );
        }
    }
}

/// The CSV header.
fn csv_header() -> String {
    let mut h = String::from(
        "elapsed_s,rss_bytes,kv_pages_used,kv_pages_total,ttft_p50_ms,ttft_p99_ms,requests,errors",
    );
    for k in ErrorKind::ALL {
        h.push_str(",errors_");
        h.push_str(k.name());
    }
    h.push_str(",tokens_per_s");
    h
}

/// One CSV line (empty cells for gauges the server did not report).
fn csv_line(r: &Row) -> String {
    let opt = |v: Option<u64>| v.map_or_else(String::new, |v| v.to_string());
    let mut s = format!(
        "{:.1},{},{},{},{:.2},{:.2},{},{}",
        r.elapsed_s,
        opt(r.rss_bytes),
        opt(r.kv_pages_used),
        opt(r.kv_pages_total),
        r.ttft_ms.p50,
        r.ttft_ms.p99,
        r.requests,
        r.error_total()
    );
    for k in ErrorKind::ALL {
        s.push_str(&format!(
            ",{}",
            r.errors.get(k.name()).copied().unwrap_or(0)
        ));
    }
    s.push_str(&format!(",{:.1}", r.tokens_per_s));
    s
}

/// Runs the soak after the warm-up request.
pub async fn run(
    target: Arc<Target>,
    shape: Arc<Shape>,
    cfg: &LoadConfig,
    soak: &SoakConfig,
    rng: &mut Rng,
) -> Result<SoakReport> {
    if soak.sample_interval > soak.duration {
        bail!("--sample-interval must not exceed --duration");
    }
    let mut csv = match &soak.csv {
        Some(p) => {
            let mut f = std::io::BufWriter::new(
                std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
            );
            writeln!(f, "{}", csv_header())?;
            f.flush()?;
            Some(f)
        }
        None => None,
    };
    let shared = Arc::new(cfg.clone());
    let (tx, mut rx) = mpsc::channel(TURN_CHANNEL);
    let mut set = JoinSet::new();
    let sessions = cfg.sessions.max(1);
    let t0 = Instant::now();
    for id in 0..sessions {
        set.spawn(session(
            target.clone(),
            shape.clone(),
            id,
            rng.next_u64(),
            shared.clone(),
            tx.clone(),
        ));
    }
    drop(tx);
    let deadline = t0 + soak.duration;
    let mut next = t0 + soak.sample_interval;
    let mut last_row = t0;
    let mut acc = Interval::default();
    let mut rows = Vec::new();
    let mut messages = Vec::new();
    let mut total_tokens = 0;
    loop {
        let at = next.min(deadline);
        tokio::select! {
            turn = rx.recv() => {
                let Some(turn) = turn else { bail!("every session ended") };
                match turn.result {
                    Ok(s) => {
                        acc.requests += 1;
                        acc.output_tokens += s.output_tokens();
                        if let Some(t) = s.ttft {
                            acc.ttft.push(t);
                        }
                    }
                    Err((kind, msg)) => {
                        acc.fail(kind);
                        if messages.len() < KEPT_ERRORS {
                            messages.push(msg);
                        }
                    }
                }
            }
            _ = tokio::time::sleep_until(at.into()) => {
                let now = Instant::now();
                let gauges = match tokio::time::timeout(SCRAPE_TIMEOUT, target.get_text("/metrics")).await {
                    Ok(Ok(text)) => parse_gauges(&text),
                    Ok(Err(e)) => {
                        acc.fail(ErrorKind::Metrics);
                        if messages.len() < KEPT_ERRORS {
                            messages.push(format!("/metrics: {e:#}"));
                        }
                        Gauges::default()
                    }
                    Err(_) => {
                        acc.fail(ErrorKind::Metrics);
                        Gauges::default()
                    }
                };
                let done = std::mem::take(&mut acc);
                total_tokens += done.output_tokens;
                let span = (now - last_row).as_secs_f64().max(1e-9);
                last_row = now;
                let row = Row {
                    elapsed_s: (now - t0).as_secs_f64(),
                    rss_bytes: gauges.rss,
                    kv_pages_used: gauges.used,
                    kv_pages_total: gauges.total,
                    ttft_ms: Dist::of_secs(done.ttft.iter().copied()),
                    requests: done.requests,
                    errors: ErrorKind::ALL
                        .iter()
                        .map(|k| (k.name(), done.errors.get(k).copied().unwrap_or(0)))
                        .collect(),
                    tokens_per_s: done.output_tokens as f64 / span,
                };
                if let Some(f) = csv.as_mut() {
                    writeln!(f, "{}", csv_line(&row))?;
                    f.flush()?;
                }
                eprintln!("soak: {}", csv_line(&row));
                rows.push(row);
                if now >= deadline {
                    break;
                }
                next += soak.sample_interval;
            }
        }
    }
    set.abort_all();
    let report = summarize(cfg, soak, rows, messages, total_tokens, t0.elapsed());
    if let Some(p) = &soak.plot {
        draw(p, &report)?;
    }
    Ok(report)
}

/// The end-of-run figures from the rows.
fn summarize(
    cfg: &LoadConfig,
    soak: &SoakConfig,
    rows: Vec<Row>,
    error_messages: Vec<String>,
    output_tokens: usize,
    wall: Duration,
) -> SoakReport {
    let warmup_s = soak.duration.as_secs_f64() * WARMUP_SHARE;
    let after: Vec<&Row> = rows.iter().filter(|r| r.elapsed_s >= warmup_s).collect();
    let points = |f: &dyn Fn(&Row) -> Option<u64>| -> Vec<(f64, f64)> {
        after
            .iter()
            .filter_map(|r| f(r).map(|v| (r.elapsed_s / 60.0, v as f64)))
            .collect()
    };
    let rss = points(&|r| r.rss_bytes);
    let kv = points(&|r| r.kv_pages_used);
    let mut errors: BTreeMap<&'static str, usize> =
        ErrorKind::ALL.iter().map(|k| (k.name(), 0)).collect();
    for r in &rows {
        for (k, n) in &r.errors {
            *errors.entry(k).or_default() += n;
        }
    }
    SoakReport {
        sessions: cfg.sessions.max(1),
        turns: cfg.turns.max(1),
        duration_s: soak.duration.as_secs_f64(),
        sample_interval_s: soak.sample_interval.as_secs_f64(),
        warmup_s,
        requests: rows.iter().map(|r| r.requests).sum(),
        errors,
        error_messages,
        output_tokens,
        output_throughput: output_tokens as f64 / wall.as_secs_f64().max(1e-9),
        rss_mean_bytes: (!rss.is_empty())
            .then(|| rss.iter().map(|p| p.1).sum::<f64>() / rss.len() as f64),
        rss_slope_bytes_per_min: slope(&rss),
        kv_pages_slope_per_min: slope(&kv),
        kv_pages_max: rows.iter().filter_map(|r| r.kv_pages_used).max(),
        kv_pages_total: rows.iter().filter_map(|r| r.kv_pages_total).max(),
        ttft_p99_first_ms: rows.first().map_or(0.0, |r| r.ttft_ms.p99),
        ttft_p99_last_ms: rows.last().map_or(0.0, |r| r.ttft_ms.p99),
        rows,
    }
}

/// The PNG: RSS (MiB), KV pages in use (axis up to the pool size), TTFT p99.
fn draw(path: &std::path::Path, r: &SoakReport) -> Result<()> {
    let minutes: Vec<f64> = r.rows.iter().map(|x| x.elapsed_s / 60.0).collect();
    let total = r.kv_pages_total;
    let kv_title = match total {
        Some(t) => format!("KV pages used (of {t})"),
        None => "KV pages used".to_string(),
    };
    plot::write_png(
        path,
        &minutes,
        r.duration_s / 60.0,
        r.warmup_s / 60.0,
        &[
            plot::Series {
                title: "Server RSS (MiB)",
                values: r
                    .rows
                    .iter()
                    .map(|x| x.rss_bytes.map(|b| b as f64 / (1u64 << 20) as f64))
                    .collect(),
                color: [30, 80, 200],
                y_max: None,
            },
            plot::Series {
                title: &kv_title,
                values: r
                    .rows
                    .iter()
                    .map(|x| x.kv_pages_used.map(|v| v as f64))
                    .collect(),
                color: [200, 40, 40],
                y_max: total.map(|t| t as f64),
            },
            plot::Series {
                title: "TTFT p99 (ms)",
                values: r
                    .rows
                    .iter()
                    .map(|x| (x.requests > 0).then_some(x.ttft_ms.p99))
                    .collect(),
                color: [20, 140, 60],
                y_max: None,
            },
        ],
    )
}

/// Prints the summary table.
pub fn print(url: &str, model: &str, r: &SoakReport) {
    let mib = |b: f64| b / (1u64 << 20) as f64;
    println!(
        "{url}, model `{model}`: soak, {} sessions x {} turns per conversation, {:.0} s, \
         a row every {:.0} s; {} turns, {:.1} output tok/s",
        r.sessions, r.turns, r.duration_s, r.sample_interval_s, r.requests, r.output_throughput
    );
    let fmt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or_else(|| "n/a".into(), f);
    println!(
        "after warm-up ({:.0} s): RSS mean {} MiB, slope {} MiB/min ({}); KV pages slope {} pages/min \
         (max {} of {})",
        r.warmup_s,
        fmt(r.rss_mean_bytes, &|b| format!("{:.1}", mib(b))),
        fmt(r.rss_slope_bytes_per_min, &|s| format!("{:+.3}", mib(s))),
        match (r.rss_slope_bytes_per_min, r.rss_mean_bytes) {
            (Some(s), Some(m)) if m > 0.0 => format!("{:+.3}% of the mean per min", s / m * 1e2),
            _ => "n/a".into(),
        },
        fmt(r.kv_pages_slope_per_min, &|s| format!("{s:+.1}")),
        r.kv_pages_max.map_or_else(|| "n/a".into(), |v| v.to_string()),
        r.kv_pages_total.map_or_else(|| "n/a".into(), |v| v.to_string()),
    );
    println!(
        "TTFT p99 first interval {:.1} ms, last interval {:.1} ms",
        r.ttft_p99_first_ms, r.ttft_p99_last_ms
    );
    let errs: Vec<String> = r
        .errors
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    println!(
        "errors: {}",
        if errs.is_empty() {
            "none".to_string()
        } else {
            errs.join(", ")
        }
    );
    for e in &r.error_messages {
        println!("error: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse_duration("120s"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("15"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5m"), Ok(Duration::from_secs(90)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("m").is_err());
    }

    #[test]
    fn least_squares_slope() {
        let pts: Vec<(f64, f64)> = (0..10).map(|i| (i as f64, 3.0 * i as f64 + 7.0)).collect();
        assert!((slope(&pts).expect("slope") - 3.0).abs() < 1e-12);
        assert_eq!(slope(&[(1.0, 2.0)]), None);
        assert_eq!(slope(&[(1.0, 2.0), (1.0, 5.0)]), None);
        // Noise around a flat line: a slope near zero.
        let flat = [(0.0, 10.0), (1.0, 11.0), (2.0, 9.0), (3.0, 10.0)];
        assert!(slope(&flat).expect("slope").abs() < 0.5);
    }

    #[test]
    fn gauges_from_prometheus_text() {
        let text =
            "# HELP process_resident_memory_bytes x\n# TYPE process_resident_memory_bytes gauge\n\
                    process_resident_memory_bytes 1.2e6\ncaracal_kv_pages_used 12\n\
                    caracal_kv_pages_used_total{x=\"1\"} 5\ncaracal_kv_pages_total 64\n";
        assert_eq!(
            parse_gauges(text),
            Gauges {
                rss: Some(1_200_000),
                used: Some(12),
                total: Some(64)
            }
        );
        assert_eq!(parse_gauges(""), Gauges::default());
    }

    #[test]
    fn errors_are_classified_by_type() {
        let status = |s| -> anyhow::Error {
            ServerError::Status {
                status: s,
                url: "u".into(),
                body: String::new(),
            }
            .into()
        };
        assert_eq!(ErrorKind::of(&status(429)), ErrorKind::Http4xx);
        assert_eq!(ErrorKind::of(&status(503)), ErrorKind::Http5xx);
        let ev: anyhow::Error = ServerError::Event("x".into()).into();
        assert_eq!(ErrorKind::of(&ev), ErrorKind::ErrorEvent);
        let refused =
            anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
                .context("connecting to 127.0.0.1:1");
        assert_eq!(ErrorKind::of(&refused), ErrorKind::Connect);
        assert_eq!(ErrorKind::of(&anyhow::anyhow!("odd")), ErrorKind::Stream);
    }

    #[test]
    fn csv_rows_match_the_header() {
        let row = Row {
            elapsed_s: 60.0,
            rss_bytes: Some(1000),
            kv_pages_used: None,
            kv_pages_total: Some(8),
            ttft_ms: Dist::default(),
            requests: 3,
            errors: ErrorKind::ALL.iter().map(|k| (k.name(), 1)).collect(),
            tokens_per_s: 2.0,
        };
        let line = csv_line(&row);
        assert_eq!(line.split(',').count(), csv_header().split(',').count());
        assert!(line.starts_with("60.0,1000,,8,0.00,0.00,3,7,1,"), "{line}");
    }
}
