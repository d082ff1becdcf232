//! Finding the machine's GPUs without linking CUDA: `nvidia-smi` when it is installed, else the
//! NVIDIA kernel driver's `/proc/driver/nvidia/gpus/*/information` files. Either gives each
//! GPU's index and UUID; neither needs a CUDA library at build time or on CPU machines.
//!
//! Indices follow the PCI bus order (what `nvidia-smi` prints). CUDA numbers devices
//! fastest-first by default, so workers given `CUDA_VISIBLE_DEVICES` also get
//! `CUDA_DEVICE_ORDER=PCI_BUS_ID` and the two numberings agree.
//!
//! A `CUDA_VISIBLE_DEVICES` already set in the process that starts the node restricts the node to
//! the GPUs it lists (by index or UUID), as Ray does. `Config::num_gpus` overrides the count:
//! fewer than detected takes the first ones; more than detected adds fake GPUs with synthetic
//! UUIDs, which is how CPU machines test every placement behaviour.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rtrun_placement::GpuInstance;

use crate::error::{Error, Result};

/// How long `nvidia-smi` may take before it is given up on (a wedged driver can hang it).
pub const NVIDIA_SMI_TIMEOUT: Duration = Duration::from_secs(10);

/// The kernel driver's per-GPU directory.
pub const PROC_NVIDIA_GPUS: &str = "/proc/driver/nvidia/gpus";

/// One GPU's state now, as NVML reports it (for the metrics endpoint).
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSample {
    /// NVML's index (PCI bus order, as `nvidia-smi` numbers them).
    pub index: u32,
    /// Its UUID (`GPU-…`).
    pub uuid: String,
    /// Its product name.
    pub name: String,
    /// Memory in use, bytes.
    pub memory_used: u64,
    /// Memory in all, bytes.
    pub memory_total: u64,
    /// Percent of the last sample period in which a kernel ran.
    pub utilization_percent: u32,
    /// Percent of the last sample period in which memory was read or written.
    pub memory_utilization_percent: u32,
}

/// NVML, loaded once per process (`None` where libnvidia-ml is missing or fails to start:
/// CPU machines, containers without the driver's libraries).
static NVML: std::sync::LazyLock<Option<nvml_wrapper::Nvml>> =
    std::sync::LazyLock::new(|| match nvml_wrapper::Nvml::init() {
        Ok(nvml) => Some(nvml),
        Err(e) => {
            tracing::debug!("no GPU metrics: NVML is not available ({e})");
            None
        }
    });

/// Every GPU of this machine, sampled now through NVML; empty without NVML. A GPU that fails
/// to answer (fallen off the bus, reset) is skipped with a warning rather than failing the
/// scrape.
pub fn sample_gpus() -> Vec<GpuSample> {
    let Some(nvml) = NVML.as_ref() else { return Vec::new() };
    let count = match nvml.device_count() {
        Ok(count) => count,
        Err(e) => {
            tracing::warn!("NVML cannot count the GPUs: {e}");
            return Vec::new();
        }
    };
    let sample = |index: u32| -> std::result::Result<GpuSample, nvml_wrapper::error::NvmlError> {
        let device = nvml.device_by_index(index)?;
        let memory = device.memory_info()?;
        let rates = device.utilization_rates()?;
        Ok(GpuSample {
            index,
            uuid: device.uuid()?,
            name: device.name()?,
            memory_used: memory.used,
            memory_total: memory.total,
            utilization_percent: rates.gpu,
            memory_utilization_percent: rates.memory,
        })
    };
    (0..count)
        .filter_map(|index| {
            sample(index)
                .map_err(|e| tracing::warn!(index, "NVML cannot read GPU {index}: {e}"))
                .ok()
        })
        .collect()
}

/// Where the detected GPUs came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuSource {
    /// `nvidia-smi --query-gpu=index,uuid`.
    NvidiaSmi,
    /// `/proc/driver/nvidia/gpus/*/information`.
    ProcDriver,
    /// Nothing found: a machine without NVIDIA GPUs (or without their driver).
    None,
}

