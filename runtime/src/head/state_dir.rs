//! `rtrun head --state-dir DIR`: the control plane's durable state on disk (decision 066), as
//! generations of a snapshot and the log of records after it: `snapshot-<G>` holds every
//! entry when generation `G` began, `log-<G>` each change since (what
//! [`rtrun_head_core::HeadCore::take_records`] returns, appended before the effects of the
//! events that made it are carried out). A new generation starts when the log outgrows its
//! snapshot, and at every start: its snapshot is written aside and renamed into place, then
//! the older generation is removed, so a head killed at any point finds one whole snapshot and
//! the log that belongs to it.
//!
//! Every file starts with the magic `RTRUNSTD`, the state format version (little-endian u32,
//! before anything version-specific) and a frame holding [`Meta`]: the cluster it belongs to
//! (its CA's fingerprint), the session, the head's address and the generation. A frame is its
//! length (u32), the XXH3-64 of its payload (u64) and the payload (`bitcode`). What the head
//! refuses, naming the file: another cluster's directory, a newer format, a frame that does not
//! match its checksum or does not decode, a missing snapshot for a log. The one thing it
//! accepts is a log whose last frame was cut short (the head was killed in its write): that
//! change was never acted on, and it is dropped (the next generation starts without it).
//!
//! Writes reach the page cache before the effects go out, so a killed head loses nothing; the
//! log is flushed to disk at most every [`SYNC_INTERVAL`] and snapshots at once, so a machine
//! that loses power loses at most that interval.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rtrun_head_core::{DurableState, Record, STATE_VERSION};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"RTRUNSTD";
/// The longest frame read back: a corrupt length must not allocate gigabytes.
const MAX_FRAME: u32 = 256 << 20;
/// How often the log is flushed to disk (`fdatasync`).
pub(crate) const SYNC_INTERVAL: Duration = Duration::from_secs(1);
/// The log may grow to this many times its snapshot (plus a MiB) before a new generation.
const LOG_GROWTH: u64 = 4;

/// What every file of a state directory says about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Meta {
    /// The SHA-256 fingerprint of the cluster's CA certificate, in hex.
    pub(crate) cluster: String,
    /// The session the cluster's addresses are named in.
    pub(crate) session: String,
    /// The head's address when it wrote the file (`host:port`).
    pub(crate) address: String,
    /// The generation the file belongs to.
    pub(crate) generation: u64,
}

/// What a state directory held.
pub(crate) struct Recovered {
    pub(crate) meta: Meta,
    pub(crate) state: DurableState,
    /// Records read from the log (after the snapshot's).
    pub(crate) log_records: usize,
}

/// The state directory a head writes.
pub(crate) struct StateDir {
    dir: PathBuf,
    meta: Meta,
    log: File,
    log_bytes: u64,
    snapshot_bytes: u64,
    synced: Instant,
    _lock: DirLock,
}

/// The directory's lock (`DIR/lock`, `flock`), held from the read to the head's exit: a
/// second head on the same directory is refused.
pub(crate) struct DirLock(#[allow(dead_code)] File);

fn system(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let message = format!("{what} {}", path.display());
    move |e| Error::System(format!("{message}: {e}"))
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(12 + payload.len());
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    bytes.extend_from_slice(&len.to_le_bytes());
    bytes.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(payload).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

fn header(meta: &Meta) -> Result<Vec<u8>> {
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&STATE_VERSION.to_le_bytes());
    bytes.extend(frame(&crate::codec::encode(meta)?));
    Ok(bytes)
}

/// A file's bytes, read as frames.
struct Reader<'a> {
    path: &'a Path,
    bytes: Vec<u8>,
    at: usize,
}

/// How a read of a frame ended.
enum Next {
    Frame(Vec<u8>),
    End,
    /// The file ends inside a frame (at this offset).
    Torn(usize),
}

