//! Checkpoints: `checkpoints/step_NNNNNN/` holds the policy (weights + AdamW state), the critic
//! (when there is one), `checksums.json` (each file's size and XXH3-64) and `trainer_state.json`
//! (step, dataloader position, KL controller, baseline evaluation). The state file is written
//! last, so a directory without it is an interrupted save and is ignored on resume.
//!
//! A resume checks every file against `checksums.json` before anything is loaded
//! ([`resume_point`]): a checkpoint with a changed or missing file is skipped, naming the file,
//! for the previous one; when no complete checkpoint checks out the run refuses to start. XXH3
//! rather than a cryptographic hash: it guards against corruption (bit rot, a torn copy, a full
//! disk), not an attacker who can write the run directory, and it hashes at memory speed, so
//! checking a checkpoint costs about one read of it. The files are hashed by the trainer after
//! every rank saved: the run directory must be one the trainer's host sees (one node, or a
//! shared file system, which a multi-node resume needs anyway).
//!
//! Every RNG of a run is derived from the config's seed and the step number (sampling seeds,
//! shuffles), so the state above is the whole RNG state: a resumed run draws what the
//! uninterrupted one would have.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Result, TrainError};
use crate::trainer::calls;
use crate::trainer::{Trainer, TrainerState};

/// Name of the state file (the completion marker of a checkpoint).
pub const STATE_FILE: &str = "trainer_state.json";

/// Name of a checkpoint's checksum manifest.
pub const CHECKSUM_FILE: &str = "checksums.json";

/// A checkpoint's checksum manifest: every file under the checkpoint directory (by its path
/// relative to it, `/`-separated) but the state file and the manifest itself.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Checksums {
    /// Always `xxh3-64`.
    algorithm: String,
    files: BTreeMap<String, FileSum>,
}

/// One file's size and checksum.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct FileSum {
    bytes: u64,
    /// XXH3-64 of the content, 16 hex digits.
    xxh3: String,
}

const ALGORITHM: &str = "xxh3-64";

/// The size and XXH3-64 of the file at `path`, read in 8 MiB pieces.
fn checksum_file(path: &Path) -> Result<FileSum> {
    let mut file = std::fs::File::open(path).map_err(|e| TrainError::io(path, e))?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buffer = vec![0u8; 8 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buffer).map_err(|e| TrainError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        bytes += n as u64;
    }
    Ok(FileSum { bytes, xxh3: format!("{:016x}", hasher.digest()) })
}

