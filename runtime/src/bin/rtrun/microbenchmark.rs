//! `rtrun microbenchmark`: the operations of Ray's `python/ray/_private/ray_perf.py`, with the
//! same call shapes and in-flight counts, timed like Ray's `timeit` (see `rtrun::bench`).

use std::time::Duration;

use rtrun::bench::{TimingConfig, timeit};
use rtrun::{ActorOptions, Config, ObjectRef, PlacementGroupOptions, TaskOptions};

/// Ray's `Actor` (declared with `num_cpus=0`).
struct BenchActor;

#[rtrun::actor]
impl BenchActor {
    pub fn new() -> Self {
        BenchActor
    }

    pub fn small_value(&self) -> Vec<u8> {
        b"ok".to_vec()
    }
}

/// Ray's `Client`: calls every server `n` times and waits for all replies.
struct Client {
    servers: Vec<BenchActorRef>,
}

#[rtrun::actor]
impl Client {
    pub fn new(servers: Vec<BenchActorRef>) -> Self {
        Client { servers }
    }

    pub fn small_value_batch(&self, n: usize) -> Result<(), String> {
        let refs: Vec<ObjectRef<Vec<u8>>> =
            self.servers.iter().flat_map(|s| (0..n).map(move |_| s.small_value())).collect();
        rtrun::get_all(&refs).map(|_| ()).map_err(|e| e.to_string())
    }
}

#[rtrun::remote]
fn small_value() -> Vec<u8> {
    b"ok".to_vec()
}

/// Ray's `work`: one client task calling the actors round-robin.
#[rtrun::remote]
fn work(actors: Vec<BenchActorRef>, n: usize) -> Result<(), String> {
    let refs: Vec<ObjectRef<Vec<u8>>> =
        (0..n).map(|i| actors[i % actors.len()].small_value()).collect();
    rtrun::get_all(&refs).map(|_| ()).map_err(|e| e.to_string())
}

fn selected(pattern: &str, name: &str) -> bool {
    pattern.is_empty() || name.contains(pattern)
}

/// Runs the metrics matching `pattern` and prints one line each in Ray's format.
pub fn run(pattern: &str, round_seconds: f64) -> anyhow::Result<()> {
    // Ray's microbenchmark cluster offers a `custom` resource for its placement-group metric.
    rtrun::init_with(Config {
        resources: [("custom".to_owned(), 100.0)].into_iter().collect(),
        ..Default::default()
    })?;
    let timing =
        TimingConfig { round: Duration::from_secs_f64(round_seconds), ..Default::default() };
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
    let n_cpu = (cpus / 2).max(1);
    let report = |name: &str,
                  multiplier: f64,
                  op: &mut dyn FnMut() -> rtrun::Result<()>|
     -> anyhow::Result<()> {
        if selected(pattern, name) {
            let m = timeit(name, &timing, multiplier, op)?;
            println!("{m}");
        }
        Ok(())
    };

    let value = rtrun::put(&0u64)?;
    report("single client get calls (Plasma Store)", 1.0, &mut || value.get().map(|_| ()))?;
    report("single client put calls (Plasma Store)", 1.0, &mut || rtrun::put(&0u64).map(|_| ()))?;
    if selected(pattern, "single client put gigabytes") {
        // Ray puts an 800 MB int64 array; here 800 MB of raw bytes.
        let array = serde_bytes::ByteBuf::from(vec![0u8; 100 * 1024 * 1024 * 8]);
        report("single client put gigabytes", 8.0 * 0.1, &mut || rtrun::put(&array).map(|_| ()))?;
    }

    report("single client tasks sync", 1.0, &mut || small_value::remote().get().map(|_| ()))?;
    report("single client tasks async", 1000.0, &mut || {
        let refs: Vec<_> = (0..1000).map(|_| small_value::remote()).collect();
        rtrun::get_all(&refs).map(|_| ())
    })?;

    if selected(pattern, "1:1 actor calls sync") {
        let a = BenchActor::remote()?;
        report("1:1 actor calls sync", 1.0, &mut || a.small_value().get().map(|_| ()))?;
    }
    if selected(pattern, "1:1 actor calls async") {
        let a = BenchActor::remote()?;
        report("1:1 actor calls async", 1000.0, &mut || {
            let refs: Vec<_> = (0..1000).map(|_| a.small_value()).collect();
            rtrun::get_all(&refs).map(|_| ())
        })?;
    }
    if selected(pattern, "1:1 actor calls concurrent") {
        let a = BenchActor::remote_with(ActorOptions::default().max_concurrency(16))?;
        report("1:1 actor calls concurrent", 1000.0, &mut || {
            let refs: Vec<_> = (0..1000).map(|_| a.small_value()).collect();
            rtrun::get_all(&refs).map(|_| ())
        })?;
    }
    if selected(pattern, "1:n actor calls async") {
        let n = 5000;
        let actors = (0..n_cpu).map(|_| BenchActor::remote()).collect::<rtrun::Result<Vec<_>>>()?;
        let client = Client::remote(actors.clone())?;
        report("1:n actor calls async", (n * actors.len()) as f64, &mut || {
            client
                .small_value_batch(n)
                .get()?
                .map_err(|e| rtrun::Error::TaskFailed { target: "client".into(), message: e })
        })?;
    }
    if selected(pattern, "n:n actor calls async") {
        let (n, m) = (5000, 4);
        let actors = (0..n_cpu).map(|_| BenchActor::remote()).collect::<rtrun::Result<Vec<_>>>()?;
        report("n:n actor calls async", (m * n) as f64, &mut || {
            let refs: Vec<_> = (0..m)
                .map(|_| work::remote_with(TaskOptions::default(), actors.clone(), n))
                .collect();
            for r in rtrun::get_all(&refs)? {
                r.map_err(|e| rtrun::Error::TaskFailed { target: "work".into(), message: e })?;
            }
            Ok(())
        })?;
    }
    if selected(pattern, "placement group create/removal") {
        // Ray's shape: 100 one-bundle groups of `{custom: 0.001}`, wait for each, remove each.
        let num_groups = 100;
        let options = PlacementGroupOptions::uniform(1, &[("custom", 0.001)])?;
        report("placement group create/removal", num_groups as f64, &mut || {
            let groups = (0..num_groups)
                .map(|_| rtrun::placement_group(options.clone()))
                .collect::<rtrun::Result<Vec<_>>>()?;
            for group in &groups {
                if !group.wait(Duration::from_secs(30))? {
                    return Err(rtrun::Error::Timeout(Duration::from_secs(30)));
                }
            }
            groups.iter().try_for_each(|group| group.remove())
        })?;
    }
    rtrun::shutdown();
    Ok(())
}
