//! Typed tensor objects: a small binary header (dtype, shape) followed by the contiguous,
//! row-major element bytes at a 64-byte-aligned offset, so a tensor library can build a tensor
//! over the data pointer without copying (e.g. tch's `Tensor::from_blob` with
//! [`TensorHeader::strides`]). The store itself knows nothing about tch.
//!
//! Layout, little-endian: `b"RTT1"`, dtype code (u8), number of dimensions (u8), two zero bytes,
//! data length in bytes (u64), one u64 per dimension, zero padding up to
//! [`TensorHeader::data_offset`], then exactly `data length` bytes. Decoding checks every field
//! against the object's size, so a hostile or truncated object gives an error.

use serde::{Deserialize, Serialize};

use crate::alloc::ALIGNMENT;

/// Most dimensions a tensor object may have.
pub const MAX_DIMS: usize = 16;
const MAGIC: [u8; 4] = *b"RTT1";
const FIXED_HEADER: usize = 16;

/// Element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum DType {
    /// 32-bit float.
    F32 = 1,
    /// 16-bit IEEE float.
    F16 = 2,
    /// 16-bit brain float.
    BF16 = 3,
    /// 64-bit float.
    F64 = 4,
    /// 64-bit signed integer.
    I64 = 5,
    /// 32-bit signed integer.
    I32 = 6,
    /// Unsigned byte.
    U8 = 7,
    /// Boolean, one byte per element.
    Bool = 8,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I64,
        DType::I32,
        DType::U8,
        DType::Bool,
    ];

    /// Bytes per element.
    pub fn element_size(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }

    /// The dtype with this header code.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|dtype| *dtype as u8 == code)
    }
}

/// Why a tensor header is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// The object is shorter than its header says.
    #[error("tensor object holds {found} bytes, expected at least {needed}")]
    TooShort {
        /// Bytes the header needs.
        needed: u64,
        /// Bytes present.
        found: u64,
    },
    /// Not a tensor object.
    #[error("tensor magic is {found:?}, expected {MAGIC:?}")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// Unknown dtype code.
    #[error("tensor dtype code {0} is unknown, expected 1..=8")]
    UnknownDType(u8),
    /// Too many dimensions.
    #[error("tensor has {found} dimensions, expected at most {MAX_DIMS}")]
    TooManyDims {
        /// Dimensions found.
        found: usize,
    },
    /// The element count or byte length does not fit in 64 bits.
    #[error("tensor shape {shape:?} overflows a 64-bit byte length")]
    SizeOverflow {
        /// The shape.
        shape: Vec<u64>,
    },
    /// The recorded data length disagrees with dtype × shape.
    #[error("tensor data length is {found} bytes, expected {expected} from dtype and shape")]
    ByteLenMismatch {
        /// Bytes dtype × shape needs.
        expected: u64,
        /// Bytes the header records (or the data given).
        found: u64,
    },
    /// Reserved header bytes are not zero.
    #[error("tensor header reserved bytes are {found:?}, expected zeros")]
    Reserved {
        /// The reserved bytes.
        found: [u8; 2],
    },
    /// The object's size disagrees with header plus data.
    #[error("tensor object holds {found} bytes, expected exactly {expected}")]
    ObjectSizeMismatch {
        /// Header plus data.
        expected: u64,
        /// The object's size.
        found: u64,
    },
}

/// Dtype and shape of a contiguous tensor object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorHeader {
    dtype: DType,
    shape: Vec<u64>,
    byte_len: u64,
}

