//! TensorBoard's `Event` message (`tensorflow/core/util/event.proto`) and the parts of
//! `Summary` and `SessionLog` that scalar logging uses, with hand-written encoding and decoding.
//!
//! Field numbers used: `Event { double wall_time = 1; int64 step = 2; string file_version = 3;
//! Summary summary = 5; SessionLog session_log = 7; }`, `Summary { repeated Value value = 1; }`,
//! `Summary.Value { string tag = 1; float simple_value = 2; }`,
//! `SessionLog { SessionStatus status = 1; }`. Other fields are skipped when reading.

use super::protobuf::{FieldValue, MessageReader, MessageWriter};
use crate::error::TelemetryError;

/// The `file_version` of the first record; version 2 makes TensorBoard honour session starts.
pub const FILE_VERSION: &str = "brain.Event:2";

/// One TensorBoard event.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    /// The global step.
    pub step: i64,
    /// What the event carries.
    pub payload: EventPayload,
}

/// The `what` of an [`Event`].
#[derive(Debug, Clone, PartialEq)]
pub enum EventPayload {
    /// The file header, e.g. [`FILE_VERSION`].
    FileVersion(String),
    /// Summary values (scalars, or other kinds this crate does not interpret).
    Summary(Vec<SummaryValue>),
    /// A session status; `Start` at a step tells TensorBoard to drop older events at or after it.
    SessionLog(SessionStatus),
    /// A payload this crate does not interpret (graphs, run metadata, ...), or none.
    Other,
}

/// One `Summary.Value`.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryValue {
    /// The series name, e.g. `reward/mean`.
    pub tag: String,
    /// The scalar, if the value is a `simple_value` (images, histograms and tensors are `None`).
    pub simple_value: Option<f32>,
}

/// `SessionLog.SessionStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionStatus {
    /// `STATUS_UNSPECIFIED` (0).
    Unspecified,
    /// `START` (1): a (re)started run.
    Start,
    /// `STOP` (2).
    Stop,
    /// `CHECKPOINT` (3).
    Checkpoint,
    /// A value this crate does not know.
    Unknown(u64),
}

impl SessionStatus {
    fn code(self) -> u64 {
        match self {
            SessionStatus::Unspecified => 0,
            SessionStatus::Start => 1,
            SessionStatus::Stop => 2,
            SessionStatus::Checkpoint => 3,
            SessionStatus::Unknown(code) => code,
        }
    }

    fn from_code(code: u64) -> Self {
        match code {
            0 => SessionStatus::Unspecified,
            1 => SessionStatus::Start,
            2 => SessionStatus::Stop,
            3 => SessionStatus::Checkpoint,
            other => SessionStatus::Unknown(other),
        }
    }
}

impl Event {
    /// Encodes the event as a protobuf message.
    pub fn encode(&self) -> Vec<u8> {
        let mut writer = MessageWriter::default();
        writer.double(1, self.wall_time);
        writer.int64(2, self.step);
        match &self.payload {
            EventPayload::FileVersion(version) => writer.bytes(3, version.as_bytes()),
            EventPayload::Summary(values) => writer.message(5, |summary| {
                for value in values {
                    summary.message(1, |encoded| {
                        encoded.bytes(1, value.tag.as_bytes());
                        if let Some(simple_value) = value.simple_value {
                            encoded.float(2, simple_value);
                        }
                    });
                }
            }),
            EventPayload::SessionLog(status) => {
                writer.message(7, |log| log.int64(1, status.code() as i64));
            }
            EventPayload::Other => {}
        }
        writer.into_bytes()
    }

    /// Decodes an event message; `offset` is its position in the file, for error messages.
    pub fn decode(bytes: &[u8], offset: u64) -> Result<Self, TelemetryError> {
        let mut event = Event { wall_time: 0.0, step: 0, payload: EventPayload::Other };
        let mut reader = MessageReader::new(bytes, offset);
        while let Some(field) = reader.next() {
            let (number, value) = field?;
            let at = reader.offset();
            match (number, value) {
                (1, FieldValue::Fixed64(bits)) => event.wall_time = f64::from_bits(bits),
                (2, FieldValue::Varint(step)) => event.step = step as i64,
                (3, FieldValue::Bytes(version)) => {
                    event.payload = EventPayload::FileVersion(utf8(version, "file_version", at)?);
                }
                (5, FieldValue::Bytes(summary)) => {
                    event.payload = EventPayload::Summary(decode_summary(summary, at)?);
                }
                (7, FieldValue::Bytes(log)) => {
                    event.payload = EventPayload::SessionLog(decode_session_log(log, at)?);
                }
                (1 | 2 | 3 | 5 | 7, other) => {
                    return Err(wrong_wire_type("Event", number, other, at));
                }
                _ => {}
            }
        }
        Ok(event)
    }
}