impl Reader<'_> {
    fn corrupt(&self, what: &str) -> Error {
        Error::Invalid(format!(
            "state file {} is corrupt at byte {}: {what}; refusing to start from it (move the \
             directory aside to start a fresh cluster, whose nodes must then join anew)",
            self.path.display(),
            self.at
        ))
    }

    fn next(&mut self) -> Result<Next> {
        let left = self.bytes.len() - self.at;
        if left == 0 {
            return Ok(Next::End);
        }
        if left < 12 {
            return Ok(Next::Torn(self.at));
        }
        let word = |at: usize, n: usize| &self.bytes[at..at + n];
        let len = u32::from_le_bytes(word(self.at, 4).try_into().unwrap_or_default());
        if len > MAX_FRAME {
            return Err(self.corrupt(&format!("a frame of {len} bytes")));
        }
        let sum = u64::from_le_bytes(word(self.at + 4, 8).try_into().unwrap_or_default());
        let start = self.at + 12;
        let Some(end) = start.checked_add(len as usize).filter(|end| *end <= self.bytes.len())
        else {
            return Ok(Next::Torn(self.at));
        };
        let payload = &self.bytes[start..end];
        if xxhash_rust::xxh3::xxh3_64(payload) != sum {
            return Err(self.corrupt("a frame does not match its checksum"));
        }
        let payload = payload.to_vec();
        self.at = end;
        Ok(Next::Frame(payload))
    }

    /// The header: magic, version, meta; checked against `cluster`.
    fn header(&mut self, cluster: &str) -> Result<Meta> {
        if self.bytes.len() < 12 || &self.bytes[..8] != MAGIC {
            return Err(self.corrupt("it does not start with an rtrun state header"));
        }
        let version = u32::from_le_bytes(self.bytes[8..12].try_into().unwrap_or_default());
        if version > STATE_VERSION {
            return Err(Error::Invalid(format!(
                "state file {} was written by a newer rtrun (state format {version}; this one \
                 reads up to {STATE_VERSION}): upgrade this head",
                self.path.display()
            )));
        }
        self.at = 12;
        let Next::Frame(payload) = self.next()? else {
            return Err(self.corrupt("its header is cut short"));
        };
        let meta: Meta =
            crate::codec::decode(&payload).map_err(|e| self.corrupt(&format!("header: {e}")))?;
        if meta.cluster != cluster {
            return Err(Error::Invalid(format!(
                "state file {} belongs to another cluster (CA fingerprint {}…, this head's is \
                 {}…): point --state-dir at this cluster's directory, or at an empty one",
                self.path.display(),
                &meta.cluster[..meta.cluster.len().min(16)],
                &cluster[..cluster.len().min(16)]
            )));
        }
        Ok(meta)
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(system("cannot read state file", path))?;
    Ok(bytes)
}

