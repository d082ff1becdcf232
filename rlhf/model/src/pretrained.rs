//! Loading Hugging Face weights into a [`Parameters`] registry and saving them back, shared by
//! the causal LM and the scalar-head models.

use std::collections::HashSet;
use std::path::Path;

use crate::error::{ModelError, Result};
use crate::params::Parameters;
use crate::safetensors_io::{SaveOptions, read_checkpoint, write_checkpoint};

/// Copies the tensors of the checkpoint in `dir` into `params` (converting dtype and device).
///
/// Every parameter must be present except those named in `may_be_missing`; the names of those
/// that were absent are returned (the caller keeps their fresh initialisation). Tensors the
/// model has no use for (an LM head when loading a critic, rotary buffers of old checkpoints)
/// are skipped.
pub(crate) fn load_into(
    params: &Parameters,
    dir: &Path,
    may_be_missing: &[&str],
) -> Result<Vec<String>> {
    let tensors = read_checkpoint(dir)?;
    let mut loaded = HashSet::new();
    for (name, tensor) in &tensors {
        if params.get(name).is_some() {
            params.copy_into(name, tensor)?;
            loaded.insert(name.as_str());
        } else {
            tracing::debug!(tensor = %name, dir = %dir.display(), "skipping unused checkpoint tensor");
        }
    }
    let mut absent = Vec::new();
    for (name, _) in params.named() {
        if loaded.contains(name) {
            continue;
        }
        if may_be_missing.contains(&name) {
            absent.push(name.to_string());
        } else {
            return Err(ModelError::MissingTensor {
                dir: dir.to_path_buf(),
                name: name.to_string(),
            });
        }
    }
    Ok(absent)
}

/// Writes every parameter of `params` under its name.
pub(crate) fn save_params(params: &Parameters, dir: &Path, options: &SaveOptions) -> Result<()> {
    write_checkpoint(dir, params.named(), options)
}
