//! Integration tests of the node's object store through the runtime, with real worker processes:
//! large values from `put`, arguments and returns travel through shared memory; references are
//! counted across processes and released when a process is killed; a workload larger than the
//! store runs through spilling; `rtrun memory` shows what a session holds.
//!
//! Each test runs in its own process (nextest), so each starts its own session with its own
//! store settings.

use std::time::Duration;

use rtrun::{Config, ObjectRef, RawBytes, StoreStats};
use rtrun_tests::{kill9, process_alive, wait_until};
use serde_bytes::ByteBuf;

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

const LONG: Duration = Duration::from_secs(60);
const MIB: usize = 1 << 20;

fn init(store_bytes: u64) {
    rtrun::init_with(Config {
        num_cpus: Some(4.0),
        object_store_memory: Some(store_bytes),
        object_spill_dir: Some(spill_parent()),
        ..Default::default()
    })
    .expect("runtime starts");
}

/// Where this test's stores spill (`Config::object_spill_dir`): one parent for every run, in
/// which each store sweeps the directories of dead processes when it opens.
fn spill_parent() -> std::path::PathBuf {
    std::env::temp_dir().join("rtrun-object-store-tests")
}

/// The spill files of this process's store under [`spill_parent`].
fn spill_files() -> usize {
    let Ok(dirs) = std::fs::read_dir(spill_parent()) else { return 0 };
    let ours = format!("rtrun-spill-{}-", std::process::id());
    dirs.flatten()
        .filter(|dir| dir.file_name().to_string_lossy().starts_with(&ours))
        .filter_map(|dir| std::fs::read_dir(dir.path()).ok())
        .map(|files| files.count())
        .sum()
}

/// Deterministic bytes for `seed` (xorshift words), so any process can check every byte.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    rtrun_tests::xorshift_bytes(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1, len)
}

/// Whether `bytes` is exactly `pattern(seed, len)`.
fn matches_pattern(bytes: &[u8], seed: u64, len: usize) -> bool {
    bytes.len() == len && bytes == pattern(seed, len).as_slice()
}

fn stats() -> StoreStats {
    rtrun::memory_stats().expect("store stats")
}

/// Waits until the store holds no object (every reference anywhere dropped).
fn assert_store_drains() {
    let drained = wait_until(LONG, || stats().objects == 0);
    assert!(drained, "objects left in the store:\n{}", stats());
}

struct Peer;

#[rtrun::actor]
impl Peer {
    pub fn new() -> Self {
        Peer
    }

    /// A large return value: goes back through the store.
    pub fn produce(&self, seed: u64, len: usize) -> ByteBuf {
        ByteBuf::from(pattern(seed, len))
    }

    /// A large argument: arrives through the store.
    pub fn check(&self, data: ByteBuf, seed: u64) -> bool {
        matches_pattern(&data, seed, data.len())
    }

    /// References inside a value: fetched from their owner, read in place.
    pub fn check_raw(&self, refs: Vec<ObjectRef<RawBytes>>, seeds: Vec<u64>, len: usize) -> bool {
        refs.iter().zip(seeds).all(|(r, seed)| {
            let view = r.get_view().expect("raw object");
            view.is_mapped() && matches_pattern(&view, seed, len)
        })
    }

    /// This worker's own puts, read back and dropped, `rounds` times.
    pub fn churn(&self, seed: u64, rounds: u64, len: usize) -> Result<u64, String> {
        for round in 0..rounds {
            let seed = seed * 1000 + round;
            let r = rtrun::put_bytes(&pattern(seed, len)).map_err(|e| e.to_string())?;
            let view = r.get_view().map_err(|e| e.to_string())?;
            if !matches_pattern(&view, seed, len) {
                return Err(format!("round {round}: bytes differ"));
            }
        }
        Ok(rounds)
    }

    pub fn pid(&self) -> u32 {
        std::process::id()
    }
}

