//! Writing checkpoint folders: shared by `quantize` and `moeify`, which both
//! read one checkpoint and write another in the same layout.

use std::path::Path;

use safetensors::Dtype;
use serde_json::Value;

use crate::checkpoint::StoredDType;
use crate::error::{Error, Result};

/// The safetensors dtype that stores `d` (named `name` in errors).
pub fn st_dtype(d: StoredDType, name: &str) -> Result<Dtype> {
    Ok(match d {
        StoredDType::F32 => Dtype::F32,
        StoredDType::BF16 => Dtype::BF16,
        StoredDType::F16 => Dtype::F16,
        StoredDType::U8 => Dtype::U8,
        StoredDType::I32 => Dtype::I32,
        StoredDType::Other("f64") => Dtype::F64,
        StoredDType::Other("i64") => Dtype::I64,
        StoredDType::Other("i8") => Dtype::I8,
        StoredDType::Other("i16") => Dtype::I16,
        StoredDType::Other("bool") => Dtype::BOOL,
        other => {
            return Err(Error::TensorDType {
                name: name.into(),
                expected: "a dtype safetensors can write".into(),
                found: other.name().into(),
            })
        }
    })
}

/// A write failure of `path` as a typed error.
pub fn bad_write(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::BadFile {
        what: "safetensors output",
        path: path.to_path_buf(),
        detail: e.to_string(),
    }
}

/// Writes `v` as pretty JSON with a trailing newline.
pub fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| bad_write(path, e))?;
    std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
}

/// Copies every regular file of `in_dir` except weights and `config.json`.
pub fn copy_side_files(in_dir: &Path, out_dir: &Path) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    let entries = std::fs::read_dir(in_dir).map_err(|e| Error::io(in_dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(in_dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_weights = name.ends_with(".safetensors") || name == "model.safetensors.index.json";
        if is_weights || name == "config.json" || !entry.path().is_file() {
            continue;
        }
        let to = out_dir.join(&name);
        std::fs::copy(entry.path(), &to).map_err(|e| Error::io(&to, e))?;
        copied.push(name);
    }
    copied.sort();
    Ok(copied)
}
