//! Sharded checkpoints (stages 1-3): every rank writes its own shard of every unit —
//! parameters and both AdamW moments — to `zero-shard-RRRRR-of-NNNNN.safetensors`; once all
//! have (a barrier), rank 0 writes `zero-manifest.json` with the layout, the step and the file
//! list, so a directory with a manifest is a complete save.
//!
//! Loading works on any number of ranks: each rank rebuilds every unit's flat values from all
//! the saved shards in rank order, drops the old padding, pads for the new world size and
//! keeps its own slice (DeepSpeed's universal checkpoint, done at load time). Whatever does
//! not match — a missing or foreign shard file, a layout other than the model's — is an error
//! that names the file and the unit or parameter.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use rtrun_rlhf_model::safetensors_io::{read_file, write_file};

use crate::error::{Result, ShardError};
use crate::model::ShardedModel;
use crate::plan::UnitPlan;

/// The manifest's file name.
pub const MANIFEST_FILE: &str = "zero-manifest.json";

/// What a sharded save holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version (1).
    pub format: u32,
    /// The ZeRO stage it was saved at.
    pub stage: u8,
    /// Ranks that saved it.
    pub world_size: usize,
    /// Optimizer steps taken.
    pub step: u64,
    /// The flat units as laid out for `world_size` ranks.
    pub units: Vec<UnitPlan>,
    /// One shard file per rank, in rank order (relative to the directory).
    pub shards: Vec<String>,
}

/// Rank `rank` of `world`'s shard file name.
pub fn shard_file(rank: usize, world: usize) -> String {
    format!("zero-shard-{rank:05}-of-{world:05}.safetensors")
}

fn checkpoint_error(path: &Path, message: impl Into<String>) -> ShardError {
    ShardError::Checkpoint { path: path.to_path_buf(), message: message.into() }
}

/// Whether `dir` holds a sharded save: its manifest, or shard files (a save cut short, which
/// [`ShardedModel::load_sharded`] then refuses by name).
pub fn is_sharded_checkpoint(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).is_file()
        || std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|e| e.file_name().to_string_lossy().starts_with("zero-shard-"))
        })
}

/// Reads and checks `dir`'s manifest.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        checkpoint_error(
            &path,
            format!("cannot read the manifest ({e}); an incomplete save has none"),
        )
    })?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|e| checkpoint_error(&path, format!("invalid manifest: {e}")))?;
    if manifest.format != 1 {
        return Err(checkpoint_error(
            &path,
            format!("format should be 1, found {}", manifest.format),
        ));
    }
    if manifest.shards.len() != manifest.world_size || manifest.world_size == 0 {
        return Err(checkpoint_error(
            &path,
            format!(
                "lists {} shard files for a world of {} ranks",
                manifest.shards.len(),
                manifest.world_size
            ),
        ));
    }
    Ok(manifest)
}

impl ShardedModel {
    /// Sharded checkpoints are made of the units' shards, which stage 0 does not keep (its
    /// parameters live in the sharding manager's buffers).
    fn require_units(&self, what: &str) -> Result<()> {
        let stage = self.config().stage;
        if stage == crate::ZeroStage::Zero {
            return Err(ShardError::Config(format!(
                "{what} a sharded checkpoint needs zero_stage 1, 2 or 3, found {stage} (a \
                 zero_stage 0 rank saves the whole model and its optimizer)"
            )));
        }
        Ok(())
    }

