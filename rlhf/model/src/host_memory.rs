//! The process's host allocator, tuned for tensor workloads: freed blocks stay in the heap for
//! the next step instead of going back to the kernel.
//!
//! glibc serves blocks above a threshold (128 KiB, raised dynamically up to 32 MiB) with a fresh
//! `mmap` and unmaps them on free, and trims the heap top above another. A decode or training
//! step allocates and frees the same multi-megabyte activations every step, so each step's
//! first touch of them page-faults again: the 27M model's decode step at batch 64 took 430k
//! page faults per benchmark run, and ran ~10% faster with 115k. PyTorch's CPU tuning guides
//! reach for jemalloc or tcmalloc for the same reason; libtorch allocates through libc, so the
//! knob within reach is `mallopt`.

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use std::sync::OnceLock;

/// Serves blocks of up to this many bytes from the heap.
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Returns the heap's free top to the kernel only above this many bytes.
const TRIM_THRESHOLD: i32 = 1 << 30;

/// Keeps freed tensor memory in the process's heap (once per process; a no-op on other C
/// libraries than glibc). Returns whether glibc took both settings.
pub fn keep_freed_memory() -> bool {
    static TAKEN: OnceLock<bool> = OnceLock::new();
    *TAKEN.get_or_init(tune)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune() -> bool {
    // SAFETY: `mallopt` only sets allocator parameters; glibc serialises it with the arenas'
    // locks, and both values are within the ranges glibc accepts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune() -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn glibc_takes_the_settings_and_a_second_call_is_a_no_op() {
        let expected = cfg!(all(target_os = "linux", target_env = "gnu"));
        assert_eq!(super::keep_freed_memory(), expected);
        assert_eq!(super::keep_freed_memory(), expected);
    }
}