/// The generations present in `dir`: (snapshots, logs).
fn generations(dir: &Path) -> Result<(Vec<u64>, Vec<u64>)> {
    let mut snapshots = Vec::new();
    let mut logs = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(system("cannot read state directory", dir))? {
        let entry = entry.map_err(system("cannot read state directory", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(g) = name.strip_prefix("snapshot-").and_then(|g| g.parse().ok()) {
            snapshots.push(g);
        } else if let Some(g) = name.strip_prefix("log-").and_then(|g| g.parse().ok()) {
            logs.push(g);
        }
    }
    snapshots.sort_unstable();
    logs.sort_unstable();
    Ok((snapshots, logs))
}

/// Takes the directory's lock (`DIR/lock`): one head per state directory.
fn lock(dir: &Path) -> Result<DirLock> {
    let path = dir.join("lock");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(system("cannot open", &path))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
        |e| {
            Error::Invalid(format!(
                "state directory {} is in use by another head ({e}): one head per state \
                 directory",
                dir.display()
            ))
        },
    )?;
    Ok(DirLock(file))
}

impl StateDir {
    /// Locks `dir` (creating it when missing) and reads what it holds for cluster `cluster`:
    /// `None` when it holds nothing yet.
    pub(crate) fn read(dir: &Path, cluster: &str) -> Result<(DirLock, Option<Recovered>)> {
        std::fs::create_dir_all(dir).map_err(system("cannot create state directory", dir))?;
        let lock = lock(dir)?;
        Ok((lock, StateDir::read_locked(dir, cluster)?))
    }

    fn read_locked(dir: &Path, cluster: &str) -> Result<Option<Recovered>> {
        let (snapshots, logs) = generations(dir)?;
        let Some(&generation) = snapshots.last() else {
            if let Some(log) = logs.last() {
                let path = dir.join(format!("log-{log}"));
                return Err(Error::Invalid(format!(
                    "state file {} has no snapshot-{log} beside it; refusing to start from half a \
                     state (move the directory aside to start a fresh cluster)",
                    path.display()
                )));
            }
            return Ok(None);
        };
        let path = dir.join(format!("snapshot-{generation}"));
        let mut reader = Reader { path: &path, bytes: read_file(&path)?, at: 0 };
        let meta = reader.header(cluster)?;
        let mut state = DurableState::default();
        loop {
            match reader.next()? {
                Next::Frame(payload) => state.apply(decode(&reader, &payload)?),
                Next::End => break,
                Next::Torn(_) => return Err(reader.corrupt("the snapshot is cut short")),
            }
        }
        let log_path = dir.join(format!("log-{generation}"));
        let mut log_records = 0;
        if log_path.exists() {
            let mut reader = Reader { path: &log_path, bytes: read_file(&log_path)?, at: 0 };
            let log_meta = reader.header(cluster)?;
            if log_meta.generation != generation {
                return Err(reader.corrupt(&format!(
                    "it says generation {}, its name {generation}",
                    log_meta.generation
                )));
            }
            loop {
                match reader.next()? {
                    Next::Frame(payload) => {
                        state.apply(decode(&reader, &payload)?);
                        log_records += 1;
                    }
                    Next::End => break,
                    Next::Torn(at) => {
                        tracing::warn!(
                            log = %log_path.display(),
                            "the last record was cut short (the head was killed writing it); \
                             dropping its {} bytes",
                            reader.bytes.len() - at
                        );
                        break;
                    }
                }
            }
        }
        Ok(Some(Recovered { meta, state, log_records }))
    }

    /// Starts writing generation `meta.generation` with `state` as its snapshot, and removes
    /// the older generations.
    pub(crate) fn start(
        lock: DirLock,
        dir: &Path,
        meta: Meta,
        state: &DurableState,
    ) -> Result<StateDir> {
        let mut state_dir = StateDir {
            dir: dir.to_owned(),
            log: File::open("/dev/null").map_err(system("cannot open", Path::new("/dev/null")))?,
            meta,
            log_bytes: 0,
            snapshot_bytes: 0,
            synced: Instant::now(),
            _lock: lock,
        };
        state_dir.begin(state)?;
        Ok(state_dir)
    }

    /// Writes this generation's snapshot aside, renames it into place, opens its log, and
    /// removes every other generation.
    fn begin(&mut self, state: &DurableState) -> Result<()> {
        let generation = self.meta.generation;
        let path = self.dir.join(format!("snapshot-{generation}"));
        let aside = self.dir.join(format!("snapshot-{generation}.tmp"));
        let mut bytes = header(&self.meta)?;
        for record in state.records() {
            bytes.extend(frame(&crate::codec::encode(&record)?));
        }
        {
            let mut file = File::create(&aside).map_err(system("cannot write", &aside))?;
            file.write_all(&bytes).map_err(system("cannot write", &aside))?;
            file.sync_data().map_err(system("cannot flush", &aside))?;
        }
        std::fs::rename(&aside, &path).map_err(system("cannot rename into", &path))?;
        let log_path = self.dir.join(format!("log-{generation}"));
        let mut log = File::create(&log_path).map_err(system("cannot write", &log_path))?;
        let head = header(&self.meta)?;
        log.write_all(&head).map_err(system("cannot write", &log_path))?;
        log.sync_data().map_err(system("cannot flush", &log_path))?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(system("cannot flush state directory", &self.dir))?;
        self.log = log;
        self.log_bytes = head.len() as u64;
        self.snapshot_bytes = bytes.len() as u64;
        let (snapshots, logs) = generations(&self.dir)?;
        for (kind, g) in snapshots
            .iter()
            .map(|g| ("snapshot", *g))
            .chain(logs.iter().map(|g| ("log", *g)))
            .filter(|(_, g)| *g != generation)
        {
            let old = self.dir.join(format!("{kind}-{g}"));
            std::fs::remove_file(&old).map_err(system("cannot remove", &old))?;
        }
        Ok(())
    }

    /// Appends records to the log (to the page cache at once, to disk every
    /// [`SYNC_INTERVAL`]).
    pub(crate) fn append(&mut self, records: &[Record]) -> Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let mut bytes = Vec::new();
        for record in records {
            bytes.extend(frame(&crate::codec::encode(record)?));
        }
        let path = || self.dir.join(format!("log-{}", self.meta.generation));
        self.log.write_all(&bytes).map_err(|e| system("cannot append to", &path())(e))?;
        self.log_bytes += bytes.len() as u64;
        if self.synced.elapsed() >= SYNC_INTERVAL {
            self.log.sync_data().map_err(|e| system("cannot flush", &path())(e))?;
            self.synced = Instant::now();
        }
        Ok(())
    }

    /// Whether the log has outgrown its snapshot (time for [`StateDir::compact`]).
    pub(crate) fn needs_compaction(&self) -> bool {
        self.log_bytes > LOG_GROWTH * self.snapshot_bytes + (1 << 20)
    }

    /// Starts the next generation from `state` (the core's whole durable state now).
    pub(crate) fn compact(&mut self, state: &DurableState) -> Result<()> {
        self.meta.generation += 1;
        self.begin(state)
    }
}

