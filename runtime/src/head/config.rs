//! The control plane's settings from the runtime's: the head node's resources (CPUs, custom
//! resources, GPUs detected or faked) and whether workers get their own
//! `CUDA_VISIBLE_DEVICES`.

use std::time::Duration;

use rtrun_placement::{CPU, GPU, NodeResources, ResourceSet};

use crate::error::{Error, Result};
use crate::runtime::Config;
use rtrun_head_core::HeadConfig;
use rtrun_proto::env::opt_out;

pub use rtrun_proto::env::NOSET_CUDA_VISIBLE_DEVICES_ENV;

/// The environment variable that sets how long a task worker may stay idle before it ends, in
/// seconds (default [`DEFAULT_TASK_WORKER_IDLE_TIMEOUT`]; Ray's
/// `idle_worker_killing_time_threshold_ms`). Read by the control plane's process.
pub const TASK_WORKER_IDLE_TIMEOUT_ENV: &str = "RTRUN_TASK_WORKER_IDLE_TIMEOUT_S";

/// 60 s: long enough that a job submitting tasks every RL step keeps its workers warm, short
/// enough that a finished run's workers do not stay for the life of the cluster.
pub const DEFAULT_TASK_WORKER_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

fn task_worker_idle_timeout() -> Result<Duration> {
    match std::env::var(TASK_WORKER_IDLE_TIMEOUT_ENV) {
        Ok(value) => value
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "{TASK_WORKER_IDLE_TIMEOUT_ENV}: expected a number of seconds >= 0, found \
                     `{value}`"
                ))
            }),
        Err(_) => Ok(DEFAULT_TASK_WORKER_IDLE_TIMEOUT),
    }
}

/// A node's resources from the runtime's settings: CPUs, custom resources and GPUs (detected,
/// limited by `CUDA_VISIBLE_DEVICES`, or fake ones from `num_gpus`), under placement id `id`.
pub(crate) fn node_resources(config: &Config, id: &str) -> Result<NodeResources> {
    Ok(node_of(config, id)?.0)
}

/// The head core's settings from the runtime's settings and this process's environment.
pub(crate) fn head_config(config: &Config) -> Result<HeadConfig> {
    let id = crate::ids::NodeId(0).to_string();
    let (node, cpus) = node_of(config, &id)?;
    let max_task_workers = (cpus.ceil() as usize).max(1) + 2;
    let noset = opt_out(std::env::var(NOSET_CUDA_VISIBLE_DEVICES_ENV).ok().as_deref());
    Ok(HeadConfig {
        node,
        max_task_workers,
        noset_cuda_visible_devices: noset,
        task_worker_idle_timeout: task_worker_idle_timeout()?,
        workers_on_head: true,
    })
}

/// This node's resources and its CPU count.
fn node_of(config: &Config, id: &str) -> Result<(NodeResources, f64)> {
    let cpus = config.num_cpus.unwrap_or_else(|| {
        std::thread::available_parallelism().map(|n| n.get() as f64).unwrap_or(1.0)
    });
    let mut pairs: Vec<(&str, f64)> = vec![(CPU, cpus)];
    for (name, amount) in &config.resources {
        if name == GPU {
            return Err(Error::Invalid(
                "node resources: expected GPUs in `num_gpus`, found `GPU` in `resources`".into(),
            ));
        }
        pairs.push((name.as_str(), *amount));
    }
    let resources = ResourceSet::from_floats(pairs)
        .map_err(|e| Error::Invalid(format!("node resources: {e}")))?;
    let id = rtrun_placement::NodeId::new(id);
    let (detected, source) = crate::gpus::detect_gpus();
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let gpus = crate::gpus::node_gpus(id.as_str(), detected, visible.as_deref(), config.num_gpus)?;
    tracing::debug!(gpus = gpus.len(), ?source, "node GPUs");
    let node = NodeResources::new(id, resources, gpus)
        .map_err(|e| Error::Invalid(format!("node resources: {e}")))?;
    Ok((node, cpus))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtrun_placement::Quantity;

    #[test]
    fn node_config_takes_gpus_from_num_gpus_only() {
        let config = Config { num_cpus: Some(4.0), num_gpus: Some(3.0), ..Default::default() };
        let head = head_config(&config).unwrap();
        assert_eq!(head.node.total().get(GPU), Quantity::whole(3));
        assert_eq!(head.node.gpus().slots().len(), 3);
        let config = Config { num_gpus: Some(2.5), ..Default::default() };
        let err = head_config(&config).unwrap_err();
        assert!(err.to_string().contains("whole non-negative number of GPUs"), "{err}");
        let config = Config {
            resources: [("GPU".to_owned(), 2.0)].into_iter().collect(),
            ..Default::default()
        };
        let err = head_config(&config).unwrap_err();
        assert!(err.to_string().contains("expected GPUs in `num_gpus`"), "{err}");
    }

    #[test]
    fn opt_out_values() {
        assert!(opt_out(Some("1")));
        assert!(opt_out(Some("true")));
        assert!(!opt_out(Some("0")));
        assert!(!opt_out(Some("")));
        assert!(!opt_out(None));
    }
}