struct Keeper {
    refs: Vec<ObjectRef<RawBytes>>,
    views: Vec<rtrun::ObjectBytes>,
}

#[rtrun::actor]
impl Keeper {
    pub fn new() -> Self {
        Keeper { refs: Vec::new(), views: Vec::new() }
    }

    /// Puts `n` objects of `len` bytes, keeps references to all and pins the first; returns
    /// the references.
    pub fn hold(&mut self, n: u64, len: usize) -> Result<Vec<ObjectRef<RawBytes>>, String> {
        for seed in 0..n {
            let r = rtrun::put_bytes(&pattern(100 + seed, len)).map_err(|e| e.to_string())?;
            self.refs.push(r);
        }
        let view = self.refs[0].get_view().map_err(|e| e.to_string())?;
        self.views.push(view);
        Ok(self.refs.clone())
    }

    /// Keeps references that arrived inside a value (a borrower).
    pub fn keep(&mut self, refs: Vec<ObjectRef<RawBytes>>) -> usize {
        self.refs.extend(refs);
        self.refs.len()
    }

    /// Reads every kept reference and checks it against its seed.
    pub fn check_kept(&self, seeds: Vec<u64>, len: usize) -> bool {
        self.refs.len() == seeds.len()
            && self
                .refs
                .iter()
                .zip(seeds)
                .all(|(r, seed)| r.get_view().is_ok_and(|view| matches_pattern(&view, seed, len)))
    }

    /// Drops every kept reference and view.
    pub fn drop_all(&mut self) -> usize {
        let n = self.refs.len();
        self.refs.clear();
        self.views.clear();
        n
    }

    pub fn pid(&self) -> u32 {
        std::process::id()
    }
}

#[test]
fn references_inside_values_are_counted_for_their_borrowers() {
    init(128 << 20);
    let len = MIB + 3;
    let seeds = vec![11u64, 12, 13];
    let refs: Vec<ObjectRef<RawBytes>> =
        seeds.iter().map(|s| rtrun::put_bytes(&pattern(*s, len)).expect("put")).collect();
    let keeper = Keeper::remote().expect("keeper starts");
    let other = Keeper::remote().expect("second keeper starts");
    assert_eq!(keeper.keep(refs.clone()).get_timeout(LONG).expect("kept"), 3);
    assert_eq!(other.keep(refs[..1].to_vec()).get_timeout(LONG).expect("kept"), 1);
    // The creator drops its references: the borrowers keep the objects alive and intact.
    drop(refs);
    assert_eq!(stats().objects, 3, "{}", stats());
    assert!(keeper.check_kept(seeds.clone(), len).get_timeout(LONG).expect("read by borrower"));
    assert_eq!(keeper.drop_all().get_timeout(LONG).expect("dropped"), 3);
    // Only the object the second borrower holds is left, then nothing.
    assert!(wait_until(LONG, || stats().objects == 1), "{}", stats());
    assert!(other.check_kept(vec![11], len).get_timeout(LONG).expect("still readable"));
    let pid = other.pid().get_timeout(LONG).expect("pid");
    kill9(pid);
    assert_store_drains();
}

