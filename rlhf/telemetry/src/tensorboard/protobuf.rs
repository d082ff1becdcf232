//! The protobuf wire format, only as far as TensorBoard's `Event` needs it: varints, 32/64-bit
//! fixed fields and length-delimited fields. Hand-written so the build needs no `protoc` and no
//! code generator; decoding is defensive (hostile bytes give an error, never a panic).

use crate::error::TelemetryError;

/// Wire type of varint fields (`int64`, `enum`, `bool`).
const VARINT: u8 = 0;
/// Wire type of 64-bit fixed fields (`double`).
const FIXED64: u8 = 1;
/// Wire type of length-delimited fields (`string`, `bytes`, nested messages).
const LEN: u8 = 2;
/// Wire type of 32-bit fixed fields (`float`).
const FIXED32: u8 = 5;

/// The longest valid varint: 64 bits in 7-bit groups.
const MAX_VARINT_BYTES: usize = 10;

/// Appends protobuf fields to a byte buffer.
#[derive(Default)]
pub(crate) struct MessageWriter {
    bytes: Vec<u8>,
}

impl MessageWriter {
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.bytes.push((value as u8 & 0x7F) | 0x80);
            value >>= 7;
        }
        self.bytes.push(value as u8);
    }

    fn key(&mut self, field: u32, wire_type: u8) {
        self.varint((u64::from(field) << 3) | u64::from(wire_type));
    }

    /// An `int64` field (negative values take ten bytes, as protobuf specifies).
    pub(crate) fn int64(&mut self, field: u32, value: i64) {
        self.key(field, VARINT);
        self.varint(value as u64);
    }

    /// A `double` field.
    pub(crate) fn double(&mut self, field: u32, value: f64) {
        self.key(field, FIXED64);
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }

    /// A `float` field.
    pub(crate) fn float(&mut self, field: u32, value: f32) {
        self.key(field, FIXED32);
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }

    /// A `string` or `bytes` field.
    pub(crate) fn bytes(&mut self, field: u32, value: &[u8]) {
        self.key(field, LEN);
        self.varint(value.len() as u64);
        self.bytes.extend_from_slice(value);
    }

    /// A nested message field, built by `build`.
    pub(crate) fn message(&mut self, field: u32, build: impl FnOnce(&mut MessageWriter)) {
        let mut nested = MessageWriter::default();
        build(&mut nested);
        self.bytes(field, &nested.bytes);
    }
}

/// The value of one decoded field.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum FieldValue<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

impl FieldValue<'_> {
    /// The name of the wire type, for error messages.
    pub(crate) fn wire_name(&self) -> &'static str {
        match self {
            FieldValue::Varint(_) => "varint",
            FieldValue::Fixed64(_) => "fixed64",
            FieldValue::Bytes(_) => "length-delimited",
            FieldValue::Fixed32(_) => "fixed32",
        }
    }
}

/// Iterates over the fields of one encoded message.
pub(crate) struct MessageReader<'a> {
    bytes: &'a [u8],
    position: usize,
    /// Offset of `bytes[0]` in the file, so errors point at the right byte.
    file_offset: u64,
}

impl<'a> MessageReader<'a> {
    pub(crate) fn new(bytes: &'a [u8], file_offset: u64) -> Self {
        Self { bytes, position: 0, file_offset }
    }

    /// The file offset of the next unread byte.
    pub(crate) fn offset(&self) -> u64 {
        self.file_offset + self.position as u64
    }

    fn error(&self, reason: impl Into<String>) -> TelemetryError {
        TelemetryError::CorruptEventFile { offset: self.offset(), reason: reason.into() }
    }

    fn varint(&mut self) -> Result<u64, TelemetryError> {
        let mut value = 0u64;
        for index in 0..MAX_VARINT_BYTES {
            let Some(&byte) = self.bytes.get(self.position) else {
                return Err(self.error("varint runs past the end of the message"));
            };
            self.position += 1;
            let group = u64::from(byte & 0x7F);
            // The tenth byte may carry only the top bit of a 64-bit value.
            if index == MAX_VARINT_BYTES - 1 && group > 1 {
                return Err(self.error("varint overflows 64 bits"));
            }
            value |= group << (7 * index);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(self.error("varint longer than 10 bytes"))
    }

    fn take(&mut self, len: usize) -> Result<&'a [u8], TelemetryError> {
        let end = self.position.checked_add(len).filter(|&end| end <= self.bytes.len());
        let Some(end) = end else {
            return Err(self.error(format!(
                "field of {len} bytes runs past the end of the message ({} bytes left)",
                self.bytes.len() - self.position
            )));
        };
        let slice = &self.bytes[self.position..end];
        self.position = end;
        Ok(slice)
    }

