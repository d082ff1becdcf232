//! The node's shared-memory arena: one memfd per node, mapped by the node process and every
//! worker on the node.
//!
//! The node creates it ([`Arena::create`]); a worker attaches to the fd it inherited
//! ([`Arena::attach`], or [`Arena::attach_from_env`] with the [`ARENA_ENV`] variable the runtime
//! sets). Why memfd and not a file in /dev/shm: nothing is left behind when processes are
//! SIGKILLed (the kernel frees the memory with the last fd or mapping), and /dev/shm's mount size
//! does not apply. Why no SIGBUS: every page is allocated at creation (fallocate) and the memfd
//! is sealed against shrinking, so touching any byte of the mapping always finds a page.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::alloc::{ALIGNMENT, Allocation};
use crate::config::{MIN_CAPACITY, available_memory};
use crate::error::{Result, StoreError};
use crate::shm::{self, Mapping, WriteGuard};

/// Environment variable through which a worker learns the inherited arena: `"<fd>:<capacity>"`.
pub const ARENA_ENV: &str = "RTRUN_OBJECT_ARENA";

/// What backs the arena's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArenaBacking {
    /// An anonymous memfd (the normal case).
    Memfd,
    /// An unlinked file on disk, used when memfd is unavailable; much slower under memory
    /// pressure, but never SIGBUS.
    DiskFile(PathBuf),
}

/// How [`Arena::create_with`] sets up the memory.
#[derive(Debug, Clone)]
pub struct ArenaOptions {
    /// Allocate every page up front (see [`crate::StoreConfig::reserve`]).
    pub reserve: bool,
    /// Fault every page into this process up front (see [`crate::StoreConfig::prefault`]).
    pub prefault: bool,
    /// Halve the capacity on reservation failure, down to [`MIN_CAPACITY`].
    pub shrink_on_reserve_failure: bool,
    /// Directory for the disk-file fallback when memfd is unavailable.
    pub fallback_dir: PathBuf,
    /// Use the disk-file backing even when memfd works (for tests of the fallback, or hosts
    /// where shared memory must not count against a small cgroup limit). Default: false.
    pub force_disk_file: bool,
}

/// A mapped arena. Dropping it unmaps this process's view; the memory lives on while any
/// process still maps it or holds its fd.
pub struct Arena {
    file: File,
    mapping: Mapping,
    capacity: u64,
    backing: ArenaBacking,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("fd", &self.file.as_raw_fd())
            .field("capacity", &self.capacity)
            .field("backing", &self.backing)
            .finish()
    }
}

impl Arena {
    /// Creates a reserved memfd arena of exactly `capacity` bytes (rounded down to 64); fails if
    /// the memory cannot be reserved.
    pub fn create(capacity: u64) -> Result<Arena> {
        Arena::create_with(
            capacity,
            &ArenaOptions {
                reserve: true,
                prefault: false,
                shrink_on_reserve_failure: false,
                fallback_dir: std::env::temp_dir(),
                force_disk_file: false,
            },
        )
    }

    /// Creates an arena with explicit options (fallbacks included).
    pub fn create_with(capacity: u64, options: &ArenaOptions) -> Result<Arena> {
        let mut capacity = capacity / ALIGNMENT * ALIGNMENT;
        if capacity == 0 {
            return Err(StoreError::Config(format!(
                "arena capacity must be at least {ALIGNMENT} bytes, found {capacity}"
            )));
        }
        let memfd = if options.force_disk_file {
            Ok(None)
        } else {
            shm::create_memfd(c"rtrun-object-arena")
        };
        let (file, backing) = match memfd {
            Ok(Some(file)) => (file, ArenaBacking::Memfd),
            Ok(None) => {
                let (file, path) = unlinked_disk_file(&options.fallback_dir)?;
                tracing::warn!(path = %path.display(), "memfd_create is unavailable; the object arena falls back to a disk file");
                (file, ArenaBacking::DiskFile(path))
            }
            Err(source) => return Err(arena_error("memfd_create", source)),
        };
        loop {
            file.set_len(capacity).map_err(|e| arena_error("size the arena", e))?;
            if !options.reserve {
                break;
            }
            // fallocate on an unbounded memfd would take pages until the OOM killer steps in,
            // so a capacity beyond what is available is refused before touching any page.
            let memory = (backing == ArenaBacking::Memfd).then(available_memory).flatten();
            let result = match memory {
                Some(available) if capacity > available => Err(std::io::Error::new(
                    std::io::ErrorKind::OutOfMemory,
                    format!("only {available} bytes of memory are available"),
                )),
                _ => shm::reserve(&file, capacity),
            };
            match result {
                Ok(()) => break,
                Err(source)
                    if options.shrink_on_reserve_failure && capacity / 2 >= MIN_CAPACITY =>
                {
                    tracing::warn!(capacity, error = %source, "cannot reserve the object arena; halving its capacity");
                    capacity = capacity / 2 / ALIGNMENT * ALIGNMENT;
                }
                Err(source) => {
                    return Err(arena_error(
                        &format!("reserve {capacity} bytes of memory"),
                        source,
                    ));
                }
            }
        }
        if backing == ArenaBacking::Memfd {
            shm::seal_size(&file).map_err(|e| arena_error("seal the arena size", e))?;
        }
        let mapping = Mapping::map(&file, capacity, options.prefault)
            .map_err(|e| arena_error("map the arena", e))?;
        Ok(Arena { file, mapping, capacity, backing })
    }

