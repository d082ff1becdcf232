//! The only module of the crate with `unsafe`: creating and reserving the memfd that backs the
//! arena, mapping it, and handing out slices of the mapping.
//!
//! Aliasing rule inside one process: every mutable slice comes from a [`WriteGuard`] and every
//! long-lived shared slice from a registered view lease; a registry refuses a writer that
//! overlaps another writer or a lease, and refuses reads of a range that a writer holds. Across
//! processes the store's protocol (write only between create and seal, never reuse a pinned
//! allocation) keeps writers and readers apart; the mapping itself always stays valid because the
//! file is reserved up front and sealed against shrinking, so no access can raise SIGBUS.

#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

use parking_lot::Mutex;

/// Why a range of the mapping cannot be handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    /// The range does not lie inside the mapping.
    #[error("range {offset}+{len} is outside the arena of {capacity} bytes")]
    OutOfBounds {
        /// First byte of the requested range.
        offset: u64,
        /// Length of the requested range.
        len: u64,
        /// Size of the mapping.
        capacity: u64,
    },
    /// A writer in this process holds an overlapping range.
    #[error("range {offset}+{len} overlaps a range being written in this process")]
    BeingWritten {
        /// First byte of the requested range.
        offset: u64,
        /// Length of the requested range.
        len: u64,
    },
    /// A view in this process reads an overlapping range, so it cannot be written.
    #[error("range {offset}+{len} overlaps a range that a view in this process reads")]
    BeingRead {
        /// First byte of the requested range.
        offset: u64,
        /// Length of the requested range.
        len: u64,
    },
}

/// Creates an anonymous memory file (close-on-exec, sealable). Returns `None` when the kernel
/// has no `memfd_create` (or a sandbox forbids it), so the caller can fall back to a disk file.
pub(crate) fn create_memfd(name: &CStr) -> io::Result<Option<File>> {
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call; the flags are
    // plain constants and the call has no other memory effects.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ENOSYS) | Some(libc::EPERM) | Some(libc::EINVAL) => Ok(None),
            _ => Err(err),
        };
    }
    // SAFETY: `fd` was just returned by `memfd_create`, is open, and nothing else owns it.
    Ok(Some(File::from(unsafe { OwnedFd::from_raw_fd(fd) })))
}

/// Allocates every page of `file` up to `len` now, so later first touches cannot fail with
/// SIGBUS when memory runs short: the shortage shows up here as an error instead.
pub(crate) fn reserve(file: &File, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: plain syscall on an fd we own; no memory is passed.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Seals a memfd against shrinking, growing and further sealing, so no process can truncate
/// the arena under another process's mapping (which would raise SIGBUS there).
pub(crate) fn seal_size(file: &File) -> io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: plain fcntl on an fd we own; no memory is passed.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `file` is shared memory (a memfd or tmpfs file, which support seals) rather than a
/// file on disk.
pub(crate) fn is_shared_memory(file: &File) -> bool {
    // SAFETY: plain fcntl on an fd we own; no memory is passed. Disk files answer EINVAL.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) >= 0 }
}

/// Makes `file` survive (or not) an `exec`, so a spawned worker inherits the arena's fd.
pub(crate) fn set_inheritable(file: &File, inheritable: bool) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: plain fcntl on an fd we own; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = if inheritable { flags & !libc::FD_CLOEXEC } else { flags | libc::FD_CLOEXEC };
    // SAFETY: as above.
    let rc = unsafe { libc::fcntl(fd, libc::F_SETFD, flags) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Opens our own close-on-exec duplicate of an inherited fd number. The number itself came from
/// the environment and may be anything: a closed number gives an error, never a double close.
pub(crate) fn duplicate_inherited(fd: RawFd) -> io::Result<File> {
    // SAFETY: F_DUPFD_CLOEXEC only reads the descriptor table; on a closed fd it fails with
    // EBADF. The original fd stays owned by whoever owns it (usually nobody: it was inherited).
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `dup` is a fresh descriptor that nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(dup) }))
}

/// A shared, read-write mapping of a whole arena file, with the in-process registry that keeps
/// Rust's aliasing rules for the slices it hands out.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    registry: Mutex<Registry>,
}

