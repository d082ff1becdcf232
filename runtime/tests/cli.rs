//! Tests of the `rtrun` binary's command line that need no running session. (Running
//! `rtrun memory` against a live session is tested in the `tests/` package.) Having this test
//! here also makes Cargo build the binary for the workspace test run.

use std::process::Command;

#[test]
fn memory_without_a_matching_session_is_a_clear_error() {
    let output = Command::new(env!("CARGO_BIN_EXE_rtrun"))
        .args(["memory", "--session", "00000000deadbeef"])
        .output()
        .expect("rtrun runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no running session `00000000deadbeef`"), "{stderr}");
}

#[test]
fn help_lists_the_memory_command() {
    let output = Command::new(env!("CARGO_BIN_EXE_rtrun")).arg("--help").output().expect("runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success() && stdout.contains("memory"), "{stdout}");
}