#[test]
fn many_processes_put_get_and_drop_concurrently_with_every_byte_checked() {
    init(256 << 20);
    let peers: Vec<PeerRef> = (0..4).map(|_| Peer::remote().expect("peer starts")).collect();
    let len = 3 * MIB + 12_345;
    std::thread::scope(|scope| {
        for thread in 0..3u64 {
            let peers = peers.clone();
            scope.spawn(move || {
                for round in 0..6u64 {
                    let seed = thread * 100 + round;
                    let producer = &peers[((thread + round) % 4) as usize];
                    let checker = &peers[((thread + round + 1) % 4) as usize];
                    let produced: ObjectRef<ByteBuf> = producer.produce(seed, len);
                    let bytes = produced.get_bytes(Some(LONG)).expect("produced value");
                    assert!(bytes.is_mapped(), "a large return is read in place");
                    let value: ByteBuf = produced.get_timeout(LONG).expect("decoded value");
                    assert!(matches_pattern(&value, seed, len), "thread {thread} round {round}");
                    assert!(checker.check(&produced, seed).get_timeout(LONG).expect("checked"));
                    let raw_seeds = [seed + 7, seed + 8];
                    let raws: Vec<ObjectRef<RawBytes>> = raw_seeds
                        .iter()
                        .map(|s| rtrun::put_bytes(&pattern(*s, len)).expect("raw put"))
                        .collect();
                    let nested = checker.check_raw(raws.clone(), raw_seeds.to_vec(), len);
                    assert!(nested.get_timeout(LONG).expect("nested refs checked"));
                    drop(raws);
                    let large_arg = ByteBuf::from(pattern(seed + 9, len));
                    assert!(producer.check(large_arg, seed + 9).get_timeout(LONG).expect("arg"));
                }
            });
        }
        for (i, peer) in peers.iter().enumerate() {
            let churned = peer.churn(i as u64, 20, MIB + 1).get_timeout(LONG).expect("churn");
            assert_eq!(churned, Ok(20));
        }
    });
    assert_store_drains();
}

#[test]
fn a_workload_of_three_times_the_capacity_runs_through_spilling_intact() {
    let capacity = 64 << 20;
    init(capacity);
    let peer = Peer::remote().expect("peer starts");
    let len = 8 * MIB;
    let count = 24u64; // 192 MiB in a 64 MiB store.
    let mut refs: Vec<ObjectRef<RawBytes>> = Vec::new();
    for seed in 0..count / 2 {
        refs.push(rtrun::put_bytes(&pattern(seed, len)).expect("put spills older objects"));
    }
    let mut returned: Vec<(u64, ObjectRef<ByteBuf>)> = Vec::new();
    for seed in count / 2..count {
        let r = peer.produce(seed, len);
        r.get_bytes(Some(LONG)).expect("returned value");
        returned.push((seed, r));
    }
    let spilled = stats();
    assert_eq!(spilled.objects, count, "{spilled}");
    assert!(spilled.bytes_spilled >= count * len as u64 - capacity, "{spilled}");
    // They spilled where the configuration said.
    let files = spill_files();
    assert!(files >= 8, "{files} spill files under {}", spill_parent().display());
    // Every object comes back intact, in the driver and in a worker.
    for (seed, r) in refs.iter().enumerate() {
        let view = r.get_view().expect("restored");
        assert!(matches_pattern(&view, seed as u64, len), "object {seed}");
    }
    for (seed, r) in &returned {
        assert!(peer.check(r, *seed).get_timeout(LONG).expect("worker reads a spilled value"));
    }
    // Pinned objects cannot be spilled: with most of the store pinned, a put is a clear error.
    let pinned: Vec<_> = refs[..7].iter().map(|r| r.get_view().expect("pinned")).collect();
    let error = rtrun::put_bytes(&vec![0u8; 16 * MIB]).expect_err("store is full of pins");
    assert!(error.to_string().contains("store full"), "{error}");
    drop(pinned);
    rtrun::put_bytes(&vec![0u8; 16 * MIB]).expect("room again after unpinning");
    drop(refs);
    drop(returned);
    assert_store_drains();
}

