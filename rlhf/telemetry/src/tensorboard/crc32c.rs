//! CRC-32C (Castagnoli) and the "masked" form TFRecord stores, computed with a 256-entry table
//! built at compile time (no SIMD: event files are tiny, a few hundred bytes per step).

/// The reflected Castagnoli polynomial.
const POLYNOMIAL: u32 = 0x82F6_3B78;

/// The constant TFRecord adds after rotating, so a CRC of data that itself holds CRCs does not
/// degenerate.
const MASK_DELTA: u32 = 0xA282_EAD8;

const TABLE: [u32; 256] = build_table();

const fn build_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut byte = 0;
    while byte < 256 {
        let mut crc = byte as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ POLYNOMIAL } else { crc >> 1 };
            bit += 1;
        }
        table[byte] = crc;
        byte += 1;
    }
    table
}

/// The CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc = TABLE[((crc ^ u32::from(byte)) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The masked CRC-32C that TFRecord framing stores: rotated right by 15 bits plus a constant.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(MASK_DELTA)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_published_check_values() {
        // The standard check value of CRC-32C (RFC 3720 appendix B.4 test vectors).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn mask_rotates_and_offsets() {
        // crc32c("abc") = 0x364B3FB7; rotated right by 15 and offset, computed independently.
        assert_eq!(crc32c(b"abc"), 0x364B_3FB7);
        assert_eq!(masked_crc32c(b"abc"), 0x21F1_576E);
    }
}
