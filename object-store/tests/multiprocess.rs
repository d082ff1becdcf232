//! Multi-process tests of the object store: a real second process (`rtrun-store-probe`) attaches
//! to the node's arena through an inherited memfd and reads or writes objects, every byte
//! checked; a spill workload of three times the capacity; and a SIGKILLed holder whose
//! references are released.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::Duration;

use rtrun_object_store::{
    ARENA_ENV, Allocation, HolderId, ObjectId, ObjectStore, StoreConfig, StoreError,
};

/// Hard limit for any single answer of the probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);
const NODE: HolderId = HolderId(1);

/// Same pattern as the probe's.
fn pattern_byte(seed: u64, i: u64) -> u8 {
    ((i ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

fn pattern(seed: u64, len: u64) -> Vec<u8> {
    (0..len).map(|i| pattern_byte(seed, i)).collect()
}

fn store(capacity: u64) -> ObjectStore {
    ObjectStore::open(StoreConfig::with_capacity(capacity)).expect("open store")
}

/// A running probe process, killed when dropped so no test leaves one behind.
struct Probe {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Probe {
    fn spawn(store: &ObjectStore) -> Probe {
        store.arena().set_inheritable(true).expect("make the arena fd inheritable");
        let mut child = Command::new(env!("CARGO_BIN_EXE_rtrun-store-probe"))
            .env(ARENA_ENV, store.arena().env_value())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the probe");
        store.arena().set_inheritable(false).expect("restore close-on-exec");
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (sender, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Probe { child, stdin, lines }
    }

    fn ask(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").expect("write to the probe");
        self.stdin.flush().expect("flush to the probe");
        match self.lines.recv_timeout(PROBE_TIMEOUT) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => panic!("probe gave no answer to `{command}` in time"),
            Err(RecvTimeoutError::Disconnected) => panic!("probe exited during `{command}`"),
        }
    }

    fn check(&mut self, allocation: Allocation, seed: u64) {
        let answer = self.ask(&format!("check {} {} {seed}", allocation.offset, allocation.size));
        assert_eq!(answer, "ok", "object at {allocation:?} with seed {seed}");
    }
}

impl Probe {
    /// Asks the probe to exit and waits for it, with a deadline.
    fn exit(&mut self) {
        writeln!(self.stdin, "exit").expect("write to the probe");
        self.stdin.flush().expect("flush to the probe");
        let deadline = std::time::Instant::now() + PROBE_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().expect("poll the probe") {
                assert!(status.success(), "probe exited with {status}");
                return;
            }
            assert!(std::time::Instant::now() < deadline, "probe did not exit in time");
            // Polling a child's exit has no blocking-with-timeout call in std.
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_worker_process_reads_every_byte_the_node_wrote() {
    let store = store(64 << 20);
    let sizes = [0u64, 1, 63, 64, 65, 4096, 3 << 20, 17 << 20];
    for (n, &size) in sizes.iter().enumerate() {
        store.put(ObjectId(n as u128), NODE, &pattern(n as u64, size)).unwrap();
    }
    let mut probe = Probe::spawn(&store);
    let reader = HolderId(u64::from(probe.child.id()));
    for (n, _) in sizes.iter().enumerate() {
        let allocation = store.pin(ObjectId(n as u128), reader).unwrap();
        probe.check(allocation, n as u64);
        store.unpin(ObjectId(n as u128), reader).unwrap();
    }
    probe.exit();
}

#[test]
fn the_node_reads_every_byte_a_worker_wrote() {
    let store = store(32 << 20);
    let mut probe = Probe::spawn(&store);
    let worker = HolderId(u64::from(probe.child.id()));
    for (n, size) in [(1u64, 5u64 << 20), (2, 1000), (3, 12 << 20)] {
        let id = ObjectId(n.into());
        let allocation = store.create(id, size, worker).unwrap();
        assert_eq!(probe.ask(&format!("write {} {size} {n}", allocation.offset)), "ok");
        store.seal(id).unwrap();
        let view = store.get(id, NODE).unwrap();
        assert!(view.iter().enumerate().all(|(i, &b)| b == pattern_byte(n, i as u64)));
    }
}

#[test]
fn a_workload_of_three_times_the_capacity_spills_and_restores_intact() {
    let capacity = 16 << 20;
    let store = store(capacity);
    let mut total = 0;
    let mut objects = Vec::new();
    let mut n = 0u64;
    while total < 3 * capacity {
        let size = (1 << 20) + (n * 397_123) % (3 << 20);
        store.put(ObjectId(n.into()), NODE, &pattern(n, size)).unwrap();
        objects.push((n, size));
        total += size;
        n += 1;
    }
    let stats = store.stats();
    assert!(stats.spilled_objects > 0 && stats.bytes_spilled >= total - capacity);
    assert_eq!(stats.bytes_in_memory + stats.bytes_spilled, total);
    let mut probe = Probe::spawn(&store);
    let reader = HolderId(u64::from(probe.child.id()));
    // Read in an order unrelated to the LRU order so restores spill other objects again.
    for &(n, size) in objects.iter().rev().step_by(2).chain(objects.iter().step_by(2)) {
        let id = ObjectId(n.into());
        let view = store.get(id, NODE).unwrap();
        assert_eq!(view.len() as u64, size);
        assert!(
            view.iter().enumerate().all(|(i, &b)| b == pattern_byte(n, i as u64)),
            "object {n}"
        );
        drop(view);
        let allocation = store.pin(id, reader).unwrap();
        probe.check(allocation, n);
        store.unpin(id, reader).unwrap();
    }
    let spill_files = std::fs::read_dir(store.spill_dir()).unwrap().count() as u64;
    assert_eq!(spill_files, store.stats().spilled_objects);
    for &(n, _) in &objects {
        assert!(store.remove_holder(ObjectId(n.into()), NODE).unwrap());
    }
    assert_eq!(std::fs::read_dir(store.spill_dir()).unwrap().count(), 0);
    assert_eq!(store.stats().used_bytes, 0);
}

#[test]
fn a_sigkilled_holder_has_its_references_and_pins_released() {
    let store = store(8 << 20);
    let mut probe = Probe::spawn(&store);
    let worker = HolderId(u64::from(probe.child.id()));
    // The worker borrows and pins object 1, owns object 2 (sealed) and object 3 (unsealed).
    store.put(ObjectId(1), NODE, &pattern(1, 3 << 20)).unwrap();
    store.add_holder(ObjectId(1), worker).unwrap();
    let pinned = store.pin(ObjectId(1), worker).unwrap();
    assert_eq!(probe.ask(&format!("hold {} {}", pinned.offset, pinned.size)), "held");
    store.put(ObjectId(2), worker, &pattern(2, 1 << 20)).unwrap();
    store.create(ObjectId(3), 3 << 20, worker).unwrap();
    let full = store.create(ObjectId(4), 3 << 20, NODE).unwrap_err();
    assert!(matches!(full, StoreError::StoreFull { .. }), "{full}");

    probe.child.kill().expect("SIGKILL the probe");
    probe.child.wait().expect("reap the probe");
    let mut freed = store.release_process(worker);
    freed.sort();
    assert_eq!(freed, vec![ObjectId(2), ObjectId(3)]);
    assert!(store.contains(ObjectId(1)), "the node still holds object 1");
    let stats = store.stats();
    assert_eq!((stats.objects, stats.pinned_objects), (1, 0));
    // The memory the dead worker held is usable again, and object 1 is intact.
    store.put(ObjectId(4), NODE, &pattern(4, 6 << 20)).unwrap();
    let view = store.get(ObjectId(1), NODE).unwrap();
    assert_eq!(&*view, &pattern(1, 3 << 20)[..]);
}
