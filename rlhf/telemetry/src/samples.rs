//! A few of each step's samples — prompt, response, reward — as JSON Lines in the run
//! directory (`samples.jsonl`), the table a reader looks at to see what the policy writes.
//!
//! The writer changes nothing until its first rows: then it drops the rows an earlier,
//! interrupted run wrote for this step or later (a resumed run writes them again) and
//! appends from there.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TelemetryError};

/// The file name in a run directory.
pub const SAMPLES_FILE: &str = "samples.jsonl";

/// One logged sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleRow {
    /// The step that generated it.
    pub step: u64,
    /// The prompt text.
    pub prompt: String,
    /// The response text.
    pub response: String,
    /// Its reward (the task's, before any shaping).
    pub reward: f64,
    /// The label the reward compared with (empty when none).
    pub label: String,
}

/// Appends [`SampleRow`]s to `samples.jsonl`.
#[derive(Debug)]
pub struct SamplesWriter {
    path: PathBuf,
    started: bool,
}

impl SamplesWriter {
    /// A writer for `run_dir/samples.jsonl`; nothing is touched before [`Self::write`].
    pub fn new(run_dir: &Path) -> Self {
        Self { path: run_dir.join(SAMPLES_FILE), started: false }
    }

    /// Appends `rows` (all of one step).
    pub fn write(&mut self, rows: &[SampleRow]) -> Result<()> {
        let Some(step) = rows.first().map(|r| r.step) else { return Ok(()) };
        let io = |action, e| TelemetryError::Io { action, path: self.path.clone(), source: e };
        if !self.started {
            // Keep what earlier steps wrote; drop this step's and later rows of a killed run.
            let kept: Vec<String> = match std::fs::read_to_string(&self.path) {
                Ok(text) => text
                    .lines()
                    .filter(|line| {
                        serde_json::from_str::<SampleRow>(line).is_ok_and(|r| r.step < step)
                    })
                    .map(|line| format!("{line}\n"))
                    .collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(io("read", e)),
            };
            std::fs::write(&self.path, kept.concat()).map_err(|e| io("write", e))?;
            self.started = true;
        }
        let mut file =
            std::fs::OpenOptions::new().append(true).open(&self.path).map_err(|e| io("open", e))?;
        let mut text = String::new();
        for row in rows {
            let line = serde_json::to_string(row).map_err(|e| TelemetryError::Jsonl {
                path: self.path.clone(),
                line: 0,
                message: e.to_string(),
            })?;
            text += &line;
            text.push('\n');
        }
        file.write_all(text.as_bytes()).map_err(|e| io("write", e))
    }
}

/// Reads `samples.jsonl`.
pub fn read_samples(run_dir: &Path) -> Result<Vec<SampleRow>> {
    let path = run_dir.join(SAMPLES_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| TelemetryError::Io {
        action: "read",
        path: path.clone(),
        source: e,
    })?;
    text.lines()
        .enumerate()
        .map(|(i, line)| {
            serde_json::from_str(line).map_err(|e| TelemetryError::Jsonl {
                path: path.clone(),
                line: i + 1,
                message: e.to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(step: u64, prompt: &str) -> SampleRow {
        SampleRow {
            step,
            prompt: prompt.into(),
            response: "r".into(),
            reward: 0.5,
            label: String::new(),
        }
    }

    #[test]
    fn a_resumed_run_replaces_the_rows_of_the_steps_it_redoes() {
        let dir = std::env::temp_dir().join(format!("rtrun-samples-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut first = SamplesWriter::new(&dir);
        first.write(&[row(1, "a"), row(1, "b")]).unwrap();
        first.write(&[row(2, "c")]).unwrap();
        first.write(&[row(3, "d")]).unwrap();
        // Killed after step 3's rows, resumed from step 1's checkpoint: steps 2 and 3 again.
        let mut resumed = SamplesWriter::new(&dir);
        resumed.write(&[]).unwrap();
        assert_eq!(read_samples(&dir).unwrap().len(), 4, "nothing changes before a row");
        resumed.write(&[row(2, "e")]).unwrap();
        let prompts: Vec<String> =
            read_samples(&dir).unwrap().into_iter().map(|r| r.prompt).collect();
        assert_eq!(prompts, ["a", "b", "e"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
