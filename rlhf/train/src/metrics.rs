//! Where the trainer's numbers go: a [`MetricsSink`] receives one record per step (and per
//! evaluation). The JSONL sink is always on; the telemetry crate's TensorBoard / plot / progress
//! sinks plug in through the same trait.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// One record: a step number, a kind (`train`, `eval`) and named values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsRecord {
    /// The training step the record belongs to (0: before training).
    pub step: u64,
    /// `train` or `eval`.
    pub kind: String,
    /// Named values.
    pub values: BTreeMap<String, f64>,
}

/// Receives the trainer's records.
pub trait MetricsSink: Send {
    /// Records one step's values.
    fn record(&mut self, record: &MetricsRecord) -> Result<()>;
    /// Called once at the end of the run.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Appends records as JSON lines to a file.
#[derive(Debug)]
pub struct JsonlSink {
    path: PathBuf,
    file: std::fs::File,
}

impl JsonlSink {
    /// Opens (appending) `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| TrainError::io(path, e))?;
        Ok(Self { path: path.to_path_buf(), file })
    }
}

impl MetricsSink for JsonlSink {
    fn record(&mut self, record: &MetricsRecord) -> Result<()> {
        let line = serde_json::to_string(record).map_err(|e| TrainError::Data(e.to_string()))?;
        writeln!(self.file, "{line}").map_err(|e| TrainError::io(&self.path, e))
    }

    fn finish(&mut self) -> Result<()> {
        self.file.flush().map_err(|e| TrainError::io(&self.path, e))
    }
}

/// Reads a JSONL metrics file back (for summaries and the resume test).
pub fn read_jsonl(path: &Path) -> Result<Vec<MetricsRecord>> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| {
                TrainError::Data(format!("{}:{}: expected a metrics record, found {e}", path.display(), i + 1))
            })
        })
        .collect()
}

/// Keeps every record in memory (tests, summaries).
#[derive(Debug, Default)]
pub struct MemorySink {
    /// The records so far.
    pub records: Vec<MetricsRecord>,
}

impl MetricsSink for MemorySink {
    fn record(&mut self, record: &MetricsRecord) -> Result<()> {
        self.records.push(record.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_sink_round_trips() {
        let dir = std::env::temp_dir().join(format!("rtrun-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.jsonl");
        let record = MetricsRecord {
            step: 3,
            kind: "train".into(),
            values: BTreeMap::from([("reward".to_owned(), 0.5)]),
        };
        let mut sink = JsonlSink::open(&path).unwrap();
        sink.record(&record).unwrap();
        sink.finish().unwrap();
        assert_eq!(read_jsonl(&path).unwrap(), vec![record]);
        std::fs::write(&path, "oops\n").unwrap();
        assert!(read_jsonl(&path).unwrap_err().to_string().contains(":1:"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
