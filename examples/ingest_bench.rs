//! Video ingest throughput: frames per core-second of decode + select at
//! 2 fps + resize to the Kimi K2.5 per-frame target size, Caracal against the
//! `ffmpeg` CLI, side by side in one run.
//!
//! The clip is made first with the `ffmpeg` CLI (default: 20 s of `testsrc2`,
//! 1280×720 at 30 fps, libx264, yuv420p). Then, per repetition, in turn:
//!
//! - Caracal `fast`: `caracal_media::video::decode_video_file` with
//!   `ScalePath::Fast` (one swscale bicubic step from YUV to RGB at the target
//!   size), one decoder thread;
//! - Caracal `exact`: the same with `ScalePath::Exact` (RGB at the source size,
//!   then the Pillow-exact bicubic resize, the default);
//! - Caracal `fast` with `skip_untaken: false`: every frame up to the last taken
//!   one decoded (by default packets of untaken frames go to the decoder with
//!   `skip_frame = nonref`, so untaken non-reference frames are never decoded);
//! - `ffmpeg -threads 1 -i CLIP -vf fps=2,scale=W:H:flags=bicubic -f rawvideo
//!   -pix_fmt rgb24 -`, its output read from a pipe and counted.
//!
//! CPU time is user + system time from `getrusage`: `RUSAGE_SELF` around each
//! Caracal decode (everything runs on this thread), `RUSAGE_CHILDREN` around
//! the waited-for `ffmpeg` child. The target size `W×H` is
//! `caracal_media::plan_resize` under `video_frame_config()` (1202×676 for
//! 720p). Frames per core-second count the frames each side outputs (the
//! kept frames); source frames per core-second are reported too. Medians
//! (and best) of `--reps`; one JSON object on stdout, a table on stderr.
//!
//! ```text
//! cargo build --release --example ingest_bench
//! target/release/examples/ingest_bench --reps 5
//! ```

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use caracal_media::video::{
    decode_video_file, video_frame_config, Container, ScalePath, VideoOptions,
};
use clap::Parser;
use serde_json::json;

