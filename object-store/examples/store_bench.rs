//! Object-store microbenchmark: put bandwidth of an 800 MB object into a warm arena, and get /
//! put calls per second for small objects, all through the `ObjectStore` API, with a plain
//! memcpy of the same size as the anchor measured side by side.
//!
//! `cargo run --release -p rtrun-object-store --example store_bench [ROUNDS] [--prefault]`
//!
//! The call rates are in-process (the node's own API, no message to another process), so they
//! bound what the runtime's local path can reach rather than compare with Ray's end-to-end
//! figures one to one.

use std::time::{Duration, Instant};

use clap::Parser;
use rtrun_object_store::{HolderId, ObjectId, ObjectStore, StoreConfig};

const BIG: usize = 800 * 1000 * 1000;
const SMALL: usize = 100;
const CALL_WINDOW: Duration = Duration::from_secs(2);
const NODE: HolderId = HolderId(1);

/// Object-store microbenchmark: put bandwidth of an 800 MB object into a 2 GiB store, and get /
/// put calls per second for small objects, with a plain memcpy of the same size as the anchor.
#[derive(Parser)]
struct Args {
    /// Puts of the 800 MB object (the first one meets cold pages).
    #[arg(default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Fault the store's pages into this process when it opens (MAP_POPULATE), so the first put
    /// meets no cold pages.
    #[arg(long)]
    prefault: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Args { rounds, prefault } = Args::parse();
    let opened = Instant::now();
    let store = ObjectStore::open(StoreConfig { prefault, ..StoreConfig::with_capacity(2 << 30) })?;
    println!(
        "open a 2 GiB store (prefault: {prefault})   : {:.2} s",
        opened.elapsed().as_secs_f64()
    );
    let source: Vec<u8> = (0..BIG).map(|i| (i * 31 % 251) as u8).collect();
    let mut next_id = 0u128;
    let mut fresh_id = || {
        next_id += 1;
        ObjectId(next_id)
    };

    // Anchor: memcpy into an already-faulted heap buffer.
    let mut target = vec![0u8; BIG];
    let mut memcpy_best = f64::MAX;
    for _ in 0..rounds.min(5) {
        let start = Instant::now();
        target.copy_from_slice(&source);
        memcpy_best = memcpy_best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(&target);
    drop(target);

    let mut put_times = Vec::new();
    for _ in 0..rounds {
        let id = fresh_id();
        let start = Instant::now();
        let allocation = store.create(id, BIG as u64, NODE)?;
        store.arena().writer(allocation)?.copy_from_slice(&source);
        store.seal(id)?;
        put_times.push(start.elapsed().as_secs_f64());
        store.remove_holder(id, NODE)?;
    }
    let gb = BIG as f64 / 1e9;
    let first = put_times[0];
    let warm: Vec<f64> = put_times.iter().skip(1).copied().collect();
    let warm_mean = warm.iter().sum::<f64>() / warm.len().max(1) as f64;
    let warm_best = warm.iter().copied().fold(f64::MAX, f64::min);
    println!("put 800 MB, first (cold pages) : {:.2} GB/s", gb / first);
    println!("put 800 MB, warm mean ({} runs)  : {:.2} GB/s", warm.len(), gb / warm_mean);
    println!("put 800 MB, warm best          : {:.2} GB/s", gb / warm_best);
    println!("memcpy 800 MB heap→heap, best  : {:.2} GB/s (anchor)", gb / memcpy_best);

    let small = vec![7u8; SMALL];
    let id = fresh_id();
    store.put(id, NODE, &small)?;
    let mut gets = 0u64;
    let start = Instant::now();
    while start.elapsed() < CALL_WINDOW {
        for _ in 0..1000 {
            let view = store.get(id, NODE)?;
            std::hint::black_box(view.as_bytes());
            gets += 1;
        }
    }
    println!(
        "get calls (pin + view + unpin) : {:.0} /s",
        gets as f64 / start.elapsed().as_secs_f64()
    );

    let mut puts = 0u64;
    let start = Instant::now();
    while start.elapsed() < CALL_WINDOW {
        for _ in 0..1000 {
            let id = fresh_id();
            store.put(id, NODE, &small)?;
            store.remove_holder(id, NODE)?;
            puts += 1;
        }
    }
    println!(
        "put calls (create+write+seal+free): {:.0} /s",
        puts as f64 / start.elapsed().as_secs_f64()
    );
    println!(
        "Ray 2.60 anchors on 2 cores (RESEARCH.md): put 6.05 GB/s, get calls 18,978/s, put calls 2,686/s"
    );
    Ok(())
}