#[test]
fn a_killed_process_releases_its_references_and_borrowers_keep_theirs() {
    init(128 << 20);
    let keeper = Keeper::remote().expect("keeper starts");
    let pid = keeper.pid().get_timeout(LONG).expect("pid");
    let len = 2 * MIB;
    let refs = keeper.hold(4, len).get_timeout(LONG).expect("hold").expect("held");
    // The driver borrows two of them (its own counts), reads them, and keeps the references.
    let borrowed: Vec<ObjectRef<RawBytes>> = refs[..2].to_vec();
    for (seed, r) in borrowed.iter().enumerate() {
        assert!(matches_pattern(&r.get_view().expect("borrowed"), 100 + seed as u64, len));
    }
    drop(refs);
    // The keeper adds the driver's counts once its reply went out (`on_sent`), over its own
    // connection to the node: the borrow is the store's only when they arrived. Killed before
    // that, an owner takes the borrow with it (a known gap, written up in issue 15's stop-33
    // note); this test kills it after.
    let borrowed_ids: Vec<String> = borrowed.iter().map(|r| r.id().to_string()).collect();
    let lent = wait_until(LONG, || {
        let now = stats();
        let held = now.per_object.iter().filter(|o| borrowed_ids.contains(&o.id.to_string()));
        held.filter(|o| o.holders == 2).count() == 2
    });
    assert!(lent, "the driver's borrows reach the store:\n{}", stats());
    let before = stats();
    assert_eq!(before.objects, 4, "{before}");
    assert_eq!(before.pinned_objects, 1, "{before}");

    kill9(pid);
    assert!(wait_until(LONG, || !process_alive(pid)), "keeper died");
    let released = wait_until(LONG, || {
        let now = stats();
        now.objects == 2 && now.pinned_objects == 0
    });
    assert!(released, "the killed keeper's references are released:\n{}", stats());
    for (seed, r) in borrowed.iter().enumerate() {
        let view = r.get_view().expect("a borrower keeps the object after its creator died");
        assert!(matches_pattern(&view, 100 + seed as u64, len));
    }
    drop(borrowed);
    assert_store_drains();
}

#[test]
fn small_values_stay_inline_and_tensors_are_viewed_in_place() {
    init(64 << 20);
    let small = rtrun::put(&vec![7u8; 1000]).expect("small put");
    assert_eq!(stats().objects, 0, "a small value stays inline");
    assert!(!small.get_bytes(None).expect("small").is_mapped());
    let shape = [256u64, 1024];
    let data: Vec<u8> = (0..256 * 1024 * 4).map(|i| (i % 253) as u8).collect();
    let tensor = rtrun::put_tensor(rtrun::DType::F32, &shape, &data).expect("tensor put");
    let view = tensor.get_view().expect("tensor view");
    assert!(view.is_mapped());
    let parsed = view.tensor().expect("tensor object");
    assert_eq!(parsed.header.shape(), &shape);
    assert_eq!(parsed.header.dtype(), rtrun::DType::F32);
    assert_eq!(parsed.data, &data[..]);
    assert_eq!(parsed.data.as_ptr() as usize % 64, 0, "data is 64-byte aligned");
    assert_eq!(stats().pinned_objects, 1);
    drop(view);
    assert_eq!(stats().pinned_objects, 0);
    let wrong = rtrun::put_tensor(rtrun::DType::F32, &shape, &data[1..]);
    assert!(wrong.is_err());
    drop(tensor);
    assert_store_drains();
}

#[test]
fn rtrun_memory_reports_what_the_session_created() {
    init(64 << 20);
    let sizes = [1_234_567usize, 2_345_678];
    let refs: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, len)| rtrun::put_bytes(&pattern(i as u64, *len)).expect("put"))
        .collect();
    let pinned = refs[1].get_view().expect("pin");
    let session = rtrun::context().expect("context").session;
    let output = std::process::Command::new(rtrun_tests::rtrun_binary())
        .args(["memory", "--session", &session])
        .output()
        .expect("rtrun memory runs");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}\n{}", String::from_utf8_lossy(&output.stderr));
    eprintln!("{text}");
    assert!(text.contains(&session), "{text}");
    assert!(text.contains("2 objects"), "{text}");
    assert!(text.contains("1 pinned"), "{text}");
    for (r, len) in refs.iter().zip(sizes) {
        let line = format!("{} {len} B sealed owner 0 holders 1 pins", r.id());
        assert!(text.contains(&line), "missing `{line}` in:\n{text}");
    }
    drop(pinned);
}
