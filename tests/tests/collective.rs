//! The CPU collective across real worker processes: every rank is an actor of an
//! [`ActorGroup`] that joins the group's communicator from its runtime context, then the
//! driver asks the ranks to run collectives and checks every element of the results.

use std::collections::BTreeMap;
use std::time::Duration;

use rtrun::collective::{CollectiveConfig, Communicator, ReduceOp};
use rtrun::{ActorGroup, ActorOptions, Config, ObjectRef};
use rtrun_tests::kill9;

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

fn init() {
    rtrun::init_with(Config {
        num_cpus: Some(2.0),
        resources: BTreeMap::new(),
        ..Default::default()
    })
    .expect("runtime starts");
}

/// Bound on anything a test waits for; far above what the operations need, so only a hang
/// reaches it.
const LONG: Duration = Duration::from_secs(120);

/// One DP rank holding a communicator.
struct Rank {
    comm: Option<Communicator>,
}

#[rtrun::actor]
impl Rank {
    pub fn new() -> Self {
        Rank { comm: None }
    }

    /// Joins the actor group's collective; returns (rank, world size).
    pub fn connect(&mut self, timeout_ms: u64) -> Result<(usize, usize), String> {
        let config = CollectiveConfig::from_group_context()
            .map_err(|e| e.to_string())?
            .with_timeout(Duration::from_millis(timeout_ms));
        let comm = Communicator::init(config).map_err(|e| e.to_string())?;
        let identity = (comm.rank(), comm.world_size());
        self.comm = Some(comm);
        Ok(identity)
    }

    pub fn all_reduce(&mut self, mut data: Vec<f32>, op: ReduceOp) -> Result<Vec<f32>, String> {
        self.comm()?.all_reduce_f32(&mut data, op).map_err(|e| e.to_string())?;
        Ok(data)
    }

    pub fn all_reduce_f64(&mut self, mut data: Vec<f64>, op: ReduceOp) -> Result<Vec<f64>, String> {
        self.comm()?.all_reduce_f64(&mut data, op).map_err(|e| e.to_string())?;
        Ok(data)
    }

    /// All-reduces `len` floats made from the rank (`(rank + 1)·(i mod 1000)/2`, exact in f32)
    /// and returns the indices (at most 10) where the result differs from the closed form.
    pub fn large_all_reduce(&mut self, len: usize, op: ReduceOp) -> Result<Vec<usize>, String> {
        let comm = self.comm()?;
        let (rank, world) = (comm.rank() as f32, comm.world_size() as f32);
        let mut data: Vec<f32> = (0..len).map(|i| (rank + 1.0) * (i % 1000) as f32 * 0.5).collect();
        comm.all_reduce_f32(&mut data, op).map_err(|e| e.to_string())?;
        // Σ_{r<w} (r + 1) = w(w + 1)/2.
        let factor = world * (world + 1.0) / 2.0;
        let factor = if op == ReduceOp::Mean { factor / world } else { factor };
        Ok((0..len).filter(|&i| data[i] != factor * (i % 1000) as f32 * 0.5).take(10).collect())
    }

    /// Broadcasts `len` bytes from `root` (the root fills a pattern, the others zeros) and says
    /// whether this rank ended with the root's pattern.
    pub fn broadcast_pattern(&mut self, len: usize, root: usize) -> Result<bool, String> {
        let comm = self.comm()?;
        let pattern = |i: usize| ((i * 31 + 7) % 251) as u8;
        let mut data: Vec<u8> =
            if comm.rank() == root { (0..len).map(pattern).collect() } else { vec![0; len] };
        comm.broadcast(&mut data, root).map_err(|e| e.to_string())?;
        Ok(data.iter().enumerate().all(|(i, &b)| b == pattern(i)))
    }

    pub fn broadcast_bytes(&mut self, mut data: Vec<u8>, root: usize) -> Result<Vec<u8>, String> {
        self.comm()?.broadcast_bytes(&mut data, root).map_err(|e| e.to_string())?;
        Ok(data)
    }

