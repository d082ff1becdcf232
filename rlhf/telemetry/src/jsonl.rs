//! Metrics as JSON Lines: one object per step, `{"step":3,"wall_time":1.7e9,"reward/mean":0.5,…}`,
//! keys in the order the metrics were set. JSON has no NaN or infinities, so those are written
//! as the strings `"NaN"`, `"Infinity"` and `"-Infinity"` (which Python's `float()`
//! parses) and read back as numbers.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

use crate::error::{Result, TelemetryError, io_error};
use crate::metrics::{MetricsSink, StartMode, StepMetrics};

/// Appends one line per step to a JSONL file, flushed before [`MetricsSink::record`] returns.
pub struct JsonlWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl JsonlWriter {
    /// Opens `path` for a run started as `mode` (see [`StartMode`]).
    pub fn create(path: &Path, mode: StartMode) -> Result<Self> {
        let mut options = OpenOptions::new();
        match mode {
            StartMode::New => options.write(true).create_new(true),
            StartMode::Overwrite => options.write(true).create(true).truncate(true),
            StartMode::Resume { next_step } => {
                keep_records_before(path, next_step)?;
                options.append(true).create(true)
            }
        };
        let file = options.open(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::AlreadyExists {
                TelemetryError::AlreadyExists { path: path.to_owned() }
            } else {
                io_error("open", path)(source)
            }
        })?;
        Ok(Self { path: path.to_owned(), file: BufWriter::new(file) })
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl MetricsSink for JsonlWriter {
    fn record(&mut self, metrics: &StepMetrics) -> Result<()> {
        let mut line = encode_line(metrics);
        line.push('\n');
        self.file.write_all(line.as_bytes()).map_err(io_error("write", &self.path))?;
        self.file.flush().map_err(io_error("write", &self.path))
    }
}

/// The JSON object of one step (without the newline).
pub fn encode_line(metrics: &StepMetrics) -> String {
    let mut line =
        format!("{{\"step\":{},\"wall_time\":{}", metrics.step(), number(metrics.wall_time()));
    for (name, value) in metrics.scalars() {
        line.push(',');
        line.push_str(&serde_json::Value::from(name.as_str()).to_string());
        line.push(':');
        line.push_str(&number(*value));
    }
    line.push('}');
    line
}

fn number(value: f64) -> String {
    match serde_json::Number::from_f64(value) {
        Some(number) => number.to_string(),
        None if value.is_nan() => "\"NaN\"".to_owned(),
        None if value > 0.0 => "\"Infinity\"".to_owned(),
        None => "\"-Infinity\"".to_owned(),
    }
}

/// Parses one line written by [`encode_line`]; the error says what was expected and found.
pub fn parse_line(line: &str) -> Result<StepMetrics, String> {
    let OrderedObject(entries) =
        serde_json::from_str(line).map_err(|error| format!("expected a JSON object: {error}"))?;
    let mut step = None;
    let mut wall_time = None;
    let mut scalars = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        match key.as_str() {
            "step" => {
                step = Some(value.as_u64().ok_or_else(|| {
                    format!("expected `step` to be a non-negative integer, found {value}")
                })?);
            }
            "wall_time" => wall_time = Some(scalar(&key, &value)?),
            _ => {
                let value = scalar(&key, &value)?;
                scalars.push((key, value));
            }
        }
    }
    let step = step.ok_or("expected a `step` key, found none")?;
    let wall_time = wall_time.ok_or("expected a `wall_time` key, found none")?;
    let mut metrics = StepMetrics::with_wall_time(step, wall_time);
    for (name, value) in scalars {
        metrics.set(name, value).map_err(|error| error.to_string())?;
    }
    Ok(metrics)
}

fn scalar(key: &str, value: &serde_json::Value) -> Result<f64, String> {
    match value {
        serde_json::Value::Number(number) => number.as_f64(),
        serde_json::Value::String(text) => match text.as_str() {
            "NaN" => Some(f64::NAN),
            "Infinity" => Some(f64::INFINITY),
            "-Infinity" => Some(f64::NEG_INFINITY),
            _ => None,
        },
        _ => None,
    }
    .ok_or_else(|| {
        format!("expected `{key}` to be a number, \"NaN\" or \"±Infinity\", found {value}")
    })
}

/// Reads every record of a JSONL metrics file; blank lines are skipped, any other line that is
/// not a record is an error naming the line.
pub fn read_jsonl(path: &Path) -> Result<Vec<StepMetrics>> {
    let text = std::fs::read_to_string(path).map_err(io_error("read", path))?;
    let mut records = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record = parse_line(line).map_err(|message| TelemetryError::Jsonl {
            path: path.to_owned(),
            line: index + 1,
            message,
        })?;
        records.push(record);
    }
    Ok(records)
}

/// Rewrites `path` keeping only the complete records of steps before `next_step` (a torn last
/// line from a killed run is dropped); the rewrite goes through a temporary file and a rename so
/// a crash during it leaves either the old or the new file.
fn keep_records_before(path: &Path, next_step: u64) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(io_error("read", path)(error)),
    };
    // Only newline-terminated lines are complete; the segment after the last newline is not.
    let complete = &text[..text.rfind('\n').map_or(0, |end| end + 1)];
    let mut kept = String::with_capacity(complete.len());
    for (index, line) in complete.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record = parse_line(line).map_err(|message| TelemetryError::Jsonl {
            path: path.to_owned(),
            line: index + 1,
            message,
        })?;
        if record.step() < next_step {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".resume-tmp");
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, kept).map_err(io_error("write", &temporary))?;
    std::fs::rename(&temporary, path).map_err(io_error("replace", path))
}

