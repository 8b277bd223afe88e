//! Where Caracal keeps files of its own: `$CARACAL_CACHE`, else
//! `$HOME/.cache/caracal` (the synthesized default model, models fetched by
//! `caracal pull`).

use std::path::PathBuf;

use crate::error::{Error, Result};

/// Caracal's cache folder: `$CARACAL_CACHE`, else `$HOME/.cache/caracal`.
pub fn cache_root() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("CARACAL_CACHE").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(home) => Ok(PathBuf::from(home).join(".cache").join("caracal")),
        None => Err(Error::Config(
            "no cache folder: set CARACAL_CACHE or HOME (or pass the folder explicitly)".into(),
        )),
    }
}
