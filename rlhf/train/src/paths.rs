//! The layout of a run directory: prepared data, the initial policy, checkpoints, the export.

use std::path::{Path, PathBuf};

/// Files of a run directory.
#[derive(Debug, Clone)]
pub struct RunPaths {
    /// The run directory.
    pub root: PathBuf,
    /// Training prompts (JSONL).
    pub train_data: PathBuf,
    /// Held-out prompts (JSONL).
    pub eval_data: PathBuf,
    /// The initial policy (Hugging Face directory).
    pub initial_policy: PathBuf,
    /// Checkpoints, one directory per step.
    pub checkpoints: PathBuf,
    /// The trained policy as a Hugging Face directory, written at the end of the run.
    pub final_policy: PathBuf,
}

impl RunPaths {
    /// The layout under `root`.
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
            train_data: root.join("data/train.jsonl"),
            eval_data: root.join("data/eval.jsonl"),
            initial_policy: root.join("models/initial"),
            checkpoints: root.join("checkpoints"),
            final_policy: root.join("final_policy"),
        }
    }
}