    /// Attaches to an arena whose fd this process inherited. The fd is duplicated (the
    /// inherited number is left as is); a closed fd or a file smaller than `capacity` is an
    /// error, never a later SIGBUS.
    pub fn attach(fd: RawFd, capacity: u64) -> Result<Arena> {
        Arena::attach_with(fd, capacity, false)
    }

    /// Like [`Arena::attach`]; `prefault` maps every page into this process now (MAP_POPULATE),
    /// so a worker that will write large objects does not pay a page fault per 4 KiB on its
    /// first puts (measured: ~0.3 GB/s cold vs ~10 GB/s warm for an 800 MB put).
    pub fn attach_with(fd: RawFd, capacity: u64, prefault: bool) -> Result<Arena> {
        let file =
            shm::duplicate_inherited(fd).map_err(|e| arena_error(&format!("attach fd {fd}"), e))?;
        let len = file.metadata().map_err(|e| arena_error("stat the arena", e))?.len();
        if capacity == 0 || len < capacity {
            return Err(StoreError::Config(format!(
                "arena fd {fd} holds {len} bytes, expected at least the announced capacity {capacity} (and more than 0)"
            )));
        }
        let backing = if shm::is_shared_memory(&file) {
            ArenaBacking::Memfd
        } else {
            let link = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()));
            ArenaBacking::DiskFile(link.unwrap_or_default())
        };
        let mapping =
            Mapping::map(&file, capacity, prefault).map_err(|e| arena_error("map the arena", e))?;
        Ok(Arena { file, mapping, capacity, backing })
    }

    /// Attaches to the arena announced in [`ARENA_ENV`]; `Ok(None)` when the variable is unset.
    pub fn attach_from_env() -> Result<Option<Arena>> {
        let Ok(value) = std::env::var(ARENA_ENV) else {
            return Ok(None);
        };
        let (fd, capacity) = parse_env_value(&value)?;
        Arena::attach(fd, capacity).map(Some)
    }

    /// The value of [`ARENA_ENV`] that lets a spawned process attach to this arena (after
    /// [`Arena::set_inheritable`]).
    pub fn env_value(&self) -> String {
        format!("{}:{}", self.fd(), self.capacity)
    }

    /// The fd of the arena in this process.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// The arena's size in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// What backs the memory.
    pub fn backing(&self) -> &ArenaBacking {
        &self.backing
    }

    /// Lets the fd survive `exec` (true) so spawned workers inherit it, or not (false, the
    /// default). The flag is per process and affects every process spawned while it is set.
    pub fn set_inheritable(&self, inheritable: bool) -> Result<()> {
        shm::set_inheritable(&self.file, inheritable)
            .map_err(|e| arena_error("set the arena fd's close-on-exec flag", e))
    }

    /// The bytes of an allocation (its `size`, not the reserved padding). Refused while a writer
    /// in this process writes an overlapping range. The store's pin protocol keeps other
    /// processes from reusing the range while a reader holds it.
    pub fn bytes(&self, allocation: Allocation) -> Result<&[u8]> {
        Ok(self.mapping.read(allocation.offset, allocation.size)?)
    }

    /// Exclusive write access to a freshly created allocation, until the writer drops.
    pub fn writer(&self, allocation: Allocation) -> Result<ObjectWriter<'_>> {
        Ok(ObjectWriter { guard: self.mapping.write(allocation.offset, allocation.size)? })
    }

    pub(crate) fn mapping(&self) -> &Mapping {
        &self.mapping
    }
}

