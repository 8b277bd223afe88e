//! A printable summary of any GGUF file, for the CLI's `inspect`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use super::quants::GgmlType;
use super::reader::GgufFile;
use super::Result;

/// How many tensors of one ggml type a file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeCount {
    /// The storage type.
    pub ggml_type: GgmlType,
    /// Tensors of this type.
    pub tensors: usize,
    /// Elements in them.
    pub elements: u64,
    /// Bytes of data in them.
    pub bytes: u64,
}

/// Summary of a GGUF file: header facts, tensor counts per type, and metadata.
#[derive(Debug, Clone)]
pub struct GgufInfo {
    /// The file summarised.
    pub path: PathBuf,
    /// GGUF version.
    pub version: u32,
    /// File size in bytes.
    pub file_size: u64,
    /// Data alignment.
    pub alignment: u64,
    /// `general.architecture`, if present.
    pub architecture: Option<String>,
    /// `general.name`, if present.
    pub name: Option<String>,
    /// Number of tensors.
    pub tensor_count: usize,
    /// Total elements over all tensors.
    pub parameters: u64,
    /// Total tensor data bytes.
    pub tensor_bytes: u64,
    /// Per-type counts, most tensors first (ties by type id).
    pub types: Vec<TypeCount>,
    /// Every metadata entry as (key, type name, value with long arrays/strings elided).
    pub metadata: Vec<(String, String, String)>,
}

impl GgufInfo {
    /// Summarises an open file.
    pub fn from_file(f: &GgufFile) -> GgufInfo {
        let mut by_type: BTreeMap<GgmlType, TypeCount> = BTreeMap::new();
        for t in f.tensors() {
            let e = by_type.entry(t.ggml_type).or_insert(TypeCount {
                ggml_type: t.ggml_type,
                tensors: 0,
                elements: 0,
                bytes: 0,
            });
            e.tensors += 1;
            e.elements += t.n_elements();
            e.bytes += t.n_bytes() as u64;
        }
        let mut types: Vec<TypeCount> = by_type.into_values().collect();
        types.sort_by(|a, b| {
            b.tensors
                .cmp(&a.tensors)
                .then(a.ggml_type.id().cmp(&b.ggml_type.id()))
        });
        GgufInfo {
            path: f.path().to_path_buf(),
            version: f.version(),
            file_size: f.file_len() as u64,
            alignment: f.alignment(),
            architecture: f.get_str("general.architecture").map(str::to_string),
            name: f.get_str("general.name").map(str::to_string),
            tensor_count: f.tensor_count(),
            parameters: types.iter().map(|t| t.elements).sum(),
            tensor_bytes: types.iter().map(|t| t.bytes).sum(),
            types,
            metadata: f
                .metadata_entries()
                .map(|(k, v)| (k.to_string(), v.type_name(), v.to_string()))
                .collect(),
        }
    }

    /// Average stored bits per weight over all tensors.
    pub fn bits_per_weight(&self) -> f64 {
        if self.parameters == 0 {
            0.0
        } else {
            self.tensor_bytes as f64 * 8.0 / self.parameters as f64
        }
    }
}

impl fmt::Display for GgufInfo {
    /// A multi-line report: header, per-type table, then one line per metadata key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "file          {}", self.path.display())?;
        writeln!(
            f,
            "gguf version  {} (alignment {})",
            self.version, self.alignment
        )?;
        writeln!(
            f,
            "architecture  {}",
            self.architecture.as_deref().unwrap_or("(none)")
        )?;
        if let Some(name) = &self.name {
            writeln!(f, "name          {name}")?;
        }
        writeln!(
            f,
            "tensors       {} ({} parameters, {} data bytes, {:.2} bits/weight; file {} bytes)",
            self.tensor_count,
            self.parameters,
            self.tensor_bytes,
            self.bits_per_weight(),
            self.file_size
        )?;
        for t in &self.types {
            writeln!(
                f,
                "  {:<8} {:>6} tensors {:>14} elements {:>14} bytes",
                t.ggml_type, t.tensors, t.elements, t.bytes
            )?;
        }
        writeln!(f, "metadata      {} keys", self.metadata.len())?;
        for (k, ty, v) in &self.metadata {
            writeln!(f, "  {k} ({ty}) = {v}")?;
        }
        Ok(())
    }
}

/// Opens `path` and summarises it (see [`GgufInfo`]).
pub fn gguf_info(path: &Path) -> Result<GgufInfo> {
    Ok(GgufInfo::from_file(&GgufFile::open(path)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summarises_fixture_types_and_metadata() {
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/quants.gguf");
        let info = gguf_info(&path).expect("fixture opens");
        assert_eq!(info.version, 3);
        assert_eq!(info.architecture.as_deref(), Some("fixture"));
        assert_eq!(info.tensor_count, 14);
        assert_eq!(info.types.len(), 14, "one tensor per type");
        assert!(info
            .types
            .iter()
            .all(|t| t.tensors == 1 && t.elements == 512));
        assert_eq!(info.parameters, 14 * 512);
        let q4_0 = info
            .types
            .iter()
            .find(|t| t.ggml_type == GgmlType::Q4_0)
            .expect("q4_0");
        assert_eq!(q4_0.bytes, 16 * 18);
        let text = info.to_string();
        assert!(text.contains("architecture  fixture"), "{text}");
        assert!(text.contains("fixture.cols (U32) = 256"), "{text}");
        assert!(text.contains("Q6_K"), "{text}");
    }
}
