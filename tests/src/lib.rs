//! Shared helpers for rtrun's multi-process tests: process inspection and bounded polling.

use std::time::{Duration, Instant};

pub mod cluster;

/// Whether a process with this pid exists and is not a zombie.
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state is the first field after the parenthesised command name.
            let state = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next());
            !matches!(state, Some("Z") | Some("X") | None)
        }
        Err(_) => false,
    }
}

/// `len` deterministic bytes from the xorshift state `state` (non-zero), so any process can
/// make or check every byte.
pub fn xorshift_bytes(mut state: u64, len: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

/// Polls `condition` every few milliseconds until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sends `signal` (`libc::SIGSTOP`, ...) to a process: the tests' one `kill(2)` call.
pub fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

/// Sends SIGKILL to a process.
pub fn kill9(pid: u32) {
    signal(pid, libc::SIGKILL);
}

/// Every process descended from `pid` (children first found, then theirs), from `/proc`.
pub fn descendants(pid: u32) -> Vec<u32> {
    let parents: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|child| {
            let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).ok()?;
            // The parent is the second field after the parenthesised command name.
            let parent = stat.rsplit(')').next()?.split_whitespace().nth(1)?.parse().ok()?;
            Some((child, parent))
        })
        .collect();
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for &(child, _) in parents.iter().filter(|(_, p)| *p == parent) {
            found.push(child);
            frontier.push(child);
        }
    }
    found
}

/// A process descended from `parent` whose environment holds `var=value` (the RLHF trainers
/// mark each role rank's worker with `RTRUN_RLHF_ROLE=<role>:<rank>`), from `/proc`.
pub fn descendant_with_env(parent: u32, var: &str, value: &str) -> Option<u32> {
    let marker = format!("{var}={value}");
    descendants(parent).into_iter().find(|pid| {
        std::fs::read(format!("/proc/{pid}/environ"))
            .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == marker.as_bytes()))
    })
}

/// Waits until `marker` (a checkpoint's completion file) exists while `child` runs, then kills
/// it (SIGKILL). Panics when the child ends first, when `limit` passes, or when the child
/// finished before it could be killed.
pub fn kill_once_written(
    child: &mut std::process::Child,
    marker: &std::path::Path,
    limit: Duration,
) {
    let deadline = std::time::Instant::now() + limit;
    while !marker.is_file() {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            panic!("the run ended ({status}) before {}", marker.display());
        }
        assert!(std::time::Instant::now() < deadline, "no {} within {limit:?}", marker.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        child.try_wait().expect("waiting for the child").is_none(),
        "the run must still be going when it is killed"
    );
    child.kill().expect("killing the child");
    child.wait().expect("reaping the child");
}

/// The step a driver's stderr says it resumed from (`resuming from …/step_000002`).
pub fn resumed_from(stderr: &str) -> Option<u64> {
    stderr
        .lines()
        .find_map(|l| l.strip_prefix("resuming from "))
        .and_then(|dir| dir.rsplit("step_").next())
        .and_then(|step| {
            let digits = step.find(|c: char| !c.is_ascii_digit()).unwrap_or(step.len());
            step[..digits].parse().ok()
        })
}

/// The `rtrun` binary of this build, built first when it is missing (the workspace test run
/// builds it, because `runtime/tests/cli.rs` uses it). Test binaries live in
/// `<target>/<profile>/deps/`, the `rtrun` binary in `<target>/<profile>/`; Cargo gives other
/// packages' binaries to integration tests only within their own package, hence the search.
pub fn rtrun_binary() -> std::path::PathBuf {
    runtime_artifact("--bin", "rtrun", "")
}

/// A binary or example of the `rtrun` package in this test's target and profile, built when
/// missing.
fn runtime_artifact(kind: &str, name: &str, subdir: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("test binaries live in <target>/<profile>/deps");
    let binary = profile_dir.join(subdir).join(name);
    if !binary.exists() {
        let target_dir = profile_dir.parent().expect("<target>/<profile>");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let mut command = std::process::Command::new(cargo);
        command.args(["build", "-p", "rtrun", kind, name, "--target-dir"]);
        command.arg(target_dir);
        if profile_dir.file_name().is_some_and(|name| name == "release") {
            command.arg("--release");
        }
        let status = command.status().expect("cargo runs");
        assert!(status.success(), "building {name} failed");
    }
    binary
}

/// Loads `url` in headless Chromium (`$RTRUN_CHROMIUM`, else `chromium`): returns its DOM after
/// load and writes a 1280×860 screenshot to `png` (the dashboard tests).
pub fn browse(url: &str, png: &std::path::Path) -> String {
    let chromium = std::env::var("RTRUN_CHROMIUM").unwrap_or_else(|_| "chromium".to_owned());
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(&chromium)
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"])
            .arg("--window-size=1280,860")
            .arg(format!("--user-data-dir={}", png.with_extension("profile").display()))
            .args(extra)
            .arg(url)
            .output()
            .unwrap_or_else(|e| {
                panic!("`{chromium}` does not run ({e}): the dashboard test needs Chromium (scripts/test.sh installs it)")
            });
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let dom = run(&["--dump-dom"]);
    run(&[&format!("--screenshot={}", png.display())]);
    let size = std::fs::metadata(png).map(|m| m.len()).unwrap_or(0);
    assert!(size > 5_000, "{} is {size} bytes", png.display());
    dom
}
