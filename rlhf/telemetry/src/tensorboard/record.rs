//! TFRecord framing, the container of TensorBoard event files: each record is
//! `u64 length (LE) · u32 masked CRC-32C of the length bytes · data · u32 masked CRC-32C of data`.

use super::crc32c::masked_crc32c;
use crate::error::TelemetryError;

/// Bytes of framing around each record's data: length, its CRC, and the data's CRC.
pub(crate) const FRAMING_BYTES: usize = 8 + 4 + 4;

/// Appends one framed record holding `data` to `out`.
pub(crate) fn encode_record(data: &[u8], out: &mut Vec<u8>) {
    let length = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc32c(&length).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
}

/// Iterates over the records of a TFRecord byte stream, checking both CRCs of each; yields each
/// record's file offset and data. Stops after the first error.
pub(crate) struct RecordReader<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl<'a> RecordReader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, position: 0 }
    }

    fn record(&mut self) -> Result<(u64, &'a [u8]), TelemetryError> {
        let start = self.position;
        let corrupt =
            |reason: String| TelemetryError::CorruptEventFile { offset: start as u64, reason };
        let rest = &self.bytes[start..];
        if rest.len() < 12 {
            return Err(corrupt(format!(
                "truncated record header: expected 12 bytes, found {}",
                rest.len()
            )));
        }
        let (length_bytes, rest) = rest.split_at(8);
        let (length_crc, rest) = rest.split_at(4);
        let stored = u32::from_le_bytes(length_crc.try_into().expect("split_at(4) gives 4 bytes"));
        let computed = masked_crc32c(length_bytes);
        if stored != computed {
            return Err(corrupt(format!(
                "length checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
            )));
        }
        let length =
            u64::from_le_bytes(length_bytes.try_into().expect("split_at(8) gives 8 bytes"));
        let fits =
            usize::try_from(length).ok().filter(|&length| length <= rest.len().saturating_sub(4));
        let Some(length) = fits else {
            return Err(corrupt(format!(
                "truncated record: header announces {length} data bytes, {} bytes follow \
                 (including the 4-byte data checksum)",
                rest.len()
            )));
        };
        let (data, rest) = rest.split_at(length);
        let stored = u32::from_le_bytes(rest[..4].try_into().expect("slice of 4 bytes"));
        let computed = masked_crc32c(data);
        if stored != computed {
            return Err(corrupt(format!(
                "data checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
            )));
        }
        self.position = start + FRAMING_BYTES + length;
        Ok(((start + 12) as u64, data))
    }
}

impl<'a> Iterator for RecordReader<'a> {
    type Item = Result<(u64, &'a [u8]), TelemetryError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.position >= self.bytes.len() {
            return None;
        }
        let item = self.record();
        if item.is_err() {
            self.position = self.bytes.len();
        }
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn framed(records: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for record in records {
            encode_record(record, &mut out);
        }
        out
    }

    #[test]
    fn round_trips_and_reports_data_offsets() {
        let bytes = framed(&[b"first", b"", b"third record"]);
        let records: Vec<_> = RecordReader::new(&bytes).collect::<Result<_, _>>().unwrap();
        assert_eq!(
            records,
            vec![(12, &b"first"[..]), (12 + 5 + 4 + 12, &b""[..]), (49, &b"third record"[..])]
        );
    }

    #[test]
    fn detects_every_single_bit_flip() {
        let bytes = framed(&[b"payload"]);
        for index in 0..bytes.len() {
            for bit in 0..8 {
                let mut damaged = bytes.clone();
                damaged[index] ^= 1 << bit;
                let result: Result<Vec<_>, _> = RecordReader::new(&damaged).collect();
                assert!(result.is_err(), "flip of bit {bit} in byte {index} went unnoticed");
            }
        }
    }

    #[test]
    fn detects_truncation() {
        let bytes = framed(&[b"payload", b"second"]);
        for len in 1..bytes.len() {
            if len == FRAMING_BYTES + 7 {
                continue; // a clean record boundary
            }
            let result: Result<Vec<_>, _> = RecordReader::new(&bytes[..len]).collect();
            assert!(result.is_err(), "truncation to {len} bytes went unnoticed");
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            for record in RecordReader::new(&bytes) {
                let _ = record;
            }
        }
    }
}
