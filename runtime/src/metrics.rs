//! Prometheus metrics over HTTP (`rtrun head|join --metrics-port`, `train --metrics-port`).
//!
//! Each scrape builds a fresh [`Registry`] from a snapshot of this process's runtime, so what is
//! served is what `rtrun status` would say at that moment:
//! - in the process holding the control plane (a cluster head, an embedded driver): nodes by
//!   state, each node's resources total and used, actors by state, tasks (queued, running,
//!   finished, failed), worker processes, placement groups by state, jobs by state;
//! - in a node process (head, node daemon, embedded driver): its object store (capacity, used,
//!   in memory, spilled, objects, spills and restores since start) and the objects it pulled
//!   from other nodes (count, bytes, a latency histogram);
//! - in every process: the latency of the actor calls it made, by actor type (a histogram);
//! - whatever the embedding program adds ([`MetricsSource`], e.g. `train`'s step metrics).
//!
//! The encoding is `prometheus-client`'s (OpenMetrics text, which Prometheus scrapes); the
//! server is axum on a thread of its own, so a slow scrape never touches the runtime's threads.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::error::{Error, Result};
use crate::runtime::Runtime;
use rtrun_object_store::StoreStats;

/// Adds metrics to a scrape's registry (called once per scrape, on the server's thread).
pub type MetricsSource = Arc<dyn Fn(&mut Registry) + Send + Sync>;

/// Labels of one sample: `(name, value)` pairs.
pub type Labels = Vec<(String, String)>;

/// A float gauge (prometheus-client's default gauge holds integers).
pub type FloatGauge = Gauge<f64, AtomicU64>;

/// A family of histograms by label set (its constructor gives each the buckets).
type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

/// Counters that live as long as the process (cumulative, unlike the snapshot gauges).
struct ProcessMetrics {
    pulls: Counter,
    pulled_bytes: Counter,
    pull_seconds: Histogram,
    actor_calls: Histograms,
}

static PROCESS: LazyLock<ProcessMetrics> = LazyLock::new(|| ProcessMetrics {
    pulls: Counter::default(),
    pulled_bytes: Counter::default(),
    // 1 ms .. ~33 s.
    pull_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
    // 50 µs .. ~26 s.
    actor_calls: Family::new_with_constructor(|| {
        Histogram::new(exponential_buckets(5e-5, 2.0, 20))
    }),
});

/// The call-latency histogram of actors of `type_name` called from this process (a submitter
/// resolves it once; each reply observes it).
pub(crate) fn actor_call_histogram(type_name: &str) -> Histogram {
    let short = type_name.rsplit("::").next().unwrap_or(type_name);
    PROCESS.actor_calls.get_or_create(&labels(&[("type", short)])).clone()
}

/// Records an object copied from another node into this node's store.
pub(crate) fn record_pull(bytes: u64, took: Duration) {
    PROCESS.pulls.inc();
    PROCESS.pulled_bytes.inc_by(bytes);
    PROCESS.pull_seconds.observe(took.as_secs_f64());
}

/// A gauge family registered under `name`; set its samples after registering.
pub fn gauge_family(registry: &mut Registry, name: &str, help: &str) -> Family<Labels, FloatGauge> {
    let family = Family::<Labels, FloatGauge>::default();
    registry.register(name, help, family.clone());
    family
}

