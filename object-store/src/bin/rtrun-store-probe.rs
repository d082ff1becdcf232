//! A small worker-side probe of the object store: attaches to the arena named in
//! `RTRUN_OBJECT_ARENA` and reads or writes allocations on command, one command per stdin line.
//! The integration tests use it as a real second process; it is also handy to inspect a live
//! node's arena by hand.
//!
//! Commands (answers on stdout, one line each):
//! - `check OFFSET SIZE SEED`: compares every byte with the test pattern; `ok` or `mismatch AT`.
//! - `write OFFSET SIZE SEED`: fills the range with the test pattern; `ok`.
//! - `sum OFFSET SIZE`: FNV-1a hash of the bytes, as `sum HEX`.
//! - `hold OFFSET SIZE`: keeps a view of the range open until exit; `held`.
//! - `exit`.

use std::io::{BufRead, Write};
use std::sync::Arc;

use rtrun_object_store::{Allocation, Arena, ObjectId, ObjectView};

fn main() {
    if let Err(error) = run() {
        eprintln!("rtrun-store-probe: {error}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let arena = Arc::new(Arena::attach_from_env()?.ok_or("RTRUN_OBJECT_ARENA is not set")?);
    let mut held = Vec::new();
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |index: usize| -> Result<u64, Box<dyn std::error::Error>> {
            Ok(words.get(index).ok_or("missing argument")?.parse::<u64>()?)
        };
        let reply = match words.first().copied() {
            Some("check") => {
                let bytes = arena.bytes(Allocation { offset: number(1)?, size: number(2)? })?;
                let seed = number(3)?;
                match (0..bytes.len()).find(|&i| bytes[i] != pattern_byte(seed, i as u64)) {
                    None => "ok".to_owned(),
                    Some(at) => format!("mismatch {at}"),
                }
            }
            Some("write") => {
                let mut writer =
                    arena.writer(Allocation { offset: number(1)?, size: number(2)? })?;
                let seed = number(3)?;
                for (i, byte) in writer.iter_mut().enumerate() {
                    *byte = pattern_byte(seed, i as u64);
                }
                "ok".to_owned()
            }
            Some("sum") => {
                let bytes = arena.bytes(Allocation { offset: number(1)?, size: number(2)? })?;
                format!("sum {:016x}", fnv1a(bytes))
            }
            Some("hold") => {
                let allocation = Allocation { offset: number(1)?, size: number(2)? };
                held.push(ObjectView::new(arena.clone(), ObjectId(0), allocation, None)?);
                "held".to_owned()
            }
            Some("exit") => return Ok(()),
            _ => format!("error unknown command `{line}`"),
        };
        let mut out = stdout.lock();
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}

/// The test pattern: position-dependent so misplaced bytes are caught, seed-dependent so objects
/// differ from each other.
fn pattern_byte(seed: u64, i: u64) -> u8 {
    ((i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
