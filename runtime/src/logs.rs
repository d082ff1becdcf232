//! Worker and job output. A spawned process writes its stdout and stderr into pipes; a thread
//! per pipe reads them line by line and either writes them to the process's log file, which
//! rotates by size (as Ray's `RAY_ROTATION_MAX_BYTES` / `RAY_ROTATION_BACKUP_COUNT`), or, in an
//! embedded session, prints them on the driver's own stdout/stderr prefixed with the worker's
//! actor type and pid, as Ray does (`(Counter pid=4242) …`). Nodes serve their log files to
//! `rtrun logs` and to cluster drivers ([`read_chunk`], [`list`]).

#![allow(unsafe_code)] // On ARCHITECTURE.md's `unsafe` allow-list.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Bytes a log file reaches before it is rotated (`RTRUN_LOG_ROTATION_MAX_BYTES`).
pub const ROTATION_MAX_BYTES_ENV: &str = "RTRUN_LOG_ROTATION_MAX_BYTES";
/// Rotated files kept (`file.1` newest … `file.N`; `RTRUN_LOG_ROTATION_BACKUP_COUNT`).
pub const ROTATION_BACKUP_COUNT_ENV: &str = "RTRUN_LOG_ROTATION_BACKUP_COUNT";
/// Ray's defaults: 512 MiB, 5 backups.
const DEFAULT_MAX_BYTES: u64 = 512 << 20;
const DEFAULT_BACKUPS: usize = 5;
/// The longest line passed on whole; longer ones are split.
const MAX_LINE: u64 = 64 << 10;
/// The most bytes one read of a log returns.
pub const MAX_CHUNK: u64 = 1 << 20;

/// How logs rotate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    /// Size at which the file is rotated.
    pub max_bytes: u64,
    /// Rotated files kept.
    pub backups: usize,
}

impl Rotation {
    /// From the environment (the node daemon's), else Ray's defaults; a malformed value is
    /// reported once and the default used.
    pub fn from_env() -> Rotation {
        fn read<T: std::str::FromStr>(name: &str, default: T) -> T {
            match std::env::var(name) {
                Ok(text) => text.trim().parse().unwrap_or_else(|_| {
                    tracing::warn!("{name}={text} is not a number; using the default");
                    default
                }),
                Err(_) => default,
            }
        }
        Rotation {
            max_bytes: read(ROTATION_MAX_BYTES_ENV, DEFAULT_MAX_BYTES).max(1),
            backups: read(ROTATION_BACKUP_COUNT_ENV, DEFAULT_BACKUPS),
        }
    }
}

/// A log file that rotates by size: `path` is the newest, `path.1` the one before, and so on.
pub struct RotatingLog {
    path: PathBuf,
    file: File,
    written: u64,
    rotation: Rotation,
}

impl RotatingLog {
    /// Opens (appends to) the log at `path`.
    pub fn open(path: &Path, rotation: Rotation) -> Result<RotatingLog> {
        let file = open_append(path)?;
        let written = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(RotatingLog { path: path.to_owned(), file, written, rotation })
    }

    /// Appends `bytes` (whole lines), rotating first when they would pass the limit.
    pub fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.written > 0 && self.written + bytes.len() as u64 > self.rotation.max_bytes {
            self.rotate()?;
        }
        self.file.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let numbered = |i: usize| {
            let mut name = self.path.clone().into_os_string();
            name.push(format!(".{i}"));
            PathBuf::from(name)
        };
        if self.rotation.backups == 0 {
            self.file.set_len(0)?;
        } else {
            let _ = std::fs::remove_file(numbered(self.rotation.backups));
            for i in (1..self.rotation.backups).rev() {
                let _ = std::fs::rename(numbered(i), numbered(i + 1));
            }
            std::fs::rename(&self.path, numbered(1))?;
            self.file = std::fs::OpenOptions::new().create(true).append(true).open(&self.path)?;
        }
        self.written = 0;
        Ok(())
    }
}

fn open_append(path: &Path) -> Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::System(format!("cannot open log {}: {e}", path.display())))
}

/// Where a pump's lines go.
pub(crate) enum Sink {
    /// A rotating log file (shared by the process's stdout and stderr pumps).
    File(Arc<Mutex<RotatingLog>>),
    /// This process's stdout (`false`) or stderr (`true`), each line prefixed by `label()`.
    Echo { stderr: bool, label: Arc<dyn Fn() -> String + Send + Sync> },
}