/// One unlabelled gauge registered under `name` with `value`.
pub fn gauge(registry: &mut Registry, name: &str, help: &str, value: f64) {
    let gauge = FloatGauge::default();
    gauge.set(value);
    registry.register(name, help, gauge);
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn counter(registry: &mut Registry, name: &str, help: &str, value: u64) {
    let counter = Counter::<u64>::default();
    counter.inc_by(value);
    registry.register(name, help, counter);
}

/// The control plane's view: nodes, resources, actors, tasks, workers, groups, jobs.
fn cluster_metrics(runtime: &Arc<Runtime>, registry: &mut Registry) -> Result<()> {
    let info = runtime.cluster_info()?;
    let nodes = gauge_family(registry, "rtrun_nodes", "Nodes of the cluster by state");
    let alive = info.nodes.iter().filter(|n| n.alive).count();
    nodes.get_or_create(&labels(&[("state", "alive")])).set(alive as f64);
    nodes.get_or_create(&labels(&[("state", "dead")])).set((info.nodes.len() - alive) as f64);
    let total = gauge_family(
        registry,
        "rtrun_node_resource_total",
        "Resources a live node offers (CPU, GPU, memory, custom)",
    );
    let used = gauge_family(registry, "rtrun_node_resource_used", "Resources held on a live node");
    for node in info.nodes.iter().filter(|n| n.alive) {
        let id = node.node.to_string();
        for (resource, amount) in &node.total {
            let key = labels(&[("node", &id), ("node_name", &node.name), ("resource", resource)]);
            total.get_or_create(&key).set(*amount);
            let free = node.available.get(resource).copied().unwrap_or(*amount);
            used.get_or_create(&key).set(amount - free);
        }
    }
    gauge(
        registry,
        "rtrun_worker_processes",
        "Live worker processes (actors and task workers)",
        info.workers as f64,
    );
    let tasks = gauge_family(registry, "rtrun_tasks", "Tasks waiting or running now");
    tasks.get_or_create(&labels(&[("state", "queued")])).set(info.tasks.queued as f64);
    tasks.get_or_create(&labels(&[("state", "running")])).set(info.tasks.running as f64);
    counter(
        registry,
        "rtrun_tasks_finished",
        "Tasks answered with a value since the head started",
        info.tasks.finished,
    );
    counter(
        registry,
        "rtrun_tasks_failed",
        "Tasks answered with an error since the head started",
        info.tasks.failed,
    );

    let actors = gauge_family(registry, "rtrun_actors", "Actors by state");
    for state in ["PENDING", "STARTING", "ALIVE", "DEAD"] {
        actors.get_or_create(&labels(&[("state", &state.to_lowercase())])).set(0.0);
    }
    for actor in runtime.list_actors()? {
        let state = actor.state.split(' ').next().unwrap_or_default().to_lowercase();
        actors.get_or_create(&labels(&[("state", &state)])).inc();
    }
    let groups = gauge_family(registry, "rtrun_placement_groups", "Placement groups by state");
    for state in ["pending", "created"] {
        groups.get_or_create(&labels(&[("state", state)])).set(0.0);
    }
    for group in runtime.list_placement_groups()? {
        let state = format!("{:?}", group.status).to_lowercase();
        groups.get_or_create(&labels(&[("state", &state)])).inc();
    }
    let jobs = gauge_family(registry, "rtrun_jobs", "Submitted jobs by state");
    for state in ["running", "succeeded", "failed", "stopped"] {
        jobs.get_or_create(&labels(&[("state", state)])).set(0.0);
    }
    for job in runtime.list_jobs()? {
        let state = job.state.to_string();
        let state = state.split([' ', '(']).next().unwrap_or_default().to_lowercase();
        jobs.get_or_create(&labels(&[("state", &state)])).inc();
    }
    Ok(())
}

/// This node's object store and the pulls into it, and its machine's GPUs.
fn node_metrics(runtime: &Arc<Runtime>, registry: &mut Registry) -> Result<()> {
    let Some(stats) = runtime.node_store_stats()? else { return Ok(()) };
    store_metrics(runtime, registry, stats);
    gpu_metrics(registry, &runtime.node().to_string(), &crate::gpus::sample_gpus());
    Ok(())
}

/// Each GPU's memory and utilisation (what `nvidia-smi` shows; nothing on a machine without
/// NVML), labelled by node, index and UUID as Ray's and DCGM's exporters label them.
pub fn gpu_metrics(registry: &mut Registry, node: &str, gpus: &[crate::gpus::GpuSample]) {
    if gpus.is_empty() {
        return;
    }
    let used = gauge_family(registry, "rtrun_gpu_memory_used_bytes", "GPU memory in use");
    let total = gauge_family(registry, "rtrun_gpu_memory_total_bytes", "GPU memory in all");
    let util = gauge_family(
        registry,
        "rtrun_gpu_utilization_ratio",
        "Share of the last sample period in which a kernel ran on the GPU (0 to 1)",
    );
    let mem_util = gauge_family(
        registry,
        "rtrun_gpu_memory_bandwidth_utilization_ratio",
        "Share of the last sample period in which GPU memory was read or written (0 to 1)",
    );
    for gpu in gpus {
        let index = gpu.index.to_string();
        let labels =
            labels(&[("node", node), ("gpu", &index), ("uuid", &gpu.uuid), ("name", &gpu.name)]);
        used.get_or_create(&labels).set(gpu.memory_used as f64);
        total.get_or_create(&labels).set(gpu.memory_total as f64);
        util.get_or_create(&labels).set(f64::from(gpu.utilization_percent) / 100.0);
        mem_util.get_or_create(&labels).set(f64::from(gpu.memory_utilization_percent) / 100.0);
    }
}

/// This node's object store (`stats`) and the pulls into it.
fn store_metrics(runtime: &Arc<Runtime>, registry: &mut Registry, stats: StoreStats) {
    let node = runtime.node().to_string();
    let store = |registry: &mut Registry, name: &str, help: &str, value: u64| {
        let family = gauge_family(registry, name, help);
        family.get_or_create(&labels(&[("node", &node)])).set(value as f64);
    };
    store(registry, "rtrun_object_store_capacity_bytes", "Object store capacity", stats.capacity);
    store(
        registry,
        "rtrun_object_store_used_bytes",
        "Object store bytes reserved by allocations",
        stats.used_bytes,
    );
    store(
        registry,
        "rtrun_object_store_in_memory_bytes",
        "Bytes of objects in memory",
        stats.bytes_in_memory,
    );
    store(
        registry,
        "rtrun_object_store_on_disk_bytes",
        "Bytes of objects spilled to disk and not in memory",
        stats.bytes_spilled,
    );
    store(registry, "rtrun_object_store_objects", "Objects in the store", stats.objects);
    let cumulative = |registry: &mut Registry, name: &str, help: &str, value: u64| {
        let family = Family::<Labels, Counter>::default();
        family.get_or_create(&labels(&[("node", &node)])).inc_by(value);
        registry.register(name, help, family);
    };
    let t = stats.transfers;
    cumulative(registry, "rtrun_object_store_spills", "Objects spilled to disk", t.spills);
    cumulative(
        registry,
        "rtrun_object_store_spilled_bytes",
        "Bytes spilled to disk",
        t.spilled_bytes,
    );
    cumulative(registry, "rtrun_object_store_restores", "Objects restored from disk", t.restores);
    cumulative(
        registry,
        "rtrun_object_store_restored_bytes",
        "Bytes restored from disk",
        t.restored_bytes,
    );
    registry.register(
        "rtrun_object_pulls",
        "Objects copied into this node's store from other nodes",
        PROCESS.pulls.clone(),
    );
    registry.register(
        "rtrun_object_pulled_bytes",
        "Bytes copied into this node's store from other nodes",
        PROCESS.pulled_bytes.clone(),
    );
    registry.register(
        "rtrun_object_pull_seconds",
        "Time to copy an object from another node",
        PROCESS.pull_seconds.clone(),
    );
}

/// The session's control plane, this node's object store and GPUs as any process of the session
/// sees them (asked of the head and of the node): for a program that serves an embedded
/// session's metrics from one of its workers, as `train`'s trainer actor does. Nothing when
/// this process holds the control plane or is a node, whose own endpoint serves them already.
pub fn session_source() -> MetricsSource {
    Arc::new(|registry| {
        let Ok(runtime) = crate::runtime::current() else { return };
        if runtime.holds_control_plane() || matches!(runtime.node_store_stats(), Ok(Some(_))) {
            return;
        }
        if let Err(e) = cluster_metrics(runtime, registry) {
            tracing::debug!("session metrics: {e}");
        }
        match runtime.store_client().and_then(|store| store.stats()) {
            Ok(stats) => store_metrics(runtime, registry, stats),
            Err(e) => tracing::debug!("session metrics: the node's store: {e}"),
        }
        gpu_metrics(registry, &runtime.node().to_string(), &crate::gpus::sample_gpus());
    })
}

/// The metrics text of this process now (without the runtime's part before it is started).
pub fn render(sources: &[MetricsSource]) -> Result<String> {
    let mut registry = Registry::default();
    registry.register(
        "rtrun_actor_call_seconds",
        "Actor method calls made by this process, submission to reply, by actor type",
        PROCESS.actor_calls.clone(),
    );
    if let Ok(runtime) = crate::runtime::current() {
        if runtime.holds_control_plane() {
            cluster_metrics(runtime, &mut registry)?;
        }
        node_metrics(runtime, &mut registry)?;
    }
    for source in sources {
        source(&mut registry);
    }
    let mut text = String::new();
    encode(&mut text, &registry).map_err(|e| Error::System(format!("encoding metrics: {e}")))?;
    Ok(text)
}

/// A running metrics endpoint; stops when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    address: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl MetricsServer {
    /// The address it listens on (the port chosen when 0 was asked for).
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// Serves `GET /metrics` on `bind`: this process's runtime (once started) plus `sources`. A
/// port in use is an error naming it, returned before anything is served.
pub fn serve(bind: SocketAddr, sources: Vec<MetricsSource>) -> Result<MetricsServer> {
    let listener = crate::http::listen("metrics endpoint", bind)?;
    let sources = Arc::new(sources);
    let app =
        axum::Router::new().route("/metrics", axum::routing::get(move || scrape(sources.clone())));
    let (address, shutdown) = crate::http::serve("metrics endpoint", listener, app)?;
    Ok(MetricsServer { address, shutdown: Some(shutdown) })
}

async fn scrape(
    sources: Arc<Vec<MetricsSource>>,
) -> (axum::http::StatusCode, [(axum::http::header::HeaderName, &'static str); 1], String) {
    use axum::http::{StatusCode, header};
    // The snapshot asks the control plane and blocks: off the server's thread.
    let text = tokio::task::spawn_blocking(move || render(&sources)).await;
    match text {
        Ok(Ok(text)) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            text,
        ),
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("rtrun metrics unavailable: {e}\n"),
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("rtrun metrics failed: {e}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpus::GpuSample;

    #[test]
    fn gpu_samples_become_labelled_gauges_and_no_gpu_adds_none() {
        let sample = |index: u32, used: u64, util: u32| GpuSample {
            index,
            uuid: format!("GPU-{index}"),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_used: used,
            memory_total: 85_899_345_920,
            utilization_percent: util,
            memory_utilization_percent: 40,
        };
        let mut registry = Registry::default();
        gpu_metrics(&mut registry, "n1", &[sample(0, 1 << 30, 97), sample(1, 0, 0)]);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        let labels = |i: u32| {
            format!("{{node=\"n1\",gpu=\"{i}\",uuid=\"GPU-{i}\",name=\"NVIDIA H100 80GB HBM3\"}}")
        };
        for line in [
            format!("rtrun_gpu_memory_used_bytes{} 1073741824.0", labels(0)),
            format!("rtrun_gpu_memory_used_bytes{} 0.0", labels(1)),
            format!("rtrun_gpu_memory_total_bytes{} 85899345920.0", labels(1)),
            format!("rtrun_gpu_utilization_ratio{} 0.97", labels(0)),
            format!("rtrun_gpu_memory_bandwidth_utilization_ratio{} 0.4", labels(0)),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        let mut empty = Registry::default();
        gpu_metrics(&mut empty, "n1", &[]);
        let mut text = String::new();
        encode(&mut text, &empty).unwrap();
        assert!(!text.contains("rtrun_gpu"), "{text}");
        // This machine has no NVML (CI and the CPU test machines): sampling answers nothing
        // rather than failing the scrape.
        if !std::path::Path::new(crate::gpus::PROC_NVIDIA_GPUS).exists() {
            assert!(crate::gpus::sample_gpus().is_empty());
        }
    }
}
