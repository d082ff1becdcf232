//! Checkpoints: `checkpoints/step_NNNNNN/` holds the policy (weights + AdamW state), the critic
//! (when there is one) and `trainer_state.json` (step, dataloader position, KL controller,
//! baseline evaluation). The state file is written last, so a directory without it is an
//! interrupted save and is ignored on resume.
//!
//! Every RNG of a run is derived from the config's seed and the step number (sampling seeds,
//! shuffles), so the state above is the whole RNG state: a resumed run draws what the
//! uninterrupted one would have.

use std::path::{Path, PathBuf};

use crate::error::{Result, TrainError};
use crate::trainer::calls;
use crate::trainer::{Trainer, TrainerState};

/// Name of the state file (the completion marker of a checkpoint).
pub const STATE_FILE: &str = "trainer_state.json";

/// Writes `state` as the state file of the checkpoint `dir` (beside it, then renamed: the file's
/// presence marks the checkpoint complete).
pub fn write_state(dir: &Path, state: &impl serde::Serialize) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(state).map_err(|e| TrainError::Data(e.to_string()))?;
    let tmp = dir.join(format!("{STATE_FILE}.tmp"));
    std::fs::write(&tmp, bytes).map_err(|e| TrainError::io(&tmp, e))?;
    std::fs::rename(&tmp, dir.join(STATE_FILE)).map_err(|e| TrainError::io(dir, e))
}

/// Reads the state file of the checkpoint `dir`.
pub fn read_state<T: serde::de::DeserializeOwned>(dir: &Path) -> Result<T> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read(&path).map_err(|e| TrainError::io(&path, e))?;
    serde_json::from_slice(&text).map_err(|e| {
        TrainError::Data(format!("{}: expected a trainer state, found {e}", path.display()))
    })
}

/// A fresh directory for the checkpoint of `step` under `checkpoints` (an earlier one of the
/// same step is removed).
pub fn step_dir(checkpoints: &Path, step: u64) -> Result<PathBuf> {
    let dir = checkpoints.join(format!("step_{step:06}"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| TrainError::io(&dir, e))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| TrainError::io(&dir, e))?;
    Ok(dir)
}

/// Writes a model to `dir` through `save` (given a sibling temporary directory, then renamed),
/// so a directory at `dir` is always complete.
pub fn export_atomically(dir: &Path, save: impl FnOnce(PathBuf) -> Result<()>) -> Result<PathBuf> {
    let tmp = dir.with_extension("tmp");
    for d in [&tmp, &dir.to_path_buf()] {
        if d.exists() {
            std::fs::remove_dir_all(d).map_err(|e| TrainError::io(d, e))?;
        }
    }
    save(tmp.clone())?;
    std::fs::rename(&tmp, dir).map_err(|e| TrainError::io(dir, e))?;
    Ok(dir.to_path_buf())
}

/// The newest complete checkpoint directory under `dir`, if any.
pub fn newest(dir: &Path) -> Result<Option<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TrainError::io(dir, e)),
    };
    let mut best: Option<(u64, PathBuf)> = None;
    for entry in entries {
        let entry = entry.map_err(|e| TrainError::io(dir, e))?;
        let name = entry.file_name();
        let Some(step) =
            name.to_str().and_then(|n| n.strip_prefix("step_")).and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(STATE_FILE).is_file() && best.as_ref().is_none_or(|(s, _)| step > *s) {
            best = Some((step, entry.path()));
        }
    }
    Ok(best.map(|(_, p)| p))
}

/// Removes all but the `keep` newest complete checkpoints (and any incomplete one older than
/// the oldest kept).
pub fn prune(dir: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    let mut steps: Vec<(u64, PathBuf, bool)> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| TrainError::io(dir, e))? {
        let entry = entry.map_err(|e| TrainError::io(dir, e))?;
        let name = entry.file_name();
        if let Some(step) =
            name.to_str().and_then(|n| n.strip_prefix("step_")).and_then(|n| n.parse::<u64>().ok())
        {
            let complete = entry.path().join(STATE_FILE).is_file();
            steps.push((step, entry.path(), complete));
        }
    }
    steps.sort_by_key(|(step, _, _)| std::cmp::Reverse(*step));
    let mut kept = 0;
    let mut removed = Vec::new();
    for (_, path, complete) in steps {
        if complete && kept < keep {
            kept += 1;
            continue;
        }
        if kept < keep {
            // An incomplete directory newer than the kept ones may be a save in progress.
            continue;
        }
        std::fs::remove_dir_all(&path).map_err(|e| TrainError::io(&path, e))?;
        removed.push(path);
    }
    Ok(removed)
}

impl Trainer {
    /// Saves the run's state after the current step.
    pub fn save_checkpoint(&self) -> Result<PathBuf> {
        let dir = step_dir(&self.paths.checkpoints, self.state.step)?;
        // Every rank is called: at zero_stage 0 rank 0 writes (the replicas are equal) and the
        // others return at once; at stages 1-3 each writes its shards.
        let actor = dir.join("actor");
        let mut saves =
            calls::each("actor", self.roles.actor.members(), |a| a.save_checkpoint(actor.clone()));
        if let Some(critic) = &self.roles.critic {
            let critic_dir = dir.join("critic");
            saves.extend(calls::each("critic", critic.members(), |c| {
                c.save_checkpoint(critic_dir.clone())
            }));
        }
        self.watch.wait("save_checkpoint", saves)?;
        write_state(&dir, &self.state)?;
        if let Some(keep) = self.config.checkpoint.keep_last {
            prune(&self.paths.checkpoints, keep)?;
        }
        Ok(dir)
    }

    /// Restores the state saved in `dir`: every DP rank loads the policy (and critic), the
    /// engines get the restored weights.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let path = dir.join(STATE_FILE);
        let state: TrainerState = read_state(dir)?;
        if state.loader.len != self.state.loader.len {
            return Err(TrainError::Data(format!(
                "{}: the checkpoint was taken over {} training prompts, this run has {}",
                path.display(),
                state.loader.len,
                self.state.loader.len
            )));
        }
        let actor = dir.join("actor");
        let loads =
            calls::each("actor", self.roles.actor.members(), |a| a.load_checkpoint(actor.clone()));
        self.watch.wait("load_checkpoint", loads)?;
        if let Some(critic) = &self.roles.critic {
            let critic_dir = dir.join("critic");
            let loads =
                calls::each("critic", critic.members(), |c| c.load_checkpoint(critic_dir.clone()));
            self.watch.wait("load_checkpoint", loads)?;
        }
        self.state = state;
        self.sync_weights()?;
        tracing::info!(dir = %dir.display(), step = self.state.step, "resumed from checkpoint");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_ignores_incomplete_and_foreign_directories() {
        let root = std::env::temp_dir().join(format!("rtrun-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(newest(&root).unwrap(), None);
        for (name, complete) in
            [("step_000002", true), ("step_000010", false), ("step_000005", true), ("other", true)]
        {
            let d = root.join(name);
            std::fs::create_dir_all(&d).unwrap();
            if complete {
                std::fs::write(d.join(STATE_FILE), "{}").unwrap();
            }
        }
        assert_eq!(newest(&root).unwrap(), Some(root.join("step_000005")));
        // keep_last 1: step 5 stays; the newer incomplete step 10 is a save in progress and
        // stays; step 2 goes.
        let removed = prune(&root, 1).unwrap();
        assert_eq!(removed, vec![root.join("step_000002")]);
        assert!(root.join("step_000010").exists() && root.join("step_000005").exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
