//! Images per second through a Kimi K2.5 vision tower and projector: one
//! image per `encode` call against all images packed into one call.
//!
//! The checkpoint is loaded through the normal loader
//! (`caracal::models::load`), every image is preprocessed with
//! `caracal_media::process_image_bytes` under
//! `ImageProcessorConfig::kimi_k25()`, and
//! `vision().encode(&[VisionInput])` runs on the rayon pool the way the
//! engine calls it (`caracal_kernels::threads::on_pool`). Each repetition
//! times both modes in turn (one at a time first, then packed), after
//! `--warmup` untimed repetitions; the median and the best are reported.
//!
//! Prints one JSON object on stdout. With `--dump DIR` it also writes, per
//! image `i`, `DIR/{i}.pixels.f32` (the preprocessed patches) and
//! `DIR/{i}.embeds.f32` (the rows of the packed call), little-endian f32,
//! for `bench/vision.py` to compare with transformers.
//!
//! ```text
//! cargo build --release --example vision_bench
//! target/release/examples/vision_bench --model DIR --threads 2 a.png b.png
//! ```

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use caracal::models::VisionInput;
use caracal_kernels::threads::on_pool;
use caracal_media::{process_image_bytes, ImageProcessorConfig};
use clap::Parser;
use serde_json::json;

/// Command-line arguments.
#[derive(Parser)]
#[command(about = "Vision tower + projector throughput: one image per call vs packed")]
struct Args {
    /// A Kimi K2.5 checkpoint folder (published layout).
    #[arg(long)]
    model: PathBuf,
    /// Worker threads of the rayon pool.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Untimed repetitions before the timed ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed repetitions of each mode.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Where to write the patches and embeddings of every image.
    #[arg(long)]
    dump: Option<PathBuf>,
    /// PNG or JPEG files.
    #[arg(required = true)]
    images: Vec<PathBuf>,
}

/// Median and best of `v` (seconds).
fn stats(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let mid = s.len() / 2;
    let median = if s.len() % 2 == 1 {
        s[mid]
    } else {
        (s[mid - 1] + s[mid]) / 2.0
    };
    (median, s[0])
}

fn write_f32(path: &PathBuf, v: &[f32]) -> Result<()> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.reps == 0 {
        return Err(anyhow!("--reps must be at least 1"));
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build_global()
        .context("building the rayon pool")?;

    let t0 = Instant::now();
    let model = caracal::models::load(&args.model)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let load_s = t0.elapsed().as_secs_f64();
    let tower = model
        .vision()
        .ok_or_else(|| anyhow!("{} has no vision tower", args.model.display()))?;

    let cfg = ImageProcessorConfig::kimi_k25();
    let t0 = Instant::now();
    let mut items = Vec::with_capacity(args.images.len());
    for p in &args.images {
        let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
        let patches = process_image_bytes(&bytes, &cfg)
            .with_context(|| format!("preprocessing {}", p.display()))?;
        items.push(VisionInput {
            pixel_values: patches.pixel_values,
            grid_thw: patches.grid_thw,
        });
    }
    let preprocess_s = t0.elapsed().as_secs_f64();
    let patches: usize = items
        .iter()
        .map(|i| i.grid_thw.iter().product::<usize>())
        .sum();
    let tokens: usize = items.iter().map(|i| tower.num_tokens(i.grid_thw)).sum();

    let one_at_a_time = || -> Result<Vec<Vec<f32>>> {
        let mut rows = Vec::with_capacity(items.len());
        for it in &items {
            let mut r = on_pool(|| tower.encode(std::slice::from_ref(it)))?;
            rows.push(r.pop().ok_or_else(|| anyhow!("encode returned no rows"))?);
        }
        Ok(rows)
    };
    let packed = || -> Result<Vec<Vec<f32>>> { Ok(on_pool(|| tower.encode(&items))?) };

    for _ in 0..args.warmup {
        one_at_a_time()?;
        packed()?;
    }
    let (mut single_s, mut packed_s) = (Vec::new(), Vec::new());
    let (mut single_rows, mut packed_rows) = (Vec::new(), Vec::new());
    for _ in 0..args.reps {
        let t = Instant::now();
        single_rows = one_at_a_time()?;
        single_s.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        packed_rows = packed()?;
        packed_s.push(t.elapsed().as_secs_f64());
    }
    // Packing must not change any item's rows (attention stays within each item).
    let packing_max_abs_diff = single_rows
        .iter()
        .zip(&packed_rows)
        .flat_map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()))
        .fold(0.0f32, f32::max);

    if let Some(dir) = &args.dump {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (i, (it, rows)) in items.iter().zip(&packed_rows).enumerate() {
            write_f32(&dir.join(format!("{i}.pixels.f32")), &it.pixel_values)?;
            write_f32(&dir.join(format!("{i}.embeds.f32")), rows)?;
        }
    }

    let n = items.len() as f64;
    let (s_med, s_best) = stats(&single_s);
    let (p_med, p_best) = stats(&packed_s);
    let report = json!({
        "engine": "caracal",
        "threads": args.threads,
        "images": items.len(),
        "patches": patches,
        "tokens": tokens,
        "grid_thw": items.iter().map(|i| i.grid_thw).collect::<Vec<_>>(),
        "out_dim": tower.info().out_dim,
        "load_s": load_s,
        "preprocess_s": preprocess_s,
        "warmup": args.warmup,
        "reps": args.reps,
        "single": {"seconds": single_s, "median_s": s_med, "best_s": s_best,
                   "images_per_s": n / s_med, "images_per_s_best": n / s_best},
        "packed": {"seconds": packed_s, "median_s": p_med, "best_s": p_best,
                   "images_per_s": n / p_med, "images_per_s_best": n / p_best},
        "packing_max_abs_diff": packing_max_abs_diff,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
