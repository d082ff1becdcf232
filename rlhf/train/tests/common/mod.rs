//! Helpers the `train` driver's tests share: a local walkthrough checkpoint, the driver's
//! command line, and running it to its end.

use std::path::Path;
use std::process::{Command, Stdio};

use rtrun_rlhf::demo::walkthrough::{WalkthroughConfig, WalkthroughFiles, write_walkthrough};

/// An untrained walkthrough checkpoint (no warm-up) and 240 + 24 problems.
pub fn walkthrough(dir: &Path) -> WalkthroughFiles {
    tch::set_num_threads(1);
    let config = WalkthroughConfig {
        train_problems: 240,
        test_problems: 24,
        vocab_size: 400,
        warmup: rtrun_rlhf::config::WarmupConfig { steps: 0, batch_size: 1, lr: 1e-3 },
        ..WalkthroughConfig::default()
    };
    write_walkthrough(&dir.join("walkthrough"), &config).unwrap()
}

/// The `train` driver with `config`, its run directory and `--set`s; stdout discarded,
/// stderr piped.
pub fn train(config: &Path, run_dir: &Path, sets: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
    cmd.arg("--config").arg(config).arg("--set").arg(format!("run_dir={}", run_dir.display()));
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    cmd
}

/// Runs the driver to its end; returns its stderr.
pub fn run_to_end(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "train failed: {stderr}");
    stderr
}