/// Read ends of the pipes echoed on this process's terminal (for [`drain_echoes`]).
static ECHO_PIPES: Mutex<Vec<std::os::fd::RawFd>> = Mutex::new(Vec::new());
/// Lines echoed so far.
static ECHOED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// At exit of a driver that echoes its workers' output: waits (at most 500 ms) until what
/// they wrote before it is printed, so that the last lines are not lost with the process.
extern "C" fn drain_echoes() {
    use std::sync::atomic::Ordering;
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(500);
    while std::time::Instant::now() < deadline {
        let before = ECHOED.load(Ordering::Acquire);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let unread = ECHO_PIPES.lock().iter().any(|&fd| {
            let mut pending: libc::c_int = 0;
            // SAFETY: FIONREAD writes one c_int; `fd` is open while listed (pumps unlist it
            // under this lock before closing it).
            unsafe { libc::ioctl(fd, libc::FIONREAD, &mut pending) == 0 && pending > 0 }
        });
        if !unread && ECHOED.load(Ordering::Acquire) == before {
            return;
        }
    }
}

/// Starts a thread that moves `reader`'s lines to `sink` until the writer closes.
pub(crate) fn pump(name: String, reader: std::io::PipeReader, sink: Sink) {
    use std::os::fd::AsRawFd;
    let echoed = matches!(sink, Sink::Echo { .. });
    if echoed {
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        // SAFETY: `atexit` registers a plain `extern "C"` function with no preconditions.
        AT_EXIT.call_once(|| unsafe {
            libc::atexit(drain_echoes);
        });
        ECHO_PIPES.lock().push(reader.as_raw_fd());
    }
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        let fd = reader.as_raw_fd();
        let mut reader = BufReader::with_capacity(64 << 10, reader);
        pump_lines(&mut reader, &sink);
        if echoed {
            // Unlisted before the descriptor closes (with `reader`), under the lock.
            let mut pipes = ECHO_PIPES.lock();
            pipes.retain(|&p| p != fd);
            drop(reader);
        }
    });
    if let Err(e) = spawned {
        tracing::error!("cannot start a log thread: {e}");
    }
}

/// Moves lines from `reader` to `sink` until the end of the input.
fn pump_lines(reader: &mut BufReader<std::io::PipeReader>, sink: &Sink) {
    {
        let mut line = Vec::with_capacity(1024);
        loop {
            line.clear();
            match reader.take(MAX_LINE).read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let written = match sink {
                Sink::File(log) => log.lock().write(&line),
                Sink::Echo { stderr, label } => {
                    let mut text = format!("({}) ", label()).into_bytes();
                    text.extend_from_slice(&line);
                    if !text.ends_with(b"\n") {
                        text.push(b'\n');
                    }
                    let written = write_fd(if *stderr { 2 } else { 1 }, &text);
                    ECHOED.fetch_add(1, std::sync::atomic::Ordering::Release);
                    written
                }
            };
            if let Err(e) = written {
                tracing::debug!("dropping worker output: {e}");
            }
        }
    }
}

/// Writes `bytes` to this process's file descriptor `fd` (1 or 2) directly, not through
/// `std::io::stdout()`: a driver may hold that lock for its whole run (`stdout().lock()` in
/// `main`), which would stall its workers' output. One `write` per line keeps lines whole.
fn write_fd(fd: std::os::fd::RawFd, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::fd::FromRawFd;
    // SAFETY: descriptors 1 and 2 stay open for the life of the process; `ManuallyDrop` keeps
    // this `File` from closing the one it borrows.
    let mut file = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    file.write_all(bytes)
}