// SAFETY: the mapping is plain shared memory with no thread affinity; all mutable access goes
// through `WriteGuard`s that the registry keeps exclusive, so sharing `&Mapping` across threads
// cannot create overlapping `&mut` slices.
unsafe impl Send for Mapping {}
// SAFETY: see `Send` above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` shared and read-write. `populate` faults every page in now
    /// (MAP_POPULATE) so the first writes into the arena do not pay page faults.
    pub(crate) fn map(file: &File, len: u64, populate: bool) -> io::Result<Mapping> {
        let len = usize::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "cannot map an empty arena"));
        }
        let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
        // SAFETY: a fresh mapping at a kernel-chosen address; it aliases no Rust object. The
        // caller has checked that the file is at least `len` bytes long and sealed or reserved.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(Mapping { ptr, len, registry: Mutex::new(Registry::default()) })
    }

    fn check_bounds(&self, offset: u64, len: u64) -> Result<(), RangeError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(RangeError::OutOfBounds { offset, len, capacity: self.len as u64 }),
        }
    }

    /// A shared slice of `offset..offset+len`, refused while a writer in this process holds an
    /// overlapping range.
    pub(crate) fn read(&self, offset: u64, len: u64) -> Result<&[u8], RangeError> {
        self.check_bounds(offset, len)?;
        if self.registry.lock().overlaps_writer(offset, len) {
            return Err(RangeError::BeingWritten { offset, len });
        }
        Ok(self.slice(offset, len))
    }

    /// Registers a long-lived reader of exactly `offset..offset+len` (an object view); writers
    /// of an overlapping range are refused until [`Mapping::end_lease`].
    pub(crate) fn lease(&self, offset: u64, len: u64) -> Result<(), RangeError> {
        self.check_bounds(offset, len)?;
        self.registry.lock().add_reader(offset, len)
    }

    /// A leased range's bytes. The caller holds a lease of exactly this range.
    pub(crate) fn leased(&self, offset: u64, len: u64) -> &[u8] {
        debug_assert!(self.registry.lock().has_reader(offset, len));
        self.slice(offset, len)
    }

    /// Ends one lease of `offset..offset+len`.
    pub(crate) fn end_lease(&self, offset: u64, len: u64) {
        self.registry.lock().remove_reader(offset, len);
    }

    /// Exclusive write access to `offset..offset+len` for as long as the guard lives.
    pub(crate) fn write(&self, offset: u64, len: u64) -> Result<WriteGuard<'_>, RangeError> {
        self.check_bounds(offset, len)?;
        self.registry.lock().add_writer(offset, len)?;
        Ok(WriteGuard { mapping: self, offset, len })
    }

    fn slice(&self, offset: u64, len: u64) -> &[u8] {
        // SAFETY: bounds were checked by every caller (offset + len <= self.len, both fit in
        // usize because self.len does); the registry guarantees no `&mut` to an overlapping
        // range exists in this process; the mapping lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), len as usize) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe exactly the mapping made in `map`; every slice handed out
        // borrows `self`, so none outlives this call.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "munmap of the object arena failed");
        }
    }
}

/// Exclusive, mutable access to one range of the mapping; dropping it lets readers in.
pub(crate) struct WriteGuard<'a> {
    mapping: &'a Mapping,
    offset: u64,
    len: u64,
}

impl Deref for WriteGuard<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.mapping.slice(self.offset, self.len)
    }
}

impl DerefMut for WriteGuard<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: bounds were checked in `Mapping::write`; the registry holds this range for
        // this guard alone (no other writer, no lease, and `read` refuses it), and the returned
        // borrow is tied to `&mut self`, so it is the only live reference to these bytes here.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.mapping.ptr.as_ptr().add(self.offset as usize),
                self.len as usize,
            )
        }
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.mapping.registry.lock().remove_writer(self.offset);
    }
}

/// Ranges currently written or leased in this process, pairwise disjoint (identical reader
/// ranges share one entry with a count).
#[derive(Default)]
struct Registry {
    ranges: BTreeMap<u64, RegistryEntry>,
}

struct RegistryEntry {
    len: u64,
    /// Zero for a writer, otherwise the number of leases of this exact range.
    readers: u32,
}

impl Registry {
    /// Entries overlapping `offset..offset+len` (entries are disjoint, so at most one starts
    /// before `offset`).
    fn overlapping(&self, offset: u64, len: u64) -> impl Iterator<Item = (&u64, &RegistryEntry)> {
        let end = offset.saturating_add(len.max(1));
        let before = self
            .ranges
            .range(..offset)
            .next_back()
            .filter(move |(start, entry)| *start + entry.len.max(1) > offset);
        before.into_iter().chain(self.ranges.range(offset..end))
    }

    fn overlaps_writer(&self, offset: u64, len: u64) -> bool {
        self.overlapping(offset, len).any(|(_, entry)| entry.readers == 0)
    }

    fn has_reader(&self, offset: u64, len: u64) -> bool {
        self.ranges.get(&offset).is_some_and(|entry| entry.len == len && entry.readers > 0)
    }

    fn add_reader(&mut self, offset: u64, len: u64) -> Result<(), RangeError> {
        if let Some(entry) = self.ranges.get_mut(&offset)
            && entry.len == len
            && entry.readers > 0
        {
            entry.readers += 1;
            return Ok(());
        }
        self.refuse_overlap(offset, len)?;
        self.ranges.insert(offset, RegistryEntry { len, readers: 1 });
        Ok(())
    }

    fn remove_reader(&mut self, offset: u64, len: u64) {
        if let Some(entry) = self.ranges.get_mut(&offset)
            && entry.len == len
            && entry.readers > 0
        {
            entry.readers -= 1;
            if entry.readers == 0 {
                self.ranges.remove(&offset);
            }
        }
    }

