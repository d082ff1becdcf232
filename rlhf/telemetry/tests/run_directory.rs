//! A run directory written through `MetricsWriter`: fresh, killed, resumed and overwritten, read
//! back from both the JSONL file and the TensorBoard event files.

use std::path::{Path, PathBuf};

use rtrun_rlhf_telemetry::tensorboard::{
    EventPayload, SessionStatus, event_files_in, read_event_file,
};
use rtrun_rlhf_telemetry::{
    MetricsSink as _, MetricsWriter, MetricsWriterOptions, StartMode, StepMetrics, TelemetryError,
    jsonl::read_jsonl,
};

fn fresh_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("rtrun-telemetry-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn step(step: u64, reward: f64) -> StepMetrics {
    let mut metrics = StepMetrics::with_wall_time(step, 1_000.0 + step as f64);
    metrics.set("reward", reward).unwrap().set("time/generate", 0.5).unwrap();
    metrics
}

/// `(step, reward)` of every scalar event across the directory's event files, in file order,
/// and the session-start steps.
fn tensorboard_rewards(dir: &Path) -> (Vec<(i64, f32)>, Vec<i64>) {
    let mut rewards = Vec::new();
    let mut starts = Vec::new();
    for file in event_files_in(dir).unwrap() {
        let events = read_event_file(&file).unwrap();
        assert_eq!(events[0].payload, EventPayload::FileVersion("brain.Event:2".into()));
        for event in events {
            match event.payload {
                EventPayload::Summary(values) => {
                    let reward = values.iter().find(|value| value.tag == "train/reward").unwrap();
                    rewards.push((event.step, reward.simple_value.unwrap()));
                }
                EventPayload::SessionLog(SessionStatus::Start) => starts.push(event.step),
                _ => {}
            }
        }
    }
    (rewards, starts)
}

#[test]
fn fresh_killed_resumed_and_overwritten_runs() {
    let dir = fresh_dir("lifecycle");
    let mut writer = MetricsWriter::create(&dir, StartMode::New).unwrap();
    for index in 1..=6 {
        writer.record(&step(index, index as f64)).unwrap();
    }
    // Each record is on disk as soon as `record` returns: read while the writer is alive.
    assert_eq!(read_jsonl(&writer.jsonl_path()).unwrap().len(), 6);
    assert_eq!(tensorboard_rewards(&dir).0.len(), 6);
    drop(writer);

    // A second fresh run into the same directory is refused rather than mixed in.
    let error = MetricsWriter::create(&dir, StartMode::New).err().unwrap();
    assert!(matches!(error, TelemetryError::AlreadyExists { .. }), "{error}");

    // A resume or an overwrite that ends before its first record (a bad checkpoint, nothing
    // left to do) changes nothing: no line dropped, no event file added or removed.
    let before = std::fs::read(dir.join("metrics.jsonl")).unwrap();
    for mode in [StartMode::Resume { next_step: 2 }, StartMode::Overwrite] {
        drop(MetricsWriter::create(&dir, mode).unwrap());
        assert_eq!(std::fs::read(dir.join("metrics.jsonl")).unwrap(), before, "{mode:?}");
        assert_eq!(event_files_in(&dir).unwrap().len(), 1, "{mode:?}");
    }

    // Resume from a checkpoint taken before step 4 with different values.
    let mut writer = MetricsWriter::create(&dir, StartMode::Resume { next_step: 4 }).unwrap();
    for index in 4..=8 {
        writer.record(&step(index, 10.0 * index as f64)).unwrap();
    }
    let records = read_jsonl(&writer.jsonl_path()).unwrap();
    let jsonl: Vec<(u64, f64)> =
        records.iter().map(|r| (r.step(), r.get("reward").unwrap())).collect();
    assert_eq!(
        jsonl,
        [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0), (7, 70.0), (8, 80.0)]
    );
    // TensorBoard keeps both files; the session start at step 4 tells its reader to drop the
    // first run's steps 4..=6.
    assert_eq!(event_files_in(&dir).unwrap().len(), 2);
    let (rewards, starts) = tensorboard_rewards(&dir);
    assert_eq!(starts, [4]);
    assert_eq!(rewards.len(), 6 + 5);
    assert_eq!(rewards[6..], [(4, 40.0), (5, 50.0), (6, 60.0), (7, 70.0), (8, 80.0)]);
    drop(writer);

    // Overwrite starts over: old event files go, the JSONL file is truncated.
    let mut writer = MetricsWriter::create(&dir, StartMode::Overwrite).unwrap();
    writer.record(&step(1, 0.25)).unwrap();
    assert_eq!(event_files_in(&dir).unwrap().len(), 1);
    assert_eq!(tensorboard_rewards(&dir), (vec![(1, 0.25)], vec![]));
    assert_eq!(read_jsonl(&writer.jsonl_path()).unwrap(), [step(1, 0.25)]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn jsonl_only_and_custom_file_name() {
    let dir = fresh_dir("options");
    let options =
        MetricsWriterOptions { jsonl_file_name: "train.jsonl".into(), tensorboard: false };
    let mut writer = MetricsWriter::with_options(&dir, StartMode::New, &options).unwrap();
    writer.record(&step(1, 0.5)).unwrap();
    assert_eq!(writer.event_file_path(), None);
    assert_eq!(writer.jsonl_path(), dir.join("train.jsonl"));
    assert!(writer.event_file_path().is_none());
    assert!(event_files_in(&dir).unwrap().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unwritable_directory_is_a_clear_error() {
    let file = fresh_dir("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let error = MetricsWriter::create(&file.join("run"), StartMode::New).err().unwrap();
    let message = error.to_string();
    assert!(message.starts_with("cannot create directory"), "{message}");
    std::fs::remove_file(&file).unwrap();
}