    /// Writes this rank's shards into `dir` (every rank calls it; rank 0 writes the manifest
    /// after all have written theirs).
    pub fn save_sharded(&mut self, dir: &Path) -> Result<()> {
        self.require_units("saving")?;
        let step = self.steps_taken();
        let moments: Vec<(Tensor, Tensor)> = match self.sharded_optimizer() {
            Some(o) => {
                o.moments.iter().map(|(m, v)| (m.shallow_clone(), v.shallow_clone())).collect()
            }
            None => Vec::new(),
        };
        let shared = self.shared().clone();
        let state = shared.lock();
        let (rank, world) = (state.comm.rank(), state.comm.world_size());
        std::fs::create_dir_all(dir).map_err(|e| checkpoint_error(dir, e.to_string()))?;
        let mut named: Vec<(String, Tensor)> = Vec::new();
        // Frozen units (LoRA's base) come from the pretrained model again on resume.
        for (index, unit) in state.units.iter().enumerate().filter(|(_, u)| u.plan.trains) {
            named.push((format!("param.{}", unit.plan.name), unit.shard.f_to_device(Device::Cpu)?));
            if let Some((m, v)) = moments.get(index) {
                named.push((format!("exp_avg.{}", unit.plan.name), m.f_to_device(Device::Cpu)?));
                named.push((format!("exp_avg_sq.{}", unit.plan.name), v.f_to_device(Device::Cpu)?));
            }
        }
        let metadata: HashMap<String, String> = [
            ("rank".to_string(), rank.to_string()),
            ("world_size".to_string(), world.to_string()),
            ("step".to_string(), step.to_string()),
        ]
        .into();
        let file = dir.join(shard_file(rank, world));
        let partial = dir.join(format!(".{}.partial", shard_file(rank, world)));
        write_file(&partial, named.iter().map(|(n, t)| (n.as_str(), t)), metadata)?;
        std::fs::rename(&partial, &file).map_err(|e| checkpoint_error(&file, e.to_string()))?;
        if world > 1 {
            state.comm.run(
                || format!("waiting for every rank's shard in {}", dir.display()),
                |c| c.barrier(),
            )?;
        }
        if rank == 0 {
            let manifest = Manifest {
                format: 1,
                stage: state.stage.number(),
                world_size: world,
                step,
                units: state
                    .units
                    .iter()
                    .filter(|u| u.plan.trains)
                    .map(|u| u.plan.clone())
                    .collect(),
                shards: (0..world).map(|r| shard_file(r, world)).collect(),
            };
            let path = dir.join(MANIFEST_FILE);
            let text = serde_json::to_string_pretty(&manifest)
                .map_err(|e| checkpoint_error(&path, e.to_string()))?;
            let partial = dir.join(format!(".{MANIFEST_FILE}.partial"));
            std::fs::write(&partial, text)
                .map_err(|e| checkpoint_error(&partial, e.to_string()))?;
            std::fs::rename(&partial, &path).map_err(|e| checkpoint_error(&path, e.to_string()))?;
        }
        Ok(())
    }