    pub fn all_gather(&mut self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String> {
        self.comm()?.all_gather_bytes(&mine).map_err(|e| e.to_string())
    }

    pub fn barrier(&mut self) -> Result<(), String> {
        self.comm()?.barrier().map_err(|e| e.to_string())
    }

    pub fn pid(&self) -> u32 {
        std::process::id()
    }
}

impl Rank {
    fn comm(&mut self) -> Result<&mut Communicator, String> {
        self.comm.as_mut().ok_or_else(|| "connect first".to_owned())
    }
}

/// A group of `n` ranks, all connected with `timeout`.
fn connected_group(name: &str, n: usize, timeout: Duration) -> ActorGroup<Rank> {
    let group: ActorGroup<Rank> =
        ActorGroup::create(name, n, ActorOptions::default(), |_, opts| Rank::remote_with(opts))
            .unwrap();
    let joined = get_all_within(&group.call_all(|m| m.connect(timeout.as_millis() as u64)));
    let expected: Vec<Result<(usize, usize), String>> = (0..n).map(|r| Ok((r, n))).collect();
    assert_eq!(joined, expected);
    group
}

fn get_all_within<T: serde::de::DeserializeOwned>(refs: &[ObjectRef<T>]) -> Vec<T> {
    refs.iter().map(|r| r.get_timeout(LONG).expect("the call completes")).collect()
}

#[test]
fn all_reduce_of_known_vectors_on_four_ranks() {
    init();
    let group = connected_group("known", 4, Duration::from_secs(60));
    // Rank r contributes [r + 1, 10·(r + 1), −r, r/2, 7]; 5 elements over 4 ranks makes
    // uneven chunks (2, 1, 1, 1).
    let data = |r: usize| {
        let r = r as f32;
        vec![r + 1.0, 10.0 * (r + 1.0), -r, r / 2.0, 7.0]
    };
    // Sums over r = 0..4: 1+2+3+4 = 10; 10·10 = 100; −(0+1+2+3) = −6; (0+1+2+3)/2 = 3; 28.
    let sum = vec![10.0f32, 100.0, -6.0, 3.0, 28.0];
    let mean = vec![2.5f32, 25.0, -1.5, 0.75, 7.0];
    let max = vec![4.0f32, 40.0, 0.0, 1.5, 7.0];
    let min = vec![1.0f32, 10.0, -3.0, 0.0, 7.0];
    for (op, expected) in
        [(ReduceOp::Sum, sum), (ReduceOp::Mean, mean), (ReduceOp::Max, max), (ReduceOp::Min, min)]
    {
        let results = get_all_within(
            &group.call_each((0..4).map(data).collect(), |m, d| m.all_reduce(d, op)).unwrap(),
        );
        for (rank, result) in results.into_iter().enumerate() {
            assert_eq!(result, Ok(expected.clone()), "{op:?} on rank {rank}");
        }
    }
    // f64: rank r contributes [0.1·r, 1e300·(r − 1.5)]: Σ = [0.6, 0] up to rounding; the mean of
    // [1, 2, 3, 4] is exact.
    let results = get_all_within(
        &group
            .call_each(
                (0..4).map(|r| vec![r as f64 + 1.0, 1e300 * (r as f64 - 1.5)]).collect(),
                |m, d| m.all_reduce_f64(d, ReduceOp::Mean),
            )
            .unwrap(),
    );
    for result in results {
        let result = result.unwrap();
        assert_eq!(result[0], 2.5);
        assert!(result[1].abs() < 1e285, "{}", result[1]);
    }
    // Empty buffers are fine too.
    let results = get_all_within(&group.call_all(|m| m.all_reduce(Vec::new(), ReduceOp::Sum)));
    assert!(results.iter().all(|r| r == &Ok(Vec::new())));
    group.kill().unwrap();
}

#[test]
fn all_reduce_of_a_large_buffer() {
    init();
    let group = connected_group("large", 4, Duration::from_secs(60));
    // 4 Mi + 3 floats (16 MiB per rank), several 1 MiB segments per chunk, uneven chunks.
    let len = (4 << 20) + 3;
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let mismatches = get_all_within(&group.call_all(|m| m.large_all_reduce(len, op)));
        for (rank, m) in mismatches.into_iter().enumerate() {
            assert_eq!(m, Ok(Vec::new()), "{op:?} on rank {rank}: first mismatching indices");
        }
    }
    group.kill().unwrap();
}

#[test]
fn broadcast_from_a_non_zero_root_and_all_gather() {
    init();
    let group = connected_group("bcast", 4, Duration::from_secs(60));
    // 3 MiB + 5 bytes from rank 2: several segments, forwarded 2 → 3 → 0 → 1.
    let ok = get_all_within(&group.call_all(|m| m.broadcast_pattern((3 << 20) + 5, 2)));
    assert_eq!(ok, vec![Ok(true); 4]);
    // Resizable: rank 1's bytes replace whatever the others had.
    let inputs = vec![vec![9u8; 100], b"hello from rank 1".to_vec(), Vec::new(), vec![1]];
    let out = get_all_within(&group.call_each(inputs, |m, d| m.broadcast_bytes(d, 1)).unwrap());
    assert_eq!(out, vec![Ok(b"hello from rank 1".to_vec()); 4]);
    // A root outside the group is an argument error on every rank (and leaves the group usable).
    let out = get_all_within(&group.call_all(|m| m.broadcast_bytes(Vec::new(), 4)));
    assert!(
        out.iter()
            .all(|r| r.as_ref().is_err_and(|e| e.contains("root must be below world size 4"))),
        "{out:?}"
    );
    // All-gather of blocks of different lengths (rank 0's is empty).
    let blocks: Vec<Vec<u8>> = (0..4u8).map(|r| vec![r; 3 * r as usize]).collect();
    let out = get_all_within(&group.call_each(blocks.clone(), |m, d| m.all_gather(d)).unwrap());
    assert_eq!(out, vec![Ok(blocks); 4]);
    group.kill().unwrap();
}