/// Command-line arguments.
#[derive(Parser)]
#[command(about = "Frames per core-second of video ingest: Caracal vs the ffmpeg CLI")]
struct Args {
    /// Use this clip instead of generating one.
    #[arg(long)]
    clip: Option<PathBuf>,
    /// Generated clip: seconds.
    #[arg(long, default_value_t = 20)]
    seconds: u32,
    /// Generated clip: source frame rate.
    #[arg(long, default_value_t = 30)]
    src_fps: u32,
    /// Generated clip: WIDTHxHEIGHT.
    #[arg(long, default_value = "1280x720")]
    size: String,
    /// Sampling rate of both sides.
    #[arg(long, default_value_t = 2.0)]
    fps: f64,
    /// Timed repetitions (each runs all three in turn).
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

/// User + system CPU seconds of `who` (`RUSAGE_SELF` or `RUSAGE_CHILDREN`).
fn cpu_seconds(who: libc::c_int) -> Result<f64> {
    // SAFETY: `getrusage` fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(who, &mut ru) } != 0 {
        bail!("getrusage failed: {}", std::io::Error::last_os_error());
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    Ok(t(ru.ru_utime) + t(ru.ru_stime))
}

/// One timed pass: frames out, source frames, frames decoded (`None` for
/// ffmpeg), CPU seconds, wall seconds.
#[derive(Debug, Clone, Copy)]
struct Pass {
    frames: usize,
    source_frames: u64,
    decoded_frames: Option<u64>,
    cpu_s: f64,
    wall_s: f64,
}

fn caracal_pass(clip: &PathBuf, fps: f64, scale: ScalePath, skip: bool) -> Result<Pass> {
    let opts = VideoOptions {
        fps,
        scale,
        threads: 1,
        skip_untaken: skip,
        ..VideoOptions::default()
    };
    let (c0, w0) = (cpu_seconds(libc::RUSAGE_SELF)?, Instant::now());
    let v = decode_video_file(clip, Container::Auto, &opts)?;
    let (c1, wall) = (cpu_seconds(libc::RUSAGE_SELF)?, w0.elapsed().as_secs_f64());
    // Keep the frames alive until after the measurement, then check them.
    let frames = v.frames.len();
    if frames == 0 {
        bail!("Caracal kept no frame of {}", clip.display());
    }
    Ok(Pass {
        frames,
        source_frames: v.total_frames,
        decoded_frames: Some(v.decoded_frames),
        cpu_s: c1 - c0,
        wall_s: wall,
    })
}

fn ffmpeg_pass(clip: &PathBuf, fps: f64, (w, h): (u32, u32), source_frames: u64) -> Result<Pass> {
    let (c0, w0) = (cpu_seconds(libc::RUSAGE_CHILDREN)?, Instant::now());
    let mut child = Command::new("ffmpeg")
        .args([
            "-hide_banner",
            "-loglevel",
            "error",
            "-nostdin",
            "-threads",
            "1",
            "-i",
        ])
        .arg(clip)
        .args(["-vf", &format!("fps={fps},scale={w}:{h}:flags=bicubic")])
        .args(["-f", "rawvideo", "-pix_fmt", "rgb24", "-"])
        .stdout(Stdio::piped())
        .spawn()
        .context("starting ffmpeg")?;
    let mut out = child.stdout.take().context("ffmpeg stdout")?;
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0usize;
    loop {
        let n = out.read(&mut buf)?;
        if n == 0 {
            break;
        }
        bytes += n;
    }
    let status = child.wait()?;
    let (c1, wall) = (
        cpu_seconds(libc::RUSAGE_CHILDREN)?,
        w0.elapsed().as_secs_f64(),
    );
    if !status.success() {
        bail!("ffmpeg failed: {status}");
    }
    let frame = (w * h * 3) as usize;
    if !bytes.is_multiple_of(frame) || bytes == 0 {
        bail!("ffmpeg wrote {bytes} bytes, not whole {w}x{h} RGB frames");
    }
    Ok(Pass {
        frames: bytes / frame,
        source_frames,
        decoded_frames: None,
        cpu_s: c1 - c0,
        wall_s: wall,
    })
}

fn make_clip(a: &Args) -> Result<PathBuf> {
    let path = std::env::temp_dir().join(format!(
        "caracal-ingest-{}-{}s-{}fps-{}.mp4",
        a.size,
        a.seconds,
        a.src_fps,
        std::process::id()
    ));
    let status = Command::new("ffmpeg")
        .args([
            "-hide_banner",
            "-loglevel",
            "error",
            "-nostdin",
            "-y",
            "-f",
            "lavfi",
        ])
        .args([
            "-i",
            &format!("testsrc2=size={}:rate={}", a.size, a.src_fps),
        ])
        .args(["-t", &a.seconds.to_string()])
        .args(["-c:v", "libx264", "-pix_fmt", "yuv420p"])
        .arg(&path)
        .status()
        .context("running ffmpeg to make the clip (is the ffmpeg CLI installed?)")?;
    if !status.success() {
        bail!("ffmpeg could not make the clip: {status}");
    }
    Ok(path)
}

/// Median and best (lowest) CPU seconds.
fn stats(passes: &[Pass]) -> (f64, f64) {
    let mut cpu: Vec<f64> = passes.iter().map(|p| p.cpu_s).collect();
    cpu.sort_by(|a, b| a.total_cmp(b));
    (cpu[cpu.len() / 2], cpu[0])
}

/// Median wall seconds.
fn median_wall(passes: &[Pass]) -> f64 {
    let mut w: Vec<f64> = passes.iter().map(|p| p.wall_s).collect();
    w.sort_by(|a, b| a.total_cmp(b));
    w[w.len() / 2]
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.reps == 0 {
        bail!("--reps must be at least 1");
    }
    let (made, clip) = match &a.clip {
        Some(c) => (false, c.clone()),
        None => (true, make_clip(&a)?),
    };
    caracal_media::video::init();
    // The target size from the clip's own dimensions (one untimed decode).
    let probe = decode_video_file(
        &clip,
        Container::Auto,
        &VideoOptions {
            fps: a.fps,
            threads: 1,
            ..VideoOptions::default()
        },
    )?;
    let plan =
        caracal_media::plan_resize(probe.info.width, probe.info.height, &video_frame_config())?;
    let target = (plan.resized_width, plan.resized_height);
    let source = probe.total_frames;
    drop(probe);
    let (mut fast, mut exact, mut full, mut ff) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..a.reps {
        fast.push(caracal_pass(&clip, a.fps, ScalePath::Fast, true)?);
        exact.push(caracal_pass(&clip, a.fps, ScalePath::Exact, true)?);
        full.push(caracal_pass(&clip, a.fps, ScalePath::Fast, false)?);
        ff.push(ffmpeg_pass(&clip, a.fps, target, source)?);
    }
    if made {
        let _ = std::fs::remove_file(&clip);
    }
    let (ff_med, _) = stats(&ff);
    let ff_rate = ff[0].frames as f64 / ff_med;
    let side = |name: &str, passes: &[Pass]| {
        let (med, best) = stats(passes);
        let p = passes[0];
        let rate = p.frames as f64 / med;
        json!({
            "name": name,
            "frames": p.frames,
            "source_frames": p.source_frames,
            "decoded_frames": p.decoded_frames,
            "cpu_s_median": med,
            "cpu_s_best": best,
            "wall_s_median": median_wall(passes),
            "frames_per_core_s": rate,
            "source_frames_per_core_s": p.source_frames as f64 / med,
            "ratio_vs_ffmpeg": rate / ff_rate,
        })
    };
    let rows = [
        side("caracal fast (one swscale step)", &fast),
        side("caracal exact (RGB + Pillow bicubic)", &exact),
        side("caracal fast, every frame decoded", &full),
        side("ffmpeg -threads 1 fps,scale bicubic", &ff),
    ];
    eprintln!(
        "{} at {} fps -> {}x{}, {} reps, medians of CPU (user+sys)",
        clip.display(),
        a.fps,
        target.0,
        target.1,
        a.reps
    );
    eprintln!(
        "{:<40} {:>7} {:>8} {:>8} {:>9} {:>14} {:>16} {:>8}",
        "side", "frames", "source", "decoded", "CPU s", "frames/core-s", "source/core-s", "ratio"
    );
    for r in &rows {
        eprintln!(
            "{:<40} {:>7} {:>8} {:>8} {:>9.3} {:>14.2} {:>16.1} {:>7.2}x",
            r["name"].as_str().unwrap_or(""),
            r["frames"].as_u64().unwrap_or(0),
            r["source_frames"].as_u64().unwrap_or(0),
            r["decoded_frames"]
                .as_u64()
                .map_or("-".to_string(), |n| n.to_string()),
            r["cpu_s_median"].as_f64().unwrap_or(0.0),
            r["frames_per_core_s"].as_f64().unwrap_or(0.0),
            r["source_frames_per_core_s"].as_f64().unwrap_or(0.0),
            r["ratio_vs_ffmpeg"].as_f64().unwrap_or(0.0),
        );
    }
    println!(
        "{}",
        json!({
            "clip": clip.display().to_string(),
            "size": a.size,
            "seconds": a.seconds,
            "src_fps": a.src_fps,
            "fps": a.fps,
            "target": [target.0, target.1],
            "reps": a.reps,
            "sides": rows,
        })
    );
    Ok(())
}