    fn field(&mut self) -> Result<(u32, FieldValue<'a>), TelemetryError> {
        let key = self.varint()?;
        let wire_type = (key & 0x7) as u8;
        let field = key >> 3;
        if field == 0 || field > u64::from(u32::MAX >> 3) {
            return Err(self.error(format!("field number {field} is out of range")));
        }
        let value = match wire_type {
            VARINT => FieldValue::Varint(self.varint()?),
            FIXED64 => {
                let bytes = self.take(8)?;
                let array: [u8; 8] = bytes.try_into().expect("take(8) returns exactly 8 bytes");
                FieldValue::Fixed64(u64::from_le_bytes(array))
            }
            LEN => {
                let len = self.varint()?;
                let len = usize::try_from(len)
                    .map_err(|_| self.error(format!("length {len} does not fit in memory")))?;
                FieldValue::Bytes(self.take(len)?)
            }
            FIXED32 => {
                let bytes = self.take(4)?;
                let array: [u8; 4] = bytes.try_into().expect("take(4) returns exactly 4 bytes");
                FieldValue::Fixed32(u32::from_le_bytes(array))
            }
            other => {
                return Err(self.error(format!(
                    "unsupported wire type {other} (expected 0, 1, 2 or 5; groups are not used \
                     by TensorBoard events)"
                )));
            }
        };
        Ok((field as u32, value))
    }
}

impl<'a> Iterator for MessageReader<'a> {
    type Item = Result<(u32, FieldValue<'a>), TelemetryError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.position >= self.bytes.len() {
            return None;
        }
        let item = self.field();
        if item.is_err() {
            // Stop after the first error: the rest of the message cannot be framed.
            self.position = self.bytes.len();
        }
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn encodes_the_documented_examples() {
        // From the protobuf encoding guide: field 1 = 150 is `08 96 01`.
        let mut writer = MessageWriter::default();
        writer.int64(1, 150);
        assert_eq!(writer.into_bytes(), [0x08, 0x96, 0x01]);
        // Field 2 = "testing" is `12 07 74 65 73 74 69 6e 67`.
        let mut writer = MessageWriter::default();
        writer.bytes(2, b"testing");
        assert_eq!(writer.into_bytes(), b"\x12\x07testing");
        // A negative int64 takes ten bytes.
        let mut writer = MessageWriter::default();
        writer.int64(1, -1);
        assert_eq!(writer.into_bytes().len(), 11);
    }

    #[test]
    fn rejects_truncated_and_overlong_input() {
        let errors = [
            &[0x08][..],                                                         // key without value
            &[0x08, 0x80],       // unterminated varint
            &[0x12, 0x05, b'a'], // length past the end
            &[0x09, 1, 2, 3],    // fixed64 with 3 bytes
            &[0x0B],             // start-group wire type
            &[0x00, 0x01],       // field number 0
            &[0x08, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x02], // > 64 bits
        ];
        for bytes in errors {
            let result: Result<Vec<_>, _> = MessageReader::new(bytes, 0).collect();
            assert!(result.is_err(), "{bytes:?} should not decode");
        }
    }

    proptest! {
        #[test]
        fn fields_round_trip(
            int in any::<i64>(),
            double in any::<f64>(),
            float in any::<f32>(),
            text in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let mut writer = MessageWriter::default();
            writer.int64(1, int);
            writer.double(2, double);
            writer.float(3, float);
            writer.bytes(4, &text);
            writer.message(5, |nested| nested.int64(7, 3));
            let bytes = writer.into_bytes();
            let fields: Vec<_> = MessageReader::new(&bytes, 0).collect::<Result<_, _>>().unwrap();
            prop_assert_eq!(fields.len(), 5);
            prop_assert_eq!(fields[0], (1, FieldValue::Varint(int as u64)));
            prop_assert_eq!(fields[1], (2, FieldValue::Fixed64(double.to_bits())));
            prop_assert_eq!(fields[2], (3, FieldValue::Fixed32(float.to_bits())));
            prop_assert_eq!(fields[3], (4, FieldValue::Bytes(&text)));
            prop_assert_eq!(fields[4], (5, FieldValue::Bytes(&[0x38, 3][..])));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            for field in MessageReader::new(&bytes, 0) {
                let _ = field;
            }
        }
    }
}