fn decode(reader: &Reader<'_>, payload: &[u8]) -> Result<Record> {
    crate::codec::decode(payload).map_err(|e| reader.corrupt(&format!("a record: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtrun_head_core::{Event, HeadConfig, HeadCore, Origin, ReplyToken};
    use rtrun_proto::protocol::HeadRequest;

    fn core() -> HeadCore {
        let config = HeadConfig {
            node: rtrun_placement::NodeResources::with_fake_gpus(
                rtrun_placement::NodeId::new("node-0"),
                2,
                0,
            ),
            max_task_workers: 1,
            noset_cuda_visible_devices: false,
            task_worker_idle_timeout: Duration::from_secs(5),
            workers_on_head: true,
        };
        let mut core = HeadCore::new("5151".into(), config, 0).unwrap();
        core.enable_cluster("quic://127.0.0.1:1/0/rtrun-5151-0".into(), "head".into(), "/l".into());
        core
    }

    fn put(core: &mut HeadCore, key: &str, value: &[u8]) -> Vec<Record> {
        let body = HeadRequest::KvPut { key: key.into(), value: value.to_vec() };
        core.handle(Origin::default(), Event::Request { reply: ReplyToken(0), body });
        core.take_records()
    }

    fn meta(cluster: &str) -> Meta {
        Meta {
            cluster: cluster.into(),
            session: "5151".into(),
            address: "a:1".into(),
            generation: 1,
        }
    }

    fn json(state: &DurableState) -> serde_json::Value {
        serde_json::to_value(state).unwrap()
    }

    /// What was appended reads back as the core holds it, across a new generation too, which
    /// leaves only its own files.
    #[test]
    fn records_read_back_as_the_core_holds_them_across_generations() {
        let dir = tempfile::tempdir().unwrap();
        let mut core = core();
        let (lock, found) = StateDir::read(dir.path(), "c1").unwrap();
        assert!(found.is_none());
        let mut state_dir =
            StateDir::start(lock, dir.path(), meta("c1"), &core.journal_from_now()).unwrap();
        state_dir.append(&put(&mut core, "a", b"1")).unwrap();
        state_dir.append(&put(&mut core, "b", b"2")).unwrap();
        drop(state_dir);
        let (lock, found) = StateDir::read(dir.path(), "c1").unwrap();
        let found = found.unwrap();
        assert_eq!(found.log_records, 2);
        assert_eq!(json(&found.state), json(&core.durable_state()));
        let mut state_dir = StateDir::start(lock, dir.path(), meta("c1"), &found.state).unwrap();
        state_dir.compact(&core.durable_state()).unwrap();
        state_dir.append(&put(&mut core, "a", b"3")).unwrap();
        drop(state_dir);
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["lock", "log-2", "snapshot-2"]);
        let (_, found) = StateDir::read(dir.path(), "c1").unwrap();
        assert_eq!(json(&found.unwrap().state), json(&core.durable_state()));
    }

    /// A record cut short by a kill is dropped; a changed byte, another cluster's directory, a
    /// newer format, a log without its snapshot and a second head are refused, naming the file.
    #[test]
    fn damaged_foreign_newer_and_busy_directories_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let mut core = core();
        let (lock, _) = StateDir::read(dir.path(), "c1").unwrap();
        let mut state_dir =
            StateDir::start(lock, dir.path(), meta("c1"), &core.journal_from_now()).unwrap();
        state_dir.append(&put(&mut core, "a", b"1")).unwrap();
        let with_a = core.durable_state();
        state_dir.append(&put(&mut core, "b", b"2")).unwrap();
        let busy = StateDir::read(dir.path(), "c1").err().unwrap().to_string();
        assert!(busy.contains("in use by another head"), "{busy}");
        drop(state_dir);
        let log = dir.path().join("log-1");
        let bytes = std::fs::read(&log).unwrap();
        // Cut short: the last record is dropped.
        std::fs::write(&log, &bytes[..bytes.len() - 3]).unwrap();
        let (lock, found) = StateDir::read(dir.path(), "c1").unwrap();
        assert_eq!(json(&found.unwrap().state), json(&with_a));
        drop(lock);
        // A changed byte in a whole record.
        let mut changed = bytes.clone();
        changed[bytes.len() - 1] ^= 0xff;
        std::fs::write(&log, &changed).unwrap();
        let error = StateDir::read(dir.path(), "c1").err().unwrap().to_string();
        assert!(error.contains("log-1 is corrupt at byte"), "{error}");
        std::fs::write(&log, &bytes).unwrap();
        // Another cluster's.
        let error = StateDir::read(dir.path(), "c2").err().unwrap().to_string();
        assert!(error.contains("snapshot-1 belongs to another cluster"), "{error}");
        // A newer format.
        let snapshot = dir.path().join("snapshot-1");
        let mut newer = std::fs::read(&snapshot).unwrap();
        newer[8..12].copy_from_slice(&(STATE_VERSION + 1).to_le_bytes());
        std::fs::write(&snapshot, &newer).unwrap();
        let error = StateDir::read(dir.path(), "c1").err().unwrap().to_string();
        assert!(error.contains("snapshot-1 was written by a newer rtrun"), "{error}");
        // No snapshot at all.
        std::fs::remove_file(&snapshot).unwrap();
        let error = StateDir::read(dir.path(), "c1").err().unwrap().to_string();
        assert!(error.contains("log-1 has no snapshot-1 beside it"), "{error}");
        // Not a state file.
        std::fs::write(&snapshot, b"hello").unwrap();
        let error = StateDir::read(dir.path(), "c1").err().unwrap().to_string();
        assert!(error.contains("does not start with an rtrun state header"), "{error}");
    }
}
