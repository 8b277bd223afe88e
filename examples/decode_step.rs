//! Times the model's forward for one decode step of N sequences, alone: no
//! scheduler, sampler or client, each sequence rewound to the same context
//! before every step, so the steps of one run are alike and two builds (or
//! two batch sizes) compare step by step. `caracal bench` measures the
//! served rate; this measures the step that rate is made of, and its
//! profile (`perf record -e cpu-clock -- target/release/examples/decode_step …`)
//! holds nothing else.
//!
//! ```text
//! cargo run --release --example decode_step -- --model DIR
//!     [--seqs 1,8] [--context 160] [--steps 400] [--activations int8|f32]
//! ```
//!
//! Prints, per batch size, the median, 10th and 90th percentile and best
//! step time, and the decode rate of the median step (`seqs / median`); with
//! several batch sizes, each one's rate over the first's.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use caracal::models::{CausalLm, LoadOptions, LogitsMode, SeqBatch};
use caracal_kernels::paged::{KvDtype, KvPool};
use caracal_kernels::threads::on_pool;
use caracal_kernels::Activations;

/// Tokens per KV page (the server's default).
const PAGE_SIZE: usize = 16;

/// Command-line settings.
struct Args {
    model: PathBuf,
    seqs: Vec<usize>,
    context: usize,
    steps: usize,
    activations: Activations,
}

fn usage() -> &'static str {
    "usage: decode_step --model DIR [--seqs 1,8] [--context 160] [--steps 400] \
     [--activations int8|f32]"
}

fn parse_args() -> Result<Args> {
    let mut model = None;
    let mut a = Args {
        model: PathBuf::new(),
        seqs: vec![1, 8],
        context: 160,
        steps: 400,
        activations: Activations::Int8,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(value()?)),
            "--seqs" => {
                a.seqs = value()?
                    .split(',')
                    .map(|s| s.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .context("--seqs takes batch sizes such as 1,8")?
            }
            "--context" => a.context = value()?.parse().context("--context")?,
            "--steps" => a.steps = value()?.parse().context("--steps")?,
            "--activations" => {
                a.activations = match value()?.as_str() {
                    "int8" => Activations::Int8,
                    "f32" => Activations::F32,
                    other => bail!("--activations must be int8 or f32, got {other}"),
                }
            }
            "-h" | "--help" => {
                println!("{}", usage());
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}\n{}", usage()),
        }
    }
    a.model = model.with_context(|| format!("--model is required\n{}", usage()))?;
    if a.seqs.is_empty() || a.seqs.contains(&0) || a.context == 0 || a.steps == 0 {
        bail!(
            "--seqs, --context and --steps must be positive\n{}",
            usage()
        );
    }
    Ok(a)
}

/// Step times in ms of `steps` decode steps of `seqs` sequences at `context`.
fn time_steps(model: &dyn CausalLm, seqs: usize, context: usize, steps: usize) -> Result<Vec<f64>> {
    let info = model.info();
    if context + 1 > info.max_position {
        bail!(
            "--context {context} exceeds the model's {} positions",
            info.max_position
        );
    }
    let pages = seqs * ((context + 1).div_ceil(PAGE_SIZE) + 1);
    let mut cache = KvPool::with_layout(
        info.kv_layers,
        if info.kv_layers > 0 { pages } else { 0 },
        PAGE_SIZE,
        info.kv_width,
        info.kv_segment,
        KvDtype::Bf16,
    );
    let vocab = info.vocab_size as u32;
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut states: Vec<_> = (0..seqs).map(|_| model.new_state()).collect();
    for st in &mut states {
        let mut batch = [SeqBatch {
            tokens: &prompt,
            state: st,
            logits: LogitsMode::Last,
            embeds: &[],
        }];
        on_pool(|| model.forward(&mut cache, &mut batch))?;
    }
    let next = [prompt[context / 2]];
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        // Rewound: every step decodes position `context` again (KDA layers
        // would need their states restored; this times attention models).
        for st in &mut states {
            st.len = context;
        }
        let mut batch: Vec<SeqBatch> = states
            .iter_mut()
            .map(|st| SeqBatch {
                tokens: &next,
                state: st,
                logits: LogitsMode::Last,
                embeds: &[],
            })
            .collect();
        let t = Instant::now();
        on_pool(|| model.forward(&mut cache, &mut batch))?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(times)
}

fn main() -> Result<()> {
    caracal::malloc::keep_freed_memory();
    let a = parse_args()?;
    let opts = LoadOptions {
        activations: a.activations,
    };
    let model = caracal::models::load_with(&a.model, &opts)
        .with_context(|| format!("loading {}", a.model.display()))?;
    if model.info().linear_layers > 0 {
        bail!("decode_step rewinds sequences by length, which KDA layers do not allow");
    }
    caracal::malloc::huge_pages_for_resident_memory();
    println!(
        "{}: context {}, {} steps a batch size, {} rayon threads",
        a.model.display(),
        a.context,
        a.steps,
        rayon::current_num_threads()
    );
    let mut first_rate = None;
    for &n in &a.seqs {
        let mut t = time_steps(model.as_ref(), n, a.context, a.steps)?;
        t.sort_by(f64::total_cmp);
        let pick = |q: f64| t[((t.len() - 1) as f64 * q).round() as usize];
        let rate = n as f64 * 1e3 / pick(0.5);
        let ratio = first_rate.map_or(String::new(), |r: f64| format!("  {:.2}x", rate / r));
        first_rate.get_or_insert(rate);
        println!(
            "seqs {n:>3}: step median {:.3} ms  p10 {:.3}  p90 {:.3}  best {:.3}  -> {rate:.1} tok/s{ratio}",
            pick(0.5),
            pick(0.1),
            pick(0.9),
            t[0],
        );
    }
    Ok(())
}