/// Parses `"<fd>:<capacity>"`.
pub fn parse_env_value(value: &str) -> Result<(RawFd, u64)> {
    let parsed = value.split_once(':').and_then(|(fd, capacity)| {
        Some((fd.parse::<RawFd>().ok()?, capacity.parse::<u64>().ok()?))
    });
    parsed.ok_or_else(|| {
        StoreError::Config(format!("{ARENA_ENV} must be `<fd>:<capacity>`, found `{value}`"))
    })
}

/// Mutable access to one allocation's bytes in the arena; see [`Arena::writer`].
pub struct ObjectWriter<'a> {
    guard: WriteGuard<'a>,
}

impl std::ops::Deref for ObjectWriter<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.guard
    }
}

impl std::ops::DerefMut for ObjectWriter<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.guard
    }
}

fn arena_error(context: &str, source: std::io::Error) -> StoreError {
    StoreError::Arena { context: context.to_owned(), source }
}

/// A fresh file in `dir`, unlinked right away so it disappears with the last fd.
fn unlinked_disk_file(dir: &Path) -> Result<(File, PathBuf)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(dir).map_err(|e| {
        arena_error(&format!("create the fallback arena directory {}", dir.display()), e)
    })?;
    let path = dir.join(format!(
        "rtrun-arena-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let file =
        std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).map_err(
            |e| arena_error(&format!("create fallback arena file {}", path.display()), e),
        )?;
    std::fs::remove_file(&path).map_err(|e| arena_error("unlink the fallback arena file", e))?;
    Ok((file, path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_mapping_sees_what_the_first_wrote() {
        let arena = Arena::create(1 << 20).unwrap();
        let allocation = Allocation { offset: 4096, size: 1000 };
        arena.writer(allocation).unwrap().copy_from_slice(&[42; 1000]);
        let other = Arena::attach(arena.fd(), arena.capacity()).unwrap();
        assert_eq!(other.bytes(allocation).unwrap(), &[42; 1000][..]);
        assert_eq!(other.backing(), &ArenaBacking::Memfd);
    }

    #[test]
    fn the_disk_file_fallback_works_and_leaves_no_file_behind() {
        let dir = std::env::temp_dir().join(format!("rtrun-arena-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let options = ArenaOptions {
            reserve: true,
            prefault: false,
            shrink_on_reserve_failure: false,
            fallback_dir: dir.clone(),
            force_disk_file: true,
        };
        let arena = Arena::create_with(1 << 20, &options).unwrap();
        assert!(matches!(arena.backing(), ArenaBacking::DiskFile(_)));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "the file is unlinked");
        let allocation = Allocation { offset: 64, size: 3 };
        arena.writer(allocation).unwrap().copy_from_slice(b"abc");
        let other = Arena::attach(arena.fd(), arena.capacity()).unwrap();
        assert!(matches!(other.backing(), ArenaBacking::DiskFile(_)));
        assert_eq!(other.bytes(allocation).unwrap(), b"abc");
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn attach_refuses_a_capacity_larger_than_the_file_and_bad_env_values() {
        let arena = Arena::create(1 << 20).unwrap();
        assert!(Arena::attach(arena.fd(), 2 << 20).is_err());
        assert!(Arena::attach(arena.fd(), 0).is_err());
        assert!(parse_env_value("12").is_err());
        assert!(parse_env_value("x:1").is_err());
        assert_eq!(parse_env_value(&arena.env_value()).unwrap(), (arena.fd(), 1 << 20));
    }

    #[test]
    fn a_reservation_beyond_available_memory_is_an_error_not_an_oom() {
        let huge = 1u64 << 40;
        assert!(Arena::create(huge).is_err());
        // Without reservation a huge arena is only address space (what tests of huge capacities
        // use); shrinking is not exercised here because it would reserve most of this machine.
        let options = ArenaOptions {
            reserve: false,
            prefault: false,
            shrink_on_reserve_failure: false,
            fallback_dir: std::env::temp_dir(),
            force_disk_file: false,
        };
        let arena = Arena::create_with(huge, &options).unwrap();
        assert_eq!(arena.capacity(), huge);
        let far = Allocation { offset: huge - 4096, size: 4096 };
        arena.writer(far).unwrap().fill(1);
        assert_eq!(arena.bytes(far).unwrap()[4095], 1);
    }
}