    /// Loads a sharded save from `dir`, made on any number of ranks, into this rank's shards
    /// (and, below stage 3, its whole parameters) and optimizer state.
    pub fn load_sharded(&mut self, dir: &Path) -> Result<()> {
        self.require_units("loading")?;
        let manifest = read_manifest(dir)?;
        let mut files: Vec<(PathBuf, HashMap<String, Tensor>)> = Vec::new();
        for (rank, name) in manifest.shards.iter().enumerate() {
            let path = dir.join(name);
            if !path.is_file() {
                return Err(checkpoint_error(
                    &path,
                    format!("shard of rank {rank} is missing (the manifest lists it)"),
                ));
            }
            let (tensors, metadata) = read_file(&path)?;
            let found = (metadata.get("rank"), metadata.get("world_size"));
            let expected = (rank.to_string(), manifest.world_size.to_string());
            if found != (Some(&expected.0), Some(&expected.1)) {
                return Err(checkpoint_error(
                    &path,
                    format!(
                        "should be rank {rank} of {}, its metadata says rank {:?} of {:?}",
                        manifest.world_size, found.0, found.1
                    ),
                ));
            }
            files.push((path, tensors.into_iter().collect()));
        }
        let trains = self.sharded_optimizer().is_some();
        let shared = self.shared().clone();
        let mut state = shared.lock();
        let trained = state.units.iter().filter(|u| u.plan.trains).count();
        if trained != manifest.units.len() {
            return Err(checkpoint_error(
                &dir.join(MANIFEST_FILE),
                format!(
                    "has {} units, the model {trained} trained ones (another model?)",
                    manifest.units.len(),
                ),
            ));
        }
        let (rank, world) = (state.comm.rank(), state.comm.world_size());
        let mut moments = Vec::new();
        let (kind, device) = (state.kind, state.device);
        let mut saved_units = manifest.units.iter();
        for unit in &state.units {
            if !unit.plan.trains {
                let empty = || Tensor::f_zeros([0], (Kind::Float, device));
                moments.push((empty()?, empty()?));
                continue;
            }
            let Some(saved) = saved_units.next() else { break };
            check_layout(&dir.join(MANIFEST_FILE), &unit.plan, saved)?;
            // The unit's values from every old shard, in rank order, without padding.
            let whole = |prefix: &str| -> Result<Tensor> {
                let key = format!("{prefix}.{}", saved.name);
                let mut parts = Vec::with_capacity(files.len());
                for (path, tensors) in &files {
                    let part = tensors
                        .get(&key)
                        .ok_or_else(|| checkpoint_error(path, format!("has no tensor `{key}`")))?;
                    parts.push(part.shallow_clone());
                }
                let flat = Tensor::f_cat(&parts, 0)?;
                if flat.numel() < saved.numel {
                    return Err(checkpoint_error(
                        dir,
                        format!("`{key}` holds {} values, the unit {}", flat.numel(), saved.numel),
                    ));
                }
                let flat = flat.f_narrow(0, 0, saved.numel as i64)?;
                let padding = (unit.plan.padded - saved.numel) as i64;
                let pad = Tensor::f_zeros([padding], (flat.f_kind()?, Device::Cpu))?;
                Ok(Tensor::f_cat(&[flat, pad], 0)?)
            };
            let own = unit.plan.shard_range(world, rank);
            let params = whole("param")?.f_to_kind(kind)?.f_to_device(device)?;
            tch::no_grad(|| -> Result<()> {
                if state.stage != crate::ZeroStage::Three {
                    // Below stage 3 `full` is always whole (and the shard a view of it).
                    unit.full.shallow_clone().f_copy_(&params)?;
                }
                let slice = params.f_narrow(0, own.start as i64, own.len() as i64)?;
                unit.shard.shallow_clone().f_copy_(&slice)?;
                Ok(())
            })?;
            if trains {
                let take = |prefix: &str| -> Result<Tensor> {
                    let values = whole(prefix)?.f_to_kind(Kind::Float)?;
                    Ok(values
                        .f_narrow(0, own.start as i64, own.len() as i64)?
                        .f_to_device(device)?)
                };
                moments.push((take("exp_avg")?, take("exp_avg_sq")?));
            }
        }
        // Whatever was gathered holds the old values.
        state.release_all_units()?;
        drop(state);
        if let Some(optimizer) = self.sharded_optimizer() {
            optimizer.moments = moments;
            optimizer.step = manifest.step;
        }
        Ok(())
    }
}

/// The saved unit must hold the same parameters, shapes and order as the model's.
fn check_layout(path: &Path, model: &UnitPlan, saved: &UnitPlan) -> Result<()> {
    if model.name != saved.name || model.numel != saved.numel {
        return Err(checkpoint_error(
            path,
            format!(
                "unit `{}` ({} values) does not match the model's `{}` ({} values)",
                saved.name, saved.numel, model.name, model.numel
            ),
        ));
    }
    for (a, b) in model.members.iter().zip(&saved.members) {
        if a.name != b.name || a.shape != b.shape || a.offset != b.offset {
            return Err(checkpoint_error(
                path,
                format!(
                    "parameter `{}` {:?} at {} in `{}` does not match the model's `{}` {:?} at {}",
                    b.name, b.shape, b.offset, saved.name, a.name, a.shape, a.offset
                ),
            ));
        }
    }
    if model.members.len() != saved.members.len() {
        return Err(checkpoint_error(
            path,
            format!(
                "unit `{}` has {} parameters, the model's {}",
                saved.name,
                saved.members.len(),
                model.members.len()
            ),
        ));
    }
    Ok(())
}