#[test]
fn barrier_waits_for_every_rank() {
    init();
    let group = connected_group("barrier", 4, Duration::from_secs(60));
    let early: Vec<_> = group.members()[..3].iter().map(|m| m.barrier()).collect();
    // Rank 3 has not entered: no early rank may leave (if one did within this window, the
    // barrier is broken; under load the window only gets safer).
    let (ready, _) = rtrun::wait(&early, 1, Some(Duration::from_millis(500))).unwrap();
    assert!(ready.is_empty(), "a rank left the barrier before rank 3 entered it");
    let last = group.members()[3].barrier();
    assert_eq!(last.get_timeout(LONG).unwrap(), Ok(()));
    assert_eq!(get_all_within(&early), vec![Ok(()); 3]);
    group.kill().unwrap();
}

#[test]
fn a_killed_rank_fails_the_collective_on_every_survivor() {
    init();
    let group = connected_group("killed", 4, Duration::from_secs(60));
    let pid = group.members()[3].pid().get_timeout(LONG).unwrap();
    kill9(pid);
    let results = get_all_within(
        &group.members()[..3]
            .iter()
            .map(|m| m.all_reduce(vec![1.0; 1000], ReduceOp::Sum))
            .collect::<Vec<_>>(),
    );
    for (rank, result) in results.iter().enumerate() {
        let error = result.as_ref().expect_err("a collective with a dead rank fails");
        assert!(error.contains("all_reduce"), "rank {rank}: {error}");
    }
    // The survivors' communicators stay failed instead of pretending to work.
    let again =
        get_all_within(&group.members()[..3].iter().map(|m| m.barrier()).collect::<Vec<_>>());
    assert!(
        again.iter().all(|r| r.as_ref().is_err_and(|e| e.contains("failed earlier"))),
        "{again:?}"
    );
    group.kill().unwrap();
}

#[test]
fn a_stuck_rank_times_out_every_survivor() {
    init();
    // A short timeout: the stopped rank makes no progress, so its neighbours give up after
    // 2 s and the failure travels around the ring.
    let group = connected_group("stuck", 3, Duration::from_secs(2));
    let pid = group.members()[1].pid().get_timeout(LONG).unwrap();
    rtrun_tests::signal(pid, libc::SIGSTOP);
    let results = get_all_within(
        &[0, 2].map(|r| group.members()[r].all_reduce(vec![1.0; 10], ReduceOp::Sum)),
    );
    rtrun_tests::signal(pid, libc::SIGCONT);
    for result in &results {
        let error = result.as_ref().expect_err("a collective with a stopped rank fails");
        assert!(error.contains("timed out") || error.contains("lost its connection"), "{error}");
    }
    assert!(
        results.iter().any(|r| r.as_ref().is_err_and(|e| e.contains("timed out after 2s"))),
        "{results:?}"
    );
    group.kill().unwrap();
}

#[test]
fn a_missing_rank_fails_the_rendezvous_within_the_timeout() {
    init();
    let group: ActorGroup<Rank> =
        ActorGroup::create("missing", 4, ActorOptions::default(), |_, opts| {
            Rank::remote_with(opts)
        })
        .unwrap();
    // Rank 2 never joins.
    let joined = get_all_within(&[0, 1, 3].map(|r| group.members()[r].connect(1500)));
    let master = joined[0].as_ref().expect_err("rank 0 cannot complete the rendezvous");
    assert!(master.contains("rank(s) [2] did not join"), "{master}");
    for error in &joined[1..] {
        let error = error.as_ref().expect_err("the other ranks are told");
        assert!(
            error.contains("rank(s) [2] did not join") || error.contains("no table"),
            "{error}"
        );
    }
    group.kill().unwrap();
}

#[test]
fn mismatched_buffer_lengths_are_an_error_on_every_rank() {
    init();
    let group = connected_group("mismatch", 3, Duration::from_secs(60));
    let inputs = vec![vec![1.0f32; 6], vec![1.0; 6], vec![1.0; 7]];
    let results =
        get_all_within(&group.call_each(inputs, |m, d| m.all_reduce(d, ReduceOp::Sum)).unwrap());
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert!(
        results
            .iter()
            .any(|r| r.as_ref().is_err_and(|e| e.contains("buffers of different lengths"))),
        "{results:?}"
    );
    // The failed communicators stay failed; a new rendezvous on the same master port gives
    // working ones.
    let joined = get_all_within(&group.call_all(|m| m.connect(60_000)));
    assert_eq!(joined, vec![Ok((0, 3)), Ok((1, 3)), Ok((2, 3))]);
    let results = get_all_within(&group.call_all(|m| m.all_reduce(vec![1.0, 2.0], ReduceOp::Sum)));
    assert_eq!(results, vec![Ok(vec![3.0, 6.0]); 3]);
    group.kill().unwrap();
}

#[test]
fn a_process_outside_any_group_has_no_collective() {
    init();
    let err = Communicator::from_group_context().unwrap_err();
    assert!(err.to_string().contains("not a member of an actor group"), "{err}");
    let err = Communicator::init(CollectiveConfig::new("g", 2, 2, "127.0.0.1", 1)).unwrap_err();
    assert!(err.to_string().contains("rank must be below world_size 2, found 2"), "{err}");
}