    fn refuse_overlap(&self, offset: u64, len: u64) -> Result<(), RangeError> {
        match self.overlapping(offset, len).next() {
            None => Ok(()),
            Some((_, entry)) if entry.readers == 0 => Err(RangeError::BeingWritten { offset, len }),
            Some(_) => Err(RangeError::BeingRead { offset, len }),
        }
    }

    fn add_writer(&mut self, offset: u64, len: u64) -> Result<(), RangeError> {
        self.refuse_overlap(offset, len)?;
        self.ranges.insert(offset, RegistryEntry { len, readers: 0 });
        Ok(())
    }

    fn remove_writer(&mut self, offset: u64) {
        if self.ranges.get(&offset).is_some_and(|entry| entry.readers == 0) {
            self.ranges.remove(&offset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(len: u64) -> (File, Mapping) {
        let file = create_memfd(c"rtrun-shm-test").unwrap().unwrap();
        file.set_len(len).unwrap();
        reserve(&file, len).unwrap();
        seal_size(&file).unwrap();
        let mapping = Mapping::map(&file, len, false).unwrap();
        (file, mapping)
    }

    #[test]
    fn writes_are_visible_to_reads_after_the_guard_drops() {
        let (_file, map) = mapping(4096);
        {
            let mut guard = map.write(64, 128).unwrap();
            guard.fill(7);
            assert_eq!(map.read(100, 8), Err(RangeError::BeingWritten { offset: 100, len: 8 }));
        }
        assert!(map.read(64, 128).unwrap().iter().all(|&b| b == 7));
    }

    #[test]
    fn leases_block_writers_and_writers_block_leases() {
        let (_file, map) = mapping(4096);
        map.lease(0, 64).unwrap();
        map.lease(0, 64).unwrap();
        assert!(matches!(map.write(32, 64), Err(RangeError::BeingRead { .. })));
        map.end_lease(0, 64);
        assert!(map.write(0, 64).is_err());
        map.end_lease(0, 64);
        let guard = map.write(0, 64).unwrap();
        assert!(matches!(map.lease(0, 64), Err(RangeError::BeingWritten { .. })));
        drop(guard);
        map.lease(0, 64).unwrap();
    }

    #[test]
    fn out_of_bounds_ranges_are_refused() {
        let (_file, map) = mapping(4096);
        assert!(matches!(map.read(4000, 100), Err(RangeError::OutOfBounds { .. })));
        assert!(matches!(map.read(u64::MAX, 2), Err(RangeError::OutOfBounds { .. })));
        assert!(matches!(map.write(4096, 1), Err(RangeError::OutOfBounds { .. })));
    }

    #[test]
    fn a_sealed_memfd_cannot_shrink() {
        let (file, _map) = mapping(4096);
        assert!(file.set_len(0).is_err());
    }

    #[test]
    fn a_closed_fd_number_is_an_error() {
        assert!(duplicate_inherited(-1).is_err());
    }

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Held {
        Reader(u64, u64),
        Writer(u64, u64),
    }

    fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
        a.0 < b.0 + b.1.max(1) && b.0 < a.0 + a.1.max(1)
    }

    proptest::proptest! {
        /// The registry agrees with a plain list model: writers exclude everything, leases
        /// exclude writers and differently shaped leases, reads are refused under writers.
        #[test]
        fn the_registry_matches_a_list_model(
            ops in proptest::collection::vec((0u8..5, 0u64..16, 0u64..6, proptest::prelude::any::<proptest::sample::Index>()), 0..200)
        ) {
            let mut registry = Registry::default();
            let mut held: Vec<Held> = Vec::new();
            for (kind, offset, len, pick) in ops {
                let range = (offset, len);
                match kind {
                    0 => {
                        let allowed = held.iter().all(|h| match *h {
                            Held::Reader(o, l) => (o, l) == range || !overlap((o, l), range),
                            Held::Writer(o, l) => !overlap((o, l), range),
                        });
                        proptest::prop_assert_eq!(registry.add_reader(offset, len).is_ok(), allowed);
                        if allowed {
                            held.push(Held::Reader(offset, len));
                        }
                    }
                    1 => {
                        let allowed = held.iter().all(|h| match *h {
                            Held::Reader(o, l) | Held::Writer(o, l) => !overlap((o, l), range),
                        });
                        proptest::prop_assert_eq!(registry.add_writer(offset, len).is_ok(), allowed);
                        if allowed {
                            held.push(Held::Writer(offset, len));
                        }
                    }
                    2 if !held.is_empty() => match held.swap_remove(pick.index(held.len())) {
                        Held::Reader(o, l) => registry.remove_reader(o, l),
                        Held::Writer(o, _) => registry.remove_writer(o),
                    },
                    _ => {
                        let blocked = held.iter().any(|h| matches!(*h, Held::Writer(o, l) if overlap((o, l), range)));
                        proptest::prop_assert_eq!(registry.overlaps_writer(offset, len), blocked);
                    }
                }
            }
        }
    }
}