/// A JSON object with its keys in file order (`serde_json::Map` sorts them without the
/// `preserve_order` feature, which would change the map type for the whole workspace).
struct OrderedObject(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for OrderedObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor;
        impl<'de> Visitor<'de> for ObjectVisitor {
            type Value = OrderedObject;

            fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                formatter.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OrderedObject, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    entries.push(entry);
                }
                Ok(OrderedObject(entries))
            }
        }
        deserializer.deserialize_map(ObjectVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn record(step: u64, reward: f64) -> StepMetrics {
        let mut metrics = StepMetrics::with_wall_time(step, 1_700_000_000.5 + step as f64);
        metrics.set("reward/mean", reward).unwrap().set("kl", 0.01 * step as f64).unwrap();
        metrics
    }

    #[test]
    fn lines_keep_order_and_non_finite_values() {
        let mut metrics = StepMetrics::with_wall_time(7, 12.5);
        metrics.set("z", 1.0).unwrap().set("a\"b", f64::NAN).unwrap();
        metrics.set("inf", f64::INFINITY).unwrap().set("ninf", f64::NEG_INFINITY).unwrap();
        let line = encode_line(&metrics);
        assert_eq!(
            line,
            r#"{"step":7,"wall_time":12.5,"z":1.0,"a\"b":"NaN","inf":"Infinity","ninf":"-Infinity"}"#
        );
        let back = parse_line(&line).unwrap();
        let names: Vec<_> = back.scalars().iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["z", "a\"b", "inf", "ninf"]);
        assert!(back.get("a\"b").unwrap().is_nan());
        assert_eq!(back.get("ninf"), Some(f64::NEG_INFINITY));
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        for (line, expected) in [
            ("[1]", "expected a JSON object"),
            (r#"{"wall_time":1}"#, "expected a `step` key"),
            (r#"{"step":-1,"wall_time":1}"#, "non-negative integer"),
            (r#"{"step":1,"wall_time":1,"x":"high"}"#, "expected `x` to be a number"),
            (r#"{"step":1,"wall_time":1,"":2}"#, "must not be empty"),
        ] {
            let error = parse_line(line).unwrap_err();
            assert!(error.contains(expected), "{line}: {error}");
        }
    }

    #[test]
    fn writes_reads_and_resumes() {
        let dir = tempfile::Builder::new().prefix("rtrun-telemetry-jsonl-").tempdir().unwrap();
        let path = dir.path().join("resume.jsonl");
        let mut writer = JsonlWriter::create(&path, StartMode::New).unwrap();
        for step in 0..5 {
            writer.record(&record(step, step as f64 / 10.0)).unwrap();
        }
        drop(writer);
        assert!(matches!(
            JsonlWriter::create(&path, StartMode::New),
            Err(TelemetryError::AlreadyExists { .. })
        ));
        assert_eq!(
            read_jsonl(&path).unwrap(),
            (0..5).map(|s| record(s, s as f64 / 10.0)).collect::<Vec<_>>()
        );

        // A killed run leaves a torn last line; resuming from step 3 drops it and steps 3, 4.
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(br#"{"step":5,"wall_ti"#).unwrap();
        drop(file);
        let mut writer = JsonlWriter::create(&path, StartMode::Resume { next_step: 3 }).unwrap();
        writer.record(&record(3, 0.9)).unwrap();
        let steps: Vec<_> = read_jsonl(&path)
            .unwrap()
            .iter()
            .map(|r| (r.step(), r.get("reward/mean").unwrap()))
            .collect();
        assert_eq!(steps, [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.9)]);

        // A corrupt complete line is an error, not silently dropped data.
        std::fs::write(&path, "{\"step\":0,\"wall_time\":1}\nnot json\n").unwrap();
        let error = JsonlWriter::create(&path, StartMode::Resume { next_step: 1 }).err().unwrap();
        assert!(error.to_string().contains("line 2"), "{error}");

        // Overwrite truncates; resuming a missing file creates it.
        JsonlWriter::create(&path, StartMode::Overwrite).unwrap();
        assert_eq!(read_jsonl(&path).unwrap(), []);
        std::fs::remove_file(&path).unwrap();
        JsonlWriter::create(&path, StartMode::Resume { next_step: 9 }).unwrap();
        assert!(path.exists());
        std::fs::remove_file(&path).unwrap();
    }

    proptest! {
        #[test]
        fn records_round_trip(
            step in any::<u64>(),
            wall_time in 0.0f64..2e9,
            scalars in proptest::collection::vec(("[a-z/_ .é]{1,10}", any::<f64>()), 0..6),
        ) {
            let mut metrics = StepMetrics::with_wall_time(step, wall_time);
            for (name, value) in scalars {
                if name != "step" && name != "wall_time" {
                    metrics.set(name, value).unwrap();
                }
            }
            let back = parse_line(&encode_line(&metrics)).unwrap();
            prop_assert_eq!(back.step(), step);
            prop_assert_eq!(back.wall_time(), wall_time);
            prop_assert_eq!(back.scalars().len(), metrics.scalars().len());
            for ((name, value), (back_name, back_value)) in metrics.scalars().iter().zip(back.scalars()) {
                prop_assert_eq!(name, back_name);
                prop_assert!(value.to_bits() == back_value.to_bits() || (value.is_nan() && back_value.is_nan()));
            }
        }

        #[test]
        fn arbitrary_lines_never_panic(line in ".{0,80}") {
            let _ = parse_line(&line);
        }
    }
}