fn decode_summary(bytes: &[u8], offset: u64) -> Result<Vec<SummaryValue>, TelemetryError> {
    let mut values = Vec::new();
    let mut reader = MessageReader::new(bytes, offset);
    while let Some(field) = reader.next() {
        match field? {
            (1, FieldValue::Bytes(value)) => values.push(decode_value(value, reader.offset())?),
            (1, other) => return Err(wrong_wire_type("Summary", 1, other, reader.offset())),
            _ => {}
        }
    }
    Ok(values)
}

fn decode_value(bytes: &[u8], offset: u64) -> Result<SummaryValue, TelemetryError> {
    let mut value = SummaryValue { tag: String::new(), simple_value: None };
    let mut reader = MessageReader::new(bytes, offset);
    while let Some(field) = reader.next() {
        let at = reader.offset();
        match field? {
            (1, FieldValue::Bytes(tag)) => value.tag = utf8(tag, "Summary.Value.tag", at)?,
            (2, FieldValue::Fixed32(bits)) => value.simple_value = Some(f32::from_bits(bits)),
            (number @ (1 | 2), other) => {
                return Err(wrong_wire_type("Summary.Value", number, other, at));
            }
            _ => {}
        }
    }
    Ok(value)
}

fn decode_session_log(bytes: &[u8], offset: u64) -> Result<SessionStatus, TelemetryError> {
    let mut status = SessionStatus::Unspecified;
    let mut reader = MessageReader::new(bytes, offset);
    while let Some(field) = reader.next() {
        match field? {
            (1, FieldValue::Varint(code)) => status = SessionStatus::from_code(code),
            (1, other) => return Err(wrong_wire_type("SessionLog", 1, other, reader.offset())),
            _ => {}
        }
    }
    Ok(status)
}

fn utf8(bytes: &[u8], field: &str, offset: u64) -> Result<String, TelemetryError> {
    String::from_utf8(bytes.to_vec()).map_err(|error| TelemetryError::CorruptEventFile {
        offset,
        reason: format!("{field} is not UTF-8: {error}"),
    })
}

fn wrong_wire_type(
    message: &str,
    field: u32,
    value: FieldValue<'_>,
    offset: u64,
) -> TelemetryError {
    TelemetryError::CorruptEventFile {
        offset,
        reason: format!("{message} field {field} has wire type {}", value.wire_name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn encodes_a_scalar_event_byte_for_byte() {
        let event = Event {
            wall_time: 1.5,
            step: 3,
            payload: EventPayload::Summary(vec![SummaryValue {
                tag: "kl".into(),
                simple_value: Some(0.25),
            }]),
        };
        let mut expected = vec![0x09];
        expected.extend_from_slice(&1.5f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 3]);
        // summary (field 5) { value (field 1) { tag "kl"; simple_value 0.25 } }
        expected.extend_from_slice(&[0x2A, 11, 0x0A, 9, 0x0A, 2, b'k', b'l', 0x15]);
        expected.extend_from_slice(&0.25f32.to_le_bytes());
        assert_eq!(event.encode(), expected);
    }

    #[test]
    fn skips_unknown_fields() {
        let mut bytes = Event { wall_time: 2.0, step: 9, payload: EventPayload::Other }.encode();
        bytes.extend_from_slice(&[0x52, 2, 0xAA, 0xBB]); // source_metadata (field 10)
        let event = Event::decode(&bytes, 0).unwrap();
        assert_eq!(event, Event { wall_time: 2.0, step: 9, payload: EventPayload::Other });
    }

    #[test]
    fn rejects_a_known_field_with_the_wrong_wire_type() {
        let bytes = [0x10 | 0x01, 0, 0, 0, 0, 0, 0, 0, 0]; // step as fixed64
        let error = Event::decode(&bytes, 100).unwrap_err().to_string();
        assert!(error.contains("Event field 2 has wire type fixed64"), "{error}");
    }

    proptest! {
        #[test]
        fn events_round_trip(
            wall_time in any::<f64>().prop_filter("NaN != NaN", |v| !v.is_nan()),
            step in any::<i64>(),
            values in proptest::collection::vec(("[a-z/_]{0,12}", proptest::option::of(-1e6f32..1e6)), 0..5),
            status in 0u64..6,
            kind in 0..4,
        ) {
            let payload = match kind {
                0 => EventPayload::FileVersion(FILE_VERSION.into()),
                1 => EventPayload::Summary(values.into_iter().map(|(tag, simple_value)| SummaryValue { tag, simple_value }).collect()),
                2 => EventPayload::SessionLog(SessionStatus::from_code(status)),
                _ => EventPayload::Other,
            };
            let event = Event { wall_time, step, payload };
            prop_assert_eq!(Event::decode(&event.encode(), 0).unwrap(), event);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = Event::decode(&bytes, 0);
        }
    }
}
