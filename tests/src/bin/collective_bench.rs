//! Benchmark of the CPU collective: ring all-reduce bus bandwidth across worker processes, with
//! its anchor measured in the same run right before each size — the same ring traffic moved by
//! bare TCP loopback sockets (no framing, no reduction, no processes), which bounds what any
//! socket-based ring can reach on this machine.
//!
//! Bus bandwidth is nccl-tests' measure: `size / time · 2(n − 1)/n`, the bytes each rank's link
//! carries per second in an optimal ring, comparable with the raw link bandwidth.
//!
//! Run: `cargo run --release -p rtrun-tests --bin collective_bench [ranks] [MiB…]`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::Parser;
use clap::builder::RangedU64ValueParser;
use rtrun::collective::{Communicator, ReduceOp};
use rtrun::{ActorGroup, ActorOptions, Config};

/// Timed repetitions per size (after one warm-up), the median is reported.
const REPETITIONS: usize = 5;

/// Benchmark of the CPU collective: ring all-reduce bus bandwidth across worker processes, each
/// size next to its anchor (the same ring traffic over bare TCP loopback sockets).
#[derive(Parser)]
struct Args {
    /// Ranks of the ring (one worker process each).
    #[arg(default_value_t = 4, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    ranks: usize,
    /// Sizes of the all-reduced buffer, in MiB.
    #[arg(value_name = "MIB", default_values_t = [1, 16, 64])]
    sizes_mib: Vec<usize>,
}

struct BenchRank {
    comm: Option<Communicator>,
}

#[rtrun::actor]
impl BenchRank {
    pub fn new() -> Self {
        BenchRank { comm: None }
    }

    pub fn connect(&mut self) -> Result<usize, String> {
        let comm = Communicator::from_group_context().map_err(|e| e.to_string())?;
        let rank = comm.rank();
        self.comm = Some(comm);
        Ok(rank)
    }

    /// Seconds per all-reduce (sum) of `len` floats, each repetition started after a barrier.
    pub fn time_all_reduce(&mut self, len: usize, repetitions: usize) -> Result<Vec<f64>, String> {
        let comm = self.comm.as_mut().ok_or("connect first")?;
        let mut data = vec![1.0f32; len];
        let mut times = Vec::with_capacity(repetitions);
        for i in 0..=repetitions {
            comm.barrier().map_err(|e| e.to_string())?;
            let start = Instant::now();
            comm.all_reduce_f32(&mut data, ReduceOp::Sum).map_err(|e| e.to_string())?;
            if i > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        Ok(times)
    }
}

/// The anchor: the same traffic as a ring all-reduce of `bytes` on `ranks` ranks, moved by
/// plain TCP loopback sockets with nothing else — `ranks` links in a ring, each carrying
/// `bytes · 2(n − 1)/n` in 1 MiB writes while its reader drains it, all links at once (so they
/// share this machine's cores as the ranks do). Returns the per-link bytes per second, the
/// ceiling of a socket ring's bus bandwidth here.
fn raw_ring_bandwidth(ranks: usize, bytes: usize) -> anyhow::Result<f64> {
    let per_link = (bytes as f64 * 2.0 * (ranks as f64 - 1.0) / ranks as f64) as usize;
    let mut pairs = Vec::with_capacity(ranks);
    for _ in 0..ranks {
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        let writer = TcpStream::connect(listener.local_addr()?)?;
        writer.set_nodelay(true)?;
        let (reader, _) = listener.accept()?;
        pairs.push((writer, reader));
    }
    // Threads are started before the clock and released together, so only the transfer counts.
    let start_line = std::sync::Barrier::new(2 * ranks + 1);
    let elapsed = std::thread::scope(|scope| -> anyhow::Result<Duration> {
        let mut handles = Vec::new();
        let start_line = &start_line;
        for (mut writer, mut reader) in pairs {
            handles.push(scope.spawn(move || -> std::io::Result<()> {
                start_line.wait();
                let chunk = vec![7u8; 1 << 20];
                let mut left = per_link;
                while left > 0 {
                    let n = left.min(chunk.len());
                    writer.write_all(&chunk[..n])?;
                    left -= n;
                }
                Ok(())
            }));
            handles.push(scope.spawn(move || -> std::io::Result<()> {
                start_line.wait();
                let mut buf = vec![0u8; 1 << 20];
                let mut left = per_link;
                while left > 0 {
                    let n = reader.read(&mut buf[..left.min(1 << 20)])?;
                    if n == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    left -= n;
                }
                Ok(())
            }));
        }
        start_line.wait();
        let start = Instant::now();
        for handle in handles {
            handle.join().map_err(|_| anyhow::anyhow!("an anchor thread panicked"))??;
        }
        Ok(start.elapsed())
    })?;
    Ok(per_link as f64 / elapsed.as_secs_f64())
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> anyhow::Result<()> {
    // A worker process (this executable re-run by the runtime) serves its assignment here and
    // never returns: only the driver reads the command line.
    rtrun::run_worker_if_requested();
    let Args { ranks, sizes_mib } = Args::parse();
    rtrun::init_with(Config { num_cpus: Some(2.0), ..Default::default() })?;

    let group: ActorGroup<BenchRank> =
        ActorGroup::create("bench", ranks, ActorOptions::default(), |_, o| {
            BenchRank::remote_with(o)
        })?;
    for r in group.call_all(|m| m.connect()) {
        r.get_timeout(Duration::from_secs(120))?.map_err(anyhow::Error::msg)?;
    }
    let bus_factor = 2.0 * (ranks as f64 - 1.0) / ranks as f64;
    println!(
        "ring all-reduce (f32 sum), {ranks} ranks, {} cores; median of {REPETITIONS}",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:>8} {:>12} {:>14} {:>14} {:>14} {:>8}",
        "size", "time", "algbw", "busbw", "raw ring", "ratio"
    );
    for mib in sizes_mib {
        let bytes = mib << 20;
        let anchor = median(
            (0..3).map(|_| raw_ring_bandwidth(ranks, bytes)).collect::<anyhow::Result<_>>()?,
        );
        let times: Vec<Vec<f64>> = group
            .call_all(|m| m.time_all_reduce(bytes / 4, REPETITIONS))
            .iter()
            .map(|r| r.get_timeout(Duration::from_secs(600))?.map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<_>>()?;
        // A collective finishes when its slowest rank does.
        let slowest: Vec<f64> =
            (0..REPETITIONS).map(|i| times.iter().map(|t| t[i]).fold(0.0, f64::max)).collect();
        let time = median(slowest);
        let algbw = bytes as f64 / time;
        let busbw = algbw * bus_factor;
        println!(
            "{:>5} MiB {:>10.2} ms {:>9.0} MiB/s {:>9.0} MiB/s {:>9.0} MiB/s {:>7.2}",
            mib,
            time * 1e3,
            algbw / (1 << 20) as f64,
            busbw / (1 << 20) as f64,
            anchor / (1 << 20) as f64,
            busbw / anchor
        );
    }
    group.kill()?;
    Ok(())
}