/// The GPUs of this machine, in index order, and where they were found.
pub fn detect_gpus() -> (Vec<GpuInstance>, GpuSource) {
    match query_nvidia_smi() {
        Ok(gpus) if !gpus.is_empty() => return (gpus, GpuSource::NvidiaSmi),
        Ok(_) => {}
        Err(e) => tracing::debug!("nvidia-smi gave no GPUs: {e}"),
    }
    match read_proc_driver(Path::new(PROC_NVIDIA_GPUS)) {
        Ok(gpus) if !gpus.is_empty() => (gpus, GpuSource::ProcDriver),
        _ => (Vec::new(), GpuSource::None),
    }
}

/// The GPUs a node offers: the detected ones, restricted by an inherited
/// `CUDA_VISIBLE_DEVICES` (`visible`), then cut or extended with fake GPUs to `requested`.
pub fn node_gpus(
    node: &str,
    detected: Vec<GpuInstance>,
    visible: Option<&str>,
    requested: Option<f64>,
) -> Result<Vec<GpuInstance>> {
    let mut gpus = match visible {
        Some(list) => restrict_to_visible(detected, list),
        None => detected,
    };
    let Some(requested) = requested else { return Ok(gpus) };
    if !requested.is_finite() || requested < 0.0 || requested.fract() != 0.0 {
        return Err(Error::Invalid(format!(
            "num_gpus must be a whole non-negative number of GPUs, found {requested}"
        )));
    }
    let requested = requested as usize;
    if requested <= gpus.len() {
        gpus.truncate(requested);
        return Ok(gpus);
    }
    if !gpus.is_empty() {
        tracing::warn!(
            detected = gpus.len(),
            requested,
            "num_gpus asks for more GPUs than the machine has; the rest are fake"
        );
    }
    let mut index = gpus.iter().map(|gpu| gpu.index + 1).max().unwrap_or(0);
    while gpus.len() < requested {
        gpus.push(GpuInstance::synthetic(node, index));
        index += 1;
    }
    Ok(gpus)
}

/// Keeps the GPUs a `CUDA_VISIBLE_DEVICES` value names (indices or UUIDs, comma-separated), in
/// the order it names them; an empty value hides them all.
pub fn restrict_to_visible(detected: Vec<GpuInstance>, visible: &str) -> Vec<GpuInstance> {
    let mut kept = Vec::new();
    for entry in visible.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let found = detected.iter().find(|gpu| {
            entry.parse::<u32>().is_ok_and(|index| index == gpu.index)
                || (entry.starts_with("GPU-") && gpu.uuid.starts_with(entry))
        });
        if let Some(gpu) = found
            && !kept.contains(gpu)
        {
            kept.push(gpu.clone());
        }
    }
    kept
}