impl TensorHeader {
    /// A header for a contiguous tensor; fails on too many dimensions or overflow.
    pub fn new(dtype: DType, shape: Vec<u64>) -> Result<TensorHeader, TensorError> {
        if shape.len() > MAX_DIMS {
            return Err(TensorError::TooManyDims { found: shape.len() });
        }
        let byte_len = shape
            .iter()
            .try_fold(dtype.element_size(), |acc, &dim| acc.checked_mul(dim))
            .filter(|&len| len.checked_add(data_offset(shape.len())).is_some());
        match byte_len {
            Some(byte_len) => Ok(TensorHeader { dtype, shape, byte_len }),
            None => Err(TensorError::SizeOverflow { shape }),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dimensions.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Element count.
    pub fn numel(&self) -> u64 {
        self.byte_len / self.dtype.element_size()
    }

    /// Bytes of element data.
    pub fn byte_len(&self) -> u64 {
        self.byte_len
    }

    /// Row-major strides in elements (the only layout stored).
    pub fn strides(&self) -> Vec<u64> {
        let mut strides = vec![1u64; self.shape.len()];
        for i in (0..self.shape.len().saturating_sub(1)).rev() {
            // Saturating: with a zero dimension the other dimensions are unbounded.
            strides[i] = strides[i + 1].saturating_mul(self.shape[i + 1].max(1));
        }
        strides
    }

    /// Where the data starts within the object: a multiple of 64.
    pub fn data_offset(&self) -> u64 {
        data_offset(self.shape.len())
    }

    /// The object's total size: header, padding and data.
    pub fn object_size(&self) -> u64 {
        self.data_offset() + self.byte_len
    }

    /// Writes header and data into a whole object buffer of [`Self::object_size`] bytes.
    pub fn write_object(&self, object: &mut [u8], data: &[u8]) -> Result<(), TensorError> {
        if data.len() as u64 != self.byte_len {
            return Err(TensorError::ByteLenMismatch {
                expected: self.byte_len,
                found: data.len() as u64,
            });
        }
        if object.len() as u64 != self.object_size() {
            return Err(TensorError::ObjectSizeMismatch {
                expected: self.object_size(),
                found: object.len() as u64,
            });
        }
        let (header, body) = object.split_at_mut(self.data_offset() as usize);
        self.write_header(header)?;
        body.copy_from_slice(data);
        Ok(())
    }

    /// Writes only the header (and its padding) into the first [`Self::data_offset`] bytes of
    /// an object, for callers that copy the data themselves.
    pub fn write_header(&self, header: &mut [u8]) -> Result<(), TensorError> {
        if header.len() as u64 != self.data_offset() {
            return Err(TensorError::ObjectSizeMismatch {
                expected: self.data_offset(),
                found: header.len() as u64,
            });
        }
        header.fill(0);
        header[..4].copy_from_slice(&MAGIC);
        header[4] = self.dtype as u8;
        header[5] = self.shape.len() as u8;
        header[8..16].copy_from_slice(&self.byte_len.to_le_bytes());
        for (slot, dim) in header[FIXED_HEADER..].chunks_exact_mut(8).zip(&self.shape) {
            slot.copy_from_slice(&dim.to_le_bytes());
        }
        Ok(())
    }

    /// Reads and validates the header of a whole tensor object.
    pub fn decode(object: &[u8]) -> Result<TensorHeader, TensorError> {
        let found = object.len() as u64;
        let fixed: &[u8; FIXED_HEADER] = object
            .get(..FIXED_HEADER)
            .and_then(|bytes| bytes.try_into().ok())
            .ok_or(TensorError::TooShort { needed: FIXED_HEADER as u64, found })?;
        let magic = [fixed[0], fixed[1], fixed[2], fixed[3]];
        if magic != MAGIC {
            return Err(TensorError::BadMagic { found: magic });
        }
        let dtype = DType::from_code(fixed[4]).ok_or(TensorError::UnknownDType(fixed[4]))?;
        let ndim = usize::from(fixed[5]);
        if ndim > MAX_DIMS {
            return Err(TensorError::TooManyDims { found: ndim });
        }
        if fixed[6..8] != [0, 0] {
            return Err(TensorError::Reserved { found: [fixed[6], fixed[7]] });
        }
        let recorded_len = u64::from_le_bytes([
            fixed[8], fixed[9], fixed[10], fixed[11], fixed[12], fixed[13], fixed[14], fixed[15],
        ]);
        let offset = data_offset(ndim);
        let dims = object
            .get(FIXED_HEADER..FIXED_HEADER + 8 * ndim)
            .ok_or(TensorError::TooShort { needed: offset, found })?;
        let shape = dims
            .chunks_exact(8)
            .map(|dim| {
                u64::from_le_bytes([dim[0], dim[1], dim[2], dim[3], dim[4], dim[5], dim[6], dim[7]])
            })
            .collect();
        let header = TensorHeader::new(dtype, shape)?;
        if header.byte_len != recorded_len {
            return Err(TensorError::ByteLenMismatch {
                expected: header.byte_len,
                found: recorded_len,
            });
        }
        if header.object_size() != found {
            return Err(TensorError::ObjectSizeMismatch { expected: header.object_size(), found });
        }
        Ok(header)
    }
}

/// A tensor read in place: its header and its element bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorView<'a> {
    /// Dtype and shape.
    pub header: TensorHeader,
    /// The contiguous element bytes, 64-byte aligned when the object is in the arena.
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Validates a whole tensor object and points at its data.
    pub fn parse(object: &'a [u8]) -> Result<TensorView<'a>, TensorError> {
        let header = TensorHeader::decode(object)?;
        let data = &object[header.data_offset() as usize..];
        Ok(TensorView { header, data })
    }
}

fn data_offset(ndim: usize) -> u64 {
    ((FIXED_HEADER + 8 * ndim) as u64).div_ceil(ALIGNMENT) * ALIGNMENT
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_tensor_round_trips_with_aligned_data_and_row_major_strides() {
        let header = TensorHeader::new(DType::F32, vec![2, 3, 4]).unwrap();
        assert_eq!((header.byte_len(), header.data_offset()), (96, 64));
        assert_eq!(header.strides(), vec![12, 4, 1]);
        let data: Vec<u8> = (0..96).collect();
        let mut object = vec![0xff; header.object_size() as usize];
        header.write_object(&mut object, &data).unwrap();
        let view = TensorView::parse(&object).unwrap();
        assert_eq!(view.header, header);
        assert_eq!(view.data, &data[..]);
    }

    #[test]
    fn hostile_headers_are_errors() {
        let header = TensorHeader::new(DType::I64, vec![3]).unwrap();
        let mut object = vec![0; header.object_size() as usize];
        header.write_object(&mut object, &[0; 24]).unwrap();
        assert!(matches!(
            TensorView::parse(&object[..70]),
            Err(TensorError::ObjectSizeMismatch { .. })
        ));
        let mut bad = object.clone();
        bad[4] = 99;
        assert_eq!(TensorView::parse(&bad), Err(TensorError::UnknownDType(99)));
        let mut bad = object.clone();
        bad[8] = 25;
        assert!(matches!(TensorView::parse(&bad), Err(TensorError::ByteLenMismatch { .. })));
        let mut bad = object.clone();
        bad[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(TensorView::parse(&bad), Err(TensorError::SizeOverflow { .. })));
        assert!(TensorHeader::new(DType::U8, vec![1; 17]).is_err());
        let empty = TensorHeader::new(DType::U8, vec![0, 1 << 40, 1 << 40, 1 << 40]).unwrap();
        assert_eq!(empty.byte_len(), 0);
        assert_eq!(empty.strides()[0], u64::MAX);
        assert!(matches!(TensorView::parse(b"RTT"), Err(TensorError::TooShort { .. })));
    }

    fn dtype() -> impl Strategy<Value = DType> {
        prop::sample::select(DType::ALL.to_vec())
    }

    proptest! {
        #[test]
        fn any_valid_tensor_round_trips(dtype in dtype(), shape in prop::collection::vec(0u64..6, 0..5)) {
            let header = TensorHeader::new(dtype, shape).unwrap();
            let data: Vec<u8> = (0..header.byte_len()).map(|i| i as u8).collect();
            let mut object = vec![0; header.object_size() as usize];
            header.write_object(&mut object, &data).unwrap();
            prop_assert_eq!(header.data_offset() % ALIGNMENT, 0);
            let view = TensorView::parse(&object).unwrap();
            prop_assert_eq!(view.header, header);
            prop_assert_eq!(view.data, &data[..]);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300), magic in any::<bool>()) {
            let mut bytes = bytes;
            if magic && bytes.len() >= 4 {
                bytes[..4].copy_from_slice(&MAGIC);
            }
            let _ = TensorView::parse(&bytes);
        }
    }
}