/// Lets SIGPIPE end this process, as it ends other Unix tools: a command whose output is piped
/// into `head` or `grep -m1` then stops quietly when the reader leaves (Rust ignores SIGPIPE,
/// so `println!` would panic on the closed pipe). For the CLI's clients, never for a daemon: a
/// closed stdout must not stop a head or a node. Call it before any thread starts.
pub fn exit_on_closed_stdout() {
    // SAFETY: restores a signal's default disposition; no handler runs, no memory is shared.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Whether `name` is a log file a node serves (`worker-N.log`, `job-N.log`, or one of their
/// rotated copies `….log.K`): no paths, nothing else in the directory.
pub fn valid_name(name: &str) -> bool {
    let base = match name.rsplit_once(".log.") {
        Some((base, k)) if !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) => base,
        _ => match name.strip_suffix(".log") {
            Some(base) => base,
            None => return false,
        },
    };
    let number = base.strip_prefix("worker-").or_else(|| base.strip_prefix("job-"));
    number.is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Up to [`MAX_CHUNK`] bytes of the log `name` in `dir` from `offset`, the file's size now and
/// its inode (which follows the file through rotations: `worker-3.log` becomes
/// `worker-3.log.1` with the same inode).
pub fn read_chunk(dir: &Path, name: &str, offset: u64) -> Result<(Vec<u8>, u64, u64)> {
    if !valid_name(name) {
        return Err(Error::Invalid(format!(
            "`{name}` is not a log name (worker-N.log or job-N.log, optionally .K)"
        )));
    }
    let path = dir.join(name);
    let mut file = File::open(&path)
        .map_err(|e| Error::Invalid(format!("no log {name} on this node ({e})")))?;
    use std::os::unix::fs::MetadataExt;
    let (size, inode) = file.metadata().map(|m| (m.len(), m.ino())).unwrap_or((0, 0));
    if offset >= size {
        return Ok((Vec::new(), size, inode));
    }
    use std::io::Seek;
    file.seek(std::io::SeekFrom::Start(offset))
        .map_err(|e| Error::System(format!("reading {}: {e}", path.display())))?;
    let mut bytes = Vec::new();
    file.take(MAX_CHUNK)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::System(format!("reading {}: {e}", path.display())))?;
    Ok((bytes, size, inode))
}

/// A node's answer to [`NodeRequest::ReadLog`](NodeRequest::ReadLog) or `ListLogs`
/// from its log directory `dir` (the head's node and node daemons alike).
pub(crate) fn answer(
    dir: &Path,
    request: &crate::protocol::NodeRequest,
) -> crate::protocol::Response {
    use crate::protocol::{NodeRequest, Response};
    let answer = match request {
        NodeRequest::ReadLog { file, offset } => read_chunk(dir, file, *offset)
            .map(|(bytes, size, inode)| Response::LogChunk { bytes, size, inode }),
        NodeRequest::ListLogs => list(dir).map(Response::LogFiles),
        other => Err(Error::Invalid(format!("not a log request: {other:?}"))),
    };
    answer.unwrap_or_else(Response::Error)
}

/// The log files in `dir` with their sizes, by name.
pub fn list(dir: &Path) -> Result<Vec<(String, u64)>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::System(format!("cannot list {}: {e}", dir.display())))?;
    let mut files: Vec<(String, u64)> = entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let name = entry.file_name().into_string().ok()?;
            let size = entry.metadata().ok()?.len();
            valid_name(&name).then_some((name, size))
        })
        .collect();
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_rotate_by_size_keeping_the_newest_backups() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("worker-7.log");
        let mut log = RotatingLog::open(&path, Rotation { max_bytes: 100, backups: 2 }).unwrap();
        for i in 0..20 {
            log.write(format!("line {i:03} of forty bytes, more or less...\n").as_bytes()).unwrap();
        }
        let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap();
        let newest = read("worker-7.log");
        assert!(newest.ends_with("line 019 of forty bytes, more or less...\n"), "{newest}");
        assert!(newest.len() <= 100);
        assert!(read("worker-7.log.1").contains("line 017"));
        assert!(read("worker-7.log.2").contains("line 015"));
        assert!(!dir.path().join("worker-7.log.3").exists(), "only two backups are kept");
        let names: Vec<String> = list(dir.path()).unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["worker-7.log", "worker-7.log.1", "worker-7.log.2"]);
    }

    #[test]
    fn chunks_follow_a_growing_file_and_names_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("job-3.log"), "hello\n").unwrap();
        let (bytes, size, inode) = read_chunk(dir.path(), "job-3.log", 0).unwrap();
        assert_eq!((bytes.as_slice(), size), (&b"hello\n"[..], 6));
        let (bytes, size, same) = read_chunk(dir.path(), "job-3.log", 6).unwrap();
        assert_eq!((bytes.len(), size, same), (0, 6, inode));
        for bad in ["../job-3.log", "job-3", "worker-.log", "secret.log", "job-3.log.x", "/etc/x"] {
            let err = read_chunk(dir.path(), bad, 0).unwrap_err().to_string();
            assert!(err.contains("not a log name"), "{bad}: {err}");
        }
        assert!(valid_name("worker-12.log.3"));
        let err = read_chunk(dir.path(), "job-4.log", 0).unwrap_err().to_string();
        assert!(err.contains("no log job-4.log"), "{err}");
    }
}