/// Runs `nvidia-smi` and parses its CSV answer.
fn query_nvidia_smi() -> Result<Vec<GpuInstance>> {
    let mut child = Command::new("nvidia-smi")
        .args(["--query-gpu=index,uuid", "--format=csv,noheader"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + NVIDIA_SMI_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::System(format!(
                "nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut text = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        stdout.read_to_string(&mut text)?;
    }
    if !status.success() {
        return Err(Error::System(format!("nvidia-smi failed: {status}")));
    }
    parse_nvidia_smi_csv(&text)
}

/// Parses `nvidia-smi --query-gpu=index,uuid --format=csv,noheader` output: one
/// `<index>, <uuid>` line per GPU.
pub fn parse_nvidia_smi_csv(text: &str) -> Result<Vec<GpuInstance>> {
    let mut gpus = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = || {
            Error::Invalid(format!(
                "nvidia-smi line {}: expected `<index>, GPU-<uuid>`, found `{line}`",
                number + 1
            ))
        };
        let (index, uuid) = line.split_once(',').ok_or_else(bad)?;
        let index: u32 = index.trim().parse().map_err(|_| bad())?;
        let uuid = uuid.trim();
        if !uuid.starts_with("GPU-") {
            return Err(bad());
        }
        gpus.push(GpuInstance::new(index, uuid));
    }
    gpus.sort_by_key(|gpu| gpu.index);
    Ok(gpus)
}

/// Reads every `<dir>/<pci address>/information` file; GPUs are numbered in PCI bus order.
pub fn read_proc_driver(dir: &Path) -> Result<Vec<GpuInstance>> {
    let mut found: Vec<(String, String)> = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path().join("information");
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        if let Some(gpu) = parse_proc_information(&text) {
            found.push(gpu);
        }
    }
    found.sort();
    Ok(found
        .into_iter()
        .enumerate()
        .map(|(index, (_, uuid))| GpuInstance::new(index as u32, uuid))
        .collect())
}

/// The `(bus location, UUID)` of one driver `information` file, or `None` when it lacks them.
pub fn parse_proc_information(text: &str) -> Option<(String, String)> {
    let field = |name: &str| {
        text.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == name).then(|| value.trim().to_owned())
        })
    };
    let uuid = field("GPU UUID").filter(|uuid| uuid.starts_with("GPU-"))?;
    let bus = field("Bus Location").unwrap_or_default().to_ascii_lowercase();
    Some((bus, uuid))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMI: &str = "0, GPU-4a1b2c3d-1111-2222-3333-444455556666\n\
                       1, GPU-5a1b2c3d-1111-2222-3333-444455556666\n";

    #[test]
    fn parses_nvidia_smi_csv_and_rejects_garbage() {
        let gpus = parse_nvidia_smi_csv(SMI).unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[1].index, 1);
        assert_eq!(gpus[1].uuid, "GPU-5a1b2c3d-1111-2222-3333-444455556666");
        let err = parse_nvidia_smi_csv("No devices were found").unwrap_err();
        assert!(err.to_string().contains("expected `<index>, GPU-<uuid>`"), "{err}");
        assert!(parse_nvidia_smi_csv("x, GPU-1").is_err());
        assert!(parse_nvidia_smi_csv("").unwrap().is_empty());
    }

    #[test]
    fn proc_information_orders_by_bus() {
        let dir = std::env::temp_dir().join(format!("rtrun-gpus-{}", std::process::id()));
        for (bus, uuid) in [("0000:b1:00.0", "GPU-bbbb"), ("0000:3b:00.0", "GPU-aaaa")] {
            let sub = dir.join(bus);
            std::fs::create_dir_all(&sub).unwrap();
            let text = format!(
                "Model: \t\t NVIDIA H100\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\n\
                 Video BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n\
                 Bus Location: \t {bus}\nDevice Minor: \t 0\n"
            );
            std::fs::write(sub.join("information"), text).unwrap();
        }
        std::fs::create_dir_all(dir.join("not-a-gpu")).unwrap();
        let gpus = read_proc_driver(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(gpus, [GpuInstance::new(0, "GPU-aaaa"), GpuInstance::new(1, "GPU-bbbb")]);
    }

    #[test]
    fn visible_devices_and_requested_counts() {
        let detected = parse_nvidia_smi_csv(SMI).unwrap();
        let only_second = restrict_to_visible(detected.clone(), "1");
        assert_eq!(only_second, [detected[1].clone()]);
        let by_uuid = restrict_to_visible(detected.clone(), "GPU-4a1b2c3d");
        assert_eq!(by_uuid, [detected[0].clone()]);
        assert!(restrict_to_visible(detected.clone(), "").is_empty());

        let one = node_gpus("n", detected.clone(), None, Some(1.0)).unwrap();
        assert_eq!(one, [detected[0].clone()]);
        let four = node_gpus("n", detected.clone(), None, Some(4.0)).unwrap();
        assert_eq!(four.len(), 4);
        assert_eq!(four[2], GpuInstance::synthetic("n", 2));
        let fake = node_gpus("n", Vec::new(), None, Some(8.0)).unwrap();
        assert_eq!(fake, GpuInstance::synthetic_set("n", 8));
        assert_eq!(node_gpus("n", detected.clone(), None, None).unwrap(), detected);
        let err = node_gpus("n", Vec::new(), None, Some(1.5)).unwrap_err();
        assert!(err.to_string().contains("whole non-negative number of GPUs, found 1.5"), "{err}");
    }
}
