//! TensorBoard event files: `events.out.tfevents.<seconds>.<host>` holding TFRecord-framed
//! `Event` protobufs, written without TensorFlow, `protoc` or generated code.
//!
//! The first record carries `file_version` ([`FILE_VERSION`]); each step's scalars go in one
//! event whose `Summary` holds a `simple_value` per metric. Resuming a run writes a
//! `SessionLog { status: START }` event at the resume step into a new file, which TensorBoard
//! takes as the cue to discard the older events at or after that step.

mod crc32c;
mod event;
mod protobuf;
mod record;

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};

pub use event::{Event, EventPayload, FILE_VERSION, SessionStatus, SummaryValue};

use crate::error::{Result, TelemetryError, io_error};

/// How many numbered names (`….1`, `….2`) to try when a file of the same second and host exists.
const MAX_NAME_ATTEMPTS: u32 = 1000;

/// Writes one TensorBoard event file; every call writes whole records and [`flush`] hands them
/// to the operating system, so a live TensorBoard sees each step as it is written.
///
/// [`flush`]: EventFileWriter::flush
pub struct EventFileWriter {
    path: PathBuf,
    file: BufWriter<File>,
    /// Reused encoding buffer.
    buffer: Vec<u8>,
}

impl EventFileWriter {
    /// Creates a new event file in `dir` (which must exist), named after `wall_time` and the host
    /// name, and writes the file-version record. Never overwrites an existing file.
    pub fn create(dir: &Path, wall_time: f64) -> Result<Self> {
        let base = format!("events.out.tfevents.{}.{}", wall_time.max(0.0) as u64, host_name());
        let mut attempt = 0;
        let (path, file) = loop {
            let name = if attempt == 0 { base.clone() } else { format!("{base}.{attempt}") };
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(error)
                    if error.kind() == std::io::ErrorKind::AlreadyExists
                        && attempt < MAX_NAME_ATTEMPTS =>
                {
                    attempt += 1;
                }
                Err(error) => return Err(io_error("create", path)(error)),
            }
        };
        let mut writer = Self { path, file: BufWriter::new(file), buffer: Vec::new() };
        writer.write_event(&Event {
            wall_time,
            step: 0,
            payload: EventPayload::FileVersion(FILE_VERSION.to_owned()),
        })?;
        writer.flush()?;
        Ok(writer)
    }

    /// The path of the event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event record (buffered until [`EventFileWriter::flush`]).
    pub fn write_event(&mut self, event: &Event) -> Result<()> {
        self.buffer.clear();
        record::encode_record(&event.encode(), &mut self.buffer);
        self.file.write_all(&self.buffer).map_err(io_error("write", &self.path))
    }

    /// Appends one event with a scalar summary value per `(tag, value)`. Values are stored as
    /// `f32`, as TensorBoard's `simple_value` is.
    pub fn write_scalars<'a>(
        &mut self,
        step: u64,
        wall_time: f64,
        scalars: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Result<()> {
        let values = scalars
            .into_iter()
            .map(|(tag, value)| SummaryValue {
                tag: tag.to_owned(),
                simple_value: Some(value as f32),
            })
            .collect();
        self.write_event(&Event {
            wall_time,
            step: step_i64(step)?,
            payload: EventPayload::Summary(values),
        })
    }

    /// Appends a `SessionLog START` event: TensorBoard then drops earlier-written events at or
    /// after `step` (a resumed run overwrites the steps the killed run wrote past its checkpoint).
    pub fn write_session_start(&mut self, step: u64, wall_time: f64) -> Result<()> {
        self.write_event(&Event {
            wall_time,
            step: step_i64(step)?,
            payload: EventPayload::SessionLog(SessionStatus::Start),
        })
    }

    /// Hands buffered records to the operating system.
    pub fn flush(&mut self) -> Result<()> {
        self.file.flush().map_err(io_error("write", &self.path))
    }
}

/// Reads every event of an event file, checking both checksums of every record.
pub fn read_event_file(path: &Path) -> Result<Vec<Event>> {
    let bytes = std::fs::read(path).map_err(io_error("read", path))?;
    decode_events(&bytes)
}

/// Decodes a TFRecord stream of events (the bytes of an event file).
pub fn decode_events(bytes: &[u8]) -> Result<Vec<Event>> {
    record::RecordReader::new(bytes)
        .map(|record| record.and_then(|(offset, data)| Event::decode(data, offset)))
        .collect()
}

/// Lists the event files in `dir`, in the order TensorBoard reads them (by name).
pub fn event_files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error("list", dir))? {
        let entry = entry.map_err(io_error("list", dir))?;
        if entry.file_name().to_string_lossy().starts_with("events.out.tfevents.") {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

fn step_i64(step: u64) -> Result<i64> {
    i64::try_from(step).map_err(|_| TelemetryError::StepOutOfRange { step })
}

/// The host name for the file name, restricted to characters safe in a file name.
fn host_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    let cleaned: String = raw
        .trim()
        .chars()
        .map(
            |c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' },
        )
        .collect();
    if cleaned.is_empty() { "localhost".to_owned() } else { cleaned }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("rtrun-telemetry-tb-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn written_files_read_back_with_checked_crcs() {
        let dir = temp_dir("roundtrip");
        let mut writer = EventFileWriter::create(&dir, 1_700_000_000.25).unwrap();
        writer.write_scalars(1, 1_700_000_001.0, [("reward/mean", 0.5), ("kl", 0.01)]).unwrap();
        writer.write_scalars(2, 1_700_000_002.0, [("reward/mean", 0.75)]).unwrap();
        writer.write_session_start(2, 1_700_000_003.0).unwrap();
        writer.flush().unwrap();
        let name = writer.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents.1700000000."), "{name}");

        let events = read_event_file(writer.path()).unwrap();
        assert_eq!(events.len(), 4);
        assert_eq!(events[0].payload, EventPayload::FileVersion("brain.Event:2".into()));
        assert_eq!(events[0].wall_time, 1_700_000_000.25);
        assert_eq!((events[1].step, events[1].wall_time), (1, 1_700_000_001.0));
        assert_eq!(
            events[1].payload,
            EventPayload::Summary(vec![
                SummaryValue { tag: "reward/mean".into(), simple_value: Some(0.5) },
                SummaryValue { tag: "kl".into(), simple_value: Some(0.01) },
            ])
        );
        assert_eq!(events[3].payload, EventPayload::SessionLog(SessionStatus::Start));

        // A second writer in the same second gets its own file.
        let other = EventFileWriter::create(&dir, 1_700_000_000.9).unwrap();
        assert_ne!(other.path(), writer.path());
        assert_eq!(event_files_in(&dir).unwrap().len(), 2);

        // Damage a byte inside the last record's data: the reader reports it.
        let mut bytes = std::fs::read(writer.path()).unwrap();
        let len = bytes.len();
        bytes[len - 6] ^= 0x40;
        let error = decode_events(&bytes).unwrap_err().to_string();
        assert!(error.contains("data checksum mismatch"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rejects_steps_beyond_i64() {
        let dir = temp_dir("step");
        let mut writer = EventFileWriter::create(&dir, 1.0).unwrap();
        let error = writer.write_scalars(u64::MAX, 1.0, [("x", 1.0)]).unwrap_err();
        assert!(matches!(error, TelemetryError::StepOutOfRange { .. }));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
