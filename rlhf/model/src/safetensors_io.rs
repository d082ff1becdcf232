//! Reading and writing named tensors in the safetensors format, single-file or sharded with a
//! Hugging Face `model.safetensors.index.json`.
//!
//! Files are untrusted input: the safetensors crate validates headers and bounds, and every
//! dtype or shape we cannot use becomes a [`ModelError`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use tch::{Device, Kind, Tensor};

use crate::config::write_json;
use crate::error::{ModelError, Result};

/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Tensors with their names, in name order.
pub type NamedTensors = Vec<(String, Tensor)>;

/// How checkpoints are written.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// Largest shard in bytes; a checkpoint larger than this is split into
    /// `model-0000i-of-0000n.safetensors` files plus an index. Default 5 GB, as transformers.
    pub max_shard_bytes: u64,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self { max_shard_bytes: 5_000_000_000 }
    }
}

/// Maps a safetensors dtype to a libtorch kind.
fn kind_of(dtype: Dtype, path: &Path) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        other => {
            return Err(ModelError::Safetensors {
                path: path.to_path_buf(),
                message: format!("dtype should be a float or integer type, found {other:?}"),
            });
        }
    })
}

/// Maps a libtorch kind to a safetensors dtype.
fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        other => return Err(ModelError::Input(format!("cannot save tensors of kind {other:?}"))),
    })
}

/// The safetensors files of a checkpoint directory: the shards named by the index when there is
/// one, else `model.safetensors`.
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::json(&index, e))?;
        let map =
            value.get("weight_map").and_then(serde_json::Value::as_object).ok_or_else(|| {
                ModelError::Safetensors {
                    path: index.clone(),
                    message: "index should have a `weight_map` object, found none".into(),
                }
            })?;
        let mut files: Vec<String> =
            map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
        files.sort();
        files.dedup();
        files
            .into_iter()
            .map(|f| {
                // Shard names come from a file: refuse anything that leaves the directory.
                if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                    Err(ModelError::Safetensors {
                        path: index.clone(),
                        message: format!("shard names should be plain file names, found `{f}`"),
                    })
                } else {
                    Ok(dir.join(f))
                }
            })
            .collect()
    } else {
        Ok(vec![dir.join(SINGLE_FILE)])
    }
}

/// Reads every tensor of one safetensors file to CPU tensors, with the file's metadata map.
pub fn read_file(path: &Path) -> Result<(NamedTensors, HashMap<String, String>)> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
    let bad = |e: safetensors::SafeTensorError| ModelError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let (_, metadata) = SafeTensors::read_metadata(&bytes).map_err(bad)?;
    let header = metadata.metadata().clone().unwrap_or_default();
    let file = SafeTensors::deserialize(&bytes).map_err(bad)?;
    let mut tensors = Vec::new();
    for (name, view) in file.iter() {
        let kind = kind_of(view.dtype(), path)?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let tensor = Tensor::f_from_data_size(view.data(), &shape, kind)?;
        tensors.push((name.to_string(), tensor));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((tensors, header))
}

/// Reads all tensors of a checkpoint directory (sharded or not) to CPU tensors.
pub fn read_checkpoint(dir: &Path) -> Result<Vec<(String, Tensor)>> {
    let mut all = Vec::new();
    for file in checkpoint_files(dir)? {
        all.extend(read_file(&file)?.0);
    }
    Ok(all)
}

/// Host bytes of a tensor, contiguous, in its own dtype.
fn host_bytes(tensor: &Tensor) -> Result<(Dtype, Vec<usize>, Vec<u8>)> {
    let t = tensor.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?;
    let kind = t.f_kind()?;
    let numel = t.numel();
    let mut bytes = vec![0u8; numel * kind.elt_size_in_bytes()];
    t.f_copy_data_u8(&mut bytes, numel)?;
    let shape = t.size().iter().map(|&d| d as usize).collect();
    Ok((dtype_of(kind)?, shape, bytes))
}