/// Every file under `dir` (recursively) as `(relative path, path)`, sorted.
fn files_under(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(current) = pending.pop() {
        for entry in std::fs::read_dir(&current).map_err(|e| TrainError::io(&current, e))? {
            let entry = entry.map_err(|e| TrainError::io(&current, e))?;
            let path = entry.path();
            let kind = entry.file_type().map_err(|e| TrainError::io(&path, e))?;
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() {
                let relative = path.strip_prefix(dir).unwrap_or(&path);
                let name = relative
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/");
                files.push((name, path));
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Writes the checksum manifest of the checkpoint `dir` (every file its ranks wrote; beside it,
/// then renamed). Called after every rank saved and before the state file.
pub fn write_checksums(dir: &Path) -> Result<()> {
    let mut files = BTreeMap::new();
    for (name, path) in files_under(dir)? {
        if name == STATE_FILE || name == CHECKSUM_FILE || name.ends_with(".tmp") {
            continue;
        }
        files.insert(name, checksum_file(&path)?);
    }
    let manifest = Checksums { algorithm: ALGORITHM.into(), files };
    let bytes =
        serde_json::to_vec_pretty(&manifest).map_err(|e| TrainError::Data(e.to_string()))?;
    let tmp = dir.join(format!("{CHECKSUM_FILE}.tmp"));
    std::fs::write(&tmp, bytes).map_err(|e| TrainError::io(&tmp, e))?;
    std::fs::rename(&tmp, dir.join(CHECKSUM_FILE)).map_err(|e| TrainError::io(dir, e))
}

/// What [`verify`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verified {
    /// Every file of the manifest is there with its size and checksum (this many files).
    Files(usize),
    /// The checkpoint has no manifest (saved before checksums were written): not checked.
    Unchecked,
}

/// Checks every file of the checkpoint `dir` against its manifest; the error names the first
/// file that is missing or changed.
pub fn verify(dir: &Path) -> Result<Verified> {
    let manifest_path = dir.join(CHECKSUM_FILE);
    let text = match std::fs::read(&manifest_path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Verified::Unchecked),
        Err(e) => return Err(TrainError::io(&manifest_path, e)),
    };
    let manifest: Checksums = serde_json::from_slice(&text).map_err(|e| {
        TrainError::Checkpoint(format!(
            "{}: expected a checksum manifest, found {e}",
            manifest_path.display()
        ))
    })?;
    if manifest.algorithm != ALGORITHM {
        return Err(TrainError::Checkpoint(format!(
            "{}: expected checksums of algorithm `{ALGORITHM}`, found `{}`",
            manifest_path.display(),
            manifest.algorithm
        )));
    }
    for (name, expected) in &manifest.files {
        let path = dir.join(name);
        if !path.is_file() {
            return Err(TrainError::Checkpoint(format!(
                "{} is missing (the checkpoint's {CHECKSUM_FILE} lists it)",
                path.display()
            )));
        }
        let found = checksum_file(&path)?;
        if found != *expected {
            return Err(TrainError::Checkpoint(format!(
                "{} changed since the checkpoint was saved: expected {} bytes with xxh3 {}, \
                 found {} bytes with xxh3 {}",
                path.display(),
                expected.bytes,
                expected.xxh3,
                found.bytes,
                found.xxh3
            )));
        }
    }
    Ok(Verified::Files(manifest.files.len()))
}

/// The checkpoint a run resumes from (see [`resume_point`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ResumePoint {
    /// Its directory.
    pub dir: PathBuf,
    /// The step it was taken after.
    pub step: u64,
    /// Newer complete checkpoints that failed their check, each with the reason.
    pub skipped: Vec<String>,
    /// Whether its files were checked (false: a checkpoint without checksums).
    pub checked: bool,
}

/// The newest complete checkpoint under `checkpoints` whose files match their checksums and
/// whose state file reads; newer ones that do not are skipped, each with its reason (logged
/// and returned). `None` when there is no complete checkpoint; an error, with every reason,
/// when there are some and none checks out: the run refuses rather than start over.
pub fn resume_point(checkpoints: &Path) -> Result<Option<ResumePoint>> {
    let complete = complete_checkpoints(checkpoints)?;
    if complete.is_empty() {
        return Ok(None);
    }
    let mut skipped = Vec::new();
    for (step, dir) in complete {
        let checked = verify(&dir).and_then(|verified| {
            #[derive(serde::Deserialize)]
            struct Step {
                step: u64,
            }
            let state: Step = read_state(&dir)?;
            if state.step != step {
                return Err(TrainError::Checkpoint(format!(
                    "{}: the state is of step {}, the directory's name says {step}",
                    dir.join(STATE_FILE).display(),
                    state.step
                )));
            }
            Ok(verified)
        });
        match checked {
            Ok(verified) => {
                let checked = verified != Verified::Unchecked;
                if !checked {
                    tracing::warn!(dir = %dir.display(), "the checkpoint has no {CHECKSUM_FILE}: resumed unchecked");
                }
                return Ok(Some(ResumePoint { dir, step, skipped, checked }));
            }
            Err(error) => {
                tracing::warn!(dir = %dir.display(), %error, "skipping a checkpoint that fails its check");
                skipped.push(match error {
                    TrainError::Checkpoint(reason) => reason,
                    other => other.to_string(),
                });
            }
        }
    }
    Err(TrainError::Checkpoint(format!(
        "no checkpoint under {} can be resumed: {}. Restore the files, remove the bad \
         checkpoints, or start over with checkpoint.resume: false and overwrite: true",
        checkpoints.display(),
        skipped.join("; ")
    )))
}

/// [`resume_point`] when `resume` (the config's `checkpoint.resume`), else `None`.
pub fn resume_from(resume: bool, checkpoints: &Path) -> Result<Option<ResumePoint>> {
    if resume { resume_point(checkpoints) } else { Ok(None) }
}

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

/// The newest complete checkpoint directory under `dir`, if any (unchecked: see
/// [`resume_point`]).
pub fn newest(dir: &Path) -> Result<Option<PathBuf>> {
    Ok(complete_checkpoints(dir)?.into_iter().next().map(|(_, path)| path))
}

/// The complete checkpoints under `dir` (those with a state file), newest first.
fn complete_checkpoints(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(TrainError::io(dir, e)),
    };
    let mut complete = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| TrainError::io(dir, e))?;
        let name = entry.file_name();
        let Some(step) =
            name.to_str().and_then(|n| n.strip_prefix("step_")).and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(STATE_FILE).is_file() {
            complete.push((step, entry.path()));
        }
    }
    complete.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    Ok(complete)
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
        write_checksums(&dir)?;
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

    /// A checkpoint as a save writes it: a nested file per "rank", checksums, then the state.
    fn save(root: &Path, step: u64) -> PathBuf {
        let dir = step_dir(root, step).unwrap();
        std::fs::create_dir_all(dir.join("actor")).unwrap();
        let weights: Vec<u8> =
            (0..100_000u32).flat_map(|i| (i * step as u32).to_le_bytes()).collect();
        std::fs::write(dir.join("actor/model.safetensors"), weights).unwrap();
        std::fs::write(dir.join("actor/config.json"), "{}").unwrap();
        write_checksums(&dir).unwrap();
        write_state(&dir, &serde_json::json!({"step": step})).unwrap();
        dir
    }

    #[test]
    fn a_changed_or_missing_file_names_itself_and_the_resume_falls_back_or_refuses() {
        let root = std::env::temp_dir().join(format!("rtrun-ckpt-sums-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(resume_point(&root).unwrap(), None);
        assert_eq!(resume_from(false, &root).unwrap(), None);
        let (two, five) = (save(&root, 2), save(&root, 5));
        assert_eq!(verify(&five).unwrap(), Verified::Files(2));
        let manifest = std::fs::read_to_string(five.join(CHECKSUM_FILE)).unwrap();
        assert!(manifest.contains("actor/model.safetensors") && !manifest.contains(STATE_FILE));
        let point = resume_point(&root).unwrap().unwrap();
        assert_eq!((point.dir.clone(), point.step, point.checked), (five.clone(), 5, true));
        assert!(point.skipped.is_empty());

        // Low mantissa bits flipped in place (same size): the newest is skipped, naming the
        // file and both checksums; the resume falls back to step 2.
        let weights = five.join("actor/model.safetensors");
        let mut bytes = std::fs::read(&weights).unwrap();
        for byte in bytes.iter_mut().step_by(4) {
            *byte ^= 1;
        }
        std::fs::write(&weights, &bytes).unwrap();
        let point = resume_point(&root).unwrap().unwrap();
        assert_eq!((point.dir.clone(), point.step), (two.clone(), 2));
        assert_eq!(point.skipped.len(), 1);
        let reason = &point.skipped[0];
        assert!(
            reason.contains(&weights.display().to_string())
                && reason.contains("changed since the checkpoint was saved")
                && reason.contains("400000 bytes"),
            "{reason}"
        );

        // A missing file is named too; with no good checkpoint left the resume refuses, with
        // every reason, rather than start over.
        std::fs::remove_file(two.join("actor/config.json")).unwrap();
        let err = resume_point(&root).unwrap_err().to_string();
        assert!(err.contains("no checkpoint under") && err.contains("can be resumed"), "{err}");
        assert!(err.contains(&weights.display().to_string()), "{err}");
        assert!(err.contains("actor/config.json is missing"), "{err}");

        // A save from before checksums (no manifest) resumes, marked unchecked; a torn state
        // file is a reason to skip too.
        let old = save(&root, 7);
        std::fs::remove_file(old.join(CHECKSUM_FILE)).unwrap();
        let point = resume_point(&root).unwrap().unwrap();
        assert_eq!((point.step, point.checked), (7, false));
        std::fs::write(old.join(STATE_FILE), "{\"ste").unwrap();
        let err = resume_point(&root).unwrap_err().to_string();
        assert!(err.contains("expected a trainer state"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