/// Writes named tensors to one safetensors file with a metadata map (`format: pt` is added).
pub fn write_file<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    metadata: HashMap<String, String>,
) -> Result<()> {
    let mut owned = Vec::new();
    for (name, tensor) in tensors {
        owned.push((name.to_string(), host_bytes(tensor)?));
    }
    let bad = |e: safetensors::SafeTensorError| ModelError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let mut views = Vec::with_capacity(owned.len());
    for (name, (dtype, shape, bytes)) in &owned {
        views.push((name.as_str(), TensorView::new(*dtype, shape.clone(), bytes).map_err(bad)?));
    }
    let mut metadata = metadata;
    metadata.insert("format".into(), "pt".into());
    safetensors::tensor::serialize_to_file(views, Some(metadata), path).map_err(bad)
}

/// Writes named tensors as a Hugging Face checkpoint in `dir`: one `model.safetensors` when it
/// fits in `options.max_shard_bytes`, else numbered shards and `model.safetensors.index.json`.
pub fn write_checkpoint<'a>(
    dir: &Path,
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    options: &SaveOptions,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let tensors: Vec<(&str, &Tensor)> = tensors.into_iter().collect();
    // Greedy sharding in parameter order, like transformers.
    let mut shards: Vec<Vec<(&str, &Tensor)>> = vec![Vec::new()];
    let mut current = 0u64;
    let mut total = 0u64;
    for (name, tensor) in &tensors {
        let bytes = (tensor.numel() * tensor.f_kind()?.elt_size_in_bytes()) as u64;
        total += bytes;
        let shard_is_empty = shards.last().is_none_or(Vec::is_empty);
        if !shard_is_empty && current + bytes > options.max_shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        current += bytes;
        if let Some(shard) = shards.last_mut() {
            shard.push((name, tensor));
        }
    }
    // Remove files of an earlier save with a different layout, so loaders see one checkpoint.
    remove_stale_checkpoint_files(dir)?;
    if shards.len() == 1 {
        return write_file(&dir.join(SINGLE_FILE), tensors, HashMap::new());
    }
    let count = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.into_iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, count);
        for (name, _) in &shard {
            weight_map.insert(name.to_string(), serde_json::Value::String(file.clone()));
        }
        write_file(&dir.join(&file), shard, HashMap::new())?;
    }
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    write_json(&dir.join(INDEX_FILE), &index)
}

fn remove_stale_checkpoint_files(dir: &Path) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| ModelError::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        let is_shard = name.starts_with("model-") && name.ends_with(".safetensors");
        if is_shard || name == SINGLE_FILE || name == INDEX_FILE {
            std::fs::remove_file(entry.path()).map_err(|e| ModelError::io(entry.path(), e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rtrun-model-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn sharded_checkpoints_round_trip() {
        let dir = temp_dir("shards");
        let a = Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4]);
        let b = Tensor::arange(5, (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let c = Tensor::ones([7], (Kind::Float, Device::Cpu));
        let options = SaveOptions { max_shard_bytes: 50 };
        write_checkpoint(&dir, [("a", &a), ("b", &b), ("c", &c)], &options).unwrap();
        assert!(dir.join(INDEX_FILE).exists());
        assert_eq!(checkpoint_files(&dir).unwrap().len(), 2);
        let back = read_checkpoint(&dir).unwrap();
        let names: Vec<&str> = back.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(back[0].1.equal(&a));
        assert_eq!(back[1].1.kind(), Kind::BFloat16);
        assert!(back[1].1.equal(&b));
        // Saving again unsharded removes the shards and the index.
        write_checkpoint(&dir, [("a", &a)], &SaveOptions::default()).unwrap();
        assert!(!dir.join(INDEX_FILE).exists());
        assert_eq!(read_checkpoint(&dir).unwrap().len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn garbage_files_are_errors() {
        let dir = temp_dir("garbage");
        std::fs::write(dir.join(SINGLE_FILE), b"\xff\xff\xff\xff\xff\xff\xff\x7fnot json").unwrap();
        assert!(matches!(read_checkpoint(&dir), Err(ModelError::Safetensors { .. })));
        std::fs::write(dir.join(INDEX_FILE), br#"{"weight_map": {"a": "../../etc/passwd"}}"#)
            .unwrap();
        assert!(read_checkpoint(&dir).unwrap_err().to_string().contains("plain file names"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
